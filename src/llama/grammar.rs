//! llama.cpp's grammar sampler (GBNF, and JSON schemas through its converter in `common/`):
//! which tokens a grammar allows after what was generated so far; and its reasoning budget,
//! a constraint of the same kind (what may follow depends on what came), applied with it.

use super::{shim, LlamaError, Model, Result, Token};
use llama_cpp_sys_2 as sys;
use std::ffi::{CStr, CString};
use std::ptr::NonNull;

/// A grammar's state: the tokens accepted so far decide what may follow. Cloning copies the
/// state (a draft path's rows each need the state after their prefix). A reasoning budget, or a
/// grammar and a budget together ([`Grammar::all`]), are applied the same way.
pub struct Grammar {
    ptr: NonNull<sys::llama_sampler>,
}

// The sampler is plain data owned by this handle; it is used from one thread at a time.
unsafe impl Send for Grammar {}

impl Grammar {
    /// `gbnf` with its `root` rule, for `model`'s vocabulary.
    pub fn new(model: &Model, gbnf: &str) -> Result<Self> {
        Self::lazy(model, gbnf, &[])
    }

    /// `gbnf` that holds only from the first of `triggers` on: the text before it is free, and
    /// the grammar reads the generation from the trigger's first character (llama.cpp's lazy
    /// grammar). No triggers: it holds from the first token.
    pub fn lazy(model: &Model, gbnf: &str, triggers: &[String]) -> Result<Self> {
        let text = CString::new(gbnf).map_err(|_| LlamaError::Invalid("the grammar holds a NUL byte".into()))?;
        let root = CString::new("root").expect("no NUL");
        // SAFETY: the vocabulary outlives the call; the strings are NUL-terminated. The wrapper
        // catches llama.cpp's exceptions and returns NULL for a grammar it cannot parse.
        let ptr = if triggers.is_empty() {
            unsafe { sys::llama_rs_sampler_init_grammar(model.vocab_ptr(), text.as_ptr(), root.as_ptr()) }
        } else {
            let words: Vec<CString> = triggers
                .iter()
                .map(|w| CString::new(w.as_str()).map_err(|_| LlamaError::Invalid("a grammar trigger holds a NUL byte".into())))
                .collect::<Result<_>>()?;
            let mut ptrs: Vec<*const std::os::raw::c_char> = words.iter().map(|w| w.as_ptr()).collect();
            // SAFETY: as above; `ptrs` points into `words`, both alive for the call, and the
            // wrapper copies the words into escaped patterns.
            unsafe {
                sys::llama_rs_sampler_init_grammar_lazy(
                    model.vocab_ptr(),
                    text.as_ptr(),
                    root.as_ptr(),
                    ptrs.as_mut_ptr(),
                    ptrs.len(),
                    std::ptr::null(),
                    0,
                )
            }
        };
        NonNull::new(ptr)
            .map(|ptr| Self { ptr })
            .ok_or_else(|| LlamaError::Invalid("llama.cpp cannot parse the grammar (see its log for where)".into()))
    }

    /// llama.cpp's reasoning budget: after `start` (or from the first token when `open`),
    /// `budget` tokens of thinking; then `forced` is the only way on, token by token, unless
    /// `end` came first.
    pub fn reasoning_budget(model: &Model, start: &[Token], end: &[Token], forced: &[Token], budget: usize, open: bool) -> Result<Self> {
        let budget = i32::try_from(budget).unwrap_or(i32::MAX);
        // SAFETY: the slices outlive the call, which copies them; exceptions are caught in the shim.
        let ptr = unsafe {
            shim::dflash2_reasoning_budget(
                model.vocab_ptr(),
                start.as_ptr(),
                start.len(),
                end.as_ptr(),
                end.len(),
                forced.as_ptr(),
                forced.len(),
                budget,
                open,
            )
        };
        NonNull::new(ptr).map(|ptr| Self { ptr }).ok_or_else(|| LlamaError::Invalid("llama.cpp's reasoning budget could not be set up".into()))
    }

    /// The constraints of `parts` together: a token must pass each; each takes every token.
    pub fn all(parts: Vec<Grammar>) -> Option<Self> {
        if parts.len() <= 1 {
            return parts.into_iter().next();
        }
        // SAFETY: the chain takes ownership of each part's sampler (forgotten here, freed with it).
        unsafe {
            let chain = sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params());
            for part in parts {
                sys::llama_sampler_chain_add(chain, part.ptr.as_ptr());
                std::mem::forget(part);
            }
            NonNull::new(chain).map(|ptr| Self { ptr })
        }
    }

    /// The GBNF grammar of a JSON schema (llama.cpp's `json_schema_to_grammar`).
    pub fn from_json_schema(schema: &str) -> Result<String> {
        let text = CString::new(schema).map_err(|_| LlamaError::Invalid("the schema holds a NUL byte".into()))?;
        let mut out: *mut std::os::raw::c_char = std::ptr::null_mut();
        // SAFETY: `out` receives a malloc'd string that is freed below.
        let status = unsafe { sys::llama_rs_json_schema_to_grammar(text.as_ptr(), false, &mut out) };
        if status != sys::LLAMA_RS_STATUS_OK || out.is_null() {
            return Err(LlamaError::Invalid("llama.cpp cannot turn this JSON schema into a grammar".into()));
        }
        let grammar = unsafe { CStr::from_ptr(out) }.to_string_lossy().into_owned();
        unsafe { sys::llama_rs_string_free(out) };
        Ok(grammar)
    }

    /// Take `token` as generated. A token the grammar does not allow is an error (llama.cpp
    /// throws; the wrapper catches it) and leaves the state unusable.
    pub fn accept(&mut self, token: Token) -> Result<()> {
        // SAFETY: a live sampler.
        match unsafe { sys::llama_rs_sampler_accept(self.ptr.as_ptr(), token) } {
            sys::LLAMA_RS_STATUS_OK => Ok(()),
            _ => Err(LlamaError::Invalid(format!("token {token} does not follow the grammar"))),
        }
    }

    /// Whether the grammar allows `token` next.
    pub fn allows(&self, token: Token) -> bool {
        let mut one = [sys::llama_token_data { id: token, logit: 0.0, p: 0.0 }];
        self.apply(&mut one);
        one[0].logit != f32::NEG_INFINITY
    }

    /// `logits` (the whole vocabulary) with every token the grammar forbids set to -inf.
    pub fn mask(&self, logits: &[f32]) -> Vec<f32> {
        let mut data: Vec<sys::llama_token_data> =
            logits.iter().enumerate().map(|(id, &logit)| sys::llama_token_data { id: id as Token, logit, p: 0.0 }).collect();
        self.apply(&mut data);
        data.into_iter().map(|d| d.logit).collect()
    }

    fn apply(&self, data: &mut [sys::llama_token_data]) {
        let mut array = sys::llama_token_data_array { data: data.as_mut_ptr(), size: data.len(), selected: -1, sorted: false };
        // SAFETY: `array` points into `data`, which outlives the call; applying a grammar only
        // rewrites logits in place.
        unsafe { sys::llama_sampler_apply(self.ptr.as_ptr(), &mut array) };
    }
}

impl Clone for Grammar {
    fn clone(&self) -> Self {
        // SAFETY: a live sampler; cloning a grammar sampler copies its stacks.
        let ptr = unsafe { sys::llama_sampler_clone(self.ptr.as_ptr()) };
        Self { ptr: NonNull::new(ptr).expect("llama_sampler_clone returned NULL") }
    }
}

impl Drop for Grammar {
    fn drop(&mut self) {
        // SAFETY: owned, freed once.
        unsafe { sys::llama_sampler_free(self.ptr.as_ptr()) }
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammar")
    }
}
