//! A loopback proxy in front of the test server (`127.0.0.1` to its unix
//! socket) whose network the test controls: it passes bytes through, or
//! delays each chunk, or holds every byte in both directions (a partition
//! in which neither end hears the other, while both sockets stay open),
//! or refuses new connections and resets the open ones (a partition that
//! both ends notice), or resets every open connection at once.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use postgres::Config;
use postgres::config::Host;

/// What the network does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Net {
    /// Bytes pass at once.
    Up,
    /// Each chunk waits this long before it passes.
    Slow(Duration),
    /// Nothing passes, either way, until the mode changes; sockets stay open.
    Held,
    /// New connections are closed as they come; the open ones were reset.
    Down,
}

#[derive(Debug)]
struct State {
    net: Mutex<Net>,
    /// Both ends of every relayed connection, to reset them.
    open: Mutex<Vec<(TcpStream, UnixStream)>>,
    resets: AtomicU64,
    refused: AtomicU64,
}

/// The proxy; it lives as long as the test process.
#[derive(Debug, Clone)]
pub struct FaultyNet {
    /// The connection string to use instead of the server's.
    pub url: String,
    state: Arc<State>,
}

impl FaultyNet {
    /// Starts a proxy in front of the server named by `url` (a unix
    /// socket, as `.ci/postgres` starts it).
    pub fn start(url: &str) -> FaultyNet {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let (socket, proxied) = in_front_of(url, listener.local_addr().unwrap().port());
        let state = Arc::new(State {
            net: Mutex::new(Net::Up),
            open: Mutex::new(Vec::new()),
            resets: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        });
        let shared = state.clone();
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                accept(&shared, client, &socket);
            }
        });
        FaultyNet {
            url: proxied,
            state,
        }
    }

    /// Sets what the network does from now on; `Down` also resets every
    /// open connection.
    pub fn set(&self, net: Net) {
        *self.state.net.lock().unwrap() = net;
        if net == Net::Down {
            self.reset_all();
        }
    }

    /// Resets every open connection (both ends see it closed).
    pub fn reset_all(&self) {
        for (client, server) in self.state.open.lock().unwrap().drain(..) {
            let _ = client.shutdown(Shutdown::Both);
            let _ = server.shutdown(Shutdown::Both);
            self.state.resets.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Connections reset so far.
    pub fn resets(&self) -> u64 {
        self.state.resets.load(Ordering::Relaxed)
    }

    /// Connections refused so far.
    pub fn refused(&self) -> u64 {
        self.state.refused.load(Ordering::Relaxed)
    }
}

/// The unix socket of the server `url` names (as `.ci/postgres` starts
/// it), and the connection string that reaches it through a proxy on
/// loopback `port` instead.
pub fn in_front_of(url: &str, port: u16) -> (PathBuf, String) {
    use std::fmt::Write as _;
    let config: Config = url.parse().expect("the test server's connection string");
    let Some(Host::Unix(dir)) = config.get_hosts().first().cloned() else {
        panic!("the test server listens on a unix socket: {url}");
    };
    let server_port = config.get_ports().first().copied().unwrap_or(5432);
    let socket = dir.join(format!(".s.PGSQL.{server_port}"));
    let mut proxied = format!("host=127.0.0.1 port={port}");
    if let Some(user) = config.get_user() {
        let _ = write!(proxied, " user={user}");
    }
    if let Some(db) = config.get_dbname() {
        let _ = write!(proxied, " dbname={db}");
    }
    (socket, proxied)
}

fn accept(state: &Arc<State>, client: TcpStream, socket: &PathBuf) {
    if *state.net.lock().unwrap() == Net::Down {
        state.refused.fetch_add(1, Ordering::Relaxed);
        let _ = client.shutdown(Shutdown::Both);
        return;
    }
    let Ok(server) = UnixStream::connect(socket) else {
        return;
    };
    let (Ok(c2), Ok(s2), Ok(c3), Ok(s3)) = (
        client.try_clone(),
        server.try_clone(),
        client.try_clone(),
        server.try_clone(),
    ) else {
        return;
    };
    state.open.lock().unwrap().push((c3, s3));
    let up = state.clone();
    thread::spawn(move || pump(&up, client, s2));
    let down = state.clone();
    thread::spawn(move || pump(&down, server, c2));
}

/// Copies `from` to `to` as the network allows, until either end closes.
fn pump(state: &State, mut from: impl Read, mut to: impl Write + Shut) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        loop {
            let net = *state.net.lock().unwrap();
            match net {
                // Down: a reset closed the sockets, and the write below fails.
                Net::Up | Net::Down => break,
                Net::Slow(d) => {
                    thread::sleep(d);
                    break;
                }
                Net::Held => thread::sleep(Duration::from_millis(2)),
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    to.shut();
}

/// Closing the far side of a pump when its near side ends.
trait Shut {
    fn shut(&self);
}

impl Shut for TcpStream {
    fn shut(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

impl Shut for UnixStream {
    fn shut(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}
