//! `dflash2 serve`: an OpenAI- and llama-server-compatible HTTP server over the engine.
//!
//! Handlers (in [`routes`]) parse and check a request, turn it into tokens and
//! [`GenerateOptions`](crate::engine::GenerateOptions), and hand it to the [`Scheduler`],
//! whose slots run the engines on their own threads and answer through channels; [`reply`]
//! shapes the answer.
pub mod errors;
pub mod fields;
pub mod infill;
pub mod logprobs;
pub mod messages;
pub mod metrics;
pub mod prompt;
pub mod reasoning;
pub mod reply;
pub mod responses;
pub mod routes;
pub mod scheduler;
pub mod tools;
pub mod types;

use crate::draft::config::DraftConfig;
use crate::engine::Verifier;
use crate::llama::Model;
use crate::sampling::SamplingParams;
use crate::template::ChatTemplate;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::{middleware, Router};
use metrics::Metrics;
use scheduler::Scheduler;
use std::sync::Arc;
use std::time::Duration;

/// How requests are decoded when they don't say otherwise (and what they can't change).
#[derive(Debug, Clone)]
pub struct Defaults {
    /// How requests draft; they may turn the look-up on or off (`--lookup`) and set its n-gram.
    pub draft: DraftConfig,
    pub sampling: SamplingParams,
    /// How drafts are verified at T > 0 (`--spec-sampling`; a request's `spec_sampling`).
    pub verifier: Verifier,
    /// Tokens a request without a limit generates at most (`-n`; None: to the end of the context).
    pub n_predict: Option<usize>,
    /// Longest prompt a request may send, in tokens (`--max-prompt-tokens`; None: the slot's context).
    pub max_prompt_tokens: Option<usize>,
    /// Where a chat answer's reasoning goes (`--reasoning-format`; a request's `reasoning_format`).
    pub reasoning_format: reasoning::ReasoningFormat,
    /// The template's `enable_thinking` (`-rea`; a request's `chat_template_kwargs`).
    pub thinking: reasoning::Thinking,
    /// Tokens of thinking at most, and the message that ends it there (`--reasoning-budget`,
    /// `--reasoning-budget-message`; None: no limit).
    pub reasoning_budget: Option<(usize, String)>,
}

/// Everything the handlers share.
pub struct AppState {
    pub scheduler: Scheduler,
    pub metrics: Arc<Metrics>,
    /// The served model's names (`--alias`): the first is the one answers carry. Requests may
    /// name any model: one is served, and clients configured for another server send its name.
    pub model_ids: Vec<String>,
    /// `--tags`, listed in `/v1/models`.
    pub model_tags: Vec<String>,
    pub drafter_path: Option<String>,
    pub api_key: Option<String>,
    pub defaults: Defaults,
    /// Renders chat messages into the prompt (the target's own Jinja template by default).
    pub template: Arc<ChatTemplate>,
    /// `GET /slots` answers (`--slots`, the default); 501 with `--no-slots`, as llama-server.
    pub slots_endpoint: bool,
    /// When the server started, in Unix seconds (llama-server's `Process-Start-Time-Unix`).
    pub started_unix: u64,
    /// `--verbose`: every whole OpenAI answer carries `__verbose`.
    pub verbose: bool,
    /// `--cors-origins`: the origins browsers may call from (empty: any).
    pub cors_origins: Vec<String>,
    /// The chat page at `/` (`--no-webui` leaves it out, as llama-server).
    pub webui: bool,
}

impl AppState {
    /// The target, for chat templates and tokenizing (read-only, shared with the engine).
    pub fn model(&self) -> &Arc<Model> {
        &self.scheduler.info().target
    }

    /// The name answers carry.
    pub fn model_id(&self) -> &str {
        &self.model_ids[0]
    }

    pub fn n_ctx(&self) -> usize {
        self.scheduler.info().n_ctx
    }
}

/// What one client may take of the server: a public server needs each bounded.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections served at once; more wait to be accepted.
    pub max_connections: usize,
    /// Time to send a request's headers, and then its body (a client that stalls is cut off).
    pub read_timeout: Duration,
    pub max_body_bytes: usize,
}

/// How long a handler waits for the rest of a request body (a request extension).
#[derive(Debug, Clone, Copy)]
pub struct BodyTimeout(pub Duration);

/// The routes; everything but `/health` needs the API key when one is set.
pub fn router(state: Arc<AppState>, limits: &Limits) -> Router {
    let body_timeout = BodyTimeout(limits.read_timeout);
    // The chat page asks for the API key itself: it is served without one, as llama-server's.
    let page = if state.webui { Router::new().route("/", get(routes::webui)) } else { Router::new() };
    // llama-server answers its OpenAI routes with and without the `/v1` prefix; so do we.
    Router::new()
        .route("/v1/models", get(routes::models))
        .route("/models", get(routes::models))
        .route("/v1/chat/completions", post(routes::chat))
        .route("/chat/completions", post(routes::chat))
        .route("/v1/chat/completions/input_tokens", post(routes::chat_input_tokens))
        .route("/chat/completions/input_tokens", post(routes::chat_input_tokens))
        .route("/v1/completions", post(routes::completions))
        .route("/v1/responses", post(responses::responses))
        .route("/responses", post(responses::responses))
        .route("/v1/responses/input_tokens", post(responses::input_tokens))
        .route("/v1/messages", post(messages::messages))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/completion", post(routes::llama_completion))
        // llama-server answers its own shape here, not OpenAI's (that is /v1/completions only)
        .route("/completions", post(routes::llama_completion))
        .route("/infill", post(routes::infill))
        .route("/apply-template", post(routes::apply_template))
        .route("/tokenize", post(routes::tokenize))
        .route("/detokenize", post(routes::detokenize))
        .route("/props", get(routes::props))
        .route("/slots", get(routes::slots))
        .route("/metrics", get(routes::metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), routes::require_api_key))
        .route("/health", get(routes::health))
        .route("/v1/health", get(routes::health))
        .route("/v1/embeddings", post(routes::not_supported))
        .route("/embeddings", post(routes::not_supported))
        .route("/embedding", post(routes::not_supported))
        .route("/v1/rerank", post(routes::not_supported))
        .route("/rerank", post(routes::not_supported))
        .merge(page)
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(DefaultBodyLimit::max(limits.max_body_bytes))
        .layer(axum::Extension(body_timeout))
        .layer(cors(&state.cors_origins))
        .with_state(state)
}

/// Browser front-ends may call the server, as with llama-server: from the origins of
/// `--cors-origins`, or from any (the request's origin is mirrored); preflight requests are
/// answered before the API key is asked for (browsers send no credentials with them). An origin
/// not allowed gets no `Access-Control-Allow-Origin`, so the browser keeps the answer from it.
fn cors(allowed: &[String]) -> tower_http::cors::CorsLayer {
    use axum::http::Method;
    use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};
    let origin = if allowed.is_empty() {
        AllowOrigin::mirror_request()
    } else {
        let allowed = allowed.to_vec();
        AllowOrigin::predicate(move |origin, _| origin.to_str().is_ok_and(|o| cors_allows(&allowed, o)))
    };
    CorsLayer::new()
        .allow_origin(origin)
        .allow_credentials(true)
        .allow_methods([Method::GET, Method::POST])
        .allow_headers(AllowHeaders::mirror_request())
}

/// Whether `origin` is one of `allowed` (exact), or a local page where `localhost` is allowed.
fn cors_allows(allowed: &[String], origin: &str) -> bool {
    let local = || {
        let Some(rest) = origin.strip_prefix("http://").or_else(|| origin.strip_prefix("https://")) else { return false };
        let port = ["localhost", "127.0.0.1", "[::1]"].iter().find_map(|h| rest.strip_prefix(h));
        port.is_some_and(|p| p.is_empty() || p.strip_prefix(':').is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())))
    };
    allowed.iter().any(|a| if a == "localhost" { local() } else { a == origin })
}

/// Serve HTTP/1.1 on every listener until Ctrl-C or SIGTERM; requests in progress are answered first. At most
/// `limits.max_connections` connections are served at once (the rest wait in the listen
/// backlog), and a client gets `limits.read_timeout` to send each request's headers (an idle
/// keep-alive connection is closed after as long).
pub async fn serve(listeners: Vec<tokio::net::TcpListener>, router: Router, limits: Limits) -> std::io::Result<()> {
    use futures_util::StreamExt;
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    use tower::ServiceExt;

    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let (closing, _) = tokio::sync::watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown_signal());
    // every address's connections, as they come
    let accepts = listeners.into_iter().map(|l| {
        futures_util::stream::unfold(l, |l| async move {
            let accepted = l.accept().await;
            Some((accepted, l))
        })
        .boxed()
    });
    let mut incoming = futures_util::stream::select_all(accepts);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            _ = &mut shutdown => break,
        };
        let stream = tokio::select! {
            accepted = incoming.next() => match accepted {
                Some(Ok((stream, _))) => stream,
                None => break, // no address to listen on
                Some(Err(e)) => {
                    // out of file descriptors and the like: wait, do not spin
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(
            router.clone().map_request(|req: axum::http::Request<hyper::body::Incoming>| req.map(axum::body::Body::new)),
        );
        let mut closing = closing.subscribe();
        tokio::spawn(async move {
            // HTTP/1.1 only, as llama-server: the header timer then runs from the first read of
            // each request, so a client that connects and sends nothing is cut off too
            // (HTTP/2 detection would first wait for bytes with no timer at all).
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.read_timeout)
                // `Content-Type`, `Process-Start-Time-Unix`: header names as llama-server
                // writes them (HTTP says case does not matter; some clients compare it)
                .title_case_headers(true)
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = closing.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(permit);
        });
    }
    // Let every connection finish its request, then stop.
    let _ = closing.send(true);
    let _ = slots.acquire_many(limits.max_connections.max(1) as u32).await;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down: finishing the requests in progress");
}

#[cfg(test)]
mod tests {
    #[test]
    fn cors_origins_allow_exact_origins_and_local_pages() {
        let allowed = ["localhost".to_string(), "https://app.example".to_string()];
        for ok in ["http://localhost", "http://localhost:8080", "http://127.0.0.1:3000", "http://[::1]", "https://[::1]:5173", "https://app.example"] {
            assert!(super::cors_allows(&allowed, ok), "{ok}");
        }
        for no in ["http://evil.com", "http://notlocalhost", "http://localhost.evil.com", "http://localhost:", "http://localhost:80x", "https://app.example:8443", "localhost"] {
            assert!(!super::cors_allows(&allowed, no), "{no}");
        }
    }
}
