//! The store's tables in its schema, and the versioned migrations that
//! create them.
//!
//! All tables live in one schema (`S`, default `idemstore`). Times are
//! `bigint` microseconds since the Unix epoch, as in the embedded store's
//! records, and always the caller's `now`: no statement reads the server's
//! clock. Strings the caller chooses (event keys, tenants, idempotency keys,
//! outbox fields, fingerprints) are stored as their UTF-8 bytes in `bytea`
//! columns, because PostgreSQL's `text` cannot hold a NUL and the embedded
//! store accepts any string; `bytea` compares bytewise, as the embedded
//! store's keys do, so listings come in the same order. Inbox names (checked
//! ASCII) are `text`, which orders by the database's collation: the store
//! sorts its listing of them in byte order itself.
//!
//! | table                 | row                                                             | indexes |
//! |-----------------------|-----------------------------------------------------------------|---------|
//! | `S.schema_version`    | the one row: the version of the last migration applied         | — |
//! | `S.inbox`             | `(inbox, event_key) → seen_at`                                   | `(inbox, seen_at, event_key)` (prune, list) |
//! | `S.outbox`            | `id → entry, status, attempt, settlement details`, and the entry's `ordering_key`, `priority`, `seq` (its place in its ordering sequence while unfinished) and `waiting` (behind an unfinished entry of its sequence) | unique `(destination, idempotency_key)`; claims `(claimed_at, id) WHERE status = 'dispatching'`; finished `(completed_at, id) WHERE status IN ('completed', 'failed')`; `(command_id, created_at, id)`; claimable ones by destination and priority: queue `(destination, priority, due, id) WHERE status = 'pending' AND NOT waiting`; sequences `(destination, ordering_key, seq) WHERE seq IS NOT NULL`; in flight `(destination) WHERE status = 'dispatching'` |
//! | `S.destinations`      | `destination →` policy, pause, token bucket, circuit, hold, `served_at` | — |
//! | `S.outbox_attempts`   | `(id, seq) → attempt record`, at most 20 per entry, deleted with it | — |
//! | `S.idempotency`       | `(tenant, idem_key) →` a reservation (`lease_until` set) or a response (`status` set) | `(created_at, tenant, idem_key)` (expiry) |
//! | `S.idempotency_fence` | the sequence of fence tokens, store-wide, never reused          | — |
//! | `S.schedules`         | `name →` destination, payload, cron (and its time zone) or interval, missed-slot policy, pause, the last slot dealt with and fired, the next slot | `(next_slot) WHERE next_slot IS NOT NULL` (firings) |
//!
//! The outbox's row invariants are `CHECK` constraints: the attempt
//! (`worker_id`, `claimed_at`) is set iff the entry is `dispatching` or
//! `outcome_unknown`, `completed_at` iff it is `completed` or `failed`, `seq`
//! iff it has an ordering key and is not finished. A
//! trigger sends `NOTIFY S_outbox` whenever a row becomes (or stays)
//! `pending` — an enqueue, a retry, a reschedule, a requeue, a released
//! claim — in the writing transaction, so it reaches the listeners at
//! commit, whoever wrote it.
//!
//! # Migrations
//!
//! [`migrate`] runs on connect. When the recorded version is the latest it
//! only reads it; otherwise, in one transaction holding a transaction-level
//! advisory lock named after the schema (so processes connecting at once
//! migrate one after the other, and the later ones find the work done), it
//! creates the schema if needed and applies every migration above the
//! recorded version. A version above [`SCHEMA_VERSION`] (a newer build
//! migrated the schema) is [`Error::IncompatibleFormat`] and changes
//! nothing. Migrations are append-only: a released one never changes.

use tokio_postgres::{Client, GenericClient};

use crate::error::{Error, Result};

/// The schema version this build creates and reads.
pub const SCHEMA_VERSION: u64 = 5;

/// Longest schema name accepted: the notification channel `<schema>_outbox`
/// must fit PostgreSQL's 63-byte identifiers.
const MAX_SCHEMA_LEN: usize = 48;

/// The migrations, in order: migration `i + 1` is `MIGRATIONS[i]`, with
/// `{s}` standing for the schema.
const MIGRATIONS: &[&str] = &[V1, V2, V3, V4, V5];

const V1: &str = r"
CREATE TABLE {s}.inbox (
    inbox     text   NOT NULL,
    event_key bytea  NOT NULL,
    seen_at   bigint NOT NULL,
    PRIMARY KEY (inbox, event_key)
);
CREATE INDEX inbox_seen_at ON {s}.inbox (inbox, seen_at, event_key);

CREATE TABLE {s}.outbox (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    command_id      bytea  NOT NULL,
    destination     bytea  NOT NULL,
    idempotency_key bytea  NOT NULL,
    payload         bytea  NOT NULL,
    status          text   NOT NULL CHECK (status IN
                        ('pending', 'dispatching', 'completed', 'failed', 'outcome_unknown')),
    attempt_count   bigint NOT NULL CHECK (attempt_count BETWEEN 0 AND 4294967295),
    next_attempt_at bigint,
    created_at      bigint NOT NULL,
    completed_at    bigint,
    worker_id       bytea,
    claimed_at      bigint,
    last_failure    bytea,
    remote_ref      bytea,
    UNIQUE (destination, idempotency_key),
    CHECK ((worker_id IS NULL) = (claimed_at IS NULL)),
    CHECK ((claimed_at IS NOT NULL) = (status IN ('dispatching', 'outcome_unknown'))),
    CHECK ((completed_at IS NOT NULL) = (status IN ('completed', 'failed')))
);
CREATE INDEX outbox_due ON {s}.outbox ((coalesce(next_attempt_at, created_at)), id)
    WHERE status = 'pending';
CREATE INDEX outbox_claimed ON {s}.outbox (claimed_at, id) WHERE status = 'dispatching';
CREATE INDEX outbox_finished ON {s}.outbox (completed_at, id)
    WHERE status IN ('completed', 'failed');
CREATE INDEX outbox_by_command ON {s}.outbox (command_id, created_at, id);

CREATE TABLE {s}.outbox_attempts (
    id         bigint NOT NULL REFERENCES {s}.outbox (id) ON DELETE CASCADE,
    seq        bigint NOT NULL,
    attempt    bigint NOT NULL,
    at         bigint NOT NULL,
    reason     bytea  NOT NULL,
    remote_ref bytea,
    PRIMARY KEY (id, seq)
);

CREATE FUNCTION {s}.outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{s}_outbox', '');
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_notify AFTER INSERT OR UPDATE ON {s}.outbox
    FOR EACH ROW WHEN (NEW.status = 'pending') EXECUTE FUNCTION {s}.outbox_notify();

CREATE TABLE {s}.idempotency (
    tenant        bytea  NOT NULL,
    idem_key      bytea  NOT NULL,
    fingerprint   bytea  NOT NULL,
    fence         bigint NOT NULL,
    created_at    bigint NOT NULL,
    lease_until   bigint,
    status        integer,
    content_type  text,
    header_names  text[],
    header_values text[],
    body          bytea,
    PRIMARY KEY (tenant, idem_key),
    CHECK ((lease_until IS NULL) = (status IS NOT NULL)),
    CHECK ((status IS NULL) = (body IS NULL)),
    CHECK ((status IS NULL) = (header_names IS NULL)),
    CHECK ((status IS NULL) = (header_values IS NULL))
);
CREATE INDEX idempotency_created_at ON {s}.idempotency (created_at, tenant, idem_key);
CREATE SEQUENCE {s}.idempotency_fence AS bigint MINVALUE 1;
";

/// Destinations: the entries' ordering keys, priorities and places in
/// their sequences, and the destinations' policies and flow state. Rows
/// of an older schema get no ordering key and priority 0. The queue index
/// replaces the first schema's due index, which claims no longer read.
const V2: &str = r"
ALTER TABLE {s}.outbox
    ADD COLUMN ordering_key bytea,
    ADD COLUMN priority     smallint NOT NULL DEFAULT 0 CHECK (priority BETWEEN 0 AND 9),
    ADD COLUMN seq          bigint,
    ADD COLUMN waiting      boolean  NOT NULL DEFAULT false,
    ADD CHECK (seq IS NULL OR ordering_key IS NOT NULL),
    ADD CHECK ((seq IS NOT NULL) = (ordering_key IS NOT NULL
                                    AND status NOT IN ('completed', 'failed'))),
    ADD CHECK (NOT waiting OR seq IS NOT NULL);
CREATE INDEX outbox_queue ON {s}.outbox
    (destination, priority, (coalesce(next_attempt_at, created_at)), id)
    WHERE status = 'pending' AND NOT waiting;
DROP INDEX {s}.outbox_due;
CREATE INDEX outbox_sequences ON {s}.outbox (destination, ordering_key, seq)
    WHERE seq IS NOT NULL;
CREATE INDEX outbox_in_flight ON {s}.outbox (destination) WHERE status = 'dispatching';

CREATE TABLE {s}.destinations (
    destination       bytea  PRIMARY KEY,
    max_in_flight     bigint CHECK (max_in_flight BETWEEN 1 AND 4294967295),
    rate_per_second   double precision CHECK (rate_per_second > 0),
    rate_burst        bigint CHECK (rate_burst BETWEEN 1 AND 4294967295),
    circuit_failures  bigint CHECK (circuit_failures BETWEEN 1 AND 4294967295),
    circuit_cool_down bigint CHECK (circuit_cool_down > 0),
    paused            boolean NOT NULL DEFAULT false,
    tokens            double precision,
    tokens_at         bigint  NOT NULL DEFAULT 0,
    failures          bigint  NOT NULL DEFAULT 0 CHECK (failures BETWEEN 0 AND 4294967295),
    trips             bigint  NOT NULL DEFAULT 0 CHECK (trips BETWEEN 0 AND 4294967295),
    open_until        bigint,
    probe             bigint,
    held_until        bigint,
    served_at         bigint  NOT NULL DEFAULT 0,
    CHECK ((rate_per_second IS NULL) = (rate_burst IS NULL)),
    CHECK ((circuit_failures IS NULL) = (circuit_cool_down IS NULL))
);
";

/// The entries an operator looks for, by id: the failed and the in-doubt
/// (few, where most entries complete). Partial, so the hot path (claims,
/// completions) never writes it; listings of those statuses read it.
const V3: &str = r"
CREATE INDEX outbox_held ON {s}.outbox (status, id)
    WHERE status IN ('failed', 'outcome_unknown');
";

/// A destination's weight: its share of a dispatcher's workers while busy
/// (`NULL`: 1).
const V4: &str = r"
ALTER TABLE {s}.destinations
    ADD COLUMN weight bigint CHECK (weight BETWEEN 1 AND 4294967295);
";

/// Outbox schedules: one row per name, with its next slot (`NULL` while
/// paused or with no slot left; the smallest `bigint` until it starts),
/// indexed for the firings.
const V5: &str = r"
CREATE TABLE {s}.schedules (
    name bytea PRIMARY KEY,
    destination bytea NOT NULL,
    payload bytea NOT NULL,
    cron text,
    time_zone text CHECK (time_zone IS NULL OR cron IS NOT NULL),
    every_us bigint CHECK (every_us > 0),
    missed text NOT NULL CHECK (missed IN ('latest', 'all', 'none')),
    paused boolean NOT NULL,
    after_us bigint,
    last_fired bigint,
    next_slot bigint,
    CHECK ((cron IS NULL) <> (every_us IS NULL))
);
CREATE INDEX schedules_due ON {s}.schedules (next_slot) WHERE next_slot IS NOT NULL;
";

/// The channel the outbox's trigger notifies: `<schema>_outbox`.
pub(super) fn channel(schema: &str) -> String {
    format!("{schema}_outbox")
}

/// Checks a schema name: 1–48 bytes of lowercase ASCII letters, digits and
/// `_`, starting with a letter or `_`, not `pg_…` (PostgreSQL's own). An
/// empty name or a bad character is [`Error::InvalidInput`], a longer name
/// [`Error::TooLarge`]. Such a name needs no quoting unless it is a
/// reserved keyword, which [`check_not_keyword`] refuses at connect; past
/// both checks it goes into statements, string literals (`nextval('S.…')`)
/// and channel names as it is.
pub(super) fn check_schema_name(name: &str) -> Result<()> {
    crate::error::check_len("schema", name, MAX_SCHEMA_LEN)?;
    let bad = |why: String| Err(Error::invalid("schema", why));
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_'))
    {
        return bad(format!(
            "{c:?} is not allowed; use lowercase ASCII letters, digits and '_'"
        ));
    }
    if name.starts_with(|c: char| c.is_ascii_digit()) {
        return bad("must start with a letter or '_'".into());
    }
    if name.starts_with("pg_") {
        return bad("names starting with \"pg_\" are reserved by PostgreSQL".into());
    }
    Ok(())
}

/// Refuses a schema name that is a reserved keyword of the server's SQL
/// (`user`, `select`, `order`, `current_user`, …): unquoted, as the store
/// writes it, it makes every statement a syntax error. Asks the server
/// (`pg_get_keywords`), whose list changes between versions.
pub(super) async fn check_not_keyword(client: &Client, name: &str) -> Result<()> {
    let reserved: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_get_keywords() \
             WHERE word = $1 AND catcode IN ('R', 'T'))",
            &[&name],
        )
        .await?
        .try_get(0)?;
    if reserved {
        return Err(Error::invalid(
            "schema",
            format!("{name:?} is a reserved SQL keyword; choose another name"),
        ));
    }
    Ok(())
}

/// The advisory lock key of `schema`'s migrations: a stable 64-bit hash
/// (FNV-1a) of `idemstore:<schema>`, so that other schemas migrate
/// concurrently.
fn lock_key(schema: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in b"idemstore:".iter().chain(schema.as_bytes()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    i64::from_ne_bytes(h.to_ne_bytes())
}

/// The version recorded in `schema`, `None` if it has no version table
/// (a new schema).
async fn recorded(client: &(impl GenericClient + Sync), schema: &str) -> Result<Option<u64>> {
    // A query of the catalog's tables, not `to_regclass`: that reads the
    // session's catalog cache, which taking an advisory lock does not
    // refresh, so a process that waited for another's migration would not
    // see its tables.
    let exists = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = 'schema_version')",
            &[&schema],
        )
        .await?
        .try_get::<_, bool>(0)?;
    if !exists {
        return Ok(None);
    }
    let row = client
        .query_opt(&format!("SELECT version FROM {schema}.schema_version"), &[])
        .await?;
    let version = match row {
        Some(r) => r.try_get::<_, i64>(0)?,
        None => 0,
    };
    Ok(Some(
        u64::try_from(version).map_err(|_| incompatible(schema, version))?,
    ))
}

/// A schema at a version this build cannot read (a newer one's, or a
/// negative one).
fn incompatible(schema: &str, version: impl std::fmt::Display) -> Error {
    Error::IncompatibleFormat {
        found: format!("PostgreSQL schema {schema} at version {version}"),
        supported: SCHEMA_VERSION,
    }
}

/// Creates or migrates `schema` to [`SCHEMA_VERSION`] (see the module
/// docs).
pub(super) async fn migrate(client: &mut Client, schema: &str) -> Result<()> {
    match recorded(&*client, schema).await? {
        Some(v) if v == SCHEMA_VERSION => return Ok(()),
        Some(v) if v > SCHEMA_VERSION => return Err(incompatible(schema, v)),
        _ => {}
    }
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&lock_key(schema)])
        .await?;
    // Another process may have migrated while this one waited.
    let found = recorded(&tx, schema).await?;
    let from = match found {
        Some(v) if v > SCHEMA_VERSION => return Err(incompatible(schema, v)),
        Some(v) => v,
        None => {
            let exists = tx
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)",
                    &[&schema],
                )
                .await?
                .try_get::<_, bool>(0)?;
            if !exists {
                tx.batch_execute(&format!("CREATE SCHEMA {schema}")).await?;
            }
            tx.batch_execute(&format!(
                "CREATE TABLE {schema}.schema_version (
                     one     boolean PRIMARY KEY DEFAULT true CHECK (one),
                     version bigint  NOT NULL
                 );
                 INSERT INTO {schema}.schema_version (version) VALUES (0);"
            ))
            .await?;
            0
        }
    };
    let mut version = from;
    for sql in MIGRATIONS
        .iter()
        .skip(usize::try_from(from).unwrap_or(usize::MAX))
    {
        tx.batch_execute(&sql.replace("{s}", schema)).await?;
        version += 1;
    }
    let v = i64::try_from(version).unwrap_or(i64::MAX);
    tx.execute(
        &format!("UPDATE {schema}.schema_version SET version = $1"),
        &[&v],
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

/// The connect's futures are `Send`: a check at compile time, never run.
#[cfg(test)]
fn _send(client: &mut Client) {
    fn is_send<T: Send>(_: T) {}
    is_send(check_not_keyword(client, "s"));
    is_send(migrate(client, "s"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_checked() {
        for bad in [
            "",
            "Idem",
            "has space",
            "a-b",
            "a.b",
            "1abc",
            "pg_x",
            "ü",
            "a\"b",
        ] {
            assert!(
                matches!(check_schema_name(bad), Err(Error::InvalidInput { .. })),
                "{bad:?}"
            );
        }
        assert!(matches!(
            check_schema_name(&"a".repeat(49)),
            Err(Error::TooLarge { .. })
        ));
        for good in ["idemstore", "_t1", "tenant_42", &"a".repeat(48)] {
            assert!(check_schema_name(good).is_ok(), "{good:?}");
        }
        assert!(channel(&"a".repeat(48)).len() <= 63);
    }

    #[test]
    fn every_version_has_its_migration() {
        assert_eq!(MIGRATIONS.len() as u64, SCHEMA_VERSION);
        assert_ne!(lock_key("a"), lock_key("b"));
        assert_eq!(lock_key("idemstore"), lock_key("idemstore"));
    }
}
