//! The outbox's operations on one write transaction. Each is a pure
//! function of the transaction's state and its arguments (the engine may run
//! one again after rolling it back, and it must write the same).
//!
//! An operation that returns `Err` is rolled back as a whole by the engine
//! (`Engine::execute`), so the bulk ones ([`change_many`],
//! [`release_expired`], and a settle followed by a claim) may fail after
//! they have written. The calls that run
//! an operation inside the caller's own transaction (the `*_in` calls) use
//! the single-entry ones only, [`enqueue`] of one entry and [`change`],
//! which check everything before they write: their `Err` wrote nothing
//! even if the caller goes on to commit.

use std::ops::RangeBounds;

use redb::{ReadableTable, TableHandle as _, WriteTransaction};

use super::index::{Tables, TimeIndex, index_mismatch, next_id};
use super::rules::{Change, Row, plan};
use super::{Enqueued, NewEntry, OutboxEntry, OutboxId, OutboxStatus};
use crate::error::{Error, Result};
use crate::schema::{
    META, META_OUTBOX_NEXT_ID, OUTBOX_CLAIMED, OUTBOX_DUE, OUTBOX_FINISHED, open_write,
};

/// Enqueues `entries` (already validated) in order; a repeated
/// `(destination, key)` — stored before or earlier in `entries` — is a
/// `Duplicate` of the first.
pub(super) fn enqueue(
    tx: &WriteTransaction,
    entries: &[NewEntry],
    now: i64,
) -> Result<Vec<Enqueued>> {
    let mut t = Tables::open(tx)?;
    let mut meta = open_write(tx, META)?;
    let first_id = next_id(&meta)?;
    let mut id = first_id;
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        let existing = t
            .dedup
            .get((e.destination.as_str(), e.idempotency_key.as_str()))?
            .map(|v| v.value());
        if let Some(id) = existing {
            out.push(Enqueued::Duplicate(OutboxId(id)));
            continue;
        }
        t.insert_new(id, &Row::new_entry(e, now))?;
        out.push(Enqueued::New(OutboxId(id)));
        id += 1;
    }
    if id != first_id {
        meta.insert(META_OUTBOX_NEXT_ID, id)?;
    }
    t.finish()?;
    Ok(out)
}

/// Claims up to `limit` entries due at `now`, earliest due then id.
/// O(limit · log n): it reads the front of the due index only.
pub(super) fn claim_due(
    tx: &WriteTransaction,
    now: i64,
    limit: usize,
    worker_id: &str,
) -> Result<Vec<OutboxEntry>> {
    let mut t = Tables::open(tx)?;
    let ids = index_ids(&t.due, ..=(now, u64::MAX), limit)?;
    let change = Change::Claimed {
        worker_id: worker_id.to_owned(),
        now,
    };
    let plans = plan_indexed(&t, OUTBOX_DUE.name(), OutboxStatus::Pending, ids, &change)?;
    let entries = plans
        .iter()
        .map(|(id, _, new)| new.to_record(*id).map(|r| r.entry))
        .collect::<Result<Vec<_>>>()?;
    replace_all(&mut t, &plans)?;
    t.finish()?;
    Ok(entries)
}

/// Applies `change` to record `id`, fenced by `attempt` if given, with the
/// attempt record it adds to the history. Returns the status after
/// (unchanged for an accepted no-op).
pub(super) fn change(
    tx: &WriteTransaction,
    id: u64,
    change: &Change,
    fence: Option<u32>,
) -> Result<OutboxStatus> {
    let mut t = Tables::open(tx)?;
    let old = t.load(id)?.ok_or(Error::NotFound)?;
    match plan(id, &old, change, fence)? {
        Some(new) => {
            let attempt = change.attempt_row(&old, old.status);
            if attempt.is_some() {
                // Opened before anything is written (see `Tables::attempts`).
                t.attempts()?;
            }
            t.replace(id, &old, &new)?;
            if let Some(a) = attempt {
                t.push_attempt(id, &a)?;
            }
            t.finish()?;
            Ok(new.status)
        }
        None => Ok(old.status),
    }
}

/// Applies many fenced changes in order. Each is accepted or refused on its
/// own: a refusal ([`Error::Conflict`]) or a missing entry
/// ([`Error::NotFound`]) is that change's answer. Anything else (a record
/// that does not decode, a storage error) fails the whole operation, which
/// the engine then rolls back, the changes already written included.
pub(super) fn change_many(
    tx: &WriteTransaction,
    changes: &[(u64, u32, Change)],
) -> Result<Vec<Result<()>>> {
    let mut t = Tables::open(tx)?;
    let mut out = Vec::with_capacity(changes.len());
    for (id, attempt, c) in changes {
        let Some(old) = t.load(*id)? else {
            out.push(Err(Error::NotFound));
            continue;
        };
        out.push(match plan(*id, &old, c, Some(*attempt)) {
            Ok(Some(new)) => {
                t.replace(*id, &old, &new)?;
                if let Some(a) = c.attempt_row(&old, old.status) {
                    t.push_attempt(*id, &a)?;
                }
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(e @ Error::Conflict { .. }) => Err(e),
            Err(e) => return Err(e),
        });
    }
    t.finish()?;
    Ok(out)
}

/// Moves up to `limit` of the `Dispatching` entries claimed strictly before
/// `cutoff` back to `Pending`, oldest claim first, each due at its claim
/// time, stopping early once it has rewritten `max_bytes` of payloads (a
/// released record is written again whole, and the transaction holds what
/// it writes until it commits). Returns their ids and whether more such
/// entries remain (the caller's next chunk). Costs what it releases.
/// Writes as it goes: an `Err` fails the operation, which the engine rolls
/// back.
pub(super) fn release_expired(
    tx: &WriteTransaction,
    cutoff: i64,
    limit: usize,
    max_bytes: usize,
) -> Result<(Vec<OutboxId>, bool)> {
    let mut t = Tables::open(tx)?;
    let (ids, more) = first_ids(&t.claimed, ..(cutoff, 0), limit)?;
    let index = OUTBOX_CLAIMED.name();
    let mut released = Vec::with_capacity(ids.len());
    let mut bytes = 0_usize;
    for &id in &ids {
        if bytes >= max_bytes {
            break;
        }
        let old = t.load_indexed(index, id, |s| s == OutboxStatus::Dispatching)?;
        let new =
            plan(id, &old, &Change::Released, None)?.ok_or_else(|| index_mismatch(index, id))?;
        bytes = bytes.saturating_add(old.payload.len());
        t.replace(id, &old, &new)?;
        released.push(OutboxId(id));
    }
    let more = more || released.len() < ids.len();
    t.finish()?;
    Ok((released, more))
}

/// Deletes up to `limit` of the `Completed` and `Failed` entries finished
/// strictly before `cutoff`, earliest finished first, with all their index
/// rows and attempt history. Returns how many, and whether more such
/// entries remain. Reads of each entry only the keys of its index rows, not
/// its payload. Costs what it removes.
pub(super) fn purge_finished(
    tx: &WriteTransaction,
    cutoff: i64,
    limit: usize,
) -> Result<(u64, bool)> {
    let mut t = Tables::open(tx)?;
    let (ids, more) = first_ids(&t.finished, ..(cutoff, 0), limit)?;
    let mut doomed = Vec::with_capacity(ids.len());
    for id in ids {
        let old = t.load_keys_indexed(OUTBOX_FINISHED.name(), id, OutboxStatus::is_finished)?;
        doomed.push((id, old));
    }
    for (id, old) in &doomed {
        t.delete(*id, old)?;
    }
    t.finish()?;
    Ok((doomed.len() as u64, more))
}

/// The ids of the first `limit` rows of a `(time, id)` index in `range`,
/// and whether the range holds more.
fn first_ids(
    index: &TimeIndex<'_>,
    range: impl RangeBounds<(i64, u64)> + 'static,
    limit: usize,
) -> Result<(Vec<u64>, bool)> {
    let mut ids = index_ids(index, range, limit.saturating_add(1))?;
    let more = ids.len() > limit;
    ids.truncate(limit);
    Ok((ids, more))
}

/// Writes planned replacements.
fn replace_all(t: &mut Tables<'_>, plans: &[(u64, Row, Row)]) -> Result<()> {
    for (id, old, new) in plans {
        t.replace(*id, old, new)?;
    }
    Ok(())
}

/// The ids of the first `limit` rows of a `(time, id)` index in `range`.
fn index_ids(
    index: &TimeIndex<'_>,
    range: impl RangeBounds<(i64, u64)> + 'static,
    limit: usize,
) -> Result<Vec<u64>> {
    let ids = index
        .range(range)?
        .take(limit)
        .map(|row| row.map(|(k, _)| k.value().1))
        .collect::<std::result::Result<_, _>>()?;
    Ok(ids)
}

/// Plans `change` for every record of `ids`, read through the index
/// `index`, which holds records in status `indexed` only; a record that
/// does not match its index, or that `change` does not move, is
/// [`Error::Corrupted`]. Checks everything before anything is written:
/// `(id, old, new)` for [`Tables::replace`].
fn plan_indexed(
    t: &Tables<'_>,
    index: &'static str,
    indexed: OutboxStatus,
    ids: Vec<u64>,
    change: &Change,
) -> Result<Vec<(u64, Row, Row)>> {
    let mut plans = Vec::with_capacity(ids.len());
    for id in ids {
        let old = t.load_indexed(index, id, |s| s == indexed)?;
        let new = plan(id, &old, change, None)?.ok_or_else(|| index_mismatch(index, id))?;
        plans.push((id, old, new));
    }
    Ok(plans)
}
