//! Generation through the socket, on the real model in a real worker.

use std::time::Duration;

use superfluid::frontend::socket::Client;
use superfluid::wire::{
    Channel, Event, Finish, Params, Record, Request, Response, Role, SessionId, Token,
};

use crate::util::{
    commit, created, expect_err, forced_weather_session, params, shared_daemon, tool_choice,
    tools_think_daemon, TestDaemon,
};

/// A session with a system message and one user message. (SmolLM2-135M
/// answers its own default system prompt poorly: "What is the capital of
/// France?" gets a list of French monuments, greedy.)
fn asked(c: &mut Client, p: Params, question: &str) -> SessionId {
    let s = created(
        c,
        Request::Create {
            parent: None,
            params: p,
        },
    );
    commit(
        c,
        Request::AppendMessage {
            session: s,
            role: Role::System.into(),
            text: "You are a helpful assistant.".into(),
        },
    );
    commit(
        c,
        Request::AppendMessage {
            session: s,
            role: Role::User.into(),
            text: question.into(),
        },
    );
    s
}

/// Generates and returns (deltas, last reply).
fn generate(c: &mut Client, s: SessionId, max_tokens: u32) -> (Vec<Event>, Response) {
    let mut replies = c
        .generate(&Request::Generate {
            session: s,
            max_tokens,
        })
        .unwrap();
    let last = replies.pop().unwrap();
    let events = replies
        .into_iter()
        .map(|r| match r {
            Response::Delta { event } => event,
            other => panic!("expected Delta, got {other:?}"),
        })
        .collect();
    (events, last)
}

/// The finish code of a `Generated` reply, None for any other reply.
fn finish_of(reply: &Response) -> Option<Finish> {
    match reply {
        Response::Generated { finish, .. } => Some(*finish),
        _ => None,
    }
}

/// The tokens and text the session generated (Generated events only).
fn generated(events: &[Event]) -> (Vec<Token>, String) {
    let mut tokens = Vec::new();
    let mut text = String::new();
    for e in events {
        if let Record::Generated { span, text: t, .. } = &e.body {
            tokens.extend_from_slice(span);
            text.push_str(t);
        }
    }
    (tokens, text)
}

fn sampled(seed: u64) -> Params {
    Params {
        temperature: 0.8,
        top_p: 0.95,
        min_p: 0.05,
        top_k: 40,
        seed,
    }
}

const QUESTION: &str = "Write a short story about a lighthouse keeper and a storm.";

#[test]
fn answers_a_plain_question() {
    let d = TestDaemon::start();
    let mut c = d.client();
    let s = asked(&mut c, params(1), "What is the capital of France?");
    let (events, last) = generate(&mut c, s, 48);
    assert!(
        matches!(events[0].body, Record::GenerationPrompt { .. }),
        "{events:?}"
    );
    let Response::Generated {
        events: n,
        tokens_generated,
        finish: f,
        ..
    } = last
    else {
        panic!("{last:?}");
    };
    assert_eq!(n as usize, events.len());
    assert!(tokens_generated > 0 && tokens_generated <= 48);
    assert!(f == Finish::EndOfTurn || f == Finish::MaxTokens);
    let (_, text) = generated(&events);
    assert!(text.contains("Paris"), "answer: {text:?}");
    // Every Delta is in the log, in order.
    let log = d.read_all(s);
    assert_eq!(&log[log.len() - events.len()..], &events[..]);
}

/// The uncut generation, on a daemon of its own: a second session with the
/// same prompt on the same daemon would start from a copy of the first one's
/// cells and decode the end of its prompt in another batch shape, which may
/// drift a sampled run (the spec says so of forks).
fn uncut(seed: u64, max_tokens: u32) -> Vec<Token> {
    let d = TestDaemon::start();
    let mut c = d.client();
    let s = asked(&mut c, sampled(seed), QUESTION);
    generated(&generate(&mut c, s, max_tokens).0).0
}

#[test]
fn a_cut_generation_continued_draws_what_the_uncut_one_drew() {
    let whole = uncut(7, 200);
    assert!(
        whole.len() > 150,
        "the story should run long: {} tokens",
        whole.len()
    );
    assert_eq!(uncut(7, 200), whole, "same seed, same tokens");

    let d = TestDaemon::start();
    let mut c = d.client();
    let cut = asked(&mut c, sampled(7), QUESTION);
    let mut tokens = Vec::new();
    let mut done = 0;
    for upto in [37u32, 80, 150, 200] {
        let (events, last) = generate(&mut c, cut, upto - done);
        tokens.extend(generated(&events).0);
        done = upto;
        if matches!(
            last,
            Response::Generated {
                finish: Finish::EndOfTurn,
                ..
            }
        ) {
            break;
        }
    }
    assert_eq!(tokens, whole, "cut at 37, 80, 150 and continued");
    // Another seed draws something else.
    let other = asked(&mut c, sampled(8), QUESTION);
    assert_ne!(generated(&generate(&mut c, other, 200).0).0, whole);
}

#[test]
fn cancel_busy_and_fork_while_generating() {
    let whole = uncut(3, 120);
    let d = TestDaemon::start();
    let mut c = d.client();
    let s = asked(&mut c, sampled(3), QUESTION);
    let socket = d.socket.clone();
    let gen = std::thread::spawn(move || {
        let mut c = Client::connect(&socket).unwrap();
        c.generate(&Request::Generate {
            session: s,
            max_tokens: 120,
        })
        .unwrap()
    });
    // Wait for the first committed chunk, then poke it from a second connection.
    let mut other = d.client();
    d.until_generated(s);
    let busy = expect_err(
        &mut other,
        &Request::AppendMessage {
            session: s,
            role: Role::User.into(),
            text: "hi".into(),
        },
    );
    assert!(busy.contains("SessionBusy"), "{busy}");
    let at = d.read_all(s).len() as u64;
    let fork = created(
        &mut other,
        Request::Fork {
            session: s,
            at_event: at,
            params: None,
        },
    );
    assert_eq!(d.read_all(fork).len() as u64, at + 1);
    assert_eq!(
        other.call(&Request::Cancel { session: s }).unwrap(),
        Response::Cancelling
    );
    let replies = gen.join().unwrap();
    let last = replies.last().unwrap();
    assert_eq!(finish_of(last), Some(Finish::Cancelled), "{last:?}");
    // Nothing is generating now.
    assert!(expect_err(&mut other, &Request::Cancel { session: s }).contains("no generation"));
    // Continued, the cancelled generation draws what the uncut one drew.
    let mut tokens = generated(&d.read_all(s)).0;
    let (rest, _) = generated(&generate(&mut c, s, 120 - tokens.len() as u32).0);
    tokens.extend(rest);
    assert_eq!(tokens, whole);
}

#[test]
fn four_sessions_progress_in_the_same_decode_steps() {
    let d = TestDaemon::start();
    let sessions: Vec<SessionId> = (0..4)
        .map(|i| asked(&mut d.client(), sampled(i), QUESTION))
        .collect();
    let threads: Vec<_> = sessions
        .iter()
        .map(|&s| {
            let socket = d.socket.clone();
            std::thread::spawn(move || {
                let mut c = Client::connect(&socket).unwrap();
                c.generate(&Request::Generate {
                    session: s,
                    max_tokens: 40,
                })
                .unwrap()
            })
        })
        .collect();
    for t in threads {
        assert!(matches!(
            t.join().unwrap().last(),
            Some(Response::Generated { .. })
        ));
    }
    let Response::Text { text } = d.call(&Request::Metrics) else {
        panic!()
    };
    let value = |name: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing in {text}"))
    };
    assert_eq!(
        value("superfluid_decode_max_sequences_per_step"),
        4,
        "{text}"
    );
    let steps = value("superfluid_decode_steps_total");
    let seq_steps = value("superfluid_decode_sequence_steps_total");
    assert!(
        seq_steps >= 3 * steps,
        "sessions shared steps: {seq_steps} over {steps} steps"
    );
}

#[test]
fn worker_killed_mid_generation() {
    let d = TestDaemon::start();
    let mut c = d.client();
    let s = asked(&mut c, sampled(5), QUESTION);
    let socket = d.socket.clone();
    let gen = std::thread::spawn(move || {
        let mut c = Client::connect(&socket).unwrap();
        c.generate(&Request::Generate {
            session: s,
            max_tokens: 400,
        })
        .unwrap()
    });
    d.until_generated(s);
    let worker = worker_pid(d.pid());
    unsafe { libc::kill(worker as i32, libc::SIGKILL) };
    let replies = gen.join().unwrap();
    let last = replies.last().unwrap();
    assert!(
        matches!(last, Response::Err { message } if message.contains("worker")),
        "{last:?}"
    );
    // The daemon stays up, the log reads back whole, the session goes on.
    let before = d.read_all(s);
    assert!(before.iter().all(|e| e.event_id < before.len() as u64));
    let (events, last) = generate(&mut c, s, 20);
    assert!(matches!(last, Response::Generated { .. }), "{last:?}");
    assert!(!events.is_empty());
    assert_ne!(worker_pid(d.pid()), worker, "a new worker runs");
}

/// A worker killed under one generation fails that one only: another,
/// admitted but waiting for a sequence (`--parallel 1`), had nothing
/// computed and runs on the next worker to its end.
#[test]
fn a_killed_worker_fails_only_what_it_was_running() {
    let mut d = TestDaemon::new();
    d.extra_args = vec!["--parallel".into(), "1".into()];
    d.spawn_and_wait();
    let mut c = d.client();
    let running = asked(&mut c, sampled(5), QUESTION);
    let waiting = asked(&mut c, sampled(6), "Name a colour.");
    let start = |s: SessionId, max_tokens: u32| {
        let socket = d.socket.clone();
        std::thread::spawn(move || {
            let mut c = Client::connect(&socket).unwrap();
            c.generate(&Request::Generate {
                session: s,
                max_tokens,
            })
            .unwrap()
        })
    };
    let a = start(running, 400);
    d.until_generated(running);
    let b = start(waiting, 8);
    // b's turn is open (its header committed, then it is admitted) and it
    // waits: the one sequence is a's.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !d
        .read_all(waiting)
        .iter()
        .any(|e| matches!(e.body, Record::GenerationPrompt { .. }))
    {
        assert!(std::time::Instant::now() < deadline, "b never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !d.read_all(waiting)
            .iter()
            .any(|e| matches!(e.body, Record::Generated { .. })),
        "b drew before a ended: the test needs it waiting"
    );
    unsafe { libc::kill(worker_pid(d.pid()) as i32, libc::SIGKILL) };
    let last_a = a.join().unwrap().pop().unwrap();
    assert!(
        matches!(&last_a, Response::Err { message } if message.contains("worker")),
        "{last_a:?}"
    );
    let last_b = b.join().unwrap().pop().unwrap();
    assert!(
        matches!(last_b, Response::Generated { .. }),
        "the waiting generation failed with the worker: {last_b:?}"
    );
}

/// A model file swapped under the daemon (another vocabulary, so its ids
/// mean other text) is refused when the next worker starts: generations
/// fail with a message naming the file and commit no output, and putting the
/// file back brings the lane back.
#[test]
fn a_worker_on_a_swapped_model_file_is_refused() {
    let (d, model) = with_copy(crate::util::model_path(), "model.gguf", |d, p| d.model = p);
    let (mut c, s) = one_reply(&d);
    let swap = |from: &std::path::Path| {
        let part = d.path().join("model.part");
        std::fs::copy(from, &part).unwrap();
        std::fs::rename(&part, &model).unwrap();
    };
    swap(&crate::util::derived_model("SmolLM2-135M-other-vocab.gguf"));
    let outputs = |events: &[Event]| {
        events
            .iter()
            .filter(|e| matches!(e.body, Record::Generated { .. } | Record::ToolUse { .. }))
            .count()
    };
    let before = outputs(&d.read_all(s));
    unsafe { libc::kill(worker_pid(d.pid()) as i32, libc::SIGKILL) };
    // Until the new worker is refused, a request can still meet the dead
    // one ("the worker died"); none may generate.
    let message = until_err_with(&d, "changed since the daemon started", || {
        generate(&mut c, s, 4).1
    });
    assert!(message.contains("model.gguf"), "{message}");
    assert_eq!(
        outputs(&d.read_all(s)),
        before,
        "nothing generated was committed"
    );
    swap(&crate::util::model_path());
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        match generate(&mut c, s, 4).1 {
            Response::Generated { .. } => break,
            Response::Err { message } => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "never back: {message}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(outputs(&d.read_all(s)) > before);
}

pub(crate) fn worker_pid(daemon: u32) -> u32 {
    for _ in 0..500 {
        let children = std::fs::read_dir(format!("/proc/{daemon}/task"))
            .unwrap()
            .filter_map(|t| t.ok())
            .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
            .flat_map(|c| c.split_whitespace().map(String::from).collect::<Vec<_>>())
            .filter_map(|p| p.parse::<u32>().ok())
            .collect::<Vec<_>>();
        if let Some(&p) = children.first() {
            return p;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("the daemon has no worker");
}

#[test]
fn bad_generate_requests() {
    let d = shared_daemon();
    let mut c = d.client();
    let s = asked(&mut c, params(1), "hi");
    let before = d.wal_bytes();
    for (req, words) in [
        (
            Request::Generate {
                session: s,
                max_tokens: 0,
            },
            "max_tokens",
        ),
        (
            Request::Generate {
                session: s,
                max_tokens: u32::MAX,
            },
            "max_tokens",
        ),
        (
            Request::Generate {
                session: 999,
                max_tokens: 5,
            },
            "unknown session",
        ),
    ] {
        let replies = c.generate(&req).unwrap();
        match replies.last().unwrap() {
            Response::Err { message } => assert!(message.contains(words), "{message}"),
            other => panic!("{req:?}: {other:?}"),
        }
    }
    assert_eq!(
        d.wal_bytes(),
        before,
        "refused requests leave the log alone"
    );
    let gen = match c.call(&Request::Inspect { session: s }).unwrap() {
        Response::Inspection { inspection } => inspection.generation,
        other => panic!("{other:?}"),
    };
    let Response::Purged { .. } = c
        .call(&Request::Purge {
            session: s,
            expected_generation: gen,
            mode: superfluid::wire::PurgeMode::Cascade,
        })
        .unwrap()
    else {
        panic!()
    };
    let replies = c
        .generate(&Request::Generate {
            session: s,
            max_tokens: 5,
        })
        .unwrap();
    assert!(
        matches!(replies.last(), Some(Response::Err { message }) if message.contains("purged"))
    );
    // A missing params field is refused when parsing.
    let err = serde_json::from_str::<Request>(r#"{"Create":{"parent":null}}"#).unwrap_err();
    assert!(err.to_string().contains("params"));
}

#[test]
fn complete_fills_in_the_middle_on_a_model_with_fim_tokens() {
    let mut d = TestDaemon::new();
    d.model = crate::util::derived_model("SmolLM2-135M-fim.gguf");
    d.spawn_and_wait();
    let mut c = d.client();
    let before = d.wal_bytes();
    for mode in [0u8, 1] {
        let reply = c
            .call(&Request::Complete {
                prefix: "def add(a, b):\n    return ".into(),
                suffix: "\n\nprint(add(1, 2))\n".into(),
                mode,
                max_tokens: 12,
            })
            .unwrap();
        let Response::Completion { tokens, cached, .. } = reply else {
            panic!("mode {mode}: {reply:?}");
        };
        assert!(tokens > 0 && tokens <= 12);
        // Neither prompt is warm yet: mode 1 puts the suffix first, so it
        // shares no prefix with mode 0's.
        assert_eq!(cached, 0, "mode {mode}: a cold prompt");
    }
    // The same request again starts from the cache.
    let req = Request::Complete {
        prefix: "def add(a, b):\n    return ".into(),
        suffix: "\n".into(),
        mode: 0,
        max_tokens: 4,
    };
    c.call(&req).unwrap();
    let Response::Completion { cached, .. } = c.call(&req).unwrap() else {
        panic!()
    };
    assert!(cached > 5, "a repeated prompt is warm: {cached}");
    let bad = expect_err(
        &mut c,
        &Request::Complete {
            prefix: "a".into(),
            suffix: "b".into(),
            mode: 2,
            max_tokens: 4,
        },
    );
    assert!(bad.contains("mode"), "{bad}");
    assert_eq!(d.wal_bytes(), before, "completions are not recorded");
}

#[test]
fn complete_on_a_model_without_fim_tokens_is_a_clear_err() {
    let d = shared_daemon();
    let mut c = d.client();
    let msg = expect_err(
        &mut c,
        &Request::Complete {
            prefix: "a".into(),
            suffix: "b".into(),
            mode: 0,
            max_tokens: 4,
        },
    );
    assert!(msg.contains("fill-in-the-middle"), "{msg}");
}

#[test]
fn reasoning_goes_on_channel_1() {
    let d = tools_think_daemon();
    let mut c = d.client();
    let s = asked(&mut c, params(1), "What is 2 + 2?");
    let first_channel = |events: &[Event]| {
        events
            .iter()
            .find_map(|e| match &e.body {
                Record::Generated { channel, .. } => Some(*channel),
                _ => None,
            })
            .expect("a Generated event")
    };
    // Cut after 3 tokens, inside the thinking block the template opened.
    let (events, last) = generate(&mut c, s, 3);
    assert_eq!(first_channel(&events), Channel::Reasoning, "{events:?}");
    assert_eq!(finish_of(&last), Some(Finish::MaxTokens));
    let Response::Inspection { inspection } = c.call(&Request::Inspect { session: s }).unwrap()
    else {
        panic!()
    };
    assert!(inspection.open_turn);
    // Continued, it goes on inside the thinking block: no new header.
    let (events, _) = generate(&mut c, s, 3);
    assert!(!events
        .iter()
        .any(|e| matches!(e.body, Record::GenerationPrompt { .. })));
    assert_eq!(first_channel(&events), Channel::Reasoning, "{events:?}");
}

#[test]
fn forced_tool_call_round_trip() {
    let d = tools_think_daemon();
    let mut c = d.client();
    let s = forced_weather_session(&mut c);
    // Forcing needs a known name.
    let bad = expect_err(
        &mut c,
        &Request::SetToolChoice {
            session: s,
            choice: "nope".into(),
        },
    );
    assert!(bad.contains("get_weather"), "{bad}");
    let (events, last) = generate(&mut c, s, 128);
    assert_eq!(finish_of(&last), Some(Finish::Grammar), "{last:?}");
    let (call_id, arguments) = events
        .iter()
        .find_map(|e| match &e.body {
            Record::ToolUse { name, arguments } if name == "get_weather" => {
                Some((e.event_id, arguments.clone()))
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no ToolUse in {events:?}"));
    assert!(serde_json::from_str::<serde_json::Value>(&arguments)
        .unwrap()
        .is_object());
    assert!(events.iter().any(|e| matches!(
        e.body,
        Record::Generated {
            channel: Channel::ToolCall,
            ..
        }
    )));
    let Response::ToolCalls { calls } = c.call(&Request::OpenToolCalls { session: s }).unwrap()
    else {
        panic!()
    };
    assert_eq!(calls, vec![(call_id, "get_weather".to_string(), arguments)]);
    // Answer it; an unknown call id is refused.
    let unknown = expect_err(
        &mut c,
        &Request::AppendToolResult {
            session: s,
            call_id: 9999,
            content: "x".into(),
        },
    );
    assert!(unknown.contains("no tool call"), "{unknown}");
    let result = commit(
        &mut c,
        Request::AppendToolResult {
            session: s,
            call_id,
            content: "Sunny, 21 C".into(),
        },
    );
    let span = match &result.body {
        Record::ToolResult { span, .. } => span.clone(),
        other => panic!("{other:?}"),
    };
    assert!(!span.is_empty());
    let again = expect_err(
        &mut c,
        &Request::AppendToolResult {
            session: s,
            call_id,
            content: "x".into(),
        },
    );
    assert!(again.contains("already answered"), "{again}");
    let Response::ToolCalls { calls } = c.call(&Request::OpenToolCalls { session: s }).unwrap()
    else {
        panic!()
    };
    assert!(calls.is_empty());
    // Back to auto: the model answers after the tool result, in a new turn.
    tool_choice(&mut c, s, "auto");
    let (events, last) = generate(&mut c, s, 32);
    assert!(matches!(events[0].body, Record::GenerationPrompt { .. }));
    assert!(matches!(last, Response::Generated { .. }), "{last:?}");
}

/// A forced call cut by max_tokens, its worker killed (the KV and the
/// grammar's state are gone), then continued: the grammar is rebuilt from the
/// turn so far, so the call is finished, not started again, and it is the
/// call the uncut generation made.
#[test]
fn a_cut_forced_call_continues_where_it_stopped() {
    let d = tools_think_daemon();
    let mut c = d.client();
    let whole = forced_weather_session(&mut c);
    let (events, last) = generate(&mut c, whole, 128);
    assert_eq!(finish_of(&last), Some(Finish::Grammar), "{last:?}");
    let calls = |events: &[Event]| -> Vec<(String, String)> {
        events
            .iter()
            .filter_map(|e| match &e.body {
                Record::ToolUse { name, arguments } => Some((name.clone(), arguments.clone())),
                Record::ToolParseFailure { .. } => Some(("parse failure".into(), String::new())),
                _ => None,
            })
            .collect()
    };
    let expected = calls(&events);
    assert_eq!(expected.len(), 1, "{events:?}");
    let n = generated(&events).0.len();
    for cut in [n / 4, n / 2, 3 * n / 4] {
        let s = forced_weather_session(&mut c);
        let (first, last) = generate(&mut c, s, cut as u32);
        assert_eq!(
            finish_of(&last),
            Some(Finish::MaxTokens),
            "cut at {cut}: {last:?}"
        );
        let worker = worker_pid(d.pid());
        unsafe { libc::kill(worker as i32, libc::SIGKILL) };
        while worker_pid(d.pid()) == worker {
            std::thread::sleep(Duration::from_millis(20));
        }
        let (rest, last) = generate(&mut c, s, 128);
        assert_eq!(
            finish_of(&last),
            Some(Finish::Grammar),
            "cut at {cut}: {last:?}"
        );
        let all: Vec<Event> = first.into_iter().chain(rest).collect();
        assert_eq!(calls(&all), expected, "cut at {cut} of {n}: {all:?}");
    }
}

/// The tool choice changed while a turn was open: the turn so far was not
/// written under the grammar, which then starts at the continuation; the
/// lane is not failed, and the call comes.
#[test]
fn a_call_forced_in_the_middle_of_an_open_turn_starts_there() {
    let d = tools_think_daemon();
    let mut c = d.client();
    let s = forced_weather_session(&mut c);
    tool_choice(&mut c, s, "auto");
    let (_, last) = generate(&mut c, s, 3);
    assert_eq!(finish_of(&last), Some(Finish::MaxTokens), "{last:?}");
    tool_choice(&mut c, s, "required");
    let (events, last) = generate(&mut c, s, 128);
    assert_eq!(finish_of(&last), Some(Finish::Grammar), "{last:?}");
    assert!(
        events
            .iter()
            .any(|e| matches!(&e.body, Record::ToolUse { name, .. } if name == "get_weather")),
        "{events:?}"
    );
}

#[test]
fn a_subscriber_sees_provisional_text_ahead_of_the_commits() {
    let d = TestDaemon::start();
    let mut c = d.client();
    let s = asked(&mut c, sampled(2), QUESTION);
    let mut sub = d.client();
    let Response::Subscribed { sub: id } = sub
        .call(&Request::Subscribe {
            session: s,
            cursor: 0,
            provisional: true,
        })
        .unwrap()
    else {
        panic!()
    };
    let socket = d.socket.clone();
    let gen = std::thread::spawn(move || {
        let mut c = Client::connect(&socket).unwrap();
        c.generate(&Request::Generate {
            session: s,
            max_tokens: 40,
        })
        .unwrap()
    });
    let (mut provisional, mut committed) = (String::new(), String::new());
    let mut ids = Vec::new();
    loop {
        match sub.read().unwrap() {
            Response::SubProvisional { sub, text, .. } => {
                assert_eq!(sub, id);
                provisional.push_str(&text);
            }
            Response::SubEvent { event, .. } => {
                ids.push(event.event_id);
                if let Record::Generated { text, finish, .. } = &event.body {
                    committed.push_str(text);
                    if *finish != Finish::Open {
                        break;
                    }
                }
            }
            other => panic!("{other:?}"),
        }
    }
    gen.join().unwrap();
    assert!(!provisional.is_empty(), "provisional text arrived");
    // Every token's text arrives provisionally before its commit, so by the
    // last commit the two agree.
    assert_eq!(provisional, committed);
    assert_eq!(
        ids,
        (0..ids.len() as u64).collect::<Vec<_>>(),
        "backlog then live, no gap"
    );
}

/// A reply cut by a SIGKILL continues after the restart from its last
/// committed token. The tokens before the cut are the uninterrupted run's;
/// the rest is what a cold prefill of the same log draws. The spec allows a
/// re-prefilled history to differ from the original decode in the last bits
/// of floating point, so the continuation is compared with a second daemon
/// resuming a copy of the crashed log (same prefill, same draws), not with
/// the uninterrupted run; a difference from that run is only reported.
#[test]
fn a_reply_cut_by_sigkill_continues_after_restart() {
    let whole = {
        let d = TestDaemon::start();
        let mut c = d.client();
        let s = asked(&mut c, params(1), QUESTION);
        generated(&generate(&mut c, s, 60).0).0
    };
    let mut d = TestDaemon::start();
    let mut c = d.client();
    let s = asked(&mut c, params(1), QUESTION);
    let first = generated(&generate(&mut c, s, 25).0).0;
    d.kill9();
    let mut twin = TestDaemon::new();
    crate::util::copy_dir(&d.sessions, &twin.sessions);
    let resume = |d: &mut TestDaemon| {
        d.spawn_and_wait();
        let (events, last) = generate(&mut d.client(), s, 35);
        assert!(
            matches!(events[0].body, Record::EpochBump),
            "{:?}",
            events[0]
        );
        assert!(matches!(last, Response::Generated { .. }), "{last:?}");
        // The open turn goes on: no new turn's prompt.
        assert!(
            !events
                .iter()
                .any(|e| matches!(e.body, Record::GenerationPrompt { .. })),
            "{events:?}"
        );
        generated(&events).0
    };
    let rest = resume(&mut d);
    let twin_rest = resume(&mut twin);
    assert_eq!(first, whole[..first.len()], "the tokens before the cut");
    assert_eq!(rest, twin_rest, "two cold resumes of the same log");
    // Continued, not started over (greedy: a new reply would begin as the
    // uninterrupted one did).
    assert_ne!(rest[..10], whole[..10], "the reply started over");
    if [&first[..], &rest[..]].concat() != whole {
        eprintln!(
            "note: the re-prefilled continuation differs from the uninterrupted decode \
             (the spec allows it)"
        );
    }
}

#[test]
fn pin_holds_a_deadline_and_zero_clears_it() {
    let d = shared_daemon();
    let mut c = d.client();
    let s = asked(&mut c, params(1), "hi");
    let now = superfluid::actors::now_ms();
    let Response::Pinned { deadline_unix_ms } = c
        .call(&Request::Pin {
            session: s,
            ttl_ms: 60_000,
        })
        .unwrap()
    else {
        panic!()
    };
    assert!(deadline_unix_ms >= now + 60_000 && deadline_unix_ms < now + 70_000);
    assert_eq!(
        c.call(&Request::Pin {
            session: s,
            ttl_ms: 0
        })
        .unwrap(),
        Response::Pinned {
            deadline_unix_ms: 0
        }
    );
    assert!(expect_err(
        &mut c,
        &Request::Pin {
            session: 999,
            ttl_ms: 1
        }
    )
    .contains("unknown"));
}

/// Whether this glibc has the `glibc.malloc.hugetlb` tunable (2.35 on).
fn glibc_has_hugetlb() -> bool {
    // SAFETY: gnu_get_libc_version returns a static NUL-terminated string.
    let v = unsafe { std::ffi::CStr::from_ptr(libc::gnu_get_libc_version()) };
    let mut parts = v
        .to_string_lossy()
        .split('.')
        .map(|p| p.parse::<u32>().unwrap_or(0))
        .collect::<Vec<_>>()
        .into_iter();
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (2, 35)
}

/// The worker's bytes on huge pages (`AnonHugePages` of its smaps_rollup).
fn huge_bytes(pid: u32) -> u64 {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
    rollup
        .lines()
        .find_map(|l| l.strip_prefix("AnonHugePages:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("AnonHugePages")
        * 1024
}

/// The worker reads the model into memory, and its weights and KV cache
/// sit on 2 MiB pages (engine::hugepages); `--mmap` maps the model file
/// instead. Either way it generates.
#[test]
fn the_worker_reads_the_model_onto_huge_pages_unless_mmap() {
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    let model = std::fs::canonicalize(crate::util::model_path()).unwrap();
    let model = model.to_string_lossy().into_owned();
    for mmap in [false, true] {
        let mut d = TestDaemon::new();
        if mmap {
            d.extra_args = vec!["--mmap".into()];
        }
        d.spawn_and_wait();
        let mut c = d.client();
        let s = asked(&mut c, params(1), "Hello.");
        let text = crate::util::generate_text(&mut c, s, 4).expect("generation");
        assert!(!text.is_empty());
        let w = worker_pid(d.pid());
        let maps = std::fs::read_to_string(format!("/proc/{w}/maps")).unwrap();
        assert_eq!(
            maps.contains(&model),
            mmap,
            "the model file mapped: {} (--mmap {mmap})",
            maps.contains(&model)
        );
        if !mmap && !thp.contains("[never]") && !thp.is_empty() && glibc_has_hugetlb() {
            // The weights alone are 92 MiB.
            let huge = huge_bytes(w);
            assert!(
                huge >= 64 << 20,
                "only {huge} bytes on huge pages ({thp:?})"
            );
            assert!(
                d.stderr().contains("MiB of the buffers on 2 MiB pages"),
                "{}",
                d.stderr()
            );
        }
    }
}

/// A worker that cannot be started again (its binary is gone) fails the
/// generations waiting for it, saying why, instead of holding them forever.
#[test]
fn a_worker_that_cannot_be_respawned_fails_what_waits_for_it() {
    let (d, exe) = with_copy(crate::util::bin(), "superfluid-copy", |d, p| d.binary = p);
    let (_, s) = one_reply(&d);
    std::fs::remove_file(&exe).unwrap();
    unsafe { libc::kill(worker_pid(d.pid()) as i32, libc::SIGKILL) };
    // Until the lane has seen the death a request can meet the dead worker
    // ("the worker died"); then the respawn fails, and so must what waits.
    let message = until_err_with(&d, "the worker could not start", || {
        let socket = d.socket.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut c = Client::connect(&socket).expect("connecting");
            let _ = tx.send(generate(&mut c, s, 4).1);
        });
        rx.recv_timeout(Duration::from_secs(30))
            .expect("a Generate waited 30 s for a worker that cannot start")
    });
    assert!(message.contains("superfluid-copy"), "{message}");
}

/// A daemon started on a copy of `file` in its own directory, named `name`
/// (`set` points the daemon at it), and the copy's path.
fn with_copy(
    file: impl AsRef<std::path::Path>,
    name: &str,
    set: impl FnOnce(&mut TestDaemon, std::path::PathBuf),
) -> (TestDaemon, std::path::PathBuf) {
    let mut d = TestDaemon::new();
    let copy = d.path().join(name);
    std::fs::copy(file, &copy).unwrap();
    set(&mut d, copy.clone());
    d.spawn_and_wait();
    (d, copy)
}

/// A client and a session asked `QUESTION` that has generated once.
fn one_reply(d: &TestDaemon) -> (Client, SessionId) {
    let mut c = d.client();
    let s = asked(&mut c, sampled(5), QUESTION);
    assert!(matches!(
        generate(&mut c, s, 4).1,
        Response::Generated { .. }
    ));
    (c, s)
}

/// Runs `attempt` (a Generate) until it answers an `Err` containing `want`,
/// for up to 60 s; any other `Err` (a request that met the dead worker)
/// tries again, a reply that generated fails the test. Returns the message.
fn until_err_with(d: &TestDaemon, want: &str, mut attempt: impl FnMut() -> Response) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let last = attempt();
        let Response::Err { message } = last else {
            panic!("generated, where each request had to fail: {last:?}");
        };
        if message.contains(want) {
            return message;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never {want:?}: {message}\n{}",
            d.stderr()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
