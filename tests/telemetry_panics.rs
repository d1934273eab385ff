//! Code the store does not own never changes an answer, hangs a caller or
//! breaks the store: a `metrics` recorder and a `tracing` subscriber that
//! panic at their Nth call, for every N a small concurrent workload reaches,
//! on a store held alone and on one shared between processes.
//!
//! For each N: every call answers within a bound, and answers `Ok` (there
//! is no other fault); after reopening, everything a call was told it wrote
//! is in the file and nothing a failed call would have written is; and a
//! later call on the same store answers `Ok`.
//!
//! The recorder and the subscriber are the process's global ones, so this
//! binary holds one test.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use common::t;
use idemstore::redb::{ReadableTable as _, TableDefinition};
use idemstore::{Begin, Claim, Enqueued, Error, NewEntry, OutboxId, OutboxStatus, Result, Store};
use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};

/// Calls into the recorder and the subscriber so far.
static CALLS: AtomicU64 = AtomicU64::new(0);
/// The call that panics (0: none).
static PANIC_AT: AtomicU64 = AtomicU64::new(0);
const MESSAGE: &str = "telemetry panics at its call";

/// One call into code the store does not own.
fn call() {
    let n = CALLS.fetch_add(1, Ordering::SeqCst) + 1;
    assert!(n != PANIC_AT.load(Ordering::SeqCst), "{MESSAGE} {n}");
}

struct Handle;

impl CounterFn for Handle {
    fn increment(&self, _: u64) {
        call();
    }
    fn absolute(&self, _: u64) {
        call();
    }
}

impl GaugeFn for Handle {
    fn increment(&self, _: f64) {
        call();
    }
    fn decrement(&self, _: f64) {
        call();
    }
    fn set(&self, _: f64) {
        call();
    }
}

impl HistogramFn for Handle {
    fn record(&self, _: f64) {
        call();
    }
}

struct PanickyRecorder;

impl Recorder for PanickyRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {
        call();
    }
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {
        call();
    }
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {
        call();
    }
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        call();
        Counter::from_arc(Arc::new(Handle))
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        call();
        Gauge::from_arc(Arc::new(Handle))
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        call();
        Histogram::from_arc(Arc::new(Handle))
    }
}

struct PanickySubscriber;

impl Subscriber for PanickySubscriber {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        call();
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {
        call();
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {
        call();
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

const ROWS: TableDefinition<&str, u64> = TableDefinition::new("app.rows");
const THREADS: usize = 3;
/// Far above what any call takes: a call not answered by then never will.
const BOUND: Duration = Duration::from_secs(30);

/// What a call was told it wrote, to look for after reopening; or, for a
/// call that failed, what it would have written, to find absent.
#[derive(Debug, Clone)]
enum Wrote {
    Claimed(String),
    Row(String),
    Entry(OutboxId),
    Completed(OutboxId),
    Response(String),
}

/// One thread's calls: every outcome, `Ok` or not, with what it concerns.
fn workload(store: &Store, thread: usize) -> Vec<(Result<()>, Vec<Wrote>)> {
    let inbox = store.inbox("events").unwrap();
    let outbox = store.outbox();
    let keys = store.idempotency_keys();
    let mut done = Vec::new();
    let key = |what: &str| format!("{what}-{thread}");

    let k = key("claim");
    done.push((
        inbox
            .claim(&k, t(1))
            .and_then(|first| first.then_some(()).ok_or(Error::NotFound)),
        vec![Wrote::Claimed(k)],
    ));

    let k = key("effect");
    let row = k.clone();
    let out = inbox.claim_with(&k, t(2), move |tx| {
        tx.open_table(ROWS)?.insert(row.as_str(), 1)?;
        Ok::<_, Error>(())
    });
    done.push((
        out.and_then(|c| match c {
            Claim::Applied(()) => Ok(()),
            Claim::Duplicate => Err(Error::NotFound),
        }),
        vec![Wrote::Claimed(k.clone()), Wrote::Row(k)],
    ));

    match outbox.enqueue(
        NewEntry::new(key("cmd"), "mail", key("send"), b"hi".to_vec()),
        t(3),
    ) {
        Ok(Enqueued::New(id)) => done.push((Ok(()), vec![Wrote::Entry(id)])),
        Ok(Enqueued::Duplicate(_)) => done.push((Err(Error::NotFound), Vec::new())),
        Err(e) => done.push((Err(e), Vec::new())),
    }

    let (claimed, row) = (key("together"), key("together-row"));
    let entry = NewEntry::new(key("cmd2"), "mail", key("send2"), b"yo".to_vec());
    let out = store.write(|tx| {
        inbox.claim_in(tx, &claimed, t(4))?;
        tx.open_table(ROWS)?.insert(row.as_str(), 2)?;
        outbox.enqueue_in(tx, entry, t(4)).map(|e| e.id())
    });
    match out {
        Ok(id) => done.push((
            Ok(()),
            vec![Wrote::Claimed(claimed), Wrote::Row(row), Wrote::Entry(id)],
        )),
        Err(e) => done.push((Err(e), vec![Wrote::Claimed(claimed), Wrote::Row(row)])),
    }

    let k = key("request");
    match keys.begin("", &k, "fp", t(5)) {
        Ok(Begin::Proceed(r)) => {
            let out = keys
                .complete(&r, r.response(201, b"made".to_vec(), t(6)), t(6))
                .and_then(|stored| stored.then_some(()).ok_or(Error::NotFound));
            done.push((out, vec![Wrote::Response(k)]));
        }
        Ok(other) => done.push((
            Err(Error::Conflict {
                reason: format!("{other:?}"),
            }),
            Vec::new(),
        )),
        Err(e) => done.push((Err(e), vec![Wrote::Response(k)])),
    }

    match outbox.claim_due(t(7), 2, &key("worker")) {
        Ok(entries) => {
            for entry in entries {
                let out = outbox.mark_completed(entry.id, t(8));
                let wrote = if out.is_ok() {
                    vec![Wrote::Completed(entry.id)]
                } else {
                    Vec::new()
                };
                done.push((out, wrote));
            }
        }
        Err(e) => done.push((Err(e), Vec::new())),
    }
    done
}

/// Whether what `wrote` names is in the reopened store.
fn is_there(store: &Store, wrote: &Wrote) -> Result<bool> {
    Ok(match wrote {
        Wrote::Claimed(k) => store.inbox("events")?.seen(k)?,
        Wrote::Row(k) => store.read(|tx| match tx.open_table(ROWS) {
            Ok(rows) => Ok::<_, Error>(rows.get(k.as_str()).map_err(Error::from)?.is_some()),
            Err(_) => Ok(false),
        })?,
        Wrote::Entry(id) => store.outbox().get(*id).is_ok(),
        Wrote::Completed(id) => store.outbox().get(*id)?.entry.status == OutboxStatus::Completed,
        Wrote::Response(k) => store.idempotency_keys().get("", k, t(0))?.is_some(),
    })
}

fn open(path: &Path, shared: bool) -> Result<Store> {
    Store::builder().shared(shared).open(path)
}

/// One run with the `panic_at`th call from now panicking (0: none);
/// returns how many calls the run made.
fn run(dir: &Path, shared: bool, panic_at: u64) -> u64 {
    let path = dir.join(format!("store-{shared}-{panic_at}.idem"));
    let store = open(&path, shared).unwrap();
    let start = CALLS.load(Ordering::SeqCst);
    PANIC_AT.store(
        if panic_at == 0 { 0 } else { start + panic_at },
        Ordering::SeqCst,
    );

    let (answers, answered) = mpsc::channel();
    for thread in 0..THREADS {
        let (store, answers) = (store.clone(), answers.clone());
        std::thread::spawn(move || {
            let out = catch_unwind(AssertUnwindSafe(|| workload(&store, thread)));
            // Closed before the answer goes, so that the file can be reopened.
            drop(store);
            let _ = answers.send(out);
        });
    }
    let mut outcomes = Vec::new();
    for _ in 0..THREADS {
        let out = answered
            .recv_timeout(BOUND)
            .unwrap_or_else(|_| panic!("panic at call {panic_at}: a call never answered"));
        let calls = out.unwrap_or_else(|_| {
            panic!("panic at call {panic_at}: the telemetry's panic reached a caller")
        });
        outcomes.extend(calls);
    }
    let made = CALLS.load(Ordering::SeqCst) - start;
    PANIC_AT.store(0, Ordering::SeqCst);

    // A later call on the same store answers.
    let later = store.inbox("events").unwrap().claim("later", t(9));
    assert!(
        matches!(later, Ok(true)),
        "panic at call {panic_at}: a later call: {later:?}"
    );
    drop(store);

    let reopened = open(&path, shared).unwrap();
    for (out, wrote) in &outcomes {
        assert!(
            out.is_ok(),
            "panic at call {panic_at}: a call answered {out:?}"
        );
        for w in wrote {
            let there = is_there(&reopened, w).unwrap();
            assert_eq!(
                there,
                out.is_ok(),
                "panic at call {panic_at}: {w:?} after a call that answered {out:?}"
            );
        }
    }
    assert!(reopened.inbox("events").unwrap().seen("later").unwrap());
    made
}

#[test]
fn a_recorder_and_a_subscriber_that_panic_at_any_call_change_no_answer() {
    metrics::set_global_recorder(PanickyRecorder).unwrap();
    tracing::subscriber::set_global_default(PanickySubscriber).unwrap();
    // The panics are expected: keep their messages out of the output.
    let quiet = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !info.to_string().contains(MESSAGE) {
            quiet(info);
        }
    }));

    let dir = tempfile::tempdir().unwrap();
    for shared in [false, true] {
        let calls = run(dir.path(), shared, 0);
        assert!(
            calls > 20,
            "the workload reaches the telemetry: {calls} calls"
        );
        // Every call of the workload, or an even spread of 100 of them
        // (each run opens, fills and reopens a store).
        let step = calls.div_ceil(100).max(1);
        let mut n = 1;
        while n <= calls {
            run(dir.path(), shared, n);
            n += step;
        }
        common::report(&format!(
            "telemetry panics ({}): a panic at each of {} of the workload's {calls} calls \
             changed no answer",
            if shared {
                "shared store"
            } else {
                "exclusive store"
            },
            calls.div_ceil(step)
        ));
    }
}
