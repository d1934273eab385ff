//! The inbox's reads and its prune for async tasks (feature `tokio`): each
//! is the blocking call of the same name without `_async`, with the same
//! checks, answers and errors; a read runs on the task and waits for
//! durability without holding a thread, and a prune's chunks join the
//! group commit like a thread's. (The claims' async forms sit beside their
//! blocking forms.)

use chrono::{DateTime, Utc};

use super::inspect::list_in;
use super::rules::check_event_key;
use super::{Inbox, len_in, seen_time};
use crate::codec::micros;
use crate::error::Result;

impl Inbox {
    /// [`Inbox::seen`], awaited.
    pub async fn seen_async(&self, event_key: &str) -> Result<bool> {
        Ok(self.seen_at_async(event_key).await?.is_some())
    }

    /// [`Inbox::seen_at`], awaited.
    pub async fn seen_at_async(&self, event_key: &str) -> Result<Option<DateTime<Utc>>> {
        check_event_key(event_key)?;
        let (at, seq) = self.lookup(event_key)?;
        self.engine.wait_durable_async(seq).await?;
        seen_time(event_key, at)
    }

    /// [`Inbox::prune`], awaited. Dropped after its first poll, the chunks
    /// committed before stay pruned and the chunk under way may still
    /// commit; no chunk is queued after it.
    pub async fn prune_async(&self, seen_before: DateTime<Utc>) -> Result<u64> {
        let cutoff = micros(seen_before);
        let mut total = 0;
        let mut merge = true;
        loop {
            let (n, more) = self
                .engine
                .execute_async(self.prune_op(cutoff, merge))
                .await?;
            total += n;
            merge = false;
            if !more {
                return Ok(total);
            }
        }
    }

    /// [`Inbox::len`], awaited.
    pub async fn len_async(&self) -> Result<u64> {
        self.engine.read_async(|tx| len_in(tx, &self.name)).await
    }

    /// [`Inbox::is_empty`], awaited.
    pub async fn is_empty_async(&self) -> Result<bool> {
        Ok(self.len_async().await? == 0)
    }

    /// [`Inbox::list`], awaited.
    pub async fn list_async(
        &self,
        after: Option<(DateTime<Utc>, &str)>,
        limit: usize,
    ) -> Result<Vec<(String, DateTime<Utc>)>> {
        self.engine
            .read_async(|tx| list_in(tx, &self.name, after, limit))
            .await
    }
}
