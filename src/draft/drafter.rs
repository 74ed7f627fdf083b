//! The DFlash drafter as llama.cpp runs it: target features are injected into its KV
//! cache, then one decode of `[last, MASK x (B-1)]` drafts a whole block.
use super::Lattice;
use crate::llama::{Batch, Context, ContextParams, FeatureSource, LlamaError, Model, Result, Token};
use std::sync::Arc;

/// Candidates per position read from a DFlash 1 drafter's logits.
pub const DFLASH1_TOP_K: usize = 8;

pub struct Drafter {
    ctx: Context,
    /// K of the DFlash 2 selector; `None` for a DFlash 1 drafter (logits per position).
    selector_k: Option<usize>,
    /// Block size the drafter was trained with (anchor included).
    trained_block: usize,
    mask: Token,
    /// Width of one injected row: every feature layer's input, concatenated.
    feature_width: usize,
    inject_batch: Batch,
    block_batch: Batch,
}

impl Drafter {
    /// Create the drafter's context next to the target's (it borrows the target's
    /// embeddings and output head through it).
    pub fn new(model: Arc<Model>, target: &Context, n_threads: i32) -> Result<Self> {
        let mask = model.mask_token().ok_or_else(|| {
            LlamaError::Invalid(format!("drafter {} has no mask token (tokenizer.ggml.mask_token_id)", model.path()))
        })?;
        let n_layers = model.target_layer_ids().len();
        if n_layers == 0 {
            return Err(LlamaError::Invalid(format!("{} lists no target layers", model.path())));
        }
        let trained_block = model.meta("dflash.block_size").and_then(|v| v.parse().ok()).unwrap_or(16usize);
        let causal = model.meta("dflash.attention.causal").is_some_and(|v| v == "true");
        let k = model.selector_top_k();
        let selector_k = (k > 0).then_some(k);
        let n_batch = target.n_batch().max(trained_block);
        let params = ContextParams {
            n_ctx: target.n_ctx(),
            n_batch,
            n_seq_max: 1,
            n_threads,
            features: FeatureSource::None,
        };
        let feature_width = n_layers * target.model().n_embd();
        let mut ctx = Context::new(model, &params, Some(target))?;
        // DFlash 2 reads its lattice from the nextn rows of every block token; DFlash 1
        // reads logits, and only of the rows that ask for them.
        ctx.set_nextn(true, selector_k.is_none());
        ctx.set_causal_attn(causal);
        Ok(Self {
            ctx,
            selector_k,
            trained_block,
            mask,
            feature_width,
            inject_batch: Batch::embeddings(n_batch, feature_width),
            block_batch: Batch::tokens(trained_block, 1),
        })
    }

    pub fn trained_block(&self) -> usize {
        self.trained_block
    }

    pub fn is_dflash2(&self) -> bool {
        self.selector_k.is_some()
    }

    pub fn feature_width(&self) -> usize {
        self.feature_width
    }

    /// Write the target features of consecutive positions `pos0..` into the drafter's
    /// cache (`features` holds whole rows of `feature_width` floats).
    pub fn inject(&mut self, features: &[f32], pos0: usize) -> Result<()> {
        let w = self.feature_width;
        if features.len() % w != 0 {
            return Err(LlamaError::Invalid(format!("{} feature floats is not a whole number of rows", features.len())));
        }
        let rows: Vec<&[f32]> = features.chunks_exact(w).collect();
        for (c, chunk) in rows.chunks(self.inject_batch.capacity()).enumerate() {
            self.inject_batch.clear();
            let base = pos0 + c * self.inject_batch.capacity();
            for (i, row) in chunk.iter().enumerate() {
                self.inject_batch.add_embedding(row, (base + i) as i32, 0, false)?;
            }
            self.ctx.decode(&self.inject_batch, "drafter feature injection")?;
        }
        Ok(())
    }

    /// Draft `n_block - 1` positions after `last` (which sits at position `pos0`) in one
    /// decode, and return their candidate lattice. The block's cache cells are removed
    /// again: only injected target features stay in the drafter's cache.
    pub fn draft(&mut self, last: Token, pos0: usize, n_block: usize) -> Result<Lattice> {
        let n_block = n_block.clamp(2, self.trained_block);
        self.block_batch.clear();
        for i in 0..n_block {
            let token = if i == 0 { last } else { self.mask };
            // DFlash 1 needs the logits of the mask rows; DFlash 2 outputs its lattice
            // for every row regardless and never needs the raw logits.
            let output = self.selector_k.is_none() && i > 0;
            self.block_batch.add_token(token, (pos0 + i) as i32, &[0], output)?;
        }
        let decoded = self.ctx.decode(&self.block_batch, "drafter block");
        // Whatever happened, the block must not stay in the cache.
        self.ctx.seq_rm(0, pos0 as i32, -1)?;
        decoded?;
        match self.selector_k {
            Some(k) => {
                let rows = self.ctx.nextn()?;
                Lattice::from_dflash2_rows(rows, self.ctx.model().n_embd(), k, n_block)
                    .ok_or_else(|| LlamaError::Invalid("malformed DFlash 2 lattice".into()))
            }
            None => {
                let logits: Vec<&[f32]> = (1..n_block).map(|i| self.ctx.logits(i)).collect::<Result<_>>()?;
                Ok(Lattice::from_position_logits(logits.into_iter(), DFLASH1_TOP_K))
            }
        }
    }

    /// Forget everything from position `pos` on.
    pub fn truncate(&mut self, pos: usize) -> Result<()> {
        self.ctx.seq_rm(0, pos as i32, -1)
    }

    /// Positions held in the drafter cache (for consistency checks).
    pub fn cached_len(&self) -> usize {
        (self.ctx.seq_pos_max(0) + 1) as usize
    }
}
