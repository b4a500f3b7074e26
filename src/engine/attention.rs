//! superfluid's tiled flash attention in llama.cpp's CPU backend (`ggml-patch/`): whether it trims,
//! and the work it did.
//!
//! ggml's tiled kernel computes every (64 query rows x 64 KV cells) pair of a prefill that is not
//! wholly masked in full; in the unified cache (prompts side by side, a shared prefix, cells that
//! start mid-tile) most of such a pair can be masked. The build replaces the kernel with one that
//! computes only the rows and cells (in steps of 16) the mask leaves, bit for bit ggml's result;
//! `SUPERFLUID_FA_TRIM=0` in the worker's environment computes every pair whole again. The two
//! functions below are defined by that replacement: a llama.cpp built without it does not link.

use std::ffi::c_int;

use crate::wire::worker::AttentionWork;

extern "C" {
    fn superfluid_ggml_fa_trim() -> c_int;
    fn superfluid_ggml_fa_stats(full: *mut u64, computed: *mut u64);
}

/// Whether the tiled kernel trims masked rows and cells (`SUPERFLUID_FA_TRIM` unset or not `0`).
pub fn trims() -> bool {
    // SAFETY: reads an environment variable once, behind a C++ static initialiser.
    unsafe { superfluid_ggml_fa_trim() != 0 }
}

/// The tiled kernel's work since the process started (relaxed counters: read between decodes,
/// on the thread that runs them, they are exact).
pub fn work() -> AttentionWork {
    let mut w = AttentionWork::default();
    // SAFETY: the function writes two u64 through valid, exclusive pointers.
    unsafe { superfluid_ggml_fa_stats(&mut w.full, &mut w.computed) };
    w
}
