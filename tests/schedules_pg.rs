//! Periodic entries on PostgreSQL: the embedded store's rules on the
//! server, each slot once however many firings race.
//!
//! The server is named by `IDEMSTORE_TEST_POSTGRES` (`.ci/postgres run --
//! cargo test --features postgres --test schedules_pg`). Without it every
//! test says so and passes, except under `CI=true`.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use idemstore::postgres::{PgOutbox, PgStore};
use idemstore::{Error, Missed, OutboxFilter, Schedule};

fn t0() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2026-03-01T00:00:00Z")
        .unwrap()
        .with_timezone(&Utc)
}

fn minutes(n: i64) -> TimeDelta {
    TimeDelta::minutes(n)
}

fn every_5_minutes() -> Schedule {
    Schedule::every("reports", Duration::from_secs(300)).unwrap()
}

fn slots(outbox: &PgOutbox, destination: &str) -> Vec<DateTime<Utc>> {
    let mut out: Vec<_> = outbox
        .list(&OutboxFilter::default().destination(destination), 100_000)
        .unwrap()
        .into_iter()
        .map(|r| r.entry.slot().unwrap())
        .collect();
    out.sort();
    out
}

/// A store in a schema of its own, dropped at the end.
fn with_store(test: impl FnOnce(&PgStore)) {
    let Some(url) = common::pg::url() else {
        return;
    };
    let schema = common::pg::unique_schema();
    let _remove = common::pg::DropSchema {
        url: url.clone(),
        schema: schema.clone(),
    };
    let store = PgStore::builder().schema(&schema).connect(&url).unwrap();
    test(&store);
}

#[test]
fn racing_firings_yield_one_entry_per_slot() {
    with_store(|store| {
        let outbox = store.outbox();
        outbox
            .set_schedule_at("every5", every_5_minutes().missed(Missed::All), t0())
            .unwrap();
        // Four threads fire at every minute of two hours, all at once.
        for m in 1..=120 {
            let now = t0() + minutes(m);
            std::thread::scope(|s| {
                for _ in 0..4 {
                    let outbox = outbox.clone();
                    s.spawn(move || outbox.fire_schedules(now).unwrap());
                }
            });
        }
        let got = slots(&outbox, "reports");
        assert_eq!(got.len(), 24);
        assert_eq!(got.iter().collect::<BTreeSet<_>>().len(), 24);
        assert_eq!(got[0], t0() + minutes(5));
        let info = &outbox.schedules().unwrap()[0];
        assert_eq!(info.last_fired, Some(t0() + minutes(120)));
        assert_eq!(info.next_slot, Some(t0() + minutes(125)));
    });
}

#[test]
fn missed_slots_pauses_and_the_start_follow_the_embedded_rules() {
    with_store(|store| {
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
        outbox.fire_schedules(t0() + minutes(182)).unwrap();
        assert_eq!(slots(&outbox, "latest"), vec![t0() + minutes(180)]);
        assert_eq!(slots(&outbox, "all").len(), 36);
        assert!(slots(&outbox, "none").is_empty());

        // Set without a time: it starts at the first firing.
        outbox
            .set_schedule(
                "lazy",
                Schedule::every("lazy", Duration::from_secs(60)).unwrap(),
            )
            .unwrap();
        let lazy = |o: &PgOutbox| {
            o.schedules()
                .unwrap()
                .into_iter()
                .find(|i| i.name == "lazy")
                .unwrap()
        };
        assert_eq!(lazy(&outbox).next_slot, None);
        assert_eq!(
            outbox.fire_schedules(t0() + minutes(200)).unwrap(),
            6,
            "the others' slots"
        );
        assert_eq!(lazy(&outbox).next_slot, Some(t0() + minutes(201)));

        // Paused: nothing; resumed: by its policy.
        outbox.pause_schedule("all").unwrap();
        outbox.fire_schedules(t0() + minutes(230)).unwrap();
        assert_eq!(slots(&outbox, "all").len(), 40, "up to 200 only");
        outbox.resume_schedule("all").unwrap();
        outbox.fire_schedules(t0() + minutes(230)).unwrap();
        assert_eq!(slots(&outbox, "all").len(), 46);
        assert!(matches!(
            outbox.pause_schedule("nope"),
            Err(Error::NotFound)
        ));

        // Removed: its entries stay.
        outbox.remove_schedule("all").unwrap();
        outbox.remove_schedule("all").unwrap();
        assert_eq!(slots(&outbox, "all").len(), 46);
        assert!(outbox.schedules().unwrap().iter().all(|i| i.name != "all"));
        assert!(outbox.set_schedule("", every_5_minutes()).is_err());
    });
}

/// Two dispatchers on the server, driven by one manual clock through two
/// hours of a per-minute schedule: one entry per slot, each sent once.
#[test]
fn two_dispatchers_fire_each_slot_once() {
    use std::sync::{Arc, Mutex};

    use idemstore::{Delivery, Dispatcher, ManualClock, OutboxStatus};

    with_store(|store| {
        let outbox = store.outbox();
        let clock = ManualClock::new(t0());
        let every = Schedule::every("minutes", Duration::from_secs(60))
            .unwrap()
            .missed(Missed::All);
        outbox.set_schedule_at("m", every, t0()).unwrap();
        let sent = Arc::new(Mutex::new(Vec::new()));
        let dispatchers: Vec<_> = (0..2)
            .map(|i| {
                let sent = sent.clone();
                Dispatcher::builder(outbox.clone())
                    .clock(clock.clone())
                    // The clock jumps a day in a moment: a lease that long
                    // keeps the reaper from sending a claimed entry again.
                    .lease(Duration::from_secs(7 * 24 * 3600))
                    .worker_id(format!("pg{i}"))
                    .start(move |e| {
                        sent.lock().unwrap().push(e.idempotency_key.clone());
                        Delivery::Delivered
                    })
                    .unwrap()
            })
            .collect();
        for _ in 0..120 {
            clock.advance(Duration::from_secs(60));
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let done = || {
            outbox
                .list(&OutboxFilter::default().destination("minutes"), 1000)
                .unwrap()
                .iter()
                .filter(|r| r.entry.status == OutboxStatus::Completed)
                .count()
        };
        while done() < 120 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        for d in dispatchers {
            d.shutdown().unwrap();
        }
        let got = slots(&outbox, "minutes");
        assert_eq!(got.len(), 120);
        assert_eq!(got.iter().collect::<BTreeSet<_>>().len(), 120);
        let sent = sent.lock().unwrap();
        assert_eq!(sent.len(), 120, "each sent once");
    });
}
