//! The console's overview: the entries by status and destination, the
//! oldest pending entry, recent failures by reason, the application's
//! commit and dispatch figures when it passed them, and the backlog over
//! time as an inline SVG chart. The part that changes (`/live`) is
//! fetched again every few seconds by the console's one small script, so
//! the page stays current without reloading; without script, a reload
//! shows the same.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{DateTime, Duration, Utc};
use maud::{Markup, PreEscaped, html};

use super::Inner;
use super::pages::{fragment, list_link, page, read_then, time, time_opt};
use crate::outbox::{OutboxCounts, OutboxFilter, OutboxRecord, OutboxStatus};
use crate::{CommitStats, DestinationState, DispatchStats};

/// Failed entries read for "recent failures by reason", newest first.
const RECENT_FAILURES: usize = 200;
/// The backlog chart's samples: at most one per [`SAMPLE_EVERY`], the
/// last hour's.
const SAMPLES: usize = 720;
const SAMPLE_EVERY: Duration = Duration::seconds(5);
/// How often the page's script fetches the live part again, in ms.
pub(super) const REFRESH_MS: u32 = 5000;

/// The counts the console saw over time, for the backlog chart: sampled
/// when a page reads them, at most once every [`SAMPLE_EVERY`].
#[derive(Debug, Default)]
pub(super) struct History {
    samples: VecDeque<(DateTime<Utc>, OutboxCounts)>,
}

impl History {
    /// Notes `counts` seen at `now`, unless the last sample is recent.
    fn note(&mut self, now: DateTime<Utc>, counts: OutboxCounts) {
        if self
            .samples
            .back()
            .is_some_and(|(at, _)| now - *at < SAMPLE_EVERY)
        {
            return;
        }
        if self.samples.len() == SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back((now, counts));
    }
}

/// What the overview shows.
struct Overview {
    now: DateTime<Utc>,
    counts: OutboxCounts,
    destinations: Vec<DestinationState>,
    next_due: Option<DateTime<Utc>>,
    oldest_claim: Option<DateTime<Utc>>,
    oldest_pending: Option<OutboxRecord>,
    recent_failures: Vec<OutboxRecord>,
    commits: Option<CommitStats>,
    dispatch: Option<DispatchStats>,
    samples: Vec<(DateTime<Utc>, OutboxCounts)>,
}

/// Reads what the overview shows (on the blocking pool).
fn read(i: &Inner) -> crate::Result<Overview> {
    let now = Utc::now();
    let counts = i.outbox.counts()?;
    let samples = {
        let mut history = i.history.lock();
        history.note(now, counts);
        history.samples.iter().copied().collect()
    };
    let pending = OutboxFilter::any().status(OutboxStatus::Pending);
    let failed = OutboxFilter::any()
        .status(OutboxStatus::Failed)
        .newest_first();
    Ok(Overview {
        now,
        counts,
        destinations: i.outbox.destinations()?,
        next_due: i.outbox.next_due()?,
        oldest_claim: i.outbox.oldest_claim()?,
        oldest_pending: i.outbox.list(&pending, 1)?.pop(),
        recent_failures: i.outbox.list(&failed, RECENT_FAILURES)?,
        commits: i
            .hooks
            .commits
            .as_ref()
            .and_then(|f| super::guarded(|| f())),
        dispatch: i
            .hooks
            .dispatch
            .as_ref()
            .and_then(|f| super::guarded(|| f())),
        samples,
    })
}

pub(super) async fn overview(State(inner): State<Arc<Inner>>) -> Response {
    read_then(inner, read, |i, o| {
        let body = html! {
            section #live data-src={ (i.base) "/live" } data-every=(REFRESH_MS) { (live(i, &o)) }
            script src={ (i.base) "/console.js" } {}
        };
        page(i, StatusCode::OK, "Overview", &body)
    })
    .await
}

/// The live part alone, which the page's script fetches.
pub(super) async fn live_part(State(inner): State<Arc<Inner>>) -> Response {
    read_then(inner, read, |i, o| fragment(&live(i, &o))).await
}

/// The part of the overview that changes.
fn live(i: &Inner, o: &Overview) -> Markup {
    let list = |status: Option<OutboxStatus>, destination: Option<&str>| {
        list_link(&i.base, status, destination, None)
    };
    html! {
        p.muted { "As of " (time(o.now)) "." }
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
        p {
            "Oldest pending entry: "
            @match &o.oldest_pending {
                Some(r) => {
                    a href={ (i.base) "/outbox/" (r.entry.id.0) } { (r.entry.id.0) }
                    ", enqueued " (age(o.now - r.entry.created_at)) " ago (" (time(r.entry.created_at)) ")"
                }
                None => "none",
            }
        }
        p { "Next entry due: " (time_opt(o.next_due)) }
        p { "Oldest claim: " (time_opt(o.oldest_claim)) }
        h2 { "Backlog by destination" }
        (bars(&o.destinations))
        h2 { "Backlog over time" }
        (chart(&o.samples))
        h2 { "Recent failures by reason" }
        (failures(i, &o.recent_failures))
        @if o.commits.is_some() || o.dispatch.is_some() {
            h2 { "Commits and dispatch" }
            (stats(o.commits, o.dispatch.as_ref()))
        }
    }
}

/// The latest failed entries grouped by reason: how many, of which
/// destinations, the latest.
fn failures(i: &Inner, recent: &[OutboxRecord]) -> Markup {
    struct Reason<'a> {
        n: usize,
        destinations: BTreeSet<&'a str>,
        latest: &'a OutboxRecord,
    }
    let mut by_reason: BTreeMap<&str, Reason<'_>> = BTreeMap::new();
    for r in recent {
        let reason = r.last_failure.as_deref().unwrap_or("(none)");
        let e = by_reason.entry(reason).or_insert(Reason {
            n: 0,
            destinations: BTreeSet::new(),
            latest: r,
        });
        e.n += 1;
        e.destinations.insert(&r.entry.destination);
    }
    let mut rows: Vec<_> = by_reason.into_iter().collect();
    rows.sort_by(|a, b| b.1.n.cmp(&a.1.n).then(a.0.cmp(b.0)));
    html! {
        @if rows.is_empty() { p { "No failed entries." } } @else {
            p.muted { "Of the latest " (recent.len()) " failed entries." }
            table {
                tr { th { "reason" } th { "entries" } th { "destinations" } th { "latest" } }
                @for (reason, r) in &rows {
                    tr {
                        td { (reason) }
                        td.n { (r.n) }
                        td {
                            @for (k, d) in r.destinations.iter().enumerate() {
                                @if k > 0 { ", " }
                                a href=(list_link(&i.base, Some(OutboxStatus::Failed), Some(d), None)) { (d) }
                            }
                        }
                        td {
                            a href={ (i.base) "/outbox/" (r.latest.entry.id.0) } { (r.latest.entry.id.0) }
                            " " (time_opt(r.latest.entry.completed_at))
                        }
                    }
                }
            }
        }
    }
}

/// The application's commit and dispatch figures.
fn stats(commits: Option<CommitStats>, dispatch: Option<&DispatchStats>) -> Markup {
    let ms = |d: std::time::Duration| format!("{:.1} ms", d.as_secs_f64() * 1e3);
    html! {
        table {
            @if let Some(c) = commits {
                tr { th { "commits" } td.n { (c.commits) } }
                tr { th { "durable commits (fsyncs)" } td.n { (c.durable_commits) } }
            }
            @if let Some(d) = dispatch {
                tr { th { "delivered" } td.n { (d.delivered) } }
                tr { th { "retried" } td.n { (d.retried) } }
                tr { th { "failed" } td.n { (d.failed) } }
                tr { th { "outcome unknown" } td.n { (d.outcome_unknown) } }
                tr { th { "send panics" } td.n { (d.panics) } }
                tr { th { "store errors" } td.n { (d.store_errors) } }
                tr {
                    th { "enqueue to send" }
                    td { "p50 " (ms(d.latency.p50)) ", p99 " (ms(d.latency.p99)) ", max " (ms(d.latency.max)) }
                }
                @if let Some(e) = &d.last_error {
                    tr { th { "last error" } td { (time(e.at)) ", " (e.during) ": " (e.message) } }
                }
            }
        }
    }
}

/// The series of the chart: a status and its colour.
const SERIES: [(OutboxStatus, &str); 4] = [
    (OutboxStatus::Pending, "#2563eb"),
    (OutboxStatus::Dispatching, "#d97706"),
    (OutboxStatus::Failed, "#b91c1c"),
    (OutboxStatus::OutcomeUnknown, "#7c3aed"),
];

/// The backlog over time as an inline SVG chart: one line per unfinished
/// or failed status, over the samples the console took, with the peak
/// and the span as labels.
fn chart(samples: &[(DateTime<Utc>, OutboxCounts)]) -> Markup {
    const W: f64 = 600.0;
    const H: f64 = 120.0;
    let (Some(first), Some(last)) = (samples.first(), samples.last()) else {
        return html! { p { "No samples yet." } };
    };
    if samples.len() < 2 {
        return html! {
            p.muted {
                "The chart fills in while the console is watched: a sample every "
                (SAMPLE_EVERY.num_seconds()) " s, the last hour's."
            }
        };
    }
    let span = (last.0 - first.0).num_milliseconds().max(1) as f64;
    let peak = samples
        .iter()
        .flat_map(|(_, c)| SERIES.iter().map(|(s, _)| c.get(*s)))
        .max()
        .unwrap_or(0)
        .max(1);
    let top = peak as f64;
    let mut lines = String::new();
    for (status, colour) in SERIES {
        let mut d = String::new();
        for (k, (at, c)) in samples.iter().enumerate() {
            let x = 40.0 + (*at - first.0).num_milliseconds() as f64 / span * W;
            let y = 10.0 + H - c.get(status) as f64 / top * H;
            let _ = write!(d, "{}{x:.1},{y:.1}", if k == 0 { "M" } else { " L" });
        }
        // Only numbers and fixed colours: nothing from the store as text.
        let _ = write!(
            lines,
            r#"<path d="{d}" fill="none" stroke="{colour}" stroke-width="2"/>"#
        );
    }
    html! {
        figure.chart {
            svg xmlns="http://www.w3.org/2000/svg" width="660" height="160" viewBox="0 0 660 160"
                role="img" aria-label="entries by status over time" {
                rect x="40" y="10" width="600" height="120" fill="none" stroke="#ccc" {}
                text x="34" y="16" text-anchor="end" font-size="11" { (peak) }
                text x="34" y="134" text-anchor="end" font-size="11" { "0" }
                text x="40" y="150" font-size="11" { (first.0.format("%H:%M:%S")) }
                text x="640" y="150" text-anchor="end" font-size="11" { (last.0.format("%H:%M:%S")) }
                (PreEscaped(lines))
            }
            figcaption { (legend()) " (" (samples.len()) " samples, UTC)" }
        }
    }
}

/// The chart's colours, named.
fn legend() -> Markup {
    html! {
        @for (status, _) in SERIES {
            span class={ "s-" (status.as_str()) } { "■ " (status.as_str()) } " "
        }
    }
}

/// The backlog of each destination as a bar: its pending, dispatching,
/// failed and in-doubt entries end to end, on one scale.
fn bars(destinations: &[DestinationState]) -> Markup {
    const W: f64 = 480.0;
    let rows: Vec<(&str, [u64; 4])> = destinations
        .iter()
        .map(|d| {
            (
                d.destination.as_str(),
                SERIES.map(|(status, _)| d.counts.get(status)),
            )
        })
        .filter(|(_, n)| n.iter().any(|&n| n > 0))
        .take(20)
        .collect();
    let widest = rows
        .iter()
        .map(|(_, n)| n.iter().sum::<u64>())
        .max()
        .unwrap_or(0);
    if widest == 0 {
        return html! { p { "No backlog: every entry is completed." } };
    }
    let height = 22 * rows.len() + 4;
    let mut shapes = String::new();
    for (k, (_, counts)) in rows.iter().enumerate() {
        let y = 22 * k + 4;
        let mut x = 160.0;
        for ((_, colour), n) in SERIES.iter().zip(counts) {
            let w = *n as f64 / widest as f64 * W;
            if w > 0.0 {
                let _ = write!(
                    shapes,
                    r#"<rect x="{x:.1}" y="{y}" width="{w:.1}" height="16" fill="{colour}"/>"#
                );
            }
            x += w;
        }
    }
    html! {
        figure.chart {
            svg xmlns="http://www.w3.org/2000/svg" width="700" height=(height)
                viewBox={ "0 0 700 " (height) } role="img" aria-label="backlog by destination" {
                @for (k, (d, counts)) in rows.iter().enumerate() {
                    // The destination's name, escaped as every text is.
                    text x="154" y=(22 * k + 16) text-anchor="end" font-size="12" { (short(d)) }
                    text x="648" y=(22 * k + 16) font-size="12" { (counts.iter().sum::<u64>()) }
                }
                (PreEscaped(shapes))
            }
            figcaption { (legend()) }
        }
    }
}

/// `name` cut to what fits beside a bar.
fn short(name: &str) -> String {
    if name.chars().count() <= 22 {
        return name.to_owned();
    }
    let mut cut: String = name.chars().take(21).collect();
    cut.push('…');
    cut
}

/// `d` for people: "3 h 20 min", "45 s".
fn age(d: Duration) -> String {
    let s = d.num_seconds().max(0);
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        3600..86_400 => format!("{} h {} min", s / 3600, s % 3600 / 60),
        _ => format!("{} d {} h", s / 86_400, s % 86_400 / 3600),
    }
}

/// The console's one script: fetches the overview's live part again every
/// few seconds and puts it in place (served from the console itself, the
/// only script the policy allows).
pub(super) const SCRIPT: &str = "(function(){var s=document.getElementById('live');\
if(!s||!window.fetch)return;var every=+s.dataset.every||5000;\
function tick(){fetch(s.dataset.src,{credentials:'same-origin'}).then(function(r){\
return r.ok?r.text():null}).then(function(t){if(t!==null)s.innerHTML=t}).catch(function(){})\
.then(function(){setTimeout(tick,every)})}setTimeout(tick,every)})();";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_history_keeps_one_sample_per_interval_and_the_last_hour() {
        let t0 = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let mut h = History::default();
        let c = OutboxCounts::default();
        h.note(t0, c);
        h.note(t0 + Duration::seconds(1), c);
        assert_eq!(h.samples.len(), 1, "a second sample too soon is dropped");
        for k in 1..=(i32::try_from(SAMPLES).unwrap() + 10) {
            h.note(t0 + SAMPLE_EVERY * k, c);
        }
        assert_eq!(h.samples.len(), SAMPLES);
        assert_eq!(h.samples.front().unwrap().0, t0 + SAMPLE_EVERY * 11);
    }

    #[test]
    fn the_chart_draws_a_line_per_status_once_it_has_two_samples() {
        let t0 = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let counts = |pending, failed| OutboxCounts {
            pending,
            failed,
            ..OutboxCounts::default()
        };
        let one = [(t0, counts(5, 1))];
        assert!(!chart(&one).into_string().contains("<svg"));
        let two = [(t0, counts(5, 1)), (t0 + SAMPLE_EVERY, counts(12, 3))];
        let svg = chart(&two).into_string();
        assert_eq!(svg.matches("<path").count(), SERIES.len());
        assert!(svg.contains(">12</text>"), "the peak labelled: {svg}");
        // Pending peaks at the top of the frame (y = 10) in the second sample.
        assert!(svg.contains("L640.0,10.0"), "{svg}");
    }

    #[test]
    fn bars_show_each_destination_with_a_backlog_escaped() {
        let d = |name: &str, pending| DestinationState {
            counts: OutboxCounts {
                pending,
                ..OutboxCounts::default()
            },
            ..DestinationState::empty(name)
        };
        let svg = bars(&[d("<b>", 3), d("idle", 0)]).into_string();
        assert!(svg.contains("&lt;b&gt;") && !svg.contains("<b>"), "{svg}");
        assert!(!svg.contains("idle"), "no bar without a backlog");
        assert!(bars(&[d("idle", 0)]).into_string().contains("No backlog"));
    }

    #[test]
    fn ages_read_as_people_say_them() {
        assert_eq!(age(Duration::seconds(45)), "45 s");
        assert_eq!(age(Duration::seconds(125)), "2 min 5 s");
        assert_eq!(age(Duration::seconds(3 * 3600 + 20 * 60)), "3 h 20 min");
        assert_eq!(age(Duration::days(2) + Duration::hours(5)), "2 d 5 h");
        assert_eq!(
            age(Duration::seconds(-5)),
            "0 s",
            "a clock behind reads as now"
        );
    }
}
