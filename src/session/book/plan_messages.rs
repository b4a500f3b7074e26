//! Plans of the appends: raw text or tokens, chat messages, the opening
//! system turn, blocks.

use super::folds::{chat_messages, declared_tools, is_input, turn_closing};
use super::{ChatMessage, Planned, Render, SessionBook, SessionError};
use crate::wire::{Event, Record, Role, SessionId, Token};

/// A request's role, as a [`Role`]: an unknown one is refused.
pub(super) fn check_role(r: u8) -> Result<Role, SessionError> {
    Ok(Role::try_from(r)?)
}

/// The most tokens one `Append` carries as a span. Its text, when not
/// given, is detokenized where the Append is planned (the session's actor):
/// this bounds that work (about 10 ms) before it starts, and keeps a 16 MiB
/// body of one-byte tokens from growing into a record several times its size.
pub const MAX_APPEND_TOKENS: usize = 128 << 10;

impl SessionBook {
    /// `Append`: raw text or raw tokens, outside the chat template. A span,
    /// when given, is what goes on the input (its text is the given text or,
    /// without one, the span detokenized); otherwise the text is tokenized.
    pub fn plan_append(
        &self,
        s: SessionId,
        text: Option<String>,
        span: Vec<Token>,
        render: &dyn Render,
        now: u64,
    ) -> Result<Planned, SessionError> {
        self.writable(s)?;
        let (text, span) = if span.is_empty() {
            let text = text.ok_or_else(|| {
                SessionError::Invalid("Append needs a text or a non-empty span".into())
            })?;
            if text.is_empty() {
                return Err(SessionError::Invalid("Append of empty text".into()));
            }
            let span = render.tokenize(&text);
            (text, span)
        } else {
            if span.len() > MAX_APPEND_TOKENS {
                return Err(SessionError::Invalid(format!(
                    "a span of {} tokens, over the limit of {MAX_APPEND_TOKENS} tokens an Append",
                    span.len()
                )));
            }
            let n = render.n_vocab();
            if let Some(bad) = span.iter().find(|&&t| t >= n) {
                return Err(SessionError::Invalid(format!(
                    "token {bad} is outside the vocabulary (0..{n})"
                )));
            }
            let text = text.unwrap_or_else(|| render.detokenize(&span));
            (text, span)
        };
        self.one_event(s, now, Record::Appended { text, span })
    }

    /// `AppendMessage`: a message rendered by the chat template.
    pub fn plan_message(
        &self,
        s: SessionId,
        role: u8,
        text: String,
        render: &dyn Render,
        now: u64,
    ) -> Result<Planned, SessionError> {
        let role = check_role(role)?;
        self.writable(s)?;
        let events = self.all_events(s);
        let span = self.render_message(&events, role, &text, render)?;
        self.one_event(s, now, Record::Message { role, text, span })
    }

    pub(super) fn render_message(
        &self,
        events: &[Event],
        role: Role,
        text: &str,
        render: &dyn Render,
    ) -> Result<Vec<Token>, SessionError> {
        let first = events.iter().all(|e| e.body.span().is_empty());
        let new = ChatMessage {
            role,
            content: text.to_string(),
        };
        let mut span = turn_closing(events, render);
        span.extend(
            render
                .message_span(&chat_messages(events), &declared_tools(events), &new, first)
                .map_err(SessionError::Render)?,
        );
        Ok(span)
    }

    /// `AppendSystem`: the opening system turn declaring tools. Refused once
    /// the session has any input, inherited history included.
    pub fn plan_system(
        &self,
        s: SessionId,
        text: Option<String>,
        tools: Vec<String>,
        render: &dyn Render,
        now: u64,
    ) -> Result<Planned, SessionError> {
        self.writable(s)?;
        if let Some(why) = crate::session::schema_limits::check_tools(&tools) {
            return Err(SessionError::ToolLimit(why));
        }
        if self.all_events(s).iter().any(|e| is_input(&e.body)) {
            return Err(SessionError::SystemAfterInput(s));
        }
        let span = render
            .system_span(text.as_deref(), &tools)
            .map_err(SessionError::Render)?;
        self.one_event(s, now, Record::System { text, tools, span })
    }

    /// `AppendBlock`: a message of a given kind, rendered like a message.
    pub fn plan_block(
        &self,
        s: SessionId,
        role: u8,
        kind: String,
        payload: String,
        render: &dyn Render,
        now: u64,
    ) -> Result<Planned, SessionError> {
        let role = check_role(role)?;
        self.writable(s)?;
        if kind.is_empty() {
            return Err(SessionError::Invalid("AppendBlock needs a kind".into()));
        }
        let events = self.all_events(s);
        let span = self.render_message(&events, role, &payload, render)?;
        self.one_event(
            s,
            now,
            Record::Block {
                role,
                kind,
                payload,
                span,
            },
        )
    }

    /// `AppendImage`: `layout` is the projector's layout of the blob (the
    /// worker's `MediaLayout`), placed between `pre_text`'s tokens and
    /// `post_text`'s inside the chat template's message.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_image(
        &self,
        s: SessionId,
        role: u8,
        blob: String,
        pre_text: String,
        post_text: String,
        layout: &[Token],
        render: &dyn Render,
        now: u64,
    ) -> Result<Planned, SessionError> {
        let role = check_role(role)?;
        self.writable(s)?;
        let events = self.all_events(s);
        let first = events.iter().all(|e| e.body.span().is_empty());
        let mut span = turn_closing(&events, render);
        span.extend(
            render
                .image_span(
                    &chat_messages(&events),
                    &declared_tools(&events),
                    role,
                    &[pre_text.clone(), post_text.clone()],
                    &[layout.to_vec()],
                    first,
                )
                .map_err(SessionError::Render)?,
        );
        let image_at = crate::session::locate_images(&span, std::slice::from_ref(&layout.to_vec()))
            .map_err(SessionError::Render)?[0];
        self.one_event(
            s,
            now,
            Record::Image {
                role,
                blob,
                pre_text,
                post_text,
                span,
                image_at: image_at as u32,
                image_len: layout.len() as u32,
            },
        )
    }
}
