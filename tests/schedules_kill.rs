//! Kill test of periodic entries: a child process runs a dispatcher that
//! fires a 10 ms schedule (every missed slot fired) on the real clock and
//! is killed (SIGKILL) at random moments, then started again, 50 times.
//! Afterwards every slot from the schedule's start to the last one fired
//! has exactly one entry: none twice, none missing.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use idemstore::{Delivery, Dispatcher, Missed, OutboxFilter, Schedule, Store};

const CHILD_ENV: &str = "IDEMSTORE_SCHEDULE_CHILD_FILE";
const START_ENV: &str = "IDEMSTORE_SCHEDULE_START";
const INTERVAL: Duration = Duration::from_millis(10);
/// Set for a child that opens the store shared between processes.
const SHARED_ENV: &str = "IDEMSTORE_SCHEDULE_SHARED";

/// The child: sets the schedule as of the parent's start (a replaced
/// schedule keeps its own), fires it with a dispatcher until killed.
#[test]
#[ignore = "run by `a_killed_dispatcher_fires_each_slot_once_and_misses_none` as a child process"]
fn schedule_child() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let start: i64 = std::env::var(START_ENV).unwrap().parse().unwrap();
    let start = DateTime::<Utc>::from_timestamp_micros(start).unwrap();
    let shared = std::env::var_os(SHARED_ENV).is_some();
    let store = Store::builder().shared(shared).open(path).unwrap();
    let outbox = store.outbox();
    let every = Schedule::every("ticks", INTERVAL)
        .unwrap()
        .missed(Missed::All);
    outbox.set_schedule_at("ticks", every, start).unwrap();
    let _dispatcher = Dispatcher::builder(outbox)
        .workers(2)
        .start(|_| Delivery::Delivered)
        .unwrap();
    println!("running");
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn a_killed_dispatcher_fires_each_slot_once_and_misses_none() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let start = Utc::now();
    let rounds: u64 = std::env::var("IDEMSTORE_KILL_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .map_or(50, |r: u64| r.max(50));
    for round in 0..rounds {
        let mut child = common::child_test("schedule_child");
        child
            .env(CHILD_ENV, &path)
            .env(START_ENV, start.timestamp_micros().to_string());
        let mut child = child.spawn().unwrap();
        // Anywhere from before the store opens to well into its firings.
        std::thread::sleep(Duration::from_millis(5 + (round * 7) % 60));
        child.kill().unwrap();
        child.wait().unwrap();
    }
    check_one_entry_per_slot(&Store::open(&path).unwrap(), start);
}

/// Three processes on one shared file fire the same schedule at once, and
/// are killed together: one entry per slot.
#[test]
fn three_processes_on_one_shared_file_fire_each_slot_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let start = Utc::now();
    for round in 0..3u64 {
        let children: Vec<_> = (0..3)
            .map(|_| {
                let mut child = common::child_test("schedule_child");
                child
                    .env(CHILD_ENV, &path)
                    .env(SHARED_ENV, "1")
                    .env(START_ENV, start.timestamp_micros().to_string());
                child.spawn().unwrap()
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300 + 100 * round));
        for mut child in children {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }
    let store = Store::builder().shared(true).open(&path).unwrap();
    check_one_entry_per_slot(&store, start);
}

/// Every slot after `start` up to the last one fired has exactly one
/// entry.
fn check_one_entry_per_slot(store: &Store, start: DateTime<Utc>) {
    let outbox = store.outbox();
    let info = outbox.schedules().unwrap().pop().expect("the schedule");
    let last = info.last_fired.expect("slots were fired");
    let mut per_slot: BTreeMap<DateTime<Utc>, usize> = BTreeMap::new();
    for r in outbox
        .list(&OutboxFilter::default().destination("ticks"), 1_000_000)
        .unwrap()
    {
        *per_slot
            .entry(r.entry.slot().expect("a slot's entry"))
            .or_default() += 1;
    }
    assert!(per_slot.values().all(|n| *n == 1), "a slot fired twice");
    let us = i64::try_from(INTERVAL.as_micros()).unwrap();
    let first = start.timestamp_micros().div_euclid(us) * us + us;
    let slots = (last.timestamp_micros() - first) / us + 1;
    let expected: Vec<DateTime<Utc>> = (0..slots)
        .map(|k| DateTime::<Utc>::from_timestamp_micros(first + k * us).unwrap())
        .collect();
    let got: Vec<DateTime<Utc>> = per_slot.keys().copied().collect();
    assert_eq!(got.len(), expected.len(), "a slot is missing");
    assert_eq!(got, expected);
    assert!(got.len() > 50, "{} slots: the dispatchers ran", got.len());
}
