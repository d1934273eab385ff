//! What a command works on: a store file, or a PostgreSQL server's store
//! (a `postgres://` or `postgresql://` URL, or a libpq `key=value`
//! connection string, with `--schema`). Shown with its password hidden.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::Failure;

/// A store file or a PostgreSQL connection string, as given on the command
/// line.
#[derive(Clone, Debug)]
pub(crate) enum Target {
    File(PathBuf),
    Postgres(String),
}

impl Target {
    /// `arg` as a connection string if it reads as one — a `postgres://` or
    /// `postgresql://` URL, or `key=value` pairs whose first key is a word
    /// (`host=/run/postgresql dbname=app`) — and as a file path otherwise.
    pub(crate) fn parse(arg: &str) -> Result<Target, String> {
        if arg.is_empty() {
            return Err("an empty store: give a file or a PostgreSQL connection string".into());
        }
        let url = ["postgres://", "postgresql://"]
            .iter()
            .any(|p| arg.starts_with(p));
        let pairs = arg.split_once('=').is_some_and(|(key, _)| {
            let key = key.trim();
            !key.is_empty() && key.chars().all(|c| c.is_ascii_lowercase() || c == '_')
        });
        Ok(if url || pairs {
            Target::Postgres(arg.to_owned())
        } else {
            Target::File(PathBuf::from(arg))
        })
    }
}

impl Target {
    /// The file, for `command`, which works on store files only.
    pub(crate) fn file(&self, command: &str) -> Result<&Path, Failure> {
        match self {
            Target::File(path) => Ok(path),
            Target::Postgres(_) => Err(Failure(format!(
                "{command} works on a store file, and {self} is a PostgreSQL connection string"
            ))),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::File(path) => write!(f, "{}", path.display()),
            Target::Postgres(url) => f.write_str(&redact(url)),
        }
    }
}

/// `url`, a libpq connection string or URL, with its password (if it
/// has one) replaced by `***`, for messages: the user info of a URL
/// (`postgresql://app:PASSWORD@host/db`), its `password` parameter
/// (`?password=…`), or the `password=…` of a connection string, quoted
/// or not.
pub(crate) fn redact(url: &str) -> String {
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
    use super::*;

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

    #[test]
    fn connection_strings_and_files_are_told_apart() {
        for url in [
            "postgres://app@db/app",
            "postgresql://app:pw@db/app",
            "host=/run/postgresql dbname=app",
            " host = db",
        ] {
            assert!(
                matches!(Target::parse(url), Ok(Target::Postgres(_))),
                "{url}"
            );
        }
        for file in [
            "app.idem",
            "/var/lib/app/store.idem",
            "./a=b.idem",
            "dir/x=1",
        ] {
            assert!(matches!(Target::parse(file), Ok(Target::File(_))), "{file}");
        }
        assert!(Target::parse("").is_err());
        let shown = Target::parse("postgres://app:s3cret@db/app").map(|t| t.to_string());
        assert_eq!(shown.as_deref(), Ok("postgres://app:***@db/app"));
    }
}
