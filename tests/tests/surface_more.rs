//! More of the spec's surface on real daemons: `Throttled` on every
//! transport (the socket, /web/ws, and /web/rpc's `429` with `Retry-After`),
//! and /web/health open to any Host while every other route refuses one.

use std::net::TcpStream;
use std::time::Duration;

use serde_json::Value;
use superfluid::wire::{Request, Response};

use crate::http::{request, Reply};
use crate::util::{derived_model, Raw, TestDaemon};

const ORIGIN: &str = "http://localhost:5173";
const IO_TIMEOUT: Duration = Duration::from_secs(20);
/// src/frontend/bucket.rs: a connection's burst, and its refill (4 a
/// second, so a token is at most 250 ms away)...
const CONNECTION_BURST: usize = 8;
const CONNECTION_REFILL_MS: u64 = 250;
/// ...and /web/rpc's (8 a second).
const LISTENER_BURST: usize = 16;
const LISTENER_REFILL_MS: u64 = 125;

/// A daemon on the fill-in-the-middle test model with `--web`, its web
/// port and token.
fn fim_web_daemon() -> (TestDaemon, u16, String) {
    let mut d = TestDaemon::new();
    d.model = derived_model("SmolLM2-135M-fim.gguf");
    d.extra_args = ["--web", "127.0.0.1:0", "--web-origin", ORIGIN]
        .iter()
        .map(|s| s.to_string())
        .collect();
    d.spawn_and_wait();
    let out = d.stdout();
    let marker = "listening on http://127.0.0.1:";
    let at = out
        .find(marker)
        .unwrap_or_else(|| panic!("no web listener in stdout:\n{out}"));
    let rest = &out[at + marker.len()..];
    let port = rest[..rest.find(|c: char| !c.is_ascii_digit()).unwrap()]
        .parse()
        .unwrap();
    let token = std::fs::read_to_string(d.sessions.join("web-token")).unwrap();
    (d, port, token)
}

/// A real completion, one token long.
fn complete() -> Request {
    Request::Complete {
        prefix: "def add(a, b):\n    return ".into(),
        suffix: "\n".into(),
        mode: 0,
        max_tokens: 1,
    }
}

/// A `Complete` refused at once (mode 2 does not exist): it is metered like
/// any other, so it drains a bucket without the model's time, which keeps
/// the refill from outrunning the test on a slow machine.
fn cheap_complete() -> Request {
    Request::Complete {
        prefix: "a".into(),
        suffix: "b".into(),
        mode: 2,
        max_tokens: 1,
    }
}

/// Checks the replies to `CONNECTION_BURST` real Completes followed by cheap
/// ones, sent at once on one connection: the burst is served, then the
/// bucket runs dry and says when its next token comes.
fn assert_burst_then_throttled(replies: &[Response]) -> u64 {
    for (i, r) in replies[..CONNECTION_BURST].iter().enumerate() {
        assert!(
            matches!(r, Response::Completion { tokens: 1, .. }),
            "Complete {i} is within the burst: {r:?}"
        );
    }
    let throttled: Vec<u64> = replies
        .iter()
        .filter_map(|r| match r {
            Response::Throttled { retry_after_ms } => Some(*retry_after_ms),
            _ => None,
        })
        .collect();
    assert!(
        !throttled.is_empty(),
        "a burst past the bucket is throttled: {replies:?}"
    );
    for ms in &throttled {
        assert!(
            (1..=CONNECTION_REFILL_MS).contains(ms),
            "retry_after_ms {ms}"
        );
    }
    // Past the burst, a reply is either the cheap Complete's Err or Throttled.
    for r in &replies[CONNECTION_BURST..] {
        assert!(
            matches!(r, Response::Throttled { .. } | Response::Err { .. }),
            "{r:?}"
        );
    }
    throttled[0]
}

fn burst() -> Vec<Request> {
    let mut requests = vec![complete(); CONNECTION_BURST];
    requests.extend(std::iter::repeat_n(cheap_complete(), 32));
    requests
}

fn rpc(port: u16, token: &str, req: &Request) -> Reply {
    let auth = format!("Bearer {token}");
    request(
        port,
        "POST",
        "/web/rpc",
        &[
            ("Content-Type", "application/json"),
            ("Authorization", &auth),
            ("X-Superfluid-CSRF", token),
        ],
        serde_json::to_string(req).unwrap().as_bytes(),
    )
}

type Ws = tungstenite::WebSocket<TcpStream>;

fn ws_connect(port: u16, token: &str) -> Ws {
    use tungstenite::client::IntoClientRequest;
    use tungstenite::http::HeaderValue;
    let mut req = format!("ws://127.0.0.1:{port}/web/ws")
        .into_client_request()
        .unwrap();
    let h = req.headers_mut();
    let protocols = format!("superfluid.v1, superfluid.token.{token}");
    h.insert(
        "Sec-WebSocket-Protocol",
        HeaderValue::from_str(&protocols).unwrap(),
    );
    h.insert("Origin", HeaderValue::from_static(ORIGIN));
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    tungstenite::client(req, s)
        .unwrap_or_else(|e| panic!("the WebSocket handshake failed: {e}"))
        .0
}

fn ws_recv(ws: &mut Ws) -> Response {
    loop {
        match ws.read().expect("the WebSocket closed") {
            tungstenite::Message::Text(t) => {
                return serde_json::from_str(&t).unwrap_or_else(|e| panic!("{e}: {t}"))
            }
            _ => continue,
        }
    }
}

// ---- Throttled -------------------------------------------------------------

#[test]
fn complete_past_its_bucket_is_throttled_on_every_transport() {
    let (d, port, token) = fim_web_daemon();

    // The socket: one connection's burst, sent at once.
    let mut raw = Raw::connect(&d.socket);
    raw.stream.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let requests = burst();
    for r in &requests {
        raw.send_request(r);
    }
    let replies: Vec<Response> = requests
        .iter()
        .map(|_| raw.recv().expect("a reply"))
        .collect();
    let wait = assert_burst_then_throttled(&replies);
    // The bucket is per connection: a fresh one is served at once...
    let mut other = Raw::connect(&d.socket);
    other.stream.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    other.send_request(&complete());
    let reply = other.recv().unwrap();
    assert!(matches!(reply, Response::Completion { .. }), "{reply:?}");
    // ...and the throttled one again once its retry_after_ms has passed.
    std::thread::sleep(Duration::from_millis(wait + 50));
    raw.send_request(&complete());
    let reply = raw.recv().unwrap();
    assert!(matches!(reply, Response::Completion { .. }), "{reply:?}");

    // /web/ws: a WebSocket connection has its own bucket too.
    let mut ws = ws_connect(port, &token);
    for r in &requests {
        ws.send(tungstenite::Message::text(
            serde_json::to_string(r).unwrap(),
        ))
        .unwrap();
    }
    let replies: Vec<Response> = requests.iter().map(|_| ws_recv(&mut ws)).collect();
    assert_burst_then_throttled(&replies);

    // /web/rpc: one bucket for the whole listener; past it, 429 with a
    // Retry-After in whole seconds and a Throttled body.
    let first = rpc(port, &token, &complete());
    assert_eq!(first.status, 200);
    let body: Response = serde_json::from_slice(&first.body).unwrap();
    assert!(matches!(body, Response::Completion { .. }), "{body:?}");
    let mut served = 1;
    let refused = loop {
        let reply = rpc(port, &token, &cheap_complete());
        if reply.status == 429 {
            break reply;
        }
        assert_eq!(reply.status, 200);
        served += 1;
        assert!(served < 200, "/web/rpc never throttled");
    };
    assert!(
        served >= LISTENER_BURST,
        "throttled within the burst: {served}"
    );
    assert_eq!(refused.header("Retry-After"), Some("1"));
    let body: Value = serde_json::from_slice(&refused.body).unwrap();
    let ms = body["Throttled"]["retry_after_ms"]
        .as_u64()
        .unwrap_or_else(|| panic!("not a Throttled body: {body}"));
    assert!((1..=LISTENER_REFILL_MS).contains(&ms), "{ms}");
    assert_eq!(body.as_object().unwrap().len(), 1, "{body}");
}

// ---- /web/health and the Host ----------------------------------------------

#[test]
fn health_answers_any_host_and_every_other_route_refuses_a_foreign_one() {
    let (_d, port, token) = fim_web_daemon();
    for host in [
        None,
        Some("evil.example:80"),
        Some("localhost:1"),
        Some("rebound.example"),
    ] {
        let headers: Vec<(&str, &str)> = host.iter().map(|h| ("Host", *h)).collect();
        let reply = request(port, "GET", "/web/health", &headers, b"");
        assert_eq!(reply.status, 200, "Host {host:?}");
        let body: Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(body["ok"], Value::Bool(true), "{body}");
    }
    // Everything else still refuses a foreign Host, even with the token.
    let auth = format!("Bearer {token}");
    let ok_body = serde_json::to_string(&Request::List).unwrap();
    let post_headers = |host: &'static str| {
        vec![
            ("Host", host),
            ("Content-Type", "application/json"),
            ("Authorization", auth.as_str()),
            ("X-Superfluid-CSRF", token.as_str()),
        ]
    };
    for path in ["/web/rpc", "/web/stream"] {
        let reply = request(
            port,
            "POST",
            path,
            &post_headers("evil.example:80"),
            ok_body.as_bytes(),
        );
        assert_eq!(reply.status, 403, "{path}");
    }
    let good = rpc(port, &token, &Request::List);
    assert_eq!(good.status, 200);
    let ws = request(
        port,
        "GET",
        "/web/ws",
        &[
            ("Host", "evil.example:80"),
            ("Origin", ORIGIN),
            ("Authorization", &auth),
            ("Connection", "Upgrade"),
            ("Upgrade", "websocket"),
            ("Sec-WebSocket-Version", "13"),
            ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
            ("Sec-WebSocket-Protocol", "superfluid.v1"),
        ],
        b"",
    );
    assert_eq!(ws.status, 403);
}
