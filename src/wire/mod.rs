//! The wire: every type that crosses a process boundary, and how it is framed.
//!
//! `Request` and `Response` are the session API (docs/protocol.md); `Event`
//! and `Record` are what a session's log holds; `LogRecord` is one entry of
//! wal.log; `codes` holds the small codes they carry (roles, channels,
//! finish reasons, ...) as types; `worker` is the worker pipe's requests and
//! replies. The same types travel as postcard on the unix socket and the
//! worker pipe, and as JSON on the browser transport. **Only this module
//! defines what crosses a process boundary.**
//!
//! Postcard encodes an enum variant by its index, so the order of every
//! variant below is part of the format: append new variants at the end, never
//! reorder. docs/protocol.md lists the order.

mod codes;
pub mod extras;
pub mod frame;
mod types;
pub mod worker;

pub use extras::{ExtrasError, SampleExtras, TokenLogprob};
pub use frame::{
    read_frame, read_frame_blocking, write_frame, write_frame_blocking, FrameError, MAX_FRAME_BYTES,
};
pub use types::*;

/// Encodes a value as postcard bytes.
pub fn to_postcard<T: serde::Serialize>(value: &T) -> Result<Vec<u8>, WireError> {
    postcard::to_stdvec(value).map_err(|e| WireError::Encode(e.to_string()))
}

/// Decodes postcard bytes; trailing bytes are an error, since a frame holds
/// exactly one value.
pub fn from_postcard<'a, T: serde::Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, WireError> {
    let (value, rest) =
        postcard::take_from_bytes(bytes).map_err(|e| WireError::Decode(e.to_string()))?;
    if !rest.is_empty() {
        return Err(WireError::Decode(format!(
            "{} trailing bytes after the value",
            rest.len()
        )));
    }
    Ok(value)
}

/// Errors of encoding and decoding.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("cannot encode: {0}")]
    Encode(String),
    #[error("cannot decode the request: {0}")]
    Decode(String),
}
