//! Calls on pooled connections the server has dropped (a restart, an
//! administrator's `pg_terminate_backend`, an idle timeout) run again on a
//! fresh connection instead of failing, as long as running again is safe;
//! a call whose commit may have landed is never run again, and says so.
//! The restart test restarts the test server (`pg_ctl restart -m
//! immediate`) when this process can; it says so and passes when it
//! cannot. The lost-commit test runs the store through a loopback proxy
//! that lets a commit through and hands the client the server's farewell
//! instead of its answer.
//!
//! Needs `IDEMSTORE_TEST_POSTGRES` (see `tests/contract_pg.rs`); without it
//! the test says so and passes, except under `CI=true`.

use std::error::Error as StdError;
use std::sync::Mutex;
use std::thread;

use idemstore::chrono::{DateTime, Duration, TimeZone, Utc};
use idemstore::postgres::PgStore;
use idemstore::{Begin, Claim, NewEntry, ResponseRecord, Settlement};
use postgres::{Client, NoTls};

mod common;

use common::pg::{Server, url};

type TestResult = Result<(), Box<dyn StdError>>;

/// The tests here end or restart the server's connections: one at a time.
static SERVER: Mutex<()> = Mutex::new(());

fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2025, 1, 1, 0, 0, 0).unwrap()
}

/// Ends every server connection of `app` but the caller's, and waits until
/// their processes are gone (a request sent to one still exiting would be
/// lost unread, which a one-statement write must not retry); how many.
fn terminate(admin: &mut Client, app: &str) -> Result<i64, Box<dyn StdError>> {
    let n: i64 = admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity \
             WHERE application_name = $1 AND pid <> pg_backend_pid()",
            &[&app],
        )?
        .get(0);
    Ok(n)
}

/// A one-statement write made first on connections the server ended. It
/// commits in the round trip that carries it, so it runs again only if the
/// server never got it (a broken pipe). The server's farewell (`57P01`)
/// reads the same whether it came before the statement or after its
/// commit: then the call says its outcome is unknown (SQLSTATE `08007`),
/// it did not commit here (the server had gone before it), and made again
/// it works, on a connection checked first.
fn first_write<T>(
    mut call: impl FnMut() -> idemstore::Result<T>,
    committed: impl Fn() -> idemstore::Result<bool>,
) -> Result<T, Box<dyn StdError>> {
    match call() {
        Ok(v) => Ok(v),
        Err(e) => {
            assert_unknown(&e);
            assert!(!committed()?, "{e}");
            Ok(call()?)
        }
    }
}

/// `e` says the call may have committed.
fn assert_unknown(e: &idemstore::Error) {
    let idemstore::Error::Postgres { code, message, .. } = e else {
        panic!("{e:?}")
    };
    assert_eq!(code.as_deref(), Some("08007"), "{e}");
    assert!(message.contains("unknown"), "{message}");
    assert!(e.to_string().contains("may have committed"), "{e}");
}

#[test]
fn every_kind_of_call_survives_connections_the_server_dropped() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let _one = SERVER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let tag = format!(
        "{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .subsec_nanos()
    );
    let app = format!("idemstore_retry_{tag}");
    let schema = format!("retry_{tag}");
    let store = PgStore::builder()
        .schema(&schema)
        .pool_size(4)
        .connect(&format!("{url} application_name={app}"))?;
    let mut admin = Client::connect(&url, NoTls)?;
    let inbox = store.inbox("payments")?;
    let outbox = store.outbox();
    let keys = store.idempotency_keys();

    // Four pooled connections in use at once, so four are open.
    thread::scope(|s| {
        for t in 0..4 {
            let inbox = inbox.clone();
            s.spawn(move || {
                for i in 0..20 {
                    inbox.claim(&format!("warm-{t}-{i}"), t0()).unwrap();
                }
            });
        }
    });
    assert!(terminate(&mut admin, &app)? >= 1);

    // A one-statement write.
    assert!(first_write(
        || inbox.claim("evt-1", t0()),
        || inbox.seen("evt-1")
    )?);
    assert!(!inbox.claim("evt-1", t0())?);
    terminate(&mut admin, &app)?;
    // Reads.
    assert!(inbox.seen("evt-1")?);
    assert_eq!(inbox.len()?, 81);
    terminate(&mut admin, &app)?;
    // A claim with an effect: the effect runs once.
    let mut runs = 0;
    let out = inbox.claim_with("evt-2", t0(), |tx| {
        runs += 1;
        outbox.enqueue_in(tx, NewEntry::new("c", "mailer", "k1", b"hi".to_vec()), t0())?;
        Ok::<_, idemstore::Error>(7)
    })?;
    assert!(matches!(out, Claim::Applied(7)));
    assert_eq!(runs, 1);
    terminate(&mut admin, &app)?;
    // The outbox: enqueue, claim, settle.
    let enqueued = first_write(
        || outbox.enqueue(NewEntry::new("c", "mailer", "k2", b"yo".to_vec()), t0()),
        || Ok(outbox.counts()?.pending == 2),
    )?;
    assert!(enqueued.is_new());
    terminate(&mut admin, &app)?;
    let claimed = outbox.claim_due(t0() + Duration::seconds(1), 10, "w1")?;
    assert_eq!(claimed.len(), 2);
    terminate(&mut admin, &app)?;
    for e in &claimed {
        first_write(
            || {
                outbox.settle(
                    e.fence(),
                    Settlement::Completed,
                    t0() + Duration::seconds(2),
                )
            },
            || Ok(outbox.counts()?.completed > 0),
        )?;
    }
    assert_eq!(outbox.counts()?.completed, 2);
    terminate(&mut admin, &app)?;
    // Idempotency keys: reserve, complete, replay.
    let Begin::Proceed(r) = keys.begin("", "req-1", "fp", t0())? else {
        panic!("a new key proceeds")
    };
    terminate(&mut admin, &app)?;
    let response = ResponseRecord::new("", "req-1", "fp", 201, b"made".to_vec(), t0());
    assert!(first_write(
        || keys.complete(&r, response.clone(), t0()),
        || Ok(keys.get("", "req-1", t0())?.is_some())
    )?);
    terminate(&mut admin, &app)?;
    assert!(matches!(
        keys.begin("", "req-1", "fp", t0())?,
        Begin::Replay(_)
    ));
    // A write closure of the caller's: it runs once.
    terminate(&mut admin, &app)?;
    let mut runs = 0;
    store.write(|tx| {
        runs += 1;
        inbox.claim_in(tx, "evt-3", t0())
    })?;
    assert_eq!(runs, 1);
    assert!(inbox.seen("evt-3")?);

    drop((inbox, outbox, keys, store));
    admin.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))?;
    Ok(())
}

#[test]
fn a_claim_on_a_pooled_connection_after_an_immediate_restart_is_retried() -> TestResult {
    let Some(url) = url() else { return Ok(()) };
    let Some(server) = Server::from_env() else {
        return Ok(());
    };
    let _one = SERVER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let schema = format!("restart_{}", std::process::id());
    let store = PgStore::builder()
        .schema(&schema)
        .pool_size(4)
        .connect(&url)?;
    let inbox = store.inbox("payments")?;
    // Four pooled connections, open and idle.
    thread::scope(|s| {
        for t in 0..4 {
            let inbox = inbox.clone();
            s.spawn(move || {
                for i in 0..20 {
                    inbox.claim(&format!("warm-{t}-{i}"), t0()).unwrap();
                }
            });
        }
    });
    // `pg_ctl restart -m immediate`: no checkpoint, the WAL replayed.
    server.crash();
    server.start();
    // Every pooled connection is dead; the first write on one cannot be
    // sent (broken pipe): it runs again on a live connection.
    for i in 0..4 {
        assert!(inbox.claim(&format!("after-{i}"), t0())?);
    }
    assert!(!inbox.claim("after-0", t0())?);
    assert_eq!(inbox.len()?, 84);
    drop((inbox, store));
    Client::connect(&url, NoTls)?.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))?;
    Ok(())
}

/// A loopback proxy in front of the test server (`127.0.0.1` to its unix
/// socket) that, once armed, lets through the request that commits —
/// a `COMMIT`, or the `Sync` closing a statement outside a transaction
/// whose text starts as the trigger says — swallows the server's answer
/// up to its `ReadyForQuery` (so the commit landed), hands the client the
/// server's farewell instead (`FATAL 57P01`, as from a shutdown or a
/// `pg_terminate_backend` racing the commit) and closes the connection at
/// the client's next request. Then it disarms: later connections pass
/// through untouched.
mod proxy {
    use std::collections::HashMap;
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::os::unix::net::UnixStream;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::thread;

    /// What the armed proxy cuts after.
    #[derive(Debug, Clone)]
    pub(super) enum Trigger {
        /// A simple query `COMMIT`.
        Commit,
        /// The `Sync` after an `Execute` of a statement, outside a
        /// transaction, whose text starts with this.
        Statement(String),
    }

    pub(super) struct Proxy {
        /// The connection string to use instead of the server's.
        pub(super) url: String,
        armed: Arc<Mutex<Option<Trigger>>>,
        cuts: Arc<AtomicUsize>,
    }

    impl Proxy {
        /// Starts a proxy in front of the server named by `url` (a unix
        /// socket, as `.ci/postgres` starts it).
        pub(super) fn start(url: &str) -> Proxy {
            let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
            let (socket, proxied) =
                super::common::faulty_net::in_front_of(url, listener.local_addr().unwrap().port());
            let armed: Arc<Mutex<Option<Trigger>>> = Arc::default();
            let cuts = Arc::new(AtomicUsize::new(0));
            {
                let (armed, cuts) = (armed.clone(), cuts.clone());
                thread::spawn(move || {
                    for client in listener.incoming() {
                        let Ok(client) = client else { return };
                        let (armed, cuts, socket) = (armed.clone(), cuts.clone(), socket.clone());
                        thread::spawn(move || relay(&client, &socket, &armed, &cuts));
                    }
                });
            }
            Proxy {
                url: proxied,
                armed,
                cuts,
            }
        }

        /// Cuts the next request `trigger` names, once.
        pub(super) fn arm(&self, trigger: Trigger) {
            *self.armed.lock().unwrap() = Some(trigger);
        }

        /// How many connections it has cut.
        pub(super) fn cuts(&self) -> usize {
            self.cuts.load(Ordering::SeqCst)
        }
    }

    fn relay(
        client: &TcpStream,
        socket: &PathBuf,
        armed: &Mutex<Option<Trigger>>,
        cuts: &AtomicUsize,
    ) {
        let Ok(server) = UnixStream::connect(socket) else {
            return;
        };
        let cut = Arc::new(AtomicBool::new(false));
        let back = {
            let (mut from, mut to) = (server.try_clone().unwrap(), client.try_clone().unwrap());
            let cut = cut.clone();
            thread::spawn(move || answers(&mut from, &mut to, &cut))
        };
        requests(
            client.try_clone().unwrap(),
            server.try_clone().unwrap(),
            armed,
            &cut,
            cuts,
        );
        let _ = back.join();
        let _ = client.shutdown(Shutdown::Both);
        let _ = server.shutdown(Shutdown::Both);
    }

    /// Client to server: messages parsed just enough to spot the trigger.
    fn requests(
        mut client: TcpStream,
        mut server: UnixStream,
        armed: &Mutex<Option<Trigger>>,
        cut: &AtomicBool,
        cuts: &AtomicUsize,
    ) {
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        let mut started = false;
        // Statement texts by name, and whether the pending Execute's is
        // the trigger's.
        let mut statements: HashMap<String, String> = HashMap::new();
        let mut bound = String::new();
        let mut executed = false;
        let mut in_tx = false;
        loop {
            let n = match client.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            buf.extend_from_slice(&chunk[..n]);
            // The complete messages of this read, and whether one is the
            // trigger.
            let mut end = 0;
            let mut hit = false;
            loop {
                let rest = &buf[end..];
                if !started {
                    // Untyped: the startup message (or a request for TLS).
                    if rest.len() < 8 {
                        break;
                    }
                    let len = u32::from_be_bytes(rest[0..4].try_into().unwrap()) as usize;
                    if rest.len() < len {
                        break;
                    }
                    let code = u32::from_be_bytes(rest[4..8].try_into().unwrap());
                    started = code == 196_608; // protocol 3.0
                    end += len;
                    continue;
                }
                if rest.len() < 5 {
                    break;
                }
                let len = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
                if rest.len() < 1 + len {
                    break;
                }
                let (kind, body) = (rest[0], &rest[5..=len]);
                let text = |at: usize| -> String {
                    let s = &body[at..];
                    let z = s.iter().position(|&b| b == 0).unwrap_or(s.len());
                    String::from_utf8_lossy(&s[..z]).into_owned()
                };
                let trigger = armed.lock().unwrap().clone();
                match kind {
                    b'Q' => {
                        let q = text(0);
                        let q = q.trim().trim_end_matches(';').to_ascii_uppercase();
                        if q == "BEGIN" {
                            in_tx = true;
                        } else if q == "COMMIT" || q == "ROLLBACK" {
                            in_tx = false;
                            hit |= q == "COMMIT" && matches!(trigger, Some(Trigger::Commit));
                        }
                    }
                    b'P' => {
                        let name = text(0);
                        let query = text(name.len() + 1);
                        statements.insert(name, query);
                    }
                    b'B' => {
                        let portal = text(0);
                        bound = statements
                            .get(&text(portal.len() + 1))
                            .cloned()
                            .unwrap_or_default();
                    }
                    b'E' => executed = true,
                    b'S' => {
                        if let Some(Trigger::Statement(start)) = &trigger
                            && executed
                            && !in_tx
                            && bound.starts_with(start.as_str())
                        {
                            hit = true;
                        }
                        executed = false;
                    }
                    _ => {}
                }
                end += 1 + len;
            }
            if hit && armed.lock().unwrap().take().is_some() {
                // Before the request reaches the server: what comes back
                // from here on is its answer.
                cut.store(true, Ordering::SeqCst);
                cuts.fetch_add(1, Ordering::SeqCst);
            }
            if server.write_all(&buf[..end]).is_err() {
                return;
            }
            buf.drain(..end);
            if cut.load(Ordering::SeqCst) {
                // Nothing more reaches the server on this connection: the
                // next request (or the client's goodbye) meets its end, as
                // it would after the server's farewell.
                let _ = client.read(&mut chunk);
                let _ = client.shutdown(Shutdown::Both);
                return;
            }
        }
    }

    /// Server to client: passed through until the cut; then the server's
    /// answer is read to its `ReadyForQuery` (the commit is done), and the
    /// client gets the farewell instead.
    fn answers(server: &mut UnixStream, client: &mut TcpStream, cut: &AtomicBool) {
        let mut chunk = vec![0u8; 64 * 1024];
        let mut swallowed = Vec::new();
        loop {
            let n = match server.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if !cut.load(Ordering::SeqCst) {
                if client.write_all(&chunk[..n]).is_err() {
                    return;
                }
                continue;
            }
            swallowed.extend_from_slice(&chunk[..n]);
            if ready_for_query(&swallowed) {
                // The farewell alone; the connection's end comes with the
                // client's next request.
                let _ = client.write_all(&farewell());
                let _ = client.flush();
                let _ = server.shutdown(Shutdown::Both);
                return;
            }
        }
    }

    /// Whether the backend messages in `bytes` reach a `ReadyForQuery`.
    fn ready_for_query(bytes: &[u8]) -> bool {
        let mut at = 0;
        while bytes.len() >= at + 5 {
            let len = u32::from_be_bytes(bytes[at + 1..at + 5].try_into().unwrap()) as usize;
            if bytes[at] == b'Z' {
                return true;
            }
            at += 1 + len;
        }
        false
    }

    /// `ErrorResponse`: FATAL 57P01, as the server sends it when it ends a
    /// connection.
    fn farewell() -> Vec<u8> {
        let mut body = Vec::new();
        for (field, value) in [
            (b'S', "FATAL"),
            (b'V', "FATAL"),
            (b'C', "57P01"),
            (b'M', "terminating connection due to administrator command"),
        ] {
            body.push(field);
            body.extend_from_slice(value.as_bytes());
            body.push(0);
        }
        body.push(0);
        let mut m = vec![b'E'];
        m.extend_from_slice(&u32::try_from(body.len() + 4).unwrap().to_be_bytes());
        m.extend_from_slice(&body);
        m
    }
}

#[test]
fn a_commit_whose_answer_was_lost_is_never_answered_as_a_duplicate() -> TestResult {
    use proxy::{Proxy, Trigger};
    let Some(url) = url() else { return Ok(()) };
    // Not while another test restarts the server.
    let _one = SERVER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let proxy = Proxy::start(&url);
    let schema = format!("lost_{}", std::process::id());
    let store = PgStore::builder()
        .schema(&schema)
        .pool_size(1)
        .connect(&proxy.url)?;
    let inbox = store.inbox("payments")?;
    let outbox = store.outbox();
    let keys = store.idempotency_keys();

    // A first claim, one statement that commits in its round trip.
    proxy.arm(Trigger::Statement(format!("INSERT INTO {schema}.inbox")));
    let first = inbox.claim("evt-1", t0());
    assert_eq!(proxy.cuts(), 1);
    // Not `Ok(false)`: this call's own claim is no duplicate.
    assert_unknown(&first.expect_err("a claim whose commit's answer was lost"));
    // It did commit.
    assert!(inbox.seen("evt-1")?);

    // A first `begin`: its transaction's COMMIT.
    proxy.arm(Trigger::Commit);
    let began = keys.begin("", "req-1", "fp", t0());
    assert_eq!(proxy.cuts(), 2);
    // Not `InFlight` against its own request.
    assert_unknown(&began.expect_err("a begin whose commit's answer was lost"));
    assert!(matches!(
        keys.begin("", "req-1", "fp", t0())?,
        Begin::InFlight { .. }
    ));

    // A `claim_due`: the entries it took are not stranded unseen.
    assert!(
        outbox
            .enqueue(NewEntry::new("c", "mailer", "k1", b"hi".to_vec()), t0())?
            .is_new()
    );
    proxy.arm(Trigger::Commit);
    let claimed = outbox.claim_due(t0(), 10, "w1");
    assert_eq!(proxy.cuts(), 3);
    assert_unknown(&claimed.expect_err("a claim_due whose commit's answer was lost"));
    assert_eq!(outbox.counts()?.dispatching, 1);

    drop((inbox, outbox, keys, store));
    Client::connect(&url, NoTls)?.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))?;
    Ok(())
}
