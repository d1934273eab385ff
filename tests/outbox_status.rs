//! Every outbox status × every operation of the status table: the result,
//! the status after, and that refused or no-op operations change nothing.
//! Only `Dispatching` holds a claim: after every operation the record's
//! claim and its claims-index row are there iff the entry is `Dispatching`.

mod common;

use common::{claims_index, t};
use idemstore::{
    Error, Fence, NewEntry, Outbox, OutboxCounts, OutboxId, OutboxRecord, OutboxStatus,
    REASON_CANCELLED, Result, Settlement, Store,
};

const CREATED: i64 = 0;
const CLAIMED: i64 = 10;
const OP_TIME: i64 = 20;
const RETRY: i64 = 500;

/// A fresh outbox holding one entry in `status`, reached the ordinary way
/// (claimed at `CLAIMED`, so at attempt 1 unless `Pending`).
fn entry_in(status: OutboxStatus) -> Result<(Store, Outbox, OutboxId)> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let id = outbox
        .enqueue(
            NewEntry::new("cmd", "dest", "key", b"payload".to_vec()),
            t(CREATED),
        )?
        .id();
    if status != OutboxStatus::Pending {
        let claimed = outbox.claim_due(t(CLAIMED), 1, "worker-a")?;
        assert_eq!(claimed.len(), 1);
    }
    match status {
        OutboxStatus::Pending | OutboxStatus::Dispatching => {}
        OutboxStatus::Completed => outbox.mark_completed(id, t(15))?,
        OutboxStatus::Failed => outbox.mark_failed(id, "gave_up", None, t(15))?,
        OutboxStatus::OutcomeUnknown => outbox.mark_outcome_unknown(id, None)?,
    }
    assert_eq!(outbox.get(id)?.entry.status, status);
    Ok((store, outbox, id))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    ClaimDue,
    MarkCompleted,
    MarkFailedRetry,
    MarkFailedFinal,
    MarkOutcomeUnknown,
    Reschedule,
    ReleaseExpired,
    Requeue,
    Cancel,
}

const OPS: [Op; 9] = [
    Op::ClaimDue,
    Op::MarkCompleted,
    Op::MarkFailedRetry,
    Op::MarkFailedFinal,
    Op::MarkOutcomeUnknown,
    Op::Reschedule,
    Op::ReleaseExpired,
    Op::Requeue,
    Op::Cancel,
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// `Ok` and the entry is now in this status.
    To(OutboxStatus),
    /// `Ok` and nothing changed ("accepted, no change", and the "—" cells).
    Unchanged,
    /// `Err(Conflict)` and nothing changed.
    Conflict,
}

/// The status table (on `OutboxStatus`), plus `requeue` and `cancel`. The
/// `Failed` entry of `entry_in` failed for another reason than a cancel
/// (see `cancelling_a_cancelled_entry_changes_nothing` for that one).
#[expect(
    clippy::match_same_arms,
    reason = "one arm per group of cells reads like the table"
)]
fn expected(from: OutboxStatus, op: Op) -> Expect {
    use Expect::{Conflict, To, Unchanged};
    use OutboxStatus::{Completed, Dispatching, Failed, OutcomeUnknown, Pending};
    match (from, op) {
        (Pending, Op::ClaimDue) => To(Dispatching),
        (Dispatching, Op::ReleaseExpired) => To(Pending),
        (_, Op::ClaimDue | Op::ReleaseExpired) => Unchanged,
        (Dispatching | OutcomeUnknown, Op::MarkCompleted) => To(Completed),
        (Completed, Op::MarkCompleted) | (Failed, Op::MarkFailedFinal) => Unchanged,
        (Pending | Dispatching | OutcomeUnknown, Op::MarkFailedRetry | Op::Reschedule) => {
            To(Pending)
        }
        (Dispatching | OutcomeUnknown, Op::MarkFailedFinal) => To(Failed),
        (Dispatching | OutcomeUnknown, Op::MarkOutcomeUnknown) => To(OutcomeUnknown),
        (Failed | OutcomeUnknown, Op::Requeue) => To(Pending),
        (Pending | OutcomeUnknown, Op::Cancel) => To(Failed),
        _ => Conflict,
    }
}

fn apply(outbox: &Outbox, id: OutboxId, op: Op) -> Result<()> {
    match op {
        Op::ClaimDue => outbox.claim_due(t(OP_TIME), 10, "worker-b").map(drop),
        Op::MarkCompleted => outbox.mark_completed(id, t(OP_TIME)),
        Op::MarkFailedRetry => outbox.mark_failed(id, "http_503", Some(t(RETRY)), t(OP_TIME)),
        Op::MarkFailedFinal => outbox.mark_failed(id, "http_400", None, t(OP_TIME)),
        Op::MarkOutcomeUnknown => outbox.mark_outcome_unknown(id, Some("remote-7")),
        Op::Reschedule => outbox.reschedule(id, t(RETRY)),
        Op::ReleaseExpired => outbox.release_expired_claims(t(OP_TIME)).map(drop),
        Op::Requeue => outbox.requeue(id, t(RETRY)),
        Op::Cancel => outbox.cancel(id, t(OP_TIME)),
    }
}

/// The fields an operation must set, beyond the status.
fn check_details(from: OutboxStatus, op: Op, before: &OutboxRecord, after: &OutboxRecord) {
    let e = &after.entry;
    let ctx = format!("{from:?} × {op:?}: {after:?}");
    assert_eq!(e.payload, before.entry.payload, "{ctx}");
    assert_eq!(e.created_at, before.entry.created_at, "{ctx}");
    match op {
        Op::ClaimDue => {
            assert_eq!(e.attempt_count, before.entry.attempt_count + 1, "{ctx}");
            let claim = after.claim.as_ref().expect("a claim");
            assert_eq!(
                (claim.worker_id.as_str(), claim.claimed_at),
                ("worker-b", t(OP_TIME))
            );
        }
        Op::MarkCompleted => {
            assert_eq!(e.completed_at, Some(t(OP_TIME)), "{ctx}");
            assert_eq!(after.claim, None, "{ctx}");
        }
        Op::MarkFailedRetry | Op::Reschedule | Op::Requeue => {
            assert_eq!(e.next_attempt_at, Some(t(RETRY)), "{ctx}");
            assert_eq!(e.completed_at, None, "{ctx}");
            assert_eq!(after.claim, None, "{ctx}");
            if op == Op::MarkFailedRetry {
                assert_eq!(after.last_failure.as_deref(), Some("http_503"), "{ctx}");
            } else {
                assert_eq!(after.last_failure, before.last_failure, "{ctx}");
            }
        }
        Op::MarkFailedFinal => {
            assert_eq!(e.completed_at, Some(t(OP_TIME)), "{ctx}");
            assert_eq!(after.last_failure.as_deref(), Some("http_400"), "{ctx}");
        }
        Op::MarkOutcomeUnknown => {
            assert_eq!(after.remote_ref.as_deref(), Some("remote-7"), "{ctx}");
            // The claim ends; who made the attempt, and when, stays as the
            // attempt in doubt.
            let attempt = before.claim.as_ref().or(before.attempt_in_doubt.as_ref());
            assert_eq!(after.attempt_in_doubt.as_ref(), attempt, "{ctx}");
            assert_eq!(
                attempt.map(|a| (a.worker_id.as_str(), a.claimed_at)),
                Some(("worker-a", t(CLAIMED))),
                "{ctx}"
            );
        }
        Op::ReleaseExpired => {
            // Due again at once: at its claim time.
            assert_eq!(e.next_attempt_at, Some(t(CLAIMED)), "{ctx}");
            assert_eq!(after.claim, None, "{ctx}");
        }
        Op::Cancel => {
            assert_eq!(e.completed_at, Some(t(OP_TIME)), "{ctx}");
            assert_eq!(e.next_attempt_at, None, "{ctx}");
            assert_eq!(
                after.last_failure.as_deref(),
                Some(REASON_CANCELLED),
                "{ctx}"
            );
            assert_eq!(after.remote_ref, before.remote_ref, "{ctx}");
            let added = after.attempts.last().expect("the cancel's attempt record");
            assert_eq!(
                (added.attempt, added.at, added.reason.as_str()),
                (before.entry.attempt_count, t(OP_TIME), REASON_CANCELLED),
                "{ctx}"
            );
        }
    }
    // The operations that end an attempt without completing it, and have a
    // time, add one attempt record; the others none.
    let adds_attempt = matches!(op, Op::MarkFailedRetry | Op::MarkFailedFinal | Op::Cancel);
    assert_eq!(
        after.attempts.len(),
        before.attempts.len() + usize::from(adds_attempt),
        "{ctx}"
    );
    assert_eq!(
        after.attempts[..before.attempts.len()],
        before.attempts[..],
        "{ctx}: earlier attempt records stay"
    );
    if op != Op::ClaimDue {
        assert_eq!(e.attempt_count, before.entry.attempt_count, "{ctx}");
    }
}

/// Only `Dispatching` holds a claim, and only a `Dispatching` entry has a
/// claims-index row; only `OutcomeUnknown` has an attempt in doubt.
fn check_claim(store: &Store, rec: &OutboxRecord, ctx: &str) -> Result<()> {
    let id = rec.entry.id.0;
    let rows = claims_index(store)?;
    match rec.entry.status {
        OutboxStatus::Dispatching => {
            let claim = rec.claim.as_ref().expect("a Dispatching entry's claim");
            assert_eq!(
                rows,
                vec![(claim.claimed_at.timestamp_micros(), id)],
                "{ctx}: its claims-index row"
            );
            assert_eq!(rec.attempt_in_doubt, None, "{ctx}");
        }
        status => {
            assert_eq!(rec.claim, None, "{ctx}: only Dispatching holds a claim");
            assert_eq!(rows, Vec::new(), "{ctx}: no claims-index row");
            assert_eq!(
                rec.attempt_in_doubt.is_some(),
                status == OutboxStatus::OutcomeUnknown,
                "{ctx}"
            );
        }
    }
    Ok(())
}

#[test]
fn every_operation_in_every_status_follows_the_transition_table() -> Result<()> {
    for from in OutboxStatus::ALL {
        for op in OPS {
            let (store, outbox, id) = entry_in(from)?;
            let before = outbox.get(id)?;
            check_claim(&store, &before, &format!("{from:?}"))?;
            let result = apply(&outbox, id, op);
            let after = outbox.get(id)?;
            check_claim(&store, &after, &format!("{from:?} × {op:?}"))?;
            let expect = expected(from, op);
            match expect {
                Expect::To(to) => {
                    result.unwrap_or_else(|e| panic!("{from:?} × {op:?}: {e}"));
                    assert_eq!(after.entry.status, to, "{from:?} × {op:?}");
                    assert!(from.can_transition(to), "{from:?} → {to:?} is an edge");
                    check_details(from, op, &before, &after);
                }
                Expect::Unchanged => {
                    result.unwrap_or_else(|e| panic!("{from:?} × {op:?}: {e}"));
                    assert_eq!(after, before, "{from:?} × {op:?} changes nothing");
                }
                Expect::Conflict => {
                    assert!(
                        matches!(result, Err(Error::Conflict { .. })),
                        "{from:?} × {op:?}: {result:?}"
                    );
                    assert_eq!(after, before, "{from:?} × {op:?} refused, nothing changed");
                }
            }
            assert_eq!(
                outbox.check_indexes()?,
                Vec::<String>::new(),
                "{from:?} × {op:?}"
            );
        }
    }
    Ok(())
}

#[test]
fn can_transition_is_exactly_the_tables_edges() {
    use OutboxStatus::{Completed, Dispatching, Failed, OutcomeUnknown, Pending};
    let edges = [
        (Pending, Pending),
        (Pending, Dispatching),
        (Dispatching, Pending),
        (Dispatching, Completed),
        (Dispatching, Failed),
        (Dispatching, OutcomeUnknown),
        (OutcomeUnknown, Pending),
        (OutcomeUnknown, Completed),
        (OutcomeUnknown, Failed),
        (OutcomeUnknown, OutcomeUnknown),
        (Failed, Pending),
        (Pending, Failed),
    ];
    for from in OutboxStatus::ALL {
        for to in OutboxStatus::ALL {
            assert_eq!(
                from.can_transition(to),
                edges.contains(&(from, to)),
                "{from:?} → {to:?}"
            );
        }
    }
}

#[test]
fn release_expired_claims_never_touches_an_outcome_unknown_entry() -> Result<()> {
    let (store, outbox, unknown) = entry_in(OutboxStatus::OutcomeUnknown)?;
    let before = outbox.get(unknown)?;
    // Another entry, claimed later than the one in doubt.
    let live = outbox
        .enqueue(NewEntry::new("cmd", "dest", "key-2", b"p".to_vec()), t(0))?
        .id();
    assert_eq!(ids(&outbox.claim_due(t(30), 10, "worker-c")?), vec![live]);
    assert_eq!(outbox.oldest_claim()?, Some(t(30)), "the live claim only");
    assert_eq!(
        claims_index(&store)?,
        vec![(t(30).timestamp_micros(), live.0)]
    );
    // However late the cutoff, only the live claim is released.
    for cutoff in [t(CLAIMED + 1), t(31), t(1_000_000)] {
        let released = outbox.release_expired_claims(cutoff)?;
        assert!(
            released.iter().all(|id| *id != unknown),
            "cutoff {cutoff}: {released:?}"
        );
        assert_eq!(outbox.get(unknown)?, before, "cutoff {cutoff}");
    }
    assert_eq!(outbox.get(live)?.entry.status, OutboxStatus::Pending);
    assert_eq!(claims_index(&store)?, Vec::new());
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    Ok(())
}

fn ids(entries: &[idemstore::OutboxEntry]) -> Vec<OutboxId> {
    entries.iter().map(|e| e.id).collect()
}

#[test]
fn outcome_unknown_fills_a_missing_remote_ref_once() -> Result<()> {
    let (_store, outbox, id) = entry_in(OutboxStatus::OutcomeUnknown)?;
    assert_eq!(outbox.get(id)?.remote_ref, None);
    outbox.mark_outcome_unknown(id, None)?;
    assert_eq!(outbox.get(id)?.remote_ref, None);
    outbox.mark_outcome_unknown(id, Some("first"))?;
    outbox.mark_outcome_unknown(id, Some("second"))?;
    let rec = outbox.get(id)?;
    assert_eq!(rec.remote_ref.as_deref(), Some("first"));
    assert_eq!(rec.entry.status, OutboxStatus::OutcomeUnknown);
    Ok(())
}

#[test]
fn mark_failed_with_a_retry_time_delays_the_entry_and_keeps_its_reason() -> Result<()> {
    let (_store, outbox, id) = entry_in(OutboxStatus::Pending)?;
    outbox.mark_failed(id, "rate_limited", Some(t(60)), t(1))?;
    let rec = outbox.get(id)?;
    assert_eq!(rec.entry.status, OutboxStatus::Pending);
    assert_eq!(rec.entry.next_attempt_at, Some(t(60)));
    assert_eq!(rec.last_failure.as_deref(), Some("rate_limited"));
    assert!(
        outbox.claim_due(t(59), 1, "w")?.is_empty(),
        "not due before the retry time"
    );
    let claimed = outbox.claim_due(t(60), 1, "w")?;
    assert_eq!(claimed[0].id, id);
    assert_eq!(
        outbox.get(id)?.last_failure.as_deref(),
        Some("rate_limited")
    );
    Ok(())
}

/// A settlement carrying `fence` applied in each status, at the right and
/// at stale attempts.
#[test]
fn fenced_settlements_follow_the_table_only_while_holding_the_attempt() -> Result<()> {
    let settlements = [
        Settlement::Completed,
        Settlement::Failed {
            reason: "http_503".into(),
            next_attempt_at: Some(t(RETRY)),
        },
        Settlement::Failed {
            reason: "http_400".into(),
            next_attempt_at: None,
        },
        Settlement::OutcomeUnknown {
            remote_ref: Some("remote-7".into()),
        },
        Settlement::Rescheduled {
            next_attempt_at: t(RETRY),
        },
    ];
    for from in OutboxStatus::ALL {
        for s in &settlements {
            for attempt in [0, 1, 2] {
                let (store, outbox, id) = entry_in(from)?;
                let before = outbox.get(id)?;
                let result = outbox.settle(Fence { id, attempt }, s.clone(), t(OP_TIME));
                let after = outbox.get(id)?;
                let holds = attempt == 1
                    && matches!(
                        from,
                        OutboxStatus::Dispatching | OutboxStatus::OutcomeUnknown
                    );
                let repeat = attempt == 1
                    && matches!(
                        (from, s),
                        (OutboxStatus::Completed, Settlement::Completed)
                            | (
                                OutboxStatus::Failed,
                                Settlement::Failed {
                                    next_attempt_at: None,
                                    ..
                                }
                            )
                    );
                let ctx = format!("{from:?} × {s:?} at attempt {attempt}: {result:?}");
                if holds {
                    result.unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    assert_ne!(after, before, "{ctx}");
                } else if repeat {
                    result.unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    assert_eq!(after, before, "{ctx}");
                } else {
                    assert!(matches!(result, Err(Error::Conflict { .. })), "{ctx}");
                    assert_eq!(after, before, "{ctx}");
                }
                check_claim(&store, &after, &ctx)?;
                assert!(outbox.check_indexes()?.is_empty(), "{ctx}");
            }
        }
    }
    Ok(())
}

#[test]
fn unknown_ids_are_not_found() -> Result<()> {
    let (_store, outbox, id) = entry_in(OutboxStatus::Dispatching)?;
    let ghost = OutboxId(id.0 + 100);
    let now = t(OP_TIME);
    let results = [
        outbox.get(ghost).map(drop),
        outbox.mark_completed(ghost, now),
        outbox.mark_failed(ghost, "x", None, now),
        outbox.mark_outcome_unknown(ghost, None),
        outbox.reschedule(ghost, now),
        outbox.requeue(ghost, now),
        outbox.cancel(ghost, now),
        outbox.settle(
            Fence {
                id: ghost,
                attempt: 1,
            },
            Settlement::Completed,
            now,
        ),
    ];
    for r in results {
        assert!(matches!(r, Err(Error::NotFound)), "{r:?}");
    }
    Ok(())
}

#[test]
fn cancelling_a_cancelled_entry_changes_nothing() -> Result<()> {
    for from in [OutboxStatus::Pending, OutboxStatus::OutcomeUnknown] {
        let (_store, outbox, id) = entry_in(from)?;
        outbox.cancel(id, t(OP_TIME))?;
        let cancelled = outbox.get(id)?;
        assert_eq!(cancelled.entry.status, OutboxStatus::Failed, "{from:?}");
        let counts = outbox.counts()?;
        // Again, later: accepted, and nothing moves (not even the time).
        outbox.cancel(id, t(OP_TIME + 100))?;
        assert_eq!(outbox.get(id)?, cancelled, "{from:?}");
        assert_eq!(outbox.counts()?, counts, "{from:?}");
        // A final failure on it is the table's accepted no-op too.
        outbox.mark_failed(id, "http_400", None, t(OP_TIME + 200))?;
        assert_eq!(outbox.get(id)?, cancelled, "{from:?}");
        assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    }
    Ok(())
}

#[test]
fn a_cancelled_entry_leaves_the_due_index_counts_as_failed_and_wakes_nobody() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let later = outbox
        .enqueue(
            NewEntry::new("cmd", "dest", "later", b"p".to_vec()).not_before(t(50)),
            t(CREATED),
        )?
        .id();
    let soon = outbox
        .enqueue(
            NewEntry::new("cmd", "dest", "soon", b"p".to_vec()),
            t(CREATED),
        )?
        .id();
    assert_eq!(outbox.next_due()?, Some(t(CREATED)));
    let wake = outbox.subscribe();
    outbox.cancel(soon, t(OP_TIME))?;
    assert!(wake.try_recv().is_err(), "a cancel makes nothing due");
    assert_eq!(
        outbox.next_due()?,
        Some(t(50)),
        "only the other entry is due"
    );
    let mut want = OutboxCounts::default();
    (want.pending, want.failed) = (1, 1);
    assert_eq!(outbox.counts()?, want);
    // However late, a claim never takes the cancelled entry.
    let claimed = outbox.claim_due(t(1_000), 10, "worker")?;
    assert_eq!(ids(&claimed), vec![later]);
    // It is finished: purged with the others once old enough.
    assert_eq!(outbox.purge_finished(t(OP_TIME + 1))?, 1);
    assert!(matches!(outbox.get(soon), Err(Error::NotFound)));
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    Ok(())
}

#[test]
fn a_dispatching_entry_must_be_settled_before_it_is_cancelled() -> Result<()> {
    let (_store, outbox, id) = entry_in(OutboxStatus::Dispatching)?;
    let err = outbox.cancel(id, t(OP_TIME)).unwrap_err();
    assert!(
        matches!(&err, Error::Conflict { .. }) && err.to_string().contains("settled"),
        "{err}"
    );
    // Once its attempt ends in doubt, the entry can be cancelled.
    outbox.settle(
        Fence { id, attempt: 1 },
        Settlement::OutcomeUnknown { remote_ref: None },
        t(OP_TIME),
    )?;
    outbox.cancel(id, t(OP_TIME + 1))?;
    let rec = outbox.get(id)?;
    assert_eq!(rec.entry.status, OutboxStatus::Failed);
    assert_eq!(rec.last_failure.as_deref(), Some(REASON_CANCELLED));
    assert_eq!(rec.attempt_in_doubt, None);
    Ok(())
}
