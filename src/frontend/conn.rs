//! `Connection`: one client connection's requests, the same on the unix
//! socket and on /web/ws. Requests run one at a time, in order; every reply
//! goes to the connection's outgoing queue (`out`), which one writer task
//! per connection turns into frames.
//!
//! A `Subscribe` leaves a `SubscriptionActor` behind that queues its
//! `SubEvent`s on the same `out` while later requests run, so a client reads
//! sub frames interleaved with replies, told apart by their variant.
//! Subscriptions belong to their connection: `Unsubscribe` names one of
//! this connection's, and closing the connection ends them all.
//!
//! The transport reads requests on a task of its own, so it sees the client
//! leave while a request runs, and says so on `gone`: a `Generate` or
//! `Complete` whose client left is dropped, which cancels its generation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use actix::Addr;
use tokio::sync::{mpsc, oneshot, watch};

use super::bucket::TokenBucket;
use crate::actors::registry::{Dispatch, DispatchComplete, DispatchStream, Registry, Subscribe};
use crate::actors::served::Served;
use crate::actors::session::STREAM_REPLY_CAPACITY;
use crate::actors::subscription::{Begin, End, SubscriptionActor};
use crate::wire::{Request, Response};

/// Replies and sub frames a connection may have queued for its writer.
/// Generation replies wait for room; a subscription waits too, and its bus
/// queue fills meanwhile (see `bus`).
pub const CONNECTION_QUEUE_FRAMES: usize = 64;

/// The most live subscriptions one connection may hold: each is an actor
/// and a bus queue, so a client cannot pile them up past this.
pub const MAX_SUBSCRIPTIONS_PER_CONNECTION: usize = 64;

/// The client is gone: its writer dropped the queue.
#[derive(Debug)]
pub struct Closed;

/// What a connection shares with the other connections of its listener.
#[derive(Clone)]
pub struct Listener {
    /// The models served; connections start on the first.
    pub served: Served,
    /// Meters the `Complete`s of all its connections together.
    pub completes: Arc<Mutex<TokenBucket>>,
}

impl Listener {
    pub fn new(served: Served) -> Listener {
        Listener {
            served,
            completes: Arc::new(Mutex::new(TokenBucket::per_listener(Instant::now()))),
        }
    }
}

pub struct Connection {
    /// The registry of the model this connection's requests go to.
    registry: Addr<Registry>,
    served: Served,
    out: mpsc::Sender<Response>,
    subs: HashMap<u64, Addr<SubscriptionActor>>,
    /// Meters this connection's `Complete`s.
    bucket: TokenBucket,
    /// Meters those of the whole listener.
    listener_bucket: Arc<Mutex<TokenBucket>>,
    /// Turns true when the transport saw the client leave.
    gone: watch::Receiver<bool>,
    /// Taken by a subscription's backlog while it queues a large event
    /// (`subscription::LARGE_EVENT_BYTES`), until this queue drains: at
    /// most one such event waits in it at a time.
    large: Arc<tokio::sync::Mutex<()>>,
}

impl Connection {
    /// A connection and the receiving end of its queue, for its writer.
    /// `gone` turns true when the client has left (its sender dropped
    /// without that means nothing).
    pub fn new(
        listener: &Listener,
        gone: watch::Receiver<bool>,
    ) -> (Connection, mpsc::Receiver<Response>) {
        let (out, rx) = mpsc::channel(CONNECTION_QUEUE_FRAMES);
        let conn = Connection {
            registry: listener.served.default_model().registry.clone(),
            served: listener.served.clone(),
            out,
            subs: HashMap::new(),
            bucket: TokenBucket::per_connection(Instant::now()),
            listener_bucket: listener.completes.clone(),
            gone,
            large: Arc::new(tokio::sync::Mutex::new(())),
        };
        (conn, rx)
    }

    /// Resolves when the client has left: the transport said so, or the
    /// writer could not write to it.
    async fn client_gone(&mut self) {
        let told = async {
            if self.gone.wait_for(|g| *g).await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            () = told => {}
            () = self.out.closed() => {}
        }
    }

    /// Moves the connection to the model `name` names (`UseModel`, or
    /// `?model=` on /web/ws).
    pub fn use_model(&mut self, name: &str) -> Result<(), String> {
        match self.served.find(name) {
            Some(m) => {
                self.registry = m.registry.clone();
                Ok(())
            }
            None => Err(self.served.unknown(name)),
        }
    }

    /// Queues one reply.
    pub async fn reply(&self, response: Response) -> Result<(), Closed> {
        self.out.send(response).await.map_err(|_| Closed)
    }

    /// Runs one request to its end: every reply is queued when this returns.
    pub async fn handle(&mut self, request: Request) -> Result<(), Closed> {
        match request {
            Request::Generate { .. } => {
                // If the client goes away, dropping `rx` cancels the
                // generation: told by the transport (a WebSocket Close, a
                // socket hung up) while it waits for the next reply, or
                // found when a reply cannot be queued.
                let (tx, mut rx) = mpsc::channel(STREAM_REPLY_CAPACITY);
                self.registry.do_send(DispatchStream {
                    request,
                    reply: tx,
                    provisional: false,
                    started: None,
                });
                loop {
                    let next = tokio::select! {
                        r = rx.recv() => r,
                        () = self.client_gone() => return Err(Closed),
                    };
                    match next {
                        Some(response) => self.reply(response).await?,
                        None => return Ok(()),
                    }
                }
            }
            Request::Subscribe {
                session,
                cursor,
                provisional,
            } => {
                self.subs.retain(|_, a| a.connected());
                if self.subs.len() >= MAX_SUBSCRIPTIONS_PER_CONNECTION {
                    return self
                        .reply(Response::err(format!(
                            "this connection holds {} subscriptions, the most one may: \
                             Unsubscribe one first",
                            self.subs.len()
                        )))
                        .await;
                }
                let started = self
                    .registry
                    .send(Subscribe {
                        session,
                        cursor,
                        provisional,
                        out: self.out.clone(),
                        large: self.large.clone(),
                    })
                    .await
                    .map_err(|e| format!("the daemon is shutting down: {e}"))
                    .and_then(|started| started.map_err(|e| e.to_string()));
                match started {
                    Ok((sub, addr)) => {
                        self.subs.insert(sub, addr.clone());
                        self.reply(Response::Subscribed { sub }).await?;
                        addr.do_send(Begin);
                        Ok(())
                    }
                    Err(message) => self.reply(Response::Err { message }).await,
                }
            }
            Request::Unsubscribe { sub } => match self.subs.remove(&sub) {
                Some(addr) if addr.connected() => {
                    // Queued before the actor is told, so `Unsubscribed`
                    // comes before its `SubEnded`.
                    self.reply(Response::Unsubscribed).await?;
                    addr.do_send(End { notify: true });
                    Ok(())
                }
                _ => {
                    self.reply(Response::err(format!(
                        "no subscription {sub} on this connection"
                    )))
                    .await
                }
            },
            Request::Complete { .. } => {
                let taken = TokenBucket::try_take_both(
                    &mut self.bucket,
                    &mut self
                        .listener_bucket
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()),
                    Instant::now(),
                );
                if let Err(retry_after_ms) = taken {
                    return self.reply(Response::Throttled { retry_after_ms }).await;
                }
                let (reply, answer) = oneshot::channel();
                self.registry.do_send(DispatchComplete { request, reply });
                // A client that leaves drops `answer`, which cancels the completion.
                let response = tokio::select! {
                    r = answer => r.unwrap_or_else(|_| Response::err("the daemon is shutting down")),
                    () = self.client_gone() => return Err(Closed),
                };
                self.reply(response).await
            }
            Request::UseModel { model } => {
                let response = match self.use_model(&model) {
                    Ok(()) => Response::Ack,
                    Err(message) => Response::Err { message },
                };
                self.reply(response).await
            }
            Request::Models => {
                let models = self.served.summaries();
                self.reply(Response::Models { models }).await
            }
            other => {
                let response = dispatch(&self.registry, other).await;
                self.reply(response).await
            }
        }
    }
}

/// One request, one reply.
pub async fn dispatch(registry: &Addr<Registry>, request: Request) -> Response {
    registry
        .send(Dispatch(request))
        .await
        .unwrap_or_else(|e| Response::err(format!("the daemon is shutting down: {e}")))
}

impl Drop for Connection {
    fn drop(&mut self) {
        for addr in self.subs.values() {
            addr.do_send(End { notify: false });
        }
    }
}
