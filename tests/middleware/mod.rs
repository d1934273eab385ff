//! The middleware's tests, written once and run on both backends:
//! `http.rs` (the layer in front of a real server and of plain tower
//! services), `commit.rs` (a handler that stores its own response with
//! `complete_in`) and `cancel.rs` (requests dropped while they wait). Each
//! test is a function generic over a [`Backend`];
//! `middleware_http_suite!(B)`, `middleware_commit_suite!(B)` and
//! `middleware_cancel_suite!(B)` make a `#[test]` of each for backend `B`.
//! `tests/middleware.rs` and `tests/middleware_commit.rs` run them on the
//! embedded store, `tests/middleware_pg.rs` on PostgreSQL (feature
//! `postgres`).
// Each test binary runs a part of the suite on one backend.
#![allow(dead_code, unused_macros)]

use chrono::{DateTime, TimeZone, Utc};
use idemstore::{IdempotencyBackend, IdempotencyStats, Reservation, ResponseRecord};

/// Opens the backend's fixture, or returns from the test when the backend
/// is not available here.
macro_rules! backend {
    ($b:ty) => {
        match <$b as crate::suite::Backend>::open() {
            Some(b) => b,
            None => return Ok(()),
        }
    };
}

#[macro_use]
pub(crate) mod cancel;
#[macro_use]
pub(crate) mod commit;
#[macro_use]
pub(crate) mod http;

pub(crate) mod embedded;
#[cfg(feature = "postgres")]
pub(crate) mod pg;

pub(crate) type Error = Box<dyn std::error::Error + Send + Sync>;
pub(crate) type TestResult = Result<(), Error>;

/// Waits until every store call the layer has started so far has ended:
/// the layer runs each as a task of the current runtime (awaiting the
/// store's async form), so none is left once no task is.
pub(crate) async fn store_calls_done() -> TestResult {
    let rt = tokio::runtime::Handle::current();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while rt.metrics().num_alive_tasks() > 0 {
        if std::time::Instant::now() > deadline {
            return Err("the layer's store calls still run after 10 s".into());
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    Ok(())
}

/// A fixed instant plus `secs` seconds.
pub(crate) fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

/// A store of one backend, with the application's own `orders` table, as
/// the tests need it. Cheap to clone; the last clone of one made by
/// [`Backend::open`] removes its data.
pub(crate) trait Backend: Clone + Send + Sync + 'static {
    /// The store's idempotency keys.
    type Keys: IdempotencyBackend + Clone;

    /// Where a fresh store can live (a file, a schema), and what removes it
    /// once dropped; `None` when the backend is not available here (the
    /// test then returns after saying so).
    fn new_address() -> Option<(String, Box<dyn std::any::Any + Send + Sync>)>;

    /// The store at `address`, as a process opens it.
    fn open_at(address: &str) -> Result<Self, Error>;

    /// A fresh store, removed with its last clone.
    fn open() -> Option<Self>;

    fn keys(&self) -> Self::Keys;

    /// Rows (reservations and responses) in the store.
    fn rows(&self) -> Result<usize, Error>;

    /// The counters of the store's keys.
    fn stats(&self) -> IdempotencyStats;

    /// The stored response of `key` (tenant `tenant`) as of `now`.
    fn get(
        &self,
        tenant: &str,
        key: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<ResponseRecord>, Error>;

    /// Records an order under `r`'s key and stores its 201 (JSON
    /// `{"order":ID}`, `Location: /orders/ID`) with `complete_in`, in one
    /// commit; `Err` (nothing committed) if `r` no longer holds the key.
    fn place_order(&self, r: &Reservation, now: DateTime<Utc>) -> Result<ResponseRecord, Error>;

    /// How many orders were placed under `key`.
    fn orders_for(&self, key: &str) -> Result<usize, Error>;
}

/// The 201 an order `id` stores: the record of the response the handler
/// answers with.
pub(crate) fn order_response(r: &Reservation, id: i64, now: DateTime<Utc>) -> ResponseRecord {
    let response = axum::http::Response::builder()
        .status(201)
        .header(axum::http::header::CONTENT_TYPE, "application/json")
        .header(axum::http::header::LOCATION, format!("/orders/{id}"))
        .body(format!("{{\"order\":{id}}}"))
        .expect("a valid response");
    idemstore::middleware::record_response(r, &response, now)
}
