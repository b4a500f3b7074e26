//! Bad requests: each gets a clear `Err`, leaves wal.log's bytes as they
//! were, and the daemon keeps serving, on the same connection where the
//! protocol allows and on a new one. Every test runs its table of cases
//! against the one shared daemon (`util::shared_daemon`), on a session of its
//! own; none of them needs a daemon of its own.

use superfluid::frontend::socket::Client;
use superfluid::wire::{to_postcard, Edit, PurgeMode, Request, Response, Role, SessionId};

use crate::util::{commit, expect_err, shared_daemon, Raw, TestDaemon};

/// A session id no test creates (the shared daemon hands out small ones).
const UNKNOWN: SessionId = 999_999;

/// A new session of 3 events on `d`: Created, a user and an assistant message.
fn fixture(d: &TestDaemon) -> (Client, SessionId) {
    let mut c = d.client();
    let s = d.create(&mut c);
    for (r, t) in [(Role::User, "hello"), (Role::Assistant, "hi")] {
        commit(
            &mut c,
            Request::AppendMessage {
                session: s,
                role: r.into(),
                text: t.into(),
            },
        );
    }
    (c, s)
}

fn assert_serves(d: &TestDaemon, c: Option<&mut Client>, s: SessionId) {
    if let Some(c) = c {
        assert!(matches!(
            c.call(&Request::List).unwrap(),
            Response::Sessions { .. }
        ));
    }
    match d.call(&Request::List) {
        Response::Sessions { ids } => assert!(ids.contains(&s)),
        other => panic!("{other:?}"),
    }
}

/// On the shared daemon, on a new fixture session `s`: sends each of
/// `cases(s)`, expects an Err containing `keyword`, and checks after each
/// case that wal.log is unchanged and the daemon serves on.
fn refused(cases: impl FnOnce(SessionId) -> Vec<Request>, keyword: &str) {
    let d = shared_daemon();
    let (mut c, s) = fixture(&d);
    let wal = d.wal_bytes();
    for req in cases(s) {
        let message = expect_err(&mut c, &req);
        assert!(
            message.contains(keyword),
            "{req:?}: {message:?} does not mention {keyword:?}"
        );
        assert_eq!(
            d.wal_bytes(),
            wal,
            "{req:?} was refused but changed wal.log"
        );
        assert_serves(&d, Some(&mut c), s);
    }
    assert_eq!(d.read_all(s).len(), 3);
}

#[test]
fn unknown_session() {
    refused(
        |_| {
            vec![
                Request::Read {
                    session: UNKNOWN,
                    cursor: 0,
                },
                Request::AppendMessage {
                    session: UNKNOWN,
                    role: Role::User.into(),
                    text: "x".into(),
                },
                Request::Fork {
                    session: UNKNOWN,
                    at_event: 1,
                    params: None,
                },
            ]
        },
        &format!("unknown session {UNKNOWN}"),
    );
}

#[test]
fn cursor_past_the_end() {
    refused(
        |s| {
            vec![Request::Read {
                session: s,
                cursor: 4,
            }]
        },
        "past the end",
    );
    // The end itself is a valid cursor.
    let d = shared_daemon();
    let (_c, s) = fixture(&d);
    assert_eq!(
        d.call(&Request::Read {
            session: s,
            cursor: 3
        }),
        Response::Events { events: vec![] }
    );
}

#[test]
fn fork_at_event_out_of_range() {
    refused(
        |s| {
            vec![
                Request::Fork {
                    session: s,
                    at_event: 0,
                    params: None,
                },
                Request::Fork {
                    session: s,
                    at_event: 4,
                    params: None,
                },
                Request::Trim {
                    session: s,
                    to_event: 0,
                },
                Request::Trim {
                    session: s,
                    to_event: 4,
                },
            ]
        },
        "out of range",
    );
}

#[test]
fn a_title_over_the_cap() {
    refused(
        |s| {
            vec![Request::SetMeta {
                session: s,
                expected_version: 0,
                title: Some("t".repeat(1025)),
                archived: None,
            }]
        },
        "over the limit of 1024 bytes",
    );
}

/// A refused Create, Fork, Trim or Rebase writes nothing and does not use
/// up a session id: the next session made takes the number after the last
/// one made (the shared daemon is held by this test, so no other test
/// makes a session in between).
#[test]
fn a_refused_branch_uses_no_session_id() {
    let d = shared_daemon();
    let (mut c, s) = fixture(&d);
    let mut bad = crate::util::params(1);
    bad.top_p = 2.0;
    for req in [
        Request::Create {
            parent: None,
            params: bad,
        },
        Request::Create {
            parent: Some(UNKNOWN),
            params: crate::util::params(1),
        },
        Request::Fork {
            session: s,
            at_event: 0,
            params: None,
        },
        Request::Fork {
            session: s,
            at_event: 2,
            params: Some(bad),
        },
        Request::Trim {
            session: s,
            to_event: 4,
        },
        rebase(
            s,
            vec![Edit::Drop { from: 1, to: 3 }, Edit::Drop { from: 2, to: 3 }],
        ),
    ] {
        expect_err(&mut c, &req);
    }
    let next = d.create(&mut c);
    assert_eq!(next, s + 1, "refused requests used up session ids");
    let fork = crate::util::created(
        &mut c,
        Request::Fork {
            session: s,
            at_event: 2,
            params: None,
        },
    );
    assert_eq!(fork, next + 1);
}

fn rebase(session: SessionId, edits: Vec<Edit>) -> Request {
    Request::Rebase {
        session,
        edits,
        params: None,
    }
}

#[test]
fn rebase_edits_overlapping() {
    refused(
        |s| {
            vec![rebase(
                s,
                vec![Edit::Drop { from: 1, to: 3 }, Edit::Drop { from: 2, to: 3 }],
            )]
        },
        "overlap",
    );
}

#[test]
fn rebase_edits_unsorted() {
    refused(
        |s| {
            vec![rebase(
                s,
                vec![Edit::Drop { from: 2, to: 3 }, Edit::Drop { from: 1, to: 2 }],
            )]
        },
        "sorted",
    );
}

#[test]
fn rebase_edit_including_event_0() {
    refused(
        |s| vec![rebase(s, vec![Edit::Drop { from: 0, to: 1 }])],
        "event 0",
    );
}

#[test]
fn rebase_edit_empty_range() {
    refused(
        |s| {
            vec![
                rebase(s, vec![Edit::Drop { from: 2, to: 2 }]),
                rebase(
                    s,
                    vec![Edit::Replace {
                        from: 2,
                        to: 1,
                        role: Role::User.into(),
                        text: "x".into(),
                    }],
                ),
            ]
        },
        "empty",
    );
}

#[test]
fn rebase_edit_past_end() {
    refused(
        |s| vec![rebase(s, vec![Edit::Drop { from: 2, to: 4 }])],
        "past the end",
    );
}

#[test]
fn rebase_with_too_many_edits() {
    // Refused on the count, before the ranges are looked at (these run past
    // the fixture's end too).
    refused(
        |s| {
            let edits = (1..=65)
                .map(|i| Edit::Drop { from: i, to: i + 1 })
                .collect();
            vec![rebase(s, edits)]
        },
        "at most 64 edits",
    );
}

#[test]
fn rebase_without_edits() {
    refused(|s| vec![rebase(s, vec![])], "at least one edit");
}

#[test]
fn wrong_expected_version() {
    refused(
        |s| {
            vec![Request::SetMeta {
                session: s,
                expected_version: 5,
                title: Some("t".into()),
                archived: None,
            }]
        },
        "version mismatch",
    );
}

#[test]
fn wrong_expected_generation() {
    refused(
        |s| {
            vec![
                Request::Purge {
                    session: s,
                    expected_generation: 99,
                    mode: PurgeMode::Cascade,
                },
                Request::Purge {
                    session: s,
                    expected_generation: 0,
                    mode: PurgeMode::Reroot,
                },
            ]
        },
        "generation mismatch",
    );
}

#[test]
fn append_system_after_input() {
    refused(
        |s| {
            vec![Request::AppendSystem {
                session: s,
                text: Some("late".into()),
                tools: vec![],
            }]
        },
        "already has input",
    );
    // A fork inherits its parent's input, so it is refused there too.
    let d = shared_daemon();
    let (mut c, s) = fixture(&d);
    let f = crate::util::created(
        &mut c,
        Request::Fork {
            session: s,
            at_event: 2,
            params: None,
        },
    );
    let wal = d.wal_bytes();
    let m = expect_err(
        &mut c,
        &Request::AppendSystem {
            session: f,
            text: None,
            tools: vec![],
        },
    );
    assert!(m.contains("already has input"), "{m}");
    assert_eq!(d.wal_bytes(), wal);
    assert_serves(&d, Some(&mut c), f);
}

#[test]
fn append_message_unknown_role() {
    refused(
        |s| {
            vec![Request::AppendMessage {
                session: s,
                role: 7,
                text: "who?".into(),
            }]
        },
        "unknown role 7",
    );
}

#[test]
fn oversized_frame_closes_the_connection() {
    let d = shared_daemon();
    let (_c, s) = fixture(&d);
    let wal = d.wal_bytes();
    let mut raw = Raw::connect(&d.socket);
    raw.send_bytes(&((64u32 << 20) + 1).to_le_bytes());
    match raw.recv() {
        Some(Response::Err { message }) => assert!(message.contains("cap"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert!(
        raw.closed(),
        "the connection stays open after a bogus length"
    );
    assert_serves(&d, None, s);
    assert_eq!(d.wal_bytes(), wal);
}

#[test]
fn garbage_frame_body() {
    let d = shared_daemon();
    let (_c, s) = fixture(&d);
    let wal = d.wal_bytes();
    let mut raw = Raw::connect(&d.socket);
    // Deterministic noise (an LCG), led by a variant index past every Request.
    let mut x: u32 = 0x1234_5678;
    let mut body = vec![0xC8, 0x01];
    body.extend((0..200).map(|_| {
        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (x >> 24) as u8
    }));
    raw.send_frame(&body);
    assert!(matches!(raw.recv(), Some(Response::Err { .. })));
    // Pure noise too (whatever it decodes as, it is answered, not fatal).
    let noise: Vec<u8> = body[2..].to_vec();
    raw.send_frame(&noise);
    assert!(raw.recv().is_some());
    raw.send_request(&Request::List);
    assert!(
        matches!(raw.recv(), Some(Response::Sessions { .. })),
        "the connection broke"
    );
    assert_serves(&d, None, s);
    assert_eq!(d.wal_bytes(), wal);
}

#[test]
fn invalid_utf8_text() {
    let d = shared_daemon();
    let (_c, s) = fixture(&d);
    let wal = d.wal_bytes();
    let mut bytes = to_postcard(&Request::AppendMessage {
        session: s,
        role: Role::User.into(),
        text: "zz".into(),
    })
    .unwrap();
    // The text is the last field: its two bytes end the encoding.
    let n = bytes.len();
    assert_eq!(&bytes[n - 3..], &[2, b'z', b'z']);
    bytes[n - 2] = 0xFF;
    bytes[n - 1] = 0xFE;
    let mut raw = Raw::connect(&d.socket);
    raw.send_frame(&bytes);
    match raw.recv() {
        Some(Response::Err { message }) => assert!(message.contains("decode"), "{message}"),
        other => panic!("{other:?}"),
    }
    raw.send_request(&Request::List);
    assert!(matches!(raw.recv(), Some(Response::Sessions { .. })));
    assert_serves(&d, None, s);
    assert_eq!(d.wal_bytes(), wal);
    assert_eq!(d.read_all(s).len(), 3);
}

#[test]
fn frame_cut_off_mid_body() {
    let d = shared_daemon();
    let (_c, s) = fixture(&d);
    let wal = d.wal_bytes();
    let full = to_postcard(&Request::AppendMessage {
        session: s,
        role: Role::User.into(),
        text: "never sent whole".into(),
    })
    .unwrap();
    {
        let mut raw = Raw::connect(&d.socket);
        raw.send_bytes(&(full.len() as u32).to_le_bytes());
        raw.send_bytes(&full[..full.len() / 2]);
        // Dropping closes the connection mid-frame.
    }
    {
        let mut raw = Raw::connect(&d.socket);
        raw.send_bytes(&[5, 0]); // inside the length prefix
    }
    assert_serves(&d, None, s);
    assert_eq!(d.wal_bytes(), wal);
    assert_eq!(d.read_all(s).len(), 3);
}

/// A Generate whose input cannot fit the context is refused before anything
/// is committed: no assistant header in the log, no open turn, no `Delta`.
#[test]
fn a_generation_that_cannot_fit_leaves_the_session_as_it_was() {
    let d = shared_daemon();
    let (mut c, s) = fixture(&d);
    // Past the shared daemon's 8,192 cells (about one token a word).
    commit(
        &mut c,
        Request::AppendMessage {
            session: s,
            role: Role::User.into(),
            text: "word ".repeat(9_000),
        },
    );
    let wal = d.wal_bytes();
    let replies = c
        .generate(&Request::Generate {
            session: s,
            max_tokens: 8,
        })
        .unwrap();
    match replies.as_slice() {
        [Response::Err { message }] => {
            assert!(message.contains("does not fit the context"), "{message:?}")
        }
        other => panic!("expected one Err and nothing else, got {other:?}"),
    }
    assert_eq!(d.wal_bytes(), wal, "the refused Generate changed wal.log");
    assert_eq!(d.read_all(s).len(), 4);
    match d.call(&Request::Inspect { session: s }) {
        Response::Inspection { inspection } => {
            assert!(!inspection.open_turn && !inspection.generating)
        }
        other => panic!("Inspect {s}: {other:?}"),
    }
    assert_serves(&d, Some(&mut c), s);
}
