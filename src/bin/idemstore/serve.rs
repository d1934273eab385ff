//! `idemstore console STORE [--listen ADDR] [--allow-writes] [--token-file
//! F]`: serves the operator console (`idemstore::console`) of a store file
//! or a PostgreSQL store until interrupted: its outbox, inboxes and
//! idempotency keys.
//!
//! It listens on loopback (`127.0.0.1:8080`) unless told otherwise, and
//! refuses an address other machines can reach without a token: with
//! `--token-file`, every request must carry `Authorization: Bearer TOKEN`
//! (the file's first line), or it is a 401.

use std::net::SocketAddr;
use std::path::Path;

use crate::target::Target;
use crate::{Failure, Outcome};

/// What `console` was asked to serve.
#[cfg_attr(
    not(feature = "console"),
    expect(
        dead_code,
        reason = "a build without the console reads the address only"
    )
)]
pub(crate) struct Serve<'a> {
    pub(crate) store: &'a Target,
    pub(crate) schema: Option<&'a str>,
    pub(crate) listen: SocketAddr,
    pub(crate) allow_writes: bool,
    pub(crate) token_file: Option<&'a Path>,
}

/// The token every request must carry, read from `file` (its first line,
/// trimmed); `None` without a file. An address other machines can reach
/// needs one.
fn token(serve: &Serve<'_>) -> Result<Option<String>, Failure> {
    let token = match serve.token_file {
        Some(file) => {
            let text = std::fs::read_to_string(file)
                .map_err(|e| Failure(format!("cannot read {}: {e}", file.display())))?;
            let token = text.lines().next().unwrap_or_default().trim().to_owned();
            if token.len() < 16 {
                return Err(Failure(format!(
                    "{}: the token must be at least 16 characters on its first line",
                    file.display()
                )));
            }
            Some(token)
        }
        None => None,
    };
    if token.is_none() && !serve.listen.ip().is_loopback() {
        return Err(Failure(format!(
            "{} is reachable from other machines: give a token with --token-file (every \
             request must then carry it as `Authorization: Bearer TOKEN`), or listen on \
             loopback (127.0.0.1)",
            serve.listen
        )));
    }
    Ok(token)
}

#[cfg(not(feature = "console"))]
pub(crate) fn run(serve: &Serve<'_>) -> Result<Outcome, Failure> {
    token(serve)?;
    Err(Failure(
        "this idemstore was built without the console; install it with \
         `cargo install idemstore --features cli,console`"
            .into(),
    ))
}

#[cfg(feature = "console")]
pub(crate) fn run(serve: &Serve<'_>) -> Result<Outcome, Failure> {
    use axum::extract::Request;
    use axum::http::{StatusCode, header};
    use axum::middleware::Next;
    use axum::response::{IntoResponse, Response};
    use idemstore::console::Console;

    use crate::handle::{StoreHandle, open_store};
    use crate::output::out;

    let token = token(serve)?;
    let store = open_store(serve.store, serve.schema)?;
    let console = match &store {
        StoreHandle::File(s) => Console::new(s.outbox()).store(s.clone()),
        #[cfg(feature = "postgres")]
        StoreHandle::Postgres(s) => Console::new(s.outbox()).store(s.clone()),
    }
    .allow_writes(serve.allow_writes);
    let mut router = console.router();
    if let Some(token) = token {
        let expected = format!("Bearer {token}");
        router = router.layer(axum::middleware::from_fn(
            move |req: Request, next: Next| {
                let allowed = req
                    .headers()
                    .get(header::AUTHORIZATION)
                    .is_some_and(|v| v.as_bytes() == expected.as_bytes());
                async move {
                    if allowed {
                        next.run(req).await
                    } else {
                        let refusal: Response = (
                            StatusCode::UNAUTHORIZED,
                            [(header::WWW_AUTHENTICATE, "Bearer")],
                            "a token is needed: Authorization: Bearer TOKEN\n",
                        )
                            .into_response();
                        refusal
                    }
                }
            },
        ));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Failure(format!("cannot start the server's runtime: {e}")))?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(serve.listen)
            .await
            .map_err(|e| Failure(format!("cannot listen on {}: {e}", serve.listen)))?;
        let at = listener.local_addr()?;
        out!(
            "serving the console of {} at http://{at}/ ({}); stop with Ctrl-C",
            serve.store,
            if serve.allow_writes {
                "actions allowed"
            } else {
                "read-only"
            }
        );
        axum::serve(listener, router)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .map_err(|e| Failure(format!("the server failed: {e}")))
    })?;
    Ok(Outcome::Ok)
}
