//! A plain in-memory model of the outbox: the records, the dedup index and
//! the status table that every change follows. Times are seconds after the
//! fixed instant of `t`. The fuzz model target (`model.rs`) and
//! `tests/outbox_model.rs` drive it with their own choice of operations.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use idemstore::{
    AttemptRecord, Enqueued, Error, MAX_ATTEMPT_HISTORY, NewEntry, OutboxClaim, OutboxCounts,
    OutboxEntry, OutboxId, OutboxRecord, OutboxStatus, REASON_CANCELLED, REASON_OUTCOME_UNKNOWN,
    REASON_RESCHEDULED,
};

use super::t;

/// The model's outbox record: the fields of an [`OutboxRecord`], which
/// only the store builds; [`Record::from`] reads a stored one into it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) entry: Entry,
    pub(crate) claim: Option<ClaimBy>,
    pub(crate) attempt_in_doubt: Option<ClaimBy>,
    pub(crate) last_failure: Option<String>,
    pub(crate) remote_ref: Option<String>,
    pub(crate) attempts: Vec<AttemptView>,
}

/// The model's [`OutboxEntry`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) id: OutboxId,
    pub(crate) command_id: String,
    pub(crate) destination: String,
    pub(crate) idempotency_key: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) status: OutboxStatus,
    pub(crate) attempt_count: u32,
    pub(crate) next_attempt_at: Option<DateTime<Utc>>,
    pub(crate) created_at: DateTime<Utc>,
    pub(crate) completed_at: Option<DateTime<Utc>>,
    pub(crate) ordering_key: Option<String>,
    pub(crate) priority: u8,
}

/// The model's [`OutboxClaim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ClaimBy {
    pub(crate) worker_id: String,
    pub(crate) claimed_at: DateTime<Utc>,
}

/// The model's [`AttemptRecord`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AttemptView {
    pub(crate) attempt: u32,
    pub(crate) at: DateTime<Utc>,
    pub(crate) reason: String,
    pub(crate) remote_ref: Option<String>,
}

impl From<&OutboxEntry> for Entry {
    fn from(e: &OutboxEntry) -> Self {
        Entry {
            id: e.id,
            command_id: e.command_id.clone(),
            destination: e.destination.clone(),
            idempotency_key: e.idempotency_key.clone(),
            payload: e.payload.clone(),
            status: e.status,
            attempt_count: e.attempt_count,
            next_attempt_at: e.next_attempt_at,
            created_at: e.created_at,
            completed_at: e.completed_at,
            ordering_key: e.ordering_key.clone(),
            priority: e.priority,
        }
    }
}

impl From<&OutboxClaim> for ClaimBy {
    fn from(c: &OutboxClaim) -> Self {
        ClaimBy {
            worker_id: c.worker_id.clone(),
            claimed_at: c.claimed_at,
        }
    }
}

impl From<&AttemptRecord> for AttemptView {
    fn from(a: &AttemptRecord) -> Self {
        AttemptView {
            attempt: a.attempt,
            at: a.at,
            reason: a.reason.clone(),
            remote_ref: a.remote_ref.clone(),
        }
    }
}

impl From<&OutboxRecord> for Record {
    fn from(r: &OutboxRecord) -> Self {
        Record {
            entry: Entry::from(&r.entry),
            claim: r.claim.as_ref().map(ClaimBy::from),
            attempt_in_doubt: r.attempt_in_doubt.as_ref().map(ClaimBy::from),
            last_failure: r.last_failure.clone(),
            remote_ref: r.remote_ref.clone(),
            attempts: r.attempts.iter().map(AttemptView::from).collect(),
        }
    }
}

/// How a single-entry call ended, as the model predicts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Ok,
    NotFound,
    Conflict,
}

/// The [`Outcome`] of a store call; any other error panics, naming `what`.
pub(crate) fn outcome<T>(r: &idemstore::Result<T>, what: &str) -> Outcome {
    match r {
        Ok(_) => Outcome::Ok,
        Err(Error::NotFound) => Outcome::NotFound,
        Err(Error::Conflict { .. }) => Outcome::Conflict,
        Err(e) => panic!("{what}: unexpected error: {e}"),
    }
}

/// A single-entry change, as the model sees it. Times in seconds; the last
/// one of `Unknown` and `Reschedule` is the settlement's `now`, which the
/// unfenced operator calls do not take (so they add no attempt record).
#[derive(Debug, Clone)]
pub(crate) enum Change {
    Complete(i64),
    Fail(String, Option<i64>, i64),
    Unknown(Option<String>, i64),
    Reschedule(i64, i64),
    Requeue(i64),
    Cancel(i64),
}

/// The code `last_failure` keeps of a reason: the reason up to a detail in
/// parentheses.
pub(crate) fn failure_code(reason: &str) -> &str {
    match reason.strip_suffix(')').and_then(|r| r.split_once(" (")) {
        Some((code, _)) if !code.is_empty() => code,
        _ => reason,
    }
}

/// Adds an attempt record to `r`'s history, keeping the last
/// `MAX_ATTEMPT_HISTORY`.
fn push_attempt(r: &mut Record, at: i64, reason: &str, remote_ref: Option<String>) {
    r.attempts.push(AttemptView {
        attempt: r.entry.attempt_count,
        at: t(at),
        reason: reason.to_owned(),
        remote_ref,
    });
    let excess = r.attempts.len().saturating_sub(MAX_ATTEMPT_HISTORY);
    r.attempts.drain(..excess);
}

/// Everything the outbox should hold.
#[derive(Default)]
pub(crate) struct OutboxModel {
    pub(crate) records: BTreeMap<u64, Record>,
    pub(crate) dedup: BTreeMap<(String, String), u64>,
    pub(crate) next_id: u64,
    /// When a claim last took an entry of each destination (seconds),
    /// forgotten once the destination has no record left.
    pub(crate) served: BTreeMap<String, i64>,
}

/// When a pending entry becomes due.
pub(crate) fn due(e: &Entry) -> DateTime<Utc> {
    e.next_attempt_at.unwrap_or(e.created_at)
}

impl OutboxModel {
    pub(crate) fn enqueue(&mut self, n: &NewEntry, now: i64) -> Enqueued {
        let key = (n.destination.clone(), n.idempotency_key.clone());
        if let Some(id) = self.dedup.get(&key) {
            return Enqueued::Duplicate(OutboxId(*id));
        }
        self.next_id += 1;
        let id = self.next_id;
        self.dedup.insert(key, id);
        self.records.insert(
            id,
            Record {
                entry: Entry {
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
                    ordering_key: n.ordering_key.clone(),
                    priority: n.priority,
                },
                claim: None,
                attempt_in_doubt: None,
                last_failure: None,
                remote_ref: None,
                attempts: Vec::new(),
            },
        );
        Enqueued::New(OutboxId(id))
    }

    /// Each destination with a pending entry, with the time it takes its
    /// turn from: the later of its earliest due entry and its last claim.
    /// By that time, then name: the order claims visit them in.
    pub(crate) fn line(&self) -> Vec<(DateTime<Utc>, String)> {
        let mut earliest: BTreeMap<&str, DateTime<Utc>> = BTreeMap::new();
        for r in self.records.values() {
            if r.entry.status == OutboxStatus::Pending {
                let d = earliest
                    .entry(&r.entry.destination)
                    .or_insert(due(&r.entry));
                *d = (*d).min(due(&r.entry));
            }
        }
        let mut line: Vec<(DateTime<Utc>, String)> = earliest
            .into_iter()
            .map(|(d, at)| {
                let served = self.served.get(d).map_or(at, |s| at.max(t(*s)));
                (served, d.to_owned())
            })
            .collect();
        line.sort();
        line
    }

    /// When the next entry may be claimed: the front of the line.
    pub(crate) fn next_due(&self) -> Option<DateTime<Utc>> {
        self.line().first().map(|(at, _)| *at)
    }

    /// A claim: the destinations whose turn has come, at most `limit` of
    /// them, in line order, one entry each per round (earliest due, then
    /// id), until `limit` entries or none left due.
    pub(crate) fn claim(&mut self, now: i64, limit: usize, worker: &str) -> Vec<Entry> {
        let mut line: Vec<String> = self
            .line()
            .into_iter()
            .filter(|(at, _)| *at <= t(now))
            .map(|(_, d)| d)
            .take(limit)
            .collect();
        let mut out = Vec::new();
        while out.len() < limit && !line.is_empty() {
            let mut still = Vec::new();
            for d in line {
                if out.len() >= limit {
                    break;
                }
                let first = self
                    .records
                    .values()
                    .filter(|r| {
                        r.entry.destination == d
                            && r.entry.status == OutboxStatus::Pending
                            && due(&r.entry) <= t(now)
                    })
                    .map(|r| (due(&r.entry), r.entry.id.0))
                    .min();
                let Some((_, id)) = first else {
                    continue;
                };
                let r = self.records.get_mut(&id).unwrap();
                r.entry.status = OutboxStatus::Dispatching;
                r.entry.attempt_count += 1;
                r.claim = Some(ClaimBy {
                    worker_id: worker.to_owned(),
                    claimed_at: t(now),
                });
                out.push(r.entry.clone());
                let served = self.served.entry(d.clone()).or_insert(now);
                *served = (*served).max(now);
                still.push(d);
            }
            line = still;
        }
        out
    }

    pub(crate) fn release(&mut self, cutoff: i64) -> Vec<OutboxId> {
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

    pub(crate) fn purge(&mut self, before: i64) -> u64 {
        let doomed: Vec<u64> = self
            .records
            .values()
            .filter(|r| r.entry.completed_at.is_some_and(|at| at < t(before)))
            .map(|r| r.entry.id.0)
            .collect();
        for id in &doomed {
            let r = self.records.remove(id).unwrap();
            if !self
                .records
                .values()
                .any(|o| o.entry.destination == r.entry.destination)
            {
                self.served.remove(&r.entry.destination);
            }
            self.dedup
                .remove(&(r.entry.destination, r.entry.idempotency_key));
        }
        doomed.len() as u64
    }

    /// Applies `change` to `id` following the status table; `fence` as the
    /// fenced settle calls check it.
    pub(crate) fn change(&mut self, id: u64, change: &Change, fence: Option<u32>) -> Outcome {
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
                r.attempt_in_doubt = None;
            }
            (Completed, Change::Complete(_)) | (Failed, Change::Fail(_, None, _)) => {}
            (Pending | Dispatching | OutcomeUnknown, Change::Fail(reason, Some(at), now)) => {
                r.entry.status = Pending;
                r.entry.next_attempt_at = Some(t(*at));
                r.last_failure = Some(failure_code(reason).to_owned());
                r.claim = None;
                r.attempt_in_doubt = None;
                push_attempt(&mut r, *now, reason, None);
            }
            (Dispatching | OutcomeUnknown, Change::Fail(reason, None, now)) => {
                r.entry.status = Failed;
                r.entry.completed_at = Some(t(*now));
                r.entry.next_attempt_at = None;
                r.last_failure = Some(failure_code(reason).to_owned());
                r.claim = None;
                r.attempt_in_doubt = None;
                push_attempt(&mut r, *now, reason, None);
            }
            (Dispatching, Change::Unknown(remote, now)) => {
                // The claim ends; who made the attempt, and when, stays as
                // the attempt in doubt.
                r.entry.status = OutcomeUnknown;
                r.attempt_in_doubt = r.claim.take();
                if remote.is_some() {
                    r.remote_ref.clone_from(remote);
                }
                if fence.is_some() {
                    push_attempt(&mut r, *now, REASON_OUTCOME_UNKNOWN, remote.clone());
                }
            }
            (OutcomeUnknown, Change::Unknown(remote, _)) => {
                if r.remote_ref.is_none() {
                    r.remote_ref.clone_from(remote);
                }
            }
            (Pending | Dispatching | OutcomeUnknown, Change::Reschedule(at, now)) => {
                r.entry.status = Pending;
                r.entry.next_attempt_at = Some(t(*at));
                r.claim = None;
                r.attempt_in_doubt = None;
                if fence.is_some() {
                    push_attempt(&mut r, *now, REASON_RESCHEDULED, None);
                }
            }
            (Failed, Change::Cancel(_))
                if old.last_failure.as_deref() == Some(REASON_CANCELLED) => {}
            (Pending | OutcomeUnknown, Change::Cancel(now)) => {
                r.entry.status = Failed;
                r.entry.completed_at = Some(t(*now));
                r.entry.next_attempt_at = None;
                r.last_failure = Some(REASON_CANCELLED.to_owned());
                r.attempt_in_doubt = None;
                push_attempt(&mut r, *now, REASON_CANCELLED, None);
            }
            (Failed | OutcomeUnknown, Change::Requeue(at)) => {
                r.entry.status = Pending;
                r.entry.next_attempt_at = Some(t(*at));
                r.entry.completed_at = None;
                r.claim = None;
                r.attempt_in_doubt = None;
            }
            _ => return Outcome::Conflict,
        }
        self.records.insert(id, r);
        Outcome::Ok
    }

    /// The ids of the entries being dispatched or of unknown outcome, where
    /// most settlements apply, in id order.
    pub(crate) fn in_flight(&self) -> Vec<u64> {
        self.records
            .values()
            .filter(|r| {
                matches!(
                    r.entry.status,
                    OutboxStatus::Dispatching | OutboxStatus::OutcomeUnknown
                )
            })
            .map(|r| r.entry.id.0)
            .collect()
    }

    pub(crate) fn counts(&self) -> OutboxCounts {
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
