//! Maintenance over more rows than one chunk: `release_expired_claims`,
//! `purge_finished` and `prune` act on exactly the rows they should, commit
//! in more than one transaction, and leave the indexes consistent.

macro_rules! maintenance_contract {
    () => {
        mod maintenance {
            use super::fixture::Ob;
            use idemstore::{Enqueued, Error, MatchingChange, OutboxId, OutboxStatus, Settlement};

            use super::*;

            /// More rows than two chunks hold.
            const MANY: usize = 2500;

            fn failed() -> Settlement {
                Settlement::Failed {
                    reason: "http_500".into(),
                    next_attempt_at: None,
                }
            }

            #[test]
            fn release_expired_claims_releases_exactly_the_old_claims_in_chunks() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let e: Vec<OutboxId> = outbox
                    .enqueue_many(
                        (0..MANY + 2).map(|i| entry("c", "d", &format!("k{i}"))),
                        t(0),
                    )?
                    .iter()
                    .map(Enqueued::id)
                    .collect();
                // Claimed at t(1), t(2) and t(3), oldest ids first.
                let mut claimed = outbox.claim_due(t(1), 1000, "w")?;
                claimed.extend(outbox.claim_due(t(2), 1000, "w")?);
                claimed.extend(outbox.claim_due(t(3), MANY - 2000 + 1, "w")?);
                assert_eq!(claimed.len(), MANY + 1);
                // In doubt: no longer a claim, never released.
                let doubt = claimed.pop().ok_or("claimed")?;
                outbox.settle(
                    doubt.fence(),
                    Settlement::OutcomeUnknown { remote_ref: None },
                    t(3),
                )?;
                // Claimed at the cutoff: not strictly before it.
                let late = outbox.claim_due(t(5), 1, "w")?;
                assert_eq!(late.len(), 1);

                let (released, commits) =
                    f.commits_during(|| outbox.release_expired_claims(t(5)))?;
                assert_eq!(released?, e[..MANY], "every older claim, oldest first");
                assert!(commits >= 2, "in chunks: {commits} transaction(s)");
                let counts = outbox.counts()?;
                assert_eq!(
                    (counts.pending, counts.dispatching, counts.outcome_unknown),
                    (MANY as u64, 1, 1)
                );
                let first = outbox.get(e[0])?;
                assert_eq!(first.entry.status, OutboxStatus::Pending);
                assert_eq!(first.entry.next_attempt_at, Some(t(1)), "due at its claim");
                assert_eq!(first.claim, None);
                assert_eq!(
                    outbox.get(late[0].id)?.entry.status,
                    OutboxStatus::Dispatching
                );
                assert_eq!(
                    outbox.get(doubt.id)?.entry.status,
                    OutboxStatus::OutcomeUnknown
                );
                assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
                assert_eq!(outbox.release_expired_claims(t(5))?, Vec::<OutboxId>::new());
                Ok(())
            }

            #[test]
            fn purge_finished_removes_exactly_the_old_finished_entries_in_chunks() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let e: Vec<OutboxId> = outbox
                    .enqueue_many(
                        (0..MANY + 3).map(|i| entry("c", "d", &format!("k{i}"))),
                        t(0),
                    )?
                    .iter()
                    .map(Enqueued::id)
                    .collect();
                let claimed = outbox.claim_due(t(1), MANY + 3, "w")?;
                assert_eq!(claimed.len(), MANY + 3);
                // Half completed at t(2), half failed for good at t(3) (with
                // an attempt record each).
                let (completed, failures): (Vec<_>, Vec<_>) =
                    claimed[..MANY].iter().partition(|c| c.id.0 % 2 == 0);
                outbox.settle_many(
                    completed.iter().map(|c| (c.fence(), Settlement::Completed)),
                    t(2),
                )?;
                outbox.settle_many(failures.iter().map(|c| (c.fence(), failed())), t(3))?;
                // Finished at the cutoff, retried, still being sent: they stay.
                outbox.settle(claimed[MANY].fence(), Settlement::Completed, t(5))?;
                outbox.settle(
                    claimed[MANY + 1].fence(),
                    Settlement::Failed {
                        reason: "http_503".into(),
                        next_attempt_at: Some(t(9)),
                    },
                    t(4),
                )?;

                let (purged, commits) = f.commits_during(|| outbox.purge_finished(t(5)))?;
                assert_eq!(purged?, MANY as u64);
                assert!(commits >= 2, "in chunks: {commits} transaction(s)");
                for id in [e[0], e[1], e[MANY - 1]] {
                    assert!(matches!(outbox.get(id), Err(Error::NotFound)), "{id}");
                }
                assert_eq!(outbox.get(e[MANY])?.entry.status, OutboxStatus::Completed);
                assert_eq!(outbox.get(e[MANY + 1])?.entry.status, OutboxStatus::Pending);
                assert_eq!(
                    outbox.get(e[MANY + 2])?.entry.status,
                    OutboxStatus::Dispatching
                );
                let counts = outbox.counts()?;
                assert_eq!(
                    (
                        counts.completed,
                        counts.failed,
                        counts.pending,
                        counts.dispatching
                    ),
                    (1, 0, 1, 1)
                );
                assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
                // A purged key is free again.
                assert!(matches!(
                    outbox.enqueue(entry("c", "d", "k0"), t(6))?,
                    Enqueued::New(_)
                ));
                assert_eq!(outbox.purge_finished(t(5))?, 0);
                Ok(())
            }

            #[test]
            fn prune_removes_exactly_the_old_keys_in_chunks() -> TestResult {
                let f = fixture!();
                let inbox = f.store.inbox("old")?;
                let other = f.store.inbox("other")?;
                let keys: Vec<String> = (0..MANY).map(|i| format!("k{i}")).collect();
                for (i, chunk) in keys.chunks(500).enumerate() {
                    let at = t(i64::try_from(i)?);
                    assert!(inbox.claim_many(chunk, at)?.iter().all(|&c| c));
                    assert!(other.claim_many(chunk, at)?.iter().all(|&c| c));
                }
                for i in 0..10 {
                    assert!(inbox.claim(&format!("new{i}"), t(5 + i))?);
                }

                let (pruned, commits) = f.commits_during(|| inbox.prune(t(5)))?;
                assert_eq!(
                    pruned?, MANY as u64,
                    "every key claimed strictly before t(5)"
                );
                assert!(commits >= 2, "in chunks: {commits} transaction(s)");
                assert_eq!(inbox.len()?, 10);
                assert!(!inbox.seen("k0")? && !inbox.seen(&keys[MANY - 1])?);
                assert!(inbox.seen("new0")? && inbox.seen("new9")?);
                assert_eq!(other.len()?, MANY as u64, "another inbox is not pruned");
                assert_eq!(inbox.prune(t(5))?, 0);
                assert!(
                    inbox.claim("k0", t(20))?,
                    "a pruned key can be claimed again"
                );
                assert!(!inbox.claim("new0", t(20))?);
                Ok(())
            }

            /// Failed entries of two destinations (`a`: ids at odd places,
            /// `b`: the others), one `a` entry pending and one in flight.
            fn failed_of_two(
                outbox: &Ob,
                n: usize,
            ) -> Result<Vec<OutboxId>, Box<dyn std::error::Error>> {
                let ids: Vec<OutboxId> = outbox
                    .enqueue_many(
                        (0..n).map(|i| {
                            let d = if i % 2 == 1 { "a" } else { "b" };
                            entry("c", d, &format!("k{i}"))
                        }),
                        t(0),
                    )?
                    .iter()
                    .map(Enqueued::id)
                    .collect();
                let claimed = outbox.claim_due(t(1), n, "w")?;
                assert_eq!(claimed.len(), n);
                outbox.settle_many(claimed.iter().map(|c| (c.fence(), failed())), t(2))?;
                outbox.enqueue(entry("c", "a", "pending"), t(3))?;
                outbox.enqueue(entry("c", "a", "flying"), t(3))?;
                assert_eq!(outbox.claim_due(t(4), 1, "w")?.len(), 1);
                Ok(ids)
            }

            #[test]
            fn a_listing_of_one_status_finds_exactly_its_entries_by_id() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let ids = failed_of_two(&outbox, 9)?;
                let list =
                    |filter: &idemstore::OutboxFilter, n| -> Result<Vec<u64>, idemstore::Error> {
                        Ok(outbox
                            .list(filter, n)?
                            .iter()
                            .map(|r| r.entry.id.0)
                            .collect())
                    };
                let failed = idemstore::OutboxFilter::any().status(OutboxStatus::Failed);
                let all: Vec<u64> = ids.iter().map(|i| i.0).collect();
                assert_eq!(list(&failed, 100)?, all);
                let of_a: Vec<u64> = all.iter().copied().skip(1).step_by(2).collect();
                assert_eq!(list(&failed.clone().destination("a"), 100)?, of_a);
                // Paged: two at a time, after the last.
                let first = list(&failed.clone().destination("a"), 2)?;
                assert_eq!(first, of_a[..2]);
                let next = list(
                    &failed.clone().destination("a").after(OutboxId(first[1])),
                    2,
                )?;
                assert_eq!(next, of_a[2..4]);
                // Newest first, and paged down.
                let newest = failed.clone().destination("a").newest_first();
                let mut down: Vec<u64> = of_a.iter().rev().copied().collect();
                assert_eq!(list(&newest, 100)?, down);
                assert_eq!(
                    list(&newest.clone().after(OutboxId(down[1])), 2)?,
                    down[2..4]
                );
                down = all.iter().rev().copied().collect();
                assert_eq!(list(&failed.clone().newest_first(), 100)?, down);
                let every = list(&idemstore::OutboxFilter::any().newest_first(), 3)?;
                assert_eq!(every.len(), 3);
                assert!(every.windows(2).all(|w| w[0] > w[1]), "{every:?}");
                let flying = list(
                    &idemstore::OutboxFilter::any().status(OutboxStatus::Dispatching),
                    10,
                )?;
                assert_eq!(flying.len(), 1);
                assert!(
                    list(
                        &idemstore::OutboxFilter::any()
                            .status(OutboxStatus::Dispatching)
                            .destination("b"),
                        10
                    )?
                    .is_empty()
                );
                assert_eq!(
                    list(
                        &idemstore::OutboxFilter::any().status(OutboxStatus::Pending),
                        10
                    )?
                    .len(),
                    1
                );
                Ok(())
            }

            #[test]
            fn retry_matching_in_steps_moves_exactly_the_matching_entries() -> TestResult {
                let retry = |s| MatchingChange::Retry {
                    next_attempt_at: t(s),
                };
                let cancel = |s| MatchingChange::Cancel { now: t(s) };
                let f = fixture!();
                let outbox = f.store.outbox();
                let ids = failed_of_two(&outbox, 25)?;
                let filter = idemstore::OutboxFilter::any()
                    .status(OutboxStatus::Failed)
                    .destination("a");
                let (mut changed, mut steps, mut from) = (0, 0, filter.clone());
                let (_, commits) = f.commits_during(|| -> Result<(), idemstore::Error> {
                    loop {
                        let step = outbox.change_matching(&from, &retry(10), 5)?;
                        let Some(last) = step.last else { break };
                        assert!(step.changed + step.skipped <= 5);
                        changed += step.changed;
                        steps += 1;
                        from = filter.clone().after(last);
                    }
                    Ok(())
                })?;
                assert_eq!(changed, 12, "a's failed entries");
                assert_eq!(steps, 3, "5 + 5 + 2");
                assert!(commits >= 3, "a commit per step: {commits}");
                for (i, id) in ids.iter().enumerate() {
                    let e = outbox.get(*id)?.entry;
                    let want = if i % 2 == 1 {
                        OutboxStatus::Pending
                    } else {
                        OutboxStatus::Failed
                    };
                    assert_eq!(e.status, want, "{id} ({})", e.destination);
                }
                // Cancel every pending entry of a: the retried, and the one
                // enqueued pending; the one in flight is not matched.
                let pending_a = idemstore::OutboxFilter::any()
                    .status(OutboxStatus::Pending)
                    .destination("a");
                let step = outbox.change_matching(&pending_a, &cancel(11), 100)?;
                assert_eq!((step.changed, step.skipped), (13, 0));
                assert_eq!(
                    outbox.change_matching(&pending_a, &cancel(11), 100)?.last,
                    None
                );
                // A retry of cancelled entries and b's failed ones: a change
                // that applies to each.
                let failed = idemstore::OutboxFilter::any().status(OutboxStatus::Failed);
                let step = outbox.change_matching(&failed, &retry(12), 1000)?;
                assert_eq!((step.changed, step.skipped), (26, 0), "13 of a, 13 of b");
                // Cancelling in flight is refused, and skipped.
                let flying = idemstore::OutboxFilter::any().status(OutboxStatus::Dispatching);
                let step = outbox.change_matching(&flying, &cancel(13), 10)?;
                assert_eq!((step.changed, step.skipped), (0, 1));
                // Released instead: back to pending, its claim gone.
                let release = MatchingChange::Release {
                    next_attempt_at: t(13),
                };
                let step = outbox.change_matching(&flying, &release, 10)?;
                assert_eq!((step.changed, step.skipped), (1, 0));
                assert_eq!(outbox.oldest_claim()?, None);
                let c = outbox.counts()?;
                assert_eq!((c.pending, c.failed, c.dispatching), (27, 0, 0));
                // Resolving in-doubt entries: two claimed, sent in doubt,
                // one resolved as completed, then every other as failed.
                let mut doubt: Vec<_> = outbox.claim_due(t(20), 2, "w")?;
                doubt.sort_by_key(|d| d.id);
                for d in &doubt {
                    outbox.settle(
                        d.fence(),
                        Settlement::OutcomeUnknown { remote_ref: None },
                        t(21),
                    )?;
                }
                let in_doubt = idemstore::OutboxFilter::any().status(OutboxStatus::OutcomeUnknown);
                let complete = MatchingChange::Complete { now: t(22) };
                let step = outbox.change_matching(&in_doubt, &complete, 1)?;
                assert_eq!((step.changed, step.last), (1, Some(doubt[0].id)));
                let fail = MatchingChange::Fail {
                    reason: "never_sent".into(),
                    now: t(22),
                };
                let step = outbox.change_matching(&in_doubt, &fail, 10)?;
                assert_eq!(step.changed, 1);
                let failed_one = outbox.get(doubt[1].id)?;
                assert_eq!(failed_one.entry.status, OutboxStatus::Failed);
                assert_eq!(failed_one.last_failure.as_deref(), Some("never_sent"));
                assert_eq!(
                    outbox.get(doubt[0].id)?.entry.status,
                    OutboxStatus::Completed
                );
                // A bad reason is refused before anything is read.
                let bad = MatchingChange::Fail {
                    reason: String::new(),
                    now: t(22),
                };
                assert!(matches!(
                    outbox.change_matching(&in_doubt, &bad, 10),
                    Err(Error::InvalidInput { .. })
                ));
                assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
                Ok(())
            }
        }
    };
}
