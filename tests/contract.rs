//! The contract suite (`tests/contract/`) on the embedded store. The same
//! source runs on PostgreSQL in `tests/contract_pg.rs`.

#[macro_use]
#[path = "contract/mod.rs"]
mod contract;

mod fixture {
    use idemstore::redb::{ReadableTable as _, TableDefinition, WriteTransaction};
    use idemstore::{Error, Result};

    pub(crate) type Db = idemstore::Store;
    pub(crate) type Ob = idemstore::Outbox;

    /// The application's own table, written beside the store's rows.
    const MARKS: TableDefinition<&str, ()> = TableDefinition::new("app.marks");

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
            tx.open_table(MARKS)
                .map_err(Error::from)?
                .insert(key, ())
                .map_err(Error::from)?;
            Ok(())
        }

        /// The application rows committed, in key order.
        pub(crate) fn marks(&self) -> Result<Vec<String>> {
            self.store.read(|tx| match tx.open_table(MARKS) {
                Ok(t) => t.iter()?.map(|r| Ok(r?.0.value().to_owned())).collect(),
                Err(idemstore::redb::TableError::TableDoesNotExist(_)) => Ok(Vec::new()),
                Err(e) => Err(e.into()),
            })
        }
    }
}

use contract::*;
use fixture::*;

contract_suite!();
