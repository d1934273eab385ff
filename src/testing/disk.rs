//! [`FaultyDisk`]: a store file in memory whose writes or syncs fail, or
//! panic, from a chosen one on.

use std::fmt;
use std::io;
use std::sync::Arc;

use parking_lot::Mutex;
use redb::{BackendError, StorageBackend};

/// What goes wrong on a [`FaultyDisk`].
///
/// May gain variants (`#[non_exhaustive]`): new kinds of failure to
/// inject. A match on one needs a `_` arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Fault {
    /// A write returns an I/O error.
    FailWrite,
    /// A write panics.
    PanicWrite,
    /// A sync (`fsync`) returns an I/O error.
    FailSync,
    /// A sync panics.
    PanicSync,
}

impl Fault {
    fn on_sync(self) -> bool {
        matches!(self, Fault::FailSync | Fault::PanicSync)
    }
}

/// A store file held in memory, for an application's crash and fault tests:
/// [`fail_at`](FaultyDisk::fail_at) makes the nth write or sync from now,
/// and every one after it, fail (an I/O error) or panic, until
/// [`heal`](FaultyDisk::heal). Clones share one file, so a test keeps a
/// handle to the disk it gave a store.
///
/// Every write is kept as soon as it is made, as an operating system keeps
/// the writes of a process that crashes: a store opened again on the bytes
/// (see [`TestStore::restart`](super::TestStore::restart)) finds what a
/// restarted process would. So a call failed by a [`Fault::FailSync`] (or
/// a [`Fault::PanicSync`]) is in doubt, as after a real failed `fsync`: its
/// writes were made, and the restarted store may have it whole, or not at
/// all; a call failed at its first write is not there. (A power cut, which
/// loses writes not yet synced, is not modelled.)
///
/// To aim at the next commit, fail the next sync: every commit syncs (once,
/// now and then twice), while how many writes one makes varies with the
/// pages it touches (7 to 11 for a claim or an enqueue on a small file).
///
/// ```
/// use idemstore::testing::{Fault, FaultyDisk};
/// use idemstore::{Error, Store};
///
/// let disk = FaultyDisk::new();
/// let store = Store::builder().open_with_backend(disk.clone())?;
/// let inbox = store.inbox("webhooks")?;
/// disk.fail_at(Fault::FailSync, 1);
/// let failed = inbox.claim("evt_1", chrono::Utc::now());
/// assert!(matches!(failed, Err(Error::Io(_) | Error::Storage(_))), "{failed:?}");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Default)]
pub struct FaultyDisk {
    inner: Arc<Mutex<Disk>>,
}

#[derive(Default)]
struct Disk {
    bytes: Vec<u8>,
    writes: u64,
    syncs: u64,
    /// The fault, and the write (or sync) count from which it strikes.
    fault: Option<(Fault, u64)>,
}

impl fmt::Debug for FaultyDisk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.inner.lock();
        f.debug_struct("FaultyDisk")
            .field("len", &d.bytes.len())
            .field("writes", &d.writes)
            .field("syncs", &d.syncs)
            .field("fault", &d.fault)
            .finish()
    }
}

impl FaultyDisk {
    /// An empty disk without faults.
    #[must_use]
    pub fn new() -> FaultyDisk {
        FaultyDisk::default()
    }

    /// From the `nth` write (for [`Fault::FailWrite`] and
    /// [`Fault::PanicWrite`]) or sync (the others) from now on, `1` being
    /// the next, every one fails or panics until [`heal`](FaultyDisk::heal).
    /// Replaces a fault set before. `nth == 0` counts as `1`.
    pub fn fail_at(&self, fault: Fault, nth: u64) {
        let mut d = self.inner.lock();
        let done = if fault.on_sync() { d.syncs } else { d.writes };
        d.fault = Some((fault, done + nth.max(1)));
    }

    /// No more faults: writes and syncs succeed from now on.
    pub fn heal(&self) {
        self.inner.lock().fault = None;
    }

    /// Writes made so far (a failed or panicking one included).
    #[must_use]
    pub fn writes(&self) -> u64 {
        self.inner.lock().writes
    }

    /// Syncs made so far (a failed or panicking one included).
    #[must_use]
    pub fn syncs(&self) -> u64 {
        self.inner.lock().syncs
    }

    /// A new disk holding a copy of this one's bytes, without faults: the
    /// file as a process that crashed now leaves it.
    #[must_use]
    pub fn copy(&self) -> FaultyDisk {
        let bytes = self.inner.lock().bytes.clone();
        FaultyDisk {
            inner: Arc::new(Mutex::new(Disk {
                bytes,
                ..Disk::default()
            })),
        }
    }

    /// Counts one write (`sync == false`) or sync and says whether it is
    /// struck: `Err` for a failure; a panic is raised after the lock is
    /// let go, so that the disk stays usable.
    fn count(&self, sync: bool) -> io::Result<()> {
        let struck = {
            let mut d = self.inner.lock();
            let n = if sync {
                d.syncs += 1;
                d.syncs
            } else {
                d.writes += 1;
                d.writes
            };
            d.fault
                .filter(|(fault, from)| fault.on_sync() == sync && n >= *from)
                .map(|(fault, _)| fault)
        };
        match struck {
            None => Ok(()),
            Some(Fault::FailWrite | Fault::FailSync) => Err(io::Error::other(format!(
                "injected fault: the disk fails this {}",
                if sync { "sync" } else { "write" }
            ))),
            Some(Fault::PanicWrite | Fault::PanicSync) => panic!(
                "injected fault: the disk panics in this {}",
                if sync { "sync" } else { "write" }
            ),
        }
    }
}

fn out_of_range(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("{what} past usize"))
}

impl StorageBackend for FaultyDisk {
    fn len(&self) -> Result<u64, BackendError> {
        Ok(self.inner.lock().bytes.len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BackendError> {
        let d = self.inner.lock();
        let start = usize::try_from(offset).map_err(|_| out_of_range("offset"))?;
        let src = start
            .checked_add(out.len())
            .and_then(|end| d.bytes.get(start..end))
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"))?;
        out.copy_from_slice(src);
        Ok(())
    }

    fn set_len(&self, len: u64) -> Result<(), BackendError> {
        self.count(false)?;
        let len = usize::try_from(len).map_err(|_| out_of_range("length"))?;
        self.inner.lock().bytes.resize(len, 0);
        Ok(())
    }

    fn sync_data(&self) -> Result<(), BackendError> {
        Ok(self.count(true)?)
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        self.count(false)?;
        let mut d = self.inner.lock();
        let start = usize::try_from(offset).map_err(|_| out_of_range("offset"))?;
        let end = start
            .checked_add(data.len())
            .ok_or_else(|| out_of_range("write end"))?;
        if d.bytes.len() < end {
            d.bytes.resize(end, 0);
        }
        if let Some(dst) = d.bytes.get_mut(start..end) {
            dst.copy_from_slice(data);
        }
        Ok(())
    }

    fn close(&self) -> Result<(), BackendError> {
        Ok(())
    }
}
