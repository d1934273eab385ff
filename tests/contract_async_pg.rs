//! The contract suite (`tests/contract/`) on PostgreSQL, through the
//! `_async` forms of its calls: the suite's tests of `tests/contract_pg.rs`
//! (not its server-only ones), on a store in a fresh schema, whose
//! handles are wrappers (`tests/contract/asynced.rs`) that run each call's
//! async form to its end on a tokio runtime of the test's, not the store's
//! own. So the async forms give the blocking calls' answers and errors,
//! under the same concurrency.
//!
//! Every call of the inbox, the outbox, the idempotency keys and the store
//! goes through its async form, except:
//!
//! - `PgStore::write` and `PgInbox::claim_with`: their closures, in the
//!   suite, borrow its locals, where the async forms take `'static`
//!   closures returning boxed futures;
//! - the `*_in` calls (`claim_in`, `prune_in`, `enqueue_in`, `settle_in`,
//!   `complete_in`), which write in such a closure's transaction (a
//!   blocking `Transaction`, where their async forms take the client's);
//! - the calls that never wait: `PgInbox::name`, the keys' `lease` and
//!   `stats`, `PgOutbox::subscribe` and `notify`.
//!
//! The server is named by `IDEMSTORE_TEST_POSTGRES` (`.ci/postgres run --
//! cargo test --features postgres --test contract_async_pg` starts a
//! throwaway one); without it every test says so and passes, except under
//! `CI=true`. The same suite runs through the embedded store's async forms
//! in `tests/contract_async.rs`.

#[macro_use]
#[path = "contract/mod.rs"]
mod contract;

#[macro_use]
#[path = "contract/asynced.rs"]
mod asynced;

mod common;

/// PostgreSQL's handles, through their async forms.
mod wrapped {
    async_wrappers! { postgres;
        store: idemstore::postgres::PgStore,
        inbox: idemstore::postgres::PgInbox,
        outbox: idemstore::postgres::PgOutbox,
        keys: idemstore::postgres::PgIdempotencyKeys,
        tx: &mut idemstore::postgres::Transaction<'_>,
    }
}

mod fixture {
    use std::sync::Arc;

    use idemstore::Result;
    use idemstore::postgres::{PgStore, Transaction};
    use postgres::{Client, NoTls};
    use tokio::runtime::Runtime;

    use super::{asynced, wrapped};
    use crate::common::pg::{unique_schema, url};

    pub(crate) type Db = wrapped::Store;
    pub(crate) type Ob = wrapped::Outbox;

    /// A store in a fresh schema, its calls through their async forms;
    /// the schema is dropped with everything in it at the end.
    pub(crate) struct Fixture {
        pub(crate) store: Db,
        rt: Arc<Runtime>,
        url: String,
        schema: String,
    }

    impl Fixture {
        /// A store of its own pool on the test schema.
        fn connect(url: &str, schema: &str) -> PgStore {
            PgStore::builder()
                .schema(schema)
                .pool_size(4)
                .connect(url)
                .expect("connect to the test server")
        }

        pub(crate) fn open() -> Option<Fixture> {
            let url = url()?;
            let schema = unique_schema();
            let store = Self::connect(&url, &schema);
            let mut client = Client::connect(&url, NoTls).expect("a plain connection");
            client
                .batch_execute(&format!(
                    "CREATE TABLE {schema}.app_marks (key text PRIMARY KEY)"
                ))
                .expect("the application's table");
            let rt = asynced::runtime();
            Some(Fixture {
                store: Db::new(store, rt.clone()),
                rt,
                url,
                schema,
            })
        }

        /// A second store on the same schema, with its own pool: what
        /// another process would open.
        /// The store wrapped, for the operator's calls.
        pub(crate) fn admin(&self) -> &idemstore::postgres::PgStore {
            self.store.admin()
        }

        pub(crate) fn another(&self) -> Db {
            Db::new(Self::connect(&self.url, &self.schema), self.rt.clone())
        }

        /// A plain connection to the server.
        fn client(&self) -> Client {
            Client::connect(&self.url, NoTls).expect("a plain connection")
        }

        /// Writes the application row `key` in `tx`.
        pub(crate) fn mark(&self, tx: &mut Transaction<'_>, key: &str) -> Result<()> {
            tx.execute(
                &format!("INSERT INTO {}.app_marks (key) VALUES ($1)", self.schema),
                &[&key],
            )?;
            Ok(())
        }

        /// The application rows committed, in key order.
        pub(crate) fn marks(&self) -> Result<Vec<String>> {
            let rows = self.client().query(
                &format!("SELECT key FROM {}.app_marks ORDER BY key", self.schema),
                &[],
            )?;
            rows.iter()
                .map(|r| r.try_get(0).map_err(idemstore::Error::from))
                .collect()
        }

        /// How many transactions updated or deleted rows of the outbox or
        /// the inbox while `f` ran (a trigger notes each such row's
        /// transaction).
        pub(crate) fn commits_during<T>(&self, f: impl FnOnce() -> T) -> Result<(T, u64)> {
            let s = &self.schema;
            let mut client = self.client();
            client.batch_execute(&format!(
                "CREATE TABLE {s}.test_xacts (xact bigint NOT NULL); \
                 CREATE FUNCTION {s}.test_note_xact() RETURNS trigger LANGUAGE plpgsql AS \
                 $$ BEGIN INSERT INTO {s}.test_xacts VALUES (txid_current()); RETURN NULL; END $$; \
                 CREATE TRIGGER test_note_xact AFTER UPDATE OR DELETE ON {s}.outbox \
                 FOR EACH ROW EXECUTE FUNCTION {s}.test_note_xact(); \
                 CREATE TRIGGER test_note_xact AFTER DELETE ON {s}.inbox \
                 FOR EACH ROW EXECUTE FUNCTION {s}.test_note_xact();"
            ))?;
            let out = f();
            let n: i64 = client
                .query_one(
                    &format!("SELECT count(DISTINCT xact) FROM {s}.test_xacts"),
                    &[],
                )?
                .get(0);
            client.batch_execute(&format!(
                "DROP TRIGGER test_note_xact ON {s}.outbox; \
                 DROP TRIGGER test_note_xact ON {s}.inbox; \
                 DROP FUNCTION {s}.test_note_xact(); DROP TABLE {s}.test_xacts;"
            ))?;
            Ok((out, u64::try_from(n).unwrap_or(0)))
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
