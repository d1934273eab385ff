//! Requests per second through the idempotency layer beside the same axum
//! server without it, in one run, over real sockets.
//!
//! - baseline: `POST /pay` on a server without the layer;
//! - pass-through: the same request, no key, through the layer;
//! - replay: one key sent again and again (a read, no commit);
//! - first execution: a new key every request (`begin` and `complete`,
//!   two durable commits, group-committed across concurrent requests).
//!
//! `cargo bench --features middleware --bench middleware` (about 15 s;
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

/// Requests per second from `CONCURRENCY` tasks for `run`.
async fn rate(
    client: &HttpClient,
    addr: SocketAddr,
    key: Key,
    run: Duration,
) -> Result<f64, Error> {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    static NEXT: AtomicU64 = AtomicU64::new(0);
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

#[tokio::main]
async fn main() -> Result<(), Error> {
    let quick = std::env::args().any(|a| a == "--quick");
    let run = Duration::from_secs(if quick { 1 } else { 3 });
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("bench.idem"))?;
    let plain = serve(routes()).await?;
    let layered =
        serve(routes().layer(
            IdempotencyLayer::new(store.idempotency_keys()).replay_headers([header::LOCATION]),
        ))
        .await?;
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();

    // Warm up connections and store the replayed key.
    rate(&client, plain, Key::None, Duration::from_millis(300)).await?;
    rate(&client, layered, Key::Same, Duration::from_millis(300)).await?;

    let baseline = rate(&client, plain, Key::None, run).await?;
    let pass = rate(&client, layered, Key::None, run).await?;
    let replay = rate(&client, layered, Key::Same, run).await?;
    let first = rate(&client, layered, Key::Fresh, run).await?;
    let baseline_after = rate(&client, plain, Key::None, run).await?;
    let base = f64::midpoint(baseline, baseline_after);

    println!(
        "requests/s, {CONCURRENCY} concurrent clients, keep-alive, one process (2 tokio workers share the machine with the client)"
    );
    println!("{:<44} {:>10} {:>8}", "", "req/s", "ratio");
    println!(
        "{:<44} {baseline:>10.0} {:>8}",
        "baseline: no layer (before)", ""
    );
    println!(
        "{:<44} {baseline_after:>10.0} {:>8}",
        "baseline: no layer (after)", ""
    );
    for (name, r) in [
        ("layer, no key (pass-through)", pass),
        ("layer, replay (same key, read only)", replay),
        ("layer, first execution (new key, 2 commits)", first),
    ] {
        println!("{name:<44} {r:>10.0} {:>7.2}x", r / base);
    }
    let (c, k) = (store.commit_stats(), store.idempotency_keys().stats());
    println!(
        "store: {} durable commits for {} reservations + {} completions ({:.1} requests per fsync); {} replays",
        c.durable_commits,
        k.reserved,
        k.completed,
        (k.reserved + k.completed) as f64 / c.durable_commits.max(1) as f64,
        k.replays
    );
    Ok(())
}
