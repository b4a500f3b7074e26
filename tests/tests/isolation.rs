//! One client cannot stall or fail the others (issue 15, "Isolation"): tool
//! schemas capped at AppendSystem, errors belonging to the item of a
//! batched step that caused them, requests retried on a respawned worker,
//! the listener's limits, the worker's replies checked, control tokens
//! never parsed from user or tool text, a step that never returns.

use std::time::{Duration, Instant};

use superfluid::frontend::socket::Client;
use superfluid::wire::{Finish, Request, Response, Role};

use crate::util::*;

fn user(c: &mut Client, s: u64, text: &str) {
    commit(
        c,
        Request::AppendMessage {
            session: s,
            role: Role::User.into(),
            text: text.into(),
        },
    );
}

/// Runs a Generate on its own connection in a thread; its replies.
fn generate_in_thread(
    d: &TestDaemon,
    s: u64,
    max_tokens: u32,
) -> std::thread::JoinHandle<Vec<Response>> {
    let mut c = d.client();
    std::thread::spawn(move || {
        c.generate(&Request::Generate {
            session: s,
            max_tokens,
        })
        .expect("generate")
    })
}

fn last_finish(replies: &[Response]) -> Result<Finish, String> {
    match replies.last() {
        Some(Response::Generated { finish, .. }) => Ok(*finish),
        Some(Response::Err { message }) => Err(message.clone()),
        other => panic!("no summary: {other:?}"),
    }
}

/// Item 1: a 5,000-property schema (about 60 KB) is refused at AppendSystem,
/// fast and naming the limit, while another client's generation goes on.
#[test]
fn a_huge_tool_schema_is_refused_fast_and_others_generate() {
    let d = TestDaemon::start();
    let mut c = d.client();
    let a = d.create(&mut c);
    user(&mut c, a, "Count from one to a hundred.");
    let gen = generate_in_thread(&d, a, 48);
    let b = d.create(&mut c);
    let props: Vec<String> = (0..5000)
        .map(|i| format!(r#""p{i}":{{"type":"string"}}"#))
        .collect();
    let tool = format!(
        r#"{{"type":"function","function":{{"name":"huge","parameters":{{"type":"object","properties":{{{}}}}}}}}}"#,
        props.join(",")
    );
    assert!(tool.len() > 60_000);
    let t = Instant::now();
    let message = expect_err(
        &mut c,
        &Request::AppendSystem {
            session: b,
            text: None,
            tools: vec![tool],
        },
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(
        message.contains("256 properties") || message.contains("bytes"),
        "{message}"
    );
    // A repetition llama.cpp would refuse is refused here, by name.
    let message = expect_err(
        &mut c,
        &Request::AppendSystem {
            session: b,
            text: None,
            tools: vec![r#"{"name":"t","parameters":{"type":"object","properties":{"a":{"type":"string","minLength":3000}}}}"#.into()],
        },
    );
    assert!(message.contains("\"minLength\": 3000"), "{message}");
    let replies = gen.join().unwrap();
    assert!(last_finish(&replies).is_ok(), "{replies:?}");
}

/// A connection holds at most `MAX_SUBSCRIPTIONS_PER_CONNECTION` live
/// subscriptions: one more is an Err (and another connection is not
/// affected); an Unsubscribe makes room again.
#[test]
fn subscriptions_per_connection_are_capped() {
    use superfluid::frontend::conn::MAX_SUBSCRIPTIONS_PER_CONNECTION as MAX;
    let d = TestDaemon::start();
    let mut c = d.client();
    let s = d.create(&mut c);
    // The reply to a request, past the sub frames queued before it.
    let reply = |c: &mut Client, req: &Request| {
        let mut r = c.call(req).unwrap();
        while matches!(
            r,
            Response::SubEvent { .. } | Response::SubProvisional { .. } | Response::SubEnded { .. }
        ) {
            r = c.read().unwrap();
        }
        r
    };
    let subscribe = Request::Subscribe {
        session: s,
        cursor: 0,
        provisional: false,
    };
    let mut subs = Vec::new();
    for _ in 0..MAX {
        match reply(&mut c, &subscribe) {
            Response::Subscribed { sub } => subs.push(sub),
            other => panic!("{other:?}"),
        }
    }
    match reply(&mut c, &subscribe) {
        Response::Err { message } => assert!(message.contains("Unsubscribe"), "{message}"),
        other => panic!("one over the cap was taken: {other:?}"),
    }
    let mut other = d.client();
    assert!(matches!(
        reply(&mut other, &subscribe),
        Response::Subscribed { .. }
    ));
    let r = reply(&mut c, &Request::Unsubscribe { sub: subs[0] });
    assert!(matches!(r, Response::Unsubscribed), "{r:?}");
    let r = reply(&mut c, &subscribe);
    assert!(matches!(r, Response::Subscribed { .. }), "{r:?}");
}

/// Item 2: a worker that stops answering (here SIGSTOPped, as a llama.cpp
/// call that never returns would) is taken for hung past its step's
/// deadline: it is killed, the generation on it fails with a message saying
/// so, the session is free again, and the next generation runs on a new
/// worker.
#[test]
fn a_hung_worker_is_killed_past_the_step_deadline() {
    let mut d = TestDaemon::new();
    // Short enough for a test, long enough that the new worker's steps on a
    // loaded machine (the suite runs many daemons at once) are not taken for
    // hangs too.
    d.extra_args = vec!["--step-timeout-secs".into(), "10".into()];
    d.spawn_and_wait();
    let mut c = d.client();
    let s = d.create(&mut c);
    user(&mut c, s, "Count from one to a thousand.");
    let gen = generate_in_thread(&d, s, 2000);
    d.until_generated(s);
    let worker = crate::generate::worker_pid(d.pid());
    // SAFETY: kill(2) on the test daemon's own worker.
    unsafe { libc::kill(worker as libc::pid_t, libc::SIGSTOP) };
    let started = Instant::now();
    // Waited for with a bound of its own, so a lane that never notices the
    // hang fails here instead of hanging the suite.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(gen.join());
    });
    let replies = rx
        .recv_timeout(Duration::from_secs(90))
        .expect("the generation on a hung worker never ended")
        .unwrap();
    let message = last_finish(&replies).expect_err("the generation went on");
    assert!(message.contains("did not answer"), "{message}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "the hang was noticed after {:?}",
        started.elapsed()
    );
    // The stopped worker is gone (SIGKILL ends a stopped process too).
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::path::Path::new(&format!("/proc/{worker}")).exists()
        && std::fs::read_to_string(format!("/proc/{worker}/stat")).is_ok_and(|st| {
            !st.rsplit_once(')')
                .is_some_and(|x| x.1.trim_start().starts_with('Z'))
        })
    {
        assert!(Instant::now() < deadline, "the hung worker still runs");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The session is not left busy, and a new worker serves it.
    user(&mut c, s, "Now name a colour.");
    let replies = generate_in_thread(&d, s, 8).join().unwrap();
    let finish = last_finish(&replies);
    assert!(
        matches!(finish, Ok(Finish::MaxTokens | Finish::EndOfTurn)),
        "{finish:?}\n{}",
        d.stderr()
    );
}
