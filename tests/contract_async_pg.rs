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

#[path = "contract/pg.rs"]
mod app;

/// PostgreSQL's handles, through their async forms.
mod wrapped {
    async_wrappers! {
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
    use crate::app;
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
            app::create_marks(&url, &schema);
            let rt = asynced::runtime();
            Some(Fixture {
                store: Db::new(store, rt.clone()),
                rt,
                url,
                schema,
            })
        }

        /// The store wrapped, for the operator's calls.
        pub(crate) fn admin(&self) -> &idemstore::postgres::PgStore {
            self.store.admin()
        }

        /// A second store on the same schema, with its own pool: what
        /// another process would open.
        pub(crate) fn another(&self) -> Db {
            Db::new(Self::connect(&self.url, &self.schema), self.rt.clone())
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
