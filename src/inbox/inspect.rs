//! Inspection: listing an inbox's keys, the inbox names, and checking the
//! ledger against its `seen_at` index, the journal and the counts.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use redb::{ReadTransaction, ReadableTable, TableHandle as _};

use super::Inbox;
use crate::codec::{from_micros, micros};
use crate::error::Result;
use crate::schema::{INBOX, INBOX_COUNT, INBOX_JOURNAL, INBOX_SEEN, open_read};

impl Inbox {
    /// Up to `limit` keys in claim order (oldest first) with their
    /// `seen_at`, starting strictly after `after` (a `(seen_at, key)` from a
    /// previous page). For inspection tools.
    pub fn list(
        &self,
        after: Option<(DateTime<Utc>, &str)>,
        limit: usize,
    ) -> Result<Vec<(String, DateTime<Utc>)>> {
        self.engine.read(|tx| list_in(tx, &self.name, after, limit))
    }
}

/// Up to `limit` keys of inbox `name` in claim order with their `seen_at`,
/// strictly after `after`, as `tx` sees them (what [`Inbox::list`] answers).
pub(super) fn list_in(
    tx: &ReadTransaction,
    name: &str,
    after: Option<(DateTime<Utc>, &str)>,
    limit: usize,
) -> Result<Vec<(String, DateTime<Utc>)>> {
    let start = after.map_or((i64::MIN, String::new()), |(at, k)| {
        (micros(at), k.to_owned())
    });
    let past_start = |at: i64, key: &str| match after {
        Some(_) => (at, key) > (start.0, start.1.as_str()),
        None => true,
    };
    // The ledger's keys come in order from the `seen_at` index; the
    // journal's (at most `journal_size`, not indexed yet) are gathered and
    // sorted, then the two are merged.
    let mut journaled: Vec<(i64, String)> = Vec::new();
    if let Some(log) = open_read(tx, INBOX_JOURNAL)? {
        for row in log.range((name, 0)..=(name, u64::MAX))? {
            let (_, v) = row?;
            let (key, at) = v.value();
            if past_start(at, key) {
                journaled.push((at, key.to_owned()));
            }
        }
    }
    journaled.sort_unstable();
    let mut journaled = journaled.into_iter().peekable();
    let mut indexed: Vec<(i64, String)> = Vec::new();
    if let Some(index) = open_read(tx, INBOX_SEEN)? {
        for row in index.range((name, start.0, start.1.as_str())..)? {
            let (k, _) = row?;
            let (n, at, key) = k.value();
            if n != name || indexed.len() >= limit {
                break;
            }
            if past_start(at, key) {
                indexed.push((at, key.to_owned()));
            }
        }
    }
    let mut indexed = indexed.into_iter().peekable();
    let mut out = Vec::new();
    while out.len() < limit {
        let from_index = match (indexed.peek(), journaled.peek()) {
            (Some(a), Some(b)) => a <= b,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => break,
        };
        let next = if from_index {
            indexed.next()
        } else {
            journaled.next()
        };
        if let Some((at, key)) = next {
            let when = from_micros(INBOX_SEEN.name(), &key, at)?;
            out.push((key, when));
        }
    }
    Ok(out)
}

/// The names of the inboxes holding at least one key, in name order (from
/// the count table, one row per inbox with keys in the ledger, and the
/// journal).
pub(crate) fn names(tx: &ReadTransaction) -> Result<Vec<String>> {
    let mut names = BTreeSet::new();
    if let Some(counts) = open_read(tx, INBOX_COUNT)? {
        for row in counts.iter()? {
            names.insert(row?.0.value().to_owned());
        }
    }
    if let Some(log) = open_read(tx, INBOX_JOURNAL)? {
        for row in log.iter()? {
            let (k, _) = row?;
            let (name, _) = k.value();
            if !names.contains(name) {
                names.insert(name.to_owned());
            }
        }
    }
    Ok(names.into_iter().collect())
}

/// Checks the inbox invariants of [`crate::schema`] over every inbox: each
/// ledger row `(inbox, key) → seen_at` has its index row `(inbox, seen_at,
/// key)` and each index row its ledger row; a journal row has none yet and
/// no key is claimed twice; [`INBOX_COUNT`] holds each inbox's number of
/// claimed keys (no zero counts). Returns one human-readable finding per
/// violation; none when consistent. Reads every row.
pub(crate) fn check_indexes(tx: &ReadTransaction) -> Result<Vec<String>> {
    let mut findings = Vec::new();
    let mut rows: BTreeMap<(String, String), i64> = BTreeMap::new();
    if let Some(t) = open_read(tx, INBOX)? {
        for row in t.iter()? {
            let (k, v) = row?;
            let (name, key) = k.value();
            rows.insert((name.to_owned(), key.to_owned()), v.value());
        }
    }
    let mut journaled: BTreeMap<(String, String), i64> = BTreeMap::new();
    if let Some(t) = open_read(tx, INBOX_JOURNAL)? {
        for row in t.iter()? {
            let (k, v) = row?;
            let ((name, id), (key, at)) = (k.value(), v.value());
            let claim = (name.to_owned(), key.to_owned());
            if rows.contains_key(&claim) || journaled.insert(claim, at).is_some() {
                findings.push(format!(
                    "{}: key {key:?} of inbox {name:?} (journal id {id}) is claimed twice",
                    INBOX_JOURNAL.name(),
                ));
            }
        }
    }
    let mut indexed: BTreeMap<(String, String), i64> = BTreeMap::new();
    if let Some(t) = open_read(tx, INBOX_SEEN)? {
        for row in t.iter()? {
            let (k, _) = row?;
            let (name, at, key) = k.value();
            let id = (name.to_owned(), key.to_owned());
            if let Some(earlier) = indexed.insert(id, at) {
                findings.push(format!(
                    "{}: key {key:?} of inbox {name:?} is indexed twice (at {earlier} µs and {at} µs)",
                    INBOX_SEEN.name()
                ));
            }
        }
    }
    for ((name, key), at) in &rows {
        match indexed.get(&(name.clone(), key.clone())) {
            None => findings.push(format!(
                "{}: missing index row for key {key:?} of inbox {name:?} seen at {at} µs",
                INBOX_SEEN.name()
            )),
            Some(i) if i != at => findings.push(format!(
                "{}: key {key:?} of inbox {name:?} is indexed at {i} µs but was seen at {at} µs",
                INBOX_SEEN.name()
            )),
            Some(_) => {}
        }
    }
    for ((name, key), at) in &indexed {
        let claim = (name.clone(), key.clone());
        if journaled.contains_key(&claim) {
            findings.push(format!(
                "{}: key {key:?} of inbox {name:?} is indexed at {at} µs before its journal row is merged",
                INBOX_SEEN.name()
            ));
        } else if !rows.contains_key(&claim) {
            findings.push(format!(
                "{}: index row at {at} µs for key {key:?} of inbox {name:?} has no row",
                INBOX_SEEN.name()
            ));
        }
    }
    let mut expected: BTreeMap<&str, u64> = BTreeMap::new();
    for (name, _) in rows.keys() {
        *expected.entry(name.as_str()).or_default() += 1;
    }
    let mut stored: BTreeMap<String, u64> = BTreeMap::new();
    if let Some(t) = open_read(tx, INBOX_COUNT)? {
        for row in t.iter()? {
            let (k, v) = row?;
            stored.insert(k.value().to_owned(), v.value());
        }
    }
    for (name, n) in &stored {
        let want = expected.get(name.as_str()).copied().unwrap_or(0);
        if *n != want {
            findings.push(format!(
                "{}: inbox {name:?} is counted {n} but holds {want} keys",
                INBOX_COUNT.name()
            ));
        }
    }
    for (name, n) in &expected {
        if !stored.contains_key(*name) {
            findings.push(format!(
                "{}: inbox {name:?} holds {n} keys but has no count",
                INBOX_COUNT.name()
            ));
        }
    }
    Ok(findings)
}
