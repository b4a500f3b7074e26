//! Images on the model's input (`--mmproj`): llama.cpp's multimodal library
//! (mtmd) lays an image blob out as positions and evaluates it into a
//! sequence's KV.
//!
//! An image is one unit on a span: the projector's layout of it (its own
//! wrapper tokens, and [`MEDIA_TOKEN`] for each position an embedding takes),
//! which the daemon asks for once (`MediaLayout`) and records in the
//! session's log. Whenever the KV is rebuilt the worker reads the blob again
//! from the media store (its hash checked: a flipped bit is refused, never
//! fed to the model), lays it out again, checks the layout is the one the
//! span holds, and evaluates it (`mtmd_helper_eval_chunks`: its text chunks
//! decoded as tokens, its image chunks encoded by the projector and decoded
//! as embeddings). Projectors whose positions are not one a token (M-RoPE)
//! are refused at load.

use std::path::{Path, PathBuf};
use std::time::Instant;

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::mtmd::{
    mtmd_default_marker, MtmdBitmap, MtmdContext, MtmdContextParams, MtmdEvalError,
    MtmdInputChunkType, MtmdInputChunks, MtmdInputText,
};

use super::error::RequestError;
use crate::media::MediaStore;
use crate::wire::worker::MEDIA_TOKEN;
use crate::wire::Token;

/// The projector and where the images are.
pub struct Vision {
    mtmd: MtmdContext,
    media: MediaStore,
    n_vocab: u32,
    path: PathBuf,
}

impl std::fmt::Debug for Vision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vision")
            .field("mmproj", &self.path)
            .field("media", &self.media.dir())
            .finish()
    }
}

impl Vision {
    /// Load the projector at `mmproj` for `model`; images are read from the
    /// media store under `sessions`.
    pub fn load(
        mmproj: &Path,
        model: &LlamaModel,
        threads: u32,
        media_dir: &Path,
    ) -> Result<Vision, String> {
        let path = mmproj
            .to_str()
            .ok_or_else(|| format!("{}: not a UTF-8 path", mmproj.display()))?;
        if !mmproj.is_file() {
            return Err(format!("{}: no such file", mmproj.display()));
        }
        let params = MtmdContextParams {
            use_gpu: false,
            print_timings: false,
            n_threads: threads as i32,
            media_marker: std::ffi::CString::new(mtmd_default_marker())
                .map_err(|e| e.to_string())?,
            image_min_tokens: -1,
            image_max_tokens: -1,
        };
        let mtmd = MtmdContext::init_from_file(path, model, &params).map_err(|e| {
            format!(
                "{}: llama.cpp could not load it as a projector for this model ({e})",
                mmproj.display()
            )
        })?;
        if !mtmd.support_vision() {
            return Err(format!(
                "{}: the projector has no vision encoder",
                mmproj.display()
            ));
        }
        if mtmd.decode_use_mrope() {
            return Err(format!(
                "{}: the projector places images with M-RoPE (positions other than one a \
                 token), which superfluid does not support",
                mmproj.display()
            ));
        }
        Ok(Vision {
            mtmd,
            media: MediaStore::at(media_dir),
            n_vocab: u32::try_from(model.vocab().n_tokens()).unwrap_or(0),
            path: mmproj.to_path_buf(),
        })
    }

    /// The blob's chunks: read (hash checked), decoded, preprocessed.
    fn chunks(&self, blob: &str) -> Result<MtmdInputChunks, RequestError> {
        let media = |e: String| RequestError::Media(format!("image {blob}: {e}"));
        let bytes = self
            .media
            .read_checked(blob)
            .map_err(|e| RequestError::Media(e.to_string()))?;
        check_decodable(&bytes).map_err(media)?;
        let bitmap = MtmdBitmap::from_buffer(&self.mtmd, &bytes, false)
            .map_err(|e| media(format!("cannot decode the image ({e})")))?;
        let text = MtmdInputText {
            text: mtmd_default_marker().to_string(),
            add_special: false,
            parse_special: true,
        };
        self.mtmd
            .tokenize(text, &[&bitmap])
            .map_err(|e| media(format!("the projector cannot take the image ({e})")))
    }

    /// `MediaLayout`: the positions the image takes, [`MEDIA_TOKEN`] for
    /// each embedding.
    pub fn layout(&self, blob: &str) -> Result<Vec<Token>, RequestError> {
        let chunks = self.chunks(blob)?;
        self.layout_of(blob, &chunks)
    }

    fn layout_of(&self, blob: &str, chunks: &MtmdInputChunks) -> Result<Vec<Token>, RequestError> {
        let media = |e: String| RequestError::Media(format!("image {blob}: {e}"));
        let mut out = Vec::new();
        for i in 0..chunks.len() {
            let Some(chunk) = chunks.get(i) else { break };
            match chunk.chunk_type() {
                MtmdInputChunkType::Text => {
                    for t in chunk.text_tokens().unwrap_or(&[]) {
                        // mtmd looks its wrapper tokens up by text and puts -1
                        // where the vocabulary lacks one.
                        match u32::try_from(t.0) {
                            Ok(id) if id < self.n_vocab => out.push(id),
                            _ => {
                                return Err(media(format!(
                                    "the projector {} wraps images in tokens this model's \
                                     vocabulary lacks",
                                    self.path.display()
                                )))
                            }
                        }
                    }
                }
                MtmdInputChunkType::Image => {
                    let n = chunk.n_tokens();
                    if chunk.n_positions() as usize != n {
                        return Err(media("its positions are not one an embedding".into()));
                    }
                    out.extend(std::iter::repeat_n(MEDIA_TOKEN, n));
                }
                MtmdInputChunkType::Audio => return Err(media("audio is not supported".into())),
            }
        }
        Ok(out)
    }

    /// The image's chunks, checked against `expect`: the layout the span
    /// holds (what the projector gave when the image was appended).
    pub fn prepare(&self, blob: &str, expect: &[Token]) -> Result<MtmdInputChunks, RequestError> {
        let chunks = self.chunks(blob)?;
        if self.layout_of(blob, &chunks)? != expect {
            return Err(RequestError::Media(format!(
                "image {blob}: the projector lays it out differently from the span that holds \
                 it (another projector than the one it was appended with?)"
            )));
        }
        Ok(chunks)
    }

    /// Evaluate prepared chunks into `seq` at positions `pos..pos + len`.
    pub fn eval(
        &mut self,
        ctx: &mut LlamaContext,
        chunks: &MtmdInputChunks,
        seq: u32,
        pos: u32,
        len: u32,
        n_batch: u32,
    ) -> Result<(), RequestError> {
        let started = Instant::now();
        let end = chunks
            .eval_chunks(
                &mut self.mtmd,
                ctx,
                pos as i32,
                seq as i32,
                n_batch as i32,
                false,
            )
            .map_err(|e| match e {
                // llama_decode's 1: no room in the KV cache, which the
                // scheduler makes and retries, as for text.
                MtmdEvalError::EvalFailure(1) => RequestError::KvFull {
                    n_ctx: ctx.n_ctx(),
                    tokens: len,
                },
                e => RequestError::Decode(format!("an image's evaluation failed ({e})")),
            })?;
        if i64::from(end) != i64::from(pos) + i64::from(len) {
            return Err(RequestError::Internal(format!(
                "an image evaluated to position {end}, not {}",
                u64::from(pos) + u64::from(len)
            )));
        }
        log::debug!(
            "image: {len} positions on sequence {seq} in {:.1} ms",
            started.elapsed().as_secs_f64() * 1e3
        );
        Ok(())
    }
}

/// The widest or tallest image decoded, and the most pixels: a small file
/// declaring a huge canvas is refused before any decoder allocates for it.
pub const MAX_IMAGE_SIDE: u32 = 8192;
pub const MAX_IMAGE_PIXELS: u64 = 40_000_000;

/// Refuses, before llama.cpp's decoder sees them, images it would not
/// decode itself (WebP: its helper would hand those to an ffmpeg process)
/// and images whose header declares more than [`MAX_IMAGE_SIDE`] a side or
/// [`MAX_IMAGE_PIXELS`] pixels.
pub fn check_decodable(bytes: &[u8]) -> Result<(), String> {
    use crate::media::{sniff, ImageKind};
    let (w, h) = match sniff(bytes) {
        Some(ImageKind::Png) => be_dims(bytes.get(16..24)).ok_or("a PNG without its header")?,
        Some(ImageKind::Gif) => {
            let d = bytes.get(6..10).ok_or("a GIF without its header")?;
            (
                u32::from(u16::from_le_bytes([d[0], d[1]])),
                u32::from(u16::from_le_bytes([d[2], d[3]])),
            )
        }
        Some(ImageKind::Jpeg) => jpeg_dims(bytes).ok_or("a JPEG without a frame header")?,
        Some(ImageKind::Webp) => {
            return Err("WebP images are not decoded here; send PNG, JPEG or GIF".into())
        }
        None => return Err("not a PNG, JPEG or GIF image".into()),
    };
    if w == 0
        || h == 0
        || w > MAX_IMAGE_SIDE
        || h > MAX_IMAGE_SIDE
        || u64::from(w) * u64::from(h) > MAX_IMAGE_PIXELS
    {
        return Err(format!(
            "the image is {w}x{h}; at most {MAX_IMAGE_SIDE} a side and {MAX_IMAGE_PIXELS} pixels"
        ));
    }
    Ok(())
}

fn be_dims(b: Option<&[u8]>) -> Option<(u32, u32)> {
    let b = b?;
    Some((
        u32::from_be_bytes(b.get(0..4)?.try_into().ok()?),
        u32::from_be_bytes(b.get(4..8)?.try_into().ok()?),
    ))
}

/// A JPEG's size, from its first start-of-frame marker.
fn jpeg_dims(b: &[u8]) -> Option<(u32, u32)> {
    let mut i = 2;
    while i + 9 < b.len() {
        if b[i] != 0xFF {
            return None;
        }
        let marker = b[i + 1];
        if marker == 0xFF {
            i += 1;
            continue;
        }
        let len = usize::from(u16::from_be_bytes([b[i + 2], b[i + 3]]));
        let sof = matches!(marker, 0xC0..=0xCF) && !matches!(marker, 0xC4 | 0xC8 | 0xCC);
        if sof {
            let h = u32::from(u16::from_be_bytes([b[i + 5], b[i + 6]]));
            let w = u32::from(u16::from_be_bytes([b[i + 7], b[i + 8]]));
            return Some((w, h));
        }
        if len < 2 {
            return None;
        }
        i += 2 + len;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::check_decodable;

    #[test]
    fn huge_canvases_and_webp_are_refused_before_decoding() {
        let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        png.extend(64u32.to_be_bytes());
        png.extend(48u32.to_be_bytes());
        assert!(check_decodable(&png).is_ok());
        png[16..20].copy_from_slice(&20000u32.to_be_bytes());
        assert!(check_decodable(&png).unwrap_err().contains("20000x48"));
        let webp = b"RIFF\0\0\0\0WEBPVP8 ".to_vec();
        assert!(check_decodable(&webp).unwrap_err().contains("WebP"));
        // A JPEG's size from its frame header, past an APP0 segment.
        let mut jpeg = vec![0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x04, 0x00, 0x00];
        jpeg.extend([
            0xFF, 0xC0, 0x00, 0x11, 0x08, 0x00, 0x20, 0x00, 0x30, 0x03, 0, 0,
        ]);
        assert!(check_decodable(&jpeg).is_ok());
        jpeg[13..15].copy_from_slice(&9000u16.to_be_bytes());
        assert!(check_decodable(&jpeg).is_err());
        assert!(check_decodable(b"GIF89a").is_err());
    }
}
