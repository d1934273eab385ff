//! One function per command.

use std::path::Path;

use chrono::{DateTime, Utc};
use idemstore::{KeyState, OutboxFilter, OutboxId, OutboxStatus, StoreStats};
use serde_json::{Value, json};

use crate::export::PAGE;
use crate::handle::{KeysHandle, OutboxHandle, StoreHandle, open_outbox, open_store};
use crate::output::{
    bytes, key_json, last_reason, out, outbox_json, preview, print_json, spinner, ts, ts_opt, when,
    when_opt,
};
use crate::target::Target;
use crate::{
    Cli, Command, Failure, InboxCommand, KeysCommand, OutboxCommand, Outcome, open, open_alone,
};

/// Runs the command `cli` names.
pub(crate) fn run(cli: &Cli) -> Result<Outcome, Failure> {
    let json = cli.json;
    let schema = cli.schema.as_deref();
    if schema.is_some()
        && matches!(
            cli.command,
            Command::Compact { .. } | Command::Backup { .. }
        )
    {
        return Err(Failure(
            "--schema names a PostgreSQL store's schema: compact and backup work on store files \
             (back a PostgreSQL store up with pg_dump)"
                .into(),
        ));
    }
    match &cli.command {
        Command::Stats { store } => stats(store, schema, json),
        Command::Inbox(InboxCommand::List { store, name, limit }) => {
            inbox_list(&open_store(store, schema)?, name, *limit, json)
        }
        Command::Inbox(InboxCommand::Prune {
            store: target,
            name,
            before,
        }) => {
            let store = open_store(target, schema)?;
            let pb = spinner(&format!("pruning inbox {name}"));
            let n = store.inbox(name)?.prune(*before)?;
            pb.finish_and_clear();
            report(
                json,
                &json!({"inbox": name, "pruned": n, "before": ts(*before)}),
                || {
                    format!(
                        "pruned {n} keys seen before {} from inbox {name}",
                        ts(*before)
                    )
                },
            )
        }
        Command::Outbox(c) => outbox(c, schema, json),
        Command::Keys(KeysCommand::List {
            store,
            tenant,
            limit,
        }) => keys_list(
            &open_store(store, schema)?.keys(),
            tenant.as_deref(),
            *limit,
            json,
        ),
        Command::Keys(KeysCommand::Purge { store, before }) => {
            let keys = open_store(store, schema)?.keys();
            let pb = spinner("purging idempotency keys");
            let n = keys.purge_expired(*before)?;
            pb.finish_and_clear();
            report(json, &json!({"purged": n, "before": ts(*before)}), || {
                format!(
                    "purged {n} idempotency records created before {}",
                    ts(*before)
                )
            })
        }
        Command::Destinations { store } => crate::destinations::list(store, schema, json),
        Command::Destination(c) => crate::destinations::run(c, schema, json),
        Command::Schedules { store } => crate::schedules::list(store, schema, json),
        Command::Schedule(c) => crate::schedules::run(c, schema, json),
        Command::Console {
            store,
            listen,
            allow_writes,
            token_file,
        } => crate::serve::run(&crate::serve::Serve {
            store,
            schema,
            listen: *listen,
            allow_writes: *allow_writes,
            token_file: token_file.as_deref(),
        }),
        Command::Compact { file } => compact(file.file("compact")?, json),
        Command::Backup { file, to } => backup(file.file("backup")?, to, json),
        Command::Check { store } => check(store, schema, json),
        Command::Export { store, .. } => crate::export::export(&open_store(store, schema)?),
        Command::Migrate {
            file,
            to_postgres,
            batch,
        } => crate::migrate::run(file.file("migrate")?, to_postgres, schema, *batch, json),
    }
}

/// Prints `v` with `--json`, else the text `human` makes.
#[expect(
    clippy::unnecessary_wraps,
    reason = "commands end with `report(..)` as their result"
)]
pub(crate) fn report(
    json: bool,
    v: &Value,
    human: impl FnOnce() -> String,
) -> Result<Outcome, Failure> {
    if json {
        print_json(v);
    } else {
        out!("{}", human());
    }
    Ok(Outcome::Ok)
}

/// `0` means no limit.
fn limit_or_all(limit: usize) -> usize {
    if limit == 0 { usize::MAX } else { limit }
}

fn stats(target: &Target, schema: Option<&str>, json: bool) -> Result<Outcome, Failure> {
    let store = open_store(target, schema)?;
    let now = Utc::now();
    let mut inboxes = Vec::new();
    for name in store.inbox_names()? {
        let inbox = store.inbox(&name)?;
        let oldest = inbox.list(None, 1)?.first().map(|(_, at)| *at);
        inboxes.push((name, inbox.len()?, oldest));
    }
    let outbox = store.outbox();
    let counts = outbox.counts()?;
    let (next_due, oldest_claim) = (outbox.next_due()?, outbox.oldest_claim()?);
    let keys = store.keys().summary()?;
    // A file's size, format and space; a server's schema.
    let file: Result<StoreStats, String> = match &store {
        StoreHandle::File(s) => Ok(s.stats()?),
        #[cfg(feature = "postgres")]
        StoreHandle::Postgres(s) => Err(s.schema().to_owned()),
    };
    if json {
        let per_status: serde_json::Map<String, Value> = OutboxStatus::ALL
            .iter()
            .map(|st| (st.as_str().to_owned(), json!(counts.get(*st))))
            .collect();
        let mut v = where_json(target, &file);
        let rest = json!({
            "inboxes": inboxes.iter().map(|(name, n, oldest)| json!({
                "name": name, "keys": n, "oldest_seen_at": ts_opt(*oldest),
            })).collect::<Vec<_>>(),
            "outbox": {
                "total": counts.total(),
                "counts": per_status,
                "oldest_due": ts_opt(next_due),
                "oldest_claim": ts_opt(oldest_claim),
            },
            "keys": {
                "completed": keys.completed,
                "in_flight": keys.reserved,
                "oldest": ts_opt(keys.oldest),
            },
        });
        if let (Some(v), Value::Object(rest)) = (v.as_object_mut(), rest) {
            v.extend(rest);
        }
        print_json(&v);
        return Ok(Outcome::Ok);
    }
    print_where(target, &file);
    out!("inboxes    {}", inboxes.len());
    for (name, n, oldest) in &inboxes {
        out!("  {name}: {n} keys, oldest seen {}", when_opt(*oldest, now));
    }
    let parts: Vec<String> = OutboxStatus::ALL
        .iter()
        .map(|st| format!("{} {}", counts.get(*st), st.as_str()))
        .collect();
    out!(
        "outbox     {} entries: {}",
        counts.total(),
        parts.join(", ")
    );
    out!("  oldest due    {}", when_opt(next_due, now));
    out!("  oldest claim  {}", when_opt(oldest_claim, now));
    out!(
        "keys       {} completed, {} in flight; oldest {}",
        keys.completed,
        keys.reserved,
        when_opt(keys.oldest, now)
    );
    Ok(Outcome::Ok)
}

/// Where `stats` read: a file's path, size, format and space, or a
/// server's connection string (its password hidden) and schema.
fn where_json(target: &Target, about: &Result<StoreStats, String>) -> Value {
    match about {
        Ok(s) => json!({
            "file": target.to_string(),
            "file_bytes": s.file_bytes,
            "format_version": s.format_version,
            "space": {
                "stored_bytes": s.stored_bytes,
                "metadata_bytes": s.metadata_bytes,
                "fragmented_bytes": s.fragmented_bytes,
                "allocated_pages": s.allocated_pages,
                "page_size": s.page_size,
                "tree_height": s.tree_height,
            },
        }),
        Err(schema) => json!({
            "postgres": target.to_string(),
            "schema": schema,
        }),
    }
}

/// [`where_json`] for people.
fn print_where(target: &Target, about: &Result<StoreStats, String>) {
    match about {
        Ok(s) => {
            out!("file       {target}");
            if let Some(n) = s.file_bytes {
                out!("size       {} ({n} bytes)", bytes(n));
            }
            out!("format     {}", s.format_version);
            out!(
                "space      {} stored, {} metadata, {} fragmented (compact can reclaim it); \
                 {} pages of {} B",
                bytes(s.stored_bytes),
                bytes(s.metadata_bytes),
                bytes(s.fragmented_bytes),
                s.allocated_pages,
                s.page_size,
            );
        }
        Err(schema) => {
            out!("postgres   {target}");
            out!("schema     {schema}");
        }
    }
}

fn inbox_list(
    store: &StoreHandle,
    name: &str,
    limit: usize,
    json: bool,
) -> Result<Outcome, Failure> {
    let inbox = store.inbox(name)?;
    let limit = limit_or_all(limit);
    let mut rows: Vec<(String, DateTime<Utc>)> = Vec::new();
    while rows.len() < limit {
        let after = rows.last().map(|(k, at)| (*at, k.as_str()));
        let page = inbox.list(after, PAGE.min(limit - rows.len()))?;
        if page.is_empty() {
            break;
        }
        rows.extend(page);
    }
    if json {
        let v: Vec<Value> = rows
            .iter()
            .map(|(k, at)| json!({"key": k, "seen_at": ts(*at)}))
            .collect();
        print_json(&Value::Array(v));
    } else {
        let now = Utc::now();
        for (k, at) in &rows {
            out!("{}  {k}", when(*at, now));
        }
        out!("{} of {} keys in inbox {name}", rows.len(), inbox.len()?);
    }
    Ok(Outcome::Ok)
}

fn outbox(c: &OutboxCommand, schema: Option<&str>, json: bool) -> Result<Outcome, Failure> {
    match c {
        OutboxCommand::List {
            store,
            status,
            destination,
            limit,
        } => {
            let mut filter = OutboxFilter::any();
            if let Some(s) = status {
                filter = filter.status((*s).into());
            }
            if let Some(d) = destination {
                filter = filter.destination(d.clone());
            }
            outbox_list(
                &open_outbox(store, schema)?,
                filter,
                limit_or_all(*limit),
                json,
            )
        }
        OutboxCommand::Show { store, id } => {
            let r = open_outbox(store, schema)?.get(OutboxId(*id))?;
            if json {
                print_json(&outbox_json(&r, true));
            } else {
                print_record(&r);
            }
            Ok(Outcome::Ok)
        }
        OutboxCommand::Retry { store, ids } => Ok(retry(&open_outbox(store, schema)?, ids, json)),
        OutboxCommand::Cancel { store, ids } => Ok(cancel(&open_outbox(store, schema)?, ids, json)),
        OutboxCommand::Resolve {
            store,
            id,
            failed,
            completed: _,
        } => resolve(
            &open_outbox(store, schema)?,
            OutboxId(*id),
            failed.as_deref(),
            json,
        ),
        OutboxCommand::Release {
            store,
            claimed_before,
        } => {
            let ids = open_outbox(store, schema)?.release_expired_claims(*claimed_before)?;
            let list: Vec<u64> = ids.iter().map(|i| i.0).collect();
            report(json, &json!({"released": list}), || {
                let shown: Vec<String> = list.iter().map(u64::to_string).collect();
                format!(
                    "released {} claims made before {} back to pending{}{}",
                    list.len(),
                    ts(*claimed_before),
                    if list.is_empty() { "" } else { ": " },
                    shown.join(" ")
                )
            })
        }
        OutboxCommand::Purge {
            store,
            finished_before,
        } => {
            let outbox = open_outbox(store, schema)?;
            let pb = spinner("purging finished outbox entries");
            let n = outbox.purge_finished(*finished_before)?;
            pb.finish_and_clear();
            report(
                json,
                &json!({"purged": n, "finished_before": ts(*finished_before)}),
                || {
                    format!(
                        "purged {n} completed or failed entries finished before {}",
                        ts(*finished_before)
                    )
                },
            )
        }
    }
}

fn outbox_list(
    outbox: &OutboxHandle,
    filter: OutboxFilter,
    limit: usize,
    json: bool,
) -> Result<Outcome, Failure> {
    let mut rows = Vec::new();
    let mut filter = filter;
    while rows.len() < limit {
        let page = outbox.list(&filter, PAGE.min(limit - rows.len()))?;
        let Some(last) = page.last() else { break };
        filter = filter.after(last.entry.id);
        rows.extend(page);
    }
    if json {
        print_json(&Value::Array(
            rows.iter().map(|r| outbox_json(r, false)).collect(),
        ));
        return Ok(Outcome::Ok);
    }
    out!(
        "{:>8}  {:<15}  {:>8}  {:<20}  {:<20}  {:<24}  IDEMPOTENCY KEY",
        "ID",
        "STATUS",
        "ATTEMPTS",
        "DUE/CLAIMED/FINISHED",
        "DESTINATION",
        "LAST REASON"
    );
    for r in &rows {
        let e = &r.entry;
        // Finished, claimed, or due: the time that matters in each status.
        let at = e
            .completed_at
            .or(r
                .claim
                .as_ref()
                .or(r.attempt_in_doubt.as_ref())
                .map(|c| c.claimed_at))
            .unwrap_or_else(|| e.due_at());
        out!(
            "{:>8}  {:<15}  {:>8}  {:<20}  {:<20}  {:<24}  {}",
            e.id.0,
            e.status.as_str(),
            e.attempt_count,
            at.format("%Y-%m-%dT%H:%M:%SZ"),
            e.destination,
            clip(last_reason(r).unwrap_or("-"), 24),
            e.idempotency_key
        );
    }
    out!("{} entries", rows.len());
    Ok(Outcome::Ok)
}

fn print_record(r: &idemstore::OutboxRecord) {
    let now = Utc::now();
    let e = &r.entry;
    out!("id               {}", e.id);
    out!("status           {}", e.status.as_str());
    out!("command          {}", e.command_id);
    out!("destination      {}", e.destination);
    out!("idempotency key  {}", e.idempotency_key);
    out!("attempts         {}", e.attempt_count);
    out!("created          {}", when(e.created_at, now));
    out!("next attempt     {}", when_opt(e.next_attempt_at, now));
    out!("finished         {}", when_opt(e.completed_at, now));
    match &r.claim {
        Some(c) => out!(
            "claim            {} at {}",
            c.worker_id,
            when(c.claimed_at, now)
        ),
        None => out!("claim            -"),
    }
    if let Some(c) = &r.attempt_in_doubt {
        out!(
            "in doubt         attempt by {} at {}",
            c.worker_id,
            when(c.claimed_at, now)
        );
    }
    out!(
        "last failure     {}",
        r.last_failure.as_deref().unwrap_or("-")
    );
    out!(
        "remote ref       {}",
        r.remote_ref.as_deref().unwrap_or("-")
    );
    out!("payload          {}", preview(&e.payload));
    if r.attempts.is_empty() {
        out!("history          -");
    } else {
        out!(
            "history          {} attempt records, oldest first (the last {} are kept)",
            r.attempts.len(),
            idemstore::MAX_ATTEMPT_HISTORY
        );
        for a in &r.attempts {
            let remote = a
                .remote_ref
                .as_deref()
                .map(|r| format!(" (remote ref {r})"))
                .unwrap_or_default();
            out!(
                "  attempt {:>4}  {}  {}{remote}",
                a.attempt,
                when(a.at, now),
                a.reason
            );
        }
    }
}

/// `s` cut to `max` characters, the cut shown by `…`.
fn clip(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_owned();
    }
    let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

fn cancel(outbox: &OutboxHandle, ids: &[u64], json: bool) -> Outcome {
    let now = Utc::now();
    let mut done = Vec::new();
    let mut failed = Vec::new();
    for &id in ids {
        let attempt = outbox
            .get(OutboxId(id))
            .and_then(|before| outbox.cancel(OutboxId(id), now).map(|()| before));
        match attempt {
            Ok(before) => {
                let was = before.entry.status;
                let already = was == OutboxStatus::Failed;
                if !json {
                    if already {
                        out!("{id}: already cancelled");
                    } else {
                        out!("{id}: {} -> failed (cancelled)", was.as_str());
                    }
                }
                done.push(json!({"id": id, "was": was.as_str(), "already": already}));
            }
            Err(e) => {
                eprintln!("idemstore: error: entry {id}: {e}");
                failed.push(json!({"id": id, "error": e.to_string()}));
            }
        }
    }
    if json {
        print_json(&json!({"cancelled": done, "failed": failed, "at": ts(now)}));
    } else {
        out!("cancelled {} of {} entries", done.len(), ids.len());
    }
    if failed.is_empty() {
        Outcome::Ok
    } else {
        Outcome::Findings
    }
}

fn retry(outbox: &OutboxHandle, ids: &[u64], json: bool) -> Outcome {
    let now = Utc::now();
    let mut done = Vec::new();
    let mut failed = Vec::new();
    for &id in ids {
        let attempt = outbox.get(OutboxId(id)).and_then(|before| {
            outbox
                .requeue(OutboxId(id), now)
                .map(|()| before.entry.status)
        });
        match attempt {
            Ok(was) => {
                if !json {
                    out!("{id}: {} -> pending, due now", was.as_str());
                }
                done.push(json!({"id": id, "was": was.as_str()}));
            }
            Err(e) => {
                eprintln!("idemstore: error: entry {id}: {e}");
                failed.push(json!({"id": id, "error": e.to_string()}));
            }
        }
    }
    if json {
        print_json(&json!({"requeued": done, "failed": failed, "due": ts(now)}));
    } else {
        out!("requeued {} of {} entries", done.len(), ids.len());
    }
    if failed.is_empty() {
        Outcome::Ok
    } else {
        Outcome::Findings
    }
}

fn resolve(
    outbox: &OutboxHandle,
    id: OutboxId,
    failed: Option<&str>,
    json: bool,
) -> Result<Outcome, Failure> {
    let before = outbox.get(id)?;
    if before.entry.status != OutboxStatus::OutcomeUnknown {
        return Err(Failure(format!(
            "entry {id} is {}, not outcome_unknown; resolve settles only entries whose \
             outcome is unknown (use retry for failed ones)",
            before.entry.status.as_str()
        )));
    }
    let now = Utc::now();
    match failed {
        Some(reason) => outbox.mark_failed(id, reason, None, now)?,
        None => outbox.mark_completed(id, now)?,
    }
    let to = if failed.is_some() {
        OutboxStatus::Failed
    } else {
        OutboxStatus::Completed
    };
    report(
        json,
        &json!({"id": id.0, "was": before.entry.status.as_str(), "now": to.as_str(),
                "reason": failed, "finished_at": ts(now)}),
        || {
            let why = failed.map(|r| format!(" ({r})")).unwrap_or_default();
            format!("{id}: outcome_unknown -> {}{why}", to.as_str())
        },
    )
}

fn keys_list(
    keys: &KeysHandle,
    tenant: Option<&str>,
    limit: usize,
    json: bool,
) -> Result<Outcome, Failure> {
    let rows = keys.list(tenant, limit_or_all(limit))?;
    if json {
        print_json(&Value::Array(
            rows.iter().map(|k| key_json(k, None)).collect(),
        ));
        return Ok(Outcome::Ok);
    }
    let now = Utc::now();
    for k in &rows {
        let state = match &k.state {
            KeyState::Completed {
                status,
                body_len,
                created_at,
            } => format!(
                "completed {status}, {body_len} B body, stored {}",
                when(*created_at, now)
            ),
            KeyState::Reserved { lease_until, .. } => {
                format!("in flight, lease until {}", when(*lease_until, now))
            }
        };
        out!("{:?} {:?}: {state}", k.tenant, k.key);
    }
    out!("{} keys", rows.len());
    Ok(Outcome::Ok)
}

/// Copies the whole file, as one moment of it, beside the processes that
/// have it open shared.
fn backup(file: &Path, to: &Path, json: bool) -> Result<Outcome, Failure> {
    let store = open(file)?;
    let pb = spinner("copying");
    let len = store.backup(to)?;
    pb.finish_and_clear();
    report(
        json,
        &json!({"file": file.display().to_string(), "to": to.display().to_string(), "bytes": len}),
        || {
            format!(
                "copied {} to {} ({})",
                file.display(),
                to.display(),
                bytes(len)
            )
        },
    )
}

/// Compacts the file with no other process beside it: redb refuses to
/// compact while another process reads (a running program reads all the
/// time), and a compaction beside others would hold the writer of every
/// process until it ended.
fn compact(file: &Path, json: bool) -> Result<Outcome, Failure> {
    let store = open_alone(file)?;
    let before = size(file)?;
    let pb = spinner("compacting");
    let compacted = store.compact()?;
    pb.finish_and_clear();
    drop(store);
    let after = size(file)?;
    report(
        json,
        &json!({"compacted": compacted, "bytes_before": before, "bytes_after": after}),
        || {
            if compacted {
                format!(
                    "compacted {}: {} -> {}",
                    file.display(),
                    bytes(before),
                    bytes(after)
                )
            } else {
                format!(
                    "nothing to compact in {} ({})",
                    file.display(),
                    bytes(before)
                )
            }
        },
    )
}

/// The size of `file` in bytes; a failure names the file.
fn size(file: &Path) -> Result<u64, Failure> {
    std::fs::metadata(file)
        .map(|m| m.len())
        .map_err(|e| Failure(format!("{}: {e}", file.display())))
}

fn check(target: &Target, schema: Option<&str>, json: bool) -> Result<Outcome, Failure> {
    let store = open_store(target, schema)?;
    let pb = spinner("checking");
    let mut findings: Vec<(&str, String)> = Vec::new();
    // Only a file has an engine and inbox indexes of its own to check.
    #[cfg_attr(
        not(feature = "postgres"),
        expect(
            irrefutable_let_patterns,
            reason = "a build without the server's store"
        )
    )]
    if let StoreHandle::File(file) = &store {
        pb.set_message("checking the engine's integrity");
        if !file.check_integrity()? {
            findings.push((
                "engine",
                "redb's integrity check failed (the engine repaired its allocator state)".into(),
            ));
        }
        pb.set_message("checking inbox indexes");
        findings.extend(
            file.check_inbox_indexes()?
                .into_iter()
                .map(|f| ("inbox", f)),
        );
    }
    pb.set_message("checking outbox indexes");
    findings.extend(
        store
            .outbox()
            .check_indexes()?
            .into_iter()
            .map(|f| ("outbox", f)),
    );
    pb.set_message("checking idempotency key indexes");
    findings.extend(
        store
            .keys()
            .check_indexes()?
            .into_iter()
            .map(|f| ("keys", f)),
    );
    pb.finish_and_clear();
    if json {
        let v: Vec<Value> = findings
            .iter()
            .map(|(part, f)| json!({"part": part, "finding": f}))
            .collect();
        print_json(&json!({"ok": findings.is_empty(), "findings": v}));
    } else if findings.is_empty() {
        let what = match store {
            StoreHandle::File(_) => {
                "passed the integrity check and every index agrees with its rows"
            }
            #[cfg(feature = "postgres")]
            StoreHandle::Postgres(_) => {
                "holds the rows the store wrote (the server keeps its own indexes)"
            }
        };
        out!("ok: {target} {what}");
    } else {
        for (part, f) in &findings {
            out!("{part}: {f}");
        }
        out!("{} findings in {target}", findings.len());
    }
    Ok(if findings.is_empty() {
        Outcome::Ok
    } else {
        Outcome::Findings
    })
}
