//! The bytes of `wal.log`: the file header, the record header, and the
//! encoder. Pure: no file I/O here (recovery and the writer do it).

use super::super::error::StoreError;

/// The log's file name inside the sessions directory.
pub const WAL_FILE: &str = "wal.log";
/// Where `OpenMode::Cache` moves an existing log before starting a fresh one.
pub const WAL_PREV_FILE: &str = "wal.log.prev";
/// Scratch name used while creating a fresh log (renamed over `wal.log`).
pub(super) const WAL_TMP_FILE: &str = "wal.log.tmp";
/// First 8 bytes of every log (PNG-style: catches text-mode and truncation mangling).
pub const WAL_MAGIC: [u8; 8] = *b"SFWAL\r\n\x1a";
/// The format version of every log this build creates (it also reads and
/// appends to version-1 logs, see [`WAL_FORMAT_V1`]).
pub const WAL_FORMAT_VERSION: u32 = 2;
/// The first format: records without group commit markers. Still read, and
/// appended to in its own format, so an existing log keeps working.
pub const WAL_FORMAT_V1: u32 = 1;
/// Version 2: in `len`, this bit marks a group commit marker (its payload is
/// the 8-byte offset of the group's first record). Payload lengths are capped
/// far below it, so a data record never has it set.
pub const MARKER_FLAG: u32 = 1 << 31;
/// Payload length of a group commit marker.
pub const MARKER_PAYLOAD_LEN: usize = 8;
/// Bytes a group commit marker adds to each group.
pub const MARKER_LEN: usize = RECORD_HEADER_LEN + MARKER_PAYLOAD_LEN;
/// The writer stops pulling more queued records into a group past this size.
pub const GROUP_MAX_BYTES: usize = 8 << 20;
/// The most bytes one group can span in the file: the writer adds records
/// while the group is under [`GROUP_MAX_BYTES`], so one more record of the
/// cap, then the marker. Damage further than this from the last committed
/// group cannot be a torn write of the group after it.
pub const MAX_GROUP_SPAN: u64 =
    (GROUP_MAX_BYTES + RECORD_HEADER_LEN + MAX_RECORD_BYTES + MARKER_LEN) as u64;
/// Length of the file header: magic, version, flags.
pub const FILE_HEADER_LEN: u64 = 16;
/// Length of a record header: len, len_crc, crc.
pub const RECORD_HEADER_LEN: usize = 12;
/// Largest payload a record may carry; checked before any allocation.
pub const MAX_RECORD_BYTES: usize = 64 << 20;

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

/// Appends the group commit marker of the group whose first record is at
/// `group_start` (version 2 only).
pub fn encode_marker(group_start: u64, out: &mut Vec<u8>) {
    let len = (MARKER_FLAG | MARKER_PAYLOAD_LEN as u32).to_le_bytes();
    let payload = group_start.to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&crc32c::crc32c(&len).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
}

/// The header of a fresh log (version [`WAL_FORMAT_VERSION`]).
pub fn file_header() -> [u8; FILE_HEADER_LEN as usize] {
    file_header_of(WAL_FORMAT_VERSION)
}

/// The header of a log of `version`.
pub fn file_header_of(version: u32) -> [u8; FILE_HEADER_LEN as usize] {
    let mut h = [0u8; FILE_HEADER_LEN as usize];
    h[..8].copy_from_slice(&WAL_MAGIC);
    h[8..12].copy_from_slice(&version.to_le_bytes());
    // flags (bytes 12..16) stay zero
    h
}

/// What is wrong with the bytes of a log: the reason inside
/// [`StoreError::BadHeader`] and [`StoreError::Corrupt`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("the file is {0} bytes, shorter than the {FILE_HEADER_LEN}-byte header")]
    ShortFile(u64),
    #[error("bad magic b\"{}\" (expected b\"{}\")", .0.escape_ascii(), WAL_MAGIC.escape_ascii())]
    BadMagic([u8; 8]),
    #[error("unsupported format version {0} (this build reads versions {WAL_FORMAT_V1} and {WAL_FORMAT_VERSION})")]
    Version(u32),
    #[error("unknown header flags {0:#010x}")]
    Flags(u32),
    #[error("record length checksum mismatch: len {len}, stored len_crc {len_crc:#010x}")]
    LenChecksum { len: u32, len_crc: u32 },
    #[error("record length {0} exceeds the {MAX_RECORD_BYTES}-byte cap")]
    LenOverCap(u32),
    #[error("payload checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    PayloadChecksum { stored: u32, computed: u32 },
    #[error("group commit marker names group start {named}, but the group began at {actual}")]
    MarkerGroup { named: u64, actual: u64 },
    #[error("group commit marker without a record before it")]
    EmptyGroup,
    #[error("group commit marker of {0} payload bytes (expected {MARKER_PAYLOAD_LEN})")]
    MarkerLen(u32),
    #[error("group commit marker in a version-1 log")]
    MarkerInV1,
    #[error("a record runs past the end of the file ({0} bytes left)")]
    PastEnd(u64),
    #[error(
        "the file ends at byte {len}, before the {acked} bytes wal.acked says were \
         acknowledged to clients: it was cut after they were told (if you restored an older \
         copy of wal.log on purpose, remove wal.acked beside it instead)"
    )]
    Shortened { len: u64, acked: u64 },
}

/// Checks a file header (magic, version, flags); returns the version.
pub(crate) fn check_file_header(h: &[u8; FILE_HEADER_LEN as usize]) -> Result<u32, FormatError> {
    let magic: [u8; 8] = h[..8].try_into().expect("8 bytes");
    if magic != WAL_MAGIC {
        return Err(FormatError::BadMagic(magic));
    }
    let version = u32_at(h, 8);
    if version != WAL_FORMAT_VERSION && version != WAL_FORMAT_V1 {
        return Err(FormatError::Version(version));
    }
    let flags = u32_at(h, 12);
    if flags != 0 {
        return Err(FormatError::Flags(flags));
    }
    Ok(version)
}

/// A record header as read from the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RecordHeader {
    /// Payload length.
    pub len: u32,
    /// A group commit marker (version 2), not a data record.
    pub marker: bool,
    /// crc32c of the payload.
    pub crc: u32,
}

impl RecordHeader {
    /// Parses and checks a record header of `RECORD_HEADER_LEN` bytes: the
    /// length's own checksum, and the cap.
    pub fn parse(h: &[u8]) -> Result<RecordHeader, FormatError> {
        let len = u32_at(h, 0);
        let len_crc = u32_at(h, 4);
        let crc = u32_at(h, 8);
        if crc32c::crc32c(&len.to_le_bytes()) != len_crc {
            return Err(FormatError::LenChecksum { len, len_crc });
        }
        if len & MARKER_FLAG != 0 {
            let payload = len & !MARKER_FLAG;
            if payload as usize != MARKER_PAYLOAD_LEN {
                return Err(FormatError::MarkerLen(payload));
            }
            return Ok(RecordHeader {
                len: payload,
                marker: true,
                crc,
            });
        }
        if len as usize > MAX_RECORD_BYTES {
            return Err(FormatError::LenOverCap(len));
        }
        Ok(RecordHeader {
            len,
            marker: false,
            crc,
        })
    }

    /// Checks `payload` against the header's checksum.
    pub fn check_payload(&self, payload: &[u8]) -> Result<(), FormatError> {
        let computed = crc32c::crc32c(payload);
        if computed != self.crc {
            return Err(FormatError::PayloadChecksum {
                stored: self.crc,
                computed,
            });
        }
        Ok(())
    }
}

/// The little-endian u32 at `at` in a header the caller has length-checked.
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_value() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn record_header_round_trip_and_checks() {
        let mut buf = Vec::new();
        encode_record(b"abc", &mut buf).unwrap();
        assert_eq!(buf.len(), RECORD_HEADER_LEN + 3);
        let h = RecordHeader::parse(&buf[..RECORD_HEADER_LEN]).unwrap();
        assert_eq!(h.len, 3);
        assert!(!h.marker);
        let mut m = Vec::new();
        encode_marker(1234, &mut m);
        assert_eq!(m.len(), MARKER_LEN);
        let mh = RecordHeader::parse(&m[..RECORD_HEADER_LEN]).unwrap();
        assert!(mh.marker);
        assert_eq!(mh.len as usize, MARKER_PAYLOAD_LEN);
        assert_eq!(mh.check_payload(&m[RECORD_HEADER_LEN..]), Ok(()));
        assert_eq!(h.crc, crc32c::crc32c(b"abc"));
        assert_eq!(h.check_payload(b"abc"), Ok(()));
        assert!(matches!(
            h.check_payload(b"abd"),
            Err(FormatError::PayloadChecksum { .. })
        ));
        let mut bad = buf.clone();
        bad[0] ^= 1;
        assert_eq!(
            RecordHeader::parse(&bad[..RECORD_HEADER_LEN]),
            Err(FormatError::LenChecksum {
                len: 2,
                len_crc: crc32c::crc32c(&3u32.to_le_bytes())
            })
        );
        let cap = (MAX_RECORD_BYTES + 1) as u32;
        let mut over = cap.to_le_bytes().to_vec();
        over.extend(crc32c::crc32c(&cap.to_le_bytes()).to_le_bytes());
        over.extend([0; 4]);
        assert_eq!(
            RecordHeader::parse(&over),
            Err(FormatError::LenOverCap(cap))
        );
        assert!(matches!(
            encode_record(&vec![0; MAX_RECORD_BYTES + 1], &mut Vec::new()),
            Err(StoreError::RecordTooLarge { .. })
        ));
    }

    #[test]
    fn file_header_checks() {
        assert_eq!(check_file_header(&file_header()), Ok(2));
        assert_eq!(check_file_header(&file_header_of(1)), Ok(1));
        let mut h = file_header();
        h[12] = 1;
        assert_eq!(check_file_header(&h), Err(FormatError::Flags(1)));
        assert_eq!(
            FormatError::Flags(1).to_string(),
            "unknown header flags 0x00000001"
        );
    }
}
