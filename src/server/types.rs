//! Request and response shapes: OpenAI's (`/v1/...`) and llama-server's (`/completion`,
//! `/tokenize`, `/detokenize`, `/props`). Unknown request fields are ignored, as both do.
//!
//! No request type uses `#[serde(flatten)]` or holds a float inside an `#[serde(untagged)]` enum:
//! both buffer values through serde's `Content`, which loses the field path of an error and, were
//! serde_json's `arbitrary_precision` ever on in the build, sees every fractional number as a map.
//! Fields shared by several routes are a struct of their own, read from the same body (`Sampled`).
use super::prompt::Prompts;
use crate::engine::{FinishReason, Generation, PromptProgress, Stats};
use crate::llama::Token;
use serde::{Deserialize, Serialize};

// ---- requests ----

/// Sampling fields every generation endpoint takes (llama.cpp's names; OpenAI's are a subset),
/// read from the same body as the route's own request type.
#[derive(Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_k: Option<i32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repeat_last_n: Option<i32>,
    /// OpenAI's `{"id": bias}` or llama-server's `[[id or text, bias or false]]` (`fields::logit_bias`).
    pub logit_bias: Option<serde_json::Value>,
    /// llama.cpp's sampler order, checked against this server's (`fields::check_samplers`).
    pub samplers: Option<serde_json::Value>,
    /// Constrained output (`fields::grammar`): GBNF, a JSON schema, or OpenAI's response format.
    pub grammar: Option<String>,
    pub json_schema: Option<serde_json::Value>,
    pub response_format: Option<serde_json::Value>,
    /// Negative: a random seed (llama.cpp's -1).
    pub seed: Option<i64>,
    /// How drafts are verified at T > 0: `"match"` or `"reject"` (`--spec-sampling`).
    pub spec_sampling: Option<String>,
    pub stop: Option<Stop>,
    /// Extras of this server: draft from the context too (`--lookup`), and the longest
    /// suffix that look-up matches (`--lookup-ngram`).
    pub lookup: Option<bool>,
    pub lookup_ngram: Option<i64>,
    /// llama-server's slot choice: -1 (or none) for any; else that slot when it is free.
    pub id_slot: Option<i64>,
    /// llama-server's reporting while streaming: `timings` in every piece, and the prompt's
    /// progress (`prompt_progress`) before the first.
    pub timings_per_token: Option<bool>,
    pub return_progress: Option<bool>,
    /// llama-server's debugging aid: `__verbose` in the answer.
    pub verbose: Option<bool>,
    /// Generate past end-of-generation tokens: they are banned (llama-server's `-inf` biases).
    pub ignore_eos: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    /// Accepted and not checked: one model is served (llama-server does the same).
    pub model: Option<String>,
    pub messages: Vec<ChatMessageIn>,
    pub max_tokens: Option<i64>,
    /// OpenAI's newer name for `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<bool>,
    /// Alternatives per token (0..=20) with `logprobs`.
    pub top_logprobs: Option<i64>,
    /// OpenAI's tools, checked by `tools::Tools::new` (which names a malformed field's path).
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Whether the prompt ends with the assistant's turn opened (true unless set false).
    pub add_generation_prompt: Option<bool>,
    /// vLLM's and transformers' name for continuing a final assistant message (which a
    /// conversation ending with one asks for anyway, as in llama-server).
    pub continue_final_message: Option<bool>,
    /// Further template variables (Qwen3's `enable_thinking`), checked by `reasoning::Ask`.
    pub chat_template_kwargs: Option<serde_json::Value>,
    /// Where the answer's reasoning goes: `none`, `deepseek`, `deepseek-legacy` or `auto`.
    pub reasoning_format: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    /// `null` for an assistant turn that only called tools.
    pub content: Option<MessageContent>,
    /// The calls of an assistant turn.
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// The call a `tool` message answers, and the tool's name.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
    /// An earlier answer's reasoning (llama-server's field): given to the template, which
    /// writes it where the model expects it (Qwen3's `<think>`) or leaves it out.
    pub reasoning_content: Option<String>,
}

impl ChatMessageIn {
    /// A turn of `role` with text content (or none): what the Responses and Messages APIs'
    /// items become on the chat path.
    pub fn text(role: &str, content: Option<String>) -> Self {
        Self {
            role: role.to_string(),
            content: content.map(MessageContent::Text),
            tool_calls: None,
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct ToolCallIn {
    pub id: Option<String>,
    pub function: FunctionCallIn,
}

#[derive(Debug, Deserialize)]
pub struct FunctionCallIn {
    pub name: String,
    /// JSON text (OpenAI's shape) or an object.
    #[serde(default)]
    pub arguments: serde_json::Value,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// Accepted and not checked: one model is served.
    pub model: Option<String>,
    pub prompt: Prompts,
    pub max_tokens: Option<i64>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Log-probabilities of each token and this many alternatives (0..=5, OpenAI's legacy shape).
    pub logprobs: Option<i64>,
}

/// llama-server's `POST /completion`.
#[derive(Debug, Deserialize)]
pub struct LlamaCompletionRequest {
    pub prompt: Prompts,
    /// -1: until the end of generation or of the context.
    pub n_predict: Option<i64>,
    pub stream: Option<bool>,
    #[serde(default)]
    pub return_tokens: bool,
    /// Log-probabilities of each token and this many alternatives (`completion_probabilities`).
    pub n_probs: Option<i64>,
    /// Only these fields of the answer, by path (`generation_settings/n_predict`), each under
    /// its path as a key.
    #[serde(default)]
    pub response_fields: Vec<String>,
}

#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub content: String,
    #[serde(default)]
    pub add_special: bool,
    #[serde(default = "yes")]
    pub parse_special: bool,
    #[serde(default)]
    pub with_pieces: bool,
}

fn yes() -> bool {
    true
}

/// llama-server's `POST /infill` (code completion in editors).
#[derive(Debug, Deserialize)]
pub struct InfillRequest {
    #[serde(default)]
    pub input_prefix: String,
    #[serde(default)]
    pub input_suffix: String,
    /// Other files, as repository-level context before the prefix.
    #[serde(default)]
    pub input_extra: Vec<ExtraChunk>,
    /// Text after the prefix (llama-server places it before FIM_SUF).
    #[serde(default)]
    pub prompt: String,
    /// -1: until the end of generation or of the context.
    pub n_predict: Option<i64>,
    pub stream: Option<bool>,
    #[serde(default)]
    pub return_tokens: bool,
    pub n_probs: Option<i64>,
}

#[derive(Debug, Deserialize)]
pub struct ExtraChunk {
    #[serde(default = "tmp")]
    pub filename: String,
    pub text: String,
}

fn tmp() -> String {
    "tmp".into()
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub tokens: Vec<i64>,
}

// ---- responses ----

/// llama-server's `timings`, with the speculative counters.
#[derive(Debug, Serialize)]
pub struct Timings {
    /// Prompt tokens reused from the slot's cache (not decoded again).
    pub cache_n: usize,
    pub prompt_n: usize,
    pub prompt_ms: f64,
    pub prompt_per_token_ms: f64,
    pub prompt_per_second: f64,
    pub predicted_n: usize,
    pub predicted_ms: f64,
    pub predicted_per_token_ms: f64,
    pub predicted_per_second: f64,
    pub draft_n: usize,
    pub draft_n_accepted: usize,
    /// Of the drafted tokens accepted, those the drafter drafted and those look-up read off the
    /// context (this server's; the chat page shows them).
    pub draft_n_accepted_drafter: usize,
    pub draft_n_accepted_lookup: usize,
    /// Mean tokens committed per target verify.
    pub tau: f64,
    pub cycles: usize,
}

impl Timings {
    /// The timings while the prompt is decoded (nothing generated yet).
    pub fn of_progress(p: &PromptProgress) -> Self {
        let decoded = p.processed - p.cache;
        Self {
            cache_n: p.cache,
            prompt_n: decoded,
            prompt_ms: p.ms,
            prompt_per_token_ms: if decoded == 0 { 0.0 } else { p.ms / decoded as f64 },
            prompt_per_second: if p.ms <= 0.0 { 0.0 } else { decoded as f64 * 1e3 / p.ms },
            predicted_n: 0,
            predicted_ms: 0.0,
            predicted_per_token_ms: 0.0,
            predicted_per_second: 0.0,
            draft_n: 0,
            draft_n_accepted: 0,
            draft_n_accepted_drafter: 0,
            draft_n_accepted_lookup: 0,
            tau: 0.0,
            cycles: 0,
        }
    }
}

impl From<&Stats> for Timings {
    fn from(s: &Stats) -> Self {
        let per = |ms: f64, n: usize| if n == 0 { 0.0 } else { ms / n as f64 };
        let rate = |ms: f64, n: usize| if ms <= 0.0 { 0.0 } else { n as f64 * 1e3 / ms };
        let predicted_ms = (s.total_ms - s.prefill_ms).max(0.0);
        Self {
            cache_n: s.n_prompt - s.n_prompt_decoded,
            prompt_n: s.n_prompt_decoded,
            prompt_ms: s.prefill_ms,
            prompt_per_token_ms: per(s.prefill_ms, s.n_prompt_decoded),
            prompt_per_second: rate(s.prefill_ms, s.n_prompt_decoded),
            predicted_n: s.n_generated,
            predicted_ms,
            // the first token came from the prompt's last decode: the steps are one fewer
            predicted_per_token_ms: per(predicted_ms, s.n_generated.saturating_sub(1)),
            predicted_per_second: s.tokens_per_second(),
            draft_n: s.n_drafted,
            draft_n_accepted: s.n_draft_accepted,
            draft_n_accepted_drafter: s.from_drafter.accepted,
            draft_n_accepted_lookup: s.from_lookup.accepted,
            tau: s.tau(),
            cycles: s.cycles,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    /// The prompts (each answered by `per_prompt` choices in a row) and every completion.
    pub fn of(gens: &[Generation], per_prompt: usize) -> Self {
        let p = gens.iter().step_by(per_prompt.max(1)).map(|g| g.stats.n_prompt).sum::<usize>();
        let c = gens.iter().map(|g| g.tokens.len()).sum::<usize>();
        Self { prompt_tokens: p, completion_tokens: c, total_tokens: p + c }
    }
}

/// OpenAI's `finish_reason`.
pub fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length | FinishReason::Context => "length",
        FinishReason::Eog | FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}

/// llama-server's `stop_type`.
pub fn stop_type(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Eog => "eos",
        FinishReason::Stop => "word",
        FinishReason::Length | FinishReason::Context => "limit",
        FinishReason::Cancelled => "none",
    }
}

/// The envelope of OpenAI completions, whole or streamed: `chat.completion`,
/// `chat.completion.chunk` (choices [`ChatChoice`]) and `text_completion` ([`TextChoice`]).
#[derive(Debug, Serialize)]
pub struct Completion<C> {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: &'static str,
    pub choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_progress: Option<PromptProgress>,
    /// llama-server's debugging aid (`--verbose`, or `"verbose": true`): the prompt as decoded.
    #[serde(rename = "__verbose", skip_serializing_if = "Option::is_none")]
    pub verbose: Option<Verbose>,
}

#[derive(Debug, Serialize)]
pub struct Verbose {
    /// The prompt's tokens as text, special tokens written out.
    pub prompt: String,
    pub tokens_evaluated: usize,
}

pub type ChatCompletion = Completion<ChatChoice>;
pub type TextCompletion = Completion<TextChoice>;

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    /// The whole answer (`chat.completion`)...
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<ChatMessageOut>,
    /// ...or a piece of it (`chat.completion.chunk`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<ChatMessageOut>,
    pub finish_reason: Option<&'static str>,
    pub logprobs: Option<ChatLogprobs>,
}

#[derive(Debug, Default, Serialize)]
pub struct ChatMessageOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// Absent, `null` (the first chunk of a stream, as llama-server and OpenAI send it; an answer
    /// that only called tools) or text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<Option<String>>,
    /// The answer's thinking, split out of its content (llama-server's field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// One call of OpenAI's `tool_calls`; streamed deltas carry its `index`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments' JSON, as text.
    pub arguments: String,
}

#[derive(Debug, Serialize)]
pub struct TextChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<TextLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// OpenAI's chat `logprobs`: one entry per token.
#[derive(Debug, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatLogprob>,
    pub refusal: Option<()>,
}

/// One token's log-probability and its alternatives: OpenAI's chat entry, or llama-server's
/// `completion_probabilities` entry, which also carries the token ids.
#[derive(Debug, Serialize)]
pub struct ChatLogprob {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<Token>,
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Serialize)]
pub struct TopLogprob {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<Token>,
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// OpenAI's legacy completions `logprobs`.
#[derive(Debug, Default, Serialize)]
pub struct TextLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<serde_json::Map<String, serde_json::Value>>,
    pub text_offset: Vec<usize>,
}

/// llama-server's `/completion` answer; a streamed piece carries only the first fields.
#[derive(Debug, Serialize)]
pub struct LlamaCompletion {
    /// Which prompt of the request this answers.
    pub index: usize,
    pub content: String,
    pub tokens: Vec<Token>,
    pub stop: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_probabilities: Option<Vec<ChatLogprob>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_progress: Option<PromptProgress>,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub end: Option<LlamaEnd>,
}

impl LlamaCompletion {
    /// An empty streamed piece of prompt `index`'s answer, for the fields to fill.
    pub fn piece(index: usize) -> Self {
        Self {
            index,
            content: String::new(),
            tokens: Vec::new(),
            stop: false,
            completion_probabilities: None,
            timings: None,
            prompt_progress: None,
            end: None,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct LlamaEnd {
    pub model: String,
    pub tokens_predicted: usize,
    pub tokens_evaluated: usize,
    pub tokens_cached: usize,
    pub stop_type: &'static str,
    pub stopping_word: String,
    /// Whether the answer holds a line break (llama-server's, read by editor plug-ins).
    pub has_new_line: bool,
    /// Always false: a prompt over the context is refused, never cut.
    pub truncated: bool,
    /// The prompt as text, special tokens written out.
    pub prompt: String,
    /// The request's settings, as `/slots` shows them.
    pub generation_settings: SlotParams,
}

#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub aliases: Vec<String>,
    pub tags: Vec<String>,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub meta: ModelMeta,
}

#[derive(Debug, Serialize)]
pub struct ModelMeta {
    pub n_vocab: usize,
    pub n_ctx: usize,
    pub drafter: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Tokens {
    pub tokens: Vec<TokenOut>,
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum TokenOut {
    Id(Token),
    WithPiece { id: Token, piece: Piece },
}

/// A token's text, or its bytes when they are not UTF-8 on their own.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Piece {
    Text(String),
    Bytes(Vec<u8>),
}

#[derive(Debug, Serialize)]
pub struct Content {
    pub content: String,
}

/// `GET /props`.
#[derive(Debug, Serialize)]
pub struct Props {
    pub default_generation_settings: GenerationSettings,
    pub total_slots: usize,
    pub model_path: String,
    pub drafter_path: Option<String>,
    pub chat_template: String,
    pub build_info: String,
}

/// `POST /apply-template`'s answer.
#[derive(Debug, Serialize)]
pub struct PromptText {
    pub prompt: String,
}

/// `POST /v1/chat/completions/input_tokens`'s answer.
#[derive(Debug, Serialize)]
pub struct InputTokens {
    pub object: &'static str,
    pub input_tokens: usize,
}

#[derive(Debug, Serialize)]
pub struct GenerationSettings {
    pub n_ctx: usize,
    pub params: SamplingDefaults,
    pub speculative: Speculative,
}

/// The default sampling settings, as llama-server's `/props` shows them.
#[derive(Debug, Serialize)]
pub struct SamplingDefaults {
    pub n_predict: i64,
    #[serde(flatten)]
    pub sampling: crate::sampling::SamplingParams,
}

/// One slot of `GET /slots`, in llama-server's shape: a slot that never took a request has no
/// `id_task`, `params` or `next_token` (llama-server leaves them out).
#[derive(Debug, Serialize)]
pub struct SlotOut {
    pub id: usize,
    pub n_ctx: usize,
    /// Whether the slot's request drafts (a drafter or context look-up).
    pub speculative: bool,
    pub is_processing: bool,
    #[serde(flatten)]
    pub task: Option<SlotTask>,
}

/// The request a slot took last.
#[derive(Debug, Serialize)]
pub struct SlotTask {
    pub id_task: i64,
    pub n_prompt_tokens: usize,
    pub params: SlotParams,
    /// One entry, as llama-server sends it.
    pub next_token: [NextToken; 1],
}

/// A slot's request settings, with llama-server's names.
#[derive(Debug, Clone, Serialize)]
pub struct SlotParams {
    pub n_predict: i64,
    #[serde(flatten)]
    pub sampling: crate::sampling::SamplingParams,
    pub stop: Vec<String>,
    pub n_probs: usize,
    pub grammar: String,
    pub samplers: [&'static str; 5],
    /// Tokens drafted per cycle at most (llama-server's `speculative.n_max`).
    #[serde(rename = "speculative.n_max")]
    pub speculative_n_max: usize,
    #[serde(rename = "speculative.n_min")]
    pub speculative_n_min: usize,
    #[serde(rename = "speculative.select")]
    pub speculative_select: &'static str,
}

#[derive(Debug, Serialize)]
pub struct NextToken {
    pub has_next_token: bool,
    pub has_new_line: bool,
    pub n_remain: i64,
    pub n_decoded: usize,
}

#[derive(Debug, Serialize)]
pub struct Speculative {
    pub select: &'static str,
    pub block: usize,
    /// Draft lengths chosen per cycle from measured costs (`--block auto`).
    pub adaptive: bool,
    pub tree_budget: usize,
    pub lookup: bool,
    pub lookup_ngram: usize,
}
