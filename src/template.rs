//! Chat templates: the model's own Jinja template from its GGUF, rendered as llama-server
//! (`--jinja`) and Hugging Face's `apply_chat_template` render it, so the same messages give the
//! same prompt tokens here and there. minijinja does the Jinja; Python's string and dict methods
//! come from minijinja-contrib's pycompat. llama.cpp's own template code serves its built-in
//! template names, and any template minijinja cannot compile (llama.cpp then picks the format
//! from the template's text, as it did before Jinja).

use crate::llama::{apply_llama_template, builtin_chat_templates, AnswerParser, ChatMessage, ChatRender, LlamaChat, LlamaError, Model, Result, Token};
use minijinja::value::{Kwargs, Serde, Value};
use minijinja::{Environment, Error, ErrorKind};

/// Which template renders chat messages (`--chat-template` / `--chat-template-file`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum TemplateChoice {
    /// The template in the target's GGUF (`tokenizer.chat_template`).
    #[default]
    Model,
    /// A llama.cpp built-in name (`chatml`, `llama3`, ...) or a Jinja template's text.
    Given(String),
}

enum Renderer {
    Jinja(Box<Environment<'static>>),
    /// llama.cpp's template code, given a built-in name or a template it recognises.
    Llama(String),
}

/// A chat template ready to render messages for one model.
pub struct ChatTemplate {
    source: String,
    renderer: Renderer,
    bos: String,
    eos: String,
    /// The tokenizer adds BOS itself: a leading BOS in the rendered text is dropped (as
    /// llama-server does), or the prompt would start with two.
    strip_bos: bool,
    /// Whether the template writes the request's tools into the prompt (found once, by a probe).
    describes_tools: std::sync::OnceLock<bool>,
    /// llama.cpp's own templates from the same text: the parser of a Jinja template's answers
    /// (None where llama.cpp cannot read the template: answers are then not split).
    llama: Option<LlamaChat>,
}

/// Template variables a request sets besides the messages (llama-server's
/// `chat_template_kwargs`, and `enable_thinking`).
pub type Vars = serde_json::Map<String, serde_json::Value>;

const NAME: &str = "chat";

impl ChatTemplate {
    pub fn new(model: &Model, choice: &TemplateChoice) -> Result<Self> {
        let (bos, eos, strip_bos) = model.special_texts();
        let given = match choice {
            TemplateChoice::Model => None,
            TemplateChoice::Given(t) => Some(t.clone()),
        };
        let source = match &given {
            Some(t) => t.clone(),
            None => model.chat_template().ok_or_else(|| {
                LlamaError::ChatTemplate(format!(
                    "{} has no chat template; give one with --chat-template NAME (llama.cpp's: {}) or --chat-template-file",
                    model.path(),
                    builtin_chat_templates().join(", ")
                ))
            })?,
        };
        let renderer = if given.is_some() && builtin_chat_templates().contains(&source) {
            Renderer::Llama(source.clone())
        } else {
            match jinja(&source) {
                Ok(env) => Renderer::Jinja(Box::new(env)),
                Err(e) if given.is_some() => {
                    return Err(LlamaError::ChatTemplate(format!("the given template does not compile: {e:#}")))
                }
                Err(e) => {
                    tracing::warn!(
                        "the chat template of {} does not compile as Jinja ({e}); llama.cpp picks its format from its text",
                        model.path()
                    );
                    Renderer::Llama(source.clone())
                }
            }
        };
        let llama = match &renderer {
            Renderer::Jinja(_) => LlamaChat::new(model, &source)
                .inspect_err(|e| tracing::warn!("llama.cpp cannot read the chat template ({e}); answers are not split into reasoning and content"))
                .ok(),
            Renderer::Llama(_) => None,
        };
        Ok(Self { source, renderer, bos, eos, strip_bos, describes_tools: Default::default(), llama })
    }

    /// The template's text (or the built-in name).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template is rendered as Jinja (else by llama.cpp's template code).
    pub fn is_jinja(&self) -> bool {
        matches!(self.renderer, Renderer::Jinja(_))
    }

    /// Render `messages`, ending with the start of the assistant's turn when
    /// `add_generation_prompt`. A template that refuses the messages (`raise_exception`)
    /// gives its own message as the error.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let messages: Vec<serde_json::Value> =
            messages.iter().map(|m| serde_json::json!({ "role": m.role, "content": m.content })).collect();
        self.render_with_tools(&messages, None, add_generation_prompt, &Vars::new())
    }

    /// Render messages given as JSON (assistant `tool_calls`, `tool` results) with a request's
    /// `tools` (OpenAI's shape), as Hugging Face's `apply_chat_template(messages, tools=tools)`;
    /// `vars` are further template variables, over the others of the same name (as llama.cpp's).
    /// llama.cpp's template code reads only each message's role and text.
    pub fn render_with_tools(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        vars: &Vars,
    ) -> Result<String> {
        let text = match &self.renderer {
            Renderer::Llama(tmpl) => {
                let text_of = |v: &serde_json::Value| v.as_str().map_or_else(|| v.to_string(), str::to_string);
                let messages: Vec<ChatMessage> = messages
                    .iter()
                    .map(|m| ChatMessage {
                        role: m["role"].as_str().unwrap_or_default().to_string(),
                        content: m.get("content").filter(|c| !c.is_null()).map(text_of).unwrap_or_default(),
                    })
                    .collect();
                apply_llama_template(tmpl, &messages, add_generation_prompt)?
            }
            Renderer::Jinja(env) => {
                let tmpl = env.get_template(NAME).expect("added at construction");
                let base = minijinja::context! {
                    messages => Value::from(Serde(messages)),
                    tools => tools.map(|t| Value::from(Serde(t))),
                    add_generation_prompt => add_generation_prompt,
                    bos_token => self.bos.as_str(),
                    eos_token => self.eos.as_str(),
                };
                // (of merged maps, the first that has a key gives it)
                let ctx = minijinja::value::merge_maps([Value::from(Serde(vars)), base]);
                tmpl.render(ctx).map_err(|e| match e.kind() {
                    ErrorKind::InvalidOperation if e.detail().is_some() => {
                        LlamaError::ChatTemplate(e.detail().unwrap_or_default().to_string())
                    }
                    _ => LlamaError::ChatTemplate(format!("rendering failed: {e:#}")),
                })?
            }
        };
        Ok(match text.strip_prefix(self.bos.as_str()) {
            Some(rest) if self.strip_bos && !self.bos.is_empty() => rest.to_string(),
            _ => text,
        })
    }

    /// Whether the template writes a request's tools into the prompt itself: a probe rendering
    /// shows a tool's name (llama.cpp finds its templates' capabilities the same way).
    pub fn describes_tools(&self) -> bool {
        *self.describes_tools.get_or_init(|| {
            const PROBE: &str = "dflash2_probe_tool";
            let tool = serde_json::json!({ "type": "function", "function": {
                "name": PROBE, "description": "", "parameters": { "type": "object", "properties": {} } } });
            let user = serde_json::json!({ "role": "user", "content": "x" });
            self.is_jinja() && self.render_with_tools(&[user], Some(&[tool]), true, &Vars::new()).is_ok_and(|t| t.contains(PROBE))
        })
    }

    /// llama.cpp's rendering of `messages` with `vars` (the prompt, which [`render_with_tools`]
    /// gives too, and what the answer continues) and the parser that splits the answer into
    /// reasoning and content for `reasoning_format` (llama.cpp's name); None where llama.cpp
    /// cannot read the template.
    ///
    /// [`render_with_tools`]: Self::render_with_tools
    pub fn answer_parser(
        &self,
        messages: &[serde_json::Value],
        vars: &Vars,
        add_generation_prompt: bool,
        reasoning_format: &str,
    ) -> Result<Option<(ChatRender, AnswerParser)>> {
        let Some(llama) = &self.llama else { return Ok(None) };
        let thinking = vars.get("enable_thinking").and_then(serde_json::Value::as_bool).unwrap_or(true);
        llama.apply(messages, vars, add_generation_prompt, thinking, reasoning_format).map(Some)
    }

    /// The prompt tokens of `messages`, as every chat path (CLI, server, C ABI) decodes them.
    pub fn tokens(&self, model: &Model, messages: &[ChatMessage]) -> Result<Vec<Token>> {
        model.tokenize(&self.render(messages, true)?, true, true)
    }
}

/// A Jinja environment with the one template, set up as Hugging Face's (trim_blocks,
/// lstrip_blocks, Python methods, `raise_exception`, `strftime_now`, Python's `tojson`).
fn jinja(source: &str) -> std::result::Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_syntax(minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build()?);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
    env.add_filter("tojson", tojson);
    env.add_template_owned(NAME, source.to_string())?;
    Ok(env)
}

/// Local time formatted with C's `strftime` (Llama 3 templates print today's date).
fn strftime_now(fmt: &str) -> String {
    let Ok(cfmt) = std::ffi::CString::new(fmt) else { return String::new() };
    let mut buf = vec![0u8; 256];
    // SAFETY: time/localtime_r/strftime write into locals and `buf` within its length.
    let n = unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        libc::localtime_r(&now, &mut tm);
        libc::strftime(buf.as_mut_ptr().cast(), buf.len(), cfmt.as_ptr(), &tm)
    };
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// Python's `json.dumps(x, ensure_ascii=False, indent=indent)`, which is what templates written
/// for Hugging Face expect (`", "` and `": "` separators, no HTML escaping).
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    python_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn python_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&J::String(k.clone()).to_string());
                out.push_str(": ");
                python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, ctx: Value) -> String {
        jinja(source).unwrap().get_template(NAME).unwrap().render(ctx).unwrap()
    }

    #[test]
    fn tojson_writes_what_python_writes() {
        let v = Value::from(Serde(serde_json::json!({"name": "f", "args": [1, 2.5, "é<>"], "empty": {}})));
        assert_eq!(
            render("{{ v | tojson }}", minijinja::context! { v => v.clone() }),
            r#"{"name": "f", "args": [1, 2.5, "é<>"], "empty": {}}"#
        );
        assert_eq!(
            render("{{ v | tojson(indent=2) }}", minijinja::context! { v => v }),
            "{\n  \"name\": \"f\",\n  \"args\": [\n    1,\n    2.5,\n    \"é<>\"\n  ],\n  \"empty\": {}\n}"
        );
    }

    #[test]
    fn python_methods_blocks_and_exceptions() {
        // trim_blocks/lstrip_blocks as in Hugging Face, str.strip() through pycompat
        let src = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content.strip() }}]\n  {% endif %}\n{% endfor %}";
        let msgs = [ChatMessage { role: "user".into(), content: "  hi  ".into() }];
        assert_eq!(render(src, minijinja::context! { messages => Value::from(Serde(msgs)) }), "[hi]\n");
        let err = jinja("{{ raise_exception('roles must alternate') }}")
            .unwrap()
            .get_template(NAME)
            .unwrap()
            .render(minijinja::context! {})
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidOperation);
        assert_eq!(err.detail(), Some("roles must alternate"));
    }
}
