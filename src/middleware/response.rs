//! A stored response and the `http::Response` it stands for, each made from
//! the other: a handler that stores its own response (with `complete_in`)
//! writes its answer once, and its client and every retry get the same one.

use bytes::Bytes;
use chrono::{DateTime, Utc};
use http::header::{CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, HeaderValue, TRANSFER_ENCODING};
use http::{HeaderName, Response, StatusCode};

use super::problem::full;
use super::{IDEMPOTENT_REPLAYED, ResponseBody};
use crate::{Reservation, ResponseRecord};

/// The HTTP response `record` stands for: its status, `Content-Type`,
/// stored headers (in their order, repeated names kept) and body. It is what
/// the layer sends a retry, less the `Idempotent-Replayed` header.
///
/// A stored status outside 100–999, or a header whose name or value HTTP
/// does not allow (possible only in a record stored by other means than
/// [`record_response`] or the layer), cannot be sent: the status becomes
/// 500 and such a header is left out.
#[must_use]
pub fn to_response(record: &ResponseRecord) -> Response<ResponseBody> {
    let mut response = Response::new(full(Bytes::from(record.response_body.clone())));
    *response.status_mut() =
        StatusCode::from_u16(record.response_status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    if let Some(v) = record
        .content_type
        .as_deref()
        .and_then(|ct| HeaderValue::from_str(ct).ok())
    {
        headers.insert(CONTENT_TYPE, v);
    }
    for (name, value) in &record.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            headers.append(n, v);
        }
    }
    response
}

/// The record that stores `response` for `reservation`, completed at `now`:
/// its status, its `Content-Type`, every other header whose value is
/// visible ASCII (`Location`, `ETag`, your own), in order, and its body.
/// Pass it to [`IdempotencyKeys::complete_in`](crate::IdempotencyKeys::complete_in)
/// in the handler's transaction and answer with [`to_response`] of it, and
/// the first client gets exactly what retries will.
///
/// Every header is kept, not just the layer's
/// [`replay_headers`](super::IdempotencyLayer::replay_headers): leave out of
/// `response` what must not be sent twice (a `Set-Cookie` with a one-time
/// token). Headers that describe one transfer rather than the response
/// (`Content-Length`, `Transfer-Encoding`, `Connection`) and
/// `Idempotent-Replayed` are not stored.
#[must_use]
pub fn record_response<B: AsRef<[u8]>>(
    reservation: &Reservation,
    response: &Response<B>,
    now: DateTime<Utc>,
) -> ResponseRecord {
    let mut record = reservation.response(
        response.status().as_u16(),
        response.body().as_ref().to_vec(),
        now,
    );
    let headers = response.headers();
    record.content_type = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    record.headers = headers
        .iter()
        .filter(|(name, _)| {
            ![
                CONTENT_TYPE,
                CONTENT_LENGTH,
                TRANSFER_ENCODING,
                CONNECTION,
                IDEMPOTENT_REPLAYED,
            ]
            .contains(*name)
        })
        .filter_map(|(name, value)| {
            let value = value.to_str().ok()?;
            Some((name.as_str().to_owned(), value.to_owned()))
        })
        .collect();
    record
}

/// A stored response, sent again: [`to_response`] with
/// `Idempotent-Replayed: true`.
pub(crate) fn replay(record: &ResponseRecord) -> Response<ResponseBody> {
    let mut response = to_response(record);
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

#[cfg(test)]
mod tests {
    use http::header::{LOCATION, SET_COOKIE};
    use http_body_util::BodyExt as _;

    use super::*;
    use crate::Store;

    fn reservation() -> Reservation {
        let store = Store::builder().in_memory().unwrap();
        let keys = store.idempotency_keys();
        match keys.begin("t", "k", "fp", Utc::now()).unwrap() {
            crate::Begin::Proceed(r) => r,
            other => panic!("a fresh key proceeds, got {other:?}"),
        }
    }

    #[test]
    fn a_response_survives_the_round_trip_through_its_record() {
        let r = reservation();
        let response = Response::builder()
            .status(201)
            .header(CONTENT_TYPE, "application/json")
            .header(LOCATION, "/orders/7")
            .header(SET_COOKIE, "a=1")
            .header(SET_COOKIE, "b=2")
            .header(CONTENT_LENGTH, "11")
            .body("{\"order\":7}")
            .unwrap();
        let record = record_response(&r, &response, Utc::now());
        assert_eq!(record.response_status, 201);
        assert_eq!(record.content_type.as_deref(), Some("application/json"));
        assert_eq!(
            record.headers,
            vec![
                ("location".to_owned(), "/orders/7".to_owned()),
                ("set-cookie".to_owned(), "a=1".to_owned()),
                ("set-cookie".to_owned(), "b=2".to_owned()),
            ]
        );
        assert_eq!(record.idempotency_key, "k");
        assert_eq!(record.tenant, "t");

        let back = to_response(&record);
        assert_eq!(back.status(), 201);
        let h = back.headers();
        assert_eq!(h[CONTENT_TYPE], "application/json");
        assert_eq!(h[LOCATION], "/orders/7");
        let cookies: Vec<_> = h.get_all(SET_COOKIE).iter().collect();
        assert_eq!(cookies, ["a=1", "b=2"]);
        assert!(h.get(CONTENT_LENGTH).is_none());
        assert!(h.get(IDEMPOTENT_REPLAYED).is_none());
        let body = futures_body(back);
        assert_eq!(body, "{\"order\":7}");

        assert_eq!(replay(&record).headers()[IDEMPOTENT_REPLAYED], "true");
    }

    #[test]
    fn unsendable_parts_of_a_record_are_left_out() {
        let r = reservation();
        let mut record = r.response(42, b"x".to_vec(), Utc::now());
        record.content_type = Some("bad\nvalue".into());
        record.headers = vec![
            ("bad name".into(), "v".into()),
            ("x-ok".into(), "yes".into()),
        ];
        let response = to_response(&record);
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(response.headers().get(CONTENT_TYPE).is_none());
        assert_eq!(response.headers().len(), 1);
        assert_eq!(response.headers()["x-ok"], "yes");
    }

    fn futures_body(response: Response<ResponseBody>) -> String {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let bytes = rt
            .block_on(response.into_body().collect())
            .unwrap()
            .to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }
}
