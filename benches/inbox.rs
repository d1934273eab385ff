//! Inbox benchmarks (placeholder).
fn main() {}
