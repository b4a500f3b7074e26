//! The daemon as a process: durability across clean stops and SIGKILL, torn
//! tails, corruption, one daemon per directory and socket, the socket's
//! mode, and the `session inspect` CLI.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use superfluid::store::RECORD_HEADER_LEN;
use superfluid::wire::{
    from_postcard, Edit, Event, LogRecord, PurgeMode, Record, Request, Response, Role, SessionId,
};

use crate::util::{
    bin, children_of, commit, created, params, shared_daemon, wal_group_end, wal_records,
    TestDaemon,
};

const WEATHER_TOOL: &str = r#"{"type":"function","function":{"name":"get_weather","description":"Current weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}"#;

/// Everything a client can read back: Read(0) and Inspect of every session
/// id handed out (purged ones answer Err, which is compared too), Tree, List
/// and Sessions{include_archived: true}.
fn snapshot(d: &TestDaemon, max_id: SessionId) -> Vec<(Request, Response)> {
    let mut c = d.client();
    let mut reqs = vec![
        Request::Tree,
        Request::List,
        Request::Sessions {
            include_archived: true,
        },
        Request::Sessions {
            include_archived: false,
        },
    ];
    for s in 1..=max_id + 1 {
        reqs.push(Request::Read {
            session: s,
            cursor: 0,
        });
        reqs.push(Request::Inspect { session: s });
    }
    reqs.into_iter()
        .map(|r| {
            let resp = c.call(&r).unwrap();
            (r, resp)
        })
        .collect()
}

fn assert_same(before: &[(Request, Response)], after: &[(Request, Response)], when: &str) {
    assert_eq!(before.len(), after.len());
    for ((req, a), (_, b)) in before.iter().zip(after) {
        assert_eq!(a, b, "{req:?} differs {when}");
    }
}

fn len_of(d: &TestDaemon, s: SessionId) -> u64 {
    d.read_all(s).len() as u64
}

fn generation(d: &TestDaemon, s: SessionId) -> u64 {
    match d.call(&Request::Inspect { session: s }) {
        Response::Inspection { inspection } => inspection.generation,
        other => panic!("Inspect {s}: {other:?}"),
    }
}

fn msg(s: SessionId, r: u8, text: &str) -> Request {
    Request::AppendMessage {
        session: s,
        role: r,
        text: text.into(),
    }
}

fn assert_ids_count_up(events: &[Event], s: SessionId) {
    for (i, e) in events.iter().enumerate() {
        assert_eq!(
            e.event_id, i as u64,
            "session {s}: event {i} has id {}",
            e.event_id
        );
    }
}

/// Builds a tree touching every kind of record the daemon writes today.
/// Returns the largest session id handed out.
fn build_tree(d: &TestDaemon) -> SessionId {
    let mut c = d.client();
    let s1 = d.create(&mut c);
    commit(
        &mut c,
        Request::AppendSystem {
            session: s1,
            text: Some("You answer with tools.".into()),
            tools: vec![WEATHER_TOOL.into()],
        },
    );
    commit(
        &mut c,
        msg(s1, Role::User.into(), "Is it raining in Paris?"),
    );
    commit(&mut c, msg(s1, Role::Assistant.into(), "Let me check."));
    commit(&mut c, msg(s1, Role::User.into(), "And in Lyon?"));
    commit(
        &mut c,
        Request::Append {
            session: s1,
            text: Some("raw text\n".into()),
            span: vec![],
        },
    );
    let raw = commit(
        &mut c,
        Request::Append {
            session: s1,
            text: None,
            span: vec![1, 2, 3, 500],
        },
    );
    assert_eq!(raw.body.span(), &[1, 2, 3, 500]);
    commit(
        &mut c,
        Request::SetQos {
            session: s1,
            class: 2,
            batch_invariant: true,
        },
    );
    let n1 = len_of(d, s1);
    assert_eq!(n1, 8);

    // Fork at the end: keeps everything.
    let f_end = created(
        &mut c,
        Request::Fork {
            session: s1,
            at_event: n1,
            params: None,
        },
    );
    commit(&mut c, msg(f_end, Role::User.into(), "forked at the end"));
    // Fork in the middle, with its own params.
    let f_mid = created(
        &mut c,
        Request::Fork {
            session: s1,
            at_event: 3,
            params: Some(params(7)),
        },
    );
    commit(
        &mut c,
        msg(f_mid, Role::Assistant.into(), "a different answer"),
    );
    // Rebase: drop event 2, replace event 4 with a new user message.
    let rb = created(
        &mut c,
        Request::Rebase {
            session: s1,
            edits: vec![
                Edit::Drop { from: 2, to: 3 },
                Edit::Replace {
                    from: 4,
                    to: 5,
                    role: Role::User.into(),
                    text: "And in Nice?".into(),
                },
            ],
            params: None,
        },
    );
    commit(&mut c, msg(rb, Role::Assistant.into(), "Sunny."));
    let tr = created(
        &mut c,
        Request::Trim {
            session: s1,
            to_event: 5,
        },
    );
    // A session created under s1 (tree only).
    let under = created(
        &mut c,
        Request::Create {
            parent: Some(s1),
            params: params(3),
        },
    );
    commit(&mut c, msg(under, Role::User.into(), "child"));
    // Meta.
    match c
        .call(&Request::SetMeta {
            session: s1,
            expected_version: 0,
            title: Some("weather".into()),
            archived: None,
        })
        .unwrap()
    {
        Response::Meta { version } => assert_eq!(version, 1),
        other => panic!("{other:?}"),
    }
    match c
        .call(&Request::SetMeta {
            session: f_end,
            expected_version: 0,
            title: None,
            archived: Some(true),
        })
        .unwrap()
    {
        Response::Meta { version } => assert_eq!(version, 1),
        other => panic!("{other:?}"),
    }
    // Purge with Cascade: s2 and its fork chain go.
    let s2 = d.create(&mut c);
    commit(&mut c, msg(s2, Role::User.into(), "to be purged"));
    let s2a = created(
        &mut c,
        Request::Fork {
            session: s2,
            at_event: 2,
            params: None,
        },
    );
    let s2b = created(
        &mut c,
        Request::Fork {
            session: s2a,
            at_event: 3,
            params: None,
        },
    );
    match c
        .call(&Request::Purge {
            session: s2,
            expected_generation: generation(d, s2),
            mode: PurgeMode::Cascade,
        })
        .unwrap()
    {
        Response::Purged { mut sessions } => {
            sessions.sort();
            assert_eq!(sessions, vec![s2, s2a, s2b]);
        }
        other => panic!("{other:?}"),
    }
    // Purge with Reroot: s3 goes, its fork stays and reads back whole.
    let s3 = d.create(&mut c);
    commit(&mut c, msg(s3, Role::User.into(), "parent of a survivor"));
    let s3a = created(
        &mut c,
        Request::Fork {
            session: s3,
            at_event: 2,
            params: None,
        },
    );
    commit(&mut c, msg(s3a, Role::Assistant.into(), "I survive"));
    let s3_events = d.read_all(s3);
    match c
        .call(&Request::Purge {
            session: s3,
            expected_generation: generation(d, s3),
            mode: PurgeMode::Reroot,
        })
        .unwrap()
    {
        Response::Purged { sessions } => assert_eq!(sessions, vec![s3]),
        other => panic!("{other:?}"),
    }
    let s3a_events = d.read_all(s3a);
    assert_eq!(s3a_events.len(), 4); // 0, 1, Forked (2), the reply (3)
    assert_eq!(
        s3a_events[..2],
        s3_events[..2],
        "a rerooted fork keeps its purged parent's events"
    );

    // Ids count up from 0, and forks share their parent's ids and events.
    let e1 = d.read_all(s1);
    for s in [s1, f_end, f_mid, rb, tr, under, s3a] {
        assert_ids_count_up(&d.read_all(s), s);
    }
    let fe = d.read_all(f_end);
    assert_eq!(
        fe[..e1.len()],
        e1[..],
        "a fork at the end holds all its parent's events"
    );
    assert!(matches!(
        fe[e1.len()].body,
        Record::Forked { fork_at: 8, .. }
    ));
    let fm = d.read_all(f_mid);
    assert_eq!(fm[..3], e1[..3]);
    assert_eq!(
        fm[3].event_id, 3,
        "Fork{{at_event: 3}}'s Forked header gets id 3"
    );
    assert!(matches!(fm[3].body, Record::Forked { fork_at: 3, .. }));
    let r = d.read_all(rb);
    assert_eq!(r[..2], e1[..2]);
    assert_eq!(r[2].event_id, 2, "Rebased gets the first edit's from");
    assert!(matches!(r[2].body, Record::Rebased { fork_at: 2, .. }));
    // After the header: parent's 3 (kept), Replace of 4, then 5.. of the parent.
    assert_eq!(r[3].body, e1[3].body);
    assert!(matches!(&r[4].body, Record::Message { text, .. } if text == "And in Nice?"));
    for (k, pe) in e1[5..].iter().enumerate() {
        assert_eq!(r[5 + k].body, pe.body);
    }
    assert_eq!(
        r.len(),
        e1.len() + 1 /* header */ - 1 /* dropped */ + 1 /* Sunny */
    );
    let t = d.read_all(tr);
    assert_eq!(t[..5], e1[..5]);
    assert_eq!(t.len(), 6);

    // Inspect agrees with Read: event count and tokens.
    for s in [s1, f_end, f_mid, rb, tr, under, s3a] {
        let events = d.read_all(s);
        match d.call(&Request::Inspect { session: s }) {
            Response::Inspection { inspection: i } => {
                assert_eq!(i.events, events.len() as u64, "session {s}");
                let tokens: u64 = events.iter().map(|e| e.body.span().len() as u64).sum();
                assert_eq!(
                    i.tokens, tokens,
                    "session {s}: Inspect's tokens vs the spans of Read"
                );
                assert!(!i.purged);
            }
            other => panic!("{other:?}"),
        }
    }
    // The tree: purged sessions are gone, the rerooted fork is a root, a
    // session created under s1 has a parent and no fork point.
    match d.call(&Request::Tree) {
        Response::Tree { nodes } => {
            let ids: Vec<SessionId> = nodes.iter().map(|n| n.0).collect();
            for gone in [s2, s2a, s2b, s3] {
                assert!(!ids.contains(&gone), "purged session {gone} in the tree");
            }
            assert!(nodes.contains(&(s3a, None, None)), "{nodes:?}");
            assert!(nodes.contains(&(under, Some(s1), None)), "{nodes:?}");
            assert!(nodes.contains(&(f_mid, Some(s1), Some(3))), "{nodes:?}");
            assert!(nodes.contains(&(rb, Some(s1), Some(2))), "{nodes:?}");
        }
        other => panic!("{other:?}"),
    }
    match d.call(&Request::Sessions {
        include_archived: false,
    }) {
        Response::SessionList { sessions } => {
            assert!(
                sessions.iter().all(|x| x.session != f_end),
                "archived session listed"
            );
            assert!(sessions
                .iter()
                .any(|x| x.session == s1 && x.title.as_deref() == Some("weather")));
        }
        other => panic!("{other:?}"),
    }
    s3a.max(under)
}

#[test]
fn restart_reads_back_identically() {
    let mut d = TestDaemon::start();
    let max_id = build_tree(&d);
    let before = snapshot(&d, max_id);
    d.restart();
    assert_same(&before, &snapshot(&d, max_id), "after a clean restart");
    d.kill9();
    d.spawn_and_wait();
    assert_same(&before, &snapshot(&d, max_id), "after SIGKILL and restart");
    assert!(d.stdout().contains("epoch 3"), "stdout: {}", d.stdout());
    // New events carry the new epoch: three starts so far.
    let mut c = d.client();
    let e = commit(&mut c, msg(1, Role::User.into(), "after two restarts"));
    assert_eq!(e.epoch, 3);
    assert!(before.iter().any(|(_, r)| matches!(r, Response::Events { events } if events.iter().all(|e| e.epoch == 1) && !events.is_empty())));
}

#[test]
fn torn_tail_at_every_offset() {
    let mut d = TestDaemon::start();
    let mut c = d.client();
    let s = d.create(&mut c);
    commit(&mut c, msg(s, Role::User.into(), "first"));
    commit(&mut c, msg(s, Role::Assistant.into(), "second"));
    let other = d.create(&mut c);
    commit(&mut c, msg(other, Role::User.into(), "untouched"));
    commit(&mut c, msg(s, Role::User.into(), "ok"));
    drop(c);
    let full_s = d.read_all(s);
    let full_other = d.read_all(other);
    d.stop();

    let original = d.wal_bytes();
    let records = wal_records(&original);
    let &(last_start, last_end) = records.last().unwrap();
    assert_eq!(
        wal_group_end(&original, last_end),
        original.len(),
        "the log ends with a whole record (and its group's marker)"
    );
    match from_postcard::<LogRecord>(&original[last_start + RECORD_HEADER_LEN..last_end]).unwrap() {
        LogRecord::Events { session, events } => {
            assert_eq!(session, s);
            assert!(matches!(&events[0].body, Record::Message { text, .. } if text == "ok"));
        }
        other => panic!("the last record is {other:?}"),
    }
    let expected_s = &full_s[..full_s.len() - 1];

    for len in last_start..original.len() {
        std::fs::write(d.wal_path(), &original[..len]).unwrap();
        // A torn write is a power cut before the writer recorded this end
        // as acknowledged (the previous start, idle, may have recorded its
        // own Boot's).
        let _ = std::fs::remove_file(d.sessions.join("wal.acked"));
        d.spawn_and_wait();
        assert_eq!(d.read_all(s), expected_s, "cut at {len}");
        assert_eq!(d.read_all(other), full_other, "cut at {len}");
        let stderr = d.stderr();
        if len > last_start {
            assert!(
                stderr.contains("torn tail")
                    && stderr.contains(&format!("byte offset {last_start}")),
                "cut at {len}: the truncation is not logged; stderr:\n{stderr}"
            );
        } else {
            assert!(
                !stderr.contains("torn tail"),
                "a whole log is not torn:\n{stderr}"
            );
        }
        d.kill9();
        let now = d.wal_bytes();
        assert_eq!(
            now[..last_start],
            original[..last_start],
            "cut at {len}: valid records changed"
        );
        // What follows is this start's Boot record, whole.
        let rest = wal_records(&now);
        assert_eq!(
            wal_group_end(&now, rest.last().unwrap().1),
            now.len(),
            "cut at {len}: the tail was not truncated"
        );
        assert_eq!(rest.len(), records.len(), "cut at {len}");
    }
}

/// Flips a bit in the middle of the payload of the record at `start..end`
/// of `bytes` (the daemon's log) and writes the log back.
fn flip_payload_bit(d: &TestDaemon, bytes: &mut [u8], (start, end): (usize, usize)) {
    let payload = start + RECORD_HEADER_LEN;
    bytes[payload + (end - payload) / 2] ^= 0x10;
    std::fs::write(d.wal_path(), &*bytes).unwrap();
}

/// The spec: a complete record that fails its checksum refuses the start.
/// A flipped byte in the log's last record, one the client was answered
/// for, was dropped as a torn tail and the event lost; the writer's
/// acknowledged end (`wal.acked`) now tells it from a torn write, after a
/// clean stop and after a SIGKILL once the writer had been idle.
#[test]
fn flipped_bit_in_the_acknowledged_last_record_refuses_start() {
    for kill in [false, true] {
        let mut d = TestDaemon::start();
        let mut c = d.client();
        let s = d.create(&mut c);
        commit(
            &mut c,
            msg(
                s,
                Role::User.into(),
                "the last message, which the client saw",
            ),
        );
        drop(c);
        if kill {
            // The writer records its end once idle for 200 ms.
            std::thread::sleep(std::time::Duration::from_millis(1000));
            d.kill9();
        } else {
            d.stop();
        }
        let mut bytes = d.wal_bytes();
        let records = wal_records(&bytes);
        let (start, end) = *records.last().unwrap();
        assert_eq!(wal_group_end(&bytes, end), bytes.len(), "the last group");
        flip_payload_bit(&d, &mut bytes, (start, end));
        let failed = d.start_expect_exit(&[]);
        assert!(
            !failed.status.success()
                && failed
                    .stderr
                    .contains(&format!("corrupt at byte offset {start}")),
            "kill {kill}: {}",
            failed.stderr
        );
        assert_eq!(d.wal_bytes(), bytes, "a refused start changed wal.log");
    }
}

#[test]
fn flipped_bit_in_non_final_record_refuses_start() {
    let mut d = TestDaemon::start();
    let mut c = d.client();
    let s = d.create(&mut c);
    commit(
        &mut c,
        msg(
            s,
            Role::User.into(),
            "a message long enough to flip a bit in",
        ),
    );
    commit(
        &mut c,
        msg(s, Role::Assistant.into(), "and a reply after it"),
    );
    drop(c);
    d.stop();
    let mut bytes = d.wal_bytes();
    let records = wal_records(&bytes);
    // Records: Boot, Created, Message, Message. Corrupt the first Message.
    assert_eq!(records.len(), 4);
    let (start, end) = records[2];
    flip_payload_bit(&d, &mut bytes, (start, end));

    let failed = d.start_expect_exit(&[]);
    assert!(
        !failed.status.success(),
        "started on a corrupt log: {}",
        failed.stderr
    );
    assert!(
        failed.stderr.contains(&format!("byte offset {start}")),
        "stderr does not name offset {start}:\n{}",
        failed.stderr
    );
    assert!(
        failed.stderr.contains("--sessions-cache"),
        "{}",
        failed.stderr
    );
    assert_eq!(d.wal_bytes(), bytes, "a refused start changed wal.log");

    d.extra_args = vec!["--sessions-cache".into()];
    d.spawn_and_wait();
    assert_eq!(
        std::fs::read(d.sessions.join("wal.log.prev")).unwrap(),
        bytes
    );
    assert_eq!(d.call(&Request::List), Response::Sessions { ids: vec![] });
    assert!(matches!(
        d.call(&Request::Read {
            session: s,
            cursor: 0
        }),
        Response::Err { .. }
    ));
}

#[test]
fn second_daemon_on_same_sessions_dir_is_refused() {
    let mut d = TestDaemon::start();
    let pid = d.pid();
    let mut c = d.client();
    let s = d.create(&mut c);
    let wal = d.wal_bytes();

    // Same sessions dir, another socket.
    let (sessions, other_socket) = (d.sessions.clone(), d.path().join("other.sock"));
    d.start_other_expect_exit(&sessions, &other_socket, &[])
        .assert_locked_by(pid);
    assert!(!other_socket.exists());
    assert_eq!(d.wal_bytes(), wal);

    // Same socket, another sessions dir.
    let (other_sessions, socket) = (d.path().join("other-sessions"), d.socket.clone());
    let failed = d.start_other_expect_exit(&other_sessions, &socket, &[]);
    assert!(!failed.status.success());
    assert!(failed.stderr.contains("listening on"), "{}", failed.stderr);

    // The first daemon still serves, on its socket, on the same connection.
    assert!(matches!(
        c.call(&Request::Inspect { session: s }).unwrap(),
        Response::Inspection { .. }
    ));
    assert_eq!(d.call(&Request::List), Response::Sessions { ids: vec![s] });
}

#[test]
fn stale_socket_file_is_replaced() {
    let mut d = TestDaemon::new();
    drop(std::os::unix::net::UnixListener::bind(&d.socket).unwrap());
    assert!(d.socket.exists());
    d.spawn_and_wait();
    assert_eq!(d.call(&Request::List), Response::Sessions { ids: vec![] });
}

#[test]
fn socket_is_private() {
    let d = shared_daemon();
    let mode = std::fs::metadata(&d.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}");
}

#[test]
fn clean_stop_removes_the_socket() {
    let mut d = TestDaemon::start();
    d.stop();
    assert!(!d.socket.exists());
}

#[test]
fn inspect_cli() {
    let d = shared_daemon();
    let mut c = d.client();
    let s = d.create(&mut c);
    commit(&mut c, msg(s, Role::User.into(), "hello\nthere"));
    commit(&mut c, msg(s, Role::Assistant.into(), "hi"));
    c.call(&Request::SetMeta {
        session: s,
        expected_version: 0,
        title: Some("greeting".into()),
        archived: None,
    })
    .unwrap();
    let run = |json: bool| {
        let mut cmd = Command::new(bin());
        cmd.args(["session", "inspect", &s.to_string(), "--socket"])
            .arg(&d.socket);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let text = run(false);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert!(
        lines[0].starts_with(&format!("session {s}: 3 events,")),
        "{text}"
    );
    assert!(lines[0].contains("title \"greeting\""), "{text}");
    assert!(lines[1].trim_start().starts_with("0  Created"), "{text}");
    assert!(
        lines[2].contains("Message user \"hello\\\\nthere\""),
        "{text}"
    );
    assert!(
        lines[3].trim_start().starts_with("2  Message assistant"),
        "{text}"
    );

    let json = run(true);
    let values: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert_eq!(values.len(), 4, "{json}");
    assert_eq!(values[0]["session"], s);
    assert_eq!(values[0]["events"], 3);
    for (i, v) in values[1..].iter().enumerate() {
        assert_eq!(v["event_id"], i);
    }

    // An unknown session: non-zero exit and the daemon's message.
    let out = Command::new(bin())
        .args(["session", "inspect", "999999", "--socket"])
        .arg(&d.socket)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown session 999999"));
}

/// 16 clients append to their own sessions while the daemon is SIGKILLed:
/// every event a client was told is Committed reads back identically.
///
/// Every client has created its session before any appends, then appends
/// until the daemon dies under it, so the SIGKILL lands while all 16 are
/// appending: each client's appends end cut off by the kill, and at least
/// `BEFORE_KILL` had been committed before it.
#[test]
fn sigkill_under_concurrent_appends_loses_nothing_committed() {
    const CLIENTS: usize = 16;
    /// Committed appends to wait for before the SIGKILL.
    const BEFORE_KILL: usize = 100;
    /// A client that gets this far was never cut off: the test fails.
    const MAX_MESSAGES: usize = 100_000;
    let mut d = TestDaemon::start();
    // Every client creates its session before any client appends.
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let mut c = d.client();
            let s = created(
                &mut c,
                Request::Create {
                    parent: None,
                    params: params(i as u64),
                },
            );
            (c, s)
        })
        .collect();
    let committed = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, (mut c, s))| {
            let committed = committed.clone();
            std::thread::spawn(move || {
                let mut seen: Vec<Event> = Vec::new();
                for m in 0..MAX_MESSAGES {
                    let r = if m % 2 == 0 {
                        Role::User
                    } else {
                        Role::Assistant
                    };
                    match c.call(&msg(s, r.into(), &format!("client {i} message {m}"))) {
                        Ok(Response::Committed { event }) => {
                            committed.fetch_add(1, Ordering::SeqCst);
                            seen.push(event)
                        }
                        Ok(other) => panic!("client {i}: {other:?}"),
                        // The daemon died under this client.
                        Err(_) => return (s, seen),
                    }
                }
                panic!("client {i}: {MAX_MESSAGES} appends and the daemon was never killed");
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while committed.load(Ordering::SeqCst) < BEFORE_KILL {
        assert!(
            Instant::now() < deadline,
            "only {} appends committed in 60 s",
            committed.load(Ordering::SeqCst)
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    d.kill9();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let total = committed.load(Ordering::SeqCst);
    eprintln!("{total} appends committed before SIGKILL");
    assert!(total >= BEFORE_KILL, "{total} appends committed");
    assert_eq!(
        results.iter().map(|(_, seen)| seen.len()).sum::<usize>(),
        total,
        "every Committed reply is held by its client"
    );
    d.spawn_and_wait();
    let mut by_session: BTreeMap<SessionId, Vec<Event>> = BTreeMap::new();
    for (s, seen) in results {
        assert!(
            by_session.insert(s, seen).is_none(),
            "session {s} handed out twice"
        );
    }
    assert_eq!(by_session.len(), CLIENTS);
    for (s, seen) in &by_session {
        let events = d.read_all(*s);
        assert_ids_count_up(&events, *s);
        for e in seen {
            assert_eq!(
                events.get(e.event_id as usize),
                Some(e),
                "session {s}: committed event {} is lost or changed",
                e.event_id
            );
        }
    }
}

/// Whether `pid` is still a live process (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let state = s.rsplit_once(')').map(|x| x.1).unwrap_or_default();
            !state.trim_start().starts_with('Z')
        })
        .unwrap_or(false)
}

#[test]
fn the_worker_dies_with_a_killed_daemon() {
    let mut d = TestDaemon::start();
    // Its worker once exec'd (its command line names `worker`).
    let is_worker = |p: &u32| {
        std::fs::read(format!("/proc/{p}/cmdline"))
            .is_ok_and(|c| c.split(|&b| b == 0).any(|a| a == b"worker"))
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let workers = loop {
        let w: Vec<u32> = children_of(d.pid()).into_iter().filter(is_worker).collect();
        if !w.is_empty() || Instant::now() > deadline {
            break w;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!workers.is_empty(), "the daemon has no worker");
    // A stopped worker cannot notice its pipe closing: only the kernel's
    // parent-death signal (SIGKILL, which a stopped process still takes)
    // ends it.
    for &w in &workers {
        // SAFETY: plain kill(2) on the test daemon's own worker.
        unsafe { libc::kill(w as libc::pid_t, libc::SIGSTOP) };
    }
    d.kill9();
    let deadline = Instant::now() + Duration::from_secs(10);
    while workers.iter().any(|&w| alive(w)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let survivors: Vec<u32> = workers.iter().copied().filter(|&w| alive(w)).collect();
    for &w in &survivors {
        // SAFETY: as above; cleaning up what the test failed to see die.
        unsafe { libc::kill(w as libc::pid_t, libc::SIGKILL) };
    }
    assert!(
        survivors.is_empty(),
        "a worker outlived its SIGKILLed daemon"
    );
}

#[test]
fn a_file_at_the_socket_path_is_never_replaced() {
    let mut d = TestDaemon::new();
    std::fs::write(&d.socket, b"the user's notes").unwrap();
    let failed = d.start_expect_exit(&[]);
    assert!(
        failed.stderr.contains("is not a socket"),
        "{}",
        failed.stderr
    );
    assert_eq!(std::fs::read(&d.socket).unwrap(), b"the user's notes");
}

/// A start that cannot write the web token (a full disk; here a directory
/// in its place) fails before it commits a `Boot` or says "serving", with
/// the reason and no panic: it printed "serving", committed a Boot (an
/// epoch used up at each try) and panicked in actix's teardown ("there is
/// no reactor running") before the reason.
#[test]
fn a_start_that_cannot_write_the_web_token_fails_before_it_boots() {
    let mut d = TestDaemon::new();
    std::fs::create_dir_all(d.sessions.join("web-token")).unwrap();
    let failed = d.start_expect_exit(&["--web".into(), "127.0.0.1:0".into()]);
    assert!(!failed.status.success());
    assert!(
        failed.stderr.contains("cannot write the web token") && !failed.stderr.contains("panicked"),
        "{}",
        failed.stderr
    );
    let boots = crate::util::wal_records(&d.wal_bytes()).len();
    assert_eq!(boots, 0, "a failed start committed {boots} records");
}

#[test]
fn stop_leaves_a_socket_another_process_bound_since() {
    let mut d = TestDaemon::start();
    // Someone else took the path after our daemon bound it.
    std::fs::rename(&d.socket, d.path().join("moved.sock")).unwrap();
    let theirs = std::os::unix::net::UnixListener::bind(&d.socket).unwrap();
    d.stop();
    assert!(
        std::os::unix::net::UnixStream::connect(&d.socket).is_ok(),
        "the daemon removed a socket it did not bind"
    );
    drop(theirs);
}

/// Flags the worker cannot start with are refused at start, naming the
/// flag: a --batch below --parallel + 1 (llama.cpp asserts on it) and a
/// --mmproj that is not a vision projector each made the daemon say it was
/// serving while its worker died and was started again, over and over.
#[test]
fn flags_the_worker_cannot_start_with_are_refused_at_start() {
    let mut d = TestDaemon::new();
    let model = crate::util::model_path().display().to_string();
    for (args, said) in [
        (
            vec!["--parallel", "8", "--batch", "8"],
            "--batch 8 (capped at --ctx-size",
        ),
        (
            vec!["--ctx-size", "64", "--parallel", "64"],
            "must be at least --parallel 64 + 1",
        ),
        (
            vec!["--mmproj", model.as_str()],
            "not a vision projector (its general.architecture is llama, not clip)",
        ),
    ] {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let failed = d.start_expect_exit(&args);
        assert!(
            !failed.status.success() && failed.stderr.contains(said),
            "{args:?}: {}",
            failed.stderr
        );
    }
    // One more than --parallel is enough.
    d.extra_args = ["--parallel", "8", "--batch", "9"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    d.spawn_and_wait();
    let mut c = d.client();
    let s = d.create(&mut c);
    commit(&mut c, msg(s, Role::User.into(), "Hi."));
    crate::util::generate_text(&mut c, s, 2).expect("the worker runs");
}

/// A sessions directory other users may write in is refused before
/// anything is written there (they could plant a link where the daemon
/// writes); files of the directory another copy left open to other users
/// are set back to 0600; a link planted in place of a temp file is not
/// followed. A security audit overwrote a file through web-addr.tmp.
#[test]
fn the_sessions_directory_is_the_users_alone() {
    use std::os::unix::fs::PermissionsExt;
    let mut d = TestDaemon::new();
    std::fs::create_dir(&d.sessions).unwrap();
    std::fs::set_permissions(&d.sessions, std::fs::Permissions::from_mode(0o777)).unwrap();
    let failed = d.start_expect_exit(&[]);
    assert!(
        !failed.status.success()
            && failed.stderr.contains("writable by other users (mode 777)")
            && failed.stderr.contains("chmod 700"),
        "{}",
        failed.stderr
    );
    assert_eq!(std::fs::read_dir(&d.sessions).unwrap().count(), 0);

    std::fs::set_permissions(&d.sessions, std::fs::Permissions::from_mode(0o700)).unwrap();
    d.extra_args = vec!["--web".into(), "127.0.0.1:0".into()];
    d.spawn_and_wait();
    d.stop();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let loose = ["wal.log", "wal.acked", "lock", "response-key"];
    for name in loose {
        let p = d.sessions.join(name);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let victim = d.path().join("victim");
    std::fs::write(&victim, "precious").unwrap();
    std::os::unix::fs::symlink(&victim, d.sessions.join("web-addr.tmp")).unwrap();
    d.spawn_and_wait();
    for name in loose {
        let p = d.sessions.join(name);
        assert_eq!(mode(&p), 0o600, "{name}; stderr:\n{}", d.stderr());
        assert!(
            d.stderr().contains(&format!(
                "{} was open to other users (mode 644)",
                p.display()
            )),
            "{name}: {}",
            d.stderr()
        );
    }
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    let addr = d.sessions.join("web-addr");
    assert!(std::fs::symlink_metadata(&addr).unwrap().is_file());
}

/// The spec's recipe: "To give the model a past turn in the template's
/// form, rebase its Generated events into one assistant message holding the
/// text." The branch's tokens are the template's rendering of the same two
/// messages: the Replace takes in the turn's header (GenerationPrompt),
/// which stayed and made an empty assistant turn before the message.
#[test]
fn a_generated_turn_rebased_into_one_message_takes_the_templates_form() {
    let d = shared_daemon();
    let mut c = d.client();
    let s = d.create(&mut c);
    commit(&mut c, msg(s, Role::User.into(), "Say hi."));
    let text = crate::util::generate_text(&mut c, s, 12).expect("generated");
    let events = crate::util::read_events(&mut c, s);
    let first = events
        .iter()
        .find(|e| matches!(e.body, Record::Generated { .. }))
        .expect("a Generated event")
        .event_id;
    assert!(matches!(
        events[first as usize - 1].body,
        Record::GenerationPrompt { .. }
    ));
    let b = created(
        &mut c,
        Request::Rebase {
            session: s,
            edits: vec![Edit::Replace {
                from: first,
                to: events.len() as u64,
                role: Role::Assistant.into(),
                text: text.clone(),
            }],
            params: None,
        },
    );
    let reference = d.create(&mut c);
    commit(&mut c, msg(reference, Role::User.into(), "Say hi."));
    commit(&mut c, msg(reference, Role::Assistant.into(), &text));
    let tokens = |c: &mut superfluid::frontend::socket::Client, s| {
        crate::util::read_events(c, s)
            .iter()
            .flat_map(|e| e.body.span().to_vec())
            .collect::<Vec<_>>()
    };
    assert_eq!(tokens(&mut c, b), tokens(&mut c, reference));
    // The branch's record names the edit as applied.
    let branch = crate::util::read_events(&mut c, b);
    let applied = branch.iter().find_map(|e| match &e.body {
        Record::Rebased { edits, .. } => Some(edits.clone()),
        _ => None,
    });
    assert!(
        matches!(applied.as_deref(), Some([Edit::Replace { from, .. }]) if *from == first - 1),
        "{applied:?}"
    );
}
