//! Reply shaping: one generation's answer in its endpoint's shape (OpenAI's chat and text
//! completions, llama-server's `/completion`), whole or as server-sent events.
use super::errors::ApiError;
use super::reasoning::Reasoning;
use super::scheduler::GenEvent;
use super::tools::{self, Tools};
use super::types::*;
use super::AppState;
use crate::draft::config::SelectMode;
use crate::engine::{FinishReason, GenerateOptions, Generation, PromptProgress};
use crate::llama::{Model, Token};
use crate::sampling::TokenProb;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{stream, StreamExt};
use serde::Serialize;
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::mpsc;

/// OpenAI's `system_fingerprint`: which build answered (llama-server sends its build id).
const SYSTEM_FINGERPRINT: &str = concat!("dflash2-", env!("CARGO_PKG_VERSION"));

pub fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Whether a request's options draft (a drafter or context look-up).
pub(super) fn drafts(o: &GenerateOptions) -> bool {
    o.draft.select != SelectMode::None || o.draft.lookup
}

/// A request's settings with llama-server's names (`/slots`, `generation_settings`), for a
/// drafter trained on blocks of `trained`.
pub(super) fn slot_params(o: &GenerateOptions, trained: Option<usize>) -> SlotParams {
    let (block, _) = o.draft.block.resolve(trained);
    SlotParams {
        n_predict: o.n_predict as i64,
        speculative_n_max: if drafts(o) { block.saturating_sub(1) } else { 0 },
        speculative_n_min: 0,
        speculative_select: o.draft.select_name(),
        sampling: o.sampling.clone(),
        stop: o.stop.clone(),
        n_probs: o.n_probs.unwrap_or(0),
        grammar: o.grammar.clone().unwrap_or_default(),
        samplers: super::fields::SAMPLERS,
    }
}

/// Which endpoint's shapes a reply takes.
pub(super) enum Shape {
    /// `tools`: tool calls are parsed out of the answer; `reasoning`: its thinking is split out.
    Chat { include_usage: bool, tools: Option<Tools>, reasoning: Option<Reasoning> },
    Text { include_usage: bool },
    /// `several`: the request held several prompts (answered as a list); `fields`: only these
    /// fields of each end (llama-server's `response_fields`).
    Llama { return_tokens: bool, stops: Vec<String>, several: bool, fields: Vec<String> },
}

/// llama-server's reporting fields of a request.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Report {
    /// `timings_per_token`: every streamed piece carries the timings so far.
    timings_per_token: bool,
    /// `return_progress`: a streamed answer first tells how far its prompt is.
    progress: bool,
    /// `__verbose` in a whole OpenAI answer (`--verbose`, or the request's `verbose`).
    verbose: bool,
}

impl Report {
    pub(super) fn of(s: &AppState, f: &SamplingFields) -> Self {
        Self {
            timings_per_token: f.timings_per_token == Some(true),
            progress: f.return_progress == Some(true),
            verbose: f.verbose.unwrap_or(s.verbose),
        }
    }
}

/// How one generation is answered: its endpoint's shapes and the ids its pieces share.
pub(super) struct Reply {
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
    pub(super) fn new(s: &AppState, prefix: &str, shape: Shape, opts: &GenerateOptions, report: Report) -> Self {
        Self {
            shape,
            id: format!("{prefix}-{:016x}", rand::random::<u64>()),
            created: now(),
            model: s.model_id().to_string(),
            target: s.model().clone(),
            logprobs: opts.n_probs.is_some(),
            report,
            settings: slot_params(opts, s.scheduler.info().trained_block),
            per_prompt: 1,
            prompt_texts: Vec::new(),
            prompt_lens: Vec::new(),
            streamed_chars: Default::default(),
            tool_text: Default::default(),
        }
    }

    /// The answer is to `prompts`, `n` choices each; whether a streamed answer reports their
    /// decoding's progress.
    pub(super) fn takes(&mut self, model: &Model, prompts: &[Vec<Token>], n: usize) -> bool {
        self.per_prompt = n;
        if matches!(self.shape, Shape::Llama { .. }) || self.report.verbose {
            self.prompt_texts = prompts.iter().map(|p| model.detokenize(p, true)).collect();
            self.prompt_lens = prompts.iter().map(Vec::len).collect();
        }
        self.report.progress
    }

    fn chat_logprobs(&self, probs: &[TokenProb]) -> Option<ChatLogprobs> {
        self.logprobs.then(|| super::logprobs::chat(&self.target, probs))
    }

    fn text_logprobs(&self, probs: &[TokenProb], offset: usize) -> Option<TextLogprobs> {
        self.logprobs.then(|| super::logprobs::text(&self.target, probs, offset))
    }

    /// The whole answer: one choice per generation (`n`), in order.
    pub(super) fn whole(&self, gens: &[Generation]) -> Response {
        let usage = Some(Usage::of(gens, self.per_prompt));
        let timings = Some(Timings::from(&gens[0].stats));
        match &self.shape {
            Shape::Chat { tools, reasoning, .. } => {
                let choices = gens
                    .iter()
                    .enumerate()
                    .map(|(i, g)| {
                        let (reasoning_content, parsed) = super::reasoning::answer(reasoning.as_ref(), tools.as_ref(), &g.text);
                        let (content, tool_calls) = (parsed.content, Some(parsed.calls).filter(|c| !c.is_empty()));
                        let finish_reason = Some(chat_finish(g.finish, tool_calls.is_some()));
                        let message = ChatMessageOut { role: Some("assistant"), content: Some(content), reasoning_content, tool_calls };
                        ChatChoice {
                            index: i as u32,
                            finish_reason,
                            message: Some(message),
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
    pub(super) fn stream(self, events: Vec<mpsc::Receiver<GenEvent>>) -> Response {
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
            Shape::Chat { tools, reasoning, .. } => {
                let (thought, text) = match reasoning {
                    None => (String::new(), text),
                    Some(r) => {
                        let split = r.piece(index, &text);
                        (split.reasoning_content, split.content)
                    }
                };
                let text = match tools {
                    None => text,
                    Some(t) => self.shown_content(t, index, &text),
                };
                if text.is_empty() && thought.is_empty() && !with_probs {
                    return None;
                }
                // a piece of thinking alone carries no `content`, as llama-server's
                let content = Some(text).filter(|t| !t.is_empty() || thought.is_empty());
                let mut chunk = self.chat_delta(index, None, content.map(Some), None, timings);
                chunk.choices[0].logprobs = self.chat_logprobs(&probs);
                if let Some(delta) = &mut chunk.choices[0].delta {
                    delta.reasoning_content = Some(thought).filter(|t| !t.is_empty());
                }
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
            Shape::Chat { tools, reasoning, .. } => {
                // What the split held back (a tag it could not yet tell), then the rest of the
                // content, then the calls whole, then the end.
                let mut out = Vec::new();
                let mut text = g.text.clone();
                if let Some(r) = reasoning {
                    let rest = r.rest(index);
                    if !rest.reasoning_content.is_empty() {
                        let mut chunk = self.chat_delta(index, None, None, None, None);
                        if let Some(delta) = &mut chunk.choices[0].delta {
                            delta.reasoning_content = Some(rest.reasoning_content);
                        }
                        out.push(event(&chunk));
                    }
                    if tools.is_none() && !rest.content.is_empty() {
                        out.push(event(&self.chat_delta(index, None, Some(Some(rest.content)), None, None)));
                    }
                    text = r.whole(&g.text).content;
                }
                let Some(t) = tools else {
                    out.push(event(&self.chat_delta(index, None, None, reason, timings)));
                    return out;
                };
                let parsed = t.parse(&text);
                let held = self.tool_text.lock().expect("never poisoned: no panics inside").get(index).cloned().unwrap_or_default();
                let rest = parsed.content.as_deref().map(|c| held.rest(c)).unwrap_or_default();
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
        let delta = ChatMessageOut { role, content, ..Default::default() };
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

fn event(v: &impl Serialize) -> Event {
    Event::default().data(serde_json::to_string(v).expect("response shapes serialize"))
}

fn done() -> Event {
    Event::default().data("[DONE]")
}

