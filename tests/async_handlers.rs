//! Store calls from async handlers, the documented way: cloned handles moved
//! into `tokio::task::spawn_blocking`, awaited. The runtime thread stays free
//! while the calls wait for their commits, and the store's guarantees hold as
//! they do for threads.

use std::sync::{Arc, Barrier, Condvar, Mutex};
use std::time::Duration;

use idemstore::chrono::{DateTime, TimeZone, Utc};
use idemstore::redb::{ReadableTable, ReadableTableMetadata, TableDefinition, WriteTransaction};
use idemstore::{Begin, Claim, Error, NewEntry, Result, Store, fingerprint};

const EFFECTS: TableDefinition<&str, u64> = TableDefinition::new("app.effects");

fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

/// Counts a ticker task's ticks, and lets a thread wait for the next one.
#[derive(Default)]
struct Ticks {
    count: Mutex<u64>,
    ticked: Condvar,
}

impl Ticks {
    fn tick(&self) {
        *self.count.lock().unwrap() += 1;
        self.ticked.notify_all();
    }

    fn now(&self) -> u64 {
        *self.count.lock().unwrap()
    }

    /// Whether a tick came after `seen` within `timeout`.
    fn wait_past(&self, seen: u64, timeout: Duration) -> bool {
        let count = self.count.lock().unwrap();
        let (count, _) = self
            .ticked
            .wait_timeout_while(count, timeout, |n| *n <= seen)
            .unwrap();
        *count > seen
    }
}

/// A ticker task on the current runtime: one tick a millisecond for as long
/// as the runtime lets it run.
fn spawn_ticker(ticks: &Arc<Ticks>) -> tokio::task::JoinHandle<()> {
    let ticks = Arc::clone(ticks);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(1));
        loop {
            every.tick().await;
            ticks.tick();
        }
    })
}

/// An effect that needs the ticker to tick while it runs: it records the
/// event and waits, inside the write transaction, for a tick after it
/// started. It can only see one if the runtime thread is free meanwhile.
fn effect_needing_a_tick(
    tx: &WriteTransaction,
    event: &str,
    ticks: &Ticks,
    timeout: Duration,
) -> Result<bool> {
    let seen = ticks.now();
    tx.open_table(EFFECTS)?.insert(event, seen)?;
    Ok(ticks.wait_past(seen, timeout))
}

fn effect_rows(store: &Store) -> Result<u64> {
    store.read(|tx| match tx.open_table(EFFECTS) {
        Ok(table) => Ok(table.len()?),
        Err(idemstore::redb::TableError::TableDoesNotExist(_)) => Ok(0),
        Err(e) => Err(e.into()),
    })
}

#[tokio::test(flavor = "current_thread")]
async fn claims_on_the_blocking_pool_leave_the_runtime_thread_free() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("app.idem"))?;
    let inbox = store.inbox("webhooks")?;
    let ticks = Arc::new(Ticks::default());
    let ticker = spawn_ticker(&ticks);

    let before = ticks.now();
    for n in 0..200 {
        let (inbox, ticks) = (inbox.clone(), Arc::clone(&ticks));
        let event = format!("evt-{n}");
        let outcome = tokio::task::spawn_blocking(move || {
            inbox.claim_with(&event, t(n), |tx| {
                effect_needing_a_tick(tx, &event, &ticks, Duration::from_secs(10))
            })
        })
        .await
        .unwrap()?;
        assert_eq!(
            outcome,
            Claim::Applied(true),
            "claim {n}: the ticker did not tick while its effect ran"
        );
    }
    let during = ticks.now() - before;
    ticker.abort();

    assert!(
        during >= 200,
        "{during} ticks while 200 effects waited for one each"
    );
    assert_eq!(inbox.len()?, 200);
    assert_eq!(effect_rows(&store)?, 200);
    Ok(())
}

/// The control for the test above: the same claims made inline, on the
/// runtime thread, stall the ticker; so the test above would fail if the
/// documented way blocked the runtime.
#[tokio::test(flavor = "current_thread")]
async fn the_same_claims_made_inline_stall_the_runtime() -> Result<()> {
    let store = Store::in_memory()?;
    let inbox = store.inbox("webhooks")?;
    let ticks = Arc::new(Ticks::default());
    let ticker = spawn_ticker(&ticks);
    // Let the ticker start, so that a stall below is the claims' doing.
    while ticks.now() == 0 {
        tokio::task::yield_now().await;
    }

    let before = ticks.now();
    for n in 0..3 {
        let outcome = inbox.claim_with(&format!("evt-{n}"), t(n), |tx| {
            effect_needing_a_tick(tx, &format!("evt-{n}"), &ticks, Duration::from_millis(50))
        })?;
        assert_eq!(
            outcome,
            Claim::Applied(false),
            "a tick came during an inline claim"
        );
    }
    assert_eq!(
        ticks.now(),
        before,
        "the ticker ran while the runtime thread was busy"
    );
    ticker.abort();
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn concurrent_handlers_delivering_one_webhook_apply_its_effect_once() -> Result<()> {
    const HANDLERS: usize = 32;
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("app.idem"))?;
    let inbox = store.inbox("webhooks")?;
    let outbox = store.outbox();
    // Every handler reaches its write before any of them starts it.
    let start = Arc::new(Barrier::new(HANDLERS));

    let mut handlers = Vec::new();
    for n in 0..HANDLERS {
        let (store, inbox, outbox) = (store.clone(), inbox.clone(), outbox.clone());
        let start = Arc::clone(&start);
        handlers.push(tokio::spawn(async move {
            tokio::task::spawn_blocking(move || {
                start.wait();
                store.write(|tx| {
                    if !inbox.claim_in(tx, "evt-1", t(0))? {
                        return Ok(false);
                    }
                    let mut effects = tx.open_table(EFFECTS)?;
                    let runs = effects.get("evt-1")?.map_or(0, |v| v.value());
                    effects.insert("evt-1", runs + 1)?;
                    let receipt = NewEntry::new("evt-1", "mailer", "evt-1/receipt", vec![]);
                    outbox.enqueue_in(tx, receipt, t(n.try_into().unwrap()))?;
                    Ok::<_, Error>(true)
                })
            })
            .await
            .unwrap()
        }));
    }
    let mut applied = 0;
    for handler in handlers {
        if handler.await.unwrap()? {
            applied += 1;
        }
    }

    assert_eq!(applied, 1, "exactly one handler applied the webhook");
    let runs = store
        .read(|tx| Ok::<_, Error>(tx.open_table(EFFECTS)?.get("evt-1")?.map(|v| v.value())))?;
    assert_eq!(runs, Some(1), "the effect ran once");
    assert_eq!(outbox.counts()?.pending, 1, "one receipt enqueued");
    assert!(inbox.seen("evt-1")?);
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn idempotency_keys_begin_and_complete_from_async_code() -> Result<()> {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys().with_lease(Duration::from_secs(60));
    let fp = fingerprint("POST", "/payments", b"{\"amount\":42}");

    // The first request reserves the key.
    let begin = {
        let (keys, fp) = (keys.clone(), fp.clone());
        tokio::task::spawn_blocking(move || keys.begin("tenant-a", "key-1", &fp, t(0)))
            .await
            .unwrap()?
    };
    let Begin::Proceed(reservation) = begin else {
        panic!("first begin: {begin:?}");
    };

    // A concurrent retry, from another task, finds it in flight.
    let retry = {
        let (keys, fp) = (keys.clone(), fp.clone());
        tokio::spawn(async move {
            tokio::task::spawn_blocking(move || keys.begin("tenant-a", "key-1", &fp, t(1)))
                .await
                .unwrap()
        })
        .await
        .unwrap()?
    };
    assert_eq!(retry, Begin::InFlight { lease_until: t(60) });

    // The handler stores its response with its own row, in one commit.
    let completed = {
        let (store, keys, reservation) = (store.clone(), keys.clone(), reservation.clone());
        tokio::task::spawn_blocking(move || {
            store.write(|tx| {
                tx.open_table(EFFECTS)?.insert("pay_1", 42)?;
                let response = reservation.response(201, b"{\"id\":\"pay_1\"}".to_vec(), t(2));
                keys.complete_in(tx, &reservation, response, t(2))
            })
        })
        .await
        .unwrap()?
    };
    assert!(completed, "the reservation was still the key's");

    // The next retry is a replay of that response; another body a mismatch.
    let (replay, mismatch) = {
        let keys = keys.clone();
        let other = fingerprint("POST", "/payments", b"{\"amount\":43}");
        tokio::task::spawn_blocking(move || {
            Ok::<_, Error>((
                keys.begin("tenant-a", "key-1", &fp, t(3))?,
                keys.begin("tenant-a", "key-1", &other, t(3))?,
            ))
        })
        .await
        .unwrap()?
    };
    let Begin::Replay(stored) = replay else {
        panic!("retry after complete: {replay:?}");
    };
    assert_eq!(stored.response_status, 201);
    assert_eq!(stored.response_body, b"{\"id\":\"pay_1\"}");
    assert!(matches!(mismatch, Begin::Mismatch { .. }), "{mismatch:?}");
    assert_eq!(effect_rows(&store)?, 1);
    Ok(())
}
