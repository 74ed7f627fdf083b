//! The arbiter: which sources are worth a drafter decode this cycle, and the one draft the
//! target verifies, chosen (or merged) from what the sources proposed, its length set by the
//! cost model. It reasons about the shapes of proposals ([`Draft`]), never about who made them.
use super::cost::CostModel;
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

/// Whether the sources that cost a drafter decode draft this cycle, given the proposals of the
/// free sources in hand: not where those are expected to be taken at least as far as the
/// drafter's drafts have been lately (the call is saved), nor, for an adaptive length, while
/// drafting does not pay (the cost model probes it now and then).
pub fn decode_pays(cost: &mut CostModel, free: &[Proposal], adaptive: bool) -> bool {
    let expected = free.iter().filter_map(|p| path(&p.draft)).map(|t| cost.expected_accepted(t)).fold(0.0, f64::max);
    !(expected > 0.0 && expected >= cost.drafter_expected()) && (!adaptive || cost.should_draft())
}

/// The draft of one sequence from its proposals: a fixed draft as it comes; else, verified by
/// matching, the law's walk merged with the one-hot trees (a tree) or the likeliest of the
/// paths, and by rejection sampling either the one-hot path or a draw from the law, picked before anything is drawn
/// (rejection sampling needs the law's draft drawn from q whatever else happens). An adaptive
/// length keeps the prefix the cost model expects to pay best (0: a plain step). Nodes come
/// depth-first, as the verify batch lays them out.
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
    let mut tree = match law {
        None => match estimates.reduce(|a, b| likelier(cost, a, b, c)) {
            Some(t) => t.clone(),
            None => return DraftTree::default(),
        },
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
    };
    if c.adaptive {
        // Prefixes of best-first order are valid drafts; 0 means a plain step.
        tree.nodes.truncate(cost.choose_len(&tree.gains(), &tree));
    }
    if tree.is_chain() {
        tree
    } else {
        tree.depth_first()
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
        cost.best_len(&t.gains(), t).1
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
