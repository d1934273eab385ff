//! The layer in front of a real axum server on a socket, driven by a real
//! HTTP client, and in front of plain tower services: exactly-once under
//! concurrency, replays, mismatches, required keys, pass-through, server
//! errors, takeovers and fencing, tenants, body limits, bad keys, and
//! releasing on errors and drops. Generic over the [`Backend`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idemstore::middleware::{IdempotencyLayer, ResponseBody, json_fingerprint};
use idemstore::{Begin, IdempotencyBackend, fingerprint};
use tower::{ServiceExt as _, service_fn};

use super::{Backend, Error, TestResult, t};

const LOCATION: header::HeaderName = header::LOCATION;
const REQUEST_N: &str = "x-request-n";

/// The application behind the layer: counts handler runs.
struct App<B: Backend> {
    hits: Arc<AtomicUsize>,
    keys: B::Keys,
    clock: Arc<AtomicI64>,
}

impl<B: Backend> Clone for App<B> {
    fn clone(&self) -> Self {
        App {
            hits: self.hits.clone(),
            keys: self.keys.clone(),
            clock: self.clock.clone(),
        }
    }
}

/// `POST /payments`: 201 with a JSON body echoing the tenant and request,
/// `Location` and a per-run `x-request-n` header. `x-delay-ms` delays it.
async fn create<B: Backend>(
    State(app): State<App<B>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let n = app.hits.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(ms) = headers.get("x-delay-ms").and_then(|v| v.to_str().ok()) {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap_or(0))).await;
    }
    let tenant = headers
        .get("x-tenant")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let json = format!(
        "{{\"payment\":{n},\"tenant\":\"{tenant}\",\"request\":\"{}\"}}",
        String::from_utf8_lossy(&body)
    );
    (
        StatusCode::CREATED,
        [
            (header::CONTENT_TYPE, "application/json".to_owned()),
            (LOCATION, format!("/payments/{n}")),
            (header::HeaderName::from_static(REQUEST_N), n.to_string()),
        ],
        json,
    )
        .into_response()
}

/// `GET /payments`: counts and answers 200.
async fn list<B: Backend>(State(app): State<App<B>>) -> &'static str {
    app.hits.fetch_add(1, Ordering::SeqCst);
    "[]"
}

/// `POST /fail`: 503 every time.
async fn fail<B: Backend>(State(app): State<App<B>>) -> (StatusCode, &'static str) {
    let n = app.hits.fetch_add(1, Ordering::SeqCst);
    if n == 0 {
        (StatusCode::SERVICE_UNAVAILABLE, "busy")
    } else {
        (StatusCode::INTERNAL_SERVER_ERROR, "boom")
    }
}

/// `POST /big`: a body of `x-len` bytes.
async fn big<B: Backend>(State(app): State<App<B>>, headers: HeaderMap) -> Vec<u8> {
    app.hits.fetch_add(1, Ordering::SeqCst);
    let len = headers
        .get("x-len")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    vec![b'b'; len]
}

/// `POST /overrun`: runs past its lease; meanwhile a retry (simulated
/// through the store at a later time) takes the key over and completes.
async fn overrun<B: Backend>(
    State(app): State<App<B>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    app.hits.fetch_add(1, Ordering::SeqCst);
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    let fp = fingerprint("POST", "/overrun", &body);
    let late = t(1000);
    app.clock.store(1000, Ordering::SeqCst);
    let keys = app.keys.clone();
    tokio::task::spawn_blocking(move || {
        let Begin::Proceed(r) = keys.begin("", &key, &fp, late).unwrap() else {
            panic!("expected a takeover");
        };
        assert!(
            keys.complete(&r, r.response(201, &b"second holder"[..], late), late)
                .unwrap()
        );
    })
    .await
    .unwrap();
    (StatusCode::CREATED, "first holder").into_response()
}

struct Server<B: Backend> {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    keys: B::Keys,
    clock: Arc<AtomicI64>,
    client: Client<HttpConnector, Full<Bytes>>,
    store: B,
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn text(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap_or("<binary>")
    }

    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Checks a problem+json answer naming `key`.
    fn assert_problem(&self, status: u16, key: Option<&str>) {
        assert_eq!(self.status, status, "{}", self.text());
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let text = self.text();
        for member in ["\"type\":", "\"title\":", "\"detail\":"] {
            assert!(text.contains(member), "{text}");
        }
        assert!(text.contains(&format!("\"status\":{status}")), "{text}");
        if let Some(key) = key {
            assert!(
                text.contains(&format!("\"idempotency_key\":\"{key}\"")),
                "{text}"
            );
            assert!(
                text.contains(&format!("Idempotency-Key \\\"{key}\\\"")),
                "{text}"
            );
        } else {
            assert!(text.contains("Idempotency-Key"), "{text}");
        }
    }
}

impl<B: Backend> Server<B> {
    /// A server whose routes sit behind `configure(layer)`; the layer's
    /// clock reads `t(self.clock)`.
    async fn start(
        store: B,
        configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    ) -> Result<Self, Error> {
        let keys = store.keys();
        let clock = Arc::new(AtomicI64::new(0));
        let hits = Arc::new(AtomicUsize::new(0));
        let app = App::<B> {
            hits: hits.clone(),
            keys: keys.clone(),
            clock: clock.clone(),
        };
        let now = clock.clone();
        let layer = configure(
            IdempotencyLayer::new(keys.clone())
                .replay_headers([LOCATION])
                .clock(move || t(now.load(Ordering::SeqCst))),
        );
        let router = Router::new()
            .route("/payments", post(create::<B>).get(list::<B>))
            .route("/fail", post(fail::<B>))
            .route("/big", post(big::<B>))
            .route("/overrun", post(overrun::<B>))
            .with_state(app)
            .layer(layer);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move { axum::serve(listener, router).await });
        Ok(Server {
            addr,
            hits,
            keys,
            clock,
            client: Client::builder(TokioExecutor::new()).build_http(),
            store,
        })
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    fn set_clock(&self, secs: i64) {
        self.clock.store(secs, Ordering::SeqCst);
    }

    /// Rows (reservations and responses) in the store.
    fn rows(&self) -> Result<usize, Error> {
        self.store.rows()
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Result<Reply, Error> {
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr));
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let response = self
            .client
            .request(req.body(Full::new(Bytes::from(body.to_owned())))?)
            .await?;
        let (parts, body) = response.into_parts();
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await?.to_bytes(),
        })
    }

    async fn post(&self, key: &str, body: &str) -> Result<Reply, Error> {
        self.send(Method::POST, "/payments", &[("idempotency-key", key)], body)
            .await
    }
}

pub(crate) async fn concurrent_duplicates_run_the_handler_once<B: Backend>() -> TestResult {
    let server = Arc::new(Server::start(backend!(B), |l| l).await?);
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let s = server.clone();
            tokio::spawn(async move {
                s.send(
                    Method::POST,
                    "/payments",
                    &[("idempotency-key", "pay-1"), ("x-delay-ms", "300")],
                    "{\"amount\":10}",
                )
                .await
            })
        })
        .collect();
    let mut first = Vec::new();
    let (mut conflicts, mut replays) = (0, Vec::new());
    for task in tasks {
        let reply = task.await??;
        match reply.status.as_u16() {
            201 if reply.replayed() => replays.push(reply),
            201 => first.push(reply),
            409 => {
                reply.assert_problem(409, Some("pay-1"));
                let retry: u64 = reply
                    .header("retry-after")
                    .ok_or("no Retry-After")?
                    .parse()?;
                assert!((1..=60).contains(&retry), "Retry-After {retry}");
                conflicts += 1;
            }
            other => panic!("unexpected {other}: {}", reply.text()),
        }
    }
    assert_eq!(server.hits(), 1, "the handler ran once");
    assert_eq!(first.len(), 1);
    assert_eq!(conflicts + replays.len(), 19);
    assert!(conflicts > 0, "the requests overlapped the handler run");
    for r in &replays {
        assert_eq!(r.body, first[0].body);
    }
    Ok(())
}

pub(crate) async fn a_retry_replays_status_body_and_allowed_headers<B: Backend>() -> TestResult {
    let server = Server::start(backend!(B), |l| l).await?;
    let key = "123e4567-e89b-12d3-a456-426614174000";
    let a = server.post(key, "{\"amount\":10}").await?;
    assert_eq!(a.status, 201);
    assert!(!a.replayed());
    assert_eq!(
        a.header(REQUEST_N),
        Some("1"),
        "the first client gets every header"
    );

    let b = server.post(key, "{\"amount\":10}").await?;
    assert_eq!(server.hits(), 1);
    assert_eq!(b.status, a.status);
    assert_eq!(b.body, a.body);
    assert!(b.replayed());
    assert_eq!(b.header("content-type"), Some("application/json"));
    assert_eq!(b.header("location"), a.header("location"));
    assert_eq!(b.header("location"), Some("/payments/1"));
    assert_eq!(b.header(REQUEST_N), None, "not allow-listed, not replayed");

    // The same key as an RFC 8941 string is the same key.
    let c = server
        .post(&format!("\"{key}\""), "{\"amount\":10}")
        .await?;
    assert!(c.replayed());
    assert_eq!(c.body, a.body);
    assert_eq!(server.hits(), 1);
    Ok(())
}

pub(crate) async fn a_changed_body_under_the_same_key_is_422<B: Backend>() -> TestResult {
    let server = Server::start(backend!(B), |l| l).await?;
    assert_eq!(server.post("k-422", "{\"amount\":10}").await?.status, 201);
    let reply = server.post("k-422", "{\"amount\":99}").await?;
    reply.assert_problem(422, Some("k-422"));
    // Another path under the same key is another request too.
    let reply = server
        .send(
            Method::POST,
            "/big",
            &[("idempotency-key", "k-422")],
            "{\"amount\":10}",
        )
        .await?;
    reply.assert_problem(422, Some("k-422"));
    assert_eq!(server.hits(), 1);
    Ok(())
}

pub(crate) async fn a_required_key_that_is_missing_is_400<B: Backend>() -> TestResult {
    let server = Server::start(backend!(B), |l| l.require_key(true)).await?;
    let reply = server.send(Method::POST, "/payments", &[], "{}").await?;
    reply.assert_problem(400, None);
    assert_eq!(server.hits(), 0);
    // Other methods still pass through without a key.
    assert_eq!(
        server.send(Method::GET, "/payments", &[], "").await?.status,
        200
    );
    assert_eq!(server.hits(), 1);
    assert_eq!(server.rows()?, 0);
    Ok(())
}

pub(crate) async fn without_a_key_or_with_another_method_requests_pass_through<B: Backend>()
-> TestResult {
    let server = Server::start(backend!(B), |l| l).await?;
    for _ in 0..2 {
        let reply = server.send(Method::POST, "/payments", &[], "{}").await?;
        assert_eq!(reply.status, 201);
        assert!(!reply.replayed());
    }
    for key in ["k-get", "bad,key", ""] {
        let reply = server
            .send(Method::GET, "/payments", &[("idempotency-key", key)], "")
            .await?;
        assert_eq!(reply.status, 200);
        assert!(!reply.replayed());
    }
    assert_eq!(server.hits(), 5);
    assert_eq!(server.rows()?, 0, "pass-through reserves nothing");
    Ok(())
}

pub(crate) async fn a_server_error_lets_the_retry_run<B: Backend>() -> TestResult {
    let server = Server::start(backend!(B), |l| l).await?;
    let h = [("idempotency-key", "k-5xx")];
    let a = server.send(Method::POST, "/fail", &h, "{}").await?;
    assert_eq!((a.status.as_u16(), a.text()), (503, "busy"));
    let b = server.send(Method::POST, "/fail", &h, "{}").await?;
    assert_eq!((b.status.as_u16(), b.text()), (500, "boom"));
    assert!(!b.replayed());
    assert_eq!(server.hits(), 2);
    assert_eq!(server.rows()?, 0);
    Ok(())
}

pub(crate) async fn cached_server_errors_are_replayed<B: Backend>() -> TestResult {
    let server = Server::start(backend!(B), |l| l.cache_server_errors(true)).await?;
    let h = [("idempotency-key", "k-5xx")];
    let a = server.send(Method::POST, "/fail", &h, "{}").await?;
    let b = server.send(Method::POST, "/fail", &h, "{}").await?;
    assert_eq!((b.status, &b.body), (a.status, &a.body));
    assert_eq!(b.status, 503);
    assert!(b.replayed());
    assert_eq!(server.hits(), 1);
    Ok(())
}

pub(crate) async fn retry_after_is_the_configured_wait_capped_by_the_lease<B: Backend>()
-> TestResult {
    let server = Server::start(backend!(B), |l| l.retry_after(Duration::from_secs(5))).await?;
    let body = "{\"amount\":10}";
    let fp = fingerprint("POST", "/payments", body.as_bytes());
    // A holder that reserved the key at t(0), its lease ending at t(60).
    let keys = server.keys.clone();
    let begin = tokio::task::spawn_blocking(move || keys.begin("", "k-wait", &fp, t(0)));
    let Begin::Proceed(_) = begin.await?? else {
        panic!("expected to reserve");
    };
    for (now, want) in [(0, "5"), (50, "5"), (58, "2"), (59, "1")] {
        server.set_clock(now);
        let reply = server.post("k-wait", body).await?;
        reply.assert_problem(409, Some("k-wait"));
        assert_eq!(reply.header("retry-after"), Some(want), "at t({now})");
        assert!(reply.text().contains(&format!("retry after {want} s")));
    }
    assert_eq!(server.hits(), 0);
    Ok(())
}

pub(crate) async fn json_bodies_compare_as_documents_under_json_fingerprint<B: Backend>()
-> TestResult {
    let store = backend!(B);
    let first = "{\"amount\":10,\"currency\":\"eur\"}";
    let same = "{ \"currency\": \"eur\",\n  \"amount\": 10 }";
    // By default the body's bytes are the request: another layout is 422.
    let exact = Server::start(store.clone(), |l| l).await?;
    assert_eq!(exact.post("k-json", first).await?.status, 201);
    exact
        .post("k-json", same)
        .await?
        .assert_problem(422, Some("k-json"));
    assert_eq!(exact.hits(), 1);

    let server = Server::start(store, |l| l.fingerprint_with(json_fingerprint)).await?;
    let a = server.post("k-doc", first).await?;
    assert_eq!((a.status, a.replayed()), (StatusCode::CREATED, false));
    let b = server.post("k-doc", same).await?;
    assert_eq!((b.status, b.replayed()), (StatusCode::CREATED, true));
    assert_eq!(b.body, a.body);
    let other = "{\"amount\":11,\"currency\":\"eur\"}";
    server
        .post("k-doc", other)
        .await?
        .assert_problem(422, Some("k-doc"));
    // A body that is not JSON is refused before anything is reserved.
    let rows = server.rows()?;
    let bad = server.post("k-bad", "amount=10").await?;
    bad.assert_problem(400, Some("k-bad"));
    assert!(bad.text().contains("not JSON"), "{}", bad.text());
    assert_eq!(server.rows()?, rows);
    assert_eq!(server.hits(), 1);
    Ok(())
}

pub(crate) async fn a_crashed_holder_is_taken_over_after_its_lease<B: Backend>() -> TestResult {
    let server = Server::start(backend!(B), |l| l).await?;
    let body = "{\"amount\":10}";
    let fp = fingerprint("POST", "/payments", body.as_bytes());
    // A holder that reserved the key at t(0) and died.
    let keys = server.keys.clone();
    let begin = tokio::task::spawn_blocking(move || keys.begin("", "k-crash", &fp, t(0)));
    let Begin::Proceed(_) = begin.await?? else {
        panic!("expected to reserve");
    };
    server.set_clock(30);
    let reply = server.post("k-crash", body).await?;
    reply.assert_problem(409, Some("k-crash"));
    // The default wait, not the 30 s left on the lease.
    assert_eq!(reply.header("retry-after"), Some("1"));
    assert_eq!(server.hits(), 0);

    server.set_clock(61);
    let reply = server.post("k-crash", body).await?;
    assert_eq!(reply.status, 201);
    assert!(!reply.replayed());
    assert_eq!(server.hits(), 1);
    assert_eq!(server.store.stats().takeovers, 1);
    assert!(server.post("k-crash", body).await?.replayed());
    Ok(())
}

pub(crate) async fn a_holder_past_its_lease_is_fenced_out_but_answers_its_client<B: Backend>()
-> TestResult {
    let server = Server::start(backend!(B), |l| l).await?;
    let h = [("idempotency-key", "k-late")];
    let a = server.send(Method::POST, "/overrun", &h, "{}").await?;
    assert_eq!((a.status.as_u16(), a.text()), (201, "first holder"));
    assert_eq!(server.store.stats().fenced_out, 1);
    let b = server.send(Method::POST, "/overrun", &h, "{}").await?;
    assert!(b.replayed());
    assert_eq!(b.text(), "second holder");
    assert_eq!(server.hits(), 1);
    Ok(())
}

pub(crate) async fn tenants_never_see_each_others_responses<B: Backend>() -> TestResult {
    let server = Server::start(backend!(B), |l| {
        l.tenant_from(|parts| {
            parts
                .headers
                .get("x-tenant")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        })
    })
    .await?;
    let server = &server;
    let send = |tenant: &'static str| async move {
        server
            .send(
                Method::POST,
                "/payments",
                &[("idempotency-key", "shared"), ("x-tenant", tenant)],
                "{}",
            )
            .await
    };
    let a = send("acme").await?;
    let b = send("globex").await?;
    assert!(!a.replayed() && !b.replayed());
    assert!(a.text().contains("\"tenant\":\"acme\""));
    assert!(b.text().contains("\"tenant\":\"globex\""));
    let a2 = send("acme").await?;
    let b2 = send("globex").await?;
    assert!(a2.replayed() && b2.replayed());
    assert_eq!((a2.body, b2.body), (a.body, b.body));
    assert_eq!(server.hits(), 2);

    let reply = server.post("no-tenant", "{}").await?;
    reply.assert_problem(400, Some("no-tenant"));
    assert_eq!(server.hits(), 2);
    Ok(())
}

pub(crate) async fn an_oversized_request_body_is_413_and_reserves_nothing<B: Backend>() -> TestResult
{
    let server = Server::start(backend!(B), |l| l.max_body(16)).await?;
    let reply = server.post("k-big", &"x".repeat(17)).await?;
    reply.assert_problem(413, Some("k-big"));
    assert_eq!(server.hits(), 0);
    assert_eq!(server.rows()?, 0);
    assert_eq!(server.post("k-big", &"x".repeat(16)).await?.status, 201);
    Ok(())
}

pub(crate) async fn an_oversized_response_reaches_its_client_unstored<B: Backend>() -> TestResult {
    let server = Server::start(backend!(B), |l| l.max_body(64)).await?;
    let h = [("idempotency-key", "k-bigresp"), ("x-len", "65")];
    let a = server.send(Method::POST, "/big", &h, "{}").await?;
    assert_eq!((a.status.as_u16(), a.body.len()), (200, 65));
    let b = server.send(Method::POST, "/big", &h, "{}").await?;
    assert_eq!((b.status.as_u16(), b.body.len()), (200, 65));
    assert!(!b.replayed());
    assert_eq!(server.hits(), 2, "not stored: the retry ran again");
    assert_eq!(server.rows()?, 0);
    // At the limit it is stored.
    let h = [("idempotency-key", "k-fits"), ("x-len", "64")];
    server.send(Method::POST, "/big", &h, "{}").await?;
    assert!(
        server
            .send(Method::POST, "/big", &h, "{}")
            .await?
            .replayed()
    );
    Ok(())
}

pub(crate) async fn bad_keys_are_400<B: Backend>() -> TestResult {
    let server = Server::start(backend!(B), |l| l).await?;
    let long = "k".repeat(256);
    let cases: [&[(&str, &str)]; 6] = [
        &[("idempotency-key", "")],
        &[("idempotency-key", "\"\"")],
        &[("idempotency-key", "a"), ("idempotency-key", "b")],
        &[("idempotency-key", &long)],
        &[("idempotency-key", "a,b")],
        &[("idempotency-key", "\"unclosed")],
    ];
    for headers in cases {
        let reply = server
            .send(Method::POST, "/payments", headers, "{}")
            .await?;
        reply.assert_problem(400, None);
    }
    assert_eq!(server.hits(), 0);
    assert_eq!(server.rows()?, 0);
    let ok = "k".repeat(255);
    assert_eq!(server.post(&ok, "{}").await?.status, 201);
    Ok(())
}

/// The layer over a plain tower service, without a server.
fn direct<K, F, Fut>(
    keys: K,
    handler: F,
) -> impl tower::Service<
    http::Request<Full<Bytes>>,
    Response = http::Response<ResponseBody>,
    Error = &'static str,
    Future = impl Send,
> + Clone
where
    K: IdempotencyBackend,
    F: Fn(http::Request<Full<Bytes>>) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<http::Response<Full<Bytes>>, &'static str>> + Send + 'static,
{
    tower::Layer::layer(
        &IdempotencyLayer::new(keys).clock(|| t(0)),
        service_fn(handler),
    )
}

fn keyed(key: &str) -> Result<http::Request<Full<Bytes>>, Error> {
    Ok(http::Request::post("/orders")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"{}")))?)
}

pub(crate) async fn an_inner_error_releases_the_key<B: Backend>() -> TestResult {
    let store = backend!(B);
    let keys = store.keys();
    let svc = direct(keys.clone(), |_| async { Err("down") });
    assert_eq!(
        svc.clone().oneshot(keyed("k-err")?).await.err(),
        Some("down")
    );
    assert_eq!(store.rows()?, 0, "released");
    let ok = direct(keys.clone(), |_| async {
        Ok(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
    });
    assert_eq!(ok.oneshot(keyed("k-err")?).await?.status(), 200);
    Ok(())
}

pub(crate) async fn a_dropped_request_releases_the_key<B: Backend>() -> TestResult {
    let store = backend!(B);
    let keys = store.keys();
    let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
    let started_tx = Arc::new(std::sync::Mutex::new(Some(started_tx)));
    let svc = direct(keys.clone(), move |_| {
        let started_tx = started_tx.clone();
        async move {
            if let Some(tx) = started_tx.lock().unwrap().take() {
                let _ = tx.send(());
            }
            std::future::pending::<Result<http::Response<Full<Bytes>>, &'static str>>().await
        }
    });
    let call = tokio::spawn(svc.oneshot(keyed("k-drop")?));
    started.await?;
    assert_eq!(store.rows()?, 1, "reserved while the handler runs");
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    // The guard releases on a blocking thread: wait for it, not for a lease.
    wait_until_free(&store).await
}

pub(crate) async fn a_panicking_handler_releases_the_key<B: Backend>() -> TestResult {
    let store = backend!(B);
    let keys = store.keys();
    let svc = direct(keys.clone(), |req: http::Request<Full<Bytes>>| async move {
        assert!(req.uri() != "/orders", "handler bug");
        Ok(http::Response::new(Full::new(Bytes::new())))
    });
    let call = tokio::spawn(svc.oneshot(keyed("k-panic")?));
    assert!(call.await.unwrap_err().is_panic());
    wait_until_free(&store).await
}

/// Waits for a drop guard's release, which runs on a blocking thread.
async fn wait_until_free<B: Backend>(store: &B) -> TestResult {
    for _ in 0..500 {
        if store.rows()? == 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Err("the reservation was not released".into())
}

/// A `#[tokio::test]` of each test above, for backend `$b`, at the root of
/// the test binary (`mod suite` is `tests/middleware/mod.rs`).
macro_rules! middleware_http_suite {
    ($b:ty) => {
        middleware_http_suite!(@multi $b; concurrent_duplicates_run_the_handler_once);
        middleware_http_suite!(@one $b;
            a_retry_replays_status_body_and_allowed_headers,
            a_changed_body_under_the_same_key_is_422,
            a_required_key_that_is_missing_is_400,
            without_a_key_or_with_another_method_requests_pass_through,
            a_server_error_lets_the_retry_run,
            cached_server_errors_are_replayed,
            a_crashed_holder_is_taken_over_after_its_lease,
            retry_after_is_the_configured_wait_capped_by_the_lease,
            json_bodies_compare_as_documents_under_json_fingerprint,
            a_holder_past_its_lease_is_fenced_out_but_answers_its_client,
            tenants_never_see_each_others_responses,
            an_oversized_request_body_is_413_and_reserves_nothing,
            an_oversized_response_reaches_its_client_unstored,
            bad_keys_are_400,
            an_inner_error_releases_the_key,
            a_dropped_request_releases_the_key,
            a_panicking_handler_releases_the_key
        );
    };
    (@multi $b:ty; $($name:ident),*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() -> crate::suite::TestResult {
            crate::suite::http::$name::<$b>().await
        }
    )*};
    (@one $b:ty; $($name:ident),*) => {$(
        #[tokio::test]
        async fn $name() -> crate::suite::TestResult {
            crate::suite::http::$name::<$b>().await
        }
    )*};
}
