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
//!
//! A listening connection only reads, so a server host that vanishes
//! without closing it (a crash, a network cut) would leave it waiting,
//! half-open, for the operating system's default keepalive (about two
//! hours) while no wake-up arrives. Its connection therefore uses TCP
//! keepalives probing after [`KEEPALIVE_IDLE`] of silence, every
//! [`KEEPALIVE_INTERVAL`], dropped after [`KEEPALIVE_RETRIES`] unanswered
//! probes (and, on Linux, after [`USER_TIMEOUT`] of unacknowledged data):
//! a vanished server is noticed within about a minute, and the thread
//! reconnects. Shorter settings from the connection string are kept.

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

/// Silence on the listening connection before keepalive probes start.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
/// Time between two keepalive probes.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// Unanswered probes after which the connection is dropped.
const KEEPALIVE_RETRIES: u32 = 3;
/// Longest time data sent may stay unacknowledged before the connection is
/// dropped (Linux's `TCP_USER_TIMEOUT`).
const USER_TIMEOUT: Duration = Duration::from_secs(60);

/// `config` for the listening connection: keepalives on, at most as slow
/// as the constants above.
fn listener_config(config: &Config) -> Config {
    let mut c = config.clone();
    c.keepalives(true);
    if c.get_keepalives_idle() > KEEPALIVE_IDLE {
        c.keepalives_idle(KEEPALIVE_IDLE);
    }
    if c.get_keepalives_interval()
        .is_none_or(|i| i > KEEPALIVE_INTERVAL)
    {
        c.keepalives_interval(KEEPALIVE_INTERVAL);
    }
    if c.get_keepalives_retries()
        .is_none_or(|n| n > KEEPALIVE_RETRIES)
    {
        c.keepalives_retries(KEEPALIVE_RETRIES);
    }
    if c.get_tcp_user_timeout().is_none_or(|t| *t > USER_TIMEOUT) {
        c.tcp_user_timeout(USER_TIMEOUT);
    }
    c
}

/// Starts the listening thread for `channel`.
pub(super) fn start(
    config: Config,
    channel: String,
    notifier: Weak<Notifier>,
) -> std::io::Result<()> {
    thread::Builder::new()
        .name("idemstore-pg-listen".into())
        .spawn(move || run(&listener_config(&config), &channel, &notifier))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listener_notices_a_vanished_server_within_a_minute() {
        let plain: Config = "host=db user=app".parse().unwrap();
        let c = listener_config(&plain);
        assert!(c.get_keepalives());
        assert_eq!(c.get_keepalives_idle(), KEEPALIVE_IDLE);
        assert_eq!(c.get_keepalives_interval(), Some(KEEPALIVE_INTERVAL));
        assert_eq!(c.get_keepalives_retries(), Some(KEEPALIVE_RETRIES));
        assert_eq!(c.get_tcp_user_timeout(), Some(&USER_TIMEOUT));
        let probing = KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_RETRIES;
        assert!(probing <= Duration::from_secs(60));
        // Shorter settings of the connection string stay.
        let eager: Config = "host=db keepalives=0 keepalives_idle=5 keepalives_interval=2 \
                             keepalives_retries=1 tcp_user_timeout=4"
            .parse()
            .unwrap();
        let c = listener_config(&eager);
        assert!(c.get_keepalives());
        assert_eq!(c.get_keepalives_idle(), Duration::from_secs(5));
        assert_eq!(c.get_keepalives_interval(), Some(Duration::from_secs(2)));
        assert_eq!(c.get_keepalives_retries(), Some(1));
        assert_eq!(c.get_tcp_user_timeout(), Some(&Duration::from_secs(4)));
    }
}
