//! The same inbox, outbox and idempotency keys on a PostgreSQL server, for
//! programs that outgrow one process (feature `postgres`).
//!
//! [`PgStore`] mirrors [`Store`](crate::Store): the same calls with the same
//! names, arguments and value types ([`Claim`](crate::Claim),
//! [`NewEntry`](crate::NewEntry), [`OutboxEntry`](crate::OutboxEntry),
//! [`Settlement`](crate::Settlement), [`Fence`](crate::Fence),
//! [`Begin`](crate::Begin), [`ResponseRecord`](crate::ResponseRecord),
//! [`Error`], …) and the same semantics: the outbox's status table and
//! fencing, due order, duplicate enqueues as
//! [`Enqueued::Duplicate`](crate::Enqueued::Duplicate), lazy expiry, tenant
//! isolation, the same input limits and the same errors for bad input. Only
//! the transaction of effects changes: a `&mut` [`Transaction`] on the
//! server where the embedded store hands a `&redb::WriteTransaction`. Moving a
//! program is a change of constructor.
//!
//! ```no_run
//! use idemstore::chrono::Utc;
//! use idemstore::postgres::PgStore;
//! use idemstore::{Claim, NewEntry};
//!
//! let store = PgStore::connect("host=/run/postgresql user=app dbname=app")?;
//! let webhooks = store.inbox("webhooks")?;
//! let outbox = store.outbox();
//!
//! // The claim, the application's own row and the email about it commit
//! // together, or not at all; a second delivery runs nothing.
//! let outcome = webhooks.claim_with("evt_123", Utc::now(), |tx| {
//!     tx.execute("UPDATE accounts SET balance = balance + 10 WHERE id = $1", &[&7_i64])?;
//!     let email = NewEntry::new("evt_123", "mailer", "evt_123/receipt", b"Thanks!".to_vec());
//!     outbox.enqueue_in(tx, email, Utc::now())?;
//!     Ok::<_, idemstore::Error>(())
//! })?;
//! assert!(matches!(outcome, Claim::Applied(())));
//! # Ok::<_, idemstore::Error>(())
//! ```
//!
//! The same from async code, holding no thread while the server answers:
//!
//! ```no_run
//! # async fn run() -> idemstore::Result<()> {
//! use idemstore::chrono::Utc;
//! use idemstore::postgres::PgStore;
//! use idemstore::{Claim, NewEntry};
//!
//! let store = PgStore::builder()
//!     .connect_async("host=/run/postgresql user=app dbname=app")
//!     .await?;
//! let webhooks = store.inbox("webhooks")?;
//! let outbox = store.outbox();
//! let outcome = webhooks
//!     .claim_with_async("evt_123", Utc::now(), |tx| {
//!         Box::pin(async move {
//!             tx.execute("UPDATE accounts SET balance = balance + 10 WHERE id = $1", &[&7_i64])
//!                 .await?;
//!             let email = NewEntry::new("evt_123", "mailer", "evt_123/receipt", b"Thanks!".to_vec());
//!             outbox.enqueue_in_async(tx, email, Utc::now()).await?;
//!             Ok::<_, idemstore::Error>(())
//!         })
//!     })
//!     .await?;
//! assert!(matches!(outcome, Claim::Applied(())));
//! # Ok(())
//! # }
//! ```
//!
//! # What differs from the embedded store
//!
//! - **Durability is the server's.** A call returns once PostgreSQL has
//!   committed; with the server's default `synchronous_commit = on` that
//!   commit is flushed to its WAL (PostgreSQL group-commits concurrent
//!   transactions itself: there is no batching of ours in front of it).
//! - **Many processes.** Any number of processes on any number of machines
//!   share one database. Claims are `INSERT … ON CONFLICT DO NOTHING`;
//!   `claim_due` takes rows with `FOR UPDATE SKIP LOCKED`; an enqueue wakes
//!   the subscribers of every process ([`PgOutbox::subscribe`]).
//! - **Errors of the server** (a lost connection, a restart, a
//!   serialization failure) are [`Error::Postgres`], with the server's
//!   message and SQLSTATE. A call runs again on a fresh connection, at most
//!   three times in all, when that is safe: a read; a write that had not
//!   yet handed the server what commits (its `COMMIT`, or its one
//!   statement outside a transaction) when the connection went; a request
//!   that could not be written at all (a broken pipe); a transaction the
//!   server answered it rolled back (`40001`, `40P01`). Your closures (an
//!   effect of `claim_with`, a [`PgStore::write`]) never run twice.
//! - **A call that returns `Err` wrote nothing**, with one exception,
//!   which says so: the connection went once the call had handed over
//!   what commits. The server may have committed, so the call is not run
//!   again (a second run would answer as if someone else had done the
//!   first: a claim `false`, a `begin` in flight); its error has SQLSTATE
//!   `08007` (`transaction_resolution_unknown`) and a message that says the
//!   call may have committed. Look before running it again: `seen`, `get`,
//!   [`PgOutbox::counts`]; entries a `claim_due` took stay `Dispatching`
//!   until [`PgOutbox::release_expired_claims`] hands them back. The same
//!   error may meet a one-statement write (a `claim`, an `enqueue`) that is
//!   the first to use a connection the server ended while it sat in the
//!   pool (a restart, `pg_terminate_backend`): the server's farewell reads
//!   the same before the statement as after its commit. The calls after it
//!   check the other pooled connections first. After such an error inside
//!   a [`PgStore::write`] closure, PostgreSQL has aborted the transaction:
//!   return the error. A closure that swallows it and returns `Ok` commits
//!   nothing either: the call returns the server's `25P02` error.
//!   To decide what to do, ask the error rather than its SQLSTATE:
//!   [`Error::is_retryable`](crate::Error::is_retryable) is `true` only
//!   when the same call may simply run again (the server out of reach or
//!   going away before the commit, no pooled connection in time, `40001`,
//!   `40P01`), and [`Error::kind`](crate::Error::kind) names the rest
//!   ([`ErrorKind::OutcomeUnknown`](crate::ErrorKind::OutcomeUnknown) for
//!   `08007`).
//! - **Every call has an `_async` form** ([`PgInbox::claim_async`],
//!   [`PgOutbox::claim_due_async`], [`PgStore::write_async`], …) that
//!   awaits the server without holding a thread: the store runs on the
//!   async client, `tokio-postgres`, its connections driven by a runtime of
//!   the store's own (one thread, `idemstore-pg`), so the futures work on
//!   any runtime and are `Send`. The blocking calls wait on the same
//!   futures from the calling thread, without starting a runtime: they
//!   work on any thread, a thread that drives a tokio runtime included
//!   (where they block its other tasks for their round trips, as every
//!   blocking call does). A closure of a blocking call
//!   ([`PgStore::write`], `claim_with`) gets a [`Transaction`] whose
//!   statements block; an `_async` call's closure gets the client's own
//!   [`tokio_postgres::Transaction`] and returns a boxed future
//!   ([`BoxFuture`]).
//! - **A dropped `_async` future** never leaves a call half done. Until
//!   its statement (or its `COMMIT`) is sent, nothing of it happened; a
//!   transaction whose future is dropped before its `COMMIT` rolls back
//!   (the client sends the `ROLLBACK`); a one-statement write (`claim`,
//!   `enqueue`, a settlement) or a `COMMIT` already sent may commit unseen,
//!   exactly as when the connection is lost at that point. Each call's
//!   documentation says what that leaves.
//! - **Calls that counted rows in the embedded store count them here**
//!   ([`PgInbox::len`], [`PgOutbox::counts`]): they read an index, in time
//!   proportional to the rows, for inspection and monitoring at a modest
//!   rate.
//!
//! # TLS
//!
//! The connection string's `sslmode` and `sslrootcert` are honoured as
//! libpq honours them, on every connection of the store (the pool's and
//! the outbox's listening one), with the feature `postgres-tls` (rustls,
//! pure Rust: nothing to install):
//!
//! | `sslmode` | TLS | the server's certificate |
//! |---|---|---|
//! | `disable` | never | — |
//! | `allow`, `prefer` (the default) | when the server offers it, else plain | not checked |
//! | `require` | always | not checked; with `sslrootcert`, checked as `verify-ca` |
//! | `verify-ca` | always | signed by a root of `sslrootcert` |
//! | `verify-full` | always | signed by a root, and naming the host |
//!
//! `sslrootcert` is a PEM file of one or more roots (a managed server's CA
//! bundle); without it, or with `sslrootcert=system`, the roots are the
//! Mozilla set compiled in (`webpki-roots`). A refused certificate fails
//! the connect with [`Error::Postgres`] saying why (not signed by a root,
//! or not naming the host). Client certificates (`sslcert`, `sslkey`) are
//! refused as [`Error::InvalidInput`]; a unix-socket host is always plain.
//! Without the feature, a connection string asking for TLS (`require`,
//! `verify-*`, `sslrootcert`) is refused as [`Error::InvalidInput`] naming
//! the feature, and `prefer` connects in plain.
//!
//! ```no_run
//! # use idemstore::postgres::PgStore;
//! let store = PgStore::connect(
//!     "host=db.example.com user=app dbname=app sslmode=verify-full sslrootcert=/etc/app/db-ca.pem",
//! )?;
//! # Ok::<_, idemstore::Error>(())
//! ```
//!
//! # Layout
//!
//! Everything lives in one schema (default [`DEFAULT_SCHEMA`]), created and
//! migrated on connect; see [`PgStoreBuilder::schema`]. The tables, their
//! indexes and the statements each call runs are described in the module
//! sources (`src/postgres/schema.rs` for the tables).

mod backend;
mod blocking;
mod conn;
mod depth;
mod errors;
mod idempotency;
mod import;
mod inbox;
mod listen;
mod outbox;
mod schema;
mod tls;
mod transaction;

use std::cell::{Cell, RefCell};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use tokio::runtime::{Handle, Runtime};

use self::blocking::wait;
use self::conn::{Conn, Manager, Mode, Params, PgConn, Pool};

use crate::error::{Error, Result};
use crate::idempotency::Counters;
use crate::idempotency::rules::DEFAULT_MAX_BODY;

/// The PostgreSQL client this backend is built with, for the statements of
/// your own (`idemstore::postgres::tokio_postgres::Transaction`, its
/// `ToSql` types, …) at the version the store uses.
pub use ::tokio_postgres;
pub use idempotency::PgIdempotencyKeys;
pub use inbox::PgInbox;
pub use outbox::PgOutbox;
pub use schema::SCHEMA_VERSION;
pub use transaction::Transaction;

/// The schema a store lives in unless told otherwise: `idemstore`.
pub const DEFAULT_SCHEMA: &str = "idemstore";
/// Default number of pooled connections per [`PgStore`]: 16.
pub const DEFAULT_POOL_SIZE: u32 = 16;
/// Default longest wait for a pooled connection (and for a new connection
/// to the server): 10 s.
pub const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// A boxed future of a caller's async closure: what the `_async` calls that
/// run one ([`PgStore::write_async`], [`PgInbox::claim_with_async`]) await.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Runs `$body` — an expression that may `.await`, with `$conn` a
/// `&mut PgConn` — on a pooled connection of `$server`, again on another
/// one (at most [`conn::MAX_TRIES`] times in all) when it failed in a way
/// that `$mode` and how far it had gone make safe to run again
/// ([`conn::decide`]); an error that leaves its outcome unknown says so
/// ([`conn::outcome_unknown`]). Evaluates to the body's `Result`. (An
/// expression, not a function taking a closure: the statements' borrowed
/// parameters then need no `'static`, and the call's future stays `Send`.)
macro_rules! run {
    ($server:expr, $mode:expr, |$conn:ident| $body:expr) => {{
        let server: &$crate::postgres::Server = &$server;
        let mode: $crate::postgres::conn::Mode = $mode;
        let mut tries = 1;
        loop {
            let mut pooled = match server.conn().await {
                Ok(c) => c,
                Err(e) => break Err(e),
            };
            let out: $crate::error::Result<_> = async {
                let $conn: &mut $crate::postgres::conn::PgConn = &mut pooled;
                $body
            }
            .await;
            match out {
                Ok(v) => break Ok(v),
                Err(e) => {
                    let phase = $crate::postgres::conn::phase(&pooled, mode);
                    drop(pooled);
                    if let Err(e) = server.retry_after(e, mode, phase, tries).await {
                        break Err(e);
                    }
                    tries += 1;
                }
            }
        }
    }};
}
pub(crate) use run;

/// The server of one [`PgStore`], as every handle of the store reaches it:
/// the pool, the runtime its connections run on, the schema and the limits.
pub(crate) struct Server {
    pool: Pool,
    /// Drives every connection of the store (one thread); held for its
    /// `Drop`, which shuts it down.
    _rt: OwnRuntime,
    handle: Handle,
    /// The server's address and TLS, for the outbox's listening
    /// connection.
    address: tls::Address,
    schema: String,
    max_body: usize,
    /// Longest wait for a pooled connection.
    timeout: Duration,
    /// How many lost connections the store has seen: a pooled connection
    /// opened before the latest is checked before use (`conn.rs`).
    epoch: Arc<AtomicU64>,
}

impl fmt::Debug for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Server")
            .field("schema", &self.schema)
            .field("pool", &self.pool.status())
            .field("max_body", &self.max_body)
            .finish_non_exhaustive()
    }
}

/// The store's runtime, shut down without waiting when the store goes: a
/// runtime dropped the ordinary way panics in async code, where a store's
/// last handle may well be dropped (a layer's service at shutdown, a
/// task).
struct OwnRuntime(Option<Runtime>);

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl OwnRuntime {
    /// One worker thread, `idemstore-pg`, with I/O and timers.
    fn start() -> Result<OwnRuntime> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("idemstore-pg")
            .enable_all()
            .build()
            .map_err(Error::Io)?;
        Ok(OwnRuntime(Some(rt)))
    }

    fn handle(&self) -> Handle {
        match &self.0 {
            Some(rt) => rt.handle().clone(),
            None => unreachable!("the runtime is taken only when dropped"),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // The connections end with their tasks, as the runtime goes.
        self.pool.close();
    }
}

/// What a transaction of a caller's closure may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// Read and write (`PgStore::write`, `claim_with`).
    Write,
    /// Read a consistent snapshot (`REPEATABLE READ, READ ONLY`:
    /// `PgStore::read`).
    Read,
}

/// Begins a transaction on `conn` and runs `first` in it, if any; the
/// rows `first` changed (0 without one).
async fn begin<'c>(
    conn: &'c mut PgConn,
    access: Access,
    first: Option<(&str, &Params<'_>)>,
) -> Result<(tokio_postgres::Transaction<'c>, u64)> {
    let mut builder = conn.client.build_transaction();
    if access == Access::Read {
        builder = builder
            .read_only(true)
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead);
    }
    let tx = builder.start().await?;
    let n = match first {
        Some((sql, params)) => {
            PgConn::tx_db(&mut conn.stmts, &tx)
                .execute(sql, params)
                .await?
        }
        None => 0,
    };
    Ok((tx, n))
}

impl Server {
    /// The most connections the pool holds.
    fn pool_size(&self) -> usize {
        self.pool.status().max_size
    }

    /// A pooled connection; [`Error::Postgres`] if none came free (or could
    /// be opened) before the pool's timeout.
    async fn conn(&self) -> Result<Conn> {
        conn::checkout(&self.pool, &self.handle, self.timeout, &self.epoch).await
    }

    /// Runs `first`, then `f` once, in one transaction on a pooled
    /// connection, and commits if `f` says so: the blocking calls that run
    /// a caller's closure ([`PgStore::write`], [`PgStore::read`],
    /// `claim_with`). `BEGIN` and `first` run again on another connection
    /// when that is safe (nothing has committed); `f` never runs twice.
    /// `f` runs on the calling thread. While a writing `f` runs, the
    /// thread is inside a write ([`WriteScope`]).
    ///
    /// `f` returning `Err` or panicking rolls back. Before the `COMMIT`, the
    /// transaction is checked: a statement that failed inside `f` aborted
    /// it on the server even if `f` went on and returned `Ok`, and the
    /// server answers the `COMMIT` of an aborted transaction by rolling
    /// back without an error. Such a transaction is rolled back and the
    /// server's error returned (`25P02`, "current transaction is aborted"):
    /// `Ok` means committed.
    fn write_once<T, E>(
        &self,
        access: Access,
        first: Option<(&str, &Params<'_>)>,
        f: impl FnOnce(u64, &mut Transaction<'_>) -> Result<Finish<T>, E>,
    ) -> Result<T, E>
    where
        E: From<Error>,
    {
        let scope = match access {
            Access::Write => Some(WriteScope::enter()?),
            Access::Read => None,
        };
        wait(async move {
            let mut tries = 1;
            loop {
                let mut pooled = self.conn().await?;
                let e = match begin(&mut pooled, access, first).await {
                    Ok((tx, p)) => {
                        let mut tx = Transaction::new(tx);
                        let out = f(p, &mut tx);
                        let hooks = take_hooks();
                        drop(scope);
                        return match out? {
                            // Dropping the transaction rolls it back.
                            Finish::Rollback(v) => Ok(v),
                            Finish::Commit(v) => {
                                self.commit(tx.into_inner()).await?;
                                run_hooks(hooks);
                                Ok(v)
                            }
                        };
                    }
                    Err(e) => e,
                };
                self.retry_after(e, Mode::Tx, conn::Phase::Open, tries)
                    .await?;
                tries += 1;
            }
        })
    }

    /// [`Server::write_once`] for an async closure: the same, with `f`
    /// awaited where the call is.
    async fn write_once_async<T, E, F>(
        &self,
        access: Access,
        first: Option<(&str, &Params<'_>)>,
        f: F,
    ) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<Error> + Send + 'static,
        F: for<'t, 'c> FnOnce(
            u64,
            &'t mut tokio_postgres::Transaction<'c>,
        ) -> BoxFuture<'t, Result<Finish<T>, E>>,
    {
        let mut tries = 1;
        loop {
            let mut pooled = self.conn().await?;
            let e = match begin(&mut pooled, access, first).await {
                Ok((mut tx, p)) => {
                    return match f(p, &mut tx).await? {
                        Finish::Rollback(v) => Ok(v),
                        Finish::Commit(v) => {
                            self.commit(tx).await?;
                            Ok(v)
                        }
                    };
                }
                Err(e) => e,
            };
            self.retry_after(e, Mode::Tx, conn::Phase::Open, tries)
                .await?;
            tries += 1;
        }
    }

    /// Commits `tx` unless a statement in it failed (see
    /// [`Server::write_once`]); a failure is noted as [`run!`] notes one,
    /// and one once the `COMMIT` was sent is [`conn::outcome_unknown`]
    /// when it may have committed. Not run again: the closure that wrote
    /// `tx` runs once.
    async fn commit(&self, tx: tokio_postgres::Transaction<'_>) -> Result<()> {
        let failed = |e: tokio_postgres::Error| {
            let e = Error::from(e);
            conn::note_failure(&self.epoch, &e);
            e
        };
        // In an aborted transaction every statement fails with 25P02; the
        // dropped transaction then rolls back.
        tx.batch_execute("SELECT 1").await.map_err(failed)?;
        tx.commit().await.map_err(failed).map_err(|e| {
            match conn::decide(Mode::Tx, conn::Phase::Committing, conn::classify(&e)) {
                conn::Decision::Unknown => conn::outcome_unknown(e),
                conn::Decision::Retry | conn::Decision::Fail => e,
            }
        })
    }

    /// After a failure `e` of a call in `mode` that had gone as far as
    /// `phase`, on try `tries` (of at most [`conn::MAX_TRIES`]): notes a
    /// lost connection, and answers `Ok` if the call may run again (after
    /// a short pause), else the error to return.
    async fn retry_after(
        &self,
        e: Error,
        mode: Mode,
        phase: conn::Phase,
        tries: u32,
    ) -> Result<()> {
        conn::note_failure(&self.epoch, &e);
        match conn::decide(mode, phase, conn::classify(&e)) {
            conn::Decision::Retry if tries < conn::MAX_TRIES => {
                conn::sleep(&self.handle, conn::backoff(tries + 1)).await;
                Ok(())
            }
            conn::Decision::Unknown => Err(conn::outcome_unknown(e)),
            conn::Decision::Retry | conn::Decision::Fail => Err(e),
        }
    }
}

/// How a [`Server::write_once`] closure ends its transaction.
pub(crate) enum Finish<T> {
    /// Commit, then answer `T`.
    Commit(T),
    /// Roll back (it wrote nothing), then answer `T`.
    Rollback(T),
}

thread_local! {
    /// Whether this thread runs a [`PgStore::write`] closure or a
    /// `claim_with` effect.
    static IN_WRITE: Cell<bool> = const { Cell::new(false) };
    /// What the `*_in` calls of that closure report once its transaction
    /// commits (see [`after_commit`]).
    static HOOKS: RefCell<Vec<Hook>> = const { RefCell::new(Vec::new()) };
}

/// A report to make once a transaction has committed.
type Hook = Box<dyn FnOnce()>;

/// Marks the thread as inside a write closure for its lifetime (also when
/// the closure panics); what is left of its hooks when it ends is dropped
/// (its transaction did not commit).
struct WriteScope;

impl WriteScope {
    fn enter() -> Result<WriteScope> {
        refuse_reentrant()?;
        IN_WRITE.with(|c| c.set(true));
        HOOKS.with(|h| h.borrow_mut().clear());
        Ok(WriteScope)
    }
}

/// The hooks registered by the write closure this thread runs, so far.
fn take_hooks() -> Vec<Hook> {
    HOOKS.with(|h| std::mem::take(&mut *h.borrow_mut()))
}

impl Drop for WriteScope {
    fn drop(&mut self) {
        IN_WRITE.with(|c| c.set(false));
        drop(take_hooks());
    }
}

/// Runs `hook` once the transaction of the [`PgStore::write`] closure (or
/// `claim_with` effect) this thread runs has committed, and never if it
/// rolls back; outside such a closure (a `*_in` call on a transaction of
/// the caller's own client, whose commit the store cannot see), at once.
/// For counters and reports only: a hook never changes an answer, and a
/// panic in it is dropped.
pub(crate) fn after_commit(hook: impl FnOnce() + 'static) {
    if in_write() {
        HOOKS.with(|h| h.borrow_mut().push(Box::new(hook)));
    } else {
        run_hooks(vec![Box::new(hook)]);
    }
}

fn run_hooks(hooks: Vec<Hook>) {
    for hook in hooks {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(hook));
    }
}

/// Whether this thread runs a write closure.
fn in_write() -> bool {
    IN_WRITE.with(Cell::get)
}

/// [`Error::Reentrant`] inside a write closure: a store write there would
/// take a second connection and could wait forever on the rows the
/// closure's own transaction holds. The `*_in` calls are the way there.
fn refuse_reentrant() -> Result<()> {
    if in_write() {
        return Err(Error::Reentrant);
    }
    Ok(())
}

/// How to connect a [`PgStore`]. Every setter states its default.
#[derive(Debug, Clone)]
#[must_use]
pub struct PgStoreBuilder {
    schema: String,
    pool_size: u32,
    connection_timeout: Duration,
    max_body: usize,
}

impl Default for PgStoreBuilder {
    fn default() -> Self {
        PgStoreBuilder {
            schema: DEFAULT_SCHEMA.to_owned(),
            pool_size: DEFAULT_POOL_SIZE,
            connection_timeout: DEFAULT_CONNECTION_TIMEOUT,
            max_body: DEFAULT_MAX_BODY,
        }
    }
}

impl PgStoreBuilder {
    /// The schema holding the store's tables, created on connect if it does
    /// not exist. Default: [`DEFAULT_SCHEMA`] (`idemstore`). Stores in
    /// different schemas of one database are independent (tests, tenants).
    /// 1–48 bytes of lowercase ASCII letters, digits and `_`, starting with
    /// a letter or `_`, not `pg_…`, and not a reserved SQL keyword of the
    /// server (`user`, `select`, `order`, …). At
    /// [`connect`](Self::connect), a name longer than 48 bytes is
    /// [`Error::TooLarge`]; any other bad name (empty, a bad character, a
    /// leading digit, `pg_…`, a reserved keyword) is [`Error::InvalidInput`]
    /// for the field `schema`, before anything is written.
    pub fn schema(mut self, schema: &str) -> Self {
        schema.clone_into(&mut self.schema);
        self
    }

    /// Most connections the store holds open (its pool's size); a call
    /// takes one for its duration. Default: [`DEFAULT_POOL_SIZE`] (16).
    /// Connections are opened as calls need them, not up front.
    pub fn pool_size(mut self, connections: u32) -> Self {
        self.pool_size = connections.max(1);
        self
    }

    /// Longest wait for a pooled connection, and for a new connection to
    /// the server when the connection string sets no `connect_timeout`; a
    /// call that waited longer fails with [`Error::Postgres`] instead of
    /// hanging while the server is away. Default:
    /// [`DEFAULT_CONNECTION_TIMEOUT`] (10 s).
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Largest response body or outbox payload accepted, in bytes. Default:
    /// 1 MiB, as in the embedded store. Larger ones are refused with
    /// [`Error::TooLarge`], never truncated.
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// Connects to the server named by `url`, a libpq connection string
    /// (`host=/run/postgresql user=app dbname=app`) or URL
    /// (`postgresql://app@db.example/app`), and creates or migrates the
    /// store's schema (see [`SCHEMA_VERSION`]). Processes connecting at
    /// once migrate one after the other. A schema migrated by a newer
    /// version of this crate is [`Error::IncompatibleFormat`]; an
    /// unreachable server is [`Error::Postgres`].
    ///
    /// `sslmode` and `sslrootcert` say how connections are secured (TLS
    /// needs the feature `postgres-tls`; see [TLS](self#tls)); a connection
    /// string that asks for TLS in a build without it, or that is malformed,
    /// is [`Error::InvalidInput`]. Starts the store's runtime (one thread, `idemstore-pg`),
    /// which drives its connections until the store's last handle is
    /// dropped.
    pub fn connect(self, url: &str) -> Result<PgStore> {
        wait(self.connect_async(url))
    }

    /// [`PgStoreBuilder::connect`], awaited.
    pub async fn connect_async(self, url: &str) -> Result<PgStore> {
        schema::check_schema_name(&self.schema)?;
        let mut address = tls::address(url)?;
        if address.config.get_connect_timeout().is_none() {
            address.config.connect_timeout(self.connection_timeout);
        }
        let rt = OwnRuntime::start()?;
        let handle = rt.handle();
        // Migrations run on a connection of their own, so that an
        // unreachable server answers with its own error at once.
        let mut client = conn::connect(&address, &handle).await?;
        schema::check_not_keyword(&client, &self.schema).await?;
        schema::migrate(&mut client, &self.schema).await?;
        drop(client);
        let epoch = Arc::new(AtomicU64::new(0));
        // No test on checkout: it would cost a round trip per call. A dead
        // connection is noticed by the call that uses it (`conn.rs`).
        let pool = Pool::builder(Manager::new(&address, handle.clone(), epoch.clone()))
            .max_size(usize::try_from(self.pool_size).unwrap_or(usize::MAX))
            .build()
            .map_err(|e| errors::pool(&e.to_string()))?;
        let server = Arc::new(Server {
            pool,
            _rt: rt,
            handle,
            address,
            schema: self.schema,
            max_body: self.max_body,
            timeout: self.connection_timeout,
            epoch,
        });
        crate::observe::describe_on_open();
        Ok(PgStore {
            outbox: PgOutbox::new(server.clone()),
            idempotency_counters: Arc::default(),
            server,
        })
    }
}

/// A store on a PostgreSQL server: the embedded [`Store`](crate::Store)'s
/// calls, for many processes. Cheap to clone (an `Arc` inside); clones share
/// one connection pool.
///
/// Each call has a blocking form and an `_async` form (see [the module
/// docs](self)): in async code, await the `_async` forms, which hold no
/// thread while the server answers.
#[derive(Clone, Debug)]
pub struct PgStore {
    server: Arc<Server>,
    /// One outbox per store, so its wake-up subscribers are shared.
    outbox: PgOutbox,
    /// Counters shared by every `PgIdempotencyKeys` handle of this store.
    idempotency_counters: Arc<Counters>,
}

impl PgStore {
    /// Connects with the default settings (schema `idemstore`, 16 pooled
    /// connections); see [`PgStoreBuilder::connect`].
    pub fn connect(url: &str) -> Result<PgStore> {
        PgStore::builder().connect(url)
    }

    /// Settings for connecting a store.
    pub fn builder() -> PgStoreBuilder {
        PgStoreBuilder::default()
    }

    /// The schema holding the store's tables.
    pub fn schema(&self) -> &str {
        &self.server.schema
    }

    /// Runs `f` in one transaction: commits if it returns `Ok`, rolls back
    /// if it returns `Err` or panics (the panic then reaches the caller).
    /// Returns once the server has committed.
    ///
    /// Use it to compose the `*_in` calls with your own statements in one
    /// atomic commit. `f` runs exactly once, on the calling thread, on a
    /// pooled connection. Inside `f`, use only the `*_in` calls with the
    /// transaction given: the store's own write methods there return
    /// [`Error::Reentrant`] (they would take a second connection, and could
    /// wait forever on rows `f`'s transaction holds); the store's reads
    /// there work, each on a second pooled connection, and see what was
    /// committed before `f`'s transaction, not its own writes
    /// ([`PgIdempotencyKeys::get`] there reads an expired record as absent
    /// without deleting it). A statement that
    /// fails aborts the transaction on the server: return its error (to go
    /// on after a statement that may fail, run it in a savepoint,
    /// `tx.transaction()`). If `f` swallows such an error and returns `Ok`,
    /// nothing commits: the call rolls back and returns the server's
    /// [`Error::Postgres`] (SQLSTATE `25P02`, "current transaction is
    /// aborted").
    ///
    /// A call that returns `Err` wrote nothing, except when the connection
    /// is lost after the `COMMIT` was sent: then the transaction may have
    /// committed, and the error says so (SQLSTATE `08007`).
    pub fn write<T, E>(&self, f: impl FnOnce(&mut Transaction<'_>) -> Result<T, E>) -> Result<T, E>
    where
        E: From<Error>,
    {
        self.server
            .write_once(Access::Write, None, |_, tx| f(tx).map(Finish::Commit))
    }

    /// [`PgStore::write`], awaited, with an async closure given the
    /// client's own transaction: `store.write_async(|tx| Box::pin(async move
    /// { tx.execute(…).await?; Ok(…) }))`. The closure's future borrows the
    /// transaction only: move into it what else it needs. The `*_in_async`
    /// calls write in it; inside it, the store's `_async` calls take a
    /// connection of their own (never use them for writes there: they can
    /// wait forever on rows this transaction holds).
    ///
    /// Dropping the future before the closure's future ends rolls the
    /// transaction back (nothing of it commits); dropping it once the
    /// closure has returned `Ok` may leave the `COMMIT` to happen unseen.
    pub async fn write_async<T, E, F>(&self, f: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<Error> + Send + 'static,
        F: for<'t, 'c> FnOnce(
            &'t mut tokio_postgres::Transaction<'c>,
        ) -> BoxFuture<'t, Result<T, E>>,
    {
        self.server
            .write_once_async(Access::Write, None, |_, tx| {
                let out = f(tx);
                Box::pin(async move { out.await.map(Finish::Commit) })
            })
            .await
    }

    /// Runs `f` in a read-only transaction on a pooled connection, with
    /// one snapshot of the database for all its statements (`REPEATABLE
    /// READ`), and returns what it returns: your own queries on the store's
    /// pool, next to its tables. `f` runs exactly once, on the calling
    /// thread; a statement that writes fails (SQLSTATE `25006`). Inside a
    /// [`PgStore::write`] closure it takes a second connection, and does
    /// not see that closure's writes.
    pub fn read<T, E>(&self, f: impl FnOnce(&mut Transaction<'_>) -> Result<T, E>) -> Result<T, E>
    where
        E: From<Error>,
    {
        self.server
            .write_once(Access::Read, None, |_, tx| f(tx).map(Finish::Rollback))
    }

    /// [`PgStore::read`], awaited, with an async closure given the
    /// client's own transaction (as [`PgStore::write_async`]'s is).
    pub async fn read_async<T, E, F>(&self, f: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<Error> + Send + 'static,
        F: for<'t, 'c> FnOnce(
            &'t mut tokio_postgres::Transaction<'c>,
        ) -> BoxFuture<'t, Result<T, E>>,
    {
        self.server
            .write_once_async(Access::Read, None, |_, tx| {
                let out = f(tx);
                Box::pin(async move { out.await.map(Finish::Rollback) })
            })
            .await
    }

    /// The inbox called `name`: its own namespace of event keys. Names are
    /// 1–64 bytes of ASCII letters, digits, `_`, `-` and `.`.
    pub fn inbox(&self, name: &str) -> Result<PgInbox> {
        PgInbox::new(self.server.clone(), name)
    }

    /// The store's outbox. Every call returns a handle to the same outbox
    /// (sharing its wake-up subscribers).
    pub fn outbox(&self) -> PgOutbox {
        self.outbox.clone()
    }

    /// The store's HTTP idempotency-key records.
    pub fn idempotency_keys(&self) -> PgIdempotencyKeys {
        PgIdempotencyKeys::new(self.server.clone(), self.idempotency_counters.clone())
    }

    /// The names of the inboxes that hold at least one key, in byte order
    /// (as the embedded store lists them, whatever the database's
    /// collation).
    pub fn inbox_names(&self) -> Result<Vec<String>> {
        wait(self.inbox_names_async())
    }

    /// [`PgStore::inbox_names`], awaited.
    pub async fn inbox_names_async(&self) -> Result<Vec<String>> {
        inbox::names(&self.server).await
    }
}
