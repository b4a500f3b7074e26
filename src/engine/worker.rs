//! `superfluid worker`: the process that owns llama.cpp (written next).

use std::path::Path;

use crate::wire::worker::WorkerConfig;

/// Runs the worker loop on stdin/stdout until Shutdown or EOF.
pub fn run(_model: &Path, _config: WorkerConfig) -> anyhow::Result<()> {
    anyhow::bail!("the worker is not written yet")
}
