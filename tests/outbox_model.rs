//! Seeded random operation sequences against an in-memory model of the
//! outbox, including reopens of a file store. After every operation the
//! store must agree with the model (records with their attempt history,
//! order, counts, next due time, dedup) and `check_indexes` must find
//! nothing. Operators cancel too.

use std::path::Path;

use idemstore::{
    Durability, Enqueued, Fence, NewEntry, Outbox, OutboxId, Result, Settlement, Store,
};

// The shared test code also holds the fuzz targets, which this test does not
// use; it takes the outbox model, the clock and the generator from it.
#[allow(dead_code, unused_imports)]
mod fuzzing;

use fuzzing::outbox_model::{Change, Entry, OutboxModel, Record, outcome};
use fuzzing::{Rng, t};

const COMMANDS: [&str; 3] = ["cmd-a", "cmd-b", "cmd-c"];
const DESTINATIONS: [&str; 2] = ["billing", "mail"];
const KEYS: u64 = 12;

/// Draws over the shared xorshift generator.
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[usize::try_from(self.below(items.len() as u64)).unwrap()]
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// A time near `now`, in seconds.
    fn near(&mut self, now: i64) -> i64 {
        now - 5 + i64::try_from(self.below(30)).unwrap()
    }
}

fn new_entry(rng: &mut Rng, now: i64) -> NewEntry {
    let mut e = NewEntry::new(
        *rng.pick(&COMMANDS),
        *rng.pick(&DESTINATIONS),
        format!("key-{}", rng.below(KEYS)),
        rng.below(1u64 << 32).to_le_bytes().to_vec(),
    );
    if rng.chance(30) {
        e = e.not_before(t(rng.near(now)));
    }
    e
}

fn settlement(rng: &mut Rng, now: i64) -> (Settlement, Change) {
    match rng.below(5) {
        0 => (Settlement::Completed, Change::Complete(now)),
        1 => {
            let at = rng.near(now);
            (
                Settlement::Failed {
                    reason: "http_503".into(),
                    next_attempt_at: Some(t(at)),
                },
                Change::Fail("http_503".into(), Some(at), now),
            )
        }
        2 => (
            Settlement::Failed {
                reason: "http_400 (bad request)".into(),
                next_attempt_at: None,
            },
            Change::Fail("http_400 (bad request)".into(), None, now),
        ),
        3 => {
            let remote = rng.chance(50).then(|| format!("ref-{}", rng.below(100)));
            (
                Settlement::OutcomeUnknown {
                    remote_ref: remote.clone(),
                },
                Change::Unknown(remote, now),
            )
        }
        _ => {
            let at = rng.near(now);
            (
                Settlement::Rescheduled {
                    next_attempt_at: t(at),
                },
                Change::Reschedule(at, now),
            )
        }
    }
}

/// An id to act on: mostly a live one (more often one that is being
/// dispatched, where most settlements apply), sometimes purged or never
/// issued.
fn pick_id(rng: &mut Rng, model: &OutboxModel) -> u64 {
    let in_flight = model.in_flight();
    if !in_flight.is_empty() && rng.chance(60) {
        return *rng.pick(&in_flight);
    }
    let live: Vec<u64> = model.records.keys().copied().collect();
    if live.is_empty() || rng.chance(10) {
        1 + rng.below(model.next_id + 2)
    } else {
        *rng.pick(&live)
    }
}

fn open(path: Option<&Path>) -> Result<Store> {
    match path {
        // Clean closes flush, so Durability::None loses nothing across a reopen
        // and keeps the test fast.
        Some(p) => Store::builder().durability(Durability::None).open(p),
        None => Store::in_memory(),
    }
}

fn step(rng: &mut Rng, model: &mut OutboxModel, outbox: &Outbox, now: i64) -> Result<String> {
    let choice = rng.below(100);
    let what = match choice {
        0..=19 => {
            let e = new_entry(rng, now);
            let got = outbox.enqueue(e.clone(), t(now))?;
            assert_eq!(got, model.enqueue(&e, now), "enqueue {e:?}");
            format!("enqueue {e:?}")
        }
        20..=24 => {
            let batch: Vec<NewEntry> = (0..=rng.below(3)).map(|_| new_entry(rng, now)).collect();
            let got = outbox.enqueue_many(batch.clone(), t(now))?;
            let want: Vec<Enqueued> = batch.iter().map(|e| model.enqueue(e, now)).collect();
            assert_eq!(got, want, "enqueue_many");
            format!("enqueue_many {}", batch.len())
        }
        25..=39 => {
            let limit = usize::try_from(rng.below(4)).unwrap();
            let worker = format!("w{}", rng.below(3));
            let got: Vec<Entry> = outbox
                .claim_due(t(now), limit, &worker)?
                .iter()
                .map(Entry::from)
                .collect();
            assert_eq!(got, model.claim(now, limit, &worker), "claim_due");
            format!("claim_due {limit}")
        }
        40..=59 => {
            let id = pick_id(rng, model);
            let current = model.records.get(&id).map_or(0, |r| r.entry.attempt_count);
            let attempt = current.saturating_sub(u32::from(rng.chance(20)));
            let (s, change) = settlement(rng, now);
            let fence = Fence {
                id: OutboxId(id),
                attempt,
            };
            let what = format!("settle {fence} {s:?}");
            let got = outcome(&outbox.settle(fence, s, t(now)), &what);
            assert_eq!(got, model.change(id, &change, Some(attempt)), "{what}");
            what
        }
        60..=74 => {
            let id = pick_id(rng, model);
            let (_, change) = settlement(rng, now);
            let got = match &change {
                Change::Complete(_) => outbox.mark_completed(OutboxId(id), t(now)),
                Change::Fail(reason, retry, _) => {
                    outbox.mark_failed(OutboxId(id), reason, retry.map(t), t(now))
                }
                Change::Unknown(remote, _) => {
                    outbox.mark_outcome_unknown(OutboxId(id), remote.as_deref())
                }
                Change::Reschedule(at, _) | Change::Requeue(at) => {
                    outbox.reschedule(OutboxId(id), t(*at))
                }
                Change::Cancel(_) => outbox.cancel(OutboxId(id), t(now)),
            };
            let what = format!("mark {id} {change:?}");
            assert_eq!(
                outcome(&got, &what),
                model.change(id, &change, None),
                "{what}"
            );
            what
        }
        75..=78 => {
            let id = pick_id(rng, model);
            let at = rng.near(now);
            let what = format!("requeue {id}");
            let got = outcome(&outbox.requeue(OutboxId(id), t(at)), &what);
            assert_eq!(got, model.change(id, &Change::Requeue(at), None), "{what}");
            what
        }
        79..=81 => {
            let id = pick_id(rng, model);
            let what = format!("cancel {id}");
            let got = outcome(&outbox.cancel(OutboxId(id), t(now)), &what);
            assert_eq!(got, model.change(id, &Change::Cancel(now), None), "{what}");
            what
        }
        82..=89 => {
            let cutoff = now - i64::try_from(rng.below(20)).unwrap();
            let got = outbox.release_expired_claims(t(cutoff))?;
            assert_eq!(got, model.release(cutoff), "release before {cutoff}");
            format!("release {cutoff}")
        }
        _ => {
            let before = now - i64::try_from(rng.below(40)).unwrap();
            let got = outbox.purge_finished(t(before))?;
            assert_eq!(got, model.purge(before), "purge before {before}");
            format!("purge {before}")
        }
    };
    Ok(what)
}

fn verify(rng: &mut Rng, model: &OutboxModel, outbox: &Outbox, what: &str) -> Result<()> {
    for cmd in COMMANDS {
        let mut want: Vec<&Record> = model
            .records
            .values()
            .filter(|r| r.entry.command_id == cmd)
            .collect();
        want.sort_by_key(|r| (r.entry.created_at, r.entry.id));
        let got: Vec<Record> = outbox
            .list_for_command(cmd)?
            .iter()
            .map(Record::from)
            .collect();
        assert_eq!(
            got.iter().collect::<Vec<_>>(),
            want,
            "after {what}: records of {cmd}"
        );
    }
    assert_eq!(outbox.counts()?, model.counts(), "after {what}: counts");
    assert_eq!(
        outbox.next_due()?,
        model.next_due(),
        "after {what}: next_due"
    );
    let dest = *rng.pick(&DESTINATIONS);
    let key = format!("key-{}", rng.below(KEYS));
    let want = model
        .dedup
        .get(&(dest.to_owned(), key.clone()))
        .map(|id| model.records[id].clone());
    assert_eq!(
        outbox.find(dest, &key)?.as_ref().map(Record::from),
        want,
        "after {what}: find"
    );
    assert_eq!(
        outbox.check_indexes()?,
        Vec::<String>::new(),
        "after {what}"
    );
    Ok(())
}

fn run(seed: u64, ops: usize, path: Option<&Path>) -> Result<()> {
    let mut rng = Rng(seed | 1);
    let mut model = OutboxModel::default();
    let mut store = open(path)?;
    let mut now = 0;
    for i in 0..ops {
        now += i64::try_from(rng.below(4)).unwrap();
        if path.is_some() && rng.chance(2) {
            drop(store);
            store = open(path)?;
            verify(&mut rng, &model, &store.outbox(), "reopen")?;
            continue;
        }
        let outbox = store.outbox();
        let what = step(&mut rng, &mut model, &outbox, now)?;
        verify(
            &mut rng,
            &model,
            &outbox,
            &format!("op {i} (seed {seed}): {what}"),
        )?;
    }
    Ok(())
}

#[test]
fn random_sequences_in_memory_match_the_model() -> Result<()> {
    for seed in [1, 0x5eed, 0xdead_beef] {
        run(seed, 700, None)?;
    }
    Ok(())
}

#[test]
fn random_sequences_with_reopens_match_the_model() -> Result<()> {
    for seed in [7, 0x00c0_ffee] {
        let dir = tempfile::tempdir().unwrap();
        run(seed, 500, Some(&dir.path().join("model.idem")))?;
    }
    Ok(())
}
