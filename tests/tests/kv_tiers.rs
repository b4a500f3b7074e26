//! The KV tiers on the real model: the host-memory tier (`--cache-ram-mb`)
//! brings back a conversation evicted beyond `--parallel` without a
//! prefill, and the reply is the one it gets when it never left the cells.

use std::time::Instant;

use superfluid::frontend::socket::Client;
use superfluid::wire::{Record, Request, Response, Role, SessionId, Token};

use crate::util::{commit, created, params, TestDaemon};

/// About 300 tokens of a conversation's own.
fn long_message(n: usize) -> String {
    let items: Vec<String> = (0..45)
        .map(|i| format!("item {i} of list {n} weighs {}", (i * 7 + n * 13) % 97))
        .collect();
    format!(
        "Here is list {n}: {}. Which item is the heaviest?",
        items.join(", ")
    )
}

fn say(c: &mut Client, s: SessionId, text: &str) {
    commit(
        c,
        Request::AppendMessage {
            session: s,
            role: Role::User.into(),
            text: text.into(),
        },
    );
}

/// Generates greedily; returns (warm_prefix, tokens generated, ms to the
/// first token).
fn generate(c: &mut Client, s: SessionId, max_tokens: u32) -> (u64, Vec<Token>, f64) {
    let t = Instant::now();
    let mut first_ms = None;
    let mut tokens = Vec::new();
    let replies = c
        .generate(&Request::Generate {
            session: s,
            max_tokens,
        })
        .unwrap();
    // The socket client gathers the replies; the TTFT is approximate (the
    // whole stream's time when the client buffers).
    for r in &replies {
        if let Response::Delta { event } = r {
            if let Record::Generated { span, .. } = &event.body {
                first_ms.get_or_insert(t.elapsed().as_secs_f64() * 1e3);
                tokens.extend_from_slice(span);
            }
        }
    }
    match replies.last() {
        Some(Response::Generated { warm_prefix, .. }) => {
            (*warm_prefix, tokens, first_ms.unwrap_or(0.0))
        }
        other => panic!("{other:?}"),
    }
}

fn metric(d: &TestDaemon, name: &str) -> f64 {
    let Response::Text { text } = d.call(&Request::Metrics) else {
        panic!("Metrics");
    };
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
}

/// Five conversations of ~300 tokens on a daemon started with `args`, then
/// turn 2 of the first: (its warm_prefix, its reply, its wall time in ms).
fn five_then_first(args: &[&str]) -> (TestDaemon, u64, Vec<Token>, f64) {
    let mut d = TestDaemon::new();
    d.extra_args = args.iter().map(|a| a.to_string()).collect();
    d.spawn_and_wait();
    let mut c = d.client();
    let sessions: Vec<SessionId> = (0..5)
        .map(|n| {
            let s = created(
                &mut c,
                Request::Create {
                    parent: None,
                    params: params(1),
                },
            );
            say(&mut c, s, &long_message(n));
            generate(&mut c, s, 8);
            s
        })
        .collect();
    say(&mut c, sessions[0], "And the lightest?");
    let t = Instant::now();
    let (warm, reply, _) = generate(&mut c, sessions[0], 24);
    let ms = t.elapsed().as_secs_f64() * 1e3;
    (d, warm, reply, ms)
}

#[test]
fn a_conversation_evicted_beyond_parallel_comes_back_from_host_memory() {
    let common = ["--ctx-size", "4096", "--threads", "2"];
    let spill: Vec<&str> = common
        .iter()
        .copied()
        .chain(["--parallel", "2", "--cache-ram-mb", "512"])
        .collect();
    let (d, warm, reply, spill_ms) = five_then_first(&spill);
    // The first conversation left the cells (two sequences, five
    // conversations) and came back from host memory.
    assert!(warm > 300, "warm_prefix {warm}");
    let restored = metric(&d, "superfluid_kv_restored_tokens_total");
    assert_eq!(restored as u64, warm, "restored {restored}");
    assert!(metric(&d, "superfluid_kv_spilled_bytes") > 0.0);
    drop(d);

    // Everything resident: the same warm prefix and the same greedy reply.
    let resident: Vec<&str> = common
        .iter()
        .copied()
        .chain(["--parallel", "8", "--cache-ram-mb", "0"])
        .collect();
    let (_d2, warm2, reply2, resident_ms) = five_then_first(&resident);
    assert_eq!(warm, warm2);
    assert_eq!(reply, reply2);

    // Without the tier, the first conversation is prefilled again.
    let off: Vec<&str> = common
        .iter()
        .copied()
        .chain(["--parallel", "2", "--cache-ram-mb", "0"])
        .collect();
    let (_d3, warm3, reply3, cold_ms) = five_then_first(&off);
    assert!(warm3 < 50, "warm_prefix {warm3} without the tier");
    assert_eq!(reply, reply3);
    eprintln!(
        "turn 2 of an evicted conversation ({warm} tokens of history): \
         from host memory {spill_ms:.0} ms, resident {resident_ms:.0} ms, prefilled {cold_ms:.0} ms"
    );
}
