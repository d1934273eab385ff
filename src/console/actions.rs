//! The console's actions: retry, cancel and resolve one entry, and retry
//! or cancel every entry a filter matches. Each is a `POST` of a plain
//! HTML form carrying the console's token; refused (403, nothing changed)
//! while writes are not allowed, without the token, or from another site.

use std::sync::Arc;

use axum::Form;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use chrono::Utc;
use maud::{Markup, html};
use serde::Deserialize;

use super::Inner;
use super::pages::{bad_request, list_link, page, read_then};
use crate::outbox::{MatchingChange, OutboxFilter, OutboxId, OutboxStatus};

/// Entries changed per step of an action on every entry a filter matches,
/// each step one commit: the writer is never held for longer than one
/// step takes (a few milliseconds), however many match.
const STEP: usize = 256;

/// The form field that carries the console's token.
pub(super) const TOKEN_FIELD: &str = "token";

/// A one-entry action's form.
#[derive(Debug, Deserialize)]
pub(super) struct EntryForm {
    token: Option<String>,
    /// For `fail`: the reason code to record.
    reason: Option<String>,
}

/// An action on every entry a filter matches.
#[derive(Debug, Deserialize)]
pub(super) struct MatchingForm {
    token: Option<String>,
    /// For `fail`: the reason code to record.
    reason: Option<String>,
    status: Option<String>,
    destination: Option<String>,
    /// The operator confirmed the count shown.
    confirm: Option<String>,
}

/// The refusal of an action, if it is refused: writes not allowed, no or
/// a wrong token, or a request another site's page made.
pub(super) fn refused(inner: &Inner, headers: &HeaderMap, token: Option<&str>) -> Option<Response> {
    let why = if !inner.writes {
        Some("this console is read-only")
    } else if headers
        .get("sec-fetch-site")
        .is_some_and(|v| v.as_bytes() == b"cross-site")
    {
        Some("a request from another site's page")
    } else if !token.is_some_and(|t| same(t.as_bytes(), inner.token.as_bytes())) {
        Some("the form's token is missing or wrong: reload the page and try again")
    } else {
        None
    };
    why.map(|why| {
        page(
            inner,
            StatusCode::FORBIDDEN,
            "Refused",
            &html! { p { (why) ". Nothing was changed." } },
        )
    })
}

/// Whether `a` and `b` are equal, in time that depends on their lengths
/// only.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0_u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// What a one-entry action does.
#[derive(Clone, Copy, Debug)]
pub(super) enum EntryAction {
    Retry,
    Cancel,
    Complete,
    Fail,
    Release,
}

impl EntryAction {
    /// The action a form's `name` asks for.
    fn named(name: &str) -> Option<EntryAction> {
        Some(match name {
            "retry" => EntryAction::Retry,
            "cancel" => EntryAction::Cancel,
            "complete" => EntryAction::Complete,
            "fail" => EntryAction::Fail,
            "release" => EntryAction::Release,
            _ => return None,
        })
    }

    /// Applies the action to entry `id` at `now`.
    fn apply(self, i: &Inner, id: OutboxId, reason: &str) -> crate::Result<()> {
        let now = Utc::now();
        match self {
            EntryAction::Retry => i.outbox.requeue(id, now),
            EntryAction::Cancel => i.outbox.cancel(id, now),
            EntryAction::Complete => i.outbox.mark_completed(id, now),
            EntryAction::Fail => i.outbox.mark_failed(id, reason, None, now),
            EntryAction::Release => i.outbox.reschedule(id, now),
        }
    }

    fn done(self) -> &'static str {
        match self {
            EntryAction::Retry => "retried",
            EntryAction::Cancel => "cancelled",
            EntryAction::Complete => "marked completed",
            EntryAction::Fail => "marked failed",
            EntryAction::Release => "released",
        }
    }
}

pub(super) async fn on_entry(
    State(inner): State<Arc<Inner>>,
    Path((id, action)): Path<(u64, String)>,
    headers: HeaderMap,
    Form(form): Form<EntryForm>,
) -> Response {
    if let Some(refusal) = refused(&inner, &headers, form.token.as_deref()) {
        return refusal;
    }
    let Some(action) = EntryAction::named(&action) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let reason = form
        .reason
        .filter(|r| !r.trim().is_empty())
        .unwrap_or_else(|| "resolved_by_operator".to_owned());
    let back = format!("{}/outbox/{id}", inner.base);
    read_then(
        inner,
        move |i| action.apply(i, OutboxId(id), &reason),
        move |_, ()| Redirect::to(&back).into_response(),
    )
    .await
}

/// Entries one selection may name.
const MAX_SELECTED: usize = 500;

/// An action on the entries checked on a list page: the form's fields in
/// order (`token`, `action`, `back`, and an `id` per entry).
pub(super) async fn on_selected(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    Form(fields): Form<Vec<(String, String)>>,
) -> Response {
    let field = |name: &str| {
        fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    if let Some(refusal) = refused(&inner, &headers, field(TOKEN_FIELD)) {
        return refusal;
    }
    let Some(action) = field("action").and_then(EntryAction::named) else {
        return bad_request(
            &inner,
            "the action is retry, cancel, release, complete or fail",
        );
    };
    let reason = field("reason")
        .filter(|r| !r.trim().is_empty())
        .unwrap_or("resolved_by_operator")
        .to_owned();
    let ids: Result<Vec<u64>, _> = fields
        .iter()
        .filter(|(k, _)| k == "id")
        .map(|(_, v)| v.parse::<u64>())
        .collect();
    let ids = match ids {
        Ok(ids) if ids.is_empty() => return bad_request(&inner, "no entry was checked"),
        Ok(ids) if ids.len() > MAX_SELECTED => {
            return bad_request(&inner, "at most 500 entries at once");
        }
        Ok(ids) => ids,
        Err(_) => return bad_request(&inner, "an entry's id is a number"),
    };
    // Back to a list page of this console only.
    let back = field("back")
        .filter(|b| b.starts_with(&format!("{}/outbox", inner.base)) && !b.contains("//"))
        .map_or_else(|| format!("{}/outbox", inner.base), str::to_owned);
    read_then(
        inner,
        move |i| {
            let (mut done, mut left) = (0_u64, Vec::new());
            for id in ids {
                match action.apply(i, OutboxId(id), &reason) {
                    Ok(()) => done += 1,
                    Err(crate::Error::Conflict { .. } | crate::Error::NotFound) => left.push(id),
                    Err(e) => return Err(e),
                }
            }
            Ok((done, left))
        },
        move |i, (done, left): (u64, Vec<u64>)| {
            let body = html! {
                p { (done) " entries " (action.done()) "." }
                @if !left.is_empty() {
                    p {
                        (left.len()) " were in a status the action does not apply to, and were left as they were: "
                        @for (k, id) in left.iter().enumerate() {
                            @if k > 0 { ", " }
                            a href={ (i.base) "/outbox/" (id) } { (id) }
                        }
                    }
                }
                p { a href=(back) { "Back to the entries" } }
            };
            page(i, StatusCode::OK, "Done", &body)
        },
    )
    .await
}

/// An action on every entry a filter matches: `POST /outbox/ACTION-matching`
/// with `retry`, `cancel`, `release`, `complete` or `fail` (a `reason` field
/// for the last), each in steps of [`STEP`] entries, one commit each.
pub(super) async fn on_matching(
    State(inner): State<Arc<Inner>>,
    Path(path): Path<String>,
    headers: HeaderMap,
    Form(form): Form<MatchingForm>,
) -> Response {
    let Some(action) = path.strip_suffix("-matching").and_then(EntryAction::named) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    if let Some(refusal) = refused(&inner, &headers, form.token.as_deref()) {
        return refusal;
    }
    let Some(status) = form
        .status
        .as_deref()
        .and_then(|s| s.parse::<OutboxStatus>().ok())
    else {
        return bad_request(&inner, "An action on every matching entry needs a status.");
    };
    if form.confirm.as_deref() != Some("yes") {
        return bad_request(&inner, "The action was not confirmed. Nothing was changed.");
    }
    let reason = form
        .reason
        .filter(|r| !r.trim().is_empty())
        .unwrap_or_else(|| "resolved_by_operator".to_owned());
    let destination = form.destination.filter(|d| !d.is_empty());
    let back = list_link(&inner.base, Some(status), destination.as_deref(), None);
    read_then(
        inner,
        move |i| {
            let mut filter = OutboxFilter::any().status(status);
            if let Some(d) = &destination {
                filter = filter.destination(d.clone());
            }
            let (mut done, mut refused) = (0_u64, 0_u64);
            let mut from = filter.clone();
            loop {
                let now = Utc::now();
                let change = match action {
                    EntryAction::Retry => MatchingChange::Retry {
                        next_attempt_at: now,
                    },
                    EntryAction::Cancel => MatchingChange::Cancel { now },
                    EntryAction::Release => MatchingChange::Release {
                        next_attempt_at: now,
                    },
                    EntryAction::Complete => MatchingChange::Complete { now },
                    EntryAction::Fail => MatchingChange::Fail {
                        reason: reason.clone(),
                        now,
                    },
                };
                let step = i.outbox.change_matching(&from, &change, STEP)?;
                done += step.changed;
                refused += step.skipped;
                let Some(last) = step.last else { break };
                from = filter.clone().after(last);
            }
            Ok((done, refused))
        },
        move |i, (done, refused)| {
            let body: Markup = html! {
                p { (done) " entries " (action.done()) "." }
                @if refused > 0 {
                    p { (refused) " had changed meanwhile and were left as they were." }
                }
                p { a href=(back) { "Back to the entries" } }
            };
            page(i, StatusCode::OK, "Done", &body)
        },
    )
    .await
}
