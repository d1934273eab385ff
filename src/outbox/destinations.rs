//! Destinations: flow control per remote. A destination is an entry's
//! [`destination`](super::NewEntry::destination) string; its
//! [`DestinationPolicy`] (a concurrency cap, a token-bucket rate limit, a
//! circuit breaker) and its state (paused, in flight, tokens, circuit) are
//! stored with the entries, so that every dispatcher, every process and
//! the CLI see the same ones, and every limit is checked inside the claim's
//! own write transaction: exact across dispatchers and processes, without a
//! coordinator.
//!
//! This file holds the public types and the rules, apart from any storage:
//! [`Flow`] is a destination's stored state as the rules see it, and its
//! methods decide what a claim may take and how a settlement moves the
//! circuit. Both backends call them; each stores a [`Flow`] its own way.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::rules::Row;
use super::{OutboxCounts, OutboxId};
use crate::error::{Error, Result};

/// The longest cool-down a circuit grows to, as a multiple of the
/// policy's `cool_down`: it doubles with each failed probe, up to 32×.
pub const MAX_COOL_DOWN_FACTOR: u32 = 32;

/// How a destination is to be treated: no limits by default.
///
/// ```
/// use std::time::Duration;
/// use idemstore::DestinationPolicy;
///
/// let payments = DestinationPolicy::default()
///     .max_in_flight(4)                                      // 4 connections
///     .rate_limit(10.0, 5)                                   // 10 requests/s, bursts of 5
///     .circuit_breaker(5, Duration::from_secs(30));          // held back 30 s after 5 failures
/// assert_eq!(payments.limits().max_in_flight, Some(4));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[must_use]
pub struct DestinationPolicy {
    max_in_flight: Option<u32>,
    rate: Option<(f64, u32)>,
    circuit: Option<(u32, Duration)>,
    weight: Option<u32>,
}

/// A [`DestinationPolicy`]'s settings, to read.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct PolicyLimits {
    /// At most this many entries `Dispatching` at once.
    pub max_in_flight: Option<u32>,
    /// `(per_second, burst)`: a token bucket.
    pub rate_limit: Option<(f64, u32)>,
    /// `(consecutive_failures, cool_down)`.
    pub circuit_breaker: Option<(u32, Duration)>,
    /// Its share of a dispatcher's workers while busy, against the other
    /// busy destinations' (`None`: the default, 1).
    pub weight: Option<u32>,
}

/// For people: `at most 4 in flight; 10/s, bursts of 5; circuit opens
/// after 3 failures in a row, cool-down 30s`, or `no limits`.
impl std::fmt::Display for DestinationPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if let Some(n) = self.max_in_flight {
            parts.push(format!("at most {n} in flight"));
        }
        if let Some((per_second, burst)) = self.rate {
            parts.push(format!("{per_second}/s, bursts of {burst}"));
        }
        if let Some((k, cool_down)) = self.circuit {
            parts.push(format!(
                "circuit opens after {k} failures in a row, cool-down {}",
                span(cool_down)
            ));
        }
        if let Some(w) = self.weight {
            parts.push(format!("weight {w}"));
        }
        if parts.is_empty() {
            f.write_str("no limits")
        } else {
            f.write_str(&parts.join("; "))
        }
    }
}

/// A cool-down for people: `500ms`, `30s`, `1m 30s`, `2h`.
fn span(d: Duration) -> String {
    if d.subsec_millis() != 0 || d.is_zero() {
        return format!("{}ms", d.as_millis());
    }
    let secs = d.as_secs();
    let (h, m, s) = (secs / 3_600, secs / 60 % 60, secs % 60);
    let mut parts = Vec::new();
    for (n, unit) in [(h, "h"), (m, "m"), (s, "s")] {
        if n > 0 {
            parts.push(format!("{n}{unit}"));
        }
    }
    parts.join(" ")
}

impl DestinationPolicy {
    /// At most `n` of the destination's entries `Dispatching` at once,
    /// across every dispatcher and process on the store (a crashed
    /// dispatcher's claims count until the reaper releases them). `n ≥ 1`:
    /// to stop a destination, [pause](super::Outbox::pause_destination) it.
    pub fn max_in_flight(mut self, n: u32) -> Self {
        self.max_in_flight = Some(n);
        self
    }

    /// At most `per_second` claims per second on average, `burst` at once:
    /// a token bucket of `burst` tokens refilled at `per_second`, kept in the
    /// store and taken from inside the claim. An idle dispatcher sleeps until
    /// the next token. `per_second` finite and above 0 (at least one per
    /// day), `burst ≥ 1`.
    pub fn rate_limit(mut self, per_second: f64, burst: u32) -> Self {
        self.rate = Some((per_second, burst));
        self
    }

    /// After `consecutive_failures` retryable failures in a row, the
    /// destination is held back for `cool_down`; then one probe entry is
    /// sent: a success closes the circuit, a failure holds it back again
    /// for twice as long (up to [`MAX_COOL_DOWN_FACTOR`] × `cool_down`).
    /// While held back, none of its entries is claimed, so none is charged
    /// an attempt. `consecutive_failures ≥ 1`, `cool_down` from 1 ms to
    /// 1 day.
    pub fn circuit_breaker(mut self, consecutive_failures: u32, cool_down: Duration) -> Self {
        self.circuit = Some((consecutive_failures, cool_down));
        self
    }

    /// While several destinations are busy, a dispatcher's workers go to
    /// them in proportion to their weights: a destination of weight 3
    /// beside one of weight 1 gets three of every four workers (with no
    /// policy, every destination weighs 1 and they share evenly). Stored
    /// with the policy, so every dispatcher and process shares out its own
    /// workers by the same weights. `w ≥ 1`; default: 1.
    pub fn weight(mut self, w: u32) -> Self {
        self.weight = Some(w);
        self
    }

    /// Its settings.
    pub fn limits(&self) -> PolicyLimits {
        PolicyLimits {
            max_in_flight: self.max_in_flight,
            rate_limit: self.rate,
            circuit_breaker: self.circuit,
            weight: self.weight,
        }
    }

    /// Whether it sets no limit at all.
    pub fn is_unlimited(&self) -> bool {
        *self == DestinationPolicy::default()
    }

    /// Checks every setting: a bad one is [`Error::InvalidInput`] naming it.
    pub(crate) fn check(&self) -> Result<()> {
        let bad = |field: &'static str, reason: String| Err(Error::InvalidInput { field, reason });
        if self.max_in_flight == Some(0) {
            return bad(
                "max_in_flight",
                "must be at least 1 (pause the destination to stop it)".into(),
            );
        }
        if self.weight == Some(0) {
            return bad(
                "weight",
                "must be at least 1 (pause the destination to stop it)".into(),
            );
        }
        if let Some((per_second, burst)) = self.rate {
            if !per_second.is_finite() || per_second < MIN_RATE {
                return bad(
                    "rate_limit",
                    format!("{per_second} per second: must be finite and at least one per day"),
                );
            }
            if burst == 0 {
                return bad("rate_limit", "burst must be at least 1".into());
            }
        }
        if let Some((failures, cool_down)) = self.circuit {
            if failures == 0 {
                return bad(
                    "circuit_breaker",
                    "consecutive_failures must be at least 1".into(),
                );
            }
            if cool_down < Duration::from_millis(1) || cool_down > MAX_COOL_DOWN {
                return bad(
                    "circuit_breaker",
                    format!("cool_down {cool_down:?}: must be from 1 ms to 1 day"),
                );
            }
        }
        Ok(())
    }

    /// The policy as stored: `(max_in_flight, (per_second, burst),
    /// (consecutive_failures, cool_down µs))`.
    pub(crate) fn to_parts(self) -> PolicyParts {
        PolicyParts {
            max_in_flight: self.max_in_flight,
            rate: self.rate,
            circuit: self
                .circuit
                .map(|(k, d)| (k, i64::try_from(d.as_micros()).unwrap_or(i64::MAX))),
            weight: self.weight,
        }
    }

    /// The policy stored as `parts` (checked when it was set).
    pub(crate) fn from_parts(parts: &PolicyParts) -> DestinationPolicy {
        DestinationPolicy {
            max_in_flight: parts.max_in_flight,
            rate: parts.rate,
            circuit: parts
                .circuit
                .map(|(k, us)| (k, Duration::from_micros(u64::try_from(us).unwrap_or(0)))),
            weight: parts.weight,
        }
    }
}

/// The slowest rate accepted: one per day.
const MIN_RATE: f64 = 1.0 / 86_400.0;
/// The longest cool-down accepted.
const MAX_COOL_DOWN: Duration = Duration::from_secs(86_400);

/// A [`DestinationPolicy`] as both backends store it (times µs).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct PolicyParts {
    pub(crate) max_in_flight: Option<u32>,
    pub(crate) rate: Option<(f64, u32)>,
    pub(crate) circuit: Option<(u32, i64)>,
    /// The share of workers (`None`: 1); no limit on claims.
    pub(crate) weight: Option<u32>,
}

impl PolicyParts {
    /// Whether it limits nothing a claim takes: no cap, rate or circuit
    /// (a weight only shares out workers).
    #[cfg(feature = "postgres")]
    pub(crate) fn limits_nothing(&self) -> bool {
        self.max_in_flight.is_none() && self.rate.is_none() && self.circuit.is_none()
    }
}

/// A destination's circuit breaker, as [`DestinationState`] shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CircuitState {
    /// Entries flow. `consecutive_failures` retryable failures in a row so
    /// far (the circuit opens at the policy's count).
    Closed {
        /// Retryable failures since the last success.
        consecutive_failures: u32,
    },
    /// Held back: nothing is claimed before `until`; from then on one
    /// probe entry may be.
    Open {
        /// When the next probe may be sent.
        until: DateTime<Utc>,
        /// How many times in a row it opened (the cool-down doubles each
        /// time).
        trips: u32,
    },
    /// One probe entry is being sent; its outcome closes the circuit or
    /// opens it again.
    Probing {
        /// The probe.
        probe: OutboxId,
        /// As in `Open`.
        trips: u32,
    },
}

/// What [`Outbox::destinations`](super::Outbox::destinations) reports of
/// one destination: its policy, its state and its entries.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct DestinationState {
    /// The destination.
    pub destination: String,
    /// Its policy (no limits unless set).
    pub policy: DestinationPolicy,
    /// Whether an operator paused it: none of its entries is claimed.
    pub paused: bool,
    /// Its circuit breaker (always `Closed` without one in the policy).
    pub circuit: CircuitState,
    /// Held back until then by a send that asked the whole destination to
    /// wait ([`Settlement::Throttled`](super::Settlement::Throttled)).
    pub held_until: Option<DateTime<Utc>>,
    /// The token bucket's tokens as last stored (it refills at the policy's
    /// rate from then on), with a rate limit.
    pub tokens: Option<f64>,
    /// Its entries `Dispatching` now.
    pub in_flight: u64,
    /// Its entries by status.
    pub counts: OutboxCounts,
}

impl DestinationState {
    /// A destination the store holds nothing of.
    pub(crate) fn empty(destination: &str) -> DestinationState {
        DestinationState {
            destination: destination.to_owned(),
            policy: DestinationPolicy::default(),
            paused: false,
            circuit: CircuitState::Closed {
                consecutive_failures: 0,
            },
            held_until: None,
            tokens: None,
            in_flight: 0,
            counts: OutboxCounts::default(),
        }
    }
}

/// What a claim may take from one destination at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Allowance {
    /// Up to this many entries (`u32::MAX`: no limit); `probe` if the one
    /// it takes is the circuit's probe.
    Take { max: u32, probe: bool },
    /// Nothing before this time (µs), when it may be claimable again (the
    /// circuit's cool-down, a hold, the next token).
    Until(i64),
    /// Nothing until something changes (paused, at its cap, a probe in
    /// flight).
    Blocked,
}

/// A destination's stored state, as the rules see it (times µs).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Flow {
    pub(crate) policy: PolicyParts,
    pub(crate) paused: bool,
    /// Its entries `Dispatching`.
    pub(crate) in_flight: u64,
    /// The bucket's tokens at `tokens_at` (a full bucket when never taken).
    pub(crate) tokens: Option<f64>,
    pub(crate) tokens_at: i64,
    /// Retryable failures in a row while closed.
    pub(crate) failures: u32,
    /// Openings in a row without a success (0: closed).
    pub(crate) trips: u32,
    /// While `trips > 0`: no claim before then; then one probe.
    pub(crate) open_until: Option<i64>,
    /// The probe in flight.
    pub(crate) probe: Option<u64>,
    /// Held back until then ([`Settlement::Throttled`](super::Settlement::Throttled)).
    pub(crate) held_until: Option<i64>,
}

/// What a settlement tells the circuit of its destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Signal {
    /// The remote took it (`Completed` from `Dispatching`).
    Success,
    /// A retryable failure (a retry, or the attempts used up).
    Failure,
    /// Nothing about the remote's health (a permanent failure, an outcome
    /// in doubt, a reschedule, a released claim).
    None,
}

impl Flow {
    /// The tokens in the bucket at `now`, refilled since `tokens_at`.
    fn tokens_at_now(&self, now: i64) -> Option<f64> {
        let (per_second, burst) = self.policy.rate?;
        let burst = f64::from(burst);
        let Some(tokens) = self.tokens else {
            return Some(burst);
        };
        let elapsed = now.saturating_sub(self.tokens_at).max(0) as f64 / 1e6;
        Some((tokens + elapsed * per_second).min(burst))
    }

    /// What a claim at `now` may take.
    pub(crate) fn allowance(&self, now: i64) -> Allowance {
        if self.paused {
            return Allowance::Blocked;
        }
        let mut max = u32::MAX;
        if let Some(cap) = self.policy.max_in_flight {
            let free = u64::from(cap).saturating_sub(self.in_flight);
            if free == 0 {
                return Allowance::Blocked;
            }
            max = u32::try_from(free).unwrap_or(u32::MAX);
        }
        if let Some(until) = self.held_until.filter(|&t| t > now) {
            return Allowance::Until(until);
        }
        let mut probe = false;
        if self.trips > 0 {
            match self.open_until {
                Some(until) if until > now => return Allowance::Until(until),
                _ if self.probe.is_some() => return Allowance::Blocked,
                _ => {
                    probe = true;
                    max = 1;
                }
            }
        }
        if let (Some((per_second, _)), Some(tokens)) = (self.policy.rate, self.tokens_at_now(now)) {
            if tokens < 1.0 - TOKEN_EPSILON {
                return Allowance::Until(now.saturating_add(wait_for_token(tokens, per_second)));
            }
            max = max.min(whole_tokens(tokens));
        }
        Allowance::Take { max, probe }
    }

    /// From when a claim may take something, whatever the entries: `None`
    /// while nothing but a change (a resume, a settlement, a new policy)
    /// can make it claimable. At any `now` from then on, [`Flow::allowance`]
    /// is [`Allowance::Take`].
    pub(crate) fn open_from(&self) -> Option<i64> {
        if self.paused {
            return None;
        }
        if let Some(cap) = self.policy.max_in_flight
            && self.in_flight >= u64::from(cap)
        {
            return None;
        }
        let mut from = i64::MIN;
        if let Some(held) = self.held_until {
            from = from.max(held);
        }
        if self.trips > 0 {
            if self.probe.is_some() {
                return None;
            }
            from = from.max(self.open_until.unwrap_or(i64::MIN));
        }
        if let (Some((per_second, _)), Some(tokens)) = (self.policy.rate, self.tokens)
            && tokens < 1.0 - TOKEN_EPSILON
        {
            {
                from = from.max(
                    self.tokens_at
                        .saturating_add(wait_for_token(tokens, per_second)),
                );
            }
        }
        Some(from)
    }

    /// Notes that a claim at `now` took `n` entries (the allowance's), the
    /// first of them `first` (the probe, if the allowance said so). The
    /// backend counts them in flight.
    pub(crate) fn claimed(&mut self, n: u32, first: u64, probe: bool, now: i64) {
        if self.held_until.is_some_and(|h| h <= now) {
            self.held_until = None;
        }
        if let Some(tokens) = self.tokens_at_now(now) {
            self.tokens = Some(tokens - f64::from(n));
            // A claim whose clock is behind the last one's (it read the
            // clock, then waited for the flow) takes from the bucket as it
            // stands and leaves its time where it was: moved back, the
            // next claim would refill the same stretch of time twice.
            self.tokens_at = self.tokens_at.max(now);
        }
        if probe {
            self.probe = Some(first);
        }
    }

    /// Notes that entry `id` left `Dispatching`, telling the circuit
    /// `signal`, at `now`. The backend counts it out of flight.
    pub(crate) fn settled(&mut self, id: u64, signal: Signal, now: i64) {
        let was_probe = self.probe == Some(id);
        if was_probe {
            self.probe = None;
        }
        match signal {
            Signal::Success => {
                self.failures = 0;
                self.trips = 0;
                self.open_until = None;
            }
            Signal::Failure => {
                let Some((threshold, cool_down)) = self.policy.circuit else {
                    return;
                };
                if self.trips > 0 {
                    if was_probe {
                        self.trips = self.trips.saturating_add(1);
                        self.open_until = Some(now.saturating_add(grown(cool_down, self.trips)));
                    }
                    return;
                }
                self.failures = self.failures.saturating_add(1);
                if self.failures >= threshold {
                    self.failures = 0;
                    self.trips = 1;
                    self.open_until = Some(now.saturating_add(cool_down));
                }
            }
            Signal::None => {}
        }
    }

    /// Holds the destination back until `until` (µs), or longer if it
    /// already is.
    pub(crate) fn hold(&mut self, until: i64) {
        self.held_until = Some(self.held_until.map_or(until, |h| h.max(until)));
    }

    /// A new policy: the bucket starts full again, a circuit the policy no
    /// longer has closes.
    pub(crate) fn set_policy(&mut self, policy: PolicyParts) {
        if policy.rate != self.policy.rate {
            self.tokens = None;
        }
        if policy.circuit.is_none() {
            self.failures = 0;
            self.trips = 0;
            self.open_until = None;
            self.probe = None;
        }
        self.policy = policy;
    }

    /// The circuit as [`DestinationState`] shows it.
    pub(crate) fn circuit_state(
        &self,
        at: impl Fn(i64) -> Result<DateTime<Utc>>,
    ) -> Result<CircuitState> {
        Ok(match (self.trips, self.probe, self.open_until) {
            (0, _, _) => CircuitState::Closed {
                consecutive_failures: self.failures,
            },
            (trips, Some(probe), _) => CircuitState::Probing {
                probe: OutboxId(probe),
                trips,
            },
            (trips, None, until) => CircuitState::Open {
                until: at(until.unwrap_or(0))?,
                trips,
            },
        })
    }

    /// The public view of this destination.
    pub(crate) fn to_state(
        &self,
        destination: &str,
        counts: OutboxCounts,
        at: impl Fn(i64) -> Result<DateTime<Utc>>,
    ) -> Result<DestinationState> {
        Ok(DestinationState {
            destination: destination.to_owned(),
            policy: DestinationPolicy::from_parts(&self.policy),
            paused: self.paused,
            circuit: self.circuit_state(&at)?,
            held_until: self.held_until.map(&at).transpose()?,
            tokens: self
                .policy
                .rate
                .map(|(_, burst)| self.tokens.unwrap_or(f64::from(burst))),
            in_flight: self.in_flight,
            counts,
        })
    }
}

/// What a bucket holding less than one token treats as a whole token:
/// refills computed in floating point may fall short of 1 by a rounding
/// error at the very time [`Flow::open_from`] says a token is there.
const TOKEN_EPSILON: f64 = 1e-9;

/// The whole tokens in a bucket holding `tokens` (at least 1 − ε: see
/// [`TOKEN_EPSILON`]), as a claim may take them.
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "a bucket holds from 0 to its burst (a u32) tokens; `as` saturates beyond"
)]
fn whole_tokens(tokens: f64) -> u32 {
    (tokens + TOKEN_EPSILON).floor() as u32
}

/// How long (µs, at least 1) a bucket holding `tokens` (< 1) waits for
/// its next token at `per_second`.
fn wait_for_token(tokens: f64, per_second: f64) -> i64 {
    let wait = ((1.0 - tokens) / per_second * 1e6).ceil();
    #[expect(
        clippy::cast_possible_truncation,
        reason = "`as` saturates: a wait beyond i64::MAX µs is i64::MAX, NaN is 0 (then 1)"
    )]
    let wait = wait as i64;
    wait.max(1)
}

/// `cool_down` (µs) after `trips` openings in a row: doubled per trip
/// beyond the first, at most [`MAX_COOL_DOWN_FACTOR`] times.
fn grown(cool_down: i64, trips: u32) -> i64 {
    let factor = 1_i64
        .checked_shl(trips.saturating_sub(1).min(31))
        .unwrap_or(i64::MAX)
        .min(i64::from(MAX_COOL_DOWN_FACTOR));
    cool_down.saturating_mul(factor)
}

/// The failure code of an entry whose attempts ran out (the dispatcher's).
pub const REASON_MAX_ATTEMPTS: &str = "max_attempts";

/// Gives `new` (record `id`, changed from `old`) its place in its
/// sequence: none once finished; a fresh one, from `next_seq`, when a
/// finished entry with an ordering key comes back (a requeue puts it at
/// the end).
pub(crate) fn sequenced(
    old: &Row,
    mut new: Row,
    next_seq: impl FnOnce() -> Result<u64>,
) -> Result<Row> {
    if new.status.is_finished() {
        new.seq = None;
    } else if new.ordering_key.is_some() && (old.status.is_finished() || new.seq.is_none()) {
        new.seq = Some(next_seq()?);
    }
    Ok(new)
}

/// Checks a destination name given to a destination call.
pub(crate) fn check_destination(destination: &str) -> Result<()> {
    super::check_field("destination", destination)
}

/// Priorities: `0..=MAX_PRIORITY`, higher first; the default is 0.
pub const MAX_PRIORITY: u8 = 9;

/// Checks an entry's priority.
pub(crate) fn check_priority(p: u8) -> Result<()> {
    if p > MAX_PRIORITY {
        return Err(Error::InvalidInput {
            field: "priority",
            reason: format!("{p}: must be from 0 to {MAX_PRIORITY}"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(policy: DestinationPolicy) -> Flow {
        Flow {
            policy: policy.to_parts(),
            ..Flow::default()
        }
    }

    #[test]
    fn a_bucket_gives_its_burst_then_one_token_per_period() {
        let mut f = flow(DestinationPolicy::default().rate_limit(20.0, 5));
        assert_eq!(
            f.allowance(0),
            Allowance::Take {
                max: 5,
                probe: false
            }
        );
        f.claimed(5, 1, false, 0);
        // The next token comes 50 ms later.
        assert_eq!(f.allowance(0), Allowance::Until(50_000));
        assert_eq!(f.allowance(49_999), Allowance::Until(50_000));
        assert_eq!(
            f.allowance(50_000),
            Allowance::Take {
                max: 1,
                probe: false
            }
        );
        // Never more than the burst, however long it waited.
        assert_eq!(
            f.allowance(3_600_000_000),
            Allowance::Take {
                max: 5,
                probe: false
            }
        );
    }

    #[test]
    fn a_claim_whose_clock_is_behind_refills_no_stretch_of_time_twice() {
        let mut f = flow(DestinationPolicy::default().rate_limit(10.0, 1));
        f.claimed(1, 1, false, 1_000_000);
        // A claim that read its clock half a second earlier, then waited
        // for the flow: the bucket is empty as it stands at 1 s.
        assert!(matches!(f.allowance(500_000), Allowance::Until(_)));
        // 100 ms after the first claim, one token: no more.
        assert_eq!(
            f.allowance(1_100_000),
            Allowance::Take {
                max: 1,
                probe: false
            }
        );
        f.claimed(1, 2, false, 1_100_000);
        // Taken by a claim behind the clock (one token in debt), the bucket
        // gives the next token 200 ms after the last claim, not 100.
        f.claimed(1, 3, false, 600_000);
        assert_eq!(f.allowance(1_200_000), Allowance::Until(1_300_000));
    }

    #[test]
    fn a_cap_counts_what_is_in_flight() {
        let mut f = flow(DestinationPolicy::default().max_in_flight(2));
        assert_eq!(
            f.allowance(0),
            Allowance::Take {
                max: 2,
                probe: false
            }
        );
        f.claimed(2, 1, false, 0);
        f.in_flight = 2;
        assert_eq!(f.allowance(0), Allowance::Blocked);
        assert_eq!(f.open_from(), None);
        f.settled(1, Signal::Success, 1);
        f.in_flight = 1;
        assert_eq!(
            f.allowance(1),
            Allowance::Take {
                max: 1,
                probe: false
            }
        );
    }

    #[test]
    fn a_circuit_opens_after_k_failures_probes_once_and_grows_its_cool_down() {
        let mut f = flow(DestinationPolicy::default().circuit_breaker(3, Duration::from_secs(1)));
        for id in 1..=3 {
            f.claimed(1, id, false, 0);
            f.settled(id, Signal::Failure, 10);
        }
        assert_eq!(f.allowance(10), Allowance::Until(1_000_010));
        // One probe, then nothing while it is out.
        assert_eq!(
            f.allowance(1_000_010),
            Allowance::Take {
                max: 1,
                probe: true
            }
        );
        f.claimed(1, 7, true, 1_000_010);
        assert_eq!(f.allowance(1_000_011), Allowance::Blocked);
        // A failed probe doubles the cool-down; a failure of another
        // entry sent before the circuit opened changes nothing.
        f.settled(4, Signal::Failure, 1_000_020);
        assert_eq!(f.allowance(1_000_020), Allowance::Blocked);
        f.settled(7, Signal::Failure, 2_000_000);
        assert_eq!(f.allowance(2_000_000), Allowance::Until(4_000_000));
        // A successful probe closes it.
        f.claimed(1, 8, true, 4_000_000);
        f.settled(8, Signal::Success, 4_000_001);
        assert_eq!(
            f.allowance(4_000_001),
            Allowance::Take {
                max: u32::MAX,
                probe: false
            }
        );
        assert_eq!(f.trips, 0);
    }

    #[test]
    fn the_cool_down_stops_growing_at_its_cap() {
        assert_eq!(grown(10, 1), 10);
        assert_eq!(grown(10, 2), 20);
        assert_eq!(grown(10, 6), 320);
        assert_eq!(grown(10, 7), 320);
        assert_eq!(grown(10, u32::MAX), 320);
    }

    #[test]
    fn a_paused_destination_gives_nothing() {
        let mut f = flow(DestinationPolicy::default());
        f.paused = true;
        assert_eq!(f.allowance(0), Allowance::Blocked);
    }

    #[test]
    fn bad_policies_are_refused_naming_the_setting() {
        for (policy, field) in [
            (
                DestinationPolicy::default().max_in_flight(0),
                "max_in_flight",
            ),
            (
                DestinationPolicy::default().rate_limit(0.0, 1),
                "rate_limit",
            ),
            (
                DestinationPolicy::default().rate_limit(f64::NAN, 1),
                "rate_limit",
            ),
            (
                DestinationPolicy::default().rate_limit(1.0, 0),
                "rate_limit",
            ),
            (
                DestinationPolicy::default().circuit_breaker(0, Duration::from_secs(1)),
                "circuit_breaker",
            ),
            (
                DestinationPolicy::default().circuit_breaker(1, Duration::ZERO),
                "circuit_breaker",
            ),
        ] {
            match policy.check() {
                Err(Error::InvalidInput { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{policy:?}: {other:?}"),
            }
        }
        assert!(DestinationPolicy::default().check().is_ok());
    }
}
