//! The receiving half: [`Receiver`] verifies a delivery, then claims its id
//! in an inbox in the same write transaction as the handler's effect.

use std::fmt;

use chrono::{DateTime, Utc};
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use redb::WriteTransaction;

use super::{Verified, Verifier, VerifyError};
use crate::error::Error;
use crate::inbox::{Claim, Inbox, MAX_EVENT_KEY_LEN};
#[cfg(feature = "postgres")]
use crate::postgres::{BoxFuture, PgInbox, Transaction, tokio_postgres};

/// The default largest body a [`Receiver`] reads: 1 MiB.
pub const DEFAULT_BODY_LIMIT: usize = 1 << 20;

/// Verifies deliveries and claims them in an inbox with their effect; cheap
/// to clone.
///
/// In order, for each delivery:
///
/// 1. a body over the limit (default [`DEFAULT_BODY_LIMIT`]) is refused,
///    413;
/// 2. the [`Verifier`] checks the headers and the signature on the raw
///    body: a missing or malformed header is refused 400, a bad signature
///    or a timestamp outside the tolerance 401 (the
///    [`VerifyError`](super::VerifyError) says which);
/// 3. the verified id (at most [`MAX_EVENT_KEY_LEN`] bytes, else 400) is
///    claimed in the inbox with [`Inbox::claim_with`]: the first delivery
///    runs the effect in the claim's transaction, and the claim and the
///    effect's writes commit together, durably, or not at all; a
///    delivery already claimed is answered without running it.
///
/// A refused delivery writes nothing and runs nothing. An effect that
/// fails leaves nothing either (the claim rolls back with it), so the
/// provider's retry runs it again. [`Received::into_response`] gives the
/// answer: 204 for a delivery applied or already applied, the refusal's
/// status with an `application/problem+json` body, 500 for a failed effect.
#[derive(Clone, Debug)]
pub struct Receiver {
    inbox: Inbox,
    checks: Checks,
}

/// What a delivery is checked for before any claim: its body's size, the
/// verifier's checks, its id's length.
#[derive(Clone, Debug)]
struct Checks {
    verifier: Verifier,
    body_limit: usize,
}

impl Checks {
    fn new(verifier: Verifier) -> Checks {
        Checks {
            verifier,
            body_limit: DEFAULT_BODY_LIMIT,
        }
    }

    fn check(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now: DateTime<Utc>,
    ) -> Result<Verified, Refusal> {
        if body.len() > self.body_limit {
            return Err(Refusal::TooLarge {
                limit: self.body_limit,
            });
        }
        let verified = self
            .verifier
            .verify(headers, body, now)
            .map_err(Refusal::Unverified)?;
        if verified.id().len() > MAX_EVENT_KEY_LEN {
            return Err(Refusal::IdTooLong {
                len: verified.id().len(),
            });
        }
        Ok(verified)
    }
}

impl<T, E> From<Result<Claim<T>, E>> for Received<T, E> {
    fn from(claimed: Result<Claim<T>, E>) -> Self {
        match claimed {
            Ok(Claim::Applied(value)) => Received::Applied(value),
            Ok(Claim::Duplicate) => Received::Duplicate,
            Err(e) => Received::Failed(e),
        }
    }
}

/// Why a delivery was refused before anything ran.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The body is longer than the receiver's limit.
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The verifier refused it.
    Unverified(VerifyError),
    /// The verified id is longer than an inbox key may be.
    IdTooLong {
        /// Its length, in bytes.
        len: usize,
    },
}

impl Refusal {
    /// The HTTP status to answer: 413, the [`VerifyError`]'s (400 or 401),
    /// or 400.
    #[must_use]
    pub fn status(&self) -> u16 {
        match self {
            Refusal::TooLarge { .. } => 413,
            Refusal::Unverified(e) => e.status(),
            Refusal::IdTooLong { .. } => 400,
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::TooLarge { limit } => write!(f, "the body is over {limit} bytes"),
            Refusal::Unverified(e) => e.fmt(f),
            Refusal::IdTooLong { len } => write!(
                f,
                "the delivery id is {len} bytes, over {MAX_EVENT_KEY_LEN}"
            ),
        }
    }
}

impl std::error::Error for Refusal {}

/// What became of a delivery.
#[derive(Debug)]
#[must_use]
pub enum Received<T, E> {
    /// First delivery of its id: the effect ran, and it and the claim are
    /// committed and durable.
    Applied(T),
    /// Its id was claimed before: nothing ran.
    Duplicate,
    /// Refused before anything ran; nothing was written.
    Refused(Refusal),
    /// The effect (or the store) failed: nothing was written, the id is
    /// not claimed, and a retry of the delivery runs the effect again.
    Failed(E),
}

impl<T, E> Received<T, E> {
    /// The HTTP status to answer: 204 applied or duplicate, the refusal's,
    /// 500 failed.
    pub fn status(&self) -> u16 {
        match self {
            Received::Applied(_) | Received::Duplicate => 204,
            Received::Refused(r) => r.status(),
            Received::Failed(_) => 500,
        }
    }

    /// The answer to send: an empty 204, or an `application/problem+json`
    /// body with the status and, for a refusal, its reason (a failed
    /// effect's error is not shown to the sender).
    pub fn into_response(self) -> Response<String> {
        let status =
            StatusCode::from_u16(self.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let problem = match &self {
            Received::Applied(_) | Received::Duplicate => None,
            Received::Refused(r) => Some(r.to_string()),
            Received::Failed(_) => Some("the delivery could not be processed".to_owned()),
        };
        let mut response = Response::new(String::new());
        *response.status_mut() = status;
        if let Some(detail) = problem {
            let title = status.canonical_reason().unwrap_or("Error");
            *response.body_mut() = serde_json::json!({
                "type": "about:blank",
                "title": title,
                "status": status.as_u16(),
                "detail": detail,
            })
            .to_string();
            response.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("application/problem+json"),
            );
        }
        response
    }
}

impl Receiver {
    /// Deliveries checked by `verifier`, claimed in `inbox`.
    #[must_use]
    pub fn new(inbox: Inbox, verifier: Verifier) -> Receiver {
        Receiver {
            inbox,
            checks: Checks::new(verifier),
        }
    }

    /// The largest body accepted, in bytes (default
    /// [`DEFAULT_BODY_LIMIT`]). Read the request's body with the same
    /// limit, so that a larger one is never held in memory whole.
    #[must_use]
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.checks.body_limit = bytes;
        self
    }

    /// Receives one delivery at `now` (see [`Receiver`]): `effect` runs, at
    /// most once per id, in the claim's write transaction, given the
    /// verified delivery.
    pub fn receive<T, E, F>(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now: DateTime<Utc>,
        effect: F,
    ) -> Received<T, E>
    where
        F: FnOnce(&WriteTransaction, &Verified) -> Result<T, E>,
        E: From<Error>,
    {
        match self.checks.check(headers, body, now) {
            Ok(verified) => self
                .inbox
                .claim_with(verified.id(), now, |tx| effect(tx, &verified))
                .into(),
            Err(refusal) => Received::Refused(refusal),
        }
    }

    /// [`Receiver::receive`] for an async task: the effect runs on tokio's
    /// blocking pool, and the task waits for the durable commit without
    /// holding a thread ([`Inbox::claim_with_async`]).
    pub async fn receive_async<T, E, F>(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now: DateTime<Utc>,
        effect: F,
    ) -> Received<T, E>
    where
        T: Send + 'static,
        F: FnOnce(&WriteTransaction, &Verified) -> Result<T, E> + Send + 'static,
        E: From<Error> + Send + 'static,
    {
        let verified = match self.checks.check(headers, body, now) {
            Ok(v) => v,
            Err(refusal) => return Received::Refused(refusal),
        };
        let id = verified.id().to_owned();
        self.inbox
            .claim_with_async(&id, now, move |tx| effect(tx, &verified))
            .await
            .into()
    }
}

/// [`Receiver`] on a PostgreSQL inbox (features `webhooks` and
/// `postgres`): the same checks, then the claim and the effect in one
/// server transaction ([`PgInbox::claim_with`]); cheap to clone.
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
#[derive(Clone, Debug)]
pub struct PgReceiver {
    inbox: PgInbox,
    checks: Checks,
}

#[cfg(feature = "postgres")]
impl PgReceiver {
    /// Deliveries checked by `verifier`, claimed in `inbox`.
    #[must_use]
    pub fn new(inbox: PgInbox, verifier: Verifier) -> PgReceiver {
        PgReceiver {
            inbox,
            checks: Checks::new(verifier),
        }
    }

    /// [`Receiver::body_limit`].
    #[must_use]
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.checks.body_limit = bytes;
        self
    }

    /// [`Receiver::receive`]: `effect` writes through the server
    /// transaction the claim is in.
    pub fn receive<T, E, F>(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now: DateTime<Utc>,
        effect: F,
    ) -> Received<T, E>
    where
        F: FnOnce(&mut Transaction<'_>, &Verified) -> Result<T, E>,
        E: From<Error>,
    {
        match self.checks.check(headers, body, now) {
            Ok(verified) => self
                .inbox
                .claim_with(verified.id(), now, |tx| effect(tx, &verified))
                .into(),
            Err(refusal) => Received::Refused(refusal),
        }
    }

    /// [`PgReceiver::receive`], awaited, with an async effect given the
    /// client's transaction and the verified delivery:
    /// `|tx, delivery| Box::pin(async move { … })`
    /// ([`PgInbox::claim_with_async`]).
    pub async fn receive_async<T, E, F>(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now: DateTime<Utc>,
        effect: F,
    ) -> Received<T, E>
    where
        F: for<'t, 'c> FnOnce(
            &'t mut tokio_postgres::Transaction<'c>,
            Verified,
        ) -> BoxFuture<'t, Result<T, E>>,
        T: Send + 'static,
        E: From<Error> + Send + 'static,
    {
        let verified = match self.checks.check(headers, body, now) {
            Ok(v) => v,
            Err(refusal) => return Received::Refused(refusal),
        };
        let id = verified.id().to_owned();
        self.inbox
            .claim_with_async(&id, now, move |tx| effect(tx, verified))
            .await
            .into()
    }
}
