//! [`Error`] and [`Result`]: every way a store call can fail.
//!
//! Expected outcomes (a duplicate claim, a duplicate enqueue, a replayed
//! response, a key in flight) are *values* in `Ok`, never errors. An `Err`
//! always means the call did not do what it was asked, and that nothing it was
//! asked to write was acknowledged.
//!
//! What to do about an `Err` is told by [`Error::kind`] and
//! [`Error::is_retryable`], not by matching variants or SQLSTATEs: see
//! [`ErrorKind`].

use std::fmt;
use std::path::PathBuf;

/// The result type of every fallible call in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in a store call.
///
/// The enum is `#[non_exhaustive]`: match the variants you act on and keep a
/// wildcard arm. To decide what to do about one — run the call again, look
/// first, fix the input, reopen the store — ask [`Error::is_retryable`] and
/// [`Error::kind`].
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

/// The kind of an [`Error`]: what the failure means for the caller's next
/// step, like [`std::io::ErrorKind`] for an I/O error. [`Error::kind`] gives
/// it; [`Error::is_retryable`] answers the question most callers have.
///
/// Every variant of [`Error`] has one kind, except
/// [`Error::Postgres`](https://docs.rs/idemstore/latest/idemstore/enum.Error.html#variant.Postgres) (feature `postgres`),
/// whose kind comes from what the server answered (its SQLSTATE) or from
/// its silence: [`Unavailable`](ErrorKind::Unavailable),
/// [`Transient`](ErrorKind::Transient),
/// [`OutcomeUnknown`](ErrorKind::OutcomeUnknown), or else
/// [`Storage`](ErrorKind::Storage).
///
/// # The retry rule
///
/// [`Error::is_retryable`] is `true` for the kinds
/// [`Unavailable`](ErrorKind::Unavailable) and
/// [`Transient`](ErrorKind::Transient) only: the call did not happen (its
/// transaction rolled back, or nothing of it reached the server) and the
/// same call, run again as it is, may succeed. Back off between tries: the
/// store has already run such a call again on another connection a few
/// times before answering. A call made in your own transaction (the
/// `*_in` calls) is retried by running the whole transaction again from its
/// start: the failed one is gone.
///
/// It is `false` for everything else, among them:
///
/// - [`OutcomeUnknown`](ErrorKind::OutcomeUnknown): the call may have
///   committed. Look before running it again.
/// - [`InvalidInput`](ErrorKind::InvalidInput),
///   [`TooLarge`](ErrorKind::TooLarge), [`Conflict`](ErrorKind::Conflict),
///   [`NotFound`](ErrorKind::NotFound), [`Reentrant`](ErrorKind::Reentrant):
///   the same call answers the same again; change the call.
/// - [`Storage`](ErrorKind::Storage), [`Panicked`](ErrorKind::Panicked),
///   [`Closed`](ErrorKind::Closed): the store may be broken or gone; after
///   a failed or panicked commit it refuses every write until it is
///   reopened.
/// - [`Corrupted`](ErrorKind::Corrupted),
///   [`IncompatibleFormat`](ErrorKind::IncompatibleFormat),
///   [`NotAStore`](ErrorKind::NotAStore),
///   [`AlreadyOpen`](ErrorKind::AlreadyOpen), [`Io`](ErrorKind::Io): a
///   person has something to fix first.
///
/// ```
/// use idemstore::{Error, ErrorKind};
///
/// let e = Error::NotFound;
/// assert_eq!(e.kind(), ErrorKind::NotFound);
/// assert!(!e.is_retryable());
/// ```
///
/// The enum is `#[non_exhaustive]`: later versions may split a kind into
/// finer ones; keep a wildcard arm, and prefer [`Error::is_retryable`] to a
/// list of kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The storage engine (redb) failed ([`Error::Storage`]: an I/O error, a
    /// failed commit, a full disk, a caller's table opened with other
    /// types), or the PostgreSQL server refused the call for a reason no
    /// other kind names (a constraint, a statement it rejected, a full
    /// disk, a protocol violation), or the client failed (a bad connection
    /// string, a column that does not decode). Not retryable: after a
    /// failed commit the embedded store refuses writes until it is reopened
    /// (the reopen repairs the file).
    Storage,
    /// [`Error::NotFound`]: no such record. Not retryable.
    NotFound,
    /// [`Error::Conflict`]: the record's state refuses the operation (a
    /// stale claim, an illegal status change). Not retryable: read the
    /// record again and decide.
    Conflict,
    /// [`Error::InvalidInput`]: a malformed argument. Not retryable.
    InvalidInput,
    /// [`Error::TooLarge`]: an argument over its limit. Not retryable.
    TooLarge,
    /// [`Error::Corrupted`]: stored bytes that do not decode (or, on
    /// PostgreSQL, a row edited by something else). Not retryable.
    Corrupted,
    /// [`Error::IncompatibleFormat`]: a file from a newer version, or a
    /// redb file that is not a store. Not retryable.
    IncompatibleFormat,
    /// [`Error::NotAStore`]: a file that cannot be opened as a store. Not
    /// retryable.
    NotAStore,
    /// [`Error::AlreadyOpen`]: another `Store` holds the file. Not
    /// retryable: share the `Store`, or stop the other process.
    AlreadyOpen,
    /// [`Error::Reentrant`]: a store write called inside a write closure
    /// on the same thread. Not retryable: use the `*_in` call.
    Reentrant,
    /// [`Error::Closed`]: the store is closed. Not retryable: reopen it.
    Closed,
    /// [`Error::Io`]: an I/O error outside the storage engine (starting a
    /// thread, reading a file's metadata). Not retryable.
    Io,
    /// [`Error::Panicked`]: code running on the store's behalf panicked.
    /// Not retryable: a store whose commit panicked refuses writes until it
    /// is reopened.
    Panicked,
    /// The PostgreSQL server could not be reached, or went away, before the
    /// call had sent what commits it: no pooled connection came free (or
    /// could be opened) before the pool's timeout, a connection failed or
    /// closed without an answer, the server is shutting down or starting
    /// (`57P01`, `57P02`, `57P03`), has too many connections (`53300`), or
    /// reported a connection failure (class `08`, but `08007` and
    /// `08P01`). Nothing of the call committed. Retryable, once the server
    /// is back.
    Unavailable,
    /// The PostgreSQL server rolled the call's transaction back for a
    /// reason that passes: a serialization failure (`40001`) or a deadlock
    /// (`40P01`). Nothing of the call committed. Retryable.
    Transient,
    /// A PostgreSQL call whose outcome is unknown: the connection failed
    /// once the call's commit was sent, so it may have committed (SQLSTATE
    /// `08007`, `transaction_resolution_unknown`, which the store gives
    /// such a call; or `40003`, `statement_completion_unknown`). Not
    /// retryable: run blindly again, a claim or an enqueue that did commit
    /// answers as a duplicate and the work after it would be skipped.
    /// Look first (`seen`, `get`, `counts`), or hand entries a `claim_due`
    /// may have taken back with `release_expired_claims`.
    OutcomeUnknown,
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

    /// What kind of failure this is: what it means for the caller's next
    /// step (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Storage(_) => ErrorKind::Storage,
            Error::NotFound => ErrorKind::NotFound,
            Error::Conflict { .. } => ErrorKind::Conflict,
            Error::InvalidInput { .. } => ErrorKind::InvalidInput,
            Error::TooLarge { .. } => ErrorKind::TooLarge,
            Error::Corrupted { .. } => ErrorKind::Corrupted,
            Error::IncompatibleFormat { .. } => ErrorKind::IncompatibleFormat,
            Error::NotAStore { .. } => ErrorKind::NotAStore,
            Error::AlreadyOpen { .. } => ErrorKind::AlreadyOpen,
            Error::Reentrant => ErrorKind::Reentrant,
            Error::Closed => ErrorKind::Closed,
            Error::Io(_) => ErrorKind::Io,
            Error::Panicked { .. } => ErrorKind::Panicked,
            #[cfg(feature = "postgres")]
            Error::Postgres { code, source, .. } => postgres_kind(code.as_deref(), &**source),
        }
    }

    /// Whether running the same call again, as it is, is safe and may
    /// succeed: `true` only for the kinds
    /// [`Unavailable`](ErrorKind::Unavailable) (the PostgreSQL server could
    /// not be reached or went away before the call committed, no pooled
    /// connection came free in time) and
    /// [`Transient`](ErrorKind::Transient) (a serialization failure or a
    /// deadlock rolled the call back). `false` for a call whose outcome is
    /// unknown (look first), for bad input, conflicts, missing records,
    /// damaged files, and a store that failed or panicked while committing
    /// (reopen it first). See [`ErrorKind`] for the rule in full.
    pub fn is_retryable(&self) -> bool {
        matches!(self.kind(), ErrorKind::Unavailable | ErrorKind::Transient)
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

/// The kind of an [`Error::Postgres`] with SQLSTATE `code` (if the server
/// answered) and the client's error `source` (see [`ErrorKind`]).
#[cfg(feature = "postgres")]
fn postgres_kind(code: Option<&str>, source: &(dyn std::error::Error + 'static)) -> ErrorKind {
    if let Some(code) = code {
        return match code {
            // transaction_resolution_unknown (the store's word for a call
            // whose commit was sent when the connection failed),
            // statement_completion_unknown.
            "08007" | "40003" => ErrorKind::OutcomeUnknown,
            // serialization_failure, deadlock_detected.
            "40001" | "40P01" => ErrorKind::Transient,
            // admin_shutdown, crash_shutdown, cannot_connect_now,
            // too_many_connections; the connection exceptions but
            // protocol_violation (a bug, not a passing state).
            "57P01" | "57P02" | "57P03" | "53300" => ErrorKind::Unavailable,
            "08P01" => ErrorKind::Storage,
            c if c.starts_with("08") => ErrorKind::Unavailable,
            _ => ErrorKind::Storage,
        };
    }
    // No answer: no pooled connection before the pool's timeout, a closed
    // connection, or an I/O error anywhere in the chain (the socket failed
    // underneath).
    if source.is::<NoConnection>() {
        return ErrorKind::Unavailable;
    }
    if let Some(pg) = source.downcast_ref::<tokio_postgres::Error>()
        && pg.is_closed()
    {
        return ErrorKind::Unavailable;
    }
    let mut next = Some(source);
    while let Some(e) = next {
        if e.is::<std::io::Error>() {
            return ErrorKind::Unavailable;
        }
        next = e.source();
    }
    ErrorKind::Storage
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

/// The source of an [`Error::Postgres`] for no pooled connection in time
/// (the pool's timeout), which [`ErrorKind`] reads as `Unavailable`.
#[cfg(feature = "postgres")]
#[derive(Debug)]
pub(crate) struct NoConnection(pub(crate) String);

#[cfg(feature = "postgres")]
impl fmt::Display for NoConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(feature = "postgres")]
impl std::error::Error for NoConnection {}

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

    #[test]
    fn every_variant_has_its_kind_and_none_of_the_stores_own_is_retryable() {
        let cases = [
            (Error::Storage(redb::Error::PreviousIo), ErrorKind::Storage),
            (
                Error::Storage(redb::Error::Io(std::io::Error::other("disk full"))),
                ErrorKind::Storage,
            ),
            (
                Error::from(redb::TableError::TableDoesNotExist("app.t".into())),
                ErrorKind::Storage,
            ),
            (Error::NotFound, ErrorKind::NotFound),
            (Error::conflict("stale claim"), ErrorKind::Conflict),
            (Error::invalid("key", "empty"), ErrorKind::InvalidInput),
            (
                Error::TooLarge {
                    field: "key",
                    len: 2000,
                    max: 1024,
                },
                ErrorKind::TooLarge,
            ),
            (
                Error::Corrupted {
                    table: "t",
                    key: "1".into(),
                    reason: "bad bytes".into(),
                },
                ErrorKind::Corrupted,
            ),
            (
                Error::IncompatibleFormat {
                    found: "format 9".into(),
                    supported: 1,
                },
                ErrorKind::IncompatibleFormat,
            ),
            (
                Error::NotAStore {
                    path: "f".into(),
                    reason: "truncated".into(),
                },
                ErrorKind::NotAStore,
            ),
            (
                Error::AlreadyOpen {
                    path: "f".into(),
                    shared: false,
                },
                ErrorKind::AlreadyOpen,
            ),
            (
                Error::AlreadyOpen {
                    path: "f".into(),
                    shared: true,
                },
                ErrorKind::AlreadyOpen,
            ),
            (Error::Reentrant, ErrorKind::Reentrant),
            (Error::Closed, ErrorKind::Closed),
            (
                Error::Io(std::io::Error::from(std::io::ErrorKind::WouldBlock)),
                ErrorKind::Io,
            ),
            (
                Error::Panicked {
                    during: "commit",
                    message: "boom".into(),
                },
                ErrorKind::Panicked,
            ),
        ];
        for (e, kind) in cases {
            assert_eq!(e.kind(), kind, "{e:?}");
            assert!(!e.is_retryable(), "{e:?}");
            // A copy made for each caller of a failed batch keeps both.
            assert_eq!(e.lossy_clone().kind(), kind, "{e:?}");
        }
    }

    #[test]
    fn the_kind_can_cross_threads() {
        fn check<T: Send + Sync + 'static>() {}
        check::<ErrorKind>();
    }

    #[cfg(feature = "postgres")]
    mod postgres {
        use std::sync::Arc;

        use super::super::{Error, ErrorKind};

        type Source = Arc<dyn std::error::Error + Send + Sync>;

        fn pg(code: Option<&str>, source: Source) -> Error {
            Error::Postgres {
                code: code.map(str::to_owned),
                message: "m".into(),
                source,
            }
        }

        fn io(kind: std::io::ErrorKind) -> Source {
            Arc::new(std::io::Error::from(kind))
        }

        /// A client error with no I/O error under it: a bad connection
        /// string.
        fn client() -> Source {
            Arc::new(
                "port=notaport"
                    .parse::<tokio_postgres::Config>()
                    .unwrap_err(),
            )
        }

        /// The pool's error when no connection came free before its
        /// timeout.
        fn pool_timeout() -> Source {
            Arc::new(super::super::NoConnection("timed out".into()))
        }

        /// An error with an I/O error under it.
        #[derive(Debug)]
        struct Wrap(std::io::Error);

        impl std::fmt::Display for Wrap {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("wrapped")
            }
        }

        impl std::error::Error for Wrap {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }

        #[test]
        fn a_call_whose_commit_may_have_happened_is_not_retryable() {
            for code in ["08007", "40003"] {
                for source in [io(std::io::ErrorKind::ConnectionReset), client()] {
                    let e = pg(Some(code), source);
                    assert_eq!(e.kind(), ErrorKind::OutcomeUnknown, "{code}");
                    assert!(!e.is_retryable(), "{code}");
                    assert!(e.is_storage());
                }
            }
        }

        #[test]
        fn a_rolled_back_serialization_failure_or_deadlock_is_retryable() {
            for code in ["40001", "40P01"] {
                let e = pg(Some(code), client());
                assert_eq!(e.kind(), ErrorKind::Transient, "{code}");
                assert!(e.is_retryable(), "{code}");
            }
        }

        #[test]
        fn a_server_out_of_reach_before_the_commit_is_retryable() {
            // The server's word that it is going, or refusing connections;
            // a connection failure it reported.
            for code in [
                "57P01", "57P02", "57P03", "53300", "08000", "08001", "08003", "08004", "08006",
            ] {
                let e = pg(Some(code), client());
                assert_eq!(e.kind(), ErrorKind::Unavailable, "{code}");
                assert!(e.is_retryable(), "{code}");
            }
            // No answer: the socket failed (at the top of the chain or
            // under the client's error), or no pooled connection came free.
            for source in [
                io(std::io::ErrorKind::ConnectionReset),
                io(std::io::ErrorKind::BrokenPipe),
                io(std::io::ErrorKind::UnexpectedEof),
                Arc::new(Wrap(std::io::Error::other("reset"))),
                pool_timeout(),
            ] {
                let e = pg(None, source);
                assert_eq!(e.kind(), ErrorKind::Unavailable, "{e:?}");
                assert!(e.is_retryable(), "{e:?}");
            }
        }

        #[test]
        fn other_server_answers_and_client_errors_are_storage_and_not_retryable() {
            // unique_violation, check_violation, query_canceled,
            // undefined_table, protocol_violation, disk_full,
            // invalid_password, in_failed_sql_transaction,
            // transaction_integrity_constraint_violation.
            for code in [
                "23505", "23514", "57014", "42P01", "08P01", "53100", "28P01", "25P02", "40002",
            ] {
                let e = pg(Some(code), io(std::io::ErrorKind::ConnectionReset));
                assert_eq!(e.kind(), ErrorKind::Storage, "{code}");
                assert!(!e.is_retryable(), "{code}");
            }
            let e = pg(None, client());
            assert_eq!(e.kind(), ErrorKind::Storage);
            assert!(!e.is_retryable());
            assert_eq!(e.lossy_clone().kind(), ErrorKind::Storage);
        }
    }
}
