//! A panic inside the engine while it commits a batch (here: the storage
//! backend's `sync_data`) never leaves a caller waiting: every call answers,
//! `Ok` or a clear `Err`, and every `Ok` is durable.

mod common;

use std::collections::BTreeSet;
use std::sync::mpsc;
use std::time::Duration;

use common::{FaultyDisk, t};
use idemstore::{Error, Result, Store};

const THREADS: usize = 16;
const CLAIMS: usize = 40;
/// Far above what any call takes here; a call that has not answered by then
/// is waiting for something that will never come.
const BOUND: Duration = Duration::from_secs(60);

#[test]
fn a_panic_in_sync_data_under_sixteen_claiming_threads_answers_every_caller() -> Result<()> {
    let disk = FaultyDisk::new();
    let store = Store::builder().open_with_backend(disk.backend())?;
    let inbox = store.inbox("events")?;
    assert!(inbox.claim("warm-up", t(0))?);
    disk.panic_at_sync(disk.syncs() + 3);

    let (answers, answered) = mpsc::channel();
    for thread in 0..THREADS {
        let (inbox, answers) = (inbox.clone(), answers.clone());
        std::thread::spawn(move || {
            for n in 0..CLAIMS {
                let key = format!("evt-{thread}-{n}");
                let out = inbox.claim(&key, t(1));
                if answers.send((key, out)).is_err() {
                    return;
                }
            }
        });
    }
    drop(answers);

    let mut acknowledged = BTreeSet::new();
    let mut panicked = 0;
    for _ in 0..THREADS * CLAIMS {
        let (key, out) = answered
            .recv_timeout(BOUND)
            .expect("every claim answers within the bound: no caller is left waiting");
        match out {
            Ok(first) => {
                assert!(first, "{key} is claimed once");
                acknowledged.insert(key);
            }
            Err(Error::Panicked { during, message }) => {
                assert_eq!(during, "a batch commit");
                assert!(message.contains("injected panic"), "{message}");
                panicked += 1;
            }
            Err(e) => panic!("{key}: unexpected error {e}"),
        }
    }
    assert!(
        panicked > 0,
        "the batch whose fsync panicked reports the panic"
    );
    common::report(&format!(
        "engine panics: {} claims acknowledged, {panicked} answered the panic (its batch, and the calls refused after it)",
        acknowledged.len()
    ));
    // After the panic the store refuses writes at once, saying why: the
    // panic, not an I/O error that never happened.
    let after = inbox.claim("after-the-panic", t(2));
    assert!(
        matches!(&after, Err(Error::Panicked { during: "a batch commit", message })
            if message.contains("injected panic") && message.contains("reopened")),
        "a later call gets a clear error: {after:?}"
    );
    drop(inbox);
    drop(store);

    // Every acknowledged claim is durable (D1): reopen what reached the platter.
    let reopened = Store::builder()
        .open_with_backend(FaultyDisk::from_image(disk.durable_image()).backend())?;
    let inbox = reopened.inbox("events")?;
    for key in &acknowledged {
        assert!(inbox.seen(key)?, "{key} was acknowledged but is gone");
    }
    assert!(inbox.claim("after-reopen", t(3))?, "a reopened store works");
    Ok(())
}
