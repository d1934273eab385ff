//! The application's own rows in an embedded store, for the fixtures of
//! `tests/contract.rs` and `tests/contract_shared.rs`.

use idemstore::redb::{ReadableTable as _, TableDefinition, WriteTransaction};
use idemstore::{Error, Result, Store};

/// The application's own table, written beside the store's rows.
const MARKS: TableDefinition<&str, ()> = TableDefinition::new("app.marks");

/// Writes the application row `key` in `tx`.
pub(crate) fn mark(tx: &WriteTransaction, key: &str) -> Result<()> {
    tx.open_table(MARKS)
        .map_err(Error::from)?
        .insert(key, ())
        .map_err(Error::from)?;
    Ok(())
}

/// The application rows `store` has committed, in key order.
pub(crate) fn marks(store: &Store) -> Result<Vec<String>> {
    store.read(|tx| match tx.open_table(MARKS) {
        Ok(t) => t.iter()?.map(|r| Ok(r?.0.value().to_owned())).collect(),
        Err(idemstore::redb::TableError::TableDoesNotExist(_)) => Ok(Vec::new()),
        Err(e) => Err(e.into()),
    })
}

/// `f`'s result, and how many write transactions `store` committed while
/// it ran.
pub(crate) fn commits_during<T>(store: &Store, f: impl FnOnce() -> T) -> (T, u64) {
    let before = store.commit_stats().commits;
    let out = f();
    (out, store.commit_stats().commits - before)
}
