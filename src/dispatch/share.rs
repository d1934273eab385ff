//! Fair sharing: while several destinations have due entries, none holds
//! more than its share of a dispatcher's workers (its worker threads, or
//! with `start_async` its sends in flight), and the shares follow the
//! destinations' weights.
//!
//! A dispatcher counts, per destination, the workers busy with it
//! ([`Busy`]). A destination of weight `w` (its policy's
//! [`weight`](crate::DestinationPolicy::weight), 1 by default) has a share
//! of `workers` of `ceil(workers × w / max(W, w + 1))`, `W` the weights of
//! the destinations busy now: its part among them in proportion to the
//! weights, and while it is the only one busy, its part beside a newcomer
//! of weight 1, so that the newcomer finds a worker free. With every weight
//! 1 that is `ceil(workers / max(busy destinations, 2))`. The destinations
//! that hold their share are *crowded*; a claim asks the store to
//! [avoid](crate::ClaimRequest::avoid) them, which it does only while
//! another destination has something to give: a lone destination still
//! gets every worker. When every busy destination is crowded and they hold
//! unequal numbers of workers for their weights, the least loaded of them
//! (workers per weight) are not crowded.
//!
//! Among the destinations that are not crowded, the next worker goes to the
//! least loaded one that had entries at its last claim ([`Busy::target`]),
//! and counts as busy with it from that moment: workers that come back at
//! once each see the others' choices, so they spread by the weights instead
//! of all going where the counts pointed a moment before.
//!
//! A slow destination's workers stay busy with it, a fast one's come back
//! soon and claim again; the counts are of this dispatcher only (the store
//! enforces a destination's `max_in_flight` across every dispatcher, and
//! each dispatcher shares out its own workers by the same stored weights).

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// How long a dispatcher uses the weights it read before it reads them
/// again: a changed weight takes effect within this.
pub(super) const WEIGHTS_FOR: Duration = Duration::from_secs(1);

/// Per destination, how many of a dispatcher's workers are busy with it;
/// the weights of the destinations that have one other than 1; and the
/// destinations that gave entries at their last claim.
#[derive(Debug, Default)]
pub(super) struct Busy {
    counts: HashMap<String, usize>,
    weights: HashMap<String, u32>,
    /// When the weights were read (`None`: never).
    weighed_at: Option<Instant>,
    /// The destinations that had entries to give at their last claim.
    active: BTreeSet<String>,
}

/// A worker's next claim, as [`Busy::target`] chose it.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Target {
    /// The destination the worker now counts as busy with, if any.
    pub(super) destination: Option<String>,
    /// The destinations the claim avoids: the crowded ones, and with a
    /// target, the other busy ones.
    pub(super) avoid: Vec<String>,
}

impl Busy {
    /// One more worker busy with `destination`.
    pub(super) fn add(&mut self, destination: &str) {
        match self.counts.get_mut(destination) {
            Some(n) => *n += 1,
            None => {
                self.counts.insert(destination.to_owned(), 1);
            }
        }
    }

    /// One worker less busy with `destination`.
    pub(super) fn remove(&mut self, destination: &str) {
        if let Some(n) = self.counts.get_mut(destination) {
            *n -= 1;
            if *n == 0 {
                self.counts.remove(destination);
            }
        }
    }

    /// How many workers are busy with `destination`.
    #[cfg(test)]
    pub(super) fn get(&self, destination: &str) -> usize {
        self.counts.get(destination).copied().unwrap_or(0)
    }

    /// Whether the weights are older than [`WEIGHTS_FOR`] at `now` (or
    /// were never read).
    pub(super) fn weights_stale(&self, now: Instant) -> bool {
        self.weighed_at
            .is_none_or(|at| now.saturating_duration_since(at) >= WEIGHTS_FOR)
    }

    /// Replaces the destinations' weights, read at `at` (those not named
    /// weigh 1).
    pub(super) fn set_weights(
        &mut self,
        weights: impl IntoIterator<Item = (String, u32)>,
        at: Instant,
    ) {
        self.weights = weights.into_iter().filter(|(_, w)| *w != 1).collect();
        self.weighed_at = Some(at);
    }

    /// Keeps the weights another `WEIGHTS_FOR` (reading them failed: the
    /// old ones are better than a read on every claim).
    pub(super) fn keep_weights(&mut self, at: Instant) {
        self.weighed_at = Some(at);
    }

    /// The weight of `destination` (1 unless set).
    fn weight(&self, destination: &str) -> u64 {
        u64::from(self.weights.get(destination).copied().unwrap_or(1).max(1))
    }

    /// Whether `a` carries fewer workers for its weight than `b` does,
    /// `n` workers over weight `w` each, compared by cross-multiplying.
    fn lighter(a: (u64, u64), b: (u64, u64)) -> bool {
        a.0 * b.1 < b.0 * a.1
    }

    /// The load of `destination`: its workers and its weight.
    fn load(&self, destination: &str) -> (u64, u64) {
        let n = self.counts.get(destination).copied().unwrap_or(0);
        (n as u64, self.weight(destination))
    }

    /// Of `destinations`, the least loaded (workers per weight), the first
    /// of equals.
    #[cfg(any(feature = "tokio", test))]
    pub(super) fn least_loaded<'a>(
        &self,
        destinations: impl Iterator<Item = &'a str>,
    ) -> Option<&'a str> {
        destinations.reduce(|a, b| {
            if Self::lighter(self.load(b), self.load(a)) {
                b
            } else {
                a
            }
        })
    }

    /// The destinations that hold their share of `workers` (see the
    /// module's docs), in no particular order.
    pub(super) fn crowded(&self, workers: usize) -> Vec<String> {
        let busy = self.counts.len();
        if busy == 0 {
            return Vec::new();
        }
        let all: u64 = self.counts.keys().map(|d| self.weight(d)).sum();
        let workers = workers as u64;
        let share = |w: u64| -> u64 { (workers * w).div_ceil(all.max(w + 1)).max(1) };
        let mut crowded: Vec<(&String, (u64, u64))> = self
            .counts
            .keys()
            .map(|d| (d, self.load(d)))
            .filter(|(_, (n, w))| *n >= share(*w))
            .collect();
        if crowded.len() == busy {
            let least = crowded
                .iter()
                .map(|(_, load)| *load)
                .reduce(|a, b| if Self::lighter(b, a) { b } else { a });
            if let Some(least) = least
                && crowded.iter().any(|(_, load)| Self::lighter(least, *load))
            {
                crowded.retain(|(_, load)| Self::lighter(least, *load));
            }
        }
        crowded.into_iter().map(|(d, _)| d.clone()).collect()
    }

    /// A worker's next claim: of the active destinations that are not
    /// crowded, the least loaded (the first by name of equals), counted as
    /// busy with this worker at once; the claim avoids the crowded ones and
    /// the other busy ones, so the store gives the target's entries, or
    /// those of a destination no worker is busy with, or, only if none of
    /// those has any, an avoided one's. Costs O(workers), however many
    /// destinations are active: the busy ones are at most the workers, and
    /// an active one with no worker is as light as any.
    pub(super) fn target(&mut self, workers: usize) -> Target {
        let crowded = self.crowded(workers);
        let mut chosen: Option<&str> = None;
        for d in &self.active {
            if crowded.contains(d) {
                continue;
            }
            let load = self.load(d);
            if chosen.is_none_or(|c| Self::lighter(load, self.load(c))) {
                chosen = Some(d);
            }
            if load.0 == 0 {
                // Nothing is lighter than a destination no worker has.
                break;
            }
        }
        let chosen = chosen.map(str::to_owned);
        let mut avoid = crowded;
        if let Some(t) = &chosen {
            for d in self.counts.keys() {
                if d != t && !avoid.contains(d) {
                    avoid.push(d.clone());
                }
            }
            self.add(t);
        }
        Target {
            destination: chosen,
            avoid,
        }
    }

    /// What a claim for `target` gave: entries of `got` (`None`: none at
    /// all). The worker's count moves from the target to `got`; a target
    /// that gave nothing while the store fell back to an avoided
    /// destination, or everything when nothing came, stops being active.
    pub(super) fn claimed(&mut self, target: &Target, got: Option<&str>) {
        if let Some(t) = &target.destination {
            self.remove(t);
        }
        match got {
            Some(d) => {
                if let Some(t) = &target.destination
                    && t != d
                    && target.avoid.iter().any(|a| a == d)
                {
                    // The store looked at the target first and found
                    // nothing there.
                    self.active.remove(t);
                }
                self.add(d);
                self.active.insert(d.to_owned());
            }
            None => self.active.clear(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn busy(counts: &[(&str, usize)]) -> Busy {
        let mut b = Busy::default();
        for (d, n) in counts {
            for _ in 0..*n {
                b.add(d);
            }
        }
        b
    }

    fn crowded(b: &Busy, workers: usize) -> Vec<String> {
        let mut c = b.crowded(workers);
        c.sort();
        c
    }

    #[test]
    fn a_destination_holding_its_share_is_crowded_and_a_newcomer_has_room() {
        // Nothing busy: nothing crowded.
        assert!(busy(&[]).crowded(8).is_empty());
        // One destination: its share of 8 is 4, the rest is for a newcomer.
        assert!(crowded(&busy(&[("a", 3)]), 8).is_empty());
        assert_eq!(crowded(&busy(&[("a", 4)]), 8), ["a"]);
        // Two: a share of 3 each; `b` below it.
        assert_eq!(crowded(&busy(&[("a", 5), ("b", 2)]), 8), ["a"]);
        // Both at their share, unequally: the least loaded is not crowded.
        assert_eq!(crowded(&busy(&[("a", 4), ("b", 3)]), 8), ["a"]);
        // Both at their share, equally: both are (a newcomer goes first).
        assert!(crowded(&busy(&[("a", 3), ("b", 3)]), 8).is_empty());
        assert_eq!(crowded(&busy(&[("a", 4), ("b", 4)]), 8), ["a", "b"]);
        assert_eq!(
            crowded(&busy(&[("a", 3), ("b", 3), ("c", 2)]), 8),
            ["a", "b"]
        );
        // One worker: its share is always 1.
        assert_eq!(crowded(&busy(&[("a", 1)]), 1), ["a"]);
    }

    fn weighted(counts: &[(&str, usize)], weights: &[(&str, u32)]) -> Busy {
        let mut b = busy(counts);
        b.set_weights(
            weights.iter().map(|(d, w)| ((*d).to_owned(), *w)),
            Instant::now(),
        );
        b
    }

    #[test]
    fn weights_share_the_workers_in_proportion() {
        // 3:1 over 8 workers: shares of 6 and 2.
        let w = [("a", 3), ("b", 1)];
        assert!(crowded(&weighted(&[("a", 5), ("b", 1)], &w), 8).is_empty());
        assert_eq!(crowded(&weighted(&[("a", 6), ("b", 1)], &w), 8), ["a"]);
        assert_eq!(crowded(&weighted(&[("a", 5), ("b", 2)], &w), 8), ["b"]);
        // Both at their shares: both crowded (loads 6/3 and 2/1 are equal).
        assert_eq!(crowded(&weighted(&[("a", 6), ("b", 2)], &w), 8), ["a", "b"]);
        // Both past them unequally for their weights: the lighter is not.
        assert_eq!(crowded(&weighted(&[("a", 7), ("b", 3)], &w), 8), ["b"]);
        // Alone, a destination of weight 3 leaves a quarter for a newcomer.
        assert!(crowded(&weighted(&[("a", 5)], &w), 8).is_empty());
        assert_eq!(crowded(&weighted(&[("a", 6)], &w), 8), ["a"]);
        // Weights of 1 are the unweighted rule.
        assert_eq!(
            crowded(&weighted(&[("a", 4), ("b", 3)], &[("a", 1), ("b", 1)]), 8),
            crowded(&busy(&[("a", 4), ("b", 3)]), 8)
        );
        // The least loaded by weight.
        let b = weighted(&[("a", 4), ("b", 2)], &w);
        assert_eq!(b.least_loaded(["b", "a"].into_iter()), Some("a"));
        assert_eq!(b.least_loaded(std::iter::empty()), None);
    }

    /// Eight workers that each take a target in turn, as they would if
    /// they all came back at once, with both destinations active.
    fn targets(weights: &[(&str, u32)]) -> Vec<String> {
        let mut b = weighted(&[], weights);
        b.active.insert("a".into());
        b.active.insert("b".into());
        (0..8)
            .map(|_| b.target(8).destination.expect("a target"))
            .collect()
    }

    #[test]
    fn workers_that_come_back_at_once_spread_by_the_weights() {
        let mut got = targets(&[("a", 3)]);
        got.sort();
        assert_eq!(got, ["a", "a", "a", "a", "a", "a", "b", "b"]);
        let mut got = targets(&[]);
        got.sort();
        assert_eq!(got, ["a", "a", "a", "a", "b", "b", "b", "b"]);
    }

    #[test]
    fn a_target_avoids_the_other_busy_destinations_and_a_miss_makes_it_inactive() {
        let mut b = busy(&[]);
        // Nothing known: no target, nothing avoided.
        assert_eq!(b.target(8), Target::default());
        // A claim with no target gave `a`: active, and busy with it.
        b.claimed(&Target::default(), Some("a"));
        assert_eq!(b.get("a"), 1);
        b.claimed(&Target::default(), Some("b"));
        // `a` and `b` one each: `a` first by name, avoiding `b`.
        let t = b.target(8);
        assert_eq!(t.destination.as_deref(), Some("a"));
        assert_eq!(t.avoid, ["b"]);
        assert_eq!(b.get("a"), 2);
        // The store fell back to the avoided `b`: `a` had nothing.
        b.claimed(&t, Some("b"));
        assert_eq!((b.get("a"), b.get("b")), (1, 2));
        assert!(!b.active.contains("a"));
        // A new destination the store gave instead keeps the target active.
        let t = b.target(8);
        assert_eq!(t.destination.as_deref(), Some("b"));
        b.claimed(&t, Some("c"));
        assert!(b.active.contains("b") && b.active.contains("c"));
        assert_eq!((b.get("b"), b.get("c")), (2, 1));
        // Nothing at all: nothing is active, and the worker holds nothing.
        let t = b.target(8);
        b.claimed(&t, None);
        assert!(b.active.is_empty());
        assert_eq!((b.get("b"), b.get("c")), (2, 1));
    }

    #[test]
    fn a_claim_avoids_only_busy_destinations_however_many_are_active() {
        let mut b = busy(&[("busy", 1)]);
        b.active.insert("busy".into());
        for i in 0..1000 {
            b.active.insert(format!("idle-{i:04}"));
        }
        let t = b.target(8);
        assert_eq!(t.destination.as_deref(), Some("idle-0000"));
        assert_eq!(t.avoid, ["busy"]);
    }

    #[test]
    fn weights_go_stale() {
        let mut b = Busy::default();
        let t0 = Instant::now();
        assert!(b.weights_stale(t0));
        b.set_weights([("a".to_owned(), 2)], t0);
        assert!(!b.weights_stale(t0 + WEIGHTS_FOR / 2));
        assert!(b.weights_stale(t0 + WEIGHTS_FOR));
        b.keep_weights(t0 + WEIGHTS_FOR);
        assert!(!b.weights_stale(t0 + WEIGHTS_FOR));
        assert_eq!(b.weight("a"), 2);
        assert_eq!(b.weight("z"), 1);
    }

    #[test]
    fn counts_go_up_and_down() {
        let mut b = busy(&[("a", 2)]);
        assert_eq!(b.get("a"), 2);
        b.remove("a");
        b.remove("a");
        b.remove("a");
        assert_eq!(b.get("a"), 0);
        assert!(b.crowded(8).is_empty());
    }
}
