//! Wake-ups across processes sharing one store file: an entry another
//! process enqueues wakes an idle dispatcher (threads and async) at once,
//! not at its one-minute safety timer; idle dispatchers in two processes do
//! not keep each other committing; the watching thread ends with the last
//! handle.
//!
//! Two stores opened shared on one file in one process behave as two
//! processes (the engine's locks belong to each open file), which keeps
//! these tests fast.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use common::{eventually, eventually_some};
use idemstore::{Delivery, Dispatcher, NewEntry, OutboxId, OutboxStatus, Result, Store};
use parking_lot::Mutex;

/// The tests count the process's threads by name: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Far below the dispatcher's idle timer (a minute), far above a wake-up
/// (milliseconds) on a busy machine.
const PROMPTLY: Duration = Duration::from_secs(5);

fn shared(path: &std::path::Path) -> Result<Store> {
    Store::builder().shared(true).open(path)
}

fn entry(i: usize) -> NewEntry {
    NewEntry::new(
        format!("cmd-{i}"),
        "remote",
        format!("key-{i}"),
        i.to_string().into_bytes(),
    )
}

/// Ids sent so far, as a dispatcher's `send` records them.
type Sent = Arc<Mutex<Vec<OutboxId>>>;

fn completed(store: &Store, id: OutboxId) -> bool {
    store
        .outbox()
        .get(id)
        .is_ok_and(|r| r.entry.status == OutboxStatus::Completed)
}

/// Enqueues five entries on `a`, one at a time, each once the last one is
/// settled (so the dispatcher is idle, waiting), alternately alone and in a
/// caller transaction; each must be sent promptly.
fn five_prompt_deliveries(a: &Store, sent: &Sent) -> Result<()> {
    for i in 0..5 {
        let enqueued = Instant::now();
        let id = if i % 2 == 0 {
            a.outbox().enqueue(entry(i), Utc::now())?.id()
        } else {
            a.write(|tx| a.outbox().enqueue_in(tx, entry(i), Utc::now()))?
                .id()
        };
        eventually("the other store's dispatcher sends the entry", || {
            sent.lock().contains(&id)
        });
        let took = enqueued.elapsed();
        assert!(
            took < PROMPTLY,
            "entry {i} waited {took:?}: the enqueue in the other store did not wake the dispatcher"
        );
        eventually("the send is settled", || completed(a, id));
    }
    Ok(())
}

#[test]
fn another_stores_enqueue_wakes_an_idle_thread_dispatcher() -> Result<()> {
    let _serial = SERIAL.lock();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.redb");
    let a = shared(&path)?;
    let b = shared(&path)?;
    let sent: Sent = Arc::default();
    let record = sent.clone();
    let handle = Dispatcher::builder(b.outbox()).workers(1).start(move |e| {
        record.lock().push(e.id);
        Delivery::Delivered
    })?;
    five_prompt_deliveries(&a, &sent)?;
    handle.shutdown()?;
    Ok(())
}

#[cfg(feature = "tokio")]
#[test]
fn another_stores_enqueue_wakes_an_idle_async_dispatcher() -> Result<()> {
    let _serial = SERIAL.lock();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.redb");
    let a = shared(&path)?;
    let b = shared(&path)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(idemstore::Error::Io)?;
    let sent: Sent = Arc::default();
    let record = sent.clone();
    let handle = {
        let _runtime = runtime.enter();
        Dispatcher::builder(b.outbox())
            .workers(1)
            .start_async(move |e| {
                record.lock().push(e.id);
                async { Delivery::Delivered }
            })?
    };
    five_prompt_deliveries(&a, &sent)?;
    runtime.block_on(handle.shutdown())?;
    Ok(())
}

#[test]
fn idle_dispatchers_sharing_a_file_do_not_wake_each_other() -> Result<()> {
    let _serial = SERIAL.lock();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.redb");
    let a = shared(&path)?;
    let b = shared(&path)?;
    let start = |store: &Store| {
        Dispatcher::builder(store.outbox())
            .workers(2)
            .start(|_| Delivery::Delivered)
    };
    let (on_a, on_b) = (start(&a)?, start(&b)?);
    // Some work first, so that both sides have been woken and have claimed.
    let id = a.outbox().enqueue(entry(1), Utc::now())?.id();
    eventually("the entry is delivered", || completed(&a, id));
    let commits = || a.commit_stats().commits + b.commit_stats().commits;
    // The claims the enqueue's wake-ups set off end within milliseconds.
    let quiet = eventually_some("the dispatchers go idle (no commit for 50 ms)", || {
        let before = commits();
        std::thread::sleep(Duration::from_millis(50));
        (commits() == before).then_some(before)
    });
    // Were every commit a wake-up, each side's empty claims would wake the
    // other's workers, whose claims would wake the first … at fsync rate.
    std::thread::sleep(Duration::from_millis(500));
    let idle_commits = commits() - quiet;
    assert!(
        idle_commits <= 2,
        "{idle_commits} commits in 0.5 s of idleness"
    );
    on_a.shutdown()?;
    on_b.shutdown()?;
    Ok(())
}

/// How many threads of this process are named `idemstore-watch`.
#[cfg(target_os = "linux")]
fn watch_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim_end() == "idemstore-watch")
        .count()
}

/// Waits until `n` threads of this process are named `idemstore-watch`
/// (a thread names itself once it runs, and leaves the process's list
/// just after its join returns).
#[cfg(target_os = "linux")]
fn watch_threads_become(n: usize, what: &str) {
    eventually(what, || watch_threads() == n);
}

#[cfg(target_os = "linux")]
#[test]
fn the_watching_thread_ends_with_the_last_handle() -> Result<()> {
    let _serial = SERIAL.lock();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.redb");
    let alone = Store::open(dir.path().join("alone.redb"))?;
    let a = shared(&path)?;
    let b = shared(&path)?;
    watch_threads_become(2, "one thread per shared store, none for the other");
    drop(alone);
    // An outbox handle (a dispatcher's) keeps its store's thread.
    let outbox = a.outbox();
    drop(a);
    assert_eq!(watch_threads(), 2);
    drop(outbox);
    watch_threads_become(1, "the first store's thread ends with its last handle");
    drop(b);
    // Its thread was joined: nothing holds the file any more, which opens
    // for one process at once.
    let exclusive = Store::open(&path)?;
    watch_threads_become(0, "no thread is left");
    drop(exclusive);
    Ok(())
}

/// How many times the threads named `idemstore-watch` have woken
/// (voluntary context switches: each timed wait is one).
#[cfg(target_os = "linux")]
fn watch_wake_ups() -> u64 {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| {
            let dir = task.ok()?.path();
            let name = std::fs::read_to_string(dir.join("comm")).ok()?;
            if name.trim_end() != "idemstore-watch" {
                return None;
            }
            let status = std::fs::read_to_string(dir.join("status")).ok()?;
            status
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?
                .trim()
                .parse::<u64>()
                .ok()
        })
        .sum()
}

#[cfg(target_os = "linux")]
#[test]
fn a_store_nobody_subscribes_to_does_not_look_at_the_file() -> Result<()> {
    let _serial = SERIAL.lock();
    let dir = tempfile::tempdir().unwrap();
    let store = Store::builder()
        .shared(true)
        .shared_poll_interval(Duration::from_millis(2))
        .open(dir.path().join("shared.redb"))?;
    watch_threads_become(1, "the store's thread runs");
    let wake_ups_over = |window| {
        let before = watch_wake_ups();
        std::thread::sleep(window);
        watch_wake_ups() - before
    };
    // A process that only enqueues: nobody to wake, no looking.
    let idle = wake_ups_over(Duration::from_millis(200));
    assert!(idle <= 2, "{idle} wake-ups with nobody subscribed");
    // A dispatcher subscribes: every 2 ms now.
    let subscription = store.outbox().subscribe();
    let polling = wake_ups_over(Duration::from_millis(200));
    assert!(polling >= 20, "{polling} wake-ups with a subscriber");
    drop(subscription);
    Ok(())
}
