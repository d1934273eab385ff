//! The operator console in a real browser: headless Chromium, driven over
//! the W3C WebDriver protocol by `chromedriver`, on a console served on a
//! loopback port. Each scenario ends with what the store says, not only
//! with what a page showed. On a store file, and (with feature `postgres`
//! and `IDEMSTORE_TEST_POSTGRES`) on PostgreSQL.
//!
//! The WebDriver client is the dozen endpoints these tests call, as JSON
//! over a `TcpStream`: the maintained client crate, `fantoccini`, brings
//! some fifty more crates (two generations of ICU, a second `http` and
//! `cookie`) for them.
//!
//! Without `/usr/bin/chromium` and `/usr/bin/chromedriver` (Debian's
//! `chromium` and `chromium-driver`) the tests say so and pass, except when
//! `CI` is set, where their absence fails them. Screenshots of the main
//! pages go to `target/console-screenshots/`; with
//! `IDEMSTORE_UPDATE_DOCS_SCREENSHOT` set, the overview's is also written
//! to `docs/console.png`.

#[path = "console_browser/webdriver.rs"]
mod webdriver;

use std::path::Path;

use axum::Router;
use chrono::{DateTime, Duration, TimeZone, Utc};
use idemstore::console::Console;
use idemstore::{
    NewEntry, OutboxAdmin, OutboxBackend, OutboxFilter, OutboxId, OutboxRecord, OutboxStatus,
    Settlement, Store,
};

use webdriver::{Browser, Fallible, Served, http};

type TestResult = Fallible<()>;

fn t(s: i64) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2025, 3, 1, 0, 0, 0).unwrap() + Duration::seconds(s)
}

// ---------------------------------------------------------------------
// The store.

/// Destination A of the scenarios.
const PAYMENTS: &str = "payments";
/// Destination B.
const EMAIL: &str = "email";
/// The destination of the entry with hostile values.
const WEBHOOKS: &str = "webhooks";

const HOSTILE_PAYLOAD: &str = "<script>window.__pwned=1</script>";
const HOSTILE_REASON: &str = "<img src=x onerror=\"window.__pwned=1\">";

/// The entries [`fill`] made, by what they are.
struct Entries {
    failed_a: Vec<OutboxId>,
    failed_b: Vec<OutboxId>,
    pending_a: OutboxId,
    hostile: OutboxId,
}

/// Three failed entries for `payments` (A) and a pending one; two failed
/// entries for `email` (B) and two completed; one failed entry for
/// `webhooks` whose payload and failure reason are markup.
fn fill(
    outbox: &impl OutboxBackend,
    enqueue: impl Fn(NewEntry) -> idemstore::Result<OutboxId>,
) -> Fallible<Entries> {
    let entry = |destination: &str, key: String, body: String| {
        enqueue(NewEntry::new(
            "checkout",
            destination,
            key,
            body.into_bytes(),
        ))
    };
    let several = |destination: &str, key: &str, n: u32| {
        (1..=n)
            .map(|i| {
                entry(
                    destination,
                    format!("{key}-{i}"),
                    format!("{{\"order\":{i}}}"),
                )
            })
            .collect::<idemstore::Result<Vec<_>>>()
    };
    let failed_a = several(PAYMENTS, "charge", 3)?;
    let failed_b = several(EMAIL, "receipt", 2)?;
    let completed = several(EMAIL, "welcome", 2)?;
    let hostile = entry(WEBHOOKS, "hook-1".into(), HOSTILE_PAYLOAD.into())?;
    let claimed = OutboxBackend::claim_due(outbox, t(1), 100, "worker-1")?;
    assert_eq!(claimed.len(), 8, "every entry claimed");
    for e in &claimed {
        let failed = |reason: &str| Settlement::Failed {
            reason: reason.into(),
            next_attempt_at: None,
        };
        let settlement = match e.destination.as_str() {
            _ if completed.contains(&e.id) => Settlement::Completed,
            PAYMENTS => failed("http_503 (upstream unavailable)"),
            EMAIL => failed("smtp_550 (mailbox unavailable)"),
            _ => failed(HOSTILE_REASON),
        };
        OutboxBackend::settle(outbox, e.fence(), settlement, t(2))?;
    }
    let pending_a = entry(PAYMENTS, "charge-4".into(), "{\"order\":4}".into())?;
    Ok(Entries {
        failed_a,
        failed_b,
        pending_a,
        hostile,
    })
}

// ---------------------------------------------------------------------
// The scenarios.

/// A browser on the consoles of one store, served: writable under `/ops`,
/// read-only under `/ro` (with the same token), and the store behind them.
struct Tour<'a, O> {
    browser: Browser,
    served: Served,
    outbox: &'a O,
    entries: &'a Entries,
}

impl<O: OutboxAdmin> Tour<'_, O> {
    /// Opens `path` of the console and waits for its page, `heading`.
    fn open(&self, path: &str, heading: &str) -> TestResult {
        self.browser
            .goto(&format!("http://{}{path}", self.served.addr))?;
        self.browser.wait_for(heading)
    }

    /// The status of a form `POST` of `form` to `path`, sent from outside
    /// the browser.
    fn post(&self, path: &str, form: &str, headers: &[(&str, &str)]) -> Fallible<u16> {
        let mut all = vec![("Content-Type", "application/x-www-form-urlencoded")];
        all.extend_from_slice(headers);
        Ok(http(self.served.addr, "POST", path, &all, form.as_bytes())?.0)
    }

    fn record(&self, id: OutboxId) -> idemstore::Result<OutboxRecord> {
        self.outbox.get(id)
    }

    fn status(&self, id: OutboxId) -> idemstore::Result<OutboxStatus> {
        Ok(self.record(id)?.entry.status)
    }

    /// The console's token, as the writable console's entry page carries it.
    fn token(&self) -> Fallible<String> {
        let id = self.entries.failed_a[0].0;
        self.open(&format!("/ops/outbox/{id}"), &format!("Entry {id}"))?;
        let token = self
            .browser
            .execute("return document.querySelector('input[name=token]').value")?;
        Ok(token.as_str().ok_or("a token")?.to_owned())
    }

    /// Every entry of A and B still failed.
    fn nothing_retried(&self) -> TestResult {
        for &id in self.entries.failed_a.iter().chain(&self.entries.failed_b) {
            assert_eq!(self.status(id)?, OutboxStatus::Failed, "entry {}", id.0);
        }
        Ok(())
    }
}

/// Runs every scenario on the consoles of `outbox`, which [`fill`] filled
/// as `entries`, in a browser (with the screenshots to `shots` if given):
/// hostile values stay text, actions without the token are refused, a
/// read-only console offers and takes no action, pause and resume work
/// from their buttons, and "retry all matching" retries exactly the
/// entries of its filter. The store is checked after each.
fn suite<O: OutboxAdmin + Clone>(
    outbox: &O,
    entries: &Entries,
    shots: Option<&Path>,
) -> TestResult {
    let Some(browser) = Browser::start()? else {
        return Ok(());
    };
    let writable = Console::new(outbox.clone())
        .base_path("/ops")
        .allow_writes(true);
    let read_only = writable.clone().allow_writes(false).base_path("/ro");
    let app = Router::new()
        .nest("/ops", writable.router())
        .nest("/ro", read_only.router());
    let tour = Tour {
        browser,
        served: Served::start(app)?,
        outbox,
        entries,
    };
    if let Some(dir) = shots {
        screenshots(&tour, dir)?;
    }
    hostile_values_are_shown_as_text_and_never_run(&tour)?;
    posts_without_the_token_are_refused(&tour)?;
    a_read_only_console_offers_no_action_and_takes_none(&tour)?;
    destinations_are_paused_and_resumed_by_their_buttons(&tour)?;
    retry_all_matching_retries_the_entries_of_the_filter_only(&tour)
}

/// The main pages, as a person sees them: PNGs in `dir`, the overview's
/// also in `docs/console.png` when asked for.
fn screenshots<O: OutboxAdmin>(tour: &Tour<'_, O>, dir: &Path) -> TestResult {
    std::fs::create_dir_all(dir)?;
    let id = tour.entries.failed_a[0].0;
    let list = format!("/ops/outbox?status=failed&destination={PAYMENTS}");
    for (name, path, heading) in [
        ("overview", "/ops".to_owned(), "Overview".to_owned()),
        ("list-failed", list, "Outbox".to_owned()),
        ("entry", format!("/ops/outbox/{id}"), format!("Entry {id}")),
        (
            "destinations",
            "/ops/destinations".to_owned(),
            "Destinations".to_owned(),
        ),
    ] {
        tour.open(&path, &heading)?;
        tour.browser.screenshot(&dir.join(format!("{name}.png")))?;
    }
    if std::env::var_os("IDEMSTORE_UPDATE_DOCS_SCREENSHOT").is_some() {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/console.png");
        std::fs::copy(dir.join("overview.png"), docs)?;
    }
    Ok(())
}

/// A payload of `<script>…` and a failure reason of `<img onerror=…>`, on
/// the entry's page and on the list, writable and read-only: shown as
/// that text, with no such element in the page, and nothing run.
fn hostile_values_are_shown_as_text_and_never_run<O: OutboxAdmin>(
    tour: &Tour<'_, O>,
) -> TestResult {
    let id = tour.entries.hostile.0;
    let list = format!("/outbox?status=failed&destination={WEBHOOKS}");
    for (path, heading, shown) in [
        (
            format!("/ops/outbox/{id}"),
            format!("Entry {id}"),
            &[HOSTILE_PAYLOAD, HOSTILE_REASON][..],
        ),
        (
            format!("/ops{list}"),
            "Outbox".to_owned(),
            &[HOSTILE_REASON][..],
        ),
        (
            format!("/ro/outbox/{id}"),
            format!("Entry {id}"),
            &[HOSTILE_PAYLOAD, HOSTILE_REASON][..],
        ),
        (
            format!("/ro{list}"),
            "Outbox".to_owned(),
            &[HOSTILE_REASON][..],
        ),
    ] {
        tour.open(&path, &heading)?;
        let b = &tour.browser;
        assert_eq!(
            b.execute("return typeof window.__pwned")?,
            "undefined",
            "{path}"
        );
        let injected =
            b.execute("return document.querySelectorAll('script, img, [onerror]').length")?;
        assert_eq!(injected, 0, "no element from the store's values on {path}");
        let text = b.page_text()?;
        for s in shown {
            assert!(text.contains(s), "{path} shows {s} as text: {text}");
        }
    }
    Ok(())
}

/// Actions posted without the console's token, with a wrong one, or from
/// another site's page (`Sec-Fetch-Site: cross-site`) are refused (403)
/// and change nothing; so is a form whose token was altered in the page.
fn posts_without_the_token_are_refused<O: OutboxAdmin>(tour: &Tour<'_, O>) -> TestResult {
    let id = tour.entries.failed_a[0];
    let before = tour.record(id)?;
    let token = tour.token()?;
    let retry = format!("/ops/outbox/{}/retry", id.0);
    let matching = format!("status=failed&destination={PAYMENTS}&confirm=yes");
    let cross_site = [("Sec-Fetch-Site", "cross-site")];
    for (path, form, headers) in [
        (retry.as_str(), String::new(), &[][..]),
        (retry.as_str(), "token=forged".into(), &[]),
        (retry.as_str(), format!("token={token}"), &cross_site),
        ("/ops/outbox/retry-matching", matching.clone(), &[]),
        (
            "/ops/outbox/retry-matching",
            format!("{matching}&token=forged"),
            &[],
        ),
        (
            "/ops/outbox/cancel-matching",
            format!("status=pending&destination={PAYMENTS}&confirm=yes"),
            &[],
        ),
    ] {
        assert_eq!(
            tour.post(path, &form, headers)?,
            403,
            "POST {path} {form:?} {headers:?}"
        );
    }
    assert_eq!(tour.record(id)?, before, "the entry unchanged");
    assert_eq!(tour.status(tour.entries.pending_a)?, OutboxStatus::Pending);
    tour.nothing_retried()?;
    // In the browser: the entry's retry form, its token altered.
    tour.open(&format!("/ops/outbox/{}", id.0), &format!("Entry {}", id.0))?;
    tour.browser.execute(
        "document.querySelectorAll('input[name=token]').forEach(i => i.value = 'forged')",
    )?;
    tour.browser
        .follow(&format!("form[action=\"{retry}\"] button"), "Refused")?;
    assert!(tour.browser.page_text()?.contains("Nothing was changed"));
    assert_eq!(tour.record(id)?, before, "the entry unchanged");
    Ok(())
}

/// A console with writes not allowed shows no action (no form that
/// posts, no check box, no token) on any page, and refuses (403) every
/// action posted to it, with the console's own token too, without
/// changing anything.
fn a_read_only_console_offers_no_action_and_takes_none<O: OutboxAdmin>(
    tour: &Tour<'_, O>,
) -> TestResult {
    let entries = tour.entries;
    let id = entries.failed_a[0];
    let before = tour.record(id)?;
    let token = tour.token()?;
    let b = &tour.browser;
    tour.open("/ro", "Overview")?;
    // Followed as a person would: overview, A's failed entries, the first.
    b.follow(
        &format!("td.n > a[href=\"/ro/outbox?status=failed&destination={PAYMENTS}\"]"),
        "Outbox",
    )?;
    assert!(
        b.page_text()?.contains("charge-1"),
        "the list shows A's entries"
    );
    assert!(
        b.find_all("form[method=post], input[type=checkbox], input[name=token]")?
            .is_empty(),
        "no action on the list"
    );
    b.follow(
        &format!("a[href=\"/ro/outbox/{}\"]", id.0),
        &format!("Entry {}", id.0),
    )?;
    for (path, heading) in [
        ("/ro".to_owned(), "Overview".to_owned()),
        (format!("/ro/outbox/{}", id.0), format!("Entry {}", id.0)),
        ("/ro/destinations".to_owned(), "Destinations".to_owned()),
        (
            format!("/ro/outbox?status=failed&destination={PAYMENTS}"),
            "Outbox".to_owned(),
        ),
        ("/ro/outbox?status=pending".to_owned(), "Outbox".to_owned()),
    ] {
        tour.open(&path, &heading)?;
        let controls = b.find_all("form[method=post], input[type=checkbox], input[name=token]")?;
        assert!(
            controls.is_empty(),
            "{path} offers {} controls",
            controls.len()
        );
    }
    for (path, form) in [
        (
            format!("/ro/outbox/{}/retry", id.0),
            format!("token={token}"),
        ),
        (
            format!("/ro/outbox/{}/cancel", entries.pending_a.0),
            format!("token={token}"),
        ),
        (
            "/ro/outbox/retry-matching".to_owned(),
            format!("token={token}&status=failed&destination={PAYMENTS}&confirm=yes"),
        ),
        (
            "/ro/destinations/pause".to_owned(),
            format!("token={token}&destination={PAYMENTS}"),
        ),
    ] {
        assert_eq!(tour.post(&path, &form, &[])?, 403, "POST {path}");
    }
    assert_eq!(tour.record(id)?, before, "the entry unchanged");
    assert_eq!(tour.status(entries.pending_a)?, OutboxStatus::Pending);
    assert!(
        tour.outbox.destinations()?.iter().all(|d| !d.paused),
        "nothing paused"
    );
    tour.nothing_retried()
}

/// On the destinations page, a destination's Pause button pauses it and
/// then its Resume button resumes it, and no other.
fn destinations_are_paused_and_resumed_by_their_buttons<O: OutboxAdmin>(
    tour: &Tour<'_, O>,
) -> TestResult {
    let paused = || -> idemstore::Result<Vec<String>> {
        Ok(tour
            .outbox
            .destinations()?
            .into_iter()
            .filter(|d| d.paused)
            .map(|d| d.destination)
            .collect())
    };
    let button = |what: &str| {
        format!(
            "form[action=\"/ops/destinations/{what}\"]:has(input[name=destination][value=\"{EMAIL}\"]) button"
        )
    };
    tour.open("/ops/destinations", "Destinations")?;
    tour.browser.follow(&button("pause"), "Destinations")?;
    assert_eq!(paused()?, [EMAIL]);
    // The page after the redirect offers the other button.
    tour.browser.follow(&button("resume"), "Destinations")?;
    assert!(paused()?.is_empty());
    assert_eq!(tour.browser.find_all(&button("pause"))?.len(), 1);
    Ok(())
}

/// From the overview, the link of A's failed entries; on their list,
/// "retry all matching", which the browser does not send until its
/// confirmation is ticked; then every failed entry of A is pending, and
/// B's and the others are as they were.
fn retry_all_matching_retries_the_entries_of_the_filter_only<O: OutboxAdmin>(
    tour: &Tour<'_, O>,
) -> TestResult {
    let (b, entries) = (&tour.browser, tour.entries);
    let list = format!("/ops/outbox?status=failed&destination={PAYMENTS}");
    tour.open("/ops", "Overview")?;
    b.follow(&format!("td.n > a[href=\"{list}\"]"), "Outbox")?;
    assert!(b.url()?.ends_with(&list), "{}", b.url()?);
    let form = "form[action=\"/ops/outbox/retry-matching\"]";
    let n = entries.failed_a.len();
    assert_eq!(
        b.text(&b.find(&format!("{form} label"))?)?,
        format!("I mean all {n}")
    );
    // Not ticked: the browser keeps the form (the box is required).
    let button = format!("{form} button");
    b.click_on(&button)?;
    let missing = b.execute(&format!(
        "return document.querySelector('{form} input[name=confirm]').validity.valueMissing"
    ))?;
    assert_eq!(missing, true);
    assert!(b.url()?.ends_with(&list), "still on the list");
    tour.nothing_retried()?;
    // Ticked and sent.
    let confirm = b.find(&format!("{form} input[name=confirm]"))?;
    b.click(&confirm)?;
    assert!(b.selected(&confirm)?);
    b.follow(&button, "Done")?;
    assert!(
        b.page_text()?.contains(&format!("{n} entries retried.")),
        "{}",
        b.page_text()?
    );
    b.follow("main a", "Outbox")?;
    assert!(
        b.page_text()?.contains("No entries."),
        "none of A's left failed"
    );
    // What the store says.
    for &id in &entries.failed_a {
        let r = tour.record(id)?;
        assert_eq!(r.entry.status, OutboxStatus::Pending, "A's entry {}", id.0);
        assert!(r.entry.due_at() > t(2), "due now, not at its old time");
    }
    for &id in &entries.failed_b {
        assert_eq!(tour.status(id)?, OutboxStatus::Failed, "B's entry {}", id.0);
    }
    assert_eq!(tour.status(entries.hostile)?, OutboxStatus::Failed);
    assert_eq!(tour.status(entries.pending_a)?, OutboxStatus::Pending);
    let failed_a = OutboxFilter::any()
        .status(OutboxStatus::Failed)
        .destination(PAYMENTS);
    assert!(tour.outbox.list(&failed_a, 10)?.is_empty());
    let counts = tour.outbox.counts()?;
    assert_eq!(
        counts.get(OutboxStatus::Failed),
        3,
        "B's two and the hostile one"
    );
    assert_eq!(
        counts.get(OutboxStatus::Pending),
        4,
        "A's three and its pending one"
    );
    assert_eq!(counts.get(OutboxStatus::Completed), 2);
    Ok(())
}

// ---------------------------------------------------------------------
// The tests.

/// The console of a store file, in a browser, does what [`suite`] lists;
/// and the screenshots of its main pages.
#[test]
fn the_console_of_a_store_file_works_in_a_browser() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("console.idem"))?;
    let outbox = store.outbox();
    let entries = fill(&outbox, |e| outbox.enqueue(e, t(0)).map(|e| e.id()))?;
    let shots = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/console-screenshots");
    suite(&outbox, &entries, Some(&shots))
}

#[cfg(feature = "postgres")]
mod common;

#[cfg(feature = "postgres")]
mod postgres {
    use idemstore::postgres::PgStore;

    use super::common::pg;
    use super::*;

    /// The console of a PostgreSQL store, in a browser, does what
    /// [`suite`] lists.
    #[test]
    fn the_console_of_a_postgresql_store_works_in_a_browser() -> TestResult {
        let Some(url) = pg::url() else { return Ok(()) };
        let schema = pg::unique_schema();
        let _drop = pg::DropSchema {
            url: url.clone(),
            schema: schema.clone(),
        };
        let store = PgStore::builder().schema(&schema).connect(&url)?;
        let outbox = store.outbox();
        let entries = fill(&outbox, |e| outbox.enqueue(e, t(0)).map(|e| e.id()))?;
        suite(&outbox, &entries, None)
    }
}
