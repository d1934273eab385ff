//! The engine's synchronisation primitives, in one place so that a model
//! checker can take their place: `parking_lot`'s locks, std's atomics and
//! threads, crossbeam's channel, normally; under `--cfg shuttle`, shuttle's,
//! which let its schedulers choose every interleaving of the engine's
//! threads (`model.rs`, run by `RUSTFLAGS="--cfg shuttle" cargo test --lib
//! engine::model`). The model types keep `parking_lot`'s shapes (`lock()`
//! without a `Result`, `Condvar::wait(&mut guard)`), so the engine's code
//! reads the same under both.

#[cfg(not(shuttle))]
pub(super) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
#[cfg(not(shuttle))]
pub(super) use std::thread;

#[cfg(not(shuttle))]
pub(super) use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, bounded};
#[cfg(not(shuttle))]
pub(super) use parking_lot::{Condvar, Mutex, RwLock};

#[cfg(shuttle)]
pub(super) use model::*;

// A guard is empty only inside `Condvar::wait`, which fills it again
// before it returns: the `expect`s cannot fire.
#[cfg(shuttle)]
#[allow(clippy::expect_used)]
mod model {
    use std::ops::{Deref, DerefMut};

    pub(crate) use shuttle::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
    pub(crate) use shuttle::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender as Sender};
    pub(crate) use shuttle::thread;

    /// A bounded channel, as crossbeam's `bounded`.
    pub(crate) fn bounded<T>(cap: usize) -> (Sender<T>, Receiver<T>) {
        shuttle::sync::mpsc::sync_channel(cap)
    }

    /// A mutex with `parking_lot`'s shape; a poisoned lock is taken anyway,
    /// as `parking_lot` has no poisoning.
    #[derive(Debug, Default)]
    pub(crate) struct Mutex<T>(shuttle::sync::Mutex<T>);

    /// Its guard: an `Option` so that [`Condvar::wait`] can hand the
    /// guard to shuttle's wait and put the one it gives back.
    pub(crate) struct MutexGuard<'a, T>(Option<shuttle::sync::MutexGuard<'a, T>>);

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Self {
            Mutex(shuttle::sync::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            MutexGuard(Some(
                self.0
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            ))
        }

        #[cfg(feature = "tokio")]
        pub(crate) fn get_mut(&mut self) -> &mut T {
            self.0
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }
    }

    impl<T> Deref for MutexGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            self.0.as_ref().expect("a guard between waits")
        }
    }

    impl<T> DerefMut for MutexGuard<'_, T> {
        fn deref_mut(&mut self) -> &mut T {
            self.0.as_mut().expect("a guard between waits")
        }
    }

    #[derive(Debug, Default)]
    pub(crate) struct Condvar(shuttle::sync::Condvar);

    impl Condvar {
        pub(crate) fn new() -> Self {
            Condvar(shuttle::sync::Condvar::new())
        }

        pub(crate) fn wait<T>(&self, guard: &mut MutexGuard<'_, T>) {
            let held = guard.0.take().expect("a guard between waits");
            guard.0 = Some(
                self.0
                    .wait(held)
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            );
        }

        pub(crate) fn notify_one(&self) {
            self.0.notify_one();
        }

        pub(crate) fn notify_all(&self) {
            self.0.notify_all();
        }
    }

    /// A reader-writer lock with `parking_lot`'s shape. The engine takes it
    /// for reading recursively only; shuttle's readers never wait for
    /// other readers.
    #[derive(Debug, Default)]
    pub(crate) struct RwLock<T>(shuttle::sync::RwLock<T>);

    impl<T> RwLock<T> {
        pub(crate) fn new(value: T) -> Self {
            RwLock(shuttle::sync::RwLock::new(value))
        }

        pub(crate) fn read_recursive(&self) -> shuttle::sync::RwLockReadGuard<'_, T> {
            self.0
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }

        pub(crate) fn read(&self) -> shuttle::sync::RwLockReadGuard<'_, T> {
            self.read_recursive()
        }

        pub(crate) fn write(&self) -> shuttle::sync::RwLockWriteGuard<'_, T> {
            self.0
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }
    }
}
