//! The `superfluid session` family, the real binary against a real daemon:
//! ls (archived), tree, read (--from, --follow), fork, trim, archive, purge,
//! each with `--json`, and `--help` with an example for each.

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};

use serde_json::Value;
use superfluid::wire::{Request, Role, SessionId};

use crate::util::{bin, commit, wait_timeout, TestDaemon};

fn sf(d: &TestDaemon, args: &[&str]) -> Output {
    d.session_cli(args)
}

/// Runs it, asserts success, returns stdout.
fn ok(d: &TestDaemon, args: &[&str]) -> String {
    let out = sf(d, args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn json(d: &TestDaemon, args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.push("--json");
    let text = ok(d, &a);
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn user(d: &TestDaemon, s: SessionId, text: &str) {
    commit(
        &mut d.client(),
        Request::AppendMessage {
            session: s,
            role: Role::User.into(),
            text: text.into(),
        },
    );
}

fn ids(list: &Value) -> Vec<u64> {
    list["SessionList"]["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["session"].as_u64().unwrap())
        .collect()
}

/// One daemon of its own: `ls` and `tree` see every session of it.
#[test]
fn session_family_end_to_end() {
    let d = TestDaemon::start();
    let s = d.create(&mut d.client());
    user(&d, s, "one");
    user(&d, s, "two");

    // fork: all events by default, or before --at.
    let f = json(&d, &["fork", &s.to_string()])["Created"]["session"]
        .as_u64()
        .unwrap();
    assert_eq!(d.read_all(f).len(), 4, "Created, 2 messages, Forked");
    let g: u64 = ok(&d, &["fork", &s.to_string(), "--at", "2"])
        .trim()
        .parse()
        .unwrap();
    assert_eq!(d.read_all(g).len(), 3);
    // trim: a new session with the events before --to.
    let t = json(&d, &["trim", &s.to_string(), "--to", "1"])["Created"]["session"]
        .as_u64()
        .unwrap();
    assert_eq!(d.read_all(t).len(), 2);

    // ls and tree.
    assert_eq!(ids(&json(&d, &["ls"])), vec![s, f, g, t]);
    let text = ok(&d, &["ls"]);
    assert!(text.lines().next().unwrap().contains("EVENTS"), "{text}");
    assert_eq!(text.lines().count(), 5, "{text}");
    let tree = json(&d, &["tree"]);
    let nodes = tree["Tree"]["nodes"].as_array().unwrap();
    assert!(nodes.contains(&serde_json::json!([f, s, 3])), "{tree}");
    let text = ok(&d, &["tree"]);
    assert_eq!(
        text,
        format!("{s}\n  {f} (at 3)\n  {g} (at 2)\n  {t} (at 1)\n")
    );

    // archive hides from ls and tree; ls --archived shows it, marked.
    assert_eq!(json(&d, &["archive", &g.to_string()])["Meta"]["version"], 1);
    assert_eq!(ids(&json(&d, &["ls"])), vec![s, f, t]);
    let all = json(&d, &["ls", "--archived"]);
    assert_eq!(ids(&all), vec![s, f, g, t]);
    assert_eq!(all["SessionList"]["sessions"][2]["archived"], true);
    assert!(ok(&d, &["ls", "--archived"]).contains("(archived)"));
    assert!(!ok(&d, &["tree"]).contains(&format!("  {g} ")));
    ok(&d, &["archive", &g.to_string(), "--undo"]);
    assert_eq!(ids(&json(&d, &["ls"])), vec![s, f, g, t]);

    // read: from a cursor, as text and as JSON lines.
    let text = ok(&d, &["read", &s.to_string(), "--from", "1"]);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(
        lines[0].trim_start().starts_with("1  Message user \"one\""),
        "{text}"
    );
    let text = ok(&d, &["read", &f.to_string(), "--json"]);
    let events: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.len(), 4);
    assert_eq!(events[3]["body"]["Forked"]["parent"], s);

    // purge: re-roots forks by default; --cascade takes them too.
    let purged = json(&d, &["purge", &g.to_string()]);
    assert_eq!(purged["Purged"]["sessions"], serde_json::json!([g]));
    let out = ok(&d, &["purge", &s.to_string(), "--cascade"]);
    let mut purged: Vec<u64> = out
        .trim()
        .strip_prefix("purged ")
        .unwrap_or_else(|| panic!("{out}"))
        .split(' ')
        .map(|x| x.parse().unwrap())
        .collect();
    purged.sort();
    assert_eq!(purged, vec![s, f, t]);
    assert_eq!(ids(&json(&d, &["ls", "--archived"])), Vec::<u64>::new());

    // A daemon's refusal: non-zero exit, its message.
    let out = sf(&d, &["read", &s.to_string()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains(&s.to_string()));
}

/// `read --follow` prints the backlog, then each event as it commits, and
/// exits when the session is purged (the subscription's end).
#[test]
fn read_follow_streams_until_the_session_ends() {
    let d = TestDaemon::start();
    let s = d.create(&mut d.client());
    user(&d, s, "before");
    let mut child = Command::new(bin())
        .args([
            "session",
            "read",
            &s.to_string(),
            "--follow",
            "--json",
            "--from",
            "1",
        ])
        .arg("--socket")
        .arg(&d.socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let e: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(e["event_id"], 1, "the backlog from the cursor: {line}");
    assert_eq!(e["body"]["Message"]["text"], "before");
    user(&d, s, "after");
    line.clear();
    out.read_line(&mut line).unwrap();
    let e: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(e["event_id"], 2, "{line}");
    assert_eq!(e["body"]["Message"]["text"], "after");
    ok(&d, &["purge", &s.to_string()]);
    let status = wait_timeout(&mut child, 20_000).expect("read --follow did not exit on purge");
    assert!(status.success());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(err.contains("purged"), "{err}");
}

#[test]
fn every_command_has_help_with_an_example() {
    for cmd in [
        "ls", "tree", "inspect", "read", "fork", "trim", "archive", "purge", "export",
    ] {
        let out = Command::new(bin())
            .args(["session", cmd, "--help"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{cmd}");
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains("Example"), "{cmd}: {text}");
        assert!(
            text.contains(&format!("superfluid session {cmd}")),
            "{cmd}: {text}"
        );
        assert!(text.contains("--socket"), "{cmd}: {text}");
    }
}

/// A command whose reader goes away (`| head -1`) ends quietly with exit 0:
/// `inspect`, `fork`, `--help` and `models` panicked with "failed printing
/// to stdout" and a backtrace. And an error that names its cause says it
/// once ("Address already in use" came out twice).
#[test]
fn a_closed_stdout_ends_quietly_and_errors_say_their_cause_once() {
    let d = TestDaemon::start();
    let mut c = d.client();
    let s = d.create(&mut c);
    for i in 0..50 {
        user(&d, s, &format!("message {i}"));
    }
    let s = s.to_string();
    let socket = d.socket.display().to_string();
    for args in [
        vec![
            "session",
            "inspect",
            s.as_str(),
            "--socket",
            socket.as_str(),
        ],
        vec!["session", "fork", s.as_str(), "--socket", socket.as_str()],
        vec!["--help"],
        vec!["models"],
    ] {
        // A pipe whose reading end is closed before the command starts.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(bin())
            .args(&args)
            .env("HF_HUB_CACHE", d.path().join("hf"))
            .stdout(writer)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.code() == Some(0) && !stderr.contains("panicked"),
            "{args:?}: {:?} {stderr}",
            out.status
        );
    }
    // The web address in use: the cause once.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = Command::new(bin())
        .args(["serve", &crate::util::model_path().display().to_string()])
        .arg("--sessions")
        .arg(d.path().join("other-sessions"))
        .arg("--socket")
        .arg(d.path().join("other.sock"))
        .args(["--web", &addr])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(
        stderr.matches("Address already in use").count(),
        1,
        "{stderr}"
    );
}

/// A mistyped command gets clap's tip, except when the tip would be the
/// hidden `worker` (the daemon's own subcommand; run by hand it waits on
/// stdin for frames): `superfluid work` suggested it.
#[test]
fn a_mistyped_command_is_never_pointed_at_the_hidden_worker() {
    let run = |arg: &str| {
        let out = Command::new(bin()).arg(arg).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{arg}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let work = run("work");
    assert!(
        work.contains("unrecognized subcommand 'work'") && !work.contains("worker"),
        "{work}"
    );
    let sesion = run("sesion");
    assert!(
        sesion.contains("similar subcommand exists: 'session'"),
        "{sesion}"
    );
}
