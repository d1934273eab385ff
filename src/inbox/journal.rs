//! The journal of recent claims: what lets a durable claim append to the end
//! of a table instead of writing into the middle of the ledger.
//!
//! The ledger [`INBOX`] is keyed by `(inbox, key)`, so fresh keys land all
//! over it: each claim of a batch copies and rewrites a different 4 KiB leaf,
//! and the commit writes and syncs one scattered page per claim. Measured on
//! a 2-core VM, that held group commit near 27k claims/s from 64 threads,
//! and one thread committing 64 fresh keys at a time near 40k. So a claim
//! instead appends `(inbox, id) → (key, seen_at)` under an increasing id to
//! [`INBOX_JOURNAL`], and once the journal holds the store's `journal_size`
//! entries, the claim that fills it moves the whole journal, sorted, into
//! the ledger, its [`INBOX_SEEN`] index and the counts, in the same
//! transaction. The ledger's pages are then written once per merge, not once
//! per claim, and a lone durable claim dirties one table's pages instead of
//! three.
//!
//! Under `Durability::None` claims go straight to the ledger: its commits
//! are rare and without fsync, so they already write each page once for many
//! claims. Lookups look in both places either way, so a file may be opened
//! with either durability.
//!
//! # Finding a key
//!
//! A key is claimed if the ledger holds it or the journal does. The journal
//! is found by key through an in-memory [`Journal`] index `(inbox, key) →
//! id`, rebuilt from the table when the store opens. The index is a hint;
//! the table is the truth:
//! - an entry is added before its row is written, so every journal row a
//!   transaction can see has an entry;
//! - a lookup reads the row back by id, in the caller's own transaction, and
//!   compares: an entry whose row that transaction cannot see (rolled back,
//!   or committed after a reader's snapshot) counts for nothing;
//! - a lookup compares the row's key too, so an entry that points at
//!   another key's row counts for nothing. In a store held alone, ids are
//!   never reused while it is open, so that does not happen; in a shared
//!   one, another process may commit a row under an id this process handed
//!   out in a transaction that rolled back (see below), and the comparison
//!   is what keeps the entry left behind from answering for it.
//! - once a merge commits, every row up to the largest id it moved is gone
//!   from the journal for good (moved, or never committed): the entries up
//!   to that id are removed then, and only while no reader stands between
//!   opening its snapshot and its lookup ([`Journal::hold_removals`]), so
//!   that a reader whose snapshot predates the merge still finds the key.
//!
//! # Several processes
//!
//! When other processes share the file, they journal claims too, and the
//! index must learn of them before this process claims or looks up a key:
//! - ids come from committed state: at the start of every write
//!   transaction ([`Journal::catch_up_all`]) the next id is raised above
//!   every journal row and above the largest id ever merged (kept in
//!   [`META`] under [`META_JOURNAL_MERGED_THROUGH`]), and only one process
//!   writes at a time; so within an inbox, ids grow in commit order across
//!   all processes, and an id never names two claims;
//! - per inbox, `seen` is the largest id whose rows, and every row before
//!   it, have been noted in the index. A catch-up reads the rows above it
//!   from a snapshot of committed state only: at the start of a write
//!   transaction (before the transaction writes anything), or in a reader's
//!   snapshot. Catch-ups run one at a time, each holding `seen` from the
//!   moment it reads it until it has raised it, so rows are noted in id
//!   order: one that read an older snapshot notes nothing a newer one
//!   noted, and never puts back an entry a newer one replaced. Rows this
//!   process writes are noted at once but raise `seen` only once a catch-up
//!   reads them back committed: a rolled-back row must not hide another
//!   process's row that later takes its id.
//! - merges by other processes leave entries whose rows are gone: they
//!   count for nothing (lookups read the row back), and go at the start of
//!   this process's next write transaction, which reads how far merges
//!   went ([`META_JOURNAL_MERGED_THROUGH`]) and removes the entries up to
//!   there (as a merge of its own would). Readers do the same: a lookup
//!   that catches up notes how far merges went in its snapshot
//!   ([`Journal::note_merged`]) and, once it has dropped its hold on
//!   removals, removes the entries up to there
//!   ([`Journal::forget_merged`]). So a process that only reads keeps
//!   entries only for rows not merged when its last lookup looked, and one
//!   that rarely claims, for rows not merged when its last write
//!   transaction began or its last lookup looked.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use redb::{ReadTransaction, ReadableTable, ReadableTableMetadata, WriteTransaction};

use super::ops;
use crate::engine::after_commit;
use crate::error::Result;
use crate::schema::{
    INBOX, INBOX_JOURNAL, INBOX_SEEN, META, META_JOURNAL_MERGED_THROUGH, open_read, open_write,
};

/// A journal table, as a write or a read transaction opened it.
pub(crate) trait JournalTable:
    ReadableTable<(&'static str, u64), (&'static str, i64)>
{
}

impl<T: ReadableTable<(&'static str, u64), (&'static str, i64)>> JournalTable for T {}

/// The in-memory index of the journal's entries; see the module docs.
///
/// Locks, in this order: `readers`, then `seen`, then `index` (each may be
/// taken without the ones before it). A reader's lookup holds `readers`
/// shared and catches up (`seen`, then `index`); a catch-up holds `seen`
/// throughout and takes `index` for each row; a removal holds `readers`
/// alone, then `index`.
#[derive(Debug, Default)]
pub(crate) struct Journal {
    /// `inbox → key → id` of the entry's journal row.
    index: Mutex<HashMap<String, HashMap<String, u64>>>,
    /// The next id to hand out.
    next_id: AtomicU64,
    /// Held shared by readers from just before they open their snapshot to
    /// their last lookup (never while they wait for anything else); removals
    /// from `index` take it alone.
    readers: RwLock<()>,
    /// For a store whose claims go to the journal, how many entries it
    /// holds before a merge; `None` when claims go straight to the ledger.
    merge_at: Option<u64>,
    /// Whether other processes may write the journal too.
    shared: bool,
    /// In a shared store: per inbox, the largest id up to which every
    /// committed row is in the index (see the module docs).
    seen: Mutex<HashMap<String, u64>>,
    /// The largest id whose entries and every one before it were removed
    /// (or never added: the journal held none when the store opened).
    forgotten: AtomicU64,
    /// In a shared store: how far merges went, in the newest snapshot a
    /// lookup read it in; its entries go at [`Journal::forget_merged`].
    merged_seen: AtomicU64,
}

impl Journal {
    /// Builds the index from the journal table. New claims are appended to
    /// the journal, merged when it holds `merge_at` entries, or written
    /// straight to the ledger for `None`.
    /// With `shared`, other processes may write the journal too.
    pub(crate) fn load(
        tx: &ReadTransaction,
        merge_at: Option<u64>,
        shared: bool,
    ) -> Result<Journal> {
        let journal = Journal {
            merge_at,
            shared,
            ..Journal::default()
        };
        let merged = match open_read(tx, META)? {
            Some(meta) => meta
                .get(META_JOURNAL_MERGED_THROUGH)?
                .map_or(0, |v| v.value()),
            None => 0,
        };
        journal.forgotten.store(merged, Ordering::Relaxed);
        let Some(log) = open_read(tx, INBOX_JOURNAL)? else {
            journal.next_id.store(merged + 1, Ordering::Relaxed);
            return Ok(journal);
        };
        let mut next = merged + 1;
        {
            let mut seen = journal.seen.lock();
            let mut index = journal.index.lock();
            for row in log.iter()? {
                let (k, v) = row?;
                let ((name, id), (key, _)) = (k.value(), v.value());
                index
                    .entry(name.to_owned())
                    .or_default()
                    .insert(key.to_owned(), id);
                let last = seen.entry(name.to_owned()).or_default();
                *last = (*last).max(id);
                next = next.max(id + 1);
            }
        }
        journal.next_id.store(next, Ordering::Relaxed);
        Ok(journal)
    }

    /// In a shared store, at the start of a write transaction (before it
    /// writes anything): removes the entries of rows another process merged
    /// since, notes every journal row other processes committed since the
    /// last catch-up, in every inbox, and raises the next id above every
    /// committed one. One range seek per inbox in the journal when nothing
    /// changed.
    pub(crate) fn catch_up_all(&self, tx: &WriteTransaction) -> Result<()> {
        let merged = open_write(tx, META)?
            .get(META_JOURNAL_MERGED_THROUGH)?
            .map_or(0, |v| v.value());
        if merged > self.forgotten.load(Ordering::Relaxed) {
            // Committed: every row up to `merged` is gone for good. This
            // waits for readers between snapshot and lookup, which wait for
            // nothing this thread holds: no journal lock is held here, they
            // take the engine's `db` lock recursively, and redb opens
            // snapshots while a writer writes. It comes before this
            // transaction claims anything, so no reader whose snapshot
            // predates the merge is left to note a merged row after it.
            self.forget_through(merged);
        }
        let log = open_write(tx, INBOX_JOURNAL)?;
        let mut next = merged + 1;
        let mut inbox = log.first()?.map(|(k, _)| k.value().0.to_owned());
        while let Some(name) = inbox {
            if let Some(last) = self.catch_up(&log, &name)? {
                next = next.max(last + 1);
            }
            // The first row of the next inbox: keys sort by inbox first.
            inbox = None;
            for row in log.range((name.as_str(), u64::MAX)..)? {
                let (k, _) = row?;
                let other = k.value().0;
                if other != name {
                    inbox = Some(other.to_owned());
                    break;
                }
            }
        }
        self.next_id.fetch_max(next, Ordering::Relaxed);
        Ok(())
    }

    /// In a shared store, notes the journal rows of inbox `name` that `log`
    /// holds above the last catch-up. `log` must show committed rows only: a
    /// reader's snapshot, or a write transaction that has written nothing.
    /// Returns the largest id of the inbox's rows, if it has any.
    pub(crate) fn catch_up(&self, log: &impl JournalTable, name: &str) -> Result<Option<u64>> {
        if !self.shared {
            return Ok(None);
        }
        // Held across the whole catch-up: catch-ups run one at a time, and
        // each notes only rows above every row noted before it, so one that
        // read an older snapshot never puts back an entry a newer one
        // replaced (say a merged, pruned and claimed-again key's old row).
        let mut seen = self.seen.lock();
        let from = seen.get(name).map_or(0, |&last| last + 1);
        #[cfg(test)]
        tests::between_from_and_rows(self);
        let mut last = None;
        for row in log.range((name, from)..=(name, u64::MAX))? {
            let (k, v) = row?;
            let (id, key) = (k.value().1, v.value().0);
            self.note(name, key, id);
            last = Some(id);
        }
        if let Some(id) = last {
            let entry = seen.entry(name.to_owned()).or_default();
            *entry = (*entry).max(id);
        }
        Ok(seen.get(name).copied())
    }

    /// In a shared store, notes how far merges went in `tx`'s snapshot
    /// (every row up to there is gone for good), for
    /// [`Journal::forget_merged`] to remove their entries once the lookup
    /// that read it has dropped its hold on removals.
    pub(crate) fn note_merged(&self, tx: &ReadTransaction) -> Result<()> {
        if !self.shared {
            return Ok(());
        }
        if let Some(meta) = open_read(tx, META)?
            && let Some(merged) = meta.get(META_JOURNAL_MERGED_THROUGH)?
        {
            self.merged_seen
                .fetch_max(merged.value(), Ordering::Relaxed);
        }
        Ok(())
    }

    /// Removes the entries of rows merged as far as a lookup last saw
    /// ([`Journal::note_merged`]), if some are left. Called with no hold on
    /// removals: it waits for the readers between snapshot and lookup.
    pub(crate) fn forget_merged(&self) {
        let merged = self.merged_seen.load(Ordering::Relaxed);
        if merged > self.forgotten.load(Ordering::Relaxed) {
            self.forget_through(merged);
        }
    }

    /// Holds off removals from the index while the guard lives: take it
    /// before opening a read transaction to look keys up in, and drop it
    /// once they are looked up, before waiting for anything.
    pub(crate) fn hold_removals(&self) -> RwLockReadGuard<'_, ()> {
        self.readers.read()
    }

    /// The id of the journal row that may hold the claim of `key`.
    pub(crate) fn hint(&self, name: &str, key: &str) -> Option<u64> {
        self.index.lock().get(name)?.get(key).copied()
    }

    fn note(&self, name: &str, key: &str, id: u64) {
        self.index
            .lock()
            .entry(name.to_owned())
            .or_default()
            .insert(key.to_owned(), id);
    }

    /// Removes the entries up to `id`, once a merge that moved every row up
    /// to it has committed (entries of rows rolled back go with them), and
    /// once no reader is between its snapshot and its lookups.
    fn forget_through(&self, id: u64) {
        let _alone = self.readers.write();
        let mut index = self.index.lock();
        index.retain(|_, keys| {
            keys.retain(|_, entry| *entry > id);
            !keys.is_empty()
        });
        self.forgotten.fetch_max(id, Ordering::Relaxed);
    }

    /// How many entries the index holds.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.index.lock().values().map(HashMap::len).sum()
    }
}

/// When `key` of inbox `name` was claimed, if journal row `id` is its
/// claim in the transaction that opened `log` (an index entry may point at a
/// row that transaction does not see).
pub(crate) fn journaled_at(
    log: &impl JournalTable,
    name: &str,
    id: u64,
    key: &str,
) -> Result<Option<i64>> {
    Ok(log.get((name, id))?.and_then(|row| {
        let (k, at) = row.value();
        (k == key).then_some(at)
    }))
}

/// How many journal rows inbox `name` has.
pub(crate) fn count(log: &impl JournalTable, name: &str) -> Result<u64> {
    let mut n = 0;
    for row in log.range((name, 0)..=(name, u64::MAX))? {
        row?;
        n += 1;
    }
    Ok(n)
}

/// Where [`claim`] recorded a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claimed {
    /// It was claimed before: nothing written.
    Before,
    /// In the journal: its `seen_at` row and its count are written when the
    /// journal is merged.
    Journaled,
    /// In the ledger: the caller writes its `seen_at` row and its count.
    InLedger,
}

/// Records a claim of `key`, in the journal or the ledger. Writes only that
/// row (the caller writes the rest of the claim), and merges the journal
/// into the ledger when it is full.
pub(crate) fn claim(
    tx: &WriteTransaction,
    journal: &Arc<Journal>,
    name: &str,
    key: &str,
    at: i64,
) -> Result<Claimed> {
    if let Some(id) = journal.hint(name, key)
        && journaled_at(&open_write(tx, INBOX_JOURNAL)?, name, id, key)?.is_some()
    {
        return Ok(Claimed::Before);
    }
    let Some(merge_at) = journal.merge_at else {
        // Insert first and look at what was there: one B-tree walk on a
        // first delivery. A duplicate puts its original time back.
        let mut ledger = open_write(tx, INBOX)?;
        let earlier = ledger.insert((name, key), at)?.map(|v| v.value());
        if let Some(earlier) = earlier {
            ledger.insert((name, key), earlier)?;
            return Ok(Claimed::Before);
        }
        return Ok(Claimed::InLedger);
    };
    if open_write(tx, INBOX)?.get((name, key))?.is_some() {
        return Ok(Claimed::Before);
    }
    let mut log = open_write(tx, INBOX_JOURNAL)?;
    let id = journal.next_id.fetch_add(1, Ordering::Relaxed);
    journal.note(name, key, id);
    log.insert((name, id), (key, at))?;
    if log.len()? >= merge_at {
        drop(log);
        merge(tx, journal)?;
    }
    Ok(Claimed::Journaled)
}

/// Moves every journal row into the ledger, in key order, and writes their
/// `seen_at` rows and counts.
pub(crate) fn merge(tx: &WriteTransaction, journal: &Arc<Journal>) -> Result<()> {
    let mut log = open_write(tx, INBOX_JOURNAL)?;
    let mut rows = Vec::with_capacity(usize::try_from(log.len()?).unwrap_or(0));
    for row in log.iter()? {
        let (k, v) = row?;
        let ((name, id), (key, at)) = (k.value(), v.value());
        rows.push((name.to_owned(), key.to_owned(), at, id));
    }
    if rows.is_empty() {
        return Ok(());
    }
    rows.sort_unstable();
    {
        let mut ledger = open_write(tx, INBOX)?;
        for (name, key, at, _) in &rows {
            ledger.insert((name.as_str(), key.as_str()), *at)?;
        }
        let mut seen = open_write(tx, INBOX_SEEN)?;
        for (name, key, at, _) in &rows {
            seen.insert((name.as_str(), *at, key.as_str()), ())?;
        }
    }
    // Sorted by inbox first: one count update per inbox.
    for group in rows.chunk_by(|a, b| a.0 == b.0) {
        if let Some((name, ..)) = group.first() {
            let n = i64::try_from(group.len()).unwrap_or(i64::MAX);
            ops::add_count(tx, name, n)?;
        }
    }
    log.retain(|_, _| false)?;
    let last = rows.iter().map(|&(_, _, _, id)| id).max().unwrap_or(0);
    let mut meta = open_write(tx, META)?;
    let before = meta
        .get(META_JOURNAL_MERGED_THROUGH)?
        .map_or(0, |v| v.value());
    meta.insert(META_JOURNAL_MERGED_THROUGH, before.max(last))?;
    let journal = journal.clone();
    after_commit(move || journal.forget_through(last));
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};
    use std::rc::Rc;
    use std::sync::Arc;

    use redb::{Database, ReadableDatabase};

    use super::{Claimed, INBOX_JOURNAL, Journal, META, META_JOURNAL_MERGED_THROUGH, claim};
    use crate::schema::{open_read, open_write};

    /// Something to do in the middle of a catch-up.
    type Pause = Box<dyn FnOnce(&Journal)>;

    thread_local! {
        /// What to do in this thread's next catch-up, once it has decided
        /// where to start reading.
        static BETWEEN_FROM_AND_ROWS: RefCell<Option<Pause>> = const { RefCell::new(None) };
    }

    pub(super) fn between_from_and_rows(journal: &Journal) {
        if let Some(f) = BETWEEN_FROM_AND_ROWS.with(|f| f.borrow_mut().take()) {
            f(journal);
        }
    }

    fn shared_journal() -> Journal {
        Journal {
            merge_at: Some(4096),
            shared: true,
            ..Journal::default()
        }
    }

    /// Commits `f`'s writes to the journal and the meta table, as another
    /// process would.
    fn commit(db: &Database, f: impl FnOnce(&redb::WriteTransaction)) {
        let tx = db.begin_write().unwrap();
        f(&tx);
        tx.commit().unwrap();
    }

    #[test]
    fn a_catch_up_from_an_older_snapshot_never_replaces_a_newer_entry() {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(Database::create(dir.path().join("j.redb")).unwrap());
        let journal = shared_journal();
        // Another process journals K at 15.
        commit(&db, |tx| {
            let mut log = open_write(tx, INBOX_JOURNAL).unwrap();
            log.insert(("in", 15), ("K", 1)).unwrap();
        });
        // A reader of this process opens its snapshot.
        let snapshot = db.begin_read().unwrap();
        // The other process merges 15, prunes K and claims it again at 40.
        commit(&db, |tx| {
            let mut log = open_write(tx, INBOX_JOURNAL).unwrap();
            log.remove(("in", 15)).unwrap();
            log.insert(("in", 40), ("K", 2)).unwrap();
            let mut meta = open_write(tx, META).unwrap();
            meta.insert(META_JOURNAL_MERGED_THROUGH, 15).unwrap();
        });
        // While the reader catches up, a write transaction of this process
        // catches up too: in the middle of the reader's if it can take
        // `seen` now, else (it would wait) after it.
        let write_catch_up = {
            let db = db.clone();
            move |journal: &Journal| {
                let tx = db.begin_write().unwrap();
                journal.catch_up_all(&tx).unwrap();
                assert_eq!(journal.hint("in", "K"), Some(40));
                tx.abort().unwrap();
            }
        };
        let ran_between = Rc::new(Cell::new(false));
        BETWEEN_FROM_AND_ROWS.with(|f| {
            let ran_between = ran_between.clone();
            let write_catch_up = write_catch_up.clone();
            *f.borrow_mut() = Some(Box::new(move |journal: &Journal| {
                if journal.seen.try_lock().is_some() {
                    write_catch_up(journal);
                    ran_between.set(true);
                }
            }));
        });
        let log = open_read(&snapshot, INBOX_JOURNAL).unwrap().unwrap();
        journal.catch_up(&log, "in").unwrap();
        if !ran_between.get() {
            write_catch_up(&journal);
        }
        drop((log, snapshot));
        // This process now offers K: it is claimed, at 40.
        let tx = db.begin_write().unwrap();
        journal.catch_up_all(&tx).unwrap();
        let journal = Arc::new(journal);
        assert_eq!(claim(&tx, &journal, "in", "K", 3).unwrap(), Claimed::Before);
        tx.abort().unwrap();
    }

    /// A store on `dir`'s one file, shared as between processes, merging
    /// its journal every `journal_size` claims.
    fn open_shared(dir: &std::path::Path, journal_size: u64) -> crate::Result<crate::Store> {
        crate::Store::builder()
            .shared(true)
            .journal_size(journal_size)
            .open(dir.join("shared.idem"))
    }

    #[test]
    fn entries_of_rows_another_process_merged_go_at_the_next_write() -> crate::Result<()> {
        let dir = tempfile::tempdir().unwrap();
        let open = || open_shared(dir.path(), 4);
        let (a, b) = (open()?, open()?);
        let (a_in, b_in) = (a.inbox("in")?, b.inbox("in")?);
        for key in ["a1", "a2", "a3"] {
            assert!(a_in.claim(key, chrono::Utc::now())?);
        }
        assert_eq!(a_in.journal.len(), 3);
        // B's claim fills the journal: B merges A's rows and its own.
        assert!(b_in.claim("b1", chrono::Utc::now())?);
        assert_eq!(a_in.journal.len(), 3, "nothing learnt before a write");
        // A's next write transaction, whatever it writes, catches up.
        a.inbox("other")?.claim("x", chrono::Utc::now())?;
        assert_eq!(a_in.journal.len(), 1, "only A's new row is left");
        for key in ["a1", "a2", "a3", "b1"] {
            assert!(
                !a_in.claim(key, chrono::Utc::now())?,
                "{key} is still claimed"
            );
        }
        Ok(())
    }

    #[test]
    fn a_process_that_only_reads_forgets_what_others_merged() -> crate::Result<()> {
        let dir = tempfile::tempdir().unwrap();
        let open = || open_shared(dir.path(), 4);
        let (reader, writer) = (open()?, open()?);
        let (r_in, w_in) = (reader.inbox("in")?, writer.inbox("in")?);
        let mut most = 0;
        for n in 0..40 {
            let key = format!("k{n}");
            assert!(w_in.claim(&key, chrono::Utc::now())?);
            assert!(r_in.seen(&key)?, "{key} is seen by the reader");
            most = most.max(r_in.journal.len());
        }
        // The writer merged every 4 claims; the reader, which never
        // writes, holds entries only for rows not yet merged.
        assert!(most <= 4, "the reader's index grew to {most} entries");
        for n in 0..40 {
            assert!(r_in.seen(&format!("k{n}"))?, "k{n} is still claimed");
        }
        Ok(())
    }

    #[test]
    fn entries_up_to_a_merged_id_are_removed() {
        let journal = Journal::default();
        journal.note("a", "k", 1);
        journal.note("b", "rolled-back", 2);
        journal.note("a", "later", 4);
        journal.forget_through(3);
        assert_eq!(journal.hint("a", "k"), None);
        assert_eq!(journal.hint("b", "rolled-back"), None);
        assert_eq!(journal.hint("a", "later"), Some(4));
    }

    #[test]
    fn removals_wait_for_readers_between_snapshot_and_lookup() {
        let journal = std::sync::Arc::new(Journal::default());
        journal.note("a", "k", 1);
        let guard = journal.hold_removals();
        let remover = {
            let journal = journal.clone();
            std::thread::spawn(move || journal.forget_through(1))
        };
        // Whenever the remover runs, it cannot remove while the guard lives.
        assert_eq!(journal.hint("a", "k"), Some(1));
        drop(guard);
        remover.join().unwrap();
        assert_eq!(journal.hint("a", "k"), None);
    }
}
