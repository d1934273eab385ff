//! Webhooks end to end over loopback: a dispatcher sending its outbox with
//! `webhooks::Sender` to a `webhooks::Receiver`, beside a hand-rolled loop
//! of the same requests to the same receiver, from the same run.
//!
//! ```text
//! cargo run --release -p idemstore-benches --features webhooks --bin webhooks
//! cargo run --release -p idemstore-benches --features webhooks --bin webhooks -- --quick
//! cargo run --release -p idemstore-benches --features webhooks --bin webhooks -- --once threads 16
//! ```
//!
//! Each cell drains `--entries` entries (default 5,000; `--quick` 1,000) of
//! destination `partner`, enqueued durably before the clock starts on a
//! fresh store in a temporary folder on the disk, with payloads of about
//! 250 bytes, and times from the start until every entry is `Completed`
//! (`Outbox::counts`, polled every 2 ms): entries per second. The
//! receiver is axum on 127.0.0.1, on a 2-thread tokio runtime of its own
//! in this process (`TCP_NODELAY` on its connections, as on the
//! sender's), with a fresh store for each cell: it verifies each
//! delivery's Standard Webhooks signature and claims its id in an inbox
//! with a one-row effect (`Receiver::receive_async`), durably, and answers
//! 204.
//!
//! - **threads**: `Dispatcher::builder(outbox).workers(w).start(sender.blocking())`;
//! - **tasks**: `.start_async(sender.async_send())` on a 2-thread tokio
//!   runtime;
//! - **loop** (the baseline): `w` tasks on that runtime posting the same
//!   requests (the same headers, the same payloads, signed with
//!   `webhooks::sign` at each send) through hyper-util's legacy pooled
//!   client over plain HTTP, built as the sender builds its own, to the
//!   same receiver, with no sender store: `w` requests in flight, as the
//!   dispatcher's `w` workers;
//! - **threads-204**, **tasks-204**, **loop-204**: the same three to a
//!   route of the same server that reads the body and answers 204 without
//!   verifying or claiming: loop ÷ loop-204 is what the receiver's durable
//!   claim costs, and the dispatchers' figures there are the sender's own
//!   ceiling on this machine.
//!
//! For 4, 16 and 64 workers, the six run in turn, three times over; each
//! figure is the median of its three runs, printed beside the loop's with
//! the ratio (the target: at least 0.8× the loop). Then, per cell
//! (medians too), where the time goes: the requests in the receiver's
//! handlers on average (their summed time over the drain's: `w` at most),
//! the connections the receiver accepted (about `w`: the clients reuse
//! their connections), the process's CPU time per entry (both sides,
//! from `/proc/self/stat`), and the durable commits of the sender's and
//! the receiver's stores.
//!
//! `--once WAY W` (`WAY` one of the six names above) runs one cell once,
//! for a profiler.
//! `--sender-dir DIR`, `--receiver-dir DIR` put the sender's or the
//! receiver's stores in DIR instead (`/dev/shm`: what its fsyncs cost on
//! this disk, shared by both sides here, as it would not be between two
//! machines); `--batch-size N` sets the dispatchers' `batch_size`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::serve::ListenerExt;
use bytes::Bytes;
use chrono::Utc;
use http_body_util::{BodyExt, Full};
use hyper::header::{CONTENT_TYPE, USER_AGENT};
use hyper::{Method, Request, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idemstore::redb::TableDefinition;
use idemstore::webhooks::{Endpoint, Received, Receiver, Secret, Sender, Verifier, sign};
use idemstore::{Dispatcher, NewEntry, Store};
use tokio::runtime::Runtime;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const DESTINATION: &str = "partner";
const WORKERS: [usize; 3] = [4, 16, 64];
/// Entries per enqueue commit while setting up.
const SETUP_CHUNK: usize = 1_000;
/// The longest a cell may take before the run is called broken.
const BOUND: Duration = Duration::from_secs(120);

/// The receiver's effect: one row per delivery, its id to its body.
const EFFECTS: TableDefinition<&str, &[u8]> = TableDefinition::new("app.webhooks");

/// Who sends (a dispatcher on threads, one on tasks, the hand-rolled
/// loop), and to which route: the receiver that verifies and claims, or
/// the one that answers 204.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Way {
    Threads,
    Tasks,
    Loop,
    Threads204,
    Tasks204,
    Loop204,
}

impl Way {
    const ALL: [Way; 6] = [
        Way::Threads,
        Way::Tasks,
        Way::Loop,
        Way::Threads204,
        Way::Tasks204,
        Way::Loop204,
    ];

    fn parse(s: &str) -> Option<Way> {
        Way::ALL.into_iter().find(|w| w.name() == s)
    }

    fn name(self) -> &'static str {
        match self {
            Way::Threads => "threads",
            Way::Tasks => "tasks",
            Way::Loop => "loop",
            Way::Threads204 => "threads-204",
            Way::Tasks204 => "tasks-204",
            Way::Loop204 => "loop-204",
        }
    }

    /// The receiver's route.
    fn path(self) -> &'static str {
        match self {
            Way::Threads | Way::Tasks | Way::Loop => "/hooks",
            Way::Threads204 | Way::Tasks204 | Way::Loop204 => "/plain",
        }
    }
}

/// The settings of a run besides its workers and entries.
#[derive(Clone, Default)]
struct Options {
    /// Where each side's stores go: a temporary folder under each (the
    /// system's temporary folder by default).
    sender: Option<std::path::PathBuf>,
    receiver: Option<std::path::PathBuf>,
    /// The dispatchers' `batch_size` (default: theirs).
    batch_size: Option<usize>,
}

impl Options {
    fn make(under: Option<&std::path::PathBuf>) -> std::io::Result<tempfile::TempDir> {
        match under {
            Some(dir) => tempfile::tempdir_in(dir),
            None => tempfile::tempdir(),
        }
    }
}

/// What one cell measured.
#[derive(Clone, Copy, Default)]
struct Cell {
    /// Entries per second.
    rate: f64,
    /// The process's CPU time per entry (both sides, every thread), µs.
    cpu: f64,
    /// Connections the receiver accepted.
    connections: u64,
    /// Requests in the receiver's handlers, on average over the drain
    /// (their summed time over the drain's).
    in_flight: f64,
    /// The sender store's durable commits.
    sender_fsyncs: u64,
    /// The receiver store's durable commits.
    receiver_fsyncs: u64,
}

/// A timed drain: entries per second, and CPU µs per entry.
struct Timed {
    rate: f64,
    cpu: f64,
}

impl Timed {
    fn new(entries: usize, took: Duration, cpu: Duration) -> Timed {
        Timed {
            rate: entries as f64 / took.as_secs_f64(),
            cpu: cpu.as_secs_f64() * 1e6 / entries as f64,
        }
    }
}

/// The CPU time of this process so far, every thread (ended ones too),
/// user and system, to the 10 ms of `/proc`'s clock ticks.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command, which is in parentheses.
    let fields: Vec<u64> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .unwrap_or_default()
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // utime and stime: fields 14 and 15 of the line, 12 and 13 after `)`.
    let ticks = fields.get(11).copied().unwrap_or(0) + fields.get(12).copied().unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let entries = args
        .iter()
        .position(|a| a == "--entries")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(if quick { 1_000 } else { 5_000_usize });
    let dir = |flag: &str| {
        let i = args.iter().position(|a| a == flag)?;
        args.get(i + 1).map(std::path::PathBuf::from)
    };
    let options = Options {
        sender: dir("--sender-dir"),
        receiver: dir("--receiver-dir"),
        batch_size: args
            .iter()
            .position(|a| a == "--batch-size")
            .and_then(|i| args.get(i + 1)?.parse().ok()),
    };
    let server_rt = runtime("receiver")?;
    let client_rt = runtime("client")?;
    if let Some(i) = args.iter().position(|a| a == "--once") {
        let way = args
            .get(i + 1)
            .and_then(|w| Way::parse(w))
            .ok_or("--once threads|tasks|loop|threads-204|tasks-204|loop-204 W")?;
        let workers = args
            .get(i + 2)
            .and_then(|w| w.parse().ok())
            .ok_or("--once WAY W: W workers")?;
        let cell = run(way, workers, entries, &options, &server_rt, &client_rt)?;
        println!(
            "{}, {workers} workers, {entries} entries: {:.0}/s, {:.1} in flight, {} connections \
             accepted, {:.0} µs CPU per entry, {} sender fsyncs, {} receiver fsyncs",
            way.name(),
            cell.rate,
            cell.in_flight,
            cell.connections,
            cell.cpu,
            cell.sender_fsyncs,
            cell.receiver_fsyncs
        );
        return Ok(());
    }
    println!(
        "webhooks end to end over loopback: {entries} entries to one destination, durable on \
         both sides, entries per second (medians of 3)"
    );
    let mut figures = Vec::new();
    for workers in WORKERS {
        let mut cells: Vec<Vec<Cell>> = vec![Vec::new(); Way::ALL.len()];
        for _ in 0..3 {
            for (k, way) in Way::ALL.into_iter().enumerate() {
                cells[k].push(run(
                    way, workers, entries, &options, &server_rt, &client_rt,
                )?);
            }
        }
        figures.push((workers, cells.iter().map(|c| median(c)).collect::<Vec<_>>()));
    }
    print_tables(&figures);
    Ok(())
}

/// The tables, from each worker count's medians (in the order of
/// [`Way::ALL`]).
fn print_tables(figures: &[(usize, Vec<Cell>)]) {
    let header = |last: &str| {
        println!(
            "{:>7} | {:>9} | {:>9} | {:>9} | {:>12} | {:>10} | {:>10}",
            "workers", "threads", "tasks", "loop", "threads/loop", "tasks/loop", last
        );
        println!("{}", "-".repeat(86));
    };
    println!("\nthe receiver verifies and claims each delivery durably, with a one-row effect\n");
    header("loop/204");
    for (workers, med) in figures {
        println!(
            "{workers:>7} | {:>9.0} | {:>9.0} | {:>9.0} | {:>11.2}× | {:>9.2}× | {:>9.2}×",
            med[0].rate,
            med[1].rate,
            med[2].rate,
            med[0].rate / med[2].rate,
            med[1].rate / med[2].rate,
            med[2].rate / med[5].rate
        );
    }
    println!(
        "\nthe same server's route that reads the body and answers 204 (no verifying, no claim)\n"
    );
    header("");
    for (workers, med) in figures {
        println!(
            "{workers:>7} | {:>9.0} | {:>9.0} | {:>9.0} | {:>11.2}× | {:>9.2}× |",
            med[3].rate,
            med[4].rate,
            med[5].rate,
            med[3].rate / med[5].rate,
            med[4].rate / med[5].rate,
        );
    }
    println!(
        "\nwhere the time goes (medians of the same runs): requests in the receiver's handlers \
         on average, connections it accepted, the process's CPU per entry, each store's \
         durable commits\n"
    );
    println!(
        "{:>7} | {:>11} | {:>9} | {:>11} | {:>12} | {:>13} | {:>15}",
        "workers",
        "way",
        "in flight",
        "connections",
        "CPU µs/entry",
        "sender fsyncs",
        "receiver fsyncs"
    );
    println!("{}", "-".repeat(97));
    for (workers, med) in figures {
        for (way, cell) in Way::ALL.into_iter().zip(med) {
            // The 204 route's handler is not timed: it does nothing.
            let in_flight = if way.path() == "/hooks" {
                format!("{:.1}", cell.in_flight)
            } else {
                "-".to_owned()
            };
            println!(
                "{workers:>7} | {:>11} | {in_flight:>9} | {:>11} | {:>12.0} | {:>13} | {:>15}",
                way.name(),
                cell.connections,
                cell.cpu,
                cell.sender_fsyncs,
                cell.receiver_fsyncs,
            );
        }
    }
}

fn runtime(name: &str) -> Res<Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(name)
        .enable_all()
        .build()?)
}

/// Each figure of `cells` by itself, the median of its runs.
fn median(cells: &[Cell]) -> Cell {
    let mid = |f: fn(&Cell) -> f64| {
        let mut v: Vec<f64> = cells.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "counts, back from the f64 they were sorted as"
    )]
    Cell {
        rate: mid(|c| c.rate),
        cpu: mid(|c| c.cpu),
        connections: mid(|c| c.connections as f64) as u64,
        in_flight: mid(|c| c.in_flight),
        sender_fsyncs: mid(|c| c.sender_fsyncs as f64) as u64,
        receiver_fsyncs: mid(|c| c.receiver_fsyncs as f64) as u64,
    }
}

fn secret() -> Res<Secret> {
    Ok(Secret::parse(SECRET)?)
}

/// Entry `i`'s payload: about 250 bytes of JSON.
fn payload(i: usize) -> Vec<u8> {
    format!(
        r#"{{"type":"order.paid","order":{i},"amount":4200,"currency":"EUR","customer":"cus_{i:012}","note":"{}"}}"#,
        "x".repeat(140)
    )
    .into_bytes()
}

/// Adds the time from its making to its drop to a sum, in ns.
struct Busy<'a> {
    since: Instant,
    sum: &'a AtomicU64,
}

impl<'a> Busy<'a> {
    fn new(sum: &'a AtomicU64) -> Self {
        Busy {
            since: Instant::now(),
            sum,
        }
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let ns = u64::try_from(self.since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.sum.fetch_add(ns, Ordering::Relaxed);
    }
}

/// The receiver for one cell: axum on 127.0.0.1 with a fresh store;
/// `/hooks` verifies and claims, `/plain` reads the body and answers 204.
struct Server {
    addr: SocketAddr,
    accepted: Arc<AtomicU64>,
    /// The handlers' summed time, ns.
    busy: Arc<AtomicU64>,
    store: Store,
    task: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn serve(dir: tempfile::TempDir, rt: &Runtime) -> Res<Server> {
    let store = Store::open(dir.path().join("receiver.idem"))?;
    let receiver = Receiver::new(store.inbox("hooks")?, Verifier::standard(vec![secret()?]));
    let busy = Arc::new(AtomicU64::new(0));
    let hooks_busy = busy.clone();
    let app = Router::new()
        .route(
            "/hooks",
            post(move |headers: HeaderMap, body: Bytes| {
                let (receiver, busy) = (receiver.clone(), hooks_busy.clone());
                async move {
                    let _busy = Busy::new(&busy);
                    let row = body.clone();
                    let got: Received<(), idemstore::Error> = receiver
                        .receive_async(&headers, &body, Utc::now(), move |tx, verified| {
                            tx.open_table(EFFECTS)?.insert(verified.id(), &row[..])?;
                            Ok(())
                        })
                        .await;
                    got.into_response().into_response()
                }
            }),
        )
        .route("/plain", post(|_: Bytes| async { StatusCode::NO_CONTENT }));
    let accepted = Arc::new(AtomicU64::new(0));
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    let counter = accepted.clone();
    let listener = listener.tap_io(move |tcp| {
        counter.fetch_add(1, Ordering::Relaxed);
        let _ = tcp.set_nodelay(true);
    });
    let task = rt.spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(Server {
        addr,
        accepted,
        busy,
        store,
        task,
        _dir: dir,
    })
}

/// One cell: `way` with `workers`, `entries` deliveries, on a fresh
/// receiver (and, for a dispatcher, a fresh sender store).
fn run(
    way: Way,
    workers: usize,
    entries: usize,
    options: &Options,
    server_rt: &Runtime,
    client_rt: &Runtime,
) -> Res<Cell> {
    let server = serve(Options::make(options.receiver.as_ref())?, server_rt)?;
    let receiver_before = server.store.commit_stats().durable_commits;
    let (timed, sender) = match way {
        Way::Loop | Way::Loop204 => (
            hand_rolled(workers, entries, &server, way.path(), client_rt)?,
            0,
        ),
        _ => {
            let dir = Options::make(options.sender.as_ref())?;
            dispatch(
                way,
                (workers, options.batch_size),
                entries,
                &dir,
                &server,
                client_rt,
            )?
        }
    };
    let receiver_fsyncs = server.store.commit_stats().durable_commits - receiver_before;
    if way.path() == "/hooks" {
        let claimed = server.store.inbox("hooks")?.len()?;
        if claimed != entries as u64 {
            return Err(format!("{}: {claimed} claims of {entries}", way.name()).into());
        }
    }
    Ok(Cell {
        rate: timed.rate,
        cpu: timed.cpu,
        connections: server.accepted.load(Ordering::Relaxed),
        in_flight: server.busy.load(Ordering::Relaxed) as f64 * timed.rate / 1e9 / entries as f64,
        sender_fsyncs: sender,
        receiver_fsyncs,
    })
}

/// A dispatcher draining `entries` entries to `server`: its figures, and
/// the sender store's durable commits while it ran.
fn dispatch(
    way: Way,
    (workers, batch_size): (usize, Option<usize>),
    entries: usize,
    dir: &tempfile::TempDir,
    server: &Server,
    client_rt: &Runtime,
) -> Res<(Timed, u64)> {
    let store = Store::open(dir.path().join("sender.idem"))?;
    let outbox = store.outbox();
    for start in (0..entries).step_by(SETUP_CHUNK) {
        outbox.enqueue_many(
            (start..entries.min(start + SETUP_CHUNK))
                .map(|i| NewEntry::new(format!("c{i}"), DESTINATION, format!("o-{i}"), payload(i))),
            Utc::now(),
        )?;
    }
    let sender = Sender::builder()
        .endpoint(
            DESTINATION,
            Endpoint::new(&format!("http://{}{}", server.addr, way.path()))?.secret(secret()?),
        )
        .build()?;
    let target = entries as u64;
    let before = store.commit_stats();
    let (began, cpu) = (Instant::now(), cpu_time());
    let builder = || {
        let builder = Dispatcher::builder(outbox.clone()).workers(workers);
        match batch_size {
            Some(n) => builder.batch_size(n),
            None => builder,
        }
    };
    let stats = if matches!(way, Way::Threads | Way::Threads204) {
        let handle = builder().start(sender.blocking())?;
        while outbox.counts()?.completed < target {
            if began.elapsed() > BOUND {
                return Err(format!("{}: not drained: {:?}", way.name(), handle.stats()).into());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let took = (began.elapsed(), cpu_time().saturating_sub(cpu));
        let stats = handle.stats();
        handle.shutdown()?;
        (took, stats)
    } else {
        client_rt.block_on(async {
            let handle = builder().start_async(sender.async_send())?;
            while outbox.counts()?.completed < target {
                if began.elapsed() > BOUND {
                    return Err(format!("{}: not drained: {:?}", way.name(), handle.stats()).into());
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let took = (began.elapsed(), cpu_time().saturating_sub(cpu));
            let stats = handle.stats();
            handle.shutdown().await?;
            Ok::<_, Box<dyn std::error::Error>>((took, stats))
        })?
    };
    let ((took, cpu), stats) = stats;
    if stats.delivered != target {
        return Err(format!("{}: {stats:?}", way.name()).into());
    }
    let after = store.commit_stats();
    let fsyncs = after.durable_commits - before.durable_commits;
    Ok((Timed::new(entries, took, cpu), fsyncs))
}

/// The baseline: `workers` tasks posting the sender's requests for
/// `entries` entries to `path` on `server` through one pooled client,
/// with no store on this side.
fn hand_rolled(
    workers: usize,
    entries: usize,
    server: &Server,
    path: &str,
    client_rt: &Runtime,
) -> Res<Timed> {
    // As the sender builds its client, over plain HTTP.
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_secs(5)));
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(http);
    let uri: Uri = format!("http://{}{path}", server.addr).parse()?;
    let secrets = Arc::new(vec![secret()?]);
    let payloads: Arc<Vec<Bytes>> = Arc::new((0..entries).map(|i| payload(i).into()).collect());
    let next = Arc::new(AtomicUsize::new(0));
    let (began, cpu) = (Instant::now(), cpu_time());
    client_rt.block_on(async {
        let tasks: Vec<_> = (0..workers)
            .map(|_| {
                let (client, uri, secrets, payloads, next) = (
                    client.clone(),
                    uri.clone(),
                    secrets.clone(),
                    payloads.clone(),
                    next.clone(),
                );
                tokio::spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(body) = payloads.get(i) else {
                            return Ok(());
                        };
                        // The sender's id: `msg_` and 32 hex digits.
                        let id = format!("msg_{i:032x}");
                        let timestamp = Utc::now().timestamp();
                        let signature = sign(&secrets, &id, timestamp, body);
                        let request = Request::builder()
                            .method(Method::POST)
                            .uri(uri.clone())
                            .header("webhook-id", &id)
                            .header("webhook-timestamp", timestamp.to_string())
                            .header("webhook-signature", signature)
                            .header("idempotency-key", &id)
                            .header(CONTENT_TYPE, "application/json")
                            .header(USER_AGENT, "idemstore/0.1.0")
                            .body(Full::new(body.clone()))?;
                        let answer = client.request(request).await?;
                        let status = answer.status();
                        answer.into_body().collect().await?;
                        if status != StatusCode::NO_CONTENT {
                            return Err(format!("answered {status}").into());
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await
                .map_err(|e| e.to_string())?
                .map_err(|e: Box<dyn std::error::Error + Send + Sync>| e.to_string())?;
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    })?;
    Ok(Timed::new(
        entries,
        began.elapsed(),
        cpu_time().saturating_sub(cpu),
    ))
}
