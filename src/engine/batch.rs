//! Batching and leadership: the queue of operations, the caller that leads
//! a batch, and the batch it runs.
//!
//! A caller queues its operation ([`Inner::submit`]); if no batch is being
//! led, it leads one itself ([`Inner::lead`]): it takes the queued
//! operations, runs them in one write transaction ([`run_batch`]), hands the
//! lead to the first caller still queued, and then answers its batch's
//! callers. [`run_batch`] goes through five phases: begin or resume the
//! transaction; run the operations, rolling back and re-running without a failed
//! one; take in late arrivals; decide between committing and keeping the
//! transaction open; commit and answer.
//!
//! # Invariants
//!
//! - Under `queue`'s lock, `!leading` implies `queued.is_empty()`: a caller
//!   that finds nobody leading starts leading in the same critical section
//!   that queues its operation, and a leader gives up the lead only when it finds
//!   the queue empty. No queued operation is ever left without a leader to run it.
//! - One leader at a time: the lead is taken by the caller that turns
//!   `leading` on, or handed by the leader to the first queued caller; only
//!   the leader takes operations out of the queue.
//! - A leader's own operation is the first of its batch: a caller leads at once
//!   only when it found the queue empty, and a promoted caller's operation was
//!   first in the queue when it was promoted, and stays first until it
//!   drains the queue itself (`max_batch >= 1`, which the store builder
//!   ensures).
//! - Every operation drained into a batch is answered exactly once: an operation kept in
//!   the open transaction at once, every other one through
//!   [`Batch::answers`] after the lead is handed on, including when
//!   something panics while the batch runs ([`Inner::lead`] catches it and
//!   fails the operations still without an outcome).
//! - A failed operation (one that returned `Err` or panicked) never commits: the
//!   transaction is rolled back and the other operations run again without it. It
//!   goes to the answers with the batch's outcome `Ok`, which its answer
//!   ignores: an operation's own failure comes first.
//! - A batch's callers are answered only once its transaction is committed
//!   (durably under `Durability::Immediate` or when an operation needs it) or kept
//!   open (its writes are then in the open transaction, which every reader
//!   and writer commits first), or once the batch has failed.
//! - Nothing the store does not own runs between a commit and the answers
//!   to its callers, nor under a lock: a batch's after-commit hooks and its
//!   reports ([`Batch::after`]) run on the leader's thread once every caller
//!   of the batch is answered, the lead handed on, and the leader's own
//!   children in the wake tree woken ([`Inner::submit`]), each under
//!   `catch_unwind`. A panic there is dropped: it changes no answer, leaves
//!   no caller waiting and does not break the engine.
//! - A batch takes in late arrivals up to `max_batch` operations (a caller
//!   closure that leads it, in a store shared between processes, counts as
//!   one); under `Durability::Immediate` it first yields up to three times
//!   before its fsync, to take in callers just woken from the last batch.
//!
//! # Locks
//!
//! [`run_batch`] holds `db` (shared) then `open` for the whole batch, and
//! redb's writer lock from the time it begins or resumes its transaction
//! until it commits, keeps or loses it; under them it takes `sync` and
//! `queue` briefly, one at a time, answers the operations it keeps open (their
//! slots' mutexes), and nothing else: no hook, no report. `queue` is otherwise taken alone, except in
//! [`Inner::hand_on_lead`], which holds it while it sends `Lead` to the
//! promoted caller's slot. The callers of a finished batch are woken with no
//! lock held.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use redb::{Database, WriteTransaction};

use super::Durability;
use super::inner::Inner;
use super::open_tx::{OpenTx, replay_log};
use super::scope::{Hook, HookFrame, run_hooks};
use super::wake::{Notify, Reply, Slot, Wake, WakeTree, wake};
use crate::error::{Error, Result};
use crate::observe;

/// What the batch queue holds, as the batch leader sees it: an
/// [`Operation`], or (in a store shared between processes) a caller
/// closure's seat.
pub(super) trait Queued: Send {
    /// Runs the operation in `tx`; `false` if it failed (returned `Err` or
    /// panicked), when it may have left part of its writes behind.
    fn run(&mut self, tx: &WriteTransaction) -> bool;
    /// Runs the operation again in a fresh transaction after a rollback,
    /// discarding its result (its caller has it already); `false` if it
    /// failed.
    fn replay(&self, tx: &WriteTransaction) -> bool;
    /// Answers the caller once the batch's outcome is known.
    fn finish(&mut self, committed: Result<(), Error>);
    /// Leaves the answer in the caller's mailbox without waking the caller:
    /// whoever holds `tree` wakes it, and the caller then wakes its own
    /// children in the tree (see [`WakeTree`]).
    fn finish_quietly(&mut self, committed: Result<(), Error>, tree: Arc<WakeTree>, index: usize);
    /// The operation's caller, to wake.
    fn caller(&self) -> Arc<dyn Notify>;
    /// Tells the operation's waiting caller to lead the next batch.
    fn promote(&self);
    /// What its batch must do before the operation's caller is answered.
    fn needs(&self) -> Needs;
    /// Whether this is a caller closure's seat (in a store shared between
    /// processes): a batch never takes one in, it starts the next batch.
    fn is_seat(&self) -> bool {
        false
    }
    /// Whether the operation's caller is answered by [`Queued::finish`]
    /// alone, never through a [`WakeTree`] (a task's operation: its
    /// channel wakes the task).
    fn wakes_itself(&self) -> bool {
        false
    }
}

/// What a batch must do before its callers are answered, beyond running
/// their operations. Ordered: a batch does what its most demanding operation
/// needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Needs {
    /// Whatever the store's durability asks for.
    Default,
    /// Commit, even if the store would keep the transaction open.
    Commit,
    /// Commit durably, whatever the store's durability (a `sync`).
    Durable,
}

/// An operation and what it came to, as the batch runs it: the part of a
/// queued operation that does not depend on how its caller waits (a
/// thread's [`Slot`], a task's channel).
pub(super) struct Run<T, F> {
    op: F,
    result: Option<Reply<T>>,
}

impl<T, F> Run<T, F>
where
    F: Fn(&WriteTransaction) -> Result<T>,
{
    pub(super) fn new(op: F) -> Run<T, F> {
        Run { op, result: None }
    }

    /// See [`Queued::run`].
    pub(super) fn run(&mut self, tx: &WriteTransaction) -> bool {
        let r = catch_unwind(AssertUnwindSafe(|| (self.op)(tx)));
        let ok = matches!(r, Ok(Ok(_)));
        self.result = Some(r);
        ok
    }

    /// See [`Queued::replay`].
    pub(super) fn replay(&self, tx: &WriteTransaction) -> bool {
        matches!(catch_unwind(AssertUnwindSafe(|| (self.op)(tx))), Ok(Ok(_)))
    }

    /// The caller's answer: the operation's own failure if it failed, else
    /// the batch's failure if the batch failed, else its result.
    pub(super) fn answer(&mut self, committed: Result<(), Error>) -> Reply<T> {
        match (committed, self.result.take()) {
            (_, Some(Err(panic))) => Err(panic),
            (Ok(()), Some(Ok(r))) => Ok(r),
            (Err(e), _) => Ok(Err(e)),
            // Every operation runs before its batch commits; this would be a bug.
            (Ok(()), None) => Ok(Err(Error::Panicked {
                during: "a batch",
                message: "an operation was answered before it ran".to_owned(),
            })),
        }
    }
}

/// A thread's operation with its mailbox.
struct Operation<T, F> {
    run: Run<T, F>,
    reply: Arc<Slot<T>>,
    needs: Needs,
}

impl<T, F> Queued for Operation<T, F>
where
    T: Send + 'static,
    F: Fn(&WriteTransaction) -> Result<T> + Send + 'static,
{
    fn run(&mut self, tx: &WriteTransaction) -> bool {
        self.run.run(tx)
    }

    fn replay(&self, tx: &WriteTransaction) -> bool {
        self.run.replay(tx)
    }

    fn finish(&mut self, committed: Result<(), Error>) {
        let answer = self.run.answer(committed);
        self.reply.put(Wake::Done(answer, None));
    }

    fn finish_quietly(&mut self, committed: Result<(), Error>, tree: Arc<WakeTree>, index: usize) {
        let answer = self.run.answer(committed);
        self.reply
            .put_quietly(Wake::Done(answer, Some((tree, index))));
    }

    fn caller(&self) -> Arc<dyn Notify> {
        self.reply.clone()
    }

    fn promote(&self) {
        self.reply.put(Wake::Lead);
    }

    fn needs(&self) -> Needs {
        self.needs
    }
}

/// Operations waiting for a batch, and whether some caller is leading one.
#[derive(Default)]
pub(super) struct Queue {
    pub(super) queued: Vec<Box<dyn Queued>>,
    pub(super) leading: bool,
}

impl Inner {
    /// Queues `op` and waits for its batch, leading batches when asked to.
    pub(super) fn submit<T, F>(&self, op: F, needs: Needs) -> Result<T>
    where
        T: Send + 'static,
        F: Fn(&WriteTransaction) -> Result<T> + Send + 'static,
    {
        let slot = Slot::new();
        let item = Operation {
            run: Run::new(op),
            reply: slot.clone(),
            needs,
        };
        let lead_now = {
            let mut q = self.queue.lock();
            q.queued.push(Box::new(item));
            !std::mem::replace(&mut q.leading, true)
        };
        // What the batches this caller led left to do once it is answered.
        let mut after = Vec::new();
        if lead_now {
            after = self.lead();
        }
        loop {
            match slot.take() {
                Wake::Done(reply, tree) => {
                    if let Some((tree, index)) = tree {
                        tree.wake_children(Some(index));
                    }
                    self.after_answers(after);
                    match reply {
                        Ok(result) => return result,
                        Err(panic) => resume_unwind(panic),
                    }
                }
                Wake::Lead => after.extend(self.lead()),
            }
        }
    }

    /// Runs what a batch or a caller closure left for after its answers:
    /// after-commit hooks and reports, each to its end (a panic in one is
    /// dropped), then the report of what broke the engine, if something did
    /// and nobody reported it yet. Called with no lock held, once every
    /// caller it concerns is answered.
    pub(super) fn after_answers(&self, after: Vec<Hook>) {
        run_hooks(after);
        self.report_broken();
    }

    /// Runs the queued operations as one batch, then hands leadership to
    /// the next waiting caller, if any, and answers the batch's callers.
    /// Returns the batch's after-commit hooks and reports, for the leader to
    /// run once it has taken its own answer and woken its children
    /// ([`Inner::after_answers`]).
    ///
    /// Unwind-safe: whatever panics while the batch runs (an operation,
    /// redb itself or its storage backend), every caller drained into the
    /// batch is answered and the lead is passed on. A panic outside the
    /// operations leaves the transaction's fate unknown: the engine is
    /// marked broken, so later calls get [`Error::Panicked`] at once instead
    /// of waiting, and so do the batch's callers.
    pub(super) fn lead(&self) -> Vec<Hook> {
        let mut batch = Batch::new(self.drain_queue());
        if !batch.queued.is_empty()
            && let Err(panic) = catch_unwind(AssertUnwindSafe(|| run_batch(self, &mut batch)))
        {
            let e = self.lose_open(
                "a batch commit",
                &Error::panicked("a batch commit", &*panic),
            );
            batch.fail_rest(&e);
        }
        self.hand_on_lead();
        wake(batch.answers);
        batch.after
    }

    /// Takes up to a batch of queued operations.
    fn drain_queue(&self) -> Vec<Box<dyn Queued>> {
        let mut q = self.queue.lock();
        let n = batch_end(&q.queued, self.config.max_batch);
        q.queued.drain(..n).collect()
    }

    /// Promotes the first waiting caller to lead the next batch, or notes
    /// that nobody leads. Done before answering the last batch's callers,
    /// so that the next batch starts while they are woken.
    pub(super) fn hand_on_lead(&self) {
        let mut q = self.queue.lock();
        match q.queued.first() {
            Some(next) => next.promote(),
            None => q.leading = false,
        }
    }
}

/// How many of the `queued` operations a batch with room for `room` more takes:
/// never a seat, which starts a batch of its own.
pub(super) fn batch_end(queued: &[Box<dyn Queued>], room: usize) -> usize {
    let seat = queued
        .iter()
        .position(|j| j.is_seat())
        .unwrap_or(queued.len());
    seat.min(room)
}

/// Operations with the outcome of their batch, to answer once the lead is handed
/// on.
pub(super) type Answers = Vec<(Box<dyn Queued>, Result<(), Error>)>;

/// The operations of the batch being led.
pub(super) struct Batch {
    /// Operations run (or to run) in the batch's transaction, not yet
    /// given an outcome.
    pub(super) queued: Vec<Box<dyn Queued>>,
    /// Operations with their outcome, to answer once the lead is handed on.
    pub(super) answers: Answers,
    /// What to run once the batch's callers are answered: the after-commit
    /// hooks of a committed transaction, and the batch's report.
    pub(super) after: Vec<Hook>,
    /// Places of the batch's `max_batch` taken by something other than the
    /// operations: a caller closure that leads the batch (in a store shared
    /// between processes) takes one.
    pub(super) reserved: usize,
}

impl Batch {
    pub(super) fn new(queued: Vec<Box<dyn Queued>>) -> Batch {
        Batch {
            answers: Vec::with_capacity(queued.len()),
            queued,
            after: Vec::new(),
            reserved: 0,
        }
    }

    /// Gives every operation still without an outcome the outcome `e`.
    pub(super) fn fail_rest(&mut self, e: &Error) {
        let queued = std::mem::take(&mut self.queued);
        self.answers
            .extend(queued.into_iter().map(|item| (item, Err(e.lossy_clone()))));
    }

    /// Gives every operation still without an outcome the outcome
    /// "committed".
    fn commit_rest(&mut self) {
        self.answers
            .extend(self.queued.drain(..).map(|item| (item, Ok(()))));
    }

    /// Runs the operations from `from` on in `tx`, in order, up to the first
    /// that fails; returns its index, or `None` if all of them succeeded.
    fn run_from(&mut self, from: usize, tx: &WriteTransaction) -> Option<usize> {
        for (i, item) in self.queued.iter_mut().enumerate().skip(from) {
            if !item.run(tx) {
                return Some(i);
            }
        }
        None
    }

    /// What the most demanding operation of the batch needs.
    fn needs(&self) -> Needs {
        self.queued
            .iter()
            .map(|j| j.needs())
            .max()
            .unwrap_or(Needs::Default)
    }
}

/// Runs the batch's operations in one write transaction, the open one if
/// there is one, and commits it, or under `Durability::None` may keep it
/// open; gives each operation its outcome (one kept in the open
/// transaction is answered at once instead).
///
/// An operation that fails (returns `Err` or panics) may have written part
/// of its work, so it never commits: the transaction is rolled back, the
/// failed operation is answered with its own error, and the others run
/// again without it. A failed call therefore wrote nothing, whatever the
/// operation did before it failed.
fn run_batch(inner: &Inner, batch: &mut Batch) {
    let db = inner.db.read_recursive();
    let mut open = inner.open.lock();
    if let Some(refusal) = inner.refusal() {
        // A commit failed, or answered writes were lost: nothing more is
        // answered on top of that.
        batch.fail_rest(&refusal);
        return;
    }
    if open.is_none() {
        inner.let_own_writers_first();
    }
    let Some(work) = begin_or_resume(inner, &db, open.take(), batch) else {
        return;
    };
    let frame = HookFrame::push();
    let Ok(work) = run_jobs(inner, &db, work, batch, &frame) else {
        return;
    };
    match decide(inner, &work, batch) {
        Fate::KeepOpen => *open = Some(answer_and_keep(work, batch, &frame)),
        Fate::Commit { durable } => {
            // The outcome is in the batch's answers.
            let _ = commit_and_answer(inner, work, frame, batch, durable);
        }
    }
}

/// Phase 1: resumes the transaction kept open, or begins one. If redb
/// refuses to begin one (after a failed commit), nothing queued now or
/// later can be made durable: the engine is marked broken and the batch
/// fails.
fn begin_or_resume(
    inner: &Inner,
    db: &Database,
    open: Option<OpenTx>,
    batch: &mut Batch,
) -> Option<OpenTx> {
    if let Some(open) = open {
        return Some(open);
    }
    match inner.begin_batch_write(db) {
        Ok(tx) => Some(OpenTx::new(tx)),
        Err(e) => {
            batch.fail_rest(&e);
            None
        }
    }
}

/// Phases 2 and 3: runs every operation of the batch in `work`, rolling
/// back and running the others again whenever one fails, and taking in the
/// operations queued meanwhile until none are left to take. `Err` if the
/// batch failed as a whole (its transaction lost): the error its operations got.
pub(super) fn run_jobs(
    inner: &Inner,
    db: &Database,
    mut work: OpenTx,
    batch: &mut Batch,
    frame: &HookFrame,
) -> Result<OpenTx> {
    let mut ran = 0;
    loop {
        if let Some(failed) = batch.run_from(ran, &work.tx) {
            ran = 0;
            work = roll_back_without(inner, db, work, batch, frame, failed)?;
            continue;
        }
        ran = batch.queued.len();
        if !take_in_late_arrivals(inner, batch) {
            return Ok(work);
        }
    }
}

/// Phase 2, on a failure: rolls the whole transaction back, answers the
/// failed operation (with its own error), and rebuilds the transaction
/// from the open transaction's log, for the others to run again. The
/// hooks go with the writes; the operations run again register theirs
/// anew. `Err` if the transaction cannot be rebuilt: the batch fails, and
/// the engine is broken if answered writes are lost with it.
fn roll_back_without(
    inner: &Inner,
    db: &Database,
    work: OpenTx,
    batch: &mut Batch,
    frame: &HookFrame,
    failed: usize,
) -> Result<OpenTx> {
    let OpenTx { tx, log, mut hooks } = work;
    let _ = tx.abort();
    hooks.clear();
    frame.discard();
    let item = batch.queued.remove(failed);
    batch.answers.push((item, Ok(())));
    let tx = match inner.begin_batch_write(db) {
        Ok(tx) => tx,
        Err(e) => {
            // Answered writes in the log are lost. With none (always so in
            // a shared store, which keeps nothing open), redb refusing to
            // begin has marked the engine broken already, and a refresh
            // that failed fails this batch alone.
            if !log.is_empty() || !inner.config.shared {
                inner.lose_open("a batch rollback", &e);
            }
            batch.fail_rest(&e);
            return Err(e);
        }
    };
    if !replay_log(&log, &tx) {
        // An operation answered earlier cannot be run again: what the
        // log held is lost, as a crash would have lost it.
        let _ = tx.abort();
        let e = inner.lose_open(
            "a batch rollback",
            &Error::Storage(redb::Error::Io(std::io::Error::other(
                "an answered operation failed when run again after a rollback: \
                 the writes kept open are lost",
            ))),
        );
        batch.fail_rest(&e);
        return Err(e);
    }
    Ok(OpenTx { tx, log, hooks })
}

/// Phase 3: takes in what was queued while the batch ran, so that callers
/// woken from the last batch still share this one's fsync; `false` if
/// there was nothing to take.
fn take_in_late_arrivals(inner: &Inner, batch: &mut Batch) -> bool {
    if absorb(inner, batch) {
        return true;
    }
    inner.config.durability == Durability::Immediate && absorb_after_yielding(inner, batch)
}

/// Moves queued operations into the running batch, up to the batch limit
/// (which counts its reserved places); `false` if there were none.
fn absorb(inner: &Inner, batch: &mut Batch) -> bool {
    let mut q = inner.queue.lock();
    let taken = batch.queued.len() + batch.reserved;
    let n = batch_end(&q.queued, inner.config.max_batch.saturating_sub(taken));
    batch.queued.extend(q.queued.drain(..n));
    n > 0
}

/// Before an fsync: lets the callers just woken from the last batch run for
/// a moment, and takes in what they queue. Without this, on two cores the
/// callers woken late miss the batch and wait a whole commit for the next
/// one (measured at 64 threads: ≈ 42 operations per fsync instead of ≈ 57,
/// and 18% fewer claims per second). A yield with nobody to run costs about
/// a microsecond, against an fsync's hundreds.
fn absorb_after_yielding(inner: &Inner, batch: &mut Batch) -> bool {
    for _ in 0..3 {
        super::sync::thread::yield_now();
        if absorb(inner, batch) {
            return true;
        }
    }
    false
}

/// What a batch does with its transaction once its operations have run.
enum Fate {
    /// Keep it open for the next batch (under `Durability::None`).
    KeepOpen,
    /// Commit it, durably or not.
    Commit { durable: bool },
}

/// Phase 4: commit or keep open. A batch commits durably under
/// `Durability::Immediate` or when an operation needs it; otherwise it commits
/// without fsync when an operation needs a commit, when the open transaction
/// would hold `max_batch` operations, or when a caller waits to begin a
/// transaction of its own; else it keeps the transaction open.
fn decide(inner: &Inner, work: &OpenTx, batch: &Batch) -> Fate {
    let needs = batch.needs();
    if inner.config.durability == Durability::Immediate || needs == Needs::Durable {
        return Fate::Commit { durable: true };
    }
    let full = work.log.len() + batch.queued.len() >= inner.config.max_batch;
    if needs == Needs::Commit || full {
        return Fate::Commit { durable: false };
    }
    // Marks the transaction pending before it looks for waiting writers.
    if inner.keep_open() {
        Fate::KeepOpen
    } else {
        Fate::Commit { durable: false }
    }
}

/// Phase 5, keeping the transaction open: answers the batch's callers at
/// once (their writes are in the open transaction, which every reader and
/// writer commits before it looks) and logs their operations in it.
fn answer_and_keep(mut work: OpenTx, batch: &mut Batch, frame: &HookFrame) -> OpenTx {
    work.hooks.extend(frame.take());
    for mut item in batch.queued.drain(..) {
        item.finish(Ok(()));
        work.log.push(item);
    }
    work
}

/// Phase 5, committing: commits the transaction, keeps its hooks for after
/// the answers if it committed, and gives every operation left the outcome,
/// which it returns.
pub(super) fn commit_and_answer(
    inner: &Inner,
    work: OpenTx,
    frame: HookFrame,
    batch: &mut Batch,
    durable: bool,
) -> Result<()> {
    let OpenTx { tx, log, mut hooks } = work;
    hooks.extend(frame.take());
    drop(frame);
    let ops = log.len() + batch.queued.len();
    let commit = observe::Stopwatch::start();
    let outcome = inner.commit(tx, durable);
    // Committed or lost: nothing is open any more.
    inner.pending.store(false, Ordering::SeqCst);
    drop(log);
    match outcome {
        Ok(()) => {
            // Run once the callers are answered, with no lock held.
            batch.after.extend(hooks);
            if observe::ENABLED {
                let took = commit.stop();
                batch.after.push(Box::new(move || {
                    observe::batch_committed(ops, durable, took);
                }));
            }
            batch.commit_rest();
            Ok(())
        }
        Err(e) => {
            batch.fail_rest(&e);
            Err(e)
        }
    }
}
