//! Tool calling for chat: a request's `tools` and `tool_choice` checked, the conversation's tool
//! turns shaped for the template, and the calls parsed out of the answer, in two formats:
//! - Hermes 2 Pro / Qwen 2.5 (llama.cpp's name), for templates that describe the tools
//!   themselves and ask for `<tool_call>{"name": .., "arguments": ..}</tool_call>`;
//! - llama.cpp's generic JSON format for every other template: the tools are described in a
//!   system message and a grammar holds the answer to `{"tool_call": ..}` / `{"tool_calls": [..]}`
//!   / `{"response": ..}`. (The bundled llama.cpp dropped it and passes the tools to a template
//!   that ignores them; a model that never hears of its tools cannot call them.)
//!
//! Grammars are part of the target law (lossless with speculation, as every grammar here);
//! parsing is post-processing of the answer's text, whose tokens are plain decoding's.
use super::errors::ApiError;
use super::types::{FunctionCall, ToolCallOut};
use crate::engine::GenerateOptions;
use crate::template::ChatTemplate;
use serde_json::{json, Value};

/// OpenAI's `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    /// The tools are shown to the template, no call is parsed.
    None,
    Auto,
    /// At least one call, held by a grammar.
    Required,
    /// A call of this function, held by a grammar.
    Named(String),
}

/// How the template asks for tool calls.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Format {
    Hermes,
    /// `native`: the template describes the tools itself; only the JSON answer is asked for.
    Generic { native: bool },
}

impl Format {
    pub fn of(template: &ChatTemplate) -> Self {
        let native = template.describes_tools();
        match native && template.source().contains(OPEN) {
            true => Format::Hermes,
            false => Format::Generic { native },
        }
    }
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A chat request's tools, checked.
#[derive(Debug, Clone)]
pub struct Tools {
    /// As given, `{"type": "function", "function": {"name", "description", "parameters"}}`.
    pub list: Vec<Value>,
    pub choice: Choice,
    /// OpenAI's `parallel_tool_calls` (llama-server's default: off): one call, or a list.
    pub parallel: bool,
    pub format: Format,
}

/// An answer split into its text and its calls.
#[derive(Debug, PartialEq)]
pub struct Parsed {
    /// `None` when only tools were called.
    pub content: Option<String>,
    pub calls: Vec<ToolCallOut>,
}

impl Tools {
    /// The request's tools (`None` without any), each field checked and named when wrong.
    pub fn new(tools: Option<&Value>, tool_choice: Option<&Value>, parallel: Option<bool>, format: Format) -> Result<Option<Self>, ApiError> {
        let list = match tools {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(list)) => list.clone(),
            Some(_) => return Err(ApiError::invalid_param("tools", "`tools` must be a list of tools")),
        };
        let mut names: Vec<&str> = Vec::new();
        for (i, tool) in list.iter().enumerate() {
            let bad = |field: &str, what: &str| ApiError::invalid_param(format!("tools[{i}]{field}"), format!("`tools[{i}]{field}` {what}"));
            if tool.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad(".type", "must be \"function\""));
            }
            let Some(function) = tool.get("function").filter(|f| f.is_object()) else {
                return Err(bad(".function", "must be an object with the function's name, description and parameters"));
            };
            let name = match function.get("name").and_then(Value::as_str) {
                Some(n) if !n.is_empty() => n,
                _ => return Err(bad(".function.name", "must be the function's name (a non-empty string)")),
            };
            if names.contains(&name) {
                return Err(bad(".function.name", &format!("names {name:?} a second time")));
            }
            names.push(name);
            if function.get("parameters").is_some_and(|p| !p.is_object()) {
                return Err(bad(".function.parameters", "must be a JSON schema object"));
            }
            if function.get("description").is_some_and(|d| !d.is_string()) {
                return Err(bad(".function.description", "must be a string"));
            }
        }
        let bad_choice = |what: String| ApiError::invalid_param("tool_choice", what);
        let choice = match tool_choice {
            None | Some(Value::Null) => Choice::Auto,
            Some(Value::String(c)) => match c.as_str() {
                "none" => Choice::None,
                "auto" => Choice::Auto,
                "required" => Choice::Required,
                other => return Err(bad_choice(format!("`tool_choice` {other:?}: give none, auto, required or a function"))),
            },
            Some(named) => match named.pointer("/function/name").and_then(Value::as_str) {
                Some(name) if named.get("type").and_then(Value::as_str) == Some("function") => {
                    if !names.contains(&name) {
                        return Err(bad_choice(format!("`tool_choice` names {name:?}, which is not among `tools`")));
                    }
                    Choice::Named(name.to_string())
                }
                _ => return Err(bad_choice(format!("`tool_choice` = {named}: give none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ..}}}}"))),
            },
        };
        if list.is_empty() {
            return match choice {
                Choice::None | Choice::Auto => Ok(None),
                _ => Err(bad_choice("`tool_choice` asks for a call, but `tools` holds none".into())),
            };
        }
        Ok(Some(Self { list, choice, parallel: parallel.unwrap_or(false), format }))
    }

    /// Whether calls are parsed out of the answer (`tool_choice` is not `none`).
    pub fn active(&self) -> bool {
        self.choice != Choice::None
    }

    /// The conversation as the template gets it, with these tools described where the template
    /// does not describe them itself (the generic format).
    pub fn describe(&self, messages: &mut Vec<Value>) {
        let Format::Generic { native } = self.format else { return };
        if !self.active() {
            return;
        }
        let answer = "Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` reply to the user's request";
        let text = match native {
            true => answer.to_string(),
            false => {
                let example = match self.parallel {
                    true => json!({ "tool_calls": [{ "name": "tool_name", "arguments": { "arg1": "some_value" } }] }),
                    false => json!({ "tool_call": { "name": "tool_name", "arguments": { "arg1": "some_value" } } }),
                };
                let tools = serde_json::to_string_pretty(&self.list).unwrap_or_default();
                format!("You can call any of the following tools to satisfy the user's requests: {tools}\n\nExample tool call syntax:\n\n{}\n\n{answer}", serde_json::to_string_pretty(&example).unwrap_or_default())
            }
        };
        match messages.first_mut() {
            Some(first) if first["role"] == "system" => {
                let before = first["content"].as_str().unwrap_or_default();
                first["content"] = Value::String(format!("{before}\n\n{text}"));
            }
            _ => messages.insert(0, json!({ "role": "system", "content": text })),
        }
    }

    /// Sets the grammar of a request whose calls are parsed (refused beside a grammar of the
    /// request's own, as llama.cpp refuses it). With Hermes and `auto`, the answer is free text
    /// until it writes `<tool_call>`, and the grammar holds the calls from there (llama.cpp's
    /// lazy grammar, as llama-server sets it).
    pub fn constrain(&self, opts: &mut GenerateOptions) -> Result<(), ApiError> {
        if !self.active() {
            return Ok(());
        }
        if opts.grammar.is_some() {
            return Err(ApiError::invalid_param("tools", "give `tools` or a `grammar` / `json_schema` / `response_format`, not both"));
        }
        opts.grammar = self.grammar()?;
        if (self.format, &self.choice) == (Format::Hermes, &Choice::Auto) {
            opts.grammar_triggers = vec![OPEN.to_string()];
        }
        Ok(())
    }

    /// The grammar that holds the answer to the calls asked for: always in the generic format
    /// (its answer is JSON); with Hermes, the calls in their tags.
    fn grammar(&self) -> Result<Option<String>, ApiError> {
        let schema = match (self.format, &self.choice) {
            (_, Choice::None) => return Ok(None),
            (Format::Generic { .. }, _) => self.generic_schema(),
            (Format::Hermes, _) => self.call_schema(),
        };
        let gbnf = crate::llama::Grammar::from_json_schema(&schema.to_string())
            .map_err(|e| ApiError::invalid_param("tools", format!("the tools' parameters do not make a grammar: {e}")))?;
        if self.format != Format::Hermes {
            return Ok(Some(gbnf));
        }
        // The calls' JSON inside the template's tags: the converter's root becomes one call.
        let call = gbnf.lines().map(|l| match l.strip_prefix("root ::=") {
            Some(rest) => format!("tool-call-json ::={rest}"),
            None => l.to_string(),
        });
        let repeat = if self.parallel { " (\"\\n\" call)*" } else { "" };
        let head = format!("root ::= call{repeat}\ncall ::= \"{OPEN}\\n\" tool-call-json \"\\n{CLOSE}\"");
        Ok(Some(std::iter::once(head).chain(call).collect::<Vec<_>>().join("\n")))
    }

    /// The functions a call may name (one, for a named `tool_choice`).
    fn callable(&self) -> impl Iterator<Item = &Value> {
        self.list.iter().map(|t| &t["function"]).filter(|f| match &self.choice {
            Choice::Named(n) => f["name"] == n.as_str(),
            _ => true,
        })
    }

    /// One call's JSON: `{"name": one of the functions, "arguments": its parameters}`.
    fn call_schema(&self) -> Value {
        let calls: Vec<Value> = self
            .callable()
            .map(|f| {
                let parameters = f.get("parameters").cloned().unwrap_or_else(|| json!({ "type": "object" }));
                json!({ "type": "object", "properties": { "name": { "const": f["name"] }, "arguments": parameters },
                    "required": ["name", "arguments"] })
            })
            .collect();
        match calls.len() {
            1 => calls.into_iter().next().unwrap_or_default(),
            _ => json!({ "anyOf": calls }),
        }
    }

    /// The generic format's answer: a call (or a list of them), or, unless a call is required,
    /// a `response` to the user.
    fn generic_schema(&self) -> Value {
        let calls = match self.parallel {
            true => json!({ "type": "object", "properties": { "tool_calls": { "type": "array", "items": self.call_schema(), "minItems": 1 } },
                "required": ["tool_calls"] }),
            false => json!({ "type": "object", "properties": { "tool_call": self.call_schema() }, "required": ["tool_call"] }),
        };
        match self.choice {
            Choice::Auto => json!({ "anyOf": [calls, { "type": "object", "properties": { "response": { "type": "string" } }, "required": ["response"] }] }),
            _ => calls,
        }
    }

    /// The answer's text and calls. An answer that is not in the format stays text, as with
    /// llama.cpp.
    pub fn parse(&self, text: &str) -> Parsed {
        let parsed = match self.format {
            Format::Hermes => parse_hermes(text),
            Format::Generic { .. } => parse_generic(text),
        };
        parsed.unwrap_or_else(|| Parsed { content: Some(text.to_string()), calls: Vec::new() })
    }

    /// How much of a growing answer is surely text and may be streamed as it comes: in the
    /// generic format none (the text is the JSON's `response`), with Hermes what comes before
    /// a call (a tail that may begin `<tool_call>` is held back, and so is a blank start, which
    /// would be no content at all). Always a beginning of what [`Tools::parse`] gives as content.
    pub fn shown_prefix(&self, text: &str) -> usize {
        if self.format != Format::Hermes {
            return 0;
        }
        let end = text.find(OPEN).unwrap_or_else(|| {
            let partial = (1..OPEN.len()).rev().find(|&n| text.ends_with(&OPEN[..n])).unwrap_or(0);
            text.len() - partial
        });
        if text[..end].trim().is_empty() {
            0
        } else {
            end
        }
    }
}

/// A streamed answer's content while calls may come: what arrived, and how much of it went out.
#[derive(Debug, Clone, Default)]
pub struct ContentStream {
    all: String,
    shown: usize,
}

impl ContentStream {
    /// The part of the answer grown by `text` that is surely content, not sent before.
    pub fn push(&mut self, tools: &Tools, text: &str) -> String {
        self.all.push_str(text);
        let end = tools.shown_prefix(&self.all).max(self.shown);
        let out = self.all[self.shown..end].to_string();
        self.shown = end;
        out
    }

    /// What is left to send of the finished answer's `content`.
    pub fn rest<'a>(&self, content: &'a str) -> &'a str {
        content.get(self.shown..).unwrap_or_default()
    }
}

/// `<tool_call>{json}</tool_call>` blocks among text; the last block may lack its end tag (the
/// answer ended there). `None` when a block does not hold a call.
fn parse_hermes(text: &str) -> Option<Parsed> {
    let (mut content, mut calls, mut rest) = (String::new(), Vec::new(), text);
    while let Some(at) = rest.find(OPEN) {
        content.push_str(&rest[..at]);
        let after = &rest[at + OPEN.len()..];
        let (body, next) = match after.find(CLOSE) {
            Some(end) => (&after[..end], &after[end + CLOSE.len()..]),
            None => (after, ""),
        };
        calls.push(call(&serde_json::from_str(body.trim()).ok()?)?);
        rest = next;
    }
    content.push_str(rest);
    Some(Parsed { content: Some(content).filter(|c| !c.trim().is_empty()), calls })
}

/// The generic format's JSON answer.
fn parse_generic(text: &str) -> Option<Parsed> {
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    if let Some(c) = v.get("tool_call") {
        return Some(Parsed { content: None, calls: vec![call(c)?] });
    }
    if let Some(list) = v.get("tool_calls").and_then(Value::as_array) {
        return Some(Parsed { content: None, calls: list.iter().map(call).collect::<Option<_>>()? });
    }
    let response = v.get("response")?;
    let content = response.as_str().map_or_else(|| response.to_string(), str::to_string);
    Some(Parsed { content: Some(content), calls: Vec::new() })
}

/// `{"name", "arguments"}` (an object, or its JSON text) as OpenAI's call: the arguments as a
/// JSON string, an id of the call's own or a new one.
fn call(v: &Value) -> Option<ToolCallOut> {
    let name = v.get("name")?.as_str().filter(|n| !n.is_empty())?.to_string();
    let arguments = match v.get("arguments") {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(args) => args.to_string(),
    };
    let id = match v.get("id").and_then(Value::as_str) {
        Some(id) if !id.is_empty() => id.to_string(),
        _ => format!("call_{:016x}", rand::random::<u64>()),
    };
    Some(ToolCallOut { index: None, id, kind: "function", function: FunctionCall { name, arguments } })
}

/// The conversation for the template, from the client's messages: assistant `tool_calls` carry
/// their arguments as objects (Hugging Face templates write them with `tojson`), and where the
/// template does not know tools, calls and results become JSON text in the generic format's
/// shape (llama.cpp's polyfill).
pub fn conversation(messages: Vec<super::types::ChatMessageIn>, native: bool) -> Result<Vec<Value>, ApiError> {
    use super::types::MessageContent;
    if messages.is_empty() {
        return Err(ApiError::invalid_param("messages", "`messages` must hold at least one message"));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.into_iter().enumerate() {
        let content = match m.content {
            None => String::new(),
            Some(MessageContent::Text(t)) => t,
            // text parts joined by a blank line, as llama-server joins them
            Some(MessageContent::Parts(parts)) => parts
                .into_iter()
                .map(|p| match (p.kind.as_str(), p.text) {
                    ("text", Some(t)) => Ok(t),
                    (kind, _) => Err(ApiError::invalid_param(
                        format!("messages[{i}].content"),
                        format!("content parts of type `{kind}` are not supported: the model reads text"),
                    )),
                })
                .collect::<Result<Vec<String>, _>>()?
                .join("\n\n"),
        };
        let calls: Vec<Value> = m
            .tool_calls
            .unwrap_or_default()
            .into_iter()
            .map(|c| {
                // Arguments arrive as JSON text (OpenAI's shape); templates want the object.
                let arguments = match &c.function.arguments {
                    Value::String(s) => serde_json::from_str(s).unwrap_or(Value::String(s.clone())),
                    other => other.clone(),
                };
                let mut call = json!({ "type": "function", "function": { "name": c.function.name, "arguments": arguments } });
                if let Some(id) = c.id {
                    call["id"] = id.into();
                }
                call
            })
            .collect();
        let mut message = json!({ "role": m.role, "content": content });
        if let Some(reasoning) = m.reasoning_content {
            message["reasoning_content"] = reasoning.into();
        }
        match (native, m.role.as_str()) {
            (true, _) => {
                if !calls.is_empty() {
                    message["tool_calls"] = calls.into();
                }
                if let Some(id) = m.tool_call_id {
                    message["tool_call_id"] = id.into();
                }
                if let Some(name) = m.name {
                    message["name"] = name.into();
                }
            }
            (false, "tool") => {
                let mut response = json!({ "content": content });
                if let Some(name) = m.name {
                    response["tool"] = name.into();
                }
                if let Some(id) = m.tool_call_id {
                    response["tool_call_id"] = id.into();
                }
                message = json!({ "role": "user", "content": pretty(&json!({ "tool_response": response })) });
            }
            (false, _) if !calls.is_empty() => {
                // in the shape the generic format asks the model for
                let mut calls: Vec<Value> = calls.into_iter().map(|c| c["function"].clone()).collect();
                let mut text = match calls.len() {
                    1 => json!({ "tool_call": calls.remove(0) }),
                    _ => json!({ "tool_calls": calls }),
                };
                if !content.is_empty() {
                    text["content"] = content.into();
                }
                message["content"] = pretty(&text).into();
            }
            (false, _) => {}
        }
        out.push(message);
    }
    Ok(out)
}

/// Another API's `tools` list in chat's shape: `convert` turns tool `i` into a chat tool or names
/// what is wrong with it (null or absent: no tools).
pub fn foreign_tools(
    tools: Option<&Value>,
    convert: impl Fn(usize, &Value) -> Result<Value, ApiError>,
) -> Result<Option<Value>, ApiError> {
    let Some(list) = tools.filter(|t| !t.is_null()) else { return Ok(None) };
    let list = list.as_array().ok_or_else(|| ApiError::invalid_param("tools", "`tools` must be a list of tools"))?;
    let converted = list.iter().enumerate().map(|(i, t)| convert(i, t)).collect::<Result<Vec<_>, _>>()?;
    Ok(Some(Value::Array(converted)))
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: Value, format: Format) -> Tools {
        let list = json!([
            { "type": "function", "function": { "name": "get_weather", "description": "Weather of a city",
                "parameters": { "type": "object", "properties": { "city": { "type": "string" } }, "required": ["city"] } } },
            { "type": "function", "function": { "name": "add", "parameters": { "type": "object",
                "properties": { "a": { "type": "integer" }, "b": { "type": "integer" } } } } }
        ]);
        Tools::new(Some(&list), Some(&choice), None, format).unwrap().unwrap()
    }

    fn names(p: &Parsed) -> Vec<(&str, Value)> {
        p.calls.iter().map(|c| (c.function.name.as_str(), serde_json::from_str(&c.function.arguments).unwrap())).collect()
    }

    #[test]
    fn hermes_calls_are_parsed_out_of_the_text() {
        let t = tools(json!("auto"), Format::Hermes);
        let one = t.parse("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>");
        assert_eq!((one.content.as_deref(), names(&one)), (None, vec![("get_weather", json!({ "city": "Paris" }))]));
        assert!(one.calls[0].id.starts_with("call_") && one.calls[0].kind == "function");
        // text around calls stays; two calls; the last one cut before its end tag
        let two = t.parse("Let me check.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}");
        assert_eq!(two.content.as_deref(), Some("Let me check.\n\n"));
        assert_eq!(names(&two), vec![("add", json!({ "a": 1, "b": 2 })), ("get_weather", json!({ "city": "Rome" }))]);
        // plain text, and a block that is not a call: text
        for text in ["Hello there.", "<tool_call>\nnot json\n</tool_call>", "<tool_call>{\"arguments\": {}}</tool_call>"] {
            assert_eq!(t.parse(text), Parsed { content: Some(text.into()), calls: vec![] });
        }
    }

    #[test]
    fn generic_answers_are_calls_or_a_response() {
        let t = tools(json!("auto"), Format::Generic { native: false });
        let p = t.parse(r#" {"tool_call": {"name": "add", "arguments": {"a": 2, "b": 3}, "id": "c1"}} "#);
        assert_eq!((p.content.as_deref(), names(&p)[0].clone(), p.calls[0].id.as_str()), (None, ("add", json!({ "a": 2, "b": 3 })), "c1"));
        let p = t.parse(r#"{"tool_calls": [{"name": "add", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]}"#);
        assert_eq!(names(&p).len(), 2);
        assert_eq!(t.parse(r#"{"response": "Hi!"}"#), Parsed { content: Some("Hi!".into()), calls: vec![] });
        assert_eq!(t.parse("{\"response\": \"Hi"), Parsed { content: Some("{\"response\": \"Hi".into()), calls: vec![] });
    }

    #[test]
    fn only_text_before_a_call_is_streamed() {
        let t = tools(json!("auto"), Format::Hermes);
        assert_eq!(t.shown_prefix("Sure. <tool_"), "Sure. ".len());
        assert_eq!(t.shown_prefix("Sure. <tool_call>{\"na"), "Sure. ".len());
        assert_eq!(t.shown_prefix("\n <tool_call>"), 0);
        assert_eq!(t.shown_prefix("a < b"), "a < b".len());
        let text = "Sure. <tool_call>{\"name\": \"add\", \"arguments\": {}}</tool_call>";
        assert!(t.parse(text).content.unwrap().starts_with(&text[..t.shown_prefix(text)]));
        // streamed in pieces, the content adds up to the parsed one
        let mut stream = ContentStream::default();
        let sent: String = text.as_bytes().chunks(3).map(|c| stream.push(&t, std::str::from_utf8(c).unwrap())).collect();
        let content = t.parse(text).content.unwrap();
        assert_eq!(format!("{sent}{}", stream.rest(&content)), content);
        assert_eq!(sent, "Sure. ");
        assert_eq!(tools(json!("auto"), Format::Generic { native: false }).shown_prefix("{\"response\": \"a"), 0);
    }

    #[test]
    fn malformed_tools_are_refused_by_their_field() {
        let refuse = |tools: Value, choice: Value| match Tools::new(Some(&tools), Some(&choice), None, Format::Hermes) {
            Err(ApiError::InvalidRequest { param, .. }) => param.unwrap_or_default(),
            other => panic!("{tools} {choice}: {other:?}"),
        };
        let f = |function: Value| json!([{ "type": "function", "function": function }]);
        assert_eq!(refuse(f(json!({ "description": "no name" })), json!("auto")), "tools[0].function.name");
        assert_eq!(refuse(json!([{ "type": "function", "function": { "name": "a" } }, { "type": "retrieval" }]), json!("auto")), "tools[1].type");
        assert_eq!(refuse(json!([{ "type": "function" }]), json!("auto")), "tools[0].function");
        assert_eq!(refuse(f(json!({ "name": "a", "parameters": "x" })), json!("auto")), "tools[0].function.parameters");
        assert_eq!(refuse(json!({ "name": "a" }), json!("auto")), "tools");
        assert_eq!(refuse(f(json!({ "name": "a" })), json!("sometimes")), "tool_choice");
        assert_eq!(refuse(f(json!({ "name": "a" })), json!({ "type": "function", "function": { "name": "b" } })), "tool_choice");
        assert_eq!(refuse(json!([]), json!("required")), "tool_choice");
        assert!(Tools::new(Some(&json!([])), Some(&json!("auto")), None, Format::Hermes).unwrap().is_none());
    }

    #[test]
    fn grammars_hold_what_the_choice_asks() {
        // Hermes with `auto`: the calls' grammar, held lazily from `<tool_call>` on
        let mut opts = GenerateOptions::default();
        tools(json!("auto"), Format::Hermes).constrain(&mut opts).unwrap();
        assert!(opts.grammar.as_deref().is_some_and(|g| g.starts_with("root ::= call")), "{:?}", opts.grammar);
        assert_eq!(opts.grammar_triggers, ["<tool_call>"]);
        let mut opts = GenerateOptions::default();
        tools(json!("required"), Format::Hermes).constrain(&mut opts).unwrap();
        assert!(opts.grammar.is_some() && opts.grammar_triggers.is_empty(), "required holds from the first token");
        assert_eq!(tools(json!("none"), Format::Generic { native: false }).grammar().unwrap(), None);
        let named = tools(json!({ "type": "function", "function": { "name": "add" } }), Format::Hermes).grammar().unwrap().unwrap();
        assert!(named.starts_with("root ::= call\ncall ::= \"<tool_call>\\n\" tool-call-json \"\\n</tool_call>\""), "{named}");
        assert!(named.contains("tool-call-json ::=") && !named.contains("get_weather"), "{named}");
        let generic = tools(json!("auto"), Format::Generic { native: false }).grammar().unwrap().unwrap();
        assert!(generic.contains("response") && generic.contains("get_weather"), "{generic}");
        let required = tools(json!("required"), Format::Generic { native: false }).grammar().unwrap().unwrap();
        assert!(!required.contains("response"), "{required}");
    }

    #[test]
    fn the_generic_format_describes_the_tools_in_a_system_message() {
        let t = tools(json!("auto"), Format::Generic { native: false });
        let mut messages = vec![json!({ "role": "user", "content": "hi" })];
        t.describe(&mut messages);
        let system = messages[0]["content"].as_str().unwrap();
        assert!(messages[0]["role"] == "system" && system.contains("\"get_weather\"") && system.contains("Respond in JSON format"), "{system}");
        let mut messages = vec![json!({ "role": "system", "content": "Be brief." }), json!({ "role": "user", "content": "hi" })];
        t.describe(&mut messages);
        assert!(messages.len() == 2 && messages[0]["content"].as_str().unwrap().starts_with("Be brief.\n\nYou can call"));
    }
}
