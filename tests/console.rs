//! The operator console's pages over a store file (and, with feature
//! `postgres` and `IDEMSTORE_TEST_POSTGRES`, a PostgreSQL store): what
//! they show, the links from the overview to every entry it counts, the
//! security headers, that hostile values render as text, and the inbox
//! and idempotency-key pages with the release of a stuck reservation.

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use chrono::{DateTime, Duration, TimeZone, Utc};
use idemstore::console::Console;
use idemstore::{
    Begin, IdempotencyBackend, NewEntry, OutboxAdmin, OutboxBackend, Reservation, Settlement,
    Store, fingerprint,
};
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

    #[tokio::test(flavor = "multi_thread")]
    async fn the_inboxes_and_keys_of_a_postgresql_store_are_shown_and_released() -> TestResult {
        let Some(url) = pg::url() else { return Ok(()) };
        let schema = pg::unique_schema();
        let _drop = pg::DropSchema {
            url: url.clone(),
            schema: schema.clone(),
        };
        let (store, stuck) = pg::off_runtime(|| {
            let store = PgStore::builder().schema(&schema).connect(&url)?;
            let claim = |name: &str, key: &str, at| store.inbox(name)?.claim(key, at);
            let stuck = fill_store(claim, &store.idempotency_keys())
                .map_err(|e| idemstore::Error::Io(std::io::Error::other(e.to_string())))?;
            Ok::<_, idemstore::Error>((store, stuck))
        })?;
        let console = |writes: bool, given: bool| {
            let console = Console::new(store.outbox()).allow_writes(writes);
            if given {
                console.store(store.clone())
            } else {
                console
            }
        };
        let prune = |name: &str, before| store.inbox(name)?.prune(before);
        inbox_and_key_pages(console, prune).await?;
        a_stuck_reservation_is_released_from_the_console(console, &store.idempotency_keys(), &stuck)
            .await
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

#[tokio::test]
async fn schedules_are_shown_and_paused_from_the_console() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("c.idem"))?;
    let outbox = store.outbox();
    let every = idemstore::Schedule::every("reports", std::time::Duration::from_secs(300))?;
    outbox.set_schedule_at("nightly & co", every, t(0))?;
    let read_only = Console::new(outbox.clone()).router();
    let (code, _, page) = get(&read_only, "/schedules").await?;
    assert_eq!(code, StatusCode::OK, "{page}");
    assert!(
        page.contains(">nightly &amp; co<")
            && page.contains("every 300s")
            && !page.contains("<form"),
        "{page}"
    );
    let (code, _, _) = post(
        &read_only,
        "/schedules/pause",
        &[("token", "x"), ("schedule", "nightly & co")],
        &[],
    )
    .await?;
    assert_eq!(code, StatusCode::FORBIDDEN);
    assert!(!outbox.schedules()?[0].paused, "refused: nothing changed");
    let router = Console::new(outbox.clone()).allow_writes(true).router();
    let (_, _, page) = get(&router, "/schedules").await?;
    let token = token_of(&page).ok_or("a token")?;
    let (code, headers, _) = post(
        &router,
        "/schedules/pause",
        &[("token", &token), ("schedule", "nightly & co")],
        &[],
    )
    .await?;
    assert_eq!(code, StatusCode::SEE_OTHER);
    assert_eq!(headers[header::LOCATION], "/schedules");
    assert!(outbox.schedules()?[0].paused);
    let (_, _, page) = get(&router, "/schedules").await?;
    assert!(page.contains("action=\"/schedules/resume\""), "{page}");
    let (code, _, _) = post(
        &router,
        "/schedules/resume",
        &[("token", &token), ("schedule", "nightly & co")],
        &[],
    )
    .await?;
    assert_eq!(code, StatusCode::SEE_OTHER);
    assert!(!outbox.schedules()?[0].paused);
    let (code, _, _) = post(&router, "/schedules/pause", &[("token", &token)], &[]).await?;
    assert_eq!(code, StatusCode::BAD_REQUEST);
    Ok(())
}

/// The fingerprint of the requests of the key pages' tests.
fn request() -> String {
    fingerprint("POST", "/pay", b"{}")
}

/// Inbox `webhooks` with two keys and `payments.v2` with one; keys: a
/// completed one with a hostile body and header (`acme`/`done`), one with
/// a body that is not UTF-8 (`acme`/`binary`), a reservation of the
/// default tenant (`a&b c`), 50 of tenant `bulk`, and a stuck one
/// (`acme`/`stuck`), returned.
fn fill_store(
    claim: impl Fn(&str, &str, DateTime<Utc>) -> idemstore::Result<bool>,
    keys: &impl IdempotencyBackend,
) -> Result<Reservation, Box<dyn std::error::Error>> {
    assert!(claim("webhooks", "e1", t(5))?);
    assert!(claim("webhooks", "e&2", t(6))?);
    assert!(claim("payments.v2", "p1", t(7))?);
    let fp = request();
    let proceed = |tenant: &str, key: &str| match keys.begin(tenant, key, &fp, t(0)) {
        Ok(Begin::Proceed(r)) => Ok(r),
        other => Err(format!("expected Proceed, got {other:?}")),
    };
    let done = proceed("acme", "done")?;
    let mut response = done.response(201, HOSTILE.as_bytes().to_vec(), t(1));
    response.content_type = Some("text/html".into());
    response.headers = vec![("x-note".into(), HOSTILE.into())];
    assert!(keys.complete(&done, response, t(1))?);
    let binary = proceed("acme", "binary")?;
    assert!(keys.complete(
        &binary,
        binary.response(200, vec![0xff, 0x00, 0x10], t(1)),
        t(1)
    )?);
    proceed("", "a&b c")?;
    for i in 0..50 {
        proceed("bulk", &format!("page-{i:02}"))?;
    }
    Ok(proceed("acme", "stuck")?)
}

/// The pages of the store filled by [`fill_store`]: `console(writes,
/// given)` is a console that allows writes if `writes`, given the store
/// if `given`; `prune` prunes an inbox.
async fn inbox_and_key_pages(
    console: impl Fn(bool, bool) -> Console,
    prune: impl Fn(&str, DateTime<Utc>) -> idemstore::Result<u64>,
) -> TestResult {
    pages_of_the_store_need_it(console(true, false).router()).await?;
    let router = console(false, true).router();
    inbox_pages(&router, prune).await?;
    key_pages(&router).await
}

/// Not given the store: no links, and the pages are 404s.
async fn pages_of_the_store_need_it(without: Router) -> TestResult {
    let (_, _, home) = get(&without, "/").await?;
    assert!(!links(&home).contains(&"/inboxes".to_owned()), "{home}");
    for path in [
        "/inboxes",
        "/inboxes/lookup?inbox=webhooks&key=e1",
        "/keys",
        "/keys/lookup?key=done",
    ] {
        let (code, _, page) = get(&without, path).await?;
        assert_eq!(code, StatusCode::NOT_FOUND, "{path}");
        assert!(page.contains("not given the store"), "{page}");
    }
    let (code, _, _) = post(&without, "/keys/release", &[("token", "x")], &[]).await?;
    assert_eq!(code, StatusCode::NOT_FOUND);
    Ok(())
}

/// The inboxes and their counts, and lookups of a seen, an unseen and a
/// pruned key.
async fn inbox_pages(
    router: &Router,
    prune: impl Fn(&str, DateTime<Utc>) -> idemstore::Result<u64>,
) -> TestResult {
    let router = router.clone();
    let (code, headers, home) = get(&router, "/").await?;
    assert_eq!(code, StatusCode::OK);
    assert!(
        headers[header::CONTENT_SECURITY_POLICY]
            .to_str()?
            .contains("default-src 'none'")
    );
    for link in ["/inboxes", "/keys"] {
        assert!(links(&home).contains(&link.to_owned()), "{link} in {home}");
    }
    let (code, _, inboxes) = get(&router, "/inboxes").await?;
    assert_eq!(code, StatusCode::OK, "{inboxes}");
    assert!(
        inboxes.contains("<td>webhooks</td><td class=\"n\">2</td>"),
        "{inboxes}"
    );
    assert!(
        inboxes.contains("<td>payments.v2</td><td class=\"n\">1</td>"),
        "{inboxes}"
    );
    assert!(inboxes.contains("action=\"/inboxes/lookup\""), "{inboxes}");
    let (code, _, seen) = get(&router, "/inboxes/lookup?inbox=webhooks&key=e%262").await?;
    assert_eq!(code, StatusCode::OK, "{seen}");
    assert!(
        seen.contains("claimed at 2025-03-01 00:00:06 UTC") && seen.contains("e&amp;2"),
        "{seen}"
    );
    let (code, _, unseen) = get(&router, "/inboxes/lookup?inbox=webhooks&key=nope").await?;
    assert_eq!(code, StatusCode::OK, "{unseen}");
    assert!(
        unseen.contains("not seen") && unseen.contains("pruned"),
        "{unseen}"
    );
    assert_eq!(prune("webhooks", t(6))?, 1);
    let (_, _, pruned) = get(&router, "/inboxes/lookup?inbox=webhooks&key=e1").await?;
    assert!(
        pruned.contains("not seen"),
        "a pruned key reads as not seen: {pruned}"
    );
    assert!(
        get(&router, "/inboxes")
            .await?
            .2
            .contains("<td>webhooks</td><td class=\"n\">1</td>")
    );
    for bad in [
        "/inboxes/lookup?inbox=has%20space&key=e1",
        "/inboxes/lookup?inbox=webhooks&key=",
        "/inboxes/lookup?inbox=webhooks",
    ] {
        assert_eq!(get(&router, bad).await?.0, StatusCode::BAD_REQUEST, "{bad}");
    }
    Ok(())
}

/// The keys: the summary, a lookup form, the first page of 50 and the
/// next; a completed key's stored response, as text.
async fn key_pages(router: &Router) -> TestResult {
    let router = router.clone();
    let (code, _, list) = get(&router, "/keys").await?;
    assert_eq!(code, StatusCode::OK, "{list}");
    assert!(
        list.contains("<th>completed</th><td class=\"n\">2</td>"),
        "{list}"
    );
    assert!(
        list.contains("<th>reserved</th><td class=\"n\">52</td>"),
        "{list}"
    );
    assert!(list.contains("action=\"/keys/lookup\""), "{list}");
    let lookups: Vec<String> = links(&list)
        .into_iter()
        .filter(|l| l.starts_with("/keys/lookup?"))
        .collect();
    assert_eq!(lookups.len(), 50);
    assert_eq!(
        lookups[0], "/keys/lookup?tenant=&key=a%26b%20c",
        "the default tenant first, encoded"
    );
    assert_eq!(lookups[49], "/keys/lookup?tenant=bulk&key=page-45");
    let next = links(&list)
        .into_iter()
        .find(|l| l.starts_with("/keys?"))
        .ok_or("a next page")?;
    assert_eq!(next, "/keys?after_tenant=bulk&after_key=page-45");
    let (_, _, second) = get(&router, &next).await?;
    let rest: Vec<String> = links(&second)
        .into_iter()
        .filter(|l| l.starts_with("/keys/lookup?"))
        .collect();
    assert_eq!(
        rest.first().map(String::as_str),
        Some("/keys/lookup?tenant=bulk&key=page-46")
    );
    assert_eq!(rest.len(), 4, "{rest:?}");
    assert!(
        !links(&second).iter().any(|l| l.starts_with("/keys?")),
        "the last page"
    );
    let (code, _, odd) = get(&router, &lookups[0]).await?;
    assert_eq!(code, StatusCode::OK, "{odd}");
    assert!(
        odd.contains("a&amp;b c") && odd.contains("(default tenant)"),
        "{odd}"
    );

    // A completed key: its stored response, as text.
    let (code, _, done) = get(&router, "/keys/lookup?tenant=acme&key=done").await?;
    assert_eq!(code, StatusCode::OK, "{done}");
    assert!(
        done.contains("completed") && done.contains(&request()),
        "{done}"
    );
    assert!(
        done.contains("<td>201</td>") && done.contains("text/html"),
        "{done}"
    );
    assert!(
        done.contains("<th>x-note</th><td>&lt;script&gt;alert(1)&lt;/script&gt;</td>"),
        "{done}"
    );
    assert!(
        done.contains("<pre>&lt;script&gt;alert(1)&lt;/script&gt;</pre>"),
        "{done}"
    );
    assert!(!done.contains(HOSTILE), "{done}");
    let (_, _, binary) = get(&router, "/keys/lookup?tenant=acme&key=binary").await?;
    assert!(binary.contains("<pre>ff 00 10</pre>"), "{binary}");
    // Unknown keys and bad input.
    assert_eq!(
        get(&router, "/keys/lookup?tenant=acme&key=nope").await?.0,
        StatusCode::NOT_FOUND
    );
    for bad in [
        "/keys/lookup?tenant=acme&key=",
        "/keys/lookup?tenant=acme",
        "/keys?after_tenant=acme",
    ] {
        assert_eq!(get(&router, bad).await?.0, StatusCode::BAD_REQUEST, "{bad}");
    }
    let long = format!("/keys/lookup?tenant=acme&key={}", "k".repeat(256));
    assert_eq!(get(&router, &long).await?.0, StatusCode::BAD_REQUEST);
    Ok(())
}

/// The release of `stuck` (a reservation of `acme`/`stuck` made at `t(0)`
/// with the default lease of 60 s) refused: on a read-only console (which
/// shows no form), without the token, with another, from another site,
/// and with a fence that is not a number. The reservation stays.
async fn a_release_is_refused_without_writes_or_the_token(
    console: impl Fn(bool, bool) -> Console,
    keys: &impl IdempotencyBackend,
    stuck: &Reservation,
) -> TestResult {
    let fp = request();
    let held = || -> idemstore::Result<bool> {
        Ok(matches!(
            keys.begin("acme", "stuck", &fp, t(10))?,
            Begin::InFlight { .. }
        ))
    };
    let lookup = "/keys/lookup?tenant=acme&key=stuck";
    let fence = stuck.fence().to_string();
    // Read-only: no form, and the POST is refused.
    let read_only = console(false, true).router();
    let (code, _, page) = get(&read_only, lookup).await?;
    assert_eq!(code, StatusCode::OK, "{page}");
    assert!(
        page.contains("reserved") && page.contains(&format!("<td>{fence}</td>")),
        "{page}"
    );
    assert!(
        !page.contains("/keys/release") && !page.contains("<form"),
        "{page}"
    );
    let router = console(true, true).router();
    let (_, _, page) = get(&router, lookup).await?;
    let token = token_of(&page).ok_or("a token on the page")?;
    assert!(
        page.contains("action=\"/keys/release\"") && page.contains("Release this reservation"),
        "{page}"
    );
    assert!(
        page.contains(&format!("name=\"fence\" value=\"{fence}\"")),
        "{page}"
    );
    let form = [
        ("tenant", "acme"),
        ("key", "stuck"),
        ("fence", fence.as_str()),
    ];
    let (code, _, _) = post(
        &read_only,
        "/keys/release",
        &[form.as_slice(), &[("token", &token)]].concat(),
        &[],
    )
    .await?;
    assert_eq!(code, StatusCode::FORBIDDEN, "a read-only console");
    assert!(held()?);
    // Without the token, with another, from another site: refused.
    for (fields, headers) in [
        (form.to_vec(), vec![]),
        ([form.as_slice(), &[("token", "wrong")]].concat(), vec![]),
        (
            [form.as_slice(), &[("token", token.as_str())]].concat(),
            vec![("sec-fetch-site", "cross-site")],
        ),
    ] {
        let (code, _, body) = post(&router, "/keys/release", &fields, &headers).await?;
        assert_eq!(code, StatusCode::FORBIDDEN, "{body}");
        assert!(held()?, "the reservation stays");
    }
    let bad = [
        ("tenant", "acme"),
        ("key", "stuck"),
        ("fence", "x"),
        ("token", token.as_str()),
    ];
    assert_eq!(
        post(&router, "/keys/release", &bad, &[]).await?.0,
        StatusCode::BAD_REQUEST
    );
    assert!(held()?);
    Ok(())
}

/// The release of `stuck` done with the token, after the refusals; `begin`
/// proceeds after it, and the same form again (a stale fence) or a
/// completed key's fence releases nothing.
async fn a_stuck_reservation_is_released_from_the_console(
    console: impl Fn(bool, bool) -> Console,
    keys: &impl IdempotencyBackend,
    stuck: &Reservation,
) -> TestResult {
    a_release_is_refused_without_writes_or_the_token(&console, keys, stuck).await?;
    let fp = request();
    let router = console(true, true).router();
    let (_, _, page) = get(&router, "/keys/lookup?tenant=acme&key=stuck").await?;
    let token = token_of(&page).ok_or("a token on the page")?;
    let fence = stuck.fence().to_string();
    let with_token = [
        ("tenant", "acme"),
        ("key", "stuck"),
        ("fence", fence.as_str()),
        ("token", token.as_str()),
    ];
    let (code, _, done) = post(&router, "/keys/release", &with_token, &[]).await?;
    assert_eq!(code, StatusCode::OK, "{done}");
    assert!(done.contains("Released"), "{done}");
    let Begin::Proceed(again) = keys.begin("acme", "stuck", &fp, t(10))? else {
        return Err("a released key proceeds".into());
    };
    assert!(again.fence() > stuck.fence());
    // The same page again (a stale fence) frees nothing: the new holder keeps the key.
    let (code, _, stale) = post(&router, "/keys/release", &with_token, &[]).await?;
    assert_eq!(code, StatusCode::CONFLICT, "{stale}");
    assert!(stale.contains("Nothing was released"), "{stale}");
    assert!(matches!(
        keys.begin("acme", "stuck", &fp, t(11))?,
        Begin::InFlight { .. }
    ));
    // A completed key's fence releases nothing either: its response stays.
    let (_, _, page) = get(&router, "/keys/lookup?tenant=acme&key=done").await?;
    assert!(
        !page.contains("/keys/release"),
        "no release of a response: {page}"
    );
    let done_fence = page
        .split("<th>fence</th><td>")
        .nth(1)
        .and_then(|rest| rest.split('<').next())
        .ok_or("the fence on the page")?
        .to_owned();
    let fields = [
        ("tenant", "acme"),
        ("key", "done"),
        ("fence", done_fence.as_str()),
        ("token", token.as_str()),
    ];
    assert_eq!(
        post(&router, "/keys/release", &fields, &[]).await?.0,
        StatusCode::CONFLICT
    );
    assert!(
        matches!(keys.begin("acme", "done", &fp, t(12))?, Begin::Replay(r) if r.response_body == HOSTILE.as_bytes())
    );
    Ok(())
}

#[tokio::test]
async fn the_inboxes_and_keys_of_a_store_file_are_shown_and_released() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("c.idem"))?;
    let claim = |name: &str, key: &str, at| store.inbox(name)?.claim(key, at);
    let stuck = fill_store(claim, &store.idempotency_keys())?;
    let console = |writes: bool, given: bool| {
        let console = Console::new(store.outbox()).allow_writes(writes);
        if given {
            console.store(store.clone())
        } else {
            console
        }
    };
    let prune = |name: &str, before| store.inbox(name)?.prune(before);
    inbox_and_key_pages(console, prune).await?;
    a_stuck_reservation_is_released_from_the_console(console, &store.idempotency_keys(), &stuck)
        .await?;
    // Mounted under a path, the pages' links and forms start with it.
    let mounted = Router::new().nest(
        "/ops",
        Console::new(store.outbox())
            .store(store.clone())
            .allow_writes(true)
            .base_path("/ops")
            .router(),
    );
    let (_, _, home) = get(&mounted, "/ops").await?;
    assert!(links(&home).contains(&"/ops/keys".to_owned()), "{home}");
    let (_, _, list) = get(&mounted, "/ops/keys").await?;
    assert!(
        links(&list).contains(&"/ops/keys/lookup?tenant=acme&key=done".to_owned()),
        "{list}"
    );
    assert!(list.contains("action=\"/ops/keys/lookup\""), "{list}");
    let (_, _, inboxes) = get(&mounted, "/ops/inboxes").await?;
    assert!(
        inboxes.contains("action=\"/ops/inboxes/lookup\""),
        "{inboxes}"
    );
    Ok(())
}
