//! The outbox's records as the embedded store keeps them: a [`Row`]
//! encoded by [`crate::codec`] as [`Stored`] (the entry's fields, its status
//! as a one-byte code, times as `i64` microseconds, the latest attempt
//! while it is in progress or in doubt, and the settlement details), and an
//! [`AttemptRow`] of the history. Decoding checks what a stored row must
//! hold (a known status code, every timestamp in range). The rules that
//! change a row are in `rules.rs` and know nothing of this encoding.
//!
//! An entry is written whole once, when it is enqueued. What changes after
//! (its status, attempts, times, settlement details and place in its
//! sequence: [`StoredState`]) is written to its row in [`OUTBOX_STATE`],
//! which stands in for the state the whole row was written with: a claim
//! or a settlement rewrites a few dozen bytes, not the entry and its
//! payload, and the entries a batch of one destination touches (spread
//! among the other destinations' ids) share fewer pages.

use redb::TableHandle as _;
use serde::{Deserialize, Serialize};

use super::OutboxStatus;
use super::rules::{AttemptRow, Row};
use crate::codec::{decode_borrowed, decode_extended, encode, from_micros};
use crate::error::{Error, Result};
use crate::schema::{OUTBOX, OUTBOX_ATTEMPTS, OUTBOX_STATE};

/// A [`Row`] as stored, every string and the payload borrowed: what is
/// encoded, and what is decoded in place. Field order is the wire format:
/// append only.
#[derive(Serialize, Deserialize)]
struct Stored<'a> {
    command_id: &'a str,
    destination: &'a str,
    idempotency_key: &'a str,
    payload: &'a [u8],
    /// [`OutboxStatus::code`].
    status: u8,
    attempt_count: u32,
    next_attempt_at: Option<i64>,
    created_at: i64,
    completed_at: Option<i64>,
    /// `(worker id, claimed_at µs)`: [`Row::attempt`]. Its wire form is the
    /// one earlier builds wrote as "the claim" of both `Dispatching` and
    /// `OutcomeUnknown`, so their files read unchanged.
    #[serde(borrow)]
    attempt: Option<(&'a str, i64)>,
    #[serde(borrow)]
    last_failure: Option<&'a str>,
    #[serde(borrow)]
    remote_ref: Option<&'a str>,
}

/// The fields a [`Stored`] row gained after its first form, encoded after
/// it; a row written before has none (ordering key and sequence absent,
/// priority 0). Field order is the wire format: append only.
#[derive(Serialize, Deserialize, Default)]
struct Appended<'a> {
    #[serde(borrow)]
    ordering_key: Option<&'a str>,
    priority: u8,
    seq: Option<u64>,
}

impl<'a> Appended<'a> {
    fn of(row: &'a Row) -> Appended<'a> {
        Appended {
            ordering_key: row.ordering_key.as_deref(),
            priority: row.priority,
            seq: row.seq,
        }
    }
}

/// The state of an entry that changed since it was enqueued, as stored in
/// [`OUTBOX_STATE`]: it replaces the fields of the same names of the
/// entry's [`Stored`] row and the `seq` of its [`Appended`] fields. Field
/// order is the wire format: append only.
#[derive(Serialize, Deserialize)]
struct StoredState<'a> {
    status: u8,
    attempt_count: u32,
    next_attempt_at: Option<i64>,
    completed_at: Option<i64>,
    #[serde(borrow)]
    attempt: Option<(&'a str, i64)>,
    #[serde(borrow)]
    last_failure: Option<&'a str>,
    #[serde(borrow)]
    remote_ref: Option<&'a str>,
    seq: Option<u64>,
}

impl<'a> StoredState<'a> {
    fn of(row: &'a Row) -> StoredState<'a> {
        StoredState {
            status: row.status.code(),
            attempt_count: row.attempt_count,
            next_attempt_at: row.next_attempt_at,
            completed_at: row.completed_at,
            attempt: row.attempt.as_ref().map(|(w, at)| (w.as_str(), *at)),
            last_failure: row.last_failure.as_deref(),
            remote_ref: row.remote_ref.as_deref(),
            seq: row.seq,
        }
    }

    /// Puts this state in place of the one `stored` and `appended` were
    /// written with.
    fn apply(self, stored: &mut Stored<'a>, appended: &mut Appended<'a>) {
        stored.status = self.status;
        stored.attempt_count = self.attempt_count;
        stored.next_attempt_at = self.next_attempt_at;
        stored.completed_at = self.completed_at;
        stored.attempt = self.attempt;
        stored.last_failure = self.last_failure;
        stored.remote_ref = self.remote_ref;
        appended.seq = self.seq;
    }
}

impl<'a> Stored<'a> {
    fn of(row: &'a Row) -> Stored<'a> {
        Stored {
            command_id: &row.command_id,
            destination: &row.destination,
            idempotency_key: &row.idempotency_key,
            payload: &row.payload,
            status: row.status.code(),
            attempt_count: row.attempt_count,
            next_attempt_at: row.next_attempt_at,
            created_at: row.created_at,
            completed_at: row.completed_at,
            attempt: row.attempt.as_ref().map(|(w, at)| (w.as_str(), *at)),
            last_failure: row.last_failure.as_deref(),
            remote_ref: row.remote_ref.as_deref(),
        }
    }

    /// Decodes and checks record `id` (status code, timestamps in range):
    /// its row `bytes` in [`OUTBOX`] and, if it changed since it was
    /// enqueued, its `state` in [`OUTBOX_STATE`].
    fn decode(
        id: u64,
        bytes: &'a [u8],
        state: Option<&'a [u8]>,
    ) -> Result<(Stored<'a>, Appended<'a>)> {
        let (mut stored, mut appended): (Stored<'_>, Appended<'_>) =
            decode_extended(OUTBOX.name(), &id, bytes)?;
        // A bad state or time is named by the row that holds it.
        let table = match state {
            Some(state) => {
                decode_borrowed::<StoredState<'_>>(OUTBOX_STATE.name(), &id, state)?
                    .apply(&mut stored, &mut appended);
                OUTBOX_STATE.name()
            }
            None => OUTBOX.name(),
        };
        stored.times().check(table, id)?;
        Ok((stored, appended))
    }

    fn times(&self) -> Times {
        Times {
            status: self.status,
            created_at: self.created_at,
            next_attempt_at: self.next_attempt_at,
            completed_at: self.completed_at,
            claimed_at: self.attempt.map(|a| a.1),
        }
    }
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
        self.status_in(OUTBOX.name(), id)
    }

    /// [`Times::status`], an unknown code named by the row of `table` that
    /// holds it.
    fn status_in(&self, table: &'static str, id: u64) -> Result<OutboxStatus> {
        OutboxStatus::from_code(self.status).ok_or_else(|| Error::Corrupted {
            table,
            key: id.to_string(),
            reason: format!("unknown status code {}", self.status),
        })
    }

    /// When the latest attempt was claimed (`created_at` if none is stored).
    pub(crate) fn claimed_at(&self) -> i64 {
        self.claimed_at.unwrap_or(self.created_at)
    }

    /// Checks what a stored row of `table` must hold: a known status code,
    /// every timestamp in range.
    fn check(&self, table: &'static str, id: u64) -> Result<()> {
        self.status_in(table, id)?;
        let times = [self.created_at]
            .into_iter()
            .chain(self.next_attempt_at)
            .chain(self.completed_at)
            .chain(self.claimed_at);
        for us in times {
            from_micros(table, &id, us)?;
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

impl RowKeys {
    /// Decodes and checks a stored record as [`Row::decode`] does (the same
    /// bytes are refused), copying only the fields deleting it needs: a
    /// purge does not load the payloads it deletes.
    pub(crate) fn decode(id: u64, bytes: &[u8], state: Option<&[u8]>) -> Result<RowKeys> {
        let (stored, _) = Stored::decode(id, bytes, state)?;
        Ok(RowKeys {
            command_id: stored.command_id.to_owned(),
            destination: stored.destination.to_owned(),
            idempotency_key: stored.idempotency_key.to_owned(),
            times: stored.times(),
        })
    }
}

impl Row {
    /// The record's status and times, as its index rows are keyed.
    pub(crate) fn times(&self) -> Times {
        Times {
            status: self.status.code(),
            created_at: self.created_at,
            next_attempt_at: self.next_attempt_at,
            completed_at: self.completed_at,
            claimed_at: self.attempt.as_ref().map(|a| a.1),
        }
    }

    /// Decodes and checks a stored record (status code, timestamps in
    /// range): its row `bytes` and, if it changed since it was enqueued,
    /// its `state`.
    pub(crate) fn decode(id: u64, bytes: &[u8], state: Option<&[u8]>) -> Result<Row> {
        let (s, appended) = Stored::decode(id, bytes, state)?;
        let status = s.times().status(id)?;
        Ok(Row {
            command_id: s.command_id.to_owned(),
            destination: s.destination.to_owned(),
            idempotency_key: s.idempotency_key.to_owned(),
            payload: s.payload.to_vec(),
            status,
            attempt_count: s.attempt_count,
            next_attempt_at: s.next_attempt_at,
            created_at: s.created_at,
            completed_at: s.completed_at,
            attempt: s.attempt.map(|(w, at)| (w.to_owned(), at)),
            last_failure: s.last_failure.map(str::to_owned),
            remote_ref: s.remote_ref.map(str::to_owned),
            ordering_key: appended.ordering_key.map(str::to_owned),
            priority: appended.priority,
            seq: appended.seq,
        })
    }

    /// The stored bytes of this row.
    pub(crate) fn encode(&self) -> Vec<u8> {
        if self.ordering_key.is_none() && self.priority == 0 && self.seq.is_none() {
            // The first form, which every build reads.
            return encode(&Stored::of(self));
        }
        encode(&(Stored::of(self), Appended::of(self)))
    }

    /// The stored bytes of this row's state: what a change writes.
    pub(crate) fn encode_state(&self) -> Vec<u8> {
        encode(&StoredState::of(self))
    }
}

/// An [`AttemptRow`] as stored in [`OUTBOX_ATTEMPTS`] under `(id, seq)`.
/// Field order is the wire format: append only.
#[derive(Serialize, Deserialize)]
#[serde(remote = "AttemptRow")]
struct StoredAttempt {
    attempt: u32,
    at: i64,
    reason: String,
    remote_ref: Option<String>,
}

/// An [`AttemptRow`] to encode.
struct AttemptOut<'a>(&'a AttemptRow);

impl Serialize for AttemptOut<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        StoredAttempt::serialize(self.0, s)
    }
}

/// An [`AttemptRow`] decoded.
struct AttemptIn(AttemptRow);

impl<'de> Deserialize<'de> for AttemptIn {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<AttemptIn, D::Error> {
        StoredAttempt::deserialize(d).map(AttemptIn)
    }
}

impl AttemptRow {
    /// Decodes and checks a stored attempt record of entry `id`.
    pub(crate) fn decode(id: u64, seq: u64, bytes: &[u8]) -> Result<AttemptRow> {
        let key = format!("{id}/{seq}");
        let AttemptIn(row) = crate::codec::decode(OUTBOX_ATTEMPTS.name(), &key, bytes)?;
        from_micros(OUTBOX_ATTEMPTS.name(), &key, row.at)?;
        Ok(row)
    }

    /// The stored bytes of this attempt record.
    pub(crate) fn encode(&self) -> Vec<u8> {
        encode(&AttemptOut(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::rules::tests::row;

    /// `row` stored with the status code `code`.
    fn with_code(row: &Row, code: u8) -> Vec<u8> {
        let mut stored = Stored::of(row);
        stored.status = code;
        encode(&stored)
    }

    #[test]
    fn round_trips_and_rejects_unknown_statuses_and_times() {
        let good = row(OutboxStatus::Pending);
        assert_eq!(Row::decode(1, &good.encode(), None).unwrap(), good);
        let bad_status = with_code(&row(OutboxStatus::Pending), 9);
        assert!(matches!(
            Row::decode(1, &bad_status, None),
            Err(Error::Corrupted { .. })
        ));
        let mut bad_time = row(OutboxStatus::Pending);
        bad_time.next_attempt_at = Some(i64::MAX);
        assert!(matches!(
            Row::decode(1, &bad_time.encode(), None),
            Err(Error::Corrupted { .. })
        ));
    }

    #[test]
    fn keys_read_in_place_match_the_row_and_refuse_what_it_refuses() {
        let mut full = row(OutboxStatus::Completed);
        full.payload = vec![7; 5000];
        full.completed_at = Some(full.created_at + 9);
        full.attempt = Some(("w".into(), full.created_at + 3));
        full.last_failure = Some("http_500".into());
        full.remote_ref = Some("r".into());
        let keys = RowKeys::decode(4, &full.encode(), None).unwrap();
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
            RowKeys::decode(3, &OLD_OUTCOME_UNKNOWN, None)
                .unwrap()
                .times,
            Row::decode(3, &OLD_OUTCOME_UNKNOWN, None).unwrap().times()
        );
        let mut bad_time = full.clone();
        bad_time.completed_at = Some(i64::MIN);
        for bad in [
            with_code(&row(OutboxStatus::Pending), 9),
            bad_time.encode(),
            full.encode()[..20].to_vec(),
            [full.encode(), vec![0]].concat(),
        ] {
            assert!(
                matches!(RowKeys::decode(1, &bad, None), Err(Error::Corrupted { .. })),
                "{bad:?}"
            );
            assert!(matches!(
                Row::decode(1, &bad, None),
                Err(Error::Corrupted { .. })
            ));
        }
    }

    #[test]
    fn a_state_row_stands_in_for_the_state_the_row_was_written_with() {
        let enqueued = {
            let mut r = row(OutboxStatus::Pending);
            r.payload = vec![7; 5000];
            r.ordering_key = Some("o".into());
            r.priority = 3;
            r.seq = Some(4);
            r
        };
        let mut settled = enqueued.clone();
        settled.status = OutboxStatus::Completed;
        settled.attempt_count = 2;
        settled.completed_at = Some(enqueued.created_at + 9);
        settled.last_failure = Some("http_500".into());
        settled.remote_ref = Some("r".into());
        settled.seq = None;
        let state = settled.encode_state();
        assert!(
            state.len() < 40,
            "a state row is small: {} bytes",
            state.len()
        );
        let bytes = enqueued.encode();
        assert_eq!(Row::decode(5, &bytes, Some(&state)).unwrap(), settled);
        assert_eq!(
            RowKeys::decode(5, &bytes, Some(&state)).unwrap().times,
            settled.times()
        );
        assert_eq!(Row::decode(5, &bytes, None).unwrap(), enqueued);
        // A bad state row is refused as a bad row is, naming its table.
        let mut bad_time = settled.clone();
        bad_time.completed_at = Some(i64::MIN);
        let mut bad_code = settled.encode_state();
        bad_code[1] = 9;
        for bad in [
            bad_time.encode_state(),
            bad_code,
            state[..state.len() - 1].to_vec(),
            [state.clone(), vec![0]].concat(),
            vec![],
        ] {
            assert!(
                matches!(
                    Row::decode(5, &bytes, Some(&bad)),
                    Err(Error::Corrupted { .. })
                ),
                "{bad:?}"
            );
            assert!(matches!(
                RowKeys::decode(5, &bytes, Some(&bad)),
                Err(Error::Corrupted { .. })
            ));
        }
        let err = Row::decode(5, &bytes, Some(&[1, 0xff])).unwrap_err();
        assert!(
            matches!(&err, Error::Corrupted { table, .. } if *table == OUTBOX_STATE.name()),
            "{err:?}"
        );
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
        let old = Row::decode(3, &OLD_OUTCOME_UNKNOWN, None).unwrap();
        assert_eq!(old.attempt, Some(("w".to_owned(), 7)));
        assert_eq!(old.status, OutboxStatus::OutcomeUnknown);
        // The wire form has not changed: this build writes the same bytes.
        assert_eq!(old.encode(), OLD_OUTCOME_UNKNOWN);
        let rec = old.to_record(3).unwrap();
        assert_eq!(rec.claim, None, "only Dispatching holds a claim");
        let doubt = rec.attempt_in_doubt.expect("the attempt in doubt");
        assert_eq!(doubt.worker_id, "w");
        assert_eq!(doubt.claimed_at.timestamp_micros(), 7);
        assert_eq!(rec.remote_ref.as_deref(), Some("r"));
        // The same slot is the claim while Dispatching, and nothing else in
        // other statuses.
        let mut dispatching = old.clone();
        dispatching.status = OutboxStatus::Dispatching;
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
        assert_eq!(row.encode(), BYTES);
        assert_eq!(AttemptRow::decode(1, 0, &BYTES).unwrap(), row);
        let mut late = row.clone();
        late.at = i64::MAX;
        assert!(matches!(
            AttemptRow::decode(1, 0, &late.encode()),
            Err(Error::Corrupted { key, .. }) if key == "1/0"
        ));
    }

    #[test]
    fn errors_name_the_tables_the_records_are_in() {
        use crate::outbox::rules::{ATTEMPT_RECORDS, RECORDS};
        assert_eq!(RECORDS, OUTBOX.name());
        assert_eq!(ATTEMPT_RECORDS, OUTBOX_ATTEMPTS.name());
    }

    #[test]
    fn status_codes_round_trip() {
        for s in OutboxStatus::ALL {
            assert_eq!(OutboxStatus::from_code(s.code()), Some(s));
        }
        assert_eq!(OutboxStatus::from_code(5), None);
    }
}
