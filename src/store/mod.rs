//! Durable storage for sessions.
//!
//! One responsibility: this module is the only code that touches `wal.log`'s
//! bytes. It defines the on-disk format ([`wal::format`], see
//! `docs/wal-format.md`), replays and recovers the log at startup ([`open`],
//! in [`wal::recovery`]), appends records with group commit on a dedicated
//! `wal-writer` thread ([`WalWriter`], in [`wal::writer`]), and makes sure
//! only one daemon uses a sessions directory at a time ([`DirLock`]). Every
//! failure is a [`StoreError`]. Payloads are opaque here; callers encode and
//! decode them.

pub mod dirs;
mod error;
pub mod lock;
pub mod salvage;
pub mod wal;

pub use error::{ReplayError, StoreError, WriterFailure};
pub use lock::{DirLock, LOCK_FILE};
pub use wal::{
    encode_record, open, BeforeSync, Durable, FormatError, OpenMode, Recovery, WalFile, WalIo,
    WalStats, WalWriter, FILE_HEADER_LEN, MARKER_FLAG, MAX_RECORD_BYTES, RECORD_HEADER_LEN,
    WAL_FILE, WAL_FORMAT_VERSION, WAL_MAGIC, WAL_PREV_FILE,
};
