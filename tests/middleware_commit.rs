//! A handler behind the layer that stores its response with `complete_in`
//! runs once per key whatever happens after that commit, on the embedded
//! store: the suite of `tests/middleware/commit.rs` (run on PostgreSQL by
//! `middleware_pg`).
#![cfg(feature = "middleware")]

mod common;
#[macro_use]
#[path = "middleware/mod.rs"]
mod suite;

middleware_commit_suite!(suite::embedded::Embedded);
