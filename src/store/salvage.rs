//! `superfluid salvage`: the operator's way past a corrupt log without
//! throwing it all away. It cuts `wal.log` at a named offset (the one a
//! corruption error printed), after checking that every record before the
//! offset is intact and that the offset is a record boundary (version 1) or a
//! group boundary (version 2), so what is kept replays. The cut bytes are
//! first copied to `wal.log.salvaged.<unix seconds>` (fsynced), so nothing
//! is destroyed. It holds the sessions directory's lock while it works, so it
//! refuses while a daemon runs there.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::error::{io_err, StoreError};
use super::lock::DirLock;
use super::wal::format::{
    check_file_header, FormatError, RecordHeader, FILE_HEADER_LEN, RECORD_HEADER_LEN, WAL_FILE,
    WAL_FORMAT_V1,
};

/// What a cut at `offset` would do; [`plan`] checks it, [`Plan::apply`] does it.
#[derive(Debug)]
pub struct Plan {
    _lock: DirLock,
    /// The log.
    pub path: PathBuf,
    /// Its size now.
    pub file_len: u64,
    /// Where it will end.
    pub offset: u64,
    /// Data records kept (before `offset`).
    pub records_kept: u64,
    /// The log's format version.
    pub version: u32,
}

impl Plan {
    /// Bytes the cut drops.
    pub fn dropped(&self) -> u64 {
        self.file_len - self.offset
    }

    /// Copies the bytes past the offset to `wal.log.salvaged.<secs>` (0600,
    /// fsynced, never replacing a file), then truncates the log and fsyncs
    /// it. Returns where the dropped bytes were kept (`None` when there were
    /// none).
    pub fn apply(self) -> Result<Option<PathBuf>, StoreError> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)
            .map_err(io_err(&self.path))?;
        let len = file.metadata().map_err(io_err(&self.path))?.len();
        if len != self.file_len {
            return Err(io_err(&self.path)(io::Error::other(format!(
                "the log changed size ({} -> {len}) since it was checked; run salvage again",
                self.file_len
            ))));
        }
        let mut kept = None;
        if self.dropped() > 0 {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let (out_path, out) = (0..1000)
                .map(|n| {
                    let name = if n == 0 {
                        format!("{WAL_FILE}.salvaged.{secs}")
                    } else {
                        format!("{WAL_FILE}.salvaged.{secs}.{n}")
                    };
                    dir.join(name)
                })
                .find_map(|p| {
                    OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o600)
                        .open(&p)
                        .ok()
                        .map(|f| (p, f))
                })
                .ok_or_else(|| {
                    io_err(dir)(io::Error::other("cannot create a wal.log.salvaged.* file"))
                })?;
            copy_range(&file, self.offset, len, &out).map_err(io_err(&out_path))?;
            out.sync_all().map_err(io_err(&out_path))?;
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(io_err(dir))?;
            kept = Some(out_path);
        }
        // The acknowledged end (`wal.acked`) names bytes this cut removes:
        // it goes first, durably, so no later log is judged by it.
        crate::store::wal::acked::remove(dir).map_err(io_err(dir))?;
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err(dir))?;
        file.set_len(self.offset).map_err(io_err(&self.path))?;
        file.sync_all().map_err(io_err(&self.path))?;
        Ok(kept)
    }
}

fn copy_range(from: &File, start: u64, end: u64, to: &File) -> io::Result<()> {
    let mut buf = vec![0u8; (1 << 20).min((end - start) as usize)];
    let mut pos = start;
    while pos < end {
        let n = buf.len().min((end - pos) as usize);
        from.read_exact_at(&mut buf[..n], pos)?;
        to.write_all_at(&buf[..n], pos - start)?;
        pos += n as u64;
    }
    Ok(())
}

/// Why a cut was refused.
#[derive(Debug, thiserror::Error)]
pub enum SalvageError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{} does not exist", .0.display())]
    NoLog(PathBuf),
    #[error("offset {offset} is past the end of the log ({file_len} bytes)")]
    PastEnd { offset: u64, file_len: u64 },
    #[error(
        "offset {offset} is inside the file header; the first record starts at {FILE_HEADER_LEN}"
    )]
    InHeader { offset: u64 },
    #[error(
        "the log is damaged at byte offset {at} ({reason}), before offset {offset}: \
         cutting at {offset} would keep damaged bytes; cut at {at} or earlier"
    )]
    DamageBefore {
        offset: u64,
        at: u64,
        reason: FormatError,
    },
    #[error(
        "offset {offset} is not a {what} boundary; the nearest one before it is {before}{}",
        .after.map(|a| format!(", after it {a}")).unwrap_or_default()
    )]
    NotABoundary {
        offset: u64,
        what: &'static str,
        before: u64,
        after: Option<u64>,
    },
}

/// Takes the directory's lock and checks that `offset` is a place the log
/// can be cut: every record before it is intact, and it ends a record
/// (version 1) or a group (version 2). Changes nothing.
pub fn plan(dir: &Path, offset: u64) -> Result<Plan, SalvageError> {
    let path = dir.join(WAL_FILE);
    if !path.is_file() {
        return Err(SalvageError::NoLog(path));
    }
    let lock = DirLock::acquire(dir)?;
    let file = File::open(&path).map_err(io_err(&path))?;
    let file_len = file.metadata().map_err(io_err(&path))?.len();
    let bad = |found: FormatError| StoreError::BadHeader {
        path: path.clone(),
        found,
    };
    if file_len < FILE_HEADER_LEN {
        return Err(bad(FormatError::ShortFile(file_len)).into());
    }
    let mut h = [0u8; FILE_HEADER_LEN as usize];
    file.read_exact_at(&mut h, 0).map_err(io_err(&path))?;
    let version = check_file_header(&h).map_err(bad)?;
    if offset > file_len {
        return Err(SalvageError::PastEnd { offset, file_len });
    }
    if offset < FILE_HEADER_LEN {
        return Err(SalvageError::InHeader { offset });
    }
    let what = if version == WAL_FORMAT_V1 {
        "record"
    } else {
        "group"
    };
    // Walk the intact records up to the offset.
    let mut pos = FILE_HEADER_LEN;
    let mut boundary = FILE_HEADER_LEN;
    let mut records = 0u64;
    let mut records_at_boundary = 0u64;
    let mut header = [0u8; RECORD_HEADER_LEN];
    let mut payload = Vec::new();
    loop {
        if boundary == offset {
            return Ok(Plan {
                _lock: lock,
                path,
                file_len,
                offset,
                records_kept: records_at_boundary,
                version,
            });
        }
        let damage = |reason| {
            if pos >= offset {
                // Inside the group that the offset cuts through.
                SalvageError::NotABoundary {
                    offset,
                    what,
                    before: boundary,
                    after: None,
                }
            } else {
                SalvageError::DamageBefore {
                    offset,
                    at: pos,
                    reason,
                }
            }
        };
        let remaining = file_len - pos;
        if remaining < RECORD_HEADER_LEN as u64 {
            return Err(damage(FormatError::PastEnd(remaining)));
        }
        file.read_exact_at(&mut header, pos)
            .map_err(io_err(&path))?;
        let h = RecordHeader::parse(&header).map_err(damage)?;
        let total = RECORD_HEADER_LEN as u64 + u64::from(h.len);
        if total > remaining {
            return Err(damage(FormatError::PastEnd(remaining)));
        }
        payload.resize(h.len as usize, 0);
        file.read_exact_at(&mut payload, pos + RECORD_HEADER_LEN as u64)
            .map_err(io_err(&path))?;
        h.check_payload(&payload).map_err(damage)?;
        if h.marker && version == WAL_FORMAT_V1 {
            return Err(damage(FormatError::MarkerInV1));
        }
        let last_boundary = boundary;
        pos += total;
        if h.marker || version == WAL_FORMAT_V1 {
            if !h.marker {
                records += 1;
            }
            boundary = pos;
            records_at_boundary = records;
            if boundary > offset {
                return Err(SalvageError::NotABoundary {
                    offset,
                    what,
                    before: last_boundary,
                    after: Some(boundary),
                });
            }
        } else {
            records += 1;
        }
    }
}
