//! `wal.acked`: the end of the log known to be acknowledged, so recovery
//! can tell a torn last group (a power cut during a write nobody was told
//! had landed: dropped) from a damaged group that was acknowledged
//! (corruption: refused, as the spec says of a complete record that fails
//! its checksum).
//!
//! Without it, damage in the last group cannot be told from a torn write:
//! the disk may land a group's pages in any order before its fdatasync
//! returns. The `wal-writer` thread writes this file after its fdatasyncs,
//! off the path of any reply: when it has been idle for [`ACKED_IDLE`],
//! at most every [`ACKED_EVERY`] while busy, and at shutdown. It only ever
//! names an end whose fdatasync returned, so it is a lower bound of what
//! was acknowledged: a stale one (lost in the same power cut) names less,
//! and the groups after it are judged as before.
//!
//! ```text
//! wal.acked := magic b"SFACKED1" | end u64 LE | dev u64 LE | ino u64 LE | crc32c(previous 32 bytes) u32 LE
//! ```
//!
//! `dev` and `ino` name the log file it describes: a log moved aside,
//! replaced or restored from a copy is another file, and the hint is
//! ignored. A fresh log and `superfluid salvage` (which cuts a log below
//! what was acknowledged) remove it; a bad checksum or a short hint file
//! are ignored too. An end past the log's length is acknowledged bytes
//! gone: recovery refuses to start, as for a damaged record.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::time::Duration;

/// The hint's file name, beside `wal.log`.
pub const ACKED_FILE: &str = "wal.acked";

/// The writer records the acknowledged end once it has had no append for
/// this long.
pub const ACKED_IDLE: Duration = Duration::from_millis(200);

/// While appends keep coming, at most this often.
pub const ACKED_EVERY: Duration = Duration::from_secs(2);

const MAGIC: &[u8; 8] = b"SFACKED1";
const LEN: usize = 36;

fn encode(end: u64, dev: u64, ino: u64) -> [u8; LEN] {
    let mut b = [0u8; LEN];
    b[..8].copy_from_slice(MAGIC);
    b[8..16].copy_from_slice(&end.to_le_bytes());
    b[16..24].copy_from_slice(&dev.to_le_bytes());
    b[24..32].copy_from_slice(&ino.to_le_bytes());
    let crc = crc32c::crc32c(&b[..32]);
    b[32..].copy_from_slice(&crc.to_le_bytes());
    b
}

/// (end, dev, ino), or None for anything but a whole, valid hint.
fn decode(b: &[u8]) -> Option<(u64, u64, u64)> {
    if b.len() != LEN || &b[..8] != MAGIC {
        return None;
    }
    let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let crc = u32::from_le_bytes(b[32..].try_into().expect("4 bytes"));
    (crc32c::crc32c(&b[..32]) == crc).then(|| (word(8), word(16), word(24)))
}

/// The acknowledged end the hint in `dir` gives for `log`, when it names
/// this file. An end past the file's length means acknowledged bytes are
/// missing (the file was cut from outside): recovery refuses that.
pub fn read(dir: &Path, log: &File) -> Option<u64> {
    let bytes = std::fs::read(dir.join(ACKED_FILE)).ok()?;
    let (end, dev, ino) = decode(&bytes)?;
    let meta = log.metadata().ok()?;
    (meta.dev() == dev && meta.ino() == ino).then_some(end)
}

/// Removes the hint (a fresh log, a salvaged one). Missing is fine.
pub fn remove(dir: &Path) -> io::Result<()> {
    match std::fs::remove_file(dir.join(ACKED_FILE)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The writer thread's handle on the hint.
pub struct AckedHint {
    file: File,
    dev: u64,
    ino: u64,
    /// The end last written.
    written: u64,
}

impl AckedHint {
    /// Opens (creates, mode 0600) the hint beside the log `log`.
    pub fn open(dir: &Path, log: &File) -> io::Result<AckedHint> {
        let meta = log.metadata()?;
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(dir.join(ACKED_FILE))?;
        crate::store::dirs::tighten(&file, &dir.join(ACKED_FILE), "It holds only an offset.")?;
        Ok(AckedHint {
            file,
            dev: meta.dev(),
            ino: meta.ino(),
            written: 0,
        })
    }

    /// Records `end` (covered by a returned fdatasync of the log), unless
    /// it is already recorded: one write of 36 bytes (within a sector),
    /// then fdatasync.
    pub fn record(&mut self, end: u64) -> io::Result<()> {
        if end == self.written {
            return Ok(());
        }
        self.file
            .write_all_at(&encode(end, self.dev, self.ino), 0)?;
        self.file.sync_data()?;
        self.written = end;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hint_names_its_own_log_only() {
        let dir = tempfile::tempdir().unwrap();
        let log = File::create(dir.path().join("wal.log")).unwrap();
        log.set_len(100).unwrap();
        let mut h = AckedHint::open(dir.path(), &log).unwrap();
        assert_eq!(read(dir.path(), &log), None, "nothing written yet");
        h.record(80).unwrap();
        assert_eq!(read(dir.path(), &log), Some(80));
        // Past the file's length it is still read: recovery refuses that.
        log.set_len(79).unwrap();
        assert_eq!(read(dir.path(), &log), Some(80));
        // Another file (a log moved aside and replaced).
        let other = File::create(dir.path().join("other.log")).unwrap();
        assert_eq!(read(dir.path(), &other), None);
        // A damaged hint.
        let path = dir.path().join(ACKED_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[9] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(read(dir.path(), &log), None);
        remove(dir.path()).unwrap();
        remove(dir.path()).unwrap();
        assert!(!path.exists());
    }
}
