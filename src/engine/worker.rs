//! `superfluid worker`: the process that owns llama.cpp, one per model.
//!
//! The daemon's lane spawns it with piped stdin/stdout and talks [`crate::wire::worker`] over
//! them in length-prefixed postcard frames ([`crate::wire::frame`]):
//!
//! 1. The worker loads the model and creates its context ([`WorkerEngine::new`]), then writes
//!    `Ready { config, n_vocab, vocab_digest }` as its first frame (`config` as llama.cpp applied it: `n_ctx`
//!    padded to a multiple of 256, `n_batch` capped at `n_ctx`). If loading fails it writes one
//!    `Err { message }` frame instead and exits with status 1.
//! 2. Then, for each request frame on stdin, exactly one reply frame, in order, flushed at once.
//!    A frame whose body does not decode as a `WorkerRequest` is answered `Err` (the framing is
//!    intact, so the worker carries on); a broken frame (over [`MAX_FRAME_BYTES`], or cut short)
//!    ends the worker with an error.
//! 3. A clean EOF on stdin (between frames) exits with status 0; so does `Shutdown`, after
//!    answering `Done`.
//!
//! **stdout carries only frames.** At start the worker moves the pipe to a private descriptor
//! and points descriptor 1 at stderr, so a stray `print!` (ours or llama.cpp's) lands in the
//! log, never in the frame stream. Logs go through `log` to stderr.
//!
//! **How the lane sees a crash.** If the worker dies (llama.cpp abort, OOM kill, SIGKILL), the
//! kernel closes its end of the pipe: the lane's next read returns EOF, `Ok(None)` from
//! `read_frame` if it died between frames, `FrameError::Truncated` if it died mid-frame; a write
//! to its stdin fails with `BrokenPipe`. Either way the lane reaps the child (`wait` gives the
//! signal), marks the KV lost and respawns; the sessions are rebuilt by prefill from their logs.

use std::io::{BufWriter, Read, Write};

use super::exec::WorkerEngine;
use super::EngineError;
use crate::wire::worker::{WorkerConfig, WorkerRequest, WorkerResponse};
use crate::wire::{
    from_postcard, read_frame_blocking, to_postcard, write_frame_blocking, MAX_FRAME_BYTES,
};

/// What a worker is started with (`superfluid worker`'s flags).
#[derive(Debug, Clone)]
pub struct WorkerSetup {
    pub model: std::path::PathBuf,
    pub config: WorkerConfig,
    /// The cap of its host-memory store of spilled sequences.
    pub spill_cap_bytes: u64,
    /// Seal and restore park artifacts: the directory, its budget in bytes,
    /// lossy.
    pub park: Option<(std::path::PathBuf, u64, bool)>,
    /// The KV cache's type, 16 or 8 bits.
    pub kv_bits: u8,
    /// Map the model file rather than read it.
    pub mmap: bool,
    pub placement: super::rpc::Placement,
    /// Take images: the projector, the media directory.
    pub vision: Option<(std::path::PathBuf, std::path::PathBuf)>,
}

/// Runs the worker on stdin/stdout until `Shutdown` or EOF.
pub fn run(setup: WorkerSetup) -> Result<(), EngineError> {
    let WorkerSetup {
        model,
        config,
        spill_cap_bytes,
        park,
        kv_bits,
        mmap,
        placement,
        vision,
    } = setup;
    let model = model.as_path();
    let placement = &placement;
    let frames = take_stdout().map_err(EngineError::Stdout)?;
    let mut out = BufWriter::new(frames);
    let engine = WorkerEngine::placed(model, &config, kv_bits, mmap, placement)
        .map(|e| e.with_spill_cap(spill_cap_bytes));
    let engine = match (engine, park) {
        (Ok(e), Some((dir, budget, lossy))) => e
            .with_park(dir, model, budget, lossy)
            .map_err(EngineError::Park),
        (e, _) => e,
    };
    let engine = match (engine, vision) {
        (Ok(e), Some((mmproj, media))) => e.with_vision(&mmproj, &media),
        (e, _) => e,
    };
    let mut engine = match engine {
        Ok(engine) => engine,
        Err(e) => {
            let message = chain(&e);
            let _ = send(&mut out, &WorkerResponse::Err { message });
            return Err(e);
        }
    };
    // Every buffer is made (the model, its context, the projector): what
    // none of them touched yet stays off huge pages.
    match super::hugepages::settle() {
        Ok(done) => log::info!(
            "huge pages: {} MiB of the buffers on 2 MiB pages, {} MiB untouched kept off them",
            done.huge_bytes >> 20,
            done.kept_small >> 20
        ),
        Err(e) => log::info!("huge pages: {e}"),
    }
    send(&mut out, &engine.ready())?;
    let stdin = std::io::stdin();
    serve(&mut engine, stdin.lock(), &mut out)
}

/// The request loop: one reply frame per request frame, until `Shutdown` or a clean EOF.
pub fn serve<R: Read, W: Write>(
    engine: &mut WorkerEngine,
    mut input: R,
    mut output: W,
) -> Result<(), EngineError> {
    loop {
        let Some(body) =
            read_frame_blocking(&mut input, MAX_FRAME_BYTES).map_err(EngineError::ReadRequest)?
        else {
            log::info!("worker: stdin closed, exiting");
            return Ok(());
        };
        crate::logging::stage("w_recv", &"-");
        let reply = match from_postcard::<WorkerRequest>(&body) {
            Ok(WorkerRequest::Shutdown) => {
                send(&mut output, &WorkerResponse::Done)?;
                log::info!("worker: shutdown");
                return Ok(());
            }
            Ok(request) => engine.handle(&request),
            Err(e) => WorkerResponse::Err {
                message: e.to_string(),
            },
        };
        crate::logging::stage("w_handled", &"-");
        send(&mut output, &reply)?;
        crate::logging::stage("w_sent", &"-");
    }
}

/// Write one reply frame and flush it.
fn send<W: Write>(out: &mut W, reply: &WorkerResponse) -> Result<(), EngineError> {
    let body = to_postcard(reply)?;
    write_frame_blocking(out, &body).map_err(EngineError::WriteReply)?;
    Ok(())
}

/// An error and its sources, `: `-separated (what the lane logs, and what a
/// request held for a worker that could not start fails with).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(&format!(": {s}"));
        source = s.source();
    }
    out
}

/// Move stdout's pipe to a new close-on-exec descriptor for the frames, and point descriptor 1
/// at stderr, so nothing else can ever write into the frame stream.
fn take_stdout() -> std::io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    std::io::stdout().flush()?;
    // SAFETY: plain descriptor calls; the new descriptor is owned by the File below alone.
    unsafe {
        let fd = libc::fcntl(1, libc::F_DUPFD_CLOEXEC, 3);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::dup2(2, 1) < 0 {
            let err = std::io::Error::last_os_error();
            libc::close(fd);
            return Err(err);
        }
        Ok(std::fs::File::from_raw_fd(fd))
    }
}
