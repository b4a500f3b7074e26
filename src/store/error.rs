//! `StoreError`: the one error type of the store. Its `Display` texts are
//! what a user reads (at start-up on stderr, or as a client's `Err
//! {message}` when a commit fails), so they name the file, the offset and
//! the way out.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::wal::FormatError;

/// What the replay callback of [`open`](super::open) answers for a record it
/// cannot apply: the caller's own error, carried opaquely.
pub type ReplayError = Box<dyn std::error::Error + Send + Sync>;

/// Errors of the store module.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("I/O error on {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{} is not a readable superfluid WAL: {found}", .path.display())]
    BadHeader { path: PathBuf, found: FormatError },
    #[error(
        "wal.log is corrupt at byte offset {offset} ({reason}); refusing to start rather than guess. \
         Keep what is before it with `superfluid salvage --sessions {} --truncate-at {cut}`, \
         move {} aside, or start with --sessions-cache to keep it aside and begin a fresh log",
        .path.parent().unwrap_or(std::path::Path::new(".")).display(),
        .path.display()
    )]
    Corrupt {
        path: PathBuf,
        /// Where the damage is.
        offset: u64,
        /// Where a salvage may cut, at or before `offset`: the start of the
        /// damaged record in a version-1 log, of the commit group holding
        /// it in a version-2 log.
        cut: u64,
        reason: FormatError,
    },
    #[error("record of {len} bytes exceeds the WAL record cap of 64 MiB")]
    RecordTooLarge { len: usize },
    #[error(
        "sessions directory {} is in use by another superfluid daemon (pid {holder}); stop it or pass a different --sessions",
        .dir.display()
    )]
    Locked { dir: PathBuf, holder: String },
    /// The directory is not the daemon user's alone: another user could
    /// plant a link where the daemon writes, or read what it keeps.
    #[error(
        "{} is {why}; the sessions and model log directories must be this user's alone \
         (`chmod 700 {}`, or pass a different --sessions; on a filesystem that ignores modes, \
         such as a Windows or CIFS mount, use a directory on a Linux filesystem)",
        .dir.display(),
        .dir.display()
    )]
    NotPrivate { dir: PathBuf, why: String },
    /// The writer thread hit an I/O error earlier (or is gone): every later append fails.
    #[error("the WAL writer failed and accepts no more records: {0}")]
    WriterFailed(WriterFailure),
    /// The replay callback rejected the record at `offset`. (`cause` is
    /// printed, not chained as a `source`, so the message reads as one line.)
    #[error("replaying the WAL record at byte offset {offset} failed: {cause}")]
    Replay { offset: u64, cause: ReplayError },
}

/// Why the WAL writer accepts no more records. Cloned into the reply of
/// every append after the failure.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WriterFailure {
    /// The write of a group failed; nothing is written after it.
    #[error("writing {len} bytes at offset {offset} of {}: {error}", .path.display())]
    Write {
        len: usize,
        offset: u64,
        path: PathBuf,
        error: Arc<io::Error>,
    },
    /// The fdatasync of a group failed.
    #[error("fdatasync of {}: {error}", .path.display())]
    Sync {
        path: PathBuf,
        error: Arc<io::Error>,
    },
    /// An append after the writer thread exited (shut down, or every handle dropped).
    #[error("the wal-writer thread has exited")]
    Exited,
    /// A commit after `WalActor` shut the log down.
    #[error("the log is shut down")]
    ShutDown,
    /// The writer thread dropped a reply without answering.
    #[error("the writer thread is gone")]
    Gone,
    /// The ordering invariant broke: a reply came before its fsync.
    #[error("record ending at {end} resolved before it was durable ({durable})")]
    NotDurable { end: u64, durable: u64 },
}

/// Maps an `io::Error` on `path` to [`StoreError::Io`].
pub(crate) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}
