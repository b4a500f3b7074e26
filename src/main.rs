//! The `superfluid` command: a thin shell over the library.

use std::path::{Path, PathBuf};

use clap::{CommandFactory, Parser, Subcommand};

mod cli_salvage;
use superfluid::daemon::{self, ServeConfig};
use superfluid::models::{hub, ModelRef};

mod cli;

/// A local LLM daemon whose sessions are durable, forkable event logs.
#[derive(Parser)]
#[command(name = "superfluid", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a GGUF model: sessions over the unix socket.
    Serve(Box<Serve>),
    /// Look at and script sessions through a running daemon's socket.
    Session(cli::SessionArgs),
    /// Print the URL of a running daemon's page (`serve --web`), token
    /// included, and open it in a browser when `xdg-open` is installed.
    Open(Open),
    /// Images in a running daemon's media store (<sessions>/media/).
    #[command(subcommand)]
    Media(MediaCommand),
    /// The inference worker the daemon spawns, one per model: it owns
    /// llama.cpp and speaks length-prefixed postcard frames on stdin/stdout.
    #[command(hide = true)]
    Worker(Worker),
    /// Fetch a model by reference (owner/repo:QUANT, owner/repo/FILE.gguf)
    /// into the Hugging Face cache, with progress; print its path.
    Pull {
        /// owner/repo:QUANT, owner/repo/FILE.gguf, or owner/repo.
        reference: String,
    },
    /// List the GGUF models in the Hugging Face cache (reference, file, size, quant).
    Models,
    /// Remove a model (its files and their blobs) from the Hugging Face cache.
    Rm {
        /// owner/repo:QUANT or owner/repo/FILE.gguf, as `models` lists it.
        reference: String,
    },
    /// Cut a damaged wal.log at a byte offset (the one a corruption error
    /// named), keeping the cut bytes in a side file. Refuses while a daemon
    /// holds the sessions directory.
    Salvage(cli_salvage::Salvage),
}

#[derive(clap::Args)]
struct Worker {
    /// Path of the model's GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// KV cells shared by all sequences.
    #[arg(long)]
    ctx_size: u32,
    /// Sequences.
    #[arg(long)]
    parallel: u32,
    /// Largest batch of one decode call.
    #[arg(long)]
    batch: u32,
    /// CPU threads.
    #[arg(long)]
    threads: u32,
    /// Map the model file rather than read it into memory.
    #[arg(long)]
    mmap: bool,
    /// Cap of the host-memory store of spilled sequences, in MiB.
    #[arg(long, default_value_t = 0)]
    cache_ram_mb: u64,
    /// Seal sessions' KV into this directory (`--park`).
    #[arg(long)]
    park_dir: Option<PathBuf>,
    /// The park directory's size bound in bytes (0: unbounded).
    #[arg(long, default_value_t = 0)]
    park_budget_bytes: u64,
    /// Store the park artifacts' KV rows as Q8_0.
    #[arg(long)]
    park_lossy: bool,
    /// The KV cache's type: 16 (f16) or 8 (Q8_0).
    #[arg(long, default_value_t = 16)]
    kv_bits: u8,
    /// RPC servers holding the model's layers.
    #[arg(long, value_parser = rpc_arg)]
    rpc: Option<RpcServers>,
    /// Their weights (and this machine's, last).
    #[arg(long, value_parser = split_arg)]
    tensor_split: Option<Weights>,
    /// The vision projector (images on the input).
    #[arg(long, requires = "media_dir")]
    mmproj: Option<PathBuf>,
    /// The media store images are read from.
    #[arg(long)]
    media_dir: Option<PathBuf>,
}

#[derive(clap::Args)]
struct Serve {
    /// The model: a GGUF file, or a reference (owner/repo:QUANT,
    /// owner/repo/FILE.gguf) fetched from the Hugging Face hub first.
    model: String,
    /// Directory of the session log (wal.log) [default: ~/.superfluid/sessions]
    #[arg(long, value_name = "DIR")]
    sessions: Option<PathBuf>,
    /// Unix socket serving the session API [default: ~/.superfluid/superfluid.sock]
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Treat the log as a cache: keep the previous log as wal.log.prev and
    /// begin a fresh one at every start.
    #[arg(long, conflicts_with = "park")]
    sessions_cache: bool,
    /// Seal a session's KV to <sessions>/park/<session>.park when its
    /// generation ends, and restore it for its next generation (also after
    /// a restart) instead of a prefill.
    #[arg(long)]
    park: bool,
    /// Park with each artifact's KV rows stored as Q8_0 (about half the
    /// size; the restored values differ in their last bits); implies --park.
    /// The live KV cache stays f16.
    #[arg(long, conflicts_with = "sessions_cache")]
    park_lossy: bool,
    /// The KV cache's type: 16 (f16) or 8 (Q8_0: half the memory a cell,
    /// its values rounded to 8 bits). --park-lossy needs 16.
    #[arg(long, value_name = "BITS", default_value_t = 16,
          value_parser = kv_bits_arg)]
    kv_bits: u8,
    /// Size bound of the park directory in GiB (fractions allowed: 0.5),
    /// least recently used artifacts deleted past it; 0 is unbounded.
    #[arg(long, value_name = "GIB", default_value = "20", value_parser = park_budget_arg)]
    park_budget_gb: ParkBudget,
    /// KV cells shared by the lane's sequences.
    #[arg(long, default_value_t = daemon::DEFAULT_CTX_SIZE,
          value_parser = clap::value_parser!(u32).range(64..=1 << 20))]
    ctx_size: u32,
    /// Host memory for KV evicted from the cells (spilled sequences, imported
    /// back when a prompt reuses their prefix), in MiB; 0 turns it off.
    /// [default: 8192, at most half the machine's memory]
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(0..=1 << 24))]
    cache_ram_mb: Option<u64>,
    /// An idle sequence (its generation ended, no pin) leaves the KV cells
    /// for host memory after this many milliseconds, so decodes beside it
    /// attend over fewer cells; its next turn restores it. 0: idle
    /// sequences stay until their cells are needed. Needs --cache-ram-mb.
    #[arg(long, value_name = "MS", default_value_t = daemon::DEFAULT_IDLE_SPILL_MS)]
    idle_spill_ms: u64,
    /// A session's turn that ended with the lane idle this many
    /// milliseconds, and no next turn yet, gets its end of turn and the chat
    /// template's user-turn opening decoded ahead, so its next turn computes
    /// less; a next turn sooner computes them itself.
    #[arg(long, value_name = "MS", default_value_t = superfluid::scheduler::TURN_WARM_DELAY_MS,
          value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    turn_warm_ms: u64,
    /// Sequences decoded together (continuous batching).
    #[arg(long, default_value_t = daemon::DEFAULT_PARALLEL,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    parallel: u32,
    /// The most tokens one decode call takes; prefill is chunked by it.
    #[arg(long, default_value_t = daemon::DEFAULT_BATCH,
          value_parser = clap::value_parser!(u32).range(1..))]
    batch: u32,
    /// Pins together protect at most this share of the KV cells (percent).
    #[arg(long, default_value_t = superfluid::scheduler::DEFAULT_PIN_BUDGET_PCT,
          value_parser = clap::value_parser!(u32).range(0..=100))]
    pin_budget_pct: u32,
    /// CPU threads for decode [default: every core]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
    /// Map the model file into memory (pages shared with other processes
    /// that map it, read on first use) instead of reading it whole at load.
    /// Read weights go on 2 MiB pages where the kernel allows, which decodes
    /// about 13% faster on a CPU; mapped weights stay on 4 KiB pages. With
    /// --rpc the file is mapped either way.
    #[arg(long)]
    mmap: bool,
    /// Serve the browser transport (JSON over HTTP and WebSocket) on this
    /// loopback address, e.g. 127.0.0.1:8455; port 0 picks a free one.
    #[arg(long, value_name = "ADDR")]
    web: Option<std::net::SocketAddr>,
    /// An Origin allowed on /web/ws (and on /web/rpc and /web/stream when a
    /// request sends one), e.g. http://localhost:5173. Repeatable.
    #[arg(long, value_name = "ORIGIN", requires = "web")]
    web_origin: Vec<String>,
    /// A stable key the OpenAI and Anthropic routes and /metrics accept
    /// besides the web token (which changes at every start), as
    /// `Authorization: Bearer KEY` or `x-api-key: KEY`. Prefer the
    /// SUPERFLUID_API_KEY variable or --api-key-file: other users can read
    /// a process's command line.
    #[arg(
        long,
        value_name = "KEY",
        env = "SUPERFLUID_API_KEY",
        hide_env_values = true
    )]
    api_key: Option<String>,
    /// --api-key read from a file (its first line), which must be readable
    /// by its owner only (0600 or 0400).
    /// It wins over SUPERFLUID_API_KEY; with --api-key as well, the start is
    /// refused.
    #[arg(long, value_name = "PATH")]
    api_key_file: Option<PathBuf>,
    /// Events a subscription may have queued towards a slow client before
    /// it is ended as lagged.
    #[arg(long, value_name = "EVENTS", default_value_t = superfluid::actors::bus::SUB_BUFFER_EVENTS)]
    sub_buffer: usize,
    /// How long one worker step (a decode, a KV operation) may run, plus an
    /// allowance per token it carries, before the worker is taken for hung:
    /// it is killed, what it was running fails, and a new one starts.
    #[arg(long, value_name = "SECS", default_value_t = daemon::DEFAULT_STEP_TIMEOUT_SECS,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    step_timeout_secs: u64,
    /// How long a worker loading its model may show no progress (no bytes
    /// read or written, no CPU time) before it is taken for hung (a load
    /// stuck on I/O): it is killed, what waits for it fails, and a new one
    /// starts (a --model settles unloaded: its next request loads it). A slow
    /// load that progresses is never cut.
    #[arg(long, value_name = "SECS", default_value_t = daemon::DEFAULT_LOAD_TIMEOUT_SECS,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    load_timeout_secs: u64,
    /// Connections served at once on the socket, and on the --web listener
    /// (each): one more is refused (the socket answers it an Err; HTTP
    /// waits for a free one).
    #[arg(long, value_name = "N", default_value_t = superfluid::frontend::socket::DEFAULT_MAX_CONNECTIONS as u64,
          value_parser = clap::value_parser!(u64).range(1..=65_536))]
    max_connections: u64,
    /// Another model to serve beside the first (a GGUF file or a
    /// reference, like MODEL); repeatable. Each has its own log under
    /// <sessions>/models/<id>/ (its id: the file name without .gguf), loads
    /// on its first request and unloads after --keep-alive without one.
    /// The HTTP routes pick it by their `model` field; the session API by
    /// `UseModel`.
    #[arg(long = "model", value_name = "MODEL")]
    more_models: Vec<String>,
    /// How long a --model stays loaded with no request: a duration (30s,
    /// 5m, 1h), 0 to unload at once, or -1 to keep it. The first model stays
    /// loaded.
    #[arg(long, value_name = "DURATION", default_value = daemon::DEFAULT_KEEP_ALIVE,
          value_parser = keep_alive_arg, allow_hyphen_values = true)]
    keep_alive: KeepAlive,
    /// Models loaded at once, the first included; loading one more unloads
    /// the least recently used idle one, or is refused.
    #[arg(long, value_name = "N", default_value_t = daemon::DEFAULT_MAX_LOADED_MODELS as u64,
          value_parser = clap::value_parser!(u64).range(1..=64))]
    max_loaded_models: u64,
    /// The memory the loaded models may need together (files, KV caches),
    /// in MiB: a model past it is refused, or idle ones unloaded to make
    /// room [default: the machine's available memory at each load]
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..))]
    memory_limit_mb: Option<u64>,
    /// The first model's layers on ggml RPC servers (llama.cpp's
    /// ggml-rpc-server) on other hosts, as llama-server's --rpc; the
    /// protocol is unauthenticated: private networks only (docs/scale.md).
    #[arg(long, value_name = "HOST:PORT,...", value_parser = rpc_arg)]
    rpc: Option<RpcServers>,
    /// Weights of the --rpc servers' shares of the layers, one per server
    /// [default: by their free memory]; one more weight keeps that share on
    /// this machine's CPU.
    #[arg(long, value_name = "W,...", value_parser = split_arg, requires = "rpc")]
    tensor_split: Option<Weights>,
    /// The first model's vision projector (a GGUF llama.cpp's mtmd loads):
    /// images on its input (AppendImage, image parts on the HTTP routes)
    /// [default: the projector fetched beside a model reference, if any].
    #[arg(long, value_name = "PATH")]
    mmproj: Option<PathBuf>,
}

/// `--rpc`'s servers (one flag value, comma-separated).
#[derive(Debug, Clone)]
struct RpcServers(Vec<String>);

/// `--tensor-split`'s weights (one flag value, comma-separated).
#[derive(Debug, Clone)]
struct Weights(Vec<f32>);

fn rpc_arg(text: &str) -> Result<RpcServers, String> {
    superfluid::engine::rpc::parse_servers(text).map(RpcServers)
}

fn split_arg(text: &str) -> Result<Weights, String> {
    superfluid::engine::rpc::parse_split(text).map(Weights)
}

/// `--keep-alive` in ms; None: for ever.
#[derive(Debug, Clone, Copy)]
struct KeepAlive(Option<u64>);

fn kv_bits_arg(text: &str) -> Result<u8, String> {
    match text {
        "16" => Ok(16),
        "8" => Ok(8),
        other => Err(format!(
            "{other:?}: the KV cache is 16 (f16) or 8 (Q8_0) bits"
        )),
    }
}

/// `--park-budget-gb`, in bytes.
#[derive(Clone, Copy, Debug)]
struct ParkBudget(u64);

fn park_budget_arg(text: &str) -> Result<ParkBudget, String> {
    match text.parse::<f64>() {
        Ok(gb) if gb.is_finite() && (0.0..=1e6).contains(&gb) => {
            // A positive budget is at least a byte (0 means unbounded).
            let bytes = (gb * (1u64 << 30) as f64) as u64;
            Ok(ParkBudget(if gb > 0.0 { bytes.max(1) } else { 0 }))
        }
        _ => Err(format!(
            "{text:?}: the park budget is a number of GiB from 0 (unbounded) to 1000000"
        )),
    }
}

fn keep_alive_arg(text: &str) -> Result<KeepAlive, String> {
    superfluid::actors::load_gate::parse_keep_alive(text).map(KeepAlive)
}

#[derive(clap::Args)]
struct Open {
    /// The daemon's sessions directory, which holds web-token and web-addr
    /// [default: ~/.superfluid/sessions]
    #[arg(long, value_name = "DIR")]
    sessions: Option<PathBuf>,
    /// Only print the URL.
    #[arg(long)]
    no_browser: bool,
}

#[derive(Subcommand)]
enum MediaCommand {
    /// Store image files (PNG, JPEG, WebP, GIF) and print each one's hash,
    /// the `blob` that AppendImage takes.
    ///
    /// Example: superfluid media put photo.png
    Put {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// One JSON object a file.
        #[arg(long)]
        json: bool,
        /// The daemon's socket [default: ~/.superfluid/superfluid.sock]
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
    },
    /// List the stored blobs: hash, size, type.
    Ls {
        #[arg(long)]
        json: bool,
        /// The sessions directory [default: ~/.superfluid/sessions]
        #[arg(long, value_name = "DIR")]
        sessions: Option<PathBuf>,
    },
    /// Remove the blobs no live session references (a blob put within the
    /// last hour is kept); prints what was kept and removed.
    Gc {
        #[arg(long)]
        json: bool,
        /// The daemon's socket [default: ~/.superfluid/superfluid.sock]
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
    },
}

/// jemalloc, not glibc's malloc: under the soak's churn (the 10-minute run of
/// issue 15) glibc's arenas kept freed memory and the daemon's RSS grew
/// 13.4 MiB with a flat live heap; with jemalloc 7.4 and 8.0 MiB (two runs).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    // Not Cli::parse: its help and errors print with print!, which panics
    // on a closed stdout (`superfluid --help | head -1`).
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let e = without_hidden_suggestion(e);
            let _ = e.print();
            std::process::exit(e.exit_code());
        }
    };
    if matches!(cli.command, Command::Worker(_)) {
        superfluid::logging::init_worker();
    } else {
        superfluid::logging::init();
    }
    if let Err(e) = run(cli) {
        eprintln!("superfluid: {}", error_chain(&e));
        std::process::exit(1);
    }
}

/// A mistyped subcommand's error without clap's tip when the tip is the
/// hidden `worker` (`superfluid work` suggested it: it is the daemon's, not
/// a user's, and run by hand it waits for frames on stdin).
fn without_hidden_suggestion(e: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let hidden = |v: &ContextValue| match v {
        ContextValue::String(s) => s == "worker",
        ContextValue::Strings(s) => s.iter().any(|s| s == "worker"),
        _ => false,
    };
    if e.kind() != ErrorKind::InvalidSubcommand
        || !e.get(ContextKind::SuggestedSubcommand).is_some_and(hidden)
    {
        return e;
    }
    let mut plain = clap::Error::new(ErrorKind::InvalidSubcommand).with_cmd(&Cli::command());
    for kind in [ContextKind::InvalidSubcommand, ContextKind::Usage] {
        if let Some(v) = e.get(kind) {
            plain.insert(kind, v.clone());
        }
    }
    plain
}

/// An error and its causes, `: `-joined, leaving out a cause whose text the
/// message before it already holds (our errors often name their source:
/// "cannot listen: Address already in use" came out twice).
fn error_chain(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    out
}

/// Whether `--api-key` was given as an argument (not through its variable).
fn key_on_command_line() -> bool {
    std::env::args().any(|a| a == "--api-key" || a.starts_with("--api-key="))
}

/// The key in `path`'s first line, once the file is found to be its
/// owner's only.
fn read_key_file(path: &Path) -> anyhow::Result<String> {
    use std::os::unix::fs::PermissionsExt;
    let what = |e: std::io::Error| anyhow::anyhow!("--api-key-file {}: {e}", path.display());
    let mode = std::fs::metadata(path).map_err(what)?.permissions().mode();
    if mode & 0o077 != 0 {
        anyhow::bail!(
            "--api-key-file {}: readable by others (mode {:o}); make it 0600",
            path.display(),
            mode & 0o777
        );
    }
    let text = std::fs::read_to_string(path).map_err(what)?;
    let key = text.lines().next().unwrap_or("").trim().to_owned();
    if key.is_empty() {
        anyhow::bail!(
            "--api-key-file {}: no key on its first line",
            path.display()
        );
    }
    Ok(key)
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(s) if s.park_lossy && s.kv_bits == 8 => anyhow::bail!(
            "--park-lossy stores an f16 cache's rows as Q8_0 (the spec: it implies --kv-bits \
             16); it cannot be combined with --kv-bits 8"
        ),
        Command::Serve(s) => {
            let s = *s;
            let (model, fetched) = resolve_model(&s.model)?;
            let more: Vec<(PathBuf, Option<PathBuf>)> = s
                .more_models
                .iter()
                .map(|m| resolve_model(m))
                .collect::<anyhow::Result<_>>()?;
            if let Some(p) = s.mmproj.as_ref().filter(|p| !p.is_file()) {
                anyhow::bail!("--mmproj {}: no such file", p.display());
            }
            // Checked here, not in the worker: a worker that cannot start
            // is started again and again while the daemon serves nothing.
            if let Some(p) = s.mmproj.as_ref() {
                daemon::check_projector(p).map_err(|e| anyhow::anyhow!("--mmproj {e}"))?;
            }
            let seqs = s.parallel + u32::from(s.parallel < 256);
            if s.batch.min(s.ctx_size) < seqs {
                anyhow::bail!(
                    "--batch {} (capped at --ctx-size {}) must be at least --parallel {} + 1: \
                     each sequence takes an output row of a batch, and one is kept spare",
                    s.batch,
                    s.ctx_size,
                    s.parallel
                );
            }
            let api_key = match &s.api_key_file {
                Some(_) if key_on_command_line() => {
                    anyhow::bail!("--api-key and --api-key-file: give one of the two")
                }
                Some(path) => Some(read_key_file(path)?),
                None => s.api_key,
            };
            if api_key.is_some() && key_on_command_line() {
                log::warn!(
                    "--api-key on the command line can be read by other users (ps, \
                     /proc/PID/cmdline); prefer SUPERFLUID_API_KEY or --api-key-file"
                );
            }
            daemon::serve(ServeConfig {
                model,
                mmproj: s.mmproj.or(fetched),
                more_mmproj: more.iter().map(|m| m.1.clone()).collect(),
                sessions: s.sessions.unwrap_or_else(daemon::default_sessions_dir),
                socket: s.socket.unwrap_or_else(daemon::default_socket),
                sessions_cache: s.sessions_cache,
                pin_budget_pct: s.pin_budget_pct,
                worker: superfluid::wire::worker::WorkerConfig {
                    n_ctx: s.ctx_size,
                    n_seq: s.parallel,
                    n_batch: s.batch.min(s.ctx_size),
                    threads: s.threads.unwrap_or_else(daemon::default_threads),
                },
                web: s.web.map(|addr| superfluid::http::WebConfig {
                    addr,
                    origins: s.web_origin,
                    api_key,
                    max_connections: s.max_connections as usize,
                }),
                sub_buffer: s.sub_buffer,
                cache_ram_mb: s.cache_ram_mb.unwrap_or_else(daemon::default_cache_ram_mb),
                idle_spill_ms: s.idle_spill_ms,
                turn_warm_ms: s.turn_warm_ms,
                park_budget_bytes: (s.park || s.park_lossy).then_some(s.park_budget_gb.0),
                park_lossy: s.park_lossy,
                kv_bits: s.kv_bits,
                mmap: s.mmap,
                step_timeout: std::time::Duration::from_secs(s.step_timeout_secs),
                load_timeout: std::time::Duration::from_secs(s.load_timeout_secs),
                max_connections: s.max_connections as usize,
                more_models: more.into_iter().map(|m| m.0).collect(),
                keep_alive_ms: s.keep_alive.0,
                max_loaded_models: s.max_loaded_models as usize,
                memory_limit_mb: s.memory_limit_mb,
                placement: superfluid::engine::rpc::Placement {
                    servers: s.rpc.map(|r| r.0).unwrap_or_default(),
                    split: s.tensor_split.map(|t| t.0).unwrap_or_default(),
                },
            })
            .map_err(Into::into)
        }
        Command::Worker(w) => {
            superfluid::engine::worker::run(superfluid::engine::worker::WorkerSetup {
                config: superfluid::wire::worker::WorkerConfig {
                    n_ctx: w.ctx_size,
                    n_seq: w.parallel,
                    n_batch: w.batch,
                    threads: w.threads,
                },
                spill_cap_bytes: w.cache_ram_mb.saturating_mul(1 << 20),
                park: w.park_dir.map(|d| (d, w.park_budget_bytes, w.park_lossy)),
                kv_bits: w.kv_bits,
                mmap: w.mmap,
                placement: superfluid::engine::rpc::Placement {
                    servers: w.rpc.map(|r| r.0).unwrap_or_default(),
                    split: w.tensor_split.map(|t| t.0).unwrap_or_default(),
                },
                vision: w.mmproj.zip(w.media_dir),
                model: w.model,
            })
            .map_err(Into::into)
        }
        Command::Media(m) => {
            use superfluid::media::cli as media;
            match m {
                MediaCommand::Put {
                    files,
                    json,
                    socket,
                } => media::put(&socket.unwrap_or_else(daemon::default_socket), &files, json),
                MediaCommand::Ls { json, sessions } => {
                    media::ls(&sessions.unwrap_or_else(daemon::default_sessions_dir), json)
                }
                MediaCommand::Gc { json, socket } => {
                    media::gc(&socket.unwrap_or_else(daemon::default_socket), json)
                }
            }
            .map_err(Into::into)
        }
        Command::Session(args) => cli::run(args),
        Command::Open(o) => open(
            &o.sessions.unwrap_or_else(daemon::default_sessions_dir),
            !o.no_browser,
        ),
        Command::Salvage(s) => cli_salvage::run(s),
        Command::Pull { reference } => {
            let resolved = hub::resolve(&ModelRef::parse(&reference)?)?;
            for f in &resolved.files {
                superfluid::outln!("{}", f.display());
            }
            Ok(())
        }
        Command::Models => {
            let models = hub::list_cached();
            superfluid::outln!("{:<48} {:>10}  {:<10} FILE", "REFERENCE", "SIZE", "QUANT");
            for m in models {
                superfluid::outln!(
                    "{:<48} {:>7.1} MB  {:<10} {}",
                    m.reference,
                    m.bytes as f64 / 1e6,
                    m.quant.as_deref().unwrap_or("-"),
                    m.file
                );
            }
            Ok(())
        }
        Command::Rm { reference } => {
            let removed = hub::remove(&ModelRef::parse(&reference)?)?;
            for p in &removed {
                superfluid::outln!("removed {}", p.display());
            }
            Ok(())
        }
    }
}

/// `serve`'s model: a path as given, a reference fetched (or found in the
/// cache) first.
fn resolve_model(model: &str) -> anyhow::Result<(PathBuf, Option<PathBuf>)> {
    let reference = ModelRef::parse(model)?;
    let resolved = hub::resolve(&reference)?;
    if let ModelRef::Hub { .. } = reference {
        eprintln!("superfluid: {reference} is {}", resolved.model.display());
        if let Some(p) = &resolved.mmproj {
            eprintln!("superfluid: its vision projector is {}", p.display());
        }
    }
    Ok((resolved.model, resolved.mmproj))
}

/// The page `superfluid open` hands the browser, in the sessions directory.
const OPEN_FILE: &str = "open.html";

/// Writes a page that sends the browser on to `url` (which holds the web
/// token), readable by its owner only.
fn write_redirect(path: &Path, url: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    // The URL is the daemon's loopback address, a path and a hex token:
    // nothing in it needs escaping in an attribute or a string.
    writeln!(
        f,
        "<!doctype html><meta charset=\"utf-8\"><title>superfluid</title>\
         <meta http-equiv=\"refresh\" content=\"0;url={url}\">\
         <script>location.replace({url:?})</script>\
         <p><a href=\"{url}\">Open superfluid</a></p>"
    )?;
    f.sync_all()
}

/// `superfluid open`: the page's URL from the files `serve --web` wrote.
fn open(sessions: &std::path::Path, browser: bool) -> anyhow::Result<()> {
    use superfluid::http::{page, token};
    let read = |name: &str| {
        let path = sessions.join(name);
        std::fs::read_to_string(&path)
            .map(|s| s.trim().to_string())
            .map_err(|e| {
                anyhow::anyhow!(
                    "cannot read {}: {e} (is `superfluid serve --web ...` running on these sessions?)",
                    path.display()
                )
            })
    };
    let addr: std::net::SocketAddr = read(token::ADDR_FILE)?
        .parse()
        .map_err(|e| anyhow::anyhow!("{}: {e}", sessions.join(token::ADDR_FILE).display()))?;
    // The token goes in the URL: only to a loopback address, as `--web`
    // listens on no other (a web-addr that names one was not written by it).
    if !addr.ip().is_loopback() {
        anyhow::bail!(
            "{} names {addr}, not a loopback address: `serve --web` listens only on loopback, \
             and the page's URL carries the token, so it is not sent there",
            sessions.join(token::ADDR_FILE).display()
        );
    }
    // The files outlive the daemon that wrote them (a stop, a restart
    // without --web): a URL nobody answers is an error, not the answer.
    if let Err(e) = std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(2)) {
        anyhow::bail!(
            "no daemon answers at {addr} ({e}), the address {} names: is `superfluid serve --web \
             ...` running on these sessions?",
            sessions.join(token::ADDR_FILE).display()
        );
    }
    let url = page::url(addr, &read(token::TOKEN_FILE)?);
    superfluid::outln!("{url}");
    if browser {
        // The browser is given a file of the owner's only that sends it on
        // to the page: the URL holds the token, and a command line
        // (xdg-open's, the browser's) can be read by other users.
        let redirect = sessions.join(OPEN_FILE);
        write_redirect(&redirect, &url)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", redirect.display()))?;
        // Absolute and percent-encoded (a relative --sessions, a `#` or a
        // space in a folder's name).
        let target = std::fs::canonicalize(&redirect)
            .ok()
            .and_then(|p| url::Url::from_file_path(p).ok())
            .ok_or_else(|| anyhow::anyhow!("{}: no file URL", redirect.display()))?
            .to_string();
        // Fire and forget; without xdg-open the printed URL is the answer.
        if let Err(e) = std::process::Command::new("xdg-open")
            .arg(&target)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
        {
            log::debug!("xdg-open: {e}");
        }
    }
    Ok(())
}
