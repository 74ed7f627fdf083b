//! The handlers: small functions over typed requests. A generation request is checked,
//! turned into tokens and [`GenerateOptions`], submitted to the scheduler, and answered by a
//! [`Reply`] in its endpoint's shape: one JSON body, or server-sent events.
use super::errors::ApiError;
use super::prompt::{Part, Prompts};
use super::scheduler::{GenEvent, GenRequest, QueueFull};
use super::tools::{self, Tools};
use super::types::*;
use super::AppState;
use crate::engine::{FinishReason, GenerateOptions, Generation, PromptProgress, SelectMode};
use crate::llama::{LlamaError, Model, Token};
use crate::sampling::{SamplingParams, TokenProb};
use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::http::{header, Uri};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{stream, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::mpsc;

type Shared = State<Arc<AppState>>;

/// OpenAI's `system_fingerprint`: which build answered (llama-server sends its build id).
const SYSTEM_FINGERPRINT: &str = concat!("dflash2-", env!("CARGO_PKG_VERSION"));

/// A JSON body, read whatever its Content-Type says (`curl -d` sends a form type), with
/// OpenAI-style errors for a body that is too large, malformed or of the wrong shape.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let body = read_body(req, state).await?;
        Ok(Self(parse_body(&body)?))
    }
}

/// A generation route's body: its own fields, and the sampling fields every such route shares,
/// both read from the same bytes (instead of `#[serde(flatten)]`: see `types`).
pub struct Sampled<T>(pub T, pub SamplingFields);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Sampled<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let body = read_body(req, state).await?;
        let (request, sampling) = (parse_body(&body)?, parse_body(&body)?);
        super::fields::refuse_unbuilt(&parse_body(&body)?)?;
        Ok(Self(request, sampling))
    }
}

/// The whole body, within the server's read timeout (a client that stalls mid-body is cut off).
async fn read_body<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, ApiError> {
    let limit = req.extensions().get::<super::BodyTimeout>().map(|t| t.0);
    match limit {
        Some(limit) => match tokio::time::timeout(limit, Bytes::from_request(req, state)).await {
            Ok(body) => Ok(body?),
            Err(_) => Err(ApiError::Timeout(limit.as_secs_f64())),
        },
        None => Ok(Bytes::from_request(req, state).await?),
    }
}

/// One JSON document of shape `T`; a field of the wrong type is named by its path.
fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut de)?;
    de.end().map_err(|e| ApiError::invalid(format!("malformed JSON: {e}")))?;
    Ok(value)
}

pub async fn require_api_key(State(s): Shared, req: Request, next: Next) -> Result<Response, ApiError> {
    if let Some(key) = &s.api_key {
        // `Authorization: Bearer KEY` (OpenAI's clients) or `X-Api-Key: KEY` (llama-server accepts both).
        let headers = req.headers();
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
        if !given.is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes())) {
            return Err(ApiError::Unauthorized);
        }
    }
    Ok(next.run(req).await)
}

/// Compares in time independent of where the first difference is.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::NotFound(uri.path().to_string())
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

/// Routes of llama-server this server does not offer (it answers them 501 unless started for
/// them): a client learns the feature is missing, not that it mistyped the path.
pub async fn not_supported(uri: Uri) -> ApiError {
    ApiError::NotSupported(uri.path().to_string())
}

/// One model, as llama-server lists it: its names in `aliases`, the first as `id`.
pub async fn models(State(s): Shared) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: s.model_id().to_string(),
            aliases: s.model_ids.clone(),
            tags: s.model_tags.clone(),
            object: "model",
            created: now(),
            owned_by: "dflash2",
            meta: ModelMeta { n_vocab: s.model().n_vocab(), n_ctx: s.n_ctx(), drafter: s.drafter_path.clone() },
        }],
    })
}

pub async fn props(State(s): Shared) -> Json<Props> {
    let (d, p) = (&s.defaults, &s.defaults.sampling);
    Json(Props {
        default_generation_settings: GenerationSettings {
            n_ctx: s.n_ctx(),
            params: SamplingDefaults { n_predict: s.defaults.n_predict.map_or(-1, |n| n as i64), sampling: p.clone() },
            speculative: Speculative {
                select: d.select,
                block: d.block,
                adaptive: d.adaptive,
                tree_budget: d.tree_budget,
                lookup: d.lookup,
                lookup_ngram: d.lookup_ngram,
            },
        },
        total_slots: s.scheduler.slots(),
        model_path: s.model().path().to_string(),
        drafter_path: s.drafter_path.clone(),
        chat_template: s.template.source().to_string(),
        build_info: format!("dflash2 {}", env!("CARGO_PKG_VERSION")),
    })
}

/// `GET /slots?fail_on_no_slot=1` asks for a 503 when no slot is free (llama-server's).
#[derive(Debug, serde::Deserialize)]
pub struct SlotsQuery {
    #[serde(default)]
    fail_on_no_slot: String,
}

/// `GET /slots` (llama-server's): each slot's last request, its settings and progress; 501 when
/// the server was started with `--no-slots`.
pub async fn slots(State(s): Shared, query: axum::extract::Query<SlotsQuery>) -> Result<Json<Vec<SlotOut>>, ApiError> {
    if !s.slots_endpoint {
        return Err(ApiError::Unsupported("this server does not offer the slots endpoint (started with --no-slots)".into()));
    }
    let states = s.scheduler.slot_states();
    if matches!(query.fail_on_no_slot.as_str(), "1" | "true") && states.iter().all(|st| st.processing) {
        return Err(ApiError::Busy);
    }
    let defaults = options(&s, SamplingFields::default(), None, "max_tokens")?;
    let slots = states
        .into_iter()
        .enumerate()
        .map(|(id, st)| SlotOut {
            id,
            n_ctx: s.n_ctx(),
            speculative: drafts(st.opts.as_ref().unwrap_or(&defaults)),
            is_processing: st.processing,
            task: st.opts.map(|o| SlotTask {
                id_task: st.id_task,
                n_prompt_tokens: st.n_prompt_tokens,
                next_token: [NextToken {
                    has_next_token: st.processing,
                    has_new_line: st.has_new_line,
                    // an idle slot has no budget left over from its last request (llama-server's)
                    n_remain: if st.processing { o.n_predict.saturating_sub(st.n_decoded) as i64 } else { -1 },
                    n_decoded: if st.processing { st.n_decoded } else { 0 },
                }],
                params: slot_params(&o),
            }),
        })
        .collect();
    Ok(Json(slots))
}

/// Whether a request's options draft (a drafter or context look-up).
fn drafts(o: &GenerateOptions) -> bool {
    o.select != SelectMode::None || o.lookup
}

/// A request's settings with llama-server's names (`/slots`, `generation_settings`).
fn slot_params(o: &GenerateOptions) -> SlotParams {
    SlotParams {
        n_predict: o.n_predict as i64,
        speculative_n_max: if drafts(o) { o.block.saturating_sub(1) } else { 0 },
        speculative_n_min: 0,
        speculative_select: o.select,
        sampling: o.sampling.clone(),
        stop: o.stop.clone(),
        n_probs: o.n_probs.unwrap_or(0),
        grammar: o.grammar.clone().unwrap_or_default(),
        samplers: super::fields::SAMPLERS,
    }
}

pub async fn metrics(State(s): Shared) -> impl IntoResponse {
    let text = s.metrics.render(s.scheduler.queued(), s.scheduler.slots());
    let started = s.started_unix.to_string();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4".to_string()), (header::HeaderName::from_static("process-start-time-unix"), started)], text)
}

pub async fn tokenize(State(s): Shared, ApiJson(req): ApiJson<TokenizeRequest>) -> Result<Json<Tokens>, ApiError> {
    let model = s.model().clone();
    let tokens = blocking(move || {
        let ids = model.tokenize(&req.content, req.add_special, req.parse_special)?;
        Ok(ids
            .into_iter()
            .map(|id| match req.with_pieces {
                false => TokenOut::Id(id),
                true => TokenOut::WithPiece { id, piece: piece(model.token_bytes(id, true)) },
            })
            .collect())
    })
    .await?;
    Ok(Json(Tokens { tokens }))
}

fn piece(bytes: Vec<u8>) -> Piece {
    String::from_utf8(bytes).map_or_else(|e| Piece::Bytes(e.into_bytes()), Piece::Text)
}

pub async fn detokenize(State(s): Shared, ApiJson(req): ApiJson<DetokenizeRequest>) -> Result<Json<Content>, ApiError> {
    let ids = token_ids(s.model(), &req.tokens, "tokens")?;
    Ok(Json(Content { content: s.model().detokenize(&ids, true) }))
}

pub async fn chat(State(s): Shared, Sampled(req, sampling): Sampled<ChatRequest>) -> Result<Response, ApiError> {
    let n = choices(req.n)?;
    let slot = preferred_slot(&s, sampling.id_slot)?;
    let report = Report::of(&s, &sampling);
    let mut opts = options(&s, sampling, req.max_completion_tokens.or(req.max_tokens), "max_tokens")?;
    opts.n_probs = match (req.logprobs, req.top_logprobs) {
        (Some(true), n) => Some(count("top_logprobs", n.unwrap_or(0), 20)?),
        (_, Some(n)) if n != 0 => {
            return Err(ApiError::invalid_param("top_logprobs", "`top_logprobs` needs `logprobs`: true"))
        }
        _ => None,
    };
    let tools = chat_tools(&s, &req)?;
    if let Some(t) = &tools {
        t.constrain(&mut opts)?;
    }
    let open_turn = generation_prompt(&req)?;
    let prompt = chat_prompt(&s, req.messages, tools.as_ref(), open_turn).await?;
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    let shape = Shape::Chat { include_usage, tools: tools.filter(Tools::active) };
    let reply = Reply::new(&s, "chatcmpl", shape, &opts, report);
    generate(&s, vec![prompt], opts, n, slot, reply, req.stream.unwrap_or(false)).await
}

pub async fn completions(
    State(s): Shared,
    Sampled(req, sampling): Sampled<CompletionRequest>,
) -> Result<Response, ApiError> {
    let n = choices(req.n)?;
    let slot = preferred_slot(&s, sampling.id_slot)?;
    let report = Report::of(&s, &sampling);
    let mut opts = options(&s, sampling, req.max_tokens, "max_tokens")?;
    opts.n_probs = req.logprobs.map(|n| count("logprobs", n, 5)).transpose()?;
    let prompts = prompt_tokens(&s, req.prompt).await?;
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    let reply = Reply::new(&s, "cmpl", Shape::Text { include_usage }, &opts, report);
    generate(&s, prompts, opts, n, slot, reply, req.stream.unwrap_or(false)).await
}

pub async fn llama_completion(
    State(s): Shared,
    Sampled(req, sampling): Sampled<LlamaCompletionRequest>,
) -> Result<Response, ApiError> {
    // -1 is llama-server's "no limit": up to the end of the context.
    let slot = preferred_slot(&s, sampling.id_slot)?;
    let report = Report::of(&s, &sampling);
    let mut opts = options(&s, sampling, req.n_predict.filter(|&n| n != -1), "n_predict")?;
    opts.n_probs = n_probs(req.n_probs)?;
    let prompts = prompt_tokens(&s, req.prompt).await?;
    let several = prompts.len() > 1;
    let shape = Shape::Llama { return_tokens: req.return_tokens, stops: opts.stop.clone(), several, fields: req.response_fields };
    let reply = Reply::new(&s, "cmpl", shape, &opts, report);
    generate(&s, prompts, opts, 1, slot, reply, req.stream.unwrap_or(false)).await
}

/// `POST /infill`: code completion between a prefix and a suffix, in `/completion`'s shapes.
pub async fn infill(State(s): Shared, Sampled(req, sampling): Sampled<InfillRequest>) -> Result<Response, ApiError> {
    let slot = preferred_slot(&s, sampling.id_slot)?;
    let report = Report::of(&s, &sampling);
    let mut opts = options(&s, sampling, req.n_predict.filter(|&n| n != -1), "n_predict")?;
    opts.n_probs = n_probs(req.n_probs)?;
    let (model, n_ctx, limit) = (s.model().clone(), s.n_ctx(), req.n_predict.filter(|&n| n != -1).map(|_| opts.n_predict));
    let stream = req.stream.unwrap_or(false);
    let return_tokens = req.return_tokens;
    let prompt = tokio::task::spawn_blocking(move || super::infill::prompt(&model, &req, n_ctx, limit))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??;
    let shape = Shape::Llama { return_tokens, stops: opts.stop.clone(), several: false, fields: Vec::new() };
    let reply = Reply::new(&s, "cmpl", shape, &opts, report);
    generate(&s, vec![prompt], opts, 1, slot, reply, stream).await
}

/// A count field between 0 and `max`.
fn count(name: &str, n: i64, max: i64) -> Result<usize, ApiError> {
    match n {
        n if (0..=max).contains(&n) => Ok(n as usize),
        n => Err(ApiError::invalid_param(name, format!("`{name}` must be between 0 and {max}, got {n}"))),
    }
}

/// llama-server's `n_probs`: 0 (or none) reports no probabilities.
fn n_probs(n: Option<i64>) -> Result<Option<usize>, ApiError> {
    Ok(Some(count("n_probs", n.unwrap_or(0), 100)?).filter(|&n| n > 0))
}

/// Submit a checked request; answer with one body, or stream it. Dropping the receiver
/// cancels the generation: with the stream, or with this future when a client goes away.
async fn generate(
    s: &AppState,
    prompts: Vec<Vec<Token>>,
    opts: GenerateOptions,
    n: usize,
    slot: Option<usize>,
    mut reply: Reply,
    stream: bool,
) -> Result<Response, ApiError> {
    reply.per_prompt = n;
    if matches!(reply.shape, Shape::Llama { .. }) || reply.report.verbose {
        reply.prompt_texts = prompts.iter().map(|p| s.model().detokenize(p, true)).collect();
        reply.prompt_lens = prompts.iter().map(Vec::len).collect();
    }
    let events = submit(s, &prompts, opts, n, slot, stream && reply.report.progress)?;
    if stream {
        return Ok(reply.stream(events));
    }
    let mut gens = Vec::with_capacity(events.len());
    for rx in events {
        gens.push(collect(rx).await?);
    }
    Ok(reply.whole(&gens))
}

/// llama-server's `id_slot`: -1 (or none) for any slot, else one of the slots.
pub(super) fn preferred_slot(s: &AppState, id_slot: Option<i64>) -> Result<Option<usize>, ApiError> {
    match id_slot.unwrap_or(-1) {
        -1 => Ok(None),
        i if (0..s.scheduler.slots() as i64).contains(&i) => Ok(Some(i as usize)),
        i => Err(ApiError::invalid_param("id_slot", format!("`id_slot` must be -1 or a slot 0..{}, got {i}", s.scheduler.slots()))),
    }
}

/// Queue `n` generations of each checked prompt (in `slot` when it is free); their events, in
/// order (prompt by prompt). `progress`: report each prompt's decoding.
pub(super) fn submit(
    s: &AppState,
    prompts: &[Vec<Token>],
    opts: GenerateOptions,
    n: usize,
    slot: Option<usize>,
    progress: bool,
) -> Result<Vec<mpsc::Receiver<GenEvent>>, ApiError> {
    if prompts.len() * n > MAX_CHOICES {
        let what = format!("{} prompts x {n} choices: at most {MAX_CHOICES} generations per request", prompts.len());
        return Err(ApiError::invalid_param("n", what));
    }
    for prompt in prompts {
        if prompt.is_empty() {
            return Err(ApiError::invalid_param("prompt", "the prompt is empty"));
        }
        if prompt.len() >= s.n_ctx() {
            return Err(ApiError::ContextExceeded { n_prompt: prompt.len(), n_ctx: s.n_ctx() });
        }
        if let Some(cap) = s.defaults.max_prompt_tokens.filter(|&cap| prompt.len() > cap) {
            return Err(ApiError::PromptCap { n_prompt: prompt.len(), cap });
        }
    }
    // `n` choices are `n` generations of one prompt, decoded side by side in the slots; at T > 0
    // choice i samples with seed + i (one seed would give n copies of one answer).
    let mut events = Vec::with_capacity(prompts.len() * n);
    for prompt in prompts {
        for i in 0..n {
            let mut opts = opts.clone();
            opts.sampling.seed = opts.sampling.seed.wrapping_add(i as u64);
            let req = GenRequest { prompt: prompt.clone(), opts, slot, progress };
            let rx = s.scheduler.submit(req).map_err(|QueueFull| {
                s.metrics.rejected();
                ApiError::Busy
            })?;
            events.push(rx);
        }
    }
    Ok(events)
}

/// OpenAI's `n`: how many choices (1 when absent).
fn choices(n: Option<i64>) -> Result<usize, ApiError> {
    match n.unwrap_or(1) {
        n if (1..=MAX_CHOICES as i64).contains(&n) => Ok(n as usize),
        n => Err(ApiError::invalid_param("n", format!("`n` must be between 1 and {MAX_CHOICES}, got {n}"))),
    }
}

/// Most choices one request may ask for.
const MAX_CHOICES: usize = 16;

/// The request's generation options over the server's defaults, each value range-checked.
/// No `max_tokens` (named `max_name` in the request) means: until the end of generation or of
/// the context.
pub(super) fn options(
    s: &AppState,
    f: SamplingFields,
    max_tokens: Option<i64>,
    max_name: &str,
) -> Result<GenerateOptions, ApiError> {
    let n_ctx = s.n_ctx();
    let d = &s.defaults.sampling;
    let n_predict = match max_tokens {
        None => s.defaults.n_predict.unwrap_or(n_ctx).min(n_ctx),
        // the server's `-n` caps every request, as llama-server's does
        Some(n) if (1..=n_ctx as i64).contains(&n) => (n as usize).min(s.defaults.n_predict.unwrap_or(n_ctx)),
        Some(n) => return Err(ApiError::invalid_param(max_name, format!("`{max_name}` must be between 1 and {n_ctx} (the context), got {n}"))),
    };
    let unit = |name: &str, v: Option<f32>, lo: f32, hi: f32, default: f32| match v {
        None => Ok(default),
        Some(x) if x.is_finite() && (lo..=hi).contains(&x) => Ok(x),
        Some(x) => Err(ApiError::invalid_param(name, format!("`{name}` must be between {lo} and {hi}, got {x}"))),
    };
    let sampling = SamplingParams {
        temperature: unit("temperature", f.temperature, 0.0, 2.0, d.temperature)?,
        top_k: f.top_k.unwrap_or(d.top_k),
        top_p: unit("top_p", f.top_p, 0.0, 1.0, d.top_p)?,
        min_p: unit("min_p", f.min_p, 0.0, 1.0, d.min_p)?,
        repeat_penalty: unit("repeat_penalty", f.repeat_penalty, 0.01, 10.0, d.repeat_penalty)?,
        presence_penalty: unit("presence_penalty", f.presence_penalty, -2.0, 2.0, d.presence_penalty)?,
        frequency_penalty: unit("frequency_penalty", f.frequency_penalty, -2.0, 2.0, d.frequency_penalty)?,
        logit_bias: {
            let mut bias = match &f.logit_bias {
                None => d.logit_bias.clone(),
                given => super::fields::logit_bias(given.as_ref(), s.model())?,
            };
            if f.ignore_eos == Some(true) {
                bias.extend(s.model().eog_tokens().into_iter().map(|t| (t, f32::NEG_INFINITY)));
            }
            bias
        },
        repeat_last_n: match f.repeat_last_n {
            None => d.repeat_last_n,
            Some(-1) => n_ctx as i32, // llama.cpp's "the whole context"
            Some(n) if n >= 0 => n,
            Some(n) => return Err(ApiError::invalid_param("repeat_last_n", format!("`repeat_last_n` must be -1 or more, got {n}"))),
        },
        seed: match f.seed {
            None => d.seed,
            Some(n) if n < 0 => rand::random(),
            Some(n) => n as u64,
        },
    };
    super::fields::check_samplers(f.samplers.as_ref(), &sampling)?;
    let grammar = super::fields::grammar(f.grammar.as_deref(), f.json_schema.as_ref(), f.response_format.as_ref(), s.model())?;
    let lookup = f.lookup.unwrap_or(s.defaults.lookup);
    let max_ngram = crate::draft::lookup::MAX_NGRAM as i64;
    let lookup_ngram = match f.lookup_ngram {
        None => s.defaults.lookup_ngram,
        Some(n) if (1..=max_ngram).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::invalid_param("lookup_ngram", format!("`lookup_ngram` must be between 1 and {max_ngram}, got {n}")))
        }
    };
    // A server started without a drafter decodes plainly unless a request asks for look-up.
    let select = match s.defaults.select {
        SelectMode::None if lookup => SelectMode::Greedy,
        select => select,
    };
    Ok(GenerateOptions {
        n_predict,
        select,
        block: s.defaults.block,
        adaptive: s.defaults.adaptive,
        tree_budget: s.defaults.tree_budget,
        lookup,
        lookup_ngram,
        stop: stop_strings(f.stop)?,
        sampling,
        grammar,
        ..GenerateOptions::default()
    })
}

/// Most stop strings one request may give, and their longest (every generated piece is
/// searched for each: the bounds keep that cheap).
const MAX_STOPS: usize = 16;
const MAX_STOP_BYTES: usize = 256;

fn stop_strings(stop: Option<Stop>) -> Result<Vec<String>, ApiError> {
    let stops = stop.map(Stop::into_vec).unwrap_or_default();
    if stops.len() > MAX_STOPS {
        return Err(ApiError::invalid_param("stop", format!("`stop` holds {} strings, at most {MAX_STOPS} are served", stops.len())));
    }
    if let Some(s) = stops.iter().find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid_param(
            "stop",
            format!("a `stop` string must have 1 to {MAX_STOP_BYTES} bytes, one has {}", s.len()),
        ));
    }
    Ok(stops)
}

/// `POST /apply-template` (llama-server's): the prompt text a chat request would decode.
pub async fn apply_template(State(s): Shared, ApiJson(req): ApiJson<ChatRequest>) -> Result<Json<PromptText>, ApiError> {
    let tools = chat_tools(&s, &req)?;
    let open_turn = generation_prompt(&req)?;
    let prompt = render_chat(&s, req.messages, tools.as_ref(), open_turn)?;
    Ok(Json(PromptText { prompt }))
}

/// `POST /v1/chat/completions/input_tokens` (llama-server's): how many prompt tokens a chat
/// request's body would decode.
pub async fn chat_input_tokens(State(s): Shared, ApiJson(req): ApiJson<ChatRequest>) -> Result<Json<InputTokens>, ApiError> {
    let tools = chat_tools(&s, &req)?;
    let open_turn = generation_prompt(&req)?;
    let prompt = chat_prompt(&s, req.messages, tools.as_ref(), open_turn).await?;
    Ok(Json(InputTokens { object: "response.input_tokens", input_tokens: prompt.len() }))
}

/// A chat request's tools, in the format the served template asks for.
fn chat_tools(s: &AppState, req: &ChatRequest) -> Result<Option<Tools>, ApiError> {
    let format = tools::Format::of(&s.template);
    Tools::new(req.tools.as_ref(), req.tool_choice.as_ref(), req.parallel_tool_calls, format)
}

/// Whether a chat request's prompt ends with the assistant's turn opened: yes unless
/// `add_generation_prompt` is false. `continue_final_message` needs a final assistant message
/// and cannot come with `add_generation_prompt: true` (llama-server refuses the pair too).
fn generation_prompt(req: &ChatRequest) -> Result<bool, ApiError> {
    if req.continue_final_message == Some(true) {
        if req.add_generation_prompt == Some(true) {
            return Err(ApiError::invalid_param(
                "continue_final_message",
                "`continue_final_message` and `add_generation_prompt` cannot both be true",
            ));
        }
        if req.messages.last().is_none_or(|m| m.role != "assistant") {
            return Err(ApiError::invalid_param("continue_final_message", "there is no final assistant message to continue"));
        }
    }
    Ok(req.add_generation_prompt.unwrap_or(true))
}

/// The prompt tokens of a chat request, rendered with the served template; `open_turn`: end
/// with the assistant's turn opened (a final assistant message is continued either way).
pub(super) async fn chat_prompt(
    s: &AppState,
    messages: Vec<ChatMessageIn>,
    tools: Option<&Tools>,
    open_turn: bool,
) -> Result<Vec<Token>, ApiError> {
    let text = render_chat(s, messages, tools, open_turn)?;
    let model = s.model().clone();
    blocking(move || model.tokenize(&text, true, true)).await
}

/// The chat prompt text, with the request's tools. A conversation that ends with an assistant
/// message asks for that message to be continued (llama-server's assistant prefill): the turns
/// before it are rendered with the assistant's turn opened, and its text follows.
fn render_chat(s: &AppState, messages: Vec<ChatMessageIn>, tools: Option<&Tools>, open_turn: bool) -> Result<String, ApiError> {
    let native = s.template.describes_tools();
    let mut messages = tools::conversation(messages, native)?;
    let is_assistant = |m: Option<&serde_json::Value>| m.is_some_and(|m| m["role"] == "assistant");
    let prefill = match is_assistant(messages.last()) {
        false => None,
        true if is_assistant(messages.iter().rev().nth(1)) => {
            return Err(ApiError::invalid_param("messages", "Cannot have 2 or more assistant messages at the end of the list."))
        }
        true => messages.pop().and_then(|m| m["content"].as_str().map(str::to_string)),
    };
    if let Some(t) = tools {
        t.describe(&mut messages);
    }
    let list = tools.filter(|_| native).map(|t| t.list.as_slice());
    let text = s.template.render_with_tools(&messages, list, open_turn || prefill.is_some()).map_err(template_refused)?;
    Ok(text + prefill.as_deref().unwrap_or_default())
}

/// The template's own refusal (`raise_exception`) names the messages as the field at fault.
fn template_refused(e: LlamaError) -> ApiError {
    ApiError::invalid_param("messages", format!("the chat template refused the messages: {e}"))
}

/// Each prompt's tokens. A text that opens a prompt gets the model's BOS (as llama-server adds
/// it); ids are checked against the vocabulary.
async fn prompt_tokens(s: &AppState, prompts: Prompts) -> Result<Vec<Vec<Token>>, ApiError> {
    let model = s.model().clone();
    tokio::task::spawn_blocking(move || {
        prompts
            .0
            .iter()
            .map(|parts| {
                let mut tokens = Vec::new();
                for (i, part) in parts.iter().enumerate() {
                    match part {
                        Part::Id(id) => tokens.extend(token_ids(&model, &[*id], "prompt")?),
                        Part::Text(t) => {
                            tokens.extend(model.tokenize(t, i == 0, true).map_err(|e| ApiError::invalid(e.to_string()))?)
                        }
                    }
                }
                Ok(tokens)
            })
            .collect()
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?
}

/// Token ids from a client's field `param`, each checked against the vocabulary (llama.cpp does
/// not check).
fn token_ids(model: &Model, ids: &[i64], param: &str) -> Result<Vec<Token>, ApiError> {
    let n_vocab = model.n_vocab();
    ids.iter()
        .map(|&id| match Token::try_from(id) {
            Ok(t) if t >= 0 && (t as usize) < n_vocab => Ok(t),
            _ => Err(ApiError::invalid_param(param, format!("token id {id} is outside the vocabulary (0..{n_vocab})"))),
        })
        .collect()
}

/// Tokenizing and templating a long prompt is CPU work: keep it off the async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, LlamaError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(|e| ApiError::invalid(e.to_string()))
}

pub fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Which endpoint's shapes a reply takes.
enum Shape {
    /// `tools`: tool calls are parsed out of the answer.
    Chat { include_usage: bool, tools: Option<Tools> },
    Text { include_usage: bool },
    /// `several`: the request held several prompts (answered as a list); `fields`: only these
    /// fields of each end (llama-server's `response_fields`).
    Llama { return_tokens: bool, stops: Vec<String>, several: bool, fields: Vec<String> },
}

/// llama-server's reporting fields of a request.
#[derive(Debug, Clone, Copy, Default)]
struct Report {
    /// `timings_per_token`: every streamed piece carries the timings so far.
    timings_per_token: bool,
    /// `return_progress`: a streamed answer first tells how far its prompt is.
    progress: bool,
    /// `__verbose` in a whole OpenAI answer (`--verbose`, or the request's `verbose`).
    verbose: bool,
}

impl Report {
    fn of(s: &AppState, f: &SamplingFields) -> Self {
        Self {
            timings_per_token: f.timings_per_token == Some(true),
            progress: f.return_progress == Some(true),
            verbose: f.verbose.unwrap_or(s.verbose),
        }
    }
}

/// How one generation is answered: its endpoint's shapes and the ids its pieces share.
struct Reply {
    shape: Shape,
    id: String,
    created: u64,
    model: String,
    target: Arc<Model>,
    /// Log-probabilities were asked for.
    logprobs: bool,
    report: Report,
    /// The request's settings (llama-server's `generation_settings`).
    settings: SlotParams,
    /// Choices per prompt (`n`).
    per_prompt: usize,
    /// Each prompt as text (llama-server's ends show it), and its length in tokens.
    prompt_texts: Vec<String>,
    prompt_lens: Vec<usize>,
    /// Characters of text streamed so far (OpenAI's legacy `text_offset`).
    streamed_chars: std::sync::Mutex<Vec<usize>>,
    /// Per choice of a streamed chat with tools: its content so far.
    tool_text: std::sync::Mutex<Vec<tools::ContentStream>>,
}

impl Reply {
    fn new(s: &AppState, prefix: &str, shape: Shape, opts: &GenerateOptions, report: Report) -> Self {
        Self {
            shape,
            id: format!("{prefix}-{:016x}", rand::random::<u64>()),
            created: now(),
            model: s.model_id().to_string(),
            target: s.model().clone(),
            logprobs: opts.n_probs.is_some(),
            report,
            settings: slot_params(opts),
            per_prompt: 1,
            prompt_texts: Vec::new(),
            prompt_lens: Vec::new(),
            streamed_chars: Default::default(),
            tool_text: Default::default(),
        }
    }

    fn chat_logprobs(&self, probs: &[TokenProb]) -> Option<ChatLogprobs> {
        self.logprobs.then(|| super::logprobs::chat(&self.target, probs))
    }

    fn text_logprobs(&self, probs: &[TokenProb], offset: usize) -> Option<TextLogprobs> {
        self.logprobs.then(|| super::logprobs::text(&self.target, probs, offset))
    }

    /// The whole answer: one choice per generation (`n`), in order.
    fn whole(&self, gens: &[Generation]) -> Response {
        let usage = Some(Usage::of(gens, self.per_prompt));
        let timings = Some(Timings::from(&gens[0].stats));
        match &self.shape {
            Shape::Chat { tools, .. } => {
                let choices = gens
                    .iter()
                    .enumerate()
                    .map(|(i, g)| {
                        let (content, tool_calls) = match tools {
                            None => (Some(g.text.clone()), None),
                            Some(t) => {
                                let parsed = t.parse(&g.text);
                                (parsed.content, Some(parsed.calls).filter(|c| !c.is_empty()))
                            }
                        };
                        ChatChoice {
                            index: i as u32,
                            finish_reason: Some(chat_finish(g.finish, tool_calls.is_some())),
                            message: Some(ChatMessageOut { role: Some("assistant"), content: Some(content), tool_calls }),
                            delta: None,
                            logprobs: self.chat_logprobs(&g.probs),
                        }
                    })
                    .collect();
                let verbose = self.verbose();
                Json(Completion { usage, timings, verbose, ..self.envelope("chat.completion", choices) }).into_response()
            }
            Shape::Text { .. } => {
                let choices = gens
                    .iter()
                    .enumerate()
                    .map(|(i, g)| TextChoice {
                        index: i as u32,
                        text: g.text.clone(),
                        logprobs: self.text_logprobs(&g.probs, 0),
                        finish_reason: Some(finish_reason(g.finish)),
                    })
                    .collect();
                let verbose = self.verbose();
                Json(Completion { usage, timings, verbose, ..self.envelope("text_completion", choices) }).into_response()
            }
            Shape::Llama { several: false, .. } => Json(self.llama_end(0, gens[0].text.clone(), &gens[0])).into_response(),
            Shape::Llama { several: true, .. } => {
                let all: Vec<_> = gens.iter().enumerate().map(|(i, g)| self.llama_end(i, g.text.clone(), g)).collect();
                Json(all).into_response()
            }
        }
    }

    /// Server-sent events: the pieces of every choice as they land (tagged with its index),
    /// each choice's end, then the usage and `[DONE]` for OpenAI.
    fn stream(self, events: Vec<mpsc::Receiver<GenEvent>>) -> Response {
        let n = events.len();
        let head: Vec<Event> = match &self.shape {
            Shape::Chat { .. } => (0..n).map(|i| event(&self.chat_delta(i, Some("assistant"), Some(None), None, None))).collect(),
            _ => Vec::new(),
        };
        let tagged = events.into_iter().enumerate().map(|(i, rx)| {
            stream::unfold(Some(rx), move |rx| async move {
                let mut rx = rx?;
                match rx.recv().await {
                    Some(GenEvent::Done(g)) => Some(((i, GenEvent::Done(g)), None)),
                    Some(GenEvent::Error(e)) => Some(((i, GenEvent::Error(e)), None)),
                    Some(e) => Some(((i, e), Some(rx))),
                    None => Some(((i, GenEvent::Error("the generation ended without a result".into())), None)),
                }
            })
            .boxed()
        });
        let merged = stream::select_all(tagged);
        let body = stream::unfold((merged, Some(self), Vec::new()), move |(mut merged, reply, mut done)| async move {
            let reply = reply?; // gone after the last event
            let (out, reply) = match merged.next().await {
                Some((i, GenEvent::Tokens { tokens, text, probs, stats })) => {
                    let timings = reply.report.timings_per_token.then(|| Timings::from(&*stats));
                    (reply.piece(i, tokens, text, probs, timings).into_iter().collect(), Some(reply))
                }
                Some((i, GenEvent::Progress(p))) => (vec![reply.progress(i, p)], Some(reply)),
                Some((i, GenEvent::Done(g))) => {
                    let mut out = reply.finish(i, &g);
                    done.push(*g);
                    if done.len() < n {
                        (out, Some(reply))
                    } else {
                        out.extend(reply.end(&done));
                        (out, None)
                    }
                }
                Some((_, GenEvent::Error(e))) => (reply.failure(ApiError::Internal(e)), None),
                None => (reply.failure(ApiError::Internal("the generation ended without a result".into())), None),
            };
            Some((stream::iter(out), (merged, reply, done)))
        })
        .flatten();
        let events = stream::iter(head).chain(body).map(Ok::<_, Infallible>);
        Sse::new(events).keep_alive(KeepAlive::default()).into_response()
    }

    /// A streamed piece of choice `index`: its text, and its tokens' log-probabilities when
    /// asked for (a piece whose text is held back still carries them); `timings` so far when
    /// asked for.
    fn piece(
        &self,
        index: usize,
        tokens: Vec<Token>,
        text: String,
        probs: Vec<TokenProb>,
        timings: Option<Timings>,
    ) -> Option<Event> {
        let with_probs = self.logprobs && !probs.is_empty();
        match &self.shape {
            Shape::Chat { tools, .. } => {
                let text = match tools {
                    None => text,
                    Some(t) => self.shown_content(t, index, &text),
                };
                if text.is_empty() && !with_probs {
                    return None;
                }
                let mut chunk = self.chat_delta(index, None, Some(Some(text)), None, timings);
                chunk.choices[0].logprobs = self.chat_logprobs(&probs);
                Some(event(&chunk))
            }
            Shape::Text { .. } if !text.is_empty() || with_probs => {
                let offset = {
                    let mut chars = self.streamed_chars.lock().expect("never poisoned: no panics inside");
                    let len = chars.len().max(index + 1);
                    chars.resize(len, 0);
                    let before = chars[index];
                    chars[index] += text.chars().count();
                    before
                };
                let mut chunk = Completion { timings, ..self.text_piece(index, text, None) };
                chunk.choices[0].logprobs = self.text_logprobs(&probs, offset);
                Some(event(&chunk))
            }
            // every streamed piece carries its token ids, as llama-server's do (`return_tokens`
            // adds them to a whole answer)
            Shape::Llama { .. } if !text.is_empty() || with_probs || !tokens.is_empty() => {
                let completion_probabilities = self.logprobs.then(|| super::logprobs::llama(&self.target, &probs));
                Some(event(&LlamaCompletion { content: text, tokens, completion_probabilities, timings, ..LlamaCompletion::piece(index) }))
            }
            _ => None,
        }
    }

    /// `__verbose` of a whole answer, when asked for: its (first) prompt as decoded.
    fn verbose(&self) -> Option<Verbose> {
        let prompt = self.prompt_texts.first().filter(|_| self.report.verbose)?;
        Some(Verbose { prompt: prompt.clone(), tokens_evaluated: self.prompt_lens[0] })
    }

    /// How far choice `index`'s prompt is (llama-server's `prompt_progress` chunk), with the
    /// timings so far when asked for.
    fn progress(&self, index: usize, p: PromptProgress) -> Event {
        let timings = self.report.timings_per_token.then(|| Timings::of_progress(&p));
        let prompt_progress = Some(p);
        match &self.shape {
            Shape::Chat { .. } => event(&ChatCompletion { prompt_progress, timings, ..self.envelope("chat.completion.chunk", Vec::new()) }),
            Shape::Text { .. } => event(&TextCompletion { prompt_progress, timings, ..self.envelope("text_completion", Vec::new()) }),
            Shape::Llama { .. } => event(&LlamaCompletion { prompt_progress, timings, ..LlamaCompletion::piece(index) }),
        }
    }

    /// The end of choice `index` (llama-server's: the whole end object).
    fn finish(&self, index: usize, g: &Generation) -> Vec<Event> {
        let reason = Some(finish_reason(g.finish));
        let timings = Some(Timings::from(&g.stats));
        match &self.shape {
            Shape::Chat { tools: None, .. } => vec![event(&self.chat_delta(index, None, None, reason, timings))],
            Shape::Chat { tools: Some(t), .. } => {
                // The rest of the content, then the calls whole, then the end.
                let parsed = t.parse(&g.text);
                let held = self.tool_text.lock().expect("never poisoned: no panics inside").get(index).cloned().unwrap_or_default();
                let rest = parsed.content.as_deref().map(|c| held.rest(c)).unwrap_or_default();
                let mut out = Vec::new();
                if !rest.is_empty() {
                    out.push(event(&self.chat_delta(index, None, Some(Some(rest.to_string())), None, None)));
                }
                let called = !parsed.calls.is_empty();
                if called {
                    let calls = parsed.calls.into_iter().enumerate().map(|(i, c)| ToolCallOut { index: Some(i as u32), ..c }).collect();
                    let mut chunk = self.chat_delta(index, None, None, None, None);
                    chunk.choices[0].delta = Some(ChatMessageOut { tool_calls: Some(calls), ..Default::default() });
                    out.push(event(&chunk));
                }
                out.push(event(&self.chat_delta(index, None, None, Some(chat_finish(g.finish, called)), timings)));
                out
            }
            Shape::Text { .. } => vec![event(&Completion { timings, ..self.text_piece(index, String::new(), reason) })],
            Shape::Llama { .. } => vec![event(&self.llama_end(index, String::new(), g))],
        }
    }

    /// After every choice ended: the usage (when asked for) and `[DONE]` (OpenAI's shapes).
    fn end(&self, gens: &[Generation]) -> Vec<Event> {
        let usage = Some(Usage::of(gens, self.per_prompt));
        let timings = Some(Timings::from(&gens[0].stats));
        let mut out = Vec::new();
        match &self.shape {
            // (with the timings, as llama-server's usage chunk)
            Shape::Chat { include_usage: true, .. } => {
                out.push(event(&ChatCompletion { usage, timings, ..self.envelope("chat.completion.chunk", Vec::new()) }))
            }
            Shape::Text { include_usage: true } => {
                out.push(event(&TextCompletion { usage, timings, ..self.envelope("text_completion", Vec::new()) }))
            }
            Shape::Llama { .. } => return out,
            _ => {}
        }
        out.push(done());
        out
    }

    fn failure(&self, e: ApiError) -> Vec<Event> {
        let error = event(&e.body());
        match self.shape {
            Shape::Llama { .. } => vec![error],
            _ => vec![error, done()],
        }
    }

    fn envelope<C>(&self, object: &'static str, choices: Vec<C>) -> Completion<C> {
        Completion {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            system_fingerprint: SYSTEM_FINGERPRINT,
            choices,
            usage: None,
            timings: None,
            prompt_progress: None,
            verbose: None,
        }
    }

    fn chat_delta(
        &self,
        index: usize,
        role: Option<&'static str>,
        content: Option<Option<String>>,
        finish: Option<&'static str>,
        timings: Option<Timings>,
    ) -> ChatCompletion {
        let delta = ChatMessageOut { role, content, tool_calls: None };
        let choice = ChatChoice { index: index as u32, message: None, delta: Some(delta), finish_reason: finish, logprobs: None };
        ChatCompletion { timings, ..self.envelope("chat.completion.chunk", vec![choice]) }
    }

    /// The part of choice `index`'s new `text` that is surely content (calls are sent whole at
    /// the end, with the content held back until then).
    fn shown_content(&self, tools: &Tools, index: usize, text: &str) -> String {
        let mut held = self.tool_text.lock().expect("never poisoned: no panics inside");
        if held.len() <= index {
            held.resize(index + 1, Default::default());
        }
        held[index].push(tools, text)
    }

    fn text_piece(&self, index: usize, text: String, finish: Option<&'static str>) -> TextCompletion {
        self.envelope("text_completion", vec![TextChoice { index: index as u32, text, logprobs: None, finish_reason: finish }])
    }

    /// The end of prompt `index`'s answer: the whole object, or the fields asked for.
    fn llama_end(&self, index: usize, content: String, g: &Generation) -> serde_json::Value {
        let Shape::Llama { fields, .. } = &self.shape else { unreachable!("llama_end is only called for /completion") };
        let end = serde_json::to_value(self.llama_end_whole(index, content, g)).expect("response shapes serialize");
        if fields.is_empty() {
            return end;
        }
        // llama-server's response_fields: each path found, under the path as its key
        let found = fields.iter().filter_map(|path| {
            let value = path.split('/').try_fold(&end, |v, key| v.as_object()?.get(key))?;
            Some((path.clone(), value.clone()))
        });
        serde_json::Value::Object(found.collect())
    }

    fn llama_end_whole(&self, index: usize, content: String, g: &Generation) -> LlamaCompletion {
        let Shape::Llama { return_tokens, stops, .. } = &self.shape else {
            unreachable!("llama_end is only called for /completion")
        };
        let s = &g.stats;
        // a streamed answer sent them with its pieces
        let whole = !content.is_empty() || g.text.is_empty();
        LlamaCompletion {
            index,
            content,
            tokens: if *return_tokens { g.tokens.clone() } else { Vec::new() },
            stop: true,
            completion_probabilities: (self.logprobs && whole).then(|| super::logprobs::llama(&self.target, &g.probs)),
            timings: Some(Timings::from(s)),
            prompt_progress: None,
            end: Some(LlamaEnd {
                model: self.model.clone(),
                tokens_predicted: g.tokens.len(),
                tokens_evaluated: s.n_prompt,
                tokens_cached: s.n_prompt - s.n_prompt_decoded,
                stop_type: stop_type(g.finish),
                stopping_word: stopping_word(&self.target, g, stops),
                has_new_line: g.text.contains('\n'),
                truncated: false,
                prompt: self.prompt_texts.get(index).cloned().unwrap_or_default(),
                generation_settings: self.settings.clone(),
            }),
        }
    }
}

/// A chat's `finish_reason`: `tool_calls` when the answer ended with calls (not cut by a limit).
fn chat_finish(f: FinishReason, called: bool) -> &'static str {
    match finish_reason(f) {
        "stop" if called => "tool_calls",
        reason => reason,
    }
}

/// The stop string that ended `g`: the engine cuts the text where it begins.
pub(super) fn stopping_word(model: &Model, g: &Generation, stops: &[String]) -> String {
    if g.finish != FinishReason::Stop {
        return String::new();
    }
    let all = model.detokenize(&g.tokens, false);
    let rest = all.get(g.text.len()..).unwrap_or_default();
    stops
        .iter()
        .filter(|s| !s.is_empty() && rest.starts_with(s.as_str()))
        .min_by_key(|s| s.len()) // at one start, the shortest completes first
        .cloned()
        .unwrap_or_default()
}

pub(super) async fn collect(mut events: mpsc::Receiver<GenEvent>) -> Result<Generation, ApiError> {
    while let Some(e) = events.recv().await {
        match e {
            GenEvent::Tokens { .. } | GenEvent::Progress(_) => {}
            GenEvent::Done(g) => return Ok(*g),
            GenEvent::Error(e) => return Err(ApiError::Internal(e)),
        }
    }
    Err(ApiError::Internal("the generation ended without a result".into()))
}

fn event(v: &impl Serialize) -> Event {
    Event::default().data(serde_json::to_string(v).expect("response shapes serialize"))
}

fn done() -> Event {
    Event::default().data("[DONE]")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The numbers real clients send (`"temperature": 0.7`) reach every generation route's
    /// sampling fields, next to the route's own fields.
    #[test]
    fn fractional_numbers_parse_on_every_generation_route() {
        let sampling = r#""temperature": 0.7, "top_p": 0.95, "min_p": 1e-3, "repeat_penalty": 1.05, "seed": 3"#;
        let check = |f: SamplingFields| {
            assert_eq!((f.temperature, f.top_p, f.min_p, f.repeat_penalty), (Some(0.7), Some(0.95), Some(1e-3), Some(1.05)));
            assert_eq!(f.seed, Some(3));
        };
        let chat = format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 5, {sampling}}}"#);
        let req: ChatRequest = parse_body(chat.as_bytes()).unwrap();
        assert_eq!((req.messages.len(), req.max_tokens), (1, Some(5)));
        check(parse_body(chat.as_bytes()).unwrap());

        let text = format!(r#"{{"prompt": "hi", "max_tokens": 5, {sampling}}}"#);
        let req: CompletionRequest = parse_body(text.as_bytes()).unwrap();
        assert_eq!(req.max_tokens, Some(5));
        check(parse_body(text.as_bytes()).unwrap());

        let llama = format!(r#"{{"prompt": [1, 2], "n_predict": 5, "return_tokens": true, {sampling}}}"#);
        let req: LlamaCompletionRequest = parse_body(llama.as_bytes()).unwrap();
        assert!(req.prompt == Prompts(vec![vec![Part::Id(1), Part::Id(2)]]) && req.return_tokens);
        check(parse_body(llama.as_bytes()).unwrap());
    }

    /// A value of the wrong type is refused with the field's path as `param`.
    #[test]
    fn a_wrong_type_names_its_field() {
        let param = |body: &str| match parse_body::<SamplingFields>(body.as_bytes()) {
            Err(e) => e.body()["error"]["param"].clone(),
            Ok(f) => panic!("{body} parsed: {f:?}"),
        };
        assert_eq!(param(r#"{"temperature": "hot"}"#), "temperature");
        assert_eq!(param(r#"{"stop": ["a", 1]}"#), "stop");
        let e = parse_body::<ChatRequest>(br#"{"messages": [{"role": 7}]}"#).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "messages[0].role");
        let e = parse_body::<SamplingFields>(b"{\"top_p\": 0.5").unwrap_err();
        assert!(e.body()["error"]["param"].is_null() && e.to_string().starts_with("malformed JSON"), "{e}");
    }

    /// Mutated request bodies (bytes flipped, cut, numbers made extreme) never panic a parser, and
    /// every refusal has an error body. (The bodies a client controls are these bytes.)
    #[test]
    fn mutated_bodies_never_panic_the_parsers() {
        use rand::{Rng, SeedableRng};
        let seeds = [
            r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 5, "temperature": 0.7, "stop": ["a"], "stream": true}"#,
            r#"{"prompt": [1, 2, 3], "n_predict": -1, "top_p": 0.95, "min_p": 1e-3, "seed": -1, "return_tokens": true}"#,
            r#"{"content": "The quick brown fox", "add_special": true, "with_pieces": true}"#,
        ];
        let extreme = ["1e308", "-1e308", "18446744073709551616", "-0", "NaN", "1e-400", "[]", "{}", "null", "\"\\u0000\""];
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for i in 0..3000 {
            let mut body = seeds[i % seeds.len()].as_bytes().to_vec();
            for _ in 0..rng.gen_range(1..4) {
                let at = rng.gen_range(0..body.len());
                match rng.gen_range(0..3) {
                    0 => body[at] = rng.gen(),
                    1 => body.truncate(at),
                    _ => {
                        let e = extreme[rng.gen_range(0..extreme.len())].as_bytes();
                        body.splice(at..at, e.iter().copied());
                    }
                }
                if body.is_empty() {
                    break;
                }
            }
            let outcome = std::panic::catch_unwind(|| {
                let errors = [
                    parse_body::<ChatRequest>(&body).err(),
                    parse_body::<CompletionRequest>(&body).err(),
                    parse_body::<LlamaCompletionRequest>(&body).err(),
                    parse_body::<SamplingFields>(&body).err(),
                    parse_body::<TokenizeRequest>(&body).err(),
                ];
                errors.into_iter().flatten().all(|e| e.body()["error"]["message"].as_str().is_some_and(|m| !m.is_empty()))
            });
            assert!(outcome.is_ok_and(|ok| ok), "body {i} broke a parser: {}", String::from_utf8_lossy(&body));
        }
    }

    /// serde_json must be built without `arbitrary_precision` (a dependency can turn it on for the
    /// whole build, as gguf-rs did): with it, `1e-3` keeps its text instead of becoming a number.
    #[test]
    fn serde_json_reads_numbers_as_numbers() {
        let v: serde_json::Value = serde_json::from_str("1e-3").unwrap();
        assert_eq!(v.to_string(), "0.001", "serde_json's arbitrary_precision is on in this build");
    }
}
