//! `POST /v1/responses`: OpenAI's Responses API (which newer SDKs and agents default to), mapped
//! onto the chat path as llama-server maps it: `input` (a text, or message, `function_call` and
//! `function_call_output` items) and `instructions` become chat messages, `max_output_tokens` the
//! limit, the function tools chat tools; the answer is a `response` object, or its stream of
//! events (`response.created` ... `response.output_text.delta` ... `response.completed`). A
//! reasoning model's thinking comes first, as a `reasoning` item (`response.reasoning_text.delta`).
//! Nothing is stored: a conversation is sent whole, never by `previous_response_id`.
use super::errors::ApiError;
use super::reply::now;
use super::reasoning::{self, Ask, Reasoning};
use super::routes::{chat_prompt, collect, options, preferred_slot, submit, ApiJson, Sampled};
use super::scheduler::GenEvent;
use super::tools::{self, ContentStream, Parsed, Tools};
use super::types::{ChatMessageIn, FunctionCallIn, InputTokens, ToolCallIn};
use super::AppState;
use crate::engine::{FinishReason, Generation};
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
pub struct ResponsesRequest {
    /// Accepted and not checked: one model is served.
    pub model: Option<String>,
    /// A text, or a list of items (checked by [`messages`], which names a wrong item's path).
    pub input: Value,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub stream: Option<bool>,
    /// Function tools in the Responses API's flat shape (`{"type", "name", "parameters"}`).
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub previous_response_id: Option<String>,
    /// `{"format": {"type": "text"}}` only.
    pub text: Option<Value>,
}

pub async fn responses(State(s): State<Arc<AppState>>, Sampled(req, sampling): Sampled<ResponsesRequest>) -> Result<Response, ApiError> {
    let (messages, tools) = chat_request(&s, &req)?;
    let slot = preferred_slot(&s, sampling.id_slot)?;
    let mut opts = options(&s, sampling, req.max_output_tokens, "max_output_tokens")?;
    if let Some(t) = &tools {
        t.constrain(&mut opts)?;
    }
    let (prompt, reasoning) = chat_prompt(&s, messages, tools.as_ref(), true, &Ask::of(&s, None, None)?).await?;
    if let Some(r) = &reasoning {
        r.constrain(&mut opts);
    }
    let mut events = submit(&s, &[prompt], opts, 1, slot, false)?;
    let rx = events.pop().ok_or_else(|| ApiError::Internal("no generation was queued".into()))?;
    let answer = Answer {
        id: format!("resp_{:016x}", rand::random::<u64>()),
        created_at: now(),
        model: s.model_id().to_string(),
        // the request's settings, as OpenAI's response object repeats them
        echo: json!({ "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "tools": req.tools.unwrap_or_else(|| json!([])), "tool_choice": req.tool_choice.unwrap_or_else(|| json!("auto")),
            "parallel_tool_calls": tools.as_ref().is_some_and(|t| t.parallel) }),
        tools: tools.filter(Tools::active),
        reasoning,
    };
    match req.stream.unwrap_or(false) {
        true => Ok(answer.stream(rx)),
        false => Ok(Json(answer.object(Some(&collect(rx).await?))).into_response()),
    }
}

/// `POST /v1/responses/input_tokens` (llama-server's): how many prompt tokens a Responses
/// request's body would decode.
pub async fn input_tokens(State(s): State<Arc<AppState>>, ApiJson(req): ApiJson<ResponsesRequest>) -> Result<Json<InputTokens>, ApiError> {
    let (messages, tools) = chat_request(&s, &req)?;
    let (prompt, _) = chat_prompt(&s, messages, tools.as_ref(), true, &Ask::of(&s, None, None)?.prompt_only()).await?;
    Ok(Json(InputTokens { object: "response.input_tokens", input_tokens: prompt.len() }))
}

/// A Responses request as the chat path takes it: its conversation and its tools.
fn chat_request(s: &AppState, req: &ResponsesRequest) -> Result<(Vec<ChatMessageIn>, Option<Tools>), ApiError> {
    if req.previous_response_id.is_some() {
        return Err(ApiError::invalid_param("previous_response_id", "responses are not stored here: send the whole conversation in `input`"));
    }
    if let Some(format) = req.text.as_ref().and_then(|t| t.get("format")).filter(|f| f["type"] != "text") {
        return Err(ApiError::invalid_param("text.format", format!("`text.format` = {format}: only text is offered on this route (chat completions take `response_format`)")));
    }
    let tools = Tools::new(
        chat_tools(req.tools.as_ref())?.as_ref(),
        req.tool_choice.as_ref().map(chat_tool_choice).as_ref(),
        req.parallel_tool_calls,
        tools::Format::of(&s.template),
    )?;
    Ok((messages(req.instructions.clone(), &req.input)?, tools))
}

/// The Responses API's function tools (`{"type": "function", "name", ..}`) in chat's shape.
fn chat_tools(tools: Option<&Value>) -> Result<Option<Value>, ApiError> {
    tools::foreign_tools(tools, |i, t| match t.get("type").and_then(Value::as_str) {
        Some("function") => {
            let mut function = t.clone();
            function.as_object_mut().map(|f| f.remove("type"));
            Ok(json!({ "type": "function", "function": function }))
        }
        other => Err(ApiError::invalid_param(
            format!("tools[{i}].type"),
            format!("`tools[{i}].type` {other:?}: function tools are offered, not hosted tools"),
        )),
    })
}

/// `{"type": "function", "name"}` (the Responses API's) as chat's `{"type": "function", "function": {"name"}}`.
fn chat_tool_choice(choice: &Value) -> Value {
    match choice.get("name") {
        Some(name) if choice["type"] == "function" => json!({ "type": "function", "function": { "name": name } }),
        _ => choice.clone(),
    }
}

/// The chat conversation of `instructions` and `input`.
fn messages(instructions: Option<String>, input: &Value) -> Result<Vec<ChatMessageIn>, ApiError> {
    let message = |role: &str, text: String| ChatMessageIn::text(role, Some(text));
    let mut out: Vec<ChatMessageIn> = instructions.into_iter().map(|i| message("system", i)).collect();
    let items = match input {
        Value::String(text) => {
            out.push(message("user", text.clone()));
            return Ok(out);
        }
        Value::Array(items) => items,
        _ => return Err(ApiError::invalid_param("input", "`input` must be a text or a list of items")),
    };
    for (i, item) in items.iter().enumerate() {
        let bad = |field: &str, what: String| ApiError::invalid_param(format!("input[{i}]{field}"), what);
        let text = |field: &str| {
            item.get(field).and_then(Value::as_str).map(str::to_string).ok_or_else(|| bad(&format!(".{field}"), format!("`input[{i}].{field}` must be a text")))
        };
        match item.get("type").and_then(Value::as_str).unwrap_or("message") {
            "message" => {
                let role = match text("role")?.as_str() {
                    "developer" => "system".to_string(),
                    role @ ("system" | "user" | "assistant") => role.to_string(),
                    other => return Err(bad(".role", format!("`input[{i}].role` {other:?}: give user, assistant, system or developer"))),
                };
                let content = match &item["content"] {
                    Value::String(t) => t.clone(),
                    Value::Array(parts) => parts
                        .iter()
                        .enumerate()
                        .map(|(j, p)| match (p["type"].as_str(), p["text"].as_str()) {
                            (Some("input_text" | "output_text" | "text"), Some(t)) => Ok(t),
                            (kind, _) => Err(bad(&format!(".content[{j}]"), format!("content of type {kind:?} is not supported: the model reads text"))),
                        })
                        .collect::<Result<String, _>>()?,
                    _ => return Err(bad(".content", format!("`input[{i}].content` must be a text or a list of text parts"))),
                };
                out.push(message(&role, content));
            }
            "function_call" => {
                let call = ToolCallIn {
                    id: Some(text("call_id")?),
                    function: FunctionCallIn { name: text("name")?, arguments: Value::String(text("arguments")?) },
                };
                // Calls after an assistant turn are that turn's.
                match out.last_mut() {
                    Some(last) if last.role == "assistant" => last.tool_calls.get_or_insert_with(Vec::new).push(call),
                    _ => out.push(ChatMessageIn { content: None, tool_calls: Some(vec![call]), ..message("assistant", String::new()) }),
                }
            }
            "function_call_output" => {
                let output = match &item["output"] {
                    Value::String(t) => t.clone(),
                    other => other.to_string(),
                };
                out.push(ChatMessageIn { tool_call_id: Some(text("call_id")?), ..message("tool", output) });
            }
            other => return Err(bad(".type", format!("`input[{i}].type` {other:?}: give message, function_call or function_call_output items"))),
        }
    }
    Ok(out)
}

/// One response being answered: its ids, the request's settings it repeats, the tools its
/// calls are parsed for and the split of its thinking.
struct Answer {
    id: String,
    created_at: u64,
    model: String,
    echo: Value,
    tools: Option<Tools>,
    reasoning: Option<Reasoning>,
}

impl Answer {
    /// The answer's thinking (if any) and its content and calls.
    fn parse(&self, g: &Generation) -> (Option<String>, Parsed) {
        reasoning::answer(self.reasoning.as_ref(), self.tools.as_ref(), &g.text)
    }

    fn message_id(&self) -> String {
        format!("msg_{}", &self.id["resp_".len()..])
    }

    fn reasoning_id(&self) -> String {
        format!("rs_{}", &self.id["resp_".len()..])
    }

    /// The thinking, as llama-server's Responses API gives it.
    fn reasoning_item(&self, text: &str, status: &str) -> Value {
        json!({ "type": "reasoning", "id": self.reasoning_id(), "status": status, "summary": [],
            "content": [{ "type": "reasoning_text", "text": text }] })
    }

    fn message(&self, text: &str, status: &str) -> Value {
        json!({ "type": "message", "id": self.message_id(), "status": status, "role": "assistant",
            "content": [{ "type": "output_text", "text": text, "annotations": [] }] })
    }

    /// The output items of a finished answer: its thinking, its text, then its calls.
    fn output(&self, thought: Option<&str>, parsed: &Parsed) -> Vec<Value> {
        let thought = thought.map(|t| self.reasoning_item(t, "completed"));
        let text = parsed.content.iter().map(|c| self.message(c, "completed"));
        let calls = parsed.calls.iter().map(|c| {
            json!({ "type": "function_call", "id": format!("fc_{}", c.id), "call_id": c.id, "name": c.function.name,
                "arguments": c.function.arguments, "status": "completed" })
        });
        thought.into_iter().chain(text).chain(calls).collect()
    }

    /// The `response` object: in progress (`None`), or finished.
    fn object(&self, g: Option<&Generation>) -> Value {
        let (status, output, usage, incomplete) = match g {
            None => ("in_progress", Vec::new(), Value::Null, Value::Null),
            Some(g) => {
                let cut = matches!(g.finish, FinishReason::Length | FinishReason::Context);
                let (input, output) = (g.stats.n_prompt, g.tokens.len());
                let usage = json!({ "input_tokens": input, "output_tokens": output, "total_tokens": input + output,
                    "input_tokens_details": { "cached_tokens": g.stats.n_prompt - g.stats.n_prompt_decoded },
                    "output_tokens_details": { "reasoning_tokens": 0 } });
                let incomplete = if cut { json!({ "reason": "max_output_tokens" }) } else { Value::Null };
                let (thought, parsed) = self.parse(g);
                (if cut { "incomplete" } else { "completed" }, self.output(thought.as_deref(), &parsed), usage, incomplete)
            }
        };
        let mut object = json!({ "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "usage": usage, "incomplete_details": incomplete, "error": null });
        if let (Some(o), Some(echo)) = (object.as_object_mut(), self.echo.as_object()) {
            o.extend(echo.clone());
        }
        object
    }

    /// The Responses API's events: created, in progress, the message's text as it comes (opened
    /// at its first piece), the calls whole, then completed.
    fn stream(self, rx: mpsc::Receiver<GenEvent>) -> Response {
        let state = Streaming { answer: self, seq: 0, thought: None, opened: false, content: ContentStream::default(), done: false };
        let body = stream::unfold((Some(rx), state), |(rx, mut st)| async move {
            let mut rx = rx?;
            let events = if st.seq == 0 {
                let response = st.answer.object(None);
                vec![st.event("response.created", json!({ "response": response })), st.event("response.in_progress", json!({ "response": response }))]
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

/// A stream in progress: its events' numbering, its thinking so far (once its item is open, the
/// first; `done` once closed) and whether the message item is open.
struct Streaming {
    answer: Answer,
    seq: u64,
    thought: Option<(String, bool)>,
    opened: bool,
    content: ContentStream,
    done: bool,
}

impl Streaming {
    fn event(&mut self, kind: &str, mut data: Value) -> Event {
        data["type"] = kind.into();
        data["sequence_number"] = self.seq.into();
        self.seq += 1;
        Event::default().event(kind).data(data.to_string())
    }

    /// Where the message item is among the output: after the thinking's, if any.
    fn message_index(&self) -> usize {
        usize::from(self.thought.is_some())
    }

    /// Thinking, as a delta of the reasoning item (opened at its first piece).
    fn think(&mut self, delta: &str) -> Vec<Event> {
        if delta.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        if self.thought.is_none() {
            self.thought = Some((String::new(), false));
            let item = self.answer.reasoning_item("", "in_progress");
            out.push(self.event("response.output_item.added", json!({ "output_index": 0, "item": item })));
        }
        if let Some((text, _)) = &mut self.thought {
            text.push_str(delta);
        }
        let item_id = self.answer.reasoning_id();
        out.push(self.event("response.reasoning_text.delta", json!({ "item_id": item_id, "output_index": 0, "content_index": 0, "delta": delta })));
        out
    }

    /// The reasoning item's end, once, when it is open.
    fn close_thought(&mut self) -> Vec<Event> {
        let Some((text, false)) = self.thought.clone() else { return Vec::new() };
        self.thought = Some((text.clone(), true));
        let item_id = self.answer.reasoning_id();
        let item = self.answer.reasoning_item(&text, "completed");
        vec![
            self.event("response.reasoning_text.done", json!({ "item_id": item_id, "output_index": 0, "content_index": 0, "text": text })),
            self.event("response.output_item.done", json!({ "output_index": 0, "item": item })),
        ]
    }

    /// The message item and its text part, announced once (the thinking ends there).
    fn open(&mut self) -> Vec<Event> {
        if self.opened {
            return Vec::new();
        }
        let mut out = self.close_thought();
        self.opened = true;
        let (item_id, index) = (self.answer.message_id(), self.message_index());
        let item = json!({ "type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": [] });
        let part = json!({ "type": "output_text", "text": "", "annotations": [] });
        out.push(self.event("response.output_item.added", json!({ "output_index": index, "item": item })));
        out.push(self.event("response.content_part.added", json!({ "item_id": item_id, "output_index": index, "content_index": 0, "part": part })));
        out
    }

    /// Text the answer surely holds, as a delta of its message.
    fn text(&mut self, delta: &str) -> Vec<Event> {
        if delta.is_empty() {
            return Vec::new();
        }
        let mut out = self.open();
        let (item_id, index) = (self.answer.message_id(), self.message_index());
        out.push(self.event("response.output_text.delta", json!({ "item_id": item_id, "output_index": index, "content_index": 0, "delta": delta })));
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
        let content = parsed.content.clone().unwrap_or_default();
        // what the split held back, then the rest of the text
        let held = self.answer.reasoning.as_ref().map(|r| r.rest(0)).unwrap_or_default();
        let mut out = self.think(&held.reasoning_content);
        out.extend(self.close_thought());
        let rest = match &self.answer.tools {
            Some(_) => self.content.rest(&content).to_string(),
            None => held.content, // every other piece went out as it came
        };
        out.extend(self.text(&rest));
        let first = self.message_index();
        let items = self.answer.output(None, &parsed); // (the thinking's item was streamed)
        for (index, item) in items.into_iter().enumerate().map(|(i, item)| (first + i, item)) {
            let item_id = item["id"].clone();
            if item["type"] == "message" {
                out.extend(self.open());
                let part = item["content"][0].clone();
                out.push(self.event("response.output_text.done", json!({ "item_id": item_id, "output_index": index, "content_index": 0, "text": content })));
                out.push(self.event("response.content_part.done", json!({ "item_id": item_id, "output_index": index, "content_index": 0, "part": part })));
            } else {
                out.push(self.event("response.output_item.added", json!({ "output_index": index, "item": item })));
                let arguments = item["arguments"].clone();
                out.push(self.event("response.function_call_arguments.done", json!({ "item_id": item_id, "output_index": index, "arguments": arguments })));
            }
            out.push(self.event("response.output_item.done", json!({ "output_index": index, "item": item })));
        }
        // `response.completed` also for an answer cut by its limit (its status says `incomplete`):
        // the SDK's stream helper ends only on that event.
        let response = self.answer.object(Some(g));
        out.push(self.event("response.completed", json!({ "response": response })));
        self.done = true;
        out
    }

    fn failure(&mut self, e: ApiError) -> Vec<Event> {
        self.done = true;
        let error = e.body()["error"].clone();
        vec![self.event("error", json!({ "code": error["code"], "message": error["message"], "param": error["param"] }))]
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
    fn input_items_become_the_chat_conversation() {
        let input = json!([
            { "role": "developer", "content": "Be brief." },
            { "type": "message", "role": "user", "content": [{ "type": "input_text", "text": "Weather in " }, { "type": "input_text", "text": "Paris?" }] },
            { "type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}" },
            { "type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{\"city\": \"Lyon\"}" },
            { "type": "function_call_output", "call_id": "c1", "output": "18 C" }
        ]);
        let m = messages(Some("You are a bot.".into()), &input).unwrap();
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "system", "user", "assistant", "tool"]);
        assert!(matches!(&m[2].content, Some(MessageContent::Text(t)) if t == "Weather in Paris?"));
        let calls = m[3].tool_calls.as_ref().unwrap();
        assert_eq!((calls.len(), calls[1].id.as_deref(), calls[1].function.name.as_str()), (2, Some("c2"), "get_weather"));
        assert_eq!((m[4].tool_call_id.as_deref(), matches!(&m[4].content, Some(MessageContent::Text(t)) if t == "18 C")), (Some("c1"), true));
        assert_eq!(messages(None, &json!("hi")).unwrap().len(), 1);

        assert_eq!(param(messages(None, &json!(3))), "input");
        assert_eq!(param(messages(None, &json!([{ "role": "user", "content": [{ "type": "input_image" }] }]))), "input[0].content[0]");
        assert_eq!(param(messages(None, &json!([{ "role": "robot", "content": "x" }]))), "input[0].role");
        assert_eq!(param(messages(None, &json!([{ "type": "reasoning" }]))), "input[0].type");
        assert_eq!(param(messages(None, &json!([{ "type": "function_call", "call_id": "c", "arguments": "{}" }]))), "input[0].name");
    }

    #[test]
    fn flat_function_tools_become_chat_tools() {
        let tools = json!([{ "type": "function", "name": "f", "parameters": { "type": "object" } }]);
        assert_eq!(chat_tools(Some(&tools)).unwrap().unwrap(), json!([{ "type": "function", "function": { "name": "f", "parameters": { "type": "object" } } }]));
        let hosted = json!([{ "type": "web_search" }]);
        assert!(matches!(chat_tools(Some(&hosted)), Err(ApiError::InvalidRequest { param: Some(p), .. }) if p == "tools[0].type"));
        assert_eq!(chat_tool_choice(&json!({ "type": "function", "name": "f" })), json!({ "type": "function", "function": { "name": "f" } }));
        assert_eq!(chat_tool_choice(&json!("required")), json!("required"));
    }
}
