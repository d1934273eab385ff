//! redb's two compaction modes on a store file after pruning: the file's
//! size, the time the compaction takes, and the durable claims per second
//! on the compacted file, each mode beside the other from the same run.
//!
//! ```text
//! cargo run --release -p idemstore-benches --bin compaction
//! cargo run --release -p idemstore-benches --bin compaction -- --keys 400000
//! ```
//!
//! A store claims `--keys` inbox keys (default 200,000) under
//! `Durability::None`, enqueues and completes 20,000 outbox entries,
//! stores 20,000 idempotency responses of 512 bytes, then prunes 90% of each
//! (the oldest keys, the finished entries, the expired responses): the shape
//! of a store whose janitor has caught up after a busy week. Copies of that
//! file are compacted with `CompactionMode::Balanced` and
//! `CompactionMode::Maximum`; each copy then takes 64 threads of durable
//! claims for a few seconds.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeZone, Utc};
use idemstore::redb::{CompactionMode, Database};
use idemstore::{Begin, Durability, NewEntry, ResponseRecord, Store, fingerprint};

fn t(s: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + s, 0).unwrap()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let keys: i64 = args
        .iter()
        .position(|a| a == "--keys")
        .and_then(|i| args.get(i + 1))
        .map_or(Ok(200_000), |v| v.parse())?;
    let dir = tempfile::tempdir()?;
    let source = dir.path().join("source.idem");
    fill(&source, keys)?;
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len() as f64 / 1_048_576.0);
    println!(
        "{keys} keys claimed and 90% pruned: the file is {:.1} MiB\n",
        size(&source)?
    );
    println!(
        "{:>9} | {:>10} | {:>11} | {:>22}",
        "mode", "file MiB", "compaction", "claims/s after (64 thr)"
    );
    println!("{}", "-".repeat(62));
    for (name, mode) in [
        ("Balanced", CompactionMode::Balanced),
        ("Maximum", CompactionMode::Maximum),
    ] {
        let copy = dir.path().join(format!("{name}.idem"));
        std::fs::copy(&source, &copy)?;
        let started = Instant::now();
        {
            let mut db = Database::open(&copy)?;
            while db.compact(mode)? {}
        }
        let took = started.elapsed();
        let rate = claims(&copy, Duration::from_secs(3))?;
        println!(
            "{name:>9} | {:>10.1} | {:>9.0}ms | {rate:>22.0}",
            size(&copy)?,
            took.as_secs_f64() * 1e3
        );
    }
    Ok(())
}

/// The busy week, then the janitor's catch-up.
fn fill(path: &PathBuf, keys: i64) -> Result<(), Box<dyn std::error::Error>> {
    let store = Store::builder().durability(Durability::None).open(path)?;
    let inbox = store.inbox("webhooks")?;
    for chunk in 0..keys / 1000 {
        let batch: Vec<String> = (0..1000)
            .map(|i| format!("evt_{:016x}", (chunk * 1000 + i).wrapping_mul(0x9e37_79b9)))
            .collect();
        inbox.claim_many(batch.iter().map(String::as_str), t(chunk))?;
    }
    let outbox = store.outbox();
    for i in 0..20_000 {
        let e = NewEntry::new(
            format!("cmd-{i}"),
            "email",
            format!("k-{i}"),
            vec![7u8; 200],
        );
        outbox.enqueue(e, t(i / 100))?;
    }
    loop {
        let claimed = outbox.claim_due(t(1_000_000), 500, "w")?;
        if claimed.is_empty() {
            break;
        }
        for e in claimed {
            outbox.mark_completed(e.id, t(1_000_000))?;
        }
    }
    let store_keys = store.idempotency_keys();
    let fp = fingerprint("POST", "/x", b"{}");
    for i in 0..20_000i64 {
        let key = format!("key-{i}");
        if let Begin::Proceed(r) = store_keys.begin("", &key, &fp, t(i / 100))? {
            let response =
                ResponseRecord::new("", key.as_str(), &fp, 201, vec![1u8; 512], t(i / 100));
            store_keys.complete(&r, response, t(i / 100))?;
        }
    }
    let cut = keys / 1000 * 9 / 10;
    inbox.prune(t(cut))?;
    outbox.purge_finished(t(1_000_000 + 1))?;
    store_keys.purge_expired(t(180))?;
    store.sync()?;
    Ok(())
}

/// Durable claims per second from 64 threads for `run_for`.
fn claims(path: &Path, run_for: Duration) -> Result<f64, Box<dyn std::error::Error>> {
    let store = Store::open(path)?;
    let inbox = store.inbox("webhooks")?;
    let done = Arc::new(AtomicU64::new(0));
    let stop = Instant::now() + run_for;
    std::thread::scope(|s| {
        for th in 0..64u64 {
            let (inbox, done) = (inbox.clone(), done.clone());
            s.spawn(move || {
                let mut i = 0u64;
                while Instant::now() < stop {
                    if inbox
                        .claim(&format!("new_{th}_{i}"), Utc::now())
                        .unwrap_or(false)
                    {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    i += 1;
                }
            });
        }
    });
    Ok(done.load(Ordering::Relaxed) as f64 / run_for.as_secs_f64())
}
