//! A stored response followed as it is written: `GET
//! /v1/responses/{id}?stream=true&starting_after=N` replays the stream's
//! events after sequence number N from the log and continues live, and
//! `POST /v1/responses/{id}/cancel` stops a response in flight and answers
//! it once its generation has ended (docs/responses.md).
//!
//! Both read the log first and then take the events the session commits
//! next from the [`Bus`](crate::actors::bus::Bus): the subscription is made
//! before the read, so an event committed in between arrives live and is
//! dropped as a copy by its id; none is missed. A response's output ends
//! with its generation's last record (a finish code other than open), with
//! the next response's input, or, for a generation that ended without a last
//! record (a worker crash, a restart), when the session stops generating.

use std::collections::VecDeque;
use std::time::Duration;

use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse};
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::mpsc;

use super::error::{ApiError, Family, Kind};
use super::responses::{
    call, inspect, is_output, load, not_found, open_stored, owner, read, Replay, Resolved,
    StoredResponse,
};
use super::{authorize, event_stream, sse};
use crate::actors::bus::{BusItem, EndReason, Subscriber};
use crate::http::routes::WebState;
use crate::wire::{Event, EventId, Request, SessionId};

const F: Family = Family::OpenAi;

/// How long a follower waits for the next event before it asks whether the
/// session still generates.
const QUIET: Duration = Duration::from_millis(500);
/// How long it then waits for events already queued.
const DRAIN: Duration = Duration::from_millis(20);
/// The most a cancel waits for the generation to end before it answers.
const CANCEL_WAIT: Duration = Duration::from_secs(30);

/// The query of `GET /v1/responses/{id}`.
#[derive(Debug, Deserialize)]
pub struct RetrieveQuery {
    #[serde(default)]
    pub stream: bool,
    pub starting_after: Option<u64>,
}

/// The events a session commits from event `next` on, live.
struct Follow {
    session: SessionId,
    sub: Subscriber,
    next: EventId,
    backlog: VecDeque<Event>,
    idle: bool,
}

impl Follow {
    fn new(session: SessionId, sub: Subscriber, next: EventId) -> Follow {
        Follow {
            session,
            sub,
            next,
            backlog: VecDeque::new(),
            idle: false,
        }
    }

    /// Subscribes again and reads what the old subscription missed from the
    /// log (after it lagged).
    async fn catch_up(&mut self, state: &WebState) -> Result<(), ApiError> {
        self.sub = state.m().shared.bus.subscribe(self.session, false);
        let events = read(state, self.session).await?;
        self.backlog
            .extend(events.into_iter().skip(self.next as usize));
        Ok(())
    }

    /// The session's next committed event; None once it stopped generating
    /// and nothing more came, or the session went away.
    async fn next(&mut self, state: &WebState) -> Option<Event> {
        loop {
            if let Some(e) = self.backlog.pop_front() {
                if e.event_id >= self.next {
                    self.next = e.event_id + 1;
                    return Some(e);
                }
                continue;
            }
            let wait = if self.idle { DRAIN } else { QUIET };
            match actix_rt::time::timeout(wait, self.sub.recv()).await {
                Ok(Some(BusItem::Event(e))) if e.event_id < self.next => {}
                Ok(Some(BusItem::Event(e))) if e.event_id == self.next => {
                    self.next += 1;
                    return Some(e);
                }
                // A gap (not expected): the log fills it.
                Ok(Some(BusItem::Event(_))) | Ok(Some(BusItem::Ended(EndReason::Lagged))) => {
                    self.catch_up(state).await.ok()?;
                }
                Ok(Some(BusItem::Provisional { .. })) => {}
                Ok(Some(BusItem::Ended(_))) | Ok(None) => return None,
                Err(_) if self.idle => return None,
                Err(_) => {
                    // Everything a finished generation committed was
                    // published before it stopped: drain, then end.
                    let generating = matches!(
                        inspect(state, self.session).await,
                        Ok(Some(i)) if i.generating
                    );
                    self.idle = !generating;
                }
            }
        }
    }
}

/// Where a follower's events go.
enum Sink {
    Discard,
    /// Server-sent events, those after sequence number `after` only.
    Stream {
        tx: mpsc::Sender<Bytes>,
        after: Option<u64>,
    },
}

impl Sink {
    /// False once the client has gone.
    async fn emit(&self, events: Vec<Value>) -> bool {
        let Sink::Stream { tx, after } = self else {
            return true;
        };
        for e in events {
            let seq = e["sequence_number"].as_u64().unwrap_or(0);
            if after.is_some_and(|n| seq <= n) {
                continue;
            }
            let ty = e["type"].as_str().unwrap_or("").to_owned();
            if tx.send(sse(Some(&ty), &e)).await.is_err() {
                return false;
            }
        }
        true
    }
}

/// The response `id` as the log holds it, and a subscription to its
/// session made before the read, so nothing committed in between is missed.
async fn open_followed(r: &Resolved, id: &str) -> Result<(Subscriber, StoredResponse), ApiError> {
    let sub = r.state.m().shared.bus.subscribe(r.session, false);
    Ok((sub, open_stored(r, id).await?))
}

/// Follows a stored response to its end, its stream's events (sequence
/// numbers from 0) going to `sink`; the response object as it ended.
async fn follow(state: &WebState, sub: Subscriber, sr: StoredResponse, sink: &Sink) -> Value {
    let mut replay = Replay::new(state, &sr);
    if !sink.emit(replay.em.start()).await {
        return replay.em.response();
    }
    for e in Replay::logged(&sr) {
        if !sink.emit(replay.take(e)).await {
            return replay.em.response();
        }
    }
    // Something other than output follows: the response is over.
    let closed = (sr.st.end as usize) < sr.events.len();
    if !closed && !replay.ended() {
        let mut live = Follow::new(sr.session, sub, sr.st.end);
        while let Some(e) = live.next(state).await {
            if !is_output(&e.body) {
                break;
            }
            if !sink.emit(replay.take(&e)).await {
                return replay.em.response();
            }
            if replay.ended() {
                break;
            }
        }
    }
    sink.emit(replay.end(false)).await;
    replay.em.response()
}

/// `GET /v1/responses/{id}`: the response object, or with `stream=true` its
/// stream's events after `starting_after` (all of them without it), replayed
/// from the log and continued live while it is in flight.
pub async fn retrieve(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    let id = path.into_inner();
    let r = owner(&state, &id)
        .await
        .ok_or_else(|| not_found("response", &id))?;
    let query = web::Query::<RetrieveQuery>::from_query(req.query_string())
        .map_err(|e| ApiError::invalid(F, format!("bad query: {e}")))?;
    if !query.stream {
        let (em, _, _) = load(&r, &id).await?;
        return Ok(HttpResponse::Ok().json(em.response()));
    }
    // Unknown ids are a 404 before the stream starts.
    let (sub, sr) = open_followed(&r, &id).await?;
    let state = r.state;
    let (tx, rx) = mpsc::channel(64);
    let sink = Sink::Stream {
        tx,
        after: query.starting_after,
    };
    actix_rt::spawn(async move {
        follow(&state, sub, sr, &sink).await;
    });
    Ok(event_stream(0, rx))
}

/// `POST /v1/responses/{id}/cancel`: stops the response's generation and
/// answers the response once it has ended (status `cancelled`, or how it
/// ended if it finished first). A response not in flight is a 400.
pub async fn cancel(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    let id = path.into_inner();
    let r = owner(&state, &id)
        .await
        .ok_or_else(|| not_found("response", &id))?;
    let (sub, sr) = open_followed(&r, &id).await?;
    let state = r.state;
    if !sr.in_flight {
        return Err(ApiError::invalid(
            F,
            format!("response {id} is not in progress, so it cannot be cancelled"),
        ));
    }
    // An error here is a generation that ended meanwhile: the answer below
    // says how it ended.
    let _ = call(
        &state,
        Request::Cancel {
            session: sr.session,
        },
    )
    .await;
    let ended = actix_rt::time::timeout(CANCEL_WAIT, follow(&state, sub, sr, &Sink::Discard))
        .await
        .map_err(|_| {
            ApiError::new(
                F,
                Kind::Unavailable,
                format!("response {id} did not stop within {CANCEL_WAIT:?}"),
            )
        })?;
    Ok(HttpResponse::Ok().json(ended))
}
