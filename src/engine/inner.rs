//! [`Inner`]: the state of one engine, which every mechanism touches. Each
//! mechanism adds its own `impl Inner` block in its file and owns the
//! fields named there; this file only gathers them.
//!
//! # Invariants
//!
//! Those of each field are stated in the file that owns it.
//!
//! # Locks
//!
//! None taken here. The order of all of them is in the engine's module
//! docs.

use redb::Database;

use super::EngineConfig;
use super::batch::Queue;
use super::durability::SyncState;
use super::open_tx::OpenTx;
use super::processes::Refresh;
use super::sync::{AtomicBool, AtomicU64, AtomicUsize, Condvar, Mutex, RwLock};

/// The state of one engine, shared by its handle, the callers' threads and
/// the flusher. Fields drop in the order declared: `db` before a
/// transaction `open` may still hold (after a close that could not commit
/// it).
pub(super) struct Inner {
    /// Inner (always `read_recursive`) by every transaction this store
    /// opens; exclusive only in `Engine::exclusive`.
    pub(super) db: RwLock<Database>,
    pub(super) config: EngineConfig,
    /// Sequence number of the latest commit started (taken under redb's
    /// write lock). See `durability`.
    pub(super) seq: AtomicU64,
    /// See `durability`.
    pub(super) sync: Mutex<SyncState>,
    /// Whether `sync` holds a cause of breakage nobody reported yet: lets
    /// every batch's end skip `sync`'s lock. See `durability`.
    pub(super) unreported: AtomicBool,
    /// Signalled when a durable commit ends, well or badly.
    pub(super) synced: Condvar,
    /// Operations waiting for a batch, and whether one is led. See `batch`.
    pub(super) queue: Mutex<Queue>,
    /// Durable commits made, for the tests and the benchmarks' fsync counts.
    pub(super) durable_commits: AtomicU64,
    /// Write transactions committed, durable or not.
    pub(super) commits: AtomicU64,
    /// Under [`Durability::None`](super::Durability::None): the transaction
    /// batches keep open between commits (only a batch leader touches it).
    /// See `open_tx`.
    pub(super) open: Mutex<Option<OpenTx>>,
    /// Whether `open` may hold answered, uncommitted writes.
    pub(super) pending: AtomicBool,
    /// Callers about to begin a write transaction of their own, which a
    /// leader must not keep one open against.
    pub(super) writers_waiting: AtomicUsize,
    /// In a store shared between processes, run at the start of each
    /// batch's write transaction. See `processes`.
    pub(super) refreshes: RwLock<Vec<Refresh>>,
    /// The thread that leads batches for tasks' operations, once one was
    /// queued. See `tasks`.
    #[cfg(feature = "tokio")]
    pub(super) task_leader: Mutex<Option<std::sync::Arc<super::tasks::TaskLeader>>>,
}

#[cfg(feature = "tokio")]
impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(leader) = self.task_leader.get_mut().take() {
            leader.stop();
        }
    }
}

impl Inner {
    pub(super) fn new(db: Database, config: EngineConfig) -> Inner {
        Inner {
            db: RwLock::new(db),
            config,
            seq: AtomicU64::new(0),
            sync: Mutex::new(SyncState::default()),
            unreported: AtomicBool::new(false),
            synced: Condvar::new(),
            queue: Mutex::new(Queue::default()),
            durable_commits: AtomicU64::new(0),
            commits: AtomicU64::new(0),
            open: Mutex::new(None),
            pending: AtomicBool::new(false),
            writers_waiting: AtomicUsize::new(0),
            refreshes: RwLock::new(Vec::new()),
            #[cfg(feature = "tokio")]
            task_leader: Mutex::new(None),
        }
    }
}
