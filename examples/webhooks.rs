//! Webhooks both ways, exactly once, with both processes killed (SIGKILL)
//! at random moments and restarted.
//!
//! ```sh
//! cargo run --release --example webhooks --features webhooks          # 2,000 orders, 20 kills of each side
//! cargo run --example webhooks --features webhooks -- --smoke         # 200 orders, 5 kills of each side
//! cargo run --example webhooks --features webhooks -- --orders 500 --kills 10
//! cargo run --example webhooks --features webhooks -- receiver FILE 127.0.0.1:3001
//! cargo run --example webhooks --features webhooks -- sender FILE http://127.0.0.1:3001/hooks 100
//! ```
//!
//! The sender creates orders `0..COUNT` (those not created yet): each order
//! is a row in its own table and an outbox entry for destination
//! `partner`, written in one commit. A dispatcher POSTs each entry as a
//! signed Standard Webhook ([`Sender`]) until the receiver answers 2xx. The
//! sender exits once every entry is `Completed`.
//!
//! The receiver, an axum server, verifies each delivery and claims its
//! `webhook-id` in an inbox ([`Receiver`]) in the same commit as its
//! effect: the order recorded by webhook id, and a count of the times each
//! order was applied. A delivery it has seen before is answered 204 and
//! runs nothing.
//!
//! With no mode (or `--smoke`, or `--orders N --kills N`), the example runs
//! both as child processes on temporary files, kills each with SIGKILL 50
//! to 400 ms after each start and restarts it, until each has had its
//! kills (a sender that delivered everything before then gets more orders),
//! lets the sender finish, and checks the receiver's file: every order
//! applied exactly once. It exits non-zero if one was applied twice or not
//! at all.
//!
//! Each kill leaves something behind that the next run must finish: a
//! killed sender's claimed entries (the next dispatcher's reaper hands them
//! back after the 2 s lease), a request the receiver died in the middle of
//! (the sender saw the connection break once its request had left, so the
//! entry is `OutcomeUnknown`; the sender sends it again, with the same
//! `webhook-id`, and the receiver applies it if its first commit never
//! happened, or answers it as a duplicate if it did).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::routing::post;
use idemstore::chrono::Utc;
use idemstore::redb::{
    ReadableTable as _, ReadableTableMetadata as _, TableDefinition, TableError, WriteTransaction,
};
use idemstore::webhooks::{Endpoint, Received, Receiver, Secret, Sender, Verifier};
use idemstore::{
    Dispatcher, DispatcherHandle, NewEntry, Outbox, OutboxFilter, OutboxStatus,
    REASON_OUTCOME_UNKNOWN, RetryPolicy, Store,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const SECOND: Duration = Duration::from_secs(1);

/// The sender's orders: order number → status.
const ORDERS: TableDefinition<u64, &str> = TableDefinition::new("app.orders");
/// The receiver's orders: webhook id → order number.
const APPLIED: TableDefinition<&str, u64> = TableDefinition::new("app.applied");
/// How many times the receiver applied each order (anything but 1 is a bug).
const APPLIED_COUNT: TableDefinition<u64, u32> = TableDefinition::new("app.applied_count");

// The sender's side.

/// Starts the dispatcher: each entry for `partner` sent to `url`, signed.
fn start_sender(store: &Store, url: &str) -> Result<DispatcherHandle, Error> {
    let secret = Secret::parse(SECRET)?;
    let endpoint = Endpoint::new(url)?.secret(secret).timeout(SECOND);
    let sender = Sender::builder().endpoint("partner", endpoint).build()?;
    let retry = RetryPolicy::exponential(Duration::from_millis(10), Duration::from_millis(200));
    Ok(Dispatcher::builder(store.outbox())
        .workers(4)
        .lease(2 * SECOND) // a killed sender's claims are sent again 2 s on
        .retry(retry.max_attempts(10_000))
        .start(sender.blocking())?)
}

/// Creates order `n` and its webhook in one commit: both or neither.
fn create_order(store: &Store, n: u64) -> Result<(), Error> {
    let key = format!("order-{n}");
    let webhook = NewEntry::new(&key, "partner", &key, format!(r#"{{"order":{n}}}"#));
    store.write(|tx| {
        tx.open_table(ORDERS)?.insert(n, "created")?;
        store.outbox().enqueue_in(tx, webhook, Utc::now())?;
        Ok(())
    })
}

/// Sends again what ended in doubt (the connection broke once the request
/// had left): the receiver knows each webhook id, so a second send is safe.
fn resend_in_doubt(outbox: &Outbox) -> Result<(), Error> {
    let in_doubt = OutboxFilter::any().status(OutboxStatus::OutcomeUnknown);
    for record in outbox.list(&in_doubt, 100)? {
        outbox.requeue(record.entry.id, Utc::now())?;
    }
    Ok(())
}

// The receiver's side.

/// The receiver's route: each delivery verified, then its webhook id
/// claimed in an inbox in the same commit as the order it applies.
fn receiver_app(store: &Store) -> Result<Router, Error> {
    let verifier = Verifier::standard(vec![Secret::parse(SECRET)?]);
    let receiver = Receiver::new(store.inbox("partner")?, verifier);
    let route = post(move |headers: HeaderMap, body: Bytes| {
        let receiver = receiver.clone();
        async move {
            let owned = body.clone(); // the effect's, on tokio's blocking pool
            let answer: Received<(), Error> = receiver
                .receive_async(&headers, &body, Utc::now(), move |tx, hook| {
                    apply(tx, hook.id(), &owned)
                })
                .await;
            answer.into_response() // 204 applied or duplicate; 400, 401, 413; 500
        }
    });
    Ok(Router::new().route("/hooks", route))
}

/// The effect, run once per webhook id: the order recorded, and counted.
fn apply(tx: &WriteTransaction, webhook_id: &str, body: &[u8]) -> Result<(), Error> {
    let json: serde_json::Value = serde_json::from_slice(body)?;
    let order = json["order"].as_u64().ok_or("no order number")?;
    tx.open_table(APPLIED)?.insert(webhook_id, order)?;
    let mut counts = tx.open_table(APPLIED_COUNT)?;
    let applied = counts.get(order)?.map_or(0, |n| n.value());
    counts.insert(order, applied + 1)?;
    Ok(())
}

// Everything below runs the two sides as processes and kills them.

const USAGE: &str =
    "usage: webhooks [--smoke | --orders N --kills N | sender FILE URL COUNT | receiver FILE ADDR]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = match args[..] {
        ["sender", file, url, count] => run_sender(Path::new(file), url, count),
        ["receiver", file, addr] => run_receiver(Path::new(file), addr),
        ["--smoke"] => kill_test(200, 5),
        [] => kill_test(2_000, 20),
        ["--orders", orders, "--kills", kills] => match (orders.parse(), kills.parse()) {
            (Ok(orders), Ok(kills)) => kill_test(orders, kills),
            _ => Err(USAGE.into()),
        },
        _ => Err(USAGE.into()),
    };
    match run {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("webhooks: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The sender process: creates the orders not created yet, and runs the
/// dispatcher until every webhook is delivered.
fn run_sender(file: &Path, url: &str, count: &str) -> Result<(), Error> {
    let count: u64 = count.parse()?;
    let store = Store::open(file)?;
    let dispatcher = start_sender(&store, url)?;
    // The orders a run before this one created, each with its webhook.
    let created = store.read(|tx| {
        let mut created = BTreeSet::new();
        match tx.open_table(ORDERS) {
            Ok(orders) => {
                for row in orders.iter()? {
                    created.insert(row?.0.value());
                }
            }
            Err(TableError::TableDoesNotExist(_)) => {}
            Err(e) => return Err(e.into()),
        }
        Ok::<_, Error>(created)
    })?;
    for n in (0..count).filter(|n| !created.contains(n)) {
        create_order(&store, n)?;
    }
    let outbox = store.outbox();
    loop {
        resend_in_doubt(&outbox)?;
        let counts = outbox.counts()?;
        if counts.failed > 0 {
            return Err(format!("{} webhooks failed for good", counts.failed).into());
        }
        if counts.completed == count {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    dispatcher.shutdown()?;
    Ok(())
}

/// The receiver process: serves `POST /hooks` on `addr` until killed.
fn run_receiver(file: &Path, addr: &str) -> Result<(), Error> {
    let addr: SocketAddr = addr.parse()?;
    let store = Store::open(file)?;
    let app = receiver_app(&store)?;
    tokio::runtime::Runtime::new()?.block_on(async move {
        // A receiver killed a moment ago may still hold the port.
        let mut tries = 0;
        let listener = loop {
            match tokio::net::TcpListener::bind(addr).await {
                Ok(listener) => break listener,
                Err(e) if tries < 100 && e.kind() == std::io::ErrorKind::AddrInUse => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        axum::serve(listener, app).await?;
        Ok(())
    })
}

/// One side of the kill test: its command line, its process and its kills.
struct Side {
    name: &'static str,
    args: Vec<OsString>,
    child: Child,
    kill_at: Instant,
    kills: u32,
    exited: bool,
}

impl Side {
    fn start(name: &'static str, args: Vec<OsString>, rng: &mut Rng) -> Result<Side, Error> {
        let child = spawn(&args)?;
        Ok(Side {
            name,
            args,
            child,
            kill_at: rng.kill_time(),
            kills: 0,
            exited: false,
        })
    }

    /// Kills the process with SIGKILL, waits for it, and starts it again.
    fn kill_and_restart(&mut self, rng: &mut Rng) -> Result<(), Error> {
        self.child.kill()?; // SIGKILL on Unix
        self.child.wait()?;
        self.kills += 1;
        self.restart(rng)
    }

    fn restart(&mut self, rng: &mut Rng) -> Result<(), Error> {
        self.child = spawn(&self.args)?;
        self.kill_at = rng.kill_time();
        self.exited = false;
        Ok(())
    }

    /// Stops the process for good (SIGKILL: everything it answered is
    /// already durable).
    fn stop(&mut self) -> Result<(), Error> {
        if !self.exited {
            self.child.kill()?;
            self.child.wait()?;
            self.exited = true;
        }
        Ok(())
    }
}

impl Drop for Side {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// This executable, run with `args`; its output discarded, its errors
/// shown.
fn spawn(args: &[OsString]) -> Result<Child, Error> {
    Ok(Command::new(std::env::current_exe()?)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()?)
}

/// Runs a receiver and a sender of `orders` orders, kills each `kills`
/// times, lets them finish, and checks that each order was applied once.
fn kill_test(mut orders: u64, kills: u32) -> Result<(), Error> {
    let (started, more) = (Instant::now(), orders);
    let dir = tempfile::tempdir()?;
    let sending = dir.path().join("sender.idem");
    let receiving = dir.path().join("receiver.idem");
    // The first kills may land while a side creates its store file: the
    // file then appears whole or not at all (`StoreBuilder::open`).
    // A free port, picked once: every receiver run listens on it.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    println!("webhooks: {orders} orders, each side killed {kills} times");
    println!("  sender store   {}", sending.display());
    println!("  receiver store {}", receiving.display());

    let mut rng = Rng::seeded();
    let receiver_args = vec![
        "receiver".into(),
        receiving.clone().into(),
        addr.to_string().into(),
    ];
    let sender_args = vec![
        "sender".into(),
        sending.clone().into(),
        format!("http://{addr}/hooks").into(),
        orders.to_string().into(),
    ];
    let mut receiver = Side::start("receiver", receiver_args, &mut rng)?;
    let mut sender = Side::start("sender", sender_args, &mut rng)?;

    // Kill each side at random moments until it has had its kills, then let
    // the sender finish.
    let deadline = Instant::now() + Duration::from_secs(600);
    while !sender.exited {
        for side in [&mut receiver, &mut sender] {
            if let Some(status) = side.child.try_wait()? {
                side.exited = true;
                if side.name == "receiver" || !status.success() {
                    return Err(format!("the {} exited on its own: {status}", side.name).into());
                }
            } else if side.kills < kills && Instant::now() >= side.kill_at {
                side.kill_and_restart(&mut rng)?;
            }
        }
        if sender.exited && sender.kills < kills {
            // Everything delivered before the sender had all its kills (a
            // fast disk): more orders, and on.
            orders += more;
            sender.args[3] = orders.to_string().into();
            sender.restart(&mut rng)?;
        }
        if Instant::now() > deadline {
            return Err("the sender did not finish in 10 minutes".into());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    // The sender is done: every webhook was answered 2xx. Keep killing the
    // receiver if it has kills left, then stop it.
    while receiver.kills < kills {
        std::thread::sleep(receiver.kill_at.saturating_duration_since(Instant::now()));
        receiver.kill_and_restart(&mut rng)?;
    }
    receiver.stop()?;

    let (applied, webhook_ids) = applied_counts(&receiving)?;
    let sent = sent(&sending)?;
    let once = (0..orders).filter(|n| applied.get(n) == Some(&1)).count();
    let twice = (0..orders).filter(|n| applied.get(n) > Some(&1)).count();
    let missing = (0..orders).filter(|n| !applied.contains_key(n)).count();
    let stray = applied.keys().filter(|n| **n >= orders).count();
    println!(
        "orders: {orders} ({} created and {} webhooks delivered by the sender)",
        sent.orders, sent.delivered
    );
    println!("  applied once:          {once}");
    println!("  applied twice or more: {twice}");
    println!("  missing:               {missing}");
    println!("  webhook ids recorded:  {webhook_ids}");
    println!(
        "kills (SIGKILL): sender {}, receiver {}",
        sender.kills, receiver.kills
    );
    println!(
        "sends: {} attempts for {orders} webhooks, {} of them in doubt (sent again)",
        sent.attempts, sent.in_doubt
    );
    println!("seconds: {:.1}", started.elapsed().as_secs_f64());
    let ok = once == usize::try_from(orders)?
        && twice == 0
        && missing == 0
        && stray == 0
        && webhook_ids == orders
        && sent.orders == orders
        && sent.delivered == orders;
    if ok {
        println!("result: OK — every order applied exactly once");
        Ok(())
    } else {
        Err("FAILED: the counts above are wrong".into())
    }
}

/// The receiver's count of applications by order number, and the number
/// of webhook ids it recorded.
fn applied_counts(file: &Path) -> Result<(BTreeMap<u64, u32>, u64), Error> {
    let store = Store::open(file)?;
    store.read(|tx| {
        let mut counts = BTreeMap::new();
        let table = match tx.open_table(APPLIED_COUNT) {
            Ok(table) => table,
            Err(TableError::TableDoesNotExist(_)) => return Ok((counts, 0)),
            Err(e) => return Err(e.into()),
        };
        for row in table.iter()? {
            let (order, n) = row?;
            counts.insert(order.value(), n.value());
        }
        Ok((counts, tx.open_table(APPLIED)?.len()?))
    })
}

/// What the sender's file holds: its orders, the webhooks delivered, their
/// attempts in all, and how many attempts ended in doubt.
struct Sent {
    orders: u64,
    delivered: u64,
    attempts: u64,
    in_doubt: usize,
}

fn sent(file: &Path) -> Result<Sent, Error> {
    let store = Store::open(file)?;
    let orders = store.read(|tx| Ok::<_, Error>(tx.open_table(ORDERS)?.len()?))?;
    let outbox = store.outbox();
    let mut sent = Sent {
        orders,
        delivered: outbox.counts()?.completed,
        attempts: 0,
        in_doubt: 0,
    };
    let mut filter = OutboxFilter::any().status(OutboxStatus::Completed);
    loop {
        let page = outbox.list(&filter, 500)?;
        let Some(last) = page.last() else { break };
        filter = filter.after(last.entry.id);
        for record in &page {
            sent.attempts += u64::from(record.entry.attempt_count);
            sent.in_doubt += record
                .attempts
                .iter()
                .filter(|a| a.reason == REASON_OUTCOME_UNKNOWN)
                .count();
        }
    }
    Ok(sent)
}

/// A small xorshift generator for the kill times.
struct Rng(u64);

impl Rng {
    fn seeded() -> Rng {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        Rng(((now.as_secs() << 30) ^ u64::from(now.subsec_nanos())) | 1)
    }

    /// A moment 50 to 400 ms from now.
    fn kill_time(&mut self) -> Instant {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        Instant::now() + Duration::from_millis(50 + self.0 % 351)
    }
}
