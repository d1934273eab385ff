//! [`Clock`]: where the runtime gets `now`. Storage calls never read a clock;
//! only the dispatcher and the janitor hold one.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use crossbeam_channel::Receiver;
use parking_lot::Mutex;

use crate::outbox::Notifier;

/// A source of the current time.
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> DateTime<Utc>;

    /// A channel signalled whenever the clock jumps (a manual clock being
    /// advanced), so that sleepers recompute their deadlines. `None` (the
    /// default) for clocks that move with real time.
    fn changes(&self) -> Option<Receiver<()>> {
        None
    }

    /// [`Clock::changes`] for async waiters (the dispatcher started with
    /// [`start_async`](crate::DispatcherBuilder::start_async)): a watch
    /// receiver marked changed whenever the clock jumps; its tasks await
    /// `changed()`. `None` (the default) for clocks that move with real
    /// time. A clock that wraps a [`ManualClock`] forwards both methods, or
    /// an async dispatcher only notices its jumps when a timer it set (by
    /// real time) fires.
    #[cfg(feature = "tokio")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
    fn changes_async(&self) -> Option<tokio::sync::watch::Receiver<()>> {
        None
    }
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that moves only when told to, for tests. Clones share one time.
#[derive(Debug, Clone)]
pub struct ManualClock {
    inner: Arc<ManualInner>,
}

#[derive(Debug)]
struct ManualInner {
    now: Mutex<DateTime<Utc>>,
    watchers: Notifier,
}

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: DateTime<Utc>) -> Self {
        ManualClock {
            inner: Arc::new(ManualInner {
                now: Mutex::new(start),
                watchers: Notifier::default(),
            }),
        }
    }

    /// Moves the clock forward by `by` and wakes whoever waits on it.
    pub fn advance(&self, by: std::time::Duration) {
        let by = chrono::Duration::from_std(by).unwrap_or(chrono::Duration::MAX);
        let mut now = self.inner.now.lock();
        *now = now.checked_add_signed(by).unwrap_or(*now);
        self.inner.watchers.notify();
    }

    /// Sets the clock to `at` (forwards or backwards) and wakes whoever
    /// waits on it.
    pub fn set(&self, at: DateTime<Utc>) {
        let mut now = self.inner.now.lock();
        *now = at;
        self.inner.watchers.notify();
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.inner.now.lock()
    }

    fn changes(&self) -> Option<Receiver<()>> {
        Some(self.inner.watchers.subscribe())
    }

    #[cfg(feature = "tokio")]
    fn changes_async(&self) -> Option<tokio::sync::watch::Receiver<()>> {
        Some(self.inner.watchers.subscribe_async())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn manual_clock_moves_only_when_told_and_signals() {
        let start = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let clock = ManualClock::new(start);
        let changes = clock.changes().unwrap();
        assert_eq!(clock.now(), start);
        assert!(changes.try_recv().is_err());
        clock.advance(Duration::from_secs(5));
        assert_eq!(clock.now(), start + chrono::Duration::seconds(5));
        assert!(changes.try_recv().is_ok());
        clock.set(start);
        assert_eq!(clock.now(), start);
        assert!(changes.try_recv().is_ok());
        assert!(SystemClock.changes().is_none());
    }

    #[cfg(feature = "tokio")]
    #[test]
    fn manual_clock_signals_async_waiters() {
        let start = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let clock = ManualClock::new(start);
        let mut changes = clock.changes_async().unwrap();
        assert!(!changes.has_changed().unwrap());
        clock.advance(Duration::from_secs(1));
        assert!(changes.has_changed().unwrap());
        changes.mark_unchanged();
        clock.set(start);
        assert!(changes.has_changed().unwrap());
        assert!(SystemClock.changes_async().is_none());
    }
}
