//! The decode loop over a target and its draft sources: [`Engine`] loads the models and runs
//! generations ([`Run`]); `cycle` is the loop itself (plan, draft, select, verify, commit,
//! roll back).
//!
//! One engine owns a target context and, optionally, a DFlash drafter next to it. Its cache
//! holds one conversation per slot: a new prompt that extends what is cached only decodes the
//! new part. Without a draft source (or with `SelectMode::None`) it decodes one token per
//! target step: the baseline every speculative mode must reproduce.
mod cycle;
mod options;
mod report;
mod run;
mod sources;
mod stats;

pub use crate::draft::config::{Block, DraftConfig, SelectMode, Upstream, DEFAULT_LOOKUP_NGRAM, LOOKUP_BLOCK};
pub use crate::target::Repack;
pub use crate::verify::{Verifier, MAX_TREE_LEAVES};
pub use options::{default_threads, CacheTypes, EngineConfig, FeatureMode, GenerateOptions, ReasoningBudget};
pub use report::PromptProgress;
pub use run::{FinishReason, Generation, Run};
pub use stats::{SourceStats, Stats};

use crate::draft::cost::CostModel;
use crate::draft::drafter::Drafter;
use crate::llama::{Batch, Context, Grammar, LlamaError, Model, Token};
use crate::sampling::{token_probs, TokenProb};
use crate::verify::own_token;
use sources::Sources;
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Llama(#[from] LlamaError),
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
    #[error(transparent)]
    Pair(#[from] crate::gguf::PairCheckError),
    #[error("the prompt has {n_prompt} tokens but the context holds {n_ctx}: shorten it or raise --ctx-size")]
    PromptTooLong { n_prompt: usize, n_ctx: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("{0}")]
    Config(String),
}

pub type Result<T> = std::result::Result<T, EngineError>;

pub struct Engine {
    // Field order is drop order: the drafter's context borrows from the target's.
    sources: Sources,
    target: Context,
    batch: Batch,
    /// Per slot: the tokens whose K/V are in the target cache (and whose features are, or are
    /// queued to be, in the drafter's).
    cached: Vec<Vec<Token>>,
    cost: CostModel,
    /// See [`EngineConfig::near_tie_margin`].
    near_tie_margin: Option<f32>,
    /// Scratch: the token history of a verify row (for the repetition penalty).
    history: Vec<Token>,
}

impl Engine {
    /// Load the models named in `cfg` and build an engine over them.
    pub fn load(cfg: &EngineConfig) -> Result<Self> {
        let (target, drafter) = Self::load_models(cfg)?;
        Self::from_models(target, drafter, cfg)
    }

    /// Load the target and drafter of `cfg`, to share among several engines. The files are
    /// checked first (readable GGUF, a drafter that pairs with the target), so a bad file
    /// is a clear error, not an abort inside llama.cpp.
    pub fn load_models(cfg: &EngineConfig) -> Result<(Arc<Model>, Option<Arc<Model>>)> {
        cfg.load_models()
    }

    pub fn from_models(target: Arc<Model>, drafter: Option<Arc<Model>>, cfg: &EngineConfig) -> Result<Self> {
        let n_slots = cfg.n_slots.max(1);
        let params = cfg.context_params(cfg.features(&target, drafter.as_deref())?, n_slots);
        let n_seq_max = params.n_seq_max;
        let target_ctx = Context::new(target, &params, None)?;
        let drafter = match drafter {
            Some(d) => Some(Drafter::new(d, &target_ctx, n_slots, cfg.n_threads, cfg.cache.draft_k, cfg.cache.draft_v)?),
            None => None,
        };
        Ok(Self {
            sources: Sources::new(drafter, n_slots),
            batch: Batch::tokens(target_ctx.n_batch(), n_seq_max),
            target: target_ctx,
            cached: vec![Vec::new(); n_slots],
            cost: CostModel::default(),
            near_tie_margin: cfg.near_tie_margin,
            history: Vec::new(),
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        self.target.model()
    }

    pub fn drafter(&self) -> Option<&Drafter> {
        self.sources.drafter()
    }

    /// Positions one conversation (slot) can hold.
    pub fn n_ctx(&self) -> usize {
        self.target.n_ctx_per_seq()
    }

    /// Conversations this engine holds side by side.
    pub fn n_slots(&self) -> usize {
        self.cached.len()
    }

    /// Forget every cached conversation.
    pub fn reset(&mut self) -> Result<()> {
        (0..self.cached.len()).try_for_each(|s| self.truncate_cache(s, 0))
    }

    /// Forget the conversation of one slot.
    pub fn reset_slot(&mut self, slot: usize) -> Result<()> {
        self.check_slot(slot)?;
        self.truncate_cache(slot, 0)
    }

    /// Generate a continuation of `prompt` in slot 0. `on_tokens` sees every batch of
    /// committed tokens as it lands and returns `false` to stop.
    pub fn generate(&mut self, prompt: &[Token], opts: &GenerateOptions, mut on_tokens: impl FnMut(&[Token]) -> bool) -> Result<Generation> {
        let mut run = self.start(prompt, opts)?;
        let mut fresh = run.tokens().to_vec();
        loop {
            if !fresh.is_empty() && !on_tokens(&fresh) && run.finish.is_none() {
                run.cancel();
            }
            if run.finish.is_some() {
                break;
            }
            fresh = self.step(&mut run)?;
        }
        Ok(run.into_generation())
    }

    /// Begin a generation in slot 0; see [`Engine::start_in`].
    pub fn start(&mut self, prompt: &[Token], opts: &GenerateOptions) -> Result<Run> {
        self.start_in(0, prompt, opts)
    }

    /// Begin a generation in `slot`: decode the prompt (what the slot's cache lacks of it)
    /// and commit the first token. Continue with [`Engine::step`] or [`Engine::step_all`]
    /// until [`Run::finish`] is set.
    pub fn start_in(&mut self, slot: usize, prompt: &[Token], opts: &GenerateOptions) -> Result<Run> {
        self.start_reporting(slot, prompt, opts, &mut |_| {})
    }

    /// [`Engine::start_in`], telling `progress` how far the prompt is: once before its first
    /// decode (the cached prefix counted as processed) and after each batch of it.
    pub fn start_reporting(
        &mut self,
        slot: usize,
        prompt: &[Token],
        opts: &GenerateOptions,
        progress: &mut dyn FnMut(PromptProgress),
    ) -> Result<Run> {
        let t_start = Instant::now();
        self.check_slot(slot)?;
        check_request(prompt, opts, self.n_ctx())?;
        let model = self.target.model();
        let grammar = opts.grammar.as_deref().map(|g| Grammar::lazy(model, g, &opts.grammar_triggers)).transpose()?;
        let budget = opts.reasoning_budget.as_ref().map(|b| Grammar::reasoning_budget(model, &b.start, &b.end, &b.forced, b.budget, b.open)).transpose()?;
        let grammar = Grammar::all(grammar.into_iter().chain(budget).collect());
        let mut run = Run::new(slot, opts, grammar, prompt.len(), t_start);
        let (first, first_prob) = self.prefill(slot, prompt, &mut run, progress)?;
        run.next = first;
        (run.block, run.adaptive) = opts.draft.block.resolve(self.drafter().map(Drafter::trained_block));
        run.sources = self.sources.begin(&self.target, &mut self.cost, slot, prompt, &opts.draft)?;
        if let Some(g) = run.grammar.as_mut().filter(|_| !self.target.model().is_eog(first)) {
            g.accept(first)?;
        }
        if !run.sources.is_empty() && run.adaptive {
            // the verify costs the first cycles choose from (the prompt's last token is in the cache)
            let largest = if opts.draft.select == SelectMode::Tree { opts.draft.tree_budget + 1 } else { run.block };
            let (pos0, token) = (self.cached[slot].len(), prompt[prompt.len() - 1]);
            let max_batch = largest.min(self.batch.capacity()).min(self.n_ctx().saturating_sub(pos0));
            self.cost.calibrate(&mut self.target, &mut self.batch, slot as i32, pos0, token, max_batch)?;
        }
        // Setup ends here: generation speed is measured from now on.
        run.stats.prefill_ms = report::ms_since(t_start);
        run.commit(self.target.model(), &[first], first_prob.as_slice());
        Ok(run)
    }

    /// Decode the part of `prompt` not already cached in `slot`; returns the first
    /// generated token.
    fn prefill(&mut self, slot: usize, prompt: &[Token], run: &mut Run, progress: &mut dyn FnMut(PromptProgress)) -> Result<(Token, Option<TokenProb>)> {
        // Reuse the cached prefix, but always decode at least the last prompt token:
        // its logits give the first generated token.
        let common = self.cached[slot].iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let keep = common.min(prompt.len() - 1);
        self.truncate_cache(slot, keep)?;
        let todo = &prompt[keep..];
        run.stats.n_prompt_decoded = todo.len();
        let n_batch = self.batch.capacity();
        let report = PromptProgress::reporter(prompt.len(), keep, run.t_start);
        progress(report(keep));
        let mut last_logits_row = 0;
        for (c, chunk) in todo.chunks(n_batch).enumerate() {
            let is_last_chunk = (c + 1) * n_batch >= todo.len();
            self.batch.clear();
            let pos0 = self.cached[slot].len();
            for (i, &t) in chunk.iter().enumerate() {
                self.batch.add_token(t, (pos0 + i) as i32, &[slot as i32], is_last_chunk && i + 1 == chunk.len())?;
            }
            self.target.decode(&self.batch, "prompt")?;
            self.sources.observe(&self.target, slot, &(0..chunk.len()).collect::<Vec<_>>(), pos0)?;
            self.cached[slot].extend_from_slice(chunk);
            last_logits_row = chunk.len() - 1;
            progress(report(self.cached[slot].len()));
        }
        let logits = self.target.logits(last_logits_row)?;
        let first = own_token(&run.sampler, logits, prompt, run.grammar.as_ref(), 0);
        Ok((first, run.opts.n_probs.map(|n| token_probs(logits, first, n))))
    }

    fn truncate_cache(&mut self, slot: usize, keep: usize) -> Result<()> {
        if keep < self.cached[slot].len() || keep == 0 {
            self.target.seq_rm(slot as i32, keep as i32, -1)?;
            self.sources.truncate(slot, keep)?;
            self.cached[slot].truncate(keep);
        }
        Ok(())
    }

    fn check_slot(&self, slot: usize) -> Result<()> {
        if slot >= self.cached.len() {
            return Err(EngineError::Config(format!("slot {slot} does not exist ({} slots)", self.cached.len())));
        }
        Ok(())
    }

    /// Tokens held in the cache of slot 0 (prompt and committed output, the last token excluded).
    pub fn cached_tokens(&self) -> &[Token] {
        self.cached_tokens_in(0)
    }

    pub fn cached_tokens_in(&self, slot: usize) -> &[Token] {
        &self.cached[slot]
    }

    /// Cache positions of slot 0 held by the target and the drafter (see [`Engine::cache_extents_in`]).
    pub fn cache_extents(&self) -> (usize, Option<usize>) {
        self.cache_extents_in(0)
    }

    /// Cache positions of `slot` held by the target and the drafter, counting features
    /// queued for the drafter (both must equal `cached_tokens_in(slot).len()`).
    pub fn cache_extents_in(&self, slot: usize) -> (usize, Option<usize>) {
        ((self.target.seq_pos_max(slot as i32) + 1) as usize, self.drafter().map(|d| d.extent(slot)))
    }
}

/// What a generation may ask for at all, checked before anything is decoded.
fn check_request(prompt: &[Token], opts: &GenerateOptions, n_ctx: usize) -> Result<()> {
    if prompt.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    if opts.n_predict == 0 {
        return Err(EngineError::Config("n_predict must be at least 1".into()));
    }
    if prompt.len() >= n_ctx {
        return Err(EngineError::PromptTooLong { n_prompt: prompt.len(), n_ctx });
    }
    let max_ngram = crate::draft::lookup::MAX_NGRAM;
    if opts.draft.lookup && !(1..=max_ngram).contains(&opts.draft.lookup_ngram) {
        return Err(EngineError::Config(format!("lookup_ngram must be 1..={max_ngram}, got {}", opts.draft.lookup_ngram)));
    }
    Ok(())
}
