//! The store's `_async` calls (feature `tokio`): 2,000 tasks on a
//! `current_thread` runtime claim with group commit while the runtime
//! keeps ticking; futures dropped at random points leave nothing half
//! done; threads and tasks share batches; and the outbox and the
//! idempotency keys answer through their async forms as they do through
//! the blocking ones.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idemstore::{
    Begin, ClaimRequest, DestinationPolicy, Enqueued, MatchingChange, NewEntry, OutboxFilter,
    OutboxStatus, Settlement, Store, fingerprint,
};

#[macro_use]
mod common;

use common::t;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn file_store() -> Result<(tempfile::TempDir, Store), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("tasks.idem"))?;
    Ok((dir, store))
}

/// The threads of this process.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, Iterator::count)
}

#[test]
fn two_thousand_tasks_claim_on_one_runtime_thread_while_it_keeps_ticking() -> TestResult {
    let (_dir, store) = file_store()?;
    let inbox = store.inbox("webhooks")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let before = store.commit_stats();
    let ticks = Arc::new(AtomicU64::new(0));
    let threads_before = threads();
    let (claimed, peak_threads, ticks_during) = runtime.block_on(async {
        let ticker = {
            let ticks = ticks.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    ticks.fetch_add(1, Ordering::Relaxed);
                }
            })
        };
        // 2,000 tasks over 500 keys: four deliveries of each.
        let tasks: Vec<_> = (0..2000)
            .map(|i| {
                let inbox = inbox.clone();
                tokio::spawn(
                    async move { inbox.claim_async(&format!("evt-{}", i % 500), t(i)).await },
                )
            })
            .collect();
        let mut peak = 0;
        let mut claimed = 0;
        let start_ticks = ticks.load(Ordering::Relaxed);
        for task in tasks {
            peak = peak.max(threads());
            if task.await?? {
                claimed += 1;
            }
        }
        let during = ticks.load(Ordering::Relaxed) - start_ticks;
        ticker.abort();
        Ok::<_, Box<dyn std::error::Error>>((claimed, peak, during))
    })?;
    assert_eq!(claimed, 500, "one first delivery per key");
    assert_eq!(inbox.len()?, 500);
    let after = store.commit_stats();
    let fsyncs = after.durable_commits - before.durable_commits;
    assert!(
        fsyncs < 1000,
        "2,000 claims shared their fsyncs: {fsyncs} durable commits"
    );
    // The runtime thread, the store's task leader: nothing per task.
    assert!(
        peak_threads <= threads_before + 2,
        "threads: {threads_before} before, {peak_threads} at the peak"
    );
    assert!(
        ticks_during > 0,
        "the runtime kept ticking while tasks waited"
    );
    assert_eq!(store.check_inbox_indexes()?, Vec::<String>::new());
    Ok(())
}

#[test]
fn a_future_dropped_anywhere_leaves_its_claim_whole_or_not_at_all() -> TestResult {
    let (_dir, store) = file_store()?;
    let inbox = store.inbox("in")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut tasks = Vec::new();
        for i in 0..400_u64 {
            let inbox = inbox.clone();
            // Each future is dropped after 0–300 µs, or awaited.
            let cut = Duration::from_micros((i * 7919) % 300);
            tasks.push(tokio::spawn(async move {
                let key = format!("k{i}");
                if i % 3 == 0 {
                    inbox.claim_async(&key, t(0)).await.map(Some)
                } else {
                    Ok(tokio::time::timeout(cut, inbox.claim_async(&key, t(0)))
                        .await
                        .ok()
                        .transpose()?)
                }
            }));
        }
        for task in tasks {
            task.await??;
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    })?;
    // Every key is claimed at most once, and a claim after the storm tells
    // the truth: `true` exactly for the keys no dropped future committed.
    let seen: Vec<bool> = (0..400)
        .map(|i| inbox.seen(&format!("k{i}")))
        .collect::<Result<_, _>>()?;
    for (i, was) in seen.iter().enumerate() {
        let first = inbox.claim(&format!("k{i}"), t(1))?;
        assert_eq!(first, !was, "k{i}");
        if i % 3 == 0 {
            assert!(was, "awaited claims are there");
        }
    }
    assert_eq!(inbox.len()?, 400);
    assert_eq!(store.check_inbox_indexes()?, Vec::<String>::new());
    Ok(())
}

#[test]
fn threads_and_tasks_share_batches_and_keys() -> TestResult {
    let (_dir, store) = file_store()?;
    let inbox = store.inbox("mixed")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let threads: Vec<_> = (0..8)
        .map(|w| {
            let inbox = inbox.clone();
            std::thread::spawn(move || -> idemstore::Result<u64> {
                let mut won = 0;
                for i in 0..100 {
                    if inbox.claim(&format!("k{}", (i * 8 + w) % 300), t(0))? {
                        won += 1;
                    }
                }
                Ok(won)
            })
        })
        .collect();
    let by_tasks: u64 = runtime.block_on(async {
        let tasks: Vec<_> = (0..800)
            .map(|i| {
                let inbox = inbox.clone();
                tokio::spawn(async move { inbox.claim_async(&format!("k{}", i % 300), t(0)).await })
            })
            .collect();
        let mut won = 0;
        for task in tasks {
            won += u64::from(task.await.expect("no panic")?);
        }
        Ok::<_, idemstore::Error>(won)
    })?;
    let by_threads: u64 = threads
        .into_iter()
        .map(|h| h.join().expect("no panic"))
        .sum::<idemstore::Result<u64>>()?;
    assert_eq!(
        by_tasks + by_threads,
        300,
        "each key won once, by a thread or a task"
    );
    assert_eq!(inbox.len()?, 300);
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn the_outbox_and_the_keys_answer_through_their_async_forms() -> TestResult {
    let (_dir, store) = file_store()?;
    let outbox = store.outbox();
    let e = outbox
        .enqueue_async(NewEntry::new("c", "d", "k1", b"one".to_vec()), t(0))
        .await?;
    assert!(matches!(e, Enqueued::New(_)));
    let again = outbox
        .enqueue_async(NewEntry::new("c", "d", "k1", b"one".to_vec()), t(0))
        .await?;
    assert_eq!(again, Enqueued::Duplicate(e.id()));
    outbox
        .enqueue_many_async(
            (2..5).map(|i| NewEntry::new("c", "d", format!("k{i}"), vec![])),
            t(0),
        )
        .await?;
    let claimed = outbox.claim_due_async(t(1), 2, "w").await?;
    assert_eq!(claimed.len(), 2);
    outbox
        .settle_async(claimed[0].fence(), Settlement::Completed, t(2))
        .await?;
    let settled = outbox
        .settle_many_async([(claimed[1].fence(), Settlement::Completed)], t(2))
        .await?;
    assert!(settled[0].is_ok());
    let (_, next) = outbox
        .settle_and_claim_with_async(Vec::new(), t(3), &ClaimRequest::new(10, "w"))
        .await?;
    assert_eq!(next.len(), 2);
    assert_eq!(
        outbox.get_async(claimed[0].id).await?.entry.status,
        OutboxStatus::Completed
    );
    assert!(matches!(
        outbox.get_async(idemstore::OutboxId(99)).await,
        Err(idemstore::Error::NotFound)
    ));
    // A stale fence is refused as in the blocking call.
    assert!(
        outbox
            .settle_async(claimed[0].fence(), Settlement::Completed, t(4))
            .await
            .is_ok(),
        "the same completion again is accepted"
    );
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());

    let keys = store.idempotency_keys();
    let fp = fingerprint("POST", "/pay", b"{}");
    let Begin::Proceed(r) = keys.begin_async("t", "key-1", &fp, t(0)).await? else {
        panic!("a free key proceeds");
    };
    assert!(matches!(
        keys.begin_async("t", "key-1", &fp, t(1)).await?,
        Begin::InFlight { .. }
    ));
    let response = r.response(201, b"paid".to_vec(), t(2));
    assert!(keys.complete_async(&r, response, t(2)).await?);
    assert!(matches!(
        keys.begin_async("t", "key-1", &fp, t(3)).await?,
        Begin::Replay(_)
    ));
    let Begin::Proceed(r2) = keys.begin_async("t", "key-2", &fp, t(0)).await? else {
        panic!("a free key proceeds");
    };
    keys.release_async(&r2).await?;
    assert!(matches!(
        keys.begin_async("t", "key-2", &fp, t(1)).await?,
        Begin::Proceed(_)
    ));
    let read: u64 = store.read_async(|_| Ok::<_, idemstore::Error>(7)).await?;
    assert_eq!(read, 7);
    Ok(())
}

const EFFECTS: idemstore::redb::TableDefinition<&str, u64> =
    idemstore::redb::TableDefinition::new("app.effects");

/// Claims with effects from tasks on a `current_thread` runtime, some
/// futures dropped at random points: every key claimed has its effect and
/// every effect its claim; four deliveries of a key apply it once.
#[test]
fn claims_with_effects_from_tasks_commit_whole_whenever_dropped() -> TestResult {
    use idemstore::redb::ReadableTable as _;
    let (_dir, store) = file_store()?;
    let inbox = store.inbox("effects")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let tasks: Vec<_> = (0..800_u64)
            .map(|i| {
                let inbox = inbox.clone();
                let key = format!("k{}", i % 200);
                let cut = Duration::from_micros((i * 7919) % 400);
                tokio::spawn(async move {
                    let event = key.clone();
                    let claim = inbox.claim_with_async(&event, t(0), move |tx| {
                        let mut effects = tx.open_table(EFFECTS)?;
                        let n = effects.get(key.as_str())?.map_or(0, |v| v.value());
                        effects.insert(key.as_str(), n + 1)?;
                        Ok::<_, idemstore::Error>(())
                    });
                    if i % 2 == 0 {
                        claim.await.map(|_| ())
                    } else {
                        let _ = tokio::time::timeout(cut, claim).await;
                        Ok(())
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await??;
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    })?;
    // Let closures of dropped futures still on the blocking pool finish.
    store.sync()?;
    std::thread::sleep(Duration::from_millis(50));
    store.sync()?;
    let effects: Vec<(String, u64)> = store.read(|tx| {
        let t = tx.open_table(EFFECTS)?;
        t.iter()?
            .map(|r| r.map(|(k, v)| (k.value().to_owned(), v.value())))
            .collect::<Result<_, _>>()
            .map_err(idemstore::Error::from)
    })?;
    for (key, n) in &effects {
        assert_eq!(*n, 1, "{key}: its effect applied once");
        assert!(inbox.seen(key)?, "{key}: an effect has its claim");
    }
    for i in 0..200 {
        let key = format!("k{i}");
        let has_effect = effects.iter().any(|(k, _)| *k == key);
        assert_eq!(
            inbox.seen(&key)?,
            has_effect,
            "{key}: a claim has its effect"
        );
        // Awaited deliveries (even i) make sure every key was claimed.
        assert!(has_effect, "{key}");
    }
    Ok(())
}

/// `begin_async` then `complete_async` from tasks, some futures dropped at
/// random points: afterwards no key is left reserved by a dropped call —
/// each is free (proceeds) or answered (replays), never in flight.
#[test]
fn a_dropped_begin_never_leaves_its_key_held() -> TestResult {
    let (_dir, store) = file_store()?;
    let keys = store.idempotency_keys();
    let fp = fingerprint("POST", "/pay", b"{}");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let tasks: Vec<_> = (0..600_u64)
            .map(|i| {
                let (keys, fp) = (keys.clone(), fp.clone());
                let cut = Duration::from_micros((i * 7919) % 500);
                tokio::spawn(async move {
                    let key = format!("key-{i}");
                    let call = async {
                        if let Begin::Proceed(r) = keys.begin_async("t", &key, &fp, t(0)).await? {
                            keys.complete_async(&r, r.response(200, b"ok".to_vec(), t(0)), t(0))
                                .await?;
                        }
                        Ok::<_, idemstore::Error>(())
                    };
                    if i % 4 == 0 {
                        call.await
                    } else {
                        let _ = tokio::time::timeout(cut, call).await;
                        Ok(())
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await??;
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    })?;
    store.sync()?;
    let mut dropped_mid_way = 0;
    for i in 0..600 {
        let key = format!("key-{i}");
        // Well within the lease: a key still reserved would be in flight.
        match keys.begin("t", &key, &fp, t(1))? {
            Begin::Replay(_) => {}
            Begin::Proceed(r) => {
                assert!(i % 4 != 0, "{key}: an awaited call completed it");
                dropped_mid_way += 1;
                keys.release(&r)?;
            }
            other => panic!("{key}: left held by a dropped call: {other:?}"),
        }
    }
    assert!(
        dropped_mid_way > 0,
        "some calls were dropped before completing"
    );
    assert_eq!(keys.check_indexes()?, Vec::<String>::new());
    Ok(())
}

/// The operator's calls, awaited: the same status moves and refusals as
/// the blocking ones.
#[tokio::test(flavor = "current_thread")]
async fn the_operators_calls_move_entries_as_the_blocking_ones_do() -> TestResult {
    let (_dir, store) = file_store()?;
    let outbox = store.outbox();
    outbox
        .enqueue_many_async(
            (0..4).map(|i| NewEntry::new("c", "d", format!("k{i}"), vec![])),
            t(0),
        )
        .await?;
    let claimed = outbox.claim_due_async(t(1), 4, "w").await?;
    let [a, b, c, d] = [0, 1, 2, 3].map(|i| claimed[i].id);
    outbox.mark_failed_async(a, "gone", None, t(2)).await?;
    outbox.requeue_async(a, t(3)).await?;
    outbox.mark_completed_async(b, t(2)).await?;
    outbox.reschedule_async(c, t(5)).await?;
    outbox.cancel_async(c, t(6)).await?;
    assert!(matches!(
        outbox.cancel_async(d, t(6)).await,
        Err(idemstore::Error::Conflict { .. })
    ));
    let status = |id| outbox.get(id).map(|r| r.entry.status);
    assert_eq!(status(a)?, OutboxStatus::Pending);
    assert_eq!(status(b)?, OutboxStatus::Completed);
    assert_eq!(status(c)?, OutboxStatus::Failed);
    assert_eq!(status(d)?, OutboxStatus::Dispatching);
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    Ok(())
}

/// The outbox's inspection, maintenance and destination calls, awaited:
/// the same answers as the blocking ones.
#[tokio::test(flavor = "current_thread")]
async fn the_outboxs_reads_maintenance_and_destinations_answer_as_blocking() -> TestResult {
    let (_dir, store) = file_store()?;
    let outbox = store.outbox();
    outbox
        .enqueue_many_async(
            (0..4).map(|i| NewEntry::new("cmd", "d", format!("k{i}"), vec![])),
            t(0),
        )
        .await?;
    let claimed = outbox.claim_due_async(t(1), 4, "w").await?;
    assert_eq!(claimed.len(), 4);
    outbox
        .enqueue_async(NewEntry::new("cmd", "e", "k4", vec![]), t(1))
        .await?;
    let done = claimed[0].id;
    outbox
        .settle_many_async(
            claimed[..2]
                .iter()
                .map(|e| (e.fence(), Settlement::Completed)),
            t(2),
        )
        .await?;
    outbox
        .mark_outcome_unknown_async(claimed[2].id, Some("ref-1"))
        .await?;
    assert_eq!(
        outbox.get(claimed[2].id)?.entry.status,
        OutboxStatus::OutcomeUnknown
    );
    // Reads.
    assert_eq!(outbox.counts_async().await?, outbox.counts()?);
    assert_eq!(outbox.counts_async().await?.completed, 2);
    let any = OutboxFilter::any();
    assert_eq!(outbox.list_async(&any, 10).await?, outbox.list(&any, 10)?);
    let completed = OutboxFilter::any().status(OutboxStatus::Completed);
    let listed = outbox.list_async(&completed, 10).await?;
    assert_eq!(listed, outbox.list(&completed, 10)?);
    assert_eq!(listed.len(), 2);
    assert_eq!(outbox.find_async("d", "k0").await?, outbox.find("d", "k0")?);
    assert_eq!(
        outbox.find_async("d", "k0").await?.map(|r| r.entry.id),
        Some(done)
    );
    assert_eq!(outbox.find_async("d", "nope").await?, None);
    assert_eq!(
        outbox.list_for_command_async("cmd").await?,
        outbox.list_for_command("cmd")?
    );
    assert_eq!(outbox.oldest_claim_async().await?, Some(t(1)));
    assert_eq!(outbox.oldest_claim_async().await?, outbox.oldest_claim()?);
    // Destinations.
    let policy = DestinationPolicy::default().max_in_flight(2);
    outbox.set_destination_policy_async("d", policy).await?;
    outbox.pause_destination_async("e").await?;
    assert_eq!(outbox.destination_async("d").await?.policy, policy);
    assert!(outbox.destination_async("e").await?.paused);
    assert_eq!(
        outbox.destination_async("e").await?,
        outbox.destination("e")?
    );
    assert_eq!(outbox.destinations_async().await?, outbox.destinations()?);
    assert!(
        outbox.claim_due_async(t(3), 10, "w").await?.is_empty(),
        "e is paused"
    );
    outbox.resume_destination_async("e").await?;
    assert!(!outbox.destination("e")?.paused);
    assert!(matches!(
        outbox.pause_destination_async("").await,
        Err(idemstore::Error::InvalidInput { .. })
    ));
    // Maintenance and bulk changes.
    let released = outbox.release_expired_claims_async(t(10)).await?;
    assert_eq!(released, vec![claimed[3].id]);
    assert_eq!(outbox.release_expired_claims(t(10))?, Vec::new());
    let unknown = OutboxFilter::any().status(OutboxStatus::OutcomeUnknown);
    let cancel = MatchingChange::Cancel { now: t(11) };
    let step = outbox.change_matching_async(&unknown, &cancel, 10).await?;
    assert_eq!((step.changed, step.last), (1, Some(claimed[2].id)));
    assert_eq!(outbox.change_matching(&unknown, &cancel, 10)?.changed, 0);
    assert_eq!(outbox.purge_finished_async(t(20)).await?, 3);
    assert_eq!(outbox.purge_finished(t(20))?, 0);
    assert_eq!(outbox.counts_async().await?.total(), 2);
    assert_eq!(outbox.check_indexes_async().await?, Vec::<String>::new());
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    Ok(())
}

/// The inbox's reads and prune, the keys' reads and operator calls, and
/// the store's inbox names, awaited: the same answers as the blocking ones.
#[tokio::test(flavor = "current_thread")]
async fn the_inbox_and_the_keys_reads_and_maintenance_answer_as_blocking() -> TestResult {
    let (_dir, store) = file_store()?;
    let inbox = store.inbox("hooks")?;
    assert!(inbox.is_empty_async().await?);
    assert_eq!(store.inbox_names_async().await?, Vec::<String>::new());
    for i in 0..3 {
        inbox.claim_async(&format!("evt-{i}"), t(i)).await?;
    }
    assert!(inbox.seen_async("evt-1").await?);
    assert!(!inbox.seen_async("evt-9").await?);
    assert_eq!(inbox.seen_at_async("evt-2").await?, Some(t(2)));
    assert_eq!(inbox.seen_at_async("evt-2").await?, inbox.seen_at("evt-2")?);
    assert_eq!(inbox.len_async().await?, 3);
    assert!(!inbox.is_empty_async().await?);
    assert_eq!(inbox.list_async(None, 10).await?, inbox.list(None, 10)?);
    let after = Some((t(0), "evt-0"));
    assert_eq!(
        inbox.list_async(after, 1).await?,
        vec![("evt-1".to_owned(), t(1))]
    );
    assert_eq!(store.inbox_names_async().await?, vec!["hooks".to_owned()]);
    assert_eq!(inbox.prune_async(t(2)).await?, 2);
    assert_eq!(inbox.prune(t(2))?, 0);
    assert_eq!(inbox.len_async().await?, 1);

    let keys = store.idempotency_keys();
    let fp = fingerprint("POST", "/pay", b"{}");
    let record =
        idemstore::ResponseRecord::new("t", "put-1", fp.clone(), 201, b"ok".to_vec(), t(0));
    assert!(keys.put_async(&record).await?);
    assert!(!keys.put_async(&record).await?, "first write wins");
    assert_eq!(
        keys.get_async("t", "put-1", t(-10)).await?,
        Some(record.clone())
    );
    assert_eq!(
        keys.response_async("t", "put-1").await?,
        keys.response("t", "put-1")?
    );
    assert_eq!(
        keys.entry_async("t", "put-1").await?,
        keys.entry("t", "put-1")?
    );
    let Begin::Proceed(r) = keys.begin_async("t", "held", &fp, t(1)).await? else {
        panic!("a free key proceeds");
    };
    assert_eq!(
        keys.list_async(Some("t"), 10).await?,
        keys.list(Some("t"), 10)?
    );
    assert_eq!(
        keys.list_after_async(None, 10).await?,
        keys.list_after(None, 10)?
    );
    assert_eq!(keys.summary_async().await?, keys.summary()?);
    assert_eq!(keys.summary_async().await?.reserved, 1);
    assert!(!keys.release_key_async("t", "held", r.fence() + 1).await?);
    assert!(keys.release_key_async("t", "held", r.fence()).await?);
    assert_eq!(keys.entry_async("t", "held").await?, None);
    // An expired response reads as absent, and is deleted.
    assert_eq!(keys.get_async("t", "put-1", t(1)).await?, None);
    assert_eq!(keys.entry("t", "put-1")?, None);
    assert!(keys.put(&record)?);
    assert_eq!(keys.purge_expired_async(t(1)).await?, 1);
    assert_eq!(keys.purge_expired(t(1))?, 0);
    assert_eq!(keys.check_indexes_async().await?, Vec::<String>::new());
    assert_eq!(keys.check_indexes()?, Vec::<String>::new());
    Ok(())
}

/// The new async forms' futures can be spawned (`Send`).
#[test]
fn the_async_forms_futures_are_send() -> TestResult {
    fn is_send<T: Send>(_: &T) {}
    let store = Store::in_memory()?;
    let (inbox, outbox, keys) = (store.inbox("i")?, store.outbox(), store.idempotency_keys());
    is_send(&store.inbox_names_async());
    is_send(&inbox.seen_at_async("k"));
    is_send(&inbox.list_async(None, 1));
    is_send(&inbox.prune_async(t(0)));
    is_send(&outbox.purge_finished_async(t(0)));
    is_send(&outbox.release_expired_claims_async(t(0)));
    is_send(&outbox.list_async(&OutboxFilter::any(), 1));
    is_send(&outbox.pause_destination_async("d"));
    is_send(&outbox.destinations_async());
    is_send(&keys.get_async("t", "k", t(0)));
    is_send(&keys.purge_expired_async(t(0)));
    is_send(&keys.summary_async());
    Ok(())
}

#[test]
fn the_async_dispatcher_makes_no_store_call_on_the_blocking_pool()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    dispatcher_without_blocking_pool!({
        let dir = tempfile::tempdir()?;
        (Store::open(dir.path().join("pool.idem"))?, dir)
    })
}
