//! `Registry`: where every request enters. It answers the requests about no
//! session (Create, List, Sessions, Tree, Metrics, ...) itself and forwards
//! the rest to the session's actor, starting it on demand. Session actors
//! idle for `SESSION_IDLE_STOP_SECS` are dropped; their state is in the book,
//! so the next request starts a fresh one.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use actix::prelude::*;

use super::session::{name, SessionActor, SessionRequest};
use super::{now_ms, Shared};
use crate::wire::{Request, Response, SessionId};

/// How long a session actor may sit idle before it is stopped.
pub const SESSION_IDLE_STOP_SECS: u64 = 60;
/// How often idle session actors are looked for.
const IDLE_SWEEP_INTERVAL_SECS: u64 = 10;

/// One request from a frontend.
#[derive(Message)]
#[rtype(result = "Response")]
pub struct Dispatch(pub Request);

/// How many session actors are running (for tests and metrics).
#[derive(Message)]
#[rtype(result = "usize")]
pub struct RunningSessions;

pub struct Registry {
    shared: Shared,
    running: HashMap<SessionId, (Addr<SessionActor>, Instant)>,
    started_unix_ms: u64,
}

impl Registry {
    pub fn new(shared: Shared) -> Registry {
        Registry {
            shared,
            running: HashMap::new(),
            started_unix_ms: now_ms(),
        }
    }

    fn actor(&mut self, id: SessionId) -> Addr<SessionActor> {
        let shared = &self.shared;
        let entry = self.running.entry(id).or_insert_with(|| {
            (
                SessionActor::new(id, shared.clone()).start(),
                Instant::now(),
            )
        });
        if !entry.0.connected() {
            entry.0 = SessionActor::new(id, shared.clone()).start();
        }
        entry.1 = Instant::now();
        entry.0.clone()
    }

    fn metrics(&self) -> String {
        let book = self.shared.read();
        let ids = book.list();
        let (events, tokens) = ids
            .iter()
            .fold((0, 0), |(e, t), id| match book.inspect(*id) {
                Ok(i) => (e + i.events, t + i.tokens),
                Err(_) => (e, t),
            });
        format!(
            "# HELP superfluid_sessions Sessions not purged.\n# TYPE superfluid_sessions gauge\nsuperfluid_sessions {}\n\
             # HELP superfluid_session_events Events across live sessions, shared ones counted per session.\n# TYPE superfluid_session_events gauge\nsuperfluid_session_events {}\n\
             # HELP superfluid_session_tokens Tokens on the input of live sessions.\n# TYPE superfluid_session_tokens gauge\nsuperfluid_session_tokens {}\n\
             # HELP superfluid_session_actors Session actors running.\n# TYPE superfluid_session_actors gauge\nsuperfluid_session_actors {}\n\
             # HELP superfluid_epoch Daemon starts recorded in the log.\n# TYPE superfluid_epoch gauge\nsuperfluid_epoch {}\n\
             # HELP superfluid_start_time_seconds When this daemon started.\n# TYPE superfluid_start_time_seconds gauge\nsuperfluid_start_time_seconds {}\n",
            ids.len(),
            events,
            tokens,
            self.running.len(),
            book.epoch(),
            self.started_unix_ms / 1000
        )
    }
}

impl Actor for Registry {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(Duration::from_secs(IDLE_SWEEP_INTERVAL_SECS), |this, _| {
            let idle = Duration::from_secs(SESSION_IDLE_STOP_SECS);
            // Dropping the last address stops the actor once its mailbox is empty.
            this.running.retain(|_, (_, last)| last.elapsed() < idle);
        });
    }
}

impl Handler<RunningSessions> for Registry {
    type Result = usize;
    fn handle(&mut self, _: RunningSessions, _: &mut Context<Self>) -> usize {
        self.running.len()
    }
}

impl Handler<Dispatch> for Registry {
    type Result = ResponseFuture<Response>;

    fn handle(&mut self, msg: Dispatch, _: &mut Context<Self>) -> Self::Result {
        let req = msg.0;
        if let Some(id) = req.session() {
            // Unknown sessions are answered here, so no actor starts for them.
            if let Err(e) = self.shared.read().len(id) {
                return Box::pin(async move { Response::err(e.to_string()) });
            }
            let addr = self.actor(id);
            return Box::pin(async move {
                addr.send(SessionRequest(req))
                    .await
                    .unwrap_or_else(|e| Response::err(format!("session {id} is unavailable: {e}")))
            });
        }
        let shared = self.shared.clone();
        let reply = |r: Response| -> ResponseFuture<Response> { Box::pin(async move { r }) };
        match req {
            Request::Create { parent, params } => Box::pin(async move {
                let now = now_ms();
                let (id, planned) = {
                    let mut book = shared.write();
                    let id = book.reserve_id();
                    (id, book.plan_create(id, parent, params, now))
                };
                match planned {
                    Ok(p) => match shared.commit(p.record).await {
                        Ok(()) => Response::Created { session: id },
                        Err(e) => Response::err(e),
                    },
                    Err(e) => Response::err(e.to_string()),
                }
            }),
            Request::List => reply(Response::Sessions {
                ids: shared.read().list(),
            }),
            Request::Sessions { include_archived } => reply(Response::SessionList {
                sessions: shared.read().summaries(include_archived),
            }),
            Request::Tree => reply(Response::Tree {
                nodes: shared.read().tree(),
            }),
            Request::Metrics => reply(Response::Text {
                text: self.metrics(),
            }),
            Request::SetLogLevel { directive } => reply(set_log_level(&directive)),
            other => reply(Response::err(format!(
                "{} is not served by this daemon yet",
                name(&other)
            ))),
        }
    }
}

/// `SetLogLevel`: a level name (`error`, `warn`, `info`, `debug`, `trace`,
/// `off`) for the whole daemon.
fn set_log_level(directive: &str) -> Response {
    match directive.trim().parse::<log::LevelFilter>() {
        Ok(level) => {
            log::set_max_level(level);
            Response::Ack
        }
        Err(_) => Response::err(format!(
            "unknown log level {directive:?}: use error, warn, info, debug, trace or off"
        )),
    }
}
