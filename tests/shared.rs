//! Several processes, one file (`StoreBuilder::shared(true)`).
//!
//! Two `Store`s opened shared on one file in this process behave as two
//! processes do (redb's file locks belong to each open of the file, and
//! each store keeps its own caches): the quick tests use such pairs. The
//! tests at the end run real child processes.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;

use common::{child_test, env_of, t, wall_micros};
use idemstore::redb::{ReadableTable as _, TableDefinition};
use idemstore::{Begin, Durability, Error, NewEntry, Result, Store, StoreBuilder};

const EFFECTS: TableDefinition<(&str, u64), ()> = TableDefinition::new("app.effects");

fn shared() -> StoreBuilder {
    Store::builder().shared(true)
}

/// Two stores sharing one new file, with a journal of `journal_size`.
fn pair(dir: &tempfile::TempDir, journal_size: u64) -> (Store, Store) {
    let path = dir.path().join("shared.idem");
    let a = shared().journal_size(journal_size).open(&path).unwrap();
    let b = shared().journal_size(journal_size).open(&path).unwrap();
    (a, b)
}

/// How many effects each key got (`app.effects` is keyed by `(key, n)`).
fn effects_per_key(store: &Store) -> Result<BTreeMap<String, usize>> {
    store.read(|tx| {
        let mut per_key = BTreeMap::new();
        let table = match tx.open_table(EFFECTS) {
            Ok(table) => table,
            Err(idemstore::redb::TableError::TableDoesNotExist(_)) => return Ok(per_key),
            Err(e) => return Err(e.into()),
        };
        for row in table.iter()? {
            let (k, _) = row?;
            *per_key.entry(k.value().0.to_owned()).or_insert(0) += 1;
        }
        Ok(per_key)
    })
}

#[test]
fn a_claim_in_one_process_is_a_duplicate_in_the_other() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = pair(&dir, 4096);
    assert!(a.inbox("in")?.claim("k", t(0))?);
    assert!(b.inbox("in")?.seen("k")?, "B sees A's journaled claim");
    assert!(!b.inbox("in")?.claim("k", t(1))?, "B cannot claim it again");
    assert_eq!(b.inbox("in")?.seen_at("k")?, Some(t(0)));
    assert_eq!(b.inbox("in")?.len()?, 1);
    Ok(())
}

#[test]
fn a_key_in_any_processs_journal_or_ledger_is_claimed_exactly_once() -> Result<()> {
    // Three stores take turns over 120 keys, each key offered four times; a
    // journal of 5 makes every store merge other stores' rows mid-run.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.idem");
    let stores: Vec<Store> = (0..3)
        .map(|_| shared().journal_size(5).open(&path))
        .collect::<Result<_>>()?;
    let mut first_seen = BTreeSet::new();
    for round in 0..480u64 {
        let store = &stores[usize::try_from((round * 7) % 3).unwrap()];
        let key = format!("k{}", (round * 13) % 120);
        let inbox = store.inbox("in")?;
        let applied = match round % 3 {
            0 => inbox.claim(&key, t(0))?,
            1 => inbox
                .claim_many([key.clone(), key.clone()], t(0))?
                .first()
                .copied()
                .unwrap(),
            _ => inbox
                .claim_with(&key, t(0), |tx| {
                    tx.open_table(EFFECTS)?.insert((key.as_str(), round), ())?;
                    Ok::<_, Error>(())
                })?
                .is_applied(),
        };
        assert_eq!(
            applied,
            first_seen.insert(key.clone()),
            "round {round}: key {key} claimed twice or never"
        );
        for other in &stores {
            assert!(other.inbox("in")?.seen(&key)?, "round {round}: {key}");
        }
    }
    assert_eq!(first_seen.len(), 120);
    for store in &stores {
        assert_eq!(store.inbox("in")?.len()?, 120);
        assert_eq!(store.check_inbox_indexes()?, Vec::<String>::new());
    }
    // No key got two effects.
    assert!(effects_per_key(&stores[0])?.values().all(|&n| n == 1));
    Ok(())
}

#[test]
fn caller_closures_and_queued_operations_share_batches_and_failures_write_nothing() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = pair(&dir, 16);
    let mut threads = Vec::new();
    for th in 0..6u64 {
        let store = if th % 2 == 0 { a.clone() } else { b.clone() };
        threads.push(std::thread::spawn(move || -> Result<Vec<String>> {
            let inbox = store.inbox("in")?;
            let mut committed = Vec::new();
            for i in 0..60u64 {
                let key = format!("t{th}-{i}");
                match (th + i) % 4 {
                    // A plain claim (a queued operation).
                    0 => {
                        assert!(inbox.claim(&key, t(0))?);
                        committed.push(key);
                    }
                    // A closure that commits.
                    1 => {
                        store.write(|tx| {
                            assert!(inbox.claim_in(tx, &key, t(0))?);
                            tx.open_table(EFFECTS)?.insert((key.as_str(), i), ())?;
                            Ok::<_, Error>(())
                        })?;
                        committed.push(key);
                    }
                    // A closure that refuses: nothing it wrote stays.
                    2 => {
                        let r: Result<()> = store.write(|tx| {
                            inbox.claim_in(tx, &key, t(0))?;
                            tx.open_table(EFFECTS)?.insert((key.as_str(), i), ())?;
                            Err(Error::Closed)
                        });
                        assert!(matches!(r, Err(Error::Closed)));
                    }
                    // A closure that panics: rolled back, the panic resumed.
                    _ => {
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            store.write(|tx| {
                                inbox.claim_in(tx, &key, t(0))?;
                                tx.open_table(EFFECTS)?.insert((key.as_str(), i), ())?;
                                assert!(i >= 1000, "handler bug");
                                Ok::<_, Error>(())
                            })
                        }));
                        assert!(r.is_err(), "the closure's panic reaches its caller");
                    }
                }
            }
            Ok(committed)
        }));
    }
    let mut committed = BTreeSet::new();
    for th in threads {
        committed.extend(th.join().expect("no panic escapes a thread")?);
    }
    for store in [&a, &b] {
        let inbox = store.inbox("in")?;
        assert_eq!(inbox.len()?, u64::try_from(committed.len()).unwrap());
        for th in 0..6u64 {
            for i in 0..60u64 {
                let key = format!("t{th}-{i}");
                assert_eq!(inbox.seen(&key)?, committed.contains(&key), "{key}");
            }
        }
        let effects = effects_per_key(store)?;
        assert!(
            effects.keys().all(|k| committed.contains(k)),
            "a failed closure's effect stayed"
        );
    }
    // Both stores still work after the panics (none broke the engine).
    assert!(a.inbox("in")?.claim("after", t(1))?);
    assert!(!b.inbox("in")?.claim("after", t(1))?);
    Ok(())
}

#[test]
fn modes_that_cannot_share_a_file_are_refused_naming_the_mode() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    {
        let _exclusive = Store::open(&path).unwrap();
        let err = shared().open(&path).unwrap_err();
        assert!(
            matches!(err, Error::AlreadyOpen { shared: true, .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("shared(true)"), "{err}");
    }
    {
        let _shared = shared().open(&path).unwrap();
        let err = Store::open(&path).unwrap_err();
        assert!(
            matches!(err, Error::AlreadyOpen { shared: false, .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("shared(true)"), "{err}");
    }
    let err = shared()
        .durability(Durability::None)
        .open(dir.path().join("none.idem"))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidInput {
                field: "durability",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        !dir.path().join("none.idem").exists(),
        "refused before the file is created"
    );
    let err = shared().in_memory().unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidInput {
                field: "shared",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn several_stores_creating_one_new_file_at_once_all_open_it() {
    for round in 0..10 {
        let dir = tempfile::tempdir().unwrap();
        let path = Arc::new(dir.path().join("new.idem"));
        let openers: Vec<_> = (0..4)
            .map(|_| {
                let path = path.clone();
                std::thread::spawn(move || shared().open(&*path).map(drop))
            })
            .collect();
        for opener in openers {
            let opened = opener.join().unwrap();
            assert!(opened.is_ok(), "round {round}: {opened:?}");
        }
    }
}

#[test]
fn idempotency_keys_and_the_outbox_are_one_across_processes() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = pair(&dir, 4096);
    let fp = idemstore::fingerprint("POST", "/orders", b"{}");
    let Begin::Proceed(r) = a.idempotency_keys().begin("", "k", &fp, t(0))? else {
        panic!("the first begin proceeds");
    };
    assert_eq!(
        b.idempotency_keys().begin("", "k", &fp, t(1))?,
        Begin::InFlight { lease_until: t(60) }
    );
    assert!(
        a.idempotency_keys()
            .complete(&r, r.response(201, b"made".to_vec(), t(2)), t(2))?
    );
    match b.idempotency_keys().begin("", "k", &fp, t(3))? {
        Begin::Replay(response) => assert_eq!(response.response_body, b"made"),
        other => panic!("B replays A's response, got {other:?}"),
    }

    // Enqueued in A, claimed once across both.
    for i in 0..10 {
        a.outbox()
            .enqueue(NewEntry::new("c", "d", format!("k{i}"), vec![]), t(0))?;
    }
    let from_b = b.outbox().claim_due(t(1), 6, "b")?;
    let from_a = a.outbox().claim_due(t(1), 6, "a")?;
    assert_eq!((from_b.len(), from_a.len()), (6, 4));
    let ids: BTreeSet<u64> = from_a.iter().chain(&from_b).map(|e| e.id.0).collect();
    assert_eq!(ids.len(), 10, "no entry claimed by both");
    Ok(())
}

// ---------- child processes ----------

#[test]
#[ignore = "run by `three_processes_of_eight_threads_claim_each_key_once` as a child process"]
fn claiming_child() -> Result<()> {
    let path = PathBuf::from(env_of("IDEMSTORE_SHARED_PATH"));
    let me: u64 = env_of("IDEMSTORE_SHARED_CHILD").parse().unwrap();
    let store = shared().journal_size(64).open(&path)?;
    let threads: Vec<_> = (0..8u64)
        .map(|th| {
            let store = store.clone();
            std::thread::spawn(move || -> Result<u64> {
                let inbox = store.inbox("events")?;
                let mut wins = 0;
                // Every thread of every process offers every key, starting
                // at a different place.
                for n in 0..600u64 {
                    let key = format!("e{}", (n + th * 75 + me * 200) % 600);
                    let claim = inbox.claim_with(&key, t(0), |tx| {
                        tx.open_table(EFFECTS)?
                            .insert((key.as_str(), me * 100 + th), ())?;
                        Ok::<_, Error>(())
                    })?;
                    if claim.is_applied() {
                        wins += 1;
                    }
                }
                Ok(wins)
            })
        })
        .collect();
    let mut wins = 0;
    for th in threads {
        wins += th.join().expect("a claiming thread panicked")?;
    }
    println!("wins {wins}");
    Ok(())
}

#[test]
fn three_processes_of_eight_threads_claim_each_key_once() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("claims.idem");
    // Created first, so that the children race on claims, not on creation.
    drop(shared().open(&path)?);
    let children: Vec<_> = (0..3)
        .map(|me| {
            child_test("claiming_child")
                .env("IDEMSTORE_SHARED_PATH", &path)
                .env("IDEMSTORE_SHARED_CHILD", me.to_string())
                .spawn()
                .expect("spawn a child")
        })
        .collect();
    let mut wins = 0;
    for child in children {
        let out = child.wait_with_output().expect("the child ran");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "a child failed: {stdout}");
        wins += stdout
            .lines()
            // The test harness may print the test's name first, on the
            // same line.
            .find_map(|l| l.split("wins ").nth(1))
            .and_then(|n| n.parse::<u64>().ok())
            .expect("the child printed its wins");
    }
    assert_eq!(wins, 600, "each key won exactly once across all processes");
    let store = shared().open(&path)?;
    let effects = effects_per_key(&store)?;
    assert_eq!(effects.len(), 600);
    assert!(
        effects.values().all(|&n| n == 1),
        "a key whose effect ran twice"
    );
    assert_eq!(store.inbox("events")?.len()?, 600);
    assert_eq!(store.check_inbox_indexes()?, Vec::<String>::new());
    common::report(&format!(
        "shared: 3 processes x 8 threads, 600 keys offered 24 times each: {wins} wins, one effect each"
    ));
    Ok(())
}

#[test]
#[ignore = "run by `a_reservation_in_one_process_is_in_flight_in_another_then_replayed` as a child process"]
fn reserving_child() -> Result<()> {
    let path = PathBuf::from(env_of("IDEMSTORE_SHARED_PATH"));
    let store = shared().open(&path)?;
    let keys = store.idempotency_keys();
    let fp = idemstore::fingerprint("POST", "/pay", b"1");
    let Begin::Proceed(r) = keys.begin("", "pay-1", &fp, t(0))? else {
        panic!("the child's begin proceeds");
    };
    println!("reserved");
    // Waits for the parent's word, then completes.
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    assert!(keys.complete(&r, r.response(200, b"paid".to_vec(), t(1)), t(1))?);
    println!("completed");
    Ok(())
}

#[test]
#[expect(
    clippy::zombie_processes,
    reason = "a failed assertion ends the test; the child then ends when its stdin closes"
)]
fn a_reservation_in_one_process_is_in_flight_in_another_then_replayed() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys.idem");
    let store = shared().open(&path)?;
    let mut child = child_test("reserving_child")
        .env("IDEMSTORE_SHARED_PATH", &path)
        .stdin(Stdio::piped())
        .spawn()
        .expect("spawn a child");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut wait_for = |word: &str| {
        for line in lines.by_ref() {
            // The test harness may print the test's name first, on the same
            // line.
            if line.unwrap().trim_end().ends_with(word) {
                return;
            }
        }
        panic!("the child ended before it said {word}");
    };
    wait_for("reserved");
    let keys = store.idempotency_keys();
    let fp = idemstore::fingerprint("POST", "/pay", b"1");
    assert_eq!(
        keys.begin("", "pay-1", &fp, t(0))?,
        Begin::InFlight { lease_until: t(60) },
        "the child's reservation holds the key here"
    );
    writeln!(child.stdin.take().unwrap(), "go").unwrap();
    wait_for("completed");
    match keys.begin("", "pay-1", &fp, t(2))? {
        Begin::Replay(response) => {
            assert_eq!(
                (response.response_status, response.response_body),
                (200, b"paid".to_vec())
            );
        }
        other => panic!("the child's response is replayed here, got {other:?}"),
    }
    assert!(child.wait().unwrap().success());
    Ok(())
}

/// One line a dispatching child logged: entry id, `start` or `sent`, when.
#[derive(Debug, Clone)]
struct Logged {
    id: u64,
    sent: bool,
    at: u64,
}

/// Reads the lines `id:event:micros` a dispatching child appended to `log`
/// (a line cut short by a kill is skipped).
fn send_log(log: &Path) -> Vec<Logged> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut parts = l.split(':');
            let id = parts.next()?.parse().ok()?;
            let sent = match parts.next()? {
                "start" => false,
                "sent" => true,
                _ => return None,
            };
            let at = parts.next()?.parse().ok()?;
            Some(Logged { id, sent, at })
        })
        .collect()
}

/// The sends of one process, per entry: `(start, Some(sent) or None)`.
fn sends(log: &[Logged]) -> BTreeMap<u64, Vec<(u64, Option<u64>)>> {
    let mut per_id: BTreeMap<u64, Vec<(u64, Option<u64>)>> = BTreeMap::new();
    for line in log {
        let sends = per_id.entry(line.id).or_default();
        if line.sent {
            let open = sends
                .iter_mut()
                .rev()
                .find(|(_, end)| end.is_none())
                .expect("a sent line follows its start");
            open.1 = Some(line.at);
        } else {
            sends.push((line.at, None));
        }
    }
    per_id
}

#[test]
#[ignore = "run by `two_dispatching_processes_send_each_entry_once_and_survive_a_kill` as a child process"]
fn dispatching_child() -> Result<()> {
    let path = PathBuf::from(env_of("IDEMSTORE_SHARED_PATH"));
    let log_path = PathBuf::from(env_of("IDEMSTORE_SHARED_LOG"));
    let store = shared().open(&path)?;
    let log = Arc::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path)
            .unwrap(),
    );
    let handle = idemstore::Dispatcher::builder(store.outbox())
        .workers(4)
        .batch_size(8)
        .lease(std::time::Duration::from_secs(2))
        .start(move |entry| {
            // One write per line: appends from several threads never mix.
            // `start` before the effect, `sent` once it happened: a send
            // cut by a kill has a start and no sent.
            (&*log)
                .write_all(format!("{}:start:{}\n", entry.id, wall_micros()).as_bytes())
                .unwrap();
            std::thread::sleep(std::time::Duration::from_micros(200));
            (&*log)
                .write_all(format!("{}:sent:{}\n", entry.id, wall_micros()).as_bytes())
                .unwrap();
            idemstore::Delivery::Delivered
        })?;
    println!("dispatching");
    // Runs until killed, or until the parent closes stdin.
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    handle.shutdown()?;
    Ok(())
}

#[test]
fn two_dispatching_processes_send_each_entry_once_and_survive_a_kill() -> Result<()> {
    const ENTRIES: u64 = 3000;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outbox.idem");
    let store = shared().open(&path)?;
    let outbox = store.outbox();
    for chunk in 0..ENTRIES / 500 {
        outbox.enqueue_many(
            (0..500).map(|i| NewEntry::new("c", "d", format!("k{}", chunk * 500 + i), vec![])),
            chrono::Utc::now(),
        )?;
    }
    let logs = [dir.path().join("a.log"), dir.path().join("b.log")];
    let mut children: Vec<_> = logs
        .iter()
        .map(|log| {
            child_test("dispatching_child")
                .env("IDEMSTORE_SHARED_PATH", &path)
                .env("IDEMSTORE_SHARED_LOG", log)
                .stdin(Stdio::piped())
                .spawn()
                .expect("spawn a child")
        })
        .collect();
    // Kill the first mid-run, once it has sent a fair share.
    common::eventually("the first child sends 300 entries", || {
        send_log(&logs[0]).iter().filter(|l| l.sent).count() >= 300
    });
    let killed_at = wall_micros();
    children[0].kill().expect("SIGKILL the first child");
    children[0].wait().unwrap();
    // The survivor's reaper releases the dead one's claims after the lease.
    common::eventually("every entry delivered", || {
        outbox.counts().is_ok_and(|c| c.completed == ENTRIES)
    });
    drop(children[1].stdin.take());
    assert!(
        children[1].wait().unwrap().success(),
        "the survivor shut down cleanly"
    );

    let (killed, survivor) = (sends(&send_log(&logs[0])), sends(&send_log(&logs[1])));
    let mut twice = 0;
    for id in 1..=ENTRIES {
        let a = killed.get(&id).map_or(&[][..], Vec::as_slice);
        let b = survivor.get(&id).map_or(&[][..], Vec::as_slice);
        assert!(!a.is_empty() || !b.is_empty(), "entry {id} was never sent");
        assert!(
            a.len() <= 1 && b.len() <= 1,
            "entry {id} sent twice by one process"
        );
        if let (Some(&(_, a_end)), Some(&(b_start, b_end))) = (a.first(), b.first()) {
            // Sent by both: the dead process's claim was released after the
            // kill, and the survivor sent it after that, never at once.
            twice += 1;
            assert!(
                b_start > killed_at,
                "entry {id}: survivor started before the kill"
            );
            assert!(
                a_end.is_none_or(|end| end < b_start),
                "entry {id}: overlapping sends"
            );
            assert!(b_end.is_some(), "entry {id}: the survivor's send finished");
        }
    }
    // Only the dead process's claims at the kill can be sent again: at most
    // its four workers' batches of eight.
    assert!(twice <= 32, "{twice} entries sent twice");
    common::report(&format!(
        "shared: 2 dispatching processes, {ENTRIES} entries, one SIGKILLed: {twice} sent again after the kill, none at once"
    ));
    Ok(())
}
