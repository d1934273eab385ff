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
//!   anything, and drops it if it is dead;
//! - the failed call is tried again on another connection when that is
//!   safe ([`decide`]), at most [`MAX_TRIES`] times in all.
//!
//! # What is retried
//!
//! Whether a call may run again depends on how far it had gone
//! ([`Phase`]) and on what the error says ([`classify`]):
//!
//! - Until the call hands the server what commits — the `COMMIT` of its
//!   transaction, or the one statement of a write outside a transaction,
//!   which commits in the same round trip — a connection that goes (the
//!   server shutting down, `57P01`…`57P03`; a connection failure it
//!   reported, class `08`; no answer at all) takes everything with it: the
//!   server rolls the transaction back. The call runs again on another
//!   connection.
//! - Once it has, only the server's answer that it rolled the transaction
//!   back — a serialization failure (`40001`) or a deadlock (`40P01`) —
//!   means it did not happen, and the call runs again. A connection that
//!   goes then, whatever its last words, may have taken a commit with it:
//!   the call is *not* run again, since a second run would answer as if
//!   someone else had done the first (a claim `false` for its own first
//!   claim, a `begin` in flight against its own request, entries a
//!   `claim_due` took stranded). The error says so instead
//!   ([`outcome_unknown`]: SQLSTATE `08007`, `transaction_resolution_unknown`,
//!   with what ended the connection in its message). So does a connection
//!   the server ended while it sat in the pool (a restart,
//!   `pg_terminate_backend`) when a one-statement write is the first to
//!   use it: the server's farewell (`57P01`) reads the same whether it came
//!   before the statement or after its commit. The failure marks the other
//!   pooled connections suspect, so the calls after it check theirs first.
//! - A request that could not be written at all (`EPIPE`, "broken pipe":
//!   the server had closed the connection already, as after a restart) never
//!   reached the server, whatever it was: the call runs again. A write that
//!   fails this way delivered none of its bytes, and the bytes before it in
//!   the same request cannot commit without the last one (`Sync`, or the
//!   whole `COMMIT`).
//! - A read runs again after any connection failure.
//! - Anything else — a constraint, bad data, the server's error in answer
//!   to a `COMMIT` (it rolled back), a timeout waiting for a pooled
//!   connection (that call already waited its timeout) — is returned as it
//!   is.
//!
//! A caller's closure (an effect of `claim_with`, a `PgStore::write`) never
//! runs twice: those calls retry only the part before the closure.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Config, GenericClient, NoTls, Row, Statement};

use super::tls::{Address, Tls};

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
    async fn get(&mut self, client: &impl GenericClient, sql: &str) -> Result<Statement> {
        if let Some(s) = self.map.get(sql) {
            return Ok(s.clone());
        }
        let s = client.prepare(sql).await?;
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
    pub(super) client: &'a C,
    pub(super) stmts: Option<&'a mut Stmts>,
    /// Outside a transaction, the connection's flag for a statement handed
    /// to the server (each commits as it ends): set once a statement is
    /// sent, after its prepare (which writes nothing). See [`phase`].
    pub(super) sent: Option<&'a mut bool>,
}

/// Parameters of a statement.
pub(super) type Params<'p> = [&'p (dyn ToSql + Sync)];

impl<'a, C: GenericClient + Sync> Db<'a, C> {
    /// `client` without a statement cache: a caller's own transaction.
    pub(super) fn uncached(client: &'a C) -> Self {
        Db {
            client,
            stmts: None,
            sent: None,
        }
    }

    /// The statement `sql`, prepared; from here on, a statement outside a
    /// transaction is on its way (see [`phase`]).
    async fn stmt(&mut self, sql: &str) -> Result<Statement> {
        let s = match &mut self.stmts {
            Some(cache) => cache.get(self.client, sql).await?,
            None => self.client.prepare(sql).await?,
        };
        if let Some(sent) = &mut self.sent {
            **sent = true;
        }
        Ok(s)
    }

    pub(super) async fn execute(&mut self, sql: &str, params: &Params<'_>) -> Result<u64> {
        let s = self.stmt(sql).await?;
        Ok(self.client.execute(&s, params).await?)
    }

    pub(super) async fn query(&mut self, sql: &str, params: &Params<'_>) -> Result<Vec<Row>> {
        let s = self.stmt(sql).await?;
        Ok(self.client.query(&s, params).await?)
    }

    pub(super) async fn query_opt(
        &mut self,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<Option<Row>> {
        let s = self.stmt(sql).await?;
        Ok(self.client.query_opt(&s, params).await?)
    }

    pub(super) async fn query_one(&mut self, sql: &str, params: &Params<'_>) -> Result<Row> {
        let s = self.stmt(sql).await?;
        Ok(self.client.query_one(&s, params).await?)
    }
}

/// One pooled connection.
pub(super) struct PgConn {
    pub(super) client: Client,
    pub(super) stmts: Stmts,
    /// The store's failure count when this connection was opened or last
    /// checked: older than the store's, it may be dead.
    epoch: u64,
    /// Whether the call using it has sent a `COMMIT`.
    pub(super) committing: bool,
    /// Whether the call using it has sent a statement outside a
    /// transaction (which commits as it ends).
    sent: bool,
}

impl PgConn {
    /// The connection, with its statements, for statements outside a
    /// transaction.
    pub(super) fn db(&mut self) -> Db<'_, Client> {
        Db {
            client: &self.client,
            stmts: Some(&mut self.stmts),
            sent: Some(&mut self.sent),
        }
    }

    /// The transaction `tx` of this connection, with its statements.
    pub(super) fn tx_db<'a>(
        stmts: &'a mut Stmts,
        tx: &'a tokio_postgres::Transaction<'_>,
    ) -> Db<'a, tokio_postgres::Transaction<'a>> {
        // A transaction's statements are the connection's.
        Db {
            client: tx,
            stmts: Some(stmts),
            sent: None,
        }
    }
}

/// Runs `$body` (an expression that may `.await`, with `$conn` a
/// `&mut PgConn`) in a transaction on that connection: commits if it is
/// `Ok`, rolls back if it is `Err` (the dropped transaction rolls back). An
/// expression, not a function taking a closure, so that the statements'
/// borrowed parameters need no `'static` and the future stays `Send`.
macro_rules! in_transaction {
    ($conn:expr, |$db:ident| $body:expr) => {{
        let conn: &mut $crate::postgres::conn::PgConn = $conn;
        match conn.client.transaction().await {
            Err(e) => Err($crate::error::Error::from(e)),
            Ok(tx) => {
                let out = {
                    let $db = &mut $crate::postgres::conn::PgConn::tx_db(&mut conn.stmts, &tx);
                    $body
                };
                match out {
                    Ok(v) => {
                        conn.committing = true;
                        match tx.commit().await {
                            Ok(()) => Ok(v),
                            Err(e) => Err($crate::error::Error::from(e)),
                        }
                    }
                    Err(e) => Err(e),
                }
            }
        }
    }};
}
pub(super) use in_transaction;

/// Silence on a connection before keepalive probes start.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
/// Time between two keepalive probes.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// Unanswered probes after which the connection is dropped.
const KEEPALIVE_RETRIES: u32 = 3;
/// Longest time data sent may stay unacknowledged before the connection is
/// dropped (Linux's `TCP_USER_TIMEOUT`).
const USER_TIMEOUT: Duration = Duration::from_secs(60);

/// `config` as every connection of the store opens it, pooled or
/// listening: TCP keepalives on, probing after [`KEEPALIVE_IDLE`] of
/// silence, every [`KEEPALIVE_INTERVAL`], dropped after
/// [`KEEPALIVE_RETRIES`] unanswered probes, and (on Linux) after
/// [`USER_TIMEOUT`] of data sent and not acknowledged. A server host that
/// vanishes without closing its connections (a crash, a network cut) is
/// then noticed within about a minute instead of the operating system's
/// defaults (about two hours for an idle connection, a quarter of an hour
/// for a call in flight), so a call caught by a partition fails within
/// about a minute and is retried or reported by the usual rules. Shorter
/// settings from the connection string are kept.
pub(super) fn bounded_config(config: &Config) -> Config {
    let mut c = config.clone();
    c.keepalives(true);
    if c.get_keepalives_idle() > KEEPALIVE_IDLE {
        c.keepalives_idle(KEEPALIVE_IDLE);
    }
    if c.get_keepalives_interval()
        .is_none_or(|i| i > KEEPALIVE_INTERVAL)
    {
        c.keepalives_interval(KEEPALIVE_INTERVAL);
    }
    if c.get_keepalives_retries()
        .is_none_or(|n| n > KEEPALIVE_RETRIES)
    {
        c.keepalives_retries(KEEPALIVE_RETRIES);
    }
    if c.get_tcp_user_timeout().is_none_or(|t| *t > USER_TIMEOUT) {
        c.tcp_user_timeout(USER_TIMEOUT);
    }
    c
}

/// Opens the pool's connections, stamped with the store's failure count.
/// Each connection is opened, and runs, on the store's own runtime
/// (`rt`): its socket belongs to that runtime's reactor, so a call awaits
/// it from any runtime (or blocks on it from any thread), and a
/// connection outlives the runtime of the call that opened it.
#[derive(Debug)]
pub(super) struct Manager {
    address: Address,
    rt: Handle,
    epoch: Arc<AtomicU64>,
}

impl Manager {
    pub(super) fn new(address: &Address, rt: Handle, epoch: Arc<AtomicU64>) -> Manager {
        Manager {
            address: address.bounded(),
            rt,
            epoch,
        }
    }
}

/// Opens a connection to `address` on `rt`, which then drives it until it
/// closes (the client dropped, the server gone).
pub(super) async fn connect(address: &Address, rt: &Handle) -> Result<Client> {
    let Address { config, tls } = address.clone();
    let opened = rt.spawn(async move {
        let client = match tls {
            Tls::Plain => {
                let (client, connection) = config.connect(NoTls).await?;
                // Its end is seen by the calls that use the client.
                tokio::spawn(async move { drop(connection.await) });
                client
            }
            #[cfg(feature = "postgres-tls")]
            Tls::Rustls(tls) => {
                let (client, connection) = config.connect(tls).await?;
                tokio::spawn(async move { drop(connection.await) });
                client
            }
        };
        Ok::<_, tokio_postgres::Error>(client)
    });
    match opened.await {
        Ok(client) => client.map_err(|e| super::tls::explained(e.into())),
        // The store's runtime is shutting down: the store is closing.
        Err(_) => Err(Error::Closed),
    }
}

impl deadpool::managed::Manager for Manager {
    type Type = PgConn;
    type Error = Error;

    async fn create(&self) -> Result<PgConn> {
        let epoch = self.epoch.load(Ordering::Acquire);
        Ok(PgConn {
            client: connect(&self.address, &self.rt).await?,
            stmts: Stmts::default(),
            epoch,
            committing: false,
            sent: false,
        })
    }

    async fn recycle(
        &self,
        conn: &mut PgConn,
        _: &deadpool::managed::Metrics,
    ) -> deadpool::managed::RecycleResult<Error> {
        if conn.client.is_closed() {
            return Err(deadpool::managed::RecycleError::message(
                "connection closed",
            ));
        }
        Ok(())
    }
}

/// The store's pool of connections.
pub(super) type Pool = deadpool::managed::Pool<Manager>;
/// A connection taken from it.
pub(super) type Conn = deadpool::managed::Object<Manager>;

/// What a call writes, for deciding whether to run it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// It only reads, or writes what a second run leaves as the first
    /// left it: running it again is always safe.
    Read,
    /// It writes in a transaction of its own, committed at its end (and
    /// any statement it makes outside it leaves a second run as the first
    /// left it, as a completion does).
    Tx,
    /// It writes in one statement outside a transaction: the statement
    /// commits as it ends, in the same round trip.
    Statement,
}

/// How far a failed call had gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Nothing that commits was handed to the server yet: a transaction
    /// before its `COMMIT`, a write before its one statement (still
    /// preparing it). Whatever the server did is rolled back when the
    /// connection goes.
    Open,
    /// The request that commits was handed to the server: the `COMMIT`, or
    /// a statement outside a transaction. Only the server's answer tells
    /// whether it committed.
    Committing,
}

/// What an error says about what happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// The server answered that it rolled the transaction back, and it may
    /// succeed if run again: a serialization failure (`40001`) or a
    /// deadlock (`40P01`).
    RolledBack,
    /// A request could not be written at all (`EPIPE`): the server had
    /// closed the connection, and got none of it.
    NotSent,
    /// The connection went, or was going: the server said so (the server
    /// shutting down or starting, `57P01`, `57P02`, `57P03`; too many
    /// connections, `53300`; a connection failure it reported itself,
    /// class `08` but `08007` and `08P01`), or the connection closed or
    /// failed with no answer. What the server did with a request already
    /// handed to it is unknown.
    Connection,
    /// Anything else: a constraint, bad data, a timeout waiting for a
    /// pooled connection (that call already waited its timeout), the
    /// server's error in answer to a `COMMIT` (it rolled back), …
    Other,
}

/// What to do about a failed call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Nothing of it happened, and it may succeed: run it again.
    Retry,
    /// Return the error as it is: the call did not happen (or it is a
    /// read), and running it again would not help.
    Fail,
    /// It may have committed: return [`outcome_unknown`], never run it
    /// again (a second run would answer as if someone else had done it).
    Unknown,
}

/// The rule: once a call is [`Phase::Committing`], only the server's word
/// that it rolled back ([`Class::RolledBack`]), or a request it never got
/// ([`Class::NotSent`]), means "not applied"; a connection that goes then
/// leaves the outcome unknown. Before, a lost connection rolled everything
/// back and the call may run again on another; a read may always run
/// again.
pub(crate) fn decide(mode: Mode, phase: Phase, class: Class) -> Decision {
    match (class, mode, phase) {
        (Class::RolledBack | Class::NotSent, ..)
        | (Class::Connection, Mode::Read, _)
        | (Class::Connection, _, Phase::Open) => Decision::Retry,
        (Class::Connection, _, Phase::Committing) => Decision::Unknown,
        (Class::Other, ..) => Decision::Fail,
    }
}

/// Sorts `e` (see [`Class`]).
pub(crate) fn classify(e: &Error) -> Class {
    let Error::Postgres { code, source, .. } = e else {
        return Class::Other;
    };
    if let Some(code) = code {
        return match code.as_str() {
            // serialization_failure, deadlock_detected
            "40001" | "40P01" => Class::RolledBack,
            // admin_shutdown, crash_shutdown, cannot_connect_now,
            // too_many_connections
            "57P01" | "57P02" | "57P03" | "53300" => Class::Connection,
            // transaction_resolution_unknown: it may have committed (the
            // store's own word for a call whose outcome is unknown, too);
            // protocol_violation: a bug, not a passing state.
            "08007" | "08P01" => Class::Other,
            c if c.starts_with("08") => Class::Connection,
            _ => Class::Other,
        };
    }
    let source: &(dyn std::error::Error + 'static) = &**source;
    if let Some(pg) = source.downcast_ref::<tokio_postgres::Error>()
        && pg.is_closed()
    {
        return Class::Connection;
    }
    // An I/O error anywhere in the chain: the socket failed underneath.
    let mut next = Some(source);
    while let Some(e) = next {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            // A write refused because the server had closed the
            // connection already (a restart while it sat in the pool).
            if io.kind() == std::io::ErrorKind::BrokenPipe {
                return Class::NotSent;
            }
            return Class::Connection;
        }
        next = e.source();
    }
    Class::Other
}

/// The SQLSTATE the store gives a call whose outcome is unknown:
/// `transaction_resolution_unknown`.
pub(crate) const OUTCOME_UNKNOWN: &str = "08007";

/// `e`, a connection that went once the call was [`Phase::Committing`], as
/// the call's error: SQLSTATE [`OUTCOME_UNKNOWN`], a message that says the
/// call may have committed (with the original error's own words and
/// SQLSTATE), the client's error as its source.
pub(crate) fn outcome_unknown(e: Error) -> Error {
    let Error::Postgres {
        code,
        message,
        source,
    } = e
    else {
        return e;
    };
    let was = match code {
        Some(code) => format!("{message} (SQLSTATE {code})"),
        None => message,
    };
    Error::Postgres {
        code: Some(OUTCOME_UNKNOWN.to_owned()),
        message: format!(
            "the connection failed once the call's commit was sent, so whether it committed \
             is unknown: {was}"
        ),
        source,
    }
}

/// The pause before try `n` (2, 3, …): short, growing.
pub(super) fn backoff(n: u32) -> Duration {
    Duration::from_millis(5 << n.min(6))
}

/// Takes a connection from `pool`, waiting at most `timeout` (on the
/// store's runtime `rt`'s clock) for one; one opened before the store's
/// latest lost connection is checked first (an empty query) and dropped
/// if dead.
pub(super) async fn checkout(
    pool: &Pool,
    rt: &Handle,
    timeout: Duration,
    epoch: &AtomicU64,
) -> Result<Conn> {
    let now = epoch.load(Ordering::Acquire);
    // Every pooled connection may be dead (a restarted server): check as
    // many as the pool holds, then take whatever comes (a new one).
    for _ in 0..=pool.status().max_size {
        let mut conn = get(pool, rt, timeout).await?;
        conn.committing = false;
        conn.sent = false;
        if conn.epoch >= now {
            return Ok(conn);
        }
        if conn.client.simple_query("").await.is_ok() {
            conn.epoch = now;
            return Ok(conn);
        }
        // Dead: the pool discards it when it comes back (`recycle`).
    }
    let mut conn = get(pool, rt, timeout).await?;
    conn.committing = false;
    conn.sent = false;
    Ok(conn)
}

/// One connection from `pool` within `timeout`.
async fn get(pool: &Pool, rt: &Handle, timeout: Duration) -> Result<Conn> {
    // The timer belongs to the store's runtime, whoever awaits it.
    let bounded = {
        let _rt = rt.enter();
        tokio::time::timeout(timeout, pool.get())
    };
    match bounded.await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(deadpool::managed::PoolError::Backend(e))) => Err(e),
        Ok(Err(deadpool::managed::PoolError::Closed)) => Err(Error::Closed),
        Ok(Err(e)) => Err(super::errors::pool(&e.to_string())),
        Err(_) => Err(super::errors::pool(&format!(
            "timed out after {timeout:?} waiting for a pooled connection"
        ))),
    }
}

/// Sleeps `d` on the store's runtime's clock, whoever awaits it.
pub(super) async fn sleep(rt: &Handle, d: Duration) {
    let sleep = {
        let _rt = rt.enter();
        tokio::time::sleep(d)
    };
    sleep.await;
}

/// Records a lost connection (no answer, or the server's word that it is
/// going away or refusing connections): every connection opened before is
/// suspect. A serialization failure or a deadlock says nothing about the
/// connections.
pub(super) fn note_failure(epoch: &AtomicU64, e: &Error) {
    let connection = match e {
        Error::Postgres { code: Some(c), .. } => c.starts_with("57P") || c.starts_with("08"),
        // No answer: the connection failed underneath.
        _ => matches!(classify(e), Class::Connection | Class::NotSent),
    };
    if connection {
        epoch.fetch_add(1, Ordering::AcqRel);
    }
}

/// How far the call holding `conn`, in `mode`, had gone: a `COMMIT` sent,
/// or for a [`Mode::Statement`] call a statement sent, is
/// [`Phase::Committing`]. (A [`Mode::Tx`] call's statements outside its
/// transaction are its own to make safe to run again.)
pub(super) fn phase(conn: &PgConn, mode: Mode) -> Phase {
    if conn.committing || (mode == Mode::Statement && conn.sent) {
        Phase::Committing
    } else {
        Phase::Open
    }
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
    fn a_connection_that_went_is_a_connection_failure() {
        // A request that could not be written.
        let pipe = Arc::new(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        assert_eq!(classify(&pg(None, pipe)), Class::NotSent);
        // A connection reset, the end of the stream: the connection went.
        for kind in [
            std::io::ErrorKind::ConnectionReset,
            std::io::ErrorKind::UnexpectedEof,
        ] {
            let e = Arc::new(std::io::Error::from(kind));
            assert_eq!(classify(&pg(None, e)), Class::Connection, "{kind:?}");
        }
        // The server said it was going, or refused the connection.
        for code in [
            "57P01", "57P02", "57P03", "53300", "08000", "08003", "08006",
        ] {
            assert_eq!(classify(&pg(Some(code), io())), Class::Connection, "{code}");
        }
    }

    #[test]
    fn only_a_serialization_failure_or_a_deadlock_is_rolled_back() {
        for code in ["40001", "40P01"] {
            assert_eq!(classify(&pg(Some(code), io())), Class::RolledBack, "{code}");
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
    fn a_connection_lost_without_an_answer_is_a_connection_failure() {
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
        assert_eq!(classify(&pg(None, io())), Class::Connection);
        // Deeper in the chain too.
        let deep = Wrap(std::io::Error::other("broken pipe"));
        assert_eq!(classify(&pg(None, Arc::new(deep))), Class::Connection);
    }

    #[test]
    fn client_errors_and_the_stores_own_are_other() {
        let parse = "port=notaport"
            .parse::<tokio_postgres::Config>()
            .unwrap_err();
        assert_eq!(classify(&Error::from(parse)), Class::Other);
        assert_eq!(classify(&Error::NotFound), Class::Other);
        assert_eq!(classify(&Error::conflict("x")), Class::Other);
    }

    #[test]
    fn once_committing_only_a_rollback_the_server_answered_runs_again() {
        use Class::{Connection, NotSent, Other, RolledBack};
        use Decision::{Fail, Retry, Unknown};
        use Mode::{Read, Statement, Tx};
        use Phase::{Committing, Open};
        // The server rolled it back, or never got it: every call may run
        // again.
        for mode in [Read, Tx, Statement] {
            for phase in [Open, Committing] {
                assert_eq!(decide(mode, phase, RolledBack), Retry);
                assert_eq!(decide(mode, phase, NotSent), Retry);
                assert_eq!(decide(mode, phase, Other), Fail);
            }
        }
        // A read may always run again.
        assert_eq!(decide(Read, Open, Connection), Retry);
        assert_eq!(decide(Read, Committing, Connection), Retry);
        // A write whose commit was not handed over yet rolled back with
        // the connection.
        assert_eq!(decide(Tx, Open, Connection), Retry);
        assert_eq!(decide(Statement, Open, Connection), Retry);
        // Once it was, whatever the connection's end said (the server
        // shutting down, a reset, no answer), it may have committed.
        assert_eq!(decide(Tx, Committing, Connection), Unknown);
        assert_eq!(decide(Statement, Committing, Connection), Unknown);
    }

    #[test]
    fn the_rule_over_the_errors_a_commit_meets() {
        let pipe = || Arc::new(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        let cases: [(Error, Decision, Decision); 6] = [
            (pg(Some("57P01"), io()), Decision::Retry, Decision::Unknown),
            (pg(Some("08006"), io()), Decision::Retry, Decision::Unknown),
            (pg(None, pipe()), Decision::Retry, Decision::Retry),
            (pg(None, io()), Decision::Retry, Decision::Unknown),
            (pg(Some("40001"), io()), Decision::Retry, Decision::Retry),
            (pg(Some("23505"), io()), Decision::Fail, Decision::Fail),
        ];
        for (e, open, committing) in cases {
            for mode in [Mode::Tx, Mode::Statement] {
                assert_eq!(decide(mode, Phase::Open, classify(&e)), open, "{e}");
                assert_eq!(
                    decide(mode, Phase::Committing, classify(&e)),
                    committing,
                    "{e}"
                );
            }
        }
    }

    #[test]
    fn an_unknown_outcome_says_so_and_keeps_the_original() {
        let e = outcome_unknown(pg(Some("57P01"), io()));
        let Error::Postgres { code, message, .. } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(code.as_deref(), Some(OUTCOME_UNKNOWN));
        assert!(
            message.contains("unknown") && message.contains("57P01"),
            "{message}"
        );
        assert!(std::error::Error::source(&e).is_some());
        // Not run again by anything that sorts it.
        assert_eq!(classify(&e), Class::Other);
        let shown = e.to_string();
        assert!(shown.contains("may have committed"), "{shown}");
        assert!(!shown.contains("rolled back"), "{shown}");
    }

    #[test]
    fn backoff_grows_and_stays_short() {
        assert!(backoff(2) < backoff(3));
        assert!(backoff(100) <= Duration::from_millis(320));
    }

    #[test]
    fn every_connection_notices_a_vanished_server_within_a_minute() {
        let plain: Config = "host=db user=app".parse().unwrap();
        let c = bounded_config(&plain);
        assert!(c.get_keepalives());
        assert_eq!(c.get_keepalives_idle(), KEEPALIVE_IDLE);
        assert_eq!(c.get_keepalives_interval(), Some(KEEPALIVE_INTERVAL));
        assert_eq!(c.get_keepalives_retries(), Some(KEEPALIVE_RETRIES));
        assert_eq!(c.get_tcp_user_timeout(), Some(&USER_TIMEOUT));
        let probing = KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_RETRIES;
        assert!(probing <= Duration::from_secs(60));
        // Shorter settings of the connection string stay.
        let eager: Config = "host=db keepalives=0 keepalives_idle=5 keepalives_interval=2 \
                             keepalives_retries=1 tcp_user_timeout=4"
            .parse()
            .unwrap();
        let c = bounded_config(&eager);
        assert!(c.get_keepalives());
        assert_eq!(c.get_keepalives_idle(), Duration::from_secs(5));
        assert_eq!(c.get_keepalives_interval(), Some(Duration::from_secs(2)));
        assert_eq!(c.get_keepalives_retries(), Some(1));
        assert_eq!(c.get_tcp_user_timeout(), Some(&Duration::from_secs(4)));
    }
}
