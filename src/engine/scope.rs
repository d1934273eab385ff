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
//!   that batch (see `Shared::without_open`). A batch's frame never holds a
//!   write scope or another batch's frame: operations and hooks never call
//!   the engine (one that queued an operation would wait for its own batch;
//!   one that began a transaction would wait for its own writer lock).
//! - While a closure's caller leads such a batch, `IN_WRITE` stays set, and
//!   the batch's operations run with it set; nothing they call consults it.
//!
//! # Locks
//!
//! None: thread-local state only. Hooks run with whatever locks their caller
//! holds: a batch's under `db` and `open` (see `batch`), a closure's with
//! none in a store held alone. In a store shared between processes a
//! closure's hooks run with its batch's: on the closure's thread, which
//! leads the batch, under `db` and `open`, with `IN_WRITE` still set, and
//! before the batch's other callers are answered.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::error::{Error, Result};

thread_local! {
    /// Set while this thread runs a caller closure inside a write transaction.
    static IN_WRITE: Cell<bool> = const { Cell::new(false) };
    /// The after-commit hooks of the transactions this thread is running,
    /// innermost last: a caller closure's, and within it (when the closure's
    /// caller leads a batch before it begins) a batch's. See [`HookFrame`].
    static HOOKS: RefCell<Vec<Vec<Hook>>> = const { RefCell::new(Vec::new()) };
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
///   thread leads, under the batch's locks and before the batch's other
///   callers are answered;
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

/// Runs after-commit hooks, each to its end: one that panics does not keep
/// the others from running. Returns the first panic, for the caller to
/// resume once nobody else depends on it.
pub(super) fn run_hooks(hooks: Vec<Hook>) -> Option<Box<dyn Any + Send>> {
    let mut first = None;
    for hook in hooks {
        if let Err(panic) = catch_unwind(AssertUnwindSafe(hook)) {
            first.get_or_insert(panic);
        }
    }
    first
}
