//! A WebDriver client for the browser suite: the W3C endpoints it calls,
//! as JSON over HTTP/1.1 on a `TcpStream`, a `chromedriver` of its own
//! with one headless Chromium session, and a router served on a loopback
//! port for the browser to open.

use std::fmt::Write as _;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use axum::Router;
use base64::Engine as _;
use serde_json::{Value, json};

pub(crate) type Fallible<T> = Result<T, Box<dyn std::error::Error>>;

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// How long the driver may take to start, and a page to load, before the
/// test fails.
const PATIENCE: Duration = Duration::from_secs(10);

/// How often a wait looks again.
const POLL: Duration = Duration::from_millis(25);

/// The key of an element reference in WebDriver's answers.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// One HTTP/1.1 exchange with `addr`, on a connection of its own: the
/// answer's status and body.
pub(crate) fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Fallible<(u16, Vec<u8>)> {
    let mut stream = TcpStream::connect_timeout(&addr, PATIENCE)?;
    // A WebDriver command that loads a page may take that long.
    stream.set_read_timeout(Some(PATIENCE * 3))?;
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        write!(head, "{name}: {value}\r\n")?;
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    let mut answer = Vec::new();
    let mut buf = [0_u8; 16 * 1024];
    loop {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&buf[..n]);
        if let Some((start, Some(len))) = body_at(&answer)
            && answer.len() >= start + len
        {
            answer.truncate(start + len);
            break;
        }
    }
    let (start, _) = body_at(&answer).ok_or("an HTTP answer's head")?;
    let status_line = String::from_utf8_lossy(&answer[..start]);
    let status = status_line
        .split_whitespace()
        .nth(1)
        .ok_or("an HTTP status")?
        .parse()?;
    Ok((status, answer.split_off(start)))
}

/// Where the body of the HTTP answer in `buf` starts, and its
/// `Content-Length` if it has one (else it ends with the connection);
/// `None` while the head is not all there.
fn body_at(buf: &[u8]) -> Option<(usize, Option<usize>)> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..end]);
    let len = head.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.eq_ignore_ascii_case("content-length")
            .then(|| value.trim().parse().ok())
            .flatten()
    });
    Some((end + 4, len))
}

/// A WebDriver command to the driver at `addr`: the `value` it answered.
fn webdriver(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> Fallible<Value> {
    let body = body.map(Value::to_string).unwrap_or_default();
    let headers: &[(&str, &str)] = if method == "POST" {
        &[("Content-Type", "application/json")]
    } else {
        &[]
    };
    let (status, answer) = http(addr, method, path, headers, body.as_bytes())?;
    let mut answer: Value = serde_json::from_slice(&answer)?;
    let value = answer["value"].take();
    if status == 200 {
        Ok(value)
    } else {
        Err(format!("WebDriver {method} {path}: {status} {value}").into())
    }
}

/// A `chromedriver` of its own with one headless Chromium session in it.
/// Dropped, it deletes the session and kills the driver's process group
/// (the browser with it, should the session be beyond deleting).
pub(crate) struct Browser {
    driver: Child,
    addr: SocketAddr,
    session: String,
    /// The browser's profile and the driver's log.
    dir: tempfile::TempDir,
}

impl Browser {
    /// A browser, or `None` (after saying so) where Chromium is not
    /// installed; a panic then if `CI` is set.
    pub(crate) fn start() -> Fallible<Option<Browser>> {
        if !Path::new(CHROMIUM).exists() || !Path::new(CHROMEDRIVER).exists() {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI is set but {CHROMIUM} or {CHROMEDRIVER} is missing: \
                 apt-get install -y chromium chromium-driver (.ci/run does)"
            );
            eprintln!(
                "skipped: chromium and chromedriver not installed; \
                 apt-get install -y chromium chromium-driver"
            );
            return Ok(None);
        }
        let dir = tempfile::tempdir()?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let log = std::fs::File::create(dir.path().join("chromedriver.log"))?;
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0)
            .spawn()?;
        let mut browser = Browser {
            driver,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            session: String::new(),
            dir,
        };
        browser.wait_until_ready()?;
        let profile = browser.dir.path().join("profile");
        let capabilities = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "timeouts": { "implicit": 0, "pageLoad": 10_000, "script": 10_000 },
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu",
                    "--disable-background-networking", "--disable-component-update",
                    "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                    "--window-size=1280,800",
                    format!("--user-data-dir={}", profile.display()),
                ],
            },
        } } });
        let created = webdriver(browser.addr, "POST", "/session", Some(&capabilities))?;
        created["sessionId"]
            .as_str()
            .ok_or("a session id")?
            .clone_into(&mut browser.session);
        // A window whose page is 1280×800, the size of the screenshots.
        let frame = browser.execute(
            "return [outerWidth - innerWidth, outerHeight - innerHeight].map(n => Math.max(n, 0))",
        )?;
        let (w, h) = (
            frame[0].as_u64().unwrap_or(0),
            frame[1].as_u64().unwrap_or(0),
        );
        let rect = json!({ "width": 1280 + w, "height": 800 + h });
        browser.command("POST", "/window/rect", Some(&rect))?;
        Ok(Some(browser))
    }

    /// Waits until the driver answers that it is ready.
    fn wait_until_ready(&self) -> Fallible<()> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let status = webdriver(self.addr, "GET", "/status", None);
            if status.as_ref().is_ok_and(|s| s["ready"] == true) {
                return Ok(());
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(self.dir.path().join("chromedriver.log"));
                return Err(format!("chromedriver not ready: {status:?}; its log: {log:?}").into());
            }
            std::thread::sleep(POLL);
        }
    }

    /// A command of the session: its answer.
    fn command(&self, method: &str, path: &str, body: Option<&Value>) -> Fallible<Value> {
        let path = format!("/session/{}{path}", self.session);
        webdriver(self.addr, method, &path, body)
    }

    pub(crate) fn goto(&self, url: &str) -> Fallible<()> {
        self.command("POST", "/url", Some(&json!({ "url": url })))
            .map(drop)
    }

    pub(crate) fn url(&self) -> Fallible<String> {
        let url = self.command("GET", "/url", None)?;
        Ok(url.as_str().ok_or("a URL")?.to_owned())
    }

    /// The elements `css` selects, in document order.
    pub(crate) fn find_all(&self, css: &str) -> Fallible<Vec<String>> {
        let body = json!({ "using": "css selector", "value": css });
        let found = self.command("POST", "/elements", Some(&body))?;
        found
            .as_array()
            .ok_or("a list of elements")?
            .iter()
            .map(|e| Ok(e[ELEMENT].as_str().ok_or("an element")?.to_owned()))
            .collect()
    }

    /// The one element `css` selects.
    pub(crate) fn find(&self, css: &str) -> Fallible<String> {
        let mut found = self.find_all(css)?;
        match found.len() {
            1 => Ok(found.remove(0)),
            n => Err(format!("{n} elements match {css} at {}", self.url()?).into()),
        }
    }

    pub(crate) fn click(&self, element: &str) -> Fallible<()> {
        self.command(
            "POST",
            &format!("/element/{element}/click"),
            Some(&json!({})),
        )
        .map(drop)
    }

    pub(crate) fn click_on(&self, css: &str) -> Fallible<()> {
        self.click(&self.find(css)?)
    }

    /// The text of `element` as the page shows it.
    pub(crate) fn text(&self, element: &str) -> Fallible<String> {
        let text = self.command("GET", &format!("/element/{element}/text"), None)?;
        Ok(text.as_str().ok_or("a text")?.to_owned())
    }

    /// The text the page shows.
    pub(crate) fn page_text(&self) -> Fallible<String> {
        self.text(&self.find("body")?)
    }

    pub(crate) fn selected(&self, element: &str) -> Fallible<bool> {
        let selected = self.command("GET", &format!("/element/{element}/selected"), None)?;
        selected.as_bool().ok_or_else(|| "a boolean".into())
    }

    /// What `script` (a function body) returns, run in the page.
    pub(crate) fn execute(&self, script: &str) -> Fallible<Value> {
        let body = json!({ "script": script, "args": [] });
        self.command("POST", "/execute/sync", Some(&body))
    }

    /// Waits until a page whose heading is `heading` has loaded: a new
    /// document, not the one [`Browser::follow`] left.
    pub(crate) fn wait_for(&self, heading: &str) -> Fallible<()> {
        const HEADING: &str = "const h = document.querySelector('h1'); \
            return !window.__left && document.readyState === 'complete' && h ? h.textContent : null";
        let deadline = Instant::now() + PATIENCE;
        loop {
            // An error while a navigation replaces the document is a "not yet".
            let seen = self.execute(HEADING).ok();
            if seen.as_ref().and_then(Value::as_str) == Some(heading) {
                return Ok(());
            }
            if Instant::now() > deadline {
                let at = self.url()?;
                return Err(
                    format!("no page \"{heading}\" in {PATIENCE:?}: {seen:?} at {at}").into(),
                );
            }
            std::thread::sleep(POLL);
        }
    }

    /// Clicks the link or button `css` selects and waits for the page it
    /// leads to, `heading` (which may be the heading of the page it left).
    pub(crate) fn follow(&self, css: &str, heading: &str) -> Fallible<()> {
        self.execute("window.__left = true")?;
        self.click_on(css)?;
        self.wait_for(heading)
    }

    /// The page as a PNG, to `path`.
    pub(crate) fn screenshot(&self, path: &Path) -> Fallible<()> {
        let png = self.command("GET", "/screenshot", None)?;
        let png = base64::engine::general_purpose::STANDARD.decode(png.as_str().ok_or("a PNG")?)?;
        std::fs::write(path, png)?;
        Ok(())
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = webdriver(
                self.addr,
                "DELETE",
                &format!("/session/{}", self.session),
                None,
            );
        }
        let group = format!("-{}", self.driver.id());
        let _ = Command::new("kill")
            .args(["-KILL", "--", &group])
            .stderr(Stdio::null())
            .status();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// A router served on a loopback port by a runtime of its own, until
/// dropped.
pub(crate) struct Served {
    pub(crate) addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Served {
    pub(crate) fn start(app: Router) -> Fallible<Served> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("a listener");
                tokio::select! {
                    served = axum::serve(listener, app) => served.expect("the console served"),
                    _ = stopped => {}
                }
            });
        });
        Ok(Served {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
