//! Fair sharing: while several destinations have due entries, none holds
//! more than its share of a dispatcher's workers (its worker threads, or
//! with `start_async` its sends in flight).
//!
//! A dispatcher counts, per destination, the workers busy with it
//! ([`Busy`]). A destination of weight `w` (its policy's
//! [`weight`](crate::DestinationPolicy::weight), 1 by default) has a share
//! of `workers` of `ceil(workers × w / max(W, w + 1))`, `W` the weights of
//! the destinations busy now: its part among them in proportion to the
//! weights, and while it is the only one busy, its part beside a newcomer
//! of weight 1, so that the newcomer finds a worker free (and among
//! several busy ones, each worker a fast destination hands back may go to
//! a newcomer first in line). With every weight 1 that is
//! `ceil(workers / max(busy destinations, 2))`. The destinations that hold
//! their share are *crowded*; a claim asks the store to
//! [avoid](crate::ClaimRequest::avoid) them, which it does only while
//! another destination has something to give: a lone destination still
//! gets every worker. When every busy destination is crowded and they hold
//! unequal numbers of workers for their weights, the least loaded of them
//! (workers per weight) are not crowded (among the busy ones, the next
//! worker goes to the one that has the fewest for its weight).
//!
//! A slow destination's workers stay busy with it, a fast one's come back
//! soon and claim again; the counts are of this dispatcher only (the store
//! enforces a destination's `max_in_flight` across every dispatcher).

use std::collections::HashMap;

/// Per destination, how many of a dispatcher's workers are busy with it,
/// and the weights of the destinations that have one other than 1.
#[derive(Debug, Default)]
pub(super) struct Busy {
    counts: HashMap<String, usize>,
    weights: HashMap<String, u32>,
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
    #[cfg(any(feature = "tokio", test))]
    pub(super) fn get(&self, destination: &str) -> usize {
        self.counts.get(destination).copied().unwrap_or(0)
    }

    /// Replaces the destinations' weights (those not named weigh 1).
    pub(super) fn set_weights(&mut self, weights: impl IntoIterator<Item = (String, u32)>) {
        self.weights = weights.into_iter().filter(|(_, w)| *w != 1).collect();
    }

    /// The weight of `destination` (1 unless set).
    fn weight(&self, destination: &str) -> u64 {
        u64::from(self.weights.get(destination).copied().unwrap_or(1).max(1))
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
        // Each crowded one with its load: workers per weight, as a
        // fraction `n / w` compared by cross-multiplying.
        let mut crowded: Vec<(&String, u64, u64)> = self
            .counts
            .iter()
            .map(|(d, n)| (d, *n as u64, self.weight(d)))
            .filter(|(_, n, w)| *n >= share(*w))
            .collect();
        if crowded.len() == busy {
            let lighter = |a: &(&String, u64, u64), b: &(&String, u64, u64)| a.1 * b.2 < b.1 * a.2;
            let least = crowded
                .iter()
                .copied()
                .reduce(|a, b| if lighter(&b, &a) { b } else { a });
            if let Some(least) = least
                && crowded.iter().any(|c| lighter(&least, c))
            {
                crowded.retain(|c| lighter(&least, c));
            }
        }
        crowded.into_iter().map(|(d, ..)| d.clone()).collect()
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

    #[test]
    fn weights_share_the_workers_in_proportion() {
        let weighted = |counts: &[(&str, usize)], weights: &[(&str, u32)], workers| {
            let mut b = busy(counts);
            b.set_weights(weights.iter().map(|(d, w)| ((*d).to_owned(), *w)));
            crowded(&b, workers)
        };
        // 3:1 over 8 workers: shares of 6 and 2.
        let w = [("a", 3), ("b", 1)];
        assert!(weighted(&[("a", 5), ("b", 1)], &w, 8).is_empty());
        assert_eq!(weighted(&[("a", 6), ("b", 1)], &w, 8), ["a"]);
        assert_eq!(weighted(&[("a", 5), ("b", 2)], &w, 8), ["b"]);
        // Both at their shares: both crowded (loads 6/3 and 2/1 are equal).
        assert_eq!(weighted(&[("a", 6), ("b", 2)], &w, 8), ["a", "b"]);
        // Both past them unequally for their weights: the lighter is not.
        assert_eq!(weighted(&[("a", 7), ("b", 3)], &w, 8), ["b"]);
        // Alone, a destination of weight 3 leaves a quarter for a newcomer.
        assert!(weighted(&[("a", 5)], &w, 8).is_empty());
        assert_eq!(weighted(&[("a", 6)], &w, 8), ["a"]);
        // Weights of 1 are the unweighted rule.
        assert_eq!(
            weighted(&[("a", 4), ("b", 3)], &[("a", 1), ("b", 1)], 8),
            crowded(&busy(&[("a", 4), ("b", 3)]), 8)
        );
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
