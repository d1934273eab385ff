//! The suite's [`Backend`] on the embedded store: a file in a temporary
//! directory, the orders in a redb table of the same file.

use std::any::Any;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use idemstore::redb::{ReadableTable as _, TableDefinition, TableError};
use idemstore::{IdempotencyKeys, IdempotencyStats, Reservation, ResponseRecord, Store};

use super::{Backend, Error, order_response};

/// The application's own table: order id → the idempotency key it was
/// placed under.
const ORDERS: TableDefinition<u64, &str> = TableDefinition::new("app.orders");

#[derive(Clone)]
pub(crate) struct Embedded {
    store: Store,
    /// The temporary directory, removed after the store closes (fields drop
    /// in order).
    _remove: Option<Arc<dyn Any + Send + Sync>>,
}

impl Backend for Embedded {
    type Keys = IdempotencyKeys;

    fn new_address() -> Option<(String, Box<dyn Any + Send + Sync>)> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("api.idem");
        Some((path.to_str()?.to_owned(), Box::new(dir)))
    }

    fn open_at(address: &str) -> Result<Self, Error> {
        Ok(Embedded {
            store: Store::open(address)?,
            _remove: None,
        })
    }

    fn open() -> Option<Self> {
        let (address, remove) = Self::new_address()?;
        let store = Self::open_at(&address).expect("open the store").store;
        Some(Embedded {
            store,
            _remove: Some(Arc::from(remove)),
        })
    }

    fn keys(&self) -> IdempotencyKeys {
        self.store.idempotency_keys()
    }

    fn rows(&self) -> Result<usize, Error> {
        Ok(self.keys().list(None, 1000)?.len())
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
        Ok(self.keys().get(tenant, key, now)?)
    }

    fn place_order(&self, r: &Reservation, now: DateTime<Utc>) -> Result<ResponseRecord, Error> {
        let keys = self.keys();
        self.store.write(|tx| {
            let mut orders = tx.open_table(ORDERS)?;
            let id = orders.last()?.map_or(1, |(k, _)| k.value() + 1);
            orders.insert(id, r.key())?;
            let response = order_response(r, i64::try_from(id)?, now);
            if keys.complete_in(tx, r, response.clone(), now)? {
                Ok(response)
            } else {
                Err("the key was taken over".into())
            }
        })
    }

    fn orders_for(&self, key: &str) -> Result<usize, Error> {
        self.store.read(|tx| match tx.open_table(ORDERS) {
            Ok(t) => {
                let mut n = 0;
                for row in t.iter()? {
                    if row?.1.value() == key {
                        n += 1;
                    }
                }
                Ok(n)
            }
            Err(TableError::TableDoesNotExist(_)) => Ok(0),
            Err(e) => Err(idemstore::Error::from(e).into()),
        })
    }
}
