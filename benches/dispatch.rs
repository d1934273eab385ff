//! The dispatcher end to end, beside the same cycle hand-rolled on SQLite.
//!
//! `cargo bench -p idemstore-benches --bench dispatch` prints, from one run:
//! - enqueue → `send` latency (p50, p99) for entries enqueued one at a time
//!   into an idle dispatcher: idemstore wakes its workers on commit (the
//!   thread dispatcher and the async one, `start_async` on a multi-thread
//!   tokio runtime); the SQLite queue polls every millisecond, as such
//!   queues do;
//! - end-to-end durable throughput: producers enqueue, 4 workers claim, send
//!   (a no-op) and complete, every step durable;
//! - draining a 20k backlog with sends that wait 1 ms (a thread sleeps, a
//!   task awaits a timer): the async dispatcher with the thread one's
//!   `workers`, and with `workers` far above the runtime's thread count.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::Utc;
use idemstore::{Delivery, Dispatcher, NewEntry, Outbox, Store};
use parking_lot::Mutex;
use rusqlite::{Connection, params};

const LATENCY_SAMPLES: usize = 400;
const THROUGHPUT_ENTRIES: u64 = 19_200; // a multiple of PRODUCERS × 100
const PRODUCERS: usize = 16;
const WORKERS: usize = 4;
/// The backlog drained with 1 ms sends.
const SLOW_ENTRIES: u64 = 20_000;
/// What each of those sends waits.
const SEND_TIME: Duration = Duration::from_millis(1);
/// Async sends in flight far above the runtime's threads.
const MANY_WORKERS: usize = 64;

fn main() {
    // `cargo bench` passes `--bench`; a plain run takes no arguments either.
    let dir = tempfile::tempdir().expect("temp dir");
    println!("dispatcher, one run, durable (fsync) everywhere\n");

    let ours = idemstore_latency(dir.path());
    let tasks = idemstore_async_latency(dir.path());
    let theirs = sqlite_latency(dir.path());
    println!(
        "enqueue -> send latency, {LATENCY_SAMPLES} entries one at a time into an idle queue:"
    );
    println!(
        "  idemstore threads (wake on commit): p50 {:>7.3} ms   p99 {:>7.3} ms",
        ms(ours.0),
        ms(ours.1)
    );
    println!(
        "  idemstore tasks (start_async):      p50 {:>7.3} ms   p99 {:>7.3} ms   p50 vs threads {:.2}x",
        ms(tasks.0),
        ms(tasks.1),
        ms(tasks.0) / ms(ours.0)
    );
    println!(
        "  SQLite (1 ms poll):                 p50 {:>7.3} ms   p99 {:>7.3} ms",
        ms(theirs.0),
        ms(theirs.1)
    );

    let threads = idemstore_slow_drain(dir.path(), WORKERS);
    let timer_threads = idemstore_timer_drain(dir.path(), WORKERS);
    let tasks = idemstore_async_slow_drain(dir.path(), WORKERS);
    let many_tasks = idemstore_async_slow_drain(dir.path(), MANY_WORKERS);
    let many_threads = idemstore_slow_drain(dir.path(), MANY_WORKERS);
    let theirs = sqlite_slow_drain(dir.path());
    let threads_per_runtime = std::thread::available_parallelism().map_or(1, usize::from);
    println!(
        "\ndraining a backlog of {SLOW_ENTRIES} entries, each send waiting {} ms (threads sleep; tasks await a tokio timer on {threads_per_runtime} runtime threads), batches of 64:",
        ms(SEND_TIME)
    );
    println!("  idemstore threads, {WORKERS:>2} workers: {threads:>9.0} entries/s");
    println!(
        "  idemstore threads, {WORKERS:>2} workers, sends on the tasks' tokio timer: {timer_threads:>9.0} entries/s   tasks vs these: {:.2}x",
        tasks / timer_threads
    );
    println!(
        "  idemstore tasks,   {WORKERS:>2} workers: {tasks:>9.0} entries/s   vs threads, same workers: {:.2}x",
        tasks / threads
    );
    println!(
        "  idemstore tasks,   {MANY_WORKERS:>2} workers: {many_tasks:>9.0} entries/s   vs threads, {WORKERS} workers: {:.2}x",
        many_tasks / threads
    );
    println!(
        "  idemstore threads, {MANY_WORKERS:>2} workers: {many_threads:>9.0} entries/s   tasks vs threads, {MANY_WORKERS} each: {:.2}x",
        many_tasks / many_threads
    );
    println!(
        "  SQLite queue,      {WORKERS:>2} workers: {theirs:>9.0} entries/s   tasks ({WORKERS} workers) vs SQLite: {:.2}x",
        tasks / theirs
    );

    let ours = idemstore_throughput(dir.path(), 1);
    let theirs = sqlite_throughput(dir.path(), 1);
    side_by_side(
        &format!(
            "\nend to end, {THROUGHPUT_ENTRIES} entries, {PRODUCERS} producers (one enqueue per call), {WORKERS} workers:"
        ),
        ours,
        theirs,
    );

    let ours = idemstore_drain(dir.path());
    let theirs = sqlite_drain(dir.path());
    side_by_side(
        &format!(
            "\ndraining a backlog of {THROUGHPUT_ENTRIES} entries, {WORKERS} workers (claim, send, complete):"
        ),
        ours,
        theirs,
    );

    let ours = idemstore_throughput(dir.path(), 100);
    let theirs = sqlite_throughput(dir.path(), 100);
    side_by_side(
        &format!(
            "\nend to end, {THROUGHPUT_ENTRIES} entries, {PRODUCERS} producers enqueuing 100 entries per commit, {WORKERS} workers:"
        ),
        ours,
        theirs,
    );
}

/// Prints one throughput comparison.
fn side_by_side(title: &str, ours: f64, theirs: f64) {
    println!("{title}");
    println!("  idemstore: {ours:>9.0} entries/s");
    println!("  SQLite:    {theirs:>9.0} entries/s");
    println!("  ratio:     {:>9.1}x", ours / theirs);
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn percentiles(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    (v[v.len() / 2], v[v.len() * 99 / 100])
}

/// When each latency sample's `send` started, by sample number (its payload).
type SendTimes = Arc<Mutex<Vec<Option<Instant>>>>;

fn send_times() -> SendTimes {
    Arc::new(Mutex::new(vec![None; LATENCY_SAMPLES]))
}

/// Notes that the send of the entry with `payload` starts now.
fn note_send(times: &SendTimes, payload: &[u8]) {
    let i: usize = std::str::from_utf8(payload).unwrap().parse().unwrap();
    times.lock()[i] = Some(Instant::now());
}

/// Enqueues the samples one at a time into an idle dispatcher (running on
/// other threads) and measures each until its send starts.
fn measure_latency(outbox: &Outbox, sent: &SendTimes) -> (Duration, Duration) {
    let mut latencies = Vec::new();
    for i in 0..LATENCY_SAMPLES {
        let start = Instant::now();
        outbox
            .enqueue(
                NewEntry::new("c", "d", format!("k{i}"), i.to_string()),
                Utc::now(),
            )
            .expect("enqueue");
        while sent.lock()[i].is_none() {
            std::thread::yield_now();
        }
        latencies.push(sent.lock()[i].unwrap() - start);
        std::thread::sleep(Duration::from_millis(1));
    }
    percentiles(latencies)
}

fn idemstore_latency(dir: &std::path::Path) -> (Duration, Duration) {
    let store = Store::open(dir.join("latency.idem")).expect("open");
    let outbox = store.outbox();
    let sent = send_times();
    let log = sent.clone();
    let handle = Dispatcher::builder(outbox.clone())
        .workers(WORKERS)
        .start(move |e| {
            note_send(&log, &e.payload);
            Delivery::Delivered
        })
        .expect("start");
    let latencies = measure_latency(&outbox, &sent);
    handle.shutdown().expect("shutdown");
    latencies
}

/// The async dispatcher on a multi-thread runtime; this thread enqueues.
fn idemstore_async_latency(dir: &std::path::Path) -> (Duration, Duration) {
    let store = Store::open(dir.join("latency-async.idem")).expect("open");
    let outbox = store.outbox();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let sent = send_times();
    let log = sent.clone();
    let handle = {
        let _runtime = runtime.enter();
        Dispatcher::builder(outbox.clone())
            .workers(WORKERS)
            .start_async(move |e| {
                note_send(&log, &e.payload);
                async { Delivery::Delivered }
            })
            .expect("start")
    };
    let latencies = measure_latency(&outbox, &sent);
    runtime.block_on(handle.shutdown()).expect("shutdown");
    latencies
}

fn sqlite_open(path: &std::path::Path) -> Connection {
    let c = Connection::open(path).expect("open");
    c.pragma_update(None, "journal_mode", "WAL").expect("wal");
    c.pragma_update(None, "synchronous", "FULL").expect("full");
    c.busy_timeout(Duration::from_secs(30)).expect("busy");
    c.execute_batch(
        "CREATE TABLE IF NOT EXISTS outbox (
            id INTEGER PRIMARY KEY, destination TEXT NOT NULL, key TEXT NOT NULL,
            payload BLOB NOT NULL, status INTEGER NOT NULL, attempts INTEGER NOT NULL,
            due INTEGER NOT NULL, UNIQUE (destination, key));
         CREATE INDEX IF NOT EXISTS due ON outbox (status, due, id);",
    )
    .expect("schema");
    c
}

/// Claims up to `limit` due entries: the SQLite skip-locked idiom.
fn sqlite_claim(c: &Connection, limit: usize) -> Vec<(i64, Vec<u8>)> {
    let now = Utc::now().timestamp_micros();
    let mut stmt = c
        .prepare_cached(
            "UPDATE outbox SET status = 1, attempts = attempts + 1
             WHERE id IN (SELECT id FROM outbox WHERE status = 0 AND due <= ?1 ORDER BY due, id LIMIT ?2)
             RETURNING id, payload",
        )
        .expect("prepare");
    let rows = stmt
        .query_map(params![now, i64::try_from(limit).unwrap()], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .expect("claim");
    rows.map(|r| r.expect("row")).collect()
}

fn sqlite_complete(c: &Connection, ids: &[i64]) {
    let tx = c.unchecked_transaction().expect("tx");
    {
        let mut stmt = tx
            .prepare_cached("UPDATE outbox SET status = 2 WHERE id = ?1")
            .expect("prepare");
        for id in ids {
            stmt.execute(params![id]).expect("complete");
        }
    }
    tx.commit().expect("commit");
}

fn sqlite_enqueue(c: &Connection, key: &str, payload: &[u8]) {
    c.prepare_cached(
        "INSERT INTO outbox (destination, key, payload, status, attempts, due) VALUES ('d', ?1, ?2, 0, 0, ?3)
         ON CONFLICT DO NOTHING",
    )
    .expect("prepare")
    .execute(params![key, payload, Utc::now().timestamp_micros()])
    .expect("enqueue");
}

/// What a benchmark `send` does with a payload.
type OnSend = Arc<dyn Fn(&[u8]) + Send + Sync>;

/// Polling workers over SQLite; `on_send` sees each payload.
fn sqlite_workers(
    path: &std::path::Path,
    stop: &Arc<AtomicBool>,
    on_send: &OnSend,
) -> Vec<std::thread::JoinHandle<()>> {
    (0..WORKERS)
        .map(|_| {
            let (path, stop, on_send) = (path.to_path_buf(), stop.clone(), on_send.clone());
            std::thread::spawn(move || {
                let c = sqlite_open(&path);
                while !stop.load(Ordering::Relaxed) {
                    let batch = sqlite_claim(&c, 64);
                    if batch.is_empty() {
                        std::thread::sleep(Duration::from_millis(1));
                        continue;
                    }
                    for (_, payload) in &batch {
                        on_send(payload);
                    }
                    let ids: Vec<i64> = batch.iter().map(|(id, _)| *id).collect();
                    sqlite_complete(&c, &ids);
                }
            })
        })
        .collect()
}

fn sqlite_latency(dir: &std::path::Path) -> (Duration, Duration) {
    let path = dir.join("latency.sqlite");
    let producer = sqlite_open(&path);
    let sent: Arc<Mutex<Vec<Option<Instant>>>> = Arc::new(Mutex::new(vec![None; LATENCY_SAMPLES]));
    let log = sent.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let on_send: OnSend = Arc::new(move |p: &[u8]| {
        let i: usize = std::str::from_utf8(p).unwrap().parse().unwrap();
        log.lock()[i] = Some(Instant::now());
    });
    let workers = sqlite_workers(&path, &stop, &on_send);
    let mut latencies = Vec::new();
    for i in 0..LATENCY_SAMPLES {
        let start = Instant::now();
        sqlite_enqueue(&producer, &format!("k{i}"), i.to_string().as_bytes());
        while sent.lock()[i].is_none() {
            std::thread::yield_now();
        }
        latencies.push(sent.lock()[i].unwrap() - start);
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    percentiles(latencies)
}

/// Producers enqueue `per_commit` entries per call (`enqueue_many`).
fn idemstore_throughput(dir: &std::path::Path, per_commit: u64) -> f64 {
    let store = Store::open(dir.join(format!("throughput-{per_commit}.idem"))).expect("open");
    let outbox = store.outbox();
    let delivered = Arc::new(AtomicU64::new(0));
    let count = delivered.clone();
    let handle = Dispatcher::builder(outbox.clone())
        .workers(WORKERS)
        .batch_size(64)
        .start(move |_| {
            count.fetch_add(1, Ordering::Relaxed);
            Delivery::Delivered
        })
        .expect("start");
    let start = Instant::now();
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let outbox = outbox.clone();
            std::thread::spawn(move || {
                let per_producer = THROUGHPUT_ENTRIES / PRODUCERS as u64;
                for chunk in 0..per_producer / per_commit {
                    let entries = (0..per_commit).map(|i| {
                        NewEntry::new("c", "d", format!("{p}-{chunk}-{i}"), b"x".to_vec())
                    });
                    outbox.enqueue_many(entries, Utc::now()).expect("enqueue");
                }
            })
        })
        .collect();
    for p in producers {
        p.join().unwrap();
    }
    while outbox.counts().expect("counts").completed < THROUGHPUT_ENTRIES {
        std::thread::sleep(Duration::from_millis(1));
    }
    let rate = THROUGHPUT_ENTRIES as f64 / start.elapsed().as_secs_f64();
    handle.shutdown().expect("shutdown");
    rate
}

/// Producers insert `per_commit` entries per transaction.
fn sqlite_throughput(dir: &std::path::Path, per_commit: u64) -> f64 {
    let path = dir.join(format!("throughput-{per_commit}.sqlite"));
    drop(sqlite_open(&path));
    let run = CountingWorkers::start(&path);
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let path = path.clone();
            std::thread::spawn(move || {
                let c = sqlite_open(&path);
                let per_producer = THROUGHPUT_ENTRIES / PRODUCERS as u64;
                for chunk in 0..per_producer / per_commit {
                    let tx = c.unchecked_transaction().expect("tx");
                    for i in 0..per_commit {
                        sqlite_enqueue(&tx, &format!("{p}-{chunk}-{i}"), b"x");
                    }
                    tx.commit().expect("commit");
                }
            })
        })
        .collect();
    for p in producers {
        p.join().unwrap();
    }
    run.finish()
}

fn idemstore_drain(dir: &std::path::Path) -> f64 {
    let (_store, outbox) = backlog(&dir.join("drain.idem"), THROUGHPUT_ENTRIES);
    let start = Instant::now();
    let handle = Dispatcher::builder(outbox.clone())
        .workers(WORKERS)
        .batch_size(64)
        .start(|_| Delivery::Delivered)
        .expect("start");
    let rate = completed_rate(&outbox, THROUGHPUT_ENTRIES, start);
    handle.shutdown().expect("shutdown");
    rate
}

/// A store holding a backlog of `n` entries, enqueued 100 per commit.
fn backlog(path: &std::path::Path, n: u64) -> (Store, Outbox) {
    let store = Store::open(path).expect("open");
    let outbox = store.outbox();
    for chunk in 0..n / 100 {
        let entries =
            (0..100).map(|i| NewEntry::new("c", "d", format!("{chunk}-{i}"), b"x".to_vec()));
        outbox.enqueue_many(entries, Utc::now()).expect("enqueue");
    }
    (store, outbox)
}

/// Waits until `n` entries are completed (durably settled); entries per
/// second since `start`.
fn completed_rate(outbox: &Outbox, n: u64, start: Instant) -> f64 {
    while outbox.counts().expect("counts").completed < n {
        std::thread::sleep(Duration::from_millis(1));
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// The thread dispatcher draining a backlog with sends that sleep
/// [`SEND_TIME`].
fn idemstore_slow_drain(dir: &std::path::Path, workers: usize) -> f64 {
    idemstore_thread_drain(dir, workers, "sleep", || std::thread::sleep(SEND_TIME))
}

/// The thread dispatcher draining a backlog with sends that wait on the
/// same tokio timer as the async sends: tokio's timer has a 1 ms tick and
/// rounds up, so its "1 ms" is 1–2 ms; with the same wait on both sides the
/// ratio compares the dispatchers, not the timers.
fn idemstore_timer_drain(dir: &std::path::Path, workers: usize) -> f64 {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let timer = runtime.handle().clone();
    idemstore_thread_drain(dir, workers, "timer", move || {
        // The timer is made inside `block_on`: made outside a runtime's
        // context, tokio's `sleep` panics.
        timer.block_on(async { tokio::time::sleep(SEND_TIME).await });
    })
}

fn idemstore_thread_drain(
    dir: &std::path::Path,
    workers: usize,
    name: &str,
    wait: impl Fn() + Send + Sync + 'static,
) -> f64 {
    let (_store, outbox) = backlog(
        &dir.join(format!("slow-drain-{name}-{workers}.idem")),
        SLOW_ENTRIES,
    );
    let start = Instant::now();
    let handle = Dispatcher::builder(outbox.clone())
        .workers(workers)
        .batch_size(64)
        .start(move |_| {
            wait();
            Delivery::Delivered
        })
        .expect("start");
    let rate = completed_rate(&outbox, SLOW_ENTRIES, start);
    handle.shutdown().expect("shutdown");
    rate
}

/// The async dispatcher, on a multi-thread runtime, draining a backlog
/// with sends that await a [`SEND_TIME`] timer.
fn idemstore_async_slow_drain(dir: &std::path::Path, workers: usize) -> f64 {
    let path = dir.join(format!("slow-drain-async-{workers}.idem"));
    let (_store, outbox) = backlog(&path, SLOW_ENTRIES);
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let start = Instant::now();
    let handle = {
        let _runtime = runtime.enter();
        Dispatcher::builder(outbox.clone())
            .workers(workers)
            .batch_size(64)
            .start_async(|_| async {
                tokio::time::sleep(SEND_TIME).await;
                Delivery::Delivered
            })
            .expect("start")
    };
    let rate = completed_rate(&outbox, SLOW_ENTRIES, start);
    runtime.block_on(handle.shutdown()).expect("shutdown");
    rate
}

/// The SQLite queue's workers draining a backlog with sends that sleep
/// [`SEND_TIME`].
fn sqlite_slow_drain(dir: &std::path::Path) -> f64 {
    let path = dir.join("slow-drain.sqlite");
    sqlite_backlog(&path, SLOW_ENTRIES);
    CountingWorkers::start_with(&path, SLOW_ENTRIES, SEND_TIME).finish()
}

fn sqlite_backlog(path: &std::path::Path, n: u64) {
    let c = sqlite_open(path);
    for chunk in 0..n / 100 {
        let tx = c.unchecked_transaction().expect("tx");
        for i in 0..100 {
            sqlite_enqueue(&tx, &format!("{chunk}-{i}"), b"x");
        }
        tx.commit().expect("commit");
    }
}

fn sqlite_drain(dir: &std::path::Path) -> f64 {
    let path = dir.join("drain.sqlite");
    sqlite_backlog(&path, THROUGHPUT_ENTRIES);
    CountingWorkers::start(&path).finish()
}

/// SQLite workers that count what they send, and the time they started.
struct CountingWorkers {
    delivered: Arc<AtomicU64>,
    /// Entries to wait for.
    total: u64,
    stop: Arc<AtomicBool>,
    start: Instant,
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl CountingWorkers {
    /// Workers with no-op sends, for [`THROUGHPUT_ENTRIES`] entries.
    fn start(path: &std::path::Path) -> CountingWorkers {
        CountingWorkers::start_with(path, THROUGHPUT_ENTRIES, Duration::ZERO)
    }

    /// Workers whose sends sleep `send_time`, for `total` entries.
    fn start_with(path: &std::path::Path, total: u64, send_time: Duration) -> CountingWorkers {
        let delivered = Arc::new(AtomicU64::new(0));
        let count = delivered.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let start = Instant::now();
        let on_send: OnSend = Arc::new(move |_: &[u8]| {
            if !send_time.is_zero() {
                std::thread::sleep(send_time);
            }
            count.fetch_add(1, Ordering::Relaxed);
        });
        let workers = sqlite_workers(path, &stop, &on_send);
        CountingWorkers {
            delivered,
            total,
            stop,
            start,
            workers,
        }
    }

    /// Waits until every entry was sent, stops the workers, and returns
    /// entries per second since they started.
    fn finish(self) -> f64 {
        while self.delivered.load(Ordering::Relaxed) < self.total {
            std::thread::sleep(Duration::from_millis(1));
        }
        let rate = self.total as f64 / self.start.elapsed().as_secs_f64();
        self.stop.store(true, Ordering::Relaxed);
        for w in self.workers {
            w.join().unwrap();
        }
        rate
    }
}
