//! Tool calls after the model made them: results and outcomes, cancel
//! requests, permissions, the ledger, and the tool choice that forces the
//! next generation to call one.

use super::commit;
use super::prepared::plan_off_thread;
use crate::actors::{now_ms, Shared};
use crate::session::grammar::GrammarError;
use crate::session::SessionError;
use crate::wire::{EventId, Response, SessionId};

/// `AppendToolResult`.
pub(super) async fn result(
    shared: &Shared,
    session: SessionId,
    call_id: EventId,
    content: String,
) -> Result<Response, SessionError> {
    let now = now_ms();
    let planned = plan_off_thread(shared, |book, render| {
        book.plan_tool_result(session, call_id, content.clone(), render, now)
    })
    .await?;
    commit(shared, planned).await
}

/// `AppendToolOutcome`.
pub(super) async fn outcome(
    shared: &Shared,
    session: SessionId,
    call_id: EventId,
    outcome: u8,
    note: String,
) -> Result<Response, SessionError> {
    let planned = shared
        .read()
        .plan_tool_outcome(session, call_id, outcome, note, now_ms())?;
    commit(shared, planned).await
}

/// `RequestToolCancel`.
pub(super) async fn cancel(
    shared: &Shared,
    session: SessionId,
    call_id: EventId,
) -> Result<Response, SessionError> {
    let planned = shared.read().plan_tool_cancel(session, call_id, now_ms())?;
    commit(shared, planned).await
}

/// `OpenToolCalls`.
pub(super) fn open_calls(shared: &Shared, session: SessionId) -> Result<Response, SessionError> {
    let calls = shared.read().open_tool_calls(session)?;
    Ok(Response::ToolCalls { calls })
}

/// `Ledger`.
pub(super) fn ledger(shared: &Shared, session: SessionId) -> Result<Response, SessionError> {
    let entries = shared.read().ledger(session)?;
    Ok(Response::Ledger { entries })
}

/// `RequestPermission`.
pub(super) async fn ask_permission(
    shared: &Shared,
    session: SessionId,
    call_id: EventId,
    text: String,
) -> Result<Response, SessionError> {
    let planned = shared
        .read()
        .plan_permission_request(session, call_id, text, now_ms())?;
    commit(shared, planned).await
}

/// `RespondPermission`.
pub(super) async fn answer_permission(
    shared: &Shared,
    session: SessionId,
    request_id: EventId,
    granted: bool,
) -> Result<Response, SessionError> {
    let planned = shared
        .read()
        .plan_permission_response(session, request_id, granted, now_ms())?;
    commit(shared, planned).await
}

/// `SetToolChoice`.
pub(super) async fn choice(
    shared: &Shared,
    session: SessionId,
    choice: String,
) -> Result<Response, SessionError> {
    let planned = shared.read().plan_tool_choice(session, choice, now_ms())?;
    commit(shared, planned).await
}

/// `SetOutputFormat`.
pub(super) async fn output_format(
    shared: &Shared,
    session: SessionId,
    schema: Option<String>,
) -> Result<Response, SessionError> {
    if let Some(text) = &schema {
        // The cheap checks (JSON, an object, the size limits) first, then
        // the grammar it must become, off the actor thread: a schema that
        // cannot become one is refused here, not at each generation after.
        shared
            .read()
            .plan_output_format(session, schema.clone(), now_ms())?;
        // As generations convert it (json_format): the parsed value's text.
        let canonical = serde_json::from_str::<serde_json::Value>(text)
            .map(|v| v.to_string())
            .unwrap_or_else(|_| text.clone());
        if let Err(e @ (GrammarError::Convert(_) | GrammarError::NoRootRule)) =
            super::schema_cache::grammar_of(&canonical).await
        {
            return Err(SessionError::Invalid(format!(
                "the output schema cannot become a grammar: {e}"
            )));
        }
    }
    let planned = shared
        .read()
        .plan_output_format(session, schema, now_ms())?;
    commit(shared, planned).await
}
