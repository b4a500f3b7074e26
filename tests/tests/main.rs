//! The integration tests: one binary (ripgrep style), one harness
//! (`util::TestDaemon`). They run the real `superfluid` binary on the real
//! model's vocabulary: set SUPERFLUID_TEST_MODEL, or run scripts/fetch-model.sh.

mod bad_input;
mod browser;
mod daemon;
mod generate;
mod models;
mod ordering;
mod util;
mod web;
