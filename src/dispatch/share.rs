//! Fair sharing: while several destinations have due entries, none holds
//! more than its share of a dispatcher's workers (its worker threads, or
//! with `start_async` its sends in flight).
//!
//! A dispatcher counts, per destination, the workers busy with it
//! ([`Busy`]). A destination's share of `workers` is
//! `ceil(workers / max(busy destinations, 2))`: an even part among the
//! destinations busy now, and half while only one is, so that a newcomer
//! finds a worker free (and among several busy ones, each worker a fast
//! destination hands back may go to a newcomer first in line). The
//! destinations that hold their share are *crowded*; a claim asks the
//! store to [avoid](crate::ClaimRequest::avoid) them, which it does only
//! while another destination has something to give: a lone destination
//! still gets every worker. When every busy destination is crowded and
//! they hold unequal numbers of workers, the least loaded of them are not
//! crowded (among the busy ones, the next worker goes to the one that has
//! the fewest).
//!
//! A slow destination's workers stay busy with it, a fast one's come back
//! soon and claim again; the counts are of this dispatcher only (the store
//! enforces a destination's `max_in_flight` across every dispatcher).

use std::collections::HashMap;

/// Per destination, how many of a dispatcher's workers are busy with it.
#[derive(Debug, Default)]
pub(super) struct Busy {
    counts: HashMap<String, usize>,
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

    /// The destinations that hold their share of `workers` (see the
    /// module's docs), in no particular order.
    pub(super) fn crowded(&self, workers: usize) -> Vec<String> {
        let busy = self.counts.len();
        if busy == 0 {
            return Vec::new();
        }
        let share = workers.div_ceil(busy.max(2)).max(1);
        let mut crowded: Vec<(&String, usize)> = self
            .counts
            .iter()
            .filter(|(_, n)| **n >= share)
            .map(|(d, n)| (d, *n))
            .collect();
        if crowded.len() == busy {
            let least = crowded.iter().map(|(_, n)| *n).min().unwrap_or(0);
            let most = crowded.iter().map(|(_, n)| *n).max().unwrap_or(0);
            if least < most {
                crowded.retain(|(_, n)| *n > least);
            }
        }
        crowded.into_iter().map(|(d, _)| d.clone()).collect()
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
