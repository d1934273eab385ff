//! The outbox of a command's store, a file's or a PostgreSQL server's,
//! with the calls the commands make: the same answers from either, so a
//! command is written once.

use chrono::{DateTime, Utc};
use idemstore::{
    DestinationPolicy, DestinationState, Outbox, OutboxFilter, OutboxId, OutboxRecord, Result,
};

use crate::Failure;
use crate::target::Target;

/// An outbox, on a store file or on a PostgreSQL server.
pub(crate) enum OutboxHandle {
    File(Outbox),
    #[cfg(feature = "postgres")]
    Postgres(idemstore::postgres::PgOutbox),
}

/// The same call on whichever outbox `$h` holds.
macro_rules! both {
    ($h:expr, $o:ident => $call:expr) => {
        match $h {
            OutboxHandle::File($o) => $call,
            #[cfg(feature = "postgres")]
            OutboxHandle::Postgres($o) => $call,
        }
    };
}

impl OutboxHandle {
    pub(crate) fn list(&self, filter: &OutboxFilter, limit: usize) -> Result<Vec<OutboxRecord>> {
        both!(self, o => o.list(filter, limit))
    }

    pub(crate) fn get(&self, id: OutboxId) -> Result<OutboxRecord> {
        both!(self, o => o.get(id))
    }

    pub(crate) fn requeue(&self, id: OutboxId, due: DateTime<Utc>) -> Result<()> {
        both!(self, o => o.requeue(id, due))
    }

    pub(crate) fn cancel(&self, id: OutboxId, now: DateTime<Utc>) -> Result<()> {
        both!(self, o => o.cancel(id, now))
    }

    pub(crate) fn mark_completed(&self, id: OutboxId, now: DateTime<Utc>) -> Result<()> {
        both!(self, o => o.mark_completed(id, now))
    }

    pub(crate) fn mark_failed(&self, id: OutboxId, reason: &str, now: DateTime<Utc>) -> Result<()> {
        both!(self, o => o.mark_failed(id, reason, None, now))
    }

    pub(crate) fn release_expired_claims(&self, before: DateTime<Utc>) -> Result<Vec<OutboxId>> {
        both!(self, o => o.release_expired_claims(before))
    }

    pub(crate) fn purge_finished(&self, before: DateTime<Utc>) -> Result<u64> {
        both!(self, o => o.purge_finished(before))
    }

    pub(crate) fn destinations(&self) -> Result<Vec<DestinationState>> {
        both!(self, o => o.destinations())
    }

    pub(crate) fn pause_destination(&self, name: &str) -> Result<()> {
        both!(self, o => o.pause_destination(name))
    }

    pub(crate) fn resume_destination(&self, name: &str) -> Result<()> {
        both!(self, o => o.resume_destination(name))
    }

    pub(crate) fn set_destination_policy(&self, name: &str, p: DestinationPolicy) -> Result<()> {
        both!(self, o => o.set_destination_policy(name, p))
    }
}

/// The outbox of `target`'s store: an existing file (opened shared, as
/// every command opens it), or the store in `schema` (default `idemstore`)
/// on a PostgreSQL server, which must exist already: a command never
/// creates a store.
pub(crate) fn open_outbox(target: &Target, schema: Option<&str>) -> Result<OutboxHandle, Failure> {
    match target {
        Target::File(path) => {
            if schema.is_some() {
                return Err(Failure(format!(
                    "--schema names a PostgreSQL store's schema; {} is a store file",
                    path.display()
                )));
            }
            Ok(OutboxHandle::File(crate::open(path)?.outbox()))
        }
        Target::Postgres(url) => postgres::open(url, schema),
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use ::postgres::{Client, NoTls};
    use idemstore::postgres::{DEFAULT_SCHEMA, PgStore};

    use super::OutboxHandle;
    use crate::Failure;
    use crate::target::redact;

    /// The outbox of the store in `schema` at `url`, if there is one.
    pub(super) fn open(url: &str, schema: Option<&str>) -> Result<OutboxHandle, Failure> {
        let schema = schema.unwrap_or(DEFAULT_SCHEMA);
        let unreachable =
            |e: ::postgres::Error| Failure(format!("cannot reach {}: {e}", redact(url)));
        // Connecting a store creates its schema when there is none: look
        // first, so that a misspelt schema is an error, not a new store.
        let mut client = Client::connect(url, NoTls).map_err(unreachable)?;
        let found: bool = client
            .query_one(
                "SELECT to_regclass(format('%I.schema_version', $1::text)) IS NOT NULL",
                &[&schema],
            )
            .map_err(unreachable)?
            .get(0);
        drop(client);
        if !found {
            return Err(Failure(format!(
                "{} has no idemstore store in schema {schema:?} (give its schema with --schema)",
                redact(url)
            )));
        }
        let store = PgStore::builder()
            .schema(schema)
            .pool_size(2)
            .connect(url)?;
        Ok(OutboxHandle::Postgres(store.outbox()))
    }
}

#[cfg(not(feature = "postgres"))]
mod postgres {
    use super::OutboxHandle;
    use crate::Failure;
    use crate::target::redact;

    pub(super) fn open(url: &str, _: Option<&str>) -> Result<OutboxHandle, Failure> {
        Err(Failure(format!(
            "{} is a PostgreSQL connection string, and this build has no PostgreSQL \
             backend: install one with `cargo install idemstore --features cli,postgres`",
            redact(url)
        )))
    }
}
