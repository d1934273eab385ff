//! The schedules of [`Outbox`]: stored in two tables (a record per name,
//! and the due index `(next slot, name)` of the unpaused ones), and fired
//! in one write transaction that enqueues each due slot's entry and moves
//! the schedule past it.
//!
//! # Exactly once per slot
//!
//! A slot's entry has the key `idemstore:schedule:<name>:<slot>` (see
//! [`SLOT_KEY_PREFIX`]) and is enqueued in the transaction that records the
//! slot as dealt with. Firings take redb's one writer one after the other
//! (in every process on the file), each reads the schedule as the last one
//! left it, and an entry's `(destination, key)` is unique: however many
//! dispatchers fire, a slot yields one entry, and a firing that did not
//! commit enqueued nothing and moved nothing.

use chrono::{DateTime, Utc};
use redb::{ReadTransaction, ReadableTable, WriteTransaction};
use serde::{Deserialize, Serialize};

use super::schedule::{
    Missed, Schedule, ScheduleInfo, ScheduleRecord, When, check, check_name, slot_time,
};
use super::{Outbox, ops};
use crate::codec::{decode, encode, micros};
use crate::error::{Error, Result};
use crate::schema::{OUTBOX_SCHEDULE_DUE, OUTBOX_SCHEDULES, open_read, open_write};

/// The schedules' table, as errors name it.
const TABLE: &str = "idemstore.v1.outbox.schedules";

/// A stored schedule: a [`ScheduleRecord`] but its name, which is the key.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    destination: String,
    payload: Vec<u8>,
    when: When,
    missed: Missed,
    paused: bool,
    after: Option<i64>,
    last_fired: Option<i64>,
}

fn read(bytes: &[u8], name: &str) -> Result<ScheduleRecord> {
    let r: Record = decode(TABLE, &name, bytes)?;
    Ok(ScheduleRecord {
        name: name.to_owned(),
        schedule: Schedule {
            destination: r.destination,
            payload: r.payload,
            when: r.when,
            missed: r.missed,
        },
        paused: r.paused,
        after: r.after,
        last_fired: r.last_fired,
    })
}

/// Writes `record`, moving its due index entry from where `old` had it.
fn put(tx: &WriteTransaction, record: &ScheduleRecord, old: Option<&ScheduleRecord>) -> Result<()> {
    let name = record.name.as_str();
    let mut due = open_write(tx, OUTBOX_SCHEDULE_DUE)?;
    if let Some(at) = old.map(ScheduleRecord::due_key).transpose()?.flatten() {
        due.remove((at, name))?;
    }
    if let Some(at) = record.due_key()? {
        due.insert((at, name), ())?;
    }
    let stored = Record {
        destination: record.schedule.destination.clone(),
        payload: record.schedule.payload.clone(),
        when: record.schedule.when.clone(),
        missed: record.schedule.missed,
        paused: record.paused,
        after: record.after,
        last_fired: record.last_fired,
    };
    open_write(tx, OUTBOX_SCHEDULES)?.insert(name, encode(&stored).as_slice())?;
    Ok(())
}

fn get(tx: &WriteTransaction, name: &str) -> Result<Option<ScheduleRecord>> {
    let table = open_write(tx, OUTBOX_SCHEDULES)?;
    let record = table.get(name)?;
    record.map(|r| read(r.value(), name)).transpose()
}

/// Every schedule whole, by name.
fn records(tx: &ReadTransaction) -> Result<Vec<ScheduleRecord>> {
    let Some(table) = open_read(tx, OUTBOX_SCHEDULES)? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for row in table.iter()? {
        let (name, bytes) = row?;
        out.push(read(bytes.value(), name.value())?);
    }
    Ok(out)
}

/// The earliest next slot of an unpaused schedule (`i64::MIN` for one
/// not started yet); `None` if there is none.
pub(super) fn next_slot(tx: &ReadTransaction) -> Result<Option<i64>> {
    let Some(due) = open_read(tx, OUTBOX_SCHEDULE_DUE)? else {
        return Ok(None);
    };
    Ok(due.first()?.map(|(k, _)| k.value().0))
}

/// Fires every schedule due at `now` (see [`ScheduleRecord::fire`]): the
/// number of entries enqueued.
pub(super) fn fire(tx: &WriteTransaction, now: i64) -> Result<u64> {
    let due: Vec<String> = {
        let table = open_write(tx, OUTBOX_SCHEDULE_DUE)?;
        let mut out = Vec::new();
        // Every key whose slot is at most `now`, whatever its name.
        for row in table.range(..(now.saturating_add(1), ""))? {
            out.push(row?.0.value().1.to_owned());
        }
        out
    };
    let mut enqueued = 0;
    for name in due {
        let Some(old) = get(tx, &name)? else {
            continue;
        };
        let mut record = old.clone();
        let entries = record.fire(now)?;
        if !entries.is_empty() {
            let out = ops::enqueue(tx, &entries, now)?;
            enqueued += out.iter().filter(|e| e.is_new()).count() as u64;
        }
        put(tx, &record, Some(&old))?;
    }
    Ok(enqueued)
}

impl Outbox {
    /// Stores `schedule` under `name`, replacing the one of that name: the
    /// dispatchers enqueue one entry per slot of it, each with the
    /// schedule's destination and payload and the key
    /// `idemstore:schedule:<name>:<slot>` (read the slot back with
    /// [`OutboxEntry::slot`](super::OutboxEntry::slot)).
    ///
    /// Setting a schedule reads no clock: a new schedule starts at the
    /// `now` of the first firing that sees it (a running dispatcher's, by
    /// its clock, at once: setting it wakes them; or
    /// [`Outbox::fire_schedules`], or the `testing` drain), and the slots up
    /// to its start never fire. From then on no slot is skipped but by its
    /// [`Missed`] policy, and none fires twice: a replaced schedule keeps
    /// its start and the slots it dealt with. Durable, and seen by every
    /// process on the file. Fails with [`Error::InvalidInput`] for an empty
    /// name or one over [`MAX_SCHEDULE_NAME_LEN`](super::MAX_SCHEDULE_NAME_LEN) bytes, or a bad
    /// destination or payload, storing nothing.
    pub fn set_schedule(&self, name: &str, schedule: Schedule) -> Result<()> {
        self.put_schedule(name, schedule, None)
    }

    /// [`Outbox::set_schedule`], a new schedule started at `now` (a
    /// replaced one keeps its start): its first slot is the first after
    /// `now`, whoever fires it.
    pub fn set_schedule_at(
        &self,
        name: &str,
        schedule: Schedule,
        now: DateTime<Utc>,
    ) -> Result<()> {
        self.put_schedule(name, schedule, Some(micros(now)))
    }

    fn put_schedule(&self, name: &str, schedule: Schedule, start: Option<i64>) -> Result<()> {
        check(name, &schedule, self.max_body)?;
        let name = name.to_owned();
        self.engine.execute(move |tx| {
            let old = get(tx, &name)?;
            let record = ScheduleRecord::set(&name, schedule.clone(), start, old.as_ref());
            put(tx, &record, old.as_ref())
        })?;
        // The dispatchers look at it now.
        self.notify();
        Ok(())
    }

    /// Removes the schedule `name`, if there is one (the entries it
    /// enqueued stay). Removing a schedule that is not there changes
    /// nothing.
    pub fn remove_schedule(&self, name: &str) -> Result<()> {
        check_name(name)?;
        let name = name.to_owned();
        self.engine.execute(move |tx| {
            let Some(old) = get(tx, &name)? else {
                return Ok(());
            };
            if let Some(at) = old.due_key()? {
                open_write(tx, OUTBOX_SCHEDULE_DUE)?.remove((at, name.as_str()))?;
            }
            open_write(tx, OUTBOX_SCHEDULES)?.remove(name.as_str())?;
            Ok(())
        })
    }

    /// Pauses the schedule `name`: it fires nothing until
    /// [`resume_schedule`](Outbox::resume_schedule), which deals with the
    /// slots that passed meanwhile by its [`Missed`] policy. Fails with
    /// [`Error::NotFound`] if there is no such schedule.
    pub fn pause_schedule(&self, name: &str) -> Result<()> {
        self.set_paused(name, true)
    }

    /// Lets a paused schedule fire again. Fails with [`Error::NotFound`] if
    /// there is no such schedule.
    pub fn resume_schedule(&self, name: &str) -> Result<()> {
        self.set_paused(name, false)?;
        self.notify();
        Ok(())
    }

    fn set_paused(&self, name: &str, paused: bool) -> Result<()> {
        check_name(name)?;
        let name = name.to_owned();
        self.engine.execute(move |tx| {
            let Some(old) = get(tx, &name)? else {
                return Err(Error::NotFound);
            };
            let mut record = old.clone();
            record.paused = paused;
            put(tx, &record, Some(&old))
        })
    }

    /// Every schedule, by name, with its next slot and the last one fired.
    pub fn schedules(&self) -> Result<Vec<ScheduleInfo>> {
        self.engine
            .read(records)?
            .iter()
            .map(|r| r.info(TABLE))
            .collect()
    }

    /// Every schedule whole, with its state, by name (for `migrate`).
    #[cfg(feature = "postgres")]
    pub(crate) fn schedule_records(&self) -> Result<Vec<ScheduleRecord>> {
        self.engine.read(records)
    }

    /// Fires the schedules due at `now` (see [`Outbox::set_schedule`]): the
    /// number of entries enqueued. The dispatchers call it; call it
    /// yourself to fire schedules without one.
    pub fn fire_schedules(&self, now: DateTime<Utc>) -> Result<u64> {
        let now = micros(now);
        if self.engine.read(next_slot)?.is_none_or(|at| at > now) {
            return Ok(0);
        }
        let n = self.engine.execute(move |tx| fire(tx, now))?;
        if n > 0 {
            self.notify();
        }
        Ok(n)
    }

    /// When the next schedule is due (possibly in the past: a firing is
    /// waiting), or `None` if no unpaused schedule has a slot left.
    pub fn next_schedule_slot(&self) -> Result<Option<DateTime<Utc>>> {
        slot_time(TABLE, self.engine.read(next_slot)?)
    }

    /// [`Outbox::fire_schedules`] for the async dispatcher, boxed for the
    /// backend trait.
    #[cfg(feature = "tokio")]
    pub(crate) fn fire_schedules_boxed(
        &self,
        now: DateTime<Utc>,
    ) -> super::tasks::Boxed<'_, Result<u64>> {
        Box::pin(async move {
            let now = micros(now);
            if self
                .engine
                .read_async(next_slot)
                .await?
                .is_none_or(|at| at > now)
            {
                return Ok(0);
            }
            let n = self.engine.execute_async(move |tx| fire(tx, now)).await?;
            if n > 0 {
                self.notify();
            }
            Ok(n)
        })
    }

    /// [`Outbox::next_schedule_slot`] for the async dispatcher, boxed.
    #[cfg(feature = "tokio")]
    pub(crate) fn next_schedule_slot_boxed(
        &self,
    ) -> super::tasks::Boxed<'_, Result<Option<DateTime<Utc>>>> {
        Box::pin(async move { slot_time(TABLE, self.engine.read_async(next_slot).await?) })
    }
}
