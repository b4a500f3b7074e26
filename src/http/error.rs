//! `WebError`: every way an HTTP request of the browser transport fails
//! without a reply of the session API, and **the one place that maps errors
//! to HTTP statuses**. A request the daemon refuses is not one of them: it
//! is a `200` carrying `Err`.

use actix_web::http::{header, StatusCode};
use actix_web::{HttpResponse, ResponseError};

use super::auth::Denied;
use crate::wire::Response;

#[derive(Debug, thiserror::Error)]
pub enum WebError {
    #[error("{0}")]
    Denied(#[from] Denied),
    #[error("the request body exceeds the {max}-byte cap")]
    TooLarge { max: usize },
    #[error("cannot read the request body: {0}")]
    Body(String),
    /// The body did not arrive whole within the deadline.
    #[error("the request body did not arrive within {secs} s")]
    BodyTimeout { secs: u64 },
    /// As many WebSockets are open as the listener keeps for them.
    #[error("{max} WebSocket connections are open, the most this listener keeps for them (half of --max-connections); close one")]
    TooManySockets { max: usize },
    #[error("not a WebSocket handshake: {0}")]
    Handshake(String),
    /// `?model=` names no served model.
    #[error("{0}")]
    NoModel(String),
    /// A `Complete` past its bucket.
    #[error("throttled: retry after {retry_after_ms} ms")]
    Throttled { retry_after_ms: u64 },
}

impl ResponseError for WebError {
    fn status_code(&self) -> StatusCode {
        match self {
            WebError::Denied(Denied::Token) => StatusCode::UNAUTHORIZED,
            WebError::Denied(_) => StatusCode::FORBIDDEN,
            WebError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            WebError::Body(_) | WebError::Handshake(_) => StatusCode::BAD_REQUEST,
            WebError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            WebError::TooManySockets { .. } => StatusCode::SERVICE_UNAVAILABLE,
            WebError::NoModel(_) => StatusCode::NOT_FOUND,
            WebError::Throttled { .. } => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    fn error_response(&self) -> HttpResponse {
        let mut r = HttpResponse::build(self.status_code());
        match self {
            WebError::Throttled { retry_after_ms } => {
                r.insert_header((header::RETRY_AFTER, retry_after_ms.div_ceil(1000).max(1)));
                r.json(Response::Throttled {
                    retry_after_ms: *retry_after_ms,
                })
            }
            other => r.json(Response::err(other.to_string())),
        }
    }
}
