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

/// Reading one frame, whatever does the reading: the header, then the body.
/// A reader reads into [`FrameReader::buf`] and reports what it got to
/// [`FrameReader::filled`], until that gives the frame (or the clean EOF).
struct FrameReader {
    max: usize,
    header: [u8; 4],
    /// The body so far and the length the header gave, once the header is
    /// in. The body grows by at most [`GROW`] ahead of the bytes read: a
    /// header naming 64 MiB allocates what is sent, not what it names.
    body: Option<(Vec<u8>, usize)>,
    /// Bytes of the header, then of the body, read so far.
    got: usize,
}

/// How far a frame's body buffer grows ahead of the bytes read.
const GROW: usize = 1 << 20;

/// Where a [`FrameReader`] stands.
enum Progress {
    /// More bytes are needed.
    More,
    /// The frame is whole, or (None) the stream ended cleanly before it began.
    Done(Option<Vec<u8>>),
}

impl FrameReader {
    fn new(max: usize) -> FrameReader {
        FrameReader {
            max,
            header: [0; 4],
            body: None,
            got: 0,
        }
    }

    /// Where the next bytes go (never empty).
    fn buf(&mut self) -> &mut [u8] {
        match &mut self.body {
            None => &mut self.header[self.got..],
            Some((body, want)) => {
                if self.got == body.len() {
                    let grow = (*want - body.len()).min(GROW);
                    body.resize(body.len() + grow, 0);
                }
                &mut body[self.got..]
            }
        }
    }

    /// `n` bytes were read into [`buf`](Self::buf); 0 is the end of the
    /// stream. The length is checked against the cap before the body is
    /// allocated.
    fn filled(&mut self, n: usize) -> Result<Progress, FrameError> {
        let got = self.got;
        if n == 0 {
            return match &self.body {
                None if got == 0 => Ok(Progress::Done(None)),
                None => Err(FrameError::Truncated { expected: 4, got }),
                Some((_, want)) => Err(FrameError::Truncated {
                    expected: *want,
                    got,
                }),
            };
        }
        self.got += n;
        match &mut self.body {
            None if self.got == 4 => {
                let len = u32::from_le_bytes(self.header) as usize;
                if len > self.max {
                    return Err(FrameError::TooLarge { len, max: self.max });
                }
                self.got = 0;
                if len == 0 {
                    return Ok(Progress::Done(Some(Vec::new())));
                }
                self.body = Some((Vec::with_capacity(len.min(GROW)), len));
            }
            Some((body, want)) if self.got == *want => {
                return Ok(Progress::Done(Some(std::mem::take(body))));
            }
            _ => {}
        }
        Ok(Progress::More)
    }
}

/// The length prefix of a frame holding `body`; Err over [`MAX_FRAME_BYTES`].
fn header(body: &[u8]) -> Result<[u8; 4], FrameError> {
    if body.len() > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge {
            len: body.len(),
            max: MAX_FRAME_BYTES,
        });
    }
    Ok((body.len() as u32).to_le_bytes())
}

/// A whole frame (the length prefix, then `body`) in one buffer, for one write.
pub fn encode_frame(body: &[u8]) -> Result<Vec<u8>, FrameError> {
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&header(body)?);
    frame.extend_from_slice(body);
    Ok(frame)
}

/// Reads one frame. `Ok(None)` is a clean EOF before the first byte of a frame.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
) -> Result<Option<Vec<u8>>, FrameError> {
    let mut reader = FrameReader::new(max);
    loop {
        let n = r.read(reader.buf()).await?;
        if let Progress::Done(frame) = reader.filled(n)? {
            return Ok(frame);
        }
    }
}

/// Writes one frame and flushes it.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, body: &[u8]) -> Result<(), FrameError> {
    w.write_all(&header(body)?).await?;
    w.write_all(body).await?;
    w.flush().await?;
    Ok(())
}

/// Blocking twin of [`read_frame`], for the worker pipe and CLI clients.
pub fn read_frame_blocking<R: Read>(r: &mut R, max: usize) -> Result<Option<Vec<u8>>, FrameError> {
    let mut reader = FrameReader::new(max);
    loop {
        let n = r.read(reader.buf())?;
        if let Progress::Done(frame) = reader.filled(n)? {
            return Ok(frame);
        }
    }
}

/// Blocking twin of [`write_frame`].
pub fn write_frame_blocking<W: Write>(w: &mut W, body: &[u8]) -> Result<(), FrameError> {
    w.write_all(&header(body)?)?;
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

    /// A header naming a large frame allocates what arrives, not what it
    /// names: a client of the socket could make the daemon allocate 64 MiB
    /// per connection with four bytes.
    #[test]
    fn a_large_header_allocates_only_what_is_sent() {
        struct Asked<'a> {
            bytes: &'a [u8],
            largest: usize,
        }
        impl Read for Asked<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                self.largest = self.largest.max(buf.len());
                Read::read(&mut self.bytes, buf)
            }
        }
        let len = 60 << 20;
        let mut bytes = (len as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(&[7; 3000]);
        let mut r = Asked {
            bytes: &bytes,
            largest: 0,
        };
        match read_frame_blocking(&mut r, 64 << 20) {
            Err(FrameError::Truncated { expected, got }) => {
                assert_eq!((expected, got), (len, 3000))
            }
            other => panic!("{other:?}"),
        }
        assert!(r.largest <= GROW, "asked for {} bytes at once", r.largest);
        // A frame over several growths reads whole.
        let body: Vec<u8> = (0..(3 * GROW + 5)).map(|i| i as u8).collect();
        let framed = frame(&body);
        let mut r = &framed[..];
        assert_eq!(
            read_frame_blocking(&mut r, 64 << 20).unwrap().unwrap(),
            body
        );
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

    #[test]
    fn a_frame_read_a_byte_at_a_time() {
        struct Trickle<'a>(&'a [u8]);
        impl Read for Trickle<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                let n = buf.len().min(self.0.len()).min(1);
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let mut bytes = frame(b"hello");
        bytes.extend(encode_frame(b"").unwrap());
        let mut r = Trickle(&bytes);
        assert_eq!(read_frame_blocking(&mut r, 100).unwrap().unwrap(), b"hello");
        assert_eq!(read_frame_blocking(&mut r, 100).unwrap().unwrap(), b"");
        assert!(read_frame_blocking(&mut r, 100).unwrap().is_none());
        assert_eq!(encode_frame(b"hello").unwrap(), frame(b"hello"));
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
