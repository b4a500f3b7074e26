//! WAL benchmark: `cargo bench --bench wal [-- --quick] [-- --dir PATH]`.
//!
//! Prints a markdown table of append throughput and commit latency (submit ->
//! receiver resolved, i.e. after the covering fdatasync) with 1 and 64
//! concurrent appenders, and of replay speed (`open` with a no-op callback)
//! against a raw `read` + crc32c of the same file. Replay and raw-read figures
//! are the second of two runs each (warm page cache).

use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use superfluid::store::wal::RECORD_HEADER_LEN;
use superfluid::store::{open, OpenMode, WalWriter};

const MB: f64 = 1024.0 * 1024.0;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let base = args
        .iter()
        .position(|a| a == "--dir")
        .and_then(|i| args.get(i + 1))
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let run_for = Duration::from_millis(if quick { 500 } else { 3000 });
    let replay_bytes: usize = if quick { 32 << 20 } else { 256 << 20 };

    println!(
        "WAL bench ({}), temp dir under {} (pass --dir to change)\n",
        if quick { "quick" } else { "full" },
        base.display()
    );
    println!("| appenders | payload | records | records/s | payload MB/s | p50 commit | p99 commit | fsyncs | records/fsync |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for threads in [1usize, 64] {
        append_bench(&base, threads, 256, run_for);
    }

    println!();
    replay_bench(&base, replay_bytes, 4096);
}

fn append_bench(base: &Path, threads: usize, size: usize, run_for: Duration) {
    let dir = tempfile::tempdir_in(base).expect("temp dir");
    let (file, _) = open(dir.path(), OpenMode::Durable, &mut |_, _| Ok(())).expect("open");
    let w = WalWriter::spawn(file, None).expect("wal-writer");
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let w = w.clone();
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut lat = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let t0 = Instant::now();
                    w.append(vec![0xA5; size])
                        .blocking_recv()
                        .expect("writer alive")
                        .expect("append");
                    lat.push(t0.elapsed());
                }
                lat
            })
        })
        .collect();
    std::thread::sleep(run_for);
    stop.store(true, Ordering::Relaxed);
    let mut lat: Vec<Duration> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    let elapsed = start.elapsed().as_secs_f64();
    let stats = w.stats();
    w.shutdown();
    lat.sort();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    let n = lat.len() as f64;
    println!(
        "| {threads} | {size} B | {} | {:.0} | {:.2} | {:.2?} | {:.2?} | {} | {:.1} |",
        lat.len(),
        n / elapsed,
        n * size as f64 / MB / elapsed,
        pct(0.50),
        pct(0.99),
        stats.fsyncs,
        stats.records as f64 / stats.fsyncs.max(1) as f64,
    );
}

fn replay_bench(base: &Path, total: usize, size: usize) {
    let dir = tempfile::tempdir_in(base).expect("temp dir");
    let (file, _) = open(dir.path(), OpenMode::Durable, &mut |_, _| Ok(())).expect("open");
    let w = WalWriter::spawn(file, None).expect("wal-writer");
    let records = total / (size + RECORD_HEADER_LEN);
    let payload: Vec<u8> = (0..size).map(|i| (i * 31) as u8).collect();
    let mut left = records;
    while left > 0 {
        let batch = left.min(2048);
        let rxs: Vec<_> = (0..batch).map(|_| w.append(payload.clone())).collect();
        for rx in rxs {
            rx.blocking_recv().unwrap().unwrap();
        }
        left -= batch;
    }
    w.shutdown();
    let path = dir.path().join(superfluid::store::WAL_FILE);
    let file_len = std::fs::metadata(&path).unwrap().len() as f64;

    let mut replay = Duration::ZERO;
    for _ in 0..2 {
        let t0 = Instant::now();
        let mut n = 0u64;
        let (_f, r) = open(dir.path(), OpenMode::Durable, &mut |_, _| {
            n += 1;
            Ok(())
        })
        .expect("replay");
        replay = t0.elapsed();
        assert_eq!(r.records, records as u64);
        assert_eq!(n, records as u64);
    }
    let mut raw = Duration::ZERO;
    let mut buf = vec![0u8; 1 << 20];
    for _ in 0..2 {
        let t0 = Instant::now();
        let mut f = File::open(&path).unwrap();
        let mut crc = 0u32;
        loop {
            let got = f.read(&mut buf).unwrap();
            if got == 0 {
                break;
            }
            crc = crc32c::crc32c_append(crc, &buf[..got]);
        }
        std::hint::black_box(crc);
        raw = t0.elapsed();
    }
    let replay_mbs = file_len / MB / replay.as_secs_f64();
    let raw_mbs = file_len / MB / raw.as_secs_f64();
    println!(
        "Replay of a {:.0} MiB log ({records} records of {size} B), warm cache (second of two runs):\n",
        file_len / MB
    );
    println!("| what | time | MB/s |");
    println!("|---|---:|---:|");
    println!("| `open` (replay, no-op callback) | {replay:.2?} | {replay_mbs:.0} |");
    println!("| raw `read` + crc32c | {raw:.2?} | {raw_mbs:.0} |");
    println!("| ratio open / raw | | {:.2} |", replay_mbs / raw_mbs);
}
