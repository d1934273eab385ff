//! Parsing the `Idempotency-Key` header value.

use std::fmt;

use crate::MAX_IDEMPOTENCY_KEY_LEN;

/// Why an `Idempotency-Key` value was refused (HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyError {
    /// The value, or the quoted string, is empty.
    Empty,
    /// The key is longer than [`MAX_IDEMPOTENCY_KEY_LEN`] characters.
    TooLong(usize),
    /// The value is neither a bare key nor an RFC 8941 string.
    Malformed(&'static str),
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Empty => f.write_str("the key is empty"),
            KeyError::TooLong(n) => write!(
                f,
                "the key is {n} characters long; at most {MAX_IDEMPOTENCY_KEY_LEN} are accepted"
            ),
            KeyError::Malformed(why) => f.write_str(why),
        }
    }
}

/// The key in one `Idempotency-Key` header value.
///
/// Accepts an RFC 8941 sf-string (`"abc"`, with `\"` and `\\` escapes and
/// nothing after the closing quote) or a bare key: a run of visible ASCII
/// without spaces, double quotes, commas or semicolons (a UUID, a ULID, a
/// base64url token). Spaces and tabs around the value are ignored. The key
/// (after unescaping) must be 1–255 characters.
pub(crate) fn parse_key(value: &[u8]) -> Result<String, KeyError> {
    let value = value.trim_ascii();
    let key = match value.split_first() {
        None => return Err(KeyError::Empty),
        Some((b'"', rest)) => sf_string(rest)?,
        Some(_) => bare(value)?,
    };
    match key.len() {
        0 => Err(KeyError::Empty),
        n if n > MAX_IDEMPOTENCY_KEY_LEN => Err(KeyError::TooLong(n)),
        _ => Ok(key),
    }
}

/// The body of an sf-string after its opening quote.
fn sf_string(rest: &[u8]) -> Result<String, KeyError> {
    let mut out = String::with_capacity(rest.len());
    let mut bytes = rest.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(char::from(e)),
                Some(_) => {
                    return Err(KeyError::Malformed(
                        "a quoted key may only escape `\"` and `\\`",
                    ));
                }
                None => return Err(KeyError::Malformed("the quoted key is not closed")),
            },
            b'"' => {
                return if bytes.as_slice().is_empty() {
                    Ok(out)
                } else {
                    Err(KeyError::Malformed(
                        "nothing may follow the closing quote of a quoted key",
                    ))
                };
            }
            0x20..=0x7e => out.push(char::from(b)),
            _ => {
                return Err(KeyError::Malformed(
                    "a quoted key may hold only visible ASCII and spaces",
                ));
            }
        }
    }
    Err(KeyError::Malformed("the quoted key is not closed"))
}

/// A bare key: visible ASCII without `"`, `,` or `;` (spaces are not visible).
fn bare(value: &[u8]) -> Result<String, KeyError> {
    if value.len() > MAX_IDEMPOTENCY_KEY_LEN {
        return Err(KeyError::TooLong(value.len()));
    }
    if let Some(&b) = value
        .iter()
        .find(|&&b| !(0x21..=0x7e).contains(&b) || matches!(b, b'"' | b',' | b';'))
    {
        return Err(KeyError::Malformed(match b {
            b',' => "a key may not contain a comma (send one key per request)",
            b';' => "a bare key may not contain a semicolon",
            b'"' => "a bare key may not contain a double quote",
            _ => "a bare key may hold only visible ASCII, without spaces",
        }));
    }
    // Visible ASCII only, so this is valid UTF-8.
    Ok(value.iter().map(|&b| char::from(b)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_keys() {
        for k in [
            "abc",
            "123e4567-e89b-12d3-a456-426614174000",
            "01ARZ3NDEKTSV4RRFFQ69G5FAV",
            "a_b-c.d~e+f/g=h",
            "back\\slash",
            "x",
        ] {
            assert_eq!(parse_key(k.as_bytes()), Ok(k.to_owned()), "{k}");
        }
        assert_eq!(parse_key(b"  padded\t"), Ok("padded".to_owned()));
    }

    #[test]
    fn quoted_keys() {
        assert_eq!(parse_key(br#""abc""#), Ok("abc".to_owned()));
        assert_eq!(parse_key(br#""a b""#), Ok("a b".to_owned()));
        assert_eq!(parse_key(br#""a,b;c""#), Ok("a,b;c".to_owned()));
        assert_eq!(parse_key(br#""q\"q""#), Ok("q\"q".to_owned()));
        assert_eq!(parse_key(br#""b\\s""#), Ok("b\\s".to_owned()));
    }

    #[test]
    fn empty_keys() {
        assert_eq!(parse_key(b""), Err(KeyError::Empty));
        assert_eq!(parse_key(b"   "), Err(KeyError::Empty));
        assert_eq!(parse_key(br#""""#), Err(KeyError::Empty));
    }

    #[test]
    fn length_limit() {
        let max = "k".repeat(255);
        assert_eq!(parse_key(max.as_bytes()), Ok(max.clone()));
        assert_eq!(parse_key(format!("\"{max}\"").as_bytes()), Ok(max.clone()));
        let over = "k".repeat(256);
        assert_eq!(parse_key(over.as_bytes()), Err(KeyError::TooLong(256)));
        assert_eq!(
            parse_key(format!("\"{over}\"").as_bytes()),
            Err(KeyError::TooLong(256))
        );
        // Escapes count once: 255 escaped quotes are 255 characters.
        let escaped = format!("\"{}\"", "\\\"".repeat(255));
        assert_eq!(parse_key(escaped.as_bytes()), Ok("\"".repeat(255)));
    }

    #[test]
    fn malformed_keys() {
        for v in [
            &b"a,b"[..],
            b"a;b",
            b"a b",
            b"a\"b",
            b"caf\xc3\xa9",
            b"tab\tin",
            br#""open"#,
            br#""bad\escape""#,
            br#""trailing\"#,
            br#""a";p=1"#,
            br#""a" "b""#,
            b"\"ctl\x01\"",
            b"\"caf\xc3\xa9\"",
        ] {
            assert!(
                matches!(parse_key(v), Err(KeyError::Malformed(_))),
                "{:?} -> {:?}",
                String::from_utf8_lossy(v),
                parse_key(v)
            );
        }
    }
}
