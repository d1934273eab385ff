//! A store call that returns `Err` wrote nothing, even when it failed after
//! its first writes: the engine rolls a failed operation back as a whole,
//! while the other callers' operations committed in the same batch stand.
//!
//! Each test damages one record in the middle of a bulk call (garbage bytes
//! written through `Store::write` into the record table) so that the call
//! fails part-way with `Error::Corrupted`.
//!
//! The inbox has no case here: no input makes `Inbox::claim_many` fail
//! part-way. Its keys are checked before anything is written, its rows are
//! typed redb values with nothing to decode (a ledger time, a journal
//! `(key, time)`, a count that saturates), and redb refuses to open those
//! tables with other types, so no garbage can be put in front of it.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

use common::{claims_index, t};
use idemstore::redb::TableDefinition;
use idemstore::{
    Error, Fence, NewEntry, Outbox, OutboxCounts, OutboxEntry, OutboxId, OutboxRecord,
    OutboxStatus, ResponseRecord, Result, Settlement, Store,
};

/// The record tables of `src/schema.rs`, with their key and value types.
const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("idemstore.v1.outbox");
const IDEM: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("idemstore.v1.idempotency");

/// A record version byte the store knows, then bytes that do not decode.
const GARBAGE: &[u8] = b"\x01garbage";

fn entry(key: &str) -> NewEntry {
    NewEntry::new("cmd", "dest", key, b"payload".to_vec())
}

/// Replaces outbox record `id` with bytes that do not decode.
fn damage_outbox_record(store: &Store, id: OutboxId) -> Result<()> {
    store.write(|tx| {
        let mut rows = tx.open_table(OUTBOX)?;
        assert!(rows.insert(id.0, GARBAGE)?.is_some(), "record {id} exists");
        Ok(())
    })
}

/// `n` entries enqueued at `t(0)` and claimed by `w` at `t(1)`: their
/// fences.
fn enqueue_and_claim(outbox: &Outbox, n: usize) -> Result<Vec<Fence>> {
    for i in 0..n {
        outbox.enqueue(entry(&format!("k{i}")), t(0))?;
    }
    Ok(outbox
        .claim_due(t(1), n, "w")?
        .iter()
        .map(OutboxEntry::fence)
        .collect())
}

/// Five entries enqueued at `t(0)` and claimed by `w` at `t(1)`; the
/// middle one's record then damaged. Returns the store, its outbox, the
/// claimed entries' fences and the damaged id.
fn five_claimed_one_damaged() -> Result<(Store, Outbox, Vec<Fence>, OutboxId)> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let fences = enqueue_and_claim(&outbox, 5)?;
    assert_eq!(fences.len(), 5);
    let damaged = fences[2].id;
    damage_outbox_record(&store, damaged)?;
    Ok((store, outbox, fences, damaged))
}

/// The records of `fences` other than `damaged`, as they are now.
fn undamaged(outbox: &Outbox, fences: &[Fence], damaged: OutboxId) -> Result<Vec<OutboxRecord>> {
    fences
        .iter()
        .filter(|f| f.id != damaged)
        .map(|f| outbox.get(f.id))
        .collect()
}

/// What the outbox holds apart from the damaged record: the records, the
/// claims index and the status counters.
type Snapshot = (Vec<OutboxRecord>, Vec<(i64, u64)>, OutboxCounts);

fn snapshot(
    store: &Store,
    outbox: &Outbox,
    fences: &[Fence],
    damaged: OutboxId,
) -> Result<Snapshot> {
    Ok((
        undamaged(outbox, fences, damaged)?,
        claims_index(store)?,
        outbox.counts()?,
    ))
}

/// What `check_indexes` finds, but for the counters (checked on their
/// own): right after the damage, the damaged record and its index rows,
/// which no longer match a record that decodes. A partial write would add
/// to them (an index row out of step with its record).
fn findings(outbox: &Outbox) -> Result<Vec<String>> {
    let mut found = outbox.check_indexes()?;
    // The counters (the store's and each destination's) count the damaged
    // record, which the check cannot read: their findings move with the
    // other callers' writes.
    found.retain(|f| {
        !f.starts_with("idemstore.v1.outbox.flows: counts")
            && (!f.starts_with("destination ") || !f.contains(": counts "))
    });
    Ok(found)
}

fn assert_corrupted<T: std::fmt::Debug>(r: &Result<T>, what: &str) {
    assert!(
        matches!(r, Err(Error::Corrupted { .. })),
        "{what}: expected Err(Corrupted), got {r:?}"
    );
}

#[test]
fn a_bulk_settle_that_fails_on_a_damaged_record_wrote_nothing() -> Result<()> {
    let (store, outbox, fences, damaged) = five_claimed_one_damaged()?;
    let before = snapshot(&store, &outbox, &fences, damaged)?;
    let found = findings(&outbox)?;
    let settlements: Vec<(Fence, Settlement)> =
        fences.iter().map(|f| (*f, Settlement::Completed)).collect();

    let result = outbox.settle_many(settlements, t(2));
    assert_corrupted(&result, "settle_many over a damaged record");

    // The settlements before the damaged record were not written: those
    // entries are still Dispatching, claimed by `w` at t(1).
    let after = snapshot(&store, &outbox, &fences, damaged)?;
    for rec in &after.0 {
        assert_eq!(
            rec.entry.status,
            OutboxStatus::Dispatching,
            "entry {} was settled by a call that failed",
            rec.entry.id
        );
        let claim = rec.claim.as_ref().expect("still claimed");
        assert_eq!((claim.worker_id.as_str(), claim.claimed_at), ("w", t(1)));
    }
    assert_eq!(after, before, "the failed call changed nothing");
    assert_eq!(findings(&outbox)?, found);
    Ok(())
}

#[test]
fn settle_and_claim_whose_claim_fails_wrote_no_settlement() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let fences = enqueue_and_claim(&outbox, 3)?;
    // Due next: a Pending entry whose record is damaged.
    let pending = outbox.enqueue(entry("due"), t(1))?.id();
    damage_outbox_record(&store, pending)?;
    let before = snapshot(&store, &outbox, &fences, pending)?;
    let found = findings(&outbox)?;

    let settlements = [
        (fences[0], Settlement::Completed),
        (
            fences[1],
            Settlement::Failed {
                reason: "http_503".into(),
                next_attempt_at: Some(t(2)),
            },
        ),
        (
            fences[2],
            Settlement::OutcomeUnknown {
                remote_ref: Some("ref-2".into()),
            },
        ),
    ];
    let result = outbox.settle_and_claim(settlements, t(2), 10, "w");
    assert_corrupted(
        &result,
        "settle_and_claim whose claim meets a damaged record",
    );

    let after = snapshot(&store, &outbox, &fences, pending)?;
    for rec in &after.0 {
        assert_eq!(
            rec.entry.status,
            OutboxStatus::Dispatching,
            "entry {} was settled by a call that failed",
            rec.entry.id
        );
    }
    assert_eq!(after, before, "the failed call changed nothing");
    assert_eq!(findings(&outbox)?, found);
    Ok(())
}

/// The failing call runs again and again while another caller enqueues
/// and claims in a loop: its operations share batches with the failing
/// one, and every one that was answered `Ok` committed.
#[test]
fn a_failed_call_leaves_the_other_callers_writes_in_its_batch_standing() -> Result<()> {
    let (store, outbox, fences, damaged) = five_claimed_one_damaged()?;
    let before = snapshot(&store, &outbox, &fences, damaged)?;
    let found = findings(&outbox)?;
    let stop = Arc::new(AtomicBool::new(false));
    let other = {
        let (outbox, stop) = (outbox.clone(), stop.clone());
        thread::spawn(move || -> Result<Vec<(OutboxId, bool)>> {
            let mut done = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) || i < 20 {
                // Every other entry is claimed at once; the others are due
                // later.
                let claimed = i % 2 == 0;
                let mut e = entry(&format!("other-{i}"));
                if !claimed {
                    e = e.not_before(t(1000));
                }
                let id = outbox.enqueue(e, t(3))?.id();
                if claimed {
                    let got = outbox.claim_due(t(3), 1, "other")?;
                    assert_eq!(got.iter().map(|e| e.id).collect::<Vec<_>>(), [id]);
                }
                done.push((id, claimed));
                i += 1;
            }
            Ok(done)
        })
    };
    for round in 0..50 {
        let settlements: Vec<(Fence, Settlement)> =
            fences.iter().map(|f| (*f, Settlement::Completed)).collect();
        let result = outbox.settle_many(settlements, t(2));
        assert_corrupted(&result, &format!("round {round}"));
    }
    stop.store(true, Ordering::Relaxed);
    let done = other.join().expect("the other caller panicked")?;

    assert_eq!(
        snapshot(&store, &outbox, &fences, damaged)?.0,
        before.0,
        "the failed calls changed nothing"
    );
    for (id, claimed) in &done {
        let rec = outbox.get(*id)?;
        if *claimed {
            assert_eq!(rec.entry.status, OutboxStatus::Dispatching, "{id}");
            assert_eq!(
                rec.claim.map(|c| c.worker_id).as_deref(),
                Some("other"),
                "{id}"
            );
        } else {
            assert_eq!(rec.entry.status, OutboxStatus::Pending, "{id}");
        }
    }
    let claimed = done.iter().filter(|(_, c)| *c).count() as u64;
    let counts = outbox.counts()?;
    assert_eq!(counts.dispatching, 5 + claimed);
    assert_eq!(counts.pending, done.len() as u64 - claimed);
    assert_eq!(findings(&outbox)?, found);
    Ok(())
}

fn response(key: &str, at: i64) -> ResponseRecord {
    ResponseRecord::new("acme", key, "fp", 200, b"ok".to_vec(), t(at))
}

#[test]
fn a_purge_of_idempotency_keys_that_fails_on_a_damaged_record_wrote_nothing() -> Result<()> {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    for (i, key) in ["a", "b", "c"].into_iter().enumerate() {
        assert!(keys.put(&response(key, i64::try_from(i).unwrap()))?);
    }
    // The purge walks them by creation time: "b" is in the middle.
    store.write(|tx| {
        let mut rows = tx.open_table(IDEM)?;
        assert!(rows.insert(("acme", "b"), GARBAGE)?.is_some());
        Ok::<_, Error>(())
    })?;

    let result = keys.purge_expired(t(100));
    assert_corrupted(&result, "purge_expired over a damaged record");

    // "a", expired and before the damaged record, is still there.
    let live = t(-1000);
    assert_eq!(keys.get("acme", "a", live)?, Some(response("a", 0)));
    assert_eq!(keys.get("acme", "c", live)?, Some(response("c", 2)));
    let findings = keys.check_indexes()?;
    assert_eq!(findings.len(), 1, "only the damaged row: {findings:#?}");
    Ok(())
}
