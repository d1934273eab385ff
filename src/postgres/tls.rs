//! Where the store's connections go and how they are secured: the
//! connection string as libpq reads it, `sslmode` and `sslrootcert`
//! included, which `tokio-postgres` alone does not take.
//!
//! The modes and what each checks are in the module docs ([TLS](super#tls)).
//!
//! `sslrootcert` is a PEM file of one or more root certificates; without
//! it (or with `sslrootcert=system`) the roots are the Mozilla set compiled
//! into `webpki-roots`. TLS is rustls (with the `ring` provider) through
//! `tokio-postgres-rustls`, all pure Rust: nothing to install, no OpenSSL.
//! It is compiled with the feature `postgres-tls`; without it a connection
//! string that asks for TLS (`require`, `verify-*`, `sslrootcert`) is
//! refused with [`Error::InvalidInput`], and `prefer` connects in plain.
//! TLS runs over TCP only: a unix-socket host is always plain, as in libpq.

use tokio_postgres::Config;

use super::conn::bounded_config;
use crate::error::{Error, Result};

/// A server's address, with how to secure the connections to it.
#[derive(Clone)]
pub(crate) struct Address {
    /// The connection string, less what `tokio-postgres` does not take.
    pub(super) config: Config,
    pub(super) tls: Tls,
}

impl Address {
    /// The same address, its connections bounded as every connection of
    /// the store is ([`bounded_config`]).
    pub(super) fn bounded(&self) -> Address {
        Address {
            config: bounded_config(&self.config),
            tls: self.tls.clone(),
        }
    }
}

impl std::fmt::Debug for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Address")
            .field("hosts", &self.config.get_hosts())
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

/// How connections are secured.
#[derive(Clone)]
pub(super) enum Tls {
    /// Plain: `sslmode=disable`, or `prefer` in a build without TLS.
    Plain,
    /// TLS through rustls, as the mode asks.
    #[cfg(feature = "postgres-tls")]
    Rustls(tokio_postgres_rustls::MakeRustlsConnect),
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Tls::Plain => "Plain",
            #[cfg(feature = "postgres-tls")]
            Tls::Rustls(_) => "Rustls",
        })
    }
}

/// `e`, a failure to connect, with what a refused server certificate
/// means: rustls names the reason, not what to do about it.
pub(super) fn explained(e: Error) -> Error {
    let Error::Postgres {
        code,
        mut message,
        source,
    } = e
    else {
        return e;
    };
    if message.contains("UnknownIssuer") {
        message.push_str(
            " (the server's certificate is not signed by a root of `sslrootcert`, or of the \
             built-in Mozilla roots without one)",
        );
    } else if message.contains("NotValidForName") || message.contains("not valid for name") {
        message.push_str(
            " (the server's certificate does not name the host connected to: connect by a name \
             it holds, or check the chain only with sslmode=verify-ca)",
        );
    }
    Error::Postgres {
        code,
        message,
        source,
    }
}

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<SslMode> {
        Ok(match value {
            "disable" => SslMode::Disable,
            // `allow` tries plain first, then TLS; `prefer` tries TLS
            // first, then plain: the same connections succeed, and more of
            // them are encrypted.
            "allow" | "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(Error::invalid(
                    "connection string",
                    format!(
                        "sslmode={other} is not one of disable, allow, prefer, require, \
                         verify-ca, verify-full"
                    ),
                ));
            }
        })
    }

    /// The mode `tokio-postgres` is told: it does the negotiation, the
    /// certificate checks are the connector's.
    fn negotiation(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => "require",
        }
    }
}

/// The TLS settings taken out of a connection string.
#[derive(Debug, Default, PartialEq, Eq)]
struct Taken {
    sslmode: Option<String>,
    sslrootcert: Option<String>,
    /// A client-certificate setting, which the store does not support.
    client_cert: Option<&'static str>,
}

impl Taken {
    /// Takes `key`'s `value` if it is a TLS setting; `false` if it is not.
    fn take(&mut self, key: &str, value: String) -> bool {
        match key {
            "sslmode" => self.sslmode = Some(value),
            "sslrootcert" => self.sslrootcert = Some(value),
            "sslcert" => self.client_cert = Some("sslcert"),
            "sslkey" => self.client_cert = Some("sslkey"),
            "sslpassword" => self.client_cert = Some("sslpassword"),
            _ => return false,
        }
        true
    }
}

/// The address `url` names, a libpq connection string (`key=value` pairs)
/// or URL, with its TLS settings.
///
/// # Errors
///
/// [`Error::InvalidInput`] for a connection string that does not parse,
/// an unknown `sslmode`, a client certificate (not supported), TLS asked
/// for in a build without it, or a `sslrootcert` that cannot be read or
/// holds no certificate.
pub(crate) fn address(url: &str) -> Result<Address> {
    let (rest, taken) = take_tls(url)?;
    if let Some(key) = taken.client_cert {
        return Err(Error::invalid(
            "connection string",
            format!("{key}: client certificates are not supported; authenticate with a password"),
        ));
    }
    let mode = match &taken.sslmode {
        Some(m) => SslMode::parse(m)?,
        None => SslMode::Prefer,
    };
    let with_mode = append(&rest, "sslmode", mode.negotiation());
    let config: Config = with_mode
        .parse()
        .map_err(|e: tokio_postgres::Error| Error::invalid("connection string", e.to_string()))?;
    let tls = connector(mode, taken.sslrootcert.as_deref())?;
    Ok(Address { config, tls })
}

#[cfg(not(feature = "postgres-tls"))]
fn connector(mode: SslMode, root: Option<&str>) -> Result<Tls> {
    let asked = match (mode, root) {
        (SslMode::Disable | SslMode::Prefer, None) => return Ok(Tls::Plain),
        (_, Some(_)) => "sslrootcert".to_owned(),
        (mode, None) => format!("sslmode={}", mode_name(mode)),
    };
    Err(Error::invalid(
        "connection string",
        format!(
            "{asked} needs TLS, which this build leaves out: enable idemstore's feature \
             `postgres-tls`"
        ),
    ))
}

#[cfg(not(feature = "postgres-tls"))]
fn mode_name(mode: SslMode) -> &'static str {
    match mode {
        SslMode::Disable => "disable",
        SslMode::Prefer => "prefer",
        SslMode::Require => "require",
        SslMode::VerifyCa => "verify-ca",
        SslMode::VerifyFull => "verify-full",
    }
}

#[cfg(feature = "postgres-tls")]
fn connector(mode: SslMode, root: Option<&str>) -> Result<Tls> {
    use verify::Check;
    let check = match (mode, root) {
        (SslMode::Disable, _) => return Ok(Tls::Plain),
        (SslMode::Prefer, _) | (SslMode::Require, None) => Check::Nothing,
        (SslMode::Require | SslMode::VerifyCa, _) => Check::Chain,
        (SslMode::VerifyFull, _) => Check::ChainAndName,
    };
    let config = verify::client_config(check, root)?;
    Ok(Tls::Rustls(tokio_postgres_rustls::MakeRustlsConnect::new(
        config,
    )))
}

#[cfg(feature = "postgres-tls")]
mod verify {
    //! rustls client configurations for the three levels of checking.

    use std::sync::Arc;

    use rustls::client::WebPkiServerVerifier;
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{
        CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
    };

    use crate::error::{Error, Result};

    /// What of the server's certificate is checked.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) enum Check {
        /// Nothing (`prefer`, `require`): the connection is encrypted, and
        /// open to an attacker in the middle.
        Nothing,
        /// That a root signed it (`verify-ca`).
        Chain,
        /// That a root signed it for the host connected to (`verify-full`).
        ChainAndName,
    }

    pub(super) fn client_config(check: Check, root: Option<&str>) -> Result<ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error(&e))?;
        let verifier: Arc<dyn ServerCertVerifier> = match check {
            Check::Nothing => Arc::new(Lenient {
                chain: None,
                provider,
            }),
            Check::Chain | Check::ChainAndName => {
                let roots = Arc::new(roots(root)?);
                let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                    .build()
                    .map_err(|e| {
                        Error::invalid("connection string", format!("sslrootcert: {e}"))
                    })?;
                if check == Check::Chain {
                    Arc::new(Lenient {
                        chain: Some(webpki),
                        provider,
                    })
                } else {
                    webpki
                }
            }
        };
        Ok(builder
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth())
    }

    fn tls_error(e: &rustls::Error) -> Error {
        Error::invalid("connection string", format!("TLS: {e}"))
    }

    /// The roots of `sslrootcert` (a PEM file), or the compiled-in Mozilla
    /// set without one or for `system`.
    fn roots(root: Option<&str>) -> Result<RootCertStore> {
        let mut store = RootCertStore::empty();
        match root {
            None | Some("system") => {
                store.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
            }
            Some(path) => {
                let bad = |why: String| {
                    Error::invalid("connection string", format!("sslrootcert={path}: {why}"))
                };
                let certs = CertificateDer::pem_file_iter(path)
                    .map_err(|e| bad(e.to_string()))?
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|e| bad(e.to_string()))?;
                if certs.is_empty() {
                    return Err(bad("no certificate in the file".into()));
                }
                for cert in certs {
                    store.add(cert).map_err(|e| bad(e.to_string()))?;
                }
            }
        }
        Ok(store)
    }

    /// The certificate checks of `verify-ca` (`chain`: the chain, any
    /// name) and of `prefer` and `require` without `sslrootcert` (`None`:
    /// none, as in libpq). Either way the handshake's signatures are
    /// checked, so the session is with the certificate's key holder.
    #[derive(Debug)]
    struct Lenient {
        chain: Option<Arc<WebPkiServerVerifier>>,
        provider: Arc<CryptoProvider>,
    }

    impl ServerCertVerifier for Lenient {
        fn verify_server_cert(
            &self,
            end_entity: &CertificateDer<'_>,
            intermediates: &[CertificateDer<'_>],
            server_name: &ServerName<'_>,
            ocsp_response: &[u8],
            now: UnixTime,
        ) -> std::result::Result<ServerCertVerified, rustls::Error> {
            let Some(chain) = &self.chain else {
                return Ok(ServerCertVerified::assertion());
            };
            match chain.verify_server_cert(
                end_entity,
                intermediates,
                server_name,
                ocsp_response,
                now,
            ) {
                // The name is checked after the chain: a certificate for
                // another name passed every other check.
                Err(rustls::Error::InvalidCertificate(
                    CertificateError::NotValidForName
                    | CertificateError::NotValidForNameContext { .. },
                )) => Ok(ServerCertVerified::assertion()),
                other => other,
            }
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls12_signature(
                message,
                cert,
                dss,
                &self.provider.signature_verification_algorithms,
            )
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls13_signature(
                message,
                cert,
                dss,
                &self.provider.signature_verification_algorithms,
            )
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.provider
                .signature_verification_algorithms
                .supported_schemes()
        }
    }
}

/// Splits the TLS settings out of `url`: the rest, as `tokio-postgres`
/// takes it, and the settings.
fn take_tls(url: &str) -> Result<(String, Taken)> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(take_from_url(url))
    } else {
        take_from_pairs(url)
    }
}

/// A URL's query parameters: `…?sslmode=verify-full&sslrootcert=/ca.pem`.
fn take_from_url(url: &str) -> (String, Taken) {
    let mut taken = Taken::default();
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), taken);
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|param| {
            let (key, value) = param.split_once('=').unwrap_or((param, ""));
            !taken.take(key, percent_decoded(value))
        })
        .collect();
    if kept.is_empty() {
        (base.to_owned(), taken)
    } else {
        (format!("{base}?{}", kept.join("&")), taken)
    }
}

/// `%XX` escapes decoded (others kept as they are).
fn percent_decoded(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let hex = bytes
            .get(i + 1..i + 3)
            .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        if let (b'%', Some(decoded)) = (b, hex) {
            out.push(decoded);
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `key=value` pairs, values bare or single-quoted (with `\'` and `\\`), as
/// libpq writes them: the pairs that are not TLS settings are kept as
/// written.
fn take_from_pairs(url: &str) -> Result<(String, Taken)> {
    let mut taken = Taken::default();
    let mut kept: Vec<&str> = Vec::new();
    let mut rest = url.trim_start();
    while !rest.is_empty() {
        let (key, after_key) = rest
            .split_once('=')
            .map(|(k, v)| (k.trim_end(), v.trim_start()))
            .ok_or_else(|| {
                Error::invalid(
                    "connection string",
                    format!("{rest:?} is not a key=value pair"),
                )
            })?;
        let (value, len) = pair_value(after_key)?;
        let pair_len = rest.len() - after_key.len() + len;
        let pair = rest.get(..pair_len).unwrap_or(rest);
        if !taken.take(key, value) {
            kept.push(pair);
        }
        rest = rest.get(pair_len..).unwrap_or("").trim_start();
    }
    Ok((kept.join(" "), taken))
}

/// The value at the start of `s` and how many bytes of `s` it took.
fn pair_value(s: &str) -> Result<(String, usize)> {
    let Some(quoted) = s.strip_prefix('\'') else {
        let end = s.find(char::is_whitespace).unwrap_or(s.len());
        return Ok((s.get(..end).unwrap_or(s).to_owned(), end));
    };
    let mut value = String::new();
    let mut chars = quoted.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' => {
                if let Some((_, escaped)) = chars.next() {
                    value.push(escaped);
                }
            }
            '\'' => return Ok((value, i + 2)),
            c => value.push(c),
        }
    }
    Err(Error::invalid(
        "connection string",
        "a quoted value has no closing quote",
    ))
}

/// `url` with `key=value` added, in its own form.
fn append(url: &str, key: &str, value: &str) -> String {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}{key}={value}")
    } else if url.trim().is_empty() {
        format!("{key}={value}")
    } else {
        format!("{url} {key}={value}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taken(mode: &str, root: Option<&str>) -> Taken {
        Taken {
            sslmode: Some(mode.into()),
            sslrootcert: root.map(Into::into),
            client_cert: None,
        }
    }

    #[test]
    fn tls_settings_come_out_of_urls_and_pairs_and_the_rest_stays() {
        let (rest, t) = take_tls(
            "postgresql://app:pw@db.example:5433/app?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x",
        )
        .unwrap();
        assert_eq!(
            rest,
            "postgresql://app:pw@db.example:5433/app?application_name=x"
        );
        assert_eq!(t, taken("verify-full", Some("/etc/ca.pem")));
        let (rest, t) = take_tls("postgres://db/app?sslmode=require").unwrap();
        assert_eq!(
            (rest.as_str(), t),
            ("postgres://db/app", taken("require", None))
        );

        let (rest, t) = take_tls(
            "host=db.example  sslmode = verify-ca user=app sslrootcert='/my certs/ca.pem' password='it\\'s'",
        )
        .unwrap();
        assert_eq!(rest, "host=db.example user=app password='it\\'s'");
        assert_eq!(t, taken("verify-ca", Some("/my certs/ca.pem")));
        assert_eq!(
            take_tls("host=/run/postgresql").unwrap().1,
            Taken::default()
        );
    }

    #[test]
    fn bad_tls_settings_are_refused_with_their_reason() {
        for (url, says) in [
            ("host=db sslmode=always", "sslmode=always"),
            ("host=db sslcert=/c.pem", "client certificates"),
            ("postgres://db/app?sslkey=/k.pem", "client certificates"),
            ("host=db password='open", "closing quote"),
            ("host", "key=value"),
        ] {
            let err = address(url).unwrap_err();
            assert!(matches!(err, Error::InvalidInput { .. }), "{url}: {err}");
            assert!(err.to_string().contains(says), "{url}: {err}");
        }
    }

    #[test]
    fn the_mode_given_to_tokio_postgres_negotiates_as_asked() {
        use tokio_postgres::config::SslMode as Tp;
        let mode = |url: &str| address(url).map(|a| a.config.get_ssl_mode());
        assert_eq!(mode("host=/tmp").unwrap(), Tp::Prefer);
        assert_eq!(mode("host=/tmp sslmode=disable").unwrap(), Tp::Disable);
        assert_eq!(mode("postgres://db/app?sslmode=allow").unwrap(), Tp::Prefer);
        if cfg!(feature = "postgres-tls") {
            assert_eq!(mode("host=db sslmode=verify-full").unwrap(), Tp::Require);
            assert_eq!(mode("host=db sslmode=verify-ca").unwrap(), Tp::Require);
            let missing = address("host=db sslmode=verify-ca sslrootcert=/nonexistent.pem");
            assert!(
                missing
                    .unwrap_err()
                    .to_string()
                    .contains("/nonexistent.pem")
            );
        } else {
            let err = address("host=db sslmode=verify-full").unwrap_err();
            assert!(err.to_string().contains("postgres-tls"), "{err}");
            let err = address("host=db sslrootcert=/ca.pem").unwrap_err();
            assert!(err.to_string().contains("sslrootcert"), "{err}");
        }
    }
}
