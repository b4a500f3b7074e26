//! New sessions from this one: Fork, Trim (a fork keeping the parent's
//! params) and Rebase. They run on the parent's actor, so the parent cannot
//! grow between the plan and the commit; the new session's id is reserved
//! first, and never reused even if the commit fails.

use super::commit;
use crate::actors::{now_ms, Shared};
use crate::session::SessionError;
use crate::wire::{Edit, EventId, Params, Response, SessionId};

/// `Fork`, and `Trim` (with no params).
pub(super) async fn fork(
    shared: &Shared,
    session: SessionId,
    at_event: EventId,
    params: Option<Params>,
) -> Result<Response, SessionError> {
    let planned = {
        let mut book = shared.write();
        let id = book.reserve_id();
        book.plan_fork(id, session, at_event, params, now_ms())?
    };
    commit(shared, planned).await
}

/// `Rebase`.
pub(super) async fn rebase(
    shared: &Shared,
    session: SessionId,
    edits: Vec<Edit>,
    params: Option<Params>,
) -> Result<Response, SessionError> {
    let render = shared.render.as_ref();
    let planned = {
        let mut book = shared.write();
        let id = book.reserve_id();
        book.plan_rebase(id, session, edits, params, render, now_ms())?
    };
    commit(shared, planned).await
}
