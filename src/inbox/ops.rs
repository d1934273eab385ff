//! The inbox's operations on one write transaction: what [`Inbox`](super::Inbox)
//! queues to the engine and what its `*_in` calls run inside the caller's
//! own transaction. Each is a pure function of the transaction's state and
//! its arguments (the engine may run one again after rolling it back, and it
//! must write the same); times are µs since the Unix epoch.

use std::sync::Arc;

use redb::{ReadableTable, WriteTransaction};

use super::journal::{self, Journal};
use crate::error::Result;
use crate::schema::{INBOX, INBOX_COUNT, INBOX_SEEN, open_write};

/// Claims `key` in inbox `name` at `at`; `false`, writing nothing, if it
/// is claimed already (in the ledger or the journal).
///
/// A first claim goes where the store's journal sends it. With a journal
/// (`Durability::Immediate`), only its journal row is written: its `seen_at` row and
/// its count follow when the journal is merged, which this claim does
/// itself when its row fills the journal (moving every journal row into the
/// ledger, the `seen_at` index and the counts). Without one
/// (`Durability::None`), it writes the ledger row, its `seen_at` index row
/// and the inbox's count.
pub(super) fn claim(
    tx: &WriteTransaction,
    journal: &Arc<Journal>,
    name: &str,
    key: &str,
    at: i64,
) -> Result<bool> {
    match journal::claim(tx, journal, name, key, at)? {
        journal::Claimed::Before => Ok(false),
        // Its `seen_at` row and count are written when the journal is merged.
        journal::Claimed::Journaled => Ok(true),
        journal::Claimed::InLedger => {
            open_write(tx, INBOX_SEEN)?.insert((name, at, key), ())?;
            add_count(tx, name, 1)?;
            Ok(true)
        }
    }
}

/// Removes up to `limit` of the keys of inbox `name` claimed strictly
/// before `cutoff`, earliest claimed first, with their `seen_at` rows and
/// count; returns how many, and whether more such keys remain (the caller's
/// next chunk).
///
/// Pruning works on the ledger: with `merge` it first moves the journal
/// there (a merge, so a key is still in one place only), which puts every
/// key claimed before this transaction in reach. A later chunk of the same
/// prune need not merge again: what it would move was claimed after the
/// prune began.
pub(super) fn prune(
    tx: &WriteTransaction,
    journal: &Arc<Journal>,
    name: &str,
    cutoff: i64,
    limit: usize,
    merge: bool,
) -> Result<(u64, bool)> {
    if merge {
        journal::merge(tx, journal)?;
    }
    let mut index = open_write(tx, INBOX_SEEN)?;
    let mut doomed: Vec<(i64, String)> = Vec::new();
    let mut more = false;
    for row in index.range((name, i64::MIN, "")..(name, cutoff, ""))? {
        if doomed.len() >= limit {
            more = true;
            break;
        }
        let (k, _) = row?;
        let (_, at, key) = k.value();
        doomed.push((at, key.to_owned()));
    }
    if doomed.is_empty() {
        return Ok((0, false));
    }
    let mut rows = open_write(tx, INBOX)?;
    for (at, key) in &doomed {
        index.remove((name, *at, key.as_str()))?;
        rows.remove((name, key.as_str()))?;
    }
    let n = doomed.len() as u64;
    add_count(tx, name, -i64::try_from(n).unwrap_or(i64::MAX))?;
    Ok((n, more))
}

/// Adds `delta` to the count of inbox `name`'s ledger rows; a count that
/// reaches zero is removed (the count table holds no zeros).
pub(super) fn add_count(tx: &WriteTransaction, name: &str, delta: i64) -> Result<()> {
    let mut counts = open_write(tx, INBOX_COUNT)?;
    let next = ledger_count(&counts, name)?.saturating_add_signed(delta);
    if next == 0 {
        counts.remove(name)?;
    } else {
        counts.insert(name, next)?;
    }
    Ok(())
}

/// The count of inbox `name`'s ledger rows in `counts` (0 if it has none).
pub(super) fn ledger_count(
    counts: &impl ReadableTable<&'static str, u64>,
    name: &str,
) -> Result<u64> {
    Ok(counts.get(name)?.map_or(0, |v| v.value()))
}
