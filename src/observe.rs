//! What the store reports: one plain function per event, which the rest of
//! the crate calls where the event happens, and which sends it to the
//! [`tracing`](https://docs.rs/tracing/0.1) facade (cargo feature `tracing`)
//! and the [`metrics`](https://docs.rs/metrics/0.24) facade (feature
//! `metrics`). Without either feature every function here has an empty
//! body and compiles to nothing, and [`Stopwatch`] reads no clock: a call
//! site costs nothing, so call sites carry no `cfg` of their own.
//!
//! The application installs the subscriber or the recorder; this module only
//! emits. The crate docs' "Observability" section (in `lib.rs`) lists
//! every metric (name, type, labels) and every tracing target with its
//! levels; this file is where they are emitted, and a change to one is a
//! change to the other.
//!
//! # Rules
//!
//! - Names start with `idemstore_`; tracing targets with `idemstore::`.
//! - Label values are `&'static str`, except the inbox name, which the inbox
//!   already holds in an `Arc<str>` (the facade shares it, no copy), and a
//!   destination, whose label is an `Arc<str>` from a bounded set: the first
//!   64 distinct destinations a process reports get their own name as their
//!   label, every later one `_other` (`labels`), so that a process sending
//!   to many destinations never grows its recorder without end. So with
//!   static labels the metric keys are statics: no allocation per event on
//!   the hot path beyond what the facades need.
//! - Durations go to histograms in seconds, to tracing in whole
//!   microseconds (`*_us` fields).
//! - Nothing here reads the wall clock for a storage call's logic: the
//!   [`Stopwatch`] only measures how long a commit or a run took.
//! - The facades call code the store does not own (the application's
//!   subscriber and recorder), so every report here runs under
//!   [`catch_unwind`](std::panic::catch_unwind) and a panic in it is
//!   dropped: it never reaches the caller, never changes an answer and
//!   never leaves the store's state half-updated. The engine makes its own
//!   reports only once the callers of a commit are answered and with none
//!   of its locks held (see `engine`), so a recorder that blocks or panics
//!   delays nobody else's call.
//!
//! Depends on `error` and std only (and the facades); anything may call it.

// Without both features, some arguments and helpers are used by neither.
#![cfg_attr(
    not(all(feature = "tracing", feature = "metrics")),
    allow(unused_variables, dead_code, clippy::unused_self)
)]

use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;

/// Whether any report goes anywhere (either feature is on). A call site
/// that must do work of its own to report (register an after-commit hook)
/// checks it first; it is a constant, so the check compiles away.
pub(crate) const ENABLED: bool = cfg!(any(feature = "tracing", feature = "metrics"));

/// Whether metrics are reported (feature `metrics`); a constant.
pub(crate) const METRICS: bool = cfg!(feature = "metrics");

/// Measures how long something took, for a report. Without the features it
/// is empty and starting it reads no clock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stopwatch {
    #[cfg(any(feature = "tracing", feature = "metrics"))]
    started: std::time::Instant,
}

impl Stopwatch {
    /// Starts measuring now.
    #[inline]
    pub(crate) fn start() -> Stopwatch {
        Stopwatch {
            #[cfg(any(feature = "tracing", feature = "metrics"))]
            started: std::time::Instant::now(),
        }
    }

    #[cfg(any(feature = "tracing", feature = "metrics"))]
    fn elapsed(self) -> Duration {
        self.started.elapsed()
    }

    /// Stops measuring: how long it ran, to report later.
    #[inline]
    pub(crate) fn stop(self) -> Elapsed {
        Elapsed {
            #[cfg(any(feature = "tracing", feature = "metrics"))]
            took: self.elapsed(),
        }
    }
}

/// How long something took, measured by a [`Stopwatch`] and reported
/// afterwards. Empty without the features.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Elapsed {
    #[cfg(any(feature = "tracing", feature = "metrics"))]
    took: Duration,
}

/// Runs one report, dropping any panic of the subscriber or recorder it
/// calls: telemetry never changes what a call answers.
#[inline]
fn guarded(report: impl FnOnce()) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(report));
}

/// A duration in whole microseconds, for a tracing field.
#[cfg(feature = "tracing")]
fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// A metric handle whose one label takes one of a few values, each arm
/// with literals: every arm's key is a static, so registering it allocates
/// nothing.
#[cfg(feature = "metrics")]
macro_rules! labelled {
    ($kind:ident!($name:literal, $label:literal), $value:expr, {$($pat:pat => $text:literal),+ $(,)?}) => {
        match $value {
            $($pat => metrics::$kind!($name, $label => $text),)+
        }
    };
    // With a second label, `$key` (its value, `$other`, not a static).
    ($kind:ident!($name:literal, $label:literal, $key:literal => $other:expr), $value:expr, {$($pat:pat => $text:literal),+ $(,)?}) => {
        match $value {
            $($pat => metrics::$kind!($name, $label => $text, $key => $other),)+
        }
    };
}

/// A commit counter or histogram, by durability.
#[cfg(feature = "metrics")]
macro_rules! by_durability {
    ($kind:ident!($name:literal), $durable:expr) => {
        labelled!($kind!($name, "durable"), $durable, {true => "true", false => "false"})
    };
}

/// A dispatch counter or histogram, by outcome and destination (its
/// bounded label: see `labels`).
#[cfg(feature = "metrics")]
macro_rules! by_outcome {
    ($kind:ident!($name:literal), $outcome:expr, $destination:expr) => {
        labelled!($kind!($name, "outcome", "destination" => $destination), $outcome, {
            Settled::Delivered => "delivered",
            Settled::Retried => "retried",
            Settled::Failed => "failed",
            Settled::OutcomeUnknown => "outcome_unknown",
            Settled::Returned => "returned",
        })
    };
}

// ---------------------------------------------------------------- engine

/// A batch of `ops` queued operations committed in one write transaction,
/// durably (fsync) or not, in `commit`.
#[inline]
pub(crate) fn batch_committed(ops: usize, durable: bool, commit: Elapsed) {
    guarded(|| {
        #[cfg(any(feature = "tracing", feature = "metrics"))]
        let took = commit.took;
        #[cfg(feature = "tracing")]
        tracing::trace!(
            target: "idemstore::engine",
            ops,
            durable,
            commit_us = micros(took),
            "batch committed"
        );
        #[cfg(feature = "metrics")]
        {
            by_durability!(counter!("idemstore_commits_total"), durable).increment(1);
            by_durability!(histogram!("idemstore_commit_seconds"), durable)
                .record(took.as_secs_f64());
            metrics::histogram!("idemstore_batch_ops").record(ops as f64);
        }
    });
}

/// A caller's own write transaction (`Store::write`, a `claim_with`
/// effect) committed, without fsync: a later durable batch covers it.
#[inline]
pub(crate) fn own_write_committed(commit: Elapsed) {
    guarded(|| {
        #[cfg(any(feature = "tracing", feature = "metrics"))]
        let took = commit.took;
        #[cfg(feature = "tracing")]
        tracing::trace!(
            target: "idemstore::engine",
            durable = false,
            commit_us = micros(took),
            "caller transaction committed"
        );
        #[cfg(feature = "metrics")]
        {
            metrics::counter!("idemstore_commits_total", "durable" => "false").increment(1);
            metrics::histogram!("idemstore_commit_seconds", "durable" => "false")
                .record(took.as_secs_f64());
        }
    });
}

/// The engine was marked broken while `during`, because of `error`: it
/// refuses every write until the store is reopened.
#[inline]
pub(crate) fn engine_broken(during: &'static str, error: &Error) {
    guarded(|| {
        #[cfg(feature = "tracing")]
        tracing::error!(
            target: "idemstore::engine",
            during,
            error = %error,
            "the store refuses writes until it is reopened"
        );
        #[cfg(feature = "metrics")]
        metrics::counter!("idemstore_errors_total", "during" => during).increment(1);
    });
}

// ---------------------------------------------------------------- inbox

/// Claims in `inbox` as they were answered, one answer per key: `true`
/// for a first delivery, `false` for a duplicate.
#[inline]
pub(crate) fn claims(inbox: &Arc<str>, answers: &[bool]) {
    guarded(|| {
        #[cfg(feature = "metrics")]
        {
            let applied = answers.iter().filter(|a| **a).count() as u64;
            count_claims(inbox, applied, answers.len() as u64 - applied);
        }
    });
}

/// One claim in `inbox`: the first delivery (`applied`) or a duplicate.
#[inline]
pub(crate) fn claim(inbox: &Arc<str>, applied: bool) {
    guarded(|| {
        #[cfg(feature = "metrics")]
        count_claims(inbox, u64::from(applied), u64::from(!applied));
    });
}

#[cfg(feature = "metrics")]
fn count_claims(inbox: &Arc<str>, applied: u64, duplicates: u64) {
    if applied > 0 {
        metrics::counter!("idemstore_inbox_claims_total", "inbox" => Arc::clone(inbox))
            .increment(applied);
    }
    if duplicates > 0 {
        metrics::counter!("idemstore_inbox_duplicates_total", "inbox" => Arc::clone(inbox))
            .increment(duplicates);
    }
}

// ---------------------------------------------------------- idempotency

/// What a request with an idempotency key was told, or how its completion
/// went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Idempotency {
    /// `begin`: the key was free (or its response expired) and is reserved.
    Proceed,
    /// `begin`: a reservation whose lease ended was taken over.
    Takeover,
    /// `begin`: the stored response is replayed.
    Replay,
    /// `begin`: another request with the key is still running.
    InFlight,
    /// `begin`: the key was used for another request.
    Mismatch,
    /// `complete`: the response is stored.
    Stored,
    /// `complete`: the reservation no longer held the key; nothing stored.
    FencedOut,
}

/// An idempotency-key outcome.
#[inline]
pub(crate) fn idempotency(outcome: Idempotency) {
    guarded(|| {
        #[cfg(feature = "metrics")]
        {
            use Idempotency as I;
            let counter = match outcome {
                I::Proceed => {
                    metrics::counter!("idemstore_idempotency_begins_total", "outcome" => "proceed")
                }
                I::Takeover => {
                    metrics::counter!("idemstore_idempotency_begins_total", "outcome" => "takeover")
                }
                I::Replay => {
                    metrics::counter!("idemstore_idempotency_begins_total", "outcome" => "replay")
                }
                I::InFlight => {
                    metrics::counter!("idemstore_idempotency_begins_total", "outcome" => "in_flight")
                }
                I::Mismatch => {
                    metrics::counter!("idemstore_idempotency_begins_total", "outcome" => "mismatch")
                }
                I::Stored => {
                    metrics::counter!("idemstore_idempotency_completions_total", "outcome" => "stored")
                }
                I::FencedOut => {
                    metrics::counter!("idemstore_idempotency_completions_total", "outcome" => "fenced_out")
                }
            };
            counter.increment(1);
        }
    });
}

// --------------------------------------------------------------- outbox

/// How many outbox entries are in each status, as one write transaction
/// left them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OutboxDepth {
    /// Its place in the order of the transactions (see
    /// [`OutboxDepth::new`]).
    #[cfg(feature = "metrics")]
    ticket: u64,
    pending: u64,
    dispatching: u64,
    completed: u64,
    failed: u64,
    outcome_unknown: u64,
}

/// The last ticket taken, and the newest one published.
#[cfg(feature = "metrics")]
static DEPTH_TICKETS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
#[cfg(feature = "metrics")]
static DEPTH_PUBLISHED: std::sync::Mutex<u64> = std::sync::Mutex::new(0);

impl OutboxDepth {
    /// The counts a write transaction leaves, read while it holds redb's
    /// writer lock, so that the order in which they are made is the order
    /// of the commits: [`outbox_depth`] publishes them after the commit,
    /// and a depth published late (a caller's transaction whose hooks run
    /// after those of a later batch) never overwrites a newer one.
    pub(crate) fn new(
        pending: u64,
        dispatching: u64,
        completed: u64,
        failed: u64,
        outcome_unknown: u64,
    ) -> OutboxDepth {
        OutboxDepth {
            #[cfg(feature = "metrics")]
            ticket: DEPTH_TICKETS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1,
            pending,
            dispatching,
            completed,
            failed,
            outcome_unknown,
        }
    }
}

/// The outbox's depth once the write transaction that left it committed:
/// sets the gauge of every status, unless a newer depth is already set.
#[inline]
pub(crate) fn outbox_depth(depth: &OutboxDepth) {
    guarded(|| {
        #[cfg(feature = "metrics")]
        publish_depth(&DEPTH_PUBLISHED, depth);
    });
}

/// The outbox's depth as a count on the server just read it (PostgreSQL,
/// which keeps no counts in its transactions): newer than any depth set
/// before, so it sets the gauge of every status. The ticket is taken and
/// the gauges set in one step under the lock, so no depth taken earlier
/// overwrites it.
#[inline]
#[cfg(feature = "postgres")]
pub(crate) fn outbox_depth_counted(
    pending: u64,
    dispatching: u64,
    completed: u64,
    failed: u64,
    outcome_unknown: u64,
) {
    guarded(|| {
        #[cfg(feature = "metrics")]
        {
            let mut published = DEPTH_PUBLISHED
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let depth = OutboxDepth::new(pending, dispatching, completed, failed, outcome_unknown);
            *published = depth.ticket;
            metrics::gauge!("idemstore_outbox_entries", "status" => "pending")
                .set(depth.pending as f64);
            metrics::gauge!("idemstore_outbox_entries", "status" => "dispatching")
                .set(depth.dispatching as f64);
            metrics::gauge!("idemstore_outbox_entries", "status" => "completed")
                .set(depth.completed as f64);
            metrics::gauge!("idemstore_outbox_entries", "status" => "failed")
                .set(depth.failed as f64);
            metrics::gauge!("idemstore_outbox_entries", "status" => "outcome_unknown")
                .set(depth.outcome_unknown as f64);
        }
    });
}

/// Sets the depth gauges to `depth`, unless `published` (the newest ticket
/// set so far, which it then becomes) is newer. The check and the setting
/// are one step under its lock.
#[cfg(feature = "metrics")]
fn publish_depth(published: &std::sync::Mutex<u64>, depth: &OutboxDepth) {
    let mut published = published
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if depth.ticket <= *published {
        return;
    }
    *published = depth.ticket;
    metrics::gauge!("idemstore_outbox_entries", "status" => "pending").set(depth.pending as f64);
    metrics::gauge!("idemstore_outbox_entries", "status" => "dispatching")
        .set(depth.dispatching as f64);
    metrics::gauge!("idemstore_outbox_entries", "status" => "completed")
        .set(depth.completed as f64);
    metrics::gauge!("idemstore_outbox_entries", "status" => "failed").set(depth.failed as f64);
    metrics::gauge!("idemstore_outbox_entries", "status" => "outcome_unknown")
        .set(depth.outcome_unknown as f64);
}

// ------------------------------------------------------------- dispatch

/// How a dispatcher settled an attempt (or gave an entry back unsent):
/// the words of [`DispatchStats`](crate::DispatchStats)' counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    /// The send delivered: `Completed`.
    Delivered,
    /// A retryable failure, retried later.
    Retried,
    /// Failed for good (a permanent failure, or attempts used up).
    Failed,
    /// The send may or may not have happened.
    OutcomeUnknown,
    /// Given back unsent at shutdown.
    Returned,
}

impl Settled {
    fn as_str(self) -> &'static str {
        match self {
            Settled::Delivered => "delivered",
            Settled::Retried => "retried",
            Settled::Failed => "failed",
            Settled::OutcomeUnknown => "outcome_unknown",
            Settled::Returned => "returned",
        }
    }
}

/// A dispatcher settled an entry for `destination` with `outcome`
/// (counted once per settlement, whatever the store then answers).
#[inline]
pub(crate) fn settled(destination: &str, outcome: Settled) {
    guarded(|| {
        #[cfg(feature = "metrics")]
        {
            let destination = labels::destination_label(destination);
            by_outcome!(
                counter!("idemstore_dispatch_outcomes_total"),
                outcome,
                destination
            )
            .increment(1);
        }
    });
}

/// One attempt of a dispatcher: entry `id` for `destination`, its attempt
/// number, how it is settled (with the failure code, for a failure), and
/// how long its `send` took.
#[inline]
pub(crate) fn attempt(
    id: u64,
    destination: &str,
    attempt: u32,
    outcome: Settled,
    reason: Option<&str>,
    took: Duration,
) {
    guarded(|| {
        #[cfg(feature = "tracing")]
        {
            macro_rules! attempt_event {
                ($level:expr) => {
                    tracing::event!(
                        target: "idemstore::dispatch",
                        $level,
                        id,
                        destination,
                        attempt,
                        outcome = outcome.as_str(),
                        reason,
                        latency_us = micros(took),
                        "attempt"
                    )
                };
            }
            match outcome {
                Settled::Delivered | Settled::Returned => attempt_event!(tracing::Level::DEBUG),
                Settled::Retried => attempt_event!(tracing::Level::INFO),
                Settled::Failed | Settled::OutcomeUnknown => attempt_event!(tracing::Level::WARN),
            }
        }
        #[cfg(feature = "metrics")]
        {
            let destination = labels::destination_label(destination);
            by_outcome!(
                histogram!("idemstore_dispatch_send_seconds"),
                outcome,
                destination
            )
            .record(took.as_secs_f64());
        }
    });
}

/// A dispatcher's send to `destination` started (`true`) or ended: the
/// sends in flight per destination, summed over the process's dispatchers.
#[inline]
pub(crate) fn in_flight(destination: &str, started: bool) {
    guarded(|| {
        #[cfg(feature = "metrics")]
        {
            let destination = labels::destination_label(destination);
            let gauge =
                metrics::gauge!("idemstore_dispatch_in_flight", "destination" => destination);
            if started {
                gauge.increment(1.0);
            } else {
                gauge.decrement(1.0);
            }
        }
    });
}

/// The time from an entry's enqueue to the start of its first send (for
/// entries due at once).
#[inline]
pub(crate) fn dispatch_latency(latency: Duration) {
    guarded(|| {
        #[cfg(feature = "metrics")]
        metrics::histogram!("idemstore_dispatch_latency_seconds").record(latency.as_secs_f64());
    });
}

/// `n` settlements refused because their claim had expired and the entry
/// had moved on.
#[inline]
pub(crate) fn fenced(n: u64) {
    guarded(|| {
        #[cfg(feature = "tracing")]
        tracing::warn!(
            target: "idemstore::dispatch",
            settlements = n,
            "settlement refused: the claim had expired and the entry moved on \
             (raise the lease above the slowest batch of sends)"
        );
        #[cfg(feature = "metrics")]
        metrics::counter!("idemstore_dispatch_fenced_total").increment(n);
    });
}

/// `n` sends panicked (each is retried as a failure with reason `panic`).
#[inline]
pub(crate) fn send_panicked(n: u64) {
    guarded(|| {
        #[cfg(feature = "tracing")]
        tracing::warn!(target: "idemstore::dispatch", sends = n, "send panicked; retried as a failure");
        #[cfg(feature = "metrics")]
        metrics::counter!("idemstore_dispatch_panics_total").increment(n);
    });
}

/// The reaper released `n` expired claims (their entries are due again).
#[inline]
pub(crate) fn reaper_released(n: u64) {
    guarded(|| {
        #[cfg(feature = "tracing")]
        if n > 0 {
            tracing::warn!(
                target: "idemstore::dispatch",
                released = n,
                "reaper released expired claims: a dispatcher died or its sends outlasted the lease"
            );
        }
        #[cfg(feature = "metrics")]
        metrics::counter!("idemstore_reaper_released_total").increment(n);
    });
}

/// A janitor run that removed what it reports, in `run`'s time.
#[inline]
pub(crate) fn janitor_run(outbox_purged: u64, inbox_pruned: u64, keys_purged: u64, run: Stopwatch) {
    guarded(|| {
        #[cfg(feature = "tracing")]
        tracing::info!(
            target: "idemstore::janitor",
            outbox_purged,
            inbox_pruned,
            keys_purged,
            run_us = micros(run.elapsed()),
            "janitor run"
        );
        #[cfg(feature = "metrics")]
        {
            let removed = |what: &'static str, n: u64| {
                metrics::counter!("idemstore_janitor_removed_total", "what" => what).increment(n);
            };
            removed("outbox", outbox_purged);
            removed("inbox", inbox_pruned);
            removed("keys", keys_purged);
        }
    });
}

// --------------------------------------------------------------- errors

/// A store call failed in a runtime thread (a dispatcher's worker, its
/// reaper, a janitor, a shared store's watch of other processes), which
/// backs off and carries on.
#[inline]
pub(crate) fn store_error(during: &'static str, error: &Error) {
    guarded(|| {
        #[cfg(feature = "tracing")]
        tracing::warn!(
            target: "idemstore::dispatch",
            during,
            error = %error,
            "store call failed; backing off"
        );
        #[cfg(feature = "metrics")]
        metrics::counter!("idemstore_errors_total", "during" => during).increment(1);
    });
}

/// A runtime thread (`during` names it) gave up: it panicked with
/// `message`.
#[inline]
pub(crate) fn thread_panicked(during: &'static str, message: &str) {
    guarded(|| {
        #[cfg(feature = "tracing")]
        tracing::error!(
            target: "idemstore::dispatch",
            during,
            error = message,
            "thread stopped by a panic"
        );
        #[cfg(feature = "metrics")]
        metrics::counter!("idemstore_errors_total", "during" => during).increment(1);
    });
}

// ----------------------------------------------------------- middleware

#[cfg(feature = "middleware")]
/// How the `IdempotencyLayer` answered a request itself, from what `begin`
/// said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LayerAnswer {
    /// The stored response was sent again.
    Replay,
    /// 409: another request with the key is running; retry after
    /// `retry_after_s` seconds.
    InFlight { retry_after_s: u64 },
    /// 422: the key belongs to another request.
    Mismatch,
}

#[cfg(feature = "middleware")]
/// The layer answered a request with `key` from the store (a replay, a
/// 409, a 422): a `debug` event. Counted already by `begin`
/// (`idemstore_idempotency_begins_total`).
#[inline]
pub(crate) fn layer_answered(answer: LayerAnswer, key: &str) {
    guarded(|| {
        #[cfg(feature = "tracing")]
        match answer {
            LayerAnswer::Replay => tracing::debug!(
                target: "idemstore::middleware",
                key,
                "stored response replayed"
            ),
            LayerAnswer::InFlight { retry_after_s } => tracing::debug!(
                target: "idemstore::middleware",
                key,
                retry_after_s,
                "request in flight; answered 409"
            ),
            LayerAnswer::Mismatch => tracing::debug!(
                target: "idemstore::middleware",
                key,
                "key reused for another request; answered 422"
            ),
        }
    });
}

#[cfg(feature = "middleware")]
/// A store call of the layer failed `during` one of its steps (`error`
/// says how): for `idempotency_begin` the request was answered 503 without
/// running the handler (an `error` event); for `idempotency_complete` or
/// `idempotency_release` the handler's response was sent unstored and the
/// key is left to its lease (a `warn` event). Counted in
/// `idemstore_errors_total`.
#[inline]
pub(crate) fn layer_store_failed(during: &'static str, key: &str, error: &dyn std::fmt::Display) {
    guarded(|| {
        #[cfg(feature = "tracing")]
        if during == "idempotency_begin" {
            tracing::error!(
                target: "idemstore::middleware",
                during,
                key,
                error = %error,
                "idempotency store failed; answered 503"
            );
        } else {
            tracing::warn!(
                target: "idemstore::middleware",
                during,
                key,
                error = %error,
                "idempotency store failed after the handler ran"
            );
        }
        #[cfg(feature = "metrics")]
        metrics::counter!("idemstore_errors_total", "during" => during).increment(1);
    });
}

#[cfg(feature = "middleware")]
/// The layer was called outside a tokio runtime, where it cannot run a
/// store call without blocking the caller's executor: the request was
/// answered 500 without running the handler. An `error` event, counted in
/// `idemstore_errors_total` (`during`: `middleware_runtime`).
#[inline]
pub(crate) fn layer_without_runtime(key: &str) {
    guarded(|| {
        #[cfg(feature = "tracing")]
        tracing::error!(
            target: "idemstore::middleware",
            during = "middleware_runtime",
            key,
            "no tokio runtime: the IdempotencyLayer needs one for its store calls; answered 500"
        );
        #[cfg(feature = "metrics")]
        metrics::counter!("idemstore_errors_total", "during" => "middleware_runtime").increment(1);
    });
}

// ------------------------------------------------------------- describe

/// Describes every metric the store reports (`# HELP` text and unit) to
/// the installed recorder.
///
/// The dispatch metrics carry a `destination` label from a bounded set:
/// the first 64 distinct destinations a process reports get their own name
/// as their label, every later one shares `_other`, so that sending to many
/// destinations never grows the recorder without end.
///
/// The store calls it whenever one is opened ([`Store::open`](crate::Store::open)
/// and its builder, `PgStore::connect`), so a recorder installed before
/// that gets the descriptions with nothing more to do. A recorder
/// installed later (after the stores are open) gets them when you call
/// this once it is installed. Calling it again is harmless: a description
/// replaces the same one.
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub fn describe_metrics() {
    guarded(describe::all);
}

/// What opening a store reports: with feature `metrics`, every metric's
/// description ([`describe_metrics`]); nothing without it.
pub(crate) fn describe_on_open() {
    #[cfg(feature = "metrics")]
    describe_metrics();
}

/// The description of every metric.
#[cfg(feature = "metrics")]
mod describe;

/// The bounded set of destination labels.
#[cfg(feature = "metrics")]
mod labels;

/// The capturing subscriber and recorder of the integration tests.
#[cfg(all(test, feature = "tracing", feature = "metrics"))]
pub(crate) mod capture;

#[cfg(all(test, feature = "tracing", feature = "metrics"))]
mod tests {
    use super::capture::Metrics;
    use super::*;

    #[test]
    fn a_depth_published_late_never_overwrites_a_newer_one() {
        let metrics = Metrics::default();
        let published = std::sync::Mutex::new(0);
        // Two commits, in this order; the second one's hooks run first.
        let first = OutboxDepth::new(1, 0, 0, 0, 0);
        let second = OutboxDepth::new(0, 1, 0, 0, 0);
        metrics::with_local_recorder(&metrics, || {
            publish_depth(&published, &second);
            publish_depth(&published, &first);
        });
        let depth = |status| metrics.gauge("idemstore_outbox_entries", &[("status", status)]);
        assert_eq!(depth("pending"), Some(0.0));
        assert_eq!(depth("dispatching"), Some(1.0));
        // A newer one still does.
        let third = OutboxDepth::new(0, 0, 1, 0, 0);
        metrics::with_local_recorder(&metrics, || publish_depth(&published, &third));
        assert_eq!(depth("dispatching"), Some(0.0));
        assert_eq!(depth("completed"), Some(1.0));
    }
}
