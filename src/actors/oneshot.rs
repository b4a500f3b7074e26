//! The lane without a session log: `generate_stream` admits a token prompt
//! to the scheduler and hands back its events on a channel; `generate`
//! collects them. This is what `Complete` (and later the OpenAI, Anthropic
//! and Ollama routes) run on. Nothing here touches the log.
//!
//! Such generations run as session 0 in the scheduler, so they share
//! sequences, and so cached prefixes, with one another.

use actix::prelude::*;
use tokio::sync::mpsc;

use super::scheduler::{AdmitGen, CancelGen, GenUpdate, SchedulerActor};
use crate::scheduler::{Admit, GenEvent, GenId};
use crate::wire::{Finish, Params, QosClass, Token};

/// The scheduler's session id for generations without a session.
pub const NO_SESSION: u64 = 0;

/// Forwards one generation's events to a channel; cancels the generation
/// when the receiver is dropped.
struct Forwarder {
    tx: mpsc::Sender<GenEvent>,
    gen: Option<GenId>,
    scheduler: Addr<SchedulerActor>,
}

impl Actor for Forwarder {
    type Context = Context<Self>;
}

impl Handler<GenUpdate> for Forwarder {
    type Result = ();

    fn handle(&mut self, msg: GenUpdate, ctx: &mut Context<Self>) {
        let done = matches!(msg.0, GenEvent::Finished { .. } | GenEvent::Failed { .. });
        if self.tx.try_send(msg.0).is_err() {
            if let Some(gen) = self.gen.take() {
                self.scheduler.do_send(CancelGen(gen));
            }
        }
        if done {
            ctx.stop();
        }
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct SetGen(GenId);

impl Handler<SetGen> for Forwarder {
    type Result = ();
    fn handle(&mut self, msg: SetGen, _: &mut Context<Self>) {
        self.gen = Some(msg.0);
    }
}

/// Starts a generation from `prompt`; its events arrive on the receiver
/// (Started, Token..., then Finished or Failed). Dropping the receiver
/// cancels it.
pub async fn generate_stream(
    scheduler: &Addr<SchedulerActor>,
    prompt: Vec<Token>,
    params: Params,
    max_tokens: u32,
    grammar: Option<String>,
) -> Result<mpsc::Receiver<GenEvent>, String> {
    // Every event fits: at most one per token, plus Started and the end.
    let (tx, rx) = mpsc::channel(max_tokens as usize + 4);
    let forwarder = Forwarder {
        tx,
        gen: None,
        scheduler: scheduler.clone(),
    }
    .start();
    let admit = Admit {
        session: NO_SESSION,
        grammar_from: prompt.len(),
        prompt,
        params,
        max_tokens,
        class: QosClass::First,
        batch_invariant: false,
        grammar,
    };
    let gen = scheduler
        .send(AdmitGen {
            admit,
            owner: forwarder.clone().recipient(),
        })
        .await
        .map_err(|e| format!("the scheduler is gone: {e}"))??;
    forwarder.do_send(SetGen(gen));
    Ok(rx)
}

/// What a generation without a session produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub tokens: Vec<Token>,
    pub finish: Finish,
    pub warm_prefix: u64,
}

/// Runs a generation from `prompt` to its end.
pub async fn generate(
    scheduler: &Addr<SchedulerActor>,
    prompt: Vec<Token>,
    params: Params,
    max_tokens: u32,
    grammar: Option<String>,
) -> Result<Generation, String> {
    let mut rx = generate_stream(scheduler, prompt, params, max_tokens, grammar).await?;
    let mut out = Generation {
        tokens: Vec::new(),
        finish: crate::wire::Finish::Error,
        warm_prefix: 0,
    };
    while let Some(e) = rx.recv().await {
        match e {
            GenEvent::Started { warm_prefix, .. } => out.warm_prefix = warm_prefix,
            GenEvent::Token { token, .. } => out.tokens.push(token),
            GenEvent::Finished { finish, .. } => {
                out.finish = finish;
                return Ok(out);
            }
            GenEvent::Failed { message, .. } => return Err(message),
        }
    }
    Err("the generation ended without a finish".into())
}
