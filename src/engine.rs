//! The decode loop: prefill, inject, draft, select, verify, commit, roll back.
//!
//! One [`Engine`] owns a target context and, optionally, a DFlash drafter next to it.
//! Its cache holds one conversation: a new prompt that extends what is cached only
//! decodes the new part. Without a drafter (or with [`SelectMode::None`]) it decodes
//! one token per target step: the baseline every speculative mode must reproduce.
use crate::draft::cost::CostModel;
use crate::draft::drafter::Drafter;
use crate::draft::lookup::{self, NgramIndex};
use crate::draft::select::{self, proposal, Greedy, Selector, Walk};
use crate::draft::{lattice, DraftTree, Origin};
use crate::llama::{Batch, CacheType, Context, ContextParams, FeatureSource, LlamaError, Model, ModelParams, Token, UpstreamDrafter};
pub use crate::target::Repack;
use crate::llama::Grammar;
use crate::sampling::{token_probs, Distribution, Sampler, SamplingParams, TokenProb};
use crate::verify::{accept_greedy, verify_tree};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// How a draft is chosen from the drafter's candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SelectMode {
    /// No drafting: plain autoregressive decoding (the baseline).
    None,
    /// llama.cpp's walk: the best-scoring successor of each pick.
    Greedy,
    /// The path with the most expected accepted tokens.
    BestPath,
    /// A best-first token tree over the candidates, verified in one decode.
    Tree,
    /// Drafting by llama.cpp's own DFlash driver (its greedy walk, a fixed block): the
    /// baseline to beat, run through the same verification. Targets with llama.cpp's
    /// layer extraction only (llama, qwen3, ...).
    Upstream,
}

impl SelectMode {
    /// The lattice walk of this mode (a tree only where the batch can hold one).
    pub fn walk(self, trees: bool, tree_budget: usize) -> Walk {
        match self {
            SelectMode::None | SelectMode::Greedy | SelectMode::Upstream => Walk::Greedy,
            SelectMode::BestPath => Walk::BestPath,
            SelectMode::Tree if trees => Walk::Tree { budget: tree_budget },
            SelectMode::Tree => Walk::BestPath,
        }
    }
}

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
}

/// Physical cores are what llama.cpp's CPU kernels scale with; hyperthreads don't help.
pub fn default_threads() -> i32 {
    std::thread::available_parallelism().map(|n| n.get() as i32).unwrap_or(4).clamp(1, 16)
}

/// What one generation asks for.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub n_predict: usize,
    pub select: SelectMode,
    /// Block size (anchor included): at most `block - 1` drafted tokens per cycle.
    pub block: usize,
    /// Choose each cycle's draft length (up to `block - 1`, or the tree's size) from
    /// measured costs and predicted acceptance, and stop drafting when it doesn't pay.
    pub adaptive: bool,
    /// Node budget of a token tree (`SelectMode::Tree`).
    pub tree_budget: usize,
    /// Also draft from the context: continuations of earlier occurrences of its last
    /// tokens (`draft::lookup`), beside the drafter's or, without a drafter, alone.
    pub lookup: bool,
    /// Longest suffix the look-up matches, in tokens (1..=`lookup::MAX_NGRAM`).
    pub lookup_ngram: usize,
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
    /// Draft with one of llama.cpp's own n-gram types instead (`llama::LLAMA_NGRAM_TYPES`, its
    /// default settings, every draft verified as it comes): the baseline `bench --llama-ngram`
    /// measures the look-up against.
    pub llama_ngram: Option<&'static str>,
    /// How drafts are checked at temperature > 0. Only tests change it.
    #[doc(hidden)]
    pub verifier: Verifier,
}

/// Verification at temperature > 0.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verifier {
    /// Rejection sampling: the output follows the target's distribution.
    #[default]
    Rejection,
    /// DELIBERATELY WRONG: accepts every draft. It exists so the distribution test can
    /// show that it detects a broken verifier.
    AcceptAll,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            n_predict: 128,
            select: SelectMode::Greedy,
            block: 16,
            adaptive: false,
            tree_budget: 32,
            lookup: false,
            lookup_ngram: DEFAULT_LOOKUP_NGRAM,
            stop: Vec::new(),
            sampling: SamplingParams::default(),
            n_probs: None,
            grammar: None,
            grammar_triggers: Vec::new(),
            llama_ngram: None,
            verifier: Verifier::Rejection,
        }
    }
}

/// Longest suffix the look-up matches unless asked otherwise.
pub const DEFAULT_LOOKUP_NGRAM: usize = 4;
/// Block size (anchor included) of look-up drafting without a drafter, unless asked otherwise.
pub const LOOKUP_BLOCK: usize = 16;

/// Most leaves a verify tree may have: each leaf is one llama.cpp sequence.
pub const MAX_TREE_LEAVES: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-generation token.
    Eog,
    /// `n_predict` tokens.
    Length,
    /// A stop string.
    Stop,
    /// The context is full.
    Context,
    /// The caller's callback asked to stop.
    Cancelled,
}

/// How far a prompt's decoding is (llama-server's `prompt_progress`): of `total` prompt tokens,
/// `cache` came from the slot's cache and `processed` (the cached ones included) are done.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct PromptProgress {
    pub total: usize,
    pub cache: usize,
    pub processed: usize,
    #[serde(rename = "time_ms")]
    pub ms: f64,
}

/// Counters and timings of one generation.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Stats {
    pub n_prompt: usize,
    /// Prompt tokens decoded (the rest came from the cache).
    pub n_prompt_decoded: usize,
    pub n_generated: usize,
    /// Target verify decodes (plain steps included, one token each).
    pub cycles: usize,
    /// Tokens committed by those cycles (bonus included).
    pub cycle_tokens: usize,
    pub n_drafted: usize,
    pub n_draft_accepted: usize,
    /// `accepted_hist[n]`: speculative cycles that accepted exactly `n` drafted tokens.
    pub accepted_hist: Vec<usize>,
    /// Accepted tree tokens decoded a second time to keep the cache in position order.
    pub redecoded: usize,
    /// Verify rows too close to call on a target whose batches are not bit-exact: the cycle
    /// was cut there and the row's token decided by a single step (the near-tie guard).
    pub near_ties: usize,
    /// Drafter calls (a drafter decode may serve several slots at once).
    pub n_draft_calls: usize,
    /// Block positions those calls drafted (under `--block auto`, as deep as the verifies
    /// have lately taken the drafter's tokens in).
    pub n_draft_positions: usize,
    /// Accepted drafts the drafter predicted (sum over verified drafts of the expected
    /// accepted length from its transition probabilities): calibration against
    /// `n_draft_accepted`.
    pub predicted_accepted: f64,
    /// Verified drafts the target cut short, and how many of those had the target's own
    /// token among the drafter's candidates at that position: the selection headroom an
    /// oracle picking among the candidates would have.
    pub rejections: usize,
    pub rejected_in_candidates: usize,
    /// Drafter outputs with ids outside the vocabulary or scores that are not numbers,
    /// repaired before selection (a drafter gone wrong; the output stays the target's).
    pub repaired_lattices: usize,
    /// Per draft source: what the DFlash drafter and the context look-up proposed and
    /// the target took (a node both proposed counts for both).
    pub from_drafter: SourceStats,
    pub from_lookup: SourceStats,
    pub prefill_ms: f64,
    pub draft_ms: f64,
    pub verify_ms: f64,
    pub host_ms: f64,
    pub total_ms: f64,
}

/// What one draft source proposed and what the target took.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SourceStats {
    /// Cycles whose verified draft held tokens of this source.
    pub cycles: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// Time spent drafting (the drafter's calls; the look-up's index and queries).
    pub ms: f64,
}

impl Stats {
    /// Mean tokens committed per target verify, bonus included.
    pub fn tau(&self) -> f64 {
        if self.cycles == 0 {
            0.0
        } else {
            self.cycle_tokens as f64 / self.cycles as f64
        }
    }

    /// Generation speed after the prompt (the first token comes from the prefill).
    pub fn tokens_per_second(&self) -> f64 {
        let ms = self.total_ms - self.prefill_ms;
        if ms <= 0.0 {
            0.0
        } else {
            self.n_generated.saturating_sub(1) as f64 * 1000.0 / ms
        }
    }

    fn record_cycle(&mut self, drafted: usize, accepted: usize) {
        self.record_verify(drafted, accepted, accepted + 1);
    }

    /// A verify decode that committed `committed` tokens, `accepted` of them drafted.
    fn record_verify(&mut self, drafted: usize, accepted: usize, committed: usize) {
        self.cycles += 1;
        self.cycle_tokens += committed;
        self.n_drafted += drafted;
        self.n_draft_accepted += accepted;
        if drafted == 0 {
            return; // a plain step: nothing was proposed
        }
        if self.accepted_hist.len() <= accepted {
            self.accepted_hist.resize(accepted + 1, 0);
        }
        self.accepted_hist[accepted] += 1;
    }
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<Token>,
    /// One per token when `GenerateOptions::n_probs` asked for them.
    pub probs: Vec<TokenProb>,
    pub text: String,
    pub finish: FinishReason,
    pub stats: Stats,
}

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

/// One conversation's place in the caches: sequence `slot` of both contexts.
#[derive(Default)]
struct Slot {
    /// Tokens whose K/V are in the target cache (and whose features are, or are queued
    /// to be, in the drafter's).
    cached: Vec<Token>,
    /// Target features not yet injected into the drafter: whole rows for consecutive
    /// positions from `pending_pos0`. Injection waits until the next draft, so plain
    /// steps cost only a copy and the drafter gets one batched decode.
    pending: Vec<f32>,
    pending_pos0: usize,
    /// The look-up's index of this conversation, brought up to date when a run with
    /// look-up drafts (so it costs nothing otherwise).
    lookup: NgramIndex,
}

/// What one run does in a cycle.
struct Plan {
    /// Index into the cycle's runs.
    run: usize,
    slot: usize,
    /// The last committed token (not yet decoded) and its position.
    last: Token,
    pos0: usize,
    /// Drafted tokens allowed this cycle (0: a plain step).
    max_draft: usize,
    /// Whether the drafter drafts for this plan this cycle.
    use_drafter: bool,
    /// Whether llama.cpp's n-gram drafting drafts for it (`GenerateOptions::llama_ngram`).
    use_llama_ngram: bool,
    lattice: Option<lattice::Lattice>,
    /// The context look-up's proposal.
    lookup: Option<lookup::Proposal>,
    tree: DraftTree,
    gains: Vec<f32>,
    /// First verify-batch row of this run (its anchor).
    row0: usize,
    /// Leaf sequences of a token tree (0 for a path).
    n_leaves: usize,
    /// With a grammar: its state after each node's token (None under a token it forbids,
    /// which only sampled drafts keep: the target never accepts it).
    states: Vec<Option<Grammar>>,
}

pub struct Engine {
    // Field order is drop order: the drafter's context borrows from the target's.
    drafter: Option<Drafter>,
    target: Context,
    batch: Batch,
    slots: Vec<Slot>,
    cost: CostModel,
    /// See [`EngineConfig::near_tie_margin`].
    near_tie_margin: Option<f32>,
    /// Scratch: the token history of a verify row (for the repetition penalty).
    history: Vec<Token>,
    /// llama.cpp's n-gram drafting, of the type runs last asked for.
    llama_ngram: Option<(&'static str, UpstreamDrafter)>,
    /// How often the target took look-up tokens in every run so far: where each run's own
    /// calibration starts.
    lookup_learned: lookup::Calibration,
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
        match &cfg.drafter {
            Some(d) => drop(crate::gguf::check_pair_files(&cfg.target, d)?),
            None => drop(crate::gguf::read_model_info(&cfg.target)?),
        }
        let (target, _) = crate::target::load_target(&cfg.target, cfg.n_gpu_layers, cfg.repack, &cfg.target_params())?;
        // The drafter's numerics never change the output: it keeps repacking for speed.
        let mparams = ModelParams { n_gpu_layers: cfg.n_gpu_layers, repack: true };
        let drafter = match &cfg.drafter {
            Some(p) => Some(Arc::new(Model::load(p, &mparams)?)),
            None => None,
        };
        Ok((target, drafter))
    }

    pub fn from_models(target: Arc<Model>, drafter: Option<Arc<Model>>, cfg: &EngineConfig) -> Result<Self> {
        let features = match &drafter {
            None => FeatureSource::None,
            Some(d) => {
                let layers = d.target_layer_ids();
                if let Some(&bad) = layers.iter().find(|&&l| l < 1 || l as usize >= target.n_layer()) {
                    return Err(EngineError::Config(format!(
                        "drafter reads target layer {bad}, the target has layers 1..{} to read from",
                        target.n_layer().saturating_sub(1)
                    )));
                }
                match cfg.features {
                    FeatureMode::Auto => FeatureSource::auto(&target.architecture(), layers),
                    FeatureMode::Native => FeatureSource::Native(layers),
                    FeatureMode::Callback => FeatureSource::Callback(layers),
                }
            }
        };
        let n_slots = cfg.n_slots.max(1);
        let n_batch = cfg.n_batch.max(64);
        // One slot: a unified cache where token trees put each leaf in a sequence of its
        // own. Several slots: each gets a stream of n_ctx cells to itself, so its cells
        // stay in position order whatever the others do; llama.cpp's attention rounds
        // differently when a sequence's cells are out of order, and the output must stay
        // bit-identical to decoding that conversation alone.
        let unified = n_slots == 1;
        // (token trees come from the drafter or the look-up, which any run may turn on)
        let n_seq_max = if unified { 1 + MAX_TREE_LEAVES } else { n_slots };
        let params = ContextParams {
            n_ctx: cfg.n_ctx * n_slots,
            n_batch,
            n_seq_max,
            features,
            kv_unified: unified,
            ..cfg.target_params()
        };
        let target_ctx = Context::new(target, &params, None)?;
        let drafter = match drafter {
            Some(d) => Some(Drafter::new(d, &target_ctx, n_slots, cfg.n_threads, cfg.cache.draft_k, cfg.cache.draft_v)?),
            None => None,
        };
        Ok(Self {
            drafter,
            batch: Batch::tokens(target_ctx.n_batch(), n_seq_max),
            target: target_ctx,
            slots: (0..n_slots).map(|_| Slot::default()).collect(),
            cost: CostModel::default(),
            near_tie_margin: cfg.near_tie_margin,
            history: Vec::new(),
            llama_ngram: None,
            lookup_learned: lookup::Calibration::default(),
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        self.target.model()
    }

    pub fn drafter(&self) -> Option<&Drafter> {
        self.drafter.as_ref()
    }

    /// Positions one conversation (slot) can hold.
    pub fn n_ctx(&self) -> usize {
        self.target.n_ctx_per_seq()
    }

    /// Conversations this engine holds side by side.
    pub fn n_slots(&self) -> usize {
        self.slots.len()
    }

    /// Forget every cached conversation.
    pub fn reset(&mut self) -> Result<()> {
        (0..self.slots.len()).try_for_each(|s| self.truncate_cache(s, 0))
    }

    /// Forget the conversation of one slot.
    pub fn reset_slot(&mut self, slot: usize) -> Result<()> {
        self.check_slot(slot)?;
        self.truncate_cache(slot, 0)
    }

    /// Generate a continuation of `prompt` in slot 0. `on_tokens` sees every batch of
    /// committed tokens as it lands and returns `false` to stop.
    pub fn generate(
        &mut self,
        prompt: &[Token],
        opts: &GenerateOptions,
        mut on_tokens: impl FnMut(&[Token]) -> bool,
    ) -> Result<Generation> {
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
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if opts.n_predict == 0 {
            return Err(EngineError::Config("n_predict must be at least 1".into()));
        }
        if prompt.len() >= self.n_ctx() {
            return Err(EngineError::PromptTooLong { n_prompt: prompt.len(), n_ctx: self.n_ctx() });
        }
        if opts.lookup && !(1..=lookup::MAX_NGRAM).contains(&opts.lookup_ngram) {
            return Err(EngineError::Config(format!(
                "lookup_ngram must be 1..={}, got {}",
                lookup::MAX_NGRAM,
                opts.lookup_ngram
            )));
        }
        let speculative =
            opts.select != SelectMode::None && (self.drafter.is_some() || opts.lookup || opts.llama_ngram.is_some());
        let mut run = Run {
            slot,
            opts: opts.clone(),
            sampler: Sampler::new(opts.sampling.clone()),
            stats: Stats { n_prompt: prompt.len(), ..Stats::default() },
            out: Output::default(),
            probs: Vec::new(),
            grammar: opts.grammar.as_deref().map(|g| Grammar::lazy(self.target.model(), g, &opts.grammar_triggers)).transpose()?,
            next: 0,
            finish: None,
            speculative,
            lookup_calibration: lookup::Calibration::learning_from(&self.lookup_learned),
            t_start,
            t_end: None,
            single_next: false,
        };
        let (first, first_prob) = self.prefill(slot, prompt, &mut run, progress)?;
        run.next = first;
        if let Some(kind) = opts.llama_ngram.filter(|_| speculative) {
            if self.llama_ngram.as_ref().is_none_or(|(k, _)| *k != kind) {
                self.llama_ngram = Some((kind, UpstreamDrafter::ngram(kind, &self.target, self.slots.len())?));
            }
            self.llama_ngram.as_mut().expect("made above").1.begin(slot as i32, prompt)?;
        }
        if let Some(g) = run.grammar.as_mut().filter(|_| !self.target.model().is_eog(first)) {
            g.accept(first)?;
        }
        if speculative && opts.adaptive {
            let largest = if opts.select == SelectMode::Tree { opts.tree_budget + 1 } else { opts.block };
            self.calibrate(slot, largest)?;
        }
        // Setup ends here: generation speed is measured from now on.
        run.stats.prefill_ms = ms_since(t_start);
        run.commit(self.target.model(), &[first], first_prob.as_slice());
        Ok(run)
    }

    /// One cycle of one run; see [`Engine::step_all`].
    pub fn step(&mut self, run: &mut Run) -> Result<Vec<Token>> {
        Ok(self.step_all(&mut [run])?.pop().unwrap_or_default())
    }

    /// One cycle for several runs (each in its own slot): all their blocks are drafted in
    /// ONE drafter decode and verified in ONE target decode. A run that does not draft
    /// this cycle (plain decoding, or drafting would not pay) adds its one token to the
    /// same verify decode. Returns, per run, the tokens committed to its output.
    /// Token trees need a single-slot engine: with several slots, `tree` drafts the best path.
    pub fn step_all(&mut self, runs: &mut [&mut Run]) -> Result<Vec<Vec<Token>>> {
        let mut seen = vec![false; self.slots.len()];
        for r in runs.iter() {
            if std::mem::replace(&mut seen[r.slot], true) {
                return Err(EngineError::Config(format!("two runs share slot {}", r.slot)));
            }
        }
        let mut plans = self.plan(runs);
        if plans.is_empty() {
            return Ok(vec![Vec::new(); runs.len()]);
        }
        let t0 = Instant::now();
        self.draft(&mut plans, runs)?;
        let t1 = Instant::now();
        let draft_ms = (t1 - t0).as_secs_f64() * 1e3;

        // Trees need leaf sequences, which only a single-slot engine has.
        let trees = self.slots.len() == 1;
        for p in plans.iter_mut() {
            self.select(p, &mut *runs[p.run], trees);
            constrain(p, runs[p.run]);
            if runs[p.run].opts.adaptive {
                self.record_used_depth(p, runs[p.run].opts.block);
            }
        }
        self.fill_verify_batch(&mut plans)?;
        let t2 = Instant::now();
        let host_ms = (t2 - t1).as_secs_f64() * 1e3;

        self.target.decode(&self.batch, "verify")?;
        let t3 = Instant::now();
        let verify_ms = (t3 - t2).as_secs_f64() * 1e3;
        self.cost.record_verify(self.batch.len(), verify_ms);

        let mut out = vec![Vec::new(); runs.len()];
        // Tokens this cycle owes to the drafter call, for the cost model's verdict on it.
        let mut drafter_credited = 0;
        let mut drafted_any = false;
        for p in &plans {
            let t = Instant::now();
            let run = &mut *runs[p.run];
            let verify_before = run.stats.verify_ms;
            let lookup_before = run.stats.from_lookup.accepted;
            let (committed, probs) = self.accept_and_commit(p, run)?;
            let redecode_ms = run.stats.verify_ms - verify_before;
            // The look-up's tokens would have been taken without the drafter call: a
            // drafter whose cycles pay only through them is not paying.
            let from_lookup = if p.lattice.is_some() { run.stats.from_lookup.accepted - lookup_before } else { 0 };
            drafter_credited += committed.len().saturating_sub(from_lookup);
            // A draft that was not worth verifying still cost a drafter call.
            drafted_any |= p.lattice.is_some();
            let s = &mut run.stats;
            s.draft_ms += draft_ms;
            if p.use_drafter {
                s.from_drafter.ms += draft_ms;
            }
            s.verify_ms += verify_ms;
            s.host_ms += host_ms + ms_since(t) - redecode_ms;
            // (a cycle whose first row was a near-tie commits nothing: its token is decided
            // alone next cycle)
            if let Some(&last) = committed.last() {
                run.next = last;
            }
            let before = run.out.tokens.len();
            run.commit(self.target.model(), &committed, &probs);
            out[p.run] = run.out.tokens[before..].to_vec();
        }
        if drafted_any {
            self.cost.record_cycle(drafter_credited, plans.len(), ms_since(t0));
        }
        Ok(out)
    }

    /// Decide, for each unfinished run, how many tokens it may draft this cycle.
    fn plan(&mut self, runs: &mut [&mut Run]) -> Vec<Plan> {
        let n_ctx = self.n_ctx();
        let mut plans = Vec::new();
        for (i, run) in runs.iter_mut().enumerate() {
            if run.finish.is_some() {
                continue;
            }
            // `run.next` is committed but not yet decoded: it sits at position cached.len().
            let pos0 = self.slots[run.slot].cached.len();
            if pos0 >= n_ctx {
                run.finish = Some(FinishReason::Context);
                run.t_end.get_or_insert_with(Instant::now);
                continue;
            }
            let remaining = run.opts.n_predict - run.out.tokens.len();
            let room = n_ctx - pos0 - 1;
            let mut max_draft = run.opts.block.saturating_sub(1).min(remaining.saturating_sub(1)).min(room);
            if !run.speculative || std::mem::take(&mut run.single_next) {
                max_draft = 0;
            }
            let lookup = if max_draft > 0 && run.opts.lookup { self.look_up(run, max_draft) } else { None };
            // A confident look-up saves the drafter call: it is expected to be taken at
            // least as far as the drafter's drafts have been lately.
            let lookup_expected = lookup.as_ref().map_or(0.0, |l| {
                self.cost.expected_accepted(&l.path(&run.lookup_calibration))
            });
            let use_drafter = max_draft > 0
                && self.drafter.is_some()
                && !(lookup_expected > 0.0 && lookup_expected >= self.cost.drafter_expected())
                && (!run.opts.adaptive || self.cost.should_draft());
            let use_llama_ngram = max_draft > 0 && run.opts.llama_ngram.is_some();
            if !use_drafter && lookup.is_none() && !use_llama_ngram {
                max_draft = 0;
            }
            plans.push(Plan {
                run: i,
                slot: run.slot,
                last: run.next,
                pos0,
                max_draft,
                use_drafter,
                use_llama_ngram,
                lookup,
                lattice: None,
                tree: DraftTree::default(),
                gains: Vec::new(),
                row0: 0,
                n_leaves: 0,
                states: Vec::new(),
            });
        }
        plans
    }

    /// One drafter decode for every plan that drafts (llama.cpp's own driver drafts
    /// the `upstream` plans, one decode each).
    fn draft(&mut self, plans: &mut [Plan], runs: &mut [&mut Run]) -> Result<()> {
        let t0 = Instant::now();
        for p in plans.iter_mut().filter(|p| p.use_drafter) {
            self.flush_features(p.slot)?;
        }
        for p in plans.iter_mut().filter(|p| p.use_llama_ngram) {
            let (_, ngram) = self.llama_ngram.as_mut().expect("made when the run started");
            let tokens = ngram.draft(p.slot as i32, &self.slots[p.slot].cached, p.last, p.pos0, p.max_draft)?;
            p.tree = DraftTree::chain(&tokens);
            p.gains = vec![1.0; tokens.len()];
        }
        for p in plans.iter_mut() {
            if !p.use_drafter || runs[p.run].opts.select != SelectMode::Upstream {
                continue;
            }
            let drafter = self.drafter.as_mut().expect("speculative runs need a drafter");
            let tokens = drafter.draft_upstream(&self.target, p.slot as i32, p.last, p.pos0, p.max_draft)?;
            p.tree = DraftTree::chain(&tokens);
            p.gains = vec![1.0; tokens.len()];
            runs[p.run].stats.n_draft_calls += 1;
            runs[p.run].stats.n_draft_positions += p.max_draft;
        }
        let drafting: Vec<usize> = (0..plans.len())
            .filter(|&i| plans[i].use_drafter && runs[plans[i].run].opts.select != SelectMode::Upstream)
            .collect();
        if drafting.is_empty() {
            return Ok(());
        }
        let blocks: Vec<(Token, usize, i32)> =
            drafting.iter().map(|&i| (plans[i].last, plans[i].pos0, plans[i].slot as i32)).collect();
        // An adaptive run's block is as deep as its verifies have lately taken drafts in.
        let depth = |p: &Plan, run: &Run| if run.opts.adaptive { self.cost.draft_depth(p.max_draft) } else { p.max_draft };
        let n_block = drafting.iter().map(|&i| depth(&plans[i], runs[plans[i].run])).max().unwrap_or(0) + 1;
        let drafter = self.drafter.as_mut().expect("speculative runs need a drafter");
        let lattices = drafter.draft(&blocks, n_block)?;
        for (&i, l) in drafting.iter().zip(lattices) {
            runs[plans[i].run].stats.repaired_lattices += usize::from(l.repaired > 0);
            runs[plans[i].run].stats.n_draft_positions += l.n_pos;
            let n = plans[i].max_draft.min(l.n_pos);
            plans[i].lattice = Some(l.truncated(n));
        }
        self.cost.record_draft(ms_since(t0));
        for &i in &drafting {
            runs[plans[i].run].stats.n_draft_calls += 1;
        }
        Ok(())
    }

    /// The look-up's proposal for `run`'s next cycle, its index brought up to date first.
    fn look_up(&mut self, run: &mut Run, max_len: usize) -> Option<lookup::Proposal> {
        let t = Instant::now();
        let slot = &mut self.slots[run.slot];
        slot.lookup.sync(&slot.cached, run.next);
        let proposal = slot.lookup.propose(run.opts.lookup_ngram, max_len);
        run.stats.from_lookup.ms += ms_since(t);
        proposal
    }

    /// Tell the cost model how deep this cycle's verify takes the drafter's block in (an
    /// adaptive run's: a fixed block is verified whole). A look-up draft chosen over the
    /// drafter's says nothing about the drafter's depth.
    fn record_used_depth(&mut self, p: &Plan, block: usize) {
        let Some(lattice) = &p.lattice else { return };
        let used = p.tree.nodes.iter().filter(|n| n.origin.from_drafter()).map(|n| n.depth).max();
        if used.is_none() && p.lookup.is_some() {
            return;
        }
        self.cost.record_used_depth(lattice.n_pos, block.saturating_sub(1), used.unwrap_or(0));
    }

    /// Pick the draft of one plan from its sources (the drafter's lattice, the look-up's
    /// trie, or llama.cpp's own draft), and its length when adaptive.
    fn select(&self, p: &mut Plan, run: &mut Run, trees: bool) {
        if !p.tree.is_empty() {
            return; // llama.cpp's driver drafted it: verified as it is
        }
        let branch = run.opts.select == SelectMode::Tree && trees;
        let greedy = run.sampler.is_greedy();
        let calibration = &run.lookup_calibration;
        // At T > 0 a look-up draft is a chain: its tokens are one-hot proposals, and
        // siblings in a rejection-sampled tree must share one proposal law.
        let lookup = p.lookup.as_ref().map(|l| {
            if branch && greedy {
                l.tree(calibration, run.opts.tree_budget)
            } else {
                l.path(calibration)
            }
        });
        let mut tree = match (&p.lattice, lookup) {
            (None, None) => return,
            (None, Some(lookup)) => lookup,
            (Some(lattice), lookup) if greedy => {
                let drafted = select::draft(lattice, run.opts.select.walk(trees, run.opts.tree_budget), 0.0, run.sampler.rng());
                match lookup {
                    None => drafted,
                    Some(lookup) if branch => drafted.merge(&lookup, run.opts.tree_budget),
                    Some(lookup) => self.likelier(drafted, lookup, run.opts.adaptive),
                }
            }
            (Some(lattice), lookup) => {
                // Rejection sampling needs the drafter's draft drawn from q whatever else
                // happens, so the source is chosen before anything is drawn: by the
                // expected acceptance of the drafter's greedy path.
                let drafter_expected = self.cost.expected_accepted(&Greedy.select(lattice, lattice.n_pos));
                match lookup {
                    Some(lookup) if self.cost.expected_accepted(&lookup) >= drafter_expected => lookup,
                    _ => {
                        let walk = run.opts.select.walk(trees, run.opts.tree_budget);
                        let temperature = run.sampler.params().temperature;
                        select::draft(lattice, walk, temperature, run.sampler.rng())
                    }
                }
            }
        };
        if run.opts.adaptive {
            // Prefixes of best-first order are valid drafts; 0 means a plain step.
            tree.nodes.truncate(self.cost.choose_len(&tree.gains(), &tree));
        }
        if !tree.is_chain() {
            tree = tree.depth_first();
        }
        p.gains = tree.gains();
        p.tree = tree;
    }

    /// Of two paths, the one expected to commit more: per verify time when the length is
    /// adaptive, in tokens otherwise.
    fn likelier(&self, a: DraftTree, b: DraftTree, adaptive: bool) -> DraftTree {
        let score = |t: &DraftTree| {
            if adaptive {
                self.cost.best_len(&t.gains(), t).1
            } else {
                self.cost.expected_accepted(t)
            }
        };
        if score(&b) > score(&a) {
            b
        } else {
            a
        }
    }

    /// Lay out every plan's `[last, nodes...]` for one verify decode. A path lives in its
    /// slot's sequence; a tree gives each leaf its own sequence (sharing the slot's
    /// prefix) and each token the sequences of the leaves below it, at position = depth.
    fn fill_verify_batch(&mut self, plans: &mut [Plan]) -> Result<()> {
        self.batch.clear();
        let n_slots = self.slots.len() as i32;
        for p in plans.iter_mut() {
            p.row0 = self.batch.len();
            let seq = p.slot as i32;
            if p.tree.is_chain() {
                self.batch.add_token(p.last, p.pos0 as i32, &[seq], true)?;
                for node in &p.tree.nodes {
                    self.batch.add_token(node.token, (p.pos0 + node.depth) as i32, &[seq], true)?;
                }
                continue;
            }
            let leaves = p.tree.leaves();
            if leaves.len() > MAX_TREE_LEAVES {
                return Err(EngineError::Config(format!("a tree of {} leaves exceeds {MAX_TREE_LEAVES}", leaves.len())));
            }
            let mut seqs: Vec<Vec<i32>> = vec![Vec::new(); p.tree.len()];
            for (li, &leaf) in leaves.iter().enumerate() {
                for node in p.tree.path_to(leaf) {
                    seqs[node].push(n_slots + li as i32);
                }
            }
            let mut all = vec![seq];
            for li in 0..leaves.len() as i32 {
                self.target.seq_cp(seq, n_slots + li, -1, -1);
                all.push(n_slots + li);
            }
            self.batch.add_token(p.last, p.pos0 as i32, &all, true)?;
            for (node, s) in p.tree.nodes.iter().zip(&seqs) {
                self.batch.add_token(node.token, (p.pos0 + node.depth) as i32, s, true)?;
            }
            p.n_leaves = leaves.len();
        }
        Ok(())
    }

    /// Verify one plan's rows, keep what the target accepts in both caches, and return
    /// the committed tokens (accepted drafts, then the target's own next token).
    fn accept_and_commit(&mut self, p: &Plan, run: &mut Run) -> Result<(Vec<Token>, Vec<TokenProb>)> {
        let (mut path, mut next) = if run.sampler.is_greedy() {
            let (path, next) = self.accept_greedy(p, run)?;
            match self.guard_near_ties(p, run, path, next)? {
                Guarded::Keep(path, next) => (path, next),
                Guarded::Retry => return self.retry_alone(p, run),
            }
        } else {
            let temperature = run.sampler.params().temperature;
            let qs: Vec<Vec<(i32, f32)>> = p
                .tree
                .nodes
                .iter()
                .map(|n| match (&p.lattice, n.origin) {
                    (Some(l), Origin::Drafter) => {
                        proposal(l, n.depth - 1, n.parent.map_or(0, |i| p.tree.nodes[i].cand), temperature)
                    }
                    // A look-up draft, or llama.cpp's driver's (greedy): q is one-hot on the draft.
                    _ => vec![(n.token, 1.0)],
                })
                .collect();
            let (history, cached, target) = (&mut self.history, &self.slots[p.slot].cached, &self.target);
            let grammar = run.grammar.as_ref();
            let (law, rng) = run.sampler.params_and_rng();
            let mut target_law = |row: usize| -> Result<Distribution> {
                fill_row_history(history, cached, p.last, &p.tree, row, law);
                let state = if row == 0 { Ok(grammar) } else { node_grammar(p, grammar, row - 1) };
                Ok(law.distribution(&masked(target.logits(p.row0 + row)?, state?), history))
            };
            if run.opts.verifier == Verifier::AcceptAll {
                let principal = p.tree.principal_path();
                let bonus = target_law(principal.last().map_or(0, |&n| n + 1))?.sample(rng);
                (principal, bonus)
            } else {
                let accepted = verify_tree(&p.tree, &qs, target_law, rng)?;
                (accepted.nodes, accepted.bonus)
            }
        };
        // The target keeps `last` and the accepted path, the drafter receives their
        // features; everything else leaves both caches.
        self.commit_target(p, &path)?;
        if let Some((_, ngram)) = self.llama_ngram.as_mut().filter(|_| p.use_llama_ngram && !p.tree.is_empty()) {
            ngram.accept(p.slot as i32, path.len())?;
        }
        // The principal branch (laid out first) sits in cells right after the anchor, in
        // position order, exactly as plain decoding would have put it.
        let in_order = path.iter().enumerate().take_while(|&(i, &n)| n == i).count();
        let rows: Vec<usize> = std::iter::once(p.row0).chain(path[..in_order].iter().map(|&i| p.row0 + i + 1)).collect();
        self.queue_features(p.slot, &rows, p.pos0)?;
        // Log-probabilities come from the rows that chose each token, read before a re-decode
        // replaces them: the in-order part, and the first side-branch node (its parent's row is
        // in order); the rest of a side branch, and the token after it, from the re-decode.
        let mut probs = Vec::new();
        let prob_at = |row: usize, token: Token, n: usize| -> Result<TokenProb> {
            Ok(token_probs(self.target.logits(row)?, token, n))
        };
        if let Some(n) = run.opts.n_probs {
            for &i in &path[..path.len().min(in_order + 1)] {
                let row = p.tree.nodes[i].parent.map_or(0, |q| q + 1);
                probs.push(prob_at(p.row0 + row, p.tree.nodes[i].token, n)?);
            }
        }
        if in_order < path.len() {
            let t = Instant::now();
            let tail = path.split_off(in_order);
            let (kept, bonus) = self.redecode_branch(p, &tail, run)?;
            path.extend_from_slice(&tail[..kept]);
            next = bonus.unwrap_or(next);
            if let Some(n) = run.opts.n_probs {
                for (k, &i) in tail[..kept].iter().enumerate().skip(1) {
                    probs.push(token_probs(self.target.logits(k - 1)?, p.tree.nodes[i].token, n));
                }
                probs.push(token_probs(self.target.logits(kept - 1)?, next, n));
            }
            // a target decode: verify time, not host time
            run.stats.verify_ms += ms_since(t);
            run.stats.redecoded += tail.len();
        }
        let n_acc = path.len();
        if let (Some(n), true) = (run.opts.n_probs, probs.len() == n_acc) {
            let row = path.last().map_or(0, |&i| i + 1);
            probs.push(token_probs(self.target.logits(p.row0 + row)?, next, n));
        }

        let slot = &mut self.slots[p.slot];
        slot.cached.push(p.last);
        let mut committed: Vec<Token> = path.iter().map(|&i| p.tree.nodes[i].token).collect();
        if let Some(g) = run.grammar.as_mut() {
            // the output ends at an end-of-generation token: nothing after it is the grammar's
            for &t in committed.iter().chain([&next]).take_while(|&&t| !self.target.model().is_eog(t)) {
                g.accept(t)?;
            }
        }
        slot.cached.extend_from_slice(&committed);
        committed.push(next);
        run.stats.record_cycle(p.tree.len(), n_acc);
        self.record_sources(p, &path, run);
        let drafter_only = p.lattice.is_some() && p.tree.nodes.iter().all(|n| n.origin == Origin::Drafter);
        if drafter_only && !p.tree.is_empty() {
            run.stats.predicted_accepted += p.gains.iter().map(|&g| g as f64).sum::<f64>();
        }
        if let (Some(l), true) = (p.lattice.as_ref().filter(|_| drafter_only), n_acc < p.tree.len()) {
            run.stats.rejections += 1;
            let depth = n_acc; // the position the target decided differently
            if depth < l.n_pos && (0..l.k).any(|c| l.id(depth, c) == next) {
                run.stats.rejected_in_candidates += 1;
            }
        }
        if drafter_only && !p.tree.is_empty() && p.tree.is_chain() {
            self.cost.record_acceptance(&p.gains, n_acc);
        }
        Ok((committed, probs))
    }

    /// Count what each source proposed and the target took in `path`, and calibrate the
    /// look-up: of its tokens the target tested (their parent taken), how many it took.
    fn record_sources(&mut self, p: &Plan, path: &[usize], run: &mut Run) {
        let tree = &p.tree;
        let mut taken = vec![false; tree.len()];
        path.iter().for_each(|&i| taken[i] = true);
        let (mut drafter, mut lookup) = ([0usize; 2], [0usize; 2]);
        for (n, &t) in tree.nodes.iter().zip(&taken) {
            if n.origin.from_drafter() {
                drafter[0] += 1;
                drafter[1] += t as usize;
            }
            if n.origin.from_lookup() {
                lookup[0] += 1;
                lookup[1] += t as usize;
            }
        }
        for (stats, [drafted, accepted]) in [(&mut run.stats.from_drafter, drafter), (&mut run.stats.from_lookup, lookup)] {
            stats.cycles += (drafted > 0) as usize;
            stats.drafted += drafted;
            stats.accepted += accepted;
        }
        if p.lattice.is_some() {
            self.cost.record_drafter_accepted(drafter[1]);
        }
        if let Some(proposal) = &p.lookup {
            // every look-up token the target tested: those it took, and the first look-up
            // child of where it stopped (one per depth: its siblings were tested by the same row)
            let stopped_at = path.last().copied();
            let rejected = tree.children(stopped_at).any(|c| tree.nodes[c].origin.from_lookup());
            let rejected_depth = stopped_at.map_or(1, |i| tree.nodes[i].depth + 1);
            let tested = path.iter().filter(|&&i| tree.nodes[i].origin.from_lookup()).map(|&i| (tree.nodes[i].depth, true));
            for (depth, taken) in tested.chain(rejected.then_some((rejected_depth, false))) {
                let repeat = proposal.repeat_at(depth);
                run.lookup_calibration.record(repeat, taken);
                self.lookup_learned.record(repeat, taken);
            }
        }
    }

    /// The near-tie guard, where verify batches are not bit-exact (a GPU backend: the probe
    /// measured how far a batch row strays from a single step). A token is trusted only from a
    /// row whose best candidate leads the runner-up by more than twice that (each may stray),
    /// times [`NEAR_TIE_SAFETY`] (the probe sees a few rows, not every one). At the first row
    /// that leads by less, the cycle is cut: the tokens before it stand, and the row's input is
    /// decoded alone next cycle (as plain decoding decodes it), which decides. Accepted side
    /// branches of a tree are dropped at their first node (its token, chosen on an in-order
    /// row, stands): re-decoding them would be another batch.
    fn guard_near_ties(&mut self, p: &Plan, run: &mut Run, mut path: Vec<usize>, mut next: Token) -> Result<Guarded> {
        if p.tree.is_empty() {
            return Ok(Guarded::Keep(path, next)); // a plain step: what plain decoding does
        }
        let margin = match self.near_tie_margin {
            Some(m) => m,
            None => match self.target.model().verify_tolerance(self.batch.len()) {
                Some(stray) => NEAR_TIE_SAFETY * 2.0 * stray,
                None => return Ok(Guarded::Keep(path, next)),
            },
        };
        let in_order = path.iter().enumerate().take_while(|&(i, &n)| n == i).count();
        if in_order < path.len() {
            next = p.tree.nodes[path[in_order]].token;
            path.truncate(in_order);
        }
        let (history, cached, target) = (&mut self.history, &self.slots[p.slot].cached, &self.target);
        let law = run.sampler.params();
        // row j decided path[j] (or `next` after the last node); its input is path[j - 1]
        for j in 0..=path.len() {
            let row = if j == 0 { 0 } else { path[j - 1] + 1 };
            fill_row_history(history, cached, p.last, &p.tree, row, law);
            let logits = masked(target.logits(p.row0 + row)?, row_grammar(p, run, row)?);
            let lead = law.greedy_lead(&logits, history);
            if lead > margin {
                continue;
            }
            tracing::debug!(pos = p.pos0 + j, row, lead, margin, "near-tie: decided by a single step");
            run.stats.near_ties += 1;
            run.single_next = true;
            if j == 0 {
                return Ok(Guarded::Retry);
            }
            next = p.tree.nodes[path[j - 1]].token;
            path.truncate(j - 1);
            break;
        }
        Ok(Guarded::Keep(path, next))
    }

    /// A cycle whose anchor row was a near-tie: nothing is committed, and the anchor leaves the
    /// caches to be decoded alone next cycle.
    fn retry_alone(&mut self, p: &Plan, run: &mut Run) -> Result<(Vec<Token>, Vec<TokenProb>)> {
        self.commit_target(p, &[])?;
        self.target.seq_rm(p.slot as i32, p.pos0 as i32, -1)?;
        run.stats.record_verify(p.tree.len(), 0, 0);
        Ok((Vec::new(), Vec::new()))
    }

    /// Greedy verification: follow the target's argmax down the plan's draft.
    fn accept_greedy(&mut self, p: &Plan, run: &Run) -> Result<(Vec<usize>, Token)> {
        let (history, cached, target) = (&mut self.history, &self.slots[p.slot].cached, &self.target);
        let sampler = &run.sampler;
        let accepted = accept_greedy(&p.tree, |row| -> Result<Token> {
            fill_row_history(history, cached, p.last, &p.tree, row, sampler.params());
            Ok(constrained_argmax(sampler, target.logits(p.row0 + row)?, history, row_grammar(p, run, row)?))
        })?;
        Ok((accepted.nodes, accepted.bonus))
    }

    /// Keep `last` and the accepted `path` in the slot's sequence of the target cache;
    /// drop the rest of the plan's cells.
    fn commit_target(&mut self, p: &Plan, path: &[usize]) -> Result<()> {
        let seq = p.slot as i32;
        let keep_end = (p.pos0 + 1 + path.len()) as i32;
        if p.n_leaves == 0 {
            return self.target.seq_rm(seq, keep_end, -1).map_err(Into::into);
        }
        let n_slots = self.slots.len() as i32;
        if let Some(&deepest) = path.last() {
            // Any leaf below the deepest accepted node holds exactly the accepted path.
            let leaf = p.tree.leaves().iter().position(|&l| p.tree.path_to(l).contains(&deepest));
            let leaf_seq = n_slots + leaf.expect("every node has a leaf below it") as i32;
            self.target.seq_cp(leaf_seq, seq, p.pos0 as i32 + 1, keep_end);
        }
        for li in 0..p.n_leaves as i32 {
            self.target.seq_rm(n_slots + li, -1, -1)?;
        }
        Ok(())
    }

    /// Decode an accepted side branch `tail` (node indices, below the principal part of
    /// the path) again as a plain path right after that part: its cells sat behind free
    /// ones, out of position order, and its tree rows attended to ancestors in scattered
    /// cells, which llama.cpp's attention sums in another order than plain decoding does.
    /// At temperature 0 the branch is verified once more on the new rows, which round
    /// exactly as plain decoding: only its first node (accepted on an in-order row) is
    /// certain. Returns how many nodes of `tail` are kept and, when verified again, the
    /// target's next token after them. (At T > 0 the rounding of the tree rows changes the
    /// target's law by far less than any test can see; the sampled token stands.)
    fn redecode_branch(&mut self, p: &Plan, tail: &[usize], run: &Run) -> Result<(usize, Option<Token>)> {
        let sampler = &run.sampler;
        let seq = p.slot as i32;
        let pos0 = p.pos0 + p.tree.nodes[tail[0]].depth;
        self.target.seq_rm(seq, pos0 as i32, -1)?;
        self.batch.clear();
        for (i, &node) in tail.iter().enumerate() {
            self.batch.add_token(p.tree.nodes[node].token, (pos0 + i) as i32, &[seq], true)?;
        }
        self.target.decode(&self.batch, "re-decode of an accepted branch")?;
        let (kept, next) = if sampler.is_greedy() {
            let (kept, next) = self.reverify_branch(p, tail, sampler, run.grammar.as_ref())?;
            (kept, Some(next))
        } else {
            (tail.len(), None)
        };
        if kept < tail.len() {
            tracing::debug!(kept, drafted = tail.len(), "a side branch accepted on scattered cells was cut by its re-decode");
            self.target.seq_rm(seq, (pos0 + kept) as i32, -1)?;
        }
        let rows: Vec<usize> = (0..kept).collect();
        self.queue_features(p.slot, &rows, pos0)?;
        Ok((kept, next))
    }

    /// Greedy verification of a re-decoded `tail` on the rows of the last decode: how
    /// many of its nodes the target confirms and its next token after them.
    fn reverify_branch(&mut self, p: &Plan, tail: &[usize], sampler: &Sampler, grammar: Option<&Grammar>) -> Result<(usize, Token)> {
        let mut history = std::mem::take(&mut self.history);
        // the last row always ends the loop: no node follows it
        let mut confirmed: Result<(usize, Token)> = Ok((tail.len(), 0));
        for (row, &node) in tail.iter().enumerate() {
            fill_row_history(&mut history, &self.slots[p.slot].cached, p.last, &p.tree, node + 1, sampler.params());
            let state = node_grammar(p, grammar, node);
            let predicted = match (self.target.logits(row), state) {
                (Ok(l), Ok(state)) => constrained_argmax(sampler, l, &history, state),
                (Err(e), _) => {
                    confirmed = Err(e.into());
                    break;
                }
                (_, Err(e)) => {
                    confirmed = Err(e);
                    break;
                }
            };
            if tail.get(row + 1).map(|&child| p.tree.nodes[child].token) != Some(predicted) {
                confirmed = Ok((row + 1, predicted));
                break;
            }
        }
        self.history = history;
        confirmed
    }

    /// Decode the part of `prompt` not already cached in `slot`; returns the first
    /// generated token.
    fn prefill(
        &mut self,
        slot: usize,
        prompt: &[Token],
        run: &mut Run,
        progress: &mut dyn FnMut(PromptProgress),
    ) -> Result<(Token, Option<TokenProb>)> {
        // Reuse the cached prefix, but always decode at least the last prompt token:
        // its logits give the first generated token.
        let cached = &self.slots[slot].cached;
        let common = cached.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let keep = common.min(prompt.len() - 1);
        self.truncate_cache(slot, keep)?;
        let todo = &prompt[keep..];
        run.stats.n_prompt_decoded = todo.len();
        let n_batch = self.batch.capacity();
        let t_start = run.t_start;
        // (the report before the first decode has taken no time yet)
        let report = |processed: usize| PromptProgress {
            total: prompt.len(),
            cache: keep,
            processed,
            ms: if processed == keep { 0.0 } else { ms_since(t_start) },
        };
        progress(report(keep));
        let mut last_logits_row = 0;
        for (c, chunk) in todo.chunks(n_batch).enumerate() {
            let is_last_chunk = (c + 1) * n_batch >= todo.len();
            self.batch.clear();
            let pos0 = self.slots[slot].cached.len();
            for (i, &t) in chunk.iter().enumerate() {
                let output = is_last_chunk && i + 1 == chunk.len();
                self.batch.add_token(t, (pos0 + i) as i32, &[slot as i32], output)?;
            }
            self.target.decode(&self.batch, "prompt")?;
            let rows: Vec<usize> = (0..chunk.len()).collect();
            self.queue_features(slot, &rows, pos0)?;
            self.slots[slot].cached.extend_from_slice(chunk);
            last_logits_row = chunk.len() - 1;
            progress(report(self.slots[slot].cached.len()));
        }
        let logits = self.target.logits(last_logits_row)?;
        let first = if run.sampler.is_greedy() {
            constrained_argmax(&run.sampler, logits, prompt, run.grammar.as_ref())
        } else {
            run.sampler.pick(&masked(logits, run.grammar.as_ref()), prompt)
        };
        Ok((first, run.opts.n_probs.map(|n| token_probs(logits, first, n))))
    }

    /// Queue the features of `rows` of the last target decode for the drafter, at
    /// consecutive positions of `slot` from `pos0` (right after what is already queued).
    fn queue_features(&mut self, slot: usize, rows: &[usize], pos0: usize) -> Result<()> {
        let Some(drafter) = self.drafter.as_ref() else { return Ok(()) };
        let s = &mut self.slots[slot];
        if s.pending.is_empty() {
            s.pending_pos0 = pos0;
        }
        debug_assert_eq!(s.pending_pos0 + s.pending.len() / drafter.feature_width(), pos0);
        self.target.append_features(rows, &mut s.pending)?;
        Ok(())
    }

    /// Inject the features queued for `slot` into the drafter's cache.
    fn flush_features(&mut self, slot: usize) -> Result<()> {
        if let Some(drafter) = self.drafter.as_mut() {
            let s = &mut self.slots[slot];
            if !s.pending.is_empty() {
                drafter.inject(&s.pending, s.pending_pos0, slot as i32)?;
                s.pending.clear();
            }
        }
        Ok(())
    }

    /// Time target decodes of the batch sizes a cycle may verify, so the first cycles
    /// already choose their length from this machine's costs. The cells are removed again.
    fn calibrate(&mut self, slot: usize, max_batch: usize) -> Result<()> {
        let pos0 = self.slots[slot].cached.len();
        let max_batch = max_batch.min(self.batch.capacity()).min(self.n_ctx().saturating_sub(pos0));
        if self.cost.is_calibrated(max_batch) || max_batch < 2 {
            return Ok(());
        }
        let token = *self.slots[slot].cached.last().expect("calibration runs after the prompt");
        let seq = slot as i32;
        let mut sizes: Vec<usize> =
            std::iter::successors(Some(1usize), |b| Some(b * 2)).take_while(|&b| b < max_batch).collect();
        sizes.push(max_batch);
        for &b in &sizes {
            for rep in 0..2 {
                self.batch.clear();
                for i in 0..b {
                    self.batch.add_token(token, (pos0 + i) as i32, &[seq], true)?;
                }
                let t = Instant::now();
                self.target.decode(&self.batch, "cost calibration")?;
                // The first run of a size warms up (graph allocation): keep the second.
                if rep == 1 {
                    self.cost.record_verify(b, ms_since(t));
                }
                self.target.seq_rm(seq, pos0 as i32, -1)?;
            }
        }
        Ok(())
    }

    fn truncate_cache(&mut self, slot: usize, keep: usize) -> Result<()> {
        let seq = slot as i32;
        let s = &mut self.slots[slot];
        if keep < s.cached.len() || keep == 0 {
            self.target.seq_rm(seq, keep as i32, -1)?;
            if let Some(d) = self.drafter.as_mut() {
                d.truncate(seq, keep)?;
                let queued_keep = keep.saturating_sub(s.pending_pos0) * d.feature_width();
                s.pending.truncate(queued_keep);
            }
            s.cached.truncate(keep);
        }
        Ok(())
    }

    fn check_slot(&self, slot: usize) -> Result<()> {
        if slot >= self.slots.len() {
            return Err(EngineError::Config(format!("slot {slot} does not exist ({} slots)", self.slots.len())));
        }
        Ok(())
    }

    /// Tokens held in the cache of slot 0 (prompt and committed output, the last token excluded).
    pub fn cached_tokens(&self) -> &[Token] {
        self.cached_tokens_in(0)
    }

    pub fn cached_tokens_in(&self, slot: usize) -> &[Token] {
        &self.slots[slot].cached
    }

    /// Cache positions of slot 0 held by the target and the drafter (see [`Engine::cache_extents_in`]).
    pub fn cache_extents(&self) -> (usize, Option<usize>) {
        self.cache_extents_in(0)
    }

    /// Cache positions of `slot` held by the target and the drafter, counting features
    /// queued for the drafter (both must equal `cached_tokens_in(slot).len()`).
    pub fn cache_extents_in(&self, slot: usize) -> (usize, Option<usize>) {
        let seq = slot as i32;
        let s = &self.slots[slot];
        let drafter = self.drafter.as_ref().map(|d| {
            let queued = s.pending.len() / d.feature_width();
            if queued > 0 {
                debug_assert_eq!(d.cached_len(seq), s.pending_pos0);
                s.pending_pos0 + queued
            } else {
                d.cached_len(seq)
            }
        });
        ((self.target.seq_pos_max(seq) + 1) as usize, drafter)
    }
}

/// The history a verify row's distribution depends on: the cache, `last`, and the
/// drafted path down to that row's node (left empty when no penalty reads it).
fn fill_row_history(
    out: &mut Vec<Token>,
    cached: &[Token],
    last: Token,
    tree: &DraftTree,
    row: usize,
    law: &SamplingParams,
) {
    out.clear();
    if !law.uses_history() {
        return;
    }
    out.extend_from_slice(cached);
    out.push(last);
    if row > 0 {
        out.extend(tree.path_to(row - 1).into_iter().map(|i| tree.nodes[i].token));
    }
}

/// `logits` with what `grammar` forbids masked out (borrowed as they are without one).
fn masked<'a>(logits: &'a [f32], grammar: Option<&Grammar>) -> std::borrow::Cow<'a, [f32]> {
    match grammar {
        None => std::borrow::Cow::Borrowed(logits),
        Some(g) => std::borrow::Cow::Owned(g.mask(logits)),
    }
}

/// The greedy token under `grammar`. Masking only removes tokens, so when the unmasked choice is
/// allowed it is the masked one too (llama.cpp samples first and masks only on a miss, for the
/// same reason): the whole vocabulary is masked only then.
fn constrained_argmax(sampler: &Sampler, logits: &[f32], history: &[Token], grammar: Option<&Grammar>) -> Token {
    let free = sampler.distribution(logits, history).argmax();
    match grammar {
        Some(g) if !g.allows(free) => sampler.distribution(&g.mask(logits), history).argmax(),
        _ => free,
    }
}

/// The grammar state after node `node` of `p`'s draft (`run_grammar` is the run's).
fn node_grammar<'a>(p: &'a Plan, run_grammar: Option<&'a Grammar>, node: usize) -> Result<Option<&'a Grammar>> {
    match run_grammar {
        None => Ok(None),
        Some(_) => match p.states.get(node) {
            Some(Some(g)) => Ok(Some(g)),
            _ => Err(EngineError::Config(format!("no grammar state below draft node {node}: the target took a token the grammar forbids"))),
        },
    }
}

/// The grammar state of verify row `row` (0: the anchor, the run's own state).
fn row_grammar<'a>(p: &'a Plan, run: &'a Run, row: usize) -> Result<Option<&'a Grammar>> {
    match row {
        0 => Ok(run.grammar.as_ref()),
        r => node_grammar(p, run.grammar.as_ref(), r - 1),
    }
}

/// Follow the grammar down `p`'s draft: each node's state after its token. At T = 0 the
/// tokens it forbids (and what hangs below them) are cut before verification: the target
/// would never take them. Sampled drafts keep them (dropping a drawn token would bias the
/// rejection sampler), and verification rejects them.
fn constrain(p: &mut Plan, run: &Run) {
    let Some(g) = run.grammar.as_ref() else { return };
    let mut states: Vec<Option<Grammar>> = Vec::with_capacity(p.tree.len());
    for n in &p.tree.nodes {
        let parent = match n.parent {
            None => Some(g),
            Some(i) => states[i].as_ref(),
        };
        let state = parent.filter(|s| s.allows(n.token)).and_then(|s| {
            let mut next = s.clone();
            next.accept(n.token).ok().map(|_| next)
        });
        states.push(state);
    }
    if run.sampler.is_greedy() && states.iter().any(Option::is_none) {
        let keep: Vec<bool> = states.iter().map(Option::is_some).collect();
        p.tree = p.tree.retain(&keep);
        states.retain(Option::is_some);
        p.gains = p.tree.gains();
    }
    p.states = states;
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// How much wider than the probe's worst stray the near-tie guard's margin is.
const NEAR_TIE_SAFETY: f32 = 2.0;

/// What the near-tie guard leaves of a greedy verification.
enum Guarded {
    /// The accepted path and the next token, possibly cut short.
    Keep(Vec<usize>, Token),
    /// The anchor's own row was too close to call: decide it alone next cycle.
    Retry,
}

/// One generation in progress: its options, sampler, output and statistics.
pub struct Run {
    slot: usize,
    opts: GenerateOptions,
    sampler: Sampler,
    stats: Stats,
    out: Output,
    /// Log-probabilities of `out.tokens` (when asked for).
    probs: Vec<TokenProb>,
    /// The grammar's state after the committed tokens (`GenerateOptions::grammar`).
    grammar: Option<Grammar>,
    /// The last committed token, not yet decoded by the target.
    next: Token,
    finish: Option<FinishReason>,
    speculative: bool,
    /// How often the target took look-up proposals in this run, starting from what earlier
    /// runs showed (`Engine::lookup_learned`).
    lookup_calibration: lookup::Calibration,
    t_start: Instant,
    /// When the generation ended (its timings stop there).
    t_end: Option<Instant>,
    /// The next cycle decodes `next` alone: a batch row left its choice too close to call.
    single_next: bool,
}

impl Run {
    /// The engine slot (cache sequence) this generation runs in.
    pub fn options(&self) -> &GenerateOptions {
        &self.opts
    }

    pub fn slot(&self) -> usize {
        self.slot
    }

    /// Why the generation ended, once it has.
    pub fn finish(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Output tokens so far (end-of-generation tokens excluded).
    pub fn tokens(&self) -> &[Token] {
        &self.out.tokens
    }

    /// Log-probabilities of [`Run::tokens`], when asked for (`GenerateOptions::n_probs`).
    pub fn probs(&self) -> &[TokenProb] {
        &self.probs
    }

    /// Output text so far (a stop string and anything after it excluded).
    pub fn text(&self) -> String {
        self.out.text()
    }

    /// Output bytes so far (a token may end inside a UTF-8 character).
    pub fn text_bytes(&self) -> &[u8] {
        &self.out.bytes[..self.out.stop_at.unwrap_or(self.out.bytes.len())]
    }

    /// The stop string that ended the generation, if one did.
    pub fn stop_word(&self) -> Option<&str> {
        self.out.stop_word.as_deref()
    }

    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.n_generated = self.out.tokens.len();
        let end = self.t_end.unwrap_or_else(Instant::now);
        s.total_ms = (end - self.t_start).as_secs_f64() * 1e3;
        s
    }

    /// Stop the generation early (the output so far stays).
    pub fn cancel(&mut self) {
        self.finish.get_or_insert(FinishReason::Cancelled);
        self.t_end.get_or_insert_with(Instant::now);
    }

    pub fn into_generation(self) -> Generation {
        let stats = self.stats();
        Generation {
            text: self.out.text(),
            tokens: self.out.tokens,
            probs: self.probs,
            finish: self.finish.unwrap_or(FinishReason::Length),
            stats,
        }
    }

    /// Take newly committed tokens (and their log-probabilities, when asked for).
    fn commit(&mut self, model: &Model, new: &[Token], probs: &[TokenProb]) {
        if self.finish.is_none() {
            let before = self.out.tokens.len();
            self.finish = self.out.push(model, new, &self.opts);
            let taken = self.out.tokens.len() - before;
            self.probs.extend_from_slice(&probs[..taken.min(probs.len())]);
        }
        if self.finish.is_some() {
            self.t_end.get_or_insert_with(Instant::now);
        }
    }
}

/// Generated tokens and text, with the stop conditions applied as tokens land.
#[derive(Default)]
struct Output {
    tokens: Vec<Token>,
    bytes: Vec<u8>,
    /// Text length after a stop string was found (the stop string excluded).
    stop_at: Option<usize>,
    stop_word: Option<String>,
}

impl Output {
    /// Take newly committed tokens in order; returns why generation ends, if it does.
    fn push(&mut self, model: &Model, new: &[Token], opts: &GenerateOptions) -> Option<FinishReason> {
        for &t in new {
            if model.is_eog(t) {
                return Some(FinishReason::Eog);
            }
            self.tokens.push(t);
            let from = self.bytes.len();
            self.bytes.extend_from_slice(&model.token_bytes(t, false));
            if let Some((at, word)) = find_stop(&self.bytes, from, &opts.stop) {
                self.stop_at = Some(at);
                self.stop_word = Some(word.to_string());
                return Some(FinishReason::Stop);
            }
            if self.tokens.len() >= opts.n_predict {
                return Some(FinishReason::Length);
            }
        }
        None
    }

    fn text(&self) -> String {
        let end = self.stop_at.unwrap_or(self.bytes.len());
        String::from_utf8_lossy(&self.bytes[..end]).into_owned()
    }
}

/// The earliest stop string that ends in `bytes[from..]`, and where it starts.
fn find_stop<'s>(bytes: &[u8], from: usize, stops: &'s [String]) -> Option<(usize, &'s str)> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|word| {
            let s = word.as_bytes();
            let start = from.saturating_sub(s.len() - 1);
            bytes[start..].windows(s.len()).position(|w| w == s).map(|p| (start + p, word.as_str()))
        })
        .min_by_key(|&(at, _)| at)
}

#[cfg(test)]
mod tests {
    use super::find_stop;

    #[test]
    fn stop_strings_are_found_across_token_boundaries() {
        let stops = vec!["\n\n".to_string(), "END".to_string()];
        // "EN" came with an earlier token, "D" with the new one (from = 6).
        assert_eq!(find_stop(b"abc\nEND", 6, &stops), Some((4, "END")));
        assert_eq!(find_stop(b"abc\n\nx", 4, &stops), Some((3, "\n\n")));
        assert_eq!(find_stop(b"abcdef", 3, &stops), None);
        // The earliest match wins.
        assert_eq!(find_stop(b"END\n\n", 0, &stops), Some((0, "END")));
    }
}
