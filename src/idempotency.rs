//! [`IdempotencyKeys`]: the HTTP `Idempotency-Key` response store.

use std::sync::Arc;

use crate::engine::Engine;

/// The store's idempotency-key records. Cheap to clone.
#[derive(Clone, Debug)]
pub struct IdempotencyKeys {
    #[allow(dead_code)]
    engine: Arc<Engine>,
    #[allow(dead_code)]
    max_body: usize,
}

impl IdempotencyKeys {
    pub(crate) fn new(engine: Arc<Engine>, max_body: usize) -> IdempotencyKeys {
        IdempotencyKeys { engine, max_body }
    }
}
