//! `webhooks::Sender` against a real HTTP server on 127.0.0.1: the request
//! it writes, and what each kind of answer (or none) makes of the attempt.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::Path;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use chrono::{DateTime, Utc};
use idemstore::webhooks::{Endpoint, Secret, Sender, Verifier};
use idemstore::{Delivery, Error, NewEntry, OutboxEntry, Store};

/// What the server saw of each request: its path, headers and body.
type Seen = Arc<Mutex<Vec<(String, HeaderMap, Vec<u8>)>>>;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

fn secret() -> Secret {
    Secret::parse(SECRET).expect("a valid secret")
}

/// Starts the test server; its address and what it saw.
async fn server() -> (SocketAddr, Seen) {
    let seen: Seen = Arc::default();
    let record = |seen: &Seen, path: &str, headers: HeaderMap, body: Bytes| {
        seen.lock()
            .unwrap()
            .push((path.to_owned(), headers, body.to_vec()));
    };
    let (s1, s2, s3, s4) = (seen.clone(), seen.clone(), seen.clone(), seen.clone());
    let app = Router::new()
        .route(
            "/ok",
            post(move |headers: HeaderMap, body: Bytes| async move {
                record(&s1, "/ok", headers, body);
                StatusCode::NO_CONTENT
            }),
        )
        .route(
            "/status/{code}",
            post(
                move |Path(code): Path<u16>, headers: HeaderMap, body: Bytes| async move {
                    record(&s2, "/status", headers, body);
                    (
                        StatusCode::from_u16(code).unwrap(),
                        format!("answer\n{code}"),
                    )
                },
            ),
        )
        .route(
            "/after/{code}/{after}",
            post(move |Path((code, after)): Path<(u16, String)>| async move {
                let mut answer = StatusCode::from_u16(code).unwrap().into_response();
                answer
                    .headers_mut()
                    .insert("retry-after", after.parse().unwrap());
                answer
            }),
        )
        .route(
            "/redirect",
            post(|| async { axum::response::Redirect::temporary("/moved-here") }),
        )
        .route(
            "/stall",
            post(move |headers: HeaderMap, body: Bytes| async move {
                record(&s3, "/stall", headers, body);
                tokio::time::sleep(Duration::from_secs(3)).await;
                StatusCode::OK
            }),
        )
        .route(
            "/moved-here",
            post(move |headers: HeaderMap, body: Bytes| async move {
                record(&s4, "/moved-here", headers, body);
                StatusCode::OK
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, seen)
}

/// A delivery's variant and its reason's code (the reason up to its
/// detail in parentheses).
fn kind(d: &Delivery) -> String {
    let code = |r: &str| r.split_once(" (").map_or(r, |(c, _)| c).to_owned();
    match d {
        Delivery::Retry { reason } => format!("Retry {}", code(reason)),
        Delivery::RetryAt { reason, .. } => format!("RetryAt {}", code(reason)),
        Delivery::Throttled { reason, .. } => format!("Throttled {}", code(reason)),
        Delivery::Failed { reason } => format!("Failed {}", code(reason)),
        other => format!("{other:?}"),
    }
}

/// An entry of `destination` with a payload that is not UTF-8.
fn entry(store: &Store, destination: &str, key: &str) -> OutboxEntry {
    let outbox = store.outbox();
    let payload = vec![0xff, 0x00, b'{', 0xfe];
    let id = outbox
        .enqueue(NewEntry::new("cmd", destination, key, payload), Utc::now())
        .unwrap()
        .id();
    outbox.get(id).unwrap().entry
}

fn store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s.idem")).unwrap();
    (dir, store)
}

fn sender(destination: &str, url: &str, timeout: Duration) -> Sender {
    Sender::builder()
        .endpoint(
            destination,
            Endpoint::new(url)
                .unwrap()
                .secret(secret())
                .header("authorization", "Bearer t")
                .timeout(timeout),
        )
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_is_a_signed_post_of_the_payload_as_stored() {
    let (addr, seen) = server().await;
    let (_dir, store) = store();
    let e = entry(&store, "hooks", "order-1");
    let s = sender(
        "hooks",
        &format!("http://{addr}/ok"),
        Duration::from_secs(5),
    );
    let before = Utc::now().timestamp();
    assert_eq!(s.send(e.clone()).await, Delivery::Delivered);
    let after = Utc::now().timestamp();

    let seen = seen.lock().unwrap();
    let (_, headers, body) = &seen[0];
    assert_eq!(body, &e.payload, "the body is the payload's bytes");
    let id = Sender::webhook_id(&e);
    assert_eq!(headers["webhook-id"], id.as_str());
    assert_eq!(headers["idempotency-key"], id.as_str());
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(headers["authorization"], "Bearer t");
    assert!(
        headers["user-agent"]
            .to_str()
            .unwrap()
            .starts_with("idemstore/")
    );
    let ts: i64 = headers["webhook-timestamp"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((before..=after).contains(&ts));
    // The receiver's verifier accepts it as sent.
    let now = DateTime::<Utc>::from_timestamp(ts, 0).unwrap();
    let verified = Verifier::standard(vec![secret()])
        .verify(headers, body, now)
        .expect("the signature verifies");
    assert_eq!(verified.id(), id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_map_to_deliveries() {
    let (addr, seen) = server().await;
    let (_dir, store) = store();
    let s = sender(
        "hooks",
        &format!("http://{addr}/ok"),
        Duration::from_secs(5),
    );
    let send = |path: String| {
        let (store, addr) = (&store, addr);
        async move {
            let url = format!("http://{addr}{path}");
            let s = Sender::builder()
                .endpoint(
                    "hooks",
                    Endpoint::new(&url)
                        .unwrap()
                        .secret(secret())
                        .fail_for_good(422),
                )
                .build()
                .unwrap();
            s.send(entry(store, "hooks", &path)).await
        }
    };
    let start = Utc::now();
    match send("/after/503/30".into()).await {
        Delivery::Throttled {
            next_attempt_at,
            reason,
        } => {
            assert!(reason.starts_with("http_503 ("), "{reason}");
            let wait = (next_attempt_at - start).num_seconds();
            assert!((29..=31).contains(&wait), "{wait}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        send("/after/429/Thu,%2001%20Jan%202099%2000:00:00%20GMT".into()).await,
        Delivery::Throttled { next_attempt_at, .. } if next_attempt_at.timestamp() == 4_070_908_800
    ));
    assert_eq!(kind(&send("/status/429".into()).await), "Retry http_429");
    assert!(matches!(
        send("/after/500/60".into()).await,
        Delivery::RetryAt { reason, .. } if reason.starts_with("http_500 (")
    ));
    assert_eq!(kind(&send("/status/502".into()).await), "Retry http_502");
    assert_eq!(kind(&send("/status/408".into()).await), "Retry http_408");
    assert_eq!(kind(&send("/status/410".into()).await), "Failed http_410");
    assert_eq!(kind(&send("/status/422".into()).await), "Failed http_422");
    assert_eq!(kind(&send("/status/404".into()).await), "Retry http_404");
    // The reason's detail: the attempt's time and the answer's first bytes.
    match send("/status/502".into()).await {
        Delivery::Retry { reason } => {
            assert!(reason.starts_with("http_502 ("), "{reason}");
            assert!(reason.ends_with(" ms: answer 502)"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // A redirect is a failure, and is not followed.
    assert_eq!(kind(&send("/redirect".into()).await), "Failed http_307");
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .all(|(p, ..)| p != "/moved-here")
    );
    // An entry whose destination has no endpoint.
    assert_eq!(
        kind(&s.send(entry(&store, "elsewhere", "x")).await),
        "Failed no_endpoint"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_after_the_request_is_an_unknown_outcome_and_the_retry_has_the_same_id() {
    let (addr, seen) = server().await;
    let (_dir, store) = store();
    let e = entry(&store, "hooks", "slow-1");
    let s = sender(
        "hooks",
        &format!("http://{addr}/stall"),
        Duration::from_millis(300),
    );
    let id = Sender::webhook_id(&e);
    for _ in 0..2 {
        assert_eq!(
            s.send(e.clone()).await,
            Delivery::OutcomeUnknown {
                remote_ref: Some(id.clone())
            }
        );
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2, "the remote saw both attempts");
    assert!(seen.iter().all(|(_, h, _)| h["webhook-id"] == id.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_a_retry_not_an_unknown_outcome() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let (_dir, store) = store();
    let s = sender(
        "hooks",
        &format!("http://127.0.0.1:{port}/"),
        Duration::from_secs(5),
    );
    assert_eq!(
        kind(&s.send(entry(&store, "hooks", "k")).await),
        "Retry connect"
    );
}

#[test]
fn send_blocking_works_from_a_plain_thread_and_as_the_dispatchers_send() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (addr, seen) = rt.block_on(server());
    let (_dir, store) = store();
    let s = sender(
        "hooks",
        &format!("http://{addr}/ok"),
        Duration::from_secs(5),
    );
    let e = entry(&store, "hooks", "blocking-1");
    assert_eq!(s.send_blocking(&e), Delivery::Delivered);
    let send = s.blocking();
    assert_eq!(
        send(&entry(&store, "hooks", "blocking-2")),
        Delivery::Delivered
    );
    assert_eq!(seen.lock().unwrap().len(), 2);
    drop(s);
    drop(send);
}

#[test]
fn bad_endpoints_are_refused_at_build() {
    let ok = || {
        Endpoint::new("https://example.com/hooks")
            .unwrap()
            .secret(secret())
    };
    for url in [
        "ftp://example.com/",
        "example.com",
        "http://",
        "not a url",
        "",
    ] {
        assert!(
            matches!(Endpoint::new(url), Err(Error::InvalidInput { .. })),
            "{url:?}"
        );
    }
    let refused = |b: idemstore::webhooks::SenderBuilder| {
        matches!(b.build(), Err(Error::InvalidInput { .. }))
    };
    assert!(refused(Sender::builder()));
    assert!(refused(
        Sender::builder().endpoint("a", Endpoint::new("https://example.com/").unwrap())
    ));
    assert!(refused(
        Sender::builder().endpoint("a", ok().header("webhook-id", "x"))
    ));
    assert!(refused(
        Sender::builder().endpoint("a", ok().header("Content-Type", "x"))
    ));
    assert!(refused(
        Sender::builder().endpoint("a", ok().header("bad name", "x"))
    ));
    assert!(refused(
        Sender::builder().endpoint("a", ok().header("x-a", "line\nbreak"))
    ));
    assert!(refused(
        Sender::builder().endpoint("a", ok().timeout(Duration::ZERO))
    ));
    assert!(refused(
        Sender::builder().endpoint("a", ok().fail_for_good(500))
    ));
    assert!(refused(
        Sender::builder().endpoint("a", ok()).endpoint("a", ok())
    ));
    assert!(
        Sender::builder()
            .endpoint("a", ok())
            .endpoint("b", ok())
            .build()
            .is_ok()
    );
}

#[test]
fn the_webhook_id_is_stable_and_differs_between_entries() {
    let (_dir, store) = store();
    let a = entry(&store, "hooks", "k1");
    let b = entry(&store, "hooks", "k2");
    let c = entry(&store, "other", "k1");
    let id = Sender::webhook_id(&a);
    assert_eq!(id, Sender::webhook_id(&a.clone()));
    assert!(id.starts_with("msg_") && id.len() == 36);
    assert_ne!(id, Sender::webhook_id(&b));
    assert_ne!(id, Sender::webhook_id(&c));
}
