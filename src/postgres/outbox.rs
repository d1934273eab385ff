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
//! | `claim_due` | `UPDATE S.outbox SET status = 'dispatching', attempt_count = LEAST(attempt_count + 1, 4294967295), worker_id = $3, claimed_at = $1 WHERE id IN (SELECT id FROM S.outbox WHERE status = 'pending' AND coalesce(next_attempt_at, created_at) <= $1 ORDER BY coalesce(next_attempt_at, created_at), id LIMIT $2 FOR UPDATE SKIP LOCKED) RETURNING …` (the partial due index) |
//! | `settle(Completed)`, `mark_completed` | `UPDATE S.outbox SET status = 'completed', completed_at = $3, next_attempt_at = NULL, worker_id = NULL, claimed_at = NULL WHERE id = $1 AND attempt_count = $2 AND status IN ('dispatching', 'outcome_unknown')` |
//! | every other settlement and operator call | `SELECT … FROM S.outbox WHERE id = $1 FOR UPDATE`, the status machine, `UPDATE S.outbox SET … WHERE id = $1`, and for an attempt record one `INSERT INTO S.outbox_attempts …` that also deletes the records beyond the last 20 |
//! | `settle_many`, `settle_and_claim` | when the ids are distinct, the completions that apply as the rows stand in one `UPDATE S.outbox o SET status = 'completed', … FROM unnest($1, $2, $3) AS f(id, fence, at) WHERE o.id = f.id AND o.attempt_count = f.fence AND o.status IN ('dispatching', 'outcome_unknown') RETURNING o.id`; the rest `SELECT … WHERE id = ANY($1) ORDER BY id FOR UPDATE` (locks in id order), then as above; then `claim_due`'s statement; in one transaction |
//! | `release_expired_claims` | per chunk of 1024: `UPDATE S.outbox SET status = 'pending', next_attempt_at = claimed_at, worker_id = NULL, claimed_at = NULL WHERE id IN (SELECT id … WHERE status = 'dispatching' AND claimed_at < $1 ORDER BY claimed_at, id LIMIT $2 FOR UPDATE SKIP LOCKED) RETURNING id, next_attempt_at` (the partial claims index) |
//! | `purge_finished` | per chunk of 1024: `DELETE FROM S.outbox WHERE id IN (SELECT id … WHERE status IN ('completed', 'failed') AND completed_at < $1 ORDER BY completed_at, id LIMIT $2 FOR UPDATE SKIP LOCKED)` (the partial finished index; attempt records go by `ON DELETE CASCADE`) |
//! | `get`, `find`, `list_for_command`, `list` | `SELECT …, ARRAY(SELECT … FROM S.outbox_attempts …) FROM S.outbox WHERE …` (one statement: one snapshot) |
//! | `counts` | `SELECT status, count(*) FROM S.outbox GROUP BY status` |
//! | `next_due`, `oldest_claim` | the first row of the due or the claims index |
//!
//! # Wake-ups
//!
//! A trigger on `S.outbox` sends `NOTIFY S_outbox` in every transaction
//! that makes a row `pending` (an enqueue, a retry, a reschedule, a requeue,
//! a released claim), so it reaches listeners when that transaction
//! commits, in whichever process it ran, the `*_in` calls and statements of
//! your own included. [`PgOutbox::subscribe`] starts one listening
//! connection per store (see `listen.rs`) feeding the same coalescing
//! channels as the embedded outbox; the calls of this process also signal
//! their own subscribers directly.

use std::sync::Arc;

use ::postgres::{GenericClient, Transaction};
use chrono::{DateTime, Utc};
use crossbeam_channel::Receiver;
use parking_lot::Mutex;

use super::conn::{Db, Mode};
use super::depth::DepthGauge;
use super::errors::{corrupted, unsigned, utf8};
use super::{Server, listen, refuse_reentrant, schema};
use crate::codec::{from_micros, micros};
use crate::error::{Error, Result};
use crate::outbox::ClaimRequest;
use crate::outbox::rules::{Row, check_entry};
use crate::outbox::{
    AttemptRecord, Enqueued, NewEntry, Notifier, OutboxEntry, OutboxId, OutboxRecord, OutboxStatus,
    check_field,
};

mod inspect;
mod maintenance;
mod settle;

const TABLE: &str = "outbox";
const ATTEMPTS: &str = "outbox_attempts";

/// The columns of an entry, in the order [`read_row`] reads them.
const COLS: &str = "id, command_id, destination, idempotency_key, payload, status, \
                    attempt_count, next_attempt_at, created_at, completed_at, worker_id, \
                    claimed_at, last_failure, remote_ref";

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

/// The entry in `r` (its first 14 columns, [`COLS`]) as the embedded
/// store's row, with its id.
fn read_row(r: &::postgres::Row) -> Result<(u64, Row)> {
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
        ordering_key: None,
        priority: 0,
        seq: None,
    };
    Ok((id, row))
}

/// The entry in `r`, as a claim returns it.
fn read_entry(r: &::postgres::Row) -> Result<OutboxEntry> {
    let (id, row) = read_row(r)?;
    Ok(row.to_record(id)?.entry)
}

/// The record in `r`: [`COLS`] followed by the four arrays of its attempt
/// history ([`PgOutbox::select_records`]).
fn read_record(r: &::postgres::Row) -> Result<OutboxRecord> {
    let (id, row) = read_row(r)?;
    let mut record = row.to_record(id)?;
    let attempts: Vec<i64> = r.try_get(14)?;
    let ats: Vec<i64> = r.try_get(15)?;
    let reasons: Vec<Vec<u8>> = r.try_get(16)?;
    let refs: Vec<Option<Vec<u8>>> = r.try_get(17)?;
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
    #[expect(
        clippy::needless_pass_by_value,
        reason = "the embedded outbox's signature, which both backends share"
    )]
    pub fn enqueue(&self, entry: NewEntry, now: DateTime<Utc>) -> Result<Enqueued> {
        check_entry(&entry, self.server.max_body)?;
        refuse_reentrant()?;
        // Statements that commit as each ends: run again only when the
        // server said they did not happen (a lost answer may hide an
        // insert, which would come back as a duplicate).
        let out = self.server.run(Mode::Statement, |conn| {
            self.insert(&mut conn.db(), &entry, micros(now))
        })?;
        if out.is_new() {
            self.notify();
        }
        self.depth.after_write(self);
        Ok(out)
    }

    /// [`PgOutbox::enqueue`] inside the caller's own transaction (from
    /// [`PgStore::write`](super::PgStore::write)): the entry commits or rolls
    /// back with the caller's writes. A new entry wakes the dispatchers of
    /// every process once the caller's transaction has committed (the
    /// server's notification; a rolled-back transaction signals nothing).
    #[expect(
        clippy::needless_pass_by_value,
        reason = "the embedded outbox's signature, which both backends share"
    )]
    pub fn enqueue_in(
        &self,
        tx: &mut Transaction<'_>,
        entry: NewEntry,
        now: DateTime<Utc>,
    ) -> Result<Enqueued> {
        check_entry(&entry, self.server.max_body)?;
        self.insert(&mut Db::uncached(tx), &entry, micros(now))
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
        let entries: Vec<NewEntry> = entries.into_iter().collect();
        for e in &entries {
            check_entry(e, self.server.max_body)?;
        }
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        refuse_reentrant()?;
        let now = micros(now);
        let out = self.server.run(Mode::Tx, |conn| {
            conn.in_transaction(|db| {
                entries
                    .iter()
                    .map(|e| self.insert(db, e, now))
                    .collect::<Result<Vec<_>>>()
            })
        })?;
        if out.iter().any(Enqueued::is_new) {
            self.notify();
        }
        self.depth.after_write(self);
        Ok(out)
    }

    /// Inserts `e` unless its `(destination, idempotency_key)` is taken.
    fn insert(
        &self,
        db: &mut Db<'_, impl GenericClient>,
        e: &NewEntry,
        now: i64,
    ) -> Result<Enqueued> {
        let s = self.s();
        let insert = format!(
            "INSERT INTO {s}.outbox (command_id, destination, idempotency_key, payload, status, \
             attempt_count, next_attempt_at, created_at) \
             VALUES ($1, $2, $3, $4, 'pending', 0, $5, $6) \
             ON CONFLICT (destination, idempotency_key) DO NOTHING RETURNING id"
        );
        let existing =
            format!("SELECT id FROM {s}.outbox WHERE destination = $1 AND idempotency_key = $2");
        let (dest, key) = (e.destination.as_bytes(), e.idempotency_key.as_bytes());
        // A conflicting row may be purged between the two statements: then
        // the insert is tried again.
        for _ in 0..3 {
            let inserted = db.query_opt(
                &insert,
                &[
                    &e.command_id.as_bytes(),
                    &dest,
                    &key,
                    &e.payload,
                    &e.not_before.map(micros),
                    &now,
                ],
            )?;
            if let Some(r) = inserted {
                return Ok(Enqueued::New(OutboxId(unsigned(
                    TABLE,
                    &"new",
                    "id",
                    r.try_get(0)?,
                )?)));
            }
            if let Some(r) = db.query_opt(&existing, &[&dest, &key])? {
                let id: u64 = unsigned(TABLE, &"?", "id", r.try_get(0)?)?;
                return Ok(Enqueued::Duplicate(OutboxId(id)));
            }
        }
        Err(Error::conflict(format!(
            "({:?}, {:?}) was enqueued and purged concurrently, three times over",
            e.destination, e.idempotency_key
        )))
    }

    /// The claim statement of [`PgOutbox::claim_due`].
    fn claim_sql(&self) -> String {
        let s = self.s();
        format!(
            "UPDATE {s}.outbox SET status = 'dispatching', \
             attempt_count = LEAST(attempt_count + 1, 4294967295), \
             worker_id = $3, claimed_at = $1 \
             WHERE id IN (SELECT id FROM {s}.outbox \
                 WHERE status = 'pending' AND coalesce(next_attempt_at, created_at) <= $1 \
                 ORDER BY coalesce(next_attempt_at, created_at), id LIMIT $2 \
                 FOR UPDATE SKIP LOCKED) \
             RETURNING {COLS}"
        )
    }

    /// Runs the claim statement on `client`; the entries earliest due
    /// first, then by id.
    fn claim_on(
        &self,
        db: &mut Db<'_, impl GenericClient>,
        now: i64,
        limit: usize,
        worker_id: &str,
    ) -> Result<Vec<OutboxEntry>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = db.query(&self.claim_sql(), &[&now, &limit, &worker_id.as_bytes()])?;
        let mut entries = rows.iter().map(read_entry).collect::<Result<Vec<_>>>()?;
        entries.sort_by_key(|e| (e.due_at(), e.id));
        Ok(entries)
    }

    /// Claims up to `limit` due `Pending` entries for `worker_id`: those
    /// with `next_attempt_at` absent or `<= now`, earliest due first
    /// (`next_attempt_at`, else `created_at`), then by id. Each becomes
    /// `Dispatching` with `attempt_count + 1` and the claim
    /// `{worker_id, claimed_at: now}`; the returned entries are exactly what
    /// [`PgOutbox::get`] returns for them afterwards. Concurrent claimers, in
    /// any process, never get the same entry: each skips the rows another
    /// is claiming (`FOR UPDATE SKIP LOCKED`). One statement on the partial
    /// due index: its cost follows `limit`, not the backlog. A call that
    /// returns `Err` claimed nothing, unless the connection was lost once
    /// its `COMMIT` was sent: then the entries may have been claimed, and
    /// stay `Dispatching` until
    /// [`release_expired_claims`](Self::release_expired_claims) hands them
    /// back.
    pub fn claim_due(
        &self,
        now: DateTime<Utc>,
        limit: usize,
        worker_id: &str,
    ) -> Result<Vec<OutboxEntry>> {
        check_field("worker_id", worker_id)?;
        if limit == 0 {
            return Ok(Vec::new());
        }
        refuse_reentrant()?;
        // In a transaction of its own, so that a row that does not decode
        // (edited by something else) fails the call before it commits:
        // a call that returns `Err` claimed nothing.
        let claimed = self.server.run(Mode::Tx, |conn| {
            conn.in_transaction(|db| self.claim_on(db, micros(now), limit, worker_id))
        })?;
        self.depth.after_write(self);
        Ok(claimed)
    }

    /// Claims what `request` asks for at `now` (as
    /// [`Outbox::claim`](crate::Outbox::claim) does).
    pub fn claim(&self, now: DateTime<Utc>, request: &ClaimRequest) -> Result<Vec<OutboxEntry>> {
        request.check()?;
        self.claim_due(now, request.limit(), request.worker_id())
    }

    /// A channel that receives `()` after a commit, in any process, that
    /// may have made work due (enqueue, retry, reschedule, requeue, released
    /// claims), and after [`PgOutbox::notify`]. Signals coalesce: at most one
    /// waits in the channel. Dropping the receiver unsubscribes.
    ///
    /// The first subscription starts the store's listening connection (its
    /// own, outside the pool) on a thread of its own; each time it has
    /// (re)connected it sends one signal, since notifications sent while it
    /// was away are lost. On a server that refuses `LISTEN` it signals every
    /// second instead (polling).
    pub fn subscribe(&self) -> Receiver<()> {
        let rx = self.wake.notifier.subscribe();
        self.listen();
        rx
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
            *listening = listen::start(
                self.server.config.clone(),
                schema::channel(&self.server.schema),
                Arc::downgrade(&self.wake.notifier),
            )
            .is_ok();
        }
    }

    /// Wakes this process's subscribers. The store calls it itself after
    /// the calls of this process that made work due; notifications from the
    /// server wake them for every other commit.
    pub fn notify(&self) {
        self.wake.notifier.notify();
    }
}
