//! The operator console on a large store file, each figure beside its
//! baseline from the same run.
//!
//! ```text
//! cargo run --release -p idemstore-benches --features console --bin console
//! cargo run --release -p idemstore-benches --features console --bin console -- pages --entries 200000
//! ```
//!
//! Parts (name one or both; none runs both):
//!
//! - `pages`: a store of `--entries` entries (default 1,000,000) over 10
//!   destinations: 1% pending, 0.2% failed (of two destinations, among
//!   the latest tenth), the rest completed. The server time of each main page (the router called
//!   directly, no sockets), p50 and p99 of 200 requests: the overview,
//!   the first page of the failed entries of one destination, a page of
//!   them further on, the first page of the completed entries, an
//!   entry's page, the destinations. The target: p99 ≤ 50 ms. The
//!   baseline is what the same listing costs without the entries by
//!   status (a walk of every entry, `OutboxFilter` without a status).
//! - `retry`: "retry all matching" of `--failed` failed entries (default
//!   100,000) of one destination through the console's form, while a
//!   thread claims and completes batches of 16 of another destination's
//!   backlog as a dispatcher's worker does: the action's total time, and
//!   the claims' worst and p99 latency beside the same claims with nothing
//!   else running (the target: worst ≤ 100 ms). The action's baseline:
//!   the first 2,000 entries retried a commit each (`requeue`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use chrono::{DateTime, TimeZone, Utc};
use idemstore::console::Console;
use idemstore::{NewEntry, Outbox, OutboxFilter, OutboxStatus, Settlement, Store};
use tower::ServiceExt as _;

/// Destinations of the large store; the failed entries are of the first
/// two.
const DESTINATIONS: u64 = 10;
/// Entries per enqueue or settlement commit while setting up.
const SETUP_CHUNK: usize = 10_000;
/// Requests timed per page.
const SAMPLES: usize = 200;
/// The claiming thread's batch, as the dispatcher's default.
const BATCH: usize = 16;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parts: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| ["pages", "retry"].contains(a))
        .collect();
    let wants = |part: &str| parts.is_empty() || parts.contains(&part);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if wants("pages") {
        let entries = flag(&args, "--entries").unwrap_or(1_000_000);
        runtime.block_on(pages(entries))?;
    }
    if wants("retry") {
        let failed = flag(&args, "--failed").unwrap_or(100_000);
        runtime.block_on(retry(failed))?;
    }
    Ok(())
}

fn flag(args: &[String], name: &str) -> Option<usize> {
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1)?.parse().ok()
}

fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

fn entry(destination: u64, i: usize) -> NewEntry {
    NewEntry::new(
        format!("cmd-{}", i / 4),
        format!("d{destination}"),
        format!("k{i}"),
        format!("{{\"order\":{i},\"note\":\"a payload of the size of a small webhook\"}}")
            .into_bytes(),
    )
}

/// Enqueues `n` entries from index `from`, each destination in turn, and
/// settles them: those `fails` picks failed for good, the rest but every
/// `pending_every`-th completed.
fn fill(
    outbox: &Outbox,
    from: usize,
    n: usize,
    fails: impl Fn(usize) -> bool,
    pending_every: usize,
) -> Res<()> {
    for start in (from..from + n).step_by(SETUP_CHUNK) {
        let end = (start + SETUP_CHUNK).min(from + n);
        let chunk: Vec<NewEntry> = (start..end)
            .map(|i| entry(i as u64 % DESTINATIONS, i))
            .collect();
        outbox.enqueue_many(chunk, t(0))?;
        // Everything pending: this chunk and what earlier ones left.
        let claimed = outbox.claim_due(t(1), usize::MAX, "setup")?;
        let settlements = claimed.iter().filter_map(|c| {
            let i: usize = c.idempotency_key[1..].parse().ok()?;
            if i.is_multiple_of(pending_every) {
                None
            } else if fails(i) {
                Some((
                    c.fence(),
                    Settlement::Failed {
                        reason: "http_500".into(),
                        next_attempt_at: None,
                    },
                ))
            } else {
                Some((c.fence(), Settlement::Completed))
            }
        });
        let settlements: Vec<_> = settlements.collect();
        outbox.settle_many(settlements, t(2))?;
        // What stayed claimed goes back to pending.
        outbox.release_expired_claims(t(3))?;
    }
    Ok(())
}

/// `GET path`: the status and the body.
async fn get(router: &Router, path: &str) -> Res<(StatusCode, String)> {
    let response = router
        .clone()
        .oneshot(Request::get(path).body(Body::empty())?)
        .await?;
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), 16 << 20).await?;
    Ok((status, String::from_utf8(body.to_vec())?))
}

/// The median and the 99th percentile of `samples`.
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "an index within the samples"
)]
fn p50_p99(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    let at = |q: f64| {
        let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples[i]
    };
    (at(0.5), at(0.99))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[expect(clippy::too_many_lines, reason = "one benchmark, read top to bottom")]
async fn pages(entries: usize) -> Res<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("console.idem");
    let store = Store::open(&path)?;
    let outbox = store.outbox();
    let started = Instant::now();
    // The failures are recent: 2% of the latest tenth of the entries, of d0
    // and d1 only (i % 10 < 2), so a walk from the first entry reads
    // nine tenths of the outbox before it finds one.
    let recent = entries / 10 * 9;
    fill(
        &outbox,
        0,
        entries,
        |i| i >= recent && i % 50 < 2 && i % 10 < 2,
        100,
    )?;
    let c = outbox.counts()?;
    println!(
        "pages: {} entries (pending {}, completed {}, failed {}) over {DESTINATIONS} destinations, set up in {:.0?}, file {} MB",
        c.total(),
        c.pending,
        c.completed,
        c.failed,
        started.elapsed(),
        std::fs::metadata(&path)?.len() >> 20
    );
    let router = Console::new(outbox.clone()).router();
    let failed_d0 = OutboxFilter::any()
        .status(OutboxStatus::Failed)
        .destination("d0");
    let middle = outbox.list(&failed_d0, 1000)?;
    let middle = middle.get(middle.len() / 2).map_or(0, |r| r.entry.id.0);
    let some_entry = outbox
        .list(&failed_d0, 1)?
        .first()
        .map_or(1, |r| r.entry.id.0);
    let paths = [
        ("overview", "/".to_owned()),
        (
            "failed of d0, first page",
            "/outbox?status=failed&destination=d0".to_owned(),
        ),
        (
            "failed of d0, further on",
            format!("/outbox?status=failed&destination=d0&after={middle}"),
        ),
        (
            "completed, first page",
            "/outbox?status=completed".to_owned(),
        ),
        ("pending, first page", "/outbox?status=pending".to_owned()),
        ("an entry", format!("/outbox/{some_entry}")),
        ("destinations", "/destinations".to_owned()),
    ];
    println!("  server time per page, {SAMPLES} requests each (target: p99 <= 50 ms):");
    for (name, path) in &paths {
        let mut samples = Vec::with_capacity(SAMPLES);
        for _ in 0..SAMPLES {
            let began = Instant::now();
            let (status, _) = get(&router, path).await?;
            samples.push(began.elapsed());
            assert_eq!(status, StatusCode::OK, "{path}");
        }
        let (p50, p99) = p50_p99(samples);
        println!(
            "    {name:<28} p50 {:>7.2} ms   p99 {:>7.2} ms",
            ms(p50),
            ms(p99)
        );
    }
    // The baseline: the same first page without the listing by status, a
    // walk of every entry from the first.
    let mut samples = Vec::new();
    let walk = OutboxFilter::any().destination("d0");
    for _ in 0..5 {
        let began = Instant::now();
        let o = outbox.clone();
        let w = walk.clone();
        let found = tokio::task::spawn_blocking(move || {
            let mut out = Vec::new();
            let mut from = w.clone();
            // Pages of 50 d0 entries, keeping the failed, until 50 are found.
            while out.len() < 50 {
                let page = o.list(&from, 500)?;
                let Some(last) = page.last().map(|r| r.entry.id) else {
                    break;
                };
                out.extend(
                    page.into_iter()
                        .filter(|r| r.entry.status == OutboxStatus::Failed),
                );
                from = w.clone().after(last);
            }
            Ok::<_, idemstore::Error>(out.len())
        })
        .await??;
        samples.push(began.elapsed());
        assert!(found >= 50.min(usize::try_from(c.failed)? / 2));
    }
    let (p50, _) = p50_p99(samples);
    println!(
        "    baseline: the same first page by a walk of the entries: p50 {:.2} ms (5 runs)",
        ms(p50)
    );
    Ok(())
}

/// The console's token, from a page that shows a form.
fn token(html: &str) -> Option<String> {
    let at = html.find("name=\"token\" value=\"")? + "name=\"token\" value=\"".len();
    Some(html[at..].split('"').next()?.to_owned())
}

/// Claims and completes batches of the live destination's entries until
/// `stop`; returns each claim's latency.
fn claim_loop(outbox: &Outbox, stop: &AtomicBool) -> Res<Vec<Duration>> {
    let mut samples = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let began = Instant::now();
        let claimed = outbox.claim(
            Utc::now(),
            &idemstore::ClaimRequest::new(BATCH, "live").avoid(["x"]),
        )?;
        samples.push(began.elapsed());
        if claimed.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        outbox.settle_many(
            claimed.iter().map(|c| (c.fence(), Settlement::Completed)),
            Utc::now(),
        )?;
    }
    Ok(samples)
}

#[expect(clippy::too_many_lines, reason = "one benchmark, read top to bottom")]
async fn retry(all: usize) -> Res<()> {
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("retry.idem"))?;
    let outbox = store.outbox();
    let started = Instant::now();
    // The failed entries, of destination x.
    for start in (0..all).step_by(SETUP_CHUNK) {
        let end = (start + SETUP_CHUNK).min(all);
        let chunk: Vec<NewEntry> = (start..end)
            .map(|i| NewEntry::new("c", "x", format!("x{i}"), b"{}".to_vec()))
            .collect();
        outbox.enqueue_many(chunk, t(0))?;
        let claimed = outbox.claim_due(t(1), end - start, "setup")?;
        outbox.settle_many(
            claimed.iter().map(|c| {
                (
                    c.fence(),
                    Settlement::Failed {
                        reason: "http_500".into(),
                        next_attempt_at: None,
                    },
                )
            }),
            t(2),
        )?;
    }
    // The live destination's backlog, which the claiming thread drains.
    let live: Vec<NewEntry> = (0..400_000)
        .map(|i| NewEntry::new("c", "live", format!("l{i}"), b"{}".to_vec()))
        .collect();
    for chunk in live.chunks(SETUP_CHUNK) {
        outbox.enqueue_many(chunk.to_vec(), t(0))?;
    }
    println!(
        "retry: {all} failed entries of x beside a backlog of live's, set up in {:.0?}",
        started.elapsed()
    );
    // The baseline: the claims alone, for as long as the action took last
    // time (two seconds the first time).
    let quiet = {
        let stop = Arc::new(AtomicBool::new(false));
        let o = outbox.clone();
        let s = stop.clone();
        let claims = std::thread::spawn(move || claim_loop(&o, &s).map_err(|e| e.to_string()));
        std::thread::sleep(Duration::from_secs(3));
        stop.store(true, Ordering::Relaxed);
        claims.join().expect("no panic")?
    };
    // The baseline of the action's speed: a commit per entry, over the
    // first 2,000 failed entries (retried by `requeue` one at a time).
    let one_by_one = {
        let o = outbox.clone();
        tokio::task::spawn_blocking(move || {
            let filter = OutboxFilter::any()
                .status(OutboxStatus::Failed)
                .destination("x");
            let ids: Vec<_> = o.list(&filter, 2_000)?.iter().map(|r| r.entry.id).collect();
            let began = Instant::now();
            for id in &ids {
                o.requeue(*id, Utc::now())?;
            }
            Ok::<_, idemstore::Error>(ids.len() as f64 / began.elapsed().as_secs_f64())
        })
        .await??
    };
    let failed = all.saturating_sub(2_000);
    let router = Console::new(outbox.clone()).allow_writes(true).router();
    let (_, list) = get(&router, "/outbox?status=failed&destination=x").await?;
    let token = token(&list).ok_or("the list page has the action's form")?;
    let stop = Arc::new(AtomicBool::new(false));
    let o = outbox.clone();
    let s = stop.clone();
    let claims = std::thread::spawn(move || claim_loop(&o, &s).map_err(|e| e.to_string()));
    std::thread::sleep(Duration::from_millis(200));
    let began = Instant::now();
    let form = format!("token={token}&status=failed&destination=x&confirm=yes");
    let response = router
        .clone()
        .oneshot(
            Request::post("/outbox/retry-matching")
                .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                .body(Body::from(form))?,
        )
        .await?;
    let took = began.elapsed();
    assert_eq!(response.status(), StatusCode::OK);
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let busy = claims.join().expect("no panic")?;
    let c = outbox.counts()?;
    assert_eq!(c.failed, 0, "every failed entry retried");
    println!(
        "  retry all matching: {failed} entries in {:.2} s ({:.0} entries/s; a commit per entry: {one_by_one:.0} entries/s)",
        took.as_secs_f64(),
        failed as f64 / took.as_secs_f64()
    );
    let worst = |s: &[Duration]| s.iter().max().copied().unwrap_or_default();
    let (q50, q99) = p50_p99(quiet.clone());
    let (b50, b99) = p50_p99(busy.clone());
    println!(
        "  claims of 16 beside it:   p50 {:>6.2} ms  p99 {:>6.2} ms  worst {:>6.2} ms  ({} claims; target: worst <= 100 ms)",
        ms(b50),
        ms(b99),
        ms(worst(&busy)),
        busy.len()
    );
    println!(
        "  claims of 16 alone:       p50 {:>6.2} ms  p99 {:>6.2} ms  worst {:>6.2} ms  ({} claims)",
        ms(q50),
        ms(q99),
        ms(worst(&quiet)),
        quiet.len()
    );
    Ok(())
}
