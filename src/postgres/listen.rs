//! The outbox's listening connection: `LISTEN <schema>_outbox` on a
//! connection of its own, turning the server's notifications into the
//! same coalescing wake-ups as the embedded outbox's.
//!
//! One thread per store, started by the first subscription. It holds only
//! a weak reference to the subscribers, so it ends (within a [`TICK`]) once
//! the store and its outbox handles are gone. When its connection fails it
//! reconnects after [`RETRY`]; after each (re)connection it signals once,
//! because notifications sent while it was away are lost and a subscriber
//! must look again. A server that refuses `LISTEN` (a PostgreSQL-compatible
//! engine without it) gets polling instead: one signal every [`TICK`].

use std::sync::Weak;
use std::thread;
use std::time::Duration;

use ::postgres::fallible_iterator::FallibleIterator as _;
use ::postgres::{Client, Config, NoTls};

use crate::outbox::Notifier;

/// How long the listener waits for a notification before it checks that
/// the store is still there; also the polling interval.
const TICK: Duration = Duration::from_secs(1);
/// How long it waits before reconnecting after a failure.
const RETRY: Duration = Duration::from_secs(1);

/// Starts the listening thread for `channel`.
pub(super) fn start(
    config: Config,
    channel: String,
    notifier: Weak<Notifier>,
) -> std::io::Result<()> {
    thread::Builder::new()
        .name("idemstore-pg-listen".into())
        .spawn(move || run(&config, &channel, &notifier))
        .map(drop)
}

/// What a listening session ended with.
enum Ended {
    /// The store is gone: stop.
    StoreGone,
    /// The connection failed: reconnect.
    Failed,
    /// The server does not do `LISTEN`: poll.
    Unsupported,
}

fn run(config: &Config, channel: &str, notifier: &Weak<Notifier>) {
    loop {
        match session(config, channel, notifier) {
            Ended::StoreGone => return,
            Ended::Failed => {
                if notifier.strong_count() == 0 {
                    return;
                }
                thread::sleep(RETRY);
            }
            Ended::Unsupported => return poll(notifier),
        }
    }
}

/// Signals every subscriber once; `false` if the store is gone.
fn signal(notifier: &Weak<Notifier>) -> bool {
    match notifier.upgrade() {
        Some(n) => {
            n.notify();
            true
        }
        None => false,
    }
}

fn poll(notifier: &Weak<Notifier>) {
    while signal(notifier) {
        thread::sleep(TICK);
    }
}

/// One connection: `LISTEN`, then relay notifications until it fails or
/// the store is gone.
fn session(config: &Config, channel: &str, notifier: &Weak<Notifier>) -> Ended {
    let Ok(mut client) = config.connect(NoTls) else {
        return Ended::Failed;
    };
    // The channel is `<schema>_outbox`, a checked identifier.
    if let Err(e) = client.batch_execute(&format!("LISTEN {channel}")) {
        let unsupported = e
            .code()
            .is_some_and(|c| *c == ::postgres::error::SqlState::FEATURE_NOT_SUPPORTED);
        return if unsupported {
            Ended::Unsupported
        } else {
            Ended::Failed
        };
    }
    if !signal(notifier) {
        return Ended::StoreGone;
    }
    relay(&mut client, notifier)
}

fn relay(client: &mut Client, notifier: &Weak<Notifier>) -> Ended {
    loop {
        {
            let mut notifications = client.notifications();
            let mut iter = notifications.timeout_iter(TICK);
            loop {
                match iter.next() {
                    // Signals coalesce in the subscribers' channels.
                    Ok(Some(_)) => {
                        if !signal(notifier) {
                            return Ended::StoreGone;
                        }
                    }
                    // A quiet tick, or a closed connection (below).
                    Ok(None) => break,
                    Err(_) => return Ended::Failed,
                }
            }
        }
        if notifier.strong_count() == 0 {
            return Ended::StoreGone;
        }
        if client.is_closed() {
            return Ended::Failed;
        }
    }
}
