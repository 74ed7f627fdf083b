//! llama.cpp's own DFlash driver (`common/speculative.cpp`), for side-by-side baselines.
use super::context::Context;
use super::{shim, LlamaError, Result, Token};

/// Drafting through llama.cpp's DFlash driver: its block decode and its greedy lattice
/// walk. The caller manages the drafter's cache as for its own drafts.
pub struct UpstreamDrafter {
    ptr: std::ptr::NonNull<shim::dflash2_upstream>,
    // The driver points at both contexts: keep them alive until it is freed.
    _target: Context,
    _drafter: Context,
}

// The driver is used through `&mut self` only, like the contexts it drives.
unsafe impl Send for UpstreamDrafter {}

impl Drop for UpstreamDrafter {
    fn drop(&mut self) {
        unsafe { shim::dflash2_upstream_free(self.ptr.as_ptr()) }
    }
}

impl UpstreamDrafter {
    /// A driver over `target` and `drafter` (a DFlash drafter context made next to it)
    /// drafting at most `n_max` tokens per block for `n_seqs` sequences.
    pub fn new(target: &Context, drafter: &Context, n_max: usize, n_seqs: usize) -> Result<Self> {
        let raw = unsafe {
            shim::dflash2_upstream_new(target.raw(), drafter.raw(), n_max as i32, n_seqs as u32)
        };
        let ptr = std::ptr::NonNull::new(raw)
            .ok_or_else(|| LlamaError::Invalid("llama.cpp's DFlash driver could not be created".into()))?;
        Ok(Self { ptr, _target: target.share(), _drafter: drafter.share() })
    }

    /// Draft up to `n_max` tokens after `last` at `pos0` of sequence `seq`.
    pub fn draft(&mut self, seq: i32, last: Token, pos0: usize, n_max: usize) -> Result<Vec<Token>> {
        let mut out = vec![0 as Token; n_max];
        let n = unsafe {
            shim::dflash2_upstream_draft(
                self.ptr.as_ptr(),
                seq,
                last,
                pos0 as i32,
                n_max as i32,
                out.as_mut_ptr(),
                out.len() as i32,
            )
        };
        if n < 0 {
            return Err(LlamaError::Invalid("llama.cpp's DFlash driver failed to draft".into()));
        }
        out.truncate(n as usize);
        Ok(out)
    }
}
