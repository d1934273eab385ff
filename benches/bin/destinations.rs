//! The outbox's destinations under load, each figure beside its baseline
//! from the same run.
//!
//! ```text
//! cargo run --release -p idemstore-benches --bin destinations            # everything
//! cargo run --release -p idemstore-benches --bin destinations -- drain   # one part
//! ```
//!
//! Parts (name one or more; none runs them all):
//!
//! - `drain`: the thread dispatcher with its defaults (2 workers, batches
//!   of 16) draining a durable backlog of 20k entries spread over 10
//!   destinations, none with a policy; entries per second, median of
//!   `--runs` (default 3). Its baseline is the same program built against
//!   the outbox before destinations (below): the target is at least 0.95×
//!   its throughput.
//! - `claim`: `claim_due(100)` at 5k and at 200k pending entries, without
//!   fsync (`Durability::None`, so the figures show the index work): one
//!   destination; 1,000 destinations; 1,000 destinations with 5,000
//!   ordering keys. Median per call; the target is 200k/5k ≤ 1.5×.
//!   `claim --destinations D [--keys K] [--pending N]` times one spread
//!   and one backlog only (for a profiler).
//! - `cycle`: the worker's cycle (`settle_and_claim` of a batch of 16 over
//!   10 destinations, the last batch completed), without fsync, per entry:
//!   the drain's store work without the disk; a batch across destinations,
//!   and a batch of one destination (what the dispatcher's workers claim
//!   once it shares them fairly).
//! - `caps`: flow control at full speed, on the embedded store, and on
//!   PostgreSQL too when built with the package's `postgres` feature and
//!   `IDEMSTORE_TEST_POSTGRES` names a server (`.ci/postgres run -- …`). For caps
//!   of 1, 4 and 16 and sends of 10 ms, the thread dispatcher (twice as
//!   many workers as the cap, at least 4) and the async one (the same
//!   number of slots) drain `50 × cap` entries of the capped destination:
//!   the most sends seen in flight at once (the goal: the cap, never more)
//!   and the drain rate as a fraction of `cap / 10 ms` (the goal: ≥ 0.9).
//!   Then a rate limit of 200/s with bursts of 10, instant sends, 8
//!   workers, 1,000 entries: the drain rate as a fraction of 200/s.
//! - `hol`: head of line. Destination A's send takes 300 ms (a backlog of
//!   400, enqueued first), B's 1 ms (1,500 entries), 8 workers: B's
//!   delivery rate while A still has a backlog, beside B's rate with A
//!   absent (goal: at least 0.45×); the same with B's sends instant.
//!
//! The baseline: build this same file against the outbox as it was before
//! destinations, with the package's default feature `destinations` off
//! (`--no-default-features`), which leaves out what that outbox cannot do
//! (ordering keys). Run the two builds in turn, A B A B, and compare the
//! medians pair by pair: the machines this runs on are shared and noisy.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeZone, Utc};
use idemstore::{Delivery, Dispatcher, Durability, NewEntry, Outbox, Settlement, Store};
use parking_lot::Mutex;

/// The drained backlog, and the destinations it is spread over.
const DRAIN_ENTRIES: u64 = 20_000;
const DRAIN_DESTINATIONS: u64 = 10;
/// Entries per enqueue commit while setting up.
const SETUP_CHUNK: u64 = 100;

/// What one timed claim asks for, and how many are timed.
const CLAIM: usize = 100;
const CLAIM_SAMPLES: usize = 300;
const CLAIM_WARM_UP: usize = 30;
/// The worker's cycle: its batch, and how many cycles are timed.
const CYCLE_BATCH: usize = 16;
const CYCLE_SAMPLES: usize = 5_000;

/// Head of line: the slow destination and the fast one.
const SLOW_ENTRIES: u64 = 400;
const SLOW_SEND: Duration = Duration::from_millis(300);
const FAST_ENTRIES: u64 = 1_500;
const HOL_WORKERS: usize = 8;
/// The longest a head-of-line run waits for B.
const HOL_BOUND: Duration = Duration::from_secs(30);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runs = flag(&args, "--runs").unwrap_or(3);
    let parts: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| ["drain", "claim", "cycle", "caps", "hol"].contains(a))
        .collect();
    let wants = |part: &str| parts.is_empty() || parts.contains(&part);
    println!(
        "build: {}",
        if cfg!(feature = "destinations") {
            "the outbox with destinations"
        } else {
            "the outbox before destinations (baseline)"
        }
    );
    if wants("drain") {
        drain(runs)?;
    }
    if wants("claim") {
        match flag(&args, "--destinations") {
            // One spread and one backlog, for a profiler.
            Some(destinations) => {
                let spread = Spread {
                    name: "asked",
                    destinations: destinations as u64,
                    keys: flag(&args, "--keys").unwrap_or(0) as u64,
                };
                let pending = flag(&args, "--pending").unwrap_or(200_000) as u64;
                let took = claim_median(spread, pending)?;
                println!("claim_due({CLAIM}): {took:.1} µs");
            }
            None => claim()?,
        }
    }
    if wants("cycle") {
        cycle()?;
    }
    #[cfg(feature = "destinations")]
    if wants("caps") {
        caps::run()?;
    }
    if wants("hol") {
        head_of_line(runs)?;
    }
    Ok(())
}

/// `caps`: see the file's docs.
#[cfg(feature = "destinations")]
mod caps {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use chrono::Utc;
    use idemstore::{
        Delivery, DestinationPolicy, Dispatcher, DispatcherBuilder, NewEntry, Outbox, Store,
    };

    type R<T> = Result<T, Box<dyn std::error::Error>>;

    const SEND: Duration = Duration::from_millis(10);

    /// Sends in flight now, and the most at once.
    #[derive(Default)]
    struct Gauge {
        now: AtomicUsize,
        most: AtomicUsize,
    }

    impl Gauge {
        fn start(&self) {
            let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(n, Ordering::SeqCst);
        }

        fn end(&self) {
            self.now.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Either backend's outbox, with what the cases ask of it.
    #[derive(Clone)]
    enum Backend {
        File(Outbox),
        #[cfg(feature = "postgres")]
        Server(idemstore::postgres::PgOutbox),
    }

    impl Backend {
        fn fill(&self, n: usize) -> R<()> {
            let entries = (0..n).map(|i| NewEntry::new("cmd", "api", format!("k{i}"), Vec::new()));
            match self {
                Backend::File(o) => drop(o.enqueue_many(entries, Utc::now())?),
                #[cfg(feature = "postgres")]
                Backend::Server(o) => drop(o.enqueue_many(entries, Utc::now())?),
            }
            Ok(())
        }

        fn completed(&self) -> R<u64> {
            Ok(match self {
                Backend::File(o) => o.counts()?.completed,
                #[cfg(feature = "postgres")]
                Backend::Server(o) => o.counts()?.completed,
            })
        }

        fn builder(&self) -> DispatcherBuilder {
            match self {
                Backend::File(o) => Dispatcher::builder(o.clone()),
                #[cfg(feature = "postgres")]
                Backend::Server(o) => Dispatcher::builder(o.clone()),
            }
        }

        /// Blocks until `n` entries are completed; returns when.
        fn drained(&self, n: u64) -> R<Instant> {
            while self.completed()? < n {
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(Instant::now())
        }
    }

    /// Where each case's fresh outbox is made.
    enum Place {
        Dir(tempfile::TempDir),
        #[cfg(feature = "postgres")]
        Server {
            url: String,
            schemas: Vec<String>,
        },
    }

    impl Place {
        /// A fresh outbox named `name` whose destination `api` has `policy`.
        fn outbox(&mut self, name: &str, policy: DestinationPolicy) -> R<Backend> {
            let outbox = match self {
                Place::Dir(dir) => Backend::File(Store::open(dir.path().join(name))?.outbox()),
                #[cfg(feature = "postgres")]
                Place::Server { url, schemas } => {
                    let schema = format!("bench_caps_{}_{}", std::process::id(), schemas.len());
                    let store = idemstore::postgres::PgStore::builder()
                        .schema(&schema)
                        .pool_size(16)
                        .connect(url)?;
                    schemas.push(schema);
                    Backend::Server(store.outbox())
                }
            };
            match &outbox {
                Backend::File(o) => o.set_destination_policy("api", policy)?,
                #[cfg(feature = "postgres")]
                Backend::Server(o) => o.set_destination_policy("api", policy)?,
            }
            Ok(outbox)
        }
    }

    #[cfg(feature = "postgres")]
    impl Drop for Place {
        fn drop(&mut self) {
            if let Place::Server { url, schemas } = self
                && let Ok(mut c) = postgres::Client::connect(url, postgres::NoTls)
            {
                for s in schemas.iter() {
                    let _ = c.batch_execute(&format!("DROP SCHEMA {s} CASCADE"));
                }
            }
        }
    }

    pub(super) fn run() -> R<()> {
        run_on("embedded", Place::Dir(tempfile::tempdir()?))?;
        #[cfg(feature = "postgres")]
        match std::env::var("IDEMSTORE_TEST_POSTGRES") {
            Ok(url) => run_on(
                "PostgreSQL",
                Place::Server {
                    url,
                    schemas: Vec::new(),
                },
            )?,
            Err(_) => println!("\n(PostgreSQL: set IDEMSTORE_TEST_POSTGRES to run it too)"),
        }
        Ok(())
    }

    fn run_on(backend: &str, mut place: Place) -> R<()> {
        println!(
            "\ncaps, {backend}: sends of 10 ms, 50 × cap entries; goal: most = cap, rate ≥ 0.9 of cap/10 ms"
        );
        println!(
            "{:>5} | {:>7} | {:>8} | {:>6} | {:>12}",
            "cap", "runtime", "workers", "most", "rate / ideal"
        );
        for cap in [1usize, 4, 16] {
            let workers = (2 * cap).max(4);
            let n = 50 * cap;
            let ideal = cap as f64 / SEND.as_secs_f64();
            for runtime in ["threads", "tokio"] {
                let name = format!("cap{cap}-{runtime}.idem");
                let cap32 = u32::try_from(cap)?;
                let outbox =
                    place.outbox(&name, DestinationPolicy::default().max_in_flight(cap32))?;
                outbox.fill(n)?;
                let gauge = Arc::new(Gauge::default());
                let started = Instant::now();
                let g = gauge.clone();
                let builder = outbox.builder().workers(workers);
                let done = if runtime == "threads" {
                    let d = builder.start(move |_| {
                        g.start();
                        std::thread::sleep(SEND);
                        g.end();
                        Delivery::Delivered
                    })?;
                    let done = outbox.drained(n as u64)?;
                    d.shutdown()?;
                    done
                } else {
                    let rt = tokio::runtime::Runtime::new()?;
                    let d = rt.block_on(async {
                        builder.start_async(move |_| {
                            let g = g.clone();
                            async move {
                                g.start();
                                tokio::time::sleep(SEND).await;
                                g.end();
                                Delivery::Delivered
                            }
                        })
                    })?;
                    let done = outbox.drained(n as u64)?;
                    rt.block_on(d.shutdown())?;
                    done
                };
                let rate = n as f64 / (done - started).as_secs_f64();
                println!(
                    "{cap:>5} | {runtime:>7} | {workers:>8} | {:>6} | {:>12.2}",
                    gauge.most.load(Ordering::SeqCst),
                    rate / ideal
                );
            }
        }
        let outbox = place.outbox(
            "rate.idem",
            DestinationPolicy::default().rate_limit(200.0, 10),
        )?;
        outbox.fill(1000)?;
        let started = Instant::now();
        let d = outbox.builder().workers(8).start(|_| Delivery::Delivered)?;
        let done = outbox.drained(1000)?;
        d.shutdown()?;
        // The burst is free: 990 entries at 200/s.
        let rate = 990.0 / (done - started).as_secs_f64();
        println!(
            "rate limit 200/s, bursts of 10, 8 workers: {rate:.0}/s, {:.2} of the rate",
            rate / 200.0
        );
        Ok(())
    }
}

/// The number after `name` in `args`.
fn flag(args: &[String], name: &str) -> Option<usize> {
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1)?.parse().ok()
}

fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

// ---------- drain ----------

fn drain(runs: usize) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "\ndrain: {DRAIN_ENTRIES} entries over {DRAIN_DESTINATIONS} destinations, no limits, thread dispatcher with its defaults, durable"
    );
    let mut rates = Vec::new();
    let mut cpu = Vec::new();
    for run in 0..runs.max(1) {
        let dir = tempfile::tempdir()?;
        let store = Store::open(dir.path().join("drain.idem"))?;
        let outbox = store.outbox();
        let mut i = 0;
        while i < DRAIN_ENTRIES {
            let end = (i + SETUP_CHUNK).min(DRAIN_ENTRIES);
            let chunk = (i..end).map(|i| {
                NewEntry::new(
                    format!("c{}", i / 10),
                    format!("dest-{}", i % DRAIN_DESTINATIONS),
                    format!("k{i}"),
                    b"x".to_vec(),
                )
            });
            outbox.enqueue_many(chunk, Utc::now())?;
            i = end;
        }
        let start = Instant::now();
        let cpu_before = cpu_time();
        let handle = Dispatcher::builder(outbox.clone()).start(|_| Delivery::Delivered)?;
        while outbox.counts()?.completed < DRAIN_ENTRIES {
            std::thread::sleep(Duration::from_millis(1));
        }
        let took = start.elapsed();
        let used = cpu_time()
            .zip(cpu_before)
            .map(|(after, before)| after.saturating_sub(before));
        handle.shutdown()?;
        let rate = DRAIN_ENTRIES as f64 / took.as_secs_f64();
        let per_entry = used.map_or(f64::NAN, |d| d.as_secs_f64() * 1e6 / DRAIN_ENTRIES as f64);
        println!(
            "  run {run}: {rate:>8.0} entries/s ({took:.2?}), process CPU {per_entry:.1} µs per entry"
        );
        rates.push(rate);
        cpu.push(per_entry);
    }
    println!(
        "  drain median: {:.0} entries/s, {:.1} µs of CPU per entry",
        median(&mut rates),
        median(&mut cpu)
    );
    Ok(())
}

/// The CPU time this process has used (user and system, all threads),
/// from `/proc/self/stat`: at the kernel's clock tick (10 ms), so only
/// for runs of a second or more. `None` where there is no `/proc`.
fn cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command name, which is in parentheses.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split(' ');
    // utime and stime are fields 14 and 15; `rest` starts at field 3.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    // USER_HZ is 100 on every Linux this runs on.
    Some(Duration::from_millis((utime + stime) * 10))
}

// ---------- claim ----------

/// How a claim benchmark's backlog is spread.
#[derive(Clone, Copy)]
struct Spread {
    name: &'static str,
    destinations: u64,
    /// Ordering keys over all destinations (0: none).
    keys: u64,
}

fn claim() -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "\nclaim_due({CLAIM}), no fsync, median of {CLAIM_SAMPLES} calls (each claimed batch put back, untimed)"
    );
    let mut spreads = vec![
        Spread {
            name: "1 destination",
            destinations: 1,
            keys: 0,
        },
        Spread {
            name: "1000 destinations",
            destinations: 1_000,
            keys: 0,
        },
    ];
    if cfg!(feature = "destinations") {
        spreads.push(Spread {
            name: "1000 destinations, 5000 keys",
            destinations: 1_000,
            keys: 5_000,
        });
    }
    for spread in spreads {
        let small = claim_median(spread, 5_000)?;
        let large = claim_median(spread, 200_000)?;
        println!(
            "  {:<30} 5k: {:>8.1} µs   200k: {:>8.1} µs   200k/5k = {:.2}x (target <= 1.5x)",
            spread.name,
            small,
            large,
            large / small
        );
    }
    Ok(())
}

fn cycle() -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "\nworker cycle over {DRAIN_DESTINATIONS} destinations, 200k pending, no fsync, median of {CYCLE_SAMPLES} cycles:"
    );
    let cycle = cycle_median(false)?;
    println!(
        "  settle_and_claim({CYCLE_BATCH}), a batch across destinations: {cycle:.2} µs per entry"
    );
    if cfg!(feature = "destinations") {
        let cycle = cycle_median(true)?;
        println!(
            "  the same, a batch of one destination (ClaimRequest::one_destination): {cycle:.2} µs per entry"
        );
    }
    Ok(())
}

fn no_sync_store(path: &std::path::Path) -> Result<Store, idemstore::Error> {
    Store::builder()
        .durability(Durability::None)
        .flush_interval(Duration::from_secs(30))
        .open(path)
}

/// An entry of a claim benchmark's backlog.
fn spread_entry(spread: Spread, i: u64) -> NewEntry {
    let entry = NewEntry::new(
        format!("c{}", i / 10),
        format!("dest-{}", i % spread.destinations),
        format!("k{i}"),
        vec![7_u8; 64],
    );
    with_key(entry, spread, i)
}

/// `entry` (number `i`) with its ordering key, if the spread has keys: key
/// `i mod keys`, which stays with one destination when `keys` is a
/// multiple of the destinations.
#[cfg(feature = "destinations")]
fn with_key(entry: NewEntry, spread: Spread, i: u64) -> NewEntry {
    if spread.keys == 0 {
        entry
    } else {
        entry.ordering_key(format!("key-{}", i % spread.keys))
    }
}

#[cfg(not(feature = "destinations"))]
fn with_key(entry: NewEntry, spread: Spread, _: u64) -> NewEntry {
    assert_eq!(spread.keys, 0, "ordering keys need feature `destinations`");
    entry
}

fn fill(outbox: &Outbox, spread: Spread, n: u64) -> Result<(), idemstore::Error> {
    let chunk = 5_000;
    let mut start = 0;
    while start < n {
        let end = (start + chunk).min(n);
        outbox.enqueue_many((start..end).map(|i| spread_entry(spread, i)), t(0))?;
        start = end;
    }
    Ok(())
}

/// The median time of `claim_due(100)` over a backlog of `n`, in µs.
fn claim_median(spread: Spread, n: u64) -> Result<f64, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let store = no_sync_store(&dir.path().join("claim.idem"))?;
    let outbox = store.outbox();
    fill(&outbox, spread, n)?;
    let mut samples = Vec::with_capacity(CLAIM_SAMPLES);
    for i in 0..CLAIM_WARM_UP + CLAIM_SAMPLES {
        let start = Instant::now();
        let claimed = outbox.claim_due(t(10), CLAIM, "bench")?;
        let took = start.elapsed();
        assert_eq!(claimed.len(), CLAIM, "a full claim");
        if i >= CLAIM_WARM_UP {
            samples.push(took.as_secs_f64() * 1e6);
        }
        let back = claimed.iter().map(|e| {
            (
                e.fence(),
                Settlement::Rescheduled {
                    next_attempt_at: e.due_at(),
                },
            )
        });
        for r in outbox.settle_many(back, t(10))? {
            r?;
        }
    }
    Ok(median(&mut samples))
}

/// The worker's cycle without fsync: completes the last batch and claims
/// the next in one call, over a backlog of 200k across 10 destinations
/// (refilled as it drains); the median per entry, in µs.
fn cycle_median(one_destination: bool) -> Result<f64, Box<dyn std::error::Error>> {
    let spread = Spread {
        name: "cycle",
        destinations: DRAIN_DESTINATIONS,
        keys: 0,
    };
    let dir = tempfile::tempdir()?;
    let store = no_sync_store(&dir.path().join("cycle.idem"))?;
    let outbox = store.outbox();
    fill(&outbox, spread, 200_000)?;
    let mut settlements = Vec::new();
    let mut samples = Vec::with_capacity(CYCLE_SAMPLES);
    for _ in 0..CYCLE_SAMPLES {
        let start = Instant::now();
        let (_, claimed) =
            settle_and_claim(&outbox, std::mem::take(&mut settlements), one_destination)?;
        samples.push(start.elapsed().as_secs_f64() * 1e6 / CYCLE_BATCH as f64);
        assert_eq!(claimed.len(), CYCLE_BATCH, "a full batch");
        settlements = claimed
            .iter()
            .map(|e| (e.fence(), Settlement::Completed))
            .collect();
    }
    Ok(median(&mut samples))
}

/// Settles `settlements` and claims a batch at `t(10)`, in one call; of
/// one destination only if `one_destination`.
#[cfg(feature = "destinations")]
fn settle_and_claim(
    outbox: &Outbox,
    settlements: Vec<(idemstore::Fence, Settlement)>,
    one_destination: bool,
) -> Result<idemstore::SettledAndClaimed, idemstore::Error> {
    let mut request = idemstore::ClaimRequest::new(CYCLE_BATCH, "bench");
    if one_destination {
        request = request.one_destination();
    }
    outbox.settle_and_claim_with(settlements, t(10), &request)
}

#[cfg(not(feature = "destinations"))]
fn settle_and_claim(
    outbox: &Outbox,
    settlements: Vec<(idemstore::Fence, Settlement)>,
    one_destination: bool,
) -> Result<idemstore::SettledAndClaimed, idemstore::Error> {
    assert!(
        !one_destination,
        "a batch of one destination needs feature `destinations`"
    );
    outbox.settle_and_claim(settlements, t(10), CYCLE_BATCH, "bench")
}

// ---------- head of line ----------

/// What a head-of-line run saw of B.
struct FastRun {
    /// B's entries sent while A still had entries to send, per second.
    rate: f64,
    /// How many B sent in that window.
    sent: u64,
    window: Duration,
}

fn head_of_line(runs: usize) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "\nhead of line: A's send {} ms ({SLOW_ENTRIES} enqueued first), B {FAST_ENTRIES} entries, {HOL_WORKERS} workers, durable; median of {runs} runs",
        SLOW_SEND.as_millis()
    );
    for (label, fast_send) in [
        ("B's send 1 ms", Some(Duration::from_millis(1))),
        ("B's send instant", None),
    ] {
        let mut beside = Vec::new();
        let mut alone = Vec::new();
        let mut ratios = Vec::new();
        for run in 0..runs.max(1) {
            let with_a = fast_run(true, fast_send)?;
            let without = fast_run(false, fast_send)?;
            println!(
                "  {label}, run {run}: beside A {:>7.1}/s ({} sent in {:.2?})   alone {:>7.1}/s ({:.2?})   ratio {:.3}",
                with_a.rate,
                with_a.sent,
                with_a.window,
                without.rate,
                without.window,
                with_a.rate / without.rate
            );
            ratios.push(with_a.rate / without.rate);
            beside.push(with_a.rate);
            alone.push(without.rate);
        }
        println!(
            "  {label}: B beside A {:.1}/s, alone {:.1}/s (medians); ratio median {:.3} (goal >= 0.45)",
            median(&mut beside),
            median(&mut alone),
            median(&mut ratios)
        );
    }
    Ok(())
}

/// One run: A's backlog (if `with_slow`) then B's, 8 workers; B's rate
/// until B is all sent or A has no entry left to start, whichever is
/// first (or [`HOL_BOUND`]).
fn fast_run(
    with_slow: bool,
    fast_send: Option<Duration>,
) -> Result<FastRun, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("hol.idem"))?;
    let outbox = store.outbox();
    let enqueue = |destination: &str, n: u64| -> Result<(), idemstore::Error> {
        let mut i = 0;
        while i < n {
            let end = (i + SETUP_CHUNK).min(n);
            let chunk = (i..end).map(|i| {
                NewEntry::new(format!("c{i}"), destination, format!("k{i}"), b"x".to_vec())
            });
            outbox.enqueue_many(chunk, Utc::now())?;
            i = end;
        }
        Ok(())
    };
    if with_slow {
        enqueue("A", SLOW_ENTRIES)?;
    }
    enqueue("B", FAST_ENTRIES)?;
    let slow_started = Arc::new(AtomicU64::new(0));
    let b_delivered = Arc::new(AtomicU64::new(0));
    // When B's last send so far ended.
    let fast_last = Arc::new(Mutex::new(None::<Instant>));
    let start = Instant::now();
    let handle = {
        let (slow_started, b_delivered, fast_last) =
            (slow_started.clone(), b_delivered.clone(), fast_last.clone());
        Dispatcher::builder(outbox.clone())
            .workers(HOL_WORKERS)
            .start(move |e| {
                if e.destination == "A" {
                    slow_started.fetch_add(1, Ordering::SeqCst);
                    std::thread::sleep(SLOW_SEND);
                } else {
                    if let Some(d) = fast_send {
                        std::thread::sleep(d);
                    }
                    let mut last = fast_last.lock();
                    b_delivered.fetch_add(1, Ordering::SeqCst);
                    *last = Some(Instant::now());
                }
                Delivery::Delivered
            })?
    };
    // Until B is done, A has started its last send, or the bound.
    let (end, sent) = loop {
        let slow_done = with_slow && slow_started.load(Ordering::SeqCst) >= SLOW_ENTRIES;
        let now = Instant::now();
        let sent = b_delivered.load(Ordering::SeqCst);
        if sent >= FAST_ENTRIES {
            break (fast_last.lock().unwrap_or(now), sent);
        }
        if slow_done || now - start >= HOL_BOUND {
            break (now, sent);
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let window = end - start;
    handle.shutdown()?;
    Ok(FastRun {
        rate: sent as f64 / window.as_secs_f64(),
        sent,
        window,
    })
}
