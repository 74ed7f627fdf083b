//! The drafting settings, declared once: the CLI's flags, the server's defaults and requests,
//! the C ABI's params and the speculator's options all fill in a [`DraftConfig`].

/// Longest suffix the look-up matches unless asked otherwise.
pub const DEFAULT_LOOKUP_NGRAM: usize = 4;
/// Block size (anchor included) of drafting without a drafter (the look-up alone), unless
/// asked otherwise.
pub const LOOKUP_BLOCK: usize = 16;

/// How drafts are chosen from what the sources propose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// The block: the anchor plus at most `block - 1` drafted tokens per cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Block {
    /// Each cycle's length chosen from measured costs and predicted acceptance, up to the
    /// drafter's trained block (`--block auto`); no draft while drafting does not pay.
    Auto,
    Fixed(usize),
}

impl std::str::FromStr for Block {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(Block::Auto);
        }
        s.parse().map(Block::Fixed).map_err(|_| format!("expected a block size or `auto`, got `{s}`"))
    }
}

impl Block {
    /// (block size, adaptive) with a drafter trained on blocks of `trained` (`None`: no
    /// drafter, [`LOOKUP_BLOCK`]).
    pub fn resolve(self, trained: Option<usize>) -> (usize, bool) {
        match self {
            Block::Auto => (trained.unwrap_or(LOOKUP_BLOCK), true),
            Block::Fixed(b) => (b, false),
        }
    }
}

/// llama.cpp's own drafting (`common/speculative.cpp`), verified by ours: the baselines to beat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upstream {
    /// Its DFlash driver: its block decode and greedy walk over the same drafter, a fixed
    /// block (`--select upstream`). Targets with llama.cpp's layer extraction only.
    Dflash,
    /// One of its n-gram types (`llama::LLAMA_NGRAM_TYPES`), default settings (`bench
    /// --llama-ngram`): the baselines of the look-up.
    Ngram(&'static str),
}

impl Upstream {
    /// llama.cpp's `--spec-type` name.
    pub fn kind(self) -> &'static str {
        match self {
            Upstream::Dflash => "draft-dflash",
            Upstream::Ngram(kind) => kind,
        }
    }
}

/// How each cycle drafts.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftConfig {
    pub select: SelectMode,
    pub block: Block,
    /// Node budget of a token tree ([`SelectMode::Tree`]).
    pub tree_budget: usize,
    /// Also draft from the context: continuations of earlier occurrences of its last tokens
    /// (`draft::lookup`), beside the drafter's or, without a drafter, alone.
    pub lookup: bool,
    /// Longest suffix the look-up matches, in tokens (1..=`lookup::MAX_NGRAM`).
    pub lookup_ngram: usize,
    /// Draft with llama.cpp's own driver instead of the DFlash drafter's lattice; every
    /// draft is verified as it comes.
    pub upstream: Option<Upstream>,
}

impl Default for DraftConfig {
    fn default() -> Self {
        Self {
            select: SelectMode::Greedy,
            block: Block::Fixed(16),
            tree_budget: 32,
            lookup: false,
            lookup_ngram: DEFAULT_LOOKUP_NGRAM,
            upstream: None,
        }
    }
}

impl DraftConfig {
    /// The selection as reports name it: `upstream` for llama.cpp's DFlash driver.
    pub fn select_name(&self) -> &'static str {
        match (self.upstream, self.select) {
            (Some(Upstream::Dflash), _) => "upstream",
            (_, SelectMode::None) => "none",
            (_, SelectMode::Greedy) => "greedy",
            (_, SelectMode::BestPath) => "best-path",
            (_, SelectMode::Tree) => "tree",
        }
    }

    /// Whether cycles draft at all (from some source), given whether a drafter is loaded.
    pub fn drafts(&self, has_drafter: bool) -> bool {
        self.select != SelectMode::None && (has_drafter || self.lookup || self.upstream.is_some())
    }
}

impl SelectMode {
    /// The lattice walk of this mode (a tree only where the verify can hold one).
    pub fn walk(self, trees: bool, tree_budget: usize) -> super::select::Walk {
        use super::select::Walk;
        match self {
            SelectMode::None | SelectMode::Greedy => Walk::Greedy,
            SelectMode::BestPath => Walk::BestPath,
            SelectMode::Tree if trees => Walk::Tree { budget: tree_budget },
            SelectMode::Tree => Walk::BestPath,
        }
    }
}
