//! `Registry`: where every request enters. It answers the requests about no
//! session (Create, List, Sessions, Tree, Metrics, ...) itself and forwards
//! the rest to the session's actor, starting it on demand. Session actors
//! idle for `SESSION_IDLE_STOP_SECS` are dropped; their state is in the book,
//! so the next request starts a fresh one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;

use super::session::{commit, name, Busy, SessionActor, SessionRequest, SessionStream};
use super::subscription::{self, SubscriptionActor};
use super::{now_ms, Shared};
use crate::session::{Owned, SessionError};
use crate::store::WalStats;
use crate::wire::{Finish, Request, Response, SessionId};

/// How long a session actor may sit idle before it is stopped.
pub const SESSION_IDLE_STOP_SECS: u64 = 60;
/// How often idle session actors are looked for.
const IDLE_SWEEP_INTERVAL_SECS: u64 = 10;

/// One request from a frontend.
#[derive(Message)]
#[rtype(result = "Response")]
pub struct Dispatch(pub Request);

/// One streaming request (Generate) from a frontend; its replies go to
/// `reply`, which closes after the last one.
#[derive(Message)]
#[rtype(result = "()")]
pub struct DispatchStream {
    pub request: Request,
    pub reply: tokio::sync::mpsc::Sender<Response>,
    /// Generate only: also stream provisional text (see `SessionStream`).
    pub provisional: bool,
    /// Generate only: told the prompt tokens taken from the cache once the
    /// scheduler starts the generation (see `SessionStream`).
    pub started: Option<tokio::sync::oneshot::Sender<u64>>,
}

/// `Complete` from a frontend that can tell when its client leaves: the
/// answer goes to `reply`, and the completion is dropped (its generation
/// cancelled) as soon as the frontend drops the other end.
#[derive(Message)]
#[rtype(result = "()")]
pub struct DispatchComplete {
    pub request: Request,
    pub reply: tokio::sync::oneshot::Sender<Response>,
}

/// `Subscribe` from a frontend: starts a `SubscriptionActor` whose replies
/// go to `out` (the connection's queue); it waits for `Begin`.
#[derive(Message)]
#[rtype(result = "Result<(u64, Addr<SubscriptionActor>), SessionError>")]
pub struct Subscribe {
    pub session: SessionId,
    pub cursor: u64,
    pub provisional: bool,
    pub out: tokio::sync::mpsc::Sender<Response>,
    /// The connection's turn to queue a large backlog event.
    pub large: std::sync::Arc<tokio::sync::Mutex<()>>,
}

/// Which session made each of a session's events (`SessionBook::owners`):
/// the Responses route names a tool call by the session that made it, so
/// a call keeps one name in every fork that shares it. Not a wire request.
#[derive(Message)]
#[rtype(result = "Result<Vec<Owned>, SessionError>")]
pub struct Owners(pub SessionId);

/// A session actor the registry started.
struct Started {
    addr: Addr<SessionActor>,
    last_used: Instant,
    /// The actor's requests in flight and its generation: never stopped
    /// while it has any.
    busy: Busy,
}

pub struct Registry {
    shared: Shared,
    started: HashMap<SessionId, Started>,
    started_unix_ms: u64,
}

impl Registry {
    pub fn new(shared: Shared) -> Registry {
        Registry {
            shared,
            started: HashMap::new(),
            started_unix_ms: now_ms(),
        }
    }

    fn actor(&mut self, id: SessionId) -> Addr<SessionActor> {
        let shared = &self.shared;
        let start = || {
            let busy = Busy::default();
            Started {
                addr: SessionActor::new(id, shared.clone(), busy.clone()).start(),
                last_used: Instant::now(),
                busy,
            }
        };
        let entry = self.started.entry(id).or_insert_with(start);
        if !entry.addr.connected() {
            *entry = start();
        }
        entry.last_used = Instant::now();
        entry.addr.clone()
    }

    /// The registry's own gauges, in the Prometheus exposition format.
    fn gauges(&self) -> String {
        let (sessions, events, tokens) = self.shared.read().totals();
        let mut out = String::new();
        metric(
            &mut out,
            "superfluid_sessions",
            "gauge",
            "Sessions not purged.",
            sessions,
        );
        metric(
            &mut out,
            "superfluid_session_events",
            "gauge",
            "Events across live sessions, shared ones counted per session.",
            events,
        );
        metric(
            &mut out,
            "superfluid_session_tokens",
            "gauge",
            "Tokens on the input of live sessions.",
            tokens,
        );
        metric(
            &mut out,
            "superfluid_session_actors",
            "gauge",
            "Session actors running.",
            self.started.len() as u64,
        );
        metric(
            &mut out,
            "superfluid_subscribers",
            "gauge",
            "Live subscriptions (Subscribe), across connections.",
            self.shared.bus.subscribers() as u64,
        );
        metric(
            &mut out,
            "superfluid_epoch",
            "gauge",
            "Daemon starts recorded in the log.",
            self.shared.read().epoch(),
        );
        metric(
            &mut out,
            "superfluid_start_time_seconds",
            "gauge",
            "When this daemon started.",
            self.started_unix_ms / 1000,
        );
        out
    }
}

/// Generations ended, by finish (in `Shared`). Counted where a generation
/// ends: the session actor's last reply and the forwarder of a generation
/// without a session.
#[derive(Default)]
pub struct Generations([AtomicU64; Finish::ALL.len()]);

impl Generations {
    /// Counts one generation that ended with `finish`.
    pub fn count(&self, finish: Finish) {
        self.0[u8::from(finish) as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// `superfluid_generations_total{finish="..."}`, one line per finish.
    fn metrics(&self) -> String {
        let mut out = String::from(
            "# HELP superfluid_generations_total Generations ended, by why they ended.\n\
             # TYPE superfluid_generations_total counter\n",
        );
        for &f in Finish::ALL {
            out.push_str(&format!(
                "superfluid_generations_total{{finish=\"{}\"}} {}\n",
                f.name().replace(' ', "_"),
                self.0[u8::from(f) as usize].load(Ordering::Relaxed)
            ));
        }
        out
    }
}

/// The WAL writer's health and counters.
fn wal_metrics(stats: WalStats) -> String {
    let mut out = String::new();
    metric(
        &mut out,
        "superfluid_wal_failed",
        "gauge",
        "1 once a write or fdatasync of the log failed (every commit is refused since), else 0.",
        u8::from(stats.failed),
    );
    metric(
        &mut out,
        "superfluid_wal_records_total",
        "counter",
        "Records made durable.",
        stats.records,
    );
    metric(
        &mut out,
        "superfluid_wal_fsyncs_total",
        "counter",
        "fdatasync calls of the log that completed (one per group commit).",
        stats.fsyncs,
    );
    metric(
        &mut out,
        "superfluid_wal_bytes_total",
        "counter",
        "Bytes made durable, record headers included.",
        stats.bytes,
    );
    crate::histogram::render_header(
        &mut out,
        "superfluid_wal_commit_seconds",
        "Group commits: the write and its fdatasync, until the events it holds may be delivered.",
    );
    stats
        .commit
        .render_series(&mut out, "superfluid_wal_commit_seconds", "");
    crate::histogram::HTTP_REQUESTS.render(
        &mut out,
        "superfluid_http_request_duration_seconds",
        "Requests of the OpenAI, Anthropic and Ollama routes, from arrival to the last byte of the reply (streams included), by route and status.",
    );
    out
}

/// The scheduler's counters, in the Prometheus exposition format.
fn counters(stats: crate::scheduler::Stats) -> String {
    let mut out = String::new();
    metric(
        &mut out,
        "superfluid_kv_cells_used",
        "gauge",
        "KV cells in use: tokens resident across the lane's sequences.",
        stats.kv_cells_used,
    );
    metric(
        &mut out,
        "superfluid_decode_steps_total",
        "counter",
        "Decode calls made.",
        stats.decode_calls,
    );
    metric(
        &mut out,
        "superfluid_decode_sequence_steps_total",
        "counter",
        "Sequences advanced, summed over decode calls.",
        stats.seq_steps,
    );
    metric(
        &mut out,
        "superfluid_decode_max_sequences_per_step",
        "gauge",
        "The most sequences one decode call advanced.",
        stats.max_seqs_per_step,
    );
    metric(
        &mut out,
        "superfluid_generated_tokens_total",
        "counter",
        "Tokens drawn.",
        stats.drawn,
    );
    metric(
        &mut out,
        "superfluid_warm_prefix_tokens_total",
        "counter",
        "Prompt tokens taken from the KV cache instead of a prefill.",
        stats.warm_tokens,
    );
    metric(
        &mut out,
        "superfluid_kv_spilled_bytes",
        "gauge",
        "Bytes of sequence state the host-memory tier holds (--cache-ram-mb).",
        stats.spilled_bytes,
    );
    metric(
        &mut out,
        "superfluid_kv_idle_spills_total",
        "counter",
        "Idle sequences moved from the KV cells to the host-memory tier (--idle-spill-ms).",
        stats.idle_spills,
    );
    metric(
        &mut out,
        "superfluid_kv_parked_artifacts",
        "gauge",
        "Park artifacts (--park) the scheduler's index holds.",
        stats.parked_artifacts,
    );
    metric(
        &mut out,
        "superfluid_kv_restored_tokens_total",
        "counter",
        "Prompt tokens imported from the host-memory tier instead of a prefill.",
        stats.restored_tokens,
    );
    metric(
        &mut out,
        "superfluid_turn_warmed_tokens_total",
        "counter",
        "Tokens decoded ahead of a session's next turn while the lane was idle (its end of turn and the chat template's turn opening).",
        stats.turn_warmed_tokens,
    );
    metric(
        &mut out,
        "superfluid_turn_warm_missed_tokens_total",
        "counter",
        "Tokens decoded ahead of a next turn that opened otherwise (dropped).",
        stats.turn_warm_missed_tokens,
    );
    metric(
        &mut out,
        "superfluid_generations_refused_total",
        "counter",
        "Generations the worker refused on their own in a batched step (a grammar that does \
         not parse or dead-ends); the others in the step went on.",
        stats.refused,
    );
    metric(
        &mut out,
        "superfluid_generations_preempted_total",
        "counter",
        "Generations taken off their sequence when the KV cache filled, to go on once there \
         is room to finish (instead of ending them).",
        stats.preempted,
    );
    metric(
        &mut out,
        "superfluid_grammar_rested_steps_total",
        "counter",
        "Steps a generation sat out while others ran because its grammar took longer to \
         constrain its last token than the step's decode (summed over generations).",
        stats.grammar_rested_steps,
    );
    metric(
        &mut out,
        "superfluid_prefill_tokens_total",
        "counter",
        "Prompt tokens the worker decoded (prefill), drawn tokens not counted.",
        stats.prefilled_tokens,
    );
    metric(
        &mut out,
        "superfluid_decoded_tokens_total",
        "counter",
        "Tokens the worker decoded, prompt and drawn.",
        stats.decoded_tokens,
    );
    metric(
        &mut out,
        "superfluid_decode_seconds_total",
        "counter",
        "Time the worker spent in llama.cpp's decode calls.",
        stats.decode_us as f64 / 1e6,
    );
    metric(
        &mut out,
        "superfluid_attention_tile_scores_total",
        "counter",
        "Attention scores (query rows x KV cells) in the prefill tile pairs not wholly masked, \
         as llama.cpp's tiled kernel computes them.",
        stats.attention.full,
    );
    metric(
        &mut out,
        "superfluid_attention_scores_computed_total",
        "counter",
        "Of those, the scores superfluid's trimmed kernel computed (SUPERFLUID_FA_TRIM=0: all).",
        stats.attention.computed,
    );
    out
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str, value: impl std::fmt::Display) {
    out.push_str(&format!(
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
    ));
}

impl Actor for Registry {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(Duration::from_secs(IDLE_SWEEP_INTERVAL_SECS), |this, _| {
            let idle = Duration::from_secs(SESSION_IDLE_STOP_SECS);
            // Dropping the last address stops the actor once its mailbox is empty.
            this.started
                .retain(|_, s| !s.busy.is_idle() || s.last_used.elapsed() < idle);
        });
    }
}

impl Handler<Subscribe> for Registry {
    type Result = Result<(u64, Addr<SubscriptionActor>), SessionError>;

    fn handle(&mut self, m: Subscribe, _: &mut Context<Self>) -> Self::Result {
        subscription::start(
            &self.shared,
            m.session,
            m.cursor,
            m.provisional,
            m.out,
            m.large,
        )
    }
}

impl Handler<Owners> for Registry {
    type Result = Result<Vec<Owned>, SessionError>;

    fn handle(&mut self, m: Owners, _: &mut Context<Self>) -> Self::Result {
        self.shared.read().owners(m.0)
    }
}

impl Handler<DispatchStream> for Registry {
    type Result = ();

    fn handle(&mut self, msg: DispatchStream, _: &mut Context<Self>) {
        let Some(id) = msg.request.session() else {
            let e = SessionError::DoesNotStream(name(&msg.request));
            let _ = msg.reply.try_send(Response::err(e.to_string()));
            return;
        };
        if let Err(e) = self.shared.read().len(id) {
            let _ = msg.reply.try_send(Response::err(e.to_string()));
            return;
        }
        self.actor(id).do_send(SessionStream {
            request: msg.request,
            reply: msg.reply,
            provisional: msg.provisional,
            started: msg.started,
        });
    }
}

impl Handler<DispatchComplete> for Registry {
    type Result = ();

    fn handle(&mut self, msg: DispatchComplete, ctx: &mut Context<Self>) {
        let DispatchComplete { request, mut reply } = msg;
        let answer = <Self as Handler<Dispatch>>::handle(self, Dispatch(request), ctx);
        actix_rt::spawn(async move {
            tokio::select! {
                response = answer => {
                    let _ = reply.send(response);
                }
                () = reply.closed() => {
                    log::debug!("a Complete's client left; its generation is cancelled");
                }
            }
        });
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
                let planned = {
                    let mut book = shared.write();
                    let id = book.reserve_id();
                    // A child of `parent` is in flight until applied: a
                    // purge of the parent waits for it.
                    let planned = book
                        .plan_create(id, parent, params, now_ms())
                        .and_then(|p| book.begin(&p).map(|()| p));
                    if planned.is_err() {
                        book.release_id(id);
                    }
                    planned
                };
                let reply = match planned {
                    Ok(p) => commit(&shared, p).await,
                    Err(e) => Err(e),
                };
                reply.unwrap_or_else(|e| Response::err(e.to_string()))
            }),
            Request::List => reply(Response::Sessions {
                ids: shared.read().list_shown(),
            }),
            Request::Sessions { include_archived } => reply(Response::SessionList {
                sessions: shared.read().summaries(include_archived),
            }),
            Request::Tree => reply(Response::Tree {
                nodes: shared.read().tree(),
            }),
            Request::Metrics => {
                let gauges = self.gauges();
                let lane = shared.lane.borrow().metrics() + &super::lane::rpc_metrics(&shared.rpc);
                let generations = shared.generations.metrics();
                Box::pin(async move {
                    let stats = shared
                        .scheduler
                        .send(super::scheduler::GetStats)
                        .await
                        .unwrap_or_default();
                    let wal = shared
                        .wal
                        .send(super::wal::GetWalStats)
                        .await
                        .unwrap_or_default();
                    Response::Text {
                        text: format!(
                            "{gauges}{lane}{}{generations}{}",
                            counters(stats),
                            wal_metrics(wal)
                        ),
                    }
                })
            }
            Request::SetLogLevel { directive } => reply(set_log_level(&directive)),
            Request::SetBackgroundRate { divisor } => {
                if divisor == 0 {
                    return reply(Response::err("divisor must be at least 1"));
                }
                shared
                    .scheduler
                    .do_send(super::scheduler::SetBackgroundRate(divisor));
                reply(Response::Ack)
            }
            Request::Complete {
                prefix,
                suffix,
                mode,
                max_tokens,
            } => Box::pin(async move {
                super::complete::complete(&shared, prefix, suffix, mode, max_tokens).await
            }),
            Request::PutMedia { bytes, mime } => {
                let media = shared.media.clone();
                Box::pin(async move {
                    let put = actix_rt::task::spawn_blocking(move || media.put(&bytes, &mime));
                    match put.await {
                        Ok(Ok(hash)) => Response::Media { hash },
                        Ok(Err(e)) => Response::err(e.to_string()),
                        Err(e) => Response::err(format!("PutMedia: {e}")),
                    }
                })
            }
            Request::GcMedia => {
                let media = shared.media.clone();
                let referenced = shared.read().media_refs();
                Box::pin(async move {
                    let gc = actix_rt::task::spawn_blocking(move || media.gc(&referenced));
                    match gc.await {
                        Ok(Ok((kept, removed))) => Response::Gc { kept, removed },
                        Ok(Err(e)) => Response::err(e.to_string()),
                        Err(e) => Response::err(format!("GcMedia: {e}")),
                    }
                })
            }
            Request::UseModel { .. } | Request::Models => reply(Response::err(
                "UseModel and Models are answered by a connection (the socket, /web/ws) \
                 or /web/rpc; /web/rpc and /web/stream pick a model with ?model=ID",
            )),
            other => reply(Response::err(format!(
                "{} is not served by this daemon yet",
                name(&other)
            ))),
        }
    }
}

/// `SetLogLevel`: env_logger directives for the whole daemon
/// (`crate::logging::parse_directive` says which).
fn set_log_level(directive: &str) -> Response {
    match crate::logging::set_directive(directive) {
        Ok(()) => Response::Ack,
        Err(e) => Response::err(e.to_string()),
    }
}
