//! The stored outbox record and the status machine.
//!
//! A record is stored as a [`Row`], encoded by [`crate::codec`]: the
//! entry's fields, its status as a one-byte code, times as `i64`
//! microseconds, the latest attempt while it is in progress or in doubt, and
//! the settlement details. [`Row::to_record`] turns it into the public
//! [`OutboxRecord`].
//!
//! Every status change goes through one pure function, [`plan`]: given the
//! row and a [`Change`], it returns the new row, `None` for an accepted
//! no-op, or an error — and writes nothing. The callers write the plan (row
//! and index rows) only once it has been accepted, so a refused change
//! never leaves a trace.

use redb::TableHandle as _;
use serde::{Deserialize, Serialize};

use super::types::failure_code;
use super::{
    AttemptRecord, OutboxClaim, OutboxEntry, OutboxId, OutboxRecord, OutboxStatus,
    REASON_CANCELLED, REASON_OUTCOME_UNKNOWN, REASON_RESCHEDULED,
};
use crate::codec::from_micros;
use crate::error::{Error, Result};
use crate::schema::{OUTBOX, OUTBOX_ATTEMPTS};

/// An outbox record as stored. Field order is the wire format: append only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Row {
    pub(crate) command_id: String,
    pub(crate) destination: String,
    pub(crate) idempotency_key: String,
    pub(crate) payload: Vec<u8>,
    /// [`OutboxStatus::code`].
    pub(crate) status: u8,
    pub(crate) attempt_count: u32,
    pub(crate) next_attempt_at: Option<i64>,
    pub(crate) created_at: i64,
    pub(crate) completed_at: Option<i64>,
    /// `(worker id, claimed_at µs)` of the latest attempt while it is in
    /// progress (`Dispatching`: the entry's claim, [`OutboxRecord::claim`])
    /// or in doubt (`OutcomeUnknown`: no longer a claim, shown as
    /// [`OutboxRecord::attempt_in_doubt`]); `None` in every other status.
    /// Its wire form is the one earlier builds wrote as "the claim" of both
    /// statuses, so their files read unchanged.
    pub(crate) attempt: Option<(String, i64)>,
    pub(crate) last_failure: Option<String>,
    pub(crate) remote_ref: Option<String>,
}

impl OutboxStatus {
    /// The status's code in the record and in the counter table.
    pub(crate) fn code(self) -> u8 {
        match self {
            OutboxStatus::Pending => 0,
            OutboxStatus::Dispatching => 1,
            OutboxStatus::Completed => 2,
            OutboxStatus::Failed => 3,
            OutboxStatus::OutcomeUnknown => 4,
        }
    }

    /// The status with code `code`, if any.
    pub(crate) fn from_code(code: u8) -> Option<OutboxStatus> {
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

/// A record's status and times: what its status index rows are keyed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Times {
    /// [`OutboxStatus::code`].
    pub(crate) status: u8,
    pub(crate) created_at: i64,
    pub(crate) next_attempt_at: Option<i64>,
    pub(crate) completed_at: Option<i64>,
    /// When the latest attempt was claimed, if one is stored.
    pub(crate) claimed_at: Option<i64>,
}

impl Times {
    /// The record's status; an unknown code is [`Error::Corrupted`].
    pub(crate) fn status(&self, id: u64) -> Result<OutboxStatus> {
        OutboxStatus::from_code(self.status).ok_or_else(|| Error::Corrupted {
            table: OUTBOX.name(),
            key: id.to_string(),
            reason: format!("unknown status code {}", self.status),
        })
    }

    /// When a `Pending` record is due: `next_attempt_at`, else `created_at`.
    pub(crate) fn due_at(&self) -> i64 {
        self.next_attempt_at.unwrap_or(self.created_at)
    }

    /// When the latest attempt was claimed (`created_at` if none is stored).
    pub(crate) fn claimed_at(&self) -> i64 {
        self.claimed_at.unwrap_or(self.created_at)
    }

    /// Checks what a stored row must hold: a known status code, every
    /// timestamp in range.
    fn check(&self, id: u64) -> Result<()> {
        self.status(id)?;
        let times = [self.created_at]
            .into_iter()
            .chain(self.next_attempt_at)
            .chain(self.completed_at)
            .chain(self.claimed_at);
        for us in times {
            from_micros(OUTBOX.name(), &id, us)?;
        }
        Ok(())
    }
}

/// What deleting a record must know of it: the fields its index rows are
/// keyed by, without the payload and the settlement details.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RowKeys {
    pub(crate) command_id: String,
    pub(crate) destination: String,
    pub(crate) idempotency_key: String,
    pub(crate) times: Times,
}

/// A stored [`Row`] read in place: the same wire format, every string and
/// the payload borrowed from the stored bytes.
#[derive(Deserialize)]
struct RowView<'a> {
    command_id: &'a str,
    destination: &'a str,
    idempotency_key: &'a str,
    _payload: &'a [u8],
    status: u8,
    _attempt_count: u32,
    next_attempt_at: Option<i64>,
    created_at: i64,
    completed_at: Option<i64>,
    #[serde(borrow)]
    attempt: Option<(&'a str, i64)>,
    #[serde(borrow)]
    _last_failure: Option<&'a str>,
    #[serde(borrow)]
    _remote_ref: Option<&'a str>,
}

impl RowKeys {
    /// Decodes and checks a stored row as [`Row::decode`] does (the same
    /// bytes are refused), copying only the fields deleting it needs: a
    /// purge does not load the payloads it deletes.
    pub(crate) fn decode(id: u64, bytes: &[u8]) -> Result<RowKeys> {
        let view: RowView<'_> = crate::codec::decode_borrowed(OUTBOX.name(), &id, bytes)?;
        let keys = RowKeys {
            command_id: view.command_id.to_owned(),
            destination: view.destination.to_owned(),
            idempotency_key: view.idempotency_key.to_owned(),
            times: Times {
                status: view.status,
                created_at: view.created_at,
                next_attempt_at: view.next_attempt_at,
                completed_at: view.completed_at,
                claimed_at: view.attempt.map(|a| a.1),
            },
        };
        keys.times.check(id)?;
        Ok(keys)
    }
}

impl Row {
    /// The record's status and times.
    pub(crate) fn times(&self) -> Times {
        Times {
            status: self.status,
            created_at: self.created_at,
            next_attempt_at: self.next_attempt_at,
            completed_at: self.completed_at,
            claimed_at: self.attempt.as_ref().map(|a| a.1),
        }
    }

    /// The record's status; an unknown code is [`Error::Corrupted`].
    pub(crate) fn status(&self, id: u64) -> Result<OutboxStatus> {
        self.times().status(id)
    }

    /// When the latest attempt was claimed (`created_at` if none is stored).
    pub(crate) fn claimed_at(&self) -> i64 {
        self.times().claimed_at()
    }

    /// Decodes and checks a stored row (status code, timestamps in range).
    pub(crate) fn decode(id: u64, bytes: &[u8]) -> Result<Row> {
        let row: Row = crate::codec::decode(OUTBOX.name(), &id, bytes)?;
        row.times().check(id)?;
        Ok(row)
    }

    /// The public view of this record, without its attempt history (which
    /// is stored apart: the caller adds it).
    pub(crate) fn to_record(&self, id: u64) -> Result<OutboxRecord> {
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
            attempts: Vec::new(),
        })
    }

    /// Back to `Pending`, due at `next_attempt_at`, the attempt dropped.
    fn make_pending(&mut self, next_attempt_at: i64) {
        self.status = OutboxStatus::Pending.code();
        self.next_attempt_at = Some(next_attempt_at);
        self.attempt = None;
    }

    /// Finished as `status` (`Completed` or `Failed`) at `now`: no longer
    /// due, the attempt dropped.
    fn make_finished(&mut self, status: OutboxStatus, now: i64) {
        self.status = status.code();
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
    /// The attempt failed; retry at `next_attempt_at`, or give up.
    Failed {
        reason: String,
        next_attempt_at: Option<i64>,
        now: i64,
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

/// One record of an entry's attempt history as stored in
/// [`OUTBOX_ATTEMPTS`] under `(id, seq)`, encoded by [`crate::codec`].
/// Field order is the wire format: append only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AttemptRow {
    pub(crate) attempt: u32,
    /// µs.
    pub(crate) at: i64,
    pub(crate) reason: String,
    pub(crate) remote_ref: Option<String>,
}

impl AttemptRow {
    /// Decodes and checks a stored attempt record of entry `id`.
    pub(crate) fn decode(id: u64, seq: u64, bytes: &[u8]) -> Result<AttemptRow> {
        let key = format!("{id}/{seq}");
        let row: AttemptRow = crate::codec::decode(OUTBOX_ATTEMPTS.name(), &key, bytes)?;
        from_micros(OUTBOX_ATTEMPTS.name(), &key, row.at)?;
        Ok(row)
    }

    /// The public view of this attempt record.
    pub(crate) fn to_record(&self, id: u64, seq: u64) -> Result<AttemptRecord> {
        let key = format!("{id}/{seq}");
        Ok(AttemptRecord {
            attempt: self.attempt,
            at: from_micros(OUTBOX_ATTEMPTS.name(), &key, self.at)?,
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
    if change.is_final_for(from) {
        return Ok(None);
    }
    if let Change::Cancelled { now } = change {
        return plan_cancel(id, old, from, *now);
    }
    let mut new = old.clone();
    match (from, change) {
        (Pending, Change::Claimed { worker_id, now }) => {
            new.status = Dispatching.code();
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
            },
        ) => {
            new.make_finished(Failed, *now);
            new.last_failure = Some(failure_code(reason).to_owned());
        }
        (Dispatching, Change::OutcomeUnknown { remote_ref, .. }) => {
            // The claim ends; its `attempt` stays as the attempt in doubt.
            new.status = OutcomeUnknown.code();
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
        OutboxStatus::from_code(new.status).is_some_and(|to| from.can_transition(to)),
        "{from:?} -> {:?}",
        OutboxStatus::from_code(new.status)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::encode;

    fn row(status: u8) -> Row {
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
        }
    }

    #[test]
    fn round_trips_and_rejects_unknown_statuses_and_times() {
        let good = row(OutboxStatus::Pending.code());
        assert_eq!(Row::decode(1, &encode(&good)).unwrap(), good);
        let bad_status = encode(&row(9));
        assert!(matches!(
            Row::decode(1, &bad_status),
            Err(Error::Corrupted { .. })
        ));
        let mut bad_time = row(0);
        bad_time.next_attempt_at = Some(i64::MAX);
        assert!(matches!(
            Row::decode(1, &encode(&bad_time)),
            Err(Error::Corrupted { .. })
        ));
    }

    #[test]
    fn keys_read_in_place_match_the_row_and_refuse_what_it_refuses() {
        let mut full = row(OutboxStatus::Completed.code());
        full.payload = vec![7; 5000];
        full.completed_at = Some(full.created_at + 9);
        full.attempt = Some(("w".into(), full.created_at + 3));
        full.last_failure = Some("http_500".into());
        full.remote_ref = Some("r".into());
        let keys = RowKeys::decode(4, &encode(&full)).unwrap();
        assert_eq!(
            keys,
            RowKeys {
                command_id: "c".into(),
                destination: "d".into(),
                idempotency_key: "k".into(),
                times: full.times(),
            }
        );
        assert_eq!(
            RowKeys::decode(3, &OLD_OUTCOME_UNKNOWN).unwrap().times,
            Row::decode(3, &OLD_OUTCOME_UNKNOWN).unwrap().times()
        );
        let mut bad_time = full.clone();
        bad_time.completed_at = Some(i64::MIN);
        for bad in [
            encode(&row(9)),
            encode(&bad_time),
            encode(&full)[..20].to_vec(),
            [encode(&full), vec![0]].concat(),
        ] {
            assert!(
                matches!(RowKeys::decode(1, &bad), Err(Error::Corrupted { .. })),
                "{bad:?}"
            );
            assert!(matches!(Row::decode(1, &bad), Err(Error::Corrupted { .. })));
        }
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
        let old = Row::decode(3, &OLD_OUTCOME_UNKNOWN).unwrap();
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

    /// The wire form of an attempt record, pinned: files keep it.
    #[test]
    fn attempt_records_have_a_fixed_wire_form() {
        const BYTES: [u8; 12] = [
            1,  // record version
            3,  // attempt
            14, // at: 7 µs (zigzag)
            5, b'x', b' ', b'(', b'y', b')', // reason
            1, 1, b'r', // remote_ref: Some("r")
        ];
        let row = AttemptRow {
            attempt: 3,
            at: 7,
            reason: "x (y)".into(),
            remote_ref: Some("r".into()),
        };
        assert_eq!(encode(&row), BYTES);
        assert_eq!(AttemptRow::decode(1, 0, &BYTES).unwrap(), row);
        let mut late = row.clone();
        late.at = i64::MAX;
        assert!(matches!(
            AttemptRow::decode(1, 0, &encode(&late)),
            Err(Error::Corrupted { key, .. }) if key == "1/0"
        ));
    }

    #[test]
    fn every_edge_out_of_dispatching_ends_the_claim() {
        let mut claimed = row(OutboxStatus::Pending.code());
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
            },
            Change::Failed {
                reason: "r".into(),
                next_attempt_at: None,
                now: 10,
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

    #[test]
    fn status_codes_round_trip() {
        for s in OutboxStatus::ALL {
            assert_eq!(OutboxStatus::from_code(s.code()), Some(s));
        }
        assert_eq!(OutboxStatus::from_code(5), None);
    }

    /// A valid row in `status`, as the status machine leaves one.
    fn row_in(status: OutboxStatus) -> Row {
        let mut r = row(status.code());
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
            },
            Change::Failed {
                reason: "r".into(),
                next_attempt_at: None,
                now: 10,
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
                    Ok(Some(new)) if new.status(1).unwrap() == OutboxStatus::Pending)
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
