//! A frontend's own llama.cpp sampler chain, read as a law over tokens.
//!
//! Lossless verification needs the target's distribution at each row, not one draw from it.
//! A chain is filters (penalties, logit bias, grammar, top-k, top-p, min-p, temperature, ...)
//! that end in a draw (`dist`) or a pick (`greedy`): the law is the softmax of what the
//! filters leave, and the pick is its argmax. The chain's own history (penalties, grammar)
//! moves forward through [`ForeignChain::accept`], as the frontend's loop would.
use super::{LlamaError, Result, Token};
use llama_cpp_sys_2 as sys;
use std::ffi::CStr;
use std::ptr::NonNull;

/// How a chain ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Terminal {
    /// `greedy`: the argmax of what the filters leave (temperature 0).
    Greedy,
    /// `dist`: a draw from the softmax of what the filters leave.
    Dist,
}

pub struct ForeignChain {
    ptr: NonNull<sys::llama_sampler>,
    /// The members before the terminal one, applied in order.
    filters: Vec<NonNull<sys::llama_sampler>>,
    terminal: Terminal,
}

/// Members whose result is not a fixed law of the logits (they draw, or adapt per draw).
const NOT_A_LAW: &[&str] = &["mirostat", "mirostat-v2", "xtc"];

fn name(s: NonNull<sys::llama_sampler>) -> String {
    let p = unsafe { sys::llama_sampler_name(s.as_ptr()) };
    if p.is_null() {
        return String::new();
    }
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

impl ForeignChain {
    /// # Safety
    /// `ptr` must be a live sampler (a chain, or one `greedy` / `dist` sampler) of the libllama
    /// this crate links, used by no one else during the returned value's life.
    pub unsafe fn borrow_raw(ptr: *mut sys::llama_sampler) -> Result<Self> {
        let ptr = NonNull::new(ptr).ok_or_else(|| LlamaError::Invalid("the sampler chain is NULL".into()))?;
        let members: Vec<NonNull<sys::llama_sampler>> = if sys::llama_sampler_chain_get(ptr.as_ptr(), -1).is_null() {
            vec![ptr]
        } else {
            (0..sys::llama_sampler_chain_n(ptr.as_ptr()))
                .filter_map(|i| NonNull::new(sys::llama_sampler_chain_get(ptr.as_ptr(), i)))
                .collect()
        };
        let names: Vec<String> = members.iter().map(|&m| name(m)).collect();
        if let Some(bad) = names.iter().find(|n| NOT_A_LAW.contains(&n.as_str())) {
            return Err(LlamaError::Invalid(format!(
                "sampler `{bad}` is not a fixed law of the logits, so no verification can reproduce it"
            )));
        }
        let terminal = match names.last().map(String::as_str) {
            Some("greedy") => Terminal::Greedy,
            Some("dist") => Terminal::Dist,
            other => {
                return Err(LlamaError::Invalid(format!(
                    "the sampler chain must end in `greedy` or `dist`, it ends in `{}` ({})",
                    other.unwrap_or("nothing"),
                    names.join(" -> ")
                )))
            }
        };
        if let Some(n) = names[..names.len() - 1].iter().find(|n| *n == "greedy" || *n == "dist") {
            return Err(LlamaError::Invalid(format!("`{n}` before the end of the sampler chain ({})", names.join(" -> "))));
        }
        let filters = members[..members.len() - 1].to_vec();
        Ok(Self { ptr, filters, terminal })
    }

    pub fn terminal(&self) -> Terminal {
        self.terminal
    }

    /// What the filters leave of `logits`: (token, logit) pairs, forbidden tokens removed.
    fn filtered(&self, logits: &[f32]) -> Vec<(Token, f32)> {
        let mut data: Vec<sys::llama_token_data> =
            logits.iter().enumerate().map(|(i, &logit)| sys::llama_token_data { id: i as Token, logit, p: 0.0 }).collect();
        let mut cur = sys::llama_token_data_array { data: data.as_mut_ptr(), size: data.len(), selected: -1, sorted: false };
        for f in &self.filters {
            unsafe { sys::llama_sampler_apply(f.as_ptr(), &mut cur) };
        }
        // A sampler may point `data` elsewhere (its own buffer) and shrink `size`.
        let kept = unsafe { std::slice::from_raw_parts(cur.data, cur.size) };
        kept.iter().filter(|d| d.logit > f32::NEG_INFINITY && !d.logit.is_nan()).map(|d| (d.id, d.logit)).collect()
    }

    /// The chain's law at a row with these logits: tokens and probabilities (one token with
    /// probability 1 for a greedy chain). Errors when the filters leave nothing.
    pub fn law(&self, logits: &[f32]) -> Result<(Vec<Token>, Vec<f32>)> {
        let kept = self.filtered(logits);
        let Some(max) = kept.iter().map(|&(_, l)| l).reduce(f32::max) else {
            return Err(LlamaError::Invalid("the sampler chain leaves no token".into()));
        };
        if self.terminal == Terminal::Greedy {
            // greedy takes the first of equal maxima in the order the filters left
            let pick = kept.iter().find(|&&(_, l)| l == max).expect("max is one of them").0;
            return Ok((vec![pick], vec![1.0]));
        }
        let exps: Vec<f64> = kept.iter().map(|&(_, l)| f64::from(l - max).exp()).collect();
        let sum: f64 = exps.iter().sum();
        Ok((kept.iter().map(|&(id, _)| id).collect(), exps.iter().map(|&e| (e / sum) as f32).collect()))
    }

    /// The chain's own token at output row `row` of `ctx`'s last decode, as the frontend's loop
    /// samples it (its filters, its draw, its random stream); the chain takes it as generated.
    pub fn sample(&mut self, ctx: &super::Context, row: usize) -> Token {
        unsafe { sys::llama_sampler_sample(self.ptr.as_ptr(), ctx.ptr(), row as i32) }
    }

    /// The chain takes `token` as generated (penalty windows, grammar state).
    pub fn accept(&mut self, token: Token) {
        unsafe { sys::llama_sampler_accept(self.ptr.as_ptr(), token) }
    }
}
