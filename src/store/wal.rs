//! `wal.log`: the byte format, open + replay (crash recovery), and the
//! group-commit writer thread. The format is described in
//! `docs/wal-format.md`; the summary:
//!
//! ```text
//! file   := header record*
//! header := magic b"SFWAL\r\n\x1a" | version u32 LE (= 1) | flags u32 LE (= 0)
//! record := len u32 LE | len_crc u32 LE = crc32c(len LE bytes) | crc u32 LE = crc32c(payload) | payload[len]
//! ```
//!
//! Everything here is blocking file I/O. [`open`] runs once at startup (call it
//! from a blocking context); after that the only blocking happens on the
//! `wal-writer` thread, and [`WalWriter::append`] never blocks its caller.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::oneshot;

/// The log's file name inside the sessions directory.
pub const WAL_FILE: &str = "wal.log";
/// Where `OpenMode::Cache` moves an existing log before starting a fresh one.
pub const WAL_PREV_FILE: &str = "wal.log.prev";
/// Scratch name used while creating a fresh log (renamed over `wal.log`).
const WAL_TMP_FILE: &str = "wal.log.tmp";
/// First 8 bytes of every log (PNG-style: catches text-mode and truncation mangling).
pub const WAL_MAGIC: [u8; 8] = *b"SFWAL\r\n\x1a";
/// The only format version this build reads and writes.
pub const WAL_FORMAT_VERSION: u32 = 1;
/// Length of the file header: magic, version, flags.
pub const FILE_HEADER_LEN: u64 = 16;
/// Length of a record header: len, len_crc, crc.
pub const RECORD_HEADER_LEN: usize = 12;
/// Largest payload a record may carry; checked before any allocation.
pub const MAX_RECORD_BYTES: usize = 64 << 20;

/// The writer stops pulling more queued records into a group past this size.
const GROUP_MAX_BYTES: usize = 8 << 20;
/// Read size while replaying.
const SCAN_BUF_BYTES: usize = 1 << 20;

/// Errors of the store module.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("I/O error on {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{} is not a readable superfluid WAL: {found}", .path.display())]
    BadHeader { path: PathBuf, found: String },
    #[error(
        "wal.log is corrupt at byte offset {offset} ({reason}); refusing to start rather than guess. \
         Move {} aside, or start with --sessions-cache to keep it as wal.log.prev and begin a fresh log",
        .path.display()
    )]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error("record of {len} bytes exceeds the WAL record cap of 64 MiB")]
    RecordTooLarge { len: usize },
    #[error(
        "sessions directory {} is in use by another superfluid daemon (pid {holder}); stop it or pass a different --sessions",
        .dir.display()
    )]
    Locked { dir: PathBuf, holder: String },
    /// The writer thread hit an I/O error earlier (or is gone): every later append fails.
    #[error("the WAL writer failed and accepts no more records: {0}")]
    WriterFailed(String),
    /// The replay callback rejected the record at `offset`.
    #[error("replaying the WAL record at byte offset {offset} failed: {message}")]
    Replay { offset: u64, message: String },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// How to treat an existing log at open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Replay the existing log; refuse to start on corruption.
    Durable,
    /// `--sessions-cache`: move an existing `wal.log` to `wal.log.prev`
    /// (replacing an older one) and start a fresh, empty log.
    Cache,
}

/// What [`open`] found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recovery {
    /// Records replayed.
    pub records: u64,
    /// Bytes of the file (header included) that hold valid records; the log's end.
    pub valid_bytes: u64,
    /// Offset the file was truncated to, if a torn tail was dropped.
    pub truncated_at: Option<u64>,
    /// Bytes dropped with the torn tail.
    pub dropped_bytes: u64,
    /// `OpenMode::Cache` moved an existing log to `wal.log.prev`.
    pub prev_kept: bool,
}

/// An open, recovered log positioned at its end. Hand it to [`WalWriter::spawn`].
#[derive(Debug)]
pub struct WalFile {
    file: File,
    path: PathBuf,
    end: u64,
}

impl WalFile {
    /// Path of the log file.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Byte offset where the next record will be written.
    pub fn end(&self) -> u64 {
        self.end
    }
}

/// Appends the encoding of one record (header + payload) to `out`.
pub fn encode_record(payload: &[u8], out: &mut Vec<u8>) -> Result<(), StoreError> {
    if payload.len() > MAX_RECORD_BYTES {
        return Err(StoreError::RecordTooLarge { len: payload.len() });
    }
    let len = (payload.len() as u32).to_le_bytes();
    out.reserve(RECORD_HEADER_LEN + payload.len());
    out.extend_from_slice(&len);
    out.extend_from_slice(&crc32c::crc32c(&len).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    out.extend_from_slice(payload);
    Ok(())
}

fn file_header() -> [u8; FILE_HEADER_LEN as usize] {
    let mut h = [0u8; FILE_HEADER_LEN as usize];
    h[..8].copy_from_slice(&WAL_MAGIC);
    h[8..12].copy_from_slice(&WAL_FORMAT_VERSION.to_le_bytes());
    // flags (bytes 12..16) stay zero
    h
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

/// Creates `<dir>/wal.log` holding only the header, atomically: header into
/// `wal.log.tmp`, fsync, rename over `wal.log`, fsync the directory.
fn create_fresh(dir: &Path, path: &Path) -> Result<(), StoreError> {
    let tmp = dir.join(WAL_TMP_FILE);
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io_err(&tmp))?;
    f.write_all_at(&file_header(), 0).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    drop(f);
    fs::rename(&tmp, path).map_err(io_err(path))?;
    sync_dir(dir)
}

fn check_header(file: &File, path: &Path, file_len: u64) -> Result<(), StoreError> {
    let bad = |found: String| StoreError::BadHeader {
        path: path.to_path_buf(),
        found,
    };
    if file_len < FILE_HEADER_LEN {
        return Err(bad(format!(
            "the file is {file_len} bytes, shorter than the {FILE_HEADER_LEN}-byte header"
        )));
    }
    let mut h = [0u8; FILE_HEADER_LEN as usize];
    file.read_exact_at(&mut h, 0).map_err(io_err(path))?;
    if h[..8] != WAL_MAGIC {
        return Err(bad(format!(
            "bad magic b\"{}\" (expected b\"{}\")",
            h[..8].escape_ascii(),
            WAL_MAGIC.escape_ascii()
        )));
    }
    let version = u32_at(&h, 8);
    if version != WAL_FORMAT_VERSION {
        return Err(bad(format!(
            "unsupported format version {version} (this build reads version {WAL_FORMAT_VERSION})"
        )));
    }
    let flags = u32_at(&h, 12);
    if flags != 0 {
        return Err(bad(format!("unknown header flags {flags:#010x}")));
    }
    Ok(())
}

/// True when every byte of the file from `from` to `file_len` is zero.
fn zero_from(file: &File, from: u64, file_len: u64) -> io::Result<bool> {
    let mut buf = vec![0u8; SCAN_BUF_BYTES.min((file_len - from) as usize)];
    let mut pos = from;
    while pos < file_len {
        let n = buf.len().min((file_len - pos) as usize);
        file.read_exact_at(&mut buf[..n], pos)?;
        if buf[..n].iter().any(|&b| b != 0) {
            return Ok(false);
        }
        pos += n as u64;
    }
    Ok(true)
}

/// Sequential reader over `[FILE_HEADER_LEN, file_len)` that hands out
/// borrowed slices, so replay copies each byte once (kernel -> buffer).
struct Scanner<'a> {
    file: &'a File,
    file_len: u64,
    buf: Vec<u8>,
    /// `buf[lo..hi]` holds the file bytes at `[pos, pos + hi - lo)`.
    lo: usize,
    hi: usize,
    /// File offset of `buf[hi]`.
    read_pos: u64,
}

impl Scanner<'_> {
    /// Makes at least `n` bytes available at `buf[lo..]`. The caller has
    /// checked that the file holds them, so `n` is bounded by the file size.
    fn fill(&mut self, n: usize) -> io::Result<()> {
        if self.hi - self.lo >= n {
            return Ok(());
        }
        self.buf.copy_within(self.lo..self.hi, 0);
        self.hi -= self.lo;
        self.lo = 0;
        if self.buf.len() < n {
            self.buf.resize(n, 0);
        }
        while self.hi < n {
            let want = (self.buf.len() - self.hi).min((self.file_len - self.read_pos) as usize);
            let got = self
                .file
                .read_at(&mut self.buf[self.hi..self.hi + want], self.read_pos)?;
            if got == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "wal.log shrank while it was being replayed",
                ));
            }
            self.hi += got;
            self.read_pos += got as u64;
        }
        Ok(())
    }
}

enum ScanEnd {
    Clean,
    Torn,
}

/// Replays records from the header to the first torn or corrupt record.
/// Returns how it ended, the number of records, and the end of the last valid record.
#[allow(clippy::type_complexity)]
fn scan(
    file: &File,
    path: &Path,
    file_len: u64,
    on_record: &mut dyn FnMut(u64, &[u8]) -> Result<(), String>,
) -> Result<(ScanEnd, u64, u64), StoreError> {
    let mut s = Scanner {
        file,
        file_len,
        buf: vec![0u8; SCAN_BUF_BYTES.min((file_len - FILE_HEADER_LEN) as usize)],
        lo: 0,
        hi: 0,
        read_pos: FILE_HEADER_LEN,
    };
    let mut pos = FILE_HEADER_LEN;
    let mut records = 0u64;
    // Used once the rest of the file is known not to be all zeros (a
    // crash-extended file, which is a torn tail).
    let corrupt = |pos: u64, reason: String| -> Result<(ScanEnd, u64, u64), StoreError> {
        Err(StoreError::Corrupt {
            path: path.to_path_buf(),
            offset: pos,
            reason,
        })
    };
    loop {
        let remaining = file_len - pos;
        if remaining == 0 {
            return Ok((ScanEnd::Clean, records, pos));
        }
        if remaining < RECORD_HEADER_LEN as u64 {
            return Ok((ScanEnd::Torn, records, pos));
        }
        s.fill(RECORD_HEADER_LEN).map_err(io_err(path))?;
        let h = &s.buf[s.lo..s.lo + RECORD_HEADER_LEN];
        let len = u32_at(h, 0);
        let len_bytes = len.to_le_bytes();
        let len_crc = u32_at(h, 4);
        let crc = u32_at(h, 8);
        let bad_header = if crc32c::crc32c(&len_bytes) != len_crc {
            Some(format!(
                "record length checksum mismatch: len {len}, stored len_crc {len_crc:#010x}"
            ))
        } else if len as usize > MAX_RECORD_BYTES {
            Some(format!(
                "record length {len} exceeds the {MAX_RECORD_BYTES}-byte cap"
            ))
        } else {
            None
        };
        if let Some(reason) = bad_header {
            if zero_from(file, pos, file_len).map_err(io_err(path))? {
                return Ok((ScanEnd::Torn, records, pos));
            }
            return corrupt(pos, reason);
        }
        let total = RECORD_HEADER_LEN as u64 + len as u64;
        if total > remaining {
            return Ok((ScanEnd::Torn, records, pos));
        }
        s.fill(total as usize).map_err(io_err(path))?;
        let payload = &s.buf[s.lo + RECORD_HEADER_LEN..s.lo + total as usize];
        let actual = crc32c::crc32c(payload);
        if actual != crc {
            // The final record's header landed but its payload did not (the
            // file grew, the data blocks stayed zero): a torn tail too.
            let is_final = pos + total == file_len;
            let payload_start = pos + RECORD_HEADER_LEN as u64;
            if is_final && zero_from(file, payload_start, file_len).map_err(io_err(path))? {
                return Ok((ScanEnd::Torn, records, pos));
            }
            return corrupt(
                pos,
                format!("payload checksum mismatch: stored {crc:#010x}, computed {actual:#010x}"),
            );
        }
        on_record(pos, payload).map_err(|message| StoreError::Replay {
            offset: pos,
            message,
        })?;
        s.lo += total as usize;
        pos += total;
        records += 1;
    }
}

/// Opens (or creates) `<dir>/wal.log`, replaying every record through
/// `on_record(offset, payload)`; an `Err` from `on_record` aborts the open
/// with [`StoreError::Replay`].
///
/// A torn tail (a crash mid-append) is truncated away and reported in the
/// returned [`Recovery`]; corruption anywhere is [`StoreError::Corrupt`] and
/// the file is left untouched. Blocking: call it before serving, or from
/// `spawn_blocking`.
#[allow(clippy::type_complexity)] // the signature is the public contract, kept spelled out
pub fn open(
    dir: &Path,
    mode: OpenMode,
    on_record: &mut dyn FnMut(u64, &[u8]) -> Result<(), String>,
) -> Result<(WalFile, Recovery), StoreError> {
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_err(dir))?;
    let path = dir.join(WAL_FILE);
    let mut recovery = Recovery::default();

    if mode == OpenMode::Cache {
        match fs::symlink_metadata(&path) {
            Ok(_) => {
                let prev = dir.join(WAL_PREV_FILE);
                fs::rename(&path, &prev).map_err(io_err(&prev))?;
                sync_dir(dir)?;
                recovery.prev_kept = true;
                log::warn!(
                    "--sessions-cache: moved {} to {} and starting a fresh log",
                    path.display(),
                    prev.display()
                );
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&path)(e)),
        }
    }

    let open_rw = || OpenOptions::new().read(true).write(true).open(&path);
    let file = match open_rw() {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            create_fresh(dir, &path)?;
            open_rw().map_err(io_err(&path))?
        }
        Err(e) => return Err(io_err(&path)(e)),
    };
    let file_len = file.metadata().map_err(io_err(&path))?.len();
    check_header(&file, &path, file_len)?;

    // SAFETY: posix_fadvise only advises the kernel about this open fd; errors are ignored.
    unsafe {
        use std::os::fd::AsRawFd;
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL);
    }

    let (end_kind, records, end) = scan(&file, &path, file_len, on_record)?;
    recovery.records = records;
    recovery.valid_bytes = end;
    match end_kind {
        ScanEnd::Clean => {
            // The previous process may have died with records still only in
            // the page cache; make what we just replayed durable.
            file.sync_data().map_err(io_err(&path))?;
        }
        ScanEnd::Torn => {
            let dropped = file_len - end;
            log::warn!(
                "{}: torn tail at byte offset {end}: dropping {dropped} bytes of an incomplete record",
                path.display()
            );
            file.set_len(end).map_err(io_err(&path))?;
            file.sync_all().map_err(io_err(&path))?;
            recovery.truncated_at = Some(end);
            recovery.dropped_bytes = dropped;
        }
    }
    Ok((WalFile { file, path, end }, recovery))
}

/// Where an appended record landed. `end` is covered by a completed fdatasync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Durable {
    /// Offset of the record's header.
    pub offset: u64,
    /// Offset just past the record.
    pub end: u64,
}

/// Writer counters; `fsyncs < records` shows group commit at work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WalStats {
    /// Records made durable.
    pub records: u64,
    /// fdatasync calls that completed.
    pub fsyncs: u64,
    /// Bytes made durable (record headers included).
    pub bytes: u64,
}

type Reply = oneshot::Sender<Result<Durable, StoreError>>;
/// Test failpoint run on the writer thread before every fdatasync.
pub type BeforeSync = Arc<dyn Fn() + Send + Sync>;

enum Msg {
    Append { payload: Vec<u8>, reply: Reply },
    Shutdown,
}

#[derive(Default)]
struct Shared {
    durable_len: AtomicU64,
    records: AtomicU64,
    fsyncs: AtomicU64,
    bytes: AtomicU64,
}

/// Cheap, cloneable handle to the `wal-writer` thread.
#[derive(Clone)]
pub struct WalWriter {
    tx: mpsc::Sender<Msg>,
    shared: Arc<Shared>,
    thread: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl WalWriter {
    /// Starts the writer thread ("wal-writer"). `before_sync` is a test
    /// failpoint called on the writer thread before every fdatasync.
    pub fn spawn(file: WalFile, before_sync: Option<BeforeSync>) -> std::io::Result<WalWriter> {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        shared.durable_len.store(file.end, Ordering::Release);
        let thread_shared = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name("wal-writer".into())
            .spawn(move || writer_loop(file, rx, &thread_shared, before_sync))?;
        Ok(WalWriter {
            tx,
            shared,
            thread: Arc::new(Mutex::new(Some(handle))),
        })
    }

    /// Queues one record; the receiver resolves only after the fdatasync
    /// covering it returned. Never blocks.
    pub fn append(&self, payload: Vec<u8>) -> oneshot::Receiver<Result<Durable, StoreError>> {
        let (reply, rx) = oneshot::channel();
        if payload.len() > MAX_RECORD_BYTES {
            let _ = reply.send(Err(StoreError::RecordTooLarge { len: payload.len() }));
            return rx;
        }
        if let Err(mpsc::SendError(Msg::Append { reply, .. })) =
            self.tx.send(Msg::Append { payload, reply })
        {
            let _ = reply.send(Err(StoreError::WriterFailed(
                "the wal-writer thread has exited".into(),
            )));
        }
        rx
    }

    /// Length of the log covered by a completed fdatasync.
    pub fn durable_len(&self) -> u64 {
        self.shared.durable_len.load(Ordering::Acquire)
    }

    /// Counters since spawn.
    pub fn stats(&self) -> WalStats {
        WalStats {
            records: self.shared.records.load(Ordering::Relaxed),
            fsyncs: self.shared.fsyncs.load(Ordering::Relaxed),
            bytes: self.shared.bytes.load(Ordering::Relaxed),
        }
    }

    /// Commits everything queued before this call, then stops and joins the
    /// thread. Appends through other clones afterwards fail with `WriterFailed`.
    pub fn shutdown(self) {
        let _ = self.tx.send(Msg::Shutdown);
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(handle) = handle {
            if handle.join().is_err() {
                log::error!("the wal-writer thread panicked");
            }
        }
    }
}

fn writer_loop(
    mut file: WalFile,
    rx: mpsc::Receiver<Msg>,
    shared: &Shared,
    before_sync: Option<BeforeSync>,
) {
    let mut failed: Option<String> = None;
    let mut buf: Vec<u8> = Vec::with_capacity(64 << 10);
    let mut group: Vec<(Reply, Durable)> = Vec::new();
    // Blocks for the first request; returns when every handle is dropped
    // (after draining what they queued) or on Shutdown.
    while let Ok(first) = rx.recv() {
        let mut stop = false;
        let mut next = Some(first);
        while let Some(msg) = next.take() {
            match msg {
                Msg::Shutdown => {
                    stop = true;
                    break;
                }
                Msg::Append { payload, reply } => {
                    if let Some(reason) = &failed {
                        let _ = reply.send(Err(StoreError::WriterFailed(reason.clone())));
                    } else {
                        let offset = file.end + buf.len() as u64;
                        match encode_record(&payload, &mut buf) {
                            Ok(()) => {
                                let end = file.end + buf.len() as u64;
                                group.push((reply, Durable { offset, end }));
                            }
                            Err(e) => {
                                let _ = reply.send(Err(e));
                            }
                        }
                    }
                }
            }
            if buf.len() < GROUP_MAX_BYTES {
                next = rx.try_recv().ok();
            }
        }
        if !group.is_empty() {
            commit(
                &mut file,
                &buf,
                &mut group,
                shared,
                before_sync.as_ref(),
                &mut failed,
            );
        }
        buf.clear();
        if buf.capacity() > 2 * GROUP_MAX_BYTES {
            buf = Vec::with_capacity(64 << 10);
        }
        if stop {
            return;
        }
    }
}

/// The little-endian u32 at `at` in a header the caller has length-checked.
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// `SUPERFLUID_BENCH_NO_FSYNC=1` skips fdatasync: for benchmarks that
/// measure what the fsync costs, never for data anyone keeps.
fn fsync_disabled() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| {
        let off = std::env::var_os("SUPERFLUID_BENCH_NO_FSYNC").is_some_and(|v| v == "1");
        if off {
            log::warn!("SUPERFLUID_BENCH_NO_FSYNC=1: the log is NOT fsynced (benchmarks only)");
        }
        off
    })
}

/// One write, one fdatasync, then every reply in order. On error, the group
/// and every later request get `WriterFailed`: nothing is written past a failure.
fn commit(
    file: &mut WalFile,
    buf: &[u8],
    group: &mut Vec<(Reply, Durable)>,
    shared: &Shared,
    before_sync: Option<&BeforeSync>,
    failed: &mut Option<String>,
) {
    let path = file.path.display();
    let result = file
        .file
        .write_all_at(buf, file.end)
        .map_err(|e| {
            format!(
                "writing {} bytes at offset {} of {path}: {e}",
                buf.len(),
                file.end
            )
        })
        .and_then(|()| {
            if let Some(hook) = before_sync {
                hook();
            }
            if fsync_disabled() {
                return Ok(());
            }
            file.file
                .sync_data()
                .map_err(|e| format!("fdatasync of {path}: {e}"))
        });
    match result {
        Ok(()) => {
            file.end += buf.len() as u64;
            shared.durable_len.store(file.end, Ordering::Release);
            shared
                .records
                .fetch_add(group.len() as u64, Ordering::Relaxed);
            shared.fsyncs.fetch_add(1, Ordering::Relaxed);
            shared.bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
            for (reply, durable) in group.drain(..) {
                let _ = reply.send(Ok(durable));
            }
        }
        Err(reason) => {
            log::error!("WAL writer failed; refusing all further appends: {reason}");
            // The group was refused, so its bytes must not come back on the
            // next start: cut them off again, as far as the disk lets us.
            if file
                .file
                .set_len(file.end)
                .and_then(|()| file.file.sync_data())
                .is_err()
            {
                log::error!(
                    "could not cut the refused records off {path}; a restart may replay them"
                );
            }
            for (reply, _) in group.drain(..) {
                let _ = reply.send(Err(StoreError::WriterFailed(reason.clone())));
            }
            *failed = Some(reason);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;
    use std::time::Duration;

    type Replayed = Vec<(u64, Vec<u8>)>;

    fn open_collect(
        dir: &Path,
        mode: OpenMode,
    ) -> Result<(WalFile, Recovery, Replayed), StoreError> {
        let mut got = Vec::new();
        let (f, r) = open(dir, mode, &mut |off, p| {
            got.push((off, p.to_vec()));
            Ok(())
        })?;
        Ok((f, r, got))
    }

    /// Appends `payloads` through a fresh writer; returns each record's Durable.
    fn write_all(dir: &Path, payloads: &[Vec<u8>]) -> Vec<Durable> {
        let (f, _, _) = open_collect(dir, OpenMode::Durable).unwrap();
        let w = WalWriter::spawn(f, None).unwrap();
        let rxs: Vec<_> = payloads.iter().map(|p| w.append(p.clone())).collect();
        let out = rxs
            .into_iter()
            .map(|rx| rx.blocking_recv().unwrap().unwrap())
            .collect();
        w.shutdown();
        out
    }

    fn payloads(n: usize) -> Vec<Vec<u8>> {
        (0..n)
            .map(|i| format!("record {i} ").repeat(i % 7 + 1).into_bytes())
            .collect()
    }

    fn wal_bytes(dir: &Path) -> Vec<u8> {
        fs::read(dir.join(WAL_FILE)).unwrap()
    }

    #[test]
    fn crc32c_check_value() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn fresh_log_is_just_the_header() {
        let d = tempfile::tempdir().unwrap();
        let (f, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        assert_eq!(f.end(), FILE_HEADER_LEN);
        assert_eq!(
            r,
            Recovery {
                valid_bytes: FILE_HEADER_LEN,
                ..Recovery::default()
            }
        );
        assert!(got.is_empty());
        assert_eq!(wal_bytes(d.path()), file_header());
        assert!(!d.path().join(WAL_TMP_FILE).exists());
    }

    #[test]
    fn round_trip() {
        let d = tempfile::tempdir().unwrap();
        let ps = payloads(200);
        let durables = write_all(d.path(), &ps);
        let (f, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        assert_eq!(r.records, 200);
        assert_eq!(r.truncated_at, None);
        assert_eq!(got.len(), ps.len());
        let mut expect_off = FILE_HEADER_LEN;
        for ((off, p), (want, dur)) in got.iter().zip(ps.iter().zip(&durables)) {
            assert_eq!(p, want);
            assert_eq!(*off, dur.offset);
            assert_eq!(*off, expect_off);
            expect_off += (RECORD_HEADER_LEN + p.len()) as u64;
            assert_eq!(dur.end, expect_off);
        }
        assert_eq!(f.end(), expect_off);
        assert_eq!(r.valid_bytes, expect_off);
    }

    #[test]
    fn appends_after_reopen_continue_the_log() {
        let d = tempfile::tempdir().unwrap();
        write_all(d.path(), &payloads(3));
        let more = write_all(d.path(), &[b"four".to_vec()]);
        let (_, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        assert_eq!(r.records, 4);
        assert_eq!(got[3], (more[0].offset, b"four".to_vec()));
    }

    #[test]
    fn torn_tail_at_every_offset_of_the_last_record() {
        let d = tempfile::tempdir().unwrap();
        let ps = payloads(5);
        let durables = write_all(d.path(), &ps);
        let full = wal_bytes(d.path());
        let last = *durables.last().unwrap();
        assert_eq!(last.end, full.len() as u64);
        for cut in last.offset..last.end {
            fs::write(d.path().join(WAL_FILE), &full[..cut as usize]).unwrap();
            let (f, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
            assert_eq!(r.records, 4, "cut at {cut}");
            assert_eq!(got.iter().map(|g| g.1.clone()).collect::<Vec<_>>(), ps[..4]);
            if cut == last.offset {
                // A clean cut at a record boundary is simply a shorter log.
                assert_eq!(r.truncated_at, None);
            } else {
                assert_eq!(r.truncated_at, Some(last.offset), "cut at {cut}");
                assert_eq!(r.dropped_bytes, cut - last.offset);
            }
            assert_eq!(f.end(), last.offset);
            assert_eq!(
                fs::metadata(d.path().join(WAL_FILE)).unwrap().len(),
                last.offset
            );
            drop(f);
        }
        // The log is usable after recovery.
        let again = write_all(d.path(), &[b"after".to_vec()]);
        assert_eq!(again[0].offset, last.offset);
        let (_, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        assert_eq!(r.records, 5);
        assert_eq!(got[4].1, b"after");
        assert_eq!(r.truncated_at, None);
    }

    #[test]
    fn zero_filled_tail_is_torn() {
        let d = tempfile::tempdir().unwrap();
        let durables = write_all(d.path(), &payloads(3));
        let mut bytes = wal_bytes(d.path());
        bytes.extend_from_slice(&[0u8; 100]);
        fs::write(d.path().join(WAL_FILE), &bytes).unwrap();
        let (f, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        let end = durables[2].end;
        assert_eq!(got.len(), 3);
        assert_eq!(r.truncated_at, Some(end));
        assert_eq!(r.dropped_bytes, 100);
        assert_eq!(f.end(), end);
        assert_eq!(fs::metadata(d.path().join(WAL_FILE)).unwrap().len(), end);
    }

    #[test]
    fn final_record_with_zeroed_payload_is_torn() {
        let d = tempfile::tempdir().unwrap();
        let durables = write_all(d.path(), &payloads(3));
        let mut bytes = wal_bytes(d.path());
        let last = durables[2];
        for b in &mut bytes[(last.offset as usize + RECORD_HEADER_LEN)..] {
            *b = 0;
        }
        fs::write(d.path().join(WAL_FILE), &bytes).unwrap();
        let (f, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(r.truncated_at, Some(last.offset));
        assert_eq!(f.end(), last.offset);
        // The same zeroed payload in a non-final record is corruption.
        let durables = write_all(d.path(), &payloads(2));
        let mut bytes = wal_bytes(d.path());
        let mid = durables[0];
        for b in &mut bytes[(mid.offset as usize + RECORD_HEADER_LEN)..mid.end as usize] {
            *b = 0;
        }
        fs::write(d.path().join(WAL_FILE), &bytes).unwrap();
        assert!(matches!(
            open_collect(d.path(), OpenMode::Durable),
            Err(StoreError::Corrupt { .. })
        ));
    }

    #[test]
    fn garbage_tail_is_corrupt_not_torn() {
        let d = tempfile::tempdir().unwrap();
        let durables = write_all(d.path(), &payloads(2));
        let mut bytes = wal_bytes(d.path());
        bytes.extend_from_slice(&[0xAB; 40]);
        fs::write(d.path().join(WAL_FILE), &bytes).unwrap();
        match open_collect(d.path(), OpenMode::Durable) {
            Err(StoreError::Corrupt { offset, .. }) => assert_eq!(offset, durables[1].end),
            other => panic!("expected Corrupt, got {:?}", other.map(|x| x.1)),
        }
        assert_eq!(wal_bytes(d.path()), bytes);
    }

    #[test]
    fn flipped_bit_in_a_non_final_record_is_corrupt() {
        let d = tempfile::tempdir().unwrap();
        let ps = payloads(4);
        let durables = write_all(d.path(), &ps);
        let good = wal_bytes(d.path());
        let victim = durables[1]; // a non-final record
        let o = victim.offset as usize;
        let plen = ps[1].len();
        // len, len_crc, crc, first / middle / last payload byte
        let sampled = [
            o,
            o + 5,
            o + 10,
            o + 12,
            o + 12 + plen / 2,
            o + 12 + plen - 1,
        ];
        for &byte in &sampled {
            for bit in 0..8 {
                let mut bad = good.clone();
                bad[byte] ^= 1 << bit;
                fs::write(d.path().join(WAL_FILE), &bad).unwrap();
                let mut seen = Vec::new();
                let err = open(d.path(), OpenMode::Durable, &mut |off, _| {
                    seen.push(off);
                    Ok(())
                })
                .expect_err("corruption must fail the open");
                match &err {
                    StoreError::Corrupt { offset, path, .. } => {
                        assert_eq!(*offset, victim.offset, "byte {byte} bit {bit}");
                        assert_eq!(path, &d.path().join(WAL_FILE));
                    }
                    other => panic!("byte {byte} bit {bit}: expected Corrupt, got {other}"),
                }
                let msg = err.to_string();
                assert!(msg.starts_with(&format!(
                    "wal.log is corrupt at byte offset {} (",
                    victim.offset
                )));
                assert!(msg.contains("refusing to start rather than guess"));
                assert!(msg.contains("--sessions-cache"));
                assert_eq!(seen, vec![durables[0].offset]);
                assert_eq!(wal_bytes(d.path()), bad, "the file must be left unchanged");
            }
        }
        // --sessions-cache: keep the corrupt log aside and start fresh.
        let bad = wal_bytes(d.path());
        let (f, r, got) = open_collect(d.path(), OpenMode::Cache).unwrap();
        assert!(r.prev_kept);
        assert_eq!(r.records, 0);
        assert!(got.is_empty());
        assert_eq!(f.end(), FILE_HEADER_LEN);
        assert_eq!(fs::read(d.path().join(WAL_PREV_FILE)).unwrap(), bad);
        assert_eq!(wal_bytes(d.path()), file_header());
    }

    #[test]
    fn cache_mode_without_a_log_just_creates_one() {
        let d = tempfile::tempdir().unwrap();
        let (_, r, _) = open_collect(d.path(), OpenMode::Cache).unwrap();
        assert!(!r.prev_kept);
        assert!(!d.path().join(WAL_PREV_FILE).exists());
    }

    #[test]
    fn bad_magic_and_bad_version_are_clear_errors() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join(WAL_FILE);
        let mut h = file_header();
        h[0] = b'X';
        fs::write(&path, h).unwrap();
        let msg = open_collect(d.path(), OpenMode::Durable)
            .unwrap_err()
            .to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(msg.contains("bad magic b\"XFWAL\\r\\n\\x1a\""), "{msg}");

        let mut h = file_header();
        h[8..12].copy_from_slice(&7u32.to_le_bytes());
        fs::write(&path, h).unwrap();
        let err = open_collect(d.path(), OpenMode::Durable).unwrap_err();
        assert!(matches!(err, StoreError::BadHeader { .. }));
        let msg = err.to_string();
        assert!(msg.contains("unsupported format version 7"), "{msg}");
        assert!(msg.contains(&path.display().to_string()), "{msg}");

        fs::write(&path, b"SFWAL").unwrap();
        let msg = open_collect(d.path(), OpenMode::Durable)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("shorter than the 16-byte header"), "{msg}");
    }

    #[test]
    fn replay_error_aborts_open() {
        let d = tempfile::tempdir().unwrap();
        let durables = write_all(d.path(), &payloads(3));
        let err = open(d.path(), OpenMode::Durable, &mut |off, _| {
            if off == durables[1].offset {
                Err("bad event".into())
            } else {
                Ok(())
            }
        })
        .unwrap_err();
        match err {
            StoreError::Replay { offset, message } => {
                assert_eq!(offset, durables[1].offset);
                assert_eq!(message, "bad event");
            }
            other => panic!("expected Replay, got {other}"),
        }
    }

    #[test]
    fn group_commit_64_threads() {
        let d = tempfile::tempdir().unwrap();
        let (f, _, _) = open_collect(d.path(), OpenMode::Durable).unwrap();
        // A slow fsync (as on a real disk) lets requests pile up behind it.
        let w = WalWriter::spawn(
            f,
            Some(Arc::new(|| std::thread::sleep(Duration::from_millis(2)))),
        )
        .unwrap();
        const THREADS: usize = 64;
        const EACH: usize = 10;
        let barrier = Arc::new(Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let w = w.clone();
                let barrier = Arc::clone(&barrier);
                std::thread::spawn(move || {
                    barrier.wait();
                    let mut out = Vec::new();
                    for i in 0..EACH {
                        let payload = format!("t{t} i{i}").into_bytes();
                        let d = w.append(payload.clone()).blocking_recv().unwrap().unwrap();
                        assert!(w.durable_len() >= d.end);
                        out.push((d, payload));
                    }
                    out
                })
            })
            .collect();
        let mut all: Vec<(Durable, Vec<u8>)> = handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect();
        let stats = w.stats();
        assert_eq!(stats.records, (THREADS * EACH) as u64);
        assert!(stats.fsyncs < stats.records, "no group commit: {stats:?}");
        let durable = w.durable_len();
        w.shutdown();
        all.sort_by_key(|(d, _)| d.offset);
        assert!(all.iter().all(|(d, _)| d.end <= durable));
        let (_, _, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        let want: Vec<_> = all.into_iter().map(|(d, p)| (d.offset, p)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn append_does_not_resolve_before_fdatasync() {
        let d = tempfile::tempdir().unwrap();
        let (f, _, _) = open_collect(d.path(), OpenMode::Durable).unwrap();
        let (entered_tx, entered_rx) = mpsc::channel::<()>();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let entered_tx = Mutex::new(entered_tx);
        let release_rx = Mutex::new(release_rx);
        let hook: BeforeSync = Arc::new(move || {
            let _ = entered_tx.lock().unwrap().send(());
            let _ = release_rx.lock().unwrap().recv();
        });
        let w = WalWriter::spawn(f, Some(hook)).unwrap();
        let before = w.durable_len();
        let mut rx = w.append(b"wait for it".to_vec());
        entered_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(matches!(
            rx.try_recv(),
            Err(oneshot::error::TryRecvError::Empty)
        ));
        assert_eq!(w.durable_len(), before);
        release_tx.send(()).unwrap();
        let durable = rx.blocking_recv().unwrap().unwrap();
        assert_eq!(durable.offset, before);
        assert_eq!(w.durable_len(), durable.end);
        drop(release_tx); // later syncs pass straight through
        w.shutdown();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn append_from_async_with_timeout() {
        let d = tempfile::tempdir().unwrap();
        let (f, _, _) = open_collect(d.path(), OpenMode::Durable).unwrap();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let release_rx = Mutex::new(release_rx);
        let w = WalWriter::spawn(
            f,
            Some(Arc::new(move || {
                let _ = release_rx.lock().unwrap().recv();
            })),
        )
        .unwrap();
        let mut rx = w.append(b"async".to_vec());
        let timed_out = tokio::time::timeout(Duration::from_millis(50), &mut rx).await;
        assert!(
            timed_out.is_err(),
            "resolved before the fdatasync was released"
        );
        drop(release_tx);
        let durable = rx.await.unwrap().unwrap();
        assert_eq!(durable.offset, FILE_HEADER_LEN);
    }

    #[test]
    fn oversized_payload_fails_alone() {
        let d = tempfile::tempdir().unwrap();
        let (f, _, _) = open_collect(d.path(), OpenMode::Durable).unwrap();
        let w = WalWriter::spawn(f, None).unwrap();
        let a = w.append(b"before".to_vec());
        let big = w.append(vec![0u8; MAX_RECORD_BYTES + 1]);
        let b = w.append(b"after".to_vec());
        match big.blocking_recv().unwrap() {
            Err(StoreError::RecordTooLarge { len }) => assert_eq!(len, MAX_RECORD_BYTES + 1),
            other => panic!("expected RecordTooLarge, got {other:?}"),
        }
        a.blocking_recv().unwrap().unwrap();
        b.blocking_recv().unwrap().unwrap();
        w.shutdown();
        let (_, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        assert_eq!(r.records, 2);
        assert_eq!(got[1].1, b"after");
    }

    #[test]
    fn write_error_fails_that_group_and_every_later_append() {
        let d = tempfile::tempdir().unwrap();
        let (f, _, _) = open_collect(d.path(), OpenMode::Durable).unwrap();
        // Swap in a read-only handle so the writer's pwrite fails (EBADF).
        let ro = File::open(f.path()).unwrap();
        let f = WalFile { file: ro, ..f };
        let w = WalWriter::spawn(f, None).unwrap();
        let first = w.append(b"x".to_vec()).blocking_recv().unwrap();
        assert!(
            matches!(first, Err(StoreError::WriterFailed(_))),
            "{first:?}"
        );
        let later = w.append(b"y".to_vec()).blocking_recv().unwrap();
        match later {
            Err(StoreError::WriterFailed(reason)) => {
                assert!(reason.contains("writing"), "{reason}")
            }
            other => panic!("expected WriterFailed, got {other:?}"),
        }
        assert_eq!(w.stats().fsyncs, 0);
        assert_eq!(w.durable_len(), FILE_HEADER_LEN);
        w.shutdown();
        assert_eq!(wal_bytes(d.path()), file_header());
    }

    #[test]
    fn append_after_shutdown_fails_and_drop_drains() {
        let d = tempfile::tempdir().unwrap();
        let (f, _, _) = open_collect(d.path(), OpenMode::Durable).unwrap();
        let w = WalWriter::spawn(f, None).unwrap();
        let other = w.clone();
        let rx = w.append(b"queued".to_vec());
        w.shutdown();
        rx.blocking_recv().unwrap().unwrap();
        let late = other.append(b"late".to_vec()).blocking_recv().unwrap();
        assert!(matches!(late, Err(StoreError::WriterFailed(_))));

        // Dropping every handle: queued records still commit.
        let (f, _, _) = open_collect(d.path(), OpenMode::Durable).unwrap();
        let w = WalWriter::spawn(f, None).unwrap();
        let rx = w.append(b"dropped handle".to_vec());
        drop(w);
        rx.blocking_recv().unwrap().unwrap();
        let (_, _, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        assert_eq!(got.len(), 2);
    }

    /// tests/data/golden-v1.wal was written by an independent encoder (a short
    /// Python script, see docs/wal-format.md); every future version must read it.
    #[test]
    fn golden_v1_file() {
        let golden = fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/golden-v1.wal"
        ))
        .unwrap();
        let want: Vec<(u64, Vec<u8>)> = vec![
            (16, b"hello, superfluid".to_vec()),
            (45, b"".to_vec()),
            (
                57,
                b"{\"session\":\"s1\",\"event\":\"user\",\"text\":\"hi\"}".to_vec(),
            ),
            (112, (0u8..=255).collect()),
        ];
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join(WAL_FILE), &golden).unwrap();
        let (f, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        assert_eq!(got, want);
        assert_eq!(r.truncated_at, None);
        assert_eq!(f.end(), golden.len() as u64);
        // And this build's encoder still produces exactly those bytes.
        let mut enc = file_header().to_vec();
        for (_, p) in &want {
            encode_record(p, &mut enc).unwrap();
        }
        assert_eq!(enc, golden);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]
        #[test]
        fn prop_round_trip(ps in proptest::collection::vec(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600), 0..40)) {
            let d = tempfile::tempdir().unwrap();
            let durables = write_all(d.path(), &ps);
            let (_, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
            proptest::prop_assert_eq!(r.records, ps.len() as u64);
            let want: Vec<_> = durables.iter().map(|d| d.offset).zip(ps.iter().cloned()).collect();
            proptest::prop_assert_eq!(got, want);
        }
    }
}
