//! The contract suite (`tests/contract/`) on PostgreSQL, and what only the
//! server backend has: migrations, connection errors, wake-ups across
//! processes, the server's errors inside effects.
//!
//! The server is named by `IDEMSTORE_TEST_POSTGRES` (a libpq connection
//! string; `.ci/postgres run -- cargo test --features postgres --test
//! contract_pg` starts a throwaway one). Without it every test says so and
//! passes, except under `CI=true`, where its absence fails them. Each test
//! works in a schema of its own, dropped at its end, so tests run in
//! parallel on one database.

#[macro_use]
#[path = "contract/mod.rs"]
mod contract;

mod common;

#[path = "contract/pg.rs"]
mod app;

#[cfg(all(feature = "tracing", feature = "metrics"))]
#[path = "../src/observe/capture.rs"]
mod capture;

mod fixture {
    use idemstore::Result;
    use idemstore::postgres::Transaction;
    use idemstore::postgres::{PgOutbox, PgStore};
    use postgres::{Client, NoTls};

    use crate::app;
    pub(crate) use crate::common::pg::{unique_schema, url};

    pub(crate) type Db = PgStore;
    pub(crate) type Ob = PgOutbox;

    /// A store in a fresh schema, dropped with everything in it at the end.
    pub(crate) struct Fixture {
        pub(crate) store: Db,
        pub(crate) url: String,
        pub(crate) schema: String,
    }

    impl Fixture {
        pub(crate) fn open() -> Option<Fixture> {
            let url = url()?;
            let schema = unique_schema();
            let store = PgStore::builder()
                .schema(&schema)
                .pool_size(4)
                .connect(&url)
                .expect("connect to the test server");
            app::create_marks(&url, &schema);
            Some(Fixture { store, url, schema })
        }

        /// The store, for the operator's calls.
        pub(crate) fn admin(&self) -> &Db {
            &self.store
        }

        /// A second store on the same schema, with its own pool: what
        /// another process would open.
        pub(crate) fn another(&self) -> Db {
            PgStore::builder()
                .schema(&self.schema)
                .pool_size(4)
                .connect(&self.url)
                .expect("connect again")
        }

        /// A plain connection to the server.
        pub(crate) fn client(&self) -> Client {
            crate::common::pg::client(&self.url)
        }

        /// Writes the application row `key` in `tx`.
        pub(crate) fn mark(&self, tx: &mut Transaction<'_>, key: &str) -> Result<()> {
            app::mark(tx, &self.schema, key)
        }

        /// The application rows committed, in key order.
        pub(crate) fn marks(&self) -> Result<Vec<String>> {
            app::marks(&self.url, &self.schema)
        }

        /// How many transactions updated or deleted rows of the outbox or
        /// the inbox while `f` ran.
        pub(crate) fn commits_during<T>(&self, f: impl FnOnce() -> T) -> Result<(T, u64)> {
            app::commits_during(&self.url, &self.schema, f)
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            if let Ok(mut client) = Client::connect(&self.url, NoTls) {
                let _ = client.batch_execute(&format!("DROP SCHEMA {} CASCADE", self.schema));
            }
        }
    }
}

use contract::*;
use fixture::*;

contract_suite!();

/// What only the server backend has.
mod server {
    use std::time::Duration;

    use idemstore::postgres::{PgStore, SCHEMA_VERSION};
    use idemstore::{Claim, Error};

    use super::*;

    #[test]
    fn connecting_checks_the_schema_name_and_the_connection_string() {
        let Some(url) = url() else { return };
        for bad in ["Idem", "a-b", "pg_x", "", "1a"] {
            let out = PgStore::builder().schema(bad).connect(&url);
            assert!(
                matches!(
                    out,
                    Err(Error::InvalidInput {
                        field: "schema",
                        ..
                    })
                ),
                "{bad:?}: {out:?}"
            );
        }
        let out = PgStore::builder().schema(&"a".repeat(49)).connect(&url);
        assert!(matches!(out, Err(Error::TooLarge { .. })), "{out:?}");
        // Reserved keywords would make every statement a syntax error.
        for keyword in ["user", "select", "order", "current_user", "join"] {
            let out = PgStore::builder().schema(keyword).connect(&url);
            let Err(Error::InvalidInput {
                field: "schema",
                reason,
            }) = out
            else {
                panic!("{keyword:?}: {out:?}");
            };
            assert!(reason.contains(keyword), "{reason}");
        }
        let out = PgStore::connect("host=/tmp port=notaport");
        assert!(
            matches!(
                out,
                Err(Error::InvalidInput {
                    field: "connection string",
                    ..
                })
            ),
            "{out:?}"
        );
    }

    #[test]
    fn an_unreachable_server_is_an_error_not_a_hang() {
        if url().is_none() {
            return;
        }
        let started = std::time::Instant::now();
        let out = PgStore::builder()
            .connection_timeout(Duration::from_secs(2))
            .connect("host=/nonexistent/idemstore user=nobody dbname=nothing");
        let Err(e @ Error::Postgres { .. }) = out else {
            panic!("{out:?}");
        };
        assert!(e.is_storage());
        assert!(e.to_string().contains("PostgreSQL error"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn processes_connecting_at_once_migrate_once() -> TestResult {
        let Some(url) = url() else { return Ok(()) };
        let schema = unique_schema();
        let stores = std::thread::scope(|s| {
            let handles: Vec<_> = (0..6)
                .map(|_| {
                    s.spawn(|| {
                        PgStore::builder()
                            .schema(&schema)
                            .pool_size(1)
                            .connect(&url)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("no panic"))
                .collect::<Result<Vec<_>, _>>()
        });
        let result = (|| -> TestResult {
            let stores = stores?;
            let mut client = postgres::Client::connect(&url, postgres::NoTls)?;
            let version: i64 = client
                .query_one(&format!("SELECT version FROM {schema}.schema_version"), &[])?
                .get(0);
            assert_eq!(u64::try_from(version)?, SCHEMA_VERSION);
            // Every store works on the one schema.
            for (i, store) in stores.iter().enumerate() {
                assert!(store.inbox("i")?.claim(&format!("k{i}"), t(0))?);
            }
            assert_eq!(stores[0].inbox("i")?.len()?, 6);
            assert_eq!(stores[0].schema(), schema);
            Ok(())
        })();
        if let Ok(mut client) = postgres::Client::connect(&url, postgres::NoTls) {
            client.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))?;
        }
        result
    }

    #[test]
    fn a_schema_from_a_newer_version_is_refused() -> TestResult {
        let f = fixture!();
        f.client().batch_execute(&format!(
            "UPDATE {}.schema_version SET version = 99",
            f.schema
        ))?;
        let out = PgStore::builder().schema(&f.schema).connect(&f.url);
        let Err(Error::IncompatibleFormat { found, supported }) = out else {
            panic!("{out:?}");
        };
        assert_eq!(supported, SCHEMA_VERSION);
        assert!(found.contains("99"), "{found}");
        Ok(())
    }

    #[test]
    fn a_server_error_in_an_effect_rolls_back_and_keeps_the_servers_words() -> TestResult {
        let f = fixture!();
        let inbox = f.store.inbox("i")?;
        let out = inbox.claim_with("evt-1", t(0), |tx| {
            f.mark(tx, "before")?;
            tx.execute("SELECT 1 / 0", &[])?;
            Ok::<_, Error>(())
        });
        let Err(Error::Postgres { code, message, .. }) = out else {
            panic!("{out:?}");
        };
        assert_eq!(code.as_deref(), Some("22012"), "division_by_zero");
        assert!(message.contains("division by zero"), "{message}");
        assert!(!inbox.seen("evt-1")?);
        assert_eq!(f.marks()?, Vec::<String>::new());
        assert_eq!(
            inbox.claim_with("evt-1", t(1), |tx| f.mark(tx, "after"))?,
            Claim::Applied(())
        );
        Ok(())
    }

    #[test]
    fn inbox_names_come_in_byte_order_whatever_the_collation() -> TestResult {
        let f = fixture!();
        // What a database created with an ICU collation would hold: `a`
        // before `B`, `_` ignored.
        f.client().batch_execute(&format!(
            "ALTER TABLE {}.inbox ALTER COLUMN inbox TYPE text COLLATE \"en-US-x-icu\"",
            f.schema
        ))?;
        for name in ["a", "B", "_z", "Z", "b-1", "b.0"] {
            assert!(f.store.inbox(name)?.claim("k", t(0))?);
        }
        assert_eq!(f.store.inbox_names()?, ["B", "Z", "_z", "a", "b-1", "b.0"]);
        Ok(())
    }

    #[test]
    fn get_inside_a_write_reads_an_expired_record_as_absent_and_leaves_it() -> TestResult {
        let f = fixture!();
        let keys = f.store.idempotency_keys();
        let record = idemstore::ResponseRecord::new(
            "t",
            "old",
            idemstore::fingerprint("POST", "/r", b""),
            201,
            b"o".to_vec(),
            t(5),
        );
        assert!(keys.put(&record)?);
        let inside = f.store.write(|_| {
            Ok::<_, Error>((keys.get("t", "old", t(6))?, keys.get("t", "old", t(5))?))
        })?;
        assert_eq!(inside, (None, Some(record.clone())));
        assert_eq!(keys.response("t", "old")?, Some(record), "left in place");
        // Outside a write, the same read deletes it.
        assert_eq!(keys.get("t", "old", t(6))?, None);
        assert_eq!(keys.response("t", "old")?, None);
        Ok(())
    }

    /// The `25P02` of a transaction the server aborted.
    fn assert_aborted<T: std::fmt::Debug>(out: Result<T, Error>) {
        let Err(Error::Postgres { code, message, .. }) = out else {
            panic!("{out:?}");
        };
        assert_eq!(code.as_deref(), Some("25P02"), "in_failed_sql_transaction");
        assert!(message.contains("transaction is aborted"), "{message}");
    }

    #[test]
    fn an_effect_that_swallows_a_failed_statement_commits_nothing_and_says_so() -> TestResult {
        let f = fixture!();
        let inbox = f.store.inbox("i")?;
        let out = inbox.claim_with("evt-1", t(0), |tx| {
            f.mark(tx, "before")?;
            let _ = tx.execute("SELECT 1/0", &[]);
            Ok::<_, Error>(())
        });
        assert_aborted(out);
        assert!(!inbox.seen("evt-1")?);
        assert_eq!(f.marks()?, Vec::<String>::new());
        // The next delivery runs the effect, on a connection as good as new.
        for _ in 0..4 {
            inbox.claim("other", t(1))?;
        }
        assert_eq!(
            inbox.claim_with("evt-1", t(1), |tx| f.mark(tx, "after"))?,
            Claim::Applied(())
        );
        assert_eq!(f.marks()?, ["after"]);
        Ok(())
    }

    #[test]
    fn a_write_that_swallows_a_failed_statement_commits_nothing_and_says_so() -> TestResult {
        let f = fixture!();
        let inbox = f.store.inbox("i")?;
        let out = f.store.write(|tx| {
            inbox.claim_in(tx, "evt-1", t(0))?;
            f.mark(tx, "before")?;
            let _ = tx.execute("SELECT 1/0", &[]);
            Ok::<_, Error>(7)
        });
        assert_aborted(out);
        assert!(!inbox.seen("evt-1")?);
        assert_eq!(f.marks()?, Vec::<String>::new());
        // A failure inside a savepoint leaves the transaction usable.
        let out = f.store.write(|tx| {
            let mut sp = tx.transaction()?;
            assert!(sp.execute("SELECT 1/0", &[]).is_err());
            drop(sp);
            f.mark(tx, "after")?;
            Ok::<_, Error>(7)
        })?;
        assert_eq!(out, 7);
        assert_eq!(f.marks()?, ["after"]);
        Ok(())
    }

    #[test]
    fn a_row_edited_into_nonsense_is_corrupted_and_a_claim_takes_nothing() -> TestResult {
        let f = fixture!();
        let outbox = f.store.outbox();
        let good = outbox.enqueue(entry("c", "d", "good"), t(0))?.id();
        let bad = outbox.enqueue(entry("c", "d", "bad"), t(0))?.id();
        let id = i64::try_from(bad.0)?;
        f.client().execute(
            &format!(
                "UPDATE {}.outbox SET command_id = '\\xff'::bytea WHERE id = $1",
                f.schema
            ),
            &[&id],
        )?;
        let out = outbox.claim_due(t(1), 10, "w");
        assert!(matches!(out, Err(Error::Corrupted { .. })), "{out:?}");
        assert_eq!(outbox.counts()?.pending, 2, "nothing was claimed");
        assert!(matches!(outbox.get(bad), Err(Error::Corrupted { .. })));
        assert_eq!(
            outbox.get(good)?.entry.status,
            idemstore::OutboxStatus::Pending
        );
        let findings = outbox.check_indexes()?;
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert!(findings[0].contains("not UTF-8"), "{findings:?}");
        Ok(())
    }

    #[test]
    fn an_enqueue_in_another_process_wakes_this_ones_subscribers_at_commit() -> TestResult {
        let f = fixture!();
        let wake = f.store.outbox().subscribe();
        // The listener signals once it listens.
        assert!(
            wake.recv_timeout(Duration::from_secs(10)).is_ok(),
            "listening"
        );
        while wake.try_recv().is_ok() {}
        let other = f.another();
        let outbox = other.outbox();
        // A rolled-back enqueue notifies nobody.
        let out = other.write(|tx| {
            outbox.enqueue_in(tx, entry("c", "d", "k"), t(0))?;
            Err::<(), _>(AppError::Refused)
        });
        assert!(matches!(out, Err(AppError::Refused)));
        assert!(
            wake.recv_timeout(Duration::from_millis(500)).is_err(),
            "no signal"
        );
        // A committed one does, whatever process made it.
        other.write(|tx| outbox.enqueue_in(tx, entry("c", "d", "k"), t(0)))?;
        assert!(
            wake.recv_timeout(Duration::from_secs(10)).is_ok(),
            "woken by the commit"
        );
        // So does a retry that makes an entry due again.
        let claimed = outbox.claim_due(t(1), 1, "w")?;
        while wake.try_recv().is_ok() {}
        outbox.settle(
            claimed[0].fence(),
            idemstore::Settlement::Failed {
                reason: "http_503".into(),
                next_attempt_at: Some(t(2)),
            },
            t(1),
        )?;
        drop(other);
        assert!(
            wake.recv_timeout(Duration::from_secs(10)).is_ok(),
            "woken by the retry"
        );
        Ok(())
    }
}

/// The metrics of the PostgreSQL backend mean what they mean on the
/// embedded store (`tests/observe.rs`): read back from a recorder installed
/// for the test's own thread, where the store's calls report.
#[cfg(all(feature = "tracing", feature = "metrics"))]
mod metrics_pg {
    use chrono::{DateTime, TimeZone as _, Utc};
    use idemstore::{Begin, Error, NewEntry, fingerprint};

    use super::*;
    use crate::capture::Metrics;

    fn t(secs: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
    }

    #[test]
    fn claims_in_a_write_are_counted_once_committed() -> TestResult {
        let Some(f) = Fixture::open() else {
            return Ok(());
        };
        let m = Metrics::default();
        let inbox = f.store.inbox("events")?;
        let claims = || m.counter("idemstore_inbox_claims_total", &[("inbox", "events")]);
        let duplicates = || m.counter("idemstore_inbox_duplicates_total", &[("inbox", "events")]);
        metrics::with_local_recorder(&m, || -> TestResult {
            let rolled_back = f.store.write(|tx| {
                assert!(inbox.claim_in(tx, "a", t(0))?);
                Err::<(), _>(Error::NotFound)
            });
            assert!(matches!(rolled_back, Err(Error::NotFound)));
            assert_eq!(claims(), None, "rolled back: not counted");
            assert!(f.store.write(|tx| inbox.claim_in(tx, "a", t(0)))?);
            assert_eq!(claims(), Some(1));
            assert!(!f.store.write(|tx| inbox.claim_in(tx, "a", t(0)))?);
            assert_eq!(duplicates(), Some(1));
            Ok(())
        })
    }

    #[test]
    fn a_completion_in_a_write_counts_once_committed_and_a_repeat_is_not_fenced_out() -> TestResult
    {
        let Some(f) = Fixture::open() else {
            return Ok(());
        };
        let m = Metrics::default();
        let completions = |outcome| {
            m.counter(
                "idemstore_idempotency_completions_total",
                &[("outcome", outcome)],
            )
        };
        let keys = f.store.idempotency_keys();
        let fp = fingerprint("POST", "/orders", b"1");
        metrics::with_local_recorder(&m, || -> TestResult {
            let Begin::Proceed(r) = keys.begin("", "k1", &fp, t(0))? else {
                panic!("a new key proceeds")
            };
            let rolled_back = f.store.write(|tx| {
                assert!(keys.complete_in(tx, &r, r.response(201, b"ok".to_vec(), t(1)), t(1))?);
                Err::<(), _>(Error::NotFound)
            });
            assert!(matches!(rolled_back, Err(Error::NotFound)));
            assert_eq!(keys.stats().completed, 0, "rolled back: not completed");
            assert_eq!(completions("stored"), None);
            assert!(f.store.write(|tx| keys.complete_in(
                tx,
                &r,
                r.response(201, b"ok".to_vec(), t(2)),
                t(2)
            ))?);
            assert_eq!(keys.stats().completed, 1);
            assert_eq!(completions("stored"), Some(1));
            // Completed again by the same reservation: nobody fenced out.
            assert!(!keys.complete(&r, r.response(500, b"late".to_vec(), t(3)), t(3))?);
            assert_eq!((keys.stats().completed, keys.stats().fenced_out), (1, 0));
            assert_eq!(completions("fenced_out"), None);
            // Taken over: fenced out.
            let Begin::Proceed(stale) = keys.begin("", "k2", &fp, t(10))? else {
                panic!("a new key proceeds")
            };
            assert!(matches!(
                keys.begin("", "k2", &fp, t(100))?,
                Begin::Proceed(_)
            ));
            assert!(!keys.complete(&stale, stale.response(201, b"x".to_vec(), t(101)), t(101))?);
            assert_eq!(keys.stats().fenced_out, 1);
            assert_eq!(completions("fenced_out"), Some(1));
            Ok(())
        })
    }

    #[test]
    fn the_outbox_depth_gauge_is_set_from_the_servers_counts() -> TestResult {
        let Some(f) = Fixture::open() else {
            return Ok(());
        };
        let m = Metrics::default();
        let depth = |status| m.gauge("idemstore_outbox_entries", &[("status", status)]);
        let outbox = f.store.outbox();
        let entry =
            |i: u32| NewEntry::new(format!("c{i}"), "mailer", format!("k{i}"), b"x".to_vec());
        metrics::with_local_recorder(&m, || -> TestResult {
            // The store's first write counts at once.
            outbox.enqueue_many([entry(1), entry(2)], t(0))?;
            assert_eq!(depth("pending"), Some(2.0));
            assert_eq!(depth("dispatching"), Some(0.0));
            assert_eq!(outbox.claim_due(t(1), 1, "w")?.len(), 1);
            // `counts` sets it to what it counted.
            let counts = outbox.counts()?;
            assert_eq!((counts.pending, counts.dispatching), (1, 1));
            assert_eq!(depth("pending"), Some(1.0));
            assert_eq!(depth("dispatching"), Some(1.0));
            assert_eq!(depth("completed"), Some(0.0));
            Ok(())
        })
    }
}

/// Destinations on the server: limits that hold across stores claiming at
/// once, and a schema from before destinations migrated in place.
mod destinations_pg {
    use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
    use std::time::Duration;

    use idemstore::{DestinationPolicy, NewEntry, Settlement};

    use super::*;

    #[test]
    fn a_cap_of_two_holds_with_two_stores_claiming_at_once() -> TestResult {
        let f = fixture!();
        let (a, b) = (f.store.outbox(), f.another().outbox());
        a.set_destination_policy("capped", DestinationPolicy::default().max_in_flight(2))?;
        for i in 0..60 {
            a.enqueue(NewEntry::new("c", "capped", format!("k{i}"), vec![0]), t(0))?;
        }
        let most = AtomicI64::new(0);
        let done = AtomicBool::new(false);
        let total = &AtomicI64::new(0);
        let sql = format!(
            "SELECT count(*) FROM {}.outbox WHERE destination = 'capped' AND status = 'dispatching'",
            f.schema
        );
        std::thread::scope(|s| -> TestResult {
            let watcher = s.spawn(|| -> Result<(), idemstore::Error> {
                let mut client = f.client();
                while !done.load(Ordering::SeqCst) {
                    let n: i64 = client.query_one(&sql, &[])?.get(0);
                    most.fetch_max(n, Ordering::SeqCst);
                }
                Ok(())
            });
            let workers: Vec<_> = [&a, &b]
                .into_iter()
                .enumerate()
                .map(|(w, outbox)| {
                    s.spawn(move || -> Result<usize, idemstore::Error> {
                        // Until every entry is sent, whichever worker the
                        // claims' `SKIP LOCKED` favours.
                        let mut sent = 0;
                        for round in 0..5000 {
                            if total.load(Ordering::SeqCst) >= 60 {
                                break;
                            }
                            let got = outbox.claim_due(t(1 + round), 3, &format!("w{w}"))?;
                            assert!(got.len() <= 2, "{got:?}");
                            for e in got {
                                outbox.settle(e.fence(), Settlement::Completed, t(1 + round))?;
                                sent += 1;
                                total.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                        Ok(sent)
                    })
                })
                .collect();
            let mut sent = 0;
            for w in workers {
                sent += w.join().expect("no panic")?;
            }
            done.store(true, Ordering::SeqCst);
            watcher.join().expect("no panic")?;
            assert_eq!(sent, 60, "every entry sent once");
            Ok(())
        })?;
        let most = most.load(Ordering::SeqCst);
        assert!(most <= 2, "{most} in flight at once, above the cap of 2");
        assert_eq!(a.destination("capped")?.counts.completed, 60);
        Ok(())
    }

    /// Two capped destinations, `a` and `b`, two entries due in each.
    fn two_capped(f: &Fixture) -> Result<Ob, idemstore::Error> {
        let outbox = f.store.outbox();
        for d in ["a", "b"] {
            outbox.set_destination_policy(d, DestinationPolicy::default().max_in_flight(5))?;
            for i in 0..2 {
                outbox.enqueue(NewEntry::new("c", d, format!("{d}{i}"), vec![0]), t(0))?;
            }
        }
        Ok(outbox)
    }

    /// Locks the flow rows of `destinations` in a transaction of `client`
    /// (as a claim or a settlement in another process does).
    fn hold_flows<'c>(
        f: &Fixture,
        client: &'c mut postgres::Client,
        destinations: &[&str],
    ) -> Result<postgres::Transaction<'c>, idemstore::Error> {
        let mut tx = client.transaction()?;
        let names: Vec<&[u8]> = destinations.iter().map(|d| d.as_bytes()).collect();
        let held = tx.query(
            &format!(
                "SELECT destination FROM {}.destinations WHERE destination = ANY($1) FOR UPDATE",
                f.schema
            ),
            &[&names],
        )?;
        assert_eq!(held.len(), destinations.len());
        Ok(tx)
    }

    /// The claim's keys, sorted.
    fn keys(entries: &[idemstore::OutboxEntry]) -> Vec<String> {
        let mut keys: Vec<String> = entries.iter().map(|e| e.idempotency_key.clone()).collect();
        keys.sort();
        keys
    }

    #[test]
    fn a_claim_leaves_a_flow_another_transaction_holds_when_another_gives() -> TestResult {
        let f = fixture!();
        let outbox = two_capped(&f)?;
        let mut client = f.client();
        let held = hold_flows(&f, &mut client, &["a"])?;
        // `a` is another's for now: `b` gives, without waiting for `a`.
        let got = outbox.claim_due(t(1), 8, "w")?;
        assert_eq!(keys(&got), ["b0", "b1"]);
        held.commit()?;
        assert_eq!(keys(&outbox.claim_due(t(1), 8, "w")?), ["a0", "a1"]);
        Ok(())
    }

    #[test]
    fn a_claim_that_would_take_nothing_waits_for_the_flows_another_transaction_holds() -> TestResult
    {
        let f = fixture!();
        let outbox = two_capped(&f)?;
        let mut client = f.client();
        let held = hold_flows(&f, &mut client, &["a", "b"])?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|s| -> TestResult {
            let outbox = &outbox;
            s.spawn(move || tx.send(outbox.claim_due(t(1), 8, "w")));
            // The claim waits for the rows' holder, on the server.
            let mut watcher = f.client();
            let mut waiting = 0;
            // (This schema's statements only: other tests share the server.)
            let waiting_here = format!(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock' AND position('{}.' in query) > 0",
                f.schema
            );
            for _ in 0..500 {
                waiting = watcher.query_one(&waiting_here, &[])?.get::<_, i64>(0);
                if waiting > 0 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            assert_eq!(waiting, 1, "the claim waits for the held flows");
            assert!(
                rx.try_recv().is_err(),
                "the claim answered while both flows were held"
            );
            held.commit()?;
            let got = rx.recv().expect("the claim answers")?;
            assert_eq!(keys(&got), ["a0", "a1", "b0", "b1"]);
            Ok(())
        })?;
        assert_eq!(outbox.destination("a")?.counts.dispatching, 2);
        Ok(())
    }

    #[test]
    fn a_freed_slot_or_the_next_of_a_sequence_wakes_another_processs_dispatchers() -> TestResult {
        let f = fixture!();
        let outbox = f.store.outbox();
        outbox.set_destination_policy("a", DestinationPolicy::default().max_in_flight(1))?;
        outbox.enqueue(NewEntry::new("c", "a", "a0", vec![0]), t(0))?;
        outbox.enqueue(NewEntry::new("c", "a", "a1", vec![0]), t(0))?;
        outbox.enqueue(
            NewEntry::new("c", "s", "s0", vec![0]).ordering_key("k"),
            t(0),
        )?;
        outbox.enqueue(
            NewEntry::new("c", "s", "s1", vec![0]).ordering_key("k"),
            t(0),
        )?;
        let got = outbox.claim_due(t(1), 10, "w")?;
        assert_eq!(got.len(), 2, "{got:?}");
        let other = f.another();
        let wake = other.outbox().subscribe();
        // Whatever arrives as the subscription starts.
        while wake.recv_timeout(Duration::from_millis(300)).is_ok() {}
        for e in &got {
            outbox.settle(e.fence(), Settlement::Completed, t(2))?;
            assert!(
                wake.recv_timeout(Duration::from_secs(10)).is_ok(),
                "woken: the next of {} may go now",
                e.destination
            );
        }
        Ok(())
    }

    /// A small deterministic generator (xorshift), for the random runs.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    /// What a claim answers, comparable across backends: keys, in order,
    /// with their attempts.
    fn claimed(entries: &[idemstore::OutboxEntry]) -> Vec<(String, u32)> {
        entries
            .iter()
            .map(|e| (e.idempotency_key.clone(), e.attempt_count))
            .collect()
    }

    /// The destinations' report, comparable across backends.
    fn report(states: Vec<idemstore::DestinationState>) -> Vec<String> {
        states
            .into_iter()
            .map(|d| {
                format!(
                    "{} {:?} paused={} {:?} held={:?} tokens={:?} in_flight={} {:?}",
                    d.destination,
                    d.policy,
                    d.paused,
                    d.circuit,
                    d.held_until,
                    d.tokens.map(|t| (t * 1e6).round()),
                    d.in_flight,
                    d.counts
                )
            })
            .collect()
    }

    #[test]
    fn random_operations_answer_as_on_the_embedded_store() -> TestResult {
        for seed in [0x9e37_79b9_7f4a_7c15, 0x2545_f491_4f6c_dd1d, 7] {
            random_run(seed)?;
        }
        Ok(())
    }

    /// One random run from `seed` (see above).
    #[expect(
        clippy::too_many_lines,
        reason = "one run: every operation, both backends, side by side"
    )]
    fn random_run(seed: u64) -> TestResult {
        use idemstore::{ClaimRequest, OutboxStatus, Store};
        let Some(fx) = Fixture::open() else {
            return Ok(());
        };
        let pg = fx.store.outbox();
        let store = Store::in_memory()?;
        let em = store.outbox();
        let dests = ["a", "b", "c", "d"];
        let mut rng = Rng(seed);
        let mut now = 0_i64;
        let mut next_key = 0;
        // Each backend's entries in flight or in doubt, by key.
        let mut held: Vec<(String, idemstore::OutboxEntry, idemstore::OutboxEntry)> = Vec::new();
        // Entries in doubt or failed for good, for the operator's calls.
        let mut parked_ones: Vec<(idemstore::OutboxEntry, idemstore::OutboxEntry)> = Vec::new();
        let (mut taken, mut tally) = (0, 0);
        let at = |secs: i64| t(0) + chrono::Duration::milliseconds(secs);
        for step in 0..400 {
            now += i64::try_from(rng.below(400))?;
            let when = at(now);
            let op = rng.below(16);
            let ctx = format!("step {step}, op {op}");
            match op {
                0..=4 => {
                    let dest = dests[usize::try_from(rng.below(4))?];
                    next_key += 1;
                    let mut e = NewEntry::new("c", dest, format!("k{next_key}"), vec![0]);
                    if rng.below(3) == 0 {
                        e = e.ordering_key(format!("o{}", rng.below(2)));
                    }
                    e = e.priority(u8::try_from(rng.below(3))?);
                    if rng.below(4) == 0 {
                        e = e.not_before(at(now + i64::try_from(rng.below(2000))?));
                    }
                    let (a, b) = (em.enqueue(e.clone(), when)?, pg.enqueue(e, when)?);
                    assert_eq!(a.is_new(), b.is_new(), "{ctx}");
                }
                5..=7 => {
                    let limit = usize::try_from(rng.below(5))? + 1;
                    let mut req = ClaimRequest::new(limit, "w");
                    if rng.below(3) == 0 {
                        req = req.one_destination();
                    }
                    if rng.below(3) == 0 {
                        req = req.avoid([dests[usize::try_from(rng.below(4))?]]);
                    }
                    let (a, b) = (em.claim(when, &req)?, pg.claim(when, &req)?);
                    assert_eq!(claimed(&a), claimed(&b), "{ctx}: {req:?}");
                    taken += a.len();
                    for (x, y) in a.into_iter().zip(b) {
                        held.push((x.idempotency_key.clone(), x, y));
                    }
                }
                8..=10 if !held.is_empty() => {
                    let pick = usize::try_from(rng.below(held.len() as u64))?;
                    let (key, x, y) = held.swap_remove(pick);
                    let retry = at(now + i64::try_from(rng.below(1500))?);
                    let settlement = match rng.below(5) {
                        0 | 1 => Settlement::Completed,
                        2 => Settlement::Failed {
                            reason: "http_503".into(),
                            next_attempt_at: Some(retry),
                        },
                        3 => Settlement::Throttled {
                            reason: "http_429".into(),
                            next_attempt_at: retry,
                        },
                        4 if rng.below(2) == 0 => Settlement::OutcomeUnknown { remote_ref: None },
                        _ => Settlement::Failed {
                            reason: "bad_request".into(),
                            next_attempt_at: None,
                        },
                    };
                    let parked = matches!(
                        settlement,
                        Settlement::OutcomeUnknown { .. }
                            | Settlement::Failed {
                                next_attempt_at: None,
                                ..
                            }
                    );
                    let a = em.settle(x.fence(), settlement.clone(), when);
                    let b = pg.settle(y.fence(), settlement, when);
                    assert_eq!(a.is_ok(), b.is_ok(), "{ctx}: {key} {a:?} {b:?}");
                    if parked && a.is_ok() {
                        parked_ones.push((x, y));
                    }
                    tally += 1;
                }
                15 if !parked_ones.is_empty() => {
                    // An operator resolves a doubt, or puts a failed entry back.
                    let pick = usize::try_from(rng.below(parked_ones.len() as u64))?;
                    let (x, y) = parked_ones.swap_remove(pick);
                    let back = at(now + i64::try_from(rng.below(500))?);
                    let (a, b) = if rng.below(2) == 0 {
                        (em.requeue(x.id, back), pg.requeue(y.id, back))
                    } else {
                        (em.mark_completed(x.id, when), pg.mark_completed(y.id, when))
                    };
                    assert_eq!(a.is_ok(), b.is_ok(), "{ctx}: {a:?} {b:?}");
                }
                11 => {
                    let dest = dests[usize::try_from(rng.below(4))?];
                    let policy = match rng.below(4) {
                        0 => DestinationPolicy::default(),
                        1 => DestinationPolicy::default()
                            .max_in_flight(u32::try_from(rng.below(3))? + 1),
                        2 => DestinationPolicy::default().rate_limit(4.0, 2),
                        _ => DestinationPolicy::default()
                            .circuit_breaker(2, std::time::Duration::from_millis(700)),
                    };
                    em.set_destination_policy(dest, policy)?;
                    pg.set_destination_policy(dest, policy)?;
                }
                12 => {
                    let dest = dests[usize::try_from(rng.below(4))?];
                    if rng.below(2) == 0 {
                        em.pause_destination(dest)?;
                        pg.pause_destination(dest)?;
                    } else {
                        em.resume_destination(dest)?;
                        pg.resume_destination(dest)?;
                    }
                }
                // The reaper, for claims held over 3 s (a released probe
                // ends, and the circuit may probe again).
                13 => {
                    let cutoff = at(now - 3000);
                    let (a, b) = (
                        em.release_expired_claims(cutoff)?.len(),
                        pg.release_expired_claims(cutoff)?.len(),
                    );
                    assert_eq!(a, b, "{ctx}");
                    let gone = |e: &idemstore::OutboxEntry| {
                        em.get(e.id)
                            .ok()
                            .map(|r| (r.entry.status, r.entry.attempt_count))
                            != Some((OutboxStatus::Dispatching, e.attempt_count))
                    };
                    held.retain(|(_, x, _)| !gone(x));
                }
                14 => {
                    let (a, b) = (
                        em.purge_finished(at(now - 2000))?,
                        pg.purge_finished(at(now - 2000))?,
                    );
                    assert_eq!(a, b, "{ctx}");
                }
                _ => {}
            }
            assert_eq!(em.next_due()?, pg.next_due()?, "{ctx}: next due");
            assert_eq!(
                report(em.destinations()?),
                report(pg.destinations()?),
                "{ctx}"
            );
        }
        assert_eq!(em.counts()?, pg.counts()?);
        assert!(
            taken > 100 && tally > 50,
            "a run that does something: {taken} {tally}"
        );
        assert!(pg.check_indexes()?.is_empty(), "{:?}", pg.check_indexes()?);
        assert!(em.check_indexes()?.is_empty());
        Ok(())
    }

    #[test]
    fn a_probe_the_reaper_releases_ends_and_the_next_claim_probes_again() -> TestResult {
        let f = fixture!();
        let outbox = f.store.outbox();
        let breaker =
            DestinationPolicy::default().circuit_breaker(1, std::time::Duration::from_secs(1));
        outbox.set_destination_policy("a", breaker)?;
        outbox.enqueue(NewEntry::new("c", "a", "a0", vec![0]), t(0))?;
        outbox.enqueue(NewEntry::new("c", "a", "a1", vec![0]), t(0))?;
        let first = outbox.claim_due(t(1), 1, "w")?;
        let retry = Settlement::Failed {
            reason: "http_503".into(),
            next_attempt_at: Some(t(1)),
        };
        outbox.settle(first[0].fence(), retry, t(1))?;
        let probe = outbox.claim_due(t(2), 10, "w")?;
        assert_eq!(probe.len(), 1, "one probe");
        assert!(matches!(
            outbox.destination("a")?.circuit,
            idemstore::CircuitState::Probing { .. }
        ));
        // Its dispatcher died: the reaper hands it back, and the circuit
        // no longer waits for it.
        assert_eq!(outbox.release_expired_claims(t(3))?, [probe[0].id]);
        assert!(matches!(
            outbox.destination("a")?.circuit,
            idemstore::CircuitState::Open { trips: 1, .. }
        ));
        assert_eq!(outbox.claim_due(t(4), 10, "w")?.len(), 1, "a new probe");
        Ok(())
    }

    #[test]
    fn a_schema_from_before_destinations_migrates_in_place() -> TestResult {
        let f = fixture!();
        let outbox = f.store.outbox();
        let old = outbox
            .enqueue(NewEntry::new("c", "a", "old", vec![0]), t(0))?
            .id();
        // Back to the first version's tables, as an older build left them.
        f.client().batch_execute(&format!(
            "DROP INDEX {s}.outbox_in_flight; DROP INDEX {s}.outbox_held; \
             ALTER TABLE {s}.outbox DROP COLUMN ordering_key, DROP COLUMN priority, \
                 DROP COLUMN seq, DROP COLUMN waiting; \
             DROP TABLE {s}.destinations; DROP TABLE {s}.schedules; \
             CREATE INDEX outbox_due ON {s}.outbox ((coalesce(next_attempt_at, created_at)), id) \
                 WHERE status = 'pending'; \
             UPDATE {s}.schema_version SET version = 1;",
            s = f.schema
        ))?;
        let store = f.another();
        let outbox = store.outbox();
        let record = outbox.get(old)?;
        assert_eq!(
            (record.entry.priority, record.entry.ordering_key),
            (0, None)
        );
        outbox.pause_destination("a")?;
        assert!(outbox.claim_due(t(1), 10, "w")?.is_empty());
        outbox.resume_destination("a")?;
        assert_eq!(outbox.claim_due(t(2), 10, "w")?[0].id, old);
        let version: i64 = f
            .client()
            .query_one(
                &format!("SELECT version FROM {}.schema_version", f.schema),
                &[],
            )?
            .get(0);
        assert_eq!(u64::try_from(version)?, idemstore::postgres::SCHEMA_VERSION);
        Ok(())
    }
}
