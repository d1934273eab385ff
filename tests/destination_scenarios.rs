//! Destinations end to end on the embedded store: a cap and a rate limit
//! held across two dispatching processes on one shared file (and a token
//! bucket and a circuit shared exactly by two stores, step by step on a
//! manual clock), a circuit breaker in front of a dead remote, a throttled
//! send holding its destination everywhere, ordering keys through random
//! failures and through a SIGKILL of the dispatching process, a pause that
//! survives a restart, and a file of the format before destinations
//! upgraded on open (`upgrade.rs`).
//!
//! The remote (`remote.rs`) lives in the test process: every send of every
//! dispatcher tells it when it begins and when it ends (child processes,
//! `children.rs`, over a line protocol on 127.0.0.1; in-process dispatchers
//! by a direct call), so it sees what a real remote would see — how many
//! sends of a destination are in flight at once, in which order each
//! ordering key's events arrive — and it decides which sends fail.

#[path = "destination_scenarios/children.rs"]
mod children;
mod common;
#[path = "destination_scenarios/remote.rs"]
mod remote;
#[path = "destination_scenarios/upgrade.rs"]
mod upgrade;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use children::{Dispatching, Setup};
use chrono::Utc;
use common::eventually;
use idemstore::{
    CircuitState, Clock as _, Delivery, DestinationPolicy, Dispatcher, ManualClock, NewEntry,
    OutboxFilter, OutboxStatus, Result, RetryPolicy, Store, StoreBuilder,
};
use parking_lot::Mutex;
use remote::{Link, Remote, SharedRemote, send_to, serve};

fn shared() -> StoreBuilder {
    Store::builder().shared(true)
}

/// Fast retries, and enough of them that no entry fails for good.
fn quick_retries() -> RetryPolicy {
    RetryPolicy::exponential(Duration::from_millis(1), Duration::from_millis(8))
        .max_attempts(1000)
        .jitter(0.5)
}

/// Waits until every one of the outbox's `n` entries is `Completed`.
fn all_completed(store: &Store, n: u64) {
    eventually(&format!("all {n} entries completed"), || {
        store.outbox().counts().is_ok_and(|c| c.completed == n)
    });
}

fn entry(destination: &str, key: &str) -> NewEntry {
    NewEntry::new("cmd", destination, key, Vec::new())
}

/// The attempts charged to `destination`'s entries, in all.
fn attempts(store: &Store, destination: &str) -> Result<u64> {
    Ok(store
        .outbox()
        .list(&OutboxFilter::any().destination(destination), usize::MAX)?
        .iter()
        .map(|r| u64::from(r.entry.attempt_count))
        .sum())
}

fn assert_indexes(store: &Store) -> Result<()> {
    let findings = store.outbox().check_indexes()?;
    assert!(findings.is_empty(), "{findings:?}");
    Ok(())
}

// ---------- the scenarios ----------

#[test]
fn a_cap_holds_across_two_dispatching_processes() -> Result<()> {
    const BURSTS: u64 = 20;
    const PER_BURST: u64 = 4;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cap.idem");
    let store = shared().open(&path)?;
    let outbox = store.outbox();
    outbox.set_destination_policy("a", DestinationPolicy::default().max_in_flight(2))?;
    let remote = Remote::failing(0);
    let addr = serve(&remote);
    // Batches of one: each of the six workers holds at most one claim, so
    // the cap is all that keeps the remote from seeing six at once.
    let setup = Setup {
        workers: 3,
        batch_size: 1,
        lease_ms: 60_000,
        send_us: 5_000,
        ahead_ms: 0,
    };
    let children = [
        Dispatching::start(&path, &addr, "p1", setup),
        Dispatching::start(&path, &addr, "p2", setup),
    ];
    // Entries arrive in bursts of four, each waking both processes, whose
    // workers race for the two slots. Each burst comes once the last one
    // is delivered, so that every burst is a new race: a worker that holds
    // a slot keeps it while there is a backlog (it settles and claims in
    // one commit).
    for burst in 0..BURSTS {
        outbox.enqueue_many(
            (0..PER_BURST).map(|i| entry("a", &format!("a{burst}-{i}"))),
            Utc::now(),
        )?;
        all_completed(&store, (burst + 1) * PER_BURST);
    }
    children.into_iter().for_each(Dispatching::stop);

    let remote = remote.lock();
    assert_eq!(
        remote.max_in_flight.get("a"),
        Some(&2),
        "at most two sends of a in flight at once, and two at times"
    );
    assert_eq!(remote.processes_sending("a"), 2, "{:?}", remote.sends);
    assert_eq!(remote.delivered.len(), 80, "each entry delivered");
    assert!(
        remote.delivered.values().all(|&n| n == 1),
        "an entry sent twice"
    );
    assert_eq!(outbox.destination("a")?.in_flight, 0);
    common::report(&format!(
        "destinations: a cap of 2 across two processes of three workers: at most {} in flight, sends per process {:?}",
        remote.max_in_flight["a"], remote.sends
    ));
    assert_indexes(&store)
}

#[test]
fn a_rate_limit_holds_across_two_dispatching_processes() -> Result<()> {
    const ENTRIES: u64 = 80;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rate.idem");
    let store = shared().open(&path)?;
    let outbox = store.outbox();
    outbox.set_destination_policy("metered", DestinationPolicy::default().rate_limit(20.0, 5))?;
    outbox.enqueue_many(
        (0..ENTRIES).map(|i| entry("metered", &format!("m{i}"))),
        Utc::now(),
    )?;
    let remote = Remote::failing(0);
    let addr = serve(&remote);
    let setup = Setup {
        workers: 2,
        batch_size: 16,
        lease_ms: 60_000,
        send_us: 200,
        ahead_ms: 0,
    };
    let children = [
        Dispatching::start(&path, &addr, "p1", setup),
        Dispatching::start(&path, &addr, "p2", setup),
    ];
    all_completed(&store, ENTRIES);
    children.into_iter().for_each(Dispatching::stop);

    let remote = remote.lock();
    let begun = &remote.begun_at["metered"];
    assert_eq!(begun.len() as u64, ENTRIES, "each sent once");
    let mut begun = begun.clone();
    begun.sort_unstable();
    // A burst of 5, then the rest at 20 a second: 3.75 s.
    let expected = (ENTRIES - 5) as f64 / 20.0;
    let took = (remote.last_delivery.unwrap() - begun[0]) as f64 / 1e6;
    assert!(
        (expected * 0.9..=expected * 1.1).contains(&took),
        "{ENTRIES} sends took {took:.3} s, expected {expected:.2} s ± 10%"
    );
    // No stretch of time saw more than the bucket allows, give or take
    // eight sends: a send begins after its claim's commit, which may wait
    // for the file's writer (the bucket counts by the claim's own `now`),
    // and each of the four workers claims one token per commit, so under a
    // loaded machine a send may begin up to ~400 ms (8 tokens) after its
    // token was taken.
    for (i, &from) in begun.iter().enumerate() {
        for (j, &to) in begun.iter().enumerate().skip(i) {
            let allowed = 5.0 + 20.0 * (to - from) as f64 / 1e6 + 8.0;
            assert!(
                (j - i + 1) as f64 <= allowed,
                "{} sends in {} µs",
                j - i + 1,
                to - from
            );
        }
    }
    assert_eq!(remote.processes_sending("metered"), 2, "{:?}", remote.sends);
    common::report(&format!(
        "destinations: {ENTRIES} sends at 20/s, burst 5, two processes: {took:.3} s ({expected:.2} s expected)"
    ));
    assert_indexes(&store)
}

#[test]
fn two_stores_take_from_one_token_bucket_exactly() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bucket.idem");
    let (a, b) = (shared().open(&path)?, shared().open(&path)?);
    a.outbox()
        .set_destination_policy("metered", DestinationPolicy::default().rate_limit(10.0, 3))?;
    a.outbox().enqueue_many(
        (0..40).map(|i| entry("metered", &format!("m{i}"))),
        common::t(0),
    )?;
    let clock = ManualClock::new(common::t(0));
    let remote = Remote::failing(0);
    let da = clocked_dispatcher(&a, &remote, &clock, 2, "a")?;
    let db = clocked_dispatcher(&b, &remote, &clock, 2, "b")?;
    // After each step of the clock, exactly the bucket's whole tokens are
    // sent, by either store: the burst, then one per 100 ms.
    // (step, sent in all): 2.5 tokens give two (the half stays), and a
    // second's wait fills the bucket to its 3, no more.
    let steps = [
        (0, 3),
        (100, 4),
        (100, 5),
        (100, 6),
        (250, 8),
        (50, 9),
        (100, 10),
        (30, 10),
        (70, 11),
        (1_000, 14),
        (100, 15),
    ];
    for (step_ms, expected) in steps {
        clock.advance(Duration::from_millis(step_ms));
        eventually("the tokens sent", || {
            remote.lock().sends_of("metered") >= expected
        });
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            remote.lock().sends_of("metered"),
            expected,
            "at {:?}",
            clock.now()
        );
    }
    da.shutdown()?;
    db.shutdown()?;
    common::report(&format!(
        "destinations: one token bucket, two stores, a manual clock: sends per store {:?}",
        remote.lock().sends
    ));
    assert_indexes(&a)
}

#[test]
fn a_throttled_send_holds_its_destination_for_every_store() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("held.idem");
    let (a, b) = (shared().open(&path)?, shared().open(&path)?);
    a.outbox().enqueue_many(
        (0..20).map(|i| entry("busy", &format!("b{i}"))),
        common::t(0),
    )?;
    a.outbox().enqueue_many(
        (0..5).map(|i| entry("other", &format!("o{i}"))),
        common::t(0),
    )?;
    // One store's send is told to wait 30 s (a 429 with Retry-After).
    let req = idemstore::ClaimRequest::new(1, "a").one_destination();
    let throttled = a.outbox().claim(common::t(0), &req)?;
    assert_eq!(throttled[0].destination, "busy");
    let wait = idemstore::Settlement::Throttled {
        reason: "http_429".into(),
        next_attempt_at: common::t(30),
    };
    a.outbox()
        .settle(throttled[0].fence(), wait, common::t(0))?;
    assert_eq!(
        b.outbox().destination("busy")?.held_until,
        Some(common::t(30))
    );
    // The other store's dispatcher sends the rest, none of busy's until then.
    let clock = ManualClock::new(common::t(1));
    let remote = Remote::failing(0);
    let db = clocked_dispatcher(&b, &remote, &clock, 2, "b")?;
    eventually("the other destination's entries sent", || {
        remote.lock().sends_of("other") == 5
    });
    clock.set(common::t(29));
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(remote.lock().sends_of("busy"), 0, "held");
    assert_eq!(b.outbox().next_due()?, Some(common::t(30)));
    clock.set(common::t(30));
    all_completed(&b, 25);
    db.shutdown()?;
    assert_eq!(remote.lock().sends_of("busy"), 20);
    assert_indexes(&b)
}

#[test]
fn an_open_circuit_charges_no_attempts_until_the_remote_is_back() -> Result<()> {
    const ENTRIES: u64 = 1000;
    const FAILURES: u32 = 3;
    let cool_down = Duration::from_secs(30);
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    outbox.set_destination_policy(
        "dead",
        DestinationPolicy::default().circuit_breaker(FAILURES, cool_down),
    )?;
    let clock = ManualClock::new(common::t(0));
    outbox.enqueue_many(
        (0..ENTRIES).map(|i| entry("dead", &format!("d{i}"))),
        common::t(0),
    )?;
    let remote = Remote::failing(0);
    remote.lock().down = true;
    let link = Link::Local(remote.clone());
    // One worker claiming one entry at a time: exactly the failures the
    // circuit counts are sent.
    let dispatcher = Dispatcher::builder(outbox.clone())
        .workers(1)
        .batch_size(1)
        .retry(RetryPolicy::exponential(
            Duration::from_secs(1),
            Duration::from_secs(1),
        ))
        .clock(clock.clone())
        .start(move |e| send_to(&link, "p", e, Duration::ZERO))?;
    let open = |trips_wanted: u32| {
        eventually(&format!("the circuit opens ({trips_wanted})"), || {
            matches!(
                outbox.destination("dead").map(|d| d.circuit),
                Ok(CircuitState::Open { trips, .. }) if trips == trips_wanted
            )
        });
    };
    open(1);
    assert_eq!(attempts(&store, "dead")?, u64::from(FAILURES));
    assert_eq!(remote.lock().sends_of("dead"), u64::from(FAILURES));

    // Held open: the failed entries' retries fall due, none is sent.
    for _ in 0..5 {
        clock.advance(Duration::from_secs(5));
        assert!(
            outbox.claim_due(clock.now(), 100, "test")?.is_empty(),
            "nothing claimable while open"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(attempts(&store, "dead")?, u64::from(FAILURES));
    assert_eq!(outbox.next_due()?, Some(common::t(30)));

    // The cool-down ends with the remote still down: one probe, which
    // fails; the circuit opens again for twice as long.
    clock.set(common::t(30));
    open(2);
    assert_eq!(attempts(&store, "dead")?, u64::from(FAILURES) + 1);
    assert_eq!(outbox.next_due()?, Some(common::t(90)));

    // Back up: the next probe closes the circuit and everything goes.
    remote.lock().down = false;
    clock.set(common::t(90));
    all_completed(&store, ENTRIES);
    dispatcher.shutdown()?;
    let counts = outbox.destination("dead")?.counts;
    assert_eq!((counts.completed, counts.failed), (ENTRIES, 0));
    assert_eq!(
        outbox.destination("dead")?.circuit,
        CircuitState::Closed {
            consecutive_failures: 0
        }
    );
    // Each entry sent once when the remote was up, and only the three
    // failures and the failed probe before.
    assert_eq!(attempts(&store, "dead")?, ENTRIES + u64::from(FAILURES) + 1);
    assert_indexes(&store)
}

/// `destination`'s circuit, if open: `(until, trips)`.
fn open_circuit(store: &Store, destination: &str) -> Option<(chrono::DateTime<Utc>, u32)> {
    match store.outbox().destination(destination).ok()?.circuit {
        CircuitState::Open { until, trips } => Some((until, trips)),
        _ => None,
    }
}

/// A dispatcher on `store` with one-second retries, `workers` claiming one
/// entry at a time, its sends reaching `remote` at once, on `clock`.
fn clocked_dispatcher(
    store: &Store,
    remote: &SharedRemote,
    clock: &ManualClock,
    workers: usize,
    name: &'static str,
) -> Result<idemstore::DispatcherHandle> {
    clocked_dispatcher_leasing(store, remote, clock, workers, name, LEASE)
}

/// The lease of [`clocked_dispatcher`]'s claims.
const LEASE: Duration = Duration::from_secs(30);

/// [`clocked_dispatcher`] with claims leased for `lease`: longer than any
/// step of the clock in a test where sends may be in flight as it steps
/// (a claim read at the time before a step and committed after it is
/// older than a shorter lease at once, and the reaper hands it back).
fn clocked_dispatcher_leasing(
    store: &Store,
    remote: &SharedRemote,
    clock: &ManualClock,
    workers: usize,
    name: &'static str,
    lease: Duration,
) -> Result<idemstore::DispatcherHandle> {
    let link = Link::Local(remote.clone());
    Dispatcher::builder(store.outbox())
        .workers(workers)
        .batch_size(1)
        .lease(lease)
        .retry(RetryPolicy::exponential(
            Duration::from_secs(1),
            Duration::from_secs(1),
        ))
        .clock(clock.clone())
        .start(move |e| send_to(&link, name, e, Duration::ZERO))
}

#[test]
fn a_circuit_shared_by_two_stores_sends_one_probe_at_a_time() -> Result<()> {
    const ENTRIES: u64 = 200;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("probe.idem");
    let (a, b) = (shared().open(&path)?, shared().open(&path)?);
    a.outbox().set_destination_policy(
        "dead",
        DestinationPolicy::default().circuit_breaker(3, Duration::from_secs(10)),
    )?;
    a.outbox().enqueue_many(
        (0..ENTRIES).map(|i| entry("dead", &format!("d{i}"))),
        common::t(0),
    )?;
    let clock = ManualClock::new(common::t(0));
    let remote = Remote::failing(0);
    remote.lock().down = true;
    // The clock steps 150 s in all while sends may be in flight.
    let lease = Duration::from_secs(600);
    let da = clocked_dispatcher_leasing(&a, &remote, &clock, 2, "a", lease)?;
    let db = clocked_dispatcher_leasing(&b, &remote, &clock, 2, "b", lease)?;
    let opened = common::eventually_some("the circuit opens", || open_circuit(&a, "dead"));
    // Three failures open it; the other workers' sends already in flight
    // fail too, and count for nothing.
    let before = attempts(&a, "dead")?;
    assert!((3..=6).contains(&before), "{before} attempts");

    // Each cool-down's end: one probe across both stores, which fails.
    let mut until = opened.0;
    for trips in 2..=4 {
        clock.set(until);
        let reopened = common::eventually_some("the probe fails", || {
            open_circuit(&b, "dead").filter(|&(_, n)| n == trips)
        });
        assert_eq!(attempts(&b, "dead")?, before + u64::from(trips) - 1);
        assert!(
            reopened.0 - until >= chrono::Duration::seconds(20),
            "it grows"
        );
        until = reopened.0;
    }
    // Back up: the next probe closes the circuit, and both stores send.
    remote.lock().down = false;
    clock.set(until);
    all_completed(&a, ENTRIES);
    da.shutdown()?;
    db.shutdown()?;
    let counts = a.outbox().destination("dead")?.counts;
    assert_eq!((counts.completed, counts.failed), (ENTRIES, 0));
    assert_eq!(attempts(&a, "dead")?, before + 3 + ENTRIES);
    assert_eq!(remote.lock().sends_of("dead"), before + 3 + ENTRIES);
    assert_indexes(&a)
}

#[test]
fn a_probe_whose_process_died_is_released_and_another_probe_goes() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    outbox.set_destination_policy(
        "dead",
        DestinationPolicy::default().circuit_breaker(1, Duration::from_secs(10)),
    )?;
    outbox.enqueue_many(
        (0..5).map(|i| entry("dead", &format!("d{i}"))),
        common::t(0),
    )?;
    let failed = outbox.claim_due(common::t(0), 1, "w")?;
    let retry = idemstore::Settlement::Failed {
        reason: "http_503".into(),
        next_attempt_at: Some(common::t(1)),
    };
    outbox.settle(failed[0].fence(), retry, common::t(0))?;
    assert_eq!(
        open_circuit(&store, "dead").map(|o| o.0),
        Some(common::t(10))
    );
    // The probe's process dies: claimed, never settled.
    let probe = outbox.claim_due(common::t(10), 10, "dead-process")?;
    assert_eq!(probe.len(), 1, "one probe");
    // A dispatcher starts; its reaper releases the probe's claim once the
    // lease is over, and the next probe goes, to a remote that is up.
    let clock = ManualClock::new(common::t(10));
    let remote = Remote::failing(0);
    let dispatcher = clocked_dispatcher(&store, &remote, &clock, 1, "p")?;
    clock.advance(Duration::from_secs(31));
    eventually("the dead probe released", || {
        dispatcher.stats().released == 1
    });
    // The dispatcher may already be sending the next probe: any probe but
    // the dead process's.
    let circuit = outbox.destination("dead")?.circuit;
    assert!(
        !matches!(circuit, CircuitState::Probing { probe: p, .. } if p == probe[0].id),
        "the released probe still holds the circuit: {circuit:?}"
    );
    all_completed(&store, 5);
    dispatcher.shutdown()?;
    assert_indexes(&store)
}

/// Enqueues `keys` × `events` entries to `destination`, the events of the
/// keys interleaved, each event's payload its place in its key's order.
fn enqueue_ordered(store: &Store, destination: &str, keys: u32, events: u32) -> Result<()> {
    let entries = (0..events).flat_map(|e| {
        (0..keys).map(move |k| {
            NewEntry::new("cmd", destination, format!("k{k}-e{e}"), e.to_string())
                .ordering_key(format!("k{k}"))
        })
    });
    store.outbox().enqueue_many(entries, Utc::now())?;
    Ok(())
}

/// Every key's events reached the remote, all of them, in order.
fn assert_in_order(remote: &Remote, keys: u32, events: u32) {
    assert!(remote.violations.is_empty(), "{:#?}", remote.violations);
    for k in 0..keys {
        assert_eq!(remote.in_order.get(&format!("k{k}")), Some(&events), "k{k}");
    }
}

#[test]
fn each_keys_events_go_one_at_a_time_in_order_through_random_failures() -> Result<()> {
    const KEYS: u32 = 50;
    const EVENTS: u32 = 20;
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("ordered.idem"))?;
    enqueue_ordered(&store, "ordered", KEYS, EVENTS)?;
    let remote = Remote::failing(25);
    let link = Link::Local(remote.clone());
    let dispatcher = Dispatcher::builder(store.outbox())
        .workers(8)
        .batch_size(4)
        .retry(quick_retries())
        .start(move |e| send_to(&link, "p", e, Duration::from_micros(300)))?;
    all_completed(&store, u64::from(KEYS * EVENTS));
    dispatcher.shutdown()?;
    let remote = remote.lock();
    assert_in_order(&remote, KEYS, EVENTS);
    assert!(remote.duplicates.is_empty(), "{:?}", remote.duplicates);
    let sent = remote.sends_of("ordered");
    assert!(
        sent > u64::from(KEYS * EVENTS) * 11 / 10,
        "{sent} sends: the failures were retried"
    );
    assert!(remote.max_in_flight["ordered"] > 1, "sends ran at once");
    assert_indexes(&store)
}

#[test]
fn each_keys_events_stay_in_order_across_a_kill_of_the_dispatching_process() -> Result<()> {
    const KEYS: u32 = 50;
    const EVENTS: u32 = 20;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("killed.idem");
    let store = shared().open(&path)?;
    // A cap too: the dead process's claims hold their slots until the
    // reaper releases them.
    store
        .outbox()
        .set_destination_policy("ordered", DestinationPolicy::default().max_in_flight(6))?;
    enqueue_ordered(&store, "ordered", KEYS, EVENTS)?;
    let remote = Remote::failing(20);
    // The 300th send gets no answer: its process is killed in the middle.
    remote.lock().hang_at = Some(300);
    let addr = serve(&remote);
    let setup = Setup {
        workers: 8,
        batch_size: 4,
        lease_ms: 10_000,
        send_us: 300,
        ahead_ms: 0,
    };
    let first = Dispatching::start(&path, &addr, "first", setup);
    eventually("the 300th send hangs", || remote.lock().hung.is_some());
    first.kill();
    let hung = remote.lock().hung.unwrap();
    assert_eq!(
        store.outbox().get(idemstore::OutboxId(hung))?.entry.status,
        OutboxStatus::Dispatching,
        "killed mid-send"
    );
    // The restarted dispatcher's reaper releases the dead one's claims once
    // their lease is over (its clock is past it: nothing waits it out);
    // their keys then go on where they stopped.
    let restarted = Setup {
        ahead_ms: 11_000,
        ..setup
    };
    let second = Dispatching::start(&path, &addr, "second", restarted);
    all_completed(&store, u64::from(KEYS * EVENTS));
    second.stop();
    let remote = remote.lock();
    assert_in_order(&remote, KEYS, EVENTS);
    assert!(
        remote.max_in_flight["ordered"] <= 6,
        "{:?}",
        remote.max_in_flight
    );
    // Only events the killed process had sent and not settled can reach
    // the remote again: at most the cap's six claims but the one cut short.
    assert!(remote.duplicates.len() <= 5, "{:?}", remote.duplicates);
    assert!(remote.sends_of("ordered") > 0);
    assert!(
        remote
            .sends
            .contains_key(&("ordered".into(), "second".into())),
        "the restarted process sent the rest"
    );
    assert_eq!(store.outbox().destination("ordered")?.in_flight, 0);
    common::report(&format!(
        "destinations: 50 keys x 20 events across a SIGKILL: in order, {} events in flight at the kill sent again",
        remote.duplicates.len()
    ));
    assert_indexes(&store)
}

#[test]
fn a_killed_dispatchers_slots_come_back_at_the_reapers_pass_and_the_cap_fills_again() -> Result<()>
{
    const ENTRIES: u64 = 60;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("reaped.idem");
    let store = shared().open(&path)?;
    store
        .outbox()
        .set_destination_policy("capped", DestinationPolicy::default().max_in_flight(2))?;
    store.outbox().enqueue_many(
        (0..ENTRIES).map(|i| entry("capped", &format!("c{i}"))),
        Utc::now(),
    )?;
    let remote = Remote::failing(0);
    // The 10th send gets no answer: its process is killed holding both slots.
    remote.lock().hang_at = Some(10);
    let addr = serve(&remote);
    let setup = Setup {
        workers: 4,
        batch_size: 16,
        lease_ms: 10_000,
        send_us: 20_000,
        ahead_ms: 0,
    };
    let first = Dispatching::start(&path, &addr, "first", setup);
    eventually("the 10th send hangs", || remote.lock().hung.is_some());
    first.kill();
    assert_eq!(
        store.outbox().destination("capped")?.in_flight,
        2,
        "the dead one's claims hold the cap"
    );
    // The restarted process's clock is past the dead one's leases: its
    // reaper releases them on its first pass.
    let second = Dispatching::start(
        &path,
        &addr,
        "second",
        Setup {
            ahead_ms: 11_000,
            ..setup
        },
    );
    all_completed(&store, ENTRIES);
    second.stop();
    let remote = remote.lock();
    let most = |process: &str| remote.max_in_flight_by[&("capped".to_owned(), process.to_owned())];
    assert_eq!(most("first"), 2, "the first process filled the cap");
    assert_eq!(
        most("second"),
        2,
        "the cap filled again once the reaper freed the slots"
    );
    assert_eq!(remote.max_in_flight["capped"], 2, "never three at once");
    assert_eq!(store.outbox().destination("capped")?.in_flight, 0);
    assert_indexes(&store)
}

#[test]
fn a_pause_survives_a_restart_and_holds_in_every_process_until_resumed() -> Result<()> {
    const PAUSED: u64 = 50;
    const OTHER: u64 = 20;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("paused.idem");
    {
        let store = shared().open(&path)?;
        let outbox = store.outbox();
        outbox.enqueue_many(
            (0..PAUSED).map(|i| entry("held", &format!("h{i}"))),
            Utc::now(),
        )?;
        outbox.pause_destination("held")?;
        outbox.enqueue_many(
            (0..OTHER).map(|i| entry("free", &format!("f{i}"))),
            Utc::now(),
        )?;
    }
    let store = shared().open(&path)?;
    let outbox = store.outbox();
    assert!(outbox.destination("held")?.paused, "still paused on reopen");
    let remote = Remote::failing(0);
    let addr = serve(&remote);
    let setup = Setup {
        workers: 2,
        batch_size: 8,
        lease_ms: 60_000,
        send_us: 100,
        ahead_ms: 0,
    };
    let child = Dispatching::start(&path, &addr, "p", setup);
    // The other process dispatches the free destination's entries, and none
    // of the paused one's.
    eventually("the free entries delivered", || {
        outbox
            .destination("free")
            .is_ok_and(|d| d.counts.completed == OTHER)
    });
    assert_eq!(remote.lock().sends_of("held"), 0);
    assert_eq!(attempts(&store, "held")?, 0);
    assert_eq!(outbox.destination("held")?.counts.pending, PAUSED);
    assert!(outbox.claim_due(Utc::now(), 100, "here")?.is_empty());

    // Resumed here, delivered by the dispatcher in the other process, which
    // the resume wakes (see also
    // `a_resume_in_one_process_wakes_an_idle_dispatcher_in_another` below).
    outbox.resume_destination("held")?;
    all_completed(&store, PAUSED + OTHER);
    child.stop();
    assert_eq!(remote.lock().sends_of("held"), PAUSED);
    assert_eq!(attempts(&store, "held")?, PAUSED);
    drop(store);
    let store = shared().open(&path)?;
    assert!(!store.outbox().destination("held")?.paused);
    assert_indexes(&store)
}

// ---------- wake-ups across processes ----------
//
// Two stores opened shared on one file in this process behave as two
// processes do (each has its own watch of the file): a change in one that
// makes entries claimable should wake an idle dispatcher of the other
// promptly, not at its one-minute safety timer.

/// Far below the dispatcher's idle timer (a minute), far above a wake-up
/// (milliseconds) on a busy machine.
const PROMPTLY: Duration = Duration::from_secs(5);

/// Deliveries per destination.
type Sent = Arc<Mutex<BTreeMap<String, u64>>>;

/// Starts a dispatcher on `store` counting its deliveries per destination.
fn counting_dispatcher(store: &Store) -> Result<(idemstore::DispatcherHandle, Sent)> {
    let sent: Sent = Arc::default();
    let counted = sent.clone();
    let handle = Dispatcher::builder(store.outbox()).start(move |e| {
        *counted.lock().entry(e.destination.clone()).or_default() += 1;
        Delivery::Delivered
    })?;
    Ok((handle, sent))
}

/// Waits up to [`PROMPTLY`] for `destination`'s entries to be sent.
fn sent_promptly(sent: &Mutex<BTreeMap<String, u64>>, destination: &str, n: u64) -> bool {
    let deadline = std::time::Instant::now() + PROMPTLY;
    while std::time::Instant::now() < deadline {
        if sent.lock().get(destination) == Some(&n) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

#[test]
fn a_resume_in_one_process_wakes_an_idle_dispatcher_in_another() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("resume.idem");
    let (a, b) = (shared().open(&path)?, shared().open(&path)?);
    b.outbox().pause_destination("held")?;
    b.outbox().enqueue(entry("held", "h0"), Utc::now())?;
    let (dispatcher, sent) = counting_dispatcher(&a)?;
    // The dispatcher runs, and goes idle with only the paused entry left.
    b.outbox().enqueue(entry("free", "f0"), Utc::now())?;
    eventually("the free entry sent", || {
        sent.lock().get("free") == Some(&1)
    });
    std::thread::sleep(Duration::from_millis(50));
    b.outbox().resume_destination("held")?;
    let woken = sent_promptly(&sent, "held", 1);
    dispatcher.shutdown()?;
    assert!(
        woken,
        "the resume in the other store did not wake the dispatcher"
    );
    Ok(())
}

#[test]
fn a_slot_freed_in_one_process_wakes_a_capped_dispatcher_in_another() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("slot.idem");
    let (a, b) = (shared().open(&path)?, shared().open(&path)?);
    b.outbox()
        .set_destination_policy("capped", DestinationPolicy::default().max_in_flight(1))?;
    b.outbox().enqueue(entry("capped", "c0"), Utc::now())?;
    // The other process holds the only slot.
    let held = b.outbox().claim_due(Utc::now(), 1, "b")?;
    assert_eq!(held.len(), 1);
    let (dispatcher, sent) = counting_dispatcher(&a)?;
    b.outbox().enqueue(entry("capped", "c1"), Utc::now())?;
    b.outbox().enqueue(entry("free", "f0"), Utc::now())?;
    // The dispatcher ran after both enqueues, and goes idle at the cap.
    eventually("the free entry sent", || {
        sent.lock().get("free") == Some(&1)
    });
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(sent.lock().get("capped"), None, "the cap held");
    b.outbox().settle(
        held[0].fence(),
        idemstore::Settlement::Completed,
        Utc::now(),
    )?;
    let woken = sent_promptly(&sent, "capped", 1);
    dispatcher.shutdown()?;
    assert!(
        woken,
        "the slot freed in the other store did not wake the dispatcher"
    );
    Ok(())
}
