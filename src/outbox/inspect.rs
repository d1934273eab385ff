//! The embedded outbox's reads: single records, listings, counters, the
//! next due time and the consistency check. Each is one read transaction
//! that waits, as every read of the store does, until what it saw is
//! durable.

use chrono::{DateTime, Utc};
use redb::{ReadOnlyTable, ReadTransaction, ReadableTable, TableDefinition, TableHandle as _};

use super::flow::FlowKey;
use super::index::{self, dangling, decode_row, load_attempts, load_row, open_read};
use super::rules::Row;
use super::{
    Outbox, OutboxCounts, OutboxFilter, OutboxId, OutboxRecord, OutboxStatus, check_field, flow,
};
use crate::codec::from_micros;
use crate::error::{Error, Result};
use crate::schema::{
    OUTBOX, OUTBOX_ATTEMPTS, OUTBOX_BY_COMMAND, OUTBOX_CLAIMED, OUTBOX_DEDUP, OUTBOX_FLOWS,
    OUTBOX_STATE,
};

/// The outbox's records and attempt history, open in one read transaction.
struct Reader {
    rows: ReadOnlyTable<u64, &'static [u8]>,
    /// `None` in a file whose state table was never written.
    states: Option<ReadOnlyTable<u64, &'static [u8]>>,
    /// `None` in a file whose history table was never written.
    attempts: Option<ReadOnlyTable<(u64, u64), &'static [u8]>>,
}

impl Reader {
    /// Opens the tables; `None` if the outbox was never written.
    fn open(tx: &ReadTransaction) -> Result<Option<Reader>> {
        let Some(rows) = open_read(tx, OUTBOX)? else {
            return Ok(None);
        };
        let states = open_read(tx, OUTBOX_STATE)?;
        let attempts = open_read(tx, OUTBOX_ATTEMPTS)?;
        Ok(Some(Reader {
            rows,
            states,
            attempts,
        }))
    }

    /// The record `id`, with its attempt history, if there is one.
    fn record(&self, id: u64) -> Result<Option<OutboxRecord>> {
        load_row((&self.rows, self.states.as_ref()), id)?
            .map(|row| self.complete(id, &row))
            .transpose()
    }

    /// The public view of `row` (record `id`), with its attempt history.
    fn complete(&self, id: u64, row: &Row) -> Result<OutboxRecord> {
        let mut record = row.to_record(id)?;
        record.attempts = load_attempts(self.attempts.as_ref(), id)?;
        Ok(record)
    }
}

impl Outbox {
    /// The entry `id` with its claim, settlement details and attempt
    /// history; [`Error::NotFound`] if there is none.
    pub fn get(&self, id: OutboxId) -> Result<OutboxRecord> {
        self.engine.read(|tx| get_in(tx, id))
    }

    /// [`Outbox::get`] for an async task (feature `tokio`): the read runs
    /// on the task, and the task waits for durability without holding a
    /// thread.
    #[cfg(feature = "tokio")]
    pub async fn get_async(&self, id: OutboxId) -> Result<OutboxRecord> {
        self.engine.read_async(|tx| get_in(tx, id)).await
    }

    /// The entry enqueued as `(destination, idempotency_key)`, if any.
    pub fn find(&self, destination: &str, idempotency_key: &str) -> Result<Option<OutboxRecord>> {
        check_field("destination", destination)?;
        check_field("idempotency_key", idempotency_key)?;
        self.engine
            .read(|tx| find_in(tx, destination, idempotency_key))
    }

    /// Every entry of `command_id`, by `created_at`, then id.
    pub fn list_for_command(&self, command_id: &str) -> Result<Vec<OutboxRecord>> {
        check_field("command_id", command_id)?;
        self.engine.read(|tx| list_for_command_in(tx, command_id))
    }

    /// How many entries are in each status (from counters, no scan).
    pub fn counts(&self) -> Result<OutboxCounts> {
        self.engine.read(counts_in)
    }

    /// When the next entry may be claimed (possibly in the past: work is
    /// waiting), or `None` if nothing is claimable until something changes:
    /// the earliest time a destination with a claimable entry may give it —
    /// its entry's due time, its next token, the end of its cool-down or
    /// hold. A paused destination, one at its `max_in_flight` and an entry
    /// waiting behind an earlier one of its ordering sequence count for
    /// nothing here. A dispatcher sleeps until then, or until a
    /// [`subscribe`](Outbox::subscribe) signal.
    pub fn next_due(&self) -> Result<Option<DateTime<Utc>>> {
        self.engine.read(next_due_in)
    }

    /// Up to `limit` entries matching `filter`, by id (enqueue order).
    /// Page with [`OutboxFilter::after`] and the last id returned.
    ///
    /// A filter with a status reads that status's entries only, through an
    /// index (the entries of each status by id; for `Dispatching`, the
    /// claims), and tells destinations apart by its keys alone: a page of
    /// the few failed entries of a large outbox reads those. Without a
    /// status the listing walks every entry from the filter's start and
    /// skips the other destinations' (for inspection tools, not for a
    /// dispatcher: use [`claim_due`](Outbox::claim_due)).
    pub fn list(&self, filter: &OutboxFilter, limit: usize) -> Result<Vec<OutboxRecord>> {
        filter.check()?;
        self.engine.read(|tx| list_in(tx, filter, limit))
    }

    /// The next id an enqueue will hand out (ids are never reused, even
    /// once their entries are purged). For the migration to PostgreSQL,
    /// which moves the server's sequence past it.
    #[cfg(feature = "postgres")]
    pub(crate) fn next_id(&self) -> Result<u64> {
        self.engine
            .read(|tx| match open_read(tx, crate::schema::META)? {
                Some(meta) => index::next_id(&meta),
                None => Ok(1),
            })
    }

    /// The claim time of the longest-held `Dispatching` entry, or `None` if
    /// nothing is being dispatched: how far back a reaper's
    /// [`release_expired_claims`](Outbox::release_expired_claims) cutoff
    /// would reach.
    pub fn oldest_claim(&self) -> Result<Option<DateTime<Utc>>> {
        self.engine.read(oldest_claim_in)
    }

    /// Checks every invariant between outbox rows, their index rows and the
    /// counters (see the module docs); returns one human-readable finding
    /// per violation, none if the outbox is consistent. Reads the whole
    /// outbox in one read transaction: for tests and offline checks.
    pub fn check_indexes(&self) -> Result<Vec<String>> {
        self.engine.read(index::check)
    }
}

/// The entry `id`, as `tx` sees it ([`Outbox::get`]).
fn get_in(tx: &ReadTransaction, id: OutboxId) -> Result<OutboxRecord> {
    let Some(reader) = Reader::open(tx)? else {
        return Err(Error::NotFound);
    };
    reader.record(id.0)?.ok_or(Error::NotFound)
}

/// The entry of `(destination, idempotency_key)` (checked), as `tx` sees it
/// ([`Outbox::find`]).
pub(super) fn find_in(
    tx: &ReadTransaction,
    destination: &str,
    idempotency_key: &str,
) -> Result<Option<OutboxRecord>> {
    let Some(dedup) = open_read(tx, OUTBOX_DEDUP)? else {
        return Ok(None);
    };
    let Some(id) = dedup
        .get((destination, idempotency_key))?
        .map(|v| v.value())
    else {
        return Ok(None);
    };
    let record = match Reader::open(tx)? {
        Some(reader) => reader.record(id)?,
        None => None,
    };
    record
        .ok_or_else(|| dangling(OUTBOX_DEDUP.name(), id))
        .map(Some)
}

/// The entries of `command_id` (checked), as `tx` sees them
/// ([`Outbox::list_for_command`]).
pub(super) fn list_for_command_in(
    tx: &ReadTransaction,
    command_id: &str,
) -> Result<Vec<OutboxRecord>> {
    let (Some(index), Some(reader)) = (open_read(tx, OUTBOX_BY_COMMAND)?, Reader::open(tx)?) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for key in index.range((command_id, i64::MIN, 0)..=(command_id, i64::MAX, u64::MAX))? {
        let id = key?.0.value().2;
        out.push(
            reader
                .record(id)?
                .ok_or_else(|| dangling(OUTBOX_BY_COMMAND.name(), id))?,
        );
    }
    Ok(out)
}

/// The entries in each status, as `tx` sees them ([`Outbox::counts`]).
pub(super) fn counts_in(tx: &ReadTransaction) -> Result<OutboxCounts> {
    let totals = flow::read_totals(tx)?;
    Ok(OutboxCounts::from_fn(|s| {
        totals.get(usize::from(s.code())).copied().unwrap_or(0)
    }))
}

/// Up to `limit` entries matching `filter` (checked), as `tx` sees them
/// ([`Outbox::list`]).
pub(super) fn list_in(
    tx: &ReadTransaction,
    filter: &OutboxFilter,
    limit: usize,
) -> Result<Vec<OutboxRecord>> {
    let Some(reader) = Reader::open(tx)? else {
        return Ok(Vec::new());
    };
    let small = open_read(tx, OUTBOX_FLOWS)?;
    let claimed = open_read(tx, OUTBOX_CLAIMED)?;
    let tables = Listing {
        rows: &reader.rows,
        states: reader.states.as_ref(),
        small: small.as_ref(),
        claimed: claimed.as_ref(),
    };
    tables
        .matching(filter, limit)?
        .into_iter()
        .map(|(id, row)| reader.complete(id, &row))
        .collect()
}

/// The claim time of the longest-held claim, as `tx` sees it
/// ([`Outbox::oldest_claim`]).
pub(super) fn oldest_claim_in(tx: &ReadTransaction) -> Result<Option<DateTime<Utc>>> {
    first_time(tx, &OUTBOX_CLAIMED)
}

/// The time of the first row of a `(time, id)` index.
fn first_time(
    tx: &ReadTransaction,
    index: &'static TableDefinition<'static, (i64, u64), ()>,
) -> Result<Option<DateTime<Utc>>> {
    let Some(rows) = open_read(tx, *index)? else {
        return Ok(None);
    };
    match rows.first()? {
        Some((k, _)) => {
            let (at, id) = k.value();
            from_micros(index.name(), &id, at).map(Some)
        }
        None => Ok(None),
    }
}

/// The tables a listing reads (in a read or a write transaction); `None`
/// for a table never written.
pub(super) struct Listing<'t, R, S, F, C> {
    pub(super) rows: &'t R,
    pub(super) states: Option<&'t S>,
    /// The flows' small rows, with the records by status.
    pub(super) small: Option<&'t F>,
    /// The claims index.
    pub(super) claimed: Option<&'t C>,
}

impl<R, S, F, C> Listing<'_, R, S, F, C>
where
    R: ReadableTable<u64, &'static [u8]>,
    S: ReadableTable<u64, &'static [u8]>,
    F: ReadableTable<FlowKey<'static>, &'static [u8]>,
    C: ReadableTable<(i64, u64), ()>,
{
    /// The first `limit` records `filter` matches, in its order, with
    /// their ids (see [`Outbox::list`]).
    pub(super) fn matching(&self, filter: &OutboxFilter, limit: usize) -> Result<Vec<(u64, Row)>> {
        let Some((lo, hi)) = filter.id_bounds() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        let Some(status) = filter.status_filter() else {
            let walk = self.rows.range(lo..=hi)?;
            let walk: Box<dyn Iterator<Item = _>> = if filter.is_newest_first() {
                Box::new(walk.rev())
            } else {
                Box::new(walk)
            };
            for row in walk {
                if out.len() >= limit {
                    break;
                }
                let (k, v) = row?;
                let id = k.value();
                let row = decode_row(self.states, id, v.value())?;
                if filter.matches(&row) {
                    out.push((id, row));
                }
            }
            return Ok(out);
        };
        for (index, id) in self.indexed_ids(filter, status, (lo, hi), limit)? {
            if out.len() >= limit {
                break;
            }
            let row = load_row((self.rows, self.states), id)?.ok_or_else(|| dangling(index, id))?;
            if row.status != status {
                return Err(index::index_mismatch(index, id));
            }
            if filter.matches(&row) {
                out.push((id, row));
            }
        }
        Ok(out)
    }

    /// The first `limit` ids within `lo..=hi`, in `filter`'s order, of the
    /// entries of `status` that it matches (by destination), each with the
    /// index it came from: the records by status, or for `Dispatching`
    /// the claims index (as many rows as entries in flight, in claim
    /// order: all are read, and sorted by id).
    fn indexed_ids(
        &self,
        filter: &OutboxFilter,
        status: OutboxStatus,
        (lo, hi): (u64, u64),
        limit: usize,
    ) -> Result<Vec<(&'static str, u64)>> {
        let newest_first = filter.is_newest_first();
        if status == OutboxStatus::Dispatching {
            let Some(claimed) = self.claimed else {
                return Ok(Vec::new());
            };
            let mut ids = std::collections::BTreeSet::new();
            for row in claimed.iter()? {
                let (_, id) = row?.0.value();
                if (lo..=hi).contains(&id) {
                    ids.insert(id);
                    // With a destination, the records tell them apart: more
                    // than `limit` may be needed.
                    if ids.len() > limit && filter.destination_filter().is_none() {
                        if newest_first {
                            ids.pop_first();
                        } else {
                            ids.pop_last();
                        }
                    }
                }
            }
            let ids: Vec<u64> = if newest_first {
                ids.into_iter().rev().collect()
            } else {
                ids.into_iter().collect()
            };
            return Ok(ids
                .into_iter()
                .map(|id| (OUTBOX_CLAIMED.name(), id))
                .collect());
        }
        let Some(small) = self.small else {
            return Ok(Vec::new());
        };
        let walk = small.range(flow::listed_between(status, lo, hi))?;
        let walk: Box<dyn Iterator<Item = _>> = if newest_first {
            Box::new(walk.rev())
        } else {
            Box::new(walk)
        };
        let mut out = Vec::new();
        for row in walk {
            if out.len() >= limit {
                break;
            }
            let (k, _) = row?;
            let (_, id, destination) = k.value();
            if filter.destination_filter().is_none_or(|d| d == destination) {
                out.push((OUTBOX_FLOWS.name(), id.cast_unsigned()));
            }
        }
        Ok(out)
    }
}

/// When the next entry may be claimed, as `tx` sees the ready line.
pub(super) fn next_due_in(tx: &ReadTransaction) -> Result<Option<DateTime<Utc>>> {
    match flow::first_ready(tx)? {
        Some(at) => from_micros(OUTBOX_FLOWS.name(), &"the ready line", at).map(Some),
        None => Ok(None),
    }
}
