//! `TIME` arguments: an RFC 3339 instant or a relative age meaning "now minus
//! that" (`7d`, `24h`, `30m`, `45s`, or combined: `1d12h`).

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

#[cfg(test)]
mod tests {
    use super::*;

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
