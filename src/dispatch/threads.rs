//! The dispatcher on threads: [`DispatcherBuilder::start`] and its
//! [`DispatcherHandle`]. Each worker thread claims a batch of one
//! destination, sends it in order, then settles it together with the next
//! claim; the reaper and the janitor have a thread each. The steps are
//! `worker.rs`'s.
//!
//! A batch holds one destination's entries only, so a slow destination
//! delays its own entries, never another's; and a worker's claim avoids
//! the destinations that already hold their share of the workers
//! (`share.rs`), so a slow destination's backlog never takes every worker
//! while another destination has entries due.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use crossbeam_channel::{Receiver, Sender, select};

use parking_lot::Mutex;

use super::share::{Busy, Target};
use super::stats::{DispatchStats, LastError};
use super::worker::{self, BACK_OFF, Ctx, IDLE_CAP, Rng, claim_cycle, give_back, sending, sent};
use super::{Delivery, DispatcherBuilder, Parts};
use crate::error::{Error, Result};
use crate::outbox::{ClaimRequest, Fence, OutboxEntry, Settlement};

type SendFn = dyn Fn(&OutboxEntry) -> Delivery + Send + Sync;

impl DispatcherBuilder {
    /// Starts the workers, the reaper and the janitor; `send` is called for
    /// each claimed entry, from the worker threads (never twice at once for
    /// one entry while its claim is live).
    pub fn start(
        self,
        send: impl Fn(&OutboxEntry) -> Delivery + Send + Sync + 'static,
    ) -> Result<DispatcherHandle> {
        let Parts {
            ctx,
            workers,
            worker_id,
            janitor,
        } = self.into_parts()?;
        let send: Arc<SendFn> = Arc::new(send);
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        // From here on, an early return drops the handle, which stops and
        // joins the threads already started.
        let mut handle = DispatcherHandle {
            ctx: Arc::new(ctx),
            stop: Some(stop_tx),
            threads: Vec::new(),
        };
        // The reaper first, so a restart releases a crashed run's claims
        // before the workers look for work.
        handle.start_thread("idemstore-reaper".into(), REAPER_THREAD, &stop_rx, reaper)?;
        let name = "idemstore-scheduler".into();
        handle.start_thread(name, SCHEDULER_THREAD, &stop_rx, scheduler)?;
        // Per destination, the workers busy with it: for fair sharing.
        let busy = Arc::new(Mutex::new(Busy::default()));
        for i in 0..workers {
            let id = format!("{worker_id}-{i}");
            let name = format!("idemstore-{id}");
            let (send, busy) = (send.clone(), busy.clone());
            handle.start_thread(name, WORKER_THREAD, &stop_rx, move |c, stop| {
                let share = Share {
                    busy: &busy,
                    workers,
                    holding: None,
                };
                worker(c, &*send, &id, share, stop);
            })?;
        }
        if let Some(janitor) = janitor {
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
/// What the scheduler thread was when it panicked.
const SCHEDULER_THREAD: &str = "the dispatcher's scheduler thread";
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
        self.ctx.stop();
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

/// Waits until `deadline` (by the clock), a wake-up, a clock change or the
/// stop signal; returns `false` on stop.
fn wait(
    ctx: &Ctx,
    deadline: Option<DateTime<Utc>>,
    cap: Duration,
    wake: &Receiver<()>,
    changes: &Receiver<()>,
    stop: &Receiver<()>,
) -> bool {
    let timeout = ctx.timeout(deadline, cap);
    if timeout.is_zero() {
        return !ctx.stopping();
    }
    select! {
        recv(stop) -> _ => false,
        recv(wake) -> _ => !ctx.stopping(),
        recv(changes) -> _ => !ctx.stopping(),
        default(timeout) => !ctx.stopping(),
    }
}

/// Backs off after a failed store call (counted and kept by its step);
/// returns `false` on stop.
fn back_off(ctx: &Ctx, stop: &Receiver<()>) -> bool {
    select! {
        recv(stop) -> _ => false,
        default(BACK_OFF) => !ctx.stopping(),
    }
}

/// A worker thread's part in fair sharing: the destination it is busy
/// with, counted among the dispatcher's workers while it holds it.
struct Share<'a> {
    busy: &'a Mutex<Busy>,
    /// How many worker threads the dispatcher has.
    workers: usize,
    holding: Option<String>,
}

impl Share<'_> {
    /// Busy with no destination any more: its batch is sent.
    fn release(&mut self) {
        if let Some(destination) = self.holding.take() {
            self.busy.lock().remove(&destination);
        }
    }

    /// Reads the destinations' weights again if the dispatcher's are older
    /// than [`WEIGHTS_FOR`](super::share::WEIGHTS_FOR): one worker reads
    /// them, the others go on with the old ones meanwhile.
    fn refresh_weights(&self, ctx: &Ctx) {
        let now = Instant::now();
        {
            let mut busy = self.busy.lock();
            if !busy.weights_stale(now) {
                return;
            }
            busy.keep_weights(now);
        }
        // A failed read keeps the old weights; the claim that follows
        // meets the same failure and backs off.
        if let Ok(weights) = ctx.outbox.weights() {
            self.busy.lock().set_weights(weights, now);
        }
    }

    /// The next claim of a worker busy with nothing: up to `limit`
    /// entries of one destination — the least loaded active one below its
    /// share, which this worker counts as busy with from now on (see the
    /// [`share`](super::share) module) — avoiding the others that are
    /// busy or hold their share of the workers (the store takes from them
    /// only if neither the target nor a destination no worker is busy with
    /// has any entry to give), and one entry of a destination
    /// whose flow limits claims (a cap, a rate): the worker sends its batch
    /// one entry after the other, so a cap of N is N workers sending at
    /// once.
    fn request(&mut self, limit: usize, worker_id: &str) -> (ClaimRequest, Target) {
        let target = self.busy.lock().target(self.workers);
        self.holding.clone_from(&target.destination);
        let request = ClaimRequest::new(limit, worker_id)
            .one_destination()
            .avoid(target.avoid.clone())
            .limited(1);
        (request, target)
    }

    /// The claim for `target` gave entries of `got` (`None`: none): busy
    /// with that one now.
    fn claimed(&mut self, target: &Target, got: Option<&str>) {
        self.busy.lock().claimed(target, got);
        self.holding = got.map(str::to_owned);
    }
}

impl Drop for Share<'_> {
    fn drop(&mut self) {
        // Also when the thread ends with a panic.
        self.release();
    }
}

fn worker(ctx: &Ctx, send: &SendFn, worker_id: &str, mut share: Share<'_>, stop: &Receiver<()>) {
    let wake = ctx.outbox.subscribe();
    let changes = ctx.clock.changes().unwrap_or_else(crossbeam_channel::never);
    let mut rng = Rng::seeded(worker_id);
    // The settlements of the last batch, committed together with the next
    // claim: one durable commit per batch instead of two.
    let mut settlements: Vec<(Fence, Settlement)> = Vec::new();
    while !ctx.stopping() {
        share.release();
        // As many as this worker sends in about `CLAIM_AHEAD` (one before
        // the first send is timed): what it holds unsent, another worker
        // could not have started much sooner.
        let limit = ctx.send_time.ahead(1, ctx.batch_size, 1).max(1);
        share.refresh_weights(ctx);
        let (request, target) = share.request(limit, worker_id);
        let Ok(entries) = claim_cycle(ctx, &mut settlements, &request) else {
            if !back_off(ctx, stop) {
                break;
            }
            continue;
        };
        share.claimed(&target, entries.first().map(|e| e.destination.as_str()));
        if entries.is_empty() {
            let Ok(next) = worker::next_due(ctx) else {
                if !back_off(ctx, stop) {
                    break;
                }
                continue;
            };
            if !wait(ctx, next, IDLE_CAP, &wake, &changes, stop) {
                break;
            }
            continue;
        }
        settlements = deliver_batch(ctx, send, &entries, &mut rng);
    }
    share.release();
    // Settle what was sent before stopping.
    worker::settle_last(ctx, settlements);
}

/// Sends each entry of a claimed batch; returns how to settle each.
fn deliver_batch(
    ctx: &Ctx,
    send: &SendFn,
    entries: &[OutboxEntry],
    rng: &mut Rng,
) -> Vec<(Fence, Settlement)> {
    let mut settlements = Vec::with_capacity(entries.len());
    for (i, entry) in entries.iter().enumerate() {
        if ctx.stopping() {
            // Give the unsent rest back, due now.
            let now = ctx.clock.now();
            for rest in entries.iter().skip(i) {
                settlements.push(give_back(ctx, rest, now));
            }
            break;
        }
        let started = sending(ctx, entry);
        let outcome = catch_unwind(AssertUnwindSafe(|| send(entry)));
        settlements.push(sent(ctx, entry, started, outcome, rng));
    }
    settlements
}

/// Releases claims older than the lease, every half lease (and at once on
/// start).
/// Fires the outbox's schedules as their slots come: sleeps until the next
/// one is due, a commit wakes it (a schedule set, resumed or changed: in
/// any process on the file), or the clock jumps.
fn scheduler(ctx: &Ctx, stop: &Receiver<()>) {
    let wake = ctx.outbox.subscribe();
    let changes = ctx.clock.changes().unwrap_or_else(crossbeam_channel::never);
    while !ctx.stopping() {
        let Ok(next) = worker::fire_schedules(ctx) else {
            if !back_off(ctx, stop) {
                break;
            }
            continue;
        };
        if !wait(ctx, next, IDLE_CAP, &wake, &changes, stop) {
            break;
        }
    }
}

fn reaper(ctx: &Ctx, stop: &Receiver<()>) {
    let never = crossbeam_channel::never();
    let changes = ctx.clock.changes().unwrap_or_else(crossbeam_channel::never);
    while !ctx.stopping() {
        worker::reap(ctx);
        if !wait(
            ctx,
            None,
            worker::reaper_period(ctx),
            &never,
            &changes,
            stop,
        ) {
            break;
        }
    }
}
