//! The `idemstore` operator binary against real store files, idle or held
//! by a running program (a child process).
#![cfg(feature = "cli")]

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use chrono::{DateTime, TimeDelta, Utc};
use idemstore::redb::{self, ReadableTable as _, TableDefinition};
use idemstore::{Begin, NewEntry, OutboxId, OutboxStatus, ResponseRecord, Settlement, Store};
use parking_lot::Mutex;
use serde_json::Value;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const OUTBOX_CLAIMED: TableDefinition<(i64, u64), ()> =
    TableDefinition::new("idemstore.v1.outbox.claimed");
const INBOX_SEEN: TableDefinition<(&str, i64, &str), ()> =
    TableDefinition::new("idemstore.v1.inbox.seen_at");

fn ago(secs: i64) -> DateTime<Utc> {
    Utc::now() - TimeDelta::seconds(secs)
}

const H: i64 = 3_600;
const D: i64 = 86_400;

/// Runs the binary with `args`.
fn run(args: &[&str]) -> Result<Output, std::io::Error> {
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

/// Runs the binary and expects exit 0.
fn ok(args: &[&str]) -> Result<String, Box<dyn std::error::Error>> {
    let o = run(args)?;
    assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
    Ok(stdout(&o))
}

/// Runs the binary with `--json` and parses its output.
fn json(args: &[&str]) -> Result<Value, Box<dyn std::error::Error>> {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    Ok(serde_json::from_str(&ok(&all)?)?)
}

/// A store with two inboxes, six outbox entries (ids 1–6: pending,
/// completed, failed, outcome unknown, dispatching, outcome unknown) and
/// three idempotency rows (two responses, one reservation).
fn fixture(dir: &Path) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let path = dir.join("store.idem");
    let store = Store::open(&path)?;
    let webhooks = store.inbox("webhooks")?;
    webhooks.claim("evt_old", ago(3 * D))?;
    webhooks.claim("evt_mid", ago(2 * D))?;
    webhooks.claim("evt_new", ago(H))?;
    store.inbox("payments")?.claim("pay_1", ago(5 * H))?;

    let outbox = store.outbox();
    let future = NewEntry::new("cmd-1", "mail", "k1", b"hello".to_vec()).not_before(ago(-D));
    outbox.enqueue(future, ago(30 * D))?;
    for (i, created) in [(2, 20), (3, 19), (4, 18), (5, 17), (6, 16)] {
        let payload = vec![0xff, 0x00, u8::try_from(i)?];
        let e = NewEntry::new(format!("cmd-{i}"), "bank", format!("k{i}"), payload);
        outbox.enqueue(e, ago(created * D))?;
    }
    let claim = |at| outbox.claim_due(at, 1, "worker-a");
    assert_eq!(claim(ago(11 * D))?[0].id, OutboxId(2));
    outbox.mark_completed(OutboxId(2), ago(10 * D))?;
    assert_eq!(claim(ago(3 * H))?[0].id, OutboxId(3));
    outbox.mark_failed(OutboxId(3), "bank_down", None, ago(H))?;
    assert_eq!(claim(ago(3 * H))?[0].id, OutboxId(4));
    outbox.mark_outcome_unknown(OutboxId(4), Some("ref-4"))?;
    assert_eq!(claim(ago(2 * H))?[0].id, OutboxId(5));
    assert_eq!(claim(ago(H))?[0].id, OutboxId(6));
    outbox.mark_outcome_unknown(OutboxId(6), None)?;

    let keys = store.idempotency_keys();
    let old = ResponseRecord::new(
        "acme",
        "order-1",
        idemstore::fingerprint("POST", "/orders", b"{}"),
        201,
        vec![b'{', 0xfe, b'}'],
        ago(3 * D),
    )
    .content_type("application/json")
    .header("location", "/orders/1");
    assert!(keys.put(&old)?);
    let mut new = old.clone();
    new.tenant = String::new();
    new.idempotency_key = "order-2".into();
    new.response_body = b"ok".to_vec();
    new.created_at = ago(H);
    assert!(keys.put(&new)?);
    let fp = idemstore::fingerprint("POST", "/orders", b"[]");
    assert!(matches!(
        keys.begin("acme", "order-3", &fp, Utc::now())?,
        Begin::Proceed(_)
    ));
    Ok(path)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap_or_default()
}

#[test]
fn stats_counts_what_the_store_holds() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let text = ok(&["stats", s(&file)])?;
    assert!(text.contains("webhooks: 3 keys"), "{text}");
    assert!(text.contains("payments: 1 keys"), "{text}");
    assert!(
        text.contains(
            "6 entries: 1 pending, 1 dispatching, 1 completed, 1 failed, 2 outcome_unknown"
        ),
        "{text}"
    );
    assert!(text.contains("2 completed, 1 in flight"), "{text}");
    assert!(text.contains("fragmented"), "{text}");

    let v = json(&["stats", s(&file)])?;
    assert_eq!(v["format_version"], 3);
    assert!(v["file_bytes"].as_u64().unwrap_or(0) > 0);
    assert!(v["space"]["stored_bytes"].as_u64().unwrap_or(0) > 0);
    let inboxes = v["inboxes"].as_array().ok_or("inboxes")?;
    assert_eq!(inboxes.len(), 2);
    assert_eq!(inboxes[0]["name"], "payments");
    assert_eq!(inboxes[1]["name"], "webhooks");
    assert_eq!(inboxes[1]["keys"], 3);
    let oldest: DateTime<Utc> = inboxes[1]["oldest_seen_at"]
        .as_str()
        .ok_or("oldest")?
        .parse()?;
    assert!((oldest - ago(3 * D)).num_seconds().abs() < 60);
    let counts = &v["outbox"]["counts"];
    assert_eq!(v["outbox"]["total"], 6);
    assert_eq!(counts["pending"], 1);
    assert_eq!(counts["dispatching"], 1);
    assert_eq!(counts["completed"], 1);
    assert_eq!(counts["failed"], 1);
    assert_eq!(counts["outcome_unknown"], 2);
    assert!(v["outbox"]["oldest_claim"].is_string());
    assert!(v["outbox"]["oldest_due"].is_string());
    assert_eq!(v["keys"]["completed"], 2);
    assert_eq!(v["keys"]["in_flight"], 1);
    Ok(())
}

#[test]
fn inbox_list_shows_the_oldest_keys_first_up_to_the_limit() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let v = json(&["inbox", "list", s(&file), "webhooks", "--limit", "2"])?;
    let keys: Vec<&str> = v
        .as_array()
        .ok_or("list")?
        .iter()
        .filter_map(|r| r["key"].as_str())
        .collect();
    assert_eq!(keys, ["evt_old", "evt_mid"]);
    let text = ok(&["inbox", "list", s(&file), "webhooks"])?;
    assert!(
        text.contains("evt_new") && text.contains("3 of 3 keys"),
        "{text}"
    );
    Ok(())
}

#[test]
fn outbox_list_shows_only_the_entries_its_filters_match_up_to_the_limit() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let v = json(&["outbox", "list", s(&file), "--status", "outcome-unknown"])?;
    let ids: Vec<u64> = v
        .as_array()
        .ok_or("list")?
        .iter()
        .filter_map(|r| r["id"].as_u64())
        .collect();
    assert_eq!(ids, [4, 6]);
    let v = json(&["outbox", "list", s(&file), "--destination", "mail"])?;
    assert_eq!(v.as_array().map(Vec::len), Some(1));
    let v = json(&["outbox", "list", s(&file), "--limit", "3"])?;
    assert_eq!(v.as_array().map(Vec::len), Some(3));
    let text = ok(&["outbox", "list", s(&file)])?;
    assert!(
        text.contains("6 entries") && text.contains("outcome_unknown"),
        "{text}"
    );
    Ok(())
}

#[test]
fn outbox_show_prints_one_entry_whole_and_a_missing_one_exits_1() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let v = json(&["outbox", "show", s(&file), "4"])?;
    assert_eq!(v["status"], "outcome_unknown");
    assert_eq!(v["remote_ref"], "ref-4");
    // Only a dispatching entry holds a claim; the attempt in doubt is shown
    // on its own.
    assert_eq!(v["claim"], Value::Null);
    assert_eq!(v["attempt_in_doubt"]["worker_id"], "worker-a");
    let text = ok(&["outbox", "show", s(&file), "4"])?;
    assert!(text.contains("claim            -"), "{text}");
    assert!(
        text.contains("in doubt         attempt by worker-a"),
        "{text}"
    );
    assert_eq!(
        BASE64.decode(v["payload"].as_str().ok_or("payload")?)?,
        [0xff, 0, 4]
    );
    let text = ok(&["outbox", "show", s(&file), "1"])?;
    assert!(text.contains("\"hello\""), "{text}");
    let o = run(&["outbox", "show", s(&file), "99"])?;
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("no such record"), "{}", stderr(&o));
    Ok(())
}

#[test]
fn keys_list_shows_a_tenants_responses_and_reservations() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let v = json(&["keys", "list", s(&file), "--tenant", "acme"])?;
    let rows = v.as_array().ok_or("keys")?;
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["state"], "completed");
    assert_eq!(rows[1]["state"], "reserved");
    let text = ok(&["keys", "list", s(&file)])?;
    assert!(
        text.contains("3 keys") && text.contains("in flight"),
        "{text}"
    );
    Ok(())
}

#[test]
fn retry_moves_a_failed_entry_back_to_pending() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let before = Utc::now();
    let text = ok(&["outbox", "retry", s(&file), "3"])?;
    assert!(text.contains("3: failed -> pending"), "{text}");
    // A completed entry cannot be retried: the others still are, exit 1.
    let o = run(&["--json", "outbox", "retry", s(&file), "2", "4"])?;
    assert_eq!(o.status.code(), Some(1));
    let v: Value = serde_json::from_str(&stdout(&o))?;
    assert_eq!(v["requeued"][0]["id"], 4);
    assert_eq!(v["failed"][0]["id"], 2);
    assert!(stderr(&o).contains("entry 2"), "{}", stderr(&o));

    let store = Store::open(&file)?;
    let r = store.outbox().get(OutboxId(3))?;
    assert_eq!(r.entry.status, OutboxStatus::Pending);
    assert!(
        r.entry
            .next_attempt_at
            .is_some_and(|t| t >= before - TimeDelta::seconds(1))
    );
    assert_eq!(r.entry.completed_at, None);
    assert_eq!(r.last_failure.as_deref(), Some("bank_down"));
    assert_eq!(
        store.outbox().get(OutboxId(4))?.entry.status,
        OutboxStatus::Pending
    );
    assert_eq!(
        store.outbox().get(OutboxId(2))?.entry.status,
        OutboxStatus::Completed
    );
    assert!(store.outbox().check_indexes()?.is_empty());
    Ok(())
}

#[test]
fn cancel_fails_pending_and_outcome_unknown_entries_and_refuses_the_others() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let text = ok(&["outbox", "cancel", s(&file), "1", "4"])?;
    assert!(text.contains("1: pending -> failed (cancelled)"), "{text}");
    assert!(
        text.contains("4: outcome_unknown -> failed (cancelled)"),
        "{text}"
    );
    // Again: accepted, nothing to do.
    let text = ok(&["outbox", "cancel", s(&file), "1"])?;
    assert!(text.contains("1: already cancelled"), "{text}");
    // Completed, failed for another reason, dispatching, missing: refused,
    // the others still cancelled, exit 1.
    let o = run(&[
        "--json",
        "outbox",
        "cancel",
        s(&file),
        "2",
        "3",
        "5",
        "6",
        "99",
    ])?;
    assert_eq!(o.status.code(), Some(1));
    let v: Value = serde_json::from_str(&stdout(&o))?;
    let ids = |key: &str| -> Vec<u64> {
        v[key]
            .as_array()
            .map(|a| a.iter().filter_map(|r| r["id"].as_u64()).collect())
            .unwrap_or_default()
    };
    assert_eq!(ids("cancelled"), [6]);
    assert_eq!(ids("failed"), [2, 3, 5, 99]);
    let err = stderr(&o);
    assert!(err.contains("entry 5") && err.contains("settled"), "{err}");
    assert!(
        err.contains("entry 3") && err.contains("(bank_down)"),
        "{err}"
    );
    assert!(err.contains("entry 99"), "{err}");
    // An id is required.
    assert_eq!(run(&["outbox", "cancel", s(&file)])?.status.code(), Some(2));

    let store = Store::open(&file)?;
    let outbox = store.outbox();
    for id in [1, 4, 6] {
        let r = outbox.get(OutboxId(id))?;
        assert_eq!(r.entry.status, OutboxStatus::Failed, "{id}");
        assert_eq!(r.last_failure.as_deref(), Some("cancelled"), "{id}");
        assert!(r.entry.completed_at.is_some(), "{id}");
    }
    let status = |id| outbox.get(OutboxId(id)).map(|r| r.entry.status);
    assert_eq!(status(2)?, OutboxStatus::Completed);
    assert_eq!(status(3)?, OutboxStatus::Failed);
    assert_eq!(
        outbox.get(OutboxId(3))?.last_failure.as_deref(),
        Some("bank_down")
    );
    assert_eq!(status(5)?, OutboxStatus::Dispatching);
    assert!(outbox.check_indexes()?.is_empty());
    Ok(())
}

/// A store with one entry (id 1) whose three attempts failed, ended in
/// doubt, then ran out, as the dispatcher settles them.
fn store_with_history(dir: &Path) -> Result<PathBuf, Box<dyn std::error::Error>> {
    use idemstore::Settlement;
    let path = dir.join("history.idem");
    let store = Store::open(&path)?;
    let outbox = store.outbox();
    let id = outbox
        .enqueue(NewEntry::new("cmd", "bank", "k", b"p".to_vec()), ago(3 * H))?
        .id();
    let claim = |at| -> Result<idemstore::Fence, Box<dyn std::error::Error>> {
        Ok(outbox.claim_due(at, 1, "worker-a")?[0].fence())
    };
    let retry = Settlement::Failed {
        reason: "http_503".into(),
        next_attempt_at: Some(ago(2 * H)),
    };
    outbox.settle(claim(ago(3 * H))?, retry, ago(3 * H))?;
    let fence = claim(ago(2 * H))?;
    let unknown = Settlement::OutcomeUnknown {
        remote_ref: Some("ref-7".into()),
    };
    outbox.settle(fence, unknown, ago(2 * H))?;
    outbox.requeue(id, ago(H))?;
    let gave_up = Settlement::Failed {
        reason: "max_attempts (http_500)".into(),
        next_attempt_at: None,
    };
    outbox.settle(claim(ago(H))?, gave_up, ago(H))?;
    Ok(path)
}

#[test]
fn outbox_show_prints_the_attempt_history_and_list_the_last_reason() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = store_with_history(dir.path())?;
    let text = ok(&["outbox", "show", s(&file), "1"])?;
    assert!(text.contains("last failure     max_attempts\n"), "{text}");
    assert!(
        text.contains("history          3 attempt records"),
        "{text}"
    );
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("  attempt "))
        .collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines[0].contains("attempt    1") && lines[0].ends_with("http_503"));
    assert!(lines[1].contains("attempt    2"));
    assert!(lines[1].ends_with("outcome_unknown (remote ref ref-7)"));
    assert!(lines[2].contains("attempt    3"));
    assert!(lines[2].ends_with("max_attempts (http_500)"));

    let v = json(&["outbox", "show", s(&file), "1"])?;
    assert_eq!(v["last_failure"], "max_attempts");
    assert_eq!(v["last_reason"], "max_attempts (http_500)");
    let attempts = v["attempts"].as_array().ok_or("attempts")?;
    let reasons: Vec<&str> = attempts
        .iter()
        .filter_map(|a| a["reason"].as_str())
        .collect();
    assert_eq!(
        reasons,
        ["http_503", "outcome_unknown", "max_attempts (http_500)"]
    );
    assert_eq!(attempts[1]["attempt"], 2);
    assert_eq!(attempts[1]["remote_ref"], "ref-7");
    assert_eq!(attempts[0]["remote_ref"], Value::Null);
    let at: DateTime<Utc> = attempts[2]["at"].as_str().ok_or("at")?.parse()?;
    let r = Store::open(&file)?.outbox().get(OutboxId(1))?;
    assert_eq!(at, r.attempts[2].at);

    let v = json(&["outbox", "list", s(&file)])?;
    assert_eq!(v[0]["last_reason"], "max_attempts (http_500)");
    let text = ok(&["outbox", "list", s(&file)])?;
    assert!(text.contains("LAST REASON"), "{text}");
    assert!(text.contains("max_attempts (http_500)"), "{text}");

    // Entries without a history: the last failure, or nothing.
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let v = json(&["outbox", "list", s(&file)])?;
    assert_eq!(v[0]["last_reason"], Value::Null);
    assert_eq!(v[2]["last_reason"], "bank_down");
    let text = ok(&["outbox", "show", s(&file), "1"])?;
    assert!(text.contains("history          -"), "{text}");
    Ok(())
}

#[test]
fn resolve_settles_an_outcome_unknown_entry() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let text = ok(&["outbox", "resolve", s(&file), "4", "--completed"])?;
    assert!(text.contains("4: outcome_unknown -> completed"), "{text}");
    let v = json(&[
        "outbox",
        "resolve",
        s(&file),
        "6",
        "--failed",
        "refunded_by_hand",
    ])?;
    assert_eq!(v["now"], "failed");
    // Only outcome-unknown entries are resolved.
    let o = run(&["outbox", "resolve", s(&file), "1", "--completed"])?;
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("not outcome_unknown"), "{}", stderr(&o));
    // One outcome is required, and only one.
    assert_eq!(
        run(&["outbox", "resolve", s(&file), "4"])?.status.code(),
        Some(2)
    );
    let both = run(&[
        "outbox",
        "resolve",
        s(&file),
        "4",
        "--completed",
        "--failed",
        "x",
    ])?;
    assert_eq!(both.status.code(), Some(2));

    let store = Store::open(&file)?;
    let four = store.outbox().get(OutboxId(4))?;
    assert_eq!(four.entry.status, OutboxStatus::Completed);
    assert!(four.entry.completed_at.is_some());
    let six = store.outbox().get(OutboxId(6))?;
    assert_eq!(six.entry.status, OutboxStatus::Failed);
    assert_eq!(six.last_failure.as_deref(), Some("refunded_by_hand"));
    assert_eq!(
        store.outbox().get(OutboxId(1))?.entry.status,
        OutboxStatus::Pending
    );
    Ok(())
}

#[test]
fn outbox_purge_removes_entries_finished_before_the_cutoff_and_says_how_many() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let text = ok(&["outbox", "purge", s(&file), "--finished-before", "5d"])?;
    assert!(text.contains("purged 1 "), "{text}");
    let v = json(&["outbox", "purge", s(&file), "--finished-before", "5d"])?;
    assert_eq!(v["purged"], 0);

    let store = Store::open(&file)?;
    assert!(store.outbox().get(OutboxId(2)).is_err());
    assert_eq!(store.outbox().counts()?.completed, 0);
    assert!(store.outbox().check_indexes()?.is_empty());
    Ok(())
}

#[test]
fn inbox_prune_removes_keys_seen_before_the_cutoff_and_says_how_many() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let text = ok(&["inbox", "prune", s(&file), "webhooks", "--before", "1d"])?;
    assert!(text.contains("pruned 2 keys"), "{text}");

    let store = Store::open(&file)?;
    let webhooks = store.inbox("webhooks")?;
    assert_eq!(webhooks.len()?, 1);
    assert!(webhooks.seen("evt_new")?);
    assert!(store.check_inbox_indexes()?.is_empty());
    Ok(())
}

#[test]
fn keys_purge_removes_responses_created_before_the_cutoff_and_says_how_many() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let cutoff = ago(2 * D).to_rfc3339();
    let v = json(&["keys", "purge", s(&file), "--before", &cutoff])?;
    assert_eq!(v["purged"], 1);

    let store = Store::open(&file)?;
    let keys = store.idempotency_keys().summary()?;
    assert_eq!((keys.completed, keys.reserved), (1, 1));
    Ok(())
}

#[test]
fn outbox_release_frees_claims_taken_before_the_cutoff_and_names_them() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let v = json(&["outbox", "release", s(&file), "--claimed-before", "90m"])?;
    assert_eq!(v["released"], serde_json::json!([5]));

    let store = Store::open(&file)?;
    let counts = store.outbox().counts()?;
    assert_eq!((counts.pending, counts.dispatching), (2, 0));
    assert!(store.outbox().check_indexes()?.is_empty());
    Ok(())
}

#[test]
fn export_round_trips_every_record() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let text = ok(&["export", s(&file), "--jsonl"])?;
    let lines: Vec<Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let store = Store::open(&file)?;
    let mut by_kind: BTreeMap<String, Vec<&Value>> = BTreeMap::new();
    for v in &lines {
        by_kind
            .entry(v["kind"].as_str().ok_or("kind")?.to_owned())
            .or_default()
            .push(v);
    }
    let inbox = &by_kind["inbox"];
    assert_eq!(inbox.len(), 4);
    for v in inbox {
        let ledger = store.inbox(v["inbox"].as_str().ok_or("inbox")?)?;
        let seen: DateTime<Utc> = v["seen_at"].as_str().ok_or("seen_at")?.parse()?;
        assert_eq!(ledger.seen_at(v["key"].as_str().ok_or("key")?)?, Some(seen));
    }
    let outbox = &by_kind["outbox"];
    assert_eq!(outbox.len(), 6);
    let time = |v: &Value| -> Result<Option<DateTime<Utc>>, Box<dyn std::error::Error>> {
        Ok(match v.as_str() {
            Some(s) => Some(s.parse()?),
            None => None,
        })
    };
    for v in outbox {
        let r = store
            .outbox()
            .get(OutboxId(v["id"].as_u64().ok_or("id")?))?;
        let e = &r.entry;
        assert_eq!(v["command_id"], e.command_id.as_str());
        assert_eq!(v["destination"], e.destination.as_str());
        assert_eq!(v["idempotency_key"], e.idempotency_key.as_str());
        assert_eq!(
            BASE64.decode(v["payload"].as_str().ok_or("payload")?)?,
            e.payload
        );
        assert_eq!(v["status"], idemstore_status(e.status));
        assert_eq!(v["attempt_count"], e.attempt_count);
        assert_eq!(time(&v["created_at"])?, Some(e.created_at));
        assert_eq!(time(&v["next_attempt_at"])?, e.next_attempt_at);
        assert_eq!(time(&v["completed_at"])?, e.completed_at);
        assert_eq!(
            time(&v["claim"]["claimed_at"])?,
            r.claim.as_ref().map(|c| c.claimed_at)
        );
        assert_eq!(
            v["claim"]["worker_id"].as_str(),
            r.claim.as_ref().map(|c| c.worker_id.as_str())
        );
        assert_eq!(
            v["attempt_in_doubt"]["worker_id"].as_str(),
            r.attempt_in_doubt.as_ref().map(|c| c.worker_id.as_str())
        );
        assert_eq!(v["last_failure"].as_str(), r.last_failure.as_deref());
        assert_eq!(v["remote_ref"].as_str(), r.remote_ref.as_deref());
        same_attempts(&v["attempts"], &r.attempts)?;
    }
    // The fixture's failed entry has the one attempt record of its failure.
    assert!(
        outbox
            .iter()
            .any(|v| v["attempts"][0]["reason"] == "bank_down")
    );
    let keys = &by_kind["key"];
    assert_eq!(keys.len(), 3);
    let far_past = ago(1000 * D);
    for v in keys {
        let (tenant, key) = (
            v["tenant"].as_str().ok_or("t")?,
            v["key"].as_str().ok_or("k")?,
        );
        match v["state"].as_str() {
            Some("completed") => {
                let r = store
                    .idempotency_keys()
                    .get(tenant, key, far_past)?
                    .ok_or("gone")?;
                assert_eq!(
                    BASE64.decode(v["body"].as_str().ok_or("body")?)?,
                    r.response_body
                );
                assert_eq!(v["response_status"], r.response_status);
                assert_eq!(v["content_type"].as_str(), r.content_type.as_deref());
                assert_eq!(v["headers"], serde_json::json!(r.headers));
                assert_eq!(v["fingerprint"], r.request_fingerprint.as_str());
                assert_eq!(time(&v["created_at"])?, Some(r.created_at));
            }
            Some("reserved") => {
                assert_eq!((tenant, key), ("acme", "order-3"));
                assert!(v["lease_until"].is_string());
            }
            other => return Err(format!("unexpected state {other:?}").into()),
        }
    }
    Ok(())
}

/// Whether exported attempt records are the record's.
fn same_attempts(v: &Value, want: &[idemstore::AttemptRecord]) -> TestResult {
    let got = v.as_array().ok_or("attempts")?;
    assert_eq!(got.len(), want.len());
    for (got, want) in got.iter().zip(want) {
        assert_eq!(got["attempt"], want.attempt);
        let at: DateTime<Utc> = got["at"].as_str().ok_or("at")?.parse()?;
        assert_eq!(at, want.at);
        assert_eq!(got["reason"], want.reason.as_str());
        assert_eq!(got["remote_ref"].as_str(), want.remote_ref.as_deref());
    }
    Ok(())
}

fn idemstore_status(s: OutboxStatus) -> &'static str {
    match s {
        OutboxStatus::Pending => "pending",
        OutboxStatus::Dispatching => "dispatching",
        OutboxStatus::Completed => "completed",
        OutboxStatus::Failed => "failed",
        OutboxStatus::OutcomeUnknown => "outcome_unknown",
    }
}

#[test]
fn check_passes_a_clean_file() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let text = ok(&["check", s(&file)])?;
    assert!(text.starts_with("ok:"), "{text}");
    assert_eq!(json(&["check", s(&file)])?["ok"], true);
    Ok(())
}

/// Removes the first row of the outbox's claims index and of the inboxes'
/// `seen_at` index: two findings for `check`.
fn damage_indexes(file: &Path) -> TestResult {
    // Recent claims sit in the journal; a prune (of nothing) merges them
    // into the ledger and its `seen_at` index, which the damage below hits.
    assert_eq!(Store::open(file)?.inbox("webhooks")?.prune(ago(30 * D))?, 0);
    {
        let db = redb::Database::open(file)?;
        let tx = db.begin_write()?;
        {
            let mut claimed = tx.open_table(OUTBOX_CLAIMED)?;
            let first = claimed
                .first()?
                .map(|(k, _)| k.value())
                .ok_or("no claims row")?;
            claimed.remove(first)?;
            let mut seen = tx.open_table(INBOX_SEEN)?;
            let first = seen.first()?.map(|(k, _)| {
                let (n, at, key) = k.value();
                (n.to_owned(), at, key.to_owned())
            });
            let (n, at, key) = first.ok_or("no seen row")?;
            seen.remove((n.as_str(), at, key.as_str()))?;
        }
        tx.commit()?;
    }
    Ok(())
}

#[test]
fn check_names_each_missing_index_row_and_exits_1() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    damage_indexes(&file)?;
    let o = run(&["check", s(&file)])?;
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    let text = stdout(&o);
    assert!(
        text.contains("idemstore.v1.outbox.claimed: missing index row"),
        "{text}"
    );
    assert!(
        text.contains("idemstore.v1.inbox.seen_at: missing index row"),
        "{text}"
    );
    assert!(text.contains("2 findings"), "{text}");
    let o = run(&["--json", "check", s(&file)])?;
    assert_eq!(o.status.code(), Some(1));
    let v: Value = serde_json::from_str(&stdout(&o))?;
    assert_eq!(v["ok"], false);
    assert_eq!(v["findings"].as_array().map(Vec::len), Some(2));
    Ok(())
}

#[test]
fn compact_reports_sizes() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    ok(&["outbox", "purge", s(&file), "--finished-before", "0s"])?;
    let v = json(&["compact", s(&file)])?;
    assert!(v["bytes_before"].as_u64().is_some());
    assert!(v["compacted"].is_boolean());
    ok(&["check", s(&file)])?;
    Ok(())
}

#[test]
fn backup_copies_the_whole_file_beside_a_running_program() -> TestResult {
    const ORDERS: TableDefinition<&str, u64> = TableDefinition::new("app.orders");
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("live.idem");
    // The running program: claims with an order row each, until stopped.
    let program = Store::builder().shared(true).open(&file)?;
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let writer = {
        let (program, stop, answered) = (program.clone(), stop.clone(), answered.clone());
        std::thread::spawn(move || -> Result<(), idemstore::Error> {
            let inbox = program.inbox("orders")?;
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let key = format!("o-{n}");
                let _ = inbox.claim_with(&key, Utc::now(), |tx| {
                    tx.open_table(ORDERS)?.insert(key.as_str(), n)?;
                    Ok::<_, idemstore::Error>(())
                })?;
                n += 1;
                answered.store(n, Ordering::SeqCst);
            }
            Ok(())
        })
    };
    while answered.load(Ordering::SeqCst) < 20 {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let before = answered.load(Ordering::SeqCst);
    let copy = dir.path().join("copy.idem");
    let v = json(&["backup", s(&file), "--to", s(&copy)])?;
    stop.store(true, Ordering::SeqCst);
    writer.join().expect("the writer thread")?;
    assert_eq!(v["bytes"].as_u64(), Some(std::fs::metadata(&copy)?.len()));

    // The copy holds the program's own table with the store's, one commit.
    let backup = Store::open(&copy)?;
    let claims = backup.inbox("orders")?.len()?;
    let orders = backup.read(|tx| {
        use idemstore::redb::ReadableTableMetadata as _;
        Ok::<_, idemstore::Error>(
            tx.open_table(ORDERS)
                .map_err(idemstore::Error::from)?
                .len()?,
        )
    })?;
    assert_eq!(claims, orders);
    assert!(
        claims >= before,
        "{claims} claims in the copy, {before} answered before"
    );
    drop(backup);
    ok(&["check", s(&copy)])?;

    // Never over an existing file; and a file held alone is refused.
    let o = run(&["backup", s(&file), "--to", s(&copy)])?;
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("exists"), "{}", stderr(&o));
    drop(program);
    let alone = Store::open(&file)?;
    let o = run(&[
        "backup",
        s(&file),
        "--to",
        s(&dir.path().join("other.idem")),
    ])?;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    drop(alone);
    Ok(())
}

#[test]
fn a_reader_that_stops_early_ends_the_command_quietly() -> TestResult {
    // `idemstore export … | head -1`: the reader goes away after a line.
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("many.idem");
    {
        let store = Store::open(&path)?;
        let keys: Vec<String> = (0..20_000).map(|i| format!("evt-{i:05}")).collect();
        store.inbox("webhooks")?.claim_many(&keys, ago(60))?;
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemstore"))
        .args(["export", s(&path), "--jsonl"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut first = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut first)?;
    assert!(first.starts_with('{'), "{first}");
    // The pipe's reading end is closed here; the command is still writing.
    let out = child.wait_with_output()?;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
    Ok(())
}

/// Runs the binary with `args` and its stdout a pipe whose reading end is
/// closed before it starts: its first line meets a reader that went away.
fn run_to_a_closed_pipe(args: &[&str]) -> Result<Output, std::io::Error> {
    let (reader, writer) = std::io::pipe()?;
    drop(reader);
    Command::new(env!("CARGO_BIN_EXE_idemstore"))
        .args(args)
        .stdout(writer)
        .output()
}

#[test]
fn a_reader_that_goes_away_stops_the_output_not_the_work() -> TestResult {
    // `idemstore outbox cancel f.idem $(seq 1 50) | grep -q cancelled`.
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("many.idem");
    {
        let outbox = Store::open(&path)?.outbox();
        for i in 0..50 {
            let e = NewEntry::new(format!("cmd-{i}"), "mail", format!("k{i}"), vec![1]);
            outbox.enqueue(e, ago(60))?;
        }
    }
    let ids: Vec<String> = (1..=50).map(|i| i.to_string()).collect();
    let mut args = vec!["outbox", "cancel", s(&path)];
    args.extend(ids.iter().map(String::as_str));
    let o = run_to_a_closed_pipe(&args)?;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
    let counts = Store::open(&path)?.outbox().counts()?;
    assert_eq!(counts.get(OutboxStatus::Failed), 50, "{counts:?}");

    // The exit code is what the work came to: entry 99 does not exist.
    ok(&["outbox", "retry", s(&path), "1", "2"])?;
    let o = run_to_a_closed_pipe(&["outbox", "cancel", s(&path), "1", "99", "2"])?;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("entry 99"), "{}", stderr(&o));
    let counts = Store::open(&path)?.outbox().counts()?;
    assert_eq!(counts.get(OutboxStatus::Failed), 50, "{counts:?}");

    // `check … | head` on a file with findings exits 1, on a clean one 0.
    let o = run_to_a_closed_pipe(&["check", s(&path)])?;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let file = fixture(dir.path())?;
    damage_indexes(&file)?;
    for json in [false, true] {
        let mut args = vec!["check", s(&file)];
        if json {
            args.insert(0, "--json");
        }
        let o = run_to_a_closed_pipe(&args)?;
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    }
    Ok(())
}

#[test]
fn bad_usage_exits_2() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let o = run(&[
        "inbox",
        "prune",
        s(&file),
        "webhooks",
        "--before",
        "yesterday",
    ])?;
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("RFC 3339"), "{}", stderr(&o));
    assert_eq!(
        run(&["outbox", "purge", s(&file), "--finished-before", "7w"])?
            .status
            .code(),
        Some(2)
    );
    assert_eq!(run(&["frobnicate"])?.status.code(), Some(2));
    assert_eq!(run(&["export", s(&file)])?.status.code(), Some(2));
    Ok(())
}

#[test]
fn a_missing_file_is_reported_and_not_created() -> TestResult {
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("missing.idem");
    for command in ["stats", "compact"] {
        let o = run(&[command, s(&missing)])?;
        assert_eq!(o.status.code(), Some(1));
        let err = stderr(&o);
        assert!(err.contains("no such file"), "{command}: {err}");
        assert!(err.contains(s(&missing)), "{command}: {err}");
        assert!(!missing.exists());
    }
    Ok(())
}

#[test]
fn an_empty_file_is_refused_and_left_empty() -> TestResult {
    let dir = tempfile::tempdir()?;
    let empty = dir.path().join("e.idem");
    std::fs::File::create(&empty)?;
    for args in [
        vec!["stats", s(&empty)],
        vec!["check", s(&empty)],
        vec!["compact", s(&empty)],
    ] {
        let o = run(&args)?;
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = stderr(&o);
        assert!(
            err.contains("empty file, not a store file"),
            "{args:?}: {err}"
        );
        assert_eq!(std::fs::metadata(&empty)?.len(), 0, "{args:?}");
    }
    Ok(())
}

const LIVE_FILE_ENV: &str = "IDEMSTORE_CLI_LIVE_FILE";
const LIVE_SHARED_ENV: &str = "IDEMSTORE_CLI_LIVE_SHARED";

/// The child: a program using a store while the CLI runs beside it. It opens
/// the file shared or alone, as told, then until its stdin closes, round
/// after round: claims the inbox key `evt-N`, enqueues the entry `cmd-N`,
/// and claims what is due. A first attempt fails for good (`bank_down`),
/// but `cmd-2`'s is left claimed (as by a worker that died) and `cmd-3`'s
/// ends in doubt; an entry claimed again (an operator retried or released
/// it) is delivered. It prints `wrote N` once round N is durable, and
/// `delivered ID on attempt A`.
#[test]
#[ignore = "run by the tests of a store a running program holds, as a child process"]
fn live_program() -> TestResult {
    let Ok(path) = std::env::var(LIVE_FILE_ENV) else {
        return Ok(());
    };
    let shared = std::env::var(LIVE_SHARED_ENV).is_ok_and(|v| v == "1");
    let store = Store::builder().shared(shared).open(path)?;
    let stop = Arc::new(AtomicBool::new(false));
    let stopper = stop.clone();
    std::thread::spawn(move || {
        // Its parent closes the pipe, or dies.
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        stopper.store(true, Ordering::SeqCst);
    });
    let inbox = store.inbox("live")?;
    let outbox = store.outbox();
    let mut round = 0_u64;
    while !stop.load(Ordering::SeqCst) {
        round += 1;
        let now = Utc::now();
        assert!(inbox.claim(&format!("evt-{round}"), now)?);
        let entry = NewEntry::new(
            format!("cmd-{round}"),
            "bank",
            format!("k{round}"),
            round.to_be_bytes().to_vec(),
        );
        outbox.enqueue(entry, now)?;
        for e in outbox.claim_due(now, 16, "live-program")? {
            let settlement = match (e.attempt_count, e.command_id.as_str()) {
                (1, "cmd-2") => continue,
                (1, "cmd-3") => Settlement::OutcomeUnknown {
                    remote_ref: Some("ref-3".into()),
                },
                (1, _) => Settlement::Failed {
                    reason: "bank_down".into(),
                    next_attempt_at: None,
                },
                _ => Settlement::Completed,
            };
            outbox.settle(e.fence(), settlement, now)?;
            if e.attempt_count > 1 {
                println!("delivered {} on attempt {}", e.id.0, e.attempt_count);
            }
        }
        println!("wrote {round}");
    }
    Ok(())
}

/// [`live_program`] running in a child process, and what it printed.
struct Live {
    child: Mutex<Child>,
    stdin: Option<ChildStdin>,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Live {
    /// Starts the program on `file`, opened shared or alone, and waits
    /// until its first round is durable.
    fn start(file: &Path, shared: bool) -> Result<Live, Box<dyn std::error::Error>> {
        let mut child = common::child_test("live_program")
            .env(LIVE_FILE_ENV, file)
            .env(LIVE_SHARED_ENV, if shared { "1" } else { "0" })
            .stdin(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().ok_or("piped stdout")?;
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                sink.lock().push(line);
            }
        });
        let live = Live {
            child: Mutex::new(child),
            stdin,
            lines,
        };
        common::eventually("the program's first round", || live.rounds() >= 1);
        Ok(live)
    }

    /// The last lines the program printed, newest first.
    fn tail(&self) -> Vec<String> {
        self.lines.lock().iter().rev().take(20).cloned().collect()
    }

    /// Fails the test if the program stopped (only [`Live::stop`] stops it).
    fn running(&self) {
        if let Ok(Some(status)) = self.child.lock().try_wait() {
            panic!("the program stopped ({status}): {:?}", self.tail());
        }
    }

    /// How many rounds the program has made durable.
    fn rounds(&self) -> u64 {
        self.running();
        // The test harness prints its own words first on the first line.
        self.lines
            .lock()
            .iter()
            .rev()
            .find_map(|l| l.split("wrote ").nth(1).and_then(|n| n.parse().ok()))
            .unwrap_or(0)
    }

    /// Whether the program printed `line`.
    fn printed(&self, line: &str) -> bool {
        self.running();
        self.lines.lock().iter().any(|l| l.ends_with(line))
    }

    /// Closes the program's stdin and waits for it: its test must pass.
    fn stop(mut self) -> TestResult {
        drop(self.stdin.take());
        let status = self.child.get_mut().wait()?;
        assert!(status.success(), "the program failed: {:?}", self.tail());
        Ok(())
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        // A test that failed half way: do not leave the program running.
        if self.stdin.take().is_some() {
            let child = self.child.get_mut();
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `stats --json`: the keys of inbox `live` and the outbox's total.
fn live_counts(file: &Path) -> Result<(u64, u64), Box<dyn std::error::Error>> {
    let v = json(&["stats", s(file)])?;
    let keys = v["inboxes"]
        .as_array()
        .ok_or("inboxes")?
        .iter()
        .find(|i| i["name"] == "live")
        .and_then(|i| i["keys"].as_u64())
        .ok_or("inbox live")?;
    Ok((keys, v["outbox"]["total"].as_u64().ok_or("total")?))
}

/// `outbox retry`, `release` and `resolve` beside [`live_program`]: it
/// takes the retried and the released entry again and delivers them.
/// Returns the retried entry's id.
fn repairs_reach_the_program(live: &Live, file: &Path) -> Result<u64, Box<dyn std::error::Error>> {
    // Retry an entry whose attempt failed for good: the program's next
    // claim takes it again, and delivers it.
    let failed = json(&[
        "outbox",
        "list",
        s(file),
        "--status",
        "failed",
        "--limit",
        "1",
    ])?;
    let id = failed[0]["id"].as_u64().ok_or("a failed entry")?;
    let text = ok(&["outbox", "retry", s(file), &id.to_string()])?;
    assert!(text.contains(&format!("{id}: failed -> pending")), "{text}");
    common::eventually("the program delivers the retried entry", || {
        live.printed(&format!("delivered {id} on attempt 2"))
    });
    let v = json(&["outbox", "show", s(file), &id.to_string()])?;
    assert_eq!(v["status"], "completed");
    assert_eq!(v["attempt_count"], 2);
    assert_eq!(v["attempts"][0]["reason"], "bank_down");

    // Release the claim the program left behind (only it: the cutoff is
    // just after it, before any later claim); the program delivers the entry.
    let v = json(&["outbox", "list", s(file), "--status", "dispatching"])?;
    let stuck = v
        .as_array()
        .and_then(|a| a.iter().find(|r| r["command_id"] == "cmd-2"));
    let stuck = stuck.ok_or("cmd-2 left claimed")?;
    let claimed_at: DateTime<Utc> = stuck["claim"]["claimed_at"]
        .as_str()
        .ok_or("claimed_at")?
        .parse()?;
    let cutoff = (claimed_at + TimeDelta::microseconds(1)).to_rfc3339();
    let v = json(&["outbox", "release", s(file), "--claimed-before", &cutoff])?;
    let released = stuck["id"].as_u64().ok_or("id")?;
    assert_eq!(v["released"], serde_json::json!([released]));
    common::eventually("the program delivers the released entry", || {
        live.printed(&format!("delivered {released} on attempt 2"))
    });

    // Settle the entry in doubt by hand.
    let v = json(&["outbox", "list", s(file), "--status", "outcome-unknown"])?;
    let doubt = v[0]["id"].as_u64().ok_or("cmd-3 in doubt")?;
    assert_eq!(v[0]["command_id"], "cmd-3");
    ok(&[
        "outbox",
        "resolve",
        s(file),
        &doubt.to_string(),
        "--completed",
    ])?;
    let v = json(&["outbox", "show", s(file), &doubt.to_string()])?;
    assert_eq!(v["status"], "completed");
    assert_eq!(v["remote_ref"], "ref-3");
    Ok(id)
}

/// The reading commands beside [`live_program`], which has enqueued more
/// than `total` entries by now.
fn reads_see_the_program(live: &Live, file: &Path, total: u64) -> TestResult {
    let v = json(&["inbox", "list", s(file), "live", "--limit", "2"])?;
    let first: Vec<&str> = v
        .as_array()
        .ok_or("list")?
        .iter()
        .filter_map(|r| r["key"].as_str())
        .collect();
    assert_eq!(first, ["evt-1", "evt-2"]);
    let v = json(&["outbox", "list", s(file), "--limit", "0"])?;
    assert!(v.as_array().is_some_and(|a| a.len() as u64 > total));
    let acknowledged = live.rounds();
    let exported = ok(&["export", s(file), "--jsonl"])?;
    let mut kinds: BTreeMap<String, u64> = BTreeMap::new();
    for line in exported.lines() {
        let v: Value = serde_json::from_str(line)?;
        *kinds
            .entry(v["kind"].as_str().ok_or("kind")?.to_owned())
            .or_default() += 1;
    }
    assert!(
        kinds["inbox"] >= acknowledged && kinds["outbox"] >= acknowledged,
        "{kinds:?}"
    );
    assert!(ok(&["keys", "list", s(file)])?.contains("0 keys"));
    assert!(ok(&["check", s(file)])?.starts_with("ok:"));
    Ok(())
}

#[test]
fn the_cli_reads_and_repairs_a_store_a_running_program_shares() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("live.idem");
    let live = Live::start(&file, true)?;

    // `stats` shows every round the program made durable before it ran, and
    // later ones as they come.
    let acknowledged = live.rounds();
    let (keys, total) = live_counts(&file)?;
    assert!(
        keys >= acknowledged && total >= acknowledged,
        "{keys} {total}"
    );
    common::eventually("stats shows the program's later rounds", || {
        live_counts(&file).is_ok_and(|(k, t)| k > keys && t > total)
    });

    let retried = repairs_reach_the_program(&live, &file)?;
    reads_see_the_program(&live, &file, total)?;

    // The other writing commands: the program keeps going over what they
    // changed.
    let v = json(&["outbox", "purge", s(&file), "--finished-before", "0s"])?;
    assert!(v["purged"].as_u64().is_some_and(|n| n > 0), "{v}");
    let v = json(&["inbox", "prune", s(&file), "live", "--before", "0s"])?;
    assert!(v["pruned"].as_u64().is_some_and(|n| n > 0), "{v}");
    let gone = run(&["outbox", "show", s(&file), &retried.to_string()])?;
    assert_eq!(gone.status.code(), Some(1));
    let rounds = live.rounds();
    common::eventually("the program goes on after them", || {
        live.rounds() > rounds + 2
    });

    // Compaction needs the file to itself.
    let o = run(&["compact", s(&file)])?;
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("needs the file to itself"), "{err}");
    assert!(stdout(&o).is_empty());

    live.stop()?;
    let store = Store::open(&file)?;
    assert!(store.outbox().check_indexes()?.is_empty());
    assert!(store.check_inbox_indexes()?.is_empty());
    assert!(!store.inbox("live")?.seen("evt-1")?);
    drop(store);
    ok(&["compact", s(&file)])?;
    Ok(())
}

#[test]
fn the_cli_names_shared_true_when_a_running_program_holds_the_store_alone() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("alone.idem");
    let live = Live::start(&file, false)?;
    for args in [
        &["stats", s(&file)][..],
        &["outbox", "list", s(&file)],
        &["outbox", "retry", s(&file), "1"],
        &["inbox", "list", s(&file), "live"],
        &["check", s(&file)],
        &["export", s(&file), "--jsonl"],
    ] {
        let o = run(args)?;
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = stderr(&o);
        assert!(err.contains("held exclusively by another process"), "{err}");
        assert!(err.contains("StoreBuilder::shared(true)"), "{err}");
        assert!(
            !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
            "{err}"
        );
        assert!(stdout(&o).is_empty(), "{args:?}");
    }
    let o = run(&["compact", s(&file)])?;
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("needs the file to itself"),
        "{}",
        stderr(&o)
    );

    // Once the program is gone, the same commands work.
    live.stop()?;
    assert!(ok(&["stats", s(&file)])?.contains("live: "));
    Ok(())
}

#[test]
fn destinations_shows_each_destinations_policy_state_and_entries() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    {
        let store = Store::open(&file)?;
        let outbox = store.outbox();
        outbox.set_destination_policy(
            "bank",
            idemstore::DestinationPolicy::default()
                .max_in_flight(4)
                .rate_limit(10.0, 5)
                .circuit_breaker(3, std::time::Duration::from_secs(30))
                .weight(3),
        )?;
        outbox.pause_destination("mail")?;
    }
    let v = json(&["destinations", s(&file)])?;
    let all = v.as_array().ok_or("an array")?;
    assert_eq!(all.len(), 2, "{v}");
    let (bank, mail) = (&all[0], &all[1]);
    assert_eq!(bank["destination"], "bank");
    assert_eq!(
        bank["policy"],
        serde_json::json!({
            "max_in_flight": 4,
            "rate_limit": {"per_second": 10.0, "burst": 5},
            "circuit_breaker": {"consecutive_failures": 3, "cool_down_ms": 30_000},
            "weight": 3,
        })
    );
    assert_eq!(bank["paused"], false);
    assert_eq!(
        bank["circuit"],
        serde_json::json!({"state": "closed", "consecutive_failures": 0})
    );
    assert_eq!(bank["held_until"], Value::Null);
    assert_eq!(bank["tokens"], 5.0);
    assert_eq!(bank["in_flight"], 1);
    assert_eq!(
        bank["counts"],
        serde_json::json!({
            "pending": 0, "dispatching": 1, "completed": 1, "failed": 1, "outcome_unknown": 2,
        })
    );
    assert_eq!(mail["destination"], "mail");
    assert_eq!(mail["paused"], true);
    assert_eq!(
        mail["policy"],
        serde_json::json!({"max_in_flight": null, "rate_limit": null, "circuit_breaker": null, "weight": null})
    );
    assert_eq!(mail["tokens"], Value::Null);
    assert_eq!(mail["counts"]["pending"], 1);

    let text = ok(&["destinations", s(&file)])?;
    for line in [
        "bank\n",
        "  policy     at most 4 in flight; 10/s, bursts of 5; circuit opens after 3 failures in a row, cool-down 30s; weight 3\n",
        "  circuit    closed (0 failures in a row)\n",
        "  tokens     5.0 of 5 (as last stored)\n",
        "  in flight  1\n",
        "  entries    0 pending, 1 dispatching, 1 completed, 1 failed, 2 outcome_unknown\n",
        "mail\n",
        "  policy     no limits\n",
        "  paused     yes\n",
        "2 destinations\n",
    ] {
        assert!(text.contains(line), "{line:?} in\n{text}");
    }
    Ok(())
}

#[test]
fn destination_pause_resume_and_set_change_what_every_dispatcher_sees() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let state = |name: &str| -> Result<idemstore::DestinationState, idemstore::Error> {
        Store::open(&file)?.outbox().destination(name)
    };

    let v = json(&["destination", "pause", s(&file), "mail"])?;
    assert_eq!(
        v,
        serde_json::json!({"destination": "mail", "paused": true})
    );
    assert!(state("mail")?.paused);
    // A paused destination's due entry is not claimed.
    {
        let store = Store::open(&file)?;
        assert!(store.outbox().claim_due(ago(-2 * D), 10, "w")?.is_empty());
    }
    let text = ok(&["destination", "resume", s(&file), "mail"])?;
    assert!(text.contains("resumed destination mail"), "{text}");
    assert!(!state("mail")?.paused);

    let v = json(&[
        "destination",
        "set",
        s(&file),
        "mail",
        "--max-in-flight",
        "2",
        "--rate",
        "0.5",
        "--burst",
        "3",
        "--circuit",
        "5",
        "--cool-down",
        "1m30s",
    ])?;
    assert_eq!(v["destination"], "mail");
    assert_eq!(v["policy"]["rate_limit"]["per_second"], 0.5);
    let want = idemstore::DestinationPolicy::default()
        .max_in_flight(2)
        .rate_limit(0.5, 3)
        .circuit_breaker(5, std::time::Duration::from_secs(90));
    assert_eq!(state("mail")?.policy, want);
    // A set replaces the whole policy.
    let text = ok(&[
        "destination",
        "set",
        s(&file),
        "mail",
        "--max-in-flight",
        "7",
    ])?;
    assert!(
        text.contains("set the policy of destination mail: at most 7 in flight"),
        "{text}"
    );
    assert_eq!(
        state("mail")?.policy,
        idemstore::DestinationPolicy::default().max_in_flight(7)
    );
    let text = ok(&["destination", "set", s(&file), "mail", "--weight", "3"])?;
    assert!(text.contains("mail: weight 3"), "{text}");
    assert_eq!(
        state("mail")?.policy,
        idemstore::DestinationPolicy::default().weight(3)
    );
    let text = ok(&["destination", "set", s(&file), "mail", "--clear"])?;
    assert!(text.contains("mail: no limits"), "{text}");
    assert!(state("mail")?.policy.is_unlimited());
    Ok(())
}

#[test]
fn destination_set_refuses_bad_usage_and_settings_the_store_refuses() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    // Bad usage exits 2; a setting the store refuses exits 1 with its
    // message. Neither changes anything.
    for args in [
        &["destination", "set", s(&file), "mail"][..],
        &["destination", "set", s(&file), "mail", "--rate", "5"],
        &["destination", "set", s(&file), "mail", "--circuit", "5"],
        &["destination", "set", s(&file), "mail", "--cool-down", "5s"],
        &[
            "destination",
            "set",
            s(&file),
            "mail",
            "--clear",
            "--max-in-flight",
            "1",
        ],
        &[
            "destination",
            "set",
            s(&file),
            "mail",
            "--circuit",
            "5",
            "--cool-down",
            "5x",
        ],
    ] {
        let o = run(args)?;
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
    }
    let o = run(&[
        "destination",
        "set",
        s(&file),
        "mail",
        "--max-in-flight",
        "0",
    ])?;
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("max_in_flight"), "{}", stderr(&o));
    let o = run(&["destination", "set", s(&file), "mail", "--weight", "0"])?;
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("weight"), "{}", stderr(&o));
    let o = run(&[
        "destination",
        "set",
        s(&file),
        "mail",
        "--rate",
        "0",
        "--burst",
        "1",
    ])?;
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("rate_limit"), "{}", stderr(&o));
    let o = run(&[
        "destination",
        "set",
        s(&file),
        "mail",
        "--circuit",
        "1",
        "--cool-down",
        "2d",
    ])?;
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("circuit_breaker"), "{}", stderr(&o));
    assert!(
        Store::open(&file)?
            .outbox()
            .destination("mail")?
            .policy
            .is_unlimited()
    );
    Ok(())
}

/// `idemstore console`: serves the console on loopback (with the store's
/// inboxes and idempotency keys), needs a token elsewhere, and then checks
/// it on every request.
#[cfg(feature = "console")]
mod console {
    use std::io::{Read as _, Write as _};
    use std::net::TcpStream;

    use super::*;

    /// A running `idemstore console` and the address it serves.
    struct Serving {
        child: Child,
        at: String,
    }

    impl Drop for Serving {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    fn serve(args: &[&str]) -> Result<Serving, Box<dyn std::error::Error>> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemstore"))
            .arg("console")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().ok_or("stdout")?).read_line(&mut line)?;
        let at = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .ok_or_else(|| format!("no address in {line:?}"))?
            .to_owned();
        Ok(Serving { child, at })
    }

    /// The status line and body of `GET path` at `at`, with `auth` if given.
    fn get(at: &str, path: &str, auth: Option<&str>) -> Result<String, Box<dyn std::error::Error>> {
        let mut s = TcpStream::connect(at)?;
        let auth = auth.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: {at}\r\n{auth}Connection: close\r\n\r\n"
        )?;
        let mut answer = String::new();
        s.read_to_string(&mut answer)?;
        Ok(answer)
    }

    #[test]
    fn the_console_serves_a_store_file_on_loopback_and_asks_a_token_elsewhere() -> TestResult {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("c.idem");
        {
            let store = Store::open(&file)?;
            store.outbox().enqueue(
                NewEntry::new("c", "mailer", "k1", b"hello".to_vec()),
                ago(10),
            )?;
            store.inbox("webhooks")?.claim("e1", ago(5))?;
            let keys = store.idempotency_keys();
            let fp = idemstore::fingerprint("POST", "/pay", b"");
            let Begin::Proceed(r) = keys.begin("acme", "pay-1", &fp, ago(5))? else {
                return Err("a new key proceeds".into());
            };
            keys.complete(&r, r.response(201, b"paid".to_vec(), ago(4)), ago(4))?;
        }
        let file = file.to_str().ok_or("a UTF-8 path")?;
        let served = serve(&[file, "--listen", "127.0.0.1:0"])?;
        let home = get(&served.at, "/", None)?;
        assert!(home.starts_with("HTTP/1.1 200"), "{home}");
        assert!(home.contains("mailer"), "{home}");
        let entry = get(&served.at, "/outbox/1", None)?;
        assert!(
            entry.contains("hello") && !entry.contains("<form"),
            "read-only: {entry}"
        );
        assert!(home.contains("Idempotency keys"), "{home}");
        let inboxes = get(&served.at, "/inboxes", None)?;
        assert!(inboxes.contains("<td>webhooks</td>"), "{inboxes}");
        let key = get(&served.at, "/keys/lookup?tenant=acme&key=pay-1", None)?;
        assert!(
            key.starts_with("HTTP/1.1 200") && key.contains("paid"),
            "{key}"
        );
        drop(served);
        // Reachable from other machines: only with a token.
        let out = run(&["console", file, "--listen", "0.0.0.0:0"])?;
        assert_eq!(out.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&out.stderr).contains("--token-file"));
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, "0123456789abcdef0123\n")?;
        let token_file = token_file.to_str().ok_or("a UTF-8 path")?;
        let served = serve(&[file, "--listen", "127.0.0.1:0", "--token-file", token_file])?;
        assert!(get(&served.at, "/", None)?.starts_with("HTTP/1.1 401"));
        assert!(get(&served.at, "/", Some("wrong"))?.starts_with("HTTP/1.1 401"));
        let home = get(&served.at, "/", Some("0123456789abcdef0123"))?;
        assert!(home.starts_with("HTTP/1.1 200"), "{home}");
        Ok(())
    }
}

#[test]
fn schedules_lists_each_schedule_and_schedule_pauses_resumes_and_removes_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = fixture(dir.path())?;
    let start = chrono::DateTime::parse_from_rfc3339("2026-03-01T00:00:00Z")?.with_timezone(&Utc);
    {
        let store = Store::open(&file)?;
        let outbox = store.outbox();
        let every = idemstore::Schedule::every("reports", std::time::Duration::from_secs(300))?;
        outbox.set_schedule_at("five", every.missed(idemstore::Missed::All), start)?;
        outbox.fire_schedules(start + chrono::TimeDelta::minutes(12))?;
    }
    let v = json(&["schedules", s(&file)])?;
    assert_eq!(
        v,
        serde_json::json!([{
            "name": "five",
            "destination": "reports",
            "spec": "every 300s",
            "missed": "all",
            "paused": false,
            "next_slot": "2026-03-01T00:15:00.000000Z",
            "last_fired": "2026-03-01T00:10:00.000000Z",
        }])
    );
    let text = ok(&["schedules", s(&file)])?;
    assert!(text.contains("every 300s (missed slots: all)"), "{text}");
    assert!(text.contains("1 schedules"), "{text}");

    let v = json(&["schedule", "pause", s(&file), "five"])?;
    assert_eq!(v, serde_json::json!({"schedule": "five", "paused": true}));
    assert!(Store::open(&file)?.outbox().schedules()?[0].paused);
    json(&["schedule", "resume", s(&file), "five"])?;
    assert!(!Store::open(&file)?.outbox().schedules()?[0].paused);
    // A schedule that is not there: exit 1, with a message.
    let missing = run(&["schedule", "pause", s(&file), "nope"])?;
    assert_eq!(missing.status.code(), Some(1));
    json(&["schedule", "remove", s(&file), "five"])?;
    assert!(Store::open(&file)?.outbox().schedules()?.is_empty());
    Ok(())
}
