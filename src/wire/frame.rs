//! Length-prefixed frames for the unix socket and the worker pipe: a `u32`
//! little-endian length, then that many bytes of postcard.
//!
//! The length is checked against the cap before anything is allocated, and a
//! clean EOF (between frames) is told apart from an EOF inside a frame.

use std::io::{self, Read, Write};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The largest frame either side accepts.
pub const MAX_FRAME_BYTES: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the {max}-byte cap")]
    TooLarge { len: usize, max: usize },
    #[error("connection closed inside a frame ({got} of {expected} bytes)")]
    Truncated { expected: usize, got: usize },
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
}

/// The state of reading one frame's header and body, shared by the blocking
/// and the async readers.
fn check_len(header: [u8; 4], max: usize) -> Result<usize, FrameError> {
    let len = u32::from_le_bytes(header) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    Ok(len)
}

/// Reads one frame. `Ok(None)` is a clean EOF before the first byte of a frame.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
) -> Result<Option<Vec<u8>>, FrameError> {
    let mut header = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut header[got..]).await?;
        if n == 0 {
            return if got == 0 {
                Ok(None)
            } else {
                Err(FrameError::Truncated { expected: 4, got })
            };
        }
        got += n;
    }
    let len = check_len(header, max)?;
    let mut body = vec![0u8; len];
    let mut got = 0;
    while got < len {
        let n = r.read(&mut body[got..]).await?;
        if n == 0 {
            return Err(FrameError::Truncated { expected: len, got });
        }
        got += n;
    }
    Ok(Some(body))
}

/// Writes one frame and flushes it.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, body: &[u8]) -> Result<(), FrameError> {
    if body.len() > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge {
            len: body.len(),
            max: MAX_FRAME_BYTES,
        });
    }
    w.write_all(&(body.len() as u32).to_le_bytes()).await?;
    w.write_all(body).await?;
    w.flush().await?;
    Ok(())
}

/// Blocking twin of [`read_frame`], for the worker pipe and CLI clients.
pub fn read_frame_blocking<R: Read>(r: &mut R, max: usize) -> Result<Option<Vec<u8>>, FrameError> {
    let mut header = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut header[got..])?;
        if n == 0 {
            return if got == 0 {
                Ok(None)
            } else {
                Err(FrameError::Truncated { expected: 4, got })
            };
        }
        got += n;
    }
    let len = check_len(header, max)?;
    let mut body = vec![0u8; len];
    let mut got = 0;
    while got < len {
        let n = r.read(&mut body[got..])?;
        if n == 0 {
            return Err(FrameError::Truncated { expected: len, got });
        }
        got += n;
    }
    Ok(Some(body))
}

/// Blocking twin of [`write_frame`].
pub fn write_frame_blocking<W: Write>(w: &mut W, body: &[u8]) -> Result<(), FrameError> {
    if body.len() > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge {
            len: body.len(),
            max: MAX_FRAME_BYTES,
        });
    }
    w.write_all(&(body.len() as u32).to_le_bytes())?;
    w.write_all(body)?;
    w.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(body: &[u8]) -> Vec<u8> {
        let mut v = (body.len() as u32).to_le_bytes().to_vec();
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn round_trip_and_clean_eof() {
        let mut bytes = frame(b"hello");
        bytes.extend(frame(b""));
        let mut r = &bytes[..];
        assert_eq!(read_frame_blocking(&mut r, 100).unwrap().unwrap(), b"hello");
        assert_eq!(read_frame_blocking(&mut r, 100).unwrap().unwrap(), b"");
        assert!(read_frame_blocking(&mut r, 100).unwrap().is_none());
    }

    #[test]
    fn eof_inside_header_and_body_is_truncated() {
        let bytes = frame(b"hello");
        for cut in 1..bytes.len() {
            let mut r = &bytes[..cut];
            match read_frame_blocking(&mut r, 100) {
                Err(FrameError::Truncated { .. }) => {}
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
    }

    #[test]
    fn cap_is_checked_before_allocating() {
        // A u32::MAX length must fail at once, not try to allocate 4 GiB.
        let bytes = u32::MAX.to_le_bytes();
        let mut r = &bytes[..];
        match read_frame_blocking(&mut r, MAX_FRAME_BYTES) {
            Err(FrameError::TooLarge { len, .. }) => assert_eq!(len, u32::MAX as usize),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn async_reader_matches_blocking_one() {
        let mut bytes = frame(b"abc");
        bytes.extend_from_slice(&[9, 0]);
        let mut r = &bytes[..];
        assert_eq!(read_frame(&mut r, 10).await.unwrap().unwrap(), b"abc");
        assert!(matches!(
            read_frame(&mut r, 10).await,
            Err(FrameError::Truncated {
                expected: 4,
                got: 2
            })
        ));
    }
}
