//! Models by reference (issue 14) against a fake hub: a real HTTP server
//! started here that serves the hub's API paths and files the way
//! huggingface.co does (`/api/models/{repo}/revision/main?blobs=true`,
//! `/{repo}/resolve/main/{file}` with `Range`, `Content-Range`,
//! `x-repo-commit` and `x-linked-etag`), so no test reaches the internet.
//! `superfluid pull`, `models`, `rm` and `serve REF` run as the real
//! binary, with `HF_ENDPOINT` and `HF_HUB_CACHE` pointing at the fake hub
//! and a temp cache.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use superfluid::wire::{Request, Response, Role};

use crate::util::{bin, commit, model_path, TestDaemon};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// One file of a fake repo.
#[derive(Clone)]
struct HubFile {
    bytes: Arc<Vec<u8>>,
    /// The SHA-256 the listing claims (the real one unless a test lies).
    sha256: String,
    /// Close the first whole-file transfer after this many bytes.
    drop_after: Option<usize>,
}

impl HubFile {
    fn new(bytes: Arc<Vec<u8>>) -> HubFile {
        let sha256 = hex::encode(Sha256::digest(&bytes[..]));
        HubFile {
            bytes,
            sha256,
            drop_after: None,
        }
    }
}

#[derive(Clone, Default)]
struct HubRepo {
    files: Vec<(String, HubFile)>,
    /// Only this bearer token may read it.
    token: Option<String>,
}

struct FakeHub {
    port: u16,
    /// Every request line (with its Range), in order.
    log: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

impl FakeHub {
    fn start(repos: HashMap<String, HubRepo>) -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let log = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let repos = Arc::new(Mutex::new(repos));
        let (log2, stop2) = (log.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let (repos, log) = (repos.clone(), log2.clone());
                std::thread::spawn(move || serve(conn, &repos, &log));
            }
        });
        FakeHub { port, log, stop }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn requests(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

fn respond(conn: &mut TcpStream, status: &str, headers: &[(&str, String)], body: &[u8]) {
    let mut head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let _ = conn.write_all(head.as_bytes());
    let _ = conn.write_all(body);
}

fn serve(mut conn: TcpStream, repos: &Mutex<HashMap<String, HubRepo>>, log: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some((n, v)) = h.split_once(':') {
            headers.insert(n.trim().to_ascii_lowercase(), v.trim().to_owned());
        }
    }
    let path = line.split(' ').nth(1).unwrap_or("").to_owned();
    let range = headers.get("range").cloned().unwrap_or_default();
    log.lock().unwrap().push(format!("{path} {range}"));
    let auth = headers.get("authorization").cloned();
    let mut repos = repos.lock().unwrap();
    // /api/models/{owner}/{name}/revision/main?blobs=true
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let repo_id = rest.split("/revision/").next().unwrap_or("");
        let Some(repo) = repos.get(repo_id) else {
            return respond(
                &mut conn,
                "404 Not Found",
                &[],
                b"{\"error\":\"Repository not found\"}",
            );
        };
        if repo.token.is_some() && auth != repo.token.as_ref().map(|t| format!("Bearer {t}")) {
            return respond(&mut conn, "401 Unauthorized", &[], b"{\"error\":\"gated\"}");
        }
        let siblings: Vec<serde_json::Value> = repo
            .files
            .iter()
            .map(|(name, f)| {
                serde_json::json!({"rfilename": name, "size": f.bytes.len(),
                    "lfs": {"sha256": f.sha256, "size": f.bytes.len()}})
            })
            .collect();
        let body = serde_json::json!({"id": repo_id, "sha": COMMIT, "siblings": siblings});
        return respond(
            &mut conn,
            "200 OK",
            &[("Content-Type", "application/json".into())],
            body.to_string().as_bytes(),
        );
    }
    // /{owner}/{name}/resolve/main/{file}
    let Some((repo_id, file)) = path.trim_start_matches('/').split_once("/resolve/main/") else {
        return respond(&mut conn, "404 Not Found", &[], b"");
    };
    let Some(repo) = repos.get_mut(repo_id) else {
        return respond(&mut conn, "404 Not Found", &[], b"");
    };
    if repo.token.is_some() && auth != repo.token.as_ref().map(|t| format!("Bearer {t}")) {
        return respond(&mut conn, "401 Unauthorized", &[], b"");
    }
    let Some((_, f)) = repo.files.iter_mut().find(|(n, _)| n == file) else {
        return respond(&mut conn, "404 Not Found", &[], b"");
    };
    let total = f.bytes.len();
    let (start, end) = match range.strip_prefix("bytes=").and_then(|r| r.split_once('-')) {
        Some((a, b)) => (
            a.parse::<usize>().unwrap_or(0),
            b.parse::<usize>()
                .map(|b| b + 1)
                .unwrap_or(total)
                .min(total),
        ),
        None => (0, total),
    };
    let real = hex::encode(Sha256::digest(&f.bytes[..]));
    let headers = [
        ("x-repo-commit", COMMIT.to_owned()),
        ("x-linked-etag", format!("\"{real}\"")),
        ("ETag", format!("\"{real}\"")),
        (
            "Content-Range",
            format!("bytes {start}-{}/{total}", end.saturating_sub(1)),
        ),
        ("Accept-Ranges", "bytes".to_owned()),
    ];
    let body = &f.bytes[start.min(end)..end];
    let whole = end - start > 1;
    if let Some(cut) = f.drop_after.filter(|_| whole) {
        // The first transfer of the file dies mid-way: headers promise it
        // all, the connection closes after `cut` bytes.
        f.drop_after = None;
        let mut head = format!(
            "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nConnection: close\r\n",
            body.len()
        );
        for (n, v) in &headers {
            head.push_str(&format!("{n}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let _ = conn.write_all(head.as_bytes());
        let _ = conn.write_all(&body[..cut.min(body.len())]);
        let _ = conn.flush();
        let _ = conn.shutdown(std::net::Shutdown::Both);
        return;
    }
    respond(&mut conn, "206 Partial Content", &headers, body);
}

fn model_bytes() -> Arc<Vec<u8>> {
    static BYTES: std::sync::OnceLock<Arc<Vec<u8>>> = std::sync::OnceLock::new();
    BYTES
        .get_or_init(|| Arc::new(std::fs::read(model_path()).unwrap()))
        .clone()
}

/// The fake hub's repos: the default model (with a projector beside it),
/// a split model, a gated repo and one whose listing lies about a digest.
fn repos() -> HashMap<String, HubRepo> {
    let model = HubFile::new(model_bytes());
    let small = |s: &str| HubFile::new(Arc::new(s.as_bytes().repeat(1000)));
    let mut m = HashMap::new();
    m.insert(
        "fake/SmolLM2-GGUF".to_owned(),
        HubRepo {
            files: vec![
                ("README.md".into(), small("readme")),
                ("SmolLM2-135M-Instruct.Q4_1.gguf".into(), model.clone()),
                // A real projector (the derived vision test one), which the
                // daemon loads beside the model it fetched.
                (
                    "mmproj-SmolLM2-F16.gguf".into(),
                    HubFile::new(Arc::new(
                        std::fs::read(crate::util::derived_model(
                            "mmproj-SmolLM2-135M-vision.gguf",
                        ))
                        .unwrap(),
                    )),
                ),
            ],
            token: None,
        },
    );
    m.insert(
        "fake/split".to_owned(),
        HubRepo {
            files: vec![
                ("Q8_0/m-Q8_0-00001-of-00002.gguf".into(), small("part one")),
                ("Q8_0/m-Q8_0-00002-of-00002.gguf".into(), small("part two")),
                ("m-Q4_0.gguf".into(), small("other")),
            ],
            token: None,
        },
    );
    m.insert(
        "fake/gated".to_owned(),
        HubRepo {
            files: vec![("g-Q4_1.gguf".into(), small("gated"))],
            token: Some("hf_secret".into()),
        },
    );
    let mut lying = small("lying");
    lying.sha256 = "00".repeat(32);
    m.insert(
        "fake/bad-sha".to_owned(),
        HubRepo {
            files: vec![("b-Q4_1.gguf".into(), lying)],
            token: None,
        },
    );
    let mut dropping = HubFile::new(model_bytes());
    dropping.drop_after = Some(model_bytes().len() / 3);
    m.insert(
        "fake/flaky".to_owned(),
        HubRepo {
            files: vec![("SmolLM2-135M-Instruct.Q4_1.gguf".into(), dropping)],
            token: None,
        },
    );
    m
}

/// Runs `superfluid ARGS` against `endpoint` with the cache at `cache`.
fn run(endpoint: &str, cache: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(args)
        .env("HF_ENDPOINT", endpoint)
        .env("HF_HUB_CACHE", cache)
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE")
        .env("HF_HOME", cache.join("home"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn sha_of(path: &Path) -> String {
    hex::encode(Sha256::digest(std::fs::read(path).unwrap()))
}

#[test]
fn pull_resolves_a_quant_with_its_projector_and_reuses_the_cache_offline() {
    let hub = FakeHub::start(repos());
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("hub");
    let out = run(
        &hub.endpoint(),
        &cache,
        &[],
        &["pull", "fake/SmolLM2-GGUF:q4_1"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let paths: Vec<PathBuf> = text(&out.stdout).lines().map(PathBuf::from).collect();
    assert_eq!(paths.len(), 2, "{paths:?}");
    assert!(paths[0].ends_with("SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(paths[1].ends_with("mmproj-SmolLM2-F16.gguf"));
    assert_eq!(sha_of(&paths[0]), sha_of(&model_path()));
    // The huggingface_hub layout: a snapshot pointer into blobs/<sha256>.
    let blob = std::fs::canonicalize(&paths[0]).unwrap();
    assert!(blob.starts_with(std::fs::canonicalize(&cache).unwrap()));
    assert_eq!(
        blob.file_name().unwrap().to_string_lossy(),
        sha_of(&model_path())
    );
    assert!(paths[0]
        .to_string_lossy()
        .contains(&format!("models--fake--SmolLM2-GGUF/snapshots/{COMMIT}")));
    // Progress lines (stderr is not a terminal here).
    let err = text(&out.stderr);
    assert!(
        err.contains("pull: SmolLM2-135M-Instruct.Q4_1.gguf") && err.contains("MiB done"),
        "{err}"
    );
    // Online again: the listing is asked, the cached file is not fetched again.
    let before = hub.requests().len();
    let out = run(
        &hub.endpoint(),
        &cache,
        &[],
        &["pull", "fake/SmolLM2-GGUF:Q4_1"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let asked: Vec<String> = hub.requests()[before..].to_vec();
    assert!(
        asked.iter().all(|r| r.starts_with("/api/")),
        "a cached file was fetched again: {asked:?}"
    );
    // Offline: the same reference from the cache, no request to the hub.
    let before = hub.requests().len();
    let out = run(
        &hub.endpoint(),
        &cache,
        &[("HF_HUB_OFFLINE", "1")],
        &["pull", "fake/SmolLM2-GGUF:Q4_1"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).lines().next().map(PathBuf::from),
        Some(paths[0].clone())
    );
    assert_eq!(hub.requests().len(), before, "offline asks the hub nothing");
    // An unreachable hub: the cache serves too.
    let out = run(
        "http://127.0.0.1:9",
        &cache,
        &[],
        &["pull", "fake/SmolLM2-GGUF:Q4_1"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Offline and not cached: a clear error.
    let out = run(
        &hub.endpoint(),
        &cache,
        &[("HF_HUB_OFFLINE", "1")],
        &["pull", "fake/split:Q8_0"],
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("HF_HUB_OFFLINE"),
        "{}",
        text(&out.stderr)
    );
    // A quant the repo does not have names those it has.
    let out = run(
        &hub.endpoint(),
        &cache,
        &[],
        &["pull", "fake/SmolLM2-GGUF:Q8_0"],
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("fake/SmolLM2-GGUF:Q8_0") && err.contains("quants there: Q4_1"),
        "{err}"
    );
    // `models` lists it; `rm` removes it and its blob.
    let out = run(&hub.endpoint(), &cache, &[], &["models"]);
    let listed = text(&out.stdout);
    assert!(
        listed.contains("fake/SmolLM2-GGUF:Q4_1") && listed.contains("Q4_1"),
        "{listed}"
    );
    let out = run(
        &hub.endpoint(),
        &cache,
        &[],
        &["rm", "fake/SmolLM2-GGUF:Q4_1"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!paths[0].exists() && !blob.exists());
    let out = run(&hub.endpoint(), &cache, &[], &["models"]);
    assert!(
        !text(&out.stdout).contains("fake/SmolLM2-GGUF"),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn pull_takes_split_files_whole() {
    let hub = FakeHub::start(repos());
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("hub");
    let out = run(&hub.endpoint(), &cache, &[], &["pull", "fake/split:q8_0"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let paths: Vec<String> = text(&out.stdout).lines().map(str::to_owned).collect();
    assert_eq!(paths.len(), 2, "{paths:?}");
    assert!(
        paths[0].ends_with("Q8_0/m-Q8_0-00001-of-00002.gguf"),
        "{paths:?}"
    );
    assert!(
        paths[1].ends_with("Q8_0/m-Q8_0-00002-of-00002.gguf"),
        "{paths:?}"
    );
    assert_eq!(std::fs::read(&paths[1]).unwrap(), b"part two".repeat(1000));
}

#[test]
fn pull_resumes_after_the_connection_drops() {
    let hub = FakeHub::start(repos());
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("hub");
    let out = run(&hub.endpoint(), &cache, &[], &["pull", "fake/flaky:Q4_1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let path = PathBuf::from(text(&out.stdout).lines().next().unwrap());
    assert_eq!(sha_of(&path), sha_of(&model_path()));
    // After the drop, the next transfer asked for the rest only.
    let resumed = hub
        .requests()
        .iter()
        .filter_map(|r| r.split("bytes=").nth(1).map(str::to_owned))
        .filter_map(|r| r.split('-').next().and_then(|a| a.parse::<u64>().ok()))
        .any(|start| start > 0);
    assert!(resumed, "{:?}", hub.requests());
    assert!(
        text(&out.stderr).contains("resumed at"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_wrong_digest_is_refused_and_a_gated_repo_asks_for_hf_token() {
    let hub = FakeHub::start(repos());
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("hub");
    let out = run(&hub.endpoint(), &cache, &[], &["pull", "fake/bad-sha:Q4_1"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("SHA-256") && err.contains(&"00".repeat(32)),
        "{err}"
    );
    // Nothing of it is left to be used.
    let out = run(
        &hub.endpoint(),
        &cache,
        &[("HF_HUB_OFFLINE", "1")],
        &["pull", "fake/bad-sha:Q4_1"],
    );
    assert!(!out.status.success(), "{}", text(&out.stdout));

    let out = run(&hub.endpoint(), &cache, &[], &["pull", "fake/gated:Q4_1"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("HF_TOKEN") && err.contains("fake/gated:Q4_1"),
        "{err}"
    );
    let out = run(
        &hub.endpoint(),
        &cache,
        &[("HF_TOKEN", "hf_secret")],
        &["pull", "fake/gated:Q4_1"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    // A repo the hub does not have.
    let out = run(&hub.endpoint(), &cache, &[], &["pull", "fake/nothing:Q4_1"]);
    assert!(text(&out.stderr).contains("404"), "{}", text(&out.stderr));
}

#[test]
fn serve_takes_a_reference() {
    let hub = FakeHub::start(repos());
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("hub");
    let mut d = TestDaemon::new();
    d.model = PathBuf::from("fake/SmolLM2-GGUF:Q4_1");
    d.env = vec![
        ("HF_ENDPOINT".into(), hub.endpoint()),
        ("HF_HUB_CACHE".into(), cache.to_string_lossy().into_owned()),
    ];
    d.spawn_and_wait();
    assert!(
        d.stderr().contains("fake/SmolLM2-GGUF:Q4_1 is "),
        "{}",
        d.stderr()
    );
    let mut c = d.client();
    let s = d.create(&mut c);
    commit(
        &mut c,
        Request::AppendMessage {
            session: s,
            role: Role::User.into(),
            text: "What is the capital of France?".into(),
        },
    );
    let replies = c
        .generate(&Request::Generate {
            session: s,
            max_tokens: 8,
        })
        .unwrap();
    assert!(
        matches!(replies.last(), Some(Response::Generated { tokens_generated, .. }) if *tokens_generated > 0),
        "{replies:?}"
    );
    // The projector fetched beside the model is the worker's.
    assert!(
        d.stderr().contains("vision projector ready"),
        "{}",
        d.stderr()
    );
}

/// `rm` (and `DELETE /api/delete`, which calls the same code) removes only
/// what lies in the repo's folder of the cache: a snapshot pointer that
/// links outside it, a linked directory in a snapshot, and a `refs/main`
/// that climbs out of `snapshots/` lead to files that stay. Offline, on a
/// cache laid out by hand.
#[test]
fn rm_never_removes_a_file_outside_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let outside = tmp.path().join("outside");
    std::fs::create_dir_all(outside.join("dir")).unwrap();
    std::fs::create_dir_all(outside.join("dir3")).unwrap();
    let victims = [
        outside.join("victim-Q4_0.gguf"),
        outside.join("dir").join("x-Q8_0.gguf"),
        outside.join("dir3").join("e-Q5_0.gguf"),
    ];
    for v in &victims {
        std::fs::write(v, b"GGUF not yours").unwrap();
    }
    let repo = |name: &str, commit: &str| {
        let root = cache.join(format!("models--o--{name}"));
        std::fs::create_dir_all(root.join("refs")).unwrap();
        std::fs::write(root.join("refs").join("main"), commit).unwrap();
        std::fs::create_dir_all(root.join("snapshots").join("c0")).unwrap();
        root
    };
    // A pointer to a file outside the cache.
    let a = repo("a", "c0");
    std::os::unix::fs::symlink(&victims[0], a.join("snapshots/c0/a-Q4_0.gguf")).unwrap();
    // A linked directory inside the snapshot.
    let b = repo("b", "c0");
    std::os::unix::fs::symlink(outside.join("dir"), b.join("snapshots/c0/sub")).unwrap();
    // refs/main naming a path out of snapshots/.
    repo("c", "../../../outside/dir3");
    for (reference, victim) in [
        ("o/a:Q4_0", &victims[0]),
        ("o/b:Q8_0", &victims[1]),
        ("o/c:Q5_0", &victims[2]),
    ] {
        let out = run(
            "http://127.0.0.1:9",
            &cache,
            &[("HF_HUB_OFFLINE", "1")],
            &["rm", reference],
        );
        assert!(
            !out.status.success(),
            "{reference}: rm succeeded: {}",
            text(&out.stdout)
        );
        assert!(
            victim.exists(),
            "{reference}: {} was removed",
            victim.display()
        );
    }
    // Nothing outside was touched.
    for v in &victims {
        assert_eq!(std::fs::read(v).unwrap(), b"GGUF not yours");
    }
}

/// An online pull over a cache whose snapshot pointer links outside it is
/// refused before anything is downloaded or removed: the pointer is not
/// written through, nor is its target removed as a wrong digest.
#[test]
fn pull_never_writes_or_removes_through_a_pointer_outside_the_cache() {
    let hub = FakeHub::start(repos());
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("hub");
    let victim = dir.path().join("victim.gguf");
    std::fs::write(&victim, b"not yours").unwrap();
    let root = cache.join("models--fake--SmolLM2-GGUF");
    let snap = root.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(root.join("refs")).unwrap();
    std::fs::write(root.join("refs").join("main"), COMMIT).unwrap();
    std::os::unix::fs::symlink(&victim, snap.join("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    let out = run(
        &hub.endpoint(),
        &cache,
        &[],
        &["pull", "fake/SmolLM2-GGUF:q4_1"],
    );
    assert!(!out.status.success(), "{}", text(&out.stdout));
    assert!(
        text(&out.stderr).contains("leads outside"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(std::fs::read(&victim).unwrap(), b"not yours");
}

/// `pull` of a path that is not there fails (it printed the path and exited
/// 0: `pull ./typo.gguf`, or `repo:QUANT` without its owner, which reads as
/// a path), and `rm` of a reference not in the cache says so, not that the
/// hub is offline (it was not). Neither asks the hub anything.
#[test]
fn pull_of_a_missing_path_fails_and_rm_of_what_is_not_cached_says_so() {
    let hub = FakeHub::start(repos());
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("hub");
    for missing in ["./typo.gguf", "Qwen3-8B-GGUF:Q4_K_M"] {
        let out = run(&hub.endpoint(), &cache, &[], &["pull", missing]);
        assert!(
            !out.status.success() && text(&out.stderr).contains("model file not found"),
            "{missing}: {}",
            text(&out.stderr)
        );
    }
    let out = run(&hub.endpoint(), &cache, &[], &["rm", "foo/bar:Q4_K_M"]);
    let stderr = text(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("nothing to remove")
            && !stderr.contains("offline"),
        "{stderr}"
    );
    assert!(hub.requests().is_empty(), "{:?}", hub.requests());
}
