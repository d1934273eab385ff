//! Claim selection against a model: seeded random operations over a few
//! destinations with caps, token buckets, circuit breakers, holds,
//! pauses, ordering keys and priorities. After every operation the store
//! must agree with the model on what each claim returns (which entries, in
//! which order), on `next_due`, and on each destination's reported state;
//! `check_indexes` must find nothing.

#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss,
    reason = "the model computes tokens in f64 exactly as the store does, `as` casts included"
)]

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use idemstore::{
    CircuitState, ClaimRequest, DestinationPolicy, Fence, NewEntry, Outbox, OutboxId, Result,
    Settlement, Store,
};

const DESTS: [&str; 3] = ["a", "b", "c"];
const KEYS: [Option<&str>; 3] = [None, Some("k1"), Some("k2")];
const PRIORITIES: [u8; 3] = [0, 1, 5];
const MAX_PRIORITY: u8 = 9;
const EPS: f64 = 1e-9;
/// The instant micros are counted from.
const BASE: i64 = 1_700_000_000_000_000;

fn at(us: i64) -> DateTime<Utc> {
    Utc.timestamp_micros(BASE + us).unwrap()
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[usize::try_from(self.below(items.len() as u64)).unwrap()]
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum St {
    Pending,
    Dispatching,
    Completed,
    Failed,
    Unknown,
}

#[derive(Clone, Debug)]
struct Rec {
    dest: &'static str,
    key: Option<&'static str>,
    prio: u8,
    status: St,
    due: i64,
    claimed_at: i64,
    attempts: u32,
    seq: Option<u64>,
}

#[derive(Clone, Debug, Default)]
struct Dest {
    cap: Option<u32>,
    rate: Option<(f64, u32)>,
    circuit: Option<(u32, i64)>,
    paused: bool,
    tokens: Option<f64>,
    tokens_at: i64,
    failures: u32,
    trips: u32,
    open_until: Option<i64>,
    probe: Option<u64>,
    held: Option<i64>,
    served: i64,
}

enum Allow {
    Take(u32, bool),
    No,
}

#[derive(Clone, Copy, PartialEq)]
enum Signal {
    Success,
    Failure,
    None,
}

#[derive(Default)]
struct Model {
    recs: BTreeMap<u64, Rec>,
    dests: BTreeMap<&'static str, Dest>,
    next_id: u64,
}

impl Model {
    fn dest(&mut self, d: &'static str) -> &mut Dest {
        self.dests.entry(d).or_default()
    }

    fn in_flight(&self, d: &str) -> u64 {
        self.recs
            .values()
            .filter(|r| r.dest == d && r.status == St::Dispatching)
            .count() as u64
    }

    fn tokens_now(f: &Dest, now: i64) -> Option<f64> {
        let (rate, burst) = f.rate?;
        let Some(tokens) = f.tokens else {
            return Some(f64::from(burst));
        };
        let elapsed = (now - f.tokens_at).max(0) as f64 / 1e6;
        Some((tokens + elapsed * rate).min(f64::from(burst)))
    }

    fn allowance(&self, d: &str, now: i64) -> Allow {
        let f = self.dests.get(d).cloned().unwrap_or_default();
        if f.paused {
            return Allow::No;
        }
        let mut max = u32::MAX;
        if let Some(cap) = f.cap {
            let free = u64::from(cap).saturating_sub(self.in_flight(d));
            if free == 0 {
                return Allow::No;
            }
            max = u32::try_from(free).unwrap();
        }
        if f.held.is_some_and(|h| h > now) {
            return Allow::No;
        }
        let mut probe = false;
        if f.trips > 0 {
            if f.open_until.is_some_and(|u| u > now) || f.probe.is_some() {
                return Allow::No;
            }
            probe = true;
            max = 1;
        }
        if let Some(tokens) = Self::tokens_now(&f, now) {
            if tokens < 1.0 - EPS {
                return Allow::No;
            }
            max = max.min((tokens + EPS).floor() as u32);
        }
        Allow::Take(max, probe)
    }

    fn open_from(&self, d: &str) -> Option<i64> {
        let f = self.dests.get(d).cloned().unwrap_or_default();
        if f.paused {
            return None;
        }
        if f.cap.is_some_and(|c| self.in_flight(d) >= u64::from(c)) {
            return None;
        }
        let mut from = i64::MIN;
        if let Some(h) = f.held {
            from = from.max(h);
        }
        if f.trips > 0 {
            if f.probe.is_some() {
                return None;
            }
            from = from.max(f.open_until.unwrap_or(i64::MIN));
        }
        if let (Some((rate, _)), Some(tokens)) = (f.rate, f.tokens)
            && tokens < 1.0 - EPS
        {
            let wait = (((1.0 - tokens) / rate * 1e6).ceil() as i64).max(1);
            from = from.max(f.tokens_at + wait);
        }
        Some(from)
    }

    /// The entries of `d` a claim may take, by the queue's order.
    fn queued(&self, d: &str) -> Vec<(u8, i64, u64)> {
        let mut heads: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for (id, r) in &self.recs {
            if let (Some(k), Some(seq)) = (r.key, r.seq)
                && r.dest == d
                && !matches!(r.status, St::Completed | St::Failed)
            {
                let e = heads.entry(k).or_insert((seq, *id));
                if seq < e.0 {
                    *e = (seq, *id);
                }
            }
        }
        let mut out: Vec<(u8, i64, u64)> = self
            .recs
            .iter()
            .filter(|(id, r)| {
                r.dest == d
                    && r.status == St::Pending
                    && r.key
                        .is_none_or(|k| heads.get(k).map(|h| h.1) == Some(**id))
            })
            .map(|(id, r)| (MAX_PRIORITY - r.prio, r.due, *id))
            .collect();
        out.sort_unstable();
        out
    }

    /// The ready line: each destination with a queued entry and an open
    /// flow, by the later of when it is claimable from and when it was
    /// last served; with when it is claimable from.
    fn line(&self) -> Vec<(i64, &'static str, i64)> {
        let mut line: Vec<(i64, &'static str, i64)> = DESTS
            .iter()
            .filter_map(|&d| {
                let earliest = self.queued(d).iter().map(|q| q.1).min()?;
                let from = self.open_from(d)?.max(earliest);
                let served = self.dests.get(d).map_or(0, |f| f.served);
                Some((from.max(served), d, from))
            })
            .collect();
        line.sort_unstable();
        line
    }

    fn next_due(&self) -> Option<i64> {
        self.line().first().map(|l| l.0)
    }

    fn take_from(&mut self, d: &'static str, n: usize, now: i64, out: &mut Vec<u64>) -> usize {
        let mut taken = 0;
        while taken < n {
            let Allow::Take(max, probe) = self.allowance(d, now) else {
                break;
            };
            if max == 0 {
                break;
            }
            let Some(&(_, _, id)) = self.queued(d).iter().find(|q| q.1 <= now) else {
                break;
            };
            let r = self.recs.get_mut(&id).unwrap();
            r.status = St::Dispatching;
            r.attempts += 1;
            r.claimed_at = now;
            out.push(id);
            let tokens = Self::tokens_now(&self.dests.get(d).cloned().unwrap_or_default(), now);
            let f = self.dest(d);
            if f.held.is_some_and(|h| h <= now) {
                f.held = None;
            }
            if let Some(tokens) = tokens {
                f.tokens = Some(tokens - 1.0);
                // A claim behind the last one's clock leaves the bucket's
                // time where it was (no stretch refills twice).
                f.tokens_at = f.tokens_at.max(now);
            }
            if probe {
                f.probe = Some(id);
            }
            f.served = f.served.max(now);
            taken += 1;
        }
        taken
    }

    fn claim_from(
        &mut self,
        now: i64,
        limit: usize,
        one: bool,
        take: impl Fn(&str) -> bool,
    ) -> Vec<u64> {
        let ready: Vec<&'static str> = self
            .line()
            .into_iter()
            .filter(|(_, d, from)| *from <= now && take(d))
            .map(|(_, d, _)| d)
            .collect();
        let mut out = Vec::new();
        if one {
            for d in ready.into_iter().take(8) {
                self.take_from(d, limit, now, &mut out);
                if !out.is_empty() {
                    break;
                }
            }
            return out;
        }
        let mut line: Vec<&'static str> = ready.into_iter().take(limit).collect();
        while out.len() < limit && !line.is_empty() {
            let mut still = Vec::new();
            for d in line {
                if out.len() >= limit {
                    break;
                }
                if self.take_from(d, 1, now, &mut out) == 1 {
                    still.push(d);
                }
            }
            line = still;
        }
        out
    }

    fn claim(&mut self, now: i64, limit: usize, one: bool, avoid: &[&str]) -> Vec<u64> {
        let out = self.claim_from(now, limit, one, |d| !avoid.contains(&d));
        let out = if out.is_empty() && !avoid.is_empty() {
            self.claim_from(now, limit, one, |d| avoid.contains(&d))
        } else {
            out
        };
        self.forget_idle();
        out
    }

    /// A change of entry `id` out of `Dispatching` (or not), with what it
    /// tells the circuit and the hold it asks for.
    fn settled(&mut self, id: u64, from: St, signal: Signal, hold: Option<i64>, now: i64) {
        let d = self.recs[&id].dest;
        let f = self.dest(d);
        if from == St::Dispatching {
            let was_probe = f.probe == Some(id);
            if was_probe {
                f.probe = None;
            }
            match signal {
                Signal::Success => {
                    f.failures = 0;
                    f.trips = 0;
                    f.open_until = None;
                }
                Signal::Failure => {
                    if let Some((k, cool)) = f.circuit {
                        if f.trips > 0 {
                            if was_probe {
                                f.trips += 1;
                                let factor = (1_i64 << (f.trips - 1).min(31)).min(32);
                                f.open_until = Some(now + cool * factor);
                            }
                        } else {
                            f.failures += 1;
                            if f.failures >= k {
                                f.failures = 0;
                                f.trips = 1;
                                f.open_until = Some(now + cool);
                            }
                        }
                    }
                }
                Signal::None => {}
            }
        }
        if let Some(h) = hold {
            f.held = Some(f.held.map_or(h, |x| x.max(h)));
        }
    }

    fn forget_idle(&mut self) {
        let recs = &self.recs;
        self.dests.retain(|d, f| {
            recs.values().any(|r| r.dest == *d)
                || f.cap.is_some()
                || f.rate.is_some()
                || f.circuit.is_some()
                || f.paused
                || f.held.is_some()
        });
    }
}

/// One seeded run of `steps` operations; panics at the first disagreement.
fn run(seed: u64, steps: usize) -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let mut m = Model::default();
    let mut rng = Rng(seed | 1);
    let mut now: i64 = 0;
    for step in 0..steps {
        now += i64::try_from(rng.below(120_000)).unwrap();
        let what = op(&mut rng, &outbox, &mut m, now)?;
        let ctx = format!("seed {seed} step {step} ({what})");
        assert_eq!(outbox.next_due()?, m.next_due().map(at), "{ctx}: next_due");
        compare_destinations(&outbox, &m, &ctx)?;
        if step % 25 == 0 {
            let findings = outbox.check_indexes()?;
            assert!(findings.is_empty(), "{ctx}: {findings:?}");
        }
    }
    let findings = outbox.check_indexes()?;
    assert!(findings.is_empty(), "seed {seed}: {findings:?}");
    Ok(())
}

fn op(rng: &mut Rng, outbox: &Outbox, m: &mut Model, now: i64) -> Result<String> {
    Ok(match rng.below(100) {
        0..=29 => {
            let d = rng.pick(&DESTS);
            let key = rng.pick(&KEYS);
            let prio = rng.pick(&PRIORITIES);
            let mut e =
                NewEntry::new("c", d, format!("e{}", m.next_id + 1), b"x".to_vec()).priority(prio);
            let mut due = now;
            if rng.chance(20) {
                due = now + i64::try_from(rng.below(500_000)).unwrap();
                e = e.not_before(at(due));
            }
            if let Some(k) = key {
                e = e.ordering_key(k);
            }
            let id = outbox.enqueue(e, at(now))?.id().0;
            m.dest(d);
            m.next_id += 1;
            assert_eq!(id, m.next_id, "ids");
            m.recs.insert(
                id,
                Rec {
                    dest: d,
                    key,
                    prio,
                    status: St::Pending,
                    due,
                    claimed_at: 0,
                    attempts: 0,
                    seq: key.map(|_| id),
                },
            );
            format!("enqueue {id} to {d} key {key:?} prio {prio}")
        }
        30..=54 => {
            // Now and then a claim whose clock is behind the last one's (two
            // workers read it a moment apart).
            let now = if rng.chance(20) {
                now - i64::try_from(rng.below(100_000)).unwrap()
            } else {
                now
            };
            let limit = usize::try_from(1 + rng.below(5)).unwrap();
            let one = rng.chance(30);
            let avoid: Vec<&str> = DESTS.iter().copied().filter(|_| rng.chance(20)).collect();
            let mut req = ClaimRequest::new(limit, "w").avoid(avoid.iter().copied());
            if one {
                req = req.one_destination();
            }
            let got: Vec<u64> = outbox
                .claim(at(now), &req)?
                .iter()
                .map(|e| e.id.0)
                .collect();
            let want = m.claim(now, limit, one, &avoid);
            assert_eq!(
                got, want,
                "claim {limit} one {one} avoid {avoid:?} at {now}"
            );
            format!("claim {limit} one {one} avoid {avoid:?}: {got:?}")
        }
        55..=79 => settle(rng, outbox, m, now)?,
        80..=85 => set_policy(rng, outbox, m)?,
        86..=89 => {
            let d = rng.pick(&DESTS);
            let pause = rng.chance(50);
            if pause {
                outbox.pause_destination(d)?;
            } else {
                outbox.resume_destination(d)?;
            }
            m.dest(d).paused = pause;
            m.forget_idle();
            format!("paused {d}: {pause}")
        }
        90..=94 => {
            let cutoff = now - 200_000;
            let got: Vec<u64> = outbox
                .release_expired_claims(at(cutoff))?
                .iter()
                .map(|i| i.0)
                .collect();
            let mut want: Vec<(i64, u64)> = m
                .recs
                .iter()
                .filter(|(_, r)| r.status == St::Dispatching && r.claimed_at < cutoff)
                .map(|(id, r)| (r.claimed_at, *id))
                .collect();
            want.sort_unstable();
            let want: Vec<u64> = want.into_iter().map(|w| w.1).collect();
            assert_eq!(got, want, "released");
            for id in &want {
                let r = m.recs.get_mut(id).unwrap();
                r.status = St::Pending;
                r.due = r.claimed_at;
                m.settled(*id, St::Dispatching, Signal::None, None, 0);
            }
            format!("release before {cutoff}: {got:?}")
        }
        _ => operator(rng, outbox, m, now)?,
    })
}

fn set_policy(rng: &mut Rng, outbox: &Outbox, m: &mut Model) -> Result<String> {
    let d = rng.pick(&DESTS);
    let mut p = DestinationPolicy::default();
    let f = m.dest(d);
    let (cap, rate, circuit) = (rng.chance(40), rng.chance(40), rng.chance(40));
    let cap = cap.then(|| u32::try_from(1 + rng.below(3)).unwrap());
    let rate = rate.then(|| {
        (
            f64::from(u32::try_from(1 + rng.below(20)).unwrap()),
            u32::try_from(1 + rng.below(4)).unwrap(),
        )
    });
    let circuit = circuit.then(|| {
        (
            u32::try_from(1 + rng.below(3)).unwrap(),
            i64::try_from(1 + rng.below(400)).unwrap() * 1000,
        )
    });
    if let Some(n) = cap {
        p = p.max_in_flight(n);
    }
    if let Some((r, b)) = rate {
        p = p.rate_limit(r, b);
    }
    if let Some((k, us)) = circuit {
        p = p.circuit_breaker(k, Duration::from_micros(u64::try_from(us).unwrap()));
    }
    outbox.set_destination_policy(d, p)?;
    if rate != f.rate {
        f.tokens = None;
    }
    if circuit.is_none() {
        f.failures = 0;
        f.trips = 0;
        f.open_until = None;
        f.probe = None;
    }
    (f.cap, f.rate, f.circuit) = (cap, rate, circuit);
    m.forget_idle();
    Ok(format!("policy {d}: {p:?}"))
}

fn settle(rng: &mut Rng, outbox: &Outbox, m: &mut Model, now: i64) -> Result<String> {
    let claimed: Vec<u64> = m
        .recs
        .iter()
        .filter(|(_, r)| r.status == St::Dispatching)
        .map(|(id, _)| *id)
        .collect();
    if claimed.is_empty() {
        return Ok("nothing to settle".into());
    }
    let id = rng.pick(&claimed);
    let fence = Fence {
        id: OutboxId(id),
        attempt: m.recs[&id].attempts,
    };
    let later = now + i64::try_from(rng.below(400_000)).unwrap();
    let (settlement, to, signal, hold) = match rng.below(7) {
        0 | 1 => (Settlement::Completed, St::Completed, Signal::Success, None),
        2 | 3 => (
            Settlement::Failed {
                reason: "http_503".into(),
                next_attempt_at: Some(at(later)),
            },
            St::Pending,
            Signal::Failure,
            None,
        ),
        4 => (
            Settlement::Failed {
                reason: if rng.chance(50) {
                    "max_attempts (http_503)".into()
                } else {
                    "http_400".into()
                },
                next_attempt_at: None,
            },
            St::Failed,
            Signal::None,
            None,
        ),
        5 => (
            Settlement::Throttled {
                reason: "http_429".into(),
                next_attempt_at: at(later),
            },
            St::Pending,
            Signal::None,
            Some(later),
        ),
        _ => (
            Settlement::OutcomeUnknown { remote_ref: None },
            St::Unknown,
            Signal::None,
            None,
        ),
    };
    let signal = match &settlement {
        Settlement::Failed {
            reason,
            next_attempt_at: None,
        } if reason.starts_with("max_attempts") => Signal::Failure,
        _ => signal,
    };
    let text = format!("settle {id} {settlement:?}");
    outbox.settle(fence, settlement, at(now))?;
    let r = m.recs.get_mut(&id).unwrap();
    r.status = to;
    if to == St::Pending {
        r.due = later;
    }
    if matches!(to, St::Completed | St::Failed) {
        r.seq = None;
    }
    m.settled(id, St::Dispatching, signal, hold, now);
    Ok(text)
}

fn operator(rng: &mut Rng, outbox: &Outbox, m: &mut Model, now: i64) -> Result<String> {
    let pick = |m: &Model, s: St| -> Vec<u64> {
        m.recs
            .iter()
            .filter(|(_, r)| r.status == s)
            .map(|(id, _)| *id)
            .collect()
    };
    match rng.below(3) {
        0 => {
            let ids = pick(m, St::Unknown);
            if ids.is_empty() {
                return Ok("no entry in doubt".into());
            }
            let id = rng.pick(&ids);
            outbox.mark_completed(OutboxId(id), at(now))?;
            let r = m.recs.get_mut(&id).unwrap();
            r.status = St::Completed;
            r.seq = None;
            Ok(format!("complete {id}"))
        }
        1 => {
            let ids = pick(m, St::Failed);
            if ids.is_empty() {
                return Ok("no failed entry".into());
            }
            let id = rng.pick(&ids);
            outbox.requeue(OutboxId(id), at(now))?;
            let keyed = m.recs[&id].key.is_some();
            if keyed {
                m.next_id += 1;
            }
            let next = m.next_id;
            let r = m.recs.get_mut(&id).unwrap();
            r.status = St::Pending;
            r.due = now;
            r.seq = keyed.then_some(next);
            Ok(format!("requeue {id}"))
        }
        _ => {
            let ids = pick(m, St::Pending);
            if ids.is_empty() {
                return Ok("no pending entry".into());
            }
            let id = rng.pick(&ids);
            outbox.cancel(OutboxId(id), at(now))?;
            let r = m.recs.get_mut(&id).unwrap();
            r.status = St::Failed;
            r.seq = None;
            Ok(format!("cancel {id}"))
        }
    }
}

fn compare_destinations(outbox: &Outbox, m: &Model, ctx: &str) -> Result<()> {
    let got = outbox.destinations()?;
    let names: Vec<&str> = got.iter().map(|d| d.destination.as_str()).collect();
    let want: Vec<&str> = m.dests.keys().copied().collect();
    assert_eq!(names, want, "{ctx}: destinations");
    for state in &got {
        let f = &m.dests[state.destination.as_str()];
        let d = state.destination.as_str();
        assert_eq!(state.paused, f.paused, "{ctx}: {d} paused");
        assert_eq!(state.in_flight, m.in_flight(d), "{ctx}: {d} in flight");
        let count = |s: St| {
            m.recs
                .values()
                .filter(|r| r.dest == d && r.status == s)
                .count() as u64
        };
        assert_eq!(
            [
                state.counts.pending,
                state.counts.dispatching,
                state.counts.completed,
                state.counts.failed,
                state.counts.outcome_unknown
            ],
            [
                count(St::Pending),
                count(St::Dispatching),
                count(St::Completed),
                count(St::Failed),
                count(St::Unknown)
            ],
            "{ctx}: {d} counts"
        );
        let circuit = match (f.trips, f.probe) {
            (0, _) => CircuitState::Closed {
                consecutive_failures: f.failures,
            },
            (trips, Some(p)) => CircuitState::Probing {
                probe: OutboxId(p),
                trips,
            },
            (trips, None) => CircuitState::Open {
                until: at(f.open_until.unwrap_or(-BASE)),
                trips,
            },
        };
        assert_eq!(state.circuit, circuit, "{ctx}: {d} circuit");
        assert_eq!(state.held_until, f.held.map(at), "{ctx}: {d} held");
        let tokens = f.rate.map(|(_, b)| f.tokens.unwrap_or(f64::from(b)));
        assert_eq!(state.tokens, tokens, "{ctx}: {d} tokens");
    }
    Ok(())
}

/// Seeded runs: 8, or `IDEMSTORE_CLAIM_MODEL_SEEDS` (`.ci/run` runs 24 in a
/// release build).
fn seeds() -> u64 {
    std::env::var("IDEMSTORE_CLAIM_MODEL_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8)
}

#[test]
fn claims_agree_with_the_model_of_caps_buckets_circuits_order_and_priorities() -> Result<()> {
    for seed in 1..=seeds() {
        run(seed * 7919, 300)?;
    }
    Ok(())
}
