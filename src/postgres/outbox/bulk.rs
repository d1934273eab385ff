//! An operator's change to every entry a filter matches, on
//! [`PgOutbox`]: the embedded store's steps (`outbox/bulk.rs`), each step
//! one transaction that reads the matching ids, locks those rows and
//! applies the change to each through the status machine.

use tokio_postgres::GenericClient;

use super::PgOutbox;
use super::flows::Touched;
use super::inspect::{db_bounds, order, status_condition};
use crate::error::{Error, Result};
use crate::outbox::rules::{Change, plan};
use crate::outbox::{MatchingChange, MatchingStep, OutboxFilter, OutboxId};
use crate::postgres::blocking::wait;
use crate::postgres::conn::{Db, Mode, in_transaction};
use crate::postgres::{refuse_reentrant, run};

impl PgOutbox {
    /// One step of an operator's `change` to every entry `filter`
    /// matches, as the embedded store's
    /// [`Outbox::change_matching`](crate::Outbox::change_matching): one
    /// transaction over up to `limit` matching entries, in the filter's
    /// order.
    pub fn change_matching(
        &self,
        filter: &OutboxFilter,
        change: &MatchingChange,
        limit: usize,
    ) -> Result<MatchingStep> {
        wait(self.change_matching_async(filter, change, limit))
    }

    /// [`PgOutbox::change_matching`], awaited. Dropped once its `COMMIT`
    /// was sent, the step may have committed.
    pub async fn change_matching_async(
        &self,
        filter: &OutboxFilter,
        change: &MatchingChange,
        limit: usize,
    ) -> Result<MatchingStep> {
        self.change_step(filter, &change.change()?, limit).await
    }

    async fn change_step(
        &self,
        filter: &OutboxFilter,
        change: &Change,
        limit: usize,
    ) -> Result<MatchingStep> {
        refuse_reentrant()?;
        filter.check()?;
        let (Some((lo, hi)), Ok(limit)) = (db_bounds(filter), i64::try_from(limit)) else {
            return Ok(MatchingStep::default());
        };
        let destination = filter.destination_filter().map(str::as_bytes);
        let s = self.s().to_owned();
        let sql = format!(
            "SELECT id FROM {s}.outbox WHERE id BETWEEN $1 AND $4 AND {} \
             AND ($2::bytea IS NULL OR destination = $2) ORDER BY id {} LIMIT $3",
            status_condition("", filter),
            order(filter)
        );
        let params = (lo, destination, limit, hi);
        let (step, sooner) = run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |db| {
                self.change_rows(db, &sql, params, filter, change).await
            })
        })?;
        self.depth.after_write(self).await;
        if step.changed > 0 && (change.makes_work_due() || sooner) {
            self.notify();
        }
        Ok(step)
    }

    /// One step of [`PgOutbox::change_step`] in `db`'s transaction: reads
    /// the matching ids with `sql` and its parameters `(lo, destination,
    /// limit, hi)`, locks their rows and applies `change` to each that
    /// still matches; the step, and whether a destination may have become
    /// claimable sooner.
    async fn change_rows(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        sql: &str,
        (lo, destination, limit, hi): (i64, Option<&[u8]>, i64, i64),
        filter: &OutboxFilter,
        change: &Change,
    ) -> Result<(MatchingStep, bool)> {
        let mut step = MatchingStep::default();
        let ids: Vec<i64> = db
            .query(sql, &[&lo, &destination, &limit, &hi])
            .await?
            .iter()
            .map(|r| r.try_get(0))
            .collect::<std::result::Result<_, _>>()?;
        let rows = self.lock(db, &ids).await?;
        let mut touched = Touched::default();
        for id in ids.iter().filter_map(|&id| u64::try_from(id).ok()) {
            step.last = Some(OutboxId(id));
            // Gone since the read (purged): nothing to change.
            let Some(old) = rows.get(&id) else {
                step.skipped += 1;
                continue;
            };
            // Changed since the read: the filter no longer matches.
            if filter.status_filter().is_some_and(|st| st != old.status) {
                step.skipped += 1;
                continue;
            }
            match plan(id, old, change, None) {
                Ok(Some(_)) => {
                    self.apply(db, id, old, change, None, &mut touched).await?;
                    step.changed += 1;
                }
                Ok(None) | Err(Error::Conflict { .. }) => step.skipped += 1,
                Err(e) => return Err(e),
            }
        }
        let sooner = self.settle_flows(db, &touched).await?;
        Ok((step, sooner))
    }
}
