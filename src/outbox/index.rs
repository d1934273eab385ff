//! The outbox's tables and the invariants between a row and its index rows.
//!
//! For a record `id` with status `s`:
//!
//! | table                 | row                                  | present when                 |
//! |-----------------------|--------------------------------------|------------------------------|
//! | [`OUTBOX`]            | `id → record`                        | always                       |
//! | [`OUTBOX_STATE`]      | `id → state`                         | the record changed since it was enqueued |
//! | [`OUTBOX_DEDUP`]      | `(destination, key) → id`            | always                       |
//! | [`OUTBOX_BY_COMMAND`] | `(command_id, created_at, id)`       | always                       |
//! | [`OUTBOX_CLAIMED`]    | `(claimed_at, id)`                   | `s = Dispatching`            |
//! | [`OUTBOX_FINISHED`]   | `(completed_at, id)`                 | `s ∈ {Completed, Failed}`    |
//! | [`OUTBOX_ATTEMPTS`]   | `(id, seq) → attempt record`         | 0 to [`MAX_ATTEMPT_HISTORY`] rows, oldest first |
//!
//! The attempt history is not an index: its rows are written beside the
//! record by the changes that end an attempt without completing it (see
//! [`AttemptRecord`](super::AttemptRecord)), the oldest dropped beyond
//! [`MAX_ATTEMPT_HISTORY`], and deleted with the record. Every history row
//! belongs to a record and decodes. An entry's `seq` only grows, so its
//! history reads oldest first. Earlier builds kept no history: their files
//! have no such table (read as empty histories), and such a build that
//! purges entries of a file this build wrote leaves their history rows
//! behind, which [`check`] reports.
//!
//! A record is its row in [`OUTBOX`], written once by its enqueue, with
//! its row in [`OUTBOX_STATE`], once it has one, in place of the state the
//! first was written with (see `record.rs`): every change after the
//! enqueue writes the state row only. Every state row belongs to a record.
//!
//! Only `Dispatching` holds a claim: its `(claimed_at, id)` row in
//! [`OUTBOX_CLAIMED`] is what the reaper walks, and every edge out of
//! `Dispatching` (to `Completed`, `Pending`, `Failed`, `OutcomeUnknown`)
//! removes it.
//!
//! Within the record: the latest `attempt` `(worker, claimed_at)` is present
//! iff `s ∈ {Dispatching, OutcomeUnknown}` (the claim, then the attempt in
//! doubt), `completed_at` iff `s ∈ {Completed, Failed}`. The outbox's
//! counts by status (kept with the destinations' rows, `flow.rs`) count
//! every record. The next id in
//! [`META`] is larger than every id in use. [`Tables`] keeps all of this true
//! on every write; [`check`] verifies it.

use std::collections::{BTreeMap, BTreeSet};

use redb::{
    ReadTransaction, ReadableTable, Table, TableDefinition, TableHandle as _, WriteTransaction,
};

use super::flow::{self, Flows};
use super::record::{RowKeys, Times};
use super::rules::{AttemptRow, Row};
use super::{AttemptRecord, MAX_ATTEMPT_HISTORY, OutboxStatus};
use crate::error::{Error, Result};
pub(super) use crate::schema::open_read;
use crate::schema::{
    META, META_OUTBOX_NEXT_ID, OUTBOX, OUTBOX_ATTEMPTS, OUTBOX_BY_COMMAND, OUTBOX_CLAIMED,
    OUTBOX_DEDUP, OUTBOX_FINISHED, OUTBOX_FLOWS, OUTBOX_STATE, open_write,
};

/// The status-dependent index keys of a record: the time of its
/// `(time, id)` row in the claims and the finished index, when it has one
/// (at most one of the two). A `Pending` record's row is in its
/// destination's queue instead (`flow.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct StatusKeys {
    claimed: Option<i64>,
    finished: Option<i64>,
}

/// The status-dependent index keys of record `id`, of status and times `row`.
fn status_keys(id: u64, row: Times) -> Result<StatusKeys> {
    let none = StatusKeys::default();
    Ok(match row.status(id)? {
        OutboxStatus::Pending | OutboxStatus::OutcomeUnknown => none,
        OutboxStatus::Dispatching => StatusKeys {
            claimed: Some(row.claimed_at()),
            ..none
        },
        OutboxStatus::Completed | OutboxStatus::Failed => StatusKeys {
            finished: Some(row.completed_at.unwrap_or(row.created_at)),
            ..none
        },
    })
}

/// The outbox's records: the rows written by enqueues and the state rows
/// written by the changes since (`None` in a file whose state table was
/// never written).
pub(super) type RecordTables<'t, R, S> = (&'t R, Option<&'t S>);

/// The record `id` of the outbox's `rows` and `states`, decoded; `None`
/// if there is none.
pub(super) fn load_row<R, S>(tables: RecordTables<'_, R, S>, id: u64) -> Result<Option<Row>>
where
    R: ReadableTable<u64, &'static [u8]>,
    S: ReadableTable<u64, &'static [u8]>,
{
    let (rows, states) = tables;
    match rows.get(id)? {
        Some(v) => decode_row(states, id, v.value()).map(Some),
        None => Ok(None),
    }
}

/// Record `id` decoded from its row `bytes` and its row in `states`, if
/// it has one.
pub(super) fn decode_row<S>(states: Option<&S>, id: u64, bytes: &[u8]) -> Result<Row>
where
    S: ReadableTable<u64, &'static [u8]>,
{
    let state = match states {
        Some(states) => states.get(id)?,
        None => None,
    };
    Row::decode(id, bytes, state.as_ref().map(redb::AccessGuard::value))
}

/// An index row whose record is missing.
pub(super) fn dangling(index: &'static str, id: u64) -> Error {
    Error::Corrupted {
        table: index,
        key: id.to_string(),
        reason: "index row without its outbox record".into(),
    }
}

/// A `(time, id)` index, open for writing.
pub(super) type TimeIndex<'tx> = Table<'tx, (i64, u64), ()>;

/// The keys of entry `id`'s rows in the attempt history, oldest first.
fn attempt_keys(
    attempts: &impl ReadableTable<(u64, u64), &'static [u8]>,
    id: u64,
) -> Result<Vec<(u64, u64)>> {
    let keys = attempts
        .range((id, 0)..=(id, u64::MAX))?
        .map(|row| row.map(|(k, _)| k.value()))
        .collect::<std::result::Result<_, _>>()?;
    Ok(keys)
}

/// The attempt history of entry `id`, oldest first (empty if the table
/// was never written); a row that does not decode is [`Error::Corrupted`].
pub(super) fn load_attempts(
    attempts: Option<&impl ReadableTable<(u64, u64), &'static [u8]>>,
    id: u64,
) -> Result<Vec<AttemptRecord>> {
    let Some(attempts) = attempts else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for row in attempts.range((id, 0)..=(id, u64::MAX))? {
        let (k, v) = row?;
        let (_, seq) = k.value();
        out.push(AttemptRow::decode(id, seq, v.value())?.to_record(id, seq)?);
    }
    Ok(out)
}

/// Every outbox table, open in one write transaction.
pub(super) struct Tables<'tx> {
    pub(super) rows: Table<'tx, u64, &'static [u8]>,
    /// The records' state since their enqueue, which every change writes.
    states: Table<'tx, u64, &'static [u8]>,
    pub(super) claimed: TimeIndex<'tx>,
    /// The uniqueness and by-command indexes, opened on first use: only
    /// enqueues and purges touch them, not claims and settlements.
    dedup: Option<Table<'tx, (&'static str, &'static str), u64>>,
    by_command: Option<Table<'tx, (&'static str, i64, u64), ()>>,
    pub(super) finished: TimeIndex<'tx>,
    /// The attempt history, opened on first use: most operations (claims,
    /// completions) never touch it.
    attempts: Option<Table<'tx, (u64, u64), &'static [u8]>>,
    /// The destinations' tables (`flow.rs`), which every change of a
    /// record keeps up to date.
    pub(super) flows: Flows<'tx>,
    tx: &'tx WriteTransaction,
}

impl<'tx> Tables<'tx> {
    pub(super) fn open(tx: &'tx WriteTransaction) -> Result<Tables<'tx>> {
        Ok(Tables {
            rows: open_write(tx, OUTBOX)?,
            states: open_write(tx, OUTBOX_STATE)?,
            claimed: open_write(tx, OUTBOX_CLAIMED)?,
            dedup: None,
            by_command: None,
            finished: open_write(tx, OUTBOX_FINISHED)?,
            attempts: None,
            flows: Flows::open(tx)?,
            tx,
        })
    }

    /// The attempt history table, opened (or created) on first use. Opening
    /// is the one step of a history write that can fail for a reason other
    /// than storage (a table of ours with other types): the single-entry
    /// operations open it before they write anything.
    pub(super) fn attempts(&mut self) -> Result<&mut Table<'tx, (u64, u64), &'static [u8]>> {
        match &mut self.attempts {
            Some(t) => Ok(t),
            slot @ None => Ok(slot.insert(open_write(self.tx, OUTBOX_ATTEMPTS)?)),
        }
    }

    /// The `(destination, idempotency key) → id` index, opened on first use.
    pub(super) fn dedup(&mut self) -> Result<&mut Table<'tx, (&'static str, &'static str), u64>> {
        match &mut self.dedup {
            Some(t) => Ok(t),
            slot @ None => Ok(slot.insert(open_write(self.tx, OUTBOX_DEDUP)?)),
        }
    }

    /// The `(command id, created_at, id)` index, opened on first use.
    fn by_command(&mut self) -> Result<&mut Table<'tx, (&'static str, i64, u64), ()>> {
        match &mut self.by_command {
            Some(t) => Ok(t),
            slot @ None => Ok(slot.insert(open_write(self.tx, OUTBOX_BY_COMMAND)?)),
        }
    }

    /// Appends `row` to entry `id`'s attempt history, dropping the oldest
    /// rows beyond [`MAX_ATTEMPT_HISTORY`].
    pub(super) fn push_attempt(&mut self, id: u64, row: &AttemptRow) -> Result<()> {
        let attempts = self.attempts()?;
        let keys = attempt_keys(attempts, id)?;
        let seq = keys.last().map_or(0, |(_, seq)| seq.saturating_add(1));
        let excess = (keys.len() + 1).saturating_sub(MAX_ATTEMPT_HISTORY);
        for key in keys.into_iter().take(excess) {
            attempts.remove(key)?;
        }
        attempts.insert((id, seq), row.encode().as_slice())?;
        Ok(())
    }

    /// The record `id`, decoded; `None` if there is none.
    pub(super) fn load(&self, id: u64) -> Result<Option<Row>> {
        load_row((&self.rows, Some(&self.states)), id)
    }

    /// The record a row of `index` points at, which the index holds in a
    /// status that `indexed` accepts only. A dangling index row, or a record
    /// in another status, is [`Error::Corrupted`].
    pub(super) fn load_indexed(
        &self,
        index: &'static str,
        id: u64,
        indexed: impl Fn(OutboxStatus) -> bool,
    ) -> Result<Row> {
        let row = self.load(id)?.ok_or_else(|| dangling(index, id))?;
        if indexed(row.status) {
            Ok(row)
        } else {
            Err(index_mismatch(index, id))
        }
    }

    /// The keys of the record a row of `index` points at (without copying
    /// its payload), checked as [`Tables::load_indexed`] checks the record.
    pub(super) fn load_keys_indexed(
        &self,
        index: &'static str,
        id: u64,
        indexed: impl Fn(OutboxStatus) -> bool,
    ) -> Result<RowKeys> {
        let Some(row) = self.rows.get(id)? else {
            return Err(dangling(index, id));
        };
        let state = self.states.get(id)?;
        let keys = RowKeys::decode(
            id,
            row.value(),
            state.as_ref().map(redb::AccessGuard::value),
        )?;
        if indexed(keys.times.status(id)?) {
            Ok(keys)
        } else {
            Err(index_mismatch(index, id))
        }
    }

    /// Writes a new record with all its index rows.
    pub(super) fn insert_new(&mut self, id: u64, s: &Row) -> Result<()> {
        let keys = status_keys(id, s.times())?;
        self.rows.insert(id, s.encode().as_slice())?;
        self.dedup()?
            .insert((s.destination.as_str(), s.idempotency_key.as_str()), id)?;
        self.by_command()?
            .insert((s.command_id.as_str(), s.created_at, id), ())?;
        self.put_status_keys(id, keys)?;
        self.flows.inserted(id, s)?;
        Ok(())
    }

    /// Replaces record `id` (`old` as stored) by `new`, moving its status
    /// index rows and counts. Only the state changes (see `record.rs`):
    /// what is written is `new`'s state row; the fields written by the
    /// enqueue (destination, key, command, payload, `created_at`, ordering
    /// key, priority) and their index rows stay as they are.
    ///
    /// A record with an ordering key gets its place in its sequence here
    /// (see [`sequenced`](super::destinations::sequenced)): what is written is `new` with it.
    pub(super) fn replace(&mut self, id: u64, old: &Row, new: &Row) -> Result<()> {
        let tx = self.tx;
        let sequenced;
        let new = if new.ordering_key.is_some() {
            sequenced = super::destinations::sequenced(old, new.clone(), || {
                let mut meta = open_write(tx, META)?;
                let seq = next_id(&meta)?;
                meta.insert(META_OUTBOX_NEXT_ID, seq.saturating_add(1))?;
                Ok(seq)
            })?;
            &sequenced
        } else {
            new
        };
        let (old_keys, new_keys) = (status_keys(id, old.times())?, status_keys(id, new.times())?);
        debug_assert!(
            new.command_id == old.command_id
                && new.destination == old.destination
                && new.idempotency_key == old.idempotency_key
                && new.payload == old.payload
                && new.created_at == old.created_at
                && new.ordering_key == old.ordering_key
                && new.priority == old.priority,
            "a change of record {id} rewrote a field its enqueue wrote"
        );
        self.states.insert(id, new.encode_state().as_slice())?;
        if old_keys != new_keys {
            self.remove_status_keys(id, old_keys)?;
            self.put_status_keys(id, new_keys)?;
        }
        let records = (&self.rows, Some(&self.states));
        self.flows.replaced(id, old, new, records)?;
        Ok(())
    }

    /// Deletes record `id` (`old`: the keys of its rows as stored), every
    /// index row of it and its attempt history.
    pub(super) fn delete(&mut self, id: u64, old: &RowKeys) -> Result<()> {
        let keys = status_keys(id, old.times)?;
        self.rows.remove(id)?;
        self.states.remove(id)?;
        self.dedup()?
            .remove((old.destination.as_str(), old.idempotency_key.as_str()))?;
        self.by_command()?
            .remove((old.command_id.as_str(), old.times.created_at, id))?;
        self.remove_status_keys(id, keys)?;
        self.flows
            .deleted(id, &old.destination, old.times.status(id)?)?;
        let attempts = self.attempts()?;
        for key in attempt_keys(attempts, id)? {
            attempts.remove(key)?;
        }
        Ok(())
    }

    /// Each status index with the time of the record's row in it, if any.
    fn status_indexes(&mut self, keys: StatusKeys) -> [(Option<i64>, &mut TimeIndex<'tx>); 2] {
        [
            (keys.claimed, &mut self.claimed),
            (keys.finished, &mut self.finished),
        ]
    }

    fn put_status_keys(&mut self, id: u64, keys: StatusKeys) -> Result<()> {
        for (at, index) in self.status_indexes(keys) {
            if let Some(at) = at {
                index.insert((at, id), ())?;
            }
        }
        Ok(())
    }

    fn remove_status_keys(&mut self, id: u64, keys: StatusKeys) -> Result<()> {
        for (at, index) in self.status_indexes(keys) {
            if let Some(at) = at {
                index.remove((at, id))?;
            }
        }
        Ok(())
    }

    /// Writes the flow records and counts changed since `open`: once per
    /// operation, not once per entry. Every operation that writes ends with
    /// it. Returns whether a destination became claimable sooner (worth a
    /// wake-up).
    pub(super) fn finish(self) -> Result<bool> {
        self.flows.finish()
    }
}

/// The next outbox id to hand out (ids start at 1 and only grow).
pub(super) fn next_id(meta: &impl ReadableTable<&'static str, u64>) -> Result<u64> {
    Ok(meta.get(META_OUTBOX_NEXT_ID)?.map_or(1, |v| v.value()))
}

/// An index row whose record is not in the status the index is for.
pub(super) fn index_mismatch(index: &'static str, id: u64) -> Error {
    Error::Corrupted {
        table: index,
        key: id.to_string(),
        reason: "indexed record is not in the indexed status".into(),
    }
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

/// Compares an expected set of index rows with the stored one, one
/// finding per row missing or extra.
pub(super) fn compare<T: Ord + std::fmt::Debug>(
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
    claimed: BTreeSet<(i64, u64)>,
    finished: BTreeSet<(i64, u64)>,
    by_command: BTreeSet<(String, i64, u64)>,
    dedup: BTreeSet<(String, String, u64)>,
    counts: [u64; 5],
    max_id: u64,
    /// Every record's id.
    ids: BTreeSet<u64>,
}

/// Reads every record; notes findings about single records.
fn expected_rows(tx: &ReadTransaction, findings: &mut Vec<String>) -> Result<Expected> {
    let mut ex = Expected::default();
    let state_rows = open_read(tx, OUTBOX_STATE)?;
    let Some(rows) = open_read(tx, OUTBOX)? else {
        if let Some(states) = &state_rows {
            orphan_states(states, &ex.ids, findings)?;
        }
        return Ok(ex);
    };
    for row in rows.iter()? {
        let (key, value) = row?;
        let id = key.value();
        ex.max_id = ex.max_id.max(id);
        ex.ids.insert(id);
        let rec = match decode_row(state_rows.as_ref(), id, value.value()) {
            Ok(rec) => rec,
            Err(e) => {
                findings.push(format!("record {id}: {e}"));
                continue;
            }
        };
        let status = rec.status;
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
        let keys = status_keys(id, rec.times())?;
        ex.claimed.extend(keys.claimed.map(|at| (at, id)));
        ex.finished.extend(keys.finished.map(|at| (at, id)));
        ex.by_command
            .insert((rec.command_id.clone(), rec.created_at, id));
        ex.dedup
            .insert((rec.destination.clone(), rec.idempotency_key.clone(), id));
        if let Some(n) = ex.counts.get_mut(usize::from(rec.status.code())) {
            *n += 1;
        }
    }
    if let Some(states) = &state_rows {
        orphan_states(states, &ex.ids, findings)?;
    }
    Ok(ex)
}

/// Notes every state row without its record.
fn orphan_states(
    states: &impl ReadableTable<u64, &'static [u8]>,
    ids: &BTreeSet<u64>,
    findings: &mut Vec<String>,
) -> Result<()> {
    for row in states.iter()? {
        let id = row?.0.value();
        if !ids.contains(&id) {
            findings.push(format!(
                "{}: state row {id} has no outbox record",
                OUTBOX_STATE.name()
            ));
        }
    }
    Ok(())
}

/// Checks every invariant of the module docs over the whole outbox; returns
/// one human-readable finding per violation (none when consistent). Reads
/// every row: for tests and offline checks, not for a hot path.
pub(super) fn check(tx: &ReadTransaction) -> Result<Vec<String>> {
    let mut findings = Vec::new();
    let expected = expected_rows(tx, &mut findings)?;
    let Expected {
        claimed,
        finished,
        by_command,
        dedup,
        counts,
        max_id,
        ids,
    } = expected;
    for (index, expected) in [(OUTBOX_CLAIMED, claimed), (OUTBOX_FINISHED, finished)] {
        compare(&mut findings, index.name(), &expected, &pairs(tx, index)?);
    }
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
    let stored_counts = flow::read_totals(tx)?;
    if stored_counts != counts {
        findings.push(format!(
            "{}: counts {stored_counts:?} but records say {counts:?}",
            OUTBOX_FLOWS.name()
        ));
    }
    let next = match open_read(tx, META)? {
        Some(meta) => next_id(&meta)?,
        None => 1,
    };
    if next <= max_id {
        findings.push(format!(
            "next outbox id {next} is not above the largest id {max_id}"
        ));
    }
    check_attempts(tx, &ids, &mut findings)?;
    flow::check(tx, &mut findings)?;
    Ok(findings)
}

/// The attempt history: every row belongs to a record and decodes, and no
/// entry keeps more than [`MAX_ATTEMPT_HISTORY`] rows.
fn check_attempts(
    tx: &ReadTransaction,
    ids: &BTreeSet<u64>,
    findings: &mut Vec<String>,
) -> Result<()> {
    let Some(attempts) = open_read(tx, OUTBOX_ATTEMPTS)? else {
        return Ok(());
    };
    let mut per_entry: BTreeMap<u64, usize> = BTreeMap::new();
    for row in attempts.iter()? {
        let (k, v) = row?;
        let (id, seq) = k.value();
        *per_entry.entry(id).or_default() += 1;
        if !ids.contains(&id) {
            findings.push(format!(
                "{}: attempt record {id}/{seq} has no outbox record",
                OUTBOX_ATTEMPTS.name()
            ));
        } else if let Err(e) = AttemptRow::decode(id, seq, v.value()) {
            findings.push(format!("attempt record {id}/{seq}: {e}"));
        }
    }
    for (id, n) in per_entry {
        if n > MAX_ATTEMPT_HISTORY {
            findings.push(format!(
                "{}: record {id} keeps {n} attempt records, more than {MAX_ATTEMPT_HISTORY}",
                OUTBOX_ATTEMPTS.name()
            ));
        }
    }
    Ok(())
}
