//! A command's store, a file or a PostgreSQL server's schema, and its
//! inboxes, outbox and idempotency keys, with the calls the commands make:
//! the same answers from either, so a command is written once.

use chrono::{DateTime, Utc};
use idemstore::{
    IdempotencyKeys, Inbox, KeyEntry, KeySummary, OutboxAdmin, ResponseRecord, Result, Store,
};

use crate::Failure;
use crate::target::Target;

/// A store file, or a store on a PostgreSQL server.
pub(crate) enum StoreHandle {
    File(Store),
    #[cfg(feature = "postgres")]
    Postgres(idemstore::postgres::PgStore),
}

/// An inbox of a [`StoreHandle`].
pub(crate) enum InboxHandle {
    File(Inbox),
    #[cfg(feature = "postgres")]
    Postgres(idemstore::postgres::PgInbox),
}

/// The idempotency keys of a [`StoreHandle`].
pub(crate) enum KeysHandle {
    File(IdempotencyKeys),
    #[cfg(feature = "postgres")]
    Postgres(idemstore::postgres::PgIdempotencyKeys),
}

/// An outbox, on a store file or on a PostgreSQL server: the calls an
/// operator makes, the library's own (`OutboxAdmin`).
pub(crate) type OutboxHandle = Box<dyn OutboxAdmin>;

/// The same call on whichever backend's value `$h` (a handle of type
/// `$t`) holds.
macro_rules! both {
    ($t:ident, $h:expr, $o:ident => $call:expr) => {
        match $h {
            $t::File($o) => $call,
            #[cfg(feature = "postgres")]
            $t::Postgres($o) => $call,
        }
    };
}

impl StoreHandle {
    pub(crate) fn outbox(&self) -> OutboxHandle {
        match self {
            StoreHandle::File(s) => Box::new(s.outbox()),
            #[cfg(feature = "postgres")]
            StoreHandle::Postgres(s) => Box::new(s.outbox()),
        }
    }

    pub(crate) fn inbox(&self, name: &str) -> Result<InboxHandle> {
        Ok(match self {
            StoreHandle::File(s) => InboxHandle::File(s.inbox(name)?),
            #[cfg(feature = "postgres")]
            StoreHandle::Postgres(s) => InboxHandle::Postgres(s.inbox(name)?),
        })
    }

    pub(crate) fn keys(&self) -> KeysHandle {
        match self {
            StoreHandle::File(s) => KeysHandle::File(s.idempotency_keys()),
            #[cfg(feature = "postgres")]
            StoreHandle::Postgres(s) => KeysHandle::Postgres(s.idempotency_keys()),
        }
    }

    pub(crate) fn inbox_names(&self) -> Result<Vec<String>> {
        both!(StoreHandle, self, s => s.inbox_names())
    }
}

impl InboxHandle {
    pub(crate) fn list(
        &self,
        after: Option<(DateTime<Utc>, &str)>,
        limit: usize,
    ) -> Result<Vec<(String, DateTime<Utc>)>> {
        both!(InboxHandle, self, i => i.list(after, limit))
    }

    pub(crate) fn len(&self) -> Result<u64> {
        both!(InboxHandle, self, i => i.len())
    }

    pub(crate) fn prune(&self, before: DateTime<Utc>) -> Result<u64> {
        both!(InboxHandle, self, i => i.prune(before))
    }
}

impl KeysHandle {
    pub(crate) fn list(&self, tenant: Option<&str>, limit: usize) -> Result<Vec<KeyEntry>> {
        both!(KeysHandle, self, k => k.list(tenant, limit))
    }

    pub(crate) fn list_after(
        &self,
        after: Option<(&str, &str)>,
        limit: usize,
    ) -> Result<Vec<KeyEntry>> {
        both!(KeysHandle, self, k => k.list_after(after, limit))
    }

    pub(crate) fn response(&self, tenant: &str, key: &str) -> Result<Option<ResponseRecord>> {
        both!(KeysHandle, self, k => k.response(tenant, key))
    }

    pub(crate) fn summary(&self) -> Result<KeySummary> {
        both!(KeysHandle, self, k => k.summary())
    }

    pub(crate) fn purge_expired(&self, before: DateTime<Utc>) -> Result<u64> {
        both!(KeysHandle, self, k => k.purge_expired(before))
    }

    pub(crate) fn check_indexes(&self) -> Result<Vec<String>> {
        both!(KeysHandle, self, k => k.check_indexes())
    }
}

/// The outbox of `target`'s store (see [`open_store`]).
pub(crate) fn open_outbox(target: &Target, schema: Option<&str>) -> Result<OutboxHandle, Failure> {
    Ok(open_store(target, schema)?.outbox())
}

/// `target`'s store: an existing file (opened shared, as every command
/// opens it), or the store in `schema` (default `idemstore`) on a
/// PostgreSQL server, which must exist already: a command never creates a
/// store.
pub(crate) fn open_store(target: &Target, schema: Option<&str>) -> Result<StoreHandle, Failure> {
    match target {
        Target::File(path) => {
            if schema.is_some() {
                return Err(Failure(format!(
                    "--schema names a PostgreSQL store's schema; {} is a store file",
                    path.display()
                )));
            }
            Ok(StoreHandle::File(crate::open(path)?))
        }
        Target::Postgres(url) => postgres::open(url, schema),
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use idemstore::postgres::tokio_postgres::{self, NoTls};
    use idemstore::postgres::{DEFAULT_SCHEMA, PgStore};

    use super::StoreHandle;
    use crate::Failure;
    use crate::target::redact;

    /// The store in `schema` at `url`, if there is one.
    pub(super) fn open(url: &str, schema: Option<&str>) -> Result<StoreHandle, Failure> {
        let schema = schema.unwrap_or(DEFAULT_SCHEMA);
        let unreachable =
            |e: tokio_postgres::Error| Failure(format!("cannot reach {}: {e}", redact(url)));
        // Connecting a store creates its schema when there is none: look
        // first, so that a misspelt schema is an error, not a new store.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Failure(format!("cannot start a runtime: {e}")))?;
        let found: bool = rt
            .block_on(async {
                let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
                let driven = tokio::spawn(connection);
                let row = client
                    .query_one(
                        "SELECT to_regclass(format('%I.schema_version', $1::text)) IS NOT NULL",
                        &[&schema],
                    )
                    .await;
                drop(client);
                let _ = driven.await;
                Ok(row?.get(0))
            })
            .map_err(unreachable)?;
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
        Ok(StoreHandle::Postgres(store))
    }
}

#[cfg(not(feature = "postgres"))]
mod postgres {
    use super::StoreHandle;
    use crate::Failure;
    use crate::target::redact;

    pub(super) fn open(url: &str, _: Option<&str>) -> Result<StoreHandle, Failure> {
        Err(Failure(format!(
            "{} is a PostgreSQL connection string, and this build has no PostgreSQL \
             backend: install one with `cargo install idemstore --features cli,postgres`",
            redact(url)
        )))
    }
}
