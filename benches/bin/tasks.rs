//! Durable claims from async tasks beside the same claims from OS
//! threads and through `spawn_blocking`, each figure beside its baseline
//! from the same run.
//!
//! ```text
//! cargo run --release -p idemstore-benches --bin tasks
//! cargo run --release -p idemstore-benches --bin tasks -- --claims 200000
//! ```
//!
//! Three ways to make `--claims` durable inbox claims (default 100,000,
//! distinct keys), each on a fresh store file:
//!
//! - 2,000 tasks on a 2-worker tokio runtime, through `claim_async`;
//! - 64 OS threads through the blocking `claim`;
//! - 2,000 tasks on the same runtime through `spawn_blocking` (the way
//!   before the async calls).
//!
//! Claims per second, durable commits, and the peak threads and resident
//! memory of the process while each runs (sampled every millisecond).
//! `-- --only tasks|threads|blocking` runs one way alone, for counts of
//! what it costs that a noisy machine shifts little: `perf stat -e
//! task-clock,context-switches` (every thread), `valgrind
//! --tool=callgrind` (instructions).
//!
//! `-- drain`: the async dispatcher (64 workers, each send awaiting 1 ms on
//! tokio's timer) draining a durable backlog of 20,000 entries over 10
//! destinations, three runs: entries per second and the peak threads.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::Utc;
use idemstore::Store;

const TASKS: usize = 2_000;
const THREADS: usize = 64;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let claims = args
        .iter()
        .position(|a| a == "--claims")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(100_000_usize);
    if args.iter().any(|a| a == "drain") {
        return drain();
    }
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str);
    let wanted = |way: &str| only.is_none_or(|o| o == way);
    println!("{claims} durable inbox claims, distinct keys, each way on a fresh store file:");
    let (mut tasks, mut threads, mut blocking) = (f64::NAN, f64::NAN, f64::NAN);
    if wanted("tasks") {
        tasks = run("2,000 tasks, claim_async", claims, |store, n| {
            let runtime = runtime()?;
            runtime.block_on(async {
                let inbox = store.inbox("bench")?;
                let handles: Vec<_> = (0..TASKS)
                    .map(|t| {
                        let inbox = inbox.clone();
                        tokio::spawn(async move {
                            for i in (t..n).step_by(TASKS) {
                                inbox.claim_async(&format!("k{i}"), Utc::now()).await?;
                            }
                            Ok::<_, idemstore::Error>(())
                        })
                    })
                    .collect();
                for h in handles {
                    h.await??;
                }
                Ok(())
            })
        })?;
    }
    if wanted("threads") {
        threads = run("64 threads, claim", claims, |store, n| {
            let inbox = store.inbox("bench")?;
            let handles: Vec<_> = (0..THREADS)
                .map(|t| {
                    let inbox = inbox.clone();
                    std::thread::spawn(move || {
                        for i in (t..n).step_by(THREADS) {
                            inbox.claim(&format!("k{i}"), Utc::now())?;
                        }
                        Ok::<_, idemstore::Error>(())
                    })
                })
                .collect();
            for h in handles {
                h.join().map_err(|_| "a claiming thread panicked")??;
            }
            Ok(())
        })?;
    }
    if wanted("blocking") {
        blocking = run("2,000 tasks, spawn_blocking(claim)", claims, |store, n| {
            let runtime = runtime()?;
            runtime.block_on(async {
                let inbox = store.inbox("bench")?;
                let handles: Vec<_> = (0..TASKS)
                    .map(|t| {
                        let inbox = inbox.clone();
                        tokio::spawn(async move {
                            for i in (t..n).step_by(TASKS) {
                                let inbox = inbox.clone();
                                tokio::task::spawn_blocking(move || {
                                    inbox.claim(&format!("k{i}"), Utc::now())
                                })
                                .await
                                .map_err(|_| {
                                    idemstore::Error::Io(std::io::Error::other("panicked"))
                                })??;
                            }
                            Ok::<_, idemstore::Error>(())
                        })
                    })
                    .collect();
                for h in handles {
                    h.await??;
                }
                Ok(())
            })
        })?;
    }
    println!(
        "  tasks ÷ 64 threads: {:.2}×   tasks ÷ spawn_blocking: {:.2}×",
        tasks / threads,
        tasks / blocking
    );
    Ok(())
}

fn runtime() -> Res<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// Runs `work` over `n` claims on a fresh store, prints its figures and
/// returns its claims per second.
fn run(name: &str, n: usize, work: impl FnOnce(&Store, usize) -> Res<()>) -> Res<f64> {
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("tasks.idem"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let (peak_threads, peak_rss) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let sampler = {
        let (stop, threads, rss) = (stop.clone(), peak_threads.clone(), peak_rss.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let (t, r) = sample();
                threads.fetch_max(t, Ordering::Relaxed);
                rss.fetch_max(r, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let before = store.commit_stats();
    let began = Instant::now();
    work(&store, n)?;
    let took = began.elapsed();
    stop.store(true, Ordering::Relaxed);
    sampler.join().map_err(|_| "the sampler panicked")?;
    let fsyncs = store.commit_stats().durable_commits - before.durable_commits;
    assert_eq!(store.inbox("bench")?.len()?, n as u64);
    let rate = n as f64 / took.as_secs_f64();
    println!(
        "  {name:<36} {rate:>9.0} claims/s  {fsyncs:>6} fsyncs ({:.1} claims each)  peak {} threads, {} MiB resident",
        n as f64 / fsyncs.max(1) as f64,
        peak_threads.load(Ordering::Relaxed),
        peak_rss.load(Ordering::Relaxed) >> 10,
    );
    Ok(rate)
}

/// The process's threads and resident memory in KiB, now.
fn sample() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (field("Threads:"), field("VmRSS:"))
}

/// The async dispatcher's drain (see the module docs).
fn drain() -> Res<()> {
    use idemstore::{Delivery, Dispatcher, NewEntry};
    const ENTRIES: u64 = 20_000;
    println!(
        "drain: {ENTRIES} entries over 10 destinations, async dispatcher, 64 workers, sends awaiting 1 ms"
    );
    for run in 0..3 {
        let dir = tempfile::tempdir()?;
        let store = Store::open(dir.path().join("drain.idem"))?;
        let outbox = store.outbox();
        for chunk in 0..ENTRIES / 1000 {
            outbox.enqueue_many(
                (chunk * 1000..(chunk + 1) * 1000)
                    .map(|i| NewEntry::new("c", format!("d{}", i % 10), format!("k{i}"), vec![])),
                Utc::now(),
            )?;
        }
        let runtime = runtime()?;
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let sampler = {
            let (stop, peak) = (stop.clone(), peak.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    peak.fetch_max(sample().0, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        };
        let began = Instant::now();
        runtime.block_on(async {
            let handle = Dispatcher::builder(outbox.clone())
                .workers(64)
                .start_async(|_| async {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    Delivery::Delivered
                })?;
            while outbox.counts()?.completed < ENTRIES {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            handle.shutdown().await?;
            Ok::<_, idemstore::Error>(())
        })?;
        let took = began.elapsed();
        stop.store(true, Ordering::Relaxed);
        sampler.join().map_err(|_| "the sampler panicked")?;
        println!(
            "  run {run}: {:>8.0} entries/s, peak {} threads",
            ENTRIES as f64 / took.as_secs_f64(),
            peak.load(Ordering::Relaxed)
        );
    }
    Ok(())
}
