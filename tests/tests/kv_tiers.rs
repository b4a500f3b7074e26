//! The KV tiers on the real model: the host-memory tier (`--cache-ram-mb`)
//! brings back a conversation evicted beyond `--parallel` without a
//! prefill, and the reply is the one it gets when it never left the cells.

use std::time::Instant;

use superfluid::frontend::socket::Client;
use superfluid::wire::{Record, Request, Response, Role, SessionId, Token};

use crate::util::{commit, created, metric, params, TestDaemon};

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
    let (warm, reply, ms) = timed_turn(&mut c, sessions[0]);
    (d, warm, reply, ms)
}

/// A 24-token turn as a first token (timed: the time to first token,
/// prefill or restore included) then the 23 others (a cut turn continued
/// draws what the uncut one does): (warm_prefix, reply, ms to first token).
fn timed_turn(c: &mut Client, s: SessionId) -> (u64, Vec<Token>, f64) {
    let t = Instant::now();
    let (warm, mut reply, _) = generate(c, s, 1);
    let ttft_ms = t.elapsed().as_secs_f64() * 1e3;
    reply.extend(generate(c, s, 23).1);
    (warm, reply, ttft_ms)
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
    // Prefilled again: the spec allows the last bits of floating point to
    // differ from the decode that built the cells, so this reply is not
    // compared with the restored one (which must equal the resident one).
    assert!(!reply3.is_empty());
    eprintln!(
        "turn 2 of an evicted conversation ({warm} tokens of history), time to first token: \
         from host memory {spill_ms:.0} ms, resident {resident_ms:.0} ms, prefilled {cold_ms:.0} ms"
    );
}

/// A session of ~300 tokens, one turn, on a daemon with `--park`; returns
/// the daemon (stopped) and the session.
fn parked_session(d: &mut TestDaemon) -> SessionId {
    d.spawn_and_wait();
    let mut c = d.client();
    let s = created(
        &mut c,
        Request::Create {
            parent: None,
            params: params(1),
        },
    );
    say(&mut c, s, &long_message(9));
    generate(&mut c, s, 8);
    say(&mut c, s, "And the lightest?");
    d.stop();
    s
}

fn park_daemon() -> TestDaemon {
    let mut d = TestDaemon::new();
    d.extra_args = [
        "--park",
        "--ctx-size",
        "2048",
        "--parallel",
        "2",
        "--threads",
        "2",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    d
}

#[test]
fn park_lossy_artifacts_are_about_half_the_size_and_the_session_still_answers() {
    let mut full = park_daemon();
    let s = parked_session(&mut full);
    let mut lossy = park_daemon();
    lossy.extra_args.push("--park-lossy".into());
    assert_eq!(parked_session(&mut lossy), s);
    let artifact = |d: &TestDaemon| d.sessions.join("park").join(format!("{s}.park"));
    let (f, l) = (
        std::fs::read(artifact(&full)).unwrap(),
        std::fs::read(artifact(&lossy)).unwrap(),
    );
    // The header's KV type says how the state is stored: 1 f16, 2 Q8_0.
    assert_eq!(u32::from_le_bytes(f[12..16].try_into().unwrap()), 1);
    assert_eq!(u32::from_le_bytes(l[12..16].try_into().unwrap()), 2);
    let ratio = l.len() as f64 / f.len() as f64;
    assert!((0.45..0.6).contains(&ratio), "lossy/full size {ratio:.3}");

    // Both restored after a restart: warm from disk, and the lossy one
    // answers as the lossless one begins to.
    full.spawn_and_wait();
    let (_, full_reply, _) = timed_turn(&mut full.client(), s);
    lossy.spawn_and_wait();
    let (warm, lossy_reply, ms) = timed_turn(&mut lossy.client(), s);
    assert!(warm > 300, "warm_prefix {warm} from the lossy artifact");
    assert!(!lossy_reply.is_empty());
    assert_eq!(
        lossy_reply[0], full_reply[0],
        "the first token of the reply"
    );
    let same = full_reply
        .iter()
        .zip(&lossy_reply)
        .take_while(|(a, b)| a == b)
        .count();
    eprintln!(
        "park-lossy: {} bytes against {} ({ratio:.3}x) for {warm} tokens; first token in \
         {ms:.0} ms; {same} of {} reply tokens as the lossless artifact's",
        l.len(),
        f.len(),
        full_reply.len()
    );
}

#[test]
fn kv_bits_8_parks_q8_state_and_an_f16_cache_resumes_cold_from_it() {
    let mut q8 = park_daemon();
    q8.extra_args.extend(["--kv-bits", "8"].map(String::from));
    let s = parked_session(&mut q8);
    let mut f16 = park_daemon();
    assert_eq!(parked_session(&mut f16), s);
    let artifact = |d: &TestDaemon| d.sessions.join("park").join(format!("{s}.park"));
    let (q, f) = (
        std::fs::read(artifact(&q8)).unwrap(),
        std::fs::read(artifact(&f16)).unwrap(),
    );
    // The header names the cache's type (ggml's 8: Q8_0), and the state of
    // a Q8_0 cache is about half an f16 one's.
    assert_eq!(u32::from_le_bytes(q[12..16].try_into().unwrap()), 8);
    let ratio = q.len() as f64 / f.len() as f64;
    assert!((0.45..0.6).contains(&ratio), "q8/f16 state {ratio:.3}");

    // Restarted with --kv-bits 8: restored from disk.
    q8.spawn_and_wait();
    let (warm, reply, ms) = timed_turn(&mut q8.client(), s);
    q8.stop();
    assert!(warm > 300, "warm_prefix {warm} with --kv-bits 8");
    assert!(!reply.is_empty());
    eprintln!(
        "kv-bits 8: park artifact {} bytes against {} ({ratio:.3}x); first token after a \
         restart {ms:.0} ms",
        q.len(),
        f.len()
    );

    // The same sessions on an f16 cache: the artifact is not one it can
    // restore, so the session prefills (one warning), and answers.
    q8.extra_args = park_daemon().extra_args.clone();
    q8.spawn_and_wait();
    let (w, r, _) = timed_turn(&mut q8.client(), s);
    q8.stop();
    assert!(
        w < 50,
        "warm_prefix {w} from a Q8_0 artifact on an f16 cache"
    );
    assert!(!r.is_empty());
    assert!(
        q8.stderr().contains("KV type 8"),
        "the warning names the type"
    );

    // --park-lossy needs an f16 cache.
    let mut both = TestDaemon::new();
    let failed = both.start_expect_exit(&["--park-lossy".into(), "--kv-bits".into(), "8".into()]);
    assert!(!failed.status.success());
    assert!(failed.stderr.contains("--kv-bits 8"), "{}", failed.stderr);
}

#[test]
fn park_restores_a_session_after_a_restart_and_a_bad_artifact_prefills() {
    let mut d = park_daemon();
    let s = parked_session(&mut d);
    let artifact = |dir: &std::path::Path| dir.join("park").join(format!("{s}.park"));
    let sealed = std::fs::read(artifact(&d.sessions)).expect("the artifact was sealed");
    assert!(sealed.len() > 124 + 300 * 4);
    // Copies of the sessions dir as sealed: no artifact, a flipped bit in
    // the state, a truncated file. Each resumes cold, with the same reply.
    let variants: Vec<(&str, TestDaemon)> = ["none", "flip", "truncate", "rebase", "rebase-none"]
        .into_iter()
        .map(|what| {
            let mut copy = TestDaemon::new();
            copy_dir(&d.sessions, &copy.sessions);
            let p = artifact(&copy.sessions);
            let mut bytes = sealed.clone();
            match what {
                "none" | "rebase-none" => std::fs::remove_file(&p).unwrap(),
                "rebase" => {}
                "flip" => {
                    let at = bytes.len() - 1000;
                    bytes[at] ^= 0x10;
                    std::fs::write(&p, &bytes).unwrap();
                }
                _ => {
                    bytes.truncate(bytes.len() / 2);
                    std::fs::write(&p, &bytes).unwrap();
                }
            }
            copy.extra_args = d.extra_args.clone();
            (what, copy)
        })
        .collect();

    // Restart with the artifact: the history comes from disk.
    d.spawn_and_wait();
    let (warm, reply, park_ms) = timed_turn(&mut d.client(), s);
    d.stop();
    assert!(warm > 300, "warm_prefix {warm} after a restart with --park");

    // The same conversation in one daemon that never stopped: a parked
    // session restored across a restart replies exactly what it would have
    // replied had it stayed resident.
    let mut uninterrupted = park_daemon();
    uninterrupted.spawn_and_wait();
    let mut c = uninterrupted.client();
    let u = created(
        &mut c,
        Request::Create {
            parent: None,
            params: params(1),
        },
    );
    say(&mut c, u, &long_message(9));
    generate(&mut c, u, 8);
    say(&mut c, u, "And the lightest?");
    let (_, resident_reply, _) = timed_turn(&mut c, u);
    uninterrupted.stop();
    assert_eq!(
        reply, resident_reply,
        "the restored reply differs from the resident one"
    );

    let mut rebased = Vec::new();
    let mut cold: Option<Vec<Token>> = None;
    for (what, mut copy) in variants {
        copy.spawn_and_wait();
        if what.starts_with("rebase") {
            // A rebased branch (its first message rewritten) shares only the
            // template's opening with the artifact: cold, and correct.
            let b = rebase_first_message(&mut copy.client(), s, "Name three colours.");
            let (w, r, _) = timed_turn(&mut copy.client(), b);
            copy.stop();
            assert!(w < 50, "{what}: warm_prefix {w}");
            rebased.push(r);
            continue;
        }
        let (w, r, cold_ms) = timed_turn(&mut copy.client(), s);
        copy.stop();
        assert!(w < 50, "{what}: warm_prefix {w}");
        // A cold resume prefills the history again, which can differ from
        // the original decode in the last bits of floating point (the spec
        // says so), so it is compared with the other cold resumes, not with
        // the parked reply: every unusable artifact resumes exactly as no
        // artifact does.
        assert!(!r.is_empty(), "{what}: no reply");
        match &cold {
            None => cold = Some(r.clone()),
            Some(first) => assert_eq!(
                &r, first,
                "{what}: differs from the resume without an artifact"
            ),
        }
        if what != "none" {
            let log = copy.stderr();
            assert_eq!(
                log.matches("unusable").count(),
                1,
                "{what}: not one warning in\n{log}"
            );
        } else {
            eprintln!(
                "park: {} bytes for {warm} tokens ({} a token); time to first token after a restart {park_ms:.0} ms with the artifact, {cold_ms:.0} ms without",
                sealed.len(),
                sealed.len() as u64 / warm.max(1)
            );
        }
    }
    // The rebased branch replies the same with the parent's artifact on
    // disk as without it.
    assert_eq!(rebased.len(), 2);
    assert_eq!(rebased[0], rebased[1]);
}

/// Rebases `s` with its first user message replaced by `text`; returns the
/// branch.
fn rebase_first_message(c: &mut Client, s: SessionId, text: &str) -> SessionId {
    let Response::Events { events } = c
        .call(&Request::Read {
            session: s,
            cursor: 0,
        })
        .unwrap()
    else {
        panic!("Read");
    };
    let first = events
        .iter()
        .find(|e| {
            matches!(
                &e.body,
                Record::Message {
                    role: Role::User,
                    ..
                }
            )
        })
        .expect("a user message")
        .event_id;
    created(
        c,
        Request::Rebase {
            session: s,
            edits: vec![superfluid::wire::Edit::Replace {
                from: first,
                to: first + 1,
                role: Role::User.into(),
                text: text.into(),
            }],
            params: None,
        },
    )
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

/// Purge deletes the session's park artifact (and the index forgets it);
/// an artifact of a purged session found at start is deleted, not indexed.
#[test]
fn purge_deletes_the_park_artifact_and_a_start_deletes_a_late_one() {
    let mut d = park_daemon();
    let s = parked_session(&mut d);
    let artifact = d.sessions.join("park").join(format!("{s}.park"));
    let sealed = std::fs::read(&artifact).expect("the artifact was sealed");
    d.spawn_and_wait();
    assert_eq!(metric(&d, "superfluid_kv_parked_artifacts"), 1.0);
    let mut c = d.client();
    let Response::Inspection { inspection } = c.call(&Request::Inspect { session: s }).unwrap()
    else {
        panic!("Inspect")
    };
    match c
        .call(&Request::Purge {
            session: s,
            expected_generation: inspection.generation,
            mode: superfluid::wire::PurgeMode::Cascade,
        })
        .unwrap()
    {
        Response::Purged { sessions } => assert_eq!(sessions, vec![s]),
        other => panic!("Purge: {other:?}"),
    }
    assert!(!artifact.exists(), "Purge left {}", artifact.display());
    assert_eq!(metric(&d, "superfluid_kv_parked_artifacts"), 0.0);
    d.stop();
    // A seal that landed after the purge (put back by hand here).
    std::fs::write(&artifact, &sealed).unwrap();
    d.spawn_and_wait();
    assert!(
        !artifact.exists(),
        "a purged session's artifact survived a start"
    );
    assert_eq!(metric(&d, "superfluid_kv_parked_artifacts"), 0.0);
}
