//! # idemstore
//!
//! An embedded, single-file store for **exactly-once effects**, built on
//! [redb]. No SQL, no server: link it into a desktop or edge program and get
//!
//! - an [`Inbox`]: each external event id (a webhook, a message) is recorded
//!   once, and its effect — a closure — commits in the same transaction as the
//!   claim;
//! - a transactional [`Outbox`]: side effects awaiting dispatch;
//! - [`IdempotencyKeys`]: an HTTP `Idempotency-Key` response store.
//!
//! Each has a chapter: [`inbox`], [`outbox`] and its [`dispatch`]er,
//! [`idempotency`]; the HTTP layer is `middleware` and the same store on
//! PostgreSQL is `postgres` (cargo features of those names). Every item of
//! the four chapters is also re-exported at the crate root:
//! `idemstore::Inbox` is `idemstore::inbox::Inbox`.
//!
//! ```
//! use idemstore::chrono::Utc;
//! use idemstore::{Claim, Store};
//! use idemstore::redb::{ReadableTable as _, TableDefinition};
//!
//! const BALANCES: TableDefinition<&str, i64> = TableDefinition::new("app.balances");
//!
//! # let dir = tempfile::tempdir().map_err(idemstore::Error::Io)?;
//! let store = Store::open(dir.path().join("app.idem"))?;
//! let webhooks = store.inbox("webhooks")?;
//!
//! // The same delivery twice: the effect runs once.
//! for _ in 0..2 {
//!     let outcome = webhooks.claim_with("evt_123", Utc::now(), |tx| {
//!         let mut balances = tx.open_table(BALANCES).map_err(idemstore::Error::from)?;
//!         let old = balances.get("alice").map_err(idemstore::Error::from)?.map_or(0, |v| v.value());
//!         balances.insert("alice", old + 10).map_err(idemstore::Error::from)?;
//!         Ok::<_, idemstore::Error>(old + 10)
//!     })?;
//!     println!("{outcome:?}");
//! }
//! assert!(webhooks.seen("evt_123")?);
//! assert_eq!(webhooks.len()?, 1);
//! # Ok::<_, idemstore::Error>(())
//! ```
//!
//! Every `Ok` is durable when it returns (under the default
//! [`Durability::Immediate`]), and no call answers from state that is not yet
//! durable. Concurrent calls share fsyncs (group commit): how that keeps
//! those promises, with the figures, is argued in the repository's
//! `docs/design.md`.
//!
//! # Several processes, one file
//!
//! By default a store file belongs to one process: a second open, from another
//! process or another `Store` in this one, is [`Error::AlreadyOpen`]. Opened
//! with [`StoreBuilder::shared(true)`](StoreBuilder::shared) in every process
//! that uses it, one file serves several: a webhook receiver and a dispatcher
//! as two services, an app and its sync daemon, the `idemstore` CLI beside a
//! running program.
//!
//! ```
//! # let dir = tempfile::tempdir().map_err(idemstore::Error::Io)?;
//! # let path = dir.path().join("app.idem");
//! use idemstore::chrono::Utc;
//!
//! let receiver = idemstore::Store::builder().shared(true).open(&path)?;
//! let dispatcher = idemstore::Store::builder().shared(true).open(&path)?; // another process, in real life
//! assert!(receiver.inbox("webhooks")?.claim("evt_1", Utc::now())?);
//! assert!(!dispatcher.inbox("webhooks")?.claim("evt_1", Utc::now())?);
//! # Ok::<_, idemstore::Error>(())
//! ```
//!
//! (Two `Store`s opened shared in one process behave as two processes do,
//! which is how most of `tests/shared.rs` tests it; the rest runs real
//! processes.)
//!
//! What it promises: everything the store promises, across processes. A key is
//! claimed once and its effect runs once; an outbox entry is claimed by one
//! dispatcher at a time, and a dispatcher's reaper in one process releases the
//! claims of a dispatcher killed in another; a reservation holds its key
//! against every process; every `Ok` is durable and no process answers from a
//! commit that is not on disk. Dispatchers wake when another process enqueues
//! (see [the outbox's wake-ups](outbox#wake-ups)).
//!
//! What it costs: one write transaction at a time across all processes (file
//! locks), and two fsyncs per commit instead of one, so a commit costs about
//! twice an exclusive one; group commit still shares them among each
//! process's callers. [`Durability::None`] is refused
//! ([`Error::InvalidInput`] at open). A process that sees another's commit
//! starts its next transaction from cold caches. Counters (`commit_stats`,
//! dispatcher and key stats, metrics) are per process.
//! [`Store::compact`] needs the other processes stopped. The figures are in
//! `docs/design.md`.
//!
//! # From async code: the `_async` calls (feature `tokio`)
//!
//! Every store call blocks: a call that writes returns only once a
//! durable commit covers it (an fsync, a fraction of a millisecond on a
//! quiet disk, several milliseconds on a busy one), and a read may wait for
//! the fsync of a commit it saw. Made directly inside an `async fn`, a call
//! holds its runtime worker for that long, and on a `current_thread`
//! runtime it stops every other task.
//!
//! With feature `tokio`, the calls a handler makes on the embedded store
//! have an awaitable form of the same name with `_async`, the same
//! arguments, answers and errors ([`Inbox::claim_async`](https://docs.rs/idemstore/latest/idemstore/inbox/struct.Inbox.html#method.claim_async),
//! `claim_many_async`, `claim_with_async`; [`Outbox::enqueue_async`](https://docs.rs/idemstore/latest/idemstore/outbox/struct.Outbox.html#method.enqueue_async),
//! `enqueue_many_async`, `claim_due_async`, `claim_async`,
//! `settle_async`, `settle_many_async`, `settle_and_claim_async`,
//! `settle_and_claim_with_async`, `get_async`, `next_due_async`, and the
//! operator's `requeue_async`,
//! `reschedule_async`, `cancel_async`, `mark_completed_async`,
//! `mark_failed_async`; [`IdempotencyKeys::begin_async`](https://docs.rs/idemstore/latest/idemstore/idempotency/struct.IdempotencyKeys.html#method.begin_async), `complete_async`,
//! `release_async`; [`Store::write_async`](https://docs.rs/idemstore/latest/idemstore/struct.Store.html#method.write_async), [`Store::read_async`](https://docs.rs/idemstore/latest/idemstore/struct.Store.html#method.read_async)). Their
//! documentation is the blocking call's; what they add:
//!
//! - **No thread waits.** A task's operation joins the same group commit
//!   as threads' operations, and the task is woken when its batch is
//!   durable. When a task's operation would lead a batch, the store's task
//!   leader (one thread per store) leads it instead, so 2,000 tasks
//!   waiting on a store hold no thread between them. A closure
//!   (`write_async`, `claim_with_async`) runs on tokio's blocking pool
//!   only while it runs, not while its commit waits for the fsync.
//! - **Cancellation.** Nothing happens before a future's first poll.
//!   Dropped after it, the call's one operation may still commit with its
//!   batch, with nobody told, and is never half done: a claim and its
//!   effect commit together or not at all. Each call's documentation says
//!   what a dropped one may have committed.
//! - The futures are `Send`; a panic of the store's own code (or of a
//!   closure) resumes in the awaiting task.
//!
//! The PostgreSQL backend (`postgres::PgStore`) has an `_async` form of
//! every call as well, which awaits its connection pool on the caller's
//! runtime. A blocking call made from async code anyway (a call with no
//! `_async` form of your own, say) belongs on tokio's blocking pool, through
//! [`tokio::task::spawn_blocking`](https://docs.rs/tokio/1/tokio/task/fn.spawn_blocking.html).
//! Every handle — [`Store`], [`Inbox`], [`Outbox`], [`IdempotencyKeys`] —
//! is a cheap `Clone + Send + Sync + 'static` (an `Arc` inside), and the
//! values the calls take and return ([`Reservation`], [`NewEntry`], …) are
//! `Send + Sync + 'static` too, so a task or a closure takes what it needs
//! by value.
//!
//! ```
//! # #[cfg(feature = "tokio")]
//! # mod with_tokio {
//! use idemstore::chrono::Utc;
//! use idemstore::Inbox;
//!
//! /// `Ok(true)` the first time `event_id` is delivered; the task waits for
//! /// the fsync without holding a thread.
//! pub async fn on_delivery(inbox: &Inbox, event_id: &str) -> idemstore::Result<bool> {
//!     inbox.claim_async(event_id, Utc::now()).await
//! }
//! # }
//! # #[cfg(feature = "tokio")]
//! # fn main() -> idemstore::Result<()> {
//! # use with_tokio::on_delivery;
//! let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(idemstore::Error::Io)?;
//! let inbox = idemstore::Store::in_memory()?.inbox("webhooks")?;
//! assert!(rt.block_on(on_delivery(&inbox, "evt_1"))?);
//! assert!(!rt.block_on(on_delivery(&inbox, "evt_1"))?);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "tokio"))]
//! # fn main() {}
//! ```
//!
//! The [`inbox`] chapter shows an axum handler that claims a webhook, applies
//! its effect and enqueues an outbox entry in one commit. The
//! [`Dispatcher`] runs on threads of its own
//! ([`DispatcherBuilder::start`]) or, with feature `tokio`, as tasks on your
//! runtime (`DispatcherBuilder::start_async`), whose workers use the
//! `_async` calls; the HTTP middleware awaits the `_async` forms of the
//! idempotency-key calls.
//!
//! # Re-exported crates
//!
//! Types of these crates appear in the API, so they are re-exported at the
//! versions this crate is built with: [`redb`] (the transaction handed to
//! effects, and your own tables in the same file), [`chrono`] (every instant
//! is a `chrono::DateTime<Utc>`) and [`crossbeam_channel`] (the
//! [`Receiver`](crossbeam_channel::Receiver) of [`Outbox::subscribe`], to
//! `select!` on it with your own channels).
//!
//! ```
//! use idemstore::crossbeam_channel::{Receiver, select};
//! use idemstore::Outbox;
//!
//! /// Waits for a wake-up of `outbox` or a message on `stop`.
//! fn wait(outbox_wake_ups: &Receiver<()>, stop: &Receiver<()>) -> bool {
//!     select! {
//!         recv(outbox_wake_ups) -> _ => true,
//!         recv(stop) -> _ => false,
//!     }
//! }
//!
//! let outbox: Outbox = idemstore::Store::in_memory()?.outbox();
//! let wake_ups = outbox.subscribe();
//! let (_stop_tx, stop) = idemstore::crossbeam_channel::bounded(1);
//! outbox.notify();
//! assert!(wait(&wake_ups, &stop));
//! # Ok::<_, idemstore::Error>(())
//! ```
//!
//! # Cargo features
//!
//! None is on by default.
//!
//! - `middleware`: `middleware::IdempotencyLayer`, a tower layer that puts
//!   the idempotency keys in front of any tower 0.5 service over `http` 1
//!   types (axum 0.8, hyper 1).
//! - `tokio`: the async dispatcher, as tasks on the caller's tokio runtime
//!   (see [`dispatch`]).
//! - `tracing`, `metrics`: events, counters and histograms, through the
//!   facade crates (see [Observability](#observability)).
//! - `postgres`: `postgres::PgStore`, the same inbox, outbox and idempotency
//!   keys on a PostgreSQL server, for programs that outgrow one machine,
//!   and `migrate::to_postgres`, which copies a store file there.
//! - `postgres-tls`: TLS for `postgres`: the connection string's `sslmode`
//!   (`disable` … `verify-full`) and `sslrootcert`, as libpq reads them,
//!   through rustls (see `postgres`'s "TLS").
//! - `cli`: the `idemstore` operator binary (the repository's `docs/cli.md`).
//! - `console`: `console::Console`, the operator console's pages and
//!   actions as an axum router over either backend (read-only unless
//!   writes are allowed).
//! - `testing`: `testing`, for the tests of an application built on the
//!   store (enable it under `[dev-dependencies]`): a store in memory with a
//!   manual clock, assertions on what was enqueued and claimed, `drain` to
//!   run the outbox on the test's thread, and a disk that fails or panics.
//! - `webhooks`: `webhooks::Verifier`, which checks Standard Webhooks,
//!   Stripe and GitHub signatures on a delivery's raw body before anything
//!   reads it, and `webhooks::sign` for the Standard Webhooks header;
//!   `webhooks::Sender`, a dispatcher's `send` that POSTs each entry signed;
//!   `webhooks::Receiver` (and `PgReceiver`), which verifies a delivery and
//!   claims it in an inbox in its effect's own transaction.
//! - `cron`: `Schedule::cron`, periodic entries at the instants of a cron
//!   expression (interval schedules need no feature).
//! - `tz`: `Schedule::time_zone`, cron schedules in a named time zone
//!   (jiff's bundled database and its daylight-saving rules).
//!
//! # Glossary
//!
//! One word for each thing, in these docs and in the code:
//!
//! - **claim** — recording an event key in an [`inbox`] for the first time
//!   (`Inbox::claim`); also the hold a dispatcher takes on an outbox entry
//!   while it sends it (`Outbox::claim_due`, [`OutboxClaim`]). A *duplicate*
//!   is a later delivery of a claimed key.
//! - **effect** — the caller's closure that commits with a claim
//!   (`Inbox::claim_with`).
//! - **entry** — one side effect in the [`outbox`]; its **due time** is
//!   `next_attempt_at` (or `created_at` when absent).
//! - **settle** — end a dispatcher's attempt: completed, retried, failed or
//!   outcome unknown ([`Settlement`]); a **fence** (the attempt number)
//!   keeps a stale dispatcher from settling an entry claimed again.
//! - **reservation** — the hold a request's `begin` takes on an
//!   idempotency key for the lease ([`Reservation`]); **complete** stores
//!   its response, **release** lets a retry run.
//! - **operation** — one of the store's own calls, queued and run by the
//!   engine in a batch with others (group commit); a **caller closure**
//!   (`Store::write`, an effect) runs on its caller's thread instead.
//! - **durable** — on disk: survives a crash or a power loss (D1, D2).
//! - **shared** — only the several-processes mode of a file
//!   (`StoreBuilder::shared`); nothing else is called shared.
//! - **cutoff** — a time parameter named by the time it is compared with:
//!   `seen_before` (an inbox key's claim time), `claimed_before` (an
//!   entry's claim time), `finished_before` (an entry's `completed_at`),
//!   `expired_before` (an idempotency record's creation time, against its
//!   TTL).
//!
//! # Observability
//!
//! Two cargo features report what the store and the dispatcher do, through the
//! usual facades; your program picks the subscriber and the recorder (for
//! example `tracing-subscriber` and `metrics-exporter-prometheus`):
//!
//! ```toml
//! idemstore = { version = "0.1", features = ["tracing", "metrics"] }
//! ```
//!
//! - `tracing`: events of the [`tracing`](https://docs.rs/tracing/0.1) crate,
//!   under the targets below.
//! - `metrics`: counters, gauges and histograms of the
//!   [`metrics`](https://docs.rs/metrics/0.24) crate, named `idemstore_*`.
//!
//! Without the features nothing is compiled in: each report is an empty
//! function. With them, label values are static strings, the inbox name the
//! inbox already holds, or a destination's label, so a report allocates
//! nothing beyond what the facades do. Destination labels come from a bounded
//! set, so that a process sending to many destinations never grows its
//! recorder without end: the first 64 distinct destinations a process reports
//! get their own name as their label, every later one shares `_other`, for
//! the life of the process (the tracing events always carry the name). A claim or a completion made inside your own `Store::write`
//! (`Inbox::claim_in`, `IdempotencyKeys::complete_in`) is counted once that
//! transaction commits, never if it rolls back, in the metrics and in
//! `IdempotencyStats` alike. On PostgreSQL the same holds inside
//! `PgStore::write` (and a `claim_with` effect); a `*_in` call on a
//! transaction of a client of your own, whose commit the store cannot see, is
//! counted when the call returns. Both backends report the same metrics with
//! the same meanings, with two differences: the engine's own
//! (`idemstore_commits_total`, `idemstore_commit_seconds`,
//! `idemstore_batch_ops`, and the `during` values of a store that refuses
//! writes) are the embedded store's only, since on PostgreSQL the server
//! commits (see its own statistics, `pg_stat_database`); and the outbox gauge
//! comes from a count query there (see its row).
//!
//! Every metric is described (`# HELP` text and unit, as a Prometheus exporter
//! shows them) each time a store is opened (`Store::open`, `StoreBuilder`,
//! `PgStore::connect`): install the recorder first, as usual, and there is
//! nothing more to do. If your recorder is installed after the stores are
//! open, call `idemstore::describe_metrics()` once it is; calling it again is
//! harmless.
//!
//! | metric | type | labels | what it measures |
//! |---|---|---|---|
//! | `idemstore_commits_total` | counter | `durable` (`true`, `false`) | write transactions committed: durable (fsynced) batches, and the caller's own transactions (`Store::write`, `claim_with` effects), which commit without fsync and are made durable by the next durable batch. Matches `Store::commit_stats` |
//! | `idemstore_commit_seconds` | histogram | `durable` | time of each commit, the fsync included for a durable one |
//! | `idemstore_batch_ops` | histogram | — | store operations per batch commit (group commit at work: above 1 under load) |
//! | `idemstore_inbox_claims_total` | counter | `inbox` | first deliveries claimed |
//! | `idemstore_inbox_duplicates_total` | counter | `inbox` | deliveries found claimed already (their effect did not run) |
//! | `idemstore_idempotency_begins_total` | counter | `outcome`: `proceed`, `takeover`, `replay`, `in_flight`, `mismatch` | answers of `IdempotencyKeys::begin` (`takeover`: a `Proceed` that replaced a reservation whose lease ended; `in_flight` is the 409, `mismatch` the 422) |
//! | `idemstore_idempotency_completions_total` | counter | `outcome`: `stored`, `fenced_out` | `complete` / `complete_in` calls: response stored, or refused because another request took the key over once the lease ended (raise the lease if these grow). A `complete` that finds the response its own reservation already stored (the `IdempotencyLayer`'s, after a handler's `complete_in`) counts nothing: it is neither |
//! | `idemstore_outbox_entries` | gauge | `status`: `pending`, `dispatching`, `completed`, `failed`, `outcome_unknown` | outbox entries in each status. Embedded: set from the outbox's status counters after every commit that writes the outbox, exact. PostgreSQL: the server keeps no such counters (one row that every write of every process updates would serialize them all), so the gauge is set from `PgOutbox::counts` (`SELECT status, count(*) … GROUP BY status`, which reads every row): by each `counts` call, and by this process's outbox writes (enqueue, claim, settle, operator calls) at most once every 5 s per store; it counts every process's entries and may lag by that much. One gauge set per process: with several stores, the last one set |
//! | `idemstore_dispatch_outcomes_total` | counter | `outcome`: `delivered`, `retried`, `failed`, `outcome_unknown`, `returned`; `destination` (the first 64 a process reports; then `_other`) | how dispatchers settled each attempt (`returned`: given back unsent at shutdown; `retried` includes `Throttled`); summed over destinations, the same counts as `DispatchStats` |
//! | `idemstore_dispatch_send_seconds` | histogram | `outcome`, `destination` | how long each `send` took |
//! | `idemstore_dispatch_in_flight` | gauge | `destination` | sends in flight now, summed over the process's dispatchers (each adds a send as it starts and takes it off as it ends) |
//! | `idemstore_dispatch_latency_seconds` | histogram | — | enqueue → start of the first send, for entries due at once (`DispatchStats::latency`) |
//! | `idemstore_dispatch_fenced_total` | counter | — | settlements refused because the claim had expired and the entry moved on |
//! | `idemstore_dispatch_panics_total` | counter | — | sends that panicked (retried as failures with reason `panic`) |
//! | `idemstore_reaper_released_total` | counter | — | expired claims the reaper released (a dispatcher died, or its sends outlasted the lease) |
//! | `idemstore_janitor_removed_total` | counter | `what`: `outbox`, `inbox`, `keys` | rows removed by janitor runs |
//! | `idemstore_errors_total` | counter | `during` | errors reported below: a dispatcher's failed store call (`claim`, `settle`, `next_due`, `reaper`, `janitor`), a shared store's failed look at other processes' commits (`watch`), a dispatcher thread stopped by a panic (`a dispatcher worker thread`, `the dispatcher's reaper thread`, `the dispatcher's janitor thread`), a store that refuses writes until reopened (`a batch commit`, `beginning a batch`, `a batch rollback`, `a caller's commit`), the `IdempotencyLayer`'s failed store calls (`idempotency_begin`: answered 503; `idempotency_complete`, `idempotency_release`: after the handler ran) and requests it got outside a tokio runtime (`middleware_runtime`: answered 500) |
//!
//! Durations are in seconds in histograms and in whole microseconds (`*_us`)
//! in events.
//!
//! | target | level | event (message) and fields |
//! |---|---|---|
//! | `idemstore::engine` | `trace` | `batch committed`: `ops`, `durable`, `commit_us`; `caller transaction committed`: `durable`, `commit_us` |
//! | `idemstore::engine` | `error` | `the store refuses writes until it is reopened`: `during`, `error` (a failed commit or a panic while committing; once per store) |
//! | `idemstore::dispatch` | `debug` / `info` / `warn` | `attempt`: `id`, `destination`, `attempt`, `outcome`, `reason` (failures), `latency_us` (the send's time); `debug` when delivered or returned, `info` when retried, `warn` when failed for good or outcome unknown |
//! | `idemstore::dispatch` | `warn` | `store call failed; backing off`: `during`, `error`; `reaper released expired claims: …`: `released`; `settlement refused: …`: `settlements`; `send panicked; retried as a failure`: `sends` |
//! | `idemstore::dispatch` | `error` | `thread stopped by a panic`: `during`, `error` |
//! | `idemstore::janitor` | `info` | `janitor run`: `outbox_purged`, `inbox_pruned`, `keys_purged`, `run_us` (runs by a dispatcher and by hand) |
//! | `idemstore::middleware` | `debug` | answers the `IdempotencyLayer` made from the store: `stored response replayed`: `key`; `request in flight; answered 409`: `key`, `retry_after_s`; `key reused for another request; answered 422`: `key` |
//! | `idemstore::middleware` | `error` | `idempotency store failed; answered 503`: `during` (`idempotency_begin`), `key`, `error`; `no tokio runtime: …; answered 500`: `during` (`middleware_runtime`), `key` |
//! | `idemstore::middleware` | `warn` | `idempotency store failed after the handler ran`: `during` (`idempotency_complete`, `idempotency_release`), `key`, `error` (the client got the handler's response; the key is left to its lease) |

// Storage code answers bad bytes and bad input with an `Error`, never a
// panic: no unwrap, no expect (the codec's one, which cannot fire, is
// allowed by name where it stands), no indexing that could be out of range.
// Tests are exempt (see clippy.toml).
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
// docs.rs marks each feature-gated item with the feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

/// The README's code samples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod backend;
mod backup;
mod codec;
#[cfg(feature = "console")]
#[cfg_attr(docsrs, doc(cfg(feature = "console")))]
pub mod console;
pub mod dispatch;
mod engine;
mod error;
pub mod idempotency;
pub mod inbox;
#[cfg(feature = "middleware")]
#[cfg_attr(docsrs, doc(cfg(feature = "middleware")))]
pub mod middleware;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod migrate;
mod observe;
pub mod outbox;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
mod schema;
mod store;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
#[cfg(feature = "webhooks")]
#[cfg_attr(docsrs, doc(cfg(feature = "webhooks")))]
pub mod webhooks;

// Crates whose types are part of the API, at the versions built against
// (see the crate docs).
pub use chrono;
pub use crossbeam_channel;
pub use redb;

pub use backend::{IdempotencyBackend, InboxBackend, OutboxAdmin, OutboxBackend, StoreAdmin};
#[cfg(feature = "tokio")]
pub use dispatch::AsyncDispatcherHandle;
pub use dispatch::{
    Clock, DEFAULT_BATCH_SIZE, DEFAULT_CLAIM_LEASE, DEFAULT_JANITOR_INTERVAL, DEFAULT_RETENTION,
    DEFAULT_WORKERS, Delivery, DispatchStats, Dispatcher, DispatcherBuilder, DispatcherHandle,
    Janitor, JanitorReport, JanitorStats, LastError, LatencySummary, ManualClock,
    REASON_MAX_ATTEMPTS, REASON_PANIC, RetryPolicy, SystemClock,
};
pub use engine::Durability;
pub use error::{Error, ErrorKind, Result};
pub use idempotency::{
    Begin, DEFAULT_LEASE, DEFAULT_TTL, IdempotencyKeys, IdempotencyStats, KeyEntry, KeyState,
    KeySummary, MAX_CONTENT_TYPE_LEN, MAX_FINGERPRINT_LEN, MAX_HEADER_NAME_LEN,
    MAX_HEADER_VALUE_LEN, MAX_HEADERS, MAX_IDEMPOTENCY_KEY_LEN, MAX_TENANT_LEN, Reservation,
    ResponseRecord, fingerprint,
};
pub use inbox::{Claim, Inbox, MAX_EVENT_KEY_LEN, MAX_INBOX_NAME_LEN};
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub use observe::describe_metrics;
pub use outbox::{
    AttemptRecord, CircuitState, ClaimRequest, DestinationPolicy, DestinationState, Enqueued,
    Fence, MAX_ATTEMPT_HISTORY, MAX_COOL_DOWN_FACTOR, MAX_OUTBOX_FIELD_LEN, MAX_PRIORITY,
    MatchingChange, MatchingStep, NewEntry, Outbox, OutboxClaim, OutboxCounts, OutboxEntry,
    OutboxFilter, OutboxId, OutboxRecord, OutboxStatus, ParseOutboxStatusError, PolicyLimits,
    REASON_CANCELLED, REASON_OUTCOME_UNKNOWN, REASON_RESCHEDULED, SettledAndClaimed, Settlement,
};
pub use outbox::{
    MAX_MISSED_SLOTS, MAX_SCHEDULE_NAME_LEN, Missed, ON_TIME, SLOT_KEY_PREFIX, Schedule,
    ScheduleInfo,
};
pub use store::{
    CommitStats, DEFAULT_CACHE_SIZE, DEFAULT_FLUSH_INTERVAL, DEFAULT_JOURNAL_SIZE,
    DEFAULT_MAX_BATCH, DEFAULT_MAX_BODY, DEFAULT_SHARED_POLL_INTERVAL, Store, StoreBuilder,
    StoreStats,
};

// The handles, the errors and the values a caller hands to another thread are
// `Send + Sync + 'static`: a change that loses either fails the build here.
const _: () = {
    const fn send_sync<T: Send + Sync + 'static>() {}

    // Handles and builders.
    send_sync::<Store>();
    send_sync::<StoreBuilder>();
    send_sync::<Inbox>();
    send_sync::<Outbox>();
    send_sync::<IdempotencyKeys>();
    send_sync::<Reservation>();
    send_sync::<Dispatcher>();
    send_sync::<DispatcherBuilder>();
    send_sync::<DispatcherHandle>();
    send_sync::<Janitor>();
    send_sync::<SystemClock>();
    send_sync::<ManualClock>();
    // Errors.
    send_sync::<Error>();
    send_sync::<LastError>();
    // Values.
    send_sync::<Claim<()>>();
    send_sync::<NewEntry>();
    send_sync::<Enqueued>();
    send_sync::<OutboxEntry>();
    send_sync::<OutboxRecord>();
    send_sync::<OutboxClaim>();
    send_sync::<AttemptRecord>();
    send_sync::<Fence>();
    send_sync::<Settlement>();
    send_sync::<SettledAndClaimed>();
    send_sync::<Delivery>();
    send_sync::<Begin>();
    send_sync::<ResponseRecord>();
    send_sync::<KeyEntry>();
    // Statistics a monitoring thread reads.
    send_sync::<CommitStats>();
    send_sync::<StoreStats>();
    send_sync::<DispatchStats>();
    send_sync::<JanitorStats>();
    send_sync::<JanitorReport>();
};

// The async dispatcher's handle moves between tasks and threads.
#[cfg(feature = "tokio")]
const _: () = {
    const fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<AsyncDispatcherHandle>();
};

// The PostgreSQL store and its handles cross threads like the embedded ones.
#[cfg(feature = "postgres")]
const _: () = {
    const fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<postgres::PgStore>();
    send_sync::<postgres::PgStoreBuilder>();
    send_sync::<postgres::PgInbox>();
    send_sync::<postgres::PgOutbox>();
    send_sync::<postgres::PgIdempotencyKeys>();
};

// A verifier is built once and shared by every request's task; its
// answers cross to whatever handles the delivery.
#[cfg(feature = "webhooks")]
const _: () = {
    const fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<webhooks::Secret>();
    send_sync::<webhooks::Verifier>();
    send_sync::<webhooks::Verified>();
    send_sync::<webhooks::VerifyError>();
};

// The layer and its service cross threads with the server that runs them; the
// service is `Send + Sync` when the service it wraps is, and its future `Send`.
#[cfg(feature = "middleware")]
const _: () = {
    const fn send_sync<T: Send + Sync + 'static>() {}
    const fn send<T: Send + 'static>() {}

    send_sync::<middleware::IdempotencyLayer>();
    send_sync::<middleware::IdempotencyService<()>>();
    send::<middleware::ResponseFuture<Error>>();
};
