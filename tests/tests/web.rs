//! The browser transport (`--web`): the auth matrix, /web/rpc, /web/stream,
//! /web/ws, subscriptions, on a real daemon and the real model. HTTP is
//! written by hand over `TcpStream` (HTTP/1.1, `Connection: close`), so the
//! tests see and send exact bytes; the WebSocket client is tungstenite's.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use superfluid::wire::{Finish, Record, Request, Response, Role};

use crate::http::{connect, read_head, request, send_request, Reply};
use crate::util::{commit, created, params, Raw, TestDaemon};

const ORIGIN: &str = "http://localhost:5173";
const IO_TIMEOUT: Duration = Duration::from_secs(20);

// ---- the daemon ------------------------------------------------------------

/// Where the browser transport of a started daemon listens.
struct Web {
    port: u16,
    token: String,
}

fn web_daemon(extra: &[&str]) -> (TestDaemon, Web) {
    let mut d = TestDaemon::new();
    d.extra_args = ["--web", "127.0.0.1:0", "--web-origin", ORIGIN]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
    d.spawn_and_wait();
    let web = web_of(&d);
    (d, web)
}

/// Parses "listening on http://127.0.0.1:PORT" from the daemon's stdout.
fn web_of(d: &TestDaemon) -> Web {
    let out = d.stdout();
    let at = out
        .find("listening on http://127.0.0.1:")
        .unwrap_or_else(|| panic!("no web listener in stdout:\n{out}"));
    let rest = &out[at + "listening on http://127.0.0.1:".len()..];
    let port = rest[..rest.find(|c: char| !c.is_ascii_digit()).unwrap()]
        .parse()
        .unwrap();
    let token = std::fs::read_to_string(d.sessions.join("web-token")).unwrap();
    Web { port, token }
}

impl Web {
    fn auth(&self) -> String {
        format!("Bearer {}", self.token)
    }

    /// POST with the token and CSRF header, as the spec's curl does.
    fn post(&self, path: &str, body: &str) -> Reply {
        let auth = self.auth();
        let headers = [
            ("Content-Type", "application/json"),
            ("Authorization", auth.as_str()),
            ("X-Superfluid-CSRF", self.token.as_str()),
        ];
        request(self.port, "POST", path, &headers, body.as_bytes())
    }

    fn rpc(&self, request: Value) -> Value {
        let r = self.post("/web/rpc", &request.to_string());
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    }

    fn rpc_typed(&self, request: &Request) -> Response {
        let r = self.post("/web/rpc", &serde_json::to_string(request).unwrap());
        assert_eq!(r.status, 200, "{}", r.text());
        serde_json::from_slice(&r.body).unwrap()
    }

    /// The `data: ` payloads of one /web/stream call.
    fn stream(&self, body: Value) -> Vec<String> {
        let r = self.post("/web/stream", &body.to_string());
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("content-type"), Some("text/event-stream"));
        sse_lines(&r.text())
    }

    fn ws(&self) -> Ws {
        let auth = self.auth();
        Ws::connect(
            self.port,
            &[("Origin", ORIGIN), ("Authorization", auth.as_str())],
        )
        .unwrap_or_else(|status| panic!("WebSocket refused with {status}"))
    }
}

/// The `data: ` lines of an event stream; every other line must be blank.
fn sse_lines(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| {
            assert!(l.is_empty() || l.starts_with("data: "), "stray line {l:?}");
            !l.is_empty()
        })
        .map(|l| l["data: ".len()..].to_string())
        .collect()
}

// ---- the WebSocket client (tungstenite) ------------------------------------

struct Ws {
    ws: tungstenite::WebSocket<TcpStream>,
    protocol: Option<String>,
}

impl Ws {
    /// The handshake (tungstenite's client) with `headers` added to, or
    /// replacing, its own; `Err(status)` when the server refused it.
    fn connect(port: u16, headers: &[(&str, &str)]) -> Result<Ws, u16> {
        use tungstenite::client::IntoClientRequest;
        use tungstenite::http::{HeaderName, HeaderValue};
        let mut req = format!("ws://127.0.0.1:{port}/web/ws")
            .into_client_request()
            .unwrap();
        let h = req.headers_mut();
        if !headers.iter().any(|(n, _)| *n == "Sec-WebSocket-Protocol") {
            h.insert(
                "Sec-WebSocket-Protocol",
                HeaderValue::from_static("superfluid.v1"),
            );
        }
        for (n, v) in headers {
            h.insert(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        match tungstenite::client(req, connect(port)) {
            Ok((ws, response)) => Ok(Ws {
                ws,
                protocol: response
                    .headers()
                    .get("sec-websocket-protocol")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned),
            }),
            Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(r))) => {
                Err(r.status().as_u16())
            }
            Err(e) => panic!("the WebSocket handshake failed: {e}"),
        }
    }

    fn send_text(&mut self, text: &str) {
        self.ws.send(tungstenite::Message::text(text)).unwrap();
    }

    fn send(&mut self, request: &Request) {
        self.send_text(&serde_json::to_string(request).unwrap());
    }

    /// The next text message, or None on a close frame, EOF or timeout.
    fn recv_text(&mut self) -> Option<String> {
        loop {
            match self.ws.read() {
                Ok(tungstenite::Message::Text(t)) => return Some(t.to_string()),
                Ok(tungstenite::Message::Close(_)) | Err(_) => return None,
                Ok(_) => continue,
            }
        }
    }

    fn recv(&mut self) -> Response {
        let text = self.recv_text().expect("the WebSocket closed");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }

    fn call(&mut self, request: &Request) -> Response {
        self.send(request);
        self.recv()
    }
}

// ---- helpers ---------------------------------------------------------------

/// A greedy session with a system and a user message, made over /web/rpc.
fn asked(web: &Web, question: &str) -> u64 {
    let Response::Created { session } = web.rpc_typed(&Request::Create {
        parent: None,
        params: params(1),
    }) else {
        panic!("Create")
    };
    for (r, text) in [
        (Role::System, "You are a helpful assistant."),
        (Role::User, question),
    ] {
        let reply = web.rpc_typed(&Request::AppendMessage {
            session,
            role: r.into(),
            text: text.into(),
        });
        assert!(matches!(reply, Response::Committed { .. }), "{reply:?}");
    }
    session
}

/// Waits until the session has no generation in flight; returns its log.
fn settled(d: &TestDaemon, session: u64) -> Vec<superfluid::wire::Event> {
    let deadline = Instant::now() + IO_TIMEOUT;
    loop {
        let Response::Inspection { inspection } = d.call(&Request::Inspect { session }) else {
            panic!("Inspect")
        };
        if !inspection.generating {
            return d.read_all(session);
        }
        assert!(Instant::now() < deadline, "the generation did not end");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn last_finish(events: &[superfluid::wire::Event]) -> Finish {
    match events.last().map(|e| &e.body) {
        Some(Record::Generated { finish, .. }) => *finish,
        other => panic!("the log ends with {other:?}"),
    }
}

const STORY: &str = "Write a long story about a lighthouse keeper and a storm.";

// ---- the tests -------------------------------------------------------------

/// (case, headers, status on /web/rpc and /web/stream, status on /web/ws)
type AuthCase<'a> = (&'a str, Vec<(&'a str, &'a str)>, u16, u16);

#[test]
fn web_auth_matrix() {
    let (_d, web) = web_daemon(&[]);
    let port = web.port;
    let bearer = web.auth();
    let t = web.token.as_str();
    let host = format!("127.0.0.1:{port}");
    let good: Vec<(&str, &str)> = vec![
        ("Authorization", &bearer),
        ("X-Superfluid-CSRF", t),
        ("Host", &host),
    ];
    let without = |name: &str| -> Vec<(&str, &str)> {
        good.iter().filter(|(n, _)| *n != name).cloned().collect()
    };
    let with = |name: &'static str, value: &'static str| -> Vec<(&str, &str)> {
        let mut h = without(name);
        h.push((name, value));
        h
    };
    let cases: Vec<AuthCase> = vec![
        ("good", good.clone(), 200, 101),
        ("missing token", without("Authorization"), 401, 401),
        ("wrong token", with("Authorization", "Bearer 00"), 401, 401),
        ("missing CSRF", without("X-Superfluid-CSRF"), 403, 101),
        ("wrong CSRF", with("X-Superfluid-CSRF", "00"), 403, 101),
        (
            "unlisted Origin",
            with("Origin", "http://evil.example"),
            403,
            403,
        ),
        ("foreign Host", with("Host", "evil.example"), 403, 403),
    ];
    for (case, headers, post_status, ws_status) in &cases {
        let rpc = request(port, "POST", "/web/rpc", headers, br#""List""#);
        assert_eq!(rpc.status, *post_status, "/web/rpc {case}: {}", rpc.text());
        let body = br#"{"session":99,"max_tokens":1}"#;
        let stream = request(port, "POST", "/web/stream", headers, body);
        assert_eq!(
            stream.status,
            *post_status,
            "/web/stream {case}: {}",
            stream.text()
        );
        if *post_status == 200 {
            assert_eq!(rpc.json(), json!({"Sessions":{"ids":[]}}));
            let lines = sse_lines(&stream.text());
            assert_eq!(lines.len(), 2, "{lines:?}");
            assert!(lines[0].starts_with(r#"{"error":"#), "{lines:?}");
            assert_eq!(lines[1], "[DONE]");
        } else {
            assert!(rpc.json()["Err"]["message"].is_string());
        }
        // The WebSocket needs an Origin; the listed one unless the case sets another.
        let mut ws_headers = headers.clone();
        if !ws_headers.iter().any(|(n, _)| *n == "Origin") {
            ws_headers.push(("Origin", ORIGIN));
        }
        let ws = Ws::connect(port, &ws_headers).map(|w| w.protocol);
        match ws {
            Ok(protocol) => {
                assert_eq!(*ws_status, 101, "/web/ws {case}");
                assert_eq!(protocol.as_deref(), Some("superfluid.v1"));
            }
            Err(status) => assert_eq!(status, *ws_status, "/web/ws {case}"),
        }
    }
    // /web/ws without an Origin, and with the token as a subprotocol only.
    let no_origin = Ws::connect(port, &[("Authorization", &bearer)]).map(|_| ());
    assert_eq!(no_origin, Err(403));
    let token_protocol = format!("superfluid.v1, superfluid.token.{t}");
    let browser = Ws::connect(
        port,
        &[
            ("Origin", ORIGIN),
            ("Sec-WebSocket-Protocol", &token_protocol),
            ("Host", &format!("localhost:{port}")),
        ],
    )
    .unwrap_or_else(|s| panic!("the browser handshake got {s}"));
    // Only superfluid.v1 is echoed, never the token.
    assert_eq!(browser.protocol.as_deref(), Some("superfluid.v1"));
    browser_snippet(browser);
    let wrong_protocol = Ws::connect(
        port,
        &[
            ("Origin", ORIGIN),
            (
                "Sec-WebSocket-Protocol",
                "superfluid.v1, superfluid.token.00",
            ),
        ],
    )
    .map(|_| ());
    assert_eq!(wrong_protocol, Err(401));
    // The spec's subprotocol must be offered: the token alone as one, another
    // protocol, or an empty list is a 400.
    let token_only = format!("superfluid.token.{t}");
    for offered in [token_only.as_str(), "chat", ""] {
        let refused = Ws::connect(
            port,
            &[
                ("Origin", ORIGIN),
                ("Authorization", &bearer),
                ("Sec-WebSocket-Protocol", offered),
            ],
        )
        .map(|_| ());
        assert_eq!(refused, Err(400), "offered {offered:?}");
    }
    // /web/health: no token (a foreign Host: see surface_more).
    let health = request(port, "GET", "/web/health", &[], b"");
    assert_eq!(health.status, 200);
    // A body over the cap is refused from its Content-Length, unread.
    let mut big = good.clone();
    big.push(("Content-Length", "17000000"));
    let mut s = connect(port);
    send_request(&mut s, port, "POST", "/web/rpc", &big, b"");
    let (status, _, _) = read_head(&mut s);
    assert_eq!(status, 413);
}

/// The spec's browser snippet, frame for frame: AppendMessage and Generate
/// are sent together as soon as Created arrives.
fn browser_snippet(mut ws: Ws) {
    ws.send_text(
        &json!({ "Create": { "parent": null, "params": { "temperature": 0.7, "top_p": 0.95, "min_p": 0, "top_k": 0, "seed": 1 } } })
            .to_string(),
    );
    let Response::Created { session } = ws.recv() else {
        panic!("Create")
    };
    ws.send_text(&json!({ "AppendMessage": { "session": session, "role": 1, "text": "Name three rivers." } }).to_string());
    ws.send_text(&json!({ "Generate": { "session": session, "max_tokens": 32 } }).to_string());
    let mut text = String::new();
    let mut replies = Vec::new();
    loop {
        let raw: Value = serde_json::from_str(&ws.recv_text().unwrap()).unwrap();
        if let Some(t) = raw.pointer("/Delta/event/body/Generated/text") {
            text.push_str(t.as_str().unwrap());
        }
        let name = raw.as_object().unwrap().keys().next().unwrap().clone();
        if name == "Generated" {
            assert!(raw["Generated"]["finish"].as_u64().unwrap() > 0);
            break;
        }
        assert_ne!(name, "Err", "{raw}");
        replies.push(name);
    }
    assert_eq!(replies[0], "Committed");
    assert!(replies[1..].iter().all(|r| r == "Delta"), "{replies:?}");
    assert!(!text.is_empty());
}

#[test]
fn web_rpc_walkthrough_and_stream() {
    let (d, web) = web_daemon(&[]);
    // The spec's curl walkthrough, byte for byte where the spec says.
    let created = web.post(
        "/web/rpc",
        r#"{"Create":{"parent":null,"params":{"temperature":0.7,"top_p":0.95,"min_p":0.0,"top_k":0,"seed":1}}}"#,
    );
    assert_eq!(created.status, 200);
    assert_eq!(created.text(), r#"{"Created":{"session":1}}"#);
    let appended =
        web.rpc(json!({"AppendMessage":{"session":1,"role":1,"text":"Name three rivers."}}));
    let event = &appended["Committed"]["event"];
    assert_eq!(event["event_id"], 1);
    let keys: Vec<&String> = event.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["event_id", "epoch", "ts_unix_ms", "body"]);
    let message = &event["body"]["Message"];
    assert_eq!(message["role"], 1);
    assert_eq!(message["text"], "Name three rivers.");
    assert!(message["span"].as_array().unwrap().len() > 3);
    assert_eq!(
        web.rpc(json!("Tree")),
        json!({"Tree":{"nodes":[[1,null,null]]}})
    );
    // Refused with Err, status 200; so is a body that is no request.
    for refused in [
        json!({"Generate":{"session":1,"max_tokens":4}}),
        json!({"Subscribe":{"session":1,"cursor":0,"provisional":false}}),
        json!({"Unsubscribe":{"sub":1}}),
        json!({"Nope":{}}),
    ] {
        assert!(
            web.rpc(refused.clone())["Err"]["message"].is_string(),
            "{refused}"
        );
    }

    // /web/stream: committed events, done, [DONE]; no provisional unasked.
    let s = asked(&web, "What is the capital of France?");
    let lines = web.stream(json!({"session": s, "max_tokens": 24}));
    let (last, rest) = lines.split_last().unwrap();
    assert_eq!(last, "[DONE]");
    let (done, committed) = rest.split_last().unwrap();
    let done: Value = serde_json::from_str(done).unwrap();
    let done = &done["done"];
    assert!(done["tokens_generated"].as_u64().unwrap() > 0);
    let f = done["finish"].as_u64().unwrap() as u8;
    assert!(
        f == u8::from(Finish::EndOfTurn) || f == u8::from(Finish::MaxTokens),
        "{done}"
    );
    assert!(done["warm_prefix"].is_u64());
    let log = d.read_all(s);
    let from_log: Vec<Value> = log
        .iter()
        .filter(|e| matches!(e.body, Record::Generated { .. }))
        .map(|e| serde_json::to_value(e).unwrap())
        .collect();
    let streamed: Vec<Value> = committed
        .iter()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            assert!(v.get("committed").is_some(), "{l}");
            v["committed"].clone()
        })
        .collect();
    assert_eq!(streamed, from_log, "every Generated event, nothing else");
    let text: String = from_log
        .iter()
        .map(|e| e["body"]["Generated"]["text"].as_str().unwrap())
        .collect();
    assert!(text.contains("Paris"), "{text}");

    // With provisional: text ahead of its commit, and the same committed text.
    let s2 = asked(&web, "What is the capital of France?");
    let lines = web.stream(json!({"session": s2, "max_tokens": 24, "provisional": true}));
    let mut provisional = String::new();
    let mut committed = String::new();
    for l in &lines[..lines.len() - 1] {
        let v: Value = serde_json::from_str(l).unwrap();
        if let Some(p) = v.get("provisional") {
            assert!(p["channel"].is_u64());
            provisional.push_str(p["text"].as_str().unwrap());
        } else if let Some(c) = v.get("committed") {
            committed.push_str(c["body"]["Generated"]["text"].as_str().unwrap_or(""));
        }
    }
    assert!(!provisional.is_empty(), "{lines:?}");
    assert!(
        committed.starts_with(&provisional[..provisional.len().min(8)]),
        "{provisional:?} / {committed:?}"
    );

    // Closing the stream mid-way cancels: the log ends with finish 4.
    let s3 = asked(&web, STORY);
    let mut sock = connect(web.port);
    let auth = web.auth();
    let body = json!({"session": s3, "max_tokens": 400}).to_string();
    send_request(
        &mut sock,
        web.port,
        "POST",
        "/web/stream",
        &[("Authorization", &auth), ("X-Superfluid-CSRF", &web.token)],
        body.as_bytes(),
    );
    let (status, _, mut seen) = read_head(&mut sock);
    assert_eq!(status, 200);
    let mut b = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("committed") {
        let n = sock.read(&mut b).unwrap();
        assert!(n > 0);
        seen.extend_from_slice(&b[..n]);
    }
    drop(sock);
    let log = settled(&d, s3);
    assert_eq!(last_finish(&log), Finish::Cancelled, "{:?}", log.last());
}

#[test]
fn web_ws_generate_cancelled_through_rpc() {
    let (_d, web) = web_daemon(&[]);
    let mut ws = web.ws();
    // The browser snippet's requests, as JSON text frames.
    ws.send_text(r#"{"Create":{"parent":null,"params":{"temperature":0,"top_p":1,"min_p":0,"top_k":0,"seed":1}}}"#);
    let Response::Created { session } = ws.recv() else {
        panic!("Create")
    };
    for (r, text) in [(0, "You are a helpful assistant."), (1, STORY)] {
        ws.send_text(
            &json!({"AppendMessage":{"session":session,"role":r,"text":text}}).to_string(),
        );
        assert!(matches!(ws.recv(), Response::Committed { .. }));
    }
    ws.send_text(&json!({"Generate":{"session":session,"max_tokens":400}}).to_string());
    let mut generated = 0;
    loop {
        match ws.recv() {
            Response::Delta { event } => {
                if matches!(event.body, Record::Generated { .. }) {
                    generated += 1;
                    if generated == 1 {
                        assert_eq!(
                            web.rpc_typed(&Request::Cancel { session }),
                            Response::Cancelling
                        );
                    }
                }
            }
            Response::Generated { finish: f, .. } => {
                assert_eq!(f, Finish::Cancelled);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    // The connection goes on: the next request is answered.
    assert!(matches!(ws.call(&Request::List), Response::Sessions { .. }));
    // Not a request: an Err frame, and the connection stays.
    ws.send_text("{");
    assert!(matches!(ws.recv(), Response::Err { .. }));
    assert!(matches!(ws.call(&Request::Tree), Response::Tree { .. }));
    // A purge ends the session's subscriptions.
    let Response::Inspection { inspection } = web.rpc_typed(&Request::Inspect { session }) else {
        panic!("Inspect")
    };
    let subscribe = Request::Subscribe {
        session,
        cursor: inspection.events,
        provisional: false,
    };
    let Response::Subscribed { sub } = ws.call(&subscribe) else {
        panic!("Subscribe")
    };
    let purge = Request::Purge {
        session,
        expected_generation: inspection.generation,
        mode: superfluid::wire::PurgeMode::Cascade,
    };
    assert!(matches!(web.rpc_typed(&purge), Response::Purged { .. }));
    assert_eq!(
        ws.recv(),
        Response::SubEnded {
            sub,
            reason: "purged".into()
        }
    );
    assert!(matches!(ws.call(&subscribe), Response::Err { .. }));
}

#[test]
fn web_subscribe_resumes_at_a_held_cursor_across_a_restart() {
    let (mut d, web) = web_daemon(&[]);
    let first_token = web.token.clone();
    let path = d.sessions.join("web-token");
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let mut c = d.client();
    let s = created(
        &mut c,
        Request::Create {
            parent: None,
            params: params(1),
        },
    );
    let say = |c: &mut superfluid::frontend::socket::Client, text: &str| {
        commit(
            c,
            Request::AppendMessage {
                session: s,
                role: Role::User.into(),
                text: text.into(),
            },
        )
        .event_id
    };
    say(&mut c, "one");
    say(&mut c, "two");

    let mut ws = web.ws();
    let Response::Subscribed { sub } = ws.call(&Request::Subscribe {
        session: s,
        cursor: 1,
        provisional: false,
    }) else {
        panic!("Subscribe")
    };
    let mut ids = Vec::new();
    let expect_event = |ws: &mut Ws, ids: &mut Vec<u64>| match ws.recv() {
        Response::SubEvent { sub: got, event } => {
            assert_eq!(got, sub);
            ids.push(event.event_id);
        }
        other => panic!("{other:?}"),
    };
    expect_event(&mut ws, &mut ids);
    expect_event(&mut ws, &mut ids);
    // Live, and other requests on the same socket go on meanwhile.
    let three = say(&mut c, "three");
    expect_event(&mut ws, &mut ids);
    assert!(matches!(ws.call(&Request::List), Response::Sessions { .. }));
    assert_eq!(ids, vec![1, 2, three]);
    assert_eq!(
        ws.call(&Request::Unsubscribe { sub }),
        Response::Unsubscribed
    );
    assert_eq!(
        ws.recv(),
        Response::SubEnded {
            sub,
            reason: "unsubscribed".into()
        }
    );
    assert!(matches!(
        ws.call(&Request::Unsubscribe { sub }),
        Response::Err { .. }
    ));
    let cursor = three + 1;
    drop(ws);

    d.restart();
    let web = web_of(&d);
    assert_ne!(web.token, first_token, "a new token at every start");
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let mut c = d.client();
    let four = say(&mut c, "four");
    let five = say(&mut c, "five");

    // Over the unix socket this time: sub frames interleave with replies.
    let mut raw = Raw::connect(&d.socket);
    raw.send_request(&Request::Subscribe {
        session: s,
        cursor,
        provisional: false,
    });
    let Some(Response::Subscribed { sub }) = raw.recv() else {
        panic!("Subscribe")
    };
    let mut got = Vec::new();
    for _ in 0..2 {
        match raw.recv() {
            Some(Response::SubEvent { event, .. }) => got.push(event),
            other => panic!("{other:?}"),
        }
    }
    let six = say(&mut c, "six");
    match raw.recv() {
        Some(Response::SubEvent { event, .. }) => got.push(event),
        other => panic!("{other:?}"),
    }
    let log = d.read_all(s);
    assert_eq!(got, log[cursor as usize..].to_vec(), "no gap, no duplicate");
    assert_eq!(
        got.iter().map(|e| e.event_id).collect::<Vec<_>>(),
        vec![four, five, six]
    );
    // A Read on the same connection is answered between sub frames.
    raw.send_request(&Request::Read {
        session: s,
        cursor: six,
    });
    assert!(matches!(raw.recv(), Some(Response::Events { .. })));
    // Shutting down ends the subscription.
    d.stop();
    assert_eq!(
        raw.recv(),
        Some(Response::SubEnded {
            sub,
            reason: "publisher closed".into()
        })
    );
}

#[test]
fn web_a_slow_subscriber_lags_and_a_fast_one_sees_everything() {
    const MESSAGES: u64 = 120;
    let (d, web) = web_daemon(&["--sub-buffer", "8"]);
    let mut c = d.client();
    let s = created(
        &mut c,
        Request::Create {
            parent: None,
            params: params(1),
        },
    );

    // Slow: a socket connection that subscribes and then reads nothing.
    let mut slow = Raw::connect(&d.socket);
    slow.send_request(&Request::Subscribe {
        session: s,
        cursor: 0,
        provisional: false,
    });
    // Fast: a WebSocket read on its own thread.
    let mut fast = web.ws();
    let Response::Subscribed { sub } = fast.call(&Request::Subscribe {
        session: s,
        cursor: 0,
        provisional: false,
    }) else {
        panic!("Subscribe")
    };
    let reader = std::thread::spawn(move || {
        let mut ids = Vec::new();
        while ids.len() as u64 <= MESSAGES {
            match fast.recv() {
                Response::SubEvent { sub: got, event } => {
                    assert_eq!(got, sub);
                    ids.push(event.event_id);
                }
                other => panic!(
                    "the fast subscriber got {other:?} after {} events",
                    ids.len()
                ),
            }
        }
        ids
    });
    let text = "river ".repeat(3000);
    for _ in 0..MESSAGES {
        commit(
            &mut c,
            Request::AppendMessage {
                session: s,
                role: Role::User.into(),
                text: text.clone(),
            },
        );
    }
    let ids = reader.join().unwrap();
    assert_eq!(ids, (0..=MESSAGES).collect::<Vec<_>>());

    // The slow one, read at last: a prefix without gaps, then `lagged`.
    let Some(Response::Subscribed { sub }) = slow.recv() else {
        panic!("Subscribe")
    };
    let mut next = 0;
    loop {
        match slow.recv() {
            Some(Response::SubEvent { sub: got, event }) => {
                assert_eq!((got, event.event_id), (sub, next));
                next += 1;
            }
            Some(Response::SubEnded { sub: got, reason }) => {
                assert_eq!((got, reason.as_str()), (sub, "lagged"));
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(next <= MESSAGES, "the slow subscriber saw all {next}");
    // Its connection still serves requests.
    slow.send_request(&Request::List);
    assert!(matches!(slow.recv(), Some(Response::Sessions { .. })));
}

#[test]
fn web_refuses_a_non_loopback_address() {
    let mut d = TestDaemon::new();
    let failed = d.start_expect_exit(&["--web".into(), "0.0.0.0:8455".into()]);
    assert!(!failed.status.success());
    assert!(failed.stderr.contains("loopback"), "{}", failed.stderr);
    assert!(!d.wal_path().exists(), "nothing started");
    assert!(!d.sessions.join("web-token").exists());
}

/// The page the listener serves at /web/ may open /web/ws from the
/// listener's own origin without --web-origin (issue 18); other ports and
/// /web/rpc still need a listed one, and the page itself needs no token.
#[test]
fn web_ws_accepts_the_listeners_own_origin_and_serves_the_page() {
    let (_d, web) = web_daemon(&[]);
    let port = web.port;
    let protocols = format!("superfluid.v1, superfluid.token.{}", web.token);
    let connect = |origin: &str| {
        Ws::connect(
            port,
            &[("Origin", origin), ("Sec-WebSocket-Protocol", &protocols)],
        )
        .map(|w| w.protocol)
    };
    for own in [
        format!("http://127.0.0.1:{port}"),
        format!("http://localhost:{port}"),
    ] {
        assert_eq!(connect(&own), Ok(Some("superfluid.v1".into())), "{own}");
    }
    assert_eq!(connect(&format!("http://127.0.0.1:{}", port + 1)), Err(403));
    let auth = web.auth();
    let own = format!("http://127.0.0.1:{port}");
    let rpc = request(
        port,
        "POST",
        "/web/rpc",
        &[
            ("Origin", own.as_str()),
            ("Authorization", auth.as_str()),
            ("X-Superfluid-CSRF", web.token.as_str()),
        ],
        br#""List""#,
    );
    assert_eq!(rpc.status, 403, "{}", rpc.text());
    let page = request(port, "GET", "/web/", &[], b"");
    assert_eq!(page.status, 200);
    assert!(page.text().contains(r#"src="app.js""#));
    assert!(
        !page.text().contains(&web.token),
        "the token is never in the page"
    );
    let script = request(port, "GET", "/web/app.js", &[], b"");
    assert_eq!(script.status, 200);
    assert_eq!(
        script.header("content-type"),
        Some("text/javascript; charset=utf-8")
    );
}

/// Issue 15, item 7: a request without the credential is answered and its
/// connection closed at once, though it asked to keep the connection alive
/// (an authorised one keeps it): refused ones, and the health check and
/// page files, which need none (256 keep-alive connections polling
/// /web/health held every --max-connections slot, and authorised requests
/// waited).
#[test]
fn web_closes_an_unauthenticated_connection() {
    let (_d, web) = web_daemon(&[]);
    for (path, headers) in [
        ("/web/health", vec![("Connection", "keep-alive")]),
        ("/web/", vec![("Connection", "keep-alive")]),
        ("/v1/models", vec![("Connection", "keep-alive")]),
        (
            "/metrics",
            vec![
                ("Connection", "keep-alive"),
                ("Authorization", "Bearer wrong"),
            ],
        ),
    ] {
        let mut s = connect(web.port);
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        send_request(&mut s, web.port, "GET", path, &headers, b"");
        let (status, head, rest) = read_head(&mut s);
        let open_route = path.starts_with("/web/");
        assert!(
            status == 401 || status == 403 || (open_route && status == 200),
            "{path}: {status}"
        );
        let len: usize = head
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
            .map(|(_, v)| v.parse().unwrap())
            .unwrap_or(0);
        let mut body = rest;
        let mut b = [0u8; 4096];
        let t = Instant::now();
        let closed = loop {
            match s.read(&mut b) {
                Ok(0) => break true,
                Ok(n) => body.extend_from_slice(&b[..n]),
                Err(_) => break false,
            }
        };
        assert!(body.len() >= len);
        assert!(
            closed && t.elapsed() < Duration::from_secs(2),
            "{path}: the connection stayed open after {status}"
        );
    }
    // An authorised keep-alive request keeps its connection.
    let mut s = connect(web.port);
    s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let auth = web.auth();
    send_request(
        &mut s,
        web.port,
        "GET",
        "/v1/models",
        &[
            ("Connection", "keep-alive"),
            ("Authorization", auth.as_str()),
        ],
        b"",
    );
    let (status, _, _) = read_head(&mut s);
    assert_eq!(status, 200);
    let mut b = [0u8; 65536];
    let mut open = false;
    for _ in 0..4 {
        match s.read(&mut b) {
            Ok(0) => break,
            Ok(_) => continue,
            Err(_) => {
                open = true;
                break;
            }
        }
    }
    assert!(open, "an authorised keep-alive connection stays open");
}

/// Issue 15, item 7: the listener serves at most `--max-connections`
/// connections at once; one more waits until one closes (here: two idle
/// connections that never send a request, closed by the server's 5-second
/// request timeout).
#[test]
fn web_connections_are_capped_and_idle_ones_closed() {
    let (_d, web) = web_daemon(&["--max-connections", "2"]);
    let idle: Vec<TcpStream> = (0..2).map(|_| connect(web.port)).collect();
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let mut s = connect(web.port);
    let auth = web.auth();
    send_request(
        &mut s,
        web.port,
        "GET",
        "/web/health",
        &[("Authorization", auth.as_str())],
        b"",
    );
    let (status, _, _) = read_head(&mut s);
    let waited = t.elapsed();
    assert_eq!(status, 200);
    assert!(
        waited > Duration::from_secs(2) && waited < Duration::from_secs(15),
        "the third connection was served after {waited:?}: not held back by the cap, or \
         the idle ones were not closed"
    );
    // The idle ones were closed by the server (after a 408).
    for mut c in idle {
        c.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let mut got = Vec::new();
        assert!(
            c.read_to_end(&mut got).is_ok(),
            "an idle connection is still open"
        );
        let text = String::from_utf8_lossy(&got);
        assert!(got.is_empty() || text.starts_with("HTTP/1.1 408"), "{text}");
    }
}

/// The status of `GET /v1/models` with `key` as the bearer.
fn models_status(port: u16, key: &str) -> u16 {
    let auth = format!("Bearer {key}");
    request(port, "GET", "/v1/models", &[("Authorization", &auth)], b"").status
}

/// `--api-key-file`: a key file others can read stops the start with a
/// message naming it; one that is the owner's only gives the key the
/// compatible routes take. `--api-key` on the command line (readable by
/// other users in the process list) is warned about.
#[test]
fn an_api_key_from_a_private_file_and_a_warning_for_one_on_the_command_line() {
    let mut d = TestDaemon::new();
    let file = d.path().join("key");
    std::fs::write(&file, "file-key-123\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let args: Vec<String> = ["--web", "127.0.0.1:0", "--api-key-file"]
        .iter()
        .map(|s| s.to_string())
        .chain([file.to_string_lossy().into_owned()])
        .collect();
    let failed = d.start_expect_exit(&args);
    assert!(
        failed.stderr.contains("readable by others (mode 644)"),
        "{}",
        failed.stderr
    );
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    d.extra_args = args;
    d.spawn_and_wait();
    let web = web_of(&d);
    let models = |key: &str| models_status(web.port, key);
    assert_eq!(models("file-key-123"), 200);
    assert_eq!(models("file-key-12"), 401);
    assert!(!d.stderr().contains("can be read by other users"));
    d.stop();
    d.extra_args = ["--web", "127.0.0.1:0", "--api-key", "argv-key"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    d.spawn_and_wait();
    assert!(
        d.stderr()
            .contains("--api-key on the command line can be read by other users"),
        "{}",
        d.stderr()
    );
    // The file wins over SUPERFLUID_API_KEY (clap refused the pair).
    d.stop();
    d.env.push(("SUPERFLUID_API_KEY".into(), "env-key".into()));
    d.extra_args = ["--web", "127.0.0.1:0", "--api-key-file"]
        .iter()
        .map(|s| s.to_string())
        .chain([file.to_string_lossy().into_owned()])
        .collect();
    d.spawn_and_wait();
    let web = web_of(&d);
    let models = |key: &str| models_status(web.port, key);
    assert_eq!((models("file-key-123"), models("env-key")), (200, 401));
}

/// After the close handshake the server closes the TCP connection at once,
/// as RFC 6455 7.1.1 asks (the client waits for it): actix kept it open
/// until its client_disconnect_timeout (5 s), so a client that waits for
/// the close (Python's websockets) returned 5 s late.
#[test]
fn web_ws_closes_its_tcp_connection_after_the_close_handshake() {
    use std::io::Read;
    let (_d, web) = web_daemon(&[]);
    let mut ws = web.ws();
    ws.send(&Request::Inspect { session: 1 });
    ws.recv();
    ws.ws.close(None).unwrap();
    loop {
        match ws.ws.read() {
            Ok(tungstenite::Message::Close(_)) => break,
            Ok(_) => continue,
            Err(e) => panic!("no Close from the server: {e}"),
        }
    }
    let tcp = ws.ws.get_mut();
    tcp.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut rest = Vec::new();
    match tcp.read_to_end(&mut rest) {
        Ok(_) => assert!(rest.is_empty(), "{rest:?}"),
        Err(e) => panic!("the server kept the connection past the close handshake: {e}"),
    }
}

/// Closing the WebSocket (a Close frame) while a `Generate` runs cancels
/// it: it ran to its max_tokens, keeping the session busy, and the server's
/// Close carried no code (1005) where RFC 6455 asks for the client's echoed.
#[test]
fn web_ws_close_cancels_its_generation_and_echoes_the_close() {
    use tungstenite::protocol::frame::coding::CloseCode;
    use tungstenite::protocol::CloseFrame;
    let (_d, web) = web_daemon(&[]);
    let (mut ws, session) = generating(&web);
    ws.ws
        .close(Some(CloseFrame {
            code: CloseCode::Library(4000),
            reason: "done".into(),
        }))
        .unwrap();
    let echoed = loop {
        match ws.ws.read() {
            Ok(tungstenite::Message::Close(frame)) => break frame,
            Ok(_) => continue,
            Err(e) => panic!("no Close from the server: {e}"),
        }
    };
    assert_eq!(echoed.map(|f| f.code), Some(CloseCode::Library(4000)));
    let (tokens, finish) = generation_end(&web, session);
    assert_eq!(finish, Some(Finish::Cancelled), "{tokens} tokens");
    assert!(tokens < 400, "{tokens}");
}

/// A WebSocket on which a `Generate` of 400 tokens of a new session runs,
/// its first tokens committed; and the session.
fn generating(web: &Web) -> (Ws, u64) {
    let session = asked(web, STORY);
    let mut ws = web.ws();
    ws.send(&Request::Generate {
        session,
        max_tokens: 400,
    });
    while !matches!(
        ws.recv(),
        Response::Delta { event } if matches!(event.body, Record::Generated { .. })
    ) {}
    (ws, session)
}

/// Waits until `session` generates no more; its generated tokens and last
/// finish code.
fn generation_end(web: &Web, session: u64) -> (usize, Option<Finish>) {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let Response::Inspection { inspection } = web.rpc_typed(&Request::Inspect { session })
        else {
            panic!("Inspect")
        };
        if !inspection.generating {
            break;
        }
        assert!(Instant::now() < until, "still generating after 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    generated(web, session)
}

/// `session`'s generated tokens so far, and its last finish code.
fn generated(web: &Web, session: u64) -> (usize, Option<Finish>) {
    let Response::Events { events } = web.rpc_typed(&Request::Read { session, cursor: 0 }) else {
        panic!("Read")
    };
    events.iter().fold((0, None), |(n, f), e| match &e.body {
        Record::Generated { span, finish, .. } => (n + span.len(), Some(*finish)),
        _ => (n, f),
    })
}

/// A Ping and a Close behind requests queued after a running `Generate`
/// are seen at once: the Pong comes back while it runs, and the Close
/// cancels it. The reader handed requests over one at a time and waited
/// for the loop with two queued: the Pong came after the generation (5 s
/// in the audit), and it ran to its max_tokens after the client had left.
#[test]
fn web_ws_sees_a_ping_and_a_close_behind_queued_requests() {
    let (_d, web) = web_daemon(&[]);
    let (mut ws, session) = generating(&web);
    for _ in 0..3 {
        ws.send(&Request::Tree);
    }
    let pinged = Instant::now();
    ws.ws
        .send(tungstenite::Message::Ping(b"p".to_vec().into()))
        .unwrap();
    let pong = loop {
        match ws.ws.read().unwrap() {
            tungstenite::Message::Pong(_) => break pinged.elapsed(),
            _ => continue,
        }
    };
    let (tokens_then, _) = generated(&web, session);
    assert!(
        tokens_then < 400,
        "the Pong ({pong:?}) came after the generation ended"
    );
    ws.ws.close(None).unwrap();
    let (tokens, finish) = generation_end(&web, session);
    assert_eq!(finish, Some(Finish::Cancelled), "{tokens} tokens");
    assert!(tokens < 400, "{tokens}");
}

/// WebSockets take at most half of --max-connections: with 4, a third
/// WebSocket is refused with 503 while the HTTP routes still answer at
/// once (256 idle WebSockets held every slot and every route hung).
#[test]
fn web_sockets_take_at_most_half_the_connection_slots() {
    let (_d, web) = web_daemon(&["--max-connections", "4"]);
    let auth = web.auth();
    let headers = [("Origin", ORIGIN), ("Authorization", auth.as_str())];
    let kept: Vec<Ws> = (0..2).map(|_| web.ws()).collect();
    match Ws::connect(web.port, &headers) {
        Err(status) => assert_eq!(status, 503),
        Ok(_) => panic!("a third WebSocket was let in with --max-connections 4"),
    }
    let t = Instant::now();
    let r = request(
        web.port,
        "GET",
        "/web/health",
        &[("Authorization", auth.as_str())],
        b"",
    );
    assert_eq!(r.status, 200);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // One closed, a new one is let in.
    drop(kept);
    std::thread::sleep(Duration::from_millis(300));
    let mut ws = web.ws();
    assert!(matches!(ws.call(&Request::Tree), Response::Tree { .. }));
}

/// A body that stops arriving is answered 408 within the body deadline
/// (10 s) and its connection closed: it held its slot for good.
#[test]
fn web_a_body_that_stops_arriving_is_a_408() {
    let (_d, web) = web_daemon(&[]);
    let mut s = connect(web.port);
    let auth = web.auth();
    let t = Instant::now();
    s.write_all(
        format!(
            "POST /web/rpc HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nAuthorization: {auth}\r\n\
             X-Superfluid-CSRF: {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{",
            web.port, web.token
        )
        .as_bytes(),
    )
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let (status, _, _) = read_head(&mut s);
    let waited = t.elapsed();
    assert_eq!(status, 408);
    assert!(
        waited >= Duration::from_secs(9) && waited < Duration::from_secs(20),
        "{waited:?}"
    );
}

/// A path or method no route serves answers 404 with the transport's JSON
/// error (docs/web.md: every non-200 status has one); it had an empty body.
#[test]
fn web_a_path_no_route_serves_is_a_json_404() {
    let (_d, web) = web_daemon(&[]);
    let auth = web.auth();
    for (method, path) in [
        ("GET", "/web/rpc"),
        ("GET", "/web/nope"),
        ("PUT", "/web/stream"),
    ] {
        let r = request(
            web.port,
            method,
            path,
            &[("Authorization", auth.as_str())],
            b"",
        );
        assert_eq!(r.status, 404, "{method} {path}");
        let said = r.json()["Err"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert_eq!(said, format!("no route serves {method} {path}"));
    }
}

/// A frame that breaks the protocol (a continuation with nothing to
/// continue) gets an `Err` frame, then a Close saying 1002 (RFC 6455 7.4.1);
/// it said 1000, a normal closure.
#[test]
fn web_ws_a_protocol_error_is_closed_with_1002() {
    use tungstenite::protocol::frame::coding::{CloseCode, Data, OpCode};
    use tungstenite::protocol::frame::Frame;
    let (_d, web) = web_daemon(&[]);
    let mut ws = web.ws();
    ws.ws
        .send(tungstenite::Message::Frame(Frame::message(
            b"stray".to_vec(),
            OpCode::Data(Data::Continue),
            true,
        )))
        .unwrap();
    let mut said = None;
    let code = loop {
        match ws.ws.read() {
            Ok(tungstenite::Message::Text(t)) => said = Some(t.to_string()),
            Ok(tungstenite::Message::Close(frame)) => break frame.map(|f| f.code),
            Ok(_) => continue,
            Err(e) => panic!("no Close from the server: {e}"),
        }
    };
    assert!(
        said.as_deref()
            .is_some_and(|t| t.contains("closing the connection")),
        "{said:?}"
    );
    assert_eq!(code, Some(CloseCode::Protocol));
}

/// What a /web/ws reader holds for its busy request loop is bounded in
/// count as well as bytes: two million empty frames sent behind a running
/// `Generate` took the daemon from 52 to 653 MB when only their bytes (0)
/// were counted; now reading stops at 1,024 held, and the sender waits.
#[test]
fn web_ws_read_ahead_is_bounded_in_frames() {
    let (d, web) = web_daemon(&[]);
    let (mut ws, _) = generating(&web);
    let before = crate::isolation::rss_mib(d.pid());
    // Masked empty text frames, written raw; the writes stop once the
    // daemon stops reading.
    let frames = [0x81u8, 0x80, 0, 0, 0, 0].repeat(2_000_000);
    let tcp = ws.ws.get_mut();
    tcp.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = tcp.write_all(&frames);
    std::thread::sleep(Duration::from_millis(500));
    let grown = crate::isolation::rss_mib(d.pid()).saturating_sub(before);
    assert!(
        grown < 40,
        "the daemon grew {grown} MiB holding empty frames"
    );
}

/// A WebSocket client that sends nothing, not even a Pong to the Pings the
/// daemon sends after 20 s of silence, is closed at 60 s, and its slot
/// freed: such connections held the listener's slots for good.
#[test]
fn web_ws_a_silent_client_is_pinged_then_closed() {
    let (_d, web) = web_daemon(&["--max-connections", "2"]);
    let mut ws = web.ws();
    std::thread::sleep(Duration::from_secs(65));
    ws.ws
        .get_mut()
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut pings = 0;
    let closed = loop {
        match ws.ws.read() {
            Ok(tungstenite::Message::Ping(_)) => pings += 1,
            Ok(tungstenite::Message::Close(_)) => break true,
            Ok(_) => continue,
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break false
            }
            Err(_) => break true,
        }
    };
    assert!(pings >= 1, "no Ping in 65 s of silence");
    assert!(closed, "a silent WebSocket is still open after 65 s");
    // Its slot is free again (one WebSocket with --max-connections 2).
    let mut again = web.ws();
    assert!(matches!(again.call(&Request::Tree), Response::Tree { .. }));
}
