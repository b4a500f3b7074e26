//! `wal.log`: the byte format ([`mod@format`]), open + replay with crash
//! recovery ([`recovery`]), and the group-commit writer thread ([`writer`]).
//! The format is described in `docs/wal-format.md`; the summary:
//!
//! ```text
//! file   := header record*
//! file   := header (record+ marker)*            (version 2; version 1: header record*)
//! header := magic b"SFWAL\r\n\x1a" | version u32 LE (= 2, or 1) | flags u32 LE (= 0)
//! record := len u32 LE | len_crc u32 LE = crc32c(len LE bytes) | crc u32 LE = crc32c(payload) | payload[len]
//! marker := a record with len = 0x8000_0008, payload = the group's first record offset u64 LE
//! ```
//!
//! Everything here is blocking file I/O. [`open`] runs once at startup (call it
//! from a blocking context); after that the only blocking happens on the
//! `wal-writer` thread, and [`WalWriter::append`] never blocks its caller.

pub mod acked;
pub mod format;
pub mod recovery;
pub mod writer;

pub use super::error::{ReplayError, StoreError, WriterFailure};
pub use format::{
    encode_marker, encode_record, file_header, file_header_of, FormatError, FILE_HEADER_LEN,
    GROUP_MAX_BYTES, MARKER_FLAG, MARKER_LEN, MAX_GROUP_SPAN, MAX_RECORD_BYTES, RECORD_HEADER_LEN,
    WAL_FILE, WAL_FORMAT_V1, WAL_FORMAT_VERSION, WAL_MAGIC, WAL_PREV_FILE,
};
pub use recovery::{open, OnRecord, OpenMode, Recovery, WalFile};
pub use writer::{BeforeSync, Durable, WalIo, WalStats, WalWriter};

/// Helpers of the unit tests of `recovery` and `writer`.
#[cfg(test)]
mod test_util {
    use std::fs;
    use std::path::Path;

    use super::*;

    pub(super) type Replayed = Vec<(u64, Vec<u8>)>;

    /// Opens the log in `dir`, collecting every replayed record.
    pub(super) fn open_collect(
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

    /// Appends `payloads` through a fresh writer, each in its own group;
    /// returns each record's Durable.
    pub(super) fn write_all(dir: &Path, payloads: &[Vec<u8>]) -> Vec<Durable> {
        let (f, _, _) = open_collect(dir, OpenMode::Durable).unwrap();
        let w = WalWriter::spawn(f, None).unwrap();
        // One at a time: each record is its own group, so the layout is
        // known (record, marker, record, marker, ...).
        let out = payloads
            .iter()
            .map(|p| w.append(p.clone()).blocking_recv().unwrap().unwrap())
            .collect();
        w.shutdown();
        out
    }

    pub(super) fn payloads(n: usize) -> Vec<Vec<u8>> {
        (0..n)
            .map(|i| format!("record {i} ").repeat(i % 7 + 1).into_bytes())
            .collect()
    }

    pub(super) fn wal_bytes(dir: &Path) -> Vec<u8> {
        fs::read(dir.join(WAL_FILE)).unwrap()
    }
}
