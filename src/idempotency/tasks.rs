//! The idempotency keys' calls for async tasks (feature `tokio`): each is
//! the blocking call of the same name without `_async`, with the same
//! checks, answers and errors; a write joins the next group commit like a
//! thread's, and the task waits for its durable answer without holding a
//! thread; a read runs on the task, and waits for durability likewise.
//!
//! Dropping one of these futures before its first poll does nothing;
//! dropping it after may leave its one operation to commit without anyone
//! told: a `complete` may have stored the response (a retry replays it), a
//! `release` may have released. A `begin` dropped before its answer never
//! leaves the key held: if its operation reserved the key, a release
//! fenced by that reservation's token follows it in the queue, so a retry
//! proceeds at once instead of waiting out the lease.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use parking_lot::Mutex;

use super::inspect::{check_indexes_in, key_entry_of, list_after_in, list_in, summary_in};
use super::rules::{self, Look, Row, check_begin, check_tenant, check_tenant_key};
use super::{
    Begin, IdempotencyKeys, KeyEntry, KeySummary, Reservation, ResponseRecord, bump,
    completed_response, count_completion, delete_expired_op, ops, purge_op, release_op, row_in,
};
use crate::codec::micros;
use crate::error::Result;

impl IdempotencyKeys {
    /// [`IdempotencyKeys::begin`], awaited.
    pub async fn begin_async(
        &self,
        tenant: &str,
        key: &str,
        fingerprint: &str,
        now: DateTime<Utc>,
    ) -> Result<Begin> {
        check_begin(tenant, key, fingerprint)?;
        let now_us = micros(now);
        let (expired_before, lease_until_us, lease_until) = self.spans.begin_window(now_us)?;
        let row = self.engine.read_async(|tx| row_in(tx, tenant, key)).await?;
        match rules::decide(row, fingerprint, now_us, expired_before) {
            Look::Reserve { .. } => {}
            answer => return self.answer(tenant, key, answer),
        }
        let (t, k, f) = (tenant.to_owned(), key.to_owned(), fingerprint.to_owned());
        // The fence the operation reserved with, for the clean-up should
        // the future be dropped before its answer.
        let reserved = Arc::new(Mutex::new(None));
        let mut guard = ReleaseOnDrop {
            keys: Some(self),
            tenant,
            key,
            reserved: reserved.clone(),
        };
        let began = self
            .engine
            .execute_async(move |tx| {
                let began = ops::begin(tx, &t, &k, &f, now_us, expired_before, lease_until_us)?;
                *reserved.lock() = match &began {
                    ops::Began::Reserved { fence, .. } => Some(*fence),
                    ops::Began::Answered(_) => None,
                };
                Ok(began)
            })
            .await;
        guard.keys = None;
        self.began(tenant, key, fingerprint, (now, lease_until), began?)
    }

    /// [`IdempotencyKeys::complete`], awaited.
    pub async fn complete_async(
        &self,
        r: &Reservation,
        response: ResponseRecord,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let row = self.reservation_row(r, response, now)?;
        let (t, k) = (r.tenant.clone(), r.key.clone());
        let done = self
            .engine
            .execute_async(move |tx| ops::complete(tx, &t, &k, &row))
            .await?;
        count_completion(&self.counters, done);
        Ok(done.stored())
    }

    /// [`IdempotencyKeys::release`], awaited.
    pub async fn release_async(&self, r: &Reservation) -> Result<()> {
        let released = self
            .engine
            .execute_async(release_op(&r.tenant, &r.key, r.fence))
            .await?;
        self.released(released);
        Ok(())
    }

    /// [`IdempotencyKeys::release_key`], awaited. Dropped after its first
    /// poll, the reservation may still be released.
    pub async fn release_key_async(&self, tenant: &str, key: &str, fence: u64) -> Result<bool> {
        check_tenant_key(tenant, key)?;
        let released = self
            .engine
            .execute_async(release_op(tenant, key, fence))
            .await?;
        Ok(self.released(released))
    }

    /// [`IdempotencyKeys::get`], awaited. Dropped after its first poll, an
    /// expired row it found may still be deleted.
    pub async fn get_async(
        &self,
        tenant: &str,
        key: &str,
        expired_before: DateTime<Utc>,
    ) -> Result<Option<ResponseRecord>> {
        check_tenant_key(tenant, key)?;
        let cutoff = micros(expired_before);
        let row = match self.read_row_async(tenant, key).await? {
            Some(r) if r.expired(cutoff) => {
                let deleted = self
                    .engine
                    .execute_async(delete_expired_op(tenant, key, cutoff))
                    .await?;
                self.expired_deleted(deleted)
            }
            other => other,
        };
        completed_response(tenant, key, row)
    }

    /// [`IdempotencyKeys::put`], awaited. Dropped after its first poll, the
    /// record may still be stored (a retry then answers `false`).
    pub async fn put_async(&self, record: &ResponseRecord) -> Result<bool> {
        let stored = self.engine.execute_async(self.put_op(record)?).await?;
        Ok(self.stored(stored))
    }

    /// [`IdempotencyKeys::purge_expired`], awaited. Dropped after its first
    /// poll, the chunks committed before stay purged and the chunk under
    /// way may still commit; no chunk is queued after it.
    pub async fn purge_expired_async(&self, expired_before: DateTime<Utc>) -> Result<u64> {
        let cutoff = micros(expired_before);
        let mut total = 0;
        let mut cursor: ops::PurgeCursor = None;
        loop {
            let (n, next) = self
                .engine
                .execute_async(purge_op(cursor.clone(), cutoff))
                .await?;
            total += n;
            bump(&self.counters.purged, n);
            match next {
                Some(c) => cursor = Some(c),
                None => return Ok(total),
            }
        }
    }

    /// [`IdempotencyKeys::entry`], awaited.
    pub async fn entry_async(&self, tenant: &str, key: &str) -> Result<Option<KeyEntry>> {
        check_tenant_key(tenant, key)?;
        key_entry_of(tenant, key, self.read_row_async(tenant, key).await?)
    }

    /// [`IdempotencyKeys::response`], awaited.
    pub async fn response_async(&self, tenant: &str, key: &str) -> Result<Option<ResponseRecord>> {
        check_tenant_key(tenant, key)?;
        completed_response(tenant, key, self.read_row_async(tenant, key).await?)
    }

    /// [`IdempotencyKeys::list`], awaited.
    pub async fn list_async(&self, tenant: Option<&str>, limit: usize) -> Result<Vec<KeyEntry>> {
        if let Some(t) = tenant {
            check_tenant(t)?;
        }
        self.engine
            .read_async(|tx| list_in(tx, tenant, limit))
            .await
    }

    /// [`IdempotencyKeys::list_after`], awaited.
    pub async fn list_after_async(
        &self,
        after: Option<(&str, &str)>,
        limit: usize,
    ) -> Result<Vec<KeyEntry>> {
        self.engine
            .read_async(|tx| list_after_in(tx, after, limit))
            .await
    }

    /// [`IdempotencyKeys::summary`], awaited.
    pub async fn summary_async(&self) -> Result<KeySummary> {
        self.engine.read_async(summary_in).await
    }

    /// [`IdempotencyKeys::check_indexes`], awaited.
    pub async fn check_indexes_async(&self) -> Result<Vec<String>> {
        self.engine.read_async(check_indexes_in).await
    }

    /// The row of `(tenant, key)`, read from the task.
    async fn read_row_async(&self, tenant: &str, key: &str) -> Result<Option<Row>> {
        self.engine.read_async(|tx| row_in(tx, tenant, key)).await
    }
}

/// The clean-up of a `begin_async` dropped before its answer: releases the
/// reservation its operation made, if it made one (fenced by its token, so
/// nothing else is touched). Disarmed (`keys: None`) once answered.
struct ReleaseOnDrop<'a> {
    keys: Option<&'a IdempotencyKeys>,
    tenant: &'a str,
    key: &'a str,
    reserved: Arc<Mutex<Option<u64>>>,
}

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        let Some(keys) = self.keys else { return };
        let (t, k, reserved) = (
            self.tenant.to_owned(),
            self.key.to_owned(),
            self.reserved.clone(),
        );
        // Queued behind the begin's operation: it runs after it, and sees
        // the fence it reserved with (none if it reserved nothing or has
        // not committed: then a fenced release changes nothing).
        let _ = keys.engine.execute_detached(move |tx| {
            if let Some(fence) = *reserved.lock() {
                ops::release(tx, &t, &k, fence)?;
            }
            Ok(())
        });
    }
}
