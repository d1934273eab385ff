//! The contract suite (`tests/contract/`) on the embedded store. The same
//! source runs on PostgreSQL in `tests/contract_pg.rs`.

#[macro_use]
#[path = "contract/mod.rs"]
mod contract;

#[path = "contract/embedded.rs"]
mod embedded;

mod fixture {
    use idemstore::Result;
    use idemstore::redb::WriteTransaction;

    use super::embedded;

    pub(crate) type Db = idemstore::Store;
    pub(crate) type Ob = idemstore::Outbox;

    /// A fresh store in memory.
    pub(crate) struct Fixture {
        pub(crate) store: Db,
    }

    impl Fixture {
        #[expect(
            clippy::unnecessary_wraps,
            reason = "the suite's fixture interface: other backends may be absent"
        )]
        pub(crate) fn open() -> Option<Fixture> {
            Some(Fixture {
                store: Db::in_memory().expect("an in-memory store"),
            })
        }

        /// The store, for the operator's calls.
        pub(crate) fn admin(&self) -> &Db {
            &self.store
        }

        /// The same store: one process holds the file.
        pub(crate) fn another(&self) -> Db {
            self.store.clone()
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
            embedded::marks(&self.store)
        }

        /// How many write transactions committed while `f` ran.
        #[expect(
            clippy::unnecessary_wraps,
            reason = "the suite's fixture interface: other backends may fail to count"
        )]
        pub(crate) fn commits_during<T>(&self, f: impl FnOnce() -> T) -> Result<(T, u64)> {
            Ok(embedded::commits_during(&self.store, f))
        }
    }
}

use contract::*;
use fixture::*;

contract_suite!();
