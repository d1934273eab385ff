//! [`RetryPolicy`]: when to try a failed delivery again.

use std::time::Duration;

use chrono::{DateTime, Utc};

/// Exponential back-off with jitter, capped, with a limit on attempts; or
/// a fixed schedule of delays ([`RetryPolicy::schedule`],
/// [`RetryPolicy::webhooks`]).
///
/// The delay before attempt `n + 1` (after `n` failed attempts) is
/// `initial · 2^(n-1)`, capped at `max` (on a schedule: its `n`-th delay,
/// its last one past its end), then spread by `± jitter` of itself.
/// After `max_attempts` attempts the entry fails for good with the reason
/// `max_attempts`.
///
/// Defaults ([`RetryPolicy::default`]): initial 1 s, max 1 h, 20 attempts,
/// jitter 0.2 — about nine hours of retries, like River's and Oban's
/// defaults in spirit.
#[derive(Debug, Clone, Copy, PartialEq)]
#[must_use]
pub struct RetryPolicy {
    initial: Duration,
    max: Duration,
    /// Fixed delays instead of doubling ones.
    schedule: Option<&'static [Duration]>,
    max_attempts: u32,
    jitter: f64,
}

/// The delays of [`RetryPolicy::webhooks`]: 5 s, 5 min, 30 min, 2 h, 5 h,
/// 10 h and 10 h after the first, second, … failed attempt.
pub const WEBHOOK_RETRY_DELAYS: [Duration; 7] = [
    Duration::from_secs(5),
    Duration::from_secs(5 * 60),
    Duration::from_secs(30 * 60),
    Duration::from_secs(2 * 3600),
    Duration::from_secs(5 * 3600),
    Duration::from_secs(10 * 3600),
    Duration::from_secs(10 * 3600),
];

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy::exponential(Duration::from_secs(1), Duration::from_secs(3600))
    }
}

impl RetryPolicy {
    /// Doubling delays from `initial`, capped at `max`; 20 attempts and a
    /// jitter of 0.2 until changed.
    pub fn exponential(initial: Duration, max: Duration) -> Self {
        RetryPolicy {
            initial,
            max: max.max(initial),
            schedule: None,
            max_attempts: 20,
            jitter: 0.2,
        }
    }

    /// Fixed delays: after the `n`-th failed attempt, `delays[n - 1]` (the
    /// last one again past the end); `delays.len() + 1` attempts in all
    /// and a jitter of 0.2 until changed. An empty schedule allows one
    /// attempt.
    pub fn schedule(delays: &'static [Duration]) -> Self {
        RetryPolicy {
            initial: Duration::ZERO,
            max: Duration::ZERO,
            schedule: Some(delays),
            max_attempts: u32::try_from(delays.len())
                .unwrap_or(u32::MAX)
                .saturating_add(1),
            jitter: 0.2,
        }
    }

    /// The webhook services' schedule (Svix's, and Standard Webhooks'
    /// guidance): the first attempt, then again after 5 s, 5 min, 30 min,
    /// 2 h, 5 h, 10 h and 10 h ([`WEBHOOK_RETRY_DELAYS`]): 8 attempts over
    /// about 27.6 hours before the entry fails for good.
    pub fn webhooks() -> Self {
        RetryPolicy::schedule(&WEBHOOK_RETRY_DELAYS)
    }

    /// Attempts allowed in all (the first one included); at least 1.
    /// Default: 20.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Spread each delay uniformly by up to `± fraction` of itself, so that
    /// entries that failed together do not retry together. Clamped to
    /// `0.0..=1.0`. Default: 0.2.
    pub fn jitter(mut self, fraction: f64) -> Self {
        self.jitter = if fraction.is_nan() {
            0.0
        } else {
            fraction.clamp(0.0, 1.0)
        };
        self
    }

    /// The number of attempts allowed.
    pub fn attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The delay after `attempt` failed attempts, before jitter.
    pub fn base_delay(&self, attempt: u32) -> Duration {
        if let Some(delays) = self.schedule {
            let i = usize::try_from(attempt.saturating_sub(1)).unwrap_or(usize::MAX);
            return delays
                .get(i)
                .or_else(|| delays.last())
                .copied()
                .unwrap_or(Duration::ZERO);
        }
        let doublings = attempt.saturating_sub(1).min(63);
        let factor = 1u64 << doublings;
        let nanos = self.initial.as_nanos().saturating_mul(u128::from(factor));
        let capped = nanos.min(self.max.as_nanos());
        Duration::from_nanos(u64::try_from(capped).unwrap_or(u64::MAX))
    }

    /// When to try again after `attempt` failed attempts, at `now`; `None`
    /// when the attempts are used up. `unit` is a number in `[0, 1)` that
    /// picks the jitter (the dispatcher draws it at random).
    pub fn next_attempt(
        &self,
        attempt: u32,
        now: DateTime<Utc>,
        unit: f64,
    ) -> Option<DateTime<Utc>> {
        if attempt >= self.max_attempts {
            return None;
        }
        let base = self.base_delay(attempt).as_secs_f64();
        let spread = base * self.jitter * (2.0 * unit.clamp(0.0, 1.0) - 1.0);
        let delay = Duration::from_secs_f64((base + spread).max(0.0));
        let delay = chrono::Duration::from_std(delay).unwrap_or(chrono::Duration::MAX);
        Some(
            now.checked_add_signed(delay)
                .unwrap_or(DateTime::<Utc>::MAX_UTC),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_cap_and_attempts_run_out() {
        let p = RetryPolicy::exponential(Duration::from_secs(1), Duration::from_secs(10))
            .max_attempts(6)
            .jitter(0.0);
        let delays: Vec<u64> = (1..=5).map(|a| p.base_delay(a).as_secs()).collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 10]);
        let now = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        assert_eq!(
            p.next_attempt(3, now, 0.5),
            Some(now + chrono::Duration::seconds(4))
        );
        assert_eq!(p.next_attempt(6, now, 0.5), None);
        assert_eq!(p.base_delay(1000), Duration::from_secs(10), "no overflow");
    }

    #[test]
    fn the_webhook_schedule_is_eight_attempts_at_the_services_delays() {
        let p = RetryPolicy::webhooks().jitter(0.0);
        assert_eq!(p.attempts(), 8);
        let now = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let waits: Vec<i64> = (1..8)
            .map(|a| (p.next_attempt(a, now, 0.5).unwrap() - now).num_seconds())
            .collect();
        assert_eq!(waits, vec![5, 300, 1800, 7200, 18_000, 36_000, 36_000]);
        assert_eq!(p.next_attempt(8, now, 0.5), None, "used up");
        // More attempts than delays: the last delay again.
        let longer = RetryPolicy::webhooks().max_attempts(10).jitter(0.0);
        assert_eq!(longer.base_delay(9), Duration::from_secs(36_000));
        assert_eq!(RetryPolicy::schedule(&[]).attempts(), 1);
        assert_eq!(RetryPolicy::schedule(&[]).base_delay(3), Duration::ZERO);
    }

    #[test]
    fn jitter_stays_within_its_fraction() {
        let p = RetryPolicy::exponential(Duration::from_secs(100), Duration::from_secs(100))
            .jitter(0.2);
        let now = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let lo = p.next_attempt(1, now, 0.0).unwrap();
        let hi = p.next_attempt(1, now, 0.999_999).unwrap();
        assert_eq!(lo, now + chrono::Duration::seconds(80));
        assert!(
            hi > now + chrono::Duration::seconds(119) && hi <= now + chrono::Duration::seconds(120)
        );
        assert!(RetryPolicy::default().jitter(f64::NAN).jitter.abs() < f64::EPSILON);
        assert!((RetryPolicy::default().jitter(7.0).jitter - 1.0).abs() < f64::EPSILON);
    }
}
