// The cases of `tests/dispatch_caps.rs` (the embedded store) and
// `tests/dispatch_caps_pg.rs` (PostgreSQL): each test binary defines
// `capped(cap) -> Option<(Guard, Outbox)>`, a fresh store whose destination
// `api` has a cap of `cap` (`None`: skip), and `fresh()`, one with no
// policy, and `SEND`, how long a send of the cases with more workers than
// the cap takes: long beside a claim's commit, so that every slot is
// sending at some moment. Then it includes this file.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use chrono::Utc;
use idemstore::{Delivery, Dispatcher, NewEntry, Result};

/// A remote that counts the sends in flight and the most it saw at once.
#[derive(Default)]
struct Remote {
    in_flight: AtomicUsize,
    most: AtomicUsize,
    sent: AtomicUsize,
}

impl Remote {
    /// One send that takes `took`.
    fn send(&self, took: Duration) -> Delivery {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(took);
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.sent.fetch_add(1, Ordering::SeqCst);
        Delivery::Delivered
    }

    fn most(&self) -> usize {
        self.most.load(Ordering::SeqCst)
    }

    fn sent(&self) -> usize {
        self.sent.load(Ordering::SeqCst)
    }
}

fn enqueue(outbox: &Outbox, destination: &str, n: usize) -> Result<()> {
    outbox.enqueue_many(
        (0..n).map(|i| NewEntry::new("cmd", destination, format!("{destination}-{i}"), vec![])),
        Utc::now(),
    )?;
    Ok(())
}

/// Waits (polling the store, at most a minute) until `n` entries are
/// completed.
fn drained(outbox: &Outbox, n: u64) -> Result<()> {
    for _ in 0..6000 {
        if outbox.counts()?.completed >= n {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("the outbox did not drain: {:?}", outbox.counts()?);
}

#[test]
fn two_thread_dispatchers_keep_a_cap_of_two_full_and_never_exceed_it() -> Result<()> {
    let Some((_guard, outbox)) = capped(2)? else {
        return Ok(());
    };
    enqueue(&outbox, "api", 60)?;
    let remote = Arc::new(Remote::default());
    let start = |name: &str| {
        let remote = remote.clone();
        Dispatcher::builder(outbox.clone())
            .workers(4)
            .worker_id(name)
            .start(move |_| remote.send(Duration::from_millis(15)))
    };
    let (a, b) = (start("a")?, start("b")?);
    drained(&outbox, 60)?;
    a.shutdown()?;
    b.shutdown()?;
    assert_eq!(remote.most(), 2, "a cap of 2 is two sends at once, never three");
    assert_eq!(remote.sent(), 60);
    Ok(())
}

/// One thread dispatcher of eight workers, a cap of four: four at once.
#[test]
fn one_thread_dispatcher_of_eight_reaches_a_cap_of_four() -> Result<()> {
    let Some((_guard, outbox)) = capped(4)? else {
        return Ok(());
    };
    enqueue(&outbox, "api", 200)?;
    let remote = Arc::new(Remote::default());
    let r = remote.clone();
    let dispatcher = Dispatcher::builder(outbox.clone())
        .workers(8)
        .start(move |_| r.send(SEND))?;
    drained(&outbox, 200)?;
    dispatcher.shutdown()?;
    assert_eq!(remote.most(), 4);
    Ok(())
}

#[test]
fn a_slow_thread_dispatcher_beside_a_fast_one_sends_only_what_it_can_start() -> Result<()> {
    let Some((_guard, outbox)) = fresh()? else {
        return Ok(());
    };
    let (slow_sent, fast_sent) = (Arc::new(Remote::default()), Arc::new(Remote::default()));
    let s = slow_sent.clone();
    // The slow one first: it has the whole backlog to itself for a moment.
    let slow = Dispatcher::builder(outbox.clone())
        .workers(1)
        .worker_id("slow")
        .start(move |_| s.send(Duration::from_millis(100)))?;
    // Its first send teaches it how long a send takes.
    enqueue(&outbox, "warm", 1)?;
    drained(&outbox, 1)?;
    let f = fast_sent.clone();
    let fast = Dispatcher::builder(outbox.clone())
        .workers(4)
        .worker_id("fast")
        .start(move |_| f.send(Duration::ZERO))?;
    enqueue(&outbox, "api", 200)?;
    drained(&outbox, 201)?;
    slow.shutdown()?;
    fast.shutdown()?;
    let slow = slow_sent.sent() - 1;
    assert!(
        slow <= 20,
        "the slow dispatcher sent {slow} of 200: it held claims the fast one could have sent"
    );
    assert_eq!(slow + fast_sent.sent(), 200);
    Ok(())
}

/// Sends of the weight cases: each destination's started sends.
#[derive(Default)]
struct Tally {
    started: std::sync::Mutex<std::collections::BTreeMap<String, usize>>,
}

impl Tally {
    /// Counts a send of `destination` as started if fewer than [`WEIGHED`]
    /// were: whether it counted. (Later ones may find one destination
    /// drained while the dispatcher stops.)
    fn start(&self, destination: &str) -> bool {
        let mut started = self.started.lock().unwrap();
        if started.values().sum::<usize>() >= WEIGHED {
            return false;
        }
        *started.entry(destination.to_owned()).or_default() += 1;
        true
    }

    fn of(&self, destination: &str) -> usize {
        self.started
            .lock()
            .unwrap()
            .get(destination)
            .copied()
            .unwrap_or(0)
    }

    fn all(&self) -> usize {
        self.started.lock().unwrap().values().sum()
    }
}

/// Sends counted in the weight cases: fewer than either destination's
/// backlog, so both have entries due throughout.
const WEIGHED: usize = 240;
/// A send of the weight cases: long beside a commit, so that what is
/// measured is how the workers are shared out, not how soon a claim
/// refills them.
const WEIGHED_SEND: Duration = Duration::from_millis(40);
const BACKLOG: usize = 400;

/// `heavy` of weight 3 and `light` of weight 1, a backlog each.
fn weighted() -> Result<Option<(Guard, Outbox)>> {
    let Some((guard, outbox)) = fresh()? else {
        return Ok(None);
    };
    outbox.set_destination_policy("heavy", DestinationPolicy::default().weight(3))?;
    enqueue(&outbox, "heavy", BACKLOG)?;
    enqueue(&outbox, "light", BACKLOG)?;
    Ok(Some((guard, outbox)))
}

/// Waits (at most a minute) until `n` sends started.
fn started(tally: &Tally, n: usize) {
    for _ in 0..6000 {
        if tally.all() >= n {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("only {} sends started", tally.all());
}

/// The first [`WEIGHED`] sends went 3:1 to `heavy`, within 20%.
fn assert_three_to_one(tally: &Tally, what: &str) {
    let (heavy, light) = (tally.of("heavy"), tally.of("light"));
    let ratio = heavy as f64 / light.max(1) as f64;
    assert!(
        (2.4..=3.6).contains(&ratio),
        "{what}: weights 3:1 sent {heavy}:{light} ({ratio:.2}:1)"
    );
}

#[test]
fn weights_of_three_to_one_share_a_thread_dispatchers_workers_three_to_one() -> Result<()> {
    let Some((_guard, outbox)) = weighted()? else {
        return Ok(());
    };
    let tally = Arc::new(Tally::default());
    let t = tally.clone();
    let dispatcher = Dispatcher::builder(outbox.clone())
        .workers(8)
        .start(move |e| {
            if t.start(&e.destination) {
                std::thread::sleep(WEIGHED_SEND);
            }
            Delivery::Delivered
        })?;
    started(&tally, WEIGHED);
    dispatcher.shutdown()?;
    assert_three_to_one(&tally, "threads");
    Ok(())
}

#[cfg(feature = "tokio")]
mod on_tokio {
    use super::*;

    /// An async send that takes `took` (on tokio's timer), counted by
    /// `remote`.
    async fn send(remote: Arc<Remote>, took: Duration) -> Delivery {
        let now = remote.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        remote.most.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(took).await;
        remote.in_flight.fetch_sub(1, Ordering::SeqCst);
        remote.sent.fetch_add(1, Ordering::SeqCst);
        Delivery::Delivered
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn two_async_dispatchers_keep_a_cap_of_two_full_and_never_exceed_it() -> Result<()> {
        let Some((_guard, outbox)) = capped(2)? else {
            return Ok(());
        };
        enqueue(&outbox, "api", 60)?;
        let remote = Arc::new(Remote::default());
        let rt = runtime();
        let _enter = rt.enter();
        let start = |name: &str| {
            let remote = remote.clone();
            Dispatcher::builder(outbox.clone())
                .workers(4)
                .worker_id(name)
                .start_async(move |_| send(remote.clone(), Duration::from_millis(15)))
        };
        let (a, b) = (start("a")?, start("b")?);
        drained(&outbox, 60)?;
        rt.block_on(async {
            a.shutdown().await?;
            b.shutdown().await
        })?;
        assert_eq!(remote.most(), 2, "a cap of 2 is two sends at once, never three");
        Ok(())
    }

    /// One async dispatcher of eight workers, a cap of three: three at
    /// once.
    #[test]
    fn one_async_dispatcher_of_eight_reaches_a_cap_of_three() -> Result<()> {
        let Some((_guard, outbox)) = capped(3)? else {
            return Ok(());
        };
        enqueue(&outbox, "api", 90)?;
        let remote = Arc::new(Remote::default());
        let rt = runtime();
        let _enter = rt.enter();
        let r = remote.clone();
        let dispatcher = Dispatcher::builder(outbox.clone())
            .workers(8)
            .start_async(move |_| send(r.clone(), SEND))?;
        drained(&outbox, 90)?;
        rt.block_on(dispatcher.shutdown())?;
        assert_eq!(remote.most(), 3);
        Ok(())
    }

    #[test]
    fn a_slow_async_dispatcher_beside_a_fast_one_sends_only_what_it_can_start() -> Result<()> {
        let Some((_guard, outbox)) = fresh()? else {
            return Ok(());
        };
        let (slow_sent, fast_sent) = (Arc::new(Remote::default()), Arc::new(Remote::default()));
        let rt = runtime();
        let _enter = rt.enter();
        let s = slow_sent.clone();
        let slow = Dispatcher::builder(outbox.clone())
            .workers(1)
            .worker_id("slow")
            .start_async(move |_| send(s.clone(), Duration::from_millis(100)))?;
        enqueue(&outbox, "warm", 1)?;
        drained(&outbox, 1)?;
        let f = fast_sent.clone();
        let fast = Dispatcher::builder(outbox.clone())
            .workers(4)
            .worker_id("fast")
            .start_async(move |_| send(f.clone(), Duration::ZERO))?;
        enqueue(&outbox, "api", 200)?;
        drained(&outbox, 201)?;
        rt.block_on(async {
            slow.shutdown().await?;
            fast.shutdown().await
        })?;
        let slow = slow_sent.sent() - 1;
        assert!(slow <= 20, "the slow dispatcher sent {slow} of 200");
        assert_eq!(slow + fast_sent.sent(), 200);
        Ok(())
    }

    #[test]
    fn weights_of_three_to_one_share_an_async_dispatchers_slots_three_to_one() -> Result<()> {
        let Some((_guard, outbox)) = weighted()? else {
            return Ok(());
        };
        let tally = Arc::new(Tally::default());
        let rt = runtime();
        let _enter = rt.enter();
        let t = tally.clone();
        let dispatcher = Dispatcher::builder(outbox.clone())
            .workers(8)
            .start_async(move |e| {
                let first = t.start(&e.destination);
                async move {
                    if first {
                        tokio::time::sleep(WEIGHED_SEND).await;
                    }
                    Delivery::Delivered
                }
            })?;
        started(&tally, WEIGHED);
        rt.block_on(dispatcher.shutdown())?;
        assert_three_to_one(&tally, "tokio");
        Ok(())
    }
}
