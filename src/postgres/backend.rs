//! The PostgreSQL handles behind the dispatcher's, the janitor's and the
//! HTTP layer's traits ([`OutboxBackend`](crate::OutboxBackend),
//! [`InboxBackend`](crate::InboxBackend),
//! [`IdempotencyBackend`](crate::IdempotencyBackend)): each call is the
//! handle's own method. [`OutboxAdmin`](crate::OutboxAdmin) and
//! [`StoreAdmin`](crate::StoreAdmin), the operator's, are forwarded the
//! same way.

use super::{PgIdempotencyKeys, PgInbox, PgOutbox};

crate::backend::forward_to_handles!(outbox: PgOutbox, inbox: PgInbox, keys: PgIdempotencyKeys);
crate::backend::forward_admin!(PgOutbox);
crate::backend::forward_store_admin!(super::PgStore);
