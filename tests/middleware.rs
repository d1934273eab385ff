//! The HTTP middleware against a real axum server on a socket, driven by a
//! real HTTP client: exactly-once under concurrency, replays, mismatches,
//! required keys, pass-through, server errors, takeovers and fencing,
//! tenants, body limits, bad keys, and releasing on errors and drops.
#![cfg(feature = "middleware")]

mod common;

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
use chrono::{DateTime, TimeZone, Utc};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idemstore::middleware::{IdempotencyLayer, ResponseBody};
use idemstore::{Begin, IdempotencyKeys, Store, fingerprint};
use tower::{ServiceExt as _, service_fn};

type Error = Box<dyn std::error::Error + Send + Sync>;
type TestResult = Result<(), Error>;

const LOCATION: header::HeaderName = header::LOCATION;
const REQUEST_N: &str = "x-request-n";

fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

/// The application behind the layer: counts handler runs.
#[derive(Clone)]
struct App {
    hits: Arc<AtomicUsize>,
    keys: IdempotencyKeys,
    clock: Arc<AtomicI64>,
}

/// `POST /payments`: 201 with a JSON body echoing the tenant and request,
/// `Location` and a per-run `x-request-n` header. `x-delay-ms` delays it.
async fn create(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
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
async fn list(State(app): State<App>) -> &'static str {
    app.hits.fetch_add(1, Ordering::SeqCst);
    "[]"
}

/// `POST /fail`: 503 every time.
async fn fail(State(app): State<App>) -> (StatusCode, &'static str) {
    let n = app.hits.fetch_add(1, Ordering::SeqCst);
    if n == 0 {
        (StatusCode::SERVICE_UNAVAILABLE, "busy")
    } else {
        (StatusCode::INTERNAL_SERVER_ERROR, "boom")
    }
}

/// `POST /big`: a body of `x-len` bytes.
async fn big(State(app): State<App>, headers: HeaderMap) -> Vec<u8> {
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
async fn overrun(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
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

struct Server {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    keys: IdempotencyKeys,
    clock: Arc<AtomicI64>,
    client: Client<HttpConnector, Full<Bytes>>,
    _store: Store,
    _dir: tempfile::TempDir,
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

impl Server {
    /// A server whose routes sit behind `configure(layer)`; the layer's
    /// clock reads `t(self.clock)`.
    async fn start(
        configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    ) -> Result<Self, Error> {
        let dir = tempfile::tempdir()?;
        let store = Store::open(dir.path().join("api.idem"))?;
        let keys = store.idempotency_keys();
        let clock = Arc::new(AtomicI64::new(0));
        let hits = Arc::new(AtomicUsize::new(0));
        let app = App {
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
            .route("/payments", post(create).get(list))
            .route("/fail", post(fail))
            .route("/big", post(big))
            .route("/overrun", post(overrun))
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
            _store: store,
            _dir: dir,
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
        Ok(self.keys.list(None, 1000)?.len())
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_run_the_handler_once() -> TestResult {
    let server = Arc::new(Server::start(|l| l).await?);
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

#[tokio::test]
async fn a_retry_replays_status_body_and_allowed_headers() -> TestResult {
    let server = Server::start(|l| l).await?;
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

#[tokio::test]
async fn a_changed_body_under_the_same_key_is_422() -> TestResult {
    let server = Server::start(|l| l).await?;
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

#[tokio::test]
async fn a_required_key_that_is_missing_is_400() -> TestResult {
    let server = Server::start(|l| l.require_key(true)).await?;
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

#[tokio::test]
async fn without_a_key_or_with_another_method_requests_pass_through() -> TestResult {
    let server = Server::start(|l| l).await?;
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

#[tokio::test]
async fn a_server_error_lets_the_retry_run() -> TestResult {
    let server = Server::start(|l| l).await?;
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

#[tokio::test]
async fn cached_server_errors_are_replayed() -> TestResult {
    let server = Server::start(|l| l.cache_server_errors(true)).await?;
    let h = [("idempotency-key", "k-5xx")];
    let a = server.send(Method::POST, "/fail", &h, "{}").await?;
    let b = server.send(Method::POST, "/fail", &h, "{}").await?;
    assert_eq!((b.status, &b.body), (a.status, &a.body));
    assert_eq!(b.status, 503);
    assert!(b.replayed());
    assert_eq!(server.hits(), 1);
    Ok(())
}

#[tokio::test]
async fn a_crashed_holder_is_taken_over_after_its_lease() -> TestResult {
    let server = Server::start(|l| l).await?;
    let body = "{\"amount\":10}";
    let fp = fingerprint("POST", "/payments", body.as_bytes());
    // A holder that reserved the key at t(0) and died.
    let Begin::Proceed(_) = server.keys.begin("", "k-crash", &fp, t(0))? else {
        panic!("expected to reserve");
    };
    server.set_clock(30);
    let reply = server.post("k-crash", body).await?;
    reply.assert_problem(409, Some("k-crash"));
    assert_eq!(reply.header("retry-after"), Some("30"));
    assert_eq!(server.hits(), 0);

    server.set_clock(61);
    let reply = server.post("k-crash", body).await?;
    assert_eq!(reply.status, 201);
    assert!(!reply.replayed());
    assert_eq!(server.hits(), 1);
    assert_eq!(server.keys.stats().takeovers, 1);
    assert!(server.post("k-crash", body).await?.replayed());
    Ok(())
}

#[tokio::test]
async fn a_holder_past_its_lease_is_fenced_out_but_answers_its_client() -> TestResult {
    let server = Server::start(|l| l).await?;
    let h = [("idempotency-key", "k-late")];
    let a = server.send(Method::POST, "/overrun", &h, "{}").await?;
    assert_eq!((a.status.as_u16(), a.text()), (201, "first holder"));
    assert_eq!(server.keys.stats().fenced_out, 1);
    let b = server.send(Method::POST, "/overrun", &h, "{}").await?;
    assert!(b.replayed());
    assert_eq!(b.text(), "second holder");
    assert_eq!(server.hits(), 1);
    Ok(())
}

#[tokio::test]
async fn tenants_never_see_each_others_responses() -> TestResult {
    let server = Server::start(|l| {
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

#[tokio::test]
async fn an_oversized_request_body_is_413_and_reserves_nothing() -> TestResult {
    let server = Server::start(|l| l.max_body(16)).await?;
    let reply = server.post("k-big", &"x".repeat(17)).await?;
    reply.assert_problem(413, Some("k-big"));
    assert_eq!(server.hits(), 0);
    assert_eq!(server.rows()?, 0);
    assert_eq!(server.post("k-big", &"x".repeat(16)).await?.status, 201);
    Ok(())
}

#[tokio::test]
async fn an_oversized_response_reaches_its_client_unstored() -> TestResult {
    let server = Server::start(|l| l.max_body(64)).await?;
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

#[tokio::test]
async fn bad_keys_are_400() -> TestResult {
    let server = Server::start(|l| l).await?;
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
fn direct<F, Fut>(
    keys: IdempotencyKeys,
    handler: F,
) -> impl tower::Service<
    http::Request<Full<Bytes>>,
    Response = http::Response<ResponseBody>,
    Error = &'static str,
    Future = impl Send,
> + Clone
where
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

#[tokio::test]
async fn an_inner_error_releases_the_key() -> TestResult {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    let svc = direct(keys.clone(), |_| async { Err("down") });
    assert_eq!(
        svc.clone().oneshot(keyed("k-err")?).await.err(),
        Some("down")
    );
    assert!(keys.list(None, 10)?.is_empty(), "released");
    let ok = direct(keys.clone(), |_| async {
        Ok(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
    });
    assert_eq!(ok.oneshot(keyed("k-err")?).await?.status(), 200);
    Ok(())
}

#[tokio::test]
async fn a_dropped_request_releases_the_key() -> TestResult {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
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
    assert_eq!(
        keys.list(None, 10)?.len(),
        1,
        "reserved while the handler runs"
    );
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    // The guard releases on a blocking thread: wait for it, not for a lease.
    wait_until_free(&keys).await
}

#[tokio::test]
async fn a_panicking_handler_releases_the_key() -> TestResult {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    let svc = direct(keys.clone(), |req: http::Request<Full<Bytes>>| async move {
        assert!(req.uri() != "/orders", "handler bug");
        Ok(http::Response::new(Full::new(Bytes::new())))
    });
    let call = tokio::spawn(svc.oneshot(keyed("k-panic")?));
    assert!(call.await.unwrap_err().is_panic());
    wait_until_free(&keys).await
}

/// Waits for a drop guard's release, which runs on a blocking thread.
async fn wait_until_free(keys: &IdempotencyKeys) -> TestResult {
    for _ in 0..500 {
        if keys.list(None, 10)?.is_empty() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Err("the reservation was not released".into())
}

#[tokio::test]
async fn a_store_error_is_503_and_the_handler_does_not_run() -> TestResult {
    let disk = common::FaultyDisk::new();
    let store = Store::builder().open_with_backend(disk.backend())?;
    let keys = store.idempotency_keys();
    let ran = Arc::new(AtomicUsize::new(0));
    let counter = ran.clone();
    let svc = direct(keys.clone(), move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
        async { Ok(http::Response::new(Full::new(Bytes::from_static(b"ok")))) }
    });
    disk.lose_power();
    let reply = svc.oneshot(keyed("k-down")?).await?;
    assert_eq!(reply.status(), 503);
    let body = reply.into_body().collect().await?.to_bytes();
    assert!(std::str::from_utf8(&body)?.contains("\"idempotency_key\":\"k-down\""));
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    Ok(())
}
