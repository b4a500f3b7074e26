//! What `/api/tags` and `/api/show` say about the served file: its GGUF
//! header's scalar metadata (architecture, name, size label, file type,
//! context length, …), read once, and a cheap identity to stand for Ollama's
//! digest. Hashing a whole multi-gigabyte file would take seconds to minutes,
//! so the digest is the sha256 of the file name, its size, its modification
//! time and its first MiB: it changes when the file does, and is documented as
//! not being the file's own sha256.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::path::Path;

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The most key-value pairs a header may declare.
pub const MAX_KV: u64 = 1 << 16;
/// The longest string read into the metadata; longer ones (a chat template,
/// a license) are skipped. The longest any string may claim to be.
pub const MAX_KEPT_STRING: u64 = 512;
pub const MAX_STRING: u64 = 64 << 20;
/// The most elements an array may claim.
pub const MAX_ARRAY: u64 = 1 << 26;
/// How much of the file's start goes into the digest.
pub const DIGEST_PREFIX: u64 = 1 << 20;

/// The header's scalar values by key (arrays and long strings left out).
pub type Meta = BTreeMap<String, Value>;

fn u32_of(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn u64_of(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn bad(m: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, m.into())
}

fn skip(r: &mut impl Read, n: u64) -> io::Result<()> {
    let copied = io::copy(&mut r.take(n), &mut io::sink())?;
    if copied < n {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// A string, or `None` (skipped) when longer than `keep`.
fn string(r: &mut impl Read, keep: u64) -> io::Result<Option<String>> {
    let n = u64_of(r)?;
    if n > MAX_STRING {
        return Err(bad(format!("a string of {n} bytes")));
    }
    if n > keep {
        skip(r, n)?;
        return Ok(None);
    }
    let mut b = vec![0u8; n as usize];
    r.read_exact(&mut b)?;
    Ok(Some(String::from_utf8_lossy(&b).into_owned()))
}

/// One value of type `ty`; `None` for arrays and skipped strings.
fn value(r: &mut impl Read, ty: u32, depth: u8) -> io::Result<Option<Value>> {
    let mut b = [0u8; 8];
    let v = match ty {
        0 | 1 | 7 => {
            r.read_exact(&mut b[..1])?;
            match ty {
                0 => Value::from(b[0]),
                1 => Value::from(b[0] as i8),
                _ => Value::Bool(b[0] != 0),
            }
        }
        2 | 3 => {
            r.read_exact(&mut b[..2])?;
            let x = u16::from_le_bytes([b[0], b[1]]);
            if ty == 2 {
                Value::from(x)
            } else {
                Value::from(x as i16)
            }
        }
        4 => Value::from(u32_of(r)?),
        5 => Value::from(u32_of(r)? as i32),
        6 => Value::from(f32::from_bits(u32_of(r)?)),
        10 => Value::from(u64_of(r)?),
        11 => Value::from(u64_of(r)? as i64),
        12 => Value::from(f64::from_bits(u64_of(r)?)),
        8 => return Ok(string(r, MAX_KEPT_STRING)?.map(Value::String)),
        9 => {
            if depth > 2 {
                return Err(bad("arrays nested too deep"));
            }
            let elem = u32_of(r)?;
            let n = u64_of(r)?;
            if n > MAX_ARRAY {
                return Err(bad(format!("an array of {n} elements")));
            }
            let width = match elem {
                0 | 1 | 7 => Some(1),
                2 | 3 => Some(2),
                4..=6 => Some(4),
                10..=12 => Some(8),
                _ => None,
            };
            match width {
                Some(w) => skip(r, n * w)?,
                None => {
                    for _ in 0..n {
                        match elem {
                            8 => {
                                string(r, 0)?;
                            }
                            _ => {
                                value(r, elem, depth + 1)?;
                            }
                        }
                    }
                }
            }
            return Ok(None);
        }
        other => return Err(bad(format!("unknown value type {other}"))),
    };
    Ok(Some(v))
}

/// Reads a GGUF header's key-value pairs (not its tensors).
pub fn read_meta(r: &mut impl Read) -> io::Result<Meta> {
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic)?;
    if &magic != b"GGUF" {
        return Err(bad("not a GGUF file"));
    }
    let version = u32_of(r)?;
    if !(2..=3).contains(&version) {
        return Err(bad(format!("GGUF version {version}")));
    }
    let _tensors = u64_of(r)?;
    let n = u64_of(r)?;
    if n > MAX_KV {
        return Err(bad(format!("{n} key-value pairs")));
    }
    let mut meta = Meta::new();
    for _ in 0..n {
        let key = string(r, 4096)?.ok_or_else(|| bad("a key too long"))?;
        let ty = u32_of(r)?;
        if let Some(v) = value(r, ty, 0)? {
            meta.insert(key, v);
        }
    }
    Ok(meta)
}

/// llama.cpp's `llama_ftype` names (`general.file_type`).
pub fn file_type_name(t: u64) -> Option<&'static str> {
    Some(match t {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        19 => "IQ2_XXS",
        20 => "IQ2_XS",
        21 => "Q2_K_S",
        22 => "IQ3_XS",
        23 => "IQ3_XXS",
        24 => "IQ1_S",
        25 => "IQ4_NL",
        26 => "IQ3_S",
        27 => "IQ3_M",
        28 => "IQ2_S",
        29 => "IQ2_M",
        30 => "IQ4_XS",
        31 => "IQ1_M",
        32 => "BF16",
        36 => "TQ1_0",
        37 => "TQ2_0",
        _ => return None,
    })
}

/// A quant named in a file name: `Model.Q4_1.gguf`, `model-UD-Q4_K_M.gguf`.
pub fn quant_from_name(name: &str) -> Option<String> {
    let stem = name.strip_suffix(".gguf").unwrap_or(name);
    let last = stem.rsplit(['.', '-']).next()?;
    let upper = last.to_ascii_uppercase();
    let known = ["Q", "IQ", "F16", "F32", "BF16", "TQ"];
    let quant = known.iter().any(|k| upper.starts_with(k))
        && upper.chars().skip(1).any(|c| c.is_ascii_digit());
    quant.then_some(upper)
}

/// Ollama's `details` of the model.
#[derive(Debug, Clone, PartialEq)]
pub struct Details {
    pub family: String,
    pub parameter_size: String,
    pub quantization_level: String,
}

/// `details` from the header, the file name filling what it lacks.
pub fn details(meta: &Meta, file_name: &str) -> Details {
    let text = |k: &str| meta.get(k).and_then(Value::as_str).map(str::to_owned);
    let family = text("general.architecture").unwrap_or_default();
    let parameter_size = text("general.size_label")
        .or_else(|| {
            meta.get("general.parameter_count")
                .and_then(Value::as_u64)
                .map(size_label)
        })
        .unwrap_or_default();
    let quantization_level = meta
        .get("general.file_type")
        .and_then(Value::as_u64)
        .and_then(file_type_name)
        .map(str::to_owned)
        .or_else(|| quant_from_name(file_name))
        .unwrap_or_default();
    Details {
        family,
        parameter_size,
        quantization_level,
    }
}

/// 134515008 → `134.52M`, as Ollama writes sizes.
pub fn size_label(n: u64) -> String {
    let (v, unit) = match n {
        n if n >= 1_000_000_000 => (n as f64 / 1e9, "B"),
        n if n >= 1_000_000 => (n as f64 / 1e6, "M"),
        n if n >= 1_000 => (n as f64 / 1e3, "K"),
        n => (n as f64, ""),
    };
    let s = format!("{v:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    format!("{s}{unit}")
}

/// The file as `/api/tags` lists it.
#[derive(Debug, Clone)]
pub struct Identity {
    pub size: u64,
    /// `sha256:<hex>` of the name, size, mtime and first MiB.
    pub digest: String,
    /// Unix milliseconds of the file's last modification.
    pub modified_ms: u64,
    pub meta: Meta,
    pub details: Details,
}

/// Reads what `Identity` needs: one stat, the first MiB, the header.
pub fn identify(path: &Path) -> io::Result<Identity> {
    let stat = std::fs::metadata(path)?;
    let modified_ms = stat
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut f = std::fs::File::open(path)?;
    let mut head = Vec::new();
    (&mut f).take(DIGEST_PREFIX).read_to_end(&mut head)?;
    let mut h = Sha256::new();
    h.update(name.as_bytes());
    h.update(stat.len().to_le_bytes());
    h.update(modified_ms.to_le_bytes());
    h.update(&head);
    let digest = format!("sha256:{}", hex::encode(h.finalize()));
    let meta = {
        let f = std::fs::File::open(path)?;
        read_meta(&mut io::BufReader::new(f)).unwrap_or_default()
    };
    let details = details(&meta, &name);
    Ok(Identity {
        size: stat.len(),
        digest,
        modified_ms,
        meta,
        details,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv_string(out: &mut Vec<u8>, key: &str, v: &str) {
        out.extend((key.len() as u64).to_le_bytes());
        out.extend(key.as_bytes());
        out.extend(8u32.to_le_bytes());
        out.extend((v.len() as u64).to_le_bytes());
        out.extend(v.as_bytes());
    }

    fn header(kvs: u64) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(0u64.to_le_bytes());
        out.extend(kvs.to_le_bytes());
        out
    }

    #[test]
    fn scalars_are_read_and_arrays_and_long_strings_skipped() {
        let mut b = header(5);
        kv_string(&mut b, "general.architecture", "llama");
        // general.file_type: u32 3 (Q4_1)
        let k = "general.file_type";
        b.extend((k.len() as u64).to_le_bytes());
        b.extend(k.as_bytes());
        b.extend(4u32.to_le_bytes());
        b.extend(3u32.to_le_bytes());
        // an array of two strings
        let k = "tokenizer.ggml.tokens";
        b.extend((k.len() as u64).to_le_bytes());
        b.extend(k.as_bytes());
        b.extend(9u32.to_le_bytes());
        b.extend(8u32.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        for t in ["a", "bc"] {
            b.extend((t.len() as u64).to_le_bytes());
            b.extend(t.as_bytes());
        }
        kv_string(&mut b, "tokenizer.chat_template", &"x".repeat(1000));
        // llama.context_length: u64 8192
        let k = "llama.context_length";
        b.extend((k.len() as u64).to_le_bytes());
        b.extend(k.as_bytes());
        b.extend(10u32.to_le_bytes());
        b.extend(8192u64.to_le_bytes());
        let meta = read_meta(&mut b.as_slice()).unwrap();
        assert_eq!(meta["general.architecture"], "llama");
        assert_eq!(meta["general.file_type"], 3);
        assert_eq!(meta["llama.context_length"], 8192);
        assert!(!meta.contains_key("tokenizer.ggml.tokens"));
        assert!(!meta.contains_key("tokenizer.chat_template"));
        let d = details(&meta, "m.gguf");
        assert_eq!(d.family, "llama");
        assert_eq!(d.quantization_level, "Q4_1");
    }

    #[test]
    fn bad_headers_are_refused() {
        assert!(read_meta(&mut &b"GGML\x03\0\0\0"[..]).is_err());
        let mut b = header(MAX_KV + 1);
        assert!(read_meta(&mut b.as_slice()).is_err());
        b = header(1);
        b.extend(u64::MAX.to_le_bytes());
        assert!(read_meta(&mut b.as_slice()).is_err());
        // Truncated mid-value.
        let mut b = header(1);
        kv_string(&mut b, "general.name", "abc");
        b.truncate(b.len() - 1);
        assert!(read_meta(&mut b.as_slice()).is_err());
    }

    #[test]
    fn names_and_sizes() {
        assert_eq!(
            quant_from_name("SmolLM2-135M-Instruct.Q4_1.gguf").as_deref(),
            Some("Q4_1")
        );
        assert_eq!(
            quant_from_name("Qwen3-27B-UD-Q4_K_M.gguf").as_deref(),
            Some("Q4_K_M")
        );
        assert_eq!(quant_from_name("model.gguf"), None);
        assert_eq!(size_label(134_515_008), "134.52M");
        assert_eq!(size_label(7_000_000_000), "7B");
        let meta = Meta::new();
        assert_eq!(details(&meta, "x.Q8_0.gguf").quantization_level, "Q8_0");
    }
}
