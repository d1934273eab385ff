//! [`Outbox`]: external side effects awaiting dispatch.

use std::sync::Arc;

use crate::engine::Engine;

/// The store's outbox. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Outbox {
    #[allow(dead_code)]
    engine: Arc<Engine>,
    #[allow(dead_code)]
    max_payload: usize,
}

impl Outbox {
    pub(crate) fn new(engine: Arc<Engine>, max_payload: usize) -> Outbox {
        Outbox {
            engine,
            max_payload,
        }
    }
}
