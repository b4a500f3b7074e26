//! The `Metrics` text: generations by finish, KV cells in use, the WAL
//! writer's health, and a text `promtool check metrics` accepts.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::process::{Command, Stdio};

use superfluid::frontend::socket::Client;
use superfluid::wire::{Finish, Params, Request, Response, Role, SessionId};

use crate::util::{commit, created, params, TestDaemon};

fn asked(c: &mut Client, p: Params) -> SessionId {
    let s = created(
        c,
        Request::Create {
            parent: None,
            params: p,
        },
    );
    commit(
        c,
        Request::AppendMessage {
            session: s,
            role: Role::User.into(),
            text: "Write a long story about a lighthouse keeper and a storm.".into(),
        },
    );
    s
}

fn metrics(d: &TestDaemon) -> String {
    match d.call(&Request::Metrics) {
        Response::Text { text } => text,
        other => panic!("Metrics answered {other:?}"),
    }
}

/// Every sample line as (name with labels, value); panics on a line the
/// exposition format does not allow, or a sample whose family has no TYPE.
fn samples(text: &str) -> BTreeMap<String, f64> {
    let mut typed = BTreeSet::new();
    let mut histograms = BTreeSet::new();
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect(line);
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            assert!(typed.insert(name.to_string()), "TYPE twice: {line}");
            if kind == "histogram" {
                histograms.insert(name.to_string());
            }
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect(line);
        let name = series.split('{').next().unwrap();
        // A histogram's samples are its name with _bucket, _sum or _count.
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                name.strip_suffix(suffix)
                    .filter(|f| histograms.contains(*f))
            })
            .unwrap_or(name);
        assert!(typed.contains(family), "no TYPE before {line}");
        assert!(
            family
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "{line}"
        );
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("{line}"));
        assert!(out.insert(series.to_string(), value).is_none(), "{line}");
    }
    out
}

fn value(s: &BTreeMap<String, f64>, series: &str) -> f64 {
    *s.get(series)
        .unwrap_or_else(|| panic!("{series} missing in {s:?}"))
}

fn finish_label(f: Finish) -> String {
    f.name().replace(' ', "_")
}

/// The generations counted so far, by finish label.
fn by_finish(s: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    Finish::ALL
        .iter()
        .map(|&f| {
            let label = finish_label(f);
            let v = value(
                s,
                &format!("superfluid_generations_total{{finish=\"{label}\"}}"),
            );
            (label, v)
        })
        .collect()
}

#[test]
fn generations_by_finish_kv_cells_and_wal_health() {
    // The model with FIM tokens, so `Complete` runs a generation without a session.
    let mut d = TestDaemon::new();
    d.model = crate::util::derived_model("SmolLM2-135M-fim.gguf");
    d.spawn_and_wait();
    let mut c = d.client();
    let before = samples(&metrics(&d));
    assert!(by_finish(&before).values().all(|&v| v == 0.0), "{before:?}");
    assert_eq!(value(&before, "superfluid_wal_failed"), 0.0);
    let fsyncs_before = value(&before, "superfluid_wal_fsyncs_total");

    // One generation cut by max_tokens.
    let s = asked(&mut c, params(1));
    let replies = c
        .generate(&Request::Generate {
            session: s,
            max_tokens: 3,
        })
        .unwrap();
    let Some(Response::Generated { finish, .. }) = replies.last() else {
        panic!("{replies:?}")
    };
    assert_eq!(*finish, Finish::MaxTokens);

    // One cancelled once its first chunk is committed.
    let s = asked(&mut c, params(2));
    let socket = d.socket.clone();
    let gen = std::thread::spawn(move || {
        let mut c = Client::connect(&socket).unwrap();
        c.generate(&Request::Generate {
            session: s,
            max_tokens: 400,
        })
        .unwrap()
    });
    d.until_generated(s);
    let cancel = c.call(&Request::Cancel { session: s }).unwrap();
    let replies = gen.join().unwrap();
    let Some(Response::Generated { finish: second, .. }) = replies.last() else {
        panic!("{replies:?}")
    };
    assert_eq!(cancel, Response::Cancelling);
    assert_eq!(*second, Finish::Cancelled);

    // One without a session.
    let reply = c
        .call(&Request::Complete {
            prefix: "def add(a, b):\n    return ".into(),
            suffix: "\n".into(),
            mode: 0,
            max_tokens: 2,
        })
        .unwrap();
    assert!(matches!(reply, Response::Completion { .. }), "{reply:?}");

    let text = metrics(&d);
    let after = samples(&text);
    let counts = by_finish(&after);
    let mut expected: BTreeMap<String, f64> = Finish::ALL
        .iter()
        .map(|&f| (finish_label(f), 0.0))
        .collect();
    *expected.get_mut("max_tokens").unwrap() += 1.0;
    *expected.get_mut("cancelled").unwrap() += 1.0;
    // The completion ended somehow: one more generation, on some finish.
    let total: f64 = counts.values().sum();
    assert_eq!(total, 3.0, "{text}");
    for (label, want) in &expected {
        assert!(counts[label] >= *want, "{label}: {text}");
    }
    assert!(value(&after, "superfluid_kv_cells_used") > 0.0, "{text}");
    assert_eq!(value(&after, "superfluid_wal_failed"), 0.0, "{text}");
    assert!(
        value(&after, "superfluid_wal_fsyncs_total") > fsyncs_before,
        "{text}"
    );
    // Every completed fdatasync is one group commit the histogram timed.
    assert_eq!(
        value(&after, "superfluid_wal_commit_seconds_count"),
        value(&after, "superfluid_wal_fsyncs_total"),
        "{text}"
    );
    assert_eq!(
        value(&after, "superfluid_wal_commit_seconds_bucket{le=\"+Inf\"}"),
        value(&after, "superfluid_wal_fsyncs_total"),
        "{text}"
    );
    assert!(
        value(&after, "superfluid_wal_commit_seconds_sum") > 0.0,
        "{text}"
    );
    assert_eq!(
        value(&after, "superfluid_lane_state{state=\"ready\"}"),
        1.0,
        "{text}"
    );
    promtool_accepts(&text);
    documented(&text);
}

/// The tiled attention's work reaches `Metrics`: a prompt of more than 64
/// tokens is prefilled by llama.cpp's tiled kernel, whose causal diagonal
/// pairs superfluid's kernel computes in part (ggml-patch/).
#[test]
fn the_tiled_attention_work_is_counted() {
    let d = TestDaemon::start();
    let mut c = d.client();
    let before = samples(&metrics(&d));
    assert_eq!(
        value(&before, "superfluid_attention_tile_scores_total"),
        0.0
    );
    let s = created(
        &mut c,
        Request::Create {
            parent: None,
            params: params(3),
        },
    );
    let text: String = (0..12)
        .map(|i| format!("Line {i} of the log says the tide is low and the lamp is lit. "))
        .collect();
    commit(
        &mut c,
        Request::AppendMessage {
            session: s,
            role: Role::User.into(),
            text,
        },
    );
    crate::util::generate_text(&mut c, s, 1).unwrap();
    let after = samples(&metrics(&d));
    let full = value(&after, "superfluid_attention_tile_scores_total");
    let computed = value(&after, "superfluid_attention_scores_computed_total");
    assert!(full >= 64.0 * 64.0, "{after:?}");
    assert!(computed > 0.0 && computed < full, "{computed} of {full}");
}

/// `promtool check metrics` (Debian's `prometheus` package; scripts/setup.sh
/// installs it) accepts the text, lint included.
fn promtool_accepts(text: &str) {
    let mut child = match Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => panic!("promtool did not start ({e}); run scripts/setup.sh"),
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// docs/metrics.md has a row `| `name` | type | ...` for every family the
/// daemon exposes, with the type it exposes.
fn documented(text: &str) {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/metrics.md"))
        .expect("docs/metrics.md");
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect(line);
            assert!(
                doc.contains(&format!("| `{name}` | {kind} |")),
                "docs/metrics.md has no row for {name} ({kind})"
            );
        }
    }
}
