//! Scheduling classes end to end: a background session (`SetQos` class 3)
//! beside a class-0 one advances every `SetBackgroundRate`-th step, so it
//! really runs slower, and at full speed again with divisor 1.

use std::thread;

use superfluid::frontend::socket::Client;
use superfluid::wire::{Record, Request, Response, Role, SessionId};

use crate::util::{commit, TestDaemon};

fn story_session(d: &TestDaemon, c: &mut Client, class: u8) -> SessionId {
    let s = d.create(c);
    commit(
        c,
        Request::AppendMessage {
            session: s,
            role: Role::User.into(),
            text: "Tell me a long story about a lighthouse keeper and the sea.".into(),
        },
    );
    if class != 0 {
        commit(
            c,
            Request::SetQos {
                session: s,
                class,
                batch_invariant: false,
            },
        );
    }
    s
}

fn generated_tokens(d: &TestDaemon, s: SessionId) -> usize {
    d.read_all(s)
        .iter()
        .map(|e| match &e.body {
            Record::Generated { span, .. } => span.len(),
            _ => 0,
        })
        .sum()
}

/// Runs a 96-token class-0 generation beside an open-ended background one
/// on the same prompt (greedy, so both draw the same tokens); returns the
/// tokens each drew while both generated: from the class-0 one's first
/// committed chunk to its end (96 tokens, so that window stays long when a
/// loaded machine sees that first chunk late).
fn race(d: &TestDaemon, divisor: u32) -> (usize, usize) {
    let mut c = d.client();
    assert!(matches!(
        d.call(&Request::SetBackgroundRate { divisor }),
        Response::Ack
    ));
    let fg = story_session(d, &mut c, 0);
    let bg = story_session(d, &mut c, 3);
    let mut bg_client = d.client();
    let background = thread::spawn(move || {
        bg_client
            .generate(&Request::Generate {
                session: bg,
                max_tokens: 2000,
            })
            .unwrap()
    });
    d.until_generated(bg);
    let foreground = thread::spawn(move || {
        c.generate(&Request::Generate {
            session: fg,
            max_tokens: 96,
        })
        .unwrap()
    });
    d.until_generated(fg);
    let (fg0, bg0) = (generated_tokens(d, fg), generated_tokens(d, bg));
    let replies = foreground.join().unwrap();
    assert!(
        matches!(replies.last(), Some(Response::Generated { .. })),
        "{replies:?}"
    );
    let (fg1, bg1) = (generated_tokens(d, fg), generated_tokens(d, bg));
    assert_eq!(fg1, 96, "the class-0 generation ended early");
    // Cancelling (or Err when it already ended by itself).
    let _ = d.call(&Request::Cancel { session: bg });
    background.join().unwrap();
    (fg1 - fg0, bg1 - bg0)
}

#[test]
fn a_background_session_runs_slower_beside_a_foreground_one() {
    let mut d = TestDaemon::new();
    d.extra_args = ["--parallel", "2", "--ctx-size", "4096", "--threads", "2"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    d.spawn_and_wait();

    let (fg, bg) = race(&d, 4);
    // Every fourth step: about a quarter to a third of the other's tokens
    // (steps in flight when the class-0 draw lands count too); at most half.
    assert!(
        bg * 2 <= fg,
        "divisor 4: background drew {bg} while the class-0 session drew {fg}"
    );

    // The control: divisor 1, the same two sessions keep pace.
    let (fg1, bg1) = race(&d, 1);
    assert!(
        bg1 * 4 >= fg1 * 3,
        "divisor 1: background drew {bg1} while the class-0 session drew {fg1}"
    );
    eprintln!(
        "while both generated: {bg} background tokens beside {fg} at divisor 4, {bg1} beside {fg1} at divisor 1"
    );
}
