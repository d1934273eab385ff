//! The public data types of the idempotency-key store and the counters
//! behind [`IdempotencyStats`].

use std::sync::atomic::{AtomicU64, Ordering};

use chrono::{DateTime, Utc};

use super::rules::{Completion, Look, row_time, to_response};
use crate::error::{Error, Result};
use crate::observe::{self, Idempotency as Outcome};

/// A stored HTTP response, as [`Begin::Replay`] and
/// [`IdempotencyKeys::get`](crate::IdempotencyKeys::get) return it and [`IdempotencyKeys::put`](crate::IdempotencyKeys::put) stores it.
///
/// Built with [`ResponseRecord::new`] and its setters (the fields are
/// readable, and set only through them, so that fields added later get
/// their defaults):
///
/// ```
/// # use idemstore::chrono::Utc;
/// use idemstore::ResponseRecord;
///
/// let record = ResponseRecord::new("", "7c1f-key", "fp", 201, b"{\"id\":1}".to_vec(), Utc::now())
///     .content_type("application/json")
///     .header("location", "/payments/1");
/// assert_eq!(record.headers, [("location".to_owned(), "/payments/1".to_owned())]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ResponseRecord {
    /// The tenant (0–255 bytes; `""` is the default tenant).
    pub tenant: String,
    /// The idempotency key (1–255 bytes).
    pub idempotency_key: String,
    /// The [`fingerprint`](crate::fingerprint) of the request that produced the response (1–128
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

impl ResponseRecord {
    /// A response of status `response_status` with body `response_body`,
    /// stored at `created_at` under `(tenant, idempotency_key)` for the
    /// request of fingerprint `request_fingerprint`; no `Content-Type` and
    /// no other headers until set. The store checks the values when it
    /// stores the record (see the fields).
    pub fn new(
        tenant: impl Into<String>,
        idempotency_key: impl Into<String>,
        request_fingerprint: impl Into<String>,
        response_status: u16,
        response_body: Vec<u8>,
        created_at: DateTime<Utc>,
    ) -> Self {
        ResponseRecord {
            tenant: tenant.into(),
            idempotency_key: idempotency_key.into(),
            request_fingerprint: request_fingerprint.into(),
            response_status,
            content_type: None,
            headers: Vec::new(),
            response_body,
            created_at,
        }
    }

    /// The `Content-Type` to replay. Default: none.
    #[must_use]
    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = Some(content_type.into());
        self
    }

    /// Adds a header to replay, after those already set. Default: no
    /// headers.
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The headers to replay, in place of those already set, as `(name,
    /// value)` pairs. Default: no headers.
    #[must_use]
    pub fn headers<N, V>(mut self, headers: impl IntoIterator<Item = (N, V)>) -> Self
    where
        N: Into<String>,
        V: Into<String>,
    {
        self.headers = headers
            .into_iter()
            .map(|(n, v)| (n.into(), v.into()))
            .collect();
        self
    }
}

/// The outcome of [`IdempotencyKeys::begin`](crate::IdempotencyKeys::begin). Each is an expected answer, not
/// an error.
///
/// A closed set: the idempotency decision — run the handler, replay, wait
/// (409) or refuse (422). Match it exhaustively.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Begin {
    /// The key is now reserved for this request: run the handler, then
    /// [`complete`](crate::IdempotencyKeys::complete) or
    /// [`release`](crate::IdempotencyKeys::release) the reservation.
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
/// [`IdempotencyKeys::complete`](crate::IdempotencyKeys::complete), [`IdempotencyKeys::complete_in`](crate::IdempotencyKeys::complete_in) or
/// [`IdempotencyKeys::release`](crate::IdempotencyKeys::release); it is fenced by a token that no later
/// reservation of any key shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub(super) tenant: String,
    pub(super) key: String,
    pub(super) fingerprint: String,
    pub(super) fence: u64,
    pub(super) reserved_at: DateTime<Utc>,
    pub(super) lease_until: DateTime<Utc>,
}

impl Reservation {
    /// A reservation of `(tenant, key)` for a request with `fingerprint`,
    /// fenced by `fence`, made at `reserved_at` until `lease_until` (for a
    /// backend that stores reservations elsewhere).
    #[cfg(feature = "postgres")]
    pub(crate) fn new(
        tenant: String,
        key: String,
        fingerprint: String,
        fence: u64,
        reserved_at: DateTime<Utc>,
        lease_until: DateTime<Utc>,
    ) -> Reservation {
        Reservation {
            tenant,
            key,
            fingerprint,
            fence,
            reserved_at,
            lease_until,
        }
    }

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
    /// fill in and pass to [`IdempotencyKeys::complete`](crate::IdempotencyKeys::complete).
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

/// Rows of the idempotency-key store by kind ([`IdempotencyKeys::summary`](crate::IdempotencyKeys::summary)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct KeySummary {
    /// Stored responses.
    pub completed: u64,
    /// Reservations: handlers in flight, or whose holder died before its
    /// lease ended.
    pub reserved: u64,
    /// The oldest row's `created_at` (a reservation's is its reservation
    /// time), `None` when there are no rows.
    pub oldest: Option<DateTime<Utc>>,
}

/// Counters since the store was opened, shared by every
/// [`IdempotencyKeys`](crate::IdempotencyKeys) handle of one store. For metrics.
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
    /// `complete` / `complete_in` stored a response (for `complete_in`:
    /// counted once the caller's transaction commits, never if it rolls
    /// back; see [`IdempotencyKeys::complete_in`](crate::IdempotencyKeys::complete_in)).
    pub completed: u64,
    /// `complete` / `complete_in` returned `false` because another holder
    /// took the key over (or it was released): the holder was fenced out,
    /// and its lease is shorter than its handler. A `complete` that finds
    /// the response its own reservation already stored (the
    /// `IdempotencyLayer`'s after a handler's `complete_in`) returns `false`
    /// too but is not counted: nobody was fenced out.
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
    pub(crate) replays: AtomicU64,
    pub(crate) mismatches: AtomicU64,
    pub(crate) in_flight: AtomicU64,
    pub(crate) reserved: AtomicU64,
    pub(crate) takeovers: AtomicU64,
    pub(crate) completed: AtomicU64,
    pub(crate) fenced_out: AtomicU64,
    pub(crate) released: AtomicU64,
    pub(crate) stored: AtomicU64,
    pub(crate) expired_deleted: AtomicU64,
    pub(crate) purged: AtomicU64,
}

impl Counters {
    /// What the counters say now.
    pub(crate) fn stats(&self) -> IdempotencyStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        IdempotencyStats {
            replays: l(&self.replays),
            mismatches: l(&self.mismatches),
            in_flight: l(&self.in_flight),
            reserved: l(&self.reserved),
            takeovers: l(&self.takeovers),
            completed: l(&self.completed),
            fenced_out: l(&self.fenced_out),
            released: l(&self.released),
            stored: l(&self.stored),
            expired_deleted: l(&self.expired_deleted),
            purged: l(&self.purged),
        }
    }
}

pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// One row of [`IdempotencyKeys::list`](crate::IdempotencyKeys::list).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
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
///
/// A closed set: a key holds a stored response or a reservation. Match it
/// exhaustively.
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

/// `begin`'s answer `look` about `(tenant, key)`, counted in `counters` and
/// reported: a replay, a mismatch or a key in flight.
pub(crate) fn answer(counters: &Counters, tenant: &str, key: &str, look: Look) -> Result<Begin> {
    match look {
        Look::Replay(row) => {
            let r = to_response(tenant, key, row)?;
            bump(&counters.replays, 1);
            observe::idempotency(Outcome::Replay);
            Ok(Begin::Replay(r))
        }
        Look::Mismatch(stored_fingerprint) => {
            bump(&counters.mismatches, 1);
            observe::idempotency(Outcome::Mismatch);
            Ok(Begin::Mismatch { stored_fingerprint })
        }
        Look::InFlight(until) => {
            bump(&counters.in_flight, 1);
            observe::idempotency(Outcome::InFlight);
            Ok(Begin::InFlight {
                lease_until: row_time(tenant, key, until)?,
            })
        }
        Look::Reserve { .. } => Err(Error::conflict("the key could not be reserved")),
    }
}

/// Counts and reports a reservation `begin` made: a takeover of an ended
/// lease, or one replacing an expired response, or a new key.
pub(crate) fn count_reserved(counters: &Counters, takeover: bool, expired: bool) {
    bump(&counters.reserved, 1);
    bump(&counters.takeovers, u64::from(takeover));
    bump(&counters.expired_deleted, u64::from(expired));
    observe::idempotency(if takeover {
        Outcome::Takeover
    } else {
        Outcome::Proceed
    });
}

/// Counts and reports a `complete`: one that stored, or was fenced out. One
/// that found its own response already stored (a repeat, such as the
/// `IdempotencyLayer`'s own `complete` after a handler's `complete_in`) is
/// neither, and counts nothing.
pub(crate) fn count_completion(counters: &Counters, done: Completion) {
    match done {
        Completion::Stored => {
            bump(&counters.completed, 1);
            observe::idempotency(Outcome::Stored);
        }
        Completion::FencedOut => {
            bump(&counters.fenced_out, 1);
            observe::idempotency(Outcome::FencedOut);
        }
        Completion::AlreadyStored => {}
    }
}
