//! The dispatcher: the runtime that drives the [outbox](crate::outbox).
//! [`Dispatcher`] workers claim due entries (skip-locked: two workers never
//! get the same entry), call your `send`, and settle each attempt with its
//! [fence](crate::outbox#fencing), so a worker whose claim expired cannot
//! overwrite a newer attempt; a reaper hands back the claims of crashed
//! deliveries; an optional [`Janitor`] keeps the file small.
//!
//! ```
//! use std::time::Duration;
//! use idemstore::chrono::Utc;
//! use idemstore::{Delivery, Dispatcher, NewEntry, RetryPolicy, Store};
//!
//! # let dir = tempfile::tempdir().map_err(idemstore::Error::Io)?;
//! let store = Store::open(dir.path().join("app.idem"))?;
//! let inbox = store.inbox("orders")?;
//! let outbox = store.outbox();
//!
//! // The order's claim and its receipt e-mail commit together.
//! inbox.claim_with("order-42", Utc::now(), |tx| {
//!     let receipt = NewEntry::new("order-42", "mailer", "order-42/receipt", b"Thanks!".to_vec());
//!     outbox.enqueue_in(tx, receipt, Utc::now())
//! })?;
//!
//! let dispatcher = Dispatcher::builder(outbox.clone())
//!     .workers(2)
//!     .retry(RetryPolicy::exponential(Duration::from_secs(1), Duration::from_secs(600)).max_attempts(10))
//!     .start(|entry| {
//!         // Send entry.payload to entry.destination, passing entry.idempotency_key along.
//!         Delivery::Delivered
//!     })?;
//! // A program would go on with its work; this one waits for the receipt.
//! while outbox.counts()?.completed < 1 {
//!     std::thread::sleep(Duration::from_millis(1));
//! }
//! dispatcher.shutdown()?; // lets sends in flight finish; leaves nothing claimed
//! # Ok::<_, idemstore::Error>(())
//! ```
//!
//! # What `send` answers
//!
//! `send` returns a [`Delivery`]: `Delivered`; `Retry { reason }` (back-off
//! from the [`RetryPolicy`]: exponential, capped, with jitter; `Failed`
//! with reason `max_attempts` when the attempts run out); `RetryAt {
//! next_attempt_at, reason }` (the time the remote asked for); `Throttled
//! { next_attempt_at, reason }` (the remote asked the whole destination to
//! wait, as a 429 or a 503 with `Retry-After` does: the entry is retried
//! then, and no entry of its destination is claimed before then, by any
//! dispatcher on the store; counted in [`DispatchStats::retried`], and
//! not a failure for the destination's circuit breaker); `Failed {
//! reason }`; or `OutcomeUnknown { remote_ref }` (the request may have
//! happened: the entry is left for reconciliation). Every retryable
//! answer (`Retry`, `RetryAt`, `Throttled`, a panic) counts towards
//! `max_attempts`. A panicking `send`
//! counts as a retryable failure with reason `panic`. Each attempt that
//! fails, is given back or ends in doubt is kept in the entry's [attempt
//! history](crate::outbox#attempt-history).
//!
//! # Fair sharing
//!
//! While several destinations have due entries, none holds more than its
//! share of a dispatcher's workers (its threads; with `start_async`, its
//! sends in flight), with no policy to set: a slow destination's backlog
//! never takes every worker from the others, and a lone destination gets
//! them all. Each worker thread claims a batch of one destination
//! ([`ClaimRequest::one_destination`](crate::ClaimRequest::one_destination)),
//! so a slow destination delays only its own entries; the dispatcher
//! counts the workers busy with each destination, and a claim
//! [avoids](crate::ClaimRequest::avoid) those that hold
//! `ceil(workers / max(busy destinations, 2))` of them — half while only
//! one is busy, so a newcomer finds room — unless no other destination
//! has an entry to give. The async dispatcher does the same with its sends
//! in flight, and gives a free slot to a crowded destination's entry only
//! once its last claim showed that nothing else is due. A worker thread
//! stays with its destination until its batch is sent: a destination whose
//! entries come due while a lone one holds every thread gets its first
//! thread when one of those batches ends (a smaller
//! [`batch_size`](DispatcherBuilder::batch_size) shortens that wait; with
//! `start_async` it is the end of any one send). The counts are of one
//! dispatcher; a destination's
//! [`DestinationPolicy`](crate::DestinationPolicy) (a cap on entries in
//! flight, a rate limit, a circuit breaker) holds across every dispatcher
//! and process, in the store.
//!
//! # Two runtimes
//!
//! Both share one set of steps (claim and settle, retry, fencing, stats,
//! reaper, janitor):
//!
//! - **Threads**: [`DispatcherBuilder::start`] runs `workers(n)` threads of
//!   its own with a blocking `send`. [`DispatcherHandle::shutdown`] lets the
//!   sends in flight finish and gives back what was claimed but not sent.
//! - **Tasks** (cargo feature `tokio`): `DispatcherBuilder::start_async`
//!   runs the same dispatcher as tasks on the caller's runtime,
//!   `current_thread` or multi-thread, with an async `send`:
//!   `Fn(OutboxEntry) -> impl Future<Output = Delivery> + Send + 'static`
//!   (the entry by value, so that the future of an async client such as
//!   hyper or reqwest owns it). One task claims and settles, each send is a
//!   task, and `workers(n)` bounds the sends in flight — async sends are
//!   cheap, so set it well above the thread count when sends wait on the
//!   network. On both backends every store call it makes (a step that
//!   settles and claims, the reaper, the janitor) is an `_async` one that
//!   waits for its commit without holding a thread; none runs on tokio's
//!   blocking pool. An idle dispatcher waits for a wake-up or its next
//!   due time without holding a thread. `handle.shutdown().await` lets the
//!   sends in flight finish, settles them and gives back what was claimed
//!   but not sent; dropping the handle never blocks the runtime (the tasks
//!   stop on their own).
//!   Called outside a tokio runtime, `start_async` returns an `Error`.
//!
//! An async client (hyper, reqwest) belongs in `start_async`. Driven from a
//! `start` thread with `Handle::block_on`, its futures must be built inside
//! the `block_on` (`handle.block_on(async { client.get(..).await })`): one
//! built outside a runtime's context panics ("no reactor running"), and a
//! panicking `send` is retried as a failure with reason `panic` until its
//! attempts run out.
//!
//! # Guarantees
//!
//! Delivery is **at least once**. An entry is claimed (durably), sent, then
//! settled (durably). If the process dies between the send and the
//! settlement, the claim stays `Dispatching` until its lease runs out; then
//! the reaper of the next dispatcher on that store releases it and it is sent
//! again. Make `send` idempotent towards the remote (pass the entry's
//! `idempotency_key` along — that is what it is for), or accept duplicates.
//! A send slower than the lease may also be sent twice.
//!
//! The dispatcher uses only the outbox's public, fenced calls: a worker whose
//! claim expired and was taken over cannot overwrite the newer attempt's
//! outcome (its settlement is refused and counted in
//! [`DispatchStats::fenced`]). Workers settle a batch and claim the next in
//! one commit ([`Outbox::settle_and_claim`](crate::Outbox::settle_and_claim)).
//!
//! # Wake-ups
//!
//! No polling: an idle worker sleeps until the next entry may be claimed
//! ([`OutboxBackend::next_due`]: the earliest due entry, or for a
//! destination held back, the end of its hold or its circuit's cool-down,
//! or its rate limit's next token) or until a commit that made work due
//! wakes it ([`OutboxBackend::subscribe`]; an enqueue wakes an idle dispatcher at
//! once; async waiters are signalled by the same commits; on PostgreSQL,
//! the commits of every process on every machine, by `LISTEN/NOTIFY`, or
//! by polling once a second on engines without `LISTEN`). Never holds a
//! read transaction while waiting.
//!
//! # The janitor
//!
//! A [`Janitor`], run by a dispatcher ([`DispatcherBuilder::janitor`]) or
//! by hand ([`Janitor::run_once`]), prunes inboxes, purges finished outbox
//! entries and expired idempotency keys on a schedule. Its tasks and the
//! reaper commit at most 1024 rows per transaction, so even the first run
//! over a large backlog never holds the writer (and the claims behind it)
//! for long; a run cut short leaves whole chunks done.
//!
//! # Errors
//!
//! No error is swallowed, and a failed store call never stops a thread: the
//! worker, the reaper or the janitor backs off and tries again. Each failure
//! is counted in [`DispatchStats::store_errors`] and kept, with its time by
//! the dispatcher's clock and what failed, in [`DispatchStats::last_error`];
//! the janitor's runs, last report and last error are in
//! [`DispatchStats::janitor`]. A thread that panics (a [`Clock`] that
//! panicked: a panicking `send` is caught and retried) is kept there too,
//! and its join in [`DispatcherHandle::shutdown`] returns
//! [`Error::Panicked`]. So does a task of the async dispatcher, at its
//! `shutdown().await`; if the task that panicked is the one that claims,
//! the sends it had in flight end with it and their claims wait for a
//! reaper, as a panicked worker thread's do.
//!
//! # Backends
//!
//! [`Dispatcher::builder`] takes either store's outbox: the embedded
//! [`Outbox`](crate::Outbox) or, with feature `postgres`,
//! `postgres::PgOutbox` (see [`OutboxBackend`]). The steps, the guarantees
//! and the stats are the same; on PostgreSQL, dispatchers in many processes
//! share one outbox.

#[cfg(feature = "tokio")]
mod background;
mod clock;
mod janitor;
mod retry;
mod share;
mod stats;
#[cfg(feature = "tokio")]
mod tasks;
mod threads;
mod worker;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::backend::OutboxBackend;
use crate::error::{Error, Result};
use crate::outbox::{MAX_OUTBOX_FIELD_LEN, OutboxEntry, Settlement};

pub use clock::{Clock, ManualClock, SystemClock};
pub use janitor::{
    DEFAULT_JANITOR_INTERVAL, DEFAULT_RETENTION, Janitor, JanitorReport, JanitorStats,
};
pub use retry::{RetryPolicy, WEBHOOK_RETRY_DELAYS};
use stats::{Counters, bump};
pub use stats::{DispatchStats, LastError, LatencySummary};
#[cfg(feature = "tokio")]
pub use tasks::AsyncDispatcherHandle;
pub use threads::DispatcherHandle;
use worker::{Ctx, Rng};

/// What one `send` did, as the `send` function reports it.
///
/// May gain variants (`#[non_exhaustive]`): a sender's outcome may gain
/// kinds in a minor release. A `send` function builds these freely; code
/// that matches on one needs a `_` arm.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Delivery {
    /// The remote accepted it: the entry is `Completed`.
    Delivered,
    /// A retryable failure: try again after the [`RetryPolicy`]'s back-off
    /// (or fail for good with reason `max_attempts` when they are used up).
    ///
    /// Reasons and remote refs are stored as given, cut to
    /// [`MAX_OUTBOX_FIELD_LEN`] bytes; an
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
    /// The remote asked the whole destination to wait (a 429 or 503 with
    /// `Retry-After`): a retryable failure retried at `next_attempt_at`, as
    /// [`Delivery::RetryAt`], and, until then, no entry of the destination
    /// is claimed, by any dispatcher on the store
    /// ([`Settlement::Throttled`]). It does not count towards the
    /// destination's circuit breaker. When the attempts are used up, the
    /// entry fails for good with reason `max_attempts`, as a `Retry` does,
    /// and holds nothing back.
    Throttled {
        /// When to try again: the destination waits until then.
        next_attempt_at: DateTime<Utc>,
        /// A stable failure code, stored on the entry (`http_429`).
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

pub use crate::outbox::REASON_MAX_ATTEMPTS;
/// The reason stored on an entry whose `send` panicked.
pub const REASON_PANIC: &str = "panic";
/// The reason stored for a failure whose `send` gave an empty one.
const REASON_UNSPECIFIED: &str = "unspecified";

/// Default number of worker threads (with `start_async`: sends in flight): 2.
pub const DEFAULT_WORKERS: usize = 2;
/// Default number of entries a worker claims at once: 16.
pub const DEFAULT_BATCH_SIZE: usize = 16;
/// Default claim lease: 60 s. A claim older than this is released by the
/// reaper and the entry is sent again; set it above the slowest batch of
/// sends.
pub const DEFAULT_CLAIM_LEASE: Duration = Duration::from_secs(60);

/// Entry point: `Dispatcher::builder(outbox)…start(send)` (worker threads),
/// or `…start_async(send)` (tasks on a tokio runtime, feature `tokio`).
#[derive(Debug)]
pub struct Dispatcher;

impl Dispatcher {
    /// A dispatcher for `outbox`, with the defaults: the embedded store's
    /// [`Outbox`](crate::Outbox) or, with feature `postgres`,
    /// `postgres::PgOutbox` (any [`OutboxBackend`]). On PostgreSQL, any
    /// number of dispatchers in any number of processes share the outbox:
    /// each claim is taken by one of them, an enqueue anywhere wakes them
    /// all, and the reaper of any of them releases the claims of one that
    /// died.
    pub fn builder(outbox: impl OutboxBackend) -> DispatcherBuilder {
        DispatcherBuilder {
            outbox: Arc::new(outbox),
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
    outbox: Arc<dyn OutboxBackend>,
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
    /// Worker threads, each claiming and sending its own batches. With
    /// `start_async`: the most sends in flight at once (async sends are
    /// cheap: set it well above the runtime's thread count when sends wait
    /// on the network). Default: 2.
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n.max(1);
        self
    }

    /// The most entries a worker claims at once (all of one destination:
    /// see [fair sharing](crate::dispatch#fair-sharing)). With
    /// `start_async`: the most entries claimed ahead of a free send slot.
    /// Within it, a claim takes about 2 ms of sends at the send time the
    /// dispatcher measures (all of it when sends are fast; one entry when
    /// a send takes 2 ms or more), and at most what the worker can start of
    /// a destination with a cap or a rate. Default: 16.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// How long a claim holds its entry. Default: 60 s. The reaper releases
    /// claims older than this (a crashed process's entries are sent again),
    /// so it must exceed the time a worker needs for one batch of sends
    /// (with `start_async`: the slowest send, plus the wait of an entry
    /// claimed ahead for a free slot, which for a destination that holds
    /// its [share](crate::dispatch#fair-sharing) of the slots is the wait
    /// for one of its own sends to end).
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

    /// The prefix of the workers' ids (`{prefix}-{n}`; with `start_async`,
    /// `{prefix}-async`), stored on their claims. Default: `dispatcher`.
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

    /// Checks the settings and sets up what every runtime shares.
    fn into_parts(self) -> Result<Parts> {
        if self.worker_id.is_empty() || self.worker_id.len() > 200 {
            return Err(Error::invalid("worker_id", "must be 1 to 200 bytes"));
        }
        let ctx = Ctx {
            outbox: self.outbox,
            clock: self.clock,
            retry: self.retry,
            batch_size: self.batch_size,
            lease: self.lease,
            stopping: AtomicBool::new(false),
            counters: Counters::new(self.janitor.is_some()),
            send_time: worker::SendTime::default(),
        };
        Ok(Parts {
            ctx,
            workers: self.workers,
            worker_id: self.worker_id,
            janitor: self.janitor,
        })
    }
}

/// A checked [`DispatcherBuilder`], ready for a runtime to start.
struct Parts {
    ctx: Ctx,
    workers: usize,
    worker_id: String,
    janitor: Option<Janitor>,
}

/// How to settle `entry` after its `send` returned `outcome` (or panicked).
fn settle_for(
    ctx: &Ctx,
    entry: &OutboxEntry,
    outcome: std::thread::Result<Delivery>,
    rng: &mut Rng,
) -> Settlement {
    if outcome.is_err() {
        bump(&ctx.counters.panics, 1);
    }
    settlement(&ctx.retry, entry, outcome.ok(), ctx.clock.now(), || {
        rng.unit()
    })
}

/// How to settle `entry` after its send answered `delivery` (`None`: it
/// panicked) at `now`, under `retry`; `unit` draws the back-off's jitter
/// (in `[0, 1)`) when there is one. The dispatchers' rule, which
/// `testing::drain` follows too.
pub(crate) fn settlement(
    retry: &RetryPolicy,
    entry: &OutboxEntry,
    delivery: Option<Delivery>,
    now: DateTime<Utc>,
    unit: impl FnOnce() -> f64,
) -> Settlement {
    let (reason, next_attempt_at) = match delivery {
        Some(Delivery::Delivered) => return Settlement::Completed,
        Some(Delivery::Failed { reason }) => {
            return Settlement::Failed {
                reason: stored_reason(reason),
                next_attempt_at: None,
            };
        }
        Some(Delivery::OutcomeUnknown { remote_ref }) => {
            return Settlement::OutcomeUnknown {
                remote_ref: stored_remote_ref(remote_ref),
            };
        }
        Some(Delivery::Retry { reason }) => (stored_reason(reason), None),
        Some(Delivery::RetryAt {
            next_attempt_at,
            reason,
        }) => (stored_reason(reason), Some(next_attempt_at)),
        Some(Delivery::Throttled {
            next_attempt_at,
            reason,
        }) => {
            let reason = stored_reason(reason);
            return if entry.attempt_count >= retry.attempts() {
                out_of_attempts(reason)
            } else {
                Settlement::Throttled {
                    reason,
                    next_attempt_at,
                }
            };
        }
        None => (REASON_PANIC.to_owned(), None),
    };
    match retry.next_attempt(entry.attempt_count, now, unit()) {
        None => out_of_attempts(reason),
        Some(backoff) => Settlement::Failed {
            reason,
            next_attempt_at: Some(next_attempt_at.unwrap_or(backoff)),
        },
    }
}

/// The settlement of an attempt that failed with `reason` when the
/// attempts ran out. The entry's `last_failure` is the code,
/// `max_attempts`; the detail in parentheses keeps this attempt's own
/// reason in its history (`max_attempts (http_500)`), cut so that the
/// whole fits the field.
fn out_of_attempts(mut reason: String) -> Settlement {
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
