//! Plans about tool calls: the tool choice, results and outcomes, cancel
//! requests, permissions.

use super::folds::declared_tools;
use super::{Planned, Render, SessionBook, SessionError};
use crate::session::schema_limits::{check_schema, MAX_TOOL_BYTES};
use crate::wire::{EventId, Record, Role, SessionId, ToolOutcome};

/// Why a tool choice cannot be a session's.
#[derive(Debug, PartialEq)]
pub enum ChoiceRefusal {
    /// A call is forced ("required", or a name) and no tool is declared.
    NoTools,
    /// A name that is none of the declared tools' (their names).
    NotDeclared(Vec<String>),
}

/// Whether `choice` ("auto", "required", or a tool's name) can be the tool
/// choice beside the declared `tools` (their JSON texts).
pub fn check_tool_choice(choice: &str, tools: &[String]) -> Result<(), ChoiceRefusal> {
    if choice == "auto" {
        return Ok(());
    }
    let names: Vec<String> = tools
        .iter()
        .filter_map(|t| crate::session::grammar::tool_name(t))
        .collect();
    if names.is_empty() {
        return Err(ChoiceRefusal::NoTools);
    }
    if choice != "required" && !names.iter().any(|n| n == choice) {
        return Err(ChoiceRefusal::NotDeclared(names));
    }
    Ok(())
}

impl SessionBook {
    /// `SetToolChoice`: "auto", "required", or a declared tool's name.
    pub fn plan_tool_choice(
        &self,
        s: SessionId,
        choice: String,
        now: u64,
    ) -> Result<Planned, SessionError> {
        self.writable(s)?;
        match check_tool_choice(&choice, &declared_tools(&self.all_events(s))) {
            Ok(()) => {}
            Err(ChoiceRefusal::NoTools) => {
                return Err(SessionError::Invalid(format!(
                    "session {s} declares no tools (AppendSystem), so no call can be forced"
                )))
            }
            Err(ChoiceRefusal::NotDeclared(names)) => {
                return Err(SessionError::Invalid(format!(
                    "tool choice {choice:?} is not \"auto\", \"required\" or a declared tool ({})",
                    names.join(", ")
                )))
            }
        }
        self.one_event(s, now, Record::ToolChoice { choice })
    }

    /// `SetOutputFormat`: a JSON schema (an object, within a tool's size
    /// and complexity limits) later generations follow, or None.
    pub fn plan_output_format(
        &self,
        s: SessionId,
        schema: Option<String>,
        now: u64,
    ) -> Result<Planned, SessionError> {
        self.writable(s)?;
        if let Some(text) = &schema {
            if text.len() > MAX_TOOL_BYTES {
                return Err(SessionError::Invalid(format!(
                    "the output schema takes {} bytes, over the limit of {MAX_TOOL_BYTES}",
                    text.len()
                )));
            }
            let value: serde_json::Value = serde_json::from_str(text).map_err(|e| {
                SessionError::Invalid(format!("the output schema is not JSON: {e}"))
            })?;
            if !value.is_object() {
                return Err(SessionError::Invalid(
                    "the output schema must be a JSON object".into(),
                ));
            }
            if let Some(why) = check_schema(&value) {
                return Err(SessionError::Invalid(format!(
                    "the output schema cannot become a grammar: {why}"
                )));
            }
        }
        self.one_event(s, now, Record::OutputFormat { schema })
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
        let span = self.render_message(&events, Role::Tool, &content, render)?;
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
        let outcome = ToolOutcome::try_from(outcome).map_err(|_| {
            SessionError::Invalid(format!(
                "outcome {outcome} is not 1 (failed) or 2 (cancelled)"
            ))
        })?;
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
        self.writable(s)?;
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
}
