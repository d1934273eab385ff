//! [`IdempotencyLayer`]: HTTP `Idempotency-Key` handling for any tower 0.5
//! service over `http` 1 types (axum 0.8, hyper 1), on the store's
//! [`IdempotencyKeys`]. Compiled with the `middleware` feature.
//!
//! ```no_run
//! use axum::{Router, routing::{get, post}};
//! use idemstore::Store;
//! use idemstore::middleware::IdempotencyLayer;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = Store::open("api.idem")?;
//! let idempotent = IdempotencyLayer::new(store.idempotency_keys())
//!     .require_key(true)
//!     .replay_headers([axum::http::header::LOCATION]);
//! // On the routes that take a key only: the others never reserve one.
//! let app: Router = Router::new()
//!     .route(
//!         "/payments",
//!         post(|| async { (axum::http::StatusCode::CREATED, "{\"id\":1}") }).layer(idempotent),
//!     )
//!     .route("/health", get(|| async { "ok" }));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, app).await?;
//! # Ok(())
//! # }
//! ```
//!
//! # What a request goes through
//!
//! Requests whose method is not covered ([`IdempotencyLayer::methods`],
//! default `POST` and `PATCH`) pass through untouched. A covered request:
//!
//! 1. without an `Idempotency-Key` header passes through, or gets **400**
//!    with [`require_key(true)`](IdempotencyLayer::require_key);
//! 2. with a bad key (empty, two headers, over 255 characters, not a bare
//!    key nor an RFC 8941 string) gets **400**;
//! 3. its tenant comes from [`IdempotencyLayer::tenant_from`] (default: the
//!    one tenant `""`); no tenant → **400**;
//! 4. its body is read, at most [`max_body`](IdempotencyLayer::max_body)
//!    bytes (a longer one → **413**, nothing reserved, handler not run), and
//!    the request [`fingerprint`](crate::fingerprint)ed from its method,
//!    path-and-query and body, or as
//!    [`fingerprint_with`](IdempotencyLayer::fingerprint_with) says (its
//!    error → **400**);
//! 5. [`IdempotencyKeys::begin`] decides, in a task of its own through its
//!    async form (a store error → **503**, handler not run; no tokio
//!    runtime → **500**, see [below](#a-tokio-runtime)):
//!    - a stored response for the same request → it is sent again: its
//!      status, `Content-Type`, [allow-listed
//!      headers](IdempotencyLayer::replay_headers) and body, plus
//!      `Idempotent-Replayed: true`;
//!    - the key is held by a running request → **409** with `Retry-After`
//!      ([`retry_after`](IdempotencyLayer::retry_after), default 1 s,
//!      capped by the time left on the holder's lease);
//!    - the key was used for another request → **422**;
//!    - the key is free (or its holder's lease ended) → the handler runs,
//!      with the request's [`Reservation`] in its extensions.
//!
//! # Once per key, crash included: `complete_in`
//!
//! On its own, the layer stores the handler's response *after* the handler
//! returns, in a commit of its own. If the process dies between the
//! handler's commit and that one, nothing is stored and the key stays
//! reserved: once the lease ends (default 60 s), a retry runs the handler
//! **again**. So "the handler runs once per key" holds across crashes only
//! for a handler that stores its response itself, with
//! [`IdempotencyKeys::complete_in`] inside the same
//! [`Store::write`](crate::Store::write) as its own rows: "the handler ran"
//! and "its response is stored" are then one commit. On PostgreSQL the same
//! holds with `PgIdempotencyKeys::complete_in` inside the handler's
//! `PgStore::write`.
//!
//! The layer puts the request's [`Reservation`] in the request's
//! extensions (`http::Extensions`) before calling the handler: axum
//! handlers take it with `Extension<Reservation>`, a tower service reads
//! `req.extensions().get::<Reservation>()`. It is there on covered requests
//! that carry a key (always, under [`require_key(true)`](IdempotencyLayer::require_key));
//! take `Option<Extension<Reservation>>` if the key is optional.
//!
//! ```no_run
//! use axum::extract::{Extension, State};
//! use axum::http::{StatusCode, header};
//! use axum::response::{IntoResponse, Response};
//! use axum::{Router, body::Bytes, routing::post};
//! use chrono::Utc;
//! use idemstore::middleware::{IdempotencyLayer, record_response, to_response};
//! use idemstore::redb::{ReadableTable as _, TableDefinition};
//! use idemstore::{Reservation, Store};
//!
//! const ORDERS: TableDefinition<u64, &[u8]> = TableDefinition::new("app.orders");
//! type BoxError = Box<dyn std::error::Error + Send + Sync>;
//!
//! async fn create_order(
//!     State(store): State<Store>,
//!     Extension(reservation): Extension<Reservation>,
//!     body: Bytes,
//! ) -> Response {
//!     let keys = store.idempotency_keys();
//!     let placed = tokio::task::spawn_blocking(move || {
//!         store.write(|tx| {
//!             let mut orders = tx.open_table(ORDERS)?;
//!             let id = orders.last()?.map_or(1, |(k, _)| k.value() + 1);
//!             orders.insert(id, &*body)?;
//!             let now = Utc::now();
//!             // The answer, written once: its record is what retries get.
//!             let answer = Response::builder()
//!                 .status(StatusCode::CREATED)
//!                 .header(header::CONTENT_TYPE, "application/json")
//!                 .header(header::LOCATION, format!("/orders/{id}"))
//!                 .body(format!("{{\"order\":{id}}}"))?;
//!             let response = record_response(&reservation, &answer, now);
//!             // The order and its response commit together, or neither does.
//!             if keys.complete_in(tx, &reservation, response.clone(), now)? {
//!                 Ok(response)
//!             } else {
//!                 // This request ran past its lease and another took the key
//!                 // over: roll the order back.
//!                 Err(BoxError::from("the idempotency key was taken over"))
//!             }
//!         })
//!     })
//!     .await;
//!     match placed {
//!         // This client gets exactly what a retry will.
//!         Ok(Ok(stored)) => to_response(&stored).into_response(),
//!         // Nothing committed: the layer releases the key on this 5xx.
//!         _ => StatusCode::SERVICE_UNAVAILABLE.into_response(),
//!     }
//! }
//!
//! # fn app(store: Store) -> Router {
//! let idempotent = IdempotencyLayer::new(store.idempotency_keys()).require_key(true);
//! Router::new()
//!     .route("/orders", post(create_order).layer(idempotent))
//!     .with_state(store.clone())
//! # }
//! ```
//!
//! Once that commit is made, nothing after it undoes it: a 5xx from the
//! handler, a panic, an `Err` from the inner or an outer service, a dropped
//! connection or a crash of the process all leave the stored response in
//! place, and the next request with the key gets it replayed at once (with
//! `Idempotent-Replayed: true`), without waiting for the lease. The layer
//! stores nothing itself then: its own `complete` and `release` act only
//! on a key still reserved under the request's fence, so on a completed key
//! they change nothing. That `complete` finds the response of its own
//! reservation and counts nothing: neither a completion nor a
//! [`fenced_out`](crate::IdempotencyStats::fenced_out) (which counts only
//! holders whose key another request took over).
//! The first client gets whatever the handler answered; retries get what it
//! stored. To make the two one answer, build the response once and derive
//! the other from it: [`record_response`] makes the record of an
//! `http::Response` (status, `Content-Type`, its headers, body) and
//! [`to_response`] the response of a record. If the handler's transaction rolls back, nothing is stored and
//! the rules below apply as for any handler.
//!
//! # After the handler
//!
//! For a handler that did not store its response itself:
//!
//! - A response is buffered (at most `max_body` bytes) and stored with
//!   [`IdempotencyKeys::complete`]: its status, `Content-Type`, the
//!   allow-listed headers whose values are visible ASCII, and its body
//!   (trailers are neither stored nor forwarded). Its own client gets it
//!   with all its headers. A crash before this store lets a retry run the
//!   handler again once the lease ends (see above).
//! - A **5xx** is not stored: the key is released so a retry runs the
//!   handler again, unless [`cache_server_errors(true)`](IdempotencyLayer::cache_server_errors).
//! - A response **larger than `max_body`**, or one the store refuses to keep
//!   (over the store's own body or header limits, or a store error), is
//!   sent to its client unchanged and not stored, and the key is released:
//!   a retry runs the handler again. Set `max_body` above your largest
//!   response (and the store's [`max_body`](crate::StoreBuilder::max_body)
//!   at least as high) where that matters.
//! - A response body that fails while being read → the key is released
//!   and the client gets **500**.
//! - The inner service returns `Err` → the key is released and the error
//!   is returned. The handler panics or the request's future is dropped
//!   (the client went away) while it runs → the key is released from a
//!   drop guard, in a task of its own (see [Cancellation](#cancellation)).
//! - There is no lease renewal: the store's lease
//!   ([`IdempotencyKeys::with_lease`], default 60 s) bounds one handler run.
//!   A handler still running past it may be taken over by a retry; its own
//!   late `complete` is then fenced out (nothing stored) and its client
//!   still gets its response.
//!
//! # Cancellation
//!
//! A request's future may be dropped at any await: the client went away,
//! a timeout or a `select!` fired. The layer's store calls run as tasks of
//! their own (each awaiting the store's async form, which holds no thread
//! while it waits for a commit or a round trip) and run to their end
//! whatever becomes of the future, so what a dropped request leaves behind
//! is decided there:
//!
//! - **While `begin` is queued or running:** the request is marked gone. A
//!   `begin` not started yet is skipped (nothing reserved); one that
//!   reserves the key releases it at once in its task; one that
//!   answered before the future was dropped has its reservation released by
//!   the future's drop guard. A retry with the key proceeds at once instead
//!   of answering 409 until the lease ends.
//! - **While the handler runs, or its response body is read:** the drop
//!   guard releases the key in a task of its own, so a retry runs the
//!   handler again. If the handler had stored its response with
//!   [`IdempotencyKeys::complete_in`], that release changes nothing (it
//!   never removes a stored response) and the retry gets the response
//!   replayed.
//! - **While the layer stores the response or releases the key:** the call
//!   is already a task of its own and finishes.
//!
//! A release that fails (the store is down) leaves the key to its lease;
//! it is reported (see [Observability](#observability)). Dropping the
//! future never stops a handler's work that runs on a task of its own
//! (`tokio::task::spawn_blocking` in the example above): its commit, and
//! its `complete_in`, may still happen after the layer's release, and the
//! response it stores is then replayed to retries as usual.
//!
//! # A tokio runtime
//!
//! The layer needs a tokio runtime (the current-thread one is enough)
//! around the request's future: its store calls run as tasks on it,
//! awaiting their commit (an fsync of the embedded store, a round trip to
//! PostgreSQL) without holding a thread. Polled outside one (another
//! executor, `futures::executor::block_on`), a covered request with a key
//! is answered **500** ([No tokio runtime](#no-tokio-runtime)) without
//! running the handler or touching the store, and the error is reported;
//! requests the layer lets pass through need no runtime.
//!
//! # Observability
//!
//! With the `tracing` and `metrics` features the layer reports under the
//! target `idemstore::middleware` (the crate docs' "Observability" section
//! lists every event and metric):
//!
//! - `debug` events for the answers it makes from the store: `stored
//!   response replayed`, `request in flight; answered 409` (with
//!   `retry_after_s`), `key reused for another request; answered 422`,
//!   each with the `key` (`begin` counts them already, in
//!   `idemstore_idempotency_begins_total`);
//! - an `error` event `idempotency store failed; answered 503` (`during`:
//!   `idempotency_begin`, `key`, `error`); a `warn` event `idempotency
//!   store failed after the handler ran` when storing the response or
//!   releasing the key failed (`during`: `idempotency_complete` or
//!   `idempotency_release`); an `error` event for a request polled outside
//!   a tokio runtime (`during`: `middleware_runtime`). Each counts in
//!   `idemstore_errors_total` under its `during`.
//!
//! # Body types
//!
//! The layered service takes `Request<B>` with `B: http_body::Body +
//! From<Bytes>` (axum's `Body`, `Full<Bytes>`): a covered request's body is
//! read and handed on rebuilt from its bytes. Serving hyper's `Incoming`
//! directly, map it first (for example `req.map(axum::body::Body::new)`).
//! Every response, the handler's or the layer's own, has the body type
//! [`ResponseBody`], a boxed body; axum takes it as it is.
//!
//! # Problems
//!
//! Every response the layer makes itself is an RFC 9457
//! `application/problem+json` body with `type` (a link to the heading
//! below), `title`, `status`, `detail`, and the key as `idempotency_key`
//! when the request carried a valid one.
//!
//! ### Missing Idempotency-Key
//! 400: a covered request without the header under `require_key(true)`.
//!
//! ### Invalid Idempotency-Key
//! 400: empty, repeated, longer than 255 characters, or malformed.
//!
//! ### No tenant
//! 400: [`IdempotencyLayer::tenant_from`] returned `None`, or a tenant over
//! 255 bytes.
//!
//! ### Request body too large
//! 413: the request body is over `max_body`; nothing was reserved.
//!
//! ### Unreadable request body
//! 400: reading the request body failed.
//!
//! ### Request not fingerprinted
//! 400: the [`fingerprint_with`](IdempotencyLayer::fingerprint_with)
//! function refused the request (for [`json_fingerprint`]: a body that is
//! not JSON); nothing was reserved.
//!
//! ### Request in flight
//! 409, with `Retry-After`: another request with the key is running.
//!
//! ### Idempotency-Key reused
//! 422: the key belongs to a request with another method, path or body.
//!
//! ### Idempotency store unavailable
//! 503: the store failed; the handler did not run.
//!
//! ### Response failed
//! 500: the handler's response body failed while being read; the key was
//! released.
//!
//! ### No tokio runtime
//! 500: the layer was polled outside a tokio runtime, which it needs for
//! its store calls (see [A tokio runtime](#a-tokio-runtime)); the handler
//! did not run and nothing was reserved.

mod body;
mod fingerprint;
mod key;
mod problem;
mod response;
mod service;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use http::request::Parts;
use http::{HeaderName, Method};

// The docs speak of the embedded store's keys by name.
#[cfg(doc)]
use crate::IdempotencyKeys;
use crate::{IdempotencyBackend, Reservation};

pub use fingerprint::{canonical_json, json_fingerprint};
pub use response::{record_response, to_response};
pub use service::{IdempotencyService, ResponseFuture};

// The layer hands each request's reservation to the handler through
// `http::Extensions`, which holds `Clone + Send + Sync + 'static` values only.
const _: fn() = || {
    fn extension<T: Clone + Send + Sync + 'static>() {}
    extension::<Reservation>();
};

/// The error type inside [`ResponseBody`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every response from an [`IdempotencyService`]: the handler's
/// own (boxed), a stored one, or a problem.
pub type ResponseBody = http_body_util::combinators::UnsyncBoxBody<bytes::Bytes, BoxError>;

/// The header that carries the key: `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The header set on a replayed response: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Default [`IdempotencyLayer::max_body`]: 1 MiB.
pub const DEFAULT_MAX_BODY: usize = crate::DEFAULT_MAX_BODY;

/// Default [`IdempotencyLayer::retry_after`]: 1 s.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

type TenantFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type ClockFn = dyn Fn() -> DateTime<Utc> + Send + Sync;

/// A tower [`Layer`](tower::Layer) that answers retried requests carrying an
/// `Idempotency-Key` from the store, so the handler runs once per key. A
/// crash between the handler's commit and the layer's store of its response
/// lets a retry run it again after the lease, unless the handler stores its
/// response itself with [`IdempotencyKeys::complete_in`] (it finds its
/// [`Reservation`] in the request's extensions). See the [module
/// docs](self) for what each request goes through.
///
/// Cheap to clone; every setter states its default.
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

/// What an [`IdempotencyLayer`] and its services share.
pub(crate) struct Config {
    /// Either backend's keys (a `dyn`: each call is a boxed future
    /// anyway).
    pub(crate) keys: Arc<dyn IdempotencyBackend>,
    pub(crate) tenant_from: Arc<TenantFn>,
    pub(crate) require_key: bool,
    pub(crate) methods: Vec<Method>,
    pub(crate) max_body: usize,
    pub(crate) cache_server_errors: bool,
    pub(crate) replay_headers: Vec<HeaderName>,
    pub(crate) retry_after: Duration,
    /// `None`: [`fingerprint::exact`].
    pub(crate) fingerprint: Option<Arc<fingerprint::FingerprintFn>>,
    pub(crate) clock: Arc<ClockFn>,
}

impl Clone for Config {
    fn clone(&self) -> Self {
        Config {
            keys: self.keys.clone(),
            tenant_from: self.tenant_from.clone(),
            require_key: self.require_key,
            methods: self.methods.clone(),
            max_body: self.max_body,
            cache_server_errors: self.cache_server_errors,
            replay_headers: self.replay_headers.clone(),
            retry_after: self.retry_after,
            fingerprint: self.fingerprint.clone(),
            clock: self.clock.clone(),
        }
    }
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &*self.config;
        f.debug_struct("IdempotencyLayer")
            .field("require_key", &c.require_key)
            .field("methods", &c.methods)
            .field("max_body", &c.max_body)
            .field("cache_server_errors", &c.cache_server_errors)
            .field("replay_headers", &c.replay_headers)
            .field("retry_after", &c.retry_after)
            .field("fingerprint_with", &c.fingerprint.is_some())
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer over `keys` (with the TTL and lease set on them: see
    /// [`IdempotencyKeys::with_ttl`] and [`IdempotencyKeys::with_lease`]):
    /// the embedded store's [`IdempotencyKeys`] or, with feature
    /// `postgres`, `postgres::PgIdempotencyKeys` (any
    /// [`IdempotencyBackend`]). On PostgreSQL, instances of a service in
    /// many processes share the keys: a retry that reaches another
    /// instance is replayed there, or answered 409 while the first runs.
    ///
    /// Defaults: one tenant `""`; requests without a key pass through;
    /// `POST` and `PATCH` covered; 1 MiB bodies; 5xx responses not stored;
    /// no headers replayed but `Content-Type`; `Retry-After: 1` on a 409;
    /// requests fingerprinted by method, path and exact body; the system
    /// clock.
    pub fn new(keys: impl IdempotencyBackend) -> Self {
        IdempotencyLayer {
            config: Arc::new(Config {
                keys: Arc::new(keys),
                tenant_from: Arc::new(|_: &Parts| Some(String::new())),
                require_key: false,
                methods: vec![Method::POST, Method::PATCH],
                max_body: DEFAULT_MAX_BODY,
                cache_server_errors: false,
                replay_headers: Vec::new(),
                retry_after: DEFAULT_RETRY_AFTER,
                fingerprint: None,
                clock: Arc::new(Utc::now),
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// How to find a request's tenant: keys and stored responses of one
    /// tenant are never seen by another. Called with the request's head on
    /// covered requests that carry a key; `None` answers 400 (so put it
    /// after authentication, or map "no account" to a tenant yourself).
    /// Tenants are at most 255 bytes. Default: every request is tenant `""`.
    #[must_use]
    pub fn tenant_from(self, f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.with(|c| c.tenant_from = Arc::new(f))
    }

    /// Whether a covered request without an `Idempotency-Key` is refused
    /// with 400 (`true`) or passed through without idempotency (`false`).
    /// Other methods pass through either way. Default: `false`.
    #[must_use]
    pub fn require_key(self, required: bool) -> Self {
        self.with(|c| c.require_key = required)
    }

    /// The methods handled; every other method passes through untouched and
    /// reserves nothing. Default: `POST` and `PATCH`.
    #[must_use]
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.with(|c| c.methods = methods)
    }

    /// The largest request body read (a longer one is answered 413 before
    /// anything is reserved) and the largest response body stored (a longer
    /// one reaches its client unstored and the key is released). Keep the
    /// store's [`max_body`](crate::StoreBuilder::max_body) at least as high.
    /// Default: [`DEFAULT_MAX_BODY`], 1 MiB.
    #[must_use]
    pub fn max_body(self, bytes: usize) -> Self {
        self.with(|c| c.max_body = bytes)
    }

    /// Whether 5xx responses are stored and replayed (`true`) or release the
    /// key so a retry runs the handler again (`false`). Default: `false`.
    #[must_use]
    pub fn cache_server_errors(self, cache: bool) -> Self {
        self.with(|c| c.cache_server_errors = cache)
    }

    /// The response headers stored and replayed, besides `Content-Type`
    /// (always kept). Headers not listed reach the first client only.
    /// Default: none.
    #[must_use]
    pub fn replay_headers(self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        let names = names.into_iter().collect();
        self.with(|c| c.replay_headers = names)
    }

    /// The `Retry-After` of a **409** (the key's holder is still running):
    /// when a retry is likely to find the answer stored, so set it near your
    /// handlers' usual run time. It is rounded up to whole seconds (at
    /// least 1) and capped by the holder's remaining lease.
    ///
    /// It is not the lease ([`IdempotencyKeys::with_lease`], default 60 s),
    /// which bounds one handler run: only after the lease may a retry take
    /// the key over from a holder that crashed or hangs. A retry that
    /// honours `Retry-After` and still finds the holder running gets
    /// another 409, and retries again. Default: [`DEFAULT_RETRY_AFTER`], 1 s.
    #[must_use]
    pub fn retry_after(self, after: Duration) -> Self {
        self.with(|c| c.retry_after = after)
    }

    /// What identifies "the same request" for one key: `f` gets the
    /// request's head and body and returns its fingerprint, stored with the
    /// reservation; a later request with the key and another fingerprint is
    /// answered **422**, one with the same fingerprint gets the stored
    /// response. Choose what matters to your API: the method and path, some
    /// headers, a canonical form or a subset of the body ([`json_fingerprint`]
    /// compares JSON documents, whitespace and member order aside). Build it
    /// with [`crate::fingerprint`], which keeps fields apart. An `Err` is
    /// answered **400** with its message, nothing reserved, the handler not
    /// run.
    ///
    /// Changing `f` on a live service changes the fingerprints of new
    /// requests only: a retry of a request reserved under the old `f` may
    /// then mismatch (422) until that key expires.
    ///
    /// Default: [`crate::fingerprint`] of the method, the path and query,
    /// and the exact body bytes.
    #[must_use]
    pub fn fingerprint_with(
        self,
        f: impl Fn(&Parts, &[u8]) -> Result<String, BoxError> + Send + Sync + 'static,
    ) -> Self {
        let f: Arc<fingerprint::FingerprintFn> = Arc::new(f);
        self.with(|c| c.fingerprint = Some(f))
    }

    /// The clock giving the `now` of `begin` and `complete` (leases, TTLs,
    /// `Retry-After`, stored `created_at`). For tests. Default:
    /// [`Utc::now`].
    #[must_use]
    pub fn clock(self, now: impl Fn() -> DateTime<Utc> + Send + Sync + 'static) -> Self {
        self.with(|c| c.clock = Arc::new(now))
    }
}

impl<S> tower::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> IdempotencyService<S> {
        IdempotencyService::new(inner, self.config.clone())
    }
}
