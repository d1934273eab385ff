//! PostgreSQL under network faults: claims with effects, idempotency keys
//! with their handlers' effects, enqueues and a dispatcher reach the server
//! through a loopback proxy that delays, holds (a partition neither end
//! notices), refuses and resets, on a random schedule. Each call is retried
//! by its caller with the same key until it answers, as an application
//! retries a webhook. A history checker then asserts: every acknowledged
//! call is in the database, no key has two effects, no entry was in two
//! sends at once, no call took longer than its bound, and once the network
//! heals the store answers at once and the dispatcher drains.
//!
//! Bounded here (`cargo test`: 10 s of faults); a longer run:
//! `IDEMSTORE_NET_SECONDS=300 .ci/postgres run -- cargo test --release
//! --features postgres --test pg_network`.
//!
//! Needs `IDEMSTORE_TEST_POSTGRES` (see `tests/common/pg.rs`); without it
//! the test says so and passes, except under `CI=true`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use idemstore::chrono::{DateTime, TimeZone, Utc};
use idemstore::postgres::PgStore;
use idemstore::{Begin, Delivery, Dispatcher, Error, NewEntry};

mod common;

use common::Rng;
use common::faulty_net::{FaultyNet, Net};
use common::pg::{DropSchema, client, unique_schema, url};

type Failed = Box<dyn std::error::Error + Send + Sync>;
type TestResult = Result<(), Failed>;

fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

/// The longest fault window: a call should answer within it plus the
/// store's own bounds (the connection timeout, a retry).
const LONGEST_FAULT: Duration = Duration::from_millis(1500);
/// The bound no single call may pass.
const CALL_BOUND: Duration = Duration::from_secs(20);

/// What the callers saw.
#[derive(Debug, Default)]
struct History {
    /// Inbox keys whose `claim_with` answered (applied or duplicate).
    claimed: HashSet<String>,
    /// Idempotency keys whose handler's write and response committed, or
    /// that answered `Replay`.
    completed: HashSet<String>,
    /// Outbox entries (`e{n}` to `d{n % 3}`) whose enqueue answered.
    enqueued: HashSet<String>,
    /// Calls that failed and were tried again.
    failed: u64,
    /// Calls made, and the slowest one.
    calls: u64,
    slowest: Duration,
}

impl History {
    fn timed<T, E>(&mut self, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        let started = Instant::now();
        let out = f();
        self.calls += 1;
        self.slowest = self.slowest.max(started.elapsed());
        if out.is_err() {
            self.failed += 1;
        }
        out
    }
}

/// Claims `c{w}-{n}` with an effect row, each until it answers.
fn claimer(store: &PgStore, schema: &str, w: usize, stop: &AtomicBool) -> History {
    let inbox = store.inbox("net").expect("a handle");
    let mut h = History::default();
    let sql = format!("INSERT INTO {schema}.effects (key) VALUES ($1)");
    for n in 0.. {
        let key = format!("c{w}-{n:05}");
        loop {
            let answered = h.timed(|| {
                inbox.claim_with(&key, t(0), |tx| {
                    tx.execute(&sql, &[&key])?;
                    Ok::<_, Error>(())
                })
            });
            if answered.is_ok() {
                h.claimed.insert(key.clone());
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
        if stop.load(Ordering::Relaxed) {
            break;
        }
    }
    h
}

/// Enqueues `e{n}`, each until it answers (a retry after a lost answer
/// finds its own entry, a duplicate).
fn enqueuer(store: &PgStore, stop: &AtomicBool) -> History {
    let outbox = store.outbox();
    let mut h = History::default();
    for n in 0.. {
        let key = format!("e{n:05}");
        let entry = || NewEntry::new("c", format!("d{}", n % 3), key.clone(), vec![]);
        while h.timed(|| outbox.enqueue(entry(), t(0))).is_err() {
            thread::sleep(Duration::from_millis(20));
        }
        h.enqueued.insert(key);
        if stop.load(Ordering::Relaxed) {
            break;
        }
        thread::sleep(Duration::from_millis(5));
    }
    h
}

/// Handles requests `k{w}-{n}`: reserve, then the handler's effect row and
/// the stored response in one transaction; each request until it is
/// completed or replayed.
fn handler(store: &PgStore, schema: &str, w: usize, stop: &AtomicBool) -> History {
    // A short lease: a reservation whose answer was lost is taken over soon.
    let keys = store
        .idempotency_keys()
        .with_lease(Duration::from_millis(300));
    let mut h = History::default();
    let sql = format!("INSERT INTO {schema}.effects (key) VALUES ($1)");
    for n in 0.. {
        let key = format!("k{w}-{n:05}");
        loop {
            let now = Utc::now();
            let done = h.timed(|| match keys.begin("", &key, "fp", now)? {
                Begin::Proceed(r) => store.write(|tx| -> Result<bool, Failed> {
                    tx.execute(&sql, &[&key])?;
                    let response = r.response(201, key.as_bytes().to_vec(), now);
                    if keys.complete_in(tx, &r, response, now)? {
                        Ok(true)
                    } else {
                        // Taken over since: roll the effect back.
                        Err("the reservation was taken over".into())
                    }
                }),
                Begin::Replay(_) => Ok(true),
                Begin::InFlight { .. } => Ok(false),
                other @ Begin::Mismatch { .. } => panic!("{key}: {other:?}"),
            });
            if matches!(done, Ok(true)) {
                h.completed.insert(key.clone());
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
        if stop.load(Ordering::Relaxed) {
            break;
        }
    }
    h
}

/// Cycles the network through faults until `until`; how many it injected.
fn faults(net: &FaultyNet, until: Instant, seed: u64) -> u64 {
    let mut rng = Rng::new(seed);
    let mut injected = 0;
    let ms = |rng: &mut Rng, max: u64| Duration::from_millis(100 + rng.below(max));
    while Instant::now() < until {
        let (mode, lasts) = match rng.below(5) {
            0 => (Net::Up, ms(&mut rng, 400)),
            1 => (
                Net::Slow(Duration::from_millis(1 + rng.below(20))),
                ms(&mut rng, 600),
            ),
            2 => (Net::Held, ms(&mut rng, 1400)),
            3 => (Net::Down, ms(&mut rng, 600)),
            _ => {
                net.reset_all();
                (Net::Up, ms(&mut rng, 200))
            }
        };
        if mode != Net::Up {
            injected += 1;
        }
        net.set(mode);
        thread::sleep(lasts.min(LONGEST_FAULT));
    }
    net.set(Net::Up);
    injected
}

/// Checks what the callers saw against the database: every acknowledged
/// claim and response is there, with one effect, and no key has two.
/// Returns the calls made, those that failed, the slowest and how many
/// were acknowledged.
fn check_history(
    url: &str,
    schema: &str,
    store: &PgStore,
    histories: &[History],
) -> Result<(u64, u64, Duration, usize), Failed> {
    // The history against the database, read on a plain connection.
    let mut db = client(url);
    let mut effects: HashMap<String, i64> = HashMap::new();
    for row in db.query(
        &format!("SELECT key, count(*) FROM {schema}.effects GROUP BY key"),
        &[],
    )? {
        effects.insert(row.get(0), row.get(1));
    }
    let twice: Vec<_> = effects.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "keys with two effects: {twice:?}");
    let inbox = store.inbox("net")?;
    let keys = store.idempotency_keys();
    let (mut calls, mut failed, mut slowest, mut acked) = (0, 0, Duration::ZERO, 0);
    for h in histories {
        for key in &h.claimed {
            assert!(inbox.seen(key)?, "acknowledged claim {key} lost");
            assert_eq!(effects.get(key), Some(&1), "{key}'s effect");
        }
        for key in &h.enqueued {
            let n: u64 = key[1..].parse()?;
            let found = store.outbox().find(&format!("d{}", n % 3), key)?;
            assert!(found.is_some(), "acknowledged enqueue {key} lost");
        }
        for key in &h.completed {
            // Stored before now, so expired for nothing before t(0).
            let stored = keys.get("", key, t(0))?;
            assert!(stored.is_some(), "acknowledged response {key} lost");
            assert_eq!(effects.get(key), Some(&1), "{key}'s effect");
        }
        acked += h.claimed.len() + h.completed.len() + h.enqueued.len();
        calls += h.calls;
        failed += h.failed;
        slowest = slowest.max(h.slowest);
    }
    Ok((calls, failed, slowest, acked))
}

#[test]
fn calls_through_a_faulty_network_keep_every_promise_and_recover_when_it_heals() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let seconds: u64 = std::env::var("IDEMSTORE_NET_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let schema = unique_schema();
    let _drop = DropSchema {
        url: url.clone(),
        schema: schema.clone(),
    };
    let net = FaultyNet::start(&url);
    let store = PgStore::builder()
        .schema(&schema)
        .pool_size(8)
        .connection_timeout(Duration::from_secs(2))
        .connect(&net.url)?;
    // Not unique: a second effect for a key would show as a second row.
    store.write(|tx| {
        tx.batch_execute(&format!(
            "CREATE TABLE {schema}.effects (key text NOT NULL)"
        ))?;
        Ok::<_, Error>(())
    })?;
    let outbox = store.outbox();

    // The dispatcher: each send checks that its entry is in no other send.
    let sending: Arc<Mutex<HashSet<u64>>> = Arc::default();
    let sends: Arc<Mutex<HashMap<u64, u32>>> = Arc::default();
    let overlaps = Arc::new(AtomicU64::new(0));
    let dispatcher = {
        let (sending, sends, overlaps) = (sending.clone(), sends.clone(), overlaps.clone());
        Dispatcher::builder(outbox.clone())
            .workers(4)
            .lease(Duration::from_secs(5))
            .start(move |e| {
                if !sending.lock().unwrap().insert(e.id.0) {
                    overlaps.fetch_add(1, Ordering::Relaxed);
                }
                *sends.lock().unwrap().entry(e.id.0).or_default() += 1;
                thread::sleep(Duration::from_millis(30));
                sending.lock().unwrap().remove(&e.id.0);
                Delivery::Delivered
            })?
    };

    let stop = AtomicBool::new(false);
    let until = Instant::now() + Duration::from_secs(seconds);
    let (histories, injected) = thread::scope(|s| {
        let mut callers = Vec::new();
        for w in 0..3 {
            let (store, schema, stop) = (&store, &schema, &stop);
            callers.push(s.spawn(move || claimer(store, schema, w, stop)));
        }
        for w in 0..2 {
            let (store, schema, stop) = (&store, &schema, &stop);
            callers.push(s.spawn(move || handler(store, schema, w, stop)));
        }
        callers.push(s.spawn(|| enqueuer(&store, &stop)));
        let injected = faults(&net, until, seconds);
        stop.store(true, Ordering::Relaxed);
        let histories: Vec<History> = callers.into_iter().map(|c| c.join().unwrap()).collect();
        (histories, injected)
    });

    // Healed: the store answers at once, and the dispatcher drains.
    let healed = Instant::now();
    assert!(store.inbox("net")?.claim("after-heal", t(0))?);
    assert!(
        healed.elapsed() < Duration::from_secs(5),
        "slow after the heal"
    );
    let entries: u64 = histories.iter().map(|h| h.enqueued.len() as u64).sum();
    let deadline = Instant::now() + Duration::from_secs(60);
    while outbox.counts()?.completed < entries {
        assert!(
            Instant::now() < deadline,
            "the dispatcher drained after the heal"
        );
        thread::sleep(Duration::from_millis(20));
    }
    dispatcher.shutdown()?;

    let (calls, failed, slowest, acked) = check_history(&url, &schema, &store, &histories)?;
    assert!(slowest < CALL_BOUND, "a call took {slowest:?}");
    assert_eq!(
        overlaps.load(Ordering::Relaxed),
        0,
        "an entry in two sends at once"
    );
    let sends = sends.lock().unwrap();
    assert_eq!(sends.len() as u64, entries, "every entry sent");
    let again = sends.values().filter(|n| **n > 1).count();
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    common::report(&format!(
        "postgres network faults: {injected} faults in {seconds} s ({} connections reset, {} \
         refused); {calls} calls, {failed} failed and retried, {acked} acknowledged and found, \
         none with two effects; slowest call {slowest:.1?}; {entries} entries sent, {again} \
         again after a fault, none in two sends at once",
        net.resets(),
        net.refused()
    ));
    Ok(())
}

/// Drops every packet to and from a loopback port while it lives (Linux
/// `tc`: a `prio` root on `lo` whose third band is `netem loss 100%`, fed
/// by filters on the port): a partition at the packet level, which neither
/// end hears about, so only the connection's own timeouts end a call
/// caught by it. `None` where `tc` cannot change `lo` (not root, no `tc`).
struct Partition;

impl Partition {
    fn cut(port: u16) -> Option<Partition> {
        let tc = |args: &str| {
            std::process::Command::new("tc")
                .args(args.split_whitespace())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if !tc("qdisc add dev lo root handle 1: prio") {
            return None;
        }
        let cut = Partition;
        let ok = tc("qdisc add dev lo parent 1:3 handle 30: netem loss 100%")
            && tc(&format!(
                "filter add dev lo protocol ip parent 1:0 prio 3 u32 match ip dport {port} 0xffff flowid 1:3"
            ))
            && tc(&format!(
                "filter add dev lo protocol ip parent 1:0 prio 3 u32 match ip sport {port} 0xffff flowid 1:3"
            ));
        ok.then_some(cut)
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        let _ = std::process::Command::new("tc")
            .args(["qdisc", "del", "dev", "lo", "root"])
            .status();
    }
}

#[test]
fn a_call_caught_by_a_packet_level_partition_fails_within_its_bound_and_the_store_recovers()
-> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let schema = unique_schema();
    let _drop = DropSchema {
        url: url.clone(),
        schema: schema.clone(),
    };
    let net = FaultyNet::start(&url);
    // Short bounds from the connection string (the store keeps shorter
    // ones than its own).
    let bounded = format!("{} connect_timeout=2 tcp_user_timeout=2000", net.url);
    let store = PgStore::builder()
        .schema(&schema)
        .pool_size(2)
        .connection_timeout(Duration::from_secs(2))
        .connect(&bounded)?;
    let inbox = store.inbox("cut")?;
    assert!(inbox.claim("before", t(0))?);
    let port: u16 = net
        .url
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("port="))
        .ok_or("the proxy's port")?
        .parse()?;
    let Some(partition) = Partition::cut(port) else {
        eprintln!("skipped: tc cannot change lo here (needs root and iproute2's tc)");
        return Ok(());
    };
    let started = Instant::now();
    let caught = inbox.claim("during", t(0));
    let took = started.elapsed();
    assert!(
        caught.is_err(),
        "a call through a cut network answered: {caught:?}"
    );
    assert!(took < Duration::from_secs(20), "the call took {took:?}");
    drop(partition);
    // Healed: the next calls answer (the one caught may have committed).
    let healed = Instant::now();
    inbox.claim("during", t(0))?;
    assert!(inbox.claim("after", t(0))?);
    assert!(
        healed.elapsed() < Duration::from_secs(10),
        "slow after the heal"
    );
    common::report(&format!(
        "postgres packet-level partition: a claim caught by it failed after {took:.1?} \
         ({}), the store answered again {:.1?} after the heal",
        caught.err().map_or_else(String::new, |e| e.to_string()),
        healed.elapsed()
    ));
    Ok(())
}
