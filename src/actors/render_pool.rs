//! The threads that render and tokenize clients' text off the actor thread
//! (`session::prepared`, `complete`): a fixed few, started once, rather than
//! the runtime's blocking pool, whose threads come and go with the load (and
//! each brings its own allocator arena: the soak saw the daemon's memory
//! grow with them).

use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};

type Job = Box<dyn FnOnce() + Send>;

/// Render threads: two, so one huge text does not hold every other
/// session's renders.
const THREADS: usize = 2;

fn queue() -> &'static Mutex<mpsc::Sender<Job>> {
    static QUEUE: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
    QUEUE.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = std::sync::Arc::new(Mutex::new(rx));
        for i in 0..THREADS {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("render-{i}"))
                .spawn(move || loop {
                    let job = match rx.lock() {
                        Ok(r) => r.recv(),
                        Err(e) => e.into_inner().recv(),
                    };
                    match job {
                        // A job that panics fails its own request (its
                        // answer is dropped), never the thread.
                        Ok(job) => {
                            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                        }
                        Err(_) => return,
                    }
                });
            if let Err(e) = spawned {
                log::error!("cannot start a render thread: {e}");
            }
        }
        Mutex::new(tx)
    })
}

/// Work on inputs smaller than this runs inline: a few milliseconds at
/// most, cheaper than a trip to a render thread, and allocation stays on
/// the caller's thread (the 10-minute soak's memory grew twice as fast when
/// every call went to the render threads).
pub const INLINE_BYTES: usize = 64 << 10;

/// Runs `f`, whose inputs are `bytes` long, inline under [`INLINE_BYTES`],
/// else on a render thread ([`run`]); `None` if it could not run there.
pub async fn run_sized<T: Send + 'static>(
    bytes: usize,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    if bytes < INLINE_BYTES {
        return Some(f());
    }
    run(f).await
}

/// Runs `f` on a render thread; `None` if it could not run (no thread, or
/// it panicked).
pub async fn run<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job: Job = Box::new(move || {
        let _ = tx.send(f());
    });
    queue()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send(job)
        .ok()?;
    rx.await.ok()
}
