//! The idempotency keys' calls for async tasks (feature `tokio`): each is
//! the blocking call of the same name without `_async`, with the same
//! checks, answers and errors; a write joins the next group commit like a
//! thread's, and the task waits for its durable answer without holding a
//! thread.
//!
//! Dropping one of these futures before its first poll does nothing;
//! dropping it after may leave its one operation to commit without anyone
//! told: a `begin` may have reserved the key (it stays reserved until its
//! lease ends: a retry then takes it over), a `complete` may have stored
//! the response (a retry replays it), a `release` may have released.

use chrono::{DateTime, Utc};

use super::record::read_row;
use super::rules::{self, Look, check_begin};
use super::{Begin, IdempotencyKeys, Reservation, ResponseRecord, bump, count_completion, ops};
use crate::codec::micros;
use crate::error::Result;
use crate::schema::{IDEM, open_read};

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
        let row = self
            .engine
            .read_async(|tx| match open_read(tx, IDEM)? {
                Some(table) => read_row(&table, tenant, key),
                None => Ok(None),
            })
            .await?;
        match rules::decide(row, fingerprint, now_us, expired_before) {
            Look::Reserve { .. } => {}
            answer => return self.answer(tenant, key, answer),
        }
        let (t, k, f) = (tenant.to_owned(), key.to_owned(), fingerprint.to_owned());
        let began = self
            .engine
            .execute_async(move |tx| {
                ops::begin(tx, &t, &k, &f, now_us, expired_before, lease_until_us)
            })
            .await?;
        self.began(tenant, key, fingerprint, (now, lease_until), began)
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
