//! The `# HELP` text and unit of every metric the store reports, given to
//! the recorder by [`describe_metrics`](super::describe_metrics). One
//! entry per name the crate docs' "Observability" section lists; a metric
//! added there is described here.

pub(super) fn all() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "idemstore_commits_total",
        Unit::Count,
        "Write transactions committed, by durability (durable: fsynced batches; not durable: the caller's own transactions, made durable by the next batch)."
    );
    describe_histogram!(
        "idemstore_commit_seconds",
        Unit::Seconds,
        "Time of each commit, the fsync included for a durable one."
    );
    describe_histogram!(
        "idemstore_batch_ops",
        Unit::Count,
        "Store operations per batch commit (group commit: above 1 under load)."
    );
    describe_counter!(
        "idemstore_inbox_claims_total",
        Unit::Count,
        "First deliveries claimed, by inbox (counted once their transaction commits)."
    );
    describe_counter!(
        "idemstore_inbox_duplicates_total",
        Unit::Count,
        "Deliveries found claimed already, by inbox (their effect did not run)."
    );
    describe_counter!(
        "idemstore_idempotency_begins_total",
        Unit::Count,
        "Answers of idempotency-key begin, by outcome: proceed, takeover (a reservation whose lease ended), replay, in_flight (HTTP 409), mismatch (HTTP 422)."
    );
    describe_counter!(
        "idemstore_idempotency_completions_total",
        Unit::Count,
        "Idempotency-key completions, by outcome: stored, or fenced_out (the reservation had been taken over: raise the lease if these grow). A repeated completion of a stored response counts nothing."
    );
    describe_gauge!(
        "idemstore_outbox_entries",
        Unit::Count,
        "Outbox entries in each status (on PostgreSQL: every process's, refreshed at most every few seconds)."
    );
    describe_counter!(
        "idemstore_dispatch_outcomes_total",
        Unit::Count,
        "How dispatchers settled each attempt, by outcome: delivered, retried, failed, outcome_unknown, returned (given back unsent at shutdown); and by destination (the first 64 distinct destinations a process reports; every later one is _other)."
    );
    describe_histogram!(
        "idemstore_dispatch_send_seconds",
        Unit::Seconds,
        "How long each dispatcher send took, by outcome and destination (the first 64 distinct destinations a process reports; every later one is _other)."
    );
    describe_gauge!(
        "idemstore_dispatch_in_flight",
        Unit::Count,
        "Sends in flight now, by destination (the first 64 distinct destinations a process reports; every later one is _other), summed over the process's dispatchers."
    );
    describe_histogram!(
        "idemstore_dispatch_latency_seconds",
        Unit::Seconds,
        "Time from an entry's enqueue to the start of its first send, for entries due at once."
    );
    describe_counter!(
        "idemstore_dispatch_fenced_total",
        Unit::Count,
        "Settlements refused because the claim had expired and the entry moved on (raise the lease above the slowest batch of sends)."
    );
    describe_counter!(
        "idemstore_dispatch_panics_total",
        Unit::Count,
        "Sends that panicked (retried as failures with reason panic)."
    );
    describe_counter!(
        "idemstore_reaper_released_total",
        Unit::Count,
        "Expired claims the reaper released (a dispatcher died, or its sends outlasted the lease)."
    );
    describe_counter!(
        "idemstore_janitor_removed_total",
        Unit::Count,
        "Rows removed by janitor runs, by what: outbox, inbox, keys."
    );
    describe_counter!(
        "idemstore_errors_total",
        Unit::Count,
        "Errors the store and its runtimes reported, by where they happened (during)."
    );
}
