//! The embedded outbox's destination calls: an operator's (or a
//! program's) policy, pause and resume, and the report of every
//! destination. Each change is one commit, seen by every dispatcher and
//! process on the file from then on; the rules are in `destinations.rs`,
//! the tables in `flow.rs`.

use redb::{ReadTransaction, TableHandle as _, WriteTransaction};

use super::Outbox;
use super::destinations::{DestinationPolicy, DestinationState, check_destination};
use super::flow::{self, DestRec, Flows};
use crate::codec::from_micros;
use crate::error::Result;
use crate::schema::OUTBOX_FLOWS;

impl Outbox {
    /// Sets `destination`'s policy (replacing the one before; the default
    /// policy removes every limit). Takes effect at the next claim of every
    /// dispatcher on the store. A new rate limit starts with a full bucket;
    /// a policy without a circuit breaker closes the circuit. A bad setting
    /// is [`Error::InvalidInput`](crate::Error::InvalidInput) and changes
    /// nothing.
    pub fn set_destination_policy(
        &self,
        destination: &str,
        policy: DestinationPolicy,
    ) -> Result<()> {
        self.flow_change(policy_change(destination, policy)?)
    }

    /// Pauses `destination`: none of its entries is claimed until
    /// [`resume_destination`](Outbox::resume_destination) (the ones in
    /// flight finish). Durable and seen by every process on the file;
    /// pausing a paused destination changes nothing. A destination need not
    /// have entries yet.
    pub fn pause_destination(&self, destination: &str) -> Result<()> {
        self.flow_change(paused_change(destination, true)?)
    }

    /// Lets a paused `destination`'s entries be claimed again.
    pub fn resume_destination(&self, destination: &str) -> Result<()> {
        self.flow_change(paused_change(destination, false)?)
    }

    /// Every destination with an entry, a policy or a pause, by name: its
    /// policy, pause, circuit, hold, tokens, entries in flight and entries
    /// by status.
    pub fn destinations(&self) -> Result<Vec<DestinationState>> {
        self.engine.read(destinations_in)
    }

    /// The destinations whose policy sets a
    /// [`weight`](DestinationPolicy::weight), with it: what a dispatcher
    /// shares its workers out by.
    pub(crate) fn weights(&self) -> Result<Vec<(String, u32)>> {
        self.engine.read(weights_in)
    }

    /// The state of `destination` as [`Outbox::destinations`] reports it
    /// (a destination the store has nothing of is reported without limits
    /// or entries). Reads its one flow record.
    pub fn destination(&self, destination: &str) -> Result<DestinationState> {
        check_destination(destination)?;
        self.engine.read(|tx| destination_in(tx, destination))
    }

    /// Applies `change` to the destinations' tables in one commit, and wakes
    /// the dispatchers if a destination became claimable sooner.
    fn flow_change(&self, change: impl FlowChange) -> Result<()> {
        let sooner = self.engine.execute(flow_op(change))?;
        self.flow_changed(sooner);
        Ok(())
    }

    /// What a destination call answers once its change committed: the
    /// dispatchers woken if a destination became claimable `sooner`.
    pub(super) fn flow_changed(&self, sooner: bool) {
        if sooner {
            self.notify();
        }
    }
}

/// A change to the destinations' tables.
pub(super) trait FlowChange: Fn(&mut Flows<'_>) -> Result<()> + Send + 'static {}

impl<F: Fn(&mut Flows<'_>) -> Result<()> + Send + 'static> FlowChange for F {}

/// `set_destination_policy`'s checks, and its change.
pub(super) fn policy_change(
    destination: &str,
    policy: DestinationPolicy,
) -> Result<impl FlowChange> {
    check_destination(destination)?;
    policy.check()?;
    let destination = destination.to_owned();
    let parts = policy.to_parts();
    Ok(move |flows: &mut Flows<'_>| {
        flows.rec(&destination)?.flow.set_policy(parts);
        Ok(())
    })
}

/// `pause_destination`'s and `resume_destination`'s checks, and their
/// change.
pub(super) fn paused_change(destination: &str, paused: bool) -> Result<impl FlowChange> {
    check_destination(destination)?;
    let destination = destination.to_owned();
    Ok(move |flows: &mut Flows<'_>| {
        flows.rec(&destination)?.flow.paused = paused;
        Ok(())
    })
}

/// The operation applying `change` to the destinations' tables: whether a
/// destination became claimable sooner.
pub(super) fn flow_op(
    change: impl FlowChange,
) -> impl Fn(&WriteTransaction) -> Result<bool> + Send + 'static {
    move |tx: &WriteTransaction| {
        let mut flows = Flows::open(tx)?;
        change(&mut flows)?;
        flows.finish()
    }
}

/// [`Outbox::weights`] in `tx`.
pub(super) fn weights_in(tx: &ReadTransaction) -> Result<Vec<(String, u32)>> {
    Ok(destinations_in(tx)?
        .into_iter()
        .filter_map(|d| Some((d.destination, d.policy.limits().weight?)))
        .collect())
}

/// Every destination's state, as `tx` sees it.
pub(super) fn destinations_in(tx: &ReadTransaction) -> Result<Vec<DestinationState>> {
    flow::read_all(tx)?
        .into_iter()
        .map(|(name, rec)| state_of(&name, &rec))
        .collect()
}

/// `destination`'s state (checked), as `tx` sees it.
pub(super) fn destination_in(tx: &ReadTransaction, destination: &str) -> Result<DestinationState> {
    match flow::read_one(tx, destination)? {
        Some(rec) => state_of(destination, &rec),
        None => Ok(DestinationState::empty(destination)),
    }
}

/// The public view of `destination`'s flow record.
fn state_of(destination: &str, rec: &DestRec) -> Result<DestinationState> {
    rec.flow.to_state(destination, rec.counts(), |us| {
        from_micros(OUTBOX_FLOWS.name(), &destination, us)
    })
}
