//! Sessions as plain data: the book of every session, rebuilt from the log and
//! changed only by applying committed log records. No actix, no I/O, no model:
//! rendering text into tokens goes through the [`Render`] trait, which the
//! daemon implements with the model's vocabulary and chat template and the
//! tests with a fake.
//!
//! - [`SessionBook`] (`book/`): every session's view; requests become typed
//!   plans ([`Planned`], [`GenerationPlan`]) from one read of it, and committed
//!   records change it (`apply`).
//! - [`turn`]: a generation's drawn tokens to the records it commits, and the
//!   finish rule (which finish codes close an assistant turn).
//! - [`output`]: the output decoder (text, reasoning and tool-call channels).
//! - [`grammar`]: the grammar that forces a tool call.
//!
//! "Turn" always means an assistant turn (`TurnState`, `TurnOutput`); one
//! message as the chat template sees it is a [`ChatMessage`] (the engine's
//! template renders this same type).

mod book;
#[cfg(test)]
pub(crate) mod fake_render;
pub mod gbnf_cost;
pub mod grammar;
pub mod output;
pub mod schema_limits;
pub mod turn;

pub use book::{
    check_tool_choice, input_after, ledger_of, output_schema_of, tool_choice_of, ApplyError,
    ChoiceRefusal, GenerationPlan, Owned, Planned, PlannedEvent, SessionBook, TurnState,
};

use crate::wire::{LedgerStatus, Role, Token, UnknownCode};

/// One message as the chat template sees it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: Role, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role,
            content: content.into(),
        }
    }
}

/// The tokens a user message's span opens with after an assistant turn
/// that ended with its end-of-turn token: what a session's next turn most
/// likely starts with (the scheduler decodes them ahead after that token,
/// `SchedulerState::with_turn_opening`). The rest of the template's
/// closing of the turn (ChatML's newline after `<|im_end|>`, which the
/// book puts at the start of the next span: `folds::turn_closing`), then
/// the part two different messages' spans share; empty when the template
/// renders none.
pub fn turn_opening(render: &dyn Render) -> Vec<Token> {
    let history = [
        ChatMessage::new(Role::User, "Hello."),
        ChatMessage::new(Role::Assistant, "Hi."),
    ];
    let mut opening = match render.turn_tail(&history, &[]) {
        Ok(tail) => match tail.split_first() {
            Some((&eot, rest)) if render.is_eog(eot) => rest.to_vec(),
            _ => tail,
        },
        Err(_) => Vec::new(),
    };
    let span =
        |text: &str| render.message_span(&history, &[], &ChatMessage::new(Role::User, text), false);
    if let (Ok(a), Ok(b)) = (span("A"), span("Z")) {
        opening.extend(
            a.iter()
                .zip(&b)
                .take_while(|(x, y)| x == y)
                .map(|(x, _)| *x),
        );
    }
    opening
}

/// A whole conversation's tokens and where its parts are
/// ([`Render::conversation`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RenderedConversation {
    /// Every message's tokens, then the assistant header's.
    pub tokens: Vec<Token>,
    /// Where each message's content ends in `tokens` (its closing template
    /// tokens follow).
    pub ends: Vec<usize>,
    /// How many trailing tokens are the assistant header.
    pub header: usize,
}

impl RenderedConversation {
    /// The assistant header's tokens.
    pub fn header(&self) -> &[Token] {
        &self.tokens[self.tokens.len() - self.header..]
    }
}

/// Where each image's layout starts in `span` (a rendering with `images`
/// placed in order): found by each layout's first embedding position, which
/// no text token can be. Err when a layout has no embedding or the template
/// did not keep one whole where it was put.
pub fn locate_images(span: &[Token], images: &[Vec<Token>]) -> Result<Vec<usize>, RenderError> {
    use crate::wire::worker::MEDIA_TOKEN;
    let mut out = Vec::with_capacity(images.len());
    let mut cursor = 0;
    for layout in images {
        let lead = layout
            .iter()
            .position(|&t| t == MEDIA_TOKEN)
            .ok_or_else(|| {
                RenderError("the projector laid an image out with no embedding".into())
            })?;
        let at = span
            .iter()
            .skip(cursor)
            .position(|&t| t == MEDIA_TOKEN)
            .map(|p| p + cursor)
            .and_then(|p| p.checked_sub(lead))
            .filter(|&at| at >= cursor && span.get(at..at + layout.len()) == Some(&layout[..]))
            .ok_or_else(|| {
                RenderError("the chat template did not keep an image where it was put".into())
            })?;
        out.push(at);
        cursor = at + layout.len();
    }
    Ok(out)
}

/// A conversation as the concatenation of each message's span and the
/// assistant header: one template render per message and its history.
pub fn conversation_by_spans<R: Render + ?Sized>(
    render: &R,
    messages: &[ChatMessage],
    tools: &[String],
) -> Result<RenderedConversation, RenderError> {
    let mut tokens = Vec::new();
    let mut ends = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        tokens.extend(render.message_span(&messages[..i], tools, m, i == 0)?);
        ends.push(tokens.len());
    }
    let header = render.generation_prompt_span(messages, tools)?;
    let n = header.len();
    tokens.extend(header);
    Ok(RenderedConversation {
        tokens,
        ends,
        header: n,
    })
}

/// Turns text into the exact tokens it puts on the model's input.
pub trait Render: Send + Sync {
    /// The vocabulary's size: every token id must be below it.
    fn n_vocab(&self) -> u32;
    /// SHA-256 of the vocabulary (`engine::vocab::vocab_digest`), when the
    /// renderer has a real one: the lane checks each worker's against it.
    fn vocab_digest(&self) -> Option<[u8; 32]> {
        None
    }
    /// Plain text to tokens, with no special-token parsing and no BOS.
    fn tokenize(&self, text: &str) -> Vec<Token>;
    /// Tokens back to text.
    fn detokenize(&self, span: &[Token]) -> String;
    /// The tokens `new` adds after `history`, rendered by the chat template
    /// with the session's declared tools. `first` is true when nothing is on
    /// the session's input yet (a BOS may be due).
    fn message_span(
        &self,
        history: &[ChatMessage],
        tools: &[String],
        new: &ChatMessage,
        first: bool,
    ) -> Result<Vec<Token>, RenderError>;
    /// The tokens a message with images adds after `history`: `texts[0]`,
    /// `images[0]`, `texts[1]`, ... (one more text than images), rendered
    /// like a message whose content is the texts joined, its content tokens
    /// being each text's with each image's layout (the projector's
    /// positions) between them. This default (for renderers without a
    /// template) is just those content tokens.
    fn image_span(
        &self,
        history: &[ChatMessage],
        tools: &[String],
        role: Role,
        texts: &[String],
        images: &[Vec<Token>],
        first: bool,
    ) -> Result<Vec<Token>, RenderError> {
        let _ = (history, tools, role, first);
        let mut out = Vec::new();
        for (i, text) in texts.iter().enumerate() {
            out.extend(self.tokenize(text));
            if let Some(image) = images.get(i) {
                out.extend_from_slice(image);
            }
        }
        Ok(out)
    }
    /// The template's text after the last message's content in the
    /// rendering of `history` (what closes it: ChatML's `<|im_end|>\n`);
    /// empty when the template does not keep that content as given, and
    /// for renderers without a template (this default).
    fn turn_tail(
        &self,
        history: &[ChatMessage],
        tools: &[String],
    ) -> Result<Vec<Token>, RenderError> {
        let _ = (history, tools);
        Ok(Vec::new())
    }
    /// The opening system turn declaring `tools`.
    fn system_span(&self, text: Option<&str>, tools: &[String]) -> Result<Vec<Token>, RenderError>;
    /// The assistant header that opens a generated turn after `history`.
    fn generation_prompt_span(
        &self,
        history: &[ChatMessage],
        tools: &[String],
    ) -> Result<Vec<Token>, RenderError>;
    /// A whole conversation rendered at once, then the assistant header.
    /// The tokens are the concatenation of each message's span and the
    /// header; this default builds it from them (one template render per
    /// message and its history), a renderer with a faster way overrides it.
    fn conversation(
        &self,
        messages: &[ChatMessage],
        tools: &[String],
    ) -> Result<RenderedConversation, RenderError> {
        conversation_by_spans(self, messages, tools)
    }
    /// A token's raw bytes (possibly part of a UTF-8 character).
    fn piece(&self, token: Token) -> Vec<u8>;
    /// True when the token ends the model's turn.
    fn is_eog(&self, token: Token) -> bool;
    /// The chat template's source (to find its thinking and tool markers).
    fn template_source(&self) -> String;
    /// The fill-in-the-middle tokens `[prefix, suffix, middle]`, if the
    /// model has them.
    fn fim(&self) -> Option<[Token; 3]>;
}

/// Why the chat template could not render a message: its message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct RenderError(pub String);

/// The most edits one `Rebase` takes.
pub const MAX_EDITS: usize = 64;

/// Why a Rebase's edits were refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EditError {
    #[error("Rebase needs at least one edit")]
    NoEdits,
    /// Each `Replace` is rendered against the history before it, so the
    /// work grows with the square of the edits: a cap, checked first.
    #[error("Rebase takes at most {MAX_EDITS} edits; this one has {0}")]
    TooMany(usize),
    #[error("edit {index} includes event 0, which no rebase may touch")]
    TouchesEventZero { index: usize },
    #[error(
        "edit {index}: range {from}..{to} is empty or reversed (ranges are half-open, from < to)"
    )]
    EmptyOrReversed { index: usize, from: u64, to: u64 },
    #[error(
        "edit {index}: range {from}..{to} runs past the end of session {session} ({len} events)"
    )]
    PastTheEnd {
        index: usize,
        from: u64,
        to: u64,
        session: u64,
        len: u64,
    },
    #[error("edit {index}: range {from}..{to} overlaps or precedes the previous edit (edits must be sorted and must not overlap)")]
    Unsorted { index: usize, from: u64, to: u64 },
}

/// Why the book refused a request. Each becomes `Err { message }` at the edge.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SessionError {
    #[error("unknown session {0}")]
    Unknown(u64),
    #[error("session {0} was purged")]
    Purged(u64),
    #[error("cursor {cursor} is past the end of session {session} ({len} events)")]
    CursorPastEnd { session: u64, cursor: u64, len: u64 },
    #[error("{0}")]
    Invalid(String),
    #[error("version mismatch on session {session}: expected_version is {expected}, the session is at version {actual}")]
    Version {
        session: u64,
        expected: u64,
        actual: u64,
    },
    #[error("generation mismatch on session {session}: expected_generation is {expected}, the session is at generation {actual}")]
    Generation {
        session: u64,
        expected: u64,
        actual: u64,
    },
    #[error("cannot render: {0}")]
    Render(RenderError),
    /// A role, class, outcome or mode the spec does not define.
    #[error(transparent)]
    UnknownCode(#[from] UnknownCode),
    #[error(transparent)]
    Edit(#[from] EditError),
    #[error(
        "AppendSystem opens a session, and session {0} already has input \
         (templates declare tools only in the first turn)"
    )]
    SystemAfterInput(u64),
    /// A tool's schema breaks a limit of `schema_limits`: which.
    #[error("AppendSystem refused: {0}")]
    ToolLimit(String),
    #[error("tool call {call_id} was already answered ({status})")]
    CallAnswered { call_id: u64, status: LedgerStatus },
    #[error("max_tokens must be between 1 and the context size ({n_ctx})")]
    MaxTokens { n_ctx: u32 },
    #[error(transparent)]
    Grammar(#[from] grammar::GrammarError),
    /// A request that would append to the session while it generates.
    #[error("SessionBusy: session {0} has a generation in flight")]
    Busy(u64),
    #[error("session {0} has no generation in flight")]
    NotGenerating(u64),
    /// A Purge that would take session `0`, while a new session under it
    /// (Create with it as parent, Fork, Trim, Rebase) is being committed:
    /// the purge would miss it. Retrying once that commit is applied works.
    #[error("SessionBusy: a new session under session {0} is being committed; retry the purge")]
    Branching(u64),
    /// Making a record durable failed: the log layer's message.
    #[error("{0}")]
    Commit(String),
    /// The scheduler refused a generation: its message.
    #[error("{0}")]
    Admit(String),
    #[error("the scheduler is gone: {0}")]
    SchedulerGone(String),
    /// A request sent as a stream that only Generate may be.
    #[error("{0} does not stream")]
    DoesNotStream(String),
    #[error(
        "AppendImage: this model has no vision projector (start the daemon with --mmproj PATH, \
         or serve a model reference whose repository has one)"
    )]
    NoVision,
    /// AppendImage: the blob or the image it holds was refused.
    #[error("AppendImage: {0}")]
    Image(String),
    #[error("Generate streams its replies: send it on the socket or /web/ws")]
    Streams,
    /// A request the session actor does not serve (the registry routes
    /// only session requests to it).
    #[error("internal error: {0} is not a session request")]
    NotASessionRequest(String),
}
