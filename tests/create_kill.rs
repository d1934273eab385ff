//! Kill test of a store file's creation: a child process creates a fresh
//! store file and is killed (SIGKILL) at random moments around it. The file
//! is then either absent or a store that opens, never a half-made file
//! that no later open accepts.

mod common;

use std::time::Duration;

use idemstore::Store;

const CHILD_ENV: &str = "IDEMSTORE_CREATE_CHILD_FILE";

/// The child: creates the store file, claims one key, and waits to be
/// killed.
#[test]
#[ignore = "run by `a_kill_while_creating_a_store_leaves_no_file_or_a_whole_one` as a child process"]
fn create_child() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let store = Store::open(path).unwrap();
    store
        .inbox("made")
        .unwrap()
        .claim("k", chrono::Utc::now())
        .unwrap();
    println!("created");
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn a_kill_while_creating_a_store_leaves_no_file_or_a_whole_one() {
    let dir = tempfile::tempdir().unwrap();
    let rounds = 30;
    let (mut absent, mut whole) = (0, 0);
    for round in 0..rounds {
        let path = dir.path().join(format!("s{round}.idem"));
        let mut child = common::child_test("create_child");
        child.env(CHILD_ENV, &path);
        let mut child = child.spawn().unwrap();
        // The kill lands anywhere from before the open to after it: the
        // child's start-up takes a few ms of these.
        std::thread::sleep(Duration::from_micros(500 * (round % 20)));
        child.kill().unwrap();
        child.wait().unwrap();
        if path.exists() {
            let store = Store::open(&path)
                .unwrap_or_else(|e| panic!("round {round}: a killed creation left {e}"));
            drop(store);
            whole += 1;
        } else {
            absent += 1;
        }
    }
    assert_eq!(absent + whole, rounds);
}
