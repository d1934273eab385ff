//! The outbox's depth by status, for the `idemstore_outbox_entries` gauge
//! (feature `metrics`): every operation that writes the outbox ends in
//! [`Tables::finish`](super::index::Tables::finish), which hands the count
//! table, as the operation leaves it, to [`report_after_commit`].

use redb::ReadableTable;

use super::OutboxStatus;
use crate::engine::after_commit;
use crate::error::Result;
use crate::observe::{self, OutboxDepth};

/// Reports the count of every status in `counts` once the transaction
/// commits, and never if it rolls back. Without the `metrics` feature it
/// does nothing; with it, it reads five rows of a small table the
/// operation has just written. A count that cannot be read reports
/// nothing: a metric never fails a write.
pub(super) fn report_after_commit(counts: &impl ReadableTable<u8, u64>) {
    if !observe::METRICS {
        return;
    }
    if let Ok(depth) = read(counts) {
        after_commit(move || observe::outbox_depth(&depth));
    }
}

fn read(counts: &impl ReadableTable<u8, u64>) -> Result<OutboxDepth> {
    let counts = super::index::counts_in(counts)?;
    let count = |status: OutboxStatus| counts.get(&status.code()).copied().unwrap_or(0);
    Ok(OutboxDepth::new(
        count(OutboxStatus::Pending),
        count(OutboxStatus::Dispatching),
        count(OutboxStatus::Completed),
        count(OutboxStatus::Failed),
        count(OutboxStatus::OutcomeUnknown),
    ))
}
