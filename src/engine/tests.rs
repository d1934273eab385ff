//! The engine's unit tests: a failed or panicking operation writes nothing
//! and loses nothing answered before it, after-commit hooks stay with their
//! transaction, and under `Durability::None` batches share one open
//! transaction that readers and caller closures commit first.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use redb::backends::InMemoryBackend;
use redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};

use super::{Durability, Engine, EngineConfig, after_commit};
use crate::error::{Error, Result};

const T: TableDefinition<&str, u64> = TableDefinition::new("t");

fn engine(durability: Durability, max_batch: usize) -> Arc<Engine> {
    engine_with(durability, max_batch, false)
}

/// An engine that runs as in a store shared between processes (refreshes,
/// closures leading their own batches), on a file it holds alone.
fn shared_engine() -> Arc<Engine> {
    engine_with(Durability::Immediate, 1024, true)
}

fn engine_with(durability: Durability, max_batch: usize, shared: bool) -> Arc<Engine> {
    let db = redb::Database::builder()
        .create_with_backend(InMemoryBackend::new())
        .unwrap();
    let config = EngineConfig {
        durability,
        quick_repair: false,
        max_batch,
        flush_interval: Duration::from_secs(3600),
        shared,
    };
    Arc::new(Engine::start(db, config, None).unwrap())
}

/// Waits until `n` operations are queued.
fn wait_queued(engine: &Engine, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while engine.inner.queue.lock().queued.len() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "{n} queued never queued"
        );
        std::thread::yield_now();
    }
}

/// Starts a batch and returns once it runs; it holds the lead until the
/// returned sender sends (or is dropped), so that others queue behind it.
fn hold_a_batch(engine: &Arc<Engine>) -> (JoinHandle<Result<()>>, mpsc::Sender<()>) {
    let (started, is_started) = mpsc::channel();
    let (release, released) = mpsc::channel::<()>();
    let released = Arc::new(parking_lot::Mutex::new(released));
    let holder = {
        let engine = engine.clone();
        std::thread::spawn(move || {
            engine.execute(move |_| {
                let _ = started.send(());
                let _ = released.lock().recv();
                Ok(())
            })
        })
    };
    is_started.recv().unwrap();
    (holder, release)
}

fn put(engine: &Engine, key: &'static str, value: u64) -> Result<()> {
    engine.execute(move |tx| {
        tx.open_table(T)?.insert(key, value)?;
        Ok(())
    })
}

fn get(engine: &Engine, key: &str) -> Result<Option<u64>> {
    engine.read(|tx| match tx.open_table(T) {
        Ok(t) => Ok(t.get(key)?.map(|v| v.value())),
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
        Err(e) => Err(Error::from(e)),
    })
}

/// An operation that writes, then panics: its write must not survive.
fn put_then_panic(engine: &Engine, key: &'static str) {
    let out = catch_unwind(AssertUnwindSafe(|| {
        engine.execute(move |tx| -> Result<()> {
            tx.open_table(T)?.insert(key, 666)?;
            panic!("operation failed half-way");
        })
    }));
    assert!(out.is_err(), "the panic reaches its caller");
}

#[test]
fn a_panicking_operation_loses_nothing_answered_before_it() {
    for durability in [Durability::Immediate, Durability::None] {
        let engine = engine(durability, 1024);
        put(&engine, "before", 1).unwrap();
        put_then_panic(&engine, "bad");
        put(&engine, "after", 2).unwrap();
        assert_eq!(get(&engine, "before").unwrap(), Some(1), "{durability:?}");
        assert_eq!(get(&engine, "after").unwrap(), Some(2), "{durability:?}");
        assert_eq!(get(&engine, "bad").unwrap(), None, "{durability:?}");
    }
}

#[test]
fn an_operation_that_fails_after_writing_leaves_nothing() {
    for durability in [Durability::Immediate, Durability::None] {
        let engine = engine(durability, 1024);
        put(&engine, "before", 1).unwrap();
        let out = engine.execute(|tx| -> Result<()> {
            tx.open_table(T)?.insert("half", 7)?;
            Err(Error::conflict("failed after its first write"))
        });
        assert!(matches!(out, Err(Error::Conflict { .. })), "{out:?}");
        put(&engine, "after", 2).unwrap();
        assert_eq!(get(&engine, "half").unwrap(), None, "{durability:?}");
        assert_eq!(get(&engine, "before").unwrap(), Some(1), "{durability:?}");
        assert_eq!(get(&engine, "after").unwrap(), Some(2), "{durability:?}");
    }
}

#[test]
fn failing_operations_roll_back_alone_among_concurrent_ones() {
    let engine = engine(Durability::Immediate, 1024);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                for i in 0..100u64 {
                    let key: &'static str = Box::leak(format!("{t}-{i}").into_boxed_str());
                    let fail = (t + i) % 3 == 0;
                    let out = engine.execute(move |tx| -> Result<()> {
                        tx.open_table(T)?.insert(key, i)?;
                        if fail {
                            return Err(Error::NotFound);
                        }
                        Ok(())
                    });
                    assert_eq!(out.is_err(), fail, "{key}: {out:?}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for t in 0..8u64 {
        for i in 0..100u64 {
            let expected = ((t + i) % 3 != 0).then_some(i);
            assert_eq!(get(&engine, &format!("{t}-{i}")).unwrap(), expected);
        }
    }
}

#[test]
fn a_panicking_after_commit_hook_changes_no_answer_and_keeps_the_store_working() {
    let engine = engine(Durability::Immediate, 1024);
    let out = engine.execute(|tx| -> Result<()> {
        tx.open_table(T)?.insert("hooked", 1)?;
        after_commit(|| panic!("hook failed"));
        Ok(())
    });
    assert!(
        out.is_ok(),
        "the caller is told its write committed: {out:?}"
    );
    assert_eq!(get(&engine, "hooked").unwrap(), Some(1), "committed");
    put(&engine, "later", 2).unwrap();
    assert_eq!(get(&engine, "later").unwrap(), Some(2));
}

/// Far above what any call here takes: a caller not answered by then waits
/// for something that never comes.
const BOUND: Duration = Duration::from_secs(20);

/// Queues `n` callers behind a held batch, each putting its own key; the
/// first one's operation registers `hook`. Returns the holder, its release
/// and the callers' answers, once all of them are queued.
#[expect(clippy::type_complexity, reason = "a test's plumbing")]
fn queue_callers_behind_a_held_batch(
    engine: &Arc<Engine>,
    n: usize,
    hook: impl Fn() + Send + Sync + 'static,
) -> (
    JoinHandle<Result<()>>,
    mpsc::Sender<()>,
    mpsc::Receiver<(usize, std::thread::Result<Result<()>>)>,
) {
    let (holder, release) = hold_a_batch(engine);
    let hook = Arc::new(hook);
    let (answers, answered) = mpsc::channel();
    for i in 0..n {
        let (caller, answers, hook) = (engine.clone(), answers.clone(), hook.clone());
        std::thread::spawn(move || {
            let key: &'static str = Box::leak(format!("caller-{i}").into_boxed_str());
            let out = catch_unwind(AssertUnwindSafe(|| {
                caller.execute(move |tx| -> Result<()> {
                    tx.open_table(T)?.insert(key, 1)?;
                    if i == 0 {
                        let hook = hook.clone();
                        after_commit(move || hook());
                    }
                    Ok(())
                })
            }));
            let _ = answers.send((i, out));
        });
        wait_queued(engine, i + 1);
    }
    (holder, release, answered)
}

/// A batch of nine callers whose hook panics on the leader's thread: the
/// leader's own answer and its children in the wake tree (callers 2 and 3,
/// and theirs: 6, 7, 8) are answered all the same, `Ok`.
#[test]
fn a_hook_panic_on_the_leader_leaves_no_caller_of_its_batch_waiting() {
    let engine = engine(Durability::Immediate, 1024);
    let (holder, release, answered) =
        queue_callers_behind_a_held_batch(&engine, 8, || panic!("hook failed"));
    release.send(()).unwrap();
    for _ in 0..8 {
        let (i, out) = answered
            .recv_timeout(BOUND)
            .expect("every caller of the batch is answered");
        assert!(matches!(out, Ok(Ok(()))), "caller {i}: {out:?}");
    }
    let led = holder.join();
    assert!(
        matches!(led, Ok(Ok(()))),
        "the leader's own answer: {led:?}"
    );
    for i in 0..8 {
        assert_eq!(get(&engine, &format!("caller-{i}")).unwrap(), Some(1));
    }
    put(&engine, "later", 2).unwrap();
    assert_eq!(get(&engine, "later").unwrap(), Some(2));
}

/// A hook runs only once every caller of its batch is answered: one that
/// waits for all of them gets them (it would wait forever were it run
/// between the commit and the answers).
#[test]
fn hooks_run_once_every_caller_of_their_batch_is_answered() {
    let engine = engine(Durability::Immediate, 1024);
    let (saw, seen) = mpsc::channel();
    let answers_to_wait_for = Arc::new(parking_lot::Mutex::new(None::<mpsc::Receiver<_>>));
    let (holder, release, answered) = {
        let waiting = answers_to_wait_for.clone();
        queue_callers_behind_a_held_batch(&engine, 7, move || {
            let answered: mpsc::Receiver<(usize, std::thread::Result<Result<()>>)> =
                waiting.lock().take().expect("one hook");
            let got = (0..7)
                .filter(|_| answered.recv_timeout(Duration::from_secs(2)).is_ok())
                .count();
            let _ = saw.send(got);
        })
    };
    *answers_to_wait_for.lock() = Some(answered);
    release.send(()).unwrap();
    let got = seen.recv_timeout(BOUND).expect("the hook ran");
    assert_eq!(got, 7, "the hook ran before every caller was answered");
    assert!(matches!(holder.join(), Ok(Ok(()))));
}

#[test]
fn a_refresh_that_fails_during_a_rollback_fails_only_that_batch() {
    use std::sync::atomic::{AtomicBool, Ordering};

    let engine = shared_engine();
    let fail_next = Arc::new(AtomicBool::new(false));
    {
        let fail_next = fail_next.clone();
        engine.on_write_begin(move |_| {
            if fail_next.swap(false, Ordering::SeqCst) {
                return Err(Error::conflict("refresh failed"));
            }
            Ok(())
        });
    }
    // The operation fails: its batch rolls back and begins again, and
    // that refresh fails.
    let fail = fail_next.clone();
    let out = engine.execute(move |tx| -> Result<()> {
        tx.open_table(T)?.insert("bad", 1)?;
        fail.store(true, Ordering::SeqCst);
        Err(Error::conflict("operation failed"))
    });
    assert!(matches!(out, Err(Error::Conflict { .. })), "{out:?}");
    assert!(!fail_next.load(Ordering::SeqCst), "the rollback refreshed");
    put(&engine, "later", 2).unwrap();
    assert_eq!(get(&engine, "later").unwrap(), Some(2));
    assert_eq!(get(&engine, "bad").unwrap(), None);
}

/// In a shared store, a closure's caller leads the operations queued behind
/// it; if the closure fails, they commit without it, and a panic of their
/// after-commit hooks, which run on the closure's thread once everyone is
/// answered, changes neither the closure's answer nor theirs.
#[test]
fn an_operations_hook_panic_changes_no_answer_of_a_closure_batch() {
    let engine = shared_engine();
    let queued = |n: usize| wait_queued(&engine, n);
    // A batch held running while a closure's seat and an operation queue
    // behind it.
    let (holder, release) = hold_a_batch(&engine);
    let writer = {
        let engine = engine.clone();
        std::thread::spawn(move || {
            catch_unwind(AssertUnwindSafe(|| {
                engine.write(|tx| -> Result<()> {
                    tx.open_table(T)?.insert("refused", 1)?;
                    Err(Error::conflict("the closure refuses"))
                })
            }))
        })
    };
    queued(1);
    let hooked = {
        let engine = engine.clone();
        std::thread::spawn(move || {
            engine.execute(|tx| -> Result<()> {
                tx.open_table(T)?.insert("hooked", 2)?;
                after_commit(|| panic!("hook failed"));
                Ok(())
            })
        })
    };
    queued(2);
    release.send(()).unwrap();
    holder.join().unwrap().unwrap();
    hooked.join().unwrap().unwrap();
    let out = writer.join().unwrap();
    assert!(
        matches!(out, Ok(Err(Error::Conflict { .. }))),
        "the closure's caller gets the closure's own answer: {out:?}"
    );
    assert_eq!(get(&engine, "hooked").unwrap(), Some(2), "committed");
    assert_eq!(get(&engine, "refused").unwrap(), None);
    put(&engine, "later", 3).unwrap();
}

/// In a shared store, a closure's batch holds at most `max_batch` operations
/// with the closure, late arrivals included.
#[test]
fn a_closure_takes_a_place_of_its_batch() {
    let engine = engine_with(Durability::Immediate, 2, true);
    let queued = |n: usize| wait_queued(&engine, n);
    let (holder, release) = hold_a_batch(&engine);
    // The closure counts the rows written before it in its transaction.
    let writer = {
        let engine = engine.clone();
        std::thread::spawn(move || {
            engine.write(|tx| -> Result<u64> { Ok(tx.open_table(T)?.len()?) })
        })
    };
    queued(1);
    let puts: Vec<_> = ["x", "y"]
        .into_iter()
        .enumerate()
        .map(|(i, key)| {
            let engine = engine.clone();
            let put = std::thread::spawn(move || put(&engine, key, 1));
            queued(i + 2);
            put
        })
        .collect();
    release.send(()).unwrap();
    holder.join().unwrap().unwrap();
    assert_eq!(
        writer.join().unwrap().unwrap(),
        1,
        "one operation and the closure"
    );
    for put in puts {
        put.join().unwrap().unwrap();
    }
}

/// A caller closure's caller may lead a batch before its own
/// transaction begins (to commit the transaction kept open under
/// [`Durability::None`]). The hooks of that batch's operations belong
/// to the batch: one whose operation was rolled back never runs, even
/// when the closure commits afterwards.
#[test]
fn hooks_of_a_rolled_back_operation_never_run_when_a_closure_caller_leads() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let engine = engine(Durability::None, 2);
    let queued = |n: usize| wait_queued(&engine, n);
    // Leaves a transaction open (pending).
    put(&engine, "a", 1).unwrap();
    // A batch held running while the others queue behind it.
    let (holder, release) = hold_a_batch(&engine);
    let filler = {
        let engine = engine.clone();
        std::thread::spawn(move || put(&engine, "y", 2))
    };
    queued(1);
    let writer = {
        let engine = engine.clone();
        std::thread::spawn(move || {
            engine.write(|tx| -> Result<()> {
                tx.open_table(T)?.insert("c", 3)?;
                Ok(())
            })
        })
    };
    queued(2);
    let ran = Arc::new(AtomicBool::new(false));
    let panicker = {
        let (engine, ran) = (engine.clone(), ran.clone());
        std::thread::spawn(move || {
            catch_unwind(AssertUnwindSafe(|| {
                engine.execute(move |_| -> Result<()> {
                    let ran = ran.clone();
                    after_commit(move || ran.store(true, Ordering::SeqCst));
                    panic!("rolled back");
                })
            }))
            .is_err()
        })
    };
    queued(3);
    release.send(()).unwrap();
    holder.join().unwrap().unwrap();
    filler.join().unwrap().unwrap();
    writer.join().unwrap().unwrap();
    assert!(panicker.join().unwrap(), "the panic reached its caller");
    assert!(
        !ran.load(Ordering::SeqCst),
        "a rolled-back operation's hook ran"
    );
    for (key, value) in [("a", 1), ("y", 2), ("c", 3)] {
        assert_eq!(get(&engine, key).unwrap(), Some(value), "{key}");
    }
}

#[test]
fn under_none_writes_share_an_open_transaction_that_readers_see() {
    let engine = engine(Durability::None, 1024);
    let (commits, _) = engine.commit_counts();
    for (i, key) in ["a", "b", "c"].into_iter().enumerate() {
        put(&engine, key, i as u64).unwrap();
    }
    assert_eq!(
        engine.commit_counts().0,
        commits,
        "nothing committed yet: the transaction is kept open"
    );
    // Another thread sees every answered write.
    let reader = engine.clone();
    let seen = std::thread::spawn(move || get(&reader, "c").unwrap())
        .join()
        .unwrap();
    assert_eq!(seen, Some(2));
    assert_eq!(
        engine.commit_counts().0,
        commits + 1,
        "the read committed it"
    );
}

#[test]
fn under_none_the_open_transaction_commits_every_max_batch_operations() {
    let engine = engine(Durability::None, 8);
    let (commits, _) = engine.commit_counts();
    for _ in 0..40 {
        engine
            .execute(|tx| {
                let mut t = tx.open_table(T)?;
                let n = t.get("n")?.map_or(0, |v| v.value());
                t.insert("n", n + 1)?;
                Ok(())
            })
            .unwrap();
    }
    assert_eq!(engine.commit_counts().0, commits + 5);
    assert_eq!(get(&engine, "n").unwrap(), Some(40));
}

#[test]
fn under_none_own_transactions_and_batches_interleave_without_deadlock() {
    let engine = engine(Durability::None, 1024);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                for i in 0..200u64 {
                    let key: &'static str = Box::leak(format!("{t}-{i}").into_boxed_str());
                    if t % 2 == 0 {
                        put(&engine, key, i).unwrap();
                    } else {
                        engine
                            .write(|tx| -> Result<()> {
                                tx.open_table(T)?.insert(key, i)?;
                                Ok(())
                            })
                            .unwrap();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for t in 0..8 {
        for i in 0..200u64 {
            assert_eq!(get(&engine, &format!("{t}-{i}")).unwrap(), Some(i));
        }
    }
    engine.sync().unwrap();
    let (all, durable) = engine.commit_counts();
    assert!(durable >= 1 && all >= durable);
    engine
        .exclusive(|db| {
            let tx = db.begin_read()?;
            assert_eq!(tx.open_table(T)?.len()?, 1600);
            Ok(())
        })
        .unwrap();
}

/// Tasks' operations queued behind a batch a thread holds, among threads'
/// ones, one of them panicking half-way: the lead passes from the thread to
/// the task leader and back, every caller is answered once, the panic
/// reaches its task alone and wrote nothing.
#[cfg(feature = "tokio")]
#[test]
fn tasks_and_threads_share_a_batch_and_a_tasks_panic_stays_its_own() {
    let engine = engine(Durability::Immediate, 1024);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (holder, release) = hold_a_batch(&engine);
    let keys = ["a", "b", "c", "d"];
    let tasks: Vec<_> = keys
        .iter()
        .map(|&key| {
            let engine = engine.clone();
            runtime.spawn(async move {
                engine
                    .execute_async(move |tx| {
                        tx.open_table(T)?.insert(key, 1)?;
                        Ok(())
                    })
                    .await
            })
        })
        .collect();
    let panicking = {
        let engine = engine.clone();
        runtime.spawn(async move {
            engine
                .execute_async(|tx| -> Result<()> {
                    tx.open_table(T)?.insert("x", 666)?;
                    panic!("operation failed half-way");
                })
                .await
        })
    };
    wait_queued(&engine, 5);
    let thread = {
        let engine = engine.clone();
        std::thread::spawn(move || put(&engine, "t", 2))
    };
    wait_queued(&engine, 6);
    release.send(()).unwrap();
    // The holder's operation runs again when the panicking one is rolled
    // back: it must not wait a second time.
    drop(release);
    holder.join().unwrap().unwrap();
    for task in tasks {
        runtime.block_on(task).unwrap().unwrap();
    }
    assert!(runtime.block_on(panicking).unwrap_err().is_panic());
    thread.join().unwrap().unwrap();
    for key in keys {
        assert_eq!(get(&engine, key).unwrap(), Some(1), "{key}");
    }
    assert_eq!(get(&engine, "t").unwrap(), Some(2));
    assert_eq!(
        get(&engine, "x").unwrap(),
        None,
        "the panicking write rolled back"
    );
    // Later calls from tasks and threads still work.
    runtime
        .block_on(engine.execute_async(|tx| {
            tx.open_table(T)?.insert("later", 3)?;
            Ok(())
        }))
        .unwrap();
    assert_eq!(get(&engine, "later").unwrap(), Some(3));
}

/// A task's read waits, without a thread, until what it saw is durable,
/// and a task alone (nobody leading) still gets its batch led.
#[cfg(feature = "tokio")]
#[test]
fn a_lone_task_is_led_and_its_read_sees_what_it_wrote() {
    let engine = engine(Durability::Immediate, 1024);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        for i in 0..50_u64 {
            engine
                .execute_async(move |tx| {
                    tx.open_table(T)?.insert("n", i)?;
                    Ok(())
                })
                .await
                .unwrap();
            let seen = engine
                .read_async(|tx| -> Result<Option<u64>> {
                    Ok(tx.open_table(T)?.get("n")?.map(|v| v.value()))
                })
                .await
                .unwrap();
            assert_eq!(seen, Some(i));
        }
    });
    let (commits, durable) = engine.commit_counts();
    assert!(
        durable >= 50 && commits >= 50,
        "{commits} commits, {durable} durable"
    );
}
