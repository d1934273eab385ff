//! The journal of recent claims: what lets a durable claim append to the end
//! of a table instead of writing into the middle of the ledger.
//!
//! The ledger [`INBOX`] is keyed by `(inbox, key)`, so fresh keys land all
//! over it: each claim of a batch copies and rewrites a different 4 KiB leaf,
//! and the commit writes and syncs one scattered page per claim. Measured on
//! a 2-core VM, that capped group commit near 35k claims/s whatever the
//! batch. So a claim instead appends `(inbox, key, seen_at)` under an
//! increasing id to [`INBOX_LOG`] (with its [`INBOX_SEEN`] row and the count,
//! which grow at their ends too), and once the journal holds the store's
//! `journal_size` entries, the claim that fills it moves the whole journal,
//! sorted, into the ledger, in the same transaction. The ledger's pages are
//! then written once per merge, not once per claim.
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
//! - an entry is removed only once the merge that moved its row to the
//!   ledger has committed, and only while no reader stands between opening
//!   its snapshot and its lookup ([`Journal::reading`]), so that a reader
//!   whose snapshot predates the merge still finds the key;
//! - ids are never reused while the store is open, so an entry never points
//!   at another key's row.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock};
use redb::{ReadTransaction, ReadableTable, ReadableTableMetadata, TableError, WriteTransaction};

use crate::engine::after_commit;
use crate::error::Result;
use crate::schema::{INBOX, INBOX_LOG};

/// The in-memory index of the journal's entries; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct Journal {
    /// `inbox → key → id` of the entry's journal row.
    index: Mutex<HashMap<String, HashMap<String, u64>>>,
    /// The next id to hand out.
    next_id: AtomicU64,
    /// Held shared by readers from opening their snapshot to their last
    /// lookup; removals from `index` need it alone.
    readers: RwLock<()>,
    /// Entries whose rows were merged into the ledger, to remove.
    merged: Mutex<Vec<(String, String, u64)>>,
    /// For a store whose claims go to the journal, how many entries it
    /// holds before a merge; `None` when claims go straight to the ledger.
    merge_at: Option<u64>,
}

impl Journal {
    /// Builds the index from the journal table. New claims are appended to
    /// the journal, merged when it holds `merge_at` entries, or written
    /// straight to the ledger for `None`.
    pub(crate) fn load(tx: &ReadTransaction, merge_at: Option<u64>) -> Result<Journal> {
        let journal = Journal {
            merge_at,
            ..Journal::default()
        };
        let log = match tx.open_table(INBOX_LOG) {
            Ok(t) => t,
            Err(TableError::TableDoesNotExist(_)) => return Ok(journal),
            Err(e) => return Err(e.into()),
        };
        let mut next = 0;
        {
            let mut index = journal.index.lock();
            for row in log.iter()? {
                let (id, entry) = row?;
                let (name, key, _) = entry.value();
                index
                    .entry(name.to_owned())
                    .or_default()
                    .insert(key.to_owned(), id.value());
                next = id.value() + 1;
            }
        }
        journal.next_id.store(next, Ordering::Relaxed);
        Ok(journal)
    }

    /// Runs `f`, which opens a read transaction and looks keys up in it,
    /// with removals from the index held off meanwhile.
    pub(crate) fn reading<T>(&self, f: impl FnOnce() -> T) -> T {
        let _guard = self.readers.read_recursive();
        f()
    }

    fn hint(&self, name: &str, key: &str) -> Option<u64> {
        self.index.lock().get(name)?.get(key).copied()
    }

    fn note(&self, name: &str, key: &str, id: u64) {
        self.index
            .lock()
            .entry(name.to_owned())
            .or_default()
            .insert(key.to_owned(), id);
    }

    /// Removes the entries of rows that a committed merge moved to the
    /// ledger, now or, if a reader is looking, later.
    fn forget(&self, merged: Vec<(String, String, u64)>) {
        self.merged.lock().extend(merged);
        self.remove_merged();
    }

    fn remove_merged(&self) {
        let Some(_alone) = self.readers.try_write() else {
            return;
        };
        let merged = std::mem::take(&mut *self.merged.lock());
        let mut index = self.index.lock();
        for (name, key, id) in merged {
            if let Some(keys) = index.get_mut(&name) {
                if keys.get(&key) == Some(&id) {
                    keys.remove(&key);
                }
                if keys.is_empty() {
                    index.remove(&name);
                }
            }
        }
    }
}

/// When `key` of inbox `name` was claimed, as the transaction that opened
/// `ledger` and `log` sees it.
pub(crate) fn find(
    journal: &Journal,
    ledger: Option<&impl ReadableTable<(&'static str, &'static str), i64>>,
    log: Option<&impl ReadableTable<u64, (&'static str, &'static str, i64)>>,
    name: &str,
    key: &str,
) -> Result<Option<i64>> {
    if let Some(ledger) = ledger
        && let Some(at) = ledger.get((name, key))?
    {
        return Ok(Some(at.value()));
    }
    let (Some(log), Some(id)) = (log, journal.hint(name, key)) else {
        return Ok(None);
    };
    Ok(log.get(id)?.and_then(|row| {
        let (n, k, at) = row.value();
        (n == name && k == key).then_some(at)
    }))
}

/// Records a claim of `key`; `false` if it was claimed before. Writes only
/// the journal row or the ledger row (the caller writes the rest of the
/// claim), and merges the journal into the ledger when it is full.
pub(crate) fn claim(
    tx: &WriteTransaction,
    journal: &Arc<Journal>,
    name: &str,
    key: &str,
    at: i64,
) -> Result<bool> {
    if let Some(id) = journal.hint(name, key) {
        let log = tx.open_table(INBOX_LOG)?;
        if log
            .get(id)?
            .is_some_and(|row| matches!(row.value(), (n, k, _) if n == name && k == key))
        {
            return Ok(false);
        }
    }
    let Some(merge_at) = journal.merge_at else {
        // Insert first and look at what was there: one B-tree walk on a
        // first delivery. A duplicate puts its original time back.
        let mut ledger = tx.open_table(INBOX)?;
        let earlier = ledger.insert((name, key), at)?.map(|v| v.value());
        if let Some(earlier) = earlier {
            ledger.insert((name, key), earlier)?;
            return Ok(false);
        }
        return Ok(true);
    };
    if tx.open_table(INBOX)?.get((name, key))?.is_some() {
        return Ok(false);
    }
    let mut log = tx.open_table(INBOX_LOG)?;
    let id = journal.next_id.fetch_add(1, Ordering::Relaxed);
    journal.note(name, key, id);
    log.insert(id, (name, key, at))?;
    if log.len()? >= merge_at {
        drop(log);
        merge(tx, journal)?;
    }
    Ok(true)
}

/// Moves every journal row into the ledger, in key order.
pub(crate) fn merge(tx: &WriteTransaction, journal: &Arc<Journal>) -> Result<()> {
    let mut log = tx.open_table(INBOX_LOG)?;
    let mut rows = Vec::with_capacity(usize::try_from(log.len()?).unwrap_or(0));
    for row in log.iter()? {
        let (id, entry) = row?;
        let (name, key, at) = entry.value();
        rows.push((name.to_owned(), key.to_owned(), at, id.value()));
    }
    if rows.is_empty() {
        return Ok(());
    }
    rows.sort_unstable();
    {
        let mut ledger = tx.open_table(INBOX)?;
        for (name, key, at, _) in &rows {
            ledger.insert((name.as_str(), key.as_str()), *at)?;
        }
    }
    log.retain(|_, _| false)?;
    let journal = journal.clone();
    journal.remove_merged();
    let merged = rows
        .into_iter()
        .map(|(name, key, _, id)| (name, key, id))
        .collect();
    after_commit(move || journal.forget(merged));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Journal;

    fn merged(id: u64) -> Vec<(String, String, u64)> {
        vec![("a".to_owned(), "k".to_owned(), id)]
    }

    #[test]
    fn merged_entries_are_removed_only_while_no_reader_looks() {
        let journal = Journal::default();
        journal.note("a", "k", 1);
        let during = journal.reading(|| {
            journal.forget(merged(1));
            journal.hint("a", "k")
        });
        assert_eq!(during, Some(1), "kept while a reader looks");
        journal.forget(Vec::new());
        assert_eq!(journal.hint("a", "k"), None, "removed once it is alone");
        // An entry pointing at a newer row stays.
        journal.note("a", "k", 2);
        journal.forget(merged(1));
        assert_eq!(journal.hint("a", "k"), Some(2));
    }
}
