//! The store's handles with their calls run through the `_async` forms,
//! for the contract suite's async binaries (`tests/contract_async.rs` on
//! the embedded store, `tests/contract_async_pg.rs` on PostgreSQL).
//!
//! `async_wrappers!` defines, in the module it is invoked in, the types
//! `Store`, `Inbox`, `Outbox` and `Keys` (the idempotency keys' handle):
//! thin wrappers over one backend's handles, each with every method the
//! suite calls, under its blocking signature. A method whose call has an
//! async form on the backend runs that form to its end on the wrapper's
//! tokio runtime (`rt.block_on(inner.foo_async(..))`); the others call the
//! blocking form:
//!
//! - calls that take a closure over the caller's transaction (`write`,
//!   `claim_with`): the suite's closures borrow its locals, and the async
//!   forms take `'static` closures returning boxed futures;
//! - the `*_in` calls, which write in such a closure's transaction;
//! - calls that never wait (`name`, `lease`, `stats`, `subscribe`,
//!   `notify`).
//!
//! The table below says which is which, for both backends at once.

use std::sync::Arc;

use tokio::runtime::Runtime;

/// A runtime for the wrappers' `block_on`s: two workers, I/O and timers.
pub(crate) fn runtime() -> Arc<Runtime> {
    Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime"),
    )
}

/// Methods of a wrapper (fields `inner`, `rt`) that forward to `inner`,
/// one a line: `fn name(args) -> Answer => how;`, where `how` is
/// `name_async` (the async form, run to its end on the runtime) or
/// `blocking` (the blocking call).
macro_rules! forward {
    (@pick [blocking] $($sig:tt)*) => {
        forward!(@blocking $($sig)*);
    };
    (@pick [$async:ident] $($sig:tt)*) => {
        forward!(@async $async $($sig)*);
    };
    (@blocking $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)?) => {
        pub(crate) fn $name(&self, $($arg: $ty),*) $(-> $ret)? {
            self.inner.$name($($arg),*)
        }
    };
    (@async $async:ident $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)?) => {
        pub(crate) fn $name(&self, $($arg: $ty),*) $(-> $ret)? {
            self.rt.block_on(self.inner.$async($($arg),*))
        }
    };
    (
        $(
            fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?
                => $how:ident;
        )*
    ) => {
        $(
            forward!(@pick [$how] $name($($arg: $ty),*) $(-> $ret)?);
        )*
    };
}

/// The wrappers `Store`, `Inbox`, `Outbox` and `Keys` over one backend's
/// handles (the handles' types and the write closures' transaction type),
/// with every call the suite makes.
macro_rules! async_wrappers {
    (
        store: $store:ty,
        inbox: $inbox:ty,
        outbox: $outbox:ty,
        keys: $keys:ty,
        tx: $tx:ty $(,)?
    ) => {
        use std::sync::Arc;
        use std::time::Duration;

        use chrono::{DateTime, Utc};
        use idemstore::crossbeam_channel::Receiver;
        use idemstore::{
            Begin, Claim, ClaimRequest, DestinationPolicy, DestinationState, Enqueued, Error,
            Fence, IdempotencyStats, KeyEntry, KeySummary, MatchingChange, MatchingStep,
            NewEntry, OutboxCounts, OutboxEntry, OutboxFilter, OutboxId, OutboxRecord,
            Reservation, ResponseRecord, Result, SettledAndClaimed, Settlement,
        };
        use tokio::runtime::Runtime;

        /// The store, its calls through their async forms.
        pub(crate) struct Store {
            inner: $store,
            rt: Arc<Runtime>,
        }

        impl Store {
            /// The store wrapped, for the operator's calls (a sealed
            /// trait's: the wrapper cannot implement it).
            pub(crate) fn admin(&self) -> &$store {
                &self.inner
            }
        }

        /// An inbox, its calls through their async forms.
        pub(crate) struct Inbox {
            inner: $inbox,
            rt: Arc<Runtime>,
        }

        /// The outbox, its calls through their async forms.
        pub(crate) struct Outbox {
            inner: $outbox,
            rt: Arc<Runtime>,
        }

        /// The idempotency keys, their calls through their async forms.
        pub(crate) struct Keys {
            inner: $keys,
            rt: Arc<Runtime>,
        }

        impl Store {
            /// `inner`, its calls run on `rt`.
            pub(crate) fn new(inner: $store, rt: Arc<Runtime>) -> Store {
                Store { inner, rt }
            }

            pub(crate) fn inbox(&self, name: &str) -> Result<Inbox> {
                Ok(Inbox {
                    inner: self.inner.inbox(name)?,
                    rt: self.rt.clone(),
                })
            }

            pub(crate) fn outbox(&self) -> Outbox {
                Outbox {
                    inner: self.inner.outbox(),
                    rt: self.rt.clone(),
                }
            }

            pub(crate) fn idempotency_keys(&self) -> Keys {
                Keys {
                    inner: self.inner.idempotency_keys(),
                    rt: self.rt.clone(),
                }
            }

            pub(crate) fn write<T, E>(&self, f: impl FnOnce($tx) -> Result<T, E>) -> Result<T, E>
            where
                E: From<Error>,
            {
                self.inner.write(f)
            }

            forward! {
                fn inbox_names() -> Result<Vec<String>> => inbox_names_async;
            }
        }

        impl Inbox {
            pub(crate) fn claim_with<T, E>(
                &self,
                event_key: &str,
                seen_at: DateTime<Utc>,
                effect: impl FnOnce($tx) -> Result<T, E>,
            ) -> Result<Claim<T>, E>
            where
                E: From<Error>,
            {
                self.inner.claim_with(event_key, seen_at, effect)
            }

            forward! {
                fn name() -> &str => blocking;
                fn claim(event_key: &str, seen_at: DateTime<Utc>) -> Result<bool> => claim_async;
                fn claim_many(event_keys: impl IntoIterator<Item = impl AsRef<str>>, seen_at: DateTime<Utc>)
                    -> Result<Vec<bool>> => claim_many_async;
                fn claim_in(tx: $tx, event_key: &str, seen_at: DateTime<Utc>) -> Result<bool> => blocking;
                fn seen(event_key: &str) -> Result<bool> => seen_async;
                fn seen_at(event_key: &str) -> Result<Option<DateTime<Utc>>> => seen_at_async;
                fn prune(seen_before: DateTime<Utc>) -> Result<u64> => prune_async;
                fn prune_in(tx: $tx, seen_before: DateTime<Utc>) -> Result<u64> => blocking;
                fn len() -> Result<u64> => len_async;
                fn is_empty() -> Result<bool> => is_empty_async;
                fn list(after: Option<(DateTime<Utc>, &str)>, limit: usize)
                    -> Result<Vec<(String, DateTime<Utc>)>> => list_async;
            }
        }

        impl Outbox {
            forward! {
                fn enqueue(entry: NewEntry, now: DateTime<Utc>) -> Result<Enqueued> => enqueue_async;
                fn enqueue_in(tx: $tx, entry: NewEntry, now: DateTime<Utc>) -> Result<Enqueued> => blocking;
                fn enqueue_many(entries: impl IntoIterator<Item = NewEntry>, now: DateTime<Utc>)
                    -> Result<Vec<Enqueued>> => enqueue_many_async;
                fn claim_due(now: DateTime<Utc>, limit: usize, worker_id: &str)
                    -> Result<Vec<OutboxEntry>> => claim_due_async;
                fn claim(now: DateTime<Utc>, request: &ClaimRequest) -> Result<Vec<OutboxEntry>> => claim_async;
                fn settle(fence: Fence, settlement: Settlement, now: DateTime<Utc>) -> Result<()> => settle_async;
                fn settle_in(tx: $tx, fence: Fence, settlement: &Settlement, now: DateTime<Utc>)
                    -> Result<()> => blocking;
                fn settle_many(settlements: impl IntoIterator<Item = (Fence, Settlement)>, now: DateTime<Utc>)
                    -> Result<Vec<Result<()>>> => settle_many_async;
                fn settle_and_claim(
                    settlements: impl IntoIterator<Item = (Fence, Settlement)>,
                    now: DateTime<Utc>,
                    limit: usize,
                    worker_id: &str,
                ) -> Result<SettledAndClaimed> => settle_and_claim_async;
                fn settle_and_claim_with(
                    settlements: impl IntoIterator<Item = (Fence, Settlement)>,
                    now: DateTime<Utc>,
                    request: &ClaimRequest,
                ) -> Result<SettledAndClaimed>
                    => settle_and_claim_with_async;
                fn mark_completed(id: OutboxId, now: DateTime<Utc>) -> Result<()> => mark_completed_async;
                fn mark_failed(id: OutboxId, reason: &str, retry_at: Option<DateTime<Utc>>, now: DateTime<Utc>)
                    -> Result<()> => mark_failed_async;
                fn mark_outcome_unknown(id: OutboxId, remote_ref: Option<&str>)
                    -> Result<()> => mark_outcome_unknown_async;
                fn reschedule(id: OutboxId, next_attempt_at: DateTime<Utc>) -> Result<()> => reschedule_async;
                fn requeue(id: OutboxId, next_attempt_at: DateTime<Utc>) -> Result<()> => requeue_async;
                fn cancel(id: OutboxId, now: DateTime<Utc>) -> Result<()> => cancel_async;
                fn release_expired_claims(claimed_before: DateTime<Utc>)
                    -> Result<Vec<OutboxId>> => release_expired_claims_async;
                fn purge_finished(finished_before: DateTime<Utc>) -> Result<u64> => purge_finished_async;
                fn change_matching(filter: &OutboxFilter, change: &MatchingChange, limit: usize)
                    -> Result<MatchingStep> => change_matching_async;
                fn get(id: OutboxId) -> Result<OutboxRecord> => get_async;
                fn find(destination: &str, idempotency_key: &str)
                    -> Result<Option<OutboxRecord>> => find_async;
                fn list_for_command(command_id: &str) -> Result<Vec<OutboxRecord>> => list_for_command_async;
                fn list(filter: &OutboxFilter, limit: usize) -> Result<Vec<OutboxRecord>> => list_async;
                fn counts() -> Result<OutboxCounts> => counts_async;
                fn next_due() -> Result<Option<DateTime<Utc>>> => next_due_async;
                fn oldest_claim() -> Result<Option<DateTime<Utc>>> => oldest_claim_async;
                fn check_indexes() -> Result<Vec<String>> => check_indexes_async;
                fn set_destination_policy(destination: &str, policy: DestinationPolicy)
                    -> Result<()> => set_destination_policy_async;
                fn pause_destination(destination: &str) -> Result<()> => pause_destination_async;
                fn resume_destination(destination: &str) -> Result<()> => resume_destination_async;
                fn destinations() -> Result<Vec<DestinationState>> => destinations_async;
                fn destination(destination: &str) -> Result<DestinationState> => destination_async;
                fn subscribe() -> Receiver<()> => blocking;
                fn notify() => blocking;
            }
        }

        impl Keys {
            pub(crate) fn with_ttl(self, ttl: Duration) -> Keys {
                Keys {
                    inner: self.inner.with_ttl(ttl),
                    rt: self.rt,
                }
            }

            pub(crate) fn with_lease(self, lease: Duration) -> Keys {
                Keys {
                    inner: self.inner.with_lease(lease),
                    rt: self.rt,
                }
            }

            forward! {
                fn lease() -> Duration => blocking;
                fn stats() -> IdempotencyStats => blocking;
                fn begin(tenant: &str, key: &str, fingerprint: &str, now: DateTime<Utc>) -> Result<Begin> => begin_async;
                fn complete(r: &Reservation, response: ResponseRecord, now: DateTime<Utc>) -> Result<bool> => complete_async;
                fn complete_in(tx: $tx, r: &Reservation, response: ResponseRecord, now: DateTime<Utc>)
                    -> Result<bool> => blocking;
                fn release(r: &Reservation) -> Result<()> => release_async;
                fn release_key(tenant: &str, key: &str, fence: u64) -> Result<bool> => release_key_async;
                fn get(tenant: &str, key: &str, expired_before: DateTime<Utc>)
                    -> Result<Option<ResponseRecord>> => get_async;
                fn put(record: &ResponseRecord) -> Result<bool> => put_async;
                fn purge_expired(expired_before: DateTime<Utc>) -> Result<u64> => purge_expired_async;
                fn entry(tenant: &str, key: &str) -> Result<Option<KeyEntry>> => entry_async;
                fn response(tenant: &str, key: &str) -> Result<Option<ResponseRecord>> => response_async;
                fn summary() -> Result<KeySummary> => summary_async;
                fn list(tenant: Option<&str>, limit: usize) -> Result<Vec<KeyEntry>> => list_async;
                fn check_indexes() -> Result<Vec<String>> => check_indexes_async;
            }
        }
    };
}
