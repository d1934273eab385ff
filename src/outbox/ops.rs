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

use redb::{KeyRange, ReadableTable, TableHandle as _, WriteTransaction};

use super::claim_request::{ClaimRequest, ONE_DESTINATION_LOOKS};
use super::destinations::Allowance;
use super::index::{Tables, TimeIndex, index_mismatch, next_id};
use super::rules::{Change, Row, plan};
use super::{Enqueued, NewEntry, OutboxEntry, OutboxId, OutboxStatus};
use crate::error::{Error, Result};
use crate::schema::{
    META, META_OUTBOX_NEXT_ID, OUTBOX_CLAIMED, OUTBOX_FINISHED, OUTBOX_QUEUE, open_write,
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
            .dedup()?
            .get((e.destination.as_str(), e.idempotency_key.as_str()))?
            .map(|v| v.value());
        if let Some(id) = existing {
            out.push(Enqueued::Duplicate(OutboxId(id)));
            continue;
        }
        t.insert_new(id, &Row::new_entry(e, id, now))?;
        out.push(Enqueued::New(OutboxId(id)));
        id += 1;
    }
    if id != first_id {
        meta.insert(META_OUTBOX_NEXT_ID, id)?;
    }
    t.finish()?;
    Ok(out)
}

/// Claims what `request` asks for at `now`: up to its limit of claimable
/// entries, across the destinations ready at `now` in turn (the one served
/// longest ago first), one entry from each per round, each destination
/// within what its flow allows; from one destination only if the request
/// says so. Destinations the request avoids give entries only if no other
/// does. O(limit · log n) plus one step per destination visited, whatever
/// the backlog. Writes as it goes: an `Err` fails the operation, which the
/// engine rolls back.
pub(super) fn claim(
    tx: &WriteTransaction,
    now: i64,
    request: &ClaimRequest,
) -> Result<Vec<OutboxEntry>> {
    let mut t = Tables::open(tx)?;
    let out = claim_in(&mut t, now, request)?;
    t.finish()?;
    Ok(out)
}

/// Settles `changes` (as [`change_many`]) and then claims what `request`
/// asks for (as [`claim`]), in one set of open tables: a dispatcher's step
/// between two batches. Returns the settlements' answers, the claimed
/// entries and whether a destination became claimable sooner.
pub(super) fn settle_and_claim(
    tx: &WriteTransaction,
    changes: &[(u64, u32, Change)],
    now: i64,
    request: &ClaimRequest,
) -> Result<(Vec<Result<()>>, Vec<OutboxEntry>, bool)> {
    let mut t = Tables::open(tx)?;
    let settled = change_all(&mut t, changes)?;
    let claimed = if request.limit == 0 {
        Vec::new()
    } else {
        claim_in(&mut t, now, request)?
    };
    let sooner = t.finish()?;
    Ok((settled, claimed, sooner))
}

/// [`claim`] on tables already open.
fn claim_in(t: &mut Tables<'_>, now: i64, request: &ClaimRequest) -> Result<Vec<OutboxEntry>> {
    let mut out = claim_from(t, now, request, |d| !request.avoids(d))?;
    if out.is_empty() && !request.avoid.is_empty() {
        out = claim_from(t, now, request, |d| request.avoids(d))?;
    }
    Ok(out)
}

/// [`claim`] from the ready destinations that `take` accepts.
fn claim_from(
    t: &mut Tables<'_>,
    now: i64,
    request: &ClaimRequest,
    take: impl Fn(&str) -> bool,
) -> Result<Vec<OutboxEntry>> {
    let change = Change::Claimed {
        worker_id: request.worker_id.clone(),
        now,
    };
    let limit = request.limit;
    let mut out = Vec::new();
    if request.one_destination {
        for destination in t.flows.ready_at(now, ONE_DESTINATION_LOOKS, take)? {
            take_from(
                t,
                &destination,
                limit,
                request.limited,
                now,
                &change,
                &mut out,
            )?;
            if !out.is_empty() {
                break;
            }
        }
        return Ok(out);
    }
    let mut line = t.flows.ready_at(now, limit, take)?;
    while out.len() < limit && !line.is_empty() {
        let mut still = Vec::with_capacity(line.len());
        for destination in line {
            if out.len() >= limit {
                break;
            }
            if take_from(t, &destination, 1, request.limited, now, &change, &mut out)? == 1 {
                still.push(destination);
            }
        }
        line = still;
    }
    Ok(out)
}

/// Claims up to `n` of `destination`'s entries due at `now`, within what
/// its flow allows (and at most `limited` if its flow limits claims: see
/// [`ClaimRequest::limited`]), into `out`; returns how many.
fn take_from(
    t: &mut Tables<'_>,
    destination: &str,
    mut n: usize,
    limited: usize,
    now: i64,
    change: &Change,
    out: &mut Vec<OutboxEntry>,
) -> Result<usize> {
    let mut taken = 0;
    while taken < n {
        let Allowance::Take { max, probe } = t.flows.rec(destination)?.flow.allowance(now) else {
            break;
        };
        if max != u32::MAX || probe {
            n = n.min(limited);
            if taken >= n {
                break;
            }
        }
        // Claiming an entry never queues another (the next of a sequence
        // waits for this one to finish), so the first `want` due now are
        // the ones a claim of one at a time would take.
        let want = (n - taken).min(usize::try_from(max).unwrap_or(usize::MAX));
        let ids = t.flows.first_due(destination, now, want)?;
        if ids.is_empty() {
            break;
        }
        for id in ids {
            let index = OUTBOX_QUEUE.name();
            let old = t.load_indexed(index, id, |s| s == OutboxStatus::Pending)?;
            let new = plan(id, &old, change, None)?.ok_or_else(|| index_mismatch(index, id))?;
            out.push(new.to_record(id)?.entry);
            t.replace(id, &old, &new)?;
            t.flows.rec(destination)?.flow.claimed(1, id, probe, now);
            taken += 1;
        }
        t.flows.served(destination, now)?;
    }
    Ok(taken)
}

/// Applies `change` to record `id`, fenced by `attempt` if given, with the
/// attempt record it adds to the history and what it tells the entry's
/// destination. Returns the status after (unchanged for an accepted
/// no-op) and whether a destination became claimable sooner.
pub(super) fn change(
    tx: &WriteTransaction,
    id: u64,
    change: &Change,
    fence: Option<u32>,
) -> Result<(OutboxStatus, bool)> {
    let mut t = Tables::open(tx)?;
    let (status, _) = apply(&mut t, id, change, fence)?;
    let sooner = t.finish()?;
    Ok((status, sooner))
}

/// Applies `change` to record `id` in `t` (without finishing `t`) and
/// returns the record's status afterwards, and whether it changed. An error of the status machine
/// ([`Error::Conflict`]) or an unknown id ([`Error::NotFound`]) comes
/// before anything is written.
pub(super) fn apply(
    t: &mut Tables<'_>,
    id: u64,
    change: &Change,
    fence: Option<u32>,
) -> Result<(OutboxStatus, bool)> {
    let old = t.load(id)?.ok_or(Error::NotFound)?;
    let Some(new) = plan(id, &old, change, fence)? else {
        return Ok((old.status, false));
    };
    let attempt = change.attempt_row(&old, old.status);
    if attempt.is_some() {
        // Opened before anything is written (see `Tables::attempts`).
        t.attempts()?;
    }
    t.replace(id, &old, &new)?;
    if let Some(a) = attempt {
        t.push_attempt(id, &a)?;
    }
    tell_destination(t, id, &old, change)?;
    Ok((new.status, true))
}

/// What `change`, just applied to record `id` (`old` before), tells its
/// destination's flow: the circuit's signal, a hold.
fn tell_destination(t: &mut Tables<'_>, id: u64, old: &Row, change: &Change) -> Result<()> {
    let rec = t.flows.rec(&old.destination)?;
    if old.status == OutboxStatus::Dispatching {
        rec.flow
            .settled(id, change.signal(old.status), change.time());
    }
    if let Some(until) = change.hold() {
        rec.flow.hold(until);
    }
    Ok(())
}

/// Applies many fenced changes in order. Each is accepted or refused on its
/// own: a refusal ([`Error::Conflict`]) or a missing entry
/// ([`Error::NotFound`]) is that change's answer. Anything else (a record
/// that does not decode, a storage error) fails the whole operation, which
/// the engine then rolls back, the changes already written included.
pub(super) fn change_many(
    tx: &WriteTransaction,
    changes: &[(u64, u32, Change)],
) -> Result<(Vec<Result<()>>, bool)> {
    let mut t = Tables::open(tx)?;
    let out = change_all(&mut t, changes)?;
    let sooner = t.finish()?;
    Ok((out, sooner))
}

/// [`change_many`] on tables already open.
fn change_all(t: &mut Tables<'_>, changes: &[(u64, u32, Change)]) -> Result<Vec<Result<()>>> {
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
                tell_destination(t, *id, &old, c)?;
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(e @ Error::Conflict { .. }) => Err(e),
            Err(e) => return Err(e),
        });
    }
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
        tell_destination(&mut t, id, &old, &Change::Released)?;
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
    range: impl KeyRange<(i64, u64)>,
    limit: usize,
) -> Result<(Vec<u64>, bool)> {
    let mut ids = index_ids(index, range, limit.saturating_add(1))?;
    let more = ids.len() > limit;
    ids.truncate(limit);
    Ok((ids, more))
}

/// The ids of the first `limit` rows of a `(time, id)` index in `range`.
fn index_ids(
    index: &TimeIndex<'_>,
    range: impl KeyRange<(i64, u64)>,
    limit: usize,
) -> Result<Vec<u64>> {
    let ids = index
        .range(range)?
        .take(limit)
        .map(|row| row.map(|(k, _)| k.value().1))
        .collect::<std::result::Result<_, _>>()?;
    Ok(ids)
}
