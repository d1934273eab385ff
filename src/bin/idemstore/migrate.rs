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

    use crate::commands::{Holdings, inbox_pages, key_pages, outbox_pages};

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
        let holds = Holdings::read(&store)?;
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
            for page in inbox_pages(&store.inbox(name)?, batch) {
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
        for page in outbox_pages(&store.outbox(), batch) {
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
        for page in key_pages(&store.idempotency_keys(), batch) {
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
            redact(url)
        ))
    }

    /// `url`, a libpq connection string or URL, with its password (if it
    /// has one) replaced by `***`, for messages: the user info of a URL
    /// (`postgresql://app:PASSWORD@host/db`), its `password` parameter
    /// (`?password=…`), or the `password=…` of a connection string, quoted
    /// or not.
    pub(super) fn redact(url: &str) -> String {
        const HIDDEN: &str = "***";
        if let Some(scheme) = ["postgresql://", "postgres://"]
            .into_iter()
            .find(|p| url.starts_with(p))
        {
            let rest = url.get(scheme.len()..).unwrap_or_default();
            // The host follows the last `@` before the query (a password
            // may hold `@` or `/`).
            let query = rest.find('?').unwrap_or(rest.len());
            let host = rest
                .get(..query)
                .and_then(|r| r.rfind('@'))
                .map_or(0, |at| at + 1);
            let end = rest
                .get(host..)
                .and_then(|r| r.find(['/', '?']))
                .map_or(rest.len(), |i| host + i);
            let (authority, tail) = rest.split_at(end);
            let authority = match authority.rsplit_once('@') {
                Some((user_info, host)) => match user_info.split_once(':') {
                    Some((user, _)) => format!("{user}:{HIDDEN}@{host}"),
                    None => format!("{user_info}@{host}"),
                },
                None => authority.to_owned(),
            };
            let tail = match tail.split_once('?') {
                Some((path, query)) => {
                    let params: Vec<String> = query
                        .split('&')
                        .map(|p| match p.split_once('=') {
                            Some(("password", _)) => format!("password={HIDDEN}"),
                            _ => p.to_owned(),
                        })
                        .collect();
                    format!("{path}?{}", params.join("&"))
                }
                None => tail.to_owned(),
            };
            return format!("{scheme}{authority}{tail}");
        }
        // `key = value` pairs; a value is a word, or quoted with `\'` and
        // `\\` escaped inside.
        let mut out = String::with_capacity(url.len());
        let mut rest = url;
        loop {
            let trimmed = rest.trim_start();
            out.push_str(rest.get(..rest.len() - trimmed.len()).unwrap_or_default());
            rest = trimmed;
            if rest.is_empty() {
                return out;
            }
            let key_end = rest
                .find(|c: char| c == '=' || c.is_whitespace())
                .unwrap_or(rest.len());
            let (key, after_key) = rest.split_at(key_end);
            let after_spaces = after_key.trim_start();
            let Some(value) = after_spaces.strip_prefix('=') else {
                // Not a pair: leave the rest as it is.
                out.push_str(rest);
                return out;
            };
            let value = value.trim_start();
            let value_len = if value.starts_with('\'') {
                let mut escaped = false;
                let mut len = value.len();
                for (i, c) in value.char_indices().skip(1) {
                    match c {
                        _ if escaped => escaped = false,
                        '\\' => escaped = true,
                        '\'' => {
                            len = i + 1;
                            break;
                        }
                        _ => {}
                    }
                }
                len
            } else {
                value.find(char::is_whitespace).unwrap_or(value.len())
            };
            let head_len = rest.len() - value.len();
            out.push_str(rest.get(..head_len).unwrap_or_default());
            if key == "password" {
                out.push_str(HIDDEN);
            } else {
                out.push_str(value.get(..value_len).unwrap_or_default());
            }
            rest = value.get(value_len..).unwrap_or_default();
        }
    }

    #[cfg(test)]
    mod tests {
        use super::redact;

        #[test]
        fn passwords_are_hidden_and_the_rest_kept() {
            for (url, want) in [
                (
                    "postgresql://app:s3cret@db.example:5432/app",
                    "postgresql://app:***@db.example:5432/app",
                ),
                ("postgres://app:p@ss@db/app", "postgres://app:***@db/app"),
                ("postgres://app:s3/x@db/app", "postgres://app:***@db/app"),
                ("postgresql://app@db/app", "postgresql://app@db/app"),
                (
                    "postgresql://db/app?user=app&password=s3cret&sslmode=disable",
                    "postgresql://db/app?user=app&password=***&sslmode=disable",
                ),
                (
                    "postgresql://app:s3cret@/app?host=/tmp",
                    "postgresql://app:***@/app?host=/tmp",
                ),
                (
                    "host=/run/postgresql user=app password=s3cret dbname=app",
                    "host=/run/postgresql user=app password=*** dbname=app",
                ),
                ("password = s3cret host=db", "password = *** host=db"),
                (
                    "user=app password='s3 \\'cret' dbname=app",
                    "user=app password=*** dbname=app",
                ),
                ("host=db user=app", "host=db user=app"),
                ("port=notaport", "port=notaport"),
                ("", ""),
                ("nonsense", "nonsense"),
            ] {
                assert_eq!(redact(url), want, "{url}");
                assert!(!redact(url).contains("s3"), "{url}");
            }
        }
    }
}
