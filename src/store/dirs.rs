//! Directories the store creates are made durable: a directory created on
//! first run is only known to survive a power cut once the directory holding
//! it is fsynced, up to the first one that already existed.

use std::fs::{DirBuilder, File};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use super::error::io_err;
use super::StoreError;

/// Creates `dir` and its missing ancestors (mode 0700), then fsyncs the
/// parent of each directory it created, deepest first. Returns the
/// directories it fsynced (empty when `dir` existed).
pub fn create_durable(dir: &Path) -> Result<Vec<PathBuf>, StoreError> {
    // The directories that do not exist yet, outermost last.
    let mut missing = Vec::new();
    let mut at = Some(dir);
    while let Some(d) = at {
        if d.as_os_str().is_empty() || d.exists() {
            break;
        }
        missing.push(d.to_path_buf());
        at = d.parent();
    }
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_err(dir))?;
    let mut synced = Vec::new();
    for created in &missing {
        let parent = match created.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        File::open(&parent)
            .and_then(|d| d.sync_all())
            .map_err(io_err(&parent))?;
        synced.push(parent);
    }
    Ok(synced)
}

/// Refuses a directory another user owns or may write in (group or
/// others write bits): they could plant a link where the daemon writes.
pub fn check_private(dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir).map_err(io_err(dir))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let why = if meta.uid() != me {
        Some(format!(
            "owned by uid {}, not by this user ({me})",
            meta.uid()
        ))
    } else if meta.mode() & 0o022 != 0 {
        Some(format!(
            "writable by other users (mode {:o})",
            meta.mode() & 0o7777
        ))
    } else {
        None
    };
    match why {
        Some(why) => Err(StoreError::NotPrivate {
            dir: dir.to_path_buf(),
            why,
        }),
        None => Ok(()),
    }
}

/// Sets an open file that others may read (restored by a copy that dropped
/// its mode) back to 0600, with a warning saying what they could have read
/// (`what`).
pub fn tighten(file: &File, path: &Path, what: &str) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = file.metadata()?.permissions().mode();
    if mode & 0o077 != 0 {
        log::warn!(
            "{} was open to other users (mode {:o}); set to 0600. {what}",
            path.display(),
            mode & 0o777
        );
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn each_created_directory_is_made_durable_in_its_parent() {
        let root = tempfile::tempdir().unwrap();
        let deep = root.path().join("a/b/c");
        let synced = create_durable(&deep).unwrap();
        assert_eq!(
            synced,
            vec![
                root.path().join("a/b"),
                root.path().join("a"),
                root.path().to_path_buf()
            ]
        );
        let mode = std::fs::metadata(&deep).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        // Existing: nothing to create, nothing to sync.
        assert!(create_durable(&deep).unwrap().is_empty());
    }
}
