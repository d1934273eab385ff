//! [`Verifier`] and [`Verified`]: the three schemes' checks, on the raw
//! body and the headers, against a `now` the caller passes.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use chrono::{DateTime, Utc};
use hmac::Mac as _;
use http::HeaderMap;

use super::secret::{HmacSha256, Secret, keyed, standard_mac};
use super::verify_error::VerifyError;

/// The tolerance of a new [`Verifier`]: 5 minutes, the Standard Webhooks
/// libraries' and Stripe's.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(5 * 60);

const WEBHOOK_ID: &str = "webhook-id";
const WEBHOOK_TIMESTAMP: &str = "webhook-timestamp";
const WEBHOOK_SIGNATURE: &str = "webhook-signature";
const STRIPE_SIGNATURE: &str = "stripe-signature";
const GITHUB_SIGNATURE: &str = "x-hub-signature-256";
const GITHUB_DELIVERY: &str = "x-github-delivery";

/// Checks that a webhook delivery is authentic and current before anything
/// reads it: one of [Standard Webhooks](Verifier::standard),
/// [Stripe](Verifier::stripe) or [GitHub](Verifier::github), with the
/// secret(s) of the endpoint. See [the module docs](super) for what each
/// scheme checks.
///
/// A verifier is a value: build it once at start-up, share it (it is
/// `Clone + Send + Sync`), call [`verify`](Verifier::verify) on each
/// request. `Debug` shows the scheme and tolerance, never a secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verifier {
    scheme: Scheme,
    tolerance: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Scheme {
    Standard(Vec<Secret>),
    Stripe(Secret),
    GitHub(Secret),
}

impl Verifier {
    /// Standard Webhooks (Svix and the services on its specification): the
    /// `webhook-id`, `webhook-timestamp` and `webhook-signature` headers.
    ///
    /// A delivery is accepted when one of the header's `v1` signatures
    /// matches under one of `secrets`: give the old and the new secret
    /// while a key rotation is under way. A secret with an empty key, and
    /// an empty list, accept nothing. Default tolerance: 5 minutes
    /// ([`DEFAULT_TOLERANCE`]).
    pub fn standard(secrets: Vec<Secret>) -> Verifier {
        Verifier {
            scheme: Scheme::Standard(secrets),
            tolerance: DEFAULT_TOLERANCE,
        }
    }

    /// Stripe: the `Stripe-Signature` header (`t=<timestamp>,v1=<hex>,…`),
    /// and the event id from the body.
    ///
    /// `endpoint_secret` is the endpoint's signing secret as the Stripe
    /// dashboard or CLI shows it, `whsec_…`: Stripe keys the HMAC with that
    /// whole text, prefix included, not with a decoded key (so this takes
    /// a `&str`, not a [`Secret`]). An empty secret accepts nothing.
    /// Default tolerance: 300 s ([`DEFAULT_TOLERANCE`]).
    pub fn stripe(endpoint_secret: &str) -> Verifier {
        Verifier {
            scheme: Scheme::Stripe(Secret::from_bytes(endpoint_secret.as_bytes().to_vec())),
            tolerance: DEFAULT_TOLERANCE,
        }
    }

    /// GitHub: the `X-Hub-Signature-256` header (`sha256=<hex>` of the
    /// body), and the delivery id from `X-GitHub-Delivery`.
    ///
    /// `secret` is the webhook's secret as entered in GitHub's settings,
    /// used as its UTF-8 bytes. An empty secret accepts nothing. GitHub
    /// signs no timestamp: the tolerance does not apply.
    pub fn github(secret: &str) -> Verifier {
        Verifier {
            scheme: Scheme::GitHub(Secret::from_bytes(secret.as_bytes().to_vec())),
            tolerance: DEFAULT_TOLERANCE,
        }
    }

    /// How far the signed timestamp may be from `now`, before or after,
    /// counted in whole seconds (a fraction of a second is dropped).
    /// Default: 5 minutes ([`DEFAULT_TOLERANCE`]). Ignored by
    /// [`Verifier::github`], whose deliveries carry no timestamp.
    #[must_use]
    pub fn tolerance(mut self, tolerance: Duration) -> Verifier {
        self.tolerance = tolerance;
        self
    }

    /// Checks a delivery: its headers, and its body as the raw bytes that
    /// arrived, never parsed and written out again (a JSON body re-encoded
    /// no longer matches its signature). `now` is the time to hold the
    /// signed timestamp against; the verifier reads no clock.
    ///
    /// Header names are matched without regard to case. Nothing panics,
    /// whatever the input.
    ///
    /// # Errors
    ///
    /// A [`VerifyError`] that says which check failed, and
    /// [its HTTP status](VerifyError::status). The checks run in this
    /// order: the required headers are there and readable (400), a
    /// signature matches (401), the timestamp is within the tolerance
    /// (401), and for Stripe, the body has an event id (400).
    pub fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now: DateTime<Utc>,
    ) -> Result<Verified, VerifyError> {
        match &self.scheme {
            Scheme::Standard(secrets) => {
                verify_standard(secrets, self.tolerance, headers, body, now)
            }
            Scheme::Stripe(secret) => verify_stripe(secret, self.tolerance, headers, body, now),
            Scheme::GitHub(secret) => verify_github(secret, headers, body),
        }
    }
}

/// A delivery that passed [`Verifier::verify`]: its id, to deduplicate by,
/// and its signed timestamp where the scheme has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    id: String,
    timestamp: Option<DateTime<Utc>>,
}

impl Verified {
    /// The delivery's id: the `webhook-id` header (Standard Webhooks), the
    /// event's `"id"` from the body (Stripe), or the `X-GitHub-Delivery`
    /// header (GitHub). A redelivery of the same message or event has the
    /// same id.
    ///
    /// For Standard Webhooks and Stripe the id is covered by the signature.
    /// GitHub signs the body only: its delivery id is not authenticated.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The signed timestamp (Standard Webhooks, Stripe), within the
    /// tolerance of the `now` the delivery was verified against; `None` for
    /// GitHub, which signs none.
    pub fn timestamp(&self) -> Option<DateTime<Utc>> {
        self.timestamp
    }
}

fn malformed(name: &'static str, reason: &str) -> VerifyError {
    VerifyError::MalformedHeader {
        name,
        reason: reason.to_owned(),
    }
}

/// The one value of a header, as text.
fn header<'h>(headers: &'h HeaderMap, name: &'static str) -> Result<&'h str, VerifyError> {
    let mut values = headers.get_all(name).iter();
    let value = values.next().ok_or(VerifyError::MissingHeader { name })?;
    if values.next().is_some() {
        return Err(malformed(name, "sent more than once"));
    }
    let text = value
        .to_str()
        .map_err(|_| malformed(name, "not visible ASCII text"))?;
    if text.is_empty() {
        return Err(malformed(name, "empty"));
    }
    Ok(text)
}

/// A timestamp header's seconds since the Unix epoch.
fn parse_seconds(name: &'static str, text: &str) -> Result<i64, VerifyError> {
    text.parse()
        .map_err(|_| malformed(name, "not a whole number of seconds since the Unix epoch"))
}

/// `timestamp` if it is within `tolerance` of `now`, before or after.
fn check_timestamp(
    timestamp: i64,
    tolerance: Duration,
    now: DateTime<Utc>,
) -> Result<DateTime<Utc>, VerifyError> {
    // In i128, no difference of two i64s nor any u64 overflows.
    let now_secs = i128::from(now.timestamp());
    let at = i128::from(timestamp);
    let allowed = i128::from(tolerance.as_secs());
    let too_old = VerifyError::TimestampTooOld {
        timestamp,
        tolerance,
    };
    let too_new = VerifyError::TimestampTooNew {
        timestamp,
        tolerance,
    };
    if now_secs - at > allowed {
        return Err(too_old);
    }
    if at - now_secs > allowed {
        return Err(too_new);
    }
    // Within a huge tolerance, a time beyond chrono's range of dates.
    DateTime::from_timestamp(timestamp, 0).ok_or(if at < now_secs { too_old } else { too_new })
}

/// Whether `mac` (keyed, content taken in) matches any of `signatures`.
/// Each comparison takes the same time wherever the bytes differ
/// (`verify_slice`), so timing tells nothing of the expected MAC; stopping
/// at the first match tells only which of its own signatures the sender
/// got right.
fn matches_any<'s>(mac: &HmacSha256, signatures: impl IntoIterator<Item = &'s [u8]>) -> bool {
    signatures
        .into_iter()
        .any(|signature| mac.clone().verify_slice(signature).is_ok())
}

/// A 32-byte MAC written as 64 hex digits (either case); `None` for
/// anything else. Hex is decoded here in a dozen lines rather than by a
/// crate: the dependency tree has no hex crate, and a MAC is all there is
/// to decode.
fn mac_from_hex(text: &str) -> Option<[u8; 32]> {
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    if text.len() != 64 {
        return None;
    }
    let mut mac = [0u8; 32];
    for (byte, pair) in mac.iter_mut().zip(text.as_bytes().chunks_exact(2)) {
        let [high, low] = *pair else { return None };
        *byte = (digit(high)? << 4) | digit(low)?;
    }
    Some(mac)
}

fn verify_standard(
    secrets: &[Secret],
    tolerance: Duration,
    headers: &HeaderMap,
    body: &[u8],
    now: DateTime<Utc>,
) -> Result<Verified, VerifyError> {
    let id = header(headers, WEBHOOK_ID)?;
    let timestamp_text = header(headers, WEBHOOK_TIMESTAMP)?;
    let signature_header = header(headers, WEBHOOK_SIGNATURE)?;
    let timestamp = parse_seconds(WEBHOOK_TIMESTAMP, timestamp_text)?;

    // `v1,<base64>` entries, space-separated; other versions (`v1a,…`) and
    // entries that do not decode match nothing.
    let signatures: Vec<Vec<u8>> = signature_header
        .split(' ')
        .filter_map(|entry| entry.split_once(','))
        .filter(|(version, _)| *version == "v1")
        .filter_map(|(_, signature)| BASE64.decode(signature).ok())
        .collect();
    // The content is signed as the header carries the timestamp.
    let matched = secrets
        .iter()
        .filter(|secret| !secret.key().is_empty())
        .any(|secret| {
            let mac = standard_mac(secret.key(), id, timestamp_text, body);
            matches_any(&mac, signatures.iter().map(Vec::as_slice))
        });
    if !matched {
        return Err(VerifyError::BadSignature);
    }
    let timestamp = check_timestamp(timestamp, tolerance, now)?;
    Ok(Verified {
        id: id.to_owned(),
        timestamp: Some(timestamp),
    })
}

fn verify_stripe(
    secret: &Secret,
    tolerance: Duration,
    headers: &HeaderMap,
    body: &[u8],
    now: DateTime<Utc>,
) -> Result<Verified, VerifyError> {
    let header_text = header(headers, STRIPE_SIGNATURE)?;
    // `t=<seconds>,v1=<hex>,v1=<hex>,v0=<hex>`: one `t`, any number of
    // `v1`; other schemes (`v0`, test-mode extras) are not checked, as
    // Stripe's own libraries do not check them.
    let mut timestamp_text = None;
    let mut signatures = Vec::new();
    for item in header_text.split(',') {
        let Some((key, value)) = item.split_once('=') else {
            continue;
        };
        match key.trim() {
            "t" if timestamp_text.is_some() => {
                return Err(malformed(STRIPE_SIGNATURE, "more than one `t=` timestamp"));
            }
            "t" => timestamp_text = Some(value.trim()),
            "v1" => signatures.extend(mac_from_hex(value.trim())),
            _ => {}
        }
    }
    let timestamp_text =
        timestamp_text.ok_or_else(|| malformed(STRIPE_SIGNATURE, "no `t=` timestamp"))?;
    let timestamp = parse_seconds(STRIPE_SIGNATURE, timestamp_text)?;

    // Signed content: `{t}.{body}`, with `t` as the header carries it.
    let mut mac = keyed(secret.key());
    mac.update(timestamp_text.as_bytes());
    mac.update(b".");
    mac.update(body);
    if secret.key().is_empty() || !matches_any(&mac, signatures.iter().map(<[u8; 32]>::as_slice)) {
        return Err(VerifyError::BadSignature);
    }
    let timestamp = check_timestamp(timestamp, tolerance, now)?;

    // The event id, read only from a body already known to be Stripe's.
    let event: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(body).map_err(|_| VerifyError::MissingEventId)?;
    let id = match event.get("id") {
        Some(serde_json::Value::String(id)) if !id.is_empty() => id.clone(),
        _ => return Err(VerifyError::MissingEventId),
    };
    Ok(Verified {
        id,
        timestamp: Some(timestamp),
    })
}

fn verify_github(
    secret: &Secret,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Verified, VerifyError> {
    let signature_text = header(headers, GITHUB_SIGNATURE)?;
    let delivery = header(headers, GITHUB_DELIVERY)?;
    let signature = signature_text
        .strip_prefix("sha256=")
        .ok_or_else(|| malformed(GITHUB_SIGNATURE, "does not start with `sha256=`"))?;

    let mut mac = keyed(secret.key());
    mac.update(body);
    let matched = !secret.key().is_empty()
        && mac_from_hex(signature).is_some_and(|signature| matches_any(&mac, [&signature[..]]));
    if !matched {
        return Err(VerifyError::BadSignature);
    }
    Ok(Verified {
        id: delivery.to_owned(),
        timestamp: None,
    })
}
