//! The dispatching child processes of the destination scenarios: the test
//! binary run again, running only `dispatching_child`, whose sends reach
//! the parent's remote over 127.0.0.1.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Stdio};
use std::time::Duration;

use chrono::{DateTime, Utc};
use idemstore::{Clock, Dispatcher, Result};

use super::common::{child_test, env_of};
use super::remote::{Link, send_to};
use super::{quick_retries, shared};

/// How a child dispatches.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Setup {
    pub(crate) workers: usize,
    pub(crate) batch_size: usize,
    pub(crate) lease_ms: u64,
    /// How long each send takes.
    pub(crate) send_us: u64,
    /// How far ahead of the system's clock the dispatcher's runs: a
    /// restarted process whose clock is past the dead one's leases releases
    /// their claims at once, without waiting them out.
    pub(crate) ahead_ms: u64,
}

/// The system's clock, `0` ahead.
struct Ahead(chrono::Duration);

impl Clock for Ahead {
    fn now(&self) -> DateTime<Utc> {
        Utc::now() + self.0
    }
}

#[test]
#[ignore = "run by the scenarios as a child process"]
fn dispatching_child() -> Result<()> {
    let path = PathBuf::from(env_of("IDEMSTORE_SCEN_PATH"));
    let link = Link::Tcp(env_of("IDEMSTORE_SCEN_REMOTE"));
    let process = env_of("IDEMSTORE_SCEN_PROCESS");
    let setup: Vec<u64> = env_of("IDEMSTORE_SCEN_SETUP")
        .split(',')
        .map(|n| n.parse().unwrap())
        .collect();
    let [workers, batch_size, lease_ms, send_us, ahead_ms] = setup[..] else {
        panic!("five settings");
    };
    let store = shared().open(&path)?;
    let took = Duration::from_micros(send_us);
    let handle = Dispatcher::builder(store.outbox())
        .workers(usize::try_from(workers).unwrap())
        .batch_size(usize::try_from(batch_size).unwrap())
        .lease(Duration::from_millis(lease_ms))
        .retry(quick_retries())
        .clock(Ahead(chrono::Duration::milliseconds(
            i64::try_from(ahead_ms).unwrap(),
        )))
        .worker_id(process.clone())
        .start(move |entry| send_to(&link, &process, entry, took))?;
    println!("dispatching");
    // Runs until killed, or until the parent closes stdin.
    let mut word = String::new();
    let _ = std::io::stdin().read_line(&mut word);
    handle.shutdown()?;
    Ok(())
}

/// A dispatching child process (and its stdout, kept open so that it can
/// print to the end); killed if the test ends without stopping it.
pub(crate) struct Dispatching {
    child: Child,
    stdout: std::io::Lines<BufReader<ChildStdout>>,
}

impl Dispatching {
    /// Starts a child and waits until its dispatcher runs.
    pub(crate) fn start(path: &Path, remote: &str, process: &str, s: Setup) -> Dispatching {
        let setup = format!(
            "{},{},{},{},{}",
            s.workers, s.batch_size, s.lease_ms, s.send_us, s.ahead_ms
        );
        let mut child = child_test("children::dispatching_child")
            .env("IDEMSTORE_SCEN_PATH", path)
            .env("IDEMSTORE_SCEN_REMOTE", remote)
            .env("IDEMSTORE_SCEN_PROCESS", process)
            .env("IDEMSTORE_SCEN_SETUP", setup)
            .stdin(Stdio::piped())
            .spawn()
            .expect("spawn a child");
        let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut child = Dispatching { child, stdout };
        // The test harness may print its own words first, on the same line.
        let started = child
            .stdout
            .by_ref()
            .any(|l| l.is_ok_and(|l| l.trim_end().ends_with("dispatching")));
        assert!(started, "the child {process} ended before it dispatched");
        child
    }

    /// Shuts the child's dispatcher down cleanly.
    pub(crate) fn stop(mut self) {
        drop(self.child.stdin.take());
        self.stdout.by_ref().for_each(drop);
        let status = self.child.wait().unwrap();
        assert!(status.success(), "the child shut down cleanly: {status}");
    }

    /// SIGKILLs it.
    pub(crate) fn kill(mut self) {
        self.child.kill().expect("SIGKILL the child");
        self.child.wait().unwrap();
    }
}

impl Drop for Dispatching {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
