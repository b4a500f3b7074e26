//! Frontends: they turn bytes into `Request`s, forward each to the registry
//! actor, and turn `Response`s back into bytes. No session logic lives here.
//! The browser transport (HTTP and WebSocket) is `crate::http`; it shares
//! [`conn::Connection`] with the socket.

pub mod bucket;
pub mod conn;
pub mod socket;
