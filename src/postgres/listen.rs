//! The outbox's listening connection: `LISTEN <schema>_outbox` on a
//! connection of its own, turning the server's notifications into the
//! same coalescing wake-ups as the embedded outbox's.
//!
//! One task per store, on the store's own runtime, started by the first
//! subscription. The task drives its connection itself (the connection's
//! notifications come out of its `poll_message`, which a connection run
//! the ordinary way would drop). It holds only a weak reference to the
//! subscribers, so it ends (within a [`TICK`]) once the store's outbox
//! handles are gone, and with the store's runtime when the store goes.
//! When its connection fails it reconnects after [`RETRY`]; after each
//! (re)connection it signals once, because notifications sent while it
//! was away are lost and a subscriber must look again. A server that
//! refuses `LISTEN` (a PostgreSQL-compatible engine without it) gets
//! polling instead: one signal every [`TICK`].
//!
//! A listening connection only reads, so a server host that vanishes
//! without closing it (a crash, a network cut) would leave it waiting,
//! half-open, for the operating system's default keepalive (about two
//! hours) while no wake-up arrives. Like every connection of the store it
//! therefore probes a silent peer and gives up on it within about a minute
//! ([`bounded_config`](super::conn::bounded_config)), and the task reconnects.

use std::future::{Future, poll_fn};
use std::pin::pin;
use std::sync::Weak;
use std::task::Poll;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::runtime::Handle;
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, Connection, NoTls};

use super::tls::{Address, Tls};
use crate::outbox::Notifier;

/// How long the listener waits for a notification before it checks that
/// the store is still there; also the polling interval.
const TICK: Duration = Duration::from_secs(1);
/// How long it waits before reconnecting after a failure.
const RETRY: Duration = Duration::from_secs(1);

/// Starts the listening task for `channel` on the store's runtime `rt`.
pub(super) fn start(rt: &Handle, address: &Address, channel: String, notifier: Weak<Notifier>) {
    let address = address.bounded();
    rt.spawn(async move { run(&address, &channel, &notifier).await });
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

async fn run(address: &Address, channel: &str, notifier: &Weak<Notifier>) {
    loop {
        let ended = match &address.tls {
            Tls::Plain => match address.config.connect(NoTls).await {
                Ok((client, connection)) => session(client, connection, channel, notifier).await,
                Err(_) => Ended::Failed,
            },
            #[cfg(feature = "postgres-tls")]
            Tls::Rustls(tls) => match address.config.connect(tls.clone()).await {
                Ok((client, connection)) => session(client, connection, channel, notifier).await,
                Err(_) => Ended::Failed,
            },
        };
        match ended {
            Ended::StoreGone => return,
            Ended::Failed => {
                if notifier.strong_count() == 0 {
                    return;
                }
                tokio::time::sleep(RETRY).await;
            }
            Ended::Unsupported => return poll(notifier).await,
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

async fn poll(notifier: &Weak<Notifier>) {
    while signal(notifier) {
        tokio::time::sleep(TICK).await;
    }
}

/// The listening connection, as this task drives it: plain or TLS.
type Listening<T> = Connection<tokio_postgres::Socket, T>;

/// One connection, just opened: `LISTEN`, then relay notifications until
/// it fails or the store is gone.
async fn session<T: AsyncRead + AsyncWrite + Unpin>(
    client: tokio_postgres::Client,
    mut connection: Listening<T>,
    channel: &str,
    notifier: &Weak<Notifier>,
) -> Ended {
    // The channel is `<schema>_outbox`, a checked identifier.
    let listen = format!("LISTEN {channel}");
    match while_driving(&mut connection, client.batch_execute(&listen)).await {
        Some(Ok(())) => {}
        Some(Err(e)) if e.code() == Some(&SqlState::FEATURE_NOT_SUPPORTED) => {
            return Ended::Unsupported;
        }
        Some(Err(_)) | None => return Ended::Failed,
    }
    if !signal(notifier) {
        return Ended::StoreGone;
    }
    // The client stays alive while the connection is relayed: dropping it
    // would close the connection.
    let ended = relay(&mut connection, notifier).await;
    drop(client);
    ended
}

/// Awaits `request` while driving `connection`, which carries it to the
/// server and its answer back; `None` if the connection ended first.
async fn while_driving<S: AsyncRead + AsyncWrite + Unpin, T>(
    connection: &mut Listening<S>,
    request: impl Future<Output = T>,
) -> Option<T> {
    let mut request = pin!(request);
    poll_fn(|cx| {
        if let Poll::Ready(out) = request.as_mut().poll(cx) {
            return Poll::Ready(Some(out));
        }
        loop {
            match connection.poll_message(cx) {
                // A notice, or a notification right after the `LISTEN`
                // (the signal that follows it covers that one).
                Poll::Ready(Some(Ok(_))) => {}
                Poll::Ready(Some(Err(_)) | None) => return Poll::Ready(None),
                Poll::Pending => break,
            }
        }
        // Polled again once the connection has handed it its answer.
        request.as_mut().poll(cx).map(Some)
    })
    .await
}

/// Relays the notifications `connection` receives, checking every
/// [`TICK`] that the store is still there.
async fn relay<T: AsyncRead + AsyncWrite + Unpin>(
    connection: &mut Listening<T>,
    notifier: &Weak<Notifier>,
) -> Ended {
    loop {
        let message = poll_fn(|cx| connection.poll_message(cx));
        match tokio::time::timeout(TICK, message).await {
            // Signals coalesce in the subscribers' channels.
            Ok(Some(Ok(AsyncMessage::Notification(_)))) => {
                if !signal(notifier) {
                    return Ended::StoreGone;
                }
            }
            // A notice.
            Ok(Some(Ok(_))) => {}
            // The connection ended.
            Ok(Some(Err(_)) | None) => return Ended::Failed,
            // A quiet tick.
            Err(_) => {
                if notifier.strong_count() == 0 {
                    return Ended::StoreGone;
                }
            }
        }
    }
}
