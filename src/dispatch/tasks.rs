//! The dispatcher on tokio tasks (feature `tokio`):
//! [`DispatcherBuilder::start_async`] and its [`AsyncDispatcherHandle`].
//!
//! # Shape
//!
//! One *claimer* task claims and settles; each send is a task of its own,
//! and at most `workers` of them run at once. The claimer keeps claimed
//! entries waiting for a free slot — about 2 ms of sends at the measured
//! send time, at most `batch_size` (not counting those of destinations that
//! hold their share, while they wait for it: see below) — so that a send
//! that ends is followed at once by the next one, without waiting for a
//! commit; of a destination with a cap or a rate it claims no more than
//! its free slots. It commits (one `settle_and_claim`: the
//! finished sends' settlements and the next claim together) once the
//! entries waiting to start run low (one per slot or fewer) and it has
//! something to settle or room to claim into while work may be due — or,
//! whatever waits, once a batch of settlements is due — and never two
//! commits at once: the settlements of every send that ended during one
//! commit go into the next, so commits batch themselves under load, as the
//! group commit of the store does. (Committing at every finished send
//! instead made claims of half a batch, twice as many commits, and a
//! PostgreSQL drain 0.6–0.7× the thread dispatcher's.)
//!
//! One claimer rather than `workers` claiming tasks: a wake-up makes one
//! claim (not `workers` claims racing for the same entry), the number of
//! sends in flight is `workers` whatever the batch size and the backlog,
//! and an idle dispatcher has one task waiting, not `workers`. That is the
//! embedded store's shape, whose commits go one after the other anyway. On
//! PostgreSQL a commit is a round trip the server runs beside others, and
//! one at a time would bound a drain at a batch per round trip: there the
//! dispatcher runs as many claimers as the pool has connections (at most
//! 16, at most `workers`), the slots shared out between them, each as
//! above.
//!
//! # Fair sharing
//!
//! The claimer counts the sends in flight per destination (`share.rs`).
//! Its claims avoid the destinations that hold their share of the slots
//! (the store takes from them only if no other destination has anything
//! to give), and a free slot goes to the first waiting entry of a
//! destination below its share. If only crowded destinations' entries
//! wait, the slot goes to one of them (the least loaded) only once a claim
//! has shown that no other destination has entries due; until then the
//! slot stays free for the claim that may bring one. So a slow
//! destination's backlog never fills every slot while another has entries
//! due, and a lone destination still gets them all.
//!
//! Every store call is the store's `_async` form, on both backends: a
//! claimer's step (its settlements and its next claim, one commit), its
//! look at the next due time, the settlements one by one after a failed
//! step and those at shutdown, the reaper's release and the janitor's
//! runs. Each waits for its commit without holding a thread, and none
//! runs on tokio's blocking pool. Waiting —
//! for a wake-up of the outbox, a jump of a [`ManualClock`](super::ManualClock),
//! the next due time, a back-off, the stop signal — is async: no thread is
//! parked for it. The reaper and the janitor are a task each. The steps
//! themselves are `worker.rs`'s, shared with the worker threads.

use std::collections::VecDeque;
use std::future::{Future, pending, poll_fn};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use chrono::{DateTime, Utc};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::{JoinError, JoinHandle, JoinSet};
use tokio::time::Instant;

use super::background::{reaper, run_janitor, scheduler};
use super::share::Busy;
use super::stats::{DispatchStats, LastError};
use super::worker::{self, BACK_OFF, BackOff, Ctx, IDLE_CAP, Rng};
use super::{Delivery, DispatcherBuilder, Parts};
use crate::error::{Error, Result};
use crate::outbox::{ClaimRequest, Fence, OutboxEntry, Settlement};

type SendFuture = Pin<Box<dyn Future<Output = Delivery> + Send>>;
type SendFn = dyn Fn(OutboxEntry) -> SendFuture + Send + Sync;

/// What the claimer task was when it panicked ([`Error::Panicked`]'s
/// `during`).
const CLAIMER_TASK: &str = "the async dispatcher's claimer task";
/// What the reaper task was when it panicked.
const REAPER_TASK: &str = "the async dispatcher's reaper task";
/// What the scheduler task was when it panicked.
const SCHEDULER_TASK: &str = "the async dispatcher's scheduler task";
/// What the janitor task was when it panicked.
const JANITOR_TASK: &str = "the async dispatcher's janitor task";

impl DispatcherBuilder {
    /// Starts the dispatcher as tasks on the current tokio runtime: `send`
    /// is called for each claimed entry (by value: its future owns it) and
    /// its future is run as a task of its own; at most
    /// [`workers`](DispatcherBuilder::workers) of them run at once. Never
    /// twice at once for one entry while its claim is live.
    ///
    /// Retries, back-off, `max_attempts`, fencing, the reaper, the janitor
    /// and the stats are those of [`start`](DispatcherBuilder::start); a
    /// `send` that panics (or whose future panics) is caught and counted
    /// as a retryable failure, as there. Every store call it makes, on
    /// either backend, is an `_async` one that holds no thread while it
    /// waits for its commit, and waiting for work never holds a thread:
    /// nothing of the dispatcher runs on the runtime's blocking pool.
    ///
    /// Works on `current_thread` and multi-thread runtimes. It must be
    /// called from within a runtime (a task, `Runtime::block_on`,
    /// `#[tokio::main]`, or under `Runtime::enter`) with timers enabled,
    /// else [`Error::InvalidInput`] (field `runtime`) and nothing starts.
    /// If that runtime shuts down before the dispatcher, its tasks end
    /// where they stand: claims they held are released by the next reaper
    /// once their lease has run out.
    ///
    /// ```
    /// use chrono::Utc;
    /// use idemstore::{Delivery, Dispatcher, NewEntry, OutboxEntry, Store};
    ///
    /// #[tokio::main(flavor = "current_thread")]
    /// async fn main() -> idemstore::Result<()> {
    ///     let store = Store::in_memory()?;
    ///     let outbox = store.outbox();
    ///     outbox.enqueue(NewEntry::new("order-1", "mailer", "order-1/receipt", b"Thanks!".to_vec()), Utc::now())?;
    ///
    ///     let dispatcher = Dispatcher::builder(outbox.clone())
    ///         .workers(64) // sends in flight at once
    ///         .start_async(|entry: OutboxEntry| async move {
    ///             // e.g. POST entry.payload to entry.destination with an async
    ///             // client, passing entry.idempotency_key along.
    ///             let _ = entry;
    ///             Delivery::Delivered
    ///         })?;
    ///     while dispatcher.stats().delivered < 1 {
    ///         tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    ///     }
    ///     dispatcher.shutdown().await?; // lets sends in flight finish; leaves nothing claimed
    ///     assert_eq!(outbox.counts()?.completed, 1);
    ///     Ok(())
    /// }
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
    pub fn start_async<F, Fut>(self, send: F) -> Result<AsyncDispatcherHandle>
    where
        F: Fn(OutboxEntry) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Delivery> + Send + 'static,
    {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            Error::invalid(
                "runtime",
                "start_async must be called from within a tokio runtime \
                 (a task, `Runtime::block_on`, `#[tokio::main]` or `Runtime::enter`)",
            )
        })?;
        // tokio has no way to ask whether timers are enabled but to try
        // one: it panics without them.
        if catch_unwind(|| drop(tokio::time::sleep(Duration::ZERO))).is_err() {
            return Err(Error::invalid(
                "runtime",
                "the tokio runtime has no timers: build it with `enable_time` (or `enable_all`)",
            ));
        }
        let Parts {
            ctx,
            workers,
            worker_id,
            janitor,
        } = self.into_parts()?;
        let ctx = Arc::new(ctx);
        let send: Arc<SendFn> = Arc::new(move |entry| -> SendFuture { Box::pin(send(entry)) });
        let (stop, stopped) = watch::channel(false);
        let mut tasks = Vec::new();
        // The reaper first, so a restart releases a crashed run's claims
        // before the claimer looks for work.
        let reaper = reaper(ctx.clone(), stopped.clone());
        tasks.push(spawn(&runtime, &ctx, REAPER_TASK, reaper));
        let scheduler = scheduler(ctx.clone(), stopped.clone());
        tasks.push(spawn(&runtime, &ctx, SCHEDULER_TASK, scheduler));
        // One claimer where commits go one after the other; where they
        // run side by side (PostgreSQL), several, the slots shared out.
        let claimers = ctx.outbox.commit_parallelism().clamp(1, workers.max(1));
        // Per destination, the sends in flight of every claimer: the shares
        // are of the dispatcher's `workers`, whichever claimer starts them.
        let busy = Arc::new(Mutex::new(Busy::default()));
        for i in 0..claimers {
            let slots = workers / claimers + usize::from(i < workers % claimers);
            let id = if claimers == 1 {
                format!("{worker_id}-async")
            } else {
                format!("{worker_id}-async-{i}")
            };
            let claimer = Claimer::new(
                ctx.clone(),
                send.clone(),
                id,
                (slots, workers),
                busy.clone(),
                stopped.clone(),
            );
            tasks.push(spawn(&runtime, &ctx, CLAIMER_TASK, claimer.run()));
        }
        if let Some(janitor) = janitor {
            let janitor = run_janitor(ctx.clone(), Arc::new(janitor), stopped);
            tasks.push(spawn(&runtime, &ctx, JANITOR_TASK, janitor));
        }
        Ok(AsyncDispatcherHandle {
            ctx,
            stop: Some(stop),
            tasks,
        })
    }
}

/// Spawns one of the dispatcher's tasks, `body`, on `runtime`. A panic in
/// it is kept as the last error and ends the task, whose result is then
/// [`Error::Panicked`] (as `during`).
fn spawn(
    runtime: &tokio::runtime::Handle,
    ctx: &Arc<Ctx>,
    during: &'static str,
    body: impl Future<Output = ()> + Send + 'static,
) -> (&'static str, JoinHandle<Result<()>>) {
    let ctx = ctx.clone();
    let task = runtime.spawn(async move {
        match CatchUnwind(Box::pin(body)).await {
            Ok(()) => Ok(()),
            Err(payload) => {
                // The clock may be what panicked: then the system's time.
                let at = catch_unwind(AssertUnwindSafe(|| ctx.clock.now()))
                    .unwrap_or_else(|_| Utc::now());
                let error = Error::panicked(during, &*payload);
                ctx.counters.last_error(LastError::new(at, during, &error));
                Err(error)
            }
        }
    });
    (during, task)
}

/// A running async dispatcher (see [`DispatcherBuilder::start_async`]).
///
/// [`shutdown`](AsyncDispatcherHandle::shutdown) stops it and waits for
/// it. Dropping the handle never blocks: it tells the tasks to stop, and
/// they finish on their own — the sends in flight run to their end and
/// are settled, claimed entries not sent yet are given back — as long as
/// the runtime runs.
#[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
pub struct AsyncDispatcherHandle {
    ctx: Arc<Ctx>,
    stop: Option<watch::Sender<bool>>,
    /// Each task, with what it is ([`Error::Panicked`]'s `during`).
    tasks: Vec<(&'static str, JoinHandle<Result<()>>)>,
}

impl std::fmt::Debug for AsyncDispatcherHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncDispatcherHandle")
            .field("tasks", &self.tasks.len())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl AsyncDispatcherHandle {
    /// What the dispatcher did so far, its last error and its janitor's
    /// runs.
    pub fn stats(&self) -> DispatchStats {
        self.ctx.counters.snapshot()
    }

    /// Stops claiming, lets the sends in flight finish and settles them,
    /// gives the entries claimed but not sent yet back (`Pending`, due now,
    /// counted in [`DispatchStats::returned`]), and returns once every task
    /// has ended. A clean shutdown leaves no entry `Dispatching`. If a task
    /// had panicked, [`Error::Panicked`] (for the first one; the others
    /// were still waited for).
    ///
    /// Dropping the returned future before it finishes leaves the
    /// dispatcher stopping on its own, as dropping the handle does.
    pub async fn shutdown(mut self) -> Result<()> {
        self.signal_stop();
        let mut first_error = None;
        for (during, task) in std::mem::take(&mut self.tasks) {
            let outcome = match task.await {
                Ok(outcome) => outcome,
                // The task's own panics are caught; this is the runtime
                // cancelling it as it shuts down: it ended where it stood.
                Err(e) if e.is_cancelled() => Ok(()),
                Err(e) => Err(Error::panicked(during, &*e.into_panic())),
            };
            if let Err(e) = outcome {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn signal_stop(&mut self) {
        self.ctx.stop();
        if let Some(stop) = self.stop.take() {
            stop.send_replace(true);
        }
    }
}

impl Drop for AsyncDispatcherHandle {
    fn drop(&mut self) {
        // Never waits: the tasks see the stop and end on their own.
        self.signal_stop();
    }
}

/// Resolves once the dispatcher is told to stop (or its handle is gone).
pub(super) async fn stopped(stop: &mut watch::Receiver<bool>) {
    // `Err`: the handle was dropped, which stops the dispatcher too.
    let _ = stop.wait_for(|stop| *stop).await;
}

/// Resolves on the next signal of `signal` (`true`), or with `false` once
/// its sender is gone (it will not signal again); never when there is no
/// `signal`.
pub(super) async fn signalled(signal: &mut Option<watch::Receiver<()>>) -> bool {
    match signal {
        Some(rx) => rx.changed().await.is_ok(),
        None => pending().await,
    }
}

/// Sleeps until `deadline`; never when there is none.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => pending().await,
    }
}

/// When the next entry is due, without a thread where the backend allows
/// (see [`worker::next_due`]).
async fn next_due(ctx: &Arc<Ctx>) -> Result<Option<DateTime<Utc>>, worker::BackOff> {
    ctx.outbox.next_due_async().await.map_err(|e| {
        ctx.store_error("next_due", &e);
        worker::BackOff
    })
}

/// What a task's failed join means: its panic goes on here; a task
/// cancelled by the runtime shutting down leaves this one to be dropped
/// with it.
async fn unwind<T>(error: JoinError) -> T {
    match error.try_into_panic() {
        Ok(payload) => resume_unwind(payload),
        Err(_) => pending().await,
    }
}

/// A send's task's result: the entry, when its send started, and what its
/// send did (or its panic's payload).
type Sent = (OutboxEntry, DateTime<Utc>, std::thread::Result<Delivery>);

/// What a commit of the claimer gives back.
struct Commit {
    /// Settlements to offer again (a storage error refused them).
    settlements: Vec<(Fence, Settlement)>,
    /// What it claimed.
    claimed: Result<Vec<OutboxEntry>, BackOff>,
    /// How many it asked for.
    limit: usize,
    /// The destinations it avoided.
    avoided: Vec<String>,
    /// When it claimed fewer than it asked for: when the next entry is due.
    next_due: Option<Result<Option<chrono::DateTime<Utc>>, BackOff>>,
    /// The destinations' weights, if it read them (and when it started).
    weights: Option<(Vec<(String, u32)>, std::time::Instant)>,
}

/// What the claimer waits for.
enum Event {
    Stop,
    Committed(std::result::Result<Commit, JoinError>),
    Sent(std::result::Result<Sent, JoinError>),
    /// The outbox signalled (`false`: it never will again).
    Wake(bool),
    /// The clock jumped (`false`: it never will again).
    ClockChanged(bool),
    Timer,
}

/// The one task that claims and settles for the async dispatcher (see the
/// module's docs).
struct Claimer {
    ctx: Arc<Ctx>,
    send: Arc<SendFn>,
    worker_id: Arc<str>,
    /// The most sends in flight.
    slots: usize,
    rng: Rng,
    /// Claimed, not sent yet (at most `batch_size` beyond the free slots,
    /// besides those of crowded destinations: see [`Claimer::room`]).
    waiting: VecDeque<OutboxEntry>,
    sends: JoinSet<Sent>,
    /// The sends in flight, per destination, of every claimer of the
    /// dispatcher.
    busy: Arc<Mutex<Busy>>,
    /// The dispatcher's slots, every claimer's.
    workers: usize,
    /// What the last claim showed of the store: `Some(destinations)`
    /// when no destination but these had entries due (empty: none at all);
    /// `None` when others may have. Forgotten (`None`) on a wake-up, a
    /// clock jump or a due time.
    due_only: Option<Vec<String>>,
    /// Sent, not settled yet: committed with the next claim.
    settlements: Vec<(Fence, Settlement)>,
    /// The commit in progress.
    commit: Option<JoinHandle<Commit>>,
    /// Whether work may be due that a claim would find: set by a wake-up,
    /// a clock jump, the due time, a claim that came back full; consumed
    /// by starting a claim.
    look: bool,
    /// When the next entry is due, as last looked up.
    due: Option<chrono::DateTime<Utc>>,
    /// No commit before then: a store call failed.
    backing_off: Option<Instant>,
    wake: Option<watch::Receiver<()>>,
    changes: Option<watch::Receiver<()>>,
    stop: watch::Receiver<bool>,
}

impl Claimer {
    fn new(
        ctx: Arc<Ctx>,
        send: Arc<SendFn>,
        worker_id: String,
        (slots, workers): (usize, usize),
        busy: Arc<Mutex<Busy>>,
        stop: watch::Receiver<bool>,
    ) -> Claimer {
        Claimer {
            rng: Rng::seeded(&worker_id),
            worker_id: worker_id.into(),
            wake: Some(ctx.outbox.subscribe_async()),
            changes: ctx.clock.changes_async(),
            ctx,
            send,
            slots,
            waiting: VecDeque::new(),
            sends: JoinSet::new(),
            busy,
            workers,
            due_only: None,
            settlements: Vec::new(),
            commit: None,
            look: true,
            due: None,
            backing_off: None,
            stop,
        }
    }

    async fn run(mut self) {
        loop {
            if self.ctx.stopping() {
                // Give the unsent back, due now; let the sends in flight
                // and the commit in progress finish.
                if !self.waiting.is_empty() {
                    let now = self.ctx.clock.now();
                    for entry in std::mem::take(&mut self.waiting) {
                        let give_back = worker::give_back(&self.ctx, &entry, now);
                        self.settlements.push(give_back);
                    }
                }
                if self.sends.is_empty() && self.commit.is_none() {
                    break;
                }
            } else {
                self.start_sends();
                self.start_commit();
            }
            let event = self.next_event().await;
            self.handle(event).await;
        }
        // Settle what was sent (and give back what was not) before ending.
        worker::settle_last_async(&self.ctx, std::mem::take(&mut self.settlements)).await;
    }

    /// Starts sends from the waiting entries while slots are free, the
    /// first entry of a destination below its share first (see the
    /// module's docs).
    fn start_sends(&mut self) {
        while self.sends.len() < self.slots {
            let Some(entry) = self.next_waiting() else {
                break;
            };
            self.busy.lock().add(&entry.destination);
            let started = worker::sending(&self.ctx, &entry);
            let send = self.send.clone();
            let copy = entry.clone();
            // `send` itself runs inside the catch too: it may panic before
            // it returns its future.
            let delivery = CatchUnwind(Box::pin(async move { send(copy).await }));
            self.sends
                .spawn(async move { (entry, started, delivery.await) });
        }
    }

    /// The waiting entry to send next, taken out of the queue: the first
    /// one of a destination below its share; else, if no other destination
    /// has entries due, the first one of the least loaded destination.
    /// `None` leaves the free slots for a claim (see the module's docs).
    fn next_waiting(&mut self) -> Option<OutboxEntry> {
        let crowded = self.busy.lock().crowded(self.workers);
        let fair = self
            .waiting
            .iter()
            .position(|e| !crowded.contains(&e.destination));
        let index = fair.or_else(|| {
            if !self.others_idle(&crowded) {
                // A claim may bring another destination's entry.
                self.look |= !self.waiting.is_empty();
                return None;
            }
            let busy = self.busy.lock();
            let least = busy.least_loaded(self.waiting.iter().map(|e| e.destination.as_str()))?;
            self.waiting.iter().position(|e| e.destination == least)
        })?;
        self.waiting.remove(index)
    }

    /// Whether no destination but the `crowded` ones has entries due, as
    /// the last claim showed: then a crowded destination's entry may take a
    /// free slot.
    fn others_idle(&self, crowded: &[String]) -> bool {
        self.due_only
            .as_ref()
            .is_some_and(|only| only.iter().all(|d| crowded.contains(d)))
    }

    /// How many entries a claim may take: up to `workers` plus what the
    /// slots start within [`CLAIM_AHEAD`](worker::CLAIM_AHEAD) at the
    /// measured send time (at most `batch_size`; as many as the slots
    /// before the first send is timed) claimed, sends in flight included,
    /// not counting the waiting entries of crowded destinations while they
    /// may not take a free slot (they wait for their destination's share,
    /// and must not crowd out the entries claimed ahead for the others).
    fn room(&self) -> usize {
        let claimed = self.startable() + self.sends.len();
        let ahead = self
            .ctx
            .send_time
            .ahead(self.slots, self.ctx.batch_size, self.slots);
        (self.slots + ahead).saturating_sub(claimed)
    }

    /// The waiting entries that may take a free slot: all of them, but
    /// those of crowded destinations while they wait for their share.
    fn startable(&self) -> usize {
        let crowded = self.busy.lock().crowded(self.workers);
        if self.others_idle(&crowded) {
            return self.waiting.len();
        }
        self.waiting
            .iter()
            .filter(|e| !crowded.contains(&e.destination))
            .count()
    }

    /// The slots no send and no waiting entry will take: the most entries
    /// of a destination whose flow limits claims (a cap, a rate) a claim
    /// may take, so that none of its slots waits here unstarted.
    fn free_slots(&self) -> usize {
        self.slots
            .saturating_sub(self.sends.len() + self.waiting.len())
    }

    /// Starts a commit unless one runs or the claimer backs off, once the
    /// entries waiting to start run low (no more than one per slot): when
    /// sends finished (their settlements are due), or when there is room to
    /// claim into and work may be due; and whatever waits, once a batch of
    /// settlements is due. Waiting for the queue to run low, a commit
    /// settles and claims a batch where committing at every finished send
    /// would make one small commit after the other (half the size and
    /// twice as many, on PostgreSQL, whose drain they bound), and the sends
    /// still never wait for a claim while one entry per slot is left.
    fn start_commit(&mut self) {
        if self.commit.is_some() || self.backing_off.is_some() {
            return;
        }
        let low = self.startable() <= self.slots;
        let room = self.room();
        let settle =
            !self.settlements.is_empty() && (low || self.settlements.len() >= self.ctx.batch_size);
        if !(settle || low && self.look && room > 0) {
            return;
        }
        self.look = false;
        let (ctx, worker_id) = (self.ctx.clone(), self.worker_id.clone());
        let mut settlements = std::mem::take(&mut self.settlements);
        let limit = room;
        let avoided = self.busy.lock().crowded(self.workers);
        let request = ClaimRequest::new(limit, &*worker_id)
            .avoid(avoided.clone())
            .limited(self.free_slots());
        // The weights, read again along with the commit once they are old.
        let weigh_at = std::time::Instant::now();
        let weigh = {
            let mut busy = self.busy.lock();
            let stale = busy.weights_stale(weigh_at);
            if stale {
                busy.keep_weights(weigh_at);
            }
            stale
        };
        // The step holds no thread while it waits for its commit.
        self.commit = Some(tokio::spawn(async move {
            let weights = if weigh {
                // A failed read keeps the old weights (the claim meets the
                // same failure and backs off).
                ctx.outbox.weights_async().await.ok().map(|w| (w, weigh_at))
            } else {
                None
            };
            let now = ctx.clock.now();
            let step = ctx
                .outbox
                .settle_and_claim_async(settlements.clone(), now, request.clone());
            let claimed = worker::claimed_async(&ctx, &mut settlements, step.await).await;
            // Fewer than asked for: nothing else is due now; when will it be?
            let next_due = match &claimed {
                Ok(entries) if entries.len() < limit => Some(next_due(&ctx).await),
                _ => None,
            };
            Commit {
                settlements,
                claimed,
                limit,
                avoided,
                next_due,
                weights,
            }
        }));
    }

    /// Waits for what comes first: the stop signal, the commit's end, a
    /// send's end, a wake-up of the outbox, a jump of the clock, or the
    /// timer (the end of a back-off, or — with room to claim into and
    /// nothing known to be due — the next due time, at most
    /// [`IDLE_CAP`] away).
    async fn next_event(&mut self) -> Event {
        let stopping = self.ctx.stopping();
        let deadline = self.backing_off.or_else(|| {
            (!stopping && !self.look && self.room() > 0)
                .then(|| Instant::now() + self.ctx.timeout(self.due, IDLE_CAP))
        });
        let Claimer {
            commit,
            sends,
            wake,
            changes,
            stop,
            ..
        } = self;
        let mut stop = pin!(async {
            if stopping {
                pending::<()>().await;
            }
            stopped(stop).await;
        });
        let mut wake = pin!(signalled(wake));
        let mut change = pin!(signalled(changes));
        let mut timer = pin!(sleep_until(deadline));
        poll_fn(|cx| {
            if stop.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Event::Stop);
            }
            if let Some(commit) = commit.as_mut()
                && let Poll::Ready(done) = Pin::new(commit).poll(cx)
            {
                return Poll::Ready(Event::Committed(done));
            }
            if let Poll::Ready(Some(sent)) = sends.poll_join_next(cx) {
                return Poll::Ready(Event::Sent(sent));
            }
            if let Poll::Ready(alive) = wake.as_mut().poll(cx) {
                return Poll::Ready(Event::Wake(alive));
            }
            if let Poll::Ready(alive) = change.as_mut().poll(cx) {
                return Poll::Ready(Event::ClockChanged(alive));
            }
            timer.as_mut().poll(cx).map(|()| Event::Timer)
        })
        .await
    }

    async fn handle(&mut self, event: Event) {
        match event {
            // `run` sees `ctx.stopping()`, which the handle set first.
            Event::Stop => self.ctx.stop(),
            Event::Committed(done) => {
                self.commit = None;
                let commit = match done {
                    Ok(commit) => commit,
                    Err(e) => unwind(e).await,
                };
                self.committed(commit);
            }
            Event::Sent(Ok((entry, started, outcome))) => {
                self.busy.lock().remove(&entry.destination);
                let settlement = worker::sent(&self.ctx, &entry, started, outcome, &mut self.rng);
                self.settlements.push(settlement);
            }
            // The send's own panics are caught; this is the runtime
            // cancelling it as it shuts down: its claim stays for the
            // reaper.
            Event::Sent(Err(_)) => {}
            Event::Wake(alive) => {
                self.look = true;
                self.due_only = None;
                if !alive {
                    self.wake = None;
                }
            }
            Event::ClockChanged(alive) => {
                self.look = true;
                self.due_only = None;
                if !alive {
                    self.changes = None;
                }
            }
            Event::Timer => {
                self.backing_off = None;
                self.look = true;
                self.due_only = None;
            }
        }
    }

    fn committed(&mut self, commit: Commit) {
        if let Some((weights, at)) = commit.weights {
            self.busy.lock().set_weights(weights, at);
        }
        // Those to offer again go first, before the sends that ended since.
        let mut settlements = commit.settlements;
        settlements.append(&mut self.settlements);
        self.settlements = settlements;
        match commit.claimed {
            Ok(entries) => {
                // A full claim: more may be due.
                self.look |= commit.limit > 0 && entries.len() == commit.limit;
                if commit.limit > 0 {
                    self.due_only = due_only(&entries, commit.limit, commit.avoided);
                }
                self.waiting.extend(entries);
            }
            Err(BackOff) => self.back_off(),
        }
        match commit.next_due {
            Some(Ok(due)) => self.due = due,
            Some(Err(BackOff)) => self.back_off(),
            None => {}
        }
    }

    /// After a failed store call (counted and kept by its step): no commit
    /// for a while, then look again.
    fn back_off(&mut self) {
        self.backing_off = Some(Instant::now() + BACK_OFF);
        self.look = true;
    }
}

/// What a claim of up to `limit` entries that avoided `avoided` and took
/// `entries` shows of the store (see [`Claimer::due_only`]), by the claim
/// rule: the store takes from avoided destinations only when no other
/// destination gave anything; otherwise it visits the claimable
/// destinations (at most `limit` of them) taking one entry from each per
/// round, so a destination that gave nothing had nothing to give, and a
/// claim that took fewer than it asked for took all that was claimable.
fn due_only(
    entries: &[OutboxEntry],
    limit: usize,
    mut avoided: Vec<String>,
) -> Option<Vec<String>> {
    if entries.len() < limit {
        let from_others = entries.iter().any(|e| !avoided.contains(&e.destination));
        // Only the avoided may have more (they were not looked at), or
        // nothing is left at all.
        return Some(if from_others { avoided } else { Vec::new() });
    }
    let mut gave: Vec<&str> = Vec::new();
    for e in entries {
        if !gave.contains(&e.destination.as_str()) {
            gave.push(&e.destination);
        }
    }
    if gave.len() >= limit {
        // Claimable destinations beyond the first `limit` were not visited.
        return None;
    }
    for d in gave {
        if !avoided.iter().any(|a| a == d) {
            avoided.push(d.to_owned());
        }
    }
    Some(avoided)
}

/// A future whose panics are caught: its output, or the panic's payload.
/// (The future is boxed, so polling it needs no pin projection.)
struct CatchUnwind<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let future = self.0.as_mut();
        match catch_unwind(AssertUnwindSafe(|| future.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(value)) => Poll::Ready(Ok(value)),
            Err(payload) => Poll::Ready(Err(payload)),
        }
    }
}
