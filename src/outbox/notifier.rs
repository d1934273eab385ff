//! [`Notifier`]: coalescing wake-up signals, for the outbox's subscribers
//! and for the dispatcher's manual clock.
//!
//! Blocking waiters get a channel each ([`Notifier::subscribe`]); with
//! feature `tokio`, async waiters get a receiver of one watch channel
//! ([`Notifier::subscribe_async`]), so that a task awaits a signal without
//! a thread parked for it. [`Notifier::notify`] signals both kinds.
//!
//! A thread that feeds the notifier only while someone listens (the
//! outbox's watch of other processes) registers with
//! [`Notifier::unpark_on_subscribe`] and asks
//! [`Notifier::has_subscribers`].

use crossbeam_channel::{Receiver, Sender, TrySendError};
use parking_lot::Mutex;

/// A set of wake-up channels. Each subscriber's channel holds at most one
/// signal, so signals coalesce; a dropped receiver unsubscribes.
#[derive(Debug, Default)]
pub(crate) struct Notifier {
    subscribers: Mutex<Vec<Sender<()>>>,
    /// Async waiters: each signal marks the channel changed for every
    /// receiver (signals coalesce the same way: a receiver sees "changed"
    /// once, however many signals came since it last looked).
    #[cfg(feature = "tokio")]
    waiters: tokio::sync::watch::Sender<()>,
    /// A thread to unpark whenever someone subscribes.
    feeder: Mutex<Option<std::thread::Thread>>,
}

impl Notifier {
    /// A new subscriber's channel.
    pub(crate) fn subscribe(&self) -> Receiver<()> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.subscribers.lock().push(tx);
        self.unpark_feeder();
        rx
    }

    /// A new async subscriber: `changed().await` returns once a signal came
    /// after this call (or after its last `changed`). It never returns `Err`
    /// while the notifier lives.
    #[cfg(feature = "tokio")]
    pub(crate) fn subscribe_async(&self) -> tokio::sync::watch::Receiver<()> {
        let rx = self.waiters.subscribe();
        self.unpark_feeder();
        rx
    }

    /// Whether anyone may be listening: an async subscriber alive, or a
    /// blocking one not yet known to be gone (a dropped receiver is noticed
    /// at the next signal), so never `false` while one listens.
    pub(crate) fn has_subscribers(&self) -> bool {
        #[cfg(feature = "tokio")]
        if self.waiters.receiver_count() > 0 {
            return true;
        }
        !self.subscribers.lock().is_empty()
    }

    /// Unparks the calling thread after every later subscription: a thread
    /// that parks while [`Notifier::has_subscribers`] is `false` then never
    /// misses the first one (an unpark before the park ends it at once).
    pub(crate) fn unpark_on_subscribe(&self) {
        *self.feeder.lock() = Some(std::thread::current());
    }

    fn unpark_feeder(&self) {
        if let Some(feeder) = &*self.feeder.lock() {
            feeder.unpark();
        }
    }

    /// Signals every subscriber.
    pub(crate) fn notify(&self) {
        // A full channel already holds a signal; a closed one is dropped.
        self.subscribers
            .lock()
            .retain(|s| !matches!(s.try_send(()), Err(TrySendError::Disconnected(()))));
        // Marks the value changed even when no receiver is alive.
        #[cfg(feature = "tokio")]
        self.waiters.send_replace(());
    }
}

// The outbox's async subscription lives here, beside the notifier it
// reads (a child module sees the outbox's private fields).
#[cfg(feature = "tokio")]
impl super::Outbox {
    /// [`Outbox::subscribe`](super::Outbox::subscribe) for async waiters:
    /// signalled after the same commits.
    pub(crate) fn subscribe_async(&self) -> tokio::sync::watch::Receiver<()> {
        self.notifier.subscribe_async()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_coalesce_and_dropped_subscribers_go() {
        let n = Notifier::default();
        let a = n.subscribe();
        let b = n.subscribe();
        n.notify();
        n.notify();
        assert!(a.try_recv().is_ok());
        assert!(a.try_recv().is_err(), "two signals coalesce into one");
        drop(b);
        n.notify();
        assert_eq!(n.subscribers.lock().len(), 1);
        assert!(a.try_recv().is_ok());
    }

    #[cfg(feature = "tokio")]
    #[test]
    fn async_subscribers_see_each_later_signal_once() {
        let n = Notifier::default();
        n.notify();
        let mut a = n.subscribe_async();
        assert!(!a.has_changed().unwrap(), "a signal before subscribing");
        n.notify();
        n.notify();
        assert!(a.has_changed().unwrap());
        a.mark_unchanged();
        assert!(!a.has_changed().unwrap(), "two signals coalesce into one");
        let blocking = n.subscribe();
        n.notify();
        assert!(a.has_changed().unwrap());
        assert!(
            blocking.try_recv().is_ok(),
            "blocking subscribers still hear"
        );
    }
}
