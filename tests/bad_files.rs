//! Files that are not stores, files in use, damaged records: clear errors, no panics.

use std::io::Write;

use chrono::{TimeZone, Utc};
use idemstore::redb::TableDefinition;
use idemstore::{Error, Result, Store};

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
    assert!(msg.contains("not an idemstore file"), "{msg}");
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
    let err = Store::open(&path).expect_err("format 99 must be refused");
    match &err {
        Error::IncompatibleFormat { found, supported } => {
            assert!(found.contains("99"), "{found}");
            assert_eq!(*supported, 1);
        }
        other => panic!("expected IncompatibleFormat, got {other:?}"),
    }
    Ok(())
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
