//! The blocking calls: each waits on its async form from the calling
//! thread.
//!
//! The connections run on the store's own runtime (`conn.rs`), so a call's
//! future needs no runtime to make progress: polling it only hands
//! requests to the connection's task and reads its answers. [`wait`] polls
//! it on the calling thread, parking between polls, and that is all the
//! blocking API is. It never starts a tokio runtime, so it works on any
//! thread — a thread of your own, a `spawn_blocking` thread, and a thread
//! that drives a runtime as well (where it blocks that runtime's tasks for
//! the call's round trips, as every blocking call does; in async code the
//! `_async` forms hold no thread). Waits nest: a closure run inside a
//! blocking call (a `PgStore::write` body) makes blocking calls of its own.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;

/// Wakes the thread that waits.
struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs `f` to its end on this thread.
pub(crate) fn wait<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        // A wake-up that came before this park makes it return at once;
        // a spurious return polls again, which is harmless.
        std::thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_future_woken_from_another_thread_completes() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            tx.send(7).unwrap();
        });
        assert_eq!(wait(rx).unwrap(), 7);
        sender.join().unwrap();
    }

    #[test]
    fn waits_nest_and_work_on_a_runtime_thread() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let sender = std::thread::spawn(move || tx.send(1).unwrap());
            let inner = wait(async { wait(rx).unwrap() + 1 });
            assert_eq!(inner, 2);
            sender.join().unwrap();
        });
    }
}
