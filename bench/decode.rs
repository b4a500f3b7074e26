//! Decode benchmarks: superfluid through its socket against the raw engine
//! in process, on the same model, threads and prompt, in pairs measured back
//! to back in alternating order (ratios are taken per pair).
//!
//! `cargo bench --bench decode` (add `-- --quick` for a smoke run). Rows:
//! - single stream: a ~40-token prompt, then up to 128 greedy tokens; the
//!   wall time of the whole request (prefill included, the same prompt on
//!   both sides), as generated tokens/s. Raw engine in process, the daemon
//!   with fsynced commits, and the daemon with fsync off
//!   (`SUPERFLUID_BENCH_NO_FSYNC=1`, benchmarks only).
//! - 4 sessions generating at once: aggregate generated tokens/s.
//!
//! Every run's prompt starts with its run number, so no run finds another's
//! prompt in the KV cache.

use std::path::Path;
use std::time::Instant;

use superfluid::engine::raw::RawEngine;
use superfluid::engine::vocab::Vocab;
use superfluid::frontend::socket::Client;
use superfluid::wire::worker::{DecodeItem, Sample, WorkerConfig, WorkerRequest, WorkerResponse};
use superfluid::wire::{role, Params, Record, Request, Response, Token};

const MAX_TOKENS: u32 = 128;
const THREADS: u32 = 2;
const CTX: u32 = 4096;
const QUESTION: &str = "Write a short story about a lighthouse keeper and a storm.";

fn greedy() -> Params {
    Params {
        temperature: 0.0,
        top_p: 1.0,
        min_p: 0.0,
        top_k: 0,
        seed: 1,
    }
}

#[path = "common.rs"]
mod common;
use common::{model, Daemon};

fn start_daemon(no_fsync: bool) -> Daemon {
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
            "4",
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
/// tokens, seconds).
fn daemon_run(socket: &Path, run: usize) -> (Vec<Token>, u64, f64) {
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
            role::SYSTEM,
            format!("Run {run}. You are a helpful assistant."),
        ),
        (role::USER, QUESTION.to_string()),
    ] {
        let reply = c
            .call(&Request::AppendMessage {
                session: s,
                role: r,
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
    (prompt, tokens, secs)
}

/// The same prompt and token count on the raw engine, in process.
fn raw_run(engine: &mut RawEngine, prompt: &[Token], tokens: u64) -> f64 {
    let start = Instant::now();
    let mut items = vec![DecodeItem {
        seq: 0,
        pos: 0,
        tokens: prompt.to_vec(),
        sample: Some(Sample {
            params: greedy(),
            draw_pos: prompt.len() as u64,
            grammar: None,
        }),
    }];
    for pos in (prompt.len() as u32..).take(tokens as usize) {
        let WorkerResponse::Decoded { drawn, .. } = engine.handle(&WorkerRequest::Decode {
            items: items.clone(),
        }) else {
            panic!("decode failed");
        };
        let t = drawn[0].token;
        items = vec![DecodeItem {
            seq: 0,
            pos,
            tokens: vec![t],
            sample: Some(Sample {
                params: greedy(),
                draw_pos: pos as u64 + 1,
                grammar: None,
            }),
        }];
    }
    let secs = start.elapsed().as_secs_f64();
    engine.handle(&WorkerRequest::KvClear { seq: 0 });
    secs
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// The raw engine runs in this process, the worker in its own; both must
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

fn main() {
    same_openmp_settings_as_the_worker();
    let quick = std::env::args().any(|a| a == "--quick");
    let runs = if quick { 3 } else { 21 };
    let _vocab = Vocab::load(&model()).expect("model");
    let mut engine = RawEngine::new(
        &model(),
        &WorkerConfig {
            n_ctx: CTX,
            n_seq: 4,
            n_batch: 512,
            threads: THREADS,
        },
    )
    .expect("raw engine");
    let with_fsync = start_daemon(false);
    let without_fsync = start_daemon(true);
    let (mut raw, mut on, mut off) = (Vec::new(), Vec::new(), Vec::new());
    let (mut on_ratio, mut off_ratio) = (Vec::new(), Vec::new());
    for run in 0..runs {
        // The machine's speed drifts over seconds (it is shared), so each
        // run is a pair measured back to back, in alternating order, and
        // the ratios are taken per pair.
        let (prompt, tokens, daemon_secs) = daemon_run(&with_fsync.socket, run);
        let r = tokens as f64 / raw_run(&mut engine, &prompt, tokens);
        let o = if run % 2 == 0 {
            tokens as f64 / daemon_secs
        } else {
            // Odd runs time the daemon after the raw engine (a new session).
            let (_, t, secs) = daemon_run(&with_fsync.socket, run + 500);
            t as f64 / secs
        };
        let (_, t, secs) = daemon_run(&without_fsync.socket, run + 1000);
        let f = t as f64 / secs;
        eprintln!(
            "run {run}: raw {r:.1} socket {o:.1} ({:.3}) fsync off {f:.1}",
            o / r
        );
        raw.push(r);
        on.push(o);
        off.push(f);
        on_ratio.push(o / r);
        off_ratio.push(o / f);
    }
    drop(without_fsync);
    let mut agg = Vec::new();
    for run in 0..runs.min(5) {
        let start = Instant::now();
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let socket = with_fsync.socket.clone();
                std::thread::spawn(move || daemon_run(&socket, 2000 + run * 4 + i).1)
            })
            .collect();
        let total: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        agg.push(total as f64 / start.elapsed().as_secs_f64());
    }
    let (raw_m, raw_lo, raw_hi) = median(raw);
    let (on_m, on_lo, on_hi) = median(on);
    let (off_m, off_lo, off_hi) = median(off);
    let (agg_m, agg_lo, agg_hi) = median(agg);
    let (ratio_m, ratio_lo, ratio_hi) = median(on_ratio);
    let (fsync_m, _, _) = median(off_ratio);
    println!(
        "decode benchmark: SmolLM2-135M-Instruct Q4_1, {THREADS} threads, GOMP_SPINCOUNT={} on both sides, {runs} paired runs, medians (min-max)\n",
        std::env::var("GOMP_SPINCOUNT").unwrap_or_else(|_| "(OMP_WAIT_POLICY set)".into())
    );
    println!("| workload | tokens/s | ratio |");
    println!("|---|---:|---:|");
    println!("| raw engine in process, 1 stream | {raw_m:.1} ({raw_lo:.1}-{raw_hi:.1}) | 1.00 |");
    println!(
        "| superfluid socket, 1 stream, fsynced commits | {on_m:.1} ({on_lo:.1}-{on_hi:.1}) | {ratio_m:.3} ({ratio_lo:.3}-{ratio_hi:.3}) vs raw, per pair |"
    );
    println!(
        "| superfluid socket, 1 stream, fsync off | {off_m:.1} ({off_lo:.1}-{off_hi:.1}) | fsync costs {:.1}% |",
        (1.0 - fsync_m) * 100.0
    );
    println!(
        "| superfluid socket, 4 sessions at once (aggregate) | {agg_m:.1} ({agg_lo:.1}-{agg_hi:.1}) | {:.2}x one stream |",
        agg_m / on_m
    );
}
