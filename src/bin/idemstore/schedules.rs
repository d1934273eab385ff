//! `schedules` and `schedule pause|resume|remove`: the outbox's periodic
//! entries, and an operator's changes to them. A change is one commit,
//! which every dispatcher on the store follows from its next firing. On a
//! store file or on a PostgreSQL server alike.

use chrono::Utc;
use idemstore::{Missed, ScheduleInfo};
use serde_json::{Value, json};

use crate::commands::report;
use crate::handle::open_outbox;
use crate::output::{out, print_json, ts_opt, when};
use crate::target::Target;
use crate::{Failure, Outcome, ScheduleCommand};

fn missed(m: Missed) -> &'static str {
    match m {
        Missed::Latest => "latest",
        Missed::All => "all",
        Missed::None => "none",
    }
}

/// A schedule for scripts.
fn info_json(s: &ScheduleInfo) -> Value {
    json!({
        "name": s.name,
        "destination": s.destination,
        "spec": s.spec,
        "missed": missed(s.missed),
        "paused": s.paused,
        "next_slot": ts_opt(s.next_slot),
        "last_fired": ts_opt(s.last_fired),
    })
}

/// `schedules STORE`.
pub(crate) fn list(store: &Target, schema: Option<&str>, json: bool) -> Result<Outcome, Failure> {
    let schedules = open_outbox(store, schema)?.schedules()?;
    if json {
        print_json(&Value::Array(schedules.iter().map(info_json).collect()));
        return Ok(Outcome::Ok);
    }
    let now = Utc::now();
    for s in &schedules {
        out!("{}", s.name);
        out!("  destination {}", s.destination);
        out!(
            "  when        {} (missed slots: {})",
            s.spec,
            missed(s.missed)
        );
        out!("  paused      {}", if s.paused { "yes" } else { "no" });
        match s.next_slot {
            Some(at) => out!("  next slot   {}", when(at, now)),
            None => out!("  next slot   none (not started by a dispatcher yet, or none left)"),
        }
        match s.last_fired {
            Some(at) => out!("  last fired  {}", when(at, now)),
            None => out!("  last fired  never"),
        }
    }
    out!("{} schedules", schedules.len());
    Ok(Outcome::Ok)
}

/// `schedule pause|resume|remove`.
pub(crate) fn run(
    c: &ScheduleCommand,
    schema: Option<&str>,
    json: bool,
) -> Result<Outcome, Failure> {
    match c {
        ScheduleCommand::Pause { store, name } => {
            open_outbox(store, schema)?.pause_schedule(name)?;
            report(json, &json!({"schedule": name, "paused": true}), || {
                format!("paused schedule {name}: it fires nothing until it is resumed")
            })
        }
        ScheduleCommand::Resume { store, name } => {
            open_outbox(store, schema)?.resume_schedule(name)?;
            report(json, &json!({"schedule": name, "paused": false}), || {
                format!("resumed schedule {name}")
            })
        }
        ScheduleCommand::Remove { store, name } => {
            open_outbox(store, schema)?.remove_schedule(name)?;
            report(json, &json!({"schedule": name, "removed": true}), || {
                format!("removed schedule {name} (the entries it enqueued stay)")
            })
        }
    }
}
