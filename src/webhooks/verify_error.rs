//! [`VerifyError`]: why a delivery was refused, and the HTTP status that
//! says so to its sender.

use std::fmt;
use std::time::Duration;

/// Why [`Verifier::verify`](super::Verifier::verify) refused a delivery.
///
/// A refused delivery is not to be processed, stored or claimed. Answer
/// its sender with [`VerifyError::status`]: `400` for a request that does
/// not follow the scheme, `401` for one that does but is not authentic or
/// not current. The enum is `#[non_exhaustive]`: keep a wildcard arm.
///
/// Header names are the lowercase forms (`webhook-id`,
/// `stripe-signature`, `x-hub-signature-256`, …).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum VerifyError {
    /// A header the scheme requires is absent. Status 400.
    MissingHeader {
        /// The header's name.
        name: &'static str,
    },
    /// A header the scheme requires is there but cannot be read: sent more
    /// than once, not visible ASCII, empty, a timestamp that is not a whole
    /// number of seconds, a signature header without its prefix or
    /// timestamp. Status 400.
    MalformedHeader {
        /// The header's name.
        name: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// No signature in the request is the HMAC of this body under any of
    /// the verifier's secrets (signatures of other versions or schemes, and
    /// ones that do not decode, match nothing). The body or a signed header
    /// was changed, the secret is wrong or was rotated, or the request is
    /// forged. Status 401.
    BadSignature,
    /// The signature matched, but the signed timestamp is more than the
    /// tolerance before `now`: a delivery held up or replayed, or a clock
    /// far behind. Status 401.
    TimestampTooOld {
        /// The timestamp the request carried, in seconds since the Unix
        /// epoch.
        timestamp: i64,
        /// The verifier's tolerance.
        tolerance: Duration,
    },
    /// The signature matched, but the signed timestamp is more than the
    /// tolerance after `now`: the sender's clock (or this one) is wrong.
    /// Status 401.
    TimestampTooNew {
        /// The timestamp the request carried, in seconds since the Unix
        /// epoch.
        timestamp: i64,
        /// The verifier's tolerance.
        tolerance: Duration,
    },
    /// A Stripe delivery whose signature matched, but whose body is not a
    /// JSON object with a non-empty string `"id"` at its top level, so it
    /// has no event id to deduplicate by. Status 400.
    MissingEventId,
}

impl VerifyError {
    /// The HTTP status to answer the sender with: 400 for
    /// [`MissingHeader`](VerifyError::MissingHeader),
    /// [`MalformedHeader`](VerifyError::MalformedHeader) and
    /// [`MissingEventId`](VerifyError::MissingEventId); 401 for
    /// [`BadSignature`](VerifyError::BadSignature),
    /// [`TimestampTooOld`](VerifyError::TimestampTooOld) and
    /// [`TimestampTooNew`](VerifyError::TimestampTooNew).
    pub fn status(&self) -> u16 {
        match self {
            VerifyError::MissingHeader { .. }
            | VerifyError::MalformedHeader { .. }
            | VerifyError::MissingEventId => 400,
            VerifyError::BadSignature
            | VerifyError::TimestampTooOld { .. }
            | VerifyError::TimestampTooNew { .. } => 401,
        }
    }
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VerifyError::MissingHeader { name } => write!(
                f,
                "the webhook request has no `{name}` header: it was not sent by this scheme's sender, or something on the way dropped the header"
            ),
            VerifyError::MalformedHeader { name, reason } => {
                write!(f, "the webhook request's `{name}` header is malformed: {reason}")
            }
            VerifyError::BadSignature => f.write_str(
                "no webhook signature matches the body under the configured secrets: the body was changed (verify the raw bytes as received), the secret is wrong or was rotated, or the request is forged",
            ),
            VerifyError::TimestampTooOld {
                timestamp,
                tolerance,
            } => write!(
                f,
                "the webhook's timestamp {timestamp} is more than {} s before now: a delivery held up or replayed, or a clock behind",
                tolerance.as_secs()
            ),
            VerifyError::TimestampTooNew {
                timestamp,
                tolerance,
            } => write!(
                f,
                "the webhook's timestamp {timestamp} is more than {} s after now: the sender's clock or this one is wrong",
                tolerance.as_secs()
            ),
            VerifyError::MissingEventId => f.write_str(
                "the Stripe event's body is not a JSON object with a non-empty string `id` at its top level",
            ),
        }
    }
}

impl std::error::Error for VerifyError {}
