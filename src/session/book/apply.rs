//! `apply`: a committed record changes the book. Replay on start calls the
//! same `apply`, so a session reads back identically after a restart.

use std::sync::Arc;

use super::plan_branches::RebaseRange;
use super::view::ViewRange;
use super::{Session, SessionBook};
use crate::wire::{Event, EventId, LogRecord, Params, PurgeMode, Record, SessionId};

/// Why a record cannot be applied: the log contradicts itself.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApplyError {
    /// `what` names the record: "Meta for", "fork of", "rebase of", "events for".
    #[error("{what} unknown session {session}")]
    Unknown {
        what: &'static str,
        session: SessionId,
    },
    #[error("an Events record without events")]
    NoEvents,
    #[error("fork of session {parent} at {fork_at} is out of range")]
    ForkOutOfRange { parent: SessionId, fork_at: EventId },
    #[error("malformed rebase of session {0}")]
    MalformedRebase(SessionId),
    #[error("rebase record misses a message")]
    RebaseMissesMessage,
    #[error("session {0} is created twice")]
    CreatedTwice(SessionId),
    #[error("session {session}: event id {got} where {next} was next")]
    EventIdGap {
        session: SessionId,
        got: EventId,
        next: EventId,
    },
}

impl SessionBook {
    /// Applies a committed record. An Err means the log contradicts itself
    /// (replay refuses to start on it); a live plan never produces one.
    /// It also ends what `begin` registered for the record.
    pub fn apply(&mut self, record: &LogRecord) -> Result<(), ApplyError> {
        self.settle(record);
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
                let s = self.sessions.get_mut(session).ok_or(ApplyError::Unknown {
                    what: "Meta for",
                    session: *session,
                })?;
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

    pub(super) fn apply_events(
        &mut self,
        id: SessionId,
        events: &[Event],
    ) -> Result<(), ApplyError> {
        let first = events.first().ok_or(ApplyError::NoEvents)?;
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
                    .ok_or(ApplyError::Unknown {
                        what: "fork of",
                        session: *parent,
                    })?
                    .len;
                if *fork_at > plen || first.event_id != *fork_at {
                    return Err(ApplyError::ForkOutOfRange {
                        parent: *parent,
                        fork_at: *fork_at,
                    });
                }
                let view = self.slice(*parent, 0, *fork_at);
                let renumbered = self.sessions.get(parent).is_some_and(|p| p.renumbered);
                self.new_session(id, Some(*parent), Some(*fork_at), *params, view, first)?;
                if let Some(s) = self.sessions.get_mut(&id) {
                    s.renumbered = renumbered;
                }
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
                    .ok_or(ApplyError::Unknown {
                        what: "rebase of",
                        session: *parent,
                    })?
                    .len;
                if edits.is_empty() || edits[0].range().0 != *fork_at || first.event_id != *fork_at
                {
                    return Err(ApplyError::MalformedRebase(*parent));
                }
                let view = self.slice(*parent, 0, *fork_at);
                self.new_session(id, Some(*parent), Some(*fork_at), *params, view, first)?;
                if let Some(s) = self.sessions.get_mut(&id) {
                    s.renumbered = true;
                }
                let mut own = events[1..].iter();
                for range in Self::rebase_ranges(edits, plen) {
                    match range {
                        RebaseRange::Keep(a, b) => {
                            let tokens = self.span_tokens(*parent, a, b);
                            let shared = self.slice(*parent, a, b);
                            let s = self.sessions.get_mut(&id).expect("just created");
                            s.view.extend(shared);
                            s.len += b - a;
                            s.tokens += tokens;
                        }
                        RebaseRange::Replace(..) => {
                            let e = own.next().ok_or(ApplyError::RebaseMissesMessage)?;
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

    pub(super) fn new_session(
        &mut self,
        id: SessionId,
        tree_parent: Option<SessionId>,
        fork_at: Option<EventId>,
        params: Params,
        view: Vec<ViewRange>,
        header: &Event,
    ) -> Result<(), ApplyError> {
        if self.sessions.contains_key(&id) {
            return Err(ApplyError::CreatedTwice(id));
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
                view,
                own: Vec::new(),
                len,
                tokens,
                generation: 0,
                version: 0,
                title: None,
                archived: false,
                purged: false,
                rerooted: false,
                renumbered: false,
                children: Vec::new(),
                created_unix_ms: header.ts_unix_ms,
                updated_unix_ms: header.ts_unix_ms,
            },
        );
        self.next_session = self.next_session.max(id + 1);
        self.push_own(id, std::slice::from_ref(header))
    }

    pub(super) fn push_own(&mut self, id: SessionId, events: &[Event]) -> Result<(), ApplyError> {
        if events.is_empty() {
            return Ok(());
        }
        let s = self.sessions.get_mut(&id).ok_or(ApplyError::Unknown {
            what: "events for",
            session: id,
        })?;
        for e in events {
            if e.event_id != s.len {
                return Err(ApplyError::EventIdGap {
                    session: id,
                    got: e.event_id,
                    next: s.len,
                });
            }
            let idx = s.own.len();
            s.own.push(Arc::new(e.clone()));
            match s.view.last_mut() {
                Some(ViewRange::Own { to, .. }) if *to == idx => *to = idx + 1,
                _ => s.view.push(ViewRange::Own {
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
