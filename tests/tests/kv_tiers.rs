//! The KV tiers on the real model: the host-memory tier (`--cache-ram-mb`)
//! brings back a conversation evicted beyond `--parallel` without a
//! prefill, and the reply is the one it gets when it never left the cells.

use std::time::{Instant, SystemTime};

use superfluid::engine::park;
use superfluid::frontend::socket::Client;
use superfluid::wire::{Record, Request, Response, Role, SessionId, Token};

use crate::util::{commit, created, metric, params, read_events, TestDaemon};

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

/// A new session (greedy, seed 1) with one user message and an 8-token
/// reply.
fn conversation(c: &mut Client, text: &str) -> SessionId {
    let s = created(
        c,
        Request::Create {
            parent: None,
            params: params(1),
        },
    );
    say(c, s, text);
    generate(c, s, 8);
    s
}

/// Five conversations of ~300 tokens on a daemon started with `args`, then
/// turn 2 of the first: (its warm_prefix, its reply, its wall time in ms).
fn five_then_first(args: &[&str]) -> (TestDaemon, u64, Vec<Token>, f64) {
    let mut d = TestDaemon::new();
    d.extra_args = args.iter().map(|a| a.to_string()).collect();
    d.spawn_and_wait();
    let mut c = d.client();
    let sessions: Vec<SessionId> = (0..5)
        .map(|n| conversation(&mut c, &long_message(n)))
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
    let s = conversation(&mut c, &long_message(9));
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

/// Parked state holds the conversation's tokens: the park directory is the
/// owner's only (0700) and so is each artifact (0600), also in a sessions
/// directory the user made readable by others beforehand (0755), where the
/// umask's modes (0755, 0644) left them readable.
#[test]
fn parked_state_is_the_owners_only() {
    use std::os::unix::fs::PermissionsExt;
    let mut d = park_daemon();
    std::fs::create_dir_all(&d.sessions).unwrap();
    std::fs::set_permissions(&d.sessions, std::fs::Permissions::from_mode(0o755)).unwrap();
    let s = parked_session(&mut d);
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let dir = d.sessions.join("park");
    assert_eq!(mode(&dir), 0o700, "the park directory");
    let artifact = dir.join(format!("{s}.park"));
    assert_eq!(mode(&artifact), 0o600, "{}", artifact.display());
    // One an older daemon left readable is made the owner's only when the
    // worker opens it: a turn (which needs the worker) before looking.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&artifact, std::fs::Permissions::from_mode(0o644)).unwrap();
    d.spawn_and_wait();
    timed_turn(&mut d.client(), s);
    d.stop();
    assert_eq!((mode(&dir), mode(&artifact)), (0o700, 0o600));
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
    assert_eq!(artifact_head(&full.sessions, s).kv_type, park::KV_TYPE_F16);
    assert_eq!(
        artifact_head(&lossy.sessions, s).kv_type,
        park::KV_TYPE_F16_AS_Q8
    );
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
    assert_eq!(
        artifact_head_of(&q8.sessions, s, park::KV_TYPE_Q8_0).kv_type,
        park::KV_TYPE_Q8_0
    );
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

/// Waits until `path` is there (a seal the writer thread finishes).
fn wait_for(path: &std::path::Path) {
    let since = Instant::now();
    while !path.exists() {
        assert!(
            since.elapsed().as_secs() < 60,
            "{} never came",
            path.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Turns after the first seal segments (only the cells they added); after
/// a restart the session restores the artifact and its segments and replies
/// exactly what it replies in a daemon that never stopped, and its next
/// seal extends the chain again.
#[test]
fn later_turns_seal_segments_and_a_restart_restores_the_chain() {
    const TURNS: [&str; 2] = ["And the lightest?", "And the heaviest?"];
    let mut d = park_daemon();
    d.spawn_and_wait();
    let mut c = d.client();
    let s = conversation(&mut c, &long_message(9));
    let dir = d.sessions.join("park");
    wait_for(&park::path(&dir, s));
    for (k, q) in TURNS.iter().enumerate() {
        say(&mut c, s, q);
        generate(&mut c, s, 8);
        wait_for(&park::segment_path(&dir, s, k as u32 + 1));
    }
    let chain = artifact_head(&d.sessions, s);
    assert_eq!((chain.segments, chain.stopped.clone()), (2, None));
    let base = std::fs::metadata(park::path(&dir, s)).unwrap().len();
    for k in 1..=2 {
        let seg = std::fs::metadata(park::segment_path(&dir, s, k))
            .unwrap()
            .len();
        assert!(seg * 4 < base, "segment {k}: {seg} bytes, the base {base}");
    }
    let base_bytes = std::fs::read(park::path(&dir, s)).unwrap();
    d.stop();

    d.spawn_and_wait();
    let mut c = d.client();
    say(&mut c, s, "And the oldest?");
    // (Two generations: the first token, then the rest.)
    let (warm, reply, _) = timed_turn(&mut c, s);
    assert_eq!(warm, chain.tokens.len() as u64, "restored from the chain");
    // The restored chain is extended, not written again whole.
    wait_for(&park::segment_path(&dir, s, 4));
    d.stop();
    assert_eq!(artifact_head(&d.sessions, s).segments, 4);
    assert!(std::fs::read(park::path(&dir, s)).unwrap() == base_bytes);
    let log = d.stderr();
    assert!(
        !log.contains("unusable") && !log.contains("park segment"),
        "{log}"
    );

    let mut uninterrupted = park_daemon();
    uninterrupted.spawn_and_wait();
    let mut c = uninterrupted.client();
    let u = conversation(&mut c, &long_message(9));
    for q in TURNS {
        say(&mut c, u, q);
        generate(&mut c, u, 8);
    }
    say(&mut c, u, "And the oldest?");
    let (_, resident, _) = timed_turn(&mut c, u);
    uninterrupted.stop();
    assert_eq!(
        reply, resident,
        "the restored reply differs from the resident one"
    );
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
    let variants: Vec<(&str, TestDaemon)> = [
        "none",
        "flip",
        "truncate",
        "rebase",
        "rebase-none",
        "other-model",
    ]
    .into_iter()
    .map(|what| {
        let mut copy = TestDaemon::new();
        crate::util::copy_dir(&d.sessions, &copy.sessions);
        let p = artifact(&copy.sessions);
        let mut bytes = sealed.clone();
        match what {
            "none" | "rebase-none" => std::fs::remove_file(&p).unwrap(),
            "rebase" => {}
            // The same tensors and template, other metadata: another
            // model identity, so the artifact is not restored.
            "other-model" => copy.model = crate::util::derived_model("SmolLM2-135M-fim.gguf"),
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
    let u = conversation(&mut c, &long_message(9));
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
    let first = read_events(c, s)
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

/// The header of `s`'s park artifact in `sessions`, read as the daemon
/// reads it (every field and digest checked).
fn artifact_head(sessions: &std::path::Path, s: SessionId) -> park::Chain {
    artifact_head_of(sessions, s, park::KV_TYPE_F16)
}

/// `artifact_head` as a cache of type `cache` reads it: the base and the
/// segments that chain on.
fn artifact_head_of(sessions: &std::path::Path, s: SessionId, cache: u32) -> park::Chain {
    let identity = park::model_identity(&crate::util::model_path()).unwrap();
    park::read_chain_heads(&sessions.join("park"), s, &identity, cache).expect("a usable artifact")
}

/// Trims `s` to the events before its first reply and asks a 24-token turn
/// of the branch: (warm_prefix, reply).
fn trim_before_reply_and_turn(c: &mut Client, s: SessionId) -> (u64, Vec<Token>) {
    let reply = read_events(c, s)
        .iter()
        .find(|e| matches!(e.body, Record::Generated { .. }))
        .expect("a reply")
        .event_id;
    let t = created(
        c,
        Request::Trim {
            session: s,
            to_event: reply,
        },
    );
    let (warm, reply, _) = timed_turn(c, t);
    (warm, reply)
}

/// A trimmed branch keeps a prefix of its parent's artifact: after a
/// restart it restores that prefix and no more, and replies what the same
/// trim replies in a daemon that never stopped (where the prefix is copied
/// from the parent's cells: the same KV, the same batches after it).
#[test]
fn park_a_trimmed_branch_restores_only_the_prefix_it_keeps() {
    let mut d = park_daemon();
    let s = parked_session(&mut d);
    let sealed = artifact_head(&d.sessions, s).tokens.len() as u64;
    d.spawn_and_wait();
    let (warm, reply) = trim_before_reply_and_turn(&mut d.client(), s);
    d.stop();
    assert!(
        warm > 250 && warm < sealed,
        "warm_prefix {warm} of an artifact of {sealed} tokens"
    );
    assert!(!d.stderr().contains("unusable"), "{}", d.stderr());

    let mut u = park_daemon();
    u.spawn_and_wait();
    let mut c = u.client();
    let s2 = conversation(&mut c, &long_message(9));
    say(&mut c, s2, "And the lightest?");
    let (warm2, reply2) = trim_before_reply_and_turn(&mut c, s2);
    u.stop();
    assert_eq!((warm, &reply), (warm2, &reply2));
}

/// The park files of `s` (its artifact and segments) in `dir`, and the
/// latest of their modification times (None when it has none).
fn park_files(dir: &std::path::Path, s: SessionId) -> (Vec<String>, Option<SystemTime>) {
    let base = format!("{s}.park");
    let mut names = vec![];
    let mut latest = None;
    for e in std::fs::read_dir(dir).unwrap().filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        let segment = name
            .strip_prefix(&format!("{base}."))
            .is_some_and(|k| k.parse::<u32>().is_ok());
        if name == base || segment {
            let t = e.metadata().unwrap().modified().unwrap();
            latest = latest.max(Some(t));
            names.push(name);
        }
    }
    names.sort();
    (names, latest)
}

/// Waits up to 60 s for `what` (the park writer works on its own thread).
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed().as_secs() < 60, "waited 60 s for {what}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// `--park-budget-gb` (fractions allowed): past it the least recently used
/// artifact is deleted, not the oldest: A is parked first, then B, then A's
/// artifact is used (restored for a fork's turn, which touches it and seals
/// the fork's own artifact, not A's), and the fork's seal goes past the
/// budget: B goes, A stays, and B's session prefills after a restart.
#[test]
fn the_park_budget_deletes_the_least_recently_used_artifact() {
    let mut d = park_daemon();
    let a = parked_session(&mut d);
    let dir = d.sessions.join("park");
    let one = std::fs::metadata(dir.join(format!("{a}.park")))
        .unwrap()
        .len();
    // Room for two artifacts of this size, not three.
    let budget = 2.5 * one as f64 / f64::from(1u32 << 30);
    d.extra_args
        .extend(["--park-budget-gb".to_string(), format!("{budget:.6}")]);
    d.spawn_and_wait();
    let mut c = d.client();
    let b = conversation(&mut c, &long_message(10));
    wait_until("B's artifact", || park_files(&dir, b).1.is_some());
    let (a_files, a_sealed) = park_files(&dir, a);
    assert_eq!(
        a_files,
        [format!("{a}.park")],
        "A's artifact before its use"
    );
    let b_sealed = park_files(&dir, b).1.unwrap();
    assert!(a_sealed.unwrap() < b_sealed, "A was parked first");
    // Whatever the file system's timestamp granularity, A's use comes after
    // the clock moved past B's seal.
    wait_until("the clock to pass B's seal", || {
        SystemTime::now() > b_sealed + std::time::Duration::from_millis(1)
    });
    let len = read_events(&mut c, a).len() as u64;
    let f = created(
        &mut c,
        Request::Fork {
            session: a,
            at_event: len,
            params: None,
        },
    );
    let (warm, reply, _) = timed_turn(&mut c, f);
    assert!(
        warm > 250,
        "warm_prefix {warm}: A's artifact was not restored"
    );
    assert!(!reply.is_empty());
    wait_until("the budget to delete an artifact", || {
        park_files(&dir, a).1.is_none() || park_files(&dir, b).1.is_none()
    });
    let (a_files, a_used) = park_files(&dir, a);
    assert!(
        park_files(&dir, b).1.is_none() && !a_files.is_empty(),
        "the budget deleted A's artifact (parked first, used last), not B's"
    );
    assert_eq!(a_files, [format!("{a}.park")], "A's artifact, no segment");
    assert!(
        a_used.unwrap() > b_sealed,
        "the restore touched A's artifact"
    );
    assert!(park_files(&dir, f).1.is_some(), "the fork's own artifact");
    // The daemon's index forgets B's artifact with the next decode's reply
    // (it counted three, and would restore from a deleted file).
    say(&mut c, f, "And the lightest?");
    generate(&mut c, f, 1);
    assert_eq!(metric(&d, "superfluid_kv_parked_artifacts"), 2.0);
    d.stop();
    // After a restart B, its artifact gone, prefills (no warning: not a
    // fault).
    d.spawn_and_wait();
    let mut c = d.client();
    say(&mut c, b, "And the lightest?");
    let (warm, reply, _) = timed_turn(&mut c, b);
    assert!(warm < 50, "warm_prefix {warm} from a deleted artifact");
    assert!(!reply.is_empty());
    d.stop();
    assert!(!d.stderr().contains("unusable"), "{}", d.stderr());
}

/// Watches a directory for files created in it (inotify).
struct Created(libc::c_int);

impl Created {
    fn watch(dir: &std::path::Path) -> Created {
        use std::os::unix::ffi::OsStrExt;
        let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
        // SAFETY: plain inotify syscalls on a fd this struct owns.
        unsafe {
            let fd = libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK);
            assert!(fd >= 0);
            assert!(libc::inotify_add_watch(fd, path.as_ptr(), libc::IN_CREATE) >= 0);
            Created(fd)
        }
    }

    /// Forgets the events so far.
    fn drain(&self) {
        let mut buf = [0u8; 4096];
        // SAFETY: reads into a buffer of its length.
        while unsafe { libc::read(self.0, buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
    }

    /// Waits up to `ms` for a file to be created; whether one was.
    fn wait(&self, ms: i32) -> bool {
        let mut p = libc::pollfd {
            fd: self.0,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polls one valid pollfd.
        unsafe { libc::poll(&mut p, 1, ms) > 0 }
    }
}

impl Drop for Created {
    fn drop(&mut self) {
        // SAFETY: closes the fd this struct owns.
        unsafe { libc::close(self.0) };
    }
}

/// The temp files in the park directory (a seal being written).
fn temp_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.to_string_lossy().ends_with(".tmp"))
                .collect()
        })
        .unwrap_or_default()
}

/// The files a session's artifact is read from (base, then segments), and
/// their bytes.
fn chain_files(dir: &std::path::Path, s: SessionId) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let base = park::path(dir, s);
    if let Ok(b) = std::fs::read(&base) {
        out.push((base, b));
        for k in 1..=park::MAX_SEGMENTS {
            let p = park::segment_path(dir, s, k);
            match std::fs::read(&p) {
                Ok(b) => out.push((p, b)),
                Err(_) => break,
            }
        }
    }
    out
}

/// SIGKILL while the writer thread writes a seal (its temp file is there):
/// the first turn's seal is the whole artifact, the next ones segments.
/// The artifact in use is the previous one, whole, or the new one, whole;
/// never a part of one. The restart restores it without a warning.
#[test]
fn a_sigkill_while_sealing_leaves_a_whole_artifact() {
    let mut d = TestDaemon::new();
    d.extra_args = ["--park", "--ctx-size", "4096", "--parallel", "2"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    d.spawn_and_wait();
    let dir = d.sessions.join("park");
    std::fs::create_dir_all(&dir).unwrap();
    let watch = Created::watch(&dir);
    let identity = park::model_identity(&crate::util::model_path()).unwrap();
    let chain =
        |dir: &std::path::Path, s| park::read_chain_heads(dir, s, &identity, park::KV_TYPE_F16);
    // ~1,800 tokens: a whole artifact of ~40 MB, written and fsynced over
    // milliseconds; the turns after it add segments of ~30 tokens.
    let text = (1..4).map(long_message).collect::<Vec<_>>().join(" ");
    let mut session = None;
    let mut caught = 0;
    for turn in 0..12 {
        let s = match session {
            Some(s) => {
                say(
                    &mut d.client(),
                    s,
                    &format!("Question {turn}: and the lightest?"),
                );
                s
            }
            None => {
                let mut c = d.client();
                let s = created(
                    &mut c,
                    Request::Create {
                        parent: None,
                        params: params(1),
                    },
                );
                say(&mut c, s, &text);
                s
            }
        };
        session = Some(s);
        let previous = chain_files(&dir, s);
        let previous_tokens = chain(&dir, s).map(|c| c.tokens).unwrap_or_default();
        watch.drain();
        let socket = d.socket.clone();
        let gen = std::thread::spawn(move || {
            if let Ok(mut c) = Client::connect(&socket) {
                // Cut short by the SIGKILL: its error is expected.
                let _ = c.generate(&Request::Generate {
                    session: s,
                    max_tokens: 8,
                });
            }
        });
        let workers = crate::util::children_of(d.pid());
        assert!(watch.wait(120_000), "no seal began");
        // The writer has created its temp file: kill the worker (which
        // would finish the write on a clean exit), then the daemon.
        for w in &workers {
            // SAFETY: plain kill(2) on the daemon's worker.
            unsafe { libc::kill(*w as libc::pid_t, libc::SIGKILL) };
        }
        // Dead (a zombie, or reaped), so nothing renames after the look.
        for w in &workers {
            let stat = format!("/proc/{w}/stat");
            while std::fs::read_to_string(&stat).is_ok_and(|st| {
                st.rsplit_once(')')
                    .is_some_and(|(_, r)| !r.starts_with(" Z"))
            }) {
                std::thread::yield_now();
            }
        }
        let mid_write = !temp_files(&dir).is_empty();
        d.kill9();
        let _ = gen.join();
        // What was in use is still there, byte for byte; what a reader
        // takes chains whole (no torn segment is ever in place).
        let now = chain_files(&dir, s);
        assert_eq!(
            now[..previous.len().min(now.len())],
            previous[..],
            "turn {turn}: the artifact in use changed"
        );
        match chain(&dir, s) {
            Ok(c) => {
                assert_eq!(c.stopped, None, "turn {turn}");
                if mid_write {
                    assert_eq!(
                        c.tokens, previous_tokens,
                        "killed mid-write, yet it changed"
                    );
                } else {
                    assert!(c.tokens.starts_with(&previous_tokens), "turn {turn}");
                }
            }
            // Killed while the first (whole) seal was written: none yet.
            Err(_) => assert!(mid_write && previous.is_empty(), "turn {turn}"),
        }
        if mid_write {
            caught += 1;
            if caught == 3 {
                break;
            }
        }
        d.spawn_and_wait();
    }
    assert!(caught > 0, "the SIGKILL never landed inside a write");
    let s = session.unwrap();
    d.spawn_and_wait();
    // The worker removes stale temp files as it starts (it may start after
    // the socket answers); checked before the next turn, whose own seal
    // writes a new temp file.
    let since = Instant::now();
    while !temp_files(&dir).is_empty() {
        assert!(
            since.elapsed().as_secs() < 60,
            "the temp file outlived a start"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let kept = chain(&dir, s).map(|c| c.tokens.len() as u64).unwrap_or(0);
    say(&mut d.client(), s, "And the heaviest?");
    let (warm, reply, _) = timed_turn(&mut d.client(), s);
    d.stop();
    assert!(
        warm <= kept && warm + 16 >= kept,
        "warm_prefix {warm}, the artifact holds {kept}"
    );
    assert!(!reply.is_empty());
    let log = d.stderr();
    assert!(
        !log.contains("unusable") && !log.contains("park segment"),
        "{log}"
    );
}

/// `--idle-spill-ms`: a session idle for the period leaves the KV cells
/// (the cells in use drop to 0, the sequence goes to host memory) while the
/// lane does nothing else, and its next turn restores it: warm, with the
/// reply it gets when it stays resident (`--idle-spill-ms 0`).
#[test]
fn an_idle_session_leaves_the_cells_and_its_next_turn_comes_back_warm() {
    let turn2 = |period: &str| {
        let mut d = TestDaemon::new();
        d.extra_args = ["--idle-spill-ms", period, "--ctx-size", "2048"]
            .iter()
            .map(|a| a.to_string())
            .collect();
        d.spawn_and_wait();
        let mut c = d.client();
        let s = conversation(&mut c, &long_message(4));
        let resident = metric(&d, "superfluid_kv_cells_used");
        assert!(resident > 300.0, "{resident} cells after turn 1");
        // The period, then the export: seconds on a loaded machine.
        std::thread::sleep(std::time::Duration::from_millis(2500));
        let since = Instant::now();
        while period != "0"
            && metric(&d, "superfluid_kv_cells_used") > 0.0
            && since.elapsed().as_secs() < 30
        {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let after = (
            metric(&d, "superfluid_kv_cells_used"),
            metric(&d, "superfluid_kv_idle_spills_total"),
        );
        say(&mut c, s, "And the lightest?");
        let (warm, reply, _) = timed_turn(&mut c, s);
        let restored = metric(&d, "superfluid_kv_restored_tokens_total");
        (resident, after, warm, reply, restored)
    };
    let (resident, (cells, spills), warm, reply, restored) = turn2("1000");
    assert_eq!((cells, spills), (0.0, 1.0), "the idle session stayed");
    assert_eq!(restored as u64, warm);
    assert!(warm as f64 >= resident - 1.0, "warm_prefix {warm}");
    let (_, (cells0, spills0), warm0, reply0, restored0) = turn2("0");
    assert_eq!((cells0, spills0), (resident, 0.0));
    assert_eq!(restored0, 0.0);
    assert_eq!((warm, &reply), (warm0, &reply0));
}

/// A conversation shorter than 32 tokens, evicted by another on the only
/// sequence, comes back from host memory too (the spec: a prefix that
/// leaves the pool is kept there until that room is full); below 32 tokens
/// nothing was kept, and its next turn was prefilled whole.
#[test]
fn a_short_conversation_evicted_comes_back_from_host_memory() {
    let mut d = TestDaemon::new();
    d.extra_args = [
        "--parallel",
        "1",
        "--ctx-size",
        "2048",
        "--cache-ram-mb",
        "64",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    d.spawn_and_wait();
    let mut c = d.client();
    let s = created(
        &mut c,
        Request::Create {
            parent: None,
            params: params(1),
        },
    );
    commit(
        &mut c,
        Request::AppendSystem {
            session: s,
            text: Some("Be brief.".into()),
            tools: vec![],
        },
    );
    say(&mut c, s, "Hi.");
    let (_, first, _) = generate(&mut c, s, 3);
    let held: usize = read_events(&mut c, s)
        .iter()
        .map(|e| e.body.span().len())
        .sum();
    assert!(held < 32, "the conversation holds {held} tokens");
    // Another conversation takes the only sequence.
    conversation(&mut c, "Name three rivers of Europe, please.");
    say(&mut c, s, "Bye.");
    let (warm, _, _) = generate(&mut c, s, 2);
    assert!(
        warm as usize >= held - first.len(),
        "warm_prefix {warm} of {held} tokens"
    );
    let restored = metric(&d, "superfluid_kv_restored_tokens_total");
    assert_eq!(restored as u64, warm, "restored {restored}");
}

/// A turn ended by a cancel is sealed like one cut by max_tokens. The step
/// planned before the cancel was seen feeds the last draw after the park
/// was asked for, so the worker's sequence is one position longer than the
/// turn; the worker skipped such a seal while the index counted on it.
/// Now it seals the turn's positions: after a restart the session comes
/// back warm and the continuation draws what the uncut turn draws.
#[test]
fn a_cancelled_turn_is_parked_and_resumes_warm_after_a_restart() {
    const N: u32 = 120;
    let mut d = park_daemon();
    d.spawn_and_wait();
    let mut c = d.client();
    let s = d.create(&mut c);
    say(&mut c, s, &long_message(9));
    let socket = d.socket.clone();
    let gen = std::thread::spawn(move || {
        let mut c = Client::connect(&socket).unwrap();
        c.generate(&Request::Generate {
            session: s,
            max_tokens: N,
        })
        .unwrap()
    });
    d.until_generated(s);
    assert_eq!(
        c.call(&Request::Cancel { session: s }).unwrap(),
        Response::Cancelling
    );
    crate::util::assert_cancelled(&gen.join().unwrap());
    let cut: Vec<Token> = d
        .read_all(s)
        .iter()
        .filter_map(|e| match &e.body {
            Record::Generated { span, .. } => Some(span.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert!(!cut.is_empty() && (cut.len() as u32) < N, "{}", cut.len());
    let dir = d.sessions.join("park");
    wait_for(&park::path(&dir, s));
    assert_eq!(metric(&d, "superfluid_kv_parked_artifacts"), 1.0);
    // The cells hold the turn and, past it, draws the cancel dropped that
    // a step had already fed: the artifact holds them all.
    let sealed = artifact_head(&d.sessions, s).tokens;
    let turn = (0..sealed.len())
        .rev()
        .find(|&at| sealed[..at].ends_with(&cut))
        .expect("the artifact holds the cut reply");
    d.stop();

    d.spawn_and_wait();
    let (warm, rest, _) = generate(&mut d.client(), s, N - cut.len() as u32);
    d.stop();
    // All of it from the artifact but the last token, decoded again to
    // draw from.
    assert_eq!(warm + 1, turn as u64, "warm_prefix after a restart");

    let mut uncut = park_daemon();
    uncut.spawn_and_wait();
    let mut c = uncut.client();
    let u = uncut.create(&mut c);
    say(&mut c, u, &long_message(9));
    let (_, whole, _) = generate(&mut c, u, N);
    uncut.stop();
    let mut resumed = cut;
    resumed.extend(rest);
    assert_eq!(
        resumed, whole,
        "the cancelled turn, continued after a restart"
    );
}
