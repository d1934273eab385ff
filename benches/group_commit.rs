//! Durable claims from 1, 16 and 64 threads: idemstore (group commit), raw
//! redb (one commit per claim) and SQLite (WAL, `synchronous=FULL`, one
//! connection per thread), in the same run. Criterion reports the time per
//! claim; `benches/bin/throughput.rs` prints the same comparison as a table of
//! claims per second with ratios. A last group compares one thread's
//! claims under `Durability::None` with raw redb's non-durable commits.
//!
//! `cargo bench -p idemstore-benches --bench group_commit`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use chrono::Utc;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use idemstore::redb::{Database, ReadableTable, TableDefinition};
use idemstore::{Durability, Store};

const RAW: TableDefinition<(&str, &str), i64> = TableDefinition::new("raw.inbox");

/// Calls each thread makes at least, per sample: with fewer, thread start-up
/// and `SQLite`'s busy-handler sleeps (up to 100 ms) swamp the figure.
const MIN_PER_THREAD: u64 = 50;

/// Runs about `iters` calls of `f(thread, n)` spread over `threads` threads
/// (at least [`MIN_PER_THREAD`] each); returns the wall time scaled to
/// `iters` calls.
fn spread(threads: usize, iters: u64, f: &Arc<dyn Fn(usize, u64) + Send + Sync>) -> Duration {
    let barrier = Arc::new(Barrier::new(threads + 1));
    let per = iters.div_ceil(threads as u64).max(MIN_PER_THREAD);
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (f, barrier) = (f.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for n in 0..per {
                    f(t, n);
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for h in handles {
        h.join().expect("bench thread panicked");
    }
    let calls = per * threads as u64;
    start.elapsed().mul_f64(iters as f64 / calls as f64)
}

fn claims(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let mut group = c.benchmark_group("durable claims");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    let round = Arc::new(AtomicU64::new(0));
    for threads in [1usize, 16, 64] {
        group.throughput(Throughput::Elements(1));

        let store = Store::open(dir.path().join(format!("idemstore-{threads}.idem"))).unwrap();
        let inbox = store.inbox("bench").unwrap();
        let r = round.clone();
        let f: Arc<dyn Fn(usize, u64) + Send + Sync> = Arc::new(move |t, n| {
            let key = format!("{}-{t}-{n}", r.load(Ordering::Relaxed));
            assert!(inbox.claim(&key, Utc::now()).unwrap());
        });
        group.bench_with_input(
            BenchmarkId::new("idemstore", threads),
            &threads,
            |b, &threads| {
                b.iter_custom(|iters| {
                    round.fetch_add(1, Ordering::Relaxed);
                    spread(threads, iters, &f)
                });
            },
        );

        let db =
            Arc::new(Database::create(dir.path().join(format!("raw-{threads}.redb"))).unwrap());
        let r = round.clone();
        let f: Arc<dyn Fn(usize, u64) + Send + Sync> = Arc::new(move |t, n| {
            let key = format!("{}-{t}-{n}", r.load(Ordering::Relaxed));
            let tx = db.begin_write().unwrap();
            {
                let mut table = tx.open_table(RAW).unwrap();
                if table.get(("bench", key.as_str())).unwrap().is_none() {
                    table.insert(("bench", key.as_str()), 1).unwrap();
                }
            }
            tx.commit().unwrap();
        });
        group.bench_with_input(
            BenchmarkId::new("raw redb", threads),
            &threads,
            |b, &threads| {
                b.iter_custom(|iters| {
                    round.fetch_add(1, Ordering::Relaxed);
                    spread(threads, iters, &f)
                });
            },
        );

        let path = dir.path().join(format!("sqlite-{threads}.db"));
        {
            let c = rusqlite::Connection::open(&path).unwrap();
            c.pragma_update(None, "journal_mode", "WAL").unwrap();
            c.execute_batch(
                "CREATE TABLE inbox (name TEXT NOT NULL, key TEXT NOT NULL, seen_at INTEGER NOT NULL,
                                     PRIMARY KEY (name, key)) WITHOUT ROWID;",
            )
            .unwrap();
        }
        let conns: Vec<_> = (0..threads)
            .map(|_| {
                let c = rusqlite::Connection::open(&path).unwrap();
                c.pragma_update(None, "synchronous", "FULL").unwrap();
                c.busy_timeout(Duration::from_secs(60)).unwrap();
                parking_lot::Mutex::new(c)
            })
            .collect();
        let r = round.clone();
        let f: Arc<dyn Fn(usize, u64) + Send + Sync> = Arc::new(move |t, n| {
            let key = format!("{}-{t}-{n}", r.load(Ordering::Relaxed));
            conns[t]
                .lock()
                .prepare_cached("INSERT INTO inbox VALUES ('bench', ?1, 0) ON CONFLICT DO NOTHING")
                .unwrap()
                .execute([key])
                .unwrap();
        });
        group.bench_with_input(
            BenchmarkId::new("SQLite FULL", threads),
            &threads,
            |b, &threads| {
                b.iter_custom(|iters| {
                    round.fetch_add(1, Ordering::Relaxed);
                    spread(threads, iters, &f)
                });
            },
        );
    }
    group.finish();
}

/// One thread, one claim per call, under `Durability::None`: idemstore
/// against raw redb committing each claim without fsync.
fn non_durable_claims(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let mut group = c.benchmark_group("non-durable claims, 1 thread");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(1));
    let store = Store::builder()
        .durability(Durability::None)
        .open(dir.path().join("none.idem"))
        .unwrap();
    let inbox = store.inbox("bench").unwrap();
    let mut n = 0u64;
    group.bench_function("idemstore", |b| {
        b.iter(|| {
            n += 1;
            assert!(inbox.claim(&format!("evt-{n}"), Utc::now()).unwrap());
        });
    });
    let db = Database::create(dir.path().join("none.redb")).unwrap();
    let mut n = 0u64;
    group.bench_function("raw redb", |b| {
        b.iter(|| {
            n += 1;
            let key = format!("evt-{n}");
            let mut tx = db.begin_write().unwrap();
            tx.set_durability(idemstore::redb::Durability::None)
                .unwrap();
            tx.open_table(RAW)
                .unwrap()
                .insert(("bench", key.as_str()), 1)
                .unwrap();
            tx.commit().unwrap();
        });
    });
    group.finish();
}

criterion_group!(benches, claims, non_durable_claims);
criterion_main!(benches);
