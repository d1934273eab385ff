//! The async dispatcher's background tasks (feature `tokio`): the reaper,
//! the scheduler and the janitor, each a task that waits without holding a
//! thread.

use std::future::poll_fn;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::sync::watch;

use super::janitor::Janitor;
use super::tasks::{signalled, stopped};
use super::worker::{self, BACK_OFF, Ctx, IDLE_CAP};

/// Waits `timeout`, ended early by a jump of the clock; returns `false` on
/// stop.
async fn pause(
    timeout: Duration,
    changes: &mut Option<watch::Receiver<()>>,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    let woke = {
        let mut stop = pin!(stopped(stop));
        let mut change = pin!(signalled(changes));
        let mut timer = pin!(tokio::time::sleep(timeout));
        poll_fn(|cx| {
            if stop.as_mut().poll(cx).is_ready() {
                return Poll::Ready(None);
            }
            if let Poll::Ready(alive) = change.as_mut().poll(cx) {
                return Poll::Ready(Some(alive));
            }
            timer.as_mut().poll(cx).map(|()| Some(true))
        })
        .await
    };
    match woke {
        None => false,
        Some(alive) => {
            if !alive {
                *changes = None;
            }
            true
        }
    }
}

/// Fires the outbox's schedules as their slots come (see the thread
/// dispatcher's scheduler): sleeps until the next one is due, a commit
/// wakes it, or the clock jumps.
pub(super) async fn scheduler(ctx: Arc<Ctx>, mut stop: watch::Receiver<bool>) {
    let mut changes = ctx.clock.changes_async();
    let mut wake = Some(ctx.outbox.subscribe_async());
    while !ctx.stopping() {
        let timeout = match worker::fire_schedules_async(&ctx).await {
            Ok(next) => ctx.timeout(next, IDLE_CAP),
            Err(worker::BackOff) => BACK_OFF,
        };
        if !pause_or_wake(timeout, &mut wake, &mut changes, &mut stop).await {
            break;
        }
    }
}

/// [`pause`], ended early by a `wake` signal too.
async fn pause_or_wake(
    timeout: Duration,
    wake: &mut Option<watch::Receiver<()>>,
    changes: &mut Option<watch::Receiver<()>>,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    let ended = {
        let mut stop = pin!(stopped(stop));
        let mut change = pin!(signalled(changes));
        let mut signal = pin!(signalled(wake));
        let mut timer = pin!(tokio::time::sleep(timeout));
        poll_fn(|cx| {
            if stop.as_mut().poll(cx).is_ready() {
                return Poll::Ready(None);
            }
            if let Poll::Ready(alive) = change.as_mut().poll(cx) {
                return Poll::Ready(Some((alive, true)));
            }
            if let Poll::Ready(alive) = signal.as_mut().poll(cx) {
                return Poll::Ready(Some((true, alive)));
            }
            timer.as_mut().poll(cx).map(|()| Some((true, true)))
        })
        .await
    };
    match ended {
        None => false,
        Some((changes_alive, wake_alive)) => {
            if !changes_alive {
                *changes = None;
            }
            if !wake_alive {
                *wake = None;
            }
            true
        }
    }
}

/// Releases claims older than the lease, every half lease (and at once on
/// start).
pub(super) async fn reaper(ctx: Arc<Ctx>, mut stop: watch::Receiver<bool>) {
    let mut changes = ctx.clock.changes_async();
    while !ctx.stopping() {
        worker::reap_async(&ctx).await;
        if !pause(worker::reaper_period(&ctx), &mut changes, &mut stop).await {
            break;
        }
    }
}

/// Runs `janitor` on its schedule (a run at start, then one per interval).
pub(super) async fn run_janitor(
    ctx: Arc<Ctx>,
    janitor: Arc<Janitor>,
    mut stop: watch::Receiver<bool>,
) {
    let mut changes = ctx.clock.changes_async();
    let mut next = ctx.clock.now();
    while !ctx.stopping() {
        if let Some(now) = janitor.due(&*ctx.clock, &mut next) {
            let outcome = janitor.run_once_async(now).await;
            ctx.counters.janitor_run(now, &outcome);
        }
        if !pause(janitor.wait(&*ctx.clock, next), &mut changes, &mut stop).await {
            break;
        }
    }
}
