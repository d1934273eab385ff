//! The destinations' flow state in `S.destinations`: one row per
//! destination that has a policy, a pause, a hold or was claimed from,
//! holding its [`Flow`] (policy, pause, token bucket, circuit, hold) and
//! when a claim last took one of its entries (`served_at`). A destination
//! without a row has the default flow and was never served (`served_at`
//! 0), as in the embedded store.
//!
//! The rules are the shared ones (`Flow`'s methods); this file only reads
//! and writes their state. In-flight counts are not stored: a claim counts
//! the destination's `dispatching` rows (the partial in-flight index)
//! after locking its row, so that the count includes every claim committed
//! before it. Every change to a row is made under its row lock (`SELECT …
//! FOR UPDATE`, several rows in name order), in the transaction of the
//! entry changes that call for it.

use std::collections::{BTreeMap, HashMap};

use tokio_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use super::{PgOutbox, TABLE};
use crate::error::Result;
use crate::outbox::destinations::{Flow, PolicyParts, Signal};
use crate::postgres::conn::Db;
use crate::postgres::errors::{corrupted, utf8};

/// The table, in error messages.
pub(super) const DESTINATIONS: &str = "destinations";

/// The flow columns of `S.destinations`, in the order [`read_flow`] reads
/// them.
pub(super) const FLOW_COLS: &str = "max_in_flight, rate_per_second, rate_burst, \
    circuit_failures, circuit_cool_down, paused, tokens, tokens_at, failures, trips, \
    open_until, probe, held_until, served_at, weight";

/// A destination's stored row: its flow (its in-flight count as the caller
/// sets it) and when it was last served.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Stored {
    pub(super) flow: Flow,
    pub(super) served_at: i64,
}

/// A `bigint` column holding a `u32`.
fn u32_col(dest: &str, field: &str, v: Option<i64>) -> Result<Option<u32>> {
    v.map(|n| u32::try_from(n).map_err(|_| corrupted(DESTINATIONS, &dest, format!("{field} {n}"))))
        .transpose()
}

/// A `bigint` column holding a `u64`.
fn u64_col(dest: &str, field: &str, v: Option<i64>) -> Result<Option<u64>> {
    v.map(|n| u64::try_from(n).map_err(|_| corrupted(DESTINATIONS, &dest, format!("{field} {n}"))))
        .transpose()
}

/// The flow of `dest` in `r`, its [`FLOW_COLS`] from column `at` on.
pub(super) fn read_flow(r: &tokio_postgres::Row, at: usize, dest: &str) -> Result<Stored> {
    let rate = match (
        r.try_get::<_, Option<f64>>(at + 1)?,
        u32_col(dest, "rate_burst", r.try_get(at + 2)?)?,
    ) {
        (Some(per_second), Some(burst)) if per_second.is_finite() && per_second > 0.0 => {
            Some((per_second, burst))
        }
        (None, None) => None,
        _ => return Err(corrupted(DESTINATIONS, &dest, "a rate limit out of range")),
    };
    let circuit = match (
        u32_col(dest, "circuit_failures", r.try_get(at + 3)?)?,
        r.try_get::<_, Option<i64>>(at + 4)?,
    ) {
        (Some(k), Some(cool_down)) => Some((k, cool_down)),
        (None, None) => None,
        _ => return Err(corrupted(DESTINATIONS, &dest, "a circuit breaker half set")),
    };
    let tokens: Option<f64> = r.try_get(at + 6)?;
    if tokens.is_some_and(|t| !t.is_finite()) {
        return Err(corrupted(DESTINATIONS, &dest, "a token count out of range"));
    }
    let flow = Flow {
        policy: PolicyParts {
            max_in_flight: u32_col(dest, "max_in_flight", r.try_get(at)?)?,
            rate,
            circuit,
            weight: match u32_col(dest, "weight", r.try_get(at + 14)?)? {
                Some(0) => return Err(corrupted(DESTINATIONS, &dest, "a weight of 0")),
                w => w,
            },
        },
        paused: r.try_get(at + 5)?,
        in_flight: 0,
        tokens,
        tokens_at: r.try_get(at + 7)?,
        failures: u32_col(dest, "failures", Some(r.try_get(at + 8)?))?.unwrap_or(0),
        trips: u32_col(dest, "trips", Some(r.try_get(at + 9)?))?.unwrap_or(0),
        open_until: r.try_get(at + 10)?,
        probe: u64_col(dest, "probe", r.try_get(at + 11)?)?,
        held_until: r.try_get(at + 12)?,
    };
    Ok(Stored {
        flow,
        served_at: r.try_get(at + 13)?,
    })
}

/// What a change to an entry tells its destination's flow.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum FlowEvent {
    /// Entry `id` left `Dispatching` at `at`, telling the circuit `signal`
    /// (`Flow::settled`).
    Settled { id: u64, signal: Signal, at: i64 },
    /// The whole destination waits until then (`Flow::hold`).
    Hold(i64),
}

/// What the entry changes of one transaction told the destinations, in
/// order, and whether one of them made a waiting entry of a sequence
/// claimable.
#[derive(Debug, Default)]
pub(super) struct Touched {
    pub(super) events: Vec<(String, FlowEvent)>,
    pub(super) promoted: bool,
}

impl Stored {
    /// Whether the row holds nothing worth keeping once its destination
    /// has no entry: no policy, no pause, no hold (as the embedded store
    /// drops such a destination's record).
    pub(super) fn is_idle(&self) -> bool {
        self.flow.policy == PolicyParts::default()
            && !self.flow.paused
            && self.flow.held_until.is_none()
    }
}

impl PgOutbox {
    /// The rows of `dests` (sorted, distinct), locked in name order; with
    /// `skip_locked`, those another transaction holds are left out.
    pub(super) async fn lock_flows(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        dests: &[String],
        skip_locked: bool,
    ) -> Result<BTreeMap<String, Stored>> {
        if dests.is_empty() {
            return Ok(BTreeMap::new());
        }
        let s = self.s();
        let names: Vec<&[u8]> = dests.iter().map(String::as_bytes).collect();
        let rows = db
            .query(
                &format!(
                    "SELECT destination, {FLOW_COLS} FROM {s}.destinations \
                     WHERE destination = ANY($1) ORDER BY destination FOR UPDATE{}",
                    if skip_locked { " SKIP LOCKED" } else { "" }
                ),
                &[&names],
            )
            .await?;
        read_flows(&rows)
    }

    /// The rows of `dests` (sorted, distinct) whose flows a settlement can
    /// change, locked in name order: those of `held` (to be held back), and
    /// those with a policy or a circuit's state. The others, left unlocked,
    /// are flows that no settlement changes (`Flow::settled` of a flow
    /// without a circuit, probe or failure count changes nothing), so
    /// concurrent settlements and claims of such a destination do not wait
    /// for each other.
    async fn lock_settled_flows(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        dests: &[String],
        held: &[String],
    ) -> Result<BTreeMap<String, Stored>> {
        let s = self.s();
        let names: Vec<&[u8]> = dests.iter().map(String::as_bytes).collect();
        let held: Vec<&[u8]> = held.iter().map(String::as_bytes).collect();
        let rows = db
            .query(
                &format!(
                    "SELECT destination, {FLOW_COLS} FROM {s}.destinations \
                     WHERE destination = ANY($1) AND (destination = ANY($2) \
                         OR max_in_flight IS NOT NULL OR rate_per_second IS NOT NULL \
                         OR circuit_failures IS NOT NULL OR probe IS NOT NULL \
                         OR failures <> 0 OR trips <> 0 OR open_until IS NOT NULL) \
                     ORDER BY destination FOR UPDATE"
                ),
                &[&names, &held],
            )
            .await?;
        read_flows(&rows)
    }
}

/// The flows of `rows`, each its destination then its [`FLOW_COLS`].
fn read_flows(rows: &[tokio_postgres::Row]) -> Result<BTreeMap<String, Stored>> {
    let mut out = BTreeMap::new();
    for r in rows {
        let dest = utf8(DESTINATIONS, &"?", r.try_get(0)?)?;
        let stored = read_flow(r, 1, &dest)?;
        out.insert(dest, stored);
    }
    Ok(out)
}

impl PgOutbox {
    /// Creates the rows of `dests` that do not exist yet (the default flow),
    /// in name order.
    pub(super) async fn ensure_flows(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        dests: &[String],
    ) -> Result<()> {
        if dests.is_empty() {
            return Ok(());
        }
        let s = self.s();
        let mut names: Vec<&[u8]> = dests.iter().map(String::as_bytes).collect();
        names.sort_unstable();
        db.execute(
            &format!(
                "INSERT INTO {s}.destinations (destination) \
                 SELECT d FROM unnest($1::bytea[]) AS u(d) ORDER BY d ON CONFLICT DO NOTHING"
            ),
            &[&names],
        )
        .await?;
        Ok(())
    }

    /// The entries of `dests` in `Dispatching` now, by destination (those
    /// with none are absent).
    pub(super) async fn count_in_flight(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        dests: &[&str],
    ) -> Result<HashMap<String, u64>> {
        if dests.is_empty() {
            return Ok(HashMap::new());
        }
        let s = self.s();
        let names: Vec<&[u8]> = dests.iter().map(|d| d.as_bytes()).collect();
        let rows = db
            .query(
                &format!(
                    "SELECT destination, count(*) FROM {s}.outbox \
                     WHERE destination = ANY($1) AND status = 'dispatching' GROUP BY destination"
                ),
                &[&names],
            )
            .await?;
        let mut out = HashMap::new();
        for r in &rows {
            let dest = utf8(TABLE, &"in flight", r.try_get(0)?)?;
            let n: i64 = r.try_get(1)?;
            out.insert(dest, u64::try_from(n).unwrap_or(0));
        }
        Ok(out)
    }

    /// Writes `stored` as the row of `dest` (which exists, locked).
    pub(super) async fn write_flow(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        dest: &str,
        stored: &Stored,
    ) -> Result<()> {
        let s = self.s();
        let f = &stored.flow;
        let p = &f.policy;
        let weight = p.weight.map(i64::from);
        let params: [&(dyn ToSql + Sync); 16] = [
            &dest.as_bytes(),
            &p.max_in_flight.map(i64::from),
            &p.rate.map(|r| r.0),
            &p.rate.map(|r| i64::from(r.1)),
            &p.circuit.map(|c| i64::from(c.0)),
            &p.circuit.map(|c| c.1),
            &f.paused,
            &f.tokens,
            &f.tokens_at,
            &i64::from(f.failures),
            &i64::from(f.trips),
            &f.open_until,
            &f.probe.map(|id| i64::try_from(id).unwrap_or(i64::MAX)),
            &f.held_until,
            &stored.served_at,
            &weight,
        ];
        db.execute(
            &format!(
                "UPDATE {s}.destinations SET max_in_flight = $2, rate_per_second = $3, \
                 rate_burst = $4, circuit_failures = $5, circuit_cool_down = $6, paused = $7, \
                 tokens = $8, tokens_at = $9, failures = $10, trips = $11, open_until = $12, \
                 probe = $13, held_until = $14, served_at = $15, weight = $16 \
                 WHERE destination = $1"
            ),
            &params,
        )
        .await?;
        Ok(())
    }

    /// Writes each `(dest, stored)` as the row of `dest` (which exists,
    /// locked): one statement for all.
    pub(super) async fn write_flows(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        rows: &[(&str, &Stored)],
    ) -> Result<()> {
        if let [(dest, stored)] = rows {
            return self.write_flow(db, dest, stored).await;
        }
        if rows.is_empty() {
            return Ok(());
        }
        let s = self.s();
        let col = |f: &dyn Fn(&Stored) -> Option<i64>| -> Vec<Option<i64>> {
            rows.iter().map(|(_, r)| f(r)).collect()
        };
        let names: Vec<&[u8]> = rows.iter().map(|(d, _)| d.as_bytes()).collect();
        let cap = col(&|r| r.flow.policy.max_in_flight.map(i64::from));
        let per_second: Vec<Option<f64>> = rows
            .iter()
            .map(|(_, r)| r.flow.policy.rate.map(|x| x.0))
            .collect();
        let burst = col(&|r| r.flow.policy.rate.map(|x| i64::from(x.1)));
        let k = col(&|r| r.flow.policy.circuit.map(|c| i64::from(c.0)));
        let cool_down = col(&|r| r.flow.policy.circuit.map(|c| c.1));
        let paused: Vec<bool> = rows.iter().map(|(_, r)| r.flow.paused).collect();
        let tokens: Vec<Option<f64>> = rows.iter().map(|(_, r)| r.flow.tokens).collect();
        let tokens_at = col(&|r| Some(r.flow.tokens_at));
        let failures = col(&|r| Some(i64::from(r.flow.failures)));
        let trips = col(&|r| Some(i64::from(r.flow.trips)));
        let open_until = col(&|r| r.flow.open_until);
        let probe = col(&|r| r.flow.probe.map(|id| i64::try_from(id).unwrap_or(i64::MAX)));
        let held_until = col(&|r| r.flow.held_until);
        let served_at = col(&|r| Some(r.served_at));
        let weight = col(&|r| r.flow.policy.weight.map(i64::from));
        let params: [&(dyn ToSql + Sync); 16] = [
            &names,
            &cap,
            &per_second,
            &burst,
            &k,
            &cool_down,
            &paused,
            &tokens,
            &tokens_at,
            &failures,
            &trips,
            &open_until,
            &probe,
            &held_until,
            &served_at,
            &weight,
        ];
        db.execute(
            &format!(
                "UPDATE {s}.destinations d SET max_in_flight = u.cap, \
                 rate_per_second = u.per_second, rate_burst = u.burst, \
                 circuit_failures = u.k, circuit_cool_down = u.cool_down, paused = u.paused, \
                 tokens = u.tokens, tokens_at = u.tokens_at, failures = u.failures, \
                 trips = u.trips, open_until = u.open_until, probe = u.probe, \
                 held_until = u.held_until, served_at = u.served_at, weight = u.weight \
                 FROM unnest($1::bytea[], $2::bigint[], $3::float8[], $4::bigint[], \
                     $5::bigint[], $6::bigint[], $7::boolean[], $8::float8[], $9::bigint[], \
                     $10::bigint[], $11::bigint[], $12::bigint[], $13::bigint[], \
                     $14::bigint[], $15::bigint[], $16::bigint[]) \
                     AS u(destination, cap, per_second, burst, k, cool_down, paused, tokens, \
                          tokens_at, failures, trips, open_until, probe, held_until, served_at, \
                          weight) \
                 WHERE d.destination = u.destination"
            ),
            &params,
        )
        .await?;
        Ok(())
    }

    /// Deletes the rows of `dests` that hold nothing ([`Stored::is_idle`])
    /// and whose destinations have no entry left.
    pub(super) async fn drop_idle_flows(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        dests: &[&[u8]],
    ) -> Result<()> {
        if dests.is_empty() {
            return Ok(());
        }
        let s = self.s();
        db.execute(
            &format!(
                "DELETE FROM {s}.destinations d WHERE d.destination = ANY($1) \
                 AND d.max_in_flight IS NULL AND d.rate_per_second IS NULL \
                 AND d.circuit_failures IS NULL AND NOT d.paused AND d.held_until IS NULL \
                 AND NOT EXISTS (SELECT 1 FROM {s}.outbox o WHERE o.destination = d.destination)"
            ),
            &[&dests],
        )
        .await?;
        Ok(())
    }

    /// Applies what the entry changes of a transaction told their
    /// destinations (`touched`) to their flows, under their row locks, and
    /// returns whether a destination may have become claimable sooner: a
    /// slot freed below its cap, its circuit closed or a probe ended, or an
    /// entry of a sequence became claimable. Then the server's
    /// notification goes out at commit too, to every process.
    pub(super) async fn settle_flows(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        touched: &Touched,
    ) -> Result<bool> {
        let mut by_dest: BTreeMap<&str, Vec<FlowEvent>> = BTreeMap::new();
        for (d, e) in &touched.events {
            by_dest.entry(d.as_str()).or_default().push(*e);
        }
        let mut sooner = touched.promoted;
        if !by_dest.is_empty() {
            let held: Vec<String> = by_dest
                .iter()
                .filter(|(_, es)| es.iter().any(|e| matches!(e, FlowEvent::Hold(_))))
                .map(|(d, _)| (*d).to_owned())
                .collect();
            self.ensure_flows(db, &held).await?;
            let dests: Vec<String> = by_dest.keys().map(|d| (*d).to_owned()).collect();
            let mut rows = self.lock_settled_flows(db, &dests, &held).await?;
            let capped: Vec<&str> = rows
                .iter()
                .filter(|(_, r)| r.flow.policy.max_in_flight.is_some())
                .map(|(d, _)| d.as_str())
                .collect();
            let in_flight = self.count_in_flight(db, &capped).await?;
            let mut changed = Vec::new();
            for (dest, stored) in &mut rows {
                let Some(events) = by_dest.get(dest.as_str()) else {
                    continue;
                };
                let left = events
                    .iter()
                    .filter(|e| matches!(e, FlowEvent::Settled { .. }))
                    .count() as u64;
                let now_in_flight = in_flight.get(dest).copied().unwrap_or(0);
                let before = stored.clone();
                let mut before_flow = before.flow.clone();
                before_flow.in_flight = now_in_flight + left;
                for e in events {
                    match *e {
                        FlowEvent::Settled { id, signal, at } => {
                            stored.flow.settled(id, signal, at);
                        }
                        FlowEvent::Hold(until) => stored.flow.hold(until),
                    }
                }
                let mut after_flow = stored.flow.clone();
                after_flow.in_flight = now_in_flight;
                sooner |= match (before_flow.open_from(), after_flow.open_from()) {
                    (None, Some(_)) => true,
                    (Some(b), Some(a)) => a < b,
                    (_, None) => false,
                };
                if *stored != before {
                    changed.push(dest.clone());
                }
            }
            let writes: Vec<(&str, &Stored)> = changed
                .iter()
                .filter_map(|d| Some((d.as_str(), rows.get(d)?)))
                .collect();
            self.write_flows(db, &writes).await?;
        }
        if sooner {
            db.execute(
                "SELECT pg_notify($1, '')",
                &[&crate::postgres::schema::channel(self.s())],
            )
            .await?;
        }
        Ok(sooner)
    }
}
