//! Inspection: listing the rows and checking them against the expiry index.

use std::ops::Bound;

use redb::{ReadTransaction, ReadableTable, TableHandle as _};

use super::ops::stored_next_fence;
use super::record::decode_row;
use super::rules::{Row, check_tenant, check_tenant_key, key_entry, key_name};
use super::types::{KeyEntry, KeySummary, ResponseRecord};
use super::{IdempotencyKeys, completed_response};
use crate::codec::from_micros;
use crate::error::Result;
use crate::schema::{IDEM, IDEM_CREATED, META, open_read};

impl IdempotencyKeys {
    /// Up to `limit` rows, completed and reserved, in `(tenant, key)` order;
    /// of one tenant only if `tenant` is given. For inspection tools.
    pub fn list(&self, tenant: Option<&str>, limit: usize) -> Result<Vec<KeyEntry>> {
        if let Some(t) = tenant {
            check_tenant(t)?;
        }
        self.engine.read(|tx| list_in(tx, tenant, limit))
    }

    /// One page of every row, for walking them all: up to `limit` rows,
    /// completed responses and reservations alike (expired ones too: a
    /// plain read that never deletes), in `(tenant, key)` order — by
    /// tenant, then by key within a tenant, comparing their bytes —
    /// starting strictly after `after`.
    ///
    /// `after` is the `(tenant, key)` of the last row of the previous page,
    /// or `None` for the first page; it need not exist any more (a row
    /// deleted between pages is simply passed). Each page is one read
    /// transaction, so a walk sees each row once but not one snapshot of
    /// the whole table: rows written meanwhile may or may not appear. A
    /// page shorter than `limit` — empty, at the latest — is the last.
    ///
    /// ```
    /// # use idemstore::chrono::Utc;
    /// let keys = idemstore::Store::in_memory()?.idempotency_keys();
    /// for key in ["a", "b", "c"] {
    ///     let _ = keys.begin("tenant", key, "fp", Utc::now())?;
    /// }
    /// let mut seen = Vec::new();
    /// let mut after: Option<(String, String)> = None;
    /// loop {
    ///     let page = keys.list_after(after.as_ref().map(|(t, k)| (t.as_str(), k.as_str())), 2)?;
    ///     let Some(last) = page.last() else { break };
    ///     after = Some((last.tenant.clone(), last.key.clone()));
    ///     seen.extend(page.into_iter().map(|e| e.key));
    /// }
    /// assert_eq!(seen, ["a", "b", "c"]);
    /// # Ok::<_, idemstore::Error>(())
    /// ```
    pub fn list_after(&self, after: Option<(&str, &str)>, limit: usize) -> Result<Vec<KeyEntry>> {
        self.engine.read(|tx| list_after_in(tx, after, limit))
    }

    /// The row at `(tenant, key)`, completed or reserved, whatever its age:
    /// what [`list`](Self::list) shows of it, or `None` if there is none. A
    /// plain read that never deletes (an expired record is listed as it is
    /// stored). For inspection tools.
    pub fn entry(&self, tenant: &str, key: &str) -> Result<Option<KeyEntry>> {
        check_tenant_key(tenant, key)?;
        key_entry_of(tenant, key, self.read_row(tenant, key)?)
    }

    /// The completed response stored at `(tenant, key)`, whatever its age:
    /// a plain read that never deletes (unlike [`get`](Self::get), which
    /// treats expired records as gone). `None` for no row or a reservation.
    /// For inspection tools and backups.
    pub fn response(&self, tenant: &str, key: &str) -> Result<Option<ResponseRecord>> {
        check_tenant_key(tenant, key)?;
        completed_response(tenant, key, self.read_row(tenant, key)?)
    }

    /// The next fence token a reservation will take (fences are never
    /// reused, even once their records are purged). For the migration to
    /// PostgreSQL, which moves the server's sequence past it.
    #[cfg(feature = "postgres")]
    pub(crate) fn next_fence(&self) -> Result<u64> {
        self.engine.read(|tx| match open_read(tx, META)? {
            Some(meta) => stored_next_fence(&meta),
            None => Ok(1),
        })
    }

    /// How many rows are completed responses and how many reservations, and
    /// the oldest row's `created_at` (what the next
    /// [`purge_expired`](Self::purge_expired) would reach first). Reads
    /// every row in one read transaction: for inspection tools.
    pub fn summary(&self) -> Result<KeySummary> {
        self.engine.read(summary_in)
    }

    /// Checks the invariants between the rows and the expiry index: every
    /// row decodes, has its `(created_at, tenant, key)` index entry and a
    /// fence below the store's next one, and every index entry has its row.
    /// Returns one human-readable line per problem; empty when consistent.
    pub fn check_indexes(&self) -> Result<Vec<String>> {
        self.engine.read(check_indexes_in)
    }
}

/// What [`IdempotencyKeys::entry`] shows of `row` (of `(tenant, key)`).
pub(super) fn key_entry_of(tenant: &str, key: &str, row: Option<Row>) -> Result<Option<KeyEntry>> {
    row.map(|row| key_entry(tenant, key, row)).transpose()
}

/// Up to `limit` rows (of `tenant` only, if given), as `tx` sees them
/// ([`IdempotencyKeys::list`]).
pub(super) fn list_in(
    tx: &ReadTransaction,
    tenant: Option<&str>,
    limit: usize,
) -> Result<Vec<KeyEntry>> {
    let Some(rows) = open_read(tx, IDEM)? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for entry in rows.range((tenant.unwrap_or(""), "")..)? {
        if out.len() >= limit {
            break;
        }
        let (k, v) = entry?;
        let (t, key) = k.value();
        if tenant.is_some_and(|want| want != t) {
            break;
        }
        out.push(key_entry(t, key, decode_row(t, key, v.value())?)?);
    }
    Ok(out)
}

/// Up to `limit` rows strictly after `after`, as `tx` sees them
/// ([`IdempotencyKeys::list_after`]).
pub(super) fn list_after_in(
    tx: &ReadTransaction,
    after: Option<(&str, &str)>,
    limit: usize,
) -> Result<Vec<KeyEntry>> {
    let Some(rows) = open_read(tx, IDEM)? else {
        return Ok(Vec::new());
    };
    let start = match after {
        Some(k) => Bound::Excluded(k),
        None => Bound::Unbounded,
    };
    let mut out = Vec::new();
    for entry in rows.range((start, Bound::Unbounded))? {
        if out.len() >= limit {
            break;
        }
        let (k, v) = entry?;
        let (t, key) = k.value();
        out.push(key_entry(t, key, decode_row(t, key, v.value())?)?);
    }
    Ok(out)
}

/// The rows' summary, as `tx` sees them ([`IdempotencyKeys::summary`]).
pub(super) fn summary_in(tx: &ReadTransaction) -> Result<KeySummary> {
    let mut out = KeySummary::default();
    let Some(rows) = open_read(tx, IDEM)? else {
        return Ok(out);
    };
    for entry in rows.iter()? {
        let (k, v) = entry?;
        let (t, key) = k.value();
        match decode_row(t, key, v.value())? {
            Row::Completed { .. } => out.completed += 1,
            Row::Reserved { .. } => out.reserved += 1,
        }
    }
    if let Some(index) = open_read(tx, IDEM_CREATED)?
        && let Some((k, _)) = index.first()?
    {
        let (at, t, key) = k.value();
        out.oldest = Some(from_micros(IDEM_CREATED.name(), &key_name(t, key), at)?);
    }
    Ok(out)
}

/// The findings of [`IdempotencyKeys::check_indexes`], as `tx` sees the
/// rows.
pub(super) fn check_indexes_in(tx: &ReadTransaction) -> Result<Vec<String>> {
    let mut findings = Vec::new();
    let rows = open_read(tx, IDEM)?;
    let index = open_read(tx, IDEM_CREATED)?;
    let next_fence = match open_read(tx, META)? {
        Some(meta) => stored_next_fence(&meta)?,
        None => 1,
    };
    if let Some(rows) = &rows {
        for entry in rows.iter()? {
            let (k, v) = entry?;
            let (t, key) = k.value();
            let name = key_name(t, key);
            let row = match decode_row(t, key, v.value()) {
                Ok(r) => r,
                Err(e) => {
                    findings.push(format!("row {name} does not decode: {e}"));
                    continue;
                }
            };
            let at = row.created_at();
            let indexed = match &index {
                Some(i) => i.get((at, t, key))?.is_some(),
                None => false,
            };
            if !indexed {
                findings.push(format!("row {name} has no expiry index entry at {at} µs"));
            }
            if row.fence() >= next_fence {
                findings.push(format!(
                    "row {name} has fence {} but the next fence to hand out is {next_fence}",
                    row.fence()
                ));
            }
        }
    }
    if let Some(index) = &index {
        for entry in index.iter()? {
            let (k, _) = entry?;
            let (at, t, key) = k.value();
            let name = key_name(t, key);
            let row = match &rows {
                Some(r) => r.get((t, key))?,
                None => None,
            };
            match row {
                None => findings.push(format!("index entry at {at} µs for {name} has no row")),
                Some(v) => {
                    if let Ok(row) = decode_row(t, key, v.value())
                        && row.created_at() != at
                    {
                        findings.push(format!(
                            "index entry at {at} µs for {name}, but the row's created_at is {} µs",
                            row.created_at()
                        ));
                    }
                }
            }
        }
    }
    Ok(findings)
}
