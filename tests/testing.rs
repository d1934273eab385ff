//! `idemstore::testing`: the assertions find what was enqueued and claimed
//! (and say what was, when they fail), `drain` delivers by the dispatchers'
//! rules and moves the clock over back-offs only, and `FaultyDisk` fails or
//! panics at the chosen write or sync, after which a restart finds every
//! acknowledged call, and the failed one whole or not at all.
#![cfg(feature = "testing")]

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use idemstore::testing::{self, Fault, TestStore};
use idemstore::{Delivery, NewEntry, OutboxStatus, RetryPolicy};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn entry(dest: &str, key: &str) -> NewEntry {
    NewEntry::new("cmd", dest, key, key.as_bytes().to_vec())
}

/// The message of the panic `f` raises.
fn panic_message(f: impl FnOnce()) -> String {
    let payload = catch_unwind(AssertUnwindSafe(f)).expect_err("a panic");
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}

#[test]
fn the_assertions_find_entries_and_claims_and_name_what_is_there() -> TestResult {
    let t = TestStore::new()?;
    let outbox = t.store().outbox();
    outbox.enqueue(entry("billing", "o-1"), t.now())?;
    let found = testing::assert_enqueued(&outbox, "billing", "o-1");
    assert_eq!(found.entry.payload, b"o-1");
    assert_eq!(found.entry.status, OutboxStatus::Pending);
    testing::assert_not_enqueued(&outbox, "billing", "o-2");

    let missing = panic_message(|| {
        let _ = testing::assert_enqueued(&outbox, "mail", "o-1");
    });
    assert!(missing.contains("\"mail\""), "{missing}");
    assert!(
        missing.contains("(\"billing\", \"o-1\", pending)"),
        "{missing}"
    );
    let there = panic_message(|| testing::assert_not_enqueued(&outbox, "billing", "o-1"));
    assert!(there.contains("was enqueued"), "{there}");

    let inbox = t.store().inbox("webhooks")?;
    inbox.claim("evt-1", t.now())?;
    testing::assert_claimed(&inbox, "evt-1");
    testing::assert_not_claimed(&inbox, "evt-2");
    let not = panic_message(|| testing::assert_claimed(&inbox, "evt-2"));
    assert!(
        not.contains("\"evt-2\"") && not.contains("\"webhooks\""),
        "{not}"
    );
    Ok(())
}

#[test]
fn drain_retries_over_the_back_off_and_leaves_later_entries_alone() -> TestResult {
    let t = TestStore::new()?;
    let outbox = t.store().outbox();
    outbox.enqueue(entry("billing", "flaky"), t.now())?;
    outbox.enqueue(entry("billing", "fine"), t.now())?;
    let later = t.now() + chrono::Duration::hours(1);
    outbox.enqueue(entry("mail", "later").not_before(later), t.now())?;

    let mut flaky_calls = 0;
    let sent = testing::drain(&outbox, t.clock(), |e| {
        if e.idempotency_key == "flaky" {
            flaky_calls += 1;
            if flaky_calls < 3 {
                return Delivery::Retry {
                    reason: "http_503".into(),
                };
            }
        }
        Delivery::Delivered
    })?;
    let keys: Vec<_> = sent.iter().map(|e| e.idempotency_key.as_str()).collect();
    assert_eq!(keys, ["flaky", "fine", "flaky", "flaky"]);
    let attempts: Vec<_> = sent.iter().map(|e| e.attempt_count).collect();
    assert_eq!(attempts, [1, 1, 2, 3]);
    // The default policy's back-offs without jitter: 1 s, then 2 s.
    assert_eq!(t.now(), TestStore::START + chrono::Duration::seconds(3));
    assert_eq!(
        testing::assert_enqueued(&outbox, "billing", "flaky")
            .entry
            .status,
        OutboxStatus::Completed
    );
    // Never tried and not due yet: still pending, the clock did not jump.
    assert_eq!(
        testing::assert_enqueued(&outbox, "mail", "later")
            .entry
            .status,
        OutboxStatus::Pending
    );
    t.clock().set(later);
    let sent = testing::drain(&outbox, t.clock(), |_| Delivery::Delivered)?;
    assert_eq!(sent.len(), 1);
    assert!(
        testing::enqueued(&outbox)?
            .iter()
            .all(|r| r.entry.status == OutboxStatus::Completed)
    );
    Ok(())
}

#[test]
fn drain_fails_an_entry_for_good_when_its_attempts_run_out() -> TestResult {
    let t = TestStore::new()?;
    let outbox = t.store().outbox();
    outbox.enqueue(entry("billing", "dead"), t.now())?;
    let policy =
        RetryPolicy::exponential(Duration::from_secs(10), Duration::from_secs(60)).max_attempts(4);
    let sent = testing::drain_with(&outbox, t.clock(), &policy, |_| Delivery::Retry {
        reason: "timeout".into(),
    })?;
    assert_eq!(sent.len(), 4);
    let record = testing::assert_enqueued(&outbox, "billing", "dead");
    assert_eq!(record.entry.status, OutboxStatus::Failed);
    assert_eq!(record.last_failure.as_deref(), Some("max_attempts"));
    // 10 s + 20 s + 40 s of back-off.
    assert_eq!(t.now(), TestStore::START + chrono::Duration::seconds(70));
    Ok(())
}

#[test]
fn a_failing_sync_fails_the_call_and_a_restart_keeps_every_acknowledged_one() -> TestResult {
    let mut t = TestStore::new()?;
    let inbox = t.store().inbox("webhooks")?;
    assert!(inbox.claim("evt-1", t.now())?);
    let syncs = t.disk().syncs();
    t.disk().fail_at(Fault::FailSync, 1);
    let failed = inbox.claim("evt-2", t.now());
    assert!(failed.is_err(), "{failed:?}");
    assert!(t.disk().syncs() > syncs);
    // The restarted store has evt-1, acknowledged. A failed sync leaves
    // evt-2 in doubt (its writes were made; the disk may have kept them):
    // it is there whole or not at all, and the tables agree either way.
    t.restart()?;
    let inbox = t.store().inbox("webhooks")?;
    testing::assert_claimed(&inbox, "evt-1");
    let was_kept = inbox.seen("evt-2")?;
    assert_eq!(inbox.len()?, if was_kept { 2 } else { 1 });
    assert_eq!(t.store().check_inbox_indexes()?, Vec::<String>::new());
    assert_eq!(inbox.claim("evt-2", t.now())?, !was_kept);
    Ok(())
}

#[test]
fn a_failing_write_fails_the_call_at_the_chosen_write() -> TestResult {
    let mut t = TestStore::new()?;
    let outbox = t.store().outbox();
    outbox.enqueue(entry("billing", "kept"), t.now())?;
    t.disk().fail_at(Fault::FailWrite, 1);
    assert!(outbox.enqueue(entry("billing", "lost"), t.now()).is_err());
    t.disk().heal();
    t.restart()?;
    let outbox = t.store().outbox();
    testing::assert_enqueued(&outbox, "billing", "kept");
    testing::assert_not_enqueued(&outbox, "billing", "lost");
    Ok(())
}

#[test]
fn a_panicking_sync_reaches_the_caller_and_a_restart_recovers() -> TestResult {
    let mut t = TestStore::new()?;
    let keys = t.store().idempotency_keys();
    let idemstore::Begin::Proceed(r) = keys.begin("", "k-1", "fp", t.now())? else {
        panic!("a fresh key proceeds");
    };
    assert!(keys.complete(&r, r.response(201, &b"done"[..], t.now()), t.now())?);
    t.disk().fail_at(Fault::PanicSync, 1);
    let outcome = catch_unwind(AssertUnwindSafe(|| keys.begin("", "k-2", "fp", t.now())));
    // The call panics or fails; either way it did not answer `Ok`.
    assert!(!matches!(outcome, Ok(Ok(_))), "{outcome:?}");
    t.restart()?;
    let keys = t.store().idempotency_keys();
    let stored = keys
        .get("", "k-1", t.now())?
        .expect("the completed response");
    assert_eq!(stored.response_body, b"done");
    // k-2's reservation is in doubt: kept whole (the key is held) or not
    // at all (it is free).
    assert!(matches!(
        keys.begin("", "k-2", "fp", t.now())?,
        idemstore::Begin::Proceed(_) | idemstore::Begin::InFlight { .. }
    ));
    assert_eq!(keys.check_indexes()?, Vec::<String>::new());
    Ok(())
}
