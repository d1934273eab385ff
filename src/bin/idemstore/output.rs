//! Rendering for people and for scripts, and progress on a terminal.

use std::io::IsTerminal as _;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use chrono::{DateTime, SecondsFormat, Utc};
use idemstore::{AttemptRecord, KeyEntry, KeyState, OutboxClaim, OutboxRecord, ResponseRecord};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};

use crate::Failure;

/// An instant for scripts: RFC 3339 with microseconds (the store's
/// precision), so it reads back exactly.
pub(crate) fn ts(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// An optional instant for scripts.
pub(crate) fn ts_opt(t: Option<DateTime<Utc>>) -> Value {
    t.map_or(Value::Null, |t| Value::String(ts(t)))
}

/// An instant for people: to the second, with its age.
pub(crate) fn when(t: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let secs = (now - t).num_seconds();
    let text = t.to_rfc3339_opts(SecondsFormat::Secs, true);
    if secs >= 0 {
        format!("{text} ({} ago)", age(secs.unsigned_abs()))
    } else {
        format!("{text} (in {})", age(secs.unsigned_abs()))
    }
}

/// An optional instant for people.
pub(crate) fn when_opt(t: Option<DateTime<Utc>>, now: DateTime<Utc>) -> String {
    t.map_or_else(|| "-".to_owned(), |t| when(t, now))
}

/// A duration in the largest two units: `3d 4h`, `12m 5s`.
fn age(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86_400, secs / 3_600 % 24, secs / 60 % 60, secs % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m {s}s"),
        (0, _, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

/// A byte count for people: `1.5 MiB`.
pub(crate) fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut units = UNITS.iter();
    let mut unit = units.next();
    while v >= 1024.0 {
        let Some(bigger) = units.next() else { break };
        v /= 1024.0;
        unit = Some(bigger);
    }
    match unit {
        Some(&u) if u != "B" => format!("{v:.1} {u}"),
        _ => format!("{n} B"),
    }
}

/// Bytes as base64, for JSON.
pub(crate) fn b64(data: &[u8]) -> String {
    BASE64.encode(data)
}

/// A payload for people: the text if it is short UTF-8, else its size.
pub(crate) fn preview(data: &[u8]) -> String {
    match std::str::from_utf8(data) {
        Ok(s) if s.chars().all(|c| !c.is_control() || c == '\n') => {
            let short: String = s.chars().take(200).collect();
            let more = if short.len() < s.len() { "…" } else { "" };
            format!("{} bytes: {short:?}{more}", data.len())
        }
        _ => format!("{} bytes (binary; base64 with --json)", data.len()),
    }
}

/// Why the entry's latest attempt did not complete it: the reason of its
/// latest attempt record (`max_attempts (http_500)`, `cancelled`), else its
/// `last_failure` (records settled before histories were kept).
pub(crate) fn last_reason(r: &OutboxRecord) -> Option<&str> {
    r.attempts
        .last()
        .map(|a| a.reason.as_str())
        .or(r.last_failure.as_deref())
}

/// An outbox record as one JSON object, with the reason of its latest
/// attempt; whole (payload in base64, every attempt record) if asked.
pub(crate) fn outbox_json(r: &OutboxRecord, whole: bool) -> Value {
    let e = &r.entry;
    let mut v = json!({
        "id": e.id.0,
        "command_id": e.command_id,
        "destination": e.destination,
        "idempotency_key": e.idempotency_key,
        "status": e.status.as_str(),
        "attempt_count": e.attempt_count,
        "next_attempt_at": ts_opt(e.next_attempt_at),
        "created_at": ts(e.created_at),
        "completed_at": ts_opt(e.completed_at),
        "claim": r.claim.as_ref().map(claim_json),
        "attempt_in_doubt": r.attempt_in_doubt.as_ref().map(claim_json),
        "last_failure": r.last_failure,
        "remote_ref": r.remote_ref,
        "last_reason": last_reason(r),
        "payload_len": e.payload.len(),
    });
    if whole {
        put(&mut v, "payload", Value::String(b64(&e.payload)));
        let attempts = r.attempts.iter().map(attempt_json).collect();
        put(&mut v, "attempts", Value::Array(attempts));
    }
    v
}

/// One attempt record as one JSON object.
fn attempt_json(a: &AttemptRecord) -> Value {
    json!({
        "attempt": a.attempt,
        "at": ts(a.at),
        "reason": a.reason,
        "remote_ref": a.remote_ref,
    })
}

/// Sets `key` in the JSON object `v` (which every caller builds with
/// `json!({..})`).
pub(crate) fn put(v: &mut Value, key: &str, value: Value) {
    if let Value::Object(fields) = v {
        fields.insert(key.to_owned(), value);
    }
}

/// Who claimed an attempt and when, as one JSON object: the claim of a
/// dispatching entry, or the attempt an outcome-unknown entry is in doubt
/// about.
fn claim_json(c: &OutboxClaim) -> Value {
    json!({
        "worker_id": c.worker_id,
        "claimed_at": ts(c.claimed_at),
    })
}

/// An idempotency-key row as one JSON object; with the stored response
/// (headers and body in base64) when given.
pub(crate) fn key_json(k: &KeyEntry, response: Option<&ResponseRecord>) -> Value {
    let mut v = json!({
        "tenant": k.tenant,
        "key": k.key,
        "fingerprint": k.fingerprint,
        "fence": k.fence,
    });
    match &k.state {
        KeyState::Completed {
            status,
            body_len,
            created_at,
        } => {
            put(&mut v, "state", json!("completed"));
            put(&mut v, "response_status", json!(status));
            put(&mut v, "body_len", json!(body_len));
            put(&mut v, "created_at", json!(ts(*created_at)));
        }
        KeyState::Reserved {
            reserved_at,
            lease_until,
        } => {
            put(&mut v, "state", json!("reserved"));
            put(&mut v, "reserved_at", json!(ts(*reserved_at)));
            put(&mut v, "lease_until", json!(ts(*lease_until)));
        }
    }
    if let Some(r) = response {
        put(&mut v, "content_type", json!(r.content_type));
        put(&mut v, "headers", json!(r.headers));
        put(&mut v, "body", json!(b64(&r.response_body)));
    }
    v
}

/// Prints one JSON value on stdout.
pub(crate) fn print_json(v: &Value) {
    line(format_args!("{v:#}"));
}

/// What became of stdout: [`OPEN`], [`GONE`] or [`FAILED`].
static STDOUT: AtomicU8 = AtomicU8::new(OPEN);
/// Lines are written.
const OPEN: u8 = 0;
/// Its reader went away (`idemstore … | head`): lines are dropped.
const GONE: u8 = 1;
/// A write failed otherwise (said on stderr): lines are dropped, and the
/// command exits 1 once done ([`stdout_failed`]).
const FAILED: u8 = 2;

/// Writes one line on stdout.
///
/// One rule for a stdout that cannot be written: output stops, the command
/// does not. A reader that went away (`idemstore … | head`) is not a
/// failure: further lines are dropped, and the command finishes its work
/// and exits with what that came to (a `cancel` of 50 ids cancels all 50; a
/// `check` with findings exits 1). Any other failure to write is said once
/// on stderr, further lines are dropped, and the command exits 1 once its
/// work is done. `export` alone stops early ([`write_record`]): it only
/// reads, and reading on for nobody is pointless.
pub(crate) fn line(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    if STDOUT.load(Ordering::Relaxed) != OPEN {
        return;
    }
    if let Err(e) = writeln!(std::io::stdout().lock(), "{args}")
        && !reader_gone(&e)
    {
        STDOUT.store(FAILED, Ordering::Relaxed);
        eprintln!("idemstore: error: writing to stdout: {e}");
    }
}

/// Whether `e`, from a write to stdout, says that its reader went away;
/// if so, notes it.
fn reader_gone(e: &std::io::Error) -> bool {
    let gone = e.kind() == std::io::ErrorKind::BrokenPipe;
    if gone {
        STDOUT.store(GONE, Ordering::Relaxed);
    }
    gone
}

/// Whether a write to stdout failed other than by its reader going away:
/// the output is incomplete, and the command exits 1.
pub(crate) fn stdout_failed() -> bool {
    STDOUT.load(Ordering::Relaxed) == FAILED
}

/// Writes `v` as one line on `out` (stdout, buffered) for `export`, or
/// flushes `out` when `v` is `None`. `Ok(false)` once stdout's reader has
/// gone away: the export stops there and exits 0 (see [`line`]).
pub(crate) fn write_record(
    out: &mut impl std::io::Write,
    v: Option<&Value>,
) -> Result<bool, Failure> {
    let written = match v {
        Some(v) => writeln!(out, "{v}"),
        None => out.flush(),
    };
    match written {
        Ok(()) => Ok(true),
        Err(e) if reader_gone(&e) => Ok(false),
        Err(e) => Err(Failure(format!("writing to stdout: {e}"))),
    }
}

/// `println!` through [`line`].
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::output::line(format_args!($($arg)*))
    };
}
pub(crate) use out;

/// A spinner on stderr while a long call runs; hidden when stderr is not a
/// terminal (piped, in scripts and tests).
pub(crate) fn spinner(message: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new_spinner();
    pb.set_message(message.to_owned());
    pb.enable_steady_tick(Duration::from_millis(100));
    pb
}

/// A progress bar on stderr over `len` items; hidden when stderr is not a
/// terminal.
pub(crate) fn bar(len: u64, message: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    if let Ok(style) =
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} ({per_sec}, {eta} left)")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(message.to_owned());
    pb
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_ages_read_well() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 * 1024 * 1024), "3.0 MiB");
        assert_eq!(age(5), "5s");
        assert_eq!(age(65), "1m 5s");
        assert_eq!(age(3_700), "1h 1m");
        assert_eq!(age(90_000), "1d 1h");
    }
}
