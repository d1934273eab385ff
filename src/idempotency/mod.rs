//! [`IdempotencyKeys`]: the HTTP `Idempotency-Key` response store.
//!
//! A request carrying an idempotency key calls [`IdempotencyKeys::begin`]
//! with its [`fingerprint`]. The first one gets [`Begin::Proceed`] with a
//! [`Reservation`]: it runs its handler and stores the response with
//! [`IdempotencyKeys::complete`] (or [`IdempotencyKeys::complete_in`], inside
//! the handler's own transaction), or gives the key back with
//! [`IdempotencyKeys::release`] if the handler failed. Every later request
//! with that key gets the stored response ([`Begin::Replay`]), is told the
//! first one is still running ([`Begin::InFlight`], HTTP 409), or that it
//! reuses the key for another request ([`Begin::Mismatch`], HTTP 422).
//!
//! # Layout
//!
//! One row per `(tenant, key)` in the idempotency table (typed tuple keys,
//! so tenants and keys of any bytes, separators and NULs included, never
//! meet), holding either a reservation `{fingerprint, fence, reserved_at,
//! lease_until}` or a completed response `{fingerprint, fence, created_at,
//! status, content type, headers, body}`; and the expiry index
//! `(created_at, tenant, key)`, with `created_at` the reservation time of a
//! reservation. A row exists iff its index entry does
//! ([`IdempotencyKeys::check_indexes`]).
//!
//! # Fencing
//!
//! Every reservation takes a fence token from one store-wide counter (kept
//! in the meta table, so it grows across releases, purges, takeovers and
//! reopens and is never handed out twice). A reservation can be completed or
//! released only while the row still holds a reservation with its token: a
//! holder whose lease ran out and whose key was taken over (or released, or
//! completed by another holder) gets `false` from `complete` and frees
//! nothing with `release`.
//!
//! # Reads stay reads
//!
//! `begin` on a completed key (a replay), a mismatch or an in-flight key is
//! answered from a read transaction: no write, no fsync. Only reserving (a
//! new key, an expired response, a takeover) goes through the commit thread,
//! where the decision is taken again on the state of that moment. `get` on
//! an expired row deletes it the same way; a `get` that finds nothing
//! expired never writes.

mod raw;
mod record;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use redb::{ReadableTable, TableError, TableHandle as _, WriteTransaction};

use crate::codec::{from_micros, micros};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::schema::{IDEM, IDEM_CREATED, META, META_IDEM_NEXT_FENCE};

use raw::{Began, Look, key_name};
pub use record::{
    MAX_CONTENT_TYPE_LEN, MAX_FINGERPRINT_LEN, MAX_HEADER_NAME_LEN, MAX_HEADER_VALUE_LEN,
    MAX_HEADERS, MAX_IDEMPOTENCY_KEY_LEN, MAX_TENANT_LEN, fingerprint,
};
use record::{Row, check_fingerprint, check_key, check_response, check_tenant};

/// Default time a completed response is kept and replayed: 24 hours.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// Default time a reservation holds a key: 60 seconds.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);
/// Longest TTL or lease accepted (longer ones are cut to it): 100 years.
const MAX_SPAN_MICROS: i64 = 100 * 366 * 24 * 60 * 60 * 1_000_000;
/// Rows removed per commit by [`IdempotencyKeys::purge_expired`].
const PURGE_CHUNK: usize = 1024;

/// A stored HTTP response, as [`Begin::Replay`] and
/// [`IdempotencyKeys::get`] return it and [`IdempotencyKeys::put`] stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseRecord {
    /// The tenant (0–255 bytes; `""` is the default tenant).
    pub tenant: String,
    /// The idempotency key (1–255 bytes).
    pub idempotency_key: String,
    /// The [`fingerprint`] of the request that produced the response (1–128
    /// bytes).
    pub request_fingerprint: String,
    /// The HTTP status, 100–599.
    pub response_status: u16,
    /// The `Content-Type`, if any (at most 255 bytes, no control characters).
    pub content_type: Option<String>,
    /// Other headers to replay (at most 64; names are HTTP tokens of at most
    /// 256 bytes, values at most 8 KiB without control characters).
    pub headers: Vec<(String, String)>,
    /// The body (at most the store's `max_body`, default 1 MiB).
    pub response_body: Vec<u8>,
    /// When the response was stored; the TTL runs from here.
    pub created_at: DateTime<Utc>,
}

/// The outcome of [`IdempotencyKeys::begin`]. Each is an expected answer, not
/// an error.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Begin {
    /// The key is now reserved for this request: run the handler, then
    /// [`complete`](IdempotencyKeys::complete) or
    /// [`release`](IdempotencyKeys::release) the reservation.
    Proceed(Reservation),
    /// The key was completed by a request with the same fingerprint: send
    /// this response again, do not run the handler.
    Replay(ResponseRecord),
    /// Another request with the same fingerprint holds the key and has not
    /// finished (HTTP 409 with `Retry-After`); its lease ends at
    /// `lease_until`, after which a retry may take the key over.
    InFlight {
        /// When the holder's lease ends.
        lease_until: DateTime<Utc>,
    },
    /// The key is bound to another request (another fingerprint), whether
    /// completed or still running (HTTP 422): the client reused a key for a
    /// different request.
    Mismatch {
        /// The fingerprint the key is bound to.
        stored_fingerprint: String,
    },
}

/// A request's hold on a key, from [`Begin::Proceed`]. Pass it to
/// [`IdempotencyKeys::complete`], [`IdempotencyKeys::complete_in`] or
/// [`IdempotencyKeys::release`]; it is fenced by a token that no later
/// reservation of any key shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    tenant: String,
    key: String,
    fingerprint: String,
    fence: u64,
    reserved_at: DateTime<Utc>,
    lease_until: DateTime<Utc>,
}

impl Reservation {
    /// The tenant holding the key.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The idempotency key held.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The fingerprint of the request holding the key.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The fence token: store-wide increasing, never reused.
    pub fn fence(&self) -> u64 {
        self.fence
    }

    /// The `now` the reservation was made at.
    pub fn reserved_at(&self) -> DateTime<Utc> {
        self.reserved_at
    }

    /// When the lease ends: from then on another request with the key may
    /// take it over, and this reservation's `complete` returns `false` once
    /// it has.
    pub fn lease_until(&self) -> DateTime<Utc> {
        self.lease_until
    }

    /// A response for this reservation (no content type, no headers), to
    /// fill in and pass to [`IdempotencyKeys::complete`].
    pub fn response(
        &self,
        status: u16,
        body: impl Into<Vec<u8>>,
        created_at: DateTime<Utc>,
    ) -> ResponseRecord {
        ResponseRecord {
            tenant: self.tenant.clone(),
            idempotency_key: self.key.clone(),
            request_fingerprint: self.fingerprint.clone(),
            response_status: status,
            content_type: None,
            headers: Vec::new(),
            response_body: body.into(),
            created_at,
        }
    }
}

/// Counters since the store was opened, shared by every
/// [`IdempotencyKeys`] handle of one store. For metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct IdempotencyStats {
    /// `begin` answered [`Begin::Replay`].
    pub replays: u64,
    /// `begin` answered [`Begin::Mismatch`].
    pub mismatches: u64,
    /// `begin` answered [`Begin::InFlight`].
    pub in_flight: u64,
    /// `begin` answered [`Begin::Proceed`] (takeovers included).
    pub reserved: u64,
    /// Of those, reservations that took over one whose lease had ended.
    pub takeovers: u64,
    /// `complete` / `complete_in` stored a response (for `complete_in`: its
    /// call returned `true`, whether or not the caller's transaction then
    /// committed).
    pub completed: u64,
    /// `complete` / `complete_in` returned `false`: the holder was fenced out.
    pub fenced_out: u64,
    /// `release` freed a key.
    pub released: u64,
    /// `put` stored a record.
    pub stored: u64,
    /// Expired rows deleted by `get` and `begin` (lazily).
    pub expired_deleted: u64,
    /// Rows removed by `purge_expired`.
    pub purged: u64,
}

/// The atomics behind [`IdempotencyStats`]: one set per store.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    replays: AtomicU64,
    mismatches: AtomicU64,
    in_flight: AtomicU64,
    reserved: AtomicU64,
    takeovers: AtomicU64,
    completed: AtomicU64,
    fenced_out: AtomicU64,
    released: AtomicU64,
    stored: AtomicU64,
    expired_deleted: AtomicU64,
    purged: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// One row of [`IdempotencyKeys::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyEntry {
    /// The tenant.
    pub tenant: String,
    /// The idempotency key.
    pub key: String,
    /// The fingerprint the key is bound to.
    pub fingerprint: String,
    /// The fence token of the reservation that wrote the row.
    pub fence: u64,
    /// Completed or reserved.
    pub state: KeyState,
}

/// The state of a key in [`KeyEntry`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyState {
    /// A stored response.
    Completed {
        /// Its HTTP status.
        status: u16,
        /// Its body length in bytes.
        body_len: usize,
        /// When it was stored.
        created_at: DateTime<Utc>,
    },
    /// A reservation (its lease may have ended: the key is then free to be
    /// taken over).
    Reserved {
        /// When it was made.
        reserved_at: DateTime<Utc>,
        /// When its lease ends.
        lease_until: DateTime<Utc>,
    },
}

/// The store's HTTP idempotency-key records. Cheap to clone; clones share the
/// store and its [`IdempotencyStats`].
///
/// Carries a TTL (default [`DEFAULT_TTL`], 24 h) after which `begin` treats a
/// completed response as gone, and a lease (default [`DEFAULT_LEASE`], 60 s)
/// for which a reservation holds its key. Every call validates its inputs
/// before writing: keys are 1–255 bytes, tenants 0–255 bytes, fingerprints
/// 1–128 bytes; bad ones are [`Error::InvalidInput`] or [`Error::TooLarge`]
/// and write nothing.
#[derive(Clone, Debug)]
pub struct IdempotencyKeys {
    engine: Arc<Engine>,
    max_body: usize,
    ttl: Duration,
    lease: Duration,
    counters: Arc<Counters>,
}

fn span_micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).map_or(MAX_SPAN_MICROS, |us| us.min(MAX_SPAN_MICROS))
}

fn time(field: &'static str, at: i64) -> Result<DateTime<Utc>> {
    DateTime::from_timestamp_micros(at)
        .ok_or_else(|| Error::invalid(field, "is too close to the end of representable time"))
}

impl IdempotencyKeys {
    pub(crate) fn new(engine: Arc<Engine>, max_body: usize) -> IdempotencyKeys {
        IdempotencyKeys {
            engine,
            max_body,
            ttl: DEFAULT_TTL,
            lease: DEFAULT_LEASE,
            counters: Arc::default(),
        }
    }

    /// Shares `counters` (the store's) instead of the handle's own.
    pub(crate) fn with_counters(mut self, counters: Arc<Counters>) -> IdempotencyKeys {
        self.counters = counters;
        self
    }

    /// How long `begin` replays a completed response, counted from its
    /// `created_at`. Default: 24 h. After it, the next `begin` with the key
    /// deletes the old response and proceeds as for a new key. (`get` and
    /// `purge_expired` take their cutoff as an argument instead.) Values
    /// over 100 years are cut to 100 years.
    #[must_use]
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long a reservation holds its key. Default: 60 s. There is no
    /// renewal: set it above your slowest handler. After it, another request
    /// with the key may take it over, and the first holder's `complete`
    /// then returns `false`. Values over 100 years are cut to 100 years.
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The TTL `begin` applies.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The lease `begin` grants.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The counters of every handle of this store since it was opened.
    pub fn stats(&self) -> IdempotencyStats {
        let c = &*self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        IdempotencyStats {
            replays: l(&c.replays),
            mismatches: l(&c.mismatches),
            in_flight: l(&c.in_flight),
            reserved: l(&c.reserved),
            takeovers: l(&c.takeovers),
            completed: l(&c.completed),
            fenced_out: l(&c.fenced_out),
            released: l(&c.released),
            stored: l(&c.stored),
            expired_deleted: l(&c.expired_deleted),
            purged: l(&c.purged),
        }
    }

    /// The completed response stored at `(tenant, key)`, if any.
    ///
    /// A record created strictly before `expired_before` counts as absent
    /// and is deleted (one write, only then; a `get` that finds nothing
    /// expired is a plain read). A reservation reads as `None` (there is no
    /// response yet); one made before `expired_before` whose lease ended by
    /// then is deleted too.
    pub fn get(
        &self,
        tenant: &str,
        key: &str,
        expired_before: DateTime<Utc>,
    ) -> Result<Option<ResponseRecord>> {
        check_tenant(tenant)?;
        check_key(key)?;
        let cutoff = micros(expired_before);
        let row = self.read_row(tenant, key)?;
        let row = match row {
            Some(r) if r.expired(cutoff) => {
                let (t, k) = (tenant.to_owned(), key.to_owned());
                let (deleted, now) = self
                    .engine
                    .execute(move |tx| raw::delete_expired(tx, &t, &k, cutoff))?;
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
    /// record was already there (nothing is overwritten: first write wins).
    ///
    /// "Free" means no row, or a row expired as of `record.created_at`: a
    /// response older than the handle's TTL, or a reservation whose lease
    /// ended. A live reservation is **not** overwritten: its holder is still
    /// running, and its own `complete` decides. A stored record replaces an
    /// ended reservation and fences its holder out. For responses produced
    /// under a reservation, use [`complete`](Self::complete) instead.
    pub fn put(&self, record: &ResponseRecord) -> Result<bool> {
        check_tenant(&record.tenant)?;
        check_key(&record.idempotency_key)?;
        check_fingerprint(&record.request_fingerprint)?;
        self.check_record(record)?;
        let row = into_row(record.clone(), 0, record.created_at);
        let expired_before = row.created_at().saturating_sub(span_micros(self.ttl));
        let (t, k) = (record.tenant.clone(), record.idempotency_key.clone());
        let stored = self
            .engine
            .execute(move |tx| raw::put(tx, &t, &k, &row, expired_before))?;
        if stored {
            bump(&self.counters.stored, 1);
        }
        Ok(stored)
    }

    /// Removes every record created strictly before `expired_before` (a
    /// reservation only once its lease has also ended by then) with their
    /// index entries; returns how many. Walks the `created_at` index, so it
    /// costs what it removes, in commits of at most 1024 rows.
    pub fn purge_expired(&self, expired_before: DateTime<Utc>) -> Result<u64> {
        let cutoff = micros(expired_before);
        let mut total = 0;
        let mut cursor: raw::PurgeCursor = None;
        loop {
            let after = cursor.clone();
            let (n, next) = self
                .engine
                .execute(move |tx| raw::purge_chunk(tx, &after, cutoff, PURGE_CHUNK))?;
            total += n;
            bump(&self.counters.purged, n);
            match next {
                Some(c) => cursor = Some(c),
                None => return Ok(total),
            }
        }
    }

    /// The request path: what to do with a request carrying `key` whose
    /// [`fingerprint`] is `fingerprint`, at `now`.
    ///
    /// - no record, or a response older than the TTL → the key is reserved
    ///   until `now + lease`: [`Begin::Proceed`];
    /// - a response with the same fingerprint → [`Begin::Replay`];
    /// - a response or a live reservation with another fingerprint →
    ///   [`Begin::Mismatch`] (the key is bound to its first request from the
    ///   moment it is reserved);
    /// - a live reservation with the same fingerprint → [`Begin::InFlight`];
    /// - a reservation whose lease ended (`lease_until <= now`) → taken
    ///   over: a new [`Begin::Proceed`] whose fence shuts the old holder out.
    ///
    /// Answers that write nothing (replay, mismatch, in flight) come from a
    /// read transaction and cost no commit. Concurrent `begin`s on a free key
    /// get exactly one `Proceed`.
    pub fn begin(
        &self,
        tenant: &str,
        key: &str,
        fingerprint: &str,
        now: DateTime<Utc>,
    ) -> Result<Begin> {
        check_tenant(tenant)?;
        check_key(key)?;
        check_fingerprint(fingerprint)?;
        let now_us = micros(now);
        let expired_before = now_us.saturating_sub(span_micros(self.ttl));
        let lease_until_us = now_us.saturating_add(span_micros(self.lease));
        let lease_until = time("now", lease_until_us)?;
        let row = self.read_row(tenant, key)?;
        match raw::decide(row, fingerprint, now_us, expired_before) {
            Look::Reserve { .. } => {}
            answer => return self.answer(tenant, key, answer),
        }
        let (t, k, f) = (tenant.to_owned(), key.to_owned(), fingerprint.to_owned());
        let began = self.engine.execute(move |tx| {
            raw::begin(tx, &t, &k, &f, now_us, expired_before, lease_until_us)
        })?;
        match began {
            Began::Answered(answer) => self.answer(tenant, key, answer),
            Began::Reserved {
                fence,
                takeover,
                expired,
            } => {
                bump(&self.counters.reserved, 1);
                bump(&self.counters.takeovers, u64::from(takeover));
                bump(&self.counters.expired_deleted, u64::from(expired));
                Ok(Begin::Proceed(Reservation {
                    tenant: tenant.to_owned(),
                    key: key.to_owned(),
                    fingerprint: fingerprint.to_owned(),
                    fence,
                    reserved_at: now,
                    lease_until,
                }))
            }
        }
    }

    fn answer(&self, tenant: &str, key: &str, look: Look) -> Result<Begin> {
        match look {
            Look::Replay(row) => {
                let r = to_response(tenant, key, row)?;
                bump(&self.counters.replays, 1);
                Ok(Begin::Replay(r))
            }
            Look::Mismatch(stored_fingerprint) => {
                bump(&self.counters.mismatches, 1);
                Ok(Begin::Mismatch { stored_fingerprint })
            }
            Look::InFlight(until) => {
                bump(&self.counters.in_flight, 1);
                Ok(Begin::InFlight {
                    lease_until: from_micros(IDEM.name(), &key_name(tenant, key), until)?,
                })
            }
            Look::Reserve { .. } => Err(Error::conflict("the key could not be reserved")),
        }
    }

    /// Stores `response` for the reservation `r` and ends it; `true` if
    /// stored. `false` if `r` no longer holds the key: its lease ended and
    /// another request took the key over, or it was released or completed
    /// already. Then nothing is written.
    ///
    /// `response` must name `r`'s tenant, key and fingerprint
    /// ([`Reservation::response`] builds one), else [`Error::InvalidInput`];
    /// its status, headers and body are checked as for [`put`](Self::put)
    /// (a body over `max_body` is [`Error::TooLarge`]). The stored
    /// `created_at` is `now`: the TTL runs from completion. A holder whose
    /// lease ended but whose key nobody took over may still complete.
    pub fn complete(
        &self,
        r: &Reservation,
        response: ResponseRecord,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let row = self.reservation_row(r, response, now)?;
        let (t, k) = (r.tenant.clone(), r.key.clone());
        let done = self
            .engine
            .execute(move |tx| raw::complete(tx, &t, &k, &row))?;
        self.count_completion(done);
        Ok(done)
    }

    /// [`complete`](Self::complete) inside the caller's own write transaction
    /// (from [`Store::write`](crate::Store::write)), so the response row
    /// commits with the handler's own writes, or not at all: a response is
    /// stored iff the handler's writes committed.
    ///
    /// If the caller's transaction rolls back, the key stays reserved by `r`
    /// (the reservation was committed by `begin`): call
    /// [`release`](Self::release) to let a retry run at once, or let the
    /// lease run out.
    pub fn complete_in(
        &self,
        tx: &WriteTransaction,
        r: &Reservation,
        response: ResponseRecord,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let row = self.reservation_row(r, response, now)?;
        let done = raw::complete(tx, &r.tenant, &r.key, &row)?;
        self.count_completion(done);
        Ok(done)
    }

    fn count_completion(&self, done: bool) {
        if done {
            bump(&self.counters.completed, 1);
        } else {
            bump(&self.counters.fenced_out, 1);
        }
    }

    /// Gives up the reservation `r` (its handler failed and wrote nothing):
    /// the key is free and a retry gets [`Begin::Proceed`]. If `r` no longer
    /// holds the key (taken over, completed, released) nothing changes: a
    /// stale holder never frees a newer holder's reservation nor deletes a
    /// response.
    pub fn release(&self, r: &Reservation) -> Result<()> {
        let (t, k, fence) = (r.tenant.clone(), r.key.clone(), r.fence);
        if self
            .engine
            .execute(move |tx| raw::release(tx, &t, &k, fence))?
        {
            bump(&self.counters.released, 1);
        }
        Ok(())
    }

    /// Up to `limit` rows, completed and reserved, in `(tenant, key)` order;
    /// of one tenant only if `tenant` is given. For inspection tools.
    pub fn list(&self, tenant: Option<&str>, limit: usize) -> Result<Vec<KeyEntry>> {
        if let Some(t) = tenant {
            check_tenant(t)?;
        }
        self.engine.read(|tx| {
            let rows = match tx.open_table(IDEM) {
                Ok(t) => t,
                Err(TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(e.into()),
            };
            let mut out = Vec::new();
            for entry in rows.range((tenant.unwrap_or(""), "")..)? {
                if out.len() >= limit {
                    break;
                }
                let (k, v) = entry?;
                let (t, key) = k.value();
                if tenant.is_some_and(|want| want != t) {
                    break;
                }
                out.push(key_entry(t, key, raw::decode_row(t, key, v.value())?)?);
            }
            Ok(out)
        })
    }

    /// Checks the invariants between the rows and the expiry index: every
    /// row decodes, has its `(created_at, tenant, key)` index entry and a
    /// fence below the store's next one, and every index entry has its row.
    /// Returns one human-readable line per problem; empty when consistent.
    pub fn check_indexes(&self) -> Result<Vec<String>> {
        self.engine.read(|tx| {
            let mut findings = Vec::new();
            let rows = match tx.open_table(IDEM) {
                Ok(t) => Some(t),
                Err(TableError::TableDoesNotExist(_)) => None,
                Err(e) => return Err(Error::from(e)),
            };
            let index = match tx.open_table(IDEM_CREATED) {
                Ok(t) => Some(t),
                Err(TableError::TableDoesNotExist(_)) => None,
                Err(e) => return Err(Error::from(e)),
            };
            let next_fence = match tx.open_table(META) {
                Ok(m) => m.get(META_IDEM_NEXT_FENCE)?.map_or(1, |v| v.value()),
                Err(TableError::TableDoesNotExist(_)) => 1,
                Err(e) => return Err(Error::from(e)),
            };
            if let Some(rows) = &rows {
                for entry in rows.iter()? {
                    let (k, v) = entry?;
                    let (t, key) = k.value();
                    let name = key_name(t, key);
                    let row = match raw::decode_row(t, key, v.value()) {
                        Ok(r) => r,
                        Err(e) => {
                            findings.push(format!("row {name} does not decode: {e}"));
                            continue;
                        }
                    };
                    let at = row.created_at();
                    let indexed = match &index {
                        Some(i) => i.get((at, t, key))?.is_some(),
                        None => false,
                    };
                    if !indexed {
                        findings.push(format!("row {name} has no expiry index entry at {at} µs"));
                    }
                    if row.fence() >= next_fence {
                        findings.push(format!(
                            "row {name} has fence {} but the next fence to hand out is {next_fence}",
                            row.fence()
                        ));
                    }
                }
            }
            if let Some(index) = &index {
                for entry in index.iter()? {
                    let (k, _) = entry?;
                    let (at, t, key) = k.value();
                    let name = key_name(t, key);
                    let row = match &rows {
                        Some(r) => r.get((t, key))?,
                        None => None,
                    };
                    match row {
                        None => findings.push(format!("index entry at {at} µs for {name} has no row")),
                        Some(v) => {
                            if let Ok(row) = raw::decode_row(t, key, v.value())
                                && row.created_at() != at
                            {
                                findings.push(format!(
                                    "index entry at {at} µs for {name}, but the row's created_at is {} µs",
                                    row.created_at()
                                ));
                            }
                        }
                    }
                }
            }
            Ok(findings)
        })
    }

    fn read_row(&self, tenant: &str, key: &str) -> Result<Option<Row>> {
        self.engine.read(|tx| {
            let table = match tx.open_table(IDEM) {
                Ok(t) => t,
                Err(TableError::TableDoesNotExist(_)) => return Ok(None),
                Err(e) => return Err(e.into()),
            };
            raw::read_row(&table, tenant, key)
        })
    }

    /// The row `complete` stores for `r`, after checking `response` fits it.
    fn reservation_row(
        &self,
        r: &Reservation,
        response: ResponseRecord,
        now: DateTime<Utc>,
    ) -> Result<Row> {
        if response.tenant != r.tenant
            || response.idempotency_key != r.key
            || response.request_fingerprint != r.fingerprint
        {
            return Err(Error::invalid(
                "response",
                format!(
                    "it names {} with fingerprint {:?}, but the reservation is for {} with fingerprint {:?}",
                    key_name(&response.tenant, &response.idempotency_key),
                    response.request_fingerprint,
                    key_name(&r.tenant, &r.key),
                    r.fingerprint,
                ),
            ));
        }
        self.check_record(&response)?;
        Ok(into_row(response, r.fence, now))
    }

    /// Checks a response's status, headers and body against the limits.
    fn check_record(&self, record: &ResponseRecord) -> Result<()> {
        check_response(
            record.response_status,
            record.content_type.as_deref(),
            &record.headers,
            &record.response_body,
            self.max_body,
        )
    }
}

/// The completed row for `record` (already checked); `created_at` is `at`.
fn into_row(record: ResponseRecord, fence: u64, at: DateTime<Utc>) -> Row {
    Row::Completed {
        fingerprint: record.request_fingerprint,
        fence,
        created_at: micros(at),
        status: record.response_status,
        content_type: record.content_type,
        headers: record.headers,
        body: record.response_body,
    }
}

fn to_response(tenant: &str, key: &str, row: Row) -> Result<ResponseRecord> {
    match row {
        Row::Completed {
            fingerprint,
            created_at,
            status,
            content_type,
            headers,
            body,
            ..
        } => Ok(ResponseRecord {
            tenant: tenant.to_owned(),
            idempotency_key: key.to_owned(),
            request_fingerprint: fingerprint,
            response_status: status,
            content_type,
            headers,
            response_body: body,
            created_at: from_micros(IDEM.name(), &key_name(tenant, key), created_at)?,
        }),
        Row::Reserved { .. } => Err(Error::conflict(
            "the key holds a reservation, not a response",
        )),
    }
}

fn key_entry(tenant: &str, key: &str, row: Row) -> Result<KeyEntry> {
    let name = key_name(tenant, key);
    let at = |us| from_micros(IDEM.name(), &name, us);
    let fence = row.fence();
    let (fingerprint, state) = match row {
        Row::Completed {
            fingerprint,
            created_at,
            status,
            body,
            ..
        } => (
            fingerprint,
            KeyState::Completed {
                status,
                body_len: body.len(),
                created_at: at(created_at)?,
            },
        ),
        Row::Reserved {
            fingerprint,
            reserved_at,
            lease_until,
            ..
        } => (
            fingerprint,
            KeyState::Reserved {
                reserved_at: at(reserved_at)?,
                lease_until: at(lease_until)?,
            },
        ),
    };
    Ok(KeyEntry {
        tenant: tenant.to_owned(),
        key: key.to_owned(),
        fingerprint,
        fence,
        state,
    })
}
