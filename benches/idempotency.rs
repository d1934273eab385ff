//! Idempotency keys against raw redb, measured in one run.
//!
//! - replay: `begin` on a completed key (a read, no commit) beside a raw
//!   redb read transaction + `get` of the same bytes;
//! - reserve + complete, durable, from 1 and 32 threads (two durable calls
//!   per request, group-committed across threads) beside raw redb
//!   insert + durable commit;
//! - `put` (one durable call) beside raw redb insert + durable commit.
//!
//! Each figure is printed beside its baseline; absolute numbers drift on a
//! shared machine, the ratios less so.

use std::hint::black_box;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeZone, Utc};
use criterion::{Criterion, criterion_group, criterion_main};
use idemstore::redb::{self, ReadableDatabase as _, ReadableTable as _, TableDefinition};
use idemstore::{Begin, IdempotencyKeys, ResponseRecord, Store, fingerprint};

const RAW: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("raw");
const RUN: Duration = Duration::from_secs(2);

fn now() -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000, 0).unwrap()
}

fn response(key: &str, fp: &str) -> ResponseRecord {
    ResponseRecord::new("bench", key, fp, 201, vec![b'x'; 256], now())
        .content_type("application/json")
        .header("location", "/orders/123")
}

fn raw_db(dir: &Path, name: &str) -> redb::Database {
    redb::Database::create(dir.join(name)).expect("raw redb")
}

/// Runs `op` for `RUN` from `threads` threads; returns operations per second.
fn throughput(threads: usize, op: impl Fn(usize, u64) + Send + Sync + 'static) -> f64 {
    let op = Arc::new(op);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (op, stop, done) = (op.clone(), stop.clone(), done.clone());
            std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    op(t, i);
                    i += 1;
                }
                done.fetch_add(i, Ordering::Relaxed);
            })
        })
        .collect();
    std::thread::sleep(RUN);
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().expect("bench thread");
    }
    #[expect(clippy::cast_precision_loss, reason = "a rate for printing")]
    let rate = done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();
    rate
}

fn replay(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s.idem")).unwrap();
    let keys = store.idempotency_keys();
    let fp = fingerprint("POST", "/orders", b"{}");
    assert!(keys.put(&response("replayed", &fp)).unwrap());
    assert!(matches!(
        keys.begin("bench", "replayed", &fp, now()).unwrap(),
        Begin::Replay(_)
    ));

    let raw = raw_db(dir.path(), "raw.redb");
    let tx = raw.begin_write().unwrap();
    tx.open_table(RAW)
        .unwrap()
        .insert(("bench", "replayed"), &[b'x'; 300][..])
        .unwrap();
    tx.commit().unwrap();

    let mut group = c.benchmark_group("idempotency/replay");
    group.bench_function("begin_on_completed_key", |b| {
        b.iter(|| black_box(keys.begin("bench", "replayed", &fp, now()).unwrap()));
    });
    group.bench_function("raw_redb_read_get", |b| {
        b.iter(|| {
            let tx = raw.begin_read().unwrap();
            let t = tx.open_table(RAW).unwrap();
            black_box(
                t.get(("bench", "replayed"))
                    .unwrap()
                    .map(|v| v.value().to_vec()),
            )
        });
    });
    group.finish();

    let handle = keys.clone();
    let fp2 = fp.clone();
    let ours = throughput(1, move |_, _| {
        let _ = black_box(handle.begin("bench", "replayed", &fp2, now()).unwrap());
    });
    let raw = Arc::new(raw);
    let db = raw.clone();
    let base = throughput(1, move |_, _| {
        let tx = db.begin_read().unwrap();
        let t = tx.open_table(RAW).unwrap();
        black_box(
            t.get(("bench", "replayed"))
                .unwrap()
                .map(|v| v.value().to_vec()),
        );
    });
    println!(
        "replay, 1 thread: {ours:>10.0} replays/s | raw redb read+get {base:>10.0}/s | ratio {:.2}",
        ours / base
    );
    println!("  commits during replays: {:?}", store.commit_stats());
}

fn reserve_complete(keys: &IdempotencyKeys, fp: &str, run: usize, thread: usize, i: u64) {
    let key = format!("rc-{run}-{thread}-{i}");
    match keys.begin("bench", &key, fp, now()).unwrap() {
        Begin::Proceed(r) => {
            let resp = r.response(201, vec![b'x'; 256], now());
            assert!(keys.complete(&r, resp, now()).unwrap());
        }
        other => panic!("unexpected {other:?}"),
    }
}

fn raw_insert_commit(db: &redb::Database, run: usize, thread: usize, i: u64) {
    let key = format!("raw-{run}-{thread}-{i}");
    let tx = db.begin_write().unwrap();
    tx.open_table(RAW)
        .unwrap()
        .insert(("bench", key.as_str()), &[b'x'; 300][..])
        .unwrap();
    tx.commit().unwrap();
}

fn durable_writes(_c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("w.idem")).unwrap();
    let keys = store.idempotency_keys();
    let fp = fingerprint("POST", "/orders", b"{}");
    let raw = Arc::new(raw_db(dir.path(), "raw.redb"));

    let r = raw.clone();
    let base1 = throughput(1, move |t, i| raw_insert_commit(&r, 1, t, i));
    let r = raw.clone();
    let base32 = throughput(32, move |t, i| raw_insert_commit(&r, 32, t, i));

    let mut rates = Vec::new();
    for threads in [1, 32] {
        let (k, f) = (keys.clone(), fp.clone());
        let before = store.commit_stats().durable_commits;
        let rate = throughput(threads, move |t, i| reserve_complete(&k, &f, threads, t, i));
        let fsyncs = store.commit_stats().durable_commits - before;
        println!(
            "reserve+complete, {threads:>2} threads: {rate:>8.0} requests/s ({fsyncs} durable commits) | \
             raw redb insert+commit {:>6.0}/s ({threads} threads) | ratio {:.2}",
            if threads == 1 { base1 } else { base32 },
            rate / if threads == 1 { base1 } else { base32 },
        );
        rates.push(rate);
    }
    println!(
        "reserve+complete, 32 threads vs 1 thread: {:.1}x",
        rates[1] / rates[0]
    );

    let (k, f) = (keys.clone(), fp.clone());
    let put = throughput(1, move |t, i| {
        let key = format!("put-{t}-{i}");
        assert!(k.put(&response(&key, &f)).unwrap());
    });
    println!(
        "put, 1 thread: {put:>8.0}/s | raw redb insert+commit {base1:>6.0}/s | ratio {:.2}",
        put / base1
    );
    let (k, f) = (keys.clone(), fp.clone());
    let put32 = throughput(32, move |t, i| {
        let key = format!("put32-{t}-{i}");
        assert!(k.put(&response(&key, &f)).unwrap());
    });
    println!(
        "put, 32 threads: {put32:>8.0}/s | raw redb insert+commit {base32:>6.0}/s (32 threads) | ratio {:.2}",
        put32 / base32
    );
    assert!(keys.check_indexes().unwrap().is_empty());
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);
    targets = replay, durable_writes
}
criterion_main!(benches);
