//! The outbox's contract: enqueue and duplicates, due order, claimers that
//! never share, every cell of the status table, fencing, bulk settles,
//! retention, attempt history, inspection, wake-ups, bad input.

macro_rules! outbox_contract {
    () => {
        mod outbox {
            use std::collections::BTreeSet;
            use std::time::Duration;

            use idemstore::{
                Enqueued, Error, Fence, NewEntry, OutboxEntry, OutboxFilter, OutboxId,
                OutboxRecord, OutboxStatus, REASON_CANCELLED, Settlement,
            };

            use super::*;

            const CREATED: i64 = 0;
            const CLAIMED: i64 = 10;
            const OP_TIME: i64 = 20;
            const RETRY: i64 = 500;

            fn ids(entries: &[OutboxEntry]) -> Vec<OutboxId> {
                entries.iter().map(|e| e.id).collect()
            }

            /// A fresh store whose outbox holds one entry in `status`,
            /// reached the ordinary way (claimed at `CLAIMED`, so at attempt
            /// 1 unless `Pending`).
            fn entry_in(status: OutboxStatus) -> Option<(Fixture, Ob, OutboxId)> {
                let f = Fixture::open()?;
                let outbox = f.store.outbox();
                let id = outbox
                    .enqueue(entry("cmd", "dest", "key"), t(CREATED))
                    .unwrap()
                    .id();
                if status != OutboxStatus::Pending {
                    assert_eq!(
                        ids(&outbox.claim_due(t(CLAIMED), 1, "worker-a").unwrap()),
                        [id]
                    );
                }
                match status {
                    OutboxStatus::Pending | OutboxStatus::Dispatching => {}
                    OutboxStatus::Completed => outbox.mark_completed(id, t(15)).unwrap(),
                    OutboxStatus::Failed => outbox.mark_failed(id, "gave_up", None, t(15)).unwrap(),
                    OutboxStatus::OutcomeUnknown => outbox.mark_outcome_unknown(id, None).unwrap(),
                }
                assert_eq!(outbox.get(id).unwrap().entry.status, status);
                Some((f, outbox, id))
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
                /// `Ok` and nothing changed.
                Unchanged,
                /// `Err(Conflict)` and nothing changed.
                Conflict,
            }

            /// The status table, with `requeue` and `cancel`.
            fn expected(from: OutboxStatus, op: Op) -> Expect {
                use Expect::{Conflict, To, Unchanged};
                use OutboxStatus::{Completed, Dispatching, Failed, OutcomeUnknown, Pending};
                match (from, op) {
                    (Pending, Op::ClaimDue) => To(Dispatching),
                    (Dispatching, Op::ReleaseExpired) => To(Pending),
                    (_, Op::ClaimDue | Op::ReleaseExpired) => Unchanged,
                    (Dispatching | OutcomeUnknown, Op::MarkCompleted) => To(Completed),
                    (Completed, Op::MarkCompleted) | (Failed, Op::MarkFailedFinal) => Unchanged,
                    (
                        Pending | Dispatching | OutcomeUnknown,
                        Op::MarkFailedRetry | Op::Reschedule,
                    ) => To(Pending),
                    (Dispatching | OutcomeUnknown, Op::MarkFailedFinal) => To(Failed),
                    (Dispatching | OutcomeUnknown, Op::MarkOutcomeUnknown) => To(OutcomeUnknown),
                    (Failed | OutcomeUnknown, Op::Requeue) => To(Pending),
                    (Pending | OutcomeUnknown, Op::Cancel) => To(Failed),
                    _ => Conflict,
                }
            }

            fn apply(outbox: &Ob, id: OutboxId, op: Op) -> idemstore::Result<()> {
                match op {
                    Op::ClaimDue => outbox.claim_due(t(OP_TIME), 10, "worker-b").map(drop),
                    Op::MarkCompleted => outbox.mark_completed(id, t(OP_TIME)),
                    Op::MarkFailedRetry => {
                        outbox.mark_failed(id, "http_503 (busy)", Some(t(RETRY)), t(OP_TIME))
                    }
                    Op::MarkFailedFinal => outbox.mark_failed(id, "http_400", None, t(OP_TIME)),
                    Op::MarkOutcomeUnknown => outbox.mark_outcome_unknown(id, Some("remote-7")),
                    Op::Reschedule => outbox.reschedule(id, t(RETRY)),
                    Op::ReleaseExpired => outbox.release_expired_claims(t(OP_TIME)).map(drop),
                    Op::Requeue => outbox.requeue(id, t(RETRY)),
                    Op::Cancel => outbox.cancel(id, t(OP_TIME)),
                }
            }

            /// The fields an operation sets, beyond the status.
            fn check_details(
                from: OutboxStatus,
                op: Op,
                before: &OutboxRecord,
                after: &OutboxRecord,
            ) {
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
                        assert_eq!(e.next_attempt_at, None, "{ctx}");
                    }
                    Op::MarkFailedRetry | Op::Reschedule | Op::Requeue => {
                        assert_eq!(e.next_attempt_at, Some(t(RETRY)), "{ctx}");
                        assert_eq!(e.completed_at, None, "{ctx}");
                        if op == Op::MarkFailedRetry {
                            assert_eq!(
                                after.last_failure.as_deref(),
                                Some("http_503"),
                                "{ctx}: the code"
                            );
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
                        let attempt = before.claim.as_ref().or(before.attempt_in_doubt.as_ref());
                        assert_eq!(after.attempt_in_doubt.as_ref(), attempt, "{ctx}");
                        assert_eq!(
                            attempt.map(|a| (a.worker_id.as_str(), a.claimed_at)),
                            Some(("worker-a", t(CLAIMED))),
                            "{ctx}"
                        );
                    }
                    Op::ReleaseExpired => {
                        assert_eq!(
                            e.next_attempt_at,
                            Some(t(CLAIMED)),
                            "{ctx}: due at its claim time"
                        );
                    }
                    Op::Cancel => {
                        assert_eq!(e.completed_at, Some(t(OP_TIME)), "{ctx}");
                        assert_eq!(e.next_attempt_at, None, "{ctx}");
                        assert_eq!(
                            after.last_failure.as_deref(),
                            Some(REASON_CANCELLED),
                            "{ctx}"
                        );
                        let added = after.attempts.last().expect("the cancel's attempt record");
                        assert_eq!(
                            (added.attempt, added.at, added.reason.as_str()),
                            (before.entry.attempt_count, t(OP_TIME), REASON_CANCELLED),
                            "{ctx}"
                        );
                    }
                }
                let adds_attempt =
                    matches!(op, Op::MarkFailedRetry | Op::MarkFailedFinal | Op::Cancel);
                assert_eq!(
                    after.attempts.len(),
                    before.attempts.len() + usize::from(adds_attempt),
                    "{ctx}"
                );
                assert_eq!(
                    after.attempts[..before.attempts.len()],
                    before.attempts[..],
                    "{ctx}"
                );
                if op == Op::MarkFailedRetry || op == Op::MarkFailedFinal {
                    let added = after.attempts.last().expect("the failure's attempt record");
                    assert_eq!(added.at, t(OP_TIME), "{ctx}");
                    assert!(added.reason.starts_with("http_"), "{ctx}: the whole reason");
                }
                if op != Op::ClaimDue {
                    assert_eq!(e.attempt_count, before.entry.attempt_count, "{ctx}");
                }
            }

            /// Only `Dispatching` holds a claim; only `OutcomeUnknown` has an
            /// attempt in doubt.
            fn check_claim(rec: &OutboxRecord, ctx: &str) {
                let dispatching = rec.entry.status == OutboxStatus::Dispatching;
                assert_eq!(rec.claim.is_some(), dispatching, "{ctx}: {rec:?}");
                assert_eq!(
                    rec.attempt_in_doubt.is_some(),
                    rec.entry.status == OutboxStatus::OutcomeUnknown,
                    "{ctx}: {rec:?}"
                );
            }

            #[test]
            fn every_operation_in_every_status_follows_the_table() -> TestResult {
                for from in OutboxStatus::ALL {
                    for op in OPS {
                        let Some((f, outbox, id)) = entry_in(from) else {
                            return Ok(());
                        };
                        let before = outbox.get(id)?;
                        check_claim(&before, &format!("{from:?}"));
                        let result = apply(&outbox, id, op);
                        let after = outbox.get(id)?;
                        check_claim(&after, &format!("{from:?} × {op:?}"));
                        match expected(from, op) {
                            Expect::To(to) => {
                                result.unwrap_or_else(|e| panic!("{from:?} × {op:?}: {e}"));
                                assert_eq!(after.entry.status, to, "{from:?} × {op:?}");
                                assert!(from.can_transition(to), "{from:?} → {to:?}");
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
                                assert_eq!(
                                    after, before,
                                    "{from:?} × {op:?}: refused, nothing changed"
                                );
                            }
                        }
                        assert_eq!(
                            outbox.check_indexes()?,
                            Vec::<String>::new(),
                            "{from:?} × {op:?}"
                        );
                        drop(f);
                    }
                }
                Ok(())
            }

            #[test]
            fn fenced_settlements_apply_only_while_holding_the_attempt() -> TestResult {
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
                            let Some((f, outbox, id)) = entry_in(from) else {
                                return Ok(());
                            };
                            let before = outbox.get(id)?;
                            let result =
                                outbox.settle(Fence { id, attempt }, s.clone(), t(OP_TIME));
                            let after = outbox.get(id)?;
                            let ctx = format!("{from:?} × {s:?} at attempt {attempt}");
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
                            if holds {
                                result.unwrap_or_else(|e| panic!("{ctx}: {e}"));
                                assert_ne!(after, before, "{ctx}");
                                let to = match s {
                                    Settlement::Completed => OutboxStatus::Completed,
                                    Settlement::Failed {
                                        next_attempt_at: Some(_),
                                        ..
                                    }
                                    | Settlement::Rescheduled { .. }
                                    | Settlement::Throttled { .. } => OutboxStatus::Pending,
                                    Settlement::Failed {
                                        next_attempt_at: None,
                                        ..
                                    } => OutboxStatus::Failed,
                                    Settlement::OutcomeUnknown { .. } => {
                                        OutboxStatus::OutcomeUnknown
                                    }
                                    other => panic!(
                                        "{ctx}: a settlement this test does not know: {other:?}"
                                    ),
                                };
                                assert_eq!(after.entry.status, to, "{ctx}");
                            } else if repeat {
                                result.unwrap_or_else(|e| panic!("{ctx}: {e}"));
                                assert_eq!(after, before, "{ctx}: accepted, no change");
                            } else {
                                assert!(
                                    matches!(result, Err(Error::Conflict { .. })),
                                    "{ctx}: {result:?}"
                                );
                                assert_eq!(after, before, "{ctx}: refused, nothing changed");
                            }
                            check_claim(&after, &ctx);
                            drop(f);
                        }
                    }
                }
                Ok(())
            }

            #[test]
            fn claim_due_and_release_touch_only_their_status() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                // One entry in each status; the pending one, made last (so
                // that no claim above takes it), due at CREATED.
                let order = [
                    OutboxStatus::Dispatching,
                    OutboxStatus::Completed,
                    OutboxStatus::Failed,
                    OutboxStatus::OutcomeUnknown,
                    OutboxStatus::Pending,
                ];
                let mut by_status = Vec::new();
                for (i, status) in order.into_iter().enumerate() {
                    let id = outbox
                        .enqueue(entry("cmd", "dest", &format!("k{i}")), t(CREATED))?
                        .id();
                    if status != OutboxStatus::Pending {
                        assert_eq!(ids(&outbox.claim_due(t(CLAIMED), 1, "worker-a")?), [id]);
                    }
                    match status {
                        OutboxStatus::Completed => outbox.mark_completed(id, t(15))?,
                        OutboxStatus::Failed => outbox.mark_failed(id, "gave_up", None, t(15))?,
                        OutboxStatus::OutcomeUnknown => outbox.mark_outcome_unknown(id, None)?,
                        _ => {}
                    }
                    by_status.push((status, id));
                }
                let dispatching = by_status[0].1;
                let pending = by_status[4].1;
                // Releasing: only the Dispatching entry, however late the cutoff.
                assert_eq!(
                    outbox.release_expired_claims(t(CLAIMED))?,
                    [],
                    "claimed at, not before"
                );
                assert_eq!(outbox.release_expired_claims(t(1_000_000))?, [dispatching]);
                assert_eq!(
                    outbox.get(dispatching)?.entry.next_attempt_at,
                    Some(t(CLAIMED))
                );
                // Claiming: the two Pending entries, earliest due first.
                let claimed = outbox.claim_due(t(OP_TIME), 10, "worker-b")?;
                assert_eq!(ids(&claimed), [pending, dispatching]);
                for (status, id) in &by_status[1..4] {
                    assert_eq!(outbox.get(*id)?.entry.status, *status, "untouched");
                }
                Ok(())
            }

            #[test]
            fn enqueue_assigns_increasing_ids_and_a_duplicate_changes_nothing() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let a = outbox.enqueue(entry("cmd-1", "mailer", "k1"), t(0))?;
                let b = outbox.enqueue(entry("cmd-1", "mailer", "k2"), t(1))?;
                let (Enqueued::New(a), Enqueued::New(b)) = (a, b) else {
                    panic!("{a:?} {b:?}");
                };
                assert!(b > a, "{a} < {b}");
                let mut again = entry("cmd-2", "mailer", "k1");
                again.payload = b"other".to_vec();
                assert_eq!(outbox.enqueue(again, t(5))?, Enqueued::Duplicate(a));
                let rec = outbox.get(a)?;
                assert_eq!(rec.entry.payload, b"payload of k1");
                assert_eq!(rec.entry.command_id, "cmd-1");
                assert_eq!(rec.entry.created_at, t(0));
                assert_eq!(rec.entry.status, OutboxStatus::Pending);
                assert_eq!(rec.entry.attempt_count, 0);
                assert_eq!(rec.entry.next_attempt_at, None);
                // Another destination, same key: a new entry.
                assert!(outbox.enqueue(entry("cmd-1", "sms", "k1"), t(0))?.is_new());
                assert_eq!(outbox.find("mailer", "k1")?.map(|r| r.entry.id), Some(a));
                assert_eq!(outbox.find("mailer", "nope")?, None);
                let many = outbox.enqueue_many(
                    [
                        entry("c", "d", "x"),
                        entry("c", "d", "x"),
                        entry("c", "mailer", "k2"),
                    ],
                    t(2),
                )?;
                assert!(many[0].is_new());
                assert_eq!(
                    many[1],
                    Enqueued::Duplicate(many[0].id()),
                    "a repeat within the batch"
                );
                assert_eq!(many[2], Enqueued::Duplicate(b));
                assert_eq!(outbox.counts()?.pending, 4);
                Ok(())
            }

            #[test]
            fn enqueue_in_commits_with_the_callers_write_or_not_at_all() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let out = f.store.write(|tx| {
                    assert!(
                        outbox
                            .enqueue_in(tx, entry("order-1", "mailer", "receipt"), t(0))?
                            .is_new()
                    );
                    f.mark(tx, "order-1")?;
                    Err::<(), _>(AppError::Refused)
                });
                assert!(matches!(out, Err(AppError::Refused)));
                assert_eq!(outbox.find("mailer", "receipt")?, None);
                assert_eq!(f.marks()?, Vec::<String>::new());
                let (first, again) = f.store.write(|tx| {
                    let first =
                        outbox.enqueue_in(tx, entry("order-1", "mailer", "receipt"), t(1))?;
                    let again =
                        outbox.enqueue_in(tx, entry("order-1", "mailer", "receipt"), t(1))?;
                    f.mark(tx, "order-1")?;
                    Ok::<_, Error>((first, again))
                })?;
                assert!(first.is_new());
                assert_eq!(
                    again,
                    Enqueued::Duplicate(first.id()),
                    "the transaction sees its own entry"
                );
                assert_eq!(outbox.get(first.id())?.entry.created_at, t(1));
                assert_eq!(f.marks()?, vec!["order-1".to_owned()]);
                Ok(())
            }

            #[test]
            fn claim_due_takes_due_entries_earliest_due_first_then_by_id() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let later = outbox
                    .enqueue(entry("c", "d", "later").not_before(t(105)), t(100))?
                    .id();
                let b = outbox.enqueue(entry("c", "d", "b"), t(100))?.id();
                let early = outbox
                    .enqueue(entry("c", "d", "early").not_before(t(90)), t(100))?
                    .id();
                let d = outbox.enqueue(entry("c", "d", "d"), t(100))?.id();
                assert_eq!(outbox.next_due()?, Some(t(90)));
                assert_eq!(outbox.get(later)?.entry.next_attempt_at, Some(t(105)));
                let claimed = outbox.claim_due(t(100), 10, "w1")?;
                assert_eq!(ids(&claimed), [early, b, d], "not yet due: {later}");
                for e in &claimed {
                    let rec = outbox.get(e.id)?;
                    assert_eq!(&rec.entry, e, "claim_due returns what get returns");
                    assert_eq!(e.status, OutboxStatus::Dispatching);
                    assert_eq!(e.attempt_count, 1);
                    let claim = rec.claim.expect("claimed");
                    assert_eq!((claim.worker_id.as_str(), claim.claimed_at), ("w1", t(100)));
                }
                assert_eq!(outbox.oldest_claim()?, Some(t(100)));
                assert_eq!(outbox.claim_due(t(104), 10, "w2")?, []);
                assert_eq!(ids(&outbox.claim_due(t(105), 10, "w2")?), [later]);
                assert_eq!(outbox.next_due()?, None);
                assert_eq!(outbox.claim_due(t(200), 0, "w3")?, []);
                Ok(())
            }

            #[test]
            fn concurrent_claimers_never_share_an_entry() -> TestResult {
                const ENTRIES: usize = 120;
                let f = fixture!();
                let outbox = f.store.outbox();
                let all: BTreeSet<OutboxId> = outbox
                    .enqueue_many(
                        (0..ENTRIES).map(|i| entry("c", "d", &format!("k{i}"))),
                        t(0),
                    )?
                    .into_iter()
                    .map(|e| e.id())
                    .collect();
                let claimed = std::thread::scope(|s| {
                    let handles: Vec<_> = (0..4)
                        .map(|w| {
                            let store = f.another();
                            s.spawn(move || -> Result<Vec<OutboxId>, Error> {
                                let outbox = store.outbox();
                                let mut mine = Vec::new();
                                loop {
                                    let got = outbox.claim_due(t(1), 3, &format!("w{w}"))?;
                                    if got.is_empty() {
                                        return Ok(mine);
                                    }
                                    mine.extend(ids(&got));
                                }
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().expect("no panic"))
                        .collect::<Result<Vec<_>, _>>()
                })?;
                let flat: Vec<OutboxId> = claimed.into_iter().flatten().collect();
                let unique: BTreeSet<OutboxId> = flat.iter().copied().collect();
                assert_eq!(flat.len(), unique.len(), "an entry was claimed twice");
                assert_eq!(unique, all);
                assert_eq!(outbox.counts()?.dispatching, ENTRIES as u64);
                Ok(())
            }

            #[test]
            fn a_released_claim_fences_out_its_old_holder() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let id = outbox.enqueue(entry("c", "d", "k"), t(0))?.id();
                let first = outbox.claim_due(t(1), 1, "crashed")?[0].fence();
                assert_eq!(first, Fence { id, attempt: 1 });
                assert_eq!(outbox.release_expired_claims(t(2))?, [id]);
                let second = outbox.claim_due(t(3), 1, "alive")?[0].fence();
                assert_eq!(second.attempt, 2);
                for s in [
                    Settlement::Completed,
                    Settlement::Rescheduled {
                        next_attempt_at: t(9),
                    },
                ] {
                    assert!(matches!(
                        outbox.settle(first, s, t(4)),
                        Err(Error::Conflict { .. })
                    ));
                }
                let rec = outbox.get(id)?;
                assert_eq!(rec.entry.status, OutboxStatus::Dispatching);
                assert_eq!(rec.claim.map(|c| c.worker_id), Some("alive".to_owned()));
                outbox.settle(second, Settlement::Completed, t(5))?;
                outbox.settle(second, Settlement::Completed, t(6))?;
                assert_eq!(
                    outbox.get(id)?.entry.completed_at,
                    Some(t(5)),
                    "a repeat changes nothing"
                );
                assert!(matches!(
                    outbox.settle(
                        second,
                        Settlement::Failed {
                            reason: "late".into(),
                            next_attempt_at: None
                        },
                        t(7)
                    ),
                    Err(Error::Conflict { .. })
                ));
                let gone = Fence {
                    id: OutboxId(id.0 + 1000),
                    attempt: 1,
                };
                assert!(matches!(
                    outbox.settle(gone, Settlement::Completed, t(8)),
                    Err(Error::NotFound)
                ));
                // In the caller's transaction, with its own writes.
                let id2 = outbox.enqueue(entry("c", "d", "k2"), t(10))?.id();
                let fence = outbox.claim_due(t(11), 1, "w")?[0].fence();
                assert_eq!(fence.id, id2);
                f.store.write(|tx| {
                    outbox.settle_in(tx, fence, &Settlement::Completed, t(12))?;
                    f.mark(tx, "sent")
                })?;
                assert_eq!(outbox.get(id2)?.entry.status, OutboxStatus::Completed);
                assert_eq!(f.marks()?, vec!["sent".to_owned()]);
                Ok(())
            }

            #[test]
            fn bulk_settles_answer_each_settlement_and_claim_what_they_freed() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let ids_ =
                    outbox.enqueue_many((0..3).map(|i| entry("c", "d", &format!("k{i}"))), t(0))?;
                let claimed = outbox.claim_due(t(1), 3, "w")?;
                assert_eq!(claimed.len(), 3);
                let stale = Fence {
                    id: claimed[0].id,
                    attempt: 7,
                };
                let gone = Fence {
                    id: OutboxId(ids_[2].id().0 + 100),
                    attempt: 1,
                };
                let retry = Settlement::Failed {
                    reason: "http_503".into(),
                    next_attempt_at: Some(t(2)),
                };
                let answers = outbox.settle_many(
                    [
                        (claimed[0].fence(), Settlement::Completed),
                        (stale, Settlement::Completed),
                        (gone, Settlement::Completed),
                        (claimed[1].fence(), retry.clone()),
                    ],
                    t(2),
                )?;
                assert!(answers[0].is_ok());
                assert!(
                    matches!(answers[1], Err(Error::Conflict { .. })),
                    "{answers:?}"
                );
                assert!(matches!(answers[2], Err(Error::NotFound)), "{answers:?}");
                assert!(answers[3].is_ok());
                assert_eq!(outbox.settle_many(Vec::new(), t(2))?.len(), 0);
                // Settle the last one and claim the retry in one step.
                let (settled, next) = outbox.settle_and_claim(
                    [
                        (claimed[2].fence(), Settlement::Completed),
                        (claimed[1].fence(), retry),
                    ],
                    t(3),
                    10,
                    "w",
                )?;
                assert!(settled[0].is_ok());
                assert!(
                    matches!(settled[1], Err(Error::Conflict { .. })),
                    "settled already"
                );
                assert_eq!(ids(&next), [claimed[1].id], "the retry, due again");
                assert_eq!(next[0].attempt_count, 2);
                let counts = outbox.counts()?;
                assert_eq!(
                    (counts.completed, counts.dispatching, counts.total()),
                    (2, 1, 3)
                );
                Ok(())
            }

            #[test]
            fn purge_finished_removes_finished_entries_before_the_cutoff() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let e =
                    outbox.enqueue_many((0..4).map(|i| entry("c", "d", &format!("k{i}"))), t(0))?;
                let c = outbox.claim_due(t(1), 3, "w")?;
                outbox.settle(c[0].fence(), Settlement::Completed, t(10))?;
                outbox.settle(
                    c[1].fence(),
                    Settlement::Failed {
                        reason: "no".into(),
                        next_attempt_at: None,
                    },
                    t(20),
                )?;
                outbox.settle(c[2].fence(), Settlement::Completed, t(30))?;
                assert_eq!(outbox.purge_finished(t(10))?, 0, "strictly before");
                assert_eq!(outbox.purge_finished(t(30))?, 2);
                assert!(matches!(outbox.get(c[0].id), Err(Error::NotFound)));
                assert!(matches!(outbox.get(c[1].id), Err(Error::NotFound)));
                assert_eq!(outbox.get(c[2].id)?.entry.status, OutboxStatus::Completed);
                assert_eq!(
                    outbox.get(e[3].id())?.entry.status,
                    OutboxStatus::Pending,
                    "unfinished stays"
                );
                // A purged key can be enqueued again, as a new entry.
                let again = outbox.enqueue(entry("c", "d", "k0"), t(40))?;
                assert!(again.is_new() && again.id() > e[3].id(), "{again:?}");
                assert_eq!(outbox.counts()?.total(), 3);
                assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
                Ok(())
            }

            #[test]
            fn the_attempt_history_keeps_the_last_twenty() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let id = outbox.enqueue(entry("c", "d", "k"), t(0))?.id();
                for i in 0..23 {
                    let got = outbox.claim_due(t(i64::from(i) * 10 + 1), 1, "w")?;
                    assert_eq!(ids(&got), [id]);
                    let reason = format!("http_50{} (try {i})", i % 3);
                    let retry = Settlement::Failed {
                        reason,
                        next_attempt_at: Some(t(i64::from(i) * 10 + 5)),
                    };
                    outbox.settle(got[0].fence(), retry, t(i64::from(i) * 10 + 2))?;
                }
                let rec = outbox.get(id)?;
                assert_eq!(rec.entry.attempt_count, 23);
                assert_eq!(rec.attempts.len(), 20);
                assert_eq!(rec.attempts[0].attempt, 4, "the oldest three dropped");
                assert_eq!(rec.attempts[19].reason, "http_501 (try 22)");
                assert_eq!(rec.attempts[19].at, t(222));
                assert_eq!(
                    rec.last_failure.as_deref(),
                    Some("http_501"),
                    "the code only"
                );
                let got = outbox.claim_due(t(300), 1, "w")?;
                outbox.settle(
                    got[0].fence(),
                    Settlement::OutcomeUnknown {
                        remote_ref: Some("r-1".into()),
                    },
                    t(301),
                )?;
                let rec = outbox.get(id)?;
                let last = rec.attempts.last().expect("a record");
                assert_eq!(
                    (last.reason.as_str(), last.remote_ref.as_deref()),
                    ("outcome_unknown", Some("r-1"))
                );
                assert_eq!(rec.attempts.len(), 20);
                assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
                Ok(())
            }

            #[test]
            fn listings_counts_and_times_describe_the_outbox() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let a = outbox.enqueue(entry("order-1", "mailer", "a"), t(5))?.id();
                let b = outbox.enqueue(entry("order-1", "sms", "b"), t(3))?.id();
                let c = outbox.enqueue(entry("order-2", "mailer", "c"), t(4))?.id();
                let by_command: Vec<OutboxId> = outbox
                    .list_for_command("order-1")?
                    .iter()
                    .map(|r| r.entry.id)
                    .collect();
                assert_eq!(by_command, [b, a], "by created_at, then id");
                assert_eq!(outbox.list_for_command("nobody")?, Vec::new());
                assert_eq!(outbox.oldest_claim()?, None);
                assert_eq!(ids(&outbox.claim_due(t(6), 1, "w")?), [b]);
                assert_eq!(outbox.oldest_claim()?, Some(t(6)));
                assert_eq!(outbox.next_due()?, Some(t(4)));
                let listed = |filter: OutboxFilter, limit| -> idemstore::Result<Vec<OutboxId>> {
                    Ok(outbox
                        .list(&filter, limit)?
                        .iter()
                        .map(|r| r.entry.id)
                        .collect())
                };
                assert_eq!(listed(OutboxFilter::any(), 10)?, [a, b, c]);
                assert_eq!(listed(OutboxFilter::any(), 2)?, [a, b]);
                assert_eq!(listed(OutboxFilter::any().after(b), 10)?, [c]);
                assert_eq!(
                    listed(OutboxFilter::any().status(OutboxStatus::Dispatching), 10)?,
                    [b]
                );
                assert_eq!(
                    listed(OutboxFilter::any().destination("mailer"), 10)?,
                    [a, c]
                );
                assert_eq!(
                    listed(
                        OutboxFilter::any()
                            .destination("mailer")
                            .status(OutboxStatus::Pending)
                            .after(a),
                        10
                    )?,
                    [c]
                );
                assert_eq!(
                    listed(OutboxFilter::any().after(OutboxId(u64::MAX)), 10)?,
                    []
                );
                let counts = outbox.counts()?;
                assert_eq!(
                    (counts.pending, counts.dispatching, counts.total()),
                    (2, 1, 3)
                );
                assert_eq!(counts.get(OutboxStatus::Pending), 2);
                Ok(())
            }

            #[test]
            fn bad_input_is_refused_with_the_same_errors() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let bad = NewEntry::new("c", "", "k", b"p".to_vec());
                assert!(matches!(
                    outbox.enqueue(bad.clone(), t(0)),
                    Err(Error::InvalidInput {
                        field: "destination",
                        ..
                    })
                ));
                let big = NewEntry::new("c", "d", "k", vec![0_u8; 1024 * 1024 + 1]);
                assert!(matches!(
                    outbox.enqueue(big, t(0)),
                    Err(Error::TooLarge {
                        field: "payload",
                        len: 1_048_577,
                        max: 1_048_576
                    })
                ));
                assert!(
                    outbox
                        .enqueue(
                            NewEntry::new("c", "d", "max", vec![0_u8; 1024 * 1024]),
                            t(0)
                        )?
                        .is_new()
                );
                let long = NewEntry::new("c", "d", "k".repeat(1025), b"p".to_vec());
                assert!(matches!(
                    outbox.enqueue(long, t(0)),
                    Err(Error::TooLarge {
                        field: "idempotency_key",
                        ..
                    })
                ));
                assert!(matches!(
                    outbox.enqueue_many([entry("c", "d", "fine"), bad], t(0)),
                    Err(Error::InvalidInput { .. })
                ));
                assert_eq!(
                    outbox.find("d", "fine")?,
                    None,
                    "a bad entry in a batch enqueues nothing"
                );
                assert!(matches!(
                    outbox.claim_due(t(0), 1, ""),
                    Err(Error::InvalidInput {
                        field: "worker_id",
                        ..
                    })
                ));
                assert!(matches!(
                    outbox.get(OutboxId(u64::MAX)),
                    Err(Error::NotFound)
                ));
                assert!(matches!(
                    outbox.get(OutboxId(987_654)),
                    Err(Error::NotFound)
                ));
                assert!(matches!(
                    outbox.mark_completed(OutboxId(987_654), t(0)),
                    Err(Error::NotFound)
                ));
                assert!(matches!(
                    outbox.cancel(OutboxId(u64::MAX), t(0)),
                    Err(Error::NotFound)
                ));
                assert!(matches!(
                    outbox.mark_failed(OutboxId(1), "", None, t(0)),
                    Err(Error::InvalidInput {
                        field: "reason",
                        ..
                    })
                ));
                assert!(matches!(
                    outbox.list_for_command(""),
                    Err(Error::InvalidInput {
                        field: "command_id",
                        ..
                    })
                ));
                // Any string, NULs included, is a field.
                let odd = NewEntry::new("c\0", "d\0e", "k\0", b"\0".to_vec());
                let id = outbox.enqueue(odd.clone(), t(0))?.id();
                let rec = outbox.get(id)?;
                assert_eq!(
                    (
                        rec.entry.command_id.as_str(),
                        rec.entry.destination.as_str()
                    ),
                    ("c\0", "d\0e")
                );
                assert_eq!(outbox.enqueue(odd, t(1))?, Enqueued::Duplicate(id));
                assert_eq!(outbox.find("d", "k\0")?, None);
                Ok(())
            }

            #[test]
            fn cancelling_takes_an_entry_out_of_the_queue_once() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let id = outbox.enqueue(entry("c", "d", "k"), t(0))?.id();
                outbox.cancel(id, t(1))?;
                let once = outbox.get(id)?;
                outbox.cancel(id, t(2))?;
                assert_eq!(outbox.get(id)?, once, "a repeated cancel changes nothing");
                assert_eq!(outbox.claim_due(t(3), 10, "w")?, []);
                assert_eq!(once.entry.status, OutboxStatus::Failed);
                outbox.requeue(id, t(4))?;
                assert_eq!(ids(&outbox.claim_due(t(4), 10, "w")?), [id]);
                Ok(())
            }

            #[test]
            fn an_enqueue_wakes_the_subscribers() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let wake = outbox.subscribe();
                // Whatever arrives as the subscription starts.
                while wake.recv_timeout(Duration::from_millis(300)).is_ok() {}
                let other = f.another();
                assert!(other.outbox().enqueue(entry("c", "d", "k"), t(0))?.is_new());
                assert!(
                    wake.recv_timeout(Duration::from_secs(10)).is_ok(),
                    "woken by the enqueue"
                );
                outbox.notify();
                assert!(
                    wake.recv_timeout(Duration::from_secs(10)).is_ok(),
                    "woken by notify"
                );
                Ok(())
            }
        }
    };
}
