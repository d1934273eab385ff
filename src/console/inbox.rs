//! The console's inbox pages: each inbox with how many keys it holds, and
//! whether an inbox saw an event key. Read-only: an inbox has no operator
//! action here.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use serde::Deserialize;

use super::Inner;
use super::pages::{bad_request, page, read_then, time};

/// The 404 page of a console that was not given the store: the pages of
/// inboxes and idempotency keys need it.
pub(super) fn no_store(inner: &Inner) -> Response {
    page(
        inner,
        StatusCode::NOT_FOUND,
        "Not found",
        &html! {
            p {
                "This console was not given the store (" code { "Console::store" } "), "
                "so it has no pages of inboxes or idempotency keys: only the outbox's."
            }
        },
    )
}

/// The form that looks a key up in an inbox, `names` offered as choices.
fn lookup_form(i: &Inner, names: &[String], inbox: &str, key: &str) -> Markup {
    html! {
        form method="get" action={ (i.base) "/inboxes/lookup" } {
            label { "Inbox " input type="text" name="inbox" value=(inbox) list="inbox-names" required; }
            " "
            label { "Event key " input type="text" name="key" value=(key) required; }
            " "
            button type="submit" { "Look up" }
            datalist id="inbox-names" {
                @for n in names { option value=(n) {} }
            }
        }
    }
}

pub(super) async fn list(State(inner): State<Arc<Inner>>) -> Response {
    let Some(store) = inner.store.clone() else {
        return no_store(&inner);
    };
    read_then(
        inner,
        move |_| {
            let names = store.inbox_names()?;
            names
                .into_iter()
                .map(|n| store.inbox_len(&n).map(|len| (n, len)))
                .collect::<crate::Result<Vec<_>>>()
        },
        |i, inboxes: Vec<(String, u64)>| {
            let names: Vec<String> = inboxes.iter().map(|(n, _)| n.clone()).collect();
            let body = html! {
                h2 { "Look up an event key" }
                (lookup_form(i, &names, "", ""))
                h2 { "Inboxes" }
                @if inboxes.is_empty() {
                    p { "No inbox holds a key." }
                } @else {
                    table {
                        tr { th { "inbox" } th { "keys" } }
                        @for (name, len) in &inboxes {
                            tr { td { (name) } td.n { (len) } }
                        }
                    }
                }
                p {
                    "An inbox is listed while it holds at least one key: one whose keys "
                    "were all pruned is not, and its keys read as not seen."
                }
            };
            page(i, StatusCode::OK, "Inboxes", &body)
        },
    )
    .await
}

/// The lookup's query.
#[derive(Debug, Deserialize)]
pub(super) struct LookupQuery {
    inbox: Option<String>,
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
    let (Some(inbox), Some(key)) = (q.inbox, q.key) else {
        return bad_request(&inner, "a lookup needs an inbox and an event key");
    };
    read_then(
        inner,
        {
            let (inbox, key) = (inbox.clone(), key.clone());
            move |_| store.inbox_seen_at(&inbox, &key)
        },
        move |i, seen: Option<DateTime<Utc>>| {
            let body = html! {
                table {
                    tr { th { "inbox" } td { (inbox) } }
                    tr { th { "event key" } td { (key) } }
                    tr {
                        th { "seen" }
                        td {
                            @match seen {
                                Some(at) => { "yes, claimed at " (time(at)) }
                                None => { "not seen" }
                            }
                        }
                    }
                }
                @if seen.is_none() {
                    p {
                        "Never claimed, or claimed and pruned since: a pruned key reads as not "
                        "seen, and a delivery of it now would be claimed again."
                    }
                }
                h2 { "Look up another" }
                (lookup_form(i, &[], &inbox, ""))
                p { a href={ (i.base) "/inboxes" } { "All inboxes" } }
            };
            page(i, StatusCode::OK, "Inbox lookup", &body)
        },
    )
    .await
}
