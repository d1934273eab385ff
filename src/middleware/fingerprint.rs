//! What makes two requests with one key "the same request": the layer's
//! default fingerprint (method, path-and-query, exact body bytes), and a
//! canonical form of JSON bodies for applications whose clients may send the
//! same document with other whitespace or key order.

use http::request::Parts;
use serde_json::Value;

use super::BoxError;
use crate::fingerprint;

/// An application's fingerprint of a request: see
/// [`IdempotencyLayer::fingerprint_with`](super::IdempotencyLayer::fingerprint_with).
pub(crate) type FingerprintFn = dyn Fn(&Parts, &[u8]) -> Result<String, BoxError> + Send + Sync;

/// The layer's default: [`fingerprint`] of the method, the path and query,
/// and the body's exact bytes.
pub(crate) fn exact(parts: &Parts, body: &[u8]) -> String {
    fingerprint(parts.method.as_str(), path_and_query(parts), body)
}

fn path_and_query(parts: &Parts) -> &str {
    parts.uri.path_and_query().map_or("/", |p| p.as_str())
}

/// `body`, a JSON document, in a canonical form: no whitespace, the members
/// of every object sorted by name (byte order), strings written with
/// `serde_json`'s escapes. Two documents that differ only in whitespace, in
/// member order or in how a string escapes its characters (`"\u00e9"` and
/// `"é"`) have one canonical form. Numbers are kept as `serde_json` reads
/// them, so `1`, `1.0` and `1e0` stay three values; an object naming one
/// member twice keeps the last.
///
/// # Errors
///
/// `body` is not one JSON document (the error says where).
pub fn canonical_json(body: &[u8]) -> Result<Vec<u8>, serde_json::Error> {
    let value: Value = serde_json::from_slice(body)?;
    let mut out = Vec::with_capacity(body.len());
    write_canonical(&mut out, &value)?;
    Ok(out)
}

fn write_canonical(out: &mut Vec<u8>, value: &Value) -> Result<(), serde_json::Error> {
    match value {
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(out, item)?;
            }
            out.push(b']');
        }
        Value::Object(members) => {
            // Sorted here, whatever order the map keeps (serde_json's
            // `preserve_order` feature, enabled by any crate in a build,
            // makes it insertion order).
            let mut sorted: Vec<(&String, &Value)> = members.iter().collect();
            sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (name, member)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, name)?;
                out.push(b':');
                write_canonical(out, member)?;
            }
            out.push(b'}');
        }
        scalar => serde_json::to_writer(&mut *out, scalar)?,
    }
    Ok(())
}

/// A fingerprint for [`IdempotencyLayer::fingerprint_with`](super::IdempotencyLayer::fingerprint_with)
/// that compares JSON bodies as documents: [`fingerprint`] of the method,
/// the path and query, and the body's [`canonical_json`] form. An empty
/// body counts as no document (it fingerprints as empty); any other body
/// that is not JSON is refused, and the layer answers 400.
///
/// ```
/// use idemstore::middleware::{IdempotencyLayer, json_fingerprint};
/// # let store = idemstore::Store::builder().in_memory().unwrap();
/// let layer = IdempotencyLayer::new(store.idempotency_keys()).fingerprint_with(json_fingerprint);
/// ```
///
/// # Errors
///
/// The body is not empty and not one JSON document.
pub fn json_fingerprint(parts: &Parts, body: &[u8]) -> Result<String, BoxError> {
    let canonical = if body.is_empty() {
        Vec::new()
    } else {
        canonical_json(body).map_err(|e| format!("the request body is not JSON: {e}"))?
    };
    Ok(fingerprint(
        parts.method.as_str(),
        path_and_query(parts),
        &canonical,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> String {
        String::from_utf8(canonical_json(s.as_bytes()).unwrap()).unwrap()
    }

    #[test]
    fn whitespace_member_order_and_escapes_do_not_matter() {
        let a = canon(r#"{"b": [1, {"y": true, "x": null}], "a": "\u00e9"}"#);
        let b = canon("{\"a\":\"é\",\n  \"b\":[1,{\"x\":null,\"y\":true}]}");
        assert_eq!(a, b);
        assert_eq!(a, r#"{"a":"é","b":[1,{"x":null,"y":true}]}"#);
    }

    #[test]
    fn values_still_matter() {
        assert_ne!(canon(r#"{"a":1}"#), canon(r#"{"a":2}"#));
        assert_ne!(canon(r#"{"a":1}"#), canon(r#"{"a":1.0}"#));
        assert_ne!(canon("[1,2]"), canon("[2,1]"));
        assert_eq!(canon(r#"{"a":1,"a":2}"#), r#"{"a":2}"#);
    }

    #[test]
    fn a_body_that_is_not_json_is_an_error() {
        assert!(canonical_json(b"{\"a\":").is_err());
        assert!(canonical_json(b"{} {}").is_err());
        let (parts, ()) = http::Request::post("/x").body(()).unwrap().into_parts();
        let err = json_fingerprint(&parts, b"not json").unwrap_err();
        assert!(err.to_string().contains("not JSON"), "{err}");
        assert_eq!(
            json_fingerprint(&parts, b"").unwrap(),
            fingerprint("POST", "/x", b"")
        );
    }
}
