//! The inbox: a dedup ledger of external event ids, so that each delivery's
//! effect runs once.
//!
//! Each event key (a webhook id, a message id) is recorded once per
//! [`Inbox`]. The first delivery of a key claims it; every later delivery —
//! a duplicate, a replay, a concurrent retry, an out-of-order one — is told
//! so, and its effect does not run. An inbox is a name inside the store file
//! ([`Store::inbox`](crate::Store::inbox)); a store holds any number of them.
//!
//! ```
//! use idemstore::chrono::Utc;
//! use idemstore::redb::{ReadableTable as _, TableDefinition};
//! use idemstore::{Claim, Store};
//!
//! // Your own tables live in the same file, through the re-exported redb.
//! const BALANCES: TableDefinition<&str, i64> = TableDefinition::new("app.balances");
//!
//! # let dir = tempfile::tempdir().map_err(idemstore::Error::Io)?;
//! let store = Store::open(dir.path().join("app.idem"))?;
//! let payments = store.inbox("payments")?;
//! for delivery in ["evt_1", "evt_1", "evt_2"] {
//!     let outcome = payments.claim_with(delivery, Utc::now(), |tx| {
//!         // Runs once per event id; commits together with the claim, or not at all.
//!         let mut balances = tx.open_table(BALANCES)?;
//!         let old = balances.get("alice")?.map_or(0, |v| v.value());
//!         balances.insert("alice", old + 10)?;
//!         Ok::<_, idemstore::Error>(old + 10)
//!     })?;
//!     match outcome {
//!         Claim::Applied(balance) => println!("{delivery}: credited, balance {balance}"),
//!         Claim::Duplicate => println!("{delivery}: seen before; nothing done"),
//!     }
//! }
//! assert_eq!(payments.len()?, 2);
//! # Ok::<_, idemstore::Error>(())
//! ```
//!
//! # Claims
//!
//! - [`Inbox::claim`]`(key, now)`: `true` the first time, `false` ever
//!   after, concurrent deliveries included.
//! - [`Inbox::claim_with`]`(key, now, effect)`: the claim and the effect
//!   commit in one write transaction, or neither does. An effect that
//!   returns `Err` or panics leaves the key unclaimed and nothing written
//!   (a later delivery runs it again; a panic reaches you and the file is
//!   left clean). The effect runs on your thread, at most once.
//! - [`Inbox::claim_in`]`(tx, key, now)`, inside your own
//!   [`Store::write`](crate::Store::write): claims, your own tables and
//!   outbox entries ([`Outbox::enqueue_in`](crate::Outbox::enqueue_in))
//!   compose in one commit.
//! - [`Inbox::claim_many`]`(keys, now)`: many keys in one commit.
//!
//! Each returns once the claim, or the claim it collided with, is durable:
//! a `false` or a [`Claim::Duplicate`] is never answered from a claim a
//! crash could still undo. Times are passed in by the caller: storage calls
//! never read the clock, so tests are deterministic.
//!
//! # Composing a claim in one commit, from async code
//!
//! An axum handler that claims a webhook, applies its effect and enqueues
//! an outbox entry in one commit, without blocking the runtime: the store
//! call runs on tokio's blocking pool. It needs no feature of idemstore,
//! only `axum`, `tokio` and `tower` of your own. (With the feature `tokio`,
//! [`Store::write_async`](https://docs.rs/idemstore/latest/idemstore/struct.Store.html#method.write_async)
//! runs the same closure and waits for its fsync without holding a pool
//! thread: see [the crate docs](crate).)
//!
//! ```
//! use axum::body::{Body, Bytes};
//! use axum::extract::State;
//! use axum::http::{HeaderMap, Request, StatusCode};
//! use axum::{Router, routing::post};
//! use idemstore::chrono::Utc;
//! use idemstore::redb::TableDefinition;
//! use idemstore::{Inbox, NewEntry, Outbox, Store};
//! use tower::ServiceExt as _; // `oneshot`, to call the router without a socket
//!
//! const ORDERS: TableDefinition<&str, &[u8]> = TableDefinition::new("app.orders");
//!
//! #[derive(Clone)]
//! struct App {
//!     store: Store,
//!     webhooks: Inbox,
//!     outbox: Outbox,
//! }
//!
//! async fn webhook(State(app): State<App>, headers: HeaderMap, body: Bytes) -> StatusCode {
//!     let Some(event_id) = headers.get("webhook-id").and_then(|v| v.to_str().ok()) else {
//!         return StatusCode::BAD_REQUEST;
//!     };
//!     let event_id = event_id.to_owned(); // owned: the closure below is `Send + 'static`
//!     let outcome = tokio::task::spawn_blocking(move || {
//!         let now = Utc::now();
//!         app.store.write(|tx| {
//!             if !app.webhooks.claim_in(tx, &event_id, now)? {
//!                 return Ok(false); // seen before: nothing is written
//!             }
//!             // The claim, the effect and the outbox entry commit together, or not at all.
//!             let mut orders = tx.open_table(ORDERS)?;
//!             orders.insert(event_id.as_str(), body.as_ref())?;
//!             let receipt = NewEntry::new(&event_id, "mailer", format!("{event_id}/receipt"), body.to_vec());
//!             app.outbox.enqueue_in(tx, receipt, now)?;
//!             Ok::<_, idemstore::Error>(true)
//!         })
//!     })
//!     .await;
//!     match outcome {
//!         Ok(Ok(true)) => StatusCode::CREATED,
//!         Ok(Ok(false)) => StatusCode::OK, // a duplicate delivery, acknowledged again
//!         // A store error, or a panic in the closure (its transaction rolled back):
//!         // not acknowledged, so the sender retries.
//!         Ok(Err(_)) | Err(_) => StatusCode::SERVICE_UNAVAILABLE,
//!     }
//! }
//!
//! fn router(store: Store) -> idemstore::Result<Router> {
//!     let app = App { webhooks: store.inbox("webhooks")?, outbox: store.outbox(), store };
//!     Ok(Router::new().route("/webhooks", post(webhook)).with_state(app))
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//!     let dir = tempfile::tempdir()?;
//!     let store = Store::open(dir.path().join("app.idem"))?; // once, at start-up
//!     let app = router(store.clone())?;
//!     // A server would run `axum::serve(listener, app).await`; here the same
//!     // delivery goes to the router twice.
//!     for expected in [StatusCode::CREATED, StatusCode::OK] {
//!         let delivery = Request::post("/webhooks").header("webhook-id", "evt_1").body(Body::from("{}"))?;
//!         assert_eq!(app.clone().oneshot(delivery).await?.status(), expected);
//!     }
//!     let outbox = store.outbox();
//!     let counts = tokio::task::spawn_blocking(move || outbox.counts()).await??;
//!     assert_eq!(counts.pending, 1); // one receipt, for the dispatcher to send
//!     Ok(())
//! }
//! ```
//!
//! A panic in the closure reaches the `.await` as a `JoinError`
//! (`std::panic::resume_unwind(e.into_panic())` resumes it, if you would
//! rather crash the task); the transaction it was in is rolled back and the
//! file left clean. `tests/async_handlers.rs` holds this to account on a
//! `current_thread` runtime: a ticking task keeps ticking while 200 claims
//! with effects run, and concurrent handlers delivering one webhook id
//! apply its effect once.
//!
//! # Forgetting old keys
//!
//! [`Inbox::prune`]`(before)` forgets the keys claimed before `before`, in
//! time proportional to what it removes, committing 1024 keys at a time so
//! that claims go on between the chunks. A pruned key can be claimed again:
//! prune only past the window in which duplicates can still arrive (a
//! [`Janitor`](crate::Janitor) can do it on a schedule).
//!
//! # Layout
//!
//! The ledger `(inbox, key) → seen_at`, its prune index
//! `(inbox, seen_at, key)` and the per-inbox count of its rows. A durable
//! store's claims first go to a journal of recent claims that grows at its
//! end, and reach those three tables in bulk every
//! [`journal_size`](crate::StoreBuilder::journal_size) claims; under
//! `Durability::None` a claim writes all three at once. Why the journal
//! pays is argued, with its figures, in the repository's `docs/design.md`.

mod inspect;
mod journal;
mod ops;
pub(crate) mod rules;
#[cfg(feature = "tokio")]
mod tasks;

use std::sync::Arc;

use chrono::{DateTime, Utc};
use redb::{ReadTransaction, ReadableTable as _, TableHandle as _, WriteTransaction};

use crate::codec::{from_micros, micros};
use crate::engine::{Engine, after_commit};
use crate::error::{Error, Result};
use crate::observe;
use crate::schema::{INBOX, INBOX_COUNT, INBOX_JOURNAL, open_read};

pub(crate) use inspect::{check_indexes, names};
pub(crate) use journal::Journal;
use rules::{check_event_key, check_event_keys, check_inbox_name};

/// Longest event key accepted, in bytes.
pub const MAX_EVENT_KEY_LEN: usize = 1024;
/// Longest inbox name accepted, in bytes.
pub const MAX_INBOX_NAME_LEN: usize = 64;
/// Keys removed per commit by [`Inbox::prune`].
pub(crate) const PRUNE_CHUNK: usize = 1024;

/// The outcome of [`Inbox::claim_with`].
///
/// A closed set: a key is claimed now or was claimed before. Match it
/// exhaustively.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Claim<T> {
    /// First delivery: the key is now claimed and the effect ran and
    /// committed with it; here is what it returned.
    Applied(T),
    /// The key was claimed before: nothing ran, nothing changed.
    Duplicate,
}

impl<T> Claim<T> {
    /// Whether this delivery was the first.
    pub fn is_applied(&self) -> bool {
        matches!(self, Claim::Applied(_))
    }

    /// The effect's result, if it ran.
    pub fn applied(self) -> Option<T> {
        match self {
            Claim::Applied(v) => Some(v),
            Claim::Duplicate => None,
        }
    }
}

/// One dedup ledger, named by the module that owns it. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Inbox {
    engine: Arc<Engine>,
    journal: Arc<Journal>,
    name: Arc<str>,
}

impl Inbox {
    pub(crate) fn new(engine: Arc<Engine>, journal: Arc<Journal>, name: &str) -> Result<Inbox> {
        check_inbox_name(name)?;
        Ok(Inbox {
            engine,
            journal,
            name: name.into(),
        })
    }

    /// The inbox's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Records `event_key`; `true` the first time, `false` for every later
    /// delivery of the same key, including concurrent ones. Returns once the
    /// claim (or the claim it collided with) is durable.
    pub fn claim(&self, event_key: &str, seen_at: DateTime<Utc>) -> Result<bool> {
        check_event_key(event_key)?;
        // When the writer is idle, a duplicate is answered from a read,
        // without a commit. Under load a commit is on its way anyway and the
        // claim rides in it: the extra read would only cost time.
        let applied = if !self.engine.is_busy() && self.seen_durable(event_key)? {
            false
        } else {
            self.engine.execute(self.claim_op(event_key, seen_at))?
        };
        observe::claim(&self.name, applied);
        Ok(applied)
    }

    /// [`Inbox::claim`] for an async task: the claim joins the next group
    /// commit like a thread's, and the task is woken once it is durable,
    /// without holding a thread while it waits (feature `tokio`). Dropped
    /// before its first poll, it does nothing; dropped after, the claim may
    /// still commit (a later delivery of the key then reads `false`).
    #[cfg(feature = "tokio")]
    pub async fn claim_async(&self, event_key: &str, seen_at: DateTime<Utc>) -> Result<bool> {
        check_event_key(event_key)?;
        let applied = if self.engine.is_busy() {
            self.engine
                .execute_async(self.claim_op(event_key, seen_at))
                .await?
        } else {
            let (at, seq) = self.lookup(event_key)?;
            if at.is_some() {
                self.engine.wait_durable_async(seq).await?;
                false
            } else {
                self.engine
                    .execute_async(self.claim_op(event_key, seen_at))
                    .await?
            }
        };
        observe::claim(&self.name, applied);
        Ok(applied)
    }

    /// The store operation that claims `event_key` (checked).
    fn claim_op(
        &self,
        event_key: &str,
        seen_at: DateTime<Utc>,
    ) -> impl Fn(&WriteTransaction) -> Result<bool> + Send + 'static {
        let (journal, name) = (self.journal.clone(), self.name.clone());
        let key = event_key.to_owned();
        let at = micros(seen_at);
        move |tx| ops::claim(tx, &journal, &name, &key, at)
    }

    /// Records many event keys in one commit, for a caller that holds many
    /// at once. Returns, for each key in order, whether this was its first
    /// delivery (a key repeated within `event_keys` is `true` once). All keys
    /// are checked before anything is written: one bad key fails the call
    /// and claims nothing.
    pub fn claim_many<I, K>(&self, event_keys: I, seen_at: DateTime<Utc>) -> Result<Vec<bool>>
    where
        I: IntoIterator<Item = K>,
        K: AsRef<str>,
    {
        let keys = check_event_keys(event_keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let claimed = self.engine.execute(self.claim_many_op(keys, seen_at))?;
        observe::claims(&self.name, &claimed);
        Ok(claimed)
    }

    /// [`Inbox::claim_many`] for an async task, as
    /// [`claim_async`](Inbox::claim_async) is of a claim.
    #[cfg(feature = "tokio")]
    pub async fn claim_many_async<I, K>(
        &self,
        event_keys: I,
        seen_at: DateTime<Utc>,
    ) -> Result<Vec<bool>>
    where
        I: IntoIterator<Item = K>,
        K: AsRef<str>,
    {
        let keys = check_event_keys(event_keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let op = self.claim_many_op(keys, seen_at);
        let claimed = self.engine.execute_async(op).await?;
        observe::claims(&self.name, &claimed);
        Ok(claimed)
    }

    /// The store operation that claims `keys` (checked) in one commit.
    fn claim_many_op(
        &self,
        keys: Vec<String>,
        seen_at: DateTime<Utc>,
    ) -> impl Fn(&WriteTransaction) -> Result<Vec<bool>> + Send + 'static {
        let (journal, name) = (self.journal.clone(), self.name.clone());
        let at = micros(seen_at);
        move |tx| {
            keys.iter()
                .map(|k| ops::claim(tx, &journal, &name, k, at))
                .collect()
        }
    }

    /// Claims `event_key` and, on its first delivery, runs `effect` in the
    /// same write transaction: both commit or neither does.
    ///
    /// - First delivery: `effect` runs once; if it returns `Ok(v)` the claim
    ///   and everything it wrote commit together and this returns
    ///   `Ok(Claim::Applied(v))` once durable.
    /// - `effect` returns `Err(e)`: nothing commits, the key stays
    ///   unclaimed (a later delivery runs the effect again), and `Err(e)` is
    ///   returned.
    /// - `effect` panics: nothing commits, the key stays unclaimed, the file
    ///   is left clean, and the panic reaches the caller.
    /// - Duplicate: `effect` does not run; `Ok(Claim::Duplicate)`.
    ///
    /// `effect` runs on the calling thread, at most once. Inside it, write
    /// through the transaction it is given (your own tables,
    /// [`Outbox::enqueue_in`](crate::Outbox::enqueue_in), …); the store's own
    /// non-`_in` write calls there return [`Error::Reentrant`].
    pub fn claim_with<T, E, F>(
        &self,
        event_key: &str,
        seen_at: DateTime<Utc>,
        effect: F,
    ) -> Result<Claim<T>, E>
    where
        F: FnOnce(&WriteTransaction) -> Result<T, E>,
        E: From<Error>,
    {
        check_event_key(event_key)?;
        // A replay is answered from a read, without taking the writer.
        if self.seen_durable(event_key)? {
            observe::claim(&self.name, false);
            return Ok(Claim::Duplicate);
        }
        let at = micros(seen_at);
        let claim = self.engine.write(|tx| {
            if !ops::claim(tx, &self.journal, &self.name, event_key, at)? {
                return Ok(Claim::Duplicate);
            }
            effect(tx).map(Claim::Applied)
        })?;
        observe::claim(&self.name, claim.is_applied());
        Ok(claim)
    }

    /// [`Inbox::claim_with`] for an async task (feature `tokio`): `effect`
    /// runs on tokio's blocking pool while it runs, with the claim in one
    /// transaction, and the task waits for the durable commit without
    /// holding a thread. The claim and its effect commit together or not
    /// at all, whenever the future is dropped: dropped after its first
    /// poll, both may still commit (a later delivery then reads
    /// `Duplicate`), never one without the other.
    #[cfg(feature = "tokio")]
    pub async fn claim_with_async<T, E, F>(
        &self,
        event_key: &str,
        seen_at: DateTime<Utc>,
        effect: F,
    ) -> Result<Claim<T>, E>
    where
        T: Send + 'static,
        F: FnOnce(&WriteTransaction) -> Result<T, E> + Send + 'static,
        E: From<Error> + Send + 'static,
    {
        check_event_key(event_key)?;
        let (at, seq) = self.lookup(event_key)?;
        if at.is_some() {
            self.engine.wait_durable_async(seq).await?;
            observe::claim(&self.name, false);
            return Ok(Claim::Duplicate);
        }
        let (journal, name, key) = (
            self.journal.clone(),
            self.name.clone(),
            event_key.to_owned(),
        );
        let at = micros(seen_at);
        let claim = self
            .engine
            .write_async(move |tx| {
                if !ops::claim(tx, &journal, &name, &key, at)? {
                    return Ok(Claim::Duplicate);
                }
                effect(tx).map(Claim::Applied)
            })
            .await?;
        observe::claim(&self.name, claim.is_applied());
        Ok(claim)
    }

    /// Claims `event_key` inside the caller's own write transaction (from
    /// [`Store::write`](crate::Store::write)); `true` the first time. The
    /// claim commits or rolls back with the caller's transaction.
    pub fn claim_in(
        &self,
        tx: &WriteTransaction,
        event_key: &str,
        seen_at: DateTime<Utc>,
    ) -> Result<bool> {
        check_event_key(event_key)?;
        let applied = ops::claim(tx, &self.journal, &self.name, event_key, micros(seen_at))?;
        if observe::ENABLED {
            // Counted once the caller's transaction commits, never if it
            // rolls back.
            let name = self.name.clone();
            after_commit(move || observe::claim(&name, applied));
        }
        Ok(applied)
    }

    /// Whether `event_key` is claimed; a `true` is returned only once that
    /// claim is durable (D2), a `false` at once (the caller goes on to claim).
    fn seen_durable(&self, event_key: &str) -> Result<bool> {
        let (at, seq) = self.lookup(event_key)?;
        if at.is_some() {
            self.engine.wait_durable(seq)?;
        }
        Ok(at.is_some())
    }

    /// Whether `event_key` has been claimed (and not pruned).
    pub fn seen(&self, event_key: &str) -> Result<bool> {
        Ok(self.seen_at(event_key)?.is_some())
    }

    /// When `event_key` was claimed, if it was.
    pub fn seen_at(&self, event_key: &str) -> Result<Option<DateTime<Utc>>> {
        check_event_key(event_key)?;
        let (at, seq) = self.lookup(event_key)?;
        self.engine.wait_durable(seq)?;
        seen_time(event_key, at)
    }

    /// When `event_key` was claimed, from a snapshot taken now (the ledger
    /// or the journal), with the sequence number to wait for (until durable)
    /// before answering.
    fn lookup(&self, event_key: &str) -> Result<(Option<i64>, u64)> {
        self.engine.commit_pending()?;
        let removals = self.journal.hold_removals();
        let (found, seq) = self.engine.read_with_seq(|tx| {
            let name: &str = &self.name;
            if let Some(ledger) = open_read(tx, INBOX)?
                && let Some(at) = ledger.get((name, event_key))?
            {
                return Ok(Some(at.value()));
            }
            let Some(log) = open_read(tx, INBOX_JOURNAL)? else {
                return Ok(None);
            };
            // Other processes sharing the file may have journaled it, and
            // merged what this process noted.
            self.journal.catch_up(&log, name)?;
            self.journal.note_merged(tx)?;
            match self.journal.hint(name, event_key) {
                Some(id) => journal::journaled_at(&log, name, id, event_key),
                None => Ok(None),
            }
        })?;
        drop(removals);
        self.journal.forget_merged();
        match found {
            Ok(at) => Ok((at, seq)),
            Err(e) => {
                // A failed lookup is an answer too: given only once what it
                // saw is durable (D2).
                self.engine.wait_durable(seq)?;
                Err(e)
            }
        }
    }

    /// Removes the keys claimed strictly before `seen_before`; returns how
    /// many. Costs what it removes (it walks the `seen_at` index, not the
    /// ledger). A pruned key can be claimed again: prune only past the
    /// window in which duplicates can still arrive.
    ///
    /// Commits in chunks of at most 1024 keys, earliest claimed first, each
    /// its own commit, so that the first prune of a large ledger never holds
    /// the writer (and every claim queued behind it) for long. The first
    /// chunk also merges the journal of recent claims into the ledger, as
    /// any merge does. Every chunk leaves the inbox consistent (a key is
    /// claimed or not, and counted if it is): a reader may see part of the
    /// prune done, and a crash or an `Err` midway leaves the chunks
    /// committed before it pruned and the rest for the next prune (the
    /// failed chunk removed nothing).
    pub fn prune(&self, seen_before: DateTime<Utc>) -> Result<u64> {
        let cutoff = micros(seen_before);
        let mut total = 0;
        let mut merge = true;
        loop {
            let (n, more) = self.engine.execute(self.prune_op(cutoff, merge))?;
            total += n;
            merge = false;
            if !more {
                return Ok(total);
            }
        }
    }

    /// The store operation that prunes one chunk of the keys claimed before
    /// `cutoff` (µs), merging the journal first if `merge`: how many it
    /// removed, and whether more remain.
    fn prune_op(
        &self,
        cutoff: i64,
        merge: bool,
    ) -> impl Fn(&WriteTransaction) -> Result<(u64, bool)> + Send + 'static {
        let (journal, name) = (self.journal.clone(), self.name.clone());
        move |tx| ops::prune(tx, &journal, &name, cutoff, PRUNE_CHUNK, merge)
    }

    /// [`Inbox::prune`] inside the caller's own write transaction: every
    /// key it removes, and the merge of the journal before them, are in
    /// that one transaction, so it holds the writer for as long as it
    /// takes, with no cap on what it removes. Use [`Inbox::prune`] to
    /// prune a large backlog.
    pub fn prune_in(&self, tx: &WriteTransaction, seen_before: DateTime<Utc>) -> Result<u64> {
        let cutoff = micros(seen_before);
        let (n, _) = ops::prune(tx, &self.journal, &self.name, cutoff, usize::MAX, true)?;
        Ok(n)
    }

    /// Number of keys recorded in this inbox. Reads the inbox's count and
    /// its rows in the journal of recent claims (at most
    /// [`StoreBuilder::journal_size`](crate::StoreBuilder::journal_size)),
    /// never the ledger itself.
    pub fn len(&self) -> Result<u64> {
        self.engine.read(|tx| len_in(tx, &self.name))
    }

    /// Whether this inbox holds no keys.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
}

/// What `seen_at` answers for `event_key` claimed at `at` (µs), if it was.
fn seen_time(event_key: &str, at: Option<i64>) -> Result<Option<DateTime<Utc>>> {
    at.map(|at| from_micros(INBOX.name(), &event_key, at))
        .transpose()
}

/// The number of keys of inbox `name` as `tx` sees them: its count and its
/// rows in the journal of recent claims.
fn len_in(tx: &ReadTransaction, name: &str) -> Result<u64> {
    let merged = match open_read(tx, INBOX_COUNT)? {
        Some(counts) => ops::ledger_count(&counts, name)?,
        None => 0,
    };
    let journaled = match open_read(tx, INBOX_JOURNAL)? {
        Some(log) => journal::count(&log, name)?,
        None => 0,
    };
    Ok(merged + journaled)
}
