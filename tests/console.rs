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
    assert!(csp.contains("script-src 'self'"), "{csp}");
    // One script, the console's own file: nothing inline.
    let scripts: Vec<&str> = home.split("<script").skip(1).collect();
    assert_eq!(scripts.len(), 1, "{home}");
    assert!(
        scripts[0].starts_with(&format!(" src=\"{base}/console.js\"></script>")),
        "{}",
        scripts[0]
    );
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
        pages_show_the_outbox(Console::new(outbox.clone()).router(), "").await?;
        destinations_are_shown_and_paused_from_the_console(outbox.clone()).await?;
        actions_change_only_what_they_are_allowed_to(outbox).await
    }
}

/// `POST path` of `router` with the form `fields` and extra `headers`.
async fn post(
    router: &Router,
    path: &str,
    fields: &[(&str, &str)],
    headers: &[(&str, &str)],
) -> Result<(StatusCode, header::HeaderMap, String), Box<dyn std::error::Error>> {
    let body: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("{k}={}", v.replace(' ', "+").replace('&', "%26")))
        .collect();
    let mut request =
        Request::post(path).header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let response = router
        .clone()
        .oneshot(request.body(Body::from(body.join("&")))?)
        .await?;
    let status = response.status();
    let headers = response.headers().clone();
    let body = axum::body::to_bytes(response.into_body(), 1 << 20).await?;
    Ok((status, headers, String::from_utf8(body.to_vec())?))
}

/// The console's token, from a page's hidden field.
fn token_of(html: &str) -> Option<String> {
    let at = html.find("name=\"token\" value=\"")?;
    let rest = &html[at + "name=\"token\" value=\"".len()..];
    rest.split('"').next().map(str::to_owned)
}

/// The actions, refused without writes, the token or from another site,
/// and done with them: on one entry, and on every entry a filter matches.
async fn actions_change_only_what_they_are_allowed_to(
    outbox: impl OutboxAdmin + Clone,
) -> TestResult {
    use idemstore::OutboxStatus::{Failed, Pending};
    let status = |id: u64| outbox.get(idemstore::OutboxId(id)).map(|r| r.entry.status);
    // Read-only: no forms, and a POST changes nothing.
    let read_only = Console::new(outbox.clone()).router();
    let (_, _, page) = get(&read_only, "/outbox/1").await?;
    assert!(!page.contains("<form"), "{page}");
    let (code, _, _) = post(&read_only, "/outbox/1/retry", &[("token", "x")], &[]).await?;
    assert_eq!(code, StatusCode::FORBIDDEN);
    assert_eq!(status(1)?, Failed);
    // With writes: the token is on the page, and needed.
    let router = Console::new(outbox.clone()).allow_writes(true).router();
    let (_, _, page) = get(&router, "/outbox/1").await?;
    let token = token_of(&page).ok_or("a token on the page")?;
    let console = Console::new(outbox.clone()).allow_writes(true);
    let own = token_of(&get(&console.router(), "/outbox/1").await?.2).ok_or("a token")?;
    assert!(
        !format!("{console:?}").contains(&own),
        "no token in the debug form"
    );
    assert!(page.contains("action=\"/outbox/1/retry\""), "{page}");
    for (fields, headers) in [
        (vec![], vec![]),
        (vec![("token", "wrong")], vec![]),
        (
            vec![("token", token.as_str())],
            vec![("sec-fetch-site", "cross-site")],
        ),
    ] {
        let (code, _, body) = post(&router, "/outbox/1/retry", &fields, &headers).await?;
        assert_eq!(code, StatusCode::FORBIDDEN, "{body}");
        assert_eq!(status(1)?, Failed, "nothing changed");
    }
    let (code, headers, _) = post(&router, "/outbox/1/retry", &[("token", &token)], &[]).await?;
    assert_eq!(code, StatusCode::SEE_OTHER);
    assert_eq!(headers[header::LOCATION], "/outbox/1");
    assert_eq!(status(1)?, Pending);
    // Retry every failed entry of `a`: the count shown, a confirmation asked.
    let (_, _, list) = get(&router, "/outbox?status=failed&destination=a").await?;
    assert!(list.contains("all 1 matching entries"), "{list}");
    let fields = [
        ("token", token.as_str()),
        ("status", "failed"),
        ("destination", "a"),
    ];
    let (code, _, _) = post(&router, "/outbox/retry-matching", &fields, &[]).await?;
    assert_eq!(code, StatusCode::BAD_REQUEST, "not confirmed");
    assert_eq!(status(2)?, Failed);
    let confirmed = [fields.as_slice(), &[("confirm", "yes")]].concat();
    let (code, _, done) = post(&router, "/outbox/retry-matching", &confirmed, &[]).await?;
    assert_eq!(code, StatusCode::OK, "{done}");
    assert!(done.contains("1 entries retried"), "{done}");
    assert_eq!(status(2)?, Pending);
    // Cancel every pending entry of `b & c`; `a`'s stay pending.
    let fields = [
        ("token", token.as_str()),
        ("status", "pending"),
        ("destination", "b & c"),
        ("confirm", "yes"),
    ];
    let (code, _, done) = post(&router, "/outbox/cancel-matching", &fields, &[]).await?;
    assert_eq!(code, StatusCode::OK, "{done}");
    assert_eq!(
        (status(1)?, status(2)?, status(3)?),
        (Pending, Pending, Failed)
    );
    Ok(())
}

#[tokio::test]
async fn actions_on_a_store_file_change_only_what_they_are_allowed_to() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("c.idem"))?;
    let outbox = store.outbox();
    let enqueue = |e| outbox.enqueue(e, t(0)).map(|_| ());
    fill(&outbox, enqueue)?;
    actions_change_only_what_they_are_allowed_to(outbox).await
}

/// The destinations page, and pause and resume from it.
async fn destinations_are_shown_and_paused_from_the_console(
    outbox: impl OutboxAdmin + Clone,
) -> TestResult {
    let read_only = Console::new(outbox.clone()).router();
    let (code, _, page) = get(&read_only, "/destinations").await?;
    assert_eq!(code, StatusCode::OK, "{page}");
    assert!(
        page.contains(">b &amp; c<") && !page.contains("<form"),
        "{page}"
    );
    let (code, _, _) = post(
        &read_only,
        "/destinations/pause",
        &[("token", "x"), ("destination", "a")],
        &[],
    )
    .await?;
    assert_eq!(code, StatusCode::FORBIDDEN);
    let router = Console::new(outbox.clone()).allow_writes(true).router();
    let (_, _, page) = get(&router, "/destinations").await?;
    let token = token_of(&page).ok_or("a token")?;
    let (code, headers, _) = post(
        &router,
        "/destinations/pause",
        &[("token", &token), ("destination", "b & c")],
        &[],
    )
    .await?;
    assert_eq!(code, StatusCode::SEE_OTHER);
    assert_eq!(headers[header::LOCATION], "/destinations");
    let paused = |name: &str| -> idemstore::Result<bool> {
        Ok(outbox
            .destinations()?
            .iter()
            .any(|d| d.destination == name && d.paused))
    };
    assert!(paused("b & c")?);
    assert!(!paused("a")?);
    let (_, _, page) = get(&router, "/destinations").await?;
    assert!(page.contains("action=\"/destinations/resume\""), "{page}");
    let (code, _, _) = post(
        &router,
        "/destinations/resume",
        &[("token", &token), ("destination", "b & c")],
        &[],
    )
    .await?;
    assert_eq!(code, StatusCode::SEE_OTHER);
    assert!(!paused("b & c")?);
    let (code, _, _) = post(&router, "/destinations/pause", &[("token", &token)], &[]).await?;
    assert_eq!(code, StatusCode::BAD_REQUEST);
    Ok(())
}

#[tokio::test]
async fn the_destinations_of_a_store_file_are_shown_and_paused_from_the_console() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("c.idem"))?;
    let outbox = store.outbox();
    let enqueue = |e| outbox.enqueue(e, t(0)).map(|_| ());
    fill(&outbox, enqueue)?;
    destinations_are_shown_and_paused_from_the_console(outbox).await
}
