//! `webhooks::Receiver`: verify, then claim the delivery's id in the
//! effect's own transaction; and the two halves together over HTTP.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use axum::routing::post;
use chrono::{DateTime, Utc};
use idemstore::redb::{ReadableTable, TableDefinition};
use idemstore::webhooks::{Endpoint, Received, Receiver, Refusal, Secret, Sender, Verifier, sign};
use idemstore::{Delivery, Error, NewEntry, Store};

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const ORDERS: TableDefinition<&str, &[u8]> = TableDefinition::new("app.orders");

fn secret() -> Secret {
    Secret::parse(SECRET).unwrap()
}

fn now() -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000, 0).unwrap()
}

/// A signed delivery of `body` with id `id`, sent at `now()`.
fn delivery(id: &str, body: &[u8]) -> HeaderMap {
    let ts = now().timestamp();
    let mut h = HeaderMap::new();
    h.insert("webhook-id", id.parse().unwrap());
    h.insert("webhook-timestamp", ts.to_string().parse().unwrap());
    h.insert(
        "webhook-signature",
        sign(&[secret()], id, ts, body).parse().unwrap(),
    );
    h
}

fn setup() -> (tempfile::TempDir, Store, Receiver) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("r.idem")).unwrap();
    let receiver = Receiver::new(
        store.inbox("hooks").unwrap(),
        Verifier::standard(vec![secret()]),
    );
    (dir, store, receiver)
}

fn orders(store: &Store) -> Vec<(String, Vec<u8>)> {
    store
        .read(|tx| {
            let Ok(t) = tx.open_table(ORDERS) else {
                return Ok(Vec::new());
            };
            let mut out = Vec::new();
            for row in t.iter().map_err(idemstore::redb::Error::from)? {
                let (k, v) = row.map_err(idemstore::redb::Error::from)?;
                out.push((k.value().to_owned(), v.value().to_vec()));
            }
            Ok::<_, Error>(out)
        })
        .unwrap()
}

/// The effect: one row per delivery, keyed by its id.
fn record(tx: &idemstore::redb::WriteTransaction, id: &str, body: &[u8]) -> Result<(), Error> {
    tx.open_table(ORDERS)
        .map_err(idemstore::redb::Error::from)?
        .insert(id, body)
        .map_err(idemstore::redb::Error::from)?;
    Ok(())
}

#[test]
fn the_first_delivery_runs_its_effect_with_the_claim_and_a_duplicate_runs_nothing() {
    let (_dir, store, receiver) = setup();
    let body = br#"{"order":1}"#;
    let headers = delivery("msg_1", body);
    let runs = AtomicUsize::new(0);
    let got: Received<(), Error> = receiver.receive(&headers, body, now(), |tx, v| {
        runs.fetch_add(1, Ordering::SeqCst);
        record(tx, v.id(), body)
    });
    assert!(matches!(got, Received::Applied(())));
    assert_eq!(got.status(), 204);
    assert!(store.inbox("hooks").unwrap().seen("msg_1").unwrap());
    assert_eq!(orders(&store), vec![("msg_1".to_owned(), body.to_vec())]);

    let again: Received<(), Error> = receiver.receive(&headers, body, now(), |tx, v| {
        runs.fetch_add(1, Ordering::SeqCst);
        record(tx, v.id(), body)
    });
    assert!(matches!(again, Received::Duplicate));
    assert_eq!(again.into_response().status(), 204);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(orders(&store).len(), 1);
}

#[test]
fn a_refused_delivery_runs_nothing_and_writes_nothing() {
    let (_dir, store, receiver) = setup();
    let body = br#"{"order":2}"#;
    let run = |headers: &HeaderMap, body: &[u8], at| -> Received<(), Error> {
        receiver.receive(headers, body, at, |_, _| panic!("must not run"))
    };
    // A changed body: bad signature, 401.
    let r = run(&delivery("msg_2", body), br#"{"order":3}"#, now());
    assert!(matches!(&r, Received::Refused(Refusal::Unverified(_))));
    let response = r.into_response();
    assert_eq!(response.status(), 401);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let problem: serde_json::Value = serde_json::from_str(response.body()).unwrap();
    assert_eq!(problem["status"], 401);
    // An hour late: 401.
    let late = now() + chrono::TimeDelta::hours(1);
    assert_eq!(run(&delivery("msg_2", body), body, late).status(), 401);
    // No headers: 400.
    assert_eq!(run(&HeaderMap::new(), body, now()).status(), 400);
    // Over the limit: 413, before any check.
    let small = receiver.clone().body_limit(4);
    let r: Received<(), Error> = small.receive(&delivery("msg_2", body), body, now(), |_, _| {
        panic!("must not run")
    });
    assert!(matches!(
        r,
        Received::Refused(Refusal::TooLarge { limit: 4 })
    ));
    assert_eq!(r.status(), 413);
    // An id longer than an inbox key may be: 400.
    let long = "m".repeat(idemstore::MAX_EVENT_KEY_LEN + 1);
    assert!(matches!(
        run(&delivery(&long, body), body, now()),
        Received::Refused(Refusal::IdTooLong { .. })
    ));
    assert!(!store.inbox("hooks").unwrap().seen("msg_2").unwrap());
    assert!(orders(&store).is_empty());
}

#[test]
fn a_failed_effect_leaves_nothing_and_the_retry_applies() {
    let (_dir, store, receiver) = setup();
    let body = br#"{"order":4}"#;
    let headers = delivery("msg_4", body);
    let failed: Received<(), Error> = receiver.receive(&headers, body, now(), |tx, v| {
        record(tx, v.id(), body)?;
        Err(Error::Io(std::io::Error::other("downstream down")))
    });
    assert!(matches!(failed, Received::Failed(_)));
    let response = failed.into_response();
    assert_eq!(response.status(), 500);
    assert!(
        !response.body().contains("downstream"),
        "the error stays inside"
    );
    assert!(!store.inbox("hooks").unwrap().seen("msg_4").unwrap());
    assert!(orders(&store).is_empty(), "the effect's write rolled back");

    let retry: Received<(), Error> =
        receiver.receive(&headers, body, now(), |tx, v| record(tx, v.id(), body));
    assert!(matches!(retry, Received::Applied(())));
    assert_eq!(orders(&store).len(), 1);
}

/// The sender's POSTs into a receiver behind axum: each entry applied once,
/// however many times it is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_to_receiver_over_http_applies_each_entry_once() {
    let (_rdir, receiving, receiver) = setup();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = {
        let runs = runs.clone();
        Router::new().route(
            "/hooks",
            post(move |headers: HeaderMap, body: Bytes| {
                let (receiver, runs) = (receiver.clone(), runs.clone());
                async move {
                    let copy = body.to_vec();
                    let got: Received<(), Error> = receiver
                        .receive_async(&headers, &body, Utc::now(), move |tx, v| {
                            runs.fetch_add(1, Ordering::SeqCst);
                            record(tx, v.id(), &copy)
                        })
                        .await;
                    got.into_response().into_response()
                }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let sdir = tempfile::tempdir().unwrap();
    let sending = Store::open(sdir.path().join("s.idem")).unwrap();
    let outbox = sending.outbox();
    let sender = Sender::builder()
        .endpoint(
            "partner",
            Endpoint::new(&format!("http://{addr}/hooks"))
                .unwrap()
                .secret(secret())
                .timeout(Duration::from_secs(5)),
        )
        .build()
        .unwrap();
    let mut entries = Vec::new();
    for i in 0..5 {
        let payload = format!("{{\"order\":{i}}}").into_bytes();
        let id = outbox
            .enqueue(
                NewEntry::new("c", "partner", format!("o-{i}"), payload),
                Utc::now(),
            )
            .unwrap()
            .id();
        entries.push(outbox.get(id).unwrap().entry);
    }
    // Each sent twice, as a retry after a lost answer would.
    for e in entries.iter().chain(entries.iter()) {
        assert_eq!(sender.send(e.clone()).await, Delivery::Delivered);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 5);
    let got = orders(&receiving);
    assert_eq!(got.len(), 5);
    for e in &entries {
        let id = Sender::webhook_id(e);
        assert!(got.iter().any(|(k, v)| *k == id && *v == e.payload));
    }
}
