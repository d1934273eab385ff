//! What the store reports with the features `tracing` and `metrics`: the
//! metrics and the events the crate docs' "Observability" section lists, with
//! their labels and values, read back from a recorder and a subscriber
//! installed for the whole test binary.
//!
//! The recorder and the subscriber are process-wide (the dispatcher reports
//! from its own threads), so the tests take turns: each starts from empty
//! captures and ends with its dispatchers shut down.

#[path = "../src/observe/capture.rs"]
mod capture;
mod common;

use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use capture::{Captured, Events, Metrics};
use common::{FaultyDisk, eventually_some, t};
use idemstore::redb::TableDefinition;
use idemstore::{
    Begin, Delivery, Dispatcher, Error, Janitor, ManualClock, NewEntry, OutboxStatus, Result,
    Store, fingerprint,
};
use tracing::Level;

/// The captures, for one test at a time.
struct Observed {
    events: Events,
    metrics: Metrics,
    _turn: MutexGuard<'static, ()>,
}

/// Installs the capturing subscriber and recorder (once per process), waits
/// for this test's turn, and empties them.
fn observe() -> Observed {
    static TURN: Mutex<()> = Mutex::new(());
    static INSTALLED: OnceLock<(Events, Metrics)> = OnceLock::new();
    let turn = TURN.lock().unwrap_or_else(PoisonError::into_inner);
    let (events, metrics) = INSTALLED
        .get_or_init(|| {
            let (events, metrics) = (Events::default(), Metrics::default());
            tracing::subscriber::set_global_default(events.clone())
                .expect("no other subscriber in this test binary");
            metrics::set_global_recorder(metrics.clone())
                .expect("no other recorder in this test binary");
            (events, metrics)
        })
        .clone();
    events.clear();
    metrics.clear();
    Observed {
        events,
        metrics,
        _turn: turn,
    }
}

/// Polls `probe` until it gives a value: the dispatcher runs on its own
/// threads, so its effects are observed, not awaited.
/// The only event of `target` with `message`.
fn the_event(events: &Events, target: &str, message: &str) -> Captured {
    let found = events.named(target, message);
    assert_eq!(found.len(), 1, "{target} {message:?}: {:#?}", events.all());
    found.into_iter().next().expect("one event")
}

/// The outbox's records, as a caller can reach them to damage them.
const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("idemstore.v1.outbox");

fn entry(i: usize) -> NewEntry {
    NewEntry::new(
        format!("cmd-{i}"),
        "mailer",
        format!("key-{i}"),
        b"hi".to_vec(),
    )
}

#[test]
fn claims_and_duplicates_are_counted_per_inbox_once_committed() -> Result<()> {
    let seen = observe();
    let store = Store::in_memory()?;
    let orders = store.inbox("orders")?;
    let payments = store.inbox("payments")?;

    assert!(orders.claim("k1", t(0))?);
    assert!(!orders.claim("k1", t(0))?);
    assert!(
        orders
            .claim_with("k2", t(0), |_| Ok::<_, Error>(()))?
            .is_applied()
    );
    assert!(
        !orders
            .claim_with("k2", t(0), |_| Ok::<_, Error>(()))?
            .is_applied()
    );
    assert_eq!(
        orders.claim_many(["k3", "k3", "k1"], t(0))?,
        [true, false, false]
    );
    assert!(payments.claim("k1", t(0))?);
    // Inside the caller's transaction: counted once it commits, never when
    // it rolls back.
    assert!(store.write(|tx| orders.claim_in(tx, "k4", t(0)))?);
    let rolled_back = store.write(|tx| {
        orders.claim_in(tx, "k5", t(0))?;
        Err::<(), _>(Error::NotFound)
    });
    assert!(matches!(rolled_back, Err(Error::NotFound)));
    assert!(!orders.seen("k5")?);

    let m = &seen.metrics;
    let orders_label = [("inbox", "orders")];
    assert_eq!(
        m.counter("idemstore_inbox_claims_total", &orders_label),
        Some(4)
    );
    assert_eq!(
        m.counter("idemstore_inbox_duplicates_total", &orders_label),
        Some(4)
    );
    let payments_label = [("inbox", "payments")];
    assert_eq!(
        m.counter("idemstore_inbox_claims_total", &payments_label),
        Some(1)
    );
    assert_eq!(
        m.counter("idemstore_inbox_duplicates_total", &payments_label),
        None
    );
    Ok(())
}

#[test]
fn every_commit_is_reported_with_its_size_and_time() -> Result<()> {
    let seen = observe();
    let store = Store::in_memory()?;
    let inbox = store.inbox("events")?;
    // One operation in one durable batch.
    inbox.claim_many(["a", "b", "c"], t(0))?;
    // A caller's own transaction (no fsync), then a durable batch for it.
    store.write(|tx| inbox.claim_in(tx, "d", t(0)))?;

    let stats = store.commit_stats();
    let m = &seen.metrics;
    let durable = m
        .counter("idemstore_commits_total", &[("durable", "true")])
        .unwrap_or(0);
    let not_durable = m
        .counter("idemstore_commits_total", &[("durable", "false")])
        .unwrap_or(0);
    assert_eq!(durable, stats.durable_commits, "{stats:?}");
    assert_eq!(durable + not_durable, stats.commits, "{stats:?}");
    assert!(durable >= 2 && not_durable >= 1, "{stats:?}");
    // Under `Durability::Immediate` every batch commits durably.
    let ops = m.histogram("idemstore_batch_ops", &[]);
    assert_eq!(ops.len() as u64, durable);
    assert!(ops.iter().all(|n| *n >= 1.0), "{ops:?}");
    let seconds = m.histogram("idemstore_commit_seconds", &[("durable", "true")]);
    assert_eq!(seconds.len() as u64, durable);
    assert!(seconds.iter().all(|s| *s >= 0.0), "{seconds:?}");
    assert_eq!(
        m.histogram("idemstore_commit_seconds", &[("durable", "false")])
            .len() as u64,
        not_durable
    );

    let batches = seen.events.named("idemstore::engine", "batch committed");
    assert_eq!(batches.len() as u64, durable);
    for batch in &batches {
        assert_eq!(batch.level, Level::TRACE);
        assert_eq!(batch.field("durable"), Some("true"));
        assert!(
            batch
                .field("ops")
                .is_some_and(|n| n.parse::<u64>().unwrap() >= 1)
        );
        assert!(
            batch
                .field("commit_us")
                .is_some_and(|us| us.parse::<u64>().is_ok())
        );
    }
    let own = seen
        .events
        .named("idemstore::engine", "caller transaction committed");
    assert_eq!(own.len() as u64, not_durable);
    Ok(())
}

#[test]
fn an_enqueue_and_its_delivery_are_reported() -> Result<()> {
    let seen = observe();
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let m = &seen.metrics;
    let depth = |status| m.gauge("idemstore_outbox_entries", &[("status", status)]);

    let id = outbox.enqueue(entry(1), t(0))?.id();
    assert_eq!(depth("pending"), Some(1.0));
    for status in ["dispatching", "completed", "failed", "outcome_unknown"] {
        assert_eq!(depth(status), Some(0.0), "{status}");
    }

    // Sent two seconds after its enqueue, by the dispatcher's clock.
    let handle = Dispatcher::builder(outbox.clone())
        .clock(ManualClock::new(t(2)))
        .workers(1)
        .start(|_| Delivery::Delivered)?;
    eventually_some("the entry is delivered", || {
        (handle.stats().delivered == 1).then_some(())
    });
    handle.shutdown()?;
    assert_eq!(outbox.get(id)?.entry.status, OutboxStatus::Completed);

    assert_eq!(
        m.counter(
            "idemstore_dispatch_outcomes_total",
            &[("outcome", "delivered"), ("destination", "mailer")]
        ),
        Some(1)
    );
    assert_eq!(
        m.series("idemstore_dispatch_outcomes_total").len(),
        1,
        "no other outcome"
    );
    assert_eq!(
        m.histogram("idemstore_dispatch_latency_seconds", &[]),
        [2.0]
    );
    assert_eq!(depth("pending"), Some(0.0));
    assert_eq!(depth("dispatching"), Some(0.0));
    assert_eq!(depth("completed"), Some(1.0));
    assert_eq!(
        m.counter("idemstore_errors_total", &[("during", "claim")]),
        None
    );
    Ok(())
}

#[test]
fn a_failed_store_call_is_a_warning_and_a_failed_commit_an_error() -> Result<()> {
    let seen = observe();
    let m = &seen.metrics;

    // A damaged record, first in line: the worker's claim fails, and it
    // backs off and carries on.
    let store = Store::in_memory()?;
    let id = store.outbox().enqueue(entry(1), t(0))?.id();
    store.write(|tx| {
        tx.open_table(OUTBOX)?
            .insert(id.0, b"\x01garbage".as_slice())?;
        Ok::<_, Error>(())
    })?;
    let handle = Dispatcher::builder(store.outbox())
        .clock(ManualClock::new(t(10)))
        .workers(1)
        .start(|_| Delivery::Delivered)?;
    let warning = eventually_some("the worker's claim fails", || {
        seen.events
            .named("idemstore::dispatch", "store call failed; backing off")
            .into_iter()
            .next()
    });
    handle.shutdown()?;
    assert_eq!(warning.level, Level::WARN);
    assert_eq!(warning.field("during"), Some("claim"));
    let error = warning.field("error").unwrap_or_default();
    assert!(error.contains("idemstore.v1.outbox"), "{error}");
    assert!(m.counter("idemstore_errors_total", &[("during", "claim")]) >= Some(1));
    assert_eq!(
        seen.events
            .all()
            .iter()
            .filter(|e| e.level == Level::ERROR)
            .count(),
        0,
        "a worker that backs off has not given up"
    );

    // A failed fsync: the store refuses writes until it is reopened.
    let disk = FaultyDisk::new();
    let store = Store::builder().open_with_backend(disk.backend())?;
    let inbox = store.inbox("events")?;
    disk.fail_sync(disk.syncs() + 1);
    assert!(inbox.claim("a", t(0)).is_err());
    let broken = the_event(
        &seen.events,
        "idemstore::engine",
        "the store refuses writes until it is reopened",
    );
    assert_eq!(broken.level, Level::ERROR);
    assert_eq!(broken.field("during"), Some("a batch commit"));
    let error = broken.field("error").unwrap_or_default();
    assert!(error.contains("injected sync failure"), "{error}");
    assert_eq!(
        m.counter("idemstore_errors_total", &[("during", "a batch commit")]),
        Some(1)
    );
    // Later calls are refused without a new report.
    assert!(inbox.claim("b", t(0)).is_err());
    assert_eq!(
        m.counter("idemstore_errors_total", &[("during", "a batch commit")]),
        Some(1)
    );
    Ok(())
}

#[test]
fn replays_in_flight_requests_and_mismatches_are_counted() -> Result<()> {
    let seen = observe();
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    let fp = fingerprint("POST", "/orders", b"1");
    let other = fingerprint("POST", "/orders", b"2");

    let Begin::Proceed(r) = keys.begin("acme", "k1", &fp, t(0))? else {
        panic!("a new key proceeds")
    };
    assert!(matches!(
        keys.begin("acme", "k1", &fp, t(1))?,
        Begin::InFlight { .. }
    ));
    assert!(matches!(
        keys.begin("acme", "k1", &other, t(1))?,
        Begin::Mismatch { .. }
    ));
    assert!(keys.complete(&r, r.response(201, b"ok".to_vec(), t(2)), t(2))?);
    assert!(matches!(
        keys.begin("acme", "k1", &fp, t(3))?,
        Begin::Replay(_)
    ));
    assert!(matches!(
        keys.begin("acme", "k1", &other, t(3))?,
        Begin::Mismatch { .. }
    ));

    // Completed in the caller's transaction: reported once it commits,
    // never when it rolls back.
    let Begin::Proceed(r2) = keys.begin("acme", "k2", &fp, t(4))? else {
        panic!("a new key proceeds")
    };
    let rolled_back = store.write(|tx| {
        keys.complete_in(tx, &r2, r2.response(201, b"ok".to_vec(), t(5)), t(5))?;
        Err::<(), _>(Error::NotFound)
    });
    assert!(matches!(rolled_back, Err(Error::NotFound)));
    assert!(store.write(|tx| keys.complete_in(
        tx,
        &r2,
        r2.response(201, b"ok".to_vec(), t(6)),
        t(6)
    ))?);

    // A holder whose lease ran out (60 s) and whose key was taken over is
    // fenced out.
    let Begin::Proceed(stale) = keys.begin("acme", "k3", &fp, t(10))? else {
        panic!("a new key proceeds")
    };
    assert!(matches!(
        keys.begin("acme", "k3", &fp, t(100))?,
        Begin::Proceed(_)
    ));
    assert!(!keys.complete(
        &stale,
        stale.response(201, b"late".to_vec(), t(101)),
        t(101)
    )?);

    let m = &seen.metrics;
    let begins = |outcome| {
        m.counter(
            "idemstore_idempotency_begins_total",
            &[("outcome", outcome)],
        )
    };
    assert_eq!(begins("proceed"), Some(3));
    assert_eq!(begins("takeover"), Some(1));
    assert_eq!(begins("in_flight"), Some(1));
    assert_eq!(begins("mismatch"), Some(2));
    assert_eq!(begins("replay"), Some(1));
    let completions = |outcome| {
        m.counter(
            "idemstore_idempotency_completions_total",
            &[("outcome", outcome)],
        )
    };
    assert_eq!(completions("stored"), Some(2));
    assert_eq!(completions("fenced_out"), Some(1));
    Ok(())
}

#[test]
fn released_claims_and_janitor_runs_are_reported() -> Result<()> {
    let seen = observe();
    let m = &seen.metrics;
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let id = outbox.enqueue(entry(1), t(0))?.id();
    // A dispatcher claimed it, then died.
    assert_eq!(outbox.claim_due(t(0), 10, "crashed")?.len(), 1);

    // The next dispatcher's reaper releases the claim, its lease (60 s)
    // long over, and a worker delivers the entry.
    let handle = Dispatcher::builder(outbox.clone())
        .clock(ManualClock::new(t(120)))
        .lease(Duration::from_secs(60))
        .workers(1)
        .start(|_| Delivery::Delivered)?;
    eventually_some("the entry is delivered", || {
        (handle.stats().delivered == 1).then_some(())
    });
    handle.shutdown()?;
    let released = the_event(
        &seen.events,
        "idemstore::dispatch",
        "reaper released expired claims: a dispatcher died or its sends outlasted the lease",
    );
    assert_eq!(released.level, Level::WARN);
    assert_eq!(released.field("released"), Some("1"));
    assert_eq!(m.counter("idemstore_reaper_released_total", &[]), Some(1));

    // A janitor run, by hand.
    let report = Janitor::new()
        .outbox(outbox.clone(), Duration::ZERO)
        .inbox(store.inbox("events")?, Duration::ZERO)
        .run_once(t(200))?;
    assert_eq!(report.outbox_purged, 1);
    assert!(matches!(outbox.get(id), Err(Error::NotFound)));
    let run = the_event(&seen.events, "idemstore::janitor", "janitor run");
    assert_eq!(run.level, Level::INFO);
    assert_eq!(run.field("outbox_purged"), Some("1"));
    assert_eq!(run.field("inbox_pruned"), Some("0"));
    assert_eq!(run.field("keys_purged"), Some("0"));
    assert!(run.field("run_us").is_some());
    assert_eq!(
        m.counter("idemstore_janitor_removed_total", &[("what", "outbox")]),
        Some(1)
    );
    assert_eq!(
        m.counter("idemstore_janitor_removed_total", &[("what", "inbox")]),
        Some(0)
    );
    // The purge left the outbox empty.
    assert_eq!(
        m.gauge("idemstore_outbox_entries", &[("status", "completed")]),
        Some(0.0)
    );
    Ok(())
}

/// Every metric the crate docs list, with its kind and unit.
const DESCRIBED: &[(&str, &str, metrics::Unit)] = &[
    ("idemstore_commits_total", "counter", metrics::Unit::Count),
    (
        "idemstore_commit_seconds",
        "histogram",
        metrics::Unit::Seconds,
    ),
    ("idemstore_batch_ops", "histogram", metrics::Unit::Count),
    (
        "idemstore_inbox_claims_total",
        "counter",
        metrics::Unit::Count,
    ),
    (
        "idemstore_inbox_duplicates_total",
        "counter",
        metrics::Unit::Count,
    ),
    (
        "idemstore_idempotency_begins_total",
        "counter",
        metrics::Unit::Count,
    ),
    (
        "idemstore_idempotency_completions_total",
        "counter",
        metrics::Unit::Count,
    ),
    ("idemstore_outbox_entries", "gauge", metrics::Unit::Count),
    (
        "idemstore_dispatch_outcomes_total",
        "counter",
        metrics::Unit::Count,
    ),
    (
        "idemstore_dispatch_send_seconds",
        "histogram",
        metrics::Unit::Seconds,
    ),
    (
        "idemstore_dispatch_in_flight",
        "gauge",
        metrics::Unit::Count,
    ),
    (
        "idemstore_dispatch_latency_seconds",
        "histogram",
        metrics::Unit::Seconds,
    ),
    (
        "idemstore_dispatch_fenced_total",
        "counter",
        metrics::Unit::Count,
    ),
    (
        "idemstore_dispatch_panics_total",
        "counter",
        metrics::Unit::Count,
    ),
    (
        "idemstore_reaper_released_total",
        "counter",
        metrics::Unit::Count,
    ),
    (
        "idemstore_janitor_removed_total",
        "counter",
        metrics::Unit::Count,
    ),
    ("idemstore_errors_total", "counter", metrics::Unit::Count),
];

fn assert_all_described(m: &Metrics) {
    let described = m.descriptions();
    for (name, kind, unit) in DESCRIBED {
        let d = described
            .get(*name)
            .unwrap_or_else(|| panic!("{name} is not described: {described:#?}"));
        assert_eq!((d.kind, d.unit), (*kind, Some(*unit)), "{name}");
        assert!(d.text.len() > 10, "{name}: {:?}", d.text);
    }
    assert_eq!(described.len(), DESCRIBED.len(), "{described:#?}");
}

#[test]
fn every_metric_is_described_with_its_unit() -> Result<()> {
    let seen = observe();
    // A recorder installed before the store opens: opening describes.
    let _store = Store::in_memory()?;
    assert_all_described(&seen.metrics);
    // A recorder installed after: the application asks.
    seen.metrics.clear();
    idemstore::describe_metrics();
    assert_all_described(&seen.metrics);
    Ok(())
}

#[test]
fn a_completion_counts_once_committed_and_a_repeat_is_not_fenced_out() -> Result<()> {
    let seen = observe();
    let m = &seen.metrics;
    let completions = |outcome| {
        m.counter(
            "idemstore_idempotency_completions_total",
            &[("outcome", outcome)],
        )
    };
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    let fp = fingerprint("POST", "/orders", b"1");
    let Begin::Proceed(r) = keys.begin("", "k1", &fp, t(0))? else {
        panic!("a new key proceeds")
    };
    // Stored in a transaction that then rolls back: nothing counted.
    let rolled_back = store.write(|tx| {
        assert!(keys.complete_in(tx, &r, r.response(201, b"ok".to_vec(), t(1)), t(1))?);
        Err::<(), _>(Error::NotFound)
    });
    assert!(matches!(rolled_back, Err(Error::NotFound)));
    assert_eq!(keys.stats().completed, 0, "rolled back: not completed");
    assert_eq!(completions("stored"), None);
    // Committed: counted.
    assert!(store.write(|tx| keys.complete_in(
        tx,
        &r,
        r.response(201, b"ok".to_vec(), t(2)),
        t(2)
    ))?);
    assert_eq!(keys.stats().completed, 1);
    assert_eq!(completions("stored"), Some(1));
    // The same reservation completed again (as the layer does after a
    // handler's `complete_in`): nothing stored, nobody fenced out.
    assert!(!keys.complete(&r, r.response(500, b"late".to_vec(), t(3)), t(3))?);
    assert_eq!((keys.stats().completed, keys.stats().fenced_out), (1, 0));
    assert_eq!(completions("fenced_out"), None);
    // A holder whose key was taken over is fenced out, and counted so.
    let Begin::Proceed(stale) = keys.begin("", "k2", &fp, t(10))? else {
        panic!("a new key proceeds")
    };
    assert!(matches!(
        keys.begin("", "k2", &fp, t(100))?,
        Begin::Proceed(_)
    ));
    assert!(!keys.complete(&stale, stale.response(201, b"x".to_vec(), t(101)), t(101))?);
    assert_eq!(keys.stats().fenced_out, 1);
    assert_eq!(completions("fenced_out"), Some(1));
    Ok(())
}

/// The layer's own reports: what it answered from the store (`debug`) and
/// its failures (`error`, counted in `idemstore_errors_total`).
#[cfg(feature = "middleware")]
mod layer {
    use bytes::Bytes;
    use http_body_util::Full;
    use idemstore::middleware::{IdempotencyLayer, ResponseBody};
    use idemstore::{Begin, IdempotencyKeys, Result, Store, fingerprint};
    use tower::{ServiceExt as _, service_fn};
    use tracing::Level;

    use super::common::block_on;
    use super::{FaultyDisk, observe, t, the_event};

    type Svc = tower::util::BoxCloneService<
        http::Request<Full<Bytes>>,
        http::Response<ResponseBody>,
        &'static str,
    >;

    fn layered(keys: IdempotencyKeys) -> Svc {
        tower::util::BoxCloneService::new(tower::Layer::layer(
            &IdempotencyLayer::new(keys).clock(|| t(0)),
            service_fn(|_: http::Request<Full<Bytes>>| async {
                Ok::<_, &'static str>(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
            }),
        ))
    }

    fn keyed(key: &str, body: &'static str) -> http::Request<Full<Bytes>> {
        http::Request::post("/orders")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .expect("a request")
    }

    fn status(svc: &Svc, req: http::Request<Full<Bytes>>) -> u16 {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        rt.block_on(svc.clone().oneshot(req))
            .expect("an answer")
            .status()
            .as_u16()
    }

    #[test]
    fn replays_409s_and_422s_are_debug_events() -> Result<()> {
        let seen = observe();
        let store = Store::in_memory()?;
        let keys = store.idempotency_keys();
        let svc = layered(keys.clone());
        assert_eq!(status(&svc, keyed("k1", "a")), 200);
        assert_eq!(status(&svc, keyed("k1", "a")), 200);
        let replayed = the_event(
            &seen.events,
            "idemstore::middleware",
            "stored response replayed",
        );
        assert_eq!(replayed.level, Level::DEBUG);
        assert_eq!(replayed.field("key"), Some("k1"));
        assert_eq!(status(&svc, keyed("k1", "b")), 422);
        let reused = the_event(
            &seen.events,
            "idemstore::middleware",
            "key reused for another request; answered 422",
        );
        assert_eq!(
            (reused.level, reused.field("key")),
            (Level::DEBUG, Some("k1"))
        );
        let fp = fingerprint("POST", "/orders", b"a");
        assert!(matches!(
            keys.begin("", "k2", &fp, t(0))?,
            Begin::Proceed(_)
        ));
        assert_eq!(status(&svc, keyed("k2", "a")), 409);
        let busy = the_event(
            &seen.events,
            "idemstore::middleware",
            "request in flight; answered 409",
        );
        assert_eq!(busy.level, Level::DEBUG);
        assert_eq!(busy.field("key"), Some("k2"));
        // The layer's default wait (1 s), not the 60 s left on the lease.
        assert_eq!(busy.field("retry_after_s"), Some("1"));
        Ok(())
    }

    #[test]
    fn a_failed_store_and_a_missing_runtime_are_errors() -> Result<()> {
        let seen = observe();
        let m = &seen.metrics;
        let disk = FaultyDisk::new();
        let store = Store::builder().open_with_backend(disk.backend())?;
        let svc = layered(store.idempotency_keys());
        disk.lose_power();
        assert_eq!(status(&svc, keyed("k-down", "a")), 503);
        let failed = the_event(
            &seen.events,
            "idemstore::middleware",
            "idempotency store failed; answered 503",
        );
        assert_eq!(failed.level, Level::ERROR);
        assert_eq!(failed.field("during"), Some("idempotency_begin"));
        assert_eq!(failed.field("key"), Some("k-down"));
        assert!(failed.field("error").is_some_and(|e| !e.is_empty()));
        assert_eq!(
            m.counter("idemstore_errors_total", &[("during", "idempotency_begin")]),
            Some(1)
        );

        let store = Store::in_memory()?;
        let svc = layered(store.idempotency_keys());
        let reply = block_on(svc.oneshot(keyed("k-no-rt", "a"))).expect("an answer");
        assert_eq!(reply.status(), 500);
        let no_runtime = seen
            .events
            .all()
            .into_iter()
            .find(|e| e.field("during") == Some("middleware_runtime"))
            .expect("an event about the missing runtime");
        assert_eq!(no_runtime.level, Level::ERROR);
        assert_eq!(no_runtime.field("key"), Some("k-no-rt"));
        assert_eq!(
            m.counter(
                "idemstore_errors_total",
                &[("during", "middleware_runtime")]
            ),
            Some(1)
        );
        Ok(())
    }
}

#[test]
fn dispatch_metrics_carry_a_destination_label_from_a_bounded_set() -> Result<()> {
    let seen = observe();
    let m = &seen.metrics;
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    // More destinations than get a label of their own (the first 64 a
    // process reports; this binary's other tests report `mailer` only).
    let destinations: Vec<String> = (0..70).map(|i| format!("remote-{i:02}")).collect();
    outbox.enqueue_many(
        destinations
            .iter()
            .map(|d| NewEntry::new(d.clone(), d.clone(), "key", Vec::new())),
        t(0),
    )?;
    let handle = Dispatcher::builder(outbox.clone())
        .clock(ManualClock::new(t(0)))
        .start(|_| Delivery::Delivered)?;
    eventually_some("every entry is delivered", || {
        (handle.stats().delivered == 70).then_some(())
    });
    handle.shutdown()?;

    let label = |labels: &[(String, String)]| {
        labels
            .iter()
            .find(|(k, _)| k == "destination")
            .map(|(_, v)| v.clone())
            .expect("a destination label")
    };
    let mut own = 0;
    let mut counted = 0;
    for labels in m.series("idemstore_dispatch_outcomes_total") {
        let destination = label(&labels);
        let pairs: Vec<(&str, &str)> = labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let n = m
            .counter("idemstore_dispatch_outcomes_total", &pairs)
            .expect("a count");
        counted += n;
        if destination == "_other" {
            assert!(n >= 6, "at least the six beyond 64: {n}");
        } else {
            assert!(destinations.contains(&destination), "{destination}");
            assert_eq!(n, 1, "{destination}");
            own += 1;
        }
    }
    assert_eq!(counted, 70, "every settlement counted once");
    assert!(
        (63..=64).contains(&own),
        "{own} destinations with their own label"
    );
    // The send times carry the same labels.
    let histograms = m.series("idemstore_dispatch_send_seconds");
    assert_eq!(histograms.len(), own + 1);
    assert!(histograms.iter().any(|l| label(l) == "_other"));
    // The events carry every destination's own name.
    let attempts = seen.events.named("idemstore::dispatch", "attempt");
    let mut named: Vec<&str> = attempts
        .iter()
        .filter_map(|e| e.field("destination"))
        .collect();
    named.sort_unstable();
    assert_eq!(
        named,
        destinations.iter().map(String::as_str).collect::<Vec<_>>()
    );
    Ok(())
}

#[test]
fn the_sends_in_flight_are_a_gauge_per_destination() -> Result<()> {
    let seen = observe();
    let m = &seen.metrics;
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let (go, gate) = crossbeam_channel::bounded::<()>(0);
    let handle = Dispatcher::builder(outbox.clone())
        .clock(ManualClock::new(t(0)))
        .workers(1)
        .start(move |_| {
            let _ = gate.recv();
            Delivery::Delivered
        })?;
    let in_flight = || m.gauge("idemstore_dispatch_in_flight", &[("destination", "mailer")]);
    outbox.enqueue(entry(1), t(0))?;
    eventually_some("the send is in flight", || {
        (in_flight() == Some(1.0)).then_some(())
    });
    go.send(()).expect("the send waits at the gate");
    eventually_some("the send has ended", || {
        (handle.stats().delivered == 1 && in_flight() == Some(0.0)).then_some(())
    });
    handle.shutdown()?;
    Ok(())
}
