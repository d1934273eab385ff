//! [`Transaction`]: the transaction a blocking closure is given.

use tokio_postgres::types::ToSql;
use tokio_postgres::{Error, Row, SimpleQueryMessage, Statement, ToStatement};

use super::blocking::wait;

/// A transaction on one of the store's connections, for the statements of
/// a blocking closure ([`PgStore::write`](super::PgStore::write),
/// [`PgStore::read`](super::PgStore::read), a
/// [`claim_with`](super::PgInbox::claim_with) effect) and the `*_in` calls.
/// Each method is the `tokio_postgres` transaction's of the same name,
/// waited on: the client's own types ([`Row`], [`ToSql`], errors) throughout,
/// and `?` turns its errors into [`crate::Error`].
///
/// The store commits or rolls it back when the closure returns; a nested
/// [`transaction`](Self::transaction) is a savepoint, rolled back when
/// dropped unless committed.
pub struct Transaction<'a> {
    inner: tokio_postgres::Transaction<'a>,
}

impl std::fmt::Debug for Transaction<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transaction").finish_non_exhaustive()
    }
}

impl<'a> Transaction<'a> {
    pub(super) fn new(inner: tokio_postgres::Transaction<'a>) -> Self {
        Transaction { inner }
    }

    pub(super) fn into_inner(self) -> tokio_postgres::Transaction<'a> {
        self.inner
    }

    /// The async transaction underneath, for the `*_in_async` calls and
    /// anything else of `tokio_postgres`'s.
    pub fn as_async(&self) -> &tokio_postgres::Transaction<'a> {
        &self.inner
    }

    /// Runs a statement; returns the number of rows it changed.
    pub fn execute<T>(&mut self, query: &T, params: &[&(dyn ToSql + Sync)]) -> Result<u64, Error>
    where
        T: ?Sized + ToStatement,
    {
        wait(self.inner.execute(query, params))
    }

    /// Runs a statement; returns the rows it answered.
    pub fn query<T>(&mut self, query: &T, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>, Error>
    where
        T: ?Sized + ToStatement,
    {
        wait(self.inner.query(query, params))
    }

    /// Runs a statement that answers exactly one row (else an error).
    pub fn query_one<T>(&mut self, query: &T, params: &[&(dyn ToSql + Sync)]) -> Result<Row, Error>
    where
        T: ?Sized + ToStatement,
    {
        wait(self.inner.query_one(query, params))
    }

    /// Runs a statement that answers at most one row (else an error).
    pub fn query_opt<T>(
        &mut self,
        query: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, Error>
    where
        T: ?Sized + ToStatement,
    {
        wait(self.inner.query_opt(query, params))
    }

    /// Prepares a statement, to run it many times.
    pub fn prepare(&mut self, query: &str) -> Result<Statement, Error> {
        wait(self.inner.prepare(query))
    }

    /// Runs statements separated by `;`, with no parameters, through the
    /// simple query protocol.
    pub fn batch_execute(&mut self, query: &str) -> Result<(), Error> {
        wait(self.inner.batch_execute(query))
    }

    /// Runs statements through the simple query protocol; returns what they
    /// answered, as text.
    pub fn simple_query(&mut self, query: &str) -> Result<Vec<SimpleQueryMessage>, Error> {
        wait(self.inner.simple_query(query))
    }

    /// A savepoint: a nested transaction that rolls back alone (when
    /// dropped, or by [`rollback`](Self::rollback)) and is kept by
    /// [`commit`](Self::commit) — the way to go on after a statement that
    /// may fail.
    pub fn transaction(&mut self) -> Result<Transaction<'_>, Error> {
        wait(self.inner.transaction()).map(Transaction::new)
    }

    /// Keeps a savepoint's changes (releases it). On the transaction a
    /// closure is given, the store commits; there, don't call this.
    pub fn commit(self) -> Result<(), Error> {
        wait(self.inner.commit())
    }

    /// Rolls a savepoint back.
    pub fn rollback(self) -> Result<(), Error> {
        wait(self.inner.rollback())
    }
}
