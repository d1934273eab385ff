//! The console's pages: each a handler that reads the store on the
//! blocking pool and renders with maud, which escapes every value.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};
use serde::Deserialize;

use super::Inner;
use crate::error::Error;
use crate::outbox::{OutboxFilter, OutboxId, OutboxRecord, OutboxStatus};

/// Entries per page of the list.
const PAGE: usize = 50;

/// The console's only stylesheet (the policy allows no other style).
const CSS: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222}\
nav{background:#223;padding:.6em 1em}nav a{color:#fff;margin-right:1.5em;text-decoration:none}\
main{padding:1em}table{border-collapse:collapse;margin:.5em 0}\
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}\
th{background:#f3f3f6}td.n{text-align:right}pre{background:#f6f6f6;padding:.6em;\
white-space:pre-wrap;word-break:break-all}.failed,.outcome_unknown{color:#a00}";

/// The security headers of every response: no script at all, styles from
/// the console's stylesheet only, no frames, forms to the console only.
const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self' data:; \
form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// A page: `status`, `title` and `body` in the console's frame, with the
/// security headers.
pub(super) fn page(inner: &Inner, status: StatusCode, title: &str, body: &Markup) -> Response {
    let base = &inner.base;
    // Mounted under `/ops`, the overview is `/ops` (a nested router's root).
    let home = if base.is_empty() { "/" } else { base.as_str() };
    let markup = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { (title) " · idemstore" }
                link rel="stylesheet" href={ (base) "/style.css" };
            }
            body {
                nav {
                    a href=(home) { "Overview" }
                    a href={ (base) "/outbox" } { "Outbox" }
                    a href={ (base) "/destinations" } { "Destinations" }
                    @if inner.store.is_some() {
                        a href={ (base) "/inboxes" } { "Inboxes" }
                        a href={ (base) "/keys" } { "Idempotency keys" }
                    }
                }
                main {
                    h1 { (title) }
                    (body)
                }
            }
        }
    };
    secured(
        (status, markup.into_string()).into_response(),
        "text/html; charset=utf-8",
    )
}

/// `response` with the console's security headers and `content_type`.
fn secured(mut response: Response, content_type: &'static str) -> Response {
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// The page of a failed read: 404 for an entry that is not there, 400 for
/// input the store refused, 500 naming the store's error otherwise.
fn failure(inner: &Inner, e: &Error) -> Response {
    let (status, title) = match e {
        Error::NotFound => (StatusCode::NOT_FOUND, "Not found"),
        Error::InvalidInput { .. } | Error::TooLarge { .. } => {
            (StatusCode::BAD_REQUEST, "Bad request")
        }
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "The store failed"),
    };
    page(inner, status, title, &html! { p { (e.to_string()) } })
}

/// The page of a bad request.
pub(super) fn bad_request(inner: &Inner, why: &str) -> Response {
    page(
        inner,
        StatusCode::BAD_REQUEST,
        "Bad request",
        &html! { p { (why) } },
    )
}

/// Runs `read` on the blocking pool and renders its answer with `render`.
pub(super) async fn read_then<T: Send + 'static>(
    inner: Arc<Inner>,
    read: impl FnOnce(&Inner) -> crate::Result<T> + Send + 'static,
    render: impl FnOnce(&Inner, T) -> Response,
) -> Response {
    let store = inner.clone();
    match tokio::task::spawn_blocking(move || read(&store)).await {
        Ok(Ok(v)) => render(&inner, v),
        Ok(Err(e)) => failure(&inner, &e),
        Err(e) => failure(&inner, &Error::panicked("a console page", &e.to_string())),
    }
}

pub(super) async fn style() -> Response {
    secured(CSS.into_response(), "text/css; charset=utf-8")
}

/// What the overview shows.
struct Overview {
    counts: crate::OutboxCounts,
    destinations: Vec<crate::DestinationState>,
    next_due: Option<DateTime<Utc>>,
    oldest_claim: Option<DateTime<Utc>>,
}

pub(super) async fn overview(State(inner): State<Arc<Inner>>) -> Response {
    read_then(
        inner,
        |i| {
            Ok(Overview {
                counts: i.outbox.counts()?,
                destinations: i.outbox.destinations()?,
                next_due: i.outbox.next_due()?,
                oldest_claim: i.outbox.oldest_claim()?,
            })
        },
        |i, o| {
            let list = |status: Option<OutboxStatus>, destination: Option<&str>| {
                list_link(&i.base, status, destination, None)
            };
            let body = html! {
                h2 { "Entries by status" }
                table {
                    tr {
                        th { "destination" }
                        @for s in OutboxStatus::ALL { th { (s.as_str()) } }
                        th { "in flight" } th { "paused" }
                    }
                    tr {
                        th { a href=(list(None, None)) { "all (" (o.counts.total()) ")" } }
                        @for s in OutboxStatus::ALL {
                            td.n { a href=(list(Some(s), None)) { (o.counts.get(s)) } }
                        }
                        td.n { (o.counts.dispatching) } td { }
                    }
                    @for d in &o.destinations {
                        tr {
                            th { a href=(list(None, Some(&d.destination))) { (d.destination) } }
                            @for s in OutboxStatus::ALL {
                                td.n {
                                    a href=(list(Some(s), Some(&d.destination))) { (d.counts.get(s)) }
                                }
                            }
                            td.n { (d.in_flight) }
                            td { @if d.paused { "paused" } }
                        }
                    }
                }
                p { "Next entry due: " (time_opt(o.next_due)) }
                p { "Oldest claim: " (time_opt(o.oldest_claim)) }
            };
            page(i, StatusCode::OK, "Overview", &body)
        },
    )
    .await
}

/// The list page's query.
#[derive(Debug, Deserialize)]
pub(super) struct ListQuery {
    status: Option<String>,
    destination: Option<String>,
    after: Option<u64>,
}

pub(super) async fn list(
    State(inner): State<Arc<Inner>>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = query else {
        return bad_request(&inner, "the query is not one this page takes");
    };
    let status = match q.status.as_deref().filter(|s| !s.is_empty()) {
        Some(s) => match s.parse::<OutboxStatus>() {
            Ok(s) => Some(s),
            Err(e) => return bad_request(&inner, &e.to_string()),
        },
        None => None,
    };
    let destination = q.destination.filter(|d| !d.is_empty());
    let mut filter = OutboxFilter::any();
    if let Some(s) = status {
        filter = filter.status(s);
    }
    if let Some(d) = &destination {
        filter = filter.destination(d.clone());
    }
    if let Some(after) = q.after {
        filter = filter.after(OutboxId(after));
    }
    let counted = destination.clone();
    read_then(
        inner,
        move |i| {
            let rows = i.outbox.list(&filter, PAGE)?;
            // How many the filter matches, for an action on all of them.
            let matching = match (status, &counted) {
                (Some(s), Some(d)) => Some(
                    i.outbox
                        .destinations()?
                        .iter()
                        .find(|x| &x.destination == d)
                        .map_or(0, |x| x.counts.get(s)),
                ),
                (Some(s), None) => Some(i.outbox.counts()?.get(s)),
                (None, _) => None,
            };
            Ok((rows, matching))
        },
        move |i, (rows, matching): (Vec<OutboxRecord>, Option<u64>)| {
            let next = (rows.len() == PAGE)
                .then(|| rows.last().map(|r| r.entry.id.0))
                .flatten()
                .map(|last| list_link(&i.base, status, destination.as_deref(), Some(last)));
            let body = html! {
                p {
                    "Status: " (status.map_or("any", OutboxStatus::as_str))
                    "; destination: " (destination.as_deref().unwrap_or("any"))
                }
                table {
                    tr {
                        th { "id" } th { "status" } th { "destination" } th { "key" }
                        th { "attempts" } th { "due, claimed or finished" } th { "last failure" }
                    }
                    @for r in &rows {
                        tr {
                            td.n { a href={ (i.base) "/outbox/" (r.entry.id.0) } { (r.entry.id.0) } }
                            td class=(r.entry.status.as_str()) { (r.entry.status.as_str()) }
                            td { (r.entry.destination) }
                            td { (r.entry.idempotency_key) }
                            td.n { (r.entry.attempt_count) }
                            td { (time(shown_time(r))) }
                            td { (r.last_failure.as_deref().unwrap_or("")) }
                        }
                    }
                }
                @if rows.is_empty() { p { "No entries." } }
                @if let (true, Some(s), Some(n)) = (i.writes, status, matching) {
                    @if n > 0 { (matching_actions(i, s, destination.as_deref(), n)) }
                }
                @if let Some(next) = next { p { a href=(next) { "Next page" } } }
            };
            page(i, StatusCode::OK, "Outbox", &body)
        },
    )
    .await
}

pub(super) async fn entry(
    State(inner): State<Arc<Inner>>,
    id: Result<Path<u64>, axum::extract::rejection::PathRejection>,
) -> Response {
    let Ok(Path(id)) = id else {
        return bad_request(&inner, "an entry's id is a number");
    };
    read_then(
        inner,
        move |i| i.outbox.get(OutboxId(id)),
        |i, r: OutboxRecord| {
            let e = &r.entry;
            let body = html! {
                table {
                    tr { th { "status" } td class=(e.status.as_str()) { (e.status.as_str()) } }
                    tr { th { "destination" } td { (e.destination) } }
                    tr { th { "idempotency key" } td { (e.idempotency_key) } }
                    tr { th { "command" } td { (e.command_id) } }
                    tr { th { "attempts" } td { (e.attempt_count) } }
                    tr { th { "created" } td { (time(e.created_at)) } }
                    tr { th { "due" } td { (time(e.due_at())) } }
                    tr { th { "finished" } td { (time_opt(e.completed_at)) } }
                    @if let Some(c) = &r.claim {
                        tr { th { "claimed" } td { (time(c.claimed_at)) " by " (c.worker_id) } }
                    }
                    @if let Some(c) = &r.attempt_in_doubt {
                        tr { th { "in doubt since" } td { (time(c.claimed_at)) " by " (c.worker_id) } }
                    }
                    tr { th { "last failure" } td { (r.last_failure.as_deref().unwrap_or("")) } }
                    tr { th { "remote ref" } td { (r.remote_ref.as_deref().unwrap_or("")) } }
                    tr { th { "ordering key" } td { (e.ordering_key.as_deref().unwrap_or("")) } }
                    tr { th { "priority" } td { (e.priority) } }
                }
                @if i.writes { (entry_actions(i, e.id.0, e.status)) }
                h2 { "Attempt history" }
                @if r.attempts.is_empty() { p { "None recorded." } } @else {
                    table {
                        tr { th { "attempt" } th { "at" } th { "reason" } th { "remote ref" } }
                        @for a in &r.attempts {
                            tr {
                                td.n { (a.attempt) } td { (time(a.at)) } td { (a.reason) }
                                td { (a.remote_ref.as_deref().unwrap_or("")) }
                            }
                        }
                    }
                }
                h2 { "Payload (" (e.payload.len()) " bytes)" }
                @match std::str::from_utf8(&e.payload) {
                    Ok(text) => pre { (text) },
                    Err(_) => pre { (hex(&e.payload)) },
                }
            };
            page(i, StatusCode::OK, &format!("Entry {}", e.id.0), &body)
        },
    )
    .await
}

/// The forms of the actions an entry in `status` allows.
fn entry_actions(i: &Inner, id: u64, status: OutboxStatus) -> Markup {
    let action = |what: &str| format!("{}/outbox/{id}/{what}", i.base);
    let retry = matches!(status, OutboxStatus::Failed | OutboxStatus::OutcomeUnknown);
    let cancel = matches!(status, OutboxStatus::Pending | OutboxStatus::OutcomeUnknown);
    let resolve = status == OutboxStatus::OutcomeUnknown;
    html! {
        h2 { "Actions" }
        @if retry {
            form method="post" action=(action("retry")) {
                (token_field(i))
                button type="submit" { "Retry: back to pending, due now" }
            }
        }
        @if cancel {
            form method="post" action=(action("cancel")) {
                (token_field(i))
                button type="submit" { "Cancel: failed, never sent" }
            }
        }
        @if resolve {
            form method="post" action=(action("complete")) {
                (token_field(i))
                button type="submit" { "Resolve: it happened (completed)" }
            }
            form method="post" action=(action("fail")) {
                (token_field(i))
                input type="text" name="reason" placeholder="reason code";
                button type="submit" { "Resolve: it did not happen (failed)" }
            }
        }
        @if !retry && !cancel { p { "No action applies to an entry " (status.as_str()) "." } }
    }
}

/// The forms of the actions on all `n` entries of `status` (and
/// `destination`), each asking for a confirmation.
fn matching_actions(i: &Inner, status: OutboxStatus, destination: Option<&str>, n: u64) -> Markup {
    let retry = matches!(status, OutboxStatus::Failed | OutboxStatus::OutcomeUnknown);
    let cancel = matches!(status, OutboxStatus::Pending | OutboxStatus::OutcomeUnknown);
    let form = |what: &str, label: &str| {
        html! {
            form method="post" action={ (i.base) "/outbox/" (what) "-matching" } {
                (token_field(i))
                input type="hidden" name="status" value=(status.as_str());
                @if let Some(d) = destination { input type="hidden" name="destination" value=(d); }
                label { input type="checkbox" name="confirm" value="yes" required; " I mean all " (n) }
                " "
                button type="submit" { (label) " all " (n) " matching entries" }
            }
        }
    };
    html! {
        h2 { "Every matching entry" }
        @if retry { (form("retry", "Retry")) }
        @if cancel { (form("cancel", "Cancel")) }
    }
}

/// The hidden field that carries the console's token.
pub(super) fn token_field(i: &Inner) -> Markup {
    html! { input type="hidden" name=(super::actions::TOKEN_FIELD) value=(i.token); }
}

/// The list page of the entries of `status` and `destination` (any when
/// `None`), from after `after`.
pub(super) fn list_link(
    base: &str,
    status: Option<OutboxStatus>,
    destination: Option<&str>,
    after: Option<u64>,
) -> String {
    let mut params = Vec::new();
    if let Some(s) = status {
        params.push(format!("status={}", s.as_str()));
    }
    if let Some(d) = destination {
        params.push(format!("destination={}", encode(d)));
    }
    if let Some(a) = after {
        params.push(format!("after={a}"));
    }
    if params.is_empty() {
        format!("{base}/outbox")
    } else {
        format!("{base}/outbox?{}", params.join("&"))
    }
}

/// `s` percent-encoded for a query value.
pub(super) fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The time that matters in an entry's status: finished, claimed (or in
/// doubt since), or due.
fn shown_time(r: &OutboxRecord) -> DateTime<Utc> {
    r.entry
        .completed_at
        .or(r
            .claim
            .as_ref()
            .or(r.attempt_in_doubt.as_ref())
            .map(|c| c.claimed_at))
        .unwrap_or_else(|| r.entry.due_at())
}

pub(super) fn time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

pub(super) fn time_opt(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "—".to_owned(), time)
}

/// `bytes` in hex, 32 a line.
pub(super) fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 3);
    for (i, b) in bytes.iter().enumerate() {
        if i > 0 {
            out.push(if i % 32 == 0 { '\n' } else { ' ' });
        }
        let _ = write!(out, "{b:02x}");
    }
    out
}
