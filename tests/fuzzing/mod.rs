//! Test code shared by the fuzz targets (`fuzz/fuzz_targets/*.rs`) and by
//! `tests/fuzz_corpus.rs`, which replays the committed seed corpus and
//! pseudo-random inputs under `cargo test` on stable.
//!
//! - [`run_model`] decodes an `Arbitrary` sequence of operations on all three
//!   primitives (and reopens of the file) and checks the store against a
//!   plain in-memory model: every answer, and the whole store every few
//!   operations.
//! - [`outbox_model`] is the outbox part of that model, which
//!   `tests/outbox_model.rs` also drives with seeded random operations.
//! - [`run_codec`] overwrites stored records with arbitrary or mutated bytes
//!   and calls every reader and writer: no panic, and every error is
//!   [`idemstore::Error::Corrupted`] (or an expected outcome such as
//!   `NotFound`).

mod codec;
mod memory_file;
mod model;
pub(crate) mod outbox_model;

pub(crate) use codec::run_codec;
pub(crate) use memory_file::MemoryFile;
pub(crate) use model::{ModelStats, run_model};

use chrono::{DateTime, TimeZone, Utc};

/// A fixed instant plus `secs` seconds.
pub(crate) fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

/// xorshift64*: deterministic pseudo-random bytes, no dependencies.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// `len` pseudo-random bytes.
    pub(crate) fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        out.truncate(len);
        out
    }
}
