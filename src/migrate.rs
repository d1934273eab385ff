//! Moving a store from its file to a PostgreSQL server.
//!
//! [`to_postgres`] copies every row of an embedded [`Store`] into a
//! [`PgStore`]'s schema, as it was: the keys of every inbox with their
//! claim times; every outbox record with its id, status, claim, attempt
//! history and ordering; the destinations' policies and pauses; the
//! schedules, each with its start and the slots it dealt with; every
//! idempotency record — completed responses with their stored response,
//! and reservations — with its fence. A program that outgrows one machine
//! stops, runs the copy, and starts again on the server with nothing
//! delivered twice and nothing lost. The `idemstore migrate FILE
//! --to-postgres URL` command is this call.
//!
//! **Copy a stopped program's file.** The store is read page by page, one
//! read transaction per page: what a program writes to the file while the
//! copy runs may or may not be copied.
//!
//! **Runs again safely.** Each page is written in one transaction of
//! `INSERT … ON CONFLICT DO NOTHING`. A row an earlier run copied is
//! recognised and left alone (an outbox record with the same id,
//! destination, idempotency key, command and creation time; an
//! idempotency record with the same fence and fingerprint), so a copy that
//! failed halfway can simply be run again; an inbox key already there is
//! claimed either way. A destination the server already has a row for
//! keeps the server's policy and pause.
//!
//! **Conflicts.** A record whose outbox id, `(destination,
//! idempotency_key)` or `(tenant, key)` a *different* row on the server
//! holds is not copied: it is counted in the [`MigrationReport`], and the
//! first [`LISTED_CONFLICTS`] of each kind are named there. Copy into a new
//! schema, or one that holds only rows copied from this file.
//!
//! **Ids and fences are never reused.** Before any row is copied, the
//! server's outbox id and fence sequences are moved past every value the
//! file ever handed out, its purged records' included, and past every
//! copied one as each page commits; they never move back. An entry
//! enqueued on the server afterwards gets a new id, and a reservation a
//! new fence, that no record of the file ever had.
//!
//! ```no_run
//! use idemstore::Store;
//! use idemstore::migrate::{self, MigrateOptions};
//! use idemstore::postgres::PgStore;
//!
//! # fn main() -> idemstore::Result<()> {
//! let store = Store::open("app.idem")?;
//! let pg = PgStore::connect("host=/run/postgresql user=app dbname=app")?;
//! let options = MigrateOptions::new().batch_size(500);
//! let report = migrate::to_postgres(&store, &pg, &options, |p| {
//!     eprintln!("{}/{} rows", p.done, p.total);
//! })?;
//! println!(
//!     "{} outbox records copied, {} in conflict",
//!     report.outbox.copied, report.outbox.conflicts
//! );
//! if report.has_conflicts() {
//!     eprintln!("some rows were not copied: {:?}", report.outbox.conflicting);
//! }
//! # Ok(())
//! # }
//! ```

use chrono::{DateTime, Utc};

use crate::error::Result;
use crate::idempotency::{IdempotencyKeys, KeyEntry, KeyState, ResponseRecord};
use crate::inbox::Inbox;
use crate::outbox::{Outbox, OutboxFilter, OutboxId, OutboxRecord};
use crate::postgres::PgStore;
use crate::store::Store;

/// The default [`MigrateOptions::batch_size`]: rows per transaction.
pub const DEFAULT_MIGRATE_BATCH: usize = 1000;

/// How many conflicting records of each kind a [`MigrationReport`] names
/// (it counts them all).
pub const LISTED_CONFLICTS: usize = 10;

/// How [`to_postgres`] copies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrateOptions {
    batch_size: usize,
}

impl Default for MigrateOptions {
    fn default() -> Self {
        MigrateOptions {
            batch_size: DEFAULT_MIGRATE_BATCH,
        }
    }
}

impl MigrateOptions {
    /// The defaults: batches of [`DEFAULT_MIGRATE_BATCH`] rows.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rows read per read transaction of the file and written per
    /// transaction on the server. Default [`DEFAULT_MIGRATE_BATCH`] (1000);
    /// 0 is taken as 1.
    #[must_use]
    pub fn batch_size(mut self, rows: usize) -> Self {
        self.batch_size = rows.max(1);
        self
    }

    /// The batch size set.
    pub fn batch(&self) -> usize {
        self.batch_size
    }
}

/// How far a copy has come, handed to [`to_postgres`]'s `progress` after
/// each batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Progress {
    /// Rows offered to the server so far (copied, already there, or in
    /// conflict), of every kind.
    pub done: u64,
    /// Rows the file holds, of every kind: inbox keys, outbox records and
    /// idempotency records, as counted before the copy began.
    pub total: u64,
}

/// What became of one kind of row: how many the file holds, how many the
/// server holds afterwards, how many this run copied, how many it did not
/// copy because a different row holds their id or key, and the first
/// [`LISTED_CONFLICTS`] of those.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Tally<C> {
    /// Rows of this kind in the file.
    pub source: u64,
    /// Rows of this kind in the server's schema after the copy (its own
    /// rows, earlier runs' and this run's).
    pub target: u64,
    /// Rows this run inserted.
    pub copied: u64,
    /// Records not copied because a different row on the server holds
    /// their id or key.
    pub conflicts: u64,
    /// The first [`LISTED_CONFLICTS`] of those, in the order met.
    pub conflicting: Vec<C>,
}

impl<C> Default for Tally<C> {
    fn default() -> Self {
        Tally {
            source: 0,
            target: 0,
            copied: 0,
            conflicts: 0,
            conflicting: Vec::new(),
        }
    }
}

impl<C> Tally<C> {
    /// Counts a batch's copies and conflicts.
    fn add(&mut self, (copied, conflicts): (u64, Vec<C>)) {
        self.copied += copied;
        self.conflicts += conflicts.len() as u64;
        let room = LISTED_CONFLICTS.saturating_sub(self.conflicting.len());
        self.conflicting.extend(conflicts.into_iter().take(room));
    }
}

/// The inboxes' part of a [`MigrationReport`]. An inbox key has no
/// conflicts: a key already on the server is claimed either way.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxTally {
    /// How many inboxes the file holds.
    pub inboxes: u64,
    /// Keys in the file, across every inbox.
    pub source: u64,
    /// Keys of those inboxes on the server after the copy.
    pub target: u64,
    /// Keys this run inserted.
    pub copied: u64,
}

/// What a [`to_postgres`] run copied, by kind of row.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationReport {
    /// Inbox keys.
    pub inboxes: InboxTally,
    /// Outbox records; a conflict is named by its id.
    pub outbox: Tally<OutboxId>,
    /// Idempotency records, completed and reserved; a conflict is named by
    /// its `(tenant, key)`.
    pub idempotency_keys: Tally<(String, String)>,
    /// Destinations whose policy or pause was copied.
    pub destinations: u64,
    /// Outbox schedules copied, each with its start and the slots it dealt
    /// with (a schedule of the same name already on the server is kept).
    pub schedules: u64,
}

impl MigrationReport {
    /// Whether some records were not copied because different rows on the
    /// server hold their ids or keys.
    pub fn has_conflicts(&self) -> bool {
        self.outbox.conflicts + self.idempotency_keys.conflicts > 0
    }
}

/// Copies every row of `store` into `pg`'s schema (see the [module
/// docs](self)): first the id and fence sequences, then the inboxes, the
/// outbox, the destinations' policies and pauses, the schedules, and the
/// idempotency records, [`batch_size`](MigrateOptions::batch_size) rows a transaction;
/// then counts what the server holds. `progress` is called after each
/// batch.
///
/// Conflicting records are reported, not an error: check
/// [`MigrationReport::has_conflicts`]. An error — the file or the server
/// failing, or the server refusing a row, named in the error's message —
/// stops the copy; the batches committed before it stay, and running the
/// copy again goes on from there. A blocking call, like every call of
/// [`PgStore`].
pub fn to_postgres(
    store: &Store,
    pg: &PgStore,
    options: &MigrateOptions,
    mut progress: impl FnMut(Progress),
) -> Result<MigrationReport> {
    let batch = options.batch_size.max(1);
    let outbox = store.outbox();
    let keys = store.idempotency_keys();

    let names = store.inbox_names()?;
    let mut inboxes = InboxTally {
        inboxes: names.len() as u64,
        ..InboxTally::default()
    };
    for name in &names {
        inboxes.source += store.inbox(name)?.len()?;
    }
    let mut outbox_tally = Tally {
        source: outbox.counts()?.total(),
        ..Tally::default()
    };
    let summary = keys.summary()?;
    let mut key_tally = Tally {
        source: summary.completed + summary.reserved,
        ..Tally::default()
    };
    let mut done = Progress {
        done: 0,
        total: inboxes.source + outbox_tally.source + key_tally.source,
    };

    // Ids and fences are never reused: the server's sequences go past
    // every one the file handed out, its purged records' too.
    pg.import_counters(outbox.next_id()?, keys.next_fence()?)?;

    for name in &names {
        let inbox = store.inbox(name)?;
        for page in inbox_pages(&inbox, batch) {
            let page = page?;
            inboxes.copied += pg.import_inbox(name, &page)?;
            done.done += page.len() as u64;
            progress(done);
        }
        inboxes.target += pg.inbox(name)?.len()?;
    }

    for page in outbox_pages(&outbox, batch) {
        let page = page?;
        outbox_tally.add(pg.import_outbox(&page)?);
        done.done += page.len() as u64;
        progress(done);
    }
    outbox_tally.target = pg.outbox().counts()?.total();
    // Policies and pauses, which the entries' claims obey from then on.
    let destinations = pg.import_destinations(&outbox.destinations()?)?;
    // Schedules after their entries: a slot already fired keeps its entry,
    // and the server's firings go on from the last slot dealt with.
    let schedules = pg.outbox().import_schedules(&outbox.schedule_records()?)?;

    for page in key_pages(&keys, batch) {
        let page = page?;
        key_tally.add(pg.import_idempotency(&page)?);
        done.done += page.len() as u64;
        progress(done);
    }
    let s = pg.idempotency_keys().summary()?;
    key_tally.target = s.completed + s.reserved;

    Ok(MigrationReport {
        inboxes,
        outbox: outbox_tally,
        idempotency_keys: key_tally,
        destinations,
        schedules,
    })
}

/// The pages `read` returns, each given the previous page's last row,
/// until one is empty or a read fails: a whole table, one read transaction
/// per page.
fn pages<T: Clone>(
    mut read: impl FnMut(Option<&T>) -> Result<Vec<T>>,
) -> impl Iterator<Item = Result<Vec<T>>> {
    let mut last: Option<T> = None;
    let mut done = false;
    std::iter::from_fn(move || {
        if done {
            return None;
        }
        match read(last.as_ref()) {
            Ok(page) => {
                last = page.last().cloned();
                done = last.is_none();
                (!done).then_some(Ok(page))
            }
            Err(e) => {
                done = true;
                Some(Err(e))
            }
        }
    })
}

/// An inbox's keys with their claim times, oldest first, `batch` a page.
fn inbox_pages(
    inbox: &Inbox,
    batch: usize,
) -> impl Iterator<Item = Result<Vec<(String, DateTime<Utc>)>>> + '_ {
    pages(move |last: Option<&(String, DateTime<Utc>)>| {
        inbox.list(last.map(|(k, at)| (*at, k.as_str())), batch)
    })
}

/// Every outbox record by id, `batch` a page.
fn outbox_pages(
    outbox: &Outbox,
    batch: usize,
) -> impl Iterator<Item = Result<Vec<OutboxRecord>>> + '_ {
    pages(move |last: Option<&OutboxRecord>| {
        let filter = match last {
            Some(r) => OutboxFilter::any().after(r.entry.id),
            None => OutboxFilter::any(),
        };
        outbox.list(&filter, batch)
    })
}

/// Every idempotency record in `(tenant, key)` order, each completed one
/// with its stored response, `batch` a page.
fn key_pages(
    keys: &IdempotencyKeys,
    batch: usize,
) -> impl Iterator<Item = Result<Vec<(KeyEntry, Option<ResponseRecord>)>>> + '_ {
    pages(move |last: Option<&(KeyEntry, Option<ResponseRecord>)>| {
        let page = keys.list_after(
            last.map(|(k, _)| (k.tenant.as_str(), k.key.as_str())),
            batch,
        )?;
        page.into_iter()
            .map(|k| {
                let response = match k.state {
                    KeyState::Completed { .. } => keys.response(&k.tenant, &k.key)?,
                    KeyState::Reserved { .. } => None,
                };
                Ok((k, response))
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_default_and_clamp() {
        assert_eq!(MigrateOptions::new().batch(), DEFAULT_MIGRATE_BATCH);
        assert_eq!(MigrateOptions::new().batch_size(7).batch(), 7);
        assert_eq!(MigrateOptions::new().batch_size(0).batch(), 1);
    }

    #[test]
    fn a_tally_counts_every_conflict_and_names_the_first_few() {
        let mut t: Tally<u64> = Tally::default();
        t.add((3, (0..8).collect()));
        t.add((2, (8..20).collect()));
        assert_eq!(t.copied, 5);
        assert_eq!(t.conflicts, 20);
        assert_eq!(t.conflicting, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn the_pagers_walk_a_whole_store_a_page_at_a_time() -> Result<()> {
        use crate::outbox::NewEntry;
        let at = chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap_or_default();
        let store = Store::in_memory()?;
        let inbox = store.inbox("hooks")?;
        for i in 0..5 {
            inbox.claim(&format!("e{i}"), at)?;
        }
        let outbox = store.outbox();
        for i in 0..5 {
            let _ = outbox.enqueue(
                NewEntry::new(format!("c{i}"), "d", format!("k{i}"), vec![]),
                at,
            )?;
        }
        let keys = store.idempotency_keys();
        for i in 0..5 {
            let _ = keys.begin("t", &format!("k{i}"), "fp", at)?;
        }
        let inbox_pages: Vec<usize> = inbox_pages(&inbox, 2)
            .map(|p| p.map(|p| p.len()))
            .collect::<Result<_>>()?;
        let outbox_pages: Vec<usize> = outbox_pages(&outbox, 2)
            .map(|p| p.map(|p| p.len()))
            .collect::<Result<_>>()?;
        let key_pages: Vec<usize> = key_pages(&keys, 2)
            .map(|p| p.map(|p| p.len()))
            .collect::<Result<_>>()?;
        assert_eq!(inbox_pages, [2, 2, 1]);
        assert_eq!(outbox_pages, [2, 2, 1]);
        assert_eq!(key_pages, [2, 2, 1]);
        Ok(())
    }
}
