//! The codec target: stored records (outbox rows, their state rows and
//! their attempt history, idempotency rows, inbox keys) replaced by arbitrary bytes, or by
//! valid records with bytes flipped, cut or inserted, then every reader, every
//! writer that scans a table, and every writer of one record on each record
//! damaged. No call may panic; an error is `Corrupted`, or for calls
//! where it is an expected answer `NotFound` or `Conflict`.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::sync::OnceLock;

use arbitrary::{Arbitrary, Unstructured};
use idemstore::redb::{ReadableTable as _, TableDefinition, WriteTransaction};
use idemstore::{
    Begin, Error, Fence, NewEntry, OutboxId, Reservation, ResponseRecord, Settlement, Store,
};

use super::{MemoryFile, t};

/// The record tables, with the key and value types of `src/schema.rs`.
const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("idemstore.v1.outbox");
/// The state rows the changes since an entry's enqueue wrote.
const STATE: TableDefinition<u64, &[u8]> = TableDefinition::new("idemstore.v1.outbox.state");
const ATTEMPTS: TableDefinition<(u64, u64), &[u8]> =
    TableDefinition::new("idemstore.v1.outbox.attempts");
const IDEM: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("idemstore.v1.idempotency");
const INBOX: TableDefinition<(&str, &str), i64> = TableDefinition::new("idemstore.v1.inbox");

/// Outbox ids 1..=5 exist after setup; 6 and 7 do not.
const OUTBOX_IDS: u64 = 7;
const IDEM_ROWS: [(&str, &str); 4] = [("", "r1"), ("", "c1"), ("t1", "p1"), ("t1", "new")];
const INBOX_ROWS: [&str; 3] = ["e0", "e1", "e9"];
const FP: &str = "fp-a";

#[derive(Debug, Arbitrary)]
struct CodecInput {
    patches: Vec<Patch>,
    /// Seconds past the setup time at which the calls run.
    now: u8,
    /// Last, so that inputs written before it decode as they did: the rest
    /// of the input, one patch after another.
    attempts: Vec<AttemptPatch>,
}

/// One attempt record to replace (or add: the setup stores `(2, 0)` and
/// `(3, 0)`), under outbox id `1 + entry % 7` and sequence `seq % 3`.
#[derive(Debug, Arbitrary)]
struct AttemptPatch {
    entry: u8,
    seq: u8,
    bytes: Bytes,
}

/// One stored value to replace.
#[derive(Debug, Arbitrary)]
enum Patch {
    /// Outbox id `1 + id % 7`: its row, or with `id`'s top bit set its
    /// state row.
    Outbox {
        id: u8,
        bytes: Bytes,
    },
    Idem {
        row: u8,
        bytes: Bytes,
    },
    Inbox {
        row: u8,
        seen_at: i64,
    },
}

/// The new value: raw bytes, or the stored value (empty if none) changed.
#[derive(Debug, Arbitrary)]
enum Bytes {
    Raw(Vec<u8>),
    Flip {
        at: u16,
        xor: u8,
    },
    Truncate(u16),
    Insert {
        at: u16,
        bytes: Vec<u8>,
    },
    /// Overwrite from `at` with a postcard varint (a length, a time, a code).
    Varint {
        at: u16,
        value: u64,
    },
}

impl Bytes {
    fn apply(&self, old: &[u8]) -> Vec<u8> {
        let clamp = |at: u16| usize::from(at).min(old.len());
        let mut v = old.to_vec();
        match self {
            Bytes::Raw(b) => v.clone_from(b),
            Bytes::Flip { at, xor } => {
                if !v.is_empty() {
                    let i = usize::from(*at) % v.len();
                    v[i] ^= xor;
                }
            }
            Bytes::Truncate(n) => v.truncate(clamp(*n)),
            Bytes::Insert { at, bytes } => {
                let at = clamp(*at);
                v.splice(at..at, bytes.iter().copied());
            }
            Bytes::Varint { at, value } => {
                let at = clamp(*at);
                let mut enc = Vec::new();
                let mut x = *value;
                loop {
                    let byte = u8::try_from(x & 0x7f).expect("seven bits");
                    x >>= 7;
                    if x == 0 {
                        enc.push(byte);
                        break;
                    }
                    enc.push(byte | 0x80);
                }
                let end = (at + enc.len()).min(v.len());
                v.splice(at..end, enc);
            }
        }
        v
    }
}

/// Replaces stored records as `data` says, then calls every reader and
/// writer of the store; panics if one panics or fails other than as allowed.
pub(crate) fn run_codec(data: &[u8]) {
    let Ok(input) = CodecInput::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    let store = open(&MemoryFile::from_bytes(image()));
    let damaged = Damaged::of(&input);
    // The live reservation on `("", "r1")`, when its row is damaged.
    let held = damaged.idem.contains(&0).then(|| reserve(&store));
    patch(&store, &input);
    exercise(&store, &damaged, held.as_ref(), 1000 + i64::from(input.now));
}

fn open(file: &MemoryFile) -> Store {
    Store::builder()
        .cache_size(1 << 20)
        .open_with_backend(file.clone())
        .expect("open the store file")
}

/// The file [`setup`] writes, made once: each input starts from a copy of
/// it, which is much cheaper than the setup's fifteen commits.
fn image() -> &'static [u8] {
    static IMAGE: OnceLock<Vec<u8>> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let file = MemoryFile::default();
        setup(&open(&file));
        file.bytes().clone()
    })
}

/// A store with outbox entries in every status, idempotency rows of both
/// kinds and inbox keys.
fn setup(store: &Store) {
    let outbox = store.outbox();
    for i in 0..5u8 {
        let mut e = NewEntry::new(
            if i % 2 == 0 { "cmd-a" } else { "cmd-b" },
            "billing",
            format!("k{i}"),
            vec![i; usize::from(i)],
        );
        if i == 4 {
            e = e.not_before(t(2000));
        }
        outbox.enqueue(e, t(10 + i64::from(i))).expect("enqueue");
    }
    let claimed = outbox.claim_due(t(100), 3, "w0").expect("claim_due");
    assert_eq!(claimed.len(), 3, "setup claims");
    // 1 Completed, 2 Failed, 3 OutcomeUnknown, 4 Pending, 5 Pending later;
    // 2 and 3 with an attempt record each.
    outbox
        .settle(claimed[0].fence(), Settlement::Completed, t(110))
        .expect("complete");
    let give_up = Settlement::Failed {
        reason: "http_400".into(),
        next_attempt_at: None,
    };
    outbox
        .settle(claimed[1].fence(), give_up, t(110))
        .expect("fail");
    let unknown = Settlement::OutcomeUnknown {
        remote_ref: Some("ref-1".into()),
    };
    outbox
        .settle(claimed[2].fence(), unknown, t(110))
        .expect("unknown");

    let keys = store.idempotency_keys();
    let Begin::Proceed(done) = keys.begin("", "c1", FP, t(200)).expect("begin") else {
        panic!("setup: c1 is free");
    };
    let mut response = done.response(201, b"created".to_vec(), t(0));
    response.content_type = Some("application/json".into());
    response.headers = vec![("location".into(), "/things/1".into())];
    assert!(keys.complete(&done, response, t(201)).expect("complete"));
    assert!(keys.put(&record("t1", "p1", 202)).expect("put"));

    let inbox = store.inbox("alpha").expect("inbox");
    inbox.claim("e0", t(300)).expect("claim");
    inbox.claim("e1", t(301)).expect("claim");
}

/// A live reservation, which a reopened file cannot hand back: made in each
/// run, before the patches.
fn reserve(store: &Store) -> Reservation {
    let keys = store.idempotency_keys();
    let Begin::Proceed(held) = keys.begin("", "r1", FP, t(990)).expect("begin") else {
        panic!("setup: r1 is free");
    };
    held
}

fn record(tenant: &str, key: &str, at: i64) -> ResponseRecord {
    ResponseRecord::new(tenant, key, FP, 200, b"ok".to_vec(), t(at))
        .content_type("text/plain")
        .header("x-a", "b")
}

/// Every patch of `input`, in order, in one write transaction.
fn patch(store: &Store, input: &CodecInput) {
    store
        .write(|tx| {
            for p in input.patches.iter().take(8) {
                patch_record(tx, p)?;
            }
            for p in input.attempts.iter().take(8) {
                patch_attempt(tx, p)?;
            }
            Ok::<_, Error>(())
        })
        .expect("write raw values");
}

fn patch_record(tx: &WriteTransaction, p: &Patch) -> Result<(), Error> {
    match p {
        Patch::Outbox { id, bytes } => {
            let def = if *id >= 0x80 { STATE } else { OUTBOX };
            let id = 1 + u64::from(*id) % OUTBOX_IDS;
            let mut table = tx.open_table(def)?;
            let old = table
                .get(id)?
                .map(|v| v.value().to_vec())
                .unwrap_or_default();
            table.insert(id, bytes.apply(&old).as_slice())?;
        }
        Patch::Idem { row, bytes } => {
            let key = IDEM_ROWS[usize::from(*row) % IDEM_ROWS.len()];
            let mut table = tx.open_table(IDEM)?;
            let old = table
                .get(key)?
                .map(|v| v.value().to_vec())
                .unwrap_or_default();
            table.insert(key, bytes.apply(&old).as_slice())?;
        }
        Patch::Inbox { row, seen_at } => {
            let key = INBOX_ROWS[usize::from(*row) % INBOX_ROWS.len()];
            tx.open_table(INBOX)?.insert(("alpha", key), *seen_at)?;
        }
    }
    Ok(())
}

fn patch_attempt(tx: &WriteTransaction, p: &AttemptPatch) -> Result<(), Error> {
    let key = (1 + u64::from(p.entry) % OUTBOX_IDS, u64::from(p.seq % 3));
    let mut table = tx.open_table(ATTEMPTS)?;
    let old = table
        .get(key)?
        .map(|v| v.value().to_vec())
        .unwrap_or_default();
    table.insert(key, p.bytes.apply(&old).as_slice())?;
    Ok(())
}

/// `Ok`, or `Corrupted`; with `expected`, `NotFound` and `Conflict` too.
fn check<T: Debug>(what: &str, r: idemstore::Result<T>, expected: bool) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(Error::Corrupted { .. }) => None,
        Err(Error::NotFound | Error::Conflict { .. }) if expected => None,
        Err(e) => panic!("{what}: expected Ok or Corrupted, got {e:?}"),
    }
}

/// What an input damaged: the writers that read one record run on these
/// only (an undamaged record's write paths gain nothing from a damaged file
/// elsewhere), while every reader and every writer that scans a table run
/// on each input.
#[derive(Default)]
struct Damaged {
    /// Outbox ids whose row, state row or attempt record was replaced.
    outbox: BTreeSet<u64>,
    /// Indexes into [`IDEM_ROWS`].
    idem: BTreeSet<usize>,
    inbox: bool,
}

impl Damaged {
    fn of(input: &CodecInput) -> Damaged {
        let mut d = Damaged::default();
        for p in input.patches.iter().take(8) {
            match p {
                Patch::Outbox { id, .. } => {
                    d.outbox.insert(1 + u64::from(*id) % OUTBOX_IDS);
                }
                Patch::Idem { row, .. } => {
                    d.idem.insert(usize::from(*row) % IDEM_ROWS.len());
                }
                Patch::Inbox { .. } => d.inbox = true,
            }
        }
        for p in input.attempts.iter().take(8) {
            d.outbox.insert(1 + u64::from(p.entry) % OUTBOX_IDS);
        }
        d
    }
}

fn exercise(store: &Store, damaged: &Damaged, held: Option<&Reservation>, now: i64) {
    exercise_outbox(store, &damaged.outbox, now);
    exercise_keys(store, &damaged.idem, held, now);
    let inbox = store.inbox("alpha").expect("inbox");
    for key in INBOX_ROWS {
        check("inbox seen_at", inbox.seen_at(key), false);
        check("inbox seen", inbox.seen(key), false);
    }
    check("inbox len", inbox.len(), false);
    check("inbox list", inbox.list(None, 100), false);
    if damaged.inbox {
        check("inbox claim", inbox.claim("e9", t(now)), false);
        check(
            "inbox claim_many",
            inbox.claim_many(["e1", "e7"], t(now)),
            false,
        );
    }
    check("inbox prune", inbox.prune(t(now - 500)), false);
    check("inbox len", inbox.len(), false);
}

fn exercise_outbox(store: &Store, damaged: &BTreeSet<u64>, now: i64) {
    let outbox = store.outbox();
    check("check_indexes", outbox.check_indexes(), false);
    check("counts", outbox.counts(), false);
    check("next_due", outbox.next_due(), false);
    for cmd in ["cmd-a", "cmd-b"] {
        check("list_for_command", outbox.list_for_command(cmd), false);
    }
    for i in 0..6 {
        check("find", outbox.find("billing", &format!("k{i}")), false);
    }
    for id in 1..=OUTBOX_IDS + 1 {
        check("get", outbox.get(OutboxId(id)), true);
    }
    let again = NewEntry::new("cmd-a", "billing", "k3", b"x".to_vec());
    check(
        "enqueue duplicate",
        outbox.enqueue(again.clone(), t(now)),
        false,
    );
    let fresh = NewEntry::new("cmd-c", "mail", "k9", b"y".to_vec());
    check(
        "enqueue_many",
        outbox.enqueue_many([again, fresh], t(now)),
        false,
    );
    check("claim_due", outbox.claim_due(t(now), 10, "w1"), false);
    let mut fences = Vec::new();
    for &id in damaged {
        let id = OutboxId(id);
        let attempt = check("get", outbox.get(id), true).map_or(1, |r| r.entry.attempt_count);
        fences.push(Fence { id, attempt });
    }
    let settlements = [
        Settlement::Completed,
        Settlement::Failed {
            reason: "http_503".into(),
            next_attempt_at: Some(t(now + 5)),
        },
        Settlement::OutcomeUnknown { remote_ref: None },
        Settlement::Rescheduled {
            next_attempt_at: t(now + 1),
        },
    ];
    if !fences.is_empty() {
        let batch: Vec<(Fence, Settlement)> = fences
            .iter()
            .zip(settlements.iter().cycle())
            .map(|(f, s)| (*f, s.clone()))
            .collect();
        if let Some(results) = check("settle_many", outbox.settle_many(batch, t(now)), false) {
            for r in results {
                check("settle_many item", r, true);
            }
        }
    }
    for (f, s) in fences.iter().zip(settlements.iter().cycle().skip(1)) {
        check("settle", outbox.settle(*f, s.clone(), t(now)), true);
        let id = f.id;
        check(
            "mark_outcome_unknown",
            outbox.mark_outcome_unknown(id, Some("r")),
            true,
        );
        check(
            "mark_failed",
            outbox.mark_failed(id, "e", Some(t(now)), t(now)),
            true,
        );
        check("reschedule", outbox.reschedule(id, t(now)), true);
        check("requeue", outbox.requeue(id, t(now)), true);
        check("cancel", outbox.cancel(id, t(now)), true);
        check("mark_completed", outbox.mark_completed(id, t(now)), true);
        check(
            "mark_failed final",
            outbox.mark_failed(id, "e", None, t(now)),
            true,
        );
    }
    check(
        "release",
        outbox.release_expired_claims(t(now + 100)),
        false,
    );
    check("purge_finished", outbox.purge_finished(t(now + 100)), false);
    check("counts", outbox.counts(), false);
    check("check_indexes", outbox.check_indexes(), false);
}

fn exercise_keys(store: &Store, damaged: &BTreeSet<usize>, held: Option<&Reservation>, now: i64) {
    let keys = store.idempotency_keys();
    check("keys check_indexes", keys.check_indexes(), false);
    check("keys list", keys.list(None, 100), false);
    check("keys list t1", keys.list(Some("t1"), 100), false);
    for (tenant, key) in IDEM_ROWS {
        check("keys get", keys.get(tenant, key, t(0)), false);
    }
    if let Some(held) = held {
        let response = held.response(200, b"done".to_vec(), t(now));
        check("complete", keys.complete(held, response, t(now)), false);
        check("release", keys.release(held), false);
    }
    let mut fresh = Vec::new();
    for &row in damaged {
        let (tenant, key) = IDEM_ROWS[row];
        if let Some(Begin::Proceed(r)) = check("begin", keys.begin(tenant, key, FP, t(now)), false)
        {
            fresh.push(r);
        }
        check(
            "begin other",
            keys.begin(tenant, key, "fp-b", t(now)),
            false,
        );
        check("put", keys.put(&record(tenant, key, now)), false);
    }
    for r in &fresh {
        let response = r.response(200, b"ok".to_vec(), t(now));
        check("complete fresh", keys.complete(r, response, t(now)), false);
    }
    for (tenant, key) in IDEM_ROWS {
        check(
            "keys get late",
            keys.get(tenant, key, t(now + 100_000)),
            false,
        );
    }
    check("purge_expired", keys.purge_expired(t(now + 200_000)), false);
    check("keys check_indexes", keys.check_indexes(), false);
}
