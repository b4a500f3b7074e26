//! Runs one stateless generation for a compatible route and decodes its
//! tokens into what both APIs stream: text, reasoning, tool calls, and why
//! it ended. Stop sequences are applied here (on the text channel), and a
//! matched one cancels the generation. Dropping the receiver (a client that
//! went away) cancels it too: the pump's next send fails, it drops the
//! scheduler's channel, and the forwarder cancels.

use std::sync::Arc;

use tokio::sync::mpsc;

use super::chat::StopMatcher;
use crate::actors::stateless::{StatelessError, StatelessGen};
use crate::actors::Shared;
use crate::scheduler::{GenEvent, PrefixPin};
use crate::session::output::{Markers, OutputDecoder, Segment};
use crate::session::turn::ends_turn;
use crate::session::Render;
use crate::wire::{Channel, Finish, Params, SampleExtras, Token, TokenLogprob};

/// One generation to run.
#[derive(Debug, Clone)]
pub struct Spec {
    pub prompt: Vec<Token>,
    pub params: Params,
    pub max_tokens: u32,
    pub grammar: Option<String>,
    pub stops: StopMatcher,
    pub markers: Markers,
    /// The generation prompt opened a thinking block.
    pub in_reasoning: bool,
    /// Drop the text channel's leading whitespace (chat replies; what follows
    /// a thinking block starts with blank lines). Off for raw completions.
    pub trim_leading: bool,
    /// Pin the prompt's first tokens when it ends (an Anthropic breakpoint).
    pub pin: Option<PrefixPin>,
    /// Penalties, logit bias, log-probabilities (OpenAI).
    pub extras: Option<SampleExtras>,
    /// The images on `prompt` (offsets into it).
    pub media: Vec<crate::wire::worker::MediaSpan>,
}

/// Why a generation ended.
#[derive(Debug, Clone, PartialEq)]
pub enum End {
    /// The model ended its turn (or completed a forced call).
    Turn,
    MaxTokens,
    /// A stop sequence matched; the text before it was emitted.
    Stop(String),
    Cancelled,
}

/// What a generation gives, in order: pieces, then exactly one `Ended` or
/// `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum Out {
    /// Text on the text channel, or reasoning (markers removed).
    Text {
        reasoning: bool,
        text: String,
    },
    /// A complete tool call; `arguments` is compact JSON.
    Call {
        name: String,
        arguments: String,
    },
    /// A drawn token's log-probabilities (only when asked), before the text
    /// it is part of.
    Logprob(Logprob),
    Ended {
        end: End,
        generated: u32,
        /// Of `generated`, the tokens of reasoning (its markup included).
        reasoning: u32,
    },
    Failed(String),
    /// The worker refused the generation's own item (its grammar does not
    /// parse, dead-ends or costs too much): the request's fault.
    Refused(String),
}

/// One drawn token and its log-probabilities, with text.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprob {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// The most likely tokens: (text, bytes, log-probability).
    pub top: Vec<(String, Vec<u8>, f32)>,
}

impl Logprob {
    fn new(render: &dyn Render, token: Token, lp: TokenLogprob) -> Logprob {
        let text = |t: Token| {
            let bytes = render.piece(t);
            (String::from_utf8_lossy(&bytes).into_owned(), bytes)
        };
        let (token, bytes) = text(token);
        Logprob {
            token,
            bytes,
            logprob: lp.logprob,
            top: lp
                .top
                .into_iter()
                .map(|(t, l)| {
                    let (s, b) = text(t);
                    (s, b, l)
                })
                .collect(),
        }
    }
}

/// A started generation: how many prompt tokens came from the cache, and
/// its output.
pub struct Run {
    pub warm: u64,
    pub out: mpsc::Receiver<Out>,
}

/// Why a generation did not start.
#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    #[error(transparent)]
    Refused(#[from] StatelessError),
    /// The lane failed it before it started (the worker is down).
    #[error("{0}")]
    Failed(String),
    /// The worker refused its own item (its grammar): the request's fault.
    #[error("{0}")]
    Own(String),
}

/// Admits the generation and waits until it has a sequence.
pub async fn start(shared: &Shared, spec: Spec) -> Result<Run, DriveError> {
    let Spec {
        prompt,
        params,
        max_tokens,
        grammar,
        stops,
        markers,
        in_reasoning,
        trim_leading,
        pin,
        extras,
        media,
    } = spec;
    let generation = StatelessGen {
        prompt,
        params,
        max_tokens,
        grammar,
        pin,
        extras,
        media,
    };
    let mut events = generation
        .start(&shared.scheduler, shared.generations.clone())
        .await?;
    let warm = match events.recv().await {
        Some(GenEvent::Started { warm_prefix, .. }) => warm_prefix,
        Some(GenEvent::Failed {
            message, own: true, ..
        }) => return Err(DriveError::Own(message)),
        Some(GenEvent::Failed { message, .. }) => return Err(DriveError::Failed(message)),
        Some(_) | None => {
            return Err(DriveError::Failed(
                "the generation ended before it started".into(),
            ))
        }
    };
    let (tx, out) = mpsc::channel(64);
    let pump = Pump {
        render: shared.render.clone(),
        decoder: OutputDecoder::new(markers.clone(), in_reasoning),
        think: markers.think.clone(),
        stops,
        tx,
        logprobs: std::collections::VecDeque::new(),
        generated: 0,
        reasoning: 0,
        text_started: !trim_leading,
    };
    actix_rt::spawn(pump.run(events));
    Ok(Run { warm, out })
}

/// A segment's text ("" for a call).
fn text_of(s: &Segment) -> &str {
    match s {
        Segment::Text { text, .. } | Segment::ParseFailure { text, .. } => text,
        Segment::ToolCall { .. } => "",
    }
}

/// Drops a start of `marker` that `text` ends with ("</think" of
/// "</think>").
fn strip_marker_start(text: &mut String, marker: &str) {
    let cut = (1..marker.len())
        .rev()
        .filter(|&k| marker.is_char_boundary(k))
        .find(|&k| text.ends_with(&marker[..k]));
    if let Some(k) = cut {
        text.truncate(text.len() - k);
    }
}

struct Pump {
    render: Arc<dyn Render>,
    decoder: OutputDecoder,
    think: Option<(String, String)>,
    stops: StopMatcher,
    tx: mpsc::Sender<Out>,
    /// The log-probabilities of the tokens pushed to the decoder and not
    /// yet in a segment, oldest first (None: not asked for).
    logprobs: std::collections::VecDeque<Option<Logprob>>,
    generated: u32,
    /// Of `generated`, the tokens the decoder put in reasoning.
    reasoning: u32,
    /// Leading whitespace of the text channel (after a thinking block) is
    /// dropped until the first other character.
    text_started: bool,
}

impl Pump {
    async fn run(mut self, mut events: mpsc::Receiver<GenEvent>) {
        while let Some(event) = events.recv().await {
            let ended = match event {
                GenEvent::Started { .. } => continue,
                GenEvent::Token { token, logprob, .. } => {
                    self.generated += 1;
                    if self.render.is_eog(token) {
                        continue;
                    }
                    let piece = self.render.piece(token);
                    // Sent with the segment the decoder puts the token in
                    // (`emit`), if that is the reply's text.
                    self.logprobs
                        .push_back(logprob.map(|lp| Logprob::new(self.render.as_ref(), token, lp)));
                    let segments = self.decoder.push(token, &piece);
                    match self.emit(segments).await {
                        Ok(None) => continue,
                        Ok(Some(stop)) => Out::Ended {
                            end: End::Stop(stop),
                            generated: self.generated,
                            reasoning: self.reasoning,
                        },
                        // The client went away: dropping `events` cancels.
                        Err(()) => return,
                    }
                }
                GenEvent::Finished { finish, .. } => {
                    let mut segments = self.decoder.finish(ends_turn(finish));
                    // A cut in the middle of the marker closing a thinking
                    // block (a grammar forcing the close, max_tokens
                    // reached within it) leaves its start held back: it is
                    // markup, not reasoning.
                    if let (Some((_, close)), Some(Segment::Text { channel, text, .. })) =
                        (&self.think, segments.last_mut())
                    {
                        if *channel == Channel::Reasoning {
                            strip_marker_start(text, close);
                        }
                    }
                    let stopped = match self.emit(segments).await {
                        Ok(s) => s,
                        Err(()) => return,
                    };
                    let rest = self.stops.finish();
                    if stopped.is_none() && self.send_text(false, rest).await.is_err() {
                        return;
                    }
                    let end = match (stopped, finish) {
                        (Some(s), _) => End::Stop(s),
                        (None, Finish::MaxTokens) => End::MaxTokens,
                        (None, Finish::Cancelled) => End::Cancelled,
                        // Cut for lack of room (the context, or a KV cache
                        // shared with others that could not wait): the
                        // output is cut short, as at max_tokens.
                        (None, Finish::Error) => End::MaxTokens,
                        (None, _) => End::Turn,
                    };
                    Out::Ended {
                        end,
                        generated: self.generated,
                        reasoning: self.reasoning,
                    }
                }
                GenEvent::Failed {
                    message, own: true, ..
                } => Out::Refused(message),
                GenEvent::Failed { message, .. } => Out::Failed(message),
            };
            let _ = self.tx.send(ended).await;
            return;
        }
        let _ = self
            .tx
            .send(Out::Failed("the lane dropped the generation".into()))
            .await;
    }

    /// Sends what `segments` make certain; the stop sequence that matched,
    /// if one did. `Err` when the receiver is gone.
    async fn emit(&mut self, segments: Vec<Segment>) -> Result<Option<String>, ()> {
        for s in segments {
            // A token's log-probability is the reply's when the decoder
            // puts the token in the reply's text: not in reasoning, not in
            // the markup opening or closing a block (which goes with the
            // block), not in a call.
            if let Segment::Text {
                channel, tokens, ..
            } = &s
            {
                if *channel == Channel::Reasoning {
                    self.reasoning += tokens.len() as u32;
                }
                // The reply's leading whitespace is dropped (`send_text`),
                // and its tokens' log-probabilities with it.
                let dropped = !self.text_started && text_of(&s).trim_start().is_empty();
                for _ in tokens {
                    let lp = self.logprobs.pop_front().flatten();
                    if let Some(lp) = lp.filter(|_| *channel == Channel::Text && !dropped) {
                        self.tx.send(Out::Logprob(lp)).await.map_err(|_| ())?;
                    }
                }
            }
            match s {
                Segment::Text {
                    channel: Channel::Reasoning,
                    text,
                    ..
                } => {
                    let text = match &self.think {
                        Some((open, close)) => text.replace(open.as_str(), "").replace(close, ""),
                        None => text,
                    };
                    self.send_text(true, text).await?;
                }
                // A call's markup: the call itself follows as a `ToolCall`.
                Segment::Text {
                    channel: Channel::ToolCall,
                    ..
                } => {}
                Segment::Text { text, .. } | Segment::ParseFailure { text, .. } => {
                    let m = self.stops.push(&text);
                    self.send_text(false, m.emit).await?;
                    if m.stopped.is_some() {
                        return Ok(m.stopped);
                    }
                }
                Segment::ToolCall { name, arguments } => {
                    self.tx
                        .send(Out::Call { name, arguments })
                        .await
                        .map_err(|_| ())?;
                }
            }
        }
        Ok(None)
    }

    async fn send_text(&mut self, reasoning: bool, mut text: String) -> Result<(), ()> {
        if !reasoning && !self.text_started {
            let trimmed = text.trim_start();
            if trimmed.is_empty() {
                return Ok(());
            }
            text = trimmed.to_owned();
            self.text_started = true;
        }
        if text.is_empty() {
            return Ok(());
        }
        self.tx
            .send(Out::Text { reasoning, text })
            .await
            .map_err(|_| ())
    }
}

/// What a whole generation gave, for the non-streamed replies.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Collected {
    pub text: String,
    pub reasoning: String,
    pub calls: Vec<(String, String)>,
    pub logprobs: Vec<Logprob>,
    pub end: Option<End>,
    pub generated: u32,
    /// Of `generated`, the tokens of reasoning.
    pub reasoning_tokens: u32,
}

/// Reads a run to its end. `Err` with the lane's message when it failed.
/// Why a generation gathered by [`collect`] did not end: the lane's
/// failure, or (`own`) one of the request's own making.
#[derive(Debug)]
pub struct Failure {
    pub message: String,
    pub own: bool,
}

impl Failure {
    /// The route's error: a 400 for the request's own fault, else a 503.
    pub fn api(self, family: super::Family) -> super::ApiError {
        let kind = if self.own {
            super::Kind::Invalid
        } else {
            super::Kind::Unavailable
        };
        super::ApiError::new(family, kind, self.message)
    }
}

pub async fn collect(mut out: mpsc::Receiver<Out>) -> Result<Collected, Failure> {
    let mut c = Collected::default();
    while let Some(o) = out.recv().await {
        match o {
            Out::Text {
                reasoning: true,
                text,
            } => c.reasoning.push_str(&text),
            Out::Text { text, .. } => c.text.push_str(&text),
            Out::Call { name, arguments } => c.calls.push((name, arguments)),
            Out::Logprob(lp) => c.logprobs.push(lp),
            Out::Ended {
                end,
                generated,
                reasoning,
            } => {
                c.end = Some(end);
                c.generated = generated;
                c.reasoning_tokens = reasoning;
                return Ok(c);
            }
            Out::Failed(message) => {
                return Err(Failure {
                    message,
                    own: false,
                })
            }
            Out::Refused(message) => return Err(Failure { message, own: true }),
        }
    }
    Err(Failure {
        message: "the generation ended without a reason".into(),
        own: false,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_cut_closing_marker_is_dropped_from_the_reasoning() {
        for (text, want) in [
            ("thinking</think", "thinking"),
            ("thinking<", "thinking"),
            ("a < b", "a < b"),
            ("done", "done"),
            ("</think>", "</think>"),
        ] {
            let mut t = text.to_owned();
            super::strip_marker_start(&mut t, "</think>");
            assert_eq!(t, want, "{text}");
        }
    }
}
