//! `SessionBook`: every session's view of the log, and the rules that turn a
//! request into the log record that would carry it out. No I/O.
//!
//! Requests are handled in two steps. `plan_*` checks a request against the
//! book and returns the [`Planned`] record to commit, changing nothing. Once
//! the record is durable, `apply` changes the book. Replay on start calls the
//! same `apply`, so a session reads back identically after a restart.
//!
//! Requests of one session are planned one at a time by its actor, but those
//! of different sessions are not, and a plan is applied only after the log's
//! fsync. A Purge and a new session under a session it takes (a Create with
//! it as parent, a Fork, Trim or Rebase of it, planned on another session's
//! actor or the registry) would each be planned against a book without the
//! other: the purge would miss the new session. So the actors register those
//! two kinds of plans with [`SessionBook::begin`] under the same write lock
//! as the plan, and `apply` (or [`SessionBook::settle`] when the commit
//! fails) ends them. While a Purge is in flight its sessions refuse every
//! write as purged; while a new session is in flight under a session, a
//! Purge that would take that session is refused (`Branching`). Two such
//! plans are therefore never in flight together, and the log holds them in
//! the order they were applied: replay rebuilds the same book.
//!
//! - `view`: a session's view as ranges of events, shared with its parents
//!   by reference, and reading it.
//! - `apply`: a committed record changes the book.
//! - `folds`: what a session's events add up to (chat messages, tools, QoS,
//!   the last turn's state, the input, the tool-call ledger).
//! - `plan_messages`, `plan_tools`, `plan_branches`, `plan_meta`,
//!   `plan_generation`: the plans, one request family a file.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{ChatMessage, Render, SessionError};
use crate::wire::{
    Event, EventId, Inspection, LogRecord, Params, PurgeMode, Record, SessionId, SessionSummary,
};

mod apply;
mod folds;
mod plan_branches;
mod plan_generation;
mod plan_messages;
mod plan_meta;
mod plan_tools;
mod view;

pub use apply::ApplyError;
pub use folds::{input_after, ledger_of, output_schema_of, tool_choice_of, TurnState};
pub use plan_generation::GenerationPlan;
pub use plan_tools::{check_tool_choice, ChoiceRefusal};
pub use view::Owned;
use view::ViewRange;

#[derive(Debug)]
struct Session {
    tree_parent: Option<SessionId>,
    fork_at: Option<EventId>,
    params: Params,
    view: Vec<ViewRange>,
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
    /// A rebase, or a fork below one: events it borrows may sit at other
    /// ids than in the session that made them (`collect` translates the
    /// ids they refer to).
    renumbered: bool,
    children: Vec<SessionId>,
    created_unix_ms: u64,
    updated_unix_ms: u64,
}

impl Session {
    /// In `List` and `Tree`: neither purged nor archived.
    fn shown(&self) -> bool {
        !self.purged && !self.archived
    }
}

/// What a plan commits; the actor replies from it once it is applied.
#[derive(Debug, Clone, PartialEq)]
pub enum Planned {
    /// One event appended to an existing session.
    Event(PlannedEvent),
    /// A new session (Create, Fork, Trim, Rebase) and its first events.
    Branch {
        session: SessionId,
        events: Vec<Event>,
    },
    /// A session's new title and archived flag, at `version`.
    Meta {
        session: SessionId,
        version: u64,
        title: Option<String>,
        archived: bool,
        ts_unix_ms: u64,
    },
    /// `sessions` (the purged one, and its descendants in Cascade mode)
    /// become purged.
    Purge {
        session: SessionId,
        mode: PurgeMode,
        sessions: Vec<SessionId>,
        ts_unix_ms: u64,
    },
}

/// One event appended to an existing session.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedEvent {
    pub session: SessionId,
    pub event: Event,
}

impl PlannedEvent {
    /// The log record that carries it.
    pub fn into_record(self) -> LogRecord {
        LogRecord::Events {
            session: self.session,
            events: vec![self.event],
        }
    }
}

impl Planned {
    /// The log record that carries the plan out.
    pub fn into_record(self) -> LogRecord {
        match self {
            Planned::Event(e) => e.into_record(),
            Planned::Branch { session, events } => LogRecord::Events { session, events },
            Planned::Meta {
                session,
                version,
                title,
                archived,
                ts_unix_ms,
            } => LogRecord::Meta {
                session,
                version,
                title,
                archived,
                ts_unix_ms,
            },
            Planned::Purge {
                session,
                mode,
                sessions,
                ts_unix_ms,
            } => LogRecord::Purge {
                session,
                mode,
                sessions,
                ts_unix_ms,
            },
        }
    }
}

/// Plans begun ([`SessionBook::begin`]) and not yet applied or settled,
/// which later plans must not contradict. Counts, as two plans may mark the
/// same session (two overlapping purges, two children of one parent).
#[derive(Debug, Default)]
struct InFlight {
    /// Sessions a Purge in flight takes.
    purging: BTreeMap<SessionId, u32>,
    /// Parents of new sessions in flight (Create with a parent, Fork, Trim,
    /// Rebase).
    branching: BTreeMap<SessionId, u32>,
}

impl InFlight {
    fn add(map: &mut BTreeMap<SessionId, u32>, s: SessionId) {
        *map.entry(s).or_insert(0) += 1;
    }

    /// Removes one mark of `s`, if it has one (replay applies records that
    /// were never begun).
    fn remove(map: &mut BTreeMap<SessionId, u32>, s: SessionId) {
        if let Some(n) = map.get_mut(&s) {
            *n -= 1;
            if *n == 0 {
                map.remove(&s);
            }
        }
    }
}

/// The parent a branch record's header files the new session under: a
/// Create with a parent, a Fork (or Trim), a Rebase.
fn branch_parent(events: &[Event]) -> Option<SessionId> {
    match &events.first()?.body {
        Record::Created { parent, .. } => *parent,
        Record::Forked { parent, .. } | Record::Rebased { parent, .. } => Some(*parent),
        _ => None,
    }
}

/// Every session, as the log says.
#[derive(Debug, Default)]
pub struct SessionBook {
    sessions: BTreeMap<SessionId, Session>,
    next_session: SessionId,
    epoch: u64,
    in_flight: InFlight,
}

impl SessionBook {
    pub fn new() -> SessionBook {
        SessionBook {
            sessions: BTreeMap::new(),
            next_session: 1,
            epoch: 0,
            in_flight: InFlight::default(),
        }
    }

    /// Registers a Purge or a new session under a parent as in flight, from
    /// its plan until `apply` (or `settle`, should its commit fail). Call it
    /// under the same write lock as the plan, or it checks against a book
    /// that may have moved: a new session whose parent is purged or being
    /// purged is refused (`Purged`), and so is a Purge that would take a
    /// session another new session is being filed under (`Branching`), as
    /// it would miss that session. Other plans need no registering.
    pub fn begin(&mut self, planned: &Planned) -> Result<(), SessionError> {
        match planned {
            Planned::Purge {
                session, sessions, ..
            } => {
                self.writable(*session)?;
                if let Some(s) = sessions
                    .iter()
                    .find(|s| self.in_flight.branching.contains_key(s))
                {
                    return Err(SessionError::Branching(*s));
                }
                for s in sessions {
                    InFlight::add(&mut self.in_flight.purging, *s);
                }
            }
            Planned::Branch { events, .. } => {
                if let Some(p) = branch_parent(events) {
                    self.writable(p)?;
                    InFlight::add(&mut self.in_flight.branching, p);
                }
            }
            Planned::Event(_) | Planned::Meta { .. } => {}
        }
        Ok(())
    }

    /// Holds `sessions` for a Purge that waits for new sessions being filed
    /// under them (`Branching`): until [`release`](Self::release), writes
    /// to them and new sessions under them are refused as for a purge in
    /// flight, so the ones in flight drain and no more start (a busy tree
    /// cannot keep the purge waiting forever).
    pub fn hold(&mut self, sessions: &[SessionId]) {
        for s in sessions {
            InFlight::add(&mut self.in_flight.purging, *s);
        }
    }

    /// Ends a [`hold`](Self::hold).
    pub fn release(&mut self, sessions: &[SessionId]) {
        for s in sessions {
            InFlight::remove(&mut self.in_flight.purging, *s);
        }
    }

    /// Ends what `begin` registered for `record`: `apply` calls it, and the
    /// committer when the commit failed. A record never begun (replay)
    /// changes nothing.
    pub fn settle(&mut self, record: &LogRecord) {
        match record {
            LogRecord::Purge { sessions, .. } => {
                for s in sessions {
                    InFlight::remove(&mut self.in_flight.purging, *s);
                }
            }
            LogRecord::Events { events, .. } => {
                if let Some(p) = branch_parent(events) {
                    InFlight::remove(&mut self.in_flight.branching, p);
                }
            }
            LogRecord::Boot { .. } | LogRecord::Meta { .. } => {}
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

    /// Gives back `id`, reserved for a plan that was refused (nothing was
    /// written under it), when no id was reserved after it: a refused
    /// Create, Fork, Trim or Rebase does not use up a session id. An id a
    /// commit was attempted for is never given back.
    pub fn release_id(&mut self, id: SessionId) {
        if self.next_session == id + 1 {
            self.next_session = id;
        }
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

    /// `live`, and not being purged: a Purge in flight takes it, and writes
    /// planned now would be committed after the purge (refused as purged).
    fn writable(&self, s: SessionId) -> Result<&Session, SessionError> {
        let sess = self.live(s)?;
        if self.in_flight.purging.contains_key(&s) {
            return Err(SessionError::Purged(s));
        }
        Ok(sess)
    }

    /// Err unless the session exists and is not purged (a check before
    /// work done outside the book).
    pub fn plan_check_live(&self, s: SessionId) -> Result<(), SessionError> {
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

    /// [`len`](Self::len) of a session that is not purged (what `Read`
    /// refuses, `Subscribe` refuses).
    pub fn live_len(&self, s: SessionId) -> Result<u64, SessionError> {
        Ok(self.live(s)?.len)
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

    /// `body` as event `event_id` of session `s`.
    fn planned_event(
        &self,
        s: SessionId,
        event_id: EventId,
        now: u64,
        body: Record,
    ) -> PlannedEvent {
        PlannedEvent {
            session: s,
            event: self.event(s, now, event_id, body),
        }
    }

    /// `body` as the next event of live session `s`.
    fn next_event(
        &self,
        s: SessionId,
        now: u64,
        body: Record,
    ) -> Result<PlannedEvent, SessionError> {
        let sess = self.writable(s)?;
        Ok(self.planned_event(s, sess.len, now, body))
    }

    fn one_event(&self, s: SessionId, now: u64, body: Record) -> Result<Planned, SessionError> {
        self.next_event(s, now, body).map(Planned::Event)
    }

    /// The ids of every session not purged, archived ones included (the
    /// sessions gauge, the replay's count).
    pub fn list(&self) -> Vec<SessionId> {
        self.sessions
            .iter()
            .filter(|(_, s)| !s.purged)
            .map(|(id, _)| *id)
            .collect()
    }

    /// Sessions not purged, and their events and input tokens summed (each
    /// session's stored counts: nothing is read or copied).
    pub fn totals(&self) -> (u64, u64, u64) {
        self.sessions
            .values()
            .filter(|s| !s.purged)
            .fold((0, 0, 0), |(n, e, t), s| (n + 1, e + s.len, t + s.tokens))
    }

    /// `List`: the ids of every session shown, neither purged nor archived.
    pub fn list_shown(&self) -> Vec<SessionId> {
        self.sessions
            .iter()
            .filter(|(_, s)| s.shown())
            .map(|(id, _)| *id)
            .collect()
    }

    /// The media blobs that live (not purged) sessions reference, which
    /// `GcMedia` keeps: every `Image` event a live session reads, its
    /// inherited history included (a purged parent's images stay while a
    /// live fork reads them).
    pub fn media_refs(&self) -> std::collections::HashSet<String> {
        let mut out = std::collections::HashSet::new();
        for (id, s) in &self.sessions {
            if s.purged {
                continue;
            }
            for e in self.all_events(*id) {
                if let Record::Image { blob, .. } = &e.body {
                    out.insert(blob.clone());
                }
            }
        }
        out
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

    /// `Tree`: `[id, parent, fork_at]` for every session shown, neither
    /// purged nor archived. Archiving hides only the session itself: its
    /// children stay, and name it as their parent (as `Sessions` does), so
    /// a node's parent may be missing from the nodes.
    pub fn tree(&self) -> Vec<(SessionId, Option<SessionId>, Option<EventId>)> {
        self.sessions
            .iter()
            .filter(|(_, s)| s.shown())
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
}

#[cfg(test)]
mod tests;
