//! Anthropic's routes: `POST /v1/messages` (streamed and not) and
//! `POST /v1/messages/count_tokens`.

use actix_web::web;
use actix_web::{HttpRequest, HttpResponse};

use super::error::{ApiError, Family};
use super::authorize;
use crate::http::routes::WebState;

const F: Family = Family::Anthropic;

/// `POST /v1/messages`.
pub async fn messages(req: HttpRequest, state: web::Data<WebState>) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    Err(ApiError::invalid(F, "not yet"))
}

/// `POST /v1/messages/count_tokens`.
pub async fn count_tokens(req: HttpRequest, state: web::Data<WebState>) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    Err(ApiError::invalid(F, "not yet"))
}
