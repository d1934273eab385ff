//! Claiming, ordering, dedup, fencing, retention, bad input and damaged
//! records of the outbox.

use std::collections::HashMap;
use std::sync::{Arc, Barrier};

use chrono::{DateTime, TimeZone, Utc};
use idemstore::redb::TableDefinition;
use idemstore::{
    Enqueued, Error, Fence, NewEntry, OutboxCounts, OutboxId, OutboxStatus, Result, Settlement,
    Store,
};

fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

fn entry(key: &str) -> NewEntry {
    NewEntry::new("cmd-1", "billing", key, key.as_bytes().to_vec())
}

fn ids(entries: &[idemstore::OutboxEntry]) -> Vec<u64> {
    entries.iter().map(|e| e.id.0).collect()
}

#[test]
#[expect(clippy::many_single_char_names, reason = "entries named by their keys")]
fn claim_due_takes_the_earliest_due_first_then_by_id_up_to_its_limit() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    // id 1 created at 5, id 2 created at 1, id 3 not before 3, id 4 created at 1.
    let a = outbox.enqueue(entry("a"), t(5))?.id();
    let b = outbox.enqueue(entry("b"), t(1))?.id();
    let c = outbox.enqueue(entry("c").not_before(t(3)), t(0))?.id();
    let d = outbox.enqueue(entry("d"), t(1))?.id();
    let e = outbox.enqueue(entry("e").not_before(t(100)), t(0))?.id();
    assert_eq!((a.0, b.0, c.0, d.0, e.0), (1, 2, 3, 4, 5));
    assert_eq!(outbox.get(c)?.entry.next_attempt_at, Some(t(3)));
    assert_eq!(outbox.next_due()?, Some(t(1)));

    let first = outbox.claim_due(t(10), 2, "w1")?;
    assert_eq!(
        ids(&first),
        vec![b.0, d.0],
        "earliest due (1, 1), then by id"
    );
    let rest = outbox.claim_due(t(10), 10, "w1")?;
    assert_eq!(
        ids(&rest),
        vec![c.0, a.0],
        "then due 3, then due 5; e is not due"
    );
    assert!(
        outbox.claim_due(t(99), 10, "w1")?.is_empty(),
        "not_before holds"
    );
    assert_eq!(outbox.next_due()?, Some(t(100)));
    assert_eq!(
        ids(&outbox.claim_due(t(100), 10, "w1")?),
        vec![e.0],
        "due at not_before"
    );
    assert_eq!(outbox.next_due()?, None);
    assert!(
        outbox.claim_due(t(100), 0, "w1")?.is_empty(),
        "limit 0 takes nothing"
    );
    Ok(())
}

#[test]
fn claimed_entries_equal_what_get_returns() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    outbox.enqueue(entry("x"), t(0))?;
    outbox.enqueue(entry("y").not_before(t(2)), t(0))?;
    for claimed in outbox.claim_due(t(5), 10, "worker-9")? {
        let rec = outbox.get(claimed.id)?;
        assert_eq!(rec.entry, claimed);
        assert_eq!(claimed.status, OutboxStatus::Dispatching);
        assert_eq!(claimed.attempt_count, 1);
        let claim = rec.claim.expect("claimed");
        assert_eq!(
            (claim.worker_id.as_str(), claim.claimed_at),
            ("worker-9", t(5))
        );
    }
    Ok(())
}

#[test]
fn settlements_keep_the_retry_time_the_first_remote_ref_and_the_first_completion() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let id = outbox.enqueue(entry("r"), t(0))?.id();
    let claim = outbox.claim_due(t(1), 1, "w")?.remove(0);
    outbox.settle(
        claim.fence(),
        Settlement::Failed {
            reason: "http_503".into(),
            next_attempt_at: Some(t(30)),
        },
        t(2),
    )?;
    assert!(outbox.claim_due(t(29), 1, "w")?.is_empty());
    let claim = outbox.claim_due(t(30), 1, "w")?.remove(0);
    assert_eq!(claim.attempt_count, 2);
    outbox.settle(
        claim.fence(),
        Settlement::OutcomeUnknown { remote_ref: None },
        t(31),
    )?;
    outbox.settle(
        claim.fence(),
        Settlement::OutcomeUnknown {
            remote_ref: Some("ch_1".into()),
        },
        t(32),
    )?;
    outbox.mark_outcome_unknown(id, Some("ch_2"))?;
    assert_eq!(
        outbox.get(id)?.remote_ref.as_deref(),
        Some("ch_1"),
        "filled once"
    );
    outbox.settle(claim.fence(), Settlement::Completed, t(40))?;
    let rec = outbox.get(id)?;
    assert_eq!(rec.entry.status, OutboxStatus::Completed);
    assert_eq!(rec.entry.completed_at, Some(t(40)));
    assert_eq!(rec.last_failure.as_deref(), Some("http_503"));
    outbox.settle(claim.fence(), Settlement::Completed, t(50))?;
    assert_eq!(
        outbox.get(id)?,
        rec,
        "a repeated completion changes nothing"
    );
    assert!(outbox.check_indexes()?.is_empty());
    Ok(())
}

#[test]
fn ids_keep_increasing_across_reopen() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outbox.idem");
    let last = {
        let store = Store::open(&path)?;
        let outbox = store.outbox();
        outbox.enqueue(entry("1"), t(0))?;
        outbox.enqueue(entry("2"), t(0))?.id()
    };
    let store = Store::open(&path)?;
    let outbox = store.outbox();
    let next = outbox.enqueue(entry("3"), t(0))?.id();
    assert!(next > last, "{next} after {last}");
    assert_eq!(
        outbox.enqueue(entry("1"), t(9))?,
        Enqueued::Duplicate(OutboxId(1)),
        "dedup survives reopen"
    );
    assert!(outbox.check_indexes()?.is_empty());
    Ok(())
}

#[test]
fn duplicates_return_the_existing_id_and_change_nothing() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let id = outbox.enqueue(entry("k"), t(0))?;
    assert!(id.is_new());
    let before = outbox.get(id.id())?;
    let again = NewEntry::new("cmd-2", "billing", "k", b"other".to_vec()).not_before(t(9));
    assert_eq!(outbox.enqueue(again, t(5))?, Enqueued::Duplicate(id.id()));
    assert_eq!(outbox.get(id.id())?, before);
    // The same key at another destination is another entry.
    let other = outbox.enqueue(NewEntry::new("cmd-1", "mail", "k", vec![]), t(0))?;
    assert!(other.is_new());
    // enqueue_many: duplicates of stored and of earlier items in the batch.
    let out = outbox.enqueue_many([entry("k"), entry("m"), entry("m")], t(1))?;
    assert_eq!(out[0], Enqueued::Duplicate(id.id()));
    assert!(out[1].is_new());
    assert_eq!(out[2], Enqueued::Duplicate(out[1].id()));
    assert_eq!(outbox.counts()?.pending, 3);
    let found = outbox.find("billing", "m")?.expect("found");
    assert_eq!(found.entry.id, out[1].id());
    assert_eq!(outbox.find("billing", "nope")?, None);
    Ok(())
}

#[test]
fn enqueue_in_rolls_back_with_the_callers_transaction() -> Result<()> {
    const APP: TableDefinition<&str, u64> = TableDefinition::new("app.orders");
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let wake = outbox.subscribe();
    let failed: Result<()> = store.write(|tx| {
        tx.open_table(APP)
            .map_err(Error::from)?
            .insert("order-1", 1)
            .map_err(Error::from)?;
        outbox.enqueue_in(tx, entry("rolled-back"), t(0))?;
        Err(Error::InvalidInput {
            field: "order",
            reason: "the application changed its mind".into(),
        })
    });
    assert!(failed.is_err());
    assert_eq!(outbox.find("billing", "rolled-back")?, None);
    assert_eq!(outbox.counts()?, OutboxCounts::default());
    assert!(
        wake.try_recv().is_err(),
        "nothing committed, nothing signalled"
    );

    let id = store.write(|tx| {
        tx.open_table(APP)
            .map_err(Error::from)?
            .insert("order-2", 2)
            .map_err(Error::from)?;
        outbox.enqueue_in(tx, entry("kept"), t(0))
    })?;
    outbox.notify();
    assert!(wake.try_recv().is_ok());
    assert_eq!(outbox.get(id.id())?.entry.idempotency_key, "kept");
    assert_eq!(id.id(), OutboxId(1), "the rolled-back enqueue used no id");
    assert!(outbox.check_indexes()?.is_empty());
    Ok(())
}

#[test]
fn a_stale_attempt_cannot_settle() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let id = outbox.enqueue(entry("f"), t(0))?.id();
    let first = outbox.claim_due(t(1), 1, "slow-worker")?.remove(0);
    // The slow worker's claim expires; the reaper releases it, another worker claims it.
    assert_eq!(outbox.release_expired_claims(t(61))?, vec![id]);
    let stale_after_release = outbox.settle(first.fence(), Settlement::Completed, t(62));
    assert!(matches!(stale_after_release, Err(Error::Conflict { .. })));
    let second = outbox.claim_due(t(62), 1, "fast-worker")?.remove(0);
    assert_eq!(second.fence(), Fence { id, attempt: 2 });
    let before = outbox.get(id)?;
    for s in [
        Settlement::Completed,
        Settlement::Failed {
            reason: "late".into(),
            next_attempt_at: None,
        },
        Settlement::OutcomeUnknown { remote_ref: None },
        Settlement::Rescheduled {
            next_attempt_at: t(99),
        },
    ] {
        let r = outbox.settle(first.fence(), s, t(63));
        assert!(matches!(r, Err(Error::Conflict { .. })), "{r:?}");
    }
    assert_eq!(outbox.get(id)?, before, "the stale worker changed nothing");
    // settle_many: one result each.
    let out = outbox.settle_many(
        [
            (first.fence(), Settlement::Completed),
            (second.fence(), Settlement::Completed),
        ],
        t(64),
    )?;
    assert!(matches!(out[0], Err(Error::Conflict { .. })));
    assert!(out[1].is_ok());
    assert_eq!(outbox.get(id)?.entry.completed_at, Some(t(64)));
    Ok(())
}

#[test]
fn release_requeue_and_purge_each_take_only_the_entries_their_rule_allows() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let wake = outbox.subscribe();
    for k in ["a", "b", "c", "d"] {
        outbox.enqueue(entry(k), t(0))?;
    }
    assert!(wake.try_recv().is_ok(), "an enqueue wakes subscribers");
    assert!(wake.try_recv().is_err(), "signals coalesce");
    let claimed = outbox.claim_due(t(10), 4, "w")?;
    let [a, b, c, d] = [0, 1, 2, 3].map(|i| claimed[i].clone());
    let mut want = OutboxCounts::default();
    want.dispatching = 4;
    assert_eq!(outbox.counts()?, want);
    outbox.settle(a.fence(), Settlement::Completed, t(20))?;
    outbox.settle(
        b.fence(),
        Settlement::Failed {
            reason: "bad_request".into(),
            next_attempt_at: None,
        },
        t(30),
    )?;
    outbox.settle(
        c.fence(),
        Settlement::OutcomeUnknown { remote_ref: None },
        t(30),
    )?;
    assert!(
        outbox.release_expired_claims(t(10))?.is_empty(),
        "strictly before"
    );
    assert_eq!(outbox.release_expired_claims(t(11))?, vec![d.id]);
    assert!(wake.try_recv().is_ok(), "a release wakes subscribers");
    assert_eq!(
        outbox.next_due()?,
        Some(t(10)),
        "released: due at its claim time"
    );
    let counts = outbox.counts()?;
    assert_eq!(
        (
            counts.pending,
            counts.dispatching,
            counts.completed,
            counts.failed,
            counts.outcome_unknown
        ),
        (1, 0, 1, 1, 1)
    );
    assert_eq!(counts.total(), 4);

    // Requeue: the way out of Failed and OutcomeUnknown only.
    assert!(matches!(
        outbox.requeue(a.id, t(50)),
        Err(Error::Conflict { .. })
    ));
    assert!(matches!(
        outbox.requeue(d.id, t(50)),
        Err(Error::Conflict { .. })
    ));
    outbox.requeue(c.id, t(50))?;
    assert!(wake.try_recv().is_ok(), "a requeue wakes subscribers");
    let rec = outbox.get(c.id)?;
    assert_eq!(
        (rec.entry.status, rec.entry.next_attempt_at),
        (OutboxStatus::Pending, Some(t(50)))
    );

    // Purge: finished strictly before the cutoff, with their index rows.
    assert_eq!(outbox.purge_finished(t(20))?, 0);
    assert_eq!(outbox.purge_finished(t(21))?, 1);
    assert!(matches!(outbox.get(a.id), Err(Error::NotFound)));
    assert_eq!(outbox.find("billing", "a")?, None);
    assert_eq!(outbox.purge_finished(t(1000))?, 1);
    assert!(matches!(outbox.get(b.id), Err(Error::NotFound)));
    assert_eq!(
        ids(&outbox
            .list_for_command("cmd-1")?
            .into_iter()
            .map(|r| r.entry)
            .collect::<Vec<_>>()),
        vec![c.id.0, d.id.0]
    );
    assert_eq!(outbox.counts()?.total(), 2);
    assert!(outbox.check_indexes()?.is_empty());
    // A purged key may be enqueued again, as a new entry.
    assert!(outbox.enqueue(entry("a"), t(2000))?.is_new());
    Ok(())
}

#[test]
fn list_for_command_orders_by_created_at_then_id() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let x = outbox
        .enqueue(NewEntry::new("order-7", "d", "x", vec![]), t(5))?
        .id();
    let y = outbox
        .enqueue(NewEntry::new("order-7", "d", "y", vec![]), t(1))?
        .id();
    outbox.enqueue(NewEntry::new("order-8", "d", "z", vec![]), t(1))?;
    let w = outbox
        .enqueue(NewEntry::new("order-7", "d", "w", vec![]), t(1))?
        .id();
    let got: Vec<OutboxId> = outbox
        .list_for_command("order-7")?
        .into_iter()
        .map(|r| r.entry.id)
        .collect();
    assert_eq!(got, vec![y, w, x]);
    assert!(outbox.list_for_command("order-9")?.is_empty());
    Ok(())
}

#[test]
fn bad_input_is_refused_and_writes_nothing() -> Result<()> {
    let store = Store::builder().max_body(16).in_memory()?;
    let outbox = store.outbox();
    let long = "k".repeat(1025);
    let invalid = |r: Result<Enqueued>| matches!(r, Err(Error::InvalidInput { .. }));
    let too_large = |r: Result<Enqueued>| matches!(r, Err(Error::TooLarge { .. }));
    assert!(invalid(
        outbox.enqueue(NewEntry::new("", "d", "k", vec![]), t(0))
    ));
    assert!(invalid(
        outbox.enqueue(NewEntry::new("c", "", "k", vec![]), t(0))
    ));
    assert!(invalid(
        outbox.enqueue(NewEntry::new("c", "d", "", vec![]), t(0))
    ));
    assert!(too_large(
        outbox.enqueue(NewEntry::new("c", "d", long.as_str(), vec![]), t(0))
    ));
    assert!(too_large(
        outbox.enqueue(NewEntry::new("c", "d", "k", vec![0; 17]), t(0))
    ));
    let batch = outbox.enqueue_many(
        [
            NewEntry::new("c", "d", "ok", vec![]),
            NewEntry::new("c", "d", "", vec![]),
        ],
        t(0),
    );
    assert!(
        matches!(batch, Err(Error::InvalidInput { .. })),
        "one bad entry fails the batch"
    );
    assert_eq!(
        outbox.find("d", "ok")?,
        None,
        "and nothing of it was written"
    );
    let in_tx: Result<Enqueued> =
        store.write(|tx| outbox.enqueue_in(tx, NewEntry::new("c", "d", "", vec![]), t(0)));
    assert!(invalid(in_tx));
    assert_eq!(outbox.counts()?, OutboxCounts::default());

    let id = outbox
        .enqueue(NewEntry::new("c", "d", "k", vec![0; 16]), t(0))?
        .id();
    let claim = outbox.claim_due(t(1), 1, "w")?.remove(0);
    let before = outbox.get(id)?;
    assert!(matches!(
        outbox.claim_due(t(1), 1, ""),
        Err(Error::InvalidInput { .. })
    ));
    assert!(matches!(
        outbox.mark_failed(id, "", None, t(2)),
        Err(Error::InvalidInput { .. })
    ));
    assert!(matches!(
        outbox.mark_outcome_unknown(id, Some(&long)),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        outbox.settle(
            claim.fence(),
            Settlement::Failed {
                reason: String::new(),
                next_attempt_at: None
            },
            t(2)
        ),
        Err(Error::InvalidInput { .. })
    ));
    assert!(matches!(
        outbox.find("", "k"),
        Err(Error::InvalidInput { .. })
    ));
    assert!(matches!(
        outbox.list_for_command(""),
        Err(Error::InvalidInput { .. })
    ));
    assert_eq!(outbox.get(id)?, before);
    assert!(outbox.check_indexes()?.is_empty());
    Ok(())
}

#[test]
fn a_garbage_record_is_corrupted_not_a_panic() -> Result<()> {
    const RAW: TableDefinition<u64, &[u8]> = TableDefinition::new("idemstore.v1.outbox");
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let id = outbox.enqueue(entry("g"), t(0))?.id();
    let good = outbox.enqueue(entry("h"), t(0))?.id();
    for garbage in [&[][..], &[1, 0xff, 0xff, 0xff][..], &[77, 1, 2][..]] {
        store.write(|tx| {
            tx.open_table(RAW)?.insert(id.0, garbage)?;
            Ok::<_, Error>(())
        })?;
        assert!(
            matches!(outbox.get(id), Err(Error::Corrupted { .. })),
            "{garbage:?}"
        );
        assert!(matches!(
            outbox.mark_completed(id, t(1)),
            Err(Error::Corrupted { .. })
        ));
        assert!(matches!(
            outbox.list_for_command("cmd-1"),
            Err(Error::Corrupted { .. })
        ));
        assert!(!outbox.check_indexes()?.is_empty(), "the check reports it");
    }
    assert_eq!(outbox.get(good)?.entry.idempotency_key, "h");
    Ok(())
}

#[test]
fn a_garbage_or_orphaned_state_row_is_corrupted_or_a_finding_not_a_panic() -> Result<()> {
    const STATE: TableDefinition<u64, &[u8]> = TableDefinition::new("idemstore.v1.outbox.state");
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let id = outbox.enqueue(entry("g"), t(0))?.id();
    let good = outbox.enqueue(entry("h"), t(0))?.id();
    // A change after the enqueue is kept in the entry's state row.
    let claimed = outbox.claim_due(t(1), 2, "w")?;
    outbox.settle(claimed[1].fence(), Settlement::Completed, t(2))?;
    assert_eq!(outbox.get(good)?.entry.status, OutboxStatus::Completed);
    assert!(outbox.check_indexes()?.is_empty());
    for garbage in [
        &[][..],
        &[1, 0xff, 0xff, 0xff][..],
        &[1, 9, 0, 0, 0, 0, 0, 0, 0][..],
    ] {
        store.write(|tx| {
            tx.open_table(STATE)?.insert(id.0, garbage)?;
            Ok::<_, Error>(())
        })?;
        let err = outbox.get(id).unwrap_err();
        assert!(
            matches!(&err, Error::Corrupted { table, .. } if *table == "idemstore.v1.outbox.state"),
            "{garbage:?}: {err:?}"
        );
        assert!(matches!(
            outbox.settle(claimed[0].fence(), Settlement::Completed, t(3)),
            Err(Error::Corrupted { .. })
        ));
        assert!(!outbox.check_indexes()?.is_empty(), "the check reports it");
    }
    store.write(|tx| {
        let mut table = tx.open_table(STATE)?;
        table.remove(id.0)?;
        // A state row of an id that has no entry.
        table.insert(99, &[1, 0, 0, 0, 0, 0, 0, 0, 0][..])?;
        Ok::<_, Error>(())
    })?;
    assert_eq!(
        outbox.get(id)?.entry.status,
        OutboxStatus::Pending,
        "as enqueued"
    );
    let findings = outbox.check_indexes()?;
    assert!(
        findings
            .iter()
            .any(|f| f.contains("state row 99 has no outbox record")),
        "{findings:?}"
    );
    assert_eq!(outbox.get(good)?.entry.status, OutboxStatus::Completed);
    Ok(())
}

#[test]
fn concurrent_claimers_take_each_entry_exactly_once() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("claims.idem"))?;
    let outbox = store.outbox();
    let total = 1_500;
    let batch: Vec<NewEntry> = (0..total).map(|i| entry(&format!("e{i}"))).collect();
    outbox.enqueue_many(batch, t(0))?;
    let threads = 6;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let outbox = outbox.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || -> Result<Vec<OutboxId>> {
                barrier.wait();
                let worker = format!("worker-{i}");
                let mut got = Vec::new();
                loop {
                    let claimed = outbox.claim_due(t(1), 7, &worker)?;
                    if claimed.is_empty() {
                        return Ok(got);
                    }
                    for e in claimed {
                        outbox.settle(e.fence(), Settlement::Completed, t(2))?;
                        got.push(e.id);
                    }
                }
            })
        })
        .collect();
    let mut seen: HashMap<OutboxId, usize> = HashMap::new();
    for h in handles {
        for id in h.join().expect("claimer panicked")? {
            *seen.entry(id).or_default() += 1;
        }
    }
    assert_eq!(seen.len(), total);
    assert!(
        seen.values().all(|&n| n == 1),
        "every entry claimed exactly once"
    );
    assert_eq!(outbox.counts()?.completed, total as u64);
    assert!(outbox.check_indexes()?.is_empty());
    Ok(())
}

#[test]
fn an_enqueue_through_another_handle_wakes_a_subscriber_on_another_thread() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let wake = store.outbox().subscribe();
    let waiter = std::thread::spawn(move || wake.recv().is_ok());
    outbox.enqueue(entry("wake"), t(0))?;
    assert!(
        waiter.join().expect("waiter panicked"),
        "an enqueue through another handle wakes"
    );
    Ok(())
}

#[test]
fn settle_and_claim_settles_then_claims_in_one_commit() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let a = outbox.enqueue(entry("a"), t(0))?.id();
    let b = outbox.enqueue(entry("b"), t(1))?.id();
    let first = outbox.claim_due(t(5), 1, "w")?;
    assert_eq!(ids(&first), vec![a.0]);
    let stale = Fence { id: a, attempt: 9 };
    let before = store.commit_stats().durable_commits;
    let (settled, claimed) = outbox.settle_and_claim(
        [
            (stale, Settlement::Completed),
            (
                first[0].fence(),
                Settlement::Failed {
                    reason: "timeout".into(),
                    next_attempt_at: Some(t(5)),
                },
            ),
        ],
        t(5),
        10,
        "w",
    )?;
    assert_eq!(
        store.commit_stats().durable_commits,
        before + 1,
        "one commit"
    );
    assert!(
        matches!(settled[0], Err(Error::Conflict { .. })),
        "a stale fence is refused"
    );
    assert!(settled[1].is_ok());
    // The retry is due at t(5): the claim sees it, after `b` (due at t(1)).
    assert_eq!(ids(&claimed), vec![b.0, a.0]);
    assert_eq!(claimed[1].attempt_count, 2);
    assert_eq!(outbox.get(a)?.last_failure.as_deref(), Some("timeout"));
    // Nothing to settle and nothing due: an empty step.
    let (settled, claimed) = outbox.settle_and_claim([], t(5), 10, "w")?;
    assert!(settled.is_empty() && claimed.is_empty());
    assert!(matches!(
        outbox.settle_and_claim([], t(5), 10, ""),
        Err(Error::InvalidInput { .. })
    ));
    Ok(())
}

#[test]
fn release_expired_claims_of_large_payloads_commits_a_few_mib_at_a_time() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let big = |i: usize| NewEntry::new("c", "d", format!("k{i}"), vec![7_u8; 1 << 20]);
    outbox.enqueue_many((0..10).map(big), t(0))?;
    let claimed = outbox.claim_due(t(1), 10, "w")?;
    assert_eq!(claimed.len(), 10);
    let before = store.commit_stats().commits;
    let released = outbox.release_expired_claims(t(2))?;
    let commits = store.commit_stats().commits - before;
    assert_eq!(released, claimed.iter().map(|e| e.id).collect::<Vec<_>>());
    // 10 MiB of payloads, written again: not in one transaction.
    assert!(commits >= 3, "{commits} commit(s)");
    assert_eq!(outbox.counts()?.pending, 10);
    assert_eq!(outbox.get(claimed[9].id)?.entry.payload.len(), 1 << 20);
    assert!(outbox.check_indexes()?.is_empty());
    Ok(())
}
