//! The request path: every `Begin` outcome, leases, fencing, release and
//! completing inside the handler's own transaction.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use idemstore::redb::{ReadableTable as _, TableDefinition};
use idemstore::{Begin, Error, IdempotencyKeys, Reservation, Result, Store, fingerprint};

const APP: TableDefinition<&str, u64> = TableDefinition::new("app.orders");

fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

fn proceed(b: Begin) -> Reservation {
    match b {
        Begin::Proceed(r) => r,
        other => panic!("expected Proceed, got {other:?}"),
    }
}

fn keys() -> Result<(Store, IdempotencyKeys)> {
    let store = Store::in_memory()?;
    let keys = store.idempotency_keys();
    Ok((store, keys))
}

#[test]
fn each_begin_outcome_follows_from_what_the_key_holds() -> Result<()> {
    let (_store, keys) = keys()?;
    let fp = fingerprint("POST", "/orders", b"{\"n\":1}");
    let other = fingerprint("POST", "/orders", b"{\"n\":2}");

    let r = proceed(keys.begin("", "k1", &fp, t(0))?);
    assert_eq!(r.tenant(), "");
    assert_eq!(r.key(), "k1");
    assert_eq!(r.fingerprint(), fp);
    assert_eq!(r.reserved_at(), t(0));
    assert_eq!(r.lease_until(), t(60), "default lease is 60 s");

    // Same request while the first runs: in flight, with the lease end.
    assert_eq!(
        keys.begin("", "k1", &fp, t(10))?,
        Begin::InFlight { lease_until: t(60) }
    );
    // Another request with the key while it runs: mismatch.
    assert_eq!(
        keys.begin("", "k1", &other, t(10))?,
        Begin::Mismatch {
            stored_fingerprint: fp.clone()
        }
    );
    // A live reservation reads as no response.
    assert_eq!(keys.get("", "k1", t(0))?, None);

    let mut response = r.response(201, b"created".to_vec(), t(0));
    response.content_type = Some("application/json".into());
    response.headers = vec![("location".into(), "/orders/7".into())];
    assert!(keys.complete(&r, response.clone(), t(20))?);
    let mut stored = response.clone();
    stored.created_at = t(20);

    assert_eq!(
        keys.begin("", "k1", &fp, t(30))?,
        Begin::Replay(stored.clone())
    );
    assert_eq!(
        keys.begin("", "k1", &other, t(30))?,
        Begin::Mismatch {
            stored_fingerprint: fp.clone()
        }
    );
    assert_eq!(keys.get("", "k1", t(0))?, Some(stored));
    // Completing twice: the reservation is gone.
    assert!(!keys.complete(&r, r.response(500, Vec::new(), t(0)), t(40))?);

    // After the TTL the key is free again.
    let keys = keys.with_ttl(Duration::from_secs(3600));
    assert!(
        matches!(keys.begin("", "k1", &fp, t(20 + 3600))?, Begin::Replay(_)),
        "created exactly at the cutoff: kept"
    );
    let again = proceed(keys.begin("", "k1", &other, t(21 + 3600))?);
    assert!(again.fence() > r.fence(), "fence tokens grow");
    Ok(())
}

#[test]
fn expired_lease_is_taken_over_and_the_old_holder_is_fenced_out() -> Result<()> {
    let (_store, keys) = keys()?;
    let keys = keys.with_lease(Duration::from_secs(30));
    let fp = fingerprint("POST", "/pay", b"1");
    let old = proceed(keys.begin("t", "k", &fp, t(0))?);
    assert_eq!(
        keys.begin("t", "k", &fp, t(29))?,
        Begin::InFlight { lease_until: t(30) }
    );
    // At lease_until the lease has ended.
    let new = proceed(keys.begin("t", "k", &fp, t(30))?);
    assert!(new.fence() > old.fence());
    assert_eq!(new.lease_until(), t(60));

    // The old holder wakes up: its release frees nothing, its complete fails.
    keys.release(&old)?;
    assert_eq!(
        keys.begin("t", "k", &fp, t(31))?,
        Begin::InFlight { lease_until: t(60) }
    );
    assert!(!keys.complete(&old, old.response(200, b"late".to_vec(), t(31)), t(31))?);
    assert_eq!(keys.get("t", "k", t(0))?, None, "still only a reservation");

    assert!(keys.complete(&new, new.response(200, b"ok".to_vec(), t(32)), t(32))?);
    // A stale release never deletes a response.
    keys.release(&old)?;
    keys.release(&new)?;
    match keys.begin("t", "k", &fp, t(33))? {
        Begin::Replay(r) => assert_eq!(r.response_body, b"ok"),
        other => panic!("expected Replay, got {other:?}"),
    }
    let s = keys.stats();
    assert_eq!(s.takeovers, 1);
    assert_eq!(s.fenced_out, 1);
    assert_eq!(s.released, 0);
    Ok(())
}

#[test]
fn an_ended_lease_nobody_took_over_can_still_complete() -> Result<()> {
    let (_store, keys) = keys()?;
    let fp = fingerprint("PUT", "/x", b"");
    let r = proceed(keys.begin("", "k", &fp, t(0))?);
    assert!(keys.complete(&r, r.response(204, Vec::new(), t(500)), t(500))?);
    assert!(matches!(
        keys.begin("", "k", &fp, t(501))?,
        Begin::Replay(_)
    ));
    Ok(())
}

#[test]
fn only_the_current_holders_release_frees_the_key() -> Result<()> {
    let (_store, keys) = keys()?;
    let fp = fingerprint("POST", "/a", b"x");
    let first = proceed(keys.begin("", "k", &fp, t(0))?);
    keys.release(&first)?;
    let second = proceed(keys.begin("", "k", &fp, t(1))?);
    // The first holder releasing again must not free the second's hold.
    keys.release(&first)?;
    assert!(matches!(
        keys.begin("", "k", &fp, t(2))?,
        Begin::InFlight { .. }
    ));
    assert!(!keys.complete(&first, first.response(200, Vec::new(), t(2)), t(2))?);
    assert!(keys.complete(&second, second.response(200, Vec::new(), t(2)), t(2))?);
    assert_eq!(keys.stats().released, 1);
    Ok(())
}

#[test]
fn a_released_key_binds_no_fingerprint() -> Result<()> {
    let (_store, keys) = keys()?;
    let fp = fingerprint("POST", "/a", b"x");
    // A released key with another fingerprint is no mismatch: nothing binds it.
    let r = proceed(keys.begin("", "free", &fp, t(3))?);
    keys.release(&r)?;
    let _ = proceed(keys.begin("", "free", &fingerprint("POST", "/b", b""), t(4))?);
    Ok(())
}

#[test]
fn complete_in_commits_with_the_handler_or_not_at_all() -> Result<()> {
    let (store, keys) = keys()?;
    let fp = fingerprint("POST", "/orders", b"1");
    let r = proceed(keys.begin("", "k", &fp, t(0))?);

    // The handler fails after completing: nothing commits.
    let failed: Result<()> = store.write(|tx| {
        tx.open_table(APP)?.insert("order", 1)?;
        assert!(keys.complete_in(tx, &r, r.response(201, b"no".to_vec(), t(1)), t(1))?);
        Err(Error::NotFound)
    });
    assert!(matches!(failed, Err(Error::NotFound)));
    assert_eq!(keys.get("", "k", t(0))?, None, "no response row");
    assert!(
        matches!(keys.begin("", "k", &fp, t(2))?, Begin::InFlight { .. }),
        "the key stays reserved by r"
    );
    let order = store.read(|tx| match tx.open_table(APP) {
        Ok(table) => Ok::<_, Error>(table.get("order")?.map(|v| v.value())),
        Err(idemstore::redb::TableError::TableDoesNotExist(_)) => Ok(None),
        Err(e) => Err(e.into()),
    })?;
    assert_eq!(order, None, "the handler's writes rolled back too");

    // The retry of the same handler commits both.
    store.write(|tx| {
        tx.open_table(APP)?.insert("order", 1)?;
        assert!(keys.complete_in(tx, &r, r.response(201, b"yes".to_vec(), t(3)), t(3))?);
        Ok::<_, Error>(())
    })?;
    match keys.begin("", "k", &fp, t(4))? {
        Begin::Replay(resp) => assert_eq!(resp.response_body, b"yes"),
        other => panic!("expected Replay, got {other:?}"),
    }
    // A fenced-out complete_in writes nothing and lets the handler decide.
    let done =
        store.write(|tx| keys.complete_in(tx, &r, r.response(200, Vec::new(), t(5)), t(5)))?;
    assert!(!done);
    Ok(())
}

#[test]
fn complete_refuses_a_foreign_or_malformed_response() -> Result<()> {
    let (_store, keys) = keys()?;
    let fp = fingerprint("POST", "/a", b"");
    let r = proceed(keys.begin("", "k", &fp, t(0))?);
    let mut wrong = r.response(200, Vec::new(), t(0));
    wrong.idempotency_key = "other".into();
    assert!(matches!(
        keys.complete(&r, wrong, t(0)),
        Err(Error::InvalidInput { .. })
    ));
    let mut bad = r.response(99, Vec::new(), t(0));
    assert!(matches!(
        keys.complete(&r, bad.clone(), t(0)),
        Err(Error::InvalidInput { .. })
    ));
    bad.response_status = 200;
    bad.headers
        .push(("x-bad".into(), "a\r\nset-cookie: x".into()));
    assert!(matches!(
        keys.complete(&r, bad, t(0)),
        Err(Error::InvalidInput { .. })
    ));
    assert!(matches!(
        keys.begin("", "k", &fp, t(1))?,
        Begin::InFlight { .. }
    ));
    assert!(keys.check_indexes()?.is_empty());
    Ok(())
}

#[test]
fn sixteen_threads_racing_on_one_key_get_one_proceed() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s.idem"))?;
    let keys = store.idempotency_keys();
    let fp = fingerprint("POST", "/race", b"");
    let threads = 16;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let keys = keys.clone();
            let barrier = barrier.clone();
            let fp = fp.clone();
            std::thread::spawn(move || -> Result<Begin> {
                barrier.wait();
                keys.begin("tenant", "one-key", &fp, t(0))
            })
        })
        .collect();
    let mut proceeds = 0;
    let mut in_flight = 0;
    for h in handles {
        match h.join().expect("begin thread panicked")? {
            Begin::Proceed(_) => proceeds += 1,
            Begin::InFlight { lease_until } => {
                assert_eq!(lease_until, t(60));
                in_flight += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(proceeds, 1);
    assert_eq!(in_flight, threads - 1);
    let s = keys.stats();
    assert_eq!((s.reserved, s.in_flight), (1, 15));
    Ok(())
}

#[test]
fn stats_count_each_outcome_per_store_whichever_handle_served_it() -> Result<()> {
    let (store, keys) = keys()?;
    let fp = fingerprint("GET", "/s", b"");
    let r = proceed(keys.begin("", "k", &fp, t(0))?);
    let _ = keys.begin("", "k", &fp, t(1))?;
    let _ = keys.begin("", "k", "other", t(1))?;
    assert!(keys.complete(&r, r.response(200, Vec::new(), t(2)), t(2))?);
    let _ = keys.begin("", "k", &fp, t(3))?;
    let other_handle = store.idempotency_keys();
    let _ = other_handle.begin("", "k", &fp, t(3))?;
    let s = other_handle.stats();
    assert_eq!(s.reserved, 1);
    assert_eq!(s.in_flight, 1);
    assert_eq!(s.mismatches, 1);
    assert_eq!(s.completed, 1);
    assert_eq!(s.replays, 2);
    assert_eq!(s, keys.stats());
    // Another store has its own counters.
    assert_eq!(
        Store::in_memory()?.idempotency_keys().stats(),
        idemstore::IdempotencyStats::default()
    );
    Ok(())
}

#[test]
fn fences_keep_growing_across_reopen() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let fp = fingerprint("POST", "/f", b"");
    let first = {
        let store = Store::open(&path)?;
        let keys = store.idempotency_keys();
        let r = proceed(keys.begin("", "k", &fp, t(0))?);
        keys.release(&r)?;
        r
    };
    let store = Store::open(&path)?;
    let keys = store.idempotency_keys();
    let second = proceed(keys.begin("", "k", &fp, t(1))?);
    assert!(
        second.fence() > first.fence(),
        "{} > {}",
        second.fence(),
        first.fence()
    );
    // The reservation from before the reopen cannot complete the new one.
    assert!(!keys.complete(&first, first.response(200, Vec::new(), t(2)), t(2))?);
    assert!(keys.complete(&second, second.response(200, Vec::new(), t(2)), t(2))?);
    Ok(())
}
