//! Starting and stopping the daemon: lock the sessions directory, load the
//! model's vocabulary, replay the log into the book, start the actors and
//! the socket, and on SIGINT/SIGTERM flush the log and remove the socket.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use actix::prelude::*;

use crate::actors::lane::{LaneActor, LaneConfig, LaneHealth};
use crate::actors::load_gate::{Entry as GateEntry, GateState, LoadGate};
use crate::actors::registry::Registry;
use crate::actors::scheduler::SchedulerActor;
use crate::actors::served::{Served, ServedModel};
use crate::actors::wal::{Shutdown, WalActor};
use crate::actors::{now_ms, Shared};
use crate::engine::render::Renderer;
use crate::engine::template::normalize_tool;
use crate::engine::vocab::Vocab;
use crate::engine::EngineError;
use crate::frontend::socket::{SocketError, SocketId};
use crate::http::compat::ModelInfo;
use crate::http::{StartError, WebConfig};
use crate::scheduler::spill::SpillIndex;
use crate::scheduler::SchedulerState;
use crate::session::{
    conversation_by_spans, ChatMessage, Render, RenderError, RenderedConversation, SessionBook,
};
use crate::store::{self, DirLock, OpenMode, StoreError, WalWriter};
use crate::wire::worker::WorkerConfig;
use crate::wire::{from_postcard, LogRecord, Token};

/// Why the daemon did not start. `main` prints it with its sources.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Web(#[from] StartError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Socket(#[from] SocketError),
    #[error(transparent)]
    Model(#[from] EngineError),
    #[error("cannot start the wal-writer thread: {0}")]
    WalWriter(std::io::Error),
    #[error("cannot record this start in the log: {0}")]
    Boot(crate::actors::CommitError),
    #[error(
        "two models, or a model and \"default\", have the id {0:?} (a model's id is its \
         file name without .gguf): rename one file"
    )]
    ModelId(String),
    /// Signal handlers, the executable's path.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// What `superfluid serve` was asked to do.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub model: PathBuf,
    pub sessions: PathBuf,
    pub socket: PathBuf,
    pub sessions_cache: bool,
    /// The model lane's worker: KV cells, sequences, batch, threads.
    pub worker: WorkerConfig,
    /// `--pin-budget-pct`: the share of KV cells pins may protect.
    pub pin_budget_pct: u32,
    /// `--web`: the browser transport, off when None.
    pub web: Option<crate::http::WebConfig>,
    /// `--sub-buffer`: events a subscription may queue before it is lagged.
    pub sub_buffer: usize,
    /// `--cache-ram-mb`: the host-memory tier's budget in MiB (0: off).
    pub cache_ram_mb: u64,
    /// `--idle-spill-ms`: idle sequences leave the cells after this long
    /// (0: never).
    pub idle_spill_ms: u64,
    /// `--turn-warm-ms`: an ended turn's opening is decoded ahead after
    /// this long without a next turn.
    pub turn_warm_ms: u64,
    /// `--park` with `--park-budget-gb` (0: unbounded); None: off.
    pub park_budget_bytes: Option<u64>,
    /// `--park-lossy`: park artifacts with their KV rows as Q8_0.
    pub park_lossy: bool,
    /// `--kv-bits`: the KV cache's type, 16 (f16) or 8 (Q8_0).
    pub kv_bits: u8,
    /// `--mmap`: the workers map the model file instead of reading it.
    pub mmap: bool,
    /// `--step-timeout-secs`: how long a worker step may run before the
    /// worker is taken for hung (plus an allowance per token of work).
    pub step_timeout: std::time::Duration,
    /// `--load-timeout-secs`: how long a worker loading its model may show
    /// no progress before it is taken for hung.
    pub load_timeout: std::time::Duration,
    /// `--max-connections`: live connections on the socket, and on `--web`.
    pub max_connections: usize,
    /// `--model`: more models served beside `model`, each with its own log
    /// under `<sessions>/models/<id>/`, loaded on first use.
    pub more_models: Vec<PathBuf>,
    /// `--keep-alive`: how long a `--model` stays loaded with no request, in
    /// ms; None: for ever.
    pub keep_alive_ms: Option<u64>,
    /// `--max-loaded-models`: models loaded at once, the first included.
    pub max_loaded_models: usize,
    /// `--memory-limit-mb`: what the loaded models may need together; None:
    /// the machine's available memory decides at each load.
    pub memory_limit_mb: Option<u64>,
    /// `--rpc` and `--tensor-split`: the first model's layers on ggml RPC
    /// servers (the other models run here).
    pub placement: crate::engine::rpc::Placement,
    /// `--mmproj` (or the projector fetched beside a model reference): the
    /// first model's vision projector; None: it takes no images.
    pub mmproj: Option<PathBuf>,
    /// The projectors of `more_models`, in their order (fetched beside a
    /// reference; a file path has none).
    pub more_mmproj: Vec<Option<PathBuf>>,
}

/// `--keep-alive` default: Ollama's five minutes.
pub const DEFAULT_KEEP_ALIVE: &str = "5m";

/// `--max-loaded-models` default: Ollama's on a machine without a GPU.
pub const DEFAULT_MAX_LOADED_MODELS: usize = 3;

/// A served model's id: its file stem (`SmolLM2-135M-Instruct.Q4_1`).
pub fn model_id(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "default".into())
}

/// The directory of a `--model`'s log (and park and media directories).
pub fn model_dir(sessions: &Path, id: &str) -> PathBuf {
    sessions.join("models").join(id)
}

/// Whether `path` is a vision projector (a GGUF whose
/// `general.architecture` is `clip`, as llama.cpp's mtmd writes them); the
/// error names the file and what it holds.
pub fn check_projector(path: &Path) -> Result<(), String> {
    use crate::http::compat::gguf;
    let meta = std::fs::File::open(path)
        .and_then(|f| gguf::read_meta(&mut std::io::BufReader::new(f)))
        .map_err(|e| format!("{}: not a GGUF file ({e})", path.display()))?;
    match meta.get("general.architecture").and_then(|v| v.as_str()) {
        Some("clip") => Ok(()),
        other => Err(format!(
            "{}: not a vision projector (its general.architecture is {}, not clip)",
            path.display(),
            other.unwrap_or("missing")
        )),
    }
}

/// What a model needs loaded, in bytes, for the load gate: its file, its
/// KV cache at `--ctx-size` (f16 K and V for every layer, from the GGUF's
/// header), and a tenth of the file for llama.cpp's compute buffers.
pub fn model_need(path: &Path, worker: &WorkerConfig) -> u64 {
    use crate::http::compat::gguf;
    let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let kv = std::fs::File::open(path)
        .ok()
        .and_then(|f| gguf::read_meta(&mut std::io::BufReader::new(f)).ok())
        .map(|meta| {
            let arch = meta
                .get("general.architecture")
                .and_then(|v| v.as_str())
                .unwrap_or("llama")
                .to_string();
            let get = |k: &str| meta.get(&format!("{arch}.{k}")).and_then(|v| v.as_u64());
            let layers = get("block_count").unwrap_or(0);
            let embd = get("embedding_length").unwrap_or(0);
            let heads = get("attention.head_count").unwrap_or(1).max(1);
            let heads_kv = get("attention.head_count_kv").unwrap_or(heads);
            let k = get("attention.key_length").unwrap_or(embd / heads);
            let v = get("attention.value_length").unwrap_or(embd / heads);
            u64::from(worker.n_ctx) * layers * heads_kv * (k + v) * 2
        })
        .unwrap_or(0);
    size + kv + size / 10
}

/// The park artifacts' KV type of a `--kv-bits` cache.
pub fn kv_type(kv_bits: u8) -> u32 {
    if kv_bits == 8 {
        crate::engine::park::KV_TYPE_Q8_0
    } else {
        crate::engine::park::KV_TYPE_F16
    }
}

/// `--step-timeout-secs` default.
pub const DEFAULT_STEP_TIMEOUT_SECS: u64 = 60;

/// `--load-timeout-secs` default: ten minutes without a byte read or a
/// moment of CPU time (a warm-up on a remote server that answers slowly
/// still shows its socket's bytes).
pub const DEFAULT_LOAD_TIMEOUT_SECS: u64 = 600;

/// `--idle-spill-ms` default: measured by bench/idle.rs and bench/peer's
/// idle workload (docs/kv-tiers.md, "Idle sequences").
pub const DEFAULT_IDLE_SPILL_MS: u64 = 2000;

/// The park directory of a sessions directory.
pub fn park_dir(sessions: &Path) -> PathBuf {
    sessions.join("park")
}

/// The park artifacts in `dir` usable with the model at `model`: (session,
/// token ids) for each, headers checked (the state is checked when it is
/// restored). One warning for each that is not.
///
/// An artifact of a session that is not live (purged, or unknown to the
/// log) is deleted: a Purge deletes its artifacts, and this catches one a
/// seal still in the writer's queue wrote after it.
pub fn scan_parked(
    dir: &Path,
    model: &Path,
    cache: u32,
    live: impl Fn(u64) -> bool,
) -> Vec<(u64, Vec<crate::wire::Token>)> {
    use crate::engine::park;
    let Ok(identity) = park::model_identity(model) else {
        return vec![];
    };
    let Ok(rd) = std::fs::read_dir(dir) else {
        return vec![];
    };
    let mut out = Vec::new();
    for p in rd.filter_map(|e| e.ok()).map(|e| e.path()) {
        if let Some((session, _)) = park::segment_of(&p) {
            // Read with its base below; one of a purged session, or one
            // whose base is gone, goes.
            if !live(session) || !park::path(dir, session).exists() {
                let _ = std::fs::remove_file(&p);
            }
            continue;
        }
        let Some(session) = park::session_of(&p) else {
            continue;
        };
        if !live(session) {
            for p in park::remove_all(dir, session) {
                log::info!("deleted {}: its session is purged", p.display());
            }
            continue;
        }
        match park::read_chain_heads(dir, session, &identity, cache) {
            Ok(chain) => {
                if let Some(why) = &chain.stopped {
                    // Never usable: a segment is only written after the one
                    // before it, in the same chain.
                    log::warn!(
                        "park segment {why}; session {session} restores the {} tokens before \
                         it, and the segments from there are deleted",
                        chain.tokens.len()
                    );
                    for k in chain.segments + 1..=park::MAX_SEGMENTS {
                        let _ = std::fs::remove_file(park::segment_path(dir, session, k));
                    }
                }
                out.push((session, chain.tokens));
            }
            Err(e) => {
                log::warn!(
                    "park artifact {} unusable ({e}); that session prefills",
                    p.display()
                );
                // Its segments extend nothing usable.
                for k in 1..=park::MAX_SEGMENTS {
                    let _ = std::fs::remove_file(park::segment_path(dir, session, k));
                }
            }
        }
    }
    out
}

/// How long shutdown waits for subscriptions to send their last frame.
const SUB_END_FLUSH_MS: u64 = 200;

/// `--ctx-size` default: KV cells shared by a lane's sequences.
pub const DEFAULT_CTX_SIZE: u32 = 8192;
/// `--parallel` default: sequences decoded together.
pub const DEFAULT_PARALLEL: u32 = 4;
/// `--batch` default: the most tokens one decode call takes.
pub const DEFAULT_BATCH: u32 = 512;

/// The most `--cache-ram-mb` defaults to (llama-server's default too).
pub const CACHE_RAM_MB_CAP: u64 = 8192;

/// `--cache-ram-mb` default: [`CACHE_RAM_MB_CAP`], at most half the
/// machine's memory (`MemTotal` in /proc/meminfo; the cap when unreadable).
pub fn default_cache_ram_mb() -> u64 {
    let total_kb = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
    });
    match total_kb {
        Some(kb) => CACHE_RAM_MB_CAP.min(kb / 1024 / 2),
        None => CACHE_RAM_MB_CAP,
    }
}

/// `--threads` default: every core the machine has.
pub fn default_threads() -> u32 {
    std::thread::available_parallelism().map_or(2, |n| n.get() as u32)
}

/// The user's home, for the default paths.
pub fn home() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/"))
}

/// `~/.superfluid/sessions`.
pub fn default_sessions_dir() -> PathBuf {
    home().join(".superfluid").join("sessions")
}

/// `~/.superfluid/superfluid.sock`.
pub fn default_socket() -> PathBuf {
    home().join(".superfluid").join("superfluid.sock")
}

/// The model's vocabulary and chat template behind the book's `Render`.
pub struct ModelRender {
    vocab: Arc<Vocab>,
    renderer: Renderer,
}

impl ModelRender {
    pub fn load(model: &Path) -> Result<ModelRender, EngineError> {
        let vocab = Arc::new(Vocab::load(model)?);
        let renderer = Renderer::new(vocab.clone())?;
        Ok(ModelRender { vocab, renderer })
    }
}

fn tools(tools: &[String]) -> Result<Vec<serde_json::Value>, RenderError> {
    tools
        .iter()
        .map(|t| normalize_tool(t).map_err(|e| RenderError(e.to_string())))
        .collect()
}

impl Render for ModelRender {
    fn n_vocab(&self) -> u32 {
        self.vocab.n_vocab()
    }

    fn vocab_digest(&self) -> Option<[u8; 32]> {
        Some(self.vocab.digest())
    }
    fn tokenize(&self, text: &str) -> Vec<Token> {
        self.vocab.tokenize(text, false)
    }
    fn detokenize(&self, span: &[Token]) -> String {
        self.vocab.detokenize(span)
    }
    fn message_span(
        &self,
        history: &[ChatMessage],
        tool_list: &[String],
        new: &ChatMessage,
        first: bool,
    ) -> Result<Vec<Token>, RenderError> {
        self.renderer
            .message_span(history, &tools(tool_list)?, new, first)
            .map_err(|e| RenderError(e.to_string()))
    }
    fn image_span(
        &self,
        history: &[ChatMessage],
        tool_list: &[String],
        role: crate::wire::Role,
        texts: &[String],
        images: &[Vec<Token>],
        first: bool,
    ) -> Result<Vec<Token>, RenderError> {
        self.renderer
            .image_span(history, &tools(tool_list)?, role, texts, images, first)
            .map_err(|e| RenderError(e.to_string()))
    }
    fn system_span(
        &self,
        text: Option<&str>,
        tool_list: &[String],
    ) -> Result<Vec<Token>, RenderError> {
        self.renderer
            .system_span(text, &tools(tool_list)?)
            .map_err(|e| RenderError(e.to_string()))
    }
    fn generation_prompt_span(
        &self,
        history: &[ChatMessage],
        tool_list: &[String],
    ) -> Result<Vec<Token>, RenderError> {
        self.renderer
            .generation_prompt_span(history, &tools(tool_list)?)
            .map_err(|e| RenderError(e.to_string()))
    }
    fn turn_tail(
        &self,
        history: &[ChatMessage],
        tool_list: &[String],
    ) -> Result<Vec<Token>, RenderError> {
        self.renderer
            .turn_tail(history, &tools(tool_list)?)
            .map(Option::unwrap_or_default)
            .map_err(|e| RenderError(e.to_string()))
    }
    fn conversation(
        &self,
        messages: &[ChatMessage],
        tool_list: &[String],
    ) -> Result<RenderedConversation, RenderError> {
        let normalized = tools(tool_list)?;
        match self.renderer.conversation(messages, &normalized) {
            Ok(Some(whole)) => Ok(whole),
            // A template that transforms content: one span per message.
            Ok(None) => {
                log::warn!(
                    "chat template transforms message content; rendering message by message"
                );
                conversation_by_spans(self, messages, tool_list)
            }
            Err(e) => Err(RenderError(e.to_string())),
        }
    }
    fn piece(&self, token: Token) -> Vec<u8> {
        self.vocab.piece(token)
    }
    fn is_eog(&self, token: Token) -> bool {
        self.vocab.is_eog(token)
    }
    fn template_source(&self) -> String {
        self.vocab.chat_template().unwrap_or_default()
    }
    fn fim(&self) -> Option<[Token; 3]> {
        self.vocab.fim().map(|f| [f.pre, f.suf, f.mid])
    }
}

/// Replays the log into a new book.
pub fn replay(dir: &Path, mode: OpenMode) -> Result<(store::WalFile, SessionBook), StoreError> {
    let mut book = SessionBook::new();
    let started = std::time::Instant::now();
    let (file, recovery) = store::open(dir, mode, &mut |offset, payload| {
        let record: LogRecord = from_postcard(payload).map_err(|e| e.to_string())?;
        book.apply(&record)
            .map_err(|e| format!("record at byte offset {offset}: {e}").into())
    })?;
    if recovery.prev_kept {
        log::warn!(
            "--sessions-cache: kept the previous log as {}.prev and began a fresh one",
            dir.join(store::WAL_FILE).display()
        );
    }
    log::info!(
        "replayed {} records ({} bytes, {} sessions) in {:?}",
        recovery.records,
        recovery.valid_bytes,
        book.list().len(),
        started.elapsed()
    );
    Ok((file, book))
}

/// Runs the daemon until SIGINT or SIGTERM.
pub fn serve(config: ServeConfig) -> Result<(), DaemonError> {
    if let Some(web) = &config.web {
        crate::http::check_addr(web.addr)?;
    }
    let _lock = DirLock::acquire(&config.sessions)?;
    // Every model's log directory is locked too: another daemon started on
    // an additional model's <sessions>/models/<id>/ would write the same
    // log (both found it corrupt at their next start).
    let mut _model_locks = Vec::new();
    let listener = crate::frontend::socket::bind(&config.socket)?;
    // Removed on every way out, and only while it is still the one bound here.
    let _socket = SocketGuard {
        id: SocketId::of(&config.socket),
        path: config.socket.clone(),
    };
    let web_listener = match &config.web {
        Some(web) => Some(crate::http::bind(web.addr)?),
        None => None,
    };
    let mode = if config.sessions_cache {
        OpenMode::Cache
    } else {
        OpenMode::Durable
    };
    let mut models = Vec::new();
    for (i, path) in std::iter::once(&config.model)
        .chain(&config.more_models)
        .enumerate()
    {
        let id = model_id(path);
        if id == "default" || id.starts_with('.') || models.iter().any(|m: &Loaded| m.id == id) {
            return Err(DaemonError::ModelId(id));
        }
        let dir = if i == 0 {
            config.sessions.clone()
        } else {
            let dir = model_dir(&config.sessions, &id);
            _model_locks.push(DirLock::acquire(&dir)?);
            dir
        };
        let render = Arc::new(ModelRender::load(path)?);
        let (file, book) = replay(&dir, mode)?;
        let writer = WalWriter::spawn(file, None).map_err(DaemonError::WalWriter)?;
        models.push(Loaded {
            id,
            config: ServeConfig {
                model: path.clone(),
                sessions: dir,
                // An RPC server serves one client at a time: --rpc is the
                // first model's.
                placement: if i == 0 {
                    config.placement.clone()
                } else {
                    Default::default()
                },
                mmproj: if i == 0 {
                    config.mmproj.clone()
                } else {
                    config.more_mmproj.get(i - 1).cloned().flatten()
                },
                ..config.clone()
            },
            book,
            writer,
            render,
        });
    }
    let system = actix::System::new();
    system.block_on(run(config.clone(), listener, web_listener, models))
}

/// A model's log replayed and its writer started, before the actors.
struct Loaded {
    id: String,
    /// The daemon's config with this model's file and directory.
    config: ServeConfig,
    book: SessionBook,
    writer: WalWriter,
    render: Arc<ModelRender>,
}

/// Unlinks the daemon's socket when `serve` returns, if it is still ours.
struct SocketGuard {
    id: Option<SocketId>,
    path: PathBuf,
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            id.remove_if_ours(&self.path);
        }
    }
}

/// Starts the model lane: its `SchedulerActor` and its `LaneActor`, each born
/// knowing the other (the scheduler sends the lane its steps, the lane tells
/// the scheduler when the worker died), and returns the scheduler and the
/// lane's health. Call inside a running actix system.
pub fn start_lane(
    lane: LaneConfig,
    state: SchedulerState,
) -> (Addr<SchedulerActor>, LaneHealth, Addr<LaneActor>) {
    let mut started = None;
    let scheduler = SchedulerActor::create(|ctx| {
        let lane = LaneActor::new(lane, ctx.address().recipient());
        let health = lane.health();
        let addr = lane.start();
        started = Some((health, addr.clone()));
        SchedulerActor::new(state, addr)
    });
    let (health, addr) = started.expect("SchedulerActor::create runs its closure at once");
    (scheduler, health, addr)
}

/// Starts the actors every request runs on (the WAL actor, and the model lane
/// with its scheduler) and returns what they share. `run` builds them here,
/// and so does the in-process ordering test. `exe` is the `superfluid`
/// executable the lane starts its worker from. Call inside a running actix
/// system.
pub fn start_actors(
    config: &ServeConfig,
    exe: PathBuf,
    book: SessionBook,
    writer: WalWriter,
    render: Arc<dyn Render>,
    gate: Option<(LoadGate, usize)>,
) -> Shared {
    // Every model but the first loads on first use.
    let lazy = gate.as_ref().is_some_and(|(_, slot)| *slot > 0);
    let load = gate.clone();
    let wal = WalActor::new(writer).start();
    let w = &config.worker;
    let rpc = crate::actors::lane::rpc_status(&config.placement.servers);
    let (scheduler, lane, lane_addr) = start_lane(
        LaneConfig {
            model: config.model.clone(),
            worker: w.clone(),
            exe,
            cache_ram_mb: config.cache_ram_mb,
            park: config
                .park_budget_bytes
                .map(|bytes| (park_dir(&config.sessions), bytes)),
            park_lossy: config.park_lossy,
            kv_bits: config.kv_bits,
            mmap: config.mmap,
            vocabulary: render
                .vocab_digest()
                .map(|digest| (render.n_vocab(), digest)),
            step_timeout: config.step_timeout,
            load_timeout: config.load_timeout,
            gate,
            lazy,
            placement: config.placement.clone(),
            rpc_status: rpc.clone(),
            vision: config.mmproj.clone().map(|p| {
                (
                    p,
                    crate::media::MediaStore::new(&config.sessions)
                        .dir()
                        .to_path_buf(),
                )
            }),
        },
        SchedulerState::new(w.n_ctx, w.n_seq, w.n_batch)
            .with_pin_budget_pct(config.pin_budget_pct)
            .with_spill(SpillIndex::new(config.cache_ram_mb.saturating_mul(1 << 20)))
            .with_idle_spill_ms(config.idle_spill_ms)
            .with_turn_warm_ms(config.turn_warm_ms)
            .with_park_if(config.park_budget_bytes.map(|_| {
                scan_parked(
                    &park_dir(&config.sessions),
                    &config.model,
                    kv_type(config.kv_bits),
                    |s| book.is_live(s),
                )
            }))
            .with_n_vocab(render.n_vocab())
            .with_turn_opening(crate::session::turn_opening(render.as_ref())),
    );
    Shared {
        book: Arc::new(RwLock::new(book)),
        render,
        wal,
        scheduler,
        lane,
        rpc,
        n_ctx: w.n_ctx,
        bus: crate::actors::bus::Bus::new(config.sub_buffer),
        generations: Arc::default(),
        media: crate::media::MediaStore::new(&config.sessions),
        vision: config.mmproj.as_ref().map(|_| lane_addr),
        park_dir: config.park_budget_bytes.map(|_| park_dir(&config.sessions)),
        load,
    }
}

async fn run(
    config: ServeConfig,
    listener: std::os::unix::net::UnixListener,
    web_listener: Option<std::net::TcpListener>,
    models: Vec<Loaded>,
) -> Result<(), DaemonError> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let exe = std::env::current_exe()?;
    let gate = LoadGate::new(GateState {
        entries: models
            .iter()
            .enumerate()
            .map(|(i, m)| GateEntry {
                id: m.id.clone(),
                need: model_need(&m.config.model, &config.worker),
                loaded: false,
                pinned: i == 0,
                active: false,
                last_used_ms: now_ms(),
                keep_alive_ms: if i == 0 { None } else { config.keep_alive_ms },
            })
            .collect(),
        max_loaded: config.max_loaded_models.max(1),
        limit: config.memory_limit_mb.map(|mb| mb.saturating_mul(1 << 20)),
    });
    // The web token and the files beside it first: a start that cannot
    // write them fails before any Boot is committed or "serving" printed.
    let web_prepared = match &web_listener {
        Some(l) => Some(crate::http::prepare(l, &config.sessions)?),
        None => None,
    };
    let mut served = Vec::new();
    let mut infos = Vec::new();
    for (slot, m) in models.into_iter().enumerate() {
        let shared = start_actors(
            &m.config,
            exe.clone(),
            m.book,
            m.writer,
            m.render,
            Some((gate.clone(), slot)),
        );
        let boot = shared.read().plan_boot(now_ms());
        shared.commit(boot).await.map_err(DaemonError::Boot)?;
        let registry = Registry::new(shared.clone()).start();
        println!(
            "superfluid: serving {} on {} (sessions in {}, epoch {}){}",
            m.config.model.display(),
            config.socket.display(),
            m.config.sessions.display(),
            shared.read().epoch(),
            if slot == 0 {
                String::new()
            } else {
                format!(" as model {:?}, loaded on first use", m.id)
            }
        );
        infos.push(ModelInfo::from_path(&m.config.model, now_ms() / 1000));
        served.push(ServedModel {
            id: m.id,
            file: m.config.model.clone(),
            shared,
            registry,
        });
    }
    let served = Served::new(served);
    let web = match web_listener.zip(web_prepared) {
        Some((l, prepared)) => {
            let web_config = config.web.clone().unwrap_or_else(|| WebConfig {
                addr: l
                    .local_addr()
                    .unwrap_or_else(|_| ([127, 0, 0, 1], 0).into()),
                origins: Vec::new(),
                api_key: None,
                max_connections: config.max_connections,
            });
            let ids = served.ids();
            let web = crate::http::start(l, prepared, &web_config, served.clone(), infos)?;
            let key = if web_config.api_key.is_some() {
                format!("--api-key, or the token in {}", web.token_path.display())
            } else {
                format!("the token in {}", web.token_path.display())
            };
            println!(
                "superfluid: browser transport listening on http://{} (token in {})",
                web.addr,
                web.token_path.display()
            );
            println!("superfluid: open the page at {}", web.page_url);
            println!(
                "superfluid: OpenAI API at http://{addr}/v1 , Anthropic API at http://{addr} , \
                 Ollama API at http://{addr} , Prometheus metrics at http://{addr}/metrics \
                 (model{} {}; key: {key})",
                if ids.len() > 1 { "s" } else { "" },
                ids.iter()
                    .map(|id| format!("{id:?}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                addr = web.addr,
            );
            Some(web)
        }
        None => None,
    };
    let socket_task = actix_rt::spawn(crate::frontend::socket::serve(
        listener,
        served.clone(),
        config.max_connections,
    ));
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
    log::info!("shutting down");
    let mut open_subs = 0;
    for m in served.all() {
        open_subs += m.shared.bus.close();
    }
    if open_subs > 0 {
        // Let the subscriptions' `SubEnded { "publisher closed" }` go out.
        tokio::time::sleep(std::time::Duration::from_millis(SUB_END_FLUSH_MS)).await;
    }
    if let Some(web) = &web {
        web.handle.stop(false).await;
    }
    socket_task.abort();
    for m in served.all() {
        let _ = m.shared.wal.send(Shutdown).await;
    }
    System::current().stop();
    Ok(())
}
