//! The idempotency keys' calls for async tasks (feature `tokio`): each is
//! the blocking call of the same name without `_async`, with the same
//! checks, answers and errors; a write joins the next group commit like a
//! thread's, and the task waits for its durable answer without holding a
//! thread.
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

use super::rules::{self, Look, check_begin};
use super::{
    Begin, IdempotencyKeys, Reservation, ResponseRecord, bump, count_completion, ops, row_in,
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
        let (t, k, fence) = (r.tenant.clone(), r.key.clone(), r.fence);
        if self
            .engine
            .execute_async(move |tx| ops::release(tx, &t, &k, fence))
            .await?
        {
            bump(&self.counters.released, 1);
        }
        Ok(())
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
