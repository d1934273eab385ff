//! The dispatcher's steps, shared by its two runtimes: worker threads
//! (`threads.rs`) and, with feature `tokio`, tasks (`tasks.rs`). A runtime
//! decides when to take a step and how to wait between steps; what a step
//! does — which store call, how its answer and its errors are counted, how
//! a send's outcome becomes a settlement — is here, once.
//!
//! A step that calls the store (which may fsync) has a blocking form, for
//! the worker threads, and an `_async` form through the store's async calls,
//! for the tasks; the two share what comes before and after the call.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::clock::Clock;
use super::retry::RetryPolicy;
use super::settle_for;
use super::stats::{Counters, EnqueueLatency, bump};
use crate::backend::OutboxBackend;
use crate::error::{Error, Result};
use crate::observe;
use crate::outbox::{ClaimRequest, Fence, OutboxEntry, Settlement};

/// The longest an idle worker sleeps before looking again (a safety net:
/// wake-ups normally come first).
pub(super) const IDLE_CAP: Duration = Duration::from_secs(60);

/// How long a worker waits after a failed store call before trying again.
pub(super) const BACK_OFF: Duration = Duration::from_millis(100);

/// What a dispatcher's runtime shares with its workers, reaper and janitor.
pub(super) struct Ctx {
    /// Either backend's outbox (see [`OutboxBackend`] for why a `dyn`).
    pub(super) outbox: Arc<dyn OutboxBackend>,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) retry: RetryPolicy,
    pub(super) batch_size: usize,
    pub(super) lease: Duration,
    pub(super) stopping: AtomicBool,
    pub(super) counters: Counters,
    /// How long a send takes, as measured ([`SendTime`]).
    pub(super) send_time: SendTime,
}

/// How much claimed work a worker holds before it can start it: claims are
/// sized so that the entries claimed ahead of their sends are about this
/// much sending time. Claiming costs one commit per claim; at 2 ms of sends
/// per claim, a durable commit (~200 µs, shared by the claims of every
/// worker) adds at most a tenth, while no entry waits in a busy worker for
/// much longer than another worker would take to start it.
pub(super) const CLAIM_AHEAD: Duration = Duration::from_millis(2);

/// A dispatcher's running estimate of how long one send takes: an
/// exponentially weighted mean of every send's time (µs; 0 before the
/// first send), updated without a lock.
#[derive(Debug, Default)]
pub(super) struct SendTime(AtomicU64);

impl SendTime {
    /// Counts one send that took `took`.
    pub(super) fn record(&self, took: Duration) {
        let took = u64::try_from(took.as_micros()).unwrap_or(u64::MAX).max(1);
        // A lost update between two racing sends only drops one sample.
        let old = self.0.load(Ordering::Relaxed);
        let new = if old == 0 {
            took
        } else {
            old - old / 8 + took / 8
        };
        self.0.store(new.max(1), Ordering::Relaxed);
    }

    /// The estimate, `None` before the first send.
    pub(super) fn get(&self) -> Option<Duration> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }

    /// How many sends fit in [`CLAIM_AHEAD`] on `workers` workers at the
    /// estimated send time, at most `batch`; `unknown` before the first
    /// send.
    pub(super) fn ahead(&self, workers: usize, batch: usize, unknown: usize) -> usize {
        let Some(each) = self.get() else {
            return unknown.min(batch);
        };
        let each = each.as_micros().max(1);
        let fit = CLAIM_AHEAD.as_micros().saturating_mul(workers as u128) / each;
        usize::try_from(fit).unwrap_or(usize::MAX).min(batch)
    }
}

impl Ctx {
    pub(super) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Tells every worker to stop claiming.
    pub(super) fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// Counts and keeps a failed store call.
    pub(super) fn store_error(&self, during: &'static str, error: &Error) {
        self.counters.store_error(self.clock.now(), during, error);
    }

    /// How long to wait for `deadline` (by the clock; none: the cap), at
    /// most `cap`. Zero when it has passed.
    pub(super) fn timeout(&self, deadline: Option<DateTime<Utc>>, cap: Duration) -> Duration {
        deadline
            .map_or(cap, |d| {
                (d - self.clock.now()).to_std().unwrap_or(Duration::ZERO)
            })
            .min(cap)
    }
}

/// A store call failed; it was counted and kept as the last error. The
/// worker waits [`BACK_OFF`] (or until stopped), then tries again.
#[derive(Debug)]
pub(super) struct BackOff;

/// A worker's store call between two batches: settles the last batch's
/// `settlements` and claims what `request` asks for, in one commit (one
/// fsync instead of two).
///
/// On success `settlements` is emptied (a settlement refused by its fence is
/// counted in `fenced`). If the call fails it wrote nothing: the
/// settlements are then made one by one, so that one damaged record holds
/// back neither the others nor the worker, and those that fail for a
/// storage error stay in `settlements`, to be offered again (settling the
/// same attempt the same way twice is accepted); the failure is counted as
/// `"claim"`.
pub(super) fn claim_cycle(
    ctx: &Ctx,
    settlements: &mut Vec<(Fence, Settlement)>,
    request: &ClaimRequest,
) -> Result<Vec<OutboxEntry>, BackOff> {
    let outcome = ctx
        .outbox
        .settle_and_claim_with(settlements.clone(), ctx.clock.now(), request);
    claimed(ctx, settlements, outcome)
}

/// What a worker's step came to: the settlements it made are done (and
/// the fenced ones counted), or on a failure settled one by one (blocking:
/// a storage error's rare path) and kept if that fails too.
pub(super) fn claimed(
    ctx: &Ctx,
    settlements: &mut Vec<(Fence, Settlement)>,
    outcome: crate::Result<crate::SettledAndClaimed>,
) -> Result<Vec<OutboxEntry>, BackOff> {
    match outcome {
        Ok((settled, claimed)) => {
            settlements.clear();
            count_fenced(ctx, &settled);
            Ok(claimed)
        }
        Err(e) => {
            settle_apart(ctx, settlements);
            ctx.store_error("claim", &e);
            Err(BackOff)
        }
    }
}

/// [`claimed`] through the backend's async calls (the async dispatcher).
#[cfg(feature = "tokio")]
pub(super) async fn claimed_async(
    ctx: &Ctx,
    settlements: &mut Vec<(Fence, Settlement)>,
    outcome: crate::Result<crate::SettledAndClaimed>,
) -> Result<Vec<OutboxEntry>, BackOff> {
    match outcome {
        Err(e) => {
            settle_apart_async(ctx, settlements).await;
            ctx.store_error("claim", &e);
            Err(BackOff)
        }
        ok => claimed(ctx, settlements, ok),
    }
}

/// The scheduler's step: fires the schedules due at the clock's now
/// (enqueueing one entry per due slot: see
/// [`Outbox::set_schedule`](crate::Outbox::set_schedule)) and tells when
/// the next one is due. A failure is counted as `"schedules"`.
pub(super) fn fire_schedules(ctx: &Ctx) -> Result<Option<DateTime<Utc>>, BackOff> {
    let now = ctx.clock.now();
    // Most wake-ups are other commits with no slot due: one look then.
    let fired = ctx.outbox.next_schedule_slot().and_then(|next| match next {
        Some(at) if at <= now => ctx
            .outbox
            .fire_schedules(now)
            .and_then(|_| ctx.outbox.next_schedule_slot()),
        later => Ok(later),
    });
    fired.map_err(|e| {
        ctx.store_error("schedules", &e);
        BackOff
    })
}

/// [`fire_schedules`] through the backend's async calls.
#[cfg(feature = "tokio")]
pub(super) async fn fire_schedules_async(ctx: &Ctx) -> Result<Option<DateTime<Utc>>, BackOff> {
    let now = ctx.clock.now();
    let fired = match ctx.outbox.next_schedule_slot_async().await {
        Ok(Some(at)) if at <= now => match ctx.outbox.fire_schedules_async(now).await {
            Ok(_) => ctx.outbox.next_schedule_slot_async().await,
            Err(e) => Err(e),
        },
        later => later,
    };
    fired.map_err(|e| {
        ctx.store_error("schedules", &e);
        BackOff
    })
}

/// When the next entry is due ([`OutboxBackend::next_due`]), for an idle worker's
/// sleep; a failure is counted as `"next_due"`.
pub(super) fn next_due(ctx: &Ctx) -> Result<Option<DateTime<Utc>>, BackOff> {
    ctx.outbox.next_due().map_err(|e| {
        ctx.store_error("next_due", &e);
        BackOff
    })
}

/// Settles what a stopping worker sent and had not settled yet, in one
/// commit; a failure is counted as `"settle"` (the claims left behind are
/// released by the next reaper once their lease runs out).
pub(super) fn settle_last(ctx: &Ctx, settlements: Vec<(Fence, Settlement)>) {
    if settlements.is_empty() {
        return;
    }
    settled_last(ctx, &ctx.outbox.settle_many(settlements, ctx.clock.now()));
}

/// [`settle_last`] through the backend's async calls.
#[cfg(feature = "tokio")]
pub(super) async fn settle_last_async(ctx: &Ctx, settlements: Vec<(Fence, Settlement)>) {
    if settlements.is_empty() {
        return;
    }
    let settled = ctx
        .outbox
        .settle_many_async(settlements, ctx.clock.now())
        .await;
    settled_last(ctx, &settled);
}

/// Counts the answer to a stopping worker's last settlements.
fn settled_last(ctx: &Ctx, settled: &Result<Vec<Result<()>>>) {
    match settled {
        Ok(settled) => count_fenced(ctx, settled),
        Err(e) => ctx.store_error("settle", e),
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

/// [`settle_apart`] through the backend's async calls.
#[cfg(feature = "tokio")]
async fn settle_apart_async(ctx: &Ctx, settlements: &mut Vec<(Fence, Settlement)>) {
    let now = ctx.clock.now();
    let mut kept = Vec::new();
    for (fence, settlement) in settlements.drain(..) {
        let answer = ctx
            .outbox
            .settle_async(fence, settlement.clone(), now)
            .await;
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

/// Notes that `entry`'s send starts now: one more send in flight to its
/// destination (reported), and on its first attempt, when it was due at
/// once, its enqueue → send latency. Returns the start, by the
/// dispatcher's clock, for [`sent`] (which takes the send off).
pub(super) fn sending(ctx: &Ctx, entry: &OutboxEntry) -> DateTime<Utc> {
    observe::in_flight(&entry.destination, true);
    let started = ctx.clock.now();
    let first_try = entry.attempt_count == 1 && entry.next_attempt_at.is_none();
    if let (true, Ok(latency)) = (first_try, (started - entry.created_at).to_std()) {
        EnqueueLatency::record(&ctx.counters.latency, latency);
    }
    started
}

/// How to settle `entry` after its send, begun at `started`, returned
/// `outcome` (or panicked: the panic's payload), counted and reported.
pub(super) fn sent(
    ctx: &Ctx,
    entry: &OutboxEntry,
    started: DateTime<Utc>,
    outcome: std::thread::Result<super::Delivery>,
    rng: &mut Rng,
) -> (Fence, Settlement) {
    observe::in_flight(&entry.destination, false);
    let settlement = settle_for(ctx, entry, outcome, rng);
    ctx.counters.settled(entry, &settlement);
    let took = (ctx.clock.now() - started).to_std().unwrap_or_default();
    ctx.counters.attempted(entry, &settlement, took);
    ctx.send_time.record(took);
    (entry.fence(), settlement)
}

/// Gives `entry`, claimed but not sent, back: `Pending`, due `now`, without
/// a failure; counted in `returned`.
pub(super) fn give_back(ctx: &Ctx, entry: &OutboxEntry, now: DateTime<Utc>) -> (Fence, Settlement) {
    let settlement = Settlement::Rescheduled {
        next_attempt_at: now,
    };
    ctx.counters.settled(entry, &settlement);
    (entry.fence(), settlement)
}

/// The reaper's step: releases the claims older than the lease (their
/// entries are due at once); a failure is counted as `"reaper"`.
pub(super) fn reap(ctx: &Ctx) {
    let (now, cutoff) = reap_cutoff(ctx);
    reaped(ctx, now, &ctx.outbox.release_expired_claims(cutoff));
}

/// [`reap`] through the backend's async calls.
#[cfg(feature = "tokio")]
pub(super) async fn reap_async(ctx: &Ctx) {
    let (now, cutoff) = reap_cutoff(ctx);
    let released = ctx.outbox.release_expired_claims_async(cutoff).await;
    reaped(ctx, now, &released);
}

/// The time of a reaper step, and the claims it releases: those made more
/// than a lease before it.
fn reap_cutoff(ctx: &Ctx) -> (DateTime<Utc>, DateTime<Utc>) {
    let lease = chrono::Duration::from_std(ctx.lease).unwrap_or(chrono::Duration::MAX);
    let now = ctx.clock.now();
    let cutoff = now
        .checked_sub_signed(lease)
        .unwrap_or(DateTime::<Utc>::MIN_UTC);
    (now, cutoff)
}

/// Counts what a reaper step at `now` released, or its failure.
fn reaped(ctx: &Ctx, now: DateTime<Utc>, released: &Result<Vec<crate::OutboxId>>) {
    match released {
        Ok(ids) => bump(&ctx.counters.released, ids.len() as u64),
        Err(e) => ctx.counters.store_error(now, "reaper", e),
    }
}

/// Time between two reaper steps: half the lease (a clock change ends the
/// wait early).
pub(super) fn reaper_period(ctx: &Ctx) -> Duration {
    (ctx.lease / 2).max(Duration::from_millis(1))
}

/// A small xorshift generator for jitter: no dependency, seeded per worker.
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn seeded(worker_id: &str) -> Rng {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64 ^ u64::from(std::process::id());
        for b in worker_id.bytes() {
            seed = (seed ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        seed ^= u64::try_from(Utc::now().timestamp_micros()).unwrap_or(1);
        Rng(seed | 1)
    }

    /// A number in `[0, 1)`.
    pub(super) fn unit(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}
