//! `PgStore`'s blocking calls from async code, and the client's own types
//! in effects.
//!
//! The store's connections run on a runtime of its own, and a blocking call
//! waits on its future without starting a runtime: connected and called
//! straight from `async fn main` (multi-thread), from a task, or on the
//! thread of a current-thread runtime, every call works, the ones that run
//! the caller's closure included. Never a panic.
//!
//! Needs `IDEMSTORE_TEST_POSTGRES` (see `tests/common/pg.rs`); without it
//! the tests say so and pass, except under `CI=true`.

use std::error::Error as StdError;

use idemstore::chrono::{DateTime, TimeZone, Utc};
use idemstore::postgres::PgStore;
use idemstore::{Claim, Error, NewEntry};

mod common;

use common::pg::{DropSchema, unique_schema, url};

type TestResult = Result<(), Box<dyn StdError + Send + Sync>>;

fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2025, 1, 1, 0, 0, 0).unwrap()
}

/// A store in a fresh schema, connected on this thread, and the guard that
/// drops the schema.
fn connect(url: &str) -> Result<(PgStore, DropSchema), Error> {
    let schema = unique_schema();
    let store = PgStore::builder()
        .schema(&schema)
        .pool_size(2)
        .connect(url)?;
    Ok((
        store,
        DropSchema {
            url: url.to_owned(),
            schema,
        },
    ))
}

/// The store's own calls, made on this thread: connect, claim, enqueue,
/// `claim_due`, begin, reads, drop.
fn own_calls(url: &str) -> TestResult {
    let (store, _drop) = connect(url)?;
    let inbox = store.inbox("webhooks")?;
    assert!(inbox.claim("evt-1", t0())?);
    assert!(!inbox.claim("evt-1", t0())?);
    let outbox = store.outbox();
    let entry = NewEntry::new("c", "mailer", "k1", b"hi".to_vec());
    assert!(outbox.enqueue(entry, t0())?.is_new());
    assert_eq!(outbox.claim_due(t0(), 10, "w")?.len(), 1);
    let keys = store.idempotency_keys();
    assert!(matches!(
        keys.begin("", "req-1", "fp", t0())?,
        idemstore::Begin::Proceed(_)
    ));
    assert_eq!(inbox.len()?, 1);
    drop((inbox, outbox, keys));
    drop(store);
    Ok(())
}

/// A write closure and an effect, made on this thread: they claim
/// `w-1{tag}` and `w-2{tag}`.
fn closure_calls(store: &PgStore, tag: &str) -> Result<(), Error> {
    let inbox = store.inbox("webhooks")?;
    let outbox = store.outbox();
    let (first, second) = (format!("w-1{tag}"), format!("w-2{tag}"));
    store.write(|tx| {
        inbox.claim_in(tx, &first, t0())?;
        outbox.enqueue_in(
            tx,
            NewEntry::new("c", "mailer", &first, b"x".to_vec()),
            t0(),
        )
    })?;
    let out = inbox.claim_with(&second, t0(), |tx| {
        tx.execute("SELECT 1", &[])?;
        Ok::<_, Error>(2)
    })?;
    assert!(matches!(out, Claim::Applied(2)));
    Ok(())
}

#[tokio::main]
async fn multi_thread_main(url: &str) -> TestResult {
    // Straight from `async fn main`, as a server opens its store.
    own_calls(url)?;
    let (store, _drop) = connect(url)?;
    closure_calls(&store, "")?;
    // On a worker, from a task.
    let on_worker = store.clone();
    tokio::spawn(async move { closure_calls(&on_worker, "-task") }).await??;
    assert!(store.inbox("webhooks")?.seen("w-2-task")?);
    Ok(())
}

#[test]
fn on_a_multi_thread_runtime_every_call_works() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    multi_thread_main(&url)
}

#[tokio::test(flavor = "current_thread")]
async fn on_a_current_thread_runtime_the_stores_own_calls_work() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    own_calls(&url)?;
    // From a task of the runtime too.
    tokio::spawn(async move { own_calls(&url) }).await??;
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn on_a_current_thread_runtime_a_closure_runs_on_its_thread_too() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let (store, _drop) = connect(&url)?;
    let inbox = store.inbox("webhooks")?;
    // On the runtime's own thread: the closure runs there, with its
    // statements.
    let runtime_thread = std::thread::current().id();
    let mut ran_on = None;
    store.write(|tx| {
        ran_on = Some(std::thread::current().id());
        tx.execute("SELECT 1", &[])?;
        Ok::<_, Error>(())
    })?;
    assert_eq!(ran_on, Some(runtime_thread));
    closure_calls(&store, "")?;
    assert!(inbox.seen("w-1")? && inbox.seen("w-2")?);
    // On its blocking pool as well.
    let pooled = store.clone();
    tokio::task::spawn_blocking(move || closure_calls(&pooled, "-pool")).await??;
    assert!(inbox.seen("w-1-pool")? && inbox.seen("w-2-pool")?);
    drop(inbox);
    drop(store);
    Ok(())
}

#[test]
fn an_effect_binds_the_clients_own_time_type() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let (store, _drop) = connect(&url)?;
    let at = Utc.with_ymd_and_hms(2025, 6, 1, 12, 30, 15).unwrap();
    let s = store.schema().to_owned();
    let back: DateTime<Utc> = store.write(|tx| {
        tx.batch_execute(&format!(
            "CREATE TABLE {s}.app_events (id bigint PRIMARY KEY, at timestamptz NOT NULL)"
        ))?;
        tx.execute(
            &format!("INSERT INTO {s}.app_events VALUES ($1, $2)"),
            &[&1_i64, &at],
        )?;
        let row = tx.query_one(
            &format!("SELECT at FROM {s}.app_events WHERE at = $1"),
            &[&at],
        )?;
        Ok::<_, Error>(row.get(0))
    })?;
    assert_eq!(back, at);
    Ok(())
}
