//! `idemstore migrate FILE --to-postgres URL`: a store file's rows into
//! PostgreSQL.
//!
//! Reads the file through its public calls, page by page as `export` does
//! (the same pagers, `commands::*_pages`), and writes each page in one
//! transaction through the PostgreSQL store's import calls, which insert
//! with `ON CONFLICT DO NOTHING` and keep outbox ids and fences as they
//! are. A row already there from an
//! earlier run is left alone; a record whose id or key a different row
//! holds is a conflict: not copied, named on stderr, and the command
//! exits 1. The server's id and fence sequences are first moved past every
//! one the file handed out. Then counts both sides.

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
    use idemstore::postgres::PgStore;
    use serde_json::json;

    use crate::export::{Holdings, inbox_pages, key_pages, outbox_pages};
    use crate::handle::StoreHandle;

    use crate::open_or;
    use crate::output::{bar, out, print_json};

    /// How many conflicting records of a kind stderr names.
    const NAMED: usize = 10;

    /// One kind of row: how many the file holds, how many the server holds
    /// afterwards, how many this run copied, how many it did not copy
    /// because a different row holds their id or key (and the first few of
    /// them, named).
    #[derive(Default)]
    struct Tally {
        source: u64,
        target: u64,
        copied: u64,
        conflicts: u64,
        named: Vec<String>,
    }

    impl Tally {
        fn json(&self) -> serde_json::Value {
            json!({
                "source": self.source,
                "target": self.target,
                "copied": self.copied,
                "conflicts": self.conflicts,
            })
        }

        /// Counts a batch's copies and conflicts.
        fn add<T>(&mut self, (copied, conflicts): (u64, Vec<T>), name: impl Fn(&T) -> String) {
            self.copied += copied;
            self.conflicts += conflicts.len() as u64;
            let room = NAMED.saturating_sub(self.named.len());
            self.named.extend(conflicts.iter().take(room).map(name));
        }

        /// `(N copied)`, with the conflicts when there are any.
        fn copied_text(&self) -> String {
            if self.conflicts == 0 {
                format!("({} copied)", self.copied)
            } else {
                format!(
                    "({} copied, {} conflicting rows not copied)",
                    self.copied, self.conflicts
                )
            }
        }

        /// Names the conflicting records of kind `what` on stderr.
        fn tell_conflicts(&self, what: &str, schema: &str) {
            if self.conflicts == 0 {
                return;
            }
            let more = if self.conflicts > self.named.len() as u64 {
                ", …"
            } else {
                ""
            };
            eprintln!(
                "idemstore: error: {} {what} not copied: schema {schema} holds different rows \
                 with their ids or keys ({}{more})",
                self.conflicts,
                self.named.join(", ")
            );
        }
    }

    /// What a run copied, by kind of row.
    struct Report {
        /// How many inboxes the file holds.
        names: usize,
        inboxes: Tally,
        outbox: Tally,
        keys: Tally,
        /// Destinations whose policy or pause was copied.
        destinations: u64,
    }

    impl Report {
        /// Prints the report on stdout and the conflicts on stderr; `Findings`
        /// if there were any.
        fn print(&self, file: &Path, schema: &str, json: bool) -> Outcome {
            let Report {
                names,
                inboxes,
                outbox,
                keys,
                destinations,
            } = self;
            if json {
                print_json(&json!({
                    "file": file.display().to_string(),
                    "schema": schema,
                    "inboxes": {
                        "names": names,
                        "source": inboxes.source,
                        "target": inboxes.target,
                        "copied": inboxes.copied,
                    },
                    "outbox": outbox.json(),
                    "idempotency_keys": keys.json(),
                    "destinations": { "copied": destinations },
                }));
            } else {
                out!("{} → PostgreSQL schema {schema}", file.display());
                out!(
                    "inboxes: {} keys in {} inboxes → {} rows ({} copied)",
                    inboxes.source,
                    names,
                    inboxes.target,
                    inboxes.copied
                );
                out!(
                    "outbox: {} records → {} rows {}",
                    outbox.source,
                    outbox.target,
                    outbox.copied_text()
                );
                out!(
                    "idempotency keys: {} records → {} rows {}",
                    keys.source,
                    keys.target,
                    keys.copied_text()
                );
                out!("destinations: {destinations} policies or pauses copied");
            }
            outbox.tell_conflicts("outbox records", schema);
            keys.tell_conflicts("idempotency records", schema);
            if outbox.conflicts + keys.conflicts > 0 {
                eprintln!(
                    "idemstore: error: migrate into a new schema, or one that holds only \
                     rows copied from this file"
                );
                return Outcome::Findings;
            }
            Outcome::Ok
        }
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
        let batch = usize::try_from(batch).unwrap_or(1000);
        let source = StoreHandle::File(store.clone());
        let holds = Holdings::read(&source)?;
        // Ids and fences are never reused: the server's sequences go past
        // every one the file handed out, its purged records' too.
        pg.import_counters(
            store.outbox().next_id()?,
            store.idempotency_keys().next_fence()?,
        )?;
        let pb = bar(holds.total(), "copying");

        let mut inboxes = Tally {
            source: holds.inbox_keys,
            ..Tally::default()
        };
        for name in &holds.inbox_names {
            for page in inbox_pages(&source.inbox(name)?, batch) {
                let page = page?;
                inboxes.copied += pg.import_inbox(name, &page)?;
                pb.inc(page.len() as u64);
            }
            inboxes.target += pg.inbox(name)?.len()?;
        }

        let mut outbox = Tally {
            source: holds.outbox,
            ..Tally::default()
        };
        for page in outbox_pages(&source.outbox(), batch) {
            let page = page?;
            outbox.add(pg.import_outbox(&page)?, |id| format!("id {id}"));
            pb.inc(page.len() as u64);
        }
        outbox.target = pg.outbox().counts()?.total();
        // Policies and pauses, which the entries' claims obey from then on.
        let destinations = pg.import_destinations(&store.outbox().destinations()?)?;

        let mut keys = Tally {
            source: holds.keys,
            ..Tally::default()
        };
        for page in key_pages(&source.keys(), batch) {
            let page = page?;
            keys.add(pg.import_idempotency(&page)?, |(t, k)| {
                format!("{t:?}/{k:?}")
            });
            pb.inc(page.len() as u64);
        }
        let s = pg.idempotency_keys().summary()?;
        keys.target = s.completed + s.reserved;
        pb.finish_and_clear();

        Ok(Report {
            names: holds.inbox_names.len(),
            inboxes,
            outbox,
            keys,
            destinations,
        }
        .print(file, pg.schema(), json))
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
