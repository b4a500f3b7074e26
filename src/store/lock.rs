//! One daemon per sessions directory: an exclusive `flock` on `<dir>/lock`,
//! held for the daemon's lifetime, with the holder's pid written inside so a
//! second daemon can say who is in the way.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use fs4::fs_std::FileExt as LockExt;

use super::error::{io_err, StoreError};

/// The lock file's name inside the sessions directory.
pub const LOCK_FILE: &str = "lock";

/// Exclusive ownership of a sessions directory; released when dropped
/// (closing the file drops the `flock`, also when the process dies).
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    path: PathBuf,
}

impl DirLock {
    /// Creates `dir` (mode 0700) if missing, then takes the exclusive lock on
    /// `<dir>/lock` (mode 0600) without waiting and records our pid in it.
    /// Fails with [`StoreError::Locked`] naming the holder's pid if another
    /// process holds it.
    pub fn acquire(dir: &Path) -> Result<DirLock, StoreError> {
        super::dirs::create_durable(dir)?;
        super::dirs::check_private(dir)?;
        let path = dir.join(LOCK_FILE);
        // No truncate here: until we hold the lock the pid inside is the holder's.
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io_err(&path))?;
        super::dirs::tighten(&file, &path, "It holds only the daemon's pid.")
            .map_err(io_err(&path))?;
        if LockExt::try_lock_exclusive(&file).map_err(io_err(&path))? {
            file.set_len(0).map_err(io_err(&path))?;
            file.write_all_at(format!("{}\n", std::process::id()).as_bytes(), 0)
                .map_err(io_err(&path))?;
            Ok(DirLock { _file: file, path })
        } else {
            let mut holder = String::new();
            // Best effort: the holder may not have written its pid yet.
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            Err(StoreError::Locked {
                dir: dir.to_path_buf(),
                holder: if holder.is_empty() {
                    "unknown".to_string()
                } else {
                    holder.to_string()
                },
            })
        }
    }

    /// Path of the lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_acquire_fails_until_the_first_is_dropped() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("sessions");
        let first = DirLock::acquire(&dir).unwrap();
        let pid = std::process::id().to_string();
        assert_eq!(std::fs::read_to_string(first.path()).unwrap().trim(), pid);
        let err = DirLock::acquire(&dir).unwrap_err();
        match &err {
            StoreError::Locked { dir: d2, holder } => {
                assert_eq!(d2, &dir);
                assert_eq!(holder, &pid);
            }
            other => panic!("expected Locked, got {other}"),
        }
        assert_eq!(
            err.to_string(),
            format!(
                "sessions directory {} is in use by another superfluid daemon (pid {pid}); \
                 stop it or pass a different --sessions",
                dir.display()
            )
        );
        drop(first);
        let again = DirLock::acquire(&dir).unwrap();
        assert_eq!(std::fs::read_to_string(again.path()).unwrap().trim(), pid);
    }

    #[test]
    fn creates_private_dir_and_lock_file() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("a/b");
        let lock = DirLock::acquire(&dir).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(lock.path()), 0o600);
    }
}
