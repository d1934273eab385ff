//! The inspection calls of [`PgIdempotencyKeys`]: plain reads of
//! `S.idempotency` that never delete, for tools (`idemstore`, the console)
//! and tests.
//!
//! | call | SQL |
//! |------|-----|
//! | `entry`, `response` | `SELECT … FROM S.idempotency WHERE tenant = $1 AND idem_key = $2` |
//! | `list`, `list_after` | `SELECT tenant, idem_key, … FROM S.idempotency WHERE … ORDER BY tenant, idem_key LIMIT …` |
//! | `summary` | `SELECT count(*) FILTER (…), count(*) FILTER (…), min(created_at) FROM S.idempotency` |
//! | `check_indexes` | the fence sequence's last value, then every row |

use super::{COLS, PgIdempotencyKeys, TABLE, read_row};
use crate::error::Result;
use crate::idempotency::rules::{
    Row, check_tenant, check_tenant_key, key_entry, key_name, row_time, to_response,
};
use crate::idempotency::{KeyEntry, KeySummary, ResponseRecord};
use crate::postgres::blocking::wait;
use crate::postgres::conn::Mode;
use crate::postgres::errors::utf8;
use crate::postgres::run;

impl PgIdempotencyKeys {
    /// The row at `(tenant, key)`, completed or reserved, whatever its age:
    /// what [`list`](Self::list) shows of it, or `None` if there is none. A
    /// plain read that never deletes. For inspection tools.
    pub fn entry(&self, tenant: &str, key: &str) -> Result<Option<KeyEntry>> {
        wait(self.entry_async(tenant, key))
    }

    /// [`PgIdempotencyKeys::entry`], awaited.
    pub async fn entry_async(&self, tenant: &str, key: &str) -> Result<Option<KeyEntry>> {
        check_tenant_key(tenant, key)?;
        let found = run!(self.server, Mode::Read, |conn| {
            self.read(&mut conn.db(), tenant, key, false).await
        })?;
        found.map(|row| key_entry(tenant, key, row)).transpose()
    }

    /// Up to `limit` rows, completed and reserved, in `(tenant, key)` order;
    /// of one tenant only if `tenant` is given. For inspection tools.
    pub fn list(&self, tenant: Option<&str>, limit: usize) -> Result<Vec<KeyEntry>> {
        wait(self.list_async(tenant, limit))
    }

    /// [`PgIdempotencyKeys::list`], awaited.
    pub async fn list_async(&self, tenant: Option<&str>, limit: usize) -> Result<Vec<KeyEntry>> {
        if let Some(t) = tenant {
            check_tenant(t)?;
        }
        if limit == 0 {
            return Ok(Vec::new());
        }
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let s = self.s();
        let sql = format!(
            "SELECT tenant, idem_key, {COLS} FROM {s}.idempotency \
             WHERE $1::bytea IS NULL OR tenant = $1 ORDER BY tenant, idem_key LIMIT $2"
        );
        let rows = run!(self.server, Mode::Read, |conn| {
            conn.db()
                .query(&sql, &[&tenant.map(str::as_bytes), &limit])
                .await
        })?;
        key_entries(&rows)
    }

    /// One page of every row, for walking them all, as the embedded
    /// store's [`IdempotencyKeys::list_after`](crate::IdempotencyKeys::list_after):
    /// up to `limit` rows, completed responses and reservations alike
    /// (expired ones too: a plain read that never deletes), in `(tenant,
    /// key)` order — by tenant, then by key, comparing their bytes —
    /// starting strictly after `after`, the `(tenant, key)` of the previous
    /// page's last row (`None` for the first page; it need not exist any
    /// more). Each page is one statement: rows written between pages may
    /// or may not appear. A page shorter than `limit` is the last.
    pub fn list_after(&self, after: Option<(&str, &str)>, limit: usize) -> Result<Vec<KeyEntry>> {
        wait(self.list_after_async(after, limit))
    }

    /// [`PgIdempotencyKeys::list_after`], awaited.
    pub async fn list_after_async(
        &self,
        after: Option<(&str, &str)>,
        limit: usize,
    ) -> Result<Vec<KeyEntry>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let s = self.s();
        let (tenant, key) = after.map_or((None, None), |(t, k)| (Some(t), Some(k)));
        let sql = format!(
            "SELECT tenant, idem_key, {COLS} FROM {s}.idempotency \
             WHERE $1::bytea IS NULL OR (tenant, idem_key) > ($1, $2::bytea) \
             ORDER BY tenant, idem_key LIMIT $3"
        );
        let rows = run!(self.server, Mode::Read, |conn| {
            conn.db()
                .query(
                    &sql,
                    &[&tenant.map(str::as_bytes), &key.map(str::as_bytes), &limit],
                )
                .await
        })?;
        key_entries(&rows)
    }

    /// The completed response stored at `(tenant, key)`, whatever its age:
    /// a plain read that never deletes. `None` for no row or a reservation.
    pub fn response(&self, tenant: &str, key: &str) -> Result<Option<ResponseRecord>> {
        wait(self.response_async(tenant, key))
    }

    /// [`PgIdempotencyKeys::response`], awaited.
    pub async fn response_async(&self, tenant: &str, key: &str) -> Result<Option<ResponseRecord>> {
        check_tenant_key(tenant, key)?;
        let found = run!(self.server, Mode::Read, |conn| {
            self.read(&mut conn.db(), tenant, key, false).await
        })?;
        match found {
            Some(row @ Row::Completed { .. }) => to_response(tenant, key, row).map(Some),
            _ => Ok(None),
        }
    }

    /// How many rows are completed responses and how many reservations, and
    /// the oldest row's `created_at`. Counts the rows: for inspection tools.
    pub fn summary(&self) -> Result<KeySummary> {
        wait(self.summary_async())
    }

    /// [`PgIdempotencyKeys::summary`], awaited.
    pub async fn summary_async(&self) -> Result<KeySummary> {
        let s = self.s();
        let sql = format!(
            "SELECT count(*) FILTER (WHERE lease_until IS NULL), \
                    count(*) FILTER (WHERE lease_until IS NOT NULL), \
                    min(created_at) \
             FROM {s}.idempotency"
        );
        let r = run!(self.server, Mode::Read, |conn| {
            conn.db().query_one(&sql, &[]).await
        })?;
        let (completed, reserved): (i64, i64) = (r.try_get(0)?, r.try_get(1)?);
        let oldest: Option<i64> = r.try_get(2)?;
        Ok(KeySummary {
            completed: u64::try_from(completed).unwrap_or(0),
            reserved: u64::try_from(reserved).unwrap_or(0),
            oldest: oldest.map(|at| row_time("", "(oldest)", at)).transpose()?,
        })
    }

    /// Checks what the server does not enforce itself: every row decodes as
    /// the store wrote it, and its fence was handed out by the sequence.
    /// Returns one human-readable line per problem; empty when consistent.
    /// Reads every row: for tests and offline checks.
    pub fn check_indexes(&self) -> Result<Vec<String>> {
        wait(self.check_indexes_async())
    }

    /// [`PgIdempotencyKeys::check_indexes`], awaited.
    pub async fn check_indexes_async(&self) -> Result<Vec<String>> {
        let s = self.s();
        let conn = self.server.conn().await?;
        let client = &conn.client;
        let last: i64 = client
            .query_one(
                &format!(
                    "SELECT CASE WHEN is_called THEN last_value ELSE 0 END \
                     FROM {s}.idempotency_fence"
                ),
                &[],
            )
            .await?
            .try_get(0)?;
        let mut findings = Vec::new();
        for r in client
            .query(
                &format!("SELECT tenant, idem_key, {COLS} FROM {s}.idempotency"),
                &[],
            )
            .await?
        {
            let (t, k): (Vec<u8>, Vec<u8>) = (r.try_get(0)?, r.try_get(1)?);
            let (t, k) = (String::from_utf8_lossy(&t), String::from_utf8_lossy(&k));
            let name = key_name(&t, &k);
            match read_row(&t, &k, &r, 2) {
                Err(e) => findings.push(format!("row {name} does not decode: {e}")),
                Ok(row) if i64::try_from(row.fence()).map_or(true, |f| f > last) => {
                    findings.push(format!(
                        "row {name} has fence {} but the last fence handed out is {last}",
                        row.fence()
                    ));
                }
                Ok(_) => {}
            }
        }
        Ok(findings)
    }
}

/// The rows of a listing (tenant, key, then [`COLS`]) as entries.
fn key_entries(rows: &[tokio_postgres::Row]) -> Result<Vec<KeyEntry>> {
    rows.iter()
        .map(|r| {
            let t = utf8(TABLE, &"?", r.try_get(0)?)?;
            let k = utf8(TABLE, &key_name(&t, "?"), r.try_get(1)?)?;
            let row = read_row(&t, &k, r, 2)?;
            key_entry(&t, &k, row)
        })
        .collect()
}

/// The async calls' futures are `Send`: a check at compile time, never run.
#[cfg(test)]
fn _send(k: &PgIdempotencyKeys) {
    fn is_send<T: Send>(_: T) {}
    is_send(k.entry_async("t", "k"));
    is_send(k.list_async(Some("t"), 1));
    is_send(k.list_after_async(Some(("t", "k")), 1));
    is_send(k.response_async("t", "k"));
    is_send(k.summary_async());
    is_send(k.check_indexes_async());
}
