//! The DFlash drafter as llama.cpp runs it: target features are injected into its KV
//! cache, then one decode of `[last, MASK x (B-1)]` drafts a whole block.
use super::Lattice;
use crate::llama::{Batch, CacheType, Context, ContextParams, FeatureSource, LlamaError, Model, Result, Token};
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
    /// Per sequence: target features not yet injected, whole rows for consecutive positions
    /// from its first. Injection waits until the next draft, so plain steps cost only a copy
    /// and the drafter gets one batched decode.
    queued: Vec<Queued>,
}

#[derive(Default)]
struct Queued {
    rows: Vec<f32>,
    pos0: usize,
}

impl Drafter {
    /// Create the drafter's context next to the target's (it borrows the target's
    /// embeddings and output head through it).
    /// `n_seqs` conversations can draft side by side (sequence ids `0..n_seqs`).
    /// `cache_k` / `cache_v`: element types of the drafter's KV cache.
    pub fn new(
        model: Arc<Model>,
        target: &Context,
        n_seqs: usize,
        n_threads: i32,
        cache_k: CacheType,
        cache_v: CacheType,
    ) -> Result<Self> {
        let mask = model.mask_token().ok_or_else(|| {
            LlamaError::Invalid(format!("drafter {} has no mask token (tokenizer.ggml.mask_token_id)", model.path()))
        })?;
        let n_layers = model.target_layer_ids().len();
        if n_layers == 0 {
            return Err(LlamaError::Invalid(format!("{} lists no target layers", model.path())));
        }
        let trained_block = model.dflash_block_size().unwrap_or(16);
        let causal = model.meta("dflash.attention.causal").is_some_and(|v| v == "true");
        let k = model.selector_top_k();
        let selector_k = (k > 0).then_some(k);
        // The drafter's numerics never change the output: where its heads do not fill whole
        // blocks of a quantized type, f16 stands in rather than failing.
        let (head_k, head_v) = model.head_sizes();
        let fit = |t: CacheType, head: usize| {
            if t.fits(head) {
                t
            } else {
                tracing::info!("drafter heads of {head} values do not fit a {t} cache: f16 instead");
                CacheType::F16
            }
        };
        let (cache_k, cache_v) = (fit(cache_k, head_k), fit(cache_v, head_v));
        let n_batch = target.n_batch().max(trained_block * n_seqs);
        let params = ContextParams {
            n_ctx: target.n_ctx_per_seq() * n_seqs,
            n_batch,
            n_seq_max: n_seqs,
            n_threads,
            features: FeatureSource::None,
            // Its blocks of all sequences go through one decode; numerics of the drafter
            // do not affect what is generated.
            kv_unified: true,
            flash_attn: true,
            reference_kernels: false,
            cache_k,
            cache_v,
            adapt_threads: true,
            // The drafter's Q8_0 products in integers: a block decode about 30% cheaper on an
            // AVX512-VNNI CPU without AMX (BENCHMARKS.md (q)).
            integer_products: true,
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
            block_batch: Batch::tokens(trained_block * n_seqs, 1),
            queued: (0..n_seqs).map(|_| Queued::default()).collect(),
        })
    }

    /// Its context (llama.cpp's own DFlash driver drafts with it too).
    pub fn context(&self) -> &Context {
        &self.ctx
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

    /// Write the target features of consecutive positions `pos0..` of sequence `seq` into
    /// the drafter's cache (`features` holds whole rows of `feature_width` floats).
    pub fn inject(&mut self, features: &[f32], pos0: usize, seq: i32) -> Result<()> {
        let w = self.feature_width;
        if features.len() % w != 0 {
            return Err(LlamaError::Invalid(format!("{} feature floats is not a whole number of rows", features.len())));
        }
        let rows: Vec<&[f32]> = features.chunks_exact(w).collect();
        for (c, chunk) in rows.chunks(self.inject_batch.capacity()).enumerate() {
            self.inject_batch.clear();
            let base = pos0 + c * self.inject_batch.capacity();
            for (i, row) in chunk.iter().enumerate() {
                self.inject_batch.add_embedding(row, (base + i) as i32, seq, false)?;
            }
            self.ctx.decode(&self.inject_batch, "drafter feature injection")?;
        }
        Ok(())
    }

    /// Draft `n_block - 1` positions after each block's anchor, all blocks in one decode
    /// (`blocks`: anchor token, its position, its sequence), and return one candidate
    /// lattice per block. The blocks' cache cells are removed again: only injected target
    /// features stay in the drafter's cache.
    pub fn draft(&mut self, blocks: &[(Token, usize, i32)], n_block: usize) -> Result<Vec<Lattice>> {
        let n_block = n_block.clamp(2, self.trained_block);
        self.block_batch.clear();
        for &(last, pos0, seq) in blocks {
            for i in 0..n_block {
                let token = if i == 0 { last } else { self.mask };
                // DFlash 1 reads the logits of the mask rows. llama.cpp's dflash graph
                // computes logits for every row and hands out the first n_outputs of them
                // (it has no output-row selection), so every row must ask: asking for the
                // mask rows only would return the anchor row's logits as position 1's.
                // DFlash 2 outputs its lattice for every row and never needs the logits.
                let output = self.selector_k.is_none();
                self.block_batch.add_token(token, (pos0 + i) as i32, &[seq], output)?;
            }
        }
        let decoded = self.ctx.decode(&self.block_batch, "drafter block");
        // Whatever happened, the blocks must not stay in the cache.
        for &(_, pos0, seq) in blocks {
            self.ctx.seq_rm(seq, pos0 as i32, -1)?;
        }
        decoded?;
        let row_stride = self.ctx.model().n_embd();
        (0..blocks.len())
            .map(|b| {
                let first = b * n_block;
                match self.selector_k {
                    Some(k) => {
                        let rows = &self.ctx.nextn()?[first * row_stride..(first + n_block) * row_stride];
                        let mut l = Lattice::from_dflash2_rows(rows, row_stride, k, n_block)
                            .ok_or_else(|| LlamaError::Invalid("malformed DFlash 2 lattice".into()))?;
                        l.repair(self.ctx.model().n_vocab());
                        Ok(l)
                    }
                    None => {
                        let logits: Vec<&[f32]> =
                            (first + 1..first + n_block).map(|i| self.ctx.logits(i)).collect::<Result<_>>()?;
                        Ok(Lattice::from_position_logits(logits.into_iter(), DFLASH1_TOP_K))
                    }
                }
            })
            .collect()
    }

    /// Queue the features of `rows` of the target's last decode for `seq`, at consecutive
    /// positions from `pos0` (right after what is already queued).
    pub fn queue(&mut self, target: &Context, seq: usize, rows: &[usize], pos0: usize) -> Result<()> {
        let q = &mut self.queued[seq];
        if q.rows.is_empty() {
            q.pos0 = pos0;
        }
        debug_assert_eq!(q.pos0 + q.rows.len() / self.feature_width, pos0);
        target.append_features(rows, &mut q.rows)
    }

    /// Inject the features queued for `seq` into the cache.
    pub fn flush(&mut self, seq: usize) -> Result<()> {
        let mut rows = std::mem::take(&mut self.queued[seq].rows);
        let injected = if rows.is_empty() { Ok(()) } else { self.inject(&rows, self.queued[seq].pos0, seq as i32) };
        rows.clear();
        self.queued[seq].rows = rows; // (its allocation serves the next cycles)
        injected
    }

    /// Forget everything of sequence `seq` from position `pos` on, queued features included.
    pub fn truncate(&mut self, seq: usize, pos: usize) -> Result<()> {
        self.ctx.seq_rm(seq as i32, pos as i32, -1)?;
        let q = &mut self.queued[seq];
        q.rows.truncate(pos.saturating_sub(q.pos0) * self.feature_width);
        Ok(())
    }

    /// Positions of `seq` the drafter holds, counting features queued for it (for consistency
    /// checks: they must equal the target's).
    pub fn extent(&self, seq: usize) -> usize {
        let q = &self.queued[seq];
        let cached = (self.ctx.seq_pos_max(seq as i32) + 1) as usize;
        match q.rows.len() / self.feature_width {
            0 => cached,
            queued => {
                debug_assert_eq!(cached, q.pos0);
                q.pos0 + queued
            }
        }
    }
}
