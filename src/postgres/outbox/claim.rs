//! How [`PgOutbox`] claims: the same rule as the embedded store, decided
//! by the same `Flow` methods, on the server's rows.
//!
//! 1. **The line.** Every destination with a claimable entry (`pending`
//!    and not waiting behind an earlier entry of its ordering sequence),
//!    the priorities its claimable entries have and its earliest due time,
//!    one index descent per destination and priority (a skip scan of the
//!    partial `outbox_queue` index), joined with its flow row and, for a
//!    capped one, its in-flight count. It is claimable from `max(open_from,
//!    earliest due)` if `open_from` is some time, and its place in line is
//!    the later of that and `served_at`. Destinations claimable at `now`
//!    are taken front first, ties by name. Costs one step per destination
//!    and priority with claimable entries, whatever the backlog.
//! 2. **The locks.** The flow rows of the destinations visited (at most
//!    `limit`, or one at a time for a one-destination claim) are created
//!    if missing and locked `FOR UPDATE SKIP LOCKED` in name order: a
//!    destination another claimer is taking from (or a settlement is
//!    changing) is left to it. If other claimers hold every one of them,
//!    the claim locks the same rows again, this time waiting for their
//!    holders' commits, in name order (holding none, it joins no cycle of
//!    waits): many workers on one capped destination fill its cap, one
//!    claim after the other.
//!    Their in-flight counts are counted again under the lock, so that
//!    every claim committed before is in them: caps, tokens and probes hold
//!    exactly across processes.
//! 3. **The entries.** Each destination gives what its flow allows at
//!    `now` (`Flow::allowance`, taken one by one as the embedded store
//!    does), highest priority first, then earliest due, then id (one
//!    descent of the partial `outbox_queue` index per priority it has); the
//!    claim takes one from each per round, round after round, up to
//!    `limit`, in one `UPDATE`, and writes each flow back
//!    (`Flow::claimed`, `served_at`).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

use super::flows::{DESTINATIONS, FLOW_COLS, Stored, read_flow};
use super::{COLS, PgOutbox, TABLE, read_entry};
use crate::codec::{from_micros, micros};
use crate::error::Result;
use crate::outbox::claim_request::ONE_DESTINATION_LOOKS;
use crate::outbox::destinations::{Allowance, Flow};
use crate::outbox::{ClaimRequest, OutboxEntry};
use crate::postgres::blocking::wait;
use crate::postgres::conn::{Db, Mode, in_transaction};
use crate::postgres::errors::{unsigned, utf8};
use crate::postgres::{refuse_reentrant, run};

/// The entries a claim takes from `available` (each destination's, in its
/// order), in rounds: one from each destination of `wants` per round, in
/// line order, each at most its capacity, up to `limit` in all.
fn rounds(
    wants: &[(&str, usize, &[i16])],
    available: &HashMap<&str, Vec<u64>>,
    limit: usize,
) -> Vec<(String, u64)> {
    let mut chosen: Vec<(String, u64)> = Vec::new();
    let mut active: Vec<&str> = wants.iter().map(|(d, ..)| *d).collect();
    let mut given: HashMap<&str, usize> = HashMap::new();
    while chosen.len() < limit && !active.is_empty() {
        let mut still = Vec::with_capacity(active.len());
        for d in active {
            if chosen.len() >= limit {
                break;
            }
            let n = given.entry(d).or_insert(0);
            let cap = wants
                .iter()
                .find(|(w, ..)| *w == d)
                .map_or(0, |(_, c, _)| *c);
            let Some(ids) = available.get(d) else {
                continue;
            };
            if *n < cap
                && let Some(id) = ids.get(*n)
            {
                chosen.push((d.to_owned(), *id));
                *n += 1;
                still.push(d);
            }
        }
        active = still;
    }
    chosen
}

/// The column of a free claim's round (`k`) after [`COLS`], the line
/// position after it (in a claim of one destination and priority: the
/// entry's due time).
const FREE_K: usize = 17;

/// A destination with a claimable entry.
#[derive(Clone, Debug)]
struct Candidate {
    destination: String,
    /// Its place in line: the later of `from` and when a claim last took
    /// one of its entries; `None` while its flow is blocked.
    place: Option<i64>,
    /// When it is claimable from: the later of when its flow opens and its
    /// earliest claimable entry's due time.
    from: Option<i64>,
    /// The priorities of its claimable entries, highest first.
    priorities: Vec<i16>,
    /// Whether it has a flow row.
    has_row: bool,
    /// Whether its flow, as read, holds nothing a claim must keep exact
    /// (no policy, pause, hold, probe or circuit state): see
    /// [`PgOutbox::take_free`].
    free: bool,
}

/// How many entries `flow` lets a claim at `now` take one after the
/// other, at most `limit` (its allowance asked again after each, as the
/// claim takes them), and at most `limited` if the flow limits what a
/// claim takes ([`ClaimRequest::limited`]).
fn capacity(flow: &Flow, now: i64, limit: usize, limited: usize) -> usize {
    let mut f = flow.clone();
    let mut n = 0;
    while n < limit {
        match f.allowance(now) {
            // Neither a cap, a bucket nor a probe: it gives all it has.
            Allowance::Take {
                max: u32::MAX,
                probe: false,
            } => return limit,
            Allowance::Take { max, probe } if max > 0 && n < limited => {
                f.claimed(1, 0, probe, now);
                f.in_flight += 1;
                n += 1;
            }
            _ => break,
        }
    }
    n
}

impl PgOutbox {
    /// Every destination with a claimable entry, with its place in line.
    async fn line(&self, db: &mut Db<'_, impl GenericClient + Sync>) -> Result<Vec<Candidate>> {
        let s = self.s();
        let due = "coalesce(o.next_attempt_at, o.created_at)";
        let sql = format!(
            "WITH RECURSIVE pairs (destination, priority, due) AS ( \
                 (SELECT o.destination, o.priority, {due} FROM {s}.outbox o \
                  WHERE o.status = 'pending' AND NOT o.waiting \
                  ORDER BY o.destination, o.priority, {due}, o.id LIMIT 1) \
               UNION ALL \
                 SELECT n.destination, n.priority, n.due FROM pairs l CROSS JOIN LATERAL ( \
                     SELECT o.destination, o.priority, {due} AS due FROM {s}.outbox o \
                     WHERE o.status = 'pending' AND NOT o.waiting \
                     AND (o.destination, o.priority) > (l.destination, l.priority) \
                     ORDER BY o.destination, o.priority, {due}, o.id LIMIT 1) n \
             ), \
             line AS (SELECT destination, min(due) AS due, \
                 array_agg(priority ORDER BY priority DESC) AS priorities \
                 FROM pairs GROUP BY destination) \
             SELECT l.destination, l.due, l.priorities, d.destination IS NOT NULL, \
                 CASE WHEN d.max_in_flight IS NULL THEN 0 ELSE \
                     (SELECT count(*) FROM {s}.outbox f \
                      WHERE f.destination = l.destination AND f.status = 'dispatching') END, \
                 {FLOW_COLS} \
             FROM line l LEFT JOIN {s}.destinations d ON d.destination = l.destination"
        );
        let rows = db.query(&sql, &[]).await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            let destination = utf8(DESTINATIONS, &"line", r.try_get(0)?)?;
            let due: i64 = r.try_get(1)?;
            let priorities: Vec<i16> = r.try_get(2)?;
            let has_row: bool = r.try_get(3)?;
            let in_flight: i64 = r.try_get(4)?;
            let mut stored = if has_row {
                read_flow(r, 5, &destination)?
            } else {
                Stored::default()
            };
            stored.flow.in_flight = u64::try_from(in_flight).unwrap_or(0);
            let from = stored.flow.open_from().map(|open| open.max(due));
            let f = &stored.flow;
            let free = f.policy.limits_nothing()
                && !f.paused
                && f.probe.is_none()
                && f.open_until.is_none()
                && f.held_until.is_none()
                && f.failures == 0
                && f.trips == 0;
            out.push(Candidate {
                destination,
                place: from.map(|from| from.max(stored.served_at)),
                from,
                priorities,
                has_row,
                free,
            });
        }
        Ok(out)
    }

    /// The destinations of `line` claimable at `now` that `take` accepts,
    /// front of the line first (a destination just served by a claim whose
    /// clock is ahead of this one's is claimable, behind in the line).
    fn ready_at(line: &[Candidate], now: i64, take: impl Fn(&str) -> bool) -> Vec<Candidate> {
        let mut ready: Vec<Candidate> = line
            .iter()
            .filter(|c| c.from.is_some_and(|f| f <= now) && take(&c.destination))
            .cloned()
            .collect();
        ready.sort_by(|a, b| {
            (a.place, a.destination.as_bytes()).cmp(&(b.place, b.destination.as_bytes()))
        });
        ready
    }

    /// When the next entry may be claimed (possibly in the past: work is
    /// waiting), or `None` if nothing is claimable until something changes:
    /// the earliest time a destination with a claimable entry may give it —
    /// its entry's due time, its next token, the end of its cool-down or
    /// hold. A paused destination, one at its `max_in_flight` and an entry
    /// waiting behind an earlier one of its ordering sequence count for
    /// nothing here. A dispatcher sleeps until then, or until a
    /// [`subscribe`](PgOutbox::subscribe) signal.
    pub fn next_due(&self) -> Result<Option<DateTime<Utc>>> {
        wait(self.next_due_async())
    }

    /// [`PgOutbox::next_due`], awaited.
    pub async fn next_due_async(&self) -> Result<Option<DateTime<Utc>>> {
        let line = run!(self.server, Mode::Read, |conn| self
            .line(&mut conn.db())
            .await)?;
        match line.iter().filter_map(|c| c.place).min() {
            Some(at) => from_micros(TABLE, &"next due", at).map(Some),
            None => Ok(None),
        }
    }

    /// Claims what `request` asks for at `now`, as
    /// [`Outbox::claim`](crate::Outbox::claim) does: an entry is claimable
    /// when it is `Pending` and due, the first unfinished entry of its
    /// ordering sequence if it has an ordering key, and its destination is
    /// not paused, not at its `max_in_flight`, not held back (circuit open,
    /// throttled) and has a token. Destinations take turns, the one served
    /// longest ago first, one entry each per round (all from one if the
    /// request says [`one_destination`](ClaimRequest::one_destination));
    /// within a destination, highest priority first, then earliest due,
    /// then id.
    ///
    /// Each entry taken becomes `Dispatching` with `attempt_count + 1` and
    /// the claim `{worker_id, claimed_at: now}`; the returned entries are
    /// exactly what [`PgOutbox::get`] returns for them afterwards.
    /// Concurrent claimers, in any process, never get the same entry, and
    /// every limit holds across all of them: each destination's row is
    /// locked for the claim, and a destination another claimer holds is
    /// left to it, unless other claimers hold every destination the claim
    /// could take from: then it waits for their commits and takes what is
    /// left. Costs one index descent per destination with claimable
    /// entries plus O(limit · log n), whatever the backlog. A call that
    /// returns `Err` claimed nothing, unless the connection was lost once
    /// its `COMMIT` was sent: then the entries may have been claimed, and
    /// stay `Dispatching` until
    /// [`release_expired_claims`](Self::release_expired_claims) hands them
    /// back.
    pub fn claim(&self, now: DateTime<Utc>, request: &ClaimRequest) -> Result<Vec<OutboxEntry>> {
        wait(self.claim_async(now, request))
    }

    /// [`PgOutbox::claim`], awaited. Dropped once its `COMMIT` was sent,
    /// the entries may have been claimed (they stay `Dispatching` until
    /// [`release_expired_claims`](Self::release_expired_claims)).
    pub async fn claim_async(
        &self,
        now: DateTime<Utc>,
        request: &ClaimRequest,
    ) -> Result<Vec<OutboxEntry>> {
        request.check()?;
        if request.limit() == 0 {
            return Ok(Vec::new());
        }
        refuse_reentrant()?;
        let now = micros(now);
        let claimed = run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |db| self.claim_in(db, now, request).await)
        })?;
        self.depth.after_write(self).await;
        Ok(claimed)
    }

    /// [`PgOutbox::claim`] in `db`'s transaction.
    pub(super) async fn claim_in(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        now: i64,
        request: &ClaimRequest,
    ) -> Result<Vec<OutboxEntry>> {
        if request.limit() == 0 {
            return Ok(Vec::new());
        }
        let line = self.line(db).await?;
        let mut out = self
            .claim_from(db, &line, now, request, |d| !request.avoids(d))
            .await?;
        if out.is_empty() && !request.avoid.is_empty() {
            out = self
                .claim_from(db, &line, now, request, |d| request.avoids(d))
                .await?;
        }
        Ok(out)
    }

    /// [`PgOutbox::claim_in`] from the destinations of `line` (read once
    /// for both passes) that `take` accepts.
    async fn claim_from(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        line: &[Candidate],
        now: i64,
        request: &ClaimRequest,
        take: impl Fn(&str) -> bool,
    ) -> Result<Vec<OutboxEntry>> {
        let limit = request.limit();
        let ready = Self::ready_at(line, now, take);
        if request.one_destination {
            for c in ready.iter().take(ONE_DESTINATION_LOOKS) {
                let got = self
                    .take_rounds(db, std::slice::from_ref(c), limit, now, request)
                    .await?;
                if !got.is_empty() {
                    return Ok(got);
                }
            }
            return Ok(Vec::new());
        }
        let visit: Vec<Candidate> = ready.into_iter().take(limit).collect();
        self.take_rounds(db, &visit, limit, now, request).await
    }

    /// Takes up to `limit` entries from `visit` (in line order), one from
    /// each per round, each within what its flow allows at `now`.
    async fn take_rounds(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        visit: &[Candidate],
        limit: usize,
        now: i64,
        request: &ClaimRequest,
    ) -> Result<Vec<OutboxEntry>> {
        if visit.iter().all(|c| c.free) {
            return self.take_free(db, visit, limit, now, request).await;
        }
        let missing: Vec<String> = visit
            .iter()
            .filter(|c| !c.has_row)
            .map(|c| c.destination.clone())
            .collect();
        self.ensure_flows(db, &missing).await?;
        let mut names: Vec<String> = visit.iter().map(|c| c.destination.clone()).collect();
        names.sort_unstable();
        names.dedup();
        let (mut locked, mut chosen) = self
            .plan(db, visit, &names, true, limit, now, request)
            .await?;
        if locked.is_empty() {
            // Other claimers hold every flow this claim could take from:
            // wait for their commits rather than come back empty (a
            // dispatcher with more workers than a cap would otherwise fill
            // it one claim at a time). Holding no flow row, this claim
            // cannot be part of a cycle of waits. (A claim that locked some
            // rows and got nothing from them leaves the others to their
            // holders, as before.)
            (locked, chosen) = self
                .plan(db, visit, &names, false, limit, now, request)
                .await?;
        }
        if chosen.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<i64> = chosen
            .iter()
            .map(|(_, id)| i64::try_from(*id).unwrap_or(i64::MAX))
            .collect();
        let s = self.s();
        let rows = db
            .query(
                &format!(
                    "UPDATE {s}.outbox SET status = 'dispatching', \
                     attempt_count = LEAST(attempt_count + 1, 4294967295), \
                     worker_id = $3, claimed_at = $1 \
                     WHERE id IN (SELECT id FROM {s}.outbox WHERE id = ANY($2) \
                         AND status = 'pending' AND NOT waiting \
                         AND coalesce(next_attempt_at, created_at) <= $1 FOR UPDATE SKIP LOCKED) \
                     RETURNING {COLS}"
                ),
                &[&now, &ids, &request.worker_id().as_bytes()],
            )
            .await?;
        let mut by_id: HashMap<u64, OutboxEntry> = HashMap::with_capacity(rows.len());
        for r in &rows {
            let e = read_entry(r)?;
            by_id.insert(e.id.0, e);
        }
        let mut out = Vec::with_capacity(by_id.len());
        let mut touched: BTreeSet<&str> = BTreeSet::new();
        for (d, id) in &chosen {
            let Some(e) = by_id.remove(id) else {
                continue;
            };
            if let Some(r) = locked.get_mut(d) {
                if let Allowance::Take { probe, .. } = r.flow.allowance(now) {
                    r.flow.claimed(1, *id, probe, now);
                }
                r.flow.in_flight += 1;
                r.served_at = r.served_at.max(now);
                touched.insert(d.as_str());
            }
            out.push(e);
        }
        let writes: Vec<(&str, &Stored)> = touched
            .into_iter()
            .filter_map(|d| Some((d, locked.get(d)?)))
            .collect();
        self.write_flows(db, &writes).await?;
        Ok(out)
    }

    /// Locks the flow rows of `names` (sorted, distinct; with
    /// `skip_locked`, those another transaction holds are left out),
    /// counts their in-flight entries again under the lock, and chooses the
    /// entries of `visit` a claim of `limit` at `now` takes from them:
    /// `(the locked flows, the chosen destination and id of each entry, in
    /// claim order)`.
    #[allow(clippy::too_many_arguments)]
    async fn plan(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        visit: &[Candidate],
        names: &[String],
        skip_locked: bool,
        limit: usize,
        now: i64,
        request: &ClaimRequest,
    ) -> Result<(BTreeMap<String, Stored>, Vec<(String, u64)>)> {
        let mut locked = self.lock_flows(db, names, skip_locked).await?;
        let capped: Vec<&str> = locked
            .iter()
            .filter(|(_, r)| r.flow.policy.max_in_flight.is_some())
            .map(|(d, _)| d.as_str())
            .collect();
        let counts = self.count_in_flight(db, &capped).await?;
        for (d, r) in &mut locked {
            r.flow.in_flight = counts.get(d).copied().unwrap_or(0);
        }
        // What each may give, and its entries that could be taken.
        let wants: Vec<(&str, usize, &[i16])> = visit
            .iter()
            .filter_map(|c| {
                let r = locked.get(&c.destination)?;
                let n = capacity(&r.flow, now, limit, request.limited);
                (n > 0).then_some((c.destination.as_str(), n, c.priorities.as_slice()))
            })
            .collect();
        let available = self.first_entries(db, &wants, now).await?;
        let chosen = rounds(&wants, &available, limit);
        Ok((locked, chosen))
    }

    /// [`PgOutbox::take_rounds`] of destinations that are all
    /// [`free`](Candidate::free): none has a limit to keep, so none is
    /// locked. Their entries are taken as concurrent claimers take them
    /// from one queue (`FOR UPDATE SKIP LOCKED`, each claimer its own), the
    /// rounds done by the server (the `k`-th entry of each destination in
    /// line order, `k` = 1, 2, …), and when each was served is moved
    /// forward where no other transaction holds its row (a claimer that
    /// does is moving it as far). One statement. A destination given a
    /// policy, a pause or a hold since the line was read is left out of it.
    async fn take_free(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        visit: &[Candidate],
        limit: usize,
        now: i64,
        request: &ClaimRequest,
    ) -> Result<Vec<OutboxEntry>> {
        if let [c] = visit
            && let [priority] = c.priorities[..]
            && c.has_row
        {
            return self
                .take_free_one(db, c, priority, limit, now, request)
                .await;
        }
        let s = self.s();
        let due = "coalesce(o.next_attempt_at, o.created_at)";
        let names: Vec<&[u8]> = visit.iter().map(|c| c.destination.as_bytes()).collect();
        // One row per destination and priority, with the destination's
        // place in line.
        let (mut pair_names, mut positions, mut priorities) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, c) in (0_i32..).zip(visit) {
            for p in &c.priorities {
                pair_names.push(c.destination.as_bytes());
                positions.push(pos);
                priorities.push(*p);
            }
        }
        let missing: Vec<&[u8]> = visit
            .iter()
            .filter(|c| !c.has_row)
            .map(|c| c.destination.as_bytes())
            .collect();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = db
            .query(
                &format!(
                    "WITH q (d, pos, pr) AS ( \
                         SELECT * FROM unnest($1::bytea[], $2::int[], $3::smallint[])), \
                     open AS (SELECT q.d, q.pos, q.pr FROM q WHERE NOT EXISTS ( \
                         SELECT 1 FROM {s}.destinations f WHERE f.destination = q.d AND ( \
                         f.paused OR f.max_in_flight IS NOT NULL OR f.rate_per_second IS NOT NULL \
                         OR f.circuit_failures IS NOT NULL OR f.held_until IS NOT NULL))), \
                     pick (pid, k, pos) AS (SELECT x.id, x.k, x.pos FROM ( \
                         SELECT e.id, open.pos, row_number() OVER ( \
                             PARTITION BY open.pos ORDER BY open.pr DESC, e.due, e.id) AS k \
                         FROM open CROSS JOIN LATERAL ( \
                             SELECT o.id, {due} AS due FROM {s}.outbox o \
                             WHERE o.destination = open.d AND o.priority = open.pr \
                             AND o.status = 'pending' AND NOT o.waiting AND {due} <= $4 \
                             ORDER BY o.destination, o.priority, {due}, o.id \
                             LIMIT $5 FOR UPDATE SKIP LOCKED) e) x \
                         ORDER BY x.k, x.pos LIMIT $5), \
                     served AS (UPDATE {s}.destinations f \
                         SET served_at = GREATEST(f.served_at, $4) \
                         WHERE f.destination IN (SELECT l.destination FROM {s}.destinations l \
                             WHERE l.destination = ANY($8) FOR UPDATE SKIP LOCKED)), \
                     born AS (INSERT INTO {s}.destinations (destination, served_at) \
                         SELECT d, $4 FROM unnest($7::bytea[]) AS m(d) ORDER BY d \
                         ON CONFLICT DO NOTHING) \
                     UPDATE {s}.outbox o SET status = 'dispatching', \
                         attempt_count = LEAST(o.attempt_count + 1, 4294967295), \
                         worker_id = $6, claimed_at = $4 \
                     FROM pick WHERE o.id = pick.pid \
                     RETURNING {COLS}, pick.k, pick.pos"
                ),
                &[
                    &pair_names,
                    &positions,
                    &priorities,
                    &now,
                    &limit,
                    &request.worker_id().as_bytes(),
                    &missing,
                    &names,
                ],
            )
            .await?;
        let mut taken = Vec::with_capacity(rows.len());
        for r in &rows {
            let k: i64 = r.try_get(FREE_K)?;
            let pos: i32 = r.try_get(FREE_K + 1)?;
            taken.push(((k, pos), read_entry(r)?));
        }
        taken.sort_by_key(|(order, _)| *order);
        Ok(taken.into_iter().map(|(_, e)| e).collect())
    }

    /// [`PgOutbox::take_free`] of one destination `c` whose claimable
    /// entries all have `priority` and that has a flow row: the common
    /// claim (one destination, one priority), in a statement the server
    /// plans in about half the time of the general one.
    async fn take_free_one(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        c: &Candidate,
        priority: i16,
        limit: usize,
        now: i64,
        request: &ClaimRequest,
    ) -> Result<Vec<OutboxEntry>> {
        let s = self.s();
        let due = "coalesce(o.next_attempt_at, o.created_at)";
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = db
            .query(
                &format!(
                    "WITH pick AS (SELECT o.id FROM {s}.outbox o \
                         WHERE o.destination = $1 AND o.priority = $2 AND o.status = 'pending' \
                         AND NOT o.waiting AND {due} <= $3 \
                         AND NOT EXISTS (SELECT 1 FROM {s}.destinations f \
                             WHERE f.destination = $1 AND (f.paused \
                             OR f.max_in_flight IS NOT NULL OR f.rate_per_second IS NOT NULL \
                             OR f.circuit_failures IS NOT NULL OR f.held_until IS NOT NULL)) \
                         ORDER BY o.destination, o.priority, {due}, o.id \
                         LIMIT $4 FOR UPDATE SKIP LOCKED), \
                     served AS (UPDATE {s}.destinations f \
                         SET served_at = GREATEST(f.served_at, $3) \
                         WHERE f.destination IN (SELECT l.destination FROM {s}.destinations l \
                             WHERE l.destination = $1 FOR UPDATE SKIP LOCKED)) \
                     UPDATE {s}.outbox o SET status = 'dispatching', \
                         attempt_count = LEAST(o.attempt_count + 1, 4294967295), \
                         worker_id = $5, claimed_at = $3 \
                     WHERE o.id IN (SELECT id FROM pick) \
                     RETURNING {COLS}, {due}"
                ),
                &[
                    &c.destination.as_bytes(),
                    &priority,
                    &now,
                    &limit,
                    &request.worker_id().as_bytes(),
                ],
            )
            .await?;
        let mut taken = Vec::with_capacity(rows.len());
        for r in &rows {
            let due: i64 = r.try_get(FREE_K)?;
            let e = read_entry(r)?;
            taken.push(((due, e.id.0), e));
        }
        taken.sort_by_key(|(order, _)| *order);
        Ok(taken.into_iter().map(|(_, e)| e).collect())
    }

    /// The first claimable entries due at `now` of each destination in
    /// `wants`, as many as it says, highest priority first, then earliest
    /// due, then id.
    async fn first_entries<'a>(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        wants: &[(&'a str, usize, &[i16])],
        now: i64,
    ) -> Result<HashMap<&'a str, Vec<u64>>> {
        let mut out: HashMap<&'a str, Vec<u64>> = HashMap::new();
        if wants.is_empty() {
            return Ok(out);
        }
        let s = self.s();
        let due = "coalesce(o.next_attempt_at, o.created_at)";
        // One row per destination and priority it has.
        let (mut names, mut counts, mut priorities) = (Vec::new(), Vec::new(), Vec::new());
        for (d, n, ps) in wants {
            for p in *ps {
                names.push(d.as_bytes());
                counts.push(i64::try_from(*n).unwrap_or(i64::MAX));
                priorities.push(*p);
            }
        }
        let rows = db
            .query(
                &format!(
                    "SELECT q.d, e.id, q.pr, e.due \
                     FROM unnest($1::bytea[], $2::bigint[], $4::smallint[]) AS q(d, n, pr) \
                     CROSS JOIN LATERAL ( \
                         SELECT o.id, {due} AS due FROM {s}.outbox o \
                         WHERE o.destination = q.d AND o.priority = q.pr AND o.status = 'pending' \
                         AND NOT o.waiting AND {due} <= $3 \
                         ORDER BY o.destination, o.priority, {due}, o.id LIMIT q.n) e"
                ),
                &[&names, &counts, &now, &priorities],
            )
            .await?;
        let mut found: HashMap<&'a str, Vec<(i16, i64, u64)>> = HashMap::new();
        for r in &rows {
            let d: &[u8] = r.try_get(0)?;
            let Some((name, ..)) = wants.iter().find(|(w, ..)| w.as_bytes() == d) else {
                continue;
            };
            let id: u64 = unsigned(TABLE, &"?", "id", r.try_get(1)?)?;
            found
                .entry(*name)
                .or_default()
                .push((r.try_get(2)?, r.try_get(3)?, id));
        }
        for (d, mut es) in found {
            es.sort_by(|a, b| (b.0, a.1, a.2).cmp(&(a.0, b.1, b.2)));
            out.insert(d, es.into_iter().map(|e| e.2).collect());
        }
        Ok(out)
    }
}
