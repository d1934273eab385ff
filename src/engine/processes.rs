//! What the engine does differently when other processes share the file
//! (`StoreBuilder::shared`, redb's `ConcurrencyMode::MultiWriter`).
//!
//! redb then commits every transaction durably (it refuses
//! `Durability::None`), takes its writer lock across processes for each
//! write transaction, and shows a reader only commits that are on disk.
//! Three things follow:
//!
//! - **A caller closure leads its own batch.** It cannot commit without
//!   fsync and wait for the next durable commit, as it does in a store it
//!   holds alone. Instead its caller queues a *seat* ([`Seat`]); once the
//!   seat is first in the queue, the caller leads a batch on its own thread
//!   ([`Inner::write_leading`]): it begins a write transaction, runs the
//!   operations queued behind its seat, then its closure, and commits all
//!   of them durably, once. Operations run first because they can be run
//!   again: should one fail, the transaction is rolled back and the others
//!   re-run without it (the closure has not run yet); should the closure
//!   fail or panic, the transaction is rolled back and the operations run
//!   again and commit on their own. The closure never runs twice.
//!   (redb refuses the ephemeral savepoints that would let the closure run
//!   first in this mode.)
//! - **Caches are brought up to date at the start of every write
//!   transaction.** Another process may have committed since this one's
//!   last transaction. What the store keeps in memory about the file
//!   registers a refresh ([`Engine::on_write_begin`](super::Engine::on_write_begin));
//!   each batch runs them right after it begins its transaction, before any
//!   operation, so each sees every commit of every process and none of the
//!   batch's own writes.
//! - **Reads do not wait.** Every commit is durable before any process can
//!   see it, so a read answers at once (D2 holds by redb's own rule).
//!
//! No lock of redb's is held between batches: each releases the writer at
//! its commit, so other processes take turns.
//!
//! # Invariants
//!
//! - A seat is never drained into another caller's batch: a batch takes
//!   queued operations only up to the first seat (`batch_end`), so a seat reaches
//!   the front of the queue and its caller is promoted like any other.
//! - A seat's caller leads with its seat first in the queue, and removes it
//!   before it runs the operations behind it; `!leading` still implies an empty
//!   queue, as the caller hands the lead on before it returns.
//! - The closure's answer is released only after its batch's durable
//!   commit (D1), and the other operations of the batch are answered as in any
//!   batch.
//!
//! # Locks
//!
//! As a leader's (`db` → `open` → `sync`/`queue`), with redb's writer lock
//! taken under them. A seat's caller waits for the lead with no lock held.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Arc;

use redb::{Database, WriteTransaction};

use super::batch::{Batch, Needs, Queued, batch_end, commit_and_answer, run_jobs};
use super::inner::Inner;
use super::open_tx::OpenTx;
use super::scope::{HookFrame, WriteScope};
use super::wake::{Notify, Slot, Wake, WakeTree, wake};
use crate::error::{Error, Result};

/// A refresh of something kept in memory about the file, run at the start
/// of each write transaction of a shared store.
pub(super) type Refresh = Box<dyn Fn(&WriteTransaction) -> Result<()> + Send + Sync>;

/// A caller closure's place in the queue, in a store shared between
/// processes: the caller leads the batch its seat starts.
struct Seat {
    reply: Arc<Slot<()>>,
}

impl Queued for Seat {
    // Unreachable: a seat is taken out of the queue by its own caller, and
    // a batch never takes one in (`batch_end`). Should one run anyway, it
    // fails, so that nothing commits on its account.
    fn run(&mut self, _: &WriteTransaction) -> bool {
        false
    }

    fn replay(&self, _: &WriteTransaction) -> bool {
        false
    }

    fn finish(&mut self, committed: Result<(), Error>) {
        self.reply.put(Wake::Done(Ok(committed), None));
    }

    fn finish_quietly(&mut self, committed: Result<(), Error>, tree: Arc<WakeTree>, index: usize) {
        self.reply
            .put_quietly(Wake::Done(Ok(committed), Some((tree, index))));
    }

    fn caller(&self) -> Arc<dyn Notify> {
        self.reply.clone()
    }

    fn promote(&self) {
        self.reply.put(Wake::Lead);
    }

    fn needs(&self) -> Needs {
        Needs::Durable
    }

    fn is_seat(&self) -> bool {
        true
    }
}

impl Inner {
    /// Begins a batch's write transaction and, in a shared store, brings
    /// what the store keeps in memory up to date with the file. If redb
    /// refuses to begin one (after a failed commit) the engine is marked
    /// broken; a refresh that fails only fails this batch.
    pub(super) fn begin_batch_write(&self, db: &Database) -> Result<WriteTransaction> {
        let tx = match db.begin_write() {
            Ok(tx) => tx,
            Err(e) => {
                let e = Error::from(e);
                self.mark_broken("beginning a batch", &e);
                return Err(e);
            }
        };
        if self.config.shared {
            for refresh in self.refreshes.read().iter() {
                if let Err(e) = refresh(&tx) {
                    let _ = tx.abort();
                    return Err(e);
                }
            }
        }
        Ok(tx)
    }

    /// Runs caller closure `f` in a batch its caller leads (a shared
    /// store): waits for its seat to reach the front of the queue, then
    /// runs the operations queued behind it and `f` in one transaction and
    /// commits them durably. `scope` marks this thread as writing; the
    /// closure's after-commit hooks run with the batch's, once the batch's
    /// callers are answered, before it returns.
    pub(super) fn write_leading<T, E>(
        &self,
        scope: WriteScope,
        f: impl FnOnce(&WriteTransaction) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<Error>,
    {
        self.wait_for_seat()?;
        let mut batch = Batch::new(self.take_seat_and_batch());
        // The closure takes a place of the batch.
        batch.reserved = 1;
        let mut outcome = None;
        let led = catch_unwind(AssertUnwindSafe(|| {
            run_closure_batch(self, &mut batch, f, &mut outcome);
        }));
        if let Err(panic) = led {
            // A panic outside the closure and the operations (redb's
            // commit, the storage backend): the batch's fate is unknown.
            // Should the closure have panicked first, and this panic come
            // from running the operations again without it, the closure's
            // panic is dropped: its caller gets this error instead (the
            // closure wrote nothing either way).
            let e = self.mark_broken(
                "a batch commit",
                &Error::panicked("a batch commit", &*panic),
            );
            batch.fail_rest(&e);
            outcome = Some(Outcome::Failed(e));
        }
        self.hand_on_lead();
        wake(batch.answers);
        drop(scope);
        // The hooks (the closure's, and the operations') and the reports,
        // now that everyone is answered: nothing they do changes an answer.
        self.after_answers(std::mem::take(&mut batch.after));
        match outcome {
            Some(Outcome::Committed(value)) => Ok(value),
            Some(Outcome::Refused(e)) => Err(e),
            Some(Outcome::Panicked(panic)) => resume_unwind(panic),
            Some(Outcome::Failed(e)) => Err(E::from(e)),
            None => Err(E::from(Error::Panicked {
                during: "a batch",
                message: "a caller's closure was answered before it ran".to_owned(),
            })),
        }
    }

    /// Queues a seat and waits until this caller leads.
    fn wait_for_seat(&self) -> Result<()> {
        let slot = Slot::new();
        let lead_now = {
            let mut q = self.queue.lock();
            q.queued.push(Box::new(Seat {
                reply: slot.clone(),
            }));
            !std::mem::replace(&mut q.leading, true)
        };
        if lead_now {
            return Ok(());
        }
        match slot.take() {
            Wake::Lead => Ok(()),
            // Unreachable: seats are never drained into a batch. Should one
            // be answered anyway, its caller does not lead.
            Wake::Done(reply, tree) => {
                if let Some((tree, index)) = tree {
                    tree.wake_children(Some(index));
                }
                match reply {
                    Ok(Ok(())) => Err(Error::Panicked {
                        during: "a batch",
                        message: "a caller's seat was taken into another batch".to_owned(),
                    }),
                    Ok(Err(e)) => Err(e),
                    Err(panic) => resume_unwind(panic),
                }
            }
        }
    }

    /// Removes this leader's seat from the front of the queue and takes
    /// the operations queued behind it, up to a batch with the closure.
    fn take_seat_and_batch(&self) -> Vec<Box<dyn Queued>> {
        let mut q = self.queue.lock();
        if q.queued.first().is_some_and(|j| j.is_seat()) {
            q.queued.remove(0);
        }
        let n = batch_end(&q.queued, self.config.max_batch.saturating_sub(1));
        q.queued.drain(..n).collect()
    }
}

/// What became of a caller closure led in a batch.
enum Outcome<T, E> {
    /// It returned `Ok` and its batch committed durably.
    Committed(T),
    /// It returned `Err`: rolled back.
    Refused(E),
    /// It panicked: rolled back; resumed on the caller's thread.
    Panicked(Box<dyn std::any::Any + Send>),
    /// The batch could not run or commit.
    Failed(Error),
}

/// Runs the operations of `batch`, then `f`, in one write transaction and
/// commits it durably; if `f` fails, rolls back and commits the operations
/// alone. Leaves what became of `f` in `outcome`.
fn run_closure_batch<T, E>(
    inner: &Inner,
    batch: &mut Batch,
    f: impl FnOnce(&WriteTransaction) -> Result<T, E>,
    outcome: &mut Option<Outcome<T, E>>,
) {
    let db = inner.db.read_recursive();
    let _open = inner.open.lock();
    if let Some(e) = inner.refusal() {
        batch.fail_rest(&e);
        *outcome = Some(Outcome::Failed(e));
        return;
    }
    let tx = match inner.begin_batch_write(&db) {
        Ok(tx) => tx,
        Err(e) => {
            batch.fail_rest(&e);
            *outcome = Some(Outcome::Failed(e));
            return;
        }
    };
    let frame = HookFrame::push();
    let work = match run_jobs(inner, &db, OpenTx::new(tx), batch, &frame) {
        Ok(work) => work,
        Err(e) => {
            *outcome = Some(Outcome::Failed(e));
            return;
        }
    };
    // The closure's hooks land in the batch's frame: they run after the
    // commit, with the operations' hooks.
    let failed = match catch_unwind(AssertUnwindSafe(|| f(&work.tx))) {
        Ok(Ok(value)) => {
            *outcome = Some(match commit_and_answer(inner, work, frame, batch, true) {
                Ok(()) => Outcome::Committed(value),
                Err(e) => Outcome::Failed(e),
            });
            return;
        }
        Ok(Err(e)) => Outcome::Refused(e),
        Err(panic) => Outcome::Panicked(panic),
    };
    *outcome = Some(failed);
    // Abort explicitly: dropping a write transaction while a panic unwinds
    // would flag the file for a full repair.
    let _ = work.tx.abort();
    frame.discard();
    commit_without_closure(inner, &db, batch, frame);
}

/// After a caller closure failed: runs the batch's operations again in a
/// new transaction and commits them durably.
fn commit_without_closure(inner: &Inner, db: &Database, batch: &mut Batch, frame: HookFrame) {
    if batch.queued.is_empty() {
        return;
    }
    let tx = match inner.begin_batch_write(db) {
        Ok(tx) => tx,
        Err(e) => {
            batch.fail_rest(&e);
            return;
        }
    };
    if let Ok(work) = run_jobs(inner, db, OpenTx::new(tx), batch, &frame) {
        // The outcome is in the batch's answers.
        let _ = commit_and_answer(inner, work, frame, batch, true);
    }
}
