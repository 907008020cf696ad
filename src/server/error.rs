//! The server's HTTP errors: a status and OpenAI's error body.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::protocol::{ErrorBody, ErrorDetail};

/// An error answered to a client: an HTTP status and
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The body.
    pub detail: ErrorDetail,
}

impl ApiError {
    /// An error with `status`; the body's `type` follows the status.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        let kind = match status.as_u16() {
            400 | 405 | 413 | 415 | 422 => "invalid_request_error",
            401 => "authentication_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            503 => "service_unavailable_error",
            _ => "server_error",
        };
        Self {
            status,
            detail: ErrorDetail {
                message: message.into(),
                kind: kind.to_string(),
                param: None,
                code: None,
            },
        }
    }

    /// A 400 about request field `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message).param(param)
    }

    /// Sets the field at fault.
    pub fn param(mut self, param: &str) -> Self {
        self.detail.param = Some(param.to_string());
        self
    }

    /// Sets the short code.
    pub fn code(mut self, code: &str) -> Self {
        self.detail.code = Some(code.to_string());
        self
    }

    /// The body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: self.detail.clone(),
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status, self.detail.message)
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
