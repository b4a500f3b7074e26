//! Parking, measured on the worker's engine in this process (`--park`,
//! `--park-lossy`; docs/kv-tiers.md): for a sequence of 1,000, 2,000 and
//! 4,000 tokens of history,
//! - seal: the state copied on the worker's thread (what holds the lane),
//!   and until the artifact is on disk (the writer thread: Q8 quantization
//!   for `--park-lossy`, the sha256, write, fsync, rename, directory fsync);
//! - the artifact's size a token;
//! - restore (`KvUnpark`: read, every digest checked, the state set),
//!   against prefilling the same history;
//! - a turn of 100 more tokens sealed again: as a segment (only the new
//!   cells copied and written) against the whole artifact, and the restore
//!   of the base and its segment.
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

/// Clears sequence 0 and restores `session`'s artifact (`KvUnpark`, every
/// digest checked) into it; ms.
fn restore(e: &mut WorkerEngine, session: u64, tokens: &[Token]) -> f64 {
    e.handle(&WorkerRequest::KvClear { seq: 0 });
    let t = Instant::now();
    let r = e.handle(&WorkerRequest::KvUnpark {
        seq: 0,
        session,
        tokens: tokens.to_vec(),
        len: tokens.len() as u32,
    });
    let ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(r, WorkerResponse::Done, "restored");
    ms
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
    let restore_ms = restore(e, session, tokens);
    Row {
        copy_ms,
        disk_ms,
        bytes,
        restore_ms,
        prefill_ms,
    }
}

/// A turn after `history`: `TURN` more tokens, then sealed again.
const TURN: usize = 100;

struct TurnRow {
    /// The whole artifact written again: copy, on disk, bytes written.
    whole: (f64, f64, u64),
    /// A segment after it: copy, on disk, bytes written.
    segment: (f64, f64, u64),
    /// Restoring the base and the segment.
    restore_ms: f64,
}

/// Seals `tokens` (the sequence holds them) for `session` and waits until
/// `file` is on disk: (copy ms, on-disk ms, its bytes).
fn seal(e: &mut WorkerEngine, session: u64, tokens: &[Token], file: &Path) -> (f64, f64, u64) {
    let t = Instant::now();
    let r = e.handle(&WorkerRequest::KvPark {
        seq: 0,
        session,
        tokens: tokens.to_vec(),
    });
    let copy = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(r, WorkerResponse::Done);
    while !file.exists() {
        assert!(t.elapsed() < Duration::from_secs(60), "the seal never came");
        std::thread::sleep(Duration::from_micros(200));
    }
    let disk = t.elapsed().as_secs_f64() * 1e3;
    (copy, disk, std::fs::metadata(file).unwrap().len())
}

/// `history` sealed, `TURN` tokens more decoded, sealed whole (a session of
/// its own) and as a segment, then the segment's chain restored.
fn turn(e: &mut WorkerEngine, dir: &Path, session: u64, history: &[Token]) -> TurnRow {
    use superfluid::engine::park;
    let all = self::history(history.len() + TURN);
    assert_eq!(&all[..history.len()], history);
    fill(e, 0, history);
    let base = park::path(dir, session);
    seal(e, session, history, &base);
    let r = e.handle(&WorkerRequest::Decode {
        items: vec![superfluid::wire::worker::DecodeItem {
            media: vec![],
            seq: 0,
            pos: history.len() as u32,
            tokens: all[history.len()..].to_vec(),
            sample: None,
        }],
    });
    assert!(matches!(r, WorkerResponse::Decoded { .. }), "{r:?}");
    let whole = seal(e, session + 50, &all, &park::path(dir, session + 50));
    let segment = seal(e, session, &all, &park::segment_path(dir, session, 1));
    let restore_ms = restore(e, session, &all);
    TurnRow {
        whole,
        segment,
        restore_ms,
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
    table.push(String::new());
    table.push(format!(
        "A turn of {TURN} tokens after the history, sealed again (--park):\n\n\
         | history | whole: copy | whole: on disk | whole: bytes | segment: copy | segment: on disk | segment: bytes | restore base + segment |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|"
    ));
    {
        let dir = tempfile::tempdir().unwrap();
        let mut e = engine(dir.path(), false);
        for (h, n) in HISTORIES.iter().enumerate() {
            let tokens = history(*n);
            let rows: Vec<TurnRow> = (0..runs)
                .map(|r| turn(&mut e, dir.path(), (1000 + h * 100 + r) as u64, &tokens))
                .collect();
            let m = |f: fn(&TurnRow) -> f64| median(rows.iter().map(f).collect());
            let (wc, wd, sc, sd, re) = (
                m(|r| r.whole.0),
                m(|r| r.whole.1),
                m(|r| r.segment.0),
                m(|r| r.segment.1),
                m(|r| r.restore_ms),
            );
            let (wb, sb) = (rows[0].whole.2, rows[0].segment.2);
            table.push(format!(
                "| {n} | {wc:.1} ms | {wd:.1} ms | {wb} | {sc:.1} ms | {sd:.1} ms | {sb} | {re:.1} ms |"
            ));
            json.push(format!(
                "{{\"turn\":{TURN},\"history\":{n},\"whole_copy_ms\":{wc:.3},\"whole_disk_ms\":{wd:.3},\
                 \"whole_bytes\":{wb},\"segment_copy_ms\":{sc:.3},\"segment_disk_ms\":{sd:.3},\
                 \"segment_bytes\":{sb},\"restore_chain_ms\":{re:.3}}}"
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
