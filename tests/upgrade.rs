//! A store file written by the 0.1 release (on redb 4.6) opens under this
//! build, alone and shared, answers from every table as it was written, and
//! takes new writes.
//!
//! `tests/fixtures/store-0.1.idem` was written by `examples/make_fixture.rs`
//! (in this repository's history, the commit that added the fixture: the last
//! build on redb 4.6), then compacted: two
//! inboxes (keys merged into the ledger and keys still in the journal, one
//! claim with an effect in an application table), outbox entries in every
//! status with attempt history, an ordering sequence and priorities,
//! destinations with a policy and one paused, idempotency keys with stored
//! responses in two tenants and a live reservation.

use std::path::{Path, PathBuf};
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use idemstore::redb::{ReadableTable as _, TableDefinition};
use idemstore::{
    Begin, DestinationPolicy, Error, NewEntry, OutboxId, OutboxStatus, Result, Store, fingerprint,
};

const FIXTURE: &str = "tests/fixtures/store-0.1.idem";
const APP: TableDefinition<&str, u64> = TableDefinition::new("app.counters");

/// The fixture's instants: 1,700,000,000 s plus `s`.
fn t(s: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + s, 0).unwrap()
}

/// A copy of the fixture in a fresh folder (the committed file is never
/// written).
fn copy_fixture() -> Result<(tempfile::TempDir, PathBuf)> {
    let dir = tempfile::tempdir().map_err(Error::Io)?;
    let path = dir.path().join("old.idem");
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE), &path).map_err(Error::Io)?;
    Ok((dir, path))
}

/// Every answer the 0.1 release gave for the fixture.
fn assert_as_written(store: &Store) -> Result<()> {
    // Inbox: every key of both inboxes, wherever it was left (ledger or
    // journal), with its time; the claim's effect in the application table.
    let webhooks = store.inbox("webhooks")?;
    assert_eq!(webhooks.len()?, 6);
    for i in 0..6 {
        assert_eq!(
            webhooks.seen_at(&format!("evt_{i}"))?,
            Some(t(i)),
            "evt_{i}"
        );
    }
    assert!(!webhooks.seen("evt_6")?);
    let orders = store.inbox("orders")?;
    assert_eq!(orders.len()?, 1);
    assert_eq!(orders.seen_at("ord_1")?, Some(t(10)));
    assert_eq!(store.inbox_names()?, ["orders", "webhooks"]);
    let app =
        store.read(|tx| Ok::<_, Error>(tx.open_table(APP)?.get("orders")?.map(|v| v.value())))?;
    assert_eq!(app, Some(1));
    assert_outbox_as_written(store)?;
    assert_keys_as_written(store)
}

/// The outbox's answers for the fixture: each entry's status, attempts,
/// claim and settlement details, and the destinations.
fn assert_outbox_as_written(store: &Store) -> Result<()> {
    let outbox = store.outbox();
    let status = |id: u64| -> Result<OutboxStatus> { Ok(outbox.get(OutboxId(id))?.entry.status) };
    assert_eq!(status(1)?, OutboxStatus::Completed);
    assert_eq!(status(2)?, OutboxStatus::Failed);
    assert_eq!(status(3)?, OutboxStatus::OutcomeUnknown);
    assert_eq!(status(4)?, OutboxStatus::Pending);
    assert_eq!(status(5)?, OutboxStatus::Dispatching);
    let completed = outbox.get(OutboxId(1))?;
    assert_eq!(completed.entry.completed_at, Some(t(31)));
    assert_eq!(completed.entry.payload, vec![0u8; 10]);
    assert_eq!(completed.entry.attempt_count, 1);
    let failed = outbox.get(OutboxId(2))?;
    assert_eq!(failed.last_failure.as_deref(), Some("http_410"));
    assert_eq!(failed.attempts.len(), 1);
    assert_eq!(failed.attempts[0].reason, "http_410 (gone)");
    assert_eq!(
        (failed.attempts[0].attempt, failed.attempts[0].at),
        (1, t(31))
    );
    assert_eq!(
        outbox.get(OutboxId(3))?.remote_ref.as_deref(),
        Some("remote-42")
    );
    let retried = outbox.get(OutboxId(4))?;
    assert_eq!(retried.entry.next_attempt_at, Some(t(3600)));
    assert_eq!(retried.last_failure.as_deref(), Some("timeout"));
    let claim = outbox.get(OutboxId(5))?.claim.expect("entry 5 is claimed");
    assert_eq!(
        (claim.worker_id.as_str(), claim.claimed_at),
        ("worker-a", t(30))
    );
    let sequence = outbox.list_for_command("cust-7")?;
    assert_eq!(sequence.len(), 3);
    assert!(
        sequence
            .iter()
            .all(|r| r.entry.ordering_key.as_deref() == Some("cust-7"))
    );
    assert!(sequence.iter().all(|r| r.entry.priority == 3));
    let later = outbox.find("email", "later")?.expect("the delayed entry");
    assert_eq!(later.entry.next_attempt_at, Some(t(86_400)));
    assert_eq!(outbox.counts()?.total(), 10);
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    let destinations = outbox.destinations()?;
    let payments = destinations
        .iter()
        .find(|d| d.destination == "payments")
        .unwrap();
    assert_eq!(
        payments.policy,
        DestinationPolicy::default()
            .max_in_flight(4)
            .rate_limit(10.0, 5)
            .circuit_breaker(5, Duration::from_secs(30))
    );
    let audit = destinations
        .iter()
        .find(|d| d.destination == "audit")
        .unwrap();
    assert!(audit.paused);
    assert_eq!(audit.policy, DestinationPolicy::default().max_in_flight(2));
    Ok(())
}

/// The idempotency keys' answers for the fixture: both stored responses as
/// they were, the reservation.
fn assert_keys_as_written(store: &Store) -> Result<()> {
    let keys = store.idempotency_keys();
    let fp = fingerprint("POST", "/payments", b"{\"amount\":10}");
    let stored = keys.get("", "key-1", t(0))?.expect("key-1 is stored");
    assert_eq!(stored.response_status, 201);
    assert_eq!(stored.content_type.as_deref(), Some("application/json"));
    assert_eq!(
        stored.headers,
        [("location".to_owned(), "/payments/1".to_owned())]
    );
    assert_eq!(stored.response_body, b"{\"id\":1}");
    assert_eq!(stored.request_fingerprint, fp);
    let acme = keys
        .get("acme", "key-1", t(0))?
        .expect("acme's key-1 is stored");
    assert_eq!((acme.content_type, acme.headers.len()), (None, 0));
    assert!(
        keys.get("", "key-2", t(0))?.is_none(),
        "a reservation reads as absent"
    );
    assert!(matches!(
        keys.begin("", "key-2", &fp, t(63))?,
        Begin::InFlight { .. }
    ));
    assert_eq!(keys.check_indexes()?, Vec::<String>::new());
    assert_eq!(store.check_inbox_indexes()?, Vec::<String>::new());
    Ok(())
}

/// New writes in every part, then the same answers again.
fn assert_takes_writes(store: &Store) -> Result<()> {
    let webhooks = store.inbox("webhooks")?;
    assert!(
        !webhooks.claim("evt_0", t(100))?,
        "an old key is still a duplicate"
    );
    for i in 6..20 {
        assert!(webhooks.claim(&format!("evt_{i}"), t(100 + i))?);
    }
    assert_eq!(webhooks.len()?, 20);
    assert_eq!(webhooks.prune(t(3))?, 3);

    let outbox = store.outbox();
    let added = outbox.enqueue(
        NewEntry::new("cmd-new", "email", "email-new", b"x".to_vec()),
        t(200),
    )?;
    assert_eq!(added.id(), OutboxId(11), "ids go on from the old file's");
    assert!(
        !outbox
            .enqueue(
                NewEntry::new("c", "email", "email-0", b"x".to_vec()),
                t(200)
            )?
            .is_new()
    );
    // Due now: entry 6 (the head of cust-7's sequence) and the new one; the
    // paused destination gives nothing, entry 4 waits for its retry.
    let mut claimed: Vec<u64> = outbox
        .claim_due(t(300), 10, "worker-b")?
        .iter()
        .map(|e| e.id.0)
        .collect();
    claimed.sort_unstable();
    assert_eq!(claimed, [6, 11]);
    outbox.mark_completed(OutboxId(5), t(301))?;
    outbox.mark_completed(OutboxId(6), t(301))?;
    outbox.mark_completed(OutboxId(3), t(301))?;
    assert_eq!(outbox.claim_due(t(302), 10, "worker-b")?[0].id, OutboxId(7));
    outbox.resume_destination("audit")?;
    assert_eq!(
        outbox.claim_due(t(303), 10, "worker-b")?[0].destination,
        "audit"
    );
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());

    let keys = store.idempotency_keys();
    let fp = fingerprint("POST", "/payments", b"{\"amount\":10}");
    assert!(matches!(
        keys.begin("", "key-1", &fp, t(400))?,
        Begin::Replay(_)
    ));
    assert!(
        matches!(keys.begin("", "key-2", &fp, t(400))?, Begin::Proceed(_)),
        "lease over"
    );
    assert!(matches!(
        keys.begin("", "key-3", &fp, t(400))?,
        Begin::Proceed(_)
    ));
    assert_eq!(keys.check_indexes()?, Vec::<String>::new());
    assert!(store.check_integrity()?);
    Ok(())
}

#[test]
fn a_file_of_the_previous_release_opens_and_answers_as_written() -> Result<()> {
    let (_dir, path) = copy_fixture()?;
    let store = Store::open(&path)?;
    assert_as_written(&store)?;
    assert_takes_writes(&store)?;
    drop(store);
    // And again after its first session under this build.
    let store = Store::open(&path)?;
    assert_eq!(store.inbox("webhooks")?.len()?, 17);
    assert!(store.inbox("webhooks")?.seen("evt_19")?);
    Ok(())
}

#[test]
fn a_file_of_the_previous_release_opens_shared() -> Result<()> {
    let (_dir, path) = copy_fixture()?;
    let one = Store::builder().shared(true).open(&path)?;
    let two = Store::builder().shared(true).open(&path)?;
    assert_as_written(&one)?;
    assert_as_written(&two)?;
    assert_takes_writes(&two)?;
    assert!(one.inbox("webhooks")?.seen("evt_19")?);
    assert!(!one.inbox("webhooks")?.claim("evt_7", t(500))?);
    Ok(())
}
