//! The four routes: /web/rpc, /web/stream, /web/ws and /web/health. Each
//! handler authorizes (`auth`), then forwards to the registry the way the
//! socket does; statuses other than 200 come only from `WebError`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::Addr;
use actix_web::http::header;
use actix_web::web::{self, Bytes, BytesMut};
use actix_web::{HttpRequest, HttpResponse};
use futures_util::{Stream, StreamExt};
use serde::Deserialize;
use tokio::sync::{mpsc, watch};

use super::auth::{authorize, Policy, Presented, Route, PROTOCOL};
use super::error::WebError;
use crate::actors::lane::LaneHealth;
use crate::actors::registry::{DispatchStream, Registry};
use crate::actors::session::STREAM_REPLY_CAPACITY;
use crate::frontend::bucket::TokenBucket;
use crate::frontend::conn::{dispatch, Connection, Listener};
use crate::wire::{Record, Request, Response};

/// The largest request body of /web/rpc and /web/stream, and the largest
/// WebSocket message.
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// One served model, as the handlers see it.
pub struct ModelView {
    pub registry: Addr<Registry>,
    /// The model lane's state, reported by /web/health.
    pub lane: LaneHealth,
    /// What the compatible routes generate with.
    pub shared: crate::actors::Shared,
    /// The model they serve.
    pub model: super::compat::ModelInfo,
}

/// What every handler shares, looking at one model (`m()`): the default
/// one, until a handler picks the model a request names (`pick`). Cheap to
/// clone.
#[derive(Clone)]
pub struct WebState {
    pub policy: Arc<Policy>,
    /// Meters `Complete` on /web/rpc, for the whole listener.
    pub rpc_bucket: Arc<Mutex<TokenBucket>>,
    /// What the /web/ws connections share (their `Complete`s, metered together).
    pub ws: Listener,
    /// Every served model, the default first.
    pub models: Arc<Vec<ModelView>>,
    /// The one this state looks at.
    pub current: usize,
    /// Tags the response ids the compatible routes issue
    /// (`compat::response_ids`).
    pub ids: Arc<super::compat::response_ids::ResponseIds>,
    /// The /web/ws connections open, and the most kept for them (half of
    /// `--max-connections`, so WebSockets never take every slot from the
    /// HTTP routes).
    pub sockets: Arc<AtomicUsize>,
    pub max_sockets: usize,
}

impl WebState {
    /// The model this state looks at.
    pub fn m(&self) -> &ModelView {
        &self.models[self.current]
    }

    /// The state looking at the `i`th model.
    pub fn at(&self, i: usize) -> WebState {
        WebState {
            current: i,
            ..self.clone()
        }
    }

    /// The state looking at the model `name` names (its id, its file name,
    /// or "default"), if one does: the served models' one naming rule.
    pub fn pick(&self, name: &str) -> Option<WebState> {
        self.ws.served.position(name).map(|i| self.at(i))
    }
}

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/web/rpc", web::post().to(rpc))
        .route("/web/stream", web::post().to(stream))
        .route("/web/ws", web::get().to(ws))
        .route("/web/health", web::get().to(health));
}

pub(super) fn check(state: &WebState, route: Route, req: &HttpRequest) -> Result<(), WebError> {
    let h = req.headers();
    let text = |name: &str| h.get(name).and_then(|v| v.to_str().ok());
    let presented = Presented {
        host: text("host"),
        origin: text("origin"),
        authorization: text("authorization"),
        csrf: text("x-superfluid-csrf"),
        api_key: text("x-api-key"),
        protocols: h
            .get_all(header::SEC_WEBSOCKET_PROTOCOL)
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .collect(),
    };
    Ok(authorize(&state.policy, route, &presented)?)
}

/// How long a request's body may take to arrive whole, once its head came
/// (within actix's 5 s for the head): a client that stops sending mid-body
/// would hold its connection's slot for good.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// Reads the body, refusing one over the cap before reading it when it says
/// its length, and as soon as it passes the cap when it does not; a 408
/// when it has not arrived within [`BODY_TIMEOUT`].
pub(super) async fn read_body(req: &HttpRequest, payload: web::Payload) -> Result<Bytes, WebError> {
    read_body_capped(req, payload, MAX_BODY_BYTES).await
}

/// [`read_body`] with another cap.
pub(super) async fn read_body_capped(
    req: &HttpRequest,
    mut payload: web::Payload,
    max: usize,
) -> Result<Bytes, WebError> {
    let too_large = WebError::TooLarge { max };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large);
    }
    let read = async {
        let mut body = BytesMut::new();
        while let Some(chunk) = payload.next().await {
            let chunk = chunk.map_err(|e| WebError::Body(e.to_string()))?;
            if body.len() + chunk.len() > max {
                return Err(too_large);
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body.freeze())
    };
    tokio::time::timeout(BODY_TIMEOUT, read)
        .await
        .unwrap_or(Err(WebError::BodyTimeout {
            secs: BODY_TIMEOUT.as_secs(),
        }))
}

/// 200 with `{"ok": true, "lane": "loading" | "ready" | "respawning" |
/// "unloaded" | "unreachable", "wal": "ok" | "failed"}`: the daemon answers,
/// what its model lane's worker is doing, and whether its log still takes
/// commits; with `--rpc`, `"rpc": {"servers": N, "up": M}` too.
async fn health(req: HttpRequest, state: web::Data<WebState>) -> Result<HttpResponse, WebError> {
    check(&state, Route::Health, &req)?;
    let lane = state.m().lane.borrow().name();
    // The log writer: "failed" once a write or fdatasync failed (the daemon
    // then refuses every commit until restarted; docs/wal-format.md).
    let wal = state
        .m()
        .shared
        .wal
        .send(crate::actors::wal::GetWalStats)
        .await
        .map_or("failed", |s| if s.failed { "failed" } else { "ok" });
    let mut body = serde_json::json!({ "ok": true, "lane": lane, "wal": wal });
    // With --rpc: how many servers, and how many the last probe reached
    // (their addresses only in the token-checked Metrics: this route needs
    // no token).
    let rpc = state
        .m()
        .shared
        .rpc
        .lock()
        .map(|s| s.clone())
        .unwrap_or_default();
    if !rpc.is_empty() {
        let up = rpc.iter().filter(|s| s.down.is_none()).count();
        body["rpc"] = serde_json::json!({ "servers": rpc.len(), "up": up });
    }
    Ok(HttpResponse::Ok().json(body))
}

/// `?model=ID` on /web/rpc, /web/stream and /web/ws: the model the
/// requests go to (the first when absent).
#[derive(Debug, Deserialize)]
struct ModelQuery {
    model: Option<String>,
}

/// The state looking at the model the query names; 404 naming the served
/// models when it names none.
fn model_of(state: &WebState, req: &HttpRequest) -> Result<WebState, WebError> {
    let query = web::Query::<ModelQuery>::from_query(req.query_string())
        .map_err(|e| WebError::Body(format!("the query: {e}")))?;
    match query.into_inner().model {
        None => Ok(state.at(0)),
        Some(name) => state
            .pick(&name)
            .ok_or_else(|| WebError::NoModel(state.ws.served.unknown(&name))),
    }
}

/// One request, one reply.
async fn rpc(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, WebError> {
    check(&state, Route::Post, &req)?;
    let state = model_of(&state, &req)?;
    let body = read_body(&req, payload).await?;
    let response = match serde_json::from_slice::<Request>(&body) {
        Err(e) => Response::err(format!("not a request: {e}")),
        Ok(Request::Generate { .. }) => {
            Response::err("Generate streams: use /web/stream or /web/ws")
        }
        Ok(Request::Subscribe { .. } | Request::Unsubscribe { .. }) => {
            Response::err("subscriptions need a connection: use /web/ws")
        }
        Ok(Request::Models) => Response::Models {
            models: state.ws.served.summaries(),
        },
        Ok(Request::UseModel { .. }) => Response::err(
            "/web/rpc takes one request a call: name its model with ?model=ID \
             (UseModel moves a /web/ws connection)",
        ),
        Ok(request @ Request::Complete { .. }) => {
            let allowed = state
                .rpc_bucket
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .try_take(Instant::now());
            match allowed {
                Ok(()) => dispatch(&state.m().registry, request).await,
                Err(retry_after_ms) => Response::Throttled { retry_after_ms },
            }
        }
        Ok(request) => dispatch(&state.m().registry, request).await,
    };
    if let Response::Throttled { retry_after_ms } = response {
        return Err(WebError::Throttled { retry_after_ms });
    }
    Ok(HttpResponse::Ok().json(response))
}

/// The body of /web/stream.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamBody {
    session: u64,
    max_tokens: u32,
    #[serde(default)]
    provisional: bool,
}

fn sse(value: &serde_json::Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

const SSE_DONE: &str = "data: [DONE]\n\n";

/// One generation's replies as server-sent events. Dropping the stream (the
/// client closed it) drops the receiver, which cancels the generation.
fn sse_events(rx: mpsc::Receiver<Response>) -> impl Stream<Item = Result<Bytes, Infallible>> {
    futures_util::stream::unfold(Some(rx), |rx| async move {
        let mut rx = rx?;
        loop {
            let Some(response) = rx.recv().await else {
                let last = sse_last(serde_json::json!({
                    "error": "the generation ended without a summary"
                }));
                return Some((Ok(last), None));
            };
            match response {
                Response::Delta { event } => {
                    if matches!(
                        event.body,
                        Record::Generated { .. }
                            | Record::ToolUse { .. }
                            | Record::ToolResult { .. }
                            | Record::ToolParseFailure { .. }
                    ) {
                        let line = sse(&serde_json::json!({ "committed": event }));
                        return Some((Ok(line), Some(rx)));
                    }
                }
                Response::SubProvisional { channel, text, .. } => {
                    crate::logging::stage("http_provisional", &"-");
                    let line = sse(&serde_json::json!({
                        "provisional": { "channel": channel, "text": text }
                    }));
                    return Some((Ok(line), Some(rx)));
                }
                Response::Generated {
                    tokens_generated,
                    finish,
                    warm_prefix,
                    ..
                } => {
                    let last = sse_last(serde_json::json!({ "done": {
                        "tokens_generated": tokens_generated,
                        "finish": finish,
                        "warm_prefix": warm_prefix,
                    }}));
                    return Some((Ok(last), None));
                }
                Response::Err { message } => {
                    return Some((Ok(sse_last(serde_json::json!({ "error": message }))), None));
                }
                other => log::debug!("/web/stream: unexpected reply {other:?}"),
            }
        }
    })
}

/// The last event, then `[DONE]`.
fn sse_last(value: serde_json::Value) -> Bytes {
    let mut b = BytesMut::from(&sse(&value)[..]);
    b.extend_from_slice(SSE_DONE.as_bytes());
    b.freeze()
}

/// A generation as server-sent events.
async fn stream(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, WebError> {
    crate::logging::stage("http_stream", &"-");
    check(&state, Route::Post, &req)?;
    let state = model_of(&state, &req)?;
    let body = read_body(&req, payload).await?;
    let events = match serde_json::from_slice::<StreamBody>(&body) {
        Ok(b) => {
            let (tx, rx) = mpsc::channel(STREAM_REPLY_CAPACITY);
            state.m().registry.do_send(DispatchStream {
                request: Request::Generate {
                    session: b.session,
                    max_tokens: b.max_tokens,
                },
                reply: tx,
                provisional: b.provisional,
                started: None,
            });
            sse_events(rx).boxed_local()
        }
        Err(e) => {
            let last = sse_last(serde_json::json!({
                "error": format!("expected {{\"session\", \"max_tokens\", \"provisional\"}}: {e}")
            }));
            futures_util::stream::once(async move { Ok(last) }).boxed_local()
        }
    };
    Ok(HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .streaming(events))
}

/// A WebSocket speaking the session API as JSON text frames.
async fn ws(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, WebError> {
    check(&state, Route::Ws, &req)?;
    // The spec's route is "a WebSocket with the superfluid.v1 subprotocol":
    // a client that does not offer it speaks something else.
    let offered = req
        .headers()
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim() == PROTOCOL);
    if !offered {
        return Err(WebError::Handshake(format!(
            "/web/ws speaks the {PROTOCOL} subprotocol: offer it in Sec-WebSocket-Protocol"
        )));
    }
    let model = model_of(&state, &req)?.current;
    let open =
        SocketCount::take(&state.sockets, state.max_sockets).ok_or(WebError::TooManySockets {
            max: state.max_sockets,
        })?;
    let (response, session, messages) = actix_ws::handle_with_protocols(&req, payload, &[PROTOCOL])
        .map_err(|e| WebError::Handshake(e.to_string()))?;
    let socket = req
        .conn_data::<super::ConnFd>()
        .and_then(super::ConnFd::duplicate);
    actix_rt::spawn(ws_connection(
        state.ws.clone(),
        model,
        session,
        messages,
        socket,
        open,
    ));
    Ok(response)
}

/// One open /web/ws connection, counted while it lives.
struct SocketCount(Arc<AtomicUsize>);

impl SocketCount {
    /// Counts one more, unless `max` are open.
    fn take(open: &Arc<AtomicUsize>, max: usize) -> Option<SocketCount> {
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()
        .map(|_| SocketCount(open.clone()))
    }
}

impl Drop for SocketCount {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A /web/ws connection with nothing from its client for this long gets a
/// Ping; one that answers nothing (no Pong, no frame) for [`WS_IDLE_LIMIT`]
/// is closed: it holds a connection slot.
pub const WS_PING_EVERY: Duration = Duration::from_secs(20);
pub const WS_IDLE_LIMIT: Duration = Duration::from_secs(60);

/// Reads a /web/ws connection's frames until its client closes, leaves, goes
/// silent past [`WS_IDLE_LIMIT`] or breaks the protocol, handing requests to
/// `incoming` in order. Requests waiting for the request loop are held here
/// (at most [`WS_READ_AHEAD`] of them and [`MAX_BODY_BYTES`], past which
/// reading waits), so a Close or a Ping behind them is still seen at once:
/// at a Close the client is `gone`, which ends the connection as a hang-up
/// ends a socket's (a running `Generate` is cancelled and the loop stops);
/// what is held is handed over only while the loop still takes it.
async fn read_ws(
    mut messages: impl Stream<Item = Result<actix_ws::AggregatedMessage, actix_ws::ProtocolError>>
        + Unpin,
    mut session: actix_ws::Session,
    incoming: mpsc::Sender<WsIn>,
    closed_with: Arc<Mutex<Option<actix_ws::CloseReason>>>,
    gone: &watch::Sender<bool>,
) {
    use actix_ws::AggregatedMessage as M;
    let mut pending: VecDeque<WsIn> = VecDeque::new();
    let mut pending_bytes = 0usize;
    // False once the stream cannot go on (a broken frame): what is pending
    // is still handed over, the `Fatal` last.
    let mut reading = true;
    let mut heard = Instant::now();
    let mut tick = tokio::time::interval(WS_PING_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let front_bytes = |p: &VecDeque<WsIn>| p.front().map_or(0, WsIn::weight);
        tokio::select! {
            permit = incoming.reserve(), if !pending.is_empty() => {
                let Ok(permit) = permit else { return };
                pending_bytes -= front_bytes(&pending);
                if let Some(item) = pending.pop_front() {
                    permit.send(item);
                }
            }
            message = messages.next(), if reading
                && pending_bytes < MAX_BODY_BYTES
                && pending.len() < WS_READ_AHEAD =>
            {
                heard = Instant::now();
                let item = match message {
                    None => return,
                    Some(Ok(M::Text(text))) => WsIn::Text(text.to_string()),
                    Some(Ok(M::Binary(_))) => WsIn::Refused("send requests as JSON text frames"),
                    Some(Ok(M::Ping(bytes))) => {
                        let _ = session.pong(&bytes).await;
                        continue;
                    }
                    Some(Ok(M::Pong(_))) => continue,
                    Some(Ok(M::Close(reason))) => {
                        *closed_with.lock().unwrap_or_else(|e| e.into_inner()) = reason;
                        let _ = gone.send(true);
                        for item in pending {
                            if incoming.send(item).await.is_err() {
                                return;
                            }
                        }
                        return;
                    }
                    Some(Err(e)) => {
                        // Past the frame cap, or not WebSocket: the stream
                        // cannot go on. The Close says which (RFC 6455
                        // 7.4.1: 1009 too big, 1002 a protocol error).
                        reading = false;
                        let code = match e {
                            actix_ws::ProtocolError::Overflow => actix_ws::CloseCode::Size,
                            _ => actix_ws::CloseCode::Protocol,
                        };
                        *closed_with.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some(code.into());
                        WsIn::Fatal(format!("closing the connection: {e}"))
                    }
                };
                pending_bytes += item.weight();
                pending.push_back(item);
            }
            _ = tick.tick(), if reading => {
                if pending_bytes >= MAX_BODY_BYTES || pending.len() >= WS_READ_AHEAD {
                    // Not reading (the loop is behind): silence is ours.
                    heard = Instant::now();
                    continue;
                }
                if heard.elapsed() >= WS_IDLE_LIMIT {
                    log::info!("/web/ws: nothing from the client for {} s; closing", WS_IDLE_LIMIT.as_secs());
                    return;
                }
                if heard.elapsed() >= WS_PING_EVERY && session.ping(b"").await.is_err() {
                    return;
                }
            }
            else => return,
        }
    }
}

/// Requests a /web/ws reader holds for its busy request loop, at most (and
/// at most [`MAX_BODY_BYTES`] of them, each counted with [`WsIn::weight`]).
const WS_READ_AHEAD: usize = 1024;

impl WsIn {
    /// What holding it costs: its text and a frame's bookkeeping, so that
    /// many empty frames count too.
    fn weight(&self) -> usize {
        64 + match self {
            WsIn::Text(t) => t.len(),
            WsIn::Refused(_) => 0,
            WsIn::Fatal(m) => m.len(),
        }
    }
}

/// What the reading task of a /web/ws connection hands its request loop.
enum WsIn {
    Text(String),
    /// Answered with an `Err`; the connection goes on.
    Refused(&'static str),
    /// Answered with an `Err`; the connection closes.
    Fatal(String),
}

async fn ws_connection(
    listener: Listener,
    model: usize,
    session: actix_ws::Session,
    messages: actix_ws::MessageStream,
    socket: Option<super::ConnSocket>,
    open: SocketCount,
) {
    let messages = messages
        .max_frame_size(MAX_BODY_BYTES)
        .aggregate_continuations()
        .max_continuation_size(MAX_BODY_BYTES);
    let (gone_tx, gone) = watch::channel(false);
    let (mut conn, mut queue) = Connection::new(&listener, gone);
    let id = listener.served.all()[model].id.clone();
    if let Err(e) = conn.use_model(&id) {
        log::error!("/web/ws: {e}");
    }
    let mut writer = session.clone();
    // The client's Close, echoed in ours (RFC 6455 5.5.1); a normal closure
    // when the server closes first.
    let closed_with = Arc::new(Mutex::new(None::<actix_ws::CloseReason>));
    let echo = closed_with.clone();
    actix_rt::spawn(async move {
        while let Some(response) = queue.recv().await {
            let text = serde_json::to_string(&response).unwrap_or_else(|e| {
                serde_json::to_string(&Response::err(e.to_string())).unwrap_or_default()
            });
            if writer.text(text).await.is_err() {
                return;
            }
        }
        let reason = echo
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_else(|| actix_ws::CloseCode::Normal.into());
        let _ = writer.close(Some(reason)).await;
        // The Close frame is the response's last: the server closes the TCP
        // connection now (RFC 6455 7.1.1), not when actix's wait for the
        // client to close first runs out.
        if let Some(socket) = socket {
            socket.end_reading();
        }
    });
    // Messages are read on a task of their own, so a client that leaves is
    // seen even while a request runs (`gone`): it reads on (control frames,
    // and requests into `pending`, up to one body's worth of bytes) while
    // the request loop is busy, pings an idle client and closes a silent one.
    let (incoming, mut requests) = mpsc::channel::<WsIn>(1);
    actix_rt::spawn(async move {
        read_ws(messages, session, incoming, closed_with, &gone_tx).await;
        let _ = gone_tx.send(true);
        drop(open);
    });
    while let Some(item) = requests.recv().await {
        let done = match item {
            WsIn::Text(text) => match serde_json::from_str::<Request>(&text) {
                Ok(request) => conn.handle(request).await,
                Err(e) => {
                    conn.reply(Response::err(format!("not a request: {e}")))
                        .await
                }
            },
            WsIn::Refused(message) => conn.reply(Response::err(message)).await,
            WsIn::Fatal(message) => {
                let _ = conn.reply(Response::err(message)).await;
                break;
            }
        };
        if done.is_err() {
            break;
        }
    }
    // Dropping `conn` ends its subscriptions; the writer closes the socket
    // once everything queued is sent.
}
