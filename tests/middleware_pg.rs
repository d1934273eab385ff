//! The middleware's suites (`tests/middleware/http.rs`,
//! `tests/middleware/commit.rs`) over the PostgreSQL keys, and what only
//! the server backend has: a store whose tables are gone answers 503.
//!
//! The server is named by `IDEMSTORE_TEST_POSTGRES` (`.ci/postgres run --
//! cargo test --features postgres,middleware --test middleware_pg`).
//! Without it every test says so and passes, except under `CI=true`.

mod common;
#[macro_use]
#[path = "middleware/mod.rs"]
mod suite;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use idemstore::middleware::IdempotencyLayer;
use idemstore::postgres::PgStore;
use tower::{ServiceExt as _, service_fn};

use suite::{TestResult, t};

middleware_http_suite!(suite::pg::Pg);
middleware_commit_suite!(suite::pg::Pg);
middleware_cancel_suite!(suite::pg::Pg);

#[tokio::test]
async fn a_server_error_is_503_and_the_handler_does_not_run() -> TestResult {
    let Some(url) = common::pg::url() else {
        return Ok(());
    };
    let schema = common::pg::unique_schema();
    let _remove = common::pg::DropSchema {
        url: url.clone(),
        schema: schema.clone(),
    };
    let store = common::pg::off_runtime(|| {
        PgStore::builder()
            .schema(&schema)
            .pool_size(2)
            .connect(&url)
    })?;
    let ran = Arc::new(AtomicUsize::new(0));
    let counter = ran.clone();
    let svc = tower::Layer::layer(
        &IdempotencyLayer::new(store.idempotency_keys()).clock(|| t(0)),
        service_fn(move |_: http::Request<Full<Bytes>>| {
            counter.fetch_add(1, Ordering::SeqCst);
            async {
                Ok::<_, &'static str>(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
            }
        }),
    );
    // The store's tables vanish under it: every statement fails.
    common::pg::off_runtime(|| {
        common::pg::client(&url).batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
    })?;
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
