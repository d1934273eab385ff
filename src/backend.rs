//! What the [`Dispatcher`](crate::Dispatcher), its [`Janitor`](crate::Janitor)
//! and the HTTP `IdempotencyLayer` need from a store, one small trait each,
//! implemented by the embedded handles ([`Outbox`], [`Inbox`],
//! [`IdempotencyKeys`]) and, with feature `postgres`, by the PostgreSQL ones
//! (`PgOutbox`, `PgInbox`, `PgIdempotencyKeys`). So
//! `Dispatcher::builder(store.outbox())` and
//! `IdempotencyLayer::new(store.idempotency_keys())` take either store's
//! handle: moving a program to PostgreSQL changes its constructor only.
//!
//! Each trait holds exactly the calls its users make, with the signatures
//! of the handles' own methods (a batch of settlements is a `Vec` here,
//! where the methods take any iterator); each method does what the
//! handle's method of the same name does, and its docs are there. A
//! handle's own method is what a plain call (`outbox.next_due()`) reaches:
//! the traits matter to code written once for both backends,
//! `fn f(outbox: &impl OutboxBackend)`.
//!
//! The runtimes keep the handle behind an `Arc<dyn …>`: one virtual call per
//! store call, beside a commit or a round trip to the server, and no type
//! parameter on the builders and handles.
//!
//! The traits are sealed (implemented by this crate's handles only), so
//! that a later version can add a call without breaking anyone.
//!
//! This module names only the value types of the calls: each backend
//! implements the traits beside its handles (`store/backend.rs`,
//! `postgres/backend.rs`), through the macros here, so that the dispatcher
//! and the console, which use the traits, depend on neither backend.
//!
//! [`Outbox`]: crate::Outbox
//! [`Inbox`]: crate::Inbox
//! [`IdempotencyKeys`]: crate::IdempotencyKeys

use std::fmt::Debug;

use chrono::{DateTime, Utc};
use crossbeam_channel::Receiver;

use crate::error::Result;
use crate::idempotency::{Begin, KeyEntry, KeySummary, Reservation, ResponseRecord};
use crate::outbox::{
    ClaimRequest, DestinationPolicy, DestinationState, Fence, MatchingChange, MatchingStep,
    OutboxCounts, OutboxEntry, OutboxFilter, OutboxId, OutboxRecord, SettledAndClaimed, Settlement,
};

/// An outbox a [`Dispatcher`](crate::Dispatcher) drives: its workers claim
/// and settle, its reaper releases expired claims, its idle workers wait
/// for [`next_due`](Self::next_due) or a [`subscribe`](Self::subscribe)
/// signal, and a [`Janitor`](crate::Janitor) purges finished entries.
/// Implemented by [`Outbox`](crate::Outbox) and `postgres::PgOutbox`; sealed.
///
/// Each call is the handle's method of the same name ([`Outbox::claim_due`](crate::Outbox::claim_due),
/// [`Outbox::settle`](crate::Outbox::settle), …; `PgOutbox`'s on PostgreSQL), with the same
/// guarantees. On PostgreSQL, [`subscribe`](Self::subscribe) hears the
/// commits of every process (`LISTEN`), so a dispatcher in one process wakes
/// when another enqueues.
pub trait OutboxBackend: Debug + Send + Sync + 'static + sealed::Outbox {
    /// Claims up to `limit` due entries for `worker_id`.
    fn claim_due(
        &self,
        now: DateTime<Utc>,
        limit: usize,
        worker_id: &str,
    ) -> Result<Vec<OutboxEntry>>;

    /// Claims what `request` asks for (fair sharing across destinations,
    /// one destination per batch, destinations to avoid).
    fn claim(&self, now: DateTime<Utc>, request: &ClaimRequest) -> Result<Vec<OutboxEntry>>;

    /// Settles one attempt, fenced by its attempt number.
    fn settle(&self, fence: Fence, settlement: Settlement, now: DateTime<Utc>) -> Result<()>;

    /// Settles many attempts in one commit: one answer each, in order.
    fn settle_many(
        &self,
        settlements: Vec<(Fence, Settlement)>,
        now: DateTime<Utc>,
    ) -> Result<Vec<Result<()>>>;

    /// Settles a finished batch and claims the next one in one commit.
    fn settle_and_claim(
        &self,
        settlements: Vec<(Fence, Settlement)>,
        now: DateTime<Utc>,
        limit: usize,
        worker_id: &str,
    ) -> Result<SettledAndClaimed>;

    /// Settles a finished batch and claims what `request` asks for in one
    /// commit.
    fn settle_and_claim_with(
        &self,
        settlements: Vec<(Fence, Settlement)>,
        now: DateTime<Utc>,
        request: &ClaimRequest,
    ) -> Result<SettledAndClaimed>;

    /// Moves every claim older than `claimed_before` back to `Pending` (the
    /// reaper); returns their ids.
    fn release_expired_claims(&self, claimed_before: DateTime<Utc>) -> Result<Vec<OutboxId>>;

    /// Deletes `Completed` and `Failed` entries finished before
    /// `finished_before`.
    fn purge_finished(&self, finished_before: DateTime<Utc>) -> Result<u64>;

    /// The earliest due time of any `Pending` entry.
    fn next_due(&self) -> Result<Option<DateTime<Utc>>>;

    /// A channel signalled after commits that may have made work due.
    fn subscribe(&self) -> Receiver<()>;
}

/// An inbox a [`Janitor`](crate::Janitor) prunes. Implemented by [`Inbox`](crate::Inbox)
/// and `postgres::PgInbox`; sealed.
pub trait InboxBackend: Debug + Send + Sync + 'static + sealed::Inbox {
    /// Removes the keys claimed strictly before `seen_before`
    /// ([`Inbox::prune`](crate::Inbox::prune)); returns how many.
    fn prune(&self, seen_before: DateTime<Utc>) -> Result<u64>;
}

/// Idempotency-key records the HTTP `IdempotencyLayer` (feature
/// `middleware`) decides with, and a [`Janitor`](crate::Janitor) purges.
/// Implemented by [`IdempotencyKeys`](crate::IdempotencyKeys) and `postgres::PgIdempotencyKeys`;
/// sealed.
///
/// Each call is the handle's method of the same name
/// ([`IdempotencyKeys::begin`](crate::IdempotencyKeys::begin), …), with the same guarantees, under the TTL
/// and lease set on the handle.
pub trait IdempotencyBackend: Debug + Send + Sync + 'static + sealed::Keys {
    /// Decides a request: proceed (reserved), replay, mismatch or in flight.
    fn begin(
        &self,
        tenant: &str,
        key: &str,
        fingerprint: &str,
        now: DateTime<Utc>,
    ) -> Result<Begin>;

    /// Stores the response of the reservation `r`; `false` if `r` no longer
    /// holds the key (nothing written).
    fn complete(
        &self,
        r: &Reservation,
        response: ResponseRecord,
        now: DateTime<Utc>,
    ) -> Result<bool>;

    /// Gives up the reservation `r`.
    fn release(&self, r: &Reservation) -> Result<()>;

    /// Removes the records created strictly before `expired_before`.
    fn purge_expired(&self, expired_before: DateTime<Utc>) -> Result<u64>;

    /// How long a completed response is kept (the handle's TTL).
    fn ttl(&self) -> std::time::Duration;
}

/// A boxed future the crate's async runtimes await.
#[cfg(feature = "tokio")]
pub(crate) type BoxFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// The seals: public traits in a module no one outside the crate can name,
/// so only this crate implements the traits above. They also carry what the
/// crate's own runtimes need and the public API does not show.
pub(crate) mod sealed {
    /// The seal of [`OutboxBackend`](super::OutboxBackend).
    pub trait Outbox {
        /// The destinations whose policy sets a
        /// [`weight`](crate::DestinationPolicy::weight), with it: what a
        /// dispatcher shares its workers out by.
        fn weights(&self) -> crate::Result<Vec<(String, u32)>>;
        /// [`weights`](Outbox::weights) as a future.
        #[cfg(feature = "tokio")]
        fn weights_async(&self) -> super::BoxFuture<'_, crate::Result<Vec<(String, u32)>>>;
        /// Fires the schedules due at `now` (the dispatcher's scheduler):
        /// the number of entries enqueued.
        fn fire_schedules(&self, now: chrono::DateTime<chrono::Utc>) -> crate::Result<u64>;
        /// When the next schedule is due, if one is.
        fn next_schedule_slot(&self) -> crate::Result<Option<chrono::DateTime<chrono::Utc>>>;
        /// [`fire_schedules`](Outbox::fire_schedules) as a future.
        #[cfg(feature = "tokio")]
        fn fire_schedules_async(
            &self,
            now: chrono::DateTime<chrono::Utc>,
        ) -> super::BoxFuture<'_, crate::Result<u64>>;
        /// [`next_schedule_slot`](Outbox::next_schedule_slot) as a future.
        #[cfg(feature = "tokio")]
        fn next_schedule_slot_async(
            &self,
        ) -> super::BoxFuture<'_, crate::Result<Option<chrono::DateTime<chrono::Utc>>>>;
        /// [`subscribe`](super::OutboxBackend::subscribe) for async waiters:
        /// signalled after the same commits.
        #[cfg(feature = "tokio")]
        fn subscribe_async(&self) -> tokio::sync::watch::Receiver<()>;
        /// [`settle_and_claim_with`](super::OutboxBackend::settle_and_claim_with)
        /// as a future that holds no thread while it waits.
        #[cfg(feature = "tokio")]
        fn settle_and_claim_async(
            &self,
            settlements: Vec<(crate::Fence, crate::Settlement)>,
            now: chrono::DateTime<chrono::Utc>,
            request: crate::ClaimRequest,
        ) -> super::BoxFuture<'_, crate::Result<crate::SettledAndClaimed>>;
        /// [`next_due`](super::OutboxBackend::next_due) likewise.
        #[cfg(feature = "tokio")]
        fn next_due_async(
            &self,
        ) -> super::BoxFuture<'_, crate::Result<Option<chrono::DateTime<chrono::Utc>>>>;
        /// How many claimers the async dispatcher runs: commits that may
        /// usefully run at once (1 where commits go one after the other).
        #[cfg(feature = "tokio")]
        fn commit_parallelism(&self) -> usize;
        /// [`settle`](super::OutboxBackend::settle), awaited.
        #[cfg(feature = "tokio")]
        fn settle_async(
            &self,
            fence: crate::Fence,
            settlement: crate::Settlement,
            now: chrono::DateTime<chrono::Utc>,
        ) -> super::BoxFuture<'_, crate::Result<()>>;
        /// [`settle_many`](super::OutboxBackend::settle_many), awaited.
        #[cfg(feature = "tokio")]
        fn settle_many_async(
            &self,
            settlements: Vec<(crate::Fence, crate::Settlement)>,
            now: chrono::DateTime<chrono::Utc>,
        ) -> super::BoxFuture<'_, crate::Result<Vec<crate::Result<()>>>>;
        /// [`release_expired_claims`](super::OutboxBackend::release_expired_claims),
        /// awaited.
        #[cfg(feature = "tokio")]
        fn release_expired_claims_async(
            &self,
            claimed_before: chrono::DateTime<chrono::Utc>,
        ) -> super::BoxFuture<'_, crate::Result<Vec<crate::OutboxId>>>;
        /// [`purge_finished`](super::OutboxBackend::purge_finished), awaited.
        #[cfg(feature = "tokio")]
        fn purge_finished_async(
            &self,
            finished_before: chrono::DateTime<chrono::Utc>,
        ) -> super::BoxFuture<'_, crate::Result<u64>>;
    }

    /// The seal of [`InboxBackend`](super::InboxBackend), with its call as
    /// a future, for the async dispatcher's janitor.
    pub trait Inbox {
        /// [`prune`](super::InboxBackend::prune), awaited.
        #[cfg(feature = "tokio")]
        fn prune_async(
            &self,
            seen_before: chrono::DateTime<chrono::Utc>,
        ) -> super::BoxFuture<'_, crate::Result<u64>>;
    }

    /// The seal of [`IdempotencyBackend`](super::IdempotencyBackend), with
    /// its calls as futures that hold no thread while they wait, for the
    /// HTTP layer.
    pub trait Keys {
        /// [`begin`](super::IdempotencyBackend::begin), awaited.
        #[cfg(feature = "tokio")]
        fn begin_async<'a>(
            &'a self,
            tenant: &'a str,
            key: &'a str,
            fingerprint: &'a str,
            now: chrono::DateTime<chrono::Utc>,
        ) -> super::BoxFuture<'a, crate::Result<crate::Begin>>;
        /// [`complete`](super::IdempotencyBackend::complete), awaited.
        #[cfg(feature = "tokio")]
        fn complete_async<'a>(
            &'a self,
            r: &'a crate::Reservation,
            response: crate::ResponseRecord,
            now: chrono::DateTime<chrono::Utc>,
        ) -> super::BoxFuture<'a, crate::Result<bool>>;
        /// [`release`](super::IdempotencyBackend::release), awaited.
        #[cfg(feature = "tokio")]
        fn release_async<'a>(
            &'a self,
            r: &'a crate::Reservation,
        ) -> super::BoxFuture<'a, crate::Result<()>>;
        /// [`purge_expired`](super::IdempotencyBackend::purge_expired),
        /// awaited (the async dispatcher's janitor).
        #[cfg(feature = "tokio")]
        fn purge_expired_async(
            &self,
            expired_before: chrono::DateTime<chrono::Utc>,
        ) -> super::BoxFuture<'_, crate::Result<u64>>;
    }

    /// The seal of [`OutboxAdmin`](super::OutboxAdmin).
    pub trait Admin {}

    /// The seal of [`StoreAdmin`](super::StoreAdmin).
    pub trait StoreAdmin {}
}

/// Implements the three traits for an outbox, an inbox and an
/// idempotency-key handle type, each call forwarded to the handle's own
/// method of the same name. Both backends' handles go through it, so their
/// calls cannot drift apart.
macro_rules! forward_to_handles {
    (outbox: $outbox:ty, inbox: $inbox:ty, keys: $keys:ty $(,)?) => {
        impl $crate::backend::sealed::Outbox for $outbox {
            fn weights(&self) -> $crate::Result<Vec<(String, u32)>> {
                <$outbox>::weights(self)
            }
            #[cfg(feature = "tokio")]
            fn weights_async(
                &self,
            ) -> $crate::backend::BoxFuture<'_, $crate::Result<Vec<(String, u32)>>> {
                <$outbox>::weights_boxed(self)
            }
            fn fire_schedules(&self, now: chrono::DateTime<chrono::Utc>) -> $crate::Result<u64> {
                <$outbox>::fire_schedules(self, now)
            }
            fn next_schedule_slot(
                &self,
            ) -> $crate::Result<Option<chrono::DateTime<chrono::Utc>>> {
                <$outbox>::next_schedule_slot(self)
            }
            #[cfg(feature = "tokio")]
            fn fire_schedules_async(
                &self,
                now: chrono::DateTime<chrono::Utc>,
            ) -> $crate::backend::BoxFuture<'_, $crate::Result<u64>> {
                <$outbox>::fire_schedules_boxed(self, now)
            }
            #[cfg(feature = "tokio")]
            fn next_schedule_slot_async(
                &self,
            ) -> $crate::backend::BoxFuture<'_, $crate::Result<Option<chrono::DateTime<chrono::Utc>>>>
            {
                <$outbox>::next_schedule_slot_boxed(self)
            }
            #[cfg(feature = "tokio")]
            fn subscribe_async(&self) -> tokio::sync::watch::Receiver<()> {
                <$outbox>::subscribe_async(self)
            }
            #[cfg(feature = "tokio")]
            fn settle_and_claim_async(
                &self,
                settlements: Vec<($crate::Fence, $crate::Settlement)>,
                now: chrono::DateTime<chrono::Utc>,
                request: $crate::ClaimRequest,
            ) -> $crate::backend::BoxFuture<'_, $crate::Result<$crate::SettledAndClaimed>> {
                <$outbox>::settle_and_claim_boxed(self, settlements, now, request)
            }
            #[cfg(feature = "tokio")]
            fn next_due_async(
                &self,
            ) -> $crate::backend::BoxFuture<'_, $crate::Result<Option<chrono::DateTime<chrono::Utc>>>>
            {
                <$outbox>::next_due_boxed(self)
            }
            #[cfg(feature = "tokio")]
            fn commit_parallelism(&self) -> usize {
                <$outbox>::commit_parallelism(self)
            }
            #[cfg(feature = "tokio")]
            fn settle_async(
                &self,
                fence: $crate::Fence,
                settlement: $crate::Settlement,
                now: chrono::DateTime<chrono::Utc>,
            ) -> $crate::backend::BoxFuture<'_, $crate::Result<()>> {
                Box::pin(<$outbox>::settle_async(self, fence, settlement, now))
            }
            #[cfg(feature = "tokio")]
            fn settle_many_async(
                &self,
                settlements: Vec<($crate::Fence, $crate::Settlement)>,
                now: chrono::DateTime<chrono::Utc>,
            ) -> $crate::backend::BoxFuture<'_, $crate::Result<Vec<$crate::Result<()>>>> {
                Box::pin(<$outbox>::settle_many_async(self, settlements, now))
            }
            #[cfg(feature = "tokio")]
            fn release_expired_claims_async(
                &self,
                claimed_before: chrono::DateTime<chrono::Utc>,
            ) -> $crate::backend::BoxFuture<'_, $crate::Result<Vec<$crate::OutboxId>>> {
                Box::pin(<$outbox>::release_expired_claims_async(self, claimed_before))
            }
            #[cfg(feature = "tokio")]
            fn purge_finished_async(
                &self,
                finished_before: chrono::DateTime<chrono::Utc>,
            ) -> $crate::backend::BoxFuture<'_, $crate::Result<u64>> {
                Box::pin(<$outbox>::purge_finished_async(self, finished_before))
            }
        }

        impl $crate::backend::OutboxBackend for $outbox {
            fn claim_due(
                &self,
                now: chrono::DateTime<chrono::Utc>,
                limit: usize,
                worker_id: &str,
            ) -> $crate::Result<Vec<$crate::OutboxEntry>> {
                <$outbox>::claim_due(self, now, limit, worker_id)
            }

            fn claim(
                &self,
                now: chrono::DateTime<chrono::Utc>,
                request: &$crate::ClaimRequest,
            ) -> $crate::Result<Vec<$crate::OutboxEntry>> {
                <$outbox>::claim(self, now, request)
            }

            fn settle_and_claim_with(
                &self,
                settlements: Vec<($crate::Fence, $crate::Settlement)>,
                now: chrono::DateTime<chrono::Utc>,
                request: &$crate::ClaimRequest,
            ) -> $crate::Result<$crate::outbox::SettledAndClaimed> {
                <$outbox>::settle_and_claim_with(self, settlements, now, request)
            }

            fn settle(
                &self,
                fence: $crate::Fence,
                settlement: $crate::Settlement,
                now: chrono::DateTime<chrono::Utc>,
            ) -> $crate::Result<()> {
                <$outbox>::settle(self, fence, settlement, now)
            }

            fn settle_many(
                &self,
                settlements: Vec<($crate::Fence, $crate::Settlement)>,
                now: chrono::DateTime<chrono::Utc>,
            ) -> $crate::Result<Vec<$crate::Result<()>>> {
                <$outbox>::settle_many(self, settlements, now)
            }

            fn settle_and_claim(
                &self,
                settlements: Vec<($crate::Fence, $crate::Settlement)>,
                now: chrono::DateTime<chrono::Utc>,
                limit: usize,
                worker_id: &str,
            ) -> $crate::Result<$crate::outbox::SettledAndClaimed> {
                <$outbox>::settle_and_claim(self, settlements, now, limit, worker_id)
            }

            fn release_expired_claims(
                &self,
                claimed_before: chrono::DateTime<chrono::Utc>,
            ) -> $crate::Result<Vec<$crate::OutboxId>> {
                <$outbox>::release_expired_claims(self, claimed_before)
            }

            fn purge_finished(
                &self,
                finished_before: chrono::DateTime<chrono::Utc>,
            ) -> $crate::Result<u64> {
                <$outbox>::purge_finished(self, finished_before)
            }

            fn next_due(&self) -> $crate::Result<Option<chrono::DateTime<chrono::Utc>>> {
                <$outbox>::next_due(self)
            }

            fn subscribe(&self) -> crossbeam_channel::Receiver<()> {
                <$outbox>::subscribe(self)
            }
        }

        impl $crate::backend::sealed::Inbox for $inbox {
            #[cfg(feature = "tokio")]
            fn prune_async(
                &self,
                seen_before: chrono::DateTime<chrono::Utc>,
            ) -> $crate::backend::BoxFuture<'_, $crate::Result<u64>> {
                Box::pin(<$inbox>::prune_async(self, seen_before))
            }
        }

        impl $crate::backend::InboxBackend for $inbox {
            fn prune(&self, seen_before: chrono::DateTime<chrono::Utc>) -> $crate::Result<u64> {
                <$inbox>::prune(self, seen_before)
            }
        }

        impl $crate::backend::sealed::Keys for $keys {
            #[cfg(feature = "tokio")]
            fn begin_async<'a>(
                &'a self,
                tenant: &'a str,
                key: &'a str,
                fingerprint: &'a str,
                now: chrono::DateTime<chrono::Utc>,
            ) -> $crate::backend::BoxFuture<'a, $crate::Result<$crate::Begin>> {
                Box::pin(<$keys>::begin_async(self, tenant, key, fingerprint, now))
            }
            #[cfg(feature = "tokio")]
            fn complete_async<'a>(
                &'a self,
                r: &'a $crate::Reservation,
                response: $crate::ResponseRecord,
                now: chrono::DateTime<chrono::Utc>,
            ) -> $crate::backend::BoxFuture<'a, $crate::Result<bool>> {
                Box::pin(<$keys>::complete_async(self, r, response, now))
            }
            #[cfg(feature = "tokio")]
            fn release_async<'a>(
                &'a self,
                r: &'a $crate::Reservation,
            ) -> $crate::backend::BoxFuture<'a, $crate::Result<()>> {
                Box::pin(<$keys>::release_async(self, r))
            }
            #[cfg(feature = "tokio")]
            fn purge_expired_async(
                &self,
                expired_before: chrono::DateTime<chrono::Utc>,
            ) -> $crate::backend::BoxFuture<'_, $crate::Result<u64>> {
                Box::pin(<$keys>::purge_expired_async(self, expired_before))
            }
        }

        impl $crate::backend::IdempotencyBackend for $keys {
            fn begin(
                &self,
                tenant: &str,
                key: &str,
                fingerprint: &str,
                now: chrono::DateTime<chrono::Utc>,
            ) -> $crate::Result<$crate::Begin> {
                <$keys>::begin(self, tenant, key, fingerprint, now)
            }

            fn complete(
                &self,
                r: &$crate::Reservation,
                response: $crate::ResponseRecord,
                now: chrono::DateTime<chrono::Utc>,
            ) -> $crate::Result<bool> {
                <$keys>::complete(self, r, response, now)
            }

            fn release(&self, r: &$crate::Reservation) -> $crate::Result<()> {
                <$keys>::release(self, r)
            }

            fn purge_expired(
                &self,
                expired_before: chrono::DateTime<chrono::Utc>,
            ) -> $crate::Result<u64> {
                <$keys>::purge_expired(self, expired_before)
            }

            fn ttl(&self) -> std::time::Duration {
                <$keys>::ttl(self)
            }
        }
    };
}
pub(crate) use forward_to_handles;

/// What an operator reads and changes in an outbox, whatever the store: the
/// operator console's view (feature `console`) and the CLI's. Implemented by [`Outbox`](crate::Outbox)
/// and `postgres::PgOutbox`; sealed, as the traits above.
///
/// Each call is the handle's method of the same name ([`Outbox::list`](crate::Outbox::list),
/// [`Outbox::requeue`](crate::Outbox::requeue), …), with the same guarantees and errors.
pub trait OutboxAdmin: Debug + Send + Sync + 'static + sealed::Admin {
    /// How many entries are in each status.
    fn counts(&self) -> Result<OutboxCounts>;
    /// Up to `limit` entries that `filter` matches, by id.
    fn list(&self, filter: &OutboxFilter, limit: usize) -> Result<Vec<OutboxRecord>>;
    /// The entry `id` with its attempt history; [`Error::NotFound`](crate::Error::NotFound) if none.
    fn get(&self, id: OutboxId) -> Result<OutboxRecord>;
    /// When the next entry may be claimed.
    fn next_due(&self) -> Result<Option<DateTime<Utc>>>;
    /// The claim time of the longest-held `Dispatching` entry.
    fn oldest_claim(&self) -> Result<Option<DateTime<Utc>>>;
    /// Every destination with an entry, a policy or a pause.
    fn destinations(&self) -> Result<Vec<DestinationState>>;
    /// A `Failed` or `OutcomeUnknown` entry back to `Pending`, due then.
    fn requeue(&self, id: OutboxId, next_attempt_at: DateTime<Utc>) -> Result<()>;
    /// A `Pending` or `OutcomeUnknown` entry to `Failed`, reason `cancelled`.
    fn cancel(&self, id: OutboxId, now: DateTime<Utc>) -> Result<()>;
    /// A `Pending`, `Dispatching` or `OutcomeUnknown` entry to `Pending`,
    /// due then; a claim is dropped (its worker's settlement is then
    /// refused as stale).
    fn reschedule(&self, id: OutboxId, next_attempt_at: DateTime<Utc>) -> Result<()>;
    /// An entry marked `Completed`.
    fn mark_completed(&self, id: OutboxId, now: DateTime<Utc>) -> Result<()>;
    /// An entry marked failed with `reason`, retried then if given.
    fn mark_failed(
        &self,
        id: OutboxId,
        reason: &str,
        next_attempt_at: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Result<()>;
    /// Stops claiming `destination`'s entries.
    fn pause_destination(&self, destination: &str) -> Result<()>;
    /// Lets a paused `destination`'s entries be claimed again.
    fn resume_destination(&self, destination: &str) -> Result<()>;
    /// Every schedule, by name, with its next slot and the last one fired.
    fn schedules(&self) -> Result<Vec<crate::ScheduleInfo>>;
    /// Stops the schedule `name` from firing.
    fn pause_schedule(&self, name: &str) -> Result<()>;
    /// Lets a paused schedule fire again (its missed slots by its policy).
    fn resume_schedule(&self, name: &str) -> Result<()>;
    /// Removes the schedule `name` (its entries stay).
    fn remove_schedule(&self, name: &str) -> Result<()>;
    /// Replaces `destination`'s policy.
    fn set_destination_policy(&self, destination: &str, policy: DestinationPolicy) -> Result<()>;
    /// Moves the entries claimed before `claimed_before` back to `Pending`.
    fn release_expired_claims(&self, claimed_before: DateTime<Utc>) -> Result<Vec<OutboxId>>;
    /// Deletes the `Completed` and `Failed` entries finished before
    /// `finished_before`.
    fn purge_finished(&self, finished_before: DateTime<Utc>) -> Result<u64>;
    /// One finding per violated invariant; none when consistent.
    fn check_indexes(&self) -> Result<Vec<String>>;
    /// The entry for `(destination, idempotency_key)`, if any.
    fn find(&self, destination: &str, idempotency_key: &str) -> Result<Option<OutboxRecord>>;
    /// Every entry of command `command_id`, by creation time.
    fn list_for_command(&self, command_id: &str) -> Result<Vec<OutboxRecord>>;
    /// One step of an operator's `change` to every entry `filter`
    /// matches: up to `limit` entries, in one commit.
    fn change_matching(
        &self,
        filter: &OutboxFilter,
        change: &MatchingChange,
        limit: usize,
    ) -> Result<MatchingStep>;
}

/// Implements [`OutboxAdmin`] for an outbox handle type, each call
/// forwarded to the handle's own method of the same name.
macro_rules! forward_admin {
    ($outbox:ty) => {
        impl $crate::backend::sealed::Admin for $outbox {}

        impl $crate::backend::OutboxAdmin for $outbox {
            fn counts(&self) -> $crate::Result<$crate::OutboxCounts> {
                <$outbox>::counts(self)
            }
            fn list(
                &self,
                filter: &$crate::OutboxFilter,
                limit: usize,
            ) -> $crate::Result<Vec<$crate::OutboxRecord>> {
                <$outbox>::list(self, filter, limit)
            }
            fn get(&self, id: $crate::OutboxId) -> $crate::Result<$crate::OutboxRecord> {
                <$outbox>::get(self, id)
            }
            fn next_due(&self) -> $crate::Result<Option<chrono::DateTime<chrono::Utc>>> {
                <$outbox>::next_due(self)
            }
            fn oldest_claim(&self) -> $crate::Result<Option<chrono::DateTime<chrono::Utc>>> {
                <$outbox>::oldest_claim(self)
            }
            fn destinations(&self) -> $crate::Result<Vec<$crate::DestinationState>> {
                <$outbox>::destinations(self)
            }
            fn requeue(
                &self,
                id: $crate::OutboxId,
                next_attempt_at: chrono::DateTime<chrono::Utc>,
            ) -> $crate::Result<()> {
                <$outbox>::requeue(self, id, next_attempt_at)
            }
            fn cancel(
                &self,
                id: $crate::OutboxId,
                now: chrono::DateTime<chrono::Utc>,
            ) -> $crate::Result<()> {
                <$outbox>::cancel(self, id, now)
            }
            fn mark_completed(
                &self,
                id: $crate::OutboxId,
                now: chrono::DateTime<chrono::Utc>,
            ) -> $crate::Result<()> {
                <$outbox>::mark_completed(self, id, now)
            }
            fn mark_failed(
                &self,
                id: $crate::OutboxId,
                reason: &str,
                next_attempt_at: Option<chrono::DateTime<chrono::Utc>>,
                now: chrono::DateTime<chrono::Utc>,
            ) -> $crate::Result<()> {
                <$outbox>::mark_failed(self, id, reason, next_attempt_at, now)
            }
            fn pause_destination(&self, destination: &str) -> $crate::Result<()> {
                <$outbox>::pause_destination(self, destination)
            }
            fn resume_destination(&self, destination: &str) -> $crate::Result<()> {
                <$outbox>::resume_destination(self, destination)
            }
            fn schedules(&self) -> $crate::Result<Vec<$crate::ScheduleInfo>> {
                <$outbox>::schedules(self)
            }
            fn pause_schedule(&self, name: &str) -> $crate::Result<()> {
                <$outbox>::pause_schedule(self, name)
            }
            fn resume_schedule(&self, name: &str) -> $crate::Result<()> {
                <$outbox>::resume_schedule(self, name)
            }
            fn remove_schedule(&self, name: &str) -> $crate::Result<()> {
                <$outbox>::remove_schedule(self, name)
            }
            fn set_destination_policy(
                &self,
                destination: &str,
                policy: $crate::DestinationPolicy,
            ) -> $crate::Result<()> {
                <$outbox>::set_destination_policy(self, destination, policy)
            }
            fn release_expired_claims(
                &self,
                claimed_before: chrono::DateTime<chrono::Utc>,
            ) -> $crate::Result<Vec<$crate::OutboxId>> {
                <$outbox>::release_expired_claims(self, claimed_before)
            }
            fn purge_finished(
                &self,
                finished_before: chrono::DateTime<chrono::Utc>,
            ) -> $crate::Result<u64> {
                <$outbox>::purge_finished(self, finished_before)
            }
            fn check_indexes(&self) -> $crate::Result<Vec<String>> {
                <$outbox>::check_indexes(self)
            }
            fn reschedule(
                &self,
                id: $crate::OutboxId,
                next_attempt_at: chrono::DateTime<chrono::Utc>,
            ) -> $crate::Result<()> {
                <$outbox>::reschedule(self, id, next_attempt_at)
            }
            fn find(
                &self,
                destination: &str,
                idempotency_key: &str,
            ) -> $crate::Result<Option<$crate::OutboxRecord>> {
                <$outbox>::find(self, destination, idempotency_key)
            }
            fn list_for_command(
                &self,
                command_id: &str,
            ) -> $crate::Result<Vec<$crate::OutboxRecord>> {
                <$outbox>::list_for_command(self, command_id)
            }
            fn change_matching(
                &self,
                filter: &$crate::OutboxFilter,
                change: &$crate::MatchingChange,
                limit: usize,
            ) -> $crate::Result<$crate::MatchingStep> {
                <$outbox>::change_matching(self, filter, change, limit)
            }
        }
    };
}
pub(crate) use forward_admin;

/// What an operator reads and changes of a store's inboxes and
/// idempotency keys, whatever the store: the operator console's view
/// (feature `console`). Implemented by [`Store`](crate::Store) and `postgres::PgStore`;
/// sealed, as the traits above.
///
/// Each call is the method of the same name of the store's own handle,
/// with the same guarantees and errors (bad input is
/// [`Error::InvalidInput`](crate::Error::InvalidInput) or
/// [`Error::TooLarge`](crate::Error::TooLarge), and writes nothing): the
/// inbox calls are those of the handle
/// [`Store::inbox`](crate::Store::inbox)`(name)` returns ([`Inbox::len`](crate::Inbox::len), [`Inbox::seen_at`](crate::Inbox::seen_at)),
/// the key calls those of [`Store::idempotency_keys`](crate::Store::idempotency_keys)'s handle
/// ([`IdempotencyKeys::entry`](crate::IdempotencyKeys::entry), [`IdempotencyKeys::response`](crate::IdempotencyKeys::response),
/// [`IdempotencyKeys::summary`](crate::IdempotencyKeys::summary), [`IdempotencyKeys::release_key`](crate::IdempotencyKeys::release_key), and
/// `list_after` for [`list_keys`](Self::list_keys)); on PostgreSQL,
/// `PgStore`'s, `PgInbox`'s and `PgIdempotencyKeys`'s.
pub trait StoreAdmin: Debug + Send + Sync + 'static + sealed::StoreAdmin {
    /// The names of the inboxes that hold at least one key, in name order
    /// ([`Store::inbox_names`](crate::Store::inbox_names)).
    fn inbox_names(&self) -> Result<Vec<String>>;
    /// How many keys the inbox `name` holds ([`Inbox::len`](crate::Inbox::len)).
    fn inbox_len(&self, name: &str) -> Result<u64>;
    /// When `key` was claimed in the inbox `name`, if it was and was not
    /// pruned since ([`Inbox::seen_at`](crate::Inbox::seen_at)).
    fn inbox_seen_at(&self, name: &str, key: &str) -> Result<Option<DateTime<Utc>>>;
    /// The idempotency record at `(tenant, key)`, completed or reserved,
    /// whatever its age ([`IdempotencyKeys::entry`](crate::IdempotencyKeys::entry)).
    fn key(&self, tenant: &str, key: &str) -> Result<Option<KeyEntry>>;
    /// Up to `limit` idempotency records in `(tenant, key)` order, strictly
    /// after `after` (the `(tenant, key)` of a previous page's last row),
    /// from the first if `None` (the key handle's `list_after`).
    fn list_keys(&self, after: Option<(&str, &str)>, limit: usize) -> Result<Vec<KeyEntry>>;
    /// The completed response stored at `(tenant, key)`, whatever its age;
    /// `None` for no record or a reservation ([`IdempotencyKeys::response`](crate::IdempotencyKeys::response)).
    fn key_response(&self, tenant: &str, key: &str) -> Result<Option<ResponseRecord>>;
    /// How many records are completed and how many reserved, and the
    /// oldest one's creation time ([`IdempotencyKeys::summary`](crate::IdempotencyKeys::summary)).
    fn key_summary(&self) -> Result<KeySummary>;
    /// Gives up the reservation of `(tenant, key)` if it still holds fence
    /// token `fence`; whether it did. Never deletes a stored response nor
    /// frees another holder's reservation
    /// ([`IdempotencyKeys::release_key`](crate::IdempotencyKeys::release_key)).
    fn release_key(&self, tenant: &str, key: &str, fence: u64) -> Result<bool>;
}

/// Implements [`StoreAdmin`] for a store type, each call forwarded to the
/// method of the same name of the store's inbox or idempotency-key handle.
macro_rules! forward_store_admin {
    ($store:ty) => {
        impl $crate::backend::sealed::StoreAdmin for $store {}

        impl $crate::backend::StoreAdmin for $store {
            fn inbox_names(&self) -> $crate::Result<Vec<String>> {
                <$store>::inbox_names(self)
            }
            fn inbox_len(&self, name: &str) -> $crate::Result<u64> {
                <$store>::inbox(self, name)?.len()
            }
            fn inbox_seen_at(
                &self,
                name: &str,
                key: &str,
            ) -> $crate::Result<Option<chrono::DateTime<chrono::Utc>>> {
                <$store>::inbox(self, name)?.seen_at(key)
            }
            fn key(&self, tenant: &str, key: &str) -> $crate::Result<Option<$crate::KeyEntry>> {
                <$store>::idempotency_keys(self).entry(tenant, key)
            }
            fn list_keys(
                &self,
                after: Option<(&str, &str)>,
                limit: usize,
            ) -> $crate::Result<Vec<$crate::KeyEntry>> {
                <$store>::idempotency_keys(self).list_after(after, limit)
            }
            fn key_response(
                &self,
                tenant: &str,
                key: &str,
            ) -> $crate::Result<Option<$crate::ResponseRecord>> {
                <$store>::idempotency_keys(self).response(tenant, key)
            }
            fn key_summary(&self) -> $crate::Result<$crate::KeySummary> {
                <$store>::idempotency_keys(self).summary()
            }
            fn release_key(&self, tenant: &str, key: &str, fence: u64) -> $crate::Result<bool> {
                <$store>::idempotency_keys(self).release_key(tenant, key, fence)
            }
        }
    };
}
pub(crate) use forward_store_admin;
