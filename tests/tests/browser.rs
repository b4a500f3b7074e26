//! The spec's browser snippet ("In a browser", session-api.md), run as
//! written in headless Chromium: a page served on `http://localhost:<port>`
//! by a tiny HTTP server in the test, talking to the daemon's `/web/ws` on
//! `127.0.0.1` with the token in the subprotocol list. Only `TOKEN` (defined
//! by the page, as the spec says whatever serves the page must) and the
//! port in the WebSocket URL differ from the spec's text.
//!
//! The page reports back by POSTing to the tiny server: a wrapper around
//! `console.log` / `console.error` (the snippet's only outputs besides the
//! DOM) sends what was logged and `document.body.textContent`, where the
//! snippet appends the generated text. Needs `/usr/bin/chromium`
//! (`scripts/setup.sh` installs it), or `$SUPERFLUID_CHROMIUM`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;
use superfluid::wire::{Finish, Record};

use crate::util::TestDaemon;

/// How long the page may take, from Chromium's start to "finished".
const PAGE_TIMEOUT: Duration = Duration::from_secs(120);

/// The spec's snippet, verbatim but for the port, which is `{PORT}` here.
const SNIPPET: &str = r#"// TOKEN is the contents of web-token, passed in by whatever serves the page.
const ws = new WebSocket("ws://127.0.0.1:{PORT}/web/ws", ["superfluid.v1", `superfluid.token.${TOKEN}`]);
const send = (request) => ws.send(JSON.stringify(request));

ws.onopen = () =>
  send({ Create: { parent: null, params: { temperature: 0.7, top_p: 0.95, min_p: 0, top_k: 0, seed: 1 } } });

ws.onmessage = ({ data }) => {
  const reply = JSON.parse(data);
  if (reply.Created) {
    const session = reply.Created.session;
    send({ AppendMessage: { session, role: 1, text: "Name three rivers." } });
    send({ Generate: { session, max_tokens: 256 } });
  } else if (reply.Delta?.event.body.Generated) {
    document.body.append(reply.Delta.event.body.Generated.text);
  } else if (reply.Generated) {
    console.log("finished", reply.Generated.finish);
  } else if (reply.Err) {
    console.error(reply.Err.message);
  }
};
"#;

/// Before the snippet: TOKEN, and console.log / console.error reported to
/// the server with the body's text. After it: the socket's close, reported.
/// Nothing follows `</html>`: a parser puts trailing whitespace in the body.
const PAGE: &str = r#"<!doctype html>
<html><head><meta charset="utf-8"><title>superfluid</title>
<script>
const TOKEN = "{TOKEN}";
const report = (kind, args) =>
  fetch("/report", { method: "POST", body: JSON.stringify({ kind, args, text: document.body.textContent }) });
for (const kind of ["log", "error"]) {
  const original = console[kind];
  console[kind] = (...args) => { original(...args); report(kind, args); };
}
</script>
<script>
{SNIPPET}</script>
<script>
ws.addEventListener("close", ({ code, reason }) => report("close", [code, reason]));
</script>
</head><body></body></html>"#;

fn chromium() -> PathBuf {
    let path = std::env::var_os("SUPERFLUID_CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    assert!(
        path.is_file(),
        "Chromium is missing at {}: run scripts/setup.sh (it installs Debian's chromium), \
         or set SUPERFLUID_CHROMIUM",
        path.display()
    );
    path
}

// ---- the tiny page server --------------------------------------------------

/// Reads one request: (request line, body).
fn read_request(s: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut b = [0u8; 4096];
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        let n = s.read(&mut b).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&b[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let length = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(n, _)| n.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = buf[end + 4..].to_vec();
    while body.len() < length {
        let n = s.read(&mut b).ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&b[..n]);
    }
    Some((head.lines().next()?.to_string(), body))
}

fn respond(s: &mut TcpStream, status: &str, content_type: &str, body: &[u8]) {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Cache-Control: no-store\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = s.write_all(head.as_bytes());
    let _ = s.write_all(body);
}

/// Serves `page` at `/` on `listener` (a thread per connection, since
/// Chromium may open a connection it never uses); each POST to `/report`
/// goes to the returned channel as JSON.
fn serve_page(listener: TcpListener, page: String) -> mpsc::Receiver<Value> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { continue };
            let page = page.clone();
            let tx = tx.clone();
            std::thread::spawn(move || {
                let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
                let Some((line, body)) = read_request(&mut s) else {
                    return;
                };
                if line.starts_with("GET / ") {
                    respond(
                        &mut s,
                        "200 OK",
                        "text/html; charset=utf-8",
                        page.as_bytes(),
                    );
                } else if line.starts_with("POST /report ") {
                    respond(&mut s, "204 No Content", "text/plain", b"");
                    // A report that is not JSON fails the test as an unknown kind.
                    let report = serde_json::from_slice(&body).unwrap_or_else(|e| {
                        serde_json::json!({"kind": format!("not JSON ({e})"),
                                           "body": String::from_utf8_lossy(&body)})
                    });
                    let _ = tx.send(report);
                } else {
                    respond(&mut s, "404 Not Found", "text/plain", b"");
                }
            });
        }
    });
    rx
}

// ---- Chromium --------------------------------------------------------------

/// Headless Chromium in a process group of its own, killed with it.
struct Browser {
    child: Child,
    stderr: PathBuf,
    _profile: tempfile::TempDir,
}

impl Browser {
    fn open(url: &str) -> Browser {
        let profile = tempfile::Builder::new()
            .prefix("sf-chromium")
            .tempdir()
            .unwrap();
        let stderr = profile.path().join("stderr.txt");
        let child = Command::new(chromium())
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-dev-shm-usage",
                "--enable-logging=stderr",
                "--remote-debugging-port=0",
            ])
            .arg(format!(
                "--user-data-dir={}",
                profile.path().join("data").display()
            ))
            .arg(url)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .process_group(0)
            .spawn()
            .expect("spawning chromium");
        Browser {
            child,
            stderr,
            _profile: profile,
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the process group our own child leads.
        unsafe { libc::kill(-(self.child.id() as libc::pid_t), libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

// ---- the test --------------------------------------------------------------

#[test]
fn browser_runs_the_spec_snippet_in_headless_chromium() {
    let chromium = chromium();
    let started = Instant::now();

    // The page's port first: its origin is what the daemon must list; the
    // page itself needs the daemon's port and token, so it is served after.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let page_port = listener.local_addr().unwrap().port();
    let origin = format!("http://localhost:{page_port}");

    let mut d = TestDaemon::new();
    d.extra_args = vec![
        "--web".into(),
        "127.0.0.1:0".into(),
        "--web-origin".into(),
        origin.clone(),
    ];
    d.spawn_and_wait();
    let out = d.stdout();
    let at = out
        .find("listening on http://127.0.0.1:")
        .unwrap_or_else(|| panic!("no web listener in stdout:\n{out}"));
    let rest = &out[at + "listening on http://127.0.0.1:".len()..];
    let web_port: u16 = rest[..rest.find(|c: char| !c.is_ascii_digit()).unwrap()]
        .parse()
        .unwrap();
    let token = std::fs::read_to_string(d.sessions.join("web-token")).unwrap();
    let token = token.trim();
    assert!(token.len() == 64 && token.bytes().all(|b| b.is_ascii_hexdigit()));

    let snippet = SNIPPET.replace("{PORT}", &web_port.to_string());
    assert_eq!(snippet.matches(&web_port.to_string()).count(), 1);
    let page = PAGE
        .replace("{TOKEN}", token)
        .replace("{SNIPPET}", &snippet);
    let reports = serve_page(listener, page);

    let browser = Browser::open(&format!("{origin}/"));
    eprintln!("chromium: {}", chromium.display());
    let deadline = Instant::now() + PAGE_TIMEOUT;
    let (finish_code, text) = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let report = match reports.recv_timeout(left) {
            Ok(r) => r,
            Err(_) => panic!(
                "no \"finished\" from the page within {PAGE_TIMEOUT:?}; chromium's stderr:\n{}\n\
                 daemon's stderr:\n{}",
                browser.stderr(),
                d.stderr()
            ),
        };
        match report["kind"].as_str() {
            Some("log") if report["args"][0] == "finished" => {
                let text = report["text"].as_str().unwrap().to_string();
                break (report["args"][1].as_u64().unwrap(), text);
            }
            Some("log") => {}
            _ => panic!(
                "the page reported {report}; chromium's stderr:\n{}",
                browser.stderr()
            ),
        }
    };
    drop(browser);
    eprintln!(
        "the snippet finished ({finish_code}) after {:.1} s: {text:?}",
        started.elapsed().as_secs_f64()
    );

    assert!(!text.trim().is_empty(), "no generated text in the page");
    assert!(
        finish_code == Finish::EndOfTurn as u64 || finish_code == Finish::MaxTokens as u64,
        "finished with {finish_code}"
    );
    // What the page shows is what the daemon committed: the session's
    // Generated events, in order, and the last one carries the finish.
    let log = d.read_all(1);
    let generated: Vec<(&str, Finish)> = log
        .iter()
        .filter_map(|e| match &e.body {
            Record::Generated { text, finish, .. } => Some((text.as_str(), *finish)),
            _ => None,
        })
        .collect();
    let committed: String = generated.iter().map(|(t, _)| *t).collect();
    assert_eq!(text, committed, "the page's text against the session log");
    assert_eq!(u8::from(generated.last().unwrap().1) as u64, finish_code);
    match &log[0].body {
        Record::Created { params, .. } => {
            assert_eq!(params.temperature, 0.7);
            assert_eq!(params.seed, 1);
        }
        other => panic!("the log starts with {other:?}"),
    }
}
