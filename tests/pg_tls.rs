//! PostgreSQL over TLS: a server of the test's own, started with `ssl=on`
//! on loopback TCP and a certificate the test makes (for `localhost`,
//! signed by a root of its own), reached with each `sslmode`: `verify-full`
//! with the right root connects, with a wrong host name or root it is
//! refused with a clear error; `verify-ca` takes any name; `require`
//! connects without verification (and, with a `sslrootcert`, verifies as
//! `verify-ca`, as libpq does); `prefer` encrypts; `disable` does not. The
//! pool's connections and the outbox's listening connection both go
//! through TLS.
//!
//! It needs the server's binaries (`IDEMSTORE_TEST_PGBIN`, set by
//! `.ci/postgres run`): without them the test says so and passes, except
//! under `CI=true`.
#![cfg(feature = "postgres-tls")]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use idemstore::postgres::PgStore;
use idemstore::{Error, NewEntry};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A root certificate (PEM) and the issuer that signs with it.
fn root(name: &str) -> Result<(String, Issuer<'static, KeyPair>), rcgen::Error> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), Issuer::new(params, key)))
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// `bin/program` as the `postgres` user when the tests run as root.
fn as_postgres(bin: &str, program: &str) -> Command {
    let path = format!("{bin}/{program}");
    if is_root() {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--", &path]);
        cmd
    } else {
        Command::new(path)
    }
}

/// A server of the test's own, stopped and removed when dropped.
struct TlsServer {
    bin: String,
    dir: PathBuf,
    port: u16,
}

impl TlsServer {
    /// `None` when the server's binaries are not known here.
    fn start(
        server_cert: &str,
        server_key: &str,
    ) -> Result<Option<TlsServer>, Box<dyn std::error::Error>> {
        let Some(bin) = std::env::var("IDEMSTORE_TEST_PGBIN")
            .ok()
            .filter(|b| !b.trim().is_empty())
        else {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "CI=true but IDEMSTORE_TEST_PGBIN is not set: run under .ci/postgres"
            );
            eprintln!("skipped: IDEMSTORE_TEST_PGBIN is not set (.ci/postgres sets it)");
            return Ok(None);
        };
        let dir = std::env::temp_dir().join(format!("idemstore-pg-tls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let server = TlsServer {
            bin,
            dir: dir.clone(),
            port: free_port()?,
        };
        if is_root() {
            run(Command::new("chown").args(["postgres:", &dir.display().to_string()]))?;
        }
        let data = dir.join("data");
        run(as_postgres(&server.bin, "initdb").args([
            "-D",
            &data.display().to_string(),
            "-A",
            "trust",
            "-U",
            "postgres",
        ]))?;
        // The server's certificate and key, owned by the server's user.
        for (name, pem, mode) in [
            ("server.crt", server_cert, "644"),
            ("server.key", server_key, "600"),
        ] {
            let path = data.join(name);
            std::fs::write(&path, pem)?;
            if is_root() {
                run(Command::new("chown").args(["postgres:", &path.display().to_string()]))?;
            }
            run(Command::new("chmod").args([mode, &path.display().to_string()]))?;
        }
        let opts = format!(
            "-c ssl=on -c listen_addresses=127.0.0.1 -p {} -k {}",
            server.port,
            dir.display()
        );
        run(as_postgres(&server.bin, "pg_ctl").args([
            "-D",
            &data.display().to_string(),
            "-l",
            &dir.join("server.log").display().to_string(),
            "-o",
            &opts,
            "-w",
            "start",
        ]))?;
        Ok(Some(server))
    }

    /// A connection string to the server at `host` with `extra` settings.
    fn url(&self, host: &str, extra: &str) -> String {
        format!(
            "host={host} port={} user=postgres dbname=postgres connect_timeout=10 {extra}",
            self.port
        )
    }
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        let data = self.dir.join("data").display().to_string();
        let _ = as_postgres(&self.bin, "pg_ctl")
            .args(["-D", &data, "-m", "immediate", "-w", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run(cmd: &mut Command) -> Result<(), Box<dyn std::error::Error>> {
    let out = cmd.output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr)).into())
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Whether the store's connections are encrypted, as the server sees them.
fn encrypted(store: &PgStore) -> Result<bool, Error> {
    store.read(|tx| {
        let row = tx.query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )?;
        Ok(row.get::<_, bool>(0))
    })
}

fn write_file(dir: &Path, name: &str, text: &str) -> std::io::Result<String> {
    let path = dir.join(name);
    std::fs::write(&path, text)?;
    Ok(path.display().to_string())
}

#[test]
fn each_sslmode_connects_or_refuses_as_libpq_does() -> TestResult {
    let (right_root, issuer) = root("idemstore test root")?;
    let (wrong_root, _) = root("another root")?;
    let server_key = KeyPair::generate()?;
    let server_cert =
        CertificateParams::new(vec!["localhost".to_owned()])?.signed_by(&server_key, &issuer)?;
    let Some(server) = TlsServer::start(&server_cert.pem(), &server_key.serialize_pem())? else {
        return Ok(());
    };
    let roots = tempfile::tempdir()?;
    let right = write_file(roots.path(), "right.pem", &right_root)?;
    let wrong = write_file(roots.path(), "wrong.pem", &wrong_root)?;

    // verify-full with the right root, by the certificate's name: TLS, and
    // the store works, its listening connection included.
    let url = server.url(
        "localhost",
        &format!("sslmode=verify-full sslrootcert={right}"),
    );
    let store = PgStore::connect(&url)?;
    assert!(encrypted(&store)?, "verify-full connects with TLS");
    assert!(store.inbox("tls")?.claim("e1", chrono::Utc::now())?);
    let outbox = store.outbox();
    let woken = outbox.subscribe();
    // The listener connects, then signals once; the enqueue after it is
    // seen through its `LISTEN` over TLS.
    woken.recv_timeout(Duration::from_secs(10))?;
    outbox.enqueue(NewEntry::new("c", "d", "k", vec![1]), chrono::Utc::now())?;
    woken.recv_timeout(Duration::from_secs(10))?;
    drop(store);

    // The same by URL.
    let url = format!(
        "postgresql://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert={right}",
        server.port
    );
    assert!(encrypted(&PgStore::connect(&url)?)?);

    // A wrong host name: refused by verify-full, taken by verify-ca.
    let by_ip = server.url(
        "127.0.0.1",
        &format!("sslmode=verify-full sslrootcert={right}"),
    );
    let refused = PgStore::connect(&by_ip).unwrap_err();
    let text = refused.to_string();
    assert!(
        text.contains("not valid for name") && text.contains("does not name the host"),
        "{text}"
    );
    let url = server.url(
        "127.0.0.1",
        &format!("sslmode=verify-ca sslrootcert={right}"),
    );
    assert!(encrypted(&PgStore::connect(&url)?)?);

    // A wrong root: refused by verify-full, verify-ca and require with it.
    for mode in ["verify-full", "verify-ca", "require"] {
        let url = server.url("localhost", &format!("sslmode={mode} sslrootcert={wrong}"));
        let text = PgStore::connect(&url).unwrap_err().to_string();
        assert!(
            text.contains("UnknownIssuer") && text.contains("not signed by a root"),
            "{mode}: {text}"
        );
    }

    // require without a root: TLS, unverified; prefer: TLS; disable: plain.
    for (extra, tls) in [
        ("sslmode=require", true),
        ("", true),
        ("sslmode=prefer", true),
        ("sslmode=disable", false),
    ] {
        let store = PgStore::connect(&server.url("127.0.0.1", extra))?;
        assert_eq!(encrypted(&store)?, tls, "{extra:?}");
    }

    // A root file that is not there, or holds no certificate.
    let missing = server.url(
        "localhost",
        "sslmode=verify-full sslrootcert=/nonexistent/root.pem",
    );
    let err = PgStore::connect(&missing).unwrap_err();
    assert!(matches!(err, Error::InvalidInput { .. }), "{err}");
    let empty = write_file(roots.path(), "empty.pem", "not a certificate\n")?;
    let err = PgStore::connect(&server.url(
        "localhost",
        &format!("sslmode=verify-ca sslrootcert={empty}"),
    ))
    .unwrap_err();
    assert!(err.to_string().contains("no certificate"), "{err}");
    Ok(())
}
