//! The batch protocol under a model checker: shuttle replaces the engine's
//! threads, locks and atomics (`sync.rs`) and chooses, iteration after
//! iteration, which thread runs at every point where one may block or
//! wake another — queueing, leading, handing the lead on, the wake tree,
//! the durable sequence, the open transaction of `Durability::None`. Faults
//! ride along: operations that fail, operations that panic, after-commit
//! hooks that panic, a commit whose fsync fails.
//!
//! Properties, checked on every schedule: every caller is answered (a
//! schedule where all threads wait for each other is a deadlock, which
//! shuttle reports), exactly once, with its own answer; no `Ok` before the
//! durable sequence has reached its commit; two batches never run at once
//! (the lead is never held by two); what was answered `Ok` is there at the
//! end, and nothing that failed is.
//!
//! `RUSTFLAGS="--cfg shuttle" cargo test --lib engine::model` runs it
//! (`IDEMSTORE_MODEL_ITERATIONS`, default 300 per test).

use std::collections::BTreeMap;
use std::io;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64 as StdAtomicU64, AtomicUsize as StdAtomicUsize, Ordering};
use std::time::Duration;

use redb::backends::InMemoryBackend;
use redb::{BackendError, ReadableTable, StorageBackend, TableDefinition};

use super::{Durability, Engine, EngineConfig, after_commit};
use crate::error::{Error, Result};

const T: TableDefinition<&str, u64> = TableDefinition::new("t");

fn iterations() -> usize {
    std::env::var("IDEMSTORE_MODEL_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

/// Shuttle's settings: stacks large enough for redb's commit path (its
/// default of 32 KiB overflows).
fn config() -> shuttle::Config {
    let mut c = shuttle::Config::default();
    c.stack_size = 4 << 20;
    c
}

/// `f` under `iterations` random schedules.
fn random(f: impl Fn() + Send + Sync + 'static) {
    shuttle::Runner::new(
        shuttle::scheduler::RandomScheduler::new(iterations()),
        config(),
    )
    .run(f);
}

/// `f` under `iterations` PCT schedules of depth `depth`.
fn pct(f: impl Fn() + Send + Sync + 'static, depth: usize) {
    shuttle::Runner::new(
        shuttle::scheduler::PctScheduler::new(depth, iterations()),
        config(),
    )
    .run(f);
}

/// redb's in-memory backend whose sync number `fail_at` (counted from its
/// creation, 1-based; 0: none) fails.
#[derive(Debug)]
struct Disk {
    inner: InMemoryBackend,
    syncs: Arc<StdAtomicU64>,
    fail_at: Arc<StdAtomicU64>,
}

impl StorageBackend for Disk {
    fn len(&self) -> Result<u64, BackendError> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BackendError> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> Result<(), BackendError> {
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> Result<(), BackendError> {
        let n = self.syncs.fetch_add(1, Ordering::SeqCst) + 1;
        if n == self.fail_at.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected sync failure").into());
        }
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        self.inner.write(offset, data)
    }
}

/// An engine on a fresh in-memory disk whose `fail_sync`-th fsync from now
/// on fails (0: none).
fn engine(durability: Durability, max_batch: usize, fail_sync: u64) -> Arc<Engine> {
    let (syncs, fail_at) = (
        Arc::new(StdAtomicU64::new(0)),
        Arc::new(StdAtomicU64::new(0)),
    );
    let disk = Disk {
        inner: InMemoryBackend::new(),
        syncs: syncs.clone(),
        fail_at: fail_at.clone(),
    };
    let db = redb::Database::builder()
        .create_with_backend(disk)
        .expect("an in-memory database");
    let config = EngineConfig {
        durability,
        quick_repair: false,
        max_batch,
        flush_interval: Duration::from_secs(3600),
        shared: false,
    };
    let engine = Engine::start(db, config, None).expect("an engine");
    if fail_sync > 0 {
        fail_at.store(syncs.load(Ordering::SeqCst) + fail_sync, Ordering::SeqCst);
    }
    Arc::new(engine)
}

/// What one caller does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    /// Writes its key.
    Put,
    /// Writes its key, then fails: nothing of it may stay.
    Fail,
    /// Writes its key, then panics: its caller gets the panic.
    Panic,
    /// Writes its key and leaves an after-commit hook that panics.
    HookPanics,
}

/// What a caller was told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Ok,
    Err,
    Panicked,
}

/// The checks that run inside every operation, against the engine's own
/// state, shared by the callers of one schedule.
#[derive(Default)]
struct Watch {
    /// Operations running now (each inside a batch): never two at once.
    running: StdAtomicUsize,
}

/// Runs `call` for `key` on `engine`: its answer, and for an `Ok` under
/// `Durability::Immediate`, checks that the durable sequence covers the
/// commit that held it.
fn run(engine: &Engine, watch: &Arc<Watch>, key: &'static str, call: Call) -> Answer {
    let expected = Arc::new(StdAtomicU64::new(0));
    let (w, seq) = (watch.clone(), expected.clone());
    let inner = engine.inner.clone();
    let out = catch_unwind(AssertUnwindSafe(|| {
        engine.execute(move |tx| {
            assert_eq!(
                w.running.fetch_add(1, Ordering::SeqCst),
                0,
                "two batches ran at once"
            );
            // This batch's commit takes the next sequence number, under
            // redb's write lock, which this transaction holds.
            seq.store(inner.seq.load(Ordering::SeqCst) + 1, Ordering::SeqCst);
            let wrote = tx.open_table(T)?.insert(key, 1).map(|_| ());
            w.running.fetch_sub(1, Ordering::SeqCst);
            wrote?;
            match call {
                Call::Put => Ok(()),
                Call::Fail => Err(Error::conflict("this operation fails")),
                Call::Panic => panic!("this operation panics"),
                Call::HookPanics => {
                    after_commit(|| panic!("this hook panics"));
                    Ok(())
                }
            }
        })
    }));
    match out {
        Ok(Ok(())) => {
            if engine.durability() == Durability::Immediate {
                let durable = engine.inner.sync.lock().durable;
                let needed = expected.load(Ordering::SeqCst);
                assert!(
                    durable >= needed,
                    "{key}: Ok while the durable sequence is {durable}, before its commit {needed}"
                );
            }
            Answer::Ok
        }
        Ok(Err(_)) => Answer::Err,
        Err(_) => Answer::Panicked,
    }
}

/// The keys in the table at the end (`Err` from an engine a failed fsync
/// broke).
fn keys(engine: &Engine) -> Result<Vec<String>> {
    engine.read(|tx| match tx.open_table(T) {
        Ok(t) => t
            .iter()?
            .map(|r| r.map(|(k, _)| k.value().to_owned()).map_err(Error::from))
            .collect(),
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(Vec::new()),
        Err(e) => Err(e.into()),
    })
}

/// The keys of the three callers' two calls.
const KEYS: [[&str; 2]; 3] = [["a0", "a1"], ["b0", "b1"], ["c0", "c1"]];

/// One schedule: three callers, two calls each, the calls given by
/// `plan`, on an engine whose `fail_sync`-th fsync fails (0: none); then
/// the answers and the table checked against each other.
fn schedule(durability: Durability, max_batch: usize, plan: [[Call; 2]; 3], fail_sync: u64) {
    let broken = fail_sync > 0;
    let engine = engine(durability, max_batch, fail_sync);
    let watch = Arc::new(Watch::default());
    let callers: Vec<_> = (0..3)
        .map(|c| {
            let (engine, watch) = (engine.clone(), watch.clone());
            shuttle::thread::spawn(move || {
                (0..2)
                    .map(|i| {
                        (
                            KEYS[c][i],
                            plan[c][i],
                            run(&engine, &watch, KEYS[c][i], plan[c][i]),
                        )
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut answers = BTreeMap::new();
    for caller in callers {
        for (key, call, answer) in caller.join().expect("a caller's thread") {
            answers.insert(key, (call, answer));
        }
    }
    if durability == Durability::None && !broken {
        engine.sync().expect("a final sync");
    }
    let stored = match keys(&engine) {
        Ok(stored) => stored,
        // Broken: every later call is refused, reads included.
        Err(e) if broken => {
            assert!(
                e.is_storage() || matches!(e, Error::Panicked { .. }),
                "{e:?}"
            );
            return;
        }
        Err(e) => panic!("a read at the end: {e:?}"),
    };
    for (key, (call, answer)) in &answers {
        let expected = match call {
            Call::Put | Call::HookPanics => Answer::Ok,
            Call::Fail => Answer::Err,
            Call::Panic => Answer::Panicked,
        };
        if !broken {
            assert_eq!(*answer, expected, "{key} ({call:?})");
        }
        let kept = stored.iter().any(|k| k == key);
        match answer {
            Answer::Ok => assert!(kept, "{key} was answered Ok and is gone"),
            Answer::Err | Answer::Panicked if !broken => {
                assert!(!kept, "{key} failed and its write stayed");
            }
            _ => {}
        }
    }
}

/// Plans mixing every fault among the three callers.
const PLANS: [[[Call; 2]; 3]; 3] = [
    [
        [Call::Put, Call::Fail],
        [Call::Panic, Call::Put],
        [Call::HookPanics, Call::Put],
    ],
    [
        [Call::HookPanics, Call::HookPanics],
        [Call::Put, Call::Put],
        [Call::Fail, Call::Panic],
    ],
    [
        [Call::Put, Call::Put],
        [Call::Put, Call::HookPanics],
        [Call::Put, Call::Fail],
    ],
];

#[test]
fn every_caller_is_answered_once_and_never_before_its_commit_is_durable() {
    for (p, plan) in PLANS.into_iter().enumerate() {
        for max_batch in [1, 2, 64] {
            random(move || schedule(Durability::Immediate, max_batch, plan, 0));
            eprintln!(
                "model (immediate): plan {p}, max_batch {max_batch}: {} random schedules",
                iterations()
            );
        }
    }
}

#[test]
fn under_pct_schedules_no_caller_waits_forever() {
    // PCT (probabilistic concurrency testing) favours the rare orders a
    // random walk seldom takes, to depth 3.
    for plan in PLANS {
        pct(move || schedule(Durability::Immediate, 2, plan, 0), 3);
    }
}

#[test]
fn under_none_batches_share_the_open_transaction_and_every_caller_is_answered() {
    for plan in PLANS {
        for max_batch in [1, 3] {
            random(move || schedule(Durability::None, max_batch, plan, 0));
        }
    }
}

#[test]
fn a_failed_fsync_answers_every_caller_and_loses_nothing_answered_ok() {
    for fail_sync in [1, 2] {
        for max_batch in [1, 64] {
            random(move || schedule(Durability::Immediate, max_batch, PLANS[2], fail_sync));
        }
    }
}
