//! The transactional outbox: external side effects awaiting dispatch.
//!
//! An outbox entry ([`NewEntry`]) is a side effect to perform later — an
//! e-mail, a call to another service — enqueued in the same write
//! transaction as the state change that calls for it
//! ([`Outbox::enqueue_in`]), so the effect is recorded if and only if the
//! change commits. A dispatcher then claims due entries
//! ([`Outbox::claim_due`]), performs them and settles each claim with its
//! [`Fence`] ([`Outbox::settle`]). The [`Dispatcher`](crate::Dispatcher)
//! does all of that for you (see [`dispatch`](crate::dispatch)); the calls
//! below are what it is built on, and what an operator uses.
//!
//! ```
//! use idemstore::chrono::{Duration, Utc};
//! use idemstore::{Enqueued, NewEntry, OutboxStatus, Settlement, Store};
//!
//! # let dir = tempfile::tempdir().map_err(idemstore::Error::Io)?;
//! let store = Store::open(dir.path().join("app.idem"))?;
//! let outbox = store.outbox();
//! let now = Utc::now();
//!
//! // Enqueued inside your own transaction: with your rows, or not at all.
//! let receipt = NewEntry::new("order-42", "mailer", "order-42/receipt", b"Thanks!".to_vec());
//! let id = store.write(|tx| outbox.enqueue_in(tx, receipt.clone(), now))?.id();
//! // The same `(destination, idempotency_key)` again is a duplicate, not a second entry.
//! assert_eq!(outbox.enqueue(receipt, now)?, Enqueued::Duplicate(id));
//!
//! // What a dispatcher does: claim what is due, perform it, settle with the fence.
//! let claimed = outbox.claim_due(now, 10, "worker-1")?;
//! assert_eq!(claimed.len(), 1);
//! outbox.settle(claimed[0].fence(), Settlement::Completed, now + Duration::seconds(1))?;
//! assert_eq!(outbox.get(id)?.entry.status, OutboxStatus::Completed);
//! # Ok::<_, idemstore::Error>(())
//! ```
//!
//! # Statuses
//!
//! An entry is `Pending` until due and claimed, `Dispatching` while a
//! worker performs it, then `Completed`, `Failed` (given up), back to
//! `Pending` (a retry, a reschedule, a released claim), or `OutcomeUnknown`
//! (the worker cannot tell whether the effect happened) until someone
//! settles it. `Completed` and `Failed` are terminal; an operator's
//! [`Outbox::requeue`] is the one way back from `Failed`. An entry not being
//! sent (`Pending`, `OutcomeUnknown`) can be [cancelled](Outbox::cancel):
//! `Failed` with the reason `cancelled`.
//!
//! # Attempt history
//!
//! Each attempt that fails, is given back or ends in doubt (and each
//! cancel) adds an [`AttemptRecord`] `{attempt, at, reason}` to the entry's
//! history, the last [`MAX_ATTEMPT_HISTORY`] of which
//! [`OutboxRecord::attempts`] shows, oldest first. `last_failure` holds the
//! latest failure's code only; the history keeps every attempt's own reason
//! (an entry the dispatcher gave up on says `max_attempts`, its last attempt
//! `max_attempts (http_500)`).
//!
//! The exact table, with the accepted no-op cells, is on
//! [`OutboxStatus`]. Every refused edge is [`Error::Conflict`] and changes
//! nothing; an unknown id is [`Error::NotFound`]. Only `Dispatching` holds a
//! claim: every edge out of it clears the claim and its claims-index row.
//!
//! # Failures
//!
//! A call that returns `Err` wrote nothing. Each call that commits on its
//! own is one operation of the store, and an operation that fails is rolled
//! back as a whole — the bulk calls too ([`Outbox::enqueue_many`],
//! [`Outbox::claim_due`], [`Outbox::settle_many`],
//! [`Outbox::settle_and_claim`]). The two maintenance calls,
//! [`Outbox::release_expired_claims`] and [`Outbox::purge_finished`], are
//! the exception: they commit in chunks of at most 1024 entries, each one
//! operation, so that a large backlog never holds the writer (and every
//! claim queued behind it) for long. An `Err` from one of them rolled back
//! its failed chunk only; the chunks before it stay committed, each a
//! consistent state. The `*_in` calls act on one entry and check before
//! they write. In a bulk settle, a settlement refused
//! ([`Error::Conflict`]) or whose entry is gone ([`Error::NotFound`]) is an
//! answer about that settlement alone; a damaged record or a storage failure
//! fails the whole call.
//!
//! # Fencing
//!
//! Every claim increments the entry's `attempt_count`, which never
//! decreases. [`OutboxEntry::fence`] captures `(id, attempt)` at claim time;
//! [`Outbox::settle`] applies a [`Settlement`] only if the entry is still at
//! that attempt and still `Dispatching` or `OutcomeUnknown`. A dispatcher
//! whose claim expired and was released (and perhaps claimed by another
//! worker) gets [`Error::Conflict`] and changes nothing. Repeating a
//! settlement that already took effect (complete twice, fail finally twice)
//! is accepted, so a dispatcher may retry a settle call whose answer it lost.
//! The unfenced `mark_*` calls are for operators.
//!
//! # Wake-ups
//!
//! [`Outbox::subscribe`] hands out a channel that receives `()` after a
//! commit that may have made work due sooner: an enqueue, a retry, a
//! reschedule, a requeue or a released claim. Signals coalesce (one pending
//! signal per subscriber). A dispatcher waits on it with a timeout of
//! [`Outbox::next_due`] minus now. The `*_in` calls signal too, once the
//! caller's [`Store::write`](crate::Store::write) has committed (durably);
//! a rolled-back write signals nothing.
//!
//! In a store file shared between processes
//! ([`StoreBuilder::shared`](crate::StoreBuilder::shared)) another
//! process's commits signal too. A thread of the store, `idemstore-watch`,
//! reads the file's 320-byte header every
//! [`shared_poll_interval`](crate::StoreBuilder::shared_poll_interval)
//! (default 5 ms); after a commit by anyone it reads the outbox's next id
//! and earliest due time, and signals if an entry was enqueued or work
//! became due sooner. A dispatcher then sends an entry another process
//! enqueued about half the interval plus one commit later than one
//! enqueued in its own process (the figures, per interval, are in the
//! repository's `docs/design.md`), not at its one-minute safety timer. What a process
//! can expect:
//!
//! - **Idle cost**: one timed wake-up and one header read per interval,
//!   only while someone subscribes (a process that runs no dispatcher does
//!   not look at all); about 1 % of a core at the default 5 ms on a
//!   2-core VM.
//! - **No ping-pong**: commits that make nothing due sooner (claims,
//!   completions, final failures) signal nobody, so idle dispatchers in
//!   several processes never keep each other committing.
//! - **Own enqueues twice**: a process's own enqueue is signalled at once
//!   and again by the thread, so its workers may make one extra, empty
//!   claim per interval in which it enqueued.
//! - **A change the thread missed** (the earliest entry claimed and put
//!   back later than before, between two looks) is noticed at the due time
//!   a dispatcher last read, as without the thread.
//! - The thread ends when the store and every handle of its outbox are
//!   dropped; a dispatcher's handle keeps it.
//!
//! # Destinations
//!
//! An entry's `destination` names the remote it goes to. Each destination
//! can be given a [`DestinationPolicy`] ([`Outbox::set_destination_policy`])
//! and be paused ([`Outbox::pause_destination`]); its policy and state are
//! stored in the file, so every dispatcher, every process sharing the file
//! and the CLI see the same ones, and every limit is checked inside the
//! claim's own write transaction — exact across all of them, with no
//! coordinator:
//!
//! - **Concurrency cap** (`max_in_flight(n)`): at most `n` of its entries
//!   `Dispatching` at once, counted from what the file holds, so a crashed
//!   dispatcher's claims count until the reaper releases them. A cap is a
//!   promise of up to `n` sends *at once*, not only of at most `n`: a
//!   claim takes no more of a destination whose flow limits claims (a cap,
//!   a rate, a probe) than its worker can start
//!   ([`ClaimRequest::limited`]) — one for a dispatcher's worker thread,
//!   which sends its batch in turn; the free send slots for the async
//!   dispatcher — so with `n` workers or more in all and `n` entries due,
//!   `n` are in flight. Destinations without a limit are still claimed in
//!   batches.
//! - **Rate limit** (`rate_limit(per_second, burst)`): a token bucket kept
//!   in the file; a claim takes only whole tokens, and
//!   [`Outbox::next_due`] says when the next one comes, so an idle
//!   dispatcher sleeps until then instead of polling.
//! - **Pause**: its entries are not claimed (those in flight finish) until
//!   [`Outbox::resume_destination`]. Durable: it survives restarts.
//! - **Circuit breaker** (`circuit_breaker(k, cool_down)`): after `k`
//!   retryable failures in a row (a retry, or the attempts used up), the
//!   destination is held back for the cool-down; then one probe entry is
//!   claimed; its success closes the circuit, its failure holds the
//!   destination back again for twice as long (up to
//!   [`MAX_COOL_DOWN_FACTOR`] times the cool-down). While held back none of
//!   its entries is claimed, so none is charged an attempt, and none fails
//!   for running out of attempts: `max_attempts` counts the attempts
//!   actually sent. A [`Settlement::Throttled`] (a 429 or 503 with
//!   `Retry-After`) holds the whole destination back until its time.
//!
//! Claims share out the work **fairly**: destinations take turns, the one
//! served longest ago first, one entry each per round, so a destination
//! with a large backlog never crowds the others out. (Its turn comes again
//! after every destination waiting since before the claim that served it,
//! by that claim's `now`: a claimer whose clock is behind another's sees
//! the destinations that one just served as served in its future, and
//! skips them until its clock gets there.) A dispatcher also keeps any
//! one destination from holding more than its share of its workers
//! ([`ClaimRequest::avoid`]), so a slow remote delays only its own entries.
//! The shares follow the destinations' weights
//! ([`DestinationPolicy::weight`], 1 by default): while destinations of
//! weights 3 and 1 both have entries due, a dispatcher's workers go to them
//! three to one, and so does what they send when their sends take alike.
//! Each dispatcher shares out its own workers by the stored weights, so
//! several dispatchers together keep the same proportion.
//!
//! A cap of N is **N sends at once**, not only never more: a claim takes at
//! most what its worker can start of a destination whose flow limits claims
//! ([`ClaimRequest::limited`]: one entry for a worker thread, which sends
//! its batch one after the other; the free send slots for the async
//! dispatcher), so with N workers or more in all, N sends of a capped
//! destination are in flight while N of its entries are due. A destination
//! without a cap, a rate or a circuit is claimed in whole batches, as
//! before.
//!
//! Within a destination, entries go **by priority** ([`NewEntry::priority`],
//! `0..=`[`MAX_PRIORITY`], higher first), then earliest due, then id. Entries
//! of one destination that share an **ordering key**
//! ([`NewEntry::ordering_key`]) go one at a time, in enqueue order: an entry
//! is claimable only once every earlier one of its sequence is `Completed`
//! or `Failed`. A retry keeps its place; an entry left `OutcomeUnknown`
//! holds its sequence until it is resolved; a `Failed` entry requeued joins
//! the end. Entries without a key are not ordered.
//!
//! [`Outbox::destinations`] reports each destination's policy, pause,
//! circuit, hold, tokens, entries in flight and entries by status.
//!
//! # Schedules
//!
//! A [`Schedule`] enqueues an entry per slot: at the instants of a cron
//! expression (feature `cron`; in a named time zone with feature `tz`), or
//! at the multiples of an interval since the Unix epoch
//! ([`Schedule::every`]). [`Outbox::set_schedule`] stores it; the
//! dispatchers fire it by their clock, each slot's entry (key
//! `idemstore:schedule:<name>:<slot>`, read back with
//! [`OutboxEntry::slot`]) enqueued in the transaction that moves the
//! schedule past the slot, so however many dispatchers and processes fire,
//! a slot yields one entry, which then has every guarantee of an entry.
//! Setting a schedule reads no clock: it starts at the first firing that
//! sees it, and the slots before never fire; from then on the slots that
//! pass while nothing fires (the store down, the schedule paused) are dealt
//! with by its [`Missed`] policy: the latest only (the default), all (at
//! most [`MAX_MISSED_SLOTS`]), or none but one at most [`ON_TIME`] late.
//! A firing reads the index of next slots from its front, so it costs per
//! due slot, whatever the number of schedules.
//!
//! # Layout
//!
//! One row per entry (`id → record`), written whole by its enqueue, and
//! one small row of its state once it changes (a claim or a settlement
//! rewrites that, not the entry and its payload); four index tables and
//! the attempt history, written in the same transaction: see
//! `src/outbox/index.rs` for the invariants, which
//! [`Outbox::check_indexes`] verifies. The destinations have three tables
//! of their own (their small rows — flow records, the ready line, the
//! outbox's counts — each destination's queue of claimable entries, and
//! the ordering sequences), kept by the same writes: see
//! `src/outbox/flow.rs`. Files of format 1, written before destinations
//! existed, gain them when this version first opens them, in one
//! transaction that reads every entry once.

mod bulk;
pub(crate) mod claim_request;
mod control;
mod depth;
pub(crate) mod destinations;
mod flow;
mod index;
mod inspect;
mod notifier;
mod ops;
mod record;
pub(crate) mod rules;
pub(crate) mod schedule;
mod schedules;
#[cfg(feature = "tokio")]
mod tasks;
mod types;
mod watch;

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use crossbeam_channel::Receiver;
use redb::WriteTransaction;

use crate::codec::micros;
use crate::engine::Engine;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
pub use bulk::{MatchingChange, MatchingStep};
pub use claim_request::ClaimRequest;
pub use destinations::{
    CircuitState, DestinationPolicy, DestinationState, MAX_COOL_DOWN_FACTOR, MAX_PRIORITY,
    PolicyLimits, REASON_MAX_ATTEMPTS,
};
pub(crate) use notifier::Notifier;
use rules::{
    Change, check_entry, mark_failed_change, mark_outcome_unknown_change, plan_settle_and_claim,
    plan_settlements,
};
pub use schedule::{
    MAX_MISSED_SLOTS, MAX_SCHEDULE_NAME_LEN, Missed, ON_TIME, SLOT_KEY_PREFIX, Schedule,
    ScheduleInfo,
};
pub(crate) use types::check_field;
pub use types::{
    AttemptRecord, Enqueued, Fence, MAX_ATTEMPT_HISTORY, MAX_OUTBOX_FIELD_LEN, NewEntry,
    OutboxClaim, OutboxCounts, OutboxEntry, OutboxFilter, OutboxId, OutboxRecord, OutboxStatus,
    ParseOutboxStatusError, REASON_CANCELLED, REASON_OUTCOME_UNKNOWN, REASON_RESCHEDULED,
    SettledAndClaimed, Settlement,
};

/// Entries released or purged per commit by
/// [`Outbox::release_expired_claims`] and [`Outbox::purge_finished`]: 1024.
pub(crate) const MAINTENANCE_CHUNK: usize = 1024;
/// Payload bytes [`Outbox::release_expired_claims`] rewrites per commit,
/// past which it ends a chunk early (each chunk releases at least one
/// entry): 4 MiB.
const RELEASE_BYTES: usize = 4 << 20;

/// Builds the destinations' tables of a file written before they existed
/// (its format's upgrade, once, when it is first opened by this build):
/// reads every record once.
pub(crate) fn add_destination_tables(tx: &WriteTransaction) -> Result<()> {
    flow::build(tx)
}

/// Lists the records by status in a file written before they were (its
/// format's upgrade, once, when it is first opened by this build): reads
/// every record's keys once.
pub(crate) fn list_by_status(tx: &WriteTransaction) -> Result<()> {
    flow::build_listed(tx)
}

/// The store's outbox. Cheap to clone; every clone (and every
/// [`Store::outbox`](crate::Store::outbox) of the same store) shares one
/// set of wake-up subscribers.
///
/// ```
/// use chrono::Utc;
/// use idemstore::redb::TableDefinition;
/// use idemstore::{NewEntry, Settlement, Store};
///
/// const ORDERS: TableDefinition<&str, &str> = TableDefinition::new("app.orders");
///
/// let store = Store::in_memory()?;
/// let outbox = store.outbox();
/// let wake = outbox.subscribe();
///
/// // The order and the email about it commit together, or neither does.
/// let now = Utc::now();
/// store.write(|tx| {
///     tx.open_table(ORDERS).map_err(idemstore::Error::from)?
///         .insert("order-1", "paid").map_err(idemstore::Error::from)?;
///     let email = NewEntry::new("order-1", "mailer", "order-1/receipt", b"Thanks!".to_vec());
///     outbox.enqueue_in(tx, email, now)
/// })?;
/// // The commit woke the dispatchers.
/// assert!(wake.try_recv().is_ok());
///
/// // A dispatcher claims due work, performs it, and settles each attempt.
/// for entry in outbox.claim_due(Utc::now(), 10, "worker-1")? {
///     // ... send entry.payload to entry.destination ...
///     outbox.settle(entry.fence(), Settlement::Completed, Utc::now())?;
/// }
/// assert_eq!(outbox.counts()?.completed, 1);
/// # Ok::<_, idemstore::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Outbox {
    engine: Arc<Engine>,
    max_body: usize,
    notifier: Arc<Notifier>,
    /// In a store shared between processes: the thread that signals the
    /// notifier after other processes' commits. It stops when the last
    /// handle is dropped.
    watch: Option<Arc<watch::Watch>>,
}

impl Outbox {
    pub(crate) fn new(engine: Arc<Engine>, max_body: usize) -> Outbox {
        Outbox {
            engine,
            max_body,
            notifier: Arc::default(),
            watch: None,
        }
    }

    /// In a store file shared between processes, starts the thread that
    /// wakes this outbox's subscribers after other processes' commits,
    /// looking every `interval` (see `watch.rs`). Does nothing for a store
    /// held alone or one without a file.
    pub(crate) fn watch_other_processes(&mut self, interval: Duration) -> Result<()> {
        let Some(path) = self.engine.path().filter(|_| self.engine.is_shared()) else {
            return Ok(());
        };
        let watch =
            watch::Watch::start(self.engine.clone(), self.notifier.clone(), path, interval)?;
        self.watch = Some(Arc::new(watch));
        Ok(())
    }

    /// Enqueues `entry`, created at `now`: `Enqueued::New(id)`, or
    /// `Enqueued::Duplicate(existing)` (nothing changed) if its
    /// `(destination, idempotency_key)` is already in the outbox. Returns
    /// once durable, and wakes subscribers if new.
    pub fn enqueue(&self, entry: NewEntry, now: DateTime<Utc>) -> Result<Enqueued> {
        let mut out = self.enqueue_many(vec![entry], now)?;
        Ok(out.remove(0))
    }

    /// [`Outbox::enqueue`] inside the caller's own write transaction (from
    /// [`Store::write`](crate::Store::write)): the entry commits or rolls
    /// back with the caller's writes. A new entry wakes the dispatchers once
    /// the caller's `write` has committed.
    pub fn enqueue_in(
        &self,
        tx: &WriteTransaction,
        entry: NewEntry,
        now: DateTime<Utc>,
    ) -> Result<Enqueued> {
        self.check_entry(&entry)?;
        let mut out = ops::enqueue(tx, &[entry], micros(now))?;
        let enqueued = out.remove(0);
        if enqueued.is_new() {
            self.notify_after_commit();
        }
        Ok(enqueued)
    }

    /// Enqueues many entries in one commit, in order. Every entry is checked
    /// first: one bad entry fails the call and enqueues nothing. An entry
    /// repeating an earlier one's `(destination, idempotency_key)` is a
    /// `Duplicate` of it. A call that returns `Err` wrote nothing.
    pub fn enqueue_many(
        &self,
        entries: impl IntoIterator<Item = NewEntry>,
        now: DateTime<Utc>,
    ) -> Result<Vec<Enqueued>> {
        match self.enqueue_op(entries, now)? {
            Some(op) => Ok(self.enqueued(self.engine.execute(op)?)),
            None => Ok(Vec::new()),
        }
    }

    /// Claims up to `limit` due `Pending` entries for `worker_id`, across
    /// destinations in turn: [`Outbox::claim`] with
    /// [`ClaimRequest::new`]`(limit, worker_id)`.
    pub fn claim_due(
        &self,
        now: DateTime<Utc>,
        limit: usize,
        worker_id: &str,
    ) -> Result<Vec<OutboxEntry>> {
        self.claim(now, &ClaimRequest::new(limit, worker_id))
    }

    /// Claims what `request` asks for at `now`. An entry is claimable when
    /// it is `Pending` and due (`next_attempt_at` absent or `<= now`), the
    /// first unfinished entry of its ordering sequence if it has an
    /// ordering key, and its destination is not paused, not at its
    /// `max_in_flight`, not held back (circuit open, throttled) and has a
    /// token. Destinations take turns, the one served longest ago first,
    /// one entry each per round (all from one if the request says
    /// [`one_destination`](ClaimRequest::one_destination)); within a
    /// destination, highest priority first, then earliest due, then id.
    ///
    /// Each entry taken becomes `Dispatching` with `attempt_count + 1` and
    /// the claim `{worker_id, claimed_at: now}`; the returned entries are
    /// exactly what [`Outbox::get`] returns for them afterwards. Concurrent
    /// claimers, in this process or another, never get the same entry, and
    /// every limit holds across all of them: it is checked in the claim's
    /// own transaction. Costs O(limit · log n), whatever the backlog. A
    /// call that returns `Err` (a damaged record among those due) claimed
    /// nothing.
    pub fn claim(&self, now: DateTime<Utc>, request: &ClaimRequest) -> Result<Vec<OutboxEntry>> {
        match claim_op(now, request)? {
            Some(op) => self.engine.execute(op),
            None => Ok(Vec::new()),
        }
    }

    /// Settles the attempt `fence` (from [`OutboxEntry::fence`]) as
    /// `settlement`, at `now`.
    ///
    /// [`Error::Conflict`], changing nothing, if the fence is stale (the
    /// entry moved on to another attempt, or was released, rescheduled or
    /// settled otherwise) or the settlement is not allowed from the entry's
    /// status. Settling the same attempt again the same final way
    /// (completed twice, failed without retry twice) is accepted and changes
    /// nothing. [`Error::NotFound`] if the entry is gone.
    pub fn settle(&self, fence: Fence, settlement: Settlement, now: DateTime<Utc>) -> Result<()> {
        let (op, wake) = change_op(fence.id, settlement.into_change(now)?, Some(fence.attempt));
        let (_, sooner) = self.engine.execute(op)?;
        self.notify_if(wake || sooner);
        Ok(())
    }

    /// [`Outbox::settle`] inside the caller's own write transaction (for a
    /// dispatcher that records the effect's result in its own tables in the
    /// same commit). A retry or a reschedule wakes the dispatchers once the
    /// caller's `write` has committed.
    pub fn settle_in(
        &self,
        tx: &WriteTransaction,
        fence: Fence,
        settlement: &Settlement,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let change = settlement.clone().into_change(now)?;
        let (_, sooner) = ops::change(tx, fence.id.0, &change, Some(fence.attempt))?;
        if change.makes_work_due() || sooner {
            self.notify_after_commit();
        }
        Ok(())
    }

    /// Settles many attempts in one commit (a dispatcher finishing a batch),
    /// in order; a later settlement sees the earlier ones.
    ///
    /// Each settlement is accepted or refused on its own, exactly as
    /// [`Outbox::settle`] would: the answer holds one result per input, in
    /// order, an `Err` there being [`Error::Conflict`] (a stale fence, an
    /// edge not in the table) or [`Error::NotFound`] (the entry is gone).
    /// The call itself fails on bad input, on a damaged record
    /// ([`Error::Corrupted`]) and on storage failures; a call that returns
    /// `Err` wrote nothing, none of its settlements included.
    pub fn settle_many(
        &self,
        settlements: impl IntoIterator<Item = (Fence, Settlement)>,
        now: DateTime<Utc>,
    ) -> Result<Vec<Result<()>>> {
        let Some((op, wake)) = settle_many_op(settlements, now)? else {
            return Ok(Vec::new());
        };
        let (out, sooner) = self.engine.execute(op)?;
        self.notify_if_settled(wake || sooner, &out);
        Ok(out)
    }

    /// Settles a finished batch and claims the next one in one commit: a
    /// dispatcher's step between two batches, for one fsync instead of two.
    ///
    /// The settlements behave exactly as in [`Outbox::settle_many`] (one
    /// result each, in order); the claim behaves exactly as
    /// [`Outbox::claim_due`] and sees the settlements (a retry due at `now`
    /// can be claimed again at once). All or nothing: if the claim fails (a
    /// damaged record), or anything else does, the call returns `Err` and
    /// wrote nothing, settlements included — a caller keeps its settlements
    /// and offers them again (settling the same attempt the same way twice
    /// is accepted).
    pub fn settle_and_claim(
        &self,
        settlements: impl IntoIterator<Item = (Fence, Settlement)>,
        now: DateTime<Utc>,
        limit: usize,
        worker_id: &str,
    ) -> Result<SettledAndClaimed> {
        self.settle_and_claim_with(settlements, now, &ClaimRequest::new(limit, worker_id))
    }

    /// [`Outbox::settle_and_claim`] with a claim that `request` shapes (as
    /// [`Outbox::claim`] takes it).
    pub fn settle_and_claim_with(
        &self,
        settlements: impl IntoIterator<Item = (Fence, Settlement)>,
        now: DateTime<Utc>,
        request: &ClaimRequest,
    ) -> Result<SettledAndClaimed> {
        let (op, wake) = settle_and_claim_op(settlements, now, request)?;
        let (settled, claimed, sooner) = self.engine.execute(op)?;
        self.notify_if_settled(wake || sooner, &settled);
        Ok((settled, claimed))
    }

    /// Operator call: marks `id` `Completed` at `now`, unfenced. Allowed from
    /// `Dispatching` and `OutcomeUnknown`; accepted without change on
    /// `Completed`; otherwise [`Error::Conflict`].
    pub fn mark_completed(&self, id: OutboxId, now: DateTime<Utc>) -> Result<()> {
        self.change(id, Change::Completed { now: micros(now) })
    }

    /// Operator call, unfenced: records `reason` (a stable code, 1–1024
    /// bytes) as `last_failure`, then with `retry_at` moves the entry to
    /// `Pending` due then (from `Pending`, `Dispatching`, `OutcomeUnknown`),
    /// without it to `Failed` stamped `completed_at = now` (from
    /// `Dispatching`, `OutcomeUnknown`; accepted without change on
    /// `Failed`). Otherwise [`Error::Conflict`].
    pub fn mark_failed(
        &self,
        id: OutboxId,
        reason: &str,
        retry_at: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Result<()> {
        self.change(id, mark_failed_change(reason, retry_at, now)?)
    }

    /// Operator call, unfenced: `Dispatching → OutcomeUnknown`, storing
    /// `remote_ref` if given. On `OutcomeUnknown` it is accepted and fills
    /// the remote reference only if none is stored yet. Otherwise
    /// [`Error::Conflict`].
    ///
    /// It takes no time, so it adds no [`AttemptRecord`] (the dispatcher's
    /// [`Settlement::OutcomeUnknown`] does).
    pub fn mark_outcome_unknown(&self, id: OutboxId, remote_ref: Option<&str>) -> Result<()> {
        self.change(id, mark_outcome_unknown_change(remote_ref)?)
    }

    /// Operator call, unfenced: moves a `Pending`, `Dispatching` or
    /// `OutcomeUnknown` entry to `Pending` due at `next_attempt_at` (the
    /// claim, if any, is dropped; `attempt_count` stays). Otherwise
    /// [`Error::Conflict`].
    ///
    /// It takes no time, so it adds no [`AttemptRecord`] (the dispatcher's
    /// [`Settlement::Rescheduled`] does).
    pub fn reschedule(&self, id: OutboxId, next_attempt_at: DateTime<Utc>) -> Result<()> {
        self.change(
            id,
            Change::Rescheduled {
                next_attempt_at: micros(next_attempt_at),
                now: None,
            },
        )
    }

    /// Operator call: the one way out of a terminal status. Moves a `Failed`
    /// or `OutcomeUnknown` entry back to `Pending`, due at `next_attempt_at`,
    /// clearing `completed_at` and the claim (`attempt_count`,
    /// `last_failure` and `remote_ref` stay). Anything else is
    /// [`Error::Conflict`].
    pub fn requeue(&self, id: OutboxId, next_attempt_at: DateTime<Utc>) -> Result<()> {
        self.change(
            id,
            Change::Requeued {
                next_attempt_at: micros(next_attempt_at),
            },
        )
    }

    /// Cancels `id` at `now`: a `Pending` or `OutcomeUnknown` entry becomes
    /// `Failed` with `last_failure` [`REASON_CANCELLED`] and `completed_at =
    /// now`, leaves the due index (no dispatcher will claim it), is counted
    /// as failed, and gets an [`AttemptRecord`] with that reason. It wakes
    /// nobody.
    ///
    /// Cancelling an entry already cancelled (`Failed` with reason
    /// `cancelled`) is accepted and changes nothing. [`Error::Conflict`],
    /// changing nothing, for a `Dispatching` entry (a worker is sending it:
    /// cancel once its attempt is settled), a `Completed` one, and one
    /// `Failed` for another reason; [`Error::NotFound`] for an unknown id. A
    /// cancelled entry is finished: [`purge_finished`](Outbox::purge_finished)
    /// removes it in time, and [`requeue`](Outbox::requeue) brings it back.
    pub fn cancel(&self, id: OutboxId, now: DateTime<Utc>) -> Result<()> {
        self.change(id, Change::Cancelled { now: micros(now) })
    }

    /// Moves every `Dispatching` entry claimed strictly before
    /// `claimed_before` back to `Pending` (the reaper for crashed
    /// dispatchers) and returns their ids, oldest claim first. A released
    /// entry is due at its `claimed_at` — it was due then, so it is due
    /// immediately and keeps its place ahead of work that became due later.
    /// Costs what it releases (it walks the claims index, which holds
    /// `Dispatching` entries only: an `OutcomeUnknown` entry is never
    /// released).
    ///
    /// Commits in chunks of at most 1024 entries, oldest claim first (fewer
    /// once their payloads, which a release writes again, reach 4 MiB), each
    /// its own commit, so that releasing a large backlog (after an outage)
    /// never holds the writer for long: claims and settlements run between
    /// the chunks, dispatchers are woken as each chunk commits, and a reader
    /// may see part of the release done. A crash or an `Err` midway leaves
    /// the chunks committed before it released (and the rest claimed, for
    /// the next call); the failed chunk released nothing.
    pub fn release_expired_claims(&self, claimed_before: DateTime<Utc>) -> Result<Vec<OutboxId>> {
        let cutoff = micros(claimed_before);
        let mut released = Vec::new();
        loop {
            let (ids, more) = self.engine.execute(release_op(cutoff))?;
            if !ids.is_empty() {
                self.notify();
            }
            released.extend(ids);
            if !more {
                return Ok(released);
            }
        }
    }

    /// Deletes `Completed` and `Failed` entries whose `completed_at` is
    /// strictly before `finished_before`, with all their index rows and attempt
    /// history; returns how many. Costs what it removes, and reads of each
    /// entry only what its index rows are keyed by, not its payload. A
    /// purged entry's `(destination, idempotency_key)` can be enqueued
    /// again: purge only past the window in which duplicates can arrive.
    ///
    /// Commits in chunks of at most 1024 entries, earliest finished first,
    /// each its own commit, so that the first purge of a large backlog
    /// neither holds the writer (and every claim behind it) nor memory for
    /// long. A reader may see part of the purge done; a
    /// crash or an `Err` midway leaves the chunks committed before it
    /// purged, the rest for the next purge, and the failed chunk removed
    /// nothing.
    pub fn purge_finished(&self, finished_before: DateTime<Utc>) -> Result<u64> {
        let cutoff = micros(finished_before);
        let mut total = 0;
        loop {
            let (n, more) = self.engine.execute(purge_op(cutoff))?;
            total += n;
            if !more {
                return Ok(total);
            }
        }
    }

    /// A channel that receives `()` after a commit of this store's outbox
    /// that may have made work due sooner (enqueue, retry, reschedule,
    /// requeue, released claims), and after [`Outbox::notify`]. Signals
    /// coalesce: at most one waits in the channel. Dropping the receiver
    /// unsubscribes.
    pub fn subscribe(&self) -> Receiver<()> {
        self.notifier.subscribe()
    }

    /// Wakes every subscriber. The store calls it itself after every commit
    /// that made work due, the caller's own `Store::write`s included; call it
    /// by hand only after changing the clock a dispatcher reads.
    pub fn notify(&self) {
        self.notifier.notify();
    }

    /// Wakes the subscribers once the caller transaction in progress on this
    /// thread is durable (at once outside one).
    fn notify_after_commit(&self) {
        let notifier = self.notifier.clone();
        crate::engine::after_commit(move || notifier.notify());
    }

    /// Wakes the subscribers after a bulk settle that wrote: if one of its
    /// settlements may make work due and at least one was accepted.
    fn notify_if_settled(&self, wake: bool, settled: &[Result<()>]) {
        if wake && settled.iter().any(Result::is_ok) {
            self.notify();
        }
    }

    /// Applies an operator's unfenced `change` to `id` in its own commit.
    fn change(&self, id: OutboxId, change: Change) -> Result<()> {
        let (op, wake) = change_op(id, change, None);
        let (_, sooner) = self.engine.execute(op)?;
        self.notify_if(wake || sooner);
        Ok(())
    }

    /// Wakes the dispatchers if `wake`.
    fn notify_if(&self, wake: bool) {
        if wake {
            self.notify();
        }
    }

    /// `enqueue_many`'s checks, and its operation (`None`: nothing to
    /// enqueue).
    fn enqueue_op(
        &self,
        entries: impl IntoIterator<Item = NewEntry>,
        now: DateTime<Utc>,
    ) -> Result<Option<impl Fn(&WriteTransaction) -> Result<Vec<Enqueued>> + Send + 'static>> {
        let entries: Vec<NewEntry> = entries.into_iter().collect();
        for e in &entries {
            self.check_entry(e)?;
        }
        let now = micros(now);
        Ok((!entries.is_empty())
            .then_some(move |tx: &WriteTransaction| ops::enqueue(tx, &entries, now)))
    }

    /// What an enqueue answers, once it committed: the dispatchers woken if
    /// an entry is new.
    fn enqueued(&self, out: Vec<Enqueued>) -> Vec<Enqueued> {
        self.notify_if(out.iter().any(Enqueued::is_new));
        out
    }

    fn check_entry(&self, e: &NewEntry) -> Result<()> {
        check_entry(e, self.max_body)
    }
}

/// `claim`'s checks, and its operation (`None`: nothing to claim).
fn claim_op(
    now: DateTime<Utc>,
    request: &ClaimRequest,
) -> Result<Option<impl Fn(&WriteTransaction) -> Result<Vec<OutboxEntry>> + Send + 'static>> {
    request.check()?;
    let request = request.clone();
    let now = micros(now);
    Ok((request.limit > 0).then_some(move |tx: &WriteTransaction| ops::claim(tx, now, &request)))
}

/// The operation releasing one chunk of the claims made before `cutoff`
/// (µs): the ids released, and whether more remain.
fn release_op(
    cutoff: i64,
) -> impl Fn(&WriteTransaction) -> Result<(Vec<OutboxId>, bool)> + Send + 'static {
    move |tx: &WriteTransaction| ops::release_expired(tx, cutoff, MAINTENANCE_CHUNK, RELEASE_BYTES)
}

/// The operation purging one chunk of the entries finished before `cutoff`
/// (µs): how many, and whether more remain.
fn purge_op(cutoff: i64) -> impl Fn(&WriteTransaction) -> Result<(u64, bool)> + Send + 'static {
    move |tx: &WriteTransaction| ops::purge_finished(tx, cutoff, MAINTENANCE_CHUNK)
}

/// The operation applying `change` to `id` (fenced by `attempt` when
/// given), and whether it may make work due.
fn change_op(
    id: OutboxId,
    change: Change,
    attempt: Option<u32>,
) -> (
    impl Fn(&WriteTransaction) -> Result<(OutboxStatus, bool)> + Send + 'static,
    bool,
) {
    let wake = change.makes_work_due();
    (
        move |tx: &WriteTransaction| ops::change(tx, id.0, &change, attempt),
        wake,
    )
}

/// `settle_many`'s plan, as an operation and whether it may make work due
/// (`None`: nothing to settle).
#[expect(clippy::type_complexity, reason = "an operation and a flag")]
fn settle_many_op(
    settlements: impl IntoIterator<Item = (Fence, Settlement)>,
    now: DateTime<Utc>,
) -> Result<
    Option<(
        impl Fn(&WriteTransaction) -> Result<(Vec<Result<()>>, bool)> + Send + 'static,
        bool,
    )>,
> {
    let (changes, wake) = plan_settlements(settlements, now)?;
    Ok((!changes.is_empty()).then_some((
        move |tx: &WriteTransaction| ops::change_many(tx, &changes),
        wake,
    )))
}

/// `settle_and_claim_with`'s checks and plan, as one operation (if the
/// claim fails after the settlements wrote, the engine rolls the
/// settlements back with it) and whether it may make work due.
#[expect(clippy::type_complexity, reason = "an operation and a flag")]
fn settle_and_claim_op(
    settlements: impl IntoIterator<Item = (Fence, Settlement)>,
    now: DateTime<Utc>,
    request: &ClaimRequest,
) -> Result<(
    impl Fn(&WriteTransaction) -> Result<(Vec<Result<()>>, Vec<OutboxEntry>, bool)> + Send + 'static,
    bool,
)> {
    request.check()?;
    let (changes, wake) = plan_settle_and_claim(settlements, now, &request.worker_id)?;
    let request = request.clone();
    let now = micros(now);
    Ok((
        move |tx: &WriteTransaction| ops::settle_and_claim(tx, &changes, now, &request),
        wake,
    ))
}
