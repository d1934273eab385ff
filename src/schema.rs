//! Every table of the store file, the format version, and how the store
//! opens its tables ([`open_read`], [`open_write`]: a table of ours with
//! other types is [`Error::IncompatibleFormat`]).
//!
//! All tables are named under a versioned prefix (`idemstore.v1.…`) and keyed
//! by typed tuples; no key is ever built by concatenating strings, so no
//! choice of bytes in a tenant, an inbox name or a key can reach another
//! namespace. Times are stored as `i64` microseconds since the Unix epoch.
//! Records are postcard bytes behind [`crate::codec`].
//!
//! Invariants between tables (each checked by the tests):
//! - inbox: a key is claimed iff it has a row `(inbox, key) → seen_at` in
//!   the ledger [`INBOX`] or a row `(inbox, id) → (key, seen_at)` in the
//!   journal [`INBOX_JOURNAL`], never both and never twice; a ledger row has its
//!   `(inbox, seen_at, key)` in [`INBOX_SEEN`] and vice versa (journal rows
//!   get theirs when merged into the ledger); [`INBOX_COUNT`] holds the
//!   number of ledger rows of each inbox (journal rows are counted when
//!   merged).
//! - outbox: see `src/outbox/index.rs` for the record, its four indexes,
//!   its attempt history and the status counters.
//! - idempotency keys: a row `(tenant, key)` exists iff
//!   `(created_at, tenant, key)` exists in [`IDEM_CREATED`], where
//!   `created_at` is the response's creation time for a completed row and the
//!   reservation time for a reserved one. Every fence token stored is below
//!   `META_IDEM_NEXT_FENCE` in [`META`].

use redb::{
    Key, ReadOnlyTable, ReadTransaction, Table, TableDefinition, TableError, Value,
    WriteTransaction,
};

use crate::error::{Error, Result};

/// The format this build writes and reads. A file with a larger number was
/// written by a newer, incompatible version.
pub(crate) const FORMAT_VERSION: u64 = 3;
/// The format of files written before destinations existed: they open,
/// and gain the destination tables ([`FORMAT_VERSION`]) on first open.
pub(crate) const FORMAT_VERSION_BEFORE_DESTINATIONS: u64 = 1;
/// The format of files written before the outbox's records were listed by
/// status: they open, and gain those rows on first open.
pub(crate) const FORMAT_VERSION_BEFORE_LISTING: u64 = 2;

/// Store-wide settings and counters: `format_version`, `outbox.next_id`,
/// `idempotency.next_fence`.
pub(crate) const META: TableDefinition<&str, u64> = TableDefinition::new("idemstore.meta");
pub(crate) const META_FORMAT_VERSION: &str = "format_version";

// ---------- inbox ----------

/// `(inbox, event key) → seen_at µs`.
pub(crate) const INBOX: TableDefinition<(&str, &str), i64> =
    TableDefinition::new("idemstore.v1.inbox");
/// `(inbox, seen_at µs, event key) → ()`: the prune index of [`INBOX`].
pub(crate) const INBOX_SEEN: TableDefinition<(&str, i64, &str), ()> =
    TableDefinition::new("idemstore.v1.inbox.seen_at");
/// `(inbox, id) → (event key, seen_at µs)`: recent claims not yet merged
/// into [`INBOX`] (see `src/inbox/journal.rs`).
pub(crate) const INBOX_JOURNAL: TableDefinition<(&str, u64), (&str, i64)> =
    TableDefinition::new("idemstore.v1.inbox.journal");
/// Key in [`META`] of the largest journal id ever merged into the ledger:
/// new journal ids are above it, even once the journal is empty, so an id
/// never names two claims (processes sharing the file rely on it).
pub(crate) const META_JOURNAL_MERGED_THROUGH: &str = "inbox.journal.merged_through";
/// `inbox → number of keys in the ledger`; with the inbox's journal rows
/// (at most `journal_size`), `len` without a scan of the ledger.
pub(crate) const INBOX_COUNT: TableDefinition<&str, u64> =
    TableDefinition::new("idemstore.v1.inbox.count");

// ---------- outbox ----------

/// `id → record` (postcard).
pub(crate) const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("idemstore.v1.outbox");
/// `id → state` (postcard): the state of each entry that changed since it
/// was enqueued (status, attempts, times, settlement details, place in its
/// sequence), in place of the state its row in [`OUTBOX`] was written
/// with. A claim or a settlement rewrites this small row only, never the
/// entry's payload.
pub(crate) const OUTBOX_STATE: TableDefinition<u64, &[u8]> =
    TableDefinition::new("idemstore.v1.outbox.state");
/// `(due µs, id) → ()` for `Pending` entries: the due index of format 1,
/// which each destination's queue ([`OUTBOX_QUEUE`]) replaced; deleted when
/// such a file is upgraded.
pub(crate) const OUTBOX_DUE: TableDefinition<(i64, u64), ()> =
    TableDefinition::new("idemstore.v1.outbox.due");
/// `(claimed_at µs, id) → ()` for `Dispatching` entries only.
pub(crate) const OUTBOX_CLAIMED: TableDefinition<(i64, u64), ()> =
    TableDefinition::new("idemstore.v1.outbox.claimed");
/// `(destination, idempotency key) → id`: uniqueness.
pub(crate) const OUTBOX_DEDUP: TableDefinition<(&str, &str), u64> =
    TableDefinition::new("idemstore.v1.outbox.dedup");
/// `(command id, created_at µs, id) → ()`: `list_for_command` in order.
pub(crate) const OUTBOX_BY_COMMAND: TableDefinition<(&str, i64, u64), ()> =
    TableDefinition::new("idemstore.v1.outbox.by_command");
/// `(completed_at µs, id) → ()` for `Completed` and `Failed` entries: retention.
pub(crate) const OUTBOX_FINISHED: TableDefinition<(i64, u64), ()> =
    TableDefinition::new("idemstore.v1.outbox.finished");
/// `(id, seq) → attempt record` (postcard): the attempt history of entry
/// `id`, oldest first (`seq` grows per entry), at most
/// [`MAX_ATTEMPT_HISTORY`](crate::MAX_ATTEMPT_HISTORY) rows per
/// entry, removed with the entry. Kept apart from [`OUTBOX`] so that the
/// hot row stays small and files of earlier builds (which have no history)
/// read unchanged.
pub(crate) const OUTBOX_ATTEMPTS: TableDefinition<(u64, u64), &[u8]> =
    TableDefinition::new("idemstore.v1.outbox.attempts");
/// `status code → number of entries`: format 1's counts, which the flows'
/// small rows ([`OUTBOX_FLOWS`]) replaced; deleted when such a file is
/// upgraded.
pub(crate) const OUTBOX_COUNT: TableDefinition<u8, u64> =
    TableDefinition::new("idemstore.v1.outbox.count");
/// The destinations' small rows (see `src/outbox/flow.rs`), by kind:
/// `(1, 0, destination) → flow record` (postcard: a destination's policy
/// and state), `(2, ready_at µs, destination) → []` (the ready line: each
/// destination that has an entry to give and may give it from `ready_at`
/// on), and `(0, 0, "") → counts` (postcard: the outbox's entries by
/// status code).
pub(crate) const OUTBOX_FLOWS: TableDefinition<(u8, i64, &str), &[u8]> =
    TableDefinition::new("idemstore.v1.outbox.flows");
/// `(destination, rank, due µs, id) → ()`: the claimable `Pending` entries
/// of each destination (`rank` = `MAX_PRIORITY - priority`).
pub(crate) const OUTBOX_QUEUE: TableDefinition<(&str, u8, i64, u64), ()> =
    TableDefinition::new("idemstore.v1.outbox.queue");
/// `(destination, ordering key, seq) → id`: the unfinished entries of each
/// ordering sequence, in order.
pub(crate) const OUTBOX_SEQUENCES: TableDefinition<(&str, &str, u64), u64> =
    TableDefinition::new("idemstore.v1.outbox.sequences");
/// Key in [`META`] of the next outbox id to hand out.
pub(crate) const META_OUTBOX_NEXT_ID: &str = "outbox.next_id";

// ---------- idempotency keys ----------

/// `(tenant, key) → record` (postcard): a completed response or a reservation.
/// Outbox schedules by name: the postcard-encoded record (destination,
/// payload, cron expression or interval, missed-slot policy, pause, the
/// last slot dealt with and the last one fired).
pub(crate) const OUTBOX_SCHEDULES: TableDefinition<&str, &[u8]> =
    TableDefinition::new("idemstore.v1.outbox.schedules");
/// The unpaused schedules by next slot (µs; `i64::MIN` until one starts):
/// what a firing reads.
pub(crate) const OUTBOX_SCHEDULE_DUE: TableDefinition<(i64, &str), ()> =
    TableDefinition::new("idemstore.v1.outbox.schedules.due");

pub(crate) const IDEM: TableDefinition<(&str, &str), &[u8]> =
    TableDefinition::new("idemstore.v1.idempotency");
/// `(created_at µs, tenant, key) → ()`: the expiry index.
pub(crate) const IDEM_CREATED: TableDefinition<(i64, &str, &str), ()> =
    TableDefinition::new("idemstore.v1.idempotency.created_at");
/// Key in [`META`] of the next reservation fence token to hand out. Store-wide
/// (not per row) so a token never repeats after a row is released, purged
/// or expired, nor across reopens.
pub(crate) const META_IDEM_NEXT_FENCE: &str = "idempotency.next_fence";

// ---------- opening the store's tables ----------

/// Opens one of the store's tables for reading; a table never written is
/// `None`. Use it for the store's own tables only (see [`store_table_error`]).
pub(crate) fn open_read<K: Key + 'static, V: Value + 'static>(
    tx: &ReadTransaction,
    def: TableDefinition<'static, K, V>,
) -> Result<Option<ReadOnlyTable<K, V>>> {
    match tx.open_table(def) {
        Ok(t) => Ok(Some(t)),
        Err(TableError::TableDoesNotExist(_)) => Ok(None),
        Err(e) => Err(store_table_error(e)),
    }
}

/// Opens one of the store's tables for writing, creating it if needed. Use
/// it for the store's own tables only (see [`store_table_error`]).
pub(crate) fn open_write<'tx, K: Key + 'static, V: Value + 'static>(
    tx: &'tx WriteTransaction,
    def: TableDefinition<'_, K, V>,
) -> Result<Table<'tx, K, V>> {
    tx.open_table(def).map_err(store_table_error)
}

/// The error for one of the store's own tables that could not be opened. A
/// table of ours with other types (or a multimap table under our name) means
/// the file was written by an incompatible version or by something else:
/// [`Error::IncompatibleFormat`]. Anything else is redb's error as it is.
/// (A caller's own table keeps redb's error: `From<TableError>`.)
pub(crate) fn store_table_error(e: TableError) -> Error {
    match e {
        TableError::TableTypeMismatch { .. }
        | TableError::TypeDefinitionChanged { .. }
        | TableError::TableIsMultimap(_) => Error::IncompatibleFormat {
            found: format!("a store table with other types ({e})"),
            supported: FORMAT_VERSION,
        },
        other => Error::from(other),
    }
}

#[cfg(test)]
mod tests {
    use redb::TableHandle as _;
    use redb::backends::InMemoryBackend;

    use super::*;

    #[test]
    fn a_store_table_with_other_types_is_an_incompatible_format() {
        let db = redb::Database::builder()
            .create_with_backend(InMemoryBackend::new())
            .unwrap();
        let tx = db.begin_write().unwrap();
        tx.open_table(TableDefinition::<u64, u64>::new(OUTBOX.name()))
            .unwrap();
        let err = open_write(&tx, OUTBOX).err().unwrap();
        assert!(
            matches!(&err, Error::IncompatibleFormat { found, .. } if found.contains(OUTBOX.name())),
            "{err:?}"
        );
        tx.commit().unwrap();
        let tx = redb::ReadableDatabase::begin_read(&db).unwrap();
        let err = open_read(&tx, OUTBOX).err().unwrap();
        assert!(matches!(err, Error::IncompatibleFormat { .. }), "{err:?}");
        assert!(open_read(&tx, OUTBOX_FLOWS).unwrap().is_none());
    }
}
