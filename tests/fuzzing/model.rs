//! The model target: an `Arbitrary` sequence of operations on the inbox, the
//! outbox and the idempotency keys of one store file, with time steps and
//! reopens, checked against `BTreeMap`s: each answer as it returns, the whole
//! store every few operations.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use chrono::{DateTime, Utc};
use idemstore::redb::{ReadableTable as _, TableDefinition, TableError};
use idemstore::{
    Begin, Claim, Durability, Enqueued, Error, Fence, IdempotencyKeys, Inbox, KeyEntry, KeyState,
    NewEntry, Outbox, OutboxId, OutboxStatus, Reservation, ResponseRecord, Settlement, Store,
};

use super::outbox_model::{Change, Entry as ModelEntry, OutboxModel, Outcome, Record, outcome};
use super::{MemoryFile, t};

/// Most operations decoded from one input.
const MAX_OPS: usize = 256;
/// Every operation's answer is checked against the model as it returns; the
/// whole store (every list, count and index check) is compared after every
/// this many operations, after each reopen and after the last operation. A
/// wrong row or index entry almost always stays wrong until the next check,
/// so checking less often loses little, and makes a run several times faster.
const VERIFY_EVERY: usize = 8;
const INBOXES: [&str; 2] = ["alpha", "beta"];
const EVENTS: [&str; 6] = ["e0", "e1", "e2", "e3", "e4", "e5"];
const COMMANDS: [&str; 3] = ["cmd-a", "cmd-b", "cmd-c"];
const DESTINATIONS: [&str; 2] = ["billing", "mail"];
const OUTBOX_KEYS: [&str; 5] = ["k0", "k1", "k2", "k3", "k4"];
const WORKERS: [&str; 3] = ["w0", "w1", "w2"];
const TENANTS: [&str; 2] = ["", "t1"];
const IDEM_KEYS: [&str; 4] = ["i0", "i1", "i2", "i3"];
const FINGERPRINTS: [&str; 2] = ["fp-a", "fp-b"];
/// Response TTL and reservation lease of the model's key store, in seconds:
/// short, so time steps reach them.
const TTL: i64 = 60;
const LEASE: i64 = 10;
/// Reservations the driver holds on to (oldest dropped first).
const HELD: usize = 6;
/// The caller's own table that `claim_with` effects write.
const EFFECTS: TableDefinition<&str, u64> = TableDefinition::new("fuzz.effects");

fn pick<T: Copy>(items: &[T], i: u8) -> T {
    items[usize::from(i) % items.len()]
}

/// A time offset of -8..=7 seconds.
fn offset(o: i8) -> i64 {
    i64::from(o.rem_euclid(16)) - 8
}

/// One operation, decoded from fuzz bytes.
#[derive(Debug, Clone, Arbitrary)]
enum Op {
    /// The model clock moves forward by `0..=31` seconds.
    Advance(u8),
    Claim {
        inbox: u8,
        key: u8,
    },
    ClaimWith {
        inbox: u8,
        key: u8,
        add: u8,
        fail: bool,
        enqueue: Option<(u8, u8, u8)>,
    },
    ClaimMany {
        inbox: u8,
        keys: Vec<u8>,
    },
    Prune {
        inbox: u8,
        back: u8,
    },
    Enqueue {
        cmd: u8,
        dest: u8,
        key: u8,
        payload: u8,
        not_before: Option<i8>,
    },
    EnqueueMany(Vec<(u8, u8, u8)>),
    ClaimDue {
        limit: u8,
        worker: u8,
    },
    Settle {
        pick: u8,
        stale: bool,
        how: How,
    },
    Mark {
        pick: u8,
        how: How,
    },
    Requeue {
        pick: u8,
        at: i8,
    },
    ReleaseClaims {
        back: u8,
    },
    PurgeFinished {
        back: u8,
    },
    Begin {
        tenant: u8,
        key: u8,
        fp: u8,
    },
    Complete {
        held: u8,
        status: u8,
    },
    ReleaseKey {
        held: u8,
    },
    Put {
        tenant: u8,
        key: u8,
        fp: u8,
        at: i8,
    },
    Get {
        tenant: u8,
        key: u8,
        back: u8,
    },
    PurgeExpired {
        back: u8,
    },
    Reopen,
    Cancel {
        pick: u8,
    },
}

/// A settlement of an outbox attempt.
#[derive(Debug, Clone, Arbitrary)]
enum How {
    Completed,
    Retry(i8),
    GiveUp,
    Unknown(Option<u8>),
    Reschedule(i8),
}

/// What a run went through, for picking seeds that reach each path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ModelStats {
    pub(crate) ops: u64,
    pub(crate) reopens: u64,
    pub(crate) effects_applied: u64,
    pub(crate) effects_refused: u64,
    pub(crate) duplicate_claims: u64,
    pub(crate) pruned: u64,
    pub(crate) duplicate_enqueues: u64,
    pub(crate) claimed: u64,
    pub(crate) retries: u64,
    pub(crate) stale_settles: u64,
    pub(crate) released: u64,
    pub(crate) purged: u64,
    pub(crate) requeued: u64,
    pub(crate) takeovers: u64,
    pub(crate) replays: u64,
    pub(crate) in_flight: u64,
    pub(crate) mismatches: u64,
    pub(crate) fenced_out: u64,
    pub(crate) expired: u64,
    pub(crate) cancelled: u64,
}

impl ModelStats {
    /// Adds `other` to `self`.
    pub(crate) fn add(&mut self, o: &ModelStats) {
        for (a, b) in self.fields_mut().into_iter().zip(o.fields()) {
            *a += b;
        }
    }

    /// Every counter with its name.
    pub(crate) fn named(&self) -> Vec<(&'static str, u64)> {
        const NAMES: [&str; 20] = [
            "ops",
            "reopens",
            "effects_applied",
            "effects_refused",
            "duplicate_claims",
            "pruned",
            "duplicate_enqueues",
            "claimed",
            "retries",
            "stale_settles",
            "released",
            "purged",
            "requeued",
            "takeovers",
            "replays",
            "in_flight",
            "mismatches",
            "fenced_out",
            "expired",
            "cancelled",
        ];
        NAMES.into_iter().zip(self.fields()).collect()
    }

    fn fields(&self) -> [u64; 20] {
        [
            self.ops,
            self.reopens,
            self.effects_applied,
            self.effects_refused,
            self.duplicate_claims,
            self.pruned,
            self.duplicate_enqueues,
            self.claimed,
            self.retries,
            self.stale_settles,
            self.released,
            self.purged,
            self.requeued,
            self.takeovers,
            self.replays,
            self.in_flight,
            self.mismatches,
            self.fenced_out,
            self.expired,
            self.cancelled,
        ]
    }

    fn fields_mut(&mut self) -> [&mut u64; 20] {
        [
            &mut self.ops,
            &mut self.reopens,
            &mut self.effects_applied,
            &mut self.effects_refused,
            &mut self.duplicate_claims,
            &mut self.pruned,
            &mut self.duplicate_enqueues,
            &mut self.claimed,
            &mut self.retries,
            &mut self.stale_settles,
            &mut self.released,
            &mut self.purged,
            &mut self.requeued,
            &mut self.takeovers,
            &mut self.replays,
            &mut self.in_flight,
            &mut self.mismatches,
            &mut self.fenced_out,
            &mut self.expired,
            &mut self.cancelled,
        ]
    }
}

/// Decodes `data` as a sequence of operations, applies each to a fresh store
/// file and to the model, and panics at the first disagreement.
pub(crate) fn run_model(data: &[u8]) -> ModelStats {
    let mut u = Unstructured::new(data);
    let mut ops = Vec::new();
    while !u.is_empty() && ops.len() < MAX_OPS {
        match Op::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    let mut stats = ModelStats::default();
    if ops.is_empty() {
        return stats;
    }
    let file = MemoryFile::default();
    let mut h = Harness::open(&file, 0);
    let mut m = Model::default();
    let last = ops.len() - 1;
    for (i, op) in ops.iter().enumerate() {
        stats.ops += 1;
        let reopen = matches!(op, Op::Reopen);
        if reopen {
            stats.reopens += 1;
            drop(h);
            h = Harness::open(&file, stats.reopens);
        } else {
            apply(&h, &mut m, op, &mut stats);
        }
        if reopen || i == last || i % VERIFY_EVERY == VERIFY_EVERY - 1 {
            verify(&h, &m, &format!("op {i}: {op:?}"));
        }
    }
    stats
}

/// The store under test and its handles.
struct Harness {
    store: Store,
    inboxes: [Inbox; 2],
    outbox: Outbox,
    keys: IdempotencyKeys,
}

impl Harness {
    /// Opens the `nth` time: alternately under `Durability::None` (claims
    /// go straight to the ledger) and durable with a three-claim journal
    /// (claims are journaled and merged every third), so that a file is
    /// read and written both ways. Clean closes flush, so neither loses
    /// anything across a reopen, and the in-memory file makes fsyncs free.
    fn open(file: &MemoryFile, nth: u64) -> Harness {
        let durability = if nth.is_multiple_of(2) {
            Durability::None
        } else {
            Durability::Immediate
        };
        let store = Store::builder()
            .durability(durability)
            .journal_size(3)
            .cache_size(1 << 20)
            .open_with_backend(file.clone())
            .expect("open the store file");
        let inbox = |name| store.inbox(name).expect("a valid inbox name");
        Harness {
            inboxes: [inbox(INBOXES[0]), inbox(INBOXES[1])],
            outbox: store.outbox(),
            keys: store
                .idempotency_keys()
                .with_ttl(Duration::from_secs(TTL.unsigned_abs()))
                .with_lease(Duration::from_secs(LEASE.unsigned_abs())),
            store,
        }
    }
}

/// Everything the store should hold, plus the driver's own state (the
/// clock and the reservations it holds).
#[derive(Default)]
struct Model {
    now: i64,
    /// `(inbox, key) → seen_at` (seconds).
    inbox: BTreeMap<(usize, String), i64>,
    /// The caller table the effects write: `"inbox/key" → value`.
    effects: BTreeMap<String, u64>,
    outbox: OutboxModel,
    keys: KeysModel,
    held: Vec<Reservation>,
}

// ---------------------------------------------------------------- outbox

// The outbox model itself lives in `outbox_model.rs`; picking an id from fuzz
// bytes is this target's own.
impl OutboxModel {
    /// An id to act on: an entry in flight, any live entry, or one never
    /// issued (or purged), chosen by `i`.
    fn pick_id(&self, i: u8) -> u64 {
        let in_flight = self.in_flight();
        if i < 128 && !in_flight.is_empty() {
            return pick(&in_flight, i);
        }
        let mut ids: Vec<u64> = self.records.keys().copied().collect();
        ids.push(self.next_id + 1);
        pick(&ids, i)
    }
}

fn new_entry(cmd: u8, dest: u8, key: u8, payload: u8) -> NewEntry {
    NewEntry::new(
        pick(&COMMANDS, cmd),
        pick(&DESTINATIONS, dest),
        pick(&OUTBOX_KEYS, key),
        vec![payload; usize::from(payload % 4)],
    )
}

/// The public settlement and the model's change for `how` at `now`.
fn settlement(how: &How, now: i64) -> (Settlement, Change) {
    match how {
        How::Completed => (Settlement::Completed, Change::Complete(now)),
        How::Retry(o) => {
            let at = now + offset(*o);
            (
                Settlement::Failed {
                    reason: "http_503".into(),
                    next_attempt_at: Some(t(at)),
                },
                Change::Fail("http_503".into(), Some(at), now),
            )
        }
        How::GiveUp => (
            Settlement::Failed {
                reason: "http_400 (bad request)".into(),
                next_attempt_at: None,
            },
            Change::Fail("http_400 (bad request)".into(), None, now),
        ),
        How::Unknown(r) => {
            let remote = r.map(|r| format!("ref-{}", r % 4));
            (
                Settlement::OutcomeUnknown {
                    remote_ref: remote.clone(),
                },
                Change::Unknown(remote, now),
            )
        }
        How::Reschedule(o) => {
            let at = now + offset(*o);
            (
                Settlement::Rescheduled {
                    next_attempt_at: t(at),
                },
                Change::Reschedule(at, now),
            )
        }
    }
}

// ---------------------------------------------------------------- keys

#[derive(Debug, Clone)]
enum Row {
    Reserved {
        fingerprint: String,
        fence: u64,
        reserved_at: i64,
        lease_until: i64,
    },
    Completed {
        record: ResponseRecord,
        fence: u64,
    },
}

impl Row {
    fn expired(&self, cutoff: i64) -> bool {
        match self {
            Row::Reserved {
                reserved_at,
                lease_until,
                ..
            } => *reserved_at < cutoff && *lease_until <= cutoff,
            Row::Completed { record, .. } => record.created_at < t(cutoff),
        }
    }
}

struct KeysModel {
    rows: BTreeMap<(String, String), Row>,
    next_fence: u64,
}

impl Default for KeysModel {
    fn default() -> Self {
        KeysModel {
            rows: BTreeMap::new(),
            next_fence: 1,
        }
    }
}

impl KeysModel {
    fn take_fence(&mut self) -> u64 {
        let f = self.next_fence;
        self.next_fence += 1;
        f
    }

    /// What `begin` answers; `None` for a new reservation (with whether it
    /// took over an ended lease), which the model then records.
    fn begin(&mut self, tenant: &str, key: &str, fp: &str, now: i64) -> Result<Begin, bool> {
        let k = (tenant.to_owned(), key.to_owned());
        let takeover = match self.rows.get(&k) {
            None => false,
            Some(Row::Completed { record, .. }) => {
                if record.created_at < t(now - TTL) {
                    false
                } else if record.request_fingerprint == fp {
                    return Ok(Begin::Replay(record.clone()));
                } else {
                    return Ok(Begin::Mismatch {
                        stored_fingerprint: record.request_fingerprint.clone(),
                    });
                }
            }
            Some(Row::Reserved {
                fingerprint,
                lease_until,
                ..
            }) => {
                if *lease_until <= now {
                    true
                } else if fingerprint == fp {
                    return Ok(Begin::InFlight {
                        lease_until: t(*lease_until),
                    });
                } else {
                    return Ok(Begin::Mismatch {
                        stored_fingerprint: fingerprint.clone(),
                    });
                }
            }
        };
        let fence = self.take_fence();
        self.rows.insert(
            k,
            Row::Reserved {
                fingerprint: fp.to_owned(),
                fence,
                reserved_at: now,
                lease_until: now + LEASE,
            },
        );
        Err(takeover)
    }

    fn holds(&self, r: &Reservation) -> bool {
        matches!(
            self.rows.get(&(r.tenant().to_owned(), r.key().to_owned())),
            Some(Row::Reserved { fence, .. }) if *fence == r.fence()
        )
    }

    /// Whether the key holds the response `r` itself stored: completing
    /// it again is a repeat, not a fencing.
    fn completed_by(&self, r: &Reservation) -> bool {
        matches!(
            self.rows.get(&(r.tenant().to_owned(), r.key().to_owned())),
            Some(Row::Completed { fence, .. }) if *fence == r.fence()
        )
    }

    fn complete(&mut self, r: &Reservation, mut record: ResponseRecord, now: i64) -> bool {
        if !self.holds(r) {
            return false;
        }
        record.created_at = t(now);
        self.rows.insert(
            (r.tenant().to_owned(), r.key().to_owned()),
            Row::Completed {
                record,
                fence: r.fence(),
            },
        );
        true
    }

    fn release(&mut self, r: &Reservation) {
        if self.holds(r) {
            self.rows
                .remove(&(r.tenant().to_owned(), r.key().to_owned()));
        }
    }

    fn put(&mut self, record: &ResponseRecord) -> bool {
        let k = (record.tenant.clone(), record.idempotency_key.clone());
        let live = match self.rows.get(&k) {
            None => false,
            Some(Row::Completed { record: old, .. }) => {
                old.created_at >= record.created_at - chrono::Duration::seconds(TTL)
            }
            Some(Row::Reserved { lease_until, .. }) => t(*lease_until) > record.created_at,
        };
        if live {
            return false;
        }
        let fence = self.take_fence();
        self.rows.insert(
            k,
            Row::Completed {
                record: record.clone(),
                fence,
            },
        );
        true
    }

    /// `get`: deletes the row if expired at `cutoff`; the response if any.
    fn get(&mut self, tenant: &str, key: &str, cutoff: i64) -> (Option<ResponseRecord>, bool) {
        let k = (tenant.to_owned(), key.to_owned());
        match self.rows.get(&k) {
            Some(row) if row.expired(cutoff) => {
                self.rows.remove(&k);
                (None, true)
            }
            Some(Row::Completed { record, .. }) => (Some(record.clone()), false),
            _ => (None, false),
        }
    }

    fn purge(&mut self, cutoff: i64) -> u64 {
        let before = self.rows.len();
        self.rows.retain(|_, row| !row.expired(cutoff));
        (before - self.rows.len()) as u64
    }

    /// Every row as [`key_row`] reads a listed one.
    fn entries(&self) -> Vec<KeyRow> {
        self.rows
            .iter()
            .map(|((tenant, key), row)| match row {
                Row::Reserved {
                    fingerprint,
                    fence,
                    reserved_at,
                    lease_until,
                } => (
                    tenant.clone(),
                    key.clone(),
                    fingerprint.clone(),
                    *fence,
                    KeyState::Reserved {
                        reserved_at: t(*reserved_at),
                        lease_until: t(*lease_until),
                    },
                ),
                Row::Completed { record, fence } => (
                    tenant.clone(),
                    key.clone(),
                    record.request_fingerprint.clone(),
                    *fence,
                    KeyState::Completed {
                        status: record.response_status,
                        body_len: record.response_body.len(),
                        created_at: record.created_at,
                    },
                ),
            })
            .collect()
    }
}

/// A listed key's tenant, key, fingerprint, fence and state: what the
/// model knows of a [`KeyEntry`], which only the store builds.
type KeyRow = (String, String, String, u64, KeyState);

/// What the model compares of a listed key.
fn key_row(k: &KeyEntry) -> KeyRow {
    (
        k.tenant.clone(),
        k.key.clone(),
        k.fingerprint.clone(),
        k.fence,
        k.state.clone(),
    )
}

// ---------------------------------------------------------------- driver

/// The error of a `claim_with` effect: the store's, or the effect refusing.
#[derive(Debug)]
enum EffectError {
    Store(Error),
    Refused,
}

impl From<Error> for EffectError {
    fn from(e: Error) -> Self {
        EffectError::Store(e)
    }
}

fn apply(h: &Harness, m: &mut Model, op: &Op, stats: &mut ModelStats) {
    let now = m.now;
    match op {
        Op::Advance(s) => m.now += i64::from(s % 32),
        Op::Claim { .. } | Op::ClaimWith { .. } | Op::ClaimMany { .. } | Op::Prune { .. } => {
            apply_inbox(h, m, op, stats);
        }
        Op::Begin { .. }
        | Op::Complete { .. }
        | Op::ReleaseKey { .. }
        | Op::Put { .. }
        | Op::Get { .. }
        | Op::PurgeExpired { .. } => apply_keys(h, m, op, stats),
        Op::Reopen => unreachable!("the driver reopens"),
        _ => apply_outbox(h, &mut m.outbox, now, op, stats),
    }
}

fn apply_inbox(h: &Harness, m: &mut Model, op: &Op, stats: &mut ModelStats) {
    let now = m.now;
    match op {
        Op::Claim { inbox, key } => {
            let (i, key) = (usize::from(inbox % 2), pick(&EVENTS, *key));
            let got = h.inboxes[i].claim(key, t(now)).expect("claim");
            let first = !m.inbox.contains_key(&(i, key.to_owned()));
            if first {
                m.inbox.insert((i, key.to_owned()), now);
            } else {
                stats.duplicate_claims += 1;
            }
            assert_eq!(got, first, "claim {i}/{key}");
        }
        Op::ClaimWith {
            inbox,
            key,
            add,
            fail,
            enqueue,
        } => {
            let (i, key) = (usize::from(inbox % 2), pick(&EVENTS, *key));
            let slot = format!("{}/{key}", INBOXES[i]);
            let entry = enqueue.map(|(c, d, k)| new_entry(c, d, k, *add));
            let got = h.inboxes[i].claim_with(key, t(now), |tx| {
                let mut table = tx.open_table(EFFECTS).map_err(Error::from)?;
                let old = table
                    .get(slot.as_str())
                    .map_err(Error::from)?
                    .map_or(0, |v| v.value());
                table
                    .insert(slot.as_str(), old + u64::from(*add) + 1)
                    .map_err(Error::from)?;
                drop(table);
                let enqueued = match &entry {
                    Some(e) => Some(h.outbox.enqueue_in(tx, e.clone(), t(now))?),
                    None => None,
                };
                if *fail {
                    return Err(EffectError::Refused);
                }
                Ok(enqueued)
            });
            let got = got.map_err(|e| match e {
                EffectError::Store(e) => panic!("claim_with {i}/{key}: {e}"),
                EffectError::Refused => "refused",
            });
            let seen = m.inbox.contains_key(&(i, key.to_owned()));
            if seen {
                stats.duplicate_claims += 1;
                assert!(
                    matches!(got, Ok(Claim::Duplicate)),
                    "claim_with dup: {got:?}"
                );
            } else if *fail {
                stats.effects_refused += 1;
                assert_eq!(got.err(), Some("refused"), "claim_with {i}/{key}");
            } else {
                stats.effects_applied += 1;
                m.inbox.insert((i, key.to_owned()), now);
                *m.effects.entry(slot).or_default() += u64::from(*add) + 1;
                let want = entry.map(|e| m.outbox.enqueue(&e, now));
                match got {
                    Ok(Claim::Applied(enqueued)) => assert_eq!(enqueued, want, "enqueue_in"),
                    other => panic!("claim_with {i}/{key}: {other:?}"),
                }
            }
        }
        Op::ClaimMany { inbox, keys } => {
            let i = usize::from(inbox % 2);
            let keys: Vec<&str> = keys.iter().take(5).map(|k| pick(&EVENTS, *k)).collect();
            let got = h.inboxes[i].claim_many(&keys, t(now)).expect("claim_many");
            let want: Vec<bool> = keys
                .iter()
                .map(|k| match m.inbox.entry((i, (*k).to_owned())) {
                    Entry::Vacant(v) => {
                        v.insert(now);
                        true
                    }
                    Entry::Occupied(_) => {
                        stats.duplicate_claims += 1;
                        false
                    }
                })
                .collect();
            assert_eq!(got, want, "claim_many {i} {keys:?}");
        }
        Op::Prune { inbox, back } => {
            let i = usize::from(inbox % 2);
            let cutoff = now - i64::from(back % 64);
            let got = h.inboxes[i].prune(t(cutoff)).expect("prune");
            let before = m.inbox.len();
            m.inbox.retain(|(j, _), seen| *j != i || *seen >= cutoff);
            let want = (before - m.inbox.len()) as u64;
            stats.pruned += want;
            assert_eq!(got, want, "prune {i} before {cutoff}");
        }
        _ => unreachable!(),
    }
}

#[expect(clippy::too_many_lines, reason = "one arm per operation")]
fn apply_outbox(h: &Harness, m: &mut OutboxModel, now: i64, op: &Op, stats: &mut ModelStats) {
    let outbox = &h.outbox;
    match op {
        Op::Enqueue {
            cmd,
            dest,
            key,
            payload,
            not_before,
        } => {
            let mut e = new_entry(*cmd, *dest, *key, *payload);
            if let Some(o) = not_before {
                e = e.not_before(t(now + offset(*o)));
            }
            let got = outbox.enqueue(e.clone(), t(now)).expect("enqueue");
            let want = m.enqueue(&e, now);
            stats.duplicate_enqueues += u64::from(!want.is_new());
            assert_eq!(got, want, "enqueue {e:?}");
        }
        Op::EnqueueMany(batch) => {
            let batch: Vec<NewEntry> = batch
                .iter()
                .take(4)
                .map(|(c, d, k)| new_entry(*c, *d, *k, *k))
                .collect();
            let got = outbox
                .enqueue_many(batch.clone(), t(now))
                .expect("enqueue_many");
            let want: Vec<Enqueued> = batch.iter().map(|e| m.enqueue(e, now)).collect();
            stats.duplicate_enqueues += want.iter().filter(|e| !e.is_new()).count() as u64;
            assert_eq!(got, want, "enqueue_many");
        }
        Op::ClaimDue { limit, worker } => {
            let limit = usize::from(limit % 5);
            let worker = pick(&WORKERS, *worker);
            let got: Vec<ModelEntry> = outbox
                .claim_due(t(now), limit, worker)
                .expect("claim_due")
                .iter()
                .map(ModelEntry::from)
                .collect();
            let want = m.claim(now, limit, worker);
            stats.claimed += want.len() as u64;
            assert_eq!(got, want, "claim_due {limit}");
        }
        Op::Settle { pick, stale, how } => {
            let id = m.pick_id(*pick);
            let current = m.records.get(&id).map_or(0, |r| r.entry.attempt_count);
            let attempt = current.saturating_sub(u32::from(*stale));
            let (s, change) = settlement(how, now);
            let fence = Fence {
                id: OutboxId(id),
                attempt,
            };
            let what = format!("settle {fence} {s:?}");
            let got = outcome(&outbox.settle(fence, s, t(now)), &what);
            let want = m.change(id, &change, Some(attempt));
            stats.stale_settles += u64::from(*stale && want == Outcome::Conflict);
            stats.retries +=
                u64::from(want == Outcome::Ok && matches!(change, Change::Fail(_, Some(_), _)));
            assert_eq!(got, want, "{what}");
        }
        Op::Mark { pick, how } => {
            let id = m.pick_id(*pick);
            let (_, change) = settlement(how, now);
            let oid = OutboxId(id);
            let got = match &change {
                Change::Complete(_) => outbox.mark_completed(oid, t(now)),
                Change::Fail(reason, retry, _) => {
                    outbox.mark_failed(oid, reason, retry.map(t), t(now))
                }
                Change::Unknown(remote, _) => outbox.mark_outcome_unknown(oid, remote.as_deref()),
                Change::Reschedule(at, _) | Change::Requeue(at) => outbox.reschedule(oid, t(*at)),
                Change::Cancel(_) => outbox.cancel(oid, t(now)),
            };
            let what = format!("mark {id} {change:?}");
            let want = m.change(id, &change, None);
            stats.retries +=
                u64::from(want == Outcome::Ok && matches!(change, Change::Fail(_, Some(_), _)));
            assert_eq!(outcome(&got, &what), want, "{what}");
        }
        Op::Requeue { pick, at } => {
            let id = m.pick_id(pick.wrapping_add(128));
            let at = now + offset(*at);
            let what = format!("requeue {id} at {at}");
            let got = outcome(&outbox.requeue(OutboxId(id), t(at)), &what);
            let want = m.change(id, &Change::Requeue(at), None);
            stats.requeued += u64::from(want == Outcome::Ok);
            assert_eq!(got, want, "{what}");
        }
        Op::Cancel { pick } => {
            let id = m.pick_id(pick.wrapping_add(128));
            let what = format!("cancel {id}");
            let before = m.records.get(&id).map(|r| r.entry.status);
            let got = outcome(&outbox.cancel(OutboxId(id), t(now)), &what);
            let want = m.change(id, &Change::Cancel(now), None);
            stats.cancelled +=
                u64::from(want == Outcome::Ok && before.is_some_and(|s| s != OutboxStatus::Failed));
            assert_eq!(got, want, "{what}");
        }
        Op::ReleaseClaims { back } => {
            let cutoff = now - i64::from(back % 32);
            let got = outbox
                .release_expired_claims(t(cutoff))
                .expect("release_expired_claims");
            let want = m.release(cutoff);
            stats.released += want.len() as u64;
            assert_eq!(got, want, "release before {cutoff}");
        }
        Op::PurgeFinished { back } => {
            let before = now - i64::from(back % 64);
            let got = outbox.purge_finished(t(before)).expect("purge_finished");
            let want = m.purge(before);
            stats.purged += want;
            assert_eq!(got, want, "purge before {before}");
        }
        _ => unreachable!(),
    }
}

fn apply_keys(h: &Harness, m: &mut Model, op: &Op, stats: &mut ModelStats) {
    let now = m.now;
    let keys = &h.keys;
    match op {
        Op::Begin { tenant, key, fp } => {
            let (tenant, key, fp) = (
                pick(&TENANTS, *tenant),
                pick(&IDEM_KEYS, *key),
                pick(&FINGERPRINTS, *fp),
            );
            let got = keys.begin(tenant, key, fp, t(now)).expect("begin");
            match (m.keys.begin(tenant, key, fp, now), got) {
                (Ok(want), got) => {
                    match &want {
                        Begin::Replay(_) => stats.replays += 1,
                        Begin::InFlight { .. } => stats.in_flight += 1,
                        Begin::Mismatch { .. } => stats.mismatches += 1,
                        Begin::Proceed(_) => unreachable!(),
                    }
                    assert_eq!(got, want, "begin {tenant:?}/{key} {fp}");
                }
                (Err(takeover), Begin::Proceed(r)) => {
                    stats.takeovers += u64::from(takeover);
                    assert_eq!(
                        (r.tenant(), r.key(), r.fingerprint(), r.fence()),
                        (tenant, key, fp, m.keys.next_fence - 1),
                        "begin {tenant:?}/{key} {fp}"
                    );
                    assert_eq!((r.reserved_at(), r.lease_until()), (t(now), t(now + LEASE)));
                    if m.held.len() == HELD {
                        m.held.remove(0);
                    }
                    m.held.push(r);
                }
                (Err(_), other) => {
                    panic!("begin {tenant:?}/{key} {fp}: expected Proceed, got {other:?}")
                }
            }
        }
        Op::Complete { held, status } => {
            if m.held.is_empty() {
                return;
            }
            let r = m.held[usize::from(*held) % m.held.len()].clone();
            let response = r.response(200 + u16::from(status % 4), vec![*status; 3], t(0));
            let got = keys
                .complete(&r, response.clone(), t(now))
                .expect("complete");
            let repeat = m.keys.completed_by(&r);
            let want = m.keys.complete(&r, response, now);
            stats.fenced_out += u64::from(!want && !repeat);
            assert_eq!(got, want, "complete {r:?}");
        }
        Op::ReleaseKey { held } => {
            if m.held.is_empty() {
                return;
            }
            let r = m.held[usize::from(*held) % m.held.len()].clone();
            keys.release(&r).expect("release");
            m.keys.release(&r);
        }
        Op::Put {
            tenant,
            key,
            fp,
            at,
        } => {
            let record = ResponseRecord::new(
                pick(&TENANTS, *tenant).to_owned(),
                pick(&IDEM_KEYS, *key).to_owned(),
                pick(&FINGERPRINTS, *fp).to_owned(),
                201,
                b"put".to_vec(),
                t(now + offset(*at)),
            )
            .content_type("text/plain")
            .header("x-fuzz", format!("{at}"));
            let got = keys.put(&record).expect("put");
            assert_eq!(got, m.keys.put(&record), "put {record:?}");
        }
        Op::Get { tenant, key, back } => {
            let (tenant, key) = (pick(&TENANTS, *tenant), pick(&IDEM_KEYS, *key));
            let cutoff = now - i64::from(back % 128);
            let got = keys.get(tenant, key, t(cutoff)).expect("get");
            let (want, expired) = m.keys.get(tenant, key, cutoff);
            stats.expired += u64::from(expired);
            assert_eq!(got, want, "get {tenant:?}/{key} expired before {cutoff}");
        }
        Op::PurgeExpired { back } => {
            let cutoff = now - i64::from(back % 128);
            let got = keys.purge_expired(t(cutoff)).expect("purge_expired");
            let want = m.keys.purge(cutoff);
            stats.expired += want;
            assert_eq!(got, want, "purge_expired before {cutoff}");
        }
        _ => unreachable!(),
    }
}

// ---------------------------------------------------------------- checks

fn verify(h: &Harness, m: &Model, what: &str) {
    verify_inboxes(h, m, what);
    let effects = h
        .store
        .read(|tx| {
            let table = match tx.open_table(EFFECTS) {
                Ok(t) => t,
                Err(TableError::TableDoesNotExist(_)) => return Ok(BTreeMap::new()),
                Err(e) => return Err(Error::from(e)),
            };
            let mut out = BTreeMap::new();
            for row in table.iter().map_err(Error::from)? {
                let (k, v) = row.map_err(Error::from)?;
                out.insert(k.value().to_owned(), v.value());
            }
            Ok(out)
        })
        .expect("read the effects table");
    assert_eq!(effects, m.effects, "after {what}: effects");

    // Outbox: every record, by command; counters; the due front; dedup.
    let outbox = &h.outbox;
    for cmd in COMMANDS {
        let mut want: Vec<&Record> = m
            .outbox
            .records
            .values()
            .filter(|r| r.entry.command_id == cmd)
            .collect();
        want.sort_by_key(|r| (r.entry.created_at, r.entry.id));
        let got: Vec<Record> = outbox
            .list_for_command(cmd)
            .expect("list_for_command")
            .iter()
            .map(Record::from)
            .collect();
        assert_eq!(got.iter().collect::<Vec<_>>(), want, "after {what}: {cmd}");
    }
    assert_eq!(
        outbox.counts().expect("counts"),
        m.outbox.counts(),
        "after {what}: counts"
    );
    let next_due = m.outbox.next_due();
    assert_eq!(
        outbox.next_due().expect("next_due"),
        next_due,
        "after {what}: next_due"
    );
    for dest in DESTINATIONS {
        for key in OUTBOX_KEYS {
            let want = m
                .outbox
                .dedup
                .get(&(dest.to_owned(), key.to_owned()))
                .map(|id| m.outbox.records[id].clone());
            assert_eq!(
                outbox
                    .find(dest, key)
                    .expect("find")
                    .as_ref()
                    .map(Record::from),
                want,
                "after {what}: find"
            );
        }
    }
    assert_eq!(
        outbox.check_indexes().expect("outbox check_indexes"),
        Vec::<String>::new(),
        "after {what}: outbox indexes"
    );

    // Idempotency keys: every row, and the expiry index.
    assert_eq!(
        h.keys
            .list(None, usize::MAX)
            .expect("keys list")
            .iter()
            .map(key_row)
            .collect::<Vec<_>>(),
        m.keys.entries(),
        "after {what}: keys"
    );
    assert_eq!(
        h.keys.check_indexes().expect("keys check_indexes"),
        Vec::<String>::new(),
        "after {what}: key indexes"
    );
}

/// Inbox: counts and every key with its `seen_at`, per inbox, whole and paged,
/// and the tables' invariants.
fn verify_inboxes(h: &Harness, m: &Model, what: &str) {
    for (i, inbox) in h.inboxes.iter().enumerate() {
        let mut want: Vec<(String, DateTime<Utc>)> = m
            .inbox
            .iter()
            .filter(|((j, _), _)| *j == i)
            .map(|((_, k), at)| (k.clone(), t(*at)))
            .collect();
        want.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
        assert_eq!(
            inbox.len().expect("len"),
            want.len() as u64,
            "after {what}: inbox {i} len"
        );
        assert_eq!(
            inbox.list(None, 1000).expect("list"),
            want,
            "after {what}: inbox {i}"
        );
        // The same, two at a time (pages cross from the ledger to the
        // journal and back).
        let mut paged: Vec<(String, DateTime<Utc>)> = Vec::new();
        loop {
            let after = paged.last().map(|(k, at)| (*at, k.as_str()));
            let page = inbox.list(after, 2).expect("list a page");
            if page.is_empty() {
                break;
            }
            paged.extend(page);
        }
        assert_eq!(paged, want, "after {what}: inbox {i}, paged");
    }
    assert_eq!(
        h.store.check_inbox_indexes().expect("inbox check_indexes"),
        Vec::<String>::new(),
        "after {what}"
    );
}
