//! [`IdempotencyService`]: the request path of the layer.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderName, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt as _, LengthLimitError, Limited};
use parking_lot::Mutex;

use super::body::{Buffered, buffer, over_max_body};
use super::fingerprint;
use super::key::parse_key;
use super::problem::{Kind, full, in_flight, problem, quoted};
use super::response::replay;
use super::{BoxError, Config, IDEMPOTENCY_KEY, ResponseBody};
use crate::observe::{self, LayerAnswer};
use crate::{Begin, IdempotencyBackend, MAX_TENANT_LEN, Reservation};

/// The service an [`IdempotencyLayer`](super::IdempotencyLayer) wraps around
/// `S`. `Clone` (it clones `S`), and `Send + Sync` when `S` is.
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S: Clone> Clone for IdempotencyService<S> {
    fn clone(&self) -> Self {
        IdempotencyService {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> IdempotencyService<S> {
    pub(super) fn new(inner: S, config: Arc<Config>) -> Self {
        IdempotencyService { inner, config }
    }
}

/// The future of an [`IdempotencyService`] call: boxed, `Send`.
pub struct ResponseFuture<E> {
    inner: Pin<Box<dyn Future<Output = Result<Response<ResponseBody>, E>> + Send>>,
}

impl<E> Future for ResponseFuture<E> {
    type Output = Result<Response<ResponseBody>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<E> fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, B, ResBody> tower::Service<Request<B>> for IdempotencyService<S>
where
    S: tower::Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> ResponseFuture<S::Error> {
        // The clone in `self` is the one made ready by `poll_ready`.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        let config = self.config.clone();
        ResponseFuture {
            inner: Box::pin(handle(inner, config, req)),
        }
    }
}

/// The inner service's response, with its body boxed.
fn boxed<ResBody>(response: Response<ResBody>) -> Response<ResponseBody>
where
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    response.map(|b| ResponseBody::new(b.map_err(Into::into)))
}

async fn handle<S, B, ResBody>(
    mut inner: S,
    config: Arc<Config>,
    req: Request<B>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: tower::Service<Request<B>, Response = Response<ResBody>>,
    B: Body + From<Bytes>,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let Keyed {
        key,
        tenant,
        mut parts,
        body,
    } = match admit(&config, req).await {
        Admit::PassThrough(req) => return inner.call(req).await.map(boxed),
        Admit::Answer(response) => return Ok(response),
        Admit::Keyed(k) => k,
    };
    if tokio::runtime::Handle::try_current().is_err() {
        // No runtime to run the store's tasks on, and blocking this
        // executor's thread could stall every request it runs.
        observe::layer_without_runtime(&key);
        return Ok(no_runtime(&key));
    }
    let fp = match &config.fingerprint {
        None => fingerprint::exact(&parts, &body),
        Some(f) => match f(&parts, &body) {
            Ok(fp) => fp,
            Err(e) => {
                let detail = format!(
                    "the request could not be fingerprinted, so nothing was reserved for Idempotency-Key {}: {e}",
                    quoted(&key)
                );
                return Ok(problem(Kind::NotFingerprinted, &detail, Some(&key)));
            }
        },
    };
    let now = (config.clock)();
    let mut beginning = Beginning::new(config.keys.clone());
    let begin = {
        let (keys, pending, tenant, key) = (
            config.keys.clone(),
            beginning.pending.clone(),
            tenant,
            key.clone(),
        );
        spawned(async move { begin_for(&*keys, &pending, &tenant, &key, &fp, now).await }).await
    };
    let reservation = match begin {
        Ok(Some(Ok(Begin::Proceed(_)))) => match beginning.take() {
            Some(r) => r,
            // Not reachable: the task handed its reservation over before
            // answering, and nothing else takes it while this future runs.
            None => return Ok(unavailable(&key)),
        },
        Ok(Some(Ok(Begin::Replay(record)))) => {
            observe::layer_answered(LayerAnswer::Replay, &key);
            return Ok(replay(&record));
        }
        Ok(Some(Ok(Begin::InFlight { lease_until }))) => {
            let retry_after_s = retry_after(now, lease_until, config.retry_after);
            observe::layer_answered(LayerAnswer::InFlight { retry_after_s }, &key);
            return Ok(in_flight(&key, retry_after_s));
        }
        Ok(Some(Ok(Begin::Mismatch { .. }))) => {
            observe::layer_answered(LayerAnswer::Mismatch, &key);
            let detail = format!(
                "Idempotency-Key {} was used for a request with another method, path or body; use a new key for a new request",
                quoted(&key)
            );
            return Ok(problem(Kind::KeyReused, &detail, Some(&key)));
        }
        Ok(Some(Err(e))) => {
            observe::layer_store_failed("idempotency_begin", &key, &e);
            return Ok(unavailable(&key));
        }
        // `None`: the task saw this request gone, which it is not.
        Ok(None) => return Ok(unavailable(&key)),
        Err(blocked) => {
            observe::layer_store_failed("idempotency_begin", &key, &blocked);
            return Ok(if blocked == Blocked::NoRuntime {
                no_runtime(&key)
            } else {
                unavailable(&key)
            });
        }
    };

    // The handler gets the reservation, to store its response with
    // `complete_in` in its own transaction. Whatever the layer then does
    // with its own copy (`complete`, `release`, here or from the drop guard)
    // is fenced: it changes nothing once the key is completed.
    parts.extensions.insert(reservation.clone());
    let mut held = Held {
        keys: config.keys.clone(),
        reservation: Some(reservation),
    };
    match inner.call(Request::from_parts(parts, B::from(body))).await {
        Ok(response) => Ok(store_response(&config, held, &key, boxed(response)).await),
        Err(e) => {
            held.release().await;
            Err(e)
        }
    }
}

/// What the layer makes of a request before the store is asked.
enum Admit<B> {
    /// Not covered, or no key and none required: hand it on untouched.
    PassThrough(Request<B>),
    /// Refused (bad key, no tenant, body too large...): this answer.
    Answer(Response<ResponseBody>),
    /// A covered request with a key, its body read.
    Keyed(Keyed),
}

struct Keyed {
    key: String,
    tenant: String,
    parts: Parts,
    body: Bytes,
}

async fn admit<B>(config: &Config, req: Request<B>) -> Admit<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    if !config.methods.contains(req.method()) {
        return Admit::PassThrough(req);
    }
    let key = {
        let mut values = req.headers().get_all(IDEMPOTENCY_KEY).iter();
        match (values.next(), values.next()) {
            (None, _) if config.require_key => {
                let detail = format!(
                    "{} requests to this service need an Idempotency-Key header",
                    req.method()
                );
                return Admit::Answer(problem(Kind::MissingKey, &detail, None));
            }
            (None, _) => return Admit::PassThrough(req),
            (Some(_), Some(_)) => {
                let detail = "the request has more than one Idempotency-Key header; send one key";
                return Admit::Answer(problem(Kind::InvalidKey, detail, None));
            }
            (Some(value), None) => match parse_key(value.as_bytes()) {
                Ok(key) => key,
                Err(e) => {
                    let detail = format!(
                        "Idempotency-Key {} is refused: {e}",
                        quoted(&String::from_utf8_lossy(value.as_bytes()))
                    );
                    return Admit::Answer(problem(Kind::InvalidKey, &detail, None));
                }
            },
        }
    };
    let (parts, body) = req.into_parts();
    let tenant = match (config.tenant_from)(&parts) {
        Some(t) if t.len() <= MAX_TENANT_LEN => t,
        found => {
            let detail = match found {
                Some(t) => format!(
                    "the request's tenant is {} bytes long; at most {MAX_TENANT_LEN} are accepted (Idempotency-Key {})",
                    t.len(),
                    quoted(&key)
                ),
                None => format!(
                    "no tenant could be found for the request, so Idempotency-Key {} cannot be scoped",
                    quoted(&key)
                ),
            };
            return Admit::Answer(problem(Kind::NoTenant, &detail, Some(&key)));
        }
    };
    match read_body(&parts, body, config.max_body).await {
        Ok(body) => Admit::Keyed(Keyed {
            key,
            tenant,
            parts,
            body,
        }),
        Err(kind) => {
            let detail = if kind == Kind::BodyTooLarge {
                format!(
                    "the request body is over {} bytes; nothing was stored for Idempotency-Key {}",
                    config.max_body,
                    quoted(&key)
                )
            } else {
                format!(
                    "the request body could not be read; nothing was stored for Idempotency-Key {}",
                    quoted(&key)
                )
            };
            Admit::Answer(problem(kind, &detail, Some(&key)))
        }
    }
}

/// Stores the handler's `response` for the reservation in `held` (or
/// releases it) and returns what its client gets.
async fn store_response(
    config: &Config,
    mut held: Held,
    key: &str,
    response: Response<ResponseBody>,
) -> Response<ResponseBody> {
    if response.status().is_server_error() && !config.cache_server_errors {
        held.release().await;
        return response;
    }
    let (parts, body) = response.into_parts();
    let body = match buffer(body, config.max_body).await {
        Buffered::Whole(b) => b,
        Buffered::TooLarge(body) => {
            held.release().await;
            return Response::from_parts(parts, body);
        }
        Buffered::Failed => {
            held.release().await;
            let detail = format!(
                "the response body failed while being sent; nothing was stored for Idempotency-Key {}",
                quoted(key)
            );
            return problem(Kind::ResponseFailed, &detail, Some(key));
        }
    };
    let Some(reservation) = held.disarm() else {
        // Released already: nothing to store.
        return Response::from_parts(parts, full(body));
    };
    let done_at = (config.clock)();
    let mut record = reservation.response(parts.status.as_u16(), body.to_vec(), done_at);
    record.content_type = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    record.headers = stored_headers(&parts.headers, &config.replay_headers);
    let keys = config.keys.clone();
    // Stored; not stored because the handler already stored its own with
    // `complete_in` or a newer holder fenced this one out (`Ok(false)`, and
    // then the `release` below is never reached); or refused by the store:
    // the handler ran, so its client gets its response in every case. A
    // refused one is released so a retry runs rather than waits (a release
    // frees only a reservation with this fence, never a stored response).
    // Dropped while this waits, the task still runs to its end.
    let stored = spawned(async move {
        if let Err(e) = keys.complete_async(&reservation, record, done_at).await {
            observe::layer_store_failed("idempotency_complete", reservation.key(), &e);
            if let Err(e) = keys.release_async(&reservation).await {
                observe::layer_store_failed("idempotency_release", reservation.key(), &e);
            }
        }
    })
    .await;
    if let Err(blocked) = stored {
        observe::layer_store_failed("idempotency_complete", key, &blocked);
    }
    Response::from_parts(parts, full(body))
}

/// The request body, at most `max_body` bytes: 413 over it (from
/// `Content-Length` when given, unread), 400 if it fails.
async fn read_body<B>(parts: &Parts, body: B, max_body: usize) -> Result<Bytes, Kind>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let declared = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| over_max_body(n, max_body)) {
        return Err(Kind::BodyTooLarge);
    }
    match Limited::new(body, max_body).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(Kind::BodyTooLarge),
        Err(_) => Err(Kind::UnreadableBody),
    }
}

/// Why a store call did not give its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blocked {
    /// There is no tokio runtime to run it on.
    NoRuntime,
    /// It panicked.
    Panicked,
}

impl fmt::Display for Blocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Blocked::NoRuntime => "no tokio runtime to run the store call on",
            Blocked::Panicked => "the store call panicked",
        })
    }
}

/// Runs store calls, through their async forms (which hold no thread while
/// they wait), as a task of their own on the current runtime. Dropped
/// while it waits, the task still runs to its end.
async fn spawned<T: Send + 'static>(
    f: impl Future<Output = T> + Send + 'static,
) -> Result<T, Blocked> {
    let rt = tokio::runtime::Handle::try_current().map_err(|_| Blocked::NoRuntime)?;
    rt.spawn(f).await.map_err(|_| Blocked::Panicked)
}

/// `begin`, in a task of its own, for a request whose future may be
/// dropped while it waits (see [`Beginning`]): skipped if the request is
/// gone already (`None`); a reservation it makes is handed to `pending`
/// before the answer, or released here if the request went away meanwhile.
async fn begin_for(
    keys: &dyn IdempotencyBackend,
    pending: &Mutex<Pending>,
    tenant: &str,
    key: &str,
    fp: &str,
    now: DateTime<Utc>,
) -> Option<crate::Result<Begin>> {
    if pending.lock().abandoned {
        return None;
    }
    let began = keys.begin_async(tenant, key, fp, now).await;
    if let Ok(Begin::Proceed(r)) = &began {
        let abandoned = {
            let mut p = pending.lock();
            if !p.abandoned {
                p.reservation = Some(r.clone());
            }
            p.abandoned
        };
        if abandoned && let Err(e) = keys.release_async(r).await {
            observe::layer_store_failed("idempotency_release", key, &e);
        }
    }
    Some(began)
}

/// What a request's `begin` left for it, shared with the task that runs it.
#[derive(Default)]
struct Pending {
    /// A reservation made and not yet taken by the request.
    reservation: Option<Reservation>,
    /// The request's future was dropped while `begin` was queued or running.
    abandoned: bool,
}

/// A request waiting for its `begin`. Dropped before it took the answer
/// (the request's future was dropped: the client went away, a timeout
/// fired), it marks the request gone, so that a `begin` still queued is
/// skipped, one running releases what it reserves, and a reservation
/// already made is released here. Without it, the reservation would hold
/// the key, answering 409 to every retry, until its lease ended.
struct Beginning {
    keys: Arc<dyn IdempotencyBackend>,
    pending: Arc<Mutex<Pending>>,
}

impl Beginning {
    fn new(keys: Arc<dyn IdempotencyBackend>) -> Beginning {
        Beginning {
            keys,
            pending: Arc::default(),
        }
    }

    /// The reservation `begin` made, now the request's own.
    fn take(&mut self) -> Option<Reservation> {
        self.pending.lock().reservation.take()
    }
}

impl Drop for Beginning {
    fn drop(&mut self) {
        let orphan = {
            let mut p = self.pending.lock();
            p.abandoned = true;
            p.reservation.take()
        };
        if let Some(r) = orphan {
            release_detached(self.keys.clone(), r);
        }
    }
}

/// Releases `r` from a drop guard: as a task of its own, or on this thread
/// outside a runtime. Nobody waits for it; a failure is reported and the
/// key left to its lease.
fn release_detached(keys: Arc<dyn IdempotencyBackend>, r: Reservation) {
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => drop(rt.spawn(async move {
            if let Err(e) = keys.release_async(&r).await {
                observe::layer_store_failed("idempotency_release", r.key(), &e);
            }
        })),
        // Outside a runtime this thread may block.
        Err(_) => {
            if let Err(e) = keys.release(&r) {
                observe::layer_store_failed("idempotency_release", r.key(), &e);
            }
        }
    }
}

fn no_runtime(key: &str) -> Response<ResponseBody> {
    let detail = format!(
        "the idempotency layer runs its store calls as tokio tasks and was called outside a tokio runtime; the request with Idempotency-Key {} was not processed",
        quoted(key)
    );
    problem(Kind::NoRuntime, &detail, Some(key))
}

fn unavailable(key: &str) -> Response<ResponseBody> {
    let detail = format!(
        "the idempotency store failed; the request with Idempotency-Key {} was not processed, retry it later",
        quoted(key)
    );
    problem(Kind::StoreUnavailable, &detail, Some(key))
}

/// The `Retry-After` of a 409: `after`, capped by the time from `now`
/// until the holder's lease ends at `until`; whole seconds, rounded up, at
/// least 1.
fn retry_after(now: DateTime<Utc>, until: DateTime<Utc>, after: Duration) -> u64 {
    let left = (until - now).num_microseconds().unwrap_or(i64::MAX);
    let left = u64::try_from(left).unwrap_or(0);
    let after = u64::try_from(after.as_micros()).unwrap_or(u64::MAX);
    left.min(after).div_ceil(1_000_000).max(1)
}

/// The allow-listed headers of a response whose values can be stored.
fn stored_headers(headers: &http::HeaderMap, allowed: &[HeaderName]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for name in allowed {
        for value in headers.get_all(name) {
            if let Ok(v) = value.to_str() {
                out.push((name.as_str().to_owned(), v.to_owned()));
            }
        }
    }
    out
}

/// A reservation held while the handler runs. Dropped still armed (the
/// handler panicked, or the request's future was dropped), it releases the
/// key on a blocking thread.
struct Held {
    keys: Arc<dyn IdempotencyBackend>,
    reservation: Option<Reservation>,
}

impl Held {
    /// Releases the key and waits for it (failures are reported and left to
    /// the lease). Dropped while it waits, the release still runs.
    async fn release(&mut self) {
        if let Some(r) = self.reservation.take() {
            let keys = self.keys.clone();
            let key = r.key().to_owned();
            let released = spawned(async move { keys.release_async(&r).await }).await;
            match released {
                Ok(Ok(())) => {}
                Ok(Err(e)) => observe::layer_store_failed("idempotency_release", &key, &e),
                Err(blocked) => {
                    observe::layer_store_failed("idempotency_release", &key, &blocked);
                }
            }
        }
    }

    /// The reservation, no longer released on drop (`None` once released
    /// or disarmed).
    fn disarm(&mut self) -> Option<Reservation> {
        self.reservation.take()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(r) = self.reservation.take() {
            release_detached(self.keys.clone(), r);
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone as _;

    use super::*;

    #[test]
    fn retry_after_is_the_configured_wait_capped_by_the_lease() {
        let t = |us: i64| {
            Utc.timestamp_opt(1_700_000_000, 0).unwrap() + chrono::Duration::microseconds(us)
        };
        let long = Duration::from_secs(3600);
        assert_eq!(retry_after(t(0), t(60_000_000), long), 60);
        assert_eq!(retry_after(t(0), t(59_000_001), long), 60);
        assert_eq!(retry_after(t(0), t(1), long), 1);
        assert_eq!(retry_after(t(0), t(0), long), 1);
        assert_eq!(retry_after(t(5), t(0), long), 1);
        // The configured value, capped by the lease left.
        let three = Duration::from_secs(3);
        assert_eq!(retry_after(t(0), t(60_000_000), three), 3);
        assert_eq!(retry_after(t(0), t(2_000_000), three), 2);
        assert_eq!(
            retry_after(t(0), t(60_000_000), Duration::from_millis(1500)),
            2
        );
        assert_eq!(retry_after(t(0), t(60_000_000), Duration::ZERO), 1);
    }
}
