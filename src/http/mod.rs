//! The browser transport (`--web 127.0.0.1:<port>`): the session API as JSON
//! over HTTP and WebSocket, on loopback only, behind a token minted at every
//! start. docs/web.md is the user's guide; the spec's "Over HTTP" and "In a
//! browser" sections are what it must serve.
//!
//! - [`auth`]: who may call (Host, token, Origin, CSRF), one pure function.
//! - [`error`]: `WebError`, the one place errors become HTTP statuses.
//! - [`page`]: the web UI at /web/, embedded from `src/http/page/`.
//! - [`routes`]: /web/rpc, /web/stream (server-sent events), /web/ws, /web/health.
//! - [`token`]: minting the token and writing `<sessions>/web-token`.
//! - [`compat`]: the OpenAI and Anthropic routes and /metrics, on the same
//!   listener (docs/compat.md).

pub mod auth;
pub mod compat;
pub mod error;
pub mod page;
pub mod routes;
pub mod token;

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use actix_web::{web, App, HttpServer};

use crate::actors::served::Served;
use crate::frontend::bucket::TokenBucket;
use crate::frontend::conn::Listener;

/// HTTP worker threads: the work is in the actors, these only move bytes.
const WEB_WORKERS: usize = 1;

/// How long the listener waits for a client's request head, its close, or
/// its next request on a kept-alive connection.
const CLIENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A `--web` connection's socket descriptor, kept in its connection data
/// (`HttpServer::on_connect`). actix's dispatcher ends a connection whose
/// response is done only when the client closes its side (or after
/// `CLIENT_TIMEOUT`), while a WebSocket client waits for the server to close
/// the TCP connection first (RFC 6455 7.1.1): /web/ws takes a duplicate of
/// the socket ([`ConnFd::duplicate`]) and, once its Close frame is sent,
/// stops the connection's reading with it; the dispatcher, seeing the end,
/// sends what it has queued and closes. Only WebSocket connections hold a
/// second descriptor.
#[derive(Clone, Copy)]
pub struct ConnFd(std::os::fd::RawFd);

impl ConnFd {
    /// An accepted TCP connection's descriptor.
    fn of(conn: &dyn std::any::Any) -> Option<ConnFd> {
        use std::os::fd::AsRawFd;
        let tcp = conn.downcast_ref::<actix_web::rt::net::TcpStream>()?;
        Some(ConnFd(tcp.as_raw_fd()))
    }

    /// A duplicate of the connection's socket. Call only from a handler of a
    /// request on this connection, before its first await: the dispatcher
    /// polling it holds the socket open, so the descriptor is this
    /// connection's and not a later one's that took its number.
    pub fn duplicate(&self) -> Option<ConnSocket> {
        // SAFETY: per the above, the descriptor is open and this
        // connection's while the handler runs; it is only borrowed to be
        // duplicated (F_DUPFD_CLOEXEC), never closed here.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.0) };
        let owned = fd.try_clone_to_owned().ok()?;
        Some(ConnSocket(std::net::TcpStream::from(owned)))
    }
}

/// A duplicate of a /web/ws connection's socket ([`ConnFd::duplicate`]).
pub struct ConnSocket(std::net::TcpStream);

impl ConnSocket {
    /// Ends the reading side (shutdown(2) SHUT_RD): the dispatcher's next
    /// read sees the end of the stream.
    pub fn end_reading(&self) {
        if let Err(e) = self.0.shutdown(std::net::Shutdown::Read) {
            log::debug!("shutting down a connection's reading: {e}");
        }
    }
}

/// Closes the connection after any 401 or 403, and after any answer to a
/// request without the credential (the health check, the page's files; a
/// WebSocket upgrade excepted): a client without the credential (or from a
/// refused origin) does not keep a connection open.
fn close_when_denied<S, B>(
    req: actix_web::dev::ServiceRequest,
    srv: &S,
) -> impl std::future::Future<Output = Result<actix_web::dev::ServiceResponse<B>, actix_web::Error>>
where
    S: actix_web::dev::Service<
        actix_web::dev::ServiceRequest,
        Response = actix_web::dev::ServiceResponse<B>,
        Error = actix_web::Error,
    >,
{
    // A request without the credential (the health check, the page's
    // files) is answered and its connection closed too: a keep-alive
    // connection that never authenticates would otherwise hold one of the
    // --max-connections slots for as long as it polls.
    let anonymous = !req
        .headers()
        .contains_key(actix_web::http::header::AUTHORIZATION);
    let call = srv.call(req);
    async move {
        let mut res = call.await?;
        let status = res.status();
        if status == actix_web::http::StatusCode::UNAUTHORIZED
            || status == actix_web::http::StatusCode::FORBIDDEN
            || (anonymous && status != actix_web::http::StatusCode::SWITCHING_PROTOCOLS)
        {
            res.response_mut()
                .head_mut()
                .set_connection_type(actix_web::http::ConnectionType::Close);
        }
        Ok(res)
    }
}

/// `--web` and `--web-origin`.
#[derive(Debug, Clone)]
pub struct WebConfig {
    pub addr: SocketAddr,
    pub origins: Vec<String>,
    /// `--api-key`: also accepted by the compatible routes.
    pub api_key: Option<String>,
    /// `--max-connections`: connections served at once; more wait in the
    /// listen backlog.
    pub max_connections: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(
        "--web {0}: the browser transport listens on loopback only (127.0.0.1, ::1); \
         use --web 127.0.0.1:<port>"
    )]
    NotLoopback(SocketAddr),
    #[error("--web {addr}: cannot listen: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot mint the web token: {0}")]
    Random(getrandom::Error),
    #[error("cannot write the web token to {path}: {source}")]
    Token {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start the web listener: {0}")]
    Server(std::io::Error),
    #[error(transparent)]
    ResponseKey(#[from] compat::response_ids::KeyError),
}

/// Refuses a non-loopback address. Checked before anything starts.
pub fn check_addr(addr: SocketAddr) -> Result<(), StartError> {
    if addr.ip().is_loopback() {
        Ok(())
    } else {
        Err(StartError::NotLoopback(addr))
    }
}

/// Binds the listener (before the log is touched, like the socket).
pub fn bind(addr: SocketAddr) -> Result<TcpListener, StartError> {
    check_addr(addr)?;
    let listener = TcpListener::bind(addr).map_err(|source| StartError::Bind { addr, source })?;
    listener
        .set_nonblocking(true)
        .map_err(|source| StartError::Bind { addr, source })?;
    Ok(listener)
}

/// The running listener.
pub struct Web {
    pub addr: SocketAddr,
    pub token_path: PathBuf,
    /// The URL that opens the page, token included.
    pub page_url: String,
    pub handle: actix_web::dev::ServerHandle,
}

/// What the web listener needs from the sessions directory, written and
/// read before anything starts (no `Boot` is committed and nothing says
/// "serving" when one of them fails): the token, minted and written, the
/// address file, and the response-id key.
pub struct Prepared {
    addr: SocketAddr,
    token: String,
    token_path: PathBuf,
    ids: compat::response_ids::ResponseIds,
}

/// Mints and writes the token and the address file for `listener`, and
/// opens the response-id key.
pub fn prepare(listener: &TcpListener, sessions: &Path) -> Result<Prepared, StartError> {
    let addr = listener.local_addr().map_err(StartError::Server)?;
    let token = token::mint().map_err(StartError::Random)?;
    let token_path = token::write(sessions, &token).map_err(|source| StartError::Token {
        path: sessions.join(token::TOKEN_FILE),
        source,
    })?;
    token::write_addr(sessions, addr).map_err(|source| StartError::Token {
        path: sessions.join(token::ADDR_FILE),
        source,
    })?;
    let ids = compat::response_ids::ResponseIds::open(sessions)?;
    Ok(Prepared {
        addr,
        token,
        token_path,
        ids,
    })
}

/// Starts serving on `listener` with what [`prepare`] made. Runs inside
/// the actix system.
pub fn start(
    listener: TcpListener,
    prepared: Prepared,
    config: &WebConfig,
    served: Served,
    infos: Vec<compat::ModelInfo>,
) -> Result<Web, StartError> {
    let Prepared {
        addr,
        token,
        token_path,
        ids,
    } = prepared;
    let page_url = page::url(addr, &token);
    let models = served
        .all()
        .iter()
        .zip(infos)
        .map(|(m, model)| routes::ModelView {
            registry: m.registry.clone(),
            lane: m.shared.lane.clone(),
            shared: m.shared.clone(),
            model,
        })
        .collect();
    let state = web::Data::new(routes::WebState {
        policy: Arc::new(
            auth::Policy::new(token, addr, config.origins.clone())
                .with_api_key(config.api_key.clone()),
        ),
        rpc_bucket: Arc::new(Mutex::new(TokenBucket::per_listener(Instant::now()))),
        ws: Listener::new(served),
        models: Arc::new(models),
        current: 0,
        ids: Arc::new(ids),
        sockets: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        max_sockets: (config.max_connections / 2).max(1),
    });
    let server = HttpServer::new(move || {
        App::new()
            .app_data(state.clone())
            .wrap_fn(close_when_denied)
            .configure(routes::configure)
            .configure(page::configure)
            .configure(compat::configure)
            .default_service(web::to(compat::no_route))
    })
    .on_connect(|conn, data| {
        if let Some(fd) = ConnFd::of(conn) {
            data.insert(fd);
        }
    })
    .workers(WEB_WORKERS)
    .max_connections(config.max_connections)
    // A client gets this long to send a request's head, and to close once
    // answered; an idle keep-alive connection closes after as long.
    .client_request_timeout(CLIENT_TIMEOUT)
    .client_disconnect_timeout(CLIENT_TIMEOUT)
    .keep_alive(CLIENT_TIMEOUT)
    .disable_signals()
    .shutdown_timeout(1)
    .listen(listener)
    .map_err(StartError::Server)?
    .run();
    let handle = server.handle();
    actix_rt::spawn(server);
    Ok(Web {
        addr,
        token_path,
        page_url,
        handle,
    })
}
