//! `export STORE --jsonl`, and the pagers that walk a whole store, a file
//! or a PostgreSQL server's schema, a page at a time.

use std::io::BufWriter;

use chrono::{DateTime, Utc};
use idemstore::{KeyEntry, KeyState, OutboxFilter, OutboxRecord, ResponseRecord};
use serde_json::json;

use crate::handle::{InboxHandle, KeysHandle, OutboxHandle, StoreHandle};
use crate::output::{bar, key_json, outbox_json, put, ts, write_record};
use crate::{Failure, Outcome};

/// Rows read per read transaction when walking a whole table.
pub(crate) const PAGE: usize = 1000;

/// Every record as one JSON object per line on stdout: inbox keys, outbox
/// entries (payload in base64), idempotency rows (body in base64). Stops
/// early, with success, when stdout's reader goes away (see
/// [`output::line`](crate::output::line)).
pub(crate) fn export(store: &StoreHandle) -> Result<Outcome, Failure> {
    let holds = Holdings::read(store)?;
    let pb = bar(holds.total(), "exporting");
    let mut out = BufWriter::new(std::io::stdout().lock());
    for name in &holds.inbox_names {
        let inbox = store.inbox(name)?;
        for page in inbox_pages(&inbox, PAGE) {
            let page = page?;
            for (key, seen_at) in &page {
                let v =
                    json!({"kind": "inbox", "inbox": name, "key": key, "seen_at": ts(*seen_at)});
                if !write_record(&mut out, Some(&v))? {
                    return Ok(Outcome::Ok);
                }
            }
            pb.inc(page.len() as u64);
        }
    }
    for page in outbox_pages(&store.outbox(), PAGE) {
        let page = page?;
        for r in &page {
            let mut v = outbox_json(r, true);
            put(&mut v, "kind", json!("outbox"));
            if !write_record(&mut out, Some(&v))? {
                return Ok(Outcome::Ok);
            }
        }
        pb.inc(page.len() as u64);
    }
    for page in key_pages(&store.keys(), PAGE) {
        let page = page?;
        for (k, response) in &page {
            let mut v = key_json(k, response.as_ref());
            put(&mut v, "kind", json!("key"));
            if !write_record(&mut out, Some(&v))? {
                return Ok(Outcome::Ok);
            }
        }
        pb.inc(page.len() as u64);
    }
    write_record(&mut out, None)?;
    pb.finish_and_clear();
    Ok(Outcome::Ok)
}

/// What a store holds, by kind of row: the size of an export, for its
/// progress bar.
struct Holdings {
    /// The inboxes' names.
    inbox_names: Vec<String>,
    /// Keys, across every inbox.
    inbox_keys: u64,
    /// Outbox records.
    outbox: u64,
    /// Idempotency records, completed and reserved.
    keys: u64,
}

impl Holdings {
    fn read(store: &StoreHandle) -> Result<Holdings, Failure> {
        let inbox_names = store.inbox_names()?;
        let mut inbox_keys = 0;
        for name in &inbox_names {
            inbox_keys += store.inbox(name)?.len()?;
        }
        let keys = store.keys().summary()?;
        Ok(Holdings {
            inbox_names,
            inbox_keys,
            outbox: store.outbox().counts()?.total(),
            keys: keys.completed + keys.reserved,
        })
    }

    fn total(&self) -> u64 {
        self.inbox_keys + self.outbox + self.keys
    }
}

/// The pages `read` returns, each given the previous page's last row,
/// until one is empty or a read fails: a whole table, one read transaction
/// per page.
fn pages<T: Clone>(
    mut read: impl FnMut(Option<&T>) -> idemstore::Result<Vec<T>>,
) -> impl Iterator<Item = Result<Vec<T>, Failure>> {
    let mut last: Option<T> = None;
    let mut done = false;
    std::iter::from_fn(move || {
        if done {
            return None;
        }
        match read(last.as_ref()) {
            Ok(page) => {
                last = page.last().cloned();
                done = last.is_none();
                (!done).then_some(Ok(page))
            }
            Err(e) => {
                done = true;
                Some(Err(e.into()))
            }
        }
    })
}

/// An inbox's keys with their claim times, oldest first, `batch` a page.
fn inbox_pages(
    inbox: &InboxHandle,
    batch: usize,
) -> impl Iterator<Item = Result<Vec<(String, DateTime<Utc>)>, Failure>> + '_ {
    pages(move |last: Option<&(String, DateTime<Utc>)>| {
        inbox.list(last.map(|(k, at)| (*at, k.as_str())), batch)
    })
}

/// Every outbox record by id, `batch` a page.
fn outbox_pages(
    outbox: &OutboxHandle,
    batch: usize,
) -> impl Iterator<Item = Result<Vec<OutboxRecord>, Failure>> + '_ {
    pages(move |last: Option<&OutboxRecord>| {
        let filter = match last {
            Some(r) => OutboxFilter::any().after(r.entry.id),
            None => OutboxFilter::any(),
        };
        outbox.list(&filter, batch)
    })
}

/// Every idempotency record in `(tenant, key)` order, each completed one
/// with its stored response, `batch` a page.
fn key_pages(
    keys: &KeysHandle,
    batch: usize,
) -> impl Iterator<Item = Result<Vec<(KeyEntry, Option<ResponseRecord>)>, Failure>> + '_ {
    pages(move |last: Option<&(KeyEntry, Option<ResponseRecord>)>| {
        let page = keys.list_after(
            last.map(|(k, _)| (k.tenant.as_str(), k.key.as_str())),
            batch,
        )?;
        page.into_iter()
            .map(|k| {
                let response = match k.state {
                    KeyState::Completed { .. } => keys.response(&k.tenant, &k.key)?,
                    KeyState::Reserved { .. } => None,
                };
                Ok((k, response))
            })
            .collect()
    })
}
