//! The async dispatcher (`start_async`, feature `tokio`): an axum app
//! receiving the entries a hyper client sends, on `current_thread` and
//! multi-thread runtimes; shutdown and dropping the handle while a send is
//! in flight; retries, back-off and `max_attempts`, the reaper, fencing,
//! panicking sends, the janitor and store errors, as the thread dispatcher
//! has them; `workers` bounding the sends in flight.
#![cfg(feature = "tokio")]

mod common;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::post;
use chrono::{DateTime, Utc};
use common::t;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemstore::redb::{ReadableTable as _, TableDefinition, TableHandle as _};
use idemstore::{
    Clock, Delivery, Dispatcher, Error, Janitor, ManualClock, NewEntry, OutboxEntry, OutboxId,
    OutboxStatus, REASON_MAX_ATTEMPTS, REASON_PANIC, RetryPolicy, Store,
};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::{Instant, timeout};

type TestError = Box<dyn std::error::Error + Send + Sync>;
type TestResult = std::result::Result<(), TestError>;

/// Polls `probe` until it gives a value, sleeping a millisecond between
/// looks: the dispatcher's tasks work on their own, so their effects are
/// observed, not awaited.
async fn eventually<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(value) = probe() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn entry(i: usize) -> NewEntry {
    entry_to("remote", i)
}

fn entry_to(destination: &str, i: usize) -> NewEntry {
    NewEntry::new(
        format!("cmd-{i}"),
        destination,
        format!("key-{i}"),
        format!("{i}").into_bytes(),
    )
}

fn status(outbox: &idemstore::Outbox, id: OutboxId) -> Option<OutboxStatus> {
    outbox.get(id).ok().map(|r| r.entry.status)
}

/// A gate that sends wait at until the test opens it.
fn gate() -> (watch::Sender<bool>, watch::Receiver<bool>) {
    watch::channel(false)
}

async fn pass(gate: &mut watch::Receiver<bool>) {
    gate.wait_for(|open| *open).await.unwrap();
}

// ---------- an axum app and a hyper client ----------

/// What the remote received: `(destination, idempotency key, body)`, in
/// order.
#[derive(Clone, Default)]
struct Remote {
    received: Arc<Mutex<Vec<Received>>>,
}

/// One request the remote received: `(destination, idempotency key, body)`.
type Received = (String, String, Vec<u8>);

/// `POST /{destination}`: 200, except `flaky` (503 the first time a key
/// comes) and `gone` (410).
async fn receive(
    State(remote): State<Remote>,
    Path(destination): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let mut received = remote.received.lock();
    let seen = received
        .iter()
        .any(|(d, k, _)| *d == destination && *k == key);
    received.push((destination.clone(), key, body.to_vec()));
    match destination.as_str() {
        "flaky" if !seen => StatusCode::SERVICE_UNAVAILABLE,
        "gone" => StatusCode::GONE,
        _ => StatusCode::OK,
    }
}

/// Serves the remote on a loopback port of the current runtime.
async fn serve(remote: Remote) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new()
        .route("/{destination}", post(receive))
        .with_state(remote);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A `send` that POSTs the entry to `http://{addr}/{destination}` with its
/// idempotency key, through a hyper client.
fn http_send(
    addr: SocketAddr,
) -> impl Fn(OutboxEntry) -> std::pin::Pin<Box<dyn Future<Output = Delivery> + Send>>
+ Send
+ Sync
+ 'static {
    let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
    move |entry: OutboxEntry| {
        let client = client.clone();
        Box::pin(async move {
            let request = Request::post(format!("http://{addr}/{}", entry.destination))
                .header("idempotency-key", &entry.idempotency_key)
                .body(Body::from(entry.payload))
                .unwrap();
            match client.request(request).await {
                Ok(response) if response.status().is_success() => Delivery::Delivered,
                Ok(response) if response.status().is_server_error() => Delivery::Retry {
                    reason: format!("http_{}", response.status().as_u16()),
                },
                Ok(response) => Delivery::Failed {
                    reason: format!("http_{}", response.status().as_u16()),
                },
                // The request may have left: the remote may have it.
                Err(_) => Delivery::OutcomeUnknown { remote_ref: None },
            }
        })
    }
}

/// Entries to an axum app delivered by a hyper client through
/// `start_async`, then a clean shutdown.
async fn deliver_through_axum() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("async.idem"))?;
    let outbox = store.outbox();
    let remote = Remote::default();
    let addr = serve(remote.clone()).await;
    // 30 accepted, 5 accepted on their second attempt, 5 refused for good.
    let destination = |i: usize| match i % 8 {
        3 => "flaky",
        5 => "gone",
        _ => "hooks",
    };
    let ids: Vec<OutboxId> = outbox
        .enqueue_many((0..40).map(|i| entry_to(destination(i), i)), Utc::now())?
        .into_iter()
        .map(|e| e.id())
        .collect();
    let handle = Dispatcher::builder(outbox.clone())
        .workers(8)
        .retry(
            RetryPolicy::exponential(Duration::from_millis(1), Duration::from_millis(5))
                .max_attempts(3),
        )
        .start_async(http_send(addr))?;
    eventually("every entry settles", || {
        outbox
            .counts()
            .ok()
            .filter(|c| c.pending == 0 && c.dispatching == 0)
    })
    .await;
    let stats = handle.stats();
    timeout(Duration::from_secs(10), handle.shutdown()).await??;

    let counts = outbox.counts()?;
    assert_eq!(
        (counts.completed, counts.failed, counts.dispatching),
        (35, 5, 0)
    );
    assert_eq!((stats.delivered, stats.retried, stats.failed), (35, 5, 5));
    let received = remote.received.lock().clone();
    let mut times: HashMap<String, usize> = HashMap::new();
    for (i, id) in ids.iter().enumerate() {
        let record = outbox.get(*id)?;
        let key = format!("key-{i}");
        let sends: Vec<_> = received.iter().filter(|(_, k, _)| *k == key).collect();
        assert!(
            sends
                .iter()
                .all(|(d, _, body)| d == destination(i) && *body == i.to_string().into_bytes()),
            "{i}: {sends:?}"
        );
        times.insert(key, sends.len());
        match destination(i) {
            "hooks" => {
                assert_eq!(record.entry.status, OutboxStatus::Completed);
                assert_eq!((record.entry.attempt_count, sends.len()), (1, 1));
            }
            "flaky" => {
                assert_eq!(record.entry.status, OutboxStatus::Completed);
                assert_eq!((record.entry.attempt_count, sends.len()), (2, 2));
                assert_eq!(record.last_failure.as_deref(), Some("http_503"));
            }
            _ => {
                assert_eq!(record.entry.status, OutboxStatus::Failed);
                assert_eq!((record.entry.attempt_count, sends.len()), (1, 1));
                assert_eq!(record.last_failure.as_deref(), Some("http_410"));
            }
        }
        assert_eq!(record.claim, None, "nothing is left claimed");
    }
    assert_eq!(times.len(), 40);
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn an_axum_app_receives_what_a_hyper_client_sends_on_a_current_thread_runtime() -> TestResult
{
    deliver_through_axum().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_axum_app_receives_what_a_hyper_client_sends_on_a_multi_thread_runtime() -> TestResult {
    deliver_through_axum().await
}

// ---------- shutdown and drop ----------

#[tokio::test(flavor = "current_thread")]
async fn shutdown_lets_the_send_in_flight_finish_settles_it_and_gives_the_rest_back() -> TestResult
{
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let ids: Vec<OutboxId> = outbox
        .enqueue_many((0..3).map(entry), Utc::now())?
        .into_iter()
        .map(|e| e.id())
        .collect();
    let (open, gate) = gate();
    let sends = Arc::new(AtomicUsize::new(0));
    let count = sends.clone();
    let handle = Dispatcher::builder(outbox.clone())
        .workers(1)
        .start_async(move |_| {
            count.fetch_add(1, Ordering::SeqCst);
            let mut gate = gate.clone();
            async move {
                pass(&mut gate).await;
                Delivery::Delivered
            }
        })?;
    // One send in flight and one entry claimed ahead of its slot: before a
    // send is timed, the claimer claims as many ahead as it has slots. The
    // third stays pending.
    eventually("the first send starts and the next is claimed", || {
        let counts = outbox.counts().ok()?;
        (sends.load(Ordering::SeqCst) == 1 && counts.dispatching == 2 && counts.pending == 1)
            .then_some(())
    })
    .await;
    let mut shutdown = tokio::spawn(handle.shutdown());
    assert!(
        timeout(Duration::from_millis(50), &mut shutdown)
            .await
            .is_err(),
        "shutdown waits for the send in flight"
    );
    open.send_replace(true);
    timeout(Duration::from_secs(10), shutdown).await???;

    assert_eq!(
        sends.load(Ordering::SeqCst),
        1,
        "nothing sent after the stop"
    );
    let first = outbox.get(ids[0])?;
    assert_eq!(first.entry.status, OutboxStatus::Completed, "settled");
    for id in &ids[1..] {
        let rest = outbox.get(*id)?;
        assert_eq!(rest.entry.status, OutboxStatus::Pending, "given back");
        assert_eq!((rest.claim, rest.last_failure), (None, None));
    }
    assert_eq!(outbox.counts()?.dispatching, 0);
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    Ok(())
}

/// Runs `body` on a thread of its own and fails the test if it has not
/// ended within 30 s (a runtime blocked by a drop cannot time itself out).
fn within_30_s(body: impl FnOnce() -> TestResult + Send + 'static) -> TestResult {
    let (done, ended) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(body().map_err(|e| e.to_string()));
    });
    ended
        .recv_timeout(Duration::from_secs(30))
        .map_err(|_| "hung: the runtime did not get its thread back")?
        .map_err(Into::into)
}

#[test]
fn dropping_the_handle_while_a_send_runs_never_blocks_a_current_thread_runtime() -> TestResult {
    within_30_s(|| {
        let store = Store::in_memory()?;
        let outbox = store.outbox();
        let id = outbox.enqueue(entry(1), Utc::now())?.id();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(async {
            let (open, gate) = gate();
            let (started, mut running) = tokio::sync::mpsc::unbounded_channel();
            let handle = Dispatcher::builder(outbox.clone()).start_async(move |e| {
                started.send(e.id).unwrap();
                let mut gate = gate.clone();
                async move {
                    pass(&mut gate).await;
                    Delivery::Delivered
                }
            })?;
            let sending = timeout(Duration::from_secs(10), running.recv()).await?;
            assert_eq!(sending, Some(id));
            // The send needs this very thread to go on: a drop that waited
            // for it would never return.
            drop(handle);
            open.send_replace(true);
            // The tasks finish on their own: the send ends and is settled.
            eventually("the send is settled after the drop", || {
                (status(&outbox, id) == Some(OutboxStatus::Completed)).then_some(())
            })
            .await;
            assert_eq!(outbox.counts()?.dispatching, 0);
            Ok::<_, TestError>(())
        })?;
        drop(runtime);
        Ok(())
    })
}

#[test]
fn a_runtime_ending_with_a_send_in_flight_does_not_hang_and_a_restart_delivers_it() -> TestResult {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let id = outbox.enqueue(entry(1), t(0))?.id();
    let first = outbox.clone();
    within_30_s(move || {
        // As `#[tokio::main] async fn main` does: a multi-thread runtime,
        // the handle dropped, `main` returns while the remote still
        // has not answered.
        let runtime = tokio::runtime::Runtime::new()?;
        runtime.block_on(async {
            let (started, mut running) = tokio::sync::mpsc::unbounded_channel();
            let handle = Dispatcher::builder(first)
                .clock(ManualClock::new(t(0)))
                .lease(Duration::from_secs(60))
                .start_async(move |e| {
                    started.send(e.id).unwrap();
                    std::future::pending::<Delivery>()
                })?;
            timeout(Duration::from_secs(10), running.recv()).await?;
            drop(handle);
            Ok::<_, TestError>(())
        })?;
        drop(runtime);
        Ok(())
    })?;
    // The claim stayed: the send never ended.
    assert_eq!(status(&outbox, id), Some(OutboxStatus::Dispatching));
    // A restart past the lease: its reaper releases the claim.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let handle = Dispatcher::builder(outbox.clone())
            .clock(ManualClock::new(t(61)))
            .lease(Duration::from_secs(60))
            .start_async(|_| async { Delivery::Delivered })?;
        eventually("the entry is delivered after the restart", || {
            (status(&outbox, id) == Some(OutboxStatus::Completed)).then_some(())
        })
        .await;
        // Counted once the reaper's call returns (the wake-up may come first).
        eventually("the release is counted", || {
            (handle.stats().released == 1).then_some(())
        })
        .await;
        handle.shutdown().await?;
        assert_eq!(outbox.get(id)?.entry.attempt_count, 2);
        Ok(())
    })
}

#[test]
fn start_async_outside_a_runtime_or_without_timers_is_an_error() -> TestResult {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    outbox.enqueue(entry(1), Utc::now())?;
    let err = Dispatcher::builder(outbox.clone())
        .start_async(|_| async { Delivery::Delivered })
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidInput {
                field: "runtime",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("tokio runtime"), "{err}");
    let runtime = tokio::runtime::Builder::new_current_thread().build()?;
    let err = runtime
        .block_on(async {
            Dispatcher::builder(outbox.clone()).start_async(|_| async { Delivery::Delivered })
        })
        .unwrap_err();
    assert!(err.to_string().contains("enable_time"), "{err}");
    let counts = outbox.counts()?;
    assert_eq!((counts.pending, counts.dispatching), (1, 0), "nothing ran");
    Ok(())
}

// ---------- the thread dispatcher's policies, on tasks ----------

#[tokio::test(flavor = "current_thread")]
async fn retries_follow_the_back_off_policy_until_max_attempts_fails_the_entry() -> TestResult {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let clock = ManualClock::new(t(0));
    let id = outbox.enqueue(entry(1), t(0))?.id();
    let policy = RetryPolicy::exponential(Duration::from_secs(1), Duration::from_secs(3))
        .max_attempts(4)
        .jitter(0.0);
    let sends = Arc::new(Mutex::new(Vec::new()));
    let seen = sends.clone();
    let c = clock.clone();
    let handle = Dispatcher::builder(outbox.clone())
        .clock(clock.clone())
        .retry(policy)
        .workers(1)
        .start_async(move |e| {
            seen.lock().push((e.attempt_count, c.now()));
            async {
                Delivery::Retry {
                    reason: "http_503".into(),
                }
            }
        })?;
    // Attempt n fails at time T; the next is due at T + min(2^(n-1), 3) s.
    let mut now = t(0);
    for (attempt, delay) in [(1u32, 1i64), (2, 2), (3, 3)] {
        eventually("the retry is scheduled", || {
            outbox
                .get(id)
                .ok()
                .filter(|r| {
                    r.entry.status == OutboxStatus::Pending && r.entry.attempt_count == attempt
                })
                .map(|_| ())
        })
        .await;
        let record = outbox.get(id)?;
        assert_eq!(
            record.entry.next_attempt_at,
            Some(now + chrono::Duration::seconds(delay))
        );
        assert_eq!(record.last_failure.as_deref(), Some("http_503"));
        // Not due yet: nothing happens until the clock reaches it.
        clock.advance(Duration::from_millis(500));
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(outbox.get(id)?.entry.attempt_count, attempt);
        now += chrono::Duration::seconds(delay);
        clock.set(now);
    }
    eventually("the last attempt fails for good", || {
        (status(&outbox, id) == Some(OutboxStatus::Failed)).then_some(())
    })
    .await;
    let record = outbox.get(id)?;
    assert_eq!(record.entry.attempt_count, 4);
    assert_eq!(record.last_failure.as_deref(), Some(REASON_MAX_ATTEMPTS));
    assert_eq!(record.entry.completed_at, Some(now));
    let sends = sends.lock().clone();
    assert_eq!(
        sends,
        vec![(1, t(0)), (2, t(1)), (3, t(3)), (4, t(6))],
        "one send per attempt, each when due"
    );
    let stats = handle.stats();
    assert_eq!((stats.retried, stats.failed), (3, 1));
    handle.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn the_reaper_releases_only_expired_claims() -> TestResult {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let a = outbox.enqueue(entry(1), t(0))?.id();
    let b = outbox.enqueue(entry(2), t(0))?.id();
    // A crashed worker claimed `a` at t(0) and `b` at t(30).
    assert_eq!(outbox.claim_due(t(0), 1, "crashed")?[0].id, a);
    assert_eq!(outbox.claim_due(t(30), 1, "crashed")?[0].id, b);
    let clock = ManualClock::new(t(70));
    let sent = Arc::new(Mutex::new(Vec::new()));
    let log = sent.clone();
    let handle = Dispatcher::builder(outbox.clone())
        .clock(clock.clone())
        .lease(Duration::from_secs(60))
        .start_async(move |e| {
            log.lock().push(e.id);
            async { Delivery::Delivered }
        })?;
    // At t(70) the cutoff is t(10): only `a` is expired.
    eventually("a is redelivered", || {
        (status(&outbox, a) == Some(OutboxStatus::Completed)).then_some(())
    })
    .await;
    let record_b = outbox.get(b)?;
    assert_eq!(record_b.entry.status, OutboxStatus::Dispatching);
    assert_eq!(
        record_b.claim.map(|c| c.worker_id).as_deref(),
        Some("crashed")
    );
    // The reaper wakes on the clock's jump (its period is 30 s).
    clock.set(t(91));
    eventually("b is redelivered after its lease", || {
        (status(&outbox, b) == Some(OutboxStatus::Completed)).then_some(())
    })
    .await;
    assert_eq!(*sent.lock(), vec![a, b]);
    eventually("both releases are counted", || {
        (handle.stats().released == 2).then_some(())
    })
    .await;
    handle.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn a_send_whose_claim_expired_cannot_settle_the_entry() -> TestResult {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let clock = ManualClock::new(t(0));
    let id = outbox.enqueue(entry(1), t(0))?.id();
    let (open, gate) = gate();
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let log = attempts.clone();
    let handle = Dispatcher::builder(outbox.clone())
        .clock(clock.clone())
        .lease(Duration::from_secs(60))
        .workers(2)
        .start_async(move |e| {
            log.lock().push(e.attempt_count);
            let mut gate = gate.clone();
            async move {
                if e.attempt_count == 1 {
                    // A remote that answers after the lease ran out.
                    pass(&mut gate).await;
                    Delivery::Failed {
                        reason: "late".into(),
                    }
                } else {
                    Delivery::Delivered
                }
            }
        })?;
    eventually("the first attempt is in flight", || {
        (*attempts.lock() == [1]).then_some(())
    })
    .await;
    // The lease runs out: the reaper releases the claim and the entry is
    // claimed and delivered again, while the first send still runs.
    clock.set(t(61));
    eventually("the second attempt completes", || {
        outbox
            .get(id)
            .ok()
            .filter(|r| r.entry.status == OutboxStatus::Completed && r.entry.attempt_count == 2)
    })
    .await;
    open.send_replace(true);
    let stats = eventually("the late settlement is refused by its fence", || {
        Some(handle.stats()).filter(|s| s.fenced == 1 && s.released == 1)
    })
    .await;
    handle.shutdown().await?;
    let record = outbox.get(id)?;
    assert_eq!(record.entry.status, OutboxStatus::Completed);
    assert_eq!(record.entry.attempt_count, 2);
    assert_eq!(
        record.last_failure, None,
        "the late failure changed nothing"
    );
    assert_eq!(stats.delivered, 1);
    assert_eq!(*attempts.lock(), vec![1, 2]);
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    Deliver,
    RetryOnce,
    Fail,
    Unknown,
    /// Panics on its first attempt, in `send` itself.
    PanicOnce,
    /// Panics on its first attempt, inside the future `send` returned.
    PanicInFutureOnce,
}

fn plan(i: usize) -> Plan {
    match i % 20 {
        0..=10 => Plan::Deliver,
        11..=13 => Plan::RetryOnce,
        14 | 15 => Plan::Fail,
        16 | 17 => Plan::Unknown,
        18 => Plan::PanicOnce,
        _ => Plan::PanicInFutureOnce,
    }
}

/// What the send of entry `i` returns, on its first attempt or a later
/// one (the panics aside).
fn planned(i: usize, first: bool) -> Delivery {
    match (plan(i), first) {
        (Plan::RetryOnce, true) => Delivery::Retry {
            reason: "timeout".into(),
        },
        (Plan::Fail, _) => Delivery::Failed {
            reason: "rejected".into(),
        },
        (Plan::Unknown, _) => Delivery::OutcomeUnknown {
            remote_ref: Some(format!("ref-{i}")),
        },
        _ => Delivery::Delivered,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_entries_end_where_their_sender_sends_them() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("d.idem"))?;
    let outbox = store.outbox();
    let n = 1_000;
    let ids: Vec<OutboxId> = outbox
        .enqueue_many((0..n).map(entry), Utc::now())?
        .into_iter()
        .map(|e| e.id())
        .collect();
    let in_flight = Arc::new(Mutex::new(HashSet::new()));
    let delivered: Arc<Mutex<HashMap<OutboxId, u32>>> = Arc::default();
    let (flight, done) = (in_flight.clone(), delivered.clone());
    let handle = Dispatcher::builder(outbox.clone())
        .workers(16)
        .batch_size(32)
        .retry(
            RetryPolicy::exponential(Duration::from_millis(1), Duration::from_millis(5))
                .max_attempts(3),
        )
        .start_async(move |e| {
            let i: usize = std::str::from_utf8(&e.payload).unwrap().parse().unwrap();
            let first = e.attempt_count == 1;
            assert!(
                flight.lock().insert(e.id),
                "{} is in two sends at once",
                e.id
            );
            if plan(i) == Plan::PanicOnce && first {
                flight.lock().remove(&e.id);
                panic!("sender bug on {i}");
            }
            let (flight, done) = (flight.clone(), done.clone());
            async move {
                tokio::task::yield_now().await;
                if plan(i) == Plan::PanicInFutureOnce && first {
                    flight.lock().remove(&e.id);
                    panic!("sender bug in the future of {i}");
                }
                let outcome = planned(i, first);
                if outcome == Delivery::Delivered {
                    *done.lock().entry(e.id).or_default() += 1;
                }
                flight.lock().remove(&e.id);
                outcome
            }
        })?;
    eventually("every entry settles", || {
        outbox
            .counts()
            .ok()
            .filter(|c| c.pending == 0 && c.dispatching == 0)
    })
    .await;
    let stats = handle.stats();
    handle.shutdown().await?;
    let expect = |p: Plan| (0..n).filter(|&i| plan(i) == p).count() as u64;
    let panics = expect(Plan::PanicOnce) + expect(Plan::PanicInFutureOnce);
    let counts = outbox.counts()?;
    assert_eq!(
        counts.completed,
        expect(Plan::Deliver) + expect(Plan::RetryOnce) + panics
    );
    assert_eq!(counts.failed, expect(Plan::Fail));
    assert_eq!(counts.outcome_unknown, expect(Plan::Unknown));
    assert_eq!(stats.panics, panics);
    assert_eq!(stats.retried, expect(Plan::RetryOnce) + panics);
    let delivered = delivered.lock();
    for (i, id) in ids.iter().enumerate() {
        let r = outbox.get(*id)?;
        match plan(i) {
            Plan::Deliver => {
                assert_eq!(r.entry.status, OutboxStatus::Completed);
                assert_eq!(r.entry.attempt_count, 1);
            }
            Plan::RetryOnce | Plan::PanicOnce | Plan::PanicInFutureOnce => {
                assert_eq!(r.entry.status, OutboxStatus::Completed);
                assert_eq!(r.entry.attempt_count, 2, "{i}: one retry");
                let reason = if plan(i) == Plan::RetryOnce {
                    "timeout"
                } else {
                    REASON_PANIC
                };
                assert_eq!(r.last_failure.as_deref(), Some(reason));
            }
            Plan::Fail => {
                assert_eq!(r.entry.status, OutboxStatus::Failed);
                assert_eq!(r.last_failure.as_deref(), Some("rejected"));
            }
            Plan::Unknown => {
                assert_eq!(r.entry.status, OutboxStatus::OutcomeUnknown);
                assert_eq!(r.remote_ref, Some(format!("ref-{i}")));
            }
        }
        if r.entry.status == OutboxStatus::Completed {
            assert_eq!(delivered.get(id), Some(&1), "{i} delivered exactly once");
        }
    }
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn workers_bounds_the_sends_in_flight_far_above_the_thread_count() -> TestResult {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    outbox.enqueue_many((0..100).map(entry), Utc::now())?;
    let in_flight = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (open, gate) = gate();
    let (now, max) = (in_flight.clone(), most.clone());
    let handle = Dispatcher::builder(outbox.clone())
        .workers(32)
        .batch_size(16)
        .start_async(move |_| {
            let (now, max, mut gate) = (now.clone(), max.clone(), gate.clone());
            async move {
                let sending = now.fetch_add(1, Ordering::SeqCst) + 1;
                max.fetch_max(sending, Ordering::SeqCst);
                pass(&mut gate).await;
                now.fetch_sub(1, Ordering::SeqCst);
                Delivery::Delivered
            }
        })?;
    // 32 sends in flight on one thread, and 16 more claimed ahead, waiting
    // for a free slot.
    eventually("32 sends in flight, 16 waiting", || {
        let counts = outbox.counts().ok()?;
        (in_flight.load(Ordering::SeqCst) == 32 && counts.dispatching == 48).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(in_flight.load(Ordering::SeqCst), 32);
    assert_eq!(outbox.counts()?.dispatching, 48);
    open.send_replace(true);
    eventually("every entry is delivered", || {
        outbox.counts().ok().filter(|c| c.completed == 100)
    })
    .await;
    handle.shutdown().await?;
    assert_eq!(most.load(Ordering::SeqCst), 32, "never more than `workers`");
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn an_enqueue_wakes_an_idle_dispatcher_at_once() -> TestResult {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let handle = Dispatcher::builder(outbox.clone())
        .workers(1)
        .start_async(move |e| {
            tx.send(e.id).unwrap();
            async { Delivery::Delivered }
        })?;
    // Let the claimer go idle (it would sleep a minute without a wake-up).
    tokio::time::sleep(Duration::from_millis(20)).await;
    for i in 0..5 {
        let id = if i % 2 == 0 {
            outbox.enqueue(entry(i), Utc::now())?.id()
        } else {
            // From inside the caller's own transaction: woken once it commits.
            store
                .write(|tx| outbox.enqueue_in(tx, entry(i), Utc::now()))?
                .id()
        };
        let got = timeout(Duration::from_secs(10), rx.recv())
            .await
            .map_err(|_| "an enqueue must wake the idle dispatcher, not wait for its timer")?;
        assert_eq!(got, Some(id));
    }
    assert!(handle.stats().latency.count >= 5);
    handle.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn the_janitor_runs_on_its_schedule_by_the_clock() -> TestResult {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    // Two entries finished at t(0) and t(3000).
    let old = outbox.enqueue(entry(1), t(0))?.id();
    let young = outbox.enqueue(entry(2), t(0))?.id();
    assert_eq!(outbox.claim_due(t(0), 2, "w")?.len(), 2);
    outbox.mark_completed(old, t(0))?;
    outbox.mark_completed(young, t(3000))?;
    let clock = ManualClock::new(t(3601));
    let janitor = Janitor::new()
        .every(Duration::from_secs(3600))
        .outbox(outbox.clone(), Duration::from_secs(3600));
    let handle = Dispatcher::builder(outbox.clone())
        .clock(clock.clone())
        .janitor(janitor)
        .start_async(|_| async { Delivery::Delivered })?;
    let first = eventually("the janitor's first run", || {
        handle.stats().janitor.filter(|j| j.runs == 1)
    })
    .await;
    assert_eq!(first.last_run_at, Some(t(3601)));
    assert_eq!(first.last_report.map(|r| r.outbox_purged), Some(1));
    assert!(outbox.get(old).is_err() && outbox.get(young).is_ok());
    // The next run comes an interval later by the clock, woken by its jump.
    clock.set(t(7201));
    let second = eventually("the janitor's second run", || {
        handle.stats().janitor.filter(|j| j.runs == 2)
    })
    .await;
    assert_eq!(second.last_run_at, Some(t(7201)));
    assert!(outbox.get(young).is_err());
    handle.shutdown().await?;
    Ok(())
}

/// The outbox's records, as a caller can reach them to damage them.
const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("idemstore.v1.outbox");

#[tokio::test(flavor = "current_thread")]
async fn a_failed_claim_is_kept_with_its_time_and_the_dispatcher_carries_on() -> TestResult {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    // The first entry in line does not decode: the claim that reads it fails.
    let id = outbox.enqueue(entry(1), t(10))?.id();
    let good = store.write(|tx| {
        let mut records = tx.open_table(OUTBOX)?;
        let good = records
            .get(id.0)?
            .map(|v| v.value().to_vec())
            .ok_or(Error::NotFound)?;
        records.insert(id.0, b"\x01garbage".as_slice())?;
        Ok::<_, Error>(good)
    })?;
    let handle = Dispatcher::builder(outbox.clone())
        .clock(ManualClock::new(t(10)))
        .start_async(|_| async { Delivery::Delivered })?;
    let last = eventually("the claim fails", || handle.stats().last_error).await;
    assert_eq!((last.during, last.at), ("claim", t(10)));
    assert!(
        last.message.contains(OUTBOX.name()) && last.message.contains(&id.0.to_string()),
        "{}",
        last.message
    );
    // Repaired, it delivers again (after its back-off).
    store.write(|tx| {
        tx.open_table(OUTBOX)?.insert(id.0, good.as_slice())?;
        Ok::<_, Error>(())
    })?;
    eventually("the entry is delivered", || {
        (status(&outbox, id) == Some(OutboxStatus::Completed)).then_some(())
    })
    .await;
    assert!(handle.stats().store_errors >= 1);
    handle.shutdown().await?;
    Ok(())
}

/// A manual clock that panics once it is armed.
struct BreakingClock {
    inner: ManualClock,
    armed: Arc<AtomicBool>,
}

impl Clock for BreakingClock {
    fn now(&self) -> DateTime<Utc> {
        assert!(!self.armed.swap(false, Ordering::SeqCst), "clock broke");
        self.inner.now()
    }

    fn changes(&self) -> Option<crossbeam_channel::Receiver<()>> {
        self.inner.changes()
    }

    fn changes_async(&self) -> Option<watch::Receiver<()>> {
        self.inner.changes_async()
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_panicked_task_is_kept_and_is_error_panicked_at_shutdown() -> TestResult {
    let store = Store::in_memory()?;
    let manual = ManualClock::new(t(5));
    let armed = Arc::new(AtomicBool::new(false));
    let clock = BreakingClock {
        inner: manual.clone(),
        armed: armed.clone(),
    };
    let handle = Dispatcher::builder(store.outbox())
        .clock(clock)
        .start_async(|_| async { Delivery::Delivered })?;
    tokio::time::sleep(Duration::from_millis(20)).await;
    armed.store(true, Ordering::SeqCst);
    // Wakes the tasks, the first to read the clock panics.
    manual.advance(Duration::from_secs(1));
    let last = eventually("a task panics", || handle.stats().last_error).await;
    assert!(
        last.during.starts_with("the async dispatcher's"),
        "{last:?}"
    );
    assert!(last.message.contains("clock broke"), "{}", last.message);
    match handle.shutdown().await {
        Err(Error::Panicked { during, message }) => {
            assert_eq!(during, last.during);
            assert_eq!(message, "clock broke");
        }
        other => panic!("expected Error::Panicked, got {other:?}"),
    }
    Ok(())
}
