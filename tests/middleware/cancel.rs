//! A request whose future is dropped (the client went away, a timeout
//! fired) while the layer waits for `begin`, or while its handler runs,
//! leaves no reservation behind: a retry with the same key runs at once,
//! not 409 until the lease ends (the layer's clock never moves past it
//! here). Generic over the [`Backend`].
//!
//! Each test runs on a current-thread runtime, where the layer's store
//! calls (tasks of their own) run only once the test lets them: a `begin`
//! stays queued until the test yields, and the test waits for the
//! runtime's tasks to end to know the calls are done.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;

use bytes::Bytes;
use http_body_util::Full;
use idemstore::middleware::{IdempotencyLayer, ResponseBody};
use tower::{ServiceExt as _, service_fn};

use super::{Backend, Error, TestResult, store_calls_done, t};

type Reply = Result<http::Response<ResponseBody>, &'static str>;

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

/// A layered service whose handler counts its runs and, with `hang`,
/// never answers.
fn service<B: Backend>(
    store: &B,
    runs: &Arc<AtomicUsize>,
    hang: bool,
) -> impl tower::Service<
    http::Request<Full<Bytes>>,
    Response = http::Response<ResponseBody>,
    Error = &'static str,
    Future = impl Future<Output = Reply> + Send,
> + Clone {
    let runs = runs.clone();
    tower::Layer::layer(
        &IdempotencyLayer::new(store.keys()).clock(|| t(0)),
        service_fn(move |_: http::Request<Full<Bytes>>| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move {
                if hang {
                    std::future::pending::<()>().await;
                }
                Ok::<_, &'static str>(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
            }
        }),
    )
}

fn keyed(key: &str) -> Result<http::Request<Full<Bytes>>, Error> {
    Ok(http::Request::post("/orders")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"{}")))?)
}

/// Polls `call` once: it must be waiting (for its store call, or its
/// handler).
async fn poll_once(call: &mut Pin<Box<impl Future<Output = Reply>>>) {
    std::future::poll_fn(|cx| {
        assert!(call.as_mut().poll(cx).is_pending(), "the call is waiting");
        Poll::Ready(())
    })
    .await;
}

/// A retry of `key` runs the handler at once and answers 200.
async fn assert_retry_runs<B: Backend>(store: &B, key: &str) -> TestResult {
    let runs = Arc::new(AtomicUsize::new(0));
    let retry = service(store, &runs, false).oneshot(keyed(key)?).await?;
    assert_eq!(retry.status(), 200, "the retry proceeds, not 409");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the retry ran the handler");
    Ok(())
}

pub(crate) fn a_request_dropped_while_its_begin_is_queued_reserves_nothing<B: Backend>()
-> TestResult {
    runtime()?.block_on(async {
        let store = backend!(B);
        let runs = Arc::new(AtomicUsize::new(0));
        let mut call = Box::pin(service(&store, &runs, false).oneshot(keyed("k-queued")?));
        // The call queues its `begin` (a task that has not run yet: this
        // one has not yielded since), then goes away.
        poll_once(&mut call).await;
        drop(call);
        store_calls_done().await?;
        assert_eq!(store.rows()?, 0, "nothing reserved for a request gone");
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        assert_retry_runs(&store, "k-queued").await
    })
}

pub(crate) fn a_request_dropped_once_its_begin_reserved_releases_the_key<B: Backend>() -> TestResult
{
    runtime()?.block_on(async {
        let store = backend!(B);
        let runs = Arc::new(AtomicUsize::new(0));
        let mut call = Box::pin(service(&store, &runs, false).oneshot(keyed("k-reserved")?));
        poll_once(&mut call).await;
        // `begin` has reserved the key; the request goes away before it
        // takes the answer.
        store_calls_done().await?;
        assert_eq!(store.rows()?, 1, "reserved");
        drop(call);
        store_calls_done().await?;
        assert_eq!(store.rows()?, 0, "released by the dropped request");
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        assert_retry_runs(&store, "k-reserved").await
    })
}

pub(crate) fn a_request_dropped_while_its_handler_runs_releases_the_key<B: Backend>() -> TestResult
{
    runtime()?.block_on(async {
        let store = backend!(B);
        let runs = Arc::new(AtomicUsize::new(0));
        let mut call = Box::pin(service(&store, &runs, true).oneshot(keyed("k-handler")?));
        poll_once(&mut call).await;
        store_calls_done().await?;
        // The answer of `begin` is in: the handler runs (and hangs).
        poll_once(&mut call).await;
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        drop(call);
        store_calls_done().await?;
        assert_eq!(store.rows()?, 0, "released by the dropped request");
        assert_retry_runs(&store, "k-handler").await
    })
}

/// A `#[test]` of each test above, for backend `$b`, at the root of the
/// test binary (`mod suite` is `tests/middleware/mod.rs`).
macro_rules! middleware_cancel_suite {
    ($b:ty) => {
        middleware_cancel_suite!(@plain $b;
            a_request_dropped_while_its_begin_is_queued_reserves_nothing,
            a_request_dropped_once_its_begin_reserved_releases_the_key,
            a_request_dropped_while_its_handler_runs_releases_the_key
        );
    };
    (@plain $b:ty; $($name:ident),*) => {$(
        #[test]
        fn $name() -> crate::suite::TestResult {
            crate::suite::cancel::$name::<$b>()
        }
    )*};
}
