//! The idempotency keys' rules, apart from any storage: the value a row
//! holds ([`Row`]), the request path's decision ([`decide`]), fencing
//! ([`Completion`]), expiry, the TTL and lease windows ([`Spans`]), and the
//! checks of every input. Pure functions over values: the embedded store
//! calls them on rows it decodes from its table, the PostgreSQL backend on
//! rows it reads from the server.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};

use super::{DEFAULT_LEASE, DEFAULT_TTL, KeyEntry, KeyState, Reservation, ResponseRecord};
use crate::codec::{from_micros, micros};
use crate::error::{Error, Result, check_len};

/// The name errors give the idempotency rows (the embedded store's table).
pub(crate) const RECORDS: &str = "idemstore.v1.idempotency";

/// Default largest stored response body (and outbox payload): 1 MiB. Both
/// backends' builders start from it (`max_body`).
pub const DEFAULT_MAX_BODY: usize = 1024 * 1024;

/// Longest idempotency key accepted, in bytes (keys are 1–255 bytes).
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;
/// Longest tenant accepted, in bytes (tenants are 0–255 bytes; `""` is the
/// default tenant of a single-tenant service).
pub const MAX_TENANT_LEN: usize = 255;
/// Longest request fingerprint accepted, in bytes.
pub const MAX_FINGERPRINT_LEN: usize = 128;
/// Longest stored `Content-Type`, in bytes.
pub const MAX_CONTENT_TYPE_LEN: usize = 255;
/// Longest stored header name, in bytes.
pub const MAX_HEADER_NAME_LEN: usize = 256;
/// Longest stored header value, in bytes.
pub const MAX_HEADER_VALUE_LEN: usize = 8 * 1024;
/// Most headers stored with one response.
pub const MAX_HEADERS: usize = 64;

/// Longest TTL or lease accepted (longer ones are cut to it): 100 years.
pub(crate) const MAX_SPAN_MICROS: i64 = 100 * 366 * 24 * 60 * 60 * 1_000_000;

/// One row of the idempotency store, as the rules see it (times µs). How a
/// backend stores it is its own business (the embedded store's encoding is
/// in `record.rs`). The tenant and the key are the row's key and are not
/// repeated here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Row {
    /// A request holds the key and its handler runs.
    Reserved {
        fingerprint: String,
        fence: u64,
        reserved_at: i64,
        lease_until: i64,
    },
    /// The handler's response, to replay.
    Completed {
        fingerprint: String,
        fence: u64,
        created_at: i64,
        status: u16,
        content_type: Option<String>,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    },
}

impl Row {
    /// The time the row's expiry index entry is filed under.
    pub(crate) fn created_at(&self) -> i64 {
        match self {
            Row::Reserved { reserved_at, .. } => *reserved_at,
            Row::Completed { created_at, .. } => *created_at,
        }
    }

    pub(crate) fn fingerprint(&self) -> &str {
        match self {
            Row::Reserved { fingerprint, .. } | Row::Completed { fingerprint, .. } => fingerprint,
        }
    }

    pub(crate) fn fence(&self) -> u64 {
        match self {
            Row::Reserved { fence, .. } | Row::Completed { fence, .. } => *fence,
        }
    }

    /// Whether the row is the reservation fenced by `fence`: the only row
    /// its holder may complete or release.
    pub(crate) fn is_reserved_by(&self, fence: u64) -> bool {
        matches!(self, Row::Reserved { fence: f, .. } if *f == fence)
    }

    /// Whether the row still holds its key against a `put` at `now`: a
    /// response created at or after `expired_before`, or a reservation
    /// whose lease runs past `now`. A `put` stores its response only where
    /// no row holds the key.
    pub(crate) fn holds_key(&self, now: i64, expired_before: i64) -> bool {
        match self {
            Row::Completed { created_at, .. } => *created_at >= expired_before,
            Row::Reserved { lease_until, .. } => *lease_until > now,
        }
    }

    /// Whether the row counts as gone at `cutoff` (an `expired_before`): a
    /// response created strictly before it, or a reservation made before it
    /// whose lease also ended by then (a live lease is never cut short).
    pub(crate) fn expired(&self, cutoff: i64) -> bool {
        match self {
            Row::Completed { created_at, .. } => *created_at < cutoff,
            Row::Reserved {
                reserved_at,
                lease_until,
                ..
            } => *reserved_at < cutoff && *lease_until <= cutoff,
        }
    }
}

/// How a row's key is printed in errors.
pub(crate) fn key_name(tenant: &str, key: &str) -> String {
    format!("(tenant {tenant:?}, key {key:?})")
}

/// A time stored in the row at `(tenant, key)`, as a `DateTime` (out of
/// range: [`Error::Corrupted`]).
pub(crate) fn row_time(tenant: &str, key: &str, us: i64) -> Result<DateTime<Utc>> {
    from_micros(RECORDS, &key_name(tenant, key), us)
}

/// What `begin` does about the row it found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Look {
    /// Answer without writing.
    Replay(Row),
    Mismatch(String),
    InFlight(i64),
    /// Reserve the key. `takeover`: a reservation whose lease ended is
    /// replaced; `expired`: an expired response is replaced.
    Reserve {
        takeover: bool,
        expired: bool,
    },
}

/// The request path's decision for the row found at a key, given the
/// request's fingerprint, `now` and the TTL cutoff (all µs).
pub(crate) fn decide(row: Option<Row>, fingerprint: &str, now: i64, expired_before: i64) -> Look {
    match row {
        None => Look::Reserve {
            takeover: false,
            expired: false,
        },
        Some(r @ Row::Completed { .. }) => {
            if r.created_at() < expired_before {
                Look::Reserve {
                    takeover: false,
                    expired: true,
                }
            } else if r.fingerprint() == fingerprint {
                Look::Replay(r)
            } else {
                Look::Mismatch(r.fingerprint().to_owned())
            }
        }
        Some(r @ Row::Reserved { lease_until, .. }) => {
            if lease_until <= now {
                Look::Reserve {
                    takeover: true,
                    expired: false,
                }
            } else if r.fingerprint() == fingerprint {
                Look::InFlight(lease_until)
            } else {
                Look::Mismatch(r.fingerprint().to_owned())
            }
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
    pub(crate) fn of(row: &Row, fence: u64) -> Completion {
        match row {
            Row::Completed { fence: f, .. } if *f == fence => Completion::AlreadyStored,
            _ => Completion::FencedOut,
        }
    }

    /// Whether the response was stored by this call (what `complete`
    /// returns).
    pub(crate) fn stored(self) -> bool {
        self == Completion::Stored
    }
}

/// `row` under the fence `new`.
pub(crate) fn with_fence(row: &Row, new: u64) -> Row {
    let mut row = row.clone();
    match &mut row {
        Row::Reserved { fence, .. } | Row::Completed { fence, .. } => *fence = new,
    }
    row
}

/// A TTL or a lease in µs, cut to [`MAX_SPAN_MICROS`].
pub(crate) fn span_micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).map_or(MAX_SPAN_MICROS, |us| us.min(MAX_SPAN_MICROS))
}

/// A time `begin` computed (µs) as a `DateTime`; one past the end of
/// representable time is [`Error::InvalidInput`] about `field`.
pub(crate) fn time(field: &'static str, at: i64) -> Result<DateTime<Utc>> {
    DateTime::from_timestamp_micros(at)
        .ok_or_else(|| Error::invalid(field, "is too close to the end of representable time"))
}

/// The TTL and the lease a handle applies, as both backends' handles keep
/// them (`with_ttl`, `with_lease`), and the windows `begin` and `put`
/// derive from them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Spans {
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
}

impl Default for Spans {
    fn default() -> Spans {
        Spans {
            ttl: DEFAULT_TTL,
            lease: DEFAULT_LEASE,
        }
    }
}

impl Spans {
    /// The TTL cutoff at `now` (µs): a response created before it is gone.
    pub(crate) fn expired_before(&self, now: i64) -> i64 {
        now.saturating_sub(span_micros(self.ttl))
    }

    /// What `begin` at `now` (µs) works with: the TTL cutoff, and the end
    /// of the lease it grants, in µs and as a time (one too close to the
    /// end of representable time is [`Error::InvalidInput`]).
    pub(crate) fn begin_window(&self, now: i64) -> Result<(i64, i64, DateTime<Utc>)> {
        let lease_until_us = now.saturating_add(span_micros(self.lease));
        let lease_until = time("now", lease_until_us)?;
        Ok((self.expired_before(now), lease_until_us, lease_until))
    }
}

/// The row `complete` stores for `r`, after checking `response` fits it and
/// the limits (a body up to `max_body`).
pub(crate) fn reservation_row(
    r: &Reservation,
    response: ResponseRecord,
    now: DateTime<Utc>,
    max_body: usize,
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
    check_record(&response, max_body)?;
    Ok(into_row(response, r.fence, now))
}

/// Checks a response's status, headers and body against the limits (a body
/// up to `max_body`).
pub(crate) fn check_record(record: &ResponseRecord, max_body: usize) -> Result<()> {
    check_response(
        record.response_status,
        record.content_type.as_deref(),
        &record.headers,
        &record.response_body,
        max_body,
    )
}

/// The completed row for `record` (already checked); `created_at` is `at`.
pub(crate) fn into_row(record: ResponseRecord, fence: u64, at: DateTime<Utc>) -> Row {
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

/// The response a completed `row` at `(tenant, key)` holds; a reservation
/// is [`Error::Conflict`].
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

/// How the listing shows `row` at `(tenant, key)`.
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

/// The hex SHA-256 of a request, for [`IdempotencyKeys::begin`](crate::IdempotencyKeys::begin):
/// two requests share a fingerprint only if their method, path-and-query and
/// body are all equal.
///
/// Each field is hashed behind its length (8 bytes, big-endian), so no
/// shifting of bytes between fields gives the same input
/// (`"GET", "/ab", "c"` and `"GET", "/a", "bc"` differ). The result is 64
/// lowercase hex characters. It covers what the request asks for, not who
/// sends it: include anything else that must match (an account, a
/// `Content-Type`) in `path_and_query` or hash it into `body` yourself.
pub fn fingerprint(method: &str, path_and_query: &str, body: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(b"idemstore.fingerprint.v1");
    for field in [method.as_bytes(), path_and_query.as_bytes(), body] {
        h.update((field.len() as u64).to_be_bytes());
        h.update(field);
    }
    let digest = h.finalize();
    let mut out = String::with_capacity(64);
    for b in &digest {
        use std::fmt::Write as _;
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// Checks what `begin` is given: the `(tenant, key)` and the request's
/// fingerprint.
pub(crate) fn check_begin(tenant: &str, key: &str, fingerprint: &str) -> Result<()> {
    check_tenant_key(tenant, key)?;
    check_fingerprint(fingerprint)
}

/// Checks the record `put` is given: its `(tenant, key)`, its fingerprint,
/// and its response against the limits (a body up to `max_body`).
pub(crate) fn check_put(record: &ResponseRecord, max_body: usize) -> Result<()> {
    check_tenant_key(&record.tenant, &record.idempotency_key)?;
    check_fingerprint(&record.request_fingerprint)?;
    check_record(record, max_body)
}

/// Checks the `(tenant, key)` a call names.
pub(crate) fn check_tenant_key(tenant: &str, key: &str) -> Result<()> {
    check_tenant(tenant)?;
    check_key(key)
}

fn check_key(key: &str) -> Result<()> {
    check_len("idempotency key", key, MAX_IDEMPOTENCY_KEY_LEN)
}

pub(crate) fn check_tenant(tenant: &str) -> Result<()> {
    check_at_most("tenant", tenant.len(), MAX_TENANT_LEN)
}

/// Checks a value that may be empty: at most `max` bytes.
fn check_at_most(field: &'static str, len: usize, max: usize) -> Result<()> {
    if len > max {
        return Err(Error::TooLarge { field, len, max });
    }
    Ok(())
}

pub(crate) fn check_fingerprint(fp: &str) -> Result<()> {
    check_len("request fingerprint", fp, MAX_FINGERPRINT_LEN)
}

/// No control characters (CR and LF would split a replayed header).
fn check_header_text(field: &'static str, value: &str) -> Result<()> {
    if let Some(c) = value.chars().find(|c| c.is_control() && *c != '\t') {
        return Err(Error::invalid(
            field,
            format!("contains the control character {c:?}"),
        ));
    }
    Ok(())
}

/// Checks a response before anything is written.
pub(crate) fn check_response(
    status: u16,
    content_type: Option<&str>,
    headers: &[(String, String)],
    body: &[u8],
    max_body: usize,
) -> Result<()> {
    if !(100..=599).contains(&status) {
        return Err(Error::invalid(
            "response status",
            format!("{status} is not an HTTP status (100–599)"),
        ));
    }
    if let Some(ct) = content_type {
        check_len("content type", ct, MAX_CONTENT_TYPE_LEN)?;
        check_header_text("content type", ct)?;
    }
    if headers.len() > MAX_HEADERS {
        return Err(Error::invalid(
            "response headers",
            format!(
                "{} headers, at most {MAX_HEADERS} are stored",
                headers.len()
            ),
        ));
    }
    for (name, value) in headers {
        check_len("header name", name, MAX_HEADER_NAME_LEN)?;
        if let Some(c) = name
            .chars()
            .find(|c| !c.is_ascii_graphic() || matches!(c, ':' | '(' | ')' | ',' | ';' | '"'))
        {
            return Err(Error::invalid(
                "header name",
                format!("{c:?} is not allowed in a header name"),
            ));
        }
        check_at_most("header value", value.len(), MAX_HEADER_VALUE_LEN)?;
        check_header_text("header value", value)?;
    }
    check_at_most("response body", body.len(), max_body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_separates_fields() {
        assert_ne!(
            fingerprint("GET", "/ab", "c".as_bytes()),
            fingerprint("GET", "/a", b"bc")
        );
        assert_ne!(fingerprint("GE", "T/a", b""), fingerprint("GET", "/a", b""));
        assert_eq!(
            fingerprint("POST", "/x", b"1"),
            fingerprint("POST", "/x", b"1")
        );
        assert_eq!(fingerprint("", "", b"").len(), 64);
    }

    #[test]
    fn expiry_never_cuts_a_live_lease() {
        let r = Row::Reserved {
            fingerprint: "f".into(),
            fence: 1,
            reserved_at: 10,
            lease_until: 70,
        };
        assert!(!r.expired(10));
        assert!(!r.expired(69));
        assert!(r.expired(70));
    }

    #[test]
    fn responses_are_checked() {
        let ok =
            |s, ct: Option<&str>, h: &[(String, String)], b: &[u8]| check_response(s, ct, h, b, 4);
        assert!(
            ok(
                200,
                Some("text/plain"),
                &[("x-a".into(), "b".into())],
                b"1234"
            )
            .is_ok()
        );
        assert!(matches!(
            ok(99, None, &[], b""),
            Err(Error::InvalidInput { .. })
        ));
        assert!(matches!(
            ok(600, None, &[], b""),
            Err(Error::InvalidInput { .. })
        ));
        assert!(matches!(
            ok(200, None, &[], b"12345"),
            Err(Error::TooLarge { .. })
        ));
        assert!(ok(200, Some("a\r\nb"), &[], b"").is_err());
        assert!(ok(200, None, &[("a b".into(), "x".into())], b"").is_err());
        assert!(ok(200, None, &[("a".into(), "x\ny".into())], b"").is_err());
        assert!(ok(200, None, &[(String::new(), "x".into())], b"").is_err());
    }
}
