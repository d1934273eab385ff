//! Reads answer only from durable state, whatever they answer: a read whose
//! closure fails on what a commit not yet on disk changed waits for that
//! commit like one that succeeds (a power cut would undo the change, and
//! the answer with it). And what a read closure must not call is refused,
//! not a deadlock.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::{FaultyDisk, eventually};
use idemstore::redb::{ReadableTable as _, TableDefinition};
use idemstore::{Error, Result, Store};

const ROWS: TableDefinition<&str, u64> = TableDefinition::new("app.rows");

/// What the application's read closure answers for a missing row.
#[derive(Debug)]
enum AppError {
    Gone,
    Store(#[expect(dead_code, reason = "shown by the assertions' Debug output")] Error),
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        AppError::Store(e)
    }
}

/// Long enough that a read which does not wait has answered by then many
/// times over.
const A_WHILE: Duration = Duration::from_millis(300);
const BOUND: Duration = Duration::from_secs(30);

#[test]
fn a_read_that_fails_on_a_deletion_not_yet_durable_waits_for_it() -> Result<()> {
    let disk = FaultyDisk::new();
    let store = Store::builder().open_with_backend(disk.backend())?;
    store.write(|tx| {
        tx.open_table(ROWS)?.insert("k", 1)?;
        Ok::<_, Error>(())
    })?;

    // A closure deletes the row; its commit is held on the way to disk.
    disk.hold_syncs();
    let deleter = {
        let store = store.clone();
        std::thread::spawn(move || {
            store.write(|tx| {
                tx.open_table(ROWS)?.remove("k")?;
                Ok::<_, Error>(())
            })
        })
    };
    eventually("the deletion's commit reaches the disk's gate", || {
        disk.syncs_held() > 0
    });

    let (answer, answered) = mpsc::channel();
    {
        let store = store.clone();
        std::thread::spawn(move || {
            let out = store.read(|tx| match tx.open_table(ROWS) {
                Ok(rows) => match rows.get("k").map_err(Error::from)? {
                    Some(v) => Ok(v.value()),
                    None => Err(AppError::Gone),
                },
                Err(e) => Err(AppError::Store(Error::from(idemstore::redb::Error::from(
                    e,
                )))),
            });
            let _ = answer.send(out);
        });
    }
    assert!(
        answered.recv_timeout(A_WHILE).is_err(),
        "the read answered `gone` before the deletion it saw was durable"
    );
    disk.open_syncs();
    let out = answered.recv_timeout(BOUND).expect("the read answers");
    assert!(matches!(out, Err(AppError::Gone)), "{out:?}");
    deleter.join().unwrap()?;
    Ok(())
}

#[test]
fn compacting_inside_a_read_closure_is_refused_not_a_deadlock() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("store.idem"))?;
    let (answer, answered) = mpsc::channel();
    {
        let store = store.clone();
        std::thread::spawn(move || {
            let _ = answer.send(store.read(|_| store.compact()));
        });
    }
    let out = answered
        .recv_timeout(BOUND)
        .expect("compact inside a read answers");
    assert!(matches!(out, Err(Error::Reentrant)), "{out:?}");
    let out = store.read(|_| store.check_integrity());
    assert!(matches!(out, Err(Error::Reentrant)), "{out:?}");
    // Outside the closure both work.
    store.compact()?;
    assert!(store.check_integrity()?);
    Ok(())
}
