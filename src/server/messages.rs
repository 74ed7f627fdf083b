//! `POST /v1/messages`: Anthropic's Messages API (which coding agents speak), mapped onto the
//! chat path as llama-server maps it: `system` and `messages` (text, `tool_use` and
//! `tool_result` blocks) become chat messages, `stop_sequences` the stop strings, `tools` chat
//! tools; the answer is a `message` with content blocks, or its stream of events
//! (`message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`).
//! A reasoning model's thinking comes first, as a `thinking` block (`thinking_delta`).
use super::errors::ApiError;
use super::reply::stopping_word;
use super::reasoning::{self, Ask, Reasoning};
use super::routes::{chat_prompt, collect, options, preferred_slot, submit, ApiJson, Sampled};
use super::scheduler::GenEvent;
use super::tools::{self, ContentStream, Parsed, Tools};
use super::types::{ChatMessageIn, FunctionCallIn, Stop, ToolCallIn};
use super::AppState;
use crate::engine::{FinishReason, Generation};
use crate::llama::Model;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream;
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::mpsc;

#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    /// Accepted and not checked: one model is served.
    pub model: Option<String>,
    /// A text, or a list of text blocks.
    pub system: Option<Value>,
    /// Checked by [`conversation`], which names a wrong block's path.
    pub messages: Value,
    pub max_tokens: Option<i64>,
    pub stop_sequences: Option<Vec<String>>,
    pub stream: Option<bool>,
    /// `[{"name", "description", "input_schema"}]`.
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
}

pub async fn messages(State(s): State<Arc<AppState>>, Sampled(req, mut sampling): Sampled<MessagesRequest>) -> Result<Response, ApiError> {
    let (conversation, tools) = chat_request(&s, &req)?;
    if let Some(stops) = req.stop_sequences.clone() {
        sampling.stop = Some(Stop::Many(stops));
    }
    let slot = preferred_slot(&s, sampling.id_slot)?;
    let mut opts = options(&s, sampling, req.max_tokens, "max_tokens")?;
    if let Some(t) = &tools {
        t.constrain(&mut opts)?;
    }
    let (prompt, reasoning) = chat_prompt(&s, conversation, tools.as_ref(), true, &Ask::of(&s, None, None)?).await?;
    if let Some(r) = &reasoning {
        r.constrain(&mut opts);
    }
    let n_prompt = prompt.len();
    let stops = opts.stop.clone();
    let mut events = submit(&s, &[prompt], opts, 1, slot, false)?;
    let rx = events.pop().ok_or_else(|| ApiError::Internal("no generation was queued".into()))?;
    let answer = Answer {
        id: format!("msg_{:016x}", rand::random::<u64>()),
        model: s.model_id().to_string(),
        target: s.model().clone(),
        stops,
        tools: tools.filter(Tools::active),
        reasoning,
    };
    match req.stream.unwrap_or(false) {
        true => Ok(answer.stream(rx, n_prompt)),
        false => Ok(Json(answer.message(&collect(rx).await?)).into_response()),
    }
}

/// `POST /v1/messages/count_tokens`: how many prompt tokens a Messages request would decode.
pub async fn count_tokens(State(s): State<Arc<AppState>>, ApiJson(req): ApiJson<MessagesRequest>) -> Result<Json<Value>, ApiError> {
    let (conversation, tools) = chat_request(&s, &req)?;
    let (prompt, _) = chat_prompt(&s, conversation, tools.as_ref(), true, &Ask::of(&s, None, None)?.prompt_only()).await?;
    Ok(Json(json!({ "input_tokens": prompt.len() })))
}

/// A Messages request as the chat path takes it: its conversation and its tools.
fn chat_request(s: &AppState, req: &MessagesRequest) -> Result<(Vec<ChatMessageIn>, Option<Tools>), ApiError> {
    let tools = Tools::new(
        chat_tools(req.tools.as_ref())?.as_ref(),
        req.tool_choice.as_ref().map(chat_tool_choice).transpose()?.as_ref(),
        None,
        tools::Format::of(&s.template),
    )?;
    Ok((conversation(req.system.as_ref(), &req.messages)?, tools))
}

/// Anthropic's tools (`{"name", "description", "input_schema"}`) in chat's shape.
fn chat_tools(tools: Option<&Value>) -> Result<Option<Value>, ApiError> {
    tools::foreign_tools(tools, |i, t| match t.get("type").and_then(Value::as_str) {
        None | Some("custom") => {
            let mut function = json!({ "name": t["name"], "parameters": t.get("input_schema").cloned().unwrap_or_else(|| json!({})) });
            if let Some(d) = t.get("description") {
                function["description"] = d.clone();
            }
            Ok(json!({ "type": "function", "function": function }))
        }
        Some(other) => Err(ApiError::invalid_param(
            format!("tools[{i}].type"),
            format!("`tools[{i}].type` {other:?}: client tools are offered, not Anthropic's server tools"),
        )),
    })
}

/// `{"type": "auto" | "any" | "tool" | "none"}` as chat's `tool_choice`.
fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice.get("type").and_then(Value::as_str) {
        Some("auto") => Ok(json!("auto")),
        Some("any") => Ok(json!("required")),
        Some("none") => Ok(json!("none")),
        Some("tool") => Ok(json!({ "type": "function", "function": { "name": choice["name"] } })),
        _ => Err(ApiError::invalid_param("tool_choice.type", "`tool_choice.type` must be auto, any, tool or none")),
    }
}

/// The chat conversation of `system` and `messages`: a turn's text blocks become its text, its
/// `tool_use` blocks an assistant's calls, its `tool_result` blocks `tool` messages (before the
/// turn's text, right after the calls they answer, where chat templates expect them).
fn conversation(system: Option<&Value>, messages: &Value) -> Result<Vec<ChatMessageIn>, ApiError> {
    let mut out = Vec::new();
    if let Some(system) = system.filter(|s| !s.is_null()) {
        out.push(ChatMessageIn::text("system", Some(texts(system, "system")?)));
    }
    let list = messages.as_array().filter(|l| !l.is_empty());
    let list = list.ok_or_else(|| ApiError::invalid_param("messages", "`messages` must be a non-empty list of messages"))?;
    for (i, m) in list.iter().enumerate() {
        let role = match m.get("role").and_then(Value::as_str) {
            Some(role @ ("user" | "assistant")) => role,
            other => return Err(ApiError::invalid_param(format!("messages[{i}].role"), format!("`messages[{i}].role` {other:?}: give user or assistant"))),
        };
        let path = format!("messages[{i}].content");
        let blocks = match &m["content"] {
            Value::String(text) => {
                out.push(ChatMessageIn::text(role, Some(text.clone())));
                continue;
            }
            Value::Array(blocks) => blocks,
            _ => return Err(ApiError::invalid_param(&path, format!("`{path}` must be a text or a list of content blocks"))),
        };
        let (mut text, mut calls, mut reasoning) = (None::<String>, Vec::new(), None::<String>);
        for (j, b) in blocks.iter().enumerate() {
            let path = format!("{path}[{j}]");
            let field = |name: &str| {
                b.get(name).and_then(Value::as_str).map(str::to_string).ok_or_else(|| ApiError::invalid_param(format!("{path}.{name}"), format!("`{path}.{name}` must be a text")))
            };
            match b.get("type").and_then(Value::as_str) {
                Some("text") => text.get_or_insert_with(String::new).push_str(&field("text")?),
                Some("tool_use") if role == "assistant" => calls.push(ToolCallIn {
                    id: Some(field("id")?),
                    function: FunctionCallIn { name: field("name")?, arguments: b.get("input").cloned().unwrap_or_else(|| json!({})) },
                }),
                Some("tool_result") if role == "user" => {
                    let result = match b.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(content) => texts(content, &format!("{path}.content"))?,
                    };
                    out.push(ChatMessageIn { tool_call_id: Some(field("tool_use_id")?), ..ChatMessageIn::text("tool", Some(result)) });
                }
                // A former answer's reasoning, as llama-server passes it: the template writes it
                // where its model expects it, or leaves it out.
                Some("thinking") if role == "assistant" => reasoning.get_or_insert_with(String::new).push_str(&field("thinking")?),
                Some("redacted_thinking") if role == "assistant" => {}
                kind => {
                    return Err(ApiError::invalid_param(
                        &path,
                        format!("a {role}'s content block of type {kind:?} is not supported: the model reads text (and tool_use / tool_result blocks)"),
                    ))
                }
            }
        }
        if text.is_some() || !calls.is_empty() || reasoning.is_some() {
            out.push(ChatMessageIn {
                tool_calls: (!calls.is_empty()).then_some(calls),
                reasoning_content: reasoning,
                ..ChatMessageIn::text(role, text)
            });
        }
    }
    Ok(out)
}

/// A text, or the texts of a list of text blocks, joined.
fn texts(value: &Value, path: &str) -> Result<String, ApiError> {
    match value {
        Value::String(t) => Ok(t.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .enumerate()
            .map(|(j, b)| match (b["type"].as_str(), b["text"].as_str()) {
                (Some("text"), Some(t)) => Ok(t),
                (kind, _) => Err(ApiError::invalid_param(format!("{path}[{j}]"), format!("a block of type {kind:?} is not supported here: give text blocks"))),
            })
            .collect(),
        _ => Err(ApiError::invalid_param(path, format!("`{path}` must be a text or a list of text blocks"))),
    }
}

/// One message being answered: its id, the stop strings whose match it reports, the tools its
/// calls are parsed for and the split of its thinking.
struct Answer {
    id: String,
    model: String,
    target: Arc<Model>,
    stops: Vec<String>,
    tools: Option<Tools>,
    reasoning: Option<Reasoning>,
}

impl Answer {
    /// The answer's thinking (if any) and its content and calls.
    fn parse(&self, g: &Generation) -> (Option<String>, Parsed) {
        reasoning::answer(self.reasoning.as_ref(), self.tools.as_ref(), &g.text)
    }

    /// Anthropic's `stop_reason` and `stop_sequence`.
    fn stop(&self, g: &Generation, parsed: &Parsed) -> (&'static str, Option<String>) {
        match g.finish {
            FinishReason::Length | FinishReason::Context => ("max_tokens", None),
            _ if !parsed.calls.is_empty() => ("tool_use", None),
            FinishReason::Stop => ("stop_sequence", Some(stopping_word(&self.target, g, &self.stops)).filter(|w| !w.is_empty())),
            _ => ("end_turn", None),
        }
    }

    /// The content blocks of a finished answer: its thinking, its text, then its calls.
    fn blocks(thought: Option<&str>, parsed: &Parsed) -> Vec<Value> {
        let thought = thought.map(|t| json!({ "type": "thinking", "thinking": t, "signature": "" }));
        let text = parsed.content.iter().filter(|c| !c.is_empty()).map(|c| json!({ "type": "text", "text": c }));
        let calls = parsed.calls.iter().map(|c| {
            let input: Value = serde_json::from_str(&c.function.arguments).unwrap_or_else(|_| json!({}));
            json!({ "type": "tool_use", "id": c.id, "name": c.function.name, "input": input })
        });
        thought.into_iter().chain(text).chain(calls).collect()
    }

    fn usage(g: &Generation) -> Value {
        let cached = g.stats.n_prompt - g.stats.n_prompt_decoded;
        json!({ "input_tokens": g.stats.n_prompt_decoded, "cache_read_input_tokens": cached, "output_tokens": g.tokens.len() })
    }

    fn message(&self, g: &Generation) -> Value {
        let (thought, parsed) = self.parse(g);
        let (stop_reason, stop_sequence) = self.stop(g, &parsed);
        let content = Self::blocks(thought.as_deref(), &parsed);
        json!({ "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": Self::usage(g) })
    }

    /// Anthropic's events: the message opened, its text block as it comes (opened at its first
    /// piece), the calls whole as `tool_use` blocks, then the stop reason and the end.
    fn stream(self, rx: mpsc::Receiver<GenEvent>, n_prompt: usize) -> Response {
        let state = Streaming { answer: self, started: false, thinking: None, text_open: false, content: ContentStream::default(), done: false };
        let body = stream::unfold((Some(rx), state), move |(rx, mut st)| async move {
            let mut rx = rx?;
            let events = if !std::mem::replace(&mut st.started, true) {
                let message = json!({ "id": st.answer.id, "type": "message", "role": "assistant", "model": st.answer.model, "content": [],
                    "stop_reason": null, "stop_sequence": null,
                    "usage": { "input_tokens": n_prompt, "cache_read_input_tokens": 0, "output_tokens": 0 } });
                vec![event("message_start", json!({ "message": message }))]
            } else {
                match rx.recv().await {
                    Some(GenEvent::Tokens { text, .. }) => st.piece(&text),
                    Some(GenEvent::Progress(_)) => Vec::new(), // never asked for here
                    Some(GenEvent::Done(g)) => st.finish(&g),
                    Some(GenEvent::Error(e)) => st.failure(ApiError::Internal(e)),
                    None => st.failure(ApiError::Internal("the generation ended without a result".into())),
                }
            };
            let rx = (!st.done).then_some(rx);
            Some((stream::iter(events.into_iter().map(Ok::<_, Infallible>)), (rx, st)))
        });
        Sse::new(futures_util::StreamExt::flatten(body)).keep_alive(KeepAlive::default()).into_response()
    }
}

fn event(kind: &str, mut data: Value) -> Event {
    data["type"] = kind.into();
    Event::default().event(kind).data(data.to_string())
}

/// A stream in progress: whether `message_start` went out, whether the thinking block is open
/// (`Some(true)`; `Some(false)`: it was, it is closed) and the text block is.
struct Streaming {
    answer: Answer,
    started: bool,
    thinking: Option<bool>,
    text_open: bool,
    content: ContentStream,
    done: bool,
}

impl Streaming {
    /// Where the text block is: after the thinking's, if any.
    fn text_index(&self) -> usize {
        usize::from(self.thinking.is_some())
    }

    /// Thinking, as a delta of block 0 (opened at its first piece).
    fn think(&mut self, delta: &str) -> Vec<Event> {
        if delta.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        if self.thinking.replace(true).is_none() {
            out.push(event("content_block_start", json!({ "index": 0, "content_block": { "type": "thinking", "thinking": "", "signature": "" } })));
        }
        out.push(event("content_block_delta", json!({ "index": 0, "delta": { "type": "thinking_delta", "thinking": delta } })));
        out
    }

    /// The thinking block's end, once, when it is open.
    fn close_thinking(&mut self) -> Vec<Event> {
        match self.thinking {
            Some(true) => {
                self.thinking = Some(false);
                vec![event("content_block_stop", json!({ "index": 0 }))]
            }
            _ => Vec::new(),
        }
    }

    /// Text the answer surely holds, as a delta of the text block (the thinking ends there).
    fn text(&mut self, delta: &str) -> Vec<Event> {
        if delta.is_empty() {
            return Vec::new();
        }
        let mut out = self.close_thinking();
        let index = self.text_index();
        if !std::mem::replace(&mut self.text_open, true) {
            out.push(event("content_block_start", json!({ "index": index, "content_block": { "type": "text", "text": "" } })));
        }
        out.push(event("content_block_delta", json!({ "index": index, "delta": { "type": "text_delta", "text": delta } })));
        out
    }

    fn piece(&mut self, text: &str) -> Vec<Event> {
        let (thought, text) = reasoning::streamed(self.answer.reasoning.as_ref(), text);
        let mut out = self.think(&thought);
        let shown = match &self.answer.tools {
            Some(t) => self.content.push(t, &text),
            None => text,
        };
        out.extend(self.text(&shown));
        out
    }

    fn finish(&mut self, g: &Generation) -> Vec<Event> {
        let (_, parsed) = self.answer.parse(g);
        // what the split held back, then the rest of the text
        let held = self.answer.reasoning.as_ref().map(|r| r.rest(0)).unwrap_or_default();
        let mut out = self.think(&held.reasoning_content);
        out.extend(self.close_thinking());
        let rest = match &self.answer.tools {
            Some(_) => self.content.rest(parsed.content.as_deref().unwrap_or_default()).to_string(),
            None => held.content, // every other piece went out as it came
        };
        out.extend(self.text(&rest));
        if self.text_open {
            out.push(event("content_block_stop", json!({ "index": self.text_index() })));
        }
        let first = self.text_index() + usize::from(self.text_open);
        for (i, call) in Answer::blocks(None, &parsed).into_iter().filter(|b| b["type"] == "tool_use").enumerate() {
            let index = first + i;
            let start = json!({ "type": "tool_use", "id": call["id"], "name": call["name"], "input": {} });
            out.push(event("content_block_start", json!({ "index": index, "content_block": start })));
            let partial = call["input"].to_string();
            out.push(event("content_block_delta", json!({ "index": index, "delta": { "type": "input_json_delta", "partial_json": partial } })));
            out.push(event("content_block_stop", json!({ "index": index })));
        }
        let (stop_reason, stop_sequence) = self.answer.stop(g, &parsed);
        let usage = Answer::usage(g);
        out.push(event("message_delta", json!({ "delta": { "stop_reason": stop_reason, "stop_sequence": stop_sequence }, "usage": usage })));
        out.push(event("message_stop", json!({})));
        self.done = true;
        out
    }

    fn failure(&mut self, e: ApiError) -> Vec<Event> {
        self.done = true;
        let error = e.body()["error"].clone();
        vec![event("error", json!({ "error": { "type": error["type"], "message": error["message"] } }))]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::types::MessageContent;

    fn param(r: Result<Vec<ChatMessageIn>, ApiError>) -> String {
        match r {
            Err(ApiError::InvalidRequest { param, .. }) => param.unwrap_or_default(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn content_blocks_become_the_chat_conversation() {
        let system = json!([{ "type": "text", "text": "Be " }, { "type": "text", "text": "brief." }]);
        let messages = json!([
            { "role": "user", "content": [{ "type": "text", "text": "Weather in " }, { "type": "text", "text": "Paris?" }] },
            { "role": "assistant", "content": [
                { "type": "thinking", "thinking": "..." },
                { "type": "text", "text": "Checking." },
                { "type": "tool_use", "id": "t1", "name": "get_weather", "input": { "city": "Paris" } }] },
            { "role": "user", "content": [
                { "type": "tool_result", "tool_use_id": "t1", "content": [{ "type": "text", "text": "18 C" }] },
                { "type": "text", "text": "And tomorrow?" }] }
        ]);
        let m = conversation(Some(&system), &messages).unwrap();
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert!(matches!(&m[0].content, Some(MessageContent::Text(t)) if t == "Be brief."));
        assert!(matches!(&m[2].content, Some(MessageContent::Text(t)) if t == "Checking."));
        assert_eq!(m[2].reasoning_content.as_deref(), Some("..."), "thinking is passed on as the reasoning");
        let calls = m[2].tool_calls.as_ref().unwrap();
        assert_eq!((calls[0].id.as_deref(), calls[0].function.name.as_str(), &calls[0].function.arguments), (Some("t1"), "get_weather", &json!({ "city": "Paris" })));
        assert_eq!(m[3].tool_call_id.as_deref(), Some("t1"));
        assert!(matches!(&m[3].content, Some(MessageContent::Text(t)) if t == "18 C"));
        assert!(matches!(&m[4].content, Some(MessageContent::Text(t)) if t == "And tomorrow?"));

        assert_eq!(param(conversation(None, &json!([]))), "messages");
        assert_eq!(param(conversation(None, &json!([{ "role": "system", "content": "x" }]))), "messages[0].role");
        let image = json!([{ "role": "user", "content": [{ "type": "image", "source": { "type": "url", "url": "x" } }] }]);
        assert_eq!(param(conversation(None, &image)), "messages[0].content[0]");
        let stray = json!([{ "role": "user", "content": [{ "type": "tool_use", "id": "t", "name": "f", "input": {} }] }]);
        assert_eq!(param(conversation(None, &stray)), "messages[0].content[0]");
        assert_eq!(param(conversation(Some(&json!(3)), &json!([{ "role": "user", "content": "x" }]))), "system");
    }

    #[test]
    fn anthropic_tools_become_chat_tools() {
        let tools = json!([{ "name": "f", "description": "d", "input_schema": { "type": "object" } }]);
        let chat = json!([{ "type": "function", "function": { "name": "f", "description": "d", "parameters": { "type": "object" } } }]);
        assert_eq!(chat_tools(Some(&tools)).unwrap().unwrap(), chat);
        let server_tool = json!([{ "type": "web_search_20250305", "name": "web_search" }]);
        assert!(matches!(chat_tools(Some(&server_tool)), Err(ApiError::InvalidRequest { param: Some(p), .. }) if p == "tools[0].type"));
        assert_eq!(chat_tool_choice(&json!({ "type": "any" })).unwrap(), json!("required"));
        assert_eq!(chat_tool_choice(&json!({ "type": "tool", "name": "f" })).unwrap(), json!({ "type": "function", "function": { "name": "f" } }));
        assert!(chat_tool_choice(&json!({ "type": "sometimes" })).is_err());
    }
}
