//! Reasoning output as llama-server gives it: the thinking a reasoning model writes before its
//! answer (Qwen3's `<think>`, gpt-oss's analysis channel) split out of `content` into
//! `reasoning_content`, whole or piece by piece as it streams. llama.cpp's own parser for the
//! served template does the split (`template::ChatTemplate::answer_parser`), so answers split
//! here as they do in llama-server. The split is on text only: the tokens are those of plain
//! decoding, whatever the mode.
use super::errors::ApiError;
use super::tools::{Parsed, Tools};
use super::AppState;
use crate::engine::{GenerateOptions, ReasoningBudget};
use crate::llama::{AnswerParser, ChatRender, Model, Split, Token};
use crate::template::Vars;
use serde_json::Value;
use std::sync::Mutex;

/// Where the reasoning goes (`--reasoning-format`, a request's `reasoning_format`; llama-server's).
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// Left in `content`, tags included.
    None,
    /// In `reasoning_content`, streamed as `delta.reasoning_content`.
    Deepseek,
    /// llama-server's older spelling: the bundled llama.cpp's parser splits it as `deepseek`.
    DeepseekLegacy,
    /// As `deepseek`.
    #[default]
    Auto,
}

impl ReasoningFormat {
    /// llama.cpp's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Deepseek => "deepseek",
            Self::DeepseekLegacy => "deepseek-legacy",
            Self::Auto => "auto",
        }
    }
}

/// Whether the model thinks (`-rea` / `--reasoning`): the template's `enable_thinking`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Thinking {
    On,
    Off,
    /// As the template decides (it is told `enable_thinking`: true).
    #[default]
    Auto,
}

/// What one chat request asks of its template and of its answer's split.
#[derive(Debug, Clone)]
pub struct Ask {
    /// Template variables: `chat_template_kwargs`, and `enable_thinking` always.
    pub vars: Vars,
    /// None: only the prompt is wanted (`/apply-template`, token counts).
    pub format: Option<ReasoningFormat>,
}

impl Ask {
    /// The request's `chat_template_kwargs` and `reasoning_format` over the server's settings;
    /// refused as llama-server refuses them, naming the field.
    pub fn of(s: &AppState, kwargs: Option<&Value>, format: Option<&str>) -> Result<Self, ApiError> {
        let mut vars = match kwargs {
            None | Some(Value::Null) => Vars::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(v) => {
                return Err(ApiError::invalid_param("chat_template_kwargs", format!("`chat_template_kwargs` must be an object, got {v}")))
            }
        };
        let thinking = match vars.get("enable_thinking") {
            None => s.defaults.thinking != Thinking::Off,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(ApiError::invalid_param(
                    "chat_template_kwargs",
                    format!("invalid type for \"enable_thinking\" (expected boolean, got {v})"),
                ))
            }
        };
        vars.insert("enable_thinking".into(), Value::Bool(thinking));
        let format = match format {
            None => s.defaults.reasoning_format,
            Some(f) => <ReasoningFormat as clap::ValueEnum>::from_str(f, false).map_err(|_| {
                ApiError::invalid_param(
                    "reasoning_format",
                    format!("Unknown reasoning format: {f} (none, deepseek, deepseek-legacy or auto)"),
                )
            })?,
        };
        Ok(Self { vars, format: Some(format) })
    }

    /// The same template variables, the answer not split (for routes that only render).
    pub fn prompt_only(self) -> Self {
        Self { format: None, ..self }
    }
}

/// The split of one request's answers (one per choice), and what it asks of their decoding.
pub struct Reasoning {
    parser: AnswerParser,
    /// `--reasoning-format none`: the answers stay whole (their markers and budget still hold).
    split: bool,
    /// Special tokens the answers' text must write out for the parser to see them.
    shown_special: Vec<Token>,
    /// The thinking's budget (`--reasoning-budget`), in the template's tokens.
    budget: Option<ReasoningBudget>,
    streams: Mutex<Vec<Streamed>>,
}

/// A streamed answer: its text so far and what of its split was sent.
#[derive(Debug, Clone, Default)]
struct Streamed {
    text: String,
    sent: Split,
}

impl Reasoning {
    /// The split by the parser of llama.cpp's rendering `render`, and `budget` tokens of thinking
    /// at most, then `message` (`--reasoning-budget`, `--reasoning-budget-message`), where the
    /// template has thinking tags.
    pub fn new(model: &Model, (render, parser): (ChatRender, AnswerParser), format: ReasoningFormat, budget: Option<(usize, &str)>) -> Self {
        let markers = render.preserved_tokens.iter().chain(Some(&render.thinking_start_tag)).chain(&render.thinking_end_tags);
        // a marker that is one control token (its plain text empty) must be written out
        let mut shown_special: Vec<Token> = markers
            .filter_map(|m| match model.tokenize(m, false, true).ok()?.as_slice() {
                [t] if model.token_bytes(*t, false).is_empty() => Some(*t),
                _ => None,
            })
            .collect();
        shown_special.sort_unstable();
        shown_special.dedup();
        let budget = budget.and_then(|(budget, message)| {
            let tokens = |t: &str| model.tokenize(t, false, true).ok().filter(|t| !t.is_empty());
            let end = render.thinking_end_tags.first()?;
            Some(ReasoningBudget {
                start: tokens(&render.thinking_start_tag)?,
                end: tokens(end)?,
                forced: tokens(&format!("{message}{end}"))?,
                budget,
                // a prompt that ends in the start tag opened the thinking itself
                open: render.generation_prompt.trim_end().ends_with(render.thinking_start_tag.as_str()),
            })
        });
        Self { parser, split: format != ReasoningFormat::None, shown_special, budget, streams: Mutex::default() }
    }

    /// What the split asks of the decoding: the markers written out, the budget applied.
    pub fn constrain(&self, opts: &mut GenerateOptions) {
        opts.shown_special = self.shown_special.clone();
        opts.reasoning_budget = self.budget.clone();
    }

    /// A whole answer's split (an answer the parser cannot read stays content).
    pub fn whole(&self, text: &str) -> Split {
        self.parse(text, false)
    }

    /// The split of choice `index`'s new `text` (a streamed piece): what is new of each part.
    /// A tag begun at the end is held back until it is whole.
    pub fn piece(&self, index: usize, text: &str) -> Split {
        self.advance(index, text, true)
    }

    /// What is left to send of choice `index`'s split once its answer ended.
    pub fn rest(&self, index: usize) -> Split {
        self.advance(index, "", false)
    }

    fn advance(&self, index: usize, text: &str, partial: bool) -> Split {
        let mut streams = self.streams.lock().expect("never poisoned: no panics inside");
        if streams.len() <= index {
            streams.resize(index + 1, Streamed::default());
        }
        let s = &mut streams[index];
        s.text.push_str(text);
        let now = self.parse(&s.text, partial);
        // each part only grows; a part the parser took back is not sent again
        let new = |now: &str, sent: &mut String| match now.strip_prefix(sent.as_str()) {
            Some(rest) => {
                *sent = now.to_string();
                rest.to_string()
            }
            None => String::new(),
        };
        Split {
            reasoning_content: new(&now.reasoning_content, &mut s.sent.reasoning_content),
            content: new(&now.content, &mut s.sent.content),
        }
    }

    fn parse(&self, text: &str, partial: bool) -> Split {
        if !self.split {
            return Split { content: text.to_string(), reasoning_content: String::new() };
        }
        self.parser.parse(text, partial).unwrap_or_else(|e| {
            tracing::warn!("the answer could not be split into reasoning and content: {e}");
            Split { content: text.to_string(), reasoning_content: String::new() }
        })
    }
}

/// A streamed piece of choice 0's answer: its new thinking, and its new content (all of it where
/// nothing is split).
pub fn streamed(reasoning: Option<&Reasoning>, text: &str) -> (String, String) {
    match reasoning {
        Some(r) => {
            let split = r.piece(0, text);
            (split.reasoning_content, split.content)
        }
        None => (String::new(), text.to_string()),
    }
}

/// A whole answer's thinking (none where it is not split or empty), then its content and the tool
/// calls parsed out of it: what every chat API answers.
pub fn answer(reasoning: Option<&Reasoning>, tools: Option<&Tools>, text: &str) -> (Option<String>, Parsed) {
    let split = reasoning.map(|r| r.whole(text));
    let text = split.as_ref().map_or(text, |s| &s.content);
    let parsed = match tools {
        Some(t) => t.parse(text),
        None => Parsed { content: Some(text.to_string()), calls: Vec::new() },
    };
    (split.map(|s| s.reasoning_content).filter(|r| !r.is_empty()), parsed)
}
