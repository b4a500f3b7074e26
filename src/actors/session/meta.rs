//! The session's settings and life: title and archive (SetMeta), Purge,
//! QoS, and pinning its KV on the lane.

use super::commit;
use crate::actors::scheduler::PinSession;
use crate::actors::{now_ms, Shared};
use crate::session::{Planned, SessionError};
use crate::wire::{PurgeMode, Response, SessionId};

/// `SetMeta`.
pub(super) async fn set(
    shared: &Shared,
    session: SessionId,
    expected_version: u64,
    title: Option<String>,
    archived: Option<bool>,
) -> Result<Response, SessionError> {
    let planned = shared
        .read()
        .plan_meta(session, expected_version, title, archived, now_ms())?;
    commit(shared, planned).await
}

/// The longest a Purge waits for new sessions being filed under the
/// sessions it takes (each is one fsync away from applied).
const PURGE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Sessions held for a waiting purge ([`SessionBook::hold`]), released when
/// dropped (also if the request is dropped while it waits).
struct Hold<'a> {
    shared: &'a Shared,
    sessions: Vec<SessionId>,
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        if !self.sessions.is_empty() {
            self.shared.write().release(&self.sessions);
        }
    }
}

/// `Purge`.
pub(super) async fn purge(
    shared: &Shared,
    session: SessionId,
    expected_generation: u64,
    mode: PurgeMode,
) -> Result<Response, SessionError> {
    // Planned and begun under one write lock: a new session filed under
    // one of the purged sessions meanwhile would be missed
    // (`SessionBook::begin`). While one is being filed, the sessions are
    // held (nothing new starts under them) and the purge waits for it, for
    // up to PURGE_WAIT, then plans again.
    let deadline = std::time::Instant::now() + PURGE_WAIT;
    let mut hold = Hold {
        shared,
        sessions: Vec::new(),
    };
    let planned = loop {
        let waiting = {
            let mut book = shared.write();
            book.release(&std::mem::take(&mut hold.sessions));
            let planned = book.plan_purge(session, expected_generation, mode, now_ms())?;
            match book.begin(&planned) {
                Ok(()) => break planned,
                Err(SessionError::Branching(_)) if std::time::Instant::now() < deadline => {
                    if let Planned::Purge { sessions, .. } = &planned {
                        book.hold(sessions);
                        hold.sessions = sessions.clone();
                    }
                    true
                }
                Err(e) => return Err(e),
            }
        };
        if waiting {
            actix_rt::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    };
    drop(hold);
    let reply = commit(shared, planned).await?;
    if let (Response::Purged { sessions }, Some(dir)) = (&reply, &shared.park_dir) {
        // The purge is durable: the sessions' park artifacts go (on a
        // blocking thread; awaited, so the reply comes after). One still in
        // the park writer's queue is deleted at the next start
        // (daemon::scan_parked).
        shared
            .scheduler
            .do_send(crate::actors::scheduler::ForgetParked(sessions.clone()));
        let (dir, sessions) = (dir.clone(), sessions.clone());
        let deleted = actix_rt::task::spawn_blocking(move || {
            for s in sessions {
                for p in crate::engine::park::remove_all(&dir, s) {
                    log::debug!("purge: deleted {}", p.display());
                }
            }
        });
        let _ = deleted.await;
    }
    Ok(reply)
}

/// `SetQos`.
pub(super) async fn qos(
    shared: &Shared,
    session: SessionId,
    class: u8,
    batch_invariant: bool,
) -> Result<Response, SessionError> {
    let planned = shared
        .read()
        .plan_qos(session, class, batch_invariant, now_ms())?;
    commit(shared, planned).await
}

/// `Pin`: keeps the session's cached tokens from eviction until `ttl_ms`
/// from now (0 clears).
pub(super) async fn pin(
    shared: &Shared,
    session: SessionId,
    ttl_ms: u64,
) -> Result<Response, SessionError> {
    shared.read().inspect(session)?;
    let deadline_ms = match ttl_ms {
        0 => 0,
        ttl => now_ms().saturating_add(ttl),
    };
    let deadline_unix_ms = shared
        .scheduler
        .send(PinSession {
            session,
            deadline_ms,
        })
        .await
        .map_err(|e| SessionError::SchedulerGone(e.to_string()))?;
    Ok(Response::Pinned { deadline_unix_ms })
}
