//! Calls from async code: where the synchronous client may block.
//!
//! The `postgres` client is `tokio-postgres` driven by a small tokio
//! runtime of its own, one per connection: every statement, every new
//! connection and every close blocks on it (`Runtime::block_on`). Tokio
//! refuses that on a thread that is driving a runtime — a worker of a
//! multi-thread runtime, the thread of a `current_thread` runtime, the body
//! of `#[tokio::main] async fn main` — with a panic ("Cannot start a runtime
//! from within a runtime"). So the store never hands the client such a
//! thread. Each call looks where it runs ([`place`]):
//!
//! - **No runtime here** (`Handle::try_current` fails: a plain thread): the
//!   call runs here.
//! - **A multi-thread runtime**: the call runs here inside
//!   `tokio::task::block_in_place`, which first hands this worker's other
//!   tasks to another thread (and just runs the call on a thread that does
//!   not drive the runtime, such as a `spawn_blocking` thread). Every call
//!   works, `PgStore::write` closures and `claim_with` effects included.
//! - **A current-thread runtime** (or any other flavor): `block_in_place`
//!   is not allowed there, and tokio has no public call that tells the
//!   runtime's own thread from a thread of its blocking pool, where
//!   blocking is fine. [`drives_runtime`] tells them apart by how
//!   `tokio::task::yield_now` asks to be woken: through the scheduler of
//!   the thread that drives it, or at once anywhere else. On a thread of
//!   the pool the call runs here. On the runtime's own thread the store's
//!   own calls (a claim, an enqueue, a begin, a read, `connect`) run on a
//!   helper thread while this one waits, and so they work; a call that runs
//!   the caller's closure (`PgStore::write`, `claim_with`) cannot move the
//!   closure to another thread (it need not be `Send`), so it returns
//!   [`Error::InvalidInput`] for the field `runtime`, naming
//!   `tokio::task::spawn_blocking`, before anything is sent.
//!
//! Waiting on the runtime's thread stalls its other tasks for a round trip,
//! as every call of the embedded store does: in async code,
//! `spawn_blocking` stays the way to call a store. The tests in
//! `tests/pg_client.rs` and this module's unit tests hold each case to
//! account, the way the yield asks to be woken included.
//!
//! The one place left where a call still meets tokio's panic is a
//! `LocalSet` run by `LocalSet::block_on` on a multi-thread runtime
//! (tokio forbids `block_in_place` there and gives no way to see it): call
//! the store through `spawn_blocking` there.

use std::future::Future as _;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Wake, Waker};

use tokio::runtime::{Handle, RuntimeFlavor};

use crate::error::{Error, Result};

/// Where a call that blocks on the client may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Where {
    /// On this thread: no runtime drives it.
    Here,
    /// On this thread, inside `block_in_place` (a multi-thread runtime).
    BlockInPlace,
    /// Not on this thread: it drives a current-thread runtime.
    Elsewhere,
}

/// Where a call made on this thread may block (see the module docs).
pub(super) fn place() -> Where {
    let Ok(handle) = Handle::try_current() else {
        return Where::Here;
    };
    match handle.runtime_flavor() {
        RuntimeFlavor::MultiThread => Where::BlockInPlace,
        _ if drives_runtime() => Where::Elsewhere,
        _ => Where::Here,
    }
}

/// Whether this thread is driving a tokio runtime's scheduler (it runs its
/// `block_on` or one of its tasks) rather than merely having it as the
/// current runtime (a `spawn_blocking` thread, `Handle::enter`). Polled
/// once, `yield_now` defers its wake-up to the scheduler of a thread that
/// drives one, and wakes at once on any other.
fn drives_runtime() -> bool {
    struct Woken(AtomicBool);
    impl Wake for Woken {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.store(true, Ordering::Release);
        }
    }
    let woken = Arc::new(Woken(AtomicBool::new(false)));
    let waker = Waker::from(woken.clone());
    let mut cx = Context::from_waker(&waker);
    let mut probe = pin!(tokio::task::yield_now());
    // The first poll is always `Pending`: what tells is whether it woke.
    let _ = probe.as_mut().poll(&mut cx);
    !woken.0.load(Ordering::Acquire)
}

/// Runs `f`, one of the store's own calls, where it may block: here, inside
/// `block_in_place`, or on a helper thread while this one waits (a panic in
/// `f` reaches the caller).
pub(super) fn off_runtime<T: Send>(f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    match place() {
        Where::Here => f(),
        Where::BlockInPlace => tokio::task::block_in_place(f),
        Where::Elsewhere => std::thread::scope(|s| {
            let helper = std::thread::Builder::new()
                .name("idemstore-pg".into())
                .spawn_scoped(s, f)
                .map_err(Error::Io)?;
            helper
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        }),
    }
}

/// Runs `f`, a call that runs the caller's closure, here if this thread
/// may block (inside `block_in_place` on a multi-thread runtime); on the
/// thread of a current-thread runtime, [`refused`] without running it.
pub(super) fn on_this_thread<T, E: From<Error>>(f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    match place() {
        Where::Here => f(),
        Where::BlockInPlace => tokio::task::block_in_place(f),
        Where::Elsewhere => Err(refused().into()),
    }
}

/// [`Error::InvalidInput`] for the field `runtime`: a call would run the
/// caller's closure with the synchronous client on the thread of a
/// current-thread tokio runtime, where the client cannot block.
fn refused() -> Error {
    Error::invalid(
        "runtime",
        "`PgStore::write` and `claim_with` run your closure on the calling thread with the \
         synchronous PostgreSQL client, which cannot block the thread of a current-thread \
         tokio runtime; make the call in `tokio::task::spawn_blocking` (or on a multi-thread \
         runtime, or a thread of your own)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_thread_runs_calls_here() {
        assert_eq!(place(), Where::Here);
        assert_eq!(off_runtime(|| Ok(7)).unwrap(), 7);
        assert_eq!(on_this_thread::<_, Error>(|| Ok(8)).unwrap(), 8);
    }

    #[test]
    fn the_thread_of_a_current_thread_runtime_is_told_from_its_blocking_pool() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            assert_eq!(place(), Where::Elsewhere);
            // Its own calls move to a helper thread...
            let here = std::thread::current().id();
            let there = off_runtime(|| Ok(std::thread::current().id())).unwrap();
            assert_ne!(here, there);
            // ...a caller's closure does not run.
            let e = on_this_thread::<(), Error>(|| panic!("ran")).unwrap_err();
            assert!(
                matches!(e, Error::InvalidInput { field: "runtime", ref reason }
                    if reason.contains("tokio::task::spawn_blocking")),
                "{e}"
            );
            // A task of the runtime drives it too.
            let task = tokio::spawn(async { place() }).await.unwrap();
            assert_eq!(task, Where::Elsewhere);
            // A thread of its blocking pool may block.
            let pool = tokio::task::spawn_blocking(place).await.unwrap();
            assert_eq!(pool, Where::Here);
        });
        // Entered but not driven: may block.
        let _entered = rt.enter();
        assert_eq!(place(), Where::Here);
    }

    #[test]
    fn a_multi_thread_runtime_blocks_in_place() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        rt.block_on(async {
            assert_eq!(place(), Where::BlockInPlace);
            let worker = tokio::spawn(async { off_runtime(|| Ok(1)).unwrap() });
            assert_eq!(worker.await.unwrap(), 1);
            assert_eq!(on_this_thread::<_, Error>(|| Ok(2)).unwrap(), 2);
        });
    }

    #[test]
    fn a_panic_on_the_helper_thread_reaches_the_caller() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            rt.block_on(async { off_runtime::<()>(|| panic!("in the call")) })
        }));
        let payload = caught.unwrap_err();
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"in the call"));
    }
}
