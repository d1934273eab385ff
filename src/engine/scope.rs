//! The thread-local scopes of a thread that writes: [`WriteScope`] (this
//! thread runs a caller closure in a write transaction) and [`HookFrame`]
//! (the after-commit hooks of one transaction this thread runs), with
//! [`after_commit`] and [`run_hooks`].
//!
//! # Invariants
//!
//! - `IN_WRITE` is set exactly while a [`WriteScope`] lives on this thread.
//!   Write scopes never nest (a second [`WriteScope::enter`] is
//!   [`Error::Reentrant`]), so clearing the flag when one ends restores it.
//! - Hook frames form a stack, innermost last, and end in the reverse order
//!   of their start (each is owned by one stack frame of the thread), so a
//!   frame's `depth` always names it. [`after_commit`] lands in the
//!   innermost frame; what a frame still holds when it ends is dropped: its
//!   transaction did not commit.
//! - The two scopes nest in one order only. A caller closure's
//!   [`WriteScope`] (which holds a frame) may hold a batch's frame: before
//!   its transaction begins, its thread commits the transaction kept open
//!   under `Durability::None` by queuing an empty operation, and may lead
//!   that batch (see `Inner::without_open`). A batch's frame never holds a
//!   write scope or another batch's frame: operations and hooks never call
//!   the engine (one that queued an operation would wait for its own batch;
//!   one that began a transaction would wait for its own writer lock).
//! - While a closure's caller leads such a batch, `IN_WRITE` stays set, and
//!   the batch's operations run with it set; nothing they call consults it.
//!
//! # Locks
//!
//! None: thread-local state only. Hooks run with no lock of the engine held
//! and only once the callers of their transaction are answered: a batch's
//! on its leader's thread once it has its own answer and has woken its
//! children (see `batch`), a closure's on its caller's thread once its
//! commit is durable. In a store shared between processes a closure's
//! hooks run with its batch's, on the closure's thread, which leads the
//! batch, once the batch's other callers are answered.

use std::cell::{Cell, RefCell};

// Under the model checker each of its threads needs its own copy.
#[cfg(shuttle)]
use shuttle::thread_local;
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::error::{Error, Result};

thread_local! {
    /// Set while this thread runs a caller closure inside a write transaction.
    static IN_WRITE: Cell<bool> = const { Cell::new(false) };
    /// The after-commit hooks of the transactions this thread is running,
    /// innermost last: a caller closure's, and within it (when the closure's
    /// caller leads a batch before it begins) a batch's. See [`HookFrame`].
    static HOOKS: RefCell<Vec<Vec<Hook>>> = const { RefCell::new(Vec::new()) };
    /// How many read closures this thread is running, one inside another.
    static READS: Cell<usize> = const { Cell::new(0) };
}

/// Work to do once a transaction has committed.
pub(super) type Hook = Box<dyn FnOnce() + Send>;

/// Whether this thread is running a caller closure inside a write
/// transaction (it holds redb's writer lock).
pub(super) fn in_write() -> bool {
    IN_WRITE.with(Cell::get)
}

/// Runs `hook` once the transaction the current thread writes in has
/// committed, and never if it rolls back. The innermost transaction the
/// thread is running wins:
/// - in a queued operation, once its batch's transaction commits (durably
///   or not);
/// - in a caller closure ([`Engine::write`](super::Engine::write)), once its
///   commit is durable (under
///   [`Durability::Immediate`](super::Durability::Immediate); committed,
///   under [`Durability::None`](super::Durability::None)); in a store
///   shared between processes, with the hooks of the batch the closure's
///   thread leads;
/// - elsewhere, at once.
///
/// Either way it runs with no lock of the engine held, once every caller of
/// the transaction is answered, and a panic in it is dropped: a hook cannot
/// change an answer, hang a caller or break the store.
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
        run_hooks(vec![hook]);
    }
}

/// The hooks of one transaction this thread runs, for its lifetime: hooks
/// registered while it is the innermost frame land in it, and whatever is
/// left uncollected when it ends is dropped (the transaction did not
/// commit). Frames nest: a caller closure's scope may hold a batch's, never
/// the other way round, and the innermost one always collects.
pub(super) struct HookFrame {
    /// This frame's position in [`HOOKS`], counted from 1.
    depth: usize,
}

impl HookFrame {
    pub(super) fn push() -> HookFrame {
        HOOKS.with(|frames| {
            let mut frames = frames.borrow_mut();
            frames.push(Vec::new());
            HookFrame {
                depth: frames.len(),
            }
        })
    }

    /// The hooks registered in this frame so far.
    pub(super) fn take(&self) -> Vec<Hook> {
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
    pub(super) fn discard(&self) {
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
pub(super) struct WriteScope {
    hooks: HookFrame,
}

impl WriteScope {
    pub(super) fn enter() -> Result<WriteScope> {
        if in_write() {
            return Err(Error::Reentrant);
        }
        IN_WRITE.with(|c| c.set(true));
        Ok(WriteScope {
            hooks: HookFrame::push(),
        })
    }

    /// The hooks the closure registered so far.
    pub(super) fn take_hooks(&self) -> Vec<Hook> {
        self.hooks.take()
    }
}

impl Drop for WriteScope {
    fn drop(&mut self) {
        IN_WRITE.with(|c| c.set(false));
    }
}

/// Whether this thread is running a read closure (it holds a read
/// transaction, and the database's lock shared).
pub(super) fn in_read() -> bool {
    READS.with(Cell::get) > 0
}

/// Marks the current thread as inside a read closure for its lifetime.
/// Reads may nest: the scopes count.
pub(super) struct ReadScope(());

impl ReadScope {
    pub(super) fn enter() -> ReadScope {
        READS.with(|c| c.set(c.get() + 1));
        ReadScope(())
    }
}

impl Drop for ReadScope {
    fn drop(&mut self) {
        READS.with(|c| c.set(c.get() - 1));
    }
}

/// Runs after-commit hooks, each to its end: one that panics does not keep
/// the others from running, and its panic is dropped. Hooks run once the
/// answers of their transaction are out (see `batch`); what they do (a
/// report to the application's recorder, a wake-up) never changes those
/// answers, so a panic in one has nothing left to change.
pub(super) fn run_hooks(hooks: Vec<Hook>) {
    for hook in hooks {
        let _ = catch_unwind(AssertUnwindSafe(hook));
    }
}
