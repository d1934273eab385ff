//! The console's outbox list: the entries a filter matches (status,
//! destination, command, key), a page at a time, oldest or newest first,
//! with the actions on a selection of them and on every entry the filter
//! matches.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use serde::Deserialize;

use super::Inner;
use super::pages::{bad_request, encode, page, read_then, time, token_field};
use crate::outbox::{OutboxFilter, OutboxId, OutboxRecord, OutboxStatus};

/// Entries per page of the list.
const PAGE: usize = 50;

/// The list page's query, as given.
#[derive(Debug, Default, Deserialize)]
pub(super) struct ListQuery {
    status: Option<String>,
    destination: Option<String>,
    command: Option<String>,
    key: Option<String>,
    after: Option<u64>,
    /// `newest` or `oldest` (the default).
    order: Option<String>,
    /// `due` or `attempts`: the page's entries sorted so; by id otherwise.
    sort: Option<String>,
}

/// How the page's entries are sorted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sort {
    Id,
    Due,
    Attempts,
}

/// The list page's query, checked.
#[derive(Clone, Debug)]
struct Listing {
    status: Option<OutboxStatus>,
    destination: Option<String>,
    command: Option<String>,
    key: Option<String>,
    after: Option<u64>,
    newest_first: bool,
    sort: Sort,
}

impl Listing {
    fn parse(q: ListQuery) -> Result<Listing, String> {
        let given = |v: Option<String>| v.filter(|s| !s.is_empty());
        let status = match given(q.status) {
            Some(s) => Some(s.parse::<OutboxStatus>().map_err(|e| e.to_string())?),
            None => None,
        };
        let newest_first = match given(q.order).as_deref() {
            None | Some("oldest") => false,
            Some("newest") => true,
            Some(_) => return Err("the order is `oldest` or `newest`".into()),
        };
        let sort = match given(q.sort).as_deref() {
            None | Some("id") => Sort::Id,
            Some("due") => Sort::Due,
            Some("attempts") => Sort::Attempts,
            Some(_) => return Err("the sort is `id`, `due` or `attempts`".into()),
        };
        Ok(Listing {
            status,
            destination: given(q.destination),
            command: given(q.command),
            key: given(q.key),
            after: q.after,
            newest_first,
            sort,
        })
    }

    /// The store's filter for this listing (without the command and key,
    /// which are looked up apart).
    fn filter(&self) -> OutboxFilter {
        let mut filter = OutboxFilter::any();
        if let Some(s) = self.status {
            filter = filter.status(s);
        }
        if let Some(d) = &self.destination {
            filter = filter.destination(d.clone());
        }
        if let Some(after) = self.after {
            filter = filter.after(OutboxId(after));
        }
        if self.newest_first {
            filter = filter.newest_first();
        }
        filter
    }

    /// Whether `r` passes the status and destination of the listing (for
    /// the entries looked up by command or key).
    fn keeps(&self, r: &OutboxRecord) -> bool {
        self.status.is_none_or(|s| s == r.entry.status)
            && self
                .destination
                .as_deref()
                .is_none_or(|d| d == r.entry.destination)
    }

    /// The link to this listing with `after` and `sort` as given.
    fn link(&self, base: &str, after: Option<u64>, sort: Sort) -> String {
        let mut params = Vec::new();
        if let Some(s) = self.status {
            params.push(format!("status={}", s.as_str()));
        }
        for (name, v) in [
            ("destination", &self.destination),
            ("command", &self.command),
            ("key", &self.key),
        ] {
            if let Some(v) = v {
                params.push(format!("{name}={}", encode(v)));
            }
        }
        if let Some(a) = after {
            params.push(format!("after={a}"));
        }
        if self.newest_first {
            params.push("order=newest".into());
        }
        match sort {
            Sort::Id => {}
            Sort::Due => params.push("sort=due".into()),
            Sort::Attempts => params.push("sort=attempts".into()),
        }
        if params.is_empty() {
            format!("{base}/outbox")
        } else {
            format!("{base}/outbox?{}", params.join("&"))
        }
    }
}

/// What a list page read.
struct Found {
    rows: Vec<OutboxRecord>,
    /// How many entries the filter matches, when it has a status (for an
    /// action on all of them) and no command or key.
    matching: Option<u64>,
    /// Whether a next page may follow.
    paged: bool,
}

fn read(i: &Inner, l: &Listing) -> crate::Result<Found> {
    let looked_up = match (&l.command, &l.key) {
        (Some(command), _) => Some(i.outbox.list_for_command(command)?),
        (None, Some(key)) => {
            let destinations = match &l.destination {
                Some(d) => vec![d.clone()],
                None => i
                    .outbox
                    .destinations()?
                    .into_iter()
                    .map(|d| d.destination)
                    .collect(),
            };
            let mut found = Vec::new();
            for d in destinations {
                found.extend(i.outbox.find(&d, key)?);
            }
            Some(found)
        }
        (None, None) => None,
    };
    if let Some(mut rows) = looked_up {
        rows.retain(|r| l.keeps(r));
        if l.key.is_some() && l.command.is_some() {
            rows.retain(|r| Some(&r.entry.idempotency_key) == l.key.as_ref());
        }
        return Ok(Found {
            rows,
            matching: None,
            paged: false,
        });
    }
    let rows = i.outbox.list(&l.filter(), PAGE)?;
    let matching = match (l.status, &l.destination) {
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
    Ok(Found {
        paged: rows.len() == PAGE,
        rows,
        matching,
    })
}

pub(super) async fn list(
    State(inner): State<Arc<Inner>>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = query else {
        return bad_request(&inner, "the query is not one this page takes");
    };
    let listing = match Listing::parse(q) {
        Ok(l) => l,
        Err(why) => return bad_request(&inner, &why),
    };
    let l = listing.clone();
    read_then(
        inner,
        move |i| read(i, &l),
        move |i, mut found: Found| {
            let l = listing;
            match l.sort {
                Sort::Id => {}
                Sort::Due => found.rows.sort_by_key(|r| r.entry.due_at()),
                Sort::Attempts => found
                    .rows
                    .sort_by_key(|r| std::cmp::Reverse(r.entry.attempt_count)),
            }
            let next = found
                .paged
                .then(|| found.rows.last().map(|r| r.entry.id.0))
                .flatten()
                .filter(|_| l.sort == Sort::Id)
                .map(|last| l.link(&i.base, Some(last), Sort::Id));
            let body = html! {
                (filter_form(i, &l))
                (table(i, &l, &found.rows))
                @if found.rows.is_empty() { p { "No entries." } }
                @if let Some(next) = next { p { a href=(next) { "Next page" } } }
                @if let (true, Some(s), Some(n)) = (i.writes, l.status, found.matching) {
                    @if n > 0 { (matching_actions(i, s, l.destination.as_deref(), n)) }
                }
            };
            page(i, StatusCode::OK, "Outbox", &body)
        },
    )
    .await
}

/// The form that sets the listing's filter (a `GET`: no token).
fn filter_form(i: &Inner, l: &Listing) -> Markup {
    html! {
        form.filter method="get" action={ (i.base) "/outbox" } {
            label { "status " select name="status" {
                option value="" selected[l.status.is_none()] { "any" }
                @for s in OutboxStatus::ALL {
                    option value=(s.as_str()) selected[l.status == Some(s)] { (s.as_str()) }
                }
            } }
            " "
            label { "destination " input type="text" name="destination" value=[l.destination.as_deref()]; }
            " "
            label { "command " input type="text" name="command" value=[l.command.as_deref()]; }
            " "
            label { "key " input type="text" name="key" value=[l.key.as_deref()]; }
            " "
            label { "order " select name="order" {
                option value="oldest" selected[!l.newest_first] { "oldest first" }
                option value="newest" selected[l.newest_first] { "newest first" }
            } }
            " "
            button type="submit" { "Filter" }
        }
    }
}

/// The entries, with a check box each and the actions on those checked
/// when writes are allowed.
fn table(i: &Inner, l: &Listing, rows: &[OutboxRecord]) -> Markup {
    let sorted = |sort: Sort, label: &str| {
        html! {
            @if l.sort == sort { (label) " ↓" } @else { a href=(l.link(&i.base, l.after, sort)) { (label) } }
        }
    };
    let rows_markup = html! {
        table {
            tr {
                @if i.writes { th { "" } }
                th { (sorted(Sort::Id, "id")) } th { "status" } th { "destination" } th { "key" }
                th { (sorted(Sort::Attempts, "attempts")) }
                th { (sorted(Sort::Due, "due")) } th { "claimed or finished" } th { "last failure" }
            }
            @for r in rows {
                tr {
                    @if i.writes {
                        td { input type="checkbox" name="id" value=(r.entry.id.0) aria-label={ "select " (r.entry.id.0) }; }
                    }
                    td.n { a href={ (i.base) "/outbox/" (r.entry.id.0) } { (r.entry.id.0) } }
                    td class=(r.entry.status.as_str()) { (r.entry.status.as_str()) }
                    td { (r.entry.destination) }
                    td { (r.entry.idempotency_key) }
                    td.n { (r.entry.attempt_count) }
                    td { (time(r.entry.due_at())) }
                    td { (settled_time(r).map(time).unwrap_or_default()) }
                    td { (r.last_failure.as_deref().unwrap_or("")) }
                }
            }
        }
    };
    if !i.writes || rows.is_empty() {
        return rows_markup;
    }
    html! {
        form method="post" action={ (i.base) "/outbox/selected" } {
            (token_field(i))
            input type="hidden" name="back" value=(l.link(&i.base, l.after, l.sort));
            (rows_markup)
            p {
                "With the entries checked: "
                button type="submit" name="action" value="retry" { "Retry" } " "
                button type="submit" name="action" value="cancel" { "Cancel" } " "
                button type="submit" name="action" value="release" { "Release claims" } " "
                button type="submit" name="action" value="complete" { "Resolve as completed" } " "
                button type="submit" name="action" value="fail" { "Resolve as failed" }
            }
        }
    }
}

/// When `r` was claimed (or went in doubt), or finished, if it was.
fn settled_time(r: &OutboxRecord) -> Option<DateTime<Utc>> {
    r.entry.completed_at.or(r
        .claim
        .as_ref()
        .or(r.attempt_in_doubt.as_ref())
        .map(|c| c.claimed_at))
}

/// The forms of the actions on all `n` entries of `status` (and
/// `destination`), each asking for a confirmation.
fn matching_actions(i: &Inner, status: OutboxStatus, destination: Option<&str>, n: u64) -> Markup {
    use OutboxStatus::{Dispatching, Failed, OutcomeUnknown, Pending};
    let retry = matches!(status, Failed | OutcomeUnknown);
    let cancel = matches!(status, Pending | OutcomeUnknown);
    let release = status == Dispatching;
    let resolve = status == OutcomeUnknown;
    let form = |what: &str, label: &str, reason: bool| {
        html! {
            form method="post" action={ (i.base) "/outbox/" (what) "-matching" } {
                (token_field(i))
                input type="hidden" name="status" value=(status.as_str());
                @if let Some(d) = destination { input type="hidden" name="destination" value=(d); }
                @if reason { input type="text" name="reason" placeholder="reason code"; " " }
                label { input type="checkbox" name="confirm" value="yes" required; " I mean all " (n) }
                " "
                button type="submit" { (label) " all " (n) " matching entries" }
            }
        }
    };
    html! {
        h2 { "Every matching entry" }
        @if retry { (form("retry", "Retry", false)) }
        @if cancel { (form("cancel", "Cancel", false)) }
        @if release { (form("release", "Release the claims of", false)) }
        @if resolve {
            (form("complete", "Resolve as completed", false))
            (form("fail", "Resolve as failed", true))
        }
    }
}
