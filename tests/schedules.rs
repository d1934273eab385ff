//! Periodic entries: schedules fire exactly once per slot, whoever fires
//! them, with the missed-slot policies, pauses, removal and restarts.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeDelta, Utc};
use idemstore::{
    Delivery, Dispatcher, Error, ManualClock, Missed, OutboxEntry, OutboxFilter, OutboxStatus,
    Schedule, Store,
};

fn t0() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2026-03-01T00:00:00Z")
        .unwrap()
        .with_timezone(&Utc)
}

fn minutes(n: i64) -> TimeDelta {
    TimeDelta::minutes(n)
}

fn store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s.idem")).unwrap();
    (dir, store)
}

fn every_5_minutes() -> Schedule {
    Schedule::every("reports", Duration::from_secs(300)).unwrap()
}

/// The entries of `destination`, oldest first.
fn entries(store: &Store, destination: &str) -> Vec<OutboxEntry> {
    let mut out: Vec<OutboxEntry> = store
        .outbox()
        .list(&OutboxFilter::default().destination(destination), 100_000)
        .unwrap()
        .into_iter()
        .map(|r| r.entry)
        .collect();
    out.sort_by_key(|e| e.id);
    out
}

#[test]
fn each_slot_fires_once_with_its_slot_on_the_entry() {
    let (_dir, store) = store();
    let outbox = store.outbox();
    outbox
        .set_schedule_at("every5", every_5_minutes().payload(b"run".to_vec()), t0())
        .unwrap();
    // Nothing is due at the moment it is set.
    assert_eq!(outbox.fire_schedules(t0()).unwrap(), 0);
    // Each minute for an hour, fired twice each time (as two dispatchers
    // racing would): 12 slots, 12 entries.
    for m in 1..=60 {
        let now = t0() + minutes(m);
        let first = outbox.fire_schedules(now).unwrap();
        assert_eq!(outbox.fire_schedules(now).unwrap(), 0, "a slot fires once");
        assert_eq!(first, u64::from(m % 5 == 0));
    }
    let got = entries(&store, "reports");
    assert_eq!(got.len(), 12);
    for (i, e) in (1..).zip(&got) {
        let slot = t0() + minutes(5 * i);
        assert_eq!(e.slot(), Some(slot));
        assert_eq!(e.payload, b"run");
        assert!(e.idempotency_key.starts_with(idemstore::SLOT_KEY_PREFIX));
    }
    let info = &outbox.schedules().unwrap()[0];
    assert_eq!(info.name, "every5");
    assert_eq!(info.last_fired, Some(t0() + minutes(60)));
    assert_eq!(info.next_slot, Some(t0() + minutes(65)));
    assert!(!info.paused);
}

#[test]
fn a_schedule_set_without_a_time_starts_at_the_first_firing() {
    let (_dir, store) = store();
    let outbox = store.outbox();
    outbox
        .set_schedule("lazy", every_5_minutes().missed(Missed::All))
        .unwrap();
    assert_eq!(
        outbox.schedules().unwrap()[0].next_slot,
        None,
        "not started"
    );
    // Due at once, for the firing that starts it, which fires nothing.
    assert!(outbox.next_schedule_slot().unwrap().unwrap() < t0());
    assert_eq!(outbox.fire_schedules(t0()).unwrap(), 0);
    assert_eq!(
        outbox.schedules().unwrap()[0].next_slot,
        Some(t0() + minutes(5))
    );
    assert_eq!(outbox.fire_schedules(t0() + minutes(60)).unwrap(), 12);
}

#[test]
fn missed_slots_follow_the_policy_after_an_outage_of_three_hours() {
    let (_dir, store) = store();
    let outbox = store.outbox();
    for (name, missed) in [
        ("latest", Missed::Latest),
        ("all", Missed::All),
        ("none", Missed::None),
    ] {
        let s = Schedule::every(name, Duration::from_secs(300))
            .unwrap()
            .missed(missed);
        outbox.set_schedule_at(name, s, t0()).unwrap();
    }
    // Down for three hours; back 2 minutes after the 03:00 slot.
    outbox.fire_schedules(t0() + minutes(182)).unwrap();
    assert_eq!(entries(&store, "latest").len(), 1);
    assert_eq!(
        entries(&store, "latest")[0].slot(),
        Some(t0() + minutes(180))
    );
    assert_eq!(entries(&store, "all").len(), 36);
    assert!(
        entries(&store, "none").is_empty(),
        "2 minutes late is missed"
    );
    // From then on each policy fires each slot on time.
    outbox.fire_schedules(t0() + minutes(185)).unwrap();
    assert_eq!(entries(&store, "latest").len(), 2);
    assert_eq!(entries(&store, "all").len(), 37);
    assert_eq!(entries(&store, "none").len(), 1);
}

#[test]
fn a_paused_schedule_fires_nothing_and_resumes_by_its_policy() {
    let (_dir, store) = store();
    let outbox = store.outbox();
    outbox
        .set_schedule_at("p", every_5_minutes().missed(Missed::All), t0())
        .unwrap();
    outbox.pause_schedule("p").unwrap();
    assert_eq!(outbox.fire_schedules(t0() + minutes(30)).unwrap(), 0);
    assert!(outbox.schedules().unwrap()[0].paused);
    assert_eq!(outbox.next_schedule_slot().unwrap(), None);
    outbox.resume_schedule("p").unwrap();
    assert_eq!(outbox.fire_schedules(t0() + minutes(30)).unwrap(), 6);
    assert!(matches!(
        outbox.pause_schedule("nope"),
        Err(Error::NotFound)
    ));
}

#[test]
fn removing_keeps_the_entries_and_a_slot_never_fires_twice() {
    let (_dir, store) = store();
    let outbox = store.outbox();
    outbox
        .set_schedule_at("r", every_5_minutes().missed(Missed::All), t0())
        .unwrap();
    outbox.fire_schedules(t0() + minutes(60)).unwrap();
    outbox.remove_schedule("r").unwrap();
    outbox.remove_schedule("r").unwrap();
    assert!(outbox.schedules().unwrap().is_empty());
    assert_eq!(
        entries(&store, "reports").len(),
        12,
        "removal keeps entries"
    );
    assert_eq!(outbox.fire_schedules(t0() + minutes(120)).unwrap(), 0);
    // Set again as of the start: its first hour's slots are already there.
    outbox
        .set_schedule_at("r", every_5_minutes().missed(Missed::All), t0())
        .unwrap();
    assert_eq!(outbox.fire_schedules(t0() + minutes(70)).unwrap(), 2);
    assert_eq!(entries(&store, "reports").len(), 14);
}

#[test]
fn schedules_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    {
        let store = Store::open(&path).unwrap();
        store
            .outbox()
            .set_schedule_at("s", every_5_minutes(), t0())
            .unwrap();
        store.outbox().fire_schedules(t0() + minutes(5)).unwrap();
    }
    let store = Store::open(&path).unwrap();
    let outbox = store.outbox();
    assert_eq!(outbox.schedules().unwrap().len(), 1);
    assert_eq!(outbox.fire_schedules(t0() + minutes(5)).unwrap(), 0);
    assert_eq!(outbox.fire_schedules(t0() + minutes(10)).unwrap(), 1);
}

#[test]
fn bad_schedules_are_refused_and_store_nothing() {
    let (_dir, store) = store();
    let outbox = store.outbox();
    assert!(matches!(
        Schedule::every("d", Duration::ZERO),
        Err(Error::InvalidInput { .. })
    ));
    let s = every_5_minutes();
    assert!(matches!(
        outbox.set_schedule_at("", s.clone(), t0()),
        Err(Error::InvalidInput { .. })
    ));
    let long = "n".repeat(idemstore::MAX_SCHEDULE_NAME_LEN + 1);
    assert!(matches!(
        outbox.set_schedule_at(&long, s.clone(), t0()),
        Err(Error::InvalidInput { .. })
    ));
    let no_destination = Schedule::every("", Duration::from_secs(1)).unwrap();
    assert!(outbox.set_schedule_at("x", no_destination, t0()).is_err());
    assert!(outbox.schedules().unwrap().is_empty());
}

#[cfg(feature = "cron")]
#[test]
fn a_cron_schedule_fires_at_its_instants() {
    let (_dir, store) = store();
    let outbox = store.outbox();
    assert!(matches!(
        Schedule::cron("d", "99 * * * *"),
        Err(Error::InvalidInput { .. })
    ));
    let s = Schedule::cron("reports", "30 2 * * *")
        .unwrap()
        .missed(Missed::All);
    outbox.set_schedule_at("nightly", s, t0()).unwrap();
    outbox.fire_schedules(t0() + TimeDelta::days(3)).unwrap();
    let slots: Vec<_> = entries(&store, "reports")
        .iter()
        .map(OutboxEntry::slot)
        .collect();
    assert_eq!(
        slots,
        (0..3)
            .map(|d| Some(t0() + TimeDelta::days(d) + TimeDelta::minutes(150)))
            .collect::<Vec<_>>()
    );
}

#[cfg(feature = "testing")]
#[test]
fn a_test_store_fires_schedules_when_its_clock_advances_and_it_drains() {
    use idemstore::testing::{TestStore, drain};
    let t = TestStore::new().unwrap();
    let outbox = t.store().outbox();
    outbox
        .set_schedule("daily", every_5_minutes().missed(Missed::All))
        .unwrap();
    // The first drain starts it at the test clock's time.
    assert!(
        drain(&outbox, t.clock(), |_| Delivery::Delivered)
            .unwrap()
            .is_empty()
    );
    t.advance(Duration::from_secs(24 * 3600));
    let sent = drain(&outbox, t.clock(), |_| Delivery::Delivered).unwrap();
    assert_eq!(sent.len(), 288);
}

/// Three dispatchers over one store, driven by one manual clock through a
/// day: one entry per slot.
#[test]
fn three_dispatchers_through_a_day_yield_one_entry_per_slot() {
    let (_dir, store) = store();
    let outbox = store.outbox();
    let clock = ManualClock::new(t0());
    outbox
        .set_schedule_at("every5", every_5_minutes().missed(Missed::All), t0())
        .unwrap();
    let sent = Arc::new(Mutex::new(Vec::new()));
    let dispatchers: Vec<_> = (0..3)
        .map(|i| {
            let sent = sent.clone();
            Dispatcher::builder(outbox.clone())
                .clock(clock.clone())
                // The clock jumps a day in a moment: a lease that long
                // keeps the reaper from sending a claimed entry again.
                .lease(Duration::from_secs(7 * 24 * 3600))
                .worker_id(format!("d{i}"))
                .start(move |e| {
                    sent.lock().unwrap().push(e.idempotency_key.clone());
                    Delivery::Delivered
                })
                .unwrap()
        })
        .collect();
    for _ in 0..(24 * 60) {
        clock.advance(Duration::from_secs(60));
    }
    // The dispatchers catch up with the clock on their own threads.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let done = entries(&store, "reports")
            .iter()
            .filter(|e| e.status == OutboxStatus::Completed)
            .count();
        if done == 288 || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for d in dispatchers {
        d.shutdown().unwrap();
    }
    let got = entries(&store, "reports");
    assert_eq!(got.len(), 288);
    let slots: BTreeSet<_> = got.iter().map(|e| e.slot().unwrap()).collect();
    assert_eq!(slots.len(), 288);
    assert_eq!(slots.first().copied(), Some(t0() + minutes(5)));
    assert_eq!(slots.last().copied(), Some(t0() + TimeDelta::days(1)));
    let sent = sent.lock().unwrap();
    assert_eq!(sent.len(), 288, "each sent once");
    assert_eq!(sent.iter().collect::<BTreeSet<_>>().len(), 288);
}

/// A daily 02:30 in Europe/Berlin through 2026, both daylight-saving
/// changes included: 365 slots, one a day; on the spring day (02:30 does
/// not exist) at the first valid time after it, on the autumn day (02:30
/// happens twice) once.
#[cfg(feature = "tz")]
#[test]
fn a_daily_schedule_in_berlin_fires_once_a_day_across_both_daylight_saving_changes() {
    let (_dir, store) = store();
    let outbox = store.outbox();
    assert!(matches!(
        Schedule::cron("d", "30 2 * * *")
            .unwrap()
            .time_zone("Mars/Olympus"),
        Err(Error::InvalidInput { .. })
    ));
    assert!(matches!(
        every_5_minutes().time_zone("Europe/Berlin"),
        Err(Error::InvalidInput { .. })
    ));
    let daily = Schedule::cron("berlin", "30 2 * * *")
        .unwrap()
        .time_zone("Europe/Berlin")
        .unwrap()
        .missed(Missed::All);
    let new_year = DateTime::parse_from_rfc3339("2026-01-01T00:00:00+01:00")
        .unwrap()
        .with_timezone(&Utc);
    outbox.set_schedule_at("daily", daily, new_year).unwrap();
    // A firing a day, as a dispatcher would at least do.
    for day in 1..=365 {
        outbox
            .fire_schedules(new_year + TimeDelta::days(day))
            .unwrap();
    }
    let slots: Vec<_> = entries(&store, "berlin")
        .iter()
        .map(|e| e.slot().unwrap())
        .collect();
    assert_eq!(slots.len(), 365);
    let utc = |s: &str| DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc);
    // Winter: 02:30 CET is 01:30 UTC; summer: 02:30 CEST is 00:30 UTC.
    assert!(slots.contains(&utc("2026-01-15T01:30:00Z")));
    assert!(slots.contains(&utc("2026-07-15T00:30:00Z")));
    // 2026-03-29: 02:00 CET jumps to 03:00 CEST; the slot is at 03:00 CEST.
    let march_29: Vec<_> = slots
        .iter()
        .filter(|s| s.date_naive().to_string() == "2026-03-29")
        .collect();
    assert_eq!(march_29, vec![&utc("2026-03-29T01:00:00Z")]);
    // 2026-10-25: 03:00 CEST falls back to 02:00 CET; 02:30 once, the
    // first time (CEST).
    let october_25: Vec<_> = slots
        .iter()
        .filter(|s| s.date_naive().to_string() == "2026-10-25")
        .collect();
    assert_eq!(october_25, vec![&utc("2026-10-25T00:30:00Z")]);
    assert!(
        outbox.schedules().unwrap()[0]
            .spec
            .contains("Europe/Berlin")
    );
}
