//! The actix actors. Each receives a message, calls the plain typed cores
//! (`session`, `scheduler`, `store`), commits what they planned, and replies;
//! the logic lives in the cores, where it is unit-tested.
//!
//! - [`wal::WalActor`]: hands encoded records to the WAL writer thread and
//!   resolves once the fsync covering them returned.
//! - [`registry::Registry`]: the entry point of every request; answers the
//!   ones about no session, starts session actors on demand and stops idle ones.
//! - [`session::SessionActor`]: one per session; runs that session's requests
//!   one at a time, in order, one request family a file under `session/`.
//! - [`subscription::SubscriptionActor`]: one per `Subscribe`; sends the
//!   backlog, then what [`bus::Bus`] publishes after each commit.
//! - [`scheduler::SchedulerActor`]: one per model lane; runs its decode loop
//!   (`SchedulerState` and `Pipeline`, src/scheduler) and hands each drawn
//!   token to its generation's owner.
//! - [`lane::LaneActor`]: one per model lane; spawns, feeds and respawns the
//!   `superfluid worker` process, and publishes its state (`LaneHealth`).
//!   It and its scheduler are built together (`daemon::start_lane`).
//! - [`stateless`]: generation without a session (`StatelessGen`), what
//!   [`complete`] (fill-in-the-middle `Complete`) runs on.
//!
//! **No actor blocks its arbiter while serving**: fsync runs on the WAL
//! writer's thread, the worker's pipes are non-blocking, and no lock is held
//! across an await. What does block, on purpose: `WalActor`'s `Shutdown`
//! joins the writer thread (its last fsync) when the daemon stops; a stopping
//! `LaneActor` waits up to 200 ms for its worker to exit; and the lane reaps a
//! worker it killed (`wait` on a SIGKILLed child returns at once).

pub mod bus;
pub mod complete;
pub mod lane;
pub mod load_gate;
pub mod registry;
pub mod render_pool;
pub mod scheduler;
pub mod served;
pub mod session;
pub mod stateless;
pub mod subscription;
pub mod wal;

use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use actix::Addr;

use crate::session::{ApplyError, Render, SessionBook, SessionError};
use crate::store::StoreError;
use crate::wire::{to_postcard, LogRecord, WireError};

/// What every actor shares.
#[derive(Clone)]
pub struct Shared {
    /// Every session as the log says; changed only after a commit.
    pub book: Arc<RwLock<SessionBook>>,
    /// The model's vocabulary and chat template.
    pub render: Arc<dyn Render>,
    pub wal: Addr<wal::WalActor>,
    /// The model lane's scheduler.
    pub scheduler: Addr<scheduler::SchedulerActor>,
    /// The model lane's state (loading, ready, respawning).
    pub lane: lane::LaneHealth,
    /// The lane's `--rpc` servers, as its last probe found them (empty
    /// without `--rpc`).
    pub rpc: lane::RpcStatus,
    /// The lane's context size: the most a generation may ask for.
    pub n_ctx: u32,
    /// Committed events, published to live subscriptions.
    pub bus: bus::Bus,
    /// Generations ended, by finish (the `superfluid_generations_total`
    /// metric).
    pub generations: Arc<registry::Generations>,
    /// The image blobs under `<sessions>/media/` (`PutMedia`, `GcMedia`).
    pub media: crate::media::MediaStore,
    /// With a vision projector (`--mmproj`): the lane, whose worker lays
    /// images out (`MediaLayout`). None: the model takes no images.
    pub vision: Option<Addr<lane::LaneActor>>,
    /// `--park`'s directory: a purged session's artifact is deleted there.
    pub park_dir: Option<std::path::PathBuf>,
    /// The daemon's load gate and this model's line in it (`serve
    /// --model`); None in a daemon built without one (in-process tests).
    pub load: Option<(load_gate::LoadGate, usize)>,
}

/// Why a record was not committed.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error(transparent)]
    Encode(#[from] WireError),
    #[error("the log writer is gone: {0}")]
    WriterGone(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The book refused a record the log already holds: a bug.
    #[error("internal error applying a committed record: {0}")]
    Apply(#[from] ApplyError),
}

impl From<CommitError> for SessionError {
    fn from(e: CommitError) -> SessionError {
        SessionError::Commit(e.to_string())
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Shared {
    /// Reads the book. A poisoned lock means a panic elsewhere already
    /// happened; the book itself is only changed by `apply`, which does not
    /// leave it half-done, so reading on is safe.
    pub fn read(&self) -> std::sync::RwLockReadGuard<'_, SessionBook> {
        self.book.read().unwrap_or_else(|e| e.into_inner())
    }

    pub fn write(&self) -> std::sync::RwLockWriteGuard<'_, SessionBook> {
        self.book.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes a record durable, then applies it to the book. Only after this
    /// returns may anyone see what the record holds.
    /// A record registered with `SessionBook::begin` is settled either way.
    pub async fn commit(&self, record: LogRecord) -> Result<(), CommitError> {
        let written = match to_postcard(&record) {
            Ok(bytes) => self
                .wal
                .send(wal::Commit(bytes))
                .await
                .map_err(|e| CommitError::WriterGone(e.to_string()))
                .and_then(|r| r.map_err(CommitError::from)),
            Err(e) => Err(e.into()),
        };
        if let Err(e) = written {
            self.write().settle(&record);
            return Err(e);
        }
        let mut book = self.write();
        book.apply(&record)?;
        // Published with the book still locked: a subscriber registers under
        // the read lock, then reads its backlog, so it sees every event.
        match &record {
            LogRecord::Events { session, events } => self.bus.publish_events(*session, events),
            LogRecord::Purge { sessions, .. } => self.bus.publish_purge(sessions),
            _ => {}
        }
        Ok(())
    }
}
