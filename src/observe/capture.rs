//! A `tracing` subscriber and a `metrics` recorder that keep what they are
//! given, for tests to read: the events of the `idemstore` targets with
//! their fields, and every metric by name and labels. Install them for the
//! whole process (`tracing::subscriber::set_global_default`,
//! `metrics::set_global_recorder`) or for one thread
//! (`tracing::subscriber::with_default`, `metrics::with_local_recorder`).
//!
//! The crate's own unit tests use it as `observe::capture`; the
//! integration tests (`tests/observe.rs`, `tests/contract_pg.rs`) include
//! this file by path.
// Each user reads a different part of it.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One event: its target, level and fields (each as its `Debug` reads,
/// strings without quotes; the message under `message`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Captured {
    pub(crate) target: String,
    pub(crate) level: Level,
    pub(crate) fields: BTreeMap<String, String>,
}

impl Captured {
    /// The field `name`, if the event has it.
    pub(crate) fn field(&self, name: &str) -> Option<&str> {
        self.fields.get(name).map(String::as_str)
    }
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

/// Keeps the events of the `idemstore` targets; no spans.
#[derive(Clone, Default)]
pub(crate) struct Events(Arc<Mutex<Vec<Captured>>>);

impl Events {
    /// Every event kept so far.
    pub(crate) fn all(&self) -> Vec<Captured> {
        lock(&self.0).clone()
    }

    /// The events kept so far whose target is `target` and whose message is
    /// `message`.
    pub(crate) fn named(&self, target: &str, message: &str) -> Vec<Captured> {
        self.all()
            .into_iter()
            .filter(|e| e.target == target && e.field("message") == Some(message))
            .collect()
    }

    pub(crate) fn clear(&self) {
        lock(&self.0).clear();
    }
}

impl Subscriber for Events {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        metadata.target().starts_with("idemstore")
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        lock(&self.0).push(Captured {
            target: event.metadata().target().to_owned(),
            level: *event.metadata().level(),
            fields,
        });
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

/// One metric's values: what a counter, a gauge or a histogram was given.
#[derive(Debug, Default)]
struct Values {
    counter: AtomicU64,
    /// The gauge's `f64`, as bits.
    gauge: AtomicU64,
    histogram: Mutex<Vec<f64>>,
}

impl CounterFn for Values {
    fn increment(&self, value: u64) {
        self.counter.fetch_add(value, Ordering::SeqCst);
    }

    fn absolute(&self, value: u64) {
        self.counter.fetch_max(value, Ordering::SeqCst);
    }
}

impl GaugeFn for Values {
    fn increment(&self, value: f64) {
        self.set(f64::from_bits(self.gauge.load(Ordering::SeqCst)) + value);
    }

    fn decrement(&self, value: f64) {
        GaugeFn::increment(self, -value);
    }

    fn set(&self, value: f64) {
        self.gauge.store(value.to_bits(), Ordering::SeqCst);
    }
}

impl HistogramFn for Values {
    fn record(&self, value: f64) {
        lock(&self.histogram).push(value);
    }
}

/// A metric's name and labels, the labels sorted.
type Series = (String, Vec<(String, String)>);

fn series(name: &str, labels: &[(&str, &str)]) -> Series {
    let mut labels: Vec<(String, String)> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    labels.sort();
    (name.to_owned(), labels)
}

/// A metric's description: its kind (`counter`, `gauge`, `histogram`),
/// unit and text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Described {
    pub(crate) kind: &'static str,
    pub(crate) unit: Option<Unit>,
    pub(crate) text: String,
}

/// Keeps every metric it is given, by name and labels, and every
/// description, by name.
#[derive(Clone, Default)]
pub(crate) struct Metrics(
    Arc<Mutex<HashMap<Series, Arc<Values>>>>,
    Arc<Mutex<BTreeMap<String, Described>>>,
);

impl Metrics {
    fn describe(&self, kind: &'static str, name: &KeyName, unit: Option<Unit>, text: &str) {
        lock(&self.1).insert(
            name.as_str().to_owned(),
            Described {
                kind,
                unit,
                text: text.to_owned(),
            },
        );
    }

    /// Every description given so far, by metric name.
    pub(crate) fn descriptions(&self) -> BTreeMap<String, Described> {
        lock(&self.1).clone()
    }

    fn values(&self, key: &Key) -> Arc<Values> {
        let labels: Vec<(&str, &str)> = key.labels().map(|l| (l.key(), l.value())).collect();
        lock(&self.0)
            .entry(series(key.name(), &labels))
            .or_default()
            .clone()
    }

    fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<Arc<Values>> {
        lock(&self.0).get(&series(name, labels)).cloned()
    }

    /// The counter `name` with exactly `labels`; `None` if nothing was
    /// counted under them.
    pub(crate) fn counter(&self, name: &str, labels: &[(&str, &str)]) -> Option<u64> {
        self.get(name, labels)
            .map(|v| v.counter.load(Ordering::SeqCst))
    }

    /// The gauge `name` with exactly `labels`, if it was set.
    pub(crate) fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.get(name, labels)
            .map(|v| f64::from_bits(v.gauge.load(Ordering::SeqCst)))
    }

    /// The samples of the histogram `name` with exactly `labels`.
    pub(crate) fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        self.get(name, labels)
            .map(|v| lock(&v.histogram).clone())
            .unwrap_or_default()
    }

    /// Every series of `name` with its labels.
    pub(crate) fn series(&self, name: &str) -> Vec<Vec<(String, String)>> {
        lock(&self.0)
            .keys()
            .filter(|(n, _)| n == name)
            .map(|(_, labels)| labels.clone())
            .collect()
    }

    pub(crate) fn clear(&self) {
        lock(&self.0).clear();
        lock(&self.1).clear();
    }
}

impl Recorder for Metrics {
    fn describe_counter(&self, name: KeyName, unit: Option<Unit>, text: SharedString) {
        self.describe("counter", &name, unit, &text);
    }

    fn describe_gauge(&self, name: KeyName, unit: Option<Unit>, text: SharedString) {
        self.describe("gauge", &name, unit, &text);
    }

    fn describe_histogram(&self, name: KeyName, unit: Option<Unit>, text: SharedString) {
        self.describe("histogram", &name, unit, &text);
    }

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.values(key))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.values(key))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.values(key))
    }
}
