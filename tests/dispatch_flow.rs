//! The dispatcher and the flow control of destinations: a throttled send
//! holds its whole destination until the time the remote asked for, and
//! an idle dispatcher with a rate limit sleeps until the next token.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{eventually, t};
use idemstore::{
    Clock as _, Delivery, DestinationPolicy, Dispatcher, ManualClock, NewEntry, OutboxId,
    OutboxStatus, REASON_MAX_ATTEMPTS, Result, RetryPolicy, Store,
};
use parking_lot::Mutex;

fn entry_to(destination: &str, i: usize) -> NewEntry {
    NewEntry::new(
        format!("cmd-{i}"),
        destination,
        format!("key-{i}"),
        format!("{i}").into_bytes(),
    )
}

/// The entry's status and attempts.
fn state(outbox: &idemstore::Outbox, id: OutboxId) -> Option<(OutboxStatus, u32)> {
    let record = outbox.get(id).ok()?;
    Some((record.entry.status, record.entry.attempt_count))
}

#[test]
fn a_throttled_send_holds_its_whole_destination_until_the_time_asked_for() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let clock = ManualClock::new(t(0));
    let first = outbox.enqueue(entry_to("remote", 1), t(0))?.id();
    let second = outbox.enqueue(entry_to("remote", 2), t(0))?.id();
    let sends = Arc::new(Mutex::new(Vec::new()));
    let (seen, c) = (sends.clone(), clock.clone());
    let handle = Dispatcher::builder(outbox.clone())
        .clock(clock.clone())
        .workers(1)
        .batch_size(1)
        .start(move |e| {
            seen.lock().push((e.id, c.now()));
            if e.id == first && e.attempt_count == 1 {
                Delivery::Throttled {
                    next_attempt_at: t(30),
                    reason: "http_429".into(),
                }
            } else {
                Delivery::Delivered
            }
        })?;
    // The throttled attempt is settled in the same commit as the next
    // claim, which took nothing: the destination is held.
    eventually("the first entry is throttled", || {
        state(&outbox, first) == Some((OutboxStatus::Pending, 1))
    });
    assert_eq!(state(&outbox, second), Some((OutboxStatus::Pending, 0)));
    let record = outbox.get(first)?;
    assert_eq!(record.entry.next_attempt_at, Some(t(30)));
    assert_eq!(record.last_failure.as_deref(), Some("http_429"));
    assert_eq!(outbox.destination("remote")?.held_until, Some(t(30)));
    // Ten seconds on, another destination's entry goes out; the claim
    // made with its settlement still leaves the held one alone.
    clock.set(t(10));
    let other = outbox.enqueue(entry_to("other", 3), t(10))?.id();
    eventually("the other destination's entry is delivered", || {
        state(&outbox, other) == Some((OutboxStatus::Completed, 1))
    });
    assert_eq!(state(&outbox, second), Some((OutboxStatus::Pending, 0)));
    // At the time asked for, both go.
    clock.set(t(30));
    for id in [first, second] {
        eventually("the held entries are delivered", || {
            state(&outbox, id).is_some_and(|(s, _)| s == OutboxStatus::Completed)
        });
    }
    let stats = handle.stats();
    handle.shutdown()?;
    assert_eq!((stats.retried, stats.delivered), (1, 3));
    let sends = sends.lock().clone();
    assert_eq!(
        sends,
        [
            (first, t(0)),
            (other, t(10)),
            // Within a destination, the earliest due goes first.
            (second, t(30)),
            (first, t(30)),
        ]
    );
    Ok(())
}

#[test]
fn a_throttled_send_out_of_attempts_fails_for_good_and_holds_nothing() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let clock = ManualClock::new(t(0));
    let first = outbox.enqueue(entry_to("remote", 1), t(0))?.id();
    let second = outbox.enqueue(entry_to("remote", 2), t(0))?.id();
    let handle = Dispatcher::builder(outbox.clone())
        .clock(clock)
        .workers(1)
        .batch_size(1)
        .retry(RetryPolicy::default().max_attempts(1))
        .start(move |e| {
            if e.id == first {
                Delivery::Throttled {
                    next_attempt_at: t(30),
                    reason: "http_429".into(),
                }
            } else {
                Delivery::Delivered
            }
        })?;
    eventually("the second entry is delivered at once", || {
        state(&outbox, second) == Some((OutboxStatus::Completed, 1))
    });
    handle.shutdown()?;
    let record = outbox.get(first)?;
    assert_eq!(record.entry.status, OutboxStatus::Failed);
    assert_eq!(record.last_failure.as_deref(), Some(REASON_MAX_ATTEMPTS));
    assert_eq!(outbox.destination("remote")?.held_until, None);
    Ok(())
}

/// The store's commits so far: each claim is one.
fn commits(store: &Store) -> u64 {
    store.commit_stats().commits
}

/// How long an idle dispatcher is watched for claims it should not make.
const WATCH: Duration = Duration::from_millis(500);

#[test]
fn an_idle_worker_with_a_rate_limit_sleeps_until_the_next_token() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    // One token every 10 s, one at once.
    outbox.set_destination_policy("remote", DestinationPolicy::default().rate_limit(0.1, 1))?;
    let clock = ManualClock::new(t(0));
    let first = outbox.enqueue(entry_to("remote", 1), t(0))?.id();
    let second = outbox.enqueue(entry_to("remote", 2), t(0))?.id();
    let sends = Arc::new(Mutex::new(Vec::new()));
    let (seen, c) = (sends.clone(), clock.clone());
    let handle = Dispatcher::builder(outbox.clone())
        .clock(clock.clone())
        .workers(1)
        .start(move |e| {
            seen.lock().push((e.id, c.now()));
            Delivery::Delivered
        })?;
    eventually("the first entry is delivered", || {
        state(&outbox, first) == Some((OutboxStatus::Completed, 1))
    });
    // Its settlement and the claim that found no token were one commit;
    // from then on the worker waits for t(10) without claiming.
    assert_eq!(outbox.next_due()?, Some(t(10)));
    let idle = commits(&store);
    std::thread::sleep(WATCH);
    assert_eq!(commits(&store), idle, "an idle worker claimed");
    assert_eq!(state(&outbox, second), Some((OutboxStatus::Pending, 0)));
    clock.set(t(10));
    eventually("the second entry is delivered", || {
        state(&outbox, second) == Some((OutboxStatus::Completed, 1))
    });
    handle.shutdown()?;
    assert_eq!(*sends.lock(), [(first, t(0)), (second, t(10))]);
    Ok(())
}

#[cfg(feature = "tokio")]
#[test]
fn an_idle_async_dispatcher_with_a_rate_limit_sleeps_until_the_next_token() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(idemstore::Error::Io)?;
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    outbox.set_destination_policy("remote", DestinationPolicy::default().rate_limit(0.1, 1))?;
    let clock = ManualClock::new(t(0));
    let first = outbox.enqueue(entry_to("remote", 1), t(0))?.id();
    let second = outbox.enqueue(entry_to("remote", 2), t(0))?.id();
    let sends = Arc::new(Mutex::new(Vec::new()));
    let (seen, c) = (sends.clone(), clock.clone());
    runtime.block_on(async {
        let handle = Dispatcher::builder(outbox.clone())
            .clock(clock.clone())
            .workers(1)
            .start_async(move |e| {
                seen.lock().push((e.id, c.now()));
                async { Delivery::Delivered }
            })?;
        while state(&outbox, first) != Some((OutboxStatus::Completed, 1)) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // The claimer commits the settlement and claims again in one
        // commit, which finds no token; then it waits for t(10).
        let idle = commits(&store);
        tokio::time::sleep(WATCH).await;
        assert_eq!(commits(&store), idle, "an idle claimer claimed");
        assert_eq!(state(&outbox, second), Some((OutboxStatus::Pending, 0)));
        clock.set(t(10));
        while state(&outbox, second) != Some((OutboxStatus::Completed, 1)) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        handle.shutdown().await
    })?;
    assert_eq!(*sends.lock(), [(first, t(0)), (second, t(10))]);
    Ok(())
}
