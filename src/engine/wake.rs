//! Wake-ups: how a waiting caller is told its operation's answer, or that
//! it leads the next batch ([`Slot`], [`Wake`]), and how a finished batch's
//! callers are woken as a binary tree ([`WakeTree`], [`wake`]).
//!
//! # Invariants
//!
//! - A caller's [`Slot`] holds at most one message, so none is ever
//!   overwritten: it is sent [`Wake::Lead`] at most once, while the
//!   caller's operation is first in the queue, and [`Wake::Done`] once, after the
//!   operation has left the queue and its batch has ended. A caller sent `Lead`
//!   takes it before its operation leaves the queue: it drains the operation itself,
//!   and puts its own `Done` as that batch's leader.
//! - No wake-up is lost: a message is put under the slot's mutex, and the
//!   caller looks under that mutex before it waits.
//! - [`wake`] puts every answer of a batch before it wakes anyone, so a
//!   caller woken through the tree finds its answer, and the children it
//!   must wake find theirs.
//! - Tree: the leader wakes callers 0 and 1; caller `p`, once it has its
//!   answer, wakes `2p + 2` and `2p + 3` before it returns or resumes a
//!   panic. Every index from 2 on has exactly one parent, so each caller of
//!   the batch is woken.
//!
//! # Locks
//!
//! A slot's mutex is a leaf: taken alone, under `queue` while a leader
//! promotes the next caller (`Inner::hand_on_lead`), or under `db` and
//! `open` while a leader answers the operations it keeps in the open transaction.
//! Condition variables are notified after the mutex is released. [`wake`]
//! is called with no lock held.

use std::any::Any;
use std::sync::Arc;

use super::batch::Answers;
use super::sync::{Condvar, Mutex};
use crate::error::Result;

/// What a caller's operation came to: its own result, or the panic it
/// raised, to resume on the caller's thread.
pub(super) type Reply<T> = std::result::Result<Result<T>, Box<dyn Any + Send>>;

/// What a waiting caller is told.
pub(super) enum Wake<T> {
    /// The batch holding the caller's operation is done (committed, kept
    /// open, or failed); if woken through a [`WakeTree`], the caller wakes
    /// its children there.
    Done(Reply<T>, Option<(Arc<WakeTree>, usize)>),
    /// The caller leads the next batch.
    Lead,
}

/// Where a waiting caller is told what happened: a one-shot mailbox that
/// blocks without spinning (dozens of callers may wait on two cores).
pub(super) struct Slot<T> {
    wake: Mutex<Option<Wake<T>>>,
    signal: Condvar,
}

impl<T> Slot<T> {
    pub(super) fn new() -> Arc<Slot<T>> {
        Arc::new(Slot {
            wake: Mutex::new(None),
            signal: Condvar::new(),
        })
    }

    pub(super) fn put(&self, wake: Wake<T>) {
        self.put_quietly(wake);
        self.signal.notify_one();
    }

    pub(super) fn put_quietly(&self, wake: Wake<T>) {
        *self.wake.lock() = Some(wake);
    }

    pub(super) fn take(&self) -> Wake<T> {
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
pub(super) trait Notify: Send + Sync {
    fn notify(&self);
}

impl<T: Send> Notify for Slot<T> {
    fn notify(&self) {
        self.signal.notify_one();
    }
}

/// The callers of a finished batch, woken as a binary tree: the leader wakes
/// the first two, and each caller, once awake, the next two. A wake-up costs
/// a system call (≈ 15 µs on a busy 2-core VM); spread this way they run on
/// the callers' threads and in parallel, not one by one on the leader's,
/// so callers queue their next operations sooner and batches stay full.
pub(super) struct WakeTree {
    callers: Vec<Arc<dyn Notify>>,
}

impl WakeTree {
    /// Wakes the children of caller `parent` (of the leader, for `None`).
    pub(super) fn wake_children(&self, parent: Option<usize>) {
        let first = parent.map_or(0, |p| 2 * p + 2);
        for caller in self.callers.iter().skip(first).take(2) {
            caller.notify();
        }
    }
}

/// Answers the callers of a finished batch through a [`WakeTree`]: every
/// answer first, then the leader's two children.
/// Tasks' operations (which wake themselves) are answered at once, apart
/// from the tree.
pub(super) fn wake(answers: Answers) {
    let (tasks, threads): (Answers, Answers) = answers
        .into_iter()
        .partition(|(item, _)| item.wakes_itself());
    let tree = Arc::new(WakeTree {
        callers: threads.iter().map(|(item, _)| item.caller()).collect(),
    });
    for (index, (mut item, outcome)) in threads.into_iter().enumerate() {
        item.finish_quietly(outcome, tree.clone(), index);
    }
    tree.wake_children(None);
    for (mut item, outcome) in tasks {
        item.finish(outcome);
    }
}
