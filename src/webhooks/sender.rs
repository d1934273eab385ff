//! The sending half: [`Sender`] POSTs outbox entries to their destinations'
//! endpoints, signed as Standard Webhooks, and tells the dispatcher what
//! became of each attempt.

use std::collections::HashMap;
use std::fmt::{self, Write as _};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER, USER_AGENT};
use http::{Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use sha2::{Digest, Sha256};

use super::{Secret, sign};
use crate::dispatch::Delivery;
use crate::error::{Error, Result};
use crate::outbox::OutboxEntry;

/// The default time an attempt may take, from the connection to the end of
/// the answer: 15 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(15);

/// The longest a connection may take to open (TCP and TLS), at most the
/// attempt's timeout: a connection not made in time is a retry known not
/// to have sent anything.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The most bytes of an answer's body read (and dropped).
pub const MAX_ANSWER: usize = 64 * 1024;

/// The headers the sender writes itself: an endpoint may not set them.
const RESERVED: [&str; 7] = [
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "idempotency-key",
    "content-length",
    "transfer-encoding",
    "host",
];

/// Where a destination's entries go, and how: its URL, its signing
/// secrets, extra headers and timeout. Configured in code: secrets come
/// from the application's configuration and are never written into the
/// store.
#[derive(Clone)]
pub struct Endpoint {
    url: Uri,
    secrets: Vec<Secret>,
    headers: Vec<(String, String)>,
    content_type: String,
    timeout: Duration,
    fail_for_good: Vec<u16>,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Header values may carry credentials: names only.
        f.debug_struct("Endpoint")
            .field("url", &self.url)
            .field("secrets", &self.secrets.len())
            .field(
                "headers",
                &self.headers.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field("content_type", &self.content_type)
            .field("timeout", &self.timeout)
            .field("fail_for_good", &self.fail_for_good)
            .finish()
    }
}

impl Endpoint {
    /// An endpoint at `url`: `http` or `https`, with a host. Fails with
    /// [`Error::InvalidInput`] for anything else.
    pub fn new(url: &str) -> Result<Endpoint> {
        let bad = |why: &str| Error::invalid("url", format!("{why}: {url:?}"));
        let parsed: Uri = url.parse().map_err(|_| bad("not a URL"))?;
        match parsed.scheme_str() {
            Some("http" | "https") => {}
            _ => return Err(bad("the scheme must be http or https")),
        }
        if parsed.host().is_none_or(str::is_empty) {
            return Err(bad("no host"));
        }
        Ok(Endpoint {
            url: parsed,
            secrets: Vec::new(),
            headers: Vec::new(),
            content_type: "application/json".to_owned(),
            timeout: DEFAULT_TIMEOUT,
            fail_for_good: Vec::new(),
        })
    }

    /// Signs with `secret` too: every request carries one signature per
    /// secret, so a receiver may move to a new secret while the old one
    /// still verifies.
    #[must_use]
    pub fn secret(mut self, secret: Secret) -> Self {
        self.secrets.push(secret);
        self
    }

    /// Sends the header `name: value` with every request. Checked by
    /// [`SenderBuilder::build`]: a name or value HTTP refuses, or one of
    /// the headers the sender writes itself, fails there.
    #[must_use]
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// The `content-type` of every request (default `application/json`).
    #[must_use]
    pub fn content_type(mut self, value: &str) -> Self {
        value.clone_into(&mut self.content_type);
        self
    }

    /// How long an attempt may take, from opening the connection to the
    /// end of the answer (default [`DEFAULT_TIMEOUT`]; at least 1 ms).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Fails the entry for good on `status` (a 4xx), as on 410 Gone,
    /// instead of retrying it.
    #[must_use]
    pub fn fail_for_good(mut self, status: u16) -> Self {
        self.fail_for_good.push(status);
        self
    }
}

/// An endpoint checked and ready to send to.
struct Ready {
    url: Uri,
    secrets: Vec<Secret>,
    headers: Vec<(HeaderName, HeaderValue)>,
    content_type: HeaderValue,
    timeout: Duration,
    fail_for_good: Vec<u16>,
}

impl Ready {
    fn check(destination: &str, e: Endpoint) -> Result<Ready> {
        let bad = |what: &'static str, why: String| {
            Error::invalid(what, format!("destination {destination:?}: {why}"))
        };
        if e.secrets.is_empty() {
            return Err(bad(
                "secret",
                "no signing secret: every request is signed".to_owned(),
            ));
        }
        if e.timeout < Duration::from_millis(1) {
            return Err(bad("timeout", format!("{:?} is below 1 ms", e.timeout)));
        }
        if let Some(s) = e.fail_for_good.iter().find(|s| !(400..500).contains(*s)) {
            return Err(bad(
                "fail_for_good",
                format!("{s} is not a 4xx status (2xx delivers, 5xx retries)"),
            ));
        }
        let mut headers = Vec::with_capacity(e.headers.len());
        for (name, value) in &e.headers {
            let n = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| bad("header", format!("{name:?} is not a header name")))?;
            if RESERVED.contains(&n.as_str()) || n == CONTENT_TYPE || n == USER_AGENT {
                return Err(bad(
                    "header",
                    format!(
                        "{name:?} is written by the sender (content-type: Endpoint::content_type)"
                    ),
                ));
            }
            let v = HeaderValue::from_str(value).map_err(|_| {
                bad(
                    "header",
                    format!("the value of {name:?} is not a header value"),
                )
            })?;
            headers.push((n, v));
        }
        let content_type = HeaderValue::from_str(&e.content_type).map_err(|_| {
            bad(
                "content_type",
                format!("{:?} is not a header value", e.content_type),
            )
        })?;
        Ok(Ready {
            url: e.url,
            secrets: e.secrets,
            headers,
            content_type,
            timeout: e.timeout,
            fail_for_good: e.fail_for_good,
        })
    }
}

/// Builds a [`Sender`] from its endpoints.
#[derive(Debug, Default)]
pub struct SenderBuilder {
    endpoints: Vec<(String, Endpoint)>,
}

impl SenderBuilder {
    /// Sends the entries of `destination` to `endpoint`.
    #[must_use]
    pub fn endpoint(mut self, destination: &str, endpoint: Endpoint) -> Self {
        self.endpoints.push((destination.to_owned(), endpoint));
        self
    }

    /// Checks every endpoint: fails with [`Error::InvalidInput`] for none
    /// at all, a destination named twice, an endpoint without a secret, a
    /// header HTTP refuses or the sender writes itself, a timeout below
    /// 1 ms, or a `fail_for_good` status that is not a 4xx.
    pub fn build(self) -> Result<Sender> {
        if self.endpoints.is_empty() {
            return Err(Error::invalid("endpoint", "a sender needs an endpoint"));
        }
        let mut endpoints = HashMap::with_capacity(self.endpoints.len());
        for (destination, endpoint) in self.endpoints {
            let ready = Ready::check(&destination, endpoint)?;
            if endpoints.insert(destination.clone(), ready).is_some() {
                return Err(Error::invalid(
                    "endpoint",
                    format!("destination {destination:?} has two endpoints"),
                ));
            }
        }
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        let longest = endpoints.values().map(|r| r.timeout).max();
        http.set_connect_timeout(Some(
            longest.map_or(CONNECT_TIMEOUT, |t| t.min(CONNECT_TIMEOUT)),
        ));
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::invalid("tls", e.to_string()))?
        .with_root_certificates(
            webpki_roots::TLS_SERVER_ROOTS
                .iter()
                .cloned()
                .collect::<rustls::RootCertStore>(),
        )
        .with_no_client_auth();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Ok(Sender {
            inner: Arc::new(Inner {
                endpoints,
                client,
                runtime: OnceLock::new(),
            }),
        })
    }
}

/// Sends outbox entries as signed webhooks; cheap to clone (clones share
/// the endpoints and the connection pool).
///
/// On the thread dispatcher: `.start(sender.blocking())`; on tokio:
/// `.start_async(sender.async_send())`.
///
/// # The request
///
/// `POST` to the destination's [`Endpoint`], the body the entry's payload
/// bytes as stored (never re-encoded), with these headers:
///
/// | header | value |
/// |---|---|
/// | `webhook-id` | [`Sender::webhook_id`]: the same for every attempt of the entry |
/// | `webhook-timestamp` | this attempt's time, Unix seconds |
/// | `webhook-signature` | [`sign`](super::sign) with the endpoint's secrets (one `v1,` signature each, for rotation) |
/// | `idempotency-key` | the `webhook-id` again, for receivers that deduplicate on it |
/// | `content-type` | the endpoint's (default `application/json`) |
/// | `user-agent` | `idemstore/<version>` |
///
/// plus the endpoint's own headers. Redirects are never followed.
///
/// # The answer
///
/// | answer | [`Delivery`] |
/// |---|---|
/// | 2xx | `Delivered` |
/// | 3xx | `Failed` (`http_3xx`: a moved endpoint is a configuration to fix, and following it would send the body where nobody asked) |
/// | 429 or 503 with a `Retry-After` (seconds or an HTTP date) | `Throttled` until then: the whole destination waits |
/// | 408, 425, 429, 5xx with a `Retry-After` | `RetryAt` then |
/// | 408, 425, 429, 5xx otherwise | `Retry` (the retry policy's back-off) |
/// | 410, and the statuses of [`Endpoint::fail_for_good`] | `Failed` |
/// | any other 4xx | `Retry` |
/// | no connection (DNS, refused, TLS handshake, the connect timeout) | `Retry` (`connect`): nothing was sent |
/// | a timeout or a broken connection once the connection was made | `OutcomeUnknown`, its remote reference the `webhook-id`: the remote may have acted, and a retry carries the same id |
///
/// Failure reasons are stable codes, `http_<status>` and `connect`, each
/// followed by a detail in parentheses that the entry's attempt history
/// keeps (the code alone is its `last_failure`): the attempt's time and the
/// first bytes of the answer (`http_503 (412 ms: {"error":"busy"})`), or
/// the connection's error (`connect (Connection refused, 2 ms)`).
/// The answer's body is read (at most [`MAX_ANSWER`] bytes, so that the
/// connection goes back to the pool) and dropped.
#[derive(Clone)]
pub struct Sender {
    inner: Arc<Inner>,
}

struct Inner {
    endpoints: HashMap<String, Ready>,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// The runtime [`Sender::send_blocking`] runs its requests on, made at
    /// its first call.
    runtime: OnceLock<tokio::runtime::Runtime>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Dropped from inside an async task, a runtime must not wait for
        // its threads.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl fmt::Debug for Sender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names: Vec<&String> = self.inner.endpoints.keys().collect();
        names.sort();
        f.debug_struct("Sender")
            .field("destinations", &names)
            .finish_non_exhaustive()
    }
}

impl Sender {
    /// A builder with no endpoint yet.
    #[must_use]
    pub fn builder() -> SenderBuilder {
        SenderBuilder::default()
    }

    /// The `webhook-id` of `entry`'s requests: `msg_` and 32 hex digits of
    /// the SHA-256 of its destination and idempotency key. The same for
    /// every attempt, in every process, so a receiver deduplicates retries
    /// by it; different for any two entries of one store (their
    /// destination and key differ).
    #[must_use]
    pub fn webhook_id(entry: &OutboxEntry) -> String {
        let mut h = Sha256::new();
        h.update(entry.destination.as_bytes());
        h.update([0]);
        h.update(entry.idempotency_key.as_bytes());
        let digest = h.finalize();
        let mut id = String::with_capacity(36);
        id.push_str("msg_");
        for b in digest.iter().take(16) {
            let _ = write!(id, "{b:02x}");
        }
        id
    }

    /// The thread dispatcher's `send`: `Dispatcher::builder(outbox)
    /// .start(sender.blocking())`.
    pub fn blocking(&self) -> impl Fn(&OutboxEntry) -> Delivery + Send + Sync + 'static {
        let sender = self.clone();
        move |entry| sender.send_blocking(entry)
    }

    /// The async dispatcher's `send`: `Dispatcher::builder(outbox)
    /// .start_async(sender.async_send())`.
    pub fn async_send(
        &self,
    ) -> impl Fn(OutboxEntry) -> std::pin::Pin<Box<dyn Future<Output = Delivery> + Send>>
    + Send
    + Sync
    + 'static {
        let sender = self.clone();
        move |entry| {
            let sender = sender.clone();
            Box::pin(async move { sender.send(entry).await })
        }
    }

    /// Sends `entry` from a thread that is not an async task's (it blocks
    /// until the answer): on a runtime of the sender's own, made at the
    /// first call.
    pub fn send_blocking(&self, entry: &OutboxEntry) -> Delivery {
        let rt = match self.runtime() {
            Ok(rt) => rt,
            Err(reason) => return Delivery::Retry { reason },
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let (sender, entry) = (self.clone(), entry.clone());
        rt.spawn(async move {
            let _ = tx.send(sender.send(entry).await);
        });
        // Nothing comes back only if the runtime went away mid-send.
        rx.recv()
            .unwrap_or(Delivery::OutcomeUnknown { remote_ref: None })
    }

    fn runtime(&self) -> std::result::Result<&tokio::runtime::Runtime, String> {
        if let Some(rt) = self.inner.runtime.get() {
            return Ok(rt);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("idemstore-webhooks")
            .enable_all()
            .build()
            .map_err(|e| format!("runtime: {e}"))?;
        // Another thread may have made one first: keep that one.
        if let Err(rt) = self.inner.runtime.set(rt) {
            rt.shutdown_background();
        }
        self.inner.runtime.get().ok_or_else(|| "runtime".to_owned())
    }

    /// Sends `entry` (see [`Sender`]). An entry whose
    /// destination has no endpoint fails for good (`no_endpoint`).
    pub async fn send(&self, entry: OutboxEntry) -> Delivery {
        let Some(endpoint) = self.inner.endpoints.get(&entry.destination) else {
            return Delivery::Failed {
                reason: "no_endpoint".to_owned(),
            };
        };
        let id = Self::webhook_id(&entry);
        let now = Utc::now();
        let request = match request(endpoint, &id, now.timestamp(), entry.payload) {
            Ok(r) => r,
            Err(reason) => return Delivery::Failed { reason },
        };
        let started = std::time::Instant::now();
        let attempt = async {
            let answer = self.inner.client.request(request).await?;
            let status = answer.status();
            let retry_after = answer.headers().get(RETRY_AFTER).cloned();
            // Read the answer (bounded) so that the connection is kept.
            let body = Limited::new(answer.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map(http_body_util::Collected::to_bytes)
                .unwrap_or_default();
            Ok::<_, hyper_util::client::legacy::Error>((status, retry_after, body))
        };
        match tokio::time::timeout(endpoint.timeout, attempt).await {
            Ok(Ok((status, retry_after, body))) => {
                let after = retry_after.as_ref().and_then(|v| retry_at(v, Utc::now()));
                let detail = detail(started.elapsed(), Some(&body));
                delivery(status, after, &endpoint.fail_for_good, &detail)
            }
            Ok(Err(e)) if e.is_connect() => {
                // The innermost cause: "Connection refused", a TLS alert…
                let mut cause: &dyn std::error::Error = &e;
                while let Some(next) = cause.source() {
                    cause = next;
                }
                Delivery::Retry {
                    reason: format!(
                        "connect ({}, {})",
                        printable(cause.to_string().as_bytes()),
                        detail(started.elapsed(), None)
                    ),
                }
            }
            // Timed out, or the connection broke once it was made: the
            // request may have reached the remote.
            Ok(Err(_)) | Err(_) => Delivery::OutcomeUnknown {
                remote_ref: Some(id),
            },
        }
    }
}

/// The request for one attempt.
fn request(
    endpoint: &Ready,
    id: &str,
    timestamp: i64,
    payload: Vec<u8>,
) -> std::result::Result<Request<Full<Bytes>>, String> {
    let signature = sign(&endpoint.secrets, id, timestamp, &payload);
    let mut builder = Request::builder()
        .method(Method::POST)
        .uri(endpoint.url.clone())
        .header("webhook-id", id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signature)
        .header("idempotency-key", id)
        .header(CONTENT_TYPE, endpoint.content_type.clone())
        .header(USER_AGENT, concat!("idemstore/", env!("CARGO_PKG_VERSION")));
    for (name, value) in &endpoint.headers {
        builder = builder.header(name, value);
    }
    builder
        .body(Full::new(Bytes::from(payload)))
        .map_err(|_| "request".to_owned())
}

/// When a `Retry-After` value asks to be tried again: seconds from `now`,
/// or an HTTP date; `None` if it is neither.
fn retry_at(value: &HeaderValue, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
    let text = value.to_str().ok()?.trim();
    if let Ok(seconds) = text.parse::<u32>() {
        return now.checked_add_signed(chrono::TimeDelta::seconds(i64::from(seconds)));
    }
    let at = httpdate::parse_http_date(text).ok()?;
    Some(DateTime::<Utc>::from(at).max(now))
}

/// The most bytes of an answer's body a failure reason shows.
const SHOWN: usize = 200;

/// A failure's detail: how long the attempt took, and the first bytes of
/// the answer's body, if any.
fn detail(took: Duration, body: Option<&[u8]>) -> String {
    let ms = took.as_millis();
    match body {
        Some(b) if !b.is_empty() => {
            let shown = b.get(..SHOWN).unwrap_or(b);
            let more = if shown.len() < b.len() { "…" } else { "" };
            format!("{ms} ms: {}{more}", printable(shown))
        }
        _ => format!("{ms} ms"),
    }
}

/// `bytes` as one line of text: invalid UTF-8 replaced, control
/// characters as spaces.
fn printable(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// What an answer of `status` (with the time its `Retry-After` asked for)
/// makes of the attempt; a failure's reason is `http_<status>` and, in
/// parentheses, `detail`.
fn delivery(
    status: StatusCode,
    after: Option<DateTime<Utc>>,
    fail_for_good: &[u16],
    detail: &str,
) -> Delivery {
    let code = status.as_u16();
    let reason = format!("http_{code} ({detail})");
    match code {
        200..=299 => Delivery::Delivered,
        // A redirect, 410 Gone and the endpoint's own: failed for good.
        300..=399 | 410 => Delivery::Failed { reason },
        429 | 503 if after.is_some() => Delivery::Throttled {
            next_attempt_at: after.unwrap_or_default(),
            reason,
        },
        408 | 425 | 429 | 500..=599 => match after {
            Some(next_attempt_at) => Delivery::RetryAt {
                next_attempt_at,
                reason,
            },
            None => Delivery::Retry { reason },
        },
        c if fail_for_good.contains(&c) => Delivery::Failed { reason },
        _ => Delivery::Retry { reason },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn statuses_map_to_deliveries() {
        let now = at("2026-01-01T00:00:00Z");
        let later = Some(at("2026-01-01T00:01:00Z"));
        let d =
            |code: u16, after| delivery(StatusCode::from_u16(code).unwrap(), after, &[422], "3 ms");
        assert_eq!(d(200, None), Delivery::Delivered);
        assert_eq!(d(204, later), Delivery::Delivered);
        assert!(matches!(d(301, None), Delivery::Failed { reason } if reason == "http_301 (3 ms)"));
        assert!(
            matches!(d(429, later), Delivery::Throttled { next_attempt_at, .. } if Some(next_attempt_at) == later)
        );
        assert!(matches!(d(503, later), Delivery::Throttled { .. }));
        assert!(matches!(d(429, None), Delivery::Retry { reason } if reason == "http_429 (3 ms)"));
        assert!(
            matches!(d(500, later), Delivery::RetryAt { next_attempt_at, .. } if Some(next_attempt_at) == later)
        );
        assert!(matches!(d(408, None), Delivery::Retry { .. }));
        assert!(matches!(d(425, None), Delivery::Retry { .. }));
        assert!(matches!(d(410, None), Delivery::Failed { reason } if reason == "http_410 (3 ms)"));
        assert!(matches!(d(422, None), Delivery::Failed { .. }));
        assert!(matches!(d(404, None), Delivery::Retry { reason } if reason == "http_404 (3 ms)"));
        let _ = now;
    }

    #[test]
    fn a_failure_shows_the_time_and_the_first_bytes_of_the_answer() {
        let took = Duration::from_millis(412);
        assert_eq!(detail(took, None), "412 ms");
        assert_eq!(detail(took, Some(b"")), "412 ms");
        assert_eq!(
            detail(took, Some(b"{\"error\":\n\"busy\"}\xff")),
            "412 ms: {\"error\": \"busy\"}\u{fffd}"
        );
        let long = vec![b'x'; SHOWN + 1];
        assert_eq!(
            detail(took, Some(&long)),
            format!("412 ms: {}…", "x".repeat(SHOWN))
        );
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let now = at("2026-01-01T00:00:00Z");
        let v = |s: &str| HeaderValue::from_str(s).unwrap();
        assert_eq!(retry_at(&v("120"), now), Some(at("2026-01-01T00:02:00Z")));
        assert_eq!(
            retry_at(&v("Thu, 01 Jan 2026 00:05:00 GMT"), now),
            Some(at("2026-01-01T00:05:00Z"))
        );
        // A date in the past asks for now.
        assert_eq!(
            retry_at(&v("Wed, 31 Dec 2025 23:00:00 GMT"), now),
            Some(now)
        );
        assert_eq!(retry_at(&v("soon"), now), None);
        assert_eq!(retry_at(&v("-5"), now), None);
    }
}
