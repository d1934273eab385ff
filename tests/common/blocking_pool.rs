//! The async dispatcher's whole life on a runtime whose blocking pool is
//! taken: a macro, as the embedded store's and PostgreSQL's handles share
//! their call names but no trait with every call the scenario makes.

/// Runs the async dispatcher on the store `$make` gives (an expression
/// evaluated inside the runtime, answering `(store, guard)`: the guard
/// lives as long as the store) on a `current_thread` runtime whose
/// blocking pool has one thread, taken for the whole run. A store call
/// sent to that pool would never run, so each step below would time out.
///
/// The dispatcher's reaper releases a claim a crashed worker left, its
/// janitor purges a finished entry, prunes an inbox key and purges an
/// expired idempotency key, a send is delivered and settled, and one held
/// in flight when the dispatcher is told to stop is settled by its
/// shutdown.
#[allow(unused_macros)]
macro_rules! dispatcher_without_blocking_pool {
    ($make:expr) => {{
        use idemstore::chrono::{DateTime, TimeZone as _, Utc};
        use idemstore::{
            Begin, Delivery, Dispatcher, Janitor, ManualClock, NewEntry, OutboxStatus,
        };
        use std::time::Duration;

        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .max_blocking_threads(1)
            .build()?;
        let (taken, is_taken) = std::sync::mpsc::channel::<()>();
        let (free, held_until) = std::sync::mpsc::channel::<()>();
        let _taker = runtime.spawn_blocking(move || {
            let _ = taken.send(());
            let _ = held_until.recv();
        });
        is_taken.recv()?;
        let t =
            |secs: i64| -> DateTime<Utc> { Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap() };
        let entry = |key: &str| NewEntry::new("c", "d", key, Vec::new());
        let outcome: Result<(), Box<dyn std::error::Error + Send + Sync>> =
            runtime.block_on(async {
                let (store, _guard) = $make;
                let outbox = store.outbox();
                let inbox = store.inbox("pool")?;
                let keys = store.idempotency_keys().with_ttl(Duration::from_secs(10));
                // At t(0): a claim a crashed worker left, a finished entry, an
                // inbox key and a completed idempotency key.
                let crashed = outbox.enqueue_async(entry("crashed"), t(0)).await?.id();
                assert_eq!(
                    outbox.claim_due_async(t(0), 1, "crashed").await?[0].id,
                    crashed
                );
                let done = outbox.enqueue_async(entry("done"), t(0)).await?.id();
                assert_eq!(outbox.claim_due_async(t(0), 1, "w").await?[0].id, done);
                outbox.mark_completed_async(done, t(0)).await?;
                assert!(inbox.claim_async("old", t(0)).await?);
                let Begin::Proceed(r) = keys.begin_async("", "old", "fp", t(0)).await? else {
                    panic!("a new key proceeds");
                };
                assert!(
                    keys.complete_async(&r, r.response(200, b"ok".to_vec(), t(0)), t(0))
                        .await?
                );
                let (open, gate) = tokio::sync::watch::channel(false);
                let (started, mut in_flight) = tokio::sync::watch::channel(false);
                let started = std::sync::Arc::new(started);
                let janitor = Janitor::new()
                    .outbox(outbox.clone(), Duration::from_secs(10))
                    .inbox(inbox.clone(), Duration::from_secs(10))
                    .idempotency_keys(keys.clone());
                let handle = Dispatcher::builder(outbox.clone())
                    .clock(ManualClock::new(t(100)))
                    .lease(Duration::from_secs(60))
                    .janitor(janitor)
                    .workers(4)
                    .start_async(move |e| {
                        let (mut gate, started) = (gate.clone(), started.clone());
                        async move {
                            if e.idempotency_key == "held" {
                                started.send_replace(true);
                                let _ = gate.wait_for(|open| *open).await;
                            }
                            Delivery::Delivered
                        }
                    })?;
                let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
                loop {
                    let stats = handle.stats();
                    let janitor = stats.janitor.clone().and_then(|j| j.last_report);
                    let sent =
                        outbox.get_async(crashed).await?.entry.status == OutboxStatus::Completed;
                    if sent && stats.released == 1 && janitor.is_some() {
                        let report = janitor.unwrap();
                        assert_eq!(
                            (
                                report.outbox_purged,
                                report.inbox_pruned,
                                report.keys_purged
                            ),
                            (1, 1, 1),
                            "the janitor's run"
                        );
                        break;
                    }
                    if tokio::time::Instant::now() >= deadline {
                        let record = outbox.get_async(crashed).await?;
                        panic!(
                            "timed out: janitor {janitor:?}, crashed {:?} {:?}, stats {stats:?}",
                            record.entry.status, record.claim
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                assert!(!inbox.seen_async("old").await?, "pruned");
                // A send held in flight until the dispatcher is told to stop:
                // the shutdown lets it end and settles it.
                let held = outbox.enqueue_async(entry("held"), t(0)).await?.id();
                tokio::time::timeout(Duration::from_secs(30), in_flight.wait_for(|s| *s))
                    .await
                    .map_err(|_| "timed out: the held send never started")??;
                let stopped = tokio::time::timeout(Duration::from_secs(30), async {
                    tokio::join!(handle.shutdown(), async {
                        tokio::task::yield_now().await;
                        open.send_replace(true);
                    })
                    .0
                })
                .await
                .map_err(|_| "timed out: the shutdown")?;
                stopped?;
                assert_eq!(
                    outbox.get_async(held).await?.entry.status,
                    OutboxStatus::Completed
                );
                assert_eq!(outbox.counts_async().await?.dispatching, 0);
                Ok(())
            });
        drop(free);
        outcome
    }};
}
