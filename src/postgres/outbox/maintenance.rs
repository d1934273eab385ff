//! The reaper's and the janitor's calls on [`PgOutbox`]: each walks a
//! partial index in chunks, one transaction per chunk,
//! so that a large backlog never holds thousands of row locks, or the
//! server's resources, in one transaction.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

use super::flows::{FlowEvent, Touched};
use super::{PgOutbox, TABLE};
use crate::codec::micros;
use crate::error::Result;
use crate::outbox::rules::Change;
use crate::outbox::{MAINTENANCE_CHUNK, OutboxId, OutboxStatus};
use crate::postgres::blocking::wait;
use crate::postgres::conn::{Db, Mode, in_transaction};
use crate::postgres::errors::{unsigned, utf8};
use crate::postgres::{refuse_reentrant, run};

/// [`MAINTENANCE_CHUNK`] as a statement parameter.
fn chunk() -> i64 {
    i64::try_from(MAINTENANCE_CHUNK).unwrap_or(i64::MAX)
}

impl PgOutbox {
    /// Moves every `Dispatching` entry claimed strictly before
    /// `claimed_before` back to `Pending`, due at its claim time (the reaper
    /// for crashed dispatchers, in any process), and returns their ids,
    /// oldest claim first. An entry being settled at that moment (its row
    /// locked) is left to its settlement. Walks the partial claims index:
    /// costs what it releases.
    ///
    /// Commits in chunks of at most 1024 entries, oldest claim first, each
    /// its own transaction (with what it tells the destinations: a released
    /// probe ends): dispatchers are woken as
    /// each chunk commits, and a reader may see part of the release done. A
    /// lost connection or an `Err` midway leaves the chunks committed
    /// before it released (and the rest claimed, for the next call).
    pub fn release_expired_claims(&self, claimed_before: DateTime<Utc>) -> Result<Vec<OutboxId>> {
        wait(self.release_expired_claims_async(claimed_before))
    }

    /// [`PgOutbox::release_expired_claims`], awaited. Dropped midway, the
    /// chunks committed before stay released.
    pub async fn release_expired_claims_async(
        &self,
        claimed_before: DateTime<Utc>,
    ) -> Result<Vec<OutboxId>> {
        refuse_reentrant()?;
        let s = self.s();
        let sql = format!(
            "UPDATE {s}.outbox SET status = 'pending', next_attempt_at = claimed_at, \
             worker_id = NULL, claimed_at = NULL \
             WHERE id IN (SELECT id FROM {s}.outbox \
                 WHERE status = 'dispatching' AND claimed_at < $1 \
                 ORDER BY claimed_at, id LIMIT $2 FOR UPDATE SKIP LOCKED) \
             RETURNING id, next_attempt_at, destination"
        );
        let (cutoff, chunk) = (micros(claimed_before), chunk());
        let mut released = Vec::new();
        loop {
            // With what it tells the destinations (a released probe ends):
            // one transaction per chunk.
            let rows = run!(self.server, Mode::Tx, |conn| {
                in_transaction!(conn, |db| self.release_chunk(db, &sql, cutoff, chunk).await)
            })?;
            for r in &rows {
                let id: u64 = unsigned(TABLE, &"?", "id", r.try_get(0)?)?;
                let at: Option<i64> = r.try_get(1)?;
                released.push((at, OutboxId(id)));
            }
            if !rows.is_empty() {
                self.notify();
            }
            if rows.len() < MAINTENANCE_CHUNK {
                break;
            }
        }
        released.sort_unstable();
        Ok(released.into_iter().map(|(_, id)| id).collect())
    }

    /// One chunk of [`PgOutbox::release_expired_claims`] in `db`'s
    /// transaction (`sql` its statement): the rows released, with what it
    /// tells their destinations.
    async fn release_chunk(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        sql: &str,
        cutoff: i64,
        chunk: i64,
    ) -> Result<Vec<tokio_postgres::Row>> {
        let rows = db.query(sql, &[&cutoff, &chunk]).await?;
        let mut touched = Touched::default();
        for r in &rows {
            let id: u64 = unsigned(TABLE, &"?", "id", r.try_get(0)?)?;
            let dest = utf8(TABLE, &id, r.try_get(2)?)?;
            touched.events.push((
                dest,
                FlowEvent::Settled {
                    id,
                    signal: Change::Released.signal(OutboxStatus::Dispatching),
                    at: Change::Released.time(),
                },
            ));
        }
        self.settle_flows(db, &touched).await?;
        Ok(rows)
    }

    /// Deletes `Completed` and `Failed` entries whose `completed_at` is
    /// strictly before `finished_before`, with their attempt history; returns how
    /// many. Walks the partial finished index: costs what it removes. A
    /// purged entry's `(destination, idempotency_key)` can be enqueued
    /// again.
    ///
    /// Commits in chunks of at most 1024 entries, earliest finished first,
    /// each its own transaction (a destination left with no entry, no
    /// policy, no pause and no hold loses its flow row); an entry whose row is
    /// locked at that moment (an operator's requeue, a repeated settlement)
    /// is left for the next purge. A reader may see part of the purge done;
    /// a lost connection or an `Err` midway leaves the chunks committed
    /// before it purged, the rest for the next purge.
    pub fn purge_finished(&self, finished_before: DateTime<Utc>) -> Result<u64> {
        wait(self.purge_finished_async(finished_before))
    }

    /// [`PgOutbox::purge_finished`], awaited. Dropped midway, the chunks
    /// committed before stay purged.
    pub async fn purge_finished_async(&self, finished_before: DateTime<Utc>) -> Result<u64> {
        refuse_reentrant()?;
        let s = self.s();
        let sql = format!(
            "DELETE FROM {s}.outbox WHERE id IN (SELECT id FROM {s}.outbox \
                 WHERE status IN ('completed', 'failed') AND completed_at < $1 \
                 ORDER BY completed_at, id LIMIT $2 FOR UPDATE SKIP LOCKED) \
             RETURNING destination"
        );
        let (cutoff, chunk) = (micros(finished_before), chunk());
        let mut total = 0;
        loop {
            // A destination left with no entry and nothing else to keep
            // loses its flow row, as in the embedded store.
            let n = run!(self.server, Mode::Tx, |conn| {
                in_transaction!(conn, |db| self.purge_chunk(db, &sql, cutoff, chunk).await)
            })?;
            total += n;
            if n < MAINTENANCE_CHUNK as u64 {
                return Ok(total);
            }
        }
    }

    /// One chunk of [`PgOutbox::purge_finished`] in `db`'s transaction
    /// (`sql` its statement): how many it deleted.
    async fn purge_chunk(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        sql: &str,
        cutoff: i64,
        chunk: i64,
    ) -> Result<u64> {
        let rows = db.query(sql, &[&cutoff, &chunk]).await?;
        let mut dests: Vec<Vec<u8>> = rows
            .iter()
            .map(|r| r.try_get(0))
            .collect::<std::result::Result<_, _>>()?;
        dests.sort_unstable();
        dests.dedup();
        let dests: Vec<&[u8]> = dests.iter().map(Vec::as_slice).collect();
        self.drop_idle_flows(db, &dests).await?;
        Ok(rows.len() as u64)
    }
}
