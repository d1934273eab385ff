//! Buffering a handler's response body up to `max_body` bytes, without
//! losing it when it is larger.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt as _;

use super::{BoxError, ResponseBody};

/// A response body read as far as `max_body` allows.
pub(crate) enum Buffered {
    /// The whole body (trailers, if any, are dropped).
    Whole(Bytes),
    /// Longer than `max_body`: the part read so far followed by the rest,
    /// byte-identical to the original.
    TooLarge(ResponseBody),
    /// Reading the body failed.
    Failed,
}

/// Reads `body` into memory if it is at most `max_body` bytes.
pub(crate) async fn buffer(mut body: ResponseBody, max_body: usize) -> Buffered {
    if over_max_body(body.size_hint().lower(), max_body) {
        return Buffered::TooLarge(body);
    }
    let mut read = BytesMut::new();
    loop {
        match body.frame().await {
            None => return Buffered::Whole(read.freeze()),
            Some(Err(_)) => return Buffered::Failed,
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue; // trailers: not stored
                };
                if read.len() + data.len() > max_body {
                    read.extend_from_slice(&data);
                    return Buffered::TooLarge(ResponseBody::new(Prefixed {
                        head: Some(read.freeze()),
                        rest: body,
                    }));
                }
                read.extend_from_slice(&data);
            }
        }
    }
}

/// Whether a body of `len` bytes (a declared or hinted length) is over
/// `max_body`.
pub(crate) fn over_max_body(len: u64, max_body: usize) -> bool {
    len > u64::try_from(max_body).unwrap_or(u64::MAX)
}

/// `head`, then every frame of `rest`.
struct Prefixed {
    head: Option<Bytes>,
    rest: ResponseBody,
}

impl Body for Prefixed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(head) = this.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        Pin::new(&mut this.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let head = self.head.as_ref().map_or(0, |h| h.len() as u64);
        let rest = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + head);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + head);
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;
    use crate::middleware::problem::full;

    /// A body of several data frames, with no size hint.
    struct Chunks(VecDeque<&'static [u8]>);

    impl Body for Chunks {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            let next = self.get_mut().0.pop_front();
            Poll::Ready(next.map(|c| Ok(Frame::data(Bytes::from_static(c)))))
        }
    }

    fn chunks(parts: &[&'static [u8]]) -> ResponseBody {
        ResponseBody::new(Chunks(parts.iter().copied().collect()))
    }

    async fn whole(body: ResponseBody, max_body: usize) -> Option<Bytes> {
        match buffer(body, max_body).await {
            Buffered::Whole(b) => Some(b),
            _ => None,
        }
    }

    async fn too_large(body: ResponseBody, max_body: usize) -> Option<Bytes> {
        match buffer(body, max_body).await {
            Buffered::TooLarge(rest) => Some(rest.collect().await.ok()?.to_bytes()),
            _ => None,
        }
    }

    #[tokio::test]
    async fn whole_bodies() {
        assert_eq!(
            whole(full(Bytes::from_static(b"hello")), 5).await.unwrap(),
            "hello"
        );
        assert_eq!(
            whole(chunks(&[b"he", b"ll", b"o"]), 5).await.unwrap(),
            "hello"
        );
        assert_eq!(whole(chunks(&[]), 0).await.unwrap(), "");
    }

    #[tokio::test]
    async fn too_large_bodies_stay_whole() {
        // Refused from the size hint, unread.
        assert_eq!(
            too_large(full(Bytes::from_static(b"hello!")), 5)
                .await
                .unwrap(),
            "hello!"
        );
        // Found while reading: the part read comes first, then the rest.
        assert_eq!(
            too_large(chunks(&[b"he", b"llo", b"!", b" world"]), 5)
                .await
                .unwrap(),
            "hello! world"
        );
    }
}
