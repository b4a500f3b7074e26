//! Opening `wal.log` at start-up: create it if missing, check its header,
//! replay every record, and recover from a crash. A torn tail (a crash
//! mid-append) is truncated away; corruption anywhere else refuses the start
//! and leaves the file as it is. Blocking file I/O, run once before serving.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::format::{
    check_file_header, file_header, FormatError, RecordHeader, FILE_HEADER_LEN, RECORD_HEADER_LEN,
    WAL_FILE, WAL_PREV_FILE, WAL_TMP_FILE,
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

/// An open, recovered log positioned at its end. Hand it to
/// [`WalWriter::spawn`](super::WalWriter::spawn).
#[derive(Debug)]
pub struct WalFile {
    pub(super) file: File,
    pub(super) path: PathBuf,
    pub(super) end: u64,
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
fn scan(
    file: &File,
    path: &Path,
    file_len: u64,
    on_record: &mut OnRecord<'_>,
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
    let corrupt = |pos: u64, reason: FormatError| -> Result<(ScanEnd, u64, u64), StoreError> {
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
        let header = match RecordHeader::parse(&s.buf[s.lo..s.lo + RECORD_HEADER_LEN]) {
            Ok(h) => h,
            Err(reason) => {
                if zero_from(file, pos, file_len).map_err(io_err(path))? {
                    return Ok((ScanEnd::Torn, records, pos));
                }
                return corrupt(pos, reason);
            }
        };
        let total = RECORD_HEADER_LEN as u64 + u64::from(header.len);
        if total > remaining {
            return Ok((ScanEnd::Torn, records, pos));
        }
        s.fill(total as usize).map_err(io_err(path))?;
        let payload = &s.buf[s.lo + RECORD_HEADER_LEN..s.lo + total as usize];
        if let Err(reason) = header.check_payload(payload) {
            // The final record's header landed but its payload did not (the
            // file grew, the data blocks stayed zero): a torn tail too.
            let is_final = pos + total == file_len;
            let payload_start = pos + RECORD_HEADER_LEN as u64;
            if is_final && zero_from(file, payload_start, file_len).map_err(io_err(path))? {
                return Ok((ScanEnd::Torn, records, pos));
            }
            return corrupt(pos, reason);
        }
        on_record(pos, payload).map_err(|cause| StoreError::Replay { offset: pos, cause })?;
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

#[cfg(test)]
mod tests {
    use super::super::format::encode_record;
    use super::super::test_util::{open_collect, payloads, wal_bytes, write_all};
    use super::*;

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
                    StoreError::Corrupt {
                        offset,
                        path,
                        reason,
                    } => {
                        assert_eq!(*offset, victim.offset, "byte {byte} bit {bit}");
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
                 guess. Move {} aside, or start with --sessions-cache to keep it as \
                 wal.log.prev and begin a fresh log",
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
            "unsupported format version 7 (this build reads version 1)"
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
