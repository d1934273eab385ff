//! Rows to bytes and back: the only module that knows the wire format.
//!
//! Each module's stored form of a record is its `Row`. A stored row is one
//! version byte ([`RECORD_VERSION`]) followed by its
//! [postcard](https://docs.rs/postcard) encoding. postcard's format is
//! documented and stable across 1.x, which matters for a file that must stay
//! readable for years. Timestamps are `i64` microseconds since the Unix epoch,
//! never chrono's string form.

use std::fmt::Display;

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The version byte in front of every row this build writes.
pub(crate) const RECORD_VERSION: u8 = 1;

/// Encodes a row.
// postcard's serializer fails only when its output is full (an `Extend`
// sink never is), when a sequence does not tell its length (the derived
// `Serialize` of the `Vec`s and `String`s in a row always does), or when a
// value's own `Serialize` fails (rows derive theirs over plain data). So
// this `expect` cannot fire.
#[allow(
    clippy::expect_used,
    reason = "encoding a row into a Vec cannot fail; see the comment above"
)]
pub(crate) fn encode<T: Serialize>(row: &T) -> Vec<u8> {
    let out = vec![RECORD_VERSION];
    postcard::to_extend(row, out).expect("postcard encoding into a Vec cannot fail")
}

/// Decodes a row read from `table` at `key`; bad bytes are
/// [`Error::Corrupted`], never a panic.
pub(crate) fn decode<T: DeserializeOwned>(
    table: &'static str,
    key: &dyn Display,
    bytes: &[u8],
) -> Result<T> {
    decode_borrowed(table, key, bytes)
}

/// [`decode`] into a view that borrows its strings and byte strings from
/// `bytes` (a row read for a few of its fields, without copying the rest).
pub(crate) fn decode_borrowed<'a, T: Deserialize<'a>>(
    table: &'static str,
    key: &dyn Display,
    bytes: &'a [u8],
) -> Result<T> {
    let corrupted = corrupted(table, key);
    match postcard::take_from_bytes(body(table, key, bytes)?) {
        Ok((record, [])) => Ok(record),
        Ok((_, rest)) => Err(corrupted(format!("{} trailing bytes", rest.len()))),
        Err(e) => Err(corrupted(e.to_string())),
    }
}

/// What a row's bad bytes are, as the error that says so.
fn corrupted<'k>(table: &'static str, key: &'k dyn Display) -> impl Fn(String) -> Error + 'k {
    move |reason| Error::Corrupted {
        table,
        key: key.to_string(),
        reason,
    }
}

/// A stored row's postcard encoding, after its version byte (which must be
/// this build's).
fn body<'a>(table: &'static str, key: &dyn Display, bytes: &'a [u8]) -> Result<&'a [u8]> {
    let corrupted = corrupted(table, key);
    match bytes.split_first() {
        None => Err(corrupted("empty record".into())),
        Some((&RECORD_VERSION, body)) => Ok(body),
        Some((v, _)) => Err(corrupted(format!("unknown record version {v}"))),
    }
}

/// [`decode_borrowed`] of a row that later builds extended: the row's
/// first form `T`, then the fields appended since, `X`, which a row written
/// before they existed lacks (decoded as `X::default()`). A row's form is
/// only ever extended by appending, so bytes of either age decode.
pub(crate) fn decode_extended<'a, T: Deserialize<'a>, X: Deserialize<'a> + Default>(
    table: &'static str,
    key: &dyn Display,
    bytes: &'a [u8],
) -> Result<(T, X)> {
    let corrupted = corrupted(table, key);
    let (record, rest) = postcard::take_from_bytes(body(table, key, bytes)?)
        .map_err(|e| corrupted(e.to_string()))?;
    if rest.is_empty() {
        return Ok((record, X::default()));
    }
    match postcard::take_from_bytes(rest) {
        Ok((extension, [])) => Ok((record, extension)),
        Ok((_, rest)) => Err(corrupted(format!("{} trailing bytes", rest.len()))),
        Err(e) => Err(corrupted(e.to_string())),
    }
}

/// A timestamp as stored: microseconds since the Unix epoch.
pub(crate) fn micros(at: DateTime<Utc>) -> i64 {
    at.timestamp_micros()
}

/// A stored timestamp back as a `DateTime`; out-of-range values are
/// [`Error::Corrupted`].
pub(crate) fn from_micros(
    table: &'static str,
    key: &dyn Display,
    us: i64,
) -> Result<DateTime<Utc>> {
    DateTime::from_timestamp_micros(us).ok_or_else(|| Error::Corrupted {
        table,
        key: key.to_string(),
        reason: format!("timestamp {us} µs is out of range"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Rec {
        a: String,
        b: i64,
        c: Option<Vec<u8>>,
    }

    #[test]
    fn round_trip() -> Result<()> {
        let r = Rec {
            a: "x".into(),
            b: -5,
            c: Some(vec![1, 2]),
        };
        let bytes = encode(&r);
        assert_eq!(bytes[0], RECORD_VERSION);
        assert_eq!(decode::<Rec>("t", &"k", &bytes)?, r);
        Ok(())
    }

    #[test]
    fn bad_bytes_are_corrupted_not_panics() {
        let good = encode(&Rec {
            a: "hello".into(),
            b: 1,
            c: None,
        });
        let mut cases: Vec<Vec<u8>> = vec![vec![], vec![9], vec![RECORD_VERSION]];
        cases.push(good[..good.len() - 1].to_vec());
        let mut long = good.clone();
        long.push(0);
        cases.push(long);
        cases.push(vec![RECORD_VERSION, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        for bytes in cases {
            let e = decode::<Rec>("tbl", &"key-1", &bytes).unwrap_err();
            match e {
                Error::Corrupted { table, key, .. } => {
                    assert_eq!(table, "tbl");
                    assert_eq!(key, "key-1");
                }
                other => panic!("expected Corrupted for {bytes:?}, got {other:?}"),
            }
        }
    }

    #[test]
    fn timestamps_round_trip_and_reject_out_of_range() {
        let t = DateTime::from_timestamp_micros(1_700_000_000_123_456).unwrap();
        assert_eq!(from_micros("t", &1, micros(t)).unwrap(), t);
        assert!(matches!(
            from_micros("t", &1, i64::MAX),
            Err(Error::Corrupted { .. })
        ));
    }
}
