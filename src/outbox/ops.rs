//! The outbox's operations on one write transaction. Each is a pure
//! function of the transaction's state and its arguments (the engine may run
//! one again after rolling it back, and it must write the same).
//!
//! An operation that returns `Err` is rolled back as a whole by the engine
//! (`Engine::execute`), so the bulk ones ([`change_many`], and a settle
//! followed by a claim) may fail after they have written. The calls that run
//! an operation inside the caller's own transaction (the `*_in` calls) use
//! the single-entry ones only, [`enqueue`] of one entry and [`change`],
//! which check everything before they write: their `Err` wrote nothing
//! even if the caller goes on to commit.

use redb::{ReadableTable, TableHandle as _, WriteTransaction};

use super::index::{Tables, next_id};
use super::record::{Change, Stored, plan};
use super::{Enqueued, NewEntry, OutboxEntry, OutboxId, OutboxStatus};
use crate::codec::micros;
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
        let stored = Stored {
            command_id: e.command_id.clone(),
            destination: e.destination.clone(),
            idempotency_key: e.idempotency_key.clone(),
            payload: e.payload.clone(),
            status: OutboxStatus::Pending.code(),
            attempt_count: 0,
            next_attempt_at: e.not_before.map(micros),
            created_at: now,
            completed_at: None,
            attempt: None,
            last_failure: None,
            remote_ref: None,
        };
        t.insert_new(id, &stored)?;
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
    let keys = t
        .due
        .range(..=(now, u64::MAX))?
        .take(limit)
        .map(|row| row.map(|(k, _)| k.value().1))
        .collect::<std::result::Result<Vec<u64>, _>>()?;
    let change = Change::Claim {
        worker_id: worker_id.to_owned(),
        now,
    };
    let mut plans = Vec::with_capacity(keys.len());
    for id in keys {
        let old = t.load_indexed(OUTBOX_DUE.name(), id)?;
        if old.status(id)? != OutboxStatus::Pending {
            return Err(index_mismatch(OUTBOX_DUE.name(), id));
        }
        let new =
            plan(id, &old, &change, None)?.ok_or_else(|| index_mismatch(OUTBOX_DUE.name(), id))?;
        let entry = new.to_record(id)?.entry;
        plans.push((id, old, new, entry));
    }
    let mut out = Vec::with_capacity(plans.len());
    for (id, old, new, entry) in plans {
        t.replace(id, &old, &new)?;
        out.push(entry);
    }
    t.finish()?;
    Ok(out)
}

/// Applies `change` to record `id`, fenced by `attempt` if given. Returns
/// the status after (unchanged for an accepted no-op).
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
            t.replace(id, &old, &new)?;
            t.finish()?;
            new.status(id)
        }
        None => old.status(id),
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

/// Moves every `Dispatching` entry claimed strictly before `cutoff` back
/// to `Pending`, due at its claim time. Costs what it releases.
pub(super) fn release_expired(tx: &WriteTransaction, cutoff: i64) -> Result<Vec<OutboxId>> {
    let mut t = Tables::open(tx)?;
    let keys = t
        .claimed
        .range(..(cutoff, 0))?
        .map(|row| row.map(|(k, _)| k.value().1))
        .collect::<std::result::Result<Vec<u64>, _>>()?;
    let mut plans = Vec::with_capacity(keys.len());
    for id in keys {
        let old = t.load_indexed(OUTBOX_CLAIMED.name(), id)?;
        if old.status(id)? != OutboxStatus::Dispatching {
            return Err(index_mismatch(OUTBOX_CLAIMED.name(), id));
        }
        let new = plan(id, &old, &Change::Release, None)?
            .ok_or_else(|| index_mismatch(OUTBOX_CLAIMED.name(), id))?;
        plans.push((id, old, new));
    }
    for (id, old, new) in &plans {
        t.replace(*id, old, new)?;
    }
    t.finish()?;
    Ok(plans.into_iter().map(|(id, ..)| OutboxId(id)).collect())
}

/// Deletes `Completed` and `Failed` entries finished strictly before
/// `cutoff`, with all their index rows. Costs what it removes.
pub(super) fn purge_finished(tx: &WriteTransaction, cutoff: i64) -> Result<u64> {
    let mut t = Tables::open(tx)?;
    let keys = t
        .finished
        .range(..(cutoff, 0))?
        .map(|row| row.map(|(k, _)| k.value().1))
        .collect::<std::result::Result<Vec<u64>, _>>()?;
    let mut doomed = Vec::with_capacity(keys.len());
    for id in keys {
        let old = t.load_indexed(OUTBOX_FINISHED.name(), id)?;
        if !old.status(id)?.is_finished() {
            return Err(index_mismatch(OUTBOX_FINISHED.name(), id));
        }
        doomed.push((id, old));
    }
    for (id, old) in &doomed {
        t.delete(*id, old)?;
    }
    t.finish()?;
    Ok(doomed.len() as u64)
}

/// An index row whose record is not in the status the index is for.
fn index_mismatch(table: &'static str, id: u64) -> Error {
    Error::Corrupted {
        table,
        key: id.to_string(),
        reason: "indexed record is not in the indexed status".into(),
    }
}
