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
//! use chrono::Utc;
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

mod codec;
mod dispatch;
mod engine;
mod error;
mod idempotency;
mod inbox;
#[cfg(feature = "middleware")]
pub mod middleware;
mod outbox;
mod schema;
mod store;

pub use redb;

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
pub use outbox::{
    Enqueued, Fence, MAX_OUTBOX_FIELD_LEN, NewEntry, Outbox, OutboxClaim, OutboxCounts,
    OutboxEntry, OutboxFilter, OutboxId, OutboxRecord, OutboxStatus, SettledAndClaimed, Settlement,
};
pub use store::{
    CommitStats, DEFAULT_CACHE_SIZE, DEFAULT_FLUSH_INTERVAL, DEFAULT_JOURNAL_SIZE,
    DEFAULT_MAX_BATCH, DEFAULT_MAX_BODY, Store, StoreBuilder, StoreStats,
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
