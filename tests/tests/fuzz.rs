//! Fuzzing the decoders (issue 15, item 14) with proptest, on stable Rust:
//! arbitrary bytes, and mutations (bit flips, overwrites, cuts, insertions,
//! duplicated chunks) of the seed inputs checked in under `tests/corpus/<decoder>/`.
//! Each decoder must answer Ok or Err, never panic, and never allocate
//! past its cap (each input's claimed lengths are checked against the cap
//! or the bytes really there before anything is allocated; the checks here
//! use a small frame cap and length fields that claim gigabytes).
//!
//! Decoders: the socket's frames, postcard `Request`, JSON `Request`, the
//! worker's postcard replies, the WAL reader (`store::open`), park artifacts
//! (`engine::park::read`).
//!
//! `cargo test --test tests fuzz::` runs 256 cases per decoder and input
//! kind; the long run is `cargo test --test tests fuzz::long -- --ignored`
//! (`SUPERFLUID_FUZZ_CASES`, default 20000 per decoder and kind).
//! `fuzz::regenerate_corpus` (ignored) rewrites the seeds from the current types.

use std::fs;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use superfluid::engine::park;
use superfluid::store::{open, OpenMode, StoreError, WalWriter, WAL_FILE};
use superfluid::wire::frame::{read_frame_blocking, FrameError};
use superfluid::wire::worker::{Drawn, WorkerConfig, WorkerResponse};
use superfluid::wire::{from_postcard, to_postcard, Params, Request, Role};

/// The frame cap the fuzzer reads with (the real one is 64 MiB; a small cap
/// makes "over the cap" reachable by short inputs).
const FUZZ_FRAME_CAP: usize = 4096;
const PARK_MODEL: [u8; 32] = [7; 32];

fn corpus_dir(kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/corpus")
        .join(kind)
}

/// The checked-in seeds of one decoder (at least one, or the test fails).
fn seeds(kind: &str) -> Vec<Vec<u8>> {
    let dir = corpus_dir(kind);
    let mut paths: Vec<_> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    let out: Vec<Vec<u8>> = paths.iter().map(|p| fs::read(p).unwrap()).collect();
    assert!(!out.is_empty(), "no seeds in {}", dir.display());
    out
}

/// One mutation: (kind, position, byte, length).
type Mutation = (u8, usize, u8, usize);

fn mutate(seed: &[u8], muts: &[Mutation]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for &(kind, pos, byte, len) in muts {
        let at = if v.is_empty() { 0 } else { pos % (v.len() + 1) };
        match kind % 6 {
            0 if at < v.len() => v[at] ^= 1 << (byte % 8),
            1 if at < v.len() => v[at] = byte,
            2 => v.truncate(at),
            3 => {
                let ins = vec![byte; len % 64];
                v.splice(at..at, ins);
            }
            4 => {
                // Duplicate a chunk (a repeated record, a repeated field).
                let end = (at + len % 256).min(v.len());
                let chunk = v[at..end].to_vec();
                v.splice(at..at, chunk);
            }
            _ => {
                // A length-looking word: huge, or zero.
                if at + 4 <= v.len() {
                    let word = if byte % 2 == 0 { u32::MAX } else { 0x7FFF_FFF0 };
                    v[at..at + 4].copy_from_slice(&word.to_le_bytes());
                }
            }
        }
    }
    v
}

/// Runs `check` on `cases` arbitrary inputs and `cases` mutated seeds.
fn fuzz(kind: &str, cases: u32, check: impl Fn(&[u8]) -> Result<(), TestCaseError>) {
    let seeds = seeds(kind);
    for seed in &seeds {
        check(seed).unwrap_or_else(|e| panic!("{kind}: a seed fails: {e}"));
    }
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config.clone());
    runner
        .run(&proptest::collection::vec(any::<u8>(), 0..2048), |bytes| {
            check(&bytes)
        })
        .unwrap_or_else(|e| panic!("{kind}, arbitrary bytes: {e}"));
    let n = seeds.len();
    let strategy = (
        0..n,
        proptest::collection::vec(
            (any::<u8>(), any::<usize>(), any::<u8>(), any::<usize>()),
            1..8,
        ),
    );
    let mut runner = TestRunner::new(config);
    runner
        .run(&strategy, |(i, muts)| check(&mutate(&seeds[i], &muts)))
        .unwrap_or_else(|e| panic!("{kind}, mutated seeds: {e}"));
}

fn check_frames(bytes: &[u8]) -> Result<(), TestCaseError> {
    let mut r = Cursor::new(bytes);
    for _ in 0..bytes.len() + 1 {
        let at = r.position() as usize;
        // A header that claims more than the cap must be refused on the
        // header alone, before anything is allocated for the body.
        let claims = bytes
            .get(at..at + 4)
            .map(|h| u32::from_le_bytes(h.try_into().unwrap()) as usize);
        let result = read_frame_blocking(&mut r, FUZZ_FRAME_CAP);
        if claims.is_some_and(|len| len > FUZZ_FRAME_CAP) {
            prop_assert!(
                matches!(result, Err(FrameError::TooLarge { .. })),
                "a header claiming {:?} bytes was not refused: {:?}",
                claims,
                result.as_ref().map(|b| b.as_ref().map(Vec::len))
            );
        }
        match result {
            Ok(Some(body)) => prop_assert!(body.len() <= FUZZ_FRAME_CAP),
            Ok(None) => return Ok(()),
            Err(FrameError::TooLarge { len, max }) => {
                prop_assert!(len > max && max == FUZZ_FRAME_CAP);
                // Refused on the header alone: nothing of the body was read.
                prop_assert_eq!(r.position() as usize, at + 4);
                return Ok(());
            }
            Err(_) => return Ok(()),
        }
    }
    Err(TestCaseError::fail("the frame reader did not advance"))
}

fn check_postcard_request(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(req) = from_postcard::<Request>(bytes) {
        // Whatever decodes, re-encodes to something that decodes the same.
        // (Compared as bytes: a float field may decode to NaN.)
        let again = to_postcard(&req).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let back =
            from_postcard::<Request>(&again).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(to_postcard(&back).ok(), Some(again));
    }
    Ok(())
}

fn check_json_request(bytes: &[u8]) -> Result<(), TestCaseError> {
    let _ = serde_json::from_slice::<Request>(bytes);
    Ok(())
}

fn check_worker_reply(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(reply) = from_postcard::<WorkerResponse>(bytes) {
        let again = to_postcard(&reply).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let back = from_postcard::<WorkerResponse>(&again)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(to_postcard(&back).ok(), Some(again));
    }
    Ok(())
}

fn check_wal(bytes: &[u8]) -> Result<(), TestCaseError> {
    let d = tempfile::tempdir().unwrap();
    fs::write(d.path().join(WAL_FILE), bytes).unwrap();
    let mut replayed = 0u64;
    match open(d.path(), OpenMode::Durable, &mut |_, p| {
        // Every payload handed out lies inside the file.
        assert!(p.len() <= bytes.len());
        replayed += 1;
        Ok(())
    }) {
        Ok((f, r)) => {
            prop_assert_eq!(r.records, replayed);
            prop_assert!(f.end() <= bytes.len() as u64);
            prop_assert_eq!(
                fs::metadata(d.path().join(WAL_FILE)).unwrap().len(),
                f.end()
            );
        }
        Err(StoreError::Corrupt { .. } | StoreError::BadHeader { .. }) => {
            // Refused: the file is left as it was.
            prop_assert_eq!(fs::read(d.path().join(WAL_FILE)).unwrap(), bytes);
        }
        Err(e) => return Err(TestCaseError::fail(format!("unexpected error: {e}"))),
    }
    Ok(())
}

fn check_park(bytes: &[u8]) -> Result<(), TestCaseError> {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("artifact");
    fs::write(&path, bytes).unwrap();
    if let Ok((head, state)) = park::read(&path, &PARK_MODEL, park::KV_TYPE_F16) {
        // What reads back fits in the file.
        prop_assert!(state.len() + 4 * head.tokens.len() <= bytes.len());
    }
    Ok(())
}

fn cases() -> u32 {
    256
}

#[test]
fn frames() {
    fuzz("frame", cases(), check_frames);
}

#[test]
fn postcard_request() {
    fuzz("request_postcard", cases(), check_postcard_request);
}

#[test]
fn json_request() {
    fuzz("request_json", cases(), check_json_request);
}

#[test]
fn worker_reply() {
    fuzz("worker_reply", cases(), check_worker_reply);
}

#[test]
fn wal_reader() {
    fuzz("wal", cases() / 2, check_wal);
}

#[test]
fn park_artifact() {
    fuzz("park", cases() / 2, check_park);
}

/// The long bounded run: every decoder, `SUPERFLUID_FUZZ_CASES` cases (default
/// 20000) of each input kind.
#[test]
#[ignore]
fn long() {
    let n: u32 = std::env::var("SUPERFLUID_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let started = std::time::Instant::now();
    fuzz("frame", n, check_frames);
    fuzz("request_postcard", n, check_postcard_request);
    fuzz("request_json", n, check_json_request);
    fuzz("worker_reply", n, check_worker_reply);
    fuzz("wal", n / 10, check_wal);
    fuzz("park", n / 10, check_park);
    println!(
        "fuzz long run: {n} cases per decoder and input kind (wal, park: {}) in {:?}",
        n / 10,
        started.elapsed()
    );
}

/// Rewrites `tests/corpus/` from the current types (run after a wire change:
/// `cargo test --test tests fuzz::regenerate_corpus -- --ignored`).
#[test]
#[ignore]
fn regenerate_corpus() {
    let write = |kind: &str, name: &str, bytes: &[u8]| {
        let dir = corpus_dir(kind);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join(name), bytes).unwrap();
    };
    let requests = [
        Request::List,
        Request::Metrics,
        Request::Create {
            parent: None,
            params: Params::greedy(1),
        },
        Request::Create {
            parent: Some(3),
            params: Params::greedy(9),
        },
        Request::AppendMessage {
            session: 1,
            role: Role::User.into(),
            text: "hello, superfluid \u{1F600}".into(),
        },
        Request::Read {
            session: 2,
            cursor: 5,
        },
    ];
    for (i, r) in requests.iter().enumerate() {
        let pc = to_postcard(r).unwrap();
        write("request_postcard", &format!("{i:02}.bin"), &pc);
        write(
            "request_json",
            &format!("{i:02}.json"),
            &serde_json::to_vec(r).unwrap(),
        );
        write(
            "frame",
            &format!("{i:02}.bin"),
            &superfluid::wire::frame::encode_frame(&pc).unwrap(),
        );
    }
    // Two frames back to back, and a header claiming 4 GiB.
    let mut two = superfluid::wire::frame::encode_frame(b"one").unwrap();
    two.extend(superfluid::wire::frame::encode_frame(b"two").unwrap());
    write("frame", "two.bin", &two);
    write("frame", "huge.bin", &u32::MAX.to_be_bytes());
    let replies = [
        WorkerResponse::Ready {
            config: WorkerConfig {
                n_ctx: 4096,
                n_seq: 4,
                n_batch: 512,
                threads: 4,
            },
            n_vocab: 32000,
            vocab_digest: [7; 32],
        },
        WorkerResponse::Decoded {
            drawn: vec![
                Drawn {
                    seq: 0,
                    token: 42,
                    eog: false,
                    logprob: None,
                    grammar_us: 0,
                },
                Drawn {
                    seq: 1,
                    token: 2,
                    eog: true,
                    logprob: None,
                    grammar_us: 0,
                },
            ],
            tokens: 17,
            decode_us: 1234,
            refused: vec![superfluid::wire::worker::Refused {
                seq: 2,
                message: "the grammar does not parse".into(),
            }],
            unparked: vec![],
            attention: superfluid::wire::worker::AttentionWork {
                full: 4096,
                computed: 1024,
            },
        },
        WorkerResponse::Done,
        WorkerResponse::Err {
            message: "no".into(),
        },
        WorkerResponse::KvFull {
            n_ctx: 4096,
            tokens: 9000,
        },
    ];
    for (i, r) in replies.iter().enumerate() {
        write(
            "worker_reply",
            &format!("{i:02}.bin"),
            &to_postcard(r).unwrap(),
        );
    }
    // A version-2 log with groups of several records.
    let d = tempfile::tempdir().unwrap();
    let (file, _) = open(d.path(), OpenMode::Durable, &mut |_, _| Ok(())).unwrap();
    let w = WalWriter::spawn(file, None).unwrap();
    for batch in [3usize, 1, 2] {
        let rxs: Vec<_> = (0..batch)
            .map(|i| w.append(format!("record {batch}.{i}").into_bytes()))
            .collect();
        for rx in rxs {
            rx.blocking_recv().unwrap().unwrap();
        }
    }
    w.shutdown();
    write("wal", "v2.wal", &fs::read(d.path().join(WAL_FILE)).unwrap());
    write(
        "wal",
        "golden-v1.wal",
        &fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden-v1.wal")).unwrap(),
    );
    let art = d.path().join("art");
    park::write(
        &art,
        &PARK_MODEL,
        &[1, 2, 3, 500],
        &[9u8; 100],
        park::KV_TYPE_F16,
    )
    .unwrap();
    write("park", "small.bin", &fs::read(&art).unwrap());
    park::write(&art, &PARK_MODEL, &[], &[], park::KV_TYPE_F16).unwrap();
    write("park", "empty.bin", &fs::read(&art).unwrap());
}
