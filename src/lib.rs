//! # superfluid
//!
//! A local LLM daemon whose sessions are durable event logs.
//!
//! ## Layout
//! - [`wire`]: every type that crosses a process boundary, its framing, and
//!   the small codes (roles, channels, finish reasons...) as types.
//! - [`store`]: the write-ahead log on disk (wal.log) and the directory lock.
//! - [`media`]: image blobs by SHA-256 under `<sessions>/media/`.
//! - [`session`]: sessions as plain data, rebuilt from the log; requests
//!   become typed plans from one read of the book.
//! - [`scheduler`]: which generations run in a lane's next decode step, and
//!   the steps in flight; plain data.
//! - [`engine`]: the only code that calls llama.cpp (the daemon's vocabulary
//!   and chat template, and the worker's `WorkerEngine`).
//! - [`actors`]: the actix actors: the WAL writer, the registry, one per
//!   session, one per subscription, and each lane's scheduler and worker.
//! - [`frontend`]: the unix socket in front of the registry, and the
//!   connection loop it shares with /web/ws.
//! - [`http`]: the browser transport (`--web`): JSON over HTTP and WebSocket.
//! - [`daemon`]: start-up and shutdown of `superfluid serve`.
//! - [`export`]: sessions as jsonl or OTLP traces, redacted (`session export`).
//! - [`logging`]: the runtime-adjustable logger and the worker's log lines.
//!
//! ARCHITECTURE.md has the bird's-eye view and the invariants.

/// `println!` for the command line: a stdout closed under it (piped into
/// `head`) ends the process quietly with exit 0 where `println!` panicked;
/// another write error ends it with the error.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            $crate::logging::stdout_failed(e);
        }
    }};
}

pub mod actors;
pub mod daemon;
pub mod engine;
pub mod export;
pub mod frontend;
pub mod histogram;
pub mod http;
pub mod logging;
pub mod media;
pub mod models;
pub mod scheduler;
pub mod session;
pub mod store;
pub mod wire;
