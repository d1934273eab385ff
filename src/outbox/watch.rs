//! Wake-ups from other processes. In a store shared between processes
//! (`StoreBuilder::shared`), the outbox's [`Notifier`] hears only this
//! process's commits; a [`Watch`] thread hears the others' and feeds the
//! same notifier, so blocking and async dispatchers wake alike.
//!
//! # How
//!
//! Every commit, of any process, rewrites the file's first 320 bytes (the
//! engine's header). Every `poll_interval` the thread reads them with one
//! positioned read on a file handle of its own (no lock, no transaction).
//! Unchanged: nothing more. Changed: it opens a read transaction and reads
//! two values of the outbox, its next id (`outbox.next_id` in the meta
//! table) and its earliest due time (when the next entry may be claimed:
//! the front of the destinations' ready line), and signals the
//! subscribers only if
//!
//! - the next id grew (an entry was enqueued), or
//! - the earliest due time moved earlier, or appeared (a retry, a
//!   reschedule, a requeue or a released claim due sooner than anything
//!   before; a slot freed under a destination's cap, a circuit closed, a
//!   resumed destination, the next entry of an ordering sequence).
//!
//! The gate is what keeps idle processes quiet. A woken worker claims,
//! and a claim is a commit even when it finds nothing; were every commit a
//! signal, each process's empty claims would wake the others' workers,
//! whose empty claims would wake the first ones' … at fsync rate, forever.
//! A claim, a completion or a final failure never moves the next id or the
//! earliest due time earlier, so it wakes nobody. The gate compares with
//! the last look only: a change it holds back although a dispatcher would
//! want it (between two looks, the earliest entry claimed and put back due
//! later than before, yet sooner than the due time that dispatcher read
//! since) is picked up at that due time, as it would be without this
//! thread, or by the other process's own dispatcher.
//!
//! While nobody subscribes (a process that enqueues but runs no
//! dispatcher), the thread parks instead: such a process pays nothing. The
//! first subscription unparks it; its first look then compares with the
//! values it last saw, so a change made meanwhile signals the new
//! subscriber at most once more than needed.
//!
//! # What the header is trusted for
//!
//! Only as a hint of "something changed": correctness never depends on
//! it. The one detail of the engine's format used is the flag it sets
//! while a commit is on its way to disk (bit 3 of byte 9, `PRIMARY_UNFLUSHED`
//! in redb 4.6's `header.rs`): no process can see that commit yet, so the
//! thread looks again at its next tick instead of reading state that does
//! not show it. Should a later format move the flag, the thread reads one
//! commit early and sees the commit at the next header change instead, or
//! a dispatcher's own timer does.
//!
//! # Invariants
//!
//! - The values last seen are taken before the store is handed out, so an
//!   entry committed after `open` returns is always news to the thread, and
//!   one committed before is there for a dispatcher's first claim.
//! - A header is recorded as seen only once its outbox values were read:
//!   a tick that fails looks again at the next one.
//! - A failure (I/O, a read transaction) never ends the thread: it is
//!   reported once per run of failures, and the thread backs off (doubling
//!   from 100 ms to 5 s) and carries on.
//! - The thread holds the engine and the notifier, never an [`Outbox`]
//!   handle. The last handle's drop stops it and joins it: the thread
//!   leaves its wait at once and the file is closed when that drop returns.
//!
//! [`Outbox`]: super::Outbox

use std::fs::File;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use redb::ReadTransaction;

use super::Notifier;
use super::index::{next_id, open_read};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::observe;
use crate::schema::META;

/// Bytes of the engine's file header that every commit rewrites.
const HEADER_LEN: usize = 320;
/// Offset of the header's flags byte.
const FLAGS_BYTE: usize = 9;
/// Flag set while the newest commit is not yet on disk (and not yet
/// visible to any reader).
const PRIMARY_UNFLUSHED: u8 = 8;
/// First wait after a failure.
const BACK_OFF_MIN: Duration = Duration::from_millis(100);
/// Longest wait between two tries while failing.
const BACK_OFF_MAX: Duration = Duration::from_secs(5);
/// What a failure is reported as (`during`).
const DURING: &str = "watch";
/// The thread's name (15 bytes: Linux keeps no more).
const THREAD_NAME: &str = "idemstore-watch";

/// The thread that hears other processes' commits. Dropping it stops the
/// thread and waits for it (at most one look at the file).
#[derive(Debug)]
pub(super) struct Watch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watch {
    /// Starts watching the file at `path` every `interval`, signalling
    /// `notifier`. Reads the outbox values to compare with first.
    pub(super) fn start(
        engine: Arc<Engine>,
        notifier: Arc<Notifier>,
        path: &Path,
        interval: Duration,
    ) -> Result<Watch> {
        let file = File::open(path).map_err(Error::Io)?;
        let mut poller = Poller {
            engine,
            notifier,
            file,
            header: [0; HEADER_LEN],
            seen: Seen::default(),
        };
        // The header first: a commit between the two reads is then both in
        // the values and seen again (harmlessly) at the next tick.
        let header = poller.read_header()?;
        poller.seen = poller.engine.read(Seen::read)?;
        if !unflushed(&header) {
            poller.header = header;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name(THREAD_NAME.into())
            .spawn(move || poller.run(&stopped, interval))
            .map_err(Error::Io)?;
        Ok(Watch {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            // Ends the thread's wait at once.
            thread.thread().unpark();
            // The thread holds no handle that could drop this one, but never
            // join oneself.
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

/// The outbox values that tell whether work may be due sooner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Seen {
    /// The next id to hand out: grows with every enqueue.
    next_id: u64,
    /// When the next entry may be claimed (micros): the front of the
    /// destinations' ready line, if any.
    earliest_due: Option<i64>,
    /// The earliest next slot of a schedule (micros; the smallest for one
    /// not started), if any.
    next_slot: Option<i64>,
}

impl Seen {
    fn read(tx: &ReadTransaction) -> Result<Seen> {
        let next_id = match open_read(tx, META)? {
            Some(meta) => next_id(&meta)?,
            None => 1,
        };
        let earliest_due = super::flow::first_ready(tx)?;
        Ok(Seen {
            next_id,
            earliest_due,
            next_slot: super::schedules::next_slot(tx)?,
        })
    }

    /// Whether going from `self` to `now` may have made work due sooner: an
    /// enqueue, or an earliest due time or schedule slot that moved earlier
    /// or appeared (a schedule set or resumed).
    fn wakes(self, now: Seen) -> bool {
        let sooner = |before: Option<i64>, now: Option<i64>| match (before, now) {
            (Some(before), Some(now)) => now < before,
            (None, Some(_)) => true,
            (_, None) => false,
        };
        now.next_id > self.next_id
            || sooner(self.earliest_due, now.earliest_due)
            || sooner(self.next_slot, now.next_slot)
    }
}

/// Waits `wait`, unless `stop` is set first (the thread is then unparked);
/// returns whether to go on. A wait too long for the clock to reach
/// (`Duration::MAX`) lasts until `stop`. (Parking costs the least of the
/// timed waits: this wait is most of what an idle store spends.)
fn pause(stop: &AtomicBool, wait: Duration) -> bool {
    let deadline = Instant::now().checked_add(wait);
    loop {
        if stop.load(Ordering::Acquire) {
            return false;
        }
        match deadline {
            Some(deadline) => {
                let now = Instant::now();
                if now >= deadline {
                    return true;
                }
                std::thread::park_timeout(deadline - now);
            }
            None => std::thread::park(),
        }
    }
}

/// Parks until someone subscribes to `notifier` (`true`) or `stop` is set
/// (`false`). The notifier unparks this thread at each subscription.
fn await_subscriber(stop: &AtomicBool, notifier: &Notifier) -> bool {
    loop {
        if stop.load(Ordering::Acquire) {
            return false;
        }
        if notifier.has_subscribers() {
            return true;
        }
        std::thread::park();
    }
}

/// Whether `header` shows a commit still on its way to disk.
fn unflushed(header: &[u8; HEADER_LEN]) -> bool {
    header[FLAGS_BYTE] & PRIMARY_UNFLUSHED != 0
}

/// The watching thread's state.
struct Poller {
    engine: Arc<Engine>,
    notifier: Arc<Notifier>,
    file: File,
    /// The last header whose commit was looked at (zeros: none).
    header: [u8; HEADER_LEN],
    /// The outbox values at that commit.
    seen: Seen,
}

impl Poller {
    /// Looks every `interval` until `stop` is set.
    fn run(mut self, stop: &AtomicBool, interval: Duration) {
        self.notifier.unpark_on_subscribe();
        let mut wait = interval;
        let mut failing = false;
        while pause(stop, wait) {
            if !self.notifier.has_subscribers() && !await_subscriber(stop, &self.notifier) {
                return;
            }
            let looked = catch_unwind(AssertUnwindSafe(|| self.tick()))
                .unwrap_or_else(|panic| Err(Error::panicked("watching the store file", &*panic)));
            match looked {
                Ok(()) => {
                    failing = false;
                    wait = interval;
                }
                Err(e) => {
                    if !failing {
                        observe::store_error(DURING, &e);
                    }
                    failing = true;
                    wait = wait.saturating_mul(2).clamp(BACK_OFF_MIN, BACK_OFF_MAX);
                }
            }
        }
    }

    /// One look: signals the subscribers if another commit may have made
    /// work due sooner.
    fn tick(&mut self) -> Result<()> {
        let header = match self.read_header() {
            Ok(header) => header,
            // Windows locks the header's bytes while a commit writes them:
            // that commit is for the next look.
            Err(e) if header_locked(&e) => return Ok(()),
            Err(e) => return Err(e),
        };
        if header == self.header || unflushed(&header) {
            return Ok(());
        }
        let now = self.engine.read(Seen::read)?;
        self.header = header;
        if self.seen.wakes(now) {
            self.notifier.notify();
        }
        self.seen = now;
        Ok(())
    }

    fn read_header(&self) -> Result<[u8; HEADER_LEN]> {
        let mut header = [0; HEADER_LEN];
        read_at_start(&self.file, &mut header).map_err(Error::Io)?;
        Ok(header)
    }
}

#[cfg(unix)]
fn read_at_start(file: &File, buf: &mut [u8]) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, 0)
}

#[cfg(windows)]
fn read_at_start(file: &File, buf: &mut [u8]) -> std::io::Result<()> {
    let mut rest = buf;
    let mut offset = 0;
    while !rest.is_empty() {
        match std::os::windows::fs::FileExt::seek_read(file, rest, offset)? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => {
                rest = std::mem::take(&mut rest).get_mut(n..).unwrap_or_default();
                offset += n as u64;
            }
        }
    }
    Ok(())
}

#[cfg(not(any(unix, windows)))]
fn read_at_start(_: &File, _: &mut [u8]) -> std::io::Result<()> {
    // Shared stores need byte-range locks, which only Unix and Windows have.
    Err(std::io::ErrorKind::Unsupported.into())
}

/// Whether a read failed only because a commit holds the header's bytes
/// (Windows' mandatory locks: `ERROR_LOCK_VIOLATION`).
fn header_locked(e: &Error) -> bool {
    cfg!(windows) && matches!(e, Error::Io(io) if io.raw_os_error() == Some(33))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(next_id: u64, earliest_due: Option<i64>) -> Seen {
        Seen {
            next_id,
            earliest_due,
            next_slot: None,
        }
    }

    #[test]
    fn only_an_enqueue_or_an_earlier_due_time_wakes() {
        let before = seen(5, Some(100));
        assert!(before.wakes(seen(6, Some(100))), "an enqueue");
        assert!(before.wakes(seen(6, None)), "an enqueue, claimed at once");
        assert!(before.wakes(seen(5, Some(99))), "a retry due sooner");
        assert!(seen(5, None).wakes(seen(5, Some(500))), "work due again");
        assert!(!before.wakes(before), "a commit that changed neither");
        assert!(!before.wakes(seen(5, Some(101))), "a claim");
        assert!(
            !before.wakes(seen(5, None)),
            "the last pending entry claimed"
        );
        assert!(!seen(5, None).wakes(seen(5, None)));
        let slot = |next_slot| Seen {
            next_slot,
            ..seen(5, None)
        };
        assert!(slot(None).wakes(slot(Some(i64::MIN))), "a schedule set");
        assert!(slot(Some(900)).wakes(slot(Some(800))), "one due sooner");
        assert!(!slot(Some(800)).wakes(slot(Some(900))), "a slot fired");
    }

    /// A poller on a shared store whose own file handle cannot be read (a
    /// directory's), signalling a notifier of its own.
    fn failing_poller(dir: &Path) -> (Poller, crate::Store) {
        let store = crate::Store::builder()
            .shared(true)
            .open(dir.join("shared.redb"))
            .unwrap();
        let poller = Poller {
            engine: store.outbox().engine.clone(),
            notifier: Arc::default(),
            file: File::open(dir).unwrap(),
            header: [0; HEADER_LEN],
            seen: Seen::default(),
        };
        (poller, store)
    }

    #[test]
    fn a_look_that_cannot_read_the_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let (mut poller, _store) = failing_poller(dir.path());
        assert!(matches!(poller.tick(), Err(Error::Io(_))));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_failing_thread_backs_off_and_stops_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let (poller, _store) = failing_poller(dir.path());
        let _subscriber = poller.notifier.subscribe();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("idemstore-wtest".into())
            .spawn(move || poller.run(&stopped, Duration::from_millis(1)))
            .unwrap();
        std::thread::sleep(Duration::from_millis(400));
        // Waits of 100, 200, 400 ms … instead of one every millisecond.
        let wake_ups = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|task| {
                let dir = task.ok()?.path();
                let name = std::fs::read_to_string(dir.join("comm")).ok()?;
                let status = std::fs::read_to_string(dir.join("status")).ok()?;
                (name.trim_end() == "idemstore-wtest").then_some(status)
            })
            .find_map(|status| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .unwrap();
        assert!(wake_ups <= 10, "{wake_ups} wake-ups in 0.4 s while failing");
        stop.store(true, Ordering::Release);
        thread.thread().unpark();
        thread.join().unwrap();
    }

    #[test]
    fn a_wait_too_long_for_the_clock_lasts_until_stopped() {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let waiter = std::thread::spawn(move || pause(&stopped, Duration::MAX));
        stop.store(true, Ordering::Release);
        waiter.thread().unpark();
        assert_eq!(
            waiter.join().ok(),
            Some(false),
            "the wait ended when stopped"
        );
    }

    #[test]
    fn a_commit_on_its_way_to_disk_is_left_for_the_next_look() {
        let mut header = [0; HEADER_LEN];
        assert!(!unflushed(&header));
        header[FLAGS_BYTE] = PRIMARY_UNFLUSHED | 1;
        assert!(unflushed(&header));
    }
}
