//! Plans of new sessions: Create, Fork (and Trim), Rebase.
//!
//! Ordering rule (kept by the actors): a branch record (Forked, Rebased) is
//! planned, committed and applied while its parent's actor holds the parent,
//! so the parent's length cannot change in between; replay sees the same
//! order in the log. A purge of the parent planned on another actor (a
//! cascade from an ancestor) is kept apart by `SessionBook::begin`.

use super::folds::turn_closing;
use super::plan_messages::check_role;
use super::{Planned, Render, SessionBook, SessionError};
use crate::session::{EditError, MAX_EDITS};
use crate::wire::{Edit, Event, EventId, Params, Record, Role, SessionId};

/// A planned range of a rebased view, before it has event ids: kept from
/// the parent, or one replacing message.
pub(super) enum RebaseRange {
    Keep(EventId, EventId),
    Replace(u8, String),
}

pub(super) fn check_params(p: &Params) -> Result<(), SessionError> {
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

impl SessionBook {
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
            self.writable(p)?;
        }
        Ok(Planned::Branch {
            session: id,
            events: vec![self.event(id, now, 0, Record::Created { parent, params })],
        })
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
        let p = self.writable(parent)?;
        if at_event == 0 || at_event > p.len {
            return Err(SessionError::Invalid(format!(
                "event {at_event} is out of range (Fork's at_event, Trim's to_event): session \
                 {parent} has events 0 to {}, so a fork or trim keeps 1 to {} of them",
                p.len - 1,
                p.len
            )));
        }
        let params = params.unwrap_or(p.params);
        check_params(&params)?;
        Ok(Planned::Branch {
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
        })
    }

    pub(super) fn check_edits(
        &self,
        parent: SessionId,
        edits: &[Edit],
    ) -> Result<(), SessionError> {
        let len = self.get(parent)?.len;
        if edits.is_empty() {
            return Err(EditError::NoEdits.into());
        }
        if edits.len() > MAX_EDITS {
            return Err(EditError::TooMany(edits.len()).into());
        }
        let mut prev_to = 0;
        for (i, e) in edits.iter().enumerate() {
            let (from, to) = e.range();
            if from == 0 {
                return Err(EditError::TouchesEventZero { index: i }.into());
            }
            if from >= to {
                return Err(EditError::EmptyOrReversed { index: i, from, to }.into());
            }
            if to > len {
                return Err(EditError::PastTheEnd {
                    index: i,
                    from,
                    to,
                    session: parent,
                    len,
                }
                .into());
            }
            if i > 0 && from < prev_to {
                return Err(EditError::Unsorted { index: i, from, to }.into());
            }
            if let Edit::Replace { role, .. } = e {
                check_role(*role)?;
            }
            prev_to = to;
        }
        Ok(())
    }

    pub(super) fn rebase_ranges(edits: &[Edit], len: u64) -> Vec<RebaseRange> {
        let mut out = Vec::new();
        let mut p = edits[0].range().0;
        for e in edits {
            let (from, to) = e.range();
            if p < from {
                out.push(RebaseRange::Keep(p, from));
            }
            if let Edit::Replace { role, text, .. } = e {
                out.push(RebaseRange::Replace(*role, text.clone()));
            }
            p = to;
        }
        if p < len {
            out.push(RebaseRange::Keep(p, len));
        }
        out
    }

    /// The role and text of `parent`'s event `at`, a message kept right
    /// after a rebase's edit, when the turn closing its span opens with
    /// (`folds::turn_closing`, after the parent's events before it) is not
    /// the one the new branch's `history` calls for: a message that
    /// followed a generated turn now follows a replacement (the spec's
    /// "rebase its Generated events into one assistant message"), or the
    /// other way round. Such a message is rendered again. Other kinds of
    /// record keep their span (only a message can be a Replace).
    fn closing_changed(
        &self,
        parent: SessionId,
        at: u64,
        history: &[Event],
        render: &dyn Render,
    ) -> Option<(Role, String)> {
        let mut kept = Vec::new();
        self.collect(parent, at, at + 1, &mut kept);
        let Some(Event {
            body: Record::Message { role, text, .. },
            ..
        }) = kept.pop()
        else {
            return None;
        };
        let mut before = Vec::new();
        self.collect(parent, 0, at, &mut before);
        (turn_closing(&before, render) != turn_closing(history, render)).then_some((role, text))
    }

    /// Widens each assistant `Replace` that begins just after a generated
    /// turn's header (its `GenerationPrompt`, not in the edit before) to
    /// take the header in: the message renders a header of its own, and
    /// the spec's "rebase its Generated events into one assistant message"
    /// otherwise left an empty assistant turn before it. The branch's
    /// `Rebased` record holds the widened edits.
    fn absorb_turn_headers(&self, parent: SessionId, mut edits: Vec<Edit>) -> Vec<Edit> {
        let mut prev_to = 0;
        for e in &mut edits {
            let (from, to) = e.range();
            if let Edit::Replace {
                from: start, role, ..
            } = e
            {
                if Role::try_from(*role).ok() == Some(Role::Assistant)
                    && from > prev_to
                    && from >= 2
                {
                    let mut before = Vec::new();
                    self.collect(parent, from - 1, from, &mut before);
                    if matches!(
                        before.first().map(|e| &e.body),
                        Some(Record::GenerationPrompt { .. })
                    ) {
                        *start = from - 1;
                    }
                }
            }
            prev_to = to;
        }
        edits
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
        let p = self.writable(parent)?;
        self.check_edits(parent, &edits)?;
        let edits = self.absorb_turn_headers(parent, edits);
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
        // A message of the new branch, rendered after its history so far.
        let message = |history: &mut Vec<Event>,
                       events: &mut Vec<Event>,
                       role: Role,
                       text: String|
         -> Result<(), SessionError> {
            let span = self.render_message(history, role, &text, render)?;
            let e = self.event(
                id,
                now,
                history.len() as u64,
                Record::Message { role, text, span },
            );
            history.push(e.clone());
            events.push(e);
            Ok(())
        };
        // Messages kept right after an edit whose turn closing the edit
        // changed, rendered again as a Replace of themselves.
        let mut reclosed = Vec::new();
        for range in Self::rebase_ranges(&edits, p.len) {
            match range {
                RebaseRange::Keep(a, b) => {
                    let again = self
                        .closing_changed(parent, a, &history, render)
                        .filter(|_| edits.len() + reclosed.len() < MAX_EDITS);
                    let from = match again {
                        Some((role, text)) => {
                            reclosed.push(Edit::Replace {
                                from: a,
                                to: a + 1,
                                role: role.into(),
                                text: text.clone(),
                            });
                            message(&mut history, &mut events, role, text)?;
                            a + 1
                        }
                        None => a,
                    };
                    self.collect(parent, from, b, &mut history);
                }
                RebaseRange::Replace(role, text) => {
                    message(&mut history, &mut events, check_role(role)?, text)?
                }
            }
        }
        if !reclosed.is_empty() {
            let mut all = edits;
            all.extend(reclosed);
            all.sort_by_key(|e| e.range().0);
            if let Record::Rebased { edits, .. } = &mut events[0].body {
                *edits = all;
            }
        }
        Ok(Planned::Branch {
            session: id,
            events,
        })
    }
}
