//! The public data types of the outbox: what is enqueued, what is stored
//! and listed, and how an attempt is settled.

use std::fmt;

use chrono::{DateTime, Utc};

#[cfg(doc)]
use super::Outbox;
use super::rules::{Change, Row};
use crate::codec::micros;
#[cfg(doc)]
use crate::error::Error;
use crate::error::{Result, check_len};

/// Longest `command_id`, `destination`, `idempotency_key`, `worker_id`,
/// failure reason and remote reference accepted, in bytes.
pub const MAX_OUTBOX_FIELD_LEN: usize = 1024;

/// Checks one of the outbox's string fields: 1 to [`MAX_OUTBOX_FIELD_LEN`]
/// bytes.
pub(crate) fn check_field(field: &'static str, value: &str) -> Result<()> {
    check_len(field, value, MAX_OUTBOX_FIELD_LEN)
}

/// An outbox entry's id: assigned by the store, increasing in enqueue order
/// (also across reopens), never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OutboxId(pub u64);

impl fmt::Display for OutboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Where an outbox entry is in its life.
///
/// | from \ op      | `claim_due` | `mark_completed` | `mark_failed` (retry) | `mark_failed` (none) | `mark_outcome_unknown` | `reschedule` | `release_expired` | `requeue` | `cancel` |
/// |----------------|-------------|------------------|-----------------------|----------------------|------------------------|--------------|-------------------|-----------|----------|
/// | Pending        | →Dispatching (if due) | Conflict | →Pending (moves time) | Conflict | Conflict | →Pending (moves time) | — | Conflict | →Failed |
/// | Dispatching    | —         | →Completed     | →Pending           | →Failed           | →`OutcomeUnknown`    | →Pending   | →Pending (if claimed before cutoff) | Conflict | Conflict |
/// | `OutcomeUnknown` | —       | →Completed     | →Pending           | →Failed           | accepted; fills a missing `remote_ref` | →Pending | — | →Pending | →Failed |
/// | Completed      | —         | accepted, no change | Conflict      | Conflict          | Conflict             | Conflict   | — | Conflict | Conflict |
/// | Failed         | —         | Conflict       | Conflict           | accepted, no change | Conflict           | Conflict   | — | →Pending | accepted, no change if cancelled; else Conflict |
///
/// An unknown id is [`Error::NotFound`]; a refused cell is
/// [`Error::Conflict`] and changes nothing. `release_expired` puts an entry
/// back due at its claim time, so due at once.
///
/// **Only `Dispatching` holds a claim.** Every edge out of it (→`Completed`,
/// →`Pending`, →`Failed`, →`OutcomeUnknown`) clears the claim
/// `{worker_id, claimed_at}` ([`OutboxRecord::claim`] becomes `None`) and
/// removes the entry's `(claimed_at, id)` row from the claims index, which
/// holds `Dispatching` entries only; so
/// [`release_expired_claims`](Outbox::release_expired_claims) never touches
/// an entry of any other status, `OutcomeUnknown` included. On the edge to
/// `OutcomeUnknown` the worker and time of the attempt stay on the record as
/// [`OutboxRecord::attempt_in_doubt`], for reconciliation.
///
/// A closed set: the states of the status machine above. A new state
/// would change the machine, and so the meaning of every match on it: it
/// would come with a new major version. Match it exhaustively.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OutboxStatus {
    /// Waiting to be claimed once due.
    Pending,
    /// Claimed by a worker, which is performing the effect.
    Dispatching,
    /// The effect happened. Terminal.
    Completed,
    /// The effect was given up on, or [cancelled](Outbox::cancel).
    /// Terminal (an operator may [`requeue`](Outbox::requeue) it).
    Failed,
    /// The worker cannot tell whether the effect happened (a timeout after
    /// sending). Holds no claim. Needs reconciliation: complete, fail or
    /// requeue it.
    OutcomeUnknown,
}

impl OutboxStatus {
    /// Every status, in code order.
    pub const ALL: [OutboxStatus; 5] = [
        OutboxStatus::Pending,
        OutboxStatus::Dispatching,
        OutboxStatus::Completed,
        OutboxStatus::Failed,
        OutboxStatus::OutcomeUnknown,
    ];

    /// Whether some operation moves an entry from `self` to `to`: the edges
    /// of the table above. `Pending → Pending` (a new due time),
    /// `OutcomeUnknown → OutcomeUnknown` (a remote reference filled in) and
    /// `Pending → Failed` (a cancel) count; the accepted no-op cells on
    /// `Completed` and `Failed` change nothing and do not.
    pub fn can_transition(self, to: OutboxStatus) -> bool {
        use OutboxStatus::{Completed, Dispatching, Failed, OutcomeUnknown, Pending};
        matches!(
            (self, to),
            (Pending, Pending | Dispatching | Failed)
                | (
                    Dispatching | OutcomeUnknown,
                    Pending | Completed | Failed | OutcomeUnknown
                )
                | (Failed, Pending)
        )
    }

    /// Whether the entry is finished (`Completed` or `Failed`): it has a
    /// `completed_at` and is what [`Outbox::purge_finished`] removes.
    pub fn is_finished(self) -> bool {
        matches!(self, OutboxStatus::Completed | OutboxStatus::Failed)
    }

    /// The status's name: `pending`, `dispatching`, `completed`, `failed`,
    /// `outcome_unknown`. The one table of names: the PostgreSQL `status`
    /// column stores it, the operator CLI prints it, the
    /// `idemstore_outbox_entries` gauge's `status` label carries it, and
    /// [`FromStr`](std::str::FromStr) reads it back. [`Display`](fmt::Display)
    /// writes it too.
    pub const fn as_str(self) -> &'static str {
        match self {
            OutboxStatus::Pending => "pending",
            OutboxStatus::Dispatching => "dispatching",
            OutboxStatus::Completed => "completed",
            OutboxStatus::Failed => "failed",
            OutboxStatus::OutcomeUnknown => "outcome_unknown",
        }
    }
}

impl fmt::Display for OutboxStatus {
    /// The status's name ([`OutboxStatus::as_str`]); padding and alignment
    /// apply (`{:<15}`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// Reads a status's name, exactly as [`OutboxStatus::as_str`] writes it
/// (lowercase, `outcome_unknown` with an underscore); anything else is a
/// [`ParseOutboxStatusError`].
///
/// ```
/// use idemstore::OutboxStatus;
///
/// assert_eq!("outcome_unknown".parse(), Ok(OutboxStatus::OutcomeUnknown));
/// assert!("Pending".parse::<OutboxStatus>().is_err());
/// ```
impl std::str::FromStr for OutboxStatus {
    type Err = ParseOutboxStatusError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        OutboxStatus::ALL
            .into_iter()
            .find(|status| status.as_str() == s)
            .ok_or_else(|| ParseOutboxStatusError { name: s.to_owned() })
    }
}

/// A name that is not an outbox status's: what parsing an
/// [`OutboxStatus`] from text returns for it.
///
/// Its message names the text and the five names accepted. Where a call
/// answers [`Error`], `?` turns it into [`Error::InvalidInput`] for the
/// field `status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseOutboxStatusError {
    name: String,
}

impl ParseOutboxStatusError {
    /// The text that was not a status's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl fmt::Display for ParseOutboxStatusError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown outbox status {:?}; expected one of ", self.name)?;
        for (i, status) in OutboxStatus::ALL.into_iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(status.as_str())?;
        }
        Ok(())
    }
}

impl std::error::Error for ParseOutboxStatusError {}

impl From<ParseOutboxStatusError> for crate::error::Error {
    fn from(e: ParseOutboxStatusError) -> Self {
        crate::error::Error::InvalidInput {
            field: "status",
            reason: e.to_string(),
        }
    }
}

/// An effect to enqueue: built with [`NewEntry::new`] and its setters
/// (the fields are readable, and set only through them, so that fields
/// added later get their defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NewEntry {
    /// The command (or business operation) the effect belongs to; entries
    /// are listed by it. 1–1024 bytes.
    pub command_id: String,
    /// Where the effect goes (a service, a topic). 1–1024 bytes.
    pub destination: String,
    /// Unique per destination: a second enqueue with the same
    /// `(destination, idempotency_key)` is a [`Enqueued::Duplicate`]. Send
    /// it with the effect so the receiver can deduplicate too. 1–1024 bytes.
    pub idempotency_key: String,
    /// The effect's body, up to the store's `max_body` (default 1 MiB).
    pub payload: Vec<u8>,
    /// Not due before this time (default: due at once).
    pub not_before: Option<DateTime<Utc>>,
    /// Entries of one destination that share an ordering key are delivered
    /// one at a time, in enqueue order (see [`NewEntry::ordering_key`]).
    /// 1–1024 bytes.
    pub ordering_key: Option<String>,
    /// Among a destination's due entries, higher first: `0..=`
    /// [`MAX_PRIORITY`](super::MAX_PRIORITY), default 0.
    pub priority: u8,
}

impl NewEntry {
    /// An entry due at once.
    pub fn new(
        command_id: impl Into<String>,
        destination: impl Into<String>,
        idempotency_key: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        NewEntry {
            command_id: command_id.into(),
            destination: destination.into(),
            idempotency_key: idempotency_key.into(),
            payload: payload.into(),
            not_before: None,
            ordering_key: None,
            priority: 0,
        }
    }

    /// Makes the entry due from `at` on (its `next_attempt_at`). Default:
    /// due at once.
    #[must_use]
    pub fn not_before(mut self, at: DateTime<Utc>) -> Self {
        self.not_before = Some(at);
        self
    }

    /// Orders the entry after every earlier entry of its destination with
    /// the same `key`: it is claimable only once each of them is
    /// `Completed` or `Failed`. An earlier one left `OutcomeUnknown` holds
    /// the sequence until it is resolved (completed, failed, cancelled or
    /// requeued). A `Failed` entry requeued joins the end of its sequence.
    /// Default: none, the entry waits for no other.
    #[must_use]
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Its priority, `0..=`[`MAX_PRIORITY`](super::MAX_PRIORITY): among a
    /// destination's due entries, higher first (then earliest due, then
    /// id). Default 0.
    #[must_use]
    pub fn priority(mut self, p: u8) -> Self {
        self.priority = p;
        self
    }
}

/// An outbox entry as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxEntry {
    /// Its id.
    pub id: OutboxId,
    /// As enqueued.
    pub command_id: String,
    /// As enqueued.
    pub destination: String,
    /// As enqueued.
    pub idempotency_key: String,
    /// As enqueued.
    pub payload: Vec<u8>,
    /// Where it is in its life.
    pub status: OutboxStatus,
    /// How many times it was claimed; the current claim's attempt number
    /// while `Dispatching`. Never decreases.
    pub attempt_count: u32,
    /// When it is (or was) due, if not at creation: `not_before`, a retry
    /// time, a reschedule. `None` once finished.
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// The `now` of its enqueue.
    pub created_at: DateTime<Utc>,
    /// When it was completed or finally failed; `None` otherwise.
    pub completed_at: Option<DateTime<Utc>>,
    /// As enqueued ([`NewEntry::ordering_key`]).
    pub ordering_key: Option<String>,
    /// As enqueued ([`NewEntry::priority`]).
    pub priority: u8,
}

impl OutboxEntry {
    /// The slot of the schedule that enqueued this entry, read from its
    /// key (`idemstore:schedule:<name>:<slot>`: see
    /// [`Outbox::set_schedule`](super::Outbox::set_schedule)); `None` for
    /// an entry of another key.
    #[must_use]
    pub fn slot(&self) -> Option<DateTime<Utc>> {
        super::schedule::slot_of_key(&self.idempotency_key)
    }
}

impl OutboxEntry {
    /// The fence of the entry's current attempt, to settle it with
    /// [`Outbox::settle`]. Take it from an entry [`Outbox::claim_due`]
    /// returned.
    pub fn fence(&self) -> Fence {
        Fence {
            id: self.id,
            attempt: self.attempt_count,
        }
    }

    /// When the entry is due if `Pending`: `next_attempt_at`, else
    /// `created_at`.
    pub fn due_at(&self) -> DateTime<Utc> {
        self.next_attempt_at.unwrap_or(self.created_at)
    }
}

/// Who claimed an attempt, and when: the claim of a `Dispatching` entry
/// ([`OutboxRecord::claim`]), or the attempt an `OutcomeUnknown` entry is
/// in doubt about ([`OutboxRecord::attempt_in_doubt`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxClaim {
    /// The `worker_id` given to [`Outbox::claim_due`].
    pub worker_id: String,
    /// The `now` of that claim.
    pub claimed_at: DateTime<Utc>,
}

/// How many attempt records an entry keeps ([`OutboxRecord::attempts`]):
/// the last 20. Older ones are dropped as new ones come.
pub const MAX_ATTEMPT_HISTORY: usize = 20;

/// The reason an entry [cancelled](Outbox::cancel) is `Failed` with (its
/// `last_failure`, and the reason of the attempt record the cancel adds).
pub const REASON_CANCELLED: &str = "cancelled";

/// The reason of the attempt record written when an attempt's outcome
/// becomes unknown ([`Settlement::OutcomeUnknown`]).
pub const REASON_OUTCOME_UNKNOWN: &str = "outcome_unknown";

/// The reason of the attempt record written when an attempt is given back
/// without a failure ([`Settlement::Rescheduled`]).
pub const REASON_RESCHEDULED: &str = "rescheduled";

/// The failure code of `reason`: a reason is a stable code, optionally
/// followed by a detail in parentheses (`http_500 (upstream timed out)`),
/// and the code is what `last_failure` keeps. A reason of another form is
/// its own code.
pub(super) fn failure_code(reason: &str) -> &str {
    match reason.strip_suffix(')').and_then(|r| r.split_once(" (")) {
        Some((code, _)) if !code.is_empty() => code,
        _ => reason,
    }
}

/// One attempt that did not complete the entry, as its history keeps it
/// ([`OutboxRecord::attempts`], oldest first, the last
/// [`MAX_ATTEMPT_HISTORY`]).
///
/// A record is added, at the `now` of the call, by:
/// - a failure, with or without a retry time ([`Settlement::Failed`],
///   [`Outbox::mark_failed`]): `reason` is the reason as given, detail
///   included (the dispatcher's `max_attempts (http_500)` keeps the last
///   attempt's own reason; `last_failure` keeps the code, `max_attempts`);
/// - a settlement that leaves the attempt's outcome unknown
///   ([`Settlement::OutcomeUnknown`] on a `Dispatching` entry):
///   [`REASON_OUTCOME_UNKNOWN`], with the remote reference it reported;
/// - a settlement that gives the attempt back ([`Settlement::Rescheduled`]):
///   [`REASON_RESCHEDULED`];
/// - a cancel ([`Outbox::cancel`]): [`REASON_CANCELLED`].
///
/// Storage calls never read the clock, so the operator calls that take no
/// time, [`Outbox::mark_outcome_unknown`] and [`Outbox::reschedule`], add
/// no record; nor does a claim released by
/// [`Outbox::release_expired_claims`], a completion or a requeue. A call
/// that changes nothing (a repeated final failure, a repeated cancel) adds
/// nothing either.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AttemptRecord {
    /// The entry's `attempt_count` when it was recorded: the attempt that
    /// failed, was given back or is in doubt (for a cancel or a failure
    /// marked on a `Pending` entry, the last attempt made; 0 if none was).
    pub attempt: u32,
    /// The `now` of the call that recorded it.
    pub at: DateTime<Utc>,
    /// Why the attempt did not complete the entry: the failure reason as
    /// given, or one of [`REASON_OUTCOME_UNKNOWN`], [`REASON_RESCHEDULED`],
    /// [`REASON_CANCELLED`].
    pub reason: String,
    /// For an attempt whose outcome is unknown: the remote system's
    /// reference it reported, if any. `None` otherwise.
    pub remote_ref: Option<String>,
}

/// An entry with its claim and settlement details.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxRecord {
    /// The entry.
    pub entry: OutboxEntry,
    /// The claim: present while `Dispatching`, `None` in every other status
    /// (only `Dispatching` holds a claim).
    pub claim: Option<OutboxClaim>,
    /// While `OutcomeUnknown`: who claimed the attempt whose outcome is
    /// unknown, and when (the worker whose logs to read, the time to ask
    /// the destination about). `None` in every other status; cleared when
    /// the entry is completed, failed, rescheduled or requeued.
    pub attempt_in_doubt: Option<OutboxClaim>,
    /// The code of the latest failure (its reason up to a detail in
    /// parentheses: `max_attempts` for `max_attempts (http_500)`), kept
    /// across retries; [`REASON_CANCELLED`] once cancelled.
    pub last_failure: Option<String>,
    /// The remote system's reference for the attempt, from
    /// `mark_outcome_unknown`, kept once set.
    pub remote_ref: Option<String>,
    /// The entry's attempts that did not complete it, oldest first: the
    /// last [`MAX_ATTEMPT_HISTORY`] (see [`AttemptRecord`] for what adds
    /// one). Empty for an entry that never failed, and for entries settled
    /// by builds that kept no history.
    pub attempts: Vec<AttemptRecord>,
}

/// What [`Outbox::settle_and_claim`] did: one result per settlement, in
/// order, and the claimed entries. A claim that fails fails the whole call,
/// which then wrote nothing (settlements included).
pub type SettledAndClaimed = (Vec<Result<()>>, Vec<OutboxEntry>);

/// The outcome of an enqueue.
///
/// A closed set: the entry is new or was enqueued before. Match it
/// exhaustively.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Enqueued {
    /// A new entry.
    New(OutboxId),
    /// `(destination, idempotency_key)` was already enqueued, as this id;
    /// nothing changed.
    Duplicate(OutboxId),
}

impl Enqueued {
    /// The entry's id, new or existing.
    pub fn id(&self) -> OutboxId {
        match *self {
            Enqueued::New(id) | Enqueued::Duplicate(id) => id,
        }
    }

    /// Whether the enqueue created the entry.
    pub fn is_new(&self) -> bool {
        matches!(self, Enqueued::New(_))
    }
}

/// One claimed attempt of one entry: the right to settle it.
///
/// Taken from a claimed entry with [`OutboxEntry::fence`]. It stays valid
/// while the entry is at this attempt and `Dispatching` or
/// `OutcomeUnknown`; after a release, a reschedule or a new claim it is
/// stale and [`Outbox::settle`] refuses it.
///
/// A value, not a record: the id and the attempt are the whole of it, and
/// a dispatcher that keeps them elsewhere may build it again from them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fence {
    /// The entry.
    pub id: OutboxId,
    /// The attempt number (`attempt_count` right after the claim).
    pub attempt: u32,
}

impl fmt::Display for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.id, self.attempt)
    }
}

/// How a dispatcher settles an attempt ([`Outbox::settle`]).
///
/// May gain variants (`#[non_exhaustive]`), as [`Delivery`](crate::Delivery)
/// may: a match on one needs a `_` arm.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settlement {
    /// The effect happened: `Completed`, `completed_at = now`.
    Completed,
    /// The attempt failed with `reason` (a stable code): retry at
    /// `next_attempt_at` (`Pending`), or give up (`Failed`,
    /// `completed_at = now`).
    Failed {
        /// A stable failure code, optionally followed by a detail in
        /// parentheses (`http_500 (upstream timed out)`): the code is
        /// stored as `last_failure`, the whole reason in the attempt's
        /// history. 1–1024 bytes.
        reason: String,
        /// When to try again; `None` gives up.
        next_attempt_at: Option<DateTime<Utc>>,
    },
    /// The effect may or may not have happened: `OutcomeUnknown`.
    OutcomeUnknown {
        /// The remote system's reference, if one came back. 1–1024 bytes.
        remote_ref: Option<String>,
    },
    /// Give the attempt back without a failure: `Pending`, due at
    /// `next_attempt_at` (for example, the destination asked to slow down).
    Rescheduled {
        /// When to try again.
        next_attempt_at: DateTime<Utc>,
    },
    /// The remote asked the whole destination to wait (a 429 or 503 with
    /// `Retry-After`): the attempt fails with `reason` and is retried at
    /// `next_attempt_at`, as [`Settlement::Failed`] with a retry time, and
    /// no entry of the destination is claimed before then. It does not
    /// count towards the circuit breaker.
    Throttled {
        /// As in [`Settlement::Failed`].
        reason: String,
        /// When to try again: the destination is held back until then.
        next_attempt_at: DateTime<Utc>,
    },
}

impl Settlement {
    /// Checks its fields, then turns it into the change it makes at `now`.
    pub(crate) fn into_change(self, now: DateTime<Utc>) -> Result<Change> {
        Ok(match self {
            Settlement::Completed => Change::Completed { now: micros(now) },
            Settlement::Failed {
                reason,
                next_attempt_at,
            } => {
                check_field("reason", &reason)?;
                Change::Failed {
                    reason,
                    next_attempt_at: next_attempt_at.map(micros),
                    now: micros(now),
                    hold: false,
                }
            }
            Settlement::Throttled {
                reason,
                next_attempt_at,
            } => {
                check_field("reason", &reason)?;
                Change::Failed {
                    reason,
                    next_attempt_at: Some(micros(next_attempt_at)),
                    now: micros(now),
                    hold: true,
                }
            }
            Settlement::OutcomeUnknown { remote_ref } => {
                if let Some(r) = &remote_ref {
                    check_field("remote_ref", r)?;
                }
                Change::OutcomeUnknown {
                    remote_ref,
                    now: Some(micros(now)),
                }
            }
            Settlement::Rescheduled { next_attempt_at } => Change::Rescheduled {
                next_attempt_at: micros(next_attempt_at),
                now: Some(micros(now)),
            },
        })
    }
}

/// Which entries [`Outbox::list`] returns: all of them by default; each
/// setter narrows the listing.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[must_use]
pub struct OutboxFilter {
    status: Option<OutboxStatus>,
    destination: Option<String>,
    after: Option<OutboxId>,
    newest_first: bool,
}

impl OutboxFilter {
    /// Every entry. Default: no status, destination or start restriction.
    pub fn any() -> Self {
        OutboxFilter::default()
    }

    /// Only entries in `status`. Default: any status.
    pub fn status(mut self, status: OutboxStatus) -> Self {
        self.status = Some(status);
        self
    }

    /// Only entries for `destination`. Default: any destination.
    pub fn destination(mut self, destination: impl Into<String>) -> Self {
        self.destination = Some(destination.into());
        self
    }

    /// Only entries that come after `id` in the listing's order, ids
    /// strictly above it (strictly below it, [newest
    /// first](OutboxFilter::newest_first)): the next page after a listing
    /// whose last entry was `id`. Default: from the first id (the last).
    pub fn after(mut self, id: OutboxId) -> Self {
        self.after = Some(id);
        self
    }

    /// Lists the newest entries first: ids from the highest down (an id
    /// is handed out at enqueue, so this is latest enqueued first).
    /// Default: oldest first.
    pub fn newest_first(mut self) -> Self {
        self.newest_first = true;
        self
    }

    /// Checks the filter's fields.
    pub(crate) fn check(&self) -> Result<()> {
        match &self.destination {
            Some(d) => check_field("destination", d),
            None => Ok(()),
        }
    }

    /// The ids the listing may return, `lo..=hi`; `None` when no id can
    /// follow [`OutboxFilter::after`].
    pub(crate) fn id_bounds(&self) -> Option<(u64, u64)> {
        match (self.after, self.newest_first) {
            (None, _) => Some((0, u64::MAX)),
            (Some(id), false) => Some((id.0.checked_add(1)?, u64::MAX)),
            (Some(id), true) => Some((0, id.0.checked_sub(1)?)),
        }
    }

    /// Whether the listing goes from the highest id down.
    pub(crate) fn is_newest_first(&self) -> bool {
        self.newest_first
    }

    /// The status listed, if the filter names one.
    pub(crate) fn status_filter(&self) -> Option<OutboxStatus> {
        self.status
    }

    /// The destination listed, if the filter names one.
    pub(crate) fn destination_filter(&self) -> Option<&str> {
        self.destination.as_deref()
    }

    /// Whether `row` is listed.
    pub(super) fn matches(&self, row: &Row) -> bool {
        self.status.is_none_or(|st| st == row.status)
            && self
                .destination
                .as_deref()
                .is_none_or(|d| d == row.destination)
    }
}

/// Number of entries in each status ([`Outbox::counts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub struct OutboxCounts {
    /// `Pending` entries (due or not).
    pub pending: u64,
    /// `Dispatching` entries.
    pub dispatching: u64,
    /// `Completed` entries not yet purged.
    pub completed: u64,
    /// `Failed` entries not yet purged.
    pub failed: u64,
    /// `OutcomeUnknown` entries.
    pub outcome_unknown: u64,
}

impl OutboxCounts {
    /// The count of one status.
    pub fn get(&self, status: OutboxStatus) -> u64 {
        match status {
            OutboxStatus::Pending => self.pending,
            OutboxStatus::Dispatching => self.dispatching,
            OutboxStatus::Completed => self.completed,
            OutboxStatus::Failed => self.failed,
            OutboxStatus::OutcomeUnknown => self.outcome_unknown,
        }
    }

    /// All entries.
    pub fn total(&self) -> u64 {
        OutboxStatus::ALL.iter().map(|s| self.get(*s)).sum()
    }

    /// The counts `count` gives for each status.
    pub(crate) fn from_fn(count: impl Fn(OutboxStatus) -> u64) -> Self {
        OutboxCounts {
            pending: count(OutboxStatus::Pending),
            dispatching: count(OutboxStatus::Dispatching),
            completed: count(OutboxStatus::Completed),
            failed: count(OutboxStatus::Failed),
            outcome_unknown: count(OutboxStatus::OutcomeUnknown),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_reads_back_from_its_name() {
        for status in OutboxStatus::ALL {
            assert_eq!(status.as_str().parse::<OutboxStatus>(), Ok(status));
            assert_eq!(status.to_string(), status.as_str());
        }
        assert_eq!(format!("{:>9}|", OutboxStatus::Failed), "   failed|");
        let names: Vec<&str> = OutboxStatus::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(
            names,
            [
                "pending",
                "dispatching",
                "completed",
                "failed",
                "outcome_unknown"
            ]
        );
    }

    #[test]
    fn a_name_that_is_not_a_status_is_refused_with_its_text() {
        for bad in [
            "",
            "Pending",
            "PENDING",
            " pending",
            "outcome-unknown",
            "OutcomeUnknown",
            "unknown",
        ] {
            let e = bad.parse::<OutboxStatus>().unwrap_err();
            assert_eq!(e.name(), bad);
            let shown = e.to_string();
            assert!(
                shown.contains(&format!("{bad:?}")) && shown.contains("outcome_unknown"),
                "{shown}"
            );
            let e = crate::error::Error::from(e);
            assert!(
                matches!(&e, crate::error::Error::InvalidInput { field: "status", reason }
                    if reason.contains("expected one of pending, dispatching")),
                "{e:?}"
            );
        }
    }

    #[test]
    fn the_parse_error_can_cross_threads() {
        fn check<T: Send + Sync + 'static>() {}
        check::<ParseOutboxStatusError>();
    }
}
