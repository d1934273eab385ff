//! The outbox's rules, apart from any storage: the value a record holds
//! ([`Row`]), the status machine ([`plan`], with its fences), the
//! settlement planning of the bulk calls and the checks of what a call is
//! given. Pure functions over values: both backends call them, the
//! embedded store on records it decodes from its tables, the PostgreSQL
//! backend on rows it reads from the server, and each writes what they
//! decide its own way.
//!
//! Every status change goes through one function, [`plan`]: given the row
//! and a [`Change`], it returns the new row, `None` for an accepted no-op,
//! or an error — and writes nothing. The callers write the plan (row and
//! index rows) only once it has been accepted, so a refused change never
//! leaves a trace.

use chrono::{DateTime, Utc};

use super::destinations::{REASON_MAX_ATTEMPTS, Signal};
use super::types::failure_code;
use super::{
    AttemptRecord, Fence, NewEntry, OutboxClaim, OutboxEntry, OutboxId, OutboxRecord, OutboxStatus,
    REASON_CANCELLED, REASON_OUTCOME_UNKNOWN, REASON_RESCHEDULED, Settlement, check_field,
};
use crate::codec::{from_micros, micros};
use crate::error::{Error, Result};

/// The name errors give the outbox's records (the embedded store's table).
pub(crate) const RECORDS: &str = "idemstore.v1.outbox";
/// The name errors give the outbox's attempt records.
pub(crate) const ATTEMPT_RECORDS: &str = "idemstore.v1.outbox.attempts";

/// An outbox record, as the rules see it: the entry's fields, its status,
/// times as `i64` microseconds, the latest attempt while it is in progress
/// or in doubt, and the settlement details. How a backend stores it is its
/// own business (the embedded store's encoding is in `record.rs`).
/// [`Row::to_record`] turns it into the public [`OutboxRecord`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Row {
    pub(crate) command_id: String,
    pub(crate) destination: String,
    pub(crate) idempotency_key: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) status: OutboxStatus,
    pub(crate) attempt_count: u32,
    pub(crate) next_attempt_at: Option<i64>,
    pub(crate) created_at: i64,
    pub(crate) completed_at: Option<i64>,
    /// `(worker id, claimed_at µs)` of the latest attempt while it is in
    /// progress (`Dispatching`: the entry's claim, [`OutboxRecord::claim`])
    /// or in doubt (`OutcomeUnknown`: no longer a claim, shown as
    /// [`OutboxRecord::attempt_in_doubt`]); `None` in every other status.
    pub(crate) attempt: Option<(String, i64)>,
    pub(crate) last_failure: Option<String>,
    pub(crate) remote_ref: Option<String>,
    /// [`NewEntry::ordering_key`].
    pub(crate) ordering_key: Option<String>,
    /// [`NewEntry::priority`].
    pub(crate) priority: u8,
    /// With an ordering key, while not finished: its place in its
    /// sequence (its id when enqueued; a fresh number when a `Failed`
    /// entry is requeued, which puts it at the end).
    pub(crate) seq: Option<u64>,
}

impl Row {
    /// A new entry's row: `Pending`, created at `now`, due at its
    /// `not_before` (else at once).
    pub(crate) fn new_entry(e: &NewEntry, id: u64, now: i64) -> Row {
        Row {
            command_id: e.command_id.clone(),
            destination: e.destination.clone(),
            idempotency_key: e.idempotency_key.clone(),
            payload: e.payload.clone(),
            status: OutboxStatus::Pending,
            attempt_count: 0,
            next_attempt_at: e.not_before.map(micros),
            created_at: now,
            completed_at: None,
            attempt: None,
            last_failure: None,
            remote_ref: None,
            ordering_key: e.ordering_key.clone(),
            priority: e.priority,
            seq: e.ordering_key.as_ref().map(|_| id),
        }
    }

    /// When the latest attempt was claimed (`created_at` if none is stored).
    pub(crate) fn claimed_at(&self) -> i64 {
        self.attempt.as_ref().map_or(self.created_at, |a| a.1)
    }

    /// The public view of this record, without its attempt history (which
    /// is stored apart: the caller adds it).
    pub(crate) fn to_record(&self, id: u64) -> Result<OutboxRecord> {
        let at = |us: i64| from_micros(RECORDS, &id, us);
        let opt = |us: Option<i64>| us.map(at).transpose();
        let status = self.status;
        let attempt = match &self.attempt {
            Some((worker_id, claimed_at)) => Some(OutboxClaim {
                worker_id: worker_id.clone(),
                claimed_at: at(*claimed_at)?,
            }),
            None => None,
        };
        let (claim, attempt_in_doubt) = match status {
            OutboxStatus::Dispatching => (attempt, None),
            OutboxStatus::OutcomeUnknown => (None, attempt),
            _ => (None, None),
        };
        Ok(OutboxRecord {
            entry: OutboxEntry {
                id: OutboxId(id),
                command_id: self.command_id.clone(),
                destination: self.destination.clone(),
                idempotency_key: self.idempotency_key.clone(),
                payload: self.payload.clone(),
                status,
                attempt_count: self.attempt_count,
                next_attempt_at: opt(self.next_attempt_at)?,
                created_at: at(self.created_at)?,
                completed_at: opt(self.completed_at)?,
                ordering_key: self.ordering_key.clone(),
                priority: self.priority,
            },
            claim,
            attempt_in_doubt,
            last_failure: self.last_failure.clone(),
            remote_ref: self.remote_ref.clone(),
            attempts: Vec::new(),
        })
    }

    /// Back to `Pending`, due at `next_attempt_at`, the attempt dropped.
    fn make_pending(&mut self, next_attempt_at: i64) {
        self.status = OutboxStatus::Pending;
        self.next_attempt_at = Some(next_attempt_at);
        self.attempt = None;
    }

    /// Finished as `status` (`Completed` or `Failed`) at `now`: no longer
    /// due, the attempt dropped.
    fn make_finished(&mut self, status: OutboxStatus, now: i64) {
        self.status = status;
        self.completed_at = Some(now);
        self.next_attempt_at = None;
        self.attempt = None;
    }
}

/// A status change asked of one record, named by what it does to the
/// record (the tense of [`Settlement`](super::Settlement)). Times are µs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Change {
    /// `claim_due` took it (the caller has checked it is due).
    Claimed { worker_id: String, now: i64 },
    /// The effect happened.
    Completed { now: i64 },
    /// The attempt failed; retry at `next_attempt_at`, or give up. `hold`:
    /// the destination waits until `next_attempt_at` too
    /// ([`Settlement::Throttled`](super::Settlement::Throttled)).
    Failed {
        reason: String,
        next_attempt_at: Option<i64>,
        now: i64,
        hold: bool,
    },
    /// The attempt may or may not have happened. `now` is the settlement's
    /// time; `None` for the operator's call, which takes none (and so adds
    /// no attempt record).
    OutcomeUnknown {
        remote_ref: Option<String>,
        now: Option<i64>,
    },
    /// Try again at `next_attempt_at` (no failure recorded). `now` as for
    /// `OutcomeUnknown`.
    Rescheduled {
        next_attempt_at: i64,
        now: Option<i64>,
    },
    /// The claim expired: back to `Pending`, due at its claim time.
    Released,
    /// An operator puts a `Failed` or `OutcomeUnknown` entry back to work.
    Requeued { next_attempt_at: i64 },
    /// Given up before (another) attempt: `Failed` with the reason
    /// [`REASON_CANCELLED`].
    Cancelled { now: i64 },
}

impl Change {
    /// Whether applying it may make work due sooner, so that a wake-up is
    /// worth sending: the changes that can leave the entry `Pending` (a
    /// retry, a reschedule, a released claim, a requeue). The one rule for
    /// every path that changes an entry; an enqueue wakes on its own.
    pub(crate) fn makes_work_due(&self) -> bool {
        match self {
            Change::Failed {
                next_attempt_at, ..
            } => next_attempt_at.is_some(),
            Change::Rescheduled { .. } | Change::Released | Change::Requeued { .. } => true,
            Change::Claimed { .. }
            | Change::Completed { .. }
            | Change::OutcomeUnknown { .. }
            | Change::Cancelled { .. } => false,
        }
    }

    /// What it tells the circuit of the entry's destination, applied to an
    /// entry in status `from`: `Completed` from `Dispatching` is a success;
    /// a retryable failure from `Dispatching` (a retry, or the attempts used
    /// up: reason code [`REASON_MAX_ATTEMPTS`]) a failure; anything else
    /// (a permanent failure, a throttled attempt, an outcome in doubt, a
    /// reschedule, a released claim, an operator's change) nothing.
    pub(crate) fn signal(&self, from: OutboxStatus) -> Signal {
        if from != OutboxStatus::Dispatching {
            return Signal::None;
        }
        match self {
            Change::Completed { .. } => Signal::Success,
            Change::Failed {
                hold: false,
                next_attempt_at: Some(_),
                ..
            } => Signal::Failure,
            Change::Failed {
                next_attempt_at: None,
                reason,
                ..
            } if failure_code(reason) == REASON_MAX_ATTEMPTS => Signal::Failure,
            _ => Signal::None,
        }
    }

    /// Until when it holds the entry's whole destination back (µs), if it
    /// does ([`Settlement::Throttled`](super::Settlement::Throttled)).
    pub(crate) fn hold(&self) -> Option<i64> {
        match self {
            Change::Failed {
                hold: true,
                next_attempt_at,
                ..
            } => *next_attempt_at,
            _ => None,
        }
    }

    /// Its time (µs), for the ones that carry one; 0 otherwise.
    pub(crate) fn time(&self) -> i64 {
        match self {
            Change::Claimed { now, .. }
            | Change::Completed { now }
            | Change::Failed { now, .. }
            | Change::Cancelled { now } => *now,
            Change::OutcomeUnknown { now, .. } | Change::Rescheduled { now, .. } => {
                now.unwrap_or(0)
            }
            Change::Released | Change::Requeued { .. } => 0,
        }
    }

    /// The operation's name in error messages.
    fn name(&self) -> &'static str {
        match self {
            Change::Claimed { .. } => "claim",
            Change::Completed { .. } => "mark_completed",
            Change::Failed {
                next_attempt_at: Some(_),
                ..
            } => "mark_failed with a retry time",
            Change::Failed {
                next_attempt_at: None,
                ..
            } => "mark_failed without a retry time",
            Change::OutcomeUnknown { .. } => "mark_outcome_unknown",
            Change::Rescheduled { .. } => "reschedule",
            Change::Released => "release_expired_claims",
            Change::Requeued { .. } => "requeue",
            Change::Cancelled { .. } => "cancel",
        }
    }

    /// Whether it settles an attempt for good: repeating it on an entry
    /// already settled that way is accepted and changes nothing.
    fn is_final_for(&self, status: OutboxStatus) -> bool {
        matches!(
            (status, self),
            (OutboxStatus::Completed, Change::Completed { .. })
                | (
                    OutboxStatus::Failed,
                    Change::Failed {
                        next_attempt_at: None,
                        ..
                    }
                )
        )
    }

    /// The attempt record the change adds to the history of `old`, which it
    /// moves from status `from` (see [`AttemptRecord`](super::AttemptRecord)
    /// for the rules); `None` for a change that adds none. Only asked of a
    /// change that [`plan`] accepted and that changes the record.
    pub(crate) fn attempt_row(&self, old: &Row, from: OutboxStatus) -> Option<AttemptRow> {
        let (at, reason, remote_ref) = match self {
            Change::Failed { reason, now, .. } => (*now, reason.clone(), None),
            Change::OutcomeUnknown {
                remote_ref,
                now: Some(now),
            } if from == OutboxStatus::Dispatching => {
                (*now, REASON_OUTCOME_UNKNOWN.to_owned(), remote_ref.clone())
            }
            Change::Rescheduled { now: Some(now), .. } if from != OutboxStatus::Pending => {
                (*now, REASON_RESCHEDULED.to_owned(), None)
            }
            Change::Cancelled { now } => (*now, REASON_CANCELLED.to_owned(), None),
            _ => return None,
        };
        Some(AttemptRow {
            attempt: old.attempt_count,
            at,
            reason,
            remote_ref,
        })
    }
}

/// One record of an entry's attempt history, as the rules make it (times
/// µs). The embedded store encodes it in `record.rs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AttemptRow {
    pub(crate) attempt: u32,
    /// µs.
    pub(crate) at: i64,
    pub(crate) reason: String,
    pub(crate) remote_ref: Option<String>,
}

impl AttemptRow {
    /// The public view of this attempt record (`seq`-th of entry `id`).
    pub(crate) fn to_record(&self, id: u64, seq: u64) -> Result<AttemptRecord> {
        let key = format!("{id}/{seq}");
        Ok(AttemptRecord {
            attempt: self.attempt,
            at: from_micros(ATTEMPT_RECORDS, &key, self.at)?,
            reason: self.reason.clone(),
            remote_ref: self.remote_ref.clone(),
        })
    }
}

/// Refuses a fenced change unless it comes from the holder of `attempt`.
fn check_fence(
    id: u64,
    old: &Row,
    from: OutboxStatus,
    change: &Change,
    attempt: u32,
) -> Result<()> {
    use OutboxStatus::{Dispatching, OutcomeUnknown};
    if attempt != old.attempt_count {
        return Err(Error::conflict(format!(
            "attempt {attempt} of outbox entry {id} is stale: the entry is at attempt {} ({from:?})",
            old.attempt_count
        )));
    }
    if matches!(from, Dispatching | OutcomeUnknown) || change.is_final_for(from) {
        Ok(())
    } else {
        Err(Error::conflict(format!(
            "attempt {attempt} of outbox entry {id} no longer holds it: the entry is {from:?}"
        )))
    }
}

/// What `change` does to `old` (record `id`), following the status table on
/// [`OutboxStatus`]: `Ok(Some(new))` to write, `Ok(None)` for an accepted
/// no-op, `Err(Conflict)` for a refused edge.
///
/// Only `Dispatching` holds a claim: every edge out of it ends the claim.
/// The attempt's `(worker, claimed_at)` is dropped on the edges to
/// `Completed`, `Pending` and `Failed`, and kept on the edge to
/// `OutcomeUnknown` as the attempt in doubt (no longer a claim: the claims
/// index row goes, and the reaper never sees the entry); it is dropped when
/// the doubt is settled.
///
/// With `fence = Some(attempt)` the change must come from the holder of
/// that attempt: the record's `attempt_count` must equal it and the record
/// must still be `Dispatching` or `OutcomeUnknown` (or already settled the
/// same way, for the table's "accepted, no change" cells).
pub(crate) fn plan(id: u64, old: &Row, change: &Change, fence: Option<u32>) -> Result<Option<Row>> {
    use OutboxStatus::{Completed, Dispatching, Failed, OutcomeUnknown, Pending};
    let from = old.status;
    let refuse = || {
        Err(Error::conflict(format!(
            "outbox entry {id} is {from:?}; {} is not allowed from there",
            change.name()
        )))
    };
    if let Some(attempt) = fence {
        check_fence(id, old, from, change, attempt)?;
    }
    if change.is_final_for(from) {
        return Ok(None);
    }
    if let Change::Cancelled { now } = change {
        return plan_cancel(id, old, from, *now);
    }
    let mut new = old.clone();
    match (from, change) {
        (Pending, Change::Claimed { worker_id, now }) => {
            new.status = Dispatching;
            new.attempt_count = old.attempt_count.saturating_add(1);
            new.attempt = Some((worker_id.clone(), *now));
        }
        (Dispatching | OutcomeUnknown, Change::Completed { now }) => {
            new.make_finished(Completed, *now);
        }
        (
            Pending | Dispatching | OutcomeUnknown,
            Change::Failed {
                reason,
                next_attempt_at: Some(at),
                ..
            },
        ) => {
            new.make_pending(*at);
            new.last_failure = Some(failure_code(reason).to_owned());
        }
        (
            Dispatching | OutcomeUnknown,
            Change::Failed {
                reason,
                next_attempt_at: None,
                now,
                ..
            },
        ) => {
            new.make_finished(Failed, *now);
            new.last_failure = Some(failure_code(reason).to_owned());
        }
        (Dispatching, Change::OutcomeUnknown { remote_ref, .. }) => {
            // The claim ends; its `attempt` stays as the attempt in doubt.
            new.status = OutcomeUnknown;
            if remote_ref.is_some() {
                new.remote_ref.clone_from(remote_ref);
            }
        }
        (OutcomeUnknown, Change::OutcomeUnknown { remote_ref, .. }) => {
            if old.remote_ref.is_some() || remote_ref.is_none() {
                return Ok(None);
            }
            new.remote_ref.clone_from(remote_ref);
        }
        (
            Pending | Dispatching | OutcomeUnknown,
            Change::Rescheduled {
                next_attempt_at, ..
            },
        ) => {
            new.make_pending(*next_attempt_at);
        }
        (Dispatching, Change::Released) => new.make_pending(old.claimed_at()),
        (Failed | OutcomeUnknown, Change::Requeued { next_attempt_at }) => {
            new.make_pending(*next_attempt_at);
            new.completed_at = None;
        }
        _ => return refuse(),
    }
    debug_assert!(
        from.can_transition(new.status),
        "{from:?} -> {:?}",
        new.status
    );
    Ok(Some(new))
}

/// What a cancel at `now` does to `old` (record `id`, in status `from`):
/// `Pending` and `OutcomeUnknown` become `Failed` with the reason
/// [`REASON_CANCELLED`]; an entry already cancelled is an accepted no-op;
/// anything else is refused, saying why.
fn plan_cancel(id: u64, old: &Row, from: OutboxStatus, now: i64) -> Result<Option<Row>> {
    use OutboxStatus::{Completed, Dispatching, Failed, OutcomeUnknown, Pending};
    match from {
        Pending | OutcomeUnknown => {
            let mut new = old.clone();
            new.make_finished(Failed, now);
            new.last_failure = Some(REASON_CANCELLED.to_owned());
            Ok(Some(new))
        }
        Failed if old.last_failure.as_deref() == Some(REASON_CANCELLED) => Ok(None),
        Completed | Failed => {
            let why = old
                .last_failure
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default();
            Err(Error::conflict(format!(
                "outbox entry {id} is already finished: {from:?}{why}; only a Pending or \
                 OutcomeUnknown entry can be cancelled"
            )))
        }
        Dispatching => Err(Error::conflict(format!(
            "outbox entry {id} is Dispatching: a worker is sending it; cancel it once the \
             attempt is settled (or its claim released)"
        ))),
    }
}

/// A change to entry `id`, fenced by its attempt number.
pub(crate) type FencedChange = (u64, u32, Change);

/// Checks settlements and turns them into fenced changes; also says whether
/// any of them may make work due ([`Change::makes_work_due`]). Both
/// backends' bulk settlements (`settle_many`) start here.
pub(crate) fn plan_settlements(
    settlements: impl IntoIterator<Item = (Fence, Settlement)>,
    now: DateTime<Utc>,
) -> Result<(Vec<FencedChange>, bool)> {
    let mut wake = false;
    let mut changes = Vec::new();
    for (fence, s) in settlements {
        let change = s.into_change(now)?;
        wake |= change.makes_work_due();
        changes.push((fence.id.0, fence.attempt, change));
    }
    Ok((changes, wake))
}

/// [`plan_settlements`] for `settle_and_claim`, after checking the worker
/// that claims.
pub(crate) fn plan_settle_and_claim(
    settlements: impl IntoIterator<Item = (Fence, Settlement)>,
    now: DateTime<Utc>,
    worker_id: &str,
) -> Result<(Vec<FencedChange>, bool)> {
    check_field("worker_id", worker_id)?;
    plan_settlements(settlements, now)
}

/// The operator's `mark_failed`: checks the reason, then records it with a
/// retry at `retry_at`, or gives up without one.
pub(crate) fn mark_failed_change(
    reason: &str,
    retry_at: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> Result<Change> {
    check_field("reason", reason)?;
    Ok(Change::Failed {
        reason: reason.to_owned(),
        next_attempt_at: retry_at.map(micros),
        now: micros(now),
        hold: false,
    })
}

/// The operator's `mark_outcome_unknown`: checks the remote reference; it
/// takes no time, so it adds no attempt record.
pub(crate) fn mark_outcome_unknown_change(remote_ref: Option<&str>) -> Result<Change> {
    if let Some(r) = remote_ref {
        check_field("remote_ref", r)?;
    }
    Ok(Change::OutcomeUnknown {
        remote_ref: remote_ref.map(str::to_owned),
        now: None,
    })
}

/// Checks an entry to enqueue: its fields, and its payload up to `max_body`.
pub(crate) fn check_entry(e: &NewEntry, max_body: usize) -> Result<()> {
    check_field("command_id", &e.command_id)?;
    check_field("destination", &e.destination)?;
    check_field("idempotency_key", &e.idempotency_key)?;
    if let Some(key) = &e.ordering_key {
        check_field("ordering_key", key)?;
    }
    super::destinations::check_priority(e.priority)?;
    if e.payload.len() > max_body {
        return Err(Error::TooLarge {
            field: "payload",
            len: e.payload.len(),
            max: max_body,
        });
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A row in `status`, for the rules' tests and the encoding's.
    pub(in crate::outbox) fn row(status: OutboxStatus) -> Row {
        Row {
            command_id: "c".into(),
            destination: "d".into(),
            idempotency_key: "k".into(),
            payload: vec![1, 2, 3],
            status,
            attempt_count: 0,
            next_attempt_at: None,
            created_at: 1_700_000_000_000_000,
            completed_at: None,
            attempt: None,
            last_failure: None,
            remote_ref: None,
            ordering_key: None,
            priority: 0,
            seq: None,
        }
    }

    #[test]
    fn every_edge_out_of_dispatching_ends_the_claim() {
        let mut claimed = row(OutboxStatus::Pending);
        claimed = plan(
            1,
            &claimed,
            &Change::Claimed {
                worker_id: "w".into(),
                now: 9,
            },
            None,
        )
        .unwrap()
        .unwrap();
        let changes = [
            Change::Completed { now: 10 },
            Change::Failed {
                reason: "r".into(),
                next_attempt_at: Some(11),
                now: 10,
                hold: false,
            },
            Change::Failed {
                reason: "r".into(),
                next_attempt_at: None,
                now: 10,
                hold: false,
            },
            Change::OutcomeUnknown {
                remote_ref: None,
                now: Some(10),
            },
            Change::Rescheduled {
                next_attempt_at: 11,
                now: Some(10),
            },
            Change::Released,
        ];
        for c in &changes {
            let new = plan(1, &claimed, c, None).unwrap().unwrap();
            let rec = new.to_record(1).unwrap();
            assert_ne!(rec.entry.status, OutboxStatus::Dispatching, "{c:?}");
            assert_eq!(rec.claim, None, "{c:?}");
            let kept = matches!(c, Change::OutcomeUnknown { .. });
            assert_eq!(rec.attempt_in_doubt.is_some(), kept, "{c:?}");
        }
    }

    /// A valid row in `status`, as the status machine leaves one.
    fn row_in(status: OutboxStatus) -> Row {
        let mut r = row(status);
        r.attempt_count = 1;
        match status {
            OutboxStatus::Dispatching | OutboxStatus::OutcomeUnknown => {
                r.attempt = Some(("w".into(), 9));
            }
            OutboxStatus::Completed | OutboxStatus::Failed => r.completed_at = Some(10),
            OutboxStatus::Pending => {}
        }
        r
    }

    /// Every change, in each of its forms.
    fn every_change() -> Vec<Change> {
        let all = vec![
            Change::Claimed {
                worker_id: "w".into(),
                now: 9,
            },
            Change::Completed { now: 10 },
            Change::Failed {
                reason: "r".into(),
                next_attempt_at: Some(11),
                now: 10,
                hold: false,
            },
            Change::Failed {
                reason: "r".into(),
                next_attempt_at: None,
                now: 10,
                hold: false,
            },
            Change::OutcomeUnknown {
                remote_ref: None,
                now: Some(10),
            },
            Change::OutcomeUnknown {
                remote_ref: Some("r".into()),
                now: None,
            },
            Change::Rescheduled {
                next_attempt_at: 11,
                now: Some(10),
            },
            Change::Released,
            Change::Requeued {
                next_attempt_at: 11,
            },
            Change::Cancelled { now: 10 },
        ];
        // A new variant does not compile here until it is in the list.
        let mut covered = [false; 8];
        for c in &all {
            let variant = match c {
                Change::Claimed { .. } => 0,
                Change::Completed { .. } => 1,
                Change::Failed { .. } => 2,
                Change::OutcomeUnknown { .. } => 3,
                Change::Rescheduled { .. } => 4,
                Change::Released => 5,
                Change::Requeued { .. } => 6,
                Change::Cancelled { .. } => 7,
            };
            covered[variant] = true;
        }
        assert!(covered.iter().all(|c| *c), "every variant is listed");
        all
    }

    #[test]
    fn a_change_makes_work_due_exactly_when_it_can_leave_the_entry_pending() {
        for c in every_change() {
            let leaves_pending = |from: OutboxStatus, fence: Option<u32>| {
                matches!(plan(1, &row_in(from), &c, fence),
                    Ok(Some(new)) if new.status == OutboxStatus::Pending)
            };
            let to_pending: Vec<OutboxStatus> = OutboxStatus::ALL
                .into_iter()
                .filter(|from| {
                    [None, Some(1)]
                        .into_iter()
                        .any(|f| leaves_pending(*from, f))
                })
                .collect();
            assert_eq!(
                c.makes_work_due(),
                !to_pending.is_empty(),
                "{c:?} leaves an entry Pending from {to_pending:?}"
            );
        }
    }
}
