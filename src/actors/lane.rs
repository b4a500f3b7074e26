//! `LaneActor`: one model lane, that is one `superfluid worker` process that
//! owns llama.cpp for one model. It spawns the worker, writes requests to its
//! stdin and reads replies from its stdout (length-prefixed postcard frames,
//! one reply per request, in order), and routes the worker's stderr into the
//! daemon's log. stdin, stdout and stderr are non-blocking pipes served by
//! tasks on the actor's own arbiter (no thread hop per frame: a reply wakes
//! the arbiter straight from epoll).
//!
//! What blocks the arbiter, and why that is acceptable: reaping a worker.
//! When the worker's stdout ends, and when a spawn half-fails, the lane
//! SIGKILLs the child and `wait`s for it (the kernel reaps a killed process
//! at once, so this is microseconds). When the lane stops (daemon shutdown,
//! nothing else left to serve) it writes a `Shutdown` frame and polls the
//! child for up to `SHUTDOWN_GRACE_MS` before killing it, so the worker can
//! exit cleanly.
//!
//! When the worker dies (a crash, SIGKILL, a llama.cpp abort) every request
//! in flight fails with an Err, the scheduler is told (`LaneReset`) so it
//! forgets the KV, and the worker is spawned again after a short delay. The
//! lane publishes its [`LaneState`] (loading, ready, respawning) on a watch
//! channel ([`LaneHealth`]).
//!
//! With `--rpc` the worker's layers live on ggml RPC servers, and ggml aborts
//! the worker when one is lost. Before each start, and after each death, the
//! lane probes the servers (an RPC hello each, on the arbiter's reactor):
//! a death with a server down fails what was in flight naming the server,
//! and while any is down the lane is `Unreachable` and refuses work at once,
//! probing every `RPC_PROBE_EVERY` until all answer, then starts the worker.

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot, watch};

use super::load_gate::{available_memory, LoadGate};
use crate::wire::frame::encode_frame;
use crate::wire::worker::{ReplyCheck, WorkerConfig, WorkerRequest, WorkerResponse};
use crate::wire::{from_postcard, read_frame, to_postcard};

/// The first respawn waits this long; each further one in a row doubles it.
const RESPAWN_DELAY_MS: u64 = 100;
/// The longest wait between respawns.
const RESPAWN_DELAY_MAX_MS: u64 = 5_000;
/// Failed starts in a row after which the requests held for a worker fail
/// (a passing error: no file descriptors, no memory for the fork).
const SPAWN_TRIES: u32 = 3;
/// How often the lane looks for a step past its deadline, and whether its
/// idle model's keep-alive ran out.
const DEADLINE_CHECK: Duration = Duration::from_millis(250);
/// OpenMP spin iterations before a waiting worker thread sleeps (libgomp's
/// default is 300,000, a millisecond or so of two busy cores after each step).
pub const WORKER_SPINCOUNT: &str = "20000";
/// How long a stopping lane waits for its worker to exit after `Shutdown`,
/// polling every `SHUTDOWN_POLL_MS`, before it kills it.
const SHUTDOWN_GRACE_MS: u64 = 200;
const SHUTDOWN_POLL_MS: u64 = 10;
/// How long a probe waits for an RPC server's hello.
const RPC_PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a probe's hello that was not answered in time is still read
/// for (the server answers once the client it serves leaves).
const RPC_PROBE_DRAIN: Duration = Duration::from_secs(600);
/// How often an `Unreachable` lane probes its RPC servers again.
const RPC_PROBE_EVERY: Duration = Duration::from_secs(1);
/// The largest reply frame accepted from the worker.
const MAX_WORKER_FRAME_BYTES: usize = 16 << 20;

/// Why the lane could not run a request. The text is what a generation
/// fails with, and so what its client sees.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LaneError {
    /// The worker died with the request in flight, or before it said Ready.
    #[error("the worker died ({reason}: {status})")]
    WorkerDied { reason: String, status: String },
    /// The worker answered its start with an Err instead of Ready.
    #[error("the worker could not start: {0}")]
    CouldNotStart(String),
    #[error("a request of {0} bytes is over the worker's frame limit")]
    RequestTooLarge(usize),
    /// The request did not encode.
    #[error("{0}")]
    Encode(String),
    #[error("the worker is not running")]
    NotRunning,
    /// The worker died before the request reached it (its stdin was
    /// already closed): nothing of it ran, so the scheduler may run it
    /// again on the next worker.
    #[error("the worker died before it got the request ({0})")]
    NotDelivered(String),
    /// The worker loaded a model other than the daemon's (the file changed
    /// under the daemon): nothing runs on it.
    #[error("{0}")]
    WrongModel(String),
    /// The worker did not answer within the step's deadline: it was killed.
    #[error("{0}")]
    Hung(String),
    /// A reply that cannot answer its request (a token id outside the
    /// vocabulary, draws not asked for): the worker is stopped.
    #[error("the worker's reply was refused: {0}")]
    BadReply(String),
    #[error("the model lane stopped")]
    Stopped,
    /// The model could not be loaded (it does not fit, or too many are
    /// loaded): the gate's message.
    #[error("{0}")]
    CannotLoad(String),
    /// The lane unloaded its idle model (`--keep-alive`, or room for
    /// another model).
    #[error("the model was unloaded")]
    Unloaded,
    /// An `--rpc` server holding the model's layers cannot be reached: the
    /// lane refuses work until it answers again.
    #[error("{0}")]
    RpcUnreachable(String),
}

/// One `--rpc` server, as the lane's last probe found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcServerState {
    /// `HOST:PORT`.
    pub server: String,
    /// Why the last probe failed; None: it answered (or none ran yet).
    pub down: Option<String>,
}

/// The lane's `--rpc` servers and their state, for /web/health and Metrics.
pub type RpcStatus = Arc<std::sync::Mutex<Vec<RpcServerState>>>;

/// A new status with every server taken as up.
pub fn rpc_status(servers: &[String]) -> RpcStatus {
    Arc::new(std::sync::Mutex::new(
        servers
            .iter()
            .map(|s| RpcServerState {
                server: s.clone(),
                down: None,
            })
            .collect(),
    ))
}

/// Metrics lines for the servers: `superfluid_rpc_server_up{server="..."}`
/// 1 or 0 (none without `--rpc`).
pub fn rpc_metrics(status: &RpcStatus) -> String {
    let servers = status.lock().map(|s| s.clone()).unwrap_or_default();
    if servers.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "# HELP superfluid_rpc_server_up Whether the lane's last probe reached each --rpc \
         server holding the model's layers.\n# TYPE superfluid_rpc_server_up gauge\n",
    );
    for s in servers {
        out.push_str(&format!(
            "superfluid_rpc_server_up{{server=\"{}\"}} {}\n",
            s.server.replace('\\', "\\\\").replace('"', "\\\""),
            u8::from(s.down.is_none())
        ));
    }
    out
}

/// Asks each server for its hello (at once, `RPC_PROBE_TIMEOUT` each) and
/// returns each one's failure, None where it answered.
async fn probe_rpc(servers: Vec<String>) -> Vec<Option<String>> {
    futures_util::future::join_all(
        servers
            .into_iter()
            .map(|s| async move { rpc_hello(s).await.err() }),
    )
    .await
}

/// Servers whose answer to a probe's hello is still awaited past
/// `RPC_PROBE_TIMEOUT` (its connection kept on a task of its own), process
/// wide: no second probe is sent to them meanwhile.
fn awaited_hellos() -> std::sync::MutexGuard<'static, std::collections::HashSet<String>> {
    static AWAITED: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<String>>> =
        std::sync::OnceLock::new();
    AWAITED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// One RPC hello exchange with a server (`engine::rpc::hello_request`): a
/// TCP connect alone also succeeds on a dying server's listening socket,
/// which ggml closes after the connections that failed the worker.
///
/// A hello not answered in time is not closed on: the server serves one
/// client at a time and reads it once free, and its reply meeting a closed
/// socket kills it (ggml-rpc writes without MSG_NOSIGNAL: SIGPIPE). The
/// connection is read on until the reply is in (at most `RPC_PROBE_DRAIN`),
/// and the server counts as down meanwhile.
async fn rpc_hello(server: String) -> Result<(), String> {
    use crate::engine::rpc;
    let busy = || {
        format!(
            "no RPC answer within {} s (a server serves one client at a time: is another one \
             using it?)",
            RPC_PROBE_TIMEOUT.as_secs()
        )
    };
    if !awaited_hellos().insert(server.clone()) {
        return Err(busy());
    }
    let answered = |r: Result<(), String>| {
        awaited_hellos().remove(&server);
        r
    };
    let deadline = tokio::time::Instant::now() + RPC_PROBE_TIMEOUT;
    let mut stream =
        match tokio::time::timeout_at(deadline, tokio::net::TcpStream::connect(&server)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => return answered(Err(e.to_string())),
            // Nothing sent yet: nothing for the server to answer.
            Err(_) => return answered(Err(busy())),
        };
    let lost = |e: std::io::Error| format!("it accepted the connection but did not answer ({e})");
    // 33 bytes: the socket's buffer takes them whether or not the server reads.
    if let Err(e) = stream.write_all(&rpc::hello_request()).await {
        return answered(Err(lost(e)));
    }
    let mut reply = [0u8; 8 + rpc::HELLO_REPLY];
    let mut got = 0;
    let read = tokio::time::timeout_at(deadline, read_hello(&mut stream, &mut reply, &mut got));
    match read.await {
        Ok(Ok(())) => answered(rpc::hello_reply_size(first_8(&reply)).and_then(|()| {
            let mut body = [0u8; rpc::HELLO_REPLY];
            body.copy_from_slice(&reply[8..]);
            rpc::hello_reply(&body)
        })),
        Ok(Err(e)) => answered(Err(lost(e))),
        Err(_) => {
            actix_rt::spawn(async move {
                let drained = read_hello(&mut stream, &mut reply, &mut got);
                let _ = tokio::time::timeout(RPC_PROBE_DRAIN, drained).await;
                awaited_hellos().remove(&server);
            });
            Err(busy())
        }
    }
}

/// Reads a hello's reply into `reply` from `*got` on (kept across a
/// timeout): its size header, then, when the size is the one expected, its
/// body. A reply of another size ends after the header.
async fn read_hello(
    stream: &mut tokio::net::TcpStream,
    reply: &mut [u8; 8 + crate::engine::rpc::HELLO_REPLY],
    got: &mut usize,
) -> std::io::Result<()> {
    fill(stream, reply, got, 8).await?;
    if crate::engine::rpc::hello_reply_size(first_8(reply)).is_ok() {
        let end = reply.len();
        fill(stream, reply, got, end).await?;
    }
    Ok(())
}

/// Reads into `buf[*got..end]`, moving `*got` on with each read.
async fn fill(
    stream: &mut tokio::net::TcpStream,
    buf: &mut [u8],
    got: &mut usize,
    end: usize,
) -> std::io::Result<()> {
    use tokio::io::AsyncReadExt;
    while *got < end {
        match stream.read(&mut buf[*got..end]).await? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => *got += n,
        }
    }
    Ok(())
}

fn first_8(reply: &[u8]) -> [u8; 8] {
    let mut header = [0u8; 8];
    header.copy_from_slice(&reply[..8]);
    header
}

/// What the lane does once a probe of its RPC servers is back.
enum AfterProbe {
    /// Start the worker if every server answered.
    Start,
    /// Finish a worker's death: fail what it left with this error (naming
    /// the servers that are down, if any).
    Gone(LaneError),
}

/// A probe of the RPC servers came back.
#[derive(Message)]
#[rtype(result = "()")]
struct Probed {
    down: Vec<Option<String>>,
    then: AfterProbe,
}

/// Run requests on the worker, in order: one reply per request, or Err when
/// the worker died under them. They go into the pipe at once, so the worker
/// runs them back to back, and two `Exec`s reach it in the order sent.
#[derive(Message)]
#[rtype(result = "Result<Vec<WorkerResponse>, LaneError>")]
pub struct Exec {
    pub requests: Vec<WorkerRequest>,
    /// For requests planned against the worker's KV (the scheduler's
    /// steps): the [`LaneReset`]s their planner had heard of. Requests
    /// planned before a reset it had not heard of yet would run on the next
    /// worker against cells that are not there: they are refused,
    /// `NotDelivered`, and the planner replans once it hears. None for
    /// requests that do not read the KV (an image's layout).
    pub kv_epoch: Option<u64>,
}

/// Why an image has no layout.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// The lane could not run the request (the worker is down, the lane
    /// gone).
    #[error("{0}")]
    Lane(String),
    /// The worker refused the image (missing or corrupt blob, not an image
    /// it decodes, no projector).
    #[error("{0}")]
    Refused(String),
}

/// `MediaLayout` on the lane's worker: the positions its projector gives
/// the blob (`MEDIA_TOKEN` where an embedding goes).
pub async fn media_layout(
    lane: &Addr<LaneActor>,
    blob: &str,
) -> Result<Vec<crate::wire::Token>, LayoutError> {
    let replies = lane
        .send(Exec {
            requests: vec![WorkerRequest::MediaLayout {
                blob: blob.to_owned(),
            }],
            kv_epoch: None,
        })
        .await
        .map_err(|e| LayoutError::Lane(e.to_string()))?
        .map_err(|e| LayoutError::Lane(e.to_string()))?;
    match replies.into_iter().next() {
        Some(WorkerResponse::MediaLayout { tokens }) => Ok(tokens),
        Some(WorkerResponse::Err { message }) => Err(LayoutError::Refused(message)),
        other => Err(LayoutError::Lane(format!(
            "unexpected reply from the worker: {other:?}"
        ))),
    }
}

/// The worker died or was unloaded; everything it held is gone.
#[derive(Message)]
#[rtype(result = "()")]
pub struct LaneReset {
    pub error: LaneError,
    /// The lane's resets so far, this one included: what the scheduler puts
    /// in [`Exec::kv_epoch`] from now on.
    pub epoch: u64,
}

/// What the lane's worker is doing. The lane publishes it on a watch channel
/// ([`LaneHealth`]); Metrics and /web/health report it, and tests and
/// benchmarks wait on it instead of sleeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneState {
    /// The first worker is loading the model.
    Loading,
    /// The worker said `Ready`: requests go to it at once.
    Ready,
    /// The worker died (or could not start) and a new one is on its way;
    /// requests wait for it.
    Respawning,
    /// No worker runs: a `--model` not used yet, or unloaded after its
    /// keep-alive. The next request loads it.
    Unloaded,
    /// An `--rpc` server holding the model's layers cannot be reached: no
    /// worker runs, requests are refused, and the lane probes again.
    Unreachable,
}

/// Re-logs the worker's stderr lines in the daemon's log until its EOF: each
/// line capped at `WORKER_LINE_MAX` bytes (the rest is skipped, never held),
/// escaped, and relayed at the level the worker logged it at.
async fn relay_stderr(stderr: pipe::Receiver) {
    use crate::logging::{parse_worker_line, sanitize_worker_line, WORKER_LINE_MAX};
    let mut reader = tokio::io::BufReader::new(stderr);
    let (mut line, mut cut) = (Vec::new(), 0usize);
    let relay = |line: &[u8], cut: usize| {
        let l = sanitize_worker_line(line, cut);
        match parse_worker_line(&l) {
            Some((level, target, msg)) => {
                log::log!(target: "superfluid::worker", level, "{target}: {msg}")
            }
            None => log::info!(target: "superfluid::worker", "{l}"),
        }
    };
    while let Ok(buf) = reader.fill_buf().await {
        if buf.is_empty() {
            if !line.is_empty() || cut > 0 {
                relay(&line, cut);
            }
            break;
        }
        let (chunk, used, ends) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], i + 1, true),
            None => (buf, buf.len(), false),
        };
        let room = WORKER_LINE_MAX.saturating_sub(line.len());
        line.extend_from_slice(&chunk[..chunk.len().min(room)]);
        cut += chunk.len().saturating_sub(room);
        reader.consume(used);
        if ends {
            relay(&line, cut);
            line.clear();
            cut = 0;
        }
    }
}

/// The receiving end of the lane's state.
pub type LaneHealth = watch::Receiver<LaneState>;

impl LaneState {
    const ALL: [LaneState; 5] = [
        LaneState::Loading,
        LaneState::Ready,
        LaneState::Respawning,
        LaneState::Unloaded,
        LaneState::Unreachable,
    ];

    /// Its name in /web/health and in Metrics.
    pub fn name(self) -> &'static str {
        match self {
            LaneState::Loading => "loading",
            LaneState::Ready => "ready",
            LaneState::Respawning => "respawning",
            LaneState::Unloaded => "unloaded",
            LaneState::Unreachable => "unreachable",
        }
    }

    /// Its Metrics lines: `superfluid_lane_state{state="..."}` is 1 for this
    /// state and 0 for the others.
    pub fn metrics(self) -> String {
        let mut out = String::from(
            "# HELP superfluid_lane_state The model lane's worker: loading (the first start), \
             ready, respawning (after a death), unloaded (idle past its keep-alive), or unreachable (an --rpc server is down).\n# TYPE superfluid_lane_state gauge\n",
        );
        for s in LaneState::ALL {
            out.push_str(&format!(
                "superfluid_lane_state{{state=\"{}\"}} {}\n",
                s.name(),
                u8::from(s == self)
            ));
        }
        out
    }
}

/// A reply frame read from the worker's stdout.
#[derive(Message)]
#[rtype(result = "()")]
struct FromWorker {
    incarnation: u64,
    response: WorkerResponse,
}

/// The worker's stdout ended.
#[derive(Message)]
#[rtype(result = "()")]
struct WorkerGone {
    incarnation: u64,
    reason: String,
}

/// How to start the worker.
#[derive(Debug, Clone)]
pub struct LaneConfig {
    pub model: PathBuf,
    pub worker: WorkerConfig,
    /// The `superfluid` executable (normally the running one).
    pub exe: PathBuf,
    /// `--cache-ram-mb`: the cap of the worker's host-memory store, in MiB.
    pub cache_ram_mb: u64,
    /// `--park`: the park directory and `--park-budget-gb` in bytes.
    pub park: Option<(PathBuf, u64)>,
    /// `--park-lossy`: artifacts stored as Q8_0.
    pub park_lossy: bool,
    /// `--kv-bits`: the worker's KV cache type, 16 or 8.
    pub kv_bits: u8,
    /// `--mmap`: the worker maps the model file instead of reading it.
    pub mmap: bool,
    /// The vocabulary the daemon tokenizes with (its size and digest): a
    /// worker whose `Ready` names another is refused.
    pub vocabulary: Option<(u32, [u8; 32])>,
    /// `--step-timeout-secs`: the base of each request's deadline.
    pub step_timeout: Duration,
    /// `--load-timeout-secs`: how long a loading worker may show no
    /// progress.
    pub load_timeout: Duration,
    /// The daemon's load gate and this lane's line in it; `None`: the lane
    /// loads at start and never unloads, with no one to ask.
    pub gate: Option<(LoadGate, usize)>,
    /// Starts unloaded, loads on the first request, and unloads after its
    /// keep-alive (a `--model`).
    pub lazy: bool,
    /// `--rpc` and `--tensor-split`: where the worker places the layers.
    pub placement: crate::engine::rpc::Placement,
    /// Where the lane reports its RPC servers' state.
    pub rpc_status: RpcStatus,
    /// `--mmproj`: the vision projector and the media directory the worker
    /// reads images from.
    pub vision: Option<(PathBuf, PathBuf)>,
}

/// The deadline of a request of `work` tokens: the base, plus 20 times what
/// that many tokens took at the slowest rate seen (10 ms a token before any
/// was seen), so a big prefill on a slow model is not taken for a hang.
pub fn step_deadline(base: Duration, work: u64, slowest_us_per_token: u64) -> Duration {
    let per_token = if slowest_us_per_token == 0 {
        10_000
    } else {
        slowest_us_per_token.saturating_mul(20)
    };
    base + Duration::from_micros(work.saturating_mul(per_token))
}

/// The tokens of work a request carries, for its deadline.
fn work_of(request: &WorkerRequest) -> u64 {
    match request {
        WorkerRequest::Decode { items } => items.iter().map(|i| i.tokens.len() as u64).sum(),
        WorkerRequest::DecodeNext { items } => items.iter().map(|i| u64::from(i.steps)).sum(),
        WorkerRequest::KvRestore { len, .. } | WorkerRequest::KvSpill { len, .. } => {
            u64::from(*len)
        }
        WorkerRequest::KvPark { tokens, .. } | WorkerRequest::KvUnpark { tokens, .. } => {
            tokens.len() as u64
        }
        _ => 0,
    }
}

type Reply = oneshot::Sender<Result<WorkerResponse, LaneError>>;

/// The worker's `--rpc` and `--tensor-split` arguments (none without RPC).
fn rpc_args(placement: &crate::engine::rpc::Placement) -> Vec<String> {
    let mut out = Vec::new();
    if !placement.servers.is_empty() {
        out.push("--rpc".into());
        out.push(placement.servers.join(","));
    }
    if !placement.split.is_empty() {
        let weights: Vec<String> = placement.split.iter().map(f32::to_string).collect();
        out.push("--tensor-split".into());
        out.push(weights.join(","));
    }
    out
}

/// The wait before the next worker starts: [`RESPAWN_DELAY_MS`], doubled
/// for each failure since a worker last decoded, up to
/// [`RESPAWN_DELAY_MAX_MS`]; and the starts that failed in a row (a spawn
/// that could not run the binary or make its pipes), against
/// [`SPAWN_TRIES`].
#[derive(Debug, Default)]
struct Respawns {
    failures_in_a_row: u32,
    spawns_failed_in_a_row: u32,
}

impl Respawns {
    /// A worker answered. One that decoded is a good start: the delay
    /// starts over. Not at `Ready`, nor at the cache housekeeping a step
    /// carries before its decode (`Done`, `Spilled`), or a step that crashes
    /// each new worker would be retried at full speed.
    fn answered(&mut self, response: &WorkerResponse) {
        if matches!(response, WorkerResponse::Decoded { .. }) {
            self.failures_in_a_row = 0;
        }
    }

    /// The wait before the next start, which counts as one more failure.
    fn next_delay(&mut self) -> Duration {
        let shift = self.failures_in_a_row.min(6);
        self.failures_in_a_row += 1;
        Duration::from_millis((RESPAWN_DELAY_MS << shift).min(RESPAWN_DELAY_MAX_MS))
    }
}

/// Whether a loading worker is making progress: the work it has done so far
/// (bytes it read and wrote, CPU time, pages it faulted in from a mapped
/// file, all of /proc), and when that last changed. A load blocked in the
/// kernel (an open or read on a hung mount, a socket no server answers)
/// does none of these.
#[derive(Debug)]
struct LoadWatch {
    work: Option<u64>,
    since: Instant,
}

impl LoadWatch {
    fn new(now: Instant) -> LoadWatch {
        LoadWatch {
            work: None,
            since: now,
        }
    }

    /// The work process `pid` has done, as one number that grows with any
    /// of it; None when /proc cannot tell (the process is gone).
    fn sample(pid: u32) -> Option<u64> {
        // Without io accounting (a kernel without it) the CPU time and
        // faults still tell.
        let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap_or_default();
        let bytes: u64 = io
            .lines()
            .filter_map(|l| {
                let (key, value) = l.split_once(':')?;
                matches!(key, "rchar" | "wchar").then(|| value.trim().parse::<u64>().ok())?
            })
            .sum();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // The fields after the command's closing parenthesis, from the
        // state (field 3): majflt is field 12, utime 14, stime 15.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
        Some(bytes + field(12)? + field(14)? + field(15)?)
    }

    /// Notes `work` seen at `now`; true when it has not changed for longer
    /// than `limit`.
    fn stalled(&mut self, work: Option<u64>, now: Instant, limit: Duration) -> bool {
        if work.is_some() && work != self.work {
            self.work = work;
            self.since = now;
        }
        now.duration_since(self.since) > limit
    }
}

/// Whether a request needs the model loaded: a decode, or a restore of KV
/// kept outside the cells. The rest manage KV a worker holds.
fn needs_model(request: &WorkerRequest) -> bool {
    matches!(
        request,
        WorkerRequest::Decode { .. }
            | WorkerRequest::DecodeNext { .. }
            | WorkerRequest::KvRestore { .. }
            | WorkerRequest::KvUnpark { .. }
            | WorkerRequest::MediaLayout { .. }
    )
}

pub struct LaneActor {
    config: LaneConfig,
    child: Option<Child>,
    /// Whole frames (length prefix included) for the stdin task.
    to_worker: Option<mpsc::UnboundedSender<Vec<u8>>>,
    /// A second descriptor of the worker's stdin, for the `Shutdown` frame
    /// written when the lane stops (its arbiter may not run the stdin task
    /// again by then).
    stdin_for_shutdown: Option<std::fs::File>,
    /// Replies awaited from the worker, oldest first, with what each may
    /// hold, the number of its frame (this worker's first is 0) and how long
    /// the worker may take over it.
    in_flight: VecDeque<(Reply, ReplyCheck, u64, Duration)>,
    /// When the worker started on the oldest request in flight (the reply
    /// before it arrived, or it was sent to an idle worker).
    head_since: Instant,
    /// Whether the loading worker is making progress (`--load-timeout-secs`).
    load_watch: LoadWatch,
    /// The worker now running (or last gone) said `Ready`.
    worker_was_ready: bool,
    /// A `--model`'s last failed load: why, and until when a request fails
    /// with that instead of loading again (the respawn delay, growing with
    /// each failure in a row).
    load_failed: Option<(LaneError, Instant)>,
    /// The slowest decode rate seen, in µs a token (0: none seen yet).
    slowest_us_per_token: u64,
    /// Frames handed to this worker's stdin task, and (shared with it)
    /// frames it wrote whole into the pipe.
    frames_sent: u64,
    frames_written: Arc<AtomicU64>,
    /// The first worker's `Ready` config: every later worker must match it
    /// (the scheduler was sized by it).
    first_config: Option<WorkerConfig>,
    /// The vocabulary size of the worker now running.
    n_vocab: u32,
    /// Why the lane stopped the worker now exiting (its `Ready` refused,
    /// a step past its deadline): what it leaves fails with this, not as a
    /// death.
    stop_reason: Option<LaneError>,
    /// Requests held until the worker says Ready, each with whether it was
    /// planned against the worker's KV ([`Exec::kv_epoch`]).
    held: VecDeque<(WorkerRequest, Reply, bool)>,
    /// The [`LaneReset`]s sent so far.
    resets: u64,
    ready: bool,
    incarnation: u64,
    respawns: Respawns,
    /// Who hears that the worker restarted (its KV is gone): the lane's
    /// scheduler, which is born knowing the lane (`daemon::start_lane`).
    listener: Recipient<LaneReset>,
    /// Where the lane publishes its [`LaneState`].
    state: watch::Sender<LaneState>,
    /// The worker now exiting is being unloaded, not replaced.
    unloading: bool,
    /// When the lane last had a request, or answered one.
    last_used: Instant,
    /// Why the lane refuses work: an RPC server is down (`Unreachable`).
    rpc_down: Option<String>,
    /// A probe of the RPC servers is under way, to start the worker.
    probing: bool,
}

/// Unload the idle model to make room for another (sent by the lane that
/// loads it, which the gate told to). A lane with work in flight keeps its
/// worker, and says so in the gate.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Unload;

/// Hand back, undelivered, the scheduler's requests held for a worker that
/// has not said `Ready` (sent by the scheduler when a generation waiting on
/// them is cancelled: the load may take long, or never end). Nothing of them
/// ran; the scheduler finishes the cancelled generation and plans the rest
/// again. A ready lane holds nothing: the cancel lands after the step.
#[derive(Message)]
#[rtype(result = "()")]
pub struct WithdrawHeld;

/// Load the model now if it is not (Ollama's request with no messages).
#[derive(Message)]
#[rtype(result = "Result<(), String>")]
pub struct Load;

impl LaneActor {
    pub fn new(config: LaneConfig, listener: Recipient<LaneReset>) -> LaneActor {
        let config_lazy = config.lazy;
        LaneActor {
            config,
            child: None,
            to_worker: None,
            stdin_for_shutdown: None,
            in_flight: VecDeque::new(),
            frames_sent: 0,
            frames_written: Arc::default(),
            head_since: Instant::now(),
            load_watch: LoadWatch::new(Instant::now()),
            worker_was_ready: false,
            load_failed: None,
            slowest_us_per_token: 0,
            first_config: None,
            n_vocab: 0,
            stop_reason: None,
            held: VecDeque::new(),
            resets: 0,
            ready: false,
            incarnation: 0,
            respawns: Respawns::default(),
            listener,
            state: watch::Sender::new(if config_lazy {
                LaneState::Unloaded
            } else {
                LaneState::Loading
            }),
            unloading: false,
            last_used: Instant::now(),
            rpc_down: None,
            probing: false,
        }
    }

    /// The lane's state, as it changes (take it before starting the actor).
    pub fn health(&self) -> LaneHealth {
        self.state.subscribe()
    }

    /// Starts the worker: at once, or with `--rpc` once a probe found every
    /// server answering.
    fn start_worker(&mut self, ctx: &mut Context<Self>) {
        if self.config.placement.servers.is_empty() {
            self.spawn_worker(ctx);
        } else if !self.probing {
            self.probing = true;
            self.probe(ctx, AfterProbe::Start);
        }
    }

    /// Probes the RPC servers; `Probed` brings the result back.
    fn probe(&mut self, ctx: &mut Context<Self>, then: AfterProbe) {
        let servers = self.config.placement.servers.clone();
        let me = ctx.address();
        actix::spawn(async move {
            let down = probe_rpc(servers).await;
            me.do_send(Probed { down, then });
        });
    }

    /// Notes a probe's result in the status; the servers that are down,
    /// with why, as one sentence (None: all answered).
    fn note_probe(&mut self, down: &[Option<String>]) -> Option<String> {
        let servers = &self.config.placement.servers;
        if let Ok(mut status) = self.config.rpc_status.lock() {
            *status = servers
                .iter()
                .zip(down)
                .map(|(server, down)| RpcServerState {
                    server: server.clone(),
                    down: down.clone(),
                })
                .collect();
        }
        let named: Vec<String> = servers
            .iter()
            .zip(down)
            .filter_map(|(server, down)| down.as_ref().map(|why| format!("{server} ({why})")))
            .collect();
        match named.len() {
            0 => None,
            1 => Some(format!(
                "the RPC server holding the model's layers cannot be reached: {}",
                named[0]
            )),
            _ => Some(format!(
                "the RPC servers holding the model's layers cannot be reached: {}",
                named.join(", ")
            )),
        }
    }

    fn spawn_worker(&mut self, ctx: &mut Context<Self>) {
        self.incarnation += 1;
        self.ready = false;
        self.load_watch = LoadWatch::new(Instant::now());
        self.worker_was_ready = false;
        let incarnation = self.incarnation;
        let w = &self.config.worker;
        let mut command = Command::new(&self.config.exe);
        // OpenMP threads spin briefly at llama.cpp's barriers (sleeping there
        // makes decode ~3x slower) but not for long once a decode is done, so
        // the daemon's own threads get the cores between steps. An explicit
        // OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins.
        if std::env::var_os("OMP_WAIT_POLICY").is_none()
            && std::env::var_os("GOMP_SPINCOUNT").is_none()
        {
            command.env("GOMP_SPINCOUNT", WORKER_SPINCOUNT);
        }
        // The weights and KV buffers on 2 MiB pages (engine::hugepages).
        command.env(
            "GLIBC_TUNABLES",
            crate::engine::hugepages::worker_tunables(
                std::env::var_os("GLIBC_TUNABLES").as_deref(),
            ),
        );
        if !self.config.placement.servers.is_empty() {
            // A lost RPC server aborts the worker (ggml-rpc): an expected
            // death, not worth ggml's backtrace (which runs gdb when present
            // and delays the respawn by seconds).
            command.env("GGML_NO_BACKTRACE", "1");
        }
        // The worker is SIGKILLed by the kernel when the daemon dies (a
        // SIGKILLed daemon cannot stop it), set between fork and exec so no
        // moment of the worker's life is without it.
        let daemon = std::process::id();
        // SAFETY: the closure runs in the forked child before exec and calls
        // only async-signal-safe functions (prctl, getppid, _exit).
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The daemon died before the request took effect.
                if libc::getppid() as u32 != daemon {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let mut child = match command
            .arg("worker")
            .arg("--model")
            .arg(&self.config.model)
            .args(["--ctx-size", &w.n_ctx.to_string()])
            .args(["--parallel", &w.n_seq.to_string()])
            .args(["--batch", &w.n_batch.to_string()])
            .args(["--threads", &w.threads.to_string()])
            .args(["--cache-ram-mb", &self.config.cache_ram_mb.to_string()])
            .args(["--kv-bits", &self.config.kv_bits.to_string()])
            .args(self.config.mmap.then_some("--mmap"))
            .args(match &self.config.park {
                Some((dir, bytes)) => vec![
                    "--park-dir".into(),
                    dir.clone().into_os_string(),
                    "--park-budget-bytes".into(),
                    bytes.to_string().into(),
                ],
                None => vec![],
            })
            .args(match &self.config.park {
                Some(_) if self.config.park_lossy => vec!["--park-lossy"],
                _ => vec![],
            })
            .args(rpc_args(&self.config.placement))
            .args(match &self.config.vision {
                Some((mmproj, media)) => vec![
                    "--mmproj".into(),
                    mmproj.clone().into_os_string(),
                    "--media-dir".into(),
                    media.clone().into_os_string(),
                ],
                None => vec![],
            })
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
        {
            Ok(c) => c,
            Err(e) => {
                log::error!("cannot start the worker: {e}");
                let why = format!("{}: {e}", self.config.exe.display());
                self.spawn_failed(&e, why);
                self.schedule_respawn(ctx);
                return;
            }
        };
        log::info!(
            "worker {} of {} started (pid {})",
            incarnation,
            self.config.model.display(),
            child.id()
        );
        let (stdin, stdout, stderr) = (
            child.stdin.take().expect("piped"),
            child.stdout.take().expect("piped"),
            child.stderr.take().expect("piped"),
        );
        let stdin = OwnedFd::from(stdin);
        self.stdin_for_shutdown = stdin.try_clone().ok().map(std::fs::File::from);
        let pipes = pipe::Receiver::from_owned_fd(OwnedFd::from(stdout))
            .and_then(|out| Ok((out, pipe::Sender::from_owned_fd(stdin)?)));
        let (stdout, mut stdin) = match pipes {
            Ok(p) => p,
            Err(e) => {
                log::error!("cannot set up the worker's pipes: {e}");
                let _ = child.kill();
                let _ = child.wait();
                self.spawn_failed(&e, format!("its pipes: {e}"));
                self.schedule_respawn(ctx);
                return;
            }
        };
        let me = ctx.address();
        actix::spawn(async move {
            let mut stdout = tokio::io::BufReader::new(stdout);
            let reason = loop {
                match read_frame(&mut stdout, MAX_WORKER_FRAME_BYTES).await {
                    Ok(Some(frame)) => match from_postcard::<WorkerResponse>(&frame) {
                        Ok(response) => me.do_send(FromWorker {
                            incarnation,
                            response,
                        }),
                        Err(e) => break format!("unreadable reply: {e}"),
                    },
                    Ok(None) => break "its output closed".to_string(),
                    Err(e) => break e.to_string(),
                }
            };
            me.do_send(WorkerGone {
                incarnation,
                reason,
            });
        });
        let stderr = match pipe::Receiver::from_owned_fd(OwnedFd::from(stderr)) {
            Ok(r) => r,
            Err(e) => {
                log::error!("cannot set up the worker's stderr: {e}");
                let _ = child.kill();
                let _ = child.wait();
                self.spawn_failed(&e, format!("its stderr: {e}"));
                self.schedule_respawn(ctx);
                return;
            }
        };
        actix::spawn(relay_stderr(stderr));
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        self.frames_sent = 0;
        self.frames_written = Arc::default();
        let written = self.frames_written.clone();
        actix::spawn(async move {
            // Ends when the lane drops the sender (the worker is gone or
            // being replaced), closing the worker's stdin, or on a write
            // error (the reader reports the death). The count tells the lane
            // which requests the worker could have read.
            while let Some(frame) = rx.recv().await {
                if stdin.write_all(&frame).await.is_err() {
                    break;
                }
                written.fetch_add(1, Ordering::SeqCst);
            }
        });
        self.to_worker = Some(tx);
        self.child = Some(child);
        self.respawns.spawns_failed_in_a_row = 0;
    }

    /// The worker answered the oldest request in flight: it moves on to the
    /// next one now, its decode rate is noted, and the reply is checked.
    fn took_reply(&mut self, check: &ReplyCheck, response: &WorkerResponse) -> Result<(), String> {
        self.head_since = Instant::now();
        if let WorkerResponse::Decoded {
            tokens, decode_us, ..
        } = response
        {
            if *tokens > 0 {
                let rate = decode_us / u64::from(*tokens);
                self.slowest_us_per_token = self.slowest_us_per_token.max(rate);
            }
        }
        check.verify(response, self.n_vocab)
    }

    /// A worker past the deadline of the request it is on is taken for hung
    /// (a llama.cpp call that never returns, a pathological grammar): it is
    /// killed, and the respawn path fails what it was running.
    fn check_deadline(&mut self) {
        self.check_load_deadline();
        let Some((_, _, _, deadline)) = self.in_flight.front() else {
            return;
        };
        if self.child.is_none() {
            // Dead, its requests about to fail (a probe of the RPC servers
            // is under way): nothing to stop.
            return;
        }
        let waited = self.head_since.elapsed();
        if waited <= *deadline || self.stop_reason.is_some() {
            return;
        }
        let error = LaneError::Hung(format!(
            "the worker did not answer a step within {:.1} s (--step-timeout-secs {}, \
             plus its work); it was stopped",
            deadline.as_secs_f64(),
            self.config.step_timeout.as_secs()
        ));
        log::error!("{error}");
        self.stop_worker(Some(error));
    }

    /// A loading worker (not `Ready` yet) that shows no progress for
    /// `--load-timeout-secs` (a load stuck on I/O: a file on a hung network
    /// mount, a remote server that stopped answering) is killed: what waits
    /// for it fails saying so, and a new one starts, as after a death. One
    /// that reads, writes or computes is loading, however long it takes.
    fn check_load_deadline(&mut self) {
        if self.ready || self.stop_reason.is_some() {
            return;
        }
        let Some(child) = &self.child else {
            return;
        };
        let limit = self.config.load_timeout;
        let work = LoadWatch::sample(child.id());
        if !self.load_watch.stalled(work, Instant::now(), limit) {
            return;
        }
        let error = LaneError::Hung(format!(
            "the worker loading the model {} made no progress for {} s \
             (--load-timeout-secs); it was stopped",
            self.config.model.display(),
            limit.as_secs()
        ));
        log::error!("{error}");
        self.stop_worker(Some(error));
    }

    /// Why a load is refused now: a `--model`'s last load failed within
    /// the respawn delay.
    fn load_refused(&self) -> Option<LaneError> {
        self.load_failed
            .as_ref()
            .filter(|(_, until)| Instant::now() < *until)
            .map(|(why, _)| why.clone())
    }

    /// Changes this lane's line in the gate, if it has one.
    fn gate_update(&self, f: impl FnOnce(&mut super::load_gate::Entry)) {
        if let Some((gate, slot)) = &self.config.gate {
            gate.update(*slot, f);
        }
    }

    /// Notes a request coming in (`incoming`) or a reply going out: when
    /// the lane was last used, and whether it has work.
    fn touch(&mut self, incoming: bool) {
        self.last_used = Instant::now();
        let active = incoming || !self.in_flight.is_empty() || !self.held.is_empty();
        let now = super::now_ms();
        self.gate_update(|e| {
            e.active = active;
            e.last_used_ms = now;
        });
    }

    /// Loads the unloaded model: asks the gate (which may have idle models
    /// unload to make room) and starts the worker; Err when it does not fit.
    fn load(&mut self, ctx: &mut Context<Self>) -> Result<(), LaneError> {
        if let Some((gate, slot)) = &self.config.gate {
            let victims = gate
                .with(|g| g.plan_load(*slot, available_memory(), super::now_ms()))
                .map_err(|why| {
                    log::warn!("{why}");
                    LaneError::CannotLoad(why)
                })?;
            for v in victims {
                gate.unload(v);
            }
        }
        log::info!("loading the model {}", self.config.model.display());
        self.state.send_replace(LaneState::Loading);
        self.start_worker(ctx);
        Ok(())
    }

    /// Unloads an idle lazy model whose keep-alive ran out.
    fn check_keep_alive(&mut self) {
        if !self.config.lazy
            || !self.ready
            || self.unloading
            || !self.in_flight.is_empty()
            || !self.held.is_empty()
        {
            return;
        }
        let Some((gate, slot)) = &self.config.gate else {
            return;
        };
        if let Some(keep) = gate.entry(*slot).keep_alive_ms {
            if self.last_used.elapsed() >= Duration::from_millis(keep) {
                self.unload(&format!(
                    "idle for {:.1} s, its keep-alive",
                    keep as f64 / 1e3
                ));
            }
        }
    }

    /// Stops the worker of an idle model; its exit leaves the lane unloaded.
    fn unload(&mut self, why: &str) {
        log::info!(
            "unloading the model {} ({why})",
            self.config.model.display()
        );
        self.unloading = true;
        self.ready = false;
        self.stop_worker(Some(LaneError::Unloaded));
    }

    /// Fails every request held for a worker that is not ready.
    fn fail_held(&mut self, error: &LaneError) {
        for (_, reply, _) in self.held.drain(..) {
            let _ = reply.send(Err(error.clone()));
        }
    }

    /// Tells the scheduler the worker's KV is gone. Requests held for the
    /// next worker that were planned against the gone one's KV are refused
    /// (`NotDelivered`): their planner had not heard.
    fn reset_kv(&mut self, error: LaneError) {
        self.resets += 1;
        let stale = LaneError::NotDelivered(format!(
            "planned against the cells of a worker that is gone ({error})"
        ));
        for (request, reply, kv) in std::mem::take(&mut self.held) {
            if kv {
                let _ = reply.send(Err(stale.clone()));
            } else {
                self.held.push_back((request, reply, kv));
            }
        }
        self.listener.do_send(LaneReset {
            error,
            epoch: self.resets,
        });
    }

    /// Kills the running worker; its exit (WorkerGone) then fails what it
    /// leaves with `reason` when one is given, else as a death.
    fn stop_worker(&mut self, reason: Option<LaneError>) {
        if reason.is_some() {
            self.stop_reason = reason;
        }
        if let Some(child) = &mut self.child {
            let _ = child.kill();
        }
    }

    /// Why a worker's `Ready` is refused, if it is: another vocabulary than
    /// the daemon's, or another configuration than the first worker's.
    fn check_ready(
        &mut self,
        config: &WorkerConfig,
        n_vocab: u32,
        digest: &[u8; 32],
    ) -> Result<(), String> {
        if let Some((want_n, want_digest)) = &self.config.vocabulary {
            if (n_vocab, digest) != (*want_n, want_digest) {
                return Err(format!(
                    "the model file {} changed since the daemon started: its vocabulary \
                     ({n_vocab} tokens) is not the one the daemon tokenizes with ({want_n} \
                     tokens); restore the file or restart the daemon",
                    self.config.model.display()
                ));
            }
        }
        match &self.first_config {
            Some(first) if first != config => Err(format!(
                "the new worker runs {config:?}, not {first:?} like the first one; restart \
                 the daemon"
            )),
            Some(_) => Ok(()),
            None => {
                self.first_config = Some(config.clone());
                Ok(())
            }
        }
    }

    /// A worker could not be started. What waits for it would otherwise
    /// wait for as long as the respawns fail: it fails, saying why, when
    /// the error will not pass (the binary is gone or not executable) or
    /// has not passed [`SPAWN_TRIES`] times in a row; before that it is
    /// handed back undelivered, and runs on the next worker (a generation
    /// that has drawn nothing sees only the delay).
    fn spawn_failed(&mut self, e: &std::io::Error, why: String) {
        let lasting = matches!(
            e.kind(),
            std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
        );
        self.respawns.spawns_failed_in_a_row += 1;
        if lasting || self.respawns.spawns_failed_in_a_row >= SPAWN_TRIES {
            self.fail_held(&LaneError::CouldNotStart(why));
        } else {
            self.fail_held(&LaneError::NotDelivered(format!(
                "the worker could not start ({why}); trying again"
            )));
        }
    }

    fn schedule_respawn(&mut self, ctx: &mut Context<Self>) {
        self.state.send_replace(LaneState::Respawning);
        let delay = self.respawns.next_delay();
        ctx.run_later(delay, |this, ctx| this.start_worker(ctx));
    }

    fn send_now(&mut self, request: WorkerRequest, reply: Reply) {
        let frame = match to_postcard(&request) {
            // One write per frame: the length prefix, then the body.
            Ok(body) => match encode_frame(&body) {
                Ok(frame) => frame,
                Err(_) => {
                    let _ = reply.send(Err(LaneError::RequestTooLarge(body.len())));
                    return;
                }
            },
            Err(e) => {
                let _ = reply.send(Err(LaneError::Encode(e.to_string())));
                return;
            }
        };
        match &self.to_worker {
            Some(tx) if tx.send(frame).is_ok() => {
                crate::logging::stage("lane_write", &"-");
                if self.in_flight.is_empty() {
                    self.head_since = Instant::now();
                }
                let deadline = step_deadline(
                    self.config.step_timeout,
                    work_of(&request),
                    self.slowest_us_per_token,
                );
                self.in_flight.push_back((
                    reply,
                    ReplyCheck::of(&request),
                    self.frames_sent,
                    deadline,
                ));
                self.frames_sent += 1;
            }
            _ => {
                let _ = reply.send(Err(LaneError::NotRunning));
            }
        }
    }
}

impl Actor for LaneActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if let Some((gate, slot)) = &self.config.gate {
            gate.register(*slot, ctx.address());
        }
        if self.config.lazy {
            self.gate_update(|e| e.loaded = false);
        } else {
            self.gate_update(|e| e.loaded = true);
            self.start_worker(ctx);
        }
        ctx.run_interval(DEADLINE_CHECK, |this, _| {
            this.check_deadline();
            this.check_keep_alive();
        });
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        self.to_worker = None;
        // Ask the worker to exit after what it has queued (a small frame: a
        // pipe with room takes it at once; if not, the kill below does).
        let frame = to_postcard(&WorkerRequest::Shutdown).map(|body| encode_frame(&body));
        if let (Some(mut f), Ok(Ok(frame))) = (self.stdin_for_shutdown.take(), frame) {
            use std::io::Write;
            let _ = f.write_all(&frame);
        }
        if let Some(mut child) = self.child.take() {
            // Give it a moment to exit cleanly, then make sure.
            for _ in 0..SHUTDOWN_GRACE_MS / SHUTDOWN_POLL_MS {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(SHUTDOWN_POLL_MS));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Handler<Exec> for LaneActor {
    type Result = ResponseFuture<Result<Vec<WorkerResponse>, LaneError>>;

    fn handle(&mut self, msg: Exec, ctx: &mut Context<Self>) -> Self::Result {
        if msg.kv_epoch.is_some_and(|e| e < self.resets) {
            let error = LaneError::NotDelivered(
                "planned against the cells of a worker that is gone".into(),
            );
            return Box::pin(async move { Err(error) });
        }
        let kv = msg.kv_epoch.is_some();
        if let Some(why) = &self.rpc_down {
            let error = LaneError::RpcUnreachable(format!(
                "{why}; the model refuses work until it answers again"
            ));
            return Box::pin(async move { Err(error) });
        }
        let unloaded = self.child.is_none() && *self.state.borrow() == LaneState::Unloaded;
        if (unloaded || self.unloading) && !msg.requests.iter().any(needs_model) {
            // Housekeeping of a KV that is gone with the worker (a spill,
            // a clear): nothing to do, and no reason to load the model.
            return Box::pin(async { Err(LaneError::Unloaded) });
        }
        if unloaded {
            if let Some(error) = self.load_refused() {
                return Box::pin(async move { Err(error) });
            }
            if let Err(error) = self.load(ctx) {
                return Box::pin(async move { Err(error) });
            }
        }
        self.touch(true);
        let mut replies = Vec::with_capacity(msg.requests.len());
        for request in msg.requests {
            let (tx, rx) = oneshot::channel();
            if self.ready {
                self.send_now(request, tx);
            } else {
                self.held.push_back((request, tx, kv));
            }
            replies.push(rx);
        }
        Box::pin(async move {
            let mut out = Vec::with_capacity(replies.len());
            for rx in replies {
                out.push(rx.await.unwrap_or(Err(LaneError::Stopped))?);
            }
            Ok(out)
        })
    }
}

impl Handler<FromWorker> for LaneActor {
    type Result = ();

    fn handle(&mut self, msg: FromWorker, _: &mut Context<Self>) {
        if msg.incarnation != self.incarnation {
            return;
        }
        if !self.ready {
            if let WorkerResponse::Err { message } = &msg.response {
                let error = LaneError::CouldNotStart(message.clone());
                log::error!("{error}");
                self.fail_held(&error);
                // What comes before the worker's exit fails the same way,
                // not as a bare death.
                self.stop_reason.get_or_insert(error);
                return;
            }
        }
        if let WorkerResponse::Ready {
            config,
            n_vocab,
            vocab_digest,
        } = &msg.response
        {
            if let Err(why) = self.check_ready(config, *n_vocab, vocab_digest) {
                // Refused: the held requests fail with why, and the worker
                // is stopped; the respawn (with its growing delay), or for
                // a `--model` the next request, tries again, so restoring
                // the file brings the lane back.
                let error = LaneError::WrongModel(why);
                log::error!("{error}");
                self.fail_held(&error);
                self.stop_worker(Some(error));
                return;
            }
            self.n_vocab = *n_vocab;
            log::info!(
                "worker ready: {n_vocab} tokens, {} KV cells, {} sequences",
                config.n_ctx,
                config.n_seq
            );
            self.ready = true;
            self.worker_was_ready = true;
            self.load_failed = None;
            self.state.send_replace(LaneState::Ready);
            while let Some((request, reply, _)) = self.held.pop_front() {
                self.send_now(request, reply);
            }
            return;
        }
        crate::logging::stage("lane_reply", &"-");
        match self.in_flight.pop_front() {
            Some((reply, check, _, _)) => match self.took_reply(&check, &msg.response) {
                Ok(()) => {
                    self.respawns.answered(&msg.response);
                    let _ = reply.send(Ok(msg.response));
                    if self.in_flight.is_empty() {
                        self.touch(false);
                    }
                }
                Err(why) => {
                    // A worker that answers nonsense is broken: nothing of
                    // it is used, and it is replaced.
                    let error = LaneError::BadReply(why);
                    log::error!("{error}; stopping the worker");
                    let _ = reply.send(Err(error));
                    self.stop_worker(None);
                }
            },
            None => log::warn!("unexpected reply from the worker: {:?}", msg.response),
        }
    }
}

impl Handler<WorkerGone> for LaneActor {
    type Result = ();

    fn handle(&mut self, msg: WorkerGone, ctx: &mut Context<Self>) {
        if msg.incarnation != self.incarnation {
            return;
        }
        // The reader may have stopped on a bad frame with the worker still
        // alive: make sure it is gone before waiting for it.
        let status = self
            .child
            .take()
            .and_then(|mut c| {
                let _ = c.kill();
                c.wait().ok()
            })
            .map(|s| s.to_string())
            .unwrap_or_else(|| "unknown status".into());
        let error = self.stop_reason.take().unwrap_or(LaneError::WorkerDied {
            reason: msg.reason,
            status,
        });
        self.to_worker = None;
        self.stdin_for_shutdown = None;
        self.ready = false;
        if !self.unloading && !self.config.placement.servers.is_empty() {
            // With --rpc, a death is most often a lost server: find out
            // which before failing what the worker held, so the error names
            // it. Requests coming meanwhile are held.
            self.state.send_replace(LaneState::Respawning);
            self.probe(ctx, AfterProbe::Gone(error));
            return;
        }
        self.worker_gone(error, ctx);
    }
}

impl Handler<Probed> for LaneActor {
    type Result = ();

    fn handle(&mut self, msg: Probed, ctx: &mut Context<Self>) {
        let down = self.note_probe(&msg.down);
        match msg.then {
            AfterProbe::Gone(error) => {
                let error = match &down {
                    Some(why) => LaneError::RpcUnreachable(format!("{why}; {error}")),
                    None => error,
                };
                self.worker_gone(error, ctx);
            }
            AfterProbe::Start => {
                self.probing = false;
                match down {
                    None => {
                        if self.rpc_down.take().is_some() {
                            log::info!("the RPC servers answer again; starting the worker");
                            self.state.send_replace(LaneState::Respawning);
                        }
                        self.spawn_worker(ctx);
                    }
                    Some(why) => {
                        if self.rpc_down.is_none() {
                            log::error!("{why}; refusing work until it answers");
                        }
                        self.state.send_replace(LaneState::Unreachable);
                        self.fail_held(&LaneError::RpcUnreachable(why.clone()));
                        self.rpc_down = Some(why);
                        ctx.run_later(RPC_PROBE_EVERY, |this, ctx| this.start_worker(ctx));
                    }
                }
            }
        }
    }
}

impl LaneActor {
    /// The rest of a worker's death, once its error is known: fails what it
    /// held, tells the scheduler, and respawns (or settles unloaded).
    fn worker_gone(&mut self, error: LaneError, ctx: &mut Context<Self>) {
        let unloaded = std::mem::take(&mut self.unloading);
        // A `--model` whose load failed is not retried for nobody: it
        // settles unloaded, and the next request loads it again.
        let load_failed = self.config.lazy && !self.worker_was_ready;
        if unloaded {
            log::info!("the model {} is unloaded", self.config.model.display());
        } else if load_failed {
            log::error!("{error}; the model stays unloaded until it is asked for again");
        } else {
            log::error!("{error}; starting a new one");
        }
        // What the worker could have read fails; what never reached it (its
        // stdin was closed, or the write not yet tried) is NotDelivered, which
        // the scheduler runs again on the next worker.
        let written = self.frames_written.load(Ordering::SeqCst);
        for (reply, _, frame, _) in self.in_flight.drain(..) {
            let _ = reply.send(Err(if frame < written {
                error.clone()
            } else {
                LaneError::NotDelivered(error.to_string())
            }));
        }
        if unloaded {
            // The KV is gone as after a death; requests that came while the
            // worker exited load the model again (those planned against its
            // cells are refused: the scheduler replans).
            self.reset_kv(error);
            self.state.send_replace(LaneState::Unloaded);
            self.gate_update(|e| e.loaded = false);
            if !self.held.is_empty() {
                if let Err(error) = self.load(ctx) {
                    self.fail_held(&error);
                }
            }
            self.touch(false);
            return;
        }
        // Requests held for a worker that never became ready fail too: a
        // respawn that keeps failing must not leave them waiting forever.
        self.fail_held(&error);
        if load_failed {
            let wait = self.respawns.next_delay();
            self.load_failed = Some((error.clone(), Instant::now() + wait));
        }
        self.reset_kv(error);
        if load_failed {
            self.state.send_replace(LaneState::Unloaded);
            self.gate_update(|e| e.loaded = false);
            self.touch(false);
            return;
        }
        self.schedule_respawn(ctx);
    }
}

impl Handler<WithdrawHeld> for LaneActor {
    type Result = ();

    fn handle(&mut self, _: WithdrawHeld, _: &mut Context<Self>) {
        if self.ready {
            return;
        }
        let withdrawn = LaneError::NotDelivered(
            "withdrawn while the worker loads: a generation was cancelled".into(),
        );
        for (request, reply, kv) in std::mem::take(&mut self.held) {
            if kv {
                let _ = reply.send(Err(withdrawn.clone()));
            } else {
                self.held.push_back((request, reply, kv));
            }
        }
        self.touch(false);
    }
}

impl Handler<Load> for LaneActor {
    type Result = Result<(), String>;

    fn handle(&mut self, _: Load, ctx: &mut Context<Self>) -> Self::Result {
        if self.child.is_none() && *self.state.borrow() == LaneState::Unloaded {
            if let Some(error) = self.load_refused() {
                return Err(error.to_string());
            }
            self.load(ctx).map_err(|e| e.to_string())?;
        }
        self.touch(false);
        Ok(())
    }
}

impl Handler<Unload> for LaneActor {
    type Result = ();

    fn handle(&mut self, _: Unload, _: &mut Context<Self>) {
        let busy = !self.in_flight.is_empty() || !self.held.is_empty();
        if busy || self.child.is_none() || self.unloading {
            // Work came in since the gate chose it: it stays loaded.
            let loaded = self.child.is_some() && !self.unloading;
            self.gate_update(|e| e.loaded = loaded);
            return;
        }
        self.unload("room for another model");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_respawn_delay_starts_over_only_after_a_decode() {
        let ms = |d: Duration| d.as_millis() as u64;
        let mut r = Respawns::default();
        assert_eq!(ms(r.next_delay()), RESPAWN_DELAY_MS);
        // A step's housekeeping answered, then its decode crashed the
        // worker: the delay keeps doubling.
        r.answered(&WorkerResponse::Done);
        r.answered(&WorkerResponse::Spilled { key: 1, bytes: 2 });
        assert_eq!(ms(r.next_delay()), 2 * RESPAWN_DELAY_MS);
        r.answered(&WorkerResponse::Done);
        assert_eq!(ms(r.next_delay()), 4 * RESPAWN_DELAY_MS);
        for _ in 0..10 {
            r.next_delay();
        }
        assert_eq!(ms(r.next_delay()), RESPAWN_DELAY_MAX_MS);
        // A worker that decoded: the next death waits the first delay.
        r.answered(&WorkerResponse::Decoded {
            drawn: vec![],
            tokens: 1,
            decode_us: 1,
            refused: vec![],
            unparked: vec![],
            attention: Default::default(),
        });
        assert_eq!(ms(r.next_delay()), RESPAWN_DELAY_MS);
    }

    #[test]
    fn a_load_is_stalled_only_after_the_limit_without_progress() {
        let t0 = Instant::now();
        let limit = Duration::from_secs(10);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut w = LoadWatch::new(t0);
        assert!(!w.stalled(Some(5), at(1), limit));
        // Progress keeps it alive however long the load takes.
        for s in 2..40 {
            assert!(!w.stalled(Some(5 + s), at(s), limit), "{s}");
        }
        // No change for the limit and more: stalled.
        assert!(!w.stalled(Some(44), at(49), limit));
        assert!(w.stalled(Some(44), at(50), limit));
        // A process /proc cannot read (gone) is no progress either.
        let mut w = LoadWatch::new(t0);
        assert!(w.stalled(None, at(11), limit));
    }

    #[test]
    fn this_process_shows_work_in_proc() {
        let pid = std::process::id();
        let a = LoadWatch::sample(pid).expect("/proc/self");
        let _ = std::fs::read("/proc/self/stat").unwrap();
        let b = LoadWatch::sample(pid).expect("/proc/self");
        assert!(b > a, "{a} then {b}");
        assert_eq!(LoadWatch::sample(u32::MAX), None);
    }

    #[test]
    fn a_deadline_grows_with_the_work_at_the_slowest_rate_seen() {
        let base = Duration::from_secs(60);
        assert_eq!(step_deadline(base, 0, 0), base);
        // Before any decode: 10 ms a token.
        assert_eq!(step_deadline(base, 100, 0), base + Duration::from_secs(1));
        // 2 ms a token seen: 20 times that.
        assert_eq!(
            step_deadline(base, 1000, 2_000),
            base + Duration::from_secs(40)
        );
    }

    #[test]
    fn rpc_servers_go_to_the_worker_and_into_metrics() {
        use crate::engine::rpc::Placement;
        assert!(rpc_args(&Placement::default()).is_empty());
        let p = Placement {
            servers: vec!["10.0.0.2:50052".into(), "10.0.0.3:50052".into()],
            split: vec![3.0, 1.0, 0.5],
        };
        assert_eq!(
            rpc_args(&p),
            [
                "--rpc",
                "10.0.0.2:50052,10.0.0.3:50052",
                "--tensor-split",
                "3,1,0.5"
            ]
        );
        assert_eq!(rpc_metrics(&rpc_status(&[])), "");
        let status = rpc_status(&p.servers);
        status.lock().unwrap()[1].down = Some("Connection refused".into());
        let text = rpc_metrics(&status);
        assert!(text.contains("superfluid_rpc_server_up{server=\"10.0.0.2:50052\"} 1\n"));
        assert!(text.contains("superfluid_rpc_server_up{server=\"10.0.0.3:50052\"} 0\n"));
        assert!(text.contains("# TYPE superfluid_rpc_server_up gauge\n"));
    }

    #[test]
    fn the_state_in_metrics_is_one_gauge_per_state() {
        let text = LaneState::Respawning.metrics();
        assert!(text.contains("superfluid_lane_state{state=\"loading\"} 0\n"));
        assert!(text.contains("superfluid_lane_state{state=\"ready\"} 0\n"));
        assert!(text.contains("superfluid_lane_state{state=\"respawning\"} 1\n"));
        assert!(text.contains("superfluid_lane_state{state=\"unreachable\"} 0\n"));
        assert!(text.contains("# TYPE superfluid_lane_state gauge\n"));
    }
}
