//! The `wal-writer` thread: appends records with group commit. Requests
//! queue on a channel; the thread writes what has queued in one `pwrite`,
//! runs one fdatasync, and only then answers each request in order. After a
//! failed write or sync it refuses every later append: nothing is written
//! past a failure. [`WalWriter::append`] never blocks its caller.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use super::acked::{AckedHint, ACKED_EVERY, ACKED_IDLE};
use super::format::{
    encode_marker, encode_record, GROUP_MAX_BYTES, MAX_RECORD_BYTES, WAL_FORMAT_V1,
};
use super::recovery::WalFile;
use crate::store::error::{StoreError, WriterFailure};

/// The writer's file I/O: the three calls it makes on the log. The real
/// thing is [`File`]; tests wrap it ([`WalWriter::spawn_with_io`]) to record
/// what was synced or to fail a call (ENOSPC, EIO) at a chosen point. There
/// is no way to select a wrapper from outside the process.
pub trait WalIo: Send {
    /// Writes all of `buf` at `offset`.
    fn write_all_at(&mut self, buf: &[u8], offset: u64) -> std::io::Result<()>;
    /// fdatasync.
    fn sync_data(&mut self) -> std::io::Result<()>;
    /// Truncates (after a failed group, to cut its bytes off again).
    fn set_len(&mut self, len: u64) -> std::io::Result<()>;
}

impl WalIo for File {
    fn write_all_at(&mut self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        FileExt::write_all_at(self, buf, offset)
    }
    fn sync_data(&mut self) -> std::io::Result<()> {
        File::sync_data(self)
    }
    fn set_len(&mut self, len: u64) -> std::io::Result<()> {
        File::set_len(self, len)
    }
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
    /// A write or fdatasync failed: the writer refuses every append since.
    pub failed: bool,
    /// Group commits' write plus fdatasync time.
    pub commit: crate::histogram::Snapshot,
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
    failed: AtomicBool,
    commit: crate::histogram::Histogram,
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
        Self::start(file, before_sync, |f| Box::new(f))
    }

    /// Starts the writer thread with its file I/O wrapped by `wrap` (for
    /// tests: fault injection and power-loss simulation).
    pub fn spawn_with_io(
        file: WalFile,
        wrap: impl FnOnce(File) -> Box<dyn WalIo>,
    ) -> std::io::Result<WalWriter> {
        Self::start(file, None, wrap)
    }

    fn start(
        file: WalFile,
        before_sync: Option<BeforeSync>,
        wrap: impl FnOnce(File) -> Box<dyn WalIo>,
    ) -> std::io::Result<WalWriter> {
        // The acknowledged-end hint (`acked`): only where groups have
        // markers (recovery reads it for version 2) and fsync is real.
        let dir = file.path.parent().map(PathBuf::from).unwrap_or_default();
        let acked = (file.version != WAL_FORMAT_V1 && !fsync_disabled())
            .then(|| AckedHint::open(&dir, &file.file))
            .and_then(|h| {
                h.map_err(|e| log::warn!("cannot keep {}: {e}", super::acked::ACKED_FILE))
                    .ok()
            });
        let log = Log {
            io: wrap(file.file),
            path: file.path,
            end: file.end,
            markers: file.version != WAL_FORMAT_V1,
            acked,
        };
        let file = log;
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
            let _ = reply.send(Err(StoreError::WriterFailed(WriterFailure::Exited)));
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
            failed: self.shared.failed.load(Ordering::Relaxed),
            commit: self.shared.commit.snapshot(),
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

/// The writer thread's view of the log.
struct Log {
    io: Box<dyn WalIo>,
    path: PathBuf,
    /// End of the last committed group (covered by a completed fdatasync).
    end: u64,
    /// Version 2: close each group with a commit marker.
    markers: bool,
    /// The acknowledged-end hint, while it can be written.
    acked: Option<AckedHint>,
}

impl Log {
    /// Records the end of the last committed group in the hint (after a
    /// failed group too: `end` is then still the end of what was
    /// acknowledged). A hint that cannot be written is given up with a
    /// warning.
    fn record_acked(&mut self) {
        if let Some(h) = &mut self.acked {
            if let Err(e) = h.record(self.end) {
                log::warn!("cannot write {}: {e}", super::acked::ACKED_FILE);
                self.acked = None;
            }
        }
    }
}

fn writer_loop(
    mut file: Log,
    rx: mpsc::Receiver<Msg>,
    shared: &Shared,
    before_sync: Option<BeforeSync>,
) {
    let mut failed: Option<WriterFailure> = None;
    let mut buf: Vec<u8> = Vec::with_capacity(64 << 10);
    let mut group: Vec<(Reply, Durable)> = Vec::new();
    // Groups committed since the hint was written, and when it was.
    let mut unrecorded = false;
    let mut recorded_at = std::time::Instant::now();
    // Blocks for the first request; returns when every handle is dropped
    // (after draining what they queued) or on Shutdown. Idle for
    // ACKED_IDLE after a commit, it records the acknowledged end.
    loop {
        let first = if unrecorded {
            match rx.recv_timeout(ACKED_IDLE) {
                Ok(m) => m,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    file.record_acked();
                    (unrecorded, recorded_at) = (false, std::time::Instant::now());
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        } else {
            match rx.recv() {
                Ok(m) => m,
                Err(_) => break,
            }
        };
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
            if file.markers {
                encode_marker(file.end, &mut buf);
            }
            commit(
                &mut file,
                &buf,
                &mut group,
                shared,
                before_sync.as_ref(),
                &mut failed,
            );
            // A burst's first commit starts the busy clock: the hint is
            // written after ACKED_EVERY of commits, not at once after a
            // long idle (which would put an fdatasync before the next
            // append of nearly every request).
            if !unrecorded {
                recorded_at = std::time::Instant::now();
            }
            unrecorded = true;
            if recorded_at.elapsed() >= ACKED_EVERY {
                file.record_acked();
                (unrecorded, recorded_at) = (false, std::time::Instant::now());
            }
        }
        buf.clear();
        if buf.capacity() > 2 * GROUP_MAX_BYTES {
            buf = Vec::with_capacity(64 << 10);
        }
        if stop {
            break;
        }
    }
    if unrecorded {
        file.record_acked();
    }
}

/// `SUPERFLUID_BENCH_NO_FSYNC=1` skips fdatasync: for benchmarks that
/// measure what the fsync costs, never for data anyone keeps. Only in builds
/// with the `bench-no-fsync` feature.
#[cfg(feature = "bench-no-fsync")]
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

/// Every commit is fsynced: no variable turns it off in this build.
#[cfg(not(feature = "bench-no-fsync"))]
fn fsync_disabled() -> bool {
    false
}

/// One write, one fdatasync, then every reply in order. On error, the group
/// and every later request get `WriterFailed`: nothing is written past a failure.
fn commit(
    file: &mut Log,
    buf: &[u8],
    group: &mut Vec<(Reply, Durable)>,
    shared: &Shared,
    before_sync: Option<&BeforeSync>,
    failed: &mut Option<WriterFailure>,
) {
    let started = std::time::Instant::now();
    let result = file
        .io
        .write_all_at(buf, file.end)
        .map_err(|e| WriterFailure::Write {
            len: buf.len(),
            offset: file.end,
            path: file.path.clone(),
            error: Arc::new(e),
        })
        .and_then(|()| {
            if let Some(hook) = before_sync {
                hook();
            }
            if fsync_disabled() {
                return Ok(());
            }
            file.io.sync_data().map_err(|e| WriterFailure::Sync {
                path: file.path.clone(),
                error: Arc::new(e),
            })
        });
    match result {
        Ok(()) => {
            log::debug!(
                "group commit: {} records, {} bytes at offset {}",
                group.len(),
                buf.len(),
                file.end
            );
            file.end += buf.len() as u64;
            shared.durable_len.store(file.end, Ordering::Release);
            shared
                .records
                .fetch_add(group.len() as u64, Ordering::Relaxed);
            shared.fsyncs.fetch_add(1, Ordering::Relaxed);
            shared.bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
            shared.commit.observe(started.elapsed());
            for (reply, durable) in group.drain(..) {
                let _ = reply.send(Ok(durable));
            }
        }
        Err(reason) => {
            log::error!("WAL writer failed; refusing all further appends: {reason}");
            shared.failed.store(true, Ordering::Relaxed);
            // The group was refused, so its bytes must not come back on the
            // next start: cut them off again, as far as the disk lets us.
            let end = file.end;
            if file
                .io
                .set_len(end)
                .and_then(|()| file.io.sync_data())
                .is_err()
            {
                log::error!(
                    "could not cut the refused records off {}; a restart may replay them",
                    file.path.display()
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
    use std::fs::File;
    use std::sync::Barrier;
    use std::time::Duration;

    use super::super::format::{file_header, FILE_HEADER_LEN, MARKER_LEN};
    use super::super::test_util::{open_collect, wal_bytes};
    use super::super::OpenMode;
    use super::*;

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
        // The group's marker follows the record.
        assert_eq!(w.durable_len(), durable.end + MARKER_LEN as u64);
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
        assert!(!w.stats().failed);
        let first = w.append(b"x".to_vec()).blocking_recv().unwrap();
        // The health Metrics reports as superfluid_wal_failed.
        assert!(w.stats().failed);
        assert!(
            matches!(first, Err(StoreError::WriterFailed(_))),
            "{first:?}"
        );
        let later = w.append(b"y".to_vec()).blocking_recv().unwrap();
        match later {
            Err(StoreError::WriterFailed(reason)) => {
                assert!(matches!(reason, WriterFailure::Write { .. }), "{reason}")
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
}
