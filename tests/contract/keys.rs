//! The idempotency keys' contract: proceed, replay, mismatch, in flight,
//! takeover and fencing, release (the holder's and the operator's), lazy
//! expiry, first write wins, purge, tenant isolation, concurrency, bad
//! input.

macro_rules! keys_contract {
    () => {
        mod keys {
            use std::time::Duration;

            use idemstore::{Begin, Error, KeyState, Reservation, ResponseRecord, fingerprint};

            use super::*;

            fn record(tenant: &str, key: &str, body: &[u8], at: chrono::DateTime<chrono::Utc>) -> ResponseRecord {
                ResponseRecord::new(tenant, key, fingerprint("POST", "/r", body), 201, body.to_vec(), at)
                    .content_type("application/json")
                    .header("location", "/r/1")
                    .header("x-a", "")
            }

            fn proceed(b: Begin) -> Reservation {
                match b {
                    Begin::Proceed(r) => r,
                    other => panic!("expected Proceed, got {other:?}"),
                }
            }

            #[test]
            fn the_first_request_proceeds_and_a_retry_replays() -> TestResult {
                let f = fixture!();
                let keys = f.store.idempotency_keys();
                let fp = fingerprint("POST", "/orders", b"{}");
                let r = proceed(keys.begin("acme", "k1", &fp, t(0))?);
                assert_eq!((r.tenant(), r.key(), r.fingerprint()), ("acme", "k1", fp.as_str()));
                assert_eq!((r.reserved_at(), r.lease_until()), (t(0), t(60)), "the default lease");
                assert_eq!(keys.get("acme", "k1", t(0))?, None, "a reservation is not a response");
                let mut response = r.response(201, b"{\"id\":7}".to_vec(), t(1));
                response.content_type = Some("application/json".into());
                response.headers = vec![("location".into(), "/orders/7".into())];
                assert!(keys.complete(&r, response.clone(), t(2))?);
                let Begin::Replay(stored) = keys.begin("acme", "k1", &fp, t(3))? else {
                    panic!("a replay");
                };
                response.created_at = t(2);
                assert_eq!(stored, response);
                assert_eq!(keys.get("acme", "k1", t(0))?, Some(stored.clone()));
                assert_eq!(keys.response("acme", "k1")?, Some(stored));
                assert!(!keys.complete(&r, r.response(500, Vec::new(), t(4)), t(4))?, "completed already");
                // Completing again under the same reservation fences nobody out.
                let stats = keys.stats();
                assert_eq!((stats.reserved, stats.completed, stats.replays, stats.fenced_out), (1, 1, 1, 0));
                Ok(())
            }

            #[test]
            fn another_request_with_the_key_is_a_mismatch_running_or_done() -> TestResult {
                let f = fixture!();
                let keys = f.store.idempotency_keys();
                let (fp, other) = (fingerprint("POST", "/a", b"1"), fingerprint("POST", "/a", b"2"));
                let r = proceed(keys.begin("", "k", &fp, t(0))?);
                assert_eq!(
                    keys.begin("", "k", &other, t(1))?,
                    Begin::Mismatch { stored_fingerprint: fp.clone() },
                    "bound to its request while running"
                );
                assert!(keys.complete(&r, r.response(200, b"ok".to_vec(), t(2)), t(2))?);
                assert_eq!(keys.begin("", "k", &other, t(3))?, Begin::Mismatch { stored_fingerprint: fp });
                Ok(())
            }

            #[test]
            fn a_live_reservation_is_in_flight_until_its_lease_ends() -> TestResult {
                let f = fixture!();
                let keys = f.store.idempotency_keys().with_lease(Duration::from_secs(10));
                assert_eq!(keys.lease(), Duration::from_secs(10));
                let fp = fingerprint("POST", "/pay", b"9");
                let first = proceed(keys.begin("t", "k", &fp, t(0))?);
                assert_eq!(keys.begin("t", "k", &fp, t(5))?, Begin::InFlight { lease_until: t(10) });
                // At the end of the lease, a retry takes the key over.
                let second = proceed(keys.begin("t", "k", &fp, t(10))?);
                assert!(second.fence() > first.fence(), "fences only grow");
                assert_eq!(second.lease_until(), t(20));
                // The first holder is fenced out: its completion stores
                // nothing and its release frees nothing.
                assert!(!keys.complete(&first, first.response(200, b"late".to_vec(), t(11)), t(11))?);
                keys.release(&first)?;
                assert_eq!(keys.begin("t", "k", &fp, t(12))?, Begin::InFlight { lease_until: t(20) });
                assert!(keys.complete(&second, second.response(200, b"mine".to_vec(), t(13)), t(13))?);
                keys.release(&second)?;
                let Begin::Replay(r) = keys.begin("t", "k", &fp, t(14))? else {
                    panic!("a stale release deletes no response");
                };
                assert_eq!(r.response_body, b"mine");
                let stats = keys.stats();
                assert_eq!((stats.takeovers, stats.in_flight, stats.fenced_out), (1, 2, 1));
                Ok(())
            }

            #[test]
            fn a_released_key_lets_a_retry_proceed() -> TestResult {
                let f = fixture!();
                let keys = f.store.idempotency_keys();
                let fp = fingerprint("PUT", "/x", b"");
                let r = proceed(keys.begin("t", "k", &fp, t(0))?);
                keys.release(&r)?;
                keys.release(&r)?;
                let again = proceed(keys.begin("t", "k", &fp, t(1))?);
                assert!(again.fence() > r.fence());
                assert_eq!(keys.stats().released, 1);
                Ok(())
            }

            #[test]
            fn an_operator_release_frees_only_the_reservation_it_names() -> TestResult {
                let f = fixture!();
                let keys = f.store.idempotency_keys().with_lease(Duration::from_secs(10));
                let fp = fingerprint("POST", "/stuck", b"");
                let first = proceed(keys.begin("t", "k", &fp, t(0))?);
                let listed = keys.entry("t", "k")?.expect("a reservation");
                assert_eq!((listed.fence, listed.fingerprint.as_str()), (first.fence(), fp.as_str()));
                assert_eq!(listed.state, KeyState::Reserved { reserved_at: t(0), lease_until: t(10) });
                assert_eq!(idemstore::StoreAdmin::key(f.admin(), "t", "k")?, Some(listed));
                // Another fence frees nothing; the holder's frees the key at
                // once, live lease or not.
                assert!(!keys.release_key("t", "k", first.fence() + 1)?);
                assert!(matches!(keys.begin("t", "k", &fp, t(1))?, Begin::InFlight { .. }));
                assert!(keys.release_key("t", "k", first.fence())?);
                assert_eq!(keys.entry("t", "k")?, None);
                assert!(!keys.release_key("t", "k", first.fence())?, "released already");
                // A page shown before the key changed hands frees nothing.
                let second = proceed(keys.begin("t", "k", &fp, t(2))?);
                assert!(!keys.release_key("t", "k", first.fence())?);
                assert!(!keys.complete(&first, first.response(200, b"late".to_vec(), t(2)), t(2))?, "fenced out");
                assert!(matches!(keys.begin("t", "k", &fp, t(3))?, Begin::InFlight { .. }));
                // A stored response is never deleted.
                assert!(keys.complete(&second, second.response(200, b"done".to_vec(), t(4)), t(4))?);
                assert!(!keys.release_key("t", "k", second.fence())?);
                assert!(!idemstore::StoreAdmin::release_key(f.admin(), "t", "k", second.fence())?);
                assert_eq!(keys.response("t", "k")?.map(|r| r.response_body), Some(b"done".to_vec()));
                let done = keys.entry("t", "k")?.expect("the response");
                assert_eq!(done.state, KeyState::Completed { status: 200, body_len: 4, created_at: t(4) });
                assert!(!keys.release_key("t", "absent", 1)?);
                assert!(!keys.release_key("t", "k", u64::MAX)?);
                assert_eq!(keys.stats().released, 1, "counted as a release");
                assert!(matches!(keys.release_key("t", "", 1), Err(Error::InvalidInput { field: "idempotency key", .. })));
                assert!(matches!(
                    keys.release_key(&"t".repeat(256), "k", 1),
                    Err(Error::TooLarge { field: "tenant", .. })
                ));
                assert!(matches!(keys.entry("t", &"k".repeat(256)), Err(Error::TooLarge { .. })));
                Ok(())
            }

            #[test]
            fn responses_expire_lazily_after_the_ttl() -> TestResult {
                let f = fixture!();
                let keys = f.store.idempotency_keys().with_ttl(Duration::from_secs(60));
                let fp = fingerprint("POST", "/e", b"");
                let r = proceed(keys.begin("t", "k", &fp, t(0))?);
                assert!(keys.complete(&r, r.response(200, b"v1".to_vec(), t(0)), t(0))?);
                assert!(matches!(keys.begin("t", "k", &fp, t(60))?, Begin::Replay(_)), "not before the TTL");
                let again = proceed(keys.begin("t", "k", &fp, t(61))?);
                assert!(keys.complete(&again, again.response(200, b"v2".to_vec(), t(61)), t(61))?);
                assert_eq!(keys.get("t", "k", t(61))?.map(|r| r.response_body), Some(b"v2".to_vec()));
                // `get` treats a record created before its cutoff as gone,
                // and deletes it.
                assert!(keys.put(&record("t", "old", b"o", t(5)))?);
                assert!(keys.get("t", "old", t(5))?.is_some());
                assert_eq!(keys.get("t", "old", t(6))?, None);
                assert_eq!(keys.response("t", "old")?, None, "deleted");
                assert_eq!(keys.stats().expired_deleted, 2);
                Ok(())
            }

            #[test]
            fn put_is_first_write_wins() -> TestResult {
                let f = fixture!();
                let keys = f.store.idempotency_keys().with_lease(Duration::from_secs(10));
                assert!(keys.put(&record("t", "k", b"first", t(0)))?);
                assert!(!keys.put(&record("t", "k", b"second", t(1)))?);
                assert_eq!(keys.response("t", "k")?.map(|r| r.response_body), Some(b"first".to_vec()));
                // A live reservation is not overwritten; an ended one is.
                let fp = fingerprint("POST", "/r", b"x");
                let r = proceed(keys.begin("t", "held", &fp, t(0))?);
                assert!(!keys.put(&record("t", "held", b"x", t(9)))?);
                assert!(keys.put(&record("t", "held", b"x", t(10)))?);
                assert!(!keys.complete(&r, r.response(200, b"late".to_vec(), t(11)), t(11))?, "fenced out");
                assert_eq!(keys.response("t", "held")?.map(|r| r.response_body), Some(b"x".to_vec()));
                Ok(())
            }

            #[test]
            fn purge_expired_removes_what_expired_and_no_live_lease() -> TestResult {
                let f = fixture!();
                let keys = f.store.idempotency_keys().with_lease(Duration::from_secs(100));
                for i in 0..5 {
                    assert!(keys.put(&record("t", &format!("k{i}"), b"b", t(i)))?);
                }
                let fp = fingerprint("POST", "/r", b"");
                let _live = proceed(keys.begin("t", "live", &fp, t(0))?);
                let summary = keys.summary()?;
                assert_eq!((summary.completed, summary.reserved, summary.oldest), (5, 1, Some(t(0))));
                assert_eq!(keys.purge_expired(t(3))?, 3, "k0..k2; the live lease stays");
                assert_eq!(keys.purge_expired(t(3))?, 0);
                assert!(matches!(keys.begin("t", "live", &fp, t(4))?, Begin::InFlight { .. }));
                assert_eq!(keys.purge_expired(t(100))?, 3, "k3, k4 and the ended lease");
                assert_eq!(keys.list(None, 10)?, Vec::new());
                assert_eq!(keys.stats().purged, 6);
                Ok(())
            }

            #[test]
            fn tenants_are_isolated_whatever_bytes_they_hold() -> TestResult {
                let f = fixture!();
                let keys = f.store.idempotency_keys();
                let pairs = [
                    ("a\0b", "c"),
                    ("a", "b\0c"),
                    ("a:b", "c"),
                    ("a", "b:c"),
                    ("", "a\0b\0c"),
                    ("a\0", "b\0c"),
                    ("", "x"),
                    ("x", "\0"),
                    ("ü", "ß"),
                ];
                for (i, (tenant, key)) in pairs.iter().enumerate() {
                    assert!(keys.put(&record(tenant, key, format!("body {i}").as_bytes(), t(0)))?, "{tenant:?} {key:?}");
                }
                for (i, (tenant, key)) in pairs.iter().enumerate() {
                    let got = keys.get(tenant, key, t(0))?.expect("stored");
                    assert_eq!(got.response_body, format!("body {i}").as_bytes());
                    assert_eq!((got.tenant.as_str(), got.idempotency_key.as_str()), (*tenant, *key));
                    let fp = fingerprint("POST", "/r", format!("body {i}").as_bytes());
                    assert!(matches!(keys.begin(tenant, key, &fp, t(1))?, Begin::Replay(r) if r == got));
                }
                let listed = keys.list(Some("a"), 100)?;
                assert_eq!(listed.len(), 2, "tenant \"a\" holds its own keys only: {listed:?}");
                assert!(listed.iter().all(|e| e.tenant == "a"));
                assert!(matches!(listed[0].state, KeyState::Completed { status: 201, .. }));
                assert_eq!(keys.list(None, 100)?.len(), pairs.len());
                assert_eq!(keys.list(None, 3)?.len(), 3);
                assert_eq!(keys.check_indexes()?, Vec::<String>::new());
                Ok(())
            }

            #[test]
            fn concurrent_begins_on_a_free_key_proceed_once() -> TestResult {
                let f = fixture!();
                let fp = fingerprint("POST", "/race", b"");
                for round in 0..5 {
                    let key = format!("k{round}");
                    let answers = std::thread::scope(|s| {
                        let handles: Vec<_> = (0..6)
                            .map(|_| {
                                let store = f.another();
                                let (key, fp) = (key.clone(), fp.clone());
                                s.spawn(move || store.idempotency_keys().begin("t", &key, &fp, t(0)))
                            })
                            .collect();
                        handles
                            .into_iter()
                            .map(|h| h.join().expect("no panic"))
                            .collect::<Result<Vec<_>, _>>()
                    })?;
                    let proceeds = answers.iter().filter(|a| matches!(a, Begin::Proceed(_))).count();
                    assert_eq!(proceeds, 1, "{answers:?}");
                    assert!(
                        answers.iter().all(|a| matches!(a, Begin::Proceed(_) | Begin::InFlight { .. })),
                        "{answers:?}"
                    );
                }
                Ok(())
            }

            #[test]
            fn complete_in_stores_the_response_with_the_handlers_writes() -> TestResult {
                let f = fixture!();
                let keys = f.store.idempotency_keys();
                let fp = fingerprint("POST", "/o", b"");
                let r = proceed(keys.begin("t", "k", &fp, t(0))?);
                let out = f.store.write(|tx| {
                    f.mark(tx, "order")?;
                    assert!(keys.complete_in(tx, &r, r.response(201, b"made".to_vec(), t(1)), t(1))?);
                    Err::<(), _>(AppError::Refused)
                });
                assert!(matches!(out, Err(AppError::Refused)));
                assert_eq!(keys.response("t", "k")?, None);
                assert_eq!(f.marks()?, Vec::<String>::new());
                assert!(matches!(keys.begin("t", "k", &fp, t(2))?, Begin::InFlight { .. }), "still reserved");
                let stored = f.store.write(|tx| {
                    f.mark(tx, "order")?;
                    keys.complete_in(tx, &r, r.response(201, b"made".to_vec(), t(3)), t(3))
                })?;
                assert!(stored);
                assert!(matches!(keys.begin("t", "k", &fp, t(4))?, Begin::Replay(resp) if resp.response_body == b"made"));
                assert_eq!(f.marks()?, vec!["order".to_owned()]);
                Ok(())
            }

            #[test]
            fn bad_input_is_refused_with_the_same_errors() -> TestResult {
                let f = fixture!();
                let keys = f.store.idempotency_keys();
                let fp = fingerprint("GET", "/", b"");
                assert!(matches!(
                    keys.begin("t", "", &fp, t(0)),
                    Err(Error::InvalidInput { field: "idempotency key", .. })
                ));
                assert!(matches!(
                    keys.begin("t", &"k".repeat(256), &fp, t(0)),
                    Err(Error::TooLarge { field: "idempotency key", len: 256, max: 255 })
                ));
                assert!(matches!(
                    keys.begin(&"t".repeat(256), "k", &fp, t(0)),
                    Err(Error::TooLarge { field: "tenant", .. })
                ));
                assert!(matches!(
                    keys.begin("t", "k", "", t(0)),
                    Err(Error::InvalidInput { field: "request fingerprint", .. })
                ));
                let r = proceed(keys.begin("t", "k", &fp, t(0))?);
                let big = r.response(200, vec![0_u8; 1024 * 1024 + 1], t(1));
                assert!(matches!(
                    keys.complete(&r, big, t(1)),
                    Err(Error::TooLarge { field: "response body", .. })
                ));
                let mut elsewhere = r.response(200, Vec::new(), t(1));
                elsewhere.idempotency_key = "other".into();
                assert!(matches!(
                    keys.complete(&r, elsewhere, t(1)),
                    Err(Error::InvalidInput { field: "response", .. })
                ));
                assert!(matches!(
                    keys.complete(&r, r.response(99, Vec::new(), t(1)), t(1)),
                    Err(Error::InvalidInput { field: "response status", .. })
                ));
                let mut header = r.response(200, Vec::new(), t(1));
                header.headers = vec![("x".into(), "a\r\nb".into())];
                assert!(matches!(
                    keys.complete(&r, header, t(1)),
                    Err(Error::InvalidInput { field: "header value", .. })
                ));
                assert!(matches!(keys.begin("t", "k", &fp, t(2))?, Begin::InFlight { .. }), "nothing was written");
                assert!(keys.complete(&r, r.response(200, vec![0_u8; 1024 * 1024], t(3)), t(3))?);
                Ok(())
            }
        }
    };
}
