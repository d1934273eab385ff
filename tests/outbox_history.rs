//! The attempt history of outbox entries: what each settlement records,
//! the bound of `MAX_ATTEMPT_HISTORY`, an entry the dispatcher gave up on
//! keeping every attempt's own reason, purges, files without a history,
//! and damaged or orphaned history rows.

mod common;

use std::time::Duration;

use common::{eventually, t};
use idemstore::chrono::{DateTime, Utc};
use idemstore::redb::{ReadableTable as _, TableDefinition};
use idemstore::{
    AttemptRecord, Delivery, Dispatcher, Error, Fence, MAX_ATTEMPT_HISTORY, MAX_OUTBOX_FIELD_LEN,
    ManualClock, NewEntry, Outbox, OutboxFilter, OutboxId, OutboxStatus, REASON_CANCELLED,
    REASON_MAX_ATTEMPTS, REASON_OUTCOME_UNKNOWN, REASON_RESCHEDULED, Result, RetryPolicy,
    Settlement, Store,
};

/// The history table, with the key and value types of `src/schema.rs`.
const ATTEMPTS: TableDefinition<(u64, u64), &[u8]> =
    TableDefinition::new("idemstore.v1.outbox.attempts");

/// Waits (yielding) until `cond` holds; the dispatcher runs on its own
/// threads, so its effects are observed, not awaited.
fn attempt(attempt: u32, at: i64, reason: &str) -> Attempt {
    (attempt, t(at), reason.to_owned(), None)
}

/// An attempt record's attempt, time, reason and remote reference: what
/// the tests compare of an [`AttemptRecord`], which only the store builds.
type Attempt = (u32, DateTime<Utc>, String, Option<String>);

/// The history of a record, as [`Attempt`]s.
fn history(records: &[AttemptRecord]) -> Vec<Attempt> {
    records
        .iter()
        .map(|a| (a.attempt, a.at, a.reason.clone(), a.remote_ref.clone()))
        .collect()
}

fn enqueue(outbox: &Outbox, key: &str) -> Result<OutboxId> {
    Ok(outbox
        .enqueue(NewEntry::new("cmd", "dest", key, b"p".to_vec()), t(0))?
        .id())
}

/// Claims the one due entry at `now` and returns its fence.
fn claim(outbox: &Outbox, now: i64) -> Result<Fence> {
    let claimed = outbox.claim_due(t(now), 1, "worker")?;
    assert_eq!(claimed.len(), 1, "one entry due at {now}");
    Ok(claimed[0].fence())
}

/// The keys of the history rows, as stored.
fn history_rows(store: &Store) -> Result<Vec<(u64, u64)>> {
    store.read(|tx| match tx.open_table(ATTEMPTS) {
        Ok(table) => table
            .iter()?
            .map(|row| row.map(|(k, _)| k.value()).map_err(Error::from))
            .collect(),
        Err(idemstore::redb::TableError::TableDoesNotExist(_)) => Ok(Vec::new()),
        Err(e) => Err(e.into()),
    })
}

#[test]
fn each_settlement_that_does_not_complete_records_its_attempt() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let id = enqueue(&outbox, "k")?;
    assert_eq!(history(&outbox.get(id)?.attempts), Vec::new());

    let fence = claim(&outbox, 10)?;
    let retry = Settlement::Failed {
        reason: "http_503".into(),
        next_attempt_at: Some(t(20)),
    };
    outbox.settle(fence, retry, t(11))?;
    let fence = claim(&outbox, 20)?;
    let back = Settlement::Rescheduled {
        next_attempt_at: t(30),
    };
    outbox.settle(fence, back, t(21))?;
    let fence = claim(&outbox, 30)?;
    let unknown = Settlement::OutcomeUnknown {
        remote_ref: Some("ref-9".into()),
    };
    outbox.settle(fence, unknown, t(31))?;
    // The attempt in doubt turns out to have failed: a record of its own.
    let failed = Settlement::Failed {
        reason: "http_404 (no such user)".into(),
        next_attempt_at: None,
    };
    outbox.settle(fence, failed.clone(), t(32))?;
    // Settling it again the same way is accepted and adds nothing.
    outbox.settle(fence, failed, t(33))?;

    let want = vec![
        attempt(1, 11, "http_503"),
        attempt(2, 21, REASON_RESCHEDULED),
        (
            3,
            t(31),
            REASON_OUTCOME_UNKNOWN.to_owned(),
            Some("ref-9".into()),
        ),
        attempt(3, 32, "http_404 (no such user)"),
    ];
    let rec = outbox.get(id)?;
    assert_eq!(history(&rec.attempts), want);
    // `last_failure` keeps the code, the history the whole reason.
    assert_eq!(rec.last_failure.as_deref(), Some("http_404"));
    assert_eq!(rec.entry.status, OutboxStatus::Failed);
    // Every reader shows the same history.
    assert_eq!(
        outbox.find("dest", "k")?.map(|r| history(&r.attempts)),
        Some(want.clone())
    );
    assert_eq!(history(&outbox.list_for_command("cmd")?[0].attempts), want);
    assert_eq!(
        history(&outbox.list(&OutboxFilter::any(), 10)?[0].attempts),
        want
    );
    // A completion, a claim and a requeue record nothing.
    outbox.requeue(id, t(40))?;
    let fence = claim(&outbox, 40)?;
    outbox.settle(fence, Settlement::Completed, t(41))?;
    assert_eq!(history(&outbox.get(id)?.attempts), want);
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    Ok(())
}

#[test]
fn operator_calls_record_failures_and_cancels_but_not_the_calls_without_a_time() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let id = enqueue(&outbox, "k")?;
    claim(&outbox, 10)?;
    // No time given: nothing to date a record with.
    outbox.mark_outcome_unknown(id, Some("ref-1"))?;
    outbox.reschedule(id, t(20))?;
    assert_eq!(history(&outbox.get(id)?.attempts), Vec::new());
    // A failure marked on a pending entry is recorded at its attempt count.
    outbox.mark_failed(id, "rate_limited (slow down)", Some(t(30)), t(25))?;
    outbox.cancel(id, t(26))?;
    let rec = outbox.get(id)?;
    assert_eq!(
        history(&rec.attempts),
        vec![
            attempt(1, 25, "rate_limited (slow down)"),
            attempt(1, 26, REASON_CANCELLED),
        ]
    );
    assert_eq!(rec.last_failure.as_deref(), Some(REASON_CANCELLED));
    Ok(())
}

#[test]
fn a_reason_is_a_code_with_an_optional_detail_in_parentheses() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let cases = [
        ("http_500", "http_500"),
        ("http_500 (upstream timed out)", "http_500"),
        ("max_attempts (http_500 (x))", "max_attempts"),
        ("(only a detail)", "(only a detail)"),
        (" (no code)", " (no code)"),
        ("a (b) c", "a (b) c"),
        ("a(b)", "a(b)"),
    ];
    for (i, (reason, code)) in cases.into_iter().enumerate() {
        let id = enqueue(&outbox, &format!("k{i}"))?;
        outbox.mark_failed(id, reason, Some(t(5)), t(1))?;
        let rec = outbox.get(id)?;
        assert_eq!(rec.last_failure.as_deref(), Some(code), "{reason:?}");
        assert_eq!(
            history(&rec.attempts),
            vec![attempt(0, 1, reason)],
            "{reason:?}"
        );
    }
    Ok(())
}

#[test]
fn the_history_keeps_the_last_attempts_only() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let id = enqueue(&outbox, "k")?;
    let other = enqueue(&outbox, "other")?;
    outbox.mark_failed(other, "http_429", Some(t(1_000_000)), t(1))?;
    let max = u32::try_from(MAX_ATTEMPT_HISTORY).unwrap();
    let total = max + 5;
    for n in 1..=total {
        let now = i64::from(n) * 10;
        let fence = claim(&outbox, now)?;
        assert_eq!(fence.attempt, n);
        let retry = Settlement::Failed {
            reason: format!("http_5{n:02}"),
            next_attempt_at: Some(t(now + 10)),
        };
        outbox.settle(fence, retry, t(now + 1))?;
    }
    let kept = history(&outbox.get(id)?.attempts);
    let first = total - max + 1;
    let want: Vec<Attempt> = (first..=total)
        .map(|n| attempt(n, i64::from(n) * 10 + 1, &format!("http_5{n:02}")))
        .collect();
    assert_eq!(kept, want, "the last {MAX_ATTEMPT_HISTORY}, oldest first");
    // As stored: exactly that many rows for the entry, the other's intact.
    let rows = history_rows(&store)?;
    assert_eq!(
        rows.iter().filter(|(e, _)| *e == id.0).count(),
        MAX_ATTEMPT_HISTORY
    );
    assert_eq!(
        history(&outbox.get(other)?.attempts),
        vec![attempt(0, 1, "http_429")]
    );
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    Ok(())
}

#[test]
fn a_purged_entry_takes_its_history_with_it() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let gone = enqueue(&outbox, "gone")?;
    let kept = enqueue(&outbox, "kept")?;
    for id in [gone, kept] {
        outbox.mark_failed(id, "http_503", Some(t(1)), t(1))?;
    }
    outbox.cancel(gone, t(2))?;
    assert_eq!(history_rows(&store)?.len(), 3);
    assert_eq!(outbox.purge_finished(t(3))?, 1);
    assert_eq!(history_rows(&store)?, vec![(kept.0, 0)]);
    assert_eq!(
        history(&outbox.get(kept)?.attempts),
        vec![attempt(0, 1, "http_503")]
    );
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    Ok(())
}

#[test]
fn a_dispatcher_that_runs_out_of_attempts_keeps_each_attempts_own_reason() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let clock = ManualClock::new(t(0));
    let id = enqueue(&outbox, "k")?;
    let policy = RetryPolicy::exponential(Duration::from_secs(1), Duration::from_secs(3))
        .max_attempts(4)
        .jitter(0.0);
    let reasons = ["http_503", "timeout", "http_503", "http_500"];
    let handle = Dispatcher::builder(outbox.clone())
        .clock(clock.clone())
        .retry(policy)
        .workers(1)
        .start(move |e| Delivery::Retry {
            reason: reasons[usize::try_from(e.attempt_count).unwrap() - 1].into(),
        })?;
    // Attempt n fails at time T; the next is due at T + min(2^(n-1), 3) s.
    let mut now = 0;
    for (n, delay) in [(1u32, 1i64), (2, 2), (3, 3)] {
        eventually("the retry is scheduled", || {
            outbox.get(id).is_ok_and(|r| {
                r.entry.status == OutboxStatus::Pending && r.entry.attempt_count == n
            })
        });
        now += delay;
        clock.set(t(now));
    }
    eventually("the last attempt fails for good", || {
        outbox
            .get(id)
            .is_ok_and(|r| r.entry.status == OutboxStatus::Failed)
    });
    handle.shutdown()?;
    let rec = outbox.get(id)?;
    assert_eq!(rec.last_failure.as_deref(), Some(REASON_MAX_ATTEMPTS));
    assert_eq!(
        history(&rec.attempts),
        vec![
            attempt(1, 0, "http_503"),
            attempt(2, 1, "timeout"),
            attempt(3, 3, "http_503"),
            attempt(4, 6, "max_attempts (http_500)"),
        ]
    );
    Ok(())
}

#[test]
fn an_exhausted_entrys_long_reason_is_cut_to_fit_with_its_code() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let clock = ManualClock::new(t(0));
    let id = enqueue(&outbox, "k")?;
    // Two-byte characters, so that the cut must find a character boundary.
    let long = "é".repeat(MAX_OUTBOX_FIELD_LEN);
    let sent = long.clone();
    let handle = Dispatcher::builder(outbox.clone())
        .clock(clock)
        .retry(RetryPolicy::default().max_attempts(1))
        .workers(1)
        .start(move |_| Delivery::Retry {
            reason: sent.clone(),
        })?;
    eventually("the only attempt fails for good", || {
        outbox
            .get(id)
            .is_ok_and(|r| r.entry.status == OutboxStatus::Failed)
    });
    handle.shutdown()?;
    let rec = outbox.get(id)?;
    assert_eq!(rec.last_failure.as_deref(), Some(REASON_MAX_ATTEMPTS));
    let reason = &rec.attempts[0].reason;
    assert!(
        reason.len() <= MAX_OUTBOX_FIELD_LEN,
        "{} bytes",
        reason.len()
    );
    assert!(
        reason.len() >= MAX_OUTBOX_FIELD_LEN - 1,
        "{} bytes",
        reason.len()
    );
    let detail = reason
        .strip_prefix("max_attempts (")
        .and_then(|r| r.strip_suffix(')'))
        .expect("the code, then the detail in parentheses");
    assert!(long.starts_with(detail));
    Ok(())
}

#[test]
fn a_file_without_a_history_reads_with_empty_histories() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.idem");
    let id = {
        let store = Store::open(&path)?;
        let outbox = store.outbox();
        let id = enqueue(&outbox, "k")?;
        outbox.mark_failed(id, "http_503", Some(t(5)), t(1))?;
        // What an earlier build leaves: the record, and no history table.
        store.write(|tx| {
            tx.delete_table(ATTEMPTS)?;
            Ok::<_, Error>(())
        })?;
        id
    };
    let store = Store::open(&path)?;
    let outbox = store.outbox();
    let rec = outbox.get(id)?;
    assert_eq!(history(&rec.attempts), Vec::new());
    assert_eq!(rec.last_failure.as_deref(), Some("http_503"));
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    // The history starts with the next attempt; purges work on the old file.
    let fence = claim(&outbox, 5)?;
    let failed = Settlement::Failed {
        reason: "http_400".into(),
        next_attempt_at: None,
    };
    outbox.settle(fence, failed, t(6))?;
    assert_eq!(
        history(&outbox.get(id)?.attempts),
        vec![attempt(1, 6, "http_400")]
    );
    assert_eq!(outbox.purge_finished(t(7))?, 1);
    assert_eq!(history_rows(&store)?, Vec::new());
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    Ok(())
}

#[test]
fn damaged_or_orphaned_history_rows_are_errors_and_findings_not_panics() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let id = enqueue(&outbox, "k")?;
    outbox.mark_failed(id, "http_503", Some(t(5)), t(1))?;
    store.write(|tx| {
        let mut table = tx.open_table(ATTEMPTS)?;
        table.insert((id.0, 0), b"\x01\xff\xff".as_slice())?;
        // An earlier build's purge of entry 99 would leave this behind.
        table.insert((99, 0), b"\x01\x01\x02\x02ok\x00".as_slice())?;
        Ok::<_, Error>(())
    })?;
    let err = outbox.get(id).unwrap_err();
    assert!(
        matches!(&err, Error::Corrupted { table, key, .. }
            if *table == "idemstore.v1.outbox.attempts" && key == "1/0"),
        "{err:?}"
    );
    let findings = outbox.check_indexes()?;
    assert_eq!(findings.len(), 2, "{findings:?}");
    assert!(findings[0].contains("attempt record 1/0"), "{findings:?}");
    assert!(
        findings[1].contains("99/0 has no outbox record"),
        "{findings:?}"
    );
    Ok(())
}
