//! What an idempotency row holds and how it is read, input limits, and the
//! request fingerprint.

use chrono::{DateTime, Utc};
use redb::{ReadableTable, TableHandle as _};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::codec::{decode, from_micros};
use crate::error::{Error, Result, check_len};
use crate::schema::IDEM;

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

/// One row of the idempotency table, as stored (postcard, behind the codec).
/// The tenant and the key are the row's key and are not repeated here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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

/// Decodes the stored row at `(tenant, key)`.
pub(crate) fn decode_row(tenant: &str, key: &str, bytes: &[u8]) -> Result<Row> {
    decode(IDEM.name(), &key_name(tenant, key), bytes)
}

/// Reads the row at `(tenant, key)` from any readable idempotency table.
pub(crate) fn read_row<T>(table: &T, tenant: &str, key: &str) -> Result<Option<Row>>
where
    T: ReadableTable<(&'static str, &'static str), &'static [u8]>,
{
    match table.get((tenant, key))? {
        Some(v) => decode_row(tenant, key, v.value()).map(Some),
        None => Ok(None),
    }
}

/// A time stored in the row at `(tenant, key)`, as a `DateTime` (out of
/// range: [`Error::Corrupted`]).
pub(crate) fn row_time(tenant: &str, key: &str, us: i64) -> Result<DateTime<Utc>> {
    from_micros(IDEM.name(), &key_name(tenant, key), us)
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
