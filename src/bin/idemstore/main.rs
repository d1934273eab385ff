//! `idemstore`: the operator's tool for an idemstore file.
//!
//! Inspect a store (`stats`, `inbox list`, `outbox list|show`, `keys list`,
//! `destinations`), repair by hand (`outbox retry|resolve|release|cancel`),
//! steer the dispatchers (`destination pause|resume|set`), reclaim space
//! (`inbox prune`, `outbox purge`, `keys purge`, `compact`), verify it
//! (`check`) and back it up (`export --jsonl`). Output is for people by default and JSON
//! with `--json`. Exit codes: 0 ok, 1 findings or a failed operation, 2 bad
//! usage. Every command but `compact` and `migrate` also works on a
//! PostgreSQL store, given its connection string (and `--schema`) in place
//! of the file (`target.rs`, `handle.rs`).
//!
//! Every command but `compact` opens the file shared between processes
//! (`StoreBuilder::shared(true)`): it works on a file nobody has open, and
//! beside a running program that opened the file shared too, whose commits it
//! sees and which sees its own. A program that opened the file alone (the
//! default) holds it exclusively, and the message says how to share it.
//! `compact` rewrites the whole file, which redb refuses while another process
//! reads it and which would stall every other process's writes meanwhile: it
//! opens the file alone, and says so when another process has it open.

// An operator tool reports bad files and bad arguments; it does not panic.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
// `println!` panics when stdout's reader has gone away: output goes through
// `out!` and `print_json` (`output::line`), which say what happens then.
#![deny(clippy::print_stdout)]

mod commands;
mod destinations;
mod export;
mod handle;
mod migrate;
mod output;
mod schedules;
mod serve;
mod target;
mod time;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use chrono::{DateTime, Utc};
use clap::{ArgGroup, Parser, Subcommand, ValueEnum};
use idemstore::{Error, OutboxStatus, Store};

use crate::target::Target;

/// Inspect, repair and back up an idemstore file.
///
/// TIME is RFC 3339 (2025-01-31T12:00:00Z) or an age meaning now minus that:
/// 7d, 24h, 30m, 45s (or combined, 1d12h). DURATION is a number and a unit:
/// 500ms, 30s, 5m, 1h, 1d (or combined, 1m30s).
///
/// A running program's store: every command but compact works beside a
/// program that opened the file with `StoreBuilder::shared(true)`, reading what
/// it committed and writing what it will see. A program that opened the file
/// alone (the default) holds it exclusively: open it shared there, or stop
/// the program first. compact needs the file to itself.
///
/// STORE is a store file, or a PostgreSQL store's connection string: a
/// postgres:// URL or libpq key=value pairs (with --schema if its schema is
/// not idemstore). Every command but compact and migrate takes either.
///
/// Exit codes: 0 ok, 1 findings (check) or a failed operation, 2 bad usage.
#[derive(Debug, Parser)]
#[command(name = "idemstore", version, about, long_about)]
pub(crate) struct Cli {
    /// Print JSON for scripts instead of text for people.
    #[arg(long, global = true)]
    pub(crate) json: bool,
    /// The schema of a PostgreSQL store: the store a command works on, or
    /// the one migrate copies into (created if absent). Default: idemstore.
    #[arg(long, global = true, value_name = "SCHEMA")]
    pub(crate) schema: Option<String>,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// File size, format, space, and what each inbox, the outbox and the
    /// idempotency keys hold.
    Stats {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
    },
    /// Inbox ledgers.
    #[command(subcommand)]
    Inbox(InboxCommand),
    /// The outbox.
    #[command(subcommand)]
    Outbox(OutboxCommand),
    /// HTTP idempotency keys.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Every destination with an entry, a policy or a pause: its policy,
    /// pause, circuit, hold, entries in flight and entries by status.
    Destinations {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
    },
    /// Pause, resume or set the policy of one destination (every
    /// dispatcher on the file follows it from its next claim).
    #[command(subcommand)]
    Destination(DestinationCommand),
    /// Every schedule of the outbox: its destination, expression, missed-
    /// slot policy, pause, next slot and the last slot fired.
    Schedules {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
    },
    /// Pause, resume or remove one schedule (every dispatcher follows it).
    #[command(subcommand)]
    Schedule(ScheduleCommand),
    /// Serve the operator console of a store on HTTP until interrupted
    /// (Ctrl-C): its outbox by status and destination, each entry, its
    /// inboxes and idempotency keys, and, with --allow-writes, retry,
    /// cancel and resolve entries and release stuck reservations. Needs a
    /// build with the `console` feature.
    ///
    /// It listens on loopback unless told otherwise, and refuses an address
    /// other machines can reach without --token-file.
    Console {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// The address to listen on (port 0: any free port, printed).
        #[arg(long, default_value = "127.0.0.1:8080", value_name = "ADDR")]
        listen: std::net::SocketAddr,
        /// Offer and accept the actions (retry, cancel, resolve, release a
        /// reservation).
        #[arg(long)]
        allow_writes: bool,
        /// Every request must carry this file's first line as
        /// `Authorization: Bearer TOKEN` (at least 16 characters).
        #[arg(long, value_name = "FILE")]
        token_file: Option<PathBuf>,
    },
    /// Copy the whole store file, every table in it (the program's own
    /// included), as one moment of the store, beside a running program that
    /// opened it shared.
    ///
    /// The program's writes wait while the file is copied. The copy is
    /// written under a temporary name and renamed to TO, which must not
    /// exist. A program that holds the file alone (the default) makes its
    /// own backups with `Store::backup`.
    Backup {
        /// The store file.
        #[arg(value_name = "FILE", value_parser = Target::parse)]
        file: Target,
        /// Where the copy goes: a new file.
        #[arg(long, value_name = "TO")]
        to: PathBuf,
    },
    /// Rewrite the file to return free space to the file system.
    ///
    /// Needs the file to itself: stop every program that has it open first.
    Compact {
        /// The store file.
        #[arg(value_name = "FILE", value_parser = Target::parse)]
        file: Target,
    },
    /// Check the engine's integrity and that every index agrees with its
    /// rows; exit 1 on any finding.
    Check {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
    },
    /// Write the store's own records as JSON lines on stdout (inbox keys,
    /// outbox entries, idempotency records; payloads and bodies in base64),
    /// for inspection, debugging and moving data.
    ///
    /// It holds the store's records only, not the program's own tables in
    /// the same file (use `backup` for the whole file). Records are read a
    /// thousand at a time: beside a running program, what it writes
    /// meanwhile may or may not be in the export.
    Export {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// One JSON object per line (the only format).
        #[arg(long, required = true)]
        jsonl: bool,
    },
    /// Copy a store's inboxes, outbox records and idempotency records into
    /// PostgreSQL, for `idemstore::postgres::PgStore`.
    ///
    /// Copies every inbox key with its time, every outbox record (any
    /// status, with its id, claim and attempt history) and every
    /// idempotency record (responses, and reservations with their fences),
    /// in batches of one transaction each, and moves the server's id and
    /// fence sequences past every one the file handed out (ids and fences
    /// are never reused). Running it again copies nothing twice: a row an
    /// earlier run copied is left alone. A record whose id or key a
    /// different row on the server holds is not copied: it is counted and
    /// named on stderr, and the command exits 1. Copy into a new schema, or
    /// one that holds only rows from this file. Prints the counts on both
    /// sides. The schema is --schema's. Needs a build with the `postgres`
    /// feature.
    ///
    /// Stop the program that writes the file first (or what it writes
    /// meanwhile may or may not be copied).
    Migrate {
        /// The store file.
        #[arg(value_name = "FILE", value_parser = Target::parse)]
        file: Target,
        /// The server: a libpq connection string or URL
        /// (host=/run/postgresql user=app dbname=app).
        #[arg(long = "to-postgres", value_name = "URL")]
        to_postgres: String,
        /// Rows per transaction.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
        batch: u32,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum InboxCommand {
    /// The keys of an inbox, oldest first.
    List {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// The inbox's name.
        name: String,
        /// At most this many keys (0: all).
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Forget the keys of an inbox seen before TIME.
    Prune {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// The inbox's name.
        name: String,
        /// Remove keys seen strictly before this TIME.
        #[arg(long, value_parser = time::parse_time)]
        before: DateTime<Utc>,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum OutboxCommand {
    /// Entries by id, optionally of one status or destination, each with
    /// the reason of its latest attempt record.
    List {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// Only entries in this status.
        #[arg(long, value_enum)]
        status: Option<StatusArg>,
        /// Only entries for this destination.
        #[arg(long)]
        destination: Option<String>,
        /// At most this many entries (0: all).
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// One entry in full, with its attempt history.
    Show {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// The entry's id.
        id: u64,
    },
    /// Move failed or outcome-unknown entries back to pending, due now.
    Retry {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// The entries' ids.
        #[arg(required = true)]
        ids: Vec<u64>,
    },
    /// Cancel pending or outcome-unknown entries: failed with the reason
    /// `cancelled`, never sent (again). An entry being dispatched must be
    /// settled first.
    Cancel {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// The entries' ids.
        #[arg(required = true)]
        ids: Vec<u64>,
    },
    /// Settle an outcome-unknown entry after reconciling it by hand.
    #[command(group(ArgGroup::new("outcome").required(true).args(["completed", "failed"])))]
    Resolve {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// The entry's id.
        id: u64,
        /// The effect happened: mark it Completed.
        #[arg(long)]
        completed: bool,
        /// The effect did not happen: mark it Failed with this reason code.
        #[arg(long, value_name = "REASON")]
        failed: Option<String>,
    },
    /// Release Dispatching entries claimed before TIME back to Pending (their
    /// dispatcher died).
    Release {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// Release claims made strictly before this TIME.
        #[arg(long, value_parser = time::parse_time)]
        claimed_before: DateTime<Utc>,
    },
    /// Delete Completed and Failed entries finished before TIME.
    Purge {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// Delete entries finished strictly before this TIME.
        #[arg(long, value_parser = time::parse_time)]
        finished_before: DateTime<Utc>,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum KeysCommand {
    /// Stored responses and reservations, by tenant and key.
    List {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// Only this tenant's keys ("" is the default tenant).
        #[arg(long)]
        tenant: Option<String>,
        /// At most this many keys (0: all).
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Delete records created before TIME (reservations once their lease
    /// has ended too).
    Purge {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// Delete records created strictly before this TIME.
        #[arg(long, value_parser = time::parse_time)]
        before: DateTime<Utc>,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum ScheduleCommand {
    /// Stop the schedule from firing (its slots meanwhile are dealt with
    /// by its missed-slot policy once it is resumed).
    Pause {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// The schedule's name.
        name: String,
    },
    /// Let a paused schedule fire again.
    Resume {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// The schedule's name.
        name: String,
    },
    /// Remove the schedule; the entries it enqueued stay.
    Remove {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// The schedule's name.
        name: String,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum DestinationCommand {
    /// Stop claiming the destination's entries (those in flight finish).
    Pause {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// The destination.
        name: String,
    },
    /// Let a paused destination's entries be claimed again.
    Resume {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// The destination.
        name: String,
    },
    /// Replace the destination's policy with the limits given (a limit not
    /// given is removed); --clear removes them all.
    #[command(group(
        ArgGroup::new("limits")
            .required(true)
            .multiple(true)
            .args(["max_in_flight", "rate", "circuit", "weight", "clear"])
    ))]
    Set {
        /// The store: a file, or a PostgreSQL connection string.
        #[arg(value_name = "STORE", value_parser = Target::parse)]
        store: Target,
        /// The destination.
        name: String,
        /// At most N entries dispatching at once, across every dispatcher.
        #[arg(long, value_name = "N")]
        max_in_flight: Option<u32>,
        /// At most this many claims per second on average (with --burst).
        #[arg(long, value_name = "PER_SECOND", requires = "burst")]
        rate: Option<f64>,
        /// At most B claims at once (the rate limit's bucket).
        #[arg(long, value_name = "B", requires = "rate")]
        burst: Option<u32>,
        /// Hold the destination back after K retryable failures in a row
        /// (with --cool-down).
        #[arg(long, value_name = "K", requires = "cool_down")]
        circuit: Option<u32>,
        /// How long the circuit holds it back before one probe (doubling
        /// after each failed probe).
        #[arg(long, value_name = "DURATION", requires = "circuit", value_parser = time::parse_duration)]
        cool_down: Option<std::time::Duration>,
        /// Its share of each dispatcher's workers while other destinations
        /// are busy too, against their weights (default 1).
        #[arg(long, value_name = "W")]
        weight: Option<u32>,
        /// No limits at all.
        #[arg(long, conflicts_with_all = ["max_in_flight", "rate", "burst", "circuit", "cool_down", "weight"])]
        clear: bool,
    },
}

/// An outbox status on the command line.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum StatusArg {
    Pending,
    Dispatching,
    Completed,
    Failed,
    #[value(alias = "outcome_unknown", alias = "unknown")]
    OutcomeUnknown,
}

impl From<StatusArg> for OutboxStatus {
    fn from(s: StatusArg) -> Self {
        match s {
            StatusArg::Pending => OutboxStatus::Pending,
            StatusArg::Dispatching => OutboxStatus::Dispatching,
            StatusArg::Completed => OutboxStatus::Completed,
            StatusArg::Failed => OutboxStatus::Failed,
            StatusArg::OutcomeUnknown => OutboxStatus::OutcomeUnknown,
        }
    }
}

/// Why a command failed, as told on stderr.
#[derive(Debug)]
pub(crate) struct Failure(pub(crate) String);

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        match e {
            // The commands open the file shared: its holder has it alone.
            Error::AlreadyOpen { path, shared: true } => Failure(format!(
                "{} is held exclusively by another process: a program opened it alone \
                 (the default). To run this command beside it, open the store in that \
                 program with StoreBuilder::shared(true) (every process that uses the file \
                 must then open it shared); or stop the program and run this command again",
                path.display()
            )),
            Error::AlreadyOpen {
                path,
                shared: false,
            } => Failure(format!(
                "{} is open in another process; this command needs the file to itself: stop \
                 every program that has it open and run this command again",
                path.display()
            )),
            other => Failure(other.to_string()),
        }
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Self {
        Failure(format!("I/O error: {e}"))
    }
}

/// What a command ended with, when it did not fail.
pub(crate) enum Outcome {
    /// Everything as asked.
    Ok,
    /// The command ran but found problems (check), some items failed
    /// (retry, cancel) or some rows were not copied (migrate): exit 1.
    Findings,
}

/// Opens an existing store file, shared with any other process that opened
/// it shared (a running program); never creates one.
pub(crate) fn open(file: &Path) -> Result<Store, Failure> {
    open_or(file, Failure::from)
}

/// Opens an existing store file as [`open`] does, telling why it could not
/// through `failure` (for a command with its own advice).
pub(crate) fn open_or(
    file: &Path,
    failure: impl FnOnce(Error) -> Failure,
) -> Result<Store, Failure> {
    must_exist(file)?;
    Store::builder().shared(true).open(file).map_err(failure)
}

/// Opens an existing store file for this process alone, for a command that
/// needs the file to itself (`compact`); never creates one.
pub(crate) fn open_alone(file: &Path) -> Result<Store, Failure> {
    must_exist(file)?;
    Ok(Store::open(file)?)
}

/// Refuses a file that is not there, and an empty one: the store would
/// make either a new store file, and a command that reads would then have
/// written one.
fn must_exist(file: &Path) -> Result<(), Failure> {
    match std::fs::metadata(file) {
        Ok(m) if m.is_file() && m.len() == 0 => Err(Failure(format!(
            "{}: empty file, not a store file (idemstore opens existing store files only)",
            file.display()
        ))),
        _ if file.exists() => Ok(()),
        _ => Err(Failure(format!(
            "{}: no such file (idemstore opens existing store files only)",
            file.display()
        ))),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match commands::run(&cli) {
        // Its output was lost (said on stderr): not all went as asked.
        Ok(_) if output::stdout_failed() => ExitCode::FAILURE,
        Ok(Outcome::Ok) => ExitCode::SUCCESS,
        Ok(Outcome::Findings) => ExitCode::FAILURE,
        Err(Failure(message)) => {
            eprintln!("idemstore: error: {message}");
            ExitCode::FAILURE
        }
    }
}
