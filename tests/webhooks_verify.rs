//! Webhook signatures: `webhooks::sign` and `webhooks::Verifier` for
//! Standard Webhooks (against the specification's example and the
//! Standard Webhooks project's own library, both ways), Stripe and GitHub
//! (against their documented schemes), with every refusal told apart.
//! Time is passed in: no test reads the clock, except the one that hands
//! a signature to `standardwebhooks`, whose `verify` reads it itself.
#![cfg(feature = "webhooks")]

use std::fmt::Write as _;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, KeyInit as _, Mac as _};
use http::{HeaderMap, HeaderName, HeaderValue};
use idemstore::chrono::{DateTime, TimeDelta, Utc};
use idemstore::webhooks::{DEFAULT_TOLERANCE, Secret, Verified, Verifier, VerifyError, sign};
use sha2::Sha256;

type TestResult = Result<(), Box<dyn std::error::Error>>;

// The Standard Webhooks specification's example.
const SPEC_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const SPEC_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
const SPEC_TIMESTAMP: i64 = 1_614_265_330;
const SPEC_BODY: &[u8] = br#"{"test": 2432232314}"#;
const SPEC_SIGNATURE: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

fn at(seconds: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(seconds, 0).unwrap()
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.append(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(value).unwrap(),
        );
    }
    map
}

fn standard_headers(id: &str, timestamp: &str, signature: &str) -> HeaderMap {
    headers(&[
        ("webhook-id", id),
        ("webhook-timestamp", timestamp),
        ("webhook-signature", signature),
    ])
}

fn spec_headers() -> HeaderMap {
    standard_headers(SPEC_ID, &SPEC_TIMESTAMP.to_string(), SPEC_SIGNATURE)
}

fn spec_verifier() -> Verifier {
    Verifier::standard(vec![Secret::parse(SPEC_SECRET).unwrap()])
}

fn malformed(error: &VerifyError) -> Option<&'static str> {
    match error {
        VerifyError::MalformedHeader { name, .. } => Some(name),
        _ => None,
    }
}

// ---------- Standard Webhooks ----------

#[test]
fn the_specification_example_signs_and_verifies() -> TestResult {
    let secret = Secret::parse(SPEC_SECRET)?;
    assert_eq!(
        sign(&[secret], SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY),
        SPEC_SIGNATURE
    );
    let verified = spec_verifier().verify(&spec_headers(), SPEC_BODY, at(SPEC_TIMESTAMP))?;
    assert_eq!(verified.id(), SPEC_ID);
    assert_eq!(verified.timestamp(), Some(at(SPEC_TIMESTAMP)));
    Ok(())
}

#[test]
fn the_standardwebhooks_crates_own_vector_signs_the_same() -> TestResult {
    // From the `standardwebhooks` crate's `test_sign`.
    let secret = Secret::parse("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD")?;
    let signature = sign(
        &[secret],
        "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk",
        1_649_367_553,
        br#"{"email":"test@example.com","username":"test_user"}"#,
    );
    assert_eq!(signature, "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=");
    Ok(())
}

#[test]
fn a_signature_from_sign_verifies_with_the_standardwebhooks_crate() -> TestResult {
    // That crate's `verify` holds the timestamp against its own clock.
    let now = Utc::now().timestamp();
    let theirs = standardwebhooks::Webhook::new(SPEC_SECRET)?;
    let other = Secret::from_bytes(b"another key, rotated out".to_vec());
    for secrets in [
        vec![Secret::parse(SPEC_SECRET)?],
        vec![other.clone(), Secret::parse(SPEC_SECRET)?],
    ] {
        let signature = sign(&secrets, SPEC_ID, now, SPEC_BODY);
        let headers = standard_headers(SPEC_ID, &now.to_string(), &signature);
        theirs.verify(SPEC_BODY, &headers)?;
        assert!(theirs.verify(b"{\"test\": 1}", &headers).is_err());
    }
    let signature = sign(&[other], SPEC_ID, now, SPEC_BODY);
    let headers = standard_headers(SPEC_ID, &now.to_string(), &signature);
    assert!(theirs.verify(SPEC_BODY, &headers).is_err());
    Ok(())
}

#[test]
fn a_signature_from_the_standardwebhooks_crate_verifies_here() -> TestResult {
    let theirs = standardwebhooks::Webhook::new(SPEC_SECRET)?;
    let timestamp = 1_700_000_000;
    let body = br#"{"type":"invoice.paid","amount":4200}"#;
    let signature = theirs.sign("msg_2", timestamp, body)?;
    assert_eq!(
        signature,
        sign(&[Secret::parse(SPEC_SECRET)?], "msg_2", timestamp, body)
    );

    let headers = standard_headers("msg_2", &timestamp.to_string(), &signature);
    let verified = spec_verifier().verify(&headers, body, at(timestamp + 12))?;
    assert_eq!(verified.id(), "msg_2");
    assert_eq!(
        spec_verifier().verify(&headers, b"{}", at(timestamp)),
        Err(VerifyError::BadSignature)
    );
    Ok(())
}

#[test]
fn a_changed_body_id_or_timestamp_is_a_bad_signature() {
    let verifier = spec_verifier();
    let now = at(SPEC_TIMESTAMP);
    let changed_body = verifier.verify(&spec_headers(), br#"{"test": 2432232315}"#, now);
    assert_eq!(changed_body, Err(VerifyError::BadSignature));

    let other_id = standard_headers("msg_other", &SPEC_TIMESTAMP.to_string(), SPEC_SIGNATURE);
    assert_eq!(
        verifier.verify(&other_id, SPEC_BODY, now),
        Err(VerifyError::BadSignature)
    );

    let other_time = standard_headers(SPEC_ID, &(SPEC_TIMESTAMP + 1).to_string(), SPEC_SIGNATURE);
    assert_eq!(
        verifier.verify(&other_time, SPEC_BODY, now),
        Err(VerifyError::BadSignature)
    );

    let err = VerifyError::BadSignature;
    assert_eq!(err.status(), 401);
    assert!(err.to_string().contains("signature"));
}

#[test]
fn a_wrong_secret_is_a_bad_signature() -> TestResult {
    let wrong = Verifier::standard(vec![Secret::parse(
        "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
    )?]);
    assert_eq!(
        wrong.verify(&spec_headers(), SPEC_BODY, at(SPEC_TIMESTAMP)),
        Err(VerifyError::BadSignature)
    );
    // No secrets, or one whose key is empty, accept nothing, not even a
    // signature made with the empty key.
    assert_eq!(
        Verifier::standard(vec![]).verify(&spec_headers(), SPEC_BODY, at(SPEC_TIMESTAMP)),
        Err(VerifyError::BadSignature)
    );
    let empty = Secret::from_bytes(Vec::new());
    let signature = sign(
        std::slice::from_ref(&empty),
        SPEC_ID,
        SPEC_TIMESTAMP,
        SPEC_BODY,
    );
    let headers = standard_headers(SPEC_ID, &SPEC_TIMESTAMP.to_string(), &signature);
    assert_eq!(
        Verifier::standard(vec![empty]).verify(&headers, SPEC_BODY, at(SPEC_TIMESTAMP)),
        Err(VerifyError::BadSignature)
    );
    Ok(())
}

#[test]
fn any_of_several_secrets_verifies_during_a_rotation() -> TestResult {
    let old = Secret::parse("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD")?;
    let new = Secret::parse(SPEC_SECRET)?;
    // Signed with the new key only: a receiver that knows both accepts.
    let both = Verifier::standard(vec![old.clone(), new]);
    let verified = both.verify(&spec_headers(), SPEC_BODY, at(SPEC_TIMESTAMP))?;
    assert_eq!(verified.id(), SPEC_ID);
    assert_eq!(
        Verifier::standard(vec![old]).verify(&spec_headers(), SPEC_BODY, at(SPEC_TIMESTAMP)),
        Err(VerifyError::BadSignature)
    );
    Ok(())
}

#[test]
fn timestamps_at_the_edge_of_the_tolerance() -> TestResult {
    assert_eq!(DEFAULT_TOLERANCE, Duration::from_secs(300));
    let verifier = spec_verifier();
    let headers = spec_headers();
    let sent = at(SPEC_TIMESTAMP);

    // Default: 5 minutes either way, in whole seconds of `now`.
    verifier.verify(&headers, SPEC_BODY, sent + TimeDelta::seconds(300))?;
    verifier.verify(&headers, SPEC_BODY, sent + TimeDelta::milliseconds(300_999))?;
    verifier.verify(&headers, SPEC_BODY, sent - TimeDelta::seconds(300))?;
    let late = verifier.verify(&headers, SPEC_BODY, sent + TimeDelta::seconds(301));
    assert_eq!(
        late,
        Err(VerifyError::TimestampTooOld {
            timestamp: SPEC_TIMESTAMP,
            tolerance: DEFAULT_TOLERANCE,
        })
    );
    let early = verifier.verify(&headers, SPEC_BODY, sent - TimeDelta::seconds(301));
    assert_eq!(
        early,
        Err(VerifyError::TimestampTooNew {
            timestamp: SPEC_TIMESTAMP,
            tolerance: DEFAULT_TOLERANCE,
        })
    );
    for refused in [late.unwrap_err(), early.unwrap_err()] {
        assert_eq!(refused.status(), 401);
        assert!(refused.to_string().contains("1614265330"), "{refused}");
    }

    // A tolerance of its own.
    let strict = spec_verifier().tolerance(Duration::from_secs(10));
    strict.verify(&headers, SPEC_BODY, sent + TimeDelta::seconds(10))?;
    strict.verify(&headers, SPEC_BODY, sent - TimeDelta::seconds(10))?;
    assert!(matches!(
        strict.verify(&headers, SPEC_BODY, sent + TimeDelta::seconds(11)),
        Err(VerifyError::TimestampTooOld { .. })
    ));
    assert!(matches!(
        strict.verify(&headers, SPEC_BODY, sent - TimeDelta::seconds(11)),
        Err(VerifyError::TimestampTooNew { .. })
    ));
    Ok(())
}

#[test]
fn a_bad_signature_is_told_before_a_stale_timestamp() {
    let now = at(SPEC_TIMESTAMP) + TimeDelta::hours(1);
    assert_eq!(
        spec_verifier().verify(&spec_headers(), b"forged", now),
        Err(VerifyError::BadSignature)
    );
}

#[test]
fn each_missing_header_is_named() {
    let verifier = spec_verifier();
    for name in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
        let mut headers = spec_headers();
        headers.remove(name);
        let refused = verifier
            .verify(&headers, SPEC_BODY, at(SPEC_TIMESTAMP))
            .unwrap_err();
        assert_eq!(refused, VerifyError::MissingHeader { name });
        assert_eq!(refused.status(), 400);
        assert!(refused.to_string().contains(name), "{refused}");
    }
}

#[test]
fn header_names_are_matched_in_any_case() -> TestResult {
    let timestamp = SPEC_TIMESTAMP.to_string();
    let headers = headers(&[
        ("Webhook-Id", SPEC_ID),
        ("WEBHOOK-TIMESTAMP", timestamp.as_str()),
        ("webhook-Signature", SPEC_SIGNATURE),
    ]);
    spec_verifier().verify(&headers, SPEC_BODY, at(SPEC_TIMESTAMP))?;
    Ok(())
}

#[test]
fn only_the_second_of_several_signatures_is_valid() -> TestResult {
    let other = sign(
        &[Secret::from_bytes(b"someone else".to_vec())],
        SPEC_ID,
        SPEC_TIMESTAMP,
        SPEC_BODY,
    );
    for header in [
        format!("{other} {SPEC_SIGNATURE}"),
        format!("{other} {SPEC_SIGNATURE} v1,tFtCZ5RDCPxzWQRWXWPgrCgE2frDBe9gjpbWQxnVfsQ="),
        format!("v1a,{} {SPEC_SIGNATURE}", &SPEC_SIGNATURE[3..]),
        format!("v1,!!notbase64!! {SPEC_SIGNATURE}"),
        format!("{other}  {SPEC_SIGNATURE}"),
    ] {
        let headers = standard_headers(SPEC_ID, &SPEC_TIMESTAMP.to_string(), &header);
        let verified = spec_verifier().verify(&headers, SPEC_BODY, at(SPEC_TIMESTAMP))?;
        assert_eq!(verified.id(), SPEC_ID, "{header}");
    }
    // Without the valid one, nothing matches.
    let headers = standard_headers(SPEC_ID, &SPEC_TIMESTAMP.to_string(), &other);
    assert_eq!(
        spec_verifier().verify(&headers, SPEC_BODY, at(SPEC_TIMESTAMP)),
        Err(VerifyError::BadSignature)
    );
    Ok(())
}

#[test]
fn a_signature_of_another_version_alone_is_refused() {
    // The right MAC, under a version this verifier does not know.
    let mac = &SPEC_SIGNATURE[3..];
    for header in [
        format!("v1a,{mac}"),
        format!("v2,{mac}"),
        format!("V1,{mac}"),
        mac.to_owned(),
    ] {
        let headers = standard_headers(SPEC_ID, &SPEC_TIMESTAMP.to_string(), &header);
        assert_eq!(
            spec_verifier().verify(&headers, SPEC_BODY, at(SPEC_TIMESTAMP)),
            Err(VerifyError::BadSignature),
            "{header}"
        );
    }
}

#[test]
fn a_body_that_is_not_utf8_is_signed_and_verified_as_bytes() -> TestResult {
    let secret = Secret::parse(SPEC_SECRET)?;
    let body: &[u8] = &[0xff, 0xfe, 0x00, 0x80, b'{', 0xc3, 0x28];
    let signature = sign(
        std::slice::from_ref(&secret),
        "msg_bin",
        1_700_000_000,
        body,
    );

    // The same MAC from first principles.
    let mut mac =
        Hmac::<Sha256>::new_from_slice(&BASE64.decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")?)?;
    mac.update(b"msg_bin.1700000000.");
    mac.update(body);
    assert_eq!(
        signature,
        format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()))
    );

    let headers = standard_headers("msg_bin", "1700000000", &signature);
    let verifier = Verifier::standard(vec![secret]);
    verifier.verify(&headers, body, at(1_700_000_000))?;
    let mut changed = body.to_vec();
    changed[0] = 0xfe;
    assert_eq!(
        verifier.verify(&headers, &changed, at(1_700_000_000)),
        Err(VerifyError::BadSignature)
    );
    Ok(())
}

#[test]
fn malformed_secrets_are_refused_at_parse() {
    for text in [
        "",
        "whsec_",
        "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        "WHSEC_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        "whsec MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaS",
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw=",
        "whsec_!!!!",
        "whsec_MfKQ9r8G KYqrTwjU",
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n",
    ] {
        match Secret::parse(text) {
            Err(idemstore::Error::InvalidInput { field, reason }) => {
                assert_eq!(field, "secret", "{text:?}");
                assert!(
                    !reason.contains("MfKQ9r8G"),
                    "the message repeats the secret: {reason}"
                );
            }
            other => panic!("{text:?}: {other:?}"),
        }
    }
    // Padding is standard base64's.
    let padded = Secret::parse("whsec_YWJj").unwrap();
    assert_eq!(padded, Secret::from_bytes(b"abc".to_vec()));
    assert_eq!(
        Secret::parse("whsec_YWI=").unwrap(),
        Secret::from_bytes(b"ab".to_vec())
    );
}

#[test]
fn a_secret_never_shows_its_key() -> TestResult {
    let secret = Secret::parse(SPEC_SECRET)?;
    let key = BASE64.decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")?;
    assert_eq!(secret, Secret::from_bytes(key.clone()));
    assert_ne!(secret, Secret::from_bytes(b"abc".to_vec()));
    for shown in [
        format!("{secret:?}"),
        format!("{secret:#?}"),
        format!("{:?}", Verifier::standard(vec![secret.clone()])),
        format!("{:?}", Verifier::stripe("whsec_topsecret")),
        format!("{:?}", Verifier::github("It's a Secret to Everybody")),
    ] {
        assert!(!shown.contains("MfKQ9r8G"), "{shown}");
        assert!(!shown.contains("topsecret"), "{shown}");
        assert!(!shown.contains("Everybody"), "{shown}");
    }
    assert_eq!(format!("{secret:?}"), "Secret(<redacted>)");
    Ok(())
}

#[test]
fn malformed_headers_are_told_apart_and_nothing_panics() -> TestResult {
    let verifier = spec_verifier();
    let now = at(SPEC_TIMESTAMP);
    for timestamp in [
        "soon",
        "1614265330.5",
        "",
        "99999999999999999999999",
        "0x10",
        " 1",
    ] {
        let mut headers = spec_headers();
        headers.insert("webhook-timestamp", HeaderValue::from_str(timestamp)?);
        let refused = verifier.verify(&headers, SPEC_BODY, now).unwrap_err();
        assert_eq!(
            malformed(&refused),
            Some("webhook-timestamp"),
            "{timestamp:?}: {refused}"
        );
        assert_eq!(refused.status(), 400);
    }

    // Not visible ASCII, sent twice, empty.
    let mut headers = spec_headers();
    headers.insert("webhook-id", HeaderValue::from_bytes(b"msg_\xff\xfe")?);
    let refused = verifier.verify(&headers, SPEC_BODY, now).unwrap_err();
    assert_eq!(malformed(&refused), Some("webhook-id"));
    let mut headers = spec_headers();
    headers.append("webhook-id", HeaderValue::from_static("msg_second"));
    let refused = verifier.verify(&headers, SPEC_BODY, now).unwrap_err();
    assert_eq!(malformed(&refused), Some("webhook-id"));
    assert!(refused.to_string().contains("more than once"), "{refused}");
    let mut headers = spec_headers();
    headers.insert("webhook-signature", HeaderValue::from_static(""));
    let refused = verifier.verify(&headers, SPEC_BODY, now).unwrap_err();
    assert_eq!(malformed(&refused), Some("webhook-signature"));

    // Signatures that do not decode match nothing.
    for signature in [
        "v1,", "v1", ",", "v1,====", "v1,AAAA", "v1,\t", "v1,,,,", " ",
    ] {
        let mut headers = spec_headers();
        headers.insert(
            "webhook-signature",
            HeaderValue::from_bytes(signature.as_bytes())?,
        );
        assert_eq!(
            verifier.verify(&headers, SPEC_BODY, now),
            Err(VerifyError::BadSignature),
            "{signature:?}"
        );
    }

    // Signed timestamps at the ends of i64, under any tolerance.
    let secret = Secret::parse(SPEC_SECRET)?;
    for (timestamp, tolerance) in [
        (i64::MAX, DEFAULT_TOLERANCE),
        (i64::MIN, DEFAULT_TOLERANCE),
        (i64::MAX, Duration::MAX),
        (i64::MIN, Duration::MAX),
    ] {
        let signature = sign(std::slice::from_ref(&secret), SPEC_ID, timestamp, SPEC_BODY);
        let headers = standard_headers(SPEC_ID, &timestamp.to_string(), &signature);
        let refused = spec_verifier()
            .tolerance(tolerance)
            .verify(&headers, SPEC_BODY, now)
            .unwrap_err();
        let expected = if timestamp > 0 {
            VerifyError::TimestampTooNew {
                timestamp,
                tolerance,
            }
        } else {
            VerifyError::TimestampTooOld {
                timestamp,
                tolerance,
            }
        };
        assert_eq!(refused, expected);
    }
    // And `now` at the ends of chrono's range.
    for now in [DateTime::<Utc>::MIN_UTC, DateTime::<Utc>::MAX_UTC] {
        assert!(verifier.verify(&spec_headers(), SPEC_BODY, now).is_err());
    }
    Ok(())
}

#[test]
fn every_refusal_is_an_error_with_a_status() {
    let refusals = [
        (VerifyError::MissingHeader { name: "webhook-id" }, 400),
        (
            VerifyError::MalformedHeader {
                name: "webhook-timestamp",
                reason: "empty".to_owned(),
            },
            400,
        ),
        (VerifyError::BadSignature, 401),
        (
            VerifyError::TimestampTooOld {
                timestamp: 1,
                tolerance: DEFAULT_TOLERANCE,
            },
            401,
        ),
        (
            VerifyError::TimestampTooNew {
                timestamp: 1,
                tolerance: DEFAULT_TOLERANCE,
            },
            401,
        ),
        (VerifyError::MissingEventId, 400),
    ];
    for (refusal, status) in refusals {
        assert_eq!(refusal.status(), status, "{refusal:?}");
        assert!(!refusal.to_string().is_empty());
        let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(refusal);
        assert!(boxed.source().is_none());
    }
}

// ---------- Stripe ----------

const STRIPE_SECRET: &str = "whsec_test";
const STRIPE_T: i64 = 1_700_000_000;
const STRIPE_BODY: &[u8] = br#"{"id":"evt_1"}"#;
// HMAC-SHA256 keyed with the bytes of "whsec_test" over
// `1700000000.{"id":"evt_1"}`, computed apart from this crate (Python's
// `hmac.new(b"whsec_test", b'1700000000.{"id":"evt_1"}', hashlib.sha256)`).
const STRIPE_V1: &str = "c89214b5b5da833daed6f0b8c5bb6bd58cea9022bd80ccc78230f3942d632925";

/// Stripe's documented scheme: HMAC-SHA256 keyed with the endpoint
/// secret's text, over `{t}.{body}`, in lowercase hex.
fn stripe_v1(secret: &str, t: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(format!("{t}.").as_bytes());
    mac.update(body);
    hex(&mac.finalize().into_bytes())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut text, byte| {
        write!(text, "{byte:02x}").unwrap();
        text
    })
}

fn stripe_headers(value: &str) -> HeaderMap {
    headers(&[("Stripe-Signature", value)])
}

#[test]
fn a_stripe_vector_of_the_documented_scheme_verifies() -> TestResult {
    assert_eq!(stripe_v1(STRIPE_SECRET, STRIPE_T, STRIPE_BODY), STRIPE_V1);
    let headers = stripe_headers(&format!("t={STRIPE_T},v1={STRIPE_V1}"));
    let verified: Verified =
        Verifier::stripe(STRIPE_SECRET).verify(&headers, STRIPE_BODY, at(STRIPE_T))?;
    assert_eq!(verified.id(), "evt_1");
    assert_eq!(verified.timestamp(), Some(at(STRIPE_T)));

    // Hex in capitals is the same signature.
    let headers = stripe_headers(&format!("t={STRIPE_T},v1={}", STRIPE_V1.to_uppercase()));
    Verifier::stripe(STRIPE_SECRET).verify(&headers, STRIPE_BODY, at(STRIPE_T))?;
    Ok(())
}

#[test]
fn a_stripe_event_with_fields_and_several_signatures() -> TestResult {
    let body = br#"{"id":"evt_1NqL2y2eZvKYlo2C","object":"event","type":"payment_intent.succeeded","data":{"object":{"id":"pi_3"}}}"#;
    let t = 1_700_000_123;
    let good = stripe_v1(STRIPE_SECRET, t, body);
    let old_secret = stripe_v1("whsec_old", t, body);
    let header = format!("t={t},v1={old_secret},v1={good},v0={old_secret}");
    let verified = Verifier::stripe(STRIPE_SECRET).verify(&stripe_headers(&header), body, at(t))?;
    assert_eq!(verified.id(), "evt_1NqL2y2eZvKYlo2C");

    // A valid signature under `v0` alone, or none at all: refused.
    for header in [
        format!("t={t},v0={good}"),
        format!("t={t}"),
        format!("t={t},v1=zz"),
    ] {
        assert_eq!(
            Verifier::stripe(STRIPE_SECRET).verify(&stripe_headers(&header), body, at(t)),
            Err(VerifyError::BadSignature),
            "{header}"
        );
    }
    Ok(())
}

#[test]
fn stripe_keys_with_the_secret_text_not_a_decoded_key() {
    // A Standard Webhooks verifier would decode the base64 after `whsec_`;
    // Stripe's key is the whole text.
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let decoded = BASE64.decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
    let mut mac = Hmac::<Sha256>::new_from_slice(&decoded).unwrap();
    mac.update(format!("{STRIPE_T}.").as_bytes());
    mac.update(STRIPE_BODY);
    let with_decoded = hex(&mac.finalize().into_bytes());
    let verifier = Verifier::stripe(secret);
    let refused = verifier.verify(
        &stripe_headers(&format!("t={STRIPE_T},v1={with_decoded}")),
        STRIPE_BODY,
        at(STRIPE_T),
    );
    assert_eq!(refused, Err(VerifyError::BadSignature));
    let header = format!(
        "t={STRIPE_T},v1={}",
        stripe_v1(secret, STRIPE_T, STRIPE_BODY)
    );
    assert!(
        verifier
            .verify(&stripe_headers(&header), STRIPE_BODY, at(STRIPE_T))
            .is_ok()
    );
}

#[test]
fn stripe_refuses_a_wrong_secret_and_a_changed_body() {
    let headers = stripe_headers(&format!("t={STRIPE_T},v1={STRIPE_V1}"));
    assert_eq!(
        Verifier::stripe("whsec_other").verify(&headers, STRIPE_BODY, at(STRIPE_T)),
        Err(VerifyError::BadSignature)
    );
    assert_eq!(
        Verifier::stripe("").verify(&headers, STRIPE_BODY, at(STRIPE_T)),
        Err(VerifyError::BadSignature)
    );
    assert_eq!(
        Verifier::stripe(STRIPE_SECRET).verify(&headers, br#"{"id":"evt_2"}"#, at(STRIPE_T)),
        Err(VerifyError::BadSignature)
    );
}

#[test]
fn stripe_timestamps_at_the_edge_of_the_tolerance() -> TestResult {
    let headers = stripe_headers(&format!("t={STRIPE_T},v1={STRIPE_V1}"));
    let verifier = Verifier::stripe(STRIPE_SECRET);
    let sent = at(STRIPE_T);
    verifier.verify(&headers, STRIPE_BODY, sent + TimeDelta::seconds(300))?;
    verifier.verify(&headers, STRIPE_BODY, sent - TimeDelta::seconds(300))?;
    assert_eq!(
        verifier.verify(&headers, STRIPE_BODY, sent + TimeDelta::seconds(301)),
        Err(VerifyError::TimestampTooOld {
            timestamp: STRIPE_T,
            tolerance: Duration::from_secs(300),
        })
    );
    assert_eq!(
        verifier.verify(&headers, STRIPE_BODY, sent - TimeDelta::seconds(301)),
        Err(VerifyError::TimestampTooNew {
            timestamp: STRIPE_T,
            tolerance: Duration::from_secs(300),
        })
    );
    let wide = Verifier::stripe(STRIPE_SECRET).tolerance(Duration::from_secs(3600));
    wide.verify(&headers, STRIPE_BODY, sent + TimeDelta::seconds(3600))?;
    assert!(matches!(
        wide.verify(&headers, STRIPE_BODY, sent + TimeDelta::seconds(3601)),
        Err(VerifyError::TimestampTooOld { .. })
    ));
    Ok(())
}

#[test]
fn a_stripe_body_without_a_string_id_is_refused() {
    for body in [
        &br#"{"object":"event"}"#[..],
        br#"{"id":42}"#,
        br#"{"id":null}"#,
        br#"{"id":""}"#,
        br#"{"data":{"id":"evt_nested"}}"#,
        br#"["evt_1"]"#,
        br#""evt_1""#,
        b"not json",
        b"",
        &[0xff, 0xfe],
    ] {
        let header = format!(
            "t={STRIPE_T},v1={}",
            stripe_v1(STRIPE_SECRET, STRIPE_T, body)
        );
        let refused = Verifier::stripe(STRIPE_SECRET)
            .verify(&stripe_headers(&header), body, at(STRIPE_T))
            .unwrap_err();
        assert_eq!(refused, VerifyError::MissingEventId, "{body:?}");
        assert_eq!(refused.status(), 400);
    }
}

#[test]
fn malformed_stripe_headers_are_refused() {
    let verifier = Verifier::stripe(STRIPE_SECRET);
    assert_eq!(
        verifier.verify(&HeaderMap::new(), STRIPE_BODY, at(STRIPE_T)),
        Err(VerifyError::MissingHeader {
            name: "stripe-signature"
        })
    );
    for header in [
        format!("v1={STRIPE_V1}"),
        format!("t=soon,v1={STRIPE_V1}"),
        format!("t=,v1={STRIPE_V1}"),
        format!("t=99999999999999999999,v1={STRIPE_V1}"),
        format!("t={STRIPE_T},t={STRIPE_T},v1={STRIPE_V1}"),
        "garbage".to_owned(),
    ] {
        let refused = verifier
            .verify(&stripe_headers(&header), STRIPE_BODY, at(STRIPE_T))
            .unwrap_err();
        assert_eq!(
            malformed(&refused),
            Some("stripe-signature"),
            "{header}: {refused}"
        );
    }
}

// ---------- GitHub ----------

// GitHub's documentation ("Validating webhook deliveries").
const GITHUB_SECRET: &str = "It's a Secret to Everybody";
const GITHUB_BODY: &[u8] = b"Hello, World!";
const GITHUB_SIGNATURE: &str =
    "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
const GITHUB_DELIVERY: &str = "72d3162e-cc78-11e3-81ab-4c9367dc0958";

fn github_headers() -> HeaderMap {
    headers(&[
        ("X-Hub-Signature-256", GITHUB_SIGNATURE),
        ("X-GitHub-Delivery", GITHUB_DELIVERY),
        ("X-GitHub-Event", "push"),
    ])
}

#[test]
fn githubs_documented_vector_verifies() -> TestResult {
    let verified = Verifier::github(GITHUB_SECRET).verify(&github_headers(), GITHUB_BODY, at(0))?;
    assert_eq!(verified.id(), GITHUB_DELIVERY);
    assert_eq!(verified.timestamp(), None);
    // No timestamp is signed: the tolerance does not apply.
    let far = at(4_102_444_800); // 2100-01-01
    Verifier::github(GITHUB_SECRET)
        .tolerance(Duration::ZERO)
        .verify(&github_headers(), GITHUB_BODY, far)?;
    Ok(())
}

#[test]
fn github_refuses_a_wrong_secret_and_a_changed_body() {
    let now = at(0);
    assert_eq!(
        Verifier::github("It's a secret to everybody").verify(&github_headers(), GITHUB_BODY, now),
        Err(VerifyError::BadSignature)
    );
    assert_eq!(
        Verifier::github("").verify(&github_headers(), GITHUB_BODY, now),
        Err(VerifyError::BadSignature)
    );
    assert_eq!(
        Verifier::github(GITHUB_SECRET).verify(&github_headers(), b"Hello, World?", now),
        Err(VerifyError::BadSignature)
    );
    for signature in [
        "sha256=",
        "sha256=zz",
        "sha256=757107ea",
        &GITHUB_SIGNATURE.to_uppercase().replace("SHA256", "sha256")[..],
    ] {
        let mut headers = github_headers();
        headers.insert(
            "x-hub-signature-256",
            HeaderValue::from_str(signature).unwrap(),
        );
        let answer = Verifier::github(GITHUB_SECRET).verify(&headers, GITHUB_BODY, now);
        if signature.len() == GITHUB_SIGNATURE.len() {
            assert!(answer.is_ok(), "capital hex digits: {answer:?}");
        } else {
            assert_eq!(answer, Err(VerifyError::BadSignature), "{signature}");
        }
    }
}

#[test]
fn github_headers_missing_or_malformed() {
    let verifier = Verifier::github(GITHUB_SECRET);
    for name in ["x-github-delivery", "x-hub-signature-256"] {
        let mut headers = github_headers();
        headers.remove(name);
        let refused = verifier.verify(&headers, GITHUB_BODY, at(0)).unwrap_err();
        assert_eq!(refused, VerifyError::MissingHeader { name });
        assert_eq!(refused.status(), 400);
    }
    // The SHA-1 header's form is not this scheme's.
    let mut headers = github_headers();
    headers.insert(
        "x-hub-signature-256",
        HeaderValue::from_static("sha1=01dc10d0c83e72ed246219cdd91669667fe2ca59"),
    );
    let refused = verifier.verify(&headers, GITHUB_BODY, at(0)).unwrap_err();
    assert_eq!(malformed(&refused), Some("x-hub-signature-256"));
    assert_eq!(refused.status(), 400);
}
