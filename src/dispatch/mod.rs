//! The runtime that drives the outbox.
