//! `superfluid session export` against a real daemon: jsonl and otlp-jsonl
//! files of a session and its fork (inherited events marked), content only
//! with `--include-content` and then redacted, the OTLP/HTTP push to a
//! receiver this test runs, and the content-egress refusal before anything
//! is sent. clients/python/tests/test_export_otlp.py checks the pushed
//! bodies against the official OTLP schema.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;
use superfluid::frontend::socket::Client;
use superfluid::wire::{Record, Request, Response, Role, SessionId};

use crate::util::{bin, commit, created, shared_daemon, TestDaemon};

const SECRET: &str = "AKIAIOSFODNN7EXAMPLE";
const MARKER: &str = "[REDACTED:aws_access_key_id]";

fn user(c: &mut Client, s: SessionId, text: &str) {
    commit(
        c,
        Request::AppendMessage {
            session: s,
            role: Role::User.into(),
            text: text.into(),
        },
    );
}

fn generate(c: &mut Client, s: SessionId, max_tokens: u32) {
    let replies = c
        .generate(&Request::Generate {
            session: s,
            max_tokens,
        })
        .unwrap();
    assert!(
        matches!(replies.last(), Some(Response::Generated { .. })),
        "{replies:?}"
    );
}

/// A session with a secret in its prompt and a generation, and a fork of
/// it with one more turn; returns (session, fork, the fork's header id).
fn session_and_fork(d: &TestDaemon) -> (SessionId, SessionId, u64) {
    let mut c = d.client();
    let s = d.create(&mut c);
    user(&mut c, s, &format!("My key is {SECRET}. Say hi."));
    generate(&mut c, s, 8);
    let at = d.read_all(s).len() as u64;
    let f = created(
        &mut c,
        Request::Fork {
            session: s,
            at_event: at,
            params: None,
        },
    );
    user(&mut c, f, "And again.");
    generate(&mut c, f, 4);
    (s, f, at)
}

fn export(d: &TestDaemon, args: &[&str]) -> Output {
    Command::new(bin())
        .args(["session", "export"])
        .args(args)
        .arg("--socket")
        .arg(&d.socket)
        .output()
        .unwrap()
}

fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

/// An export over a file others can read leaves it the owner's only; over
/// a symbolic link it is refused, and the link's target is untouched.
#[test]
fn an_export_is_private_over_an_old_file_and_refused_through_a_link() {
    let d = shared_daemon();
    let (s, f, _) = session_and_fork(&d);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("exports");
    let run = |id: SessionId| {
        export(
            &d,
            &[
                &id.to_string(),
                "--format",
                "jsonl",
                "--out",
                out.to_str().unwrap(),
            ],
        )
    };
    ok(&run(f));
    let path = out.join(format!("session-{f}.jsonl"));
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    // Someone who could read the old file holds it open.
    let mut held = std::fs::File::open(&path).unwrap();
    ok(&run(f));
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    // The export is a new file: the old one, as held, is as it was.
    let mut old = String::new();
    held.read_to_string(&mut old).unwrap();
    assert_eq!(old, std::fs::read_to_string(&path).unwrap());
    let target_of_old = std::fs::metadata(&path).unwrap();
    assert_ne!(
        std::os::unix::fs::MetadataExt::ino(&held.metadata().unwrap()),
        std::os::unix::fs::MetadataExt::ino(&target_of_old)
    );
    let target = dir.path().join("elsewhere");
    std::fs::write(&target, "not an export").unwrap();
    std::os::unix::fs::symlink(&target, out.join(format!("session-{s}.jsonl"))).unwrap();
    let again = run(s);
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("symbolic link"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "not an export");
}

#[test]
fn jsonl_of_a_fork_marks_inherited_events_and_leaves_content_out() {
    let d = shared_daemon();
    let (s, f, at) = session_and_fork(&d);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("exports");
    ok(&export(
        &d,
        &[
            &s.to_string(),
            &f.to_string(),
            "--format",
            "jsonl",
            "--out",
            out.to_str().unwrap(),
        ],
    ));
    let events = d.read_all(f);
    let path = out.join(format!("session-{f}.jsonl"));
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let got = lines(&path);
    assert_eq!(got.len(), events.len(), "one line per event");
    for (line, e) in got.iter().zip(&events) {
        assert_eq!(line["v"], 1);
        assert_eq!(line["session"], f);
        assert_eq!(line["event_id"], e.event_id);
        assert_eq!(line["epoch"], e.epoch);
        assert_eq!(line["ts_unix_ms"], e.ts_unix_ms);
        assert_eq!(line["record"], e.body.name());
        assert_eq!(line["tokens"], e.body.span().len());
        assert_eq!(line["content"], false);
        let inherited = e.event_id < at;
        assert_eq!(line["inherited"], inherited, "{line}");
        assert_eq!(
            line["inherited_from"],
            if inherited {
                Value::from(s)
            } else {
                Value::Null
            }
        );
        assert!(line["fields"].get("text").is_none(), "{line}");
        assert!(line["fields"].get("span").is_none(), "{line}");
    }
    assert_eq!(got[at as usize]["record"], "Forked");
    assert_eq!(got[at as usize]["fields"]["parent"], s);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(!text.contains("Say hi") && !text.contains(SECRET), "{text}");
    // The parent's own file: nothing inherited.
    let parent = lines(&out.join(format!("session-{s}.jsonl")));
    assert_eq!(parent.len(), d.read_all(s).len());
    assert!(parent.iter().all(|l| l["inherited"] == false));
}

#[test]
fn jsonl_with_content_is_redacted() {
    let d = shared_daemon();
    let (s, _, _) = session_and_fork(&d);
    let dir = tempfile::tempdir().unwrap();
    let out = export(
        &d,
        &[
            &s.to_string(),
            "--include-content",
            "--out",
            dir.path().to_str().unwrap(),
        ],
    );
    ok(&out);
    assert!(String::from_utf8_lossy(&out.stderr).contains("secrets redacted: "));
    let got = lines(&dir.path().join(format!("session-{s}.jsonl")));
    let message = got.iter().find(|l| l["record"] == "Message").unwrap();
    assert_eq!(
        message["fields"]["text"],
        format!("My key is {MARKER}. Say hi.")
    );
    assert_eq!(message["redactions"], 1);
    assert_eq!(message["content"], true);
    let generated: String = got
        .iter()
        .filter(|l| l["record"] == "Generated")
        .map(|l| l["fields"]["text"].as_str().unwrap().to_string())
        .collect();
    let expected: String = d
        .read_all(s)
        .iter()
        .filter_map(|e| match &e.body {
            Record::Generated { text, .. } => Some(text.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(generated, expected);
    let text = std::fs::read_to_string(dir.path().join(format!("session-{s}.jsonl"))).unwrap();
    assert!(!text.contains(SECRET));
}

fn attr<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)
        .map(|a| &a["value"])
}

#[test]
fn otlp_jsonl_has_a_span_per_generation_with_gen_ai_attributes() {
    let d = shared_daemon();
    let (s, f, _) = session_and_fork(&d);
    let dir = tempfile::tempdir().unwrap();
    ok(&export(
        &d,
        &[
            &f.to_string(),
            "--format",
            "otlp-jsonl",
            "--model",
            "smollm2",
            "--out",
            dir.path().to_str().unwrap(),
        ],
    ));
    let got = lines(&dir.path().join(format!("session-{f}.otlp.jsonl")));
    assert_eq!(got.len(), 1, "one ExportTraceServiceRequest per session");
    let spans = got[0]["resourceSpans"][0]["scopeSpans"][0]["spans"]
        .as_array()
        .unwrap();
    assert_eq!(spans.len(), 3, "the session and its two generations");
    let events = d.read_all(f);
    let generated_tokens = |from: usize, to: usize| -> u64 {
        events[from..to]
            .iter()
            .filter(|e| matches!(e.body, Record::Generated { .. }))
            .map(|e| e.body.span().len() as u64)
            .sum()
    };
    let prompts: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(e.body, Record::GenerationPrompt { .. }))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(prompts.len(), 2);
    let expected_output = [
        generated_tokens(prompts[0], prompts[1]),
        generated_tokens(prompts[1], events.len()),
    ];
    let input_before = |i: usize| -> u64 {
        events[..=i]
            .iter()
            .map(|e| e.body.span().len() as u64)
            .sum()
    };
    for (k, span) in spans[1..].iter().enumerate() {
        assert_eq!(span["name"], "chat smollm2");
        assert_eq!(span["parentSpanId"], spans[0]["spanId"]);
        assert_eq!(
            attr(span, "gen_ai.conversation.id").unwrap()["stringValue"],
            f.to_string()
        );
        assert_eq!(
            attr(span, "gen_ai.usage.output_tokens").unwrap()["intValue"],
            expected_output[k].to_string()
        );
        assert_eq!(
            attr(span, "gen_ai.usage.input_tokens").unwrap()["intValue"],
            input_before(prompts[k]).to_string()
        );
        let reason = &attr(span, "gen_ai.response.finish_reasons").unwrap()["arrayValue"]["values"]
            [0]["stringValue"];
        assert!(reason == "stop" || reason == "length", "{reason}");
        assert!(attr(span, "gen_ai.input.messages").is_none());
    }
    assert_eq!(
        attr(&spans[1], "superfluid.inherited_from").unwrap()["intValue"],
        s.to_string()
    );
    assert!(attr(&spans[2], "superfluid.inherited_from").is_none());
}

/// A one-shot HTTP receiver: answers each request 200 and hands back its
/// request line, headers and body.
fn receiver() -> (String, std::sync::mpsc::Receiver<(String, String)>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut head = String::new();
            let mut len = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap();
                }
                head.push_str(&line);
            }
            let mut body = vec![0; len];
            reader.read_exact(&mut body).unwrap();
            // Queued before the reply, so an exporter that has its answer
            // (and may exit) has every body it sent counted.
            if tx.send((head, String::from_utf8(body).unwrap())).is_err() {
                return;
            }
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}");
        }
    });
    (url, rx)
}

#[test]
fn push_posts_otlp_json_to_v1_traces() {
    let d = shared_daemon();
    let (s, _, _) = session_and_fork(&d);
    let (url, rx) = receiver();
    ok(&export(
        &d,
        &[
            &s.to_string(),
            "--endpoint",
            &url,
            "--include-content",
            "--allow-content-egress",
        ],
    ));
    let (head, body) = rx.recv_timeout(std::time::Duration::from_secs(30)).unwrap();
    assert!(head.starts_with("POST /v1/traces HTTP/1.1\r\n"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    assert!(!body.contains(SECRET), "redacted before it leaves");
    assert!(body.contains(MARKER));
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["resourceSpans"][0]["scopeSpans"][0]["spans"].is_array());
    assert!(rx.try_recv().is_err(), "one POST per session");
}

#[test]
fn content_egress_is_refused_before_anything_is_sent() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    // No daemon at all: the refusal comes before the socket is tried.
    let d = TestDaemon::new();
    let out = export(&d, &["1", "--endpoint", &url, "--include-content"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--allow-content-egress"), "{err}");
    assert!(err.contains("nothing was sent"), "{err}");
    assert!(
        matches!(listener.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the export connected to the endpoint"
    );
    // An https endpoint is refused just as early (no TLS in this build).
    let out = export(&d, &["1", "--endpoint", "https://127.0.0.1:1"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("https is not supported"));
}

#[test]
fn export_all_writes_every_session_archived_included() {
    let d = TestDaemon::start();
    let mut c = d.client();
    let a = d.create(&mut c);
    let b = d.create(&mut c);
    c.call(&Request::SetMeta {
        session: b,
        expected_version: 0,
        title: None,
        archived: Some(true),
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    ok(&export(
        &d,
        &["--all", "--out", dir.path().to_str().unwrap()],
    ));
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![format!("session-{a}.jsonl"), format!("session-{b}.jsonl")]
    );
}

/// A rebase shares its parent's events before and after the edit: those
/// are marked inherited, the replacement is its own.
#[test]
fn jsonl_of_a_rebase_marks_what_it_shares() {
    let d = shared_daemon();
    let mut c = d.client();
    let s = d.create(&mut c);
    for t in ["first", "second", "third"] {
        user(&mut c, s, t);
    }
    let r = created(
        &mut c,
        Request::Rebase {
            session: s,
            edits: vec![superfluid::wire::Edit::Replace {
                from: 2,
                to: 3,
                role: Role::User.into(),
                text: "SECOND".into(),
            }],
            params: None,
        },
    );
    let dir = tempfile::tempdir().unwrap();
    ok(&export(
        &d,
        &[
            &r.to_string(),
            "--include-content",
            "--out",
            dir.path().to_str().unwrap(),
        ],
    ));
    let got = lines(&dir.path().join(format!("session-{r}.jsonl")));
    assert_eq!(got.len(), d.read_all(r).len());
    let by_text = |t: &str| {
        got.iter()
            .find(|l| l["fields"]["text"] == t)
            .unwrap_or_else(|| panic!("no {t}: {got:?}"))
    };
    for (t, inherited) in [("first", true), ("SECOND", false), ("third", true)] {
        let l = by_text(t);
        assert_eq!(l["inherited"], inherited, "{l}");
        assert_eq!(
            l["inherited_from"],
            if inherited {
                Value::from(s)
            } else {
                Value::Null
            }
        );
    }
    assert!(got.iter().all(|l| l["fields"]["text"] != "second"));
    let header = got.iter().find(|l| l["record"] == "Rebased").unwrap();
    assert_eq!(header["inherited"], false);
}

/// Finish 5 from a real generation: on a 64-cell context a long answer runs
/// out of room, the generation ends `error` (reply and log), and its OTLP
/// span carries the `error` finish reason and status ERROR.
#[test]
fn a_generation_out_of_context_ends_with_finish_5_and_an_error_span() {
    let mut d = TestDaemon::new();
    d.extra_args = vec!["--ctx-size".into(), "64".into()];
    d.spawn_and_wait();
    let mut c = d.client();
    let s = d.create(&mut c);
    user(
        &mut c,
        s,
        "Write a very long story about a lighthouse keeper, a storm and a ship.",
    );
    let replies = c
        .generate(&Request::Generate {
            session: s,
            max_tokens: 64,
        })
        .unwrap();
    let Some(Response::Generated { finish, .. }) = replies.last() else {
        panic!("{replies:?}")
    };
    assert_eq!(*finish, superfluid::wire::Finish::Error, "{replies:?}");
    let last = d.read_all(s).into_iter().rev().find_map(|e| match e.body {
        Record::Generated { finish, .. } => Some(finish),
        _ => None,
    });
    assert_eq!(last, Some(superfluid::wire::Finish::Error));
    let dir = tempfile::tempdir().unwrap();
    ok(&export(
        &d,
        &[
            &s.to_string(),
            "--format",
            "otlp-jsonl",
            "--out",
            dir.path().to_str().unwrap(),
        ],
    ));
    let got = lines(&dir.path().join(format!("session-{s}.otlp.jsonl")));
    let spans = got[0]["resourceSpans"][0]["scopeSpans"][0]["spans"]
        .as_array()
        .unwrap();
    assert_eq!(spans.len(), 2);
    assert_eq!(
        attr(&spans[1], "gen_ai.response.finish_reasons").unwrap()["arrayValue"]["values"][0]
            ["stringValue"],
        "error"
    );
    assert_eq!(spans[1]["status"]["code"], 2);
}
