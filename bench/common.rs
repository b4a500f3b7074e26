//! What the benchmarks share: the model, and a daemon on a temp dir.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use superfluid::actors::lane::LaneState;
use superfluid::engine::exec::WorkerEngine;
use superfluid::frontend::socket::Client;
use superfluid::wire::worker::{DecodeItem, WorkerRequest, WorkerResponse};
use superfluid::wire::{Request, Response, Token};

/// How long a started daemon's worker may take to load the model.
const WORKER_LOAD_TIMEOUT_SECS: u64 = 60;

/// `$SUPERFLUID_TEST_MODEL`, or the default model's cached path.
pub fn model() -> PathBuf {
    superfluid::engine::default_model_path().expect("HOME or SUPERFLUID_TEST_MODEL is set")
}

/// A `superfluid serve` on a temp sessions dir, killed on drop.
pub struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
    /// The temp dir: `sessions/` and the daemon's `stdout` live here (not
    /// every benchmark reads it; each includes this file on its own).
    #[allow(dead_code)]
    pub dir: tempfile::TempDir,
}

impl Daemon {
    /// Starts the daemon with `args` after the paths and `env` set, and
    /// waits until it answers on its socket and its worker has loaded.
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("sf.sock");
        let stdout = std::fs::File::create(dir.path().join("stdout")).expect("stdout file");
        let child = Command::new(env!("CARGO_BIN_EXE_superfluid"))
            .arg("serve")
            .arg(model())
            .arg("--sessions")
            .arg(dir.path().join("sessions"))
            .arg("--socket")
            .arg(&socket)
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn superfluid serve");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(mut c) = Client::connect(&socket) {
                if matches!(c.call(&Request::List), Ok(Response::Sessions { .. })) {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "the daemon did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Let the worker load before timing anything: wait for the lane to
        // say it is ready.
        let ready = format!(
            "superfluid_lane_state{{state=\"{}\"}} 1",
            LaneState::Ready.name()
        );
        let deadline = Instant::now() + Duration::from_secs(WORKER_LOAD_TIMEOUT_SECS);
        loop {
            let mut c = Client::connect(&socket).expect("connect");
            match c.call(&Request::Metrics) {
                Ok(Response::Text { text }) if text.contains(&ready) => break,
                Ok(Response::Text { .. }) => {}
                other => panic!("Metrics: {other:?}"),
            }
            assert!(Instant::now() < deadline, "the worker did not load");
            std::thread::sleep(Duration::from_millis(20));
        }
        Daemon { child, socket, dir }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Puts `tokens` into sequence `seq` of the in-process engine (an idle session).
pub fn fill(engine: &mut WorkerEngine, seq: u32, tokens: &[Token]) {
    engine.handle(&WorkerRequest::KvClear { seq });
    for (k, chunk) in tokens.chunks(512).enumerate() {
        let r = engine.handle(&WorkerRequest::Decode {
            items: vec![DecodeItem {
                media: vec![],
                seq,
                pos: (k * 512) as u32,
                tokens: chunk.to_vec(),
                sample: None,
            }],
        });
        assert!(matches!(r, WorkerResponse::Decoded { .. }), "{r:?}");
    }
}
