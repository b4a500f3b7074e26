//! Huge pages for the worker's big buffers.
//!
//! Every decode reads the model's weights whole, and its attention reads the
//! KV cache's rows; on 4 KiB pages a good part of that time goes to TLB
//! misses. Linux gives such memory 2 MiB pages only where it was advised so
//! (`transparent_hugepage/enabled` = `madvise`, the usual default), and
//! llama.cpp allocates its buffers with `malloc`, without advice. So:
//!
//! - the daemon starts each worker with glibc's `glibc.malloc.hugetlb=1`
//!   tunable ([`worker_tunables`]): glibc advises `MADV_HUGEPAGE` on the
//!   memory it maps, and llama.cpp's buffers fault in as 2 MiB pages;
//! - the worker reads the model into memory (a file mapping keeps 4 KiB
//!   pages; `serve --mmap` keeps the mapping);
//! - once the model, its context and any projector are made, [`settle`] advises
//!   `MADV_NOHUGEPAGE` on the stretches of the large mappings that nothing
//!   touched yet. That is llama.cpp's compute buffer, reserved for the
//!   largest graph and used in part: on huge pages each touch would make
//!   2 MiB resident. The weights (read whole) and the KV cache (cleared at
//!   creation) are resident to the last page, so huge pages cost them no
//!   memory.
//!
//! Measured on SmolLM2-135M, 2 threads (docs/benchmarks.md): reading the
//! model instead of mapping it, decode 1.11x; huge pages on top, decode
//! 1.13x and prefill 1.12x more. A kernel without THP, or a C library
//! without the tunable (glibc before 2.35), leaves 4 KiB pages, and the
//! worker runs as before. With `--rpc` llama.cpp maps the file whatever
//! `--mmap` says (`rpc::load` uses its default parameters).

use std::ffi::{OsStr, OsString};

/// The smallest mapping [`settle`] looks at: llama.cpp's buffers are tens or
/// hundreds of MiB; the allocator's arenas and thread stacks are smaller.
pub const MIN_BYTES: u64 = 16 << 20;

/// The kernel's page size.
fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the system.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(n).ok().filter(|n| *n > 0).unwrap_or(4096)
}

/// The tunable that makes glibc advise huge pages on what it maps.
const TUNABLE: &str = "glibc.malloc.hugetlb=1";

/// The worker's `GLIBC_TUNABLES`: `inherited` (the daemon's) with the huge
/// page tunable added, unless it names `glibc.malloc.hugetlb` itself (the
/// user's choice wins).
pub fn worker_tunables(inherited: Option<&OsStr>) -> OsString {
    match inherited.map(OsStr::to_string_lossy) {
        Some(t) if t.contains("glibc.malloc.hugetlb") => t.into_owned().into(),
        Some(t) if !t.is_empty() => format!("{t}:{TUNABLE}").into(),
        _ => TUNABLE.into(),
    }
}

/// The page-aligned stretches of the mapping `[start, end)` none of whose
/// pages (of `page` bytes) is resident (`resident[i]`: page `i`), adjacent
/// ones merged.
pub fn untouched_runs(start: u64, end: u64, page: u64, resident: &[bool]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (i, r) in resident.iter().enumerate() {
        let at = start + i as u64 * page;
        if *r || at >= end {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.1 == at => last.1 = at + page,
            _ => out.push((at, at + page)),
        }
    }
    out
}

/// The process's private anonymous writable mappings of at least
/// [`MIN_BYTES`], from `/proc/self/maps`.
fn large_anonymous() -> Result<Vec<(u64, u64)>, String> {
    use procfs::process::{MMPermissions, MMapPath, Process};
    let me = Process::myself().map_err(|e| e.to_string())?;
    let maps = me.maps().map_err(|e| e.to_string())?;
    let rw = MMPermissions::READ | MMPermissions::WRITE | MMPermissions::PRIVATE;
    Ok(maps
        .into_iter()
        .filter(|m| {
            m.perms.contains(rw)
                && m.inode == 0
                && matches!(m.pathname, MMapPath::Anonymous)
                && m.address.1.saturating_sub(m.address.0) >= MIN_BYTES
        })
        .map(|m| m.address)
        .collect())
}

/// Which pages (of `page` bytes) of `[start, end)` are resident
/// (`mincore`); None when the range is not mapped any more (another thread
/// freed it).
fn residency(start: u64, end: u64, page: u64) -> Option<Vec<bool>> {
    let len = usize::try_from(end - start).ok()?;
    let mut vec = vec![0u8; len.div_ceil(usize::try_from(page).ok()?)];
    // SAFETY: `vec` has one byte per page of the range, as mincore writes;
    // an unmapped range is ENOMEM, not undefined behaviour.
    let rc = unsafe { libc::mincore(start as *mut libc::c_void, len, vec.as_mut_ptr()) };
    (rc == 0).then(|| vec.iter().map(|b| b & 1 == 1).collect())
}

/// What [`settle`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settled {
    /// Bytes kept off huge pages (untouched so far).
    pub kept_small: u64,
    /// The process's bytes on huge pages (`AnonHugePages`).
    pub huge_bytes: u64,
}

/// Advises `MADV_NOHUGEPAGE` on the untouched stretches of the process's
/// large anonymous mappings, and reports the bytes on huge pages. Errors are
/// the kernel's refusals, for the log (the first one; the other stretches
/// are still advised); nothing depends on them.
pub fn settle() -> Result<Settled, String> {
    let mut done = Settled::default();
    let mut first_error = None;
    for (start, end) in large_anonymous()? {
        if let Err(e) = settle_range(start, end, &mut done) {
            first_error.get_or_insert(e);
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    done.huge_bytes = procfs::process::Process::myself()
        .and_then(|p| p.smaps_rollup())
        .ok()
        .and_then(|r| {
            r.memory_map_rollup
                .0
                .first()
                .and_then(|m| m.extension.map.get("AnonHugePages").copied())
        })
        .unwrap_or(0);
    Ok(done)
}

/// [`settle`] for one mapping `[start, end)`.
fn settle_range(start: u64, end: u64, done: &mut Settled) -> Result<(), String> {
    let page = page_size();
    let Some(resident) = residency(start, end, page) else {
        return Ok(());
    };
    for (a, b) in untouched_runs(start, end, page, &resident) {
        let len = usize::try_from(b - a).map_err(|e| e.to_string())?;
        // SAFETY: madvise only reads the range's mappings (an address not
        // mapped any more is ENOMEM, not undefined behaviour), and this
        // advice changes no contents: it only bars huge pages there.
        if unsafe { libc::madvise(a as *mut libc::c_void, len, libc::MADV_NOHUGEPAGE) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(format!("MADV_NOHUGEPAGE on {} KiB: {e}", len >> 10));
        }
        done.kept_small += b - a;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_users_hugetlb_setting_wins_and_others_are_kept() {
        assert_eq!(worker_tunables(None), TUNABLE);
        assert_eq!(worker_tunables(Some(OsStr::new(""))), TUNABLE);
        assert_eq!(
            worker_tunables(Some(OsStr::new("glibc.malloc.arena_max=2"))),
            "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
        );
        assert_eq!(
            worker_tunables(Some(OsStr::new("glibc.malloc.hugetlb=0"))),
            "glibc.malloc.hugetlb=0"
        );
    }

    const PAGE: u64 = 4096;

    #[test]
    fn untouched_stretches_are_page_runs() {
        let start = 1 << 30;
        let resident = [true, false, false, true, false, true, true, false];
        assert_eq!(
            untouched_runs(start, start + 8 * PAGE, PAGE, &resident),
            vec![
                (start + PAGE, start + 3 * PAGE),
                (start + 4 * PAGE, start + 5 * PAGE),
                (start + 7 * PAGE, start + 8 * PAGE)
            ]
        );
        assert!(untouched_runs(start, start + 3 * PAGE, PAGE, &[true; 3]).is_empty());
    }

    /// A 64 MiB mapping advised for huge pages (what glibc does under the
    /// tunable) with its first 24 MiB written: after `settle_range` (what
    /// `settle` does for each large mapping), the written
    /// part is on huge pages with its bytes kept, and touching one byte in
    /// each 2 MiB of the rest makes 4 KiB resident there, not 2 MiB.
    #[test]
    fn settle_keeps_untouched_stretches_on_small_pages() {
        let len = 64usize << 20;
        let written = 24usize << 20;
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        if thp.contains("[never]") || thp.is_empty() {
            eprintln!("this kernel gives no huge pages ({thp:?}): nothing to check");
            return;
        }
        // SAFETY: a fresh private anonymous mapping, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: the mapping just made.
        assert_eq!(unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) }, 0);
        // SAFETY: the first `written` bytes of the mapping.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), written) };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let (start, end) = (p as u64, p as u64 + len as u64);
        let stat = |key: &str| {
            procfs::process::Process::myself()
                .and_then(|me| me.smaps())
                .expect("smaps")
                .into_iter()
                .filter(|m| m.address.0 < end && start < m.address.1)
                .map(|m| m.extension.map.get(key).copied().unwrap_or(0))
                .sum::<u64>()
        };
        let huge_before = stat("AnonHugePages");
        assert!(
            huge_before >= (written as u64) / 2,
            "the advised mapping got {huge_before} bytes of huge pages"
        );
        let mut done = Settled::default();
        settle_range(start, end, &mut done).expect("settle");
        assert!(
            done.kept_small >= (len - written) as u64 - (2 << 20),
            "{done:?}"
        );
        // One byte in each 2 MiB of the untouched rest.
        for off in (written..len).step_by(2 << 20) {
            // SAFETY: inside the mapping.
            unsafe { *p.cast::<u8>().add(off + 4096) = 1 };
        }
        let touches = ((len - written) / (2 << 20)) as u64;
        assert_eq!(
            stat("AnonHugePages"),
            huge_before,
            "the touches took huge pages"
        );
        let rss = stat("Rss");
        assert!(
            rss <= written as u64 + touches * 4096 + (2 << 20),
            "resident {rss}: each touch made more than a page resident"
        );
        // SAFETY: the first `written` bytes were written above.
        let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), written) };
        assert!(bytes.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
        // SAFETY: the mapping was made above and is no longer used.
        unsafe { libc::munmap(p, len) };
    }
}
