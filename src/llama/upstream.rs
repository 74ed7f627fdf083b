//! llama.cpp's own drafting (`common/speculative.cpp`): its DFlash driver and its n-gram
//! types, for side-by-side baselines verified by the same engine.
use super::context::Context;
use super::{shim, LlamaError, Result, Token};
use std::ffi::CString;

/// llama.cpp's n-gram speculative types, by its own `--spec-type` names.
pub const LLAMA_NGRAM_TYPES: [&str; 5] = ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"];

/// Drafting through one of llama.cpp's speculative types, with its default settings.
pub struct UpstreamDrafter {
    ptr: std::ptr::NonNull<shim::dflash2_upstream>,
    // The driver points at the contexts: keep them alive until it is freed.
    _target: Context,
    _drafter: Option<Context>,
}

// The driver is used through `&mut self` only, like the contexts it drives.
unsafe impl Send for UpstreamDrafter {}

impl Drop for UpstreamDrafter {
    fn drop(&mut self) {
        unsafe { shim::dflash2_upstream_free(self.ptr.as_ptr()) }
    }
}

impl UpstreamDrafter {
    /// llama.cpp's DFlash driver over `target` and `drafter` (a DFlash drafter context made
    /// next to it): its block decode and greedy lattice walk. The caller manages the
    /// drafter's cache as for its own drafts.
    pub fn dflash(target: &Context, drafter: &Context, n_max: usize, n_seqs: usize) -> Result<Self> {
        Self::new("draft-dflash", target, Some(drafter), n_max, n_seqs)
    }

    /// llama.cpp's n-gram drafting of type `kind` (one of [`LLAMA_NGRAM_TYPES`]): drafts read
    /// off the context's own tokens, as llama-server's `--spec-type` does.
    pub fn ngram(kind: &str, target: &Context, n_seqs: usize) -> Result<Self> {
        if !LLAMA_NGRAM_TYPES.contains(&kind) {
            return Err(LlamaError::Invalid(format!("{kind}: llama.cpp's n-gram types are {}", LLAMA_NGRAM_TYPES.join(", "))));
        }
        Self::new(kind, target, None, 16, n_seqs)
    }

    fn new(kind: &str, target: &Context, drafter: Option<&Context>, n_max: usize, n_seqs: usize) -> Result<Self> {
        let name = CString::new(kind).map_err(|_| LlamaError::Invalid(format!("{kind:?}: not a type name")))?;
        let dft = drafter.map_or(std::ptr::null_mut(), |d| d.raw());
        let raw = unsafe { shim::dflash2_upstream_new(name.as_ptr(), target.raw(), dft, n_max as i32, n_seqs as u32) };
        let ptr = std::ptr::NonNull::new(raw)
            .ok_or_else(|| LlamaError::Invalid(format!("llama.cpp's {kind} drafting could not be set up")))?;
        Ok(Self { ptr, _target: target.share(), _drafter: drafter.map(Context::share) })
    }

    /// A new generation on `seq` whose prompt is `prompt`.
    pub fn begin(&mut self, seq: i32, prompt: &[Token]) -> Result<()> {
        let rc = unsafe { shim::dflash2_upstream_begin(self.ptr.as_ptr(), seq, prompt.as_ptr(), prompt.len() as i32) };
        if rc < 0 {
            return Err(LlamaError::Invalid("llama.cpp's drafting failed to begin a sequence".into()));
        }
        Ok(())
    }

    /// Draft up to `n_max` tokens after `last` at `pos0` of sequence `seq`, whose tokens
    /// before `last` are `context`.
    pub fn draft(&mut self, seq: i32, context: &[Token], last: Token, pos0: usize, n_max: usize) -> Result<Vec<Token>> {
        let mut out = vec![0 as Token; n_max];
        let n = unsafe {
            shim::dflash2_upstream_draft(
                self.ptr.as_ptr(),
                seq,
                context.as_ptr(),
                context.len() as i32,
                last,
                pos0 as i32,
                n_max as i32,
                out.as_mut_ptr(),
                out.len() as i32,
            )
        };
        if n < 0 {
            return Err(LlamaError::Invalid("llama.cpp's drafting failed".into()));
        }
        out.truncate(n as usize);
        Ok(out)
    }

    /// The target took `n` tokens of `seq`'s last draft.
    pub fn accept(&mut self, seq: i32, n: usize) -> Result<()> {
        if unsafe { shim::dflash2_upstream_accept(self.ptr.as_ptr(), seq, n as i32) } < 0 {
            return Err(LlamaError::Invalid("llama.cpp's drafting failed to take an acceptance".into()));
        }
        Ok(())
    }
}
