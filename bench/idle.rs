//! Idle sessions beside a decoding stream, measured on the worker's engine in
//! this process: what keeping them in the KV cells costs each decode step,
//! and what moving them to host memory (`KvSpill`) and back (`KvRestore`)
//! costs instead. The evidence for when idle sequences leave the cells
//! (docs/kv-tiers.md, "Idle sequences").
//!
//! One stream: a ~40-token prompt, then 128 greedy tokens, timed by
//! llama.cpp's decode calls (ms a step). Beside it, 3 idle sequences of
//! `IDLE` tokens, in these layouts:
//! - alone: nothing else in the cells;
//! - resident: the idle sequences stay;
//! - spilled after: they are spilled once the stream's prompt is in (their
//!   cells freed below the stream's);
//! - spilled before: they are spilled before the stream's prompt comes.
//!
//! `cargo bench --profile dev --bench idle` (add `-- --quick` for 1 run;
//! `IDLE_RUNS=n`). Prints a markdown table.

use std::time::Instant;

use superfluid::engine::exec::WorkerEngine;
use superfluid::wire::worker::{DecodeItem, Sample, WorkerConfig, WorkerRequest, WorkerResponse};
use superfluid::wire::{Params, Token};

#[path = "common.rs"]
#[allow(dead_code)] // the daemon half is decode.rs's
mod common;
use common::{fill, model};

const THREADS: u32 = 2;
const CTX: u32 = 8192;
const STEPS: u32 = 128;
const IDLE: [usize; 3] = [170, 500, 1500];

fn engine() -> WorkerEngine {
    WorkerEngine::new(
        &model(),
        &WorkerConfig {
            n_ctx: CTX,
            n_seq: 4,
            n_batch: 512,
            threads: THREADS,
        },
    )
    .expect("engine")
    .with_spill_cap(1 << 30)
}

fn tokens(n: usize, salt: usize) -> Vec<Token> {
    (0..n)
        .map(|i| 100 + ((i * 7919 + salt * 104_729) % 40000) as Token)
        .collect()
}

fn sample(draw_pos: u64) -> Option<Sample> {
    Some(Sample {
        params: Params::greedy(1),
        draw_pos,
        grammar: None,
        grammar_prefix: vec![],
        extras: None,
    })
}

/// Decodes `STEPS` greedy tokens on sequence 0 after `prompt` (already in
/// its cells); ms a step in llama.cpp's decode.
fn decode(e: &mut WorkerEngine, prompt_len: u32, first: Token) -> f64 {
    let mut t = first;
    let mut us = 0u64;
    for pos in prompt_len..prompt_len + STEPS {
        let WorkerResponse::Decoded {
            drawn, decode_us, ..
        } = e.handle(&WorkerRequest::Decode {
            items: vec![DecodeItem {
                media: vec![],
                seq: 0,
                pos,
                tokens: vec![t],
                sample: sample(pos as u64 + 1),
            }],
        })
        else {
            panic!("decode failed");
        };
        us += decode_us;
        t = drawn[0].token;
    }
    us as f64 / 1e3 / f64::from(STEPS)
}

#[derive(Clone, Copy, PartialEq)]
enum Layout {
    Alone,
    Resident,
    SpilledAfter,
    SpilledBefore,
}

/// One run: (ms a step, ms to spill the 3, ms to restore one).
fn run(e: &mut WorkerEngine, layout: Layout, idle: usize, salt: usize) -> (f64, f64, f64) {
    for seq in 0..4 {
        e.handle(&WorkerRequest::KvClear { seq });
    }
    if layout != Layout::Alone {
        for seq in 1..4u32 {
            fill(e, seq, &tokens(idle, salt * 10 + seq as usize));
        }
    }
    let spill = |e: &mut WorkerEngine| {
        let t = Instant::now();
        for seq in 1..4u32 {
            let r = e.handle(&WorkerRequest::KvSpill {
                seq,
                key: u64::from(seq),
                len: idle as u32,
            });
            assert!(matches!(r, WorkerResponse::Spilled { .. }), "{r:?}");
            e.handle(&WorkerRequest::KvClear { seq });
        }
        t.elapsed().as_secs_f64() * 1e3
    };
    let mut spill_ms = 0.0;
    if layout == Layout::SpilledBefore {
        spill_ms = spill(e);
    }
    let prompt = tokens(40, salt * 10);
    let WorkerResponse::Decoded { drawn, .. } = e.handle(&WorkerRequest::Decode {
        items: vec![DecodeItem {
            media: vec![],
            seq: 0,
            pos: 0,
            tokens: prompt.clone(),
            sample: sample(40),
        }],
    }) else {
        panic!("prompt failed");
    };
    if layout == Layout::SpilledAfter {
        spill_ms = spill(e);
    }
    let step = decode(e, 40, drawn[0].token);
    let mut restore_ms = 0.0;
    if matches!(layout, Layout::SpilledAfter | Layout::SpilledBefore) {
        let t = Instant::now();
        let r = e.handle(&WorkerRequest::KvRestore {
            seq: 1,
            key: 1,
            len: idle as u32,
            keep: false,
        });
        restore_ms = t.elapsed().as_secs_f64() * 1e3;
        assert_eq!(r, WorkerResponse::Done);
        for key in 2..4 {
            e.handle(&WorkerRequest::KvDrop { key });
        }
    }
    (step, spill_ms, restore_ms)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let runs: usize = std::env::var("IDLE_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 1 } else { 7 });
    let mut e = engine();
    println!("| idle tokens (x3) | layout | ms a step | vs alone | spill the 3 | restore one |");
    println!("|---:|---|---:|---:|---:|---:|");
    for idle in IDLE {
        let layouts = [
            (Layout::Alone, "alone"),
            (Layout::Resident, "resident"),
            (Layout::SpilledAfter, "spilled after the prompt"),
            (Layout::SpilledBefore, "spilled before the prompt"),
        ];
        let mut results: Vec<Vec<(f64, f64, f64)>> = vec![Vec::new(); layouts.len()];
        for r in 0..runs {
            // Alternate the order, so drift does not favour one layout.
            let order: Vec<usize> = if r % 2 == 0 {
                (0..layouts.len()).collect()
            } else {
                (0..layouts.len()).rev().collect()
            };
            for i in order {
                results[i].push(run(&mut e, layouts[i].0, idle, r * 7 + i));
            }
        }
        let alone = median(results[0].iter().map(|x| x.0).collect());
        for (i, (_, name)) in layouts.iter().enumerate() {
            let step = median(results[i].iter().map(|x| x.0).collect());
            let spill = median(results[i].iter().map(|x| x.1).collect());
            let restore = median(results[i].iter().map(|x| x.2).collect());
            println!(
                "| {idle} | {name} | {step:.2} | {:.3} | {spill:.1} ms | {restore:.1} ms |",
                alone / step
            );
        }
    }
}
