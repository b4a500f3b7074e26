//! The browser transport's credential: a random token minted at every start
//! and written to `<sessions>/web-token`, readable only by the daemon's user.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use subtle::ConstantTimeEq;

/// The token file's name in the sessions directory.
pub const TOKEN_FILE: &str = "web-token";
/// The listener's address (`ip:port`), written beside the token so that
/// `superfluid open` can print the page's URL. Not a secret.
pub const ADDR_FILE: &str = "web-addr";
/// Random bytes in a token (256 bits), written as hex.
pub const TOKEN_BYTES: usize = 32;

/// A new token from the operating system's generator, in hex.
pub fn mint() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; TOKEN_BYTES];
    getrandom::fill(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes the token to `<dir>/web-token`, mode 0600: a temp file renamed
/// over the old one, so a reader never sees half a token.
pub fn write(dir: &Path, token: &str) -> std::io::Result<PathBuf> {
    write_secret(dir, TOKEN_FILE, token)
}

/// Writes `secret` to `<dir>/<name>` as [`write`] does the token: mode
/// 0600, through a temp file synced and renamed over the old one.
pub fn write_secret(dir: &Path, name: &str, secret: &str) -> std::io::Result<PathBuf> {
    write_new(dir, name, secret, 0o600)
}

/// Writes the listener's address to `<dir>/web-addr` (mode 0644: not a
/// secret) the same way.
pub fn write_addr(dir: &Path, addr: std::net::SocketAddr) -> std::io::Result<PathBuf> {
    write_new(dir, ADDR_FILE, &addr.to_string(), 0o644)
}

/// `text` into a new `<name>.tmp` (created here, never a link followed to
/// another file), synced and renamed over `<dir>/<name>`, the rename made
/// durable: a reader never sees half of it, and a key kept across restarts
/// does not come back as the old file (or none) after a power loss.
fn write_new(dir: &Path, name: &str, text: &str, mode: u32) -> std::io::Result<PathBuf> {
    let path = dir.join(name);
    let tmp = dir.join(format!("{name}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)?;
    file.set_permissions(std::fs::Permissions::from_mode(mode))?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(path)
}

/// Compares a presented token with ours in constant time (for tokens of
/// the right length; the length itself is no secret).
pub fn matches(ours: &str, presented: &str) -> bool {
    ours.as_bytes().ct_eq(presented.as_bytes()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_256_bit_hex_and_differ() {
        let a = mint().unwrap();
        let b = mint().unwrap();
        assert_eq!(a.len(), 2 * TOKEN_BYTES);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
        assert!(matches(&a, &a.clone()));
        assert!(!matches(&a, &b));
        assert!(!matches(&a, &a[1..]));
    }

    #[test]
    fn written_0600_and_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), "one").unwrap();
        write(dir.path(), "two").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "two");
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
}
