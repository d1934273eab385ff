//! Writes `tests/fixtures/store-0.1.idem`: a small store file with a row in
//! every table, made by the 0.1 release on redb 4 (see `tests/upgrade.rs`).

use chrono::{DateTime, TimeZone, Utc};
use idemstore::redb::TableDefinition;
use idemstore::{
    Begin, DestinationPolicy, NewEntry, OutboxId, ResponseRecord, Settlement, Store, fingerprint,
};
use std::time::Duration;

const APP: TableDefinition<&str, u64> = TableDefinition::new("app.counters");

fn t(s: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + s, 0).unwrap()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).expect("path");
    let _ = std::fs::remove_file(&path);
    let store = Store::builder().journal_size(4).open(&path)?;

    // Inbox: two inboxes; keys in the ledger (merged) and in the journal.
    let webhooks = store.inbox("webhooks")?;
    for i in 0..6 {
        assert!(webhooks.claim(&format!("evt_{i}"), t(i))?);
    }
    let orders = store.inbox("orders")?;
    let _ = orders.claim_with("ord_1", t(10), |tx| {
        tx.open_table(APP)?.insert("orders", 1)?;
        Ok::<_, idemstore::Error>(())
    })?;

    // Outbox: every status, a destination with a policy, one paused, an
    // ordering key, a priority, a delayed entry, attempt history.
    let outbox = store.outbox();
    outbox.set_destination_policy(
        "payments",
        DestinationPolicy::default()
            .max_in_flight(4)
            .rate_limit(10.0, 5)
            .circuit_breaker(5, Duration::from_secs(30)),
    )?;
    outbox.set_destination_policy("audit", DestinationPolicy::default().max_in_flight(2))?;
    outbox.pause_destination("audit")?;
    let mut ids = Vec::new();
    for i in 0..5u8 {
        let e = NewEntry::new(
            format!("cmd-{i}"),
            "email",
            format!("email-{i}"),
            vec![i; 10],
        );
        ids.push(outbox.enqueue(e, t(20 + i64::from(i)))?.id());
    }
    let claimed = outbox.claim_due(t(30), 5, "worker-a")?;
    assert_eq!(claimed.len(), 5);
    outbox.mark_completed(ids[0], t(31))?; // Completed
    outbox.settle(
        claimed[1].fence(),
        Settlement::Failed {
            reason: "http_410 (gone)".into(),
            next_attempt_at: None,
        },
        t(31),
    )?; // Failed, with an attempt in its history
    outbox.mark_outcome_unknown(ids[2], Some("remote-42"))?; // OutcomeUnknown
    outbox.mark_failed(ids[3], "timeout", Some(t(3600)), t(31))?; // Pending, retry later
    // ids[4] stays Dispatching.
    for i in 0..3 {
        let e = NewEntry::new(
            "cust-7",
            "payments",
            format!("cust-7/{i}"),
            format!("{{\"n\":{i}}}"),
        )
        .ordering_key("cust-7")
        .priority(3);
        outbox.enqueue(e, t(40 + i))?;
    }
    outbox.enqueue(
        NewEntry::new("cmd-a", "audit", "audit-1", b"a".to_vec()),
        t(50),
    )?;
    outbox.enqueue(
        NewEntry::new("cmd-l", "email", "later", b"later".to_vec()).not_before(t(86_400)),
        t(51),
    )?;
    let _ = OutboxId(0);

    // Idempotency keys: a completed response in two tenants, a live
    // reservation, a stored record with headers.
    let keys = store.idempotency_keys();
    let fp = fingerprint("POST", "/payments", b"{\"amount\":10}");
    let Begin::Proceed(r) = keys.begin("", "key-1", &fp, t(60))? else {
        panic!()
    };
    let mut response =
        ResponseRecord::new("", "key-1", fp.clone(), 201, b"{\"id\":1}".to_vec(), t(61))
            .content_type("application/json")
            .header("location", "/payments/1");
    assert!(keys.complete(&r, response.clone(), t(61))?);
    response.tenant = "acme".into();
    response.content_type = None;
    response.headers.clear();
    assert!(keys.put(&response)?);
    let Begin::Proceed(_held) = keys.begin("", "key-2", &fp, t(62))? else {
        panic!()
    };

    store.compact()?;
    drop(store);
    println!("wrote {path}");
    Ok(())
}
