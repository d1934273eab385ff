//! The whole story on a real store file.
//!
//! ```text
//! cargo run --release --example demo
//! ```
//!
//! 1. Payment webhooks arrive the way real ones do: duplicated, shuffled, to
//!    several workers at once. Each worker claims the event in the inbox and
//!    applies its effect in the same transaction: it credits an account in
//!    the application's own table and enqueues two outbox entries (a receipt
//!    e-mail and a ledger notification).
//! 2. A dispatcher delivers the outbox to a simulated flaky remote that times
//!    out, rejects, and sometimes leaves the outcome unknown.
//! 3. An HTTP API answers a retried `POST` from the idempotency-key store:
//!    replay, in flight, mismatch.
//! 4. The file is reopened and every event replayed: nothing changes.
//!
//! The demo checks its own result and exits non-zero if any effect ran twice
//! or anything was lost.

use std::collections::{BTreeMap, HashMap};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use crossbeam_channel::unbounded;
use idemstore::redb::{ReadableTable, TableDefinition};
use idemstore::{
    Begin, Claim, Delivery, Dispatcher, Error, NewEntry, OutboxEntry, RetryPolicy, Store,
    fingerprint,
};
use parking_lot::Mutex;

/// The application's own tables, in the same file.
const BALANCES: TableDefinition<&str, i64> = TableDefinition::new("demo.balances");
const APPLIED: TableDefinition<&str, u32> = TableDefinition::new("demo.applied");

const EVENTS: usize = 2_000;
const WORKERS: usize = 8;
const ACCOUNTS: [&str; 5] = ["alice", "bob", "carol", "dave", "erin"];

#[derive(Clone, Debug)]
struct Webhook {
    event_id: String,
    account: &'static str,
    amount: i64,
}

/// A tiny deterministic PRNG, so every run tells the same story.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).expect("small")
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("demo: FAILED: the checks above found a problem");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("demo: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<bool, Error> {
    let dir = tempfile::tempdir().map_err(|e| Error::Storage(idemstore::redb::Error::Io(e)))?;
    let path = dir.path().join("demo.idem");
    let store = Store::open(&path)?;
    println!("idemstore demo — store file {}", path.display());

    // The dispatcher runs from the start: entries are delivered while the
    // webhooks that enqueue them are still arriving.
    let accepted: Accepted = Arc::default();
    let dispatcher = start_dispatcher(&store, accepted.clone())?;
    let mut ok = true;
    ok &= webhooks(&store)?;
    ok &= dispatch(&store, dispatcher, &accepted)?;
    ok &= http_idempotency(&store)?;
    drop(store);

    // Reopen: everything acknowledged is still there, and a late replay of
    // every event changes nothing.
    let store = Store::open(&path)?;
    ok &= replay_after_reopen(&store)?;
    println!(
        "\nresult: {}",
        if ok {
            "OK — every effect applied exactly once"
        } else {
            "FAILED"
        }
    );
    Ok(ok)
}

fn make_webhooks(rng: &mut Rng) -> Vec<Webhook> {
    (0..EVENTS)
        .map(|i| Webhook {
            event_id: format!("evt_{i:05}"),
            account: ACCOUNTS[rng.below(ACCOUNTS.len())],
            amount: i64::try_from(1 + rng.below(500)).expect("small"),
        })
        .collect()
}

/// Applies one delivery: claim, credit and enqueue the follow-ups in one
/// transaction.
fn deliver(store: &Store, hook: &Webhook) -> Result<Claim<i64>, Error> {
    let inbox = store.inbox("payments")?;
    let outbox = store.outbox();
    let now = Utc::now();
    inbox.claim_with(&hook.event_id, now, |tx| {
        for destination in ["mailer", "ledger"] {
            let body = format!("{} +{} ({})", hook.account, hook.amount, hook.event_id);
            let entry = NewEntry::new(
                &hook.event_id,
                destination,
                &hook.event_id,
                body.into_bytes(),
            );
            outbox.enqueue_in(tx, entry, now)?;
        }
        let mut balances = tx.open_table(BALANCES)?;
        let new = balances.get(hook.account)?.map_or(0, |v| v.value()) + hook.amount;
        balances.insert(hook.account, new)?;
        let mut applied = tx.open_table(APPLIED)?;
        let n = applied
            .get(hook.event_id.as_str())?
            .map_or(0, |v| v.value());
        applied.insert(hook.event_id.as_str(), n + 1)?;
        Ok(new)
    })
}

fn webhooks(store: &Store) -> Result<bool, Error> {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let hooks = make_webhooks(&mut rng);
    // Every event is delivered 1 to 3 times, in a shuffled order.
    let mut deliveries: Vec<Webhook> = Vec::new();
    for h in &hooks {
        for _ in 0..=rng.below(3) {
            deliveries.push(h.clone());
        }
    }
    for i in (1..deliveries.len()).rev() {
        deliveries.swap(i, rng.below(i + 1));
    }
    println!(
        "\n1. webhooks: {} events arrive as {} deliveries (duplicates, out of order) to {WORKERS} workers",
        hooks.len(),
        deliveries.len()
    );

    let (tx, rx) = unbounded::<Webhook>();
    for d in &deliveries {
        tx.send(d.clone()).expect("queue");
    }
    drop(tx);
    let fsyncs_before = store.commit_stats().durable_commits;
    let started = Instant::now();
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (store, rx) = (store.clone(), rx.clone());
            std::thread::spawn(move || -> Result<(u64, u64), Error> {
                let (mut applied, mut duplicates) = (0, 0);
                for hook in rx {
                    match deliver(&store, &hook)? {
                        Claim::Applied(_) => applied += 1,
                        Claim::Duplicate => duplicates += 1,
                    }
                }
                Ok((applied, duplicates))
            })
        })
        .collect();
    let (mut applied, mut duplicates) = (0u64, 0u64);
    for w in workers {
        let (a, d) = w.join().expect("worker panicked")?;
        applied += a;
        duplicates += d;
    }
    let took = started.elapsed();
    let fsyncs = store.commit_stats().durable_commits - fsyncs_before;
    println!(
        "   applied {applied}, skipped {duplicates} duplicates in {:.0} ms \
         ({:.0} deliveries/s, {fsyncs} fsyncs shared by {} durable calls)",
        took.as_secs_f64() * 1e3,
        deliveries.len() as f64 / took.as_secs_f64(),
        deliveries.len()
    );
    check_effects(store, &hooks, "after the deliveries")
}

fn replay_after_reopen(store: &Store) -> Result<bool, Error> {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let hooks = make_webhooks(&mut rng);
    println!(
        "\n4. reopen the file and replay all {} events once more",
        hooks.len()
    );
    let hooks = Arc::new(hooks);
    let replayed: usize = (0..WORKERS)
        .map(|w| {
            let (store, hooks) = (store.clone(), hooks.clone());
            std::thread::spawn(move || -> Result<usize, Error> {
                let mut n = 0;
                for h in hooks.iter().skip(w).step_by(WORKERS) {
                    if deliver(&store, h)? == Claim::Duplicate {
                        n += 1;
                    }
                }
                Ok(n)
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().expect("replay worker panicked"))
        .sum::<Result<usize, Error>>()?;
    println!(
        "   {replayed} of {} replays recognised as duplicates",
        hooks.len()
    );
    let ok = replayed == hooks.len();
    if !ok {
        println!("   FAILED: some replays were applied again");
    }
    Ok(check_effects(store, &hooks, "after reopen and replay")? && ok)
}

/// Every event applied exactly once; balances equal the sum of the events.
fn check_effects(store: &Store, hooks: &[Webhook], when: &str) -> Result<bool, Error> {
    let mut expected: BTreeMap<&str, i64> = BTreeMap::new();
    for h in hooks {
        *expected.entry(h.account).or_default() += h.amount;
    }
    let (balances, applied) = store.read(|tx| {
        let balances: BTreeMap<String, i64> = tx
            .open_table(BALANCES)?
            .iter()?
            .map(|r| r.map(|(k, v)| (k.value().to_owned(), v.value())))
            .collect::<Result<_, _>>()?;
        let applied: BTreeMap<String, u32> = tx
            .open_table(APPLIED)?
            .iter()?
            .map(|r| r.map(|(k, v)| (k.value().to_owned(), v.value())))
            .collect::<Result<_, _>>()?;
        Ok::<_, Error>((balances, applied))
    })?;
    let twice = applied.values().filter(|&&n| n > 1).count();
    let missing = hooks
        .iter()
        .filter(|h| !applied.contains_key(&h.event_id))
        .count();
    let balances_ok = expected
        .iter()
        .all(|(account, sum)| balances.get(*account) == Some(sum));
    let inbox_len = store.inbox("payments")?.len()?;
    let entries = store.outbox().counts()?.total();
    let ok = twice == 0
        && missing == 0
        && balances_ok
        && inbox_len == hooks.len() as u64
        && entries == 2 * hooks.len() as u64;
    println!(
        "   check {when}: {} events applied once, {twice} twice, {missing} missing, \
         balances {}, inbox holds {inbox_len} keys, outbox {entries} entries",
        applied.len() - twice,
        if balances_ok { "match" } else { "DO NOT MATCH" }
    );
    Ok(ok)
}

/// What the flaky remote does with an entry, decided by its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Remote {
    Accept,
    TimeoutThenAccept,
    Reject,
    Unknown,
}

fn remote_plan(entry: &OutboxEntry) -> Remote {
    let h = entry
        .idempotency_key
        .bytes()
        .chain(entry.destination.bytes())
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    match h % 100 {
        0..=69 => Remote::Accept,
        70..=84 => Remote::TimeoutThenAccept,
        85..=92 => Remote::Reject,
        _ => Remote::Unknown,
    }
}

/// What the remote accepted, per (destination, key).
type Accepted = Arc<Mutex<HashMap<(String, String), u32>>>;

fn start_dispatcher(
    store: &Store,
    accepted: Accepted,
) -> Result<idemstore::DispatcherHandle, Error> {
    Dispatcher::builder(store.outbox())
        .workers(4)
        .batch_size(32)
        .retry(
            RetryPolicy::exponential(Duration::from_millis(5), Duration::from_millis(50))
                .max_attempts(5),
        )
        .start(
            move |entry| match (remote_plan(entry), entry.attempt_count) {
                (Remote::Accept, _) | (Remote::TimeoutThenAccept, 2..) => {
                    *accepted
                        .lock()
                        .entry((entry.destination.clone(), entry.idempotency_key.clone()))
                        .or_default() += 1;
                    Delivery::Delivered
                }
                (Remote::TimeoutThenAccept, _) => Delivery::Retry {
                    reason: "timeout".into(),
                },
                (Remote::Reject, _) => Delivery::Failed {
                    reason: "rejected_422".into(),
                },
                (Remote::Unknown, _) => Delivery::OutcomeUnknown {
                    remote_ref: Some(format!("req-{}", entry.id)),
                },
            },
        )
}

fn dispatch(
    store: &Store,
    handle: idemstore::DispatcherHandle,
    accepted: &Accepted,
) -> Result<bool, Error> {
    let outbox = store.outbox();
    let total = outbox.counts()?.total();
    println!(
        "\n2. dispatch: {total} outbox entries, delivered by 4 workers to a flaky remote \
         (timeouts, rejections, unknown outcomes) while the webhooks arrived"
    );
    let started = Instant::now();
    // Wait for the outbox to drain.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let c = outbox.counts()?;
        if c.pending == 0 && c.dispatching == 0 {
            break;
        }
        if Instant::now() > deadline {
            println!("   FAILED: the outbox did not drain: {c:?}");
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let drained = started.elapsed();
    let stats = handle.stats();
    handle.shutdown()?;
    let counts = outbox.counts()?;
    println!(
        "   {} delivered ({} retries), {} rejected, {} outcome unknown; \
         the backlog drained {:.0} ms after the last webhook",
        counts.completed,
        stats.retried,
        counts.failed,
        counts.outcome_unknown,
        drained.as_secs_f64() * 1e3,
    );
    println!(
        "   enqueue -> send latency: p50 {:.2} ms, p99 {:.2} ms (first attempts, measured from enqueue)",
        stats.latency.p50.as_secs_f64() * 1e3,
        stats.latency.p99.as_secs_f64() * 1e3
    );
    let accepted = accepted.lock();
    let twice = accepted.values().filter(|&&n| n > 1).count();
    let ok = twice == 0
        && accepted.len() as u64 == counts.completed
        && counts.completed + counts.failed + counts.outcome_unknown == total
        && outbox.check_indexes()?.is_empty();
    println!(
        "   check: {} entries accepted by the remote once, {twice} twice, indexes {}",
        accepted.len(),
        if outbox.check_indexes()?.is_empty() {
            "consistent"
        } else {
            "INCONSISTENT"
        }
    );
    Ok(ok)
}

fn http_idempotency(store: &Store) -> Result<bool, Error> {
    println!("\n3. HTTP: POST /payments with Idempotency-Key, retried");
    let keys = store.idempotency_keys();
    let body = br#"{"amount": 42, "to": "alice"}"#;
    let fp = fingerprint("POST", "/payments", body);
    let now = Utc::now();
    let mut ok = true;

    let Begin::Proceed(reservation) = keys.begin("acme", "key-1", &fp, now)? else {
        println!("   FAILED: the first request did not proceed");
        return Ok(false);
    };
    println!(
        "   first request: proceed (lease until {})",
        reservation.lease_until().format("%H:%M:%S")
    );
    // A concurrent retry while the handler runs: 409.
    match keys.begin("acme", "key-1", &fp, now)? {
        Begin::InFlight { lease_until } => {
            println!(
                "   concurrent retry: in flight, retry after {}",
                lease_until.format("%H:%M:%S")
            );
        }
        other => {
            println!("   FAILED: concurrent retry got {other:?}");
            ok = false;
        }
    }
    let mut response = reservation.response(201, br#"{"payment": "pay_1"}"#.to_vec(), now);
    response.content_type = Some("application/json".into());
    ok &= keys.complete(&reservation, response.clone(), now)?;
    // A retry after completion: the stored response, byte for byte.
    match keys.begin("acme", "key-1", &fp, now)? {
        Begin::Replay(stored) if stored.response_body == response.response_body => {
            println!(
                "   retry after completion: replayed {} {}",
                stored.response_status,
                String::from_utf8_lossy(&stored.response_body)
            );
        }
        other => {
            println!("   FAILED: retry got {other:?}");
            ok = false;
        }
    }
    // The same key for another request: 422.
    let other = fingerprint("POST", "/payments", br#"{"amount": 9000, "to": "mallory"}"#);
    match keys.begin("acme", "key-1", &other, now)? {
        Begin::Mismatch { .. } => println!("   same key, different body: mismatch (422)"),
        other => {
            println!("   FAILED: a changed body got {other:?}");
            ok = false;
        }
    }
    // Another tenant with the same key is a different request altogether.
    ok &= matches!(keys.begin("globex", "key-1", &fp, now)?, Begin::Proceed(_));
    let stats = keys.stats();
    println!(
        "   check: {} replay, {} in flight, {} mismatch; tenants isolated: {}",
        stats.replays,
        stats.in_flight,
        stats.mismatches,
        if ok { "yes" } else { "NO" }
    );
    Ok(ok)
}
