//! `SessionBook`: every session's view of the log, and the rules that turn a
//! request into the log record that would carry it out.
//!
//! Requests are handled in two steps. `plan_*` checks a request against the
//! book and returns the `LogRecord` to commit, changing nothing. Once the
//! record is durable, `apply` changes the book. Replay on start calls the same
//! `apply`, so a session reads back identically after a restart.
//!
//! A fork, rebase or trim never copies its parent's events: its view is a
//! list of pieces, each either a range of another session's view (shared by
//! reference) or a range of its own events. The parent is never rewritten,
//! and since a session's log only grows, a shared range never changes.
//!
//! Ordering rule (kept by the actors): a branch record (Forked, Rebased) is
//! planned, committed and applied while its parent's actor holds the parent,
//! so the parent's length cannot change in between; replay sees the same
//! order in the log.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{Render, SessionError, Turn};
use crate::wire::{
    role, Edit, Event, EventId, Inspection, LedgerEntry, LogRecord, Params, PurgeMode, Record,
    SessionId, SessionSummary, Token,
};

/// A range of a session's view. A fork's pieces point straight at the
/// sessions that own the events (never at another view), so reading any
/// session is one level deep however long its chain of forks.
#[derive(Debug, Clone)]
enum Piece {
    /// Entries `from..to` of another session's own events, shared by
    /// reference.
    Shared {
        session: SessionId,
        from: usize,
        to: usize,
    },
    /// Entries `from..to` of this session's own events.
    Own { from: usize, to: usize },
}

impl Piece {
    fn len(&self) -> u64 {
        match self {
            Piece::Shared { from, to, .. } | Piece::Own { from, to } => (to - from) as u64,
        }
    }
}

#[derive(Debug)]
struct Session {
    tree_parent: Option<SessionId>,
    fork_at: Option<EventId>,
    params: Params,
    pieces: Vec<Piece>,
    own: Vec<Arc<Event>>,
    len: u64,
    tokens: u64,
    generation: u64,
    version: u64,
    title: Option<String>,
    archived: bool,
    purged: bool,
    /// Its tree parent was purged with Reroot: shown as a root.
    rerooted: bool,
    children: Vec<SessionId>,
    created_unix_ms: u64,
    updated_unix_ms: u64,
}

/// Where a session's last assistant turn stands, for `Generate`.
#[derive(Debug, Clone, PartialEq)]
pub enum TurnState {
    /// No open turn: generating opens one with the template's assistant header.
    Closed,
    /// The last turn was cut (max_tokens, a cancel, a crash) and generating
    /// continues it; `in_reasoning` when it stopped inside a thinking block.
    Open { in_reasoning: bool },
}

/// What a plan commits; the actor replies from it once it is applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub record: LogRecord,
}

/// Every session, as the log says.
#[derive(Debug, Default)]
pub struct SessionBook {
    sessions: BTreeMap<SessionId, Session>,
    next_session: SessionId,
    epoch: u64,
}

/// A planned piece of a rebased view, before it has event ids.
enum RebasePiece {
    Shared(EventId, EventId),
    Replace(u8, String),
}

fn check_params(p: &Params) -> Result<(), SessionError> {
    let bad = |what: &str| Err(SessionError::Invalid(format!("params: {what}")));
    if !p.temperature.is_finite() || p.temperature < 0.0 {
        return bad("temperature must be a finite number >= 0 (0 is greedy)");
    }
    if !p.top_p.is_finite() || !(0.0..=1.0).contains(&p.top_p) {
        return bad("top_p must be between 0 and 1");
    }
    if !p.min_p.is_finite() || !(0.0..=1.0).contains(&p.min_p) {
        return bad("min_p must be between 0 and 1");
    }
    Ok(())
}

fn check_role(r: u8) -> Result<(), SessionError> {
    if role::name(r).is_none() {
        return Err(SessionError::Invalid(format!(
            "unknown role {r}: roles are 0 system, 1 user, 2 assistant, 3 tool"
        )));
    }
    Ok(())
}

/// Folds a session's events into the messages a chat template sees.
fn turns(events: &[Event]) -> Vec<Turn> {
    let mut out: Vec<Turn> = Vec::new();
    let mut in_assistant = false;
    for e in events {
        match &e.body {
            Record::System { text, .. } => {
                in_assistant = false;
                out.push(Turn {
                    role: role::SYSTEM,
                    content: text.clone().unwrap_or_default(),
                })
            }
            Record::Message { role, text, .. } => {
                in_assistant = false;
                out.push(Turn {
                    role: *role,
                    content: text.clone(),
                })
            }
            Record::Block { role, payload, .. } => {
                in_assistant = false;
                out.push(Turn {
                    role: *role,
                    content: payload.clone(),
                })
            }
            Record::ToolResult { content, .. } => {
                in_assistant = false;
                out.push(Turn {
                    role: role::TOOL,
                    content: content.clone(),
                })
            }
            Record::GenerationPrompt { .. } => {
                in_assistant = true;
                out.push(Turn {
                    role: role::ASSISTANT,
                    content: String::new(),
                })
            }
            Record::Generated { text, channel, .. } => {
                if !in_assistant {
                    in_assistant = true;
                    out.push(Turn {
                        role: role::ASSISTANT,
                        content: String::new(),
                    });
                }
                if *channel != crate::wire::channel::REASONING {
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

/// True when a record is input to the model (or a call it made): anything
/// but a session header, a QoS change or an epoch bump.
fn is_input(r: &Record) -> bool {
    !matches!(
        r,
        Record::Created { .. }
            | Record::Forked { .. }
            | Record::Rebased { .. }
            | Record::Qos { .. }
            | Record::ToolChoice { .. }
            | Record::EpochBump
    )
}

fn declared_tools(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .find_map(|e| match &e.body {
            Record::System { tools, .. } => Some(tools.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

impl SessionBook {
    pub fn new() -> SessionBook {
        SessionBook {
            sessions: BTreeMap::new(),
            next_session: 1,
            epoch: 0,
        }
    }

    /// The current daemon start; events committed now carry it.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Plans the Boot record of a new daemon start.
    pub fn plan_boot(&self, now: u64) -> LogRecord {
        LogRecord::Boot {
            epoch: self.epoch + 1,
            ts_unix_ms: now,
        }
    }

    /// Reserves a session id; ids are never reused, even if the commit fails.
    pub fn reserve_id(&mut self) -> SessionId {
        let id = self.next_session;
        self.next_session += 1;
        id
    }

    fn get(&self, s: SessionId) -> Result<&Session, SessionError> {
        self.sessions.get(&s).ok_or(SessionError::Unknown(s))
    }

    fn live(&self, s: SessionId) -> Result<&Session, SessionError> {
        let sess = self.get(s)?;
        if sess.purged {
            return Err(SessionError::Purged(s));
        }
        Ok(sess)
    }

    /// Ok when the session exists and is not purged.
    pub fn check_live(&self, s: SessionId) -> Result<(), SessionError> {
        self.live(s).map(|_| ())
    }

    /// True when the session exists and is not purged.
    pub fn is_live(&self, s: SessionId) -> bool {
        self.live(s).is_ok()
    }

    /// The number of events of a session: also its next event id.
    pub fn len(&self, s: SessionId) -> Result<u64, SessionError> {
        Ok(self.get(s)?.len)
    }

    pub fn params(&self, s: SessionId) -> Result<Params, SessionError> {
        Ok(self.get(s)?.params)
    }

    /// Appends a session's events `from..to` to `out`, with the ids they have
    /// in this session.
    fn collect(&self, s: SessionId, from: u64, to: u64, out: &mut Vec<Event>) {
        let Some(sess) = self.sessions.get(&s) else {
            return;
        };
        let mut pos = 0u64;
        for piece in &sess.pieces {
            let n = piece.len();
            let (lo, hi) = (from.max(pos), to.min(pos + n));
            if lo < hi {
                let (owner, of) = match piece {
                    Piece::Shared { session, from, .. } => (self.sessions.get(session), *from),
                    Piece::Own { from, .. } => (Some(sess), *from),
                };
                let Some(owner) = owner else { continue };
                for i in lo..hi {
                    let mut e = (*owner.own[of + (i - pos) as usize]).clone();
                    // Ids are positions in this session's view.
                    e.event_id = i;
                    out.push(e);
                }
            }
            pos += n;
            if pos >= to {
                break;
            }
        }
    }

    /// `Read`: the session's events from `cursor` on.
    pub fn read(&self, s: SessionId, cursor: EventId) -> Result<Vec<Event>, SessionError> {
        let sess = self.live(s)?;
        if cursor > sess.len {
            return Err(SessionError::CursorPastEnd {
                session: s,
                cursor,
                len: sess.len,
            });
        }
        let mut out = Vec::with_capacity((sess.len - cursor) as usize);
        self.collect(s, cursor, sess.len, &mut out);
        Ok(out)
    }

    /// Every event of a session, purged or not (for internal folds).
    fn all_events(&self, s: SessionId) -> Vec<Event> {
        let len = self.sessions.get(&s).map_or(0, |x| x.len);
        let mut out = Vec::with_capacity(len as usize);
        self.collect(s, 0, len, &mut out);
        out
    }

    /// The last event of a session.
    pub fn last_event(&self, s: SessionId) -> Option<Event> {
        let len = self.sessions.get(&s)?.len;
        let mut out = Vec::with_capacity(1);
        self.collect(s, len.checked_sub(1)?, len, &mut out);
        out.pop()
    }

    fn event(&self, s: SessionId, ts: u64, event_id: EventId, body: Record) -> Event {
        let _ = s;
        Event {
            event_id,
            epoch: self.epoch,
            ts_unix_ms: ts,
            body,
        }
    }

    fn one_event(&self, s: SessionId, now: u64, body: Record) -> Result<Planned, SessionError> {
        let sess = self.live(s)?;
        Ok(Planned {
            record: LogRecord::Events {
                session: s,
                events: vec![self.event(s, now, sess.len, body)],
            },
        })
    }

    /// Every token on the session's input, in order.
    pub fn input(&self, s: SessionId) -> Result<Vec<Token>, SessionError> {
        let events = self.read(s, 0)?;
        Ok(events
            .iter()
            .flat_map(|e| e.body.span().iter().copied())
            .collect())
    }

    /// The session's QoS: the last `Qos` record's class and batch
    /// invariance, or class 0.
    pub fn qos(&self, s: SessionId) -> Result<(u8, bool), SessionError> {
        let events = self.read(s, 0)?;
        Ok(events
            .iter()
            .rev()
            .find_map(|e| match e.body {
                Record::Qos {
                    class,
                    batch_invariant,
                } => Some((class, batch_invariant)),
                _ => None,
            })
            .unwrap_or((0, false)))
    }

    /// `SetToolChoice`: "auto", "required", or a declared tool's name.
    pub fn plan_tool_choice(
        &self,
        s: SessionId,
        choice: String,
        now: u64,
    ) -> Result<Planned, SessionError> {
        self.live(s)?;
        if choice != "auto" {
            let names: Vec<String> = declared_tools(&self.all_events(s))
                .iter()
                .filter_map(|t| super::grammar::tool_name(t))
                .collect();
            if names.is_empty() {
                return Err(SessionError::Invalid(format!(
                    "session {s} declares no tools (AppendSystem), so no call can be forced"
                )));
            }
            if choice != "required" && !names.contains(&choice) {
                return Err(SessionError::Invalid(format!(
                    "tool choice {choice:?} is not \"auto\", \"required\" or a declared tool ({})",
                    names.join(", ")
                )));
            }
        }
        self.one_event(s, now, Record::ToolChoice { choice })
    }

    /// The tools (name, parameters schema) a generation must call one of,
    /// or None when tool calls are not forced ("auto").
    pub fn forced_tools(
        &self,
        s: SessionId,
    ) -> Result<Option<Vec<(String, serde_json::Value)>>, SessionError> {
        let events = self.read(s, 0)?;
        let choice = events.iter().rev().find_map(|e| match &e.body {
            Record::ToolChoice { choice } => Some(choice.clone()),
            _ => None,
        });
        let tools: Vec<(String, serde_json::Value)> = declared_tools(&events)
            .iter()
            .filter_map(|t| super::grammar::tool_signature(t))
            .collect();
        Ok(match choice.as_deref() {
            None | Some("auto") => None,
            Some("required") => Some(tools),
            Some(name) => Some(tools.into_iter().filter(|(n, _)| n == name).collect()),
        })
    }

    /// The session's last assistant turn: the offset on its input where the
    /// model's output in it begins (just after the header), and the header's
    /// tokens (the `GenerationPrompt` span). None before the first turn.
    pub fn last_turn_start(
        &self,
        s: SessionId,
    ) -> Result<Option<(usize, Vec<Token>)>, SessionError> {
        let mut offset = 0;
        let mut found = None;
        for e in self.read(s, 0)? {
            offset += e.body.span().len();
            if let Record::GenerationPrompt { span } = &e.body {
                found = Some((offset, span.clone()));
            }
        }
        Ok(found)
    }

    /// Where the session's last turn stands. `think_close` is the template's
    /// closing thinking marker, if it has one.
    pub fn turn_state(
        &self,
        s: SessionId,
        think_close: Option<&str>,
    ) -> Result<TurnState, SessionError> {
        let events = self.read(s, 0)?;
        for e in events.iter().rev() {
            match &e.body {
                Record::ToolUse { .. }
                | Record::ToolParseFailure { .. }
                | Record::EpochBump
                | Record::ToolChoice { .. }
                | Record::Qos { .. } => continue,
                Record::GenerationPrompt { .. } => {
                    return Ok(TurnState::Open {
                        in_reasoning: false,
                    })
                }
                Record::Generated {
                    finish,
                    channel,
                    text,
                    ..
                } => {
                    // Ended by the model or by a completed grammar: closed.
                    // Cut by max_tokens, a cancel or an error: open.
                    if *finish == crate::wire::finish::END_OF_TURN
                        || *finish == crate::wire::finish::GRAMMAR
                    {
                        return Ok(TurnState::Closed);
                    }
                    let closed = think_close.is_some_and(|m| text.trim_end().ends_with(m));
                    return Ok(TurnState::Open {
                        in_reasoning: *channel == crate::wire::channel::REASONING && !closed,
                    });
                }
                _ => return Ok(TurnState::Closed),
            }
        }
        Ok(TurnState::Closed)
    }

    /// The `GenerationPrompt` that opens an assistant turn.
    pub fn plan_generation_prompt(
        &self,
        s: SessionId,
        render: &dyn Render,
        now: u64,
    ) -> Result<Planned, SessionError> {
        self.live(s)?;
        let events = self.all_events(s);
        let span = render
            .generation_prompt_span(&turns(&events), &declared_tools(&events))
            .map_err(SessionError::Render)?;
        self.one_event(s, now, Record::GenerationPrompt { span })
    }

    /// A record the generation produced (Generated, ToolUse,
    /// ToolParseFailure, EpochBump) as the session's next event.
    pub fn plan_output(
        &self,
        s: SessionId,
        body: Record,
        now: u64,
    ) -> Result<Planned, SessionError> {
        match body {
            Record::Generated { .. }
            | Record::ToolUse { .. }
            | Record::ToolParseFailure { .. }
            | Record::EpochBump => self.one_event(s, now, body),
            other => Err(SessionError::Invalid(format!(
                "{} is not generation output",
                other.name()
            ))),
        }
    }

    // ---- plans -----------------------------------------------------------

    /// `Create`. The caller reserved `id`.
    pub fn plan_create(
        &self,
        id: SessionId,
        parent: Option<SessionId>,
        params: Params,
        now: u64,
    ) -> Result<Planned, SessionError> {
        check_params(&params)?;
        if let Some(p) = parent {
            self.live(p)?;
        }
        Ok(Planned {
            record: LogRecord::Events {
                session: id,
                events: vec![self.event(id, now, 0, Record::Created { parent, params })],
            },
        })
    }

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
        self.live(s)?;
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
        check_role(role)?;
        self.live(s)?;
        let events = self.all_events(s);
        let span = self.render_turn(&events, role, &text, render)?;
        self.one_event(s, now, Record::Message { role, text, span })
    }

    fn render_turn(
        &self,
        events: &[Event],
        role: u8,
        text: &str,
        render: &dyn Render,
    ) -> Result<Vec<Token>, SessionError> {
        let first = events.iter().all(|e| e.body.span().is_empty());
        let new = Turn {
            role,
            content: text.to_string(),
        };
        render
            .message_span(&turns(events), &declared_tools(events), &new, first)
            .map_err(SessionError::Render)
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
        self.live(s)?;
        if self.all_events(s).iter().any(|e| is_input(&e.body)) {
            return Err(SessionError::Invalid(format!(
                "AppendSystem opens a session, and session {s} already has input \
                 (templates declare tools only in the first turn)"
            )));
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
        check_role(role)?;
        self.live(s)?;
        if kind.is_empty() {
            return Err(SessionError::Invalid("AppendBlock needs a kind".into()));
        }
        let events = self.all_events(s);
        let span = self.render_turn(&events, role, &payload, render)?;
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

    /// `SetQos`.
    pub fn plan_qos(
        &self,
        s: SessionId,
        class: u8,
        batch_invariant: bool,
        now: u64,
    ) -> Result<Planned, SessionError> {
        if class > 3 {
            return Err(SessionError::Invalid(format!(
                "QoS class {class} is out of range: classes are 0 to 3"
            )));
        }
        self.one_event(
            s,
            now,
            Record::Qos {
                class,
                batch_invariant,
            },
        )
    }

    /// `Fork` (and `Trim`, which is a fork keeping the parent's params).
    pub fn plan_fork(
        &self,
        id: SessionId,
        parent: SessionId,
        at_event: EventId,
        params: Option<Params>,
        now: u64,
    ) -> Result<Planned, SessionError> {
        let p = self.live(parent)?;
        if at_event == 0 || at_event > p.len {
            return Err(SessionError::Invalid(format!(
                "at_event {at_event} is out of range: session {parent} has events 0 to {}, \
                 so a fork holds 1 to {} of them",
                p.len - 1,
                p.len
            )));
        }
        let params = params.unwrap_or(p.params);
        check_params(&params)?;
        Ok(Planned {
            record: LogRecord::Events {
                session: id,
                events: vec![self.event(
                    id,
                    now,
                    at_event,
                    Record::Forked {
                        parent,
                        fork_at: at_event,
                        params,
                    },
                )],
            },
        })
    }

    fn check_edits(&self, parent: SessionId, edits: &[Edit]) -> Result<(), SessionError> {
        let len = self.get(parent)?.len;
        if edits.is_empty() {
            return Err(SessionError::Invalid(
                "Rebase needs at least one edit".into(),
            ));
        }
        let mut prev_to = 0;
        for (i, e) in edits.iter().enumerate() {
            let (from, to) = e.range();
            if from == 0 {
                return Err(SessionError::Invalid(format!(
                    "edit {i} includes event 0, which no rebase may touch"
                )));
            }
            if from >= to {
                return Err(SessionError::Invalid(format!(
                    "edit {i}: range {from}..{to} is empty or reversed (ranges are half-open, from < to)"
                )));
            }
            if to > len {
                return Err(SessionError::Invalid(format!(
                    "edit {i}: range {from}..{to} runs past the end of session {parent} ({len} events)"
                )));
            }
            if i > 0 && from < prev_to {
                return Err(SessionError::Invalid(format!(
                    "edit {i}: range {from}..{to} overlaps or precedes the previous edit (edits must be sorted and must not overlap)"
                )));
            }
            if let Edit::Replace { role, .. } = e {
                check_role(*role)?;
            }
            prev_to = to;
        }
        Ok(())
    }

    fn rebase_pieces(edits: &[Edit], len: u64) -> Vec<RebasePiece> {
        let mut out = Vec::new();
        let mut p = edits[0].range().0;
        for e in edits {
            let (from, to) = e.range();
            if p < from {
                out.push(RebasePiece::Shared(p, from));
            }
            if let Edit::Replace { role, text, .. } = e {
                out.push(RebasePiece::Replace(*role, text.clone()));
            }
            p = to;
        }
        if p < len {
            out.push(RebasePiece::Shared(p, len));
        }
        out
    }

    /// `Rebase`: a new branch with events dropped or replaced.
    pub fn plan_rebase(
        &self,
        id: SessionId,
        parent: SessionId,
        edits: Vec<Edit>,
        params: Option<Params>,
        render: &dyn Render,
        now: u64,
    ) -> Result<Planned, SessionError> {
        let p = self.live(parent)?;
        self.check_edits(parent, &edits)?;
        let params = params.unwrap_or(p.params);
        check_params(&params)?;
        let fork_at = edits[0].range().0;
        let mut history = Vec::new();
        self.collect(parent, 0, fork_at, &mut history);
        let header = self.event(
            id,
            now,
            fork_at,
            Record::Rebased {
                parent,
                fork_at,
                params,
                edits: edits.clone(),
            },
        );
        history.push(header.clone());
        let mut events = vec![header];
        for piece in Self::rebase_pieces(&edits, p.len) {
            match piece {
                RebasePiece::Shared(a, b) => self.collect(parent, a, b, &mut history),
                RebasePiece::Replace(role, text) => {
                    let span = self.render_turn(&history, role, &text, render)?;
                    let e = self.event(
                        id,
                        now,
                        history.len() as u64,
                        Record::Message { role, text, span },
                    );
                    history.push(e.clone());
                    events.push(e);
                }
            }
        }
        Ok(Planned {
            record: LogRecord::Events {
                session: id,
                events,
            },
        })
    }

    /// `SetMeta`.
    pub fn plan_meta(
        &self,
        s: SessionId,
        expected_version: u64,
        title: Option<String>,
        archived: Option<bool>,
        now: u64,
    ) -> Result<Planned, SessionError> {
        let sess = self.live(s)?;
        if sess.version != expected_version {
            return Err(SessionError::Version {
                session: s,
                expected: expected_version,
                actual: sess.version,
            });
        }
        Ok(Planned {
            record: LogRecord::Meta {
                session: s,
                version: sess.version + 1,
                title: title.or_else(|| sess.title.clone()),
                archived: archived.unwrap_or(sess.archived),
                ts_unix_ms: now,
            },
        })
    }

    /// The live descendants of `s`, depth first, without recursion (a chain
    /// of forks may be very deep).
    fn descendants(&self, s: SessionId, out: &mut Vec<SessionId>) {
        let mut stack = vec![s];
        while let Some(id) = stack.pop() {
            if let Some(sess) = self.sessions.get(&id) {
                for &c in sess.children.iter().rev() {
                    if self.sessions.get(&c).is_some_and(|x| !x.purged) {
                        out.push(c);
                        stack.push(c);
                    }
                }
            }
        }
    }

    /// `Purge`.
    pub fn plan_purge(
        &self,
        s: SessionId,
        expected_generation: u64,
        mode: PurgeMode,
        now: u64,
    ) -> Result<Planned, SessionError> {
        let sess = self.live(s)?;
        if sess.generation != expected_generation {
            return Err(SessionError::Generation {
                session: s,
                expected: expected_generation,
                actual: sess.generation,
            });
        }
        let mut sessions = vec![s];
        if mode == PurgeMode::Cascade {
            self.descendants(s, &mut sessions);
        }
        Ok(Planned {
            record: LogRecord::Purge {
                session: s,
                mode,
                sessions,
                ts_unix_ms: now,
            },
        })
    }

    // ---- tool calls ------------------------------------------------------

    /// Every ToolUse of a session with how it stands.
    pub fn ledger(&self, s: SessionId) -> Result<Vec<LedgerEntry>, SessionError> {
        self.live(s)?;
        let events = self.all_events(s);
        let mut entries: Vec<LedgerEntry> = Vec::new();
        for e in &events {
            match &e.body {
                Record::ToolUse { name, arguments } => entries.push(LedgerEntry {
                    call_id: e.event_id,
                    name: name.clone(),
                    arguments: arguments.clone(),
                    status: "open".into(),
                    closed_by: None,
                    permission: None,
                }),
                Record::ToolResult { call_id, .. } => {
                    if let Some(x) = entries.iter_mut().find(|x| x.call_id == *call_id) {
                        x.status = "answered".into();
                        x.closed_by = Some(e.event_id);
                    }
                }
                Record::ToolOutcome {
                    call_id, outcome, ..
                } => {
                    if let Some(x) = entries.iter_mut().find(|x| x.call_id == *call_id) {
                        x.status = if *outcome == 1 { "failed" } else { "cancelled" }.into();
                        x.closed_by = Some(e.event_id);
                    }
                }
                Record::ToolCancelRequested { call_id } => {
                    if let Some(x) = entries
                        .iter_mut()
                        .find(|x| x.call_id == *call_id && x.closed_by.is_none())
                    {
                        x.status = "cancel requested".into();
                    }
                }
                Record::PermissionResponded {
                    request_id,
                    granted,
                } => {
                    let call = events.iter().find_map(|r| match &r.body {
                        Record::PermissionRequested { call_id, .. }
                            if r.event_id == *request_id =>
                        {
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
        Ok(entries)
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

    fn open_call(&self, s: SessionId, call_id: EventId) -> Result<LedgerEntry, SessionError> {
        let entry = self
            .ledger(s)?
            .into_iter()
            .find(|x| x.call_id == call_id)
            .ok_or_else(|| {
                SessionError::Invalid(format!("session {s} has no tool call {call_id}"))
            })?;
        if entry.closed_by.is_some() {
            return Err(SessionError::Invalid(format!(
                "tool call {call_id} was already answered ({})",
                entry.status
            )));
        }
        Ok(entry)
    }

    /// `AppendToolResult`.
    pub fn plan_tool_result(
        &self,
        s: SessionId,
        call_id: EventId,
        content: String,
        render: &dyn Render,
        now: u64,
    ) -> Result<Planned, SessionError> {
        self.open_call(s, call_id)?;
        let events = self.all_events(s);
        let span = self.render_turn(&events, role::TOOL, &content, render)?;
        self.one_event(
            s,
            now,
            Record::ToolResult {
                call_id,
                content,
                span,
            },
        )
    }

    /// `AppendToolOutcome`.
    pub fn plan_tool_outcome(
        &self,
        s: SessionId,
        call_id: EventId,
        outcome: u8,
        note: String,
        now: u64,
    ) -> Result<Planned, SessionError> {
        if !(1..=2).contains(&outcome) {
            return Err(SessionError::Invalid(format!(
                "outcome {outcome} is not 1 (failed) or 2 (cancelled)"
            )));
        }
        self.open_call(s, call_id)?;
        self.one_event(
            s,
            now,
            Record::ToolOutcome {
                call_id,
                outcome,
                note,
            },
        )
    }

    /// `RequestToolCancel`.
    pub fn plan_tool_cancel(
        &self,
        s: SessionId,
        call_id: EventId,
        now: u64,
    ) -> Result<Planned, SessionError> {
        self.open_call(s, call_id)?;
        self.one_event(s, now, Record::ToolCancelRequested { call_id })
    }

    /// `RequestPermission`: asks the user whether a tool call may run; the
    /// request's event id is what `RespondPermission` answers.
    pub fn plan_permission_request(
        &self,
        s: SessionId,
        call_id: EventId,
        text: String,
        now: u64,
    ) -> Result<Planned, SessionError> {
        self.open_call(s, call_id)?;
        self.one_event(s, now, Record::PermissionRequested { call_id, text })
    }

    /// `RespondPermission`.
    pub fn plan_permission_response(
        &self,
        s: SessionId,
        request_id: EventId,
        granted: bool,
        now: u64,
    ) -> Result<Planned, SessionError> {
        self.live(s)?;
        let events = self.all_events(s);
        let asked = events.iter().any(|e| {
            e.event_id == request_id && matches!(e.body, Record::PermissionRequested { .. })
        });
        if !asked {
            return Err(SessionError::Invalid(format!(
                "session {s} has no permission request {request_id}"
            )));
        }
        let answered = events.iter().any(|e| {
            matches!(e.body, Record::PermissionResponded { request_id: r, .. } if r == request_id)
        });
        if answered {
            return Err(SessionError::Invalid(format!(
                "permission request {request_id} was already answered"
            )));
        }
        self.one_event(
            s,
            now,
            Record::PermissionResponded {
                request_id,
                granted,
            },
        )
    }

    // ---- queries ---------------------------------------------------------

    /// `List`: the ids of every session not purged.
    pub fn list(&self) -> Vec<SessionId> {
        self.sessions
            .iter()
            .filter(|(_, s)| !s.purged)
            .map(|(id, _)| *id)
            .collect()
    }

    /// `Sessions`.
    pub fn summaries(&self, include_archived: bool) -> Vec<SessionSummary> {
        self.sessions
            .iter()
            .filter(|(_, s)| !s.purged && (include_archived || !s.archived))
            .map(|(id, s)| SessionSummary {
                session: *id,
                parent: self.shown_parent(s),
                title: s.title.clone(),
                archived: s.archived,
                events: s.len,
                updated_unix_ms: s.updated_unix_ms,
            })
            .collect()
    }

    fn shown_parent(&self, s: &Session) -> Option<SessionId> {
        if s.rerooted {
            None
        } else {
            s.tree_parent
        }
    }

    /// `Tree`: `[id, parent, fork_at]` for every session not purged.
    pub fn tree(&self) -> Vec<(SessionId, Option<SessionId>, Option<EventId>)> {
        self.sessions
            .iter()
            .filter(|(_, s)| !s.purged)
            .map(|(id, s)| {
                let parent = self.shown_parent(s);
                (*id, parent, parent.and(s.fork_at))
            })
            .collect()
    }

    /// `Inspect` (`generating` is the actor's to fill in).
    pub fn inspect(&self, s: SessionId) -> Result<Inspection, SessionError> {
        let sess = self.live(s)?;
        // The same judgement Generate makes: it would continue this turn.
        let open_turn = matches!(self.turn_state(s, None)?, TurnState::Open { .. });
        Ok(Inspection {
            session: s,
            parent: self.shown_parent(sess),
            fork_at: self.shown_parent(sess).and(sess.fork_at),
            params: sess.params,
            events: sess.len,
            tokens: sess.tokens,
            generation: sess.generation,
            version: sess.version,
            title: sess.title.clone(),
            archived: sess.archived,
            purged: sess.purged,
            children: sess
                .children
                .iter()
                .copied()
                .filter(|c| self.is_live(*c))
                .collect(),
            created_unix_ms: sess.created_unix_ms,
            updated_unix_ms: sess.updated_unix_ms,
            open_turn,
            generating: false,
        })
    }

    // ---- apply -----------------------------------------------------------

    /// Applies a committed record. An Err means the log contradicts itself
    /// (replay refuses to start on it); a live plan never produces one.
    pub fn apply(&mut self, record: &LogRecord) -> Result<(), String> {
        match record {
            LogRecord::Boot { epoch, .. } => {
                self.epoch = self.epoch.max(*epoch);
                Ok(())
            }
            LogRecord::Meta {
                session,
                version,
                title,
                archived,
                ts_unix_ms,
            } => {
                let s = self
                    .sessions
                    .get_mut(session)
                    .ok_or_else(|| format!("Meta for unknown session {session}"))?;
                s.version = *version;
                s.title = title.clone();
                s.archived = *archived;
                s.generation += 1;
                s.updated_unix_ms = *ts_unix_ms;
                Ok(())
            }
            LogRecord::Purge {
                session,
                mode,
                sessions,
                ..
            } => {
                for id in sessions {
                    if let Some(s) = self.sessions.get_mut(id) {
                        s.purged = true;
                    }
                }
                if *mode == PurgeMode::Reroot {
                    let children = self
                        .sessions
                        .get(session)
                        .map(|s| s.children.clone())
                        .unwrap_or_default();
                    for c in children {
                        if let Some(s) = self.sessions.get_mut(&c) {
                            s.rerooted = true;
                        }
                    }
                }
                Ok(())
            }
            LogRecord::Events { session, events } => self.apply_events(*session, events),
        }
    }

    fn apply_events(&mut self, id: SessionId, events: &[Event]) -> Result<(), String> {
        let first = events.first().ok_or("an Events record without events")?;
        match &first.body {
            Record::Created { parent, params } => {
                self.new_session(id, *parent, None, *params, vec![], first)?;
                self.push_own(id, &events[1..])
            }
            Record::Forked {
                parent,
                fork_at,
                params,
            } => {
                let plen = self
                    .sessions
                    .get(parent)
                    .ok_or_else(|| format!("fork of unknown session {parent}"))?
                    .len;
                if *fork_at > plen || first.event_id != *fork_at {
                    return Err(format!(
                        "fork of session {parent} at {fork_at} is out of range"
                    ));
                }
                let pieces = self.slice(*parent, 0, *fork_at);
                self.new_session(id, Some(*parent), Some(*fork_at), *params, pieces, first)?;
                self.push_own(id, &events[1..])
            }
            Record::Rebased {
                parent,
                fork_at,
                params,
                edits,
            } => {
                let plen = self
                    .sessions
                    .get(parent)
                    .ok_or_else(|| format!("rebase of unknown session {parent}"))?
                    .len;
                if edits.is_empty() || edits[0].range().0 != *fork_at || first.event_id != *fork_at
                {
                    return Err(format!("malformed rebase of session {parent}"));
                }
                let pieces = self.slice(*parent, 0, *fork_at);
                self.new_session(id, Some(*parent), Some(*fork_at), *params, pieces, first)?;
                let mut own = events[1..].iter();
                for piece in Self::rebase_pieces(edits, plen) {
                    match piece {
                        RebasePiece::Shared(a, b) => {
                            let tokens = self.span_tokens(*parent, a, b);
                            let shared = self.slice(*parent, a, b);
                            let s = self.sessions.get_mut(&id).expect("just created");
                            s.pieces.extend(shared);
                            s.len += b - a;
                            s.tokens += tokens;
                        }
                        RebasePiece::Replace(..) => {
                            let e = own.next().ok_or("rebase record misses a message")?;
                            self.push_own(id, std::slice::from_ref(e))?;
                        }
                    }
                }
                let rest: Vec<Event> = own.cloned().collect();
                self.push_own(id, &rest)
            }
            _ => self.push_own(id, events),
        }
    }

    /// The pieces of view range `from..to` of session `s`, pointing at the
    /// sessions that own those events.
    fn slice(&self, s: SessionId, from: u64, to: u64) -> Vec<Piece> {
        let Some(sess) = self.sessions.get(&s) else {
            return vec![];
        };
        let mut out = Vec::new();
        let mut pos = 0u64;
        for piece in &sess.pieces {
            let n = piece.len();
            let (lo, hi) = (from.max(pos), to.min(pos + n));
            if lo < hi {
                let (a, b) = ((lo - pos) as usize, (hi - pos) as usize);
                out.push(match piece {
                    Piece::Shared { session, from, .. } => Piece::Shared {
                        session: *session,
                        from: from + a,
                        to: from + b,
                    },
                    Piece::Own { from, .. } => Piece::Shared {
                        session: s,
                        from: from + a,
                        to: from + b,
                    },
                });
            }
            pos += n;
            if pos >= to {
                break;
            }
        }
        out
    }

    fn span_tokens(&self, s: SessionId, from: u64, to: u64) -> u64 {
        let mut out = Vec::new();
        self.collect(s, from, to, &mut out);
        out.iter().map(|e| e.body.span().len() as u64).sum()
    }

    fn new_session(
        &mut self,
        id: SessionId,
        tree_parent: Option<SessionId>,
        fork_at: Option<EventId>,
        params: Params,
        pieces: Vec<Piece>,
        header: &Event,
    ) -> Result<(), String> {
        if self.sessions.contains_key(&id) {
            return Err(format!("session {id} is created twice"));
        }
        let (len, tokens) = match (tree_parent, fork_at) {
            (Some(p), Some(at)) => (at, self.span_tokens(p, 0, at)),
            _ => (0, 0),
        };
        if let Some(p) = tree_parent {
            if let Some(ps) = self.sessions.get_mut(&p) {
                ps.children.push(id);
            }
        }
        self.sessions.insert(
            id,
            Session {
                tree_parent,
                fork_at,
                params,
                pieces,
                own: Vec::new(),
                len,
                tokens,
                generation: 0,
                version: 0,
                title: None,
                archived: false,
                purged: false,
                rerooted: false,
                children: Vec::new(),
                created_unix_ms: header.ts_unix_ms,
                updated_unix_ms: header.ts_unix_ms,
            },
        );
        self.next_session = self.next_session.max(id + 1);
        self.push_own(id, std::slice::from_ref(header))
    }

    fn push_own(&mut self, id: SessionId, events: &[Event]) -> Result<(), String> {
        if events.is_empty() {
            return Ok(());
        }
        let s = self
            .sessions
            .get_mut(&id)
            .ok_or_else(|| format!("events for unknown session {id}"))?;
        for e in events {
            if e.event_id != s.len {
                return Err(format!(
                    "session {id}: event id {} where {} was next",
                    e.event_id, s.len
                ));
            }
            let idx = s.own.len();
            s.own.push(Arc::new(e.clone()));
            match s.pieces.last_mut() {
                Some(Piece::Own { to, .. }) if *to == idx => *to = idx + 1,
                _ => s.pieces.push(Piece::Own {
                    from: idx,
                    to: idx + 1,
                }),
            }
            s.len += 1;
            s.tokens += e.body.span().len() as u64;
            s.updated_unix_ms = s.updated_unix_ms.max(e.ts_unix_ms);
        }
        s.generation += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
