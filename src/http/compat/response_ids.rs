//! Response ids the daemon issued, and only those.
//!
//! A stored response is a committed point of a session, named
//! `resp_<session>_<event>_<tag>`: the session, the first event of the
//! response's input, and a tag, the first 128 bits of HMAC-SHA256 over the
//! log that holds the session (`""` for the default model's
//! `<sessions>/wal.log`, the model's id for a `--model`'s own log) and the
//! two numbers, keyed by `<sessions>/response-key` (32 random bytes in hex,
//! mode 0600, made on the first start and kept). So a caller of the
//! compatible routes can name the responses it was given and nothing else:
//! not a point of a session a socket or web client made, nor another
//! model's session under the same number. `--api-key` is the credential a
//! tool holds; without the tag, a holder could count through
//! `resp_<n>_<m>` and read, continue or purge any session.
//!
//! The tag also says which model's log the id names, so a route that gets
//! only an id (retrieve, cancel, delete, input items) finds the model that
//! made it ([`owner`]).
//!
//! Ids issued before 2026-12-04 had no tag (`resp_<session>_<event>`, the
//! default model's). They are accepted while the daemon runs without
//! `--api-key` (every caller then holds the web token, which opens every
//! session through `/web/*` anyway), and are a 404 with one.

use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::http::routes::WebState;
use crate::http::token;
use crate::wire::{EventId, SessionId};

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
        let hex = match std::fs::read_to_string(&path) {
            Ok(text) => text.trim().to_owned(),
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

    fn mac(&self, log: &str, s: SessionId, start: EventId) -> Sha256Mac {
        let mut mac = self.mac.clone();
        mac.update(format!("{log}\0{s}\0{start}").as_bytes());
        mac
    }

    /// The id of the response whose input starts at event `start` of
    /// session `s` of the log `log`.
    pub fn name(&self, log: &str, s: SessionId, start: EventId) -> String {
        let tag = self.mac(log, s, start).finalize().into_bytes();
        let hex: String = tag[..TAG_BYTES]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("resp_{s}_{start}_{hex}")
    }

    /// The session and event `id` names, if this daemon issued it for the
    /// log `log` (the tag compared in constant time), or it is an untagged
    /// id and `untagged` allows those.
    pub fn parse(&self, log: &str, id: &str, untagged: bool) -> Option<(SessionId, EventId)> {
        let mut parts = id.strip_prefix("resp_")?.split('_');
        let s = number(parts.next()?)?;
        let start = number(parts.next()?)?;
        match (parts.next(), parts.next()) {
            (None, _) => untagged.then_some((s, start)),
            (Some(hex), None) if hex.len() == 2 * TAG_BYTES => {
                let tag = decode_hex(hex)?;
                self.mac(log, s, start)
                    .verify_truncated_left(&tag)
                    .ok()
                    .map(|()| (s, start))
            }
            _ => None,
        }
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

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
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

/// The id of a response of the model `state` looks at.
pub fn response_id(state: &WebState, s: SessionId, start: EventId) -> String {
    state.ids.name(log_of(state), s, start)
}

/// What `id` names in the log of the model `state` looks at, if it names
/// a response issued there.
pub fn parse_response_id(state: &WebState, id: &str) -> Option<(SessionId, EventId)> {
    state.ids.parse(log_of(state), id, untagged_ok(state))
}

/// The state looking at the model whose log `id` names: the one whose tag
/// it carries (an untagged id names the default model's, where allowed).
pub fn owner(state: &WebState, id: &str) -> Option<WebState> {
    (0..state.models.len())
        .map(|i| state.at(i))
        .find(|m| parse_response_id(m, id).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> ResponseIds {
        ResponseIds::from_key(&[7u8; 32]).unwrap()
    }

    #[test]
    fn an_issued_id_parses_back_in_its_own_log_only() {
        let ids = ids();
        let id = ids.name("", 12, 345);
        assert!(id.starts_with("resp_12_345_"), "{id}");
        assert_eq!(id.len(), "resp_12_345_".len() + 2 * TAG_BYTES);
        assert_eq!(ids.parse("", &id, false), Some((12, 345)));
        // Another model's log, or another key: not issued there.
        assert_eq!(ids.parse("other-model", &id, false), None);
        let other = ResponseIds::from_key(&[8u8; 32]).unwrap();
        assert_eq!(other.parse("", &id, false), None);
        assert_eq!(
            ids.parse("m", &ids.name("m", 1, 2), false),
            Some((1, 2)),
            "a --model's log"
        );
    }

    #[test]
    fn a_changed_number_or_tag_is_refused() {
        let ids = ids();
        let id = ids.name("", 12, 345);
        let tag = id.rsplit('_').next().unwrap().to_owned();
        for forged in [
            format!("resp_13_345_{tag}"),
            format!("resp_12_344_{tag}"),
            format!("resp_012_345_{tag}"),
            format!("resp_+12_345_{tag}"),
            format!("resp_12_345_{}", &tag[..tag.len() - 2]),
            format!("resp_12_345_{tag}00"),
            format!("resp_12_345_+{}", &tag[1..]),
            format!("resp_12_345_{tag}_1"),
            format!("msg_12_345_{tag}"),
        ] {
            assert_eq!(ids.parse("", &forged, true), None, "{forged}");
        }
        // One flipped hex digit anywhere in the tag.
        for i in 0..tag.len() {
            let mut t = tag.clone().into_bytes();
            t[i] = if t[i] == b'0' { b'1' } else { b'0' };
            let forged = format!("resp_12_345_{}", String::from_utf8(t).unwrap());
            assert_eq!(ids.parse("", &forged, true), None, "{forged}");
        }
    }

    #[test]
    fn untagged_ids_only_where_allowed() {
        let ids = ids();
        assert_eq!(ids.parse("", "resp_5_9", true), Some((5, 9)));
        assert_eq!(ids.parse("", "resp_5_9", false), None);
        for bad in ["resp_5", "resp_x_1", "resp__1", "resp_5_", "resp_1_2_"] {
            assert_eq!(ids.parse("", bad, true), None, "{bad}");
        }
    }

    #[test]
    fn the_key_is_made_once_0600_and_kept() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let first = ResponseIds::open(dir.path()).unwrap();
        let path = dir.path().join(KEY_FILE);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let id = first.name("", 1, 2);
        let again = ResponseIds::open(dir.path()).unwrap();
        assert_eq!(
            again.parse("", &id, false),
            Some((1, 2)),
            "a restart keeps ids"
        );
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
