//! `PgStore`'s `_async` calls: 2,000 tasks on a `current_thread` runtime
//! claim with effects while the runtime keeps ticking; futures dropped at
//! random points leave no claim without its effect and no key reserved;
//! the outbox, the keys and the application's own statements answer
//! through the async forms as through the blocking ones.
//!
//! Needs `IDEMSTORE_TEST_POSTGRES` (see `tests/common/pg.rs`); without it
//! the tests say so and pass, except under `CI=true`.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idemstore::chrono::{DateTime, TimeZone, Utc};
use idemstore::postgres::PgStore;
use idemstore::{Begin, Claim, Enqueued, Error, NewEntry, OutboxStatus, Settlement, fingerprint};

#[macro_use]
mod common;

use common::pg::{DropSchema, client, unique_schema, url};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

/// The threads of this process.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, Iterator::count)
}

/// A store in a fresh schema with an application table `effects (key)`,
/// and the guard that drops the schema.
async fn store(url: &str, pool: u32) -> Result<(PgStore, DropSchema), Error> {
    let schema = unique_schema();
    let store = PgStore::builder()
        .schema(&schema)
        .pool_size(pool)
        .connect_async(url)
        .await?;
    let s = schema.clone();
    store
        .write_async(move |tx| {
            Box::pin(async move {
                tx.batch_execute(&format!("CREATE TABLE {s}.effects (key text PRIMARY KEY)"))
                    .await?;
                Ok::<_, Error>(())
            })
        })
        .await?;
    Ok((
        store,
        DropSchema {
            url: url.to_owned(),
            schema,
        },
    ))
}

/// The application rows written by effects, read on a plain connection.
fn effects(url: &str, schema: &str) -> HashSet<String> {
    client(url)
        .query(&format!("SELECT key FROM {schema}.effects"), &[])
        .expect("the effects")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Claims `key` and, the first time, writes its effect row.
async fn claim_with_effect(
    inbox: &idemstore::postgres::PgInbox,
    schema: &str,
    key: &str,
) -> Result<bool, Error> {
    let sql = format!("INSERT INTO {schema}.effects (key) VALUES ($1)");
    let owned = key.to_owned();
    let out = inbox
        .claim_with_async(key, t(0), move |tx| {
            Box::pin(async move {
                tx.execute(&sql, &[&owned]).await?;
                Ok::<_, Error>(())
            })
        })
        .await?;
    Ok(matches!(out, Claim::Applied(())))
}

#[test]
fn two_thousand_tasks_claim_with_effects_on_one_runtime_thread_while_it_keeps_ticking() -> TestResult
{
    let Some(url) = url() else { return Ok(()) };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let ticks = Arc::new(AtomicU64::new(0));
    let (claimed, peak, before, during, schema, _drop) = runtime.block_on(async {
        let (store, drop) = store(&url, 16).await?;
        let schema = store.schema().to_owned();
        let inbox = store.inbox("webhooks")?;
        let before = threads();
        let ticker = {
            let ticks = ticks.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    ticks.fetch_add(1, Ordering::Relaxed);
                }
            })
        };
        // 2,000 tasks over 500 keys: four deliveries of each.
        let tasks: Vec<_> = (0..2000)
            .map(|i| {
                let (inbox, schema) = (inbox.clone(), schema.clone());
                tokio::spawn(async move {
                    claim_with_effect(&inbox, &schema, &format!("evt-{}", i % 500)).await
                })
            })
            .collect();
        let start = ticks.load(Ordering::Relaxed);
        let (mut claimed, mut peak) = (0, 0);
        for task in tasks {
            peak = peak.max(threads());
            if task.await?? {
                claimed += 1;
            }
        }
        let during = ticks.load(Ordering::Relaxed) - start;
        ticker.abort();
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((
            claimed, peak, before, during, schema, drop,
        ))
    })?;
    assert_eq!(claimed, 500, "one first delivery per key");
    assert_eq!(effects(&url, &schema).len(), 500, "one effect per key");
    // The runtime's own thread and the store's: nothing per task.
    assert!(
        peak <= before + 1,
        "threads: {before} before, {peak} at the peak"
    );
    assert!(during > 0, "the runtime kept ticking while tasks waited");
    Ok(())
}

#[test]
fn a_future_dropped_anywhere_leaves_no_claim_without_its_effect() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (schema, inbox, _drop, _store) = runtime.block_on(async {
        let (store, drop) = store(&url, 8).await?;
        let schema = store.schema().to_owned();
        let inbox = store.inbox("in")?;
        let tasks: Vec<_> = (0..400_u64)
            .map(|i| {
                let (inbox, schema) = (inbox.clone(), schema.clone());
                // Each future is dropped after 0–3 ms, or awaited.
                let cut = Duration::from_micros((i * 7919) % 3000);
                tokio::spawn(async move {
                    let key = format!("k{i}");
                    let call = claim_with_effect(&inbox, &schema, &key);
                    if i % 3 == 0 {
                        call.await.map(Some)
                    } else {
                        tokio::time::timeout(cut, call).await.ok().transpose()
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await??;
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((schema, inbox, drop, store))
    })?;
    // A dropped call's transaction may still be committing: let the
    // server finish what was handed to it.
    std::thread::sleep(Duration::from_millis(200));
    let rows = effects(&url, &schema);
    let mut dropped = 0;
    for i in 0..400 {
        let key = format!("k{i}");
        let seen = inbox.seen(&key)?;
        assert_eq!(
            seen,
            rows.contains(&key),
            "{key}: claim and effect together"
        );
        if i % 3 == 0 {
            assert!(seen, "{key}: awaited claims are there");
        } else if !seen {
            dropped += 1;
        }
    }
    assert!(dropped > 0, "some calls were dropped before they committed");
    Ok(())
}

#[test]
fn a_dropped_begin_never_leaves_its_key_held() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let fp = fingerprint("POST", "/pay", b"{}");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (keys, _drop, _store) = runtime.block_on(async {
        let (store, drop) = store(&url, 8).await?;
        let keys = store.idempotency_keys();
        let tasks: Vec<_> = (0..300_u64)
            .map(|i| {
                let (keys, fp) = (keys.clone(), fp.clone());
                let cut = Duration::from_micros((i * 7919) % 4000);
                tokio::spawn(async move {
                    let key = format!("key-{i}");
                    let call = async {
                        if let Begin::Proceed(r) = keys.begin_async("t", &key, &fp, t(0)).await? {
                            keys.complete_async(&r, r.response(200, b"ok".to_vec(), t(0)), t(0))
                                .await?;
                        }
                        Ok::<_, Error>(())
                    };
                    if i % 4 == 0 {
                        call.await
                    } else {
                        let _ = tokio::time::timeout(cut, call).await;
                        Ok(())
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await??;
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((keys, drop, store))
    })?;
    // What a dropped call left is released by the store in the background.
    std::thread::sleep(Duration::from_millis(300));
    let mut free = 0;
    for i in 0..300 {
        let key = format!("key-{i}");
        // Well within the lease: a key still reserved would be in flight.
        match keys.begin("t", &key, &fp, t(1))? {
            Begin::Replay(_) => {}
            Begin::Proceed(r) => {
                assert!(i % 4 != 0, "{key}: an awaited call completed it");
                free += 1;
                keys.release(&r)?;
            }
            other => panic!("{key}: left held by a dropped call: {other:?}"),
        }
    }
    assert!(free > 0, "some calls were dropped before completing");
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn the_outbox_the_keys_and_the_applications_statements_answer_awaited() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let (store, _drop) = store(&url, 4).await?;
    let outbox = store.outbox();
    let entry = NewEntry::new("send", "mailer", "k1", b"hi".to_vec());
    let Enqueued::New(id) = outbox.enqueue_async(entry.clone(), t(0)).await? else {
        panic!("a new entry")
    };
    assert!(matches!(
        outbox.enqueue_async(entry, t(0)).await?,
        Enqueued::Duplicate(d) if d == id
    ));
    let claimed = outbox.claim_due_async(t(1), 10, "w").await?;
    assert_eq!(claimed.len(), 1);
    outbox
        .settle_async(claimed[0].fence(), Settlement::Completed, t(2))
        .await?;
    let got = outbox.get_async(id).await?;
    assert_eq!(got.entry.status, OutboxStatus::Completed);
    assert_eq!(outbox.next_due_async().await?, None);

    let keys = store.idempotency_keys();
    let fp = fingerprint("POST", "/x", b"1");
    let Begin::Proceed(r) = keys.begin_async("", "req", &fp, t(0)).await? else {
        panic!("a first request proceeds")
    };
    assert!(matches!(
        keys.begin_async("", "req", &fp, t(0)).await?,
        Begin::InFlight { .. }
    ));
    keys.complete_async(&r, r.response(201, b"made".to_vec(), t(1)), t(1))
        .await?;
    let Begin::Replay(stored) = keys.begin_async("", "req", &fp, t(2)).await? else {
        panic!("the stored response")
    };
    assert_eq!(stored.response_status, 201);

    // The application's own statements, with the crate's time type, in the
    // store's transactions and on its pool.
    let s = store.schema().to_owned();
    let at = t(5);
    let inbox = store.inbox("app")?;
    let wrote = store
        .write_async({
            let (s, inbox) = (s.clone(), inbox.clone());
            move |tx| {
                Box::pin(async move {
                    tx.batch_execute(&format!("CREATE TABLE {s}.events (at timestamptz)"))
                        .await?;
                    tx.execute(&format!("INSERT INTO {s}.events VALUES ($1)"), &[&at])
                        .await?;
                    inbox.claim_in_async(tx, "e1", at).await
                })
            }
        })
        .await?;
    assert!(wrote);
    let back: DateTime<Utc> = store
        .read_async(move |tx| {
            Box::pin(async move {
                let row = tx
                    .query_one(&format!("SELECT at FROM {s}.events"), &[])
                    .await?;
                Ok::<_, Error>(row.get(0))
            })
        })
        .await?;
    assert_eq!(back, at);
    assert!(inbox.seen_async("e1").await?);
    // A closure that fails rolls back.
    let failed = store
        .write_async(|tx| {
            Box::pin(async move {
                tx.execute("SELECT 1", &[]).await?;
                Err::<(), _>(Error::NotFound)
            })
        })
        .await;
    assert!(failed.is_err());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_async_dispatchers_claimers_send_every_entry_once() -> TestResult {
    use std::collections::HashMap;
    use std::sync::Mutex;
    let Some(url) = url() else { return Ok(()) };
    let (store, _drop) = store(&url, 8).await?;
    let outbox = store.outbox();
    let entries: Vec<_> = (0..300)
        .map(|i| NewEntry::new("c", format!("d{}", i % 3), format!("k{i}"), vec![]))
        .collect();
    outbox.enqueue_many_async(entries, Utc::now()).await?;
    let sent: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    // Four workers on a pool of eight: four claimers, a commit each at once.
    let dispatcher = {
        let sent = sent.clone();
        idemstore::Dispatcher::builder(outbox.clone())
            .workers(4)
            .batch_size(16)
            .start_async(move |entry| {
                *sent
                    .lock()
                    .unwrap()
                    .entry(entry.idempotency_key)
                    .or_default() += 1;
                std::future::ready(idemstore::Delivery::Delivered)
            })?
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while dispatcher.stats().delivered < 300 {
        assert!(std::time::Instant::now() < deadline, "drained in time");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    dispatcher.shutdown().await?;
    let sent = sent.lock().unwrap().clone();
    assert_eq!(sent.len(), 300, "every entry sent");
    assert!(sent.values().all(|&n| n == 1), "none sent twice");
    assert_eq!(outbox.counts_async().await?.completed, 300);
    Ok(())
}

#[test]
fn the_async_dispatcher_makes_no_store_call_on_the_blocking_pool() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    dispatcher_without_blocking_pool!(store(&url, 4).await?)
}
