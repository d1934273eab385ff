//! The embedded outbox's destination calls: an operator's (or a
//! program's) policy, pause and resume, and the report of every
//! destination. Each change is one commit, seen by every dispatcher and
//! process on the file from then on; the rules are in `destinations.rs`,
//! the tables in `flow.rs`.

use redb::{TableHandle as _, WriteTransaction};

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
        check_destination(destination)?;
        policy.check()?;
        let destination = destination.to_owned();
        let parts = policy.to_parts();
        self.flow_change(move |flows| {
            flows.rec(&destination)?.flow.set_policy(parts);
            Ok(())
        })
    }

    /// Pauses `destination`: none of its entries is claimed until
    /// [`resume_destination`](Outbox::resume_destination) (the ones in
    /// flight finish). Durable and seen by every process on the file;
    /// pausing a paused destination changes nothing. A destination need not
    /// have entries yet.
    pub fn pause_destination(&self, destination: &str) -> Result<()> {
        self.set_paused(destination, true)
    }

    /// Lets a paused `destination`'s entries be claimed again.
    pub fn resume_destination(&self, destination: &str) -> Result<()> {
        self.set_paused(destination, false)
    }

    /// Every destination with an entry, a policy or a pause, by name: its
    /// policy, pause, circuit, hold, tokens, entries in flight and entries
    /// by status.
    pub fn destinations(&self) -> Result<Vec<DestinationState>> {
        self.engine.read(|tx| {
            flow::read_all(tx)?
                .into_iter()
                .map(|(name, rec)| state_of(&name, &rec))
                .collect()
        })
    }

    /// The state of `destination` as [`Outbox::destinations`] reports it
    /// (a destination the store has nothing of is reported without limits
    /// or entries). Reads its one flow record.
    pub fn destination(&self, destination: &str) -> Result<DestinationState> {
        check_destination(destination)?;
        self.engine
            .read(|tx| match flow::read_one(tx, destination)? {
                Some(rec) => state_of(destination, &rec),
                None => Ok(DestinationState::empty(destination)),
            })
    }

    fn set_paused(&self, destination: &str, paused: bool) -> Result<()> {
        check_destination(destination)?;
        let destination = destination.to_owned();
        self.flow_change(move |flows| {
            flows.rec(&destination)?.flow.paused = paused;
            Ok(())
        })
    }

    /// Applies `change` to the destinations' tables in one commit, and wakes
    /// the dispatchers if a destination became claimable sooner.
    fn flow_change(
        &self,
        change: impl Fn(&mut Flows<'_>) -> Result<()> + Send + 'static,
    ) -> Result<()> {
        let sooner = self.engine.execute(move |tx: &WriteTransaction| {
            let mut flows = Flows::open(tx)?;
            change(&mut flows)?;
            flows.finish()
        })?;
        if sooner {
            self.notify();
        }
        Ok(())
    }
}

/// The public view of `destination`'s flow record.
fn state_of(destination: &str, rec: &DestRec) -> Result<DestinationState> {
    rec.flow.to_state(destination, rec.counts(), |us| {
        from_micros(OUTBOX_FLOWS.name(), &destination, us)
    })
}
