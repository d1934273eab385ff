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
//!   `Inner::lead`.
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
//! In a store shared between processes redb refuses non-durable commits:
//! there a caller closure instead leads a batch of its own, running the
//! operations queued behind it and then itself in one transaction, under
//! one durable commit (see `processes`).
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
//!   for `durable` to reach it before it answers, whatever it answers: a
//!   failing read (a "not found") is an answer too. Operations are answered only
//!   after their batch's durable commit, which covers everything they saw.
//!   (In a shared store no read waits: redb shows a reader only commits that
//!   are on disk, and every commit there is durable.)
//!
//! # Code the store does not own
//!
//! The application's `metrics` recorder and `tracing` subscriber (reached
//! through `observe`), and the after-commit hooks that report to them,
//! never run between a commit and the answers to its callers, nor while a
//! lock is held that another caller needs:
//! - a batch's hooks and reports run on its leader's thread once the batch
//!   is answered, the lead handed on, and the leader has taken its own
//!   answer and woken its children in the wake tree (`batch`); a caller
//!   closure's once its commit is durable and its answer decided;
//! - each runs under `catch_unwind`, and a panic in one is dropped: the
//!   answers are out already, so it changes none of them, leaves nobody
//!   waiting, and does not mark the engine broken;
//! - what breaks the engine (a failed commit, a panic of redb or of the
//!   storage backend) is recorded where it happens and reported later, by
//!   whoever next finishes answering (`Inner::after_answers`).
//!
//! A store broken by a panic says [`Error::Panicked`] to every later call;
//! one broken by a failed commit, redb's `PreviousIo`. Caller closures are
//! the exception by design: they run inside their transaction, and their
//! panic rolls it back and reaches their caller.
//!
//! # Where each mechanism lives
//!
//! - `batch`: the queue, leadership, and the batch a leader runs in one
//!   transaction (rollback of a failed operation, late arrivals, commit or
//!   keep open).
//! - `durability`: commit sequence numbers, what is on disk, waiting for it
//!   (D1, D2), and the commits that move it.
//! - `open_tx`: the transaction kept open under [`Durability::None`], its
//!   replay log, and the flusher thread.
//! - `wake`: how waiting callers are told their answer, or to lead.
//! - `processes`: what changes when other processes share the file: caller
//!   closures lead their batch, caches catch up at each write transaction,
//!   reads need not wait.
//! - `scope`: the thread-local scopes: inside a caller closure, and the
//!   after-commit hooks of the transactions a thread runs.
//! - `inner`: the state all of them share (`Inner`; "shared" names only the several-processes mode).
//!
//! # Locks
//!
//! Taken in this order, never the other way round:
//!
//! 1. `db`, the [`Database`]'s lock: shared by every transaction this
//!    store opens, always with `read_recursive`, so that a thread holding it
//!    may lead a batch that takes it again even while
//!    [`Engine::exclusive`] waits for it; exclusive in
//!    [`Engine::exclusive`] alone, which holds nothing else.
//! 2. `open`: only a batch leader takes it, for its whole batch.
//! 3. Then, one at a time: `sync` (durability bookkeeping, a leaf), or
//!    `queue`, under which only a waiting caller's slot is taken (to promote
//!    it). A slot's lock is a leaf.
//!
//! redb's writer lock (a live [`WriteTransaction`]) is taken under `db`: by
//! a leader under `open` too; by a caller closure or
//! [`Engine::inspect_write`] only once no transaction is kept open (see
//! `open_tx`). Of the engine's locks, a leader holding it takes only `sync`,
//! `queue` and slots; a caller closure holding it may read through the
//! engine (`db` again, recursively, and nothing else) but not write
//! ([`Error::Reentrant`]). So nobody holding it waits for `open`.
//! Operations and after-commit hooks never call the engine: they run under
//! a leader's locks.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use redb::{Database, ReadTransaction, ReadableDatabase, WriteTransaction};

use crate::error::{Error, Result};

mod batch;
mod durability;
mod inner;
#[cfg(test)]
#[cfg(shuttle)]
mod model;
mod open_tx;
mod processes;
mod scope;
mod sync;
#[cfg(feature = "tokio")]
mod tasks;
#[cfg(test)]
mod tests;
mod wake;

use batch::Needs;
use inner::Inner;
use open_tx::Flusher;
pub(crate) use scope::after_commit;
use scope::{ReadScope, WriteScope, in_read, in_write};

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
    /// Other processes may open the file at the same time (redb's
    /// `ConcurrencyMode::MultiWriter`). See `processes`.
    pub(crate) shared: bool,
}

/// The store's database, its batch queue and, under [`Durability::None`],
/// its flusher thread.
pub(crate) struct Engine {
    inner: Arc<Inner>,
    flusher: Option<Flusher>,
    path: Option<PathBuf>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("path", &self.path)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Engine {
    pub(crate) fn start(
        db: Database,
        config: EngineConfig,
        path: Option<PathBuf>,
    ) -> Result<Engine> {
        let inner = Arc::new(Inner::new(db, config));
        let flusher = if inner.config.durability == Durability::None {
            Some(Flusher::start(&inner)?)
        } else {
            None
        };
        Ok(Engine {
            inner,
            flusher,
            path,
        })
    }

    pub(crate) fn path(&self) -> Option<&std::path::Path> {
        self.path.as_deref()
    }

    pub(crate) fn durability(&self) -> Durability {
        self.inner.config.durability
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
        if in_write() {
            return Err(Error::Reentrant);
        }
        self.inner.submit(op, Needs::Default)
    }

    /// [`Engine::execute`] from an async task: the operation joins the next
    /// batch like a thread's, and the task waits for it without holding a
    /// thread (see `tasks`). Nothing is queued before the future is first
    /// polled; dropped after that, the operation still runs and commits
    /// with its batch.
    #[cfg(feature = "tokio")]
    pub(crate) async fn execute_async<T, F>(&self, op: F) -> Result<T>
    where
        T: Send + 'static,
        F: Fn(&WriteTransaction) -> Result<T> + Send + 'static,
    {
        if in_write() {
            return Err(Error::Reentrant);
        }
        self.inner.submit_async(op, Needs::Default).await
    }

    /// Queues `op` to run in a coming batch, after every operation queued
    /// before it, and returns at once: nobody is answered (a failure is
    /// dropped). For the clean-up of an async call dropped mid-way.
    #[cfg(feature = "tokio")]
    pub(crate) fn execute_detached<F>(&self, op: F) -> Result<()>
    where
        F: Fn(&WriteTransaction) -> Result<()> + Send + 'static,
    {
        self.inner.submit_detached(op)
    }

    /// [`Engine::wait_durable`] from an async task, without holding a
    /// thread.
    #[cfg(feature = "tokio")]
    pub(crate) async fn wait_durable_async(&self, seq: u64) -> Result<()> {
        if self.waits_for_durability() {
            self.inner.wait_durable_async(seq).await?;
        }
        Ok(())
    }

    /// [`Engine::read`] from an async task: the read runs on the task (a
    /// read transaction never waits for a writer), then the task waits,
    /// without holding a thread, until what it saw is durable (D2).
    #[cfg(feature = "tokio")]
    pub(crate) async fn read_async<T, E, F>(&self, f: F) -> Result<T, E>
    where
        E: From<Error>,
        F: FnOnce(&ReadTransaction) -> Result<T, E>,
    {
        if !in_write() {
            self.inner.commit_pending_async().await?;
        }
        let (out, seen) = {
            let db = self.inner.db.read_recursive();
            let tx = db.begin_read().map_err(Error::from)?;
            let seen = self.inner.current_seq();
            let _scope = ReadScope::enter();
            (f(&tx), seen)
        };
        self.wait_durable_async(seen).await?;
        out
    }

    /// Whether a batch is being run right now or a transaction is kept open
    /// (a hint: it may change at once). A write queued now will not commit
    /// on its own.
    pub(crate) fn is_busy(&self) -> bool {
        self.inner.pending.load(Ordering::Relaxed) || self.inner.queue.lock().leading
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
        if self.inner.config.shared {
            return self.inner.write_leading(scope, f);
        }
        let (value, seq, hooks) = self.write_committed(scope, f)?;
        self.wait_durable(seq)?;
        // The answer is decided: the hooks and the report run now, with no
        // lock held, and cannot change it.
        self.inner.after_answers(hooks);
        Ok(value)
    }

    /// Runs caller closure `f` in a write transaction of its own, committed
    /// without fsync; returns its value, its commit's sequence number (to
    /// wait for before answering) and what runs once it is answered.
    fn write_committed<T, E>(
        &self,
        scope: WriteScope,
        f: impl FnOnce(&WriteTransaction) -> Result<T, E>,
    ) -> Result<(T, u64, Vec<scope::Hook>), E>
    where
        E: From<Error>,
    {
        let db = self.inner.db.read_recursive();
        let mut tx = self.inner.begin_own_write()?;
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
                let mut hooks = scope.take_hooks();
                drop(scope);
                let committed = self.inner.commit_own_write(tx);
                drop(db);
                let (seq, took) = committed?;
                if crate::observe::ENABLED {
                    hooks.push(Box::new(move || crate::observe::own_write_committed(took)));
                }
                Ok((value, seq, hooks))
            }
        }
    }

    /// [`Engine::write`] from an async task: `f` runs on tokio's blocking
    /// pool, in its own transaction committed without fsync, and the task
    /// then waits for a durable commit that covers it without holding a
    /// thread (in a store shared between processes, where the closure
    /// leads a durable batch of its own, the whole call runs on the
    /// blocking pool). Dropped after its first poll, `f` may still run and
    /// commit.
    #[cfg(feature = "tokio")]
    pub(crate) async fn write_async<T, E, F>(self: &Arc<Self>, f: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<Error> + Send + 'static,
        F: FnOnce(&WriteTransaction) -> Result<T, E> + Send + 'static,
    {
        let engine = self.clone();
        let ran = tokio::task::spawn_blocking(move || {
            if engine.inner.config.shared {
                return engine.write(f).map(|v| (v, None, Vec::new()));
            }
            let scope = WriteScope::enter()?;
            let (value, seq, hooks) = engine.write_committed(scope, f)?;
            Ok((value, Some(seq), hooks))
        })
        .await;
        let (value, seq, hooks) = match ran {
            Ok(out) => out?,
            Err(e) => match e.try_into_panic() {
                Ok(panic) => resume_unwind(panic),
                Err(_) => {
                    return Err(E::from(Error::Panicked {
                        during: "a caller closure",
                        message: "the runtime shut down before it ran".to_owned(),
                    }));
                }
            },
        };
        if let Some(seq) = seq {
            self.wait_durable_async(seq).await?;
        }
        self.inner.after_answers(hooks);
        Ok(value)
    }

    /// Runs `f` in a read transaction. Under [`Durability::Immediate`] the
    /// answer is returned only once everything the transaction could see is
    /// durable (D2), whatever `f` returned: an `Err` is an answer too (a
    /// "not found" for a row that a commit not yet on disk deleted would be
    /// undone by a power cut). Only a failure to begin the read returns at
    /// once: it saw nothing.
    pub(crate) fn read<T, E>(
        &self,
        f: impl FnOnce(&ReadTransaction) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<Error>,
    {
        self.commit_pending()?;
        let db = self.inner.db.read_recursive();
        let tx = db.begin_read().map_err(Error::from)?;
        let seen = self.inner.current_seq();
        let out = {
            let _scope = ReadScope::enter();
            f(&tx)
        };
        drop(tx);
        drop(db);
        // Should the wait fail, what `f` answered may rest on writes that
        // never reach the disk: the wait's error is the answer.
        self.wait_durable(seen)?;
        out
    }

    /// Commits the transaction batches keep open under
    /// [`Durability::None`], so that a read transaction begun next sees every
    /// answered write. [`Engine::read`] does it itself; callers of
    /// [`Engine::read_with_seq`] do it first.
    pub(crate) fn commit_pending(&self) -> Result<()> {
        if in_write() {
            // Inside a caller closure no batch can hold a transaction open.
            return Ok(());
        }
        self.inner.commit_pending()
    }

    /// Runs `f` in a read transaction begun now (after
    /// [`Engine::commit_pending`]) and returns its answer at once, `Ok` or
    /// `Err`, with the sequence number to pass to [`Engine::wait_durable`]
    /// before acting on the answer towards a caller, whichever it is (D2).
    /// The outer `Err`: the read could not begin (it saw nothing).
    pub(crate) fn read_with_seq<T>(
        &self,
        f: impl FnOnce(&ReadTransaction) -> Result<T>,
    ) -> Result<(Result<T>, u64)> {
        let db = self.inner.db.read_recursive();
        let tx = db.begin_read()?;
        let seen = self.inner.current_seq();
        let _scope = ReadScope::enter();
        Ok((f(&tx), seen))
    }

    /// Under [`Durability::Immediate`], waits until commit `seq` is durable
    /// (queuing an empty durable batch if no commit under way covers it).
    /// Inside a caller closure it does not wait (it could not: the closure
    /// holds the writer): what the closure returns is released only after
    /// its own durable commit, which covers every commit before it.
    /// In a store shared between processes it does not wait either: every
    /// commit there is durable before anyone can see it.
    pub(crate) fn wait_durable(&self, seq: u64) -> Result<()> {
        if self.waits_for_durability() {
            self.inner.wait_durable(seq)?;
        }
        Ok(())
    }

    /// Whether a caller here waits for a commit's durability before it
    /// answers (see [`Engine::wait_durable`]).
    fn waits_for_durability(&self) -> bool {
        self.inner.config.durability == Durability::Immediate
            && !self.inner.config.shared
            && !in_write()
    }

    /// Makes every commit so far durable, whatever the store's durability.
    pub(crate) fn sync(&self) -> Result<()> {
        if in_write() {
            return Err(Error::Reentrant);
        }
        self.inner.sync_all()
    }

    /// Runs `f` with the database to itself: no transaction of this store is
    /// open meanwhile. For compaction and integrity checks. Inside a read
    /// or write closure of this thread it is [`Error::Reentrant`]: it would
    /// wait for the closure's own transaction to end.
    pub(crate) fn exclusive<T>(&self, f: impl FnOnce(&mut Database) -> Result<T>) -> Result<T> {
        if in_read() {
            return Err(Error::Reentrant);
        }
        self.sync()?;
        self.inner.without_open(|| {
            let mut db = self.inner.db.write();
            f(&mut db)
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
        let tx = self.inner.begin_own_write()?;
        let out = f(&tx);
        tx.abort()?;
        drop(scope);
        out
    }

    /// Registers `refresh`, to run at the start of every write transaction
    /// of a store shared between processes (before anything is written in
    /// it): how what a primitive keeps in memory about the file catches up
    /// with other processes' commits. Not run in a store held alone.
    pub(crate) fn on_write_begin(
        &self,
        refresh: impl Fn(&WriteTransaction) -> Result<()> + Send + Sync + 'static,
    ) {
        self.inner.refreshes.write().push(Box::new(refresh));
    }

    /// Whether other processes may share the file.
    pub(crate) fn is_shared(&self) -> bool {
        self.inner.config.shared
    }

    /// Commit counters: `(all commits, durable commits)`.
    pub(crate) fn commit_counts(&self) -> (u64, u64) {
        (
            self.inner.commits.load(Ordering::Relaxed),
            self.inner.durable_commits.load(Ordering::Relaxed),
        )
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(flusher) = self.flusher.take() {
            flusher.stop();
        }
        // Under Durability::None, what is still only in memory reaches the
        // disk now; a failure here has nobody left to tell.
        let _ = self.inner.sync_all();
    }
}
