//! A payments API behind the idempotency layer.
//!
//! ```sh
//! cargo run --example http_server --features middleware            # serve on 127.0.0.1:3000
//! cargo run --example http_server --features middleware -- --smoke # self-test, then exit
//! ```
//!
//! `POST /payments` records a payment in the store file (an app table beside
//! the idempotency keys) and answers 201 with its id and a `Location`. A
//! retry with the same `Idempotency-Key` gets the same answer, replayed from
//! the store, without recording a second payment. `GET /payments/count`
//! says how many were recorded. `PORT` picks the port, `STORE` the file.
//!
//! The handler stores its own response: it takes the request's
//! `Reservation` from the layer (`Extension<Reservation>`) and calls
//! `IdempotencyKeys::complete_in` in the same `Store::write` as the payment,
//! so the payment and its response commit together. Even if the process
//! died right after that commit, a retry would get the stored 201 instead
//! of recording the payment again.

use std::net::SocketAddr;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::Utc;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemstore::middleware::{IdempotencyLayer, record_response, to_response};
use idemstore::redb::{ReadableTable as _, ReadableTableMetadata as _, TableDefinition};
use idemstore::{Reservation, Store};

/// Payment id → request body.
const PAYMENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("example.payments");

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Records a payment and stores its 201 (id, `Location`) for the
/// request's idempotency key, in one commit; answers that 201.
async fn create_payment(
    State(store): State<Store>,
    Extension(reservation): Extension<Reservation>,
    body: Bytes,
) -> Response {
    let keys = store.idempotency_keys();
    let recorded = tokio::task::spawn_blocking(move || {
        store.write(|tx| {
            let mut payments = tx.open_table(PAYMENTS)?;
            let id = payments.last()?.map_or(1, |(k, _)| k.value() + 1);
            payments.insert(id, &*body)?;
            let now = Utc::now();
            // The answer, written once: stored as it is, sent as stored.
            let answer = Response::builder()
                .status(StatusCode::CREATED)
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::LOCATION, format!("/payments/{id}"))
                .body(format!("{{\"id\":{id},\"status\":\"accepted\"}}"))?;
            let response = record_response(&reservation, &answer, now);
            // The payment and its stored response commit together.
            if keys.complete_in(tx, &reservation, response.clone(), now)? {
                Ok(response)
            } else {
                // This request ran past its lease and another took the key
                // over: roll the payment back.
                Err(Error::from("the idempotency key was taken over"))
            }
        })
    })
    .await;
    match recorded {
        // What retries will get, replayed, is what this client gets.
        Ok(Ok(stored)) => to_response(&stored).into_response(),
        // Nothing was committed; on a 5xx the layer frees the key for a retry.
        _ => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// How many payments were recorded.
async fn count(State(store): State<Store>) -> Response {
    let n = tokio::task::spawn_blocking(move || {
        store.read(|tx| match tx.open_table(PAYMENTS) {
            Ok(t) => Ok::<_, idemstore::Error>(t.len()?),
            Err(idemstore::redb::TableError::TableDoesNotExist(_)) => Ok(0),
            Err(e) => Err(e.into()),
        })
    })
    .await;
    match n {
        Ok(Ok(n)) => n.to_string().into_response(),
        _ => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

fn app(store: &Store) -> Router {
    Router::new()
        .route("/payments", post(create_payment))
        .route("/payments/count", get(count))
        .with_state(store.clone())
        .layer(
            IdempotencyLayer::new(store.idempotency_keys())
                .require_key(true)
                .replay_headers([header::LOCATION]),
        )
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let smoke = std::env::args().any(|a| a == "--smoke");
    let dir = tempfile::tempdir()?;
    let path = match std::env::var_os("STORE") {
        Some(p) => p.into(),
        None if smoke => dir.path().join("payments.idem"),
        None => std::env::temp_dir().join("idemstore-example-payments.idem"),
    };
    let store = Store::open(&path)?;
    let port: u16 = match std::env::var("PORT") {
        Ok(p) => p.parse()?,
        Err(_) if smoke => 0,
        Err(_) => 3000,
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let addr = listener.local_addr()?;
    println!("store file: {}", path.display());
    println!("listening on http://{addr}");
    println!("try (twice; the second answer is replayed, no second payment):");
    println!(
        "  curl -i -X POST http://{addr}/payments -H 'Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324' -d '{{\"amount\":1000}}'"
    );
    println!("  curl http://{addr}/payments/count");
    let server = tokio::spawn(axum::serve(listener, app(&store)).into_future());
    if smoke {
        smoke_test(addr).await?;
        server.abort();
        return Ok(());
    }
    server.await??;
    Ok(())
}

/// Sends one payment twice and checks the second is a replay.
async fn smoke_test(addr: SocketAddr) -> Result<(), Error> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut answers = Vec::new();
    for _ in 0..2 {
        let req = hyper::Request::post(format!("http://{addr}/payments"))
            .header("idempotency-key", "smoke-1")
            .body(Full::new(Bytes::from_static(b"{\"amount\":1000}")))?;
        let (parts, body) = client.request(req).await?.into_parts();
        let body = body.collect().await?.to_bytes();
        let replayed = parts.headers.contains_key("idempotent-replayed");
        println!(
            "POST /payments -> {} {} (replayed: {replayed})",
            parts.status,
            String::from_utf8_lossy(&body)
        );
        let location = parts.headers.get(header::LOCATION).cloned();
        answers.push((parts.status, body, replayed, location));
    }
    let count = client
        .get(format!("http://{addr}/payments/count").parse()?)
        .await?
        .into_body()
        .collect()
        .await?
        .to_bytes();
    println!("payments recorded: {}", String::from_utf8_lossy(&count));
    let ok = answers[0].0 == StatusCode::CREATED
        && !answers[0].2
        && answers[1].2
        && answers[0].1 == answers[1].1
        && answers[0].3.is_some()
        && answers[0].3 == answers[1].3
        && &count[..] == b"1";
    if !ok {
        return Err("smoke test failed: the retry was not replayed".into());
    }
    println!("smoke test passed");
    Ok(())
}
