//! Errors as OpenAI shapes them: `{"error": {"message", "type", "param", "code"}}` with an HTTP
//! status; `param` names the request field at fault, where there is one.
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Malformed JSON, wrong types, values out of range; `param` is the field at fault.
    #[error("{message}")]
    InvalidRequest { message: String, param: Option<String> },
    #[error("the prompt has {n_prompt} tokens but the context holds {n_ctx}")]
    ContextExceeded { n_prompt: usize, n_ctx: usize },
    /// Over `--max-prompt-tokens`: answered as a context that holds that many, so clients that
    /// trim a conversation to `n_ctx` trim it to the cap.
    #[error("the prompt has {n_prompt} tokens but this server takes prompts of at most {cap} (--max-prompt-tokens)")]
    PromptCap { n_prompt: usize, cap: usize },
    #[error("missing or invalid API key (send `Authorization: Bearer KEY` or `X-Api-Key: KEY`)")]
    Unauthorized,
    #[error("no endpoint {0}")]
    NotFound(String),
    #[error("method not allowed on this endpoint")]
    MethodNotAllowed,
    #[error("{0} is not offered by this server (it serves generation, not embeddings or reranking)")]
    NotSupported(String),
    /// What the served model cannot do (infill without fill-in-the-middle tokens).
    #[error("{0}")]
    Unsupported(String),
    #[error("the request body is larger than the server accepts ({0})")]
    TooLarge(String),
    #[error("every slot is busy and the queue is full: retry later")]
    Busy,
    #[error("the request body did not arrive within {0} s")]
    Timeout(f64),
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    fn parts(&self) -> (StatusCode, &'static str, &'static str) {
        use ApiError::*;
        match self {
            InvalidRequest { .. } => (StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_request"),
            // llama-server's type, OpenAI's code
            ContextExceeded { .. } | PromptCap { .. } => {
                (StatusCode::BAD_REQUEST, "exceed_context_size_error", "context_length_exceeded")
            }
            Unauthorized => (StatusCode::UNAUTHORIZED, "authentication_error", "invalid_api_key"),
            NotFound(_) => (StatusCode::NOT_FOUND, "invalid_request_error", "not_found"),
            MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method_not_allowed"),
            NotSupported(_) | Unsupported(_) => (StatusCode::NOT_IMPLEMENTED, "not_supported_error", "not_supported"),
            TooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", "request_too_large"),
            Busy => (StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", "server_busy"),
            Timeout(_) => (StatusCode::REQUEST_TIMEOUT, "invalid_request_error", "request_timeout"),
            Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error"),
        }
    }

    /// A request that cannot be served as sent, for no one field's value.
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError::InvalidRequest { message: message.into(), param: None }
    }

    /// A request whose field `param` holds a value that cannot be served.
    pub fn invalid_param(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest { message: message.into(), param: Some(param.into()) }
    }

    /// The JSON body, also sent as the last event of a stream that fails.
    pub fn body(&self) -> serde_json::Value {
        let (_, kind, code) = self.parts();
        let param = match self {
            ApiError::InvalidRequest { param, .. } => param.as_deref(),
            _ => None,
        };
        let mut body = serde_json::json!({ "message": self.to_string(), "type": kind, "param": param, "code": code });
        if let ApiError::ContextExceeded { n_prompt, n_ctx } | ApiError::PromptCap { n_prompt, cap: n_ctx } = self {
            // llama-server's fields, which its clients read to trim a conversation
            body["n_prompt_tokens"] = (*n_prompt).into();
            body["n_ctx"] = (*n_ctx).into();
        }
        serde_json::json!({ "error": body })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.parts().0, Json(self.body())).into_response()
    }
}

impl From<BytesRejection> for ApiError {
    fn from(r: BytesRejection) -> Self {
        match r.status() {
            StatusCode::PAYLOAD_TOO_LARGE => ApiError::TooLarge(r.body_text()),
            _ => ApiError::invalid(format!("cannot read the request body: {}", r.body_text())),
        }
    }
}

impl From<serde_path_to_error::Error<serde_json::Error>> for ApiError {
    /// A body that is not JSON, or not of the route's shape; a wrong field names its path.
    fn from(e: serde_path_to_error::Error<serde_json::Error>) -> Self {
        use serde_json::error::Category;
        let path = e.path().to_string();
        let e = e.into_inner();
        match e.classify() {
            Category::Syntax | Category::Eof | Category::Io => ApiError::invalid(format!("malformed JSON: {e}")),
            // A body that is not an object (`[1, 2]`) or a path through an unnamed part: no field to name.
            Category::Data if path == "." || path.starts_with('[') || path.contains('?') => {
                ApiError::invalid(format!("invalid request: {e}"))
            }
            Category::Data => ApiError::invalid_param(path.clone(), format!("invalid request: `{path}`: {e}")),
        }
    }
}
