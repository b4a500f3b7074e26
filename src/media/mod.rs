//! The media store: image bytes referenced by SHA-256 (`PutMedia`,
//! `GcMedia`; the spec's "Images are referenced by SHA-256; their bytes live
//! in <sessions>/media/").
//!
//! A blob is `<sessions>/media/<sha256 hex>`, mode 0600, written as a temp
//! file, fsynced, renamed into place, and the directory fsynced, so a blob
//! that exists is whole. The same bytes put twice are stored once. Sans-IO
//! parts ([`sniff`], [`check_put`], [`gc_plan`]) are plain functions; the
//! [`MediaStore`] does the file work and is called off the actor thread.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};

pub mod cli;

/// The largest blob `PutMedia` takes (documented in docs/media.md). A
/// socket frame holds it (64 MiB); over /web/rpc the 16 MiB body cap, with
/// bytes as a JSON array of numbers, limits an image to about 4 MiB.
pub const MAX_MEDIA_BYTES: usize = 20 << 20;

/// A blob put but not yet referenced by any session survives `GcMedia` for
/// this long, so a client's `PutMedia` then `AppendImage` cannot lose the
/// race against a collection run between them.
pub const GC_GRACE: Duration = Duration::from_secs(3600);

/// The image types the store takes, sniffed from the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    Png,
    Jpeg,
    Webp,
    Gif,
}

impl ImageKind {
    pub fn mime(self) -> &'static str {
        match self {
            ImageKind::Png => "image/png",
            ImageKind::Jpeg => "image/jpeg",
            ImageKind::Webp => "image/webp",
            ImageKind::Gif => "image/gif",
        }
    }

    /// The kind a declared MIME type names (`image/jpg` is taken for JPEG,
    /// as browsers do); parameters after `;` and case are ignored.
    pub fn from_mime(mime: &str) -> Option<ImageKind> {
        let base = mime.split(';').next().unwrap_or("").trim();
        match base.to_ascii_lowercase().as_str() {
            "image/png" => Some(ImageKind::Png),
            "image/jpeg" | "image/jpg" => Some(ImageKind::Jpeg),
            "image/webp" => Some(ImageKind::Webp),
            "image/gif" => Some(ImageKind::Gif),
            _ => None,
        }
    }
}

/// The image type the bytes' signature says, if any.
pub fn sniff(bytes: &[u8]) -> Option<ImageKind> {
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some(ImageKind::Png)
    } else if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Some(ImageKind::Jpeg)
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Some(ImageKind::Webp)
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Some(ImageKind::Gif)
    } else {
        None
    }
}

/// Why a blob was refused.
#[derive(Debug, thiserror::Error)]
pub enum MediaError {
    #[error("PutMedia: {len} bytes is over the {max}-byte cap")]
    TooLarge { len: usize, max: usize },
    #[error("PutMedia: empty bytes")]
    Empty,
    #[error("PutMedia: mime {0:?} is not one of image/png, image/jpeg, image/webp, image/gif")]
    UnknownMime(String),
    #[error("PutMedia: the bytes are not an image (no PNG, JPEG, WebP or GIF signature)")]
    NotAnImage,
    #[error("PutMedia: the bytes are {found}, not the declared {declared}")]
    Mismatch {
        declared: &'static str,
        found: &'static str,
    },
    #[error("media blob {0:?} is not a sha256 hex name")]
    BadHash(String),
    #[error("media blob {0} is not in the store")]
    Missing(String),
    #[error("media blob {0} no longer matches its hash; it is never used")]
    Corrupt(String),
    #[error("media store {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Checks a `PutMedia` before any file work: the cap, the declared type,
/// and that the bytes are an image of that type.
pub fn check_put(bytes: &[u8], mime: &str) -> Result<ImageKind, MediaError> {
    if bytes.len() > MAX_MEDIA_BYTES {
        return Err(MediaError::TooLarge {
            len: bytes.len(),
            max: MAX_MEDIA_BYTES,
        });
    }
    if bytes.is_empty() {
        return Err(MediaError::Empty);
    }
    let declared =
        ImageKind::from_mime(mime).ok_or_else(|| MediaError::UnknownMime(mime.into()))?;
    let found = sniff(bytes).ok_or(MediaError::NotAnImage)?;
    if found != declared {
        return Err(MediaError::Mismatch {
            declared: declared.mime(),
            found: found.mime(),
        });
    }
    Ok(found)
}

/// The lowercase hex SHA-256 of `bytes`: a blob's name.
pub fn hash_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Whether `name` is a blob name (64 lowercase hex digits): the only names
/// the store opens, so a hash from a client can never name another path.
pub fn is_hash(name: &str) -> bool {
    name.len() == 64 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// One blob on disk, as `GcMedia` sees it.
#[derive(Debug, Clone)]
pub struct Blob {
    pub hash: String,
    pub modified: SystemTime,
    pub size: u64,
}

/// Which blobs a collection removes: those no live session references,
/// put longer than [`GC_GRACE`] ago. Returns (kept, removed).
pub fn gc_plan(
    blobs: &[Blob],
    referenced: &HashSet<String>,
    now: SystemTime,
) -> (Vec<Blob>, Vec<Blob>) {
    blobs.iter().cloned().partition(|b| {
        referenced.contains(&b.hash)
            || now
                .duration_since(b.modified)
                .map(|age| age < GC_GRACE)
                .unwrap_or(true)
    })
}

/// The blobs under `<sessions>/media/`.
#[derive(Debug, Clone)]
pub struct MediaStore {
    dir: PathBuf,
}

impl MediaStore {
    /// The store under `sessions`; the directory is made on first put.
    pub fn new(sessions: &Path) -> MediaStore {
        MediaStore {
            dir: sessions.join("media"),
        }
    }

    /// The store in `dir` itself (the worker, given `--media-dir`).
    pub fn at(dir: &Path) -> MediaStore {
        MediaStore {
            dir: dir.to_path_buf(),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn io(&self, path: &Path) -> impl FnOnce(std::io::Error) -> MediaError {
        let path = path.to_path_buf();
        move |source| MediaError::Io { path, source }
    }

    /// `PutMedia`: checks the bytes, stores them once under their hash.
    pub fn put(&self, bytes: &[u8], mime: &str) -> Result<String, MediaError> {
        check_put(bytes, mime)?;
        let hash = hash_hex(bytes);
        let path = self.dir.join(&hash);
        if let Ok(existing) = self.read_checked(&hash) {
            // Stored already, and whole: the same bytes are kept once. The
            // put restarts its grace period, so a GcMedia between this put
            // and its AppendImage cannot take it.
            drop(existing);
            if let Ok(f) = OpenOptions::new().write(true).open(&path) {
                let _ = f.set_modified(SystemTime::now());
            }
            return Ok(hash);
        }
        crate::store::dirs::create_durable(&self.dir).map_err(|e| MediaError::Io {
            path: self.dir.clone(),
            source: std::io::Error::other(e.to_string()),
        })?;
        let tmp = self.dir.join(format!(".{hash}.{}.tmp", std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
            fs::rename(&tmp, &path)?;
            File::open(&self.dir)?.sync_all()
        };
        if let Err(e) = write() {
            let _ = fs::remove_file(&tmp);
            return Err(MediaError::Io { path, source: e });
        }
        Ok(hash)
    }

    /// A blob's bytes, refused unless they still hash to its name: a
    /// bit-flipped blob is never fed to the model.
    pub fn read_checked(&self, hash: &str) -> Result<Vec<u8>, MediaError> {
        if !is_hash(hash) {
            return Err(MediaError::BadHash(hash.into()));
        }
        let path = self.dir.join(hash);
        let mut bytes = Vec::new();
        match File::open(&path) {
            Ok(f) => f
                .take(MAX_MEDIA_BYTES as u64 + 1)
                .read_to_end(&mut bytes)
                .map_err(self.io(&path))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(MediaError::Missing(hash.into()))
            }
            Err(e) => return Err(MediaError::Io { path, source: e }),
        };
        if hash_hex(&bytes) != hash {
            return Err(MediaError::Corrupt(hash.into()));
        }
        Ok(bytes)
    }

    /// Every blob in the store (temp files and foreign names skipped).
    pub fn list(&self) -> Result<Vec<Blob>, MediaError> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => {
                return Err(MediaError::Io {
                    path: self.dir.clone(),
                    source: e,
                })
            }
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(self.io(&self.dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !is_hash(&name) {
                continue;
            }
            let meta = entry.metadata().map_err(self.io(&entry.path()))?;
            if !meta.is_file() {
                continue;
            }
            out.push(Blob {
                hash: name,
                modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                size: meta.len(),
            });
        }
        out.sort_by(|a, b| a.hash.cmp(&b.hash));
        Ok(out)
    }

    /// `GcMedia`: removes the blobs [`gc_plan`] picks; answers (kept, removed).
    pub fn gc(&self, referenced: &HashSet<String>) -> Result<(u64, u64), MediaError> {
        let blobs = self.list()?;
        let (kept, removed) = gc_plan(&blobs, referenced, SystemTime::now());
        for b in &removed {
            let path = self.dir.join(&b.hash);
            match fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(MediaError::Io { path, source: e }),
            }
        }
        if !removed.is_empty() {
            File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(self.io(&self.dir))?;
        }
        Ok((kept.len() as u64, removed.len() as u64))
    }

    /// A blob's mode (for tests and `media ls`).
    pub fn mode(&self, hash: &str) -> Option<u32> {
        is_hash(hash)
            .then(|| fs::metadata(self.dir.join(hash)).ok())
            .flatten()
            .map(|m| m.permissions().mode() & 0o777)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PNG: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR";
    const JPEG: &[u8] = &[0xFF, 0xD8, 0xFF, 0xE0, 0, 0x10, b'J', b'F', b'I', b'F'];

    #[test]
    fn sniffs_the_four_types_and_nothing_else() {
        assert_eq!(sniff(PNG), Some(ImageKind::Png));
        assert_eq!(sniff(JPEG), Some(ImageKind::Jpeg));
        assert_eq!(sniff(b"RIFF\0\0\0\0WEBPVP8 "), Some(ImageKind::Webp));
        assert_eq!(sniff(b"GIF89a\x01\0"), Some(ImageKind::Gif));
        assert_eq!(sniff(b"RIFF\0\0\0\0WAVE"), None);
        assert_eq!(sniff(b"<svg xmlns="), None);
        assert_eq!(sniff(b""), None);
    }

    #[test]
    fn a_put_is_checked_before_any_file_work() {
        assert!(matches!(check_put(PNG, "image/png"), Ok(ImageKind::Png)));
        assert!(matches!(check_put(JPEG, "IMAGE/JPG"), Ok(ImageKind::Jpeg)));
        assert!(matches!(
            check_put(PNG, "image/jpeg"),
            Err(MediaError::Mismatch { .. })
        ));
        assert!(matches!(
            check_put(b"hello", "image/png"),
            Err(MediaError::NotAnImage)
        ));
        assert!(matches!(
            check_put(PNG, "text/plain"),
            Err(MediaError::UnknownMime(_))
        ));
        assert!(matches!(
            check_put(b"", "image/png"),
            Err(MediaError::Empty)
        ));
        let big = [PNG, &vec![0u8; MAX_MEDIA_BYTES]].concat();
        assert!(matches!(
            check_put(&big, "image/png"),
            Err(MediaError::TooLarge { .. })
        ));
    }

    #[test]
    fn blobs_are_stored_once_0600_and_refused_when_flipped() {
        let root = tempfile::tempdir().unwrap();
        let store = MediaStore::new(root.path());
        let h = store.put(PNG, "image/png").unwrap();
        assert_eq!(h, hash_hex(PNG));
        assert_eq!(store.put(PNG, "image/png").unwrap(), h);
        assert_eq!(store.list().unwrap().len(), 1);
        assert_eq!(store.mode(&h), Some(0o600));
        assert_eq!(store.read_checked(&h).unwrap(), PNG);
        // No temp file left behind.
        assert_eq!(fs::read_dir(store.dir()).unwrap().count(), 1);
        let path = store.dir().join(&h);
        let mut bytes = fs::read(&path).unwrap();
        bytes[3] ^= 1;
        fs::write(&path, &bytes).unwrap();
        assert!(matches!(
            store.read_checked(&h),
            Err(MediaError::Corrupt(_))
        ));
        // A put of the good bytes again repairs the blob.
        store.put(PNG, "image/png").unwrap();
        assert_eq!(store.read_checked(&h).unwrap(), PNG);
        assert!(matches!(
            store.read_checked("../wal.log"),
            Err(MediaError::BadHash(_))
        ));
        assert!(matches!(
            store.read_checked(&"0".repeat(64)),
            Err(MediaError::Missing(_))
        ));
    }

    #[test]
    fn gc_keeps_referenced_and_recent_blobs() {
        let now = SystemTime::now();
        let old = now - GC_GRACE - Duration::from_secs(1);
        let blob = |h: &str, t| Blob {
            hash: h.into(),
            modified: t,
            size: 1,
        };
        let blobs = [blob("a", old), blob("b", old), blob("c", now)];
        let referenced: HashSet<String> = ["a".to_string()].into();
        let (kept, removed) = gc_plan(&blobs, &referenced, now);
        let names = |v: &[Blob]| v.iter().map(|b| b.hash.clone()).collect::<Vec<_>>();
        assert_eq!(names(&kept), ["a", "c"]);
        assert_eq!(names(&removed), ["b"]);
    }
}
