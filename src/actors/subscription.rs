//! `SubscriptionActor`: one per `Subscribe`. It sends the session's events
//! from the client's cursor (the backlog, read from the book) and then the
//! live ones the [`Bus`](super::bus::Bus) publishes after each commit, each as
//! `SubEvent { sub, event }`, deduplicated by id; last `SubEnded { sub,
//! reason }`.
//!
//! Its replies go to the connection's outgoing queue (`out`), awaited one at
//! a time: a client that reads slowly slows this actor, never the publisher.
//! While it waits, live events pile up in its bus queue, and when that is full
//! the bus ends it as `lagged` (it still sends what was queued, then
//! `SubEnded`). A lagged client resubscribes from the id after the last event
//! it saw.

use std::sync::Arc;

use actix::prelude::*;
use tokio::sync::mpsc;

use super::bus::{BusItem, EndReason, Subscriber};
use super::Shared;
use crate::session::SessionError;
use crate::wire::{EventId, Response, SessionId};

/// A backlog event larger than this (its postcard size) waits for its
/// connection's turn, and the turn is held until the connection's queue has
/// drained: however many subscriptions a client opens and does not read, at
/// most one large event is queued for it at a time (each subscription's copy
/// of a long session, queued towards a client that did not read, took a
/// 1 MB session's ten silent subscribers to 1.3 GB).
pub const LARGE_EVENT_BYTES: usize = 64 << 10;

/// Start delivering: sent by the connection once it has queued
/// `Subscribed { sub }`, so that reply comes before the first `SubEvent`.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Begin;

/// Stop. With `notify`, `SubEnded { reason: "unsubscribed" }` is sent first
/// (`Unsubscribe`); without, the connection is gone and nothing is sent.
#[derive(Message)]
#[rtype(result = "()")]
pub struct End {
    pub notify: bool,
}

pub struct SubscriptionActor {
    sub: u64,
    /// The id of the next event to send: later ones are new, earlier ones
    /// were sent already (from the backlog).
    next: EventId,
    out: mpsc::Sender<Response>,
    /// The book the backlog is read from, one event at a time as the client
    /// takes them (a copy of a whole long session per subscription, held
    /// while a client did not read, multiplied a session's size).
    shared: Shared,
    session: SessionId,
    /// The session's length when the subscriber registered: the backlog is
    /// `next..backlog_end`, the bus carries what comes after.
    backlog_end: EventId,
    /// The connection's turn to queue a large event (see [`LARGE_EVENT_BYTES`]).
    large: Arc<tokio::sync::Mutex<()>>,
    /// Until `Begin`: the bus registration (then it is the actor's stream).
    subscriber: Option<Subscriber>,
    ended: bool,
}

/// Registers a subscription of `session` from `cursor` and starts its actor
/// (idle until `Begin`). The registration and the backlog are taken under
/// one read lock of the book, so no commit falls between them.
pub fn start(
    shared: &Shared,
    session: SessionId,
    cursor: EventId,
    provisional: bool,
    out: mpsc::Sender<Response>,
    large: Arc<tokio::sync::Mutex<()>>,
) -> Result<(u64, Addr<SubscriptionActor>), SessionError> {
    let (backlog_end, subscriber) = {
        let book = shared.read();
        let len = book.live_len(session)?;
        if cursor > len {
            return Err(SessionError::CursorPastEnd {
                session,
                cursor,
                len,
            });
        }
        (len, shared.bus.subscribe(session, provisional))
    };
    let sub = subscriber.sub;
    let addr = SubscriptionActor {
        sub,
        next: cursor,
        out,
        shared: shared.clone(),
        session,
        backlog_end,
        large,
        subscriber: Some(subscriber),
        ended: false,
    }
    .start();
    Ok((sub, addr))
}

impl SubscriptionActor {
    /// Queues one reply for the client, holding this actor's other work
    /// until it is queued; a gone client stops the actor. At most one such
    /// wait is pending at a time (actix runs several in reverse order).
    fn send(&mut self, response: Response, ctx: &mut Context<Self>) {
        let out = self.out.clone();
        ctx.wait(
            async move { out.send(response).await.is_ok() }
                .into_actor(self)
                .map(|ok, this, ctx| {
                    if !ok {
                        this.ended = true;
                        ctx.stop();
                    }
                }),
        );
    }

    fn end(&mut self, reason: EndReason, ctx: &mut Context<Self>) {
        if self.ended {
            return;
        }
        self.ended = true;
        self.subscriber = None;
        log::debug!("subscription {} ended: {}", self.sub, reason.as_str());
        let out = self.out.clone();
        let last = Response::SubEnded {
            sub: self.sub,
            reason: reason.as_str().into(),
        };
        ctx.wait(
            async move {
                let _ = out.send(last).await;
            }
            .into_actor(self)
            .map(|_, _, ctx| ctx.stop()),
        );
    }
}

impl Actor for SubscriptionActor {
    type Context = Context<Self>;
}

impl Handler<Begin> for SubscriptionActor {
    type Result = ();

    fn handle(&mut self, _: Begin, ctx: &mut Context<Self>) {
        let Some(subscriber) = self.subscriber.take() else {
            return;
        };
        // One future for the whole backlog: it is sent in order before any
        // live event is looked at (`ctx.wait` holds the stream back). Each
        // event is read from the book when the client's queue has room for
        // it; committed events never change, so reading them late reads the
        // same. A session purged meanwhile ends the backlog there (the bus
        // then says `purged`).
        let (from, end) = (self.next, self.backlog_end);
        self.next = self.next.max(end);
        let (out, sub, shared, session, large) = (
            self.out.clone(),
            self.sub,
            self.shared.clone(),
            self.session,
            self.large.clone(),
        );
        ctx.wait(
            async move {
                for id in from..end {
                    let read = shared.read().read_range(session, id, id + 1);
                    let Some(event) = read.ok().and_then(|mut v| v.pop()) else {
                        break;
                    };
                    let large_one = postcard::experimental::serialized_size(&event)
                        .map_or(true, |n| n > LARGE_EVENT_BYTES);
                    let turn = if large_one {
                        Some(large.lock().await)
                    } else {
                        None
                    };
                    if out.send(Response::SubEvent { sub, event }).await.is_err() {
                        return false;
                    }
                    if turn.is_some() {
                        // Holds the turn until the queue is drained: the
                        // event was written to the client.
                        if out.reserve_many(out.max_capacity()).await.is_err() {
                            return false;
                        }
                    }
                }
                true
            }
            .into_actor(self)
            .map(move |ok, this, ctx| {
                if !ok {
                    this.ended = true;
                    ctx.stop();
                    return;
                }
                ctx.add_stream(futures_util::stream::unfold(
                    subscriber,
                    |mut s| async move { s.recv().await.map(|item| (item, s)) },
                ));
            }),
        );
    }
}

impl Handler<End> for SubscriptionActor {
    type Result = ();

    fn handle(&mut self, msg: End, ctx: &mut Context<Self>) {
        if msg.notify {
            self.end(EndReason::Unsubscribed, ctx);
        } else {
            self.ended = true;
            ctx.stop();
        }
    }
}

impl StreamHandler<BusItem> for SubscriptionActor {
    fn handle(&mut self, item: BusItem, ctx: &mut Context<Self>) {
        if self.ended {
            return;
        }
        match item {
            BusItem::Event(event) => {
                if event.event_id < self.next {
                    return;
                }
                self.next = event.event_id + 1;
                self.send(
                    Response::SubEvent {
                        sub: self.sub,
                        event,
                    },
                    ctx,
                );
            }
            BusItem::Provisional { channel, text } => self.send(
                Response::SubProvisional {
                    sub: self.sub,
                    channel,
                    text,
                },
                ctx,
            ),
            BusItem::Ended(reason) => self.end(reason, ctx),
        }
    }

    /// The stream ends only after `Ended`, which already stops the actor.
    fn finished(&mut self, _: &mut Context<Self>) {}
}
