//! The suite's [`Backend`] on PostgreSQL: a store in a schema of its own
//! (dropped at the end), the orders in a table of that schema.
//!
//! The synchronous client cannot be called from a thread that runs a tokio
//! runtime (it runs one of its own inside each call): the calls an async
//! test makes directly go through [`pg::off_runtime`]. (A store's last
//! handle may drop there: the store closes its pool on a thread of its
//! own.)

use std::any::Any;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use idemstore::postgres::{PgIdempotencyKeys, PgStore};
use idemstore::{IdempotencyStats, Reservation, ResponseRecord};

use super::{Backend, Error, order_response};
use crate::common::pg;

#[derive(Clone)]
pub(crate) struct Pg {
    store: PgStore,
    /// Drops the schema after the store's pool closes (fields drop in
    /// order).
    _remove: Option<Arc<dyn Any + Send + Sync>>,
}

impl Pg {
    fn store(&self) -> &PgStore {
        &self.store
    }

    fn connect(schema: &str) -> Result<PgStore, Error> {
        let url = pg::url().ok_or("no test server")?;
        Ok(PgStore::builder()
            .schema(schema)
            .pool_size(4)
            .connect(&url)?)
    }

    fn new_address_here() -> Option<(String, Box<dyn Any + Send + Sync>)> {
        let url = pg::url()?;
        let schema = pg::unique_schema();
        let remove = pg::DropSchema {
            url: url.clone(),
            schema: schema.clone(),
        };
        // The store's schema, and the application's table in it.
        drop(Self::connect(&schema).expect("connect to the test server"));
        pg::client(&url)
            .batch_execute(&format!(
                "CREATE TABLE {schema}.orders (id bigserial PRIMARY KEY, key text NOT NULL)"
            ))
            .expect("the application's table");
        Some((schema, Box::new(remove)))
    }

    fn orders_for_here(&self, key: &str) -> Result<usize, Error> {
        let url = pg::url().ok_or("no test server")?;
        let n: i64 = pg::client(&url)
            .query_one(
                &format!(
                    "SELECT count(*) FROM {}.orders WHERE key = $1",
                    self.store().schema()
                ),
                &[&key],
            )?
            .try_get(0)?;
        Ok(usize::try_from(n)?)
    }
}

impl Backend for Pg {
    type Keys = PgIdempotencyKeys;

    fn new_address() -> Option<(String, Box<dyn Any + Send + Sync>)> {
        pg::off_runtime(Self::new_address_here)
    }

    fn open_at(schema: &str) -> Result<Self, Error> {
        let store = pg::off_runtime(|| Self::connect(schema))?;
        // The layer's handles end inside the test's runtime.
        Ok(Pg {
            store,
            _remove: None,
        })
    }

    fn open() -> Option<Self> {
        let (schema, remove) = Self::new_address()?;
        let store = Self::open_at(&schema)
            .expect("connect to the test server")
            .store;
        Some(Pg {
            store,
            _remove: Some(Arc::from(remove)),
        })
    }

    fn keys(&self) -> PgIdempotencyKeys {
        self.store().idempotency_keys()
    }

    fn rows(&self) -> Result<usize, Error> {
        pg::off_runtime(|| Ok(self.keys().list(None, 1000)?.len()))
    }

    fn stats(&self) -> IdempotencyStats {
        self.keys().stats()
    }

    fn get(
        &self,
        tenant: &str,
        key: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<ResponseRecord>, Error> {
        pg::off_runtime(|| Ok(self.keys().get(tenant, key, now)?))
    }

    fn place_order(&self, r: &Reservation, now: DateTime<Utc>) -> Result<ResponseRecord, Error> {
        let keys = self.keys();
        let schema = self.store().schema().to_owned();
        self.store().write(|tx| {
            let id: i64 = tx
                .query_one(
                    &format!("INSERT INTO {schema}.orders (key) VALUES ($1) RETURNING id"),
                    &[&r.key()],
                )?
                .try_get(0)?;
            let response = order_response(r, id, now);
            if keys.complete_in(tx, r, response.clone(), now)? {
                Ok(response)
            } else {
                Err("the key was taken over".into())
            }
        })
    }

    fn orders_for(&self, key: &str) -> Result<usize, Error> {
        pg::off_runtime(|| self.orders_for_here(key))
    }
}
