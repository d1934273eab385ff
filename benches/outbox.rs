//! Outbox benchmarks, each figure printed beside its baseline from the same
//! run:
//!
//! - `claim_due(100)` at a 5k and a 200k backlog (the claim must not slow
//!   down with the backlog: target ratio ≤ 1.5×), beside `SQLite`'s
//!   `UPDATE … RETURNING` claim at the same backlogs. Both without fsync
//!   (`Durability::None`, `synchronous=OFF`) so the figures show the index
//!   work, not the disk.
//! - enqueue → claim → complete cycles, durable (`Durability::Immediate`
//!   against `SQLite` WAL with `synchronous=FULL`): one entry per cycle, and
//!   100 entries per cycle through the bulk calls, and one entry per cycle
//!   from 8 threads at once (where group commit shares fsyncs).
//!
//! Run with `cargo bench -p idemstore-benches --bench outbox`.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeZone, Utc};
use criterion::Criterion;
use idemstore::{Durability, NewEntry, Outbox, Settlement, Store};
use rusqlite::{Connection, params};

const PAYLOAD: [u8; 64] = [7; 64];
const CLAIM: usize = 100;

fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

/// Total time and iterations of each benchmark, for the printed summary.
static FIGURES: Mutex<BTreeMap<&'static str, (Duration, u64)>> = Mutex::new(BTreeMap::new());

fn record(name: &'static str, elapsed: Duration, iters: u64) {
    let mut figures = FIGURES.lock().unwrap();
    let slot = figures.entry(name).or_default();
    slot.0 += elapsed;
    slot.1 += iters;
}

/// Mean time per iteration of a benchmark, in µs (NaN if it did not run).
fn micros_per_iter(name: &str) -> f64 {
    let figures = FIGURES.lock().unwrap();
    let Some(&(elapsed, iters)) = figures.get(name) else {
        return f64::NAN;
    };
    #[expect(clippy::cast_precision_loss, reason = "iteration counts are small")]
    let iters = iters.max(1) as f64;
    elapsed.as_secs_f64() * 1e6 / iters
}

fn entry(i: u64) -> NewEntry {
    NewEntry::new(
        format!("cmd-{}", i / 10),
        "billing",
        format!("key-{i}"),
        PAYLOAD.to_vec(),
    )
}

// ---------- idemstore ----------

fn no_sync_store(path: &Path) -> Store {
    Store::builder()
        .durability(Durability::None)
        .flush_interval(Duration::from_secs(30))
        .open(path)
        .unwrap()
}

fn fill_outbox(outbox: &Outbox, n: u64) {
    let chunk = 5_000;
    let mut start = 0;
    while start < n {
        let end = (start + chunk).min(n);
        outbox.enqueue_many((start..end).map(entry), t(0)).unwrap();
        start = end;
    }
}

/// Times `claim_due(100)`; puts the claimed entries back (untimed) so the
/// backlog stays the same.
fn claim_round(outbox: &Outbox, iters: u64) -> Duration {
    let mut timed = Duration::ZERO;
    for _ in 0..iters {
        let start = Instant::now();
        let claimed = outbox.claim_due(t(10), CLAIM, "bench").unwrap();
        timed += start.elapsed();
        assert_eq!(claimed.len(), CLAIM);
        let back = claimed.iter().map(|e| {
            (
                e.fence(),
                Settlement::Rescheduled {
                    next_attempt_at: e.due_at(),
                },
            )
        });
        for r in outbox.settle_many(back, t(10)).unwrap() {
            r.unwrap();
        }
    }
    timed
}

// ---------- SQLite ----------

fn sqlite(path: &Path, synchronous: &str) -> Connection {
    let conn = Connection::open(path).unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    conn.pragma_update(None, "synchronous", synchronous)
        .unwrap();
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS outbox (
            id INTEGER PRIMARY KEY,
            command_id TEXT NOT NULL,
            destination TEXT NOT NULL,
            idempotency_key TEXT NOT NULL,
            payload BLOB NOT NULL,
            status INTEGER NOT NULL,
            attempt_count INTEGER NOT NULL,
            due_at INTEGER NOT NULL,
            created_at INTEGER NOT NULL,
            completed_at INTEGER,
            worker_id TEXT,
            claimed_at INTEGER,
            UNIQUE (destination, idempotency_key)
        );
        CREATE INDEX IF NOT EXISTS outbox_due ON outbox (due_at, id) WHERE status = 0;
        CREATE INDEX IF NOT EXISTS outbox_claimed ON outbox (claimed_at, id) WHERE status = 1;
        CREATE INDEX IF NOT EXISTS outbox_command ON outbox (command_id, created_at, id);",
    )
    .unwrap();
    conn
}

const SQL_INSERT: &str = "INSERT INTO outbox
    (command_id, destination, idempotency_key, payload, status, attempt_count, due_at, created_at)
    VALUES (?1, ?2, ?3, ?4, 0, 0, ?5, ?5)
    ON CONFLICT (destination, idempotency_key) DO NOTHING";

const SQL_CLAIM: &str = "UPDATE outbox
    SET status = 1, attempt_count = attempt_count + 1, worker_id = ?1, claimed_at = ?2
    WHERE id IN (SELECT id FROM outbox WHERE status = 0 AND due_at <= ?2
                 ORDER BY due_at, id LIMIT ?3)
    RETURNING id, attempt_count, command_id, destination, idempotency_key, payload";

const SQL_COMPLETE: &str = "UPDATE outbox SET status = 2, completed_at = ?2, worker_id = NULL
    WHERE id = ?1 AND attempt_count = ?3 AND status IN (1, 4)";

fn sql_insert(conn: &Connection, i: u64) {
    let e = entry(i);
    conn.prepare_cached(SQL_INSERT)
        .unwrap()
        .execute(params![
            e.command_id,
            e.destination,
            e.idempotency_key,
            e.payload,
            0
        ])
        .unwrap();
}

/// Claims up to `limit`; returns `(id, attempt)` pairs.
fn sql_claim(conn: &Connection, limit: i64) -> Vec<(i64, i64)> {
    let mut stmt = conn.prepare_cached(SQL_CLAIM).unwrap();
    let rows = stmt
        .query_map(params!["bench", 10, limit], |row| {
            let payload: Vec<u8> = row.get(5)?;
            black_box(payload);
            Ok((row.get(0)?, row.get(1)?))
        })
        .unwrap();
    rows.map(Result::unwrap).collect()
}

fn sql_complete(conn: &Connection, claimed: &[(i64, i64)]) {
    let mut stmt = conn.prepare_cached(SQL_COMPLETE).unwrap();
    for (id, attempt) in claimed {
        assert_eq!(stmt.execute(params![id, 20, attempt]).unwrap(), 1);
    }
}

fn fill_sqlite(conn: &mut Connection, n: u64) {
    let tx = conn.transaction().unwrap();
    for i in 0..n {
        sql_insert(&tx, i);
    }
    tx.commit().unwrap();
}

fn sql_claim_round(conn: &mut Connection, iters: u64) -> Duration {
    let mut timed = Duration::ZERO;
    for _ in 0..iters {
        let start = Instant::now();
        let claimed = sql_claim(conn, 100);
        timed += start.elapsed();
        assert_eq!(claimed.len(), CLAIM);
        let tx = conn.transaction().unwrap();
        {
            let mut back = tx
                .prepare_cached("UPDATE outbox SET status = 0, worker_id = NULL WHERE id = ?1")
                .unwrap();
            for (id, _) in &claimed {
                back.execute(params![id]).unwrap();
            }
        }
        tx.commit().unwrap();
    }
    timed
}

// ---------- benchmarks ----------

fn claim_scaling(c: &mut Criterion) {
    let mut group = c.benchmark_group("claim_due_100");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for (backlog, name, sql_name) in [
        (5_000, "idemstore/5k", "sqlite/5k"),
        (200_000, "idemstore/200k", "sqlite/200k"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let store = no_sync_store(&dir.path().join("claim.idem"));
        let outbox = store.outbox();
        fill_outbox(&outbox, backlog);
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let d = claim_round(&outbox, iters);
                record(name, d, iters);
                d
            });
        });
        drop(store);
        let mut conn = sqlite(&dir.path().join("claim.sqlite"), "OFF");
        fill_sqlite(&mut conn, backlog);
        group.bench_function(sql_name, |b| {
            b.iter_custom(|iters| {
                let d = sql_claim_round(&mut conn, iters);
                record(sql_name, d, iters);
                d
            });
        });
    }
    group.finish();
}

fn cycles(c: &mut Criterion) {
    let mut group = c.benchmark_group("cycle_durable");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(4));
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("cycle.idem")).unwrap();
    let outbox = store.outbox();
    let mut next = 0_u64;
    group.bench_function("idemstore/1", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                outbox.enqueue(entry(next), t(0)).unwrap();
                next += 1;
                let claimed = outbox.claim_due(t(10), 1, "bench").unwrap();
                outbox
                    .settle(claimed[0].fence(), Settlement::Completed, t(20))
                    .unwrap();
            }
            let d = start.elapsed();
            record("cycle idemstore/1", d, iters);
            d
        });
    });
    group.bench_function("idemstore/100", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                outbox
                    .enqueue_many((next..next + 100).map(entry), t(0))
                    .unwrap();
                next += 100;
                let claimed = outbox.claim_due(t(10), 100, "bench").unwrap();
                let done = claimed.iter().map(|e| (e.fence(), Settlement::Completed));
                for r in outbox.settle_many(done, t(20)).unwrap() {
                    r.unwrap();
                }
            }
            let d = start.elapsed();
            record("cycle idemstore/100", d, iters);
            d
        });
    });
    drop(store);
    let mut conn = sqlite(&dir.path().join("cycle.sqlite"), "FULL");
    group.bench_function("sqlite/1", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                sql_insert(&conn, next);
                next += 1;
                let claimed = sql_claim(&conn, 1);
                sql_complete(&conn, &claimed);
            }
            let d = start.elapsed();
            record("cycle sqlite/1", d, iters);
            d
        });
    });
    group.bench_function("sqlite/100", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                let tx = conn.transaction().unwrap();
                for i in next..next + 100 {
                    sql_insert(&tx, i);
                }
                tx.commit().unwrap();
                next += 100;
                let claimed = sql_claim(&conn, 100);
                let tx = conn.transaction().unwrap();
                sql_complete(&tx, &claimed);
                tx.commit().unwrap();
            }
            let d = start.elapsed();
            record("cycle sqlite/100", d, iters);
            d
        });
    });
    group.finish();
}

/// Threads in the concurrent cycle benchmark.
const THREADS: u64 = 8;

/// Runs `cycle(thread, n)` on [`THREADS`] threads, `iters` cycles in all;
/// returns the wall time.
fn on_threads(iters: u64, cycle: impl Fn(u64, u64) + Sync) -> Duration {
    let per_thread = iters.div_ceil(THREADS);
    let start = Instant::now();
    std::thread::scope(|s| {
        for thread in 0..THREADS {
            let cycle = &cycle;
            s.spawn(move || cycle(thread, per_thread));
        }
    });
    start.elapsed()
}

fn concurrent_cycles(c: &mut Criterion) {
    let mut group = c.benchmark_group("cycle_durable_8_threads");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(4));
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("threads.idem")).unwrap();
    let outbox = store.outbox();
    let round = std::sync::atomic::AtomicU64::new(0);
    group.bench_function("idemstore", |b| {
        b.iter_custom(|iters| {
            let base = round.fetch_add(1, std::sync::atomic::Ordering::Relaxed) << 32;
            let d = on_threads(iters, |thread, n| {
                let worker = format!("w{thread}");
                for i in 0..n {
                    let key = base | (thread << 24) | i;
                    outbox.enqueue(entry(key), t(0)).unwrap();
                    for e in outbox.claim_due(t(10), 1, &worker).unwrap() {
                        outbox
                            .settle(e.fence(), Settlement::Completed, t(20))
                            .unwrap();
                    }
                }
            });
            record("threads idemstore", d, iters.div_ceil(THREADS) * THREADS);
            d
        });
    });
    drop(store);
    let path = dir.path().join("threads.sqlite");
    drop(sqlite(&path, "FULL"));
    group.bench_function("sqlite", |b| {
        b.iter_custom(|iters| {
            let base = round.fetch_add(1, std::sync::atomic::Ordering::Relaxed) << 32;
            let d = on_threads(iters, |thread, n| {
                let conn = sqlite(&path, "FULL");
                conn.busy_timeout(Duration::from_secs(30)).unwrap();
                for i in 0..n {
                    sql_insert(&conn, base | (thread << 24) | i);
                    let claimed = sql_claim(&conn, 1);
                    sql_complete(&conn, &claimed);
                }
            });
            record("threads sqlite", d, iters.div_ceil(THREADS) * THREADS);
            d
        });
    });
    group.finish();
}

fn summary() {
    let small = micros_per_iter("idemstore/5k");
    let large = micros_per_iter("idemstore/200k");
    let sql_small = micros_per_iter("sqlite/5k");
    let sql_large = micros_per_iter("sqlite/200k");
    println!();
    println!("== outbox summary (means over all timed iterations) ==");
    println!("claim_due(100), no fsync:");
    println!(
        "  idemstore  5k: {small:8.1} µs   200k: {large:8.1} µs   200k/5k = {:.2}x (target <= 1.5x)",
        large / small
    );
    println!(
        "  SQLite     5k: {sql_small:8.1} µs   200k: {sql_large:8.1} µs   200k/5k = {:.2}x",
        sql_large / sql_small
    );
    println!(
        "  idemstore/SQLite time: 5k {:.2}x, 200k {:.2}x",
        small / sql_small,
        large / sql_large
    );
    let one = 1e6 / micros_per_iter("cycle idemstore/1");
    let sql_one = 1e6 / micros_per_iter("cycle sqlite/1");
    let hundred = 100.0 * 1e6 / micros_per_iter("cycle idemstore/100");
    let sql_hundred = 100.0 * 1e6 / micros_per_iter("cycle sqlite/100");
    println!("enqueue -> claim -> complete, durable (Immediate vs WAL + synchronous=FULL):");
    println!(
        "  1 per cycle:   idemstore {one:9.0} entries/s   SQLite {sql_one:9.0} entries/s   ratio {:.2}x",
        one / sql_one
    );
    println!(
        "  100 per cycle: idemstore {hundred:9.0} entries/s   SQLite {sql_hundred:9.0} entries/s   ratio {:.2}x",
        hundred / sql_hundred
    );
    let threads = 1e6 / micros_per_iter("threads idemstore");
    let sql_threads = 1e6 / micros_per_iter("threads sqlite");
    println!(
        "  {THREADS} threads, 1 per cycle each: idemstore {threads:9.0} entries/s   SQLite {sql_threads:9.0} entries/s   ratio {:.2}x",
        threads / sql_threads
    );
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    claim_scaling(&mut c);
    cycles(&mut c);
    concurrent_cycles(&mut c);
    c.final_summary();
    if !FIGURES.lock().unwrap().is_empty() {
        summary();
    }
}
