//! The HTTP middleware against a real axum server on a socket, driven by a
//! real HTTP client, on the embedded store: the suite of
//! `tests/middleware/http.rs` (run on PostgreSQL by `middleware_pg`), and
//! a store that fails.
#![cfg(feature = "middleware")]

mod common;
#[macro_use]
#[path = "middleware/mod.rs"]
mod suite;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use idemstore::Store;
use idemstore::middleware::IdempotencyLayer;
use tower::{ServiceExt as _, service_fn};

use suite::{TestResult, t};

middleware_http_suite!(suite::embedded::Embedded);

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
