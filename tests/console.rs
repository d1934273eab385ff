//! The operator console's pages over a store file (and, with feature
//! `postgres` and `IDEMSTORE_TEST_POSTGRES`, a PostgreSQL store): what
//! they show, the links from the overview to every entry it counts, the
//! security headers, and that hostile values render as text.

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use chrono::{DateTime, Duration, TimeZone, Utc};
use idemstore::console::Console;
use idemstore::{NewEntry, OutboxAdmin, OutboxBackend, Settlement, Store};
use tower::ServiceExt as _;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn t(s: i64) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2025, 3, 1, 0, 0, 0).unwrap() + Duration::seconds(s)
}

const HOSTILE: &str = "<script>alert(1)</script>";

/// Two failed entries for `a` (one with a hostile reason and payload), one
/// pending for `b`.
fn fill(
    outbox: &(impl OutboxAdmin + OutboxBackend),
    enqueue: impl Fn(NewEntry) -> idemstore::Result<()>,
) -> TestResult {
    enqueue(NewEntry::new("c", "a", "a1", HOSTILE.as_bytes().to_vec()))?;
    enqueue(NewEntry::new("c", "a", "a2", vec![0xff, 0x00, 0x10]))?;
    let claimed = OutboxBackend::claim_due(outbox, t(1), 2, "w")?;
    for (e, reason) in claimed.iter().zip([HOSTILE, "http_500"]) {
        let failed = Settlement::Failed {
            reason: reason.into(),
            next_attempt_at: None,
        };
        OutboxBackend::settle(outbox, e.fence(), failed, t(2))?;
    }
    enqueue(NewEntry::new("c", "b & c", "b1", b"{}".to_vec()))?;
    Ok(())
}

/// `GET path` of `router`: the status, the headers and the body.
async fn get(
    router: &Router,
    path: &str,
) -> Result<(StatusCode, header::HeaderMap, String), Box<dyn std::error::Error>> {
    let response = router
        .clone()
        .oneshot(Request::get(path).body(Body::empty())?)
        .await?;
    let status = response.status();
    let headers = response.headers().clone();
    let body = axum::body::to_bytes(response.into_body(), 1 << 20).await?;
    Ok((status, headers, String::from_utf8(body.to_vec())?))
}

/// The `href`s of `html`, in order.
fn links(html: &str) -> Vec<String> {
    html.split("href=\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .map(|l| l.replace("&amp;", "&"))
        .collect()
}

async fn pages_show_the_outbox(router: Router, base: &str) -> TestResult {
    let root = if base.is_empty() { "/" } else { base };
    let (status, headers, home) = get(&router, root).await?;
    assert!(
        links(&home).contains(&root.to_owned()),
        "the overview links to itself"
    );
    assert_eq!(status, StatusCode::OK, "{home}");
    let csp = headers[header::CONTENT_SECURITY_POLICY].to_str()?;
    assert!(csp.contains("default-src 'none'"), "{csp}");
    assert_eq!(headers[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
    assert!(!home.contains("<script"), "no script on any page");
    // The overview's counts link to the entries they count.
    let failed_of_a = format!("{base}/outbox?status=failed&destination=a");
    assert!(links(&home).contains(&failed_of_a), "{:?}", links(&home));
    let (status, _, list) = get(&router, &failed_of_a).await?;
    assert_eq!(status, StatusCode::OK, "{list}");
    let entries: Vec<String> = links(&list)
        .into_iter()
        .filter(|l| l.starts_with(&format!("{base}/outbox/")))
        .collect();
    assert_eq!(
        entries,
        [format!("{base}/outbox/1"), format!("{base}/outbox/2")]
    );
    // A hostile reason and payload are text.
    assert!(
        list.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{list}"
    );
    assert!(!list.contains(HOSTILE));
    let (status, _, one) = get(&router, &entries[0]).await?;
    assert_eq!(status, StatusCode::OK, "{one}");
    assert!(
        one.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{one}"
    );
    assert!(!one.contains(HOSTILE), "{one}");
    // A payload that is not UTF-8 is shown in hex.
    let (_, _, two) = get(&router, &entries[1]).await?;
    assert!(two.contains("ff 00 10"), "{two}");
    // A destination with `&` and a space is linked encoded.
    assert!(
        links(&home).contains(&format!("{base}/outbox?destination=b%20%26%20c")),
        "{home}"
    );
    // Bad input and unknown entries.
    assert_eq!(
        get(&router, &format!("{base}/outbox/99")).await?.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        get(&router, &format!("{base}/outbox/x")).await?.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        get(&router, &format!("{base}/outbox?status=nope")).await?.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        get(&router, &format!("{base}/style.css")).await?.1[header::CONTENT_TYPE],
        "text/css; charset=utf-8"
    );
    Ok(())
}

#[tokio::test]
async fn the_pages_of_a_store_file_show_its_outbox_as_text() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("c.idem"))?;
    let outbox = store.outbox();
    let enqueue = |e| outbox.enqueue(e, t(0)).map(|_| ());
    fill(&outbox, enqueue)?;
    pages_show_the_outbox(Console::new(outbox.clone()).router(), "").await?;
    // Mounted under a path, every link starts with it.
    let mounted = Router::new().nest("/ops", Console::new(outbox).base_path("/ops/").router());
    pages_show_the_outbox(mounted, "/ops").await
}

#[cfg(feature = "postgres")]
mod common;

#[cfg(feature = "postgres")]
mod postgres {
    use idemstore::postgres::PgStore;

    use super::common::pg;
    use super::*;

    #[tokio::test(flavor = "multi_thread")]
    async fn the_pages_of_a_postgresql_store_show_its_outbox_as_text() -> TestResult {
        let Some(url) = pg::url() else { return Ok(()) };
        let schema = pg::unique_schema();
        let _drop = pg::DropSchema {
            url: url.clone(),
            schema: schema.clone(),
        };
        let outbox = pg::off_runtime(|| {
            let store = PgStore::builder().schema(&schema).connect(&url)?;
            let outbox = store.outbox();
            let enqueue = |e| outbox.enqueue(e, t(0)).map(|_| ());
            fill(&outbox, enqueue)
                .map_err(|e| idemstore::Error::Io(std::io::Error::other(e.to_string())))?;
            Ok::<_, idemstore::Error>(outbox)
        })?;
        pages_show_the_outbox(Console::new(outbox).router(), "").await
    }
}
