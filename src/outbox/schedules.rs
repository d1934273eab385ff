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

#[cfg(feature = "postgres")]
use super::schedule::ScheduleRecord;
use super::schedule::{Missed, Schedule, When, due_slots, slot_key};
use super::types::{NewEntry, check_field};
use super::{Outbox, ops};
use crate::codec::{decode, encode, from_micros, micros};
use crate::error::{Error, Result};
use crate::schema::{OUTBOX_SCHEDULE_DUE, OUTBOX_SCHEDULES, open_read, open_write};

/// The schedules' table, as errors name it.
const TABLE: &str = "idemstore.v1.outbox.schedules";

/// Longest schedule name accepted, in bytes (its entries' keys carry it).
pub const MAX_SCHEDULE_NAME_LEN: usize = 512;

/// A stored schedule.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    destination: String,
    payload: Vec<u8>,
    when: When,
    missed: Missed,
    paused: bool,
    /// The last slot dealt with (µs): the slots up to it are done. `None`
    /// until the schedule starts (the first firing that sees it, which
    /// stores its `now` here).
    after: Option<i64>,
    /// The latest slot whose entry was enqueued (µs).
    last_fired: Option<i64>,
}

/// A schedule as [`Outbox::schedules`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScheduleInfo {
    /// Its name.
    pub name: String,
    /// The destination of its entries.
    pub destination: String,
    /// Its cron expression, or `every <interval>`.
    pub spec: String,
    /// What a firing does with missed slots.
    pub missed: Missed,
    /// Whether it is paused.
    pub paused: bool,
    /// The next slot it will deal with (fire, or drop by its [`Missed`]
    /// policy); `None` until it starts (the first firing that sees it: see
    /// [`Outbox::set_schedule`]), or if it has no slot left.
    pub next_slot: Option<DateTime<Utc>>,
    /// The latest slot whose entry it enqueued.
    pub last_fired: Option<DateTime<Utc>>,
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::invalid("schedule", "a schedule needs a name"));
    }
    if name.len() > MAX_SCHEDULE_NAME_LEN {
        return Err(Error::invalid(
            "schedule",
            format!(
                "the name is {} bytes, over {MAX_SCHEDULE_NAME_LEN}",
                name.len()
            ),
        ));
    }
    Ok(())
}

fn read(bytes: &[u8], name: &str) -> Result<Record> {
    decode(TABLE, &name, bytes)
}

/// The due index's key of `record`: its next slot, or `i64::MIN` until it
/// starts (due at once, for the firing that starts it); `None` while paused
/// or with no slot left.
fn due_key(record: &Record) -> Result<Option<i64>> {
    if record.paused {
        return Ok(None);
    }
    match record.after {
        None => Ok(Some(i64::MIN)),
        Some(after) => record.when.next_after(after),
    }
}

/// Writes `record` under `name`, moving its due index entry from `old`.
fn put(tx: &WriteTransaction, name: &str, record: &Record, old: Option<&Record>) -> Result<()> {
    let mut due = open_write(tx, OUTBOX_SCHEDULE_DUE)?;
    if let Some(old) = old
        && let Some(at) = due_key(old)?
    {
        due.remove((at, name))?;
    }
    if let Some(at) = due_key(record)? {
        due.insert((at, name), ())?;
    }
    open_write(tx, OUTBOX_SCHEDULES)?.insert(name, encode(record).as_slice())?;
    Ok(())
}

fn get(tx: &WriteTransaction, name: &str) -> Result<Option<Record>> {
    let table = open_write(tx, OUTBOX_SCHEDULES)?;
    let record = table.get(name)?;
    record.map(|r| read(r.value(), name)).transpose()
}

fn info(name: &str, r: &Record) -> Result<ScheduleInfo> {
    let at = |us: i64| from_micros(TABLE, &name, us);
    let next_slot = match r.after {
        Some(after) => r.when.next_after(after)?.map(at).transpose()?,
        None => None,
    };
    Ok(ScheduleInfo {
        name: name.to_owned(),
        destination: r.destination.clone(),
        spec: r.when.spec(),
        missed: r.missed,
        paused: r.paused,
        next_slot,
        last_fired: r.last_fired.map(at).transpose()?,
    })
}

/// Every schedule, by name.
pub(super) fn list(tx: &ReadTransaction) -> Result<Vec<ScheduleInfo>> {
    let Some(table) = open_read(tx, OUTBOX_SCHEDULES)? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for row in table.iter()? {
        let (name, bytes) = row?;
        out.push(info(name.value(), &read(bytes.value(), name.value())?)?);
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

/// Fires every schedule due at `now`: enqueues the entries of its due
/// slots (by its [`Missed`] policy) and moves it past them. The number of
/// entries enqueued.
pub(super) fn fire(tx: &WriteTransaction, now: i64) -> Result<u64> {
    let due: Vec<(i64, String)> = {
        let table = open_write(tx, OUTBOX_SCHEDULE_DUE)?;
        let mut out = Vec::new();
        for row in table.range(..=(now, "\u{10ffff}"))? {
            let (k, _) = row?;
            let (at, name) = k.value();
            out.push((at, name.to_owned()));
        }
        out
    };
    let mut enqueued = 0;
    for (_, name) in due {
        let Some(old) = get(tx, &name)? else {
            continue;
        };
        let mut record = old.clone();
        let Some(after) = old.after else {
            // It starts now: the slots up to now are before its time.
            record.after = Some(now);
            put(tx, &name, &record, Some(&old))?;
            continue;
        };
        let (slots, last) = due_slots(&old.when, old.missed, after, now)?;
        let entries: Vec<NewEntry> = slots
            .iter()
            .map(|slot| {
                NewEntry::new(
                    format!("schedule:{name}"),
                    old.destination.clone(),
                    slot_key(&name, *slot),
                    old.payload.clone(),
                )
            })
            .collect();
        if !entries.is_empty() {
            let out = ops::enqueue(tx, &entries, now)?;
            enqueued += out.iter().filter(|e| e.is_new()).count() as u64;
            record.last_fired = slots.last().copied().or(old.last_fired);
        }
        record.after = Some(last);
        put(tx, &name, &record, Some(&old))?;
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
    /// name or one over [`MAX_SCHEDULE_NAME_LEN`] bytes, or a bad
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
        check_name(name)?;
        check_field("destination", &schedule.destination)?;
        self.check_entry(&NewEntry::new(
            format!("schedule:{name}"),
            schedule.destination.clone(),
            slot_key(name, i64::MIN),
            schedule.payload.clone(),
        ))?;
        let name = name.to_owned();
        self.engine.execute(move |tx| {
            let old = get(tx, &name)?;
            let record = Record {
                destination: schedule.destination.clone(),
                payload: schedule.payload.clone(),
                when: schedule.when.clone(),
                missed: schedule.missed,
                paused: old.as_ref().is_some_and(|o| o.paused),
                after: old.as_ref().map_or(start, |o| o.after.or(start)),
                last_fired: old.as_ref().and_then(|o| o.last_fired),
            };
            put(tx, &name, &record, old.as_ref())
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
            if let Some(at) = due_key(&old)? {
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
            put(tx, &name, &record, Some(&old))
        })
    }

    /// Every schedule, by name, with its next slot and the last one fired.
    pub fn schedules(&self) -> Result<Vec<ScheduleInfo>> {
        self.engine.read(list)
    }

    /// Every schedule whole, with its state, by name (for `migrate`).
    #[cfg(feature = "postgres")]
    pub(crate) fn schedule_records(&self) -> Result<Vec<ScheduleRecord>> {
        self.engine.read(|tx| {
            let Some(table) = open_read(tx, OUTBOX_SCHEDULES)? else {
                return Ok(Vec::new());
            };
            let mut out = Vec::new();
            for row in table.iter()? {
                let (name, bytes) = row?;
                let r = read(bytes.value(), name.value())?;
                out.push(ScheduleRecord {
                    name: name.value().to_owned(),
                    schedule: Schedule {
                        destination: r.destination,
                        payload: r.payload,
                        when: r.when,
                        missed: r.missed,
                    },
                    paused: r.paused,
                    after: r.after,
                    last_fired: r.last_fired,
                });
            }
            Ok(out)
        })
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
        slot_time(self.engine.read(next_slot)?)
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
        Box::pin(async move { slot_time(self.engine.read_async(next_slot).await?) })
    }
}

/// The time of a due index key: a schedule not started yet is due at the
/// earliest time there is.
fn slot_time(at: Option<i64>) -> Result<Option<DateTime<Utc>>> {
    match at {
        None => Ok(None),
        // Not started yet: due at once.
        Some(i64::MIN) => Ok(Some(DateTime::<Utc>::MIN_UTC)),
        Some(at) => from_micros(TABLE, &"next slot", at).map(Some),
    }
}
