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
