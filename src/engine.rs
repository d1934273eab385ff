//! The one redb [`Database`] of a store, and the only place that opens write
//! transactions: group commit, durability, panic-safe transactions.
//!
//! # Group commit
//!
//! redb has one writer at a time and a durable commit costs about one fsync.
//! To let concurrent callers share that cost, writes take one of two paths:
//!
//! - **Operations** (the store's own calls: claims, enqueues, settlements,
//!   reservations) are `Fn(&WriteTransaction) -> Result<T> + Send + 'static`
//!   closures over owned data. A caller queues its operation; if no batch is
//!   being led, it leads one itself: it takes every queued operation, runs
//!   them in **one** write transaction, commits once, answers each caller,
//!   and hands the lead to the first caller still waiting. A lone caller
//!   therefore commits on its own thread with no hand-off, and under load
//!   each fsync is shared by everyone who queued while the last one ran.
//!   An operation that fails — returns `Err` or panics — may have written
//!   part of its work before it failed, so it never commits: the
//!   transaction is rolled back and the rest of the batch is run again
//!   without it (operations are `Fn`, so they may run more than once; they
//!   write only what they compute from the transaction's state). A failed
//!   call therefore wrote nothing, by mechanism, whatever the operation did.
//!   A panic anywhere else while leading (an after-commit hook, redb's
//!   commit, the storage backend) never leaves a caller waiting: see
//!   `Shared::lead`.
//! - **Caller closures** ([`Engine::write`]: `Store::write`, `claim_with`
//!   effects) are `FnOnce` and need not be `Send`. Each runs on its caller's
//!   own thread in a write transaction of its own, committed with
//!   [`redb::Durability::None`] (about 10 µs, no fsync). The caller then
//!   waits until a later durable commit covers it: the next batch, or an
//!   empty durable batch it queues. A closure that fails or panics aborts
//!   only its own transaction; nobody else's work is touched, and no closure
//!   ever runs twice.
//!
//! A durable redb commit persists every non-durable commit before it, so
//! either way one fsync makes a whole group durable.
//!
//! Under [`Durability::None`] a batch does not even commit: the leader keeps
//! its write transaction open, answers its callers, and the next batch runs
//! in the same transaction. It is committed (without fsync) when a reader or
//! a caller closure needs it, every `max_batch` operations, and durably on
//! the flush interval, on `sync` and on close. The operations it holds are
//! kept until then: should one panic, the transaction is rolled back and
//! they are run again (operations are `Fn` and recompute their writes from
//! the transaction's state), so no answered write is undone. One commit per
//! call would cap a single thread near a non-durable redb commit's cost
//! (the ≈ 10 µs above).
//!
//! # Durability invariants
//!
//! Every commit takes a sequence number while it holds redb's write lock, so
//! the numbers follow commit order. `durable` is the largest number known to
//! be on disk.
//! - **D1**: under [`Durability::Immediate`] no write call returns `Ok` before
//!   `durable` reaches its own commit's number.
//! - **D2**: a read notes the sequence number after it opens its read
//!   transaction (every commit it can see has a number no larger) and waits
//!   for `durable` to reach it before it answers. Operations are answered only
//!   after their batch's durable commit, which covers everything they saw.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::{Condvar, Mutex, RwLock};
use redb::{Database, ReadTransaction, ReadableDatabase, WriteTransaction};

use crate::error::{Error, Result};

/// How durable a store's commits are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Durability {
    /// Every call that returns `Ok` has reached the disk (fsync) and survives
    /// a crash or a power loss. Concurrent callers share fsyncs (group
    /// commit). The default.
    #[default]
    Immediate,
    /// Calls return once their write is in the store's in-memory state,
    /// where every later read sees it, before it reaches the disk. **A crash or power loss loses the writes of roughly
    /// the last [`StoreBuilder::flush_interval`](crate::StoreBuilder::flush_interval)**
    /// (a claim can then be claimed again and its effect run twice), but the
    /// file stays consistent: it rolls back to its last durable commit.
    /// Dirty state is flushed on that interval, by [`Store::sync`](crate::Store::sync), and when the
    /// store is closed. Choose it only where re-running recent effects after
    /// a crash is acceptable.
    None,
}

/// Settings the engine needs, filled in by the store builder.
#[derive(Debug, Clone)]
pub(crate) struct EngineConfig {
    pub(crate) durability: Durability,
    pub(crate) quick_repair: bool,
    pub(crate) max_batch: usize,
    pub(crate) flush_interval: Duration,
}

thread_local! {
    /// Set while this thread runs a caller closure inside a write transaction.
    static IN_WRITE: Cell<bool> = const { Cell::new(false) };
    /// The after-commit hooks of the transactions this thread is running,
    /// innermost last: a caller closure's, and within it (when the closure's
    /// caller leads a batch before it begins) a batch's. See [`HookFrame`].
    static HOOKS: RefCell<Vec<Vec<Hook>>> = const { RefCell::new(Vec::new()) };
}

/// Work to do once a transaction has committed.
type Hook = Box<dyn FnOnce() + Send>;

/// Runs `hook` once the transaction the current thread writes in has
/// committed, and never if it rolls back. The innermost transaction the
/// thread is running wins:
/// - in a queued operation, once its batch's transaction commits (durably
///   or not);
/// - in a caller closure ([`Engine::write`]), once its commit is durable
///   (under [`Durability::Immediate`]; committed, under [`Durability::None`]);
/// - elsewhere, at once.
pub(crate) fn after_commit(hook: impl FnOnce() + Send + 'static) {
    let hook: Hook = Box::new(hook);
    let unscoped = HOOKS.with(|frames| match frames.borrow_mut().last_mut() {
        Some(frame) => {
            frame.push(hook);
            None
        }
        None => Some(hook),
    });
    if let Some(hook) = unscoped {
        hook();
    }
}

/// The hooks of one transaction this thread runs, for its lifetime: hooks
/// registered while it is the innermost frame land in it, and whatever is
/// left uncollected when it ends is dropped (the transaction did not
/// commit). Frames nest: a caller closure's scope may hold a batch's, never
/// the other way round, and the innermost one always collects.
struct HookFrame {
    /// This frame's position in [`HOOKS`], counted from 1.
    depth: usize,
}

impl HookFrame {
    fn push() -> HookFrame {
        HOOKS.with(|frames| {
            let mut frames = frames.borrow_mut();
            frames.push(Vec::new());
            HookFrame {
                depth: frames.len(),
            }
        })
    }

    /// The hooks registered in this frame so far.
    fn take(&self) -> Vec<Hook> {
        HOOKS.with(|frames| {
            frames
                .borrow_mut()
                .get_mut(self.depth - 1)
                .map(std::mem::take)
                .unwrap_or_default()
        })
    }

    /// Drops the hooks registered in this frame so far (their writes were
    /// rolled back).
    fn discard(&self) {
        drop(self.take());
    }
}

impl Drop for HookFrame {
    fn drop(&mut self) {
        let left = HOOKS.with(|frames| frames.borrow_mut().split_off(self.depth - 1));
        drop(left);
    }
}

/// Marks the current thread as inside a write closure for its lifetime, with
/// the closure's after-commit hooks.
struct WriteScope {
    hooks: HookFrame,
}

impl WriteScope {
    fn enter() -> Result<WriteScope> {
        if IN_WRITE.with(Cell::get) {
            return Err(Error::Reentrant);
        }
        IN_WRITE.with(|c| c.set(true));
        Ok(WriteScope {
            hooks: HookFrame::push(),
        })
    }
}

impl Drop for WriteScope {
    fn drop(&mut self) {
        IN_WRITE.with(|c| c.set(false));
    }
}

/// Runs after-commit hooks, each to its end: one that panics does not keep
/// the others from running. Returns the first panic, for the caller to
/// resume once nobody else depends on it.
fn run_hooks(hooks: Vec<Hook>) -> Option<Box<dyn Any + Send>> {
    let mut first = None;
    for hook in hooks {
        if let Err(panic) = catch_unwind(AssertUnwindSafe(hook)) {
            first.get_or_insert(panic);
        }
    }
    first
}

/// Durability bookkeeping shared by all callers.
#[derive(Debug, Default)]
struct SyncState {
    /// The largest commit sequence number known to be on disk.
    durable: u64,
    /// A durable commit failed: nothing after `durable` can be promised.
    broken: bool,
    /// The sequence number of the durable commit in progress, or 0.
    committing: u64,
}

struct Shared {
    db: RwLock<Database>,
    config: EngineConfig,
    /// Sequence number of the latest commit started (taken under redb's write lock).
    seq: AtomicU64,
    sync: Mutex<SyncState>,
    /// Signalled when a durable commit ends, well or badly.
    synced: Condvar,
    queue: Mutex<Queue>,
    /// Durable commits made, for the tests and the benchmarks' fsync counts.
    durable_commits: AtomicU64,
    /// Write transactions committed, durable or not.
    commits: AtomicU64,
    /// Under [`Durability::None`]: the transaction batches keep open between
    /// commits (only a batch leader touches it).
    open: Mutex<Option<OpenTx>>,
    /// Whether `open` may hold answered, uncommitted writes.
    pending: AtomicBool,
    /// Callers about to begin a write transaction of their own, which a
    /// leader must not keep one open against.
    writers_waiting: AtomicUsize,
}

impl Shared {
    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn current_seq(&self) -> u64 {
        self.seq.load(Ordering::SeqCst)
    }

    /// Takes the sequence number of a durable commit about to start.
    fn begin_durable(&self) -> u64 {
        let mut s = self.sync.lock();
        let seq = self.next_seq();
        s.committing = seq;
        seq
    }

    fn mark_durable(&self, seq: u64) {
        let mut s = self.sync.lock();
        s.durable = s.durable.max(seq);
        if s.committing == seq {
            s.committing = 0;
        }
        drop(s);
        self.synced.notify_all();
    }

    fn mark_broken(&self) {
        let mut s = self.sync.lock();
        s.broken = true;
        s.committing = 0;
        drop(s);
        self.synced.notify_all();
    }
}

fn previous_commit_failed() -> Error {
    Error::Storage(redb::Error::PreviousIo)
}

/// A queued operation, as the batch leader sees it.
trait Job: Send {
    /// Runs the operation in `tx`; `false` if it failed (returned `Err` or
    /// panicked), when it may have left part of its writes behind.
    fn run(&mut self, tx: &WriteTransaction) -> bool;
    /// Runs the operation again in a fresh transaction after a rollback,
    /// discarding its result (its caller has it already); `false` if it
    /// failed.
    fn replay(&self, tx: &WriteTransaction) -> bool;
    /// Answers the caller once the batch's fate is known.
    fn finish(&mut self, committed: Result<(), Error>);
    /// Leaves the answer in the caller's mailbox without waking the caller:
    /// whoever holds `tree` wakes it, and the caller then wakes its own
    /// children in the tree (see [`WakeTree`]).
    fn finish_quietly(&mut self, committed: Result<(), Error>, tree: Arc<WakeTree>, index: usize);
    /// The job's caller, to wake.
    fn caller(&self) -> Arc<dyn Notify>;
    /// Tells the job's waiting caller to lead the next batch.
    fn promote(&self);
    /// What its batch must do before the job's caller is answered.
    fn needs(&self) -> Needs;
}

/// What a batch must do before its callers are answered, beyond running
/// their operations. Ordered: a batch does what its most demanding job
/// needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Needs {
    /// Whatever the store's durability asks for.
    Default,
    /// Commit, even if the store would keep the transaction open.
    Commit,
    /// Commit durably, whatever the store's durability (a `sync`).
    Durable,
}

type Reply<T> = std::result::Result<Result<T>, Box<dyn Any + Send>>;

/// What a waiting caller is told.
enum Wake<T> {
    /// The batch holding the caller's operation is settled; if woken
    /// through a [`WakeTree`], the caller wakes its children there.
    Done(Reply<T>, Option<(Arc<WakeTree>, usize)>),
    /// The caller leads the next batch.
    Lead,
}

/// Where a waiting caller is told what happened: a one-shot mailbox that
/// blocks without spinning (dozens of callers may wait on two cores).
struct Slot<T> {
    wake: Mutex<Option<Wake<T>>>,
    signal: Condvar,
}

impl<T> Slot<T> {
    fn new() -> Arc<Slot<T>> {
        Arc::new(Slot {
            wake: Mutex::new(None),
            signal: Condvar::new(),
        })
    }

    fn put(&self, wake: Wake<T>) {
        self.put_quietly(wake);
        self.signal.notify_one();
    }

    fn put_quietly(&self, wake: Wake<T>) {
        *self.wake.lock() = Some(wake);
    }

    fn take(&self) -> Wake<T> {
        let mut w = self.wake.lock();
        loop {
            if let Some(wake) = w.take() {
                return wake;
            }
            self.signal.wait(&mut w);
        }
    }
}

/// A waiting caller, as whoever wakes it sees it.
trait Notify: Send + Sync {
    fn notify(&self);
}

impl<T: Send> Notify for Slot<T> {
    fn notify(&self) {
        self.signal.notify_one();
    }
}

/// The callers of a settled batch, woken as a binary tree: the leader wakes
/// the first two, and each caller, once awake, the next two. A wake-up costs
/// a system call (≈ 15 µs on a busy 2-core VM); spread this way they run on
/// the callers' threads and in parallel, not one by one on the leader's,
/// so callers queue their next operations sooner and batches stay full.
struct WakeTree {
    callers: Vec<Arc<dyn Notify>>,
}

impl WakeTree {
    /// Wakes the children of caller `parent` (of the leader, for `None`).
    fn wake_children(&self, parent: Option<usize>) {
        let first = parent.map_or(0, |p| 2 * p + 2);
        for caller in self.callers.iter().skip(first).take(2) {
            caller.notify();
        }
    }
}

struct OpJob<T, F> {
    op: F,
    result: Option<Reply<T>>,
    reply: Arc<Slot<T>>,
    needs: Needs,
}

impl<T, F> OpJob<T, F> {
    fn answer(&mut self, committed: Result<(), Error>) -> Reply<T> {
        match (committed, self.result.take()) {
            (_, Some(Err(panic))) => Err(panic),
            (Ok(()), Some(Ok(r))) => Ok(r),
            (Err(e), _) => Ok(Err(e)),
            // Every job runs before its batch commits; this would be a bug.
            (Ok(()), None) => Ok(Err(Error::Panicked {
                during: "a batch",
                message: "an operation was answered before it ran".to_owned(),
            })),
        }
    }
}

impl<T, F> Job for OpJob<T, F>
where
    T: Send + 'static,
    F: Fn(&WriteTransaction) -> Result<T> + Send + 'static,
{
    fn run(&mut self, tx: &WriteTransaction) -> bool {
        let r = catch_unwind(AssertUnwindSafe(|| (self.op)(tx)));
        let ok = matches!(r, Ok(Ok(_)));
        self.result = Some(r);
        ok
    }

    fn replay(&self, tx: &WriteTransaction) -> bool {
        matches!(catch_unwind(AssertUnwindSafe(|| (self.op)(tx))), Ok(Ok(_)))
    }

    fn finish(&mut self, committed: Result<(), Error>) {
        let answer = self.answer(committed);
        self.reply.put(Wake::Done(answer, None));
    }

    fn finish_quietly(&mut self, committed: Result<(), Error>, tree: Arc<WakeTree>, index: usize) {
        let answer = self.answer(committed);
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
struct Queue {
    jobs: Vec<Box<dyn Job>>,
    leading: bool,
}

/// The store's database, its batch queue and, under [`Durability::None`],
/// its flusher thread.
pub(crate) struct Engine {
    shared: Arc<Shared>,
    flusher: Option<(Sender<()>, JoinHandle<()>)>,
    path: Option<PathBuf>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("path", &self.path)
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl Engine {
    pub(crate) fn start(
        db: Database,
        config: EngineConfig,
        path: Option<PathBuf>,
    ) -> Result<Engine> {
        let shared = Arc::new(Shared {
            db: RwLock::new(db),
            config,
            seq: AtomicU64::new(0),
            sync: Mutex::new(SyncState::default()),
            synced: Condvar::new(),
            queue: Mutex::new(Queue::default()),
            durable_commits: AtomicU64::new(0),
            commits: AtomicU64::new(0),
            open: Mutex::new(None),
            pending: AtomicBool::new(false),
            writers_waiting: AtomicUsize::new(0),
        });
        let flusher = if shared.config.durability == Durability::None {
            let (stop, stopped) = crossbeam_channel::bounded::<()>(1);
            let thread_shared = shared.clone();
            let handle = std::thread::Builder::new()
                .name("idemstore-flush".into())
                .spawn(move || flush_loop(&thread_shared, &stopped))
                .map_err(Error::Io)?;
            Some((stop, handle))
        } else {
            None
        };
        Ok(Engine {
            shared,
            flusher,
            path,
        })
    }

    pub(crate) fn path(&self) -> Option<&std::path::Path> {
        self.path.as_deref()
    }

    pub(crate) fn durability(&self) -> Durability {
        self.shared.config.durability
    }

    /// Runs a store operation in the next batch and returns its result once
    /// the batch is committed (durably, under [`Durability::Immediate`]).
    ///
    /// If `op` returns `Err` (or panics), whatever it wrote is rolled back
    /// and the caller gets its error: a failed operation wrote nothing. It
    /// may be run more than once (after another operation in its batch
    /// failed), and must then compute the same writes from the
    /// transaction's state.
    pub(crate) fn execute<T, F>(&self, op: F) -> Result<T>
    where
        T: Send + 'static,
        F: Fn(&WriteTransaction) -> Result<T> + Send + 'static,
    {
        if IN_WRITE.with(Cell::get) {
            return Err(Error::Reentrant);
        }
        self.shared.submit(op, Needs::Default)
    }

    /// Whether a batch is being run right now or a transaction is kept open
    /// (a hint: it may change at once). A write queued now will not commit
    /// on its own.
    pub(crate) fn is_busy(&self) -> bool {
        self.shared.pending.load(Ordering::Relaxed) || self.shared.queue.lock().leading
    }

    /// Runs a caller closure in a write transaction of its own on this
    /// thread; commits if it returns `Ok`, aborts if it returns `Err` or
    /// panics (then resumes the panic). Returns once the commit is durable
    /// (under [`Durability::Immediate`]).
    pub(crate) fn write<T, E>(
        &self,
        f: impl FnOnce(&WriteTransaction) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<Error>,
    {
        let scope = WriteScope::enter()?;
        let db = self.shared.db.read_recursive();
        let mut tx = self.begin_own_write()?;
        tx.set_durability(redb::Durability::None)
            .map_err(Error::from)?;
        match catch_unwind(AssertUnwindSafe(|| f(&tx))) {
            Err(panic) => {
                // Abort explicitly: dropping a write transaction while a panic
                // unwinds would flag the file for a full repair.
                let _ = tx.abort();
                drop(scope);
                resume_unwind(panic)
            }
            Ok(Err(e)) => {
                drop(scope);
                tx.abort().map_err(Error::from)?;
                Err(e)
            }
            Ok(Ok(value)) => {
                let hooks = scope.hooks.take();
                drop(scope);
                let seq = self.shared.next_seq();
                match catch_unwind(AssertUnwindSafe(|| tx.commit())) {
                    Ok(committed) => committed.map_err(Error::from)?,
                    Err(panic) => {
                        // The commit's fate is unknown: nothing more can be
                        // promised on top of it.
                        self.shared.mark_broken();
                        resume_unwind(panic)
                    }
                }
                self.shared.commits.fetch_add(1, Ordering::Relaxed);
                drop(db);
                self.settle(seq)?;
                if let Some(panic) = run_hooks(hooks) {
                    resume_unwind(panic)
                }
                Ok(value)
            }
        }
    }

    /// Runs `f` in a read transaction. Under [`Durability::Immediate`] the
    /// answer is returned only once everything the transaction could see is
    /// durable (D2).
    pub(crate) fn read<T, E>(
        &self,
        f: impl FnOnce(&ReadTransaction) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<Error>,
    {
        self.commit_pending()?;
        let db = self.shared.db.read_recursive();
        let tx = db.begin_read().map_err(Error::from)?;
        let seen = self.shared.current_seq();
        let out = f(&tx);
        drop(tx);
        drop(db);
        if out.is_ok() {
            self.settle(seen)?;
        }
        out
    }

    /// Commits the transaction batches keep open under
    /// [`Durability::None`], so that a read transaction begun next sees every
    /// answered write. [`Engine::read`] does it itself; callers of
    /// [`Engine::read_unsettled`] do it first.
    pub(crate) fn commit_pending(&self) -> Result<()> {
        if IN_WRITE.with(Cell::get) {
            // Inside a caller closure no batch can hold a transaction open.
            return Ok(());
        }
        self.shared.commit_pending()
    }

    /// Runs `f` in a read transaction begun now (after
    /// [`Engine::commit_pending`]) and returns its answer at once, with the
    /// sequence number to [`Engine::settle`] before acting on the answer
    /// towards a caller (D2).
    pub(crate) fn read_unsettled<T>(
        &self,
        f: impl FnOnce(&ReadTransaction) -> Result<T>,
    ) -> Result<(T, u64)> {
        let db = self.shared.db.read_recursive();
        let tx = db.begin_read()?;
        let seen = self.shared.current_seq();
        let out = f(&tx)?;
        Ok((out, seen))
    }

    /// Under [`Durability::Immediate`], waits until commit `seq` is durable.
    /// Inside a caller closure it does not wait (it could not: the closure
    /// holds the writer): what the closure returns is released only after
    /// its own durable commit, which covers every commit before it.
    pub(crate) fn settle(&self, seq: u64) -> Result<()> {
        if self.shared.config.durability == Durability::Immediate && !IN_WRITE.with(Cell::get) {
            self.shared.wait_durable(seq)?;
        }
        Ok(())
    }

    /// Makes every commit so far durable, whatever the store's durability.
    pub(crate) fn sync(&self) -> Result<()> {
        if IN_WRITE.with(Cell::get) {
            return Err(Error::Reentrant);
        }
        self.shared.sync_all()
    }

    /// Runs `f` with the database to itself: no transaction of this store is
    /// open meanwhile. For compaction and integrity checks.
    pub(crate) fn exclusive<T>(&self, f: impl FnOnce(&mut Database) -> Result<T>) -> Result<T> {
        self.sync()?;
        self.shared.without_open(|| {
            let mut db = self.shared.db.write();
            f(&mut db)
        })
    }

    /// Begins a write transaction for this thread's own use, once no batch
    /// holds one open.
    fn begin_own_write(&self) -> Result<WriteTransaction> {
        self.shared.without_open(|| {
            let db = self.shared.db.read_recursive();
            Ok(db.begin_write()?)
        })
    }

    /// Runs `f` in a write transaction that is always aborted, never
    /// committed: for what only a write transaction can tell (redb's
    /// [`WriteTransaction::stats`]). Waits for the writer like any write.
    pub(crate) fn inspect_write<T>(
        &self,
        f: impl FnOnce(&WriteTransaction) -> Result<T>,
    ) -> Result<T> {
        let scope = WriteScope::enter()?;
        let tx = self.begin_own_write()?;
        let out = f(&tx);
        tx.abort()?;
        drop(scope);
        out
    }

    /// Commit counters: `(all commits, durable commits)`.
    pub(crate) fn commit_counts(&self) -> (u64, u64) {
        (
            self.shared.commits.load(Ordering::Relaxed),
            self.shared.durable_commits.load(Ordering::Relaxed),
        )
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some((stop, handle)) = self.flusher.take() {
            drop(stop);
            let _ = handle.join();
        }
        // Under Durability::None, what is still only in memory reaches the
        // disk now; a failure here has nobody left to tell.
        let _ = self.shared.sync_all();
    }
}

impl Shared {
    /// Queues `op` and waits for its batch, leading batches when asked to.
    fn submit<T, F>(&self, op: F, needs: Needs) -> Result<T>
    where
        T: Send + 'static,
        F: Fn(&WriteTransaction) -> Result<T> + Send + 'static,
    {
        let slot = Slot::new();
        let job = OpJob {
            op,
            result: None,
            reply: slot.clone(),
            needs,
        };
        let lead_now = {
            let mut q = self.queue.lock();
            q.jobs.push(Box::new(job));
            !std::mem::replace(&mut q.leading, true)
        };
        if lead_now {
            self.lead();
        }
        loop {
            match slot.take() {
                Wake::Done(reply, tree) => {
                    if let Some((tree, index)) = tree {
                        tree.wake_children(Some(index));
                    }
                    match reply {
                        Ok(result) => return result,
                        Err(panic) => resume_unwind(panic),
                    }
                }
                Wake::Lead => self.lead(),
            }
        }
    }

    /// Runs the queued operations as one batch, then hands leadership to
    /// the next waiting caller, if any, and answers the batch's callers.
    ///
    /// Unwind-safe: whatever panics while the batch runs (an operation, an
    /// after-commit hook, redb itself or its storage backend), every caller
    /// drained into the batch is answered and the lead is passed on. A panic
    /// outside the operations leaves the transaction's fate unknown: the
    /// engine is marked broken, so later calls get a clear `Err` instead of
    /// waiting, and the batch's callers get [`Error::Panicked`]. A panicking
    /// hook runs after its commit: its batch's callers are answered as
    /// committed, and the panic is resumed on this thread once they are.
    fn lead(&self) {
        let mut batch = Batch::new(self.drain_queue());
        if !batch.jobs.is_empty()
            && let Err(panic) = catch_unwind(AssertUnwindSafe(|| run_batch(self, &mut batch)))
        {
            lose_open(self);
            batch.fail_rest(&Error::panicked("a batch commit", &*panic));
        }
        self.hand_on_lead();
        wake(batch.settled);
        if let Some(panic) = batch.hook_panic {
            resume_unwind(panic)
        }
    }

    /// Takes up to a batch of queued operations.
    fn drain_queue(&self) -> Vec<Box<dyn Job>> {
        let mut q = self.queue.lock();
        let n = q.jobs.len().min(self.config.max_batch);
        q.jobs.drain(..n).collect()
    }

    /// Promotes the first waiting caller to lead the next batch, or notes
    /// that nobody leads. Done before answering the last batch's callers,
    /// so that the next batch starts while they are woken.
    fn hand_on_lead(&self) {
        let mut q = self.queue.lock();
        match q.jobs.first() {
            Some(next) => next.promote(),
            None => q.leading = false,
        }
    }

    /// Waits until commit `seq` is durable, making a durable commit if none
    /// is on its way.
    fn wait_durable(&self, seq: u64) -> Result<()> {
        loop {
            {
                let mut s = self.sync.lock();
                loop {
                    if s.durable >= seq {
                        return Ok(());
                    }
                    if s.broken {
                        return Err(previous_commit_failed());
                    }
                    if s.committing < seq {
                        break;
                    }
                    // A durable commit that covers `seq` is on its way.
                    self.synced.wait(&mut s);
                }
            }
            // Nothing on its way covers `seq`: an empty durable batch will,
            // as it persists every commit before it.
            self.submit(|_| Ok(()), Needs::Durable)?;
        }
    }

    /// Makes every write answered so far durable, including those in the
    /// open transaction.
    fn sync_all(&self) -> Result<()> {
        if self.pending.load(Ordering::SeqCst) {
            self.submit(|_| Ok(()), Needs::Durable)?;
        }
        self.wait_durable(self.current_seq())
    }

    /// Commits the open transaction, if there is one, so that what it holds
    /// is visible to readers.
    fn commit_pending(&self) -> Result<()> {
        if self.pending.load(Ordering::SeqCst) {
            self.submit(|_| Ok(()), Needs::Commit)?;
        }
        Ok(())
    }

    /// Runs `f` with no transaction left open by a batch: for callers that
    /// begin a write transaction of their own, or need the database alone.
    fn without_open<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        // Announce first, then look: a leader about to keep a transaction
        // open looks at `writers_waiting` after it sets `pending`, so one
        // of the two sees the other (both sequentially consistent).
        self.writers_waiting.fetch_add(1, Ordering::SeqCst);
        let out = self.commit_pending().and_then(|()| f());
        self.writers_waiting.fetch_sub(1, Ordering::SeqCst);
        out
    }
}

/// Under [`Durability::None`]: flushes dirty state every flush interval
/// until `stop` closes.
fn flush_loop(shared: &Shared, stop: &Receiver<()>) {
    loop {
        match stop.recv_timeout(shared.config.flush_interval) {
            Err(RecvTimeoutError::Timeout) => {
                let _ = shared.sync_all();
            }
            _ => return,
        }
    }
}

/// A job with the fate of its batch, to answer once the lead is handed on.
type Settled = Vec<(Box<dyn Job>, Result<(), Error>)>;

/// The operations of the batch being led.
struct Batch {
    /// Operations run (or to run) in the batch's transaction, not yet
    /// answered.
    jobs: Vec<Box<dyn Job>>,
    /// Operations with their fate, to answer once the lead is handed on.
    settled: Settled,
    /// The first panic of an after-commit hook, resumed on the leader's
    /// thread once every caller is answered.
    hook_panic: Option<Box<dyn Any + Send>>,
}

impl Batch {
    fn new(jobs: Vec<Box<dyn Job>>) -> Batch {
        Batch {
            settled: Vec::with_capacity(jobs.len()),
            jobs,
            hook_panic: None,
        }
    }

    /// Settles every operation not yet settled with `e`.
    fn fail_rest(&mut self, e: &Error) {
        let jobs = std::mem::take(&mut self.jobs);
        fail_all(&mut self.settled, jobs, e);
    }

    /// Settles every operation not yet settled as committed.
    fn commit_rest(&mut self) {
        self.settled
            .extend(self.jobs.drain(..).map(|job| (job, Ok(()))));
    }

    /// Runs the operations from `from` on in `tx`, in order, up to the first
    /// that fails; returns its index, or `None` if all of them succeeded.
    fn run_from(&mut self, from: usize, tx: &WriteTransaction) -> Option<usize> {
        for (i, job) in self.jobs.iter_mut().enumerate().skip(from) {
            if !job.run(tx) {
                return Some(i);
            }
        }
        None
    }
}

/// Answers the callers of a settled batch through a [`WakeTree`].
fn wake(settled: Settled) {
    let tree = Arc::new(WakeTree {
        callers: settled.iter().map(|(job, _)| job.caller()).collect(),
    });
    for (index, (mut job, outcome)) in settled.into_iter().enumerate() {
        job.finish_quietly(outcome, tree.clone(), index);
    }
    tree.wake_children(None);
}

/// Under [`Durability::None`], a write transaction kept open across
/// batches, with the operations it holds (already answered), so that they
/// can be run again should the transaction have to be rolled back.
struct OpenTx {
    tx: WriteTransaction,
    log: Vec<Box<dyn Job>>,
    /// What the logged operations asked to run once it commits.
    hooks: Vec<Hook>,
}

/// Runs the batch's operations in one write transaction, the open one if
/// there is one, and commits it, or under [`Durability::None`] may keep it
/// open; settles each operation with its fate (one kept in the open
/// transaction is answered at once instead).
///
/// An operation that fails (returns `Err` or panics) may have written part
/// of its work, so it never commits: the transaction is rolled back, the
/// failed operation is settled with its own error, and the others run again
/// without it. A failed call therefore wrote nothing, whatever the
/// operation did before it failed.
fn run_batch(shared: &Shared, batch: &mut Batch) {
    let immediate = shared.config.durability == Durability::Immediate;
    let db = shared.db.read_recursive();
    let mut open = shared.open.lock();
    if shared.sync.lock().broken {
        // A commit failed, or answered writes were lost: nothing more is
        // answered on top of that.
        batch.fail_rest(&previous_commit_failed());
        return;
    }
    let (mut tx, mut log, mut hooks) = match open.take() {
        Some(o) => (o.tx, o.log, o.hooks),
        None => match db.begin_write() {
            Ok(tx) => (tx, Vec::new(), Vec::new()),
            Err(e) => {
                // The engine refuses writes (after a failed commit): nothing
                // queued now or later can be made durable.
                shared.mark_broken();
                batch.fail_rest(&Error::from(e));
                return;
            }
        },
    };
    let frame = HookFrame::push();
    let mut ran = 0;
    loop {
        let Some(failed) = batch.run_from(ran, &tx) else {
            // Take in what was queued while these ran, so that callers
            // woken from the last batch still share this one's fsync.
            ran = batch.jobs.len();
            if absorb(shared, &mut batch.jobs)
                || (immediate && absorb_after_yielding(shared, &mut batch.jobs))
            {
                continue;
            }
            break;
        };
        // Roll the whole transaction back and run the others again without
        // the failed operation. Their hooks go with the writes; the
        // operations run again register theirs anew.
        ran = 0;
        let _ = tx.abort();
        hooks.clear();
        frame.discard();
        let job = batch.jobs.remove(failed);
        batch.settled.push((job, Ok(())));
        tx = match db.begin_write() {
            Ok(tx) => tx,
            Err(e) => {
                lose_open(shared);
                batch.fail_rest(&Error::from(e));
                return;
            }
        };
        if !replay_log(&log, &tx) {
            // An operation answered earlier cannot be run again: what the
            // log held is lost, as a crash would have lost it.
            let _ = tx.abort();
            lose_open(shared);
            batch.fail_rest(&previous_commit_failed());
            return;
        }
    }
    let needs = batch
        .jobs
        .iter()
        .map(|j| j.needs())
        .max()
        .unwrap_or(Needs::Default);
    let durable = immediate || needs == Needs::Durable;
    if !durable
        && needs == Needs::Default
        && log.len() + batch.jobs.len() < shared.config.max_batch
        && keep_open(shared)
    {
        // Answer now: the writes are in the open transaction, which every
        // reader and writer commits before it looks.
        hooks.extend(frame.take());
        for mut job in batch.jobs.drain(..) {
            job.finish(Ok(()));
            log.push(job);
        }
        *open = Some(OpenTx { tx, log, hooks });
        return;
    }
    hooks.extend(frame.take());
    drop(frame);
    let outcome = commit(shared, tx, durable);
    shared.pending.store(false, Ordering::SeqCst);
    drop(log);
    match outcome {
        Ok(()) => {
            batch.hook_panic = run_hooks(hooks);
            batch.commit_rest();
        }
        Err(e) => batch.fail_rest(&e),
    }
}

/// Runs the answered operations of the open transaction again in `tx`
/// after a rollback; `false` if one of them failed.
fn replay_log(log: &[Box<dyn Job>], tx: &WriteTransaction) -> bool {
    for job in log {
        if !job.replay(tx) {
            return false;
        }
    }
    true
}

/// Moves queued operations into the running batch, up to the batch limit;
/// `false` if there were none.
fn absorb(shared: &Shared, jobs: &mut Vec<Box<dyn Job>>) -> bool {
    let mut q = shared.queue.lock();
    let n = q
        .jobs
        .len()
        .min(shared.config.max_batch.saturating_sub(jobs.len()));
    jobs.extend(q.jobs.drain(..n));
    n > 0
}

/// Before an fsync: lets the callers just woken from the last batch run for
/// a moment, and takes in what they queue. Without this, on two cores the
/// callers woken late miss the batch and wait a whole commit for the next
/// one (measured at 64 threads: ≈ 42 operations per fsync instead of ≈ 57,
/// and 18% fewer claims per second). A yield with nobody to run costs about
/// a microsecond, against an fsync's hundreds.
fn absorb_after_yielding(shared: &Shared, jobs: &mut Vec<Box<dyn Job>>) -> bool {
    (0..3).any(|_| {
        std::thread::yield_now();
        absorb(shared, jobs)
    })
}

/// Whether a leader may keep its transaction open: marks it pending, then
/// checks that nobody is waiting to write (see [`Shared::without_open`]).
fn keep_open(shared: &Shared) -> bool {
    shared.pending.store(true, Ordering::SeqCst);
    shared.writers_waiting.load(Ordering::SeqCst) == 0
}

/// Commits `tx`, durably or not, and does the bookkeeping.
fn commit(shared: &Shared, mut tx: WriteTransaction, durable: bool) -> Result<()> {
    let set = if durable {
        tx.set_quick_repair(shared.config.quick_repair);
        tx.set_durability(redb::Durability::Immediate)
    } else {
        tx.set_durability(redb::Durability::None)
    };
    if let Err(e) = set {
        let _ = tx.abort();
        shared.mark_broken();
        return Err(e.into());
    }
    let seq = if durable {
        shared.begin_durable()
    } else {
        shared.next_seq()
    };
    match tx.commit() {
        Ok(()) => {
            shared.commits.fetch_add(1, Ordering::Relaxed);
            if durable {
                shared.durable_commits.fetch_add(1, Ordering::Relaxed);
                shared.mark_durable(seq);
            }
            Ok(())
        }
        Err(e) => {
            shared.mark_broken();
            Err(Error::from(e))
        }
    }
}

/// The open transaction was rolled back and cannot be rebuilt: the writes
/// it held, already answered, are gone. The engine is marked broken so that
/// nothing more is answered on top of them.
fn lose_open(shared: &Shared) {
    shared.mark_broken();
    shared.pending.store(false, Ordering::SeqCst);
}

fn fail_all(settled: &mut Settled, jobs: Vec<Box<dyn Job>>, e: &Error) {
    settled.extend(jobs.into_iter().map(|job| (job, Err(clone_error(e)))));
}

/// A copy of `e` for each caller of a failed batch. The engine's and the
/// file system's errors are not `Clone`: their copies keep the kind and the
/// message.
fn clone_error(e: &Error) -> Error {
    fn io(e: &std::io::Error) -> std::io::Error {
        std::io::Error::new(e.kind(), e.to_string())
    }
    match e {
        Error::Storage(redb::Error::PreviousIo) => previous_commit_failed(),
        Error::Storage(redb::Error::Io(inner)) => Error::Storage(redb::Error::Io(io(inner))),
        Error::Storage(inner) => {
            Error::Storage(redb::Error::Io(std::io::Error::other(inner.to_string())))
        }
        Error::Io(inner) => Error::Io(io(inner)),
        Error::NotFound => Error::NotFound,
        Error::Conflict { reason } => Error::conflict(reason.clone()),
        Error::InvalidInput { field, reason } => Error::invalid(field, reason.clone()),
        Error::TooLarge { field, len, max } => Error::TooLarge {
            field,
            len: *len,
            max: *max,
        },
        Error::Corrupted { table, key, reason } => Error::Corrupted {
            table,
            key: key.clone(),
            reason: reason.clone(),
        },
        Error::IncompatibleFormat { found, supported } => Error::IncompatibleFormat {
            found: found.clone(),
            supported: *supported,
        },
        Error::NotAStore { path, reason } => Error::NotAStore {
            path: path.clone(),
            reason: reason.clone(),
        },
        Error::AlreadyOpen { path } => Error::AlreadyOpen { path: path.clone() },
        Error::Reentrant => Error::Reentrant,
        Error::Closed => Error::Closed,
        Error::Panicked { during, message } => Error::Panicked {
            during,
            message: message.clone(),
        },
    }
}

#[cfg(test)]
mod tests {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::sync::Arc;
    use std::time::Duration;

    use redb::backends::InMemoryBackend;
    use redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};

    use super::{Durability, Engine, EngineConfig, after_commit};
    use crate::error::{Error, Result};

    const T: TableDefinition<&str, u64> = TableDefinition::new("t");

    fn engine(durability: Durability, max_batch: usize) -> Arc<Engine> {
        let db = redb::Database::builder()
            .create_with_backend(InMemoryBackend::new())
            .unwrap();
        let config = EngineConfig {
            durability,
            quick_repair: false,
            max_batch,
            flush_interval: Duration::from_secs(3600),
        };
        Arc::new(Engine::start(db, config, None).unwrap())
    }

    fn put(engine: &Engine, key: &'static str, value: u64) -> Result<()> {
        engine.execute(move |tx| {
            tx.open_table(T)?.insert(key, value)?;
            Ok(())
        })
    }

    fn get(engine: &Engine, key: &str) -> Result<Option<u64>> {
        engine.read(|tx| match tx.open_table(T) {
            Ok(t) => Ok(t.get(key)?.map(|v| v.value())),
            Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
            Err(e) => Err(Error::from(e)),
        })
    }

    /// An operation that writes, then panics: its write must not survive.
    fn put_then_panic(engine: &Engine, key: &'static str) {
        let out = catch_unwind(AssertUnwindSafe(|| {
            engine.execute(move |tx| -> Result<()> {
                tx.open_table(T)?.insert(key, 666)?;
                panic!("operation failed half-way");
            })
        }));
        assert!(out.is_err(), "the panic reaches its caller");
    }

    #[test]
    fn a_panicking_operation_loses_nothing_answered_before_it() {
        for durability in [Durability::Immediate, Durability::None] {
            let engine = engine(durability, 1024);
            put(&engine, "before", 1).unwrap();
            put_then_panic(&engine, "bad");
            put(&engine, "after", 2).unwrap();
            assert_eq!(get(&engine, "before").unwrap(), Some(1), "{durability:?}");
            assert_eq!(get(&engine, "after").unwrap(), Some(2), "{durability:?}");
            assert_eq!(get(&engine, "bad").unwrap(), None, "{durability:?}");
        }
    }

    #[test]
    fn an_operation_that_fails_after_writing_leaves_nothing() {
        for durability in [Durability::Immediate, Durability::None] {
            let engine = engine(durability, 1024);
            put(&engine, "before", 1).unwrap();
            let out = engine.execute(|tx| -> Result<()> {
                tx.open_table(T)?.insert("half", 7)?;
                Err(Error::conflict("failed after its first write"))
            });
            assert!(matches!(out, Err(Error::Conflict { .. })), "{out:?}");
            put(&engine, "after", 2).unwrap();
            assert_eq!(get(&engine, "half").unwrap(), None, "{durability:?}");
            assert_eq!(get(&engine, "before").unwrap(), Some(1), "{durability:?}");
            assert_eq!(get(&engine, "after").unwrap(), Some(2), "{durability:?}");
        }
    }

    #[test]
    fn failing_operations_roll_back_alone_among_concurrent_ones() {
        let engine = engine(Durability::Immediate, 1024);
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let engine = engine.clone();
                std::thread::spawn(move || {
                    for i in 0..100u64 {
                        let key: &'static str = Box::leak(format!("{t}-{i}").into_boxed_str());
                        let fail = (t + i) % 3 == 0;
                        let out = engine.execute(move |tx| -> Result<()> {
                            tx.open_table(T)?.insert(key, i)?;
                            if fail {
                                return Err(Error::NotFound);
                            }
                            Ok(())
                        });
                        assert_eq!(out.is_err(), fail, "{key}: {out:?}");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        for t in 0..8u64 {
            for i in 0..100u64 {
                let expected = ((t + i) % 3 != 0).then_some(i);
                assert_eq!(get(&engine, &format!("{t}-{i}")).unwrap(), expected);
            }
        }
    }

    #[test]
    fn a_panicking_after_commit_hook_answers_everyone_and_keeps_the_store_working() {
        let engine = engine(Durability::Immediate, 1024);
        let out = catch_unwind(AssertUnwindSafe(|| {
            engine.execute(|tx| -> Result<()> {
                tx.open_table(T)?.insert("hooked", 1)?;
                after_commit(|| panic!("hook failed"));
                Ok(())
            })
        }));
        assert!(out.is_err(), "the hook's panic reaches the leader");
        assert_eq!(get(&engine, "hooked").unwrap(), Some(1), "committed");
        put(&engine, "later", 2).unwrap();
        assert_eq!(get(&engine, "later").unwrap(), Some(2));
    }

    /// A caller closure's caller may lead a batch before its own
    /// transaction begins (to commit the transaction kept open under
    /// [`Durability::None`]). The hooks of that batch's operations belong
    /// to the batch: one whose operation was rolled back never runs, even
    /// when the closure commits afterwards.
    #[test]
    fn hooks_of_a_rolled_back_operation_never_run_when_a_closure_caller_leads() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::mpsc;

        let engine = engine(Durability::None, 2);
        let queued = |n: usize| {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while engine.shared.queue.lock().jobs.len() < n {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{n} jobs never queued"
                );
                std::thread::yield_now();
            }
        };
        // Leaves a transaction open (pending).
        put(&engine, "a", 1).unwrap();
        // A batch held running while the others queue behind it.
        let (started, is_started) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let released = Arc::new(parking_lot::Mutex::new(released));
        let holder = {
            let engine = engine.clone();
            std::thread::spawn(move || {
                engine.execute(move |_| {
                    let _ = started.send(());
                    let _ = released.lock().recv();
                    Ok(())
                })
            })
        };
        is_started.recv().unwrap();
        let filler = {
            let engine = engine.clone();
            std::thread::spawn(move || put(&engine, "y", 2))
        };
        queued(1);
        let writer = {
            let engine = engine.clone();
            std::thread::spawn(move || {
                engine.write(|tx| -> Result<()> {
                    tx.open_table(T)?.insert("c", 3)?;
                    Ok(())
                })
            })
        };
        queued(2);
        let ran = Arc::new(AtomicBool::new(false));
        let panicker = {
            let (engine, ran) = (engine.clone(), ran.clone());
            std::thread::spawn(move || {
                catch_unwind(AssertUnwindSafe(|| {
                    engine.execute(move |_| -> Result<()> {
                        let ran = ran.clone();
                        after_commit(move || ran.store(true, Ordering::SeqCst));
                        panic!("rolled back");
                    })
                }))
                .is_err()
            })
        };
        queued(3);
        release.send(()).unwrap();
        holder.join().unwrap().unwrap();
        filler.join().unwrap().unwrap();
        writer.join().unwrap().unwrap();
        assert!(panicker.join().unwrap(), "the panic reached its caller");
        assert!(
            !ran.load(Ordering::SeqCst),
            "a rolled-back operation's hook ran"
        );
        for (key, value) in [("a", 1), ("y", 2), ("c", 3)] {
            assert_eq!(get(&engine, key).unwrap(), Some(value), "{key}");
        }
    }

    #[test]
    fn under_none_writes_share_an_open_transaction_that_readers_see() {
        let engine = engine(Durability::None, 1024);
        let (commits, _) = engine.commit_counts();
        for (i, key) in ["a", "b", "c"].into_iter().enumerate() {
            put(&engine, key, i as u64).unwrap();
        }
        assert_eq!(
            engine.commit_counts().0,
            commits,
            "nothing committed yet: the transaction is kept open"
        );
        // Another thread sees every answered write.
        let reader = engine.clone();
        let seen = std::thread::spawn(move || get(&reader, "c").unwrap())
            .join()
            .unwrap();
        assert_eq!(seen, Some(2));
        assert_eq!(
            engine.commit_counts().0,
            commits + 1,
            "the read committed it"
        );
    }

    #[test]
    fn under_none_the_open_transaction_commits_every_max_batch_operations() {
        let engine = engine(Durability::None, 8);
        let (commits, _) = engine.commit_counts();
        for _ in 0..40 {
            engine
                .execute(|tx| {
                    let mut t = tx.open_table(T)?;
                    let n = t.get("n")?.map_or(0, |v| v.value());
                    t.insert("n", n + 1)?;
                    Ok(())
                })
                .unwrap();
        }
        assert_eq!(engine.commit_counts().0, commits + 5);
        assert_eq!(get(&engine, "n").unwrap(), Some(40));
    }

    #[test]
    fn under_none_own_transactions_and_batches_interleave_without_deadlock() {
        let engine = engine(Durability::None, 1024);
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let engine = engine.clone();
                std::thread::spawn(move || {
                    for i in 0..200u64 {
                        let key: &'static str = Box::leak(format!("{t}-{i}").into_boxed_str());
                        if t % 2 == 0 {
                            put(&engine, key, i).unwrap();
                        } else {
                            engine
                                .write(|tx| -> Result<()> {
                                    tx.open_table(T)?.insert(key, i)?;
                                    Ok(())
                                })
                                .unwrap();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        for t in 0..8 {
            for i in 0..200u64 {
                assert_eq!(get(&engine, &format!("{t}-{i}")).unwrap(), Some(i));
            }
        }
        engine.sync().unwrap();
        let (all, durable) = engine.commit_counts();
        assert!(durable >= 1 && all >= durable);
        engine
            .exclusive(|db| {
                let tx = db.begin_read()?;
                assert_eq!(tx.open_table(T)?.len()?, 1600);
                Ok(())
            })
            .unwrap();
    }
}
