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
//! ```
//! use idemstore::chrono::Utc;
//! use idemstore::{Claim, Store};
//! use idemstore::redb::{ReadableTable as _, TableDefinition};
//!
//! const BALANCES: TableDefinition<&str, i64> = TableDefinition::new("app.balances");
//!
//! # let dir = tempfile::tempdir().unwrap();
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
//! durable. Concurrent calls share fsyncs: see the `engine` notes in the
//! README for how group commit keeps those promises.
//!
//! # Several processes, one file
//!
//! By default a store file belongs to one process. Opened with
//! [`StoreBuilder::shared(true)`](StoreBuilder::shared) in every process
//! that uses it, one file serves several: a webhook receiver and a
//! dispatcher as two services, an app and its sync daemon, the `idemstore`
//! CLI beside a running program. Claims, reservations and outbox claims are
//! exactly-once across all of them; each commit is durable and costs about
//! twice an exclusive one; dispatchers wake when another process enqueues.
//!
//! # Calls block; from async code, use the blocking pool
//!
//! Every store call is blocking: a call that writes returns only once a
//! durable commit covers it (an fsync, a fraction of a millisecond on a quiet
//! disk, several milliseconds on a busy one), and a read may wait for the
//! fsync of a commit it saw. Made directly inside an `async fn`, a call holds
//! its runtime worker for that long, and on a `current_thread` runtime it
//! stops every other task.
//!
//! So in async code, run store calls on tokio's blocking pool with
//! [`tokio::task::spawn_blocking`](https://docs.rs/tokio/1/tokio/task/fn.spawn_blocking.html)
//! and `.await` the result. Every handle — [`Store`], [`Inbox`],
//! [`Outbox`], [`IdempotencyKeys`] — is a cheap `Clone + Send + Sync +
//! 'static` (an `Arc` inside), and the values the calls take and return
//! ([`Reservation`], [`NewEntry`], …) are `Send + Sync + 'static` too: clone
//! what the call needs and move it into the closure. The closure, and so every effect and
//! [`Store::write`] closure run inside it, executes on a pool thread: what it
//! captures must be `Send + 'static` (owned: a `String`, a `Bytes`, not a
//! `&str` borrowed from the request). Handlers on the pool share fsyncs
//! through group commit exactly as threads do; a panic in the closure rolls
//! its transaction back and reaches the `.await` as a `JoinError`.
//!
//! ```
//! use idemstore::chrono::Utc;
//! use idemstore::Inbox;
//!
//! type BoxError = Box<dyn std::error::Error + Send + Sync>;
//!
//! /// `Ok(true)` the first time `event_id` is delivered.
//! async fn on_delivery(inbox: &Inbox, event_id: String) -> Result<bool, BoxError> {
//!     let inbox = inbox.clone();
//!     // The outer `?`: the closure panicked (nothing was committed), or the
//!     // runtime is shutting down. The inner one: the store's own error.
//!     let first = tokio::task::spawn_blocking(move || inbox.claim(&event_id, Utc::now())).await??;
//!     Ok(first)
//! }
//!
//! #[tokio::main(flavor = "current_thread")]
//! async fn main() -> Result<(), BoxError> {
//!     let inbox = idemstore::Store::in_memory()?.inbox("webhooks")?;
//!     assert!(on_delivery(&inbox, "evt_1".to_owned()).await?);
//!     assert!(!on_delivery(&inbox, "evt_1".to_owned()).await?);
//!     Ok(())
//! }
//! ```
//!
//! The README shows an axum handler that claims a webhook, applies its effect
//! and enqueues an outbox entry in one commit this way. The [`Dispatcher`]
//! runs on threads of its own, and the HTTP middleware makes its store calls
//! on the blocking pool itself.
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
//! - `tokio`: the async dispatcher, on the caller's tokio runtime.
//! - `tracing`, `metrics`: spans and events, counters and histograms, through
//!   the facade crates; the application picks the subscriber or recorder.
//! - `postgres`: `postgres::PgStore`, the same inbox, outbox and idempotency
//!   keys on a PostgreSQL server, for programs that outgrow one process.
//! - `cli`: the `idemstore` operator binary.

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
mod codec;
pub mod dispatch;
mod engine;
mod error;
pub mod idempotency;
pub mod inbox;
#[cfg(feature = "middleware")]
#[cfg_attr(docsrs, doc(cfg(feature = "middleware")))]
pub mod middleware;
mod observe;
pub mod outbox;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
mod schema;
mod store;

// Crates whose types are part of the API, at the versions built against
// (see the crate docs).
pub use chrono;
pub use crossbeam_channel;
pub use redb;

pub use backend::{IdempotencyBackend, InboxBackend, OutboxBackend};
#[cfg(feature = "tokio")]
pub use dispatch::AsyncDispatcherHandle;
pub use dispatch::{
    Clock, DEFAULT_BATCH_SIZE, DEFAULT_CLAIM_LEASE, DEFAULT_JANITOR_INTERVAL, DEFAULT_RETENTION,
    DEFAULT_WORKERS, Delivery, DispatchStats, Dispatcher, DispatcherBuilder, DispatcherHandle,
    Janitor, JanitorReport, JanitorStats, LastError, LatencySummary, ManualClock,
    REASON_MAX_ATTEMPTS, REASON_PANIC, RetryPolicy, SystemClock,
};
pub use engine::Durability;
pub use error::{Error, Result};
pub use idempotency::{
    Begin, DEFAULT_LEASE, DEFAULT_TTL, IdempotencyKeys, IdempotencyStats, KeyEntry, KeyState,
    KeySummary, MAX_CONTENT_TYPE_LEN, MAX_FINGERPRINT_LEN, MAX_HEADER_NAME_LEN,
    MAX_HEADER_VALUE_LEN, MAX_HEADERS, MAX_IDEMPOTENCY_KEY_LEN, MAX_TENANT_LEN, Reservation,
    ResponseRecord, fingerprint,
};
pub use inbox::{Claim, Inbox, MAX_EVENT_KEY_LEN, MAX_INBOX_NAME_LEN};
pub use observe::describe_metrics;
pub use outbox::{
    AttemptRecord, Enqueued, Fence, MAX_ATTEMPT_HISTORY, MAX_OUTBOX_FIELD_LEN, NewEntry, Outbox,
    OutboxClaim, OutboxCounts, OutboxEntry, OutboxFilter, OutboxId, OutboxRecord, OutboxStatus,
    REASON_CANCELLED, REASON_OUTCOME_UNKNOWN, REASON_RESCHEDULED, SettledAndClaimed, Settlement,
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
