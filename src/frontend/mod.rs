//! Frontends: they turn bytes into `Request`s, forward each to the registry
//! actor, and turn `Response`s back into bytes. No session logic lives here.

pub mod socket;
