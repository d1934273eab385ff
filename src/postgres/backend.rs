//! The PostgreSQL handles behind the dispatcher's, the janitor's and the
//! HTTP layer's traits ([`OutboxBackend`], [`InboxBackend`],
//! [`IdempotencyBackend`]): each call is the handle's own method.

use chrono::{DateTime, Utc};
use crossbeam_channel::Receiver;

use super::{PgIdempotencyKeys, PgInbox, PgOutbox};
use crate::backend::{IdempotencyBackend, InboxBackend, OutboxBackend, sealed};
use crate::error::Result;
use crate::idempotency::{Begin, Reservation, ResponseRecord};
use crate::outbox::{Fence, OutboxEntry, OutboxId, SettledAndClaimed, Settlement};

impl sealed::Outbox for PgOutbox {
    #[cfg(feature = "tokio")]
    fn subscribe_async(&self) -> tokio::sync::watch::Receiver<()> {
        PgOutbox::subscribe_async(self)
    }
}

impl OutboxBackend for PgOutbox {
    fn claim_due(
        &self,
        now: DateTime<Utc>,
        limit: usize,
        worker_id: &str,
    ) -> Result<Vec<OutboxEntry>> {
        PgOutbox::claim_due(self, now, limit, worker_id)
    }

    fn settle(&self, fence: Fence, settlement: Settlement, now: DateTime<Utc>) -> Result<()> {
        PgOutbox::settle(self, fence, settlement, now)
    }

    fn settle_many(
        &self,
        settlements: Vec<(Fence, Settlement)>,
        now: DateTime<Utc>,
    ) -> Result<Vec<Result<()>>> {
        PgOutbox::settle_many(self, settlements, now)
    }

    fn settle_and_claim(
        &self,
        settlements: Vec<(Fence, Settlement)>,
        now: DateTime<Utc>,
        limit: usize,
        worker_id: &str,
    ) -> Result<SettledAndClaimed> {
        PgOutbox::settle_and_claim(self, settlements, now, limit, worker_id)
    }

    fn release_expired_claims(&self, claimed_before: DateTime<Utc>) -> Result<Vec<OutboxId>> {
        PgOutbox::release_expired_claims(self, claimed_before)
    }

    fn purge_finished(&self, before: DateTime<Utc>) -> Result<u64> {
        PgOutbox::purge_finished(self, before)
    }

    fn next_due(&self) -> Result<Option<DateTime<Utc>>> {
        PgOutbox::next_due(self)
    }

    fn subscribe(&self) -> Receiver<()> {
        PgOutbox::subscribe(self)
    }
}

impl sealed::Inbox for PgInbox {}

impl InboxBackend for PgInbox {
    fn prune(&self, seen_before: DateTime<Utc>) -> Result<u64> {
        PgInbox::prune(self, seen_before)
    }
}

impl sealed::Keys for PgIdempotencyKeys {}

impl IdempotencyBackend for PgIdempotencyKeys {
    fn begin(
        &self,
        tenant: &str,
        key: &str,
        fingerprint: &str,
        now: DateTime<Utc>,
    ) -> Result<Begin> {
        PgIdempotencyKeys::begin(self, tenant, key, fingerprint, now)
    }

    fn complete(
        &self,
        r: &Reservation,
        response: ResponseRecord,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        PgIdempotencyKeys::complete(self, r, response, now)
    }

    fn release(&self, r: &Reservation) -> Result<()> {
        PgIdempotencyKeys::release(self, r)
    }

    fn purge_expired(&self, expired_before: DateTime<Utc>) -> Result<u64> {
        PgIdempotencyKeys::purge_expired(self, expired_before)
    }

    fn ttl(&self) -> std::time::Duration {
        PgIdempotencyKeys::ttl(self)
    }
}
