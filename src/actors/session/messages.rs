//! Appends to the session's input (raw text or tokens, chat messages, the
//! opening system turn, blocks) and the reads (events, inspection). Appends
//! render and tokenize off the actor thread (`prepared`).

use super::commit;
use super::prepared::plan_off_thread;
use crate::actors::{now_ms, Shared};
use crate::session::SessionError;
use crate::wire::{EventId, Response, SessionId, Token};

/// `Append`.
pub(super) async fn append(
    shared: &Shared,
    session: SessionId,
    text: Option<String>,
    span: Vec<Token>,
) -> Result<Response, SessionError> {
    let now = now_ms();
    let planned = plan_off_thread(shared, |book, render| {
        book.plan_append(session, text.clone(), span.clone(), render, now)
    })
    .await?;
    commit(shared, planned).await
}

/// `AppendMessage`.
pub(super) async fn message(
    shared: &Shared,
    session: SessionId,
    role: u8,
    text: String,
) -> Result<Response, SessionError> {
    let now = now_ms();
    let planned = plan_off_thread(shared, |book, render| {
        book.plan_message(session, role, text.clone(), render, now)
    })
    .await?;
    commit(shared, planned).await
}

/// `AppendSystem`.
pub(super) async fn system(
    shared: &Shared,
    session: SessionId,
    text: Option<String>,
    tools: Vec<String>,
) -> Result<Response, SessionError> {
    let now = now_ms();
    let planned = plan_off_thread(shared, |book, render| {
        book.plan_system(session, text.clone(), tools.clone(), render, now)
    })
    .await?;
    commit(shared, planned).await
}

/// `AppendImage`: the worker lays the blob out (reading it from the media
/// store, its hash checked), then the message is rendered around it.
pub(super) async fn image(
    shared: &Shared,
    session: SessionId,
    role: u8,
    blob: String,
    pre_text: String,
    post_text: String,
) -> Result<Response, SessionError> {
    let Some(lane) = &shared.vision else {
        return Err(SessionError::NoVision);
    };
    if !crate::media::is_hash(&blob) {
        return Err(SessionError::Image(format!(
            "blob {blob:?} is not a PutMedia hash (64 lowercase hex digits)"
        )));
    }
    // Refuse a purged or unknown session before the worker is asked.
    shared.read().plan_check_live(session)?;
    let layout = crate::actors::lane::media_layout(lane, &blob)
        .await
        .map_err(|e| SessionError::Image(e.to_string()))?;
    let now = now_ms();
    let planned = plan_off_thread(shared, |book, render| {
        book.plan_image(
            session,
            role,
            blob.clone(),
            pre_text.clone(),
            post_text.clone(),
            &layout,
            render,
            now,
        )
    })
    .await?;
    commit(shared, planned).await
}

/// `AppendBlock`.
pub(super) async fn block(
    shared: &Shared,
    session: SessionId,
    role: u8,
    kind: String,
    payload: String,
) -> Result<Response, SessionError> {
    let now = now_ms();
    let planned = plan_off_thread(shared, |book, render| {
        book.plan_block(session, role, kind.clone(), payload.clone(), render, now)
    })
    .await?;
    commit(shared, planned).await
}

/// `Read`.
pub(super) fn read(
    shared: &Shared,
    session: SessionId,
    cursor: EventId,
) -> Result<Response, SessionError> {
    let events = shared.read().read(session, cursor)?;
    Ok(Response::Events { events })
}

/// `Inspect` (the actor fills in `generating`).
pub(super) fn inspect(shared: &Shared, session: SessionId) -> Result<Response, SessionError> {
    let inspection = shared.read().inspect(session)?;
    Ok(Response::Inspection { inspection })
}
