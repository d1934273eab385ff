//! The PostgreSQL test server, for the test binaries of feature `postgres`
//! outside the contract suite: its connection string, fresh schemas, and
//! control of the server itself (restart).
//!
//! `.ci/postgres run -- CMD` starts a throwaway server and sets
//! `IDEMSTORE_TEST_POSTGRES` (and `IDEMSTORE_TEST_PGDATA`,
//! `IDEMSTORE_TEST_PGBIN` for a restart). Without the connection string the
//! tests say so and pass, except under `CI=true`, where its absence fails
//! them.

use std::sync::atomic::{AtomicU64, Ordering};

use postgres::{Client, NoTls};

/// The server's connection string, or `None` (after saying so) when the
/// tests are to skip; a panic under `CI=true`, where the server must be
/// there.
pub fn url() -> Option<String> {
    match std::env::var("IDEMSTORE_TEST_POSTGRES") {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "CI=true but IDEMSTORE_TEST_POSTGRES is not set: run the PostgreSQL \
                 tests under .ci/postgres"
            );
            eprintln!(
                "skipped: IDEMSTORE_TEST_POSTGRES is not set (a libpq connection string; \
                 .ci/postgres run -- cargo test --features postgres ...)"
            );
            None
        }
    }
}

/// A schema name no other test (of this run or an earlier one) uses.
pub fn unique_schema() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "t{}_{}_{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Runs `f` on a thread of its own and returns what it returned. The
/// synchronous client runs a tokio runtime of its own inside each call,
/// which panics on a thread that runs a runtime already: an async test
/// makes its direct store calls through this.
pub fn off_runtime<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| s.spawn(f).join().expect("no panic"))
}

/// A plain connection to the server.
pub fn client(url: &str) -> Client {
    Client::connect(url, NoTls).expect("a plain connection to the test server")
}

/// Drops its schema, with everything in it, when dropped.
#[derive(Debug)]
pub struct DropSchema {
    pub url: String,
    pub schema: String,
}

impl Drop for DropSchema {
    fn drop(&mut self) {
        off_runtime(|| {
            if let Ok(mut client) = Client::connect(&self.url, NoTls) {
                let _ =
                    client.batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema));
            }
        });
    }
}

/// How to restart the test server: its data directory and binaries, from
/// `IDEMSTORE_TEST_PGDATA` and `IDEMSTORE_TEST_PGBIN` (set by
/// `.ci/postgres`); `None` (after saying so) when they are not set, a
/// panic under `CI=true`.
#[derive(Debug, Clone)]
pub struct Server {
    data: String,
    bin: String,
}

impl Server {
    pub fn from_env() -> Option<Server> {
        let var = |name| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        if let (Some(data), Some(bin)) = (var("IDEMSTORE_TEST_PGDATA"), var("IDEMSTORE_TEST_PGBIN"))
        {
            return Some(Server { data, bin });
        }
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but IDEMSTORE_TEST_PGDATA / IDEMSTORE_TEST_PGBIN are not set: \
             run the PostgreSQL tests under .ci/postgres"
        );
        eprintln!(
            "skipped: IDEMSTORE_TEST_PGDATA and IDEMSTORE_TEST_PGBIN are not set \
             (.ci/postgres sets them)"
        );
        None
    }

    /// `pg_ctl` as the server's owner: `postgres` when the tests run as
    /// root (the server refuses to run as root), else this user.
    fn pg_ctl(&self) -> std::process::Command {
        let pg_ctl = format!("{}/pg_ctl", self.bin);
        let root = std::process::Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| o.stdout.trim_ascii() == b"0");
        let mut cmd = if root {
            let mut cmd = std::process::Command::new("runuser");
            cmd.args(["-u", "postgres", "--", &pg_ctl]);
            cmd
        } else {
            std::process::Command::new(pg_ctl)
        };
        cmd.args(["-D", &self.data]);
        cmd
    }

    /// Stops the server at once, as a crash would (`-m immediate`: no
    /// checkpoint; the restart replays the WAL), and waits until it is
    /// down.
    pub fn crash(&self) {
        let out = self
            .pg_ctl()
            .args(["-m", "immediate", "-w", "stop"])
            .output()
            .expect("run pg_ctl stop");
        assert!(out.status.success(), "pg_ctl stop: {out:?}");
    }

    /// Starts the server again with the options it was first started with
    /// (`postmaster.opts`: its socket directory, its settings), its log
    /// beside its data directory, and waits until it accepts connections.
    pub fn start(&self) {
        let opts = std::fs::read_to_string(format!("{}/postmaster.opts", self.data))
            .expect("the server's postmaster.opts");
        // `/path/to/postgres "-D" "…" "-k" "…" …`: the options after the binary.
        let opts = opts.trim().split_once(' ').map_or("", |(_, rest)| rest);
        let log = std::path::Path::new(&self.data).with_file_name("server.log");
        let out = self
            .pg_ctl()
            .arg("-l")
            .arg(log)
            .args(["-o", opts, "-w", "start"])
            .output()
            .expect("run pg_ctl start");
        assert!(out.status.success(), "pg_ctl start: {out:?}");
    }
}
