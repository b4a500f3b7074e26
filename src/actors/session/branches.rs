//! New sessions from this one: Fork, Trim (a fork keeping the parent's
//! params) and Rebase. They run on the parent's actor, so the parent cannot
//! grow between the plan and the commit; the new session's id is reserved
//! first, given back if the plan is refused (when no id was reserved after
//! it), and never reused once a commit was tried, even if it fails. A cascade purge of an
//! ancestor runs on another actor: each plan is registered as in flight
//! (`SessionBook::begin`) so that the two are never in flight together.

use super::commit;
use super::prepared::plan_off_thread;
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
        // In flight until applied: a purge of the parent (a cascade from an
        // ancestor, planned on another actor) waits for it.
        match book
            .plan_fork(id, session, at_event, params, now_ms())
            .and_then(|p| book.begin(&p).map(|()| p))
        {
            Ok(planned) => planned,
            Err(e) => {
                book.release_id(id);
                return Err(e);
            }
        }
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
    let id = shared.write().reserve_id();
    let now = now_ms();
    // The Replace edits render off the actor thread, under no write lock.
    let planned = plan_off_thread(shared, |book, render| {
        book.plan_rebase(id, session, edits.clone(), params, render, now)
    })
    .await
    // Planned under a read lock: `begin` checks again that no purge took the
    // parent meanwhile.
    .and_then(|p| shared.write().begin(&p).map(|()| p));
    match planned {
        Ok(planned) => commit(shared, planned).await,
        Err(e) => {
            // Given back only if no other session reserved one meanwhile.
            shared.write().release_id(id);
            Err(e)
        }
    }
}
