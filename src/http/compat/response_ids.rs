//! Response ids the daemon issued, and only those.
//!
//! A stored response is a committed point of a session, named
//! `resp_<session>_<event>_<tag>`: the session, the first event of the
//! response's input, and a tag, the first 128 bits of HMAC-SHA256 keyed by
//! `<sessions>/response-key` (32 random bytes in hex, mode 0600, made on the
//! first start and kept) over the log that holds the session (`""` for the
//! default model's `<sessions>/wal.log`, the model's id for a `--model`'s
//! own log), the session, when the session was made (its header record's
//! `ts_unix_ms`) and the event. So a caller of the compatible routes can
//! name the responses it was given and nothing else: not a point of a
//! session a socket or web client made, nor another model's session under
//! the same number, nor a session that took the number of one the id named
//! after the log started over (`--sessions-cache`, a log moved aside,
//! `superfluid salvage` dropping sessions). `--api-key` is the credential a
//! tool holds; without the tag, a holder could count through
//! `resp_<n>_<m>` and read, continue or purge any session.
//!
//! The tag also says which model's log the id names, so a route that gets
//! only an id (retrieve, cancel, delete, input items) finds the model that
//! made it ([`owner`]).
//!
//! Ids issued before 2026-12-04 had no tag (`resp_<session>_<event>`). They
//! are accepted while the daemon runs without `--api-key` (every caller then
//! holds the web token, which opens every session through `/web/*` anyway),
//! as the default model's, and are a 404 with one.

use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::http::routes::WebState;
use crate::http::token;
use crate::wire::{EventId, Inspection, SessionId};

/// The key's file name in the sessions directory.
pub const KEY_FILE: &str = "response-key";

/// Bytes of the MAC kept in an id (written as twice as many hex digits).
const TAG_BYTES: usize = 16;

type Sha256Mac = Hmac<Sha256>;

/// The keyed MAC that tags response ids.
#[derive(Clone)]
pub struct ResponseIds {
    mac: Sha256Mac,
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read or write {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("cannot mint the response key: {0}")]
    Random(getrandom::Error),
    #[error(
        "{0} does not hold 64 hex digits; remove it to make a new key (the response ids \
         issued so far then stop resolving)"
    )]
    Malformed(std::path::PathBuf),
}

impl ResponseIds {
    /// The key in `<sessions>/response-key`, made (mode 0600) when there
    /// is none. A file that is not 64 hex digits refuses the start: a new
    /// key would silently orphan every id issued.
    pub fn open(sessions: &Path) -> Result<ResponseIds, KeyError> {
        let path = sessions.join(KEY_FILE);
        let io = |source| KeyError::Io {
            path: path.clone(),
            source,
        };
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path);
        let hex = match opened {
            Ok(mut file) => {
                crate::store::dirs::tighten(
                    &file,
                    &path,
                    "Anyone who read it can forge response ids: remove it to make a new key \
                     (the ids issued so far then stop resolving)",
                )
                .map_err(io)?;
                let mut text = String::new();
                std::io::Read::read_to_string(&mut file, &mut text).map_err(io)?;
                text.trim().to_owned()
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key = token::mint().map_err(KeyError::Random)?;
                token::write_secret(sessions, KEY_FILE, &key).map_err(io)?;
                key
            }
            Err(e) => return Err(io(e)),
        };
        let key = decode_hex(&hex)
            .filter(|k| k.len() == token::TOKEN_BYTES)
            .ok_or_else(|| KeyError::Malformed(path.clone()))?;
        ResponseIds::from_key(&key).ok_or(KeyError::Malformed(path))
    }

    /// Ids keyed by `key` (tests; [`open`](Self::open) reads the file).
    pub fn from_key(key: &[u8]) -> Option<ResponseIds> {
        Some(ResponseIds {
            mac: <Sha256Mac as Mac>::new_from_slice(key).ok()?,
        })
    }

    fn mac(&self, log: &str, s: SessionId, made_ms: u64, start: EventId) -> Sha256Mac {
        let mut mac = self.mac.clone();
        mac.update(format!("{log}\0{s}\0{made_ms}\0{start}").as_bytes());
        mac
    }

    /// The id of the response whose input starts at event `start` of
    /// session `s` of the log `log`, made at `made_ms`.
    pub fn name(&self, log: &str, s: SessionId, made_ms: u64, start: EventId) -> String {
        let tag = self.mac(log, s, made_ms, start).finalize().into_bytes();
        let hex: String = tag[..TAG_BYTES]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("resp_{s}_{start}_{hex}")
    }

    /// Whether `tag` (None: untagged) is the one [`name`](Self::name) gives
    /// these numbers (compared in constant time), or the id is untagged and
    /// `untagged` allows those.
    pub fn verify(
        &self,
        log: &str,
        (s, start, tag): &Parsed,
        made_ms: u64,
        untagged: bool,
    ) -> bool {
        match tag {
            None => untagged,
            Some(tag) => self
                .mac(log, *s, made_ms, *start)
                .verify_truncated_left(tag)
                .is_ok(),
        }
    }
}

/// An id's parts: the session, the event, and the tag (None for an
/// untagged id), not yet checked.
pub type Parsed = (SessionId, EventId, Option<Vec<u8>>);

/// The parts of a well-formed response id: digits as the daemon writes
/// them, and a tag of 32 lower-case hex digits or none.
pub fn split(id: &str) -> Option<Parsed> {
    let mut parts = id.strip_prefix("resp_")?.split('_');
    let s = number(parts.next()?)?;
    let start = number(parts.next()?)?;
    match (parts.next(), parts.next()) {
        (None, _) => Some((s, start, None)),
        (Some(hex), None) if hex.len() == 2 * TAG_BYTES => Some((s, start, Some(decode_hex(hex)?))),
        _ => None,
    }
}

/// Decimal digits as the daemon writes them: no sign, no leading zero, so
/// one response has one id.
fn number(text: &str) -> Option<u64> {
    if text.is_empty()
        || !text.bytes().all(|b| b.is_ascii_digit())
        || (text.len() > 1 && text.starts_with('0'))
    {
        return None;
    }
    text.parse().ok()
}

/// Lower-case hex only, as the daemon writes it: one response, one id.
fn decode_hex(text: &str) -> Option<Vec<u8>> {
    let digit = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
    if text.len() % 2 != 0 || !text.bytes().all(digit) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The name the tag gives the log of the model `state` looks at: `""` for
/// the default model (`<sessions>/wal.log`), the model's id for the others
/// (`<sessions>/models/<id>/`).
fn log_of(state: &WebState) -> &str {
    if state.current == 0 {
        ""
    } else {
        &state.m().model.id
    }
}

/// Untagged ids are taken only from a daemon without `--api-key`.
fn untagged_ok(state: &WebState) -> bool {
    state.policy.api_key.is_none()
}

/// The id of a response of the model `state` looks at: its input starts at
/// event `start` of session `s`, made at `made_ms` (its `Inspection`'s
/// `created_unix_ms`).
pub fn response_id(state: &WebState, s: SessionId, made_ms: u64, start: EventId) -> String {
    state.ids.name(log_of(state), s, made_ms, start)
}

/// A response id resolved: the state looking at the model whose log holds
/// it, the session, the response's first event, and the session as its
/// tag was checked against.
pub struct Resolved {
    pub state: WebState,
    pub session: SessionId,
    pub start: EventId,
    pub info: Inspection,
}

/// What `id` names in the log of the model `state` looks at, if it names
/// a response issued there: a session of that log whose tag matches (an
/// untagged id where allowed, on the default model only).
pub async fn resolve(state: &WebState, id: &str) -> Option<Resolved> {
    let parsed = split(id)?;
    if parsed.2.is_none() && state.current != 0 {
        return None;
    }
    let info = super::responses::inspect(state, parsed.0).await.ok()??;
    state
        .ids
        .verify(
            log_of(state),
            &parsed,
            info.created_unix_ms,
            untagged_ok(state),
        )
        .then(|| Resolved {
            state: state.clone(),
            session: parsed.0,
            start: parsed.1,
            info,
        })
}

/// [`resolve`]'s session and event.
pub async fn parse_response_id(state: &WebState, id: &str) -> Option<(SessionId, EventId)> {
    resolve(state, id).await.map(|r| (r.session, r.start))
}

/// `id` resolved in the log of the model whose tag it carries (an untagged
/// id names the default model's, where allowed).
pub async fn owner(state: &WebState, id: &str) -> Option<Resolved> {
    for i in 0..state.models.len() {
        if let Some(r) = resolve(&state.at(i), id).await {
            return Some(r);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> ResponseIds {
        ResponseIds::from_key(&[7u8; 32]).unwrap()
    }

    /// What the routes check: the id's parts, then the tag against the
    /// session's log and making time.
    fn check(
        ids: &ResponseIds,
        log: &str,
        id: &str,
        made_ms: u64,
        untagged: bool,
    ) -> Option<(u64, u64)> {
        let parsed = split(id)?;
        ids.verify(log, &parsed, made_ms, untagged)
            .then_some((parsed.0, parsed.1))
    }

    #[test]
    fn an_issued_id_resolves_for_its_own_log_and_session_only() {
        let ids = ids();
        let id = ids.name("", 12, 1_000, 345);
        assert!(id.starts_with("resp_12_345_"), "{id}");
        assert_eq!(id.len(), "resp_12_345_".len() + 2 * TAG_BYTES);
        assert_eq!(check(&ids, "", &id, 1_000, false), Some((12, 345)));
        // Another model's log, another session under the same number (made
        // at another time: the log started over), another key.
        assert_eq!(check(&ids, "other-model", &id, 1_000, false), None);
        assert_eq!(check(&ids, "", &id, 1_001, false), None);
        let other = ResponseIds::from_key(&[8u8; 32]).unwrap();
        assert_eq!(check(&other, "", &id, 1_000, false), None);
        let m = ids.name("m", 1, 5, 2);
        assert_eq!(
            check(&ids, "m", &m, 5, false),
            Some((1, 2)),
            "a --model's log"
        );
    }

    #[test]
    fn a_changed_number_or_tag_is_refused() {
        let ids = ids();
        let id = ids.name("", 12, 9, 345);
        let tag = id.rsplit('_').next().unwrap().to_owned();
        for forged in [
            format!("resp_13_345_{tag}"),
            format!("resp_12_344_{tag}"),
            format!("resp_012_345_{tag}"),
            format!("resp_+12_345_{tag}"),
            format!("resp_12_345_+{}", &tag[1..]),
            format!("resp_12_345_{}", tag.to_uppercase()),
            format!("resp_12_345_{}", &tag[..tag.len() - 2]),
            format!("resp_12_345_{tag}00"),
            format!("resp_12_345_{tag}_1"),
            format!("msg_12_345_{tag}"),
        ] {
            assert_eq!(check(&ids, "", &forged, 9, true), None, "{forged}");
        }
        // One changed hex digit anywhere in the tag.
        for i in 0..tag.len() {
            let mut t = tag.clone().into_bytes();
            t[i] = if t[i] == b'0' { b'1' } else { b'0' };
            let forged = format!("resp_12_345_{}", String::from_utf8(t).unwrap());
            assert_eq!(check(&ids, "", &forged, 9, true), None, "{forged}");
        }
    }

    #[test]
    fn untagged_ids_only_where_allowed() {
        let ids = ids();
        assert_eq!(check(&ids, "", "resp_5_9", 1, true), Some((5, 9)));
        assert_eq!(check(&ids, "", "resp_5_9", 1, false), None);
        for bad in ["resp_5", "resp_x_1", "resp__1", "resp_5_", "resp_1_2_"] {
            assert_eq!(split(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_key_is_made_once_0600_and_kept() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let first = ResponseIds::open(dir.path()).unwrap();
        let path = dir.path().join(KEY_FILE);
        let mode = || std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(), 0o600);
        let id = first.name("", 1, 3, 2);
        let again = ResponseIds::open(dir.path()).unwrap();
        assert_eq!(
            check(&again, "", &id, 3, false),
            Some((1, 2)),
            "a restart keeps ids"
        );
        // A copy that lost its mode is set back to 0600, and still the key.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let copied = ResponseIds::open(dir.path()).unwrap();
        assert_eq!(mode(), 0o600);
        assert_eq!(check(&copied, "", &id, 3, false), Some((1, 2)));
        std::fs::write(&path, "not hex").unwrap();
        let err = ResponseIds::open(dir.path()).err().unwrap();
        assert!(matches!(err, KeyError::Malformed(_)), "{err}");
        std::fs::write(&path, "ab".repeat(31)).unwrap();
        assert!(matches!(
            ResponseIds::open(dir.path()),
            Err(KeyError::Malformed(_))
        ));
    }
}
