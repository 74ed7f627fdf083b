//! The one interface of every draft source (llama.cpp's `common_speculative_impl`): begin a
//! sequence, propose for the sequences that draft this cycle, learn what the verify took.
//!
//! Sources only propose. What they propose comes in three shapes ([`Draft`]), and the arbiter
//! (`draft::arbiter`) turns a cycle's proposals into the one draft the target verifies.
use super::config::DraftConfig;
use super::cost::CostModel;
use super::drafter::Drafter;
use super::select::Walk;
use super::{DraftTree, Lattice, Origin};
use crate::llama::{Context, Result, Token};

/// What a source may use while it drafts: the target (its features), the DFlash drafter
/// beside it (absent without one) and the cost model.
pub struct Env<'a> {
    pub target: &'a Context,
    pub drafter: Option<&'a mut Drafter>,
    pub cost: &'a mut CostModel,
}

/// One sequence that drafts this cycle.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub seq: usize,
    /// Its committed tokens before `last`, all in the target's cache (empty where the caller
    /// does not keep them: the speculator's frontend).
    pub history: &'a [Token],
    /// The last committed token, not yet decoded, at position `pos`.
    pub last: Token,
    pub pos: usize,
    /// Drafted tokens allowed.
    pub max_len: usize,
    /// How the draft will be walked (a tree only where the verify can hold one).
    pub walk: Walk,
    /// Drafts are verified by matching the target's own token (one-hot proposals may branch).
    pub matching: bool,
    /// The length follows the cost model (`Block::Auto`).
    pub adaptive: bool,
}

/// What one source proposes for one sequence.
#[derive(Debug, Clone)]
pub struct Proposal {
    pub draft: Draft,
    /// Drafter decodes it took and the block positions they drafted (0 where no model ran),
    /// and whether the drafter's output had to be repaired.
    pub calls: usize,
    pub positions: usize,
    pub repaired: bool,
    /// Time its source spent on it (a decode shared by several sequences: the whole decode).
    pub ms: f64,
}

/// The shapes of a proposal, as the arbiter handles them.
#[derive(Debug, Clone)]
pub enum Draft {
    /// Candidates with their law (the DFlash lattice): walked at temperature 0, drawn from
    /// above, and the law is the q of rejection sampling.
    Law(Lattice),
    /// One-hot continuations, each node's `q` its estimated chance of acceptance: the likeliest
    /// path, and all of them as a tree where the request may branch (the look-up's trie).
    Estimates { path: DraftTree, tree: Option<DraftTree> },
    /// A draft verified as it comes: its source chose its tokens and length (llama.cpp's drivers).
    Fixed(DraftTree),
}

impl Proposal {
    /// A proposal that cost no model call.
    pub fn free(draft: Draft, ms: f64) -> Self {
        Self { draft, calls: 0, positions: 0, repaired: false, ms }
    }

    /// Whether the cost model judges the drafter call behind it: a call whose draft the arbiter
    /// sizes (a fixed draft is verified as it comes, whatever the cost model says).
    pub fn judged(&self) -> bool {
        self.calls > 0 && !matches!(self.draft, Draft::Fixed(_))
    }
}

/// What the verify made of the draft built from the cycle's proposals.
#[derive(Debug, Clone, Copy)]
pub struct Outcome<'a> {
    pub seq: usize,
    /// The draft verified (chosen, then cut by a grammar), its nodes tagged by origin.
    pub tree: &'a DraftTree,
    /// The nodes the target took, from the anchor's child down.
    pub path: &'a [usize],
    /// The target's own token after them, where known (a frontend that verified by itself
    /// reports only how many it took).
    pub next: Option<Token>,
}

/// How well a drafter's predictions held over a generation (where it alone drafted).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Prediction {
    /// Sum over verified drafts of the expected accepted length from its transition
    /// probabilities: calibration against the accepted drafted tokens.
    pub predicted_accepted: f64,
    /// Verified drafts the target cut short, and how many of those had the target's own token
    /// among the drafter's candidates at that position: the selection headroom an oracle
    /// picking among the candidates would have.
    pub rejections: usize,
    pub rejected_in_candidates: usize,
}

/// A way of proposing drafts: the DFlash drafter (`draft::dflash`), the context look-up
/// (`draft::lookup`), llama.cpp's own drivers (`draft::upstream`).
pub trait DraftSource: Send {
    /// What its tokens are tagged with in a draft (per-origin statistics, the cost model's
    /// calibration of the drafter).
    fn origin(&self) -> Origin;

    /// Whether proposing costs a drafter decode. Such a source is asked after the free ones,
    /// only where the cost model says drafting pays and the free proposals do not already
    /// promise as much (`arbiter::decode_pays`).
    fn decodes(&self) -> bool;

    /// A generation begins on `seq`: its prompt is in the target's cache and `cfg` is how it drafts.
    fn begin(&mut self, _env: &mut Env, _seq: usize, _prompt: &[Token], _cfg: &DraftConfig) -> Result<()> {
        Ok(()) // nothing of the sequence kept beyond what each request brings
    }

    /// One proposal per request (`None`: nothing to propose); the requests of a cycle come in
    /// one call, so a drafter decodes all their blocks at once.
    fn propose(&mut self, env: &mut Env, requests: &[Request]) -> Result<Vec<Option<Proposal>>>;

    /// The target verified the draft built with `proposal` (this source's, for that sequence).
    fn learn(&mut self, env: &mut Env, proposal: &Proposal, outcome: &Outcome, prediction: &mut Prediction) -> Result<()>;
}

/// Milliseconds since `t`.
pub fn ms_since(t: std::time::Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}
