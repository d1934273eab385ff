//! Destinations' contract: policies, pause, ordering keys, priorities and
//! fair claiming, each checked against the claims they allow and the
//! indexes they leave — with the same answers on every backend.

macro_rules! destinations_contract {
    () => {
        mod destinations {
            use std::time::Duration;

            use chrono::{DateTime, TimeZone, Utc};
            use idemstore::{
                CircuitState, ClaimRequest, DestinationPolicy, NewEntry, OutboxFilter, Settlement,
            };

            use super::*;

            /// `ms` milliseconds after the suite's origin.
            fn t(ms: i64) -> DateTime<Utc> {
                Utc.timestamp_millis_opt(1_700_000_000_000 + ms).unwrap()
            }

            fn entry(dest: &str, key: &str) -> NewEntry {
                NewEntry::new("cmd", dest, key, b"x".to_vec())
            }

            fn destinations_of(claimed: &[idemstore::OutboxEntry]) -> Vec<&str> {
                claimed.iter().map(|e| e.destination.as_str()).collect()
            }

            #[test]
            fn claims_take_destinations_in_turn() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                for i in 0..10 {
                    outbox.enqueue(entry("a", &format!("a{i}")), t(0))?;
                }
                for i in 0..3 {
                    outbox.enqueue(entry("b", &format!("b{i}")), t(1))?;
                }
                let got = outbox.claim_due(t(10), 6, "w")?;
                assert_eq!(destinations_of(&got), ["a", "b", "a", "b", "a", "b"]);
                // b was served last at the same time: a's turn comes first by name,
                // then b; b has nothing left.
                let got = outbox.claim_due(t(20), 3, "w")?;
                assert_eq!(destinations_of(&got), ["a", "a", "a"]);
                assert!(
                    outbox.check_indexes()?.is_empty(),
                    "{:?}",
                    outbox.check_indexes()?
                );
                Ok(())
            }

            #[test]
            fn a_one_destination_claim_avoids_what_it_is_told_unless_nothing_else_is_due()
            -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                for i in 0..4 {
                    outbox.enqueue(entry("a", &format!("a{i}")), t(0))?;
                    outbox.enqueue(entry("b", &format!("b{i}")), t(0))?;
                }
                let req = ClaimRequest::new(3, "w").one_destination().avoid(["a"]);
                assert_eq!(destinations_of(&outbox.claim(t(1), &req)?), ["b", "b", "b"]);
                let req = ClaimRequest::new(3, "w").one_destination().avoid(["b"]);
                assert_eq!(destinations_of(&outbox.claim(t(2), &req)?), ["a", "a", "a"]);
                // Only a's and b's last entries left; avoiding both still claims.
                let req = ClaimRequest::new(3, "w")
                    .one_destination()
                    .avoid(["a", "b"]);
                assert_eq!(outbox.claim(t(3), &req)?.len(), 1);
                assert!(outbox.check_indexes()?.is_empty());
                Ok(())
            }

            #[test]
            fn a_claim_whose_clock_is_behind_still_takes_from_a_destination_just_served()
            -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                for i in 0..3 {
                    outbox.enqueue(entry("a", &format!("a{i}")), t(0))?;
                }
                outbox.enqueue(entry("b", "b0"), t(0))?;
                let one = ClaimRequest::new(1, "w").one_destination();
                assert_eq!(destinations_of(&outbox.claim(t(10), &one)?), ["a"]);
                // A second worker read its clock a moment before the first:
                // a, served at 10, is still claimable at 9, behind b in line.
                let avoid_b = ClaimRequest::new(1, "w2").one_destination().avoid(["b"]);
                assert_eq!(destinations_of(&outbox.claim(t(9), &avoid_b)?), ["a"]);
                assert_eq!(
                    destinations_of(&outbox.claim_due(t(9), 2, "w3")?),
                    ["b", "a"]
                );
                assert!(outbox.check_indexes()?.is_empty());
                Ok(())
            }

            #[test]
            fn a_cap_holds_and_a_settlement_frees_a_slot() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                outbox
                    .set_destination_policy("a", DestinationPolicy::default().max_in_flight(2))?;
                for i in 0..5 {
                    outbox.enqueue(entry("a", &format!("a{i}")), t(0))?;
                }
                let got = outbox.claim_due(t(1), 10, "w")?;
                assert_eq!(got.len(), 2);
                assert!(outbox.claim_due(t(2), 10, "w")?.is_empty());
                assert_eq!(
                    outbox.next_due()?,
                    None,
                    "nothing claimable until a slot frees"
                );
                outbox.settle(got[0].fence(), Settlement::Completed, t(3))?;
                assert_eq!(outbox.claim_due(t(4), 10, "w")?.len(), 1);
                let state = outbox.destination("a")?;
                assert_eq!(state.in_flight, 2);
                assert_eq!(state.counts.completed, 1);
                assert_eq!(state.counts.pending, 2);
                assert!(
                    outbox.check_indexes()?.is_empty(),
                    "{:?}",
                    outbox.check_indexes()?
                );
                Ok(())
            }

            #[test]
            fn a_paused_destination_gives_nothing_until_resumed() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                outbox.pause_destination("a")?;
                outbox.enqueue(entry("a", "a0"), t(0))?;
                outbox.enqueue(entry("b", "b0"), t(0))?;
                assert_eq!(destinations_of(&outbox.claim_due(t(1), 10, "w")?), ["b"]);
                assert!(outbox.destination("a")?.paused);
                outbox.resume_destination("a")?;
                assert_eq!(destinations_of(&outbox.claim_due(t(2), 10, "w")?), ["a"]);
                assert!(outbox.check_indexes()?.is_empty());
                Ok(())
            }

            #[test]
            fn entries_of_one_ordering_key_go_one_at_a_time_in_order() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                for i in 0..3 {
                    outbox.enqueue(
                        entry("a", &format!("k{i}")).ordering_key("customer-1"),
                        t(i),
                    )?;
                }
                outbox.enqueue(entry("a", "free"), t(5))?;
                let got = outbox.claim_due(t(10), 10, "w")?;
                let keys: Vec<&str> = got.iter().map(|e| e.idempotency_key.as_str()).collect();
                assert_eq!(keys, ["k0", "free"]);
                // A retry keeps its place: k1 still waits.
                let retry = Settlement::Failed {
                    reason: "http_500".into(),
                    next_attempt_at: Some(t(20)),
                };
                outbox.settle(got[0].fence(), retry, t(11))?;
                assert!(outbox.claim_due(t(15), 10, "w")?.is_empty());
                let again = outbox.claim_due(t(20), 10, "w")?;
                assert_eq!(again[0].idempotency_key, "k0");
                // In doubt holds the sequence.
                outbox.settle(
                    again[0].fence(),
                    Settlement::OutcomeUnknown { remote_ref: None },
                    t(21),
                )?;
                assert!(outbox.claim_due(t(22), 10, "w")?.is_empty());
                outbox.mark_completed(again[0].id, t(23))?;
                let next = outbox.claim_due(t(24), 10, "w")?;
                assert_eq!(next[0].idempotency_key, "k1");
                assert!(
                    outbox.check_indexes()?.is_empty(),
                    "{:?}",
                    outbox.check_indexes()?
                );
                Ok(())
            }

            #[test]
            fn a_claim_without_a_limit_takes_every_claimable_entry() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                outbox
                    .set_destination_policy("b", DestinationPolicy::default().max_in_flight(2))?;
                for i in 0..5 {
                    outbox.enqueue(entry("a", &format!("a{i}")), t(0))?;
                    outbox.enqueue(entry("b", &format!("b{i}")), t(0))?;
                }
                let got = outbox.claim_due(t(1), usize::MAX, "w")?;
                assert_eq!(
                    destinations_of(&got),
                    ["a", "b", "a", "b", "a", "a", "a"],
                    "in turn while both give, b up to its cap"
                );
                Ok(())
            }

            #[test]
            fn higher_priority_goes_first_within_a_destination() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                outbox.enqueue(entry("a", "low"), t(0))?;
                outbox.enqueue(entry("a", "high").priority(5), t(1))?;
                let got = outbox.claim_due(t(2), 1, "w")?;
                assert_eq!(got[0].idempotency_key, "high");
                assert_eq!(got[0].priority, 5);
                Ok(())
            }

            #[test]
            fn a_circuit_opens_after_failures_and_charges_no_attempt_while_open() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                outbox.set_destination_policy(
                    "a",
                    DestinationPolicy::default().circuit_breaker(2, Duration::from_secs(10)),
                )?;
                for i in 0..5 {
                    outbox.enqueue(entry("a", &format!("a{i}")), t(0))?;
                }
                for round in 0..2 {
                    let got = outbox.claim_due(t(1 + round), 1, "w")?;
                    let retry = Settlement::Failed {
                        reason: "http_503".into(),
                        next_attempt_at: Some(t(2)),
                    };
                    outbox.settle(got[0].fence(), retry, t(2))?;
                }
                assert!(matches!(
                    outbox.destination("a")?.circuit,
                    CircuitState::Open { trips: 1, .. }
                ));
                assert!(outbox.claim_due(t(5_000), 10, "w")?.is_empty());
                assert_eq!(outbox.next_due()?, Some(t(10_002)));
                let probe = outbox.claim_due(t(10_002), 10, "w")?;
                assert_eq!(probe.len(), 1, "one probe");
                outbox.settle(probe[0].fence(), Settlement::Completed, t(10_003))?;
                assert_eq!(outbox.claim_due(t(10_004), 10, "w")?.len(), 4);
                let charged: u32 = outbox
                    .list(&OutboxFilter::any(), 10)?
                    .iter()
                    .map(|r| r.entry.attempt_count)
                    .sum();
                assert_eq!(charged, 2 + 1 + 4, "two failures, the probe, then one each");
                assert!(outbox.check_indexes()?.is_empty());
                Ok(())
            }

            #[test]
            fn a_rate_limit_gives_its_burst_then_a_token_per_period() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                outbox.set_destination_policy(
                    "a",
                    DestinationPolicy::default().rate_limit(10.0, 3),
                )?;
                for i in 0..10 {
                    outbox.enqueue(entry("a", &format!("a{i}")), t(0))?;
                }
                assert_eq!(outbox.claim_due(t(0), 10, "w")?.len(), 3);
                assert!(outbox.claim_due(t(50), 10, "w")?.is_empty());
                assert_eq!(outbox.next_due()?, Some(t(100)));
                assert_eq!(outbox.claim_due(t(100), 10, "w")?.len(), 1);
                assert_eq!(outbox.claim_due(t(350), 10, "w")?.len(), 2);
                Ok(())
            }

            #[test]
            fn statuses_stay_consistent_across_requeue_cancel_and_purge() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let a = outbox
                    .enqueue(entry("a", "k0").ordering_key("o"), t(0))?
                    .id();
                let b = outbox
                    .enqueue(entry("a", "k1").ordering_key("o"), t(0))?
                    .id();
                outbox.cancel(a, t(1))?;
                assert_eq!(outbox.claim_due(t(2), 10, "w")?[0].id, b);
                outbox.requeue(a, t(3))?;
                // a now waits behind b, which is in flight.
                assert!(outbox.claim_due(t(4), 10, "w")?.is_empty());
                outbox.mark_completed(b, t(5))?;
                assert_eq!(outbox.claim_due(t(6), 10, "w")?[0].id, a);
                outbox.mark_completed(a, t(7))?;
                assert_eq!(outbox.purge_finished(t(100))?, 2);
                assert!(
                    outbox.destinations()?.is_empty(),
                    "{:?}",
                    outbox.destinations()?
                );
                assert_eq!(
                    outbox.get(a).map(|r| r.entry.status).ok(),
                    None::<idemstore::OutboxStatus>
                );
                assert!(outbox.check_indexes()?.is_empty());
                Ok(())
            }

            #[test]
            fn a_throttled_attempt_holds_the_whole_destination() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                for i in 0..3 {
                    outbox.enqueue(entry("a", &format!("a{i}")), t(0))?;
                }
                outbox.enqueue(entry("b", "b0"), t(0))?;
                let got = outbox.claim(t(1), &ClaimRequest::new(1, "w").one_destination())?;
                assert_eq!(destinations_of(&got), ["a"]);
                let wait = Settlement::Throttled {
                    reason: "http_429".into(),
                    next_attempt_at: t(5_000),
                };
                outbox.settle(got[0].fence(), wait, t(2))?;
                assert_eq!(outbox.destination("a")?.held_until, Some(t(5_000)));
                // Only b gives anything until the hold ends.
                assert_eq!(destinations_of(&outbox.claim_due(t(3), 10, "w")?), ["b"]);
                assert!(outbox.claim_due(t(4_999), 10, "w")?.is_empty());
                assert_eq!(outbox.next_due()?, Some(t(5_000)));
                let after = outbox.claim_due(t(5_000), 10, "w")?;
                assert_eq!(after.len(), 3, "{after:?}");
                assert_eq!(
                    after[0].idempotency_key, "a1",
                    "earliest due first: a0 waits for 5 s"
                );
                assert!(outbox.check_indexes()?.is_empty());
                Ok(())
            }

            #[test]
            fn destinations_report_policies_pauses_and_counts() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                let capped = DestinationPolicy::default()
                    .max_in_flight(3)
                    .rate_limit(2.0, 4);
                outbox.set_destination_policy("a", capped)?;
                outbox.pause_destination("b")?;
                outbox.enqueue(entry("a", "a0"), t(0))?;
                outbox.enqueue(entry("a", "a1"), t(0))?;
                outbox.enqueue(entry("c", "c0"), t(0))?;
                let got = outbox.claim_due(t(1), 1, "w")?;
                assert_eq!(destinations_of(&got), ["a"]);
                let all = outbox.destinations()?;
                let names: Vec<&str> = all.iter().map(|d| d.destination.as_str()).collect();
                assert_eq!(names, ["a", "b", "c"]);
                let a = &all[0];
                assert_eq!(a.policy, capped);
                assert_eq!(
                    (a.in_flight, a.counts.pending, a.counts.dispatching),
                    (1, 1, 1)
                );
                assert_eq!(a.tokens, Some(3.0));
                assert!(all[1].paused && all[1].counts.total() == 0);
                assert_eq!(all[2].counts.pending, 1);
                assert!(all[2].policy.is_unlimited());
                assert_eq!(
                    all[2].circuit,
                    CircuitState::Closed {
                        consecutive_failures: 0
                    }
                );
                // A destination with nothing left to report goes.
                outbox.resume_destination("b")?;
                let names: Vec<String> = outbox
                    .destinations()?
                    .into_iter()
                    .map(|d| d.destination)
                    .collect();
                assert_eq!(names, ["a", "c"]);
                assert_eq!(outbox.destination("b")?.counts.total(), 0);
                assert!(matches!(
                    outbox
                        .set_destination_policy("a", DestinationPolicy::default().max_in_flight(0)),
                    Err(idemstore::Error::InvalidInput {
                        field: "max_in_flight",
                        ..
                    })
                ));
                for (bad, field) in [
                    (DestinationPolicy::default().weight(0), "weight"),
                    (
                        DestinationPolicy::default().rate_limit(f64::NAN, 1),
                        "rate_limit",
                    ),
                    (
                        DestinationPolicy::default().rate_limit(-1.0, 1),
                        "rate_limit",
                    ),
                    (
                        DestinationPolicy::default().weight(2).max_in_flight(0),
                        "max_in_flight",
                    ),
                ] {
                    match outbox.set_destination_policy("a", bad) {
                        Err(idemstore::Error::InvalidInput { field: f, .. }) => {
                            assert_eq!(f, field)
                        }
                        other => panic!("{bad:?}: {other:?}"),
                    }
                }
                assert_eq!(outbox.destination("a")?.policy, capped, "unchanged");
                // A weight is stored with the policy, as every limit is.
                let weighted = capped.weight(3);
                outbox.set_destination_policy("a", weighted)?;
                assert_eq!(outbox.destination("a")?.policy, weighted);
                assert_eq!(outbox.destination("a")?.policy.limits().weight, Some(3));
                Ok(())
            }

            #[test]
            fn an_entry_waiting_in_its_sequence_is_not_due() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                outbox.enqueue(entry("a", "k0").ordering_key("o"), t(100))?;
                outbox.enqueue(entry("a", "k1").ordering_key("o").not_before(t(50)), t(0))?;
                // k1 is due earlier but waits behind k0.
                assert_eq!(outbox.next_due()?, Some(t(100)));
                assert!(outbox.claim_due(t(60), 10, "w")?.is_empty());
                let got = outbox.claim_due(t(100), 10, "w")?;
                assert_eq!(got.len(), 1);
                assert_eq!(outbox.next_due()?, None, "k1 waits for k0 in flight");
                outbox.settle(
                    got[0].fence(),
                    Settlement::Failed {
                        reason: "gave_up".into(),
                        next_attempt_at: None,
                    },
                    t(101),
                )?;
                // A failed entry leaves its sequence: k1 goes next, once
                // its destination's turn comes again (served at 100).
                assert_eq!(outbox.next_due()?, Some(t(100)));
                assert_eq!(outbox.claim_due(t(102), 10, "w")?[0].idempotency_key, "k1");
                assert!(outbox.check_indexes()?.is_empty());
                Ok(())
            }

            #[test]
            fn a_settle_and_claim_with_a_request_avoids_what_it_is_told() -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                for i in 0..3 {
                    outbox.enqueue(entry("a", &format!("a{i}")), t(0))?;
                    outbox.enqueue(entry("b", &format!("b{i}")), t(0))?;
                }
                let first = outbox.claim(t(1), &ClaimRequest::new(1, "w").avoid(["a"]))?;
                assert_eq!(destinations_of(&first), ["b"]);
                let req = ClaimRequest::new(2, "w").avoid(["b"]).one_destination();
                let (settled, claimed) = outbox.settle_and_claim_with(
                    [(first[0].fence(), Settlement::Completed)],
                    t(2),
                    &req,
                )?;
                assert!(settled.iter().all(Result::is_ok));
                assert_eq!(destinations_of(&claimed), ["a", "a"]);
                let (_, claimed) = outbox.settle_and_claim(
                    claimed.iter().map(|e| (e.fence(), Settlement::Completed)),
                    t(3),
                    10,
                    "w",
                )?;
                // b was served at 1, a at 2: b first, then in turn.
                assert_eq!(destinations_of(&claimed), ["b", "a", "b"]);
                assert!(outbox.check_indexes()?.is_empty());
                Ok(())
            }

            #[test]
            fn a_settlement_that_frees_a_slot_wakes_the_dispatchers_and_a_plain_one_does_not()
            -> TestResult {
                let f = fixture!();
                let outbox = f.store.outbox();
                outbox
                    .set_destination_policy("a", DestinationPolicy::default().max_in_flight(1))?;
                outbox.enqueue(entry("a", "a0"), t(0))?;
                outbox.enqueue(entry("a", "a1"), t(0))?;
                outbox.enqueue(entry("z", "z0"), t(0))?;
                let got = outbox.claim_due(t(1), 10, "w")?;
                assert_eq!(destinations_of(&got), ["a", "z"]);
                let wake = outbox.subscribe();
                // Whatever arrives as the subscription starts.
                while wake.recv_timeout(Duration::from_millis(300)).is_ok() {}
                outbox.settle(got[1].fence(), Settlement::Completed, t(2))?;
                assert!(
                    wake.recv_timeout(Duration::from_millis(300)).is_err(),
                    "a completion that frees nothing wakes nobody"
                );
                outbox.settle(got[0].fence(), Settlement::Completed, t(3))?;
                assert!(
                    wake.recv_timeout(Duration::from_secs(10)).is_ok(),
                    "woken: a1 may go now"
                );
                Ok(())
            }
        }
    };
}
