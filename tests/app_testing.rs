//! An application's own test, written as a user of the crate writes one,
//! with `idemstore::testing` alone: an axum order service behind
//! `IdempotencyLayer` that records an order, enqueues its billing webhook
//! and stores its answer in one commit. The test checks what was enqueued,
//! that a retry is replayed, delivers the webhook through a flaky remote
//! (the clock moves over the back-off), and that while the disk fails an
//! order is refused whole and its retry after a restart is placed once.
#![cfg(all(feature = "testing", feature = "middleware"))]

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Extension, State};
use axum::http::{Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::BodyExt as _;
use idemstore::middleware::{IdempotencyLayer, record_response, to_response};
use idemstore::redb::{ReadableTable as _, ReadableTableMetadata as _, TableDefinition};
use idemstore::testing::{self, Fault, TestStore};
use idemstore::{Clock as _, Delivery, ManualClock, NewEntry, Reservation, Store};
use tower::ServiceExt as _;

type Error = Box<dyn std::error::Error + Send + Sync>;

// ------------------------------------------------ the application under test

const ORDERS: TableDefinition<u64, &[u8]> = TableDefinition::new("shop.orders");

#[derive(Clone)]
struct Shop {
    store: Store,
    clock: ManualClock,
}

/// `POST /orders`: the order, its billing webhook and its 201, in one
/// commit.
async fn create_order(
    State(shop): State<Shop>,
    Extension(reservation): Extension<Reservation>,
    body: Bytes,
) -> Response {
    let now = shop.clock.now();
    let store = shop.store.clone();
    let placed = tokio::task::spawn_blocking(move || {
        let outbox = store.outbox();
        let keys = store.idempotency_keys();
        store.write(|tx| {
            let mut orders = tx.open_table(ORDERS)?;
            let id = orders.last()?.map_or(1, |(k, _)| k.value() + 1);
            orders.insert(id, &*body)?;
            let webhook = NewEntry::new(
                format!("order-{id}"),
                "billing",
                format!("order-{id}/charge"),
                body.to_vec(),
            );
            outbox.enqueue_in(tx, webhook, now)?;
            let answer = Response::builder()
                .status(StatusCode::CREATED)
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::LOCATION, format!("/orders/{id}"))
                .body(format!("{{\"order\":{id}}}"))?;
            let stored = record_response(&reservation, &answer, now);
            if keys.complete_in(tx, &reservation, stored.clone(), now)? {
                Ok(stored)
            } else {
                Err(Error::from("the idempotency key was taken over"))
            }
        })
    })
    .await;
    match placed {
        Ok(Ok(stored)) => to_response(&stored).into_response(),
        _ => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

fn app(store: &Store, clock: &ManualClock) -> Router {
    let layer_clock = clock.clone();
    let idempotent = IdempotencyLayer::new(store.idempotency_keys())
        .require_key(true)
        .clock(move || layer_clock.now());
    Router::new()
        .route("/orders", post(create_order).layer(idempotent))
        .with_state(Shop {
            store: store.clone(),
            clock: clock.clone(),
        })
}

// ------------------------------------------------------------------ the tests

async fn order(app: Router, key: &str, body: &str) -> Result<(StatusCode, bool, String), Error> {
    let request = Request::post("/orders")
        .header("idempotency-key", key)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_owned()))?;
    let response = app.oneshot(request).await?;
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, replayed, String::from_utf8(body.to_vec())?))
}

fn orders(store: &Store) -> Result<u64, Error> {
    Ok(store.read(|tx| match tx.open_table(ORDERS) {
        Ok(t) => Ok(t.len()?),
        Err(idemstore::redb::TableError::TableDoesNotExist(_)) => Ok(0),
        Err(e) => Err(idemstore::Error::from(e)),
    })?)
}

#[tokio::test]
async fn an_order_enqueues_its_webhook_once_and_the_webhook_is_delivered() -> Result<(), Error> {
    let t = TestStore::new()?;
    let app = app(t.store(), t.clock());

    let first = order(app.clone(), "k-1", r#"{"sku":"tea","qty":2}"#).await?;
    assert_eq!(
        first,
        (StatusCode::CREATED, false, r#"{"order":1}"#.to_owned())
    );
    let outbox = t.store().outbox();
    let webhook = testing::assert_enqueued(&outbox, "billing", "order-1/charge");
    assert_eq!(webhook.entry.payload, br#"{"sku":"tea","qty":2}"#);

    // The client retries: the same answer, replayed; no second order or
    // webhook.
    let retry = order(app.clone(), "k-1", r#"{"sku":"tea","qty":2}"#).await?;
    assert_eq!((retry.0, retry.1, &retry.2), (first.0, true, &first.2));
    assert_eq!(orders(t.store())?, 1);
    assert_eq!(testing::enqueued(&outbox)?.len(), 1);

    // Billing answers 503 once, then accepts.
    let mut calls = 0;
    let sent = testing::drain(&outbox, t.clock(), |_| {
        calls += 1;
        if calls == 1 {
            Delivery::Retry {
                reason: "http_503".into(),
            }
        } else {
            Delivery::Delivered
        }
    })?;
    assert_eq!(sent.len(), 2);
    assert!(
        t.now() > TestStore::START,
        "the clock moved over the back-off"
    );
    let webhook = testing::assert_enqueued(&outbox, "billing", "order-1/charge");
    assert!(webhook.entry.status.is_finished());
    assert_eq!(webhook.last_failure.as_deref(), Some("http_503"));
    Ok(())
}

#[tokio::test]
async fn a_failing_disk_refuses_the_order_whole_and_the_retry_places_it() -> Result<(), Error> {
    let mut t = TestStore::new()?;
    // The disk dies before the request: its next write fails.
    t.disk().fail_at(Fault::FailWrite, 1);
    let failed = order(app(t.store(), t.clock()), "k-2", r#"{"sku":"cup"}"#).await?;
    assert_eq!(failed.0, StatusCode::SERVICE_UNAVAILABLE, "{}", failed.2);

    // After a restart, nothing of the order is there and the key is free:
    // the client's retry places it.
    t.restart()?;
    let outbox = t.store().outbox();
    testing::assert_not_enqueued(&outbox, "billing", "order-1/charge");
    assert_eq!(orders(t.store())?, 0);
    let retry = order(app(t.store(), t.clock()), "k-2", r#"{"sku":"cup"}"#).await?;
    assert_eq!(
        retry,
        (StatusCode::CREATED, false, r#"{"order":1}"#.to_owned())
    );
    testing::assert_enqueued(&outbox, "billing", "order-1/charge");
    Ok(())
}
