//! The contract suite: one source of tests for the inbox, the outbox (and
//! its destinations) and the idempotency keys, run on every backend.
//!
//! A test binary instantiates it with `contract_suite!()` beside a module
//! `fixture` that names the backend's types and says how to open a fresh
//! store:
//!
//! - `Db`, `Ob`: the store's and the outbox's types;
//! - `Fixture::open() -> Option<Fixture>`: a fresh, empty store in
//!   `fixture.store` (`None`: the backend is not available here, and the
//!   test returns after saying so);
//! - `fixture.another() -> Db`: a second handle on the same data, as
//!   another process would open it;
//! - `fixture.mark(tx, key)` / `fixture.marks()`: the application's own
//!   writes inside a store transaction, and what of them committed;
//! - `fixture.admin()`: the store itself, for the operator's
//!   [`StoreAdmin`](idemstore::StoreAdmin) calls (a fixture whose `Db`
//!   wraps the store hands out what it wraps);
//! - `fixture.commits_during(f)`: `f`'s result, and how many write
//!   transactions committed while it ran (the embedded store's commit
//!   counter; on PostgreSQL, the transactions that updated or deleted
//!   outbox or inbox rows).
//!
//! The tests call the backends' methods by name: the two backends have
//! the same calls, and the suite compiling against both is part of what it
//! checks. `tests/contract.rs` runs it on the embedded store (in every
//! `cargo test`), `tests/contract_shared.rs` on an embedded store shared
//! between processes (its second handle another store on the same file),
//! `tests/contract_pg.rs` on PostgreSQL (feature `postgres`, server from
//! `IDEMSTORE_TEST_POSTGRES`).

/// Opens the fixture, or returns from the test when the backend is not
/// available here.
macro_rules! fixture {
    () => {
        match Fixture::open() {
            Some(f) => f,
            None => return Ok(()),
        }
    };
}

#[macro_use]
mod destinations;
#[macro_use]
mod inbox;
#[macro_use]
mod keys;
#[macro_use]
mod maintenance;
#[macro_use]
mod outbox;

use chrono::{DateTime, Utc};
use idemstore::NewEntry;

/// What a contract test returns.
pub(crate) type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A fixed instant, `secs` seconds after the suite's origin.
pub(crate) fn t(secs: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_700_000_000 + secs, 0).expect("in range")
}

/// An entry of command `cmd` to `dest`, with idempotency key `key`.
pub(crate) fn entry(cmd: &str, dest: &str, key: &str) -> NewEntry {
    NewEntry::new(cmd, dest, key, format!("payload of {key}").into_bytes())
}

/// An application's error, beside the store's: what an effect that refuses
/// to go on returns.
#[derive(Debug)]
pub(crate) enum AppError {
    Store(idemstore::Error),
    Refused,
}

impl From<idemstore::Error> for AppError {
    fn from(e: idemstore::Error) -> Self {
        AppError::Store(e)
    }
}

impl std::fmt::Display for AppError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AppError::Store(e) => write!(f, "the store failed: {e}"),
            AppError::Refused => f.write_str("the application refused"),
        }
    }
}

impl std::error::Error for AppError {}

/// The whole suite, in modules `inbox`, `outbox`, `keys`, `maintenance`
/// and `destinations`.
macro_rules! contract_suite {
    () => {
        inbox_contract!();
        outbox_contract!();
        keys_contract!();
        maintenance_contract!();
        destinations_contract!();
    };
}
