//! What a firing of the schedules costs as their number grows: a store
//! with 10 schedules beside one with 10,000 (each every hour, their slots
//! spread over the hour), the median time of one `fire_schedules` when no
//! slot is due, and when 10 slots are due; each figure for 10,000 beside the
//! same for 10, measured in the same run. A firing reads the due index
//! from its first key: it should cost per due slot, not per schedule.
//!
//! ```text
//! cargo run --release -p idemstore-benches --bin schedules
//! ```

use std::time::{Duration, Instant};

use chrono::{DateTime, TimeDelta, Utc};
use idemstore::{Schedule, Store};

const HOUR: Duration = Duration::from_secs(3600);

fn start() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2026-03-01T00:00:00Z")
        .map(|t| t.with_timezone(&Utc))
        .unwrap_or_default()
}

/// A store with `n` hourly schedules whose slots fall `3600 s / n` apart
/// (cron would place them alike; an interval anchored at the epoch puts
/// all of one interval on the same instant, so each gets its own
/// interval offset by a second).
fn store_with(dir: &std::path::Path, n: u32) -> Result<Store, Box<dyn std::error::Error>> {
    let store = Store::open(dir.join(format!("s{n}.idem")))?;
    let outbox = store.outbox();
    for i in 0..n {
        // Intervals of 3600 s + i µs: slots spread, still about hourly.
        let every = HOUR + Duration::from_micros(u64::from(i) * 3_600_000_000 / u64::from(n));
        let s = Schedule::every(&format!("d{}", i % 16), every)?;
        outbox.set_schedule_at(&format!("s{i}"), s, start())?;
    }
    Ok(store)
}

/// The median µs of `f` over `runs` calls.
fn median_us(
    runs: usize,
    mut f: impl FnMut(usize) -> Result<u64, idemstore::Error>,
) -> Result<f64, idemstore::Error> {
    let mut t = Vec::with_capacity(runs);
    for i in 0..runs {
        let s = Instant::now();
        f(i)?;
        t.push(s.elapsed().as_secs_f64() * 1e6);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    println!("one fire_schedules, median µs (same run)\n");
    println!(
        "{:>34} | {:>10} | {:>10} | {:>7}",
        "", "10", "10,000", "ratio"
    );
    println!("{}", "-".repeat(70));
    let small = store_with(dir.path(), 10)?;
    let large = store_with(dir.path(), 10_000)?;
    // Start every schedule (a first firing sees each one), a minute in.
    let t0 = start() + TimeDelta::seconds(1);
    small.outbox().fire_schedules(t0)?;
    large.outbox().fire_schedules(t0)?;
    // Nothing due: the firing looks at the index's first key and stops.
    let idle = |s: &Store| median_us(200, |_| s.outbox().fire_schedules(t0));
    let (a, b) = (idle(&small)?, idle(&large)?);
    println!(
        "{:>34} | {a:>10.1} | {b:>10.1} | {:>6.2}x",
        "nothing due",
        b / a
    );
    // Due: each call moves the clock to the time at which the next 10 of
    // the large store's slots (or 10 of the small one's) come due.
    let due = |s: &Store, n: i64| -> Result<(f64, f64), idemstore::Error> {
        // Every schedule's first slot, fired before the timed calls.
        let mut now = start() + HOUR_DELTA + HOUR_DELTA;
        s.outbox().fire_schedules(now)?;
        let mut fired = 0;
        let us = median_us(50, |_| {
            now += TimeDelta::microseconds(3_600_000_000 / n * 10);
            let k = s.outbox().fire_schedules(now)?;
            fired += k;
            Ok(k)
        })?;
        Ok((us, fired as f64 / 50.0))
    };
    let ((a, ka), (b, kb)) = (due(&small, 10)?, due(&large, 10_000)?);
    println!(
        "{:>34} | {a:>10.1} | {b:>10.1} | {:>6.2}x",
        "about 10 slots due",
        b / a
    );
    println!(
        "{:>34} | {ka:>10.1} | {kb:>10.1} |",
        "entries per firing (mean)"
    );
    Ok(())
}

const HOUR_DELTA: TimeDelta = TimeDelta::seconds(3600);
