//! The handlers: small functions over typed requests. A generation request is checked,
//! turned into tokens and [`GenerateOptions`], submitted to the scheduler as a job, and
//! answered by a [`Reply`] in its endpoint's shape (`reply`): request -> job -> reply.
use super::errors::ApiError;
use super::prompt::{Part, Prompts};
use super::reasoning::{Ask, Reasoning};
use super::reply::{drafts, now, slot_params, Reply, Report, Shape};
use super::scheduler::{GenEvent, GenRequest, QueueFull};
use super::tools::{self, Tools};
use super::types::*;
use super::AppState;
use crate::draft::config::SelectMode;
use crate::engine::{GenerateOptions, Generation, Verifier};
use crate::llama::{LlamaError, Model, Token};
use crate::sampling::SamplingParams;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::http::{header, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use std::sync::Arc;
use tokio::sync::mpsc;

type Shared = State<Arc<AppState>>;

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

/// `GET /`: the chat page, one file built into the binary.
pub async fn webui() -> axum::response::Html<&'static str> {
    axum::response::Html(include_str!("webui.html"))
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
    let (d, p) = (&s.defaults.draft, &s.defaults.sampling);
    let (block, adaptive) = d.block.resolve(s.scheduler.info().trained_block);
    Json(Props {
        default_generation_settings: GenerationSettings {
            n_ctx: s.n_ctx(),
            params: SamplingDefaults { n_predict: s.defaults.n_predict.map_or(-1, |n| n as i64), sampling: p.clone() },
            speculative: Speculative {
                select: d.select_name(),
                block,
                adaptive,
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
                params: slot_params(&o, s.scheduler.info().trained_block),
            }),
        })
        .collect();
    Ok(Json(slots))
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
    let ask = Ask::of(&s, req.chat_template_kwargs.as_ref(), req.reasoning_format.as_deref())?;
    let (prompt, reasoning) = chat_prompt(&s, req.messages, tools.as_ref(), open_turn, &ask).await?;
    if let Some(r) = &reasoning {
        r.constrain(&mut opts);
    }
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    let shape = Shape::Chat { include_usage, tools: tools.filter(Tools::active), reasoning };
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
    let progress = reply.takes(s.model(), &prompts, n);
    let events = submit(s, &prompts, opts, n, slot, stream && progress)?;
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
    // choice i draws from stream i of the seed (one stream would give n copies of one answer).
    let mut events = Vec::with_capacity(prompts.len() * n);
    for prompt in prompts {
        for i in 0..n {
            let mut opts = opts.clone();
            opts.sampling.choice = i as u64;
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
        choice: 0,
    };
    super::fields::check_samplers(f.samplers.as_ref(), &sampling)?;
    let grammar = super::fields::grammar(f.grammar.as_deref(), f.json_schema.as_ref(), f.response_format.as_ref(), s.model())?;
    let lookup = f.lookup.unwrap_or(s.defaults.draft.lookup);
    let max_ngram = crate::draft::lookup::MAX_NGRAM as i64;
    let lookup_ngram = match f.lookup_ngram {
        None => s.defaults.draft.lookup_ngram,
        Some(n) if (1..=max_ngram).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::invalid_param("lookup_ngram", format!("`lookup_ngram` must be between 1 and {max_ngram}, got {n}")))
        }
    };
    let mut draft = s.defaults.draft.clone();
    (draft.lookup, draft.lookup_ngram) = (lookup, lookup_ngram);
    // A server started without a drafter decodes plainly unless a request asks for look-up.
    if draft.select == SelectMode::None && lookup {
        draft.select = SelectMode::Greedy;
    }
    let verifier = match f.spec_sampling.as_deref() {
        None => s.defaults.verifier,
        Some(v) => <Verifier as clap::ValueEnum>::from_str(v, false).map_err(|_| {
            ApiError::invalid_param("spec_sampling", format!("`spec_sampling` must be \"match\" or \"reject\", got {v:?}"))
        })?,
    };
    Ok(GenerateOptions {
        n_predict,
        draft,
        stop: stop_strings(f.stop)?,
        sampling,
        grammar,
        verifier,
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
    let ask = Ask::of(&s, req.chat_template_kwargs.as_ref(), None)?.prompt_only();
    let (prompt, _) = render_chat(&s, req.messages, tools.as_ref(), open_turn, &ask)?;
    Ok(Json(PromptText { prompt }))
}

/// `POST /v1/chat/completions/input_tokens` (llama-server's): how many prompt tokens a chat
/// request's body would decode.
pub async fn chat_input_tokens(State(s): Shared, ApiJson(req): ApiJson<ChatRequest>) -> Result<Json<InputTokens>, ApiError> {
    let tools = chat_tools(&s, &req)?;
    let open_turn = generation_prompt(&req)?;
    let ask = Ask::of(&s, req.chat_template_kwargs.as_ref(), None)?.prompt_only();
    let (prompt, _) = chat_prompt(&s, req.messages, tools.as_ref(), open_turn, &ask).await?;
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

/// The prompt tokens of a chat request, rendered with the served template, and the split of
/// its answer (`reasoning`); `open_turn`: end with the assistant's turn opened (a final
/// assistant message is continued either way).
pub(super) async fn chat_prompt(
    s: &AppState,
    messages: Vec<ChatMessageIn>,
    tools: Option<&Tools>,
    open_turn: bool,
    ask: &Ask,
) -> Result<(Vec<Token>, Option<Reasoning>), ApiError> {
    let (text, reasoning) = render_chat(s, messages, tools, open_turn, ask)?;
    let model = s.model().clone();
    Ok((blocking(move || model.tokenize(&text, true, true)).await?, reasoning))
}

/// The chat prompt text, with the request's tools and template variables, and the split of its
/// answer. A conversation that ends with an assistant message asks for that message to be
/// continued (llama-server's assistant prefill): the turns before it are rendered with the
/// assistant's turn opened, and its text follows (that answer is not split).
fn render_chat(
    s: &AppState,
    messages: Vec<ChatMessageIn>,
    tools: Option<&Tools>,
    open_turn: bool,
    ask: &Ask,
) -> Result<(String, Option<Reasoning>), ApiError> {
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
    let budget = s.defaults.reasoning_budget.as_ref().map(|(n, message)| (*n, message.as_str()));
    let reasoning = match ask.format {
        Some(format) if prefill.is_none() => match s.template.answer_parser(&messages, &ask.vars, open_turn, format.name()) {
            Ok(parser) => parser.map(|parser| Reasoning::new(s.model(), parser, format, budget)),
            // minijinja's rendering below speaks for the template; without llama.cpp's, the
            // answer is not split
            Err(e) => {
                tracing::warn!("llama.cpp cannot render this chat ({e}); its answer is not split into reasoning and content");
                None
            }
        },
        _ => None,
    };
    if let Some(t) = tools {
        t.describe(&mut messages);
    }
    let list = tools.filter(|_| native).map(|t| t.list.as_slice());
    let text = s.template.render_with_tools(&messages, list, open_turn || prefill.is_some(), &ask.vars).map_err(template_refused)?;
    Ok((text + prefill.as_deref().unwrap_or_default(), reasoning))
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
