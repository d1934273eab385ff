//! `webhooks::PgReceiver`: the receiver's rules on a PostgreSQL inbox.
//!
//! The server is named by `IDEMSTORE_TEST_POSTGRES` (`.ci/postgres run --
//! cargo test --features webhooks,postgres --test webhooks_receive_pg`).
//! Without it every test says so and passes, except under `CI=true`.

mod common;

use chrono::{DateTime, Utc};
use http::HeaderMap;
use idemstore::Error;
use idemstore::postgres::PgStore;
use idemstore::webhooks::{PgReceiver, Received, Refusal, Secret, Verifier, sign};

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

fn secret() -> Secret {
    Secret::parse(SECRET).unwrap()
}

fn now() -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000, 0).unwrap()
}

fn delivery(id: &str, body: &[u8]) -> HeaderMap {
    let ts = now().timestamp();
    let mut h = HeaderMap::new();
    h.insert("webhook-id", id.parse().unwrap());
    h.insert("webhook-timestamp", ts.to_string().parse().unwrap());
    h.insert(
        "webhook-signature",
        sign(&[secret()], id, ts, body).parse().unwrap(),
    );
    h
}

/// The rows of the test's `orders` table.
fn orders(store: &PgStore, schema: &str) -> Vec<String> {
    store
        .write(|tx| {
            let rows = tx.query(&format!("SELECT id FROM {schema}.orders ORDER BY id"), &[])?;
            Ok::<_, Error>(rows.iter().map(|r| r.get(0)).collect())
        })
        .unwrap()
}

#[test]
fn verified_deliveries_are_claimed_with_their_effect_once_and_refusals_write_nothing() {
    let Some(url) = common::pg::url() else {
        return;
    };
    let schema = common::pg::unique_schema();
    let _remove = common::pg::DropSchema {
        url: url.clone(),
        schema: schema.clone(),
    };
    let store = PgStore::builder().schema(&schema).connect(&url).unwrap();
    store
        .write(|tx| {
            tx.execute(
                &format!("CREATE TABLE {schema}.orders (id text PRIMARY KEY)"),
                &[],
            )?;
            Ok::<_, Error>(())
        })
        .unwrap();
    let receiver = PgReceiver::new(
        store.inbox("hooks").unwrap(),
        Verifier::standard(vec![secret()]),
    );
    let insert = format!("INSERT INTO {schema}.orders (id) VALUES ($1)");
    let body = br#"{"order":1}"#;
    let headers = delivery("msg_1", body);
    let effect = |tx: &mut idemstore::postgres::Transaction<'_>,
                  v: &idemstore::webhooks::Verified| {
        tx.execute(&insert, &[&v.id()])?;
        Ok::<_, Error>(())
    };

    let first = receiver.receive(&headers, body, now(), effect);
    assert!(matches!(first, Received::Applied(())));
    let again = receiver.receive(&headers, body, now(), |_, _| -> Result<(), Error> {
        panic!("a duplicate runs nothing")
    });
    assert!(matches!(again, Received::Duplicate));
    assert_eq!(orders(&store, &schema), vec!["msg_1"]);

    // A changed body: refused, nothing claimed.
    let refused = receiver.receive(&delivery("msg_2", body), b"{}", now(), effect);
    assert!(matches!(refused, Received::Refused(Refusal::Unverified(_))));
    assert_eq!(refused.status(), 401);
    // A failing effect: its write rolls back with the claim.
    let failed = receiver.receive(&delivery("msg_3", body), body, now(), |tx, v| {
        tx.execute(&insert, &[&v.id()])?;
        Err::<(), _>(Error::Io(std::io::Error::other("downstream down")))
    });
    assert!(matches!(failed, Received::Failed(_)));
    assert!(!store.inbox("hooks").unwrap().seen("msg_2").unwrap());
    assert!(!store.inbox("hooks").unwrap().seen("msg_3").unwrap());
    assert_eq!(orders(&store, &schema), vec!["msg_1"]);
    // Its retry applies.
    let retry = receiver.receive(&delivery("msg_3", body), body, now(), effect);
    assert!(matches!(retry, Received::Applied(())));
    assert_eq!(orders(&store, &schema), vec!["msg_1", "msg_3"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_async_receiver_runs_an_async_effect_in_the_claims_transaction() {
    let Some(url) = common::pg::url() else {
        return;
    };
    let schema = common::pg::unique_schema();
    let _remove = common::pg::DropSchema {
        url: url.clone(),
        schema: schema.clone(),
    };
    let store = PgStore::builder()
        .schema(&schema)
        .connect_async(&url)
        .await
        .unwrap();
    let create = format!("CREATE TABLE {schema}.orders (id text PRIMARY KEY)");
    let s2 = store.clone();
    common::pg::off_runtime(move || {
        s2.write(|tx| {
            tx.execute(&create, &[])?;
            Ok::<_, Error>(())
        })
    })
    .unwrap();
    let receiver = PgReceiver::new(
        store.inbox("hooks").unwrap(),
        Verifier::standard(vec![secret()]),
    );
    let body = br#"{"order":7}"#;
    let headers = delivery("msg_7", body);
    for expect_applied in [true, false] {
        let insert = format!("INSERT INTO {schema}.orders (id) VALUES ($1)");
        let got: Received<(), Error> = receiver
            .receive_async(&headers, body, now(), move |tx, v| {
                Box::pin(async move {
                    tx.execute(&insert, &[&v.id()]).await.map_err(Error::from)?;
                    Ok(())
                })
            })
            .await;
        assert_eq!(matches!(got, Received::Applied(())), expect_applied);
        assert_eq!(got.status(), 204);
    }
    let (s3, schema2) = (store.clone(), schema.clone());
    let rows = common::pg::off_runtime(move || orders(&s3, &schema2));
    assert_eq!(rows, vec!["msg_7"]);
}
