//! The session API's requests and replies, the event envelope and the records
//! of a session's log, exactly as ../shared/spec/session-api.md writes them.
//!
//! JSON form: externally tagged (`{"Create":{...}}`), a variant without
//! fields a bare string (`"Tree"`); roles, channels, finish reasons, modes
//! and classes are plain integers, checked where they are used.
//! Variant order is the postcard format: append only (docs/protocol.md).

use serde::{Deserialize, Serialize};

pub use super::codes::{
    Channel, FimMode, Finish, LedgerStatus, QosClass, Role, ToolOutcome, UnknownCode, UnknownStatus,
};

/// A session id. Sessions count up from 1.
pub type SessionId = u64;
/// An event id within a session. Events count up from 0 (the session's
/// `Created`, or the ids it shares with the session it was forked from).
pub type EventId = u64;
/// A token id of the model's vocabulary.
pub type Token = u32;

/// Sampling parameters. All five are required; nothing is filled in from the
/// model's defaults. `temperature` 0 is greedy; `top_k` 0 disables top-k.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub top_k: u32,
    pub seed: u64,
}

impl Params {
    /// Greedy decoding (temperature 0, no top-p, min-p or top-k cut) with
    /// `seed`: what completions, tests and benchmarks run.
    pub const fn greedy(seed: u64) -> Params {
        Params {
            temperature: 0.0,
            top_p: 1.0,
            min_p: 0.0,
            top_k: 0,
            seed,
        }
    }
}

/// One edit of a `Rebase`: a half-open range `[from, to)` of the parent's
/// event ids, dropped, or replaced by one message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Edit {
    Drop {
        from: EventId,
        to: EventId,
    },
    Replace {
        from: EventId,
        to: EventId,
        role: u8,
        text: String,
    },
}

impl Edit {
    pub fn range(&self) -> (EventId, EventId) {
        match self {
            Edit::Drop { from, to } | Edit::Replace { from, to, .. } => (*from, *to),
        }
    }
}

/// How `Purge` treats the purged session's descendants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PurgeMode {
    /// Purge the descendants too.
    Cascade,
    /// Keep the descendants; the purged session's children become roots.
    Reroot,
}

/// A committed event: what a session's log holds and what clients receive.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub event_id: EventId,
    /// The daemon start (counting from 1) that committed this event.
    pub epoch: u64,
    pub ts_unix_ms: u64,
    pub body: Record,
}

/// One session-log record. `span` is always the token ids the record put on
/// the model's input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Record {
    /// Event 0 of a root session. `parent` names a session it belongs under
    /// (for the tree only; nothing is shared).
    Created {
        parent: Option<SessionId>,
        params: Params,
    },
    /// The first event of a fork (or a trim): the parent's events
    /// `0..fork_at` come before it, shared by reference.
    Forked {
        parent: SessionId,
        fork_at: EventId,
        params: Params,
    },
    /// The first event of a rebase: the parent's events `0..fork_at` come
    /// before it, and the parent's later events after it, with `edits` applied.
    Rebased {
        parent: SessionId,
        fork_at: EventId,
        params: Params,
        edits: Vec<Edit>,
    },
    Message {
        role: Role,
        text: String,
        span: Vec<Token>,
    },
    /// The assistant header a generated turn opened with.
    GenerationPrompt {
        span: Vec<Token>,
    },
    Generated {
        span: Vec<Token>,
        text: String,
        channel: Channel,
        finish: Finish,
    },
    /// A tool call parsed from the model's output; its event id is the call id.
    ToolUse {
        name: String,
        arguments: String,
    },
    ToolResult {
        call_id: EventId,
        content: String,
        span: Vec<Token>,
    },
    Appended {
        text: String,
        span: Vec<Token>,
    },
    /// Output that looked like a tool call but did not parse.
    ToolParseFailure {
        text: String,
        error: String,
    },
    /// The session's KV was rebuilt in a new epoch (after a restart or a
    /// worker crash) before generation went on.
    EpochBump,
    /// A tool call ended without a result: `outcome` 1 failed, 2 cancelled.
    ToolOutcome {
        call_id: EventId,
        outcome: ToolOutcome,
        note: String,
    },
    ToolCancelRequested {
        call_id: EventId,
    },
    PermissionRequested {
        call_id: EventId,
        text: String,
    },
    PermissionResponded {
        request_id: EventId,
        granted: bool,
    },
    Qos {
        class: QosClass,
        batch_invariant: bool,
    },
    /// The opening system turn declaring tools (`AppendSystem`); `tools` are
    /// the JSON strings as given.
    System {
        text: Option<String>,
        tools: Vec<String>,
        span: Vec<Token>,
    },
    /// `AppendImage`: `span` holds the projector's layout of the image
    /// (`wire::worker::MEDIA_TOKEN` where an embedding goes) at
    /// `span[image_at..image_at + image_len]`, between `pre_text`'s tokens
    /// and `post_text`'s, inside the chat template's message.
    Image {
        role: Role,
        blob: String,
        pre_text: String,
        post_text: String,
        span: Vec<Token>,
        image_at: u32,
        image_len: u32,
    },
    Block {
        role: Role,
        kind: String,
        payload: String,
        span: Vec<Token>,
    },
    /// `SetToolChoice`: how later generations may call tools ("auto",
    /// "required", or one tool's name).
    ToolChoice {
        choice: String,
    },
    /// `SetOutputFormat` (an extension): later generations' output follows
    /// this JSON schema (by grammar), or is free text when None.
    OutputFormat {
        schema: Option<String>,
    },
}

impl Record {
    /// The tokens this record put on the model's input.
    pub fn span(&self) -> &[Token] {
        match self {
            Record::Message { span, .. }
            | Record::GenerationPrompt { span }
            | Record::Generated { span, .. }
            | Record::ToolResult { span, .. }
            | Record::Appended { span, .. }
            | Record::System { span, .. }
            | Record::Image { span, .. }
            | Record::Block { span, .. } => span,
            _ => &[],
        }
    }

    /// The record's name, as in its JSON form.
    pub fn name(&self) -> &'static str {
        match self {
            Record::Created { .. } => "Created",
            Record::Forked { .. } => "Forked",
            Record::Rebased { .. } => "Rebased",
            Record::Message { .. } => "Message",
            Record::GenerationPrompt { .. } => "GenerationPrompt",
            Record::Generated { .. } => "Generated",
            Record::ToolUse { .. } => "ToolUse",
            Record::ToolResult { .. } => "ToolResult",
            Record::Appended { .. } => "Appended",
            Record::ToolParseFailure { .. } => "ToolParseFailure",
            Record::EpochBump => "EpochBump",
            Record::ToolOutcome { .. } => "ToolOutcome",
            Record::ToolCancelRequested { .. } => "ToolCancelRequested",
            Record::PermissionRequested { .. } => "PermissionRequested",
            Record::PermissionResponded { .. } => "PermissionResponded",
            Record::Qos { .. } => "Qos",
            Record::System { .. } => "System",
            Record::Image { .. } => "Image",
            Record::Block { .. } => "Block",
            Record::ToolChoice { .. } => "ToolChoice",
            Record::OutputFormat { .. } => "OutputFormat",
        }
    }
}

/// One entry of wal.log. Events of one session committed together (a
/// rebase's header and its replacement messages) are one entry, so a crash
/// never leaves half of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum LogRecord {
    Events {
        session: SessionId,
        events: Vec<Event>,
    },
    /// `SetMeta`: the session's title and archived flag as of `version`.
    Meta {
        session: SessionId,
        version: u64,
        title: Option<String>,
        archived: bool,
        ts_unix_ms: u64,
    },
    /// `Purge`: `sessions` are the ones removed (the session, and with
    /// Cascade its descendants). Their bytes stay in the log.
    Purge {
        session: SessionId,
        mode: PurgeMode,
        sessions: Vec<SessionId>,
        ts_unix_ms: u64,
    },
    /// A daemon start; events committed after it carry this epoch.
    Boot { epoch: u64, ts_unix_ms: u64 },
}

/// A request of the session API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    Create {
        parent: Option<SessionId>,
        params: Params,
    },
    Append {
        session: SessionId,
        text: Option<String>,
        span: Vec<Token>,
    },
    AppendMessage {
        session: SessionId,
        role: u8,
        text: String,
    },
    AppendSystem {
        session: SessionId,
        text: Option<String>,
        tools: Vec<String>,
    },
    AppendBlock {
        session: SessionId,
        role: u8,
        kind: String,
        payload: String,
    },
    AppendImage {
        session: SessionId,
        role: u8,
        blob: String,
        pre_text: String,
        post_text: String,
    },
    Read {
        session: SessionId,
        cursor: EventId,
    },
    List,
    Sessions {
        include_archived: bool,
    },
    Tree,
    Inspect {
        session: SessionId,
    },
    SetMeta {
        session: SessionId,
        expected_version: u64,
        title: Option<String>,
        archived: Option<bool>,
    },
    Purge {
        session: SessionId,
        expected_generation: u64,
        mode: PurgeMode,
    },
    Generate {
        session: SessionId,
        max_tokens: u32,
    },
    Cancel {
        session: SessionId,
    },
    Subscribe {
        session: SessionId,
        cursor: EventId,
        provisional: bool,
    },
    Unsubscribe {
        sub: u64,
    },
    Complete {
        prefix: String,
        suffix: String,
        mode: u8,
        max_tokens: u32,
    },
    Fork {
        session: SessionId,
        at_event: EventId,
        params: Option<Params>,
    },
    Rebase {
        session: SessionId,
        edits: Vec<Edit>,
        params: Option<Params>,
    },
    Trim {
        session: SessionId,
        to_event: EventId,
    },
    AppendToolResult {
        session: SessionId,
        call_id: EventId,
        content: String,
    },
    AppendToolOutcome {
        session: SessionId,
        call_id: EventId,
        outcome: u8,
        note: String,
    },
    RequestToolCancel {
        session: SessionId,
        call_id: EventId,
    },
    OpenToolCalls {
        session: SessionId,
    },
    Ledger {
        session: SessionId,
    },
    RequestPermission {
        session: SessionId,
        call_id: EventId,
        text: String,
    },
    RespondPermission {
        session: SessionId,
        request_id: EventId,
        granted: bool,
    },
    SetQos {
        session: SessionId,
        class: u8,
        batch_invariant: bool,
    },
    SetBackgroundRate {
        divisor: u32,
    },
    Pin {
        session: SessionId,
        ttl_ms: u64,
    },
    PutMedia {
        bytes: Vec<u8>,
        mime: String,
    },
    GcMedia,
    SetLogLevel {
        directive: String,
    },
    Metrics,
    /// Not in the spec's table (an extension, docs/protocol.md): how the
    /// session's later generations may call its declared tools: "auto" (the
    /// default), "required" (a call to one of them is forced by a grammar),
    /// or a tool's name (a call to that tool is forced).
    SetToolChoice {
        session: SessionId,
        choice: String,
    },
    /// Not in the spec's table (an extension, docs/protocol.md): the JSON
    /// schema (a JSON document, as text) that the session's later
    /// generations' output must follow, forced by a grammar; None sets it
    /// back to free text. A forced tool call wins over it.
    SetOutputFormat {
        session: SessionId,
        schema: Option<String>,
    },
    /// Not in the spec's table (an extension, docs/protocol.md): the model
    /// this connection's later requests go to (a daemon serving more than
    /// one, `serve --model`): its id, its file name, or "default" (the
    /// first model, where every connection starts). Answers `Ack`.
    UseModel {
        model: String,
    },
    /// Not in the spec's table (an extension): the models the daemon
    /// serves. Answers `Models`.
    Models,
}

impl Request {
    /// The session a request is about, if it is about one.
    pub fn session(&self) -> Option<SessionId> {
        use Request::*;
        match self {
            Append { session, .. }
            | AppendMessage { session, .. }
            | AppendSystem { session, .. }
            | AppendBlock { session, .. }
            | AppendImage { session, .. }
            | Read { session, .. }
            | Inspect { session }
            | SetMeta { session, .. }
            | Purge { session, .. }
            | Generate { session, .. }
            | Cancel { session }
            | Subscribe { session, .. }
            | Fork { session, .. }
            | Rebase { session, .. }
            | Trim { session, .. }
            | AppendToolResult { session, .. }
            | AppendToolOutcome { session, .. }
            | RequestToolCancel { session, .. }
            | OpenToolCalls { session }
            | Ledger { session }
            | RequestPermission { session, .. }
            | RespondPermission { session, .. }
            | SetQos { session, .. }
            | SetToolChoice { session, .. }
            | SetOutputFormat { session, .. }
            | Pin { session, .. } => Some(*session),
            Create { .. }
            | List
            | Sessions { .. }
            | Tree
            | Unsubscribe { .. }
            | Complete { .. }
            | SetBackgroundRate { .. }
            | PutMedia { .. }
            | GcMedia
            | SetLogLevel { .. }
            | Metrics
            | UseModel { .. }
            | Models => None,
        }
    }
}

/// What `Inspect` tells about a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Inspection {
    pub session: SessionId,
    /// The session it was forked, rebased or trimmed from (or created under).
    pub parent: Option<SessionId>,
    pub fork_at: Option<EventId>,
    pub params: Params,
    /// The number of events; also the next event id.
    pub events: u64,
    /// Tokens on the model's input: the sum of every event's span.
    pub tokens: u64,
    /// Bumped by every committed event and every `SetMeta`: `Purge`'s
    /// `expected_generation`.
    pub generation: u64,
    /// Bumped by every `SetMeta`: its `expected_version`.
    pub version: u64,
    pub title: Option<String>,
    pub archived: bool,
    pub purged: bool,
    pub children: Vec<SessionId>,
    pub created_unix_ms: u64,
    pub updated_unix_ms: u64,
    /// True when the last generated turn is still open (cut by max_tokens or
    /// a cancel), so the next Generate continues it.
    pub open_turn: bool,
    pub generating: bool,
}

/// One row of `Sessions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionSummary {
    pub session: SessionId,
    pub parent: Option<SessionId>,
    pub title: Option<String>,
    pub archived: bool,
    pub events: u64,
    pub updated_unix_ms: u64,
}

/// One tool call of `Ledger`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LedgerEntry {
    pub call_id: EventId,
    pub name: String,
    pub arguments: String,
    /// "open", "answered", "failed", "cancelled" or "cancel requested".
    pub status: LedgerStatus,
    /// The ToolResult's or ToolOutcome's event id.
    pub closed_by: Option<EventId>,
    pub permission: Option<bool>,
}

/// A reply of the session API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Response {
    Created {
        session: SessionId,
    },
    Committed {
        event: Event,
    },
    Events {
        events: Vec<Event>,
    },
    Sessions {
        ids: Vec<SessionId>,
    },
    SessionList {
        sessions: Vec<SessionSummary>,
    },
    Tree {
        nodes: Vec<(SessionId, Option<SessionId>, Option<EventId>)>,
    },
    Inspection {
        inspection: Inspection,
    },
    Meta {
        version: u64,
    },
    Purged {
        sessions: Vec<SessionId>,
    },
    Delta {
        event: Event,
    },
    Generated {
        events: u64,
        tokens_generated: u64,
        finish: Finish,
        warm_prefix: u64,
    },
    Cancelling,
    Subscribed {
        sub: u64,
    },
    SubEvent {
        sub: u64,
        event: Event,
    },
    SubProvisional {
        sub: u64,
        channel: Channel,
        text: String,
    },
    SubEnded {
        sub: u64,
        reason: String,
    },
    Unsubscribed,
    Completion {
        text: String,
        tokens: u64,
        cached: u64,
        expired: u64,
    },
    Throttled {
        retry_after_ms: u64,
    },
    ToolCalls {
        calls: Vec<(EventId, String, String)>,
    },
    Ledger {
        entries: Vec<LedgerEntry>,
    },
    Ack,
    Pinned {
        deadline_unix_ms: u64,
    },
    Media {
        hash: String,
    },
    Gc {
        kept: u64,
        removed: u64,
    },
    Text {
        text: String,
    },
    Err {
        message: String,
    },
    /// Not in the spec (an extension): `Models`' answer, the first model
    /// first.
    Models {
        models: Vec<ModelSummary>,
    },
}

/// One model a daemon serves (`Models`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSummary {
    /// What `UseModel` and the HTTP routes' `model` name it by.
    pub id: String,
    /// Its GGUF file.
    pub file: String,
    /// The first model: where connections start.
    pub default: bool,
    /// Its lane: "loading", "ready", "respawning" or "unloaded".
    pub state: String,
}

impl Response {
    pub fn err(message: impl Into<String>) -> Response {
        Response::Err {
            message: message.into(),
        }
    }
}
