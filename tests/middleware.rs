//! The HTTP middleware against a real axum server on a socket, driven by a
//! real HTTP client, on the embedded store: the suite of
//! `tests/middleware/http.rs` and `tests/middleware/cancel.rs` (run on
//! PostgreSQL by `middleware_pg`), a store that fails, and the layer
//! driven by an executor that is not tokio.
#![cfg(feature = "middleware")]

mod common;
#[macro_use]
#[path = "middleware/mod.rs"]
mod suite;

use common::block_on;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use idemstore::Store;
use idemstore::middleware::IdempotencyLayer;
use tower::{ServiceExt as _, service_fn};

use suite::{TestResult, t};

middleware_http_suite!(suite::embedded::Embedded);
middleware_cancel_suite!(suite::embedded::Embedded);

#[tokio::test]
async fn a_store_error_is_503_and_the_handler_does_not_run() -> TestResult {
    let disk = common::FaultyDisk::new();
    let store = Store::builder().open_with_backend(disk.backend())?;
    let keys = store.idempotency_keys();
    let ran = Arc::new(AtomicUsize::new(0));
    let counter = ran.clone();
    let svc = tower::Layer::layer(
        &IdempotencyLayer::new(keys).clock(|| t(0)),
        service_fn(move |_: http::Request<Full<Bytes>>| {
            counter.fetch_add(1, Ordering::SeqCst);
            async {
                Ok::<_, &'static str>(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
            }
        }),
    );
    disk.lose_power();
    let req = http::Request::post("/orders")
        .header("idempotency-key", "k-down")
        .body(Full::new(Bytes::from_static(b"{}")))?;
    let reply = svc.oneshot(req).await?;
    assert_eq!(reply.status(), 503);
    let body = reply.into_body().collect().await?.to_bytes();
    assert!(std::str::from_utf8(&body)?.contains("\"idempotency_key\":\"k-down\""));
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    Ok(())
}

#[test]
fn outside_a_tokio_runtime_a_keyed_request_is_500_and_others_pass_through() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("api.idem"))?;
    let keys = store.idempotency_keys();
    let ran = Arc::new(AtomicUsize::new(0));
    let counter = ran.clone();
    let svc = tower::Layer::layer(
        &IdempotencyLayer::new(keys.clone()).clock(|| t(0)),
        service_fn(move |_: http::Request<Full<Bytes>>| {
            counter.fetch_add(1, Ordering::SeqCst);
            async {
                Ok::<_, &'static str>(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
            }
        }),
    );
    assert!(
        tokio::runtime::Handle::try_current().is_err(),
        "no runtime here"
    );
    let keyed = http::Request::post("/orders")
        .header("idempotency-key", "k-no-rt")
        .body(Full::new(Bytes::from_static(b"{}")))?;
    let reply = block_on(svc.clone().oneshot(keyed))?;
    assert_eq!(reply.status(), 500);
    assert_eq!(
        reply
            .headers()
            .get("content-type")
            .map(http::HeaderValue::as_bytes),
        Some(&b"application/problem+json"[..])
    );
    let body = block_on(reply.into_body().collect())?.to_bytes();
    let text = std::str::from_utf8(&body)?;
    assert!(text.contains("#no-tokio-runtime"), "{text}");
    assert!(text.contains("tokio runtime"), "{text}");
    assert!(text.contains("\"idempotency_key\":\"k-no-rt\""), "{text}");
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the handler did not run");
    assert!(keys.list(None, 10)?.is_empty(), "nothing reserved");
    // Requests the layer does not cover need no store call, and pass.
    let plain = http::Request::post("/orders").body(Full::new(Bytes::from_static(b"{}")))?;
    assert_eq!(block_on(svc.oneshot(plain))?.status(), 200);
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    Ok(())
}
