//! Fetching a reference's files from the Hugging Face hub into the
//! huggingface_hub cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`) with the `hf-hub` crate: resumed after an
//! interruption (the `.part` file is kept and continued), checked against
//! the hub's SHA-256 before use, progress drawn on a terminal or printed as
//! lines. `$HF_ENDPOINT` names another hub, `$HF_TOKEN` (or the cache's
//! `token` file) is sent for gated repos, and `$HF_HUB_OFFLINE=1` (or an
//! unreachable hub) resolves from the cache alone.

use std::io::{IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::api::Progress;
use hf_hub::{Cache, Repo};
use serde_json::Value;

use super::{choose, quant_of, Chosen, ModelRef, Pick, RefError};

/// Why a reference could not be made a file on disk.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(transparent)]
    Ref(#[from] RefError),
    #[error("{reference}: the hub refused access ({status}): the repo is gated or private; set HF_TOKEN to a token that may read it (https://huggingface.co/settings/tokens)")]
    Gated { reference: String, status: u16 },
    #[error("{reference}: the hub has no such repo or file (404)")]
    NotFound { reference: String },
    #[error("{reference}: offline (HF_HUB_OFFLINE) and not in the cache {cache}")]
    NotCached { reference: String, cache: PathBuf },
    #[error("{reference}: cannot reach the hub ({reason}) and it is not in the cache")]
    Unreachable { reference: String, reason: String },
    #[error("{file}: its SHA-256 is {got}, the hub says {want}; the download was removed")]
    Digest {
        file: String,
        got: String,
        want: String,
    },
    #[error("{reference}: {reason}")]
    Other { reference: String, reason: String },
    #[error("model file not found: {}", .0.display())]
    NoFile(PathBuf),
}

/// A reference made files on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The model's file (the first part of a split set; the others lie
    /// beside it, as llama.cpp expects).
    pub model: PathBuf,
    /// Every file fetched for it (model parts, projector).
    pub files: Vec<PathBuf>,
    /// The vision projector, when the repo has one.
    pub mmproj: Option<PathBuf>,
}

/// The hub cache: `$HF_HUB_CACHE`, else hf-hub's (`$HF_HOME/hub`, else
/// `~/.cache/huggingface/hub`).
pub fn cache() -> Cache {
    match std::env::var_os("HF_HUB_CACHE") {
        Some(p) if !p.is_empty() => Cache::new(PathBuf::from(p)),
        _ => Cache::from_env(),
    }
}

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .map(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        })
        .unwrap_or(false)
}

/// Makes each download's progress report: given the file's name and the
/// hub's SHA-256 of it.
pub type ProgressFactory<'a> = &'a dyn Fn(&str, Option<&str>) -> Box<dyn Progress>;

/// A boxed progress, for hf-hub's generic download.
struct Boxed(Box<dyn Progress>);

impl Progress for Boxed {
    fn init(&mut self, size: usize, filename: &str) {
        self.0.init(size, filename)
    }
    fn update(&mut self, size: usize) {
        self.0.update(size)
    }
    fn finish(&mut self) {
        self.0.finish()
    }
}

/// Makes `reference` a file on disk: a path as it is (checked to exist),
/// a hub reference fetched (or found in the cache), progress on stderr.
pub fn resolve(reference: &ModelRef) -> Result<Resolved, HubError> {
    resolve_with(reference, &|_, _| Box::new(PullProgress::new()))
}

/// [`resolve`], each download reporting to a progress `progress` makes.
pub fn resolve_with(reference: &ModelRef, progress: ProgressFactory) -> Result<Resolved, HubError> {
    let (repo, pick) = match reference {
        ModelRef::Path(p) => {
            // `pull ./typo.gguf` or `pull repo:QUANT` (no owner) printed
            // the path and exited 0 with nothing there.
            if !p.is_file() {
                return Err(HubError::NoFile(p.clone()));
            }
            return Ok(Resolved {
                model: p.clone(),
                files: vec![p.clone()],
                mmproj: None,
            });
        }
        ModelRef::Hub { repo, pick } => (repo, pick),
    };
    let name = reference.to_string();
    if offline() {
        return cached(&name, repo, pick);
    }
    let cache = cache();
    let token = std::env::var("HF_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty())
        .or_else(|| cache.token());
    let api = ApiBuilder::from_cache(cache)
        .with_token(token)
        .with_progress(false)
        .with_retries(5)
        .with_user_agent("superfluid", env!("CARGO_PKG_VERSION"));
    let api = match std::env::var("HF_ENDPOINT") {
        Ok(e) if !e.trim().is_empty() => api.with_endpoint(e.trim_end_matches('/').to_owned()),
        _ => api,
    }
    .build()
    .map_err(|e| HubError::Other {
        reference: name.clone(),
        reason: e.to_string(),
    })?;
    let remote = api.model(repo.clone());
    let listing = match listing(&remote) {
        Ok(l) => l,
        Err(e) => {
            return match classify(&name, e) {
                HubError::Unreachable { reason, .. } => {
                    log::warn!("{name}: the hub is unreachable ({reason}); looking in the cache");
                    cached(&name, repo, pick).map_err(|_| HubError::Unreachable {
                        reference: name.clone(),
                        reason,
                    })
                }
                other => Err(other),
            }
        }
    };
    let names: Vec<String> = listing.iter().map(|f| f.name.clone()).collect();
    let chosen = choose(&name, &names, pick)?;
    let mut files = Vec::new();
    for file in chosen.model.iter().chain(&chosen.mmproj) {
        let want = listing
            .iter()
            .find(|f| &f.name == file)
            .and_then(|f| f.sha256.clone());
        files.push(fetch(
            &name,
            repo,
            &remote,
            file,
            want.as_deref(),
            progress,
        )?);
    }
    assemble(&name, repo, &chosen, files)
}

/// The resolved reference, once each of its files is found to lie in
/// `repo`'s folder of the cache, links followed ([`contained`]).
fn assemble(
    reference: &str,
    repo: &str,
    chosen: &Chosen,
    files: Vec<PathBuf>,
) -> Result<Resolved, HubError> {
    let root = repo_root(repo);
    if let Some(outside) = files.iter().find(|f| contained(f, &root).is_none()) {
        return Err(HubError::Other {
            reference: reference.to_owned(),
            reason: format!(
                "{} is missing or leads outside {}",
                outside.display(),
                root.display()
            ),
        });
    }
    let mmproj = chosen.mmproj.as_ref().and_then(|_| files.last().cloned());
    let model = files.first().cloned().ok_or_else(|| HubError::Other {
        reference: reference.to_owned(),
        reason: "no model file was chosen".into(),
    })?;
    Ok(Resolved {
        model,
        files,
        mmproj,
    })
}

/// One file of a repo's listing.
struct Listed {
    name: String,
    sha256: Option<String>,
}

/// The repo's files, with the SHA-256 of the large (LFS) ones.
fn listing(remote: &ApiRepo) -> Result<Vec<Listed>, ApiError> {
    let mut response = remote
        .info_request()
        .query("blobs", "true")
        .call()
        .map_err(Box::new)?;
    let info: Value = response.body_mut().read_json().map_err(Box::new)?;
    Ok(info["siblings"]
        .as_array()
        .map(|s| {
            s.iter()
                .filter_map(|f| {
                    let name = f["rfilename"].as_str()?;
                    // A file name is a path inside the repo: nothing that
                    // climbs out of it or starts at the root.
                    let plain = std::path::Path::new(name)
                        .components()
                        .all(|c| matches!(c, std::path::Component::Normal(_)));
                    if !plain {
                        log::warn!("the hub listed a file named {name:?}; it is left out");
                        return None;
                    }
                    Some(Listed {
                        name: name.to_owned(),
                        sha256: f["lfs"]["sha256"].as_str().map(str::to_ascii_lowercase),
                    })
                })
                .collect()
        })
        .unwrap_or_default())
}

fn classify(reference: &str, e: ApiError) -> HubError {
    let reference = reference.to_owned();
    match e {
        ApiError::RequestError(e) => match *e {
            ureq::Error::StatusCode(status @ (401 | 403)) => HubError::Gated { reference, status },
            ureq::Error::StatusCode(404) => HubError::NotFound { reference },
            ureq::Error::StatusCode(s) => HubError::Other {
                reference,
                reason: format!("the hub answered {s}"),
            },
            other => HubError::Unreachable {
                reference,
                reason: other.to_string(),
            },
        },
        ApiError::TooManyRetries(e) => classify(&reference, *e),
        other => HubError::Other {
            reference,
            reason: other.to_string(),
        },
    }
}

/// One file: from the cache when its snapshot has it (and it checks out),
/// else downloaded (resumed where a `.part` was left), then checked.
fn fetch(
    reference: &str,
    repo: &str,
    remote: &ApiRepo,
    file: &str,
    want: Option<&str>,
    progress: ProgressFactory,
) -> Result<PathBuf, HubError> {
    // Already in the cache, its blob named by the digest the hub gives now.
    if let Some(path) = cache().model(repo.to_owned()).get(file) {
        // A pointer that leads outside the repo's folder is never used, nor
        // written through (hf-hub keeps a pointer that exists).
        if contained(&path, &repo_root(repo)).is_none() {
            return Err(HubError::Other {
                reference: reference.to_owned(),
                reason: format!(
                    "{} leads outside {}",
                    path.display(),
                    repo_root(repo).display()
                ),
            });
        }
        let blob = std::fs::canonicalize(&path).ok();
        let named = blob
            .as_ref()
            .and_then(|b| b.file_name())
            .map(|n| n.to_string_lossy().to_ascii_lowercase());
        if want.is_none_or(|w| named.as_deref() == Some(w)) {
            return Ok(path);
        }
    }
    let path = remote
        .download_with_progress(file, Boxed(progress(file, want)))
        .map_err(|e| classify(reference, e))?;
    if let Some(want) = want {
        let got = sha256_of(&path).map_err(|e| HubError::Other {
            reference: reference.to_owned(),
            reason: format!("reading {}: {e}", path.display()),
        })?;
        if got != want {
            // Neither the pointer nor the blob may be used again (a blob of
            // this repo only: nothing a link leads to elsewhere).
            if let Some(blob) = contained(&path, &repo_root(repo).join("blobs")) {
                let _ = std::fs::remove_file(blob);
            }
            let _ = std::fs::remove_file(&path);
            return Err(HubError::Digest {
                file: file.to_owned(),
                got,
                want: want.to_owned(),
            });
        }
    }
    Ok(path)
}

fn sha256_of(path: &Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// `repo`'s folder in the cache (`models--owner--name`).
fn repo_root(repo: &str) -> PathBuf {
    cache()
        .path()
        .join(Repo::model(repo.to_owned()).folder_name())
}

/// `path` resolved (links followed), when that lies inside `within`
/// (resolved too). A snapshot's pointers lead to the repo's blobs; one a
/// link leads elsewhere is never opened nor removed.
fn contained(path: &Path, within: &Path) -> Option<PathBuf> {
    let within = std::fs::canonicalize(within).ok()?;
    let resolved = std::fs::canonicalize(path).ok()?;
    resolved.starts_with(&within).then_some(resolved)
}

/// The snapshot directory `refs/main` points at, for `repo`: a commit id
/// (letters and digits only, so no path), its directory inside the repo's
/// `snapshots/` once resolved.
fn snapshot(repo: &str) -> Option<PathBuf> {
    let root = repo_root(repo);
    let commit = std::fs::read_to_string(root.join("refs").join("main")).ok()?;
    let commit = commit.trim();
    if commit.is_empty() || !commit.bytes().all(|b| b.is_ascii_alphanumeric()) {
        log::warn!("{}: refs/main is not a commit id", root.display());
        return None;
    }
    let dir = root.join("snapshots").join(commit);
    contained(&dir, &root.join("snapshots"))
        .filter(|d| d.is_dir())
        .map(|_| dir)
}

/// Every file under `dir`, as paths relative to it. A linked directory is
/// not walked into (a snapshot holds links to files, its blobs, only).
fn files_under(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            let Ok(kind) = e.file_type() else {
                continue;
            };
            if kind.is_dir() {
                walk(base, &p, out);
            } else if p.is_dir() {
                continue;
            } else if let Ok(rel) = p.strip_prefix(base) {
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// A reference resolved from the cache alone.
fn cached(reference: &str, repo: &str, pick: &Pick) -> Result<Resolved, HubError> {
    let dir = snapshot(repo).ok_or_else(|| HubError::NotCached {
        reference: reference.to_owned(),
        cache: cache().path().clone(),
    })?;
    let chosen = choose(reference, &files_under(&dir), pick)?;
    let files: Vec<PathBuf> = chosen
        .model
        .iter()
        .chain(&chosen.mmproj)
        .map(|f| dir.join(f))
        .collect();
    if let Some(missing) = files.iter().find(|f| !f.exists()) {
        return Err(HubError::Other {
            reference: reference.to_owned(),
            reason: format!("{} is not in the cache", missing.display()),
        });
    }
    assemble(reference, repo, &chosen, files)
}

/// A hub reference's files as the cache holds them (no request).
pub fn in_cache(reference: &ModelRef) -> Result<Resolved, HubError> {
    match reference {
        ModelRef::Hub { repo, pick } => cached(&reference.to_string(), repo, pick),
        ModelRef::Path(_) => Err(HubError::Ref(RefError::NotARef(reference.to_string()))),
    }
}

/// A cached model file, as `superfluid models` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedModel {
    pub reference: String,
    pub file: String,
    pub bytes: u64,
    pub quant: Option<String>,
}

/// Every GGUF in the cache's model repos (their `main` snapshot), projectors
/// and later split parts left out.
pub fn list_cached() -> Vec<CachedModel> {
    let root = cache().path().clone();
    let Ok(entries) = std::fs::read_dir(&root) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let folder = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = folder.strip_prefix("models--") else {
            continue;
        };
        let repo = rest.replacen("--", "/", 1);
        let Some(dir) = snapshot(&repo) else {
            continue;
        };
        for file in files_under(&dir) {
            let lower = file.to_ascii_lowercase();
            let base = lower.rsplit('/').next().unwrap_or(&lower);
            if !lower.ends_with(".gguf") || base.starts_with("mmproj") {
                continue;
            }
            if base.contains("-of-") && !base.contains("-00001-of-") {
                continue;
            }
            let quant = quant_of(&file);
            let reference = match &quant {
                Some(q) => format!("{repo}:{q}"),
                None => format!("{repo}/{file}"),
            };
            let bytes = std::fs::metadata(dir.join(&file))
                .map(|m| m.len())
                .unwrap_or(0);
            out.push(CachedModel {
                reference,
                file,
                bytes,
                quant,
            });
        }
    }
    out.sort_by(|a, b| a.reference.cmp(&b.reference));
    out
}

/// Removes a reference's model files from the cache: their snapshot
/// pointers, and each blob no other pointer of the repo still uses. The
/// repo's projector stays while another model of it is cached. The paths
/// removed.
pub fn remove(reference: &ModelRef) -> Result<Vec<PathBuf>, HubError> {
    let ModelRef::Hub { repo, pick } = reference else {
        return Err(HubError::Ref(RefError::NotARef(reference.to_string())));
    };
    let name = reference.to_string();
    let resolved = cached(&name, repo, pick).map_err(|e| match e {
        // `cached` speaks for an offline fetch; here it is just not there.
        HubError::NotCached { reference, cache } => HubError::Other {
            reference,
            reason: format!("not in the cache {}; nothing to remove", cache.display()),
        },
        e => e,
    })?;
    let root = repo_root(repo);
    let mut doomed: Vec<PathBuf> = resolved
        .files
        .iter()
        .filter(|f| Some(*f) != resolved.mmproj.as_ref())
        .cloned()
        .collect();
    let mut removed = Vec::new();
    let unlink = |pointers: &[PathBuf], removed: &mut Vec<PathBuf>| {
        for pointer in pointers {
            // Only a blob of this repo is removed; `cached` refused any
            // file that leads outside the repo's folder.
            let blob = contained(pointer, &root.join("blobs"));
            if std::fs::remove_file(pointer).is_ok() {
                removed.push(pointer.clone());
            }
            let Some(blob) = blob.filter(|b| b != pointer) else {
                continue;
            };
            let still_used = files_under(&root.join("snapshots")).iter().any(|p| {
                std::fs::canonicalize(root.join("snapshots").join(p))
                    .ok()
                    .as_ref()
                    == Some(&blob)
            });
            if !still_used && std::fs::remove_file(&blob).is_ok() {
                removed.push(blob);
            }
        }
    };
    unlink(&doomed, &mut removed);
    // The projector goes with the last model of the repo.
    if let (Some(mmproj), Some(dir)) = (&resolved.mmproj, snapshot(repo)) {
        let models_left = files_under(&dir).iter().any(|f| {
            let lower = f.to_ascii_lowercase();
            lower.ends_with(".gguf")
                && !lower.rsplit('/').next().unwrap_or("").starts_with("mmproj")
        });
        if !models_left {
            doomed = vec![mmproj.clone()];
            unlink(&doomed, &mut removed);
        }
    }
    Ok(removed)
}

/// Download progress: a bar on a terminal, else a line every few seconds
/// (and at the end), on stderr.
pub enum PullProgress {
    Bar(indicatif::ProgressBar),
    Lines(Lines),
}

/// The state of plain progress lines.
#[derive(Default)]
pub struct Lines {
    file: String,
    total: u64,
    done: u64,
    /// Where this attempt started (a resumed download starts past 0).
    from: Option<u64>,
    started: Option<Instant>,
    last: Option<Instant>,
}

/// How often a progress line is printed when stderr is not a terminal.
const LINE_EVERY: Duration = Duration::from_secs(2);

impl PullProgress {
    pub fn new() -> PullProgress {
        if std::io::stderr().is_terminal() {
            let bar = indicatif::ProgressBar::new(0);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "{msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
            ) {
                bar.set_style(style);
            }
            PullProgress::Bar(bar)
        } else {
            PullProgress::Lines(Lines::default())
        }
    }
}

impl Default for PullProgress {
    fn default() -> Self {
        PullProgress::new()
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

impl Lines {
    fn line(&self, now: Instant) {
        let from = self.from.unwrap_or(0);
        let secs = self
            .started
            .map_or(0.0, |s| (now - s).as_secs_f64())
            .max(1e-3);
        let rate = self.done.saturating_sub(from) as f64 / secs;
        let eta = if rate > 0.0 {
            format!(
                "{:.0} s",
                self.total.saturating_sub(self.done) as f64 / rate
            )
        } else {
            "?".to_owned()
        };
        eprintln!(
            "pull: {} {:.1}/{:.1} MiB ({:.0}%), {:.1} MiB/s, ETA {eta}",
            self.file,
            mib(self.done),
            mib(self.total),
            100.0 * self.done as f64 / self.total.max(1) as f64,
            rate / (1024.0 * 1024.0),
        );
    }
}

impl Progress for PullProgress {
    fn init(&mut self, size: usize, filename: &str) {
        match self {
            PullProgress::Bar(bar) => {
                bar.set_length(size as u64);
                bar.set_position(0);
                bar.set_message(filename.to_owned());
            }
            PullProgress::Lines(l) => {
                *l = Lines {
                    file: filename.to_owned(),
                    total: size as u64,
                    ..Lines::default()
                };
            }
        }
    }

    fn update(&mut self, size: usize) {
        match self {
            PullProgress::Bar(bar) => bar.inc(size as u64),
            PullProgress::Lines(l) => {
                let now = Instant::now();
                l.done += size as u64;
                if l.from.is_none() {
                    // hf-hub's first update of an attempt is where it starts.
                    l.from = Some(l.done);
                    l.started = Some(now);
                    if l.done > 0 {
                        eprintln!(
                            "pull: {} resumed at {:.1} of {:.1} MiB",
                            l.file,
                            mib(l.done),
                            mib(l.total)
                        );
                    }
                    return;
                }
                if l.last.is_none_or(|t| now - t >= LINE_EVERY) {
                    l.last = Some(now);
                    l.line(now);
                }
            }
        }
    }

    fn finish(&mut self) {
        match self {
            PullProgress::Bar(bar) => bar.finish(),
            PullProgress::Lines(l) => {
                if l.done >= l.total {
                    eprintln!("pull: {} {:.1} MiB done", l.file, mib(l.total));
                }
            }
        }
    }
}
