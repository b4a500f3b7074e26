//! # superfluid
//!
//! A local LLM daemon whose sessions are durable event logs.
//!
//! ## Layout
//! - [`wire`]: every type that crosses a process boundary, and its framing.
//! - [`store`]: the write-ahead log on disk (wal.log) and the directory lock.
//! - [`session`]: sessions as plain data, rebuilt from the log.
//! - [`engine`]: the only code that calls llama.cpp.
//! - [`actors`]: the actix actors: WAL writer, registry, one per session.
//! - [`frontend`]: the unix socket in front of the registry, and the
//!   connection loop it shares with /web/ws.
//! - [`http`]: the browser transport (`--web`): JSON over HTTP and WebSocket.
//! - [`daemon`]: start-up and shutdown of `superfluid serve`.
//!
//! ARCHITECTURE.md has the bird's-eye view and the invariants.

pub mod actors;
pub mod daemon;
pub mod engine;
pub mod frontend;
pub mod http;
pub mod logging;
pub mod scheduler;
pub mod session;
pub mod store;
pub mod wire;
