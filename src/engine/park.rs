//! Park artifacts (`--park`): a session's KV sealed to
//! `<sessions>/park/<session>.park`, restored by the next generation on that
//! session instead of a prefill, across restarts.
//!
//! # Layout (version 2, little endian; docs/kv-tiers.md)
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `SFPARK\0\0` |
//! | 8 | 4 | version (2) |
//! | 12 | 4 | header length `h` |
//! | 16 | 4 | crc32c of the header |
//! | 20 | h | the header, an rkyv archive of [`Header`]: KV type, model identity (sha256 of the GGUF's size and first MiB), the token ids, their sha256, the state's length and its sha256 |
//! | 20+h | m | llama.cpp's per-sequence state (`state_seq_get_data_ext`) |
//!
//! An artifact is written to a temp file beside it, fsynced, renamed over
//! the old one and the directory fsynced, so a reader sees the previous
//! artifact or the new one, never half of one. A reader checks every field
//! and both digests before llama.cpp sees a byte: anything else (another
//! model, a truncated file, a flipped bit) is refused, and the generation
//! prefills instead.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::wire::Token;

pub const MAGIC: &[u8; 8] = b"SFPARK\0\0";
/// 2: the header is an rkyv archive (1, before it, was fixed fields).
pub const VERSION: u32 = 2;
/// The KV cache's type as llama.cpp's `ggml_type` names it: f16.
pub const KV_TYPE_F16: u32 = 1;
/// `--park-lossy`: an f16 cache's state stored with its rows as Q8_0
/// blocks (`park_q8`), expanded back to f16 when read.
pub const KV_TYPE_F16_AS_Q8: u32 = 2;
/// `--kv-bits 8`: a Q8_0 cache's state, as it is (ggml's type id).
pub const KV_TYPE_Q8_0: u32 = 8;

/// The artifact KV types a cache of `cache` type (`KV_TYPE_F16` or
/// `KV_TYPE_Q8_0`) can restore.
pub fn restorable(cache: u32, artifact: u32) -> bool {
    match cache {
        KV_TYPE_F16 => artifact == KV_TYPE_F16 || artifact == KV_TYPE_F16_AS_Q8,
        other => artifact == other,
    }
}
/// The fixed prefix before the header: magic, version, header length, the
/// header's crc32c (so a flipped bit in the archive's padding is refused
/// too).
pub const PREFIX_BYTES: usize = 20;
/// The most tokens an artifact may name (llama.cpp's own context limit).
pub const MAX_TOKENS: u32 = 1 << 20;
/// The longest header a reader accepts (checked before it is read): the
/// token ids at [`MAX_TOKENS`] and the fixed fields, with room to spare.
pub const MAX_HEADER_BYTES: u32 = 4 * MAX_TOKENS + 4096;
/// What the model identity digest reads of the GGUF.
const IDENTITY_BYTES: u64 = 1 << 20;

/// Why an artifact was refused.
#[derive(Debug, thiserror::Error)]
pub enum ParkError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("not a park artifact (bad magic)")]
    Magic,
    #[error("park format version {0}, this build reads {VERSION}")]
    Version(u32),
    #[error("KV type {0}, not one this cache (KV type {1}) restores")]
    KvType(u32, u32),
    #[error("{0}")]
    Lossy(String),
    #[error("sealed for another model")]
    Model,
    #[error("{0} tokens is more than {MAX_TOKENS}")]
    TooManyTokens(u32),
    #[error("a header of {0} bytes (at most {MAX_HEADER_BYTES}, and within the file)")]
    HeaderLen(u32),
    #[error("the header does not match its crc32c")]
    HeaderCrc,
    #[error("the header is not a valid archive: {0}")]
    Archive(String),
    #[error("a state of {0} bytes")]
    StateLen(u64),
    #[error("the file is {got} bytes, the header says {want}")]
    Truncated { got: u64, want: u64 },
    #[error("the token ids do not match their digest")]
    TokenDigest,
    #[error("the state does not match its digest")]
    StateDigest,
}

/// An artifact's header (and the token ids it covers), stored as an rkyv
/// archive after the fixed prefix and validated (bytecheck) when read.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Header {
    /// How the state is stored: [`KV_TYPE_F16`], [`KV_TYPE_F16_AS_Q8`] or
    /// [`KV_TYPE_Q8_0`].
    pub kv_type: u32,
    pub model: [u8; 32],
    pub tokens: Vec<Token>,
    pub tokens_digest: [u8; 32],
    pub state_len: u64,
    pub state_digest: [u8; 32],
}

/// The model identity the header carries: sha256 of the GGUF's size and
/// its first MiB (cheap, and changes with any other model file).
pub fn model_identity(gguf: &Path) -> std::io::Result<[u8; 32]> {
    let mut f = File::open(gguf)?;
    let size = f.metadata()?.len();
    let mut h = Sha256::new();
    h.update(size.to_le_bytes());
    let mut head = Vec::new();
    (&mut f).take(IDENTITY_BYTES).read_to_end(&mut head)?;
    h.update(&head);
    Ok(h.finalize().into())
}

fn tokens_digest(tokens: &[Token]) -> [u8; 32] {
    let mut h = Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// The artifact's path for a session.
pub fn path(dir: &Path, session: u64) -> PathBuf {
    dir.join(format!("{session}.park"))
}

/// The session an artifact's file name names, if it is one.
pub fn session_of(path: &Path) -> Option<u64> {
    if path.extension()? != "park" {
        return None;
    }
    path.file_stem()?.to_str()?.parse().ok()
}

/// The prefix and header, as written.
pub fn encode_head(
    model: &[u8; 32],
    tokens: &[Token],
    state: &[u8],
    kv_type: u32,
) -> std::io::Result<Vec<u8>> {
    let head = Header {
        kv_type,
        model: *model,
        tokens: tokens.to_vec(),
        tokens_digest: tokens_digest(tokens),
        state_len: state.len() as u64,
        state_digest: Sha256::digest(state).into(),
    };
    let archive = rkyv::to_bytes::<rkyv::rancor::Error>(&head).map_err(std::io::Error::other)?;
    let mut out = Vec::with_capacity(PREFIX_BYTES + archive.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(archive.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(&archive).to_le_bytes());
    out.extend_from_slice(&archive);
    Ok(out)
}

/// Writes an artifact crash-safely: temp file, fsync, rename, dir fsync.
/// `state` is stored as `kv_type` says it is.
pub fn write(
    path: &Path,
    model: &[u8; 32],
    tokens: &[Token],
    state: &[u8],
    kv_type: u32,
) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension("park.tmp");
    {
        let mut f = File::create(&tmp)?;
        f.write_all(&encode_head(model, tokens, state, kv_type)?)?;
        f.write_all(state)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    File::open(dir)?.sync_all()?;
    Ok(())
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

/// Reads and checks an artifact's header and token ids (not the state):
/// magic, version, the header's length against the file's, the archive
/// (validated before any field is read), KV type (one a cache of type
/// `cache` restores), model, the state's length against the file's, token
/// digest.
pub fn read_head(f: &mut File, model: &[u8; 32], cache: u32) -> Result<Header, ParkError> {
    let file_len = f.metadata()?.len();
    let mut prefix = [0u8; PREFIX_BYTES];
    f.read_exact(&mut prefix)
        .map_err(|_| ParkError::Truncated {
            got: file_len,
            want: PREFIX_BYTES as u64,
        })?;
    if &prefix[0..8] != MAGIC {
        return Err(ParkError::Magic);
    }
    let version = u32_at(&prefix, 8);
    if version != VERSION {
        return Err(ParkError::Version(version));
    }
    let h = u32_at(&prefix, 12);
    // Sizes are checked against the caps and the file before anything is
    // allocated.
    if h > MAX_HEADER_BYTES || PREFIX_BYTES as u64 + u64::from(h) > file_len {
        return Err(ParkError::HeaderLen(h));
    }
    let mut raw = vec![0u8; h as usize];
    f.read_exact(&mut raw)?;
    if crc32c::crc32c(&raw) != u32_at(&prefix, 16) {
        return Err(ParkError::HeaderCrc);
    }
    let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(raw.len());
    aligned.extend_from_slice(&raw);
    let head = rkyv::from_bytes::<Header, rkyv::rancor::Error>(&aligned)
        .map_err(|e| ParkError::Archive(e.to_string()))?;
    if !restorable(cache, head.kv_type) {
        return Err(ParkError::KvType(head.kv_type, cache));
    }
    if &head.model != model {
        return Err(ParkError::Model);
    }
    if head.tokens.len() > MAX_TOKENS as usize {
        return Err(ParkError::TooManyTokens(head.tokens.len() as u32));
    }
    let want = (PREFIX_BYTES as u64 + u64::from(h))
        .checked_add(head.state_len)
        .ok_or(ParkError::StateLen(head.state_len))?;
    if file_len != want {
        return Err(ParkError::Truncated {
            got: file_len,
            want,
        });
    }
    if tokens_digest(&head.tokens) != head.tokens_digest {
        return Err(ParkError::TokenDigest);
    }
    Ok(head)
}

/// Reads a whole artifact: its header, token ids and state, every digest
/// checked; a lossy state comes back expanded to f16.
pub fn read(path: &Path, model: &[u8; 32], cache: u32) -> Result<(Header, Vec<u8>), ParkError> {
    let mut f = File::open(path)?;
    let head = read_head(&mut f, model, cache)?;
    let mut state = vec![0u8; head.state_len as usize];
    f.read_exact(&mut state)?;
    let d: [u8; 32] = Sha256::digest(&state).into();
    if d != head.state_digest {
        return Err(ParkError::StateDigest);
    }
    if head.kv_type == KV_TYPE_F16_AS_Q8 {
        state = super::park_q8::dequantize(&state).map_err(ParkError::Lossy)?;
    }
    Ok((head, state))
}

/// Deletes the least recently used artifacts (by modification time) in
/// `dir` until they total at most `budget_bytes` (0: unbounded). Returns
/// the paths deleted.
pub fn enforce_budget(dir: &Path, budget_bytes: u64) -> Vec<PathBuf> {
    if budget_bytes == 0 {
        return vec![];
    }
    let Ok(rd) = std::fs::read_dir(dir) else {
        return vec![];
    };
    let mut files: Vec<(std::time::SystemTime, u64, PathBuf)> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| session_of(p).is_some())
        .filter_map(|p| {
            let m = std::fs::metadata(&p).ok()?;
            Some((m.modified().ok()?, m.len(), p))
        })
        .collect();
    files.sort();
    let mut total: u64 = files.iter().map(|f| f.1).sum();
    let mut deleted = Vec::new();
    for (_, len, p) in files {
        if total <= budget_bytes {
            break;
        }
        if std::fs::remove_file(&p).is_ok() {
            total -= len;
            deleted.push(p);
        }
    }
    deleted
}

/// An artifact on its way to the writer: its path, token ids and state.
type Sealed = (PathBuf, Vec<Token>, Vec<u8>);

/// The worker's side of parking: the directory, the model identity, and a
/// thread that writes artifacts off the request path.
pub struct Parker {
    dir: PathBuf,
    /// The live cache's KV type: what lossless artifacts say they hold.
    cache: u32,
    model: [u8; 32],
    tx: Option<std::sync::mpsc::SyncSender<Sealed>>,
    /// Artifacts copied and not yet written (at most [`PARK_QUEUE`]).
    queued: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Artifacts waiting for the writer thread at most; a seal beyond it is
/// skipped (before its state is copied).
pub const PARK_QUEUE: usize = 2;

impl Parker {
    /// Parks into `dir` (created), for the model at `gguf`, keeping the
    /// directory within `budget_bytes` (0: unbounded); `lossy`
    /// (`--park-lossy`) stores the states as Q8_0.
    pub fn new(
        dir: PathBuf,
        gguf: &Path,
        budget_bytes: u64,
        lossy: bool,
        cache: u32,
    ) -> std::io::Result<Parker> {
        // Only an f16 cache's rows are stored as Q8_0.
        let lossy = lossy && cache == KV_TYPE_F16;
        std::fs::create_dir_all(&dir)?;
        // Temp files a killed writer left: never in use, removed.
        for e in std::fs::read_dir(&dir)?.filter_map(|e| e.ok()) {
            if e.file_name().to_string_lossy().ends_with(".park.tmp") {
                let _ = std::fs::remove_file(e.path());
            }
        }
        let model = model_identity(gguf)?;
        let (tx, rx) = std::sync::mpsc::sync_channel::<Sealed>(PARK_QUEUE);
        let queued = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let q = queued.clone();
        let d = dir.clone();
        let thread = std::thread::Builder::new()
            .name("park-writer".into())
            .spawn(move || {
                for (path, tokens, state) in rx {
                    let t = std::time::Instant::now();
                    // Quantized here, on the writer thread: never on the
                    // worker's request path.
                    let (stored, kv_type) = match lossy.then(|| super::park_q8::quantize(&state)) {
                        Some(Some(q)) => (q, KV_TYPE_F16_AS_Q8),
                        Some(None) => {
                            log::warn!(
                                "--park-lossy: the KV state's layout is not one this build \
                                 knows; parked as it is"
                            );
                            (state, cache)
                        }
                        None => (state, cache),
                    };
                    match write(&path, &model, &tokens, &stored, kv_type) {
                        Ok(()) => log::debug!(
                            "parked {} tokens ({} bytes{}) to {} in {} ms",
                            tokens.len(),
                            stored.len(),
                            if kv_type == KV_TYPE_F16_AS_Q8 {
                                ", Q8"
                            } else {
                                ""
                            },
                            path.display(),
                            t.elapsed().as_millis()
                        ),
                        Err(e) => log::warn!("cannot park to {}: {e}", path.display()),
                    }
                    q.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    for p in enforce_budget(&d, budget_bytes) {
                        log::info!("park budget: deleted {}", p.display());
                    }
                }
            })?;
        Ok(Parker {
            dir,
            cache,
            model,
            tx: Some(tx),
            queued,
            thread: Some(thread),
        })
    }

    pub fn model(&self) -> &[u8; 32] {
        &self.model
    }

    /// The live cache's KV type.
    pub fn cache(&self) -> u32 {
        self.cache
    }

    /// The artifact path of a session.
    pub fn path(&self, session: u64) -> PathBuf {
        path(&self.dir, session)
    }

    /// Whether the writer has room for one more artifact (checked before
    /// the state is copied).
    pub fn has_room(&self) -> bool {
        self.queued.load(std::sync::atomic::Ordering::SeqCst) < PARK_QUEUE
    }

    /// Hands an artifact to the writer thread.
    pub fn seal(&self, session: u64, tokens: Vec<Token>, state: Vec<u8>) -> bool {
        let Some(tx) = &self.tx else { return false };
        self.queued
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if tx.try_send((self.path(session), tokens, state)).is_err() {
            self.queued
                .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            return false;
        }
        true
    }
}

impl Drop for Parker {
    /// Artifacts handed over are written before the worker exits.
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for Parker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parker")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_corruption_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = path(dir.path(), 7);
        assert_eq!(session_of(&p), Some(7));
        let model = [3u8; 32];
        let tokens: Vec<Token> = (0..100).collect();
        let state: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        write(&p, &model, &tokens, &state, KV_TYPE_F16).unwrap();
        let (h, s) = read(&p, &model, KV_TYPE_F16).unwrap();
        assert_eq!(h.tokens, tokens);
        assert_eq!(s, state);
        assert!(matches!(
            read(&p, &[4u8; 32], KV_TYPE_F16),
            Err(ParkError::Model)
        ));
        let bytes = std::fs::read(&p).unwrap();
        // A flipped bit anywhere is refused: every byte of the prefix and
        // the header, and the state's first and last.
        let head_end = bytes.len() - state.len();
        for at in (0..head_end).chain([head_end, bytes.len() - 1]) {
            let mut b = bytes.clone();
            b[at] ^= 1;
            std::fs::write(&p, &b).unwrap();
            assert!(
                read(&p, &model, KV_TYPE_F16).is_err(),
                "bit flipped at {at}"
            );
        }
        // So is a truncated or extended file.
        for len in [0, 10, PREFIX_BYTES, PREFIX_BYTES + 100, bytes.len() - 1] {
            std::fs::write(&p, &bytes[..len]).unwrap();
            assert!(read(&p, &model, KV_TYPE_F16).is_err(), "cut at {len}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        std::fs::write(&p, &longer).unwrap();
        assert!(matches!(
            read(&p, &model, KV_TYPE_F16),
            Err(ParkError::Truncated { .. })
        ));
    }

    #[test]
    fn the_budget_deletes_the_least_recently_used() {
        let dir = tempfile::tempdir().unwrap();
        for s in 0..4u64 {
            write(
                &path(dir.path(), s),
                &[0; 32],
                &[1, 2],
                &[0u8; 1000],
                KV_TYPE_F16,
            )
            .unwrap();
            let t = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000 + s);
            File::options()
                .write(true)
                .open(path(dir.path(), s))
                .unwrap()
                .set_modified(t)
                .unwrap();
        }
        let one = std::fs::metadata(path(dir.path(), 0)).unwrap().len();
        let deleted = enforce_budget(dir.path(), 2 * one);
        assert_eq!(deleted, vec![path(dir.path(), 0), path(dir.path(), 1)]);
        assert!(enforce_budget(dir.path(), 0).is_empty());
    }
}
