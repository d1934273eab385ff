//! Kill test: the test binary re-runs itself as a child process that claims
//! events from several threads — each effect writing the caller's own table
//! and, for HTTP-style requests, completing an idempotency key in the same
//! transaction — and prints each key only after its call returned `Ok`. The
//! parent SIGKILLs the child at random moments, reopens the file and checks
//! that everything printed is there, whole, and that the indexes agree with
//! their rows.

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use common::t;
use idemstore::redb::TableDefinition;
use idemstore::{Begin, Error, Result, Store};

const EFFECTS: TableDefinition<&str, u64> = TableDefinition::new("app.effects");
const CHILD_ENV: &str = "IDEMSTORE_CRASH_CHILD_FILE";
const ROUND_ENV: &str = "IDEMSTORE_CRASH_ROUND";
/// Set for a child that opens the store shared between processes.
const SHARED_ENV: &str = "IDEMSTORE_CRASH_SHARED";
const THREADS: usize = 4;

/// The child: claims `r{round}-w{thread}-{n}` with an effect, forever, printing
/// `claim KEY` or `http KEY` after each acknowledged call.
#[test]
#[ignore = "run by `every_acknowledged_call_and_its_effect_survive_a_kill_at_any_moment` as a child process"]
fn crash_child() -> Result<()> {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return Ok(());
    };
    let round: u32 = std::env::var(ROUND_ENV).unwrap().parse().unwrap();
    // A small journal: the kills also land in and around merges.
    let shared = std::env::var_os(SHARED_ENV).is_some();
    let store = Store::builder().journal_size(7).shared(shared).open(path)?;
    let inbox = store.inbox("crash")?;
    let keys = store.idempotency_keys();
    let handles: Vec<_> = (0..THREADS)
        .map(|w| {
            let (store, inbox, keys) = (store.clone(), inbox.clone(), keys.clone());
            std::thread::spawn(move || -> Result<()> {
                let stdout = std::io::stdout();
                for n in 0u64.. {
                    let key = format!("r{round:02}-w{w}-{n:06}");
                    if n % 3 == 2 {
                        // An HTTP request: reserve, then the handler's write
                        // and the stored response commit together.
                        let Begin::Proceed(r) = keys.begin("tenant", &key, "fp", t(0))? else {
                            panic!("{key} is fresh");
                        };
                        let done = store.write(|tx| {
                            tx.open_table(EFFECTS)?.insert(key.as_str(), n)?;
                            keys.complete_in(
                                tx,
                                &r,
                                r.response(201, key.as_bytes().to_vec(), t(0)),
                                t(0),
                            )
                        })?;
                        assert!(done);
                        writeln!(stdout.lock(), "http {key}").ok();
                    } else {
                        let c = inbox.claim_with(&key, t(0), |tx| {
                            tx.open_table(EFFECTS)?.insert(key.as_str(), n)?;
                            Ok::<_, Error>(())
                        })?;
                        assert!(c.is_applied());
                        writeln!(stdout.lock(), "claim {key}").ok();
                    }
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join().expect("child worker panicked")?;
    }
    Ok(())
}

struct Round {
    claims: BTreeSet<String>,
    http: BTreeSet<String>,
}

/// Runs the child until it has printed `acks` lines, or `deadline`, then kills it.
fn run_and_kill(path: &Path, shared: bool, round: u32, acks: usize, deadline: Duration) -> Round {
    let mut child = common::child_test("crash_child");
    child.env(CHILD_ENV, path).env(ROUND_ENV, round.to_string());
    if shared {
        child.env(SHARED_ENV, "1");
    }
    let mut child = child.spawn().expect("spawn child");
    let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
    let started = Instant::now();
    let mut round = Round {
        claims: BTreeSet::new(),
        http: BTreeSet::new(),
    };
    // Only whole lines count: the kill may cut the last one short.
    let mut read_line = |round: &mut Round| -> bool {
        let mut line = String::new();
        match stdout.read_line(&mut line) {
            Ok(n) if n > 0 && line.ends_with('\n') => {
                // The test harness prints its own words first on the first line.
                let line = line.trim_end();
                if let Some(i) = line.find("claim ") {
                    round.claims.insert(line[i + 6..].to_owned());
                } else if let Some(i) = line.find("http ") {
                    round.http.insert(line[i + 5..].to_owned());
                }
                true
            }
            _ => false,
        }
    };
    while round.claims.len() + round.http.len() < acks && started.elapsed() < deadline {
        if !read_line(&mut round) {
            break;
        }
    }
    child.kill().expect("SIGKILL the child");
    // Lines printed before the kill landed are acknowledged too.
    while read_line(&mut round) {}
    let status = child.wait().expect("reap child");
    assert!(!status.success(), "the child was killed, not finished");
    round
}

#[test]
fn every_acknowledged_call_and_its_effect_survive_a_kill_at_any_moment() -> Result<()> {
    kill_rounds(false)
}

#[test]
fn in_a_shared_store_every_acknowledged_call_survives_a_kill_at_any_moment() -> Result<()> {
    // Shared: durable commits of their own kind, and caller closures that
    // lead their batch.
    kill_rounds(true)
}

fn kill_rounds(shared: bool) -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("crash.idem");
    let mut seed: u64 = 0x005e_ed0f_c4a5;
    let rounds = 12;
    let mut acked_total = 0;
    let mut all_claims = BTreeSet::new();
    let mut all_http = BTreeSet::new();
    for round in 0..rounds {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let acks = 5 + usize::try_from(seed % 400).unwrap();
        let r = run_and_kill(&path, shared, round, acks, Duration::from_secs(20));
        acked_total += r.claims.len() + r.http.len();
        all_claims.extend(r.claims);
        all_http.extend(r.http);

        // Reopen (a repair, after a kill) and check everything acknowledged so far.
        let store = Store::builder().shared(shared).open(&path)?;
        let inbox = store.inbox("crash")?;
        let keys = store.idempotency_keys();
        let effects: BTreeSet<String> = common::effect_keys(&store)?;
        let claimed: BTreeSet<String> = inbox
            .list(None, usize::MAX)?
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        for key in &all_claims {
            assert!(
                claimed.contains(key),
                "round {round}: acknowledged claim {key} lost"
            );
        }
        for key in &all_http {
            let stored = keys.get("tenant", key, t(-1))?;
            let stored = stored.unwrap_or_else(|| panic!("round {round}: response {key} lost"));
            assert_eq!(stored.response_body, key.as_bytes());
        }
        // Effects exist exactly for the claims and the completed requests.
        let completed: BTreeSet<String> = keys
            .list(Some("tenant"), usize::MAX)?
            .into_iter()
            .filter(|e| matches!(e.state, idemstore::KeyState::Completed { .. }))
            .map(|e| e.key)
            .collect();
        let expected: BTreeSet<String> = claimed.union(&completed).cloned().collect();
        assert_eq!(
            effects, expected,
            "round {round}: effects without claims or claims without effects"
        );
        assert_eq!(
            inbox.len()?,
            claimed.len() as u64,
            "round {round}: inbox count"
        );
        assert_eq!(keys.check_indexes()?, Vec::<String>::new(), "round {round}");
    }
    common::report(&format!(
        "crash recovery (shared: {shared}): {rounds} kill rounds, {acked_total} acknowledged calls checked after reopen"
    ));
    Ok(())
}
