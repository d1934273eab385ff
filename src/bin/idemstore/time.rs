//! `TIME` arguments: an RFC 3339 instant or a relative age meaning "now minus
//! that" (`7d`, `24h`, `30m`, `45s`, or combined: `1d12h`); and `DURATION`
//! arguments, the same ages with milliseconds too (`500ms`, `1m30s`).

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

/// Parses a `TIME` argument relative to the wall clock (for clap).
pub(crate) fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    parse_time_at(s, Utc::now())
}

/// Parses a `TIME` argument; a relative age is taken back from `now`.
pub(crate) fn parse_time_at(s: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err(
            "empty time; use RFC 3339 (2025-01-31T12:00:00Z) or an age (7d, 24h, 30m, 45s)".into(),
        );
    }
    if s.starts_with(|c: char| c.is_ascii_digit()) && s.ends_with(['d', 'h', 'm', 's']) {
        let age = parse_age(s)?;
        return now
            .checked_sub_signed(age)
            .ok_or_else(|| format!("{s:?} reaches before the earliest time supported"));
    }
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| {
            format!(
                "{s:?} is not a time ({e}); use RFC 3339 (2025-01-31T12:00:00Z) \
                 or an age (7d, 24h, 30m, 45s)"
            )
        })
}

/// `7d`, `24h`, `30m`, `45s` or a run of them (`1d12h`).
fn parse_age(s: &str) -> Result<TimeDelta, String> {
    let bad = || format!("{s:?} is not an age; use a number and a unit: 7d, 24h, 30m, 45s");
    let mut total = TimeDelta::zero();
    let mut digits = String::new();
    for c in s.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let n: i64 = digits.parse().map_err(|_| bad())?;
        digits.clear();
        let part = match c {
            'd' => n.checked_mul(86_400),
            'h' => n.checked_mul(3_600),
            'm' => n.checked_mul(60),
            's' => Some(n),
            _ => None,
        }
        .and_then(TimeDelta::try_seconds)
        .ok_or_else(bad)?;
        total = total.checked_add(&part).ok_or_else(bad)?;
    }
    if digits.is_empty() {
        Ok(total)
    } else {
        Err(bad())
    }
}

/// Parses a `DURATION` argument (for clap): a number and a unit (`d`,
/// `h`, `m`, `s`, `ms`), or a run of them (`1m30s`).
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || {
        format!(
            "{s:?} is not a duration; use a number and a unit: 30s, 500ms, 5m, 1h, 1d, or a run of them (1m30s)"
        )
    };
    let mut total = Duration::ZERO;
    let mut rest = s.trim();
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let (number, tail) = rest.split_at(digits);
        let n: u64 = number.parse().map_err(|_| bad())?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let millis = match unit {
            "ms" => Some(1),
            "s" => Some(1_000),
            "m" => Some(60_000),
            "h" => Some(3_600_000),
            "d" => Some(86_400_000),
            _ => None,
        }
        .and_then(|per: u64| n.checked_mul(per))
        .ok_or_else(bad)?;
        total = total
            .checked_add(Duration::from_millis(millis))
            .ok_or_else(bad)?;
        rest = tail;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_each_unit_and_runs_of_them() -> Result<(), String> {
        assert_eq!(parse_duration("500ms")?, Duration::from_millis(500));
        assert_eq!(parse_duration("30s")?, Duration::from_secs(30));
        assert_eq!(parse_duration("5m")?, Duration::from_secs(300));
        assert_eq!(parse_duration("1h")?, Duration::from_secs(3_600));
        assert_eq!(parse_duration("1d")?, Duration::from_secs(86_400));
        assert_eq!(parse_duration("1m30s")?, Duration::from_secs(90));
        assert_eq!(parse_duration("1s500ms")?, Duration::from_millis(1_500));
        for bad in [
            "",
            "30",
            "s",
            "30x",
            "-5s",
            "5 s",
            "1.5s",
            "99999999999999999999s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} was accepted");
        }
        Ok(())
    }

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2025-06-15T12:00:00Z")
            .map(|t| t.with_timezone(&Utc))
            .unwrap_or_default()
    }

    #[test]
    fn relative_ages_count_back_from_now() -> Result<(), String> {
        let now = now();
        assert_eq!(parse_time_at("7d", now)?, now - TimeDelta::days(7));
        assert_eq!(parse_time_at("24h", now)?, now - TimeDelta::hours(24));
        assert_eq!(parse_time_at("30m", now)?, now - TimeDelta::minutes(30));
        assert_eq!(parse_time_at("45s", now)?, now - TimeDelta::seconds(45));
        assert_eq!(parse_time_at("0s", now)?, now);
        assert_eq!(
            parse_time_at("1d12h", now)?,
            now - TimeDelta::days(1) - TimeDelta::hours(12)
        );
        Ok(())
    }

    #[test]
    fn rfc3339_is_read_in_any_offset() -> Result<(), String> {
        let now = now();
        assert_eq!(parse_time_at("2025-06-15T12:00:00Z", now)?, now);
        assert_eq!(parse_time_at("2025-06-15T14:00:00+02:00", now)?, now);
        assert_eq!(
            parse_time_at("2025-06-15T12:00:00.250Z", now)?,
            now + TimeDelta::milliseconds(250)
        );
        Ok(())
    }

    #[test]
    fn bad_times_are_refused_with_a_hint() {
        let now = now();
        for bad in [
            "",
            "7",
            "d",
            "7w",
            "-7d",
            "7 d",
            "7dd",
            "yesterday",
            "2025-06-15",
            "12:00",
            "99999999999999999999d",
            "9223372036854775807d",
        ] {
            let err = parse_time_at(bad, now).err();
            assert!(err.is_some(), "{bad:?} was accepted");
        }
        let msg = parse_time_at("soon", now).err().unwrap_or_default();
        assert!(msg.contains("RFC 3339") && msg.contains("7d"), "{msg}");
    }
}
