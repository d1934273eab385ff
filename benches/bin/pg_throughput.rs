//! The PostgreSQL backend beside hand-written SQL through the same kind of
//! pool, one run, medians of 3.
//!
//! ```text
//! .ci/postgres run -- cargo run --release -p idemstore-benches --features postgres \
//!     --bin pg_throughput            # add `-- --quick` for shorter runs,
//!                                    # `-- --drain-only` for the drain alone,
//!                                    # `-- --single` for one caller alone
//! ```
//!
//! - durable inbox claims at 1/16/64 threads: `PgInbox::claim` vs a raw
//!   `INSERT … ON CONFLICT DO NOTHING` (one round trip each; an r2d2 pool of
//!   plain clients, no test on checkout); and from 256 tasks on a 2-worker
//!   runtime through `claim_async`, on a pool of 64 as the 64 threads;
//! - `claim_due(100)` with 200k vs 5k entries pending;
//! - draining 20k entries with a `Dispatcher` of 4 workers over a `PgOutbox`
//!   (sending nothing) vs a hand-rolled `UPDATE … WHERE id IN
//!   (SELECT … FOR UPDATE SKIP LOCKED) RETURNING` and `UPDATE … SET status =
//!   'completed'` loop on a copy of the same tables, and vs a hand-rolled
//!   loop running the `Dispatcher`'s own statements in its shape (the
//!   completions fenced by attempt, whole rows returned, one transaction
//!   per batch), which tells the statements' cost from the dispatcher's;
//!   and the same drain by 3 processes vs 1, and by the async dispatcher
//!   (`start_async`, 4 workers, on a 2-worker runtime).
//!
//! Every figure is measured in this run against the same server, so the
//! ratios are what to read.

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use chrono::Utc;
use idemstore::postgres::PgStore;
use postgres::types::Type;
use postgres::{Client, NoTls};
use r2d2_postgres::PostgresConnectionManager;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const DRAIN: i64 = 20_000;
const BATCH: usize = 32;

fn main() -> R<()> {
    let args: Vec<String> = std::env::args().collect();
    let url = std::env::var("IDEMSTORE_TEST_POSTGRES")
        .map_err(|_| "set IDEMSTORE_TEST_POSTGRES (see .ci/postgres)")?;
    if args.get(1).map(String::as_str) == Some("--drain-child") {
        let secs = drain_ours(&url, &args[2], args[3].parse()?)?;
        println!("{secs}");
        return Ok(());
    }
    // One drain, for a profiler: `--drain-one ours|tasks|lean|fenced
    // SCHEMA` creates SCHEMA if it is missing (with the `raw_due` index the
    // hand-rolled loops need), fills it, and drains it once.
    if args.get(1).map(String::as_str) == Some("--drain-one") {
        let schema = &args[3];
        PgStore::builder().schema(schema).connect(&url)?;
        Client::connect(&url, NoTls)?.batch_execute(&format!(
            "CREATE INDEX IF NOT EXISTS raw_due ON {schema}.outbox \
             ((coalesce(next_attempt_at, created_at)), id) WHERE status = 'pending'"
        ))?;
        fill(&url, schema, DRAIN)?;
        let secs = match args[2].as_str() {
            "ours" => drain_ours(&url, schema, 4)?,
            "tasks" => drain_tasks(&url, schema, 4)?,
            "lean" => drain_raw(&url, schema, 4, Shape::Lean)?,
            "fenced" => drain_raw(&url, schema, 4, Shape::Fenced)?,
            other => return Err(format!("no drain {other:?}").into()),
        };
        println!("{:.0} entries/s", DRAIN as f64 / secs);
        return Ok(());
    }
    let quick = args.iter().any(|a| a == "--quick");
    let run_for = Duration::from_millis(if quick { 500 } else { 2000 });
    let tag = format!("{}", std::process::id());
    let mut admin = Client::connect(&url, NoTls)?;

    println!(
        "PostgreSQL backend, medians of 3 ({} s per claim cell)\n",
        run_for.as_secs_f64()
    );
    if !args.iter().any(|a| a == "--drain-only") {
        println!("durable inbox claims per second");
        println!(
            "{:>8} | {:>12} | {:>12} | {:>7}",
            "threads", "idemstore", "raw INSERT", "ratio"
        );
        println!("{}", "-".repeat(50));
        // `--single`: the one-caller row only (the latency of one call).
        let rows: &[usize] = if args.iter().any(|a| a == "--single") {
            &[1]
        } else {
            &[1, 16, 64]
        };
        for &threads in rows {
            let schema = format!("bench_claims_{tag}_{threads}");
            let ours = median3(|| claims_ours(&url, &schema, threads, run_for))?;
            let raw = median3(|| claims_raw(&url, &schema, threads, run_for))?;
            println!(
                "{threads:>8} | {ours:>12.0} | {raw:>12.0} | {:>6.2}×",
                ours / raw
            );
            admin.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))?;
        }
        if rows.len() == 1 {
            return Ok(());
        }
        let schema = format!("bench_claims_{tag}_tasks");
        let threads = median3(|| claims_ours(&url, &schema, 64, run_for))?;
        let tasks = median3(|| claims_tasks(&url, &schema, 256, 64, run_for))?;
        println!(
            "{:>8} | {tasks:>12.0} | {:>12} | {:>6.2}× 64 threads ({threads:.0})",
            "256 tasks",
            "",
            tasks / threads
        );
        admin.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))?;

        println!("\nclaim_due(100), ms per call");
        let schema = format!("bench_due_{tag}");
        let small = median3(|| claim_due_ms(&url, &schema, 5_000))?;
        let large = median3(|| claim_due_ms(&url, &schema, 200_000))?;
        println!("{:>16} | {:>8.3}", "5k pending", small);
        println!("{:>16} | {:>8.3}", "200k pending", large);
        println!("{:>16} | {:>7.2}×", "200k / 5k", large / small);
        admin.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))?;
    }

    drain_figures(&url, &tag, &mut admin)
}

/// The drains (see the module docs).
fn drain_figures(url: &str, tag: &str, admin: &mut Client) -> R<()> {
    let url = url.to_owned();
    println!("\ndrain of {DRAIN} entries, batches of {BATCH}, entries per second");
    let schema = format!("bench_drain_{tag}");
    PgStore::builder().schema(&schema).connect(&url)?;
    let ours = median3(|| {
        fill(&url, &schema, DRAIN)?;
        Ok(DRAIN as f64 / drain_ours(&url, &schema, 4)?)
    })?;
    let tasks = median3(|| {
        fill(&url, &schema, DRAIN)?;
        Ok(DRAIN as f64 / drain_tasks(&url, &schema, 4)?)
    })?;
    // The hand-rolled loops take the earliest due entries, by the due index
    // such a queue has (idemstore's own tables have none: their queue
    // index is by destination and priority).
    admin.batch_execute(&format!(
        "CREATE INDEX raw_due ON {schema}.outbox ((coalesce(next_attempt_at, created_at)), id) \
         WHERE status = 'pending'"
    ))?;
    let raw = median3(|| {
        fill(&url, &schema, DRAIN)?;
        Ok(DRAIN as f64 / drain_raw(&url, &schema, 4, Shape::Lean)?)
    })?;
    let fenced = median3(|| {
        fill(&url, &schema, DRAIN)?;
        Ok(DRAIN as f64 / drain_raw(&url, &schema, 4, Shape::Fenced)?)
    })?;
    admin.batch_execute(&format!("DROP INDEX {schema}.raw_due"))?;
    let procs = median3(|| {
        fill(&url, &schema, DRAIN)?;
        let exe = std::env::current_exe()?;
        let start = Instant::now();
        let children = (0..3)
            .map(|_| {
                Command::new(&exe)
                    .args(["--drain-child", &schema, "4"])
                    .stdout(std::process::Stdio::null())
                    .spawn()
            })
            .collect::<Result<Vec<_>, _>>()?;
        for mut c in children {
            if !c.wait()?.success() {
                return Err("a drain child failed".into());
            }
        }
        Ok(DRAIN as f64 / start.elapsed().as_secs_f64())
    })?;
    println!("{:>42} | {ours:>9.0}", "idemstore Dispatcher, 4 workers");
    println!(
        "{:>42} | {tasks:>9.0}",
        "idemstore async dispatcher, 4 workers"
    );
    println!("{:>42} | {:>8.2}×", "async / threads", tasks / ours);
    println!("{:>42} | {raw:>9.0}", "hand-rolled SKIP LOCKED, 4 workers");
    println!("{:>42} | {:>8.2}×", "ratio", ours / raw);
    println!(
        "{:>42} | {fenced:>9.0}",
        "hand-rolled, the Dispatcher's statements"
    );
    println!("{:>42} | {:>8.2}×", "ratio", ours / fenced);
    println!(
        "{:>42} | {procs:>9.0}",
        "idemstore Dispatcher, 3 processes × 4"
    );
    println!("{:>42} | {:>8.2}×", "3 processes / 1", procs / ours);
    admin.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))?;
    Ok(())
}

fn median3(mut f: impl FnMut() -> R<f64>) -> R<f64> {
    let mut v = [f()?, f()?, f()?];
    v.sort_by(f64::total_cmp);
    Ok(v[1])
}

/// Runs `op(thread, i)` on `threads` threads for `run_for`; ops per second.
fn per_second(
    threads: usize,
    run_for: Duration,
    op: impl Fn(usize, u64) -> R<()> + Sync,
) -> R<f64> {
    let done = AtomicU64::new(0);
    let barrier = Barrier::new(threads);
    let start = Instant::now();
    std::thread::scope(|s| -> R<()> {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (op, done, barrier) = (&op, &done, &barrier);
                s.spawn(move || -> R<()> {
                    barrier.wait();
                    let begin = Instant::now();
                    let mut i = 0;
                    while begin.elapsed() < run_for {
                        op(t, i)?;
                        i += 1;
                    }
                    done.fetch_add(i, Ordering::Relaxed);
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| "a thread panicked")??;
        }
        Ok(())
    })?;
    Ok(done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64())
}

static RUN: AtomicU64 = AtomicU64::new(0);

fn claims_ours(url: &str, schema: &str, threads: usize, run_for: Duration) -> R<f64> {
    let store = PgStore::builder()
        .schema(schema)
        .pool_size(u32::try_from(threads)?)
        .connect(url)?;
    let inbox = store.inbox("bench")?;
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    let now = Utc::now();
    per_second(threads, run_for, |t, i| {
        inbox.claim(&format!("o{run}-{t}-{i}"), now)?;
        Ok(())
    })
}

fn claims_raw(url: &str, schema: &str, threads: usize, run_for: Duration) -> R<f64> {
    let pool = r2d2::Pool::builder()
        .max_size(u32::try_from(threads)?)
        .test_on_check_out(false)
        .build(PostgresConnectionManager::new(url.parse()?, NoTls))?;
    let sql = format!(
        "INSERT INTO {schema}.inbox (inbox, event_key, seen_at) VALUES ($1, $2, $3) \
         ON CONFLICT DO NOTHING"
    );
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    let now = Utc::now().timestamp_micros();
    per_second(threads, run_for, |t, i| {
        let mut c = pool.get()?;
        let key = format!("r{run}-{t}-{i}");
        // One round trip: parameters typed here, no prepare.
        c.query_typed(
            &sql,
            &[
                (&"bench", Type::TEXT),
                (&key.as_bytes(), Type::BYTEA),
                (&now, Type::INT8),
            ],
        )?;
        Ok(())
    })
}

/// Fills `schema`'s outbox with `n` due pending entries (after emptying it).
fn fill(url: &str, schema: &str, n: i64) -> R<()> {
    let mut c = Client::connect(url, NoTls)?;
    c.batch_execute(&format!("TRUNCATE {schema}.outbox CASCADE"))?;
    c.execute(
        &format!(
            "INSERT INTO {schema}.outbox (command_id, destination, idempotency_key, payload, \
             status, attempt_count, created_at) \
             SELECT 'c'::bytea, 'mailer'::bytea, convert_to('k' || g, 'UTF8'), '\\x00'::bytea, \
                    'pending', 0, g FROM generate_series(1, $1::bigint) g"
        ),
        &[&n],
    )?;
    c.batch_execute(&format!("VACUUM ANALYZE {schema}.outbox"))?;
    Ok(())
}

/// Median ms of 20 `claim_due(100)` calls with `pending` entries due.
fn claim_due_ms(url: &str, schema: &str, pending: i64) -> R<f64> {
    let store = PgStore::builder()
        .schema(schema)
        .pool_size(1)
        .connect(url)?;
    fill(url, schema, pending)?;
    let outbox = store.outbox();
    let now = Utc::now();
    outbox.claim_due(now, 100, "warm")?;
    let mut ms = Vec::new();
    for _ in 0..20 {
        let start = Instant::now();
        let got = outbox.claim_due(now, 100, "w")?;
        ms.push(start.elapsed().as_secs_f64() * 1e3);
        assert_eq!(got.len(), 100);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

/// Drains `schema`'s outbox with a `Dispatcher` of `workers` threads
/// (sending nothing, completing every entry), until nothing is due and
/// none of its sends is under way; seconds. Asks the server only for the
/// earliest due time (one index lookup), and only once its own sends
/// paused for 2 ms.
fn drain_ours(url: &str, schema: &str, workers: usize) -> R<f64> {
    let store = PgStore::builder()
        .schema(schema)
        .pool_size(u32::try_from(workers + 2)?)
        .connect(url)?;
    let outbox = store.outbox();
    let sent = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let dispatcher = {
        let sent = sent.clone();
        idemstore::Dispatcher::builder(outbox.clone())
            .workers(workers)
            .batch_size(BATCH)
            .worker_id(format!("w{}", std::process::id()))
            .start(move |_| {
                sent.fetch_add(1, Ordering::Relaxed);
                idemstore::Delivery::Delivered
            })?
    };
    let mut last = u64::MAX;
    loop {
        std::thread::sleep(Duration::from_millis(2));
        let now = sent.load(Ordering::Relaxed);
        // Still sending: no need to ask the server.
        if now != last {
            last = now;
            continue;
        }
        // Nothing due, and every send of ours settled.
        if outbox.next_due()?.is_none() && dispatcher.stats().delivered == now {
            break;
        }
    }
    let took = start.elapsed().as_secs_f64();
    dispatcher.shutdown()?;
    Ok(took)
}

/// Claims from `tasks` tasks on a 2-worker runtime through `claim_async`
/// for `run_for`, on a pool of `pool`; claims per second.
fn claims_tasks(url: &str, schema: &str, tasks: usize, pool: u32, run_for: Duration) -> R<f64> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let store = PgStore::builder()
            .schema(schema)
            .pool_size(pool)
            .connect_async(url)
            .await?;
        let inbox = store.inbox("bench")?;
        let run = RUN.fetch_add(1, Ordering::Relaxed);
        let now = Utc::now();
        let done = Arc::new(AtomicU64::new(0));
        let start = Instant::now();
        let handles: Vec<_> = (0..tasks)
            .map(|t| {
                let (inbox, done) = (inbox.clone(), done.clone());
                tokio::spawn(async move {
                    let mut i = 0;
                    while start.elapsed() < run_for {
                        inbox.claim_async(&format!("a{run}-{t}-{i}"), now).await?;
                        i += 1;
                    }
                    done.fetch_add(i, Ordering::Relaxed);
                    Ok::<_, idemstore::Error>(())
                })
            })
            .collect();
        for h in handles {
            h.await??;
        }
        Ok(done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64())
    })
}

/// [`drain_ours`] by the async dispatcher (`start_async`, `workers`
/// workers) on a 2-worker runtime; seconds.
fn drain_tasks(url: &str, schema: &str, workers: usize) -> R<f64> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let store = PgStore::builder()
            .schema(schema)
            .pool_size(u32::try_from(workers + 2)?)
            .connect_async(url)
            .await?;
        let outbox = store.outbox();
        let sent = Arc::new(AtomicU64::new(0));
        let start = Instant::now();
        let dispatcher = {
            let sent = sent.clone();
            idemstore::Dispatcher::builder(outbox.clone())
                .workers(workers)
                .batch_size(BATCH)
                .worker_id(format!("t{}", std::process::id()))
                .start_async(move |_| {
                    sent.fetch_add(1, Ordering::Relaxed);
                    std::future::ready(idemstore::Delivery::Delivered)
                })?
        };
        let mut last = u64::MAX;
        loop {
            tokio::time::sleep(Duration::from_millis(2)).await;
            let now = sent.load(Ordering::Relaxed);
            if now != last {
                last = now;
                continue;
            }
            if outbox.next_due_async().await?.is_none() && dispatcher.stats().delivered == now {
                break;
            }
        }
        let took = start.elapsed().as_secs_f64();
        dispatcher.shutdown().await?;
        Ok(took)
    })
}

/// How a hand-rolled drain talks to the server.
#[derive(Clone, Copy)]
enum Shape {
    /// The usual loop: claim a batch with `SKIP LOCKED` returning `id,
    /// payload`, then complete it by id, each statement committing alone.
    Lean,
    /// The `Dispatcher`'s statements in its shape: one transaction completes
    /// the last batch, each row checked against its attempt, and claims the
    /// next, returning whole rows.
    Fenced,
}

/// The same drain by hand, shaped as `shape`; seconds.
fn drain_raw(url: &str, schema: &str, workers: usize, shape: Shape) -> R<f64> {
    let pool = Arc::new(
        r2d2::Pool::builder()
            .max_size(u32::try_from(workers)?)
            .test_on_check_out(false)
            .build(PostgresConnectionManager::new(url.parse()?, NoTls))?,
    );
    let (returning, attempt) = match shape {
        Shape::Lean => ("id, payload", "attempt_count + 1"),
        Shape::Fenced => (
            "id, command_id, destination, idempotency_key, payload, status, attempt_count, \
             next_attempt_at, created_at, completed_at, worker_id, claimed_at, last_failure, \
             remote_ref",
            "LEAST(attempt_count + 1, 4294967295)",
        ),
    };
    let claim = format!(
        "UPDATE {schema}.outbox SET status = 'dispatching', attempt_count = {attempt}, \
         worker_id = $3, claimed_at = $1 \
         WHERE id IN (SELECT id FROM {schema}.outbox \
             WHERE status = 'pending' AND coalesce(next_attempt_at, created_at) <= $1 \
             ORDER BY coalesce(next_attempt_at, created_at), id LIMIT $2 \
             FOR UPDATE SKIP LOCKED) \
         RETURNING {returning}"
    );
    let complete = match shape {
        Shape::Lean => format!(
            "UPDATE {schema}.outbox SET status = 'completed', completed_at = $2, \
             worker_id = NULL, claimed_at = NULL WHERE id = ANY($1)"
        ),
        Shape::Fenced => format!(
            "UPDATE {schema}.outbox o SET status = 'completed', completed_at = f.at, \
             next_attempt_at = NULL, worker_id = NULL, claimed_at = NULL \
             FROM unnest($1::bigint[], $2::bigint[], $3::bigint[]) AS f(id, fence, at) \
             WHERE o.id = f.id AND o.attempt_count = f.fence \
             AND o.status IN ('dispatching', 'outcome_unknown') RETURNING o.id"
        ),
    };
    let start = Instant::now();
    std::thread::scope(|s| -> R<()> {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let (pool, claim, complete) = (pool.clone(), &claim, &complete);
                s.spawn(move || -> R<()> {
                    let worker = format!("raw-{w}").into_bytes();
                    let limit = i64::try_from(BATCH)?;
                    // Statements are per connection: the worker keeps one.
                    let mut c = pool.get()?;
                    let (claim, complete) = (c.prepare(claim)?, c.prepare(complete)?);
                    // The batch claimed last, with each entry's attempt.
                    let (mut ids, mut attempts) = (Vec::<i64>::new(), Vec::<i64>::new());
                    loop {
                        let now = Utc::now().timestamp_micros();
                        let rows = match shape {
                            Shape::Lean => {
                                if !ids.is_empty() {
                                    c.execute(&complete, &[&ids, &now])?;
                                }
                                c.query(&claim, &[&now, &limit, &worker])?
                            }
                            Shape::Fenced => {
                                let mut tx = c.transaction()?;
                                if !ids.is_empty() {
                                    let times = vec![now; ids.len()];
                                    tx.query(&complete, &[&ids, &attempts, &times])?;
                                }
                                let rows = tx.query(&claim, &[&now, &limit, &worker])?;
                                tx.commit()?;
                                rows
                            }
                        };
                        if rows.is_empty() {
                            return Ok(());
                        }
                        ids = rows.iter().map(|r| r.get(0)).collect();
                        if let Shape::Fenced = shape {
                            attempts = rows.iter().map(|r| r.get(6)).collect();
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| "a worker panicked")??;
        }
        Ok(())
    })?;
    Ok(start.elapsed().as_secs_f64())
}
