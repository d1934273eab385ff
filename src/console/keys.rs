//! The console's idempotency-key pages: the records by kind and in
//! `(tenant, key)` order, one record with its stored response, and, when
//! writes are allowed, the release of a reservation whose handler is stuck
//! or gone.

use std::sync::Arc;

use axum::Form;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use chrono::Utc;
use maud::{Markup, html};
use serde::Deserialize;

use super::Inner;
use super::actions::refused;
use super::inbox::no_store;
use super::pages::{bad_request, encode, hex, page, read_then, time, time_opt, token_field};
use crate::idempotency::{KeyEntry, KeyState, KeySummary, ResponseRecord};

/// Records per page of the list.
const PAGE: usize = 50;

/// The page of the record at `(tenant, key)`.
fn lookup_link(base: &str, tenant: &str, key: &str) -> String {
    format!(
        "{base}/keys/lookup?tenant={}&key={}",
        encode(tenant),
        encode(key)
    )
}

/// A tenant for people: the default tenant (`""`) is named as such.
fn tenant_cell(tenant: &str) -> Markup {
    html! {
        @if tenant.is_empty() { em { "(default tenant)" } } @else { (tenant) }
    }
}

/// The form that looks a record up.
fn lookup_form(i: &Inner) -> Markup {
    html! {
        form method="get" action={ (i.base) "/keys/lookup" } {
            label { "Tenant " input type="text" name="tenant" placeholder="(default tenant)"; }
            " "
            label { "Idempotency key " input type="text" name="key" required; }
            " "
            button type="submit" { "Look up" }
        }
    }
}

/// The list page's query: the `(tenant, key)` the page starts after.
#[derive(Debug, Deserialize)]
pub(super) struct ListQuery {
    after_tenant: Option<String>,
    after_key: Option<String>,
}

pub(super) async fn list(
    State(inner): State<Arc<Inner>>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Response {
    let Some(store) = inner.store.clone() else {
        return no_store(&inner);
    };
    let Ok(Query(q)) = query else {
        return bad_request(&inner, "the query is not one this page takes");
    };
    let after = match (q.after_tenant, q.after_key) {
        (None, None) => None,
        (tenant, Some(key)) if !key.is_empty() => Some((tenant.unwrap_or_default(), key)),
        _ => {
            return bad_request(
                &inner,
                "a page starts after a (tenant, key): after_key is needed, and never empty",
            );
        }
    };
    read_then(
        inner,
        move |_| {
            let summary = store.key_summary()?;
            let from = after.as_ref().map(|(t, k)| (t.as_str(), k.as_str()));
            Ok((summary, store.list_keys(from, PAGE)?))
        },
        |i, (summary, rows): (KeySummary, Vec<KeyEntry>)| {
            let next = (rows.len() == PAGE).then(|| rows.last()).flatten().map(|last| {
                format!(
                    "{}/keys?after_tenant={}&after_key={}",
                    i.base,
                    encode(&last.tenant),
                    encode(&last.key)
                )
            });
            let now = Utc::now();
            let body = html! {
                table {
                    tr { th { "completed" } td.n { (summary.completed) } }
                    tr { th { "reserved" } td.n { (summary.reserved) } }
                    tr { th { "oldest record" } td { (time_opt(summary.oldest)) } }
                }
                h2 { "Look up a key" }
                (lookup_form(i))
                h2 { "Records" }
                table {
                    tr {
                        th { "tenant" } th { "key" } th { "state" } th { "fence" }
                        th { "stored or reserved" } th { "response or lease" }
                    }
                    @for r in &rows {
                        tr {
                            td { (tenant_cell(&r.tenant)) }
                            td { a href=(lookup_link(&i.base, &r.tenant, &r.key)) { (r.key) } }
                            @match &r.state {
                                KeyState::Completed { status, body_len, created_at } => {
                                    td { "completed" } td.n { (r.fence) } td { (time(*created_at)) }
                                    td { "status " (status) ", " (body_len) " bytes" }
                                }
                                KeyState::Reserved { reserved_at, lease_until } => {
                                    td { "reserved" } td.n { (r.fence) } td { (time(*reserved_at)) }
                                    td {
                                        @if *lease_until <= now { "lease ended " } @else { "lease until " }
                                        (time(*lease_until))
                                    }
                                }
                            }
                        }
                    }
                }
                @if rows.is_empty() { p { "No records." } }
                @if let Some(next) = next { p { a href=(next) { "Next page" } } }
            };
            page(i, StatusCode::OK, "Idempotency keys", &body)
        },
    )
    .await
}

/// The lookup's query.
#[derive(Debug, Deserialize)]
pub(super) struct LookupQuery {
    tenant: Option<String>,
    key: Option<String>,
}

pub(super) async fn lookup(
    State(inner): State<Arc<Inner>>,
    query: Result<Query<LookupQuery>, QueryRejection>,
) -> Response {
    let Some(store) = inner.store.clone() else {
        return no_store(&inner);
    };
    let Ok(Query(q)) = query else {
        return bad_request(&inner, "the query is not one this page takes");
    };
    let Some(key) = q.key else {
        return bad_request(&inner, "a lookup needs an idempotency key");
    };
    let tenant = q.tenant.unwrap_or_default();
    read_then(
        inner,
        {
            let (tenant, key) = (tenant.clone(), key.clone());
            move |_| {
                let Some(entry) = store.key(&tenant, &key)? else {
                    return Ok(None);
                };
                let response = match entry.state {
                    KeyState::Completed { .. } => store.key_response(&tenant, &key)?,
                    KeyState::Reserved { .. } => None,
                };
                Ok(Some((entry, response)))
            }
        },
        move |i, found: Option<(KeyEntry, Option<ResponseRecord>)>| match found {
            None => {
                let body = html! {
                    p {
                        "No record for the key " code { (key) } " of " (tenant_cell(&tenant)) ": "
                        "never used, released, or purged."
                    }
                    (lookup_form(i))
                };
                page(i, StatusCode::NOT_FOUND, "Not found", &body)
            }
            Some((entry, response)) => page(
                i,
                StatusCode::OK,
                "Idempotency key",
                &record(i, &entry, response.as_ref()),
            ),
        },
    )
    .await
}

/// One record: its state, fingerprint, fence and times; the stored
/// response of a completed one; the release form of a reservation when
/// writes are allowed.
fn record(i: &Inner, e: &KeyEntry, response: Option<&ResponseRecord>) -> Markup {
    let now = Utc::now();
    html! {
        table {
            tr { th { "tenant" } td { (tenant_cell(&e.tenant)) } }
            tr { th { "key" } td { (e.key) } }
            tr { th { "fingerprint" } td { code { (e.fingerprint) } } }
            tr { th { "fence" } td { (e.fence) } }
            @match &e.state {
                KeyState::Completed { status, body_len, created_at } => {
                    tr { th { "state" } td { "completed" } }
                    tr { th { "stored" } td { (time(*created_at)) } }
                    tr { th { "status" } td { (status) } }
                    tr { th { "body" } td { (body_len) " bytes" } }
                }
                KeyState::Reserved { reserved_at, lease_until } => {
                    tr { th { "state" } td { "reserved: a handler holds the key, or held it and is gone" } }
                    tr { th { "reserved" } td { (time(*reserved_at)) } }
                    tr {
                        th { "lease" }
                        td {
                            @if *lease_until <= now {
                                "ended " (time(*lease_until)) ": the next request with the key takes it over"
                            } @else {
                                "until " (time(*lease_until))
                            }
                        }
                    }
                }
            }
        }
        @match (&e.state, response) {
            (KeyState::Completed { .. }, Some(r)) => (stored_response(r)),
            (KeyState::Completed { .. }, None) => {
                p { "The response is gone: purged since the record was read." }
            }
            (KeyState::Reserved { .. }, _) => {
                @if i.writes { (release_form(i, e)) }
            }
        }
        p { a href={ (i.base) "/keys" } { "All keys" } }
    }
}

/// A stored response: status, content type, headers and body (text when
/// it is UTF-8, else in hex).
fn stored_response(r: &ResponseRecord) -> Markup {
    html! {
        h2 { "Stored response" }
        table {
            tr { th { "status" } td { (r.response_status) } }
            tr { th { "content type" } td { (r.content_type.as_deref().unwrap_or("")) } }
            @for (name, value) in &r.headers {
                tr { th { (name) } td { (value) } }
            }
        }
        h2 { "Body (" (r.response_body.len()) " bytes)" }
        @match std::str::from_utf8(&r.response_body) {
            Ok(text) => pre { (text) },
            Err(_) => pre { (hex(&r.response_body)) },
        }
    }
}

/// The form that releases the reservation `e` shows, fenced by its token.
fn release_form(i: &Inner, e: &KeyEntry) -> Markup {
    html! {
        h2 { "Actions" }
        p {
            "Release only a reservation whose handler is stuck or gone: the next request "
            "with the key runs its handler again. A handler still running then stores no "
            "response. Nothing is released if the key changed hands since this page was shown."
        }
        form method="post" action={ (i.base) "/keys/release" } {
            (token_field(i))
            input type="hidden" name="tenant" value=(e.tenant);
            input type="hidden" name="key" value=(e.key);
            input type="hidden" name="fence" value=(e.fence);
            button type="submit" { "Release this reservation" }
        }
    }
}

/// The release form.
#[derive(Debug, Deserialize)]
pub(super) struct ReleaseForm {
    token: Option<String>,
    tenant: Option<String>,
    key: Option<String>,
    fence: Option<String>,
}

pub(super) async fn release(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    Form(form): Form<ReleaseForm>,
) -> Response {
    let Some(store) = inner.store.clone() else {
        return no_store(&inner);
    };
    if let Some(refusal) = refused(&inner, &headers, form.token.as_deref()) {
        return refusal;
    }
    let (Some(tenant), Some(key), Some(fence)) = (
        form.tenant,
        form.key,
        form.fence.and_then(|f| f.parse::<u64>().ok()),
    ) else {
        return bad_request(
            &inner,
            "a release needs a tenant, a key and a fence token (a number). Nothing was changed.",
        );
    };
    read_then(
        inner,
        {
            let (tenant, key) = (tenant.clone(), key.clone());
            move |_| store.release_key(&tenant, &key, fence)
        },
        move |i, released: bool| {
            let what = html! {
                "the reservation with fence " (fence) " of the key " code { (key) }
                " of " (tenant_cell(&tenant))
            };
            let (status, title, body) = if released {
                (
                    StatusCode::OK,
                    "Released",
                    html! {
                        p { "Released " (what) ": the next request with the key runs its handler." }
                    },
                )
            } else {
                (
                    StatusCode::CONFLICT,
                    "Not released",
                    html! {
                        p {
                            "Nothing was released: the key no longer holds " (what)
                            " (it was completed, released, taken over or purged meanwhile)."
                        }
                        p { a href=(lookup_link(&i.base, &tenant, &key)) { "The key now" } }
                    },
                )
            };
            page(i, status, title, &body)
        },
    )
    .await
}
