//! [`Inbox`]: a dedup ledger of external event ids.
//!
//! Each event key is recorded once per inbox. The first delivery of a key
//! claims it (`true`, or [`Claim::Applied`] with the effect's result); every
//! later delivery — a duplicate, a replay, a concurrent retry — is told so and
//! its effect does not run. With [`Inbox::claim_with`] and [`Inbox::claim_in`]
//! the claim and the effect commit in one write transaction, or neither does.
//!
//! Layout: the ledger `(inbox, key) → seen_at` in [`INBOX`], its prune index
//! `(inbox, seen_at, key)` in [`INBOX_SEEN`] and the per-inbox count of its
//! rows in [`INBOX_COUNT`]. A durable store's claims first go to the journal
//! of recent claims [`INBOX_LOG`] and reach those three tables in bulk (see
//! [`journal`]); under `Durability::None` a claim writes all three at once.

mod journal;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use redb::{ReadTransaction, ReadableTable, WriteTransaction};

use crate::codec::{from_micros, micros};
use crate::engine::Engine;
use crate::error::{Error, Result, check_len};
use crate::schema::{INBOX, INBOX_COUNT, INBOX_LOG, INBOX_SEEN, open_read, open_write};

pub(crate) use journal::Journal;

/// Longest event key accepted, in bytes.
pub const MAX_EVENT_KEY_LEN: usize = 1024;
/// Longest inbox name accepted, in bytes.
pub const MAX_INBOX_NAME_LEN: usize = 64;

/// The outcome of [`Inbox::claim_with`].
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
        if !self.engine.is_busy() && self.seen_unsettled(event_key)? {
            return Ok(false);
        }
        let (journal, name) = (self.journal.clone(), self.name.clone());
        let key = event_key.to_owned();
        let at = micros(seen_at);
        self.engine
            .execute(move |tx| claim_raw(tx, &journal, &name, &key, at))
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
        let keys: Vec<String> = event_keys
            .into_iter()
            .map(|k| {
                let k = k.as_ref();
                check_event_key(k).map(|()| k.to_owned())
            })
            .collect::<Result<_>>()?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let (journal, name) = (self.journal.clone(), self.name.clone());
        let at = micros(seen_at);
        self.engine.execute(move |tx| {
            keys.iter()
                .map(|k| claim_raw(tx, &journal, &name, k, at))
                .collect()
        })
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
        if self.seen_unsettled(event_key)? {
            return Ok(Claim::Duplicate);
        }
        let at = micros(seen_at);
        self.engine.write(|tx| {
            if !claim_raw(tx, &self.journal, &self.name, event_key, at)? {
                return Ok(Claim::Duplicate);
            }
            effect(tx).map(Claim::Applied)
        })
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
        claim_raw(tx, &self.journal, &self.name, event_key, micros(seen_at))
    }

    /// Whether `event_key` is claimed; a `true` is returned only once that
    /// claim is durable (D2), a `false` at once (the caller goes on to claim).
    fn seen_unsettled(&self, event_key: &str) -> Result<bool> {
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
        at.map(|at| from_micros(INBOX.name(), &event_key, at))
            .transpose()
    }

    /// When `event_key` was claimed, from a snapshot taken now (the ledger
    /// or the journal), with the sequence number to settle before answering.
    fn lookup(&self, event_key: &str) -> Result<(Option<i64>, u64)> {
        self.engine.commit_pending()?;
        let _removals = self.journal.hold_removals();
        self.engine.read_with_seq(|tx| {
            let name: &str = &self.name;
            if let Some(ledger) = open_read(tx, INBOX)?
                && let Some(at) = ledger.get((name, event_key))?
            {
                return Ok(Some(at.value()));
            }
            let Some(id) = self.journal.hint(name, event_key) else {
                return Ok(None);
            };
            match open_read(tx, INBOX_LOG)? {
                Some(log) => journal::journaled_at(&log, name, id, event_key),
                None => Ok(None),
            }
        })
    }

    /// Removes the keys claimed strictly before `seen_before`; returns how
    /// many. Costs what it removes (it walks the `seen_at` index, not the
    /// ledger). A pruned key can be claimed again: prune only past the
    /// window in which duplicates can still arrive.
    pub fn prune(&self, seen_before: DateTime<Utc>) -> Result<u64> {
        let (journal, name) = (self.journal.clone(), self.name.clone());
        let cutoff = micros(seen_before);
        self.engine
            .execute(move |tx| prune_raw(tx, &journal, &name, cutoff))
    }

    /// [`Inbox::prune`] inside the caller's own write transaction.
    pub fn prune_in(&self, tx: &WriteTransaction, seen_before: DateTime<Utc>) -> Result<u64> {
        prune_raw(tx, &self.journal, &self.name, micros(seen_before))
    }

    /// Number of keys recorded in this inbox. Reads the inbox's count and
    /// its rows in the journal of recent claims (at most
    /// [`StoreBuilder::journal_size`](crate::StoreBuilder::journal_size)),
    /// never the ledger itself.
    pub fn len(&self) -> Result<u64> {
        self.engine.read(|tx| {
            let name: &str = &self.name;
            let merged = match open_read(tx, INBOX_COUNT)? {
                Some(counts) => counts.get(name)?.map_or(0, |v| v.value()),
                None => 0,
            };
            let journaled = match open_read(tx, INBOX_LOG)? {
                Some(log) => journal::count(&log, name)?,
                None => 0,
            };
            Ok(merged + journaled)
        })
    }

    /// Whether this inbox holds no keys.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Up to `limit` keys in claim order (oldest first) with their
    /// `seen_at`, starting strictly after `after` (a `(seen_at, key)` from a
    /// previous page). For inspection tools.
    pub fn list(
        &self,
        after: Option<(DateTime<Utc>, &str)>,
        limit: usize,
    ) -> Result<Vec<(String, DateTime<Utc>)>> {
        let name: &str = &self.name;
        let start = after.map_or((i64::MIN, String::new()), |(at, k)| {
            (micros(at), k.to_owned())
        });
        let past_start = |at: i64, key: &str| match after {
            Some(_) => (at, key) > (start.0, start.1.as_str()),
            None => true,
        };
        self.engine.read(|tx| {
            // The ledger's keys come in order from the `seen_at` index; the
            // journal's (at most `journal_size`, not indexed yet) are
            // gathered and sorted, then the two are merged.
            let mut journaled: Vec<(i64, String)> = Vec::new();
            if let Some(log) = open_read(tx, INBOX_LOG)? {
                for row in log.range((name, 0)..=(name, u64::MAX))? {
                    let (_, entry) = row?;
                    let (key, at) = entry.value();
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
        })
    }
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
    if let Some(log) = open_read(tx, INBOX_LOG)? {
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
    if let Some(t) = open_read(tx, INBOX_LOG)? {
        for row in t.iter()? {
            let (k, v) = row?;
            let ((name, id), (key, at)) = (k.value(), v.value());
            let claim = (name.to_owned(), key.to_owned());
            if rows.contains_key(&claim) || journaled.insert(claim, at).is_some() {
                findings.push(format!(
                    "{}: key {key:?} of inbox {name:?} (journal id {id}) is claimed twice",
                    INBOX_LOG.name(),
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

fn check_event_key(key: &str) -> Result<()> {
    check_len("event key", key, MAX_EVENT_KEY_LEN)
}

fn check_inbox_name(name: &str) -> Result<()> {
    check_len("inbox name", name, MAX_INBOX_NAME_LEN)?;
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        return Err(Error::invalid(
            "inbox name",
            format!("{c:?} is not allowed; use ASCII letters, digits, '_', '-' and '.'"),
        ));
    }
    Ok(())
}

use redb::TableHandle as _;

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
fn claim_raw(
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

fn prune_raw(
    tx: &WriteTransaction,
    journal: &Arc<Journal>,
    name: &str,
    cutoff: i64,
) -> Result<u64> {
    // Pruning works on the ledger: move the journal there first.
    journal::merge(tx, journal)?;
    let mut index = open_write(tx, INBOX_SEEN)?;
    let doomed: Vec<(i64, String)> = index
        .range((name, i64::MIN, "")..(name, cutoff, ""))?
        .map(|row| {
            row.map(|(k, _)| {
                let (_, at, key) = k.value();
                (at, key.to_owned())
            })
        })
        .collect::<std::result::Result<_, _>>()?;
    if doomed.is_empty() {
        return Ok(0);
    }
    let mut rows = open_write(tx, INBOX)?;
    for (at, key) in &doomed {
        index.remove((name, *at, key.as_str()))?;
        rows.remove((name, key.as_str()))?;
    }
    let n = doomed.len() as u64;
    add_count(tx, name, -i64::try_from(n).unwrap_or(i64::MAX))?;
    Ok(n)
}

fn add_count(tx: &WriteTransaction, name: &str, delta: i64) -> Result<()> {
    let mut counts = open_write(tx, INBOX_COUNT)?;
    let current = counts.get(name)?.map_or(0, |v| v.value());
    let next = current.saturating_add_signed(delta);
    if next == 0 {
        counts.remove(name)?;
    } else {
        counts.insert(name, next)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        for bad in ["", "has space", "slash/", "nul\0", "ü"] {
            assert!(
                matches!(check_inbox_name(bad), Err(Error::InvalidInput { .. })),
                "{bad:?}"
            );
        }
        assert!(matches!(
            check_inbox_name(&"a".repeat(65)),
            Err(Error::TooLarge { .. })
        ));
        for good in ["webhooks", "payments.v2", "a-b_c", &"a".repeat(64)] {
            assert!(check_inbox_name(good).is_ok(), "{good:?}");
        }
    }
}
