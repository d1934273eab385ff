//! [`PgInbox`]: the dedup ledger in `S.inbox`.
//!
//! The statements (`S` is the store's schema, times µs):
//!
//! | call | SQL |
//! |------|-----|
//! | `claim`, `claim_in` | `INSERT INTO S.inbox (inbox, event_key, seen_at) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING` — one row inserted: first delivery |
//! | `claim_many` | the same, from `unnest($2::bytea[])`, `RETURNING event_key` |
//! | `claim_with` | `BEGIN`, the claim's `INSERT`, the effect's statements, `COMMIT` (or `ROLLBACK`) |
//! | `seen`, `seen_at` | `SELECT seen_at FROM S.inbox WHERE inbox = $1 AND event_key = $2` |
//! | `prune` | per chunk of 1024: `DELETE FROM S.inbox WHERE inbox = $1 AND event_key IN (SELECT event_key … WHERE inbox = $1 AND seen_at < $2 ORDER BY seen_at, event_key LIMIT $3 FOR UPDATE SKIP LOCKED)` (the `(inbox, seen_at, event_key)` index) |
//! | `prune_in` | `DELETE FROM S.inbox WHERE inbox = $1 AND seen_at < $2`, in the caller's transaction |
//! | `len` | `SELECT count(*) FROM S.inbox WHERE inbox = $1` |
//! | `list` | `SELECT event_key, seen_at … WHERE inbox = $1 AND (seen_at, event_key) > ($2, $3) ORDER BY seen_at, event_key LIMIT $4` |
//!
//! A concurrent claim of the same key waits for the first one's
//! transaction: if it commits, the second is a duplicate; if it rolls back
//! (its effect failed), the second claims the key and runs its own effect.

use std::collections::HashSet;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use tokio_postgres::types::ToSql;

use super::blocking::wait;
use super::conn::{Db, Mode};
use super::errors::utf8;
use super::{Access, BoxFuture, Finish, Server, Transaction, after_commit, refuse_reentrant, run};
use crate::codec::{from_micros, micros};
use crate::error::{Error, Result};
use crate::inbox::Claim;
use crate::inbox::rules::{check_event_key, check_event_keys, check_inbox_name};
use crate::observe;

const TABLE: &str = "inbox";

/// One dedup ledger on the server, named by the module that owns it. Cheap
/// to clone. The calls of [`Inbox`](crate::Inbox), with effects in a
/// PostgreSQL transaction.
#[derive(Clone, Debug)]
pub struct PgInbox {
    server: Arc<Server>,
    name: Arc<str>,
}

/// The time stored for a key, back as a `DateTime`.
fn time(key: &[u8], us: i64) -> Result<DateTime<Utc>> {
    from_micros(TABLE, &String::from_utf8_lossy(key), us)
}

impl PgInbox {
    pub(super) fn new(server: Arc<Server>, name: &str) -> Result<PgInbox> {
        check_inbox_name(name)?;
        Ok(PgInbox {
            server,
            name: name.into(),
        })
    }

    /// The inbox's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn insert_sql(&self) -> String {
        format!(
            "INSERT INTO {}.inbox (inbox, event_key, seen_at) VALUES ($1, $2, $3) \
             ON CONFLICT DO NOTHING",
            self.server.schema
        )
    }

    /// Records `event_key`; `true` the first time, `false` for every later
    /// delivery of the same key, including concurrent ones. Returns once the
    /// claim is committed.
    pub fn claim(&self, event_key: &str, seen_at: DateTime<Utc>) -> Result<bool> {
        wait(self.claim_async(event_key, seen_at))
    }

    /// [`PgInbox::claim`], awaited. Dropped once sent, the claim may have
    /// been made (a later claim of the key then answers `false`).
    pub async fn claim_async(&self, event_key: &str, seen_at: DateTime<Utc>) -> Result<bool> {
        check_event_key(event_key)?;
        refuse_reentrant()?;
        let sql = self.insert_sql();
        // One statement that commits as it ends: run again only when the
        // server said it did not happen (a lost answer may hide a claim).
        let n = run!(self.server, Mode::Statement, |conn| {
            conn.db()
                .execute(
                    &sql,
                    &[&&*self.name, &event_key.as_bytes(), &micros(seen_at)],
                )
                .await
        })?;
        observe::claim(&self.name, n == 1);
        Ok(n == 1)
    }

    /// Records many event keys in one statement. Returns, for each key in
    /// order, whether this was its first delivery (a key repeated within
    /// `event_keys` is `true` once). All keys are checked before anything is
    /// written: one bad key fails the call and claims nothing.
    pub fn claim_many<I, K>(&self, event_keys: I, seen_at: DateTime<Utc>) -> Result<Vec<bool>>
    where
        I: IntoIterator<Item = K>,
        K: AsRef<str>,
    {
        wait(self.claim_many_async(event_keys, seen_at))
    }

    /// [`PgInbox::claim_many`], awaited.
    pub async fn claim_many_async<I, K>(
        &self,
        event_keys: I,
        seen_at: DateTime<Utc>,
    ) -> Result<Vec<bool>>
    where
        I: IntoIterator<Item = K>,
        K: AsRef<str>,
    {
        let keys = check_event_keys(event_keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        refuse_reentrant()?;
        let bytes: Vec<&[u8]> = keys.iter().map(String::as_bytes).collect();
        let sql = format!(
            "INSERT INTO {}.inbox (inbox, event_key, seen_at) \
             SELECT $1, k, $3 FROM unnest($2::bytea[]) AS k \
             ON CONFLICT DO NOTHING RETURNING event_key",
            self.server.schema
        );
        let rows = run!(self.server, Mode::Statement, |conn| {
            conn.db()
                .query(&sql, &[&&*self.name, &bytes, &micros(seen_at)])
                .await
        })?;
        let mut inserted: HashSet<Vec<u8>> = HashSet::with_capacity(rows.len());
        for row in rows {
            inserted.insert(row.try_get(0)?);
        }
        // The first occurrence of an inserted key is its claim.
        let claimed: Vec<bool> = keys.iter().map(|k| inserted.remove(k.as_bytes())).collect();
        observe::claims(&self.name, &claimed);
        Ok(claimed)
    }

    /// Claims `event_key` and, on its first delivery, runs `effect` in the
    /// same transaction: both commit or neither does.
    ///
    /// - First delivery: `effect` runs once; if it returns `Ok(v)` the claim
    ///   and everything it wrote commit together and this returns
    ///   `Ok(Claim::Applied(v))` once committed.
    /// - `effect` returns `Err(e)`: nothing commits, the key stays
    ///   unclaimed (a later delivery runs the effect again), and `Err(e)` is
    ///   returned.
    /// - `effect` panics: the transaction rolls back, the key stays
    ///   unclaimed, and the panic reaches the caller.
    /// - A statement of `effect` failed but `effect` returned `Ok` anyway:
    ///   the server had aborted the transaction, so nothing commits, the key
    ///   stays unclaimed, and the server's [`Error::Postgres`] is returned
    ///   (SQLSTATE `25P02`, "current transaction is aborted"). Return a
    ///   failed statement's error, or run a statement that may fail in a
    ///   savepoint (`tx.transaction()`).
    /// - The connection is lost after the `COMMIT` was sent: `Err`, and the
    ///   claim and the effect's writes may have committed (a later delivery
    ///   then finds the key claimed).
    /// - Duplicate: `effect` does not run; `Ok(Claim::Duplicate)`.
    ///
    /// `effect` runs on the calling thread, at most once. Inside it, write
    /// through the transaction it is given (your own statements,
    /// [`PgOutbox::enqueue_in`](super::PgOutbox::enqueue_in), …); the
    /// store's own non-`_in` write calls there return [`Error::Reentrant`].
    /// While it runs, a concurrent delivery of the same key waits for its
    /// outcome.
    pub fn claim_with<T, E, F>(
        &self,
        event_key: &str,
        seen_at: DateTime<Utc>,
        effect: F,
    ) -> Result<Claim<T>, E>
    where
        F: FnOnce(&mut Transaction<'_>) -> Result<T, E>,
        E: From<Error>,
    {
        check_event_key(event_key)?;
        let sql = self.insert_sql();
        let params: [&(dyn ToSql + Sync); 3] =
            [&&*self.name, &event_key.as_bytes(), &micros(seen_at)];
        // The claim is tried again until it answers; the effect runs at
        // most once, after it.
        let out = self
            .server
            .write_once(Access::Write, Some((&sql, &params)), |claimed, tx| {
                if claimed == 0 {
                    // Nothing was written: roll back.
                    return Ok(Finish::Rollback(Claim::Duplicate));
                }
                effect(tx).map(|v| Finish::Commit(Claim::Applied(v)))
            })?;
        observe::claim(&self.name, matches!(out, Claim::Applied(_)));
        Ok(out)
    }

    /// [`PgInbox::claim_with`], awaited, with an async effect given the
    /// client's own transaction: `|tx| Box::pin(async move { … })` (its
    /// future borrows the transaction only: move into it what else it
    /// needs). The `*_in_async` calls write in it.
    ///
    /// Dropping the future before the effect's future ends rolls back:
    /// neither the claim nor the effect's writes commit, and a later
    /// delivery runs the effect again. Dropping it once the effect has
    /// returned `Ok` may leave both to commit unseen.
    pub async fn claim_with_async<T, E, F>(
        &self,
        event_key: &str,
        seen_at: DateTime<Utc>,
        effect: F,
    ) -> Result<Claim<T>, E>
    where
        F: for<'t, 'c> FnOnce(
            &'t mut tokio_postgres::Transaction<'c>,
        ) -> BoxFuture<'t, Result<T, E>>,
        T: Send + 'static,
        E: From<Error> + Send + 'static,
    {
        check_event_key(event_key)?;
        let sql = self.insert_sql();
        let params: [&(dyn ToSql + Sync); 3] =
            [&&*self.name, &event_key.as_bytes(), &micros(seen_at)];
        let out = self
            .server
            .write_once_async(Access::Write, Some((&sql, &params)), |claimed, tx| {
                if claimed == 0 {
                    return Box::pin(async { Ok(Finish::Rollback(Claim::Duplicate)) });
                }
                let effect = effect(tx);
                Box::pin(async move { effect.await.map(|v| Finish::Commit(Claim::Applied(v))) })
            })
            .await?;
        observe::claim(&self.name, matches!(out, Claim::Applied(_)));
        Ok(out)
    }

    /// Claims `event_key` inside the caller's own transaction (from
    /// [`PgStore::write`](super::PgStore::write)); `true` the first time.
    /// The claim commits or rolls back with the caller's transaction.
    ///
    /// Inside a `PgStore::write` closure (or a `claim_with` effect) the
    /// claim is counted (`idemstore_inbox_claims_total` or
    /// `idemstore_inbox_duplicates_total`) once that transaction has
    /// committed, and never if it rolls back, as on the embedded store. On a
    /// transaction of a client of your own, whose commit the store cannot
    /// see, it is counted when this call returns.
    pub fn claim_in(
        &self,
        tx: &mut Transaction<'_>,
        event_key: &str,
        seen_at: DateTime<Utc>,
    ) -> Result<bool> {
        wait(self.claim_in_async(tx.as_async(), event_key, seen_at))
    }

    /// [`PgInbox::claim_in`], awaited, in a transaction of the async
    /// client (a [`PgStore::write_async`](super::PgStore::write_async)
    /// closure's, or your own); the claim is counted when this returns.
    pub async fn claim_in_async(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        event_key: &str,
        seen_at: DateTime<Utc>,
    ) -> Result<bool> {
        check_event_key(event_key)?;
        let n = Db::uncached(tx)
            .execute(
                &self.insert_sql(),
                &[&&*self.name, &event_key.as_bytes(), &micros(seen_at)],
            )
            .await?;
        let applied = n == 1;
        if observe::ENABLED {
            let name = Arc::clone(&self.name);
            after_commit(move || observe::claim(&name, applied));
        }
        Ok(applied)
    }

    /// Whether `event_key` has been claimed (and not pruned).
    pub fn seen(&self, event_key: &str) -> Result<bool> {
        Ok(self.seen_at(event_key)?.is_some())
    }

    /// [`PgInbox::seen`], awaited.
    pub async fn seen_async(&self, event_key: &str) -> Result<bool> {
        Ok(self.seen_at_async(event_key).await?.is_some())
    }

    /// When `event_key` was claimed, if it was.
    pub fn seen_at(&self, event_key: &str) -> Result<Option<DateTime<Utc>>> {
        wait(self.seen_at_async(event_key))
    }

    /// [`PgInbox::seen_at`], awaited.
    pub async fn seen_at_async(&self, event_key: &str) -> Result<Option<DateTime<Utc>>> {
        check_event_key(event_key)?;
        let sql = format!(
            "SELECT seen_at FROM {}.inbox WHERE inbox = $1 AND event_key = $2",
            self.server.schema
        );
        let row = run!(self.server, Mode::Read, |conn| {
            conn.db()
                .query_opt(&sql, &[&&*self.name, &event_key.as_bytes()])
                .await
        })?;
        match row {
            Some(r) => time(event_key.as_bytes(), r.try_get(0)?).map(Some),
            None => Ok(None),
        }
    }

    /// Removes the keys claimed strictly before `seen_before`; returns how
    /// many. Walks the `(inbox, seen_at, event_key)` index, so it costs what
    /// it removes. A pruned key can be claimed again: prune only past the
    /// window in which duplicates can still arrive.
    ///
    /// Commits in chunks of at most 1024 keys, earliest claimed first, each
    /// one statement and so its own transaction; a key whose row is locked
    /// at that moment (by another prune) is left to it, or to the next
    /// prune. A reader may see part of the prune done; a lost connection or
    /// an `Err` midway leaves the chunks committed before it pruned, the
    /// rest for the next prune.
    pub fn prune(&self, seen_before: DateTime<Utc>) -> Result<u64> {
        wait(self.prune_async(seen_before))
    }

    /// [`PgInbox::prune`], awaited. Dropped midway, the chunks committed
    /// before stay pruned.
    pub async fn prune_async(&self, seen_before: DateTime<Utc>) -> Result<u64> {
        refuse_reentrant()?;
        let s = &self.server.schema;
        let sql = format!(
            "DELETE FROM {s}.inbox WHERE inbox = $1 AND event_key IN ( \
                 SELECT event_key FROM {s}.inbox WHERE inbox = $1 AND seen_at < $2 \
                 ORDER BY seen_at, event_key LIMIT $3 FOR UPDATE SKIP LOCKED)"
        );
        let chunk = i64::try_from(crate::inbox::PRUNE_CHUNK).unwrap_or(i64::MAX);
        let params: [&(dyn ToSql + Sync); 3] = [&&*self.name, &micros(seen_before), &chunk];
        let mut total = 0;
        loop {
            let n = run!(self.server, Mode::Statement, |conn| {
                conn.db().execute(&sql, &params).await
            })?;
            total += n;
            if n < crate::inbox::PRUNE_CHUNK as u64 {
                return Ok(total);
            }
        }
    }

    /// [`PgInbox::prune`] inside the caller's own transaction: one
    /// `DELETE` of every key it removes, with no cap on how many, whose row
    /// locks the caller's transaction holds until it ends. Use
    /// [`PgInbox::prune`] to prune a large backlog.
    pub fn prune_in(&self, tx: &mut Transaction<'_>, seen_before: DateTime<Utc>) -> Result<u64> {
        wait(self.prune_in_async(tx.as_async(), seen_before))
    }

    /// [`PgInbox::prune_in`], awaited, in a transaction of the async client.
    pub async fn prune_in_async(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        seen_before: DateTime<Utc>,
    ) -> Result<u64> {
        let params: [&(dyn ToSql + Sync); 2] = [&&*self.name, &micros(seen_before)];
        let sql = format!(
            "DELETE FROM {}.inbox WHERE inbox = $1 AND seen_at < $2",
            self.server.schema
        );
        Db::uncached(tx).execute(&sql, &params).await
    }

    /// Number of keys recorded in this inbox. Counts them (an index-only
    /// scan): for inspection and monitoring, not for every request.
    pub fn len(&self) -> Result<u64> {
        wait(self.len_async())
    }

    /// [`PgInbox::len`], awaited.
    pub async fn len_async(&self) -> Result<u64> {
        let sql = format!(
            "SELECT count(*) FROM {}.inbox WHERE inbox = $1",
            self.server.schema
        );
        let n: i64 = run!(self.server, Mode::Read, |conn| {
            conn.db().query_one(&sql, &[&&*self.name]).await
        })?
        .try_get(0)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Whether this inbox holds no keys.
    pub fn is_empty(&self) -> Result<bool> {
        wait(self.is_empty_async())
    }

    /// [`PgInbox::is_empty`], awaited.
    pub async fn is_empty_async(&self) -> Result<bool> {
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {}.inbox WHERE inbox = $1)",
            self.server.schema
        );
        let any: bool = run!(self.server, Mode::Read, |conn| {
            conn.db().query_one(&sql, &[&&*self.name]).await
        })?
        .try_get(0)?;
        Ok(!any)
    }

    /// Up to `limit` keys in claim order (oldest first) with their
    /// `seen_at`, starting strictly after `after` (a `(seen_at, key)` from a
    /// previous page). For inspection tools.
    pub fn list(
        &self,
        after: Option<(DateTime<Utc>, &str)>,
        limit: usize,
    ) -> Result<Vec<(String, DateTime<Utc>)>> {
        wait(self.list_async(after, limit))
    }

    /// [`PgInbox::list`], awaited.
    pub async fn list_async(
        &self,
        after: Option<(DateTime<Utc>, &str)>,
        limit: usize,
    ) -> Result<Vec<(String, DateTime<Utc>)>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let schema = &self.server.schema;
        let rows = if let Some((at, key)) = after {
            let sql = format!(
                "SELECT event_key, seen_at FROM {schema}.inbox \
                 WHERE inbox = $1 AND (seen_at, event_key) > ($2, $3) \
                 ORDER BY seen_at, event_key LIMIT $4"
            );
            run!(self.server, Mode::Read, |conn| {
                conn.db()
                    .query(&sql, &[&&*self.name, &micros(at), &key.as_bytes(), &limit])
                    .await
            })?
        } else {
            let sql = format!(
                "SELECT event_key, seen_at FROM {schema}.inbox WHERE inbox = $1 \
                 ORDER BY seen_at, event_key LIMIT $2"
            );
            run!(self.server, Mode::Read, |conn| {
                conn.db().query(&sql, &[&&*self.name, &limit]).await
            })?
        };
        rows.into_iter()
            .map(|r| {
                let key: Vec<u8> = r.try_get(0)?;
                let at = time(&key, r.try_get(1)?)?;
                Ok((
                    utf8(TABLE, &String::from_utf8_lossy(&key), key.clone())?,
                    at,
                ))
            })
            .collect()
    }
}

/// The names of the inboxes holding at least one key, in byte order (as
/// the embedded store lists them).
pub(super) async fn names(server: &Server) -> Result<Vec<String>> {
    // A walk of the primary key from name to name, not a scan of every key.
    // The `text` column orders by the database's collation, which need not
    // be byte order: the names are sorted here.
    let sql = format!(
        "WITH RECURSIVE names AS ( \
                 (SELECT inbox FROM {s}.inbox ORDER BY inbox LIMIT 1) \
                 UNION ALL \
                 SELECT (SELECT i.inbox FROM {s}.inbox i WHERE i.inbox > n.inbox \
                         ORDER BY i.inbox LIMIT 1) \
                 FROM names n WHERE n.inbox IS NOT NULL \
             ) SELECT inbox FROM names WHERE inbox IS NOT NULL",
        s = server.schema
    );
    let rows = run!(server, Mode::Read, |conn| conn.db().query(&sql, &[]).await)?;
    let mut names = rows
        .into_iter()
        .map(|r| r.try_get::<_, String>(0).map_err(Error::from))
        .collect::<Result<Vec<_>>>()?;
    names.sort_unstable();
    Ok(names)
}
