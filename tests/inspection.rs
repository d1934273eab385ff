//! The inspection calls operators' tools use: store stats, inbox names and
//! index checks, outbox listing, idempotency summaries and plain reads.

mod common;

use common::t;
use idemstore::redb::TableDefinition;
use idemstore::{
    Begin, IdempotencyKeys, NewEntry, OutboxFilter, OutboxId, OutboxStatus, ResponseRecord, Store,
};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const INBOX: TableDefinition<(&str, &str), i64> = TableDefinition::new("idemstore.v1.inbox");
const INBOX_SEEN: TableDefinition<(&str, i64, &str), ()> =
    TableDefinition::new("idemstore.v1.inbox.seen_at");
const INBOX_COUNT: TableDefinition<&str, u64> = TableDefinition::new("idemstore.v1.inbox.count");

#[test]
fn stats_report_the_file_and_its_space() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("s.idem");
    let store = Store::open(&path)?;
    let empty = store.stats()?;
    assert_eq!(empty.format_version, 3);
    assert!(empty.page_size > 0);
    let inbox = store.inbox("a")?;
    for i in 0..200 {
        inbox.claim(&format!("evt-{i}"), t(i))?;
    }
    let full = store.stats()?;
    assert!(full.stored_bytes > empty.stored_bytes);
    assert_eq!(full.file_bytes, Some(std::fs::metadata(&path)?.len()));
    // Stats write nothing.
    assert_eq!(store.commit_stats(), store.commit_stats());
    let before = store.commit_stats().commits;
    store.stats()?;
    assert_eq!(store.commit_stats().commits, before);
    assert_eq!(Store::in_memory()?.stats()?.file_bytes, None);
    Ok(())
}

#[test]
fn inbox_names_list_non_empty_inboxes() -> TestResult {
    let store = Store::in_memory()?;
    assert!(store.inbox_names()?.is_empty());
    store.inbox("zeta")?.claim("k", t(0))?;
    store.inbox("alpha")?.claim("k", t(0))?;
    let beta = store.inbox("beta")?;
    beta.claim("k", t(0))?;
    assert_eq!(store.inbox_names()?, ["alpha", "beta", "zeta"]);
    beta.prune(t(1))?;
    assert_eq!(store.inbox_names()?, ["alpha", "zeta"]);
    Ok(())
}

#[test]
fn inbox_index_check_finds_each_broken_invariant() -> TestResult {
    let store = Store::in_memory()?;
    let a = store.inbox("a")?;
    a.claim("k1", t(1))?;
    a.claim("k2", t(2))?;
    store.inbox("b")?.claim("k1", t(3))?;
    assert!(store.check_inbox_indexes()?.is_empty());
    // Recent claims sit in the journal; pruning (here nothing) first moves
    // them into the ledger, whose rows the damage below removes.
    assert_eq!(a.prune(t(0))?, 0);
    assert!(store.check_inbox_indexes()?.is_empty());

    // An index row without its row, a row without its index row, a wrong count.
    store.write(|tx| {
        tx.open_table(INBOX_SEEN)?
            .remove(("a", t(1).timestamp_micros(), "k1"))?;
        tx.open_table(INBOX)?.remove(("a", "k2"))?;
        tx.open_table(INBOX_COUNT)?.insert("b", 5)?;
        tx.open_table(INBOX_COUNT)?.insert("ghost", 1)?;
        Ok::<_, idemstore::Error>(())
    })?;
    let findings = store.check_inbox_indexes()?;
    let all = findings.join("\n");
    assert!(
        all.contains("missing index row for key \"k1\" of inbox \"a\""),
        "{all}"
    );
    assert!(
        all.contains("for key \"k2\" of inbox \"a\" has no row"),
        "{all}"
    );
    assert!(
        all.contains("inbox \"b\" is counted 5 but holds 1"),
        "{all}"
    );
    assert!(
        all.contains("inbox \"ghost\" is counted 1 but holds 0"),
        "{all}"
    );
    assert!(
        all.contains("inbox \"a\" is counted 2 but holds 1"),
        "{all}"
    );
    assert_eq!(findings.len(), 5, "{all}");

    // A row whose index row sits at another time.
    let store = Store::in_memory()?;
    store.inbox("a")?.claim("k", t(1))?;
    store.inbox("a")?.prune(t(0))?;
    store.write(|tx| {
        let mut seen = tx.open_table(INBOX_SEEN)?;
        seen.remove(("a", t(1).timestamp_micros(), "k"))?;
        seen.insert(("a", 7, "k"), ())?;
        Ok::<_, idemstore::Error>(())
    })?;
    let findings = store.check_inbox_indexes()?;
    assert_eq!(findings.len(), 1, "{findings:?}");
    assert!(findings[0].contains("indexed at 7 µs"), "{findings:?}");

    // A key in the journal and in the ledger at once.
    let store = Store::in_memory()?;
    store.inbox("a")?.claim("k", t(1))?;
    assert!(store.check_inbox_indexes()?.is_empty());
    store.write(|tx| {
        tx.open_table(INBOX)?
            .insert(("a", "k"), t(1).timestamp_micros())?;
        Ok::<_, idemstore::Error>(())
    })?;
    // The stray ledger row also lacks its index row and its count.
    let findings = store.check_inbox_indexes()?;
    assert_eq!(findings.len(), 3, "{findings:?}");
    assert!(findings[0].contains("is claimed twice"), "{findings:?}");
    assert!(findings[1].contains("missing index row"), "{findings:?}");
    assert!(findings[2].contains("has no count"), "{findings:?}");

    // A journaled key indexed before its merge.
    let store = Store::in_memory()?;
    store.inbox("a")?.claim("k", t(1))?;
    store.write(|tx| {
        tx.open_table(INBOX_SEEN)?
            .insert(("a", t(1).timestamp_micros(), "k"), ())?;
        Ok::<_, idemstore::Error>(())
    })?;
    let findings = store.check_inbox_indexes()?;
    assert_eq!(findings.len(), 1, "{findings:?}");
    assert!(
        findings[0].contains("before its journal row is merged"),
        "{findings:?}"
    );
    Ok(())
}

/// Ten entries (ids 1–10, even ids to "odd", odd ids to "even"), the first
/// three claimed; returns the claimed ones.
fn ten_entries_three_claimed(
    outbox: &idemstore::Outbox,
) -> Result<Vec<idemstore::OutboxEntry>, idemstore::Error> {
    for i in 0..10 {
        let dest = if i % 2 == 0 { "even" } else { "odd" };
        outbox.enqueue(
            NewEntry::new("c", dest, format!("k{i}"), vec![i]),
            t(i.into()),
        )?;
    }
    outbox.claim_due(t(100), 3, "w")
}

fn ids(rs: &[idemstore::OutboxRecord]) -> Vec<u64> {
    rs.iter().map(|r| r.entry.id.0).collect()
}

#[test]
fn outbox_list_pages_through_every_entry_in_id_order() -> TestResult {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    ten_entries_three_claimed(&outbox)?;

    let all = outbox.list(&OutboxFilter::any(), 100)?;
    assert_eq!(ids(&all), (1..=10).collect::<Vec<_>>());
    assert_eq!(all[0], outbox.get(OutboxId(1))?);
    let page = outbox.list(&OutboxFilter::any(), 4)?;
    assert_eq!(ids(&page), [1, 2, 3, 4]);
    let next = outbox.list(&OutboxFilter::any().after(OutboxId(4)), 4)?;
    assert_eq!(ids(&next), [5, 6, 7, 8]);
    assert!(
        outbox
            .list(&OutboxFilter::any().after(OutboxId(u64::MAX)), 4)?
            .is_empty()
    );
    assert!(
        Store::in_memory()?
            .outbox()
            .list(&OutboxFilter::any(), 10)?
            .is_empty()
    );
    Ok(())
}

#[test]
fn outbox_list_returns_only_the_entries_its_filter_matches() -> TestResult {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let claimed = ten_entries_three_claimed(&outbox)?;

    let dispatching = outbox.list(&OutboxFilter::any().status(OutboxStatus::Dispatching), 100)?;
    assert_eq!(
        ids(&dispatching),
        claimed.iter().map(|e| e.id.0).collect::<Vec<_>>()
    );
    let odd_pending = OutboxFilter::any()
        .destination("odd")
        .status(OutboxStatus::Pending);
    assert_eq!(ids(&outbox.list(&odd_pending, 100)?), [4, 6, 8, 10]);
    assert_eq!(ids(&outbox.list(&odd_pending.after(OutboxId(6)), 1)?), [8]);
    assert!(
        outbox
            .list(&OutboxFilter::any().destination(""), 1)
            .is_err()
    );
    Ok(())
}

#[test]
fn oldest_claim_follows_the_claims_index() -> TestResult {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    assert_eq!(outbox.oldest_claim()?, None);
    outbox.enqueue(NewEntry::new("c", "d", "k1", vec![]), t(0))?;
    outbox.enqueue(NewEntry::new("c", "d", "k2", vec![]), t(0))?;
    let first = outbox.claim_due(t(10), 1, "w")?;
    outbox.claim_due(t(20), 1, "w")?;
    assert_eq!(outbox.oldest_claim()?, Some(t(10)));
    outbox.mark_completed(first[0].id, t(30))?;
    assert_eq!(outbox.oldest_claim()?, Some(t(20)));
    outbox.release_expired_claims(t(100))?;
    assert_eq!(outbox.oldest_claim()?, None);
    Ok(())
}

/// A completed response for ("t", "old") created at t(5), and a reservation
/// for ("t", "new"); returns the response.
fn one_response_one_reservation(
    keys: &IdempotencyKeys,
) -> Result<ResponseRecord, idemstore::Error> {
    let record =
        ResponseRecord::new("t", "old", "fp", 200, b"body".to_vec(), t(5)).header("x-a", "1");
    keys.put(&record)?;
    assert!(matches!(
        keys.begin("t", "new", "fp2", t(50))?,
        Begin::Proceed(_)
    ));
    Ok(record)
}

#[test]
fn key_summary_counts_completed_and_reserved_keys_and_the_oldest() -> TestResult {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    let summary = keys.summary()?;
    assert_eq!(
        (summary.completed, summary.reserved, summary.oldest),
        (0, 0, None)
    );
    one_response_one_reservation(&keys)?;
    let summary = keys.summary()?;
    assert_eq!((summary.completed, summary.reserved), (1, 1));
    assert_eq!(summary.oldest, Some(t(5)));
    Ok(())
}

#[test]
fn response_reads_a_stored_response_at_any_age_and_deletes_nothing() -> TestResult {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    let record = one_response_one_reservation(&keys)?;

    // `response` reads whatever the age and deletes nothing.
    assert_eq!(keys.response("t", "old")?, Some(record.clone()));
    assert_eq!(keys.response("t", "old")?, Some(record));
    assert_eq!(keys.response("t", "new")?, None);
    assert_eq!(keys.response("t", "absent")?, None);
    assert_eq!(keys.response("other", "old")?, None);
    assert!(keys.response("t", "").is_err());
    assert_eq!(keys.summary()?.completed, 1);
    Ok(())
}
