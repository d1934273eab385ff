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
//!   closures over owned data. They are queued to the store's commit thread,
//!   which drains the queue, runs every queued operation in **one** write
//!   transaction and commits it once. Each caller is answered after that
//!   commit. An operation checks before it writes, so an operation that
//!   returns `Err` wrote nothing and the others in its batch commit as usual.
//!   An operation that panics poisons the transaction: it is aborted and the
//!   rest of the batch is run again without it (operations are `Fn`, so they
//!   may run more than once; they write only what they compute).
//! - **Caller closures** ([`Engine::write`]: `Store::write`, `claim_with`
//!   effects) are `FnOnce` and need not be `Send`. Each runs on its caller's
//!   own thread in a write transaction of its own, committed with
//!   [`redb::Durability::None`] (about 10 µs, no fsync). The caller then
//!   waits until a later durable commit covers it: the commit thread's next
//!   batch, or an empty durable commit it makes on request. A closure that
//!   fails or panics aborts only its own transaction; nobody else's work is
//!   touched, so no closure is ever run twice.
//!
//! A durable redb commit persists every non-durable commit before it, so
//! either way one fsync makes a whole group durable.
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
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
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
    /// Calls return once their write is committed in memory, before it
    /// reaches the disk. **A crash or power loss loses the writes of roughly
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
}

/// Marks the current thread as inside a write closure for its lifetime.
struct WriteScope;

impl WriteScope {
    fn enter() -> Result<WriteScope> {
        if IN_WRITE.with(Cell::get) {
            return Err(Error::Reentrant);
        }
        IN_WRITE.with(|c| c.set(true));
        Ok(WriteScope)
    }
}

impl Drop for WriteScope {
    fn drop(&mut self) {
        IN_WRITE.with(|c| c.set(false));
    }
}

/// Durability bookkeeping shared by callers and the commit thread.
#[derive(Debug, Default)]
struct SyncState {
    /// The largest commit sequence number known to be on disk.
    durable: u64,
    /// A durable commit failed: nothing after `durable` can be promised.
    broken: bool,
}

struct Shared {
    db: RwLock<Database>,
    config: EngineConfig,
    /// Sequence number of the latest commit started (taken under redb's write lock).
    seq: AtomicU64,
    sync: Mutex<SyncState>,
    synced: Condvar,
    /// Durable commits made, for the tests and the benchmarks' fsync counts.
    durable_commits: AtomicU64,
    /// Write transactions committed, durable or not.
    commits: AtomicU64,
}

impl Shared {
    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn current_seq(&self) -> u64 {
        self.seq.load(Ordering::SeqCst)
    }

    fn mark_durable(&self, seq: u64) {
        let mut s = self.sync.lock();
        if seq > s.durable {
            s.durable = seq;
        }
        drop(s);
        self.synced.notify_all();
    }

    fn mark_broken(&self) {
        self.sync.lock().broken = true;
        self.synced.notify_all();
    }

    fn is_durable(&self, seq: u64) -> Result<bool> {
        let s = self.sync.lock();
        if s.durable >= seq {
            Ok(true)
        } else if s.broken {
            Err(previous_commit_failed())
        } else {
            Ok(false)
        }
    }
}

fn previous_commit_failed() -> Error {
    Error::Storage(redb::Error::PreviousIo)
}

/// A queued operation, as the commit thread sees it.
trait Job: Send {
    /// Runs the operation in `tx`; `false` if it panicked.
    fn run(&mut self, tx: &WriteTransaction) -> bool;
    /// Answers the caller once the batch's fate is known.
    fn finish(self: Box<Self>, committed: Result<(), Error>);
}

type Reply<T> = std::result::Result<Result<T>, Box<dyn Any + Send>>;

struct OpJob<T, F> {
    op: F,
    result: Option<Reply<T>>,
    reply: Sender<Reply<T>>,
}

impl<T, F> Job for OpJob<T, F>
where
    T: Send + 'static,
    F: Fn(&WriteTransaction) -> Result<T> + Send + 'static,
{
    fn run(&mut self, tx: &WriteTransaction) -> bool {
        let r = catch_unwind(AssertUnwindSafe(|| (self.op)(tx)));
        let ok = r.is_ok();
        self.result = Some(r);
        ok
    }

    fn finish(self: Box<Self>, committed: Result<(), Error>) {
        let answer = match (committed, self.result) {
            (_, Some(Err(panic))) => Err(panic),
            (Ok(()), Some(Ok(r))) => Ok(r),
            (Err(e), _) => Ok(Err(e)),
            (Ok(()), None) => Ok(Err(Error::Closed)),
        };
        // The caller may have gone away (it cannot, it blocks); ignore a closed channel.
        let _ = self.reply.send(answer);
    }
}

enum Request {
    Job(Box<dyn Job>),
    /// Make every commit so far durable.
    Sync,
}

/// The store's database and its commit thread.
pub(crate) struct Engine {
    shared: Arc<Shared>,
    requests: Option<Sender<Request>>,
    thread: Option<JoinHandle<()>>,
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
            durable_commits: AtomicU64::new(0),
            commits: AtomicU64::new(0),
        });
        let (tx, rx) = crossbeam_channel::unbounded();
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("idemstore-commit".into())
            .spawn(move || commit_loop(&thread_shared, &rx))
            .map_err(|e| Error::Storage(redb::Error::Io(e)))?;
        Ok(Engine {
            shared,
            requests: Some(tx),
            thread: Some(thread),
            path,
        })
    }

    pub(crate) fn path(&self) -> Option<&std::path::Path> {
        self.path.as_deref()
    }

    pub(crate) fn durability(&self) -> Durability {
        self.shared.config.durability
    }

    /// Runs a store operation in the commit thread's next batch and returns
    /// its result once the batch is committed (durably, under
    /// [`Durability::Immediate`]).
    ///
    /// `op` must check before it writes: returning `Err` means it wrote
    /// nothing. It may be run more than once (after another operation in its
    /// batch panicked), and must then compute the same writes from the
    /// transaction's state.
    pub(crate) fn execute<T, F>(&self, op: F) -> Result<T>
    where
        T: Send + 'static,
        F: Fn(&WriteTransaction) -> Result<T> + Send + 'static,
    {
        if IN_WRITE.with(Cell::get) {
            return Err(Error::Reentrant);
        }
        let (reply, answer) = crossbeam_channel::bounded(1);
        let job = OpJob {
            op,
            result: None,
            reply,
        };
        self.send(Request::Job(Box::new(job)))?;
        match answer.recv() {
            Ok(Ok(result)) => result,
            Ok(Err(panic)) => resume_unwind(panic),
            Err(_) => Err(Error::Closed),
        }
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
        let db = self.shared.db.read();
        let mut tx = db.begin_write().map_err(Error::from)?;
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
                tx.abort().map_err(Error::from)?;
                Err(e)
            }
            Ok(Ok(value)) => {
                let seq = self.shared.next_seq();
                tx.commit().map_err(Error::from)?;
                self.shared.commits.fetch_add(1, Ordering::Relaxed);
                drop(db);
                drop(scope);
                self.settle(seq)?;
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
        let db = self.shared.db.read();
        let tx = db.begin_read().map_err(Error::from)?;
        let seen = self.shared.current_seq();
        let out = f(&tx);
        drop(tx);
        drop(db);
        if out.is_ok() && !IN_WRITE.with(Cell::get) {
            self.settle(seen)?;
        }
        out
    }

    /// Under [`Durability::Immediate`], waits until commit `seq` is durable.
    fn settle(&self, seq: u64) -> Result<()> {
        if self.shared.config.durability == Durability::Immediate {
            self.wait_durable(seq)?;
        }
        Ok(())
    }

    fn wait_durable(&self, seq: u64) -> Result<()> {
        if self.shared.is_durable(seq)? {
            return Ok(());
        }
        self.send(Request::Sync)?;
        let mut s = self.shared.sync.lock();
        while s.durable < seq {
            if s.broken {
                return Err(previous_commit_failed());
            }
            self.shared.synced.wait(&mut s);
        }
        Ok(())
    }

    /// Makes every commit so far durable, whatever the store's durability.
    pub(crate) fn sync(&self) -> Result<()> {
        let seq = self.shared.current_seq();
        self.wait_durable(seq)
    }

    fn send(&self, request: Request) -> Result<()> {
        self.requests
            .as_ref()
            .ok_or(Error::Closed)?
            .send(request)
            .map_err(|_| Error::Closed)
    }

    /// Runs `f` with the database to itself: no transaction of this store is
    /// open meanwhile. For compaction and integrity checks.
    pub(crate) fn exclusive<T>(&self, f: impl FnOnce(&mut Database) -> Result<T>) -> Result<T> {
        self.sync()?;
        let mut db = self.shared.db.write();
        f(&mut db)
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
        // Closing the channel ends the commit thread after it has drained
        // the queue and, under Durability::None, flushed.
        drop(self.requests.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The commit thread: drains queued operations and commits them in batches.
fn commit_loop(shared: &Shared, requests: &Receiver<Request>) {
    let durable_mode = shared.config.durability == Durability::Immediate;
    let mut last_flush = Instant::now();
    let mut dirty = false;
    loop {
        let first = if dirty {
            match requests.recv_timeout(shared.config.flush_interval) {
                Ok(r) => Some(r),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        } else {
            match requests.recv() {
                Ok(r) => Some(r),
                Err(_) => break,
            }
        };
        let mut jobs: Vec<Box<dyn Job>> = Vec::new();
        let mut want_sync = first.is_none();
        let mut next = first;
        let mut disconnected = false;
        loop {
            match next {
                Some(Request::Job(j)) => jobs.push(j),
                Some(Request::Sync) => want_sync = true,
                None => {}
            }
            if jobs.len() >= shared.config.max_batch {
                break;
            }
            next = match requests.try_recv() {
                Ok(r) => Some(r),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    disconnected = true;
                    break;
                }
            };
        }
        let flush_due = last_flush.elapsed() >= shared.config.flush_interval;
        let durable = durable_mode || want_sync || (dirty && flush_due);
        if jobs.is_empty() && shared.is_durable(shared.current_seq()).unwrap_or(true) {
            // Nothing to run and nothing to make durable: just wake the waiters.
            dirty = false;
            shared.synced.notify_all();
            if disconnected {
                break;
            }
            continue;
        }
        commit_batch(shared, jobs, durable);
        if durable {
            last_flush = Instant::now();
            dirty = false;
        } else {
            dirty = true;
        }
        if disconnected {
            break;
        }
    }
    if dirty || !shared.is_durable(shared.current_seq()).unwrap_or(true) {
        commit_batch(shared, Vec::new(), true);
    }
}

/// Runs `jobs` in one write transaction and commits it; answers every job.
fn commit_batch(shared: &Shared, mut jobs: Vec<Box<dyn Job>>, durable: bool) {
    let db = shared.db.read();
    loop {
        let mut tx = match db.begin_write() {
            Ok(tx) => tx,
            Err(e) => {
                // The engine refuses writes (after a failed commit): nothing
                // queued now or later can be made durable.
                shared.mark_broken();
                fail_all(jobs, &Error::from(e));
                return;
            }
        };
        if durable {
            tx.set_quick_repair(shared.config.quick_repair);
        } else if let Err(e) = tx.set_durability(redb::Durability::None) {
            let _ = tx.abort();
            fail_all(jobs, &Error::from(e));
            return;
        }
        let panicked = jobs.iter_mut().position(|job| !job.run(&tx));
        if let Some(i) = panicked {
            // The panicking operation may have left partial writes: drop the
            // whole transaction and run the others again without it.
            let _ = tx.abort();
            jobs.remove(i).finish(Ok(()));
            continue;
        }
        let seq = shared.next_seq();
        match tx.commit() {
            Ok(()) => {
                shared.commits.fetch_add(1, Ordering::Relaxed);
                if durable {
                    shared.durable_commits.fetch_add(1, Ordering::Relaxed);
                    shared.mark_durable(seq);
                }
                for job in jobs {
                    job.finish(Ok(()));
                }
            }
            Err(e) => {
                shared.mark_broken();
                fail_all(jobs, &Error::from(e));
            }
        }
        return;
    }
}

fn fail_all(jobs: Vec<Box<dyn Job>>, e: &Error) {
    let mut first = true;
    for job in jobs {
        // Errors are not Clone: the first job gets the engine's own error,
        // the others a "previous I/O error" pointing at it.
        let err = if first {
            first = false;
            clone_error(e)
        } else {
            previous_commit_failed()
        };
        job.finish(Err(err));
    }
}

/// A copy of `e` for another caller: storage errors become "a previous I/O
/// error" with the same message where they cannot be cloned.
fn clone_error(e: &Error) -> Error {
    match e {
        Error::Storage(inner) => {
            Error::Storage(redb::Error::Io(std::io::Error::other(inner.to_string())))
        }
        Error::Closed => Error::Closed,
        other => Error::Storage(redb::Error::Io(std::io::Error::other(other.to_string()))),
    }
}
