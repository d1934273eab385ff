//! The runtime that drives the outbox: [`Dispatcher`] workers that claim due
//! entries and call your `send`, a reaper for crashed deliveries, and an
//! optional [`Janitor`].
//!
//! # Guarantees
//!
//! Delivery is **at least once**. An entry is claimed (durably), sent, then
//! settled (durably). If the process dies between the send and the
//! settlement, the claim stays `Dispatching` until its lease runs out; then
//! the reaper of the next dispatcher on that file releases it and it is sent
//! again. Make `send` idempotent towards the remote (pass the entry's
//! `idempotency_key` along — that is what it is for), or accept duplicates.
//!
//! The dispatcher uses only the outbox's public, fenced calls: a worker whose
//! claim expired and was taken over cannot overwrite the newer attempt's
//! outcome (its settlement is refused and counted in
//! [`DispatchStats::fenced`]).
//!
//! # Errors
//!
//! A failed store call never stops a thread: the worker, the reaper or the
//! janitor backs off and tries again. Each failure is counted in
//! [`DispatchStats::store_errors`] and kept, with its time by the
//! dispatcher's clock and what failed, in [`DispatchStats::last_error`]; the
//! janitor's runs and its last error are in [`DispatchStats::janitor`]. A
//! thread that panics (a [`Clock`] that panicked: a panicking `send` is
//! caught and retried) is kept there too, and its join in
//! [`DispatcherHandle::shutdown`] returns [`Error::Panicked`].
//!
//! # Wake-ups
//!
//! No polling: an idle worker sleeps until the earliest due entry
//! ([`Outbox::next_due`]) or until a commit that made work due wakes it
//! ([`Outbox::subscribe`]). Never holds a read transaction while waiting.

mod clock;
mod janitor;
mod retry;
mod stats;

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use chrono::{DateTime, Utc};
use crossbeam_channel::{Receiver, Sender, select};

use crate::error::{Error, Result};
use crate::outbox::{Fence, MAX_OUTBOX_FIELD_LEN, Outbox, OutboxEntry, Settlement};

pub use clock::{Clock, ManualClock, SystemClock};
pub use janitor::{
    DEFAULT_JANITOR_INTERVAL, DEFAULT_RETENTION, Janitor, JanitorReport, JanitorStats,
};
pub use retry::RetryPolicy;
use stats::{Counters, bump};
pub use stats::{DispatchStats, LastError, LatencySummary};

/// What one `send` did, as the `send` function reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    /// The remote accepted it: the entry is `Completed`.
    Delivered,
    /// A retryable failure: try again after the [`RetryPolicy`]'s back-off
    /// (or fail for good with reason `max_attempts` when they are used up).
    ///
    /// Reasons and remote refs are stored as given, cut to
    /// [`MAX_OUTBOX_FIELD_LEN`](crate::MAX_OUTBOX_FIELD_LEN) bytes; an
    /// empty reason is stored as `unspecified`.
    Retry {
        /// A stable failure code, stored on the entry.
        reason: String,
    },
    /// A retryable failure with the time the remote asked for (`Retry-After`).
    RetryAt {
        /// When to try again.
        next_attempt_at: DateTime<Utc>,
        /// A stable failure code, stored on the entry.
        reason: String,
    },
    /// A permanent failure: the entry is `Failed`.
    Failed {
        /// A stable failure code, stored on the entry.
        reason: String,
    },
    /// The send may or may not have happened (a timeout after the request
    /// left): the entry is `OutcomeUnknown`, for reconciliation.
    OutcomeUnknown {
        /// The remote's reference for the attempt, if one came back.
        remote_ref: Option<String>,
    },
}

/// The reason stored on an entry whose attempts ran out.
pub const REASON_MAX_ATTEMPTS: &str = "max_attempts";
/// The reason stored on an entry whose `send` panicked.
pub const REASON_PANIC: &str = "panic";
/// The reason stored for a failure whose `send` gave an empty one.
const REASON_UNSPECIFIED: &str = "unspecified";

/// Default number of worker threads: 2.
pub const DEFAULT_WORKERS: usize = 2;
/// Default number of entries a worker claims at once: 16.
pub const DEFAULT_BATCH_SIZE: usize = 16;
/// Default claim lease: 60 s. A claim older than this is released by the
/// reaper and the entry is sent again; set it above the slowest batch of
/// sends.
pub const DEFAULT_CLAIM_LEASE: Duration = Duration::from_secs(60);

/// Entry point: `Dispatcher::builder(outbox)…start(send)`.
#[derive(Debug)]
pub struct Dispatcher;

impl Dispatcher {
    /// A dispatcher for `outbox`, with the defaults.
    pub fn builder(outbox: Outbox) -> DispatcherBuilder {
        DispatcherBuilder {
            outbox,
            workers: DEFAULT_WORKERS,
            batch_size: DEFAULT_BATCH_SIZE,
            lease: DEFAULT_CLAIM_LEASE,
            retry: RetryPolicy::default(),
            clock: Arc::new(SystemClock),
            worker_id: "dispatcher".into(),
            janitor: None,
        }
    }
}

/// How to run a [`Dispatcher`]. Every setter states its default.
#[must_use]
pub struct DispatcherBuilder {
    outbox: Outbox,
    workers: usize,
    batch_size: usize,
    lease: Duration,
    retry: RetryPolicy,
    clock: Arc<dyn Clock>,
    worker_id: String,
    janitor: Option<Janitor>,
}

impl std::fmt::Debug for DispatcherBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DispatcherBuilder")
            .field("workers", &self.workers)
            .field("batch_size", &self.batch_size)
            .field("lease", &self.lease)
            .field("retry", &self.retry)
            .field("worker_id", &self.worker_id)
            .finish_non_exhaustive()
    }
}

impl DispatcherBuilder {
    /// Worker threads, each claiming and sending its own batches. Default: 2.
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n.max(1);
        self
    }

    /// Entries a worker claims at once. Default: 16.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// How long a claim holds its entry. Default: 60 s. The reaper releases
    /// claims older than this (a crashed process's entries are sent again),
    /// so it must exceed the time a worker needs for one batch of sends.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(1));
        self
    }

    /// The back-off for retries. Default: [`RetryPolicy::default`].
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// Where `now` comes from. Default: [`SystemClock`].
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The prefix of the workers' ids (`{prefix}-{n}`), stored on their
    /// claims. Default: `dispatcher`.
    pub fn worker_id(mut self, prefix: impl Into<String>) -> Self {
        self.worker_id = prefix.into();
        self
    }

    /// Runs `janitor` on its schedule beside the workers; its runs, last
    /// report and last error are in [`DispatchStats::janitor`]. Default:
    /// none.
    pub fn janitor(mut self, janitor: Janitor) -> Self {
        self.janitor = Some(janitor);
        self
    }

    /// Starts the workers, the reaper and the janitor; `send` is called for
    /// each claimed entry, from the worker threads (never twice at once for
    /// one entry while its claim is live).
    pub fn start(
        self,
        send: impl Fn(&OutboxEntry) -> Delivery + Send + Sync + 'static,
    ) -> Result<DispatcherHandle> {
        if self.worker_id.is_empty() || self.worker_id.len() > 200 {
            return Err(Error::invalid("worker_id", "must be 1 to 200 bytes"));
        }
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        let ctx = Arc::new(Ctx {
            outbox: self.outbox,
            send: Box::new(send),
            clock: self.clock,
            retry: self.retry,
            batch_size: self.batch_size,
            lease: self.lease,
            stopping: AtomicBool::new(false),
            counters: Counters::new(self.janitor.is_some()),
        });
        // From here on, an early return drops the handle, which stops and
        // joins the threads already started.
        let mut handle = DispatcherHandle {
            ctx,
            stop: Some(stop_tx),
            threads: Vec::new(),
        };
        // The reaper first, so a restart releases a crashed run's claims
        // before the workers look for work.
        handle.start_thread("idemstore-reaper".into(), REAPER_THREAD, &stop_rx, reaper)?;
        for i in 0..self.workers {
            let id = format!("{}-{i}", self.worker_id);
            let name = format!("idemstore-{id}");
            handle.start_thread(name, WORKER_THREAD, &stop_rx, move |c, stop| {
                worker(c, &id, stop);
            })?;
        }
        if let Some(janitor) = self.janitor {
            let name = "idemstore-janitor".into();
            handle.start_thread(name, JANITOR_THREAD, &stop_rx, move |c, stop| {
                janitor.run(&*c.clock, stop, &|at, outcome| {
                    c.counters.janitor_run(at, outcome);
                });
            })?;
        }
        Ok(handle)
    }
}

/// What a worker thread was when it panicked ([`Error::Panicked`]'s `during`).
const WORKER_THREAD: &str = "a dispatcher worker thread";
/// What the reaper thread was when it panicked.
const REAPER_THREAD: &str = "the dispatcher's reaper thread";
/// What the janitor thread was when it panicked.
const JANITOR_THREAD: &str = "the dispatcher's janitor thread";

/// A running dispatcher. Dropping it shuts it down too (and waits), but
/// [`DispatcherHandle::shutdown`] reports how that went.
pub struct DispatcherHandle {
    ctx: Arc<Ctx>,
    stop: Option<Sender<()>>,
    /// Each thread, with what it is ([`Error::Panicked`]'s `during`).
    threads: Vec<(&'static str, JoinHandle<()>)>,
}

impl std::fmt::Debug for DispatcherHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DispatcherHandle")
            .field("threads", &self.threads.len())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl DispatcherHandle {
    /// Starts one of the dispatcher's threads, `name`, running `body` with
    /// the dispatcher's context and the stop signal. A panic in it is kept
    /// as the last error, then goes on to end the thread (its join reports
    /// it, as `during`).
    fn start_thread(
        &mut self,
        name: String,
        during: &'static str,
        stop: &Receiver<()>,
        body: impl FnOnce(&Ctx, &Receiver<()>) + Send + 'static,
    ) -> Result<()> {
        let (ctx, stop) = (self.ctx.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                if let Err(payload) = catch_unwind(AssertUnwindSafe(|| body(&ctx, &stop))) {
                    // The clock may be what panicked: then the system's time.
                    let at = catch_unwind(AssertUnwindSafe(|| ctx.clock.now()))
                        .unwrap_or_else(|_| Utc::now());
                    let error = Error::panicked(during, &*payload);
                    ctx.counters.last_error(LastError::new(at, during, &error));
                    resume_unwind(payload);
                }
            })
            .map_err(Error::Io)?;
        self.threads.push((during, thread));
        Ok(())
    }

    /// What the dispatcher did so far, its last error and its janitor's
    /// runs.
    pub fn stats(&self) -> DispatchStats {
        self.ctx.counters.snapshot()
    }

    /// Stops claiming, lets the sends in progress finish and settles them,
    /// gives the rest of each claimed batch back (`Pending`, due now), and
    /// returns once every thread has stopped. A clean shutdown leaves no
    /// entry `Dispatching`. If a thread had panicked, [`Error::Panicked`]
    /// (for the first one joined; the others were still joined).
    pub fn shutdown(mut self) -> Result<()> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<()> {
        self.ctx.stopping.store(true, Ordering::SeqCst);
        drop(self.stop.take());
        let mut first_panic = None;
        for (during, thread) in self.threads.drain(..) {
            if let Err(payload) = thread.join() {
                first_panic.get_or_insert_with(|| Error::panicked(during, &*payload));
            }
        }
        first_panic.map_or(Ok(()), Err)
    }
}

impl Drop for DispatcherHandle {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}

type SendFn = Box<dyn Fn(&OutboxEntry) -> Delivery + Send + Sync>;

struct Ctx {
    outbox: Outbox,
    send: SendFn,
    clock: Arc<dyn Clock>,
    retry: RetryPolicy,
    batch_size: usize,
    lease: Duration,
    stopping: AtomicBool,
    counters: Counters,
}

impl Ctx {
    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Waits until `deadline` (by the clock), a wake-up, a clock change or
    /// the stop signal; returns `false` on stop.
    fn wait(
        &self,
        deadline: Option<DateTime<Utc>>,
        cap: Duration,
        wake: &Receiver<()>,
        changes: &Receiver<()>,
        stop: &Receiver<()>,
    ) -> bool {
        let timeout = deadline
            .map_or(cap, |d| {
                (d - self.clock.now()).to_std().unwrap_or(Duration::ZERO)
            })
            .min(cap);
        if timeout.is_zero() {
            return !self.stopping();
        }
        select! {
            recv(stop) -> _ => false,
            recv(wake) -> _ => !self.stopping(),
            recv(changes) -> _ => !self.stopping(),
            default(timeout) => !self.stopping(),
        }
    }

    /// Counts and keeps a failed store call.
    fn store_error(&self, during: &'static str, error: &Error) {
        self.counters.store_error(self.clock.now(), during, error);
    }

    /// Backs off after a failed store call (counted and kept).
    fn back_off(&self, during: &'static str, error: &Error, stop: &Receiver<()>) -> bool {
        self.store_error(during, error);
        select! {
            recv(stop) -> _ => false,
            default(Duration::from_millis(100)) => !self.stopping(),
        }
    }
}

/// The longest an idle worker sleeps before looking again (a safety net:
/// wake-ups normally come first).
const IDLE_CAP: Duration = Duration::from_secs(60);

fn worker(ctx: &Ctx, worker_id: &str, stop: &Receiver<()>) {
    let wake = ctx.outbox.subscribe();
    let changes = ctx.clock.changes().unwrap_or_else(crossbeam_channel::never);
    let mut rng = Rng::seeded(worker_id);
    // The settlements of the last batch, committed together with the next
    // claim: one durable commit per batch instead of two.
    let mut settlements: Vec<(Fence, Settlement)> = Vec::new();
    while !ctx.stopping() {
        let limit = ctx.batch_size;
        let outcome = ctx.outbox.settle_and_claim(
            settlements.iter().cloned(),
            ctx.clock.now(),
            limit,
            worker_id,
        );
        let claimed = match outcome {
            Ok((settled, claimed)) => {
                settlements.clear();
                count_fenced(ctx, &settled);
                Ok(claimed)
            }
            // The call wrote nothing. The settlements are made one by one,
            // so that one damaged record holds back neither the others nor
            // this worker; those that fail for a storage error are kept and
            // offered again (settling the same attempt the same way twice is
            // accepted).
            Err(e) => {
                settle_apart(ctx, &mut settlements);
                Err(e)
            }
        };
        let entries = match claimed {
            Ok(entries) => entries,
            Err(e) => {
                if !ctx.back_off("claim", &e, stop) {
                    break;
                }
                continue;
            }
        };
        if entries.is_empty() {
            let next = match ctx.outbox.next_due() {
                Ok(next) => next,
                Err(e) => {
                    if !ctx.back_off("next_due", &e, stop) {
                        break;
                    }
                    continue;
                }
            };
            if !ctx.wait(next, IDLE_CAP, &wake, &changes, stop) {
                break;
            }
            continue;
        }
        settlements = deliver_batch(ctx, &entries, &mut rng);
    }
    // Settle what was sent before stopping.
    if !settlements.is_empty() {
        match ctx.outbox.settle_many(settlements, ctx.clock.now()) {
            Ok(settled) => count_fenced(ctx, &settled),
            Err(e) => ctx.store_error("settle", &e),
        }
    }
}

/// Settles each of `settlements` on its own, after a call that made them
/// together failed; keeps those that failed for a storage error, to offer
/// them again.
fn settle_apart(ctx: &Ctx, settlements: &mut Vec<(Fence, Settlement)>) {
    let now = ctx.clock.now();
    let mut kept = Vec::new();
    for (fence, settlement) in settlements.drain(..) {
        let answer = ctx.outbox.settle(fence, settlement.clone(), now);
        if count_answer(ctx, &answer) {
            kept.push((fence, settlement));
        }
    }
    *settlements = kept;
}

/// Counts the store's answers to a batch of settlements (see
/// [`count_answer`]).
fn count_fenced(ctx: &Ctx, settled: &[Result<()>]) {
    for answer in settled {
        count_answer(ctx, answer);
    }
}

/// Counts the store's answer to one settlement: refused by its fence (the
/// entry moved on, or was purged since), or failed otherwise (a store
/// error). Returns whether it failed for a storage error, so that offering
/// it again may succeed.
fn count_answer(ctx: &Ctx, answer: &Result<()>) -> bool {
    match answer {
        Ok(()) => false,
        Err(Error::Conflict { .. } | Error::NotFound) => {
            bump(&ctx.counters.fenced, 1);
            false
        }
        Err(e) => {
            ctx.store_error("settle", e);
            e.is_storage()
        }
    }
}

/// Sends each entry of a claimed batch; returns how to settle each.
fn deliver_batch(ctx: &Ctx, entries: &[OutboxEntry], rng: &mut Rng) -> Vec<(Fence, Settlement)> {
    let mut settlements = Vec::with_capacity(entries.len());
    let mut settle = |entry: &OutboxEntry, settlement: Settlement| {
        ctx.counters.settled(&settlement);
        settlements.push((entry.fence(), settlement));
    };
    for (i, entry) in entries.iter().enumerate() {
        if ctx.stopping() {
            // Give the unsent rest back, due now.
            let now = ctx.clock.now();
            for rest in entries.iter().skip(i) {
                settle(
                    rest,
                    Settlement::Rescheduled {
                        next_attempt_at: now,
                    },
                );
            }
            break;
        }
        let started = ctx.clock.now();
        let first_try = entry.attempt_count == 1 && entry.next_attempt_at.is_none();
        if let (true, Ok(latency)) = (first_try, (started - entry.created_at).to_std()) {
            ctx.counters.latency.lock().record(latency);
        }
        let outcome = catch_unwind(AssertUnwindSafe(|| (ctx.send)(entry)));
        settle(entry, settle_for(ctx, entry, outcome, rng));
    }
    settlements
}

/// How to settle `entry` after its `send` returned `outcome` (or panicked).
fn settle_for(
    ctx: &Ctx,
    entry: &OutboxEntry,
    outcome: std::thread::Result<Delivery>,
    rng: &mut Rng,
) -> Settlement {
    let (reason, next_attempt_at) = match outcome {
        Ok(Delivery::Delivered) => return Settlement::Completed,
        Ok(Delivery::Failed { reason }) => {
            return Settlement::Failed {
                reason: stored_reason(reason),
                next_attempt_at: None,
            };
        }
        Ok(Delivery::OutcomeUnknown { remote_ref }) => {
            return Settlement::OutcomeUnknown {
                remote_ref: stored_remote_ref(remote_ref),
            };
        }
        Ok(Delivery::Retry { reason }) => (stored_reason(reason), None),
        Ok(Delivery::RetryAt {
            next_attempt_at,
            reason,
        }) => (stored_reason(reason), Some(next_attempt_at)),
        Err(_) => {
            bump(&ctx.counters.panics, 1);
            (REASON_PANIC.to_owned(), None)
        }
    };
    let now = ctx.clock.now();
    match ctx.retry.next_attempt(entry.attempt_count, now, rng.unit()) {
        // The attempts ran out. The entry's `last_failure` is the code,
        // `max_attempts`; the detail in parentheses keeps this attempt's own
        // reason in its history (`max_attempts (http_500)`), cut so that the
        // whole fits the field.
        None => {
            let mut reason = reason;
            let mut room = MAX_OUTBOX_FIELD_LEN.saturating_sub(REASON_MAX_ATTEMPTS.len() + 3);
            if reason.len() > room {
                while !reason.is_char_boundary(room) {
                    room -= 1;
                }
                reason.truncate(room);
            }
            Settlement::Failed {
                reason: format!("{REASON_MAX_ATTEMPTS} ({reason})"),
                next_attempt_at: None,
            }
        }
        Some(backoff) => Settlement::Failed {
            reason,
            next_attempt_at: Some(next_attempt_at.unwrap_or(backoff)),
        },
    }
}

/// A failure code as stored: empty becomes `unspecified`, and one longer
/// than the outbox accepts is cut (a dispatcher must settle every attempt,
/// whatever its `send` returned).
fn stored_reason(reason: String) -> String {
    if reason.is_empty() {
        REASON_UNSPECIFIED.to_owned()
    } else {
        cut_to_field_len(reason)
    }
}

/// A remote reference as stored: none if empty, and one longer than the
/// outbox accepts is cut.
fn stored_remote_ref(remote_ref: Option<String>) -> Option<String> {
    remote_ref.filter(|r| !r.is_empty()).map(cut_to_field_len)
}

/// `s` cut to [`MAX_OUTBOX_FIELD_LEN`] bytes, at a character boundary.
fn cut_to_field_len(mut s: String) -> String {
    if s.len() > MAX_OUTBOX_FIELD_LEN {
        let mut end = MAX_OUTBOX_FIELD_LEN;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

/// Releases claims older than the lease, every half lease (and at once on
/// start).
fn reaper(ctx: &Ctx, stop: &Receiver<()>) {
    let never = crossbeam_channel::never();
    let changes = ctx.clock.changes().unwrap_or_else(crossbeam_channel::never);
    let lease = chrono::Duration::from_std(ctx.lease).unwrap_or(chrono::Duration::MAX);
    while !ctx.stopping() {
        let now = ctx.clock.now();
        let cutoff = now
            .checked_sub_signed(lease)
            .unwrap_or(DateTime::<Utc>::MIN_UTC);
        match ctx.outbox.release_expired_claims(cutoff) {
            Ok(ids) => bump(&ctx.counters.released, ids.len() as u64),
            Err(e) => ctx.counters.store_error(now, "reaper", &e),
        }
        if !ctx.wait(
            None,
            (ctx.lease / 2).max(Duration::from_millis(1)),
            &never,
            &changes,
            stop,
        ) {
            break;
        }
    }
}

/// A small xorshift generator for jitter: no dependency, seeded per worker.
struct Rng(u64);

impl Rng {
    fn seeded(worker_id: &str) -> Rng {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64 ^ u64::from(std::process::id());
        for b in worker_id.bytes() {
            seed = (seed ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        seed ^= u64::try_from(Utc::now().timestamp_micros()).unwrap_or(1);
        Rng(seed | 1)
    }

    /// A number in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}
