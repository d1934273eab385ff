//! The consistency check of the destinations' tables (see the parent
//! module's docs): every row they hold against what the records call for.

use std::collections::{BTreeMap, BTreeSet};

use redb::{ReadTransaction, ReadableTable, TableHandle as _};

use super::{
    COUNTS, COUNTS_KEY, DestRec, LISTED, RANKS, READY, RECORD, SERVED, SERVED_KEY, bump,
    decode_time, listed_key, rank, read_all,
};

/// The first key field after the records by status.
const LISTED_END: u8 = LISTED + 5;
use crate::codec::from_micros;
use crate::error::Result;
use crate::outbox::OutboxStatus;
use crate::outbox::index::{compare, decode_row};
use crate::outbox::rules::Row;
use crate::schema::{
    OUTBOX, OUTBOX_FLOWS, OUTBOX_QUEUE, OUTBOX_SEQUENCES, OUTBOX_STATE, open_read,
};

/// Checks the invariants of the module docs over every record; one
/// finding per violation.
pub(in crate::outbox) fn check(tx: &ReadTransaction, findings: &mut Vec<String>) -> Result<()> {
    let Some(rows) = open_read(tx, OUTBOX)? else {
        return Ok(());
    };
    let states = open_read(tx, OUTBOX_STATE)?;
    let mut seqs: BTreeSet<(String, String, u64, u64)> = BTreeSet::new();
    let mut pending: Vec<(u64, Row)> = Vec::new();
    let mut counts: BTreeMap<String, [u64; 5]> = BTreeMap::new();
    let mut listed = Listed::new();
    for row in rows.iter()? {
        let (k, v) = row?;
        let id = k.value();
        let Ok(row) = decode_row(states.as_ref(), id, v.value()) else {
            continue; // reported by the record check
        };
        bump(
            counts.entry(row.destination.clone()).or_default(),
            row.status.code(),
            1,
        );
        if let Some((kind, at, d)) = listed_key(row.status, id, &row.destination) {
            listed.insert((kind, at, d.to_owned()));
        }
        match (&row.ordering_key, row.seq, row.status.is_finished()) {
            (Some(key), Some(seq), false) => {
                seqs.insert((row.destination.clone(), key.clone(), seq, id));
            }
            (Some(_), None, false) => findings.push(format!(
                "record {id} has an ordering key but no place in its sequence"
            )),
            (_, Some(_), true) | (None, Some(_), _) => {
                findings.push(format!(
                    "record {id} keeps a sequence number it should not have"
                ));
            }
            _ => {}
        }
        if row.status == OutboxStatus::Pending {
            pending.push((id, row));
        }
    }
    let mut found = BTreeSet::new();
    if let Some(t) = open_read(tx, OUTBOX_SEQUENCES)? {
        for row in t.iter()? {
            let (k, v) = row?;
            let (d, key, seq) = k.value();
            found.insert((d.to_owned(), key.to_owned(), seq, v.value()));
        }
    }
    compare(findings, OUTBOX_SEQUENCES.name(), &seqs, &found);
    // The first of each sequence.
    let mut heads: BTreeMap<(String, String), u64> = BTreeMap::new();
    for (d, key, _, id) in &seqs {
        heads.entry((d.clone(), key.clone())).or_insert(*id);
    }
    let mut queue: BTreeSet<(String, u8, i64, u64)> = BTreeSet::new();
    for (id, row) in &pending {
        let head = match &row.ordering_key {
            Some(key) => heads.get(&(row.destination.clone(), key.clone())) == Some(id),
            None => true,
        };
        if head {
            let due = row.next_attempt_at.unwrap_or(row.created_at);
            queue.insert((row.destination.clone(), rank(row.priority), due, *id));
        }
    }
    let mut found = BTreeSet::new();
    if let Some(t) = open_read(tx, OUTBOX_QUEUE)? {
        for row in t.iter()? {
            let (k, _) = row?;
            let (d, r, due, id) = k.value();
            found.insert((d.to_owned(), r, due, id));
        }
    }
    compare(findings, OUTBOX_QUEUE.name(), &queue, &found);
    check_destinations(tx, &counts, &queue, &listed, findings)
}

/// The rows of the records by status, as [`listed_key`] makes them.
type Listed = BTreeSet<(u8, i64, String)>;

/// The flow records and the ready line against what the records call for:
/// `counts` by destination and the `queue` rows.
fn check_destinations(
    tx: &ReadTransaction,
    counts: &BTreeMap<String, [u64; 5]>,
    queue: &BTreeSet<(String, u8, i64, u64)>,
    listed: &Listed,
    findings: &mut Vec<String>,
) -> Result<()> {
    let recs: BTreeMap<String, DestRec> = read_all(tx)?.into_iter().collect();
    for (d, n) in counts {
        let stored = recs.get(d).map(|r| r.counts).unwrap_or_default();
        if stored != *n {
            findings.push(format!(
                "destination {d:?}: counts {stored:?} but records say {n:?}"
            ));
        }
    }
    // Each destination's queue rows by rank, and its earliest due time.
    let mut by_destination: BTreeMap<&str, ([u64; RANKS], Option<i64>)> = BTreeMap::new();
    for (d, r, due, _) in queue {
        let (queued, earliest) = by_destination.entry(d.as_str()).or_default();
        bump(queued, *r, 1);
        *earliest = Some(earliest.map_or(*due, |e| e.min(*due)));
    }
    let mut ready = BTreeSet::new();
    for (d, rec) in &recs {
        if !counts.contains_key(d) && rec.counts.iter().any(|&n| n > 0) {
            findings.push(format!("destination {d:?} counts records it does not have"));
        }
        let (queued, earliest) = by_destination.get(d.as_str()).copied().unwrap_or_default();
        if earliest != rec.earliest {
            findings.push(format!(
                "destination {d:?}: earliest queued {:?} but the queue's is {earliest:?}",
                rec.earliest
            ));
        }
        if queued != rec.queued {
            findings.push(format!(
                "destination {d:?}: queued {:?} but the queue holds {queued:?}",
                rec.queued
            ));
        }
        if let Some((at, from)) = rec.ready {
            ready.insert((at, d.clone(), from));
        }
        let has_queued = queued.iter().any(|&n| n > 0);
        let should = match (earliest, rec.flow.open_from()) {
            (Some(due), Some(open)) => {
                let from = open.max(due);
                Some((from.max(rec.served_at), from))
            }
            _ => None,
        };
        if rec.ready.is_some() && rec.ready != should {
            findings.push(format!(
                "destination {d:?}: its row in the ready line is {:?} but its flow calls for {should:?}",
                rec.ready
            ));
        }
        if rec.ready.is_some() != (has_queued && rec.flow.open_from().is_some()) {
            findings.push(format!(
                "destination {d:?} is {}in the ready line, with {} queued and its flow {}",
                if rec.ready.is_some() { "" } else { "not " },
                queued.iter().sum::<u64>(),
                if rec.flow.open_from().is_some() {
                    "open"
                } else {
                    "blocked"
                }
            ));
        }
        if let Some((at, _)) = rec.ready
            && from_micros(OUTBOX_FLOWS.name(), d, at).is_err()
        {
            findings.push(format!("destination {d:?}: ready time {at} out of range"));
        }
    }
    let latest = recs.values().map(|r| r.served_at).max().unwrap_or(0);
    check_small_rows(tx, &ready, latest, listed, findings)
}

/// The rows of [`OUTBOX_FLOWS`] that are not flow records against what
/// the flow records call for: the `ready` line, and a latest time a claim
/// served no earlier than any destination's (`latest`), and the records
/// by status (`listed`). Notes rows of no known kind.
fn check_small_rows(
    tx: &ReadTransaction,
    ready: &BTreeSet<(i64, String, i64)>,
    latest: i64,
    listed: &Listed,
    findings: &mut Vec<String>,
) -> Result<()> {
    let mut found = BTreeSet::new();
    let mut found_listed = Listed::new();
    let mut served = None;
    if let Some(t) = open_read(tx, OUTBOX_FLOWS)? {
        for row in t.iter()? {
            let (k, v) = row?;
            let key = k.value();
            let (what, at, d) = key;
            let odd = match what {
                READY => match decode_time(d, v.value()) {
                    Ok(from) => !found.insert((at, d.to_owned(), from)),
                    Err(e) => {
                        findings.push(format!("the ready line's row of {d:?}: {e}"));
                        false
                    }
                },
                RECORD => at != 0,
                COUNTS => key != COUNTS_KEY,
                SERVED if key == SERVED_KEY => {
                    served = Some(decode_time("served", v.value()));
                    false
                }
                LISTED..LISTED_END => {
                    found_listed.insert((what, at, d.to_owned()));
                    !v.value().is_empty()
                }
                _ => true,
            };
            if odd {
                findings.push(format!(
                    "{}: row {key:?} is of no known kind",
                    OUTBOX_FLOWS.name()
                ));
            }
        }
    }
    compare(findings, "the ready line", ready, &found);
    compare(findings, "the records by status", listed, &found_listed);
    match served.transpose() {
        Ok(served) if latest > served.unwrap_or(0) => findings.push(format!(
            "the latest time a claim served, {served:?}, is before a destination's {latest}"
        )),
        Ok(_) => {}
        Err(e) => findings.push(format!("the latest time a claim served: {e}")),
    }
    Ok(())
}
