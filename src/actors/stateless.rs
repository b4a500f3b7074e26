//! Generation without a session: [`StatelessGen::start`] admits a token
//! prompt to the scheduler and hands back its events on a channel. This is
//! what `Complete` (and later the OpenAI, Anthropic and Ollama routes) run
//! on. Nothing here touches the log.
//!
//! Such generations run as session 0 ([`NO_SESSION`]) in the scheduler, so
//! they share sequences, and so cached prefixes, with one another.

use std::sync::Arc;

use actix::prelude::*;
use tokio::sync::mpsc;

use super::registry::Generations;
use super::scheduler::{AdmitGen, CancelGen, GenUpdate, SchedulerActor};
use crate::scheduler::{Admit, GenEvent, PrefixPin, SchedulerError};
use crate::wire::{Finish, Params, QosClass, SampleExtras, Token};

/// The scheduler's session id for generations without a session.
pub use crate::scheduler::NO_SESSION;

/// Why a generation without a session did not start. The text is what the
/// client sees.
#[derive(Debug, thiserror::Error)]
pub enum StatelessError {
    #[error("the scheduler is gone: {0}")]
    SchedulerGone(MailboxError),
    #[error(transparent)]
    Refused(#[from] SchedulerError),
}

/// A generation without a session: greedy or sampled from `prompt`.
#[derive(Debug, Clone)]
pub struct StatelessGen {
    pub prompt: Vec<Token>,
    pub params: Params,
    pub max_tokens: u32,
    pub grammar: Option<String>,
    /// Keep the prompt and reply cached after it ends, as a pin (an
    /// Anthropic `cache_control` breakpoint; see `Admit::pin`).
    pub pin: Option<PrefixPin>,
    /// Presence/frequency penalties, logit bias and log-probabilities
    /// (None: none of them). Checked at admission: a value out of range or
    /// a `logit_bias` id outside the vocabulary is `StatelessError::Refused`
    /// (`SchedulerError::Extras`). With `logprobs`, each
    /// `GenEvent::Token` carries its `TokenLogprob`.
    pub extras: Option<SampleExtras>,
    /// The images on `prompt` (offsets into it): such a request neither
    /// takes nor leaves a cached prefix.
    pub media: Vec<crate::wire::worker::MediaSpan>,
}

impl StatelessGen {
    /// Starts it; its events arrive on the receiver (Started, Token...,
    /// then Finished or Failed). Dropping the receiver cancels it.
    pub async fn start(
        self,
        scheduler: &Addr<SchedulerActor>,
        generations: Arc<Generations>,
    ) -> Result<mpsc::Receiver<GenEvent>, StatelessError> {
        // Every event fits: at most one per token, plus Started and the end.
        let (tx, rx) = mpsc::channel(self.max_tokens as usize + 4);
        let forwarder = Forwarder {
            tx,
            cancelled: false,
            scheduler: scheduler.clone(),
            generations,
        }
        .start();
        let admit = Admit {
            session: NO_SESSION,
            grammar_from: self.prompt.len(),
            prompt: self.prompt,
            params: self.params,
            max_tokens: self.max_tokens,
            class: QosClass::First,
            batch_invariant: false,
            grammar: self.grammar,
            pin: self.pin,
            extras: self.extras,
            media: self.media,
        };
        scheduler
            .send(AdmitGen {
                admit,
                owner: forwarder.recipient(),
            })
            .await
            .map_err(StatelessError::SchedulerGone)??;
        Ok(rx)
    }
}

/// Forwards one generation's events to a channel; cancels the generation
/// when the receiver is dropped. Each event names its generation, so the
/// forwarder needs no other word of it.
struct Forwarder {
    tx: mpsc::Sender<GenEvent>,
    cancelled: bool,
    scheduler: Addr<SchedulerActor>,
    /// Where its end is counted.
    generations: Arc<Generations>,
}

impl Actor for Forwarder {
    type Context = Context<Self>;
}

impl Handler<GenUpdate> for Forwarder {
    type Result = ();

    fn handle(&mut self, msg: GenUpdate, ctx: &mut Context<Self>) {
        let (gen, done) = (msg.0.gen(), msg.0.ends());
        match &msg.0 {
            GenEvent::Finished { finish, .. } => self.generations.count(*finish),
            GenEvent::Failed { .. } => self.generations.count(Finish::Error),
            _ => {}
        }
        if self.tx.try_send(msg.0).is_err() && !self.cancelled {
            self.cancelled = true;
            self.scheduler.do_send(CancelGen(gen));
        }
        if done {
            ctx.stop();
        }
    }
}
