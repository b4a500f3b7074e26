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
//! - [`server`]: the socket frontend and the daemon's start-up.
//!
//! ARCHITECTURE.md has the bird's-eye view and the invariants.

pub mod session;
pub mod wire;
