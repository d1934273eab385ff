//! RFC 9457 `application/problem+json` responses and the response body type.

use std::fmt::Write as _;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Full};

use super::{BoxError, ResponseBody};

/// Where the problem types are described: the module docs' "Problems"
/// section, one heading per type.
const TYPE_BASE: &str = "https://docs.rs/idemstore/latest/idemstore/middleware/index.html#";

/// The problems the layer answers with itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    MissingKey,
    InvalidKey,
    NoTenant,
    BodyTooLarge,
    UnreadableBody,
    NotFingerprinted,
    InFlight,
    KeyReused,
    StoreUnavailable,
    ResponseFailed,
    NoRuntime,
}

impl Kind {
    fn parts(self) -> (StatusCode, &'static str, &'static str) {
        match self {
            Kind::MissingKey => (
                StatusCode::BAD_REQUEST,
                "missing-idempotency-key",
                "Missing Idempotency-Key",
            ),
            Kind::InvalidKey => (
                StatusCode::BAD_REQUEST,
                "invalid-idempotency-key",
                "Invalid Idempotency-Key",
            ),
            Kind::NoTenant => (StatusCode::BAD_REQUEST, "no-tenant", "No tenant"),
            Kind::BodyTooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "request-body-too-large",
                "Request body too large",
            ),
            Kind::UnreadableBody => (
                StatusCode::BAD_REQUEST,
                "unreadable-request-body",
                "Unreadable request body",
            ),
            Kind::NotFingerprinted => (
                StatusCode::BAD_REQUEST,
                "request-not-fingerprinted",
                "Request not fingerprinted",
            ),
            Kind::InFlight => (
                StatusCode::CONFLICT,
                "request-in-flight",
                "Request in flight",
            ),
            Kind::KeyReused => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                "Idempotency-Key reused",
            ),
            Kind::StoreUnavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "idempotency-store-unavailable",
                "Idempotency store unavailable",
            ),
            Kind::ResponseFailed => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "response-failed",
                "Response failed",
            ),
            Kind::NoRuntime => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "no-tokio-runtime",
                "No tokio runtime",
            ),
        }
    }
}

/// A problem response of `kind`, with `detail` and, when known, the key as
/// the `idempotency_key` extension member.
pub(crate) fn problem(kind: Kind, detail: &str, key: Option<&str>) -> Response<ResponseBody> {
    let (status, slug, title) = kind.parts();
    let mut json = String::with_capacity(160 + detail.len());
    json.push_str("{\"type\":");
    push_str(&mut json, &format!("{TYPE_BASE}{slug}"));
    json.push_str(",\"title\":");
    push_str(&mut json, title);
    let _ = write!(json, ",\"status\":{}", status.as_u16());
    json.push_str(",\"detail\":");
    push_str(&mut json, detail);
    if let Some(key) = key {
        json.push_str(",\"idempotency_key\":");
        push_str(&mut json, key);
    }
    json.push('}');
    let mut response = Response::new(full(Bytes::from(json)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// The 409 for a key whose holder runs, with `Retry-After: secs`.
pub(crate) fn in_flight(key: &str, secs: u64) -> Response<ResponseBody> {
    let mut response = problem(
        Kind::InFlight,
        &format!(
            "a request with Idempotency-Key {} is still being processed; retry after {secs} s",
            quoted(key)
        ),
        Some(key),
    );
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(secs));
    response
}

/// `s` as a JSON string literal, for `detail` texts.
pub(crate) fn quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    push_str(&mut out, s);
    out
}

/// Appends `s` to `out` as a JSON string literal.
fn push_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 || c == '\u{7f}' => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A complete body of `bytes`.
pub(crate) fn full(bytes: Bytes) -> ResponseBody {
    UnsyncBoxBody::new(Full::new(bytes).map_err(|never| -> BoxError { match never {} }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes() {
        assert_eq!(quoted("a\"b\\c\n\u{1}"), r#""a\"b\\c\n\u0001""#);
    }

    #[tokio::test]
    async fn problem_body() {
        let r = problem(Kind::KeyReused, "detail \"x\"", Some("k\"1"));
        assert_eq!(r.status(), 422);
        assert_eq!(r.headers()[CONTENT_TYPE], "application/problem+json");
        let body = r.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            concat!(
                r#"{"type":"https://docs.rs/idemstore/latest/idemstore/middleware/index.html#idempotency-key-reused","#,
                r#""title":"Idempotency-Key reused","status":422,"detail":"detail \"x\"","idempotency_key":"k\"1"}"#
            )
        );
    }
}
