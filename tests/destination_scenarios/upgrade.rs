//! A file of the format before destinations (format 1) opened by this
//! build: it gains the destinations' tables, built from its entries.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use idemstore::{DestinationPolicy, Result, Store};

use super::common;
use super::{assert_indexes, entry, shared};

/// Format 1's due index, which the upgrade drops.
const DUE: idemstore::redb::TableDefinition<(i64, u64), ()> =
    idemstore::redb::TableDefinition::new("idemstore.v1.outbox.due");
/// Format 1's counts by status code, which the upgrade moves.
const COUNT: idemstore::redb::TableDefinition<u8, u64> =
    idemstore::redb::TableDefinition::new("idemstore.v1.outbox.count");

/// Writes a file as a build of format 1 left it: entries of this build
/// (a: three pending, two in flight, one completed; b: one of each status),
/// then without the destinations' tables, its format version 1. (Format 1
/// kept each record whole in one row; this build's records read the same,
/// their state rows included.)
fn old_file(path: &Path) -> Result<()> {
    use idemstore::redb::{Database, TableDefinition, TableHandle as _};
    let t = common::t;
    let (pending, counts) = {
        let store = Store::open(path)?;
        let outbox = store.outbox();
        outbox.enqueue_many((0..6).map(|i| entry("a", &format!("a{i}"))), t(0))?;
        outbox.enqueue_many((0..4).map(|i| entry("b", &format!("b{i}"))), t(1))?;
        // a: two in flight; b: one completed, one failed, one in doubt.
        let claimed = outbox.claim_due(t(2), 5, "w")?;
        let (a, b): (Vec<_>, Vec<_>) = claimed.iter().partition(|e| e.destination == "a");
        assert_eq!((a.len(), b.len()), (3, 2));
        outbox.settle(a[2].fence(), idemstore::Settlement::Completed, t(3))?;
        outbox.settle(b[0].fence(), idemstore::Settlement::Completed, t(3))?;
        outbox.mark_failed(b[1].id, "gone", None, t(3))?;
        let more = outbox.claim(t(4), &idemstore::ClaimRequest::new(1, "w").avoid(["a"]))?;
        assert_eq!(more[0].destination, "b");
        outbox.mark_outcome_unknown(more[0].id, None)?;
        let pending = outbox
            .list(
                &idemstore::OutboxFilter::any().status(idemstore::OutboxStatus::Pending),
                100,
            )?
            .iter()
            .map(|r| (r.entry.due_at().timestamp_micros(), r.entry.id.0))
            .collect::<Vec<_>>();
        let c = outbox.counts()?;
        let counts = [
            c.pending,
            c.dispatching,
            c.completed,
            c.failed,
            c.outcome_unknown,
        ];
        (pending, counts)
    };
    {
        // As a file of format 1 was: no destination tables.
        let db = Database::create(path).map_err(idemstore::redb::Error::from)?;
        let tx = db.begin_write().map_err(idemstore::redb::Error::from)?;
        let dropped = [
            "idemstore.v1.outbox.flows",
            "idemstore.v1.outbox.queue",
            "idemstore.v1.outbox.sequences",
        ];
        let tables: Vec<_> = tx
            .list_tables()
            .map_err(idemstore::redb::Error::from)?
            .filter(|t| dropped.contains(&t.name()))
            .collect();
        // The sequences' table exists once an entry had an ordering key.
        assert_eq!(tables.len(), 2, "the file has the new tables to drop");
        for table in tables {
            assert!(tx.delete_table(table)?);
        }
        // Format 1's due index: `(due, id)` for each pending entry.
        let mut due = tx.open_table(DUE)?;
        for row in &pending {
            due.insert(*row, ())?;
        }
        drop(due);
        // Its counts: `status code → n`, no zeros.
        let mut count = tx.open_table(COUNT)?;
        for (code, n) in (0_u8..).zip(counts) {
            if n > 0 {
                count.insert(code, n)?;
            }
        }
        drop(count);
        tx.open_table(TableDefinition::<&str, u64>::new("idemstore.meta"))?
            .insert("format_version", 1)?;
        tx.commit().map_err(idemstore::redb::Error::from)?;
    }
    Ok(())
}

#[test]
fn a_file_of_the_format_before_destinations_gains_their_tables() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.idem");
    let t = common::t;
    old_file(&path)?;
    let store = Store::open(&path)?;
    assert_eq!(store.stats()?.format_version, 3, "upgraded");
    assert_indexes(&store)?;
    let outbox = store.outbox();
    let states: BTreeMap<String, _> = outbox
        .destinations()?
        .into_iter()
        .map(|d| (d.destination.clone(), d))
        .collect();
    assert_eq!(states.len(), 2, "{states:?}");
    let (a, b) = (&states["a"], &states["b"]);
    assert_eq!(
        (a.counts.pending, a.counts.dispatching, a.counts.completed),
        (3, 2, 1)
    );
    assert_eq!(a.in_flight, 2);
    assert_eq!(
        (
            b.counts.pending,
            b.counts.completed,
            b.counts.failed,
            b.counts.outcome_unknown
        ),
        (1, 1, 1, 1)
    );
    assert_eq!(b.in_flight, 0);
    let c = outbox.counts()?;
    assert_eq!(
        [
            c.pending,
            c.dispatching,
            c.completed,
            c.failed,
            c.outcome_unknown
        ],
        [4, 2, 2, 1, 1],
        "format 1's counts carried over"
    );
    // Every pending entry is claimable, a's and b's in turn.
    let claimed = outbox.claim_due(t(10), 10, "w")?;
    let destinations: Vec<&str> = claimed.iter().map(|e| e.destination.as_str()).collect();
    assert_eq!(destinations, ["a", "b", "a", "a"]);
    // A policy set on the upgraded file counts the claims already in flight.
    outbox.set_destination_policy("a", DestinationPolicy::default().max_in_flight(5))?;
    assert_eq!(outbox.destination("a")?.in_flight, 5);
    outbox.enqueue(entry("a", "late"), t(11))?;
    assert!(outbox.claim_due(t(12), 10, "w")?.is_empty(), "a at its cap");
    assert_indexes(&store)?;
    drop((outbox, store));
    // The queues replaced format 1's due index and the flows' rows its
    // count table, which are gone.
    let db = idemstore::redb::Database::open(&path).map_err(idemstore::redb::Error::from)?;
    let tx =
        idemstore::redb::ReadableDatabase::begin_read(&db).map_err(idemstore::redb::Error::from)?;
    let names: Vec<String> = tx
        .list_tables()
        .map_err(idemstore::redb::Error::from)?
        .map(|t| idemstore::redb::TableHandle::name(&t).to_owned())
        .collect();
    for gone in ["idemstore.v1.outbox.due", "idemstore.v1.outbox.count"] {
        assert!(!names.iter().any(|n| n == gone), "{names:?}");
    }
    Ok(())
}

#[test]
fn stores_opening_an_old_shared_file_at_once_upgrade_it_once() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = Arc::new(dir.path().join("old.idem"));
    old_file(&path)?;
    let openers: Vec<_> = (0..4)
        .map(|_| {
            let path = path.clone();
            std::thread::spawn(move || shared().open(&*path))
        })
        .collect();
    let stores: Vec<Store> = openers
        .into_iter()
        .map(|o| o.join().expect("no panic"))
        .collect::<Result<_>>()?;
    for store in &stores {
        assert_eq!(store.stats()?.format_version, 3);
        assert_indexes(store)?;
        let a = store.outbox().destination("a")?;
        assert_eq!((a.counts.pending, a.in_flight), (3, 2));
    }
    // One destination table each, built once: the claims of one store are
    // the others' too.
    let claimed = stores[0].outbox().claim_due(common::t(10), 10, "w")?;
    assert_eq!(claimed.len(), 4);
    assert!(
        stores[1]
            .outbox()
            .claim_due(common::t(10), 10, "w")?
            .is_empty()
    );
    assert_eq!(stores[2].outbox().destination("a")?.in_flight, 5);
    assert_indexes(&stores[3])
}

/// A file of format 2 (destinations, but its entries not yet listed by
/// status) opened by this build: it gains the listing, and a listing of
/// one status finds exactly that status's entries.
#[test]
fn a_file_of_the_format_before_listing_by_status_gains_the_listing() -> Result<()> {
    use idemstore::redb::{Database, ReadableTable as _, TableDefinition};
    use idemstore::{OutboxFilter, OutboxStatus};
    const FLOWS: TableDefinition<(u8, i64, &str), &[u8]> =
        TableDefinition::new("idemstore.v1.outbox.flows");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v2.idem");
    let t = common::t;
    let expected = {
        let store = Store::open(&path)?;
        let outbox = store.outbox();
        outbox.enqueue_many((0..6).map(|i| entry("a", &format!("a{i}"))), t(0))?;
        outbox.enqueue_many((0..4).map(|i| entry("b", &format!("b{i}"))), t(1))?;
        let claimed = outbox.claim_due(t(2), 4, "w")?;
        outbox.settle(claimed[0].fence(), idemstore::Settlement::Completed, t(3))?;
        outbox.mark_failed(claimed[1].id, "gone", None, t(3))?;
        outbox.mark_outcome_unknown(claimed[2].id, None)?;
        let mut by_status = BTreeMap::new();
        for status in OutboxStatus::ALL {
            let ids: Vec<u64> = outbox
                .list(&OutboxFilter::any().status(status), 100)?
                .iter()
                .map(|r| r.entry.id.0)
                .collect();
            by_status.insert(status, ids);
        }
        assert_eq!(by_status[&OutboxStatus::Pending].len(), 6);
        by_status
    };
    {
        // As format 2 left it: no rows of the entries by status.
        let db = Database::create(&path).map_err(idemstore::redb::Error::from)?;
        let tx = db.begin_write().map_err(idemstore::redb::Error::from)?;
        let mut flows = tx.open_table(FLOWS)?;
        let listed: Vec<(u8, i64, String)> = flows
            .range((16, i64::MIN, "")..(21, i64::MIN, ""))?
            .map(|r| r.map(|(k, _)| (k.value().0, k.value().1, k.value().2.to_owned())))
            .collect::<std::result::Result<_, _>>()?;
        assert_eq!(listed.len(), 10 - 1, "every entry but the one in flight");
        for (kind, id, d) in &listed {
            flows.remove((*kind, *id, d.as_str()))?;
        }
        drop(flows);
        tx.open_table(TableDefinition::<&str, u64>::new("idemstore.meta"))?
            .insert("format_version", 2)?;
        tx.commit().map_err(idemstore::redb::Error::from)?;
    }
    let store = Store::open(&path)?;
    assert_eq!(store.stats()?.format_version, 3, "upgraded");
    assert_indexes(&store)?;
    for (status, ids) in expected {
        let found: Vec<u64> = store
            .outbox()
            .list(&OutboxFilter::any().status(status), 100)?
            .iter()
            .map(|r| r.entry.id.0)
            .collect();
        assert_eq!(found, ids, "{status:?}");
    }
    let b_pending = store.outbox().list(
        &OutboxFilter::any()
            .status(OutboxStatus::Pending)
            .destination("b"),
        100,
    )?;
    // Fair claims took two of b's four.
    assert_eq!(b_pending.len(), 2);
    assert!(b_pending.iter().all(|r| r.entry.destination == "b"));
    Ok(())
}
