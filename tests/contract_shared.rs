//! The contract suite (`tests/contract/`) on an embedded store shared
//! between processes (`StoreBuilder::shared(true)`): each test's second
//! handle is a second store opened shared on the same file, which behaves as
//! another process does (its own caches, redb's file locks). The same
//! source runs on a store held alone in `tests/contract.rs` and on
//! PostgreSQL in `tests/contract_pg.rs`.

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

    fn shared() -> idemstore::StoreBuilder {
        // A small journal: claims also land in merges, by either store.
        Db::builder().shared(true).journal_size(8)
    }

    /// A fresh store file, opened shared.
    pub(crate) struct Fixture {
        pub(crate) store: Db,
        path: std::path::PathBuf,
        _dir: tempfile::TempDir,
    }

    impl Fixture {
        #[expect(
            clippy::unnecessary_wraps,
            reason = "the suite's fixture interface: other backends may be absent"
        )]
        pub(crate) fn open() -> Option<Fixture> {
            let dir = tempfile::tempdir().expect("a temporary directory");
            let path = dir.path().join("contract.idem");
            Some(Fixture {
                store: shared().open(&path).expect("a shared store"),
                path,
                _dir: dir,
            })
        }

        /// The store, for the operator's calls.
        pub(crate) fn admin(&self) -> &Db {
            &self.store
        }

        /// A second store opened shared on the same file: another process.
        pub(crate) fn another(&self) -> Db {
            shared().open(&self.path).expect("a second shared store")
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
