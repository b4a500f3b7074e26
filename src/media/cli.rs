//! `superfluid media`: put images into a running daemon's store, list them,
//! and collect the unreferenced ones. `put` and `gc` are clients of the
//! socket (`PutMedia`, `GcMedia`); `ls` reads the store's directory, which
//! holds nothing but blobs named by their hash.

use std::path::{Path, PathBuf};

use crate::frontend::socket::Client;
use crate::wire::{Request, Response};

use super::{ImageKind, MediaStore, MAX_MEDIA_BYTES};

#[derive(Debug, thiserror::Error)]
pub enum MediaCliError {
    #[error("cannot reach the daemon at {path}: {message}")]
    Connect { path: PathBuf, message: String },
    #[error("{0}")]
    Daemon(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {len} bytes is over the {MAX_MEDIA_BYTES}-byte cap")]
    TooLarge { path: PathBuf, len: u64 },
    #[error("{0}: not a PNG, JPEG, WebP or GIF image")]
    NotAnImage(PathBuf),
    #[error(transparent)]
    Media(#[from] super::MediaError),
}

fn connect(socket: &Path) -> Result<Client, MediaCliError> {
    Client::connect(socket).map_err(|e| MediaCliError::Connect {
        path: socket.to_path_buf(),
        message: e.to_string(),
    })
}

fn call(client: &mut Client, request: &Request) -> Result<Response, MediaCliError> {
    match client.call(request) {
        Ok(Response::Err { message }) => Err(MediaCliError::Daemon(message)),
        Ok(r) => Ok(r),
        Err(e) => Err(MediaCliError::Daemon(e.to_string())),
    }
}

/// `media put FILE...`: one line per file, `<hash>  <file>`.
pub fn put(socket: &Path, files: &[PathBuf], json: bool) -> Result<(), MediaCliError> {
    let mut client = connect(socket)?;
    for path in files {
        let io = |source| MediaCliError::Io {
            path: path.clone(),
            source,
        };
        // The cap is checked on the file's size before its bytes are read.
        let len = std::fs::metadata(path).map_err(io)?.len();
        if len > MAX_MEDIA_BYTES as u64 {
            return Err(MediaCliError::TooLarge {
                path: path.clone(),
                len,
            });
        }
        let bytes = std::fs::read(path).map_err(io)?;
        let kind: ImageKind =
            super::sniff(&bytes).ok_or_else(|| MediaCliError::NotAnImage(path.clone()))?;
        let request = Request::PutMedia {
            bytes,
            mime: kind.mime().into(),
        };
        let Response::Media { hash } = call(&mut client, &request)? else {
            return Err(MediaCliError::Daemon("unexpected reply to PutMedia".into()));
        };
        if json {
            crate::outln!(
                "{}",
                serde_json::json!({"hash": hash, "file": path, "mime": kind.mime(), "bytes": len})
            );
        } else {
            crate::outln!("{hash}  {}", path.display());
        }
    }
    Ok(())
}

/// `media gc`: `kept N, removed M`.
pub fn gc(socket: &Path, json: bool) -> Result<(), MediaCliError> {
    let mut client = connect(socket)?;
    let Response::Gc { kept, removed } = call(&mut client, &Request::GcMedia)? else {
        return Err(MediaCliError::Daemon("unexpected reply to GcMedia".into()));
    };
    if json {
        crate::outln!("{}", serde_json::json!({"kept": kept, "removed": removed}));
    } else {
        crate::outln!("kept {kept}, removed {removed}");
    }
    Ok(())
}

/// `media ls`: every blob with its size and type.
pub fn ls(sessions: &Path, json: bool) -> Result<(), MediaCliError> {
    let store = MediaStore::new(sessions);
    for blob in store.list()? {
        let path = store.dir().join(&blob.hash);
        let mut head = [0u8; 12];
        let n = std::fs::File::open(&path)
            .and_then(|mut f| std::io::Read::read(&mut f, &mut head))
            .unwrap_or(0);
        let mime = super::sniff(&head[..n]).map_or("?", ImageKind::mime);
        let modified = blob
            .modified
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        if json {
            crate::outln!(
                "{}",
                serde_json::json!({"hash": blob.hash, "bytes": blob.size, "mime": mime, "modified_unix_ms": modified})
            );
        } else {
            crate::outln!("{}  {:>10}  {mime}", blob.hash, blob.size);
        }
    }
    Ok(())
}
