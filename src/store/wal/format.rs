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
/// The only format version this build reads and writes.
pub const WAL_FORMAT_VERSION: u32 = 1;
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

/// The header of a fresh log.
pub(super) fn file_header() -> [u8; FILE_HEADER_LEN as usize] {
    let mut h = [0u8; FILE_HEADER_LEN as usize];
    h[..8].copy_from_slice(&WAL_MAGIC);
    h[8..12].copy_from_slice(&WAL_FORMAT_VERSION.to_le_bytes());
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
    #[error("unsupported format version {0} (this build reads version {WAL_FORMAT_VERSION})")]
    Version(u32),
    #[error("unknown header flags {0:#010x}")]
    Flags(u32),
    #[error("record length checksum mismatch: len {len}, stored len_crc {len_crc:#010x}")]
    LenChecksum { len: u32, len_crc: u32 },
    #[error("record length {0} exceeds the {MAX_RECORD_BYTES}-byte cap")]
    LenOverCap(u32),
    #[error("payload checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    PayloadChecksum { stored: u32, computed: u32 },
}

/// Checks a file header (magic, version, flags).
pub(super) fn check_file_header(h: &[u8; FILE_HEADER_LEN as usize]) -> Result<(), FormatError> {
    let magic: [u8; 8] = h[..8].try_into().expect("8 bytes");
    if magic != WAL_MAGIC {
        return Err(FormatError::BadMagic(magic));
    }
    let version = u32_at(h, 8);
    if version != WAL_FORMAT_VERSION {
        return Err(FormatError::Version(version));
    }
    let flags = u32_at(h, 12);
    if flags != 0 {
        return Err(FormatError::Flags(flags));
    }
    Ok(())
}

/// A record header as read from the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RecordHeader {
    /// Payload length.
    pub len: u32,
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
        if len as usize > MAX_RECORD_BYTES {
            return Err(FormatError::LenOverCap(len));
        }
        Ok(RecordHeader { len, crc })
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
        assert_eq!(check_file_header(&file_header()), Ok(()));
        let mut h = file_header();
        h[12] = 1;
        assert_eq!(check_file_header(&h), Err(FormatError::Flags(1)));
        assert_eq!(
            FormatError::Flags(1).to_string(),
            "unknown header flags 0x00000001"
        );
    }
}
