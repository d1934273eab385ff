//! The inbox's contract: first delivery wins, once, under concurrency; an
//! effect commits with its claim or not at all; prune, len, list; bad
//! input refused with the same errors.

macro_rules! inbox_contract {
    () => {
        mod inbox {
            use std::cell::Cell;
            use std::collections::BTreeMap;
            use std::panic::{AssertUnwindSafe, catch_unwind};

            use idemstore::{Claim, Error};

            use super::*;

            #[test]
            fn a_key_is_claimed_once_then_seen() -> TestResult {
                let f = fixture!();
                let webhooks = f.store.inbox("webhooks")?;
                assert_eq!(webhooks.name(), "webhooks");
                assert!(webhooks.is_empty()?);
                assert!(webhooks.claim("evt-1", t(0))?);
                assert!(!webhooks.claim("evt-1", t(1))?, "a redelivery");
                assert!(webhooks.seen("evt-1")?);
                assert!(!webhooks.seen("evt-2")?);
                assert_eq!(
                    webhooks.seen_at("evt-1")?,
                    Some(t(0)),
                    "the first claim's time"
                );
                assert_eq!(webhooks.seen_at("evt-2")?, None);
                assert_eq!(webhooks.len()?, 1);
                assert!(!webhooks.is_empty()?);
                Ok(())
            }

            #[test]
            fn inboxes_are_separate_namespaces() -> TestResult {
                let f = fixture!();
                let a = f.store.inbox("payments")?;
                let b = f.store.inbox("payments.v2")?;
                assert!(a.claim("evt-1", t(0))?);
                assert!(b.claim("evt-1", t(0))?, "the same key in another inbox");
                assert!(!f.store.inbox("payments")?.claim("evt-1", t(1))?);
                assert_eq!((a.len()?, b.len()?), (1, 1));
                Ok(())
            }

            #[test]
            fn any_string_is_a_key_and_bad_ones_are_refused() -> TestResult {
                let f = fixture!();
                let inbox = f.store.inbox("i")?;
                let odd = ["a\0b", "a", "ü", " ", "\u{1F600}", &"k".repeat(1024)];
                for key in odd {
                    assert!(inbox.claim(key, t(0))?, "{key:?}");
                }
                for key in odd {
                    assert!(!inbox.claim(key, t(1))?, "{key:?} again");
                    assert!(inbox.seen(key)?, "{key:?}");
                }
                assert!(!inbox.seen("a\0")?, "keys are compared whole");
                assert!(matches!(
                    inbox.claim("", t(0)),
                    Err(Error::InvalidInput {
                        field: "event key",
                        ..
                    })
                ));
                assert!(matches!(
                    inbox.claim(&"k".repeat(1025), t(0)),
                    Err(Error::TooLarge {
                        field: "event key",
                        len: 1025,
                        max: 1024
                    })
                ));
                assert!(matches!(
                    inbox.claim_many(["ok", ""], t(0)),
                    Err(Error::InvalidInput {
                        field: "event key",
                        ..
                    })
                ));
                assert!(!inbox.seen("ok")?, "a bad key in a batch claims nothing");
                for bad in ["", "has space", "slash/", "ü"] {
                    assert!(
                        matches!(
                            f.store.inbox(bad),
                            Err(Error::InvalidInput {
                                field: "inbox name",
                                ..
                            })
                        ),
                        "{bad:?}"
                    );
                }
                assert!(matches!(
                    f.store.inbox(&"n".repeat(65)),
                    Err(Error::TooLarge {
                        field: "inbox name",
                        ..
                    })
                ));
                Ok(())
            }

            #[test]
            fn concurrent_claims_of_a_key_have_one_winner() -> TestResult {
                const THREADS: usize = 8;
                const KEYS: usize = 25;
                let f = fixture!();
                let wins = std::thread::scope(|s| {
                    let handles: Vec<_> = (0..THREADS)
                        .map(|w| {
                            let store = f.another();
                            s.spawn(move || -> Result<Vec<usize>, Error> {
                                let inbox = store.inbox("race")?;
                                let mut won = Vec::new();
                                for k in 0..KEYS {
                                    // Each thread starts at another key, so
                                    // claims of one key overlap in time.
                                    let k = (k + w * 3) % KEYS;
                                    if inbox.claim(&format!("evt-{k}"), t(0))? {
                                        won.push(k);
                                    }
                                }
                                Ok(won)
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().expect("no panic"))
                        .collect::<Result<Vec<_>, _>>()
                })?;
                let mut per_key: BTreeMap<usize, usize> = BTreeMap::new();
                for k in wins.into_iter().flatten() {
                    *per_key.entry(k).or_default() += 1;
                }
                assert_eq!(per_key.len(), KEYS, "every key was won");
                assert!(per_key.values().all(|n| *n == 1), "{per_key:?}");
                assert_eq!(f.store.inbox("race")?.len()?, KEYS as u64);
                Ok(())
            }

            #[test]
            fn claim_many_answers_each_key_in_order() -> TestResult {
                let f = fixture!();
                let inbox = f.store.inbox("bulk")?;
                assert!(inbox.claim("a", t(0))?);
                assert_eq!(
                    inbox.claim_many(["a", "b", "b", "c"], t(1))?,
                    vec![false, true, false, true]
                );
                assert_eq!(
                    inbox.claim_many(Vec::<String>::new(), t(1))?,
                    Vec::<bool>::new()
                );
                assert_eq!(inbox.len()?, 3);
                assert_eq!(inbox.seen_at("b")?, Some(t(1)));
                Ok(())
            }

            #[test]
            fn an_effect_commits_with_its_claim_and_runs_once() -> TestResult {
                let f = fixture!();
                let inbox = f.store.inbox("effects")?;
                let runs = Cell::new(0);
                for delivery in 0..3 {
                    let outcome = inbox.claim_with("evt-1", t(delivery), |tx| {
                        runs.set(runs.get() + 1);
                        f.mark(tx, "credited")?;
                        Ok::<_, Error>(42)
                    })?;
                    let want = if delivery == 0 {
                        Claim::Applied(42)
                    } else {
                        Claim::Duplicate
                    };
                    assert_eq!(outcome, want, "delivery {delivery}");
                }
                assert_eq!(runs.get(), 1, "the effect ran once");
                assert_eq!(f.marks()?, vec!["credited".to_owned()]);
                assert_eq!(inbox.seen_at("evt-1")?, Some(t(0)));
                Ok(())
            }

            #[test]
            fn a_failed_effect_rolls_back_its_claim_and_writes() -> TestResult {
                let f = fixture!();
                let inbox = f.store.inbox("effects")?;
                let out = inbox.claim_with("evt-1", t(0), |tx| {
                    f.mark(tx, "half-done")?;
                    Err::<(), _>(AppError::Refused)
                });
                assert!(matches!(out, Err(AppError::Refused)), "{out:?}");
                assert!(!inbox.seen("evt-1")?, "the key stays unclaimed");
                assert_eq!(f.marks()?, Vec::<String>::new(), "nothing committed");
                // The next delivery runs the effect again.
                let out = inbox.claim_with("evt-1", t(1), |tx| {
                    f.mark(tx, "done")?;
                    Ok::<_, AppError>(())
                })?;
                assert_eq!(out, Claim::Applied(()));
                assert_eq!(f.marks()?, vec!["done".to_owned()]);
                Ok(())
            }

            #[test]
            fn a_panicking_effect_rolls_back_and_the_store_goes_on() -> TestResult {
                let f = fixture!();
                let inbox = f.store.inbox("effects")?;
                let panicked = catch_unwind(AssertUnwindSafe(|| {
                    inbox.claim_with("evt-1", t(0), |tx| -> Result<(), Error> {
                        f.mark(tx, "half-done")?;
                        panic!("the effect panics");
                    })
                }));
                assert!(panicked.is_err(), "the panic reaches the caller");
                assert!(!inbox.seen("evt-1")?);
                assert_eq!(f.marks()?, Vec::<String>::new());
                // The store works on, with the same key.
                for _ in 0..3 {
                    let _ = inbox.claim_with("evt-1", t(1), |tx| f.mark(tx, "done"))?;
                }
                assert_eq!(f.marks()?, vec!["done".to_owned()]);
                assert!(inbox.claim("evt-2", t(2))?);
                Ok(())
            }

            #[test]
            fn claim_in_commits_or_rolls_back_with_the_callers_write() -> TestResult {
                let f = fixture!();
                let inbox = f.store.inbox("composed")?;
                let out = f.store.write(|tx| {
                    assert!(inbox.claim_in(tx, "evt-1", t(0))?);
                    f.mark(tx, "row")?;
                    Err::<(), _>(AppError::Refused)
                });
                assert!(matches!(out, Err(AppError::Refused)));
                assert!(!inbox.seen("evt-1")?);
                assert_eq!(f.marks()?, Vec::<String>::new());
                let first = f.store.write(|tx| {
                    let first = inbox.claim_in(tx, "evt-1", t(1))?;
                    let again = inbox.claim_in(tx, "evt-1", t(1))?;
                    f.mark(tx, "row")?;
                    Ok::<_, Error>((first, again))
                })?;
                assert_eq!(first, (true, false), "the transaction sees its own claim");
                assert!(inbox.seen("evt-1")?);
                assert_eq!(f.marks()?, vec!["row".to_owned()]);
                Ok(())
            }

            #[test]
            fn a_panicking_write_rolls_back_and_the_store_goes_on() -> TestResult {
                let f = fixture!();
                let inbox = f.store.inbox("composed")?;
                let panicked = catch_unwind(AssertUnwindSafe(|| {
                    f.store.write(|tx| -> Result<(), Error> {
                        assert!(inbox.claim_in(tx, "evt-1", t(0))?);
                        f.mark(tx, "row")?;
                        panic!("the closure panics");
                    })
                }));
                assert!(panicked.is_err(), "the panic reaches the caller");
                assert!(!inbox.seen("evt-1")?);
                assert_eq!(f.marks()?, Vec::<String>::new());
                f.store.write(|tx| f.mark(tx, "row"))?;
                assert_eq!(f.marks()?, vec!["row".to_owned()]);
                let nested = f.store.write(|_tx| f.store.write(|tx| f.mark(tx, "inner")));
                assert!(matches!(nested, Err(Error::Reentrant)), "{nested:?}");
                Ok(())
            }

            #[test]
            fn a_store_write_inside_a_write_closure_is_refused() -> TestResult {
                let f = fixture!();
                let inbox = f.store.inbox("nested")?;
                let out = f.store.write(|_tx| inbox.claim("evt-1", t(0)));
                assert!(matches!(out, Err(Error::Reentrant)), "{out:?}");
                let out = inbox.claim_with("evt-2", t(0), |_tx| inbox.claim("evt-3", t(0)));
                assert!(matches!(out, Err(Error::Reentrant)), "{out:?}");
                assert!(!inbox.seen("evt-2")? && !inbox.seen("evt-3")?);
                assert!(inbox.claim("evt-1", t(0))?, "fine outside");
                Ok(())
            }

            #[test]
            fn prune_removes_keys_seen_before_the_cutoff() -> TestResult {
                let f = fixture!();
                let inbox = f.store.inbox("old")?;
                let other = f.store.inbox("other")?;
                for i in 0..10 {
                    assert!(inbox.claim(&format!("k{i}"), t(i))?);
                }
                assert!(other.claim("k0", t(0))?);
                assert_eq!(inbox.prune(t(5))?, 5, "k0..k4, strictly before t(5)");
                assert_eq!(inbox.len()?, 5);
                assert!(!inbox.seen("k4")? && inbox.seen("k5")?);
                assert!(other.seen("k0")?, "another inbox is not pruned");
                assert_eq!(inbox.prune(t(5))?, 0);
                assert!(
                    inbox.claim("k0", t(20))?,
                    "a pruned key can be claimed again"
                );
                let pruned = f.store.write(|tx| inbox.prune_in(tx, t(8)))?;
                assert_eq!(pruned, 3, "k5..k7");
                assert_eq!(inbox.len()?, 3);
                Ok(())
            }

            #[test]
            fn the_store_names_the_inboxes_holding_keys() -> TestResult {
                let f = fixture!();
                assert_eq!(f.store.inbox_names()?, Vec::<String>::new());
                for name in ["z", "a", "b.c", "a-b"] {
                    let inbox = f.store.inbox(name)?;
                    assert!(inbox.claim("k1", t(0))?);
                    assert!(inbox.claim("k2", t(1))?);
                }
                let _unused = f.store.inbox("never")?;
                assert_eq!(f.store.inbox_names()?, ["a", "a-b", "b.c", "z"]);
                assert_eq!(f.store.inbox("z")?.prune(t(2))?, 2);
                assert_eq!(
                    f.store.inbox_names()?,
                    ["a", "a-b", "b.c"],
                    "all pruned: not listed"
                );
                Ok(())
            }

            #[test]
            fn list_pages_through_keys_in_claim_order() -> TestResult {
                let f = fixture!();
                let inbox = f.store.inbox("listed")?;
                for (key, at) in [("d", 3), ("a", 1), ("c", 2), ("b", 2), ("e", 4)] {
                    assert!(inbox.claim(key, t(at))?);
                }
                let first = inbox.list(None, 3)?;
                let keys: Vec<&str> = first.iter().map(|(k, _)| k.as_str()).collect();
                assert_eq!(keys, ["a", "b", "c"], "by time, then key");
                assert_eq!(first[1].1, t(2));
                let (last_key, last_at) = first.last().cloned().expect("a page");
                let next = inbox.list(Some((last_at, &last_key)), 3)?;
                let keys: Vec<&str> = next.iter().map(|(k, _)| k.as_str()).collect();
                assert_eq!(keys, ["d", "e"]);
                assert_eq!(inbox.list(None, 0)?, Vec::new());
                Ok(())
            }
        }
    };
}
