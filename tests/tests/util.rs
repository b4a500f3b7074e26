//! The one harness of the integration tests: `TestDaemon`, a real
//! `superfluid serve` on the real model's vocabulary, in a temp directory of
//! its own (sessions dir and socket inside), with kill and restart helpers;
//! `shared_daemon`, the one daemon the tests that only read or validate
//! share; the test models (the default one and those
//! scripts/make-test-models.py derives from it); request helpers; raw
//! frames; the WAL's record walk; a forced tool call on the tools model.
//!
//! A test that only reads or validates takes `shared_daemon()` and works on
//! sessions it creates; a test that stops, kills, restarts or needs other
//! arguments or an empty daemon starts its own `TestDaemon`. To count the
//! daemons a run starts, set `SUPERFLUID_TEST_SPAWN_LOG` to a file and `wc
//! -l` it afterwards.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use superfluid::frontend::socket::Client;
use superfluid::store::{FILE_HEADER_LEN, MARKER_FLAG, RECORD_HEADER_LEN, WAL_MAGIC};
use superfluid::wire::{
    read_frame_blocking, to_postcard, write_frame_blocking, Event, Finish, Params, Record, Request,
    Response, Role, SessionId, MAX_FRAME_BYTES,
};

/// How long a daemon may take to accept on its socket.
const START_TIMEOUT_MS: u64 = 20_000;
/// How long `stop` waits for a clean exit after SIGTERM.
const STOP_TIMEOUT_MS: u64 = 20_000;
/// How long a daemon expected to fail may run before we call it a hang.
const FAIL_TIMEOUT_MS: u64 = 20_000;
/// When set, every `serve` the harness spawns appends one line to this file:
/// how the daemons a run starts are counted (`wc -l`).
const SPAWN_LOG_ENV: &str = "SUPERFLUID_TEST_SPAWN_LOG";

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_superfluid")
}

/// Greedy params with a fixed seed.
pub fn params(seed: u64) -> Params {
    Params::greedy(seed)
}

/// What a daemon expected to fail left behind.
#[derive(Debug)]
pub struct Failed {
    pub status: ExitStatus,
    pub stderr: String,
}

impl Failed {
    /// The start was refused because the daemon `pid` holds the directory.
    pub fn assert_locked_by(&self, pid: u32) {
        assert!(!self.status.success());
        assert!(
            self.stderr.contains("in use by another superfluid daemon")
                && self.stderr.contains(&format!("pid {pid}")),
            "{}",
            self.stderr
        );
    }
}

pub struct TestDaemon {
    dir: tempfile::TempDir,
    pub sessions: PathBuf,
    pub socket: PathBuf,
    child: Option<Child>,
    /// Counts starts, so each start's output goes to its own files.
    starts: u32,
    /// Extra arguments of `serve` (e.g. `--sessions-cache`).
    pub extra_args: Vec<String>,
    /// The model `serve` loads (the default model unless a test sets another).
    pub model: PathBuf,
    /// `RUST_LOG` of `serve` (`info` unless a test sets another).
    pub rust_log: String,
    /// More environment variables of `serve`.
    pub env: Vec<(String, String)>,
    /// The binary `serve` runs from (the built one unless a test sets a copy).
    pub binary: PathBuf,
    /// SIGKILL the daemon when the thread that spawned it exits (the shared
    /// daemon, which no `Drop` ever stops).
    die_with_spawner: bool,
}

impl TestDaemon {
    /// A temp dir with nothing started yet.
    pub fn new() -> TestDaemon {
        let dir = tempfile::Builder::new()
            .prefix("sf-test")
            .tempdir()
            .expect("tempdir");
        let sessions = dir.path().join("sessions");
        let socket = dir.path().join("sf.sock");
        TestDaemon {
            dir,
            sessions,
            socket,
            child: None,
            starts: 0,
            extra_args: Vec::new(),
            model: model_path(),
            rust_log: "info".into(),
            env: Vec::new(),
            binary: PathBuf::from(bin()),
            die_with_spawner: false,
        }
    }

    /// A new temp dir with a daemon started in it.
    pub fn start() -> TestDaemon {
        let mut d = TestDaemon::new();
        d.spawn_and_wait();
        d
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn wal_path(&self) -> PathBuf {
        self.sessions.join("wal.log")
    }

    pub fn wal_bytes(&self) -> Vec<u8> {
        std::fs::read(self.wal_path()).expect("reading wal.log")
    }

    fn out_paths(&self, n: u32) -> (PathBuf, PathBuf) {
        (
            self.dir.path().join(format!("stdout.{n}")),
            self.dir.path().join(format!("stderr.{n}")),
        )
    }

    /// Spawns `serve` with the given sessions dir and socket; stdout and
    /// stderr go to files in the temp dir.
    fn spawn_with(&mut self, sessions: &Path, socket: &Path, extra: &[String]) -> (Child, PathBuf) {
        self.starts += 1;
        count_spawn(&format!("serve {}", sessions.display()));
        let (out, err) = self.out_paths(self.starts);
        let mut cmd = Command::new(&self.binary);
        if self.die_with_spawner {
            let parent = std::process::id();
            // SAFETY: prctl, getppid and _exit are async-signal-safe; nothing
            // else runs between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    // The test process died before the prctl: do not serve forever.
                    if libc::getppid() as u32 != parent {
                        libc::_exit(1);
                    }
                    Ok(())
                })
            };
        }
        let child = cmd
            .arg("serve")
            .arg(&self.model)
            .arg("--sessions")
            .arg(sessions)
            .arg("--socket")
            .arg(socket)
            .args(extra)
            .env("RUST_LOG", &self.rust_log)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .expect("spawning superfluid serve");
        (child, err)
    }

    /// Starts the daemon and waits until it answers a `List`: a reply means
    /// the accept loop runs, which happens only after the SIGTERM handler is
    /// installed, so `stop` right after is a clean stop.
    pub fn spawn_and_wait(&mut self) {
        assert!(self.child.is_none(), "a daemon is already running");
        let (sessions, socket, extra) = (
            self.sessions.clone(),
            self.socket.clone(),
            self.extra_args.clone(),
        );
        let (mut child, err) = self.spawn_with(&sessions, &socket, &extra);
        let deadline = Instant::now() + Duration::from_millis(START_TIMEOUT_MS);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "the daemon exited during start ({status}); stderr:\n{}",
                    std::fs::read_to_string(&err).unwrap_or_default()
                );
            }
            if let Ok(mut c) = Client::connect(&self.socket) {
                if let Ok(Response::Sessions { .. }) = c.call(&Request::List) {
                    break;
                }
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "the daemon did not answer on {} within {START_TIMEOUT_MS} ms; stderr:\n{}",
                    self.socket.display(),
                    std::fs::read_to_string(&err).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.child = Some(child);
    }

    /// The stderr of the latest start.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.out_paths(self.starts).1).unwrap_or_default()
    }

    /// The stdout of the latest start.
    pub fn stdout(&self) -> String {
        std::fs::read_to_string(self.out_paths(self.starts).0).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("no daemon running").id()
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.socket).expect("connecting to the daemon")
    }

    /// One request on a fresh connection.
    pub fn call(&self, req: &Request) -> Response {
        self.client().call(req).expect("calling the daemon")
    }

    /// SIGKILL, then reap.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("no daemon running");
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
        child.wait().unwrap();
    }

    /// SIGTERM, and wait for exit status 0.
    pub fn stop(&mut self) {
        let mut child = self.child.take().expect("no daemon running");
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let status = wait_timeout(&mut child, STOP_TIMEOUT_MS).unwrap_or_else(|| {
            panic!(
                "the daemon did not exit after SIGTERM; stderr:\n{}",
                self.stderr()
            )
        });
        assert!(
            status.success(),
            "the daemon exited with {status} after SIGTERM; stderr:\n{}",
            self.stderr()
        );
    }

    /// `stop` then start again on the same directory.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn_and_wait();
    }

    /// Runs `serve` on this daemon's sessions dir and socket, expecting it
    /// to exit (with any status) rather than serve.
    pub fn start_expect_exit(&mut self, extra: &[String]) -> Failed {
        let (sessions, socket) = (self.sessions.clone(), self.socket.clone());
        self.start_other_expect_exit(&sessions, &socket, extra)
    }

    /// Runs `serve` on the given sessions dir and socket, expecting it to exit.
    pub fn start_other_expect_exit(
        &mut self,
        sessions: &Path,
        socket: &Path,
        extra: &[String],
    ) -> Failed {
        let (mut child, err) = self.spawn_with(sessions, socket, extra);
        let status = match wait_timeout(&mut child, FAIL_TIMEOUT_MS) {
            Some(s) => s,
            None => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "serve was expected to fail but kept running; stderr:\n{}",
                    std::fs::read_to_string(&err).unwrap_or_default()
                );
            }
        };
        Failed {
            status,
            stderr: std::fs::read_to_string(&err).unwrap_or_default(),
        }
    }

    /// Runs `superfluid session ARGS --socket <this daemon's>` to its end.
    pub fn session_cli(&self, args: &[&str]) -> std::process::Output {
        Command::new(bin())
            .arg("session")
            .args(args)
            .arg("--socket")
            .arg(&self.socket)
            .output()
            .unwrap()
    }

    // ---- request helpers -------------------------------------------------

    pub fn create(&self, c: &mut Client) -> SessionId {
        match c
            .call(&Request::Create {
                parent: None,
                params: params(1),
            })
            .unwrap()
        {
            Response::Created { session } => session,
            other => panic!("Create: {other:?}"),
        }
    }

    /// Waits until session `s` has committed a `Generated` chunk: its
    /// generation runs. Panics after a minute.
    pub fn until_generated(&self, s: SessionId) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !self
            .read_all(s)
            .iter()
            .any(|e| matches!(e.body, superfluid::wire::Record::Generated { .. }))
        {
            assert!(
                std::time::Instant::now() < deadline,
                "session {s} committed no Generated chunk"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    pub fn read_all(&self, s: SessionId) -> Vec<Event> {
        read_events(&mut self.client(), s)
    }
}

impl Default for TestDaemon {
    fn default() -> Self {
        TestDaemon::new()
    }
}

impl Drop for TestDaemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Appends `what` as a line to `$SUPERFLUID_TEST_SPAWN_LOG`, if set.
fn count_spawn(what: &str) {
    let Some(path) = std::env::var_os(SPAWN_LOG_ENV) else {
        return;
    };
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("{SPAWN_LOG_ENV}={}: {e}", Path::new(&path).display()));
    // One write of a short line in append mode: concurrent tests do not interleave.
    f.write_all(format!("{what}\n").as_bytes()).unwrap();
}

static SHARED: OnceLock<Mutex<TestDaemon>> = OnceLock::new();

/// The one daemon (default model, default arguments) that the tests which
/// only read or validate share, instead of a daemon each. Holding the guard
/// gives the test the daemon to itself, so a test sees `wal.log` change only
/// through its own requests; a test works on sessions it creates, and never
/// stops, kills or restarts the shared daemon (those tests start their own).
///
/// Started on first use from a thread that lives as long as the test
/// process, with `PR_SET_PDEATHSIG`, so the daemon dies with the process
/// however it ends; a clean exit also stops it and removes its temp dir.
pub fn shared_daemon() -> MutexGuard<'static, TestDaemon> {
    SHARED
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel();
            std::thread::Builder::new()
                .name("shared-daemon".into())
                .spawn(move || {
                    let mut d = TestDaemon::new();
                    d.die_with_spawner = true;
                    d.spawn_and_wait();
                    tx.send(d).unwrap();
                    // The daemon dies with this thread: keep it until exit.
                    loop {
                        std::thread::park();
                    }
                })
                .expect("spawning the shared daemon's thread");
            let d = rx
                .recv()
                .expect("the shared daemon did not start (its panic is above)");
            // SAFETY: registers a plain extern "C" fn that does not unwind.
            unsafe { libc::atexit(stop_shared_daemon) };
            Mutex::new(d)
        })
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// At exit: SIGKILL the shared daemon and remove its temp dir (statics are
/// never dropped).
extern "C" fn stop_shared_daemon() {
    let Some(m) = SHARED.get() else { return };
    let mut d = match m.try_lock() {
        Ok(d) => d,
        Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    if let Some(mut child) = d.child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = std::fs::remove_dir_all(d.path());
}

pub fn wait_timeout(child: &mut Child, ms: u64) -> Option<ExitStatus> {
    let deadline = Instant::now() + Duration::from_millis(ms);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sends `req`, expects `Committed`, returns the event.
pub fn commit(c: &mut Client, req: Request) -> Event {
    match c.call(&req).unwrap() {
        Response::Committed { event } => event,
        other => panic!("{req:?}: {other:?}"),
    }
}

/// Sends `req`, expects `Created`, returns the session.
pub fn created(c: &mut Client, req: Request) -> SessionId {
    match c.call(&req).unwrap() {
        Response::Created { session } => session,
        other => panic!("{req:?}: {other:?}"),
    }
}

/// Sends `req`, expects `Err`, returns its message.
pub fn expect_err(c: &mut Client, req: &Request) -> String {
    match c.call(req).unwrap() {
        Response::Err { message } => message,
        other => panic!("{req:?} should fail, got {other:?}"),
    }
}

/// A raw connection for hand-made frames.
pub struct Raw {
    pub stream: UnixStream,
}

impl Raw {
    pub fn connect(path: &Path) -> Raw {
        let stream = UnixStream::connect(path).expect("connecting");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        Raw { stream }
    }

    pub fn send_bytes(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
        self.stream.flush().unwrap();
    }

    /// A whole frame with this body.
    pub fn send_frame(&mut self, body: &[u8]) {
        write_frame_blocking(&mut self.stream, body).unwrap();
    }

    pub fn send_request(&mut self, req: &Request) {
        self.send_frame(&to_postcard(req).unwrap());
    }

    /// The next reply, or None on a clean close.
    pub fn recv(&mut self) -> Option<Response> {
        read_frame_blocking(&mut self.stream, MAX_FRAME_BYTES)
            .expect("reading a reply")
            .map(|f| superfluid::wire::from_postcard(&f).expect("decoding a reply"))
    }

    /// True when the daemon closed the connection (EOF, or reset).
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.stream.read(&mut b), Ok(0) | Err(_))
    }
}

/// The start offsets of every record of a WAL file, and where the valid
/// records end. Walks `[len u32][len_crc u32][crc u32][payload]` from the
/// end of the file header, with the store's own sizes, skipping group
/// commit markers.
pub fn wal_records(bytes: &[u8]) -> Vec<(usize, usize)> {
    let header = FILE_HEADER_LEN as usize;
    assert!(
        bytes.len() >= header && bytes[..WAL_MAGIC.len()] == WAL_MAGIC,
        "not a WAL"
    );
    let mut out = Vec::new();
    let mut pos = header;
    while pos + RECORD_HEADER_LEN <= bytes.len() {
        let word = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap());
        let len = (word & !MARKER_FLAG) as usize;
        let end = pos + RECORD_HEADER_LEN + len;
        if end > bytes.len() {
            break;
        }
        // Group commit markers (format version 2) are not records.
        if word & MARKER_FLAG == 0 {
            out.push((pos, end));
        }
        pos = end;
    }
    out
}

/// Where the group holding the record that ends at `record_end` ends: past
/// the group commit marker right after it, if there is one (version 2).
pub fn wal_group_end(bytes: &[u8], record_end: usize) -> usize {
    match bytes.get(record_end..record_end + 4) {
        Some(w) if u32::from_le_bytes(w.try_into().unwrap()) & MARKER_FLAG != 0 => {
            record_end + superfluid::store::wal::MARKER_LEN
        }
        _ => record_end,
    }
}

// ---- the test models ------------------------------------------------------

/// The model the daemon loads: `$SUPERFLUID_TEST_MODEL`, or the path
/// scripts/fetch-model.sh writes.
pub fn model_path() -> PathBuf {
    let path =
        superfluid::engine::default_model_path().expect("HOME or SUPERFLUID_TEST_MODEL is set");
    assert!(
        path.is_file(),
        "the test model {} is missing: run scripts/setup.sh (or set SUPERFLUID_TEST_MODEL)",
        path.display()
    );
    path
}

/// A test model scripts/make-test-models.py derives from the default one
/// (`SmolLM2-135M-tools-think.gguf`, `SmolLM2-135M-fim.gguf`), beside it.
pub fn derived_model(name: &str) -> PathBuf {
    let path = model_path().with_file_name(name);
    assert!(
        path.is_file(),
        "the derived test model {} is missing: run scripts/setup.sh (or scripts/make-test-models.py)",
        path.display()
    );
    path
}

// ---- tool calls on the tools model -----------------------------------------

const WEATHER: &str = r#"{"type":"function","function":{"name":"get_weather","description":"Current weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}"#;

/// A daemon on the test model whose template declares tools and opens each
/// assistant turn inside a `<think>` block.
pub fn tools_think_daemon() -> TestDaemon {
    let mut d = TestDaemon::new();
    d.model = derived_model("SmolLM2-135M-tools-think.gguf");
    d.spawn_and_wait();
    d
}

/// `SetToolChoice`, committed.
pub fn tool_choice(c: &mut Client, s: SessionId, choice: &str) {
    commit(
        c,
        Request::SetToolChoice {
            session: s,
            choice: choice.into(),
        },
    );
}

/// A session on the tools model asked about the weather, with the call forced.
pub fn forced_weather_session(c: &mut Client) -> SessionId {
    let s = created(
        c,
        Request::Create {
            parent: None,
            params: params(1),
        },
    );
    commit(
        c,
        Request::AppendSystem {
            session: s,
            text: Some("Answer with the tools.".into()),
            tools: vec![WEATHER.into()],
        },
    );
    commit(
        c,
        Request::AppendMessage {
            session: s,
            role: Role::User.into(),
            text: "Is it raining in Paris?".into(),
        },
    );
    tool_choice(c, s, "required");
    s
}

/// The value of the Prometheus sample `name` (with its labels, if any) in
/// the daemon's `Metrics`; panics when it is missing.
pub fn metric(d: &TestDaemon, name: &str) -> f64 {
    let Response::Text { text } = d.call(&Request::Metrics) else {
        panic!("Metrics");
    };
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
}

/// The worker processes a daemon spawned (its children, from /proc).
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        // The parent pid is the second field after the ")" closing the name.
        let after = stat.rsplit_once(')').map(|x| x.1).unwrap_or_default();
        if after.split_whitespace().nth(1) == Some(&pid.to_string()) {
            out.push(child);
        }
    }
    out
}

/// GET /web/health of a daemon started with `--web 127.0.0.1:0` (its
/// address is in `<sessions>/web.addr`).
pub fn web_health(d: &TestDaemon) -> String {
    let addr =
        std::fs::read_to_string(d.sessions.join(superfluid::http::token::ADDR_FILE)).unwrap();
    let mut s = std::net::TcpStream::connect(addr.trim()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /web/health HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        addr.trim()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// Asserts that a Generate's replies end with its `Generated` summary,
/// finished by a cancel.
pub fn assert_cancelled(replies: &[Response]) {
    assert!(
        matches!(
            replies.last(),
            Some(Response::Generated {
                finish: Finish::Cancelled,
                ..
            })
        ),
        "{replies:?}"
    );
}

/// Generates up to `n` tokens: the reply's text, or the `Err`'s message
/// (or the last reply, when it is not `Generated`).
pub fn generate_text(c: &mut Client, s: SessionId, n: u32) -> Result<String, String> {
    let replies = c
        .generate(&Request::Generate {
            session: s,
            max_tokens: n,
        })
        .unwrap();
    let mut text = String::new();
    for r in &replies {
        match r {
            Response::Delta { event } => {
                if let Record::Generated { text: t, .. } = &event.body {
                    text.push_str(t);
                }
            }
            Response::Err { message } => return Err(message.clone()),
            _ => {}
        }
    }
    match replies.last() {
        Some(Response::Generated { .. }) => Ok(text),
        other => Err(format!("{other:?}")),
    }
}

/// Every event of `s`, read on `c`.
pub fn read_events(c: &mut Client, s: SessionId) -> Vec<Event> {
    match c.call(&Request::Read {
        session: s,
        cursor: 0,
    }) {
        Ok(Response::Events { events }) => events,
        other => panic!("Read {s}: {other:?}"),
    }
}

/// Copies a directory tree (a sessions directory, to start a second daemon
/// on the same log).
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}
