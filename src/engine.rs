//! The decode loop: prefill, inject, draft, select, verify, commit, roll back.
//!
//! One [`Engine`] owns a target context and, optionally, a DFlash drafter next to it.
//! Its cache holds one conversation: a new prompt that extends what is cached only
//! decodes the new part. Without a drafter (or with [`SelectMode::None`]) it decodes
//! one token per target step: the baseline every speculative mode must reproduce.
use crate::draft::cost::CostModel;
use crate::draft::drafter::Drafter;
use crate::draft::select::{proposal, sample_path, BestPath, Greedy, Selector, TreeBestFirst};
use crate::draft::{lattice, DraftTree};
use crate::llama::{Batch, Context, ContextParams, FeatureSource, LlamaError, Model, ModelParams, Token};
use crate::sampling::{Sampler, SamplingParams};
use crate::verify::{accept_greedy, rejection::verify_chain};
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
    pub stop: Vec<String>,
    pub sampling: SamplingParams,
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
            stop: Vec::new(),
            sampling: SamplingParams::default(),
            verifier: Verifier::Rejection,
        }
    }
}

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
    pub prefill_ms: f64,
    pub draft_ms: f64,
    pub verify_ms: f64,
    pub host_ms: f64,
    pub total_ms: f64,
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
        self.cycles += 1;
        self.cycle_tokens += accepted + 1;
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

pub struct Engine {
    // Field order is drop order: the drafter's context borrows from the target's.
    drafter: Option<Drafter>,
    target: Context,
    batch: Batch,
    /// Tokens whose K/V are in the target cache (and whose features are in the drafter's).
    cached: Vec<Token>,
    /// Target features not yet injected into the drafter: whole rows for consecutive
    /// positions from `pending_pos0`. Injection waits until the next draft, so plain
    /// steps cost only a copy and the drafter gets one batched decode.
    pending: Vec<f32>,
    pending_pos0: usize,
    cost: CostModel,
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
        match &cfg.drafter {
            Some(d) => drop(crate::gguf::check_pair_files(&cfg.target, d)?),
            None => drop(crate::gguf::read_model_info(&cfg.target)?),
        }
        let mparams = ModelParams { n_gpu_layers: cfg.n_gpu_layers };
        let target = Arc::new(Model::load(&cfg.target, &mparams)?);
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
        let n_batch = cfg.n_batch.max(64);
        // Token trees put each leaf in its own sequence, all in one unified cache.
        let n_seq_max = if drafter.is_some() { MAX_TREE_LEAVES + 1 } else { 1 };
        let params =
            ContextParams { n_ctx: cfg.n_ctx, n_batch, n_seq_max, n_threads: cfg.n_threads, features };
        let target_ctx = Context::new(target, &params, None)?;
        let drafter = match drafter {
            Some(d) => Some(Drafter::new(d, &target_ctx, cfg.n_threads)?),
            None => None,
        };
        Ok(Self {
            drafter,
            batch: Batch::tokens(target_ctx.n_batch(), n_seq_max),
            target: target_ctx,
            cached: Vec::new(),
            pending: Vec::new(),
            pending_pos0: 0,
            cost: CostModel::default(),
            history: Vec::new(),
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        self.target.model()
    }

    pub fn has_drafter(&self) -> bool {
        self.drafter.is_some()
    }

    pub fn drafter(&self) -> Option<&Drafter> {
        self.drafter.as_ref()
    }

    pub fn n_ctx(&self) -> usize {
        self.target.n_ctx()
    }

    /// Forget the cached conversation.
    pub fn reset(&mut self) -> Result<()> {
        self.truncate_cache(0)
    }

    /// Generate a continuation of `prompt`. `on_tokens` sees every batch of committed
    /// tokens as it lands and returns `false` to stop.
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
                run.finish = Some(FinishReason::Cancelled);
            }
            if run.finish.is_some() {
                break;
            }
            fresh = self.step(&mut run)?;
        }
        Ok(run.into_generation())
    }

    /// Begin a generation: decode the prompt (what the cache lacks of it) and commit the
    /// first token. Continue with [`Engine::step`] until [`Run::finish`] is set.
    pub fn start(&mut self, prompt: &[Token], opts: &GenerateOptions) -> Result<Run> {
        let t_start = Instant::now();
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if opts.n_predict == 0 {
            return Err(EngineError::Config("n_predict must be at least 1".into()));
        }
        if prompt.len() >= self.n_ctx() {
            return Err(EngineError::PromptTooLong { n_prompt: prompt.len(), n_ctx: self.n_ctx() });
        }
        let speculative = opts.select != SelectMode::None && self.drafter.is_some();
        if speculative && opts.select == SelectMode::Tree && !opts.sampling.is_greedy() {
            tracing::info!("tree selection samples a single path at temperature > 0");
        }
        let mut run = Run {
            opts: opts.clone(),
            sampler: Sampler::new(opts.sampling.clone()),
            stats: Stats { n_prompt: prompt.len(), ..Stats::default() },
            out: Output::default(),
            next: 0,
            finish: None,
            speculative,
            t_start,
        };
        run.next = self.prefill(prompt, &mut run.sampler, &mut run.stats)?;
        run.stats.prefill_ms = ms_since(t_start);
        if speculative && opts.adaptive {
            self.calibrate(opts.block.max(opts.tree_budget + 1))?;
        }
        run.commit(self.target.model(), &[run.next]);
        Ok(run)
    }

    /// One cycle: a speculative draft-and-verify (or a plain step), committing at least
    /// one token. Returns the tokens committed to the output by this cycle.
    pub fn step(&mut self, run: &mut Run) -> Result<Vec<Token>> {
        if run.finish.is_some() {
            return Ok(Vec::new());
        }
        // `run.next` is committed but not yet decoded: it sits at position cached.len().
        let pos = self.cached.len();
        if pos >= self.n_ctx() {
            run.finish = Some(FinishReason::Context);
            return Ok(Vec::new());
        }
        let remaining = run.opts.n_predict - run.out.tokens.len();
        let room = self.n_ctx() - pos - 1;
        let max_draft = run.opts.block.saturating_sub(1).min(remaining.saturating_sub(1)).min(room);
        let draft = run.speculative && max_draft > 0 && (!run.opts.adaptive || self.cost.should_draft());
        let new_tokens = if draft {
            self.speculative_step(run.next, max_draft, &run.opts, &mut run.sampler, &mut run.stats)?
        } else {
            self.plain_step(run.next, &mut run.sampler, &mut run.stats)?
        };
        run.next = *new_tokens.last().expect("a step commits at least one token");
        let before = run.out.tokens.len();
        run.commit(self.target.model(), &new_tokens);
        Ok(run.out.tokens[before..].to_vec())
    }

    /// Decode the part of `prompt` not already cached; returns the first generated token.
    fn prefill(&mut self, prompt: &[Token], sampler: &mut Sampler, stats: &mut Stats) -> Result<Token> {
        // Reuse the cached prefix, but always decode at least the last prompt token:
        // its logits give the first generated token.
        let common = self.cached.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let keep = common.min(prompt.len() - 1);
        self.truncate_cache(keep)?;
        let todo = &prompt[keep..];
        stats.n_prompt_decoded = todo.len();
        let n_batch = self.batch.capacity();
        let mut last_logits_row = 0;
        for (c, chunk) in todo.chunks(n_batch).enumerate() {
            let is_last_chunk = (c + 1) * n_batch >= todo.len();
            self.batch.clear();
            let pos0 = self.cached.len();
            for (i, &t) in chunk.iter().enumerate() {
                let output = is_last_chunk && i + 1 == chunk.len();
                self.batch.add_token(t, (pos0 + i) as i32, &[0], output)?;
            }
            self.target.decode(&self.batch, "prompt")?;
            let rows: Vec<usize> = (0..chunk.len()).collect();
            self.inject_rows(&rows, pos0)?;
            self.cached.extend_from_slice(chunk);
            last_logits_row = chunk.len() - 1;
        }
        Ok(sampler.pick(self.target.logits(last_logits_row)?, prompt))
    }

    /// Decode `last` alone and pick the target's next token.
    fn plain_step(&mut self, last: Token, sampler: &mut Sampler, stats: &mut Stats) -> Result<Vec<Token>> {
        let t0 = Instant::now();
        let pos = self.cached.len();
        self.batch.clear();
        self.batch.add_token(last, pos as i32, &[0], true)?;
        self.target.decode(&self.batch, "generation step")?;
        self.history.clear();
        if sampler.uses_history() {
            self.history.extend_from_slice(&self.cached);
            self.history.push(last);
        }
        let next = sampler.pick(self.target.logits(0)?, &self.history);
        let ms = ms_since(t0);
        stats.verify_ms += ms;
        self.cost.record_verify(1, ms);
        let t1 = Instant::now();
        self.inject_rows(&[0], pos)?;
        stats.draft_ms += ms_since(t1);
        self.cached.push(last);
        stats.record_cycle(0, 0);
        Ok(vec![next])
    }

    /// One speculative cycle: draft after `last`, verify `[last, draft...]` in one target
    /// decode, commit the accepted path plus the target's own next token.
    fn speculative_step(
        &mut self,
        last: Token,
        max_draft: usize,
        opts: &GenerateOptions,
        sampler: &mut Sampler,
        stats: &mut Stats,
    ) -> Result<Vec<Token>> {
        let pos0 = self.cached.len();
        let t0 = Instant::now();
        self.flush_features()?;
        let drafter = self.drafter.as_mut().expect("speculative_step needs a drafter");
        let lattice = drafter.draft(last, pos0, max_draft + 1)?;
        let t1 = Instant::now();
        let draft_ms = (t1 - t0).as_secs_f64() * 1e3;
        stats.draft_ms += draft_ms;
        self.cost.record_draft(draft_ms);

        let temperature = sampler.params().temperature;
        let mut tree = if sampler.is_greedy() {
            select(opts, &lattice, max_draft)
        } else {
            // Rejection sampling needs drafts drawn from q: a sampled path.
            sample_path(&lattice, max_draft, temperature, sampler.rng())
        };
        let gains = tree_gains(&tree);
        if opts.adaptive {
            let keep = self.cost.choose_len(&gains, &tree);
            if keep == 0 {
                // Not worth verifying: the draft is sunk, decode plainly.
                return self.plain_step(last, sampler, stats);
            }
            tree.nodes.truncate(keep);
        }
        if !tree.is_chain() {
            tree = tree.depth_first();
        }
        let n_leaves = self.fill_verify_batch(last, pos0, &tree)?;
        let t2 = Instant::now();
        stats.host_ms += (t2 - t1).as_secs_f64() * 1e3;

        self.target.decode(&self.batch, "verify")?;
        let t3 = Instant::now();
        let verify_ms = (t3 - t2).as_secs_f64() * 1e3;
        stats.verify_ms += verify_ms;
        self.cost.record_verify(tree.len() + 1, verify_ms);

        let (path, next) = if sampler.is_greedy() {
            self.accept_greedy(last, &tree, sampler)?
        } else {
            let ps = (0..=tree.len())
                .map(|row| {
                    self.row_history(last, &tree, row, sampler);
                    Ok(sampler.distribution(self.target.logits(row)?, &self.history))
                })
                .collect::<Result<Vec<_>>>()?;
            let qs: Vec<Vec<(i32, f32)>> = tree
                .nodes
                .iter()
                .map(|n| {
                    let pred = n.parent.map_or(0, |p| tree.nodes[p].cand);
                    proposal(&lattice, n.depth - 1, pred, temperature)
                })
                .collect();
            let drafts: Vec<Token> = tree.nodes.iter().map(|n| n.token).collect();
            if opts.verifier == Verifier::AcceptAll {
                let bonus = ps[drafts.len()].sample(sampler.rng());
                ((0..drafts.len()).collect::<Vec<_>>(), bonus)
            } else {
                let r = verify_chain(&drafts, &qs, &ps, sampler.rng());
                ((0..r.n_accepted).collect::<Vec<_>>(), r.next)
            }
        };
        let n_acc = path.len();
        let t4 = Instant::now();
        stats.host_ms += (t4 - t3).as_secs_f64() * 1e3;

        // Commit: the target keeps `last` and the accepted path, the drafter receives
        // their features; everything else leaves both caches.
        self.commit_target(pos0, &tree, &path, n_leaves)?;
        // Nodes laid out after a rejected branch sit in cells behind free ones; later
        // tokens would fill those first and the cache would no longer be in position
        // order, which changes llama.cpp's attention rounding. Decode that tail again.
        let in_order = path.iter().enumerate().take_while(|&(i, &n)| n == i).count();
        let rows: Vec<usize> = std::iter::once(0).chain(path[..in_order].iter().map(|&i| i + 1)).collect();
        self.inject_rows(&rows, pos0)?;
        if in_order < path.len() {
            let tail: Vec<Token> = path[in_order..].iter().map(|&i| tree.nodes[i].token).collect();
            self.redecode(&tail, pos0 + 1 + in_order)?;
            stats.redecoded += tail.len();
        }
        stats.draft_ms += ms_since(t4);

        self.cached.push(last);
        let mut committed: Vec<Token> = path.iter().map(|&i| tree.nodes[i].token).collect();
        self.cached.extend_from_slice(&committed);
        committed.push(next);
        stats.record_cycle(tree.len(), n_acc);
        if tree.is_chain() {
            self.cost.record_acceptance(&gains[..tree.len()], n_acc);
        }
        self.cost.record_cycle(committed.len(), ms_since(t0));
        Ok(committed)
    }

    /// Lay out `[last, nodes...]` for one verify decode. A chain lives in sequence 0; a
    /// tree gives each leaf its own sequence (1..=leaves, sharing the cached prefix)
    /// and each token the sequences of the leaves below it, at position = depth.
    /// Returns the number of leaf sequences used (0 for a chain).
    fn fill_verify_batch(&mut self, last: Token, pos0: usize, tree: &DraftTree) -> Result<usize> {
        self.batch.clear();
        if tree.is_chain() {
            self.batch.add_token(last, pos0 as i32, &[0], true)?;
            for node in &tree.nodes {
                self.batch.add_token(node.token, (pos0 + node.depth) as i32, &[0], true)?;
            }
            return Ok(0);
        }
        let leaves = tree.leaves();
        if leaves.len() > MAX_TREE_LEAVES {
            return Err(EngineError::Config(format!("a tree of {} leaves exceeds {MAX_TREE_LEAVES}", leaves.len())));
        }
        let mut seqs: Vec<Vec<i32>> = vec![Vec::new(); tree.len()];
        for (li, &leaf) in leaves.iter().enumerate() {
            for node in tree.path_to(leaf) {
                seqs[node].push(li as i32 + 1);
            }
        }
        for s in 1..=leaves.len() as i32 {
            self.target.seq_cp(0, s, -1, -1);
        }
        let all: Vec<i32> = (0..=leaves.len() as i32).collect();
        self.batch.add_token(last, pos0 as i32, &all, true)?;
        for (node, s) in tree.nodes.iter().zip(&seqs) {
            self.batch.add_token(node.token, (pos0 + node.depth) as i32, s, true)?;
        }
        Ok(leaves.len())
    }

    /// Keep `last` and the accepted `path` in sequence 0 of the target cache; drop the rest.
    fn commit_target(&mut self, pos0: usize, tree: &DraftTree, path: &[usize], n_leaves: usize) -> Result<()> {
        let keep_end = (pos0 + 1 + path.len()) as i32;
        if n_leaves == 0 {
            return self.target.seq_rm(0, keep_end, -1).map_err(Into::into);
        }
        if let Some(&deepest) = path.last() {
            // Any leaf below the deepest accepted node holds exactly the accepted path.
            let leaf = tree.leaves().iter().position(|&l| tree.path_to(l).contains(&deepest));
            let seq = leaf.expect("every node has a leaf below it") as i32 + 1;
            self.target.seq_cp(seq, 0, pos0 as i32 + 1, keep_end);
        }
        for s in 1..=n_leaves as i32 {
            self.target.seq_rm(s, -1, -1)?;
        }
        Ok(())
    }

    /// Decode `tokens` again as a chain at `pos0..` (after dropping their cells) and queue
    /// their features for the drafter.
    fn redecode(&mut self, tokens: &[Token], pos0: usize) -> Result<()> {
        self.target.seq_rm(0, pos0 as i32, -1)?;
        self.batch.clear();
        for (i, &t) in tokens.iter().enumerate() {
            self.batch.add_token(t, (pos0 + i) as i32, &[0], false)?;
        }
        self.target.decode(&self.batch, "re-decode of an accepted branch")?;
        let rows: Vec<usize> = (0..tokens.len()).collect();
        self.inject_rows(&rows, pos0)
    }

    /// Greedy verification: follow the target's argmax down the tree.
    fn accept_greedy(&mut self, last: Token, tree: &DraftTree, sampler: &Sampler) -> Result<(Vec<usize>, Token)> {
        let failure = std::cell::RefCell::new(None);
        let history = std::cell::RefCell::new(std::mem::take(&mut self.history));
        let accepted = accept_greedy(tree, |row| {
            let mut h = history.borrow_mut();
            fill_row_history(&mut h, &self.cached, last, tree, row, sampler);
            match self.target.logits(row) {
                Ok(l) => sampler.distribution(l, &h).argmax(),
                Err(e) => {
                    failure.borrow_mut().get_or_insert(e);
                    -1
                }
            }
        });
        self.history = history.into_inner();
        match failure.into_inner() {
            Some(e) => Err(e.into()),
            None => Ok((accepted.nodes, accepted.bonus)),
        }
    }

    fn row_history(&mut self, last: Token, tree: &DraftTree, row: usize, sampler: &Sampler) {
        fill_row_history(&mut self.history, &self.cached, last, tree, row, sampler);
    }

    /// Queue the features of `rows` of the last target decode for the drafter, at
    /// consecutive positions from `pos0` (right after what is already queued).
    fn inject_rows(&mut self, rows: &[usize], pos0: usize) -> Result<()> {
        let Some(drafter) = self.drafter.as_ref() else { return Ok(()) };
        if self.pending.is_empty() {
            self.pending_pos0 = pos0;
        }
        debug_assert_eq!(self.pending_pos0 + self.pending.len() / drafter.feature_width(), pos0);
        self.target.append_features(rows, &mut self.pending)?;
        Ok(())
    }

    /// Inject the queued features into the drafter's cache.
    fn flush_features(&mut self) -> Result<()> {
        if let Some(drafter) = self.drafter.as_mut() {
            if !self.pending.is_empty() {
                drafter.inject(&self.pending, self.pending_pos0)?;
                self.pending.clear();
            }
        }
        Ok(())
    }

    /// Time target decodes of the batch sizes a cycle may verify, so the first cycles
    /// already choose their length from this machine's costs. The cells are removed again.
    fn calibrate(&mut self, max_batch: usize) -> Result<()> {
        let pos0 = self.cached.len();
        let max_batch = max_batch.min(self.batch.capacity()).min(self.n_ctx().saturating_sub(pos0));
        if self.cost.is_calibrated(max_batch) || max_batch < 2 {
            return Ok(());
        }
        let token = *self.cached.last().expect("calibration runs after the prompt");
        let mut sizes: Vec<usize> = std::iter::successors(Some(1usize), |b| Some(b * 2)).take_while(|&b| b < max_batch).collect();
        sizes.push(max_batch);
        for &b in &sizes {
            for rep in 0..2 {
                self.batch.clear();
                for i in 0..b {
                    self.batch.add_token(token, (pos0 + i) as i32, &[0], true)?;
                }
                let t = Instant::now();
                self.target.decode(&self.batch, "cost calibration")?;
                // The first run of a size warms up (graph allocation): keep the second.
                if rep == 1 {
                    self.cost.record_verify(b, ms_since(t));
                }
                self.target.seq_rm(0, pos0 as i32, -1)?;
            }
        }
        Ok(())
    }

    fn truncate_cache(&mut self, keep: usize) -> Result<()> {
        if keep < self.cached.len() || keep == 0 {
            self.target.seq_rm(0, keep as i32, -1)?;
            if let Some(d) = self.drafter.as_mut() {
                d.truncate(keep)?;
                let queued_keep = keep.saturating_sub(self.pending_pos0) * d.feature_width();
                self.pending.truncate(queued_keep);
            }
            self.cached.truncate(keep);
        }
        Ok(())
    }

    /// Tokens held in the cache (prompt and committed output, the last token excluded).
    pub fn cached_tokens(&self) -> &[Token] {
        &self.cached
    }

    /// Cache positions held by the target and the drafter, counting features queued for
    /// the drafter (both must equal `cached_tokens().len()`).
    pub fn cache_extents(&self) -> (usize, Option<usize>) {
        let drafter = self.drafter.as_ref().map(|d| {
            let queued = self.pending.len() / d.feature_width();
            if queued > 0 {
                debug_assert_eq!(d.cached_len(), self.pending_pos0);
                self.pending_pos0 + queued
            } else {
                d.cached_len()
            }
        });
        ((self.target.seq_pos_max(0) + 1) as usize, drafter)
    }
}

fn select(opts: &GenerateOptions, lattice: &lattice::Lattice, max_draft: usize) -> DraftTree {
    match opts.select {
        SelectMode::None | SelectMode::Greedy => Greedy.select(lattice, max_draft),
        SelectMode::BestPath => BestPath.select(lattice, max_draft),
        SelectMode::Tree => TreeBestFirst.select(lattice, opts.tree_budget),
    }
}

/// What each node adds to the expected accepted length: its path probability (the
/// product of the drafter's transition probabilities from the anchor down to it).
fn tree_gains(tree: &DraftTree) -> Vec<f32> {
    let mut gains: Vec<f32> = Vec::with_capacity(tree.len());
    for n in &tree.nodes {
        let parent = n.parent.map_or(1.0, |p| gains[p]);
        gains.push(parent * n.q);
    }
    gains
}

/// The history a verify row's distribution depends on: the cache, `last`, and the
/// drafted path down to that row's node (left empty when no penalty reads it).
fn fill_row_history(
    out: &mut Vec<Token>,
    cached: &[Token],
    last: Token,
    tree: &DraftTree,
    row: usize,
    sampler: &Sampler,
) {
    out.clear();
    if !sampler.uses_history() {
        return;
    }
    out.extend_from_slice(cached);
    out.push(last);
    if row > 0 {
        out.extend(tree.path_to(row - 1).into_iter().map(|i| tree.nodes[i].token));
    }
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// One generation in progress: its options, sampler, output and statistics.
pub struct Run {
    opts: GenerateOptions,
    sampler: Sampler,
    stats: Stats,
    out: Output,
    /// The last committed token, not yet decoded by the target.
    next: Token,
    finish: Option<FinishReason>,
    speculative: bool,
    t_start: Instant,
}

impl Run {
    /// Why the generation ended, once it has.
    pub fn finish(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Output tokens so far (end-of-generation tokens excluded).
    pub fn tokens(&self) -> &[Token] {
        &self.out.tokens
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
        s.total_ms = ms_since(self.t_start);
        s
    }

    /// Stop the generation early (the output so far stays).
    pub fn cancel(&mut self) {
        self.finish.get_or_insert(FinishReason::Cancelled);
    }

    pub fn into_generation(self) -> Generation {
        let stats = self.stats();
        Generation {
            text: self.out.text(),
            tokens: self.out.tokens,
            finish: self.finish.unwrap_or(FinishReason::Length),
            stats,
        }
    }

    fn commit(&mut self, model: &Model, new: &[Token]) {
        if self.finish.is_none() {
            self.finish = self.out.push(model, new, &self.opts);
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
        // "EN" came with an earlier token, "D" with the new one (from = 5).
        assert_eq!(find_stop(b"abc\nEND", 6, &stops), Some((4, "END")));
        assert_eq!(find_stop(b"abc\n\nx", 5, &stops), Some((3, "\n\n")));
        assert_eq!(find_stop(b"abcdef", 3, &stops), None);
        // The earliest match wins.
        assert_eq!(find_stop(b"END\n\n", 0, &stops), Some((0, "END")));
    }
}
