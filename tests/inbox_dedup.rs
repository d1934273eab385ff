//! The inbox records each event key once, across threads and reopens.

use std::collections::HashMap;
use std::sync::{Arc, Barrier};

use chrono::{DateTime, TimeZone, Utc};
use idemstore::{Durability, Error, Result, Store};

fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

#[test]
fn first_claim_wins_and_survives_reopen() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.idem");
    {
        let store = Store::open(&path)?;
        let inbox = store.inbox("webhooks")?;
        assert!(inbox.claim("evt-1", t(0))?);
        assert!(!inbox.claim("evt-1", t(1))?);
        assert!(inbox.claim("evt-2", t(2))?);
        assert_eq!(inbox.len()?, 2);
    }
    let store = Store::open(&path)?;
    let inbox = store.inbox("webhooks")?;
    assert!(!inbox.claim("evt-1", t(3))?, "a claim survives reopen");
    assert!(inbox.seen("evt-2")?);
    assert!(!inbox.seen("evt-3")?);
    assert_eq!(
        inbox.seen_at("evt-1")?,
        Some(t(0)),
        "the first seen_at is kept"
    );
    assert_eq!(inbox.len()?, 2);
    Ok(())
}

#[test]
fn racing_threads_get_exactly_one_winner_per_key() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::builder()
        .journal_size(16)
        .open(dir.path().join("store.idem"))?;
    let inbox = store.inbox("race")?;
    let threads = 16;
    let keys = 50;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let inbox = inbox.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || -> Result<Vec<String>> {
                barrier.wait();
                let mut won = Vec::new();
                for k in 0..keys {
                    // Each thread walks the keys in a different order.
                    let key = format!("key-{}", (k + i * 7) % keys);
                    if inbox.claim(&key, t(0))? {
                        won.push(key);
                    }
                }
                Ok(won)
            })
        })
        .collect();
    let mut wins: HashMap<String, usize> = HashMap::new();
    for h in handles {
        for key in h.join().expect("claim thread panicked")? {
            *wins.entry(key).or_default() += 1;
        }
    }
    assert_eq!(wins.len(), keys, "every key was won");
    assert!(
        wins.values().all(|&n| n == 1),
        "exactly one winner per key: {wins:?}"
    );
    assert_eq!(inbox.len()?, keys as u64);
    Ok(())
}

#[test]
fn claim_many_answers_each_key_in_order() -> Result<()> {
    let store = Store::in_memory()?;
    let inbox = store.inbox("bulk")?;
    assert!(inbox.claim("b", t(0))?);
    let answers = inbox.claim_many(["a", "b", "c", "a"], t(1))?;
    assert_eq!(answers, vec![true, false, true, false]);
    assert_eq!(inbox.len()?, 3);
    assert_eq!(
        inbox.claim_many(Vec::<String>::new(), t(2))?,
        Vec::<bool>::new()
    );
    Ok(())
}

#[test]
fn claim_many_with_one_bad_key_claims_nothing() -> Result<()> {
    let store = Store::in_memory()?;
    let inbox = store.inbox("bulk")?;
    // One bad key: nothing is claimed.
    let err = inbox.claim_many(["d", ""], t(2)).unwrap_err();
    assert!(matches!(err, Error::InvalidInput { .. }), "{err}");
    assert!(!inbox.seen("d")?);
    Ok(())
}

#[test]
fn prune_removes_only_older_keys_and_counts_them() -> Result<()> {
    let store = Store::in_memory()?;
    let inbox = store.inbox("p")?;
    let other = store.inbox("q")?;
    for i in 0..10 {
        assert!(inbox.claim(&format!("k{i}"), t(i))?);
        assert!(other.claim(&format!("k{i}"), t(i))?);
    }
    assert_eq!(inbox.prune(t(4))?, 4, "k0..k3 are strictly before t(4)");
    assert_eq!(inbox.len()?, 6);
    assert!(!inbox.seen("k3")?);
    assert!(inbox.seen("k4")?);
    assert_eq!(inbox.prune(t(4))?, 0, "pruning again removes nothing");
    assert_eq!(other.len()?, 10, "another inbox is untouched");
    // A pruned key can be claimed again.
    assert!(inbox.claim("k0", t(20))?);
    assert_eq!(inbox.prune(t(100))?, 7);
    assert!(inbox.is_empty()?);
    Ok(())
}

#[test]
fn list_pages_through_keys_oldest_first() -> Result<()> {
    let store = Store::in_memory()?;
    let other = store.inbox("q")?;
    for i in 0..10 {
        assert!(other.claim(&format!("k{i}"), t(i))?);
    }
    let listed = other.list(None, 3)?;
    assert_eq!(
        listed,
        vec![
            ("k0".to_string(), t(0)),
            ("k1".to_string(), t(1)),
            ("k2".to_string(), t(2))
        ]
    );
    let next = other.list(Some((t(2), "k2")), 100)?;
    assert_eq!(next.len(), 7);
    assert_eq!(next[0].0, "k3");
    Ok(())
}

#[test]
fn inboxes_are_separate_namespaces() -> Result<()> {
    let store = Store::in_memory()?;
    let a = store.inbox("a")?;
    let b = store.inbox("b")?;
    assert!(a.claim("same-key", t(0))?);
    assert!(
        b.claim("same-key", t(0))?,
        "another inbox has its own ledger"
    );
    assert!(!a.claim("same-key", t(1))?);
    assert_eq!(a.len()?, 1);
    assert_eq!(b.len()?, 1);
    Ok(())
}

#[test]
fn bad_keys_and_names_are_refused_and_write_nothing() -> Result<()> {
    let store = Store::in_memory()?;
    let inbox = store.inbox("x")?;
    assert!(matches!(
        inbox.claim("", t(0)),
        Err(Error::InvalidInput { .. })
    ));
    let long = "k".repeat(1025);
    assert!(matches!(
        inbox.claim(&long, t(0)),
        Err(Error::TooLarge {
            len: 1025,
            max: 1024,
            ..
        })
    ));
    assert!(
        inbox.claim(&"k".repeat(1024), t(0))?,
        "1024 bytes is allowed"
    );
    assert!(matches!(inbox.seen(""), Err(Error::InvalidInput { .. })));
    let effect_ran = std::cell::Cell::new(false);
    let r = inbox.claim_with("", t(0), |_| {
        effect_ran.set(true);
        Ok::<_, Error>(())
    });
    assert!(matches!(r, Err(Error::InvalidInput { .. })));
    assert!(!effect_ran.get());
    for bad in ["", "a b", "a/b", "ä", &"n".repeat(65)] {
        assert!(store.inbox(bad).is_err(), "{bad:?}");
    }
    assert_eq!(inbox.len()?, 1);
    Ok(())
}

#[test]
fn claims_stay_unique_across_journal_merges_reopens_and_durabilities() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.idem");
    {
        // A durable store journals claims and merges every ten.
        let store = Store::builder().journal_size(10).open(&path)?;
        let inbox = store.inbox("j")?;
        for i in 0..95 {
            assert!(inbox.claim(&format!("k{i}"), t(i))?);
        }
        for i in 0..95 {
            assert!(!inbox.claim(&format!("k{i}"), t(200))?, "k{i}");
        }
        assert_eq!(inbox.len()?, 95);
        assert_eq!(inbox.seen_at("k3")?, Some(t(3)), "merged into the ledger");
        assert_eq!(inbox.seen_at("k94")?, Some(t(94)), "still in the journal");
        assert_eq!(inbox.list(None, 1000)?.len(), 95);
        assert_eq!(
            inbox.claim_many(["k94", "k95", "k95"], t(300))?,
            [false, true, false]
        );
        let in_own_write = store.write(|tx| inbox.claim_in(tx, "k95", t(300)))?;
        assert!(!in_own_write);
        assert!(store.check_inbox_indexes()?.is_empty());
    }
    {
        // Reopened: what the journal holds is found again.
        let store = Store::builder().journal_size(10).open(&path)?;
        let inbox = store.inbox("j")?;
        assert!(!inbox.claim("k95", t(400))?);
        assert!(!inbox.claim("k93", t(400))?);
        assert!(inbox.claim("k96", t(400))?);
        assert_eq!(inbox.len()?, 97);
        assert!(store.check_inbox_indexes()?.is_empty());
    }
    {
        // Under Durability::None claims go straight to the ledger, and
        // journaled keys are still duplicates.
        let store = Store::builder().durability(Durability::None).open(&path)?;
        let inbox = store.inbox("j")?;
        assert!(!inbox.claim("k96", t(500))?);
        assert!(inbox.claim("k97", t(500))?);
        assert_eq!(inbox.seen_at("k96")?, Some(t(400)));
        // Pruning merges the journal first, then removes from the ledger.
        assert_eq!(inbox.prune(t(50))?, 50);
        assert_eq!(inbox.len()?, 48);
        assert!(!inbox.seen("k0")?);
        assert!(
            inbox.claim("k0", t(600))?,
            "a pruned key can be claimed again"
        );
        assert_eq!(inbox.len()?, 49);
        assert!(store.check_inbox_indexes()?.is_empty());
    }
    Ok(())
}

#[test]
fn prune_of_many_keys_commits_in_chunks_and_keeps_the_journal_invariants() -> Result<()> {
    // A small journal: the claims below land in merges and in the journal.
    let store = Store::builder().journal_size(300).in_memory()?;
    let inbox = store.inbox("p")?;
    let other = store.inbox("q")?;
    for i in 0..2600 {
        assert!(inbox.claim_many([format!("old{i}")], t(i % 7))?[0]);
    }
    assert!(other.claim("old0", t(0))?);
    for i in 0..20 {
        assert!(inbox.claim(&format!("new{i}"), t(7))?);
    }
    let before = store.commit_stats().commits;
    assert_eq!(
        inbox.prune(t(7))?,
        2600,
        "every key claimed strictly before t(7)"
    );
    let commits = store.commit_stats().commits - before;
    assert!(
        commits >= 3,
        "2600 keys in chunks of 1024: {commits} commit(s)"
    );
    assert_eq!(store.check_inbox_indexes()?, Vec::<String>::new());
    assert_eq!(inbox.len()?, 20);
    assert_eq!(inbox.list(None, usize::MAX)?.len(), 20);
    assert!(!inbox.seen("old0")? && !inbox.seen("old2599")? && inbox.seen("new19")?);
    assert!(other.seen("old0")?);
    // Pruned keys are free again, journaled and merged like any other.
    for i in 0..400 {
        assert!(inbox.claim(&format!("old{i}"), t(8))?);
    }
    assert!(!inbox.claim("old399", t(9))?);
    assert_eq!(inbox.len()?, 420);
    assert_eq!(store.check_inbox_indexes()?, Vec::<String>::new());
    // Inside the caller's transaction: everything in that one transaction.
    assert_eq!(store.write(|tx| inbox.prune_in(tx, t(100)))?, 420);
    assert!(inbox.is_empty()?);
    assert_eq!(store.check_inbox_indexes()?, Vec::<String>::new());
    Ok(())
}

#[test]
fn claims_between_the_chunks_of_a_prune_keep_the_inbox_consistent() -> Result<()> {
    // A small journal: the claims merge it while the prune runs.
    let store = Store::builder().journal_size(64).in_memory()?;
    let inbox = store.inbox("p")?;
    for batch in 0..5 {
        inbox.claim_many((0..1000).map(|i| format!("old{}", batch * 1000 + i)), t(0))?;
    }
    let claimer = {
        let inbox = inbox.clone();
        std::thread::spawn(move || -> Result<Vec<bool>> {
            (0..1500)
                .map(|i| inbox.claim(&format!("fresh{i}"), t(10)))
                .collect()
        })
    };
    let pruned = inbox.prune(t(5))?;
    let fresh = claimer.join().expect("the claimer does not panic")?;
    assert_eq!(pruned, 5000);
    assert!(fresh.iter().all(|&first| first));
    assert_eq!(inbox.len()?, 1500);
    assert_eq!(store.check_inbox_indexes()?, Vec::<String>::new());
    assert!(!inbox.seen("old0")? && !inbox.seen("old4999")?);
    assert!(inbox.seen("fresh0")? && inbox.seen("fresh1499")?);
    Ok(())
}
