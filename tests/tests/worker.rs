//! `superfluid worker` end to end: spawn the binary, speak frames on its stdin/stdout.
//!
//! One worker (ctx 2048, 4 sequences, batch 512, 2 threads) is shared by the tests, behind a
//! mutex; each test clears the sequences it uses first. The stdout-purity and SIGKILL tests spawn
//! their own.

use std::io::{BufReader, Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};

use superfluid::engine::vocab::Vocab;
use superfluid::wire::worker::{
    AttentionWork, DecodeItem, DrawExtras, Drawn, NextItem, Sample, WorkerConfig, WorkerRequest,
    WorkerResponse,
};
use superfluid::wire::{
    from_postcard, read_frame_blocking, to_postcard, write_frame_blocking, Params, SampleExtras,
    MAX_FRAME_BYTES,
};

use crate::util::{bin, model_path};

const PROMPT: &str =
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";

fn vocab() -> &'static Vocab {
    static V: OnceLock<Vocab> = OnceLock::new();
    V.get_or_init(|| Vocab::load(&model_path()).expect("vocab"))
}

fn prompt() -> Vec<u32> {
    vocab().tokenize(PROMPT, true)
}

const GREEDY: Params = Params::greedy(0);

const SAMPLED: Params = Params {
    temperature: 0.9,
    top_p: 0.95,
    min_p: 0.02,
    top_k: 50,
    seed: 12345,
};

struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    config: WorkerConfig,
    n_vocab: u32,
    _stderr: tempfile::NamedTempFile,
}

impl Worker {
    fn spawn() -> Worker {
        Worker::spawn_env(&[])
    }

    /// A worker with more environment variables.
    fn spawn_env(env: &[(&str, &str)]) -> Worker {
        let stderr = tempfile::NamedTempFile::new().expect("stderr file");
        let mut child = Command::new(bin())
            .env_remove("SUPERFLUID_FA_TRIM")
            .envs(env.iter().copied())
            .arg("worker")
            .arg("--model")
            .arg(model_path())
            .args([
                "--ctx-size",
                "2048",
                "--parallel",
                "4",
                "--batch",
                "512",
                "--threads",
                "2",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr.reopen().expect("reopen")))
            .spawn()
            .expect("spawn worker");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        // The very first bytes on stdout are the Ready frame.
        let body = read_frame_blocking(&mut stdout, MAX_FRAME_BYTES)
            .expect("read Ready")
            .expect("EOF before Ready");
        let ready: WorkerResponse = from_postcard(&body).expect("Ready parses");
        let WorkerResponse::Ready {
            config, n_vocab, ..
        } = ready
        else {
            panic!("first frame is not Ready: {ready:?}");
        };
        Worker {
            child,
            stdin,
            stdout,
            config,
            n_vocab,
            _stderr: stderr,
        }
    }

    fn call(&mut self, request: &WorkerRequest) -> WorkerResponse {
        write_frame_blocking(&mut self.stdin, &to_postcard(request).unwrap()).expect("send");
        let body = read_frame_blocking(&mut self.stdout, MAX_FRAME_BYTES)
            .expect("read reply")
            .expect("worker closed stdout");
        // from_postcard rejects trailing bytes: a reply is exactly one value.
        from_postcard(&body).expect("reply parses")
    }

    fn done(&mut self, request: WorkerRequest) {
        let r = self.call(&request);
        assert_eq!(r, WorkerResponse::Done, "{request:?}");
    }

    fn clear(&mut self, seqs: &[u32]) {
        for &seq in seqs {
            self.done(WorkerRequest::KvClear { seq });
        }
    }

    fn decode(&mut self, items: Vec<DecodeItem>) -> Vec<(u32, bool)> {
        match self.call(&WorkerRequest::Decode { items }) {
            WorkerResponse::Decoded { drawn, .. } => {
                drawn.iter().map(|d| (d.token, d.eog)).collect()
            }
            other => panic!("{other:?}"),
        }
    }

    fn err(&mut self, request: WorkerRequest) -> String {
        match self.call(&request) {
            WorkerResponse::Err { message } => message,
            other => panic!("expected Err for {request:?}, got {other:?}"),
        }
    }
}

fn item(seq: u32, pos: u32, tokens: Vec<u32>, sample: Option<Sample>) -> DecodeItem {
    DecodeItem {
        media: vec![],
        seq,
        pos,
        tokens,
        sample,
    }
}

fn sample(params: Params, draw_pos: u64, grammar: Option<&str>) -> Option<Sample> {
    Some(Sample {
        params,
        draw_pos,
        grammar: grammar.map(str::to_owned),
        grammar_prefix: vec![],
        extras: None,
    })
}

/// Generate up to `n` tokens in `seq`, which holds `pos` positions already, feeding `feed` first.
/// Stops after an end-of-generation token.
fn generate(
    w: &mut Worker,
    seq: u32,
    mut pos: u32,
    mut feed: Vec<u32>,
    n: usize,
    params: Params,
    grammar: Option<&str>,
) -> Vec<u32> {
    let mut out = Vec::new();
    while out.len() < n {
        let draw_pos = u64::from(pos) + feed.len() as u64;
        // A grammar has governed every token drawn so far.
        let mut s = sample(params, draw_pos, grammar);
        if let Some(s) = s.as_mut().filter(|s| s.grammar.is_some()) {
            s.grammar_prefix = out.clone();
        }
        let drawn = w.decode(vec![item(seq, pos, feed.clone(), s)]);
        assert_eq!(drawn.len(), 1);
        pos += feed.len() as u32;
        let (t, eog) = drawn[0];
        out.push(t);
        if eog {
            break;
        }
        feed = vec![t];
    }
    out
}

fn shared() -> MutexGuard<'static, Worker> {
    static W: OnceLock<Mutex<Worker>> = OnceLock::new();
    W.get_or_init(|| Mutex::new(Worker::spawn()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

#[test]
fn ready_echoes_the_config() {
    let w = shared();
    assert_eq!(
        w.config,
        WorkerConfig {
            n_ctx: 2048,
            n_seq: 4,
            n_batch: 512,
            threads: 2
        }
    );
    assert_eq!(w.n_vocab, vocab().n_vocab());
}

#[test]
fn greedy_answers_paris() {
    let mut w = shared();
    w.clear(&[0]);
    let out = generate(&mut w, 0, 0, prompt(), 30, GREEDY, None);
    let text = vocab().detokenize(&out);
    assert!(text.contains("Paris"), "{text:?}");
}

#[test]
fn seeded_sampling_is_reproducible() {
    let mut w = shared();
    w.clear(&[0, 1]);
    let a = generate(&mut w, 0, 0, prompt(), 30, SAMPLED, None);
    let b = generate(&mut w, 1, 0, prompt(), 30, SAMPLED, None);
    assert_eq!(a, b);
    let other = Params {
        seed: 777,
        temperature: 1.5,
        ..SAMPLED
    };
    w.clear(&[1]);
    let c = generate(&mut w, 1, 0, prompt(), 30, other, None);
    assert_ne!(a, c, "another seed and temperature should draw otherwise");
}

/// Sampling is indexed by position: a generation cut after 10 tokens, its KV lost, and resumed by
/// prefilling what it had drawn, goes on exactly as the uncut one.
#[test]
fn a_cut_generation_resumes_identically() {
    let mut w = shared();
    w.clear(&[0, 1]);
    let p = vocab().tokenize(
        "<|im_start|>user\nWrite a short story about a cat.<|im_end|>\n<|im_start|>assistant\n",
        true,
    );
    let n = p.len() as u32;
    let uncut = generate(&mut w, 0, 0, p.clone(), 30, SAMPLED, None);
    assert!(uncut.len() >= 12, "{uncut:?}");
    let head = generate(&mut w, 1, 0, p.clone(), 10, SAMPLED, None);
    assert_eq!(head, uncut[..10]);
    // Drop the generated part of the KV, then prefill the 10 drawn tokens and continue.
    w.done(WorkerRequest::KvTrim { seq: 1, from: n });
    let rest = generate(&mut w, 1, n, head.clone(), 20, SAMPLED, None);
    let mut resumed = head;
    resumed.extend(rest);
    assert_eq!(resumed, uncut);
}

#[test]
fn sequences_decoded_together_match_each_alone() {
    let mut w = shared();
    w.clear(&[0, 1, 2, 3]);
    let a = prompt();
    let b = vocab().tokenize(
        "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
        true,
    );
    let alone_a = generate(&mut w, 0, 0, a.clone(), 15, GREEDY, None);
    let alone_b = generate(&mut w, 1, 0, b.clone(), 15, GREEDY, None);
    // Both in every request: seq 2 runs a, seq 3 runs b.
    let (mut pa, mut pb) = (0u32, 0u32);
    let (mut fa, mut fb) = (a, b);
    let (mut out_a, mut out_b) = (Vec::new(), Vec::new());
    for _ in 0..15 {
        let drawn = w.decode(vec![
            item(
                2,
                pa,
                fa.clone(),
                sample(GREEDY, u64::from(pa) + fa.len() as u64, None),
            ),
            item(
                3,
                pb,
                fb.clone(),
                sample(GREEDY, u64::from(pb) + fb.len() as u64, None),
            ),
        ]);
        pa += fa.len() as u32;
        pb += fb.len() as u32;
        out_a.push(drawn[0].0);
        out_b.push(drawn[1].0);
        fa = vec![drawn[0].0];
        fb = vec![drawn[1].0];
    }
    assert_eq!(out_a[..alone_a.len()], alone_a[..]);
    assert_eq!(out_b[..alone_b.len()], alone_b[..]);
}

#[test]
fn kv_copy_forks_a_prompt() {
    let mut w = shared();
    w.clear(&[0, 2]);
    let p = prompt();
    let n = p.len() as u32;
    // Prefill all but the last prompt token, without sampling.
    let none = w.decode(vec![item(0, 0, p[..p.len() - 1].to_vec(), None)]);
    assert!(none.is_empty());
    w.done(WorkerRequest::KvCopy {
        src: 0,
        dst: 2,
        len: n - 1,
    });
    let last = vec![p[p.len() - 1]];
    let in_copy = generate(&mut w, 2, n - 1, last.clone(), 20, GREEDY, None);
    let in_original = generate(&mut w, 0, n - 1, last, 20, GREEDY, None);
    assert_eq!(in_copy, in_original);
    // A copy of more positions than the source holds is refused.
    let msg = w.err(WorkerRequest::KvCopy {
        src: 1,
        dst: 2,
        len: 5000,
    });
    assert!(msg.contains("holds"), "{msg}");
}

#[test]
fn bad_inputs_answer_err_and_the_worker_goes_on() {
    let mut w = shared();
    w.clear(&[3]);
    let n_vocab = w.n_vocab;
    let bad: Vec<(WorkerRequest, &str)> = vec![
        (
            WorkerRequest::Decode {
                items: vec![item(4, 0, vec![1], sample(GREEDY, 1, None))],
            },
            "out of range",
        ),
        (
            WorkerRequest::Decode {
                items: vec![item(3, 0, vec![1, n_vocab], None)],
            },
            "invalid token",
        ),
        (
            WorkerRequest::Decode {
                items: vec![item(3, 5, vec![1], None)],
            },
            "not 5",
        ),
        (
            WorkerRequest::Decode {
                items: vec![item(3, 0, vec![], None)],
            },
            "no tokens",
        ),
        (
            WorkerRequest::Decode {
                items: vec![item(3, 0, vec![7; 2049], None)],
            },
            "n_ctx",
        ),
        (WorkerRequest::KvTrim { seq: 9, from: 0 }, "out of range"),
        (WorkerRequest::KvClear { seq: u32::MAX }, "out of range"),
    ];
    for (request, expect) in bad {
        let msg = w.err(request.clone());
        assert!(msg.contains(expect), "{request:?}: {msg}");
        // Nothing was decoded: seq 3 is still empty and takes a prompt at position 0.
        let drawn = w.decode(vec![item(3, 0, vec![1, 2], sample(GREEDY, 2, None))]);
        assert_eq!(drawn.len(), 1);
        w.clear(&[3]);
    }
    // A frame that is not a request is answered Err too.
    write_frame_blocking(&mut w.stdin, &[0xff, 0xff, 0xff]).unwrap();
    let body = read_frame_blocking(&mut w.stdout, MAX_FRAME_BYTES)
        .unwrap()
        .unwrap();
    assert!(matches!(
        from_postcard::<WorkerResponse>(&body).unwrap(),
        WorkerResponse::Err { .. }
    ));
}

/// Issue 15, item 3: a grammar that does not parse fails its own item of a
/// batched Decode, not the step. The other items decode and draw; the
/// refused sequence is left as it was (it takes its prompt again at its old
/// position), and the sequence beside it goes on from its draw.
#[test]
fn a_bad_grammar_fails_only_its_own_item() {
    let mut w = shared();
    w.clear(&[2, 3]);
    let p = prompt();
    let n = p.len() as u32;
    let alone = {
        let drawn = w.decode(vec![item(
            2,
            0,
            p.clone(),
            sample(GREEDY, u64::from(n), None),
        )]);
        w.clear(&[2]);
        drawn[0].0
    };
    let r = w.call(&WorkerRequest::Decode {
        items: vec![
            item(
                3,
                0,
                p.clone(),
                sample(SAMPLED, u64::from(n), Some("root ::= (")),
            ),
            item(2, 0, p.clone(), sample(GREEDY, u64::from(n), None)),
        ],
    });
    let WorkerResponse::Decoded { drawn, refused, .. } = r else {
        panic!("the step failed as a whole: {r:?}");
    };
    assert_eq!(drawn.len(), 1, "{drawn:?}");
    assert_eq!((drawn[0].seq, drawn[0].token), (2, alone), "{drawn:?}");
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].seq, 3);
    assert!(refused[0].message.contains("grammar"), "{refused:?}");
    // Sequence 3 holds nothing: its prompt goes in at position 0 again.
    let again = w.decode(vec![item(
        3,
        0,
        p.clone(),
        sample(GREEDY, u64::from(n), None),
    )]);
    assert_eq!(again[0].0, alone);
    // Sequence 2 goes on from its draw, as a DecodeNext would have it.
    let next = w.call(&WorkerRequest::DecodeNext {
        items: vec![NextItem {
            seq: 2,
            pos: n,
            steps: 2,
            sample: sample(GREEDY, u64::from(n) + 1, None).unwrap(),
        }],
    });
    assert!(
        matches!(&next, WorkerResponse::Decoded { drawn, .. } if !drawn.is_empty()),
        "{next:?}"
    );
    w.clear(&[2, 3]);
}

#[test]
fn a_grammar_forces_yes_or_no() {
    let mut w = shared();
    w.clear(&[1]);
    let p = vocab().tokenize(
        "<|im_start|>user\nIs the sky green? Answer yes or no.<|im_end|>\n<|im_start|>assistant\n",
        true,
    );
    let grammar = r#"root ::= "yes" | "no""#;
    let out = generate(&mut w, 1, 0, p, 10, SAMPLED, Some(grammar));
    let (last, body) = out.split_last().unwrap();
    assert!(vocab().is_eog(*last), "{out:?}");
    let text = vocab().detokenize(body);
    assert!(text == "yes" || text == "no", "{text:?}");
}

/// Nothing but frames on stdout: Ready first, one frame per reply, nothing after Shutdown's Done.
#[test]
fn stdout_carries_only_frames() {
    let mut w = Worker::spawn();
    let drawn = w.decode(vec![item(0, 0, prompt(), sample(GREEDY, 1000, None))]);
    assert_eq!(drawn.len(), 1);
    assert_eq!(w.call(&WorkerRequest::Shutdown), WorkerResponse::Done);
    let mut rest = Vec::new();
    w.stdout.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "{} stray bytes on stdout", rest.len());
    let status = w.child.wait().unwrap();
    assert!(status.success(), "{status}");
}

/// A clean EOF on stdin ends the worker with status 0.
#[test]
fn stdin_eof_exits_cleanly() {
    let w = Worker::spawn();
    let Worker {
        mut child,
        stdin,
        mut stdout,
        ..
    } = w;
    drop(stdin);
    assert!(read_frame_blocking(&mut stdout, MAX_FRAME_BYTES)
        .unwrap()
        .is_none());
    assert!(child.wait().unwrap().success());
}

/// How the lane sees a crash: the reader gets EOF (between frames: `Ok(None)`), a writer gets
/// `BrokenPipe`, and `wait` reports the signal.
#[test]
fn a_killed_worker_reads_as_eof() {
    use std::os::unix::process::ExitStatusExt;
    let mut w = Worker::spawn();
    w.child.kill().unwrap(); // SIGKILL
    let status = w.child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    assert!(read_frame_blocking(&mut w.stdout, MAX_FRAME_BYTES)
        .unwrap()
        .is_none());
    let body = to_postcard(&WorkerRequest::Shutdown).unwrap();
    let err = write_frame_blocking(&mut w.stdin, &body).and_then(|_| Ok(w.stdin.flush()?));
    assert!(err.is_err(), "writing to a dead worker must fail");
}

/// Decode speed through the pipe vs the same `WorkerEngine` in process, 128-token greedy
/// generations, alternated. Run with
/// `cargo test --test tests -- --ignored --nocapture worker::bench`.
#[test]
#[ignore]
fn bench_pipe_vs_in_process() {
    use superfluid::engine::exec::WorkerEngine;
    let mut w = Worker::spawn();
    let config = w.config.clone();
    let mut in_process = WorkerEngine::new(&model_path(), &config).expect("engine");
    let p = prompt();
    let n = 128usize;
    let rounds: usize = std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let mut pipe_tps = Vec::new();
    let mut in_process_tps = Vec::new();
    // Generate with a closure over "call": prefill the prompt, then n-1 single-token steps.
    fn run(call: &mut dyn FnMut(&WorkerRequest) -> WorkerResponse, p: &[u32], n: usize) -> f64 {
        assert_eq!(
            call(&WorkerRequest::KvClear { seq: 0 }),
            WorkerResponse::Done
        );
        let mut feed = p.to_vec();
        let mut pos = 0u32;
        let first = {
            let draw_pos = feed.len() as u64;
            let r = call(&WorkerRequest::Decode {
                items: vec![item(0, pos, feed.clone(), sample(GREEDY, draw_pos, None))],
            });
            pos += feed.len() as u32;
            match r {
                WorkerResponse::Decoded { drawn, .. } => drawn[0].token,
                other => panic!("{other:?}"),
            }
        };
        feed = vec![first];
        let start = std::time::Instant::now();
        for _ in 1..n {
            let draw_pos = u64::from(pos) + 1;
            let r = call(&WorkerRequest::Decode {
                items: vec![item(0, pos, feed.clone(), sample(GREEDY, draw_pos, None))],
            });
            pos += 1;
            match r {
                WorkerResponse::Decoded { drawn, .. } => feed = vec![drawn[0].token],
                other => panic!("{other:?}"),
            }
        }
        (n - 1) as f64 / start.elapsed().as_secs_f64()
    }
    for _ in 0..rounds {
        pipe_tps.push(run(&mut |r| w.call(r), &p, n));
        in_process_tps.push(run(&mut |r| in_process.handle(r), &p, n));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    eprintln!("pipe tok/s: {pipe_tps:.1?}");
    eprintln!("in-process tok/s: {in_process_tps:.1?}");
    eprintln!(
        "median decode tok/s over {rounds} rounds of {n} tokens: pipe {:.1}, in process {:.1}",
        median(&mut pipe_tps),
        median(&mut in_process_tps)
    );
}

/// A sample with `extras` for the generation whose first draw is at `first_draw`.
fn sample_x(params: Params, draw_pos: u64, first_draw: u64, extras: &SampleExtras) -> Sample {
    Sample {
        params,
        draw_pos,
        grammar: None,
        grammar_prefix: vec![],
        extras: Some(DrawExtras {
            extras: extras.clone(),
            first_draw,
        }),
    }
}

/// Generates up to `n` tokens from `prompt` on the cleared sequence `seq` with `extras`, one
/// `Decode` per token (`next == 0`), or after the first by `DecodeNext`s of `next` steps.
fn generate_x(
    w: &mut Worker,
    seq: u32,
    prompt: &[u32],
    n: usize,
    extras: &SampleExtras,
    next: u32,
) -> Vec<Drawn> {
    w.clear(&[seq]);
    let first = prompt.len() as u64;
    let mut out: Vec<Drawn> = Vec::new();
    let mut feed = prompt.to_vec();
    let mut pos = 0u32;
    while out.len() < n && !out.last().is_some_and(|d| d.eog) {
        let draw_pos = u64::from(pos) + feed.len() as u64;
        let request = if next == 0 || out.is_empty() {
            WorkerRequest::Decode {
                items: vec![item(
                    seq,
                    pos,
                    feed.clone(),
                    Some(sample_x(GREEDY, draw_pos, first, extras)),
                )],
            }
        } else {
            WorkerRequest::DecodeNext {
                items: vec![NextItem {
                    seq,
                    pos,
                    steps: next.min((n - out.len()) as u32),
                    sample: sample_x(GREEDY, draw_pos, first, extras),
                }],
            }
        };
        let WorkerResponse::Decoded { drawn, .. } = w.call(&request) else {
            panic!("{request:?}");
        };
        assert!(!drawn.is_empty());
        // What the sequence holds now: the fed tokens, then every draw but the last.
        pos += feed.len() as u32 + drawn.len() as u32 - 1;
        feed = vec![drawn[drawn.len() - 1].token];
        out.extend(drawn);
    }
    out
}

fn tokens(drawn: &[Drawn]) -> Vec<u32> {
    drawn.iter().map(|d| d.token).collect()
}

/// logit_bias: -100 on the greedy first token moves the draw off it; +100 on any token forces
/// it; a bias id outside the vocabulary is a clear Err and the worker goes on.
#[test]
fn logit_bias_moves_and_forces_the_first_token() {
    let mut w = shared();
    let p = prompt();
    let none = SampleExtras::default();
    let plain = generate_x(&mut w, 0, &p, 1, &none, 0);
    let greedy = plain[0].token;
    w.clear(&[0]);
    assert_eq!(
        greedy,
        generate(&mut w, 0, 0, p.clone(), 1, GREEDY, None)[0]
    );
    let biased = |bias| SampleExtras {
        logit_bias: vec![bias],
        ..SampleExtras::default()
    };
    let off = generate_x(&mut w, 0, &p, 1, &biased((greedy, -100.0)), 0);
    assert_ne!(off[0].token, greedy);
    let forced: u32 = vocab().tokenize("banana", false)[0];
    assert_ne!(forced, greedy);
    let on = generate_x(&mut w, 0, &p, 3, &biased((forced, 100.0)), 0);
    assert_eq!(tokens(&on), [forced; 3]);
    // Checked before any work: nothing decoded, the sequence still empty.
    w.clear(&[0]);
    let n_vocab = w.n_vocab;
    let message = w.err(WorkerRequest::Decode {
        items: vec![item(
            0,
            0,
            p.clone(),
            Some(sample_x(
                GREEDY,
                p.len() as u64,
                p.len() as u64,
                &biased((n_vocab, 1.0)),
            )),
        )],
    });
    assert_eq!(
        message,
        format!(
            "item 0: sampling extras: logit_bias: token id {n_vocab} is not in the vocabulary \
             ({n_vocab} tokens)"
        )
    );
    w.clear(&[0]);
    assert_eq!(generate(&mut w, 0, 0, p, 1, GREEDY, None), [greedy]);
}

/// frequency_penalty 2.0 breaks a repetitive greedy continuation; penalties count only this
/// generation's draws (the first draw is the plain greedy one), and the pipelined path
/// (`DecodeNext`, fed the worker's own draws) draws exactly what one Decode per token draws.
#[test]
fn frequency_penalty_changes_a_repetitive_continuation() {
    let mut w = shared();
    let p = vocab().tokenize(
        "one, two, one, two, one, two, one, two, one, two, one,",
        false,
    );
    let plain = tokens(&generate_x(&mut w, 0, &p, 24, &SampleExtras::default(), 0));
    let most = plain
        .iter()
        .map(|t| plain.iter().filter(|u| *u == t).count())
        .max()
        .unwrap_or(0);
    assert!(
        most >= 5,
        "not repetitive: {:?}",
        vocab().detokenize(&plain)
    );
    let penalized = SampleExtras {
        frequency_penalty: 2.0,
        ..SampleExtras::default()
    };
    let lockstep = tokens(&generate_x(&mut w, 0, &p, 24, &penalized, 0));
    assert_eq!(lockstep[0], plain[0], "nothing drawn yet: no penalty");
    assert_ne!(lockstep, plain, "{:?}", vocab().detokenize(&lockstep));
    let pipelined = tokens(&generate_x(&mut w, 1, &p, 24, &penalized, 4));
    assert_eq!(pipelined, lockstep);
    // Presence 2.0 alone is too weak to break this cycle, but lowers the log-probability of a
    // token drawn before (28, the comma, drawn at 1, again at 3), and raises that of a new one
    // (at 2) whose rivals were drawn.
    let logprobs = SampleExtras {
        logprobs: Some(0),
        ..SampleExtras::default()
    };
    let presence = SampleExtras {
        presence_penalty: 2.0,
        ..logprobs.clone()
    };
    let lp = |d: &[Drawn], i: usize| d[i].logprob.as_ref().map_or(0.0, |l| l.logprob);
    let a = generate_x(&mut w, 0, &p, 4, &logprobs, 4);
    let b = generate_x(&mut w, 0, &p, 4, &presence, 4);
    assert_eq!(
        (tokens(&a), tokens(&b)),
        (plain[..4].to_vec(), plain[..4].to_vec())
    );
    assert_eq!(plain[1], plain[3]);
    assert!(lp(&b, 3) < lp(&a, 3) - 0.5, "{a:?} {b:?}");
    assert!(lp(&b, 2) > lp(&a, 2) + 0.1, "{a:?} {b:?}");
    assert_eq!(lp(&b, 0), lp(&a, 0), "nothing drawn yet: no penalty");
    // Zero penalties change nothing.
    let zero = SampleExtras {
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        ..SampleExtras::default()
    };
    assert_eq!(tokens(&generate_x(&mut w, 0, &p, 24, &zero, 4)), plain);
}

/// logprobs: every greedy draw reports a log-probability <= 0, and `top_logprobs` alternatives
/// most likely first with the greedy token first; a plain draw reports none.
#[test]
fn logprobs_come_with_each_draw_when_asked() {
    let mut w = shared();
    let p = prompt();
    let asked = SampleExtras {
        logprobs: Some(5),
        ..SampleExtras::default()
    };
    for next in [0, 4] {
        let drawn = generate_x(&mut w, 0, &p, 8, &asked, next);
        assert_eq!(drawn.len(), 8);
        for d in &drawn {
            let lp = d.logprob.as_ref().expect("logprobs asked");
            assert!(lp.logprob <= 0.0 && lp.logprob.is_finite(), "{lp:?}");
            assert_eq!(lp.top.len(), 5, "{lp:?}");
            assert_eq!(lp.top[0], (d.token, lp.logprob), "{lp:?}");
            assert!(lp.top.windows(2).all(|t| t[0].1 >= t[1].1), "{lp:?}");
            let mass: f32 = lp.top.iter().map(|t| t.1.exp()).sum();
            assert!(mass <= 1.0 + 1e-4, "{lp:?}");
        }
        // "Paris" is a confident answer: some draw is nearly certain.
        assert!(drawn
            .iter()
            .any(|d| d.logprob.as_ref().is_some_and(|l| l.logprob > -0.1)));
    }
    // Asked with no alternatives: the logprob alone.
    let bare = SampleExtras {
        logprobs: Some(0),
        ..SampleExtras::default()
    };
    let d = &generate_x(&mut w, 0, &p, 1, &bare, 0)[0];
    assert!(d.logprob.as_ref().is_some_and(|l| l.top.is_empty()));
    assert!(generate_x(&mut w, 0, &p, 2, &SampleExtras::default(), 0)
        .iter()
        .all(|d| d.logprob.is_none()));
}

/// What a worker draws, and the tiled attention's work, laying prompts out as the unified cache
/// does under concurrent requests: a shared opening (one set of cells, `KvCopy`) that every
/// prompt's query tiles see, one prompt prefilled alone, then three in one step, whose query
/// tiles straddle two prompts and whose cells start mid-tile; then decode steps of all four.
/// Greedy, with the log-probabilities of every draw and its 5 most likely alternatives.
fn concurrent_layout(env: &[(&str, &str)]) -> (Vec<Drawn>, AttentionWork) {
    let mut w = Worker::spawn_env(env);
    let mut work = AttentionWork::default();
    let mut decode =
        |w: &mut Worker, items: Vec<DecodeItem>| match w.call(&WorkerRequest::Decode { items }) {
            WorkerResponse::Decoded {
                drawn, attention, ..
            } => {
                work.add(attention);
                drawn
            }
            other => panic!("{other:?}"),
        };
    let extras = SampleExtras {
        logprobs: Some(5),
        ..SampleExtras::default()
    };
    let greedy_at =
        |draw_pos: u32| Some(sample_x(GREEDY, draw_pos.into(), draw_pos.into(), &extras));
    let opening = vocab().tokenize("<|im_start|>system\nYou are a careful, brief helper.", true);
    let o = opening.len() as u32;
    decode(&mut w, vec![item(0, 0, opening, None)]);
    for seq in 1..4 {
        w.done(WorkerRequest::KvCopy {
            src: 0,
            dst: seq,
            len: o,
        });
    }
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|k| {
            let lines: String = (0..5 + 2 * k)
                .map(|i| format!("Line {i} of part {k} says the tide is low. "))
                .collect();
            vocab().tokenize(&lines, false)
        })
        .collect();
    let mut pos: Vec<u32> = prompts.iter().map(|p| o + p.len() as u32).collect();
    let mut drawn = decode(
        &mut w,
        vec![item(0, o, prompts[0].clone(), greedy_at(pos[0]))],
    );
    drawn.extend(decode(
        &mut w,
        (1..4)
            .map(|k| {
                item(
                    k,
                    o,
                    prompts[k as usize].clone(),
                    greedy_at(pos[k as usize]),
                )
            })
            .collect(),
    ));
    for _ in 0..4 {
        let last: Vec<u32> = (0..4)
            .map(|k| drawn.iter().rev().find(|d| d.seq == k).unwrap().token)
            .collect();
        let items = (0..4)
            .map(|k| {
                let at = pos[k as usize];
                pos[k as usize] += 1;
                item(k, at, vec![last[k as usize]], greedy_at(at + 1))
            })
            .collect();
        drawn.extend(decode(&mut w, items));
    }
    (drawn, work)
}

/// superfluid's tiled attention (ggml-patch/) computes, in each tile pair a mask leaves partly
/// open, only the rows and cells it leaves; what it leaves out weighs exactly 0, so a worker
/// draws the same tokens with the same log-probabilities, to the bit, as with ggml's kernel
/// (`SUPERFLUID_FA_TRIM=0`), while computing a fraction of the scores.
#[test]
fn the_trimmed_tiled_attention_draws_what_ggml_does_computing_less() {
    let (trimmed, trimmed_work) = concurrent_layout(&[]);
    let (whole, whole_work) = concurrent_layout(&[("SUPERFLUID_FA_TRIM", "0")]);
    assert_eq!(trimmed.len(), 4 + 16, "{trimmed:?}");
    assert!(trimmed
        .iter()
        .all(|d| d.logprob.as_ref().is_some_and(|l| l.top.len() == 5)));
    assert_eq!(
        trimmed, whole,
        "the same draws and log-probabilities, to the bit"
    );
    assert!(
        whole_work.full > 0,
        "the prefills ran the tiled kernel: {whole_work:?}"
    );
    assert_eq!(whole_work.computed, whole_work.full, "{whole_work:?}");
    assert_eq!(
        trimmed_work.full, whole_work.full,
        "the same tile pairs were not skipped"
    );
    assert!(
        trimmed_work.computed * 10 < trimmed_work.full * 7,
        "the trim computed {} of {} scores",
        trimmed_work.computed,
        trimmed_work.full
    );
}
