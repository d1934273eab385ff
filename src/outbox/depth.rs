//! The outbox's depth by status, for the `idemstore_outbox_entries` gauge
//! (feature `metrics`): every operation that writes the outbox ends in
//! [`Flows::finish`](super::flow::Flows::finish), which hands the counts,
//! as the operation leaves them, to [`report_after_commit`].

use super::OutboxStatus;
use crate::engine::after_commit;
use crate::observe::{self, OutboxDepth};

/// Reports `counts` (by status code) once the transaction commits, and
/// never if it rolls back. Without the `metrics` feature it does nothing.
pub(super) fn report_after_commit(counts: [u64; 5]) {
    if !observe::METRICS {
        return;
    }
    let count = |status: OutboxStatus| counts.get(usize::from(status.code())).copied().unwrap_or(0);
    let depth = OutboxDepth::new(
        count(OutboxStatus::Pending),
        count(OutboxStatus::Dispatching),
        count(OutboxStatus::Completed),
        count(OutboxStatus::Failed),
        count(OutboxStatus::OutcomeUnknown),
    );
    after_commit(move || observe::outbox_depth(&depth));
}
