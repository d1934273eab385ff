//! The embedded handles behind the dispatcher's, the janitor's and the
//! HTTP layer's traits ([`OutboxBackend`](crate::OutboxBackend),
//! [`InboxBackend`](crate::InboxBackend),
//! [`IdempotencyBackend`](crate::IdempotencyBackend)): each call is the
//! handle's own method. [`OutboxAdmin`](crate::OutboxAdmin) and
//! [`StoreAdmin`](crate::StoreAdmin), the operator's, are forwarded the
//! same way.

use crate::idempotency::IdempotencyKeys;
use crate::inbox::Inbox;
use crate::outbox::Outbox;

crate::backend::forward_to_handles!(outbox: Outbox, inbox: Inbox, keys: IdempotencyKeys);
crate::backend::forward_admin!(Outbox);
crate::backend::forward_store_admin!(super::Store);
