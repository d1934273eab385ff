//! [`Store`] and [`StoreBuilder`]: open the file, hand out the primitives.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use redb::{ReadableTable, StorageBackend};

mod backend;

use crate::engine::{Durability, Engine, EngineConfig};
use crate::error::{Error, Result, panic_message};
use crate::idempotency::IdempotencyKeys;
use crate::inbox::{Inbox, Journal};
use crate::outbox::Outbox;
use crate::schema::{
    FORMAT_VERSION, FORMAT_VERSION_BEFORE_DESTINATIONS, FORMAT_VERSION_BEFORE_LISTING, META,
    META_FORMAT_VERSION, open_read, open_write,
};

/// Default page cache: 64 MiB.
pub const DEFAULT_CACHE_SIZE: usize = 64 * 1024 * 1024;
/// Default largest number of queued operations committed in one batch.
pub const DEFAULT_MAX_BATCH: usize = 1024;
/// Default number of recent inbox claims journaled before a merge.
pub const DEFAULT_JOURNAL_SIZE: u64 = 4096;
/// Default flush interval under [`Durability::None`]: 100 ms.
pub const DEFAULT_FLUSH_INTERVAL: Duration = Duration::from_millis(100);
pub use crate::idempotency::rules::DEFAULT_MAX_BODY;
/// Default interval at which a shared store looks for other processes'
/// commits: 5 ms.
pub const DEFAULT_SHARED_POLL_INTERVAL: Duration = Duration::from_millis(5);

/// The longest [`StoreBuilder::shared_poll_interval`]: longer ones are cut
/// to it.
const MAX_SHARED_POLL_INTERVAL: Duration = Duration::from_secs(3600);

/// An open store file. Cheap to clone (an `Arc` inside); clones share one
/// database and one commit queue. The file is closed
/// when the last clone (and every handle taken from it) is dropped.
///
/// All calls block the calling thread (file I/O): from async code, call them
/// from a blocking-friendly context such as `spawn_blocking`.
#[derive(Clone, Debug)]
pub struct Store {
    engine: Arc<Engine>,
    limits: Limits,
    /// Counters shared by every `IdempotencyKeys` handle of this store.
    idempotency_counters: Arc<crate::idempotency::Counters>,
    /// One outbox per store, so its wake-up subscribers are shared.
    outbox: Outbox,
    /// The index of recent inbox claims, shared by every `Inbox` handle.
    journal: Arc<Journal>,
}

/// Size limits shared by the primitives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub(crate) max_body: usize,
}

/// How to open a [`Store`]. Every setter states its default.
#[derive(Debug, Clone)]
#[must_use]
pub struct StoreBuilder {
    durability: Durability,
    cache_size: usize,
    quick_repair: bool,
    max_batch: usize,
    journal_size: u64,
    flush_interval: Duration,
    max_body: usize,
    shared: bool,
    shared_poll_interval: Duration,
}

impl Default for StoreBuilder {
    fn default() -> Self {
        StoreBuilder {
            durability: Durability::Immediate,
            cache_size: DEFAULT_CACHE_SIZE,
            quick_repair: false,
            max_batch: DEFAULT_MAX_BATCH,
            journal_size: DEFAULT_JOURNAL_SIZE,
            flush_interval: DEFAULT_FLUSH_INTERVAL,
            max_body: DEFAULT_MAX_BODY,
            shared: false,
            shared_poll_interval: DEFAULT_SHARED_POLL_INTERVAL,
        }
    }
}

impl StoreBuilder {
    /// How durable commits are. Default: [`Durability::Immediate`] (every
    /// `Ok` has been fsynced; concurrent calls share fsyncs).
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// Bytes of page cache. Default: 64 MiB — enough to keep the hot part of
    /// a desktop or edge store (inbox tails, the outbox's due index, recent
    /// idempotency keys) in memory, without redb's own default of 1 GiB,
    /// which is too much to reserve in a process that is not a database
    /// server.
    pub fn cache_size(mut self, bytes: usize) -> Self {
        self.cache_size = bytes;
        self
    }

    /// Save the allocator state with every durable commit, so that reopening
    /// after a crash is almost instant instead of a full repair that reads
    /// the whole file (seconds per GiB). Each durable commit then costs
    /// more; with group commit that cost is shared by the batch. Default:
    /// off. The repository's `docs/performance.md` gives the measured trade.
    pub fn quick_repair(mut self, enabled: bool) -> Self {
        self.quick_repair = enabled;
        self
    }

    /// Largest number of queued operations committed in one batch. Default:
    /// 1024. Larger batches share an fsync among more callers; smaller ones
    /// bound the latency of a batch. Under [`Durability::None`], also the
    /// most operations the store's open transaction holds before it is
    /// committed.
    pub fn max_batch(mut self, operations: usize) -> Self {
        self.max_batch = operations.max(1);
        self
    }

    /// How many recent inbox claims a durable store keeps in its journal
    /// before it merges them into the ledger, in the commit of the claim that
    /// fills it. Default: 4096. A claim appends to the journal, which
    /// grows at its end, instead of writing into the middle of the ledger:
    /// under load that is what lets a fsync carry many claims cheaply. A
    /// larger journal makes merges rarer and cheaper per claim, but each
    /// one longer (the batch that merges 4096 claims takes ~10 ms more
    /// here); a smaller one the opposite. Ignored under [`Durability::None`],
    /// whose claims go straight to the ledger.
    pub fn journal_size(mut self, claims: u64) -> Self {
        self.journal_size = claims.max(1);
        self
    }

    /// Under [`Durability::None`], how often dirty state is flushed to disk:
    /// about the most work a crash can lose. Default: 100 ms. Ignored under
    /// [`Durability::Immediate`].
    pub fn flush_interval(mut self, interval: Duration) -> Self {
        self.flush_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// Largest response body or outbox payload accepted, in bytes. Default:
    /// 1 MiB. Larger ones are refused with [`Error::TooLarge`], never
    /// truncated.
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// Whether other processes may open the file at the same time
    /// (`true`), or this one holds it alone (`false`, the default and the
    /// fastest). Every process that opens a shared file must open it
    /// shared; one that opens it otherwise gets [`Error::AlreadyOpen`].
    ///
    /// In a shared store any number of processes read and write the file;
    /// one write transaction runs at a time across all of them, and a
    /// process sees another's commit once it is on disk. Every commit is
    /// durable (a shared file cannot take [`Durability::None`]: asking for
    /// both is [`Error::InvalidInput`]) and costs about twice an exclusive
    /// one, so group commit matters even more: a [`Store::write`] closure
    /// runs in the batch it leads, with the operations queued behind it,
    /// under one fsync. An outbox wakes its dispatchers when another
    /// process enqueues (see [`shared_poll_interval`](Self::shared_poll_interval)).
    /// Needs the operating system's byte-range file locks (Linux, macOS,
    /// Windows); an in-memory store cannot be shared.
    ///
    /// Every guarantee holds across processes: a key is claimed once, an
    /// entry is claimed by one dispatcher at a time, a reservation holds
    /// its key against every process. What is counted, though, is counted
    /// per process: [`Store::commit_stats`], a dispatcher's stats, the
    /// idempotency-key stats and the metrics describe this process's calls.
    /// [`Store::compact`] fails while another process has the file open
    /// for reading; run it when the others are stopped.
    pub fn shared(mut self, shared: bool) -> Self {
        self.shared = shared;
        self
    }

    /// In a [shared](Self::shared) store, how often a thread of the store
    /// (`idemstore-watch`) looks whether another process has committed, so
    /// that an enqueue there wakes this process's dispatchers. Default:
    /// 5 ms; at least 1 ms. Ignored unless shared.
    ///
    /// A dispatcher here sends another process's entry about half the
    /// interval plus a commit later than one enqueued in its own process.
    /// Measured with the `shared_wake` bench on a busy 2-core VM, enqueue to
    /// send: p50 ≈ 12 ms at 5 ms (≈ 16 ms at 10 ms, ≈ 6 ms at 1 ms), against
    /// ≈ 7 ms within one process; p99 follows the machine's load more than
    /// the interval. Without this thread it would wait for the dispatcher's
    /// one-minute safety timer.
    ///
    /// The cost is one timed wake-up and a 320-byte read per interval, and
    /// only while something subscribes to the outbox (a dispatcher): a
    /// process that just enqueues does not look at all. Each wake-up is
    /// tens of µs of CPU on that VM: ≈ 1 % of a core at 5 ms, ≈ 0.5 % at
    /// 10 ms. Choose a longer interval where wake-ups matter more than
    /// latency (on a battery). After a commit of any
    /// process the thread reads two values of the outbox, and wakes the
    /// dispatchers only if that commit enqueued something or made work due
    /// sooner, so idle dispatchers in several processes never keep each
    /// other committing.
    ///
    /// Clamped to between 1 ms and 1 hour (the dispatchers' own safety timer
    /// looks far more often than that anyway).
    pub fn shared_poll_interval(mut self, interval: Duration) -> Self {
        self.shared_poll_interval =
            interval.clamp(Duration::from_millis(1), MAX_SHARED_POLL_INTERVAL);
        self
    }

    /// Opens the store file at `path`, creating it if it does not exist.
    ///
    /// A new file appears at `path` whole: it is made under a temporary
    /// name in the same directory (`.<name>.new-<pid>`) and linked into
    /// place once redb has written it, so a process killed while creating
    /// it leaves no file at `path` (at worst the temporary one, which
    /// nothing reads), never a half-made one that could not be opened
    /// again. Two processes creating the same file at once both end up
    /// with the one that was linked first.
    pub fn open(self, path: impl AsRef<Path>) -> Result<Store> {
        let path = path.as_ref().to_path_buf();
        self.check_settings()?;
        if !path.exists() {
            self.create_whole(&path)?;
        }
        let db = self.create_db(&path, |b| b.create(&path))?;
        self.finish(db, Some(path))
    }

    /// Makes a new store file at `path` under a temporary name, then links
    /// it into place unless another process got there first (see
    /// [`StoreBuilder::open`]).
    fn create_whole(&self, path: &Path) -> Result<()> {
        let name = path
            .file_name()
            .ok_or_else(|| Error::invalid("path", format!("{} names no file", path.display())))?;
        let mut temp_name = std::ffi::OsString::from(".");
        temp_name.push(name);
        temp_name.push(format!(".new-{}", std::process::id()));
        let temp = path.with_file_name(temp_name);
        // A leftover of this process id, from a run killed while creating.
        let _ = std::fs::remove_file(&temp);
        drop(self.create_db(&temp, |b| b.create(&temp))?);
        let linked = match std::fs::hard_link(&temp, path) {
            // A file system without hard links: moved into place instead
            // (a second creator racing this one may then replace it while
            // it is still empty).
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists && !path.exists() => {
                std::fs::rename(&temp, path)
            }
            // Linked, or another process created it first: theirs is used.
            _ => Ok(()),
        };
        let _ = std::fs::remove_file(&temp);
        linked.map_err(Error::Io)?;
        // The new name is durable before the store is used.
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(Error::Io)?;
        }
        Ok(())
    }

    /// Opens a store in memory (redb's in-memory backend): nothing reaches a
    /// disk, everything is gone when the store is dropped.
    pub fn in_memory(self) -> Result<Store> {
        if self.shared {
            return Err(Error::InvalidInput {
                field: "shared",
                reason: "an in-memory store belongs to its process: only a store file can be \
                         shared"
                    .into(),
            });
        }
        self.open_with_backend(redb::backends::InMemoryBackend::new())
    }

    /// Opens a store on a custom redb storage backend (for example one that
    /// injects I/O faults in tests). A [`shared`](Self::shared) store needs
    /// a backend that implements redb's byte-range locks.
    pub fn open_with_backend(self, backend: impl StorageBackend) -> Result<Store> {
        self.check_settings()?;
        let db = self.create_db(Path::new("<backend>"), |b| b.create_with_backend(backend))?;
        self.finish(db, None)
    }

    /// Refuses settings that cannot work together, before the file is
    /// touched.
    fn check_settings(&self) -> Result<()> {
        if self.shared && self.durability == Durability::None {
            return Err(Error::InvalidInput {
                field: "durability",
                reason: "a shared store commits every write durably: Durability::None needs \
                         the file to itself (shared(false))"
                    .into(),
            });
        }
        Ok(())
    }

    /// Opens the redb database with `create`, given redb's builder with
    /// this builder's settings. A file redb cannot read is
    /// [`Error::NotAStore`] (named `path`), including one it panics on.
    fn create_db(
        &self,
        path: &Path,
        create: impl FnOnce(&redb::Builder) -> std::result::Result<redb::Database, redb::DatabaseError>,
    ) -> Result<redb::Database> {
        let mut builder = redb::Database::builder();
        builder.set_cache_size(self.cache_size);
        if self.shared {
            builder.set_concurrency_mode(redb::ConcurrencyMode::MultiWriter);
        }
        let opened = catch_unwind(AssertUnwindSafe(|| create(&builder)));
        open_result(opened, path, self.shared)
    }

    fn finish(self, db: redb::Database, path: Option<PathBuf>) -> Result<Store> {
        let engine = Engine::start(
            db,
            EngineConfig {
                durability: self.durability,
                quick_repair: self.quick_repair,
                max_batch: self.max_batch,
                flush_interval: self.flush_interval,
                shared: self.shared,
            },
            path,
        )?;
        Store::check_format(&engine)?;
        // Durable stores journal their claims; `None` ones write the ledger.
        let merge_at = (self.durability == Durability::Immediate).then_some(self.journal_size);
        let journal = Arc::new(engine.read(|tx| Journal::load(tx, merge_at, self.shared))?);
        if self.shared {
            let journal = journal.clone();
            engine.on_write_begin(move |tx| journal.catch_up_all(tx));
        }
        let engine = Arc::new(engine);
        let mut outbox = Outbox::new(engine.clone(), self.max_body);
        if self.shared {
            // Another process's enqueue wakes this one's dispatchers.
            outbox.watch_other_processes(self.shared_poll_interval)?;
        }
        // A recorder installed before the store opens gets its `# HELP`
        // text and units.
        crate::observe::describe_on_open();
        Ok(Store {
            outbox,
            engine,
            limits: Limits {
                max_body: self.max_body,
            },
            idempotency_counters: Arc::default(),
            journal,
        })
    }
}

fn open_result(
    opened: std::thread::Result<std::result::Result<redb::Database, redb::DatabaseError>>,
    path: &Path,
    shared: bool,
) -> Result<redb::Database> {
    let not_a_store = |reason: String| Error::NotAStore {
        path: path.to_path_buf(),
        reason,
    };
    match opened {
        Ok(Ok(db)) => Ok(db),
        Ok(Err(redb::DatabaseError::DatabaseAlreadyOpen)) => Err(Error::AlreadyOpen {
            path: path.to_path_buf(),
            shared,
        }),
        Ok(Err(redb::DatabaseError::UpgradeRequired(v))) => Err(Error::IncompatibleFormat {
            found: format!("redb file format {v}"),
            supported: FORMAT_VERSION,
        }),
        Ok(Err(redb::DatabaseError::Storage(redb::StorageError::Corrupted(reason)))) => {
            Err(not_a_store(reason))
        }
        Ok(Err(redb::DatabaseError::Storage(redb::StorageError::Io(e))))
            if matches!(
                e.kind(),
                std::io::ErrorKind::InvalidData | std::io::ErrorKind::UnexpectedEof
            ) =>
        {
            Err(not_a_store(e.to_string()))
        }
        Ok(Err(e)) => Err(Error::from(e)),
        Err(panic) => Err(not_a_store(format!(
            "the engine could not read it: {}",
            panic_message(&*panic)
        ))),
    }
}

/// What a file records of its format.
enum Recorded {
    /// No meta table: a new file.
    Nothing,
    /// A meta table without a format version.
    NoVersion,
    /// This format version.
    Version(u64),
}

impl Recorded {
    /// What a meta table holding `version` records.
    fn in_meta(version: Option<u64>) -> Recorded {
        version.map_or(Recorded::NoVersion, Recorded::Version)
    }

    /// `Err` if what the file records is not this build's format; a new
    /// file records nothing to refuse.
    fn check(self) -> Result<()> {
        match self {
            Recorded::Nothing | Recorded::Version(FORMAT_VERSION) => Ok(()),
            Recorded::Version(v) => Err(Error::IncompatibleFormat {
                found: format!("store format {v}"),
                supported: FORMAT_VERSION,
            }),
            Recorded::NoVersion => Err(Error::IncompatibleFormat {
                found: "a meta table without a format version".into(),
                supported: FORMAT_VERSION,
            }),
        }
    }
}

fn recorded_format(tx: &redb::ReadTransaction) -> Result<Recorded> {
    let Some(meta) = open_read(tx, META)? else {
        return Ok(Recorded::Nothing);
    };
    Ok(Recorded::in_meta(
        meta.get(META_FORMAT_VERSION)?.map(|v| v.value()),
    ))
}

/// What a store file holds and how much of it is in use ([`Store::stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StoreStats {
    /// The file's size on disk in bytes (`None` for in-memory and custom
    /// backends).
    pub file_bytes: Option<u64>,
    /// The store format version recorded in the file.
    pub format_version: u64,
    /// Bytes of keys and values stored, without index overhead.
    pub stored_bytes: u64,
    /// Bytes of branch-page keys and other engine metadata.
    pub metadata_bytes: u64,
    /// Bytes allocated but not holding data: what [`Store::compact`] may
    /// return to the file system.
    pub fragmented_bytes: u64,
    /// Pages allocated by the engine.
    pub allocated_pages: u64,
    /// Bytes per page.
    pub page_size: u64,
    /// Deepest B-tree, across all tables.
    pub tree_height: u32,
}

/// Commit counters of a store since it was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct CommitStats {
    /// Write transactions committed, durable or not.
    pub commits: u64,
    /// Durable (fsynced) commits: the fsyncs paid.
    pub durable_commits: u64,
}

impl Store {
    /// Opens (or creates) the store file at `path` with the default settings.
    pub fn open(path: impl AsRef<Path>) -> Result<Store> {
        Store::builder().open(path)
    }

    /// A store in memory, for tests and caches: nothing survives the process.
    pub fn in_memory() -> Result<Store> {
        Store::builder().in_memory()
    }

    /// Settings for opening a store.
    pub fn builder() -> StoreBuilder {
        StoreBuilder::default()
    }

    /// Runs `f` in one write transaction: commits if it returns `Ok`, rolls
    /// back if it returns `Err` or panics (the panic then reaches the caller
    /// and the file is left clean). Returns once the commit is durable.
    ///
    /// Use it to compose the `*_in` calls with your own tables (through the
    /// re-exported [`redb`]) in one atomic commit. `f` runs exactly once, on
    /// the calling thread; concurrent `write`s share fsyncs. Inside `f`, use
    /// only the `*_in` calls with the transaction given: calling the store's
    /// own write methods there returns [`Error::Reentrant`].
    pub fn write<T, E>(
        &self,
        f: impl FnOnce(&redb::WriteTransaction) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<Error>,
    {
        self.engine.write(f)
    }

    /// [`Store::write`] for an async task (feature `tokio`): `f` runs on
    /// tokio's blocking pool while it runs, in its own transaction
    /// committed without fsync, and the task then waits for the durable
    /// commit that covers it without holding a thread. `f` runs exactly
    /// once. Dropped before its first poll, nothing runs; dropped after,
    /// `f` may still run and commit, with nobody told.
    #[cfg(feature = "tokio")]
    pub async fn write_async<T, E, F>(&self, f: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<Error> + Send + 'static,
        F: FnOnce(&redb::WriteTransaction) -> Result<T, E> + Send + 'static,
    {
        self.engine.write_async(f).await
    }

    /// Runs `f` in a read transaction. Under [`Durability::Immediate`] it
    /// returns only once everything `f` could see is durable. Do not keep
    /// read transactions open for long: they pin pages and grow the file.
    pub fn read<T, E>(&self, f: impl FnOnce(&redb::ReadTransaction) -> Result<T, E>) -> Result<T, E>
    where
        E: From<Error>,
    {
        self.engine.read(f)
    }

    /// [`Store::read`] for an async task (feature `tokio`): `f` runs on
    /// the task (a read transaction never waits for a writer), then the
    /// task waits, without holding a thread, until everything `f` could
    /// see is durable.
    #[cfg(feature = "tokio")]
    pub async fn read_async<T, E, F>(&self, f: F) -> Result<T, E>
    where
        E: From<Error>,
        F: FnOnce(&redb::ReadTransaction) -> Result<T, E>,
    {
        self.engine.read_async(f).await
    }

    /// The inbox called `name`: its own namespace of event keys. Names are
    /// 1–64 bytes of ASCII letters, digits, `_`, `-` and `.`.
    pub fn inbox(&self, name: &str) -> Result<Inbox> {
        Inbox::new(self.engine.clone(), self.journal.clone(), name)
    }

    /// The store's outbox. Every call returns a handle to the same outbox
    /// (sharing its wake-up subscribers).
    pub fn outbox(&self) -> Outbox {
        self.outbox.clone()
    }

    /// The store's HTTP idempotency-key records.
    pub fn idempotency_keys(&self) -> IdempotencyKeys {
        IdempotencyKeys::new(self.engine.clone(), self.limits.max_body)
            .with_counters(self.idempotency_counters.clone())
    }

    /// Makes every write so far durable. Under [`Durability::Immediate`]
    /// every `Ok` already is; under [`Durability::None`] this is how to
    /// flush before the interval.
    pub fn sync(&self) -> Result<()> {
        self.engine.sync()
    }

    /// Rewrites the file to return free space to the file system. Waits for
    /// all other calls on this store to finish and blocks them meanwhile.
    /// Returns whether anything was compacted.
    pub fn compact(&self) -> Result<bool> {
        self.engine.exclusive(|db| {
            db.compact(redb::CompactionMode::Balanced)
                .map_err(Error::from)
        })
    }

    /// Runs redb's integrity check over the whole file (checksums of every
    /// page, allocator state). Returns `true` if the file was consistent.
    pub fn check_integrity(&self) -> Result<bool> {
        self.engine
            .exclusive(|db| db.check_integrity().map_err(Error::from))
    }

    /// The durability the store was opened with.
    pub fn durability(&self) -> Durability {
        self.engine.durability()
    }

    /// The store file's path (`None` for in-memory and custom backends).
    pub fn path(&self) -> Option<&Path> {
        self.engine.path()
    }

    /// The engine, for what extends the store in modules of its own
    /// ([`Store::backup`]).
    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Commits made since the store was opened.
    pub fn commit_stats(&self) -> CommitStats {
        let (commits, durable_commits) = self.engine.commit_counts();
        CommitStats {
            commits,
            durable_commits,
        }
    }

    /// The file's size, format version and the engine's space accounting
    /// (stored, metadata and fragmented bytes). Takes the writer for a
    /// moment (redb computes these in a write transaction, which is then
    /// aborted: nothing is written).
    pub fn stats(&self) -> Result<StoreStats> {
        let format_version = match self.engine.read(recorded_format)? {
            Recorded::Version(v) => v,
            Recorded::Nothing | Recorded::NoVersion => 0,
        };
        let s = self.engine.inspect_write(|tx| Ok(tx.stats()?))?;
        let file_bytes = match self.path() {
            Some(p) => Some(std::fs::metadata(p).map_err(Error::Io)?.len()),
            None => None,
        };
        Ok(StoreStats {
            file_bytes,
            format_version,
            stored_bytes: s.stored_bytes(),
            metadata_bytes: s.metadata_bytes(),
            fragmented_bytes: s.fragmented_bytes(),
            allocated_pages: s.allocated_pages(),
            page_size: s.page_size() as u64,
            tree_height: s.tree_height(),
        })
    }

    /// The names of the inboxes that hold at least one key, in name order.
    /// (An inbox is not registered anywhere: one whose keys were all pruned,
    /// or that never claimed one, is not listed.)
    pub fn inbox_names(&self) -> Result<Vec<String>> {
        self.engine.read(crate::inbox::names)
    }

    /// [`Store::inbox_names`], awaited (feature `tokio`).
    #[cfg(feature = "tokio")]
    pub async fn inbox_names_async(&self) -> Result<Vec<String>> {
        self.engine.read_async(crate::inbox::names).await
    }

    /// Checks every inbox's rows against its `seen_at` index and its count:
    /// each `(inbox, key)` row of the ledger has its `(inbox, seen_at, key)`
    /// index row and vice versa, no key is both in the ledger and in the
    /// journal of recent claims (nor twice in either), and each inbox's count
    /// matches its claimed keys. Returns one
    /// human-readable finding per violation, none when consistent. Reads
    /// every inbox row in one read transaction: for tests and offline
    /// checks.
    pub fn check_inbox_indexes(&self) -> Result<Vec<String>> {
        self.engine.read(crate::inbox::check_indexes)
    }

    /// Checks (and on a new file, writes) the format version.
    fn check_format(engine: &Engine) -> Result<()> {
        match engine.read(recorded_format)? {
            Recorded::Nothing => engine.write(|tx| {
                let names: Vec<String> = tx
                    .list_tables()?
                    .map(|t| redb::TableHandle::name(&t).to_owned())
                    .collect();
                if names.iter().any(|n| n == redb::TableHandle::name(&META)) {
                    // Another process sharing the file wrote it since the
                    // read above.
                    let meta = open_write(tx, META)?;
                    return Recorded::in_meta(meta.get(META_FORMAT_VERSION)?.map(|v| v.value()))
                        .check();
                }
                if names.iter().any(|n| n.starts_with("idemstore.")) {
                    return Err(Error::IncompatibleFormat {
                        found: "idemstore tables without a format version".into(),
                        supported: FORMAT_VERSION,
                    });
                }
                open_write(tx, META)?.insert(META_FORMAT_VERSION, FORMAT_VERSION)?;
                Ok(())
            }),
            Recorded::Version(
                found @ (FORMAT_VERSION_BEFORE_DESTINATIONS | FORMAT_VERSION_BEFORE_LISTING),
            ) => engine.write(|tx| {
                // Re-read under the write lock: another process sharing the
                // file may have upgraded it since the read above.
                let version = open_write(tx, META)?
                    .get(META_FORMAT_VERSION)?
                    .map(|v| v.value());
                if version != Some(found) {
                    return Recorded::in_meta(version).check();
                }
                if found == FORMAT_VERSION_BEFORE_DESTINATIONS {
                    // Lists the records by status too.
                    crate::outbox::add_destination_tables(tx)?;
                } else {
                    crate::outbox::list_by_status(tx)?;
                }
                open_write(tx, META)?.insert(META_FORMAT_VERSION, FORMAT_VERSION)?;
                Ok(())
            }),
            found => found.check(),
        }
    }
}
