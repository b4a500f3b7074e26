//! Opening `wal.log` at start-up: create it if missing, check its header,
//! replay every record, and recover from a crash. A torn tail (a crash
//! mid-append) is truncated away; corruption anywhere else refuses the start
//! and leaves the file as it is. Blocking file I/O, run once before serving.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::format::{
    check_file_header, file_header, FormatError, RecordHeader, FILE_HEADER_LEN, MARKER_LEN,
    MAX_GROUP_SPAN, RECORD_HEADER_LEN, WAL_FILE, WAL_FORMAT_V1, WAL_PREV_FILE, WAL_TMP_FILE,
};
use crate::store::error::{io_err, ReplayError, StoreError};

/// Read size while replaying.
const SCAN_BUF_BYTES: usize = 1 << 20;

/// The replay callback of [`open`]: each record's offset and payload, in
/// order; an `Err` aborts the open.
pub type OnRecord<'a> = dyn FnMut(u64, &[u8]) -> Result<(), ReplayError> + 'a;

/// How to treat an existing log at open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Replay the existing log; refuse to start on corruption.
    Durable,
    /// `--sessions-cache`: move an existing `wal.log` to `wal.log.prev`
    /// (an older one there moved aside to `wal.log.prev.<secs>`) and start
    /// a fresh, empty log.
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
    /// `OpenMode::Cache` moved an existing log aside.
    pub prev_kept: bool,
    /// Where it is now: `wal.log.prev` (an older log found there was moved
    /// to `wal.log.prev.<unix seconds>`).
    pub prev_path: Option<PathBuf>,
    /// The log's format version (1: an old log, appended to without group
    /// markers; 2: every log created by this build).
    pub version: u32,
}

/// An open, recovered log positioned at its end. Hand it to
/// [`WalWriter::spawn`](super::WalWriter::spawn).
#[derive(Debug)]
pub struct WalFile {
    pub(super) file: File,
    pub(super) path: PathBuf,
    pub(super) end: u64,
    /// Format version: the writer adds group markers only to version 2.
    pub(super) version: u32,
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
    /// The log's format version.
    pub fn version(&self) -> u32 {
        self.version
    }
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
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(io_err(&tmp))?;
    f.write_all_at(&file_header(), 0).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    drop(f);
    // A previous log's acknowledged end says nothing of this one.
    super::acked::remove(dir).map_err(io_err(&dir.join(super::acked::ACKED_FILE)))?;
    fs::rename(&tmp, path).map_err(io_err(path))?;
    sync_dir(dir)
}

fn check_header(file: &File, path: &Path, file_len: u64) -> Result<u32, StoreError> {
    let bad = |found: FormatError| StoreError::BadHeader {
        path: path.to_path_buf(),
        found,
    };
    if file_len < FILE_HEADER_LEN {
        return Err(bad(FormatError::ShortFile(file_len)));
    }
    let mut h = [0u8; FILE_HEADER_LEN as usize];
    file.read_exact_at(&mut h, 0).map_err(io_err(path))?;
    check_file_header(&h).map_err(bad)
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
/// Bytes from `keep` on stay in the buffer: a version-2 group is held there
/// until its marker is read.
struct Scanner<'a> {
    file: &'a File,
    file_len: u64,
    buf: Vec<u8>,
    /// `buf[keep..hi]` holds the file bytes at `[keep_pos, keep_pos + hi - keep)`.
    keep: usize,
    keep_pos: u64,
    hi: usize,
    /// File offset of `buf[hi]`.
    read_pos: u64,
}

impl Scanner<'_> {
    fn new(file: &File, file_len: u64) -> Scanner<'_> {
        Scanner {
            file,
            file_len,
            buf: vec![0u8; SCAN_BUF_BYTES.min((file_len - FILE_HEADER_LEN) as usize)],
            keep: 0,
            keep_pos: FILE_HEADER_LEN,
            hi: 0,
            read_pos: FILE_HEADER_LEN,
        }
    }

    /// Index in `buf` of file offset `pos` (which is at or after `keep_pos`).
    fn at(&self, pos: u64) -> usize {
        self.keep + (pos - self.keep_pos) as usize
    }

    /// Keeps nothing before `pos` any more.
    fn release_to(&mut self, pos: u64) {
        self.keep = self.at(pos);
        self.keep_pos = pos;
    }

    /// Makes the `n` bytes at file offset `pos` available at `buf[at(pos)..]`.
    /// The caller has checked that the file holds them, so `n` is bounded by
    /// the file size.
    fn fill(&mut self, pos: u64, n: usize) -> io::Result<()> {
        let need = self.at(pos) + n;
        if self.hi >= need {
            return Ok(());
        }
        self.buf.copy_within(self.keep..self.hi, 0);
        self.hi -= self.keep;
        self.keep = 0;
        let need = self.at(pos) + n;
        if self.buf.len() < need {
            self.buf.resize(need, 0);
        }
        while self.hi < need {
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

    fn slice(&self, pos: u64, n: usize) -> &[u8] {
        let i = self.at(pos);
        &self.buf[i..i + n]
    }
}

enum ScanEnd {
    Clean,
    Torn,
}

/// How a scan ended: its kind, the records replayed, the end of the last
/// valid record (version 1) or committed group (version 2).
type Scanned = (ScanEnd, u64, u64);

/// Replays records from the header to the first torn or corrupt record.
/// `acked`: the end of the log known acknowledged (`wal.acked`, version 2).
fn scan(
    file: &File,
    path: &Path,
    file_len: u64,
    version: u32,
    acked: Option<u64>,
    on_record: &mut OnRecord<'_>,
) -> Result<Scanned, StoreError> {
    if version == WAL_FORMAT_V1 {
        scan_v1(file, path, file_len, on_record)
    } else {
        scan_v2(file, path, file_len, acked, on_record)
    }
}

fn corrupt(path: &Path, offset: u64, cut: u64, reason: FormatError) -> StoreError {
    StoreError::Corrupt {
        path: path.to_path_buf(),
        offset,
        cut,
        reason,
    }
}

/// Version 1: every record stands alone.
fn scan_v1(
    file: &File,
    path: &Path,
    file_len: u64,
    on_record: &mut OnRecord<'_>,
) -> Result<Scanned, StoreError> {
    let mut s = Scanner::new(file, file_len);
    let mut pos = FILE_HEADER_LEN;
    let mut records = 0u64;
    loop {
        let remaining = file_len - pos;
        if remaining == 0 {
            return Ok((ScanEnd::Clean, records, pos));
        }
        if remaining < RECORD_HEADER_LEN as u64 {
            return Ok((ScanEnd::Torn, records, pos));
        }
        s.fill(pos, RECORD_HEADER_LEN).map_err(io_err(path))?;
        let parsed = RecordHeader::parse(s.slice(pos, RECORD_HEADER_LEN)).and_then(|h| {
            if h.marker {
                Err(FormatError::MarkerInV1)
            } else {
                Ok(h)
            }
        });
        let header = match parsed {
            Ok(h) => h,
            Err(reason) => {
                // A file extended by a crash is a torn tail.
                if zero_from(file, pos, file_len).map_err(io_err(path))? {
                    return Ok((ScanEnd::Torn, records, pos));
                }
                return Err(corrupt(path, pos, pos, reason));
            }
        };
        let total = RECORD_HEADER_LEN as u64 + u64::from(header.len);
        if total > remaining {
            return Ok((ScanEnd::Torn, records, pos));
        }
        s.fill(pos, total as usize).map_err(io_err(path))?;
        let payload = s.slice(pos + RECORD_HEADER_LEN as u64, header.len as usize);
        if let Err(reason) = header.check_payload(payload) {
            // The final record's header landed but its payload did not (the
            // file grew, the data blocks stayed zero): a torn tail too.
            let is_final = pos + total == file_len;
            let payload_start = pos + RECORD_HEADER_LEN as u64;
            if is_final && zero_from(file, payload_start, file_len).map_err(io_err(path))? {
                return Ok((ScanEnd::Torn, records, pos));
            }
            return Err(corrupt(path, pos, pos, reason));
        }
        on_record(pos, payload).map_err(|cause| StoreError::Replay { offset: pos, cause })?;
        pos += total;
        s.release_to(pos);
        records += 1;
    }
}

/// Version 2: records come in groups, each closed by a commit marker. A
/// group's records are replayed only once its marker is read; a group that
/// did not fully land (the last one, when the power went during its write)
/// is a torn tail.
fn scan_v2(
    file: &File,
    path: &Path,
    file_len: u64,
    acked: Option<u64>,
    on_record: &mut OnRecord<'_>,
) -> Result<Scanned, StoreError> {
    let mut s = Scanner::new(file, file_len);
    // Start of the current (uncommitted) group; its records so far.
    let mut group = FILE_HEADER_LEN;
    let mut pending: Vec<(u64, u32)> = Vec::new();
    let mut pos = FILE_HEADER_LEN;
    let mut records = 0u64;
    let damaged = |at: u64, group: u64, reason: FormatError, records: u64| {
        // A group that starts before the acknowledged end was acknowledged:
        // damage in it is corruption, wherever it lies.
        let acknowledged = acked.is_some_and(|end| group < end);
        if !acknowledged && torn_group(file, file_len, group, at).map_err(io_err(path))? {
            Ok((ScanEnd::Torn, records, group))
        } else {
            Err(corrupt(path, at, group, reason))
        }
    };
    loop {
        let remaining = file_len - pos;
        if remaining == 0 {
            if pending.is_empty() {
                return Ok((ScanEnd::Clean, records, pos));
            }
            // Every record of the last group is whole, its marker is not there.
            return Ok((ScanEnd::Torn, records, group));
        }
        let short = FormatError::PastEnd(remaining);
        if remaining < RECORD_HEADER_LEN as u64 {
            return damaged(pos, group, short, records);
        }
        s.fill(pos, RECORD_HEADER_LEN).map_err(io_err(path))?;
        let header = match RecordHeader::parse(s.slice(pos, RECORD_HEADER_LEN)) {
            Ok(h) => h,
            Err(reason) => return damaged(pos, group, reason, records),
        };
        let total = RECORD_HEADER_LEN as u64 + u64::from(header.len);
        if total > remaining {
            return damaged(pos, group, short, records);
        }
        s.fill(pos, total as usize).map_err(io_err(path))?;
        let payload = s.slice(pos + RECORD_HEADER_LEN as u64, header.len as usize);
        if let Err(reason) = header.check_payload(payload) {
            return damaged(pos, group, reason, records);
        }
        if !header.marker {
            pending.push((pos, header.len));
            pos += total;
            continue;
        }
        let named = u64::from_le_bytes(payload.try_into().expect("marker payload is 8 bytes"));
        if pending.is_empty() {
            return damaged(pos, group, FormatError::EmptyGroup, records);
        }
        if named != group {
            let reason = FormatError::MarkerGroup {
                named,
                actual: group,
            };
            return damaged(pos, group, reason, records);
        }
        for (off, len) in pending.drain(..) {
            let payload = s.slice(off + RECORD_HEADER_LEN as u64, len as usize);
            on_record(off, payload).map_err(|cause| StoreError::Replay { offset: off, cause })?;
            records += 1;
        }
        pos += total;
        group = pos;
        s.release_to(pos);
    }
}

/// Damage was found at `at` inside the group that starts at `group`: is it
/// the torn write of a group whose fsync never completed? The writer writes
/// a group only after the fsync of the one before returned, so an unsynced
/// group is the last thing in the file and nothing of a later group follows
/// it. Torn when everything from `at` is zero (a crash-extended file), or
/// when the rest of the file fits in one group and holds no valid marker
/// except this group's own as the file's very last bytes. Anything else
/// (a later group's marker, or this group's marker with more after it) means
/// the group was durable before the damage: corruption.
fn torn_group(file: &File, file_len: u64, group: u64, at: u64) -> io::Result<bool> {
    if zero_from(file, at, file_len)? {
        return Ok(true);
    }
    if file_len - group > MAX_GROUP_SPAN {
        return Ok(false);
    }
    let from = at + 1;
    if file_len < from + MARKER_LEN as u64 {
        return Ok(true);
    }
    let mut rest = vec![0u8; (file_len - from) as usize];
    file.read_exact_at(&mut rest, from)?;
    for i in 0..=rest.len() - MARKER_LEN {
        let Ok(h) = RecordHeader::parse(&rest[i..i + RECORD_HEADER_LEN]) else {
            continue;
        };
        let payload = &rest[i + RECORD_HEADER_LEN..i + MARKER_LEN];
        if !h.marker || h.check_payload(payload).is_err() {
            continue;
        }
        let named = u64::from_le_bytes(payload.try_into().expect("8 bytes"));
        let last = i + MARKER_LEN == rest.len();
        if named != group || !last {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Moves `path` (the log) to `wal.log.prev`, so that name always holds the
/// previous log. An older one found there is kept too, first moved to
/// `wal.log.prev.<unix seconds>` (then `.1`, `.2`, ...). Hard links fail
/// rather than replace an existing name, so no kept log is ever lost, and
/// a crash between the steps leaves every log under some name (the next
/// start finishes the move).
fn move_aside(dir: &Path, path: &Path) -> Result<PathBuf, StoreError> {
    let prev = dir.join(WAL_PREV_FILE);
    if fs::symlink_metadata(&prev).is_ok() {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let names = std::iter::once(format!("{WAL_PREV_FILE}.{secs}"))
            .chain((1..1000).map(|n| format!("{WAL_PREV_FILE}.{secs}.{n}")));
        let mut kept = false;
        for name in names {
            let older = dir.join(name);
            match fs::hard_link(&prev, &older) {
                Ok(()) => {
                    kept = true;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err(&older)(e)),
            }
        }
        if !kept {
            return Err(io_err(path)(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "too many kept logs named wal.log.prev*; remove old ones",
            )));
        }
        fs::remove_file(&prev).map_err(io_err(&prev))?;
    }
    fs::hard_link(path, &prev).map_err(io_err(&prev))?;
    fs::remove_file(path).map_err(io_err(path))?;
    Ok(prev)
}

/// Opens (or creates) `<dir>/wal.log`, replaying every record through
/// `on_record(offset, payload)`; an `Err` from `on_record` aborts the open
/// with [`StoreError::Replay`].
///
/// A torn tail (a crash mid-append) is truncated away and reported in the
/// returned [`Recovery`]; corruption anywhere is [`StoreError::Corrupt`] and
/// the file is left untouched. Blocking: call it before serving, or from
/// `spawn_blocking`.
pub fn open(
    dir: &Path,
    mode: OpenMode,
    on_record: &mut OnRecord<'_>,
) -> Result<(WalFile, Recovery), StoreError> {
    crate::store::dirs::create_durable(dir)?;
    let path = dir.join(WAL_FILE);
    let mut recovery = Recovery::default();

    if mode == OpenMode::Cache {
        match fs::symlink_metadata(&path) {
            Ok(_) => {
                let prev = move_aside(dir, &path)?;
                sync_dir(dir)?;
                log::warn!(
                    "--sessions-cache: moved {} to {} and starting a fresh log",
                    path.display(),
                    prev.display()
                );
                recovery.prev_kept = true;
                recovery.prev_path = Some(prev);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&path)(e)),
        }
    }

    let open_rw = || {
        OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
    };
    let file = match open_rw() {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            create_fresh(dir, &path)?;
            open_rw().map_err(io_err(&path))?
        }
        Err(e) => return Err(io_err(&path)(e)),
    };
    crate::store::dirs::tighten(
        &file,
        &path,
        "It holds every session's text: anyone who could read it may have.",
    )
    .map_err(io_err(&path))?;
    let file_len = file.metadata().map_err(io_err(&path))?.len();
    let version = check_header(&file, &path, file_len)?;
    recovery.version = version;

    // SAFETY: posix_fadvise only advises the kernel about this open fd; errors are ignored.
    unsafe {
        use std::os::fd::AsRawFd;
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL);
    }

    let acked = super::acked::read(dir, &file);
    // Acknowledged bytes past the end of the file were cut from outside (a
    // writer never shortens a synced log): every group left is judged as
    // acknowledged, and the start is refused below, naming where a salvage
    // may cut.
    let shortened = acked.filter(|&end| end > file_len);
    let acked = acked.map(|end| end.min(file_len));
    let (end_kind, records, end) = scan(&file, &path, file_len, version, acked, on_record)?;
    if let Some(acked) = shortened {
        return Err(corrupt(
            &path,
            file_len,
            end,
            FormatError::Shortened {
                len: file_len,
                acked,
            },
        ));
    }
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
    Ok((
        WalFile {
            file,
            path,
            end,
            version,
        },
        recovery,
    ))
}

#[cfg(test)]
mod tests {
    use super::super::format::{encode_marker, encode_record, file_header_of, WAL_FORMAT_VERSION};
    use super::super::test_util::{open_collect, payloads, wal_bytes, write_all};
    use super::*;

    /// A version-2 log built by hand: each inner list is one group.
    fn v2_log(groups: &[Vec<Vec<u8>>]) -> (Vec<u8>, Vec<u64>) {
        let mut out = file_header().to_vec();
        let mut starts = Vec::new();
        for g in groups {
            let start = out.len() as u64;
            starts.push(start);
            for p in g {
                encode_record(p, &mut out).unwrap();
            }
            encode_marker(start, &mut out);
        }
        (out, starts)
    }

    fn replayed(got: &[(u64, Vec<u8>)]) -> Vec<Vec<u8>> {
        got.iter().map(|g| g.1.clone()).collect()
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
                version: WAL_FORMAT_VERSION,
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
        // One record per group here (write_all waits for each): each is
        // followed by its group's marker.
        let mut expect_off = FILE_HEADER_LEN;
        for ((off, p), (want, dur)) in got.iter().zip(ps.iter().zip(&durables)) {
            assert_eq!(p, want);
            assert_eq!(*off, dur.offset);
            assert_eq!(*off, expect_off);
            assert_eq!(dur.end, expect_off + (RECORD_HEADER_LEN + p.len()) as u64);
            expect_off = dur.end + MARKER_LEN as u64;
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
    fn torn_tail_at_every_offset_of_the_last_group() {
        let d = tempfile::tempdir().unwrap();
        let ps = payloads(5);
        let durables = write_all(d.path(), &ps);
        let full = wal_bytes(d.path());
        let last = *durables.last().unwrap();
        assert_eq!(last.end + MARKER_LEN as u64, full.len() as u64);
        // Every cut inside the last group (its record or its marker), as a
        // power cut leaves it: before the writer recorded that group's end
        // (with the end recorded, a shorter log is refused:
        // a_log_shorter_than_its_acknowledged_end_is_refused).
        super::super::acked::remove(d.path()).unwrap();
        for cut in last.offset..full.len() as u64 {
            fs::write(d.path().join(WAL_FILE), &full[..cut as usize]).unwrap();
            let (f, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
            assert_eq!(r.records, 4, "cut at {cut}");
            assert_eq!(replayed(&got), ps[..4]);
            if cut == last.offset {
                // A clean cut at a group boundary is simply a shorter log.
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

    /// Item 11: a multi-record group is all or nothing. Cut anywhere inside
    /// the last group, or damage any of its records (zeros, garbage, a torn
    /// page) while its marker landed: the whole group is a torn tail.
    #[test]
    fn multi_record_group_is_atomic() {
        let d = tempfile::tempdir().unwrap();
        let g0 = vec![b"a0".to_vec(), b"a1".to_vec()];
        let g1: Vec<Vec<u8>> = (0..4).map(|i| vec![b'b' + i; 300]).collect();
        let (full, starts) = v2_log(&[g0.clone(), g1.clone()]);
        let path = d.path().join(WAL_FILE);
        for cut in starts[1]..full.len() as u64 {
            fs::write(&path, &full[..cut as usize]).unwrap();
            let (_, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
            assert_eq!(replayed(&got), g0, "cut at {cut}");
            assert_eq!(r.valid_bytes, starts[1]);
        }
        let rec1 = starts[1] as usize + RECORD_HEADER_LEN + 300;
        for damage in ["zeros", "garbage", "bitflip"] {
            for at in [
                starts[1] as usize + 3,
                rec1 + 20,
                full.len() - MARKER_LEN - 5,
            ] {
                let mut bad = full.clone();
                let to = (at + 64).min(full.len());
                match damage {
                    "zeros" => bad[at..to].fill(0),
                    "garbage" => bad[at..to].fill(0xA5),
                    _ => bad[at] ^= 0x08,
                }
                fs::write(&path, &bad).unwrap();
                let (f, r, got) = open_collect(d.path(), OpenMode::Durable)
                    .unwrap_or_else(|e| panic!("{damage} at {at}: {e}"));
                assert_eq!(replayed(&got), g0, "{damage} at {at}");
                assert_eq!(r.truncated_at, Some(starts[1]), "{damage} at {at}");
                assert_eq!(f.end(), starts[1]);
            }
        }
        // All there: both groups.
        fs::write(&path, &full).unwrap();
        let (_, _, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        assert_eq!(replayed(&got), [g0.clone(), g1.clone()].concat());
    }

    /// Damage inside a group that another group follows is corruption: that
    /// group was fsynced before the next one was written.
    #[test]
    fn damage_in_a_group_before_another_is_corrupt() {
        let d = tempfile::tempdir().unwrap();
        let g0: Vec<Vec<u8>> = (0..3).map(|i| vec![b'a' + i; 100]).collect();
        let g1 = vec![b"later".to_vec()];
        let (full, starts) = v2_log(&[g0, g1]);
        let path = d.path().join(WAL_FILE);
        let marker0 = starts[1] as usize - MARKER_LEN;
        // A record of group 0, and group 0's own marker.
        for at in [starts[0] as usize + 130, marker0 + 2, marker0 + 12] {
            for zero in [false, true] {
                let mut bad = full.clone();
                if zero {
                    bad[at..at + 4].fill(0);
                } else {
                    bad[at] ^= 0x40;
                }
                fs::write(&path, &bad).unwrap();
                match open_collect(d.path(), OpenMode::Durable) {
                    Err(e @ StoreError::Corrupt { offset, cut, .. }) => {
                        assert!(
                            offset >= starts[0] && offset < starts[1],
                            "at {at}: {offset}"
                        );
                        // The salvage command the error prints cuts at the
                        // damaged group's start, which salvage takes.
                        assert_eq!(cut, starts[0], "at {at}");
                        assert!(
                            e.to_string().contains(&format!("--truncate-at {cut}`")),
                            "{e}"
                        );
                        crate::store::salvage::plan(d.path(), cut)
                            .unwrap_or_else(|e| panic!("at {at}: salvage at {cut}: {e}"));
                    }
                    other => panic!(
                        "damage at {at}: expected Corrupt, got {:?}",
                        other.map(|x| x.1)
                    ),
                }
                assert_eq!(fs::read(&path).unwrap(), bad, "left unchanged");
            }
        }
    }

    /// Version-1 logs are still read and appended to as version 1 (no
    /// markers), so a build with version 2 keeps an existing log working.
    #[test]
    fn v1_log_is_read_and_appended_as_v1() {
        let d = tempfile::tempdir().unwrap();
        let mut v1 = file_header_of(1).to_vec();
        encode_record(b"old", &mut v1).unwrap();
        fs::write(d.path().join(WAL_FILE), &v1).unwrap();
        let durables = write_all(d.path(), &[b"new".to_vec()]);
        let mut want = v1.clone();
        encode_record(b"new", &mut want).unwrap();
        assert_eq!(wal_bytes(d.path()), want);
        assert_eq!(durables[0].end, want.len() as u64);
        let (f, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        assert_eq!(r.version, 1);
        assert_eq!(f.version(), 1);
        assert_eq!(replayed(&got), [b"old".to_vec(), b"new".to_vec()]);
        // v1 keeps its rules: a garbage tail is corruption there.
        let mut bad = want.clone();
        bad.extend_from_slice(&[0xAB; 40]);
        fs::write(d.path().join(WAL_FILE), &bad).unwrap();
        assert!(matches!(
            open_collect(d.path(), OpenMode::Durable),
            Err(StoreError::Corrupt { .. })
        ));
    }

    /// `--sessions-cache` twice: `wal.log.prev` is the previous log, and the
    /// one before it is kept aside, not replaced.
    #[test]
    fn cache_mode_keeps_the_previous_log_as_prev_and_older_ones_aside() {
        let d = tempfile::tempdir().unwrap();
        write_all(d.path(), &[b"first".to_vec()]);
        let first = wal_bytes(d.path());
        let (_, r, _) = open_collect(d.path(), OpenMode::Cache).unwrap();
        assert_eq!(r.prev_path, Some(d.path().join(WAL_PREV_FILE)));
        write_all(d.path(), &[b"second".to_vec(), b"more".to_vec()]);
        let second = wal_bytes(d.path());
        let (_, r, _) = open_collect(d.path(), OpenMode::Cache).unwrap();
        assert_eq!(r.prev_path, Some(d.path().join(WAL_PREV_FILE)));
        assert_eq!(fs::read(d.path().join(WAL_PREV_FILE)).unwrap(), second);
        let older: Vec<_> = fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with("wal.log.prev."))
            .collect();
        assert_eq!(older.len(), 1, "{older:?}");
        assert_eq!(fs::read(d.path().join(&older[0])).unwrap(), first);
        assert_eq!(wal_bytes(d.path()), file_header());
        // A third start: the second goes aside beside the first.
        write_all(d.path(), &[b"third".to_vec()]);
        let third = wal_bytes(d.path());
        open_collect(d.path(), OpenMode::Cache).unwrap();
        assert_eq!(fs::read(d.path().join(WAL_PREV_FILE)).unwrap(), third);
        let mut older: Vec<_> = fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with("wal.log.prev."))
            .map(|n| fs::read(d.path().join(n)).unwrap())
            .collect();
        older.sort();
        let mut want = vec![first, second];
        want.sort();
        assert_eq!(older, want);
    }

    #[test]
    fn zero_filled_tail_is_torn() {
        let d = tempfile::tempdir().unwrap();
        let durables = write_all(d.path(), &payloads(3));
        let mut bytes = wal_bytes(d.path());
        bytes.extend_from_slice(&[0u8; 100]);
        fs::write(d.path().join(WAL_FILE), &bytes).unwrap();
        let (f, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        let end = durables[2].end + MARKER_LEN as u64;
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
        // The power went before the writer recorded its acknowledged end.
        super::super::acked::remove(d.path()).unwrap();
        let mut bytes = wal_bytes(d.path());
        let last = durables[2];
        for b in &mut bytes[(last.offset as usize + RECORD_HEADER_LEN)..last.end as usize] {
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

    /// A log cut from outside below what `wal.acked` says was acknowledged
    /// (its last group gone whole, or cut inside) lost events clients were
    /// told had committed: the start is refused (it replayed the rest and
    /// handed the lost ids out again), and a salvage at the cut it names
    /// starts it.
    #[test]
    fn a_log_shorter_than_its_acknowledged_end_is_refused() {
        for inside in [0u64, 5] {
            let d = tempfile::tempdir().unwrap();
            let durables = write_all(d.path(), &payloads(3));
            let last = durables[2];
            let bytes = wal_bytes(d.path());
            let cut = last.offset + inside;
            let f = OpenOptions::new()
                .write(true)
                .open(d.path().join(WAL_FILE))
                .unwrap();
            f.set_len(cut).unwrap();
            drop(f);
            match open_collect(d.path(), OpenMode::Durable) {
                Err(StoreError::Corrupt {
                    offset,
                    cut: at,
                    reason: FormatError::Shortened { len, acked },
                    ..
                }) if inside == 0 => {
                    assert_eq!((offset, at, len), (cut, cut, cut));
                    assert_eq!(acked, bytes.len() as u64);
                }
                // Cut inside the last group: that group is judged
                // acknowledged, so its damage is named first.
                Err(StoreError::Corrupt { cut: at, .. }) if inside > 0 => {
                    assert_eq!(at, last.offset)
                }
                other => panic!("cut at {cut}: {other:?}"),
            }
            crate::store::salvage::plan(d.path(), last.offset)
                .unwrap()
                .apply()
                .unwrap();
            let (_, _, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
            assert_eq!(got.len(), 2, "salvaged at {cut}");
        }
    }

    /// The spec: a complete record that fails its checksum refuses the
    /// start. In the last group that cannot be told from a torn write by
    /// the log alone (pages land in any order before the fdatasync
    /// returns); `wal.acked` tells it: a flipped byte in the last group of
    /// a log whose writer recorded its end is corruption, and without the
    /// record (a power cut before it) the group is dropped as torn.
    #[test]
    fn damage_in_an_acknowledged_last_group_is_corrupt() {
        let d = tempfile::tempdir().unwrap();
        let durables = write_all(d.path(), &payloads(3));
        let last = durables[2];
        let mut bytes = wal_bytes(d.path());
        bytes[last.offset as usize + RECORD_HEADER_LEN + 1] ^= 0x20;
        fs::write(d.path().join(WAL_FILE), &bytes).unwrap();
        match open_collect(d.path(), OpenMode::Durable) {
            Err(StoreError::Corrupt { offset, .. }) => assert_eq!(offset, last.offset),
            other => panic!("{other:?}"),
        }
        assert_eq!(wal_bytes(d.path()), bytes, "left as it was");
        // A group past the recorded end is still judged torn.
        super::super::acked::remove(d.path()).unwrap();
        let (f, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        assert_eq!((got.len(), r.truncated_at), (2, Some(last.offset)));
        drop(f);
        // The writer records the end at shutdown, and after ACKED_IDLE idle.
        let (f, _, _) = open_collect(d.path(), OpenMode::Durable).unwrap();
        let w = super::super::WalWriter::spawn(f, None).unwrap();
        let end = w
            .append(b"x".to_vec())
            .blocking_recv()
            .unwrap()
            .unwrap()
            .end;
        std::thread::sleep(super::super::acked::ACKED_IDLE * 5);
        let log = File::open(d.path().join(WAL_FILE)).unwrap();
        assert_eq!(
            super::super::acked::read(d.path(), &log),
            Some(end + MARKER_LEN as u64)
        );
        w.shutdown();
    }

    /// Version 2: garbage after the last marker is the torn write of a group
    /// whose fsync never returned (a torn page can hold any old bytes).
    #[test]
    fn garbage_tail_is_torn_in_v2() {
        let d = tempfile::tempdir().unwrap();
        write_all(d.path(), &payloads(2));
        let good = wal_bytes(d.path());
        let mut bytes = good.clone();
        bytes.extend_from_slice(&[0xAB; 40]);
        fs::write(d.path().join(WAL_FILE), &bytes).unwrap();
        let (_, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(r.truncated_at, Some(good.len() as u64));
        assert_eq!(wal_bytes(d.path()), good);
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
                    StoreError::Corrupt {
                        offset,
                        cut,
                        path,
                        reason,
                    } => {
                        assert_eq!(*offset, victim.offset, "byte {byte} bit {bit}");
                        assert!(cut <= offset);
                        assert_eq!(path, &d.path().join(WAL_FILE));
                        // A flip in len or len_crc fails the length's own
                        // checksum; one in crc or the payload, the payload's.
                        if byte < o + 8 {
                            assert!(
                                matches!(reason, FormatError::LenChecksum { .. }),
                                "byte {byte} bit {bit}: {reason:?}"
                            );
                        } else {
                            assert!(
                                matches!(reason, FormatError::PayloadChecksum { .. }),
                                "byte {byte} bit {bit}: {reason:?}"
                            );
                        }
                    }
                    other => panic!("byte {byte} bit {bit}: expected Corrupt, got {other}"),
                }
                assert_eq!(seen, vec![durables[0].offset]);
                assert_eq!(wal_bytes(d.path()), bad, "the file must be left unchanged");
            }
        }
        // What the user reads: the offset, the reason, and both ways out.
        let path = d.path().join(WAL_FILE);
        let err = open_collect(d.path(), OpenMode::Durable).unwrap_err();
        // The loop left the last payload byte flipped.
        let now = wal_bytes(d.path());
        let stored = u32::from_le_bytes(now[o + 8..o + 12].try_into().unwrap());
        let computed = crc32c::crc32c(&now[o + 12..o + 12 + plen]);
        assert_eq!(
            err.to_string(),
            format!(
                "wal.log is corrupt at byte offset {} (payload checksum mismatch: stored \
                 {stored:#010x}, computed {computed:#010x}); refusing to start rather than \
                 guess. Keep what is before it with `superfluid salvage --sessions {} \
                 --truncate-at {}`, move {} aside, or start with --sessions-cache to keep it \
                 aside and begin a fresh log",
                victim.offset,
                d.path().display(),
                victim.offset,
                path.display()
            )
        );
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
        let found = |bytes: &[u8]| {
            fs::write(&path, bytes).unwrap();
            match open_collect(d.path(), OpenMode::Durable) {
                Err(StoreError::BadHeader { path: p, found }) => {
                    assert_eq!(p, path);
                    found
                }
                other => panic!("expected BadHeader, got {:?}", other.map(|x| x.1)),
            }
        };
        let mut h = file_header();
        h[0] = b'X';
        assert_eq!(found(&h), FormatError::BadMagic(*b"XFWAL\r\n\x1a"));
        // What the user reads: the file and what is wrong with it.
        let msg = open_collect(d.path(), OpenMode::Durable)
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            format!(
                "{} is not a readable superfluid WAL: bad magic b\"XFWAL\\r\\n\\x1a\" \
                 (expected b\"SFWAL\\r\\n\\x1a\")",
                path.display()
            )
        );

        let mut h = file_header();
        h[8..12].copy_from_slice(&7u32.to_le_bytes());
        assert_eq!(found(&h), FormatError::Version(7));
        assert_eq!(
            FormatError::Version(7).to_string(),
            "unsupported format version 7 (this build reads versions 1 and 2)"
        );

        assert_eq!(found(b"SFWAL"), FormatError::ShortFile(5));
        assert_eq!(
            FormatError::ShortFile(5).to_string(),
            "the file is 5 bytes, shorter than the 16-byte header"
        );
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
            StoreError::Replay { offset, cause } => {
                assert_eq!(offset, durables[1].offset);
                assert_eq!(cause.to_string(), "bad event");
            }
            other => panic!("expected Replay, got {other}"),
        }
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
        assert_eq!(r.version, 1);
        assert_eq!(f.end(), golden.len() as u64);
        // And this build's encoder still produces exactly those bytes.
        let mut enc = file_header_of(1).to_vec();
        for (_, p) in &want {
            encode_record(p, &mut enc).unwrap();
        }
        assert_eq!(enc, golden);
    }

    /// tests/data/golden-v2.wal: three groups (two records, one, one) by the
    /// independent encoder in docs/wal-format.md.
    #[test]
    fn golden_v2_file() {
        let golden = fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/golden-v2.wal"
        ))
        .unwrap();
        let want: Vec<(u64, Vec<u8>)> = vec![
            (16, b"hello, superfluid".to_vec()),
            (45, b"".to_vec()),
            (
                77,
                b"{\"session\":\"s1\",\"event\":\"user\",\"text\":\"hi\"}".to_vec(),
            ),
            (152, (0u8..=255).collect()),
        ];
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join(WAL_FILE), &golden).unwrap();
        let (f, r, got) = open_collect(d.path(), OpenMode::Durable).unwrap();
        assert_eq!(got, want);
        assert_eq!((r.truncated_at, r.version), (None, 2));
        assert_eq!(f.end(), golden.len() as u64);
        let groups = [
            vec![want[0].1.clone(), want[1].1.clone()],
            vec![want[2].1.clone()],
            vec![want[3].1.clone()],
        ];
        assert_eq!(v2_log(&groups).0, golden);
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
