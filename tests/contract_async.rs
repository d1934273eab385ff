//! The contract suite (`tests/contract/`) on the embedded store, through
//! the `_async` forms of its calls (feature `tokio`): the tests of
//! `tests/contract.rs`, on a store in memory, whose handles are wrappers
//! (`tests/contract/asynced.rs`) that run each call's async form to its end
//! on a tokio runtime. So the async forms give the blocking calls' answers
//! and errors, under the same concurrency.
//!
//! Not yet the idempotency keys' contract (`keys_contract!()`): one of its
//! tests calls `idemstore::StoreAdmin::key(&f.store, ..)`, and `StoreAdmin`
//! is sealed (only `Store` and `PgStore` implement it), so it cannot
//! compile on a wrapper type; the keys' wrapper is ready for it, and this
//! binary takes `contract_suite!()` once that test reaches the store's
//! `StoreAdmin` in a way a wrapper can give (through the fixture, say).
//!
//! Calls that stay blocking, each for its reason:
//!
//! - `Store::write` and `Inbox::claim_with`: their closures, in the suite,
//!   borrow its locals, where the async forms take `'static` closures;
//! - the `*_in` calls (`claim_in`, `prune_in`, `enqueue_in`, `settle_in`,
//!   `complete_in`), which write in such a closure's transaction;
//! - the calls the embedded store has no async form of: the inbox's `seen`,
//!   `seen_at`, `len`, `is_empty`, `list`, `prune`; the outbox's
//!   `mark_outcome_unknown`, `release_expired_claims`, `purge_finished`,
//!   `change_matching`, `find`, `list`, `list_for_command`, `counts`,
//!   `oldest_claim`, `check_indexes` and the destinations' calls; the keys'
//!   `release_key`, `entry`, `response`, `get`, `put`, `purge_expired`,
//!   `summary`, `list`, `check_indexes`; `Store::inbox_names`; and
//!   `Outbox::settle_and_claim` (the embedded `settle_and_claim_async` takes
//!   a `ClaimRequest`: it is `settle_and_claim_with`'s, and runs for that);
//! - the calls that never wait: `Inbox::name`, the keys' `lease` and `stats`,
//!   `Outbox::subscribe` and `notify`.
//!
//! The same suite runs through PostgreSQL's async forms in
//! `tests/contract_async_pg.rs`.

#[macro_use]
#[path = "contract/mod.rs"]
#[expect(
    unused_macros,
    reason = "keys_contract!(), and contract_suite!() with it, cannot compile here"
)]
mod contract;

#[macro_use]
#[path = "contract/asynced.rs"]
mod asynced;

#[path = "contract/embedded.rs"]
mod embedded;

/// The embedded store's handles, through their async forms.
#[expect(
    dead_code,
    reason = "the keys' wrapper: keys_contract!() cannot compile here"
)]
mod wrapped {
    async_wrappers! { embedded;
        store: idemstore::Store,
        inbox: idemstore::Inbox,
        outbox: idemstore::Outbox,
        keys: idemstore::IdempotencyKeys,
        tx: &idemstore::redb::WriteTransaction,
    }
}

mod fixture {
    use std::sync::Arc;

    use idemstore::Result;
    use idemstore::redb::WriteTransaction;
    use tokio::runtime::Runtime;

    use super::{asynced, embedded, wrapped};

    pub(crate) type Db = wrapped::Store;
    pub(crate) type Ob = wrapped::Outbox;

    /// A fresh store in memory, its calls through their async forms.
    pub(crate) struct Fixture {
        pub(crate) store: Db,
        /// The same store, its calls as they are: for the fixture's own.
        plain: idemstore::Store,
        rt: Arc<Runtime>,
    }

    impl Fixture {
        #[expect(
            clippy::unnecessary_wraps,
            reason = "the suite's fixture interface: other backends may be absent"
        )]
        pub(crate) fn open() -> Option<Fixture> {
            let plain = idemstore::Store::in_memory().expect("an in-memory store");
            let rt = asynced::runtime();
            Some(Fixture {
                store: Db::new(plain.clone(), rt.clone()),
                plain,
                rt,
            })
        }

        /// The same store: one process holds the file.
        pub(crate) fn another(&self) -> Db {
            Db::new(self.plain.clone(), self.rt.clone())
        }

        /// Writes the application row `key` in `tx`.
        #[expect(
            clippy::unused_self,
            reason = "the suite's fixture interface: other backends need the fixture"
        )]
        pub(crate) fn mark(&self, tx: &WriteTransaction, key: &str) -> Result<()> {
            embedded::mark(tx, key)
        }

        /// The application rows committed, in key order.
        pub(crate) fn marks(&self) -> Result<Vec<String>> {
            embedded::marks(&self.plain)
        }

        /// How many write transactions committed while `f` ran.
        #[expect(
            clippy::unnecessary_wraps,
            reason = "the suite's fixture interface: other backends may fail to count"
        )]
        pub(crate) fn commits_during<T>(&self, f: impl FnOnce() -> T) -> Result<(T, u64)> {
            let before = self.plain.commit_stats().commits;
            let out = f();
            Ok((out, self.plain.commit_stats().commits - before))
        }
    }
}

use contract::*;
use fixture::*;

// `contract_suite!()` but for `keys_contract!()`, which cannot compile on
// a wrapper (see the module doc).
inbox_contract!();
outbox_contract!();
maintenance_contract!();
destinations_contract!();
