//! What [`PgOutbox`] tells about its entries without changing them: one
//! entry, the entries of a command or a filter, the counts by status, and
//! the first time of the claims index. Each is one statement, so one
//! snapshot.

use std::collections::HashMap;

use chrono::{DateTime, Utc};

use super::{ATTEMPTS, PgOutbox, TABLE, db_id, history, parse_status, read_record, status_name};
use crate::codec::from_micros;
use crate::error::{Error, Result};
use crate::outbox::{
    OutboxCounts, OutboxFilter, OutboxId, OutboxRecord, OutboxStatus, check_field,
};
use crate::postgres::blocking::wait;
use crate::postgres::conn::Mode;
use crate::postgres::run;

impl PgOutbox {
    /// The entry `id` with its claim, settlement details and attempt
    /// history; [`Error::NotFound`] if there is none.
    pub fn get(&self, id: OutboxId) -> Result<OutboxRecord> {
        wait(self.get_async(id))
    }

    /// [`PgOutbox::get`], awaited.
    pub async fn get_async(&self, id: OutboxId) -> Result<OutboxRecord> {
        let db = db_id(id).ok_or(Error::NotFound)?;
        let sql = format!("{} WHERE o.id = $1", self.select_records());
        let row = run!(self.server, Mode::Read, |conn| {
            conn.db().query_opt(&sql, &[&db]).await
        })?;
        read_record(&row.ok_or(Error::NotFound)?)
    }

    /// The entry enqueued as `(destination, idempotency_key)`, if any.
    pub fn find(&self, destination: &str, idempotency_key: &str) -> Result<Option<OutboxRecord>> {
        wait(self.find_async(destination, idempotency_key))
    }

    /// [`PgOutbox::find`], awaited.
    pub async fn find_async(
        &self,
        destination: &str,
        idempotency_key: &str,
    ) -> Result<Option<OutboxRecord>> {
        check_field("destination", destination)?;
        check_field("idempotency_key", idempotency_key)?;
        let sql = format!(
            "{} WHERE o.destination = $1 AND o.idempotency_key = $2",
            self.select_records()
        );
        let row = run!(self.server, Mode::Read, |conn| {
            conn.db()
                .query_opt(
                    &sql,
                    &[&destination.as_bytes(), &idempotency_key.as_bytes()],
                )
                .await
        })?;
        row.as_ref().map(read_record).transpose()
    }

    /// Every entry of `command_id`, by `created_at`, then id.
    pub fn list_for_command(&self, command_id: &str) -> Result<Vec<OutboxRecord>> {
        wait(self.list_for_command_async(command_id))
    }

    /// [`PgOutbox::list_for_command`], awaited.
    pub async fn list_for_command_async(&self, command_id: &str) -> Result<Vec<OutboxRecord>> {
        check_field("command_id", command_id)?;
        let sql = format!(
            "{} WHERE o.command_id = $1 ORDER BY o.created_at, o.id",
            self.select_records()
        );
        let rows = run!(self.server, Mode::Read, |conn| {
            conn.db().query(&sql, &[&command_id.as_bytes()]).await
        })?;
        rows.iter().map(read_record).collect()
    }

    /// How many entries are in each status. Counts the rows: for
    /// monitoring at a modest rate. Sets the `idemstore_outbox_entries`
    /// gauge (feature `metrics`) to what it counted.
    pub fn counts(&self) -> Result<OutboxCounts> {
        wait(self.counts_async())
    }

    /// [`PgOutbox::counts`], awaited.
    pub async fn counts_async(&self) -> Result<OutboxCounts> {
        let s = self.s();
        let sql = format!("SELECT status, count(*) FROM {s}.outbox GROUP BY status");
        let rows = run!(self.server, Mode::Read, |conn| conn
            .db()
            .query(&sql, &[])
            .await)?;
        let mut counts: HashMap<OutboxStatus, u64> = HashMap::new();
        for r in &rows {
            let name: &str = r.try_get(0)?;
            let n: i64 = r.try_get(1)?;
            counts.insert(parse_status(0, name)?, u64::try_from(n).unwrap_or(0));
        }
        let counts = OutboxCounts::from_fn(|st| counts.get(&st).copied().unwrap_or(0));
        self.depth.publish(&counts);
        Ok(counts)
    }

    /// The claim time of the longest-held `Dispatching` entry, or `None` if
    /// nothing is being dispatched.
    pub fn oldest_claim(&self) -> Result<Option<DateTime<Utc>>> {
        wait(self.oldest_claim_async())
    }

    /// [`PgOutbox::oldest_claim`], awaited.
    pub async fn oldest_claim_async(&self) -> Result<Option<DateTime<Utc>>> {
        let s = self.s();
        self.first_time(&format!(
            "SELECT claimed_at, id FROM {s}.outbox WHERE status = 'dispatching' \
             ORDER BY claimed_at, id LIMIT 1"
        ))
        .await
    }

    /// The `(time, id)` of the one row `sql` returns, if any.
    async fn first_time(&self, sql: &str) -> Result<Option<DateTime<Utc>>> {
        let Some(r) = run!(self.server, Mode::Read, |conn| conn
            .db()
            .query_opt(sql, &[])
            .await)?
        else {
            return Ok(None);
        };
        let (at, id): (i64, i64) = (r.try_get(0)?, r.try_get(1)?);
        from_micros(TABLE, &id, at).map(Some)
    }

    /// Up to `limit` entries matching `filter`, by id (enqueue order). For
    /// inspection tools, not for a dispatcher. Page with
    /// [`OutboxFilter::after`] and the last id returned.
    pub fn list(&self, filter: &OutboxFilter, limit: usize) -> Result<Vec<OutboxRecord>> {
        wait(self.list_async(filter, limit))
    }

    /// [`PgOutbox::list`], awaited.
    pub async fn list_async(
        &self,
        filter: &OutboxFilter,
        limit: usize,
    ) -> Result<Vec<OutboxRecord>> {
        filter.check()?;
        let Some((lo, hi)) = db_bounds(filter) else {
            return Ok(Vec::new());
        };
        if limit == 0 {
            return Ok(Vec::new());
        }
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let destination = filter.destination_filter().map(str::as_bytes);
        let sql = format!(
            "{} WHERE o.id BETWEEN $1 AND $4 AND {} AND ($2::bytea IS NULL OR o.destination = $2) \
             ORDER BY o.id {} LIMIT $3",
            self.select_records(),
            status_condition("o.", filter),
            order(filter)
        );
        let rows = run!(self.server, Mode::Read, |conn| {
            conn.db()
                .query(&sql, &[&lo, &destination, &limit, &hi])
                .await
        })?;
        rows.iter().map(read_record).collect()
    }

    /// Checks what the server does not enforce itself (its constraints hold
    /// the status invariants): every row and attempt record decodes as the
    /// store wrote it, no entry keeps more than 20 attempt records, and an
    /// entry waits in its ordering sequence exactly while an earlier one
    /// is unfinished.
    /// Returns one human-readable finding per violation, none if the outbox
    /// is consistent. Reads every row: for tests and offline checks.
    pub fn check_indexes(&self) -> Result<Vec<String>> {
        wait(self.check_indexes_async())
    }

    /// [`PgOutbox::check_indexes`], awaited.
    pub async fn check_indexes_async(&self) -> Result<Vec<String>> {
        let mut findings = Vec::new();
        // One pooled connection, used directly for its three reads (they are
        // not run again on a lost connection).
        let conn = self.server.conn().await?;
        let conn = &conn.client;
        for r in conn.query(&self.select_records(), &[]).await? {
            if let Err(e) = read_record(&r) {
                findings.push(e.to_string());
            }
        }
        let s = self.s();
        for r in conn
            .query(
                &format!(
                    "SELECT id, count(*) FROM {s}.outbox_attempts GROUP BY id HAVING count(*) > $1"
                ),
                &[&history()],
            )
            .await?
        {
            let (id, n): (i64, i64) = (r.try_get(0)?, r.try_get(1)?);
            findings.push(format!(
                "{ATTEMPTS}: record {id} keeps {n} attempt records, more than {}",
                history()
            ));
        }
        // An entry waits in its sequence exactly when an earlier one is
        // unfinished (or, as copied in, another is being sent or in doubt).
        for r in conn
            .query(
                &format!(
                    "SELECT o.id, o.waiting FROM {s}.outbox o WHERE o.seq IS NOT NULL \
                     AND o.waiting <> (EXISTS (SELECT 1 FROM {s}.outbox p \
                         WHERE p.destination = o.destination AND p.ordering_key = o.ordering_key \
                         AND p.seq IS NOT NULL AND p.id <> o.id AND (p.seq < o.seq \
                             OR (o.status = 'pending' \
                                 AND p.status IN ('dispatching', 'outcome_unknown')))))"
                ),
                &[],
            )
            .await?
        {
            let (id, waiting): (i64, bool) = (r.try_get(0)?, r.try_get(1)?);
            findings.push(format!(
                "{TABLE}: record {id} is {} in its ordering sequence, against its place",
                if waiting { "waiting" } else { "not waiting" }
            ));
        }
        Ok(findings)
    }
}

/// The condition on the status of the entries `filter` lists (columns
/// prefixed by `alias`): the status as a literal, so the planner can use
/// the partial indexes whose predicate it matches (`outbox_held` for the
/// failed and in-doubt entries), or `true`. The literal is one of the
/// store's own status names, never the caller's text.
pub(super) fn status_condition(alias: &str, filter: &OutboxFilter) -> String {
    match filter.status_filter() {
        Some(status) => format!("{alias}status = '{}'", status_name(status)),
        None => "true".to_owned(),
    }
}

/// The ids `filter` lists, `lo..=hi`, as the server's `bigint`s; `None`
/// when there are none.
pub(super) fn db_bounds(filter: &OutboxFilter) -> Option<(i64, i64)> {
    let (lo, hi) = filter.id_bounds()?;
    let lo = i64::try_from(lo).ok()?;
    Some((lo, i64::try_from(hi).unwrap_or(i64::MAX)))
}

/// The order of `filter`'s listing by id.
pub(super) fn order(filter: &OutboxFilter) -> &'static str {
    if filter.is_newest_first() {
        "DESC"
    } else {
        "ASC"
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_status, status_name};
    use crate::error::Error;
    use crate::outbox::OutboxStatus;

    #[test]
    fn the_status_column_reads_back_and_an_unknown_name_is_corrupted() {
        for status in OutboxStatus::ALL {
            assert_eq!(parse_status(1, status_name(status)).ok(), Some(status));
        }
        for bad in ["Pending", "outcome-unknown", ""] {
            let e = parse_status(7, bad).unwrap_err();
            assert!(
                matches!(&e, Error::Corrupted { table: "outbox", key, reason }
                    if key == "7" && reason.contains("unknown status")),
                "{e:?}"
            );
        }
    }
}
