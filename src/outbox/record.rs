//! The stored outbox record and the status machine.
//!
//! A record is [`Stored`], encoded by [`crate::codec`]: the entry's fields,
//! its status as a one-byte code, times as `i64` microseconds, the latest
//! attempt while it is in progress or in doubt, and the settlement details.
//! [`Stored::to_record`] turns it into the public [`OutboxRecord`].
//!
//! Every status change goes through one pure function, [`plan`]: given the
//! stored record and a [`Change`], it returns the new record, `None` for an
//! accepted no-op, or an error — and writes nothing. The callers write the
//! plan (row and index rows) only once it has been accepted, so a refused
//! change never leaves a trace.

use redb::TableHandle as _;
use serde::{Deserialize, Serialize};

use super::{OutboxClaim, OutboxEntry, OutboxId, OutboxRecord, OutboxStatus};
use crate::codec::from_micros;
use crate::error::{Error, Result};
use crate::schema::OUTBOX;

/// An outbox row as stored. Field order is the wire format: append only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Stored {
    pub(super) command_id: String,
    pub(super) destination: String,
    pub(super) idempotency_key: String,
    pub(super) payload: Vec<u8>,
    /// [`OutboxStatus::code`].
    pub(super) status: u8,
    pub(super) attempt_count: u32,
    pub(super) next_attempt_at: Option<i64>,
    pub(super) created_at: i64,
    pub(super) completed_at: Option<i64>,
    /// `(worker id, claimed_at µs)` of the latest attempt while it is in
    /// progress (`Dispatching`: the entry's claim, [`OutboxRecord::claim`])
    /// or in doubt (`OutcomeUnknown`: no longer a claim, shown as
    /// [`OutboxRecord::attempt_in_doubt`]); `None` in every other status.
    /// Its wire form is the one earlier builds wrote as "the claim" of both
    /// statuses, so their files read unchanged.
    pub(super) attempt: Option<(String, i64)>,
    pub(super) last_failure: Option<String>,
    pub(super) remote_ref: Option<String>,
}

impl OutboxStatus {
    /// The status's code in the record and in the counter table.
    pub(super) fn code(self) -> u8 {
        match self {
            OutboxStatus::Pending => 0,
            OutboxStatus::Dispatching => 1,
            OutboxStatus::Completed => 2,
            OutboxStatus::Failed => 3,
            OutboxStatus::OutcomeUnknown => 4,
        }
    }

    /// The status with code `code`, if any.
    pub(super) fn from_code(code: u8) -> Option<OutboxStatus> {
        Some(match code {
            0 => OutboxStatus::Pending,
            1 => OutboxStatus::Dispatching,
            2 => OutboxStatus::Completed,
            3 => OutboxStatus::Failed,
            4 => OutboxStatus::OutcomeUnknown,
            _ => return None,
        })
    }
}

impl Stored {
    /// The record's status; an unknown code is [`Error::Corrupted`].
    pub(super) fn status(&self, id: u64) -> Result<OutboxStatus> {
        OutboxStatus::from_code(self.status).ok_or_else(|| Error::Corrupted {
            table: OUTBOX.name(),
            key: id.to_string(),
            reason: format!("unknown status code {}", self.status),
        })
    }

    /// When a `Pending` record is due: `next_attempt_at`, else `created_at`.
    pub(super) fn due(&self) -> i64 {
        self.next_attempt_at.unwrap_or(self.created_at)
    }

    /// Decodes and checks a stored row (status code, timestamps in range).
    pub(super) fn decode(id: u64, bytes: &[u8]) -> Result<Stored> {
        let stored: Stored = crate::codec::decode(OUTBOX.name(), &id, bytes)?;
        stored.status(id)?;
        let times = [stored.created_at]
            .into_iter()
            .chain(stored.next_attempt_at)
            .chain(stored.completed_at)
            .chain(stored.attempt.as_ref().map(|a| a.1));
        for us in times {
            from_micros(OUTBOX.name(), &id, us)?;
        }
        Ok(stored)
    }

    /// The public view of this record.
    pub(super) fn to_record(&self, id: u64) -> Result<OutboxRecord> {
        let table = OUTBOX.name();
        let at = |us: i64| from_micros(table, &id, us);
        let opt = |us: Option<i64>| us.map(at).transpose();
        let status = self.status(id)?;
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
            },
            claim,
            attempt_in_doubt,
            last_failure: self.last_failure.clone(),
            remote_ref: self.remote_ref.clone(),
        })
    }
}

/// A status change asked of one record. Times are µs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Change {
    /// `claim_due` took it (the caller has checked it is due).
    Claim { worker_id: String, now: i64 },
    /// The effect happened.
    Complete { now: i64 },
    /// The attempt failed; retry at `retry_at`, or give up.
    Fail {
        reason: String,
        retry_at: Option<i64>,
        now: i64,
    },
    /// The attempt may or may not have happened.
    OutcomeUnknown { remote_ref: Option<String> },
    /// Try again at `at` (no failure recorded).
    Reschedule { at: i64 },
    /// The claim expired: back to `Pending`, due at its claim time.
    Release,
    /// An operator puts a `Failed` or `OutcomeUnknown` entry back to work.
    Requeue { due: i64 },
}

impl Change {
    /// The operation's name in error messages.
    fn name(&self) -> &'static str {
        match self {
            Change::Claim { .. } => "claim",
            Change::Complete { .. } => "mark_completed",
            Change::Fail {
                retry_at: Some(_), ..
            } => "mark_failed with a retry time",
            Change::Fail { retry_at: None, .. } => "mark_failed without a retry time",
            Change::OutcomeUnknown { .. } => "mark_outcome_unknown",
            Change::Reschedule { .. } => "reschedule",
            Change::Release => "release_expired_claims",
            Change::Requeue { .. } => "requeue",
        }
    }
}

/// Refuses a fenced change unless it comes from the holder of `attempt`.
fn check_fence(
    id: u64,
    old: &Stored,
    from: OutboxStatus,
    change: &Change,
    attempt: u32,
) -> Result<()> {
    use OutboxStatus::{Completed, Dispatching, Failed, OutcomeUnknown};
    if attempt != old.attempt_count {
        return Err(Error::conflict(format!(
            "attempt {attempt} of outbox entry {id} is stale: the entry is at attempt {} ({from:?})",
            old.attempt_count
        )));
    }
    let idempotent_repeat = matches!(
        (from, change),
        (Completed, Change::Complete { .. }) | (Failed, Change::Fail { retry_at: None, .. })
    );
    if matches!(from, Dispatching | OutcomeUnknown) || idempotent_repeat {
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
pub(super) fn plan(
    id: u64,
    old: &Stored,
    change: &Change,
    fence: Option<u32>,
) -> Result<Option<Stored>> {
    use OutboxStatus::{Completed, Dispatching, Failed, OutcomeUnknown, Pending};
    let from = old.status(id)?;
    let refuse = || {
        Err(Error::conflict(format!(
            "outbox entry {id} is {from:?}; {} is not allowed from there",
            change.name()
        )))
    };
    if let Some(attempt) = fence {
        check_fence(id, old, from, change, attempt)?;
    }
    let mut new = old.clone();
    match (from, change) {
        (Pending, Change::Claim { worker_id, now }) => {
            new.status = Dispatching.code();
            new.attempt_count = old.attempt_count.saturating_add(1);
            new.attempt = Some((worker_id.clone(), *now));
        }
        (Dispatching | OutcomeUnknown, Change::Complete { now }) => {
            new.status = Completed.code();
            new.completed_at = Some(*now);
            new.next_attempt_at = None;
            new.attempt = None;
        }
        (Completed, Change::Complete { .. }) | (Failed, Change::Fail { retry_at: None, .. }) => {
            return Ok(None);
        }
        (
            Pending | Dispatching | OutcomeUnknown,
            Change::Fail {
                reason,
                retry_at: Some(at),
                ..
            },
        ) => {
            new.status = Pending.code();
            new.next_attempt_at = Some(*at);
            new.last_failure = Some(reason.clone());
            new.attempt = None;
        }
        (
            Dispatching | OutcomeUnknown,
            Change::Fail {
                reason,
                retry_at: None,
                now,
            },
        ) => {
            new.status = Failed.code();
            new.completed_at = Some(*now);
            new.next_attempt_at = None;
            new.last_failure = Some(reason.clone());
            new.attempt = None;
        }
        (Dispatching, Change::OutcomeUnknown { remote_ref }) => {
            // The claim ends; its `attempt` stays as the attempt in doubt.
            new.status = OutcomeUnknown.code();
            if remote_ref.is_some() {
                new.remote_ref.clone_from(remote_ref);
            }
        }
        (OutcomeUnknown, Change::OutcomeUnknown { remote_ref }) => {
            if old.remote_ref.is_some() || remote_ref.is_none() {
                return Ok(None);
            }
            new.remote_ref.clone_from(remote_ref);
        }
        (Pending | Dispatching | OutcomeUnknown, Change::Reschedule { at }) => {
            new.status = Pending.code();
            new.next_attempt_at = Some(*at);
            new.attempt = None;
        }
        (Dispatching, Change::Release) => {
            let claimed_at = old.attempt.as_ref().map_or(old.created_at, |a| a.1);
            new.status = Pending.code();
            new.next_attempt_at = Some(claimed_at);
            new.attempt = None;
        }
        (Failed | OutcomeUnknown, Change::Requeue { due }) => {
            new.status = Pending.code();
            new.next_attempt_at = Some(*due);
            new.completed_at = None;
            new.attempt = None;
        }
        _ => return refuse(),
    }
    debug_assert!(
        OutboxStatus::from_code(new.status).is_some_and(|to| from.can_transition(to)),
        "{from:?} -> {:?}",
        OutboxStatus::from_code(new.status)
    );
    Ok(Some(new))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::encode;

    fn stored(status: u8) -> Stored {
        Stored {
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
        }
    }

    #[test]
    fn round_trips_and_rejects_unknown_statuses_and_times() {
        let good = stored(OutboxStatus::Pending.code());
        assert_eq!(Stored::decode(1, &encode(&good)).unwrap(), good);
        let bad_status = encode(&stored(9));
        assert!(matches!(
            Stored::decode(1, &bad_status),
            Err(Error::Corrupted { .. })
        ));
        let mut bad_time = stored(0);
        bad_time.next_attempt_at = Some(i64::MAX);
        assert!(matches!(
            Stored::decode(1, &encode(&bad_time)),
            Err(Error::Corrupted { .. })
        ));
    }

    /// An `OutcomeUnknown` record as earlier builds wrote it, when the
    /// attempt's `(worker, claimed_at)` was still called its claim.
    const OLD_OUTCOME_UNKNOWN: [u8; 24] = [
        1, // record version
        1, b'c', // command_id
        1, b'd', // destination
        1, b'k', // idempotency_key
        3, 1, 2, 3,  // payload
        4,  // status: OutcomeUnknown
        1,  // attempt_count
        0,  // next_attempt_at: None
        10, // created_at: 5 µs (zigzag)
        0,  // completed_at: None
        1, 1, b'w', 14, // ("w", 7 µs)
        0,  // last_failure: None
        1, 1, b'r', // remote_ref: Some("r")
    ];

    #[test]
    fn records_written_before_read_the_same_and_hold_no_claim_when_in_doubt() {
        let old = Stored::decode(3, &OLD_OUTCOME_UNKNOWN).unwrap();
        assert_eq!(old.attempt, Some(("w".to_owned(), 7)));
        assert_eq!(old.status(3).unwrap(), OutboxStatus::OutcomeUnknown);
        // The wire form has not changed: this build writes the same bytes.
        assert_eq!(encode(&old), OLD_OUTCOME_UNKNOWN);
        let rec = old.to_record(3).unwrap();
        assert_eq!(rec.claim, None, "only Dispatching holds a claim");
        let doubt = rec.attempt_in_doubt.expect("the attempt in doubt");
        assert_eq!(doubt.worker_id, "w");
        assert_eq!(doubt.claimed_at.timestamp_micros(), 7);
        assert_eq!(rec.remote_ref.as_deref(), Some("r"));
        // The same slot is the claim while Dispatching, and nothing else in
        // other statuses.
        let mut dispatching = old.clone();
        dispatching.status = OutboxStatus::Dispatching.code();
        let rec = dispatching.to_record(3).unwrap();
        assert_eq!(rec.claim.map(|c| c.worker_id).as_deref(), Some("w"));
        assert_eq!(rec.attempt_in_doubt, None);
    }

    #[test]
    fn every_edge_out_of_dispatching_ends_the_claim() {
        let mut claimed = stored(OutboxStatus::Pending.code());
        claimed = plan(
            1,
            &claimed,
            &Change::Claim {
                worker_id: "w".into(),
                now: 9,
            },
            None,
        )
        .unwrap()
        .unwrap();
        let changes = [
            Change::Complete { now: 10 },
            Change::Fail {
                reason: "r".into(),
                retry_at: Some(11),
                now: 10,
            },
            Change::Fail {
                reason: "r".into(),
                retry_at: None,
                now: 10,
            },
            Change::OutcomeUnknown { remote_ref: None },
            Change::Reschedule { at: 11 },
            Change::Release,
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

    #[test]
    fn status_codes_round_trip() {
        for s in OutboxStatus::ALL {
            assert_eq!(OutboxStatus::from_code(s.code()), Some(s));
        }
        assert_eq!(OutboxStatus::from_code(5), None);
    }
}
