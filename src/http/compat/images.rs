//! Images on the compatible routes: an image sent inline (an OpenAI
//! `image_url` with a `data:` URI; an `http(s)` URL is refused, the daemon
//! makes no outbound requests) is checked like `PutMedia` (sniffed type,
//! cap), stored in the media store under its SHA-256 (so the worker reads it
//! from there, as for a session), and laid out by the worker's projector
//! (`MediaLayout`), before the conversation is rendered.

use std::collections::HashMap;

use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::{alphabet, Engine};

use super::chat::MsgImage;
use super::error::{ApiError, Family, Kind};
use crate::actors::lane::{media_layout, LayoutError};
use crate::http::routes::WebState;

/// Standard base64, padded or not.
const B64: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// The most images one request may carry.
pub const MAX_IMAGES: usize = 16;

/// Each image of a request, by its source text (the `data:` URI as sent),
/// resolved: stored and laid out.
#[derive(Debug, Default)]
pub struct Resolved(HashMap<String, MsgImage>);

impl Resolved {
    pub fn get(&self, source: &str) -> Option<&MsgImage> {
        self.0.get(source)
    }
}

/// The bytes and declared type of a `data:<mime>;base64,<data>` URI.
pub fn data_uri(family: Family, uri: &str) -> Result<(Vec<u8>, String), ApiError> {
    let bad = |m: &str| Err(ApiError::invalid(family, m.to_string()));
    let lower = uri
        .get(..8)
        .map(str::to_ascii_lowercase)
        .unwrap_or_default();
    if lower.starts_with("http://") || lower.starts_with("https:/") {
        return bad(
            "image URLs are not fetched (the daemon makes no outbound requests): send the image \
             inline as a data: URI (data:image/png;base64,...)",
        );
    }
    let Some(rest) = uri.strip_prefix("data:") else {
        return bad("an image must be a data: URI (data:image/png;base64,...)");
    };
    let Some((head, payload)) = rest.split_once(',') else {
        return bad("a data: URI needs a comma before its data");
    };
    let Some(mime) = head.strip_suffix(";base64") else {
        return bad("an image data: URI must be base64 (data:image/png;base64,...)");
    };
    let bytes = decode_base64(family, payload)?;
    Ok((bytes, mime.to_string()))
}

/// Base64 (standard alphabet, padding optional), its size capped before
/// it is decoded.
pub fn decode_base64(family: Family, data: &str) -> Result<Vec<u8>, ApiError> {
    if data.len() / 4 * 3 > crate::media::MAX_MEDIA_BYTES + 3 {
        return Err(ApiError::invalid(
            family,
            format!(
                "an image is at most {} bytes",
                crate::media::MAX_MEDIA_BYTES
            ),
        ));
    }
    B64.decode(data.trim())
        .map_err(|e| ApiError::invalid(family, format!("an image's base64 does not decode: {e}")))
}

/// Err (400) unless the model has a vision projector: checked at a
/// request's first image, before its bytes are looked at.
pub fn require_vision(state: &WebState, family: Family) -> Result<(), ApiError> {
    match state.m().shared.vision {
        Some(_) => Ok(()),
        None => Err(ApiError::invalid(
            family,
            "this model has no vision projector (serve it with --mmproj PATH), so images \
             cannot be read; send text only",
        )),
    }
}

/// What every route checks at each image it finds, before decoding it:
/// the model has a projector, and the request is within [`MAX_IMAGES`]
/// (`found` are the images taken so far).
pub fn next_image(state: &WebState, family: Family, found: usize) -> Result<(), ApiError> {
    require_vision(state, family)?;
    if found >= MAX_IMAGES {
        return Err(ApiError::invalid(
            family,
            format!("at most {MAX_IMAGES} images per request"),
        ));
    }
    Ok(())
}

/// Stores and lays out each image (`sources`: source text, bytes, declared
/// type). Refused with 400 when the model has no projector, an image is not
/// one (sniffed), or the projector cannot take it.
pub async fn resolve(
    state: &WebState,
    family: Family,
    sources: Vec<(String, Vec<u8>, String)>,
) -> Result<Resolved, ApiError> {
    let mut out = Resolved::default();
    if sources.is_empty() {
        return Ok(out);
    }
    if sources.len() > MAX_IMAGES {
        return Err(ApiError::invalid(
            family,
            format!("at most {MAX_IMAGES} images per request"),
        ));
    }
    require_vision(state, family)?;
    let shared = &state.m().shared;
    let Some(lane) = shared.vision.clone() else {
        return Err(ApiError::invalid(family, "no vision projector"));
    };
    for (source, bytes, mime) in sources {
        if out.0.contains_key(&source) {
            continue;
        }
        let store = shared.media.clone();
        let put = crate::actors::render_pool::run(move || store.put(&bytes, &mime))
            .await
            .ok_or_else(|| ApiError::invalid(family, "storing the image failed"))?;
        let blob = put.map_err(|e| ApiError::invalid(family, e.to_string()))?;
        let layout = media_layout(&lane, &blob).await.map_err(|e| match e {
            LayoutError::Lane(m) => ApiError::new(family, Kind::Unavailable, m),
            LayoutError::Refused(m) => ApiError::invalid(family, m),
        })?;
        out.0.insert(source, MsgImage { blob, layout });
    }
    Ok(out)
}
