//! `idemstore migrate FILE --to-postgres URL`: a store file's rows into
//! PostgreSQL.
//!
//! The copy is the library's, `idemstore::migrate::to_postgres`: it reads
//! the file page by page and writes each page in one transaction,
//! inserting with `ON CONFLICT DO NOTHING` and keeping outbox ids and
//! fences as they are, then counts both sides. This command opens the file
//! and the server, shows the progress, and prints the report: a record
//! whose id or key a different row holds is a conflict, named on stderr,
//! and the command exits 1.

use std::path::Path;

use crate::{Failure, Outcome};

#[cfg(not(feature = "postgres"))]
pub(crate) fn run(
    _file: &Path,
    _url: &str,
    _schema: Option<&str>,
    _batch: u32,
    _json: bool,
) -> Result<Outcome, Failure> {
    Err(Failure(
        "this idemstore was built without PostgreSQL support; install it with \
         `cargo install idemstore --features cli,postgres`"
            .into(),
    ))
}

#[cfg(feature = "postgres")]
pub(crate) use with_postgres::run;

#[cfg(feature = "postgres")]
mod with_postgres {
    use super::{Failure, Outcome, Path};

    use idemstore::Error;
    use idemstore::migrate::{self, MigrateOptions, MigrationReport, Tally};
    use idemstore::postgres::PgStore;
    use serde_json::json;

    use crate::open_or;
    use crate::output::{bar, out, print_json};

    /// A kind's counts, in `--json`.
    fn tally_json<C>(t: &Tally<C>) -> serde_json::Value {
        json!({
            "source": t.source,
            "target": t.target,
            "copied": t.copied,
            "conflicts": t.conflicts,
        })
    }

    /// `(N copied)`, with the conflicts when there are any.
    fn copied_text<C>(t: &Tally<C>) -> String {
        if t.conflicts == 0 {
            format!("({} copied)", t.copied)
        } else {
            format!(
                "({} copied, {} conflicting rows not copied)",
                t.copied, t.conflicts
            )
        }
    }

    /// Names the conflicting records of kind `what` on stderr, each as
    /// `name` writes it.
    fn tell_conflicts<C>(t: &Tally<C>, what: &str, schema: &str, name: impl Fn(&C) -> String) {
        if t.conflicts == 0 {
            return;
        }
        let more = if t.conflicts > t.conflicting.len() as u64 {
            ", …"
        } else {
            ""
        };
        let named: Vec<String> = t.conflicting.iter().map(name).collect();
        eprintln!(
            "idemstore: error: {} {what} not copied: schema {schema} holds different rows \
             with their ids or keys ({}{more})",
            t.conflicts,
            named.join(", ")
        );
    }

    /// Prints the report on stdout and the conflicts on stderr; `Findings`
    /// if there were any.
    fn print(report: &MigrationReport, file: &Path, schema: &str, json: bool) -> Outcome {
        let MigrationReport {
            inboxes,
            outbox,
            idempotency_keys: keys,
            destinations,
            schedules,
            ..
        } = report;
        if json {
            print_json(&json!({
                "file": file.display().to_string(),
                "schema": schema,
                "inboxes": {
                    "names": inboxes.inboxes,
                    "source": inboxes.source,
                    "target": inboxes.target,
                    "copied": inboxes.copied,
                },
                "outbox": tally_json(outbox),
                "idempotency_keys": tally_json(keys),
                "destinations": { "copied": destinations },
                "schedules": { "copied": schedules },
            }));
        } else {
            out!("{} → PostgreSQL schema {schema}", file.display());
            out!(
                "inboxes: {} keys in {} inboxes → {} rows ({} copied)",
                inboxes.source,
                inboxes.inboxes,
                inboxes.target,
                inboxes.copied
            );
            out!(
                "outbox: {} records → {} rows {}",
                outbox.source,
                outbox.target,
                copied_text(outbox)
            );
            out!(
                "idempotency keys: {} records → {} rows {}",
                keys.source,
                keys.target,
                copied_text(keys)
            );
            out!("destinations: {destinations} policies or pauses copied");
            out!("schedules: {schedules} copied");
        }
        tell_conflicts(outbox, "outbox records", schema, |id| format!("id {id}"));
        tell_conflicts(keys, "idempotency records", schema, |(t, k)| {
            format!("{t:?}/{k:?}")
        });
        if report.has_conflicts() {
            eprintln!(
                "idemstore: error: migrate into a new schema, or one that holds only \
                 rows copied from this file"
            );
            return Outcome::Findings;
        }
        Outcome::Ok
    }

    pub(crate) fn run(
        file: &Path,
        url: &str,
        schema: Option<&str>,
        batch: u32,
        json: bool,
    ) -> Result<Outcome, Failure> {
        let store = open_or(file, |e| match e {
            // A program holds the file alone: it is running, and migrate
            // copies a stopped program's file.
            Error::AlreadyOpen { path, .. } => Failure(format!(
                "{} is held by a running program: stop the program that uses it, then run \
                 migrate again (what a running program writes meanwhile may or may not be \
                 copied)",
                path.display()
            )),
            other => other.into(),
        })?;
        let mut builder = PgStore::builder().pool_size(2);
        if let Some(s) = schema {
            builder = builder.schema(s);
        }
        let pg = builder.connect(url).map_err(|e| unusable(url, e))?;
        let options = MigrateOptions::new()
            .batch_size(usize::try_from(batch).unwrap_or(migrate::DEFAULT_MIGRATE_BATCH));
        let pb = bar(0, "copying");
        let report = migrate::to_postgres(&store, &pg, &options, |p| {
            pb.set_length(p.total);
            pb.set_position(p.done);
        })?;
        pb.finish_and_clear();
        Ok(print(&report, file, pg.schema(), json))
    }

    /// Why the server at `url` could not be used, as told: a bad schema
    /// name or connection string as itself; the server's or the client's
    /// error with the server named (no call ran, so no transaction was
    /// rolled back to speak of).
    fn unusable(url: &str, e: Error) -> Failure {
        let why = match e {
            Error::InvalidInput { .. } | Error::TooLarge { .. } => return e.into(),
            Error::Postgres {
                code: Some(code),
                message,
                ..
            } => format!("{message} (SQLSTATE {code})"),
            Error::Postgres { message, .. } => message,
            other => other.to_string(),
        };
        Failure(format!(
            "cannot use the PostgreSQL server at {:?}: {why}",
            crate::target::redact(url)
        ))
    }
}
