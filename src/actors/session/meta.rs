//! The session's settings and life: title and archive (SetMeta), Purge,
//! QoS, and pinning its KV on the lane.

use super::commit;
use crate::actors::scheduler::PinSession;
use crate::actors::{now_ms, Shared};
use crate::session::SessionError;
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

/// `Purge`.
pub(super) async fn purge(
    shared: &Shared,
    session: SessionId,
    expected_generation: u64,
    mode: PurgeMode,
) -> Result<Response, SessionError> {
    // Planned and begun under one write lock: a new session filed under
    // one of the purged sessions meanwhile would be missed
    // (`SessionBook::begin`).
    let planned = {
        let mut book = shared.write();
        let planned = book.plan_purge(session, expected_generation, mode, now_ms())?;
        book.begin(&planned)?;
        planned
    };
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
