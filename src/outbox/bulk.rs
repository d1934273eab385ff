//! An operator's change to every entry a filter matches (retry, cancel,
//! release, resolve),
//! in bounded steps: each step visits at most a given number of matching
//! entries and changes them in one commit, so that a change to 100,000
//! entries never holds the writer (and the dispatchers' claims behind it)
//! for longer than one step.

use chrono::{DateTime, Utc};
use redb::WriteTransaction;

use super::index::Tables;
use super::inspect::Listing;
use super::rules::{Change, mark_failed_change};
use super::{Outbox, OutboxFilter, OutboxId, ops};
use crate::codec::micros;
use crate::error::{Error, Result};
use crate::schema::{OUTBOX, OUTBOX_CLAIMED, OUTBOX_FLOWS, OUTBOX_STATE, open_write};

/// What one step of an operator's change to the entries a filter matches
/// did ([`Outbox::change_matching`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct MatchingStep {
    /// The entries changed.
    pub changed: u64,
    /// The entries the filter matched that the change does not apply to
    /// (a cancel of a `Failed` entry, say), left as they were.
    pub skipped: u64,
    /// The last entry the step visited: the next step starts after it
    /// ([`OutboxFilter::after`]). `None` once no matching entry is left
    /// to visit.
    pub last: Option<OutboxId>,
}

/// An operator's change to every entry a filter matches
/// ([`Outbox::change_matching`]): each is the operator call of the same
/// meaning, applied to each entry visited.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MatchingChange {
    /// A `Failed` or `OutcomeUnknown` entry back to `Pending`, due at
    /// `next_attempt_at` ([`Outbox::requeue`]).
    Retry {
        /// When the entry is due again.
        next_attempt_at: DateTime<Utc>,
    },
    /// A `Pending` or `OutcomeUnknown` entry to `Failed`, reason
    /// [`REASON_CANCELLED`](crate::REASON_CANCELLED) ([`Outbox::cancel`]).
    Cancel {
        /// When it was cancelled.
        now: DateTime<Utc>,
    },
    /// A claim released: a `Dispatching` (or `Pending`, `OutcomeUnknown`)
    /// entry back to `Pending`, due at `next_attempt_at`; its worker's
    /// settlement is then refused as stale ([`Outbox::reschedule`]).
    Release {
        /// When the entry is due again.
        next_attempt_at: DateTime<Utc>,
    },
    /// The entry marked `Completed`: an in-doubt send that happened
    /// ([`Outbox::mark_completed`]).
    Complete {
        /// When it was resolved.
        now: DateTime<Utc>,
    },
    /// The entry marked `Failed` with `reason`, not retried: an in-doubt
    /// send that did not happen ([`Outbox::mark_failed`]).
    Fail {
        /// The reason code recorded (1–1024 bytes).
        reason: String,
        /// When it was resolved.
        now: DateTime<Utc>,
    },
}

impl MatchingChange {
    /// The status machine's change; a bad reason is
    /// [`Error::InvalidInput`].
    pub(crate) fn change(&self) -> Result<Change> {
        Ok(match self {
            MatchingChange::Retry { next_attempt_at } => Change::Requeued {
                next_attempt_at: micros(*next_attempt_at),
            },
            MatchingChange::Cancel { now } => Change::Cancelled { now: micros(*now) },
            MatchingChange::Release { next_attempt_at } => Change::Rescheduled {
                next_attempt_at: micros(*next_attempt_at),
                now: None,
            },
            MatchingChange::Complete { now } => Change::Completed { now: micros(*now) },
            MatchingChange::Fail { reason, now } => mark_failed_change(reason, None, *now)?,
        })
    }
}

impl Outbox {
    /// One step of an operator's `change` to every entry `filter`
    /// matches: visits up to `limit` matching entries from the filter's
    /// start, in its order, and applies the change to each (entries in a
    /// status it does not apply to are [skipped](MatchingStep::skipped)).
    /// The step is one commit: all of it or, on an `Err`, none of it. Call
    /// again with [`OutboxFilter::after`] the step's
    /// [`last`](MatchingStep::last) until it is `None`; steps that ran
    /// before an `Err` or a crash stay done. A filter with a status reads
    /// that status's entries only (see [`list`](Outbox::list)), so each
    /// step costs what it changes.
    ///
    /// ```
    /// # fn main() -> idemstore::Result<()> {
    /// use chrono::Utc;
    /// use idemstore::{MatchingChange, OutboxFilter, OutboxStatus, Store};
    ///
    /// let store = Store::in_memory()?;
    /// let outbox = store.outbox();
    /// // Retry every failed entry of "payments", 256 per commit.
    /// let filter = OutboxFilter::any()
    ///     .status(OutboxStatus::Failed)
    ///     .destination("payments");
    /// let retry = MatchingChange::Retry { next_attempt_at: Utc::now() };
    /// let mut from = filter.clone();
    /// while let Some(last) = outbox.change_matching(&from, &retry, 256)?.last {
    ///     from = filter.clone().after(last);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn change_matching(
        &self,
        filter: &OutboxFilter,
        change: &MatchingChange,
        limit: usize,
    ) -> Result<MatchingStep> {
        let (op, wake) = change_matching_op(filter, change, limit)?;
        let (step, sooner) = self.engine.execute(op)?;
        Ok(self.matched(step, wake || sooner))
    }

    /// What a step of `change_matching` answers, once it committed: the
    /// dispatchers woken if it changed an entry and `wake`.
    pub(super) fn matched(&self, step: MatchingStep, wake: bool) -> MatchingStep {
        if step.changed > 0 && wake {
            self.notify();
        }
        step
    }
}

/// `change_matching`'s checks, its operation (one step) and whether the
/// change may make work due.
#[expect(clippy::type_complexity, reason = "an operation and a flag")]
pub(super) fn change_matching_op(
    filter: &OutboxFilter,
    change: &MatchingChange,
    limit: usize,
) -> Result<(
    impl Fn(&WriteTransaction) -> Result<(MatchingStep, bool)> + Send + 'static,
    bool,
)> {
    filter.check()?;
    let change = change.change()?;
    let filter = filter.clone();
    let wake = change.makes_work_due();
    Ok((
        move |tx: &WriteTransaction| change_step(tx, &filter, &change, limit),
        wake,
    ))
}

/// One step of `change` to the entries `filter` matches, in `tx`; and
/// whether a destination became claimable sooner.
fn change_step(
    tx: &WriteTransaction,
    filter: &OutboxFilter,
    change: &Change,
    limit: usize,
) -> Result<(MatchingStep, bool)> {
    let mut step = MatchingStep::default();
    let ids = matching_ids(tx, filter, limit)?;
    let mut t = Tables::open(tx)?;
    for id in ids {
        step.last = Some(OutboxId(id));
        match ops::apply(&mut t, id, change, None) {
            Ok((_, true)) => step.changed += 1,
            Ok((_, false)) | Err(Error::Conflict { .. }) => step.skipped += 1,
            Err(e) => return Err(e),
        }
    }
    let sooner = t.finish()?;
    Ok((step, sooner))
}

/// The ids of up to `limit` entries that `filter` matches, in its order.
/// (Opens, in `tx`, tables [`Tables::open`] opens again: they are closed
/// on return.)
fn matching_ids(tx: &WriteTransaction, filter: &OutboxFilter, limit: usize) -> Result<Vec<u64>> {
    let rows = open_write(tx, OUTBOX)?;
    let states = open_write(tx, OUTBOX_STATE)?;
    let small = open_write(tx, OUTBOX_FLOWS)?;
    let claimed = open_write(tx, OUTBOX_CLAIMED)?;
    let listing = Listing {
        rows: &rows,
        states: Some(&states),
        small: Some(&small),
        claimed: Some(&claimed),
    };
    Ok(listing
        .matching(filter, limit)?
        .into_iter()
        .map(|(id, _)| id)
        .collect())
}
