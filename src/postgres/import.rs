//! Rows copied in from another store, as they are: the writes of the
//! library's migration to PostgreSQL (the crate's `migrate` module, and the
//! `idemstore migrate --to-postgres` command through it), which reads an
//! embedded store through its public calls and hands its rows here in
//! batches.
//!
//! Each batch is one transaction of `INSERT … ON CONFLICT DO NOTHING`
//! statements. A row the insert skips is looked up: the same entry (an
//! outbox record with the same id, destination, idempotency key, command
//! and creation time; an idempotency record with the same fence and
//! fingerprint) was copied by an earlier run and is left alone, so copying
//! again copies nothing twice; any other row holding its id or key is a
//! *conflict*: the record is not copied, and the call returns it for the
//! caller to report. An inbox key already there is neither (the key is
//! claimed either way). Outbox ids and fence tokens are kept as they are;
//! the sequences that hand out new ones are then moved past the largest
//! copied, under a lock of the table (writers of this table wait for the
//! batch), so that the server never hands out a copied id or fence again;
//! [`PgStore::import_counters`] moves them past what the source store
//! already handed out too. A sequence moved is not moved back should its
//! transaction fail (PostgreSQL's sequences are not transactional): values
//! are then skipped, never handed out twice.
//!
//! Private to the crate: the migration is the documented call.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

use super::PgStore;
use super::blocking::wait;
use super::conn::{Db, Mode, in_transaction};
use super::outbox::status_name;
use super::run;
use crate::codec::micros;
use crate::error::{Error, Result};
use crate::idempotency::{KeyEntry, KeyState, ResponseRecord};
use crate::inbox::rules::{check_event_key, check_inbox_name};
use crate::outbox::destinations::check_destination;
use crate::outbox::{DestinationState, OutboxId, OutboxRecord, OutboxStatus};

impl PgStore {
    /// Copies the keys of inbox `inbox` with their claim times; returns how
    /// many were not there yet.
    pub(crate) fn import_inbox(
        &self,
        inbox: &str,
        keys: &[(String, DateTime<Utc>)],
    ) -> Result<u64> {
        wait(self.import_inbox_async(inbox, keys))
    }

    /// [`PgStore::import_inbox`], awaited.
    pub(crate) async fn import_inbox_async(
        &self,
        inbox: &str,
        keys: &[(String, DateTime<Utc>)],
    ) -> Result<u64> {
        check_inbox_name(inbox)?;
        for (k, _) in keys {
            check_event_key(k)?;
        }
        if keys.is_empty() {
            return Ok(0);
        }
        let s = self.schema();
        let sql = format!(
            "INSERT INTO {s}.inbox (inbox, event_key, seen_at) \
             SELECT $1, k, t FROM unnest($2::bytea[], $3::bigint[]) AS u(k, t) \
             ON CONFLICT DO NOTHING"
        );
        let names: Vec<&[u8]> = keys.iter().map(|(k, _)| k.as_bytes()).collect();
        let times: Vec<i64> = keys.iter().map(|(_, t)| micros(*t)).collect();
        run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |db| {
                db.execute(&sql, &[&inbox, &names, &times]).await
            })
        })
    }

    /// Copies outbox records with their ids, status, claim and attempt
    /// history; returns how many were not there yet (neither their id nor
    /// their `(destination, idempotency_key)`), and the ids of those not
    /// copied because a different row holds their id or their
    /// `(destination, idempotency_key)`.
    pub(crate) fn import_outbox(&self, records: &[OutboxRecord]) -> Result<(u64, Vec<OutboxId>)> {
        wait(self.import_outbox_async(records))
    }

    /// [`PgStore::import_outbox`], awaited.
    pub(crate) async fn import_outbox_async(
        &self,
        records: &[OutboxRecord],
    ) -> Result<(u64, Vec<OutboxId>)> {
        if records.is_empty() {
            return Ok((0, Vec::new()));
        }
        let s = self.schema().to_owned();
        run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |db| async {
                db.execute(
                    &format!("LOCK TABLE {s}.outbox IN SHARE ROW EXCLUSIVE MODE"),
                    &[],
                )
                .await?;
                let mut copied = 0;
                let mut conflicts = Vec::new();
                for r in records {
                    let id = r.entry.id;
                    match insert_record(db, &s, r)
                        .await
                        .map_err(|e| naming(e, &format!("outbox entry {id}")))?
                    {
                        Copied::Inserted => copied += 1,
                        Copied::Present => {}
                        Copied::Conflict => conflicts.push(id),
                    }
                }
                order_sequences(db, &s, records).await?;
                bump_outbox_ids(db, &s).await?;
                Ok((copied, conflicts))
            }
            .await)
        })
    }

    /// Copies destination policies and pauses: a destination with a limit
    /// or a pause in `states` gets them, unless the server already holds a
    /// row for it (copied by an earlier run, or changed on the server since:
    /// left alone). Returns how many were copied.
    pub(crate) fn import_destinations(&self, states: &[DestinationState]) -> Result<u64> {
        wait(self.import_destinations_async(states))
    }

    /// [`PgStore::import_destinations`], awaited.
    pub(crate) async fn import_destinations_async(
        &self,
        states: &[DestinationState],
    ) -> Result<u64> {
        let states: Vec<&DestinationState> = states
            .iter()
            .filter(|d| d.paused || !d.policy.is_unlimited())
            .collect();
        for d in &states {
            check_destination(&d.destination)?;
            d.policy.check()?;
        }
        if states.is_empty() {
            return Ok(0);
        }
        let s = self.schema().to_owned();
        let sql = format!(
            "INSERT INTO {s}.destinations (destination, max_in_flight, rate_per_second, \
                 rate_burst, circuit_failures, circuit_cool_down, paused, weight) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
             ON CONFLICT (destination) DO NOTHING"
        );
        run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |db| async {
                let mut copied = 0;
                for d in &states {
                    let p = d.policy.to_parts();
                    copied += db
                        .execute(
                            &sql,
                            &[
                                &d.destination.as_bytes(),
                                &p.max_in_flight.map(i64::from),
                                &p.rate.map(|r| r.0),
                                &p.rate.map(|r| i64::from(r.1)),
                                &p.circuit.map(|c| i64::from(c.0)),
                                &p.circuit.map(|c| c.1),
                                &d.paused,
                                &p.weight.map(i64::from),
                            ],
                        )
                        .await?;
                }
                Ok(copied)
            }
            .await)
        })
    }

    /// Copies idempotency records — completed responses (each with its
    /// stored response) and reservations — with their fences; returns how
    /// many were not there yet, and the `(tenant, key)` of those not copied
    /// because a row with another fence or fingerprint holds their key. A
    /// completed entry without its response (purged meanwhile) is skipped.
    pub(crate) fn import_idempotency(
        &self,
        rows: &[(KeyEntry, Option<ResponseRecord>)],
    ) -> Result<(u64, Vec<(String, String)>)> {
        wait(self.import_idempotency_async(rows))
    }

    /// [`PgStore::import_idempotency`], awaited.
    pub(crate) async fn import_idempotency_async(
        &self,
        rows: &[(KeyEntry, Option<ResponseRecord>)],
    ) -> Result<(u64, Vec<(String, String)>)> {
        if rows.is_empty() {
            return Ok((0, Vec::new()));
        }
        let s = self.schema().to_owned();
        run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |db| async {
                db.execute(
                    &format!("LOCK TABLE {s}.idempotency IN SHARE ROW EXCLUSIVE MODE"),
                    &[],
                )
                .await?;
                let mut copied = 0;
                let mut conflicts = Vec::new();
                for (entry, response) in rows {
                    let copy = insert_key(db, &s, entry, response.as_ref())
                        .await
                        .map_err(|e| {
                            naming(
                                e,
                                &format!("idempotency key {:?}/{:?}", entry.tenant, entry.key),
                            )
                        })?;
                    match copy {
                        Copied::Inserted => copied += 1,
                        Copied::Present => {}
                        Copied::Conflict => {
                            conflicts.push((entry.tenant.clone(), entry.key.clone()));
                        }
                    }
                }
                let largest: Option<i64> = db
                    .query_one(&format!("SELECT max(fence) FROM {s}.idempotency"), &[])
                    .await?
                    .try_get(0)?;
                advance(db, &format!("{s}.idempotency_fence"), largest.unwrap_or(0)).await?;
                Ok((copied, conflicts))
            }
            .await)
        })
    }

    /// Moves the sequences past what the source store already handed out —
    /// outbox ids below `next_outbox_id`, fences below `next_fence`, its
    /// purged records' included — never back, so that the server never
    /// hands out an id or fence again that the source store did.
    pub(crate) fn import_counters(&self, next_outbox_id: u64, next_fence: u64) -> Result<()> {
        wait(self.import_counters_async(next_outbox_id, next_fence))
    }

    /// [`PgStore::import_counters`], awaited.
    pub(crate) async fn import_counters_async(
        &self,
        next_outbox_id: u64,
        next_fence: u64,
    ) -> Result<()> {
        let last = |field, next: u64| {
            i64::try_from(next.saturating_sub(1))
                .map_err(|_| Error::invalid(field, format!("{next} is beyond PostgreSQL's bigint")))
        };
        let (last_id, last_fence) = (last("id", next_outbox_id)?, last("fence", next_fence)?);
        let s = self.schema().to_owned();
        run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |db| async {
                db.execute(
                    &format!("LOCK TABLE {s}.outbox, {s}.idempotency IN SHARE ROW EXCLUSIVE MODE"),
                    &[],
                )
                .await?;
                let seq = outbox_ids(db, &s).await?;
                advance(db, &seq, last_id).await?;
                advance(db, &format!("{s}.idempotency_fence"), last_fence).await
            }
            .await)
        })
    }
}

/// What became of one row offered to the server.
enum Copied {
    /// It was not there: inserted.
    Inserted,
    /// Not copied, and not a conflict: the same entry is there already (an
    /// earlier run copied it), or there was nothing to copy.
    Present,
    /// A different row holds its id or key: not copied.
    Conflict,
}

/// `e`, a row's failure, naming the row: the server refusing one row fails
/// its whole batch, and the message says which row it was.
fn naming(e: Error, row: &str) -> Error {
    match e {
        Error::Postgres {
            code,
            message,
            source,
        } => Error::Postgres {
            code,
            message: format!("{row}: {message}"),
            source,
        },
        Error::InvalidInput { field, reason } => Error::invalid(field, format!("{row}: {reason}")),
        other => other,
    }
}

/// Inserts record `r` unless its id or `(destination, idempotency_key)` is
/// there; then its attempt history. What is there is the same entry if it
/// has the same id, destination, idempotency key, command and creation
/// time (its status and history may have moved on since); else a conflict.
async fn insert_record<C: GenericClient + Sync>(
    db: &mut Db<'_, C>,
    s: &str,
    r: &OutboxRecord,
) -> Result<Copied> {
    let e = &r.entry;
    let id = i64::try_from(e.id.0)
        .map_err(|_| Error::invalid("id", format!("{} is beyond PostgreSQL's bigint", e.id.0)))?;
    let attempt = match e.status {
        OutboxStatus::Dispatching => r.claim.as_ref(),
        OutboxStatus::OutcomeUnknown => r.attempt_in_doubt.as_ref(),
        _ => None,
    };
    let worker = attempt.map(|a| a.worker_id.as_bytes());
    let claimed_at = attempt.map(|a| micros(a.claimed_at));
    let inserted = db
        .query_opt(
            &format!(
                "INSERT INTO {s}.outbox (id, command_id, destination, idempotency_key, payload, \
             status, attempt_count, next_attempt_at, created_at, completed_at, worker_id, \
             claimed_at, last_failure, remote_ref, ordering_key, priority, seq) \
             OVERRIDING SYSTEM VALUE \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, \
                 CASE WHEN $15::bytea IS NULL OR $6 IN ('completed', 'failed') THEN NULL \
                 ELSE $1::bigint END) \
             ON CONFLICT DO NOTHING RETURNING id"
            ),
            &[
                &id,
                &e.command_id.as_bytes(),
                &e.destination.as_bytes(),
                &e.idempotency_key.as_bytes(),
                &e.payload,
                &status_name(e.status),
                &i64::from(e.attempt_count),
                &e.next_attempt_at.map(micros),
                &micros(e.created_at),
                &e.completed_at.map(micros),
                &worker,
                &claimed_at,
                &r.last_failure.as_deref().map(str::as_bytes),
                &r.remote_ref.as_deref().map(str::as_bytes),
                &e.ordering_key.as_deref().map(str::as_bytes),
                &i16::from(e.priority),
            ],
        )
        .await?;
    if inserted.is_none() {
        let there = db
            .query(
                &format!(
                    "SELECT id, command_id, destination, idempotency_key, created_at \
                 FROM {s}.outbox WHERE id = $1 OR (destination = $2 AND idempotency_key = $3)"
                ),
                &[
                    &id,
                    &e.destination.as_bytes(),
                    &e.idempotency_key.as_bytes(),
                ],
            )
            .await?;
        let same = |row: &tokio_postgres::Row| -> Result<bool> {
            Ok(row.try_get::<_, i64>(0)? == id
                && row.try_get::<_, &[u8]>(1)? == e.command_id.as_bytes()
                && row.try_get::<_, &[u8]>(2)? == e.destination.as_bytes()
                && row.try_get::<_, &[u8]>(3)? == e.idempotency_key.as_bytes()
                && row.try_get::<_, i64>(4)? == micros(e.created_at))
        };
        return Ok(match there.as_slice() {
            [row] if same(row)? => Copied::Present,
            _ => Copied::Conflict,
        });
    }
    if !r.attempts.is_empty() {
        let attempts: Vec<i64> = r.attempts.iter().map(|a| i64::from(a.attempt)).collect();
        let ats: Vec<i64> = r.attempts.iter().map(|a| micros(a.at)).collect();
        let reasons: Vec<&[u8]> = r.attempts.iter().map(|a| a.reason.as_bytes()).collect();
        let refs: Vec<Option<&[u8]>> = r
            .attempts
            .iter()
            .map(|a| a.remote_ref.as_deref().map(str::as_bytes))
            .collect();
        db.execute(
            &format!(
                "INSERT INTO {s}.outbox_attempts (id, seq, attempt, at, reason, remote_ref) \
                 SELECT $1, n - 1, a, t, r, rr \
                 FROM unnest($2::bigint[], $3::bigint[], $4::bytea[], $5::bytea[]) \
                     WITH ORDINALITY AS u(a, t, r, rr, n)"
            ),
            &[&id, &attempts, &ats, &reasons, &refs],
        )
        .await?;
    }
    Ok(Copied::Inserted)
}

/// Puts the copied entries with ordering keys in their sequences: in id
/// order (enqueue order), each waiting while an entry before it is
/// unfinished or one of its sequence is being sent or in doubt, so that
/// the entry the source store was sending stays the one in flight.
async fn order_sequences<C: GenericClient + Sync>(
    db: &mut Db<'_, C>,
    s: &str,
    records: &[OutboxRecord],
) -> Result<()> {
    let mut dests: Vec<&[u8]> = records
        .iter()
        .filter(|r| r.entry.ordering_key.is_some())
        .map(|r| r.entry.destination.as_bytes())
        .collect();
    if dests.is_empty() {
        return Ok(());
    }
    dests.sort_unstable();
    dests.dedup();
    db.execute(
        &format!(
            "UPDATE {s}.outbox o SET waiting = EXISTS (SELECT 1 FROM {s}.outbox p \
                 WHERE p.destination = o.destination AND p.ordering_key = o.ordering_key \
                 AND p.seq IS NOT NULL AND p.id <> o.id \
                 AND (p.seq < o.seq OR p.status IN ('dispatching', 'outcome_unknown'))) \
             WHERE o.destination = ANY($1) AND o.seq IS NOT NULL"
        ),
        &[&dests],
    )
    .await?;
    Ok(())
}

/// Moves the outbox's id sequence past the largest id, never back.
async fn bump_outbox_ids<C: GenericClient + Sync>(db: &mut Db<'_, C>, s: &str) -> Result<()> {
    let seq = outbox_ids(db, s).await?;
    let largest: Option<i64> = db
        .query_one(&format!("SELECT max(id) FROM {s}.outbox"), &[])
        .await?
        .try_get(0)?;
    advance(db, &seq, largest.unwrap_or(0)).await
}

/// The name of the outbox's id sequence, from the catalog, quoted where it
/// needs to be.
async fn outbox_ids<C: GenericClient + Sync>(db: &mut Db<'_, C>, s: &str) -> Result<String> {
    Ok(db
        .query_one(
            "SELECT pg_get_serial_sequence($1, 'id')",
            &[&format!("{s}.outbox")],
        )
        .await?
        .try_get(0)?)
}

/// Moves sequence `seq` so that it hands out only values above `past`;
/// never back (a sequence that is past it already is left alone). The
/// caller holds a lock of the table whose writers take values from it.
async fn advance<C: GenericClient + Sync>(db: &mut Db<'_, C>, seq: &str, past: i64) -> Result<()> {
    if past < 1 {
        return Ok(());
    }
    db.execute(
        &format!(
            "SELECT setval('{seq}', $1) \
             WHERE $1 > (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {seq})"
        ),
        &[&past],
    )
    .await?;
    Ok(())
}

/// Inserts the idempotency record `entry` unless its key is there. What is
/// there is the same record if it has the same fence and fingerprint (it
/// may have been completed since); else a conflict. A completed entry
/// without its response is neither copied nor a conflict.
async fn insert_key<C: GenericClient + Sync>(
    db: &mut Db<'_, C>,
    s: &str,
    entry: &KeyEntry,
    response: Option<&ResponseRecord>,
) -> Result<Copied> {
    let fence = i64::try_from(entry.fence).map_err(|_| {
        Error::invalid(
            "fence",
            format!("{} is beyond PostgreSQL's bigint", entry.fence),
        )
    })?;
    let (created_at, lease_until, status, content_type, names, values, body) =
        match (&entry.state, response) {
            (
                KeyState::Reserved {
                    reserved_at,
                    lease_until,
                },
                _,
            ) => (
                micros(*reserved_at),
                Some(micros(*lease_until)),
                None,
                None,
                None,
                None,
                None,
            ),
            (KeyState::Completed { .. }, Some(r)) => (
                micros(r.created_at),
                None,
                Some(i32::from(r.response_status)),
                r.content_type.as_deref(),
                Some(
                    r.headers
                        .iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>(),
                ),
                Some(
                    r.headers
                        .iter()
                        .map(|(_, v)| v.as_str())
                        .collect::<Vec<_>>(),
                ),
                Some(r.response_body.as_slice()),
            ),
            (KeyState::Completed { .. }, None) => return Ok(Copied::Present),
        };
    let n = db
        .execute(
            &format!(
                "INSERT INTO {s}.idempotency (tenant, idem_key, fingerprint, fence, created_at, \
             lease_until, status, content_type, header_names, header_values, body) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT DO NOTHING"
            ),
            &[
                &entry.tenant.as_bytes(),
                &entry.key.as_bytes(),
                &entry.fingerprint.as_bytes(),
                &fence,
                &created_at,
                &lease_until,
                &status,
                &content_type,
                &names,
                &values,
                &body,
            ],
        )
        .await?;
    if n == 1 {
        return Ok(Copied::Inserted);
    }
    let there = db
        .query_opt(
            &format!(
                "SELECT fence, fingerprint FROM {s}.idempotency WHERE tenant = $1 AND idem_key = $2"
            ),
            &[&entry.tenant.as_bytes(), &entry.key.as_bytes()],
        )
        .await?;
    Ok(match there {
        Some(row)
            if row.try_get::<_, i64>(0)? == fence
                && row.try_get::<_, &[u8]>(1)? == entry.fingerprint.as_bytes() =>
        {
            Copied::Present
        }
        _ => Copied::Conflict,
    })
}

/// The async calls' futures are `Send`: a check at compile time, never run.
#[cfg(test)]
fn _send(pg: &PgStore) {
    fn is_send<T: Send>(_: T) {}
    is_send(pg.import_inbox_async("i", &[]));
    is_send(pg.import_outbox_async(&[]));
    is_send(pg.import_destinations_async(&[]));
    is_send(pg.import_idempotency_async(&[]));
    is_send(pg.import_counters_async(1, 1));
}
