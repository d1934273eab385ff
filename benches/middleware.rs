//! Requests per second through the idempotency layer beside the same axum
//! server without it, in one run, over real sockets.
//!
//! - baseline: `POST /pay` on a server without the layer;
//! - pass-through: the same request, no key, through the layer;
//! - replay: one key sent again and again (a read, no commit);
//! - durable baseline: no layer, a handler making one durable store write;
//! - first execution: a new key every request (`begin` and `complete`,
//!   two durable commits, group-committed across concurrent requests).
//!
//! `cargo bench -p idemstore-benches --bench middleware` (about 25 s;
//! `-- --quick` for a shorter run). Client and server share the machine, so
//! read the ratios rather than the absolute figures.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::{StatusCode, header};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idemstore::Store;
use idemstore::middleware::IdempotencyLayer;

type Error = Box<dyn std::error::Error + Send + Sync>;
type HttpClient = Client<HttpConnector, Full<Bytes>>;

const CONCURRENCY: usize = 32;
const BODY: &[u8] = b"{\"amount\":1000,\"currency\":\"EUR\",\"to\":\"acct_123\"}";

fn routes() -> Router {
    Router::new().route(
        "/pay",
        post(|| async {
            (
                StatusCode::CREATED,
                [
                    (header::CONTENT_TYPE, "application/json"),
                    (header::LOCATION, "/pay/1"),
                ],
                "{\"id\":1,\"status\":\"accepted\"}",
            )
        }),
    )
}

async fn serve(router: Router) -> Result<SocketAddr, Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(addr)
}

/// Which key each request carries.
#[derive(Clone, Copy)]
enum Key {
    None,
    Same,
    Fresh,
}

/// The next fresh key's number.
static NEXT: AtomicU64 = AtomicU64::new(0);

/// Requests per second from `CONCURRENCY` tasks for `run`.
async fn rate(
    client: &HttpClient,
    addr: SocketAddr,
    key: Key,
    run: Duration,
) -> Result<f64, Error> {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (client, stop, done) = (client.clone(), stop.clone(), done.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let mut req = hyper::Request::post(format!("http://{addr}/pay"));
                    match key {
                        Key::None => {}
                        Key::Same => req = req.header("idempotency-key", "bench-replay"),
                        Key::Fresh => {
                            let n = NEXT.fetch_add(1, Ordering::Relaxed);
                            req = req.header("idempotency-key", format!("bench-{n}"));
                        }
                    }
                    let response = client
                        .request(req.body(Full::new(Bytes::from_static(BODY)))?)
                        .await?;
                    if response.status() != StatusCode::CREATED {
                        return Err::<(), Error>(format!("got {}", response.status()).into());
                    }
                    response.into_body().collect().await?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect();
    tokio::time::sleep(run).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64())
}

/// One measurement round of every scenario, in req/s.
struct Round {
    baseline: f64,
    durable: f64,
    pass: f64,
    replay: f64,
    first: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let quick = std::env::args().any(|a| a == "--quick");
    let (rounds, run) = if quick {
        (1, Duration::from_secs(1))
    } else {
        (3, Duration::from_millis(1500))
    };
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("bench.idem"))?;
    let plain = serve(routes()).await?;
    let durable = serve(durable_route(&store)?).await?;
    let layered =
        serve(routes().layer(
            IdempotencyLayer::new(store.idempotency_keys()).replay_headers([header::LOCATION]),
        ))
        .await?;
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();

    // Store the replayed key, then warm up connections.
    let first = hyper::Request::post(format!("http://{layered}/pay"))
        .header("idempotency-key", "bench-replay")
        .body(Full::new(Bytes::from_static(BODY)))?;
    client.request(first).await?.into_body().collect().await?;
    rate(&client, plain, Key::None, Duration::from_millis(300)).await?;
    rate(&client, durable, Key::Fresh, Duration::from_millis(300)).await?;
    rate(&client, layered, Key::Same, Duration::from_millis(300)).await?;

    // Interleaved rounds: drift on a shared machine hits every scenario alike.
    let mut all = Vec::new();
    for _ in 0..rounds {
        all.push(Round {
            baseline: rate(&client, plain, Key::None, run).await?,
            durable: rate(&client, durable, Key::Fresh, run).await?,
            pass: rate(&client, layered, Key::None, run).await?,
            replay: rate(&client, layered, Key::Same, run).await?,
            first: rate(&client, layered, Key::Fresh, run).await?,
        });
    }
    let m = |f: fn(&Round) -> f64| median(all.iter().map(f).collect());
    let (baseline, durable) = (m(|r| r.baseline), m(|r| r.durable));

    println!(
        "requests/s, {CONCURRENCY} concurrent keep-alive clients in the same process, median of {rounds} interleaved rounds of {run:?}"
    );
    println!("{:<46} {:>9} {:>12}", "", "req/s", "vs baseline");
    println!(
        "{:<46} {baseline:>9.0}",
        "baseline: no layer, handler writes nothing"
    );
    println!(
        "{:<46} {durable:>9.0} {:>11.2}x",
        "baseline: no layer, handler: 1 durable write",
        durable / baseline
    );
    for (name, r) in [
        ("layer, no key (pass-through)", m(|r| r.pass)),
        ("layer, replay (same key: a read)", m(|r| r.replay)),
        ("layer, first execution (begin + complete)", m(|r| r.first)),
    ] {
        println!("{name:<46} {r:>9.0} {:>11.2}x", r / baseline);
    }
    println!(
        "first execution vs the 1-durable-write handler: {:.2}x",
        m(|r| r.first) / durable
    );
    let (c, k) = (store.commit_stats(), store.idempotency_keys().stats());
    println!(
        "store: {} durable commits for {} reservations + {} completions + inbox claims; {} replays",
        c.durable_commits, k.reserved, k.completed, k.replays
    );
    Ok(())
}

/// `POST /pay` without the layer whose handler makes one durable store
/// write (an inbox claim of its request's key).
fn durable_route(store: &Store) -> Result<Router, Error> {
    let inbox = store.inbox("bench")?;
    Ok(Router::new().route(
        "/pay",
        post(move |headers: axum::http::HeaderMap| {
            let inbox = inbox.clone();
            async move {
                let key = headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("none")
                    .to_owned();
                let claimed =
                    tokio::task::spawn_blocking(move || inbox.claim(&key, chrono::Utc::now()))
                        .await;
                match claimed {
                    Ok(Ok(_)) => (
                        StatusCode::CREATED,
                        [
                            (header::CONTENT_TYPE, "application/json"),
                            (header::LOCATION, "/pay/1"),
                        ],
                        "{\"id\":1,\"status\":\"accepted\"}",
                    ),
                    _ => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        [(header::CONTENT_TYPE, "text/plain"), (header::LOCATION, "")],
                        "",
                    ),
                }
            }
        }),
    ))
}
