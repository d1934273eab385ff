//! The server's and the pool's errors as [`Error::Postgres`], and the
//! errors of values read back from the server.
//!
//! Nothing here panics: a statement the server refuses, a connection that
//! drops, a column that does not decode are all errors with the server's
//! (or the client's) own message.

use std::fmt::{Display, Write as _};
use std::sync::Arc;

use crate::error::{Error, NoConnection};

/// A server or client error, with the SQLSTATE the server answered with
/// and its message (severity, message, detail and hint), so that the
/// caller — and `?` in an effect — gets it without digging.
impl From<tokio_postgres::Error> for Error {
    fn from(e: tokio_postgres::Error) -> Self {
        let code = e.code().map(|c| c.code().to_owned());
        let message = match e.as_db_error() {
            Some(db) => {
                let mut m = format!("{}: {}", db.severity(), db.message());
                if let Some(detail) = db.detail() {
                    let _ = write!(m, " (detail: {detail})");
                }
                if let Some(hint) = db.hint() {
                    let _ = write!(m, " (hint: {hint})");
                }
                m
            }
            None => chain(&e),
        };
        Error::Postgres {
            code,
            message,
            source: Arc::new(e),
        }
    }
}

/// No pooled connection came free, or none could be opened, before the
/// pool's timeout (the server is down or unreachable, or every connection
/// is busy).
pub(super) fn pool(reason: &str) -> Error {
    Error::Postgres {
        code: None,
        message: format!("no database connection: {reason}"),
        source: Arc::new(NoConnection(reason.to_owned())),
    }
}

/// `e`'s message followed by its sources' (the client's own messages say
/// little without them: "error connecting to server: No such file or
/// directory").
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        let _ = write!(out, ": {s}");
        next = s.source();
    }
    out
}

/// A value read from `table` at `key` that cannot be what the store wrote:
/// the row was edited by something else.
pub(super) fn corrupted(
    table: &'static str,
    key: &dyn Display,
    reason: impl Into<String>,
) -> Error {
    Error::Corrupted {
        table,
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// Bytes the store wrote as a string's UTF-8 (PostgreSQL's `text` cannot
/// hold a NUL, so strings the caller chooses are stored as `bytea`), back as
/// the string.
pub(super) fn utf8(
    table: &'static str,
    key: &dyn Display,
    bytes: Vec<u8>,
) -> Result<String, Error> {
    String::from_utf8(bytes)
        .map_err(|e| corrupted(table, key, format!("stored text is not UTF-8: {e}")))
}

/// A stored count or number that must fit `u64`/`u32` (ids, fences,
/// attempt numbers are written from them).
pub(super) fn unsigned<T: TryFrom<i64>>(
    table: &'static str,
    key: &dyn Display,
    what: &str,
    v: i64,
) -> Result<T, Error> {
    T::try_from(v).map_err(|_| corrupted(table, key, format!("{what} {v} is out of range")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_connection_string_keeps_the_clients_words() {
        let e = "host=/nowhere port=notaport"
            .parse::<tokio_postgres::Config>()
            .unwrap_err();
        let e = Error::from(e);
        let Error::Postgres { code, message, .. } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(*code, None);
        assert!(message.contains("invalid"), "{message}");
        assert!(e.is_storage());
        assert!(std::error::Error::source(&e).is_some());
        let copy = e.lossy_clone();
        assert_eq!(copy.to_string(), e.to_string());
    }

    #[test]
    fn stored_values_that_cannot_be_ours_are_corrupted() {
        assert!(matches!(
            utf8("t", &1, vec![0xff]),
            Err(Error::Corrupted { table: "t", .. })
        ));
        assert!(matches!(
            unsigned::<u32>("t", &1, "attempt", -1),
            Err(Error::Corrupted { .. })
        ));
        assert_eq!(unsigned::<u64>("t", &1, "id", 7).unwrap(), 7);
    }
}
