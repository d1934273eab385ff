//! Many processes on one PostgreSQL database, and the server restarted
//! under load.
//!
//! - Three dispatching processes drain one outbox with a sender that fails
//!   some attempts; one is killed (`SIGKILL`) mid-send and the others' reapers
//!   deliver its entries after the lease. No entry is ever in two sends at
//!   once, every entry ends settled, every entry is delivered once but for
//!   the dead process's claims at the kill.
//! - Three processes × 8 threads claim overlapping inbox keys with effects:
//!   one winner and one effect per key.
//! - Idle dispatchers (threads and async) wake when another process
//!   enqueues: the server's `NOTIFY`, not a poll.
//! - The server is stopped (`pg_ctl stop -m immediate`, a crash) and
//!   started again while threads claim and enqueue: every call answered
//!   `Ok` is there afterwards, calls fail (never hang) while it is down,
//!   and the store works again after.
//!
//! The server comes from `.ci/postgres run -- cargo test --features
//! postgres,tokio --test pg_processes`; without `IDEMSTORE_TEST_POSTGRES`
//! the tests say so and pass (they fail under `CI=true`). The restart needs
//! `IDEMSTORE_TEST_PGDATA` and `IDEMSTORE_TEST_PGBIN` too. The tests of
//! this file take turns (one lock): a restart would fail the others.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use chrono::Utc;
use common::pg::{self, DropSchema};
use common::{child_test, env_of, wall_micros};
use idemstore::postgres::PgStore;
use idemstore::{Claim, Delivery, Dispatcher, NewEntry, OutboxEntry, RetryPolicy};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// One test of this file at a time.
fn turn() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A fresh schema on the test server, dropped at the end, and a store on
/// it; `None` when there is no server.
fn fresh(pool: u32) -> Option<(String, String, DropSchema, PgStore)> {
    let url = pg::url()?;
    let schema = pg::unique_schema();
    let remove = DropSchema {
        url: url.clone(),
        schema: schema.clone(),
    };
    let store = connect(&url, &schema, pool);
    Some((url, schema, remove, store))
}

fn connect(url: &str, schema: &str, pool: u32) -> PgStore {
    PgStore::builder()
        .schema(schema)
        .pool_size(pool)
        .connect(url)
        .expect("connect to the test server")
}

#[test]
fn the_last_handle_of_a_store_may_drop_on_a_runtime_thread() -> TestResult {
    let _turn = turn();
    let Some((_url, _schema, _remove, store)) = fresh(2) else {
        return Ok(());
    };
    // A pooled connection is open when the store goes.
    assert!(store.inbox("drop")?.claim("k", Utc::now())?);
    let runtime = tokio::runtime::Builder::new_current_thread().build()?;
    runtime.block_on(async move { drop(store) });
    Ok(())
}

/// Kills the child if the test fails before it exits by itself.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

// ---------------------------------------------------------------------------
// Three dispatching processes, one killed.

const ENTRIES: u64 = 5000;

/// Whether the sender fails this attempt: one attempt in seven, spread over
/// entries and attempts (never two in a row for one entry).
fn fails(entry: &OutboxEntry) -> bool {
    (entry.id.0 + u64::from(entry.attempt_count)).is_multiple_of(7)
}

#[test]
#[ignore = "run by `three_dispatching_processes_drain_one_outbox_and_survive_a_kill` as a child process"]
fn dispatching_child() -> TestResult {
    let store = connect(
        &env_of("IDEMSTORE_TEST_POSTGRES"),
        &env_of("IDEMSTORE_PG_SCHEMA"),
        4,
    );
    let log = Arc::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(env_of("IDEMSTORE_PG_LOG"))?,
    );
    let handle = Dispatcher::builder(store.outbox())
        .workers(4)
        .batch_size(8)
        .lease(Duration::from_secs(2))
        .retry(
            RetryPolicy::exponential(Duration::from_millis(1), Duration::from_millis(20))
                .max_attempts(50),
        )
        .start(move |entry| {
            // One write per line: appends from several threads never mix.
            // `start` before the effect, the outcome once it happened: a
            // send cut by a kill has a start and no outcome.
            let line = |what: &str| {
                format!(
                    "{}:{}:{what}:{}\n",
                    entry.id,
                    entry.attempt_count,
                    wall_micros()
                )
            };
            (&*log).write_all(line("start").as_bytes()).unwrap();
            std::thread::sleep(Duration::from_micros(200));
            let (what, delivery) = if fails(entry) {
                (
                    "retry",
                    Delivery::Retry {
                        reason: "http_503".into(),
                    },
                )
            } else {
                ("sent", Delivery::Delivered)
            };
            (&*log).write_all(line(what).as_bytes()).unwrap();
            delivery
        })?;
    println!("dispatching");
    // Runs until killed, or until the parent closes stdin.
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    handle.shutdown()?;
    Ok(())
}

/// One send a child logged: its process, entry, attempt, start, and its
/// end with whether it delivered (none: cut by the kill).
#[derive(Debug, Clone)]
struct SendLog {
    process: usize,
    attempt: u32,
    start: u64,
    end: Option<(u64, bool)>,
}

/// The sends in `log` (written by process `process`), per entry id.
fn read_sends(log: &Path, process: usize, into: &mut BTreeMap<u64, Vec<SendLog>>) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    for l in text.lines() {
        let parts: Vec<&str> = l.split(':').collect();
        let [id, attempt, what, at] = parts[..] else {
            continue; // a line cut short by the kill
        };
        let (Ok(id), Ok(attempt), Ok(at)) = (id.parse(), attempt.parse(), at.parse()) else {
            continue;
        };
        let sends = into.entry(id).or_default();
        match what {
            "start" => sends.push(SendLog {
                process,
                attempt,
                start: at,
                end: None,
            }),
            "sent" | "retry" => {
                let open = sends
                    .iter_mut()
                    .rev()
                    .find(|s| s.process == process && s.attempt == attempt && s.end.is_none())
                    .expect("an outcome follows its start");
                open.end = Some((at, what == "sent"));
            }
            _ => {}
        }
    }
}

fn sent_count(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(":sent:"))
        .count()
}

#[test]
fn three_dispatching_processes_drain_one_outbox_and_survive_a_kill() -> TestResult {
    let _turn = turn();
    let Some((url, schema, _remove, store)) = fresh(4) else {
        return Ok(());
    };
    let outbox = store.outbox();
    for chunk in 0..ENTRIES / 500 {
        outbox.enqueue_many(
            (0..500).map(|i| NewEntry::new("c", "d", format!("k{}", chunk * 500 + i), vec![])),
            Utc::now(),
        )?;
    }
    let dir = tempfile::tempdir()?;
    let logs: Vec<PathBuf> = (0..3)
        .map(|i| dir.path().join(format!("{i}.log")))
        .collect();
    let mut children: Vec<Reaped> = logs
        .iter()
        .map(|log| {
            Reaped(
                child_test("dispatching_child")
                    .env("IDEMSTORE_TEST_POSTGRES", &url)
                    .env("IDEMSTORE_PG_SCHEMA", &schema)
                    .env("IDEMSTORE_PG_LOG", log)
                    .stdin(Stdio::piped())
                    .spawn()
                    .expect("spawn a child"),
            )
        })
        .collect();
    // Kill the first mid-run, once it has delivered a fair share.
    common::eventually("the first child delivers 300 entries", || {
        sent_count(&logs[0]) >= 300
    });
    let killed_at = wall_micros();
    children[0].0.kill()?;
    children[0].0.wait()?;
    // The survivors' reapers release the dead one's claims after the lease.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let c = outbox.counts()?;
        if c.completed == ENTRIES {
            break;
        }
        assert!(Instant::now() < deadline, "not drained: {c:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    for child in &mut children[1..] {
        drop(child.0.stdin.take());
        assert!(child.0.wait()?.success(), "a survivor shut down cleanly");
    }
    let c = outbox.counts()?;
    assert_eq!(
        (c.pending, c.dispatching, c.failed, c.outcome_unknown),
        (0, 0, 0, 0),
        "every entry settled: {c:?}"
    );

    let mut sends = BTreeMap::new();
    for (i, log) in logs.iter().enumerate() {
        read_sends(log, i, &mut sends);
    }
    let (mut again, mut retried, mut by_survivors) = (0, 0, [0; 3]);
    for id in 1..=ENTRIES {
        let mut s = sends.remove(&id).unwrap_or_default();
        assert!(!s.is_empty(), "entry {id} was never sent");
        s.sort_by_key(|s| s.start);
        // Never two sends at once: each ended before the next began, or was
        // cut by the kill before it.
        for pair in s.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if let Some((end, _)) = a.end {
                assert!(end < b.start, "entry {id}: overlapping sends {s:?}");
            } else {
                assert_eq!(a.process, 0, "entry {id}: only the killed send is cut");
                assert!(
                    b.start > killed_at,
                    "entry {id}: resent before the kill {s:?}"
                );
            }
        }
        let delivered: Vec<&SendLog> = s.iter().filter(|s| s.end.is_some_and(|e| e.1)).collect();
        match delivered[..] {
            [_] => {}
            // Delivered by the dead process, which died before it settled:
            // sent again after its lease, once.
            [first, second] => {
                assert_eq!(first.process, 0, "entry {id}: delivered twice {s:?}");
                assert!(second.start > killed_at, "entry {id}: {s:?}");
                again += 1;
            }
            _ => panic!("entry {id}: delivered {} times: {s:?}", delivered.len()),
        }
        retried += s.iter().filter(|s| s.end.is_some_and(|e| !e.1)).count();
        by_survivors[delivered.last().unwrap().process] += 1;
    }
    // Only the dead process's claims at the kill can be delivered again: at
    // most its four workers' batches of eight.
    assert!(again <= 32, "{again} entries delivered again");
    assert!(retried > 0, "the sender failed some attempts");
    common::report(&format!(
        "postgres: 3 dispatching processes, {ENTRIES} entries, {retried} attempts failed and \
         retried, one process SIGKILLed: {again} delivered again after the kill, none at once \
         (last deliveries by process: {by_survivors:?})"
    ));
    Ok(())
}

// ---------------------------------------------------------------------------
// Three processes × 8 threads claiming overlapping keys.

const KEYS: usize = 600;
/// [`KEYS`] as the server counts.
const KEYS_I64: i64 = 600;
const THREADS: usize = 8;

#[test]
#[ignore = "run by `three_processes_of_eight_threads_claim_each_key_once` as a child process"]
fn claiming_child() -> TestResult {
    let schema = env_of("IDEMSTORE_PG_SCHEMA");
    let process: usize = env_of("IDEMSTORE_PG_PROCESS").parse()?;
    let store = connect(&env_of("IDEMSTORE_TEST_POSTGRES"), &schema, 8);
    let inbox = store.inbox("events")?;
    let applied = AtomicU64::new(0);
    std::thread::scope(|s| {
        for thread in 0..THREADS {
            let (inbox, applied, schema) = (&inbox, &applied, &schema);
            s.spawn(move || {
                // Every thread offers every key, each from its own start.
                let start = thread * 37 + process * 101;
                for n in 0..KEYS {
                    let key = format!("k{}", (start + n) % KEYS);
                    let tag = i32::try_from(process * 100 + thread).unwrap();
                    let out = inbox
                        .claim_with(&key, Utc::now(), |tx| {
                            tx.execute(
                                &format!("INSERT INTO {schema}.effects (key, tag) VALUES ($1, $2)"),
                                &[&key, &tag],
                            )?;
                            Ok::<_, idemstore::Error>(())
                        })
                        .expect("a claim");
                    if out == Claim::Applied(()) {
                        applied.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    println!("applied {}", applied.load(Ordering::Relaxed));
    Ok(())
}

#[test]
fn three_processes_of_eight_threads_claim_each_key_once() -> TestResult {
    let _turn = turn();
    let Some((url, schema, _remove, store)) = fresh(2) else {
        return Ok(());
    };
    // No key constraint: a second effect for a key would show.
    pg::client(&url).batch_execute(&format!(
        "CREATE TABLE {schema}.effects (key text NOT NULL, tag int NOT NULL)"
    ))?;
    let children: Vec<Reaped> = (0..3)
        .map(|p| {
            Reaped(
                child_test("claiming_child")
                    .env("IDEMSTORE_TEST_POSTGRES", &url)
                    .env("IDEMSTORE_PG_SCHEMA", &schema)
                    .env("IDEMSTORE_PG_PROCESS", p.to_string())
                    .spawn()
                    .expect("spawn a child"),
            )
        })
        .collect();
    let mut applied = 0;
    for mut child in children {
        let out = BufReader::new(child.0.stdout.take().expect("piped"));
        for line in out.lines() {
            let line = line?;
            if let Some(i) = line.find("applied ") {
                applied += line[i + "applied ".len()..].trim().parse::<u64>()?;
            }
        }
        assert!(child.0.wait()?.success(), "a child claimed without error");
    }
    assert_eq!(applied, KEYS as u64, "one winner per key");
    let rows = pg::client(&url).query_one(
        &format!("SELECT count(*), count(DISTINCT key) FROM {schema}.effects"),
        &[],
    )?;
    let (effects, distinct): (i64, i64) = (rows.get(0), rows.get(1));
    assert_eq!(
        (effects, distinct),
        (KEYS_I64, KEYS_I64),
        "one effect per key"
    );
    assert_eq!(store.inbox("events")?.len()?, KEYS as u64);
    common::report(&format!(
        "postgres: 3 processes x {THREADS} threads offered {KEYS} keys {} times: {applied} \
         claims applied, {effects} effects",
        3 * THREADS
    ));
    Ok(())
}

// ---------------------------------------------------------------------------
// Wake-ups across processes.

/// Waits up to 10 s for `n` deliveries counted in `delivered`.
fn delivered_within(delivered: &AtomicU64, n: u64, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if delivered.load(Ordering::SeqCst) >= n {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

#[test]
fn idle_dispatchers_wake_when_another_process_enqueues() -> TestResult {
    let _turn = turn();
    let Some((url, schema, _remove, store)) = fresh(4) else {
        return Ok(());
    };
    let other = connect(&url, &schema, 2);
    // An idle dispatcher sleeps up to a minute (nothing is due): a delivery
    // within seconds is the server's notification waking it.
    let within = Duration::from_secs(10);

    let delivered = Arc::new(AtomicU64::new(0));
    let count = delivered.clone();
    let handle = Dispatcher::builder(store.outbox()).start(move |_| {
        count.fetch_add(1, Ordering::SeqCst);
        Delivery::Delivered
    })?;
    std::thread::sleep(Duration::from_millis(300)); // idle by now
    other
        .outbox()
        .enqueue(NewEntry::new("c", "d", "threads", vec![]), Utc::now())?;
    assert!(
        delivered_within(&delivered, 1, within),
        "the thread dispatcher woke"
    );
    handle.shutdown()?;

    let runtime = tokio::runtime::Runtime::new()?;
    let delivered = Arc::new(AtomicU64::new(0));
    let count = delivered.clone();
    let outbox = store.outbox();
    let handle = runtime.block_on(async move {
        Dispatcher::builder(outbox).start_async(move |_| {
            let count = count.clone();
            async move {
                count.fetch_add(1, Ordering::SeqCst);
                Delivery::Delivered
            }
        })
    })?;
    std::thread::sleep(Duration::from_millis(300));
    other
        .outbox()
        .enqueue(NewEntry::new("c", "d", "async", vec![]), Utc::now())?;
    assert!(
        delivered_within(&delivered, 1, within),
        "the async dispatcher woke"
    );
    runtime.block_on(handle.shutdown())?;
    drop(runtime);
    assert_eq!(store.outbox().counts()?.completed, 2);
    Ok(())
}

// ---------------------------------------------------------------------------
// The server restarted under load.

/// What one loader thread saw: the keys whose claim and enqueue answered
/// `Ok`, how many calls failed, and the longest call.
#[derive(Debug, Default)]
struct Seen {
    claimed: Vec<String>,
    enqueued: Vec<(String, idemstore::OutboxId)>,
    errors: u64,
    longest: Duration,
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario: load, crash, restart, checks"
)]
fn a_server_crash_under_load_loses_nothing_answered_ok() -> TestResult {
    let _turn = turn();
    let Some(server) = pg::Server::from_env() else {
        return Ok(());
    };
    let Some(url) = pg::url() else {
        return Ok(());
    };
    let schema = pg::unique_schema();
    let _remove = DropSchema {
        url: url.clone(),
        schema: schema.clone(),
    };
    // Calls wait at most this long for a connection while the server is
    // down, then fail.
    let timeout = Duration::from_secs(2);
    let store = PgStore::builder()
        .schema(&schema)
        .pool_size(8)
        .connection_timeout(timeout)
        .connect(&url)?;
    pg::client(&url).batch_execute(&format!(
        "CREATE TABLE {schema}.effects (key text PRIMARY KEY)"
    ))?;
    let stop = AtomicBool::new(false);
    let seen: Vec<Seen> = std::thread::scope(|s| {
        let loaders: Vec<_> = (0..4)
            .map(|thread| {
                let (store, stop, schema) = (&store, &stop, &schema);
                s.spawn(move || {
                    let inbox = store.inbox("events").expect("an inbox");
                    let outbox = store.outbox();
                    let mut seen = Seen::default();
                    let mut n = 0;
                    while !stop.load(Ordering::SeqCst) {
                        n += 1;
                        let key = format!("t{thread}-{n}");
                        let started = Instant::now();
                        let claim = inbox.claim_with(&key, Utc::now(), |tx| {
                            tx.execute(
                                &format!("INSERT INTO {schema}.effects (key) VALUES ($1)"),
                                &[&key],
                            )?;
                            Ok::<_, idemstore::Error>(())
                        });
                        let enqueue = outbox
                            .enqueue(NewEntry::new("c", "d", key.clone(), vec![]), Utc::now());
                        seen.longest = seen.longest.max(started.elapsed());
                        match claim {
                            Ok(Claim::Applied(())) => seen.claimed.push(key.clone()),
                            Ok(Claim::Duplicate) => panic!("{key}: a fresh key is a duplicate"),
                            Err(_) => seen.errors += 1,
                        }
                        match enqueue {
                            Ok(e) => seen.enqueued.push((key, e.id())),
                            Err(_) => seen.errors += 1,
                        }
                    }
                    seen
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        server.crash();
        // Down for a while: calls fail, after at most the timeout each.
        std::thread::sleep(timeout * 2);
        server.start();
        std::thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::SeqCst);
        loaders
            .into_iter()
            .map(|h| h.join().expect("no panic"))
            .collect()
    });
    let errors: u64 = seen.iter().map(|s| s.errors).sum();
    let longest = seen.iter().map(|s| s.longest).max().unwrap_or_default();
    assert!(errors > 0, "calls failed while the server was down");
    // A call waits for a connection at most `timeout`, twice per round
    // (the claim and the enqueue), plus the connection attempt itself.
    assert!(
        longest < timeout * 4,
        "no call hangs: the longest took {longest:?}"
    );

    // Everything answered `Ok` is there, with its effect.
    let inbox = store.inbox("events")?;
    let outbox = store.outbox();
    let mut client = pg::client(&url);
    let effects: std::collections::BTreeSet<String> = client
        .query(&format!("SELECT key FROM {schema}.effects"), &[])?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let (mut claimed, mut enqueued) = (0, 0);
    for s in &seen {
        for key in &s.claimed {
            assert!(inbox.seen(key)?, "{key}: an Ok claim was lost");
            assert!(effects.contains(key), "{key}: its effect was lost");
            claimed += 1;
        }
        for (key, id) in &s.enqueued {
            assert_eq!(
                &outbox.get(*id)?.entry.idempotency_key,
                key,
                "an Ok enqueue"
            );
            enqueued += 1;
        }
    }
    assert!(claimed > 0 && enqueued > 0);
    // The store works again.
    assert!(inbox.claim("after", Utc::now())?);
    common::report(&format!(
        "postgres: server crashed (pg_ctl stop -m immediate) and started under 4 loader threads: \
         {claimed} claims and {enqueued} enqueues answered Ok, all there after; {errors} calls \
         failed while it was down, the longest call {longest:?}"
    ));
    Ok(())
}
