//! Kill test: the test binary re-runs itself as a child process that claims
//! events from several threads — each effect writing the caller's own table
//! and, for HTTP-style requests, completing an idempotency key in the same
//! transaction — and prints each key only after its call returned `Ok`. The
//! parent SIGKILLs the child at random moments, reopens the file and checks
//! that everything printed is there, whole, and that the indexes agree with
//! their rows. Each round checks what it wrote, and every 50th round (and
//! the last) the whole file, so a round costs what it wrote, not what the
//! file holds: `IDEMSTORE_KILL_ROUNDS=1000 cargo test --release --test
//! crash_recovery` runs 1,000 rounds of each mode (4 by default; `.ci/run`
//! runs 12).

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use common::t;
use idemstore::redb::{ReadableTable as _, TableDefinition};
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
                    let key = format!("r{round:04}-w{w}-{n:06}");
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
                        // Claimed at t(round): each round's claims list
                        // together, so the parent checks them alone.
                        let c = inbox.claim_with(&key, t(round.into()), |tx| {
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

/// Kill rounds to run: 4, or `IDEMSTORE_KILL_ROUNDS` (`.ci/run` runs 12 in
/// a release build).
fn rounds() -> u32 {
    std::env::var("IDEMSTORE_KILL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4)
}

/// Rounds between two checks of the whole file; the rounds between check
/// what they wrote (and the counts), so a round costs what it wrote, not
/// what the file holds.
const FULL_CHECK_EVERY: u32 = 50;

fn kill_rounds(shared: bool) -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("crash.idem");
    let mut seed: u64 = 0x005e_ed0f_c4a5;
    let rounds = rounds();
    let started = Instant::now();
    let (mut acked_total, mut claimed_total, mut full_checks) = (0, 0u64, 0);
    let mut all = Round {
        claims: BTreeSet::new(),
        http: BTreeSet::new(),
    };
    for round in 0..rounds {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let acks = 5 + usize::try_from(seed % 400).unwrap();
        let r = run_and_kill(&path, shared, round, acks, Duration::from_secs(20));
        acked_total += r.claims.len() + r.http.len();

        // Reopen (a repair, after a kill) and check what this round
        // acknowledged, and what it left: claims and effects together.
        let store = Store::builder().shared(shared).open(&path)?;
        let prefix = format!("r{round:04}-");
        let found = check(
            &store,
            &prefix,
            Some(t(round.into())),
            &r,
            &format!("round {round}"),
        )?;
        claimed_total += found;
        let inbox = store.inbox("crash")?;
        assert_eq!(inbox.len()?, claimed_total, "round {round}: inbox count");
        all.claims.extend(r.claims);
        all.http.extend(r.http);
        if round % FULL_CHECK_EVERY == FULL_CHECK_EVERY - 1 || round + 1 == rounds {
            // The whole file: no repair lost an earlier round's call.
            let in_file = check(
                &store,
                "r",
                None,
                &all,
                &format!("round {round}, whole file"),
            )?;
            assert_eq!(
                in_file, claimed_total,
                "round {round}: claims in the whole file"
            );
            assert_eq!(
                store.idempotency_keys().check_indexes()?,
                Vec::<String>::new()
            );
            assert_eq!(store.check_inbox_indexes()?, Vec::<String>::new());
            full_checks += 1;
        }
    }
    common::report(&format!(
        "crash recovery (shared: {shared}): {rounds} kill rounds, {acked_total} acknowledged calls \
         checked after reopen ({full_checks} checks of the whole file), in {:.1?}",
        started.elapsed()
    ));
    Ok(())
}

/// Checks the calls whose keys start with `prefix` (claimed at `seen_at`,
/// or at any time if `None`) against `acked`: each acknowledged claim and
/// response is there, whole, and effects exist exactly for the claims and
/// the completed requests. Returns how many claims it found.
fn check(
    store: &Store,
    prefix: &str,
    seen_at: Option<chrono::DateTime<chrono::Utc>>,
    acked: &Round,
    what: &str,
) -> Result<u64> {
    let inbox = store.inbox("crash")?;
    let keys = store.idempotency_keys();
    let claimed: BTreeSet<String> = inbox
        .list(seen_at.map(|at| (at, "")), usize::MAX)?
        .into_iter()
        .take_while(|(_, at)| seen_at.is_none_or(|s| *at == s))
        .map(|(k, _)| k)
        .filter(|k| k.starts_with(prefix))
        .collect();
    for key in &acked.claims {
        assert!(
            claimed.contains(key),
            "{what}: acknowledged claim {key} lost"
        );
    }
    for key in &acked.http {
        let stored = keys.get("tenant", key, t(-1))?;
        let stored = stored.unwrap_or_else(|| panic!("{what}: response {key} lost"));
        assert_eq!(stored.response_body, key.as_bytes());
    }
    let completed: BTreeSet<String> = keys
        .list_after(Some(("tenant", prefix)), usize::MAX)?
        .into_iter()
        .take_while(|e| e.tenant == "tenant" && e.key.starts_with(prefix))
        .filter(|e| matches!(e.state, idemstore::KeyState::Completed { .. }))
        .map(|e| e.key)
        .collect();
    let effects: BTreeSet<String> = store.read(|tx| {
        let table = match tx.open_table(EFFECTS) {
            Ok(t) => t,
            Err(idemstore::redb::TableError::TableDoesNotExist(_)) => return Ok(BTreeSet::new()),
            Err(e) => return Err(e.into()),
        };
        let mut out = BTreeSet::new();
        for row in table.range(prefix..)? {
            let key = row?.0.value().to_owned();
            if !key.starts_with(prefix) {
                break;
            }
            out.insert(key);
        }
        Ok::<_, Error>(out)
    })?;
    let expected: BTreeSet<String> = claimed.union(&completed).cloned().collect();
    assert_eq!(
        effects, expected,
        "{what}: effects without claims or claims without effects"
    );
    Ok(claimed.len() as u64)
}
