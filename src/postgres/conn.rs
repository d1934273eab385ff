//! The pooled connection: its prepared statements, the check of
//! connections that may have outlived the server, and the bounded retry of
//! calls that failed for a reason that lets them run again.
//!
//! # One round trip per statement
//!
//! A statement given as text costs two round trips (prepare, then
//! execute). Every pooled connection keeps the statements it prepared,
//! keyed by their text ([`Stmts`]), so a call's statements are prepared
//! once per connection and each later call is one round trip per
//! statement. The pool does not test a connection when it hands it out
//! (that would cost a round trip per call); a connection that has died is
//! noticed by the call that uses it, and then:
//!
//! - every connection opened before that failure is *suspect*: the next
//!   call to take one checks it first with an empty query, before sending
//!   anything, and drops it if it is dead (a restarted server leaves every
//!   pooled connection dead; one failure marks them all);
//! - the failed call is tried again on another connection when that is
//!   safe ([`Mode`]), at most [`MAX_TRIES`] times in all.
//!
//! # What is retried
//!
//! [`classify`] sorts an error into one of three kinds:
//!
//! - [`Class::NotApplied`]: the server answered that the statement or its
//!   transaction did not happen and may succeed if run again — a
//!   serialization failure (`40001`), a deadlock (`40P01`), the server
//!   shutting down or starting (`57P01`, `57P02`, `57P03`), too many
//!   connections (`53300`), a connection failure it reported itself (class
//!   `08` but `08007`, "transaction resolution unknown", and `08P01`, a
//!   protocol violation). Safe to run again whatever the call wrote.
//!   So is a request the client could not write at all because the server
//!   had closed the connection already (`EPIPE`, "broken pipe": a pooled
//!   connection that outlived a restart); the server never got it.
//! - [`Class::Lost`]: the server did not answer — the connection closed or
//!   failed underneath (I/O error). Whatever was in flight may or may not
//!   have committed: run again only if nothing could have committed (a
//!   read, or a transaction whose `COMMIT` was not sent yet).
//! - [`Class::Other`]: anything else — a constraint, bad data, a timeout
//!   waiting for a pooled connection (that call already waited its
//!   timeout), … — is returned as it is.
//!
//! A caller's closure (an effect of `claim_with`, a `PgStore::write`) never
//! runs twice: those calls retry only the part before the closure.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ::postgres::types::ToSql;
use ::postgres::{Client, Config, GenericClient, NoTls, Row, Statement};
use r2d2::ManageConnection;
use r2d2_postgres::PostgresConnectionManager;

use crate::error::{Error, Result};

/// How many times a call runs at most, the first time included.
pub(super) const MAX_TRIES: u32 = 3;

/// Most statements a connection keeps prepared; past it the cache starts
/// afresh (the store's own statements are a few dozen per schema).
const MAX_STATEMENTS: usize = 256;

/// The statements prepared on one connection, by their text.
#[derive(Default)]
pub(super) struct Stmts {
    map: HashMap<String, Statement>,
}

impl Stmts {
    /// The statement `sql`, prepared on `client` the first time.
    fn get(&mut self, client: &mut impl GenericClient, sql: &str) -> Result<Statement> {
        if let Some(s) = self.map.get(sql) {
            return Ok(s.clone());
        }
        let s = client.prepare(sql)?;
        if self.map.len() >= MAX_STATEMENTS {
            // Dropping a statement closes it on the server.
            self.map.clear();
        }
        self.map.insert(sql.to_owned(), s.clone());
        Ok(s)
    }
}

/// A client (a connection or a transaction on it) with the connection's
/// prepared statements, when the store owns the connection. Statements run
/// through it are prepared once per connection; on a caller's own
/// transaction (no cache) each is prepared where it runs, as text would be.
pub(super) struct Db<'a, C: GenericClient> {
    pub(super) client: &'a mut C,
    pub(super) stmts: Option<&'a mut Stmts>,
}

/// Parameters of a statement.
pub(super) type Params<'p> = [&'p (dyn ToSql + Sync)];

impl<'a, C: GenericClient> Db<'a, C> {
    /// `client` without a statement cache: a caller's own transaction.
    pub(super) fn uncached(client: &'a mut C) -> Self {
        Db {
            client,
            stmts: None,
        }
    }

    fn stmt(&mut self, sql: &str) -> Result<Statement> {
        match &mut self.stmts {
            Some(cache) => cache.get(self.client, sql),
            None => Ok(self.client.prepare(sql)?),
        }
    }

    pub(super) fn execute(&mut self, sql: &str, params: &Params<'_>) -> Result<u64> {
        let s = self.stmt(sql)?;
        Ok(self.client.execute(&s, params)?)
    }

    pub(super) fn query(&mut self, sql: &str, params: &Params<'_>) -> Result<Vec<Row>> {
        let s = self.stmt(sql)?;
        Ok(self.client.query(&s, params)?)
    }

    pub(super) fn query_opt(&mut self, sql: &str, params: &Params<'_>) -> Result<Option<Row>> {
        let s = self.stmt(sql)?;
        Ok(self.client.query_opt(&s, params)?)
    }

    pub(super) fn query_one(&mut self, sql: &str, params: &Params<'_>) -> Result<Row> {
        let s = self.stmt(sql)?;
        Ok(self.client.query_one(&s, params)?)
    }
}

/// One pooled connection.
pub(super) struct PgConn {
    pub(super) client: Client,
    pub(super) stmts: Stmts,
    /// The store's failure count when this connection was opened or last
    /// checked: older than the store's, it may be dead.
    epoch: u64,
    /// Whether the call using it has sent its `COMMIT` (its outcome is then
    /// unknown if the connection is lost).
    committing: bool,
}

impl PgConn {
    /// The connection, with its statements, for statements outside a
    /// transaction.
    pub(super) fn db(&mut self) -> Db<'_, Client> {
        Db {
            client: &mut self.client,
            stmts: Some(&mut self.stmts),
        }
    }

    /// Runs `f` in a transaction: commits if it returns `Ok`, rolls back if
    /// it returns `Err` or panics (the dropped transaction rolls back).
    pub(super) fn in_transaction<T>(
        &mut self,
        f: impl FnOnce(&mut Db<'_, ::postgres::Transaction<'_>>) -> Result<T>,
    ) -> Result<T> {
        let mut tx = self.client.transaction()?;
        let out = f(&mut Db {
            client: &mut tx,
            stmts: Some(&mut self.stmts),
        })?;
        self.committing = true;
        tx.commit()?;
        Ok(out)
    }
}

/// Opens the pool's connections, stamped with the store's failure count.
#[derive(Debug)]
pub(super) struct Manager {
    inner: PostgresConnectionManager<NoTls>,
    epoch: Arc<AtomicU64>,
}

impl Manager {
    pub(super) fn new(config: Config, epoch: Arc<AtomicU64>) -> Manager {
        Manager {
            inner: PostgresConnectionManager::new(config, NoTls),
            epoch,
        }
    }
}

impl ManageConnection for Manager {
    type Connection = PgConn;
    type Error = ::postgres::Error;

    fn connect(&self) -> Result<PgConn, ::postgres::Error> {
        let epoch = self.epoch.load(Ordering::Acquire);
        Ok(PgConn {
            client: self.inner.connect()?,
            stmts: Stmts::default(),
            epoch,
            committing: false,
        })
    }

    fn is_valid(&self, conn: &mut PgConn) -> Result<(), ::postgres::Error> {
        self.inner.is_valid(&mut conn.client)
    }

    fn has_broken(&self, conn: &mut PgConn) -> bool {
        conn.client.is_closed()
    }
}

/// What a failed call may have left behind, for deciding whether to run it
/// again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// It only reads, or writes what a second run leaves as the first
    /// left it: running it again is always safe.
    Read,
    /// It writes in a transaction of its own, committed at its end: safe to
    /// run again until its `COMMIT` was sent.
    Tx,
    /// It writes in one statement outside a transaction (the statement
    /// commits as it ends): safe to run again only when the server said it
    /// did not happen.
    Statement,
}

/// What an error says about running the call again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// The server answered that it did not happen, and it may succeed if
    /// run again.
    NotApplied,
    /// The connection was lost with no answer: what was in flight may have
    /// committed.
    Lost,
    /// Not worth retrying.
    Other,
}

/// Sorts `e` (see the module docs).
pub(crate) fn classify(e: &Error) -> Class {
    let Error::Postgres { code, source, .. } = e else {
        return Class::Other;
    };
    if let Some(code) = code {
        return if transient_sqlstate(code) {
            Class::NotApplied
        } else {
            Class::Other
        };
    }
    let source: &(dyn std::error::Error + 'static) = &**source;
    if let Some(pg) = source.downcast_ref::<::postgres::Error>()
        && pg.is_closed()
    {
        return Class::Lost;
    }
    // An I/O error anywhere in the chain: the socket failed underneath.
    let mut next = Some(source);
    while let Some(e) = next {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            // A write refused because the server had closed the
            // connection already (a restart while it sat in the pool):
            // the request never reached it.
            if io.kind() == std::io::ErrorKind::BrokenPipe {
                return Class::NotApplied;
            }
            return Class::Lost;
        }
        next = e.source();
    }
    Class::Other
}

/// SQLSTATEs with which the server says a statement did not happen and may
/// succeed if run again.
fn transient_sqlstate(code: &str) -> bool {
    match code {
        // serialization_failure, deadlock_detected; admin_shutdown,
        // crash_shutdown, cannot_connect_now, too_many_connections
        "40001" | "40P01" | "57P01" | "57P02" | "57P03" | "53300" => true,
        // transaction_resolution_unknown: it may have committed;
        // protocol_violation: a bug, not a passing state.
        "08007" | "08P01" => false,
        c => c.starts_with("08"),
    }
}

/// Whether a call in `mode` that failed with `class` may run again;
/// `committing` tells whether it had sent its `COMMIT`.
pub(crate) fn may_retry(mode: Mode, class: Class, committing: bool) -> bool {
    match class {
        Class::NotApplied => true,
        Class::Lost => match mode {
            Mode::Read => true,
            Mode::Tx => !committing,
            Mode::Statement => false,
        },
        Class::Other => false,
    }
}

/// The pause before try `n` (2, 3, …): short, growing.
pub(super) fn backoff(n: u32) -> Duration {
    Duration::from_millis(5 << n.min(6))
}

/// Takes a connection from `pool`; one opened before the store's latest
/// lost connection is checked first (an empty query) and dropped if dead.
pub(super) fn checkout(
    pool: &r2d2::Pool<Manager>,
    epoch: &AtomicU64,
) -> Result<r2d2::PooledConnection<Manager>> {
    let now = epoch.load(Ordering::Acquire);
    // Every pooled connection may be dead (a restarted server): check as
    // many as the pool holds, then take whatever comes (a new one).
    for _ in 0..=pool.max_size() {
        let mut conn = pool.get().map_err(super::errors::pool)?;
        conn.committing = false;
        if conn.epoch >= now {
            return Ok(conn);
        }
        if conn.client.simple_query("").is_ok() {
            conn.epoch = now;
            return Ok(conn);
        }
        // Dead: the pool discards it when it comes back (`has_broken`).
    }
    let mut conn = pool.get().map_err(super::errors::pool)?;
    conn.committing = false;
    Ok(conn)
}

/// Records a lost connection (no answer, or the server's word that it is
/// going away or refusing connections): every connection opened before is
/// suspect. A serialization failure or a deadlock says nothing about the
/// connections.
pub(super) fn note_failure(epoch: &AtomicU64, e: &Error) {
    let connection = match e {
        Error::Postgres { code: Some(c), .. } => c.starts_with("57P") || c.starts_with("08"),
        // No answer: the connection failed underneath.
        _ => classify(e) != Class::Other,
    };
    if connection {
        epoch.fetch_add(1, Ordering::AcqRel);
    }
}

/// Whether the call holding `conn` had sent its `COMMIT`.
pub(super) fn committing(conn: &PgConn) -> bool {
    conn.committing
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pg(code: Option<&str>, source: Arc<dyn std::error::Error + Send + Sync>) -> Error {
        Error::Postgres {
            code: code.map(str::to_owned),
            message: "m".into(),
            source,
        }
    }

    fn io() -> Arc<dyn std::error::Error + Send + Sync> {
        Arc::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        ))
    }

    #[test]
    fn a_request_that_could_not_be_written_was_not_applied() {
        let pipe = Arc::new(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        assert_eq!(classify(&pg(None, pipe)), Class::NotApplied);
        let eof = Arc::new(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
        assert_eq!(classify(&pg(None, eof)), Class::Lost);
    }

    #[test]
    fn the_servers_transient_answers_are_not_applied() {
        for code in [
            "40001", "40P01", "57P01", "57P02", "57P03", "53300", "08000", "08003", "08006",
        ] {
            assert_eq!(classify(&pg(Some(code), io())), Class::NotApplied, "{code}");
        }
    }

    #[test]
    fn other_answers_are_not_retried() {
        // unique_violation, check_violation, query_canceled, undefined_table,
        // transaction_resolution_unknown, protocol_violation,
        // statement_completion_unknown, disk_full.
        for code in [
            "23505", "23514", "57014", "42P01", "08007", "08P01", "40003", "53100",
        ] {
            assert_eq!(classify(&pg(Some(code), io())), Class::Other, "{code}");
        }
    }

    #[test]
    fn a_connection_lost_without_an_answer_is_lost() {
        #[derive(Debug)]
        struct Wrap(std::io::Error);
        impl std::fmt::Display for Wrap {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("wrapped")
            }
        }
        impl std::error::Error for Wrap {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        assert_eq!(classify(&pg(None, io())), Class::Lost);
        // Deeper in the chain too.
        let deep = Wrap(std::io::Error::other("broken pipe"));
        assert_eq!(classify(&pg(None, Arc::new(deep))), Class::Lost);
    }

    #[test]
    fn client_errors_and_the_stores_own_are_other() {
        let parse = "port=notaport".parse::<::postgres::Config>().unwrap_err();
        assert_eq!(classify(&Error::from(parse)), Class::Other);
        assert_eq!(classify(&Error::NotFound), Class::Other);
        assert_eq!(classify(&Error::conflict("x")), Class::Other);
    }

    #[test]
    fn what_may_run_again() {
        use Class::{Lost, NotApplied, Other};
        use Mode::{Read, Statement, Tx};
        // Nothing happened: every call may run again.
        for mode in [Read, Tx, Statement] {
            for committing in [false, true] {
                assert!(may_retry(mode, NotApplied, committing));
                assert!(!may_retry(mode, Other, committing));
            }
        }
        // A lost connection: a read, or a transaction before its COMMIT.
        assert!(may_retry(Read, Lost, false));
        assert!(may_retry(Read, Lost, true));
        assert!(may_retry(Tx, Lost, false));
        assert!(!may_retry(Tx, Lost, true));
        // A one-statement write may have committed.
        assert!(!may_retry(Statement, Lost, false));
    }

    #[test]
    fn backoff_grows_and_stays_short() {
        assert!(backoff(2) < backoff(3));
        assert!(backoff(100) <= Duration::from_millis(320));
    }
}
