//! The whole story on a real store file.
//!
//! ```text
//! cargo run --release --example demo
//! ```
//!
//! Payment webhooks arrive the way real ones do: duplicated, replayed, out of
//! order, to several workers at once. Each worker claims the event in the
//! inbox and applies its effect — crediting an account in the application's
//! own table — in the same transaction. The demo checks its own result and
//! exits non-zero if any effect ran twice or anything was lost.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use chrono::Utc;
use crossbeam_channel::unbounded;
use idemstore::redb::{ReadableTable, TableDefinition};
use idemstore::{Claim, Error, Store};

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

    let mut ok = true;
    ok &= webhooks(&store)?;
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

/// Applies one delivery: claim and credit in one transaction.
fn deliver(store: &Store, hook: &Webhook) -> Result<Claim<i64>, Error> {
    let inbox = store.inbox("payments")?;
    inbox.claim_with(&hook.event_id, Utc::now(), |tx| {
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
        "\n2. reopen the file and replay all {} events once more",
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
    let ok = twice == 0 && missing == 0 && balances_ok && inbox_len == hooks.len() as u64;
    println!(
        "   check {when}: {} events applied once, {twice} twice, {missing} missing, \
         balances {}, inbox holds {inbox_len} keys",
        applied.len() - twice,
        if balances_ok { "match" } else { "DO NOT MATCH" }
    );
    Ok(ok)
}
