//! `tests/dispatch_caps.rs` on PostgreSQL: a cap of N is N sends at once
//! across dispatchers, on threads and on tokio, and a slow dispatcher
//! beside a fast one sends only what it can start. Needs the test server
//! (`IDEMSTORE_TEST_POSTGRES`; each test skips without it, except under
//! `CI=true`).

mod common;

use common::pg::{self, DropSchema, unique_schema};
use idemstore::DestinationPolicy;
use idemstore::postgres::{PgOutbox, PgStore};

type Outbox = PgOutbox;
type Guard = DropSchema;

/// A store in a fresh schema with no policy.
fn fresh() -> idemstore::Result<Option<(Guard, Outbox)>> {
    let Some(url) = pg::url() else {
        return Ok(None);
    };
    let schema = unique_schema();
    let store = PgStore::builder().schema(&schema).connect(&url)?;
    Ok(Some((DropSchema { url, schema }, store.outbox())))
}

/// A store in a fresh schema whose destination `api` has a cap of `cap`.
fn capped(cap: u32) -> idemstore::Result<Option<(Guard, Outbox)>> {
    let Some((guard, outbox)) = fresh()? else {
        return Ok(None);
    };
    outbox.set_destination_policy("api", DestinationPolicy::default().max_in_flight(cap))?;
    Ok(Some((guard, outbox)))
}

/// A send of the cases with more workers than the cap: a claim on the
/// server takes milliseconds, and the claims of one capped destination
/// take its flow row one after the other.
const SEND: std::time::Duration = std::time::Duration::from_millis(40);

include!("dispatch_caps/cases.rs");
