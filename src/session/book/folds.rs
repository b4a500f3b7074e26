//! Folds over a session's events: the chat messages a template sees, the
//! declared and forced tools, the QoS, where the last turn stands, the input,
//! and the tool-call ledger.

use super::{ChatMessage, SessionBook, SessionError};
use crate::session::turn::ends_turn;
use crate::session::{Render, RenderError};
use crate::wire::worker::MediaSpan;
use crate::wire::{
    Channel, Event, EventId, LedgerEntry, LedgerStatus, QosClass, Record, Role, SessionId, Token,
};

/// Where a session's last assistant turn stands, for `Generate`.
#[derive(Debug, Clone, PartialEq)]
pub enum TurnState {
    /// No open turn: generating opens one with the template's assistant header.
    Closed,
    /// The last turn was cut (max_tokens, a cancel, a crash) and generating
    /// continues it; `in_reasoning` when it stopped inside a thinking block.
    Open { in_reasoning: bool },
}

impl TurnState {
    /// Where the last turn of `events` stands. `think_close` is the
    /// template's closing thinking marker, if it has one.
    pub fn of(events: &[Event], think_close: Option<&str>) -> TurnState {
        for e in events.iter().rev() {
            match &e.body {
                // A fork's or a rebase's header puts nothing on the input:
                // a fork (or trim) of a cut reply continues that reply.
                Record::ToolUse { .. }
                | Record::ToolParseFailure { .. }
                | Record::EpochBump
                | Record::ToolChoice { .. }
                | Record::OutputFormat { .. }
                | Record::Qos { .. }
                | Record::Forked { .. }
                | Record::Rebased { .. } => continue,
                Record::GenerationPrompt { .. } => {
                    return TurnState::Open {
                        in_reasoning: false,
                    }
                }
                Record::Generated {
                    finish,
                    channel,
                    text,
                    ..
                } => {
                    // Ended by the model or by a completed grammar: closed.
                    // Cut by max_tokens, a cancel or an error: open.
                    if ends_turn(*finish) {
                        return TurnState::Closed;
                    }
                    let closed = think_close.is_some_and(|m| text.trim_end().ends_with(m));
                    return TurnState::Open {
                        in_reasoning: *channel == Channel::Reasoning && !closed,
                    };
                }
                _ => return TurnState::Closed,
            }
        }
        TurnState::Closed
    }
}

/// Every token `events` put on the input, in order.
/// The images on a session's input, at offsets into [`input_of`].
pub(super) fn media_of(events: &[Event]) -> Vec<MediaSpan> {
    let mut offset = 0u32;
    let mut out = Vec::new();
    for e in events {
        if let Record::Image {
            blob,
            image_at,
            image_len,
            ..
        } = &e.body
        {
            out.push(MediaSpan {
                at: offset + image_at,
                len: *image_len,
                blob: blob.clone(),
            });
        }
        offset += e.body.span().len() as u32;
    }
    out
}

pub(super) fn input_of(events: &[Event]) -> Vec<Token> {
    events
        .iter()
        .flat_map(|e| e.body.span().iter().copied())
        .collect()
}

/// Folds a session's events into the messages a chat template sees.
pub(super) fn chat_messages(events: &[Event]) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::new();
    let mut in_assistant = false;
    for e in events {
        match &e.body {
            Record::System { text, .. } => {
                in_assistant = false;
                out.push(ChatMessage {
                    role: Role::System,
                    content: text.clone().unwrap_or_default(),
                })
            }
            Record::Message { role, text, .. } => {
                in_assistant = false;
                out.push(ChatMessage {
                    role: *role,
                    content: text.clone(),
                })
            }
            Record::Block { role, payload, .. } => {
                in_assistant = false;
                out.push(ChatMessage {
                    role: *role,
                    content: payload.clone(),
                })
            }
            Record::Image {
                role,
                pre_text,
                post_text,
                ..
            } => {
                in_assistant = false;
                out.push(ChatMessage {
                    role: *role,
                    content: format!("{pre_text}{post_text}"),
                })
            }
            Record::ToolResult { content, .. } => {
                in_assistant = false;
                out.push(ChatMessage {
                    role: Role::Tool,
                    content: content.clone(),
                })
            }
            Record::GenerationPrompt { .. } => {
                in_assistant = true;
                out.push(ChatMessage {
                    role: Role::Assistant,
                    content: String::new(),
                })
            }
            Record::Generated { text, channel, .. } => {
                if !in_assistant {
                    in_assistant = true;
                    out.push(ChatMessage {
                        role: Role::Assistant,
                        content: String::new(),
                    });
                }
                if *channel != Channel::Reasoning {
                    if let Some(t) = out.last_mut() {
                        t.content.push_str(text);
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// The template's text that closes the generated turn `events` end with,
/// as far as the model's own tokens did not write it: what the chat
/// template puts after an assistant message's content (ChatML's
/// `<|im_end|>\n`, Render::turn_tail), less the end-of-turn token the
/// turn ended with when that is where the template's text starts. A turn
/// that ended with its end-of-turn token lacks the rest (ChatML's
/// newline); one cut by `max_tokens`, a cancel or a grammar's end lacks
/// all of it. Put before whatever templated input comes next (a message,
/// block, image, tool result or the next assistant header), so the
/// session's input is what the template renders for the same
/// conversation, as the HTTP routes send it. Nothing when the session does
/// not end with a generated turn (records that put nothing on the input,
/// a permission or an outcome, do not count; a raw `Append` after one is
/// outside the template), or when the template does not keep an assistant
/// message's content as given.
pub(super) fn turn_closing(events: &[Event], render: &dyn Render) -> Vec<Token> {
    let generated = |r: &Record| {
        matches!(
            r,
            Record::GenerationPrompt { .. }
                | Record::Generated { .. }
                | Record::ToolUse { .. }
                | Record::ToolParseFailure { .. }
        )
    };
    let Some(last) = events
        .iter()
        .rev()
        .find(|e| generated(&e.body) || !e.body.span().is_empty())
    else {
        return Vec::new();
    };
    if !generated(&last.body) {
        return Vec::new();
    }
    // The turn's last token: of its last chunk that holds one.
    let end = events
        .iter()
        .rev()
        .take_while(|e| !matches!(e.body, Record::GenerationPrompt { .. }))
        .find_map(|e| match &e.body {
            Record::Generated { span, .. } => span.last().copied(),
            _ => None,
        });
    let messages = chat_messages(events);
    if messages.last().is_none_or(|m| m.role != Role::Assistant) {
        return Vec::new();
    }
    // An error is no closing: a render the plan still waits for
    // (`prepared`) throws the plan away anyway.
    let Ok(tail) = render.turn_tail(&messages, &declared_tools(events)) else {
        return Vec::new();
    };
    match (end, tail.split_first()) {
        (Some(t), Some((&first, rest))) if t == first && render.is_eog(t) => rest.to_vec(),
        _ => tail,
    }
}

/// True when a record is input to the model (or a call it made): anything
/// but a session header, a QoS change or an epoch bump.
pub(super) fn is_input(r: &Record) -> bool {
    !matches!(
        r,
        Record::Created { .. }
            | Record::Forked { .. }
            | Record::Rebased { .. }
            | Record::Qos { .. }
            | Record::ToolChoice { .. }
            | Record::OutputFormat { .. }
            | Record::EpochBump
    )
}

/// The QoS of a session with `events`: the last `Qos` record's class and
/// batch invariance, or class 0.
pub(super) fn qos_of(events: &[Event]) -> (QosClass, bool) {
    events
        .iter()
        .rev()
        .find_map(|e| match e.body {
            Record::Qos {
                class,
                batch_invariant,
            } => Some((class, batch_invariant)),
            _ => None,
        })
        .unwrap_or((QosClass::First, false))
}

/// The tool choice the last `ToolChoice` record set ("auto" when none did).
pub fn tool_choice_of(events: &[Event]) -> String {
    events
        .iter()
        .rev()
        .find_map(|e| match &e.body {
            Record::ToolChoice { choice } => Some(choice.clone()),
            _ => None,
        })
        .unwrap_or_else(|| "auto".to_owned())
}

/// The JSON schema text the last `OutputFormat` record set (None: free text).
pub fn output_schema_of(events: &[Event]) -> Option<String> {
    events
        .iter()
        .rev()
        .find_map(|e| match &e.body {
            Record::OutputFormat { schema } => Some(schema.clone()),
            _ => None,
        })
        .flatten()
}

/// The tools (name, parameters schema) a generation must call one of, or
/// None when tool calls are not forced ("auto").
pub(super) fn forced_tools_of(events: &[Event]) -> Option<Vec<(String, serde_json::Value)>> {
    let choice = tool_choice_of(events);
    let tools: Vec<(String, serde_json::Value)> = declared_tools(events)
        .iter()
        .filter_map(|t| crate::session::grammar::tool_signature(t))
        .collect();
    match choice.as_str() {
        "auto" => None,
        "required" => Some(tools),
        name => Some(tools.into_iter().filter(|(n, _)| n == name).collect()),
    }
}

/// The JSON schema a generation's output must follow (`SetOutputFormat`),
/// or None for free text.
pub(super) fn output_format_of(events: &[Event]) -> Option<serde_json::Value> {
    output_schema_of(events).and_then(|s| serde_json::from_str(&s).ok())
}

pub(super) fn declared_tools(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .find_map(|e| match &e.body {
            Record::System { tools, .. } => Some(tools.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

/// The tokens on a session's input after `events` once `messages` are
/// appended and a generation opens, each rendered as the session will
/// (`AppendMessage`, `AppendToolResult`, then the `GenerationPrompt`):
/// what `plan_generation` weighs against the context, for a caller that
/// refuses what cannot fit before writing anything. `system` (text and
/// tools) is the opening system turn, appended first when nothing is on
/// the input yet, as `AppendSystem` is refused after input.
pub fn input_after(
    events: &[Event],
    system: Option<(Option<&str>, &[String])>,
    messages: &[ChatMessage],
    render: &dyn Render,
) -> Result<usize, RenderError> {
    let mut tokens = events.iter().map(|e| e.body.span().len()).sum::<usize>();
    // Whatever comes next opens with the closing of a generated turn.
    tokens += turn_closing(events, render).len();
    let mut history = chat_messages(events);
    let mut tools = declared_tools(events);
    if let Some((text, declared)) = system.filter(|_| tokens == 0) {
        tokens += render.system_span(text, declared)?.len();
        history.push(ChatMessage {
            role: Role::System,
            content: text.unwrap_or_default().to_owned(),
        });
        tools = declared.to_vec();
    }
    for m in messages {
        tokens += render.message_span(&history, &tools, m, tokens == 0)?.len();
        history.push(m.clone());
    }
    Ok(tokens + render.generation_prompt_span(&history, &tools)?.len())
}

/// Every ToolUse of `events` (a session's, in order) with how it stands:
/// the `Ledger`, and what a result or outcome must answer (an `Open` call),
/// for a caller that checks a request before anything is written.
pub fn ledger_of(events: &[Event]) -> Vec<LedgerEntry> {
    let mut entries: Vec<LedgerEntry> = Vec::new();
    for e in events {
        match &e.body {
            Record::ToolUse { name, arguments } => entries.push(LedgerEntry {
                call_id: e.event_id,
                name: name.clone(),
                arguments: arguments.clone(),
                status: LedgerStatus::Open,
                closed_by: None,
                permission: None,
            }),
            Record::ToolResult { call_id, .. } => {
                if let Some(x) = entries.iter_mut().find(|x| x.call_id == *call_id) {
                    x.status = LedgerStatus::Answered;
                    x.closed_by = Some(e.event_id);
                }
            }
            Record::ToolOutcome {
                call_id, outcome, ..
            } => {
                if let Some(x) = entries.iter_mut().find(|x| x.call_id == *call_id) {
                    x.status = LedgerStatus::from(*outcome);
                    x.closed_by = Some(e.event_id);
                }
            }
            Record::ToolCancelRequested { call_id } => {
                if let Some(x) = entries
                    .iter_mut()
                    .find(|x| x.call_id == *call_id && x.closed_by.is_none())
                {
                    x.status = LedgerStatus::CancelRequested;
                }
            }
            Record::PermissionResponded {
                request_id,
                granted,
            } => {
                let call = events.iter().find_map(|r| match &r.body {
                    Record::PermissionRequested { call_id, .. } if r.event_id == *request_id => {
                        Some(*call_id)
                    }
                    _ => None,
                });
                if let Some(x) = entries.iter_mut().find(|x| Some(x.call_id) == call) {
                    x.permission = Some(*granted);
                }
            }
            _ => {}
        }
    }
    entries
}

impl SessionBook {
    /// Every token on the session's input, in order.
    #[cfg(test)]
    pub fn input(&self, s: SessionId) -> Result<Vec<Token>, SessionError> {
        Ok(input_of(&self.read(s, 0)?))
    }

    /// Where the session's last turn stands. `think_close` is the template's
    /// closing thinking marker, if it has one.
    pub fn turn_state(
        &self,
        s: SessionId,
        think_close: Option<&str>,
    ) -> Result<TurnState, SessionError> {
        Ok(TurnState::of(&self.read(s, 0)?, think_close))
    }

    /// Every ToolUse of a session with how it stands.
    pub fn ledger(&self, s: SessionId) -> Result<Vec<LedgerEntry>, SessionError> {
        self.live(s)?;
        Ok(ledger_of(&self.all_events(s)))
    }

    /// `OpenToolCalls`: calls without a result or an outcome.
    pub fn open_tool_calls(
        &self,
        s: SessionId,
    ) -> Result<Vec<(EventId, String, String)>, SessionError> {
        Ok(self
            .ledger(s)?
            .into_iter()
            .filter(|x| x.closed_by.is_none())
            .map(|x| (x.call_id, x.name, x.arguments))
            .collect())
    }

    pub(super) fn open_call(
        &self,
        s: SessionId,
        call_id: EventId,
    ) -> Result<LedgerEntry, SessionError> {
        let entry = self
            .ledger(s)?
            .into_iter()
            .find(|x| x.call_id == call_id)
            .ok_or_else(|| {
                SessionError::Invalid(format!("session {s} has no tool call {call_id}"))
            })?;
        if entry.closed_by.is_some() {
            return Err(SessionError::CallAnswered {
                call_id,
                status: entry.status,
            });
        }
        Ok(entry)
    }
}
