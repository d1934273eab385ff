//! An operator's change to every entry a filter matches (retry, cancel),
//! in bounded steps: each step visits at most a given number of matching
//! entries and changes them in one commit, so that a change to 100,000
//! entries never holds the writer (and the dispatchers' claims behind it)
//! for longer than one step.

use chrono::{DateTime, Utc};
use redb::WriteTransaction;

use super::index::Tables;
use super::inspect::Listing;
use super::rules::Change;
use super::{Outbox, OutboxFilter, OutboxId, ops};
use crate::codec::micros;
use crate::error::{Error, Result};
use crate::schema::{OUTBOX, OUTBOX_CLAIMED, OUTBOX_FLOWS, OUTBOX_STATE, open_write};

/// What one step of an operator's change to the entries a filter matches
/// did ([`Outbox::requeue_matching`], [`Outbox::cancel_matching`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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

impl Outbox {
    /// One step of "retry every entry `filter` matches": visits up to
    /// `limit` matching entries from the filter's start, by id, and moves
    /// each `Failed` or `OutcomeUnknown` one back to `Pending`, due at
    /// `next_attempt_at`, as [`requeue`](Outbox::requeue) does; entries in
    /// another status are [skipped](MatchingStep::skipped). The step is
    /// one commit: all of it or, on an `Err`, none of it. Call again with
    /// [`OutboxFilter::after`] the step's [`last`](MatchingStep::last)
    /// until it is `None`; steps that ran before an `Err` or a crash stay
    /// done. A filter with a status reads that status's entries only
    /// (see [`list`](Outbox::list)).
    pub fn requeue_matching(
        &self,
        filter: &OutboxFilter,
        next_attempt_at: DateTime<Utc>,
        limit: usize,
    ) -> Result<MatchingStep> {
        let change = Change::Requeued {
            next_attempt_at: micros(next_attempt_at),
        };
        self.change_matching(filter, change, limit)
    }

    /// One step of "cancel every entry `filter` matches", as
    /// [`requeue_matching`](Outbox::requeue_matching) is of a retry: each
    /// `Pending` or `OutcomeUnknown` entry visited becomes `Failed` with
    /// reason [`REASON_CANCELLED`](crate::REASON_CANCELLED), as
    /// [`cancel`](Outbox::cancel) does; others are skipped.
    pub fn cancel_matching(
        &self,
        filter: &OutboxFilter,
        now: DateTime<Utc>,
        limit: usize,
    ) -> Result<MatchingStep> {
        self.change_matching(filter, Change::Cancelled { now: micros(now) }, limit)
    }

    fn change_matching(
        &self,
        filter: &OutboxFilter,
        change: Change,
        limit: usize,
    ) -> Result<MatchingStep> {
        filter.check()?;
        let filter = filter.clone();
        let wake = change.makes_work_due();
        let (step, sooner) = self
            .engine
            .execute(move |tx| change_step(tx, &filter, &change, limit))?;
        if step.changed > 0 && (wake || sooner) {
            self.notify();
        }
        Ok(step)
    }
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
