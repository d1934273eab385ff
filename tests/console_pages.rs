//! The operator console's overview and list over a store file (and, with
//! feature `postgres` and `IDEMSTORE_TEST_POSTGRES`, a PostgreSQL store):
//! the live part, the oldest pending entry, failures by reason, the
//! application's figures, the list's filters by command and key, its
//! order and sort, the payload shown as text, JSON or hex or redacted by
//! the application, and the actions on checked entries.

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use chrono::{DateTime, Duration, TimeZone, Utc};
use idemstore::console::Console;
use idemstore::{
    CommitStats, NewEntry, OutboxAdmin, OutboxBackend, OutboxId, OutboxStatus, Settlement, Store,
};
use tower::ServiceExt as _;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn t(s: i64) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2025, 3, 1, 0, 0, 0).unwrap() + Duration::seconds(s)
}

/// Entries 1–3 of `a` failed (two `http_500`, one `timeout`), 4 of `b`
/// failed `http_500`, 5 of `a` pending (a JSON payload, command `order-9`),
/// 6 of `b` in flight.
fn fill(
    outbox: &(impl OutboxAdmin + OutboxBackend),
    enqueue: impl Fn(NewEntry) -> idemstore::Result<()>,
) -> TestResult {
    for (d, k) in [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1")] {
        enqueue(NewEntry::new("c", d, k, b"x".to_vec()))?;
    }
    let claimed = OutboxBackend::claim_due(outbox, t(1), 4, "w")?;
    assert_eq!(claimed.len(), 4);
    for c in &claimed {
        let reason = if c.idempotency_key == "a2" {
            "timeout"
        } else {
            "http_500"
        };
        let failed = Settlement::Failed {
            reason: reason.into(),
            next_attempt_at: None,
        };
        OutboxBackend::settle(outbox, c.fence(), failed, t(2))?;
    }
    enqueue(NewEntry::new(
        "order-9",
        "a",
        "a-json",
        br#"{"order":9,"card":"4111"}"#.to_vec(),
    ))?;
    enqueue(NewEntry::new("c", "b", "b-flying", b"y".to_vec()))?;
    let flying = OutboxBackend::claim(
        outbox,
        t(3),
        &idemstore::ClaimRequest::new(1, "w").avoid(["a"]),
    )?;
    assert_eq!(flying[0].idempotency_key, "b-flying");
    Ok(())
}

async fn get(
    router: &Router,
    path: &str,
) -> Result<(StatusCode, String), Box<dyn std::error::Error>> {
    let response = router
        .clone()
        .oneshot(Request::get(path).body(Body::empty())?)
        .await?;
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), 1 << 20).await?;
    Ok((status, String::from_utf8(body.to_vec())?))
}

async fn post(
    router: &Router,
    path: &str,
    body: String,
) -> Result<(StatusCode, String), Box<dyn std::error::Error>> {
    let response = router
        .clone()
        .oneshot(
            Request::post(path)
                .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                .body(Body::from(body))?,
        )
        .await?;
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), 1 << 20).await?;
    Ok((status, String::from_utf8(body.to_vec())?))
}

fn token_of(html: &str) -> Option<String> {
    let at = html.find("name=\"token\" value=\"")? + "name=\"token\" value=\"".len();
    html[at..].split('"').next().map(str::to_owned)
}

/// The ids of the entries a list page links to, in order.
fn listed(html: &str) -> Vec<u64> {
    html.split("href=\"/outbox/")
        .skip(1)
        .filter_map(|rest| rest.split('"').next()?.parse().ok())
        .collect()
}

async fn overview(outbox: impl OutboxAdmin + Clone) -> TestResult {
    let commits = || {
        let mut stats = CommitStats::default();
        (stats.commits, stats.durable_commits) = (41, 40);
        stats
    };
    let router = Console::new(outbox.clone()).commit_stats(commits).router();
    let (status, home) = get(&router, "/").await?;
    assert_eq!(status, StatusCode::OK, "{home}");
    // The live part is the page's, fetched alone too.
    let (status, live) = get(&router, "/live").await?;
    assert_eq!(status, StatusCode::OK);
    assert!(home.contains(r#"data-src="/live""#), "{home}");
    for part in [&home, &live] {
        assert!(
            part.contains("Oldest pending entry: <a href=\"/outbox/5\">5</a>"),
            "{part}"
        );
        // Failures by reason: http_500 three times (a and b), timeout once.
        let http = part
            .find("<td>http_500</td><td class=\"n\">3</td>")
            .ok_or("http_500 × 3")?;
        let timeout = part
            .find("<td>timeout</td><td class=\"n\">1</td>")
            .ok_or("timeout × 1")?;
        assert!(http < timeout, "the most frequent reason first");
        assert!(
            part.contains("<td class=\"n\">40</td>"),
            "the commit figures: {part}"
        );
        assert!(part.contains("<svg"), "the backlog chart");
    }
    assert!(!live.contains("<html"), "a part, not a page");
    let (status, script) = get(&router, "/console.js").await?;
    assert_eq!(status, StatusCode::OK);
    assert!(script.contains("fetch("), "{script}");
    Ok(())
}

async fn list_filters(outbox: impl OutboxAdmin + Clone) -> TestResult {
    let router = Console::new(outbox).router();
    // Filters: by command, by key (any destination), newest first.
    let (_, by_command) = get(&router, "/outbox?command=order-9").await?;
    assert_eq!(listed(&by_command), [5]);
    let (_, by_key) = get(&router, "/outbox?key=b1").await?;
    assert_eq!(listed(&by_key), [4]);
    let (_, by_key) = get(&router, "/outbox?key=b1&destination=a").await?;
    assert!(listed(&by_key).is_empty());
    let (_, newest) = get(&router, "/outbox?status=failed&order=newest").await?;
    assert_eq!(listed(&newest), [4, 3, 2, 1]);
    let (_, oldest) = get(&router, "/outbox?status=failed&destination=a").await?;
    assert_eq!(listed(&oldest), [1, 2, 3]);
    let (_, flying) = get(&router, "/outbox?status=dispatching").await?;
    assert_eq!(listed(&flying), [6]);
    let (_, by_attempts) = get(&router, "/outbox?sort=attempts").await?;
    assert_eq!(
        listed(&by_attempts)[..4],
        [1, 2, 3, 4],
        "one attempt each, first"
    );
    for bad in [
        "/outbox?order=sideways",
        "/outbox?sort=colour",
        "/outbox?status=lost",
    ] {
        assert_eq!(get(&router, bad).await?.0, StatusCode::BAD_REQUEST, "{bad}");
    }
    Ok(())
}

async fn payloads(outbox: impl OutboxAdmin + Clone) -> TestResult {
    let router = Console::new(outbox.clone()).router();
    // The payload: JSON indented by default, as text or hex when asked.
    let (_, json) = get(&router, "/outbox/5").await?;
    assert!(json.contains("&quot;order&quot;: 9"), "{json}");
    let (_, text) = get(&router, "/outbox/5?as=text").await?;
    assert!(text.contains("{&quot;order&quot;:9,"), "{text}");
    let (_, hex) = get(&router, "/outbox/5?as=hex").await?;
    assert!(hex.contains("7b 22 6f 72"), "{hex}");
    assert_eq!(
        get(&router, "/outbox/5?as=pdf").await?.0,
        StatusCode::BAD_REQUEST
    );

    // Redacted by the application's hook, hidden, and a hook that panics.
    let redacted = Console::new(outbox.clone())
        .redact_payloads(|e| {
            Some(
                String::from_utf8_lossy(&e.payload)
                    .replace("4111", "****")
                    .into_bytes(),
            )
        })
        .router();
    let (_, page) = get(&redacted, "/outbox/5").await?;
    assert!(page.contains("****") && !page.contains("4111"), "{page}");
    let hidden = Console::new(outbox.clone()).hide_payloads().router();
    let (_, page) = get(&hidden, "/outbox/5").await?;
    assert!(
        page.contains("Not shown (25 bytes)") && !page.contains("4111"),
        "{page}"
    );
    let panicking = Console::new(outbox.clone())
        .redact_payloads(|_| panic!("a redaction bug"))
        .dispatch_stats(|| panic!("a stats bug"))
        .router();
    let (status, page) = get(&panicking, "/outbox/5").await?;
    assert_eq!(status, StatusCode::OK);
    assert!(
        page.contains("Not shown") && !page.contains("4111"),
        "fails closed: {page}"
    );
    assert_eq!(
        get(&panicking, "/").await?.0,
        StatusCode::OK,
        "the overview without the figures"
    );
    Ok(())
}

async fn selected_entries(outbox: impl OutboxAdmin + Clone) -> TestResult {
    let router = Console::new(outbox.clone()).allow_writes(true).router();
    let (_, list) = get(&router, "/outbox").await?;
    assert!(
        list.contains(r#"type="checkbox" name="id" value="1""#),
        "{list}"
    );
    let token = token_of(&list).ok_or("a token")?;
    // Retry 1 and 4 (failed) and 5 (pending: left as it is).
    let (status, done) = post(
        &router,
        "/outbox/selected",
        format!("token={token}&back=%2Foutbox&id=1&id=4&id=5&action=retry"),
    )
    .await?;
    assert_eq!(status, StatusCode::OK, "{done}");
    assert!(done.contains("2 entries retried"), "{done}");
    assert!(
        done.contains("href=\"/outbox/5\""),
        "the one left is named: {done}"
    );
    for (id, want) in [
        (1, OutboxStatus::Pending),
        (4, OutboxStatus::Pending),
        (5, OutboxStatus::Pending),
        (2, OutboxStatus::Failed),
    ] {
        assert_eq!(outbox.get(OutboxId(id))?.entry.status, want, "{id}");
    }
    // Release the claim of 6, from the checked list and from its page.
    let (_, page) = get(&router, "/outbox/6").await?;
    assert!(page.contains("/outbox/6/release"), "{page}");
    let (status, _) = post(&router, "/outbox/6/release", format!("token={token}")).await?;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(outbox.get(OutboxId(6))?.entry.status, OutboxStatus::Pending);
    assert_eq!(outbox.oldest_claim()?, None);
    // Without the token, or with no entry checked: refused, nothing changed.
    let (status, _) = post(&router, "/outbox/selected", "id=2&action=cancel".into()).await?;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _) = post(
        &router,
        "/outbox/selected",
        format!("token={token}&action=cancel"),
    )
    .await?;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = post(
        &router,
        "/outbox/selected",
        format!("token={token}&action=purge&id=2"),
    )
    .await?;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(outbox.get(OutboxId(2))?.entry.status, OutboxStatus::Failed);
    // Read-only: no check boxes.
    let (_, list) = get(&Console::new(outbox.clone()).router(), "/outbox").await?;
    assert!(!list.contains("checkbox"), "{list}");
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    Ok(())
}

/// Every in-doubt entry resolved from the list's form, every claim
/// released: the store shows them so, and an unknown action is a 404.
async fn matching_resolutions(outbox: impl OutboxAdmin + OutboxBackend + Clone) -> TestResult {
    let router = Console::new(outbox.clone()).allow_writes(true).router();
    // The retries above made entries due at the wall clock's now.
    let later = Utc::now() + Duration::hours(1);
    let doubt = OutboxBackend::claim_due(&outbox, later, 2, "w")?;
    assert_eq!(doubt.len(), 2);
    for d in &doubt {
        let unknown = Settlement::OutcomeUnknown { remote_ref: None };
        OutboxBackend::settle(&outbox, d.fence(), unknown, later)?;
    }
    let (_, list) = get(&router, "/outbox?status=outcome_unknown").await?;
    assert!(list.contains("/outbox/complete-matching"), "{list}");
    assert!(list.contains("/outbox/fail-matching"), "{list}");
    let token = token_of(&list).ok_or("a token")?;
    let form = |what: &str| format!("token={token}&status={what}&confirm=yes&reason=gone");
    let (status, done) = post(&router, "/outbox/fail-matching", form("outcome_unknown")).await?;
    assert_eq!(status, StatusCode::OK, "{done}");
    assert!(done.contains("2 entries marked failed"), "{done}");
    for d in &doubt {
        let r = outbox.get(d.id)?;
        assert_eq!(
            (r.entry.status, r.last_failure.as_deref()),
            (OutboxStatus::Failed, Some("gone"))
        );
    }
    let flying = OutboxBackend::claim_due(&outbox, later, 1, "w")?;
    assert_eq!(flying.len(), 1);
    let (_, done) = post(&router, "/outbox/release-matching", form("dispatching")).await?;
    assert!(done.contains("1 entries released"), "{done}");
    assert_eq!(outbox.oldest_claim()?, None);
    let (status, _) = post(&router, "/outbox/purge-matching", form("failed")).await?;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    Ok(())
}

#[tokio::test]
async fn the_overview_and_list_of_a_store_file() -> TestResult {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    fill(&outbox, |e| outbox.enqueue(e, t(0)).map(|_| ()))?;
    overview(outbox.clone()).await?;
    list_filters(outbox.clone()).await?;
    payloads(outbox.clone()).await?;
    selected_entries(outbox.clone()).await?;
    matching_resolutions(outbox).await
}

#[cfg(feature = "postgres")]
#[path = "common/mod.rs"]
mod common;

#[cfg(feature = "postgres")]
mod pg {
    use idemstore::postgres::PgStore;

    use super::common::pg;
    use super::*;

    #[tokio::test(flavor = "multi_thread")]
    async fn the_overview_and_list_of_a_postgresql_store() -> TestResult {
        let Some(url) = pg::url() else { return Ok(()) };
        let schema = pg::unique_schema();
        let _drop = pg::DropSchema {
            url: url.clone(),
            schema: schema.clone(),
        };
        let outbox = pg::off_runtime(|| {
            let store = PgStore::builder().schema(&schema).connect(&url)?;
            let outbox = store.outbox();
            fill(&outbox, |e| outbox.enqueue(e, t(0)).map(|_| ()))
                .map_err(|e| idemstore::Error::Io(std::io::Error::other(e.to_string())))?;
            Ok::<_, idemstore::Error>(outbox)
        })?;
        overview(outbox.clone()).await?;
        list_filters(outbox.clone()).await?;
        payloads(outbox.clone()).await?;
        selected_entries(outbox.clone()).await?;
        matching_resolutions(outbox).await
    }
}
