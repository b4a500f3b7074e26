//! `RUST_LOG` and `SetLogLevel` take env_logger directives: per-target
//! levels that stay per target (`superfluid::store=debug,warn`), at start
//! and while the daemon runs; a directive env_logger refuses is refused.

use superfluid::wire::{Request, Response, SessionId};

use crate::util::{commit, expect_err, TestDaemon};

/// The (level, target) of each env_logger line: `[<time> LEVEL target] msg`.
fn records(stderr: &str) -> Vec<(String, String)> {
    stderr
        .lines()
        .filter_map(|l| {
            let head = l.strip_prefix('[')?.split(']').next()?;
            let mut words = head.split_whitespace();
            let (_time, level, target) = (words.next()?, words.next()?, words.next()?);
            Some((level.to_string(), target.to_string()))
        })
        .collect()
}

/// The targets of the DEBUG lines, split into `superfluid::store` and the rest.
fn debug_targets(d: &TestDaemon) -> (usize, Vec<String>) {
    let (store, other): (Vec<_>, Vec<_>) = records(&d.stderr())
        .into_iter()
        .filter(|(level, _)| level == "DEBUG")
        .map(|(_, target)| target)
        .partition(|t| t == "superfluid::store" || t.starts_with("superfluid::store::"));
    (store.len(), other)
}

fn append(d: &TestDaemon, session: SessionId, text: &str) {
    commit(
        &mut d.client(),
        Request::Append {
            session,
            text: Some(text.into()),
            span: vec![],
        },
    );
}

fn set(d: &TestDaemon, directive: &str) -> Response {
    d.call(&Request::SetLogLevel {
        directive: directive.into(),
    })
}

#[test]
fn set_log_level_takes_per_target_directives() {
    let mut d = TestDaemon::new();
    d.rust_log = "warn".into();
    d.spawn_and_wait();
    let mut c = d.client();
    let s = d.create(&mut c);
    append(&d, s, "at warn\n");
    assert!(
        records(&d.stderr())
            .iter()
            .all(|(l, _)| l != "INFO" && l != "DEBUG"),
        "RUST_LOG=warn logged below warn:\n{}",
        d.stderr()
    );

    assert_eq!(set(&d, "superfluid::store=debug,warn"), Response::Ack);
    // A new session: its actor's "started" DEBUG line is not the store's.
    let s = d.create(&mut c);
    append(&d, s, "store at debug\n");
    let (store, other) = debug_targets(&d);
    assert!(
        store >= 1,
        "no DEBUG line from superfluid::store:\n{}",
        d.stderr()
    );
    assert!(other.is_empty(), "DEBUG lines outside the store: {other:?}");

    // Garbage is refused, naming it, and the old filter stays.
    for bad in ["superfluid=loud", "===", ""] {
        let message = expect_err(
            &mut c,
            &Request::SetLogLevel {
                directive: bad.into(),
            },
        );
        assert!(message.contains("log directive"), "{bad:?}: {message}");
        if !bad.is_empty() {
            assert!(message.contains(&format!("{bad:?}")), "{bad:?}: {message}");
        }
    }
    let long = expect_err(
        &mut c,
        &Request::SetLogLevel {
            directive: "x".repeat(1025),
        },
    );
    assert_eq!(long, "log directive is 1025 bytes; at most 1024");
    append(&d, s, "still store at debug\n");
    let (after, other) = debug_targets(&d);
    assert!(
        after > store,
        "the store's DEBUG lines stopped:\n{}",
        d.stderr()
    );
    assert!(other.is_empty(), "DEBUG lines outside the store: {other:?}");

    // A plain level is every target's, as before.
    assert_eq!(set(&d, "debug"), Response::Ack);
    let s = d.create(&mut c);
    append(&d, s, "everything at debug\n");
    let (_, other) = debug_targets(&d);
    assert!(
        other
            .iter()
            .any(|t| t.starts_with("superfluid::actors::session")),
        "`debug` did not reach the session actor: {other:?}"
    );

    // RUST_LOG takes the same directives at start.
    d.stop();
    d.rust_log = "superfluid::store=debug,warn".into();
    d.spawn_and_wait();
    let s = d.create(&mut d.client());
    append(&d, s, "store at debug from the start\n");
    let (store, other) = debug_targets(&d);
    assert!(
        store >= 1,
        "RUST_LOG: no DEBUG line from the store:\n{}",
        d.stderr()
    );
    assert!(
        other.is_empty(),
        "RUST_LOG: DEBUG lines outside the store: {other:?}"
    );
    assert!(
        records(&d.stderr()).iter().all(|(l, _)| l != "INFO"),
        "RUST_LOG collapsed into one level:\n{}",
        d.stderr()
    );
}
