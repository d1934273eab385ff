//! The contract suite (`tests/contract/`) on the embedded store, through
//! the `_async` forms of its calls (feature `tokio`): the tests of
//! `tests/contract.rs`, on a store in memory, whose handles are wrappers
//! (`tests/contract/asynced.rs`) that run each call's async form to its end
//! on a tokio runtime. So the async forms give the blocking calls' answers
//! and errors, under the same concurrency.
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
//!   `summary`, `list`, `check_indexes`; `Store::inbox_names`;
//! - the calls that never wait: `Inbox::name`, the keys' `lease` and `stats`,
//!   `Outbox::subscribe` and `notify`.
//!
//! The same suite runs through PostgreSQL's async forms in
//! `tests/contract_async_pg.rs`.

#[macro_use]
#[path = "contract/mod.rs"]
mod contract;

#[macro_use]
#[path = "contract/asynced.rs"]
mod asynced;

#[path = "contract/embedded.rs"]
mod embedded;

/// The embedded store's handles, through their async forms.
mod wrapped {
    async_wrappers! {
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

        /// The store wrapped, for the operator's calls.
        pub(crate) fn admin(&self) -> &idemstore::Store {
            self.store.admin()
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
            Ok(embedded::commits_during(&self.plain, f))
        }
    }
}

use contract::*;
use fixture::*;

contract_suite!();
