//! Calls on pooled connections the server has dropped (a restart, an
//! administrator's `pg_terminate_backend`, an idle timeout) run again on a
//! fresh connection instead of failing, as long as running again is safe.
//! The restart test restarts the test server (`pg_ctl restart -m
//! immediate`) when this process can; it says so and passes when it
//! cannot.
//!
//! Needs `IDEMSTORE_TEST_POSTGRES` (see `tests/contract_pg.rs`); without it
//! the test says so and passes, except under `CI=true`.

use std::error::Error as StdError;
use std::sync::Mutex;
use std::thread;

use idemstore::chrono::{DateTime, Duration, TimeZone, Utc};
use idemstore::postgres::PgStore;
use idemstore::postgres::postgres::{Client, NoTls};
use idemstore::{Begin, Claim, NewEntry, ResponseRecord, Settlement};

mod common;

use common::pg::{Server, url};

type TestResult = Result<(), Box<dyn StdError>>;

/// The tests here end or restart the server's connections: one at a time.
static SERVER: Mutex<()> = Mutex::new(());

fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2025, 1, 1, 0, 0, 0).unwrap()
}

/// Ends every server connection of `app` but the caller's, and waits until
/// their processes are gone (a request sent to one still exiting would be
/// lost unread, which a one-statement write must not retry); how many.
fn terminate(admin: &mut Client, app: &str) -> Result<i64, Box<dyn StdError>> {
    let n: i64 = admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity \
             WHERE application_name = $1 AND pid <> pg_backend_pid()",
            &[&app],
        )?
        .get(0);
    Ok(n)
}

#[test]
fn every_kind_of_call_survives_connections_the_server_dropped() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let _one = SERVER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let tag = format!(
        "{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .subsec_nanos()
    );
    let app = format!("idemstore_retry_{tag}");
    let schema = format!("retry_{tag}");
    let store = PgStore::builder()
        .schema(&schema)
        .pool_size(4)
        .connect(&format!("{url} application_name={app}"))?;
    let mut admin = Client::connect(&url, NoTls)?;
    let inbox = store.inbox("payments")?;
    let outbox = store.outbox();
    let keys = store.idempotency_keys();

    // Four pooled connections in use at once, so four are open.
    thread::scope(|s| {
        for t in 0..4 {
            let inbox = inbox.clone();
            s.spawn(move || {
                for i in 0..20 {
                    inbox.claim(&format!("warm-{t}-{i}"), t0()).unwrap();
                }
            });
        }
    });
    assert!(terminate(&mut admin, &app)? >= 1);

    // A one-statement write: the server said it did not happen.
    assert!(inbox.claim("evt-1", t0())?);
    assert!(!inbox.claim("evt-1", t0())?);
    terminate(&mut admin, &app)?;
    // Reads.
    assert!(inbox.seen("evt-1")?);
    assert_eq!(inbox.len()?, 81);
    terminate(&mut admin, &app)?;
    // A claim with an effect: the effect runs once.
    let mut runs = 0;
    let out = inbox.claim_with("evt-2", t0(), |tx| {
        runs += 1;
        outbox.enqueue_in(tx, NewEntry::new("c", "mailer", "k1", b"hi".to_vec()), t0())?;
        Ok::<_, idemstore::Error>(7)
    })?;
    assert!(matches!(out, Claim::Applied(7)));
    assert_eq!(runs, 1);
    terminate(&mut admin, &app)?;
    // The outbox: enqueue, claim, settle.
    assert!(
        outbox
            .enqueue(NewEntry::new("c", "mailer", "k2", b"yo".to_vec()), t0())?
            .is_new()
    );
    terminate(&mut admin, &app)?;
    let claimed = outbox.claim_due(t0() + Duration::seconds(1), 10, "w1")?;
    assert_eq!(claimed.len(), 2);
    terminate(&mut admin, &app)?;
    for e in &claimed {
        outbox.settle(
            e.fence(),
            Settlement::Completed,
            t0() + Duration::seconds(2),
        )?;
    }
    assert_eq!(outbox.counts()?.completed, 2);
    terminate(&mut admin, &app)?;
    // Idempotency keys: reserve, complete, replay.
    let Begin::Proceed(r) = keys.begin("", "req-1", "fp", t0())? else {
        panic!("a new key proceeds")
    };
    terminate(&mut admin, &app)?;
    let response = ResponseRecord {
        tenant: String::new(),
        idempotency_key: "req-1".into(),
        request_fingerprint: "fp".into(),
        response_status: 201,
        content_type: None,
        headers: Vec::new(),
        response_body: b"made".to_vec(),
        created_at: t0(),
    };
    assert!(keys.complete(&r, response, t0())?);
    terminate(&mut admin, &app)?;
    assert!(matches!(
        keys.begin("", "req-1", "fp", t0())?,
        Begin::Replay(_)
    ));
    // A write closure of the caller's: it runs once.
    terminate(&mut admin, &app)?;
    let mut runs = 0;
    store.write(|tx| {
        runs += 1;
        inbox.claim_in(tx, "evt-3", t0())
    })?;
    assert_eq!(runs, 1);
    assert!(inbox.seen("evt-3")?);

    drop((inbox, outbox, keys, store));
    admin.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))?;
    Ok(())
}

#[test]
fn a_claim_on_a_pooled_connection_after_an_immediate_restart_is_retried() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let Some(server) = Server::from_env() else {
        return Ok(());
    };
    let _one = SERVER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let schema = format!("restart_{}", std::process::id());
    let store = PgStore::builder()
        .schema(&schema)
        .pool_size(4)
        .connect(&url)?;
    let inbox = store.inbox("payments")?;
    // Four pooled connections, open and idle.
    thread::scope(|s| {
        for t in 0..4 {
            let inbox = inbox.clone();
            s.spawn(move || {
                for i in 0..20 {
                    inbox.claim(&format!("warm-{t}-{i}"), t0()).unwrap();
                }
            });
        }
    });
    // `pg_ctl restart -m immediate`: no checkpoint, the WAL replayed.
    server.crash();
    server.start();
    // Every pooled connection is dead; the first write on one cannot be
    // sent (broken pipe): it runs again on a live connection.
    for i in 0..4 {
        assert!(inbox.claim(&format!("after-{i}"), t0())?);
    }
    assert!(!inbox.claim("after-0", t0())?);
    assert_eq!(inbox.len()?, 84);
    drop((inbox, store));
    Client::connect(&url, NoTls)?.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))?;
    Ok(())
}
