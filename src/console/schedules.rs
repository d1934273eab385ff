//! The console's schedules page: each schedule's destination, expression,
//! missed-slot policy, pause, next slot and last slot fired; and, when
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
use crate::outbox::{Missed, ScheduleInfo};

pub(super) async fn list(State(inner): State<Arc<Inner>>) -> Response {
    read_then(
        inner,
        |i| i.outbox.schedules(),
        |i, schedules: Vec<ScheduleInfo>| {
            let body = html! {
                @if schedules.is_empty() { p { "No schedule." } }
                table {
                    tr {
                        th { "schedule" } th { "destination" } th { "when" } th { "missed slots" }
                        th { "paused" } th { "next slot" } th { "last fired" }
                        @if i.writes { th { "action" } }
                    }
                    @for s in &schedules {
                        tr {
                            th { (s.name) }
                            td { a href=(list_link(&i.base, None, Some(&s.destination), None)) { (s.destination) } }
                            td { (s.spec) }
                            td { (missed(s.missed)) }
                            td { @if s.paused { "paused" } @else { "no" } }
                            td { (s.next_slot.map_or_else(|| "not started".to_owned(), time)) }
                            td { (s.last_fired.map_or_else(|| "never".to_owned(), time)) }
                            @if i.writes {
                                td {
                                    @let (what, label) = if s.paused { ("resume", "Resume") } else { ("pause", "Pause") };
                                    form method="post" action={ (i.base) "/schedules/" (what) } {
                                        (token_field(i))
                                        input type="hidden" name="schedule" value=(s.name);
                                        button type="submit" { (label) }
                                    }
                                }
                            }
                        }
                    }
                }
            };
            page(i, StatusCode::OK, "Schedules", &body)
        },
    )
    .await
}

fn missed(m: Missed) -> &'static str {
    match m {
        Missed::Latest => "the latest",
        Missed::All => "all",
        Missed::None => "none",
    }
}

/// A pause or resume form.
#[derive(Debug, Deserialize)]
pub(super) struct ScheduleForm {
    token: Option<String>,
    schedule: Option<String>,
}

pub(super) async fn pause(
    state: State<Arc<Inner>>,
    headers: HeaderMap,
    form: Form<ScheduleForm>,
) -> Response {
    change(state, headers, form, true).await
}

pub(super) async fn resume(
    state: State<Arc<Inner>>,
    headers: HeaderMap,
    form: Form<ScheduleForm>,
) -> Response {
    change(state, headers, form, false).await
}

async fn change(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    Form(form): Form<ScheduleForm>,
    paused: bool,
) -> Response {
    if let Some(refusal) = refused(&inner, &headers, form.token.as_deref()) {
        return refusal;
    }
    let Some(name) = form.schedule.filter(|d| !d.is_empty()) else {
        return page(
            &inner,
            StatusCode::BAD_REQUEST,
            "Bad request",
            &html! { p { "Which schedule? Nothing was changed." } },
        );
    };
    let back = format!("{}/schedules", inner.base);
    read_then(
        inner,
        move |i| {
            if paused {
                i.outbox.pause_schedule(&name)
            } else {
                i.outbox.resume_schedule(&name)
            }
        },
        move |_, ()| Redirect::to(&back).into_response(),
    )
    .await
}
