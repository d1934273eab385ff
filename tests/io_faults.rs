//! I/O faults through redb's storage seam: a failed write, a failed fsync, a
//! power loss at the Nth fsync. Swept over every fault point of a workload:
//! a call that returned `Ok` survives; after a power loss a call that
//! returned `Err` left nothing; the store always reopens; an I/O error is an
//! `Error::Storage`, never a panic.

mod common;

use std::collections::BTreeSet;

use common::{FaultyDisk, t};
use idemstore::redb::TableDefinition;
use idemstore::{Error, Result, Store};

const EFFECTS: TableDefinition<&str, u64> = TableDefinition::new("app.effects");

#[derive(Debug, Default)]
struct Outcome {
    acked: BTreeSet<String>,
    failed: BTreeSet<String>,
}

/// A fixed single-threaded workload of claims, effects and caller writes.
fn workload(store: &Store) -> Outcome {
    let mut out = Outcome::default();
    let inbox = match store.inbox("faults") {
        Ok(i) => i,
        Err(e) => panic!("opening a handle does no I/O: {e}"),
    };
    for i in 0..24u64 {
        let key = format!("k{i:02}");
        let r: Result<()> = match i % 4 {
            0 => inbox.claim(&key, t(0)).map(|first| assert!(first)),
            1 => inbox
                .claim_with(&key, t(0), |tx| {
                    tx.open_table(EFFECTS)?.insert(key.as_str(), i)?;
                    Ok::<_, Error>(())
                })
                .map(|c| assert!(c.is_applied())),
            2 => store.write(|tx| {
                assert!(inbox.claim_in(tx, &key, t(0))?);
                tx.open_table(EFFECTS)?.insert(key.as_str(), i)?;
                Ok(())
            }),
            _ => inbox
                .claim_many([key.clone()], t(0))
                .map(|v| assert_eq!(v, vec![true])),
        };
        match r {
            Ok(()) => {
                out.acked.insert(key);
            }
            Err(e) => {
                assert!(e.is_storage(), "an I/O fault is Error::Storage, got {e:?}");
                out.failed.insert(key);
            }
        }
    }
    out
}

/// What a reopened store holds: keys claimed, and keys with an effect row
/// (for the keys whose call writes one).
fn contents(image: Vec<u8>) -> Result<(BTreeSet<String>, BTreeSet<String>)> {
    let store = Store::builder().open_with_backend(FaultyDisk::from_image(image).backend())?;
    let inbox = store.inbox("faults")?;
    let claimed = inbox
        .list(None, usize::MAX)?
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    let effects = common::effect_keys(&store)?;
    Ok((claimed, effects))
}

fn has_effect(key: &str) -> bool {
    let i: u64 = key[1..].parse().unwrap();
    i % 4 == 1 || i % 4 == 2
}

/// Checks one faulted run: `strict` when the image is what survived a power
/// loss (then failed calls must have left nothing).
fn check(out: &Outcome, image: Vec<u8>, strict: bool, what: &str) -> Result<()> {
    let (claimed, effects) = contents(image)?;
    for key in &out.acked {
        assert!(claimed.contains(key), "{what}: acknowledged {key} was lost");
        if has_effect(key) {
            assert!(effects.contains(key), "{what}: {key}'s effect was lost");
        }
    }
    for key in &claimed {
        // A claim and its effect are one commit: never one without the other.
        assert_eq!(
            has_effect(key),
            effects.contains(key),
            "{what}: {key} half-applied"
        );
    }
    if strict {
        for key in &out.failed {
            assert!(
                !claimed.contains(key),
                "{what}: failed call {key} left its write"
            );
        }
    }
    Ok(())
}

fn fresh_store(disk: &FaultyDisk) -> Store {
    open_store(disk, false)
}

/// A store on `disk`, shared between processes or not.
fn open_store(disk: &FaultyDisk, shared: bool) -> Store {
    // A small journal, so that faults also hit merges.
    Store::builder()
        .journal_size(3)
        .shared(shared)
        .open_with_backend(disk.backend())
        .expect("a fresh disk opens")
}

#[test]
fn a_failed_write_at_any_point_loses_no_acknowledged_call() -> Result<()> {
    // Count the writes of a clean run, then fail each one in turn.
    let clean = FaultyDisk::new();
    let base = {
        let store = fresh_store(&clean);
        let before = clean.writes();
        let out = workload(&store);
        assert_eq!(out.acked.len(), 24);
        (before, clean.writes())
    };
    let mut points = 0;
    for n in base.0 + 1..=base.1 {
        let disk = FaultyDisk::new();
        let store = fresh_store(&disk);
        disk.fail_write(n);
        let out = workload(&store);
        drop(store);
        // The process lives on: the page cache (live image) is what a reopen sees.
        check(
            &out,
            disk.durable_image(),
            false,
            &format!("write {n} failed, power lost"),
        )?;
        check(&out, disk.live_image(), false, &format!("write {n} failed"))?;
        points += 1;
    }
    common::report(&format!("io faults: swept {points} failed-write points"));
    assert!(points > 20);
    Ok(())
}

/// The fsyncs of a clean run of the workload: the first one's number minus
/// one, and the last one's.
fn sync_points() -> (u64, u64) {
    sync_points_of(false)
}

fn sync_points_of(shared: bool) -> (u64, u64) {
    let clean = FaultyDisk::new();
    let store = open_store(&clean, shared);
    let before = clean.syncs();
    workload(&store);
    (before, clean.syncs())
}

#[test]
fn a_failed_fsync_at_any_point_fails_its_call_and_loses_nothing_acknowledged() -> Result<()> {
    let (first, last) = sync_points();
    let mut points = 0;
    for n in first + 1..=last {
        // A failed fsync: the call fails, and a power loss right after keeps
        // nothing of it.
        let disk = FaultyDisk::new();
        let store = fresh_store(&disk);
        disk.fail_sync(n);
        let out = workload(&store);
        assert!(
            !out.failed.is_empty(),
            "sync {n} failed but every call succeeded"
        );
        drop(store);
        check(
            &out,
            disk.durable_image(),
            true,
            &format!("sync {n} failed"),
        )?;
        points += 1;
    }
    common::report(&format!("io faults: swept {points} sync-failure points"));
    assert!(points >= 20);
    Ok(())
}

#[test]
fn a_power_loss_at_any_fsync_loses_no_acknowledged_call_and_keeps_no_failed_one() -> Result<()> {
    power_loss_sweep(false)
}

#[test]
fn in_a_shared_store_a_power_loss_at_any_fsync_loses_no_acknowledged_call() -> Result<()> {
    // Shared: every commit is durable and caller closures lead their own
    // batch, a different path to the disk.
    power_loss_sweep(true)
}

fn power_loss_sweep(shared: bool) -> Result<()> {
    let (first, last) = sync_points_of(shared);
    let mut points = 0;
    for n in first + 1..=last {
        // Power lost at the Nth fsync.
        let disk = FaultyDisk::new();
        let store = open_store(&disk, shared);
        disk.lose_power_at_sync(n);
        let out = workload(&store);
        drop(store);
        check(
            &out,
            disk.durable_image(),
            true,
            &format!("power lost at sync {n} (shared: {shared})"),
        )?;
        points += 1;
    }
    common::report(&format!(
        "io faults: swept {points} power-loss points (shared: {shared})"
    ));
    assert!(points >= 20);
    Ok(())
}

/// Old rows per maintenance call: a little over one chunk of 1024, so a
/// power loss can fall between the first chunk's commit and the last's.
const OLD: usize = 1200;

/// Old rows for the maintenance calls: `OLD` entries finished at t(1) or
/// t(2), one finished at t(10), `OLD + 1` claimed at t(1) (the reaper's);
/// `OLD` inbox keys claimed at t(1), five at t(10). Returns the disk image.
fn old_rows() -> Result<Vec<u8>> {
    let disk = FaultyDisk::new();
    let store = Store::builder().open_with_backend(disk.backend())?;
    let outbox = store.outbox();
    let entries = |dest: &'static str, n: usize| {
        (0..n)
            .map(move |i| idemstore::NewEntry::new("c", dest, format!("k{i}"), b"payload".to_vec()))
    };
    outbox.enqueue_many(entries("d", OLD + 2), t(0))?;
    let claimed = outbox.claim_due(t(0), OLD + 1, "w")?;
    let done = |range: std::ops::Range<usize>| {
        claimed[range]
            .iter()
            .map(|c| (c.fence(), idemstore::Settlement::Completed))
            .collect::<Vec<_>>()
    };
    for (range, at) in [
        (0..OLD / 2, t(1)),
        (OLD / 2..OLD, t(2)),
        (OLD..OLD + 1, t(10)),
    ] {
        let settled = outbox.settle_many(done(range), at)?;
        assert!(settled.iter().all(Result::is_ok));
    }
    outbox.enqueue_many(entries("r", OLD), t(0))?;
    assert_eq!(outbox.claim_due(t(1), OLD + 1, "w")?.len(), OLD + 1);
    let inbox = store.inbox("old")?;
    inbox.claim_many((0..OLD).map(|i| format!("e{i}")), t(1))?;
    inbox.claim_many((0..5).map(|i| format!("new{i}")), t(10))?;
    drop(store);
    Ok(disk.durable_image())
}

/// A maintenance call of [`a_power_loss_midway_through_maintenance_leaves_whole_chunks_done`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Maintenance {
    Purge,
    Prune,
    Release,
}

/// How much of `what` a store reopened after it was cut short had done,
/// checking that the store is consistent and that only doomed rows went:
/// `(done, all)`.
fn done_after(store: &Store, what: Maintenance) -> Result<(u64, u64)> {
    let outbox = store.outbox();
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new(), "{what:?}");
    assert_eq!(
        store.check_inbox_indexes()?,
        Vec::<String>::new(),
        "{what:?}"
    );
    let counts = outbox.counts()?;
    Ok(match what {
        Maintenance::Purge => {
            assert_eq!(counts.dispatching, OLD as u64 + 1);
            assert!(
                outbox.find("d", &format!("k{OLD}"))?.is_some(),
                "finished at t(10)"
            );
            (OLD as u64 + 1 - counts.completed, OLD as u64)
        }
        Maintenance::Prune => {
            let inbox = store.inbox("old")?;
            assert!(inbox.seen("new0")? && inbox.seen("new4")?);
            let left = inbox.len()?;
            assert_eq!(inbox.list(None, usize::MAX)?.len() as u64, left);
            (OLD as u64 + 5 - left, OLD as u64)
        }
        Maintenance::Release => {
            assert_eq!(counts.completed, OLD as u64 + 1);
            assert_eq!(counts.pending + counts.dispatching, OLD as u64 + 1);
            (counts.pending, OLD as u64 + 1)
        }
    })
}

#[test]
fn a_power_loss_midway_through_maintenance_leaves_whole_chunks_done() -> Result<()> {
    let image = old_rows()?;
    for what in [Maintenance::Purge, Maintenance::Prune, Maintenance::Release] {
        let mut partial = 0;
        for k in 1..=8 {
            let disk = FaultyDisk::from_image(image.clone());
            let store = Store::builder().open_with_backend(disk.backend())?;
            disk.lose_power_at_sync(disk.syncs() + k);
            let out = match what {
                Maintenance::Purge => store.outbox().purge_finished(t(5)),
                Maintenance::Prune => store.inbox("old")?.prune(t(5)),
                Maintenance::Release => store
                    .outbox()
                    .release_expired_claims(t(5))
                    .map(|ids| ids.len() as u64),
            };
            if let Err(e) = &out {
                assert!(e.is_storage(), "{e:?}");
            }
            drop(store);
            let store = Store::builder()
                .open_with_backend(FaultyDisk::from_image(disk.durable_image()).backend())?;
            let (done, all) = done_after(&store, what)?;
            assert!(
                done % 1024 == 0 || done == all,
                "{what:?} cut at its {k}th sync: {done} done, not whole chunks"
            );
            if 0 < done && done < all {
                partial += 1;
            }
            if out.is_ok() {
                // The call finished before the power loss: later ones would too.
                break;
            }
        }
        assert!(partial > 0, "no power loss left a {what:?} partly done");
    }
    Ok(())
}
