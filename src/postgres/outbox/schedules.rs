//! [`PgOutbox`]'s schedules: the embedded store's rules (the same slots,
//! keys and missed-slot policies, from `outbox::schedule`) on the
//! `S.schedules` table.
//!
//! A firing locks the due schedules' rows (`FOR UPDATE SKIP LOCKED`: a
//! schedule another firing holds is left to it), enqueues each due slot's
//! entry (`ON CONFLICT (destination, idempotency_key) DO NOTHING`) and
//! moves the schedule past it, in one transaction: however many
//! dispatchers fire, on however many machines, a slot yields one entry.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;
use tokio_postgres::Row;

use super::PgOutbox;
use crate::codec::micros;
use crate::error::{Error, Result};
use crate::outbox::schedule::{ScheduleRecord, When, check, check_name, slot_time};
use crate::outbox::{Missed, Schedule, ScheduleInfo};
use crate::postgres::blocking::wait;
use crate::postgres::conn::{Db, Mode, in_transaction};
use crate::postgres::errors::{corrupted, utf8};
use crate::postgres::{refuse_reentrant, run, schema};

const TABLE: &str = "schedules";

/// The columns a schedule is read by.
const COLS: &str = "name, destination, payload, cron, every_us, missed, paused, after_us, \
                    last_fired, time_zone";

fn missed_text(m: Missed) -> &'static str {
    match m {
        Missed::Latest => "latest",
        Missed::All => "all",
        Missed::None => "none",
    }
}

fn read(r: &Row) -> Result<ScheduleRecord> {
    let name = utf8(TABLE, &"?", r.try_get(0)?)?;
    let cron: Option<String> = r.try_get(3)?;
    let every: Option<i64> = r.try_get(4)?;
    let zone: Option<String> = r.try_get(9)?;
    let when = match (cron, every) {
        (Some(expr), None) => match zone {
            Some(zone) => When::CronIn(expr, zone),
            None => When::Cron(expr),
        },
        (None, Some(us)) if us > 0 => When::Every(us.unsigned_abs()),
        _ => return Err(corrupted(TABLE, &name, "neither a cron nor an interval")),
    };
    let missed = match r.try_get::<_, &str>(5)? {
        "latest" => Missed::Latest,
        "all" => Missed::All,
        "none" => Missed::None,
        other => {
            return Err(corrupted(
                TABLE,
                &name,
                format!("missed-slot policy {other:?}"),
            ));
        }
    };
    Ok(ScheduleRecord {
        schedule: Schedule {
            destination: utf8(TABLE, &name, r.try_get(1)?)?,
            payload: r.try_get(2)?,
            when,
            missed,
        },
        paused: r.try_get(6)?,
        after: r.try_get(7)?,
        last_fired: r.try_get(8)?,
        name,
    })
}

impl PgOutbox {
    /// [`Outbox::set_schedule`](crate::Outbox::set_schedule) on the server:
    /// the same rules; the dispatchers of every process are woken.
    pub fn set_schedule(&self, name: &str, schedule: Schedule) -> Result<()> {
        wait(self.set_schedule_async(name, schedule))
    }

    /// [`PgOutbox::set_schedule`], awaited.
    pub async fn set_schedule_async(&self, name: &str, schedule: Schedule) -> Result<()> {
        self.put_schedule(name, schedule, None).await
    }

    /// [`Outbox::set_schedule_at`](crate::Outbox::set_schedule_at) on the
    /// server.
    pub fn set_schedule_at(
        &self,
        name: &str,
        schedule: Schedule,
        now: DateTime<Utc>,
    ) -> Result<()> {
        wait(self.put_schedule(name, schedule, Some(micros(now))))
    }

    async fn put_schedule(&self, name: &str, schedule: Schedule, start: Option<i64>) -> Result<()> {
        check(name, &schedule, self.server.max_body)?;
        refuse_reentrant()?;
        let s = self.s().to_owned();
        run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |db| {
                let old = self.lock_schedule(db, name).await?;
                let record = ScheduleRecord::set(name, schedule.clone(), start, old.as_ref());
                self.write_schedule(db, &record).await?;
                db.execute("SELECT pg_notify($1, '')", &[&schema::channel(&s)])
                    .await?;
                Ok(())
            })
        })
    }

    /// [`Outbox::remove_schedule`](crate::Outbox::remove_schedule) on the
    /// server.
    pub fn remove_schedule(&self, name: &str) -> Result<()> {
        wait(self.remove_schedule_async(name))
    }

    /// [`PgOutbox::remove_schedule`], awaited.
    pub async fn remove_schedule_async(&self, name: &str) -> Result<()> {
        check_name(name)?;
        refuse_reentrant()?;
        let s = self.s();
        run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |db| {
                db.execute(
                    &format!("DELETE FROM {s}.schedules WHERE name = $1"),
                    &[&name.as_bytes()],
                )
                .await?;
                Ok(())
            })
        })
    }

    /// [`Outbox::pause_schedule`](crate::Outbox::pause_schedule) on the
    /// server.
    pub fn pause_schedule(&self, name: &str) -> Result<()> {
        wait(self.set_paused(name, true))
    }

    /// [`Outbox::resume_schedule`](crate::Outbox::resume_schedule) on the
    /// server.
    pub fn resume_schedule(&self, name: &str) -> Result<()> {
        wait(self.set_paused(name, false))
    }

    async fn set_paused(&self, name: &str, paused: bool) -> Result<()> {
        check_name(name)?;
        refuse_reentrant()?;
        let s = self.s().to_owned();
        run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |db| {
                let Some(mut stored) = self.lock_schedule(db, name).await? else {
                    return Err(Error::NotFound);
                };
                stored.paused = paused;
                self.write_schedule(db, &stored).await?;
                if !paused {
                    db.execute("SELECT pg_notify($1, '')", &[&schema::channel(&s)])
                        .await?;
                }
                Ok(())
            })
        })
    }

    /// [`Outbox::schedules`](crate::Outbox::schedules) on the server.
    pub fn schedules(&self) -> Result<Vec<ScheduleInfo>> {
        wait(self.schedules_async())
    }

    /// [`PgOutbox::schedules`], awaited.
    pub async fn schedules_async(&self) -> Result<Vec<ScheduleInfo>> {
        let s = self.s();
        let rows = run!(self.server, Mode::Read, |conn| {
            conn.db()
                .query(
                    &format!("SELECT {COLS} FROM {s}.schedules ORDER BY name"),
                    &[],
                )
                .await
        })?;
        rows.iter().map(|r| read(r)?.info(TABLE)).collect()
    }

    /// [`Outbox::fire_schedules`](crate::Outbox::fire_schedules) on the
    /// server: the number of entries enqueued.
    pub fn fire_schedules(&self, now: DateTime<Utc>) -> Result<u64> {
        wait(self.fire_schedules_async(now))
    }

    /// [`PgOutbox::fire_schedules`], awaited.
    pub async fn fire_schedules_async(&self, now: DateTime<Utc>) -> Result<u64> {
        refuse_reentrant()?;
        let now = micros(now);
        if self.next_slot_micros().await?.is_none_or(|at| at > now) {
            return Ok(0);
        }
        let s = self.s();
        run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |db| {
                let rows = db
                    .query(
                        &format!(
                            "SELECT {COLS} FROM {s}.schedules WHERE next_slot <= $1 \
                             ORDER BY next_slot, name FOR UPDATE SKIP LOCKED"
                        ),
                        &[&now],
                    )
                    .await?;
                let mut enqueued = 0;
                for r in &rows {
                    let mut record = read(r)?;
                    for entry in record.fire(now)? {
                        if self.insert(db, &entry, now).await?.is_new() {
                            enqueued += 1;
                        }
                    }
                    self.write_schedule(db, &record).await?;
                }
                Ok(enqueued)
            })
        })
    }

    /// [`Outbox::next_schedule_slot`](crate::Outbox::next_schedule_slot)
    /// on the server.
    pub fn next_schedule_slot(&self) -> Result<Option<DateTime<Utc>>> {
        wait(self.next_schedule_slot_async())
    }

    /// [`PgOutbox::next_schedule_slot`], awaited.
    pub async fn next_schedule_slot_async(&self) -> Result<Option<DateTime<Utc>>> {
        slot_time(TABLE, self.next_slot_micros().await?)
    }

    async fn next_slot_micros(&self) -> Result<Option<i64>> {
        let s = self.s();
        let row = run!(self.server, Mode::Read, |conn| {
            conn.db()
                .query_one(&format!("SELECT min(next_slot) FROM {s}.schedules"), &[])
                .await
        })?;
        Ok(row.try_get(0)?)
    }

    /// The dispatcher's firing, boxed for the backend trait.
    pub(crate) fn fire_schedules_boxed(
        &self,
        now: DateTime<Utc>,
    ) -> crate::backend::BoxFuture<'_, Result<u64>> {
        Box::pin(self.fire_schedules_async(now))
    }

    /// The dispatcher's look at the next slot, boxed for the backend trait.
    pub(crate) fn next_schedule_slot_boxed(
        &self,
    ) -> crate::backend::BoxFuture<'_, Result<Option<DateTime<Utc>>>> {
        Box::pin(self.next_schedule_slot_async())
    }

    /// Copies `records` (a store file's schedules, with their state) into
    /// the server's table, keeping a schedule already there under the same
    /// name: the number copied. One transaction.
    pub(crate) fn import_schedules(&self, records: &[ScheduleRecord]) -> Result<u64> {
        wait(async {
            refuse_reentrant()?;
            let s = self.s();
            run!(self.server, Mode::Tx, |conn| {
                in_transaction!(conn, |db| {
                    let mut copied = 0;
                    for r in records {
                        if self.lock_schedule(db, &r.name).await?.is_some() {
                            continue;
                        }
                        self.write_schedule(db, r).await?;
                        copied += 1;
                    }
                    if copied > 0 {
                        db.execute("SELECT pg_notify($1, '')", &[&schema::channel(s)])
                            .await?;
                    }
                    Ok(copied)
                })
            })
        })
    }

    /// The schedule `name`, its row locked for this transaction.
    async fn lock_schedule(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        name: &str,
    ) -> Result<Option<ScheduleRecord>> {
        let s = self.s();
        let row = db
            .query_opt(
                &format!("SELECT {COLS} FROM {s}.schedules WHERE name = $1 FOR UPDATE"),
                &[&name.as_bytes()],
            )
            .await?;
        row.as_ref().map(read).transpose()
    }

    async fn write_schedule(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        st: &ScheduleRecord,
    ) -> Result<()> {
        let s = self.s();
        let (cron, zone, every): (Option<&str>, Option<&str>, Option<i64>) = match &st.schedule.when
        {
            When::Cron(expr) => (Some(expr.as_str()), None, None),
            When::CronIn(expr, zone) => (Some(expr.as_str()), Some(zone.as_str()), None),
            When::Every(us) => (None, None, Some(i64::try_from(*us).unwrap_or(i64::MAX))),
        };
        db.execute(
            &format!(
                "INSERT INTO {s}.schedules (name, destination, payload, cron, every_us, missed, \
                 paused, after_us, last_fired, next_slot, time_zone) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) \
                 ON CONFLICT (name) DO UPDATE SET destination = $2, payload = $3, cron = $4, \
                 every_us = $5, missed = $6, paused = $7, after_us = $8, last_fired = $9, \
                 next_slot = $10, time_zone = $11"
            ),
            &[
                &st.name.as_bytes(),
                &st.schedule.destination.as_bytes(),
                &st.schedule.payload,
                &cron,
                &every,
                &missed_text(st.schedule.missed),
                &st.paused,
                &st.after,
                &st.last_fired,
                &st.due_key()?,
                &zone,
            ],
        )
        .await?;
        Ok(())
    }
}
