//! The unix-socket frontend: frames of a `u32` little-endian length and a
//! postcard `Request`; one request at a time per connection, in order.
//! After a `Subscribe`, the connection also carries that subscription's
//! `SubEvent`/`SubEnded` frames between replies (see `conn`). At most
//! `--max-connections` at once; the next one gets an `Err` and is closed.
//!
//! The socket is created mode 0600 in a directory created 0700. A socket
//! file left by a dead daemon is replaced; one a live daemon answers on is
//! refused.

use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};

use super::conn::{Connection, Listener};
use crate::actors::served::Served;
use crate::wire::{
    from_postcard, read_frame, to_postcard, write_frame, FrameError, Request, Response,
    MAX_FRAME_BYTES,
};

#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("another superfluid daemon is listening on {0}; stop it or pass a different --socket")]
    InUse(PathBuf),
    #[error("{0} exists and is not a socket; remove it or pass a different --socket")]
    NotASocket(PathBuf),
    #[error("cannot listen on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Binds the socket, replacing a stale one and refusing a live one. Called
/// before the runtime starts (and before the log is touched), so a daemon
/// refused here changes nothing.
pub fn bind(path: &Path) -> Result<std::os::unix::net::UnixListener, SocketError> {
    let io = |source| SocketError::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() && !dir.exists() {
            std::fs::create_dir_all(dir).map_err(io)?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
        }
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        // Only a socket is ever replaced: a file, a directory or a link at
        // the path is the user's, and is refused.
        if !meta.file_type().is_socket() {
            return Err(SocketError::NotASocket(path.to_path_buf()));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(SocketError::InUse(path.to_path_buf()));
        }
        log::info!("replacing the stale socket {}", path.display());
        std::fs::remove_file(path).map_err(io)?;
    }
    // Bind with a umask that leaves no window in which the socket is open
    // to others, then set the mode explicitly as well.
    // SAFETY: umask only swaps the process's file mode mask.
    let old = unsafe { libc::umask(0o177) };
    let bound = std::os::unix::net::UnixListener::bind(path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old) };
    let listener = bound.map_err(io)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    listener.set_nonblocking(true).map_err(io)?;
    Ok(listener)
}

/// The identity (device, inode) of the socket file this daemon bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketId {
    dev: u64,
    ino: u64,
}

impl SocketId {
    /// The identity of the file at `path` now.
    pub fn of(path: &Path) -> Option<SocketId> {
        let m = std::fs::symlink_metadata(path).ok()?;
        m.file_type().is_socket().then(|| SocketId {
            dev: m.dev(),
            ino: m.ino(),
        })
    }

    /// Unlinks `path` only if it is still the socket this daemon bound (not
    /// one another daemon bound there since, nor anything else).
    pub fn remove_if_ours(self, path: &Path) {
        if SocketId::of(path) == Some(self) {
            let _ = std::fs::remove_file(path);
        } else {
            log::info!(
                "leaving {}: it is no longer the socket this daemon bound",
                path.display()
            );
        }
    }
}

/// The most connections the socket serves at once by default
/// (`--max-connections`).
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

/// Accepts connections until the listener fails; each runs on its own task.
/// Past `max_connections` live ones, a new connection gets one `Err` saying
/// so and is closed.
pub async fn serve(
    listener: std::os::unix::net::UnixListener,
    served: Served,
    max_connections: usize,
) {
    let listener = match UnixListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            log::error!("cannot serve the socket: {e}");
            return;
        }
    };
    let shared = Listener::new(served);
    let live = Arc::new(AtomicUsize::new(0));
    loop {
        match listener.accept().await {
            Ok((mut stream, _)) => {
                if live.load(Ordering::Relaxed) >= max_connections {
                    log::warn!("socket: {max_connections} connections open; refusing one more");
                    let refusal = Response::err(format!(
                        "the daemon serves at most {max_connections} socket connections at once \
                         (--max-connections); close one or try again later"
                    ));
                    actix_rt::spawn(async move {
                        let _ = send(&mut stream, &refusal).await;
                    });
                    continue;
                }
                live.fetch_add(1, Ordering::Relaxed);
                let (shared, live) = (shared.clone(), live.clone());
                actix_rt::spawn(async move {
                    connection(stream, &shared).await;
                    live.fetch_sub(1, Ordering::Relaxed);
                });
            }
            Err(e) => {
                log::error!("socket accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

/// Whether the peer of `fd` has closed its end entirely (`POLLHUP`), not
/// just shut down its writing half.
fn hung_up(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: 0,
        revents: 0,
    };
    // SAFETY: one valid pollfd, for a descriptor that stays open (borrowed)
    // during the call; a timeout of 0 never blocks.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLHUP | libc::POLLERR) != 0
}

/// Hands `item` to the request loop; while it waits there (a request is
/// running), a client that leaves is told to the connection. False when
/// the loop is gone.
async fn hand_over(
    incoming: &mpsc::Sender<Incoming>,
    item: Incoming,
    fd: std::os::fd::BorrowedFd<'_>,
    gone: &watch::Sender<bool>,
) -> bool {
    let permit = loop {
        tokio::select! {
            permit = incoming.reserve() => break permit,
            () = tokio::time::sleep(HANGUP_POLL) => {
                if !*gone.borrow() && hung_up(fd) {
                    let _ = gone.send(true);
                }
            }
        }
    };
    match permit {
        Ok(p) => {
            p.send(item);
            true
        }
        Err(_) => false,
    }
}

/// How often a half-closed connection is checked for the peer leaving.
const HANGUP_POLL: std::time::Duration = std::time::Duration::from_millis(100);

async fn send<W: tokio::io::AsyncWrite + Unpin>(
    stream: &mut W,
    response: &Response,
) -> Result<(), FrameError> {
    write_frame(stream, &encode_reply(response)).await
}

/// A reply's frame body. One over the frame cap (a `Read` of a huge
/// session) becomes an `Err` saying so, so the client gets an answer and
/// the connection stays usable instead of closing.
pub fn encode_reply(response: &Response) -> Vec<u8> {
    let bytes = match to_postcard(response) {
        Ok(b) => b,
        Err(e) => return to_postcard(&Response::err(e.to_string())).unwrap_or_default(),
    };
    if bytes.len() <= MAX_FRAME_BYTES {
        return bytes;
    }
    let message = format!(
        "the reply takes {} bytes, over the {MAX_FRAME_BYTES}-byte frame cap{}",
        bytes.len(),
        match response {
            Response::Events { .. } => ": Read from a later cursor, in parts",
            _ => "",
        }
    );
    to_postcard(&Response::err(message)).unwrap_or_default()
}

/// What the reading task hands the request loop.
enum Incoming {
    Frame(Vec<u8>),
    /// The client will send nothing more: end after what is queued.
    Eof,
    /// A frame over the cap: answered, then the connection closes.
    TooLarge {
        len: usize,
        max: usize,
    },
}

/// Reads requests on a task of its own and runs them through a
/// `Connection`, one at a time; a writer task turns its queue into frames,
/// so subscription frames interleave with replies. The reading task tells
/// the connection when the client has left (`gone`), even mid-request; a
/// client that only shut down its writing half still gets its replies.
async fn connection(stream: UnixStream, listener: &Listener) {
    let (mut reader, mut writer) = stream.into_split();
    let (gone_tx, gone) = watch::channel(false);
    let (mut conn, mut queue) = Connection::new(listener, gone);
    actix_rt::spawn(async move {
        while let Some(response) = queue.recv().await {
            if send(&mut writer, &response).await.is_err() {
                return;
            }
        }
    });
    let (incoming, mut requests) = mpsc::channel::<Incoming>(1);
    actix_rt::spawn(async move {
        loop {
            let item = match read_frame(&mut reader, MAX_FRAME_BYTES).await {
                Ok(Some(frame)) => Incoming::Frame(frame),
                Err(FrameError::TooLarge { len, max }) => Incoming::TooLarge { len, max },
                // End of input: the client left, or shut down only its
                // writing half and waits for its replies. The request loop
                // ends after what is queued (so the writer closes, and a
                // half-closed client reads its replies, then EOF); a full
                // close meanwhile is told to the request running.
                Ok(None) => Incoming::Eof,
                Err(e) => {
                    log::debug!("socket connection ended: {e}");
                    let _ = gone_tx.send(true);
                    return;
                }
            };
            let last = !matches!(item, Incoming::Frame(_));
            let fd = reader.as_ref().as_fd();
            if !hand_over(&incoming, item, fd, &gone_tx).await || last {
                // Until the request loop ends, a client that leaves is told.
                while !incoming.is_closed() && !*gone_tx.borrow() {
                    if hung_up(fd) {
                        let _ = gone_tx.send(true);
                        break;
                    }
                    tokio::select! {
                        () = tokio::time::sleep(HANGUP_POLL) => {}
                        () = incoming.closed() => {}
                    }
                }
                return;
            }
        }
    });
    while let Some(item) = requests.recv().await {
        let frame = match item {
            Incoming::Frame(frame) => frame,
            Incoming::Eof => return,
            Incoming::TooLarge { len, max } => {
                // The stream cannot be resynchronised past a bogus length.
                let msg = format!(
                    "frame of {len} bytes exceeds the {max}-byte cap; closing the connection"
                );
                let _ = conn.reply(Response::err(msg)).await;
                return;
            }
        };
        let done = match from_postcard::<Request>(&frame) {
            Ok(request) => conn.handle(request).await,
            Err(e) => conn.reply(Response::err(e.to_string())).await,
        };
        if done.is_err() {
            return;
        }
    }
}

/// Why a [`Client`] call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Wire(#[from] crate::wire::WireError),
    #[error(transparent)]
    Frame(#[from] crate::wire::FrameError),
    #[error("the daemon closed the connection")]
    Closed,
    /// The daemon refused the connection before reading a request (its
    /// `Err`, e.g. at `--max-connections`).
    #[error("{0}")]
    Refused(String),
}

/// A blocking client for the socket, for the CLI and tests.
pub struct Client {
    stream: std::os::unix::net::UnixStream,
}

impl Client {
    pub fn connect(path: &Path) -> std::io::Result<Client> {
        Ok(Client {
            stream: std::os::unix::net::UnixStream::connect(path)?,
        })
    }

    /// Sends a Generate and reads its replies: every `Delta`, then the
    /// last (`Generated` or `Err`).
    pub fn generate(&mut self, request: &Request) -> Result<Vec<Response>, ClientError> {
        self.send(request)?;
        let mut out = Vec::new();
        loop {
            let r = self.read()?;
            let last = !matches!(r, Response::Delta { .. });
            out.push(r);
            if last {
                return Ok(out);
            }
        }
    }

    /// Reads one reply.
    pub fn read(&mut self) -> Result<Response, ClientError> {
        match crate::wire::read_frame_blocking(&mut self.stream, MAX_FRAME_BYTES)? {
            Some(frame) => Ok(from_postcard(&frame)?),
            None => Err(ClientError::Closed),
        }
    }

    /// Sends one request and reads its reply.
    pub fn call(&mut self, request: &Request) -> Result<Response, ClientError> {
        self.send(request)?;
        self.read()
    }

    /// Writes `request`. When the write fails because the daemon already
    /// closed the connection, its last word is read instead: a daemon at
    /// `--max-connections` answers a new connection one `Err` and closes it
    /// before any request, and that `Err` (not "Broken pipe") is the reply.
    fn send(&mut self, request: &Request) -> Result<(), ClientError> {
        let bytes = to_postcard(request)?;
        match crate::wire::write_frame_blocking(&mut self.stream, &bytes) {
            Ok(()) => Ok(()),
            // Only a closed connection: after any other failure (a request
            // over the frame cap, nothing written) the daemon is waiting
            // for a request and a read would block.
            Err(crate::wire::FrameError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                match self.read() {
                    Ok(Response::Err { message }) => Err(ClientError::Refused(message)),
                    _ => Err(crate::wire::FrameError::Io(e).into()),
                }
            }
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{from_postcard, Event, Record};

    #[test]
    fn a_reply_over_the_frame_cap_is_an_err_naming_it() {
        let small = Response::Events { events: vec![] };
        assert_eq!(
            from_postcard::<Response>(&encode_reply(&small)).unwrap(),
            small
        );
        let text = "x".repeat(MAX_FRAME_BYTES / 4 + 1);
        let events = (0..4)
            .map(|i| Event {
                event_id: i,
                epoch: 1,
                ts_unix_ms: 0,
                body: Record::Appended {
                    text: text.clone(),
                    span: vec![],
                },
            })
            .collect();
        let reply = from_postcard::<Response>(&encode_reply(&Response::Events { events })).unwrap();
        match reply {
            Response::Err { message } => {
                assert!(
                    message.contains("frame cap") && message.contains("later cursor"),
                    "{message}"
                )
            }
            other => panic!("{other:?}"),
        }
    }
}
