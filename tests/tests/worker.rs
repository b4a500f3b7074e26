//! `superfluid worker` end to end: spawn the binary, speak frames on its stdin/stdout.
//!
//! One worker (ctx 2048, 4 sequences, batch 512, 2 threads) is shared by the tests, behind a
//! mutex; each test clears the sequences it uses first. The stdout-purity and SIGKILL tests spawn
//! their own.

use std::io::{BufReader, Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};

use superfluid::engine::vocab::Vocab;
use superfluid::wire::worker::{DecodeItem, Sample, WorkerConfig, WorkerRequest, WorkerResponse};
use superfluid::wire::{
    from_postcard, read_frame_blocking, to_postcard, write_frame_blocking, Params, MAX_FRAME_BYTES,
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
        let stderr = tempfile::NamedTempFile::new().expect("stderr file");
        let mut child = Command::new(bin())
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
        let WorkerResponse::Ready { config, n_vocab } = ready else {
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
                items: vec![item(
                    3,
                    0,
                    vec![1, 2],
                    sample(SAMPLED, 2, Some("root ::= (")),
                )],
            },
            "grammar",
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
