//! [`ClaimRequest`]: what a claim asks of the outbox, on either backend —
//! how many entries, for which worker, and how to share them out among
//! destinations.

#[cfg(doc)]
use super::destinations::DestinationPolicy;
use super::destinations::check_destination;
use crate::error::Result;

/// How many ready destinations a one-destination claim looks at for one
/// that gives something (each ready one normally does).
pub(crate) const ONE_DESTINATION_LOOKS: usize = 8;

/// What a claim asks for: how many entries, for which worker, and how to
/// share them out among destinations.
///
/// By default a claim takes due entries across destinations in turn — one
/// from each claimable destination, the one served longest ago first, then
/// round again — so a destination with a big backlog never crowds out the
/// others. A dispatcher also says which destinations it already gives
/// its share of workers ([`avoid`](Self::avoid)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub struct ClaimRequest {
    pub(crate) limit: usize,
    pub(crate) worker_id: String,
    pub(crate) avoid: Vec<String>,
    pub(crate) one_destination: bool,
    pub(crate) limited: usize,
}

impl ClaimRequest {
    /// Up to `limit` entries for `worker_id`.
    pub fn new(limit: usize, worker_id: impl Into<String>) -> ClaimRequest {
        ClaimRequest {
            limit,
            worker_id: worker_id.into(),
            avoid: Vec::new(),
            one_destination: false,
            limited: usize::MAX,
        }
    }

    /// Takes entries of these destinations only if no other destination
    /// has any to give.
    pub fn avoid(mut self, destinations: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.avoid = destinations.into_iter().map(Into::into).collect();
        self
    }

    /// Takes all its entries from one destination (a worker that sends
    /// its batch in order, so that a slow destination delays only its own
    /// entries).
    pub fn one_destination(mut self) -> Self {
        self.one_destination = true;
        self
    }

    /// Takes at most `n` entries of each destination whose flow limits
    /// what a claim may take — a cap ([`DestinationPolicy::max_in_flight`]),
    /// a rate ([`DestinationPolicy::rate_limit`]) or a circuit's probe —
    /// however many it could take: the most sends of one destination the
    /// claiming worker can start at once. A worker that sends its batch one
    /// entry after the other asks for 1, so that a cap of N is N workers
    /// sending at once, not one worker holding N claims and sending them in
    /// turn. Destinations without a limit still give up to the whole
    /// [`limit`](Self::limit). Default: no bound.
    pub fn limited(mut self, n: usize) -> Self {
        self.limited = n;
        self
    }

    /// The most entries it takes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The worker it claims for.
    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    pub(crate) fn check(&self) -> Result<()> {
        super::check_field("worker_id", &self.worker_id)?;
        for d in &self.avoid {
            check_destination(d)?;
        }
        Ok(())
    }

    pub(crate) fn avoids(&self, destination: &str) -> bool {
        self.avoid.iter().any(|d| d == destination)
    }
}
