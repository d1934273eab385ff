//! Group commit: concurrent callers share durable commits without sharing
//! each other's failures, and nobody is answered before their commit is on disk.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Barrier};

use common::{FaultyDisk, t};
use idemstore::redb::{ReadableTable as _, TableDefinition};
use idemstore::{Claim, Durability, Error, Result, Store};
use parking_lot::Mutex;

const ROWS: TableDefinition<&str, u64> = TableDefinition::new("app.rows");

fn row(store: &Store, key: &str) -> Result<Option<u64>> {
    store.read(|tx| match tx.open_table(ROWS) {
        Ok(t) => Ok(t.get(key)?.map(|v| v.value())),
        Err(idemstore::redb::TableError::TableDoesNotExist(_)) => Ok(None),
        Err(e) => Err(e.into()),
    })
}

#[test]
fn a_failing_and_a_panicking_closure_do_not_undo_the_others() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s.idem"))?;
    let inbox = store.inbox("gc")?;
    let threads = 32;
    let barrier = Arc::new(Barrier::new(threads));
    let before = store.commit_stats();
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let store = store.clone();
            let inbox = inbox.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                let key = format!("k{i}");
                catch_unwind(AssertUnwindSafe(|| {
                    // Writers, effects and plain claims, all at once.
                    match i % 3 {
                        0 => store.write(|tx| {
                            tx.open_table(ROWS)?.insert(key.as_str(), i as u64)?;
                            match i {
                                0 => Err(Error::InvalidInput {
                                    field: "test",
                                    reason: "fails after writing".into(),
                                }),
                                3 => panic!("panics after writing"),
                                _ => Ok(()),
                            }
                        }),
                        1 => inbox
                            .claim_with(&key, t(0), |tx| {
                                tx.open_table(ROWS)?.insert(key.as_str(), i as u64)?;
                                Ok::<_, Error>(())
                            })
                            .map(|c| assert!(c.is_applied())),
                        _ => inbox.claim(&key, t(0)).map(|first| assert!(first)),
                    }
                }))
            })
        })
        .collect();
    let outcomes: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (i, outcome) in outcomes.iter().enumerate() {
        let key = format!("k{i}");
        match i {
            0 => {
                assert!(matches!(outcome, Ok(Err(Error::InvalidInput { .. }))));
                assert_eq!(
                    row(&store, &key)?,
                    None,
                    "the failing closure wrote nothing"
                );
            }
            3 => {
                assert!(outcome.is_err(), "the panic reached its caller");
                assert_eq!(
                    row(&store, &key)?,
                    None,
                    "the panicking closure wrote nothing"
                );
            }
            _ => {
                assert!(matches!(outcome, Ok(Ok(()))), "thread {i}: {outcome:?}");
                match i % 3 {
                    0 => assert_eq!(row(&store, &key)?, Some(i as u64)),
                    1 => {
                        assert!(inbox.seen(&key)?);
                        assert_eq!(row(&store, &key)?, Some(i as u64));
                    }
                    _ => assert!(inbox.seen(&key)?),
                }
            }
        }
    }
    let after = store.commit_stats();
    let fsyncs = after.durable_commits - before.durable_commits;
    assert!(fsyncs >= 1);
    Ok(())
}

/// What a call of [`effects_of_64_threads_fail_and_panic_alone`] did.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Applied,
    Failed,
    Panicked,
}

#[test]
fn effects_of_64_threads_fail_and_panic_alone() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s.idem"))?;
    let inbox = store.inbox("fx")?;
    let (threads, rounds) = (64, 10);
    let barrier = Arc::new(Barrier::new(threads));
    let before = store.commit_stats();
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let inbox = inbox.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                let mut answers = Vec::new();
                for r in 0..rounds {
                    let n = i * rounds + r;
                    let key = format!("e{n}");
                    let out = catch_unwind(AssertUnwindSafe(|| {
                        inbox.claim_with(&key, t(0), |tx| {
                            // Every closure writes before it decides.
                            tx.open_table(ROWS)?.insert(key.as_str(), n as u64)?;
                            match n % 17 {
                                3 => Err(Error::InvalidInput {
                                    field: "test",
                                    reason: "fails after writing".into(),
                                }),
                                11 => panic!("panics after writing"),
                                _ => Ok(n),
                            }
                        })
                    }));
                    let outcome = match out {
                        Ok(Ok(Claim::Applied(v))) => {
                            assert_eq!(v, n, "{key}: another caller's answer");
                            Outcome::Applied
                        }
                        Ok(Err(Error::InvalidInput { .. })) => Outcome::Failed,
                        Err(_) => Outcome::Panicked,
                        other => panic!("{key}: {other:?}"),
                    };
                    answers.push((key, n, outcome));
                }
                answers
            })
        })
        .collect();
    let mut applied = 0;
    for h in handles {
        let answers = h.join().unwrap();
        assert_eq!(answers.len(), rounds, "one answer per call");
        for (key, n, outcome) in answers {
            let expected = match n % 17 {
                3 => Outcome::Failed,
                11 => Outcome::Panicked,
                _ => Outcome::Applied,
            };
            assert_eq!(outcome, expected, "{key}");
            if outcome == Outcome::Applied {
                applied += 1;
                assert!(inbox.seen(&key)?, "{key} claimed");
                assert_eq!(row(&store, &key)?, Some(n as u64), "{key}'s effect");
            } else {
                assert!(!inbox.seen(&key)?, "{key} left unclaimed");
                assert_eq!(row(&store, &key)?, None, "{key} wrote nothing");
            }
        }
    }
    assert_eq!(inbox.len()?, applied);
    // The effects shared their fsyncs.
    let fsyncs = store.commit_stats().durable_commits - before.durable_commits;
    assert!(fsyncs < applied, "{fsyncs} fsyncs for {applied} effects");
    Ok(())
}

#[test]
fn results_reach_the_right_callers_under_64_threads() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s.idem"))?;
    let inbox = store.inbox("gc")?;
    let threads = 64;
    let rounds = 20;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let inbox = inbox.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || -> Result<Vec<(String, bool)>> {
                barrier.wait();
                let mut got = Vec::new();
                for r in 0..rounds {
                    // An own key (always first) and a shared key (one winner).
                    let own = format!("own-{i}-{r}");
                    assert!(inbox.claim(&own, t(0))?, "{own} is new");
                    let shared = format!("shared-{r}");
                    got.push((shared.clone(), inbox.claim(&shared, t(0))?));
                    // An effect whose result names its caller.
                    let tagged = format!("tag-{i}-{r}");
                    let c = inbox.claim_with(&tagged, t(0), |_| Ok::<_, Error>(tagged.clone()))?;
                    assert_eq!(c, Claim::Applied(tagged.clone()));
                }
                Ok(got)
            })
        })
        .collect();
    let mut winners: HashMap<String, usize> = HashMap::new();
    for h in handles {
        for (key, won) in h.join().unwrap()? {
            if won {
                *winners.entry(key).or_default() += 1;
            }
        }
    }
    assert_eq!(winners.len(), rounds);
    assert!(winners.values().all(|&n| n == 1), "{winners:?}");
    assert_eq!(inbox.len()?, (threads * rounds * 2 + rounds) as u64);
    let stats = store.commit_stats();
    assert!(
        stats.durable_commits < (threads * rounds * 3) as u64,
        "calls shared fsyncs: {stats:?}"
    );
    Ok(())
}

/// Runs `threads` claimers against a disk that loses power at sync `cut`;
/// returns the keys acknowledged with `Ok` and the disk.
fn claim_until_power_loss(threads: usize, cut: u64) -> (BTreeSet<String>, FaultyDisk) {
    let disk = FaultyDisk::new();
    let store = Store::builder()
        .journal_size(5)
        .open_with_backend(disk.backend())
        .expect("open on a fresh disk");
    disk.lose_power_at_sync(disk.syncs() + cut);
    let inbox = store.inbox("acked").unwrap();
    let acked = Arc::new(Mutex::new(BTreeSet::new()));
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let inbox = inbox.clone();
            let store = store.clone();
            let acked = acked.clone();
            std::thread::spawn(move || {
                for n in 0.. {
                    let key = format!("t{i}-{n}");
                    let r = if n % 2 == 0 {
                        inbox.claim(&key, t(0)).map(|_| ())
                    } else {
                        store.write(|tx| {
                            inbox.claim_in(tx, &key, t(0))?;
                            tx.open_table(ROWS)?.insert(key.as_str(), 1)?;
                            Ok::<_, Error>(())
                        })
                    };
                    match r {
                        Ok(()) => {
                            acked.lock().insert(key);
                        }
                        Err(e) => {
                            assert!(e.is_storage(), "an I/O failure is a storage error: {e:?}");
                            break;
                        }
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    drop(inbox);
    drop(store);
    let acked = std::mem::take(&mut *acked.lock());
    (acked, disk)
}

#[test]
fn nothing_is_answered_before_its_commit_is_on_disk() -> Result<()> {
    for (threads, cut) in [(1, 7), (8, 5), (16, 23), (32, 40)] {
        let (acked, disk) = claim_until_power_loss(threads, cut);
        assert!(disk.is_dead());
        let reopened = Store::builder()
            .open_with_backend(FaultyDisk::from_image(disk.durable_image()).backend())?;
        let inbox = reopened.inbox("acked")?;
        for key in &acked {
            assert!(
                inbox.seen(key)?,
                "{key} was acknowledged but lost ({threads} threads, cut at sync {cut})"
            );
        }
        assert!(inbox.len()? >= acked.len() as u64);
    }
    Ok(())
}

/// A `Durability::None` store on `disk` that flushes every `flush_interval`.
fn none_store(disk: &FaultyDisk, flush_interval: std::time::Duration) -> Result<Store> {
    Store::builder()
        .durability(Durability::None)
        .flush_interval(flush_interval)
        .open_with_backend(disk.backend())
}

#[test]
fn durability_none_answers_without_an_fsync_per_call() -> Result<()> {
    let disk = FaultyDisk::new();
    let store = none_store(&disk, std::time::Duration::from_secs(3600))?;
    assert_eq!(store.durability(), Durability::None);
    let inbox = store.inbox("fast")?;
    let syncs = disk.syncs();
    for i in 0..100 {
        assert!(inbox.claim(&format!("k{i}"), t(0))?);
    }
    assert_eq!(
        disk.syncs(),
        syncs,
        "no fsync per claim under Durability::None"
    );
    Ok(())
}

#[test]
fn under_durability_none_sync_makes_every_earlier_answer_durable() -> Result<()> {
    let disk = FaultyDisk::new();
    let store = none_store(&disk, std::time::Duration::from_secs(3600))?;
    let inbox = store.inbox("fast")?;
    let syncs = disk.syncs();
    for i in 0..100 {
        assert!(inbox.claim(&format!("k{i}"), t(0))?);
    }
    store.sync()?;
    assert!(disk.syncs() > syncs, "sync() reaches the disk");
    assert!(inbox.claim("late", t(0))?);
    disk.lose_power();
    drop(inbox);
    drop(store);
    let reopened = Store::builder()
        .open_with_backend(FaultyDisk::from_image(disk.durable_image()).backend())?;
    let inbox = reopened.inbox("fast")?;
    assert_eq!(
        inbox.len()?,
        100,
        "everything before sync() survived; `late` was not flushed"
    );
    assert!(!inbox.seen("late")?);
    Ok(())
}

#[test]
fn durability_none_flushes_on_its_interval() -> Result<()> {
    let disk = FaultyDisk::new();
    let store = none_store(&disk, std::time::Duration::from_millis(5))?;
    let inbox = store.inbox("fast")?;
    assert!(inbox.claim("a", t(0))?);
    let syncs = disk.syncs();
    // The commit thread flushes on its own once the interval passes.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while disk.syncs() == syncs {
        assert!(std::time::Instant::now() < deadline, "no flush within 10 s");
        std::thread::yield_now();
    }
    Ok(())
}

#[test]
fn durability_none_flushes_on_close() -> Result<()> {
    let disk = FaultyDisk::new();
    // An interval no test outlives: only the close can flush.
    let store = none_store(&disk, std::time::Duration::from_secs(3600))?;
    let inbox = store.inbox("fast")?;
    assert!(inbox.claim("a", t(0))?);
    assert!(inbox.claim("b", t(0))?);
    drop(inbox);
    drop(store);
    let reopened = Store::builder()
        .open_with_backend(FaultyDisk::from_image(disk.durable_image()).backend())?;
    let inbox = reopened.inbox("fast")?;
    assert!(
        inbox.seen("a")? && inbox.seen("b")?,
        "closing the store flushed"
    );
    Ok(())
}

#[test]
fn durability_none_answers_are_seen_by_every_later_call() -> Result<()> {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = Store::builder()
        .durability(Durability::None)
        .flush_interval(std::time::Duration::from_secs(3600))
        .open(dir.path().join("none.idem"))?;
    let inbox = store.inbox("fast")?;
    for i in 0..50 {
        assert!(inbox.claim(&format!("k{i}"), t(i))?);
    }
    // Another thread reads what was answered.
    let reader = inbox.clone();
    let seen = std::thread::spawn(move || reader.seen("k49"))
        .join()
        .expect("reader")?;
    assert!(seen);
    assert_eq!(inbox.len()?, 50);
    // A caller transaction sees the answered claims and adds its own.
    assert!(inbox.claim("k50", t(50))?);
    let (again, fresh) = store.write(|tx| -> Result<_> {
        Ok((
            inbox.claim_in(tx, "k50", t(51))?,
            inbox.claim_in(tx, "k51", t(51))?,
        ))
    })?;
    assert!(!again && fresh);
    // Duplicates are told so, alone and in bulk.
    assert!(!inbox.claim("k0", t(99))?);
    assert_eq!(inbox.claim_many(["k1", "new"], t(99))?, [false, true]);
    // Compaction and integrity checks need the file to themselves.
    assert!(inbox.claim("k52", t(52))?);
    assert!(store.check_integrity()?, "a clean file");
    store.compact()?;
    assert_eq!(inbox.len()?, 54);
    assert_eq!(inbox.seen_at("k52")?, Some(t(52)));
    Ok(())
}
