//! The outbox's tables and the invariants between a row and its index rows.
//!
//! For a record `id` with status `s`:
//!
//! | table                 | row                                  | present when                 |
//! |-----------------------|--------------------------------------|------------------------------|
//! | [`OUTBOX`]            | `id → record`                        | always                       |
//! | [`OUTBOX_DEDUP`]      | `(destination, key) → id`            | always                       |
//! | [`OUTBOX_BY_COMMAND`] | `(command_id, created_at, id)`       | always                       |
//! | [`OUTBOX_DUE`]        | `(next_attempt_at ∨ created_at, id)` | `s = Pending`                |
//! | [`OUTBOX_CLAIMED`]    | `(claimed_at, id)`                   | `s = Dispatching`            |
//! | [`OUTBOX_FINISHED`]   | `(completed_at, id)`                 | `s ∈ {Completed, Failed}`    |
//! | [`OUTBOX_COUNT`]      | `status code → n`                    | one count per status, no zeros |
//!
//! Only `Dispatching` holds a claim: its `(claimed_at, id)` row in
//! [`OUTBOX_CLAIMED`] is what the reaper walks, and every edge out of
//! `Dispatching` (to `Completed`, `Pending`, `Failed`, `OutcomeUnknown`)
//! removes it.
//!
//! Within the record: the latest `attempt` `(worker, claimed_at)` is present
//! iff `s ∈ {Dispatching, OutcomeUnknown}` (the claim, then the attempt in
//! doubt), `completed_at` iff `s ∈ {Completed, Failed}`. The next id in
//! [`META`] is larger than every id in use. [`Tables`] keeps all of this true
//! on every write; [`check`] verifies it.

use std::collections::{BTreeMap, BTreeSet};

use redb::{
    ReadTransaction, ReadableTable, Table, TableDefinition, TableHandle as _, WriteTransaction,
};

use super::OutboxStatus;
use super::record::Stored;
use crate::codec::encode;
use crate::error::{Error, Result};
pub(super) use crate::schema::open_read;
use crate::schema::{
    META, META_OUTBOX_NEXT_ID, OUTBOX, OUTBOX_BY_COMMAND, OUTBOX_CLAIMED, OUTBOX_COUNT,
    OUTBOX_DEDUP, OUTBOX_DUE, OUTBOX_FINISHED, open_write,
};

/// The status-dependent index keys of a record: `(due, claimed, finished)`.
fn status_keys(id: u64, s: &Stored) -> Result<(Option<i64>, Option<i64>, Option<i64>)> {
    Ok(match s.status(id)? {
        OutboxStatus::Pending => (Some(s.due()), None, None),
        OutboxStatus::Dispatching => (
            None,
            Some(s.attempt.as_ref().map_or(s.created_at, |a| a.1)),
            None,
        ),
        OutboxStatus::Completed | OutboxStatus::Failed => {
            (None, None, Some(s.completed_at.unwrap_or(s.created_at)))
        }
        OutboxStatus::OutcomeUnknown => (None, None, None),
    })
}

/// Every outbox table, open in one write transaction.
pub(super) struct Tables<'tx> {
    pub(super) rows: Table<'tx, u64, &'static [u8]>,
    pub(super) due: Table<'tx, (i64, u64), ()>,
    pub(super) claimed: Table<'tx, (i64, u64), ()>,
    pub(super) dedup: Table<'tx, (&'static str, &'static str), u64>,
    pub(super) by_command: Table<'tx, (&'static str, i64, u64), ()>,
    pub(super) finished: Table<'tx, (i64, u64), ()>,
    count: Table<'tx, u8, u64>,
    /// Count changes per status code, written by [`Tables::finish`].
    deltas: [i64; 5],
}

impl<'tx> Tables<'tx> {
    pub(super) fn open(tx: &'tx WriteTransaction) -> Result<Tables<'tx>> {
        Ok(Tables {
            rows: open_write(tx, OUTBOX)?,
            due: open_write(tx, OUTBOX_DUE)?,
            claimed: open_write(tx, OUTBOX_CLAIMED)?,
            dedup: open_write(tx, OUTBOX_DEDUP)?,
            by_command: open_write(tx, OUTBOX_BY_COMMAND)?,
            finished: open_write(tx, OUTBOX_FINISHED)?,
            count: open_write(tx, OUTBOX_COUNT)?,
            deltas: [0; 5],
        })
    }

    /// The record `id`, decoded; `None` if there is none.
    pub(super) fn load(&self, id: u64) -> Result<Option<Stored>> {
        match self.rows.get(id)? {
            Some(v) => Stored::decode(id, v.value()).map(Some),
            None => Ok(None),
        }
    }

    /// The record an index row points at; a dangling index row is
    /// [`Error::Corrupted`].
    pub(super) fn load_indexed(&self, index: &'static str, id: u64) -> Result<Stored> {
        self.load(id)?.ok_or_else(|| Error::Corrupted {
            table: index,
            key: id.to_string(),
            reason: "index row without its outbox record".into(),
        })
    }

    /// Writes a new record with all its index rows.
    pub(super) fn insert_new(&mut self, id: u64, s: &Stored) -> Result<()> {
        let keys = status_keys(id, s)?;
        self.rows.insert(id, encode(s).as_slice())?;
        self.dedup
            .insert((s.destination.as_str(), s.idempotency_key.as_str()), id)?;
        self.by_command
            .insert((s.command_id.as_str(), s.created_at, id), ())?;
        self.put_status_keys(id, keys)?;
        self.add_count(s.status, 1);
        Ok(())
    }

    /// Replaces record `id` (`old` as stored) by `new`, moving its status
    /// index rows and counts. Immutable fields (destination, key, command,
    /// `created_at`) keep their index rows.
    pub(super) fn replace(&mut self, id: u64, old: &Stored, new: &Stored) -> Result<()> {
        let (old_keys, new_keys) = (status_keys(id, old)?, status_keys(id, new)?);
        self.rows.insert(id, encode(new).as_slice())?;
        if old_keys != new_keys {
            self.remove_status_keys(id, old_keys)?;
            self.put_status_keys(id, new_keys)?;
        }
        if old.status != new.status {
            self.add_count(old.status, -1);
            self.add_count(new.status, 1);
        }
        Ok(())
    }

    /// Deletes record `id` (`old` as stored) and every index row of it.
    pub(super) fn delete(&mut self, id: u64, old: &Stored) -> Result<()> {
        let keys = status_keys(id, old)?;
        self.rows.remove(id)?;
        self.dedup
            .remove((old.destination.as_str(), old.idempotency_key.as_str()))?;
        self.by_command
            .remove((old.command_id.as_str(), old.created_at, id))?;
        self.remove_status_keys(id, keys)?;
        self.add_count(old.status, -1);
        Ok(())
    }

    fn put_status_keys(
        &mut self,
        id: u64,
        (d, c, f): (Option<i64>, Option<i64>, Option<i64>),
    ) -> Result<()> {
        if let Some(at) = d {
            self.due.insert((at, id), ())?;
        }
        if let Some(at) = c {
            self.claimed.insert((at, id), ())?;
        }
        if let Some(at) = f {
            self.finished.insert((at, id), ())?;
        }
        Ok(())
    }

    fn remove_status_keys(
        &mut self,
        id: u64,
        (d, c, f): (Option<i64>, Option<i64>, Option<i64>),
    ) -> Result<()> {
        if let Some(at) = d {
            self.due.remove((at, id))?;
        }
        if let Some(at) = c {
            self.claimed.remove((at, id))?;
        }
        if let Some(at) = f {
            self.finished.remove((at, id))?;
        }
        Ok(())
    }

    /// Notes a count change; [`Tables::finish`] writes it.
    fn add_count(&mut self, status: u8, delta: i64) {
        self.deltas[usize::from(status)] += delta;
    }

    /// Writes the status counters changed since `open`: once per operation,
    /// not once per entry. Every operation that writes ends with it.
    pub(super) fn finish(mut self) -> Result<()> {
        for (code, delta) in (0u8..).zip(self.deltas) {
            if delta == 0 {
                continue;
            }
            let current = self.count.get(code)?.map_or(0, |v| v.value());
            let next = current.saturating_add_signed(delta);
            if next == 0 {
                self.count.remove(code)?;
            } else {
                self.count.insert(code, next)?;
            }
        }
        Ok(())
    }
}

/// The next outbox id to hand out (ids start at 1 and only grow).
pub(super) fn next_id(meta: &Table<'_, &'static str, u64>) -> Result<u64> {
    Ok(meta.get(META_OUTBOX_NEXT_ID)?.map_or(1, |v| v.value()))
}

/// Every key of a `(i64, u64) → ()` index.
fn pairs(
    tx: &ReadTransaction,
    def: TableDefinition<'static, (i64, u64), ()>,
) -> Result<BTreeSet<(i64, u64)>> {
    let mut out = BTreeSet::new();
    if let Some(t) = open_read(tx, def)? {
        for row in t.iter()? {
            out.insert(row?.0.value());
        }
    }
    Ok(out)
}

/// Compares an expected set of index rows with the stored one.
fn compare<T: Ord + std::fmt::Debug>(
    findings: &mut Vec<String>,
    table: &str,
    expected: &BTreeSet<T>,
    found: &BTreeSet<T>,
) {
    for missing in expected.difference(found) {
        findings.push(format!("{table}: missing index row {missing:?}"));
    }
    for extra in found.difference(expected) {
        findings.push(format!(
            "{table}: index row {extra:?} has no matching record"
        ));
    }
}

/// The index rows and counters the records call for.
#[derive(Default)]
struct Expected {
    due: BTreeSet<(i64, u64)>,
    claimed: BTreeSet<(i64, u64)>,
    finished: BTreeSet<(i64, u64)>,
    by_command: BTreeSet<(String, i64, u64)>,
    dedup: BTreeSet<(String, String, u64)>,
    counts: BTreeMap<u8, u64>,
    max_id: u64,
}

/// Reads every record; notes findings about single records.
fn expected_rows(tx: &ReadTransaction, findings: &mut Vec<String>) -> Result<Expected> {
    let mut ex = Expected::default();
    let Some(rows) = open_read(tx, OUTBOX)? else {
        return Ok(ex);
    };
    for row in rows.iter()? {
        let (key, value) = row?;
        let id = key.value();
        ex.max_id = ex.max_id.max(id);
        let rec = match Stored::decode(id, value.value()) {
            Ok(rec) => rec,
            Err(e) => {
                findings.push(format!("record {id}: {e}"));
                continue;
            }
        };
        let status = rec.status(id)?;
        // The claim while `Dispatching`, the attempt in doubt while
        // `OutcomeUnknown`; the claims index holds the first only.
        let attempted = matches!(
            status,
            OutboxStatus::Dispatching | OutboxStatus::OutcomeUnknown
        );
        if rec.attempt.is_some() != attempted {
            findings.push(format!(
                "record {id} is {status:?} but its attempt is {:?}",
                rec.attempt
            ));
        }
        if rec.completed_at.is_some() != status.is_finished() {
            findings.push(format!(
                "record {id} is {status:?} but completed_at is {:?}",
                rec.completed_at
            ));
        }
        let (due, claimed, finished) = status_keys(id, &rec)?;
        ex.due.extend(due.map(|at| (at, id)));
        ex.claimed.extend(claimed.map(|at| (at, id)));
        ex.finished.extend(finished.map(|at| (at, id)));
        ex.by_command
            .insert((rec.command_id.clone(), rec.created_at, id));
        ex.dedup
            .insert((rec.destination.clone(), rec.idempotency_key.clone(), id));
        *ex.counts.entry(rec.status).or_default() += 1;
    }
    Ok(ex)
}

/// Checks every invariant of the module docs over the whole outbox; returns
/// one human-readable finding per violation (none when consistent). Reads
/// every row: for tests and offline checks, not for a hot path.
pub(super) fn check(tx: &ReadTransaction) -> Result<Vec<String>> {
    let mut findings = Vec::new();
    let expected = expected_rows(tx, &mut findings)?;
    let Expected {
        due,
        claimed,
        finished,
        by_command,
        dedup,
        counts,
        max_id,
    } = expected;
    compare(
        &mut findings,
        OUTBOX_DUE.name(),
        &due,
        &pairs(tx, OUTBOX_DUE)?,
    );
    compare(
        &mut findings,
        OUTBOX_CLAIMED.name(),
        &claimed,
        &pairs(tx, OUTBOX_CLAIMED)?,
    );
    compare(
        &mut findings,
        OUTBOX_FINISHED.name(),
        &finished,
        &pairs(tx, OUTBOX_FINISHED)?,
    );
    let mut found = BTreeSet::new();
    if let Some(t) = open_read(tx, OUTBOX_BY_COMMAND)? {
        for row in t.iter()? {
            let (k, _) = row?;
            let (c, at, id) = k.value();
            found.insert((c.to_owned(), at, id));
        }
    }
    compare(&mut findings, OUTBOX_BY_COMMAND.name(), &by_command, &found);
    let mut found = BTreeSet::new();
    if let Some(t) = open_read(tx, OUTBOX_DEDUP)? {
        for row in t.iter()? {
            let (k, v) = row?;
            let (d, key) = k.value();
            found.insert((d.to_owned(), key.to_owned(), v.value()));
        }
    }
    compare(&mut findings, OUTBOX_DEDUP.name(), &dedup, &found);
    let mut stored_counts = BTreeMap::new();
    if let Some(t) = open_read(tx, OUTBOX_COUNT)? {
        for row in t.iter()? {
            let (k, v) = row?;
            stored_counts.insert(k.value(), v.value());
        }
    }
    if stored_counts != counts {
        findings.push(format!(
            "{}: counters {stored_counts:?} but records say {counts:?}",
            OUTBOX_COUNT.name()
        ));
    }
    let next = match open_read(tx, META)? {
        Some(meta) => meta.get(META_OUTBOX_NEXT_ID)?.map_or(1, |v| v.value()),
        None => 1,
    };
    if next <= max_id {
        findings.push(format!(
            "next outbox id {next} is not above the largest id {max_id}"
        ));
    }
    Ok(findings)
}
