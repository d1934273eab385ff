//! [`PgOutbox`]'s destination calls: an operator's (or a program's)
//! policy, pause and resume, and the report of every destination, with
//! the same answers as the embedded store's. Each change is one
//! transaction on the destination's row, under its lock, seen by every
//! dispatcher and process from then on.

use std::collections::BTreeMap;

use tokio_postgres::GenericClient;

use super::flows::{DESTINATIONS, FLOW_COLS, Stored, read_flow};
use super::{PgOutbox, parse_status};
use crate::codec::from_micros;
use crate::error::Result;
use crate::outbox::destinations::{DestinationPolicy, DestinationState, Flow, check_destination};
use crate::outbox::{OutboxCounts, OutboxStatus};
use crate::postgres::blocking::wait;
use crate::postgres::conn::{Db, Mode, in_transaction};
use crate::postgres::errors::{corrupted, utf8};
use crate::postgres::{refuse_reentrant, run, schema};

impl PgOutbox {
    /// Sets `destination`'s policy (replacing the one before; the default
    /// policy removes every limit). Takes effect at the next claim of every
    /// dispatcher on the store, in any process. A new rate limit starts
    /// with a full bucket; a policy without a circuit breaker closes the
    /// circuit. A bad setting is
    /// [`Error::InvalidInput`](crate::Error::InvalidInput) and changes
    /// nothing.
    pub fn set_destination_policy(
        &self,
        destination: &str,
        policy: DestinationPolicy,
    ) -> Result<()> {
        wait(self.set_destination_policy_async(destination, policy))
    }

    /// [`PgOutbox::set_destination_policy`], awaited.
    pub async fn set_destination_policy_async(
        &self,
        destination: &str,
        policy: DestinationPolicy,
    ) -> Result<()> {
        check_destination(destination)?;
        policy.check()?;
        let parts = policy.to_parts();
        self.flow_change(destination, |flow| flow.set_policy(parts))
            .await
    }

    /// Pauses `destination`: none of its entries is claimed until
    /// [`resume_destination`](PgOutbox::resume_destination) (the ones in
    /// flight finish). Seen by every process on the store; pausing a
    /// paused destination changes nothing. A destination need not have
    /// entries yet.
    pub fn pause_destination(&self, destination: &str) -> Result<()> {
        wait(self.pause_destination_async(destination))
    }

    /// [`PgOutbox::pause_destination`], awaited.
    pub async fn pause_destination_async(&self, destination: &str) -> Result<()> {
        check_destination(destination)?;
        self.flow_change(destination, |flow| flow.paused = true)
            .await
    }

    /// Lets a paused `destination`'s entries be claimed again.
    pub fn resume_destination(&self, destination: &str) -> Result<()> {
        wait(self.resume_destination_async(destination))
    }

    /// [`PgOutbox::resume_destination`], awaited.
    pub async fn resume_destination_async(&self, destination: &str) -> Result<()> {
        check_destination(destination)?;
        self.flow_change(destination, |flow| flow.paused = false)
            .await
    }

    /// Every destination with an entry, a policy or a pause, by name: its
    /// policy, pause, circuit, hold, tokens, entries in flight and entries
    /// by status. Counts the entries (one `GROUP BY`): for monitoring at a
    /// modest rate.
    pub fn destinations(&self) -> Result<Vec<DestinationState>> {
        wait(self.destinations_async())
    }

    /// [`PgOutbox::destinations`], awaited.
    pub async fn destinations_async(&self) -> Result<Vec<DestinationState>> {
        self.states(None).await
    }

    /// The destinations whose policy sets a
    /// [`weight`](DestinationPolicy::weight), with it: what a dispatcher
    /// shares its workers out by.
    pub(crate) fn weights(&self) -> Result<Vec<(String, u32)>> {
        wait(self.weights_async())
    }

    /// [`PgOutbox::weights`], awaited.
    pub(crate) async fn weights_async(&self) -> Result<Vec<(String, u32)>> {
        let sql = format!(
            "SELECT destination, weight FROM {}.destinations WHERE weight IS NOT NULL",
            self.s()
        );
        let rows = run!(self.server, Mode::Read, |conn| conn
            .db()
            .query(&sql, &[])
            .await)?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            let dest = utf8(DESTINATIONS, &"weights", r.try_get(0)?)?;
            let weight: i64 = r.try_get(1)?;
            match u32::try_from(weight) {
                Ok(w) if w > 0 => out.push((dest, w)),
                _ => return Err(corrupted(DESTINATIONS, &dest, "a weight out of range")),
            }
        }
        Ok(out)
    }

    /// [`PgOutbox::weights`], boxed for the backend trait.
    #[cfg(feature = "tokio")]
    pub(crate) fn weights_boxed(
        &self,
    ) -> crate::backend::BoxFuture<'_, Result<Vec<(String, u32)>>> {
        Box::pin(self.weights_async())
    }

    /// The states of every destination, or of `only` that one.
    async fn states(&self, only: Option<&str>) -> Result<Vec<DestinationState>> {
        let s = self.s();
        let only: Option<&[u8]> = only.map(str::as_bytes);
        let flows_sql = format!(
            "SELECT destination, {FLOW_COLS} FROM {s}.destinations \
             WHERE $1::bytea IS NULL OR destination = $1"
        );
        let counts_sql = format!(
            "SELECT destination, status, count(*) FROM {s}.outbox \
             WHERE $1::bytea IS NULL OR destination = $1 GROUP BY destination, status"
        );
        // One snapshot for both: a repeatable-read transaction.
        let (flows, counts) = run!(self.server, Mode::Read, |conn| {
            let tx = conn
                .client
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .await?;
            let flows = tx.query(&flows_sql, &[&only]).await?;
            let counts = tx.query(&counts_sql, &[&only]).await?;
            tx.commit().await?;
            Ok((flows, counts))
        })?;
        let mut by_name: BTreeMap<Vec<u8>, (Option<Stored>, [u64; 5])> = BTreeMap::new();
        for r in &flows {
            let name: Vec<u8> = r.try_get(0)?;
            let dest = utf8(DESTINATIONS, &"?", name.clone())?;
            let stored = read_flow(r, 1, &dest)?;
            by_name.entry(name).or_default().0 = Some(stored);
        }
        for r in &counts {
            let name: Vec<u8> = r.try_get(0)?;
            let status = parse_status(0, r.try_get(1)?)?;
            let n: i64 = r.try_get(2)?;
            if let Some(slot) = by_name
                .entry(name)
                .or_default()
                .1
                .get_mut(usize::from(status.code()))
            {
                *slot = u64::try_from(n).unwrap_or(0);
            }
        }
        let mut out = Vec::with_capacity(by_name.len());
        for (name, (stored, counts)) in by_name {
            let stored = stored.unwrap_or_default();
            if counts.iter().all(|&n| n == 0) && stored.is_idle() {
                continue;
            }
            let dest = utf8(DESTINATIONS, &"?", name)?;
            let mut flow: Flow = stored.flow;
            flow.in_flight = count_of(&counts, OutboxStatus::Dispatching);
            let counts = OutboxCounts::from_fn(|st| count_of(&counts, st));
            out.push(flow.to_state(&dest, counts, |us| from_micros(DESTINATIONS, &dest, us))?);
        }
        Ok(out)
    }

    /// The state of `destination` as [`PgOutbox::destinations`] reports it
    /// (a destination the store has nothing of is reported without limits
    /// or entries).
    pub fn destination(&self, destination: &str) -> Result<DestinationState> {
        wait(self.destination_async(destination))
    }

    /// [`PgOutbox::destination`], awaited.
    pub async fn destination_async(&self, destination: &str) -> Result<DestinationState> {
        check_destination(destination)?;
        let found = self.states(Some(destination)).await?.into_iter().next();
        Ok(found.unwrap_or_else(|| DestinationState::empty(destination)))
    }

    /// Applies `change` to `destination`'s flow in one transaction, under
    /// its row lock, and wakes the dispatchers (of every process) if it
    /// became claimable sooner. A row left holding nothing, of a
    /// destination without entries, is deleted.
    async fn flow_change(
        &self,
        destination: &str,
        change: impl Fn(&mut Flow) + Send + Sync,
    ) -> Result<()> {
        refuse_reentrant()?;
        let sooner = run!(self.server, Mode::Tx, |conn| {
            in_transaction!(conn, |db| {
                self.flow_change_in(db, destination, &change).await
            })
        })?;
        if sooner {
            self.notify();
        }
        Ok(())
    }

    async fn flow_change_in(
        &self,
        db: &mut Db<'_, impl GenericClient + Sync>,
        destination: &str,
        change: &(impl Fn(&mut Flow) + Sync),
    ) -> Result<bool> {
        let name = [destination.to_owned()];
        self.ensure_flows(db, &name).await?;
        let mut rows = self.lock_flows(db, &name, false).await?;
        let Some(stored) = rows.get_mut(destination) else {
            return Ok(false);
        };
        if stored.flow.policy.max_in_flight.is_some() {
            stored.flow.in_flight = self
                .count_in_flight(db, &[destination])
                .await?
                .get(destination)
                .copied()
                .unwrap_or(0);
        }
        let before = stored.clone();
        change(&mut stored.flow);
        let sooner = match (before.flow.open_from(), stored.flow.open_from()) {
            (None, Some(_)) => true,
            (Some(b), Some(a)) => a < b,
            (_, None) => false,
        };
        self.write_flow(db, destination, stored).await?;
        if stored.is_idle() {
            self.drop_idle_flows(db, &[destination.as_bytes()]).await?;
        }
        if sooner {
            db.execute("SELECT pg_notify($1, '')", &[&schema::channel(self.s())])
                .await?;
        }
        Ok(sooner)
    }
}

/// The count of status `st` in a table of counts by status code.
fn count_of(counts: &[u64; 5], st: OutboxStatus) -> u64 {
    counts.get(usize::from(st.code())).copied().unwrap_or(0)
}
