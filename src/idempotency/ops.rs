//! The idempotency rows inside one write transaction: every write path of the
//! module ends here, so the row/index invariant is kept in one place
//! ([`write_row`]).
//!
//! Each function reads what it needs first and writes only once it knows it
//! will succeed, so a function that returns `Err` wrote nothing (the engine's
//! rule for queued operations), and it computes its writes from the
//! transaction's state and its arguments only (it may be run twice).

use redb::{ReadableTable, Table, WriteTransaction};

use super::record::{encode_row, read_row};
use super::rules::{Completion, Look, Row, decide, with_fence};
use crate::error::Result;
use crate::schema::{IDEM, IDEM_CREATED, META, META_IDEM_NEXT_FENCE, open_write};

/// The idempotency table, opened for writing.
type Rows<'tx> = Table<'tx, (&'static str, &'static str), &'static [u8]>;

/// What [`begin`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Began {
    Answered(Look),
    Reserved {
        fence: u64,
        takeover: bool,
        expired: bool,
    },
}

/// Decides again inside the transaction (the row may have changed since the
/// caller's read) and reserves the key when the decision says so.
pub(crate) fn begin(
    tx: &WriteTransaction,
    tenant: &str,
    key: &str,
    fingerprint: &str,
    now: i64,
    expired_before: i64,
    lease_until: i64,
) -> Result<Began> {
    let rows = open_write(tx, IDEM)?;
    let old = read_row(&rows, tenant, key)?;
    let old_at = old.as_ref().map(Row::created_at);
    let (takeover, expired) = match decide(old, fingerprint, now, expired_before) {
        Look::Reserve { takeover, expired } => (takeover, expired),
        answer => return Ok(Began::Answered(answer)),
    };
    let fence = next_fence(tx)?;
    let row = Row::Reserved {
        fingerprint: fingerprint.to_owned(),
        fence,
        reserved_at: now,
        lease_until,
    };
    write_row(tx, rows, tenant, key, old_at, Some(&row))?;
    Ok(Began::Reserved {
        fence,
        takeover,
        expired,
    })
}

/// Takes the next fence token (store-wide, starting at 1, never reused).
fn next_fence(tx: &WriteTransaction) -> Result<u64> {
    let mut meta = open_write(tx, META)?;
    let fence = stored_next_fence(&meta)?;
    meta.insert(META_IDEM_NEXT_FENCE, fence + 1)?;
    Ok(fence)
}

/// The next fence token to hand out, as `meta` holds it (1 on a new file).
pub(crate) fn stored_next_fence(meta: &impl ReadableTable<&'static str, u64>) -> Result<u64> {
    Ok(meta.get(META_IDEM_NEXT_FENCE)?.map_or(1, |v| v.value()))
}

/// Replaces the row at `(tenant, key)`, whose expiry index entry is at
/// `old_at` (`None`: there was no row), by `new` (`None`: removes it), and
/// moves the index entry with it: the one place where a row and its index
/// entry change together.
fn write_row(
    tx: &WriteTransaction,
    mut rows: Rows<'_>,
    tenant: &str,
    key: &str,
    old_at: Option<i64>,
    new: Option<&Row>,
) -> Result<()> {
    if let Some(row) = new {
        rows.insert((tenant, key), encode_row(row).as_slice())?;
    } else {
        rows.remove((tenant, key))?;
    }
    drop(rows);
    let new_at = new.map(Row::created_at);
    if old_at == new_at {
        return Ok(());
    }
    let mut index = open_write(tx, IDEM_CREATED)?;
    if let Some(at) = old_at {
        index.remove((at, tenant, key))?;
    }
    if let Some(at) = new_at {
        index.insert((at, tenant, key), ())?;
    }
    Ok(())
}

/// Stores `response` (a `Row::Completed` carrying the reservation's fence)
/// if the row is still the reservation with that fence; otherwise writes
/// nothing and says why (see [`Completion`]).
pub(crate) fn complete(
    tx: &WriteTransaction,
    tenant: &str,
    key: &str,
    response: &Row,
) -> Result<Completion> {
    let rows = open_write(tx, IDEM)?;
    let Some(old) = read_row(&rows, tenant, key)? else {
        return Ok(Completion::FencedOut);
    };
    if !old.is_reserved_by(response.fence()) {
        return Ok(Completion::of(&old, response.fence()));
    }
    let old_at = Some(old.created_at());
    write_row(tx, rows, tenant, key, old_at, Some(response))?;
    Ok(Completion::Stored)
}

/// Frees the reservation with `fence`; anything else at the key (a newer
/// reservation, a response) is left alone. `true` if it freed the key.
pub(crate) fn release(tx: &WriteTransaction, tenant: &str, key: &str, fence: u64) -> Result<bool> {
    let rows = open_write(tx, IDEM)?;
    let Some(old) = read_row(&rows, tenant, key)? else {
        return Ok(false);
    };
    if !old.is_reserved_by(fence) {
        return Ok(false);
    }
    write_row(tx, rows, tenant, key, Some(old.created_at()), None)?;
    Ok(true)
}

/// First write wins: stores `row` (a response created at `now`) under a fresh
/// fence unless a row is there that is still live: a response created at or
/// after `expired_before`, or a reservation whose lease ends after `now`.
pub(crate) fn put(
    tx: &WriteTransaction,
    tenant: &str,
    key: &str,
    row: &Row,
    expired_before: i64,
) -> Result<bool> {
    let now = row.created_at();
    let rows = open_write(tx, IDEM)?;
    let old = read_row(&rows, tenant, key)?;
    if old
        .as_ref()
        .is_some_and(|r| r.holds_key(now, expired_before))
    {
        return Ok(false);
    }
    let fence = next_fence(tx)?;
    let row = with_fence(row, fence);
    let old_at = old.as_ref().map(Row::created_at);
    write_row(tx, rows, tenant, key, old_at, Some(&row))?;
    Ok(true)
}

/// Deletes the row at `(tenant, key)` if it is (still) expired at `cutoff`.
/// Returns whether it deleted it, and what is there afterwards.
pub(crate) fn delete_expired(
    tx: &WriteTransaction,
    tenant: &str,
    key: &str,
    cutoff: i64,
) -> Result<(bool, Option<Row>)> {
    let rows = open_write(tx, IDEM)?;
    let Some(old) = read_row(&rows, tenant, key)? else {
        return Ok((false, None));
    };
    if !old.expired(cutoff) {
        return Ok((false, Some(old)));
    }
    write_row(tx, rows, tenant, key, Some(old.created_at()), None)?;
    Ok((true, None))
}

/// Where a purge resumes: the index entry after which to continue.
pub(crate) type PurgeCursor = Option<(i64, String, String)>;

/// Removes up to `limit` rows expired at `cutoff`, walking the expiry index
/// from `after`. Returns the rows removed and where to continue (`None` when
/// the index has nothing more before `cutoff`).
pub(crate) fn purge_chunk(
    tx: &WriteTransaction,
    after: &PurgeCursor,
    cutoff: i64,
    limit: usize,
) -> Result<(u64, PurgeCursor)> {
    let mut index = open_write(tx, IDEM_CREATED)?;
    let mut candidates: Vec<(i64, String, String)> = Vec::new();
    let mut more = false;
    {
        let start = after
            .as_ref()
            .map_or((i64::MIN, "", ""), |(a, t, k)| (*a, t.as_str(), k.as_str()));
        for entry in index.range(start..(cutoff, "", ""))? {
            let (k, _) = entry?;
            let (at, tenant, key) = k.value();
            if after.is_some() && (at, tenant, key) == start {
                continue;
            }
            if candidates.len() >= limit {
                more = true;
                break;
            }
            candidates.push((at, tenant.to_owned(), key.to_owned()));
        }
    }
    let mut rows = open_write(tx, IDEM)?;
    // Decide everything before writing anything.
    let mut doomed: Vec<(bool, &(i64, String, String))> = Vec::new();
    for candidate in &candidates {
        let (at, tenant, key) = candidate;
        match read_row(&rows, tenant, key)? {
            // An index entry without its row: drop it, count nothing.
            None => doomed.push((false, candidate)),
            Some(row) if row.created_at() != *at => doomed.push((false, candidate)),
            Some(row) if row.expired(cutoff) => doomed.push((true, candidate)),
            Some(_) => {}
        }
    }
    let mut removed = 0;
    for (has_row, (at, tenant, key)) in doomed {
        index.remove((*at, tenant.as_str(), key.as_str()))?;
        if has_row {
            rows.remove((tenant.as_str(), key.as_str()))?;
            removed += 1;
        }
    }
    let next = if more { candidates.pop() } else { None };
    Ok((removed, next))
}
