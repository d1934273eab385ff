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
use crate::outbox::{OutboxId, OutboxRecord, OutboxStatus};

/// The console's only stylesheet (the policy allows no other style).
const CSS: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222}\
nav{background:#223;padding:.6em 1em}nav a{color:#fff;margin-right:1.5em;text-decoration:none}\
main{padding:1em}table{border-collapse:collapse;margin:.5em 0}\
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}\
th{background:#f3f3f6}td.n{text-align:right}pre{background:#f6f6f6;padding:.6em;\
white-space:pre-wrap;word-break:break-all}.failed,.outcome_unknown{color:#a00}\
.muted{color:#666}figure.chart{margin:.5em 0}.s-pending{color:#2563eb}.s-dispatching{color:#d97706}\
.s-failed{color:#b91c1c}.s-outcome_unknown{color:#7c3aed}form.inline{display:inline}";

/// The security headers of every response: scripts and styles from the
/// console's own files only (no inline script or style), fetches to the
/// console only, no frames, forms to the console only.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

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
                    a href={ (base) "/schedules" } { "Schedules" }
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
pub(super) fn failure(inner: &Inner, e: &Error) -> Response {
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

pub(super) async fn script() -> Response {
    secured(
        super::overview::SCRIPT.into_response(),
        "text/javascript; charset=utf-8",
    )
}

/// A part of a page, for the page's script to put in place: the same
/// escaping and headers as a page.
pub(super) fn fragment(markup: &Markup) -> Response {
    secured(
        (StatusCode::OK, markup.clone().into_string()).into_response(),
        "text/html; charset=utf-8",
    )
}

/// The entry page's query: how to show the payload.
#[derive(Debug, Deserialize)]
pub(super) struct EntryQuery {
    #[serde(rename = "as")]
    shown_as: Option<String>,
}

/// How an entry's page shows its payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shown {
    Text,
    Json,
    Hex,
}

pub(super) async fn entry(
    State(inner): State<Arc<Inner>>,
    id: Result<Path<u64>, axum::extract::rejection::PathRejection>,
    query: Result<Query<EntryQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Path(id)) = id else {
        return bad_request(&inner, "an entry's id is a number");
    };
    let shown = match query.map(|Query(q)| q.shown_as) {
        Ok(None) => None,
        Ok(Some(s)) if s == "text" => Some(Shown::Text),
        Ok(Some(s)) if s == "json" => Some(Shown::Json),
        Ok(Some(s)) if s == "hex" => Some(Shown::Hex),
        _ => return bad_request(&inner, "the payload is shown as text, json or hex"),
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
                (payload(i, &r, shown))
            };
            page(i, StatusCode::OK, &format!("Entry {}", e.id.0), &body)
        },
    )
    .await
}

/// The payload section of `r`'s page, shown as asked (by default as text
/// when it is UTF-8, indented when it is JSON, else in hex), or as the
/// console's payload hook has it.
fn payload(i: &Inner, r: &OutboxRecord, shown: Option<Shown>) -> Markup {
    let e = &r.entry;
    let bytes: Option<std::borrow::Cow<'_, [u8]>> = match &i.hooks.payload {
        None => Some(std::borrow::Cow::Borrowed(&e.payload)),
        Some(hook) => super::guarded(|| hook(e))
            .flatten()
            .map(std::borrow::Cow::Owned),
    };
    let Some(bytes) = bytes else {
        return html! { h2 { "Payload" } p.muted { "Not shown (" (e.payload.len()) " bytes)." } };
    };
    let text = std::str::from_utf8(&bytes).ok();
    let json = text.and_then(|t| serde_json::from_str::<serde_json::Value>(t).ok());
    let shown = shown.unwrap_or(match (&json, text) {
        (Some(_), _) => Shown::Json,
        (None, Some(_)) => Shown::Text,
        (None, None) => Shown::Hex,
    });
    let body = match (shown, text, &json) {
        (Shown::Json, _, Some(v)) => serde_json::to_string_pretty(v).unwrap_or_default(),
        (Shown::Text | Shown::Json, Some(t), _) => t.to_owned(),
        _ => hex(&bytes),
    };
    let link = |what: &str, label: &str, on: bool| {
        html! {
            @if on { b { (label) } } @else {
                a href={ (i.base) "/outbox/" (e.id.0) "?as=" (what) } { (label) }
            }
        }
    };
    html! {
        h2 { "Payload (" (bytes.len()) " bytes)" }
        p {
            "As: " (link("text", "text", shown == Shown::Text)) " · "
            (link("json", "JSON", shown == Shown::Json)) " · "
            (link("hex", "hex", shown == Shown::Hex))
            @if shown == Shown::Json && json.is_none() { span.muted { " (not JSON: as text)" } }
            @if shown != Shown::Hex && text.is_none() { span.muted { " (not UTF-8: in hex)" } }
        }
        pre { (body) }
    }
}

/// The forms of the actions an entry in `status` allows.
fn entry_actions(i: &Inner, id: u64, status: OutboxStatus) -> Markup {
    let action = |what: &str| format!("{}/outbox/{id}/{what}", i.base);
    let retry = matches!(status, OutboxStatus::Failed | OutboxStatus::OutcomeUnknown);
    let cancel = matches!(status, OutboxStatus::Pending | OutboxStatus::OutcomeUnknown);
    let resolve = status == OutboxStatus::OutcomeUnknown;
    let release = status == OutboxStatus::Dispatching;
    html! {
        h2 { "Actions" }
        @if release {
            form method="post" action=(action("release")) {
                (token_field(i))
                button type="submit" { "Release the claim: back to pending, due now" }
                span.muted { " (its worker's settlement will be refused as stale)" }
            }
        }
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
        @if !retry && !cancel && !release { p { "No action applies to an entry " (status.as_str()) "." } }
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
