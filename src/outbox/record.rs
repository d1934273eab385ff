//! The stored outbox record and the status machine.
//!
//! A record is [`Stored`], encoded by [`crate::codec`]: the entry's fields,
//! its status as a one-byte code, times as `i64` microseconds, the current
//! claim and the settlement details. [`Stored::to_record`] turns it into the
//! public [`OutboxRecord`].
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
    /// `(worker id, claimed_at µs)` while `Dispatching` or `OutcomeUnknown`.
    pub(super) claim: Option<(String, i64)>,
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
            .chain(stored.claim.as_ref().map(|c| c.1));
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
        Ok(OutboxRecord {
            entry: OutboxEntry {
                id: OutboxId(id),
                command_id: self.command_id.clone(),
                destination: self.destination.clone(),
                idempotency_key: self.idempotency_key.clone(),
                payload: self.payload.clone(),
                status: self.status(id)?,
                attempt_count: self.attempt_count,
                next_attempt_at: opt(self.next_attempt_at)?,
                created_at: at(self.created_at)?,
                completed_at: opt(self.completed_at)?,
            },
            claim: match &self.claim {
                Some((worker_id, claimed_at)) => Some(OutboxClaim {
                    worker_id: worker_id.clone(),
                    claimed_at: at(*claimed_at)?,
                }),
                None => None,
            },
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

/// What `change` does to `old` (record `id`), following DESIGN.md's status
/// table: `Ok(Some(new))` to write, `Ok(None)` for an accepted no-op,
/// `Err(Conflict)` for a refused edge.
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
            new.claim = Some((worker_id.clone(), *now));
        }
        (Dispatching | OutcomeUnknown, Change::Complete { now }) => {
            new.status = Completed.code();
            new.completed_at = Some(*now);
            new.next_attempt_at = None;
            new.claim = None;
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
            new.claim = None;
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
            new.claim = None;
        }
        (Dispatching, Change::OutcomeUnknown { remote_ref }) => {
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
            new.claim = None;
        }
        (Dispatching, Change::Release) => {
            let claimed_at = old.claim.as_ref().map_or(old.created_at, |c| c.1);
            new.status = Pending.code();
            new.next_attempt_at = Some(claimed_at);
            new.claim = None;
        }
        (Failed | OutcomeUnknown, Change::Requeue { due }) => {
            new.status = Pending.code();
            new.next_attempt_at = Some(*due);
            new.completed_at = None;
            new.claim = None;
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
            claim: None,
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

    #[test]
    fn status_codes_round_trip() {
        for s in OutboxStatus::ALL {
            assert_eq!(OutboxStatus::from_code(s.code()), Some(s));
        }
        assert_eq!(OutboxStatus::from_code(5), None);
    }
}
