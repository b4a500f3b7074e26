//! `superfluid session export`: a session's events as jsonl, as OTLP traces
//! (GenAI semantic conventions) in a file, or pushed to an OTLP/HTTP
//! collector. docs/export.md is the user's reference; this module is plain
//! data in, text out, except [`fetch`] (a client of the daemon's socket:
//! an export never opens wal.log) and [`push`] (one POST per session to
//! the URL the user gave, and nowhere else).
//!
//! - [`redact`]: the secret shapes replaced in exported content.
//! - [`jsonl`]: one line per event.
//! - [`otlp`]: an `ExportTraceServiceRequest` per session.

pub mod jsonl;
pub mod otlp;
pub mod redact;

use std::time::Duration;

use crate::frontend::socket::Client;
use crate::wire::{Event, EventId, Inspection, Record, Request, Response, SessionId};

/// How long one push may take, connecting included.
pub const PUSH_TIMEOUT_MS: u64 = 30_000;

/// Why an export failed.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("the daemon: {0}")]
    Daemon(String),
    #[error("unexpected reply to {0} from the daemon")]
    Reply(&'static str),
    #[error(
        "refusing to push content to {0}: --include-content with --endpoint also needs \
         --allow-content-egress (nothing was sent)"
    )]
    ContentEgress(String),
    #[error("bad endpoint {url:?}: {reason}")]
    Endpoint { url: String, reason: String },
    #[error("pushing to {url}: {reason}")]
    Push { url: String, reason: String },
    #[error(
        "one span takes {bytes} bytes, over the limit of {cap} bytes a request \
         (--max-request-bytes); export it to a file instead (nothing was sent)"
    )]
    SpanTooLarge { bytes: usize, cap: usize },
}

/// A session as an export sees it: its inspection and every event of its
/// view, a fork's inherited events included.
#[derive(Debug, Clone)]
pub struct SessionExport {
    pub inspection: Inspection,
    pub events: Vec<Event>,
    /// Per event: the session this one was forked (or trimmed, or rebased)
    /// from when the event is inherited from it, `None` for its own.
    pub inherited_from: Vec<Option<SessionId>>,
}

/// What the exported text carries.
#[derive(Debug, Clone, Default)]
pub struct ExportOptions {
    /// Write message text, generated text, tool arguments and results
    /// (redacted); without it, none of them.
    pub include_content: bool,
    /// The model's name for `gen_ai.request.model`; the daemon does not
    /// say which file it serves, so the user does.
    pub model: Option<String>,
}

/// The events of a session's view that it inherited from `parent` (the
/// session its header names): everything before its own
/// `Forked`/`Rebased` header, and, after a `Rebased` header, the parent's
/// later events it still shares (equal in epoch, time and body).
pub fn mark_inherited(
    inspection: &Inspection,
    events: &[Event],
    parent_events: Option<&[Event]>,
) -> Vec<Option<SessionId>> {
    let mut out = vec![None; events.len()];
    let (Some(parent), Some(_)) = (inspection.parent, inspection.fork_at) else {
        return out;
    };
    // Its own header is the last one naming its parent: a fork of a fork
    // also holds its parent's header, inherited.
    let header = events.iter().rposition(|e| {
        matches!(&e.body,
            Record::Forked { parent: p, .. } | Record::Rebased { parent: p, .. } if *p == parent)
    });
    let Some(header) = header else {
        return out;
    };
    for slot in out.iter_mut().take(header) {
        *slot = Some(parent);
    }
    if let (Record::Rebased { fork_at, .. }, Some(pe)) = (&events[header].body, parent_events) {
        let later: Vec<&Event> = pe.iter().filter(|e| e.event_id >= *fork_at).collect();
        for (i, e) in events.iter().enumerate().skip(header + 1) {
            if later
                .iter()
                .any(|p| p.epoch == e.epoch && p.ts_unix_ms == e.ts_unix_ms && p.body == e.body)
            {
                out[i] = Some(parent);
            }
        }
    }
    out
}

fn call(client: &mut Client, request: &Request) -> Result<Response, ExportError> {
    match client.call(request) {
        Err(e) => Err(ExportError::Daemon(e.to_string())),
        Ok(Response::Err { message }) => Err(ExportError::Daemon(message)),
        Ok(r) => Ok(r),
    }
}

/// Every event of `session` from `cursor` on, in as many `Read`s as the
/// daemon answers with.
pub fn read_all(
    client: &mut Client,
    session: SessionId,
    mut cursor: EventId,
    len: u64,
) -> Result<Vec<Event>, ExportError> {
    let mut out = Vec::new();
    loop {
        let Response::Events { events } = call(client, &Request::Read { session, cursor })? else {
            return Err(ExportError::Reply("Read"));
        };
        let Some(last) = events.last() else { break };
        cursor = last.event_id + 1;
        out.extend(events);
        if cursor >= len {
            break;
        }
    }
    Ok(out)
}

/// `Inspect`.
pub fn inspect(client: &mut Client, session: SessionId) -> Result<Inspection, ExportError> {
    match call(client, &Request::Inspect { session })? {
        Response::Inspection { inspection } => Ok(inspection),
        _ => Err(ExportError::Reply("Inspect")),
    }
}

/// A session, read through the daemon's socket; a fork's parent is read
/// too, to tell a rebase's inherited events from its own.
pub fn fetch(client: &mut Client, session: SessionId) -> Result<SessionExport, ExportError> {
    let inspection = inspect(client, session)?;
    let events = read_all(client, session, 0, inspection.events)?;
    let parent_events = match (inspection.parent, inspection.fork_at) {
        // A purged parent cannot be read: only the header rule applies.
        (Some(p), Some(_)) => inspect(client, p)
            .and_then(|pi| read_all(client, p, 0, pi.events))
            .ok(),
        _ => None,
    };
    let inherited_from = mark_inherited(&inspection, &events, parent_events.as_deref());
    Ok(SessionExport {
        inspection,
        events,
        inherited_from,
    })
}

/// The URL an OTLP/HTTP push posts traces to: `endpoint` + `/v1/traces`,
/// the collector's path. Only `http://` is taken: this build carries no
/// TLS (docs/export.md).
pub fn traces_url(endpoint: &str) -> Result<String, ExportError> {
    let bad = |reason: &str| ExportError::Endpoint {
        url: endpoint.to_string(),
        reason: reason.to_string(),
    };
    let rest = if let Some(rest) = endpoint.strip_prefix("http://") {
        rest
    } else if endpoint.starts_with("https://") {
        return Err(bad(
            "https is not supported (this build has no TLS); push to a local collector over http://",
        ));
    } else {
        return Err(bad("expected http://HOST:PORT"));
    };
    if rest.is_empty() || rest.starts_with('/') {
        return Err(bad("no host"));
    }
    if rest.contains(['?', '#']) || rest.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad("give the collector's base URL, without a query"));
    }
    Ok(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
}

/// The refusal the spec asks for, checked before anything is read or sent.
pub fn check_egress(
    endpoint: &str,
    include_content: bool,
    allow_content_egress: bool,
) -> Result<(), ExportError> {
    if include_content && !allow_content_egress {
        return Err(ExportError::ContentEgress(endpoint.to_string()));
    }
    Ok(())
}

/// POSTs one OTLP/HTTP JSON body to `url`: no proxy (whatever the
/// environment says), no redirect followed, so the bytes go to the URL the
/// user gave and nowhere else. A status outside 2xx is an error.
pub fn push(url: &str, body: &str) -> Result<(), ExportError> {
    let err = |reason: String| ExportError::Push {
        url: url.to_string(),
        reason,
    };
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .proxy(None)
        .max_redirects(0)
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_millis(PUSH_TIMEOUT_MS)))
        .build()
        .into();
    let response = agent
        .post(url)
        .header("Content-Type", "application/json")
        .send(body)
        .map_err(|e| err(e.to_string()))?;
    let status = response.status();
    if !status.is_success() {
        return Err(err(format!("the collector answered {status}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Params;

    fn ev(id: u64, ts: u64, body: Record) -> Event {
        Event {
            event_id: id,
            epoch: 1,
            ts_unix_ms: ts,
            body,
        }
    }

    fn insp(parent: Option<u64>, fork_at: Option<u64>) -> Inspection {
        Inspection {
            session: 9,
            parent,
            fork_at,
            params: Params::greedy(0),
            events: 0,
            tokens: 0,
            generation: 0,
            version: 0,
            title: None,
            archived: false,
            purged: false,
            children: vec![],
            created_unix_ms: 0,
            updated_unix_ms: 0,
            open_turn: false,
            generating: false,
        }
    }

    fn msg(t: &str) -> Record {
        Record::Message {
            role: crate::wire::Role::User,
            text: t.into(),
            span: vec![1],
        }
    }

    #[test]
    fn a_forks_events_before_its_header_are_inherited() {
        let p = Params::greedy(0);
        let events = vec![
            ev(
                0,
                1,
                Record::Created {
                    parent: None,
                    params: p,
                },
            ),
            ev(1, 2, msg("a")),
            ev(
                2,
                3,
                Record::Forked {
                    parent: 4,
                    fork_at: 2,
                    params: p,
                },
            ),
            ev(3, 4, msg("b")),
        ];
        let got = mark_inherited(&insp(Some(4), Some(2)), &events, None);
        assert_eq!(got, vec![Some(4), Some(4), None, None]);
        // A root: nothing inherited, even under a `Created` parent.
        assert_eq!(
            mark_inherited(&insp(Some(4), None), &events, None),
            vec![None; 4]
        );
    }

    #[test]
    fn a_fork_of_a_fork_names_its_own_parent() {
        let p = Params::greedy(0);
        let events = vec![
            ev(
                0,
                1,
                Record::Created {
                    parent: None,
                    params: p,
                },
            ),
            ev(
                1,
                2,
                Record::Forked {
                    parent: 1,
                    fork_at: 1,
                    params: p,
                },
            ),
            ev(2, 3, msg("a")),
            ev(
                3,
                4,
                Record::Forked {
                    parent: 2,
                    fork_at: 3,
                    params: p,
                },
            ),
        ];
        let got = mark_inherited(&insp(Some(2), Some(3)), &events, None);
        assert_eq!(got, vec![Some(2), Some(2), Some(2), None]);
    }

    #[test]
    fn a_rebase_shares_the_parents_later_events() {
        let p = Params::greedy(0);
        let parent = vec![
            ev(
                0,
                1,
                Record::Created {
                    parent: None,
                    params: p,
                },
            ),
            ev(1, 2, msg("a")),
            ev(2, 3, msg("b")),
            ev(3, 4, msg("c")),
        ];
        let events = vec![
            parent[0].clone(),
            ev(
                1,
                9,
                Record::Rebased {
                    parent: 4,
                    fork_at: 1,
                    params: p,
                    edits: vec![],
                },
            ),
            ev(2, 9, msg("A")),
            ev(3, 3, msg("b")),
            ev(4, 4, msg("c")),
        ];
        let got = mark_inherited(&insp(Some(4), Some(1)), &events, Some(&parent));
        assert_eq!(got, vec![Some(4), None, None, Some(4), Some(4)]);
    }

    #[test]
    fn endpoints_are_http_base_urls() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318").unwrap(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://collector:4318/").unwrap(),
            "http://collector:4318/v1/traces"
        );
        for bad in [
            "https://x:4318",
            "ftp://x",
            "collector:4318",
            "http://",
            "http://x/?a=b",
        ] {
            assert!(traces_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn content_egress_needs_both_flags() {
        assert!(check_egress("http://x", false, false).is_ok());
        assert!(check_egress("http://x", true, true).is_ok());
        let e = check_egress("http://x", true, false).unwrap_err();
        assert!(e.to_string().contains("--allow-content-egress"), "{e}");
    }
}
