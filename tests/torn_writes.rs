//! Power loss that tears and reorders. The disk keeps every write since the
//! last `sync_data` in flight; when the power goes, any subset of them
//! lands, in any order, each torn at 512-byte sector boundaries
//! ([`FaultyDisk::torn_image`]). Swept over a concurrent workload (claims
//! with effects and the journal merges they start, enqueues, claims and
//! settlements, idempotency completions, a compaction) at every fsync,
//! with several tearings of each: after each cut the file opens (redb
//! repairs it), every acknowledged call is there, nothing unacknowledged
//! is half there, and every index check passes.
//!
//! The bounded form runs in `cargo test`; a longer one:
//! `IDEMSTORE_TORN_SUBSETS=200 IDEMSTORE_TORN_ROUNDS=24 cargo test --release --test torn_writes`.

mod common;

use std::collections::BTreeSet;

use common::{FaultyDisk, t};
use idemstore::redb::TableDefinition;
use idemstore::{Begin, Error, NewEntry, OutboxStatus, Settlement, Store};

const EFFECTS: TableDefinition<&str, u64> = TableDefinition::new("app.effects");

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Tearings tried at each cut point.
fn subsets() -> u64 {
    env_or("IDEMSTORE_TORN_SUBSETS", 8).max(2)
}

/// Calls of each kind in one run of the workload.
fn rounds() -> u64 {
    env_or("IDEMSTORE_TORN_ROUNDS", 6).max(2)
}

/// The calls that returned `Ok` in one run.
#[derive(Debug, Default)]
struct Acked {
    /// Inbox keys claimed with an effect row.
    claims: BTreeSet<String>,
    /// Outbox entries (idempotency keys, destination `mail`) enqueued.
    enqueued: BTreeSet<String>,
    /// Entries settled `Completed`.
    settled: BTreeSet<String>,
    /// Idempotency keys completed (their body is [`body`]).
    completed: BTreeSet<String>,
}

/// The response body stored for idempotency key `key`: long enough to
/// span sectors, so a torn one would show.
fn body(key: &str) -> Vec<u8> {
    key.bytes().cycle().take(1500).collect()
}

fn open(disk: &FaultyDisk, shared: bool) -> Store {
    // A small journal, so that claims start merges.
    Store::builder()
        .journal_size(3)
        .shared(shared)
        .open_with_backend(disk.backend())
        .expect("a fresh disk opens")
}

/// Claims with effects, outbox traffic and idempotency completions on
/// three threads, while this one compacts the file halfway. Every call
/// fails once the power is gone; a failure is recorded as not acknowledged.
fn workload(store: &Store) -> Acked {
    let n = rounds();
    let storage = |e: &Error| assert!(e.is_storage(), "an I/O fault is Error::Storage: {e:?}");
    std::thread::scope(|s| {
        let claims = s.spawn(|| {
            let inbox = store.inbox("torn").expect("a handle does no I/O");
            let mut acked = BTreeSet::new();
            for i in 0..n {
                let key = format!("c{i:03}");
                let r = inbox.claim_with(&key, t(0), |tx| {
                    tx.open_table(EFFECTS)?.insert(key.as_str(), i)?;
                    Ok::<_, Error>(())
                });
                match r {
                    Ok(c) => {
                        assert!(c.is_applied());
                        acked.insert(key);
                    }
                    Err(e) => storage(&e),
                }
            }
            acked
        });
        let outbox = s.spawn(|| {
            let outbox = store.outbox();
            let (mut enqueued, mut settled) = (BTreeSet::new(), BTreeSet::new());
            for i in 0..n {
                let key = format!("o{i:03}");
                let entry = NewEntry::new("notify", "mail", key.clone(), vec![7; 700]);
                match outbox.enqueue(entry, t(0)) {
                    Ok(_) => {
                        enqueued.insert(key);
                    }
                    Err(e) => storage(&e),
                }
                let claimed = match outbox.claim_due(t(0), 1, "w") {
                    Ok(c) => c,
                    Err(e) => {
                        storage(&e);
                        continue;
                    }
                };
                for c in claimed {
                    match outbox.settle(c.fence(), Settlement::Completed, t(1)) {
                        Ok(()) => {
                            settled.insert(c.idempotency_key.clone());
                        }
                        Err(e) => storage(&e),
                    }
                }
            }
            (enqueued, settled)
        });
        let keys = s.spawn(|| {
            let keys = store.idempotency_keys();
            let mut completed = BTreeSet::new();
            for i in 0..n {
                let key = format!("k{i:03}");
                let r = match keys.begin("", &key, "fp", t(0)) {
                    Ok(Begin::Proceed(r)) => r,
                    Ok(other) => panic!("{key} was never begun before: {other:?}"),
                    Err(e) => {
                        storage(&e);
                        continue;
                    }
                };
                match keys.complete(&r, r.response(201, body(&key), t(0)), t(0)) {
                    Ok(stored) => {
                        assert!(stored);
                        completed.insert(key);
                    }
                    Err(e) => storage(&e),
                }
            }
            completed
        });
        // A compaction among the others' calls: it waits for them, then
        // rewrites the file in commits of its own.
        std::thread::yield_now();
        if let Err(e) = store.compact() {
            storage(&e);
        }
        let (enqueued, settled) = outbox.join().expect("the outbox thread");
        Acked {
            claims: claims.join().expect("the claims thread"),
            enqueued,
            settled,
            completed: keys.join().expect("the keys thread"),
        }
    })
}

/// Opens the platter `image` after a cut and checks it against what was
/// acknowledged before the cut. Returns how many rows (claims, entries,
/// completed entries, keys, responses) it holds.
fn check(
    image: Vec<u8>,
    shared: bool,
    acked: &Acked,
    what: &str,
) -> Result<usize, Box<dyn std::error::Error>> {
    let store = Store::builder()
        .shared(shared)
        .open_with_backend(FaultyDisk::from_image(image).backend())
        .map_err(|e| format!("{what}: the file does not open: {e}"))?;
    assert!(store.check_integrity()?, "{what}: integrity");
    assert_eq!(store.check_inbox_indexes()?, Vec::<String>::new(), "{what}");
    let inbox = store.inbox("torn")?;
    let claimed: BTreeSet<String> = inbox
        .list(None, usize::MAX)?
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    let effects = common::effect_keys(&store)?;
    for key in &acked.claims {
        assert!(
            claimed.contains(key),
            "{what}: acknowledged claim {key} lost"
        );
    }
    // A claim and its effect are one commit: both or neither.
    assert_eq!(claimed, effects, "{what}: claims and effects differ");

    let outbox = store.outbox();
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new(), "{what}");
    for key in &acked.enqueued {
        assert!(
            outbox.find("mail", key)?.is_some(),
            "{what}: acknowledged enqueue {key} lost"
        );
    }
    for key in &acked.settled {
        let record = outbox.find("mail", key)?.expect("settled, so enqueued");
        assert_eq!(
            record.entry.status,
            OutboxStatus::Completed,
            "{what}: acknowledged settlement of {key} lost"
        );
    }

    let keys = store.idempotency_keys();
    assert_eq!(keys.check_indexes()?, Vec::<String>::new(), "{what}");
    for key in &acked.completed {
        assert!(
            keys.response("", key)?.is_some(),
            "{what}: acknowledged completion of {key} lost"
        );
    }
    let listed = keys.list(None, usize::MAX)?;
    let mut responses = 0;
    for entry in &listed {
        if let Some(r) = keys.response("", &entry.key)? {
            assert_eq!(r.response_body, body(&entry.key), "{what}: torn response");
            responses += 1;
        }
    }
    let counts = outbox.counts()?;
    let entries = counts.pending + counts.dispatching + counts.completed;
    Ok(claimed.len() + usize::try_from(entries + counts.completed)? + listed.len() + responses)
}

/// Cuts the power at every fsync of the workload in turn and checks
/// [`subsets`] tearings of each cut.
fn sweep(shared: bool) -> TestResult {
    let first = {
        let disk = FaultyDisk::new();
        let _store = open(&disk, shared);
        disk.syncs()
    };
    let tearings = subsets();
    let (mut cuts, mut images, mut in_flight) = (0u64, 0u64, 0usize);
    // Tearings that kept more than the synced state held: some of the cut
    // commit's writes landed and the reopened file shows it.
    let mut landed = 0u64;
    // The workload is concurrent: its number of fsyncs varies from run to
    // run. Cut at each next one until a run ends before its cut.
    for n in first + 1.. {
        let disk = FaultyDisk::new();
        let store = open(&disk, shared);
        disk.lose_power_at_sync(n);
        let acked = workload(&store);
        drop(store);
        if !disk.is_dead() {
            break;
        }
        cuts += 1;
        in_flight = in_flight.max(disk.in_flight());
        let mut synced = 0;
        for seed in 0..tearings {
            let what = format!("power lost at sync {n}, tearing {seed} (shared: {shared})");
            let rows = check(disk.torn_image(seed), shared, &acked, &what)?;
            if seed == 0 {
                // Seed 0 lands nothing in flight.
                synced = rows;
            } else if rows > synced {
                landed += 1;
            }
            images += 1;
        }
        assert!(cuts < 10_000, "the workload never ended");
    }
    common::report(&format!(
        "torn writes (shared: {shared}): {cuts} cut points × {tearings} tearings = {images} \
         images checked ({landed} showed part of what was in flight), up to {in_flight} writes \
         in flight at a cut, 0 lost, 0 torn"
    ));
    assert!(cuts >= 20, "only {cuts} cut points");
    Ok(())
}

#[test]
fn a_power_loss_that_tears_and_reorders_writes_loses_nothing_acknowledged() -> TestResult {
    sweep(false)
}

#[test]
fn in_a_shared_store_torn_and_reordered_writes_lose_nothing_acknowledged() -> TestResult {
    sweep(true)
}
