//! [`Error`] and [`Result`]: every way a store call can fail.
//!
//! Expected outcomes (a duplicate claim, a duplicate enqueue, a replayed
//! response, a key in flight) are *values* in `Ok`, never errors. An `Err`
//! always means the call did not do what it was asked, and that nothing it was
//! asked to write was acknowledged.

use std::fmt;
use std::path::PathBuf;

/// The result type of every fallible call in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in a store call.
///
/// The enum is `#[non_exhaustive]`: match the variants you act on and keep a
/// wildcard arm.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The storage engine (redb) failed, with its own error: an I/O error, a
    /// failed commit, a full disk, or the caller's own table opened with
    /// other types than it was created with. The call wrote nothing that was
    /// acknowledged; retrying may work once the cause is fixed. After a
    /// failed commit the store refuses further writes until it is reopened
    /// (the reopen repairs the file).
    Storage(redb::Error),
    /// The record asked for does not exist (it was never written, was purged,
    /// or the id belongs to another store file).
    NotFound,
    /// The operation is not allowed in the record's current state, for
    /// example completing an outbox entry that already failed, or settling it
    /// with a stale claim. Nothing was changed.
    Conflict {
        /// What the operation ran into.
        reason: String,
    },
    /// An argument is malformed: an empty key, a bad inbox name, a time out of
    /// range. Nothing was written.
    InvalidInput {
        /// The argument at fault.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// An argument is longer than the store accepts. Nothing was written; the
    /// value was not truncated.
    TooLarge {
        /// The argument at fault.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The largest length accepted.
        max: usize,
    },
    /// Stored bytes could not be decoded: the file was damaged or written by
    /// something else. The record is left as it is for inspection.
    Corrupted {
        /// The table holding the bad record.
        table: &'static str,
        /// The record's key, printed for people.
        key: String,
        /// What failed to decode.
        reason: String,
    },
    /// The file is a store written by a newer, incompatible version of this
    /// crate, or a redb database that is not an idemstore file at all.
    IncompatibleFormat {
        /// What was found in the file.
        found: String,
        /// What this build of the crate can read.
        supported: u64,
    },
    /// The file cannot be opened as a store: it is neither empty nor a redb
    /// database, or it was truncated or overwritten. It is left as it is.
    NotAStore {
        /// The file that was opened.
        path: PathBuf,
        /// What the engine said about it.
        reason: String,
    },
    /// The file is already open, in this process or another one, in a way
    /// that excludes this open: a store opened exclusively (the default)
    /// has one owner at a time — share a [`Store`](crate::Store) by cloning
    /// it — and a file shared between processes
    /// ([`StoreBuilder::shared`](crate::StoreBuilder::shared)) must be
    /// opened shared by every one of them.
    AlreadyOpen {
        /// The file that was opened.
        path: PathBuf,
        /// Whether this open asked to share the file: then the holder has it
        /// exclusively; else the holder has it, shared or not.
        shared: bool,
    },
    /// A store write method was called from inside a [`Store::write`]
    /// closure (or an effect) on the same thread, which would deadlock: use
    /// the `*_in` variants with the transaction the closure was given.
    ///
    /// [`Store::write`]: crate::Store::write
    Reentrant,
    /// The store is shutting down and took no more work. Reopen the store.
    Closed,
    /// An I/O operation outside the storage engine failed: starting a
    /// background thread, reading a file's metadata.
    Io(std::io::Error),
    /// Code running on the store's behalf panicked: a dispatcher's worker
    /// thread, or the store's own code while it committed a batch of
    /// operations. Nothing from this call was acknowledged. After a panic
    /// while committing, the store refuses further writes with this same
    /// error until it is reopened, as after a failed commit. A panic in code
    /// the store does not own (a `metrics` recorder, a `tracing`
    /// subscriber) is never one: it is dropped, and changes no answer.
    Panicked {
        /// What was running when it panicked.
        during: &'static str,
        /// The panic's message, when it had one.
        message: String,
    },
    /// The PostgreSQL server failed the call, or could not be reached: a
    /// lost connection, a server restart, a serialization failure, a
    /// statement it refused, no pooled connection free before the timeout.
    /// The transaction the call ran in was rolled back, so nothing from the
    /// call was acknowledged, and retrying may work once the server is back
    /// — except when `code` is `08007` (`transaction_resolution_unknown`): the
    /// connection failed once the call's commit was sent, and the call may
    /// have committed. Do not run such a call again blindly: a claim or an
    /// enqueue that did commit answers the second time as a duplicate (the
    /// work after it would be skipped), a `begin` as in flight. Look first
    /// (`seen`, `get`, `counts`), or hand entries a `claim_due` may have
    /// taken back with `release_expired_claims`.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    Postgres {
        /// The SQLSTATE the server answered with (`40001`: a
        /// serialization failure, `57P01`: the server is shutting down, …);
        /// `None` when it did not answer (a lost connection, a timeout);
        /// `08007` when the call's outcome is unknown (the message then
        /// says what ended the connection).
        code: Option<String>,
        /// What went wrong, in the server's words when it answered (its
        /// severity, message, detail and hint), else the client's.
        message: String,
        /// The client's error, for [`source`](std::error::Error::source).
        source: std::sync::Arc<dyn std::error::Error + Send + Sync>,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Storage(e) => {
                write!(
                    f,
                    "storage engine error: {e}; nothing from this call was acknowledged"
                )?;
                match e {
                    redb::Error::PreviousIo => f.write_str(
                        " (an earlier commit failed: reopen the store to repair the file)",
                    ),
                    redb::Error::Io(_) | redb::Error::Backend(_) => {
                        f.write_str(" (if a commit failed, reopen the store to repair the file)")
                    }
                    _ => Ok(()),
                }
            }
            Error::NotFound => f.write_str(
                "no such record in the store (never written, purged, or from another store file)",
            ),
            Error::Conflict { reason } => write!(f, "conflict: {reason}; nothing was changed"),
            Error::InvalidInput { field, reason } => {
                write!(f, "invalid {field}: {reason}; nothing was written")
            }
            Error::TooLarge { field, len, max } => write!(
                f,
                "{field} is {len} bytes, over the limit of {max} bytes; nothing was written"
            ),
            Error::Corrupted { table, key, reason } => write!(
                f,
                "corrupted record in table `{table}` at key {key}: {reason}; \
                 the file was damaged or written by something else"
            ),
            Error::IncompatibleFormat { found, supported } => write!(
                f,
                "incompatible store format: found {found}, this build reads format {supported}; \
                 open it with the version of idemstore that wrote it"
            ),
            Error::NotAStore { path, reason } => write!(
                f,
                "{} cannot be opened as a store ({reason}): it is not an idemstore file, or it \
                 was damaged (truncated or overwritten); restore it from a backup or point the \
                 store at another file",
                path.display()
            ),
            Error::AlreadyOpen { path, shared: true } => write!(
                f,
                "{} is held exclusively by another Store, in this process or another one; \
                 to share it between processes, open it with StoreBuilder::shared(true) there \
                 too, or stop that process",
                path.display()
            ),
            Error::AlreadyOpen {
                path,
                shared: false,
            } => write!(
                f,
                "{} is already open by another Store, in this process or another one; share \
                 one Store by cloning it, stop the other process, or open the file with \
                 StoreBuilder::shared(true) in every process that uses it",
                path.display()
            ),
            Error::Reentrant => f.write_str(
                "a store write was called from inside a write closure on the same thread; \
                 use the `*_in` variant with the closure's transaction instead",
            ),
            Error::Closed => f.write_str("the store is closed; reopen it"),
            Error::Io(e) => write!(f, "I/O error: {e}"),
            Error::Panicked { during, message } => write!(
                f,
                "a panic during {during}: {message}; nothing from this call was acknowledged"
            ),
            #[cfg(feature = "postgres")]
            Error::Postgres { code, message, .. } => {
                write!(f, "PostgreSQL error: {message}")?;
                if let Some(code) = code {
                    write!(f, " (SQLSTATE {code})")?;
                }
                if code.as_deref() == Some("08007") {
                    f.write_str(
                        "; the call may have committed: look before running it again \
                         (a claim that committed answers as a duplicate)",
                    )
                } else {
                    f.write_str("; the call's transaction was rolled back")
                }
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Storage(e) => Some(e),
            Error::Io(e) => Some(e),
            #[cfg(feature = "postgres")]
            Error::Postgres { source, .. } => Some(&**source),
            _ => None,
        }
    }
}

impl Error {
    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidInput {
            field,
            reason: reason.into(),
        }
    }

    pub(crate) fn conflict(reason: impl Into<String>) -> Self {
        Error::Conflict {
            reason: reason.into(),
        }
    }

    /// An [`Error::Panicked`] from a caught panic's payload.
    pub(crate) fn panicked(during: &'static str, payload: &(dyn std::any::Any + Send)) -> Self {
        Error::Panicked {
            during,
            message: panic_message(payload),
        }
    }

    /// Whether this error came from the storage engine or the disk (or, with
    /// feature `postgres`, the database server) rather than from the
    /// arguments or the records' states.
    pub fn is_storage(&self) -> bool {
        match self {
            Error::Storage(_) => true,
            #[cfg(feature = "postgres")]
            Error::Postgres { .. } => true,
            _ => false,
        }
    }

    /// A copy of this error, for each caller of a batch that failed as a
    /// whole. redb's and the file system's errors are not `Clone`: their
    /// copies keep the kind and the message, and any other redb error
    /// becomes an I/O error with its message. Every other variant is copied
    /// as it is.
    pub(crate) fn lossy_clone(&self) -> Error {
        fn io(e: &std::io::Error) -> std::io::Error {
            std::io::Error::new(e.kind(), e.to_string())
        }
        match self {
            Error::Storage(redb::Error::PreviousIo) => Error::Storage(redb::Error::PreviousIo),
            Error::Storage(redb::Error::Io(inner)) => Error::Storage(redb::Error::Io(io(inner))),
            Error::Storage(inner) => {
                Error::Storage(redb::Error::Io(std::io::Error::other(inner.to_string())))
            }
            Error::Io(inner) => Error::Io(io(inner)),
            Error::NotFound => Error::NotFound,
            Error::Conflict { reason } => Error::conflict(reason.clone()),
            Error::InvalidInput { field, reason } => Error::invalid(field, reason.clone()),
            Error::TooLarge { field, len, max } => Error::TooLarge {
                field,
                len: *len,
                max: *max,
            },
            Error::Corrupted { table, key, reason } => Error::Corrupted {
                table,
                key: key.clone(),
                reason: reason.clone(),
            },
            Error::IncompatibleFormat { found, supported } => Error::IncompatibleFormat {
                found: found.clone(),
                supported: *supported,
            },
            Error::NotAStore { path, reason } => Error::NotAStore {
                path: path.clone(),
                reason: reason.clone(),
            },
            Error::AlreadyOpen { path, shared } => Error::AlreadyOpen {
                path: path.clone(),
                shared: *shared,
            },
            Error::Reentrant => Error::Reentrant,
            Error::Closed => Error::Closed,
            Error::Panicked { during, message } => Error::Panicked {
                during,
                message: message.clone(),
            },
            #[cfg(feature = "postgres")]
            Error::Postgres {
                code,
                message,
                source,
            } => Error::Postgres {
                code: code.clone(),
                message: message.clone(),
                source: source.clone(),
            },
        }
    }
}

/// Checks a key-like argument: 1..=max bytes.
pub(crate) fn check_len(field: &'static str, value: &str, max: usize) -> Result<()> {
    if value.is_empty() {
        return Err(Error::invalid(field, "must not be empty"));
    }
    if value.len() > max {
        return Err(Error::TooLarge {
            field,
            len: value.len(),
            max,
        });
    }
    Ok(())
}

macro_rules! from_redb {
    ($($t:ty),* $(,)?) => {$(
        impl From<$t> for Error {
            fn from(e: $t) -> Self {
                Error::Storage(e.into())
            }
        }
    )*};
}

from_redb!(
    redb::TransactionError,
    redb::CommitError,
    redb::CompactionError,
    redb::SetDurabilityError,
    redb::DatabaseError,
);

impl From<redb::StorageError> for Error {
    fn from(e: redb::StorageError) -> Self {
        Error::Storage(e.into())
    }
}

/// redb's own error, whatever the table: a caller's table opened with other
/// types than it was created with is the caller's mistake, told in redb's
/// words. The store's own tables map a clash to
/// [`Error::IncompatibleFormat`] where they are opened (`crate::schema`).
impl From<redb::TableError> for Error {
    fn from(e: redb::TableError) -> Self {
        Error::Storage(e.into())
    }
}

impl From<redb::Error> for Error {
    fn from(e: redb::Error) -> Self {
        Error::Storage(e)
    }
}

/// The message a panic carried (`panic!("…")` or `panic!("{…}")`), or
/// `(no message)` for any other payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_failed_commit_or_io_speaks_of_reopening() {
        let previous = Error::Storage(redb::Error::PreviousIo).to_string();
        assert!(previous.contains("reopen the store"), "{previous}");
        let io = Error::Storage(redb::Error::Io(std::io::Error::other("disk full"))).to_string();
        assert!(io.contains("disk full") && io.contains("reopen"), "{io}");
        let table = Error::from(redb::TableError::TableDoesNotExist("app.t".into())).to_string();
        assert!(table.contains("Table 'app.t' does not exist"), "{table}");
        assert!(!table.contains("reopen"), "{table}");
    }
}
