//! Seeded random operation sequences against an in-memory model of the
//! outbox, including reopens of a file store. After every operation the
//! store must agree with the model (records, order, counts, next due time,
//! dedup) and `check_indexes` must find nothing.

use std::collections::BTreeMap;
use std::path::Path;

use chrono::{DateTime, TimeZone, Utc};
use idemstore::{
    Durability, Enqueued, Error, Fence, NewEntry, Outbox, OutboxClaim, OutboxCounts, OutboxEntry,
    OutboxId, OutboxRecord, OutboxStatus, Result, Settlement, Store,
};

const COMMANDS: [&str; 3] = ["cmd-a", "cmd-b", "cmd-c"];
const DESTINATIONS: [&str; 2] = ["billing", "mail"];
const KEYS: u64 = 12;

fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

/// xorshift64*: small, deterministic, no dependencies.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    NotFound,
    Conflict,
}

fn outcome<T>(r: &Result<T>) -> Outcome {
    match r {
        Ok(_) => Outcome::Ok,
        Err(Error::NotFound) => Outcome::NotFound,
        Err(Error::Conflict { .. }) => Outcome::Conflict,
        Err(e) => panic!("unexpected error: {e}"),
    }
}

/// A single-entry change, as the model sees it.
#[derive(Debug, Clone)]
enum Change {
    Complete(i64),
    Fail(String, Option<i64>, i64),
    Unknown(Option<String>),
    Reschedule(i64),
    Requeue(i64),
}

#[derive(Default)]
struct Model {
    records: BTreeMap<u64, OutboxRecord>,
    dedup: BTreeMap<(String, String), u64>,
    next_id: u64,
}

fn due(e: &OutboxEntry) -> DateTime<Utc> {
    e.next_attempt_at.unwrap_or(e.created_at)
}

impl Model {
    fn enqueue(&mut self, n: &NewEntry, now: i64) -> Enqueued {
        let key = (n.destination.clone(), n.idempotency_key.clone());
        if let Some(id) = self.dedup.get(&key) {
            return Enqueued::Duplicate(OutboxId(*id));
        }
        self.next_id += 1;
        let id = self.next_id;
        self.dedup.insert(key, id);
        self.records.insert(
            id,
            OutboxRecord {
                entry: OutboxEntry {
                    id: OutboxId(id),
                    command_id: n.command_id.clone(),
                    destination: n.destination.clone(),
                    idempotency_key: n.idempotency_key.clone(),
                    payload: n.payload.clone(),
                    status: OutboxStatus::Pending,
                    attempt_count: 0,
                    next_attempt_at: n.not_before,
                    created_at: t(now),
                    completed_at: None,
                },
                claim: None,
                last_failure: None,
                remote_ref: None,
            },
        );
        Enqueued::New(OutboxId(id))
    }

    fn claim(&mut self, now: i64, limit: usize, worker: &str) -> Vec<OutboxEntry> {
        let mut due_now: Vec<(DateTime<Utc>, u64)> = self
            .records
            .values()
            .filter(|r| r.entry.status == OutboxStatus::Pending && due(&r.entry) <= t(now))
            .map(|r| (due(&r.entry), r.entry.id.0))
            .collect();
        due_now.sort_unstable();
        due_now.truncate(limit);
        due_now
            .into_iter()
            .map(|(_, id)| {
                let r = self.records.get_mut(&id).unwrap();
                r.entry.status = OutboxStatus::Dispatching;
                r.entry.attempt_count += 1;
                r.claim = Some(OutboxClaim {
                    worker_id: worker.to_owned(),
                    claimed_at: t(now),
                });
                r.entry.clone()
            })
            .collect()
    }

    fn release(&mut self, cutoff: i64) -> Vec<OutboxId> {
        let mut expired: Vec<(DateTime<Utc>, u64)> = self
            .records
            .values()
            .filter(|r| r.entry.status == OutboxStatus::Dispatching)
            .map(|r| (r.claim.as_ref().unwrap().claimed_at, r.entry.id.0))
            .filter(|(at, _)| *at < t(cutoff))
            .collect();
        expired.sort_unstable();
        for (at, id) in &expired {
            let r = self.records.get_mut(id).unwrap();
            r.entry.status = OutboxStatus::Pending;
            r.entry.next_attempt_at = Some(*at);
            r.claim = None;
        }
        expired.into_iter().map(|(_, id)| OutboxId(id)).collect()
    }

    fn purge(&mut self, before: i64) -> u64 {
        let doomed: Vec<u64> = self
            .records
            .values()
            .filter(|r| r.entry.completed_at.is_some_and(|at| at < t(before)))
            .map(|r| r.entry.id.0)
            .collect();
        for id in &doomed {
            let r = self.records.remove(id).unwrap();
            self.dedup
                .remove(&(r.entry.destination, r.entry.idempotency_key));
        }
        doomed.len() as u64
    }

    /// Applies `change` to `id` following the status table; `fence` as the
    /// fenced settle calls check it.
    fn change(&mut self, id: u64, change: &Change, fence: Option<u32>) -> Outcome {
        use OutboxStatus::{Completed, Dispatching, Failed, OutcomeUnknown, Pending};
        let Some(old) = self.records.get(&id) else {
            return Outcome::NotFound;
        };
        let from = old.entry.status;
        if let Some(attempt) = fence {
            let repeat = matches!(
                (from, change),
                (Completed, Change::Complete(_)) | (Failed, Change::Fail(_, None, _))
            );
            if attempt != old.entry.attempt_count
                || !(matches!(from, Dispatching | OutcomeUnknown) || repeat)
            {
                return Outcome::Conflict;
            }
        }
        let mut r = old.clone();
        match (from, change) {
            (Dispatching | OutcomeUnknown, Change::Complete(now)) => {
                r.entry.status = Completed;
                r.entry.completed_at = Some(t(*now));
                r.entry.next_attempt_at = None;
                r.claim = None;
            }
            (Completed, Change::Complete(_)) | (Failed, Change::Fail(_, None, _)) => {}
            (Pending | Dispatching | OutcomeUnknown, Change::Fail(reason, Some(at), _)) => {
                r.entry.status = Pending;
                r.entry.next_attempt_at = Some(t(*at));
                r.last_failure = Some(reason.clone());
                r.claim = None;
            }
            (Dispatching | OutcomeUnknown, Change::Fail(reason, None, now)) => {
                r.entry.status = Failed;
                r.entry.completed_at = Some(t(*now));
                r.entry.next_attempt_at = None;
                r.last_failure = Some(reason.clone());
                r.claim = None;
            }
            (Dispatching, Change::Unknown(remote)) => {
                r.entry.status = OutcomeUnknown;
                if remote.is_some() {
                    r.remote_ref.clone_from(remote);
                }
            }
            (OutcomeUnknown, Change::Unknown(remote)) => {
                if r.remote_ref.is_none() {
                    r.remote_ref.clone_from(remote);
                }
            }
            (Pending | Dispatching | OutcomeUnknown, Change::Reschedule(at)) => {
                r.entry.status = Pending;
                r.entry.next_attempt_at = Some(t(*at));
                r.claim = None;
            }
            (Failed | OutcomeUnknown, Change::Requeue(at)) => {
                r.entry.status = Pending;
                r.entry.next_attempt_at = Some(t(*at));
                r.entry.completed_at = None;
                r.claim = None;
            }
            _ => return Outcome::Conflict,
        }
        self.records.insert(id, r);
        Outcome::Ok
    }

    fn counts(&self) -> OutboxCounts {
        let mut c = OutboxCounts::default();
        for r in self.records.values() {
            match r.entry.status {
                OutboxStatus::Pending => c.pending += 1,
                OutboxStatus::Dispatching => c.dispatching += 1,
                OutboxStatus::Completed => c.completed += 1,
                OutboxStatus::Failed => c.failed += 1,
                OutboxStatus::OutcomeUnknown => c.outcome_unknown += 1,
            }
        }
        c
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
                    retry_at: Some(t(at)),
                },
                Change::Fail("http_503".into(), Some(at), now),
            )
        }
        2 => (
            Settlement::Failed {
                reason: "http_400".into(),
                retry_at: None,
            },
            Change::Fail("http_400".into(), None, now),
        ),
        3 => {
            let remote = rng.chance(50).then(|| format!("ref-{}", rng.below(100)));
            (
                Settlement::OutcomeUnknown {
                    remote_ref: remote.clone(),
                },
                Change::Unknown(remote),
            )
        }
        _ => {
            let at = rng.near(now);
            (
                Settlement::Rescheduled { at: t(at) },
                Change::Reschedule(at),
            )
        }
    }
}

/// An id to act on: mostly a live one (more often one that is being
/// dispatched, where most settlements apply), sometimes purged or never
/// issued.
fn pick_id(rng: &mut Rng, model: &Model) -> u64 {
    let in_flight: Vec<u64> = model
        .records
        .values()
        .filter(|r| {
            matches!(
                r.entry.status,
                OutboxStatus::Dispatching | OutboxStatus::OutcomeUnknown
            )
        })
        .map(|r| r.entry.id.0)
        .collect();
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

fn step(rng: &mut Rng, model: &mut Model, outbox: &Outbox, now: i64) -> Result<String> {
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
            let got = outbox.claim_due(t(now), limit, &worker)?;
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
            let got = outcome(&outbox.settle(fence, s.clone(), t(now)));
            assert_eq!(
                got,
                model.change(id, &change, Some(attempt)),
                "settle {fence} {s:?}"
            );
            format!("settle {fence} {s:?}")
        }
        60..=74 => {
            let id = pick_id(rng, model);
            let (_, change) = settlement(rng, now);
            let got = match &change {
                Change::Complete(_) => outbox.mark_completed(OutboxId(id), t(now)),
                Change::Fail(reason, retry, _) => {
                    outbox.mark_failed(OutboxId(id), reason, retry.map(t), t(now))
                }
                Change::Unknown(remote) => {
                    outbox.mark_outcome_unknown(OutboxId(id), remote.as_deref())
                }
                Change::Reschedule(at) | Change::Requeue(at) => {
                    outbox.reschedule(OutboxId(id), t(*at))
                }
            };
            assert_eq!(
                outcome(&got),
                model.change(id, &change, None),
                "mark {id} {change:?}"
            );
            format!("mark {id} {change:?}")
        }
        75..=81 => {
            let id = pick_id(rng, model);
            let at = rng.near(now);
            let got = outcome(&outbox.requeue(OutboxId(id), t(at)));
            assert_eq!(
                got,
                model.change(id, &Change::Requeue(at), None),
                "requeue {id}"
            );
            format!("requeue {id}")
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

fn verify(rng: &mut Rng, model: &Model, outbox: &Outbox, what: &str) -> Result<()> {
    for cmd in COMMANDS {
        let mut want: Vec<&OutboxRecord> = model
            .records
            .values()
            .filter(|r| r.entry.command_id == cmd)
            .collect();
        want.sort_by_key(|r| (r.entry.created_at, r.entry.id));
        let got = outbox.list_for_command(cmd)?;
        assert_eq!(
            got.iter().collect::<Vec<_>>(),
            want,
            "after {what}: records of {cmd}"
        );
    }
    assert_eq!(outbox.counts()?, model.counts(), "after {what}: counts");
    let next_due = model
        .records
        .values()
        .filter(|r| r.entry.status == OutboxStatus::Pending)
        .map(|r| due(&r.entry))
        .min();
    assert_eq!(outbox.next_due()?, next_due, "after {what}: next_due");
    let dest = *rng.pick(&DESTINATIONS);
    let key = format!("key-{}", rng.below(KEYS));
    let want = model
        .dedup
        .get(&(dest.to_owned(), key.clone()))
        .map(|id| model.records[id].clone());
    assert_eq!(outbox.find(dest, &key)?, want, "after {what}: find");
    assert_eq!(
        outbox.check_indexes()?,
        Vec::<String>::new(),
        "after {what}"
    );
    Ok(())
}

fn run(seed: u64, ops: usize, path: Option<&Path>) -> Result<()> {
    let mut rng = Rng(seed | 1);
    let mut model = Model::default();
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
