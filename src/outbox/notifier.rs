//! [`Notifier`]: coalescing wake-up signals, for the outbox's subscribers
//! and for the dispatcher's manual clock.

use crossbeam_channel::{Receiver, Sender, TrySendError};
use parking_lot::Mutex;

/// A set of wake-up channels. Each subscriber's channel holds at most one
/// signal, so signals coalesce; a dropped receiver unsubscribes.
#[derive(Debug, Default)]
pub(crate) struct Notifier {
    subscribers: Mutex<Vec<Sender<()>>>,
}

impl Notifier {
    /// A new subscriber's channel.
    pub(crate) fn subscribe(&self) -> Receiver<()> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.subscribers.lock().push(tx);
        rx
    }

    /// Signals every subscriber.
    pub(crate) fn notify(&self) {
        // A full channel already holds a signal; a closed one is dropped.
        self.subscribers
            .lock()
            .retain(|s| !matches!(s.try_send(()), Err(TrySendError::Disconnected(()))));
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
}
