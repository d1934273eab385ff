//! Claim latency and memory while maintenance runs: a store with 200k
//! finished outbox entries of 1 KiB and 200k old inbox keys, one thread
//! claiming fresh keys while `purge_finished` and `prune` remove the old
//! rows. Each figure is printed beside its baseline from the same run: the
//! worst and median claim latency with no maintenance running, and the
//! resident memory before maintenance began.
//!
//! ```text
//! cargo run --release -p idemstore-benches --bin maintenance            # 200k rows (~1 min)
//! cargo run --release -p idemstore-benches --bin maintenance -- --quick # 20k rows
//! ```
//!
//! The targets it checks: the worst claim during maintenance at most
//! max(100 ms, 10 × the worst claim without it), and peak resident memory
//! during maintenance at most 64 MiB above what it was before.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use idemstore::{Inbox, NewEntry, Settlement, Store};

/// Rows written per setup commit.
const BATCH: usize = 1000;
const PAYLOAD: usize = 1024;
const DAY: chrono::Duration = chrono::Duration::days(1);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::args().any(|a| a == "--quick");
    let rows = if quick { 20_000 } else { 200_000 };
    let baseline_for = Duration::from_secs(if quick { 2 } else { 5 });
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("maintenance.idem"))?;
    let inbox = store.inbox("webhooks")?;
    let old = Utc::now() - DAY * 30;
    let started = Instant::now();
    setup(&store, &inbox, rows, old)?;
    println!(
        "setup: {rows} finished outbox entries of {PAYLOAD} B and {rows} inbox keys, 30 days old, in {:.1?}",
        started.elapsed()
    );

    let next_key = Arc::new(AtomicU64::new(0));
    // Baseline: the same claimer, nothing else running.
    let quiet = claim_for(&inbox, &next_key, &Stop::After(baseline_for))?;

    // Maintenance, with the claimer running beside it.
    let rss_before = status_kib("VmRSS").unwrap_or(0);
    let hwm_reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let done = Arc::new(AtomicBool::new(false));
    let rss_sampler = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut peak = 0;
            while !done.load(Ordering::Relaxed) {
                peak = peak.max(status_kib("VmRSS").unwrap_or(0));
                std::thread::sleep(Duration::from_millis(2));
            }
            peak
        })
    };
    let claimer = {
        let (inbox, next_key, done) = (inbox.clone(), next_key.clone(), done.clone());
        std::thread::spawn(move || claim_for(&inbox, &next_key, &Stop::When(done)))
    };
    // Let the claimer get going first.
    std::thread::sleep(Duration::from_millis(200));
    let commits_before = store.commit_stats().commits;
    let cutoff = Utc::now() - DAY * 7;
    let purge_began = Instant::now();
    let purged = store.outbox().purge_finished(cutoff)?;
    let purge_took = purge_began.elapsed();
    let prune_began = Instant::now();
    let pruned = inbox.prune(cutoff)?;
    let prune_took = prune_began.elapsed();
    let commits = store.commit_stats().commits - commits_before;
    // And a little after, for the claims that waited on the last chunk.
    std::thread::sleep(Duration::from_millis(200));
    done.store(true, Ordering::Relaxed);
    let busy = claimer.join().map_err(|_| "the claimer panicked")??;
    let sampled_peak = rss_sampler.join().map_err(|_| "the sampler panicked")?;
    let hwm = if hwm_reset {
        status_kib("VmHWM").unwrap_or(0)
    } else {
        0
    };
    assert_eq!(purged, rows as u64, "every finished entry purged");
    assert_eq!(pruned, rows as u64, "every old key pruned");
    println!(
        "maintenance: purge_finished removed {purged} in {purge_took:.1?}, prune removed {pruned} in {prune_took:.1?}; {commits} commits (the claims' included)"
    );
    report(&quiet, &busy, rss_before, sampled_peak.max(hwm), hwm_reset);
    if let Some(&(worst, began)) = busy.0.last() {
        let when = if began < purge_began {
            "before the purge".to_owned()
        } else if began < prune_began {
            format!("{:.0?} into the purge", began - purge_began)
        } else {
            format!("{:.0?} into the prune", began - prune_began)
        };
        println!(
            "the worst claim during maintenance ({}) began {when}",
            ms(worst)
        );
    }
    Ok(())
}

/// Prints the figures beside their baselines, and whether the targets are met.
fn report(quiet: &Latencies, busy: &Latencies, rss_before: u64, peak: u64, hwm_reset: bool) {
    println!();
    println!(
        "{:<34} | {:>12} | {:>12} | {:>8}",
        "claim latency", "without", "during", "claims"
    );
    println!("{}", "-".repeat(76));
    println!(
        "{:<34} | {:>12} | {:>12} |",
        "median",
        ms(quiet.median()),
        ms(busy.median())
    );
    println!(
        "{:<34} | {:>12} | {:>12} |",
        "99th percentile",
        ms(quiet.p99()),
        ms(busy.p99())
    );
    println!(
        "{:<34} | {:>12} | {:>12} | {:>4}/{:<4}",
        "worst",
        ms(quiet.worst()),
        ms(busy.worst()),
        quiet.len(),
        busy.len()
    );
    let bound = quiet.worst().mul_f64(10.0).max(Duration::from_millis(100));
    let growth_mib = peak.saturating_sub(rss_before) as f64 / 1024.0;
    println!();
    println!(
        "worst claim during maintenance {} against a bound of max(100 ms, 10 × {}) = {}: {}",
        ms(busy.worst()),
        ms(quiet.worst()),
        ms(bound),
        verdict(busy.worst() <= bound)
    );
    println!(
        "peak RSS {:.1} MiB against {:.1} MiB before maintenance: +{growth_mib:.1} MiB (bound +64 MiB; {}): {}",
        peak as f64 / 1024.0,
        rss_before as f64 / 1024.0,
        if hwm_reset {
            "VmHWM reset at the start, and VmRSS sampled every 2 ms"
        } else {
            "VmRSS sampled every 2 ms"
        },
        verdict(growth_mib <= 64.0)
    );
}

/// `rows` finished entries of [`PAYLOAD`] bytes and `rows` inbox keys, all
/// at `old`.
fn setup(
    store: &Store,
    inbox: &Inbox,
    rows: usize,
    old: DateTime<Utc>,
) -> Result<(), Box<dyn std::error::Error>> {
    let outbox = store.outbox();
    let payload = vec![0x5a_u8; PAYLOAD];
    for batch in 0..rows.div_ceil(BATCH) {
        let n = BATCH.min(rows - batch * BATCH);
        let entries = (0..n).map(|i| {
            let k = format!("k{}", batch * BATCH + i);
            NewEntry::new(format!("cmd-{k}"), "mailer", k, payload.clone())
        });
        outbox.enqueue_many(entries, old)?;
        let claimed = outbox.claim_due(old, n, "setup")?;
        let done: Vec<_> = claimed
            .iter()
            .map(|e| (e.fence(), Settlement::Completed))
            .collect();
        for r in outbox.settle_many(done, old)? {
            r?;
        }
        let keys = (0..n).map(|i| format!("old-{}", batch * BATCH + i));
        inbox.claim_many(keys, old)?;
    }
    Ok(())
}

enum Stop {
    After(Duration),
    When(Arc<AtomicBool>),
}

/// Claim latencies with the time each claim began, sorted by latency.
struct Latencies(Vec<(Duration, Instant)>);

impl Latencies {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn median(&self) -> Duration {
        self.0
            .get(self.0.len() / 2)
            .map(|l| l.0)
            .unwrap_or_default()
    }

    fn p99(&self) -> Duration {
        let i = (self.0.len() * 99 / 100).min(self.0.len().saturating_sub(1));
        self.0.get(i).map(|l| l.0).unwrap_or_default()
    }

    fn worst(&self) -> Duration {
        self.0.last().map(|l| l.0).unwrap_or_default()
    }
}

/// Claims fresh keys one at a time until `stop`, timing each claim.
fn claim_for(inbox: &Inbox, next: &AtomicU64, stop: &Stop) -> idemstore::Result<Latencies> {
    let started = Instant::now();
    let mut out = Vec::new();
    loop {
        let stopped = match stop {
            Stop::After(d) => started.elapsed() >= *d,
            Stop::When(flag) => flag.load(Ordering::Relaxed),
        };
        if stopped {
            break;
        }
        let key = format!("fresh-{}", next.fetch_add(1, Ordering::Relaxed));
        let t = Instant::now();
        assert!(inbox.claim(&key, Utc::now())?, "a fresh key");
        out.push((t.elapsed(), t));
    }
    out.sort_unstable();
    Ok(Latencies(out))
}

/// A `kB` field of `/proc/self/status`.
fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        rest.trim().trim_end_matches("kB").trim().parse().ok()
    })
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "NOT met" }
}
