//! [`PgOutbox`]: the outbox in `S.outbox` and `S.outbox_attempts`.
//!
//! Most status changes go through the outbox's status machine, the pure
//! rules both backends share (`src/outbox/rules.rs`, which knows nothing of
//! either backend's storage): the row is read `FOR UPDATE` as the rules'
//! value, the same function the embedded store calls decides (the new
//! row, an accepted no-op, or a `Conflict`), and the new row and the
//! attempt record it calls for are written back in the same transaction.
//! Three changes run as statements whose SQL is that function's cell,
//! because dispatchers and reapers make them all the time or to many rows
//! at once:
//!
//! - a claim (`Pending → Dispatching`, `claim_due`);
//! - a completion (`Dispatching` or `OutcomeUnknown → Completed`): one
//!   entry's (`settle`, `mark_completed`), or a batch's in one statement
//!   (`settle_many`, `settle_and_claim`, when the ids are distinct); a
//!   completion the statement does not apply — a stale fence, a repeat, an
//!   unknown id — takes the general path for its answer;
//! - the reaper's release (`Dispatching → Pending`, due at the claim time,
//!   `release_expired_claims`).
//!
//! The statements (`S` is the store's schema, times µs):
//!
//! | call | SQL |
//! |------|-----|
//! | `enqueue`, `enqueue_in`, `enqueue_many` | `INSERT INTO S.outbox (…) VALUES (…) ON CONFLICT (destination, idempotency_key) DO NOTHING RETURNING id`; on a conflict `SELECT id FROM S.outbox WHERE destination = $1 AND idempotency_key = $2` (a duplicate); the insert's trigger `NOTIFY`s |
//! | `enqueue` of an entry with an ordering key | first `SELECT pg_advisory_xact_lock(…)` (its sequence's lock), then the insert, which takes its id as its `seq` and waits if its sequence has an unfinished entry |
//! | `claim`, `claim_due` | the destinations in line (a skip scan of the partial line index with their flow rows), their rows locked `FOR UPDATE SKIP LOCKED`, their in-flight counts, their first claimable entries by priority (the partial queue index), then `UPDATE S.outbox SET status = 'dispatching', attempt_count = LEAST(attempt_count + 1, 4294967295), worker_id = $3, claimed_at = $1 WHERE id IN (… FOR UPDATE SKIP LOCKED) RETURNING …` and each flow written back (see `outbox/claim.rs`) |
//! | `settle(Completed)`, `mark_completed` | `UPDATE S.outbox SET status = 'completed', completed_at = $3, next_attempt_at = NULL, worker_id = NULL, claimed_at = NULL WHERE id = $1 AND attempt_count = $2 AND status IN ('dispatching', 'outcome_unknown')` and the completion tells its destination nothing (no ordering key; no cap, circuit or probe there); else the general path |
//! | after a change out of `Dispatching`, or a hold | the destinations' rows locked `FOR UPDATE` in name order, `Flow::settled` / `Flow::hold`, the rows written back; a finished entry leaving its sequence (under the sequence's lock) makes the next one claimable (`UPDATE … SET waiting = false`) |
//! | every other settlement and operator call | `SELECT … FROM S.outbox WHERE id = $1 FOR UPDATE`, the status machine, `UPDATE S.outbox SET … WHERE id = $1`, and for an attempt record one `INSERT INTO S.outbox_attempts …` that also deletes the records beyond the last 20 |
//! | `settle_many`, `settle_and_claim` | when the ids are distinct, the completions that apply as the rows stand in one `UPDATE S.outbox o SET status = 'completed', … FROM unnest($1, $2, $3) AS f(id, fence, at) WHERE o.id = f.id AND o.attempt_count = f.fence AND o.status IN ('dispatching', 'outcome_unknown') RETURNING o.id`; the rest `SELECT … WHERE id = ANY($1) ORDER BY id FOR UPDATE` (locks in id order), then as above; then `claim_due`'s statement; in one transaction |
//! | `release_expired_claims` | per chunk of 1024: `UPDATE S.outbox SET status = 'pending', next_attempt_at = claimed_at, worker_id = NULL, claimed_at = NULL WHERE id IN (SELECT id … WHERE status = 'dispatching' AND claimed_at < $1 ORDER BY claimed_at, id LIMIT $2 FOR UPDATE SKIP LOCKED) RETURNING id, next_attempt_at` (the partial claims index) |
//! | `purge_finished` | per chunk of 1024: `DELETE FROM S.outbox WHERE id IN (SELECT id … WHERE status IN ('completed', 'failed') AND completed_at < $1 ORDER BY completed_at, id LIMIT $2 FOR UPDATE SKIP LOCKED)` (the partial finished index; attempt records go by `ON DELETE CASCADE`) |
//! | `get`, `find`, `list_for_command`, `list` | `SELECT …, ARRAY(SELECT … FROM S.outbox_attempts …) FROM S.outbox WHERE …` (one statement: one snapshot) |
//! | `counts` | `SELECT status, count(*) FROM S.outbox GROUP BY status` |
//! | `next_due` | the line of the claim: the earliest place of a destination with a claimable entry |
//! | `oldest_claim` | the first row of the claims index |
//! | `destinations` | the flow rows and `SELECT destination, status, count(*) … GROUP BY destination, status`, in one snapshot |
//!
//! # Wake-ups
//!
//! A trigger on `S.outbox` sends `NOTIFY S_outbox` in every transaction
//! that makes a row `pending` (an enqueue, a retry, a reschedule, a requeue,
//! a released claim), so it reaches listeners when that transaction
//! commits, in whichever process it ran, the `*_in` calls and statements of
//! your own included; a settlement or a destination call that makes a
//! destination claimable sooner (a slot freed below its cap, its circuit
//! closed, a pause lifted) notifies in its transaction too, and a finished
//! entry's successor in its sequence becomes `pending`-claimable by an
//! update the trigger sees. [`PgOutbox::subscribe`] starts one listening
//! connection per store (see `listen.rs`) feeding the same coalescing
//! channels as the embedded outbox; the calls of this process also signal
//! their own subscribers directly.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use crossbeam_channel::Receiver;
use parking_lot::Mutex;
use tokio_postgres::GenericClient;

use super::blocking::wait;
use super::conn::{Db, Mode, in_transaction};
use super::depth::DepthGauge;
use super::errors::{corrupted, unsigned, utf8};
use super::{Server, Transaction, listen, refuse_reentrant, run, schema};
use crate::codec::{from_micros, micros};
use crate::error::{Error, Result};
use crate::outbox::ClaimRequest;
use crate::outbox::rules::{Row, check_entry};
use crate::outbox::{
    AttemptRecord, Enqueued, NewEntry, Notifier, OutboxEntry, OutboxId, OutboxRecord, OutboxStatus,
};

mod bulk;
mod claim;
mod control;
mod flows;
mod inspect;
mod maintenance;
mod schedules;
mod settle;

const TABLE: &str = "outbox";
const ATTEMPTS: &str = "outbox_attempts";

/// The columns of an entry, in the order [`read_row`] reads them.
const COLS: &str = "id, command_id, destination, idempotency_key, payload, status, \
                    attempt_count, next_attempt_at, created_at, completed_at, worker_id, \
                    claimed_at, last_failure, remote_ref, ordering_key, priority, seq";

/// How many attempt records an entry keeps, as the embedded store.
fn history() -> i64 {
    i64::try_from(crate::outbox::MAX_ATTEMPT_HISTORY).unwrap_or(i64::MAX)
}

/// A status as stored in the `status` column: its name
/// ([`OutboxStatus::as_str`]).
pub(super) fn status_name(s: OutboxStatus) -> &'static str {
    s.as_str()
}

/// The status stored as `name` in the row of entry `id`; a name that is not
/// a status's is [`Error::Corrupted`] (the row was edited by something
/// else).
fn parse_status(id: u64, name: &str) -> Result<OutboxStatus> {
    name.parse()
        .map_err(|_| corrupted(TABLE, &id, format!("unknown status {name:?}")))
}

/// An id as the caller gives it, as stored; `None` for one no row can have.
fn db_id(id: OutboxId) -> Option<i64> {
    i64::try_from(id.0).ok()
}

/// The entry in `r` (its first 17 columns, [`COLS`]) as the embedded
/// store's row, with its id.
fn read_row(r: &tokio_postgres::Row) -> Result<(u64, Row)> {
    let id: u64 = unsigned(TABLE, &"?", "id", r.try_get(0)?)?;
    let text = |i: usize| -> Result<String> { utf8(TABLE, &id, r.try_get(i)?) };
    let opt_text = |i: usize| -> Result<Option<String>> {
        r.try_get::<_, Option<Vec<u8>>>(i)?
            .map(|b| utf8(TABLE, &id, b))
            .transpose()
    };
    let status = parse_status(id, r.try_get(5)?)?;
    let worker: Option<String> = opt_text(10)?;
    let claimed_at: Option<i64> = r.try_get(11)?;
    let row = Row {
        command_id: text(1)?,
        destination: text(2)?,
        idempotency_key: text(3)?,
        payload: r.try_get(4)?,
        status,
        attempt_count: unsigned(TABLE, &id, "attempt_count", r.try_get(6)?)?,
        next_attempt_at: r.try_get(7)?,
        created_at: r.try_get(8)?,
        completed_at: r.try_get(9)?,
        attempt: worker.zip(claimed_at),
        last_failure: opt_text(12)?,
        remote_ref: opt_text(13)?,
        ordering_key: opt_text(14)?,
        priority: u8::try_from(r.try_get::<_, i16>(15)?)
            .ok()
            .filter(|p| *p <= crate::outbox::MAX_PRIORITY)
            .ok_or_else(|| corrupted(TABLE, &id, "a priority out of range"))?,
        seq: r
            .try_get::<_, Option<i64>>(16)?
            .map(|n| unsigned(TABLE, &id, "seq", n))
            .transpose()?,
    };
    Ok((id, row))
}

/// The entry in `r`, as a claim returns it.
fn read_entry(r: &tokio_postgres::Row) -> Result<OutboxEntry> {
    let (id, row) = read_row(r)?;
    Ok(row.to_record(id)?.entry)
}

/// The record in `r`: [`COLS`] followed by the four arrays of its attempt
/// history ([`PgOutbox::select_records`]).
fn read_record(r: &tokio_postgres::Row) -> Result<OutboxRecord> {
    let (id, row) = read_row(r)?;
    let mut record = row.to_record(id)?;
    let attempts: Vec<i64> = r.try_get(17)?;
    let ats: Vec<i64> = r.try_get(18)?;
    let reasons: Vec<Vec<u8>> = r.try_get(19)?;
    let refs: Vec<Option<Vec<u8>>> = r.try_get(20)?;
    if [ats.len(), reasons.len(), refs.len()] != [attempts.len(); 3] {
        return Err(corrupted(ATTEMPTS, &id, "attempt history columns disagree"));
    }
    let history = attempts
        .into_iter()
        .zip(ats)
        .zip(reasons.into_iter().zip(refs));
    for ((attempt, at), (reason, remote_ref)) in history {
        record.attempts.push(AttemptRecord {
            attempt: unsigned(ATTEMPTS, &id, "attempt", attempt)?,
            at: from_micros(ATTEMPTS, &id, at)?,
            reason: utf8(ATTEMPTS, &id, reason)?,
            remote_ref: remote_ref.map(|b| utf8(ATTEMPTS, &id, b)).transpose()?,
        });
    }
    Ok(record)
}

/// The wake-up side of one store's outbox: the subscribers and whether this
/// process listens for the server's notifications yet.
#[derive(Debug, Default)]
struct Wake {
    notifier: Arc<Notifier>,
    listening: Mutex<bool>,
}

/// The store's outbox on the server: the calls of [`Outbox`](crate::Outbox)
/// with the same status table, fencing and due order, for dispatchers in
/// any number of processes. Cheap to clone; every clone (and every
/// [`PgStore::outbox`](super::PgStore::outbox) of the same store) shares
/// one set of wake-up subscribers.
#[derive(Clone, Debug)]
pub struct PgOutbox {
    server: Arc<Server>,
    wake: Arc<Wake>,
    /// The `idemstore_outbox_entries` gauge (`depth.rs`).
    depth: Arc<DepthGauge>,
}

impl PgOutbox {
    pub(super) fn new(server: Arc<Server>) -> PgOutbox {
        PgOutbox {
            server,
            wake: Arc::default(),
            depth: Arc::default(),
        }
    }

    fn s(&self) -> &str {
        &self.server.schema
    }

    /// `SELECT` of [`COLS`] and the attempt history of each row of
    /// `S.outbox o`.
    fn select_records(&self) -> String {
        let s = self.s();
        let history = |col: &str| {
            format!(
                "ARRAY(SELECT a.{col} FROM {s}.outbox_attempts a WHERE a.id = o.id ORDER BY a.seq)"
            )
        };
        format!(
            "SELECT {COLS}, {}, {}, {}, {} FROM {s}.outbox o",
            history("attempt"),
            history("at"),
            history("reason"),
            history("remote_ref"),
        )
    }

    /// Enqueues `entry`, created at `now`: `Enqueued::New(id)`, or
    /// `Enqueued::Duplicate(existing)` (nothing changed) if its
    /// `(destination, idempotency_key)` is already in the outbox. Returns
    /// once committed, and wakes subscribers (in every process) if new.
    pub fn enqueue(&self, entry: NewEntry, now: DateTime<Utc>) -> Result<Enqueued> {
        wait(self.enqueue_async(entry, now))
    }

    /// [`PgOutbox::enqueue`], awaited. Dropped once sent, the entry may
    /// have been enqueued (enqueueing it again answers `Duplicate`).
    pub async fn enqueue_async(&self, entry: NewEntry, now: DateTime<Utc>) -> Result<Enqueued> {
        check_entry(&entry, self.server.max_body)?;
        refuse_reentrant()?;
        let now = micros(now);
        // Statements that commit as each ends: run again only when the
        // server said they did not happen (a lost answer may hide an
        // insert, which would come back as a duplicate).
        let out = if entry.ordering_key.is_some() {
            // The sequence's lock, then the insert: one transaction.
            run!(self.server, Mode::Tx, |conn| {
                in_transaction!(conn, |db| self.insert(db, &entry, now).await)
            })?
        } else {
            run!(self.server, Mode::Statement, |conn| {
                self.insert(&mut conn.db(), &entry, now).await
            })?
        };
        if out.is_new() {
            self.notify();
        }
        self.depth.after_write(self).await;
        Ok(out)
    }

    /// [`PgOutbox::enqueue`] inside the caller's own transaction (from
    /// [`PgStore::write`](super::PgStore::write)): the entry commits or rolls
    /// back with the caller's writes. A new entry wakes the dispatchers of
    /// every process once the caller's transaction has committed (the
    /// server's notification; a rolled-back transaction signals nothing).
    /// An entry with an ordering key holds its sequence's lock until the
    /// caller's transaction ends: another enqueue to the same sequence
    /// waits for it, so that the sequence keeps the order of the commits.
    pub fn enqueue_in(
        &self,
        tx: &mut Transaction<'_>,
        entry: NewEntry,
        now: DateTime<Utc>,
    ) -> Result<Enqueued> {
        wait(self.enqueue_in_async(tx.as_async(), entry, now))
    }

    /// [`PgOutbox::enqueue_in`], awaited, in a transaction of the async
    /// client (a [`PgStore::write_async`](super::PgStore::write_async)
    /// closure's, or your own).
    pub async fn enqueue_in_async(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        entry: NewEntry,
        now: DateTime<Utc>,
    ) -> Result<Enqueued> {
        check_entry(&entry, self.server.max_body)?;
        self.insert(&mut Db::uncached(tx), &entry, micros(now))
            .await
    }

    /// Enqueues many entries in one transaction, in order. Every entry is
    /// checked first: one bad entry fails the call and enqueues nothing. An
    /// entry repeating an earlier one's `(destination, idempotency_key)` is
    /// a `Duplicate` of it. A call that returns `Err` wrote nothing, unless
    /// the connection was lost once its `COMMIT` was sent: then the entries
    /// may have been enqueued (enqueueing them again answers `Duplicate`).
    pub fn enqueue_many(
        &self,
        entries: impl IntoIterator<Item = NewEntry>,
        now: DateTime<Utc>,
    ) -> Result<Vec<Enqueued>> {
        wait(self.enqueue_many_async(entries, now))
    }

    /// [`PgOutbox::enqueue_many`], awaited. Dropped once its `COMMIT` was
    /// sent, the entries may have been enqueued.
    pub async fn enqueue_many_async(
        &self,
        entries: impl IntoIterator<Item = NewEntry>,
        now: DateTime<Utc>,
    ) -> Result<Vec<Enqueued>> {
        let entries: Vec<NewEntry> = entries.into_iter().collect();
        for e in &entries {
            check_entry(e, self.server.max_body)?;
        }
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        refuse_reentrant()?;
        let now = micros(now);
        let out = run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |db| self.insert_all(db, &entries, now).await)
        })?;
        if out.iter().any(Enqueued::is_new) {
            self.notify();
        }
        self.depth.after_write(self).await;
        Ok(out)
    }

    /// Inserts each of `entries` in order ([`PgOutbox::insert`]).
    async fn insert_all(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        entries: &[NewEntry],
        now: i64,
    ) -> Result<Vec<Enqueued>> {
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            out.push(self.insert(db, e, now).await?);
        }
        Ok(out)
    }

    /// Inserts `e` unless its `(destination, idempotency_key)` is taken.
    async fn insert(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        e: &NewEntry,
        now: i64,
    ) -> Result<Enqueued> {
        let s = self.s();
        // The id is taken first, so that an entry with an ordering key gets
        // it as its place in its sequence; it waits if an unfinished entry
        // of its sequence is there (its enqueuer holds the sequence's lock,
        // `lock_sequence`, so that none is enqueued meanwhile).
        let insert = format!(
            "INSERT INTO {s}.outbox (id, command_id, destination, idempotency_key, payload, \
             status, attempt_count, next_attempt_at, created_at, ordering_key, priority, seq, \
             waiting) OVERRIDING SYSTEM VALUE \
             SELECT n.id, $1, $2, $3, $4, 'pending', 0, $5, $6, $7, $8, \
                 CASE WHEN $7::bytea IS NULL THEN NULL ELSE n.id END, \
                 $7::bytea IS NOT NULL AND EXISTS (SELECT 1 FROM {s}.outbox w \
                     WHERE w.destination = $2 AND w.ordering_key = $7 AND w.seq IS NOT NULL) \
             FROM (SELECT nextval(pg_get_serial_sequence('{s}.outbox', 'id')) AS id) n \
             ON CONFLICT (destination, idempotency_key) DO NOTHING RETURNING id"
        );
        let ordering_key = e.ordering_key.as_deref().map(str::as_bytes);
        if let Some(k) = &e.ordering_key {
            self.lock_sequence(db, &e.destination, k).await?;
        }
        let existing =
            format!("SELECT id FROM {s}.outbox WHERE destination = $1 AND idempotency_key = $2");
        let (dest, key) = (e.destination.as_bytes(), e.idempotency_key.as_bytes());
        // A conflicting row may be purged between the two statements: then
        // the insert is tried again.
        for _ in 0..3 {
            let inserted = db
                .query_opt(
                    &insert,
                    &[
                        &e.command_id.as_bytes(),
                        &dest,
                        &key,
                        &e.payload,
                        &e.not_before.map(micros),
                        &now,
                        &ordering_key,
                        &i16::from(e.priority),
                    ],
                )
                .await?;
            if let Some(r) = inserted {
                return Ok(Enqueued::New(OutboxId(unsigned(
                    TABLE,
                    &"new",
                    "id",
                    r.try_get(0)?,
                )?)));
            }
            if let Some(r) = db.query_opt(&existing, &[&dest, &key]).await? {
                let id: u64 = unsigned(TABLE, &"?", "id", r.try_get(0)?)?;
                return Ok(Enqueued::Duplicate(OutboxId(id)));
            }
        }
        Err(Error::conflict(format!(
            "({:?}, {:?}) was enqueued and purged concurrently, three times over",
            e.destination, e.idempotency_key
        )))
    }

    /// Takes the lock of the ordering sequence `(destination, key)` until
    /// the end of the transaction (a transaction-level advisory lock named
    /// by a hash of the schema, destination and key): an entry joins or
    /// leaves a sequence only under it, so that two transactions never both
    /// see themselves first of one.
    pub(super) async fn lock_sequence(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        destination: &str,
        key: &str,
    ) -> Result<()> {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let parts: [&[u8]; 6] = [
            b"idemstore-sequence:",
            self.s().as_bytes(),
            b"\0",
            destination.as_bytes(),
            b"\0",
            key.as_bytes(),
        ];
        for b in parts.iter().flat_map(|p| p.iter()) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        let lock = i64::from_ne_bytes(h.to_ne_bytes());
        db.execute("SELECT pg_advisory_xact_lock($1)", &[&lock])
            .await?;
        Ok(())
    }

    /// Claims up to `limit` due `Pending` entries for `worker_id`, across
    /// destinations in turn: [`PgOutbox::claim`] with
    /// [`ClaimRequest::new`]`(limit, worker_id)`.
    pub fn claim_due(
        &self,
        now: DateTime<Utc>,
        limit: usize,
        worker_id: &str,
    ) -> Result<Vec<OutboxEntry>> {
        wait(self.claim_due_async(now, limit, worker_id))
    }

    /// [`PgOutbox::claim_due`], awaited. Dropped once its `COMMIT` was
    /// sent, the entries may have been claimed (they stay `Dispatching`
    /// until [`release_expired_claims`](Self::release_expired_claims)).
    pub async fn claim_due_async(
        &self,
        now: DateTime<Utc>,
        limit: usize,
        worker_id: &str,
    ) -> Result<Vec<OutboxEntry>> {
        self.claim_async(now, &ClaimRequest::new(limit, worker_id))
            .await
    }

    /// A channel that receives `()` after a commit, in any process, that
    /// may have made work due (enqueue, retry, reschedule, requeue, released
    /// claims), and after [`PgOutbox::notify`]. Signals coalesce: at most one
    /// waits in the channel. Dropping the receiver unsubscribes.
    ///
    /// The first subscription starts the store's listening connection (its
    /// own, outside the pool), a task on the store's runtime; each time it
    /// has (re)connected it sends one signal, since notifications sent
    /// while it was away are lost. On a server that refuses `LISTEN` it
    /// signals every second instead (polling).
    pub fn subscribe(&self) -> Receiver<()> {
        let rx = self.wake.notifier.subscribe();
        self.listen();
        rx
    }

    /// [`PgOutbox::settle_and_claim_with`] as the async dispatcher awaits
    /// it: on the async client, holding no thread.
    #[cfg(feature = "tokio")]
    pub(super) fn settle_and_claim_boxed(
        &self,
        settlements: Vec<(crate::Fence, crate::Settlement)>,
        now: DateTime<Utc>,
        request: ClaimRequest,
    ) -> crate::backend::BoxFuture<'_, Result<crate::SettledAndClaimed>> {
        Box::pin(async move {
            self.settle_and_claim_with_async(settlements, now, &request)
                .await
        })
    }

    /// [`PgOutbox::next_due`] likewise.
    #[cfg(feature = "tokio")]
    pub(super) fn next_due_boxed(
        &self,
    ) -> crate::backend::BoxFuture<'_, Result<Option<DateTime<Utc>>>> {
        Box::pin(self.next_due_async())
    }

    /// How many commits of the async dispatcher may usefully run at once:
    /// each is a round trip of its own that the server runs beside the
    /// others (`SKIP LOCKED` keeps their claims apart), so as many as the
    /// pool has connections, at most 16.
    #[cfg(feature = "tokio")]
    pub(super) fn commit_parallelism(&self) -> usize {
        self.server.pool_size().min(16)
    }

    /// [`subscribe`](Self::subscribe) for async waiters (the async
    /// dispatcher): signalled after the same commits, by the same
    /// listening connection.
    #[cfg(feature = "tokio")]
    pub(super) fn subscribe_async(&self) -> tokio::sync::watch::Receiver<()> {
        let rx = self.wake.notifier.subscribe_async();
        self.listen();
        rx
    }

    /// Starts the store's listening connection unless it runs.
    fn listen(&self) {
        let mut listening = self.wake.listening.lock();
        if !*listening {
            listen::start(
                &self.server.handle,
                &self.server.address,
                schema::channel(&self.server.schema),
                Arc::downgrade(&self.wake.notifier),
            );
            *listening = true;
        }
    }

    /// Wakes this process's subscribers. The store calls it itself after
    /// the calls of this process that made work due; notifications from the
    /// server wake them for every other commit.
    pub fn notify(&self) {
        self.wake.notifier.notify();
    }
}

/// The async calls' futures are `Send` (a compile-time check; nothing
/// runs it).
#[cfg(test)]
#[expect(
    clippy::too_many_arguments,
    reason = "one of each argument the calls take"
)]
fn _send(
    o: &PgOutbox,
    tx: &tokio_postgres::Transaction<'_>,
    entry: NewEntry,
    fence: crate::Fence,
    settlement: &crate::Settlement,
    request: &ClaimRequest,
    filter: &crate::OutboxFilter,
    change: &crate::MatchingChange,
    now: DateTime<Utc>,
) {
    fn is_send<T: Send>(_: T) {}
    let id = fence.id;
    let batch = || vec![(fence, settlement.clone())];
    is_send(o.enqueue_async(entry.clone(), now));
    is_send(o.enqueue_in_async(tx, entry.clone(), now));
    is_send(o.enqueue_many_async(vec![entry], now));
    is_send(o.claim_due_async(now, 1, "w"));
    is_send(o.claim_async(now, request));
    is_send(o.next_due_async());
    is_send(o.settle_async(fence, settlement.clone(), now));
    is_send(o.settle_in_async(tx, fence, settlement, now));
    is_send(o.settle_many_async(batch(), now));
    is_send(o.settle_and_claim_async(batch(), now, 1, "w"));
    is_send(o.settle_and_claim_with_async(batch(), now, request));
    is_send(o.mark_completed_async(id, now));
    is_send(o.mark_failed_async(id, "r", None, now));
    is_send(o.mark_outcome_unknown_async(id, None));
    is_send(o.reschedule_async(id, now));
    is_send(o.requeue_async(id, now));
    is_send(o.cancel_async(id, now));
    is_send(o.change_matching_async(filter, change, 1));
    is_send(o.set_destination_policy_async("d", crate::DestinationPolicy::default()));
    is_send(o.pause_destination_async("d"));
    is_send(o.resume_destination_async("d"));
    is_send(o.destinations_async());
    is_send(o.destination_async("d"));
    is_send(o.release_expired_claims_async(now));
    is_send(o.purge_finished_async(now));
    is_send(o.get_async(id));
    is_send(o.find_async("d", "k"));
    is_send(o.list_for_command_async("c"));
    is_send(o.counts_async());
    is_send(o.oldest_claim_async());
    is_send(o.list_async(filter, 1));
    is_send(o.check_indexes_async());
}
