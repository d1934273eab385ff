//! The console's destinations page: each destination's policy, pause,
//! circuit, hold, entries in flight and entries by status; and, when
//! writes are allowed, pause and resume.

use std::sync::Arc;

use axum::Form;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use maud::html;
use serde::Deserialize;

use super::Inner;
use super::actions::refused;
use super::pages::{list_link, page, read_then, time, token_field};
use crate::outbox::{CircuitState, DestinationState, OutboxStatus};

pub(super) async fn list(State(inner): State<Arc<Inner>>) -> Response {
    read_then(
        inner,
        |i| i.outbox.destinations(),
        |i, destinations: Vec<DestinationState>| {
            let body = html! {
                @if destinations.is_empty() { p { "No destination has an entry, a policy or a pause." } }
                table {
                    tr {
                        th { "destination" } th { "policy" } th { "paused" } th { "circuit" }
                        th { "held until" } th { "in flight" } th { "entries" }
                        @if i.writes { th { "action" } }
                    }
                    @for d in &destinations {
                        tr {
                            th { a href=(list_link(&i.base, None, Some(&d.destination), None)) { (d.destination) } }
                            td { (d.policy.to_string()) }
                            td { @if d.paused { "paused" } @else { "no" } }
                            td { (circuit(&d.circuit)) }
                            td { (d.held_until.map_or_else(String::new, time)) }
                            td.n { (d.in_flight) }
                            td {
                                @for s in OutboxStatus::ALL {
                                    @let n = d.counts.get(s);
                                    @if n > 0 { (n) " " (s.as_str()) " " }
                                }
                            }
                            @if i.writes {
                                td {
                                    @let (what, label) = if d.paused { ("resume", "Resume") } else { ("pause", "Pause") };
                                    form method="post" action={ (i.base) "/destinations/" (what) } {
                                        (token_field(i))
                                        input type="hidden" name="destination" value=(d.destination);
                                        button type="submit" { (label) }
                                    }
                                }
                            }
                        }
                    }
                }
            };
            page(i, StatusCode::OK, "Destinations", &body)
        },
    )
    .await
}

/// A pause or resume form.
#[derive(Debug, Deserialize)]
pub(super) struct FlowForm {
    token: Option<String>,
    destination: Option<String>,
}

pub(super) async fn pause(
    state: State<Arc<Inner>>,
    headers: HeaderMap,
    form: Form<FlowForm>,
) -> Response {
    change(state, headers, form, true).await
}

pub(super) async fn resume(
    state: State<Arc<Inner>>,
    headers: HeaderMap,
    form: Form<FlowForm>,
) -> Response {
    change(state, headers, form, false).await
}

async fn change(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    Form(form): Form<FlowForm>,
    paused: bool,
) -> Response {
    if let Some(refusal) = refused(&inner, &headers, form.token.as_deref()) {
        return refusal;
    }
    let Some(destination) = form.destination.filter(|d| !d.is_empty()) else {
        return page(
            &inner,
            StatusCode::BAD_REQUEST,
            "Bad request",
            &html! { p { "Which destination? Nothing was changed." } },
        );
    };
    let back = format!("{}/destinations", inner.base);
    read_then(
        inner,
        move |i| {
            if paused {
                i.outbox.pause_destination(&destination)
            } else {
                i.outbox.resume_destination(&destination)
            }
        },
        move |_, ()| Redirect::to(&back).into_response(),
    )
    .await
}

/// A circuit for people.
fn circuit(c: &CircuitState) -> String {
    match c {
        CircuitState::Closed {
            consecutive_failures,
        } => format!("closed ({consecutive_failures} failures in a row)"),
        CircuitState::Open { until, trips } => {
            format!("open until {} ({trips} trips)", time(*until))
        }
        CircuitState::Probing { probe, trips } => {
            format!("probing with entry {} ({trips} trips)", probe.0)
        }
    }
}
