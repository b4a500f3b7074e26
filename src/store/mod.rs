//! Durable storage for sessions.
//!
//! One responsibility: this module is the only code that touches `wal.log`'s
//! bytes. It defines the on-disk format (see `docs/wal-format.md`), replays
//! and recovers the log at startup ([`open`]), appends records with group
//! commit on a dedicated `wal-writer` thread ([`WalWriter`]), and makes sure
//! only one daemon uses a sessions directory at a time ([`DirLock`]).
//! Payloads are opaque here; callers encode and decode them.

pub mod lock;
pub mod wal;

pub use lock::{DirLock, LOCK_FILE};
pub use wal::{
    encode_record, open, BeforeSync, Durable, OpenMode, Recovery, StoreError, WalFile, WalStats,
    WalWriter, FILE_HEADER_LEN, MAX_RECORD_BYTES, RECORD_HEADER_LEN, WAL_FILE, WAL_FORMAT_VERSION,
    WAL_MAGIC, WAL_PREV_FILE,
};
