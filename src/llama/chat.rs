//! llama.cpp's chat code (`common/chat.cpp`): its own rendering of a chat, and the parser it
//! derives from the template, which splits an answer into reasoning and content exactly as
//! llama-server does (Qwen3's `<think>`, gpt-oss's channels, templates that open the thinking
//! themselves). Reused rather than rewritten: that parser knows every template llama.cpp knows.
use super::{shim, LlamaError, Model, Result};
use std::ffi::{c_char, CStr, CString};
use std::ptr::NonNull;

/// llama.cpp's templates for one model.
pub struct LlamaChat {
    ptr: NonNull<shim::dflash2_chat>,
}

// Read-only once made: every render starts its own Jinja context.
unsafe impl Send for LlamaChat {}
unsafe impl Sync for LlamaChat {}

impl Drop for LlamaChat {
    fn drop(&mut self) {
        unsafe { shim::dflash2_chat_free(self.ptr.as_ptr()) }
    }
}

/// What llama.cpp's rendering of one request gives besides its parser.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct ChatRender {
    /// The prompt as llama.cpp renders it.
    pub prompt: String,
    /// The end of the prompt that the answer continues (the parser reads the two together, so
    /// a template that opens `<think>` itself is parsed as thinking from the first token).
    pub generation_prompt: String,
    pub supports_thinking: bool,
    pub thinking_start_tag: String,
    pub thinking_end_tags: Vec<String>,
    /// Special tokens the answer's text must show for the parser to see them.
    pub preserved_tokens: Vec<String>,
}

/// An answer split as llama-server splits it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
pub struct Split {
    pub content: String,
    pub reasoning_content: String,
}

/// The parser of one request's answer.
pub struct AnswerParser {
    ptr: NonNull<shim::dflash2_chat_parser>,
}

// Parsing reads the parser and copies its settings.
unsafe impl Send for AnswerParser {}
unsafe impl Sync for AnswerParser {}

impl Drop for AnswerParser {
    fn drop(&mut self) {
        unsafe { shim::dflash2_chat_parser_free(self.ptr.as_ptr()) }
    }
}

impl LlamaChat {
    /// llama.cpp's templates for `model` from a Jinja template's text.
    pub fn new(model: &Model, template: &str) -> Result<Self> {
        let tmpl = c_string(template)?;
        let mut error = std::ptr::null_mut();
        let raw = unsafe { shim::dflash2_chat_new(model.as_ptr(), tmpl.as_ptr(), &mut error) };
        NonNull::new(raw).map(|ptr| Self { ptr }).ok_or_else(|| failure(error))
    }

    /// Render `messages` (OpenAI's shape) with the template variables `kwargs`, and set up the
    /// parser of the answer for `reasoning_format` (llama.cpp's name).
    pub fn apply(
        &self,
        messages: &[serde_json::Value],
        kwargs: &serde_json::Map<String, serde_json::Value>,
        add_generation_prompt: bool,
        enable_thinking: bool,
        reasoning_format: &str,
    ) -> Result<(ChatRender, AnswerParser)> {
        let messages = c_string(&serde_json::Value::from(messages.to_vec()).to_string())?;
        let kwargs = c_string(&serde_json::Value::Object(kwargs.clone()).to_string())?;
        let format = c_string(reasoning_format)?;
        let (mut info, mut error) = (std::ptr::null_mut(), std::ptr::null_mut());
        let raw = unsafe {
            shim::dflash2_chat_apply(
                self.ptr.as_ptr(),
                messages.as_ptr(),
                kwargs.as_ptr(),
                add_generation_prompt,
                enable_thinking,
                format.as_ptr(),
                &mut info,
                &mut error,
            )
        };
        let parser = NonNull::new(raw).map(|ptr| AnswerParser { ptr }).ok_or_else(|| failure(error))?;
        let info = take_string(info).ok_or_else(|| LlamaError::ChatTemplate("llama.cpp gave no rendering".into()))?;
        let render = serde_json::from_str(&info).map_err(|e| LlamaError::ChatTemplate(format!("llama.cpp's rendering: {e}")))?;
        Ok((render, parser))
    }
}

impl AnswerParser {
    /// Split `text`, an answer so far when `partial` (a tag begun at its end is held back).
    pub fn parse(&self, text: &str, partial: bool) -> Result<Split> {
        let mut error = std::ptr::null_mut();
        let raw = unsafe { shim::dflash2_chat_parse(self.ptr.as_ptr(), text.as_ptr().cast(), text.len(), partial, &mut error) };
        let json = take_string(raw).ok_or_else(|| failure(error))?;
        serde_json::from_str(&json).map_err(|e| LlamaError::ChatTemplate(format!("llama.cpp's parse: {e}")))
    }
}

fn c_string(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| LlamaError::Invalid("a chat text holds a NUL byte".into()))
}

/// A string the shim allocated, freed here.
fn take_string(p: *mut c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    unsafe { shim::dflash2_string_free(p) };
    Some(s)
}

fn failure(error: *mut c_char) -> LlamaError {
    LlamaError::ChatTemplate(take_string(error).unwrap_or_else(|| "llama.cpp's chat code failed".into()))
}
