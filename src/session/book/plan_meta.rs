//! Plans of a session's settings and life: SetMeta, Purge, SetQos.

use super::{Planned, SessionBook, SessionError};
use crate::wire::{PurgeMode, QosClass, Record, SessionId};

/// The longest title `SetMeta` takes, in bytes. Titles travel in every
/// listing of sessions (`superfluid session ls`, the page's tree), whose
/// reply is one frame: five 15 MiB titles put it past the 64 MiB frame cap
/// for every client.
pub const MAX_TITLE_BYTES: usize = 1024;

impl SessionBook {
    /// `SetMeta`.
    pub fn plan_meta(
        &self,
        s: SessionId,
        expected_version: u64,
        title: Option<String>,
        archived: Option<bool>,
        now: u64,
    ) -> Result<Planned, SessionError> {
        let sess = self.writable(s)?;
        if let Some(t) = title.as_ref().filter(|t| t.len() > MAX_TITLE_BYTES) {
            return Err(SessionError::Invalid(format!(
                "a title of {} bytes, over the limit of {MAX_TITLE_BYTES} bytes",
                t.len()
            )));
        }
        if sess.version != expected_version {
            return Err(SessionError::Version {
                session: s,
                expected: expected_version,
                actual: sess.version,
            });
        }
        Ok(Planned::Meta {
            session: s,
            version: sess.version + 1,
            title: title.or_else(|| sess.title.clone()),
            archived: archived.unwrap_or(sess.archived),
            ts_unix_ms: now,
        })
    }

    /// The live descendants of `s`, depth first, without recursion (a chain
    /// of forks may be very deep).
    pub(super) fn descendants(&self, s: SessionId, out: &mut Vec<SessionId>) {
        let mut stack = vec![s];
        while let Some(id) = stack.pop() {
            if let Some(sess) = self.sessions.get(&id) {
                for &c in sess.children.iter().rev() {
                    if self.sessions.get(&c).is_some_and(|x| !x.purged) {
                        out.push(c);
                        stack.push(c);
                    }
                }
            }
        }
    }

    /// `Purge`.
    pub fn plan_purge(
        &self,
        s: SessionId,
        expected_generation: u64,
        mode: PurgeMode,
        now: u64,
    ) -> Result<Planned, SessionError> {
        let sess = self.writable(s)?;
        if sess.generation != expected_generation {
            return Err(SessionError::Generation {
                session: s,
                expected: expected_generation,
                actual: sess.generation,
            });
        }
        let mut sessions = vec![s];
        if mode == PurgeMode::Cascade {
            self.descendants(s, &mut sessions);
        }
        Ok(Planned::Purge {
            session: s,
            mode,
            sessions,
            ts_unix_ms: now,
        })
    }

    /// `SetQos`.
    pub fn plan_qos(
        &self,
        s: SessionId,
        class: u8,
        batch_invariant: bool,
        now: u64,
    ) -> Result<Planned, SessionError> {
        let class = QosClass::try_from(class).map_err(|_| {
            SessionError::Invalid(format!(
                "QoS class {class} is out of range: classes are 0 to 3"
            ))
        })?;
        self.one_event(
            s,
            now,
            Record::Qos {
                class,
                batch_invariant,
            },
        )
    }
}
