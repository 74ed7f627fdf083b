//! What an engine is built with ([`EngineConfig`]) and what one generation asks for
//! ([`GenerateOptions`]).
use super::{EngineError, Result};
use crate::draft::config::DraftConfig;
use crate::llama::{CacheType, ContextParams, FeatureSource, Model, ModelParams, Token};
use crate::verify::MAX_TREE_LEAVES;
use crate::sampling::SamplingParams;
use crate::target::Repack;
use crate::verify::Verifier;
use std::path::PathBuf;
use std::sync::Arc;

/// Where the target's layer inputs come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum FeatureMode {
    /// llama.cpp's extraction where the architecture has it, else the callback.
    #[default]
    Auto,
    Native,
    Callback,
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub target: PathBuf,
    pub drafter: Option<PathBuf>,
    pub n_ctx: usize,
    pub n_batch: usize,
    pub n_threads: i32,
    pub n_gpu_layers: i32,
    pub features: FeatureMode,
    /// Conversations held side by side, decoded together (one cache sequence each).
    pub n_slots: usize,
    pub cache: CacheTypes,
    /// The target's weight repacking (`crate::target`): probed by default.
    pub repack: Repack,
    /// The near-tie guard's margin in logits, forced (tests exercise the guard on a machine
    /// whose batches are bit-exact); by default it comes from the load-time probe.
    pub near_tie_margin: Option<f32>,
}

/// Element types of the two models' KV caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheTypes {
    pub target_k: CacheType,
    /// Quantized only with flash attention, which the target runs without.
    pub target_v: CacheType,
    pub draft_k: CacheType,
    pub draft_v: CacheType,
}

impl Default for CacheTypes {
    /// The drafter's numerics never change the output, and on CPU a q8_0 drafter cache
    /// drafts faster at the same acceptance (BENCHMARKS.md).
    fn default() -> Self {
        Self { target_k: CacheType::F16, target_v: CacheType::F16, draft_k: CacheType::Q8_0, draft_v: CacheType::Q8_0 }
    }
}

impl EngineConfig {
    pub fn new(target: PathBuf, drafter: Option<PathBuf>) -> Self {
        Self {
            target,
            drafter,
            n_ctx: 4096,
            n_batch: 512,
            n_threads: default_threads(),
            n_gpu_layers: 999,
            features: FeatureMode::Auto,
            n_slots: 1,
            cache: CacheTypes::default(),
            repack: Repack::Auto,
            near_tie_margin: None,
        }
    }

    /// The target context's numerics as the engine runs it (what the invariance probe must
    /// test): threads, cache types, and no flash attention (verify batches must reproduce
    /// single-token decoding bit for bit).
    pub fn target_params(&self) -> ContextParams {
        ContextParams {
            n_threads: self.n_threads,
            flash_attn: false,
            cache_k: self.cache.target_k,
            cache_v: self.cache.target_v,
            ..ContextParams::default()
        }
    }

    /// The target (probed for batch invariance) and the drafter, their files checked first.
    pub(super) fn load_models(&self) -> Result<(Arc<Model>, Option<Arc<Model>>)> {
        match &self.drafter {
            Some(d) => drop(crate::gguf::check_pair_files(&self.target, d)?),
            None => drop(crate::gguf::read_model_info(&self.target)?),
        }
        let (target, _) = crate::target::load_target(&self.target, self.n_gpu_layers, self.repack, &self.target_params())?;
        // The drafter's numerics never change the output: it keeps repacking for speed.
        let mparams = ModelParams { n_gpu_layers: self.n_gpu_layers, repack: true };
        let drafter = match &self.drafter {
            Some(p) => Some(Arc::new(Model::load(p, &mparams)?)),
            None => None,
        };
        Ok((target, drafter))
    }

    /// The target context of an engine of `n_slots` slots whose drafter reads `features`.
    pub(super) fn context_params(&self, features: FeatureSource, n_slots: usize) -> ContextParams {
        // One slot: a unified cache where token trees put each leaf in a sequence of its
        // own. Several slots: each gets a stream of n_ctx cells to itself, so its cells
        // stay in position order whatever the others do; llama.cpp's attention rounds
        // differently when a sequence's cells are out of order, and the output must stay
        // bit-identical to decoding that conversation alone.
        let unified = n_slots == 1;
        // (token trees come from the drafter or the look-up, which any run may turn on)
        let n_seq_max = if unified { 1 + MAX_TREE_LEAVES } else { n_slots };
        ContextParams { n_ctx: self.n_ctx * n_slots, n_batch: self.n_batch.max(64), n_seq_max, features, kv_unified: unified, ..self.target_params() }
    }

    /// Where the target's layer inputs come from for `drafter` (none without one).
    pub(super) fn features(&self, target: &Model, drafter: Option<&Model>) -> Result<FeatureSource> {
        let Some(d) = drafter else { return Ok(FeatureSource::None) };
        let layers = d.target_layer_ids();
        if let Some(&bad) = layers.iter().find(|&&l| l < 1 || l as usize >= target.n_layer()) {
            return Err(EngineError::Config(format!(
                "drafter reads target layer {bad}, the target has layers 1..{} to read from",
                target.n_layer().saturating_sub(1)
            )));
        }
        Ok(match self.features {
            FeatureMode::Auto => FeatureSource::auto(&target.architecture(), layers),
            FeatureMode::Native => FeatureSource::Native(layers),
            FeatureMode::Callback => FeatureSource::Callback(layers),
        })
    }
}

/// Physical cores are what llama.cpp's CPU kernels scale with; hyperthreads don't help.
pub fn default_threads() -> i32 {
    std::thread::available_parallelism().map(|n| n.get() as i32).unwrap_or(4).clamp(1, 16)
}

/// What one generation asks for.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub n_predict: usize,
    /// How each cycle drafts (`Block::Auto` follows the engine's drafter's trained block).
    pub draft: DraftConfig,
    pub stop: Vec<String>,
    pub sampling: SamplingParams,
    /// Constrain the output to this GBNF grammar (root rule `root`): the target law is the
    /// grammar-masked one, for plain and speculative decoding alike.
    pub grammar: Option<String>,
    /// With these words, the grammar holds only from the first of them on (the text before it
    /// is free; llama.cpp's lazy grammar, as tool calls use it). Empty: from the first token.
    pub grammar_triggers: Vec<String>,
    /// Report each output token's log-probability and this many likeliest alternatives
    /// (None: none), from the same target rows that chose it.
    pub n_probs: Option<usize>,
    /// How drafts are checked at temperature > 0: by matching (plain decoding's text for a
    /// seed) or by rejection sampling (its distribution).
    pub verifier: Verifier,
    /// llama.cpp's reasoning budget: a constraint applied with the grammar, to every draft and
    /// verify row as to plain decoding's tokens.
    pub reasoning_budget: Option<ReasoningBudget>,
    /// Special tokens the output text writes out (llama-server's preserved tokens: the markers
    /// a chat's answer parser reads, such as gpt-oss's channels); others are written as nothing.
    pub shown_special: Vec<Token>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            n_predict: 128,
            draft: DraftConfig::default(),
            stop: Vec::new(),
            sampling: SamplingParams::default(),
            n_probs: None,
            grammar: None,
            grammar_triggers: Vec::new(),
            verifier: Verifier::Match,
            shown_special: Vec::new(),
            reasoning_budget: None,
        }
    }
}

/// At most `budget` tokens of thinking: after `start` (or from the first token when `open`, the
/// prompt having opened it), `budget` tokens may follow, then `forced` (a message and the end of
/// the thinking) is the only way on unless `end` came first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReasoningBudget {
    pub start: Vec<Token>,
    pub end: Vec<Token>,
    pub forced: Vec<Token>,
    pub budget: usize,
    pub open: bool,
}
