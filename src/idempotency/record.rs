//! The idempotency rows as the embedded store keeps them: a [`Row`]
//! encoded by [`crate::codec`] (postcard) in the idempotency table under
//! `(tenant, key)`, and read back from any readable view of that table. The
//! rules over a row are in `rules.rs` and know nothing of this encoding.

use redb::{ReadableTable, TableHandle as _};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::rules::{Row, key_name};
use crate::codec::{decode, encode};
use crate::error::Result;
use crate::schema::IDEM;

/// A [`Row`] as stored. Variant and field order are the wire format:
/// append only.
#[derive(Serialize, Deserialize)]
#[serde(remote = "Row")]
enum Stored {
    Reserved {
        fingerprint: String,
        fence: u64,
        reserved_at: i64,
        lease_until: i64,
    },
    Completed {
        fingerprint: String,
        fence: u64,
        created_at: i64,
        status: u16,
        content_type: Option<String>,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    },
}

/// A [`Row`] to encode.
struct Out<'a>(&'a Row);

impl Serialize for Out<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Stored::serialize(self.0, s)
    }
}

/// A [`Row`] decoded.
struct In(Row);

impl<'de> Deserialize<'de> for In {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<In, D::Error> {
        Stored::deserialize(d).map(In)
    }
}

/// The stored bytes of `row`.
pub(crate) fn encode_row(row: &Row) -> Vec<u8> {
    encode(&Out(row))
}

/// Decodes the stored row at `(tenant, key)`.
pub(crate) fn decode_row(tenant: &str, key: &str, bytes: &[u8]) -> Result<Row> {
    decode(IDEM.name(), &key_name(tenant, key), bytes).map(|In(row)| row)
}

/// Reads the row at `(tenant, key)` from any readable idempotency table.
pub(crate) fn read_row<T>(table: &T, tenant: &str, key: &str) -> Result<Option<Row>>
where
    T: ReadableTable<(&'static str, &'static str), &'static [u8]>,
{
    match table.get((tenant, key))? {
        Some(v) => decode_row(tenant, key, v.value()).map(Some),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::rules::RECORDS;

    #[test]
    fn errors_name_the_table_the_rows_are_in() {
        assert_eq!(RECORDS, IDEM.name());
    }
}
