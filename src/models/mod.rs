//! Models by reference: `owner/repo:quant`, `owner/repo/file.gguf`, or a
//! path. A reference to a Hugging Face repo resolves to GGUF files there
//! (a quant matched case-insensitively against the file names, split files
//! `*-00001-of-0000N.gguf` taken whole, a vision projector `mmproj-*.gguf`
//! beside them), fetched into the huggingface_hub cache layout with the
//! `hf-hub` crate ([`hub`]), so a model another tool downloaded is reused and
//! ours is reused by them.
//!
//! This file is the sans-IO part: parsing a reference and choosing files
//! from a repo's listing.

pub mod hub;

use std::path::{Path, PathBuf};

/// What `serve`, `pull` and `rm` were given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelRef {
    /// A GGUF file on disk.
    Path(PathBuf),
    /// A Hugging Face model repo (`owner/name`) and which of its GGUFs.
    Hub { repo: String, pick: Pick },
}

/// Which GGUF of a repo a reference names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pick {
    /// `owner/repo:QUANT`: the file (or split set) whose name ends in the quant.
    Quant(String),
    /// `owner/repo/path/in/repo.gguf`.
    File(String),
    /// `owner/repo`: the repo's only model GGUF, else its Q4_K_M.
    Default,
}

/// Why a reference names nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RefError {
    #[error(
        "{0:?} is neither a GGUF file on disk nor a model reference \
         (owner/repo:QUANT, owner/repo/file.gguf)"
    )]
    NotARef(String),
    #[error("{reference}: no GGUF file there matches {wanted}; {available}")]
    NoMatch {
        reference: String,
        wanted: String,
        available: String,
    },
    #[error("{reference}: {count} files match {wanted} ({files}); name one with owner/repo/FILE")]
    Ambiguous {
        reference: String,
        wanted: String,
        count: usize,
        files: String,
    },
    #[error(
        "{reference}: {first} is part of a model split in {of} files, and {have} of them are \
         there (missing: {missing})"
    )]
    IncompleteSplit {
        reference: String,
        first: String,
        of: u32,
        have: usize,
        missing: String,
    },
}

/// A name of the hub: letters, digits, `-`, `_`, `.`; not `.` or `..`.
fn hub_name(s: &str) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && s.len() <= 96
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// `~` and `~/...` with the home directory ($HOME), as a shell would (a
/// quoted `'~/m.gguf'` reached us as it is); anything else as given.
fn expand_home(s: &str) -> PathBuf {
    let home = || std::env::var_os("HOME").map(PathBuf::from);
    match s.strip_prefix('~') {
        Some("") => home().unwrap_or_else(|| PathBuf::from(s)),
        Some(rest) if rest.starts_with('/') => home()
            .map(|h| h.join(rest.trim_start_matches('/')))
            .unwrap_or_else(|| PathBuf::from(s)),
        _ => PathBuf::from(s),
    }
}

impl ModelRef {
    /// Parses a reference. An existing file, or anything that looks like a
    /// path (starts with `/`, `.` or `~`, or has no `/`), is a path.
    pub fn parse(s: &str) -> Result<ModelRef, RefError> {
        if Self::looks_like_path(s) || Path::new(s).exists() || Self::under_a_local_dir(s) {
            return Ok(ModelRef::Path(expand_home(s)));
        }
        Self::parse_hub(s)
    }

    /// `models/llama/m.gguf`, missing, where `models/` is a directory here:
    /// a path mistyped (or not made yet), whose name must not go to the hub
    /// as a request; it fails as a missing file. A hub owner rarely names a
    /// directory of the working directory.
    fn under_a_local_dir(s: &str) -> bool {
        let file_ref = s.matches('/').count() >= 2 && s.to_ascii_lowercase().ends_with(".gguf");
        file_ref
            && s.split('/')
                .next()
                .is_some_and(|first| Path::new(first).is_dir())
    }

    /// Whether `s` is taken for a path whatever the disk holds.
    fn looks_like_path(s: &str) -> bool {
        // `dir/file.gguf` (one `/`) is a path too, never sent to the hub.
        let one_slash_gguf =
            s.matches('/').count() == 1 && s.to_ascii_lowercase().ends_with(".gguf");
        s.starts_with('/')
            || s.starts_with('.')
            || s.starts_with('~')
            || !s.contains('/')
            || one_slash_gguf
    }

    /// Parses a hub reference only, never looking at the disk: what a
    /// request names (Ollama's `/api/pull` and `/api/delete`), so that no
    /// client learns which paths exist on the daemon's machine by how its
    /// request is answered. Anything shaped like a path is `NotARef`.
    pub fn parse_hub(s: &str) -> Result<ModelRef, RefError> {
        if Self::looks_like_path(s) {
            return Err(RefError::NotARef(s.to_owned()));
        }
        let bad = || RefError::NotARef(s.to_owned());
        let (owner, rest) = s.split_once('/').ok_or_else(bad)?;
        if !hub_name(owner) {
            return Err(bad());
        }
        if let Some((name, file)) = rest.split_once('/') {
            let parts_ok = file.split('/').all(hub_name);
            if !hub_name(name) || !parts_ok || !file.to_ascii_lowercase().ends_with(".gguf") {
                return Err(bad());
            }
            return Ok(ModelRef::Hub {
                repo: format!("{owner}/{name}"),
                pick: Pick::File(file.to_owned()),
            });
        }
        let (name, pick) = match rest.split_once(':') {
            Some((name, quant)) if hub_name(quant) => (name, Pick::Quant(quant.to_owned())),
            Some(_) => return Err(bad()),
            None => (rest, Pick::Default),
        };
        if !hub_name(name) {
            return Err(bad());
        }
        Ok(ModelRef::Hub {
            repo: format!("{owner}/{name}"),
            pick,
        })
    }
}

impl std::fmt::Display for ModelRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelRef::Path(p) => write!(f, "{}", p.display()),
            ModelRef::Hub { repo, pick } => match pick {
                Pick::Quant(q) => write!(f, "{repo}:{q}"),
                Pick::File(file) => write!(f, "{repo}/{file}"),
                Pick::Default => write!(f, "{repo}"),
            },
        }
    }
}

/// The files of a repo a reference resolves to: the model (every part of a
/// split set, first part first) and the projector if the repo has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chosen {
    pub model: Vec<String>,
    pub mmproj: Option<String>,
}

/// `name` without the `-00001-of-00003` of a split part, and whether it had one.
fn split_stem(stem: &str) -> (&str, bool) {
    // "-NNNNN-of-NNNNN": 15 bytes (ASCII, so a char boundary when it matches).
    if let Some(tail) = stem.len().checked_sub(15).and_then(|at| stem.get(at..)) {
        let t = tail.as_bytes();
        let digits = |r: std::ops::Range<usize>| t[r].iter().all(u8::is_ascii_digit);
        if t[0] == b'-' && digits(1..6) && &tail[6..10] == "-of-" && digits(10..15) {
            return (&stem[..stem.len() - 15], true);
        }
    }
    (stem, false)
}

fn is_gguf(f: &str) -> bool {
    f.to_ascii_lowercase().ends_with(".gguf")
}

fn is_mmproj(f: &str) -> bool {
    let base = f.rsplit('/').next().unwrap_or(f).to_ascii_lowercase();
    is_gguf(f) && base.starts_with("mmproj")
}

/// The quant a model file's name ends in (after the last `-` or `.`), if it
/// looks like one (`Q4_K_M`, `UD-Q4_K_XL`, `F16`, `IQ2_XXS`, `BF16`...).
pub fn quant_of(file: &str) -> Option<String> {
    let base = file.rsplit('/').next().unwrap_or(file);
    quant_of_name(base).or_else(|| {
        // A folder named for the quant holds its files (`Q8_0/model-00001-
        // of-00002.gguf`), as `matches_quant` takes them.
        file.rsplit('/').skip(1).find_map(|folder| {
            let up = folder.to_ascii_uppercase();
            let (ud, q) = match up.strip_prefix("UD-") {
                Some(q) => (true, q),
                None => (false, up.as_str()),
            };
            quantish(q).then(|| if ud { format!("UD-{q}") } else { q.to_owned() })
        })
    })
}

/// Whether `up` (upper case) reads as a quant's name.
fn quantish(up: &str) -> bool {
    (up.starts_with('Q')
        || up.starts_with("IQ")
        || up == "F16"
        || up == "BF16"
        || up == "F32"
        || up.starts_with("TQ"))
        && up.chars().any(|c| c.is_ascii_digit())
}

/// [`quant_of`] from a file's own name.
fn quant_of_name(base: &str) -> Option<String> {
    let stem = &base[..base.len().saturating_sub(5)];
    let (stem, _) = split_stem(stem);
    let last = stem.rsplit(['-', '.']).next()?;
    let up = last.to_ascii_uppercase();
    if !quantish(&up) {
        return None;
    }
    // Unsloth's dynamic quants: UD-Q4_K_XL.
    let ud = stem.len() > last.len() + 3
        && stem[..stem.len() - last.len() - 1]
            .to_ascii_uppercase()
            .ends_with("UD");
    Some(if ud { format!("UD-{up}") } else { up })
}

/// Whether model file `file` is of quant `quant` (case-insensitive): its
/// name, split suffix dropped, ends in `-QUANT` or `.QUANT`, or it lies in a
/// folder named QUANT.
fn matches_quant(file: &str, quant: &str) -> bool {
    let q = quant.to_ascii_lowercase();
    let lower = file.to_ascii_lowercase();
    let mut segs: Vec<&str> = lower.split('/').collect();
    let base = segs.pop().unwrap_or("");
    if segs.iter().any(|s| *s == q) {
        return true;
    }
    let stem = &base[..base.len().saturating_sub(5)];
    let (stem, _) = split_stem(stem);
    stem == q
        || stem.ends_with(&format!("-{q}"))
        || stem.ends_with(&format!(".{q}"))
        || stem.ends_with(&format!("_{q}"))
}

/// The files of `listing` (a repo's file names) that `pick` names, for
/// reference `reference` (in errors).
pub fn choose(reference: &str, listing: &[String], pick: &Pick) -> Result<Chosen, RefError> {
    // Names a file can be fetched under: plain segments, no `..`.
    let listing: Vec<String> = listing
        .iter()
        .filter(|f| f.split('/').all(hub_name))
        .cloned()
        .collect();
    let listing = &listing[..];
    let models: Vec<&String> = listing
        .iter()
        .filter(|f| is_gguf(f) && !is_mmproj(f))
        .collect();
    let available = || {
        let mut quants: Vec<String> = models.iter().filter_map(|f| quant_of(f)).collect();
        quants.sort();
        quants.dedup();
        if quants.is_empty() {
            if models.is_empty() {
                "the repo holds no GGUF file".to_owned()
            } else {
                format!(
                    "its GGUF files: {}",
                    models
                        .iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        } else {
            format!("quants there: {}", quants.join(", "))
        }
    };
    let (wanted, found): (String, Vec<&String>) = match pick {
        Pick::File(f) => (
            f.clone(),
            listing
                .iter()
                .filter(|x| x.eq_ignore_ascii_case(f))
                .collect(),
        ),
        Pick::Quant(q) => (
            format!("quant {q}"),
            models
                .iter()
                .copied()
                .filter(|f| matches_quant(f, q))
                .collect(),
        ),
        Pick::Default => {
            if models.len() == 1 || groups(&models).len() == 1 {
                ("a model GGUF".to_owned(), models.clone())
            } else {
                (
                    "the default quant Q4_K_M".to_owned(),
                    models
                        .iter()
                        .copied()
                        .filter(|f| matches_quant(f, "Q4_K_M"))
                        .collect(),
                )
            }
        }
    };
    if found.is_empty() {
        return Err(RefError::NoMatch {
            reference: reference.to_owned(),
            wanted,
            available: available(),
        });
    }
    // One file, or the parts of one split set.
    let sets = groups(&found);
    if sets.len() > 1 {
        return Err(RefError::Ambiguous {
            reference: reference.to_owned(),
            wanted,
            count: sets.len(),
            files: sets
                .iter()
                .map(|g| g[0].clone())
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    let mut model = sets.into_iter().next().unwrap_or_default();
    model.sort();
    let model = whole_split(reference, listing, model)?;
    let mut projectors: Vec<&String> = listing.iter().filter(|f| is_mmproj(f)).collect();
    // F16 projectors first (the common one), then by name.
    projectors.sort_by_key(|f| (!f.to_ascii_lowercase().contains("f16"), f.to_string()));
    Ok(Chosen {
        model,
        mmproj: projectors.first().map(|s| s.to_string()),
    })
}

/// `model` (one file, or parts of one split set) with every part of its set:
/// a split model is fetched whole, so a part named alone brings the others,
/// and a set with a part missing (a cache holding part 1 of 2) is refused
/// rather than handed to llama.cpp.
fn whole_split(
    reference: &str,
    listing: &[String],
    model: Vec<String>,
) -> Result<Vec<String>, RefError> {
    let Some(first) = model.first() else {
        return Ok(model);
    };
    let end = first.len().saturating_sub(5);
    let (stem, split) = split_stem(&first[..end]);
    // "-NNNNN-of-NNNNN": the count is the last five digits.
    let of = first[..end]
        .get(end.saturating_sub(5)..)
        .and_then(|n| n.parse::<u32>().ok());
    let (true, Some(of)) = (split, of) else {
        return Ok(model);
    };
    let name = |k: u32| format!("{stem}-{k:05}-of-{of:05}{}", &first[end..]);
    let mut parts = Vec::new();
    let mut missing = Vec::new();
    for k in 1..=of {
        let want = name(k);
        match listing.iter().find(|f| f.eq_ignore_ascii_case(&want)) {
            Some(f) => parts.push(f.clone()),
            None => missing.push(want),
        }
    }
    if !missing.is_empty() {
        return Err(RefError::IncompleteSplit {
            reference: reference.to_owned(),
            first: first.clone(),
            of,
            have: parts.len(),
            missing: missing.join(", "),
        });
    }
    Ok(parts)
}

/// Files grouped by model: split parts of one set together.
fn groups(files: &[&String]) -> Vec<Vec<String>> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for f in files {
        let base_end = f.len().saturating_sub(5);
        let (stem, _) = split_stem(&f[..base_end]);
        match out.iter_mut().find(|(k, _)| k == stem) {
            Some((_, v)) => v.push(f.to_string()),
            None => out.push((stem.to_owned(), vec![f.to_string()])),
        }
    }
    out.into_iter().map(|(_, v)| v).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hub(repo: &str, pick: Pick) -> ModelRef {
        ModelRef::Hub {
            repo: repo.into(),
            pick,
        }
    }

    #[test]
    fn a_hub_reference_from_a_request_never_looks_at_the_disk() {
        // `parse_hub` reads the string only (no file system call): path
        // shapes are refused, references parse as `parse` parses them.
        for path in [
            "/etc/passwd",
            "./x.gguf",
            "~/m.gguf",
            "default",
            "dir/m.gguf",
        ] {
            assert!(ModelRef::parse_hub(path).is_err(), "{path}");
        }
        // A missing `src/...gguf` (src/ is a directory here, the crate's
        // root when tests run) is a path, never a hub request.
        assert_eq!(
            ModelRef::parse("src/models/missing.gguf").unwrap(),
            ModelRef::Path("src/models/missing.gguf".into())
        );
        assert!(ModelRef::parse_hub("src/models/missing.gguf").is_ok());
        assert_eq!(
            ModelRef::parse_hub("owner/repo:Q4_0").unwrap(),
            ModelRef::parse("owner/repo:Q4_0").unwrap()
        );
    }

    #[test]
    fn a_path_from_home_is_expanded() {
        let home = PathBuf::from(std::env::var_os("HOME").expect("HOME"));
        assert_eq!(
            ModelRef::parse("~/models/m.gguf").unwrap(),
            ModelRef::Path(home.join("models/m.gguf"))
        );
        assert_eq!(ModelRef::parse("~").unwrap(), ModelRef::Path(home));
        // Another user's home is not guessed.
        assert_eq!(
            ModelRef::parse("~bob/m.gguf").unwrap(),
            ModelRef::Path("~bob/m.gguf".into())
        );
    }

    #[test]
    fn references_parse() {
        assert_eq!(
            ModelRef::parse("unsloth/Qwen3.8-27B-GGUF:UD-Q4_K_M").unwrap(),
            hub("unsloth/Qwen3.8-27B-GGUF", Pick::Quant("UD-Q4_K_M".into()))
        );
        assert_eq!(
            ModelRef::parse("owner/repo/sub/model-Q8_0.gguf").unwrap(),
            hub("owner/repo", Pick::File("sub/model-Q8_0.gguf".into()))
        );
        assert_eq!(
            ModelRef::parse("owner/repo").unwrap(),
            hub("owner/repo", Pick::Default)
        );
        for path in ["/models/a.gguf", "./a.gguf", "a.gguf", "models/qwen.gguf"] {
            assert_eq!(ModelRef::parse(path).unwrap(), ModelRef::Path(path.into()));
        }
        for bad in [
            "owner/../x:Q4",
            "owner/repo:",
            "owner/repo/x.bin",
            "o w/r",
            "owner/re po",
        ] {
            assert!(ModelRef::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            ModelRef::parse("owner/repo:q4_k_m").unwrap().to_string(),
            "owner/repo:q4_k_m"
        );
    }

    fn listing(files: &[&str]) -> Vec<String> {
        files.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_quant_picks_its_file_case_insensitively() {
        let l = listing(&[
            "README.md",
            "Qwen-27B-UD-Q4_K_M.gguf",
            "Qwen-27B-Q4_K_M.gguf",
            "Qwen-27B-Q8_0.gguf",
            "mmproj-F32.gguf",
            "mmproj-F16.gguf",
        ]);
        let c = choose("r", &l, &Pick::Quant("ud-q4_k_m".into())).unwrap();
        assert_eq!(c.model, ["Qwen-27B-UD-Q4_K_M.gguf"]);
        assert_eq!(c.mmproj.as_deref(), Some("mmproj-F16.gguf"));
        // Q4_K_M matches both Q4_K_M files: a clear refusal.
        let e = choose("r", &l, &Pick::Quant("Q4_K_M".into())).unwrap_err();
        assert!(matches!(e, RefError::Ambiguous { count: 2, .. }), "{e}");
        let e = choose("r", &l, &Pick::Quant("Q5_K_M".into())).unwrap_err();
        assert_eq!(
            e.to_string(),
            "r: no GGUF file there matches quant Q5_K_M; quants there: Q4_K_M, Q8_0, UD-Q4_K_M"
        );
    }

    #[test]
    fn split_files_are_taken_whole() {
        let l = listing(&[
            "UD-Q4_K_M/Big-UD-Q4_K_M-00002-of-00002.gguf",
            "UD-Q4_K_M/Big-UD-Q4_K_M-00001-of-00002.gguf",
            "Big-Q8_0-00001-of-00003.gguf",
            "Big-Q8_0-00002-of-00003.gguf",
            "Big-Q8_0-00003-of-00003.gguf",
        ]);
        let c = choose("r", &l, &Pick::Quant("UD-Q4_K_M".into())).unwrap();
        assert_eq!(
            c.model,
            [
                "UD-Q4_K_M/Big-UD-Q4_K_M-00001-of-00002.gguf",
                "UD-Q4_K_M/Big-UD-Q4_K_M-00002-of-00002.gguf"
            ]
        );
        let c = choose("r", &l, &Pick::Quant("q8_0".into())).unwrap();
        assert_eq!(c.model.len(), 3);
        assert!(c.model[0].contains("00001-of"));
        assert_eq!(c.mmproj, None);
        assert_eq!(
            quant_of("Big-Q8_0-00001-of-00003.gguf").as_deref(),
            Some("Q8_0")
        );
        // A split set is taken whole: a part named alone brings the others,
        // and a set missing a part is refused (a cache holding part 1 of 2).
        let c = choose("r", &l, &Pick::File("Big-Q8_0-00002-of-00003.gguf".into())).unwrap();
        assert_eq!(c.model.len(), 3);
        let partial = listing(&["Q8_0/model-00001-of-00002.gguf"]);
        let e = choose("r", &partial, &Pick::Quant("Q8_0".into())).unwrap_err();
        assert!(
            e.to_string()
                .contains("1 of them are there (missing: Q8_0/model-00002-of-00002.gguf)"),
            "{e}"
        );
        // A folder named for the quant, the file's own name plain.
        assert_eq!(
            quant_of("Q8_0/model-00001-of-00002.gguf").as_deref(),
            Some("Q8_0")
        );
        assert_eq!(
            quant_of("UD-Q4_K_XL/model-00001-of-00002.gguf").as_deref(),
            Some("UD-Q4_K_XL")
        );
        assert_eq!(quant_of("docs/model.gguf"), None);
    }

    #[test]
    fn the_default_is_the_only_model_or_q4_k_m() {
        let one = listing(&["SmolLM2-135M-Instruct.Q4_1.gguf", "mmproj-x.gguf"]);
        let c = choose("r", &one, &Pick::Default).unwrap();
        assert_eq!(c.model, ["SmolLM2-135M-Instruct.Q4_1.gguf"]);
        let many = listing(&["m-Q4_K_M.gguf", "m-Q8_0.gguf"]);
        assert_eq!(
            choose("r", &many, &Pick::Default).unwrap().model,
            ["m-Q4_K_M.gguf"]
        );
        let none = listing(&["m-Q5_0.gguf", "m-Q8_0.gguf"]);
        assert!(choose("r", &none, &Pick::Default).is_err());
        let file = choose("r", &many, &Pick::File("M-Q8_0.GGUF".into())).unwrap();
        assert_eq!(file.model, ["m-Q8_0.gguf"]);
    }
}
