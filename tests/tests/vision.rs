//! Images on the model's input (`AppendImage`, `--mmproj`) on a real daemon
//! with the derived vision test model (scripts/make-test-models.py: the
//! default model with idefics3's wrapper tokens, and a random idefics3
//! projector: its answers are noise, the mechanics are what is tested).

use std::time::{Duration, SystemTime};

use superfluid::frontend::socket::Client;
use superfluid::wire::worker::MEDIA_TOKEN;
use superfluid::wire::{PurgeMode, Record, Request, Response, SessionId};

use crate::util::{derived_model, expect_err, read_events, TestDaemon};

/// The positions the test projector gives any image: a 1x1 grid tile and
/// the overview, 4 embeddings each, wrapped in 6 tokens.
const IMAGE_POSITIONS: usize = 14;
const IMAGE_EMBEDDINGS: usize = 8;

/// A `w`x`h` RGB PNG (stored, uncompressed deflate) whose pixels depend on
/// `seed`.
pub fn png(w: u32, h: u32, seed: u8) -> Vec<u8> {
    png_of(w, h, |x, y| {
        let v = (x * 7 + y * 13) as u8 ^ seed;
        [v, v.wrapping_mul(3), v.wrapping_add(seed)]
    })
}

/// A `w`x`h` RGB PNG of the pixels `pixel(x, y)` gives.
pub fn png_of(w: u32, h: u32, pixel: impl Fn(u32, u32) -> [u8; 3]) -> Vec<u8> {
    fn crc32(bytes: &[u8]) -> u32 {
        let mut c = 0xFFFF_FFFFu32;
        for &b in bytes {
            c ^= u32::from(b);
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
        }
        !c
    }
    fn chunk(out: &mut Vec<u8>, kind: &[u8], data: &[u8]) {
        out.extend((data.len() as u32).to_be_bytes());
        let mut body = kind.to_vec();
        body.extend(data);
        out.extend(&body);
        out.extend(crc32(&body).to_be_bytes());
    }
    let mut raw = Vec::new();
    for y in 0..h {
        raw.push(0); // filter: none
        for x in 0..w {
            raw.extend(pixel(x, y));
        }
    }
    // zlib, stored blocks of at most 65535 bytes, then Adler-32.
    let mut z = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = raw.chunks(65535).collect();
    for (i, b) in blocks.iter().enumerate() {
        z.push(u8::from(i + 1 == blocks.len()));
        z.extend((b.len() as u16).to_le_bytes());
        z.extend((!(b.len() as u16)).to_le_bytes());
        z.extend(*b);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &x in &raw {
        a = (a + u32::from(x)) % 65521;
        b = (b + a) % 65521;
    }
    z.extend(((b << 16) | a).to_be_bytes());
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = w.to_be_bytes().to_vec();
    ihdr.extend(h.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]); // 8-bit RGB
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(&mut out, b"IDAT", &z);
    chunk(&mut out, b"IEND", &[]);
    out
}

pub fn vision_daemon() -> TestDaemon {
    vision_daemon_with(&[])
}

/// The vision daemon with more `serve` flags.
fn vision_daemon_with(extra: &[&str]) -> TestDaemon {
    let mut d = TestDaemon::new();
    d.model = derived_model("SmolLM2-135M-vision.gguf");
    let mmproj = derived_model("mmproj-SmolLM2-135M-vision.gguf");
    d.extra_args = vec!["--mmproj".into(), mmproj.display().to_string()];
    d.extra_args.extend(extra.iter().map(|a| a.to_string()));
    d.spawn_and_wait();
    d
}

fn put(c: &mut Client, bytes: &[u8]) -> String {
    match c
        .call(&Request::PutMedia {
            bytes: bytes.to_vec(),
            mime: "image/png".into(),
        })
        .unwrap()
    {
        Response::Media { hash } => hash,
        other => panic!("PutMedia: {other:?}"),
    }
}

fn append_image(c: &mut Client, s: SessionId, blob: &str) -> Response {
    c.call(&Request::AppendImage {
        session: s,
        role: 1,
        blob: blob.into(),
        pre_text: "Look at this picture:".into(),
        post_text: "What is in it?".into(),
    })
    .unwrap()
}

/// A greedy generation: (warm_prefix, Err text if it failed).
fn generate(c: &mut Client, s: SessionId, n: u32) -> (u64, Option<String>) {
    let replies = c
        .generate(&Request::Generate {
            session: s,
            max_tokens: n,
        })
        .unwrap();
    for r in &replies {
        if let Response::Err { message } = r {
            return (0, Some(message.clone()));
        }
    }
    match replies.last() {
        Some(Response::Generated { warm_prefix, .. }) => (*warm_prefix, None),
        other => (0, Some(format!("{other:?}"))),
    }
}

fn image_record(c: &mut Client, s: SessionId) -> Record {
    read_events(c, s)
        .into_iter()
        .map(|e| e.body)
        .find(|b| matches!(b, Record::Image { .. }))
        .expect("an Image event")
}

#[test]
fn an_image_goes_on_the_input_is_re_encoded_after_a_restart_and_never_uses_the_cache() {
    let mut d = vision_daemon();
    let mut c = d.client();
    let blob = put(&mut c, &png_of(48, 40, |_, _| [0, 0, 0]));
    let s = d.create(&mut c);
    match append_image(&mut c, s, &blob) {
        Response::Committed { .. } => {}
        other => panic!("AppendImage: {other:?}"),
    }
    // The record holds the projector's layout between the two texts.
    let Record::Image {
        span,
        image_at,
        image_len,
        blob: recorded,
        ..
    } = image_record(&mut c, s)
    else {
        unreachable!()
    };
    assert_eq!(recorded, blob);
    assert_eq!(image_len as usize, IMAGE_POSITIONS);
    let layout = &span[image_at as usize..(image_at + image_len) as usize];
    assert_eq!(
        layout.iter().filter(|&&t| t == MEDIA_TOKEN).count(),
        IMAGE_EMBEDDINGS
    );
    assert_eq!(
        span.iter().filter(|&&t| t == MEDIA_TOKEN).count(),
        IMAGE_EMBEDDINGS
    );
    assert!(
        image_at > 0,
        "the template's header and the text come first"
    );

    let (warm, err) = generate(&mut c, s, 8);
    assert_eq!(err, None);
    assert_eq!(warm, 0, "a session with an image prefills it all");
    // The image is on the input: the same texts with the same image draw
    // the same reply, with another image another one.
    let reply = |c: &mut Client, s: SessionId| -> Vec<u32> {
        read_events(c, s)
            .iter()
            .filter_map(|e| match &e.body {
                Record::Generated { span, .. } => Some(span.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    };
    let first = reply(&mut c, s);
    let same = d.create(&mut c);
    let other = d.create(&mut c);
    let other_blob = put(&mut c, &png_of(48, 40, |_, _| [255, 255, 255]));
    for (session, b) in [(same, &blob), (other, &other_blob)] {
        assert!(matches!(
            append_image(&mut c, session, b),
            Response::Committed { .. }
        ));
        assert_eq!(generate(&mut c, session, 8), (0, None));
    }
    assert_eq!(reply(&mut c, same), first, "the same image, the same reply");
    assert_ne!(reply(&mut c, other), first, "another image, another reply");
    // The next turn: still no cached prefix, the whole input evaluated again.
    let _ = c.call(&Request::AppendMessage {
        session: s,
        role: 1,
        text: "And the colours?".into(),
    });
    let (warm, err) = generate(&mut c, s, 8);
    assert_eq!((warm, err), (0, None), "an image session's next turn");
    // A text session beside it takes nothing from the image session's cells
    // either (the same opening text).
    let t = d.create(&mut c);
    let _ = c.call(&Request::AppendMessage {
        session: t,
        role: 1,
        text: "Look at this picture:".into(),
    });
    let (warm, err) = generate(&mut c, t, 4);
    assert_eq!(
        (warm, err),
        (0, None),
        "a text session beside the image one"
    );

    // After a SIGKILL the image is read and encoded again from the blob.
    d.kill9();
    d.spawn_and_wait();
    let mut c = d.client();
    let _ = c.call(&Request::AppendMessage {
        session: s,
        role: 1,
        text: "Once more?".into(),
    });
    let (warm, err) = generate(&mut c, s, 8);
    assert_eq!((warm, err), (0, None), "after the restart");
    let generated = read_events(&mut c, s)
        .iter()
        .filter(|e| matches!(e.body, Record::Generated { .. }))
        .count();
    assert!(generated >= 3, "three turns generated: {generated}");
    let log = d.stderr();
    assert!(!log.contains("panicked"), "{log}");
}

#[test]
fn images_are_refused_clearly_and_a_flipped_blob_never_reaches_the_model() {
    // The default model has no projector.
    let plain = TestDaemon::start();
    let mut c = plain.client();
    let blob = put(&mut c, &png(8, 8, 1));
    let s = plain.create(&mut c);
    let e = expect_err(&mut c, &append_image_req(s, &blob));
    assert!(e.contains("--mmproj"), "{e}");
    drop(plain);

    let d = vision_daemon();
    let mut c = d.client();
    let s = d.create(&mut c);
    let unknown = "ab".repeat(32);
    let e = expect_err(&mut c, &append_image_req(s, &unknown));
    assert!(e.contains("not in the store"), "{e}");
    let e = expect_err(&mut c, &append_image_req(s, "../wal.log"));
    assert!(e.contains("PutMedia hash"), "{e}");

    // A blob flipped after it was appended: the generation fails with a
    // clear error (its own item refused by the worker), and the daemon goes
    // on serving other sessions.
    let blob = put(&mut c, &png(20, 20, 9));
    match append_image(&mut c, s, &blob) {
        Response::Committed { .. } => {}
        other => panic!("AppendImage: {other:?}"),
    }
    flip_a_bit(&d, &blob);
    let (_, err) = generate(&mut c, s, 4);
    let err = err.expect("the generation on a flipped blob fails");
    assert!(err.contains("no longer matches its hash"), "{err}");
    another_session_generates(&d, &mut c);
    let e = expect_err(&mut c, &append_image_req(s, &blob));
    assert!(e.contains("no longer matches its hash"), "{e}");
    // Not an image at all (stored under its hash by hand).
    let junk = b"not an image at all, only text".to_vec();
    let hash = superfluid::media::hash_hex(&junk);
    std::fs::write(d.sessions.join("media").join(&hash), &junk).unwrap();
    let e = expect_err(&mut c, &append_image_req(s, &hash));
    assert!(e.contains("not a PNG, JPEG or GIF"), "{e}");
    // A small file declaring a huge canvas is refused before any decoder
    // allocates for it.
    let mut huge = png(8, 8, 1);
    huge[16..24].copy_from_slice(&[0, 0, 0x4E, 0x20, 0, 0, 0x4E, 0x20]);
    let huge = put(&mut c, &huge);
    let e = expect_err(&mut c, &append_image_req(s, &huge));
    assert!(e.contains("20000x20000"), "{e}");
}

/// With `--batch 16` an image's positions are prefilled in a chunk before
/// the one that draws: a flipped blob refuses that chunk's item, which the
/// lane must take as the item's own failure, not as a bad reply that kills
/// the worker (and every generation beside it).
#[test]
fn a_flipped_blob_in_a_prefill_chunk_fails_only_its_own_generation() {
    let d = vision_daemon_with(&["--batch", "16"]);
    let mut c = d.client();
    let s = d.create(&mut c);
    let blob = put(&mut c, &png(20, 20, 9));
    let long_question = "Describe the colours, the shapes and the light of the picture \
                         above in three short sentences, one for each of them, please.";
    match c
        .call(&Request::AppendImage {
            session: s,
            role: 1,
            blob: blob.clone(),
            pre_text: String::new(),
            post_text: long_question.into(),
        })
        .unwrap()
    {
        Response::Committed { .. } => {}
        other => panic!("AppendImage: {other:?}"),
    }
    flip_a_bit(&d, &blob);
    let worker = crate::generate::worker_pid(d.pid());
    let (_, err) = generate(&mut c, s, 4);
    let err = err.expect("the generation on a flipped blob fails");
    assert!(err.contains("no longer matches its hash"), "{err}");
    assert_eq!(
        crate::generate::worker_pid(d.pid()),
        worker,
        "the worker was replaced"
    );
    another_session_generates(&d, &mut c);
}

/// A new session on `d` says hello and generates without an error.
fn another_session_generates(d: &TestDaemon, c: &mut Client) {
    let other = d.create(c);
    let _ = c.call(&Request::AppendMessage {
        session: other,
        role: 1,
        text: "Hello".into(),
    });
    assert_eq!(generate(c, other, 4).1, None);
}

/// Flips a bit near the end of a stored blob (after it was appended).
fn flip_a_bit(d: &TestDaemon, blob: &str) {
    let path = d.sessions.join("media").join(blob);
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 20;
    bytes[last] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
}

fn append_image_req(s: SessionId, blob: &str) -> Request {
    Request::AppendImage {
        session: s,
        role: 1,
        blob: blob.into(),
        pre_text: String::new(),
        post_text: "What is it?".into(),
    }
}

#[test]
fn gc_media_keeps_the_blobs_live_sessions_reference_until_they_are_purged() {
    let d = vision_daemon();
    let mut c = d.client();
    let used = put(&mut c, &png(16, 16, 5));
    let unused = put(&mut c, &png(16, 16, 6));
    let s = d.create(&mut c);
    assert!(matches!(
        append_image(&mut c, s, &used),
        Response::Committed { .. }
    ));
    // A fork reads its parent's image by reference.
    let fork = match c
        .call(&Request::Fork {
            session: s,
            at_event: 2,
            params: None,
        })
        .unwrap()
    {
        Response::Created { session } => session,
        other => panic!("Fork: {other:?}"),
    };
    let media = d.sessions.join("media");
    for h in [&used, &unused] {
        std::fs::File::options()
            .write(true)
            .open(media.join(h))
            .unwrap()
            .set_modified(SystemTime::now() - Duration::from_secs(7200))
            .unwrap();
    }
    let gc = |c: &mut Client| match c.call(&Request::GcMedia).unwrap() {
        Response::Gc { kept, removed } => (kept, removed),
        other => panic!("GcMedia: {other:?}"),
    };
    assert_eq!(gc(&mut c), (1, 1), "the referenced blob stays");
    assert!(media.join(&used).exists() && !media.join(&unused).exists());
    let generation = match c.call(&Request::Inspect { session: s }).unwrap() {
        Response::Inspection { inspection } => inspection.generation,
        other => panic!("Inspect: {other:?}"),
    };
    match c
        .call(&Request::Purge {
            session: s,
            expected_generation: generation,
            mode: PurgeMode::Cascade,
        })
        .unwrap()
    {
        Response::Purged { sessions } => assert!(sessions.contains(&fork), "{sessions:?}"),
        other => panic!("Purge: {other:?}"),
    }
    assert_eq!(gc(&mut c), (0, 1), "purged sessions do not count");
    assert!(!media.join(&used).exists());
}

#[test]
fn an_image_session_is_never_parked_and_its_fork_encodes_the_image_again() {
    let d = vision_daemon_with(&["--park"]);
    let mut c = d.client();
    let blob = put(&mut c, &png(24, 24, 7));
    let s = d.create(&mut c);
    assert!(matches!(
        append_image(&mut c, s, &blob),
        Response::Committed { .. }
    ));
    assert_eq!(generate(&mut c, s, 6), (0, None));
    // A text session is parked at the end of its generation; the image one
    // never is.
    let t = d.create(&mut c);
    let _ = c.call(&Request::AppendMessage {
        session: t,
        role: 1,
        text: "Hello there".into(),
    });
    assert_eq!(generate(&mut c, t, 6).1, None);
    let park = d.sessions.join("park");
    let parked = |id: SessionId| park.join(format!("{id}.park")).exists();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !parked(t) {
        assert!(
            std::time::Instant::now() < deadline,
            "the text session was never parked"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!parked(s), "a session with an image was parked");
    // A fork shares the image event by reference and encodes it again.
    let events = read_events(&mut c, s).len() as u64;
    let fork = match c
        .call(&Request::Fork {
            session: s,
            at_event: events,
            params: None,
        })
        .unwrap()
    {
        Response::Created { session } => session,
        other => panic!("Fork: {other:?}"),
    };
    let _ = c.call(&Request::AppendMessage {
        session: fork,
        role: 1,
        text: "Tell me more.".into(),
    });
    assert_eq!(generate(&mut c, fork, 6), (0, None));
    assert!(!parked(fork), "a fork with an image was parked");
    assert!(matches!(image_record(&mut c, fork), Record::Image { .. }));
}
