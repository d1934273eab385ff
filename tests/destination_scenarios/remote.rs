//! The remote of the destination scenarios: it sees every send of every
//! dispatcher, in this process or in a child process, and decides which
//! fail.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write as _};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use idemstore::{Delivery, OutboxEntry};
use parking_lot::Mutex;

use super::common::wall_micros;

/// One send, as the remote sees it.
#[derive(Clone, Debug)]
struct Send {
    id: u64,
    destination: String,
    /// `(ordering key, the event's place in its key's enqueue order)`.
    ordered: Option<(String, u32)>,
    /// The process that sent it.
    process: String,
}

/// What the remote saw, and what it answers.
#[derive(Debug, Default)]
pub(crate) struct Remote {
    /// While down, every send fails.
    pub(crate) down: bool,
    /// This percentage of the sends fail, at random.
    fail_percent: u64,
    rng: u64,
    /// The send that begins as the remote's `n`th (1-based) gets no answer:
    /// its process is killed in the middle of it.
    pub(crate) hang_at: Option<u64>,
    /// The send that got no answer.
    pub(crate) hung: Option<u64>,
    begins: u64,
    in_flight: BTreeMap<String, u32>,
    pub(crate) max_in_flight: BTreeMap<String, u32>,
    /// Sends in flight per `(destination, process)`, and the most at once.
    in_flight_by: BTreeMap<(String, String), u32>,
    pub(crate) max_in_flight_by: BTreeMap<(String, String), u32>,
    keys_in_flight: BTreeSet<String>,
    /// Per ordering key, how many of its events were delivered in order
    /// (the place of the next one).
    pub(crate) in_order: BTreeMap<String, u32>,
    /// The ordered events the remote was sent again after it had taken
    /// them: `(key, place)`.
    pub(crate) duplicates: BTreeSet<(String, u32)>,
    pub(crate) violations: Vec<String>,
    /// Per entry, how many times the remote took it.
    pub(crate) delivered: BTreeMap<u64, u32>,
    /// Sends begun, per `(destination, process)`.
    pub(crate) sends: BTreeMap<(String, String), u64>,
    /// When each send began (µs since the epoch), per destination.
    pub(crate) begun_at: BTreeMap<String, Vec<u64>>,
    /// When the last send the remote took ended.
    pub(crate) last_delivery: Option<u64>,
}

pub(crate) type SharedRemote = Arc<Mutex<Remote>>;

impl Remote {
    pub(crate) fn failing(percent: u64) -> SharedRemote {
        Arc::new(Mutex::new(Remote {
            fail_percent: percent,
            rng: 0x2545_f491_4f6c_dd1d,
            ..Remote::default()
        }))
    }

    /// A send begins; the answer it will get (`None`: none, it hangs).
    fn begin(&mut self, send: &Send) -> Option<bool> {
        self.begins += 1;
        let flight = self.in_flight.entry(send.destination.clone()).or_default();
        *flight += 1;
        let flight = *flight;
        let max = self
            .max_in_flight
            .entry(send.destination.clone())
            .or_default();
        *max = (*max).max(flight);
        let by = (send.destination.clone(), send.process.clone());
        let mine = self.in_flight_by.entry(by.clone()).or_default();
        *mine += 1;
        let mine = *mine;
        let most = self.max_in_flight_by.entry(by).or_default();
        *most = (*most).max(mine);
        *self
            .sends
            .entry((send.destination.clone(), send.process.clone()))
            .or_default() += 1;
        self.begun_at
            .entry(send.destination.clone())
            .or_default()
            .push(wall_micros());
        if let Some((key, place)) = &send.ordered {
            if !self.keys_in_flight.insert(key.clone()) {
                self.violations.push(format!(
                    "{key}: event {place} sent while another was in flight"
                ));
            }
            let next = self.in_order.get(key).copied().unwrap_or(0);
            if *place + 1 == next {
                self.duplicates.insert((key.clone(), *place));
            } else if *place != next {
                self.violations.push(format!(
                    "{key}: event {place} sent when event {next} was the next in order"
                ));
            }
        }
        if self.hang_at == Some(self.begins) {
            self.hung = Some(send.id);
            return None;
        }
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        Some(!self.down && self.rng % 100 >= self.fail_percent)
    }

    /// The send ends: the remote took it, or not.
    fn end(&mut self, send: &Send, taken: bool) {
        self.abandon(send);
        if !taken {
            return;
        }
        *self.delivered.entry(send.id).or_default() += 1;
        self.last_delivery = Some(wall_micros());
        if let Some((key, place)) = &send.ordered {
            let next = self.in_order.entry(key.clone()).or_default();
            if *place == *next {
                *next += 1;
            }
        }
    }

    /// The send ended without an answer (its process died).
    fn abandon(&mut self, send: &Send) {
        if let Some(n) = self.in_flight.get_mut(&send.destination) {
            *n -= 1;
        }
        let by = (send.destination.clone(), send.process.clone());
        if let Some(n) = self.in_flight_by.get_mut(&by) {
            *n -= 1;
        }
        if let Some((key, _)) = &send.ordered {
            self.keys_in_flight.remove(key);
        }
    }

    pub(crate) fn sends_of(&self, destination: &str) -> u64 {
        self.sends
            .iter()
            .filter(|((d, _), _)| d == destination)
            .map(|(_, n)| n)
            .sum()
    }

    pub(crate) fn processes_sending(&self, destination: &str) -> usize {
        self.sends.keys().filter(|(d, _)| d == destination).count()
    }
}

/// Serves `remote` on 127.0.0.1 to child processes; returns its address.
/// Lines: `begin PROCESS ID DESTINATION KEY|- PLACE` (answered `ok` or
/// `fail`, or not at all when the remote hangs), `end ID 0|1` (answered
/// `ok`). A connection that closes with sends begun abandons them.
pub(crate) fn serve(remote: &SharedRemote) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let remote = remote.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let remote = remote.clone();
            std::thread::spawn(move || connection(&remote, conn));
        }
    });
    addr
}

fn connection(remote: &SharedRemote, conn: TcpStream) {
    // Each line in one write, sent at once (no wait for an acknowledgement
    // of the last one).
    conn.set_nodelay(true).unwrap();
    let mut out = conn.try_clone().unwrap();
    let mut open: BTreeMap<u64, Send> = BTreeMap::new();
    for line in BufReader::new(conn).lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split(' ').collect();
        let answer = match words[..] {
            ["begin", process, id, destination, key, place] => {
                let send = Send {
                    id: id.parse().unwrap(),
                    destination: destination.to_owned(),
                    ordered: (key != "-").then(|| (key.to_owned(), place.parse().unwrap())),
                    process: process.to_owned(),
                };
                let answer = remote.lock().begin(&send);
                open.insert(send.id, send);
                match answer {
                    Some(true) => "ok",
                    Some(false) => "fail",
                    None => continue,
                }
            }
            ["end", id, taken] => {
                let send = open.remove(&id.parse().unwrap()).expect("a send begun");
                remote.lock().end(&send, taken == "1");
                "ok"
            }
            _ => panic!("the remote got {line:?}"),
        };
        if out.write_all(format!("{answer}\n").as_bytes()).is_err() {
            break;
        }
    }
    let mut remote = remote.lock();
    for send in open.values() {
        remote.abandon(send);
    }
}

/// How a dispatcher's `send` reaches the remote.
#[derive(Clone)]
pub(crate) enum Link {
    /// The remote is in this process.
    Local(SharedRemote),
    /// At this address ([`serve`]).
    Tcp(String),
}

thread_local! {
    /// Each worker thread's connection to the remote.
    static CONNECTION: RefCell<Option<(BufReader<TcpStream>, TcpStream)>> =
        const { RefCell::new(None) };
}

/// Sends one line on this thread's connection to `addr`; its answer.
fn ask(addr: &str, line: &str) -> String {
    CONNECTION.with(|c| {
        let mut c = c.borrow_mut();
        let (reader, writer) = c.get_or_insert_with(|| {
            let stream = TcpStream::connect(addr).expect("the remote listens");
            stream.set_nodelay(true).unwrap();
            (BufReader::new(stream.try_clone().unwrap()), stream)
        });
        writer.write_all(format!("{line}\n").as_bytes()).unwrap();
        let mut answer = String::new();
        reader.read_line(&mut answer).unwrap();
        answer.trim_end().to_owned()
    })
}

/// A dispatcher's `send`: tells the remote it begins, takes `took`, tells
/// it how it ended. The payload of an entry with an ordering key is its
/// place in its key's enqueue order.
pub(crate) fn send_to(link: &Link, process: &str, entry: &OutboxEntry, took: Duration) -> Delivery {
    let ordered = entry.ordering_key.as_ref().map(|key| {
        let place = std::str::from_utf8(&entry.payload)
            .unwrap()
            .parse()
            .unwrap();
        (key.clone(), place)
    });
    let send = Send {
        id: entry.id.0,
        destination: entry.destination.clone(),
        ordered,
        process: process.to_owned(),
    };
    let taken = match link {
        Link::Local(remote) => {
            let taken = remote.lock().begin(&send).expect("no hang in process");
            std::thread::sleep(took);
            remote.lock().end(&send, taken);
            taken
        }
        Link::Tcp(addr) => {
            let (key, place) = send
                .ordered
                .as_ref()
                .map_or(("-".to_owned(), 0), |(k, p)| (k.clone(), *p));
            let begin = format!(
                "begin {process} {} {} {key} {place}",
                send.id, send.destination
            );
            let taken = ask(addr, &begin) == "ok";
            std::thread::sleep(took);
            ask(addr, &format!("end {} {}", send.id, u8::from(taken)));
            taken
        }
    };
    if taken {
        Delivery::Delivered
    } else {
        Delivery::Retry {
            reason: "http_503".into(),
        }
    }
}
