//! [`PgIdempotencyKeys`]: the HTTP idempotency keys in `S.idempotency`.
//!
//! A row is the rules' row (`src/idempotency/rules.rs`) in columns: a reservation
//! (`lease_until` set; `created_at` is its reservation time) or a
//! completed response (`status`, `content_type`, the headers as two
//! arrays, `body`). `begin`, `put` and `get` read the row, take the
//! decision both backends share on it, and only when it says to write
//! they read it again `FOR UPDATE` in a transaction and decide again on
//! what they find there. Fence tokens come from the store-wide sequence
//! `S.idempotency_fence`, so they are never handed out twice.
//!
//! The statements (`S` is the store's schema, times µs):
//!
//! | call | SQL |
//! |------|-----|
//! | `begin` (replay, mismatch, in flight) | `SELECT … FROM S.idempotency WHERE tenant = $1 AND idem_key = $2` |
//! | `begin` (reserve), `put` | `BEGIN`, the `SELECT … FOR UPDATE`, then `INSERT … VALUES (…, nextval('S.idempotency_fence'), …) ON CONFLICT DO NOTHING RETURNING fence` (no row) or `UPDATE … SET …, fence = nextval(…) … RETURNING fence` (an expired or ended one), `COMMIT` |
//! | `complete`, `complete_in` | `UPDATE S.idempotency SET <the response>, lease_until = NULL WHERE tenant = $1 AND idem_key = $2 AND lease_until IS NOT NULL AND fence = $3` |
//! | `release`, `release_key` | `DELETE FROM S.idempotency WHERE tenant = $1 AND idem_key = $2 AND lease_until IS NOT NULL AND fence = $3` |
//! | `get` (expired row) | `BEGIN`, `SELECT … FOR UPDATE`, `DELETE …` if still expired, `COMMIT` |
//! | `purge_expired` | `DELETE … WHERE (tenant, idem_key) IN (SELECT … WHERE created_at < $1 AND (lease_until IS NULL OR lease_until <= $1) ORDER BY created_at LIMIT 1024 FOR UPDATE SKIP LOCKED)`, repeated while a chunk is full (the `created_at` index) |
//!
//! The inspection calls (`entry`, `list`, `summary`, `check_indexes`, …)
//! are in `inspect.rs`.

mod inspect;

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use super::blocking::wait;
use super::conn::{Db, Mode, in_transaction};
use super::errors::{corrupted, unsigned, utf8};
use super::{Server, Transaction, after_commit, in_write, refuse_reentrant, run};
use crate::codec::micros;
use crate::error::{Error, Result};
use crate::idempotency::rules::{
    Completion, Look, Row, Spans, check_begin, check_put, check_tenant_key, decide, into_row,
    key_name, reservation_row, to_response,
};
use crate::idempotency::{
    Begin, Counters, IdempotencyStats, PURGE_CHUNK, Reservation, ResponseRecord, answer, bump,
    count_completion, count_reserved,
};

const TABLE: &str = "idempotency";

/// The columns of a row, in the order [`read_row`] reads them (after the
/// tenant and the key, where a query selects them).
const COLS: &str = "fingerprint, fence, created_at, lease_until, status, content_type, \
                    header_names, header_values, body";

/// The row in `r`, its columns [`COLS`] from `at` on, stored at
/// `(tenant, key)`.
fn read_row(tenant: &str, key: &str, r: &tokio_postgres::Row, at: usize) -> Result<Row> {
    let name = key_name(tenant, key);
    let fingerprint = utf8(TABLE, &name, r.try_get(at)?)?;
    let fence: u64 = unsigned(TABLE, &name, "fence", r.try_get(at + 1)?)?;
    let created_at: i64 = r.try_get(at + 2)?;
    if let Some(lease_until) = r.try_get::<_, Option<i64>>(at + 3)? {
        return Ok(Row::Reserved {
            fingerprint,
            fence,
            reserved_at: created_at,
            lease_until,
        });
    }
    let status: Option<i32> = r.try_get(at + 4)?;
    let status = status
        .and_then(|s| u16::try_from(s).ok())
        .ok_or_else(|| corrupted(TABLE, &name, format!("bad response status {status:?}")))?;
    let names: Vec<String> = r.try_get(at + 6)?;
    let values: Vec<String> = r.try_get(at + 7)?;
    if names.len() != values.len() {
        return Err(corrupted(TABLE, &name, "header names and values disagree"));
    }
    Ok(Row::Completed {
        fingerprint,
        fence,
        created_at,
        status,
        content_type: r.try_get(at + 5)?,
        headers: names.into_iter().zip(values).collect(),
        body: r.try_get(at + 8)?,
    })
}

/// What a reserving transaction did.
enum Began {
    Answered(Look),
    Reserved {
        fence: u64,
        takeover: bool,
        expired: bool,
    },
}

/// The store's HTTP idempotency-key records on the server: the calls of
/// [`IdempotencyKeys`](crate::IdempotencyKeys), with the same decisions,
/// fencing, limits and errors. Cheap to clone; clones share the store and
/// its [`IdempotencyStats`]. Carries a TTL (default 24 h) and a lease
/// (default 60 s), as the embedded handle.
#[derive(Clone, Debug)]
pub struct PgIdempotencyKeys {
    server: Arc<Server>,
    spans: Spans,
    counters: Arc<Counters>,
}

impl PgIdempotencyKeys {
    pub(super) fn new(server: Arc<Server>, counters: Arc<Counters>) -> PgIdempotencyKeys {
        PgIdempotencyKeys {
            server,
            spans: Spans::default(),
            counters,
        }
    }

    fn s(&self) -> &str {
        &self.server.schema
    }

    /// How long `begin` replays a completed response, counted from its
    /// `created_at`. Default: 24 h. Values over 100 years are cut to 100
    /// years.
    #[must_use]
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.spans.ttl = ttl;
        self
    }

    /// How long a reservation holds its key. Default: 60 s. There is no
    /// renewal: set it above your slowest handler. Values over 100 years
    /// are cut to 100 years.
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.spans.lease = lease;
        self
    }

    /// The TTL `begin` applies.
    pub fn ttl(&self) -> Duration {
        self.spans.ttl
    }

    /// The lease `begin` grants.
    pub fn lease(&self) -> Duration {
        self.spans.lease
    }

    /// The counters of every handle of this store (in this process) since
    /// it was connected.
    pub fn stats(&self) -> IdempotencyStats {
        self.counters.stats()
    }

    /// The row at `(tenant, key)`, locked if `lock`.
    async fn read<C: GenericClient + Sync>(
        &self,
        db: &mut Db<'_, C>,
        tenant: &str,
        key: &str,
        lock: bool,
    ) -> Result<Option<Row>> {
        let s = self.s();
        let lock = if lock { " FOR UPDATE" } else { "" };
        let row = db
            .query_opt(
                &format!(
                    "SELECT {COLS} FROM {s}.idempotency WHERE tenant = $1 AND idem_key = $2{lock}"
                ),
                &[&tenant.as_bytes(), &key.as_bytes()],
            )
            .await?;
        row.map(|r| read_row(tenant, key, &r, 0)).transpose()
    }

    /// Writes `row` at `(tenant, key)` under a fresh fence from the
    /// sequence (a reservation's own, or a response's `put` stores):
    /// replacing the row there (`replace`, locked by the caller) or
    /// inserting one. Returns the fence, or `None` if a row appeared
    /// meanwhile (the insert found one committed since the caller looked).
    async fn write_fresh<C: GenericClient + Sync>(
        &self,
        tx: &mut Db<'_, C>,
        tenant: &str,
        key: &str,
        row: &Row,
        replace: bool,
    ) -> Result<Option<u64>> {
        let s = self.s();
        let fresh = format!("nextval('{s}.idempotency_fence')");
        let (lease_until, status, content_type, names, values, body) = match row {
            Row::Reserved { lease_until, .. } => (Some(*lease_until), None, None, None, None, None),
            Row::Completed {
                status,
                content_type,
                headers,
                body,
                ..
            } => (
                None,
                Some(i32::from(*status)),
                content_type.as_deref(),
                Some(headers.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>()),
                Some(headers.iter().map(|(_, v)| v.as_str()).collect::<Vec<_>>()),
                Some(body.as_slice()),
            ),
        };
        let params: [&(dyn ToSql + Sync); 10] = [
            &tenant.as_bytes(),
            &key.as_bytes(),
            &row.fingerprint().as_bytes(),
            &row.created_at(),
            &lease_until,
            &status,
            &content_type,
            &names,
            &values,
            &body,
        ];
        let sql = if replace {
            format!(
                "UPDATE {s}.idempotency SET fingerprint = $3, fence = {fresh}, created_at = $4, \
                 lease_until = $5, status = $6, content_type = $7, header_names = $8, \
                 header_values = $9, body = $10 \
                 WHERE tenant = $1 AND idem_key = $2 RETURNING fence"
            )
        } else {
            format!(
                "INSERT INTO {s}.idempotency (tenant, idem_key, fingerprint, fence, created_at, \
                 lease_until, status, content_type, header_names, header_values, body) \
                 VALUES ($1, $2, $3, {fresh}, $4, $5, $6, $7, $8, $9, $10) \
                 ON CONFLICT DO NOTHING RETURNING fence"
            )
        };
        let name = key_name(tenant, key);
        tx.query_opt(&sql, &params)
            .await?
            .map(|r| unsigned(TABLE, &name, "fence", r.try_get(0)?))
            .transpose()
    }

    /// The completed response stored at `(tenant, key)`, if any.
    ///
    /// A record created strictly before `expired_before` counts as absent
    /// and is deleted (one write, only then). A reservation reads as `None`;
    /// one made before `expired_before` whose lease ended by then is
    /// deleted too. Inside a [`PgStore::write`](super::PgStore::write)
    /// closure an expired record reads as absent but stays, for a later
    /// `get` or [`purge_expired`](Self::purge_expired): deleting it would
    /// take a second connection, which could wait forever on rows the
    /// closure's transaction holds.
    pub fn get(
        &self,
        tenant: &str,
        key: &str,
        expired_before: DateTime<Utc>,
    ) -> Result<Option<ResponseRecord>> {
        wait(self.get_async(tenant, key, expired_before))
    }

    /// [`PgIdempotencyKeys::get`], awaited. Dropped midway, an expired
    /// record may have been deleted.
    pub async fn get_async(
        &self,
        tenant: &str,
        key: &str,
        expired_before: DateTime<Utc>,
    ) -> Result<Option<ResponseRecord>> {
        check_tenant_key(tenant, key)?;
        let cutoff = micros(expired_before);
        let found = run!(self.server, Mode::Read, |conn| {
            self.read(&mut conn.db(), tenant, key, false).await
        })?;
        let row = match found {
            // Absent either way; the delete is left to a later call.
            Some(r) if r.expired(cutoff) && in_write() => None,
            Some(r) if r.expired(cutoff) => {
                let s = self.s();
                let delete =
                    format!("DELETE FROM {s}.idempotency WHERE tenant = $1 AND idem_key = $2");
                let (deleted, now) = run!(self.server, Mode::Tx, |conn| {
                    in_transaction!(conn, |tx| async {
                        let Some(old) = self.read(tx, tenant, key, true).await? else {
                            return Ok((false, None));
                        };
                        if !old.expired(cutoff) {
                            return Ok((false, Some(old)));
                        }
                        tx.execute(&delete, &[&tenant.as_bytes(), &key.as_bytes()])
                            .await?;
                        Ok((true, None))
                    }
                    .await)
                })?;
                if deleted {
                    bump(&self.counters.expired_deleted, 1);
                }
                now
            }
            other => other,
        };
        match row {
            Some(r @ Row::Completed { .. }) => to_response(tenant, key, r).map(Some),
            _ => Ok(None),
        }
    }

    /// Stores `record` if its key is free; `true` if stored, `false` if a
    /// record was already there (first write wins). "Free" means no row, or
    /// a row expired as of `record.created_at`: a response older than the
    /// handle's TTL, or a reservation whose lease ended.
    pub fn put(&self, record: &ResponseRecord) -> Result<bool> {
        wait(self.put_async(record))
    }

    /// [`PgIdempotencyKeys::put`], awaited. Dropped once its `COMMIT` is
    /// sent, the record may have been stored.
    pub async fn put_async(&self, record: &ResponseRecord) -> Result<bool> {
        check_put(record, self.server.max_body)?;
        refuse_reentrant()?;
        let row = into_row(record.clone(), 0, record.created_at);
        let now = row.created_at();
        let expired_before = self.spans.expired_before(now);
        let (tenant, key) = (record.tenant.as_str(), record.idempotency_key.as_str());
        let stored = run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |tx| async {
                for _ in 0..3 {
                    let old = self.read(tx, tenant, key, true).await?;
                    if old
                        .as_ref()
                        .is_some_and(|r| r.holds_key(now, expired_before))
                    {
                        return Ok(false);
                    }
                    if self
                        .write_fresh(tx, tenant, key, &row, old.is_some())
                        .await?
                        .is_some()
                    {
                        return Ok(true);
                    }
                }
                Err(Error::conflict("the key kept changing while it was stored"))
            }
            .await)
        })?;
        if stored {
            bump(&self.counters.stored, 1);
        }
        Ok(stored)
    }

    /// Removes every record created strictly before `expired_before` (a
    /// reservation only once its lease has also ended by then); returns how
    /// many. Walks the `created_at` index in chunks of 1024 rows, so it
    /// costs what it removes; a row being written at that moment is left
    /// for the next purge.
    pub fn purge_expired(&self, expired_before: DateTime<Utc>) -> Result<u64> {
        wait(self.purge_expired_async(expired_before))
    }

    /// [`PgIdempotencyKeys::purge_expired`], awaited. Dropped midway, the
    /// chunks committed before stay purged.
    pub async fn purge_expired_async(&self, expired_before: DateTime<Utc>) -> Result<u64> {
        refuse_reentrant()?;
        let s = self.s();
        let cutoff = micros(expired_before);
        let chunk = i64::try_from(PURGE_CHUNK).unwrap_or(i64::MAX);
        let sql = format!(
            "DELETE FROM {s}.idempotency WHERE (tenant, idem_key) IN ( \
                 SELECT tenant, idem_key FROM {s}.idempotency \
                 WHERE created_at < $1 AND (lease_until IS NULL OR lease_until <= $1) \
                 ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
        );
        let mut total = 0;
        loop {
            let n = run!(self.server, Mode::Statement, |conn| {
                conn.db().execute(&sql, &[&cutoff, &chunk]).await
            })?;
            total += n;
            bump(&self.counters.purged, n);
            if n < PURGE_CHUNK as u64 {
                return Ok(total);
            }
        }
    }

    /// The request path: what to do with a request carrying `key` whose
    /// [`fingerprint`](crate::fingerprint) is `fingerprint`, at `now` — the
    /// same decisions as [`IdempotencyKeys::begin`](crate::IdempotencyKeys::begin):
    /// [`Begin::Proceed`] (a new key, an expired response, or a takeover of
    /// an ended lease, fencing out the old holder), [`Begin::Replay`],
    /// [`Begin::Mismatch`] or [`Begin::InFlight`]. Answers that write
    /// nothing come from one read. Concurrent `begin`s on a free key, in any
    /// processes, get exactly one `Proceed`.
    pub fn begin(
        &self,
        tenant: &str,
        key: &str,
        fingerprint: &str,
        now: DateTime<Utc>,
    ) -> Result<Begin> {
        check_begin(tenant, key, fingerprint)?;
        wait(self.begin_here(tenant, key, fingerprint, now, in_write()))
    }

    /// [`PgIdempotencyKeys::begin`], awaited. The call runs as a task of
    /// the store's runtime, to its end whatever becomes of this future:
    /// dropped before the answer, a reservation it made is released there
    /// and then (fenced: it frees only that reservation), so a dropped
    /// `begin_async` never leaves the key held.
    pub async fn begin_async(
        &self,
        tenant: &str,
        key: &str,
        fingerprint: &str,
        now: DateTime<Utc>,
    ) -> Result<Begin> {
        check_begin(tenant, key, fingerprint)?;
        let (this, reentrant) = (self.clone(), in_write());
        let (tenant, key, fingerprint) =
            (tenant.to_owned(), key.to_owned(), fingerprint.to_owned());
        let (answer, answered) = tokio::sync::oneshot::channel();
        self.server.handle.spawn(async move {
            let began = this
                .begin_here(&tenant, &key, &fingerprint, now, reentrant)
                .await;
            if let Err(Ok(Begin::Proceed(r))) = answer.send(began) {
                // Nobody is there to take the reservation: free the key
                // (a failure leaves it to its lease).
                let _ = this.release_async(&r).await;
            }
        });
        // No answer: the store's runtime is gone (the store is closing).
        answered.await.unwrap_or(Err(Error::Closed))
    }

    /// `begin` on this task, its arguments checked by the caller;
    /// `reentrant`: the caller's thread runs a write closure (where a
    /// reservation is refused).
    async fn begin_here(
        &self,
        tenant: &str,
        key: &str,
        fingerprint: &str,
        now: DateTime<Utc>,
        reentrant: bool,
    ) -> Result<Begin> {
        let now_us = micros(now);
        let (expired_before, lease_until_us, lease_until) = self.spans.begin_window(now_us)?;
        let row = run!(self.server, Mode::Read, |conn| {
            self.read(&mut conn.db(), tenant, key, false).await
        })?;
        match decide(row, fingerprint, now_us, expired_before) {
            Look::Reserve { .. } => {}
            look => return answer(&self.counters, tenant, key, look),
        }
        if reentrant {
            return Err(Error::Reentrant);
        }
        let reservation = Row::Reserved {
            fingerprint: fingerprint.to_owned(),
            fence: 0,
            reserved_at: now_us,
            lease_until: lease_until_us,
        };
        let began = run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |tx| async {
                // Decided again on the locked row; an insert that meets a row
                // committed since is decided again on that one.
                for _ in 0..3 {
                    let old = self.read(tx, tenant, key, true).await?;
                    let exists = old.is_some();
                    let (takeover, expired) = match decide(old, fingerprint, now_us, expired_before)
                    {
                        Look::Reserve { takeover, expired } => (takeover, expired),
                        look => return Ok(Began::Answered(look)),
                    };
                    if let Some(fence) = self
                        .write_fresh(tx, tenant, key, &reservation, exists)
                        .await?
                    {
                        return Ok(Began::Reserved {
                            fence,
                            takeover,
                            expired,
                        });
                    }
                }
                Err(Error::conflict(
                    "the key kept changing while it was reserved",
                ))
            }
            .await)
        })?;
        match began {
            Began::Answered(look) => answer(&self.counters, tenant, key, look),
            Began::Reserved {
                fence,
                takeover,
                expired,
            } => {
                count_reserved(&self.counters, takeover, expired);
                Ok(Begin::Proceed(Reservation::new(
                    tenant.to_owned(),
                    key.to_owned(),
                    fingerprint.to_owned(),
                    fence,
                    now,
                    lease_until,
                )))
            }
        }
    }

    /// The statement of `complete`: the response replaces the reservation
    /// with its fence, and nothing else; and whether, if it did not, the
    /// row already held the response of that reservation (read from the
    /// statement's snapshot, in the same round trip).
    async fn complete_on<C: GenericClient + Sync>(
        &self,
        db: &mut Db<'_, C>,
        r: &Reservation,
        row: &Row,
    ) -> Result<Completion> {
        let Ok(fence) = i64::try_from(r.fence()) else {
            // No reservation holds a fence out of the sequence's range.
            return Ok(Completion::FencedOut);
        };
        let Row::Completed {
            status,
            content_type,
            headers,
            body,
            created_at,
            ..
        } = row
        else {
            return Err(Error::conflict("a reservation is not a response"));
        };
        let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
        let values: Vec<&str> = headers.iter().map(|(_, v)| v.as_str()).collect();
        let s = self.s();
        let params: [&(dyn ToSql + Sync); 9] = [
            &r.tenant().as_bytes(),
            &r.key().as_bytes(),
            &fence,
            created_at,
            &i32::from(*status),
            &content_type.as_deref(),
            &names,
            &values,
            body,
        ];
        let r = db
            .query_one(
                &format!(
                    "WITH done AS (UPDATE {s}.idempotency SET created_at = $4, \
                     lease_until = NULL, status = $5, content_type = $6, header_names = $7, \
                     header_values = $8, body = $9 \
                     WHERE tenant = $1 AND idem_key = $2 AND lease_until IS NOT NULL \
                     AND fence = $3 RETURNING 1) \
                     SELECT EXISTS (SELECT 1 FROM done), \
                     EXISTS (SELECT 1 FROM {s}.idempotency \
                     WHERE tenant = $1 AND idem_key = $2 AND lease_until IS NULL AND fence = $3)"
                ),
                &params,
            )
            .await?;
        let (stored, already): (bool, bool) = (r.try_get(0)?, r.try_get(1)?);
        Ok(match (stored, already) {
            (true, _) => Completion::Stored,
            (false, true) => Completion::AlreadyStored,
            (false, false) => Completion::FencedOut,
        })
    }

    /// Stores `response` for the reservation `r` and ends it; `true` if
    /// stored. `false` if `r` no longer holds the key (taken over, released
    /// or completed already); then nothing is written. `response` must name
    /// `r`'s tenant, key and fingerprint, else [`Error::InvalidInput`]; its
    /// status, headers and body are checked as for [`put`](Self::put). The
    /// stored `created_at` is `now`.
    pub fn complete(
        &self,
        r: &Reservation,
        response: ResponseRecord,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        wait(self.complete_async(r, response, now))
    }

    /// [`PgIdempotencyKeys::complete`], awaited. Dropped once sent, the
    /// response may have been stored (and the reservation ended).
    pub async fn complete_async(
        &self,
        r: &Reservation,
        response: ResponseRecord,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let row = reservation_row(r, response, now, self.server.max_body)?;
        refuse_reentrant()?;
        // One statement: run again only when the server said it did not
        // happen (after a lost answer a second try would find the
        // reservation gone and answer `false` for a stored response).
        let done = run!(self.server, Mode::Statement, |conn| {
            self.complete_on(&mut conn.db(), r, &row).await
        })?;
        count_completion(&self.counters, done);
        Ok(done.stored())
    }

    /// [`complete`](Self::complete) inside the caller's own transaction
    /// (from [`PgStore::write`](super::PgStore::write)), so the response
    /// commits with the handler's own writes, or not at all. If the
    /// caller's transaction rolls back, the key stays reserved by `r`: call
    /// [`release`](Self::release) to let a retry run at once, or let the
    /// lease run out.
    ///
    /// Inside a [`PgStore::write`](super::PgStore::write) closure (or a
    /// `claim_with` effect) the completion is counted
    /// ([`IdempotencyStats::completed`], the
    /// `idemstore_idempotency_completions_total` metric) once that
    /// transaction has committed, and never if it rolls back, as on the
    /// embedded store. On a transaction of a client of your own, whose
    /// commit the store cannot see, it is counted when this call returns.
    pub fn complete_in(
        &self,
        tx: &mut Transaction<'_>,
        r: &Reservation,
        response: ResponseRecord,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        wait(self.complete_in_async(tx.as_async(), r, response, now))
    }

    /// [`PgIdempotencyKeys::complete_in`], awaited, in a transaction of the
    /// async client (a [`PgStore::write_async`](super::PgStore::write_async)
    /// closure's, or your own); the completion is counted when this returns.
    pub async fn complete_in_async(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        r: &Reservation,
        response: ResponseRecord,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let row = reservation_row(r, response, now, self.server.max_body)?;
        let done = self.complete_on(&mut Db::uncached(tx), r, &row).await?;
        if done != Completion::AlreadyStored {
            let counters = self.counters.clone();
            after_commit(move || count_completion(&counters, done));
        }
        Ok(done.stored())
    }

    /// Gives up the reservation `r` (its handler failed and wrote nothing):
    /// the key is free and a retry gets [`Begin::Proceed`]. If `r` no longer
    /// holds the key (taken over, completed, released) nothing changes.
    pub fn release(&self, r: &Reservation) -> Result<()> {
        wait(self.release_async(r))
    }

    /// [`PgIdempotencyKeys::release`], awaited. Dropped once sent, the
    /// reservation may have been given up.
    pub async fn release_async(&self, r: &Reservation) -> Result<()> {
        refuse_reentrant()?;
        let Ok(fence) = i64::try_from(r.fence()) else {
            return Ok(());
        };
        let s = self.s();
        let sql = format!(
            "DELETE FROM {s}.idempotency \
             WHERE tenant = $1 AND idem_key = $2 AND lease_until IS NOT NULL AND fence = $3"
        );
        // Deleting the reservation again is harmless: a lost answer is
        // retried too.
        let n = run!(self.server, Mode::Read, |conn| {
            conn.db()
                .execute(&sql, &[&r.tenant().as_bytes(), &r.key().as_bytes(), &fence])
                .await
        })?;
        if n == 1 {
            bump(&self.counters.released, 1);
        }
        Ok(())
    }

    /// The operator's release, for a reservation whose handler is stuck or
    /// gone: gives up the reservation of `(tenant, key)` if the key still
    /// holds a reservation with fence token `fence` (as
    /// [`KeyEntry::fence`](crate::KeyEntry::fence) lists it), and returns
    /// whether it did — the same rule as
    /// [`IdempotencyKeys::release_key`](crate::IdempotencyKeys::release_key).
    /// A stored response is never deleted and a reservation with another
    /// fence never freed; a holder released while still running has its
    /// [`complete`](Self::complete) return `false`. One statement, run
    /// again only when the server said it did not happen, so the answer is
    /// what the server did (a lost answer is an error, never a wrong
    /// `false`). Counted in [`IdempotencyStats::released`].
    pub fn release_key(&self, tenant: &str, key: &str, fence: u64) -> Result<bool> {
        wait(self.release_key_async(tenant, key, fence))
    }

    /// [`PgIdempotencyKeys::release_key`], awaited. Dropped once sent, the
    /// reservation may have been given up.
    pub async fn release_key_async(&self, tenant: &str, key: &str, fence: u64) -> Result<bool> {
        check_tenant_key(tenant, key)?;
        refuse_reentrant()?;
        let Ok(fence) = i64::try_from(fence) else {
            // No reservation holds a fence out of the sequence's range.
            return Ok(false);
        };
        let s = self.s();
        let sql = format!(
            "DELETE FROM {s}.idempotency \
             WHERE tenant = $1 AND idem_key = $2 AND lease_until IS NOT NULL AND fence = $3"
        );
        let n = run!(self.server, Mode::Statement, |conn| {
            conn.db()
                .execute(&sql, &[&tenant.as_bytes(), &key.as_bytes(), &fence])
                .await
        })?;
        if n == 1 {
            bump(&self.counters.released, 1);
        }
        Ok(n == 1)
    }
}

/// The async calls' futures are `Send`: a check at compile time, never run.
#[cfg(test)]
fn _send(
    k: &PgIdempotencyKeys,
    tx: &tokio_postgres::Transaction<'_>,
    r: &Reservation,
    record: &ResponseRecord,
) {
    fn is_send<T: Send>(_: T) {}
    let now = Utc::now();
    is_send(k.get_async("t", "k", now));
    is_send(k.put_async(record));
    is_send(k.purge_expired_async(now));
    is_send(k.begin_async("t", "k", "f", now));
    is_send(k.complete_async(r, record.clone(), now));
    is_send(k.complete_in_async(tx, r, record.clone(), now));
    is_send(k.release_async(r));
    is_send(k.release_key_async("t", "k", 1));
}
