//! More than one model per daemon (`serve MODEL --model MODEL...`): each
//! with its own log under `<sessions>/models/<id>/`, its sessions kept apart
//! across a restart, `UseModel` and `Models` on the socket, loading on first
//! use, unloading after `--keep-alive`, `--max-loaded-models` and
//! `--memory-limit-mb`.
//!
//! The second model is a derived test model with a Llama 3 style template
//! (a header per turn), so the same message puts other tokens on its input
//! than on the default model's: which template rendered a message shows
//! which model served it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use superfluid::frontend::socket::Client;
use superfluid::wire::{ModelSummary, Record, Request, Response, SessionId};

use crate::util::{
    assert_cancelled, children_of, commit, created, derived_model, generate_text, params,
    read_events, TestDaemon,
};

const LLAMA3: &str = "SmolLM2-135M-llama3-style.gguf";
const GEMMA: &str = "SmolLM2-135M-gemma-style.gguf";

fn id_of(path: &Path) -> String {
    path.file_stem().unwrap().to_string_lossy().into_owned()
}

fn daemon_with(models: &[PathBuf], extra: &[&str]) -> TestDaemon {
    let mut d = TestDaemon::new();
    for m in models {
        d.extra_args.push("--model".into());
        d.extra_args.push(m.display().to_string());
    }
    d.extra_args.extend(extra.iter().map(|s| s.to_string()));
    d.spawn_and_wait();
    d
}

fn models(c: &mut Client) -> Vec<ModelSummary> {
    match c.call(&Request::Models).unwrap() {
        Response::Models { models } => models,
        other => panic!("Models: {other:?}"),
    }
}

fn state_of(c: &mut Client, id: &str) -> String {
    models(c)
        .into_iter()
        .find(|m| m.id == id)
        .unwrap_or_else(|| panic!("{id} is not listed"))
        .state
}

fn use_model(c: &mut Client, name: &str) {
    let r = c.call(&Request::UseModel { model: name.into() }).unwrap();
    assert_eq!(r, Response::Ack, "UseModel {name}");
}

/// A session holding one user message; its id and the message's tokens.
fn session_with_message(c: &mut Client, text: &str) -> (SessionId, Vec<u32>) {
    let s = created(
        c,
        Request::Create {
            parent: None,
            params: params(7),
        },
    );
    let e = commit(
        c,
        Request::AppendMessage {
            session: s,
            role: 1,
            text: text.into(),
        },
    );
    (s, e.body.span().to_vec())
}

/// The pids of the daemon's workers serving `model`.
fn workers_of(daemon: u32, model: &Path) -> Vec<u32> {
    let want = model.display().to_string();
    children_of(daemon)
        .into_iter()
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<String> = cmd
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            args.get(1).map(String::as_str) == Some("worker") && args.contains(&want)
        })
        .collect()
}

/// Polls `f` every 100 ms for up to `secs`.
fn eventually(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn two_models_keep_their_own_logs_and_sessions_across_a_restart() {
    let second = derived_model(LLAMA3);
    let id = id_of(&second);
    let mut d = daemon_with(std::slice::from_ref(&second), &[]);
    let mut c = d.client();

    let listed = models(&mut c);
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert!(listed[0].default && !listed[1].default, "{listed:?}");
    assert_eq!(listed[1].id, id);
    assert_eq!(listed[1].state, "unloaded", "a --model loads on first use");

    // The same message on each model: each template renders it its way.
    let (a, a_span) = session_with_message(&mut c, "Name a colour.");
    use_model(&mut c, &id);
    let (b, b_span) = session_with_message(&mut c, "Name a colour.");
    assert_eq!(a, b, "each model numbers its own sessions");
    assert_ne!(a_span, b_span, "the second model's template rendered it");
    let b_text = generate_text(&mut c, b, 8).expect("a generation on the second model");
    assert_eq!(state_of(&mut c, &id), "ready");
    assert!(!workers_of(d.pid(), &second).is_empty());

    // "default" goes back; an unknown name is refused, naming what is served.
    use_model(&mut c, "default");
    match c.call(&Request::Inspect { session: a }).unwrap() {
        Response::Inspection { inspection } => assert_eq!(inspection.events, 2),
        other => panic!("{other:?}"),
    }
    let r = c
        .call(&Request::UseModel {
            model: "no-such-model".into(),
        })
        .unwrap();
    let Response::Err { message } = r else {
        panic!("{r:?}")
    };
    assert!(
        message.contains(&id) && message.contains("no-such-model"),
        "{message}"
    );

    // Each model's log is its own file.
    assert!(d.sessions.join("wal.log").is_file());
    assert!(d
        .sessions
        .join("models")
        .join(&id)
        .join("wal.log")
        .is_file());

    d.kill9();
    d.spawn_and_wait();
    let mut c = d.client();
    let default_events = d.read_all(a);
    assert_eq!(default_events.last().unwrap().body.span(), &a_span[..]);
    assert!(
        !default_events
            .iter()
            .any(|e| matches!(e.body, Record::Generated { .. })),
        "the generation ran on the other model's session"
    );
    use_model(&mut c, &id);
    let events = read_events(&mut c, b);
    assert_eq!(events[1].body.span(), &b_span[..]);
    let generated: String = events
        .iter()
        .filter_map(|e| match &e.body {
            Record::Generated { text, .. } => Some(text.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        generated, b_text,
        "the second model's session came back whole"
    );

    // `superfluid session --use-model ID` works on that model's sessions.
    let cli = |args: &[&str]| d.session_cli(args);
    let out = cli(&["inspect", &b.to_string(), "--use-model", &id, "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // One JSON value a line; the first is the inspection.
    let first = |out: &std::process::Output| -> serde_json::Value {
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        serde_json::from_str(text.lines().next().unwrap_or_default()).unwrap()
    };
    assert_eq!(first(&out)["events"], events.len() as u64);
    let out = cli(&["inspect", &a.to_string(), "--json"]);
    assert_eq!(first(&out)["events"], default_events.len() as u64);
    let out = cli(&["ls", "--use-model", "no-such-model"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no-such-model"));
}

#[test]
fn a_second_model_loads_on_first_use_and_unloads_after_its_keep_alive() {
    let second = derived_model(LLAMA3);
    let id = id_of(&second);
    let d = daemon_with(std::slice::from_ref(&second), &["--keep-alive", "2s"]);
    let mut c = d.client();
    use_model(&mut c, &id);
    // Nothing loads it until a request needs its worker.
    let (s, _) = session_with_message(&mut c, "Say one word.");
    std::thread::sleep(Duration::from_millis(500));
    assert!(workers_of(d.pid(), &second).is_empty(), "loaded before use");
    assert_eq!(state_of(&mut c, &id), "unloaded");

    let first = generate_text(&mut c, s, 6).expect("the first generation loads it");
    assert_eq!(workers_of(d.pid(), &second).len(), 1);

    // Idle past its keep-alive: the worker goes, the sessions stay.
    eventually(20, "the model to unload", || {
        workers_of(d.pid(), &second).is_empty() && state_of(&mut c, &id) == "unloaded"
    });

    // The next request loads it again, and greedy decoding says the same.
    let (s2, _) = session_with_message(&mut c, "Say one word.");
    assert_eq!(generate_text(&mut c, s2, 6).as_deref(), Ok(first.as_str()));
    assert_eq!(state_of(&mut c, &id), "ready");
    // The default model never unloads.
    assert_eq!(models(&mut c)[0].state, "ready");
}

#[test]
fn past_max_loaded_models_the_least_recently_used_idle_model_unloads() {
    let (b, g) = (derived_model(LLAMA3), derived_model(GEMMA));
    let (b_id, g_id) = (id_of(&b), id_of(&g));
    let d = daemon_with(
        &[b.clone(), g.clone()],
        &["--max-loaded-models", "2", "--keep-alive", "-1"],
    );
    let mut c = d.client();
    use_model(&mut c, &b_id);
    let (sb, _) = session_with_message(&mut c, "Hi.");
    generate_text(&mut c, sb, 4).unwrap();
    assert_eq!(state_of(&mut c, &b_id), "ready");
    // Idle for over a second, b may make room for g.
    std::thread::sleep(Duration::from_millis(1_500));
    use_model(&mut c, &g_id);
    let (sg, _) = session_with_message(&mut c, "Hi.");
    generate_text(&mut c, sg, 4).unwrap();
    assert_eq!(state_of(&mut c, &g_id), "ready");
    eventually(10, "b to unload", || {
        workers_of(d.pid(), &b).is_empty() && state_of(&mut c, &b_id) == "unloaded"
    });
    assert_eq!(models(&mut c)[0].state, "ready", "the first model stays");
}

#[test]
fn a_model_past_max_loaded_models_with_none_idle_is_refused() {
    let second = derived_model(LLAMA3);
    let id = id_of(&second);
    // The first model is never unloaded to make room.
    let d = daemon_with(std::slice::from_ref(&second), &["--max-loaded-models", "1"]);
    let mut c = d.client();
    use_model(&mut c, &id);
    let (s, _) = session_with_message(&mut c, "Hi.");
    let e = generate_text(&mut c, s, 4).unwrap_err();
    assert!(
        e.contains(&format!("cannot load the model {id:?}")) && e.contains("--max-loaded-models 1"),
        "{e}"
    );
    assert!(workers_of(d.pid(), &second).is_empty());
}

#[test]
fn a_model_that_does_not_fit_is_refused_with_a_clear_error() {
    let second = derived_model(LLAMA3);
    let id = id_of(&second);
    let d = daemon_with(std::slice::from_ref(&second), &["--memory-limit-mb", "100"]);
    let mut c = d.client();
    use_model(&mut c, &id);
    let (s, _) = session_with_message(&mut c, "Hi.");
    let e = generate_text(&mut c, s, 4).unwrap_err();
    assert!(
        e.contains(&format!("cannot load the model {id:?}")) && e.contains("--memory-limit-mb 100"),
        "{e}"
    );
    assert!(workers_of(d.pid(), &second).is_empty());
    assert_eq!(state_of(&mut c, &id), "unloaded");
    // The default model is unharmed.
    use_model(&mut c, "default");
    let (s, _) = session_with_message(&mut c, "Hi.");
    generate_text(&mut c, s, 4).expect("the default model still serves");
}

#[test]
fn two_models_with_one_id_are_refused_at_start() {
    let mut d = TestDaemon::new();
    let model = d.model.display().to_string();
    let failed = d.start_expect_exit(&["--model".into(), model]);
    assert!(!failed.status.success());
    assert!(failed.stderr.contains("have the id"), "{}", failed.stderr);
}

/// Each model's log directory is locked with the daemon's: a second daemon
/// started on an additional model's `<sessions>/models/<id>/` wrote the
/// same log beside the first (both took session id 1), and the first then
/// refused to start on the log they had made together.
#[test]
fn another_daemon_on_a_model_log_directory_is_refused() {
    let second = derived_model(LLAMA3);
    let mut d = daemon_with(std::slice::from_ref(&second), &[]);
    let pid = d.pid();
    let dir = d.sessions.join("models").join(id_of(&second));
    let wal = std::fs::read(dir.join("wal.log")).unwrap();
    let other_socket = d.path().join("other.sock");
    d.start_other_expect_exit(&dir, &other_socket, &[])
        .assert_locked_by(pid);
    assert_eq!(std::fs::read(dir.join("wal.log")).unwrap(), wal);
    // The first daemon still serves that model.
    let mut c = d.client();
    use_model(&mut c, &id_of(&second));
    session_with_message(&mut c, "Still mine.");
}

/// A second model whose file, once the daemon has read it at its start, is
/// held under a write lease (fcntl F_SETLEASE): the kernel blocks its
/// worker's open of the file until the lease is released, or broken after
/// /proc/sys/fs/lease-break-time (45 s by default), as an open on a hung
/// network mount or a recalled NFS delegation blocks. The directory, the
/// daemon, the file's path and the lease (dropping it lets the load go on).
fn daemon_with_a_stuck_model(
    extra: &[&str],
) -> (tempfile::TempDir, TestDaemon, PathBuf, std::fs::File) {
    use std::os::fd::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("stuck.gguf");
    std::fs::copy(derived_model(LLAMA3), &model).unwrap();
    let d = daemon_with(std::slice::from_ref(&model), extra);
    let lease = std::fs::File::open(&model).unwrap();
    // SAFETY: signal(2) and fcntl(2) on a file this test owns. The lease's
    // break is announced with SIGIO, whose default action ends the process.
    unsafe {
        libc::signal(libc::SIGIO, libc::SIG_IGN);
        assert_eq!(
            libc::fcntl(lease.as_raw_fd(), libc::F_SETLEASE, libc::F_WRLCK),
            0,
            "F_SETLEASE: {}",
            std::io::Error::last_os_error()
        );
    }
    (dir, d, model, lease)
}

/// A Generate of `s` on a connection of its own, on model `id`: its replies
/// come on the channel (read with a bound, so a generation that never ends
/// fails the test rather than hanging it).
fn generate_on(d: &TestDaemon, id: &str, s: SessionId) -> std::sync::mpsc::Receiver<Vec<Response>> {
    let mut g = d.client();
    use_model(&mut g, id);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let replies = g.generate(&Request::Generate {
            session: s,
            max_tokens: 8,
        });
        let _ = tx.send(replies.expect("generate"));
    });
    rx
}

/// A Cancel reaches a generation whose model is still loading: the steps
/// the lane held for the worker are handed back, the generation finishes
/// cancelled at once and its session is free, though the load never ends.
#[test]
fn a_cancel_frees_a_session_whose_model_is_stuck_loading() {
    let (_dir, d, model, _lease) = daemon_with_a_stuck_model(&[]);
    let mut c = d.client();
    use_model(&mut c, "stuck");
    let (s, _) = session_with_message(&mut c, "Say one word.");
    let replies = generate_on(&d, "stuck", s);
    eventually(30, "the worker to start loading", || {
        workers_of(d.pid(), &model).len() == 1
    });
    assert_eq!(state_of(&mut c, "stuck"), "loading");
    // The generation is admitted and its step held for the worker.
    std::thread::sleep(Duration::from_millis(500));
    let r = c.call(&Request::Cancel { session: s }).unwrap();
    assert_eq!(r, Response::Cancelling);
    let replies = replies
        .recv_timeout(Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("the cancelled generation did not end; {}", d.stderr()));
    assert_cancelled(&replies);
    // Free: the next request on it is not refused as busy (it waits for the
    // load in turn, and is cancelled the same way).
    let again = generate_on(&d, "stuck", s);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        c.call(&Request::Cancel { session: s }).unwrap(),
        Response::Cancelling
    );
    let again = again.recv_timeout(Duration::from_secs(20)).unwrap();
    assert_cancelled(&again);
    assert_eq!(state_of(&mut c, "stuck"), "loading", "the load went on");
    assert_eq!(workers_of(d.pid(), &model).len(), 1);
}

/// A loading worker that shows no progress for --load-timeout-secs is
/// killed: what waits for it fails saying so, the --model settles unloaded,
/// and once the file can be opened the next request loads it and is served.
#[test]
fn a_stalled_load_fails_and_the_next_request_loads_the_model() {
    let (_dir, d, model, lease) = daemon_with_a_stuck_model(&["--load-timeout-secs", "3"]);
    let mut c = d.client();
    use_model(&mut c, "stuck");
    let (s, _) = session_with_message(&mut c, "Say one word.");
    let started = Instant::now();
    let replies = generate_on(&d, "stuck", s);
    eventually(30, "the worker to start loading", || {
        workers_of(d.pid(), &model).len() == 1
    });
    let worker = workers_of(d.pid(), &model)[0];
    let replies = replies
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("the generation waited past 60 s; {}", d.stderr()));
    match replies.last() {
        Some(Response::Err { message }) => assert!(
            message.contains("made no progress for 3 s (--load-timeout-secs)"),
            "{message}"
        ),
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_secs(3));
    eventually(10, "the stuck worker to be killed", || {
        !workers_of(d.pid(), &model).contains(&worker)
    });
    // A --model whose load failed settles unloaded: no worker is started
    // again for nobody (the first respawn would come within 100 ms).
    eventually(10, "the model to settle unloaded", || {
        state_of(&mut c, "stuck") == "unloaded"
    });
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        workers_of(d.pid(), &model).is_empty(),
        "a worker was started again"
    );
    // The lease released: the next request loads the model and is served.
    drop(lease);
    assert!(!generate_text(&mut c, s, 4).expect("served").is_empty());
    assert_eq!(state_of(&mut c, "stuck"), "ready");
}

/// A --model whose file broke after the start (truncated): every request
/// fails naming the load's error (those that came between the worker's
/// Err and its exit said only "the worker died"), and requests in a row
/// do not each start a worker: after a failed load the next one waits out
/// the respawn delay (100 ms, doubling), failing at once meanwhile.
#[test]
fn a_broken_model_file_fails_each_request_with_its_cause_and_backs_off() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("broken.gguf");
    std::fs::copy(derived_model(LLAMA3), &model).unwrap();
    let d = daemon_with(std::slice::from_ref(&model), &[]);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&model)
        .unwrap();
    f.set_len(1 << 20).unwrap();
    drop(f);
    let mut c = d.client();
    use_model(&mut c, "broken");
    let (s, _) = session_with_message(&mut c, "Hi.");
    let until = Instant::now() + Duration::from_secs(2);
    let mut asked = 0;
    while Instant::now() < until {
        let e = generate_text(&mut c, s, 2).expect_err("the model cannot load");
        assert!(
            e.contains("could not start") && !e.contains("the worker died"),
            "{e}"
        );
        asked += 1;
    }
    let started = d.stderr().matches("started (pid").count();
    // One worker for the first model, and for this one a start per failure
    // after waits of 100, 200, 400, 800 ms: at most 5 in 2 s.
    assert!(
        asked > started && started <= 1 + 5,
        "{asked} requests, {started} workers started"
    );
}
