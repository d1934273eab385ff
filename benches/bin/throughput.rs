//! Durable claim throughput: idemstore beside raw `redb` and `SQLite`, one run.
//!
//! ```text
//! cargo run --release -p idemstore-benches --bin throughput            # the full table (~1 min)
//! cargo run --release -p idemstore-benches --bin throughput -- --quick # shorter runs
//! cargo run --release -p idemstore-benches --bin throughput -- --shared # only the table of shared stores
//! cargo run --release -p idemstore-benches --bin throughput -- --effects # claims with an effect only
//! cargo run --release -p idemstore-benches --bin throughput -- --effects-once # one 64-thread run of them, for a profiler
//! ```
//!
//! Every figure is measured in this run, on this machine, so the ratios are
//! what to read: absolute numbers drift on a shared machine.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use chrono::Utc;
use idemstore::redb::{Database, ReadableTable, TableDefinition};
use idemstore::{Durability, Store};

const RAW: TableDefinition<(&str, &str), i64> = TableDefinition::new("raw.inbox");

struct Config {
    run_for: Duration,
    crash_mib: u64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--crash-child") {
        return crash_child(Path::new(&args[2]), args[3] == "quick", args[4].parse()?);
    }
    if args.get(1).map(String::as_str) == Some("--claiming-child") {
        return claiming_child(Path::new(&args[2]), args[3].parse()?, args[4].parse()?);
    }
    let quick = args.iter().any(|a| a == "--quick");
    let cfg = Config {
        run_for: Duration::from_millis(if quick { 400 } else { 1500 }),
        crash_mib: if quick { 32 } else { 128 },
    };
    let dir = tempfile::tempdir()?;
    if args.iter().any(|a| a == "--shared") {
        return shared_table(dir.path(), &cfg);
    }
    // One 64-thread run of claims with an effect, for a profiler.
    if args.iter().any(|a| a == "--effects-once") {
        let (rate, per_fsync) = effects_run(dir.path(), 64, Duration::from_secs(3))?;
        println!("{rate:.0}/s, {per_fsync:.1} claims per fsync");
        return Ok(());
    }
    if args.iter().any(|a| a == "--effects") {
        return effects_table(dir.path(), &cfg);
    }
    println!(
        "durable claims per second ({} s per cell, median of 3 where noted)\n",
        cfg.run_for.as_secs_f64()
    );
    println!(
        "{:>8} | {:>12} | {:>12} | {:>12} | {:>9} | {:>9}",
        "threads", "idemstore", "raw redb", "SQLite FULL", "vs redb", "vs SQLite"
    );
    println!("{}", "-".repeat(78));
    let mut single = (0.0, 0.0);
    let mut at64 = 0.0;
    for threads in [1usize, 16, 64] {
        let ours = median3(|| {
            idemstore_claims(
                dir.path(),
                threads,
                cfg.run_for,
                Durability::Immediate,
                false,
            )
        })?;
        let redb = median3(|| raw_redb_claims(dir.path(), threads, cfg.run_for))?;
        let sqlite = median3(|| sqlite_claims(dir.path(), threads, cfg.run_for))?;
        if threads == 1 {
            single = (ours, redb);
        }
        at64 = ours;
        println!(
            "{threads:>8} | {ours:>12.0} | {redb:>12.0} | {sqlite:>12.0} | {:>8.1}x | {:>8.1}x",
            ours / redb,
            ours / sqlite
        );
    }
    println!(
        "\n1 thread: one durable claim costs {:.0} µs, raw redb insert+commit {:.0} µs: {:.2}x",
        1e6 / single.0,
        1e6 / single.1,
        single.1 / single.0
    );
    let ceiling = median3(|| raw_redb_batched(dir.path(), 64, cfg.run_for))?;
    println!(
        "raw redb batched perfectly (64 claims per commit from one thread, the same keyed \
         table): {ceiling:.0}/s; idemstore at 64 threads: {:.2}x that",
        at64 / ceiling
    );
    let none = median3(|| idemstore_claims(dir.path(), 1, cfg.run_for, Durability::None, false))?;
    let raw_none = median3(|| raw_redb_non_durable(dir.path(), cfg.run_for))?;
    println!(
        "Durability::None, 1 thread, one claim per call: {none:.0} claims/s; raw redb with a \
         non-durable commit per claim {raw_none:.0}/s: {:.1}x",
        none / raw_none
    );
    let many = median3(|| idemstore_claim_many(dir.path(), cfg.run_for, Durability::None))?;
    let many_durable =
        median3(|| idemstore_claim_many(dir.path(), cfg.run_for, Durability::Immediate))?;
    println!(
        "claim_many of 100 keys per call, 1 thread: {many:.0} claims/s under Durability::None, \
         {many_durable:.0} durable"
    );

    quick_repair_table(dir.path(), &cfg)?;
    shared_table(dir.path(), &cfg)
}

/// The application's table a claim's effect writes to.
const EFFECTS: TableDefinition<&str, u64> = TableDefinition::new("app.effects");

/// Claims with a one-row effect (`Inbox::claim_with`) beside plain claims
/// and raw redb's one commit per claim, from 1 and 64 threads.
fn effects_table(dir: &Path, cfg: &Config) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "durable claims with a one-row effect, per second ({} s per cell, medians of 3)\n",
        cfg.run_for.as_secs_f64()
    );
    println!(
        "{:>8} | {:>12} | {:>12} | {:>12} | {:>9} | {:>9}",
        "threads", "with effect", "plain", "raw redb", "vs plain", "vs redb"
    );
    println!("{}", "-".repeat(78));
    for threads in [1usize, 64] {
        let effect = median3(|| idemstore_effects(dir, threads, cfg.run_for))?;
        let plain =
            median3(|| idemstore_claims(dir, threads, cfg.run_for, Durability::Immediate, false))?;
        let redb = median3(|| raw_redb_claims(dir, threads, cfg.run_for))?;
        println!(
            "{threads:>8} | {effect:>12.0} | {plain:>12.0} | {redb:>12.0} | {:>8.2}x | {:>8.2}x",
            effect / plain,
            effect / redb
        );
    }
    let (rate, per_fsync) = effects_run(dir, 64, cfg.run_for)?;
    println!(
        "\n64 threads with an effect, one more run: {rate:.0}/s, {per_fsync:.1} claims per fsync"
    );
    Ok(())
}

fn idemstore_effects(
    dir: &Path,
    threads: usize,
    run_for: Duration,
) -> Result<f64, Box<dyn std::error::Error>> {
    Ok(effects_run(dir, threads, run_for)?.0)
}

/// One run of claims with an effect: claims per second, and claims per
/// durable commit (per fsync).
fn effects_run(
    dir: &Path,
    threads: usize,
    run_for: Duration,
) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    let store = Store::open(fresh(dir, "effects.idem"))?;
    let inbox = store.inbox("bench")?;
    let before = store.commit_stats();
    let rate = drive(threads, run_for, move |t, n| {
        let key = format!("evt-{t}-{n}");
        let claim = inbox
            .claim_with(&key, Utc::now(), |tx| {
                tx.open_table(EFFECTS)?.insert(key.as_str(), n)?;
                Ok::<_, idemstore::Error>(())
            })
            .expect("claim with effect");
        assert!(claim.is_applied());
    });
    let after = store.commit_stats();
    let fsyncs = after
        .durable_commits
        .saturating_sub(before.durable_commits)
        .max(1);
    let claims = rate * run_for.as_secs_f64();
    Ok((rate, claims / fsyncs as f64))
}

/// Several processes, one file: a store held alone against a shared one,
/// several processes sharing one, and raw redb in its multi-process mode
/// with one commit per claim.
fn shared_table(dir: &Path, cfg: &Config) -> Result<(), Box<dyn std::error::Error>> {
    println!("\nseveral processes, one file: durable claims per second (median of 3)");
    println!(
        "{:>30} | {:>12} | {:>18}",
        "", "claims/s", "vs raw MultiWriter"
    );
    println!("{}", "-".repeat(66));
    let raw = median3(|| raw_redb_multi_writer(dir, cfg.run_for))?;
    let row = |what: &str, rate: f64| {
        println!("{what:>30} | {rate:>12.0} | {:>17.1}x", rate / raw);
    };
    row("raw redb MultiWriter, 1 thread", raw);
    for threads in [1usize, 64] {
        let alone =
            median3(|| idemstore_claims(dir, threads, cfg.run_for, Durability::Immediate, false))?;
        let shared = median3(|| shared_claims(dir, 1, threads, cfg.run_for))?;
        row(&format!("exclusive, {threads} threads"), alone);
        row(&format!("shared, 1 process x {threads}"), shared);
    }
    for processes in [1usize, 2, 4] {
        let rate = median3(|| shared_claims(dir, processes, 16, cfg.run_for))?;
        row(&format!("shared, {processes} processes x 16"), rate);
    }
    Ok(())
}

/// Raw redb opened for several processes (`MultiWriter`), one thread, one
/// durable commit per claim.
fn raw_redb_multi_writer(dir: &Path, run_for: Duration) -> Result<f64, Box<dyn std::error::Error>> {
    let db = Arc::new(
        Database::builder()
            .set_concurrency_mode(idemstore::redb::ConcurrencyMode::MultiWriter)
            .create(fresh(dir, "raw-multi.redb"))?,
    );
    let now = Utc::now().timestamp_micros();
    Ok(drive(1, run_for, move |t, n| {
        let key = format!("evt-{t}-{n}");
        let tx = db.begin_write().expect("begin");
        {
            let mut table = tx.open_table(RAW).expect("table");
            if table.get(("bench", key.as_str())).expect("get").is_none() {
                table.insert(("bench", key.as_str()), now).expect("insert");
            }
        }
        tx.commit().expect("commit");
    }))
}

/// `processes` child processes of `threads` threads each claim fresh keys
/// in one shared store for `run_for`; returns their claims per second
/// together. The children open the store first and start together.
fn shared_claims(
    dir: &Path,
    processes: usize,
    threads: usize,
    run_for: Duration,
) -> Result<f64, Box<dyn std::error::Error>> {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};
    let path = fresh(dir, "shared.idem");
    drop(Store::builder().shared(true).open(&path)?);
    let mut children = Vec::new();
    for p in 0..processes {
        let mut child = Command::new(std::env::current_exe()?)
            .arg("--claiming-child")
            .arg(&path)
            .arg(threads.to_string())
            .arg(p.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let mut out = BufReader::new(child.stdout.take().expect("piped"));
        let mut ready = String::new();
        out.read_line(&mut ready)?;
        assert_eq!(ready.trim(), "ready");
        children.push((child, out));
    }
    for (child, _) in &mut children {
        writeln!(child.stdin.as_mut().expect("piped"), "go")?;
    }
    std::thread::sleep(run_for);
    let mut claims = 0u64;
    for (mut child, mut out) in children {
        drop(child.stdin.take());
        let mut line = String::new();
        out.read_line(&mut line)?;
        claims += line.trim().parse::<u64>()?;
        assert!(child.wait()?.success());
    }
    Ok(claims as f64 / run_for.as_secs_f64())
}

/// A child of [`shared_claims`]: opens the store, says `ready`, claims from
/// `threads` threads from `go` until its stdin closes, then prints how many.
fn claiming_child(
    path: &Path,
    threads: usize,
    me: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let store = Store::builder().shared(true).open(path)?;
    let inbox = store.inbox("bench")?;
    println!("ready");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (inbox, stop, done) = (inbox.clone(), stop.clone(), done.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let first = inbox
                        .claim(&format!("evt-{me}-{t}-{n}"), Utc::now())
                        .expect("claim");
                    assert!(first);
                    n += 1;
                }
                done.fetch_add(n, Ordering::Relaxed);
            })
        })
        .collect();
    // Until the parent closes stdin.
    let _ = std::io::stdin().read_line(&mut line);
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().expect("worker panicked");
    }
    println!("{}", done.load(Ordering::Relaxed));
    Ok(())
}

/// Commit cost against reopen time after a crash, with quick repair off and on.
fn quick_repair_table(dir: &Path, cfg: &Config) -> Result<(), Box<dyn std::error::Error>> {
    println!("\nquick repair: commit cost vs reopen time after a crash");
    println!(
        "{:>13} | {:>14} | {:>15} | {:>16}",
        "quick_repair", "1 thread /s", "64 threads /s", "reopen after kill"
    );
    println!("{}", "-".repeat(68));
    for quick_repair in [false, true] {
        let one =
            median3(|| idemstore_claims(dir, 1, cfg.run_for, Durability::Immediate, quick_repair))?;
        let many = median3(|| {
            idemstore_claims(dir, 64, cfg.run_for, Durability::Immediate, quick_repair)
        })?;
        let reopen = reopen_after_crash(dir, quick_repair, cfg.crash_mib)?;
        println!(
            "{:>13} | {one:>14.0} | {many:>15.0} | {:>10.0} ms ({} MiB file)",
            quick_repair,
            reopen.0.as_secs_f64() * 1e3,
            reopen.1 / (1024 * 1024)
        );
    }
    Ok(())
}

fn median3(
    mut f: impl FnMut() -> Result<f64, Box<dyn std::error::Error>>,
) -> Result<f64, Box<dyn std::error::Error>> {
    let mut v = [f()?, f()?, f()?];
    v.sort_by(f64::total_cmp);
    Ok(v[1])
}

/// Runs `threads` workers calling `claim` on fresh keys for `run_for`;
/// returns calls per second.
fn drive(
    threads: usize,
    run_for: Duration,
    work: impl Fn(usize, u64) + Send + Sync + 'static,
) -> f64 {
    let work = Arc::new(work);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let barrier = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (work, stop, done, barrier) =
                (work.clone(), stop.clone(), done.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    work(t, n);
                    n += 1;
                }
                done.fetch_add(n, Ordering::Relaxed);
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    std::thread::sleep(run_for);
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().expect("worker panicked");
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

fn fresh(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    let _ = std::fs::remove_file(&p);
    p
}

fn idemstore_claims(
    dir: &Path,
    threads: usize,
    run_for: Duration,
    durability: Durability,
    quick_repair: bool,
) -> Result<f64, Box<dyn std::error::Error>> {
    let store = Store::builder()
        .durability(durability)
        .quick_repair(quick_repair)
        .open(fresh(dir, "idemstore.idem"))?;
    let inbox = store.inbox("bench")?;
    Ok(drive(threads, run_for, move |t, n| {
        // A claim is stamped with the time it is received, as a service
        // would, so the `seen_at` index grows at its end.
        let first = inbox
            .claim(&format!("evt-{t}-{n}"), Utc::now())
            .expect("claim");
        assert!(first);
    }))
}

fn idemstore_claim_many(
    dir: &Path,
    run_for: Duration,
    durability: Durability,
) -> Result<f64, Box<dyn std::error::Error>> {
    let store = Store::builder()
        .durability(durability)
        .open(fresh(dir, "many.idem"))?;
    let inbox = store.inbox("bench")?;
    let now = Utc::now();
    let calls = drive(1, run_for, move |_, n| {
        let keys: Vec<String> = (0..100).map(|i| format!("evt-{n}-{i}")).collect();
        inbox.claim_many(&keys, now).expect("claim_many");
    });
    Ok(calls * 100.0)
}

fn raw_redb_claims(
    dir: &Path,
    threads: usize,
    run_for: Duration,
) -> Result<f64, Box<dyn std::error::Error>> {
    let db = Arc::new(Database::create(fresh(dir, "raw.redb"))?);
    let now = Utc::now().timestamp_micros();
    Ok(drive(threads, run_for, move |t, n| {
        let key = format!("evt-{t}-{n}");
        let tx = db.begin_write().expect("begin");
        {
            let mut table = tx.open_table(RAW).expect("table");
            if table.get(("bench", key.as_str())).expect("get").is_none() {
                table.insert(("bench", key.as_str()), now).expect("insert");
            }
        }
        tx.commit().expect("commit");
    }))
}

/// What batching alone can reach with a keyed table: one thread inserting
/// `batch` claims spread like the threads' keys (each lands in its own
/// leaf), then committing once.
fn raw_redb_batched(
    dir: &Path,
    batch: u64,
    run_for: Duration,
) -> Result<f64, Box<dyn std::error::Error>> {
    let db = Database::create(fresh(dir, "batched.redb"))?;
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < run_for {
        let tx = db.begin_write()?;
        {
            let mut rows = tx.open_table(RAW)?;
            for t in 0..batch {
                let key = format!("evt-{t}-{n}");
                if rows.get(("bench", key.as_str()))?.is_none() {
                    rows.insert(("bench", key.as_str()), Utc::now().timestamp_micros())?;
                }
            }
        }
        tx.commit()?;
        n += 1;
    }
    Ok((n * batch) as f64 / start.elapsed().as_secs_f64())
}

/// Raw redb with one non-durable commit per claim, from one thread.
fn raw_redb_non_durable(dir: &Path, run_for: Duration) -> Result<f64, Box<dyn std::error::Error>> {
    let db = Arc::new(Database::create(fresh(dir, "raw-none.redb"))?);
    let now = Utc::now().timestamp_micros();
    Ok(drive(1, run_for, move |_, n| {
        let key = format!("evt-{n}");
        let mut tx = db.begin_write().expect("begin");
        tx.set_durability(idemstore::redb::Durability::None)
            .expect("durability");
        {
            let mut table = tx.open_table(RAW).expect("table");
            table.insert(("bench", key.as_str()), now).expect("insert");
        }
        tx.commit().expect("commit");
    }))
}

fn sqlite_claims(
    dir: &Path,
    threads: usize,
    run_for: Duration,
) -> Result<f64, Box<dyn std::error::Error>> {
    let path = fresh(dir, "sqlite.db");
    let _ = std::fs::remove_file(path.with_extension("db-wal"));
    let _ = std::fs::remove_file(path.with_extension("db-shm"));
    {
        let c = rusqlite::Connection::open(&path)?;
        c.pragma_update(None, "journal_mode", "WAL")?;
        c.execute_batch(
            "CREATE TABLE inbox (name TEXT NOT NULL, key TEXT NOT NULL, seen_at INTEGER NOT NULL,
                                 PRIMARY KEY (name, key)) WITHOUT ROWID;",
        )?;
    }
    let now = Utc::now().timestamp_micros();
    let conns: Vec<_> = (0..threads)
        .map(|_| {
            let c = rusqlite::Connection::open(&path).expect("open");
            c.pragma_update(None, "synchronous", "FULL")
                .expect("pragma");
            c.busy_timeout(Duration::from_secs(30)).expect("busy");
            parking_lot::Mutex::new(c)
        })
        .collect();
    let conns = Arc::new(conns);
    Ok(drive(threads, run_for, move |t, n| {
        let c = conns[t].lock();
        c.prepare_cached(
            "INSERT INTO inbox (name, key, seen_at) VALUES (?1, ?2, ?3) ON CONFLICT DO NOTHING",
        )
        .expect("prepare")
        .execute(rusqlite::params!["bench", format!("evt-{t}-{n}"), now])
        .expect("insert");
    }))
}

/// Kills a child process that is writing a store of about `mib` MiB and
/// times the reopen (the repair).
fn reopen_after_crash(
    dir: &Path,
    quick_repair: bool,
    mib: u64,
) -> Result<(Duration, u64), Box<dyn std::error::Error>> {
    let path = fresh(dir, "crash.idem");
    let status = std::process::Command::new(std::env::current_exe()?)
        .arg("--crash-child")
        .arg(&path)
        .arg(if quick_repair { "quick" } else { "full" })
        .arg(mib.to_string())
        .status()?;
    assert!(!status.success(), "the child aborts on purpose");
    let size = std::fs::metadata(&path)?.len();
    let start = Instant::now();
    let store = Store::builder().quick_repair(quick_repair).open(&path)?;
    let took = start.elapsed();
    assert!(store.inbox("bulk")?.len()? > 0);
    Ok((took, size))
}

fn crash_child(
    path: &Path,
    quick_repair: bool,
    mib: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    let store = Store::builder().quick_repair(quick_repair).open(path)?;
    let inbox = store.inbox("bulk")?;
    let now = Utc::now();
    let pad = "x".repeat(200);
    let mut n = 0u64;
    while std::fs::metadata(path)?.len() < mib * 1024 * 1024 {
        let keys: Vec<String> = (0..2000).map(|i| format!("{pad}-{n}-{i}")).collect();
        inbox.claim_many(&keys, now)?;
        n += 1;
    }
    // A crash: no clean close, no destructors.
    std::process::abort();
}
