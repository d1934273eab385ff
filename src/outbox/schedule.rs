//! Periodic entries: a [`Schedule`] (a cron expression or a fixed interval,
//! in UTC) and the rule of which of its slots a firing at `now` enqueues.
//! Pure: the storage is `schedules.rs`'s.
//!
//! # Slots
//!
//! A schedule's slots are the instants its expression names (cron), or the
//! multiples of its interval since the Unix epoch (`every`): the same
//! instants in every process, whenever the schedule was set, so that a
//! slot's entry has the same key wherever it is fired.
//!
//! A schedule starts at the `now` of the first firing that sees it (a
//! dispatcher's, by its clock, at once when the schedule is set: setting
//! one reads no clock), or at the `now` it is set with
//! (`Outbox::set_schedule_at`); the slots up to its start never fire: they
//! are before its time. From then on it keeps the last slot it dealt with;
//! a firing at `now` deals with every slot after it up to `now`, by its
//! [`Missed`] policy (the store was down, no dispatcher ran, the schedule
//! was paused).

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
#[cfg(feature = "cron")]
use croner::Cron;
#[cfg(feature = "cron")]
use croner::parser::{CronParser, Seconds};
use serde::{Deserialize, Serialize};

use super::types::NewEntry;
use crate::codec::from_micros;
use crate::error::{Error, Result};

/// The most missed slots [`Missed::All`] enqueues in one firing: the latest
/// ones; older ones are dropped.
pub const MAX_MISSED_SLOTS: usize = 1000;

/// How late a slot may be fired under [`Missed::None`] and still count as
/// on time: 60 s.
pub const ON_TIME: Duration = Duration::from_secs(60);

/// The prefix of the idempotency key of a slot's entry:
/// `idemstore:schedule:<name>:<slot, µs since the epoch>`. Keys of this
/// form are the store's: [`OutboxEntry::slot`](super::OutboxEntry::slot)
/// reads the slot back from them.
pub const SLOT_KEY_PREFIX: &str = "idemstore:schedule:";

/// What a firing does with the slots that passed since the last one (the
/// store was down, no dispatcher ran, the schedule was paused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Missed {
    /// Only the latest slot up to now is enqueued (the default).
    #[default]
    Latest,
    /// Every slot is enqueued, oldest first, at most the latest
    /// [`MAX_MISSED_SLOTS`] of them.
    All,
    /// Only a slot at most [`ON_TIME`] old is enqueued; older ones are
    /// dropped.
    None,
}

/// When a schedule fires.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum When {
    /// A cron expression (five fields, or six with seconds first), in UTC.
    Cron(String),
    /// A fixed interval, in µs.
    Every(u64),
    /// A cron expression in a named time zone: `(expression, zone)`.
    CronIn(String, String),
}

/// A schedule: which destination gets an entry, with which payload, at
/// which instants. Build one with `Schedule::cron` (feature `cron`) or
/// [`Schedule::every`] and store it with
/// [`Outbox::set_schedule`](super::Outbox::set_schedule).
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct Schedule {
    pub(crate) destination: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) when: When,
    pub(crate) missed: Missed,
}

impl Schedule {
    /// Fires at the instants of the cron expression `expr`, in UTC: five
    /// fields (minute, hour, day of month, month, day of week), or six with
    /// seconds first; `@hourly`, `@daily` and the other aliases; `L`, `#`
    /// and `W` as croner reads them. Fails with [`Error::InvalidInput`] for
    /// an expression that does not parse.
    #[cfg(feature = "cron")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cron")))]
    pub fn cron(destination: &str, expr: &str) -> Result<Schedule> {
        parse(expr)?;
        Ok(Schedule::new(
            destination,
            When::Cron(expr.trim().to_owned()),
        ))
    }

    /// Fires every `interval`, at its multiples since the Unix epoch (every
    /// hour on the hour, every 5 minutes at :00, :05, …). Fails with
    /// [`Error::InvalidInput`] for an interval under 1 ms.
    pub fn every(destination: &str, interval: Duration) -> Result<Schedule> {
        if interval < Duration::from_millis(1) {
            return Err(Error::invalid(
                "interval",
                format!("{interval:?} is under 1 ms"),
            ));
        }
        let us = u64::try_from(interval.as_micros())
            .map_err(|_| Error::invalid("interval", format!("{interval:?} is too long")))?;
        Ok(Schedule::new(destination, When::Every(us)))
    }

    fn new(destination: &str, when: When) -> Schedule {
        Schedule {
            destination: destination.to_owned(),
            payload: Vec::new(),
            when,
            missed: Missed::default(),
        }
    }

    /// The payload of every entry it enqueues, stored as given (default:
    /// empty).
    pub fn payload(mut self, payload: Vec<u8>) -> Self {
        self.payload = payload;
        self
    }

    /// A cron schedule's instants in the time zone `name` (`Europe/Berlin`;
    /// jiff's bundled database) instead of UTC. Across daylight-saving
    /// changes, a slot whose wall-clock time does not exist that day (in
    /// the hour skipped in spring) fires once at the first valid time after
    /// it, and one whose wall-clock time happens twice (in the hour repeated
    /// in autumn) fires once, at its first occurrence. Fails with
    /// [`Error::InvalidInput`] for an unknown zone, or for an interval
    /// schedule (whose slots are instants, the same in every zone).
    #[cfg(feature = "tz")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tz")))]
    pub fn time_zone(mut self, name: &str) -> Result<Schedule> {
        time_zone(name)?;
        self.when = match self.when {
            When::Cron(expr) | When::CronIn(expr, _) => When::CronIn(expr, name.to_owned()),
            When::Every(_) => {
                return Err(Error::invalid(
                    "time_zone",
                    "an interval schedule's slots are instants: it has no time zone",
                ));
            }
        };
        Ok(self)
    }

    /// What a firing does with missed slots (default [`Missed::Latest`]).
    pub fn missed(mut self, missed: Missed) -> Self {
        self.missed = missed;
        self
    }

    /// The destination of its entries.
    #[must_use]
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// Its expression: the cron expression, or `every <duration>`.
    #[must_use]
    pub fn spec(&self) -> String {
        self.when.spec()
    }
}

impl When {
    pub(crate) fn spec(&self) -> String {
        match self {
            When::Cron(expr) => expr.clone(),
            When::Every(us) => format!("every {:?}", Duration::from_micros(*us)),
            When::CronIn(expr, zone) => format!("{expr} ({zone})"),
        }
    }

    /// The first slot strictly after `after` (µs since the epoch), or
    /// `None` if there is none (a cron expression that never matches again,
    /// or past the representable range).
    pub(crate) fn next_after(&self, after: i64) -> Result<Option<i64>> {
        match self {
            When::Every(us) => {
                let us = i64::try_from(*us).unwrap_or(i64::MAX);
                let k = after.div_euclid(us);
                Ok(k.checked_add(1).and_then(|k| k.checked_mul(us)))
            }
            When::Cron(expr) | When::CronIn(expr, _) => {
                let cron = parse(expr)?;
                // Cron has whole seconds: from the second `after` is in.
                let Some(from) = zoned(whole_second(after), self.zone())? else {
                    return Ok(None);
                };
                Ok(cron
                    .find_next_occurrence(&from, false)
                    .ok()
                    .map(|at| unzoned(&at)))
            }
        }
    }
}

impl When {
    /// The last slot before `at` (at `at` too if `inclusive`), or `None`.
    fn before(&self, at: i64, inclusive: bool) -> Result<Option<i64>> {
        match self {
            When::Every(us) => {
                let us = i64::try_from(*us).unwrap_or(i64::MAX);
                let t = if inclusive { at } else { at.saturating_sub(1) };
                Ok(Some(t.div_euclid(us).saturating_mul(us)))
            }
            When::Cron(expr) | When::CronIn(expr, _) => {
                let cron = parse(expr)?;
                // Cron has whole seconds: a time within a second counts as
                // that second, so the second itself is included.
                let second = whole_second(at);
                let Some(from) = zoned(second, self.zone())? else {
                    return Ok(None);
                };
                Ok(cron
                    .find_previous_occurrence(&from, inclusive || second < at)
                    .ok()
                    .map(|at| unzoned(&at)))
            }
        }
    }
}

impl When {
    /// The time zone of a cron schedule's wall clock; `None`: UTC.
    fn zone(&self) -> Option<&str> {
        match self {
            When::CronIn(_, zone) => Some(zone),
            _ => None,
        }
    }
}

/// `us` (µs since the epoch) as a time of jiff's in `zone` (`None`: UTC),
/// which croner reads; `None` out of its range. An unknown zone (a record
/// written by a build with a newer database) is an error.
#[cfg(feature = "cron")]
fn zoned(us: i64, zone: Option<&str>) -> Result<Option<jiff::Zoned>> {
    let tz = match zone {
        None => jiff::tz::TimeZone::UTC,
        Some(name) => time_zone(name)?,
    };
    Ok(jiff::Timestamp::from_microsecond(us)
        .ok()
        .map(|t| t.to_zoned(tz)))
}

#[cfg(feature = "tz")]
fn time_zone(name: &str) -> Result<jiff::tz::TimeZone> {
    jiff::tz::TimeZone::get(name).map_err(|e| Error::invalid("time_zone", format!("{name:?}: {e}")))
}

/// Without feature `tz` a stored time zone cannot be read.
#[cfg(all(feature = "cron", not(feature = "tz")))]
fn time_zone(name: &str) -> Result<jiff::tz::TimeZone> {
    Err(Error::invalid(
        "time_zone",
        format!("{name:?}: this build has no time zones (feature `tz`)"),
    ))
}

/// A time croner found, back in µs since the epoch, in whole seconds.
#[cfg(feature = "cron")]
fn unzoned(at: &jiff::Zoned) -> i64 {
    whole_second(at.timestamp().as_microsecond())
}

#[cfg(not(feature = "cron"))]
#[expect(clippy::unnecessary_wraps, reason = "the shape of the build with cron")]
fn zoned(_: i64, _: Option<&str>) -> Result<Option<Never>> {
    Ok(None)
}

#[cfg(not(feature = "cron"))]
fn unzoned(never: &Never) -> i64 {
    match *never {}
}

/// `us` rounded down to a whole second.
fn whole_second(us: i64) -> i64 {
    us.div_euclid(1_000_000).saturating_mul(1_000_000)
}

#[cfg(feature = "cron")]
fn parse(expr: &str) -> Result<Cron> {
    CronParser::builder()
        .seconds(Seconds::Optional)
        .build()
        .parse(expr.trim())
        .map_err(|e| Error::invalid("cron", format!("{expr:?}: {e}")))
}

/// Without feature `cron` a stored cron schedule cannot be read: its
/// firings fail with this error (the schedule is kept, untouched).
#[cfg(not(feature = "cron"))]
fn parse(expr: &str) -> Result<Never> {
    Err(Error::invalid(
        "cron",
        format!("{expr:?}: this build has no cron parser (feature `cron`)"),
    ))
}

/// A cron expression in a build without the parser: never made.
#[cfg(not(feature = "cron"))]
enum Never {}

#[cfg(not(feature = "cron"))]
impl Never {
    fn find_next_occurrence(&self, _: &Never, _: bool) -> std::result::Result<Never, ()> {
        match *self {}
    }

    fn find_previous_occurrence(&self, _: &Never, _: bool) -> std::result::Result<Never, ()> {
        match *self {}
    }
}

/// What a firing at `now` does with a schedule whose last dealt-with slot
/// is `after`: the slots to enqueue (oldest first) and the new last slot
/// dealt with (`after` again if no slot is due). Costs one step per slot
/// enqueued, whatever the length of the outage.
pub(crate) fn due_slots(
    when: &When,
    missed: Missed,
    after: i64,
    now: i64,
) -> Result<(Vec<i64>, i64)> {
    let Some(latest) = when.before(now, true)?.filter(|l| *l > after) else {
        return Ok((Vec::new(), after));
    };
    let chosen = match missed {
        Missed::Latest => vec![latest],
        Missed::None => {
            let on_time = i64::try_from(ON_TIME.as_micros()).unwrap_or(i64::MAX);
            if now.saturating_sub(latest) <= on_time {
                vec![latest]
            } else {
                Vec::new()
            }
        }
        Missed::All => {
            let mut slots = vec![latest];
            let mut earliest = latest;
            while slots.len() < MAX_MISSED_SLOTS {
                match when.before(earliest, false)? {
                    Some(p) if p > after => {
                        slots.push(p);
                        earliest = p;
                    }
                    _ => break,
                }
            }
            slots.reverse();
            slots
        }
    };
    Ok((chosen, latest))
}

/// Longest schedule name accepted, in bytes (its entries' keys carry it).
pub const MAX_SCHEDULE_NAME_LEN: usize = 512;

/// A schedule as [`Outbox::schedules`](super::Outbox::schedules) lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScheduleInfo {
    /// Its name.
    pub name: String,
    /// The destination of its entries.
    pub destination: String,
    /// Its cron expression, or `every <interval>`.
    pub spec: String,
    /// What a firing does with missed slots.
    pub missed: Missed,
    /// Whether it is paused.
    pub paused: bool,
    /// The next slot it will deal with (fire, or drop by its [`Missed`]
    /// policy); `None` until it starts (the first firing that sees it: see
    /// [`Outbox::set_schedule`](super::Outbox::set_schedule)), or if it has
    /// no slot left.
    pub next_slot: Option<DateTime<Utc>>,
    /// The latest slot whose entry it enqueued.
    pub last_fired: Option<DateTime<Utc>>,
}

/// `set_schedule`'s checks, on either backend: the name, and the entry its
/// slots would enqueue (destination, payload within `max_body`).
pub(crate) fn check(name: &str, schedule: &Schedule, max_body: usize) -> Result<()> {
    check_name(name)?;
    super::rules::check_entry(&entry(name, schedule, i64::MIN), max_body)
}

/// A schedule's name: 1 to [`MAX_SCHEDULE_NAME_LEN`] bytes.
pub(crate) fn check_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::invalid("schedule", "a schedule needs a name"));
    }
    if name.len() > MAX_SCHEDULE_NAME_LEN {
        return Err(Error::invalid(
            "schedule",
            format!(
                "the name is {} bytes, over {MAX_SCHEDULE_NAME_LEN}",
                name.len()
            ),
        ));
    }
    Ok(())
}

/// The entry of `name`'s `slot`.
fn entry(name: &str, schedule: &Schedule, slot: i64) -> NewEntry {
    NewEntry::new(
        format!("schedule:{name}"),
        schedule.destination.clone(),
        slot_key(name, slot),
        schedule.payload.clone(),
    )
}

/// A schedule whole, with its state: what both backends store, and fire
/// by the rules below (and what `migrate` copies from a file to a server).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ScheduleRecord {
    pub(crate) name: String,
    pub(crate) schedule: Schedule,
    pub(crate) paused: bool,
    /// The last slot dealt with (µs): the slots up to it are done. `None`
    /// until the schedule starts (the first firing that sees it stores its
    /// `now` here).
    pub(crate) after: Option<i64>,
    /// The latest slot whose entry was enqueued (µs).
    pub(crate) last_fired: Option<i64>,
}

impl ScheduleRecord {
    /// `schedule` set under `name`, replacing `old` if there is one: a
    /// replaced schedule keeps its pause, its start and the slots it dealt
    /// with; a new one starts at `start` (`None`: at its first firing).
    pub(crate) fn set(
        name: &str,
        schedule: Schedule,
        start: Option<i64>,
        old: Option<&ScheduleRecord>,
    ) -> ScheduleRecord {
        ScheduleRecord {
            name: name.to_owned(),
            schedule,
            paused: old.is_some_and(|o| o.paused),
            after: old.map_or(start, |o| o.after.or(start)),
            last_fired: old.and_then(|o| o.last_fired),
        }
    }

    /// Its key in the index of due schedules: its next slot, or `i64::MIN`
    /// until it starts (due at once, for the firing that starts it);
    /// `None` while paused or with no slot left.
    pub(crate) fn due_key(&self) -> Result<Option<i64>> {
        if self.paused {
            return Ok(None);
        }
        match self.after {
            None => Ok(Some(i64::MIN)),
            Some(after) => self.schedule.when.next_after(after),
        }
    }

    /// Fires it at `now`: starts it if it has not started, else moves it
    /// past its due slots; the entries of the slots its [`Missed`] policy
    /// fires, oldest first, to enqueue in the same transaction.
    pub(crate) fn fire(&mut self, now: i64) -> Result<Vec<NewEntry>> {
        let Some(after) = self.after else {
            // It starts now: the slots up to now are before its time.
            self.after = Some(now);
            return Ok(Vec::new());
        };
        let (slots, last) = due_slots(&self.schedule.when, self.schedule.missed, after, now)?;
        self.after = Some(last);
        if let Some(latest) = slots.last() {
            self.last_fired = Some(*latest);
        }
        Ok(slots
            .iter()
            .map(|slot| entry(&self.name, &self.schedule, *slot))
            .collect())
    }

    /// How it is listed; `table` names it in the error of a time out of
    /// range.
    pub(crate) fn info(&self, table: &'static str) -> Result<ScheduleInfo> {
        let at = |us: i64| from_micros(table, &self.name, us);
        let next_slot = match self.after {
            Some(after) => self.schedule.when.next_after(after)?.map(at).transpose()?,
            None => None,
        };
        Ok(ScheduleInfo {
            name: self.name.clone(),
            destination: self.schedule.destination.clone(),
            spec: self.schedule.when.spec(),
            missed: self.schedule.missed,
            paused: self.paused,
            next_slot,
            last_fired: self.last_fired.map(at).transpose()?,
        })
    }
}

/// The time of a due index key (`table` names it in an error): a schedule
/// not started yet is due at the earliest time there is.
pub(crate) fn slot_time(table: &'static str, at: Option<i64>) -> Result<Option<DateTime<Utc>>> {
    match at {
        None => Ok(None),
        Some(i64::MIN) => Ok(Some(DateTime::<Utc>::MIN_UTC)),
        Some(at) => from_micros(table, &"next slot", at).map(Some),
    }
}

/// The idempotency key of `name`'s entry for `slot`.
pub(crate) fn slot_key(name: &str, slot: i64) -> String {
    format!("{SLOT_KEY_PREFIX}{name}:{slot}")
}

/// The slot a key of [`slot_key`]'s form names.
pub(crate) fn slot_of_key(key: &str) -> Option<DateTime<Utc>> {
    let rest = key.strip_prefix(SLOT_KEY_PREFIX)?;
    let (_, slot) = rest.rsplit_once(':')?;
    let us: i64 = slot.parse().ok()?;
    DateTime::<Utc>::UNIX_EPOCH.checked_add_signed(TimeDelta::microseconds(us))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::micros;

    fn t(s: &str) -> i64 {
        micros(DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc))
    }

    #[test]
    #[cfg(feature = "cron")]
    fn cron_and_interval_slots() {
        let five = When::Cron("*/5 * * * *".into());
        assert_eq!(
            five.next_after(t("2026-01-01T00:00:00Z")).unwrap(),
            Some(t("2026-01-01T00:05:00Z"))
        );
        assert_eq!(
            five.next_after(t("2026-01-01T00:04:59Z")).unwrap(),
            Some(t("2026-01-01T00:05:00Z"))
        );
        let secs = When::Cron("*/10 * * * * *".into());
        assert_eq!(
            secs.next_after(t("2026-01-01T00:00:01Z")).unwrap(),
            Some(t("2026-01-01T00:00:10Z"))
        );
        let hourly = When::Every(3_600_000_000);
        assert_eq!(
            hourly.next_after(t("2026-01-01T10:30:00Z")).unwrap(),
            Some(t("2026-01-01T11:00:00Z"))
        );
        assert_eq!(
            hourly.next_after(t("2026-01-01T11:00:00Z")).unwrap(),
            Some(t("2026-01-01T12:00:00Z"))
        );
    }

    #[test]
    #[cfg(feature = "cron")]
    fn missed_slots_by_policy() {
        let five = When::Cron("*/5 * * * *".into());
        let after = t("2026-01-01T00:00:00Z");
        let now = t("2026-01-01T03:00:30Z");
        let (all, last) = due_slots(&five, Missed::All, after, now).unwrap();
        assert_eq!(all.len(), 36);
        assert_eq!(all[0], t("2026-01-01T00:05:00Z"));
        assert_eq!(last, t("2026-01-01T03:00:00Z"));
        let (latest, _) = due_slots(&five, Missed::Latest, after, now).unwrap();
        assert_eq!(latest, vec![t("2026-01-01T03:00:00Z")]);
        let (on_time, _) = due_slots(&five, Missed::None, after, now).unwrap();
        assert_eq!(
            on_time,
            vec![t("2026-01-01T03:00:00Z")],
            "30 s late is on time"
        );
        let late = t("2026-01-01T03:02:00Z");
        let (none, last) = due_slots(&five, Missed::None, after, late).unwrap();
        assert!(none.is_empty());
        assert_eq!(last, t("2026-01-01T03:00:00Z"), "dealt with all the same");
        // Nothing due.
        let (nothing, last) = due_slots(&five, Missed::All, after, after + 1).unwrap();
        assert!(nothing.is_empty());
        assert_eq!(last, after);
    }

    #[test]
    fn a_long_outage_of_a_fine_schedule_keeps_the_latest_slots_only() {
        let second = When::Every(1_000_000);
        let after = t("2026-01-01T00:00:00Z");
        let now = t("2026-01-02T00:00:00Z");
        let (all, last) = due_slots(&second, Missed::All, after, now).unwrap();
        assert_eq!(all.len(), MAX_MISSED_SLOTS);
        assert_eq!(*all.last().unwrap(), now);
        assert_eq!(last, now);
        assert!(all.windows(2).all(|w| w[1] - w[0] == 1_000_000));
    }

    #[test]
    #[cfg(feature = "cron")]
    fn bad_schedules_are_refused() {
        assert!(Schedule::cron("d", "not cron").is_err());
        assert!(Schedule::cron("d", "61 * * * *").is_err());
        assert!(Schedule::cron("d", "").is_err());
        assert!(Schedule::every("d", Duration::ZERO).is_err());
        assert!(Schedule::every("d", Duration::from_micros(999)).is_err());
        assert!(Schedule::cron("d", "@daily").is_ok());
        assert!(Schedule::cron("d", "0 30 2 * * *").is_ok());
    }

    #[test]
    fn slot_keys_round_trip() {
        let slot = t("2026-03-01T02:30:00Z");
        let key = slot_key("report:daily", slot);
        assert_eq!(slot_of_key(&key).map(micros), Some(slot));
        assert_eq!(slot_of_key("order-1"), None);
        assert_eq!(slot_of_key("idemstore:schedule:x:notanumber"), None);
    }
}
