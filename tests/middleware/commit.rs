//! A handler behind the layer that stores its response with `complete_in`,
//! in the same write as its own rows, runs once per key whatever happens
//! after that commit: a 5xx, a panic, an `Err` from the inner or an outer
//! service, a dropped request, or a crash of the process (a child that
//! aborts right after the commit). The retry is replayed at once, the lease
//! untouched (the layer's clock does not move past it), and the order row
//! exists once. The layer's own `complete` and `release` leave the
//! handler's response alone. Generic over the [`Backend`].

use std::convert::Infallible;
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::SocketAddr;
use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Extension, State};
use axum::http::{Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemstore::middleware::{IdempotencyLayer, to_response};
use idemstore::{Begin, IdempotencyBackend as _, Reservation, fingerprint};
use tower::{ServiceExt as _, service_fn};

use super::{Backend, Error, TestResult, t};

const BODY: &str = "{\"sku\":42}";
const CHILD_ENV: &str = "IDEMSTORE_MIDDLEWARE_CRASH_STORE";
/// Bounds every wait on the child process.
const CHILD_DEADLINE: Duration = Duration::from_secs(60);

/// What the handler does once its order and response are committed.
#[derive(Clone, Copy, Debug)]
enum Then {
    /// Answers this status with a body of its own (not the stored one).
    Answer(StatusCode),
    /// Answers with the response it stored, through `to_response`.
    Stored,
    Panic,
    /// Never answers (until the request is dropped).
    Hang,
    /// Prints `committed` and aborts the process.
    Abort,
}

struct App<B: Backend> {
    store: B,
    runs: Arc<AtomicUsize>,
    committed: Arc<tokio::sync::Notify>,
    then: Then,
}

impl<B: Backend> Clone for App<B> {
    fn clone(&self) -> Self {
        App {
            store: self.store.clone(),
            runs: self.runs.clone(),
            committed: self.committed.clone(),
            then: self.then,
        }
    }
}

/// `POST /orders`: an axum handler taking the reservation from the layer.
async fn create_order<B: Backend>(
    State(app): State<App<B>>,
    Extension(r): Extension<Reservation>,
) -> Response {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let store = app.store.clone();
    let placed = tokio::task::spawn_blocking(move || store.place_order(&r, t(0))).await;
    let Ok(Ok(stored)) = placed else {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    app.committed.notify_one();
    match app.then {
        Then::Answer(status) => (status, "answered after the commit").into_response(),
        Then::Stored => to_response(&stored).into_response(),
        Then::Panic => panic!("the handler panics after its commit"),
        Then::Hang => std::future::pending::<Response>().await,
        Then::Abort => {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "committed");
            let _ = out.flush();
            std::process::abort()
        }
    }
}

impl<B: Backend> App<B> {
    fn new(store: &B, then: Then) -> App<B> {
        App {
            store: store.clone(),
            runs: Arc::default(),
            committed: Arc::default(),
            then,
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    /// The app behind the layer, whose clock stands at `t(at)`.
    fn router(&self, at: i64) -> Router {
        Router::new()
            .route("/orders", post(create_order::<B>))
            .with_state(self.clone())
            .layer(layer(&self.store, at))
    }
}

/// The layer under test, its clock standing at `t(at)`: the lease (60 s)
/// never ends unless a test moves past it, which none does.
fn layer<B: Backend>(store: &B, at: i64) -> IdempotencyLayer {
    IdempotencyLayer::new(store.keys())
        .require_key(true)
        .replay_headers([header::LOCATION])
        .clock(move || t(at))
}

fn order(key: &str) -> Result<Request<Body>, Error> {
    Ok(Request::post("/orders")
        .header("idempotency-key", key)
        .body(Body::from(BODY))?)
}

struct Reply {
    status: StatusCode,
    replayed: bool,
    location: Option<String>,
    content_type: Option<String>,
    body: Bytes,
}

impl Reply {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

async fn reply<B>(response: Response<B>) -> Result<Reply, Error>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Error>,
{
    let (parts, body) = response.into_parts();
    let header = |name| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    Ok(Reply {
        status: parts.status,
        replayed: parts
            .headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true"),
        location: header(header::LOCATION),
        content_type: header(header::CONTENT_TYPE),
        body: body.collect().await.map_err(Into::into)?.to_bytes(),
    })
}

/// Sends the retry of `key` to a fresh router over `store` whose clock
/// stands at `t(at)`, and checks it is the stored 201 of order 1, replayed,
/// without running the handler; and that order 1 is the only one for `key`.
async fn assert_replayed<B: Backend>(store: &B, key: &str, at: i64) -> TestResult {
    let app = App::new(store, Then::Answer(StatusCode::CREATED));
    let retry = reply(app.router(at).oneshot(order(key)?).await?).await?;
    assert_eq!(
        (retry.status, retry.replayed),
        (StatusCode::CREATED, true),
        "{}",
        retry.text()
    );
    assert_eq!(retry.text(), "{\"order\":1}");
    assert_eq!(retry.content_type.as_deref(), Some("application/json"));
    assert_eq!(retry.location.as_deref(), Some("/orders/1"));
    assert_eq!(app.runs(), 0, "the retry did not run the handler");
    assert_eq!(store.orders_for(key)?, 1, "one order for the key");
    let stored = store.get("", key, t(-1))?;
    assert_eq!(stored.map(|r| r.response_status), Some(201));
    Ok(())
}

/// A current-thread runtime: once its tasks have ended, so have the
/// layer's store calls, the drop guard's `release` included.
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

pub(crate) async fn a_server_error_after_the_commit_replays_the_stored_response_at_once<
    B: Backend,
>() -> TestResult {
    let store = backend!(B);
    let app = App::new(&store, Then::Answer(StatusCode::INTERNAL_SERVER_ERROR));
    let first = reply(app.router(0).oneshot(order("k-500")?).await?).await?;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(first.text(), "answered after the commit");
    assert!(!first.replayed);
    assert_eq!(app.runs(), 1);
    // The layer's `release` on the 5xx left the response in place.
    assert_eq!(store.stats().released, 0);
    assert_replayed(&store, "k-500", 1).await
}

pub(crate) async fn the_layer_stores_nothing_over_the_handlers_response<B: Backend>() -> TestResult
{
    let store = backend!(B);
    let app = App::new(&store, Then::Answer(StatusCode::ACCEPTED));
    let first = reply(app.router(0).oneshot(order("k-own")?).await?).await?;
    // Its client gets what the handler answered...
    assert_eq!(first.status, StatusCode::ACCEPTED);
    assert_eq!(first.text(), "answered after the commit");
    // ...the layer's own `complete` found the key completed by this very
    // reservation, which fences nobody out and counts nothing...
    let stats = store.stats();
    assert_eq!((stats.completed, stats.fenced_out), (1, 0));
    // ...and retries get what the handler stored.
    assert_replayed(&store, "k-own", 0).await
}

pub(crate) async fn the_first_client_gets_the_response_retries_get<B: Backend>() -> TestResult {
    let store = backend!(B);
    let app = App::new(&store, Then::Stored);
    let response = app.router(0).oneshot(order("k-same")?).await?;
    let mut first_headers = response.headers().clone();
    let first = reply(response).await?;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed);
    assert_eq!(first.text(), "{\"order\":1}");
    assert_eq!(first.location.as_deref(), Some("/orders/1"));

    let retry = App::new(&store, Then::Stored)
        .router(1)
        .oneshot(order("k-same")?)
        .await?;
    let mut retry_headers = retry.headers().clone();
    let retry = reply(retry).await?;
    assert!(retry.replayed);
    // The same answer, header for header, but for the replay's mark.
    assert_eq!(
        retry_headers
            .remove("idempotent-replayed")
            .as_ref()
            .map(axum::http::HeaderValue::as_bytes),
        Some(&b"true"[..])
    );
    first_headers.remove(header::CONTENT_LENGTH);
    retry_headers.remove(header::CONTENT_LENGTH);
    assert_eq!(retry_headers, first_headers);
    assert_eq!((retry.status, &retry.body), (first.status, &first.body));
    assert_replayed(&store, "k-same", 2).await
}

pub(crate) fn a_panic_after_the_commit_replays_the_stored_response_at_once<B: Backend>()
-> TestResult {
    runtime()?.block_on(async {
        let store = backend!(B);
        let app = App::new(&store, Then::Panic);
        let call = tokio::spawn(app.router(0).oneshot(order("k-panic")?));
        assert!(call.await.expect_err("the handler panicked").is_panic());
        assert_eq!(app.runs(), 1);
        super::store_calls_done().await?;
        assert_replayed(&store, "k-panic", 1).await
    })
}

pub(crate) fn a_dropped_request_after_the_commit_replays_the_stored_response_at_once<B: Backend>()
-> TestResult {
    runtime()?.block_on(async {
        let store = backend!(B);
        let app = App::new(&store, Then::Hang);
        let mut call = tokio::spawn(app.router(0).oneshot(order("k-drop")?));
        tokio::select! {
            () = app.committed.notified() => {}
            ended = &mut call => {
                let status = ended.map(|r| r.map(|r| r.status()));
                return Err(format!("the request ended before its commit: {status:?}").into());
            }
        }
        call.abort();
        assert!(call.await.expect_err("aborted").is_cancelled());
        super::store_calls_done().await?;
        assert_replayed(&store, "k-drop", 1).await
    })
}

pub(crate) async fn an_inner_error_after_the_commit_replays_the_stored_response_at_once<
    B: Backend,
>() -> TestResult {
    let store = backend!(B);
    let runs = Arc::new(AtomicUsize::new(0));
    let inner = {
        let (store, runs) = (store.clone(), runs.clone());
        service_fn(move |req: Request<Full<Bytes>>| {
            let (store, runs) = (store.clone(), runs.clone());
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                // A tower service finds the reservation in the extensions.
                let r = req
                    .extensions()
                    .get::<Reservation>()
                    .cloned()
                    .ok_or("no reservation in the request's extensions")?;
                tokio::task::spawn_blocking(move || store.place_order(&r, t(0)))
                    .await
                    .map_err(|_| "the handler's store call panicked")?
                    .map_err(|_| "the handler's commit failed")?;
                Err::<Response<Full<Bytes>>, _>("the inner service fails after its commit")
            }
        })
    };
    let svc = tower::Layer::layer(&layer(&store, 0), inner);
    let req = Request::post("/orders")
        .header("idempotency-key", "k-inner")
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))?;
    let err = svc.oneshot(req).await.err();
    assert_eq!(err, Some("the inner service fails after its commit"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_replayed(&store, "k-inner", 1).await
}

pub(crate) async fn an_outer_error_after_the_commit_replays_the_stored_response_at_once<
    B: Backend,
>() -> TestResult {
    let store = backend!(B);
    let app = App::new(&store, Then::Answer(StatusCode::CREATED));
    let outer = tower::ServiceExt::<Request<Body>>::map_result(
        app.router(0),
        |_: Result<Response, Infallible>| Err::<Response, Error>("the outer service fails".into()),
    );
    assert_eq!(
        outer
            .oneshot(order("k-outer")?)
            .await
            .err()
            .map(|e| e.to_string()),
        Some("the outer service fails".to_owned())
    );
    assert_eq!(app.runs(), 1);
    assert_replayed(&store, "k-outer", 1).await
}

pub(crate) fn the_layers_complete_and_release_leave_a_completed_key_alone<B: Backend>() -> TestResult
{
    let store = backend!(B);
    let keys = store.keys();
    let fp = fingerprint("POST", "/orders", BODY.as_bytes());
    let Begin::Proceed(r) = keys.begin("", "k-fence", &fp, t(0))? else {
        panic!("a fresh key is reserved");
    };
    let stored = store.place_order(&r, t(0))?;
    assert!(!keys.complete(&r, r.response(500, &b"the layer's"[..], t(1)), t(1))?);
    keys.release(&r)?;
    assert_eq!(store.get("", "k-fence", t(-1))?, Some(stored.clone()));
    assert_eq!(keys.begin("", "k-fence", &fp, t(1))?, Begin::Replay(stored));
    Ok(())
}

/// The child: serves the app on loopback, prints `listening ADDR`; its
/// handler commits, prints `committed` and aborts the process.
pub(crate) fn crash_child<B: Backend>() -> TestResult {
    let Ok(address) = std::env::var(CHILD_ENV) else {
        return Ok(());
    };
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?
        .block_on(async {
            let store = B::open_at(&address)?;
            let router = App::new(&store, Then::Abort).router(0);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let mut out = std::io::stdout().lock();
            writeln!(out, "listening {}", listener.local_addr()?)?;
            out.flush()?;
            drop(out);
            // Bounded: a child the parent lost track of exits on its own.
            tokio::time::timeout(CHILD_DEADLINE, axum::serve(listener, router))
                .await
                .map_err(|_| "the child was never asked to commit")??;
            Ok(())
        })
}

/// Kills the child if the test fails before it exits by itself.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn a_crash_after_the_commit_replays_the_stored_response_at_once<B: Backend>()
-> TestResult {
    let Some((address, _remove)) = B::new_address() else {
        return Ok(());
    };
    let mut child = Reaped(
        crate::common::child_test("crash_child")
            .env(CHILD_ENV, &address)
            .spawn()?,
    );
    let stdout = child.0.stdout.take().ok_or("piped")?;
    let (lines_tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    // The test harness prints its own words first on the first line.
    let addr: SocketAddr = loop {
        let line = lines.recv_timeout(CHILD_DEADLINE)?;
        if let Some(i) = line.find("listening ") {
            break line[i + "listening ".len()..].parse()?;
        }
    };

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let answered = rt.block_on(async {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let req = hyper::Request::post(format!("http://{addr}/orders"))
            .header("idempotency-key", "k-crash")
            .body(Full::new(Bytes::from_static(BODY.as_bytes())))?;
        let sent = tokio::time::timeout(CHILD_DEADLINE, client.request(req)).await?;
        Ok::<_, Error>(sent.ok().map(|r| r.status()))
    })?;
    if let Some(status) = answered {
        return Err(
            format!("the child answered {status} instead of crashing after its commit").into(),
        );
    }
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.0.try_wait()? {
            break status;
        }
        if started.elapsed() > CHILD_DEADLINE {
            return Err("the child did not exit".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(!status.success(), "the child aborted: {status}");
    let said: Vec<String> = lines.try_iter().collect();
    assert!(
        said.iter().any(|l| l.ends_with("committed")),
        "the child committed before it died: {said:?}"
    );

    // A restarted server over the same store, its clock one second on:
    // well inside the crashed request's lease.
    let store = B::open_at(&address)?;
    rt.block_on(assert_replayed(&store, "k-crash", 1))
}

/// A test of each test above, for backend `$b`, at the root of the test
/// binary (`mod suite` is `tests/middleware/mod.rs`; `crash_child` is the
/// child process of the crash test, ignored unless run by it).
macro_rules! middleware_commit_suite {
    ($b:ty) => {
        middleware_commit_suite!(@tokio $b;
            a_server_error_after_the_commit_replays_the_stored_response_at_once,
            the_layer_stores_nothing_over_the_handlers_response,
            the_first_client_gets_the_response_retries_get,
            an_inner_error_after_the_commit_replays_the_stored_response_at_once,
            an_outer_error_after_the_commit_replays_the_stored_response_at_once
        );
        middleware_commit_suite!(@plain $b;
            a_panic_after_the_commit_replays_the_stored_response_at_once,
            a_dropped_request_after_the_commit_replays_the_stored_response_at_once,
            the_layers_complete_and_release_leave_a_completed_key_alone,
            a_crash_after_the_commit_replays_the_stored_response_at_once
        );

        #[test]
        #[ignore = "run by `a_crash_after_the_commit_replays_the_stored_response_at_once` as a child process"]
        fn crash_child() -> crate::suite::TestResult {
            crate::suite::commit::crash_child::<$b>()
        }
    };
    (@tokio $b:ty; $($name:ident),*) => {$(
        #[tokio::test]
        async fn $name() -> crate::suite::TestResult {
            crate::suite::commit::$name::<$b>().await
        }
    )*};
    (@plain $b:ty; $($name:ident),*) => {$(
        #[test]
        fn $name() -> crate::suite::TestResult {
            crate::suite::commit::$name::<$b>()
        }
    )*};
}
