//! The outbox's calls for async tasks (feature `tokio`): each is the
//! blocking call of the same name without `_async`, with the same checks,
//! answers and errors; its operation joins the next group commit like a
//! thread's, and the task waits for its durable answer without holding a
//! thread.
//!
//! Dropping one of these futures before its first poll does nothing;
//! dropping it after may leave its operation to commit without anyone
//! told: an enqueue may have enqueued (a retry of it is then a
//! `Duplicate`), a claim may have claimed (the entries come back once
//! their claims expire and the reaper releases them), a settlement may
//! have settled (settling the same attempt the same way again is
//! accepted). Nothing is ever half done: each call is one operation of
//! one commit, but for the maintenance calls that commit in chunks
//! (`release_expired_claims`, `purge_finished`), each chunk of which is
//! whole. The reads run on the task and wait for durability without
//! holding a thread.

use std::future::Future;
use std::pin::Pin;

use chrono::{DateTime, Utc};

use super::bulk::change_matching_op;
use super::control::{
    FlowChange, destination_in, destinations_in, flow_op, paused_change, policy_change,
};
use super::destinations::check_destination;
use super::inspect::{counts_in, find_in, list_for_command_in, list_in, oldest_claim_in};
use super::rules::{Change, mark_failed_change, mark_outcome_unknown_change};
use super::{
    ClaimRequest, DestinationPolicy, DestinationState, Enqueued, Fence, MatchingChange,
    MatchingStep, NewEntry, Outbox, OutboxCounts, OutboxEntry, OutboxFilter, OutboxId,
    OutboxRecord, SettledAndClaimed, Settlement, change_op, check_field, claim_op, purge_op,
    release_op, settle_and_claim_op, settle_many_op,
};
use crate::codec::micros;
use crate::error::Result;

/// A boxed future, as the dispatcher awaits it.
pub(super) type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

impl Outbox {
    /// [`Outbox::enqueue`], awaited.
    pub async fn enqueue_async(&self, entry: NewEntry, now: DateTime<Utc>) -> Result<Enqueued> {
        let mut out = self.enqueue_many_async(vec![entry], now).await?;
        Ok(out.remove(0))
    }

    /// [`Outbox::enqueue_many`], awaited.
    pub async fn enqueue_many_async(
        &self,
        entries: impl IntoIterator<Item = NewEntry>,
        now: DateTime<Utc>,
    ) -> Result<Vec<Enqueued>> {
        match self.enqueue_op(entries, now)? {
            Some(op) => Ok(self.enqueued(self.engine.execute_async(op).await?)),
            None => Ok(Vec::new()),
        }
    }

    /// [`Outbox::claim_due`], awaited.
    pub async fn claim_due_async(
        &self,
        now: DateTime<Utc>,
        limit: usize,
        worker_id: &str,
    ) -> Result<Vec<OutboxEntry>> {
        self.claim_async(now, &ClaimRequest::new(limit, worker_id))
            .await
    }

    /// [`Outbox::claim`], awaited.
    pub async fn claim_async(
        &self,
        now: DateTime<Utc>,
        request: &ClaimRequest,
    ) -> Result<Vec<OutboxEntry>> {
        match claim_op(now, request)? {
            Some(op) => self.engine.execute_async(op).await,
            None => Ok(Vec::new()),
        }
    }

    /// [`Outbox::settle`], awaited.
    pub async fn settle_async(
        &self,
        fence: Fence,
        settlement: Settlement,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let (op, wake) = change_op(fence.id, settlement.into_change(now)?, Some(fence.attempt));
        let (_, sooner) = self.engine.execute_async(op).await?;
        self.notify_if(wake || sooner);
        Ok(())
    }

    /// [`Outbox::settle_many`], awaited.
    pub async fn settle_many_async(
        &self,
        settlements: impl IntoIterator<Item = (Fence, Settlement)>,
        now: DateTime<Utc>,
    ) -> Result<Vec<Result<()>>> {
        let Some((op, wake)) = settle_many_op(settlements, now)? else {
            return Ok(Vec::new());
        };
        let (out, sooner) = self.engine.execute_async(op).await?;
        self.notify_if_settled(wake || sooner, &out);
        Ok(out)
    }

    /// [`Outbox::settle_and_claim`], awaited.
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

    /// [`Outbox::settle_and_claim_with`], awaited.
    pub async fn settle_and_claim_with_async(
        &self,
        settlements: impl IntoIterator<Item = (Fence, Settlement)>,
        now: DateTime<Utc>,
        request: &ClaimRequest,
    ) -> Result<SettledAndClaimed> {
        let (op, wake) = settle_and_claim_op(settlements, now, request)?;
        let (settled, claimed, sooner) = self.engine.execute_async(op).await?;
        self.notify_if_settled(wake || sooner, &settled);
        Ok((settled, claimed))
    }

    /// [`Outbox::next_due`], awaited.
    pub async fn next_due_async(&self) -> Result<Option<DateTime<Utc>>> {
        self.engine.read_async(super::inspect::next_due_in).await
    }

    /// The dispatcher's step, boxed for the backend trait (the outbox does
    /// not name the trait's types: the backend module sits above it).
    pub(crate) fn settle_and_claim_boxed(
        &self,
        settlements: Vec<(Fence, Settlement)>,
        now: DateTime<Utc>,
        request: ClaimRequest,
    ) -> Boxed<'_, Result<SettledAndClaimed>> {
        Box::pin(async move {
            self.settle_and_claim_with_async(settlements, now, &request)
                .await
        })
    }

    /// The weights a dispatcher shares its workers out by, boxed for the
    /// backend trait.
    pub(crate) fn weights_boxed(&self) -> Boxed<'_, Result<Vec<(String, u32)>>> {
        Box::pin(self.engine.read_async(super::control::weights_in))
    }

    /// The dispatcher's idle look, boxed for the backend trait.
    pub(crate) fn next_due_boxed(&self) -> Boxed<'_, Result<Option<DateTime<Utc>>>> {
        Box::pin(self.next_due_async())
    }

    /// How many commits of the async dispatcher may usefully run at once:
    /// one. The store's commits are one after the other (the group commit
    /// batches what comes during one), so a second claimer would only race
    /// the first for the same entries.
    #[expect(clippy::unused_self, reason = "the backend trait's shape")]
    pub(crate) fn commit_parallelism(&self) -> usize {
        1
    }

    /// [`Outbox::requeue`], awaited.
    pub async fn requeue_async(&self, id: OutboxId, next_attempt_at: DateTime<Utc>) -> Result<()> {
        let change = Change::Requeued {
            next_attempt_at: micros(next_attempt_at),
        };
        self.change_async(id, change).await
    }

    /// [`Outbox::reschedule`], awaited.
    pub async fn reschedule_async(
        &self,
        id: OutboxId,
        next_attempt_at: DateTime<Utc>,
    ) -> Result<()> {
        let change = Change::Rescheduled {
            next_attempt_at: micros(next_attempt_at),
            now: None,
        };
        self.change_async(id, change).await
    }

    /// [`Outbox::cancel`], awaited.
    pub async fn cancel_async(&self, id: OutboxId, now: DateTime<Utc>) -> Result<()> {
        self.change_async(id, Change::Cancelled { now: micros(now) })
            .await
    }

    /// [`Outbox::mark_completed`], awaited.
    pub async fn mark_completed_async(&self, id: OutboxId, now: DateTime<Utc>) -> Result<()> {
        self.change_async(id, Change::Completed { now: micros(now) })
            .await
    }

    /// [`Outbox::mark_failed`], awaited.
    pub async fn mark_failed_async(
        &self,
        id: OutboxId,
        reason: &str,
        retry_at: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Result<()> {
        self.change_async(id, mark_failed_change(reason, retry_at, now)?)
            .await
    }

    /// [`Outbox::mark_outcome_unknown`], awaited.
    pub async fn mark_outcome_unknown_async(
        &self,
        id: OutboxId,
        remote_ref: Option<&str>,
    ) -> Result<()> {
        self.change_async(id, mark_outcome_unknown_change(remote_ref)?)
            .await
    }

    /// [`Outbox::release_expired_claims`], awaited. Dropped after its first
    /// poll, the chunks committed before stay released (their entries
    /// pending again) and the chunk under way may still commit; no chunk
    /// is queued after it.
    pub async fn release_expired_claims_async(
        &self,
        claimed_before: DateTime<Utc>,
    ) -> Result<Vec<OutboxId>> {
        let cutoff = micros(claimed_before);
        let mut released = Vec::new();
        loop {
            let (ids, more) = self.engine.execute_async(release_op(cutoff)).await?;
            if !ids.is_empty() {
                self.notify();
            }
            released.extend(ids);
            if !more {
                return Ok(released);
            }
        }
    }

    /// [`Outbox::purge_finished`], awaited. Dropped after its first poll,
    /// the chunks committed before stay purged and the chunk under way may
    /// still commit; no chunk is queued after it.
    pub async fn purge_finished_async(&self, finished_before: DateTime<Utc>) -> Result<u64> {
        let cutoff = micros(finished_before);
        let mut total = 0;
        loop {
            let (n, more) = self.engine.execute_async(purge_op(cutoff)).await?;
            total += n;
            if !more {
                return Ok(total);
            }
        }
    }

    /// [`Outbox::change_matching`], awaited. Dropped after its first poll,
    /// the step may still commit, whole.
    pub async fn change_matching_async(
        &self,
        filter: &OutboxFilter,
        change: &MatchingChange,
        limit: usize,
    ) -> Result<MatchingStep> {
        let (op, wake) = change_matching_op(filter, change, limit)?;
        let (step, sooner) = self.engine.execute_async(op).await?;
        Ok(self.matched(step, wake || sooner))
    }

    /// [`Outbox::set_destination_policy`], awaited. Dropped after its
    /// first poll, the policy may still be set.
    pub async fn set_destination_policy_async(
        &self,
        destination: &str,
        policy: DestinationPolicy,
    ) -> Result<()> {
        self.flow_change_async(policy_change(destination, policy)?)
            .await
    }

    /// [`Outbox::pause_destination`], awaited. Dropped after its first
    /// poll, the destination may still be paused.
    pub async fn pause_destination_async(&self, destination: &str) -> Result<()> {
        self.flow_change_async(paused_change(destination, true)?)
            .await
    }

    /// [`Outbox::resume_destination`], awaited. Dropped after its first
    /// poll, the destination may still be resumed.
    pub async fn resume_destination_async(&self, destination: &str) -> Result<()> {
        self.flow_change_async(paused_change(destination, false)?)
            .await
    }

    /// [`Outbox::destinations`], awaited.
    pub async fn destinations_async(&self) -> Result<Vec<DestinationState>> {
        self.engine.read_async(destinations_in).await
    }

    /// [`Outbox::destination`], awaited.
    pub async fn destination_async(&self, destination: &str) -> Result<DestinationState> {
        check_destination(destination)?;
        self.engine
            .read_async(|tx| destination_in(tx, destination))
            .await
    }

    /// [`Outbox::find`], awaited.
    pub async fn find_async(
        &self,
        destination: &str,
        idempotency_key: &str,
    ) -> Result<Option<OutboxRecord>> {
        check_field("destination", destination)?;
        check_field("idempotency_key", idempotency_key)?;
        self.engine
            .read_async(|tx| find_in(tx, destination, idempotency_key))
            .await
    }

    /// [`Outbox::list_for_command`], awaited.
    pub async fn list_for_command_async(&self, command_id: &str) -> Result<Vec<OutboxRecord>> {
        check_field("command_id", command_id)?;
        self.engine
            .read_async(|tx| list_for_command_in(tx, command_id))
            .await
    }

    /// [`Outbox::counts`], awaited.
    pub async fn counts_async(&self) -> Result<OutboxCounts> {
        self.engine.read_async(counts_in).await
    }

    /// [`Outbox::list`], awaited.
    pub async fn list_async(
        &self,
        filter: &OutboxFilter,
        limit: usize,
    ) -> Result<Vec<OutboxRecord>> {
        filter.check()?;
        self.engine
            .read_async(|tx| list_in(tx, filter, limit))
            .await
    }

    /// [`Outbox::oldest_claim`], awaited.
    pub async fn oldest_claim_async(&self) -> Result<Option<DateTime<Utc>>> {
        self.engine.read_async(oldest_claim_in).await
    }

    /// [`Outbox::check_indexes`], awaited.
    pub async fn check_indexes_async(&self) -> Result<Vec<String>> {
        self.engine.read_async(super::index::check).await
    }

    /// A destination call's `change` in a commit of its own, awaited (see
    /// `Outbox::flow_change`).
    async fn flow_change_async(&self, change: impl FlowChange) -> Result<()> {
        let sooner = self.engine.execute_async(flow_op(change)).await?;
        self.flow_changed(sooner);
        Ok(())
    }

    /// An operator's unfenced `change` to `id` in a commit of its own,
    /// awaited (see `Outbox::change`).
    async fn change_async(&self, id: OutboxId, change: Change) -> Result<()> {
        let (op, wake) = change_op(id, change, None);
        let (_, sooner) = self.engine.execute_async(op).await?;
        self.notify_if(wake || sooner);
        Ok(())
    }
}
