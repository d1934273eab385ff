//! Durability tracking: commit sequence numbers, what is known to be on
//! disk ([`SyncState`]), waiting for it, and the two commits that feed it
//! (a batch's, a caller closure's).
//!
//! # Invariants
//!
//! - Every commit takes its sequence number ([`Inner::next_seq`]) while its
//!   transaction holds redb's writer lock, just before it commits, so the
//!   numbers follow commit order, and every commit a read transaction can
//!   see has a number no larger than [`Inner::current_seq`] read after the
//!   read transaction began.
//! - `durable` never decreases. A durable commit persists every commit
//!   before it, so `durable >= n` means commit `n` is on disk.
//! - `broken` is never cleared: once a commit failed, its fate is unknown
//!   (a panic), or answered writes were lost, every wait and every batch
//!   gets an `Err` until the store is reopened: the refusal the first cause
//!   set ([`SyncState::refusal`]), [`Error::Panicked`] for a panic, else
//!   redb's `PreviousIo`. Only the store's own failures break it: a panic
//!   in code the store does not own (a hook, a recorder) never does.
//! - The first cause is reported ([`observe::engine_broken`]) once, by
//!   [`Inner::report_broken`], which callers run after their answers are
//!   out and with no lock held, never by the code that marks it.
//! - `committing` is one slot, not a set: durable commits are made only by
//!   batch leaders ([`Inner::commit`]; caller closures commit without
//!   fsync), one leader at a time, and each holds redb's writer lock from
//!   [`Inner::begin_durable`] until its commit ends, so at most one durable
//!   commit is under way. 0 means none.
//! - `committing >= n` means a durable commit under way covers commit `n`;
//!   a waiter that no commit under way covers queues an empty durable batch.
//! - [`SyncState`] changes only under `sync`, and `synced` is notified after
//!   every end of a durable commit, good ([`Inner::mark_durable`]) or bad
//!   ([`Inner::mark_broken`]).
//!
//! # Locks
//!
//! `sync` is a leaf: taken alone by callers, or under `db` and `open` by a
//! leader; nothing is taken while it is held, and waiting on `synced`
//! releases it. [`Inner::wait_durable`] and [`Inner::sync_all`] may queue
//! (and lead) a batch, with no lock held.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::Ordering;

use redb::WriteTransaction;

use super::batch::Needs;
use super::inner::Inner;
use crate::error::{Error, Result};
use crate::observe;

/// Durability bookkeeping shared by all callers.
#[derive(Debug, Default)]
pub(super) struct SyncState {
    /// The largest commit sequence number known to be on disk.
    pub(super) durable: u64,
    /// A durable commit failed, or its fate is unknown: nothing after
    /// `durable` can be promised. What every later call is told.
    broken: Option<Error>,
    /// The first cause of `broken`, until it is reported.
    unreported: Option<(&'static str, Error)>,
    /// The sequence number of the durable commit in progress, or 0.
    committing: u64,
}

impl SyncState {
    /// What a call is told once the engine is broken (`None` while it is
    /// not).
    pub(super) fn refusal(&self) -> Option<Error> {
        self.broken.as_ref().map(Error::lossy_clone)
    }
}

/// What every call is told after `cause` broke the engine: the panic, for
/// a panic (the store's own code panicked while it committed); else redb's
/// "an earlier commit failed".
fn refusal_after(cause: &Error) -> Error {
    match cause {
        Error::Panicked { during, message } => Error::Panicked {
            during,
            message: format!(
                "{message} (that commit's fate is unknown: the store refuses writes until it is \
                 reopened)"
            ),
        },
        _ => Error::Storage(redb::Error::PreviousIo),
    }
}

impl Inner {
    /// Takes the sequence number of a commit about to start. Called with
    /// redb's writer lock held.
    pub(super) fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The sequence number of the latest commit started.
    pub(super) fn current_seq(&self) -> u64 {
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

    /// Nothing more can be promised: a commit failed or its fate is unknown,
    /// or answered writes were lost, while `during`, because of `cause`.
    /// The first cause sets what every later call is told; it is reported
    /// later, by [`Inner::report_broken`].
    /// Returns what every call is told from now on.
    pub(super) fn mark_broken(&self, during: &'static str, cause: &Error) -> Error {
        let mut s = self.sync.lock();
        if s.broken.is_none() {
            s.broken = Some(refusal_after(cause));
            s.unreported = Some((during, cause.lossy_clone()));
            self.unreported.store(true, Ordering::SeqCst);
        }
        s.committing = 0;
        let refusal = s.refusal().unwrap_or_else(|| refusal_after(cause));
        drop(s);
        self.synced.notify_all();
        refusal
    }

    /// What a call is told now that the engine is broken, or `None`.
    pub(super) fn refusal(&self) -> Option<Error> {
        self.sync.lock().refusal()
    }

    /// Reports what broke the engine, once. Called after a batch's or a
    /// closure's callers are answered, with no lock held: the report runs
    /// code the store does not own.
    pub(super) fn report_broken(&self) {
        // The common case, nothing broken, takes no lock.
        if !self.unreported.swap(false, Ordering::SeqCst) {
            return;
        }
        let unreported = self.sync.lock().unreported.take();
        if let Some((during, cause)) = unreported {
            observe::engine_broken(during, &cause);
        }
    }

    /// Waits until commit `seq` is durable, making a durable commit if none
    /// is on its way.
    pub(super) fn wait_durable(&self, seq: u64) -> Result<()> {
        loop {
            {
                let mut s = self.sync.lock();
                loop {
                    if s.durable >= seq {
                        return Ok(());
                    }
                    if let Some(refusal) = s.refusal() {
                        return Err(refusal);
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
    pub(super) fn sync_all(&self) -> Result<()> {
        if self.pending.load(Ordering::SeqCst) {
            self.submit(|_| Ok(()), Needs::Durable)?;
        }
        self.wait_durable(self.current_seq())
    }

    /// Commits a batch's transaction, durably or not, and does the
    /// bookkeeping. Any failure marks the engine broken.
    pub(super) fn commit(&self, mut tx: WriteTransaction, durable: bool) -> Result<()> {
        let set = if durable {
            tx.set_quick_repair(self.config.quick_repair);
            tx.set_durability(redb::Durability::Immediate)
        } else {
            tx.set_durability(redb::Durability::None)
        };
        if let Err(e) = set {
            let _ = tx.abort();
            let e = Error::from(e);
            self.mark_broken("a batch commit", &e);
            return Err(e);
        }
        let seq = if durable {
            self.begin_durable()
        } else {
            self.next_seq()
        };
        match tx.commit() {
            Ok(()) => {
                self.commits.fetch_add(1, Ordering::Relaxed);
                if durable {
                    self.durable_commits.fetch_add(1, Ordering::Relaxed);
                    self.mark_durable(seq);
                }
                Ok(())
            }
            Err(e) => {
                let e = Error::from(e);
                self.mark_broken("a batch commit", &e);
                Err(e)
            }
        }
    }

    /// Commits a caller closure's transaction (begun with
    /// [`redb::Durability::None`]: no fsync) and returns its sequence
    /// number, for the caller to wait on, with how long the commit took, to
    /// report once the caller is answered. A panic in redb's commit leaves
    /// the commit's fate unknown: the engine is marked broken and the panic
    /// resumed.
    pub(super) fn commit_own_write(&self, tx: WriteTransaction) -> Result<(u64, observe::Elapsed)> {
        let seq = self.next_seq();
        let commit = observe::Stopwatch::start();
        match catch_unwind(AssertUnwindSafe(|| tx.commit())) {
            Ok(committed) => committed.map_err(Error::from)?,
            Err(panic) => {
                // The commit's fate is unknown: nothing more can be
                // promised on top of it.
                self.mark_broken("a caller's commit", &Error::panicked("a commit", &*panic));
                resume_unwind(panic)
            }
        }
        let took = commit.stop();
        self.commits.fetch_add(1, Ordering::Relaxed);
        Ok((seq, took))
    }
}
