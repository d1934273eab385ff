//! Idempotency keys: the HTTP `Idempotency-Key` response store, so that a
//! retried request is answered from the store instead of running twice.
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
//! Keys are kept per tenant. With the `middleware` feature,
//! `middleware::IdempotencyLayer` does all of this in front of any tower
//! service.
//!
//! ```
//! use idemstore::chrono::Utc;
//! use idemstore::{Begin, Store, fingerprint};
//!
//! let store = Store::in_memory()?;
//! let keys = store.idempotency_keys(); // TTL 24 h, lease 60 s: .with_ttl(..), .with_lease(..)
//! let fp = fingerprint("POST", "/payments", br#"{"amount":42}"#);
//! match keys.begin("tenant-a", "7c1f-key", &fp, Utc::now())? {
//!     Begin::Proceed(reservation) => {
//!         // Run the handler, then store its response (or `release` on failure).
//!         let response = reservation.response(201, br#"{"id":"pay_1"}"#.to_vec(), Utc::now());
//!         keys.complete(&reservation, response, Utc::now())?;
//!     }
//!     Begin::Replay(_stored) => { /* answer with the stored response */ }
//!     Begin::InFlight { lease_until: _ } => { /* 409, Retry-After */ }
//!     Begin::Mismatch { .. } => { /* 422: the key was used for another request */ }
//! }
//! // The same request again is answered from the store.
//! assert!(matches!(keys.begin("tenant-a", "7c1f-key", &fp, Utc::now())?, Begin::Replay(_)));
//! # Ok::<_, idemstore::Error>(())
//! ```
//!
//! # In the handler's transaction
//!
//! [`IdempotencyKeys::complete_in`] stores the response inside the
//! handler's own [`Store::write`](crate::Store::write), with its rows: a
//! response exists if and only if the handler's writes committed, so a
//! crash between the two cannot make a retry run the handler again. A
//! handler that crashed does not block its key past its lease; the request
//! that takes it over [fences](#fencing) the old holder out.
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
//! answered from a read transaction: no write. It costs no fsync of its own,
//! except when the row it read was written by a commit not yet durable: the
//! answer then waits for that commit's fsync (queuing one empty durable
//! commit if none is on its way), so nothing is answered from state a crash
//! could undo. Only reserving (a
//! new key, an expired response, a takeover) goes through a group-committed write,
//! where the decision is taken again on the state of that moment. `get` on
//! an expired row deletes it the same way; a `get` that finds nothing
//! expired never writes.

mod inspect;
mod ops;
mod record;
pub(crate) mod rules;
#[cfg(feature = "tokio")]
mod tasks;
mod types;

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use redb::WriteTransaction;

use crate::codec::micros;
use crate::engine::{Engine, after_commit};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::schema::{IDEM, open_read};

use ops::Began;
use record::read_row;
use rules::{
    Completion, Look, Row, Spans, check_begin, check_put, check_tenant_key, into_row,
    reservation_row, to_response,
};
pub use rules::{
    MAX_CONTENT_TYPE_LEN, MAX_FINGERPRINT_LEN, MAX_HEADER_NAME_LEN, MAX_HEADER_VALUE_LEN,
    MAX_HEADERS, MAX_IDEMPOTENCY_KEY_LEN, MAX_TENANT_LEN, fingerprint,
};
pub use types::{
    Begin, IdempotencyStats, KeyEntry, KeyState, KeySummary, Reservation, ResponseRecord,
};
pub(crate) use types::{Counters, answer, bump, count_completion, count_reserved};

/// Default time a completed response is kept and replayed: 24 hours.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// Default time a reservation holds a key: 60 seconds.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);
/// Rows removed per commit by [`IdempotencyKeys::purge_expired`].
pub(crate) const PURGE_CHUNK: usize = 1024;

/// The store's HTTP idempotency-key records. Cheap to clone; clones share the
/// store and its [`IdempotencyStats`].
///
/// Carries a TTL (default [`DEFAULT_TTL`], 24 h) after which `begin` treats a
/// completed response as gone, and a lease (default [`DEFAULT_LEASE`], 60 s)
/// for which a reservation holds its key. Every call validates its inputs
/// before writing: keys are 1–255 bytes, tenants 0–255 bytes, fingerprints
/// 1–128 bytes; bad ones are [`Error::InvalidInput`] or [`Error::TooLarge`]
/// and write nothing.
///
/// ```
/// use chrono::Utc;
/// use idemstore::{Begin, Store, fingerprint};
///
/// # let dir = tempfile::tempdir().unwrap();
/// let store = Store::open(dir.path().join("api.idem"))?;
/// let keys = store.idempotency_keys();
/// let fp = fingerprint("POST", "/orders", b"{\"sku\":42}");
///
/// // The first request with the key runs the handler and stores its response.
/// let Begin::Proceed(r) = keys.begin("acme", "key-1", &fp, Utc::now())? else { unreachable!() };
/// let response = r.response(201, b"{\"order\":7}".to_vec(), Utc::now());
/// assert!(keys.complete(&r, response, Utc::now())?);
///
/// // A retry gets the same response, from a read.
/// match keys.begin("acme", "key-1", &fp, Utc::now())? {
///     Begin::Replay(stored) => assert_eq!(stored.response_status, 201),
///     other => panic!("{other:?}"),
/// }
/// // The same key with another body is refused (HTTP 422).
/// let other = fingerprint("POST", "/orders", b"{\"sku\":43}");
/// assert!(matches!(keys.begin("acme", "key-1", &other, Utc::now())?, Begin::Mismatch { .. }));
/// # Ok::<_, idemstore::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct IdempotencyKeys {
    engine: Arc<Engine>,
    max_body: usize,
    spans: Spans,
    counters: Arc<Counters>,
}

impl IdempotencyKeys {
    pub(crate) fn new(engine: Arc<Engine>, max_body: usize) -> IdempotencyKeys {
        IdempotencyKeys {
            engine,
            max_body,
            spans: Spans::default(),
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
        self.spans.ttl = ttl;
        self
    }

    /// How long a reservation holds its key. Default: 60 s. There is no
    /// renewal: set it above your slowest handler. After it, another request
    /// with the key may take it over, and the first holder's `complete`
    /// then returns `false`. Values over 100 years are cut to 100 years.
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

    /// The counters of every handle of this store since it was opened.
    pub fn stats(&self) -> IdempotencyStats {
        self.counters.stats()
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
        check_tenant_key(tenant, key)?;
        let cutoff = micros(expired_before);
        let row = match self.read_row(tenant, key)? {
            Some(r) if r.expired(cutoff) => {
                let deleted = self
                    .engine
                    .execute(delete_expired_op(tenant, key, cutoff))?;
                self.expired_deleted(deleted)
            }
            other => other,
        };
        completed_response(tenant, key, row)
    }

    /// What is at a key once `get`'s delete of its expired row committed
    /// (counted if it deleted).
    fn expired_deleted(&self, (deleted, now): (bool, Option<Row>)) -> Option<Row> {
        if deleted {
            bump(&self.counters.expired_deleted, 1);
        }
        now
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
        let stored = self.engine.execute(self.put_op(record)?)?;
        Ok(self.stored(stored))
    }

    /// `put`'s checks, and its operation.
    fn put_op(
        &self,
        record: &ResponseRecord,
    ) -> Result<impl Fn(&WriteTransaction) -> Result<bool> + Send + 'static> {
        check_put(record, self.max_body)?;
        let row = into_row(record.clone(), 0, record.created_at);
        let expired_before = self.spans.expired_before(row.created_at());
        let (t, k) = (record.tenant.clone(), record.idempotency_key.clone());
        Ok(move |tx: &WriteTransaction| ops::put(tx, &t, &k, &row, expired_before))
    }

    /// What `put` answers once its operation committed (counted if stored).
    fn stored(&self, stored: bool) -> bool {
        if stored {
            bump(&self.counters.stored, 1);
        }
        stored
    }

    /// Removes every record created strictly before `expired_before` (a
    /// reservation only once its lease has also ended by then) with their
    /// index entries; returns how many. Walks the `created_at` index, so it
    /// costs what it removes, in commits of at most 1024 rows.
    pub fn purge_expired(&self, expired_before: DateTime<Utc>) -> Result<u64> {
        let cutoff = micros(expired_before);
        let mut total = 0;
        let mut cursor: ops::PurgeCursor = None;
        loop {
            let (n, next) = self.engine.execute(purge_op(cursor.clone(), cutoff))?;
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
        check_begin(tenant, key, fingerprint)?;
        let now_us = micros(now);
        let (expired_before, lease_until_us, lease_until) = self.spans.begin_window(now_us)?;
        let row = self.read_row(tenant, key)?;
        match rules::decide(row, fingerprint, now_us, expired_before) {
            Look::Reserve { .. } => {}
            answer => return self.answer(tenant, key, answer),
        }
        let (t, k, f) = (tenant.to_owned(), key.to_owned(), fingerprint.to_owned());
        let began = self.engine.execute(move |tx| {
            ops::begin(tx, &t, &k, &f, now_us, expired_before, lease_until_us)
        })?;
        self.began(tenant, key, fingerprint, (now, lease_until), began)
    }

    /// `begin`'s answer once its operation ran: `began`, for the request
    /// `(tenant, key, fingerprint)` at `now` with a lease to `lease_until`.
    fn began(
        &self,
        tenant: &str,
        key: &str,
        fingerprint: &str,
        (now, lease_until): (DateTime<Utc>, DateTime<Utc>),
        began: Began,
    ) -> Result<Begin> {
        match began {
            Began::Answered(answer) => self.answer(tenant, key, answer),
            Began::Reserved {
                fence,
                takeover,
                expired,
            } => {
                count_reserved(&self.counters, takeover, expired);
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
        answer(&self.counters, tenant, key, look)
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
            .execute(move |tx| ops::complete(tx, &t, &k, &row))?;
        count_completion(&self.counters, done);
        Ok(done.stored())
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
    ///
    /// The completion is counted ([`IdempotencyStats::completed`], the
    /// `idemstore_idempotency_completions_total` metric) once the caller's
    /// transaction has committed (durably, under the default durability),
    /// and never if it rolls back.
    pub fn complete_in(
        &self,
        tx: &WriteTransaction,
        r: &Reservation,
        response: ResponseRecord,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let row = self.reservation_row(r, response, now)?;
        let done = ops::complete(tx, &r.tenant, &r.key, &row)?;
        if done != Completion::AlreadyStored {
            // Counted once the caller's transaction commits, never if it
            // rolls back.
            let counters = self.counters.clone();
            after_commit(move || count_completion(&counters, done));
        }
        Ok(done.stored())
    }

    /// Gives up the reservation `r` (its handler failed and wrote nothing):
    /// the key is free and a retry gets [`Begin::Proceed`]. If `r` no longer
    /// holds the key (taken over, completed, released) nothing changes: a
    /// stale holder never frees a newer holder's reservation nor deletes a
    /// response.
    pub fn release(&self, r: &Reservation) -> Result<()> {
        let released = self
            .engine
            .execute(release_op(&r.tenant, &r.key, r.fence))?;
        self.released(released);
        Ok(())
    }

    /// The operator's release, for a reservation whose handler is stuck or
    /// gone (its process died, or it hangs past any use): gives up the
    /// reservation of `(tenant, key)` if the key still holds a reservation
    /// with fence token `fence` (as [`KeyEntry::fence`] lists it), and
    /// returns whether it did. Then the key is free and the next request
    /// with it gets [`Begin::Proceed`] at once, without waiting for the
    /// lease to end.
    ///
    /// Anything else at the key is left as it is and the answer is `false`:
    /// a stored response is never deleted, and a reservation with another
    /// fence (a newer holder's, after a takeover or a release and a new
    /// `begin`) is never freed, so an operator acting on what a stale page
    /// showed changes nothing. If the released holder is in fact still
    /// running, its [`complete`](Self::complete) returns `false` and stores
    /// nothing: a retry of its request runs the handler again. A release
    /// is counted in [`IdempotencyStats::released`], as
    /// [`release`](Self::release)'s are. `tenant` and `key` are checked
    /// as for [`begin`](Self::begin).
    pub fn release_key(&self, tenant: &str, key: &str, fence: u64) -> Result<bool> {
        check_tenant_key(tenant, key)?;
        let released = self.engine.execute(release_op(tenant, key, fence))?;
        Ok(self.released(released))
    }

    /// What a release answers once its operation committed (counted if it
    /// released).
    fn released(&self, released: bool) -> bool {
        if released {
            bump(&self.counters.released, 1);
        }
        released
    }

    pub(super) fn read_row(&self, tenant: &str, key: &str) -> Result<Option<Row>> {
        self.engine.read(|tx| row_in(tx, tenant, key))
    }

    /// The row `complete` stores for `r`, after checking `response` fits it.
    fn reservation_row(
        &self,
        r: &Reservation,
        response: ResponseRecord,
        now: DateTime<Utc>,
    ) -> Result<Row> {
        reservation_row(r, response, now, self.max_body)
    }
}

/// The completed response in `row` (of `(tenant, key)`), if it holds one.
fn completed_response(tenant: &str, key: &str, row: Option<Row>) -> Result<Option<ResponseRecord>> {
    match row {
        Some(r @ Row::Completed { .. }) => to_response(tenant, key, r).map(Some),
        _ => Ok(None),
    }
}

/// The operation deleting the row of `(tenant, key)` if it is (still)
/// expired at `cutoff` (µs): whether it did, and what is there afterwards.
fn delete_expired_op(
    tenant: &str,
    key: &str,
    cutoff: i64,
) -> impl Fn(&WriteTransaction) -> Result<(bool, Option<Row>)> + Send + 'static {
    let (t, k) = (tenant.to_owned(), key.to_owned());
    move |tx: &WriteTransaction| ops::delete_expired(tx, &t, &k, cutoff)
}

/// The operation purging one chunk of the rows expired at `cutoff` (µs),
/// from `after`: how many, and where to go on.
fn purge_op(
    after: ops::PurgeCursor,
    cutoff: i64,
) -> impl Fn(&WriteTransaction) -> Result<(u64, ops::PurgeCursor)> + Send + 'static {
    move |tx: &WriteTransaction| ops::purge_chunk(tx, &after, cutoff, PURGE_CHUNK)
}

/// The operation releasing the reservation of `(tenant, key)` fenced by
/// `fence`: whether it released it.
fn release_op(
    tenant: &str,
    key: &str,
    fence: u64,
) -> impl Fn(&WriteTransaction) -> Result<bool> + Send + 'static {
    let (t, k) = (tenant.to_owned(), key.to_owned());
    move |tx: &WriteTransaction| ops::release(tx, &t, &k, fence)
}

/// The row of `(tenant, key)` as `tx` sees it.
pub(super) fn row_in(tx: &redb::ReadTransaction, tenant: &str, key: &str) -> Result<Option<Row>> {
    match open_read(tx, IDEM)? {
        Some(table) => read_row(&table, tenant, key),
        None => Ok(None),
    }
}
