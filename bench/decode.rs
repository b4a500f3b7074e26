//! Decode benchmarks: superfluid through its socket against the worker's
//! engine (`WorkerEngine`) run in this process, on the same model, threads
//! and prompt, in pairs measured back to back in alternating order (ratios
//! are taken per pair).
//!
//! `cargo bench --features bench-no-fsync --bench decode` (add `-- --quick` for a smoke run;
//! `DECODE_RUNS=n` sets the number of pairs). Rows:
//! - single stream: a ~40-token prompt, then up to 128 greedy tokens; the
//!   wall time of the whole request (prefill included, the same prompt on
//!   both sides), as generated tokens/s. The stream is alone in the KV cache
//!   on both sides (`--parallel 1`: each new session takes the one
//!   sequence). The engine in process, the daemon with fsynced commits, the
//!   daemon with fsync off (`SUPERFLUID_BENCH_NO_FSYNC=1`, benchmarks only),
//!   and `superfluid worker` driven straight over its pipe with no daemon.
//! - single stream beside 3 idle sessions kept in the KV cache
//!   (`--parallel 4`), against the engine in process holding the same 3
//!   sessions' tokens in its other sequences: llama.cpp attends over the
//!   whole used range of its unified cache, so cached idle sessions slow
//!   every decode; this row shows by how much, on both sides.
//! - 4 sessions generating at once: aggregate generated tokens/s.
//!
//! Every run's prompt starts with its run number, so no run finds another's
//! prompt in the KV cache.

use std::path::Path;
use std::time::Instant;

use superfluid::engine::exec::WorkerEngine;
use superfluid::engine::vocab::Vocab;
use superfluid::frontend::socket::Client;
use superfluid::wire::worker::{DecodeItem, Sample, WorkerConfig, WorkerRequest, WorkerResponse};
use superfluid::wire::{Params, Record, Request, Response, Role, Token};

const MAX_TOKENS: u32 = 128;
const THREADS: u32 = 2;
const CTX: u32 = 4096;
const QUESTION: &str = "Write a short story about a lighthouse keeper and a storm.";

fn greedy() -> Params {
    Params::greedy(1)
}

#[path = "common.rs"]
mod common;
use common::{fill, model, Daemon};

fn start_daemon(no_fsync: bool, parallel: u32) -> Daemon {
    let env: &[(&str, &str)] = if no_fsync {
        &[("SUPERFLUID_BENCH_NO_FSYNC", "1")]
    } else {
        &[]
    };
    Daemon::start(
        &[
            "--threads",
            &THREADS.to_string(),
            "--ctx-size",
            &CTX.to_string(),
            "--parallel",
            &parallel.to_string(),
        ],
        env,
    )
}

fn expect_session(r: Response) -> u64 {
    match r {
        Response::Created { session } => session,
        other => panic!("{other:?}"),
    }
}

/// One session asked one question; returns (its prompt tokens, generated
/// tokens, seconds, every token of the session).
fn daemon_run(socket: &Path, run: usize) -> (Vec<Token>, u64, f64, Vec<Token>) {
    let mut c = Client::connect(socket).expect("connect");
    let s = expect_session(
        c.call(&Request::Create {
            parent: None,
            params: greedy(),
        })
        .unwrap(),
    );
    for (r, text) in [
        (
            Role::System,
            format!("Run {run}. You are a helpful assistant."),
        ),
        (Role::User, QUESTION.to_string()),
    ] {
        let reply = c
            .call(&Request::AppendMessage {
                session: s,
                role: r.into(),
                text,
            })
            .unwrap();
        assert!(matches!(reply, Response::Committed { .. }), "{reply:?}");
    }
    let start = Instant::now();
    let replies = c
        .generate(&Request::Generate {
            session: s,
            max_tokens: MAX_TOKENS,
        })
        .unwrap();
    let secs = start.elapsed().as_secs_f64();
    let tokens = match replies.last() {
        Some(Response::Generated {
            tokens_generated, ..
        }) => *tokens_generated,
        other => panic!("{other:?}"),
    };
    let Response::Events { events } = c
        .call(&Request::Read {
            session: s,
            cursor: 0,
        })
        .unwrap()
    else {
        panic!()
    };
    let prompt: Vec<Token> = events
        .iter()
        .take_while(|e| !matches!(e.body, Record::Generated { .. }))
        .flat_map(|e| e.body.span().to_vec())
        .collect();
    let all = events.iter().flat_map(|e| e.body.span().to_vec()).collect();
    (prompt, tokens, secs, all)
}

/// The daemon's `superfluid_decode_seconds_total`: time its worker spent in
/// llama.cpp's decode calls.
fn decode_seconds(socket: &Path) -> f64 {
    let mut c = Client::connect(socket).expect("connect");
    let Response::Text { text } = c.call(&Request::Metrics).expect("metrics") else {
        panic!("metrics")
    };
    text.lines()
        .find_map(|l| l.strip_prefix("superfluid_decode_seconds_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("superfluid_decode_seconds_total")
}

/// The same prompt and token count on the engine in process; returns
/// (seconds, seconds in llama.cpp's decode calls).
fn in_process_run(engine: &mut WorkerEngine, prompt: &[Token], tokens: u64) -> (f64, f64) {
    let start = Instant::now();
    let mut items = vec![DecodeItem {
        media: vec![],
        seq: 0,
        pos: 0,
        tokens: prompt.to_vec(),
        sample: Some(Sample {
            params: greedy(),
            draw_pos: prompt.len() as u64,
            grammar: None,
            grammar_prefix: vec![],
            extras: None,
        }),
    }];
    let mut in_decode = 0u64;
    for pos in (prompt.len() as u32..).take(tokens as usize) {
        let WorkerResponse::Decoded {
            drawn, decode_us, ..
        } = engine.handle(&WorkerRequest::Decode {
            items: items.clone(),
        })
        else {
            panic!("decode failed");
        };
        in_decode += decode_us;
        let t = drawn[0].token;
        items = vec![DecodeItem {
            media: vec![],
            seq: 0,
            pos,
            tokens: vec![t],
            sample: Some(Sample {
                params: greedy(),
                draw_pos: pos as u64 + 1,
                grammar: None,
                grammar_prefix: vec![],
                extras: None,
            }),
        }];
    }
    let secs = start.elapsed().as_secs_f64();
    engine.handle(&WorkerRequest::KvClear { seq: 0 });
    (secs, in_decode as f64 / 1e6)
}

/// `superfluid worker` driven straight over its pipe, as the lane drives it
/// (the prompt in one Decode, then DecodeNext steps of 4 tokens, one queued
/// behind the one running), with no daemon: what the process boundary costs
/// apart from the daemon's own work.
struct DirectWorker {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl DirectWorker {
    fn spawn() -> DirectWorker {
        use superfluid::wire::{from_postcard, read_frame_blocking, MAX_FRAME_BYTES};
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_superfluid"))
            .arg("worker")
            .arg("--model")
            .arg(model())
            .args(["--ctx-size", &CTX.to_string(), "--parallel", "4"])
            .args(["--batch", "512", "--threads", &THREADS.to_string()])
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn worker");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let ready = read_frame_blocking(&mut stdout, MAX_FRAME_BYTES)
            .unwrap()
            .unwrap();
        assert!(matches!(
            from_postcard::<WorkerResponse>(&ready).unwrap(),
            WorkerResponse::Ready { .. }
        ));
        DirectWorker {
            child,
            stdin,
            stdout,
        }
    }

    fn send(&mut self, request: &WorkerRequest) {
        use superfluid::wire::{to_postcard, write_frame_blocking};
        write_frame_blocking(&mut self.stdin, &to_postcard(request).unwrap()).unwrap();
    }

    fn recv(&mut self) -> (u32, u64) {
        use superfluid::wire::{from_postcard, read_frame_blocking, MAX_FRAME_BYTES};
        let body = read_frame_blocking(&mut self.stdout, MAX_FRAME_BYTES)
            .unwrap()
            .unwrap();
        match from_postcard::<WorkerResponse>(&body).unwrap() {
            WorkerResponse::Decoded {
                drawn, decode_us, ..
            } => (drawn.len() as u32, decode_us),
            WorkerResponse::Done => (0, 0),
            other => panic!("{other:?}"),
        }
    }

    /// Returns (seconds, seconds in llama.cpp's decode calls).
    fn run(&mut self, prompt: &[Token], tokens: u64) -> (f64, f64) {
        use superfluid::wire::worker::NextItem;
        let start = Instant::now();
        let sample = |draw_pos| Sample {
            params: greedy(),
            draw_pos,
            grammar: None,
            grammar_prefix: vec![],
            extras: None,
        };
        self.send(&WorkerRequest::Decode {
            items: vec![DecodeItem {
                media: vec![],
                seq: 0,
                pos: 0,
                tokens: prompt.to_vec(),
                sample: Some(sample(prompt.len() as u64)),
            }],
        });
        let (mut sent, mut got, mut in_decode) = (1u64, 0u64, 0u64);
        let mut pending = 1;
        let mut pos = prompt.len() as u32;
        while got < tokens {
            while pending < 2 && sent < tokens {
                let steps = 4.min(tokens - sent) as u32;
                self.send(&WorkerRequest::DecodeNext {
                    items: vec![NextItem {
                        seq: 0,
                        pos,
                        steps,
                        sample: sample(pos as u64 + 1),
                    }],
                });
                pos += steps;
                sent += u64::from(steps);
                pending += 1;
            }
            let (n, us) = self.recv();
            pending -= 1;
            got += u64::from(n);
            in_decode += us;
        }
        let secs = start.elapsed().as_secs_f64();
        self.send(&WorkerRequest::KvClear { seq: 0 });
        self.recv();
        (secs, in_decode as f64 / 1e6)
    }
}

impl Drop for DirectWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// The in-process engine runs in this process, the worker in its own; both must
/// run llama.cpp's OpenMP threads with the same settings, the worker's
/// (`GOMP_SPINCOUNT`, which libgomp reads only when it loads). Unless the
/// environment already sets them, run this benchmark again with them set.
fn same_openmp_settings_as_the_worker() {
    if std::env::var_os("OMP_WAIT_POLICY").is_some() || std::env::var_os("GOMP_SPINCOUNT").is_some()
    {
        return;
    }
    let exe = std::env::current_exe().expect("current exe");
    let status = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("GOMP_SPINCOUNT", superfluid::actors::lane::WORKER_SPINCOUNT)
        .status()
        .expect("run the benchmark again");
    std::process::exit(status.code().unwrap_or(1));
}

fn in_process_engine(n_seq: u32) -> WorkerEngine {
    WorkerEngine::new(
        &model(),
        &WorkerConfig {
            n_ctx: CTX,
            n_seq,
            n_batch: 512,
            threads: THREADS,
        },
    )
    .expect("in-process engine")
}

fn main() {
    same_openmp_settings_as_the_worker();
    let quick = std::env::args().any(|a| a == "--quick");
    let runs = if quick { 3 } else { 21 };
    let runs = std::env::var("DECODE_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(runs);
    let _vocab = Vocab::load(&model()).expect("model");
    let mut engine = in_process_engine(1);
    let mut shared_engine = in_process_engine(4);
    let mut direct = DirectWorker::spawn();
    let alone = start_daemon(false, 1);
    let without_fsync = start_daemon(true, 1);
    let shared = start_daemon(false, 4);
    // Three sessions on the shared daemon first, mirrored on the in-process side.
    for k in 0..3 {
        let all = daemon_run(&shared.socket, 3000 + k).3;
        fill(&mut shared_engine, 1 + k as u32, &all);
    }
    let mut rows: [Vec<f64>; 6] = Default::default();
    let [inproc, on, off, direct_r, inproc_shared, on_shared] = &mut rows;
    let (mut on_ratio, mut off_ratio, mut direct_ratio, mut shared_ratio, mut tax) =
        (vec![], vec![], vec![], vec![], vec![]);
    let mut split = vec![];
    for run in 0..runs {
        // The machine's speed drifts over seconds (it is shared), so each
        // comparison is a pair measured back to back, the order alternating,
        // and the ratios are taken per pair.
        let d0 = decode_seconds(&alone.socket);
        let (prompt, tokens, first_secs, _) = daemon_run(&alone.socket, run);
        let d1 = decode_seconds(&alone.socket);
        let (inproc_secs, inproc_decode) = in_process_run(&mut engine, &prompt, tokens);
        let (o, sf_decode, sf_secs) = if run % 2 == 0 {
            (tokens as f64 / first_secs, d1 - d0, first_secs)
        } else {
            // Odd runs time the daemon after the in-process engine (a new session).
            let (_, t, secs, _) = daemon_run(&alone.socket, run + 500);
            (t as f64 / secs, decode_seconds(&alone.socket) - d1, secs)
        };
        let r = tokens as f64 / inproc_secs;
        let (direct_secs, direct_decode) = direct.run(&prompt, tokens);
        let (_, t, secs, _) = daemon_run(&without_fsync.socket, run + 1000);
        let f = t as f64 / secs;
        // The same question beside 3 idle sessions, on both sides.
        let (prompt_s, tokens_s, secs_s, all_s) = daemon_run(&shared.socket, run + 2000);
        let (inproc_s_secs, _) = in_process_run(&mut shared_engine, &prompt_s, tokens_s);
        fill(&mut shared_engine, 1 + (run % 3) as u32, &all_s);
        let (rs, os) = (tokens_s as f64 / inproc_s_secs, tokens_s as f64 / secs_s);
        let ms = |x: f64| x * 1e3 / tokens as f64;
        split.push([
            ms(inproc_decode),
            ms(inproc_secs - inproc_decode),
            ms(direct_decode),
            ms(direct_secs - direct_decode),
            ms(sf_decode),
            ms(sf_secs - sf_decode),
        ]);
        let dr = tokens as f64 / direct_secs;
        eprintln!(
            "run {run}: in process {r:.1} socket {o:.1} ({:.3}) fsync off {f:.1} worker alone {dr:.1}; beside 3 idle sessions: in process {rs:.1} socket {os:.1} ({:.3})",
            o / r,
            os / rs
        );
        inproc.push(r);
        on.push(o);
        off.push(f);
        direct_r.push(dr);
        inproc_shared.push(rs);
        on_shared.push(os);
        on_ratio.push(o / r);
        off_ratio.push(o / f);
        direct_ratio.push(dr / r);
        shared_ratio.push(os / rs);
        tax.push(rs / r);
    }
    drop(without_fsync);
    drop(alone);
    drop(direct);
    let mut agg = Vec::new();
    for run in 0..runs.min(5) {
        let start = Instant::now();
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let socket = shared.socket.clone();
                std::thread::spawn(move || daemon_run(&socket, 4000 + run * 4 + i).1)
            })
            .collect();
        let total: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        agg.push(total as f64 / start.elapsed().as_secs_f64());
    }
    let m = |v: &Vec<f64>| median(v.clone());
    let f = |(a, lo, hi): (f64, f64, f64)| format!("{a:.1} ({lo:.1}-{hi:.1})");
    let fr = |(a, lo, hi): (f64, f64, f64)| format!("{a:.3} ({lo:.3}-{hi:.3})");
    println!(
        "decode benchmark: SmolLM2-135M-Instruct Q4_1, {THREADS} threads, GOMP_SPINCOUNT={} on both sides, {runs} paired runs, medians (min-max)\n",
        std::env::var("GOMP_SPINCOUNT").unwrap_or_else(|_| "(OMP_WAIT_POLICY set)".into())
    );
    println!("| workload | tokens/s | ratio |");
    println!("|---|---:|---:|");
    println!("| engine in process, 1 stream | {} | 1.00 |", f(m(inproc)));
    println!(
        "| superfluid socket, 1 stream, fsynced commits | {} | {} vs in process, per pair |",
        f(m(on)),
        fr(m(&on_ratio))
    );
    println!(
        "| superfluid socket, 1 stream, fsync off | {} | fsync costs {:.1}% |",
        f(m(off)),
        (1.0 - m(&off_ratio).0) * 100.0
    );
    println!(
        "| superfluid worker over its pipe, no daemon | {} | {} vs in process, per pair |",
        f(m(direct_r)),
        fr(m(&direct_ratio))
    );
    println!(
        "| engine in process, 1 stream beside 3 idle sequences | {} | {} vs alone |",
        f(m(inproc_shared)),
        fr(m(&tax))
    );
    println!(
        "| superfluid socket, 1 stream beside 3 idle sessions | {} | {} vs in process beside the same |",
        f(m(on_shared)),
        fr(m(&shared_ratio))
    );
    let agg_m = m(&agg);
    println!(
        "| superfluid socket, 4 sessions at once (aggregate) | {} | {:.2}x one stream |",
        f(agg_m),
        agg_m.0 / m(on).0
    );
    let col = |k: usize| median(split.iter().map(|x| x[k]).collect()).0;
    println!(
        "\nper generated token, medians, ms in llama.cpp's decode + outside it: engine in process {:.3} + {:.3}; worker alone {:.3} + {:.3}; superfluid {:.3} + {:.3}",
        col(0),
        col(1),
        col(2),
        col(3),
        col(4),
        col(5)
    );
}
