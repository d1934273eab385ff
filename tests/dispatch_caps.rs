//! A cap of N is N sends at once, on the embedded store: with enough
//! workers and N or more entries due, N sends of a capped destination are
//! in flight together, and never N+1 — on worker threads and on tokio
//! tasks, with several dispatchers on one store. And a dispatcher claims
//! only what it can start: a slow dispatcher beside a fast one sends its
//! share, not a batch it hoarded. (`tests/dispatch_caps_pg.rs`: the same on
//! PostgreSQL.)
//!
//! The sends sleep (they stand for a remote that takes that long); the
//! assertions are on what the remote saw — how many sends were in flight
//! at once, who sent what — never on how long anything took.

use idemstore::{DestinationPolicy, Outbox, Store};

/// The store's folder, kept while a test runs.
type Guard = tempfile::TempDir;

/// A fresh store file with no policy.
fn fresh() -> idemstore::Result<Option<(Guard, Outbox)>> {
    let dir = tempfile::tempdir().map_err(idemstore::Error::Io)?;
    let store = Store::open(dir.path().join("caps.idem"))?;
    Ok(Some((dir, store.outbox())))
}

/// A fresh store file whose destination `api` has a cap of `cap`.
fn capped(cap: u32) -> idemstore::Result<Option<(Guard, Outbox)>> {
    let Some((dir, outbox)) = fresh()? else {
        return Ok(None);
    };
    outbox.set_destination_policy("api", DestinationPolicy::default().max_in_flight(cap))?;
    Ok(Some((dir, outbox)))
}

/// A send of the cases with more workers than the cap.
const SEND: std::time::Duration = std::time::Duration::from_millis(10);

include!("dispatch_caps/cases.rs");
