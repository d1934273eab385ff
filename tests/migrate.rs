//! `idemstore migrate FILE --to-postgres URL`: every row of a store file,
//! of every kind, copied into PostgreSQL as it was, once however often the
//! command runs.
//!
//! Needs `IDEMSTORE_TEST_POSTGRES` for the copies (see
//! `tests/contract_pg.rs`); without it those tests say so and pass, except
//! under `CI=true`.

use std::path::Path;
use std::process::{Command, Output};

use idemstore::chrono::{DateTime, Duration, TimeZone, Utc};
use idemstore::postgres::PgStore;
use idemstore::{
    Begin, DestinationPolicy, Enqueued, NewEntry, OutboxFilter, OutboxId, OutboxStatus,
    ResponseRecord, Settlement, Store,
};
use postgres::{Client, NoTls};
use serde_json::Value;

mod common;

use common::pg::{unique_schema, url};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn t(s: i64) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2025, 3, 1, 0, 0, 0).unwrap() + Duration::seconds(s)
}

fn run(args: &[&str]) -> std::io::Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_idemstore"))
        .args(args)
        .output()
}

/// Runs `migrate FILE --to-postgres URL` with `extra` arguments.
fn migrate_to(
    file: &Path,
    url: &str,
    extra: &[&str],
) -> Result<Output, Box<dyn std::error::Error>> {
    let file = file.to_str().ok_or("path")?;
    let mut args = vec!["migrate", file, "--to-postgres", url];
    args.extend_from_slice(extra);
    Ok(run(&args)?)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs `migrate --json` in batches of 7.
fn migrate_output(
    file: &Path,
    url: &str,
    schema: &str,
) -> Result<Output, Box<dyn std::error::Error>> {
    migrate_in_batches(file, url, schema, 7)
}

/// Runs `migrate --json` in batches of `batch`.
fn migrate_in_batches(
    file: &Path,
    url: &str,
    schema: &str,
    batch: u32,
) -> Result<Output, Box<dyn std::error::Error>> {
    let file = file.to_str().ok_or("path")?;
    Ok(run(&[
        "--json",
        "migrate",
        file,
        "--to-postgres",
        url,
        "--schema",
        schema,
        "--batch",
        &batch.to_string(),
    ])?)
}

/// Runs `migrate --json`, expects exit 0 and parses its report.
fn migrate(file: &Path, url: &str, schema: &str) -> Result<Value, Box<dyn std::error::Error>> {
    let o = migrate_output(file, url, schema)?;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    Ok(serde_json::from_slice(&o.stdout)?)
}

fn response(tenant: &str, key: &str, fp: &str, at: DateTime<Utc>) -> ResponseRecord {
    ResponseRecord::new(tenant, key, fp, 201, b"{\"ok\":true}".to_vec(), at)
        .content_type("application/json")
        .header("x-request-id", "r1")
        .header("etag", "\"1\"")
}

/// A store file with rows of every kind: two inboxes, outbox entries in
/// every status with attempt histories, responses and a live reservation.
/// Returns the id of the entry left `Dispatching`.
fn fill(store: &Store) -> Result<OutboxId, Box<dyn std::error::Error>> {
    let payments = store.inbox("payments")?;
    for i in 0..30 {
        assert!(payments.claim(&format!("evt-{i:02}"), t(i))?);
    }
    store.inbox("webhooks")?.claim("hook\u{0}with nul", t(5))?;

    let outbox = store.outbox();
    let mut ids = Vec::new();
    for i in 0..8 {
        let e = NewEntry::new(
            format!("cmd-{}", i % 3),
            "mailer",
            format!("k{i}"),
            vec![u8::try_from(i)?; 3],
        );
        let Enqueued::New(id) = outbox.enqueue(e, t(100 + i))? else {
            panic!("new")
        };
        ids.push(id);
    }
    // The seven earliest are claimed; ids[7] stays pending, never tried.
    let claimed = outbox.claim_due(t(200), 7, "w1")?;
    assert_eq!(claimed.len(), 7);
    let fence = |id: OutboxId| claimed.iter().find(|e| e.id == id).unwrap().fence();
    outbox.settle(fence(ids[1]), Settlement::Completed, t(201))?;
    outbox.settle(
        fence(ids[2]),
        Settlement::Failed {
            reason: "http_500".into(),
            next_attempt_at: Some(t(300)),
        },
        t(202),
    )?;
    outbox.settle(
        fence(ids[3]),
        Settlement::Failed {
            reason: "bad_address".into(),
            next_attempt_at: None,
        },
        t(203),
    )?;
    outbox.settle(
        fence(ids[4]),
        Settlement::OutcomeUnknown {
            remote_ref: Some("remote-4".into()),
        },
        t(204),
    )?;
    outbox.settle(
        fence(ids[5]),
        Settlement::Rescheduled {
            next_attempt_at: t(400),
        },
        t(205),
    )?;
    outbox.settle(
        fence(ids[6]),
        Settlement::Failed {
            reason: "timeout".into(),
            next_attempt_at: Some(t(206)),
        },
        t(206),
    )?;
    outbox.cancel(ids[6], t(207))?;
    // ids[0] stays Dispatching, claimed by w1 at t(200).

    let keys = store.idempotency_keys();
    for (tenant, key) in [("", "order-1"), ("acme", "order-1"), ("acme", "order-2")] {
        let Begin::Proceed(r) = keys.begin(tenant, key, "fp", t(10))? else {
            panic!("proceed")
        };
        assert!(keys.complete(&r, response(tenant, key, "fp", t(11)), t(11))?);
    }
    let Begin::Proceed(_held) = keys.begin("acme", "in-flight", "fp2", t(12))? else {
        panic!("proceed")
    };
    Ok(ids[0])
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one story: copy, compare every row, work on, copy again"
)]
fn every_row_is_copied_as_it_was_and_once() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("app.redb");
    let store = Store::open(&file)?;
    let dispatching = fill(&store)?;
    drop(store);
    let schema = unique_schema();

    let first = migrate(&file, &url, &schema)?;
    assert_eq!(first["schema"], schema.as_str());
    assert_eq!(first["inboxes"]["names"], 2);
    for (kind, n) in [("inboxes", 31), ("outbox", 8), ("idempotency_keys", 4)] {
        let v = &first[kind];
        assert_eq!(v["source"], n, "{kind}: {first}");
        assert_eq!(v["target"], n, "{kind}: {first}");
        assert_eq!(v["copied"], n, "{kind}: {first}");
    }

    // Every row, through the PostgreSQL store's own calls.
    let store = Store::builder().shared(true).open(&file)?;
    let pg = PgStore::builder()
        .schema(&schema)
        .pool_size(2)
        .connect(&url)?;
    assert_eq!(pg.inbox_names()?, store.inbox_names()?);
    for name in store.inbox_names()? {
        assert_eq!(
            pg.inbox(&name)?.list(None, 1000)?,
            store.inbox(&name)?.list(None, 1000)?,
            "{name}"
        );
    }
    let all = store.outbox().list(&OutboxFilter::any(), 1000)?;
    assert_eq!(all.len(), 8);
    let statuses: std::collections::BTreeSet<_> = all
        .iter()
        .map(|r| format!("{:?}", r.entry.status))
        .collect();
    assert_eq!(
        statuses.len(),
        OutboxStatus::ALL.len(),
        "every status: {statuses:?}"
    );
    assert!(all.iter().any(|r| !r.attempts.is_empty()));
    for r in &all {
        assert_eq!(pg.outbox().get(r.entry.id)?, *r);
    }
    assert_eq!(pg.outbox().counts()?, store.outbox().counts()?);
    let (keys, pg_keys) = (store.idempotency_keys(), pg.idempotency_keys());
    assert_eq!(pg_keys.list(None, 100)?, keys.list(None, 100)?);
    for (tenant, key) in [("", "order-1"), ("acme", "order-1"), ("acme", "order-2")] {
        assert_eq!(pg_keys.response(tenant, key)?, keys.response(tenant, key)?);
        assert!(pg_keys.response(tenant, key)?.is_some());
    }

    // The copies work on: the claim's fence, the reservation, the
    // sequences past every copied id and fence.
    let held = pg.outbox().get(dispatching)?;
    let fence = held.entry.fence();
    pg.outbox().settle(fence, Settlement::Completed, t(500))?;
    assert!(matches!(
        pg_keys.begin("acme", "in-flight", "fp2", t(13))?,
        Begin::InFlight { .. }
    ));
    let max_id = all.iter().map(|r| r.entry.id.0).max().unwrap_or(0);
    let Enqueued::New(id) = pg
        .outbox()
        .enqueue(NewEntry::new("c", "mailer", "fresh", b"x".to_vec()), t(600))?
    else {
        panic!("new")
    };
    assert!(id.0 > max_id, "{id:?} after {max_id}");
    let max_fence = keys
        .list(None, 100)?
        .iter()
        .map(|k| k.fence)
        .max()
        .unwrap_or(0);
    let Begin::Proceed(r) = pg_keys.begin("", "fresh", "fp", t(600))? else {
        panic!("proceed")
    };
    assert!(r.fence() > max_fence, "{} after {max_fence}", r.fence());

    // Again: nothing copied twice, the file's counts the same; the server
    // holds the two rows made since.
    let second = migrate(&file, &url, &schema)?;
    for (kind, n, target) in [
        ("inboxes", 31, 31),
        ("outbox", 8, 9),
        ("idempotency_keys", 4, 5),
    ] {
        let v = &second[kind];
        assert_eq!(v["source"], n, "{kind}: {second}");
        assert_eq!(v["target"], target, "{kind}: {second}");
        assert_eq!(v["copied"], 0, "{kind}: {second}");
    }
    // The settlement made on the server stands.
    assert_eq!(
        pg.outbox().get(dispatching)?.entry.status,
        OutboxStatus::Completed
    );

    // Text for people.
    let o = migrate_to(&file, &url, &["--schema", &schema])?;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout)?;
    assert!(
        text.contains("inboxes: 31 keys in 2 inboxes → 31 rows (0 copied)"),
        "{text}"
    );
    assert!(
        text.contains("outbox: 8 records → 9 rows (0 copied)"),
        "{text}"
    );
    assert!(
        text.contains("idempotency keys: 4 records → 5 rows (0 copied)"),
        "{text}"
    );

    drop(pg);
    Client::connect(&url, NoTls)?.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))?;
    Ok(())
}

/// A store file with four outbox entries (ids 1–4) whose idempotency keys
/// start with `prefix`, one response at `("", "order-1")` whose
/// fingerprint is `fp`, and the inbox key `evt-1`.
fn small(
    dir: &Path,
    name: &str,
    prefix: &str,
    fp: &str,
) -> Result<std::path::PathBuf, Box<dyn std::error::Error>> {
    let file = dir.join(name);
    let store = Store::open(&file)?;
    store.inbox("payments")?.claim("evt-1", t(1))?;
    for i in 0..4 {
        let e = NewEntry::new(
            format!("cmd-{i}"),
            "mailer",
            format!("{prefix}{i}"),
            vec![1],
        );
        let Enqueued::New(id) = store.outbox().enqueue(e, t(100 + i))? else {
            panic!("new")
        };
        assert_eq!(id, OutboxId(u64::try_from(i)? + 1));
    }
    assert!(
        store
            .idempotency_keys()
            .put(&response("", "order-1", fp, t(10)))?
    );
    Ok(file)
}

#[test]
fn rows_that_clash_with_different_rows_are_reported_not_copied_and_exit_1() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let file_a = small(dir.path(), "a.idem", "k", "fp-a")?;
    let file_c = small(dir.path(), "c.idem", "otherk", "fp-c")?;
    let schema = unique_schema();
    let _drop = common::pg::DropSchema {
        url: url.clone(),
        schema: schema.clone(),
    };
    let first = migrate(&file_a, &url, &schema)?;
    assert_eq!(first["outbox"]["copied"], 4, "{first}");
    assert_eq!(first["outbox"]["conflicts"], 0, "{first}");

    // c's entries have a's ids, its response a's key with another
    // fingerprint: not copied, counted, named, exit 1. The inbox key is
    // claimed either way: no conflict.
    let o = migrate_output(&file_c, &url, &schema)?;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout)?;
    assert_eq!(v["outbox"]["copied"], 0, "{v}");
    assert_eq!(v["outbox"]["conflicts"], 4, "{v}");
    assert_eq!(v["idempotency_keys"]["copied"], 0, "{v}");
    assert_eq!(v["idempotency_keys"]["conflicts"], 1, "{v}");
    assert_eq!(v["inboxes"]["copied"], 0, "{v}");
    assert!(v["inboxes"].get("conflicts").is_none(), "{v}");
    let err = stderr(&o);
    assert!(err.contains("4 outbox records not copied"), "{err}");
    assert!(err.contains("id 1, id 2, id 3, id 4"), "{err}");
    assert!(err.contains("1 idempotency records not copied"), "{err}");
    assert!(err.contains(r#"""/"order-1""#), "{err}");

    // The server holds a's rows, untouched.
    let pg = PgStore::builder()
        .schema(&schema)
        .pool_size(1)
        .connect(&url)?;
    for i in 0..4u64 {
        let r = pg.outbox().get(OutboxId(i + 1))?;
        assert_eq!(r.entry.idempotency_key, format!("k{i}"));
    }
    assert_eq!(pg.outbox().counts()?.total(), 4);
    let kept = pg
        .idempotency_keys()
        .response("", "order-1")?
        .ok_or("kept")?;
    assert_eq!(kept.request_fingerprint, "fp-a");

    // In text, each kind says how many it did not copy.
    let o = migrate_to(&file_c, &url, &["--schema", &schema])?;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout)?;
    assert!(
        text.contains("outbox: 4 records → 4 rows (0 copied, 4 conflicting rows not copied)"),
        "{text}"
    );
    assert!(
        text.contains(
            "idempotency keys: 1 records → 1 rows (0 copied, 1 conflicting rows not copied)"
        ),
        "{text}"
    );

    // a again is a rerun: nothing copied, nothing in conflict.
    let again = migrate(&file_a, &url, &schema)?;
    assert_eq!(again["outbox"]["copied"], 0, "{again}");
    assert_eq!(again["outbox"]["conflicts"], 0, "{again}");
    assert_eq!(again["idempotency_keys"]["conflicts"], 0, "{again}");
    Ok(())
}

#[test]
fn the_server_never_hands_out_an_id_or_fence_the_file_did() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("purged.idem");
    {
        let store = Store::open(&file)?;
        let outbox = store.outbox();
        for i in 1..=5 {
            let e = NewEntry::new(format!("cmd-{i}"), "mailer", format!("k{i}"), vec![1]);
            outbox.enqueue(e, t(100 + i))?;
        }
        // Id 5, the largest, is completed and purged.
        let claimed = outbox.claim_due(t(200), 5, "w1")?;
        let last = claimed.iter().find(|e| e.id == OutboxId(5)).ok_or("id 5")?;
        outbox.settle(last.fence(), Settlement::Completed, t(201))?;
        assert_eq!(outbox.purge_finished(t(300))?, 1);
        let ids: Vec<OutboxId> = outbox
            .list(&OutboxFilter::any(), 10)?
            .iter()
            .map(|r| r.entry.id)
            .collect();
        assert_eq!(ids, [OutboxId(1), OutboxId(2), OutboxId(3), OutboxId(4)]);

        // Fences 1–3; fence 3's record, created earliest, is purged.
        let keys = store.idempotency_keys();
        for (key, at) in [("k1", 100), ("k2", 100), ("k3", 1)] {
            let Begin::Proceed(r) = keys.begin("", key, "fp", t(at))? else {
                panic!("proceed")
            };
            assert!(keys.complete(&r, response("", key, "fp", t(at)), t(at))?);
        }
        assert_eq!(keys.purge_expired(t(50))?, 1);
        assert_eq!(keys.list(None, 10)?.iter().map(|k| k.fence).max(), Some(2));
    }
    let schema = unique_schema();
    let _drop = common::pg::DropSchema {
        url: url.clone(),
        schema: schema.clone(),
    };
    let v = migrate(&file, &url, &schema)?;
    assert_eq!(v["outbox"]["copied"], 4, "{v}");
    assert_eq!(v["idempotency_keys"]["copied"], 2, "{v}");

    let pg = PgStore::builder()
        .schema(&schema)
        .pool_size(1)
        .connect(&url)?;
    let Enqueued::New(id) = pg
        .outbox()
        .enqueue(NewEntry::new("c", "mailer", "fresh", b"x".to_vec()), t(600))?
    else {
        panic!("new")
    };
    assert_eq!(id, OutboxId(6));
    let Begin::Proceed(r) = pg.idempotency_keys().begin("", "fresh", "fp", t(600))? else {
        panic!("proceed")
    };
    assert_eq!(r.fence(), 4);

    // Again: the sequences never move back.
    migrate(&file, &url, &schema)?;
    let Enqueued::New(id) = pg.outbox().enqueue(
        NewEntry::new("c", "mailer", "fresh-2", b"x".to_vec()),
        t(600),
    )?
    else {
        panic!("new")
    };
    assert_eq!(id, OutboxId(7));
    Ok(())
}

#[test]
fn destination_policies_pauses_and_sequences_survive_the_copy() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("destinations.idem");
    let capped = DestinationPolicy::default()
        .max_in_flight(1)
        .rate_limit(5.0, 2)
        .circuit_breaker(3, std::time::Duration::from_secs(30));
    {
        let store = Store::open(&file)?;
        let outbox = store.outbox();
        outbox.set_destination_policy("payments", capped)?;
        outbox.pause_destination("mailer")?;
        for i in 0..3 {
            let e = NewEntry::new("c", "payments", format!("p{i}"), vec![1]).ordering_key("acct");
            outbox.enqueue(e, t(i))?;
        }
        outbox.enqueue(
            NewEntry::new("c", "payments", "urgent", vec![1]).priority(7),
            t(5),
        )?;
        outbox.enqueue(NewEntry::new("c", "mailer", "m0", vec![1]), t(0))?;
    }
    let schema = unique_schema();
    let _drop = common::pg::DropSchema {
        url: url.clone(),
        schema: schema.clone(),
    };
    let v = migrate(&file, &url, &schema)?;
    assert_eq!(v["destinations"]["copied"], 2, "{v}");
    let pg = PgStore::builder()
        .schema(&schema)
        .pool_size(1)
        .connect(&url)?;
    let outbox = pg.outbox();
    let payments = outbox.destination("payments")?;
    assert_eq!(payments.policy, capped);
    assert!(!payments.paused);
    assert!(outbox.destination("mailer")?.paused);
    let urgent = outbox.find("payments", "urgent")?.ok_or("urgent")?;
    assert_eq!(urgent.entry.priority, 7);
    let p1 = outbox.find("payments", "p1")?.ok_or("p1")?;
    assert_eq!(p1.entry.ordering_key.as_deref(), Some("acct"));
    // The copy obeys them: the paused mailer gives nothing, the cap one,
    // priority first; then the sequence goes in order, one at a time.
    let got = outbox.claim_due(t(10), 10, "w")?;
    let keys: Vec<&str> = got.iter().map(|e| e.idempotency_key.as_str()).collect();
    assert_eq!(keys, ["urgent"]);
    let mut order = Vec::new();
    let mut last = got[0].clone();
    for step in 0..3 {
        outbox.settle(last.fence(), Settlement::Completed, t(20 + step * 1000))?;
        let got = outbox.claim_due(t(1000 + step * 1000), 10, "w")?;
        assert_eq!(got.len(), 1, "{got:?}");
        order.push(got[0].idempotency_key.clone());
        last = got[0].clone();
    }
    assert_eq!(order, ["p0", "p1", "p2"]);
    // Again: nothing copied twice, the server's own changes kept.
    outbox.resume_destination("mailer")?;
    let v = migrate(&file, &url, &schema)?;
    assert_eq!(v["destinations"]["copied"], 0, "{v}");
    assert_eq!(outbox.destination("payments")?.policy, capped);
    assert!(!outbox.destination("mailer")?.paused);
    Ok(())
}

#[test]
fn schedules_survive_the_copy_and_fire_on_from_where_they_were() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("schedules.idem");
    let every = idemstore::Schedule::every("reports", std::time::Duration::from_secs(300))?
        .missed(idemstore::Missed::All);
    {
        let store = Store::open(&file)?;
        let outbox = store.outbox();
        outbox.set_schedule_at("five", every.clone(), t(0))?;
        outbox.set_schedule("later", every)?;
        outbox.pause_schedule("later")?;
        // Two slots fired on the file: 5 and 10 minutes in.
        assert_eq!(
            outbox.fire_schedules(t(0) + chrono::TimeDelta::minutes(12))?,
            2
        );
    }
    let schema = unique_schema();
    let _drop = common::pg::DropSchema {
        url: url.clone(),
        schema: schema.clone(),
    };
    let v = migrate(&file, &url, &schema)?;
    assert_eq!(v["schedules"]["copied"], 2, "{v}");
    let pg = PgStore::builder()
        .schema(&schema)
        .pool_size(1)
        .connect(&url)?;
    let outbox = pg.outbox();
    let on_file = Store::open(&file)?.outbox().schedules()?;
    assert_eq!(outbox.schedules()?, on_file);
    // The server goes on from the slot after the last one dealt with: the
    // 15-minute slot, not the two the file fired already.
    assert_eq!(
        outbox.fire_schedules(t(0) + chrono::TimeDelta::minutes(16))?,
        1
    );
    let reports = outbox.list(&OutboxFilter::default().destination("reports"), 100)?;
    assert_eq!(reports.len(), 3);
    // Again: nothing copied twice.
    let v = migrate(&file, &url, &schema)?;
    assert_eq!(v["schedules"]["copied"], 0, "{v}");
    Ok(())
}

#[test]
fn a_row_the_server_refuses_is_named() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let file = small(dir.path(), "a.idem", "k", "fp-a")?;
    for (check, named) in [
        (
            "outbox ADD CHECK (idempotency_key <> 'k2'::bytea)",
            "outbox entry 3: ",
        ),
        (
            "idempotency ADD CHECK (idem_key <> 'order-1'::bytea)",
            r#"idempotency key ""/"order-1": "#,
        ),
    ] {
        let schema = unique_schema();
        let _drop = common::pg::DropSchema {
            url: url.clone(),
            schema: schema.clone(),
        };
        drop(
            PgStore::builder()
                .schema(&schema)
                .pool_size(1)
                .connect(&url)?,
        );
        Client::connect(&url, NoTls)?.batch_execute(&format!("ALTER TABLE {schema}.{check}"))?;
        let o = migrate_output(&file, &url, &schema)?;
        assert_eq!(o.status.code(), Some(1));
        let err = stderr(&o);
        assert!(err.contains(named), "{err}");
        assert!(err.contains("violates check constraint"), "{err}");
    }
    Ok(())
}

#[test]
fn a_reader_that_goes_away_stops_the_report_not_the_copy() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let file = small(dir.path(), "a.idem", "k", "fp-a")?;
    let schema = unique_schema();
    let _drop = common::pg::DropSchema {
        url: url.clone(),
        schema: schema.clone(),
    };
    let (reader, writer) = std::io::pipe()?;
    drop(reader);
    let o = Command::new(env!("CARGO_BIN_EXE_idemstore"))
        .args([
            "migrate",
            file.to_str().ok_or("path")?,
            "--to-postgres",
            &url,
            "--schema",
            &schema,
        ])
        .stdout(writer)
        .output()?;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
    let pg = PgStore::builder()
        .schema(&schema)
        .pool_size(1)
        .connect(&url)?;
    assert_eq!(pg.outbox().counts()?.total(), 4);
    Ok(())
}

#[test]
fn every_kind_is_copied_page_by_page() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("app.redb");
    fill(&Store::open(&file)?)?;
    let store = Store::builder().shared(true).open(&file)?;
    for batch in [1, 3] {
        let schema = unique_schema();
        let _drop = common::pg::DropSchema {
            url: url.clone(),
            schema: schema.clone(),
        };
        let o = migrate_in_batches(&file, &url, &schema, batch)?;
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let v: Value = serde_json::from_slice(&o.stdout)?;
        for (kind, n) in [("inboxes", 31), ("outbox", 8), ("idempotency_keys", 4)] {
            assert_eq!(v[kind]["copied"], n, "batch {batch}, {kind}: {v}");
        }
        let pg = PgStore::builder()
            .schema(&schema)
            .pool_size(1)
            .connect(&url)?;
        let (keys, pg_keys) = (store.idempotency_keys(), pg.idempotency_keys());
        assert_eq!(pg_keys.list(None, 100)?, keys.list(None, 100)?);
        for k in keys.list(None, 100)? {
            assert_eq!(
                pg_keys.response(&k.tenant, &k.key)?,
                keys.response(&k.tenant, &k.key)?
            );
        }
    }
    Ok(())
}

#[test]
fn an_unreachable_server_or_a_missing_file_fails_clearly() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("app.redb");
    drop(Store::open(&file)?);
    let nowhere = format!(
        "host={} user=app dbname=app connect_timeout=2",
        dir.path().join("no-server").display()
    );
    let o = migrate_to(&file, &nowhere, &[])?;
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("cannot use the PostgreSQL server"), "{err}");
    assert!(err.contains("error connecting to server"), "{err}");
    assert!(!err.contains("rolled back"), "{err}");
    assert!(o.stdout.is_empty());

    // A bad schema name is bad input, said as such, before any server.
    let o = migrate_to(&file, &nowhere, &["--schema", "Bad-Name"])?;
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("invalid schema"), "{err}");
    assert!(!err.contains("PostgreSQL server"), "{err}");

    // The password is not printed, in either form.
    let no_server = dir.path().join("no-server");
    for with_password in [
        format!("{nowhere} password=s3cret"),
        format!(
            "postgresql://app:s3cret@/app?host={}&connect_timeout=2",
            no_server.display()
        ),
    ] {
        let o = migrate_to(&file, &with_password, &[])?;
        assert_eq!(o.status.code(), Some(1));
        let err = stderr(&o);
        assert!(err.contains("cannot use the PostgreSQL server"), "{err}");
        assert!(!err.contains("s3cret"), "{err}");
        assert!(err.contains("***"), "{err}");
    }

    let o = migrate_to(&file, "port=notaport", &[])?;
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("invalid connection string"), "{err}");
    assert!(!err.contains("PostgreSQL server"), "{err}");

    // A program holds the file alone: migrate says to stop it (not to
    // share the file).
    {
        let _held = Store::open(&file)?;
        let o = migrate_to(&file, &nowhere, &[])?;
        assert_eq!(o.status.code(), Some(1));
        let err = stderr(&o);
        assert!(err.contains("stop the program"), "{err}");
        assert!(!err.contains("shared(true)"), "{err}");
    }

    let missing = dir.path().join("missing.redb");
    let o = migrate_to(&missing, &nowhere, &[])?;
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("no such file"), "{}", stderr(&o));
    assert!(!missing.exists());

    // Bad usage: no server named.
    let o = run(&["migrate", file.to_str().ok_or("path")?])?;
    assert_eq!(o.status.code(), Some(2));
    Ok(())
}

#[test]
fn the_library_call_copies_reports_progress_and_runs_again() -> TestResult {
    use idemstore::migrate::{self, MigrateOptions};

    let Some(url) = url() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("app.redb");
    let store = Store::open(&file)?;
    fill(&store)?;
    let schema = unique_schema();
    let _drop = common::pg::DropSchema {
        url: url.clone(),
        schema: schema.clone(),
    };
    let pg = PgStore::builder()
        .schema(&schema)
        .pool_size(2)
        .connect(&url)?;
    let options = MigrateOptions::new().batch_size(5);
    let mut seen = Vec::new();
    let report = migrate::to_postgres(&store, &pg, &options, |p| seen.push((p.done, p.total)))?;
    assert_eq!(report.inboxes.inboxes, 2);
    assert_eq!((report.inboxes.source, report.inboxes.copied), (31, 31));
    assert_eq!((report.outbox.source, report.outbox.copied), (8, 8));
    assert_eq!(
        (
            report.idempotency_keys.source,
            report.idempotency_keys.target,
            report.idempotency_keys.copied
        ),
        (4, 4, 4)
    );
    assert!(!report.has_conflicts());
    assert_eq!(seen.last(), Some(&(43, 43)));
    assert!(seen.windows(2).all(|w| w[0].0 < w[1].0));

    let again = migrate::to_postgres(&store, &pg, &options, |_| {})?;
    assert_eq!(again.inboxes.copied + again.outbox.copied, 0);
    assert_eq!(again.idempotency_keys.copied, 0);
    assert_eq!(again.outbox.target, 8);
    assert!(!again.has_conflicts());
    Ok(())
}
