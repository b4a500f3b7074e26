//! `ApiError`: how the compatible routes fail, each family in its own error
//! shape — OpenAI's `{"error": {"message", "type", "param", "code"}}` and
//! Anthropic's `{"type": "error", "error": {"type", "message"}}`, Ollama's
//! `{"error": "message"}` — and the
//! one place their errors become HTTP statuses.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde_json::json;

use crate::http::auth::Denied;

/// Which API's error shape a route answers in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    OpenAi,
    Anthropic,
    Ollama,
}

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// 400: the request is malformed or asks for what cannot be done.
    Invalid,
    /// 400, OpenAI code `context_length_exceeded`.
    ContextLength,
    /// 401.
    Auth,
    /// 403.
    Forbidden,
    /// 404, OpenAI code `model_not_found`.
    NoModel,
    /// 404: a stored object (a response, a conversation, an item) that does
    /// not exist or was deleted.
    NotFound,
    /// 413.
    TooLarge,
    /// 503: the model's worker is down (or restarting).
    Unavailable,
    /// 500.
    Internal,
    /// 501: a route this daemon answers but does not serve yet.
    NotImplemented,
}

#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub family: Family,
    pub kind: Kind,
    pub message: String,
    /// OpenAI's `param`: the request field at fault.
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn new(family: Family, kind: Kind, message: impl Into<String>) -> ApiError {
        ApiError {
            family,
            kind,
            message: message.into(),
            param: None,
        }
    }

    pub fn invalid(family: Family, message: impl Into<String>) -> ApiError {
        ApiError::new(family, Kind::Invalid, message)
    }

    pub fn with_param(mut self, param: &'static str) -> ApiError {
        self.param = Some(param);
        self
    }

    pub fn denied(family: Family, d: Denied) -> ApiError {
        let kind = match d {
            Denied::Token => Kind::Auth,
            _ => Kind::Forbidden,
        };
        let message = match d {
            Denied::Token => "missing or wrong API key: send the web token or --api-key as \
                              `Authorization: Bearer <key>` or `x-api-key: <key>`"
                .to_string(),
            other => other.to_string(),
        };
        ApiError::new(family, kind, message)
    }

    /// The error's JSON body.
    pub fn body(&self) -> serde_json::Value {
        match self.family {
            Family::OpenAi => {
                let (ty, code) = match self.kind {
                    Kind::Invalid | Kind::TooLarge => ("invalid_request_error", None),
                    Kind::ContextLength => {
                        ("invalid_request_error", Some("context_length_exceeded"))
                    }
                    Kind::Auth => ("authentication_error", Some("invalid_api_key")),
                    Kind::Forbidden => ("permission_error", None),
                    Kind::NoModel => ("invalid_request_error", Some("model_not_found")),
                    Kind::NotFound => ("invalid_request_error", None),
                    Kind::Unavailable | Kind::Internal | Kind::NotImplemented => {
                        ("server_error", None)
                    }
                };
                json!({"error": {
                    "message": self.message,
                    "type": ty,
                    "param": self.param,
                    "code": code,
                }})
            }
            Family::Anthropic => {
                let ty = match self.kind {
                    Kind::Invalid | Kind::ContextLength => "invalid_request_error",
                    Kind::Auth => "authentication_error",
                    Kind::Forbidden => "permission_error",
                    Kind::NoModel | Kind::NotFound => "not_found_error",
                    Kind::TooLarge => "request_too_large",
                    Kind::Unavailable => "overloaded_error",
                    Kind::Internal | Kind::NotImplemented => "api_error",
                };
                json!({"type": "error", "error": {"type": ty, "message": self.message}})
            }
            Family::Ollama => json!({"error": self.message}),
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self.kind {
            Kind::Invalid | Kind::ContextLength => StatusCode::BAD_REQUEST,
            Kind::Auth => StatusCode::UNAUTHORIZED,
            Kind::Forbidden => StatusCode::FORBIDDEN,
            Kind::NoModel | Kind::NotFound => StatusCode::NOT_FOUND,
            Kind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            // Anthropic's overloaded_error is a 529 (its SDK raises
            // OverloadedError for it, and retries it).
            Kind::Unavailable if self.family == Family::Anthropic => {
                StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE)
            }
            Kind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Kind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Kind::NotImplemented => StatusCode::NOT_IMPLEMENTED,
        }
    }

    fn error_response(&self) -> HttpResponse {
        HttpResponse::build(self.status_code()).json(self.body())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_family_has_its_shape() {
        let e =
            ApiError::new(Family::OpenAi, Kind::ContextLength, "too long").with_param("messages");
        assert_eq!(e.status_code(), StatusCode::BAD_REQUEST);
        assert_eq!(
            e.body(),
            json!({"error": {"message": "too long", "type": "invalid_request_error",
                             "param": "messages", "code": "context_length_exceeded"}})
        );
        let e = ApiError::new(Family::Anthropic, Kind::NoModel, "no such model");
        assert_eq!(e.status_code(), StatusCode::NOT_FOUND);
        assert_eq!(
            e.body(),
            json!({"type": "error", "error": {"type": "not_found_error", "message": "no such model"}})
        );
        let e = ApiError::denied(Family::Anthropic, Denied::Token);
        assert_eq!(e.status_code(), StatusCode::UNAUTHORIZED);
        assert_eq!(e.body()["error"]["type"], "authentication_error");
        let e = ApiError::denied(Family::OpenAi, Denied::Origin);
        assert_eq!(e.status_code(), StatusCode::FORBIDDEN);
        let e = ApiError::new(Family::Ollama, Kind::NoModel, "no such model");
        assert_eq!(e.status_code(), StatusCode::NOT_FOUND);
        assert_eq!(e.body(), json!({"error": "no such model"}));
        let e = ApiError::new(Family::Ollama, Kind::NotImplemented, "later");
        assert_eq!(e.status_code(), StatusCode::NOT_IMPLEMENTED);
    }
}
