//! The integration tests: one binary (ripgrep style), one harness
//! (`util`: `TestDaemon`, the shared daemon, the test models). They run the
//! real `superfluid` binary on the real model's vocabulary: set
//! SUPERFLUID_TEST_MODEL, or run scripts/fetch-model.sh.
//!
//! Modules: `daemon` (the daemon as a process: durability, SIGKILL, torn
//! tails, corruption, locks), `bad_input` (refused requests), `ordering`
//! (no reply before its fsync), `generate` (generation on the real model),
//! `logging` (`RUST_LOG` and `SetLogLevel` directives), `media` (`PutMedia`, `GcMedia`,
//! `superfluid media`), `metrics` (the
//! `Metrics` text, checked by promtool), `web` and `browser`
//! (the HTTP transport), `surface` (the tool-call ledger, `AppendBlock`,
//! archived sessions, SessionBusy, flags refused together), `spec_json` (the
//! wire types against the spec: JSON examples, every variant, postcard
//! goldens), `surface_more` (`Throttled` on the socket, /web/ws and
//! /web/rpc's 429; /web/health open to any Host), `stateless` (`StatelessGen` with sampling
//! extras, in process), `worker` (`superfluid
//! worker` over its pipe), `test_models` (the derived test models' metadata),
//! `storage_faults` (power loss, ENOSPC/EIO, full filesystems, salvage),
//! `fuzz` (the decoders under proptest, seeds in tests/corpus/),
//! `rpc` (`serve --rpc`: the model's layers on two loopback
//! `ggml-rpc-server`s, a lost server), `cli` (the `superfluid session` family against a daemon), `export`
//! (`session export`: jsonl, otlp-jsonl, the OTLP push, redaction; finish 5
//! from a real generation out of context), `soak` (16 generating sessions,
//! 256 subscriptions, appends and forks).

mod bad_input;
mod browser;
mod cli;
mod daemon;
mod export;
mod fuzz;
mod generate;
mod http;
mod hub;
mod isolation;
mod kv_tiers;
mod logging;
mod media;
mod metrics;
mod models;
mod ordering;
mod qos;
mod rpc;
mod soak;
mod spec_json;
mod stateless;
mod storage_faults;
mod surface;
mod surface_more;
mod test_models;
mod util;
mod vision;
mod web;
mod worker;
