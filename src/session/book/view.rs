//! A session's view: the ranges of events it is made of, and reading them.
//!
//! A fork, rebase or trim never copies its parent's events: its view is a
//! list of ranges, each either a range of another session's own events
//! (shared by reference) or a range of its own events. The parent is never
//! rewritten, and since a session's log only grows, a shared range never
//! changes.

use super::{SessionBook, SessionError};
use crate::wire::{Event, EventId, Record, SessionId};

/// A range of a session's view. A fork's ranges point straight at the
/// sessions that own the events (never at another view), so reading any
/// session is one level deep however long its chain of forks.
#[derive(Debug, Clone)]
pub(super) enum ViewRange {
    /// Entries `from..to` of another session's own events, shared by
    /// reference.
    Borrowed {
        session: SessionId,
        from: usize,
        to: usize,
    },
    /// Entries `from..to` of this session's own events.
    Own { from: usize, to: usize },
}

impl ViewRange {
    pub(super) fn len(&self) -> u64 {
        match self {
            ViewRange::Borrowed { from, to, .. } | ViewRange::Own { from, to } => {
                (to - from) as u64
            }
        }
    }
}

/// A run of a session's view and the session that made its events: the
/// view's ids `at..at + len` are the owner's own ids `owner_at..`. A fork
/// keeps its parent's ids for what it shares; a rebase may move them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owned {
    pub at: EventId,
    pub len: u64,
    pub owner: SessionId,
    pub owner_at: EventId,
}

impl SessionBook {
    /// Appends a session's events `from..to` to `out`, with the ids they have
    /// in this session.
    pub(super) fn collect(&self, s: SessionId, from: u64, to: u64, out: &mut Vec<Event>) {
        self.collect_with(s, from, to, out, true);
    }

    /// [`collect`](Self::collect); with `refs` false, the ids events refer
    /// to are left in their maker's numbering (for what reads only spans).
    fn collect_with(&self, s: SessionId, from: u64, to: u64, out: &mut Vec<Event>, refs: bool) {
        let Some(sess) = self.sessions.get(&s) else {
            return;
        };
        // Only below a rebase do a maker's ids differ from this session's.
        let refs = refs && sess.renumbered;
        let mut pos = 0u64;
        for range in &sess.view {
            let n = range.len();
            let (lo, hi) = (from.max(pos), to.min(pos + n));
            if lo < hi {
                let (owner, of) = match range {
                    ViewRange::Borrowed { session, from, .. } => {
                        (self.sessions.get(session), *from)
                    }
                    ViewRange::Own { from, .. } => (Some(sess), *from),
                };
                let Some(owner) = owner else { continue };
                let maker = match range {
                    ViewRange::Borrowed { session, .. } if refs => Some(*session),
                    _ => None,
                };
                for i in lo..hi {
                    let mut e = (*owner.own[of + (i - pos) as usize]).clone();
                    // Ids are positions in this session's view, the ids an
                    // event refers to included.
                    e.event_id = i;
                    if let Some(m) = maker {
                        self.translate_refs(m, s, i, &mut e.body);
                    }
                    out.push(e);
                }
            }
            pos += n;
            if pos >= to {
                break;
            }
        }
    }

    /// Rewrites the event ids a record made in session `m` refers to (a
    /// call, a permission request: ids in `m`'s view) into their ids in
    /// session `s`'s view, where the record is event `at`. A fork keeps the
    /// ids it shares, but a rebase that drops or replaces events moves the
    /// ones after them. A reference to an event `s` does not hold (its call
    /// dropped) becomes `at` itself: it names no call.
    fn translate_refs(&self, m: SessionId, s: SessionId, at: EventId, body: &mut Record) {
        let id = match body {
            Record::ToolResult { call_id, .. }
            | Record::ToolOutcome { call_id, .. }
            | Record::ToolCancelRequested { call_id }
            | Record::PermissionRequested { call_id, .. } => call_id,
            Record::PermissionResponded { request_id, .. } => request_id,
            _ => return,
        };
        *id = self
            .own_index(m, *id)
            .and_then(|(maker, j)| self.position_of(s, maker, j))
            .unwrap_or(at);
    }

    /// The session that made event `id` of session `s`'s view, and the
    /// event's index among that session's own events.
    fn own_index(&self, s: SessionId, id: EventId) -> Option<(SessionId, usize)> {
        let mut pos = 0u64;
        for range in &self.sessions.get(&s)?.view {
            let n = range.len();
            if id < pos + n {
                let k = (id - pos) as usize;
                return Some(match range {
                    ViewRange::Borrowed { session, from, .. } => (*session, from + k),
                    ViewRange::Own { from, .. } => (s, from + k),
                });
            }
            pos += n;
        }
        None
    }

    /// Where own event `j` of session `maker` sits in session `s`'s view.
    fn position_of(&self, s: SessionId, maker: SessionId, j: usize) -> Option<EventId> {
        let mut pos = 0u64;
        for range in &self.sessions.get(&s)?.view {
            let (owner, from, to) = match range {
                ViewRange::Borrowed { session, from, to } => (*session, *from, *to),
                ViewRange::Own { from, to } => (s, *from, *to),
            };
            if owner == maker && (from..to).contains(&j) {
                return Some(pos + (j - from) as u64);
            }
            pos += range.len();
        }
        None
    }

    /// The session's events `from..to` (`to` at most its length).
    pub fn read_range(
        &self,
        s: SessionId,
        from: EventId,
        to: EventId,
    ) -> Result<Vec<Event>, SessionError> {
        let sess = self.live(s)?;
        let to = to.min(sess.len);
        let mut out = Vec::with_capacity(to.saturating_sub(from) as usize);
        if from < to {
            self.collect(s, from, to, &mut out);
        }
        Ok(out)
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

    /// Which session made each of a live session's events, run by run, in
    /// view order. A run whose owner is gone is named by `s` itself.
    pub fn owners(&self, s: SessionId) -> Result<Vec<Owned>, SessionError> {
        let sess = self.live(s)?;
        let mut out = Vec::with_capacity(sess.view.len());
        let mut at = 0u64;
        for range in &sess.view {
            let len = range.len();
            let (owner, from) = match range {
                ViewRange::Borrowed { session, from, .. } => (*session, *from),
                ViewRange::Own { from, .. } => (s, *from),
            };
            let owner_at = self
                .sessions
                .get(&owner)
                .and_then(|o| o.own.get(from))
                .map(|e| e.event_id);
            out.push(match owner_at {
                Some(owner_at) => Owned {
                    at,
                    len,
                    owner,
                    owner_at,
                },
                None => Owned {
                    at,
                    len,
                    owner: s,
                    owner_at: at,
                },
            });
            at += len;
        }
        Ok(out)
    }

    /// Every event of a session, purged or not (for internal folds).
    pub(super) fn all_events(&self, s: SessionId) -> Vec<Event> {
        let len = self.sessions.get(&s).map_or(0, |x| x.len);
        let mut out = Vec::with_capacity(len as usize);
        self.collect(s, 0, len, &mut out);
        out
    }

    /// The ranges of view range `from..to` of session `s`, pointing at the
    /// sessions that own those events.
    pub(super) fn slice(&self, s: SessionId, from: u64, to: u64) -> Vec<ViewRange> {
        let Some(sess) = self.sessions.get(&s) else {
            return vec![];
        };
        let mut out = Vec::new();
        let mut pos = 0u64;
        for range in &sess.view {
            let n = range.len();
            let (lo, hi) = (from.max(pos), to.min(pos + n));
            if lo < hi {
                let (a, b) = ((lo - pos) as usize, (hi - pos) as usize);
                out.push(match range {
                    ViewRange::Borrowed { session, from, .. } => ViewRange::Borrowed {
                        session: *session,
                        from: from + a,
                        to: from + b,
                    },
                    ViewRange::Own { from, .. } => ViewRange::Borrowed {
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

    pub(super) fn span_tokens(&self, s: SessionId, from: u64, to: u64) -> u64 {
        let mut out = Vec::new();
        self.collect_with(s, from, to, &mut out, false);
        out.iter().map(|e| e.body.span().len() as u64).sum()
    }
}
