//! Verification against the target: the verify batch's layout (a path in its sequence's cells,
//! a tree with a sequence per leaf), the walk over its rows (matching, with the near-tie guard at
//! temperature 0, or rejection sampling), the cells kept afterwards, and the re-decode of an
//! accepted side branch.
use super::rows::{fill_history, masked, own_token, States};
use super::{accept_matching, verify_tree};
use crate::draft::DraftTree;
use crate::llama::{Batch, Context, Grammar, LlamaError, Result, Token};
use crate::sampling::{Distribution, Sampler};

/// Most leaves a verify tree may have: each leaf is one llama.cpp sequence.
pub const MAX_TREE_LEAVES: usize = 64;

/// How much wider than the probe's worst stray the near-tie guard's margin is.
const NEAR_TIE_SAFETY: f32 = 2.0;

/// How drafts are checked at temperature > 0 (at 0 both are the target's argmax).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Verifier {
    /// Each row's token is sampled from the target's law with its position's draw, and drafted
    /// tokens are kept while they equal it: plain decoding's text for a seed, token for token.
    #[default]
    Match,
    /// Rejection sampling against the drafter's law: the same distribution as plain decoding,
    /// not the same text; it accepts more where drafts are drawn from the drafter's law.
    #[value(name = "reject")]
    Rejection,
    /// DELIBERATELY WRONG: accepts every draft. It exists so the distribution test can
    /// show that it detects a broken verifier.
    #[doc(hidden)]
    #[value(skip)]
    AcceptAll,
}

impl Verifier {
    /// Whether drafts at this temperature are verified by matching the target's own token
    /// (a plain step always is: it has nothing to test).
    pub fn matches(self, greedy: bool) -> bool {
        greedy || self == Verifier::Match
    }
}

/// One sequence's draft in the verify batch.
#[derive(Debug)]
pub struct Drafted {
    /// Its sequence in the target's cache.
    pub seq: usize,
    /// The last committed token (the anchor, not yet decoded) and its position.
    pub last: Token,
    pub pos0: usize,
    pub tree: DraftTree,
    /// With a grammar: its state after each node.
    pub states: States,
    /// First verify-batch row (the anchor's), and the leaf sequences of a tree (0 for a path).
    pub row0: usize,
    pub n_leaves: usize,
}

/// The law a sequence is decoded with: its sampler, the grammar's state after what it
/// committed, what its cache holds (the penalties' history), which generated token the
/// anchor's row decides (its draw), and how drafts are verified.
pub struct Law<'a> {
    pub sampler: &'a Sampler,
    pub grammar: Option<&'a Grammar>,
    pub cached: &'a [Token],
    pub index: usize,
    pub verifier: Verifier,
}

impl Law<'_> {
    /// The generated token that verify row `row` of `tree` decides.
    fn index(&self, tree: &DraftTree, row: usize) -> usize {
        self.index + if row == 0 { 0 } else { tree.nodes[row - 1].depth }
    }
}

/// What the target made of one draft.
#[derive(Debug, PartialEq)]
pub enum Verdict {
    /// The accepted nodes, from the anchor's child down, and the target's own next token.
    /// `near_tie`: a row too close to call cut the path there, and its token (`next`) stands;
    /// the next cycle decodes alone.
    Take { path: Vec<usize>, next: Token, near_tie: bool },
    /// The anchor's own row was too close to call: nothing is committed, and the anchor is
    /// decoded alone next cycle.
    Retry,
}

/// The target's side of verification: its context, the batch drafts are laid out in, and a
/// scratch history. Leaf sequences of a tree are numbered after the `n_seqs` sequences.
pub struct Check<'a> {
    pub target: &'a mut Context,
    pub batch: &'a mut Batch,
    pub history: &'a mut Vec<Token>,
    pub n_seqs: usize,
}

impl Check<'_> {
    /// Lay out every draft's `[last, nodes...]` for one verify decode. A path lives in its
    /// sequence; a tree gives each leaf its own sequence (sharing the sequence's prefix) and
    /// each token the sequences of the leaves below it, at position = depth.
    pub fn layout<'d>(&mut self, drafts: impl Iterator<Item = &'d mut Drafted>) -> Result<()> {
        self.batch.clear();
        let n_seqs = self.n_seqs as i32;
        for d in drafts {
            d.row0 = self.batch.len();
            let seq = d.seq as i32;
            if d.tree.is_chain() {
                self.batch.add_token(d.last, d.pos0 as i32, &[seq], true)?;
                for node in &d.tree.nodes {
                    self.batch.add_token(node.token, (d.pos0 + node.depth) as i32, &[seq], true)?;
                }
                continue;
            }
            let leaves = d.tree.leaves();
            if leaves.len() > MAX_TREE_LEAVES {
                return Err(LlamaError::Invalid(format!("a tree of {} leaves exceeds {MAX_TREE_LEAVES}", leaves.len())));
            }
            let mut seqs: Vec<Vec<i32>> = vec![Vec::new(); d.tree.len()];
            for (li, &leaf) in leaves.iter().enumerate() {
                for node in d.tree.path_to(leaf) {
                    seqs[node].push(n_seqs + li as i32);
                }
            }
            let mut all = vec![seq];
            for li in 0..leaves.len() as i32 {
                self.target.seq_cp(seq, n_seqs + li, -1, -1);
                all.push(n_seqs + li);
            }
            self.batch.add_token(d.last, d.pos0 as i32, &all, true)?;
            for (node, s) in d.tree.nodes.iter().zip(&seqs) {
                self.batch.add_token(node.token, (d.pos0 + node.depth) as i32, s, true)?;
            }
            d.n_leaves = leaves.len();
        }
        Ok(())
    }

    /// Walk `d`'s rows of the last decode. By matching: follow the target's own token down the
    /// draft (at temperature 0 its argmax, behind the near-tie guard; `margin`: forced, or from
    /// the target's load-time probe). Else rejection sampling against `qs` (the proposal each
    /// node was drawn from), all its draws from the anchor's stream.
    pub fn accept(&mut self, d: &Drafted, law: Law, margin: Option<f32>, qs: &[Vec<(i32, f32)>]) -> Result<Verdict> {
        let (history, target, grammar, sampler) = (&mut *self.history, &*self.target, law.grammar, law.sampler);
        if law.verifier.matches(sampler.is_greedy()) || d.tree.is_empty() {
            let accepted = accept_matching(&d.tree, |row| -> Result<Token> {
                fill_history(history, law.cached, d.last, &d.tree, row, sampler.params());
                Ok(own_token(sampler, target.logits(d.row0 + row)?, history, d.states.row(grammar, row)?, law.index(&d.tree, row)))
            })?;
            if !sampler.is_greedy() {
                return Ok(Verdict::Take { path: accepted.nodes, next: accepted.bonus, near_tie: false });
            }
            return self.guard_near_ties(d, &law, margin, accepted.nodes, accepted.bonus);
        }
        let params = sampler.params();
        let mut target_law = |row: usize| -> Result<Distribution> {
            fill_history(history, law.cached, d.last, &d.tree, row, params);
            Ok(params.distribution(&masked(target.logits(d.row0 + row)?, d.states.row(grammar, row)?), history))
        };
        let (path, next) = if law.verifier == Verifier::AcceptAll {
            let principal = d.tree.principal_path();
            let row = principal.last().map_or(0, |&n| n + 1);
            let bonus = target_law(row)?.sample(&mut sampler.draws(law.index(&d.tree, row)));
            (principal, bonus)
        } else {
            let accepted = verify_tree(&d.tree, qs, target_law, &mut sampler.draws(law.index))?;
            (accepted.nodes, accepted.bonus)
        };
        Ok(Verdict::Take { path, next, near_tie: false })
    }

    /// The near-tie guard, where verify batches are not bit-exact (a GPU backend: the probe
    /// measured how far a batch row strays from a single step). A token is trusted only from a
    /// row whose best candidate leads the runner-up by more than twice that (each may stray),
    /// times [`NEAR_TIE_SAFETY`] (the probe sees a few rows, not every one). At the first row
    /// that leads by less, the cycle is cut: the tokens before it stand, and the row's input is
    /// decoded alone next cycle (as plain decoding decodes it), which decides. Accepted side
    /// branches of a tree are dropped at their first node (its token, chosen on an in-order
    /// row, stands): re-decoding them would be another batch.
    fn guard_near_ties(&mut self, d: &Drafted, law: &Law, margin: Option<f32>, mut path: Vec<usize>, mut next: Token) -> Result<Verdict> {
        let keep = |path, next| Ok(Verdict::Take { path, next, near_tie: false });
        if d.tree.is_empty() {
            return keep(path, next); // a plain step: what plain decoding does
        }
        let margin = match margin {
            Some(m) => m,
            None => match self.target.model().verify_tolerance(self.batch.len()) {
                Some(stray) => NEAR_TIE_SAFETY * 2.0 * stray,
                None => return keep(path, next),
            },
        };
        let in_order = in_order(&path);
        if in_order < path.len() {
            next = d.tree.nodes[path[in_order]].token;
            path.truncate(in_order);
        }
        let params = law.sampler.params();
        // row j decided path[j] (or `next` after the last node); its input is path[j - 1]
        for j in 0..=path.len() {
            let row = if j == 0 { 0 } else { path[j - 1] + 1 };
            fill_history(self.history, law.cached, d.last, &d.tree, row, params);
            let logits = masked(self.target.logits(d.row0 + row)?, d.states.row(law.grammar, row)?);
            let lead = params.greedy_lead(&logits, self.history);
            if lead > margin {
                continue;
            }
            tracing::debug!(pos = d.pos0 + j, row, lead, margin, "near-tie: decided by a single step");
            if j == 0 {
                return Ok(Verdict::Retry);
            }
            next = d.tree.nodes[path[j - 1]].token;
            path.truncate(j - 1);
            return Ok(Verdict::Take { path, next, near_tie: true });
        }
        keep(path, next)
    }

    /// Keep the anchor and the accepted `path` in `d`'s sequence of the target cache; drop the
    /// rest of its cells (the leaf sequences of a tree).
    pub fn keep(&mut self, d: &Drafted, path: &[usize]) -> Result<()> {
        let seq = d.seq as i32;
        let keep_end = (d.pos0 + 1 + path.len()) as i32;
        if d.n_leaves == 0 {
            return self.target.seq_rm(seq, keep_end, -1);
        }
        let n_seqs = self.n_seqs as i32;
        if let Some(&deepest) = path.last() {
            // Any leaf below the deepest accepted node holds exactly the accepted path.
            let leaf = d.tree.leaves().iter().position(|&l| d.tree.path_to(l).contains(&deepest));
            let leaf_seq = n_seqs + leaf.expect("every node has a leaf below it") as i32;
            self.target.seq_cp(leaf_seq, seq, d.pos0 as i32 + 1, keep_end);
        }
        for li in 0..d.n_leaves as i32 {
            self.target.seq_rm(n_seqs + li, -1, -1)?;
        }
        Ok(())
    }

    /// A cycle whose anchor row was a near-tie: the anchor too leaves the cache, to be decoded
    /// alone next cycle.
    pub fn retry_alone(&mut self, d: &Drafted) -> Result<()> {
        self.keep(d, &[])?;
        self.target.seq_rm(d.seq as i32, d.pos0 as i32, -1)
    }

    /// Decode an accepted side branch `tail` (node indices, below the in-order part of the
    /// path) again as a plain path right after that part: its cells sat behind free ones, out
    /// of position order, and its tree rows attended to ancestors in scattered cells, which
    /// llama.cpp's attention sums in another order than plain decoding does. At temperature 0
    /// the branch is verified once more on the new rows, which round exactly as plain decoding:
    /// only its first node (accepted on an in-order row) is certain. Returns how many nodes of
    /// `tail` are kept and, when verified again, the target's next token after them; the kept
    /// nodes are rows `0..kept` of the last decode, at positions from the first one's. Matching
    /// verifies again at T > 0 too (each row with its position's draw); after rejection
    /// sampling the sampled tokens stand (the tree rows' rounding changes the target's law by
    /// far less than any test can see).
    pub fn redecode(&mut self, d: &Drafted, tail: &[usize], law: &Law) -> Result<(usize, Option<Token>)> {
        let seq = d.seq as i32;
        let pos0 = d.pos0 + d.tree.nodes[tail[0]].depth;
        self.target.seq_rm(seq, pos0 as i32, -1)?;
        self.batch.clear();
        for (i, &node) in tail.iter().enumerate() {
            self.batch.add_token(d.tree.nodes[node].token, (pos0 + i) as i32, &[seq], true)?;
        }
        self.target.decode(self.batch, "re-decode of an accepted branch")?;
        let (kept, next) = match law.verifier.matches(law.sampler.is_greedy()) {
            true => self.reverify(d, tail, law).map(|(kept, next)| (kept, Some(next)))?,
            false => (tail.len(), None),
        };
        if kept < tail.len() {
            tracing::debug!(kept, drafted = tail.len(), "a side branch accepted on scattered cells was cut by its re-decode");
            self.target.seq_rm(seq, (pos0 + kept) as i32, -1)?;
        }
        Ok((kept, next))
    }

    /// Matching of a re-decoded `tail` on the rows of the last decode: how many of its nodes
    /// the target confirms and its next token after them.
    fn reverify(&mut self, d: &Drafted, tail: &[usize], law: &Law) -> Result<(usize, Token)> {
        let mut confirmed = (0, 0);
        for (row, &node) in tail.iter().enumerate() {
            fill_history(self.history, law.cached, d.last, &d.tree, node + 1, law.sampler.params());
            let state = d.states.node(law.grammar, node)?;
            let index = law.index(&d.tree, node + 1);
            confirmed = (row + 1, own_token(law.sampler, self.target.logits(row)?, self.history, state, index));
            // (the last row always ends the loop: no node follows it)
            if tail.get(row + 1).map(|&child| d.tree.nodes[child].token) != Some(confirmed.1) {
                break;
            }
        }
        Ok(confirmed)
    }
}

/// How many nodes of an accepted `path` sit in cells right after the anchor, in position
/// order, as plain decoding would have put them (the principal branch is laid out first).
pub fn in_order(path: &[usize]) -> usize {
    path.iter().enumerate().take_while(|&(i, &n)| n == i).count()
}
