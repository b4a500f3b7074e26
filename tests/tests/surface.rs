//! The spec's surface end to end, on a real daemon through the socket:
//! archived sessions in `List` and `Tree`, the tool-call ledger
//! (`AppendToolOutcome`, `RequestToolCancel`, `RequestPermission`,
//! `RespondPermission`, `Ledger`), `AppendBlock`, a second `Generate` refused
//! with SessionBusy, and `--sessions-cache` refused with `--park`.
//!
//! The tool tests make one forced call on the tools model and fork the
//! session at its end once per case: every fork shares the same `ToolUse`
//! (same call id) and keeps a ledger of its own.

use serde_json::json;
use superfluid::frontend::socket::Client;
use superfluid::wire::{
    Event, EventId, Finish, LedgerEntry, LedgerStatus, Record, Request, Response, Role, SessionId,
    SessionSummary, ToolOutcome,
};

use crate::util::{
    assert_cancelled, commit, created, expect_err, forced_weather_session, shared_daemon,
    tools_think_daemon, TestDaemon,
};

// ---- archived sessions -----------------------------------------------------

fn list(c: &mut Client) -> Vec<SessionId> {
    match c.call(&Request::List).unwrap() {
        Response::Sessions { ids } => ids,
        other => panic!("List: {other:?}"),
    }
}

fn tree(c: &mut Client) -> Vec<(SessionId, Option<SessionId>, Option<EventId>)> {
    match c.call(&Request::Tree).unwrap() {
        Response::Tree { nodes } => nodes,
        other => panic!("Tree: {other:?}"),
    }
}

fn summaries(c: &mut Client, include_archived: bool) -> Vec<SessionSummary> {
    match c.call(&Request::Sessions { include_archived }).unwrap() {
        Response::SessionList { sessions } => sessions,
        other => panic!("Sessions: {other:?}"),
    }
}

fn set_archived(c: &mut Client, s: SessionId, version: u64, archived: bool) {
    assert_eq!(
        c.call(&Request::SetMeta {
            session: s,
            expected_version: version,
            title: None,
            archived: Some(archived),
        })
        .unwrap(),
        Response::Meta {
            version: version + 1
        }
    );
}

/// `SetMeta {archived: true}` hides the session from `List`, `Tree` and
/// `Sessions`, and only it: its fork stays and names it as its parent. It
/// keeps everything (reads back the same, takes appends), and unarchiving
/// shows it again.
#[test]
fn an_archived_session_leaves_list_and_tree_and_keeps_everything() {
    let d = shared_daemon();
    let mut c = d.client();
    let root = d.create(&mut c);
    let say = |c: &mut Client, s, text: &str| {
        commit(
            c,
            Request::AppendMessage {
                session: s,
                role: Role::User.into(),
                text: text.into(),
            },
        )
    };
    say(&mut c, root, "a");
    let fork = |c: &mut Client, s, at_event| {
        created(
            c,
            Request::Fork {
                session: s,
                at_event,
                params: None,
            },
        )
    };
    let archived = fork(&mut c, root, 2);
    say(&mut c, archived, "b");
    let child = fork(&mut c, archived, 3);
    let before = d.read_all(archived);
    for s in [root, archived, child] {
        assert!(list(&mut c).contains(&s));
    }

    set_archived(&mut c, archived, 0, true);
    let ids = list(&mut c);
    assert!(!ids.contains(&archived), "{ids:?}");
    assert!(ids.contains(&root) && ids.contains(&child), "{ids:?}");
    let nodes = tree(&mut c);
    assert!(nodes.iter().all(|n| n.0 != archived), "{nodes:?}");
    assert!(nodes.contains(&(root, None, None)), "{nodes:?}");
    assert!(
        nodes.contains(&(child, Some(archived), Some(3))),
        "the child keeps its archived parent: {nodes:?}"
    );
    assert!(summaries(&mut c, false)
        .iter()
        .all(|x| x.session != archived));
    let all = summaries(&mut c, true);
    let entry = all.iter().find(|x| x.session == archived).unwrap();
    assert_eq!(
        (entry.parent, entry.archived, entry.events),
        (Some(root), true, 4)
    );
    // Everything is kept: it reads back the same and still takes appends.
    assert_eq!(d.read_all(archived), before);
    let Response::Inspection { inspection } =
        c.call(&Request::Inspect { session: archived }).unwrap()
    else {
        panic!()
    };
    assert_eq!((inspection.archived, inspection.version), (true, 1));
    let e = say(&mut c, archived, "c");
    assert_eq!(e.event_id, 4);
    assert!(!list(&mut c).contains(&archived));

    set_archived(&mut c, archived, 1, false);
    assert!(list(&mut c).contains(&archived));
    assert!(tree(&mut c).contains(&(archived, Some(root), Some(2))));
}

// ---- the tool-call ledger ----------------------------------------------------

/// A daemon on the tools model and a session whose last event is the
/// `ToolUse` of a forced call: (daemon, session, call id, arguments).
fn called() -> (TestDaemon, SessionId, EventId, String) {
    let d = tools_think_daemon();
    let mut c = d.client();
    let s = forced_weather_session(&mut c);
    let replies = c
        .generate(&Request::Generate {
            session: s,
            max_tokens: 128,
        })
        .unwrap();
    assert!(
        matches!(
            replies.last(),
            Some(Response::Generated {
                finish: Finish::Grammar,
                ..
            })
        ),
        "{replies:?}"
    );
    let (call_id, arguments) = d
        .read_all(s)
        .iter()
        .find_map(|e| match &e.body {
            Record::ToolUse { name, arguments } if name == "get_weather" => {
                Some((e.event_id, arguments.clone()))
            }
            _ => None,
        })
        .expect("a ToolUse");
    (d, s, call_id, arguments)
}

/// A fork of `s` holding all of it: the call is open there too.
fn fork_at_end(d: &TestDaemon, c: &mut Client, s: SessionId) -> SessionId {
    created(
        c,
        Request::Fork {
            session: s,
            at_event: d.read_all(s).len() as u64,
            params: None,
        },
    )
}

fn ledger(c: &mut Client, s: SessionId) -> Vec<LedgerEntry> {
    match c.call(&Request::Ledger { session: s }).unwrap() {
        Response::Ledger { entries } => entries,
        other => panic!("Ledger: {other:?}"),
    }
}

fn open_calls(c: &mut Client, s: SessionId) -> Vec<(EventId, String, String)> {
    match c.call(&Request::OpenToolCalls { session: s }).unwrap() {
        Response::ToolCalls { calls } => calls,
        other => panic!("OpenToolCalls: {other:?}"),
    }
}

fn entry(
    call_id: EventId,
    arguments: &str,
    status: LedgerStatus,
    closed_by: Option<EventId>,
    permission: Option<bool>,
) -> LedgerEntry {
    LedgerEntry {
        call_id,
        name: "get_weather".into(),
        arguments: arguments.into(),
        status,
        closed_by,
        permission,
    }
}

/// The event a request committed is what `Read` gives back as the session's
/// last event, and it is the next id.
fn assert_last(d: &TestDaemon, s: SessionId, e: &Event, id: EventId) {
    assert_eq!(e.event_id, id);
    assert_eq!(d.read_all(s).last(), Some(e));
}

/// `AppendToolOutcome` closes an open call as failed (1) or cancelled (2),
/// with its note; a closed call takes no result or outcome after it; an
/// unknown outcome or call is refused.
#[test]
fn a_tool_outcome_closes_the_call() {
    let (d, s, call_id, arguments) = called();
    let mut c = d.client();
    for (outcome, status) in [
        (ToolOutcome::Failed, LedgerStatus::Failed),
        (ToolOutcome::Cancelled, LedgerStatus::Cancelled),
    ] {
        let f = fork_at_end(&d, &mut c, s);
        let at = d.read_all(f).len() as u64;
        let e = commit(
            &mut c,
            Request::AppendToolOutcome {
                session: f,
                call_id,
                outcome: outcome.into(),
                note: "the weather service timed out".into(),
            },
        );
        assert_eq!(
            e.body,
            Record::ToolOutcome {
                call_id,
                outcome,
                note: "the weather service timed out".into()
            }
        );
        assert_last(&d, f, &e, at);
        assert_eq!(
            ledger(&mut c, f),
            vec![entry(call_id, &arguments, status, Some(at), None)]
        );
        assert_eq!(open_calls(&mut c, f), vec![]);
        let closed = format!("tool call {call_id} was already answered ({status})");
        for again in [
            Request::AppendToolResult {
                session: f,
                call_id,
                content: "Sunny".into(),
            },
            Request::AppendToolOutcome {
                session: f,
                call_id,
                outcome: 1,
                note: String::new(),
            },
            Request::RequestToolCancel {
                session: f,
                call_id,
            },
        ] {
            assert_eq!(expect_err(&mut c, &again), closed, "{again:?}");
        }
        assert_eq!(d.read_all(f).len() as u64, at + 1, "a refusal committed");
    }
    // The parent's call is still open: the forks' outcomes are their own.
    assert_eq!(
        open_calls(&mut c, s),
        vec![(call_id, "get_weather".into(), arguments.clone())]
    );
    let len = d.read_all(s).len();
    assert_eq!(
        expect_err(
            &mut c,
            &Request::AppendToolOutcome {
                session: s,
                call_id,
                outcome: 3,
                note: String::new(),
            }
        ),
        "outcome 3 is not 1 (failed) or 2 (cancelled)"
    );
    assert_eq!(
        expect_err(
            &mut c,
            &Request::AppendToolOutcome {
                session: s,
                call_id: call_id + 1000,
                outcome: 1,
                note: String::new(),
            }
        ),
        format!("session {s} has no tool call {}", call_id + 1000)
    );
    assert_eq!(d.read_all(s).len(), len, "a refusal committed");
}

/// `RequestToolCancel` records the request and leaves the call open
/// ("cancel requested"): it still takes its outcome, which closes it.
#[test]
fn a_cancel_request_leaves_the_call_open_until_its_outcome() {
    let (d, s, call_id, arguments) = called();
    let mut c = d.client();
    let at = d.read_all(s).len() as u64;
    let e = commit(
        &mut c,
        Request::RequestToolCancel {
            session: s,
            call_id,
        },
    );
    assert_eq!(e.body, Record::ToolCancelRequested { call_id });
    assert_last(&d, s, &e, at);
    assert_eq!(
        ledger(&mut c, s),
        vec![entry(
            call_id,
            &arguments,
            LedgerStatus::CancelRequested,
            None,
            None
        )]
    );
    assert_eq!(
        open_calls(&mut c, s),
        vec![(call_id, "get_weather".into(), arguments.clone())]
    );
    // Asked twice: still open, still "cancel requested".
    commit(
        &mut c,
        Request::RequestToolCancel {
            session: s,
            call_id,
        },
    );
    let e = commit(
        &mut c,
        Request::AppendToolOutcome {
            session: s,
            call_id,
            outcome: ToolOutcome::Cancelled.into(),
            note: "stopped".into(),
        },
    );
    assert_last(&d, s, &e, at + 2);
    assert_eq!(
        ledger(&mut c, s),
        vec![entry(
            call_id,
            &arguments,
            LedgerStatus::Cancelled,
            Some(at + 2),
            None
        )]
    );
    assert_eq!(
        expect_err(
            &mut c,
            &Request::RequestToolCancel {
                session: s,
                call_id
            }
        ),
        format!("tool call {call_id} was already answered (cancelled)")
    );
}

/// `Ledger` in JSON (what /web/rpc and the JSON clients get): each status
/// is the spec's string, on one session per status.
#[test]
fn the_ledger_names_each_status_as_the_spec_writes_it() {
    let (d, s, call_id, arguments) = called();
    let mut c = d.client();
    let mut cases = vec![(s, "open", None)];
    let answered = fork_at_end(&d, &mut c, s);
    let e = commit(
        &mut c,
        Request::AppendToolResult {
            session: answered,
            call_id,
            content: "Sunny, 21 C".into(),
        },
    );
    cases.push((answered, "answered", Some(e.event_id)));
    for (outcome, status) in [(1, "failed"), (2, "cancelled")] {
        let f = fork_at_end(&d, &mut c, s);
        let e = commit(
            &mut c,
            Request::AppendToolOutcome {
                session: f,
                call_id,
                outcome,
                note: String::new(),
            },
        );
        cases.push((f, status, Some(e.event_id)));
    }
    let asked = fork_at_end(&d, &mut c, s);
    commit(
        &mut c,
        Request::RequestToolCancel {
            session: asked,
            call_id,
        },
    );
    cases.push((asked, "cancel requested", None));
    for (session, status, closed_by) in cases {
        let reply = c.call(&Request::Ledger { session }).unwrap();
        assert_eq!(
            serde_json::to_value(&reply).unwrap(),
            json!({"Ledger": {"entries": [{
                "call_id": call_id,
                "name": "get_weather",
                "arguments": arguments,
                "status": status,
                "closed_by": closed_by,
                "permission": null,
            }]}}),
            "session {session}"
        );
    }
}

/// `RequestPermission` commits a request whose event id `RespondPermission`
/// answers, once; the answer is the ledger's `permission`.
#[test]
fn a_permission_request_and_its_answer_reach_the_ledger() {
    let (d, s, call_id, arguments) = called();
    let mut c = d.client();
    for granted in [true, false] {
        let f = fork_at_end(&d, &mut c, s);
        let at = d.read_all(f).len() as u64;
        let asked = commit(
            &mut c,
            Request::RequestPermission {
                session: f,
                call_id,
                text: "Look up the weather in Paris?".into(),
            },
        );
        assert_eq!(
            asked.body,
            Record::PermissionRequested {
                call_id,
                text: "Look up the weather in Paris?".into()
            }
        );
        assert_last(&d, f, &asked, at);
        assert_eq!(
            ledger(&mut c, f),
            vec![entry(call_id, &arguments, LedgerStatus::Open, None, None)]
        );
        let answer = commit(
            &mut c,
            Request::RespondPermission {
                session: f,
                request_id: asked.event_id,
                granted,
            },
        );
        assert_eq!(
            answer.body,
            Record::PermissionResponded {
                request_id: asked.event_id,
                granted
            }
        );
        assert_last(&d, f, &answer, at + 1);
        assert_eq!(
            ledger(&mut c, f),
            vec![entry(
                call_id,
                &arguments,
                LedgerStatus::Open,
                None,
                Some(granted)
            )]
        );
        assert_eq!(
            expect_err(
                &mut c,
                &Request::RespondPermission {
                    session: f,
                    request_id: asked.event_id,
                    granted: !granted,
                }
            ),
            format!("permission request {} was already answered", asked.event_id)
        );
        // A request id that is not a PermissionRequested event.
        assert_eq!(
            expect_err(
                &mut c,
                &Request::RespondPermission {
                    session: f,
                    request_id: call_id,
                    granted,
                }
            ),
            format!("session {f} has no permission request {call_id}")
        );
        assert_eq!(d.read_all(f).len() as u64, at + 2, "a refusal committed");
    }
    // A closed call takes no permission request.
    commit(
        &mut c,
        Request::AppendToolResult {
            session: s,
            call_id,
            content: "Sunny".into(),
        },
    );
    assert_eq!(
        expect_err(
            &mut c,
            &Request::RequestPermission {
                session: s,
                call_id,
                text: "late".into(),
            }
        ),
        format!("tool call {call_id} was already answered (answered)")
    );
}

// ---- AppendBlock -------------------------------------------------------------

/// `AppendBlock` commits a `Block` with its role, kind and payload, rendered
/// like a message of its role with the payload as content (the same span
/// `AppendMessage` gets in the same place), and reads back as committed.
#[test]
fn a_block_is_committed_and_rendered_like_a_message() {
    let d = shared_daemon();
    let mut c = d.client();
    let s = d.create(&mut c);
    commit(
        &mut c,
        Request::AppendMessage {
            session: s,
            role: Role::User.into(),
            text: "Summarise the notes.".into(),
        },
    );
    let payload = "meeting moved to Thursday";
    let block = commit(
        &mut c,
        Request::AppendBlock {
            session: s,
            role: Role::User.into(),
            kind: "note".into(),
            payload: payload.into(),
        },
    );
    let Record::Block {
        role,
        kind,
        payload: p,
        span,
    } = &block.body
    else {
        panic!("{block:?}")
    };
    assert_eq!(
        (*role, kind.as_str(), p.as_str()),
        (Role::User, "note", payload)
    );
    assert!(!span.is_empty());
    assert_eq!(block.event_id, 2);
    assert_eq!(d.read_all(s).last(), Some(&block));
    // The message it renders like, in the same place.
    let twin = created(
        &mut c,
        Request::Fork {
            session: s,
            at_event: 2,
            params: None,
        },
    );
    let msg = commit(
        &mut c,
        Request::AppendMessage {
            session: twin,
            role: Role::User.into(),
            text: payload.into(),
        },
    );
    assert_eq!(msg.body.span(), span.as_slice());
    // Refused: no kind, or a role the spec does not define; nothing committed.
    assert_eq!(
        expect_err(
            &mut c,
            &Request::AppendBlock {
                session: s,
                role: Role::User.into(),
                kind: String::new(),
                payload: "x".into(),
            }
        ),
        "AppendBlock needs a kind"
    );
    let bad_role = expect_err(
        &mut c,
        &Request::AppendBlock {
            session: s,
            role: 7,
            kind: "note".into(),
            payload: "x".into(),
        },
    );
    assert!(bad_role.starts_with("unknown role 7: "), "{bad_role}");
    assert_eq!(d.read_all(s).len(), 3);
}

// ---- SessionBusy ---------------------------------------------------------------

/// A second `Generate` on a session that is generating, from another
/// connection, is refused with SessionBusy and commits nothing; the first
/// one runs on.
#[test]
fn a_second_generate_is_refused_while_the_first_runs() {
    let d = TestDaemon::start();
    let mut c = d.client();
    let s = d.create(&mut c);
    commit(
        &mut c,
        Request::AppendMessage {
            session: s,
            role: Role::User.into(),
            text: "Write a long story about a lighthouse keeper and a storm.".into(),
        },
    );
    let socket = d.socket.clone();
    let first = std::thread::spawn(move || {
        Client::connect(&socket)
            .unwrap()
            .generate(&Request::Generate {
                session: s,
                max_tokens: 1000,
            })
            .unwrap()
    });
    // The first generation has committed a chunk: it runs.
    d.until_generated(s);
    let mut other = d.client();
    let second = other
        .generate(&Request::Generate {
            session: s,
            max_tokens: 16,
        })
        .unwrap();
    assert_eq!(
        second,
        vec![Response::Err {
            message: format!("SessionBusy: session {s} has a generation in flight")
        }]
    );
    assert_eq!(
        other.call(&Request::Cancel { session: s }).unwrap(),
        Response::Cancelling
    );
    let replies = first.join().unwrap();
    assert_cancelled(&replies);
    // The log holds the first generation's events and nothing else.
    let deltas: Vec<Event> = replies
        .iter()
        .filter_map(|r| match r {
            Response::Delta { event } => Some(event.clone()),
            _ => None,
        })
        .collect();
    let events = d.read_all(s);
    assert_eq!(events[2..], deltas[..]);
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e.body, Record::GenerationPrompt { .. }))
            .count(),
        1
    );
    // Once it has ended, a Generate is served again.
    let replies = other
        .generate(&Request::Generate {
            session: s,
            max_tokens: 4,
        })
        .unwrap();
    assert!(
        matches!(replies.last(), Some(Response::Generated { .. })),
        "{replies:?}"
    );
}

// ---- --sessions-cache with --park --------------------------------------------

/// `--sessions-cache` cannot be combined with `--park` (the spec), in either
/// order: refused before anything is opened or created.
#[test]
fn sessions_cache_is_refused_with_park() {
    let mut d = TestDaemon::new();
    for (args, message) in [
        (
            ["--sessions-cache", "--park"],
            "error: the argument '--sessions-cache' cannot be used with '--park'",
        ),
        (
            ["--park", "--sessions-cache"],
            "error: the argument '--park' cannot be used with '--sessions-cache'",
        ),
    ] {
        let failed = d.start_expect_exit(&args.map(String::from));
        assert_eq!(failed.status.code(), Some(2), "{}", failed.stderr);
        assert!(failed.stderr.starts_with(message), "{}", failed.stderr);
        assert!(!d.sessions.exists(), "the sessions dir was created");
        assert!(!d.socket.exists(), "the socket was bound");
    }
    // `--sessions-cache` alone starts.
    d.extra_args = vec!["--sessions-cache".into()];
    d.spawn_and_wait();
}
