//! Subscription fan-out over the browser transport: 64 WebSocket clients on
//! `/web/ws`, each subscribed to one of 4 sessions (16 each), while the 4
//! sessions generate continuously over the unix socket for 60 s (`--quick`:
//! 10 s).
//!
//! `cargo bench --bench subscribers` (add `-- --quick` for a smoke run).
//! Reports, as a markdown table:
//! - events/s delivered: `SubEvent`s read by all 64 clients together, over
//!   the generating window;
//! - delivery delay: when a client read an event (its wall clock) minus the
//!   event's `ts_unix_ms` (the daemon's clock at commit; same machine), p50,
//!   p90, p99 and max. The daemon stamps `ts_unix_ms` when it plans the
//!   record, before the WAL write and its fsync, so the delay includes them;
//! - the rates are over the generating window: from the first Generate to
//!   the end of the last one (a generation running at the deadline finishes);
//! - gaps: every client's event ids must run without a gap from its cursor
//!   to the session's last event; a client that missed an id, saw one twice,
//!   or was ended as `lagged` counts.
//!
//! The WebSocket client is tungstenite's, as in tests/tests/web.rs.

use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use superfluid::frontend::socket::Client;
use superfluid::wire::{Finish, Params, Request, Response, Role};

#[path = "common.rs"]
#[allow(dead_code)] // the engine half is the in-process benches'
mod common;
use common::Daemon;

const SESSIONS: usize = 4;
const SUBSCRIBERS: usize = 64;
const MAX_TOKENS: u32 = 128;
const THREADS: u32 = 2;
const CTX: u32 = 16384;
const ORIGIN: &str = "http://localhost:5173";
const IO_TIMEOUT: Duration = Duration::from_secs(60);
const QUESTION: &str = "Write a long story about a lighthouse keeper and a storm.";

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

// ---- the daemon --------------------------------------------------------------

/// The daemon, with its browser transport's port and token.
struct Web {
    daemon: Daemon,
    web_port: u16,
    token: String,
}

impl Web {
    fn start() -> Web {
        let daemon = Daemon::start(
            &[
                "--threads",
                &THREADS.to_string(),
                "--ctx-size",
                &CTX.to_string(),
                "--parallel",
                &SESSIONS.to_string(),
                "--web",
                "127.0.0.1:0",
                "--web-origin",
                ORIGIN,
            ],
            &[],
        );
        let out = std::fs::read_to_string(daemon.dir.path().join("stdout")).unwrap();
        let marker = "listening on http://127.0.0.1:";
        let rest = &out[out.find(marker).expect("no web listener in stdout") + marker.len()..];
        let web_port = rest[..rest.find(|c: char| !c.is_ascii_digit()).unwrap()]
            .parse()
            .unwrap();
        let token = std::fs::read_to_string(daemon.dir.path().join("sessions/web-token"))
            .unwrap()
            .trim()
            .to_string();
        Web {
            daemon,
            web_port,
            token,
        }
    }
}

// ---- the WebSocket client (tungstenite) -----------------------------------

/// The reading half of a WebSocket.
struct WsReader {
    ws: tungstenite::WebSocket<TcpStream>,
}

/// The writing half of a WebSocket: a second tungstenite client over the
/// same connection, used only to send.
struct WsWriter {
    ws: tungstenite::WebSocket<TcpStream>,
}

fn ws_connect(port: u16, token: &str) -> (WsReader, WsWriter) {
    use tungstenite::client::IntoClientRequest;
    use tungstenite::http::HeaderValue;
    let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s.set_nodelay(true).unwrap();
    let mut req = format!("ws://127.0.0.1:{port}/web/ws")
        .into_client_request()
        .unwrap();
    let h = req.headers_mut();
    h.insert(
        "Sec-WebSocket-Protocol",
        HeaderValue::from_static("superfluid.v1"),
    );
    h.insert("Origin", HeaderValue::from_static(ORIGIN));
    h.insert(
        "Authorization",
        HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
    );
    let w = s.try_clone().unwrap();
    let (ws, _) = tungstenite::client(req, s).expect("the WebSocket was refused");
    let writer =
        tungstenite::WebSocket::from_raw_socket(w, tungstenite::protocol::Role::Client, None);
    (WsReader { ws }, WsWriter { ws: writer })
}

impl WsWriter {
    fn send(&mut self, request: &Request) {
        let text = serde_json::to_string(request).unwrap();
        self.ws.send(tungstenite::Message::text(text)).unwrap();
    }
}

impl WsReader {
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

    fn recv(&mut self) -> Option<Response> {
        let text = self.recv_text()?;
        Some(serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
    }
}

// ---- the workload ------------------------------------------------------------

/// What one subscriber saw.
struct Seen {
    session: usize,
    cursor: u64,
    ids: Vec<u64>,
    delays_ms: Vec<i64>,
    ended: Option<String>,
}

/// Reads `SubEvent`s until `SubEnded` (or the connection ends).
fn subscriber(mut ws: WsReader, session: usize, cursor: u64, sub: u64) -> Seen {
    let mut seen = Seen {
        session,
        cursor,
        ids: Vec::new(),
        delays_ms: Vec::new(),
        ended: None,
    };
    while let Some(reply) = ws.recv() {
        match reply {
            Response::SubEvent { sub: got, event } => {
                let at = now_ms();
                assert_eq!(got, sub);
                seen.ids.push(event.event_id);
                seen.delays_ms.push(at as i64 - event.ts_unix_ms as i64);
            }
            Response::SubEnded { reason, .. } => {
                seen.ended = Some(reason);
                break;
            }
            Response::Unsubscribed => {}
            other => panic!("subscriber {sub}: {other:?}"),
        }
    }
    seen
}

/// One session generating until `until`: a user message, then Generate,
/// continuing a turn cut by max_tokens. Returns (tokens, generations).
fn generator(socket: &Path, session: u64, until: Instant) -> (u64, u64) {
    let mut c = Client::connect(socket).expect("connect");
    let (mut tokens, mut generations) = (0, 0);
    let mut open = false;
    while Instant::now() < until {
        if !open {
            match c
                .call(&Request::AppendMessage {
                    session,
                    role: Role::User.into(),
                    text: QUESTION.into(),
                })
                .unwrap()
            {
                Response::Committed { .. } => {}
                other => panic!("AppendMessage: {other:?}"),
            }
        }
        let replies = c
            .generate(&Request::Generate {
                session,
                max_tokens: MAX_TOKENS,
            })
            .unwrap();
        match replies.last() {
            Some(Response::Generated {
                tokens_generated,
                finish: f,
                ..
            }) => {
                tokens += tokens_generated;
                generations += 1;
                open = *f == Finish::MaxTokens;
            }
            other => panic!("session {session}: Generate ended with {other:?}"),
        }
    }
    (tokens, generations)
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let secs = if quick { 10 } else { 60 };
    let d = Web::start();
    let mut c = Client::connect(&d.daemon.socket).expect("connect");

    // The sessions, each with a system message; subscribers start at the
    // next id, so everything they read is live.
    let mut sessions = Vec::new();
    let mut cursors = Vec::new();
    for i in 0..SESSIONS {
        let Ok(Response::Created { session }) = c.call(&Request::Create {
            parent: None,
            params: Params {
                temperature: 0.8,
                top_p: 0.95,
                min_p: 0.0,
                top_k: 0,
                seed: 1 + i as u64,
            },
        }) else {
            panic!("Create")
        };
        let reply = c
            .call(&Request::AppendMessage {
                session,
                role: Role::System.into(),
                text: "You are a helpful assistant.".into(),
            })
            .unwrap();
        let Response::Committed { event } = reply else {
            panic!("AppendMessage: {reply:?}")
        };
        sessions.push(session);
        cursors.push(event.event_id + 1);
    }

    let mut writers = Vec::new();
    let mut readers = Vec::new();
    for i in 0..SUBSCRIBERS {
        let k = i % SESSIONS;
        let (mut r, mut w) = ws_connect(d.web_port, &d.token);
        w.send(&Request::Subscribe {
            session: sessions[k],
            cursor: cursors[k],
            provisional: false,
        });
        let Some(Response::Subscribed { sub }) = r.recv() else {
            panic!("Subscribe")
        };
        writers.push((w, sub));
        let cursor = cursors[k];
        readers.push(std::thread::spawn(move || subscriber(r, k, cursor, sub)));
    }

    let start = Instant::now();
    let until = start + Duration::from_secs(secs);
    let generators: Vec<_> = sessions
        .iter()
        .map(|&s| {
            let socket = d.daemon.socket.clone();
            std::thread::spawn(move || generator(&socket, s, until))
        })
        .collect();
    let (mut tokens, mut generations) = (0, 0);
    for g in generators {
        let (t, n) = g.join().unwrap();
        tokens += t;
        generations += n;
    }
    let window = start.elapsed().as_secs_f64();

    // Every session's last id, then end the subscriptions: each reader
    // reads to its SubEnded.
    let mut ends = Vec::new();
    for &session in &sessions {
        let Ok(Response::Inspection { inspection }) = c.call(&Request::Inspect { session }) else {
            panic!("Inspect")
        };
        ends.push(inspection.events);
    }
    // Let the last commits reach every subscriber before unsubscribing.
    std::thread::sleep(Duration::from_millis(500));
    for (w, sub) in &mut writers {
        w.send(&Request::Unsubscribe { sub: *sub });
    }
    let seen: Vec<Seen> = readers.into_iter().map(|r| r.join().unwrap()).collect();

    let mut delays: Vec<i64> = Vec::new();
    let mut delivered = 0usize;
    let mut missed = 0usize;
    let mut lagged = 0usize;
    for s in &seen {
        delivered += s.ids.len();
        delays.extend_from_slice(&s.delays_ms);
        let expected: Vec<u64> = (s.cursor..ends[s.session]).collect();
        if s.ids != expected {
            missed += 1;
            let first_bad = s.ids.iter().zip(&expected).position(|(a, b)| a != b);
            eprintln!(
                "subscriber on session {}: {} ids, expected {} (from {}); first difference at {:?}",
                sessions[s.session],
                s.ids.len(),
                expected.len(),
                s.cursor,
                first_bad
            );
        }
        if s.ended.as_deref() != Some("unsubscribed") {
            lagged += 1;
            eprintln!(
                "subscriber on session {} ended with {:?}",
                sessions[s.session], s.ended
            );
        }
    }
    delays.sort_unstable();
    let events: u64 = ends.iter().zip(&cursors).map(|(e, c)| e - c).sum();

    println!(
        "subscriber fan-out: SmolLM2-135M-Instruct Q4_1, {THREADS} threads, {SESSIONS} sessions \
         generating for {secs} s ({window:.1} s with the last generations' ends; {generations} \
         generations, {tokens} tokens, {:.1} tokens/s), {SUBSCRIBERS} WebSocket subscribers \
         ({} per session)\n",
        tokens as f64 / window,
        SUBSCRIBERS / SESSIONS
    );
    println!("| measure | value |");
    println!("|---|---:|");
    println!(
        "| events committed (4 sessions) | {events} ({:.1}/s) |",
        events as f64 / window
    );
    println!(
        "| events delivered (64 subscribers) | {delivered} ({:.1}/s) |",
        delivered as f64 / window
    );
    println!(
        "| delivery delay after commit, p50 | {} ms |",
        percentile(&delays, 0.50)
    );
    println!(
        "| delivery delay after commit, p90 | {} ms |",
        percentile(&delays, 0.90)
    );
    println!(
        "| delivery delay after commit, p99 | {} ms |",
        percentile(&delays, 0.99)
    );
    println!(
        "| delivery delay after commit, max | {} ms |",
        delays.last().copied().unwrap_or(0)
    );
    println!("| subscribers that missed an id | {missed} of {SUBSCRIBERS} |");
    println!(
        "| subscribers not ended by their Unsubscribe (lagged, closed) | {lagged} of {SUBSCRIBERS} |"
    );
    if missed > 0 || lagged > 0 {
        std::process::exit(1);
    }
}
