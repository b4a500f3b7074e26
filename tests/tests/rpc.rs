//! A model's layers across hosts (`serve --rpc`): two llama.cpp
//! `ggml-rpc-server` processes on loopback ports stand in for two hosts.
//! The same sessions, forks and SIGKILL restart give the same greedy replies
//! as on one machine; a server killed under a generation fails it with an
//! error naming the server, the model refuses work (and Metrics says why)
//! until the server is back, then serves again.
//!
//! The servers are `$SUPERFLUID_RPC_SERVER`, built by
//! `scripts/build-llama-tool.sh ggml-rpc-server` (scripts/test.sh sets it).

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use superfluid::frontend::socket::Client;
use superfluid::wire::{Request, Response, SessionId};

use crate::util::{children_of, commit, created, generate_text, params, web_health, TestDaemon};

/// The two tests run one at a time: run together, a server of the lost-server
/// test died under its worker's load within a second of its start (2 of 9
/// runs under load, "Remote RPC server crashed"), never with the test alone
/// (5 of 5).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// One `ggml-rpc-server` on a loopback port, killed when dropped.
struct RpcServer {
    port: u16,
    child: Option<Child>,
    log: PathBuf,
}

fn rpc_server_bin() -> PathBuf {
    std::env::var_os("SUPERFLUID_RPC_SERVER")
        .map(PathBuf::from)
        .expect(
            "SUPERFLUID_RPC_SERVER is not set: build llama.cpp's RPC server with \
             `scripts/build-llama-tool.sh ggml-rpc-server` and set it to the path printed \
             (scripts/test.sh does both)",
        )
}

impl RpcServer {
    fn start(dir: &std::path::Path) -> RpcServer {
        for _ in 0..5 {
            // A port the kernel just handed out and took back: free for the
            // server, unless another test's server took it meanwhile (then
            // this one exits at once, and another port is tried).
            let port = TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let mut s = RpcServer {
                port,
                child: None,
                log: dir.join(format!("rpc-{port}.log")),
            };
            if s.spawn() {
                return s;
            }
        }
        panic!("ggml-rpc-server found no free port in 5 tries");
    }

    /// Starts the server on its port; false when it exited instead of
    /// listening (the port is taken). What answers the port is then this
    /// process, not another test's.
    fn spawn(&mut self) -> bool {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let endpoint = self.endpoint();
        // Held from the start, so Drop kills it whatever happens below.
        let child = self.child.insert(
            Command::new(rpc_server_bin())
                .args(["-H", "127.0.0.1", "-p", &self.port.to_string(), "-t", "1"])
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .stdin(Stdio::null())
                .spawn()
                .expect("starting ggml-rpc-server"),
        );
        let until = Instant::now() + Duration::from_secs(10);
        let listening = loop {
            if child.try_wait().unwrap().is_some() {
                break false;
            }
            if TcpStream::connect(&endpoint).is_ok() {
                // Still alive a while after something answers: it is the
                // listener (one that lost the port exits at once; this
                // CPU build binds within milliseconds of its start).
                std::thread::sleep(Duration::from_millis(200));
                break child.try_wait().unwrap().is_none();
            }
            assert!(Instant::now() < until, "ggml-rpc-server did not listen");
            std::thread::sleep(Duration::from_millis(20));
        };
        if !listening {
            self.kill();
        }
        listening
    }

    fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether its process still runs.
    fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    /// What it printed, for a failure's message.
    fn log(&self) -> String {
        format!(
            "{}'s log:\n{}",
            self.endpoint(),
            std::fs::read_to_string(&self.log).unwrap_or_default()
        )
    }

    /// The connections it accepted (it logs each).
    fn clients(&self) -> usize {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .matches("Accepted client connection")
            .count()
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A daemon with `extra`, and no turn opening decoded ahead: whether a next
/// turn came before `--turn-warm-ms` is timing, and the prompt's batch shape
/// with it, so two runs compared token for token could differ by a greedy
/// near-tie (seen under load: "three great mountains" / "three great
/// wonders").
fn daemon(extra: &[String]) -> TestDaemon {
    let mut d = TestDaemon::new();
    d.extra_args = extra.to_vec();
    d.extra_args
        .extend(["--turn-warm-ms".into(), "3600000".into()]);
    d.spawn_and_wait();
    d
}

/// A daemon on the `--rpc` servers `servers` (and a web listener, for
/// `/web/health`), its client, and a session asked `text`.
fn asked_over_rpc(servers: String, text: &str) -> (TestDaemon, Client, SessionId) {
    let d = daemon(&[
        "--rpc".into(),
        servers,
        "--web".into(),
        "127.0.0.1:0".into(),
    ]);
    let mut c = d.client();
    let s = created(
        &mut c,
        Request::Create {
            parent: None,
            params: params(5),
        },
    );
    ask(&mut c, s, text);
    (d, c, s)
}

fn ask(c: &mut Client, s: SessionId, text: &str) -> u64 {
    commit(
        c,
        Request::AppendMessage {
            session: s,
            role: 1,
            text: text.into(),
        },
    )
    .event_id
}

/// A conversation, a fork of it, a SIGKILL and restart, and a next turn on
/// both: the replies, in order.
fn conversation(d: &mut TestDaemon) -> Vec<String> {
    let mut c = d.client();
    let s = created(
        &mut c,
        Request::Create {
            parent: None,
            params: params(3),
        },
    );
    let asked = ask(&mut c, s, "Name three rivers of Europe.");
    let mut replies = vec![generate_text(&mut c, s, 24).expect("turn 1")];
    let f = created(
        &mut c,
        Request::Fork {
            session: s,
            at_event: asked,
            params: None,
        },
    );
    ask(&mut c, f, "And three mountains?");
    replies.push(generate_text(&mut c, f, 24).expect("the fork's turn"));
    d.kill9();
    d.spawn_and_wait();
    let mut c = d.client();
    ask(&mut c, s, "Which is the longest?");
    replies.push(generate_text(&mut c, s, 24).expect("turn 2 after the restart"));
    replies.push(generate_text(&mut c, f, 8).expect("the fork, continued after the restart"));
    replies
}

/// The `--rpc` the daemon's worker was started with.
/// The `--rpc` argument of the daemon's worker. The worker is spawned
/// beside the daemon's start, not before it answers: looked for until it
/// is there (a worker without the argument is `None` once it is).
fn worker_rpc_arg(d: &TestDaemon) -> Option<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let workers: Vec<Vec<String>> = children_of(d.pid())
            .into_iter()
            .filter_map(|pid| {
                let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
                let args: Vec<String> = cmd
                    .split(|b| *b == 0)
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect();
                args.iter().any(|a| a == "worker").then_some(args)
            })
            .collect();
        if let Some(args) = workers.first() {
            let arg = args
                .iter()
                .position(|a| a == "--rpc")
                .and_then(|i| args.get(i + 1).cloned());
            if arg.is_none() {
                eprintln!("a worker without --rpc: {args:?}");
            }
            return arg;
        }
        if std::time::Instant::now() > deadline {
            eprintln!(
                "no worker after 30 s; the daemon's children: {:?}",
                children_of(d.pid())
                    .iter()
                    .map(
                        |pid| std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                            .unwrap_or_default()
                            .replace('\0', " ")
                    )
                    .collect::<Vec<_>>()
            );
            eprintln!("the daemon's stderr:\n{}", d.stderr());
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn metrics(d: &TestDaemon) -> String {
    match d.call(&Request::Metrics) {
        Response::Text { text } => text,
        other => panic!("Metrics: {other:?}"),
    }
}

#[test]
fn a_model_across_two_rpc_servers_answers_as_it_does_here() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut here = daemon(&[]);
    let expected = conversation(&mut here);
    drop(here);

    let dir = tempfile::tempdir().unwrap();
    for split in [None, Some("1,3,2")] {
        // Servers of its own for each daemon: a worker killed with its
        // daemon (conversation's SIGKILL, the drop below) while a server
        // replies can kill that server with SIGPIPE (ggml-rpc writes
        // without MSG_NOSIGNAL; seen as exit status 13 under load), and the
        // next daemon found it gone.
        let (a, b) = (RpcServer::start(dir.path()), RpcServer::start(dir.path()));
        let servers = format!("{},{}", a.endpoint(), b.endpoint());
        let mut args = vec!["--rpc".to_string(), servers.clone()];
        if let Some(w) = split {
            // The last weight keeps a third of the layers on this machine.
            args.extend(["--tensor-split".into(), w.into()]);
        }
        let (before_a, before_b) = (a.clients(), b.clients());
        let mut d = daemon(&args);
        assert_eq!(worker_rpc_arg(&d).as_deref(), Some(servers.as_str()));
        let got = conversation(&mut d);
        assert_eq!(got, expected, "--tensor-split {split:?}");
        // Both servers served the model's layers, to each worker started.
        assert!(a.clients() > before_a && b.clients() > before_b);
        assert!(
            d.stderr().contains(&format!(
                "placing {} layers on 2 RPC servers",
                if split.is_some() { 21 } else { 31 }
            )),
            "{}",
            d.stderr()
        );
        let m = metrics(&d);
        for s in [&a, &b] {
            assert!(
                m.contains(&format!(
                    "superfluid_rpc_server_up{{server=\"{}\"}} 1",
                    s.endpoint()
                )),
                "{m}"
            );
        }
    }
}

#[test]
fn a_lost_rpc_server_fails_the_generation_then_the_model_refuses_until_it_is_back() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let (mut a, b) = (RpcServer::start(dir.path()), RpcServer::start(dir.path()));
    let (d, mut c, s) = asked_over_rpc(
        format!("{},{}", a.endpoint(), b.endpoint()),
        "Tell me a long story about a lighthouse keeper.",
    );
    assert!(web_health(&d).contains(r#""rpc":{"servers":2,"up":2}"#));
    let socket = d.socket.clone();
    let gen = std::thread::spawn(move || {
        let mut c = Client::connect(&socket).unwrap();
        generate_text(&mut c, s, 2000)
    });
    // Killed once the generation has committed tokens, far from its end.
    d.until_generated(s);
    a.kill();
    let failed = gen.join().unwrap();
    let message = failed.expect_err("the generation under the lost server fails");
    assert!(
        message.contains(&a.endpoint()) && message.contains("cannot be reached"),
        "{message}; the daemon's stderr:\n{}\n{}\n{}",
        d.stderr(),
        a.log(),
        b.log()
    );

    // Refused at once, naming the server, while it is down; Metrics says so.
    let started = Instant::now();
    let refused = generate_text(&mut c, s, 8).expect_err("refused while the server is down");
    assert!(
        refused.contains(&a.endpoint()) && refused.contains("refuses work"),
        "{refused}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "refused at once"
    );
    let m = metrics(&d);
    assert!(
        m.contains("superfluid_lane_state{state=\"unreachable\"} 1"),
        "{m}"
    );
    assert!(
        m.contains(&format!(
            "superfluid_rpc_server_up{{server=\"{}\"}} 0",
            a.endpoint()
        )),
        "{m}"
    );
    assert!(
        m.contains(&format!(
            "superfluid_rpc_server_up{{server=\"{}\"}} 1",
            b.endpoint()
        )),
        "{m}"
    );

    let health = web_health(&d);
    assert!(
        health.contains(r#""lane":"unreachable""#)
            && health.contains(r#""rpc":{"servers":2,"up":1}"#),
        "{health}"
    );

    // Back on the same port: the lane starts a worker, and the session goes on.
    assert!(a.spawn(), "the port was taken while the server was down");
    let until = Instant::now() + Duration::from_secs(30);
    while !metrics(&d).contains("superfluid_lane_state{state=\"ready\"} 1") {
        assert!(Instant::now() < until, "the lane did not come back");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(web_health(&d).contains(r#""rpc":{"servers":2,"up":2}"#));
    let text = generate_text(&mut c, s, 8).expect("served again");
    assert!(!text.is_empty());
    let events = d.read_all(s);
    assert!(events.iter().all(|e| e.event_id < events.len() as u64));
}

#[test]
fn a_listener_that_never_answers_the_hello_is_not_a_server() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    // Listening, never accepting: a connect succeeds (the kernel completes
    // the handshake), as it does for a moment on a server just killed.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent = silent
        .local_addr()
        .map(|a| (silent, a.to_string()))
        .unwrap();
    let b = RpcServer::start(dir.path());
    let (d, mut c, s) = asked_over_rpc(format!("{},{}", silent.1, b.endpoint()), "Hello.");
    // Held until the first probe is back, then refused naming the listener
    // (a worker started against it would wait for its hello for ever).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(generate_text(&mut c, s, 8)));
    let refused = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("no answer in 60 s; the daemon's stderr:\n{}", d.stderr()))
        .expect_err("refused: no server answers there");
    assert!(
        refused.contains(&silent.1) && refused.contains("no RPC answer within 2 s"),
        "{refused}; the daemon's stderr:\n{}",
        d.stderr()
    );
    let m = metrics(&d);
    assert!(
        m.contains(&format!(
            "superfluid_rpc_server_up{{server=\"{}\"}} 0",
            silent.1
        )) && m.contains(&format!(
            "superfluid_rpc_server_up{{server=\"{}\"}} 1",
            b.endpoint()
        )),
        "{m}"
    );
    assert!(
        !d.stderr().contains("started (pid"),
        "a worker started against a server that never answered:\n{}",
        d.stderr()
    );
}

/// A server busy with another client (it serves one at a time) is down for
/// the lane, and its probe's hello is not closed on: closed, the server's
/// reply once free met a reset and killed it (SIGPIPE: ggml-rpc writes
/// without MSG_NOSIGNAL). Freed, it answers the kept hello, lives on, and
/// the model serves.
#[test]
fn a_probe_of_a_busy_server_waits_for_its_answer_and_leaves_it_alive() {
    use std::io::{Read, Write};
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let mut a = RpcServer::start(dir.path());
    // Another client: its hello answered, the server waits for its commands.
    let mut other = TcpStream::connect(a.endpoint()).unwrap();
    other
        .write_all(&superfluid::engine::rpc::hello_request())
        .unwrap();
    let mut reply = [0u8; 8 + superfluid::engine::rpc::HELLO_REPLY];
    other.read_exact(&mut reply).unwrap();
    let (d, mut c, s) = asked_over_rpc(a.endpoint(), "Hello.");
    let refused = generate_text(&mut c, s, 4).expect_err("refused while the server is busy");
    assert!(
        refused.contains(&a.endpoint()) && refused.contains("no RPC answer within 2 s"),
        "{refused}"
    );
    // Probes every second meanwhile; then the other client leaves.
    std::thread::sleep(Duration::from_secs(3));
    drop(other);
    let until = Instant::now() + Duration::from_secs(30);
    while !metrics(&d).contains("superfluid_lane_state{state=\"ready\"} 1") {
        assert!(
            a.alive() && Instant::now() < until,
            "the server died or the lane did not come back (alive: {}); {}\nthe daemon's stderr:\n{}",
            a.alive(),
            a.log(),
            d.stderr()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(a.alive());
    assert!(!generate_text(&mut c, s, 4).expect("served").is_empty());
}
