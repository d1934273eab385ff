//! The operator console (feature `console`): server-rendered pages of a
//! store's outbox and, when [given the store](Console::store), of its
//! inboxes and idempotency keys, over either backend, as an
//! [`axum::Router`] an application mounts under its own path and behind
//! its own authentication.
//!
//! ```no_run
//! # fn main() -> idemstore::Result<()> {
//! use idemstore::console::Console;
//!
//! let store = idemstore::Store::open("app.idem")?;
//! let console = Console::new(store.outbox())
//!     .store(store.clone())
//!     .base_path("/ops");
//! let app: axum::Router = axum::Router::new().nest("/ops", console.router());
//! # let _ = app;
//! # Ok(())
//! # }
//! ```
//!
//! The pages, each reached by links from the overview:
//!
//! - `/`: the entries by status, and by status for each destination (each
//!   count a link to the entries it counts), the oldest pending entry and
//!   its age, when the next entry is due and the oldest claim, each
//!   destination's backlog as a bar, the backlog over time (a line per
//!   status, from the counts the console sampled, at most every 5 s while
//!   it is watched, the last hour's), the latest 200 failed entries by
//!   reason, and the application's commit and dispatch figures when it
//!   passed them ([`Console::commit_stats`], [`Console::dispatch_stats`]).
//!   The part that changes is fetched again every 5 s (`/live`) by the
//!   console's one script, so the page stays current without reloading;
//!   without script, a reload shows the same;
//! - `/outbox?status=S&destination=D&command=C&key=K&order=newest&sort=due&after=ID`:
//!   the entries a filter matches, 50 a page, oldest or newest first (a
//!   listing of one status reads that status's entries only, through an
//!   index; by command or key, the entries are looked up), the page sorted
//!   by id, due time or attempts;
//! - `/outbox/ID`: one entry, with its attempt history and its payload
//!   (indented when it is JSON, as text when it is UTF-8, else in hex, or
//!   as asked: `?as=text|json|hex`), or what the application's hook shows
//!   of it ([`Console::redact_payloads`], [`Console::hide_payloads`]);
//! - `/destinations`: each destination's policy, pause, circuit, hold,
//!   entries in flight and entries by status (with writes allowed, a pause
//!   or resume button each);
//! - `/schedules`: each schedule's destination, expression, missed-slot
//!   policy, pause, next slot and last slot fired (with writes allowed, a
//!   pause or resume button each).
//!
//! Given the store ([`Console::store`]), also (else these answer 404, with
//! a page saying the console was not given the store):
//!
//! - `/inboxes`: each inbox that holds a key, with how many it holds, and
//!   a lookup form;
//! - `/inboxes/lookup?inbox=I&key=K`: whether the inbox saw the event key,
//!   and when (a pruned key reads as not seen, and the page says so);
//! - `/keys?after_tenant=T&after_key=K`: the idempotency records by kind
//!   (completed, reserved, the oldest one's time), a lookup form, and the
//!   records in `(tenant, key)` order, 50 a page;
//! - `/keys/lookup?tenant=T&key=K`: one record: its state, fingerprint,
//!   fence and times, and for a completed one the stored response (status,
//!   headers, and body as text when it is UTF-8, else in hex).
//!
//! Actions, once [allowed](Console::allow_writes): on a reservation's page,
//! release it (for a handler that is stuck or gone:
//! [`IdempotencyKeys::release_key`](crate::IdempotencyKeys::release_key),
//! fenced by the token the page showed, so a page shown before the key
//! changed hands frees nothing, and a stored response is never deleted);
//! on an entry's page,
//! retry (a failed or in-doubt entry back to pending, due now), cancel (a
//! pending or in-doubt one to failed, reason `cancelled`), resolve an
//! in-doubt entry as completed or failed, and release a claim (a
//! dispatching entry back to pending, due now: its worker's settlement is
//! then refused as stale); on the entries checked on a list page, retry,
//! cancel or release each (those in a status the action does not apply
//! to are left as they are, and named); on a list of one status, retry
//! or cancel **every entry the filter matches**, with the count shown and a
//! confirmation, in steps of 256 entries, each step one commit
//! ([`Outbox::change_matching`](crate::Outbox::change_matching)), so the
//! writer, and the dispatchers' claims behind it, are never held for
//! longer than a step. An entry that changed meanwhile is left as it is
//! and counted apart.
//!
//! What is guaranteed:
//!
//! - **Read-only unless writes are allowed.** Then no page shows an action
//!   and every action `POST` is refused (403) without changing anything.
//! - **Every action is a plain HTML form** (`<form method="post">`, no
//!   script needed; the one script only refreshes the overview) carrying the console's token as a hidden field; a
//!   `POST` without it, with another, or from another site's page
//!   (`Sec-Fetch-Site: cross-site`) is refused (403) and changes nothing.
//!   The token is made from the operating system's randomness when the
//!   console is made, and is the same for every page it serves.
//! - **Everything is escaped.** Every value from the store (a payload, a
//!   failure reason, a key, a tenant, a stored response's headers and
//!   body) is inserted as text by
//!   [maud](https://docs.rs/maud), whose templates are checked at compile
//!   time: a reason of `<script>` renders as that text.
//! - **A strict Content-Security-Policy**: scripts and styles from the
//!   console's own two files only (no inline script, style or event
//!   handler), fetches to the console only, no frames, forms post to the
//!   console only; `nosniff`, no referrer, no caching.
//! - **The application's code cannot break a page.** A hook that panics
//!   (a figures closure, a payload hook) is caught: the page is drawn
//!   without the figures, and without the payload (a payload hook fails
//!   closed).
//! - **Bad input is a 400** (an inbox name, event key, tenant or
//!   idempotency key the store would refuse too), an unknown entry or
//!   idempotency record a 404, a store error a 500 page naming the error;
//!   never a panic.
//!
//! A page's store calls run on tokio's blocking pool
//! (`tokio::task::spawn_blocking`): a read of the embedded store may wait
//! for a commit to be durable, and the PostgreSQL client blocks.

mod actions;
mod destinations;
mod inbox;
mod keys;
mod list;
mod overview;
mod pages;
mod schedules;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};
use parking_lot::Mutex;

use crate::backend::{OutboxAdmin, StoreAdmin};
use crate::{CommitStats, DispatchStats, OutboxEntry};

/// The operator console of one outbox: its pages, as a router.
#[derive(Clone, Debug)]
pub struct Console {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    outbox: Arc<dyn OutboxAdmin>,
    /// The inboxes and idempotency keys, if the console was given them.
    store: Option<Arc<dyn StoreAdmin>>,
    /// The path the router is mounted under, in front of every link.
    base: String,
    /// Whether the actions are offered and accepted.
    writes: bool,
    /// What an action's form must carry.
    token: String,
    /// The counts seen over time, for the backlog chart (shared by every
    /// copy of the console).
    history: Arc<Mutex<overview::History>>,
    /// The application's code the pages call.
    hooks: Hooks,
}

/// A payload as an entry's page shows it: the bytes to show, or `None`
/// to show none.
type Redact = dyn Fn(&OutboxEntry) -> Option<Vec<u8>> + Send + Sync;

/// The application's code the pages call: each call's panic is caught,
/// and the page shows what it would show without the hook (a payload
/// hook's panic hides the payload).
#[derive(Clone, Default)]
struct Hooks {
    commits: Option<Arc<dyn Fn() -> CommitStats + Send + Sync>>,
    dispatch: Option<Arc<dyn Fn() -> DispatchStats + Send + Sync>>,
    payload: Option<Arc<Redact>>,
}

impl Console {
    /// The console of `outbox` (an embedded store's [`Outbox`](crate::Outbox)
    /// or a `postgres::PgOutbox`), mounted at the root.
    pub fn new(outbox: impl OutboxAdmin) -> Console {
        Console {
            inner: Arc::new(Inner {
                outbox: Arc::new(outbox),
                store: None,
                base: String::new(),
                writes: false,
                token: token(),
                history: Arc::default(),
                hooks: Hooks::default(),
            }),
        }
    }

    /// Offers and accepts the actions (retry, cancel, resolve; on every
    /// matching entry too; release a reservation, given the store).
    /// Default: read-only.
    #[must_use]
    pub fn allow_writes(self, allow: bool) -> Console {
        self.with(|i| i.writes = allow)
    }

    /// Shows the application's commit counters on the overview, as `stats`
    /// returns them when the page is drawn (say
    /// `move || store.commit_stats()`, [`Store::commit_stats`](crate::Store::commit_stats)).
    /// Default: not shown.
    #[must_use]
    pub fn commit_stats(self, stats: impl Fn() -> CommitStats + Send + Sync + 'static) -> Console {
        self.with(|i| i.hooks.commits = Some(Arc::new(stats)))
    }

    /// Shows the application's dispatcher figures on the overview
    /// (delivered, retried, failed, in doubt, send panics, store errors,
    /// enqueue-to-send latency, the last error), as `stats` returns them
    /// when the page is drawn (say `move || handle.stats()` over the
    /// application's [`DispatcherHandle`](crate::DispatcherHandle)).
    /// Default: not shown.
    #[must_use]
    pub fn dispatch_stats(
        self,
        stats: impl Fn() -> DispatchStats + Send + Sync + 'static,
    ) -> Console {
        self.with(|i| i.hooks.dispatch = Some(Arc::new(stats)))
    }

    /// What an entry's page shows of its payload: `redact` returns the
    /// bytes to show in its place (a copy with personal data masked, say),
    /// or `None` to show none. Default: the payload as it is. A `redact`
    /// that panics shows none.
    #[must_use]
    pub fn redact_payloads(
        self,
        redact: impl Fn(&OutboxEntry) -> Option<Vec<u8>> + Send + Sync + 'static,
    ) -> Console {
        self.with(|i| i.hooks.payload = Some(Arc::new(redact)))
    }

    /// Shows no payload at all (as [`redact_payloads`](Console::redact_payloads)
    /// with a hook that always returns `None`).
    #[must_use]
    pub fn hide_payloads(self) -> Console {
        self.redact_payloads(|_| None)
    }

    /// Adds the pages of `store`'s inboxes and idempotency keys (an
    /// embedded [`Store`](crate::Store) or a `postgres::PgStore`, normally
    /// the one whose outbox the console shows) and their links in the
    /// navigation. Without it, those pages answer 404.
    #[must_use]
    pub fn store(self, store: impl StoreAdmin) -> Console {
        let store: Arc<dyn StoreAdmin> = Arc::new(store);
        self.with(|i| i.store = Some(store))
    }

    /// This console with `change` made to a copy of its settings.
    fn with(self, change: impl FnOnce(&mut Inner)) -> Console {
        let mut inner = (*self.inner).clone();
        change(&mut inner);
        Console {
            inner: Arc::new(inner),
        }
    }

    /// The path the application mounts the router under (`/ops`), which
    /// every link of the pages starts with. Default: the root. A trailing
    /// `/` is dropped.
    #[must_use]
    pub fn base_path(self, path: &str) -> Console {
        let base = path.trim_end_matches('/').to_owned();
        self.with(|i| i.base = base)
    }

    /// The pages, as a router to serve or to mount (`Router::nest`).
    pub fn router(&self) -> Router {
        Router::new()
            .route("/", get(overview::overview))
            .route("/live", get(overview::live_part))
            .route("/outbox", get(list::list))
            // `POST /outbox/retry-matching` and the like.
            .route("/outbox/{id}", get(pages::entry).post(actions::on_matching))
            .route("/outbox/{id}/{action}", post(actions::on_entry))
            .route("/outbox/selected", post(actions::on_selected))
            .route("/destinations", get(destinations::list))
            .route("/destinations/pause", post(destinations::pause))
            .route("/destinations/resume", post(destinations::resume))
            .route("/schedules", get(schedules::list))
            .route("/schedules/pause", post(schedules::pause))
            .route("/schedules/resume", post(schedules::resume))
            .route("/inboxes", get(inbox::list))
            .route("/inboxes/lookup", get(inbox::lookup))
            .route("/keys", get(keys::list))
            .route("/keys/lookup", get(keys::lookup))
            .route("/keys/release", post(keys::release))
            .route("/style.css", get(pages::style))
            .route("/console.js", get(pages::script))
            .with_state(self.inner.clone())
    }
}

/// What `hook` (the application's code) returns, or `None` if it
/// panicked.
fn guarded<T>(hook: impl FnOnce() -> T) -> Option<T> {
    catch_unwind(AssertUnwindSafe(hook)).ok()
}

impl std::fmt::Debug for Inner {
    // Not the token: a console's debug form may reach a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console")
            .field("outbox", &self.outbox)
            .field("store", &self.store)
            .field("base", &self.base)
            .field("writes", &self.writes)
            .field("commit_stats", &self.hooks.commits.is_some())
            .field("dispatch_stats", &self.hooks.dispatch.is_some())
            .field("redacts_payloads", &self.hooks.payload.is_some())
            .finish_non_exhaustive()
    }
}

/// A token no one can guess: 256 bits of SHA-256 over keys the standard
/// library draws from the operating system's randomness for each hasher
/// (`RandomState`), the time and the process.
fn token() -> String {
    use std::hash::{BuildHasher as _, Hasher as _};

    use sha2::{Digest as _, Sha256};

    let mut digest = Sha256::new();
    for i in 0_u64..4 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(i);
        digest.update(h.finish().to_le_bytes());
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    digest.update(nanos.to_le_bytes());
    digest.update(std::process::id().to_le_bytes());
    digest
        .finalize()
        .iter()
        .fold(String::with_capacity(64), |mut s, b| {
            use std::fmt::Write as _;
            let _ = write!(s, "{b:02x}");
            s
        })
}
