//! [`Secret`], the Standard Webhooks signature ([`sign`]), and the one
//! HMAC-SHA256 constructor every scheme uses.

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, KeyInit as _, Mac as _};
use sha2::Sha256;

use crate::error::{Error, Result};

/// HMAC-SHA256, the MAC of all three schemes.
pub(super) type HmacSha256 = Hmac<Sha256>;

/// The prefix of a Standard Webhooks secret's text form.
const PREFIX: &str = "whsec_";

/// An HMAC-SHA256 state keyed with `key`, ready for the signed content.
#[allow(
    clippy::expect_used,
    reason = "HMAC takes keys of any length: `new_from_slice` cannot fail"
)]
pub(super) fn keyed(key: &[u8]) -> HmacSha256 {
    HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length")
}

/// An HMAC-SHA256 state keyed with `key` that has taken in the Standard
/// Webhooks signed content, `{id}.{timestamp}.{body}` (without building it
/// as one buffer).
pub(super) fn standard_mac(key: &[u8], id: &str, timestamp: &str, body: &[u8]) -> HmacSha256 {
    let mut mac = keyed(key);
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// A webhook signing key: the bytes HMAC-SHA256 is keyed with.
///
/// Made from the Standard Webhooks text form with [`Secret::parse`]
/// (`whsec_` and the key in standard base64, as Svix and the Standard
/// Webhooks libraries print it), or from raw bytes with
/// [`Secret::from_bytes`].
///
/// The key never shows: `Debug` prints `Secret(<redacted>)`, and there is
/// no `Display`. Equality compares the keys without stopping at the first
/// byte that differs.
///
/// ```
/// use idemstore::webhooks::Secret;
///
/// let secret = Secret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")?;
/// assert_eq!(format!("{secret:?}"), "Secret(<redacted>)");
/// assert!(Secret::parse("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").is_err()); // no prefix
/// # Ok::<_, idemstore::Error>(())
/// ```
#[derive(Clone)]
pub struct Secret {
    key: Vec<u8>,
}

impl Secret {
    /// Reads a secret in the Standard Webhooks text form: `whsec_` followed
    /// by the key in standard base64 (with its `=` padding, if any).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] (field `secret`) when the text does not
    /// start with `whsec_`, when the rest is not standard base64, or when
    /// the key it gives is empty. The message never repeats the text.
    pub fn parse(text: &str) -> Result<Secret> {
        let invalid = |reason: &str| Error::InvalidInput {
            field: "secret",
            reason: reason.to_owned(),
        };
        let encoded = text
            .strip_prefix(PREFIX)
            .ok_or_else(|| invalid("a webhook secret starts with `whsec_`"))?;
        let key = BASE64.decode(encoded).map_err(|_| {
            invalid(
                "the text after `whsec_` is not standard base64 (`A-Z a-z 0-9 + /`, `=` padding)",
            )
        })?;
        if key.is_empty() {
            return Err(invalid("the key after `whsec_` is empty"));
        }
        Ok(Secret { key })
    }

    /// A secret of the given key bytes, as they are (no prefix, no base64).
    ///
    /// An empty key is taken, and [`sign`] signs with it, but no
    /// [`Verifier`](super::Verifier) accepts a signature under an empty key:
    /// anyone could make one.
    pub fn from_bytes(key: Vec<u8>) -> Secret {
        Secret { key }
    }

    /// The key bytes.
    pub(super) fn key(&self) -> &[u8] {
        &self.key
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Secret) -> bool {
        // Every byte is looked at, whatever the first difference: how long
        // a comparison takes says nothing of where two keys differ.
        self.key.len() == other.key.len()
            && self
                .key
                .iter()
                .zip(&other.key)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl Eq for Secret {}

/// The Standard Webhooks `webhook-signature` header value for a message:
/// for each secret, `v1,` and the standard base64 of
/// HMAC-SHA256(key, `{id}.{timestamp}.{body}`), separated by spaces.
///
/// `id` is the message's `webhook-id` header and `timestamp` its
/// `webhook-timestamp` (seconds since the Unix epoch), exactly as sent;
/// `body` is the raw body, which need not be UTF-8. Several secrets sign
/// during a key rotation: a receiver that knows any one of them accepts
/// the message. No secrets gives an empty string.
///
/// ```
/// use idemstore::webhooks::{Secret, sign};
///
/// // The example of the Standard Webhooks specification.
/// let secret = Secret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")?;
/// let signature = sign(&[secret], "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, br#"{"test": 2432232314}"#);
/// assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
/// # Ok::<_, idemstore::Error>(())
/// ```
pub fn sign(secrets: &[Secret], id: &str, timestamp: i64, body: &[u8]) -> String {
    let timestamp = timestamp.to_string();
    let signatures: Vec<String> = secrets
        .iter()
        .map(|secret| {
            let mac = standard_mac(secret.key(), id, &timestamp, body).finalize();
            format!("v1,{}", BASE64.encode(mac.into_bytes()))
        })
        .collect();
    signatures.join(" ")
}
