//! `Generate`, planned: everything a generation needs from the session, read
//! in one go. The actor commits the plan's opening record (if any), admits
//! the generation to the scheduler with the plan's prompt, and decodes its
//! output with the plan's `TurnOutput`.

use serde_json::Value;

use super::folds::{
    chat_messages, declared_tools, forced_tools_of, input_of, media_of, output_format_of, qos_of,
    turn_closing,
};
use super::{PlannedEvent, SessionBook, TurnState};
use crate::session::grammar::{forced_call, json_format, SchemaToGrammar};
use crate::session::output::Markers;
use crate::session::turn::TurnOutput;
use crate::session::{Render, SessionError};
use crate::wire::worker::MediaSpan;
use crate::wire::{Params, QosClass, Record, SessionId, Token};

/// What `Generate` does to a session, from one read of the book.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationPlan {
    /// Where the session's last turn stood: Closed opens a turn, Open
    /// continues it.
    pub state: TurnState,
    /// The record committed before the generation is admitted: the
    /// `GenerationPrompt` opening a turn, or an `EpochBump` when an open
    /// turn from an earlier daemon start is continued (its KV is rebuilt by
    /// prefill, which can differ in the last bits from the original decode;
    /// the log says so). None when continuing a turn of this daemon start.
    pub opening: Option<PlannedEvent>,
    /// Every token on the session's input once `opening` is committed.
    pub prompt: Vec<Token>,
    /// The images on `prompt` (`AppendImage`), at offsets into it.
    pub media: Vec<MediaSpan>,
    pub params: Params,
    /// The session's QoS class and batch invariance.
    pub class: QosClass,
    pub batch_invariant: bool,
    /// The tools (name, parameters schema) a call is forced to, or None
    /// ("auto").
    pub forced_tools: Option<Vec<(String, Value)>>,
    /// The grammar forcing that call, or else the output format
    /// (`SetOutputFormat`). It governs the whole turn, from its header on,
    /// with what the turn holds so far as its prefix, so a cut forced call
    /// or answer continues where it stopped.
    pub grammar: Option<String>,
    /// Where on `prompt` the turn's output begins (just after its header):
    /// the grammar's start.
    pub grammar_from: usize,
    /// The template's thinking and tool-call markers.
    pub markers: Markers,
    /// The turn opened inside a thinking block (its header ends with the
    /// opening marker).
    pub opened_in_reasoning: bool,
    /// The open turn's tokens so far with their pieces (end-of-generation
    /// tokens left out): the output decoder resumes over them, so a marker
    /// or tool call split across a cut is still recognised.
    pub turn: Vec<(Token, Vec<u8>)>,
}

impl GenerationPlan {
    /// The output side of the planned generation.
    pub fn output(&self) -> TurnOutput {
        TurnOutput::resume(self.markers.clone(), self.opened_in_reasoning, &self.turn)
            .with_forced_call(self.forced_tools.is_some())
    }
}

impl SessionBook {
    /// `Generate` with `max_tokens` on a lane of `n_ctx` tokens. `convert`
    /// turns a JSON schema into a grammar (for a forced tool call).
    pub fn plan_generation(
        &self,
        s: SessionId,
        max_tokens: u32,
        n_ctx: u32,
        render: &dyn Render,
        convert: SchemaToGrammar,
        now: u64,
    ) -> Result<GenerationPlan, SessionError> {
        if max_tokens == 0 || max_tokens > n_ctx {
            return Err(SessionError::MaxTokens { n_ctx });
        }
        let sess = self.writable(s)?;
        let events = self.all_events(s);
        let forced_tools = forced_tools_of(&events);
        let mut markers = Markers::from_template(&render.template_source())
            .with_tools(!declared_tools(&events).is_empty());
        if forced_tools.is_some() {
            markers = markers.forcing_a_call();
        }
        let think_open = markers.think.as_ref().map(|m| m.0.as_str());
        let think_close = markers.think.as_ref().map(|m| m.1.as_str());
        let state = TurnState::of(&events, think_close);
        let mut prompt = input_of(&events);
        let media = media_of(&events);
        // The last turn's header and where its output begins.
        let mut header = None;
        let mut offset = 0;
        for e in &events {
            offset += e.body.span().len();
            if let Record::GenerationPrompt { span } = &e.body {
                header = Some((offset, span.clone()));
            }
        }
        let opening = match state {
            TurnState::Open { .. } => {
                // The epoch of the turn's last output, not of a record after
                // it that puts nothing on the input (a fork's header, a QoS,
                // tool choice or output format set since): a fork made now
                // of a turn cut before the restart is rebuilt by prefill too.
                let last = events.iter().rev().find(|e| {
                    !matches!(
                        e.body,
                        Record::Forked { .. }
                            | Record::Rebased { .. }
                            | Record::Qos { .. }
                            | Record::ToolChoice { .. }
                            | Record::OutputFormat { .. }
                    )
                });
                let stale = last.map_or(0, |e| e.epoch) < self.epoch;
                stale.then(|| self.planned_event(s, sess.len, now, Record::EpochBump))
            }
            TurnState::Closed => {
                // After a generated turn (a Generate again), its closing first.
                let mut span = turn_closing(&events, render);
                span.extend(
                    render
                        .generation_prompt_span(&chat_messages(&events), &declared_tools(&events))
                        .map_err(SessionError::Render)?,
                );
                prompt.extend_from_slice(&span);
                header = Some((prompt.len(), span.clone()));
                Some(self.planned_event(s, sess.len, now, Record::GenerationPrompt { span }))
            }
        };
        // Refused before anything is committed: the opening record of a
        // generation the scheduler cannot admit would stay in the log, an
        // open turn no client was told of.
        if prompt.len() as u64 + 1 > u64::from(n_ctx) {
            return Err(SessionError::Admit(
                crate::scheduler::SchedulerError::DoesNotFit {
                    tokens: prompt.len(),
                    n_ctx,
                }
                .to_string(),
            ));
        }
        let (grammar_from, header) = header.unwrap_or((prompt.len(), Vec::new()));
        let opened_in_reasoning =
            think_open.is_some_and(|m| render.detokenize(&header).trim_end().ends_with(m));
        let close = think_close.filter(|_| opened_in_reasoning);
        let grammar = match (&forced_tools, output_format_of(&events)) {
            (Some(tools), _) => Some(forced_call(tools, close, convert)?),
            (None, Some(schema)) => Some(json_format(&schema, close, convert)?),
            (None, None) => None,
        };
        let turn = prompt[grammar_from.min(prompt.len())..]
            .iter()
            .filter(|&&t| !render.is_eog(t))
            .map(|&t| (t, render.piece(t)))
            .collect();
        let (class, batch_invariant) = qos_of(&events);
        Ok(GenerationPlan {
            state,
            opening,
            prompt,
            media,
            params: sess.params,
            class,
            batch_invariant,
            forced_tools,
            grammar,
            grammar_from,
            markers,
            opened_in_reasoning,
            turn,
        })
    }

    /// A record the generation produced (Generated, ToolUse,
    /// ToolParseFailure, EpochBump) as the session's next event.
    pub fn plan_output(
        &self,
        s: SessionId,
        body: Record,
        now: u64,
    ) -> Result<PlannedEvent, SessionError> {
        match body {
            Record::Generated { .. }
            | Record::ToolUse { .. }
            | Record::ToolParseFailure { .. }
            | Record::EpochBump => self.next_event(s, now, body),
            other => Err(SessionError::Invalid(format!(
                "{} is not generation output",
                other.name()
            ))),
        }
    }
}
