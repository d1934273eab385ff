//! Webhooks (feature `webhooks`): check that a delivery comes from its
//! sender and is current before anything reads it ([`Verifier`]), sign
//! the ones you send the Standard Webhooks way ([`sign`]), and send outbox
//! entries as signed webhooks from a dispatcher ([`Sender`]: its docs give
//! the request and how each answer becomes a
//! [`Delivery`](crate::Delivery)), and receive them exactly once
//! ([`Receiver`]: verify, then claim the delivery's id in an inbox in the
//! effect's own write transaction).
//!
//! ```no_run
//! use idemstore::webhooks::{Endpoint, Secret, Sender};
//! use idemstore::{Dispatcher, Store};
//!
//! # fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = Store::open("shop.idem")?;
//! let sender = Sender::builder()
//!     .endpoint(
//!         "billing",
//!         Endpoint::new("https://billing.example.com/hooks")?
//!             .secret(Secret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")?),
//!     )
//!     .build()?;
//! // Every entry of destination "billing" is POSTed there, signed; a
//! // timeout once the request left is `OutcomeUnknown`, and the retry
//! // carries the same `webhook-id`.
//! let dispatcher = Dispatcher::builder(store.outbox()).start(sender.blocking())?;
//! # dispatcher.shutdown()?;
//! # Ok(())
//! # }
//! ```
//!
//! ```
//! use http::HeaderMap;
//! use idemstore::chrono::{DateTime, TimeDelta};
//! use idemstore::webhooks::{Secret, Verifier, VerifyError, sign};
//!
//! let secret = Secret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")?;
//! let body = br#"{"test": 2432232314}"#;
//!
//! // The sender's headers.
//! let mut headers = HeaderMap::new();
//! headers.insert("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek".parse()?);
//! headers.insert("webhook-timestamp", "1614265330".parse()?);
//! let signature = sign(&[secret.clone()], "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body);
//! headers.insert("webhook-signature", signature.parse()?);
//!
//! // The receiver, 30 s later: the raw body, the headers, its own clock's now.
//! let verifier = Verifier::standard(vec![secret]);
//! let sent = DateTime::from_timestamp(1614265330, 0).ok_or("a date")?;
//! let now = sent + TimeDelta::seconds(30);
//! let verified = verifier.verify(&headers, body, now)?;
//! assert_eq!(verified.id(), "msg_p5jXN8AQM9LWM0D4loKWxJek");
//! assert_eq!(verified.timestamp(), Some(sent));
//!
//! // One byte changed: refused, and the status to answer with.
//! let refused = verifier.verify(&headers, br#"{"test": 2432232315}"#, now).unwrap_err();
//! assert_eq!(refused, VerifyError::BadSignature);
//! assert_eq!(refused.status(), 401);
//!
//! // The same delivery replayed an hour later: refused too.
//! let later = sent + TimeDelta::hours(1);
//! assert!(matches!(
//!     verifier.verify(&headers, body, later),
//!     Err(VerifyError::TimestampTooOld { timestamp: 1614265330, .. })
//! ));
//! # Ok::<_, Box<dyn std::error::Error>>(())
//! ```
//!
//! # What a `verify` that answers `Ok` guarantees
//!
//! - A signature in the request is the HMAC-SHA256, under one of the
//!   verifier's secrets, of exactly the body bytes given (and of the id
//!   and timestamp, for the schemes that sign them). Verify the raw body as
//!   it arrived: parsed and encoded again, it no longer matches.
//! - Where the scheme signs a timestamp, it is within the
//!   [tolerance](Verifier::tolerance) of the `now` passed in.
//! - [`Verified::id`] is the id to deduplicate the delivery by (a
//!   redelivery carries the same one).
//!
//! Signatures are compared in constant time (`hmac`'s `verify_slice`).
//! `verify` stores nothing, reads no clock and never panics, whatever the
//! headers and body: a header missing, sent twice, not ASCII, a timestamp
//! out of any range, a signature that does not decode. Each refusal is a
//! [`VerifyError`] that says which check failed, with the HTTP status
//! to answer ([`VerifyError::status`]): 400 when the request does not
//! follow the scheme, 401 when it does but is not authentic or not
//! current.
//!
//! # The schemes
//!
//! | | [Standard Webhooks](Verifier::standard) | [Stripe](Verifier::stripe) | [GitHub](Verifier::github) |
//! |---|---|---|---|
//! | headers | `webhook-id`, `webhook-timestamp`, `webhook-signature` | `Stripe-Signature` | `X-Hub-Signature-256`, `X-GitHub-Delivery` |
//! | key | the bytes of a [`Secret`] (`whsec_` + base64, decoded) | the endpoint secret's text, `whsec_…` as it is | the secret's text |
//! | signed content | `{webhook-id}.{webhook-timestamp}.{body}` | `{t}.{body}` | `{body}` |
//! | signature | `v1,<base64>` entries, space-separated; any `v1` one under any secret | `t=<seconds>,v1=<hex>,…`; any `v1` one | `sha256=<hex>` |
//! | id ([`Verified::id`]) | `webhook-id` (signed) | the body's top-level `"id"` (signed) | `X-GitHub-Delivery` (not signed) |
//! | timestamp | `webhook-timestamp` | `t` | none |
//!
//! Signatures of other versions or schemes (`v1a,…`, Stripe's `v0=`)
//! are ignored: a request whose only signatures are of those is refused.
//! Several secrets ([`Verifier::standard`] takes a list) let a key
//! rotation go on without a refused delivery: the sender signs with both
//! keys ([`sign`] takes a list too) while receivers move to the new one.
//!
//! GitHub signs neither a timestamp nor the delivery id: a captured
//! delivery can be sent again at any time, under a new delivery id, and
//! still verify. Deduplicating by `X-GitHub-Delivery` catches GitHub's own
//! redeliveries, not such a replay; an effect that must not run twice for
//! one event also keys on something inside the body.
//!
//! # The tolerance
//!
//! A signed timestamp is accepted when it is at most the tolerance before
//! or after `now`, counted in whole seconds of `now` (its fraction of a
//! second is dropped): with the default 5 minutes and `now` at 12:00:00.9,
//! 11:55:00 and 12:05:00 are accepted, 11:54:59 and 12:05:01 refused. The
//! window limits how long a captured delivery can be replayed; within it,
//! a replay has the id of the original, which an inbox claim turns into a
//! duplicate. Keep it longer than the sender's and the receiver's clocks
//! may disagree plus the time a delivery may spend on the way.
//! The timestamp is checked only once a signature matched, so
//! [`TimestampTooOld`](VerifyError::TimestampTooOld) and
//! [`TimestampTooNew`](VerifyError::TimestampTooNew) are about authentic,
//! stale (or early) deliveries.
//!
//! # Secrets
//!
//! A [`Secret`]'s `Debug` prints no key, and nothing in this module writes
//! one anywhere: keep them in the application's configuration, not in the
//! store.

mod receiver;
mod secret;
mod sender;
mod verify;
mod verify_error;

#[cfg(feature = "postgres")]
pub use receiver::PgReceiver;
pub use receiver::{DEFAULT_BODY_LIMIT, Received, Receiver, Refusal};
pub use secret::{Secret, sign};
pub use sender::{CONNECT_TIMEOUT, DEFAULT_TIMEOUT, Endpoint, MAX_ANSWER, Sender, SenderBuilder};
pub use verify::{DEFAULT_TOLERANCE, Verified, Verifier};
pub use verify_error::VerifyError;
