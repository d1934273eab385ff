//! Under [`Durability::None`]: the write transaction batches keep open
//! between commits ([`OpenTx`]), with the answered operations it holds
//! (its replay log); how callers get it committed before they read or
//! write on their own ([`Inner::commit_pending`], [`Inner::without_open`]);
//! and the flusher thread that makes it durable on the flush interval.
//!
//! [`Durability::None`]: super::Durability::None
//!
//! # Invariants
//!
//! - Only a batch leader touches `open`, and it holds the lock for its whole
//!   batch, so the transaction a batch resumes is the one the last batch
//!   kept. Under [`Durability::Immediate`](super::Durability::Immediate)
//!   `open` is always empty: only a batch that need not be durable is kept.
//! - Outside a running batch, `open` holds a transaction only if `pending`
//!   is set: [`Inner::keep_open`] sets it before a transaction is parked,
//!   and it is cleared only once that transaction is committed or lost.
//!   (`pending` may be set with nothing open: it is a "may hold".)
//! - No transaction is kept open while a caller waits to begin its own
//!   (`writers_waiting > 0`): a leader sets `pending`, then reads
//!   `writers_waiting`; a caller raises `writers_waiting`, then reads
//!   `pending` (all sequentially consistent), so at least one of them sees
//!   the other, and the caller commits what is open before it begins.
//! - Every operation in the log has been answered `Ok`, and the hooks are
//!   theirs. After a rollback they are run again in the new transaction; if
//!   one fails, what the log held is lost as a crash would lose it, and the
//!   engine is marked broken ([`Inner::lose_open`]) so that nothing more is
//!   answered on top of it.
//! - An open transaction holds fewer than `max_batch` operations.
//!
//! # Locks
//!
//! `open` is taken only by a leader, after `db` (see `batch`);
//! `pending` and `writers_waiting` are atomics. [`Inner::begin_own_write`]
//! may lead a batch (`db` → `open` → …) before it takes `db` and then
//! redb's writer lock. The flusher thread takes what
//! [`Inner::sync_all`] takes, holding nothing.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use redb::WriteTransaction;

use super::batch::{Needs, Queued};
use super::inner::Inner;
use super::scope::Hook;
use super::sync::{Receiver, RecvTimeoutError, Sender, bounded, thread};
use crate::error::{Error, Result};

/// The longest a batch lets caller closures waiting for redb's writer go
/// first ([`Inner::let_own_writers_first`]): about what a few dozen of them
/// take (each begins, writes and commits without fsync in tens of µs), and
/// a small part of a durable commit's fsync.
#[cfg(not(shuttle))]
const OWN_WRITERS_FIRST: std::time::Duration = std::time::Duration::from_micros(500);

/// A batch's write transaction, with what it holds from earlier batches:
/// under `Durability::None`, the transaction kept open across batches, with
/// the operations it holds (already answered) so that they can be run again
/// should it have to be rolled back. A transaction just begun holds none.
pub(super) struct OpenTx {
    pub(super) tx: WriteTransaction,
    pub(super) log: Vec<Box<dyn Queued>>,
    /// What the logged operations asked to run once it commits.
    pub(super) hooks: Vec<Hook>,
}

impl OpenTx {
    /// A transaction just begun, holding nothing yet.
    pub(super) fn new(tx: WriteTransaction) -> OpenTx {
        OpenTx {
            tx,
            log: Vec::new(),
            hooks: Vec::new(),
        }
    }
}

/// Runs the answered operations of the open transaction again in `tx`
/// after a rollback; `false` if one of them failed.
pub(super) fn replay_log(log: &[Box<dyn Queued>], tx: &WriteTransaction) -> bool {
    for item in log {
        if !item.replay(tx) {
            return false;
        }
    }
    true
}

impl Inner {
    /// Whether a leader may keep its transaction open: marks it pending,
    /// then checks that nobody is waiting to write (see
    /// [`Inner::without_open`]).
    pub(super) fn keep_open(&self) -> bool {
        self.pending.store(true, Ordering::SeqCst);
        self.writers_waiting.load(Ordering::SeqCst) == 0
    }

    /// The open transaction was rolled back and cannot be rebuilt: the
    /// writes it held, already answered, are gone. The engine is marked
    /// broken so that nothing more is answered on top of them.
    /// `during` and `cause` say why (see [`Inner::mark_broken`]); returns
    /// what every call is told from now on.
    pub(super) fn lose_open(&self, during: &'static str, cause: &Error) -> Error {
        let refusal = self.mark_broken(during, cause);
        self.pending.store(false, Ordering::SeqCst);
        refusal
    }

    /// Commits the open transaction, if there is one, so that what it holds
    /// is visible to readers.
    pub(super) fn commit_pending(&self) -> Result<()> {
        if self.pending.load(Ordering::SeqCst) {
            self.submit(|_| Ok(()), Needs::Commit)?;
        }
        Ok(())
    }

    /// Runs `f` with no transaction left open by a batch: for callers that
    /// begin a write transaction of their own, or need the database alone.
    pub(super) fn without_open<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        // Announce first, then look: a leader about to keep a transaction
        // open looks at `writers_waiting` after it sets `pending`, so one
        // of the two sees the other (both sequentially consistent).
        self.writers_waiting.fetch_add(1, Ordering::SeqCst);
        let out = self.commit_pending().and_then(|()| f());
        self.writers_waiting.fetch_sub(1, Ordering::SeqCst);
        out
    }

    /// Before a batch begins a write transaction: lets the callers already
    /// waiting to begin one of their own (caller closures: effects,
    /// `Store::write`) take redb's writer first, for at most
    /// [`OWN_WRITERS_FIRST`]. Their commits are not durable; the batch's
    /// durable commit, after them, covers them all. Otherwise a leader
    /// takes the writer first and holds it through its fsync while they
    /// wait, and the next leader takes it again: one or two closures per
    /// fsync.
    pub(super) fn let_own_writers_first(&self) {
        #[cfg(not(shuttle))]
        {
            let start = std::time::Instant::now();
            while self.writers_waiting.load(Ordering::SeqCst) > 0
                && start.elapsed() < OWN_WRITERS_FIRST
            {
                thread::yield_now();
            }
        }
        #[cfg(shuttle)]
        if self.writers_waiting.load(Ordering::SeqCst) > 0 {
            thread::yield_now();
        }
    }

    /// Begins a write transaction for this thread's own use, once no batch
    /// holds one open.
    pub(super) fn begin_own_write(&self) -> Result<WriteTransaction> {
        self.without_open(|| {
            let db = self.db.read_recursive();
            Ok(db.begin_write()?)
        })
    }
}

/// Under `Durability::None`: the thread that flushes dirty state to disk
/// every flush interval, until stopped.
pub(super) struct Flusher {
    stop: Sender<()>,
    thread: thread::JoinHandle<()>,
}

impl Flusher {
    pub(super) fn start(inner: &Arc<Inner>) -> Result<Flusher> {
        let (stop, stopped) = bounded::<()>(1);
        let thread_inner = inner.clone();
        let thread = thread::Builder::new()
            .name("idemstore-flush".into())
            .spawn(move || flush_loop(&thread_inner, &stopped))
            .map_err(Error::Io)?;
        Ok(Flusher { stop, thread })
    }

    /// Stops the thread and waits for it (a flush under way ends first).
    pub(super) fn stop(self) {
        drop(self.stop);
        let _ = self.thread.join();
    }
}

/// Flushes dirty state every flush interval until `stop` closes.
fn flush_loop(inner: &Inner, stop: &Receiver<()>) {
    loop {
        match stop.recv_timeout(inner.config.flush_interval) {
            Err(RecvTimeoutError::Timeout) => {
                let _ = inner.sync_all();
            }
            _ => return,
        }
    }
}
