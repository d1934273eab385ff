//! Idempotency rows on disk: tenant isolation, expiry, purge, limits,
//! first write wins, damaged records and the row/index invariant.

use chrono::{DateTime, TimeZone, Utc};
use idemstore::redb::{
    ReadableTable as _, ReadableTableMetadata as _, TableDefinition, TableError,
};
use idemstore::{
    Begin, Error, IdempotencyKeys, KeyState, Reservation, ResponseRecord, Result, Store,
    fingerprint,
};

/// The store's own tables, opened raw to check what is on disk.
const RAW_ROWS: TableDefinition<(&str, &str), &[u8]> =
    TableDefinition::new("idemstore.v1.idempotency");
const RAW_CREATED: TableDefinition<(i64, &str, &str), ()> =
    TableDefinition::new("idemstore.v1.idempotency.created_at");

fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

fn record(tenant: &str, key: &str, body: &[u8], at: DateTime<Utc>) -> ResponseRecord {
    ResponseRecord::new(
        tenant,
        key,
        fingerprint("POST", "/r", body),
        200,
        body.to_vec(),
        at,
    )
    .content_type("text/plain")
    .header("x-request-id", "abc")
}

fn proceed(b: Begin) -> Reservation {
    match b {
        Begin::Proceed(r) => r,
        other => panic!("expected Proceed, got {other:?}"),
    }
}

/// Number of rows and index entries, read raw.
fn raw_counts(store: &Store) -> Result<(u64, u64)> {
    store.read(|tx| {
        let rows = match tx.open_table(RAW_ROWS) {
            Ok(t) => t.len()?,
            Err(TableError::TableDoesNotExist(_)) => 0,
            Err(e) => return Err(e.into()),
        };
        let index = match tx.open_table(RAW_CREATED) {
            Ok(t) => t.len()?,
            Err(TableError::TableDoesNotExist(_)) => 0,
            Err(e) => return Err(e.into()),
        };
        Ok((rows, index))
    })
}

fn raw_has_row(store: &Store, tenant: &str, key: &str) -> Result<bool> {
    store.read(|tx| match tx.open_table(RAW_ROWS) {
        Ok(t) => Ok(t.get((tenant, key))?.is_some()),
        Err(TableError::TableDoesNotExist(_)) => Ok(false),
        Err(e) => Err(e.into()),
    })
}

#[test]
fn tenants_and_keys_with_separators_and_nuls_stay_apart() -> Result<()> {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    let pairs = [
        ("a\0b", "c"),
        ("a", "b\0c"),
        ("a:b", "c"),
        ("a", "b:c"),
        ("a/b", "c"),
        ("a", "b/c"),
        ("a|b", "c"),
        ("a", "b|c"),
        ("", "a\0b\0c"),
        ("a\0", "b\0c"),
        ("", "x"),
        ("x", "\0"),
    ];
    for (i, (tenant, key)) in pairs.iter().enumerate() {
        let body = format!("body {i}");
        assert!(
            keys.put(&record(tenant, key, body.as_bytes(), t(0)))?,
            "{tenant:?} {key:?}"
        );
    }
    for (i, (tenant, key)) in pairs.iter().enumerate() {
        let got = keys.get(tenant, key, t(0))?.expect("stored");
        assert_eq!(
            got.response_body,
            format!("body {i}").as_bytes(),
            "{tenant:?} {key:?}"
        );
        assert_eq!(
            (got.tenant.as_str(), got.idempotency_key.as_str()),
            (*tenant, *key)
        );
    }
    // Through the request path too: each pair replays its own response.
    for (i, (tenant, key)) in pairs.iter().enumerate() {
        let fp = fingerprint("POST", "/r", format!("body {i}").as_bytes());
        assert!(
            matches!(keys.begin(tenant, key, &fp, t(1))?, Begin::Replay(r) if r.response_body == format!("body {i}").as_bytes())
        );
    }
    assert_eq!(
        keys.list(Some("a"), 100)?.len(),
        4,
        "tenant \"a\" holds exactly its own keys"
    );
    assert_eq!(keys.list(None, 100)?.len(), pairs.len());
    assert_eq!(
        raw_counts(&store)?,
        (pairs.len() as u64, pairs.len() as u64)
    );
    assert!(keys.check_indexes()?.is_empty());
    Ok(())
}

#[test]
fn get_deletes_an_expired_row_and_only_then_writes() -> Result<()> {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    assert!(keys.put(&record("", "old", b"1", t(0)))?);
    assert!(keys.put(&record("", "new", b"2", t(100)))?);

    let commits = store.commit_stats().commits;
    assert!(
        keys.get("", "old", t(0))?.is_some(),
        "created at the cutoff: kept"
    );
    assert!(keys.get("", "new", t(50))?.is_some());
    assert_eq!(keys.get("", "missing", t(50))?, None);
    assert_eq!(
        store.commit_stats().commits,
        commits,
        "reads found nothing expired: no commit"
    );

    assert_eq!(
        keys.get("", "old", t(50))?,
        None,
        "created before the cutoff: absent"
    );
    assert!(!raw_has_row(&store, "", "old")?, "and deleted");
    assert!(raw_has_row(&store, "", "new")?);
    assert_eq!(raw_counts(&store)?, (1, 1), "its index entry went with it");
    assert_eq!(keys.stats().expired_deleted, 1);
    assert!(keys.check_indexes()?.is_empty());
    Ok(())
}

#[test]
fn begin_on_an_expired_response_replaces_it() -> Result<()> {
    let store = Store::in_memory()?;
    let keys = store
        .idempotency_keys()
        .with_ttl(std::time::Duration::from_secs(10));
    let rec = record("", "k", b"1", t(0));
    assert!(keys.put(&rec)?);
    assert!(matches!(
        keys.begin("", "k", &rec.request_fingerprint, t(10))?,
        Begin::Replay(_)
    ));
    let r = proceed(keys.begin("", "k", "another request", t(11))?);
    assert_eq!(
        keys.list(None, 10)?[0].state,
        KeyState::Reserved {
            reserved_at: t(11),
            lease_until: t(71)
        }
    );
    assert_eq!(keys.list(None, 10)?[0].fence, r.fence());
    assert_eq!(raw_counts(&store)?, (1, 1));
    assert!(keys.check_indexes()?.is_empty());
    Ok(())
}

#[test]
fn purge_removes_only_what_has_expired_with_its_index_entries() -> Result<()> {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    for i in 0..3000 {
        assert!(keys.put(&record("t", &format!("k{i}"), b"x", t(i)))?);
    }
    // A reservation whose lease (60 s from t(100)) is still live at the cutoff stays.
    let live = proceed(keys.begin("other", "live", "fp", t(2990))?);
    let ended = proceed(keys.begin("other", "ended", "fp", t(0))?);
    assert_eq!(raw_counts(&store)?, (3002, 3002));

    assert_eq!(
        keys.purge_expired(t(2500))?,
        2501,
        "k0..k2499 and the ended reservation"
    );
    assert_eq!(raw_counts(&store)?, (501, 501));
    assert!(!raw_has_row(&store, "t", "k2499")?);
    assert!(raw_has_row(&store, "t", "k2500")?);
    assert!(!raw_has_row(&store, "other", "ended")?);
    assert_eq!(keys.purge_expired(t(2500))?, 0);
    // At t(3000) the live reservation's lease (until t(3050)) has not ended.
    assert_eq!(keys.purge_expired(t(3000))?, 500);
    assert!(raw_has_row(&store, "other", "live")?);
    assert!(keys.complete(&live, live.response(200, Vec::new(), t(3001)), t(3001))?);
    assert!(!keys.complete(&ended, ended.response(200, Vec::new(), t(3001)), t(3001))?);
    assert_eq!(keys.stats().purged, 3001);
    assert!(keys.check_indexes()?.is_empty());
    Ok(())
}

#[test]
fn oversized_or_empty_inputs_are_refused_and_write_nothing() -> Result<()> {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    let max = idemstore::DEFAULT_MAX_BODY;

    let big = record("", "k", &vec![7; max + 1], t(0));
    match keys.put(&big) {
        Err(Error::TooLarge { field, len, max: m }) => {
            assert_eq!((field, len, m), ("response body", max + 1, max));
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    let r = proceed(keys.begin("", "k", &big.request_fingerprint, t(0))?);
    let mut resp = r.response(200, vec![7; max + 1], t(0));
    assert!(matches!(
        keys.complete(&r, resp.clone(), t(0)),
        Err(Error::TooLarge { .. })
    ));
    assert!(
        matches!(
            keys.begin("", "k", &big.request_fingerprint, t(1))?,
            Begin::InFlight { .. }
        ),
        "still only reserved"
    );
    resp.response_body.pop();
    assert!(
        keys.complete(&r, resp, t(0))?,
        "exactly max_body is accepted"
    );

    let long_key = "k".repeat(256);
    assert!(matches!(
        keys.begin("", &long_key, "fp", t(0)),
        Err(Error::TooLarge {
            field: "idempotency key",
            len: 256,
            max: 255
        })
    ));
    assert!(matches!(
        keys.put(&record("", &long_key, b"", t(0))),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        keys.get("", &long_key, t(0)),
        Err(Error::TooLarge { .. })
    ));
    let long_tenant = "t".repeat(256);
    assert!(matches!(
        keys.begin(&long_tenant, "k", "fp", t(0)),
        Err(Error::TooLarge {
            field: "tenant",
            ..
        })
    ));
    assert!(matches!(
        keys.put(&record(&long_tenant, "k", b"", t(0))),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        keys.begin("", "", "fp", t(0)),
        Err(Error::InvalidInput { .. })
    ));
    assert!(matches!(
        keys.begin("", "k2", &"f".repeat(129), t(0)),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        keys.begin("", "k2", "", t(0)),
        Err(Error::InvalidInput { .. })
    ));
    let mut bad_status = record("", "k3", b"", t(0));
    bad_status.response_status = 600;
    assert!(matches!(
        keys.put(&bad_status),
        Err(Error::InvalidInput { .. })
    ));

    // Limits themselves are accepted.
    assert!(keys.put(&record(&"t".repeat(255), &"k".repeat(255), b"", t(0)))?);
    assert_eq!(raw_counts(&store)?, (2, 2), "only k and the 255-byte pair");
    // A smaller configured limit applies.
    let small = Store::builder()
        .max_body(10)
        .in_memory()?
        .idempotency_keys();
    assert!(matches!(
        small.put(&record("", "k", &[0; 11], t(0))),
        Err(Error::TooLarge { max: 10, .. })
    ));
    Ok(())
}

#[test]
fn put_keeps_the_first_response_until_it_expires() -> Result<()> {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    assert!(keys.put(&record("", "k", b"first", t(0)))?);
    assert!(!keys.put(&record("", "k", b"second", t(1)))?);
    assert_eq!(keys.get("", "k", t(0))?.unwrap().response_body, b"first");
    // A response older than the TTL (24 h) is replaced.
    assert!(keys.put(&record("", "k", b"third", t(24 * 3600 + 1)))?);
    assert_eq!(keys.get("", "k", t(0))?.unwrap().response_body, b"third");
    assert_eq!(raw_counts(&store)?, (1, 1));
    assert!(keys.check_indexes()?.is_empty());
    Ok(())
}

#[test]
fn put_never_overwrites_a_live_reservation() -> Result<()> {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    let r = proceed(keys.begin("", "held", "fp", t(0))?);
    assert!(
        !keys.put(&record("", "held", b"x", t(59)))?,
        "a live reservation is not overwritten"
    );
    assert!(
        keys.put(&record("", "held", b"x", t(60)))?,
        "an ended one is"
    );
    assert!(
        !keys.complete(&r, r.response(200, Vec::new(), t(61)), t(61))?,
        "and its holder is fenced out"
    );
    assert_eq!(raw_counts(&store)?, (1, 1));
    assert!(keys.check_indexes()?.is_empty());
    Ok(())
}

#[test]
fn garbage_bytes_are_corrupted_not_panics() -> Result<()> {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    assert!(keys.put(&record("t", "k", b"1", t(0)))?);
    store.write(|tx| {
        tx.open_table(RAW_ROWS)?
            .insert(("t", "k"), &[1u8, 0xff, 0xff, 0xff, 0xff, 0xff][..])?;
        Ok::<_, Error>(())
    })?;
    for result in [
        keys.get("t", "k", t(0)).map(|_| ()),
        keys.begin("t", "k", "fp", t(1)).map(|_| ()),
        keys.put(&record("t", "k", b"1", t(0))).map(|_| ()),
        keys.list(None, 10).map(|_| ()),
    ] {
        match result {
            Err(Error::Corrupted { table, key, .. }) => {
                assert_eq!(table, "idemstore.v1.idempotency");
                assert!(key.contains("\"t\"") && key.contains("\"k\""), "{key}");
            }
            other => panic!("expected Corrupted, got {other:?}"),
        }
    }
    let findings = keys.check_indexes()?;
    assert_eq!(findings.len(), 1, "{findings:?}");
    assert!(findings[0].contains("does not decode"));
    Ok(())
}

#[test]
fn check_indexes_reports_a_missing_or_dangling_index_entry() -> Result<()> {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    assert!(keys.put(&record("", "a", b"1", t(0)))?);
    assert!(keys.put(&record("", "b", b"1", t(0)))?);
    store.write(|tx| {
        let mut index = tx.open_table(RAW_CREATED)?;
        index.remove((t(0).timestamp_micros(), "", "a"))?;
        index.insert((5, "", "ghost"), ())?;
        Ok::<_, Error>(())
    })?;
    let findings = keys.check_indexes()?;
    assert_eq!(findings.len(), 2, "{findings:?}");
    assert!(
        findings
            .iter()
            .any(|f| f.contains("\"a\"") && f.contains("no expiry index entry"))
    );
    assert!(
        findings
            .iter()
            .any(|f| f.contains("\"ghost\"") && f.contains("no row"))
    );
    Ok(())
}

#[test]
fn records_survive_reopen() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let rec = record("tenant", "key", b"persisted", t(0));
    {
        let keys: IdempotencyKeys = Store::open(&path)?.idempotency_keys();
        assert!(keys.put(&rec)?);
    }
    let store = Store::open(&path)?;
    assert_eq!(
        store.idempotency_keys().get("tenant", "key", t(0))?,
        Some(rec)
    );
    Ok(())
}

#[test]
fn fingerprints_are_unambiguous() {
    assert_ne!(
        fingerprint("GET", "/ab", b"c"),
        fingerprint("GET", "/a", b"bc")
    );
    assert_ne!(fingerprint("GET", "/a", b""), fingerprint("GE", "T/a", b""));
    assert_ne!(
        fingerprint("POST", "/a", b"\0"),
        fingerprint("POST", "/a", b"")
    );
    let fp = fingerprint("POST", "/a?x=1", b"{}");
    assert_eq!(fp, fingerprint("POST", "/a?x=1", b"{}"));
    assert_eq!(fp.len(), 64);
    assert!(
        fp.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    );
}
