//! Parking, measured on the worker's engine in this process (`--park`,
//! `--park-lossy`; docs/kv-tiers.md): for a sequence of 1,000, 2,000 and
//! 4,000 tokens of history,
//! - seal: the state copied on the worker's thread (what holds the lane),
//!   and until the artifact is on disk (the writer thread: Q8 quantization
//!   for `--park-lossy`, the sha256, write, fsync, rename, directory fsync);
//! - the artifact's size a token;
//! - restore (`KvUnpark`: read, every digest checked, the state set),
//!   against prefilling the same history.
//!
//! `cargo bench --bench park` (add `-- --quick` for 1 run; `PARK_RUNS=n`).
//! Prints a markdown table and writes bench/results/park-<date>.json.

use std::path::Path;
use std::time::{Duration, Instant};

use superfluid::engine::exec::WorkerEngine;
use superfluid::wire::worker::{WorkerConfig, WorkerRequest, WorkerResponse};
use superfluid::wire::Token;

#[path = "common.rs"]
#[allow(dead_code)] // the daemon half is decode.rs's
mod common;
use common::{fill, model};

const THREADS: u32 = 2;
const CTX: u32 = 8192;
const HISTORIES: [usize; 3] = [1000, 2000, 4000];

fn engine(dir: &Path, lossy: bool) -> WorkerEngine {
    WorkerEngine::new(
        &model(),
        &WorkerConfig {
            n_ctx: CTX,
            n_seq: 1,
            n_batch: 512,
            threads: THREADS,
        },
    )
    .expect("engine")
    .with_park(dir.to_path_buf(), &model(), 0, lossy)
    .expect("park")
}

/// Token ids spread over the vocabulary (the KV's size and the times do not
/// depend on which tokens they are).
fn history(n: usize) -> Vec<Token> {
    (0..n)
        .map(|i| 100 + ((i * 7919) % 40000) as Token)
        .collect()
}

/// Prefills `tokens` into sequence 0; seconds.
fn prefill(e: &mut WorkerEngine, tokens: &[Token]) -> f64 {
    let t = Instant::now();
    fill(e, 0, tokens);
    t.elapsed().as_secs_f64()
}

struct Row {
    copy_ms: f64,
    disk_ms: f64,
    bytes: u64,
    restore_ms: f64,
    prefill_ms: f64,
}

fn one(e: &mut WorkerEngine, dir: &Path, session: u64, tokens: &[Token]) -> Row {
    let prefill_ms = prefill(e, tokens) * 1e3;
    let path = superfluid::engine::park::path(dir, session);
    let _ = std::fs::remove_file(&path);
    let t = Instant::now();
    let r = e.handle(&WorkerRequest::KvPark {
        seq: 0,
        session,
        tokens: tokens.to_vec(),
    });
    let copy_ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(r, WorkerResponse::Done);
    // The writer renames the finished artifact into place.
    while !path.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the artifact never came"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    let disk_ms = t.elapsed().as_secs_f64() * 1e3;
    let bytes = std::fs::metadata(&path).unwrap().len();
    e.handle(&WorkerRequest::KvClear { seq: 0 });
    let t = Instant::now();
    let r = e.handle(&WorkerRequest::KvUnpark {
        seq: 0,
        session,
        tokens: tokens.to_vec(),
        len: tokens.len() as u32,
    });
    let restore_ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(r, WorkerResponse::Done, "restored");
    Row {
        copy_ms,
        disk_ms,
        bytes,
        restore_ms,
        prefill_ms,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let runs: usize = std::env::var("PARK_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 1 } else { 5 });
    let mut table = vec![
        "| tier | history | copy (holds the lane) | on disk | ms per 1,000 tokens (on disk) | bytes a token | restore | prefill instead |".to_string(),
        "|---|---:|---:|---:|---:|---:|---:|---:|".to_string(),
    ];
    let mut json = Vec::new();
    for (tier, lossy) in [("--park", false), ("--park-lossy", true)] {
        let dir = tempfile::tempdir().unwrap();
        let mut e = engine(dir.path(), lossy);
        for (h, n) in HISTORIES.iter().enumerate() {
            let tokens = history(*n);
            let rows: Vec<Row> = (0..runs)
                .map(|r| one(&mut e, dir.path(), (h * 100 + r) as u64, &tokens))
                .collect();
            let m = |f: fn(&Row) -> f64| median(rows.iter().map(f).collect());
            let (copy, disk, restore, pre) = (
                m(|r| r.copy_ms),
                m(|r| r.disk_ms),
                m(|r| r.restore_ms),
                m(|r| r.prefill_ms),
            );
            let bytes = rows[0].bytes as f64 / *n as f64;
            table.push(format!(
                "| {tier} | {n} | {copy:.1} ms | {disk:.1} ms | {:.1} | {bytes:.0} | {restore:.1} ms | {pre:.0} ms |",
                disk / (*n as f64 / 1000.0)
            ));
            json.push(format!(
                "{{\"tier\":\"{tier}\",\"history\":{n},\"copy_ms\":{copy:.3},\"disk_ms\":{disk:.3},\
                 \"bytes_per_token\":{bytes:.1},\"restore_ms\":{restore:.3},\"prefill_ms\":{pre:.3}}}"
            ));
        }
    }
    let md = table.join("\n");
    println!("{md}");
    let date = {
        let out = std::process::Command::new("date")
            .arg("+%Y-%m-%d")
            .output()
            .expect("date");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("bench/results")
        .join(format!("park-{date}.json"));
    std::fs::write(
        &path,
        format!(
            "{{\"runs\":{runs},\"threads\":{THREADS},\"rows\":[{}]}}\n",
            json.join(",")
        ),
    )
    .unwrap();
    eprintln!("wrote {}", path.display());
}
