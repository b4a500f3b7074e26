//! The test models: the default one and those scripts/make-test-models.py
//! derives from it. Shared by the integration binary and tests/test_models.rs
//! (which includes this file by path).

use std::path::PathBuf;

/// The model the daemon loads: `$SUPERFLUID_TEST_MODEL`, or the path
/// scripts/fetch-model.sh writes.
pub fn model_path() -> PathBuf {
    let path =
        superfluid::engine::default_model_path().expect("HOME or SUPERFLUID_TEST_MODEL is set");
    assert!(
        path.is_file(),
        "the test model {} is missing: run scripts/setup.sh (or set SUPERFLUID_TEST_MODEL)",
        path.display()
    );
    path
}

/// A test model scripts/make-test-models.py derives from the default one
/// (`SmolLM2-135M-tools-think.gguf`, `SmolLM2-135M-fim.gguf`), beside it.
pub fn derived_model(name: &str) -> PathBuf {
    let path = model_path().with_file_name(name);
    assert!(
        path.is_file(),
        "the derived test model {} is missing: run scripts/setup.sh (or scripts/make-test-models.py)",
        path.display()
    );
    path
}
