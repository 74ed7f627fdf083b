//! DFlash 2 drafting for a frontend that owns the target: it decodes, samples and keeps its
//! KV cache; this drafts for it and helps it verify. The engine-less counterpart of
//! llama.cpp's `common_speculative` (begin / process / draft / accept), behind the C ABI's
//! `dflash2_spec_*` calls.
//!
//! Features: the drafter reads the target's layer inputs at every position before the
//! anchor. Each target decode the frontend reports ([`Speculator::process`]) leaves its
//! rows' features pending by position; a draft at anchor position `p` injects the pending
//! rows below `p` and forgets the rest (rows of rejected drafts). So a chain verify needs no
//! bookkeeping from the frontend: what it accepted is what lies below its next anchor.
//!
//! Drafting is the engine's: the DFlash source proposes (`draft::dflash`), the arbiter gates,
//! chooses and sizes the draft (`draft::arbiter`), and the source learns from each verify,
//! over a cost model fed with the verify times the frontend reports.
use crate::draft::arbiter::{self, Choice};
use crate::draft::config::{DraftConfig, SelectMode};
use crate::draft::cost::CostModel;
use crate::draft::dflash::Dflash;
use crate::draft::drafter::Drafter;
use crate::draft::source::{ms_since, DraftSource, Env, Outcome, Prediction, Proposal, Request};
use crate::draft::DraftTree;
use crate::gguf::ModelInfo;
use crate::llama::{CacheType, Context, ForeignChain, LlamaError, Model, ModelParams, Terminal, Token};
use crate::sampling::Distribution;
use crate::verify::{accept_matching, verify_tree, Accepted};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// What went wrong, by the kind of mistake (the C ABI maps each to a status).
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error(transparent)]
    Llama(#[from] LlamaError),
    /// Called out of order (drafting before begin, accepting without a draft).
    #[error("{0}")]
    State(String),
    /// A value out of range (a sequence id, more accepted tokens than drafted).
    #[error("{0}")]
    Invalid(String),
    /// The drafter file is missing or unreadable.
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
    /// The drafter cannot draft for this target (names the field).
    #[error("{drafter} cannot draft for the frontend's target: {problem}")]
    Mismatch { drafter: String, problem: String },
}

pub type Result<T> = std::result::Result<T, SpecError>;

#[derive(Debug, Clone)]
pub struct SpecOptions {
    /// How it drafts: the selection (greedy, best-path or tree), the block (`Block::Auto`: the
    /// cost model picks each draft's length from the verify times the frontend reports, and
    /// drafts nothing while drafting does not pay) and the tree budget; the drafter alone.
    pub draft: DraftConfig,
    /// 0: draft the most likely path; above: draw drafts from the drafter's law at this
    /// temperature (what rejection sampling at the target's temperature accepts most).
    pub temperature: f32,
    /// Seeds the draws of sampled drafts and of rejection sampling.
    pub seed: u64,
    pub n_threads: i32,
}

/// Counters of one sequence since it began.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpecStats {
    /// Verify cycles (plain steps included; the prompt's token is none).
    pub cycles: u64,
    /// Drafter calls.
    pub drafts: u64,
    pub drafted: u64,
    pub accepted: u64,
    pub draft_ms: f64,
}

impl SpecStats {
    /// Tokens committed per target verify.
    pub fn tau(&self) -> f64 {
        if self.cycles == 0 {
            0.0
        } else {
            (self.cycles + self.accepted) as f64 / self.cycles as f64
        }
    }
}

/// The last draft of a sequence, until it is accepted.
struct Draft {
    tree: DraftTree,
    /// The drafter's proposal it was chosen from.
    proposal: Proposal,
    started: Instant,
}

#[derive(Default)]
struct Seq {
    begun: bool,
    /// Begun and not drafted for yet: the next verify takes the prompt's token, which is
    /// no cycle (as the engine counts).
    at_prompt: bool,
    /// Positions `0..injected` have their features in the drafter's cache.
    injected: usize,
    /// Features read from target decodes, by position, not yet injected.
    pending: BTreeMap<usize, Vec<f32>>,
    draft: Option<Draft>,
    stats: SpecStats,
}

/// One row of a batch the frontend decoded on the target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchRow {
    pub pos: usize,
    pub seqs: Vec<i32>,
}

/// The pairing checks the engine runs on two files, with the target's side read off a
/// target the frontend loaded: the drafter file at `path`, as read, when it pairs.
pub fn check_drafter_for(target: &Model, path: &Path) -> Result<ModelInfo> {
    let drafter = crate::gguf::read_model_info(path)?;
    let loaded = ModelInfo {
        path: PathBuf::from(target.path()),
        gguf_version: 0,
        file_size: 0,
        n_tensors: 0,
        architecture: target.architecture(),
        name: None,
        n_embd: target.n_embd() as u32,
        n_layer: target.n_layer() as u32,
        context_length: None,
        n_vocab: target.n_vocab() as u32,
        tokenizer_model: target.meta("tokenizer.ggml.model"),
        tokenizer_pre: target.meta("tokenizer.ggml.pre"),
        // compared entry by entry below, once the drafter is loaded
        tokenizer_fingerprint: drafter.tokenizer_fingerprint,
        bos_id: None,
        eos_id: None,
        mask_id: None,
        has_chat_template: false,
        dflash: None,
    };
    crate::gguf::check_pair(&loaded, &drafter).map_err(|e| mismatch(path, e.to_string()))?;
    Ok(drafter)
}

fn mismatch(path: &Path, problem: String) -> SpecError {
    SpecError::Mismatch { drafter: path.display().to_string(), problem }
}

/// Load the drafter at `path` for a target the frontend loaded, after [`check_drafter_for`],
/// with the vocabularies compared entry by entry.
pub fn load_drafter_for(target: &Model, path: &Path) -> Result<Arc<Model>> {
    check_drafter_for(target, path)?;
    // The drafter's numerics never change the output: it keeps repacking for speed.
    let model = Arc::new(Model::load(path, &ModelParams::default())?);
    if let Some((id, t, d)) = target.first_vocab_difference(&model) {
        return Err(mismatch(path, format!("tokenizer: token {id} is {t:?} in the target and {d:?} in the drafter")));
    }
    Ok(model)
}

/// How a frontend's sampler chain verifies a draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainVerify {
    /// A chain ending in `greedy`: drafts are kept while they are its pick.
    Greedy,
    /// A chain ending in `dist`: rejection sampling against the drafter's law with the
    /// speculator's draws, so the tokens follow the chain's law (not its text for a seed).
    Reject,
    /// Any chain samples each row itself (its filters, its draw, its stream) and drafts are
    /// kept while they equal its token: the frontend's own loop's text, token for token.
    Match,
}

pub struct Speculator {
    target: Context,
    drafter: Drafter,
    source: Dflash,
    seqs: Vec<Seq>,
    cost: CostModel,
    opts: SpecOptions,
    /// The block with the anchor, and whether each draft's length follows the cost model.
    block: usize,
    adaptive: bool,
    /// Draws of rejection sampling, and (a stream of their own) of sampled drafts.
    rng: ChaCha8Rng,
    drafting: ChaCha8Rng,
    /// The last processed batch and its features (tree verifies pick rows from it).
    last_rows: Vec<BatchRow>,
    last_features: Vec<f32>,
}

impl Speculator {
    /// A speculator for `n_seq` sequences (ids `0..n_seq`) of the frontend's `target` context,
    /// drafting with `drafter` (already checked to pair with the target).
    pub fn new(target: Context, drafter: Arc<Model>, n_seq: usize, opts: SpecOptions) -> Result<Self> {
        if !(1..=256).contains(&n_seq) {
            return Err(SpecError::Invalid(format!("n_seq is {n_seq}, expected 1..=256")));
        }
        let d = &opts.draft;
        if d.select == SelectMode::None || d.upstream.is_some() || d.lookup {
            return Err(SpecError::Invalid("select: greedy, best-path or tree, with the drafter alone".into()));
        }
        let drafter = Drafter::new(drafter, &target, n_seq, opts.n_threads, CacheType::Q8_0, CacheType::Q8_0)?;
        let (block, adaptive) = d.block.resolve(Some(drafter.trained_block()));
        if block < 2 || block > drafter.trained_block() {
            return Err(SpecError::Invalid(format!(
                "block size {block}: 0 (adaptive) or 2..={} (the drafter's trained block)",
                drafter.trained_block()
            )));
        }
        Ok(Self {
            target,
            drafter,
            source: Dflash,
            block,
            adaptive,
            seqs: (0..n_seq).map(|_| Seq::default()).collect(),
            cost: CostModel::default(),
            rng: ChaCha8Rng::seed_from_u64(opts.seed),
            drafting: {
                let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
                rng.set_stream(1);
                rng
            },
            opts,
            last_rows: Vec::new(),
            last_features: Vec::new(),
        })
    }

    /// The frontend's target context this speculator reads.
    pub fn target(&self) -> &Context {
        &self.target
    }

    pub fn feature_layers(&self) -> &[i32] {
        self.target.features().layers()
    }

    /// Floats per position: every feature layer's input, concatenated in layer order.
    pub fn feature_width(&self) -> usize {
        self.drafter.feature_width()
    }

    pub fn trained_block(&self) -> usize {
        self.drafter.trained_block()
    }

    /// Whether drafts are token trees (select `tree`).
    pub fn tree_mode(&self) -> bool {
        self.opts.draft.select == SelectMode::Tree
    }

    pub fn n_seq(&self) -> usize {
        self.seqs.len()
    }

    pub fn stats(&self, seq: i32) -> Result<SpecStats> {
        Ok(self.seq(seq)?.stats)
    }

    fn seq_index(&self, seq: i32) -> Result<usize> {
        usize::try_from(seq)
            .ok()
            .filter(|&s| s < self.seqs.len())
            .ok_or_else(|| SpecError::Invalid(format!("sequence {seq}: this speculator has sequences 0..{}", self.seqs.len())))
    }

    fn seq(&self, seq: i32) -> Result<&Seq> {
        Ok(&self.seqs[self.seq_index(seq)?])
    }

    fn begun(&mut self, seq: i32) -> Result<&mut Seq> {
        let i = self.seq_index(seq)?;
        let s = &mut self.seqs[i];
        if !s.begun {
            return Err(SpecError::State(format!("sequence {seq} has not begun (dflash2_spec_begin), or was freed")));
        }
        Ok(s)
    }

    /// Start (or restart) sequence `seq`: its drafter cache and counters are emptied.
    pub fn begin(&mut self, seq: i32) -> Result<()> {
        let i = self.seq_index(seq)?;
        self.drafter.truncate(i, 0)?;
        self.seqs[i] = Seq { begun: true, at_prompt: true, ..Seq::default() };
        Ok(())
    }

    /// Forget sequence `seq` from position `p0` on (the frontend rolled its cache back);
    /// `p0 < 0` frees the sequence, which must begin again before it drafts.
    pub fn seq_rm(&mut self, seq: i32, p0: i64) -> Result<()> {
        let i = self.seq_index(seq)?;
        if p0 < 0 {
            self.drafter.truncate(i, 0)?;
            self.seqs[i] = Seq::default();
            return Ok(());
        }
        self.begun(seq)?;
        self.rollback(i, p0 as usize)
    }

    fn rollback(&mut self, i: usize, pos: usize) -> Result<()> {
        let s = &mut self.seqs[i];
        s.pending.split_off(&pos);
        if pos < s.injected {
            self.drafter.truncate(i, pos)?;
            s.injected = pos;
        }
        Ok(())
    }

    /// The frontend decoded `rows` on the target: read their features. A row of one begun
    /// sequence becomes that sequence's pending feature at its position (rows at or after the
    /// batch's first position of that sequence replace what was pending there); rows of
    /// several sequences (a token tree) are kept for [`Speculator::accept_rows`].
    pub fn process(&mut self, rows: &[BatchRow]) -> Result<()> {
        self.target.observe(rows.len())?;
        let all: Vec<usize> = (0..rows.len()).collect();
        let mut features = Vec::new();
        let read = self.target.append_features(&all, &mut features);
        self.target.forget_captured();
        read?;
        let width = self.feature_width();
        let mut first: BTreeMap<usize, usize> = BTreeMap::new();
        for r in rows {
            if let [s] = r.seqs[..] {
                if let Ok(i) = self.seq_index(s) {
                    let p = first.entry(i).or_insert(r.pos);
                    *p = (*p).min(r.pos);
                }
            }
        }
        for (&i, &pos) in &first {
            if self.seqs[i].begun {
                self.rollback(i, pos)?;
            }
        }
        for (r, f) in rows.iter().zip(features.chunks_exact(width)) {
            if let [s] = r.seqs[..] {
                if let Some(seq) = self.seq_index(s).ok().map(|i| &mut self.seqs[i]).filter(|q| q.begun) {
                    seq.pending.insert(r.pos, f.to_vec());
                }
            }
        }
        self.last_rows = rows.to_vec();
        self.last_features = features;
        Ok(())
    }

    /// Features the frontend computed itself: `n` rows of [`Speculator::feature_width`]
    /// floats for positions `pos0..pos0 + n` of `seq`.
    pub fn feed(&mut self, seq: i32, pos0: usize, features: &[f32]) -> Result<()> {
        let width = self.feature_width();
        if features.is_empty() || features.len() % width != 0 {
            return Err(SpecError::Invalid(format!("{} floats: not whole rows of {width}", features.len())));
        }
        self.begun(seq)?;
        let i = self.seq_index(seq)?;
        self.rollback(i, pos0)?;
        for (k, row) in features.chunks_exact(width).enumerate() {
            self.seqs[i].pending.insert(pos0 + k, row.to_vec());
        }
        Ok(())
    }

    /// Take rows of the last processed batch as `seq`'s features at their positions (the
    /// accepted path of a token tree, whose rows belong to several sequences).
    pub fn accept_rows(&mut self, seq: i32, rows: &[usize]) -> Result<()> {
        self.begun(seq)?;
        let i = self.seq_index(seq)?;
        let width = self.feature_width();
        for &r in rows {
            let row = self.last_rows.get(r).ok_or_else(|| {
                SpecError::Invalid(format!("row {r}: the last processed batch had {} rows", self.last_rows.len()))
            })?;
            let f = self.last_features[r * width..(r + 1) * width].to_vec();
            self.seqs[i].pending.insert(row.pos, f);
        }
        Ok(())
    }

    /// Draft at most `max_len` tokens after `last`, the token at position `pos` of `seq`
    /// (committed, not yet decoded): a chain, or a token tree in `tree` mode (nodes
    /// parents-first). Empty when the adaptive block decides a plain step pays better.
    pub fn draft(&mut self, seq: i32, last: Token, pos: usize, max_len: usize) -> Result<DraftTree> {
        let i = self.seq_index(seq)?;
        self.begun(seq)?;
        if self.seqs[i].draft.is_some() {
            // an unreported verify: count it as nothing accepted
            self.finish_cycle(i, &[], None)?;
        }
        let started = Instant::now();
        self.seqs[i].at_prompt = false;
        self.inject_below(i, pos)?;
        let room = self.target.n_ctx_per_seq().saturating_sub(pos + 1);
        let max_draft = (self.block - 1).min(room).min(max_len);
        if max_draft == 0 || (self.adaptive && !self.cost.should_draft()) {
            return Ok(DraftTree::default());
        }
        // The engine's drafting step, for one sequence: the drafter's proposal and the arbiter's choice.
        let walk = self.opts.draft.select.walk(true, self.opts.draft.tree_budget);
        let temperature = self.opts.temperature;
        let request = Request { seq: i, history: &[], last, pos, max_len: max_draft, walk, matching: temperature <= 0.0, adaptive: self.adaptive };
        let mut env = Env { target: &self.target, drafter: Some(&mut self.drafter), cost: &mut self.cost };
        let proposal = self.source.propose(&mut env, &[request])?.pop().flatten();
        let proposal = proposal.ok_or_else(|| SpecError::State("the drafter proposed nothing".into()))?;
        let proposals = [proposal];
        let choice = Choice { walk, adaptive: self.adaptive, matching: temperature <= 0.0, temperature };
        let mut tree = arbiter::choose(&proposals, &choice, &self.cost, &mut self.drafting);
        let adaptive = arbiter::cuttable(&proposals, self.adaptive);
        arbiter::settle(&self.cost, &mut [arbiter::Pending { tree: &mut tree, adaptive, credit: 0.0 }]);
        if self.adaptive {
            arbiter::chosen(&mut self.cost, &proposals, &tree, self.block);
        }
        let [proposal] = proposals;
        let s = &mut self.seqs[i];
        s.stats.drafts += 1;
        s.stats.draft_ms += ms_since(started);
        s.stats.drafted += tree.len() as u64;
        s.draft = Some(Draft { tree: tree.clone(), proposal, started });
        Ok(tree)
    }

    /// Inject the pending features of positions below `pos` (the anchor's) and forget the
    /// rest: rows at or after the anchor belong to drafts the target did not keep.
    fn inject_below(&mut self, i: usize, pos: usize) -> Result<()> {
        self.rollback(i, pos)?;
        let s = &mut self.seqs[i];
        let start = s.injected;
        if start >= pos {
            return Ok(());
        }
        let rows: Vec<(usize, Vec<f32>)> = std::mem::take(&mut s.pending).into_iter().collect();
        let contiguous = rows.iter().enumerate().all(|(k, (p, _))| *p == start + k);
        if rows.len() != pos - start || !contiguous {
            let missing = (start..pos).find(|p| rows.iter().all(|(q, _)| q != p)).unwrap_or(start);
            s.pending = rows.into_iter().collect();
            return Err(SpecError::State(format!(
                "sequence {i}: no features for position {missing} (report every target decode with \
                 dflash2_spec_process, or pass features with dflash2_spec_feed)"
            )));
        }
        let flat: Vec<f32> = rows.into_iter().flat_map(|(_, f)| f).collect();
        self.drafter.inject(&flat, start, i as i32)?;
        self.seqs[i].injected = pos;
        Ok(())
    }

    /// The frontend verified `seq`'s last draft itself and kept `n_accepted` drafted tokens
    /// (a chain's first tokens; for a tree, the depth of the path it kept). Also a plain step
    /// with no draft (`n_accepted` 0).
    pub fn accept(&mut self, seq: i32, n_accepted: usize) -> Result<()> {
        let i = self.seq_index(seq)?;
        let s = self.begun(seq)?;
        let drafted = s.draft.as_ref().map_or(0, |d| d.tree.nodes.iter().map(|n| n.depth).max().unwrap_or(0));
        if n_accepted > drafted {
            return Err(SpecError::Invalid(format!(
                "accepting {n_accepted} tokens of sequence {seq}, its last draft had {drafted}"
            )));
        }
        // a path that deep (for a chain, its first tokens)
        let path = match s.draft.as_ref().and_then(|d| d.tree.nodes.iter().position(|n| n.depth == n_accepted).map(|k| d.tree.path_to(k))) {
            Some(path) => path,
            None => Vec::new(),
        };
        self.finish_cycle(i, &path, None)
    }

    /// Close `i`'s cycle: `path` the drafted nodes the target took (a tree verified by the
    /// frontend reports only their depth: any path that deep teaches the drafter the same) and,
    /// where known, its own next token.
    fn finish_cycle(&mut self, i: usize, path: &[usize], next: Option<Token>) -> Result<()> {
        let s = &mut self.seqs[i];
        if std::mem::take(&mut s.at_prompt) {
            return Ok(());
        }
        s.stats.cycles += 1;
        s.stats.accepted += path.len() as u64;
        if let Some(d) = s.draft.take() {
            let outcome = Outcome { seq: i, tree: &d.tree, path, next };
            let mut env = Env { target: &self.target, drafter: Some(&mut self.drafter), cost: &mut self.cost };
            self.source.learn(&mut env, &d.proposal, &outcome, &mut Prediction::default())?;
            self.cost.record_cycle(path.len() + 1, 1, ms_since(d.started));
        }
        Ok(())
    }

    /// The frontend timed a target decode of `n_tokens` rows (what the adaptive block weighs).
    pub fn report_verify(&mut self, n_tokens: usize, ms: f64) -> Result<()> {
        if n_tokens == 0 || !ms.is_finite() || ms < 0.0 {
            return Err(SpecError::Invalid(format!("a verify of {n_tokens} tokens in {ms} ms")));
        }
        self.cost.record_verify(n_tokens, ms);
        Ok(())
    }

    /// Verify `seq`'s last draft (or a plain step when there is none) with the frontend's
    /// sampler chain over the target's output rows: `rows[0]` is the anchor's row of the
    /// verify batch, `rows[1 + k]` draft node k's (see [`ChainVerify`]). The chain accepts every
    /// token returned. Returns the accepted drafted tokens and the target's own next token,
    /// and records the cycle (no [`Speculator::accept`] after this).
    pub fn verify(&mut self, seq: i32, chain: &mut ForeignChain, rows: &[usize], how: ChainVerify) -> Result<Vec<Token>> {
        let i = self.seq_index(seq)?;
        self.begun(seq)?;
        match (chain.terminal(), how) {
            (Terminal::Dist, ChainVerify::Greedy) => {
                return Err(SpecError::Invalid(
                    "the sampler chain draws (ends in dist): verify with dflash2_verify_sample or dflash2_verify_match".into(),
                ))
            }
            (Terminal::Greedy, ChainVerify::Reject) => {
                return Err(SpecError::Invalid(
                    "the sampler chain picks the argmax (ends in greedy): verify with dflash2_verify_greedy".into(),
                ))
            }
            _ => {}
        }
        let empty = DraftTree::default();
        let tree = self.seqs[i].draft.as_ref().map_or(&empty, |d| &d.tree);
        if rows.len() != tree.len() + 1 {
            return Err(SpecError::Invalid(format!(
                "{} rows: the anchor's and one per drafted token ({} drafted) are needed",
                rows.len(),
                tree.len()
            )));
        }
        // The chain moves along the path as it is accepted: a row's law follows the tokens
        // before it (penalties, grammar).
        let target = &self.target;
        let mut law_at = |row: usize| -> std::result::Result<Distribution, LlamaError> {
            if row > 0 {
                chain.accept(tree.nodes[row - 1].token);
            }
            let (ids, probs) = chain.law(target.logits(rows[row])?)?;
            Ok(distribution(ids, probs))
        };
        let accepted: Accepted = match how {
            ChainVerify::Reject => {
                let temperature = self.opts.temperature;
                let qs = self.seqs[i].draft.as_ref().map_or_else(Vec::new, |d| arbiter::laws(std::slice::from_ref(&d.proposal), &d.tree, temperature));
                verify_tree(tree, &qs, law_at, &mut self.rng)?
            }
            ChainVerify::Greedy => accept_matching(tree, |row| law_at(row).map(|d| d.argmax()))?,
            // the chain samples and takes each row's token itself, the bonus included
            ChainVerify::Match => accept_matching(tree, |row| Ok::<_, SpecError>(chain.sample(target, rows[row])))?,
        };
        if how != ChainVerify::Match {
            chain.accept(accepted.bonus);
        }
        let mut tokens: Vec<Token> = accepted.nodes.iter().map(|&n| tree.nodes[n].token).collect();
        tokens.push(accepted.bonus);
        self.finish_cycle(i, &accepted.nodes, Some(accepted.bonus))?;
        Ok(tokens)
    }

}

/// A law as [`Distribution`] keeps it: positive probabilities, most likely first, ties by id.
fn distribution(ids: Vec<Token>, probs: Vec<f32>) -> Distribution {
    let mut pairs: Vec<(Token, f32)> = ids.into_iter().zip(probs).filter(|&(_, p)| p > 0.0).collect();
    pairs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    Distribution { ids: pairs.iter().map(|p| p.0).collect(), probs: pairs.iter().map(|p| p.1).collect() }
}
