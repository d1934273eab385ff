//! Test helpers shared by the integration tests.
// Each test binary uses a different part of this module.
#![allow(dead_code, unreachable_pub)]

#[cfg(feature = "tokio")]
#[macro_use]
mod blocking_pool;
#[cfg(feature = "postgres")]
pub mod faulty_net;
#[cfg(feature = "postgres")]
pub mod pg;

use std::io;
use std::ops::Bound;
use std::sync::Arc;

use chrono::{DateTime, TimeZone, Utc};
use idemstore::redb::{BackendError, StorageBackend};
use parking_lot::Mutex;

/// Prints a figure of a reliability suite and adds it to
/// `target/tmp/reliability-report.txt`, which CI prints after the tests (the
/// test harness hides the output of passing tests).
pub fn report(line: &str) {
    use std::io::Write as _;
    println!("{line}");
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("reliability-report.txt");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(f, "{line}");
    }
}

/// Waits (up to 30 s, then fails the test) until `probe` returns a value,
/// and returns it: for what another thread does in its own time.
pub fn eventually_some<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if let Some(value) = probe() {
            return value;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Waits (up to 30 s, then fails the test) until `cond` holds.
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    eventually_some(what, || cond().then_some(()));
}

/// The keys of the caller table `app.effects` (`&str → u64`) that the
/// reliability workloads write beside their claims; empty if it was never
/// created.
pub fn effect_keys(
    store: &idemstore::Store,
) -> idemstore::Result<std::collections::BTreeSet<String>> {
    use idemstore::redb::{ReadableTable as _, TableDefinition};
    const EFFECTS: TableDefinition<&str, u64> = TableDefinition::new("app.effects");
    store.read(|tx| match tx.open_table(EFFECTS) {
        Ok(t) => t
            .iter()?
            .map(|r| {
                r.map(|(k, _)| k.value().to_owned())
                    .map_err(idemstore::Error::from)
            })
            .collect(),
        Err(idemstore::redb::TableError::TableDoesNotExist(_)) => {
            Ok(std::collections::BTreeSet::new())
        }
        Err(e) => Err(e.into()),
    })
}

/// The rows of the outbox's claims index `(claimed_at_micros, id)`, read
/// as a caller can reach them; empty if the table was never written.
pub fn claims_index(store: &idemstore::Store) -> idemstore::Result<Vec<(i64, u64)>> {
    use idemstore::redb::{ReadableTable as _, TableDefinition};
    const CLAIMED: TableDefinition<(i64, u64), ()> =
        TableDefinition::new("idemstore.v1.outbox.claimed");
    store.read(|tx| match tx.open_table(CLAIMED) {
        Ok(t) => t
            .iter()?
            .map(|row| row.map(|(k, _)| k.value()).map_err(idemstore::Error::from))
            .collect(),
        Err(idemstore::redb::TableError::TableDoesNotExist(_)) => Ok(Vec::new()),
        Err(e) => Err(e.into()),
    })
}

/// This test binary, set up to run again as a child process that runs only
/// the ignored test `name`: its stdout piped (where the test harness prints
/// its own words first, on the first line), its stderr dropped. The caller
/// adds the environment that tells the child what to do, then spawns it.
pub fn child_test(name: &str) -> std::process::Command {
    use std::process::Stdio;
    let mut child = std::process::Command::new(std::env::current_exe().expect("the test binary"));
    child
        .args([
            name,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    child
}

/// The environment variable `name`, which a parent test set for the child
/// process it runs.
pub fn env_of(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set by the parent test"))
}

/// Microseconds since the Unix epoch: one clock for every process.
pub fn wall_micros() -> u64 {
    u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros(),
    )
    .unwrap()
}

/// A fixed instant plus `secs` seconds.
pub fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

#[derive(Debug, Default)]
struct Disk {
    /// What the process sees (the page cache).
    live: Vec<u8>,
    /// What survived the last `sync_data` (the platter).
    durable: Vec<u8>,
    syncs: u64,
    writes: u64,
    /// After a power loss every call fails.
    dead: bool,
    /// Lose power when `syncs` reaches this number (before that sync lands).
    lose_power_at_sync: Option<u64>,
    /// Fail the Nth write (1-based) with an I/O error, once.
    fail_write: Option<u64>,
    /// Fail the Nth sync (1-based) with an I/O error, once; nothing reaches the platter.
    fail_sync: Option<u64>,
    /// Panic in the Nth sync (1-based), once; nothing reaches the platter.
    panic_sync: Option<u64>,
    /// Every write and resize since the last `sync_data`, in order: on
    /// their way to the platter, any of them may have landed at a power
    /// loss ([`FaultyDisk::torn_image`]).
    in_flight: Vec<InFlight>,
    /// While held, every sync waits at it before it does anything.
    gate: Arc<Gate>,
}

/// A change since the last `sync_data`, not yet on the platter.
#[derive(Debug, Clone)]
enum InFlight {
    Write { offset: usize, data: Vec<u8> },
    SetLen(usize),
}

/// The unit a disk writes whole: a power loss tears a write at these
/// boundaries, never inside one.
pub const SECTOR: usize = 512;

/// A small deterministic pseudo-random generator (xorshift64*), so that a
/// failing seed can be run again.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        // Never zero, which xorshift cannot leave.
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// `true` with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = usize::try_from(self.below(i as u64 + 1)).unwrap();
            items.swap(i, j);
        }
    }
}

/// Where syncs wait while the gate is held ([`FaultyDisk::hold_syncs`]).
#[derive(Debug, Default)]
struct Gate {
    /// `(held, syncs waiting)`.
    state: Mutex<(bool, u64)>,
    opened: parking_lot::Condvar,
}

impl Gate {
    fn pass(&self) {
        let mut state = self.state.lock();
        state.1 += 1;
        while state.0 {
            self.opened.wait(&mut state);
        }
        state.1 -= 1;
    }
}

/// An in-memory disk that keeps only what was synced when "power is lost",
/// and can fail chosen writes or syncs. Clones share one disk.
#[derive(Debug, Clone, Default)]
pub struct FaultyDisk(Arc<Mutex<Disk>>);

impl FaultyDisk {
    pub fn new() -> Self {
        Self::default()
    }

    /// A disk whose content is `image` (both live and durable).
    pub fn from_image(image: Vec<u8>) -> Self {
        let d = Disk {
            live: image.clone(),
            durable: image,
            ..Disk::default()
        };
        FaultyDisk(Arc::new(Mutex::new(d)))
    }

    pub fn backend(&self) -> FaultyBackend {
        FaultyBackend(self.clone())
    }

    /// Cuts the power now: from here on every call fails, and only what was
    /// synced is on the platter.
    pub fn lose_power(&self) {
        self.0.lock().dead = true;
    }

    pub fn lose_power_at_sync(&self, n: u64) {
        self.0.lock().lose_power_at_sync = Some(n);
    }

    pub fn fail_write(&self, n: u64) {
        self.0.lock().fail_write = Some(n);
    }

    pub fn fail_sync(&self, n: u64) {
        self.0.lock().fail_sync = Some(n);
    }

    /// From now on every sync waits, before it does anything, until
    /// [`FaultyDisk::open_syncs`]: a commit held on its way to the platter.
    pub fn hold_syncs(&self) {
        self.0.lock().gate.state.lock().0 = true;
    }

    /// Lets the syncs held by [`FaultyDisk::hold_syncs`] go on.
    pub fn open_syncs(&self) {
        let gate = self.0.lock().gate.clone();
        gate.state.lock().0 = false;
        gate.opened.notify_all();
    }

    /// How many syncs wait at the gate now.
    pub fn syncs_held(&self) -> u64 {
        self.0.lock().gate.state.lock().1
    }

    /// Makes the Nth sync (1-based) panic, once: a backend bug.
    pub fn panic_at_sync(&self, n: u64) {
        self.0.lock().panic_sync = Some(n);
    }

    pub fn syncs(&self) -> u64 {
        self.0.lock().syncs
    }

    pub fn writes(&self) -> u64 {
        self.0.lock().writes
    }

    pub fn is_dead(&self) -> bool {
        self.0.lock().dead
    }

    /// What the process saw: every write, synced or not (a crash of the
    /// process alone, with the operating system's cache intact).
    pub fn live_image(&self) -> Vec<u8> {
        self.0.lock().live.clone()
    }

    /// The platter after a power loss: what was synced.
    pub fn durable_image(&self) -> Vec<u8> {
        self.0.lock().durable.clone()
    }

    /// How many writes and resizes were in flight (made since the last
    /// sync) when the power went.
    pub fn in_flight(&self) -> usize {
        self.0.lock().in_flight.len()
    }

    /// The platter after a power loss that tears and reorders: what was
    /// synced, plus any subset of the writes and resizes in flight, landed
    /// in any order, each write torn at sector boundaries (each of its
    /// sectors landed or not on its own). Where writes in flight overlap,
    /// a sector holds what any one of them put there, as a disk that
    /// wrote back an older copy of the page and never the newer one.
    /// `seed` picks the subset: 0 lands nothing, 1 lands everything in
    /// order, any other a pseudo-random tearing whose density the seed
    /// also picks.
    pub fn torn_image(&self, seed: u64) -> Vec<u8> {
        let d = self.0.lock();
        let mut image = d.durable.clone();
        let mut order: Vec<usize> = (0..d.in_flight.len()).collect();
        let mut rng = Rng::new(seed);
        let percent = match seed {
            0 => 0,
            1 => 100,
            _ => {
                rng.shuffle(&mut order);
                [10, 50, 90][usize::try_from(seed % 3).unwrap()]
            }
        };
        for i in order {
            match &d.in_flight[i] {
                InFlight::SetLen(len) => {
                    if rng.chance(percent) {
                        image.resize(*len, 0);
                    }
                }
                InFlight::Write { offset, data } => {
                    let end = offset + data.len();
                    let mut at = *offset;
                    while at < end {
                        let to = ((at / SECTOR + 1) * SECTOR).min(end);
                        if rng.chance(percent) {
                            if image.len() < to {
                                image.resize(to, 0);
                            }
                            image[at..to].copy_from_slice(&data[at - offset..to - offset]);
                        }
                        at = to;
                    }
                }
            }
        }
        image
    }
}

/// The [`StorageBackend`] view of a [`FaultyDisk`].
#[derive(Debug)]
pub struct FaultyBackend(FaultyDisk);

fn power_lost() -> io::Error {
    io::Error::other("power lost")
}

impl StorageBackend for FaultyBackend {
    fn len(&self) -> Result<u64, BackendError> {
        let d = self.0.0.lock();
        if d.dead {
            return Err(power_lost().into());
        }
        Ok(d.live.len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BackendError> {
        let d = self.0.0.lock();
        if d.dead {
            return Err(power_lost().into());
        }
        let start = usize::try_from(offset).unwrap();
        let end = start + out.len();
        if end > d.live.len() {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read past end").into());
        }
        out.copy_from_slice(&d.live[start..end]);
        Ok(())
    }

    fn set_len(&self, len: u64) -> Result<(), BackendError> {
        let mut d = self.0.0.lock();
        if d.dead {
            return Err(power_lost().into());
        }
        let len = usize::try_from(len).unwrap();
        d.live.resize(len, 0);
        d.in_flight.push(InFlight::SetLen(len));
        Ok(())
    }

    fn sync_data(&self) -> Result<(), BackendError> {
        // Outside the disk's lock: reads and writes go on meanwhile.
        let gate = self.0.0.lock().gate.clone();
        gate.pass();
        let mut d = self.0.0.lock();
        if d.dead {
            return Err(power_lost().into());
        }
        let n = d.syncs + 1;
        if d.lose_power_at_sync == Some(n) {
            d.dead = true;
            return Err(power_lost().into());
        }
        if d.fail_sync == Some(n) {
            d.fail_sync = None;
            d.syncs = n;
            return Err(io::Error::other("injected sync failure").into());
        }
        if d.panic_sync == Some(n) {
            d.panic_sync = None;
            d.syncs = n;
            drop(d);
            panic!("injected panic in sync_data");
        }
        d.syncs = n;
        let d = &mut *d;
        d.durable.clone_from(&d.live);
        d.in_flight.clear();
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        let mut d = self.0.0.lock();
        if d.dead {
            return Err(power_lost().into());
        }
        let n = d.writes + 1;
        d.writes = n;
        if d.fail_write == Some(n) {
            d.fail_write = None;
            return Err(io::Error::other("injected write failure").into());
        }
        let start = usize::try_from(offset).unwrap();
        let end = start + data.len();
        if end > d.live.len() {
            d.live.resize(end, 0);
        }
        d.live[start..end].copy_from_slice(data);
        d.in_flight.push(InFlight::Write {
            offset: start,
            data: data.to_vec(),
        });
        Ok(())
    }

    // The byte-range locks of a store shared between processes: the disk
    // has one user, whose own locks never conflict (as one open file's
    // locks do not), so each is granted at once.
    fn try_lock_range(&self, _: Bound<u64>, _: Bound<u64>) -> Result<bool, BackendError> {
        Ok(true)
    }

    fn try_lock_shared_range(&self, _: Bound<u64>, _: Bound<u64>) -> Result<bool, BackendError> {
        Ok(true)
    }

    fn lock_range(&self, _: Bound<u64>, _: Bound<u64>) -> Result<(), BackendError> {
        Ok(())
    }

    fn lock_shared_range(&self, _: Bound<u64>, _: Bound<u64>) -> Result<(), BackendError> {
        Ok(())
    }

    fn unlock_range(&self, _: Bound<u64>, _: Bound<u64>) -> Result<(), BackendError> {
        Ok(())
    }

    fn query_lock_range(&self, _: Bound<u64>, _: Bound<u64>) -> Result<bool, BackendError> {
        Ok(false)
    }
}

/// Runs `fut` to its end on this thread, parking it while the future
/// waits: an executor that is not tokio, with no runtime around.
pub fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}
