//! Reasoning output as llama-server gives it, on a real model (SmolLM2) served with Qwen3's chat
//! template (`tests/data/Qwen-Qwen3-0.6B.jinja`): a grammar makes the answer open with a
//! `<think>` section, which comes back as `reasoning_content` (streamed as
//! `delta.reasoning_content`), the content without it; the split is on text only, so a speculating
//! server answers the same text as a plain one.
mod common;

use dflash2::llama::{Model, ModelParams};
use dflash2::template::{ChatTemplate, TemplateChoice, Vars};
use serde_json::{json, Value};
use std::process::Command;

const QWEN3_TEMPLATE: &str = include_str!("data/Qwen-Qwen3-0.6B.jinja");
/// The letters of a thought and of an answer, in Qwen3's layout.
const THINK_GRAMMAR: &str = r#"root ::= "<think>\n" [a-z]{4,16} "\n</think>\n\n" [a-z]{4,16}"#;

fn template_file(name: &str, text: &str) -> String {
    let path = common::scratch_dir("reasoning").join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

fn serve(name: &str, template: &str, extra: &[&str]) -> common::Server {
    let model = common::real_model(common::SMOLLM2);
    let args = [&["-m", model.to_str().unwrap(), "-t", "1", "--chat-template-file", template][..], extra].concat();
    common::Server::spawn(name, &args)
}

/// curl, never through a proxy; (status, body).
fn post(server: &common::Server, path: &str, body: &Value) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-sS", "-N", "--noproxy", "*", "--max-time", "120", "-w", "\n%{http_code}", "-X", "POST", "-d"])
        .arg(body.to_string())
        .arg(format!("{}{path}", server.base))
        .output()
        .expect("curl is installed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

fn post_ok(server: &common::Server, path: &str, body: Value) -> Value {
    let (code, text) = post(server, path, &body);
    assert_eq!(code, 200, "{path} {body}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// A streamed chat answer: its reasoning and content deltas in order, as (is_reasoning, text).
fn streamed(server: &common::Server, mut body: Value) -> Vec<(bool, String)> {
    body["stream"] = json!(true);
    let (code, text) = post(server, "/v1/chat/completions", &body);
    assert_eq!(code, 200, "{text}");
    let mut pieces = Vec::new();
    for data in text.split("\n\n").filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: "))) {
        if data == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        let delta = &chunk["choices"][0]["delta"];
        for (key, thought) in [("reasoning_content", true), ("content", false)] {
            if let Some(t) = delta[key].as_str().filter(|t| !t.is_empty()) {
                pieces.push((thought, t.to_string()));
            }
        }
    }
    pieces
}

fn message(answer: &Value) -> (String, Option<String>) {
    let m = &answer["choices"][0]["message"];
    (m["content"].as_str().unwrap().to_string(), m["reasoning_content"].as_str().map(str::to_string))
}

fn ask(extra: Value) -> Value {
    let mut body = json!({ "messages": [{ "role": "user", "content": "Think, then answer: what is a cat?" }],
        "max_tokens": 48, "grammar": THINK_GRAMMAR });
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}


#[test]
fn thinking_comes_back_as_reasoning_content_whole_and_streamed_and_speculation_keeps_it() {
    let template = template_file("qwen3.jinja", QWEN3_TEMPLATE);
    let drafter = common::shipped_drafter();
    let spec = serve("reasoning-spec", &template, &["--drafter", drafter.to_str().unwrap(), "--lookup"]);
    let plain = serve("reasoning-plain", &template, &["--select", "none"]);

    // The raw answer, tags included (`reasoning_format: none`), splits into the two fields.
    let raw = message(&post_ok(&spec, "/v1/chat/completions", ask(json!({ "reasoning_format": "none" })))).0;
    assert!(raw.starts_with("<think>\n") && raw.contains("</think>"), "{raw}");
    let answer = post_ok(&spec, "/v1/chat/completions", ask(json!({})));
    let (content, reasoning) = message(&answer);
    let reasoning = reasoning.unwrap_or_else(|| panic!("no reasoning_content: {answer}"));
    assert!(!content.contains("think>") && !reasoning.contains("think>"), "{answer}");
    assert!(!content.is_empty() && reasoning.trim().chars().all(|c| c.is_ascii_lowercase()), "{answer}");
    assert_eq!(raw, format!("<think>\n{reasoning}</think>\n\n{content}"));
    for format in ["deepseek", "deepseek-legacy", "auto"] {
        let again = post_ok(&spec, "/v1/chat/completions", ask(json!({ "reasoning_format": format })));
        assert_eq!(message(&again), (content.clone(), Some(reasoning.clone())), "{format}");
    }
    // Speculation (drafter and look-up) keeps the text: a plain server answers the same.
    assert_eq!(message(&post_ok(&plain, "/v1/chat/completions", ask(json!({})))), (content.clone(), Some(reasoning.clone())));
    assert!(answer["timings"]["draft_n"].as_u64().unwrap() > 0, "the speculating server did not draft: {answer}");

    // Streamed: the thinking in `delta.reasoning_content` pieces, then the content, the same texts.
    let pieces = streamed(&spec, ask(json!({})));
    let first_content = pieces.iter().position(|(thought, _)| !thought).expect("no content was streamed");
    assert!(first_content > 0 && pieces[first_content..].iter().all(|(thought, _)| !thought), "{pieces:?}");
    let join = |thought: bool| pieces.iter().filter(|p| p.0 == thought).map(|p| p.1.as_str()).collect::<String>();
    assert_eq!((join(false), join(true)), (content.clone(), reasoning.clone()));
    // `none` streams the raw text as content.
    let raw_pieces = streamed(&spec, ask(json!({ "reasoning_format": "none" })));
    assert!(raw_pieces.iter().all(|(thought, _)| !thought));
    assert_eq!(raw_pieces.into_iter().map(|p| p.1).collect::<String>(), raw);
}

#[test]
fn enable_thinking_and_rea_off_close_the_thinking_in_the_prompt() {
    let template = template_file("qwen3-rea.jinja", QWEN3_TEMPLATE);
    let on = serve("reasoning-on", &template, &[]);
    let off = serve("reasoning-off", &template, &["-rea", "off"]);
    let hi = json!([{ "role": "user", "content": "hi" }]);
    let prompt = |server: &common::Server, body: Value| post_ok(server, "/apply-template", body)["prompt"].as_str().unwrap().to_string();
    let closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
    assert!(!prompt(&on, json!({ "messages": hi })).ends_with(closed));
    assert!(prompt(&off, json!({ "messages": hi })).ends_with(closed));
    let kwargs = |on: bool| json!({ "messages": hi, "chat_template_kwargs": { "enable_thinking": on } });
    assert!(prompt(&on, kwargs(false)).ends_with(closed));
    assert!(!prompt(&off, kwargs(true)).ends_with(closed), "a request's enable_thinking wins over -rea");

    // With the thinking closed in the prompt, the answer is all content (nothing to split).
    let body = json!({ "messages": hi, "max_tokens": 12, "chat_template_kwargs": { "enable_thinking": false } });
    let answer = post_ok(&on, "/v1/chat/completions", body.clone());
    let (content, reasoning) = message(&answer);
    assert_eq!(reasoning, None, "{answer}");
    let raw = message(&post_ok(&on, "/v1/chat/completions", with(&body, "reasoning_format", json!("none")))).0;
    assert_eq!(content, raw);
}

#[test]
fn a_template_that_opens_the_thinking_itself_is_parsed_as_thinking_from_the_first_token() {
    let server = serve("reasoning-forced-open", &template_file("qwen3-open.jinja", &opened_template()), &[]);
    let grammar = r#"root ::= [a-z]{4,16} "\n</think>\n\n" [a-z]{4,16}"#;
    let body = json!({ "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 48, "grammar": grammar });
    let raw = message(&post_ok(&server, "/v1/chat/completions", with(&body, "reasoning_format", json!("none")))).0;
    let answer = post_ok(&server, "/v1/chat/completions", body.clone());
    let (content, reasoning) = message(&answer);
    let reasoning = reasoning.unwrap_or_else(|| panic!("no reasoning_content: {answer}"));
    assert_eq!(raw, format!("{reasoning}</think>\n\n{content}"), "{answer}");
    let pieces = streamed(&server, body);
    let join = |thought: bool| pieces.iter().filter(|p| p.0 == thought).map(|p| p.1.as_str()).collect::<String>();
    assert_eq!((join(false), join(true)), (content, reasoning));
}

/// Qwen3's template, its generation prompt opening the thinking (as DeepSeek-R1's and newer
/// Qwen3 templates do).
fn opened_template() -> String {
    let opened = QWEN3_TEMPLATE.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}");
    assert_ne!(opened, QWEN3_TEMPLATE);
    opened
}

fn with(body: &Value, key: &str, value: Value) -> Value {
    let mut body = body.clone();
    body[key] = value;
    body
}

#[test]
fn values_llama_server_refuses_are_refused_naming_the_field() {
    let server = serve("reasoning-refusals", &template_file("qwen3-refusals.jinja", QWEN3_TEMPLATE), &[]);
    let hi = json!([{ "role": "user", "content": "hi" }]);
    for (body, field) in [
        (json!({ "messages": hi, "reasoning_format": "deepthink" }), "reasoning_format"),
        (json!({ "messages": hi, "chat_template_kwargs": "enable_thinking" }), "chat_template_kwargs"),
        (json!({ "messages": hi, "chat_template_kwargs": { "enable_thinking": "false" } }), "chat_template_kwargs"),
    ] {
        let (code, text) = post(&server, "/v1/chat/completions", &body);
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!((code, error["error"]["param"].as_str()), (400, Some(field)), "{body}: {text}");
    }
    assert_eq!(post(&server, "/health", &json!({})).0, 405, "the server kept serving");
}

/// dflash2 renders with minijinja, llama.cpp's parser reads what llama.cpp's renderer makes: for
/// the Qwen3 template the two prompts are the same, thinking on and off, over tools' and earlier
/// answers' turns.
#[test]
fn minijinja_renders_the_prompt_llama_cpp_renders() {
    let model = Model::load(&common::real_model(common::SMOLLM2), &ModelParams::default()).unwrap();
    let template = ChatTemplate::new(&model, &TemplateChoice::Given(QWEN3_TEMPLATE.to_string())).unwrap();
    let conversations = [
        json!([{ "role": "user", "content": "hi" }]),
        json!([{ "role": "system", "content": "Be brief." }, { "role": "user", "content": "2+2?" },
               { "role": "assistant", "content": "4", "reasoning_content": "two and two" }, { "role": "user", "content": "and 3+3?" }]),
        json!([{ "role": "user", "content": "weather?" },
               { "role": "assistant", "content": "", "tool_calls": [{ "type": "function", "id": "c1",
                   "function": { "name": "get_weather", "arguments": "{\"city\": \"Paris\"}" } }] },
               { "role": "tool", "tool_call_id": "c1", "content": "sunny" }]),
    ];
    for messages in conversations {
        let messages = messages.as_array().unwrap().clone();
        for thinking in [true, false] {
            let mut vars = Vars::new();
            vars.insert("enable_thinking".into(), json!(thinking));
            let ours = template.render_with_tools(&messages, None, true, &vars).unwrap();
            let (theirs, _) = template.answer_parser(&messages, &vars, true, "auto").unwrap().expect("llama.cpp reads the template");
            assert_eq!(ours, theirs.prompt, "thinking {thinking}: {messages:?}");
        }
    }
}

/// Server-sent events of a streamed POST: (event name, data).
fn events(server: &common::Server, path: &str, mut body: Value) -> Vec<(String, Value)> {
    body["stream"] = json!(true);
    let (code, text) = post(server, path, &body);
    assert_eq!(code, 200, "{text}");
    text.split("\n\n")
        .filter_map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data = e.lines().find_map(|l| l.strip_prefix("data: "))?;
            Some((name.to_string(), serde_json::from_str(data).unwrap()))
        })
        .collect()
}

#[test]
fn the_responses_and_messages_apis_carry_the_thinking_as_their_own_items() {
    let server = serve("reasoning-apis", &template_file("qwen3-apis.jinja", QWEN3_TEMPLATE), &[]);
    let (content, reasoning) = message(&post_ok(&server, "/v1/chat/completions", ask(json!({}))));
    let reasoning = reasoning.expect("the chat path splits the thinking out");
    let question = ask(json!({}))["messages"][0]["content"].clone();

    // Responses: a `reasoning` item, then the message.
    let body = json!({ "input": question, "max_output_tokens": 48, "grammar": THINK_GRAMMAR });
    let whole = post_ok(&server, "/v1/responses", body.clone());
    let output = &whole["output"];
    assert_eq!((output[0]["type"].as_str(), output[0]["content"][0]["text"].as_str()), (Some("reasoning"), Some(reasoning.as_str())), "{whole}");
    assert_eq!((output[1]["type"].as_str(), output[1]["content"][0]["text"].as_str()), (Some("message"), Some(content.as_str())), "{whole}");
    let streamed = events(&server, "/v1/responses", body);
    let deltas = |kind: &str| streamed.iter().filter(|(e, _)| e == kind).map(|(_, d)| d["delta"].as_str().unwrap()).collect::<String>();
    assert_eq!((deltas("response.reasoning_text.delta"), deltas("response.output_text.delta")), (reasoning.clone(), content.clone()));
    let index_of = |kind: &str| streamed.iter().find(|(e, _)| e == kind).map(|(_, d)| d["output_index"].as_u64()).unwrap();
    assert_eq!((index_of("response.reasoning_text.delta"), index_of("response.output_text.delta")), (Some(0), Some(1)));
    let items = |o: &Value| o.as_array().unwrap().iter().map(|i| (i["type"].clone(), i["content"][0]["text"].clone())).collect::<Vec<_>>();
    assert_eq!(items(&streamed.last().unwrap().1["response"]["output"]), items(&whole["output"]));

    // Messages: a `thinking` block, then the text.
    let body = json!({ "messages": [{ "role": "user", "content": question }], "max_tokens": 48, "grammar": THINK_GRAMMAR });
    let whole = post_ok(&server, "/v1/messages", body.clone());
    let blocks = &whole["content"];
    assert_eq!((blocks[0]["type"].as_str(), blocks[0]["thinking"].as_str()), (Some("thinking"), Some(reasoning.as_str())), "{whole}");
    assert_eq!((blocks[1]["type"].as_str(), blocks[1]["text"].as_str()), (Some("text"), Some(content.as_str())), "{whole}");
    let streamed = events(&server, "/v1/messages", body);
    let deltas = |kind: &str, field: &str| {
        streamed.iter().filter(|(e, d)| e == "content_block_delta" && d["delta"]["type"] == kind).map(|(_, d)| d["delta"][field].as_str().unwrap()).collect::<String>()
    };
    assert_eq!((deltas("thinking_delta", "thinking"), deltas("text_delta", "text")), (reasoning, content));
    let starts: Vec<(u64, String)> = streamed
        .iter()
        .filter(|(e, _)| e == "content_block_start")
        .map(|(_, d)| (d["index"].as_u64().unwrap(), d["content_block"]["type"].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(starts, [(0, "thinking".to_string()), (1, "text".to_string())]);
}

/// Markers that are control tokens (gpt-oss's channels are) decode to no text; the answer's text
/// writes them out for the parser, as llama-server's preserved tokens. SmolLM2's `<jupyter_text>`
/// and `<jupyter_code>` stand for `<think>` and `</think>` in Qwen3's template here.
#[test]
fn thinking_markers_that_are_control_tokens_are_seen_by_the_parser() {
    let template = QWEN3_TEMPLATE.replace("</think>", "<jupyter_code>").replace("<think>", "<jupyter_text>");
    let server = serve("reasoning-control-tokens", &template_file("qwen3-control.jinja", &template), &[]);
    let pieces = post_ok(&server, "/tokenize", json!({ "content": "<jupyter_text><jupyter_code>", "with_pieces": true }));
    assert_eq!(pieces["tokens"].as_array().unwrap().len(), 2, "each marker is one token: {pieces}");
    let plain = post_ok(&server, "/tokenize", json!({ "content": "<jupyter_text>", "parse_special": false }));
    assert!(plain["tokens"].as_array().unwrap().len() > 1, "`<jupyter_text>` is a special token");

    let grammar = r#"root ::= <jupyter_text> "\n" [a-z]{4,16} "\n" <jupyter_code> "\n\n" [a-z]{4,16}"#;
    let body = json!({ "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 48, "grammar": grammar });
    // Not split, the markers are written out, as llama-server writes its preserved tokens.
    let raw_answer = post_ok(&server, "/v1/chat/completions", with(&body, "reasoning_format", json!("none")));
    let raw = message(&raw_answer).0;
    let answer = post_ok(&server, "/v1/chat/completions", body.clone());
    let (content, reasoning) = message(&answer);
    let reasoning = reasoning.unwrap_or_else(|| panic!("no reasoning_content: {answer}"));
    assert_eq!(raw, format!("<jupyter_text>\n{reasoning}<jupyter_code>\n\n{content}"), "{answer}");
    assert!(!content.contains("jupyter") && !reasoning.contains("jupyter"), "{answer}");
    assert_eq!(answer["usage"], raw_answer["usage"], "the same tokens");
    let pieces = streamed(&server, body);
    let join = |thought: bool| pieces.iter().filter(|p| p.0 == thought).map(|p| p.1.as_str()).collect::<String>();
    assert_eq!((join(false), join(true)), (content, reasoning));
}

/// `--reasoning-budget`: past the budget only the end of the thinking may follow (after the
/// message). llama.cpp's budget sampler is applied with the grammar, to drafts and verify rows
/// alike, so a speculating server answers as a plain one.
#[test]
fn a_reasoning_budget_ends_the_thinking_and_speculation_keeps_the_answer() {
    let template = template_file("qwen3-budget.jinja", &opened_template());
    let drafter = common::shipped_drafter();
    let budget = ["--reasoning-budget", "5", "--reasoning-budget-message", " Enough."];
    let spec = serve("reasoning-budget-spec", &template, &[&budget[..], &["--drafter", drafter.to_str().unwrap(), "--lookup"]].concat());
    let plain = serve("reasoning-budget-plain", &template, &[&budget[..], &["--select", "none"]].concat());
    let free = serve("reasoning-budget-none", &template, &[]);
    let body = json!({ "messages": [{ "role": "user", "content": "What is the capital of France? Think step by step." }], "max_tokens": 40 });

    let answer = post_ok(&spec, "/v1/chat/completions", body.clone());
    let (content, reasoning) = message(&answer);
    let reasoning = reasoning.unwrap_or_else(|| panic!("no reasoning_content: {answer}"));
    assert!(reasoning.ends_with(" Enough."), "{answer}");
    let thought = reasoning.strip_suffix(" Enough.").unwrap();
    let n = post_ok(&spec, "/tokenize", json!({ "content": thought }))["tokens"].as_array().unwrap().len();
    assert!(n <= 5, "{n} tokens of thinking past a budget of 5: {thought:?}");
    let (free_content, free_reasoning) = message(&post_ok(&free, "/v1/chat/completions", body.clone()));
    assert_ne!((free_content, free_reasoning), (content.clone(), Some(reasoning.clone())), "the budget changed nothing");
    let raw = message(&post_ok(&spec, "/v1/chat/completions", with(&body, "reasoning_format", json!("none")))).0;
    assert!(raw.starts_with(&format!("{reasoning}</think>")) && raw.ends_with(&content), "the budget holds whatever the format: {raw:?}");

    let plain_answer = post_ok(&plain, "/v1/chat/completions", body.clone());
    assert_eq!(message(&plain_answer), (content, Some(reasoning)));
    assert_eq!(plain_answer["usage"], answer["usage"]);
}
