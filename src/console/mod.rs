//! The operator console (feature `console`): server-rendered pages of a
//! store's outbox, over either backend, as an [`axum::Router`] an
//! application mounts under its own path and behind its own
//! authentication.
//!
//! ```no_run
//! # fn main() -> idemstore::Result<()> {
//! use idemstore::console::Console;
//!
//! let store = idemstore::Store::open("app.idem")?;
//! let console = Console::new(store.outbox()).base_path("/ops");
//! let app: axum::Router = axum::Router::new().nest("/ops", console.router());
//! # let _ = app;
//! # Ok(())
//! # }
//! ```
//!
//! The pages, each reached by links from the overview:
//!
//! - `/`: the entries by status, and by status for each destination (each
//!   count a link to the entries it counts), when the next entry is due and
//!   the oldest claim;
//! - `/outbox?status=S&destination=D&after=ID`: the entries by id, 50 a
//!   page, of one status and destination if given;
//! - `/outbox/ID`: one entry, with its attempt history and its payload
//!   (as text when it is UTF-8, else in hex).
//!
//! What is guaranteed:
//!
//! - **It only reads.** No page changes the store.
//! - **Everything is escaped.** Every value from the store (a payload, a
//!   failure reason, a key) is inserted as text by
//!   [maud](https://docs.rs/maud), whose templates are checked at compile
//!   time: a reason of `<script>` renders as that text.
//! - **A strict Content-Security-Policy**: no script at all, styles from
//!   the console's own stylesheet only, no frames, forms post to the
//!   console only; `nosniff`, no referrer, no caching.
//! - **Bad input is a 400**, an unknown entry a 404, a store error a 500
//!   page naming the error; never a panic.
//!
//! A page's store calls run on tokio's blocking pool
//! (`tokio::task::spawn_blocking`): a read of the embedded store may wait
//! for a commit to be durable, and the PostgreSQL client blocks.

mod pages;

use std::sync::Arc;

use axum::Router;
use axum::routing::get;

use crate::backend::OutboxAdmin;

/// The operator console of one outbox: its pages, as a router.
#[derive(Clone, Debug)]
pub struct Console {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    outbox: Arc<dyn OutboxAdmin>,
    /// The path the router is mounted under, in front of every link.
    base: String,
}

impl Console {
    /// The console of `outbox` (an embedded store's [`Outbox`](crate::Outbox)
    /// or a `postgres::PgOutbox`), mounted at the root.
    pub fn new(outbox: impl OutboxAdmin) -> Console {
        Console {
            inner: Arc::new(Inner {
                outbox: Arc::new(outbox),
                base: String::new(),
            }),
        }
    }

    /// The path the application mounts the router under (`/ops`), which
    /// every link of the pages starts with. Default: the root. A trailing
    /// `/` is dropped.
    #[must_use]
    pub fn base_path(self, path: &str) -> Console {
        Console {
            inner: Arc::new(Inner {
                outbox: self.inner.outbox.clone(),
                base: path.trim_end_matches('/').to_owned(),
            }),
        }
    }

    /// The pages, as a router to serve or to mount (`Router::nest`).
    pub fn router(&self) -> Router {
        Router::new()
            .route("/", get(pages::overview))
            .route("/outbox", get(pages::list))
            .route("/outbox/{id}", get(pages::entry))
            .route("/style.css", get(pages::style))
            .with_state(self.inner.clone())
    }
}
