//! The arbiter: which sources are worth a drafter decode this cycle, and the one draft the
//! target verifies, chosen (or merged) from what the sources proposed, its length set by the
//! cost model. It reasons about the shapes of proposals ([`Draft`]), never about who made them.
use super::cost::CostModel;
use super::sharing::{self, Share};
use super::select::{self, proposal, Greedy, Selector, Walk};
use super::source::{Draft, Proposal};
use super::{DraftTree, Origin};
use rand::Rng;

/// How one sequence's draft is chosen.
#[derive(Debug, Clone, Copy)]
pub struct Choice {
    /// The lattice walk; a tree also lets one-hot proposals branch and merge (when matching).
    pub walk: Walk,
    /// The length follows the cost model (`Block::Auto`).
    pub adaptive: bool,
    /// Drafts are verified by matching the target's own token (its argmax, or its seeded sample
    /// at T > 0: the likeliest draft is the best bet either way); otherwise at `temperature`,
    /// by rejection sampling.
    pub matching: bool,
    pub temperature: f32,
}

/// Whether the sources that cost a drafter decode are worth one for a sequence, given the
/// proposals of the free sources in hand: not where those are expected to be taken at least as
/// far as the drafter's drafts have been lately (the call is saved). For an adaptive length the
/// cost model has the last word, once per cycle ([`CostModel::should_draft`]).
pub fn decode_pays(cost: &CostModel, free: &[Proposal]) -> bool {
    let expected = free.iter().filter_map(|p| path(&p.draft)).map(|t| cost.expected_accepted(t)).fold(0.0, f64::max);
    !(expected > 0.0 && expected >= cost.drafter_expected())
}

/// The draft of one sequence from its proposals: a fixed draft as it comes; else, verified by
/// matching, the law's walk merged with the one-hot trees (a tree) or the likeliest of the
/// paths, and by rejection sampling either the one-hot path or a draw from the law, picked before anything is drawn
/// (rejection sampling needs the law's draft drawn from q whatever else happens). Nodes come
/// best first: [`settle`] cuts the batch's adaptive lengths and lays each draft out.
pub fn choose(proposals: &[Proposal], c: &Choice, cost: &CostModel, rng: &mut impl Rng) -> DraftTree {
    let fixed = proposals.iter().find_map(|p| match &p.draft {
        Draft::Fixed(t) if !t.is_empty() => Some(t),
        _ => None,
    });
    if let Some(t) = fixed {
        return t.clone();
    }
    let law = lattice(proposals);
    let branch = matches!(c.walk, Walk::Tree { .. }) && c.matching;
    let estimates = proposals.iter().filter_map(|p| match &p.draft {
        Draft::Estimates { tree: Some(tree), .. } if branch => Some(tree),
        Draft::Estimates { path, .. } => Some(path),
        _ => None,
    });
    match law {
        None => estimates.reduce(|a, b| likelier(cost, a, b, c)).cloned().unwrap_or_default(),
        Some(lattice) if c.matching => {
            let walked = select::draft(lattice, c.walk, 0.0, rng);
            match c.walk {
                Walk::Tree { budget } if branch => estimates.fold(walked, |t, e| t.merge(e, budget)),
                _ => estimates.fold(walked, |t, e| if score(cost, e, c) > score(cost, &t, c) { e.clone() } else { t }),
            }
        }
        Some(lattice) => {
            let best = estimates.reduce(|a, b| if cost.expected_accepted(b) > cost.expected_accepted(a) { b } else { a });
            match best {
                Some(e) if cost.expected_accepted(e) >= cost.expected_accepted(&Greedy.select(lattice, lattice.n_pos)) => e.clone(),
                _ => select::draft(lattice, c.walk, c.temperature, rng),
            }
        }
    }
}

/// Whether the cost model may cut a draft chosen from `proposals` for a run whose length is
/// `adaptive`: not a fixed draft (llama.cpp's drivers size their own).
pub fn cuttable(proposals: &[Proposal], adaptive: bool) -> bool {
    adaptive && !proposals.iter().any(|p| matches!(&p.draft, Draft::Fixed(t) if !t.is_empty()))
}

/// One run's chosen draft in a cycle's verify batch, before the batch's lengths are settled.
pub struct Pending<'a> {
    /// Best first, as [`choose`] returns it.
    pub tree: &'a mut DraftTree,
    /// Its length follows the cost model.
    pub adaptive: bool,
    /// Tokens the run is ahead of plain decoding (`draft::sharing`).
    pub credit: f64,
}

/// Settle the drafts of every run in one verify batch: adaptive lengths are chosen together
/// (`draft::sharing`: the prefixes with the most expected tokens per millisecond of the shared
/// decode that slow no run below plain decoding; 0 means a plain step), then each draft is laid
/// depth-first, as the verify batch lays it out.
pub fn settle(cost: &CostModel, drafts: &mut [Pending]) {
    if drafts.iter().any(|d| d.adaptive) {
        let shares: Vec<Share> =
            drafts.iter().map(|d| Share { gains: cost.node_gains(d.tree), adaptive: d.adaptive, credit: d.credit }).collect();
        for (d, len) in drafts.iter_mut().zip(sharing::allot(cost, &shares).lengths) {
            d.tree.nodes.truncate(len);
        }
    }
    for d in drafts.iter_mut().filter(|d| !d.tree.is_chain()) {
        *d.tree = d.tree.depth_first();
    }
}

/// Of two paths, the one expected to commit more (the first on ties).
fn likelier<'a>(cost: &CostModel, a: &'a DraftTree, b: &'a DraftTree, c: &Choice) -> &'a DraftTree {
    if score(cost, b, c) > score(cost, a, c) {
        b
    } else {
        a
    }
}

/// What a path is expected to commit: per verify time when the length is adaptive, in tokens
/// otherwise.
fn score(cost: &CostModel, t: &DraftTree, c: &Choice) -> f64 {
    if c.adaptive {
        cost.best_len(t).1
    } else {
        cost.expected_accepted(t)
    }
}

/// Tell the cost model how deep the chosen draft takes the drafter's block in (an adaptive
/// length only: a fixed block is verified whole). A one-hot draft chosen over the drafter's
/// says nothing about the drafter's depth.
pub fn chosen(cost: &mut CostModel, proposals: &[Proposal], tree: &DraftTree, block: usize) {
    let Some(lattice) = lattice(proposals) else { return };
    let used = tree.nodes.iter().filter(|n| n.origin.from_drafter()).map(|n| n.depth).max();
    let one_hot = proposals.iter().any(|p| matches!(p.draft, Draft::Estimates { .. }));
    if used.is_none() && one_hot {
        return;
    }
    cost.record_used_depth(lattice.n_pos, block.saturating_sub(1), used.unwrap_or(0));
}

/// The proposal each node of `tree` was drawn from, for rejection sampling: the law at
/// `temperature` for the law's nodes drawn from it, one-hot on the token for every other.
pub fn laws(proposals: &[Proposal], tree: &DraftTree, temperature: f32) -> Vec<Vec<(i32, f32)>> {
    let law = lattice(proposals).filter(|_| temperature > 0.0);
    let q = |n: &super::DraftNode| match law {
        Some(l) if n.origin == Origin::Drafter => proposal(l, n.depth - 1, n.parent.map_or(0, |p| tree.nodes[p].cand), temperature),
        _ => vec![(n.token, 1.0)],
    };
    tree.nodes.iter().map(q).collect()
}

fn lattice(proposals: &[Proposal]) -> Option<&super::Lattice> {
    proposals.iter().find_map(|p| match &p.draft {
        Draft::Law(l) => Some(l),
        _ => None,
    })
}

/// The path a proposal offers where a path is asked for.
fn path(d: &Draft) -> Option<&DraftTree> {
    match d {
        Draft::Estimates { path, .. } | Draft::Fixed(path) => Some(path),
        Draft::Law(_) => None,
    }
}
