//! The media store on a real daemon: `PutMedia` (hash, mode 0600, stored
//! once, every refusal), `GcMedia` (the grace period, then removal), and
//! `superfluid media put / ls / gc` as clients of the socket.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use superfluid::media::{GC_GRACE, MAX_MEDIA_BYTES};
use superfluid::wire::{Request, Response};

use crate::util::{bin, expect_err, TestDaemon};

/// A 1x1 PNG.
const PNG: &[u8] = &[
    0x89, 0x50, 0x4E, 0x47, 0x0D, 0x0A, 0x1A, 0x0A, 0x00, 0x00, 0x00, 0x0D, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x06, 0x00, 0x00, 0x00, 0x1F, 0x15, 0xC4,
    0x89, 0x00, 0x00, 0x00, 0x0D, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9C, 0x63, 0xF8, 0xCF, 0xC0, 0xF0,
    0x1F, 0x00, 0x05, 0x00, 0x01, 0xFF, 0x89, 0x99, 0x3D, 0x1D, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45,
    0x4E, 0x44, 0xAE, 0x42, 0x60, 0x82,
];
/// The start of a JFIF JPEG (SOI, APP0).
const JPEG: &[u8] = &[
    0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x10, 0x4A, 0x46, 0x49, 0x46, 0x00, 0x01, 0x01, 0x00, 0x00, 0x01,
    0x00, 0x01, 0x00, 0x00, 0xFF, 0xD9,
];

fn put(d: &TestDaemon, bytes: &[u8], mime: &str) -> String {
    match d.call(&Request::PutMedia {
        bytes: bytes.to_vec(),
        mime: mime.into(),
    }) {
        Response::Media { hash } => hash,
        other => panic!("PutMedia: {other:?}"),
    }
}

fn gc(d: &TestDaemon) -> (u64, u64) {
    match d.call(&Request::GcMedia) {
        Response::Gc { kept, removed } => (kept, removed),
        other => panic!("GcMedia: {other:?}"),
    }
}

fn age(path: &std::path::Path, by: Duration) {
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(SystemTime::now() - by)
        .unwrap();
}

#[test]
fn put_media_stores_an_image_once_under_its_sha256_and_refuses_the_rest() {
    let d = TestDaemon::start();
    let media = d.sessions.join("media");
    let png = put(&d, PNG, "image/png");
    assert_eq!(png, hex::encode(Sha256::digest(PNG)));
    let jpeg = put(&d, JPEG, "image/jpeg");
    assert_eq!(jpeg, hex::encode(Sha256::digest(JPEG)));
    for h in [&png, &jpeg] {
        let meta = std::fs::metadata(media.join(h)).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    }
    assert_eq!(std::fs::read(media.join(&png)).unwrap(), PNG);
    // The same bytes again: the same hash, one file.
    assert_eq!(put(&d, PNG, "image/png"), png);
    assert_eq!(std::fs::read_dir(&media).unwrap().count(), 2);

    let mut c = d.client();
    let refused = |bytes: Vec<u8>, mime: &str| {
        let mut c = d.client();
        expect_err(
            &mut c,
            &Request::PutMedia {
                bytes,
                mime: mime.into(),
            },
        )
    };
    assert!(refused(PNG.to_vec(), "image/jpeg").contains("not the declared image/jpeg"));
    assert!(refused(b"hello, world".to_vec(), "image/png").contains("not an image"));
    assert!(refused(PNG.to_vec(), "text/html").contains("is not one of"));
    let big = [PNG, &vec![0u8; MAX_MEDIA_BYTES]].concat();
    assert!(refused(big, "image/png").contains("cap"));
    // Nothing of the refused puts was written.
    assert_eq!(std::fs::read_dir(&media).unwrap().count(), 2);
    // AppendImage without a projector: a clear Err, nothing committed.
    let s = d.create(&mut c);
    let before = d.wal_bytes().len();
    let e = expect_err(
        &mut c,
        &Request::AppendImage {
            session: s,
            role: 1,
            blob: png.clone(),
            pre_text: String::new(),
            post_text: String::new(),
        },
    );
    assert!(e.contains("no vision projector"), "{e}");
    assert_eq!(d.wal_bytes().len(), before);
}

#[test]
fn gc_media_keeps_recent_blobs_and_removes_old_unreferenced_ones() {
    let d = TestDaemon::start();
    let media = d.sessions.join("media");
    assert_eq!(gc(&d), (0, 0));
    let png = put(&d, PNG, "image/png");
    let jpeg = put(&d, JPEG, "image/jpeg");
    // Just put: within the grace period, both kept.
    assert_eq!(gc(&d), (2, 0));
    age(&media.join(&png), GC_GRACE + Duration::from_secs(60));
    assert_eq!(gc(&d), (1, 1));
    assert!(!media.join(&png).exists());
    assert!(media.join(&jpeg).exists());
}

#[test]
fn the_media_command_puts_lists_and_collects_through_the_socket() {
    let d = TestDaemon::start();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dot.png");
    std::fs::write(&file, PNG).unwrap();
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, b"not an image").unwrap();
    let run = |args: &[&str]| {
        Command::new(bin())
            .arg("media")
            .args(args)
            .output()
            .expect("superfluid media")
    };
    let socket = d.socket.to_str().unwrap();
    let out = run(&["put", file.to_str().unwrap(), "--socket", socket]);
    assert!(out.status.success(), "{out:?}");
    let hash = hex::encode(Sha256::digest(PNG));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("{hash}  {}", file.display())
    );
    let out = run(&["put", text.to_str().unwrap(), "--socket", socket]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a PNG, JPEG, WebP or GIF"));

    let sessions = d.sessions.to_str().unwrap();
    let out = run(&["ls", "--json", "--sessions", sessions]);
    assert!(out.status.success(), "{out:?}");
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(line["hash"], hash);
    assert_eq!(line["bytes"], PNG.len());
    assert_eq!(line["mime"], "image/png");

    age(&d.sessions.join("media").join(&hash), GC_GRACE * 2);
    let out = run(&["gc", "--socket", socket]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "kept 0, removed 1"
    );
}
