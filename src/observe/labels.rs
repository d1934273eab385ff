//! The `destination` label of the dispatch metrics, from a bounded set.
//!
//! A destination is any string an application enqueues to, so its name
//! cannot go straight into a label: a recorder keeps a series per label
//! value, and a process that sent to one destination per customer would
//! grow its recorder without end. So the first
//! [`MAX_DESTINATION_LABELS`] distinct destinations a process reports get
//! a label of their own, their name, and every later one shares
//! [`OTHER_DESTINATIONS`] (`_other`). The set is the process's, shared by
//! every store and dispatcher in it, and is kept for the process's life;
//! the tracing events carry the destination's own name, always.

use std::collections::HashSet;
use std::sync::Arc;

use parking_lot::RwLock;

/// How many destinations get a label of their own in a process: 64.
pub(crate) const MAX_DESTINATION_LABELS: usize = 64;

/// The label of every destination beyond the first
/// [`MAX_DESTINATION_LABELS`]: `_other`.
pub(crate) const OTHER_DESTINATIONS: &str = "_other";

/// A bounded set of destination labels (see the module's docs).
#[derive(Debug)]
pub(super) struct DestinationLabels {
    max: usize,
    labels: RwLock<HashSet<Arc<str>>>,
}

/// What a destination's metrics are labelled with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Label {
    /// Its own name.
    Own(Arc<str>),
    /// [`OTHER_DESTINATIONS`].
    Other,
}

impl DestinationLabels {
    /// A set that gives `max` destinations a label of their own.
    pub(super) fn new(max: usize) -> DestinationLabels {
        DestinationLabels {
            max,
            labels: RwLock::new(HashSet::new()),
        }
    }

    /// The label of `destination`: its own once it has one, or if there is
    /// room for one more; else [`Label::Other`]. Holds the set's lock only
    /// to look it up (never while a recorder runs).
    pub(super) fn label(&self, destination: &str) -> Label {
        if let Some(name) = self.labels.read().get(destination) {
            return Label::Own(name.clone());
        }
        let mut labels = self.labels.write();
        if let Some(name) = labels.get(destination) {
            return Label::Own(name.clone());
        }
        if labels.len() >= self.max {
            return Label::Other;
        }
        let name: Arc<str> = destination.into();
        labels.insert(name.clone());
        Label::Own(name)
    }
}

/// The process's set.
pub(super) fn destination_label(destination: &str) -> Label {
    static LABELS: std::sync::OnceLock<DestinationLabels> = std::sync::OnceLock::new();
    LABELS
        .get_or_init(|| DestinationLabels::new(MAX_DESTINATION_LABELS))
        .label(destination)
}

#[cfg(feature = "metrics")]
impl From<Label> for metrics::SharedString {
    fn from(label: Label) -> Self {
        match label {
            Label::Own(name) => name.into(),
            Label::Other => OTHER_DESTINATIONS.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_destinations_get_their_own_label_and_the_rest_share_one() {
        let set = DestinationLabels::new(2);
        assert_eq!(set.label("a"), Label::Own("a".into()));
        assert_eq!(set.label("b"), Label::Own("b".into()));
        assert_eq!(set.label("c"), Label::Other);
        // Those that have one keep it.
        assert_eq!(set.label("a"), Label::Own("a".into()));
        assert_eq!(set.label("c"), Label::Other);
    }
}
