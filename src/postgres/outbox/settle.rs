//! How [`PgOutbox`] changes an entry's status: a dispatcher's settlements
//! (one, or a batch with the next claim) and the operator's calls. A
//! completion that applies as the row stands is one `UPDATE` (the fast
//! path); every other change reads the row `FOR UPDATE`, asks the status
//! machine (`outbox::rules`), and writes what it says, with the attempt
//! record it calls for, in the same transaction (see the table in the
//! parent module's docs).

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use super::flows::{FlowEvent, Touched};
use super::{COLS, PgOutbox, TABLE, db_id, history, read_row, status_name};
use crate::codec::micros;
use crate::error::{Error, Result};
use crate::outbox::destinations::sequenced;
use crate::outbox::rules::{
    Change, FencedChange, Row, mark_failed_change, mark_outcome_unknown_change, plan,
    plan_settle_and_claim, plan_settlements,
};
use crate::outbox::{ClaimRequest, OutboxEntry};
use crate::outbox::{Fence, OutboxId, OutboxStatus, SettledAndClaimed, Settlement};
use crate::postgres::blocking::wait;
use crate::postgres::conn::{Db, Mode, in_transaction};
use crate::postgres::errors::unsigned;
use crate::postgres::{Transaction, refuse_reentrant, run};

/// The condition (on the row `o`) under which completing an entry changes
/// nothing but the row: it has no ordering key (no sequence to move on),
/// and its destination's flow, told of a success, stays as it is and frees
/// no capped slot (no circuit to close, not its probe, no cap). Every other
/// completion takes the general path, which tells the destination.
fn flow_neutral(s: &str) -> String {
    format!(
        "o.ordering_key IS NULL AND NOT EXISTS (SELECT 1 FROM {s}.destinations d \
         WHERE d.destination = o.destination AND (d.failures <> 0 OR d.trips <> 0 \
         OR d.open_until IS NOT NULL OR d.probe = o.id OR d.max_in_flight IS NOT NULL))"
    )
}

impl PgOutbox {
    /// Completes entry `id` at `now` in one statement if the status table
    /// allows it as it stands (`Dispatching` or `OutcomeUnknown`, at
    /// attempt `fence` if given); `false` if the statement changed nothing.
    async fn complete_fast(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        id: i64,
        fence: Option<u32>,
        now: i64,
    ) -> Result<bool> {
        let s = self.s();
        let sql = format!(
            "UPDATE {s}.outbox o SET status = 'completed', completed_at = $3, \
             next_attempt_at = NULL, worker_id = NULL, claimed_at = NULL \
             WHERE o.id = $1 AND ($2::bigint IS NULL OR o.attempt_count = $2) \
             AND o.status IN ('dispatching', 'outcome_unknown') AND {}",
            flow_neutral(s)
        );
        let fence = fence.map(i64::from);
        Ok(db.execute(&sql, &[&id, &fence, &now]).await? == 1)
    }

    /// Applies `change` to entry `id` (fenced by `fence` if given) in
    /// `tx`: a completion in one statement when it applies as it stands,
    /// anything else through the status machine on the locked row.
    async fn change_in(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        id: OutboxId,
        change: &Change,
        fence: Option<u32>,
    ) -> Result<()> {
        let Some(id) = db_id(id) else {
            return Err(Error::NotFound);
        };
        if let Change::Completed { now } = change
            && self.complete_fast(db, id, fence, *now).await?
        {
            return Ok(());
        }
        let mut touched = Touched::default();
        self.change_locked(db, id, change, fence, &mut touched)
            .await?;
        self.settle_flows(db, &touched).await?;
        Ok(())
    }

    /// Applies `change` to entry `db` through the status machine on the
    /// locked row.
    async fn change_locked(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        id: i64,
        change: &Change,
        fence: Option<u32>,
        touched: &mut Touched,
    ) -> Result<()> {
        let rows = self.lock(db, &[id]).await?;
        let (id, old) = rows.iter().next().ok_or(Error::NotFound)?;
        self.apply(db, *id, old, change, fence, touched).await?;
        Ok(())
    }

    /// The entries `ids`, read and locked (`FOR UPDATE`) in id order.
    pub(super) async fn lock(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        ids: &[i64],
    ) -> Result<HashMap<u64, Row>> {
        let s = self.s();
        let rows = db
            .query(
                &format!("SELECT {COLS} FROM {s}.outbox WHERE id = ANY($1) ORDER BY id FOR UPDATE"),
                &[&ids],
            )
            .await?;
        rows.iter().map(read_row).collect()
    }

    /// Plans `change` on `old` (entry `id`, locked) with the status
    /// machine and writes the plan: the new row, its place in its ordering
    /// sequence (none once finished, a fresh one at the end when a finished
    /// entry comes back), the attempt record it adds, and the next entry of
    /// its sequence made claimable when it leaves. Notes in `touched` what
    /// it tells its destination. Returns the row as it stands afterwards.
    pub(super) async fn apply(
        &self,
        tx: &mut Db<'_, impl GenericClient + Sync>,
        id: u64,
        old: &Row,
        change: &Change,
        fence: Option<u32>,
        touched: &mut Touched,
    ) -> Result<Row> {
        let Some(new) = plan(id, old, change, fence)? else {
            return Ok(old.clone());
        };
        let attempt = change.attempt_row(old, old.status);
        let s = self.s().to_owned();
        let db = db_id(OutboxId(id)).ok_or(Error::NotFound)?;
        let (new, waiting, leaves) = self.place_in_sequence(tx, id, old, new).await?;
        let status = status_name(new.status);
        let (worker, claimed_at) = match &new.attempt {
            Some((w, at)) => (Some(w.as_bytes()), Some(*at)),
            None => (None, None),
        };
        let seq = new.seq.map(|n| i64::try_from(n).unwrap_or(i64::MAX));
        let params: [&(dyn ToSql + Sync); 11] = [
            &db,
            &status,
            &i64::from(new.attempt_count),
            &new.next_attempt_at,
            &new.completed_at,
            &worker,
            &claimed_at,
            &new.last_failure.as_deref().map(str::as_bytes),
            &new.remote_ref.as_deref().map(str::as_bytes),
            &seq,
            &waiting,
        ];
        tx.execute(
            &format!(
                "UPDATE {s}.outbox SET status = $2, attempt_count = $3, next_attempt_at = $4, \
                 completed_at = $5, worker_id = $6, claimed_at = $7, last_failure = $8, \
                 remote_ref = $9, seq = $10, waiting = coalesce($11, waiting) WHERE id = $1"
            ),
            &params,
        )
        .await?;
        if let Some(a) = attempt {
            // The next record after the entry's last, and the oldest ones
            // beyond the last 20 dropped: one statement, under the row lock.
            let params: [&(dyn ToSql + Sync); 6] = [
                &db,
                &i64::from(a.attempt),
                &a.at,
                &a.reason.as_bytes(),
                &a.remote_ref.as_deref().map(str::as_bytes),
                &history(),
            ];
            tx.execute(
                &format!(
                    "WITH next AS ( \
                         SELECT coalesce(max(seq) + 1, 0) AS seq \
                         FROM {s}.outbox_attempts WHERE id = $1 \
                     ), added AS ( \
                         INSERT INTO {s}.outbox_attempts (id, seq, attempt, at, reason, remote_ref) \
                         SELECT $1, seq, $2, $3, $4, $5 FROM next RETURNING seq \
                     ) \
                     DELETE FROM {s}.outbox_attempts \
                     WHERE id = $1 AND seq <= (SELECT seq FROM added) - $6"
                ),
                &params,
            )
            .await?;
        }
        if leaves {
            touched.promoted |= self.promote_next(tx, old).await?;
        }
        if old.status == OutboxStatus::Dispatching {
            touched.events.push((
                old.destination.clone(),
                FlowEvent::Settled {
                    id,
                    signal: change.signal(old.status),
                    at: change.time(),
                },
            ));
        }
        if let Some(until) = change.hold() {
            touched
                .events
                .push((old.destination.clone(), FlowEvent::Hold(until)));
        }
        Ok(new)
    }

    /// `new` (entry `id`, changed from `old`) with its place in its
    /// ordering sequence, under the sequence's lock when it joins or leaves
    /// it: none once finished, a fresh one at the end when a finished entry
    /// comes back (then it waits if another entry of the sequence is
    /// unfinished). Returns it, what its `waiting` flag becomes (`None`:
    /// unchanged) and whether it left its sequence.
    async fn place_in_sequence(
        &self,
        tx: &mut Db<'_, impl GenericClient + Sync>,
        id: u64,
        old: &Row,
        new: Row,
    ) -> Result<(Row, Option<bool>, bool)> {
        let s = self.s().to_owned();
        let in_seq = |r: &Row| r.ordering_key.is_some() && !r.status.is_finished();
        let (leaves, joins) = (in_seq(old) && !in_seq(&new), !in_seq(old) && in_seq(&new));
        if (leaves || joins)
            && let Some(key) = &old.ordering_key
        {
            self.lock_sequence(tx, &old.destination, key).await?;
        }
        // The rules ask for a fresh place by calling back, which cannot
        // await: they are given a placeholder, and the place they asked for
        // is taken from the server afterwards.
        let mut fresh = false;
        let mut new = sequenced(old, new, || {
            fresh = true;
            Ok(0)
        })?;
        if fresh {
            let n: i64 = tx
                .query_one(
                    &format!("SELECT nextval(pg_get_serial_sequence('{s}.outbox', 'id'))"),
                    &[],
                )
                .await?
                .try_get(0)?;
            new.seq = Some(unsigned(TABLE, &id, "seq", n)?);
        }
        let waiting = if joins {
            let db = db_id(OutboxId(id)).ok_or(Error::NotFound)?;
            let r = tx
                .query_one(
                    &format!(
                        "SELECT EXISTS (SELECT 1 FROM {s}.outbox WHERE destination = $1 \
                         AND ordering_key = $2 AND seq IS NOT NULL AND id <> $3)"
                    ),
                    &[
                        &new.destination.as_bytes(),
                        &new.ordering_key.as_deref().map(str::as_bytes),
                        &db,
                    ],
                )
                .await?;
            Some(r.try_get::<_, bool>(0)?)
        } else if leaves {
            Some(false)
        } else {
            None
        };
        Ok((new, waiting, leaves))
    }

    /// Makes the first entry left in `old`'s sequence claimable (`old` just
    /// left it, under the sequence's lock); whether one was, `Pending`.
    async fn promote_next(
        &self,
        tx: &mut Db<'_, impl GenericClient + Sync>,
        old: &Row,
    ) -> Result<bool> {
        let s = self.s();
        let promoted = tx
            .query_opt(
                &format!(
                    "UPDATE {s}.outbox SET waiting = false WHERE id = ( \
                         SELECT id FROM {s}.outbox WHERE destination = $1 \
                         AND ordering_key = $2 AND seq IS NOT NULL ORDER BY seq LIMIT 1) \
                     AND waiting RETURNING status"
                ),
                &[
                    &old.destination.as_bytes(),
                    &old.ordering_key.as_deref().map(str::as_bytes),
                ],
            )
            .await?;
        Ok(match promoted {
            Some(r) => r.try_get::<_, &str>(0)? == status_name(OutboxStatus::Pending),
            None => false,
        })
    }

    /// Applies `change` to `id` in its own transaction, waking this
    /// process's subscribers if it may have made work due.
    async fn change(&self, id: OutboxId, change: &Change, fence: Option<u32>) -> Result<()> {
        refuse_reentrant()?;
        let id = db_id(id).ok_or(Error::NotFound)?;
        // A completion lost in flight may be run again: a second
        // completion of the same attempt is accepted without change.
        let (done, sooner) = run!(self.server, Mode::Tx, |conn| {
            if let Change::Completed { now } = change
                && self.complete_fast(&mut conn.db(), id, fence, *now).await?
            {
                return Ok((true, false));
            }
            let sooner = in_transaction!(conn, |db| {
                self.change_settled(db, id, change, fence).await
            })?;
            Ok((false, sooner))
        })?;
        self.depth.after_write(self).await;
        if done {
            return Ok(());
        }
        if change.makes_work_due() || sooner {
            self.notify();
        }
        Ok(())
    }

    /// [`PgOutbox::change_locked`] and what it tells the destinations, in
    /// `db`'s transaction: whether one may have become claimable sooner.
    async fn change_settled(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        id: i64,
        change: &Change,
        fence: Option<u32>,
    ) -> Result<bool> {
        let mut touched = Touched::default();
        self.change_locked(db, id, change, fence, &mut touched)
            .await?;
        self.settle_flows(db, &touched).await
    }

    /// Settles the attempt `fence` (from [`OutboxEntry::fence`](crate::OutboxEntry::fence)) as
    /// `settlement`, at `now`.
    ///
    /// [`Error::Conflict`], changing nothing, if the fence is stale (the
    /// entry moved on to another attempt, or was released, rescheduled or
    /// settled otherwise) or the settlement is not allowed from the entry's
    /// status. Settling the same attempt again the same final way
    /// (completed twice, failed without retry twice) is accepted and changes
    /// nothing. [`Error::NotFound`] if the entry is gone.
    pub fn settle(&self, fence: Fence, settlement: Settlement, now: DateTime<Utc>) -> Result<()> {
        wait(self.settle_async(fence, settlement, now))
    }

    /// [`PgOutbox::settle`], awaited. Dropped once its `COMMIT` was sent,
    /// the settlement may have been applied.
    pub async fn settle_async(
        &self,
        fence: Fence,
        settlement: Settlement,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let change = settlement.into_change(now)?;
        self.change(fence.id, &change, Some(fence.attempt)).await
    }

    /// [`PgOutbox::settle`] inside the caller's own transaction (for a
    /// dispatcher that records the effect's result in its own tables in the
    /// same commit). A retry or a reschedule wakes the dispatchers once the
    /// caller's transaction has committed. A settlement that changes its
    /// destination's flow (a circuit, a probe, a cap, a hold) or moves an
    /// ordering sequence on holds that destination's row (or the
    /// sequence's lock) until the caller's transaction ends: claims leave
    /// the destination alone meanwhile, so keep such transactions short.
    pub fn settle_in(
        &self,
        tx: &mut Transaction<'_>,
        fence: Fence,
        settlement: &Settlement,
        now: DateTime<Utc>,
    ) -> Result<()> {
        wait(self.settle_in_async(tx.as_async(), fence, settlement, now))
    }

    /// [`PgOutbox::settle_in`], awaited, in a transaction of the async
    /// client (a [`PgStore::write_async`](crate::postgres::PgStore::write_async)
    /// closure's, or your own).
    pub async fn settle_in_async(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        fence: Fence,
        settlement: &Settlement,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let change = settlement.clone().into_change(now)?;
        self.change_in(
            &mut Db::uncached(tx),
            fence.id,
            &change,
            Some(fence.attempt),
        )
        .await
    }

    /// Applies `changes` in order in `tx`, each accepted or refused on its
    /// own; the rows are locked first, in id order.
    async fn settle_many_in(
        &self,
        tx: &mut Db<'_, impl GenericClient + Sync>,
        changes: &[FencedChange],
    ) -> Result<(Vec<Result<()>>, bool)> {
        let mut touched = Touched::default();
        let out = self.settle_many_rows(tx, changes, &mut touched).await?;
        let sooner = self.settle_flows(tx, &touched).await?;
        Ok((out, sooner))
    }

    /// The entry changes of [`PgOutbox::settle_many_in`], noting in
    /// `touched` what they tell their destinations.
    async fn settle_many_rows(
        &self,
        tx: &mut Db<'_, impl GenericClient + Sync>,
        changes: &[FencedChange],
        touched: &mut Touched,
    ) -> Result<Vec<Result<()>>> {
        let done = self.complete_many_fast(tx, changes).await?;
        let ids: Vec<i64> = changes
            .iter()
            .filter(|(id, ..)| !done.contains(id))
            .filter_map(|(id, ..)| db_id(OutboxId(*id)))
            .collect();
        let mut rows = if ids.is_empty() {
            HashMap::new()
        } else {
            self.lock(tx, &ids).await?
        };
        let mut out = Vec::with_capacity(changes.len());
        for (id, attempt, change) in changes {
            if done.contains(id) {
                out.push(Ok(()));
                continue;
            }
            let Some(old) = rows.get(id) else {
                out.push(Err(Error::NotFound));
                continue;
            };
            match self
                .apply(tx, *id, old, change, Some(*attempt), touched)
                .await
            {
                Ok(new) => {
                    rows.insert(*id, new);
                    out.push(Ok(()));
                }
                Err(e @ Error::Conflict { .. }) => out.push(Err(e)),
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// The completions among `changes` that apply as the rows stand, in one
    /// statement (a dispatcher's batch is mostly these): the ids completed.
    /// Only when every id in `changes` is distinct, so that no settlement
    /// has to see an earlier one of the same entry; the rest take the
    /// general path.
    async fn complete_many_fast(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        changes: &[FencedChange],
    ) -> Result<HashSet<u64>> {
        let mut seen = HashSet::with_capacity(changes.len());
        if !changes.iter().all(|(id, ..)| seen.insert(*id)) {
            return Ok(HashSet::new());
        }
        let (mut ids, mut fences, mut times) = (Vec::new(), Vec::new(), Vec::new());
        for (id, attempt, change) in changes {
            if let (Change::Completed { now }, Some(db_id)) = (change, db_id(OutboxId(*id))) {
                ids.push(db_id);
                fences.push(i64::from(*attempt));
                times.push(*now);
            }
        }
        if ids.len() < 2 {
            return Ok(HashSet::new());
        }
        let s = self.s();
        let rows = db
            .query(
                &format!(
                    "UPDATE {s}.outbox o SET status = 'completed', completed_at = f.at, \
                     next_attempt_at = NULL, worker_id = NULL, claimed_at = NULL \
                     FROM unnest($1::bigint[], $2::bigint[], $3::bigint[]) AS f(id, fence, at) \
                     WHERE o.id = f.id AND o.attempt_count = f.fence \
                     AND o.status IN ('dispatching', 'outcome_unknown') AND {} RETURNING o.id",
                    flow_neutral(s)
                ),
                &[&ids, &fences, &times],
            )
            .await?;
        rows.iter()
            .map(|r| unsigned(TABLE, &"?", "id", r.try_get(0)?))
            .collect()
    }

    /// Settles many attempts in one transaction (a dispatcher finishing a
    /// batch), in order; a later settlement sees the earlier ones.
    ///
    /// Each settlement is accepted or refused on its own, exactly as
    /// [`PgOutbox::settle`] would: the answer holds one result per input, in
    /// order, an `Err` there being [`Error::Conflict`] or
    /// [`Error::NotFound`]. The call itself fails on bad input and on the
    /// server's errors; a call that returns `Err` wrote nothing, unless the
    /// connection was lost once its `COMMIT` was sent: then every
    /// settlement may have been applied.
    pub fn settle_many(
        &self,
        settlements: impl IntoIterator<Item = (Fence, Settlement)>,
        now: DateTime<Utc>,
    ) -> Result<Vec<Result<()>>> {
        wait(self.settle_many_async(settlements, now))
    }

    /// [`PgOutbox::settle_many`], awaited. Dropped once its `COMMIT` was
    /// sent, every settlement may have been applied.
    pub async fn settle_many_async(
        &self,
        settlements: impl IntoIterator<Item = (Fence, Settlement)>,
        now: DateTime<Utc>,
    ) -> Result<Vec<Result<()>>> {
        let (changes, _) = plan_settlements(settlements, now)?;
        if changes.is_empty() {
            return Ok(Vec::new());
        }
        refuse_reentrant()?;
        let (out, sooner) = run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |db| self.settle_many_in(db, &changes).await)
        })?;
        self.notify_if_settled(&changes, &out, sooner);
        self.depth.after_write(self).await;
        Ok(out)
    }

    /// Settles a finished batch and claims the next one in one transaction:
    /// a dispatcher's step between two batches. The settlements behave
    /// exactly as in [`PgOutbox::settle_many`], the claim exactly as
    /// [`PgOutbox::claim_due`] and sees the settlements. All or nothing: a
    /// call that returns `Err` wrote nothing, settlements included, unless
    /// the connection was lost once its `COMMIT` was sent: then all of it
    /// may have committed, the claimed entries staying `Dispatching` until
    /// [`release_expired_claims`](Self::release_expired_claims) hands them
    /// back.
    pub fn settle_and_claim(
        &self,
        settlements: impl IntoIterator<Item = (Fence, Settlement)>,
        now: DateTime<Utc>,
        limit: usize,
        worker_id: &str,
    ) -> Result<SettledAndClaimed> {
        wait(self.settle_and_claim_async(settlements, now, limit, worker_id))
    }

    /// [`PgOutbox::settle_and_claim`], awaited. Dropped once its `COMMIT`
    /// was sent, all of it may have committed.
    pub async fn settle_and_claim_async(
        &self,
        settlements: impl IntoIterator<Item = (Fence, Settlement)>,
        now: DateTime<Utc>,
        limit: usize,
        worker_id: &str,
    ) -> Result<SettledAndClaimed> {
        self.settle_and_claim_with_async(settlements, now, &ClaimRequest::new(limit, worker_id))
            .await
    }

    /// [`PgOutbox::settle_and_claim`] with a claim that `request` shapes (as
    /// [`PgOutbox::claim`] takes it).
    pub fn settle_and_claim_with(
        &self,
        settlements: impl IntoIterator<Item = (Fence, Settlement)>,
        now: DateTime<Utc>,
        request: &ClaimRequest,
    ) -> Result<SettledAndClaimed> {
        wait(self.settle_and_claim_with_async(settlements, now, request))
    }

    /// [`PgOutbox::settle_and_claim_with`], awaited. Dropped once its
    /// `COMMIT` was sent, all of it may have committed.
    pub async fn settle_and_claim_with_async(
        &self,
        settlements: impl IntoIterator<Item = (Fence, Settlement)>,
        now: DateTime<Utc>,
        request: &ClaimRequest,
    ) -> Result<SettledAndClaimed> {
        request.check()?;
        let (changes, _) = plan_settle_and_claim(settlements, now, request.worker_id())?;
        refuse_reentrant()?;
        let now = micros(now);
        let (settled, claimed, sooner) = run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |db| {
                self.settle_and_claim_in(db, &changes, now, request).await
            })
        })?;
        self.notify_if_settled(&changes, &settled, sooner);
        self.depth.after_write(self).await;
        Ok((settled, claimed))
    }

    /// [`PgOutbox::settle_and_claim_with`] in `db`'s transaction: the
    /// settlements' results, the entries claimed, and whether a
    /// destination may have become claimable sooner.
    async fn settle_and_claim_in(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        changes: &[FencedChange],
        now: i64,
        request: &ClaimRequest,
    ) -> Result<(Vec<Result<()>>, Vec<OutboxEntry>, bool)> {
        let (settled, sooner) = if changes.is_empty() {
            (Vec::new(), false)
        } else {
            self.settle_many_in(db, changes).await?
        };
        let claimed = self.claim_in(db, now, request).await?;
        Ok((settled, claimed, sooner))
    }

    /// Wakes this process's subscribers after a bulk settle that may have
    /// made work due.
    fn notify_if_settled(&self, changes: &[FencedChange], settled: &[Result<()>], sooner: bool) {
        let wake = sooner
            || changes
                .iter()
                .zip(settled)
                .any(|((_, _, c), r)| r.is_ok() && c.makes_work_due());
        if wake {
            self.notify();
        }
    }

    /// Operator call: marks `id` `Completed` at `now`, unfenced. Allowed from
    /// `Dispatching` and `OutcomeUnknown`; accepted without change on
    /// `Completed`; otherwise [`Error::Conflict`].
    pub fn mark_completed(&self, id: OutboxId, now: DateTime<Utc>) -> Result<()> {
        wait(self.mark_completed_async(id, now))
    }

    /// [`PgOutbox::mark_completed`], awaited.
    pub async fn mark_completed_async(&self, id: OutboxId, now: DateTime<Utc>) -> Result<()> {
        self.change(id, &Change::Completed { now: micros(now) }, None)
            .await
    }

    /// Operator call, unfenced: records `reason` as `last_failure`, then with
    /// `retry_at` moves the entry to `Pending` due then (from `Pending`,
    /// `Dispatching`, `OutcomeUnknown`), without it to `Failed` stamped
    /// `completed_at = now` (from `Dispatching`, `OutcomeUnknown`; accepted
    /// without change on `Failed`). Otherwise [`Error::Conflict`].
    pub fn mark_failed(
        &self,
        id: OutboxId,
        reason: &str,
        retry_at: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Result<()> {
        wait(self.mark_failed_async(id, reason, retry_at, now))
    }

    /// [`PgOutbox::mark_failed`], awaited.
    pub async fn mark_failed_async(
        &self,
        id: OutboxId,
        reason: &str,
        retry_at: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Result<()> {
        self.change(id, &mark_failed_change(reason, retry_at, now)?, None)
            .await
    }

    /// Operator call, unfenced: `Dispatching → OutcomeUnknown`, storing
    /// `remote_ref` if given. On `OutcomeUnknown` it is accepted and fills
    /// the remote reference only if none is stored yet. Otherwise
    /// [`Error::Conflict`].
    pub fn mark_outcome_unknown(&self, id: OutboxId, remote_ref: Option<&str>) -> Result<()> {
        wait(self.mark_outcome_unknown_async(id, remote_ref))
    }

    /// [`PgOutbox::mark_outcome_unknown`], awaited.
    pub async fn mark_outcome_unknown_async(
        &self,
        id: OutboxId,
        remote_ref: Option<&str>,
    ) -> Result<()> {
        self.change(id, &mark_outcome_unknown_change(remote_ref)?, None)
            .await
    }

    /// Operator call, unfenced: moves a `Pending`, `Dispatching` or
    /// `OutcomeUnknown` entry to `Pending` due at `next_attempt_at`.
    /// Otherwise [`Error::Conflict`].
    pub fn reschedule(&self, id: OutboxId, next_attempt_at: DateTime<Utc>) -> Result<()> {
        wait(self.reschedule_async(id, next_attempt_at))
    }

    /// [`PgOutbox::reschedule`], awaited.
    pub async fn reschedule_async(
        &self,
        id: OutboxId,
        next_attempt_at: DateTime<Utc>,
    ) -> Result<()> {
        let change = Change::Rescheduled {
            next_attempt_at: micros(next_attempt_at),
            now: None,
        };
        self.change(id, &change, None).await
    }

    /// Operator call: moves a `Failed` or `OutcomeUnknown` entry back to
    /// `Pending`, due at `next_attempt_at`. Anything else is
    /// [`Error::Conflict`].
    pub fn requeue(&self, id: OutboxId, next_attempt_at: DateTime<Utc>) -> Result<()> {
        wait(self.requeue_async(id, next_attempt_at))
    }

    /// [`PgOutbox::requeue`], awaited.
    pub async fn requeue_async(&self, id: OutboxId, next_attempt_at: DateTime<Utc>) -> Result<()> {
        let change = Change::Requeued {
            next_attempt_at: micros(next_attempt_at),
        };
        self.change(id, &change, None).await
    }

    /// Cancels `id` at `now`: a `Pending` or `OutcomeUnknown` entry becomes
    /// `Failed` with `last_failure` [`REASON_CANCELLED`](crate::REASON_CANCELLED).
    /// Repeating it is accepted; a `Dispatching`, `Completed` or otherwise
    /// `Failed` entry is [`Error::Conflict`].
    pub fn cancel(&self, id: OutboxId, now: DateTime<Utc>) -> Result<()> {
        wait(self.cancel_async(id, now))
    }

    /// [`PgOutbox::cancel`], awaited.
    pub async fn cancel_async(&self, id: OutboxId, now: DateTime<Utc>) -> Result<()> {
        self.change(id, &Change::Cancelled { now: micros(now) }, None)
            .await
    }
}
