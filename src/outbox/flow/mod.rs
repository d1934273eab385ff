//! The destinations' tables in the embedded store, and the invariants
//! between them and the records (kept by [`Flows`], checked by [`check`]):
//!
//! | table                | row                                     | present when |
//! |----------------------|-----------------------------------------|--------------|
//! | [`OUTBOX_SEQUENCES`] | `(destination, ordering key, seq) → id` | the record has an ordering key and is not `Completed` or `Failed` |
//! | [`OUTBOX_QUEUE`]     | `(destination, rank, due, id)`          | the record is `Pending` and either has no ordering key or is the first of its sequence |
//! | [`OUTBOX_FLOWS`]     | `(RECORD, 0, destination) → flow record` | the destination has a record, a policy or a pause |
//! | [`OUTBOX_FLOWS`]     | `(READY, ready_at, destination) → claimable_from` | the destination has a queued record and [`Flow::open_from`] is some time |
//! | [`OUTBOX_FLOWS`]     | `(COUNTS, 0, "") → counts by status`    | the outbox has a record |
//! | [`OUTBOX_FLOWS`]     | `(SERVED, 0, "") → served_at`           | a claim took an entry: the latest time one did (at least every destination's own) |
//! | [`OUTBOX_FLOWS`]     | `(LISTED + status, id, destination) → []` | the record is in that status and it is not `Dispatching` |
//!
//! The small rows (flow records, the ready line, the outbox's counts, the
//! records by status) share one table, told apart by their first key field: every write of a
//! record changes some of each, and each table a transaction writes costs
//! its commit a page or two more.
//!
//! `rank` is [`MAX_PRIORITY`] minus the record's priority, so a
//! destination's queue reads highest priority first, then earliest due,
//! then id. A flow record counts its destination's records by status (the
//! `Dispatching` count is its in-flight count, which a cap limits) and its
//! queued records by rank, and remembers its own row in the ready line.
//! The row holds when the destination is claimable from (the later of when
//! its flow opens and its earliest queued due time) and is keyed by the
//! later of that and when a claim last took one of its entries. Claims
//! walk the ready line from the front, so the destination served longest
//! ago goes first: fair sharing, at O(log n) per destination visited,
//! whatever the backlog. A claim whose time is behind another's (two
//! workers' clocks read a moment apart) walks on past its own time to the
//! latest time a claim served (`SERVED`) and takes the destinations
//! claimable at its time there too: a destination just served by the
//! other claim is behind in the line, not out of it.
//!
//! The records by status are what a listing of one status pages through
//! (by id, skipping other destinations by key alone), so an operator's
//! "the failed entries of B" reads those, however many others there are.
//! `Dispatching` records have none: the claims index (`(claimed_at, id)`,
//! as many rows as entries in flight) lists them, and a claim and its
//! settlement, the hot path, write two such rows fewer.

use std::collections::BTreeMap;

use redb::{ReadTransaction, ReadableTable, Table, TableHandle as _, WriteTransaction};
use serde::{Deserialize, Serialize};

mod check;

pub(super) use check::check;

use super::destinations::{Flow, MAX_PRIORITY, PolicyParts};
use super::index::{RecordTables, decode_row, load_row};
use super::record::RowKeys;
use super::rules::Row;
use super::{OutboxCounts, OutboxStatus};
use crate::codec::{decode, encode};
use crate::error::{Error, Result};
use crate::schema::{
    OUTBOX, OUTBOX_COUNT, OUTBOX_DUE, OUTBOX_FLOWS, OUTBOX_QUEUE, OUTBOX_SEQUENCES, OUTBOX_STATE,
    open_read, open_write,
};

/// Ranks: one per priority.
const RANKS: usize = MAX_PRIORITY as usize + 1;

/// The first key field of the outbox's counts by status in
/// [`OUTBOX_FLOWS`].
const COUNTS: u8 = 0;
/// The first key field of a flow record in [`OUTBOX_FLOWS`].
const RECORD: u8 = 1;
/// The first key field of a row of the ready line in [`OUTBOX_FLOWS`].
const READY: u8 = 2;
/// The first key field of the latest time a claim served, in
/// [`OUTBOX_FLOWS`].
const SERVED: u8 = 3;
/// The first key field of the records of status code 0 by id, in
/// [`OUTBOX_FLOWS`]; `LISTED + code` for the others.
pub(super) const LISTED: u8 = 16;
/// The key of the latest time a claim served.
const SERVED_KEY: (u8, i64, &str) = (SERVED, 0, "");
/// The key of the outbox's counts.
const COUNTS_KEY: (u8, i64, &str) = (COUNTS, 0, "");

/// A row of [`OUTBOX_FLOWS`]'s key.
pub(super) type FlowKey<'a> = (u8, i64, &'a str);

/// The key of record `id`'s row among the records of its `status`, if it
/// has one (`Dispatching` records have none). Ids stay below 2^63 (they
/// count enqueues from 1).
pub(super) fn listed_key(status: OutboxStatus, id: u64, destination: &str) -> Option<FlowKey<'_>> {
    (status != OutboxStatus::Dispatching)
        .then(|| (LISTED + status.code(), id.cast_signed(), destination))
}

/// The rows of the records of `status` with ids in `lo..=hi`, to page
/// through (ids stay below 2^63).
pub(super) fn listed_between(
    status: OutboxStatus,
    lo: u64,
    hi: u64,
) -> std::ops::Range<FlowKey<'static>> {
    let kind = LISTED + status.code();
    let end = match hi.checked_add(1).and_then(|h| i64::try_from(h).ok()) {
        Some(h) => (kind, h, ""),
        None => (kind + 1, i64::MIN, ""),
    };
    (kind, i64::try_from(lo).unwrap_or(i64::MAX), "")..end
}

/// The rows of one kind of [`OUTBOX_FLOWS`].
fn kind(kind: u8) -> std::ops::Range<FlowKey<'static>> {
    (kind, i64::MIN, "")..(kind.saturating_add(1), i64::MIN, "")
}

/// The outbox's records by status code, as stored.
type Totals = [u64; 5];

/// The outbox's counts as stored, by status code.
fn decode_totals(bytes: &[u8]) -> Result<Totals> {
    decode(OUTBOX_FLOWS.name(), &"counts", bytes)
}

/// A time as stored in a small row (`what` names the row in an error).
fn decode_time(what: &str, bytes: &[u8]) -> Result<i64> {
    decode(OUTBOX_FLOWS.name(), &what, bytes)
}

/// The outbox's records by status code (zeros if none was ever written).
pub(super) fn read_totals(tx: &ReadTransaction) -> Result<Totals> {
    let Some(t) = open_read(tx, OUTBOX_FLOWS)? else {
        return Ok(Totals::default());
    };
    match t.get(COUNTS_KEY)? {
        Some(v) => decode_totals(v.value()),
        None => Ok(Totals::default()),
    }
}

/// A destination's flow record: its [`Flow`] and the embedded store's
/// bookkeeping of its rows.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct DestRec {
    pub(super) flow: Flow,
    /// Its records by status code.
    pub(super) counts: [u64; 5],
    /// Its rows in [`OUTBOX_QUEUE`] by rank.
    queued: [u64; RANKS],
    /// When a claim last took one of its entries (µs).
    served_at: i64,
    /// Its row in the ready line: the row's time, and when it is
    /// claimable from.
    ready: Option<(i64, i64)>,
    /// The earliest due time among its rows in [`OUTBOX_QUEUE`], kept so
    /// that an operation that leaves the queue alone (a completion, a
    /// final failure) need not read it.
    earliest: Option<i64>,
    /// Whether `earliest` must be read again from the queue (an operation
    /// removed the row it was the time of). Not stored.
    stale: bool,
}

/// A [`DestRec`] as stored. Field order is the wire format: append only.
#[derive(Serialize, Deserialize)]
struct StoredDest {
    max_in_flight: Option<u32>,
    rate: Option<(f64, u32)>,
    circuit: Option<(u32, i64)>,
    paused: bool,
    tokens: Option<f64>,
    tokens_at: i64,
    failures: u32,
    trips: u32,
    open_until: Option<i64>,
    probe: Option<u64>,
    held_until: Option<i64>,
    counts: [u64; 5],
    queued: [u64; RANKS],
    served_at: i64,
    ready: Option<(i64, i64)>,
    earliest: Option<i64>,
    /// Appended with weights: a row written before has none (see
    /// [`DestRec::decode`]).
    weight: Option<u32>,
}

/// A [`StoredDest`] as written before weights: the same fields but the
/// last. Read when a row is one field short.
#[derive(Deserialize)]
struct StoredDestBeforeWeights {
    max_in_flight: Option<u32>,
    rate: Option<(f64, u32)>,
    circuit: Option<(u32, i64)>,
    paused: bool,
    tokens: Option<f64>,
    tokens_at: i64,
    failures: u32,
    trips: u32,
    open_until: Option<i64>,
    probe: Option<u64>,
    held_until: Option<i64>,
    counts: [u64; 5],
    queued: [u64; RANKS],
    served_at: i64,
    ready: Option<(i64, i64)>,
    earliest: Option<i64>,
}

impl From<StoredDestBeforeWeights> for StoredDest {
    fn from(s: StoredDestBeforeWeights) -> StoredDest {
        StoredDest {
            max_in_flight: s.max_in_flight,
            rate: s.rate,
            circuit: s.circuit,
            paused: s.paused,
            tokens: s.tokens,
            tokens_at: s.tokens_at,
            failures: s.failures,
            trips: s.trips,
            open_until: s.open_until,
            probe: s.probe,
            held_until: s.held_until,
            counts: s.counts,
            queued: s.queued,
            served_at: s.served_at,
            ready: s.ready,
            earliest: s.earliest,
            weight: None,
        }
    }
}

impl DestRec {
    fn encode(&self) -> Vec<u8> {
        let f = &self.flow;
        encode(&StoredDest {
            max_in_flight: f.policy.max_in_flight,
            rate: f.policy.rate,
            circuit: f.policy.circuit,
            paused: f.paused,
            tokens: f.tokens,
            tokens_at: f.tokens_at,
            failures: f.failures,
            trips: f.trips,
            open_until: f.open_until,
            probe: f.probe,
            held_until: f.held_until,
            counts: self.counts,
            queued: self.queued,
            served_at: self.served_at,
            ready: self.ready,
            earliest: self.earliest,
            weight: f.policy.weight,
        })
    }

    pub(super) fn decode(destination: &str, bytes: &[u8]) -> Result<DestRec> {
        // A row of a file written before weights is one field short: the
        // new layout fails on it, the old one reads all of it.
        let s: StoredDest = match decode(OUTBOX_FLOWS.name(), &destination, bytes) {
            Ok(s) => s,
            Err(new) => {
                match decode::<StoredDestBeforeWeights>(OUTBOX_FLOWS.name(), &destination, bytes) {
                    Ok(old) => old.into(),
                    Err(_) => return Err(new),
                }
            }
        };
        let rec = DestRec {
            flow: Flow {
                policy: PolicyParts {
                    max_in_flight: s.max_in_flight,
                    rate: s.rate,
                    circuit: s.circuit,
                    weight: s.weight,
                },
                paused: s.paused,
                in_flight: at(&s.counts, OutboxStatus::Dispatching.code()),
                tokens: s.tokens,
                tokens_at: s.tokens_at,
                failures: s.failures,
                trips: s.trips,
                open_until: s.open_until,
                probe: s.probe,
                held_until: s.held_until,
            },
            counts: s.counts,
            queued: s.queued,
            served_at: s.served_at,
            ready: s.ready,
            earliest: s.earliest,
            stale: false,
        };
        let bad = |reason: &str| Error::Corrupted {
            table: OUTBOX_FLOWS.name(),
            key: destination.to_owned(),
            reason: reason.to_owned(),
        };
        if let Some((per_second, burst)) = rec.flow.policy.rate
            && (!per_second.is_finite() || per_second <= 0.0 || burst == 0)
        {
            return Err(bad("a rate limit out of range"));
        }
        if rec.flow.tokens.is_some_and(|t| !t.is_finite()) {
            return Err(bad("a token count out of range"));
        }
        if rec.flow.policy.weight == Some(0) {
            return Err(bad("a weight of 0"));
        }
        Ok(rec)
    }

    /// Its records by status.
    pub(super) fn counts(&self) -> OutboxCounts {
        OutboxCounts::from_fn(|s| at(&self.counts, s.code()))
    }

    /// Whether it holds nothing worth a row: no record, no policy, no pause,
    /// no hold.
    fn is_idle(&self) -> bool {
        self.counts.iter().all(|&n| n == 0)
            && self.flow.policy == PolicyParts::default()
            && !self.flow.paused
            && self.flow.held_until.is_none()
    }

    fn count(&mut self, status: OutboxStatus, delta: i64) {
        bump(&mut self.counts, status.code(), delta);
        self.flow.in_flight = at(&self.counts, OutboxStatus::Dispatching.code());
    }
}

/// The count at `code` of a table of counts (0 past its end).
fn at<const N: usize>(counts: &[u64; N], code: u8) -> u64 {
    counts.get(usize::from(code)).copied().unwrap_or(0)
}

/// Moves the count at `code` by `delta` (nothing past the end: a code the
/// table has no slot for is refused when decoded).
fn bump<const N: usize>(counts: &mut [u64; N], code: u8, delta: i64) {
    if let Some(n) = counts.get_mut(usize::from(code)) {
        *n = n.saturating_add_signed(delta);
    }
}

/// The ranks with a queued entry, by a table of counts per rank.
fn ranks_in_use(queued: &[u64; RANKS]) -> impl Iterator<Item = u8> + '_ {
    (0..=MAX_PRIORITY).filter(|&r| at(queued, r) > 0)
}

/// A record's row in [`OUTBOX_QUEUE`], with its destination borrowed.
type QueueKey<'a> = (&'a str, u8, i64, u64);

/// The rank of priority `p`.
fn rank(p: u8) -> u8 {
    MAX_PRIORITY.saturating_sub(p)
}

/// The destinations' tables, open in one write transaction, and the flow
/// records and counts the operation changed (written by [`Flows::finish`]).
pub(super) struct Flows<'tx> {
    /// The flow records, the ready line and the outbox's counts.
    small: Table<'tx, FlowKey<'static>, &'static [u8]>,
    pub(super) queue: Table<'tx, (&'static str, u8, i64, u64), ()>,
    /// The ordering sequences, opened on first use: entries without an
    /// ordering key never touch them.
    seqs: Option<Table<'tx, (&'static str, &'static str, u64), u64>>,
    tx: &'tx WriteTransaction,
    /// The flow records the operation read, each written back by
    /// [`Flows::finish`].
    cache: BTreeMap<String, DestRec>,
    /// How the operation moved the outbox's counts, by status code.
    moved: [i64; 5],
    /// The latest time the operation's claims took an entry at.
    served: Option<i64>,
}

impl<'tx> Flows<'tx> {
    pub(super) fn open(tx: &'tx WriteTransaction) -> Result<Flows<'tx>> {
        Ok(Flows {
            small: open_write(tx, OUTBOX_FLOWS)?,
            queue: open_write(tx, OUTBOX_QUEUE)?,
            seqs: None,
            tx,
            cache: BTreeMap::new(),
            moved: [0; 5],
            served: None,
        })
    }

    /// The flow record of `destination`, to change (a destination without
    /// a row starts from the default).
    pub(super) fn rec(&mut self, destination: &str) -> Result<&mut DestRec> {
        if !self.cache.contains_key(destination) {
            let rec = match self.small.get((RECORD, 0, destination))? {
                Some(v) => DestRec::decode(destination, v.value())?,
                None => DestRec::default(),
            };
            self.cache.insert(destination.to_owned(), rec);
        }
        self.cache
            .get_mut(destination)
            .ok_or_else(|| Error::Io(std::io::Error::other("a flow record just cached is gone")))
    }

    /// Notes that a claim took an entry of `destination` at `now`.
    pub(super) fn served(&mut self, destination: &str, now: i64) -> Result<()> {
        let rec = self.rec(destination)?;
        rec.served_at = rec.served_at.max(now);
        self.served = Some(self.served.map_or(now, |s| s.max(now)));
        Ok(())
    }

    /// The latest time a claim took an entry, as stored.
    fn latest_served(&self) -> Result<Option<i64>> {
        match self.small.get(SERVED_KEY)? {
            Some(v) => decode_time("served", v.value()).map(Some),
            None => Ok(None),
        }
    }

    /// Whether `seq` is the first of its sequence `(destination, key)`.
    /// The ordering sequences' table.
    fn seqs(&mut self) -> Result<&mut Table<'tx, (&'static str, &'static str, u64), u64>> {
        match &mut self.seqs {
            Some(t) => Ok(t),
            slot @ None => Ok(slot.insert(open_write(self.tx, OUTBOX_SEQUENCES)?)),
        }
    }

    fn is_head(&mut self, destination: &str, key: &str, seq: u64) -> Result<bool> {
        let first = self
            .seqs()?
            .range((destination, key, 0)..=(destination, key, u64::MAX))?
            .next()
            .transpose()?;
        Ok(first.is_some_and(|(k, _)| k.value().2 == seq))
    }

    /// The row of `row` (record `id`) in the queue, if it belongs there.
    fn queue_key<'r>(&mut self, id: u64, row: &'r Row) -> Result<Option<QueueKey<'r>>> {
        if row.status != OutboxStatus::Pending {
            return Ok(None);
        }
        if let (Some(key), Some(seq)) = (&row.ordering_key, row.seq)
            && !self.is_head(&row.destination, key, seq)?
        {
            return Ok(None);
        }
        let due = row.next_attempt_at.unwrap_or(row.created_at);
        Ok(Some((
            row.destination.as_str(),
            rank(row.priority),
            due,
            id,
        )))
    }

    fn enqueue(&mut self, key: QueueKey<'_>) -> Result<()> {
        if self.queue.insert(key, ())?.is_none() {
            let rec = self.rec(key.0)?;
            bump(&mut rec.queued, key.1, 1);
            rec.earliest = Some(rec.earliest.map_or(key.2, |e| e.min(key.2)));
        }
        Ok(())
    }

    fn dequeue(&mut self, key: QueueKey<'_>) -> Result<()> {
        if self.queue.remove(key)?.is_some() {
            let rec = self.rec(key.0)?;
            bump(&mut rec.queued, key.1, -1);
            if rec.earliest.is_none_or(|e| e >= key.2) {
                rec.stale = true;
            }
        }
        Ok(())
    }

    /// A new record `id`: its sequence, queue and count rows.
    pub(super) fn inserted(&mut self, id: u64, row: &Row) -> Result<()> {
        if let (Some(key), Some(seq)) = (&row.ordering_key, row.seq) {
            self.seqs()?
                .insert((row.destination.as_str(), key.as_str(), seq), id)?;
        }
        if let Some(q) = self.queue_key(id, row)? {
            self.enqueue(q)?;
        }
        self.rec(&row.destination)?.count(row.status, 1);
        self.count_total(row.status, 1);
        self.list(row.status, id, &row.destination)
    }

    /// Record `id` of `destination` is in `status` now: its row among the
    /// records of that status.
    fn list(&mut self, status: OutboxStatus, id: u64, destination: &str) -> Result<()> {
        if let Some(key) = listed_key(status, id, destination) {
            self.small.insert(key, [].as_slice())?;
        }
        Ok(())
    }

    /// Record `id` of `destination` is no longer in `status`.
    fn unlist(&mut self, status: OutboxStatus, id: u64, destination: &str) -> Result<()> {
        if let Some(key) = listed_key(status, id, destination) {
            self.small.remove(key)?;
        }
        Ok(())
    }

    /// Record `id` changed from `old` to `new` (its sequence number already
    /// given by [`sequenced`]). `records` reads the other records (the next
    /// of a sequence, when this one leaves it).
    pub(super) fn replaced<R, S>(
        &mut self,
        id: u64,
        old: &Row,
        new: &Row,
        records: RecordTables<'_, R, S>,
    ) -> Result<()>
    where
        R: ReadableTable<u64, &'static [u8]>,
        S: ReadableTable<u64, &'static [u8]>,
    {
        let old_q = self.queue_key(id, old)?;
        let in_seq = |r: &Row| match (&r.ordering_key, r.seq) {
            (Some(k), Some(seq)) if !r.status.is_finished() => Some((k.clone(), seq)),
            _ => None,
        };
        let (was, is) = (in_seq(old), in_seq(new));
        let mut left = None;
        if was != is {
            if let Some((key, seq)) = &was {
                self.seqs()?
                    .remove((old.destination.as_str(), key.as_str(), *seq))?;
                left = Some(key.clone());
            }
            if let Some((key, seq)) = &is {
                self.seqs()?
                    .insert((new.destination.as_str(), key.as_str(), *seq), id)?;
            }
        }
        let new_q = self.queue_key(id, new)?;
        if old_q != new_q {
            if let Some(q) = old_q {
                self.dequeue(q)?;
            }
            if let Some(q) = new_q {
                self.enqueue(q)?;
            }
        }
        if let Some(key) = left {
            self.promote(&old.destination, &key, records)?;
        }
        if old.status != new.status {
            let rec = self.rec(&new.destination)?;
            rec.count(old.status, -1);
            rec.count(new.status, 1);
            self.count_total(old.status, -1);
            self.count_total(new.status, 1);
            self.unlist(old.status, id, &old.destination)?;
            self.list(new.status, id, &new.destination)?;
        }
        Ok(())
    }

    /// Queues the first record of sequence `(destination, key)` if it is
    /// `Pending` (an entry before it just left the sequence).
    fn promote<R, S>(
        &mut self,
        destination: &str,
        key: &str,
        records: RecordTables<'_, R, S>,
    ) -> Result<()>
    where
        R: ReadableTable<u64, &'static [u8]>,
        S: ReadableTable<u64, &'static [u8]>,
    {
        let first = self
            .seqs()?
            .range((destination, key, 0)..=(destination, key, u64::MAX))?
            .next()
            .transpose()?
            .map(|(_, v)| v.value());
        let Some(next) = first else {
            return Ok(());
        };
        let row = load_row(records, next)?
            .ok_or_else(|| super::index::dangling(OUTBOX_SEQUENCES.name(), next))?;
        if let Some(q) = self.queue_key(next, &row)? {
            self.enqueue(q)?;
        }
        Ok(())
    }

    /// Record `id` of `destination` in status `status` was deleted.
    pub(super) fn deleted(
        &mut self,
        id: u64,
        destination: &str,
        status: OutboxStatus,
    ) -> Result<()> {
        self.rec(destination)?.count(status, -1);
        self.count_total(status, -1);
        self.unlist(status, id, destination)
    }

    /// The first `n` claimable entries of `destination` due at `now`:
    /// highest priority first, then earliest due, then id.
    pub(super) fn first_due(&mut self, destination: &str, now: i64, n: usize) -> Result<Vec<u64>> {
        let queued = self.rec(destination)?.queued;
        let mut out = Vec::new();
        for r in ranks_in_use(&queued) {
            let range = (destination, r, i64::MIN, 0)..=(destination, r, now, u64::MAX);
            for row in self.queue.range(range)? {
                if out.len() >= n {
                    return Ok(out);
                }
                out.push(row?.0.value().3);
            }
        }
        Ok(out)
    }

    /// The destinations ready at `now`, front of the line first, at most
    /// `limit` of them that `take` accepts.
    pub(super) fn ready_at(
        &self,
        now: i64,
        limit: usize,
        take: impl Fn(&str) -> bool,
    ) -> Result<Vec<String>> {
        let mut out = Vec::new();
        // Past `now` only rows a claim at a later time served.
        let end = now.max(self.latest_served()?.unwrap_or(now));
        let front = (READY, i64::MIN, "")..(READY, end.saturating_add(1), "");
        for row in self.small.range(front)? {
            if out.len() >= limit {
                break;
            }
            let (k, v) = row?;
            let (_, _, destination) = k.value();
            if decode_time(destination, v.value())? <= now && take(destination) {
                out.push(destination.to_owned());
            }
        }
        Ok(out)
    }

    /// The earliest due time among `destination`'s queued entries.
    fn earliest_queued(&self, destination: &str, rec: &DestRec) -> Result<Option<i64>> {
        let mut earliest: Option<i64> = None;
        for r in ranks_in_use(&rec.queued) {
            let first = self
                .queue
                .range((destination, r, i64::MIN, 0)..=(destination, r, i64::MAX, u64::MAX))?
                .next()
                .transpose()?;
            if let Some((k, _)) = first {
                let due = k.value().2;
                earliest = Some(earliest.map_or(due, |e| e.min(due)));
            }
        }
        Ok(earliest)
    }

    /// Writes the changed flow records, their rows in the ready line and
    /// the outbox's counts: once per operation, not once per entry. Returns
    /// whether a destination became claimable sooner than before (worth a
    /// wake-up).
    pub(super) fn finish(mut self) -> Result<bool> {
        let mut sooner = false;
        let cache = std::mem::take(&mut self.cache);
        for (destination, mut rec) in cache {
            if rec.stale {
                rec.earliest = self.earliest_queued(&destination, &rec)?;
            }
            let ready = match rec.earliest {
                Some(due) => rec.flow.open_from().map(|open| {
                    let from = open.max(due);
                    (from.max(rec.served_at), from)
                }),
                None => None,
            };
            if ready != rec.ready {
                if let Some((old, _)) = rec.ready {
                    self.small.remove((READY, old, destination.as_str()))?;
                }
                if let Some((at, from)) = ready {
                    let key = (READY, at, destination.as_str());
                    self.small.insert(key, encode(&from).as_slice())?;
                    sooner |= rec.ready.is_none_or(|(_, old)| from < old);
                }
                rec.ready = ready;
            }
            let key = (RECORD, 0, destination.as_str());
            if rec.is_idle() {
                self.small.remove(key)?;
            } else {
                self.small.insert(key, rec.encode().as_slice())?;
            }
        }
        if let Some(served) = self.served
            && self.latest_served()?.is_none_or(|s| s < served)
        {
            self.small.insert(SERVED_KEY, encode(&served).as_slice())?;
        }
        let totals = self.write_totals()?;
        if let Some(totals) = totals {
            super::depth::report_after_commit(totals);
        }
        Ok(sooner)
    }

    /// Moves the outbox's count of `status` by `delta`.
    fn count_total(&mut self, status: OutboxStatus, delta: i64) {
        if let Some(n) = self.moved.get_mut(usize::from(status.code())) {
            *n += delta;
        }
    }

    /// Writes the outbox's counts as the operation moved them; returns
    /// them (read even if unmoved where metrics want them), or `None`.
    fn write_totals(&mut self) -> Result<Option<Totals>> {
        let unmoved = self.moved.iter().all(|&d| d == 0);
        if unmoved && !crate::observe::METRICS {
            return Ok(None);
        }
        let mut totals = match self.small.get(COUNTS_KEY)? {
            Some(v) => decode_totals(v.value())?,
            None => Totals::default(),
        };
        if unmoved {
            return Ok(Some(totals));
        }
        for (n, d) in totals.iter_mut().zip(self.moved) {
            *n = n.saturating_add_signed(d);
        }
        if totals.iter().all(|&n| n == 0) {
            self.small.remove(COUNTS_KEY)?;
        } else {
            self.small.insert(COUNTS_KEY, encode(&totals).as_slice())?;
        }
        Ok(Some(totals))
    }
}

/// The destinations' flow records, by name (a read for inspection).
pub(super) fn read_all(tx: &ReadTransaction) -> Result<Vec<(String, DestRec)>> {
    let Some(t) = open_read(tx, OUTBOX_FLOWS)? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for row in t.range(kind(RECORD))? {
        let (k, v) = row?;
        let (_, _, destination) = k.value();
        out.push((
            destination.to_owned(),
            DestRec::decode(destination, v.value())?,
        ));
    }
    Ok(out)
}

/// The flow record of `destination`, if it has one.
pub(super) fn read_one(tx: &ReadTransaction, destination: &str) -> Result<Option<DestRec>> {
    let Some(t) = open_read(tx, OUTBOX_FLOWS)? else {
        return Ok(None);
    };
    match t.get((RECORD, 0, destination))? {
        Some(v) => DestRec::decode(destination, v.value()).map(Some),
        None => Ok(None),
    }
}

/// The front of the ready line: when the next destination may be claimed
/// from.
pub(super) fn first_ready(tx: &ReadTransaction) -> Result<Option<i64>> {
    let Some(t) = open_read(tx, OUTBOX_FLOWS)? else {
        return Ok(None);
    };
    let first = t.range(kind(READY))?.next().transpose()?;
    Ok(first.map(|(k, _)| k.value().1))
}

/// Builds the destinations' tables of a file written before they existed
/// (every record without an ordering key, priority 0): reads every record
/// once.
pub(super) fn build(tx: &WriteTransaction) -> Result<()> {
    let rows = open_write(tx, OUTBOX)?;
    // Format 1 kept each record whole in its row (no state rows); read as
    // every record is read all the same.
    let states = open_write(tx, OUTBOX_STATE)?;
    let mut flows = Flows::open(tx)?;
    for row in rows.iter()? {
        let (k, v) = row?;
        let id = k.value();
        let row = decode_row(Some(&states), id, v.value())?;
        flows.inserted(id, &row)?;
    }
    drop((rows, states));
    flows.finish()?;
    // The queues replace format 1's due index, and the counts it kept in a
    // table of their own are among the flows' small rows.
    tx.delete_table(OUTBOX_DUE)
        .map_err(crate::schema::store_table_error)?;
    tx.delete_table(OUTBOX_COUNT)
        .map_err(crate::schema::store_table_error)?;
    Ok(())
}

/// Lists the records by status in a file written before the records were
/// listed by status (format 2): reads every record's keys once, payloads
/// not copied.
pub(super) fn build_listed(tx: &WriteTransaction) -> Result<()> {
    let rows = open_write(tx, OUTBOX)?;
    let states = open_write(tx, OUTBOX_STATE)?;
    let mut small = open_write(tx, OUTBOX_FLOWS)?;
    for row in rows.iter()? {
        let (k, v) = row?;
        let id = k.value();
        let state = states.get(id)?;
        let keys = RowKeys::decode(id, v.value(), state.as_ref().map(redb::AccessGuard::value))?;
        if let Some(key) = listed_key(keys.times.status(id)?, id, &keys.destination) {
            small.insert(key, [].as_slice())?;
        }
    }
    Ok(())
}
