//! The public data types of the idempotency-key store and the counters
//! behind [`IdempotencyStats`].

use std::sync::atomic::{AtomicU64, Ordering};

use chrono::{DateTime, Utc};

use super::record::{Row, row_time};
use crate::error::{Error, Result};

/// A stored HTTP response, as [`Begin::Replay`] and
/// [`IdempotencyKeys::get`](crate::IdempotencyKeys::get) return it and [`IdempotencyKeys::put`](crate::IdempotencyKeys::put) stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
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

/// The outcome of [`IdempotencyKeys::begin`](crate::IdempotencyKeys::begin). Each is an expected answer, not
/// an error.
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

/// What a `complete` did: the one decision both backends take on the row
/// they find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Completion {
    /// The reservation held the key: its response is stored.
    Stored,
    /// The key already holds the response stored under this very
    /// reservation (its handler stored it with `complete_in`): a repeat,
    /// nothing written, nobody fenced out.
    AlreadyStored,
    /// The reservation no longer held the key (taken over by a newer one,
    /// released, or the row is gone): nothing written.
    FencedOut,
}

impl Completion {
    /// The answer for a `complete` under `fence` that found `row`, which is
    /// not the reservation with that fence.
    pub(crate) fn of(row: &super::record::Row, fence: u64) -> Completion {
        match row {
            super::record::Row::Completed { fence: f, .. } if *f == fence => {
                Completion::AlreadyStored
            }
            _ => Completion::FencedOut,
        }
    }

    /// Whether the response was stored by this call (what `complete`
    /// returns).
    pub(crate) fn stored(self) -> bool {
        self == Completion::Stored
    }
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

pub(crate) fn to_response(tenant: &str, key: &str, row: Row) -> Result<ResponseRecord> {
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
            created_at: row_time(tenant, key, created_at)?,
        }),
        Row::Reserved { .. } => Err(Error::conflict(
            "the key holds a reservation, not a response",
        )),
    }
}

pub(crate) fn key_entry(tenant: &str, key: &str, row: Row) -> Result<KeyEntry> {
    let at = |us| row_time(tenant, key, us);
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
