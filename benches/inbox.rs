//! Durable `claim` and `claim_with` beside a raw redb insert-and-commit,
//! measured in the same run.
//!
//! `cargo bench -p idemstore-benches --bench inbox`

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::Utc;
use criterion::{Criterion, criterion_group, criterion_main};
use idemstore::redb::{Database, ReadableTable, TableDefinition};
use idemstore::{Error, Store};

const RAW: TableDefinition<(&str, &str), i64> = TableDefinition::new("raw.inbox");
const EFFECT: TableDefinition<&str, u64> = TableDefinition::new("app.effects");

fn durable_single_thread(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let mut group = c.benchmark_group("inbox/durable");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(4));
    let n = AtomicU64::new(0);

    let db = Database::create(dir.path().join("raw.redb")).unwrap();
    group.bench_function("raw redb insert+commit", |b| {
        b.iter(|| {
            let key = format!("evt-{}", n.fetch_add(1, Ordering::Relaxed));
            let tx = db.begin_write().unwrap();
            {
                let mut t = tx.open_table(RAW).unwrap();
                if t.get(("bench", key.as_str())).unwrap().is_none() {
                    t.insert(("bench", key.as_str()), 1).unwrap();
                }
            }
            tx.commit().unwrap();
        });
    });

    let store = Store::open(dir.path().join("store.idem")).unwrap();
    let inbox = store.inbox("bench").unwrap();
    let now = Utc::now();
    group.bench_function("idemstore claim", |b| {
        b.iter(|| {
            let key = format!("evt-{}", n.fetch_add(1, Ordering::Relaxed));
            assert!(inbox.claim(&key, now).unwrap());
        });
    });
    group.bench_function("idemstore claim_with (one effect row)", |b| {
        b.iter(|| {
            let i = n.fetch_add(1, Ordering::Relaxed);
            let key = format!("evt-{i}");
            let c = inbox
                .claim_with(&key, now, |tx| {
                    tx.open_table(EFFECT)?.insert(key.as_str(), i)?;
                    Ok::<_, Error>(())
                })
                .unwrap();
            assert!(c.is_applied());
        });
    });
    group.bench_function("idemstore claim (duplicate)", |b| {
        b.iter(|| assert!(!inbox.claim("evt-0", now).unwrap()));
    });
    group.finish();
}

criterion_group!(benches, durable_single_thread);
criterion_main!(benches);
