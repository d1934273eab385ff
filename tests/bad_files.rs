//! Files that are not stores, files in use, damaged records: clear errors, no panics.

mod common;

use std::io::{BufRead, BufReader, Write};

use chrono::{TimeZone, Utc};
use idemstore::redb::TableDefinition;
use idemstore::{Error, NewEntry, Result, Store};

#[test]
fn random_bytes_are_not_a_store() {
    let dir = tempfile::tempdir().unwrap();
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    for (i, len) in [1usize, 100, 4096, 70_000].into_iter().enumerate() {
        let path = dir.path().join(format!("random-{i}"));
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed.to_le_bytes()[3]
            })
            .collect();
        std::fs::write(&path, &bytes).unwrap();
        let err = Store::open(&path).expect_err("random bytes must not open");
        assert!(
            matches!(err, Error::NotAStore { .. } | Error::Storage(_)),
            "{len} random bytes: {err:?}"
        );
        let before = std::fs::read(&path).unwrap();
        assert_eq!(before, bytes, "a refused file is not modified");
    }
    common::report("bad files: 4 files of random bytes refused, each left unmodified");
}

#[test]
fn a_short_text_file_is_not_a_store() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.txt");
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(b"shopping list: milk, eggs\n").unwrap();
    drop(f);
    let err = Store::open(&path).expect_err("a text file is not a store");
    assert!(matches!(err, Error::NotAStore { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("cannot be opened as a store"), "{msg}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        b"shopping list: milk, eggs\n",
        "the text file is untouched"
    );
}

#[test]
fn an_empty_file_becomes_a_new_store() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty.idem");
    std::fs::File::create(&path).unwrap();
    let store = Store::open(&path)?;
    assert!(store.inbox("i")?.claim("k", Utc::now())?);
    Ok(())
}

#[test]
fn the_same_file_opened_twice_is_refused() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.idem");
    let store = Store::open(&path)?;
    let err = Store::open(&path).expect_err("second open must fail");
    assert!(matches!(err, Error::AlreadyOpen { .. }), "{err:?}");
    assert!(err.to_string().contains("already open"));
    // The first handle is unaffected; after it closes the file opens again.
    assert!(store.inbox("i")?.claim("k", Utc::now())?);
    drop(store);
    let again = Store::open(&path)?;
    assert!(again.inbox("i")?.seen("k")?);
    Ok(())
}

#[test]
fn a_newer_format_version_is_incompatible() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.idem");
    drop(Store::open(&path)?);
    {
        let db = idemstore::redb::Database::create(&path).map_err(idemstore::redb::Error::from)?;
        let tx = db.begin_write().map_err(idemstore::redb::Error::from)?;
        tx.open_table(TableDefinition::<&str, u64>::new("idemstore.meta"))?
            .insert("format_version", 99)?;
        tx.commit().map_err(idemstore::redb::Error::from)?;
    }
    let before = raw_contents(&path)?;
    let err = Store::open(&path).expect_err("format 99 must be refused");
    // redb's clean close may rewrite its own header and allocator state;
    // no table of the file changes.
    assert_eq!(
        raw_contents(&path)?,
        before,
        "a refused newer file keeps its tables"
    );
    match &err {
        Error::IncompatibleFormat { found, supported } => {
            assert!(found.contains("99"), "{found}");
            assert_eq!(*supported, 3);
        }
        other => panic!("expected IncompatibleFormat, got {other:?}"),
    }
    Ok(())
}

/// The names of a file's tables, and the rows of its meta table.
type RawContents = (Vec<String>, Vec<(String, u64)>);

/// Every table of the redb file at `path` and the rows of its meta table,
/// read with redb alone.
fn raw_contents(path: &std::path::Path) -> Result<RawContents> {
    use idemstore::redb::{ReadableDatabase as _, ReadableTable as _, TableHandle as _};
    let db = idemstore::redb::Database::open(path).map_err(idemstore::redb::Error::from)?;
    let tx = db.begin_read().map_err(idemstore::redb::Error::from)?;
    let tables = tx
        .list_tables()
        .map_err(idemstore::redb::Error::from)?
        .map(|t| t.name().to_owned())
        .collect();
    let meta = tx.open_table(TableDefinition::<&str, u64>::new("idemstore.meta"))?;
    let rows = meta
        .iter()?
        .map(|r| r.map(|(k, v)| (k.value().to_owned(), v.value())))
        .collect::<std::result::Result<_, _>>()
        .map_err(idemstore::redb::Error::from)?;
    Ok((tables, rows))
}

#[test]
fn a_foreign_redb_file_with_clashing_tables_is_incompatible() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("other.redb");
    {
        let db = idemstore::redb::Database::create(&path).map_err(idemstore::redb::Error::from)?;
        let tx = db.begin_write().map_err(idemstore::redb::Error::from)?;
        // Same name as the store's meta table, other types.
        tx.open_table(TableDefinition::<u64, u64>::new("idemstore.meta"))?
            .insert(1, 2)?;
        tx.commit().map_err(idemstore::redb::Error::from)?;
    }
    let err = Store::open(&path).expect_err("clashing tables must be refused");
    assert!(matches!(err, Error::IncompatibleFormat { .. }), "{err:?}");
    Ok(())
}

#[test]
fn a_callers_table_opened_with_other_types_gets_redbs_own_error() -> Result<()> {
    const CREATED: TableDefinition<&str, u64> = TableDefinition::new("app.balances");
    const MISREAD: TableDefinition<u64, u64> = TableDefinition::new("app.balances");
    let store = Store::in_memory()?;
    store.write(|tx| {
        tx.open_table(CREATED)?.insert("alice", 10)?;
        Ok::<_, Error>(())
    })?;
    let written = store
        .write(|tx| {
            tx.open_table(MISREAD)?.insert(1, 2)?;
            Ok::<_, Error>(())
        })
        .expect_err("other types than the table was created with");
    let read = store
        .read(|tx| {
            tx.open_table(MISREAD)?;
            Ok::<_, Error>(())
        })
        .expect_err("other types than the table was created with");
    for err in [written, read] {
        assert!(matches!(err, Error::Storage(_)), "{err:?}");
        let redb_says = std::error::Error::source(&err)
            .expect("the engine's error is the source")
            .to_string();
        assert!(redb_says.contains("app.balances"), "{redb_says}");
        let msg = err.to_string();
        assert!(msg.contains(&redb_says), "{msg}");
        assert!(!msg.contains("incompatible store format"), "{msg}");
        assert!(!msg.contains("reopen"), "{msg}");
    }
    // The caller's mistake broke nothing.
    assert!(store.inbox("i")?.claim("k", Utc::now())?);
    Ok(())
}

#[test]
fn a_store_table_with_other_types_is_an_incompatible_format() -> Result<()> {
    let store = Store::in_memory()?;
    // Tables under the store's names, with other types than the store's.
    store.write(|tx| {
        tx.open_table(TableDefinition::<u64, u64>::new("idemstore.v1.outbox"))?
            .insert(1, 2)?;
        tx.open_table(TableDefinition::<u64, u64>::new("idemstore.v1.inbox"))?
            .insert(1, 2)?;
        Ok::<_, Error>(())
    })?;
    let outbox = store.outbox();
    let inbox = store.inbox("i")?;
    let errors = [
        outbox
            .get(idemstore::OutboxId(1))
            .expect_err("a read of the outbox"),
        outbox
            .enqueue(NewEntry::new("c", "d", "k", b"p".to_vec()), Utc::now())
            .expect_err("a write to the outbox"),
        inbox.seen("k").expect_err("a read of the inbox"),
        inbox
            .claim("k", Utc::now())
            .expect_err("a write to the inbox"),
    ];
    for err in errors {
        match &err {
            Error::IncompatibleFormat { found, .. } => {
                assert!(found.contains("idemstore.v1."), "{found}");
            }
            other => panic!("expected IncompatibleFormat, got {other:?}"),
        }
    }
    Ok(())
}

#[test]
fn a_corrupted_inbox_row_is_reported_not_panicked() -> Result<()> {
    let store = Store::in_memory()?;
    let inbox = store.inbox("i")?;
    assert!(inbox.claim("k", Utc.timestamp_opt(1_700_000_000, 0).unwrap())?);
    store.write(|tx| {
        tx.open_table(TableDefinition::<(&str, &str), i64>::new(
            "idemstore.v1.inbox",
        ))?
        .insert(("i", "k"), i64::MAX)?;
        Ok::<_, Error>(())
    })?;
    let err = inbox
        .seen_at("k")
        .expect_err("an impossible timestamp is corruption");
    match err {
        Error::Corrupted { table, key, .. } => {
            assert_eq!(table, "idemstore.v1.inbox");
            assert!(key.contains('k'));
        }
        other => panic!("expected Corrupted, got {other:?}"),
    }
    // The row is still a claim: a duplicate stays a duplicate.
    assert!(!inbox.claim("k", Utc::now())?);
    Ok(())
}

/// A store file with some of everything in it.
fn filled_store(path: &std::path::Path) -> Result<()> {
    let store = Store::open(path)?;
    let inbox = store.inbox("i")?;
    let keys: Vec<String> = (0..3000)
        .map(|i| format!("event-{i:05}-{}", "p".repeat(40)))
        .collect();
    inbox.claim_many(&keys, Utc::now())?;
    store.outbox().enqueue_many(
        (0..500).map(|i| NewEntry::new("c", "d", format!("k{i}"), vec![7; 300])),
        Utc::now(),
    )?;
    Ok(())
}

#[test]
fn a_truncated_store_file_is_an_error_or_a_repair_never_a_panic() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full.idem");
    filled_store(&full)?;
    let bytes = std::fs::read(&full).unwrap();
    let len = bytes.len();
    assert!(len > 64 * 1024, "the store is {len} bytes");
    let mut refused = 0;
    let mut opened = 0;
    // Cut mid-page at several places: the header page, early pages, the middle, near the end.
    for cut in [
        100,
        4096 + 1000,
        3 * 4096 + 7,
        len / 3 + 123,
        len / 2 + 2049,
        len - 4096 + 5,
        len - 1,
    ] {
        let path = dir.path().join(format!("cut-{cut}.idem"));
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let outcome = std::panic::catch_unwind(|| -> Result<()> {
            let store = Store::open(&path)?;
            // If it opened (a repair), every call answers without panicking.
            let inbox = store.inbox("i")?;
            let _ = inbox.len();
            let _ = inbox.seen("event-00000");
            let _ = store.outbox().counts();
            let _ = store.outbox().claim_due(Utc::now(), 10, "w");
            Ok(())
        });
        match outcome {
            Ok(Ok(())) => opened += 1,
            Ok(Err(e)) => {
                assert!(
                    matches!(
                        e,
                        Error::NotAStore { .. } | Error::Storage(_) | Error::Corrupted { .. }
                    ),
                    "cut at {cut}: {e:?}"
                );
                println!("cut at {cut}: {e}");
                assert!(!e.to_string().is_empty());
                refused += 1;
            }
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
    common::report(&format!(
        "bad files: 7 truncated copies of a {len}-byte store: {refused} refused with an error, {opened} repaired"
    ));
    Ok(())
}

const HOLDER_ENV: &str = "IDEMSTORE_HOLDER_FILE";

/// The child: opens the store, says so, and holds it until killed.
#[test]
#[ignore = "run by `a_store_in_use_by_another_process_is_refused` as a child process"]
fn hold_store_open() -> Result<()> {
    let Ok(path) = std::env::var(HOLDER_ENV) else {
        return Ok(());
    };
    let _store = Store::open(path)?;
    println!("holding");
    loop {
        std::thread::park();
    }
}

#[test]
fn a_store_in_use_by_another_process_is_refused() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("held.idem");
    drop(Store::open(&path)?);
    let mut child = common::child_test("hold_store_open")
        .env(HOLDER_ENV, &path)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // The test harness prints its own words first on the same line.
    while !lines
        .next()
        .expect("the child reports")
        .unwrap()
        .contains("holding")
    {}
    let before = std::fs::read(&path).unwrap();
    let err = Store::open(&path).expect_err("the file is held by the child");
    assert!(matches!(err, Error::AlreadyOpen { .. }), "{err:?}");
    let shared_err = Store::builder()
        .shared(true)
        .open(&path)
        .expect_err("a shared open of a file held alone is refused too");
    assert!(
        matches!(shared_err, Error::AlreadyOpen { shared: true, .. }),
        "{shared_err:?}"
    );
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "refused opens write nothing"
    );
    assert!(err.to_string().contains("already open"), "{err}");
    child.kill().unwrap();
    child.wait().unwrap();
    // Once the holder is gone, the file opens.
    let store = Store::open(&path)?;
    assert!(store.inbox("i")?.is_empty()?);
    Ok(())
}
