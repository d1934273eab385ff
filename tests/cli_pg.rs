//! The outbox and destination commands of `idemstore` on a PostgreSQL
//! store: the same output, JSON and exit codes as on a store file, the
//! password never shown, and no store made where there was none.
//!
//! Needs `IDEMSTORE_TEST_POSTGRES` (see `tests/common/pg.rs`); without it
//! the tests say so and pass, except under `CI=true`.

use std::process::{Command, Output};

use idemstore::chrono::{DateTime, Duration, TimeZone, Utc};
use idemstore::postgres::PgStore;
use idemstore::{NewEntry, OutboxId, OutboxStatus, Settlement, Store};
use serde_json::Value;

mod common;

use common::pg::{DropSchema, client, unique_schema, url};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn t(s: i64) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2025, 3, 1, 0, 0, 0).unwrap() + Duration::seconds(s)
}

fn run(args: &[&str]) -> std::io::Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_idemstore"))
        .args(args)
        .output()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

/// The same entries in both stores, made by the same calls: `a` has two
/// failed entries and one pending, `b` one failed and one in doubt.
macro_rules! populate {
    ($outbox:expr) => {{
        let o = $outbox;
        for (d, k) in [
            ("a", "a1"),
            ("a", "a2"),
            ("b", "b1"),
            ("b", "b2"),
            ("a", "a3"),
        ] {
            o.enqueue(NewEntry::new("cmd", d, k, k.as_bytes().to_vec()), t(0))?;
        }
        let claimed = o.claim_due(t(1), 4, "w")?;
        assert_eq!(claimed.len(), 4);
        for e in &claimed {
            let s = if e.idempotency_key == "b2" {
                Settlement::OutcomeUnknown { remote_ref: None }
            } else {
                Settlement::Failed {
                    reason: "http_500".into(),
                    next_attempt_at: None,
                }
            };
            o.settle(e.fence(), s, t(2))?;
        }
    }};
}

/// A store in a fresh schema of the test server (dropped with the
/// guard), with the server's connection string and the schema; `None`
/// when the tests skip.
fn server_store() -> Result<Option<(String, String, DropSchema, PgStore)>, idemstore::Error> {
    let Some(url) = url() else { return Ok(None) };
    let schema = unique_schema();
    let guard = DropSchema {
        url: url.clone(),
        schema: schema.clone(),
    };
    let pg = PgStore::builder().schema(&schema).connect(&url)?;
    Ok(Some((url, schema, guard, pg)))
}

#[test]
fn outbox_and_destination_commands_answer_alike_on_a_file_and_on_postgresql() -> TestResult {
    let Some((url, schema, _drop, pg)) = server_store()? else {
        return Ok(());
    };
    populate!(pg.outbox());
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("s.idem");
    {
        let store = Store::open(&file)?;
        populate!(store.outbox());
    }
    let file = file.to_str().ok_or("a UTF-8 path")?.to_owned();
    let on = |store: &str, args: &[&str]| -> std::io::Result<Output> {
        let mut all: Vec<&str> = args.to_vec();
        all.push(store);
        if store == url.as_str() {
            all.extend(["--schema", schema.as_str()]);
        }
        run(&all)
    };
    for store in [file.as_str(), url.as_str()] {
        let list = on(store, &["--json", "outbox", "list", "--status", "failed"])?;
        assert!(list.status.success(), "{}", stderr(&list));
        let keys: Vec<String> = json(&list)
            .as_array()
            .ok_or("an array")?
            .iter()
            .map(|r| r["idempotency_key"].as_str().unwrap_or_default().to_owned())
            .collect();
        assert_eq!(keys, ["a1", "a2", "b1"], "on {store}");
        // The text listing is the same table on both.
        let text = on(store, &["outbox", "list", "--destination", "b"])?;
        assert!(
            stdout(&text).contains("outcome_unknown"),
            "{}",
            stdout(&text)
        );
        assert!(stdout(&text).ends_with("2 entries\n"), "{}", stdout(&text));
    }
    // Retry the failed entries of `a` on the server: pending again, `b`'s
    // untouched; an unknown id is reported and the exit code is 1.
    let out = run(&["outbox", "retry", &url, "--schema", &schema, "1", "2", "99"])?;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("requeued 2 of 3 entries"),
        "{}",
        stdout(&out)
    );
    assert!(stderr(&out).contains("entry 99"), "{}", stderr(&out));
    let o = pg.outbox();
    assert_eq!(o.get(OutboxId(1))?.entry.status, OutboxStatus::Pending);
    assert_eq!(o.get(OutboxId(2))?.entry.status, OutboxStatus::Pending);
    assert_eq!(o.get(OutboxId(3))?.entry.status, OutboxStatus::Failed);
    // Resolve the entry in doubt, cancel a pending one.
    let out = run(&[
        "--json",
        "outbox",
        "resolve",
        &url,
        "--schema",
        &schema,
        "4",
        "--completed",
    ])?;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(json(&out)["now"], "completed");
    let out = run(&["outbox", "cancel", &url, "--schema", &schema, "5"])?;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(o.get(OutboxId(5))?.entry.status, OutboxStatus::Failed);
    let out = run(&["outbox", "show", &url, "--schema", &schema, "3"])?;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("http_500"), "{}", stdout(&out));
    // Destinations: pause and a policy, seen by the store, listed by the CLI.
    let out = run(&["destination", "pause", &url, "--schema", &schema, "a"])?;
    assert!(out.status.success(), "{}", stderr(&out));
    let out = run(&[
        "destination",
        "set",
        &url,
        "--schema",
        &schema,
        "b",
        "--max-in-flight",
        "3",
    ])?;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(o.destination("a")?.paused);
    assert_eq!(o.destination("b")?.policy.limits().max_in_flight, Some(3));
    let out = run(&["--json", "destinations", &url, "--schema", &schema])?;
    assert!(out.status.success(), "{}", stderr(&out));
    let names: Vec<String> = json(&out)
        .as_array()
        .ok_or("an array")?
        .iter()
        .filter_map(|d| d["destination"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(names, ["a", "b"]);
    assert!(
        o.claim_due(t(10), 10, "w")?.is_empty(),
        "a paused; b has nothing due"
    );
    Ok(())
}

#[test]
fn a_missing_schema_or_server_is_an_error_that_hides_the_password() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let schema = unique_schema();
    let out = run(&["outbox", "list", &url, "--schema", &schema])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("no idemstore store"),
        "{}",
        stderr(&out)
    );
    let found: bool = client(&url)
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)",
            &[&schema],
        )?
        .get(0);
    assert!(!found, "a command made no schema");
    // A server that is not there, with a password in the URL.
    let bad = "postgresql://app:s3cret@127.0.0.1:1/app?connect_timeout=2";
    let out = run(&["outbox", "list", bad])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("postgresql://app:***@127.0.0.1:1"),
        "{}",
        stderr(&out)
    );
    assert!(!stderr(&out).contains("s3cret"), "{}", stderr(&out));
    // compact and migrate work on files: said so, the password hidden.
    for args in [
        vec!["compact", bad],
        vec!["migrate", bad, "--to-postgres", &url],
    ] {
        let out = run(&args)?;
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(
            stderr(&out).contains("works on a store file"),
            "{}",
            stderr(&out)
        );
        assert!(!stderr(&out).contains("s3cret"), "{}", stderr(&out));
    }
    // --schema names a server's schema: with a file it is a mistake.
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("s.idem");
    drop(Store::open(&file)?);
    let file = file.to_str().ok_or("a UTF-8 path")?;
    let out = run(&["outbox", "list", file, "--schema", "x"])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--schema"), "{}", stderr(&out));
    let out = run(&["stats", file, "--schema", "x"])?;
    assert_eq!(out.status.code(), Some(1));
    Ok(())
}

#[test]
fn stats_inbox_keys_check_and_export_read_a_postgresql_store() -> TestResult {
    let Some((url, schema, _drop, pg)) = server_store()? else {
        return Ok(());
    };
    let hooks = pg.inbox("hooks")?;
    for (i, key) in ["e1", "e2", "e3"].iter().enumerate() {
        assert!(hooks.claim(key, t(i64::try_from(i)?))?);
    }
    for k in ["k1", "k2"] {
        let r = idemstore::ResponseRecord::new(
            "acme",
            k,
            idemstore::fingerprint("POST", "/orders", b"{}"),
            201,
            b"{\"id\":1}".to_vec(),
            t(5),
        )
        .content_type("application/json")
        .header("location", "/orders/1");
        assert!(pg.idempotency_keys().put(&r)?);
    }
    populate!(pg.outbox());
    let with = |args: &[&str]| -> std::io::Result<Output> {
        let mut all = args.to_vec();
        all.extend(["--schema", schema.as_str()]);
        run(&all)
    };
    let out = with(&["--json", "stats", &url])?;
    assert!(out.status.success(), "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(v["schema"], schema.as_str());
    assert!(v.get("file").is_none(), "{v}");
    assert_eq!(v["outbox"]["total"], 5);
    assert_eq!(v["outbox"]["counts"]["failed"], 3);
    assert_eq!(v["inboxes"][0]["name"], "hooks");
    assert_eq!(v["inboxes"][0]["keys"], 3);
    assert_eq!(v["keys"]["completed"], 2);
    let out = with(&["stats", &url])?;
    assert!(
        stdout(&out).contains(&format!("schema     {schema}")),
        "{}",
        stdout(&out)
    );

    let out = with(&["--json", "inbox", "list", &url, "hooks", "--limit", "2"])?;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(json(&out).as_array().map(Vec::len), Some(2));
    let out = with(&["--json", "keys", "list", &url, "--tenant", "acme"])?;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(json(&out).as_array().map(Vec::len), Some(2));

    let out = with(&["check", &url])?;
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(stdout(&out).starts_with("ok: "), "{}", stdout(&out));

    // Every record once, of each kind, as from a file.
    let out = with(&["export", &url, "--jsonl"])?;
    assert!(out.status.success(), "{}", stderr(&out));
    let mut kinds = std::collections::BTreeMap::new();
    for line in stdout(&out).lines() {
        let v: Value = serde_json::from_str(line)?;
        *kinds
            .entry(v["kind"].as_str().unwrap_or("?").to_owned())
            .or_insert(0) += 1;
    }
    assert_eq!(
        kinds.into_iter().collect::<Vec<_>>(),
        [("inbox".into(), 3), ("key".into(), 2), ("outbox".into(), 5)]
    );

    // Pruning and purging write to the server.
    let before = "2025-03-01T00:00:02Z";
    let out = with(&[
        "--json", "inbox", "prune", &url, "hooks", "--before", before,
    ])?;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(json(&out)["pruned"], 2);
    assert_eq!(pg.inbox("hooks")?.len()?, 1);
    let out = with(&[
        "--json",
        "keys",
        "purge",
        &url,
        "--before",
        "2025-03-01T00:00:06Z",
    ])?;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(json(&out)["purged"], 2);
    // compact is for files only.
    let out = with(&["compact", &url])?;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    Ok(())
}
