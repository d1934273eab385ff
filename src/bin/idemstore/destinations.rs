//! `destinations` and `destination pause|resume|set`: what each destination
//! holds and how it is treated, and an operator's changes to it. A change
//! is one commit, which every dispatcher on the store follows from its
//! next claim. On a store file or on a PostgreSQL server alike.

use chrono::Utc;
use idemstore::{CircuitState, DestinationPolicy, DestinationState, OutboxStatus};
use serde_json::{Value, json};

use crate::commands::report;
use crate::handle::open_outbox;
use crate::output::{out, print_json, ts, ts_opt, when};
use crate::target::Target;
use crate::{DestinationCommand, Failure, Outcome};

/// `destinations STORE`.
pub(crate) fn list(store: &Target, schema: Option<&str>, json: bool) -> Result<Outcome, Failure> {
    let destinations = open_outbox(store, schema)?.destinations()?;
    if json {
        print_json(&Value::Array(destinations.iter().map(state_json).collect()));
        return Ok(Outcome::Ok);
    }
    let now = Utc::now();
    for d in &destinations {
        out!("{}", d.destination);
        out!("  policy     {}", d.policy);
        out!("  paused     {}", if d.paused { "yes" } else { "no" });
        let circuit = match d.circuit {
            CircuitState::Closed {
                consecutive_failures,
            } => format!("closed ({consecutive_failures} failures in a row)"),
            CircuitState::Open { until, trips } => {
                format!(
                    "open until {} (opened {trips} times in a row)",
                    when(until, now)
                )
            }
            CircuitState::Probing { probe, trips } => {
                format!(
                    "probing with entry {} (opened {trips} times in a row)",
                    probe.0
                )
            }
            _ => format!("{:?}", d.circuit),
        };
        out!("  circuit    {circuit}");
        if let Some(until) = d.held_until {
            out!("  held       until {}", when(until, now));
        }
        if let (Some(tokens), Some((_, burst))) = (d.tokens, d.policy.limits().rate_limit) {
            out!("  tokens     {tokens:.1} of {burst} (as last stored)");
        }
        out!("  in flight  {}", d.in_flight);
        let parts: Vec<String> = OutboxStatus::ALL
            .iter()
            .map(|st| format!("{} {}", d.counts.get(*st), st.as_str()))
            .collect();
        out!("  entries    {}", parts.join(", "));
    }
    out!("{} destinations", destinations.len());
    Ok(Outcome::Ok)
}

/// `destination pause|resume|set`.
pub(crate) fn run(
    c: &DestinationCommand,
    schema: Option<&str>,
    json: bool,
) -> Result<Outcome, Failure> {
    match c {
        DestinationCommand::Pause { store, name } => {
            open_outbox(store, schema)?.pause_destination(name)?;
            report(json, &json!({"destination": name, "paused": true}), || {
                format!(
                    "paused destination {name}: none of its entries is claimed until it is resumed"
                )
            })
        }
        DestinationCommand::Resume { store, name } => {
            open_outbox(store, schema)?.resume_destination(name)?;
            report(json, &json!({"destination": name, "paused": false}), || {
                format!("resumed destination {name}")
            })
        }
        DestinationCommand::Set {
            store,
            name,
            max_in_flight,
            rate,
            burst,
            circuit,
            cool_down,
            weight,
            clear: _,
        } => {
            let mut policy = DestinationPolicy::default();
            if let Some(n) = max_in_flight {
                policy = policy.max_in_flight(*n);
            }
            if let (Some(per_second), Some(burst)) = (rate, burst) {
                policy = policy.rate_limit(*per_second, *burst);
            }
            if let (Some(k), Some(cool_down)) = (circuit, cool_down) {
                policy = policy.circuit_breaker(*k, *cool_down);
            }
            if let Some(w) = weight {
                policy = policy.weight(*w);
            }
            open_outbox(store, schema)?.set_destination_policy(name, policy)?;
            report(
                json,
                &json!({"destination": name, "policy": policy_json(&policy)}),
                || format!("set the policy of destination {name}: {policy}"),
            )
        }
    }
}

/// A policy for scripts: each limit, `null` when not set.
fn policy_json(policy: &DestinationPolicy) -> Value {
    let limits = policy.limits();
    json!({
        "max_in_flight": limits.max_in_flight,
        "rate_limit": limits.rate_limit.map(|(per_second, burst)| json!({
            "per_second": per_second, "burst": burst,
        })),
        "circuit_breaker": limits.circuit_breaker.map(|(k, cool_down)| json!({
            "consecutive_failures": k,
            "cool_down_ms": u64::try_from(cool_down.as_millis()).unwrap_or(u64::MAX),
        })),
        "weight": limits.weight,
    })
}

/// A destination for scripts.
fn state_json(d: &DestinationState) -> Value {
    let circuit = match d.circuit {
        CircuitState::Closed {
            consecutive_failures,
        } => json!({"state": "closed", "consecutive_failures": consecutive_failures}),
        CircuitState::Open { until, trips } => {
            json!({"state": "open", "until": ts(until), "trips": trips})
        }
        CircuitState::Probing { probe, trips } => {
            json!({"state": "probing", "probe": probe.0, "trips": trips})
        }
        _ => json!({"state": format!("{:?}", d.circuit)}),
    };
    let counts: serde_json::Map<String, Value> = OutboxStatus::ALL
        .iter()
        .map(|st| (st.as_str().to_owned(), json!(d.counts.get(*st))))
        .collect();
    json!({
        "destination": d.destination,
        "policy": policy_json(&d.policy),
        "paused": d.paused,
        "circuit": circuit,
        "held_until": ts_opt(d.held_until),
        "tokens": d.tokens,
        "in_flight": d.in_flight,
        "counts": counts,
    })
}
