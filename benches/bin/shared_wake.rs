//! Wake-up latency across processes sharing one store file, beside the
//! same latency within one process, from one run.
//!
//! ```text
//! cargo run --release -p idemstore-benches --bin shared_wake             # 200 entries per cell
//! cargo run --release -p idemstore-benches --bin shared_wake -- --entries 50
//! ```
//!
//! For each poll interval, this process opens a shared store and runs a
//! dispatcher on it, then starts a child process (this program again) that
//! opens the same file and enqueues the entries, 10–20 ms apart, each
//! carrying its enqueue time (taken just before the call). The dispatcher's
//! `send` records how long ago that was. Then this process enqueues as many
//! itself: the baseline, woken by the outbox's own signal. Latency covers
//! the enqueue's commit, the wake-up, the claim's commit and the send.
//! Last, the watching thread's CPU time over two idle seconds (Linux).

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use idemstore::{Delivery, Dispatcher, DispatcherHandle, NewEntry, Store};
use parking_lot::Mutex;

type Latencies = Arc<Mutex<Vec<Duration>>>;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        let store = Store::builder().shared(true).open(Path::new(&args[2]))?;
        return Ok(enqueue_paced(&store, args[3].parse()?, "other")?);
    }
    let entries: usize = match args.iter().position(|a| a == "--entries") {
        Some(i) => args.get(i + 1).ok_or("--entries needs a number")?.parse()?,
        None => 200,
    };
    let dir = tempfile::tempdir()?;
    println!("enqueue → send latency, ms ({entries} entries per cell, 10–20 ms apart)\n");
    println!(
        "{:>8} | {:>22} | {:>22} | {:>10} | {:>14}",
        "interval", "another process", "this process", "p50 ratio", "idle watch CPU"
    );
    println!(
        "{:>8} | {:>22} | {:>22} | {:>10} | {:>14}",
        "", "p50 / p99 / max", "p50 / p99 / max", "", "per second"
    );
    println!("{}", "-".repeat(88));
    for interval_ms in [1, 5, 10] {
        let path = dir.path().join(format!("wake-{interval_ms}.redb"));
        let store = Store::builder()
            .shared(true)
            .shared_poll_interval(Duration::from_millis(interval_ms))
            .open(&path)?;
        let (dispatcher, latencies) = dispatcher(&store)?;

        let status = Command::new(std::env::current_exe()?)
            .arg("--child")
            .arg(&path)
            .arg(entries.to_string())
            .status()?;
        if !status.success() {
            return Err(format!("the enqueuing process failed: {status}").into());
        }
        let other = collect(&latencies, entries)?;

        enqueue_paced(&store, entries, "this")?;
        let this = collect(&latencies, entries)?;

        let idle = watch_cpu(Duration::from_secs(2));
        dispatcher.shutdown()?;
        println!(
            "{:>6} ms | {:>22} | {:>22} | {:>9.1}× | {:>14}",
            interval_ms,
            summary(&other),
            summary(&this),
            ms(percentile(&other, 50)) / ms(percentile(&this, 50)),
            idle.map_or_else(
                || "n/a".into(),
                |d| format!("{:.1} µs", d.as_secs_f64() * 5e5)
            ),
        );
    }
    Ok(())
}

/// A one-worker dispatcher on `store` whose sends record each entry's age.
fn dispatcher(store: &Store) -> idemstore::Result<(DispatcherHandle, Latencies)> {
    let latencies = Latencies::default();
    let record = latencies.clone();
    let handle = Dispatcher::builder(store.outbox())
        .workers(1)
        .start(move |e| {
            let sent = Utc::now().timestamp_micros();
            let at = e
                .payload
                .get(..8)
                .and_then(|b| b.try_into().ok())
                .map_or(sent, i64::from_le_bytes);
            let age = u64::try_from(sent - at).unwrap_or(0);
            record.lock().push(Duration::from_micros(age));
            Delivery::Delivered
        })?;
    Ok((handle, latencies))
}

/// Enqueues `n` entries 10–20 ms apart, each carrying the time just before
/// its enqueue.
fn enqueue_paced(store: &Store, n: usize, who: &str) -> idemstore::Result<()> {
    let outbox = store.outbox();
    for i in 0..n {
        let gap = 10 + (i * 7) % 11;
        std::thread::sleep(Duration::from_millis(gap as u64));
        let now = Utc::now();
        let entry = NewEntry::new(
            format!("{who}-{i}"),
            "remote",
            format!("{who}-{i}"),
            now.timestamp_micros().to_le_bytes().to_vec(),
        );
        outbox.enqueue(entry, now)?;
    }
    Ok(())
}

/// Waits until `n` sends were recorded (at most a minute), and takes them.
fn collect(latencies: &Latencies, n: usize) -> Result<Vec<Duration>, String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while latencies.lock().len() < n {
        if Instant::now() > deadline {
            return Err(format!(
                "only {} of {n} entries sent",
                latencies.lock().len()
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut taken = std::mem::take(&mut *latencies.lock());
    taken.sort();
    Ok(taken)
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    let i = (sorted.len() * p / 100).min(sorted.len().saturating_sub(1));
    sorted.get(i).copied().unwrap_or_default()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn summary(sorted: &[Duration]) -> String {
    format!(
        "{:.1} / {:.1} / {:.1}",
        ms(percentile(sorted, 50)),
        ms(percentile(sorted, 99)),
        ms(percentile(sorted, 100))
    )
}

/// CPU time the store's watching thread (`idemstore-watch`) spent over
/// `window` of idleness (Linux: the scheduler's per-thread counter).
fn watch_cpu(window: Duration) -> Option<Duration> {
    let before = watch_cpu_total()?;
    std::thread::sleep(window);
    Some(watch_cpu_total()?.saturating_sub(before))
}

fn watch_cpu_total() -> Option<Duration> {
    let mut total = Duration::ZERO;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let dir = task.ok()?.path();
        let name = std::fs::read_to_string(dir.join("comm")).ok()?;
        if name.trim_end() != "idemstore-watch" {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("schedstat")).ok()?;
        let ns: u64 = stat.split_whitespace().next()?.parse().ok()?;
        total += Duration::from_nanos(ns);
    }
    Some(total)
}
