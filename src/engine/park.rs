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
//!
//! # Segments (incremental sealing)
//!
//! A later seal of the same session whose tokens extend what is sealed
//! copies only the new cells and writes them as a segment,
//! `<session>.park.<k>` (k = 1, 2, …, at most [`MAX_SEGMENTS`]; then the
//! next seal writes the whole artifact again and the segments go). A
//! segment has the same layout with magic `SFPSEG\0\0`, version 1, and a
//! [`SegmentHeader`]: its first position (`from`), its own token ids, and
//! the sha256 of every token id from 0 to its end, so it only ever extends
//! the exact tokens before it. Each segment is written like an artifact
//! (temp file, fsync, rename, directory fsync). A reader takes the base and
//! then segments 1, 2, … while each one chains on; it stops at the first
//! that is missing or does not (a torn write is never renamed into place;
//! a stale or damaged segment is not used), and restores what chained.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::wire::Token;

pub const MAGIC: &[u8; 8] = b"SFPARK\0\0";
/// A segment's magic ([module docs](self)).
pub const SEG_MAGIC: &[u8; 8] = b"SFPSEG\0\0";
pub const SEG_VERSION: u32 = 1;
/// Segments after a base at most; the next seal writes the whole artifact.
pub const MAX_SEGMENTS: u32 = 16;
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
    #[error("a segment that does not extend what comes before it ({0})")]
    Chain(&'static str),
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

/// A segment's header ([module docs](self)): the cells of positions
/// `from..from + tokens.len()`, after the base's and the earlier segments'.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct SegmentHeader {
    /// As the base's.
    pub kv_type: u32,
    pub model: [u8; 32],
    /// The position of its first token: the tokens before it are the base's
    /// and the earlier segments'.
    pub from: u32,
    /// Its own token ids.
    pub tokens: Vec<Token>,
    /// sha256 of every token id from position 0 to its end: what chains it
    /// to the exact tokens it extends.
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

/// Segment `k` (from 1) of a session's artifact.
pub fn segment_path(dir: &Path, session: u64, k: u32) -> PathBuf {
    dir.join(format!("{session}.park.{k}"))
}

/// The session and number a segment's file name names, if it is one.
pub fn segment_of(path: &Path) -> Option<(u64, u32)> {
    let name = path.file_name()?.to_str()?;
    let (session, k) = name.split_once(".park.")?;
    let k: u32 = k.parse().ok()?;
    (1..=MAX_SEGMENTS).contains(&k).then_some(())?;
    Some((session.parse().ok()?, k))
}

/// The session of an artifact's or a segment's file, if it is one.
fn owner_of(path: &Path) -> Option<u64> {
    session_of(path).or_else(|| segment_of(path).map(|(s, _)| s))
}

/// Deletes a session's artifact and its segments; the paths deleted.
pub fn remove_all(dir: &Path, session: u64) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for p in rd.filter_map(|e| e.ok()).map(|e| e.path()) {
        if owner_of(&p) == Some(session) && std::fs::remove_file(&p).is_ok() {
            out.push(p);
        }
    }
    out
}

/// Deletes a session's segments (not its base); the paths deleted.
fn remove_segments(dir: &Path, session: u64) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for p in rd.filter_map(|e| e.ok()).map(|e| e.path()) {
        if segment_of(&p).is_some_and(|(s, _)| s == session) && std::fs::remove_file(&p).is_ok() {
            out.push(p);
        }
    }
    out
}

/// The temp file an artifact or segment is written to before its rename.
fn tmp_of(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// A finished header archive behind its fixed prefix.
fn frame(magic: &[u8; 8], version: u32, archive: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PREFIX_BYTES + archive.len());
    out.extend_from_slice(magic);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(archive.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(archive).to_le_bytes());
    out.extend_from_slice(archive);
    out
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
    Ok(frame(MAGIC, VERSION, &archive))
}

/// A segment's prefix and header: the cells of positions `from..` holding
/// `own` tokens, after `before` (every token id before `from`).
pub fn encode_segment_head(
    model: &[u8; 32],
    before: &[Token],
    own: &[Token],
    state: &[u8],
    kv_type: u32,
) -> std::io::Result<Vec<u8>> {
    let mut h = Sha256::new();
    for t in before.iter().chain(own) {
        h.update(t.to_le_bytes());
    }
    let head = SegmentHeader {
        kv_type,
        model: *model,
        from: u32::try_from(before.len()).map_err(std::io::Error::other)?,
        tokens: own.to_vec(),
        tokens_digest: h.finalize().into(),
        state_len: state.len() as u64,
        state_digest: Sha256::digest(state).into(),
    };
    let archive = rkyv::to_bytes::<rkyv::rancor::Error>(&head).map_err(std::io::Error::other)?;
    Ok(frame(SEG_MAGIC, SEG_VERSION, &archive))
}

/// Makes `dir` (and its parents) when missing, the last one 0700, as the
/// sessions directory the daemon makes is: what is parked there holds the
/// conversations' tokens.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Writes `head` then `state` crash-safely: temp file, fsync, rename, dir
/// fsync.
fn write_file(path: &Path, head: &[u8], state: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    private_dir(dir)?;
    let tmp = tmp_of(path);
    let written = (|| {
        // The artifact holds the conversation's tokens: the owner's only.
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(head)?;
        f.write_all(state)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        // A full disk, say: the temp file does not stay.
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    File::open(dir)?.sync_all()?;
    Ok(())
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
    write_file(path, &encode_head(model, tokens, state, kv_type)?, state)
}

/// Writes segment `k` of a session's artifact crash-safely (as [`write`]):
/// the cells of `own` tokens after `before`.
#[allow(clippy::too_many_arguments)]
pub fn write_segment(
    dir: &Path,
    session: u64,
    k: u32,
    model: &[u8; 32],
    before: &[Token],
    own: &[Token],
    state: &[u8],
    kv_type: u32,
) -> std::io::Result<()> {
    let head = encode_segment_head(model, before, own, state, kv_type)?;
    write_file(&segment_path(dir, session, k), &head, state)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

/// Reads the fixed prefix and the header archive after it, checked: magic,
/// version, the header's length against the cap and the file, its crc32c.
/// Returns the archive (aligned for rkyv) and the header's length.
fn read_archive(
    f: &mut File,
    file_len: u64,
    magic: &[u8; 8],
    version: u32,
) -> Result<(rkyv::util::AlignedVec<16>, u32), ParkError> {
    let mut prefix = [0u8; PREFIX_BYTES];
    f.read_exact(&mut prefix)
        .map_err(|_| ParkError::Truncated {
            got: file_len,
            want: PREFIX_BYTES as u64,
        })?;
    if &prefix[0..8] != magic {
        return Err(ParkError::Magic);
    }
    let v = u32_at(&prefix, 8);
    if v != version {
        return Err(ParkError::Version(v));
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
    Ok((aligned, h))
}

/// The file holds exactly the prefix, a header of `h` bytes and the state.
fn check_len(file_len: u64, h: u32, state_len: u64) -> Result<(), ParkError> {
    let want = (PREFIX_BYTES as u64 + u64::from(h))
        .checked_add(state_len)
        .ok_or(ParkError::StateLen(state_len))?;
    if file_len != want {
        return Err(ParkError::Truncated {
            got: file_len,
            want,
        });
    }
    Ok(())
}

/// Reads and checks an artifact's header and token ids (not the state):
/// magic, version, the header's length against the file's, the archive
/// (validated before any field is read), KV type (one a cache of type
/// `cache` restores), model, the state's length against the file's, token
/// digest.
pub fn read_head(f: &mut File, model: &[u8; 32], cache: u32) -> Result<Header, ParkError> {
    let file_len = f.metadata()?.len();
    let (aligned, h) = read_archive(f, file_len, MAGIC, VERSION)?;
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
    check_len(file_len, h, head.state_len)?;
    if tokens_digest(&head.tokens) != head.tokens_digest {
        return Err(ParkError::TokenDigest);
    }
    Ok(head)
}

/// Reads and checks a segment's header (not the state) as [`read_head`]
/// does, and that it extends `before` (hashed so far in `digest`) under the
/// base's KV type `kv_type`.
fn read_segment_head(
    f: &mut File,
    model: &[u8; 32],
    kv_type: u32,
    before: usize,
    digest: &Sha256,
) -> Result<SegmentHeader, ParkError> {
    let file_len = f.metadata()?.len();
    let (aligned, h) = read_archive(f, file_len, SEG_MAGIC, SEG_VERSION)?;
    let head = rkyv::from_bytes::<SegmentHeader, rkyv::rancor::Error>(&aligned)
        .map_err(|e| ParkError::Archive(e.to_string()))?;
    if head.kv_type != kv_type {
        return Err(ParkError::Chain("another KV type"));
    }
    if &head.model != model {
        return Err(ParkError::Model);
    }
    if head.from as usize != before || head.tokens.is_empty() {
        return Err(ParkError::Chain("another first position"));
    }
    let total = before.saturating_add(head.tokens.len());
    if total > MAX_TOKENS as usize {
        return Err(ParkError::TooManyTokens(total as u32));
    }
    check_len(file_len, h, head.state_len)?;
    let mut d = digest.clone();
    for t in &head.tokens {
        d.update(t.to_le_bytes());
    }
    if <[u8; 32]>::from(d.finalize()) != head.tokens_digest {
        return Err(ParkError::Chain("other tokens before it"));
    }
    Ok(head)
}

/// Reads a whole artifact: its header, token ids and state, every digest
/// checked; a lossy state comes back expanded to f16.
pub fn read(path: &Path, model: &[u8; 32], cache: u32) -> Result<(Header, Vec<u8>), ParkError> {
    let mut f = File::open(path)?;
    let head = read_head(&mut f, model, cache)?;
    let state = read_state(&mut f, head.state_len, &head.state_digest, head.kv_type)?;
    Ok((head, state))
}

/// Reads a state of `len` bytes and checks its digest; a lossy one comes
/// back expanded to f16.
fn read_state(
    f: &mut File,
    len: u64,
    digest: &[u8; 32],
    kv_type: u32,
) -> Result<Vec<u8>, ParkError> {
    let mut state = vec![0u8; len as usize];
    f.read_exact(&mut state)?;
    let d: [u8; 32] = Sha256::digest(&state).into();
    if &d != digest {
        return Err(ParkError::StateDigest);
    }
    if kv_type == KV_TYPE_F16_AS_Q8 {
        state = super::park_q8::dequantize(&state).map_err(ParkError::Lossy)?;
    }
    Ok(state)
}

/// A part of a chain read whole: its first position and its state.
pub type StatePart = (u32, Vec<u8>);

/// A session's artifact as a reader takes it: the base and the segments
/// that chain on ([module docs](self)).
#[derive(Debug, Clone, PartialEq)]
pub struct Chain {
    /// The base's KV type (every segment's too).
    pub kv_type: u32,
    /// Every token id the base and the segments taken cover.
    pub tokens: Vec<Token>,
    /// Segments taken.
    pub segments: u32,
    /// Why the chain stops before a segment file that is there (a stale or
    /// damaged one), if it does.
    pub stopped: Option<String>,
    /// The base's and each segment's state: (file, first position, offset
    /// and length of the state in the file, its digest).
    parts: Vec<(PathBuf, u32, u64, u64, [u8; 32])>,
}

impl Chain {
    /// The tokens the base alone covers.
    pub fn base_len(&self) -> usize {
        self.parts
            .get(1)
            .map_or(self.tokens.len(), |p| p.1 as usize)
    }
}

/// Reads a session's artifact headers in `dir`: the base (any fault is the
/// error) and the segments that chain on.
pub fn read_chain_heads(
    dir: &Path,
    session: u64,
    model: &[u8; 32],
    cache: u32,
) -> Result<Chain, ParkError> {
    let base = path(dir, session);
    let mut f = File::open(&base)?;
    let head = read_head(&mut f, model, cache)?;
    let mut digest = Sha256::new();
    for t in &head.tokens {
        digest.update(t.to_le_bytes());
    }
    let file_len = f.metadata()?.len();
    let mut chain = Chain {
        kv_type: head.kv_type,
        parts: vec![(
            base,
            0,
            file_len - head.state_len,
            head.state_len,
            head.state_digest,
        )],
        tokens: head.tokens,
        segments: 0,
        stopped: None,
    };
    for k in 1..=MAX_SEGMENTS {
        let p = segment_path(dir, session, k);
        let got = File::open(&p).map_err(ParkError::from).and_then(|mut f| {
            let h = read_segment_head(&mut f, model, chain.kv_type, chain.tokens.len(), &digest)?;
            Ok((h, f.metadata()?.len()))
        });
        match got {
            Ok((h, len)) => {
                for t in &h.tokens {
                    digest.update(t.to_le_bytes());
                }
                chain
                    .parts
                    .push((p, h.from, len - h.state_len, h.state_len, h.state_digest));
                chain.tokens.extend_from_slice(&h.tokens);
                chain.segments = k;
            }
            Err(ParkError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => break,
            Err(e) => {
                chain.stopped = Some(format!("{}: {e}", p.display()));
                break;
            }
        }
    }
    Ok(chain)
}

/// Reads a session's artifact whole: [`read_chain_heads`], then every
/// state it needs for positions `0..len` with its digest checked (a lossy
/// one expanded to f16). The base's state failing is the error; a
/// segment's cuts the chain there (`stopped` says why). Returns the chain
/// and, for each part kept, its first position and state.
pub fn read_chain(
    dir: &Path,
    session: u64,
    model: &[u8; 32],
    cache: u32,
    len: usize,
) -> Result<(Chain, Vec<StatePart>), ParkError> {
    use std::io::{Seek, SeekFrom};
    let mut chain = read_chain_heads(dir, session, model, cache)?;
    let mut states = Vec::new();
    for (i, (p, from, offset, n, digest)) in chain.parts.iter().enumerate() {
        if i > 0 && *from as usize >= len {
            break;
        }
        let got = File::open(p).map_err(ParkError::from).and_then(|mut f| {
            f.seek(SeekFrom::Start(*offset))?;
            read_state(&mut f, *n, digest, chain.kv_type)
        });
        match got {
            Ok(state) => states.push((*from, state)),
            Err(e) if i == 0 => return Err(e),
            Err(e) => {
                chain.stopped = Some(format!("{}: {e}", p.display()));
                chain.tokens.truncate(*from as usize);
                chain.segments = i as u32 - 1;
                chain.parts.truncate(i);
                break;
            }
        }
    }
    Ok((chain, states))
}

/// Deletes the least recently used artifacts (a session's base and
/// segments together, by their latest modification time) in `dir` until
/// they total at most `budget_bytes` (0: unbounded). Returns the paths
/// deleted.
pub fn enforce_budget(dir: &Path, budget_bytes: u64) -> Vec<PathBuf> {
    if budget_bytes == 0 {
        return vec![];
    }
    let Ok(rd) = std::fs::read_dir(dir) else {
        return vec![];
    };
    // Per session: (latest mtime, bytes, files).
    let mut groups: std::collections::HashMap<u64, (std::time::SystemTime, u64, Vec<PathBuf>)> =
        std::collections::HashMap::new();
    for p in rd.filter_map(|e| e.ok()).map(|e| e.path()) {
        let Some(session) = owner_of(&p) else {
            continue;
        };
        let Ok(m) = std::fs::metadata(&p) else {
            continue;
        };
        let Ok(t) = m.modified() else {
            continue;
        };
        let g = groups
            .entry(session)
            .or_insert((std::time::UNIX_EPOCH, 0, Vec::new()));
        g.0 = g.0.max(t);
        g.1 += m.len();
        g.2.push(p);
    }
    let mut groups: Vec<_> = groups.into_values().collect();
    groups.sort();
    let mut total: u64 = groups.iter().map(|g| g.1).sum();
    let mut deleted = Vec::new();
    for (_, len, mut files) in groups {
        if total <= budget_bytes {
            break;
        }
        // The base first: without it the segments are never read.
        files.sort_by_key(|p| segment_of(p).map_or(0, |(_, k)| k));
        for p in files {
            if std::fs::remove_file(&p).is_ok() {
                deleted.push(p);
            }
        }
        total = total.saturating_sub(len);
    }
    deleted
}

/// What the worker knows of a session's artifact, shared with the writer
/// thread: what the next seal may extend.
#[derive(Debug)]
struct Sealed {
    /// Which whole seal (or restore) this chain starts from.
    epoch: u64,
    /// Every token id sealed so far (written or queued).
    tokens: Vec<Token>,
    /// Segments handed to the writer after the base.
    planned: u32,
    /// Segments on disk after the base; None until the base is.
    written: Option<u32>,
}

/// A seal on its way to the writer thread.
enum Job {
    Whole {
        session: u64,
        epoch: u64,
        tokens: Vec<Token>,
        state: Vec<u8>,
    },
    Segment {
        session: u64,
        epoch: u64,
        k: u32,
        tokens: Vec<Token>,
        from: u32,
        state: Vec<u8>,
    },
}

/// How a seal copies the sequence: whole, or the cells from a position on
/// (a segment after what is sealed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SealPlan {
    Whole,
    From(u32),
}

type Chains = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<u64, Sealed>>>;

fn lock(chains: &Chains) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, Sealed>> {
    chains.lock().unwrap_or_else(|e| e.into_inner())
}

/// The worker's side of parking: the directory, the model identity, and a
/// thread that writes artifacts off the request path.
pub struct Parker {
    dir: PathBuf,
    /// The live cache's KV type: what lossless artifacts say they hold.
    cache: u32,
    /// What this writer's artifacts say they hold: `cache`, or
    /// [`KV_TYPE_F16_AS_Q8`] with `--park-lossy`.
    stores: u32,
    model: [u8; 32],
    tx: Option<std::sync::mpsc::SyncSender<Job>>,
    /// Seals copied and not yet written (at most [`PARK_QUEUE`]).
    queued: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    chains: Chains,
    next_epoch: std::cell::Cell<u64>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Sessions whose artifact the budget deleted (the writer thread's).
    deleted: Deleted,
}

/// Seals waiting for the writer thread at most; a seal beyond it is
/// skipped (before its state is copied).
pub const PARK_QUEUE: usize = 2;

/// The writer thread's loop: each seal stored (Q8 for `--park-lossy`,
/// quantized here, never on the worker's request path), then the budget.
/// What the writer thread stores with and where.
struct WriterConfig {
    dir: PathBuf,
    model: [u8; 32],
    cache: u32,
    lossy: bool,
    budget_bytes: u64,
}

/// Sessions whose artifact the budget deleted, not told to the daemon yet.
type Deleted = std::sync::Arc<std::sync::Mutex<Vec<u64>>>;

/// Adds `session` to what the daemon is told its index no longer has.
fn tell_deleted(deleted: &Deleted, session: u64) {
    let mut d = deleted.lock().unwrap_or_else(|e| e.into_inner());
    if !d.contains(&session) {
        d.push(session);
    }
}

fn writer(
    rx: std::sync::mpsc::Receiver<Job>,
    w: WriterConfig,
    queued: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    chains: Chains,
    deleted: Deleted,
) {
    let WriterConfig {
        dir,
        model,
        cache,
        lossy,
        budget_bytes,
    } = w;
    let store = |state: Vec<u8>| match lossy.then(|| super::park_q8::quantize(&state)) {
        Some(Some(q)) => (q, KV_TYPE_F16_AS_Q8),
        Some(None) => {
            log::warn!(
                "--park-lossy: the KV state's layout is not one this build knows; parked as it is"
            );
            (state, cache)
        }
        None => (state, cache),
    };
    for job in rx {
        let t = std::time::Instant::now();
        let (session, epoch, what, result) = match job {
            Job::Whole {
                session,
                epoch,
                tokens,
                state,
            } => {
                let (stored, kv_type) = store(state);
                let p = path(&dir, session);
                let r = write(&p, &model, &tokens, &stored, kv_type).map(|()| {
                    // The old chain's segments no longer extend it.
                    remove_segments(&dir, session);
                    Some(0)
                });
                (
                    session,
                    epoch,
                    format!("{} tokens to {}", tokens.len(), p.display()),
                    r,
                )
            }
            Job::Segment {
                session,
                epoch,
                k,
                tokens,
                from,
                state,
            } => {
                // Only right after the segment before it (or the base), in
                // the same chain, with the base still there.
                let next = lock(&chains)
                    .get(&session)
                    .is_some_and(|c| c.epoch == epoch && c.written == Some(k - 1));
                let extends = next && path(&dir, session).exists();
                let r = if extends {
                    let (stored, kv_type) = store(state);
                    let (before, own) = tokens.split_at(from as usize);
                    write_segment(&dir, session, k, &model, before, own, &stored, kv_type)
                        .map(|()| Some(k))
                } else {
                    // What it extends did not reach the disk, or a newer
                    // seal replaced it: skipped.
                    Ok(None)
                };
                let p = segment_path(&dir, session, k);
                (
                    session,
                    epoch,
                    format!(
                        "{} tokens from {from} to {}",
                        tokens.len() - from as usize,
                        p.display()
                    ),
                    r,
                )
            }
        };
        let mut c = lock(&chains);
        let mine = c.get(&session).is_some_and(|x| x.epoch == epoch);
        match &result {
            &Ok(Some(k)) => {
                log::debug!("parked {what} in {} ms", t.elapsed().as_millis());
                if mine {
                    if let Some(x) = c.get_mut(&session) {
                        x.written = Some(k);
                    }
                } else if k == 0 {
                    // An older whole seal replaced what a newer entry (a
                    // restore) counts on: the next seal is whole again.
                    c.remove(&session);
                }
            }
            Ok(None) => {
                log::debug!("skipped parking {what}: it extends nothing on disk");
            }
            Err(e) => {
                log::warn!("cannot park {what}: {e}");
            }
        }
        // Not on disk as the daemon counts: the next seal writes the whole
        // artifact again, and the daemon's index forgets it (a newer seal
        // of the session on its way tells its own outcome).
        if mine && !matches!(result, Ok(Some(_))) {
            c.remove(&session);
            tell_deleted(&deleted, session);
        }
        drop(c);
        queued.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        for p in enforce_budget(&dir, budget_bytes) {
            log::info!("park budget: deleted {}", p.display());
            // Its chain is gone: the next seal is whole, and the daemon's
            // index forgets the artifact (told with the next decode).
            if let Some(session) = owner_of(&p) {
                lock(&chains).remove(&session);
                tell_deleted(&deleted, session);
            }
        }
    }
}

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
        private_dir(&dir)?;
        // A directory and artifacts an older daemon made with the umask's
        // modes (0755, 0644) become the owner's only.
        if let Err(e) = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)) {
            log::warn!(
                "{}: cannot make it the owner's only ({e}); its artifacts are 0600",
                dir.display()
            );
        }
        // Temp files a killed writer left: never in use, removed.
        for e in std::fs::read_dir(&dir)?.filter_map(|e| e.ok()) {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.ends_with(".tmp") && name.contains(".park") {
                let _ = std::fs::remove_file(e.path());
            } else if name.contains(".park") {
                let _ = std::fs::set_permissions(e.path(), std::fs::Permissions::from_mode(0o600));
            }
        }
        let model = model_identity(gguf)?;
        let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(PARK_QUEUE);
        let queued = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let chains = Chains::default();
        let deleted = Deleted::default();
        let (q, c, d, gone) = (queued.clone(), chains.clone(), dir.clone(), deleted.clone());
        let thread = std::thread::Builder::new()
            .name("park-writer".into())
            .spawn(move || {
                let w = WriterConfig {
                    dir: d,
                    model,
                    cache,
                    lossy,
                    budget_bytes,
                };
                writer(rx, w, q, c, gone)
            })?;
        Ok(Parker {
            dir,
            cache,
            stores: if lossy { KV_TYPE_F16_AS_Q8 } else { cache },
            model,
            tx: Some(tx),
            queued,
            chains,
            next_epoch: std::cell::Cell::new(0),
            thread: Some(thread),
            deleted,
        })
    }

    /// A park of `session` that was not handed to the writer: the daemon,
    /// which counted on it, forgets the artifact (told with the deleted).
    pub fn not_sealed(&self, session: u64) {
        tell_deleted(&self.deleted, session);
    }

    /// Sessions whose artifact the park budget deleted, or whose park was
    /// not sealed ([`Self::not_sealed`]), since the last call.
    pub fn take_deleted(&self) -> Vec<u64> {
        std::mem::take(&mut *self.deleted.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn model(&self) -> &[u8; 32] {
        &self.model
    }

    /// The live cache's KV type.
    pub fn cache(&self) -> u32 {
        self.cache
    }

    /// The directory artifacts live in.
    pub fn dir(&self) -> &Path {
        &self.dir
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

    fn epoch(&self) -> u64 {
        let e = self.next_epoch.get();
        self.next_epoch.set(e + 1);
        e
    }

    /// How to seal `tokens` for `session`: the cells after what is sealed
    /// when they extend it (and the chain has room for a segment), else
    /// whole.
    pub fn plan(&self, session: u64, tokens: &[Token]) -> SealPlan {
        match lock(&self.chains).get(&session) {
            Some(c)
                if c.planned < MAX_SEGMENTS
                    && tokens.len() > c.tokens.len()
                    && tokens.starts_with(&c.tokens) =>
            {
                SealPlan::From(c.tokens.len() as u32)
            }
            _ => SealPlan::Whole,
        }
    }

    /// Hands a whole artifact to the writer thread.
    pub fn seal(&self, session: u64, tokens: Vec<Token>, state: Vec<u8>) -> bool {
        let epoch = self.epoch();
        lock(&self.chains).insert(
            session,
            Sealed {
                epoch,
                tokens: tokens.clone(),
                planned: 0,
                written: None,
            },
        );
        self.send(
            session,
            Job::Whole {
                session,
                epoch,
                tokens,
                state,
            },
        )
    }

    /// Hands a segment to the writer thread: the state of the cells from
    /// `from` ([`Self::plan`]) of a sequence holding `tokens`.
    pub fn seal_from(&self, session: u64, tokens: Vec<Token>, from: u32, state: Vec<u8>) -> bool {
        let (epoch, k) = {
            let mut c = lock(&self.chains);
            let Some(x) = c.get_mut(&session).filter(|x| {
                x.tokens.len() == from as usize
                    && tokens.len() > from as usize
                    && tokens.starts_with(&x.tokens)
            }) else {
                return false;
            };
            x.planned += 1;
            x.tokens = tokens.clone();
            (x.epoch, x.planned)
        };
        self.send(
            session,
            Job::Segment {
                session,
                epoch,
                k,
                tokens,
                from,
                state,
            },
        )
    }

    fn send(&self, session: u64, job: Job) -> bool {
        let Some(tx) = &self.tx else { return false };
        self.queued
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if tx.try_send(job).is_err() {
            self.queued
                .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            lock(&self.chains).remove(&session);
            return false;
        }
        true
    }

    /// A sequence was restored from `session`'s artifact as it is on disk
    /// (`whole`: all of `chain`'s tokens): the next seal may extend it, if
    /// no seal of that session is on its way to the disk (then what is
    /// planned stays), the chain was read whole, and its segments are
    /// stored as this writer stores them. A chain that stopped at a bad
    /// segment makes the next seal whole, which deletes the segments.
    pub fn restored(&self, session: u64, chain: &Chain, whole: bool) {
        let mut c = lock(&self.chains);
        if c.get(&session)
            .is_some_and(|x| x.written != Some(x.planned))
        {
            return;
        }
        if chain.stopped.is_some() || !whole || chain.kv_type != self.stores {
            c.remove(&session);
            return;
        }
        let epoch = self.epoch();
        c.insert(
            session,
            Sealed {
                epoch,
                tokens: chain.tokens.clone(),
                planned: chain.segments,
                written: Some(chain.segments),
            },
        );
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
    fn seg(dir: &Path, k: u32, before: std::ops::Range<u32>, own: std::ops::Range<u32>, fill: u8) {
        let before: Vec<Token> = before.collect();
        let own: Vec<Token> = own.collect();
        write_segment(
            dir,
            7,
            k,
            &[3; 32],
            &before,
            &own,
            &[fill; 300],
            KV_TYPE_F16,
        )
        .unwrap();
    }

    #[test]
    fn segments_chain_on_and_a_stale_or_damaged_one_stops_the_chain() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let model = [3u8; 32];
        let base: Vec<Token> = (0..100).collect();
        write(&path(d, 7), &model, &base, &[1u8; 500], KV_TYPE_F16).unwrap();
        seg(d, 1, 0..100, 100..150, 2);
        seg(d, 2, 0..150, 150..160, 3);
        assert_eq!(segment_of(&segment_path(d, 7, 2)), Some((7, 2)));
        assert_eq!(session_of(&segment_path(d, 7, 2)), None);
        let c = read_chain_heads(d, 7, &model, KV_TYPE_F16).unwrap();
        assert_eq!(c.tokens, (0..160).collect::<Vec<_>>());
        assert_eq!((c.segments, c.stopped.clone()), (2, None));
        let (_, states) = read_chain(d, 7, &model, KV_TYPE_F16, 160).unwrap();
        let got: Vec<(u32, u8, usize)> = states.iter().map(|(f, s)| (*f, s[0], s.len())).collect();
        assert_eq!(got, vec![(0, 1, 500), (100, 2, 300), (150, 3, 300)]);
        // Only the parts positions 0..len need are read.
        let (_, states) = read_chain(d, 7, &model, KV_TYPE_F16, 120).unwrap();
        assert_eq!(states.len(), 2);
        // Another model's or KV type's segment is not taken.
        assert!(read_chain_heads(d, 7, &[4; 32], KV_TYPE_F16).is_err());

        // A stale segment (it extends other tokens) stops the chain.
        seg(d, 3, 1..161, 160..170, 4);
        let c = read_chain_heads(d, 7, &model, KV_TYPE_F16).unwrap();
        assert_eq!((c.tokens.len(), c.segments), (160, 2));
        // `stopped` is "<path>: <error>"; each case names its own error.
        let stopped_by = |c: Chain, e: ParkError| {
            let why = c.stopped.expect("the chain stopped");
            assert!(why.ends_with(&format!(": {e}")), "{why:?} is not {e:?}");
        };
        stopped_by(c, ParkError::Chain("other tokens before it"));
        // So does one that starts elsewhere.
        seg(d, 3, 0..150, 150..170, 4);
        let c = read_chain_heads(d, 7, &model, KV_TYPE_F16).unwrap();
        assert_eq!(c.tokens.len(), 160);
        stopped_by(c, ParkError::Chain("another first position"));
        std::fs::remove_file(segment_path(d, 7, 3)).unwrap();

        // A flipped bit in a segment's header stops the chain before it.
        let p2 = segment_path(d, 7, 2);
        let good = std::fs::read(&p2).unwrap();
        let mut b = good.clone();
        b[PREFIX_BYTES + 3] ^= 1;
        std::fs::write(&p2, &b).unwrap();
        let c = read_chain_heads(d, 7, &model, KV_TYPE_F16).unwrap();
        assert_eq!((c.tokens.len(), c.segments), (150, 1));
        stopped_by(c, ParkError::HeaderCrc);
        // In its state: the headers chain, the states read cut it.
        let mut b = good.clone();
        let last = b.len() - 1;
        b[last] ^= 1;
        std::fs::write(&p2, &b).unwrap();
        assert_eq!(
            read_chain_heads(d, 7, &model, KV_TYPE_F16)
                .unwrap()
                .tokens
                .len(),
            160
        );
        let (c, states) = read_chain(d, 7, &model, KV_TYPE_F16, 160).unwrap();
        assert_eq!((c.tokens.len(), c.segments, states.len()), (150, 1, 2));
        stopped_by(c, ParkError::StateDigest);
        // Cut short: the same.
        std::fs::write(&p2, &good[..good.len() - 10]).unwrap();
        let c = read_chain_heads(d, 7, &model, KV_TYPE_F16).unwrap();
        assert_eq!(c.tokens.len(), 150);
        // A damaged base is the error, whatever the segments.
        let mut b = std::fs::read(path(d, 7)).unwrap();
        let last = b.len() - 1;
        b[last] ^= 1;
        std::fs::write(path(d, 7), &b).unwrap();
        assert!(read_chain(d, 7, &model, KV_TYPE_F16, 160).is_err());
        // remove_all takes the base and every segment, no other session's.
        write(&path(d, 8), &model, &base, &[1u8; 5], KV_TYPE_F16).unwrap();
        let mut gone = remove_all(d, 7);
        gone.sort();
        assert_eq!(
            gone,
            vec![path(d, 7), segment_path(d, 7, 1), segment_path(d, 7, 2)]
        );
        assert!(path(d, 8).exists());
    }

    #[test]
    fn the_budget_counts_a_session_s_segments_with_its_base() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let old = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000);
        for s in [7u64, 9] {
            write(
                &path(d, s),
                &[3; 32],
                &(0..100).collect::<Vec<_>>(),
                &[0u8; 1000],
                KV_TYPE_F16,
            )
            .unwrap();
        }
        seg(d, 1, 0..100, 100..150, 2);
        // Session 7's base is older than 9's, its segment newer: the group
        // counts as recent as its newest file.
        for (p, t) in [
            (path(d, 7), 0),
            (path(d, 9), 10),
            (segment_path(d, 7, 1), 20),
        ] {
            File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(old + std::time::Duration::from_secs(t))
                .unwrap();
        }
        let one = std::fs::metadata(path(d, 9)).unwrap().len();
        assert_eq!(enforce_budget(d, 2 * one), vec![path(d, 9)]);
        // Past the budget again: 7's base and segment go together.
        assert_eq!(
            enforce_budget(d, 10),
            vec![path(d, 7), segment_path(d, 7, 1)]
        );
    }

    #[test]
    fn the_parker_writes_a_segment_for_tokens_that_extend_the_sealed_ones() {
        let dir = tempfile::tempdir().unwrap();
        let gguf = dir.path().join("model.gguf");
        std::fs::write(&gguf, b"not really a model").unwrap();
        let d = dir.path().join("park");
        let p = Parker::new(d.clone(), &gguf, 0, false, KV_TYPE_F16).unwrap();
        let model = *p.model();
        let wait = |f: &Path| {
            let t = std::time::Instant::now();
            while !f.exists() {
                assert!(t.elapsed().as_secs() < 10, "{} never came", f.display());
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        };
        let t: Vec<Token> = (0..100).collect();
        assert_eq!(p.plan(7, &t), SealPlan::Whole);
        assert!(p.seal(7, t.clone(), vec![1; 500]));
        let t2: Vec<Token> = (0..130).collect();
        assert_eq!(p.plan(7, &t2), SealPlan::From(100));
        assert!(p.seal_from(7, t2.clone(), 100, vec![2; 300]));
        wait(&segment_path(&d, 7, 1));
        let c = read_chain_heads(&d, 7, &model, KV_TYPE_F16).unwrap();
        assert_eq!((c.tokens, c.segments), (t2.clone(), 1));
        // Tokens that do not extend it (a rewritten history): whole again,
        // and the old segments go.
        let other: Vec<Token> = (1..140).collect();
        assert_eq!(p.plan(7, &other), SealPlan::Whole);
        assert!(p.seal(7, other.clone(), vec![3; 500]));
        let t = std::time::Instant::now();
        while segment_path(&d, 7, 1).exists() {
            assert!(t.elapsed().as_secs() < 10, "the stale segment stayed");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(
            read_chain_heads(&d, 7, &model, KV_TYPE_F16).unwrap().tokens,
            other
        );
        // After MAX_SEGMENTS segments the next seal is whole.
        let mut n = other.len();
        for _ in 0..MAX_SEGMENTS {
            let more: Vec<Token> = (1..n as u32 + 11).collect();
            let SealPlan::From(from) = p.plan(7, &more) else {
                panic!("a segment")
            };
            while !p.has_room() {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            assert!(p.seal_from(7, more.clone(), from, vec![4; 10]));
            n = more.len();
        }
        let more: Vec<Token> = (1..n as u32 + 11).collect();
        assert_eq!(p.plan(7, &more), SealPlan::Whole);
        drop(p);
        let c = read_chain_heads(&d, 7, &model, KV_TYPE_F16).unwrap();
        assert_eq!((c.tokens.len(), c.segments), (n, MAX_SEGMENTS));
        // A restore of the whole chain lets the next seal extend it.
        let p = Parker::new(d.clone(), &gguf, 0, false, KV_TYPE_F16).unwrap();
        assert_eq!(p.plan(7, &more), SealPlan::Whole);
        let mut shorter = c.clone();
        shorter.segments = 3;
        shorter.tokens.truncate(other.len() + 30);
        p.restored(7, &shorter, true);
        assert_eq!(
            p.plan(7, &more),
            SealPlan::From(shorter.tokens.len() as u32)
        );
        // A chain that stopped at a bad segment, one restored in part, or
        // one stored as another writer stores it: the next seal is whole.
        let mut stopped = shorter.clone();
        stopped.stopped = Some("a bad segment".into());
        let mut lossy = shorter.clone();
        lossy.kv_type = KV_TYPE_F16_AS_Q8;
        for (chain, whole) in [(&stopped, true), (&shorter, false), (&lossy, true)] {
            p.restored(7, &shorter, true);
            assert!(matches!(p.plan(7, &more), SealPlan::From(_)));
            p.restored(7, chain, whole);
            assert_eq!(p.plan(7, &more), SealPlan::Whole);
        }
    }
}
