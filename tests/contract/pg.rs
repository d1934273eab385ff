//! The application's own rows and the count of commits on PostgreSQL, for
//! the fixtures of `tests/contract_pg.rs` and `tests/contract_async_pg.rs`.

use idemstore::Result;
use idemstore::postgres::Transaction;

use crate::common::pg::client;

/// Creates the application's own table in `schema`.
pub(crate) fn create_marks(url: &str, schema: &str) {
    client(url)
        .batch_execute(&format!(
            "CREATE TABLE {schema}.app_marks (key text PRIMARY KEY)"
        ))
        .expect("the application's table");
}

/// Writes the application row `key` in `tx`.
pub(crate) fn mark(tx: &mut Transaction<'_>, schema: &str, key: &str) -> Result<()> {
    tx.execute(
        &format!("INSERT INTO {schema}.app_marks (key) VALUES ($1)"),
        &[&key],
    )?;
    Ok(())
}

/// The application rows committed, in key order.
pub(crate) fn marks(url: &str, schema: &str) -> Result<Vec<String>> {
    let rows = client(url).query(
        &format!("SELECT key FROM {schema}.app_marks ORDER BY key"),
        &[],
    )?;
    rows.iter()
        .map(|r| r.try_get(0).map_err(idemstore::Error::from))
        .collect()
}

/// `f`'s result, and how many transactions updated or deleted rows of the
/// outbox or the inbox while it ran (a trigger notes each such row's
/// transaction).
pub(crate) fn commits_during<T>(url: &str, s: &str, f: impl FnOnce() -> T) -> Result<(T, u64)> {
    let mut client = client(url);
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
