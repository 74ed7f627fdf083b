//! Look-up drafting: what followed earlier occurrences of the context's last tokens.
//!
//! Much of what people generate repeats the context: code they asked to edit, quoted
//! passages, the same identifiers again and again. An n-gram index over one sequence's
//! committed tokens (prompt and output) proposes the continuations that followed earlier
//! matches of its last n tokens, at no drafter cost. A proposal is a token trie (one
//! branch per distinct continuation); each node's chance of acceptance is estimated from
//! how often the target took look-up tokens in this sequence so far, by the length of the
//! repeat the node would extend (the match, plus the proposed tokens before the node).
use std::collections::HashMap;

use super::config::DraftConfig;
use super::select::Walk;
use super::source::{ms_since, Draft, DraftSource, Env, Outcome, Prediction, Proposal, Request};
use super::{DraftNode, DraftTree, Origin};
use crate::llama::Token;

/// Longest n-gram the index keeps: `--lookup-ngram` can be at most this.
pub const MAX_NGRAM: usize = 8;
/// Earlier matches merged into one proposal, the most recent first.
const MAX_MATCHES: usize = 8;
/// How far back a match is followed to measure its length (beyond the indexed n-gram): a
/// long repeat (a quoted function being rewritten) is far likelier to go on than a short one.
const LONG_MATCH: usize = 16;

/// Every n-gram (n = 1..=MAX_NGRAM) of one sequence, and where each occurred.
#[derive(Debug, Default)]
pub struct NgramIndex {
    tokens: Vec<Token>,
    /// hash of an n-gram (its length included) -> the positions right after its
    /// occurrences, ascending. Hash collisions only share a list: matches are checked.
    ends: HashMap<u64, Vec<u32>>,
}

impl NgramIndex {
    /// Bring the index to the committed sequence `history` + `last`, keeping what it
    /// shares with what was indexed before (normally all but the newest tokens).
    pub fn sync(&mut self, history: &[Token], last: Token) {
        let full = history.len() + 1;
        let at = |i: usize| if i < history.len() { history[i] } else { last };
        let common = self.tokens.iter().enumerate().take_while(|&(i, &t)| i < full && at(i) == t).count();
        self.truncate(common);
        for i in common..full {
            self.push(at(i));
        }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    fn push(&mut self, token: Token) {
        self.tokens.push(token);
        let end = self.tokens.len();
        for n in 1..=MAX_NGRAM.min(end) {
            self.ends.entry(key(&self.tokens[end - n..end])).or_default().push(end as u32);
        }
    }

    fn truncate(&mut self, keep: usize) {
        // Undo pushes newest first: each list's last entry is the position being removed.
        while self.tokens.len() > keep {
            let end = self.tokens.len();
            for n in 1..=MAX_NGRAM.min(end) {
                let k = key(&self.tokens[end - n..end]);
                if let Some(list) = self.ends.get_mut(&k) {
                    debug_assert_eq!(list.last(), Some(&(end as u32)));
                    list.pop();
                    if list.is_empty() {
                        self.ends.remove(&k);
                    }
                }
            }
            self.tokens.pop();
        }
    }

    /// What followed the earlier occurrences of the longest suffix of at most `max_ngram`
    /// tokens that occurred before: up to `MAX_MATCHES` continuations (most recent first)
    /// of at most `max_len` tokens, merged into a trie. `None` when nothing matches.
    pub fn propose(&self, max_ngram: usize, max_len: usize) -> Option<Trie> {
        let len = self.tokens.len();
        if max_len == 0 {
            return None;
        }
        for n in (1..=max_ngram.min(MAX_NGRAM).min(len.saturating_sub(1))).rev() {
            let suffix = &self.tokens[len - n..];
            let Some(ends) = self.ends.get(&key(suffix)) else { continue };
            let matches: Vec<usize> = ends
                .iter()
                .rev()
                .map(|&e| e as usize)
                .filter(|&e| e < len && &self.tokens[e - n..e] == suffix)
                .take(MAX_MATCHES)
                .collect();
            if matches.is_empty() {
                continue;
            }
            // the whole repeat: how far the earlier occurrence agrees going back from its end
            let repeat = |e: usize| {
                (n..LONG_MATCH.min(e)).take_while(|&k| self.tokens[e - k - 1] == self.tokens[len - k - 1]).count() + n
            };
            let match_len = matches.iter().map(|&e| repeat(e)).max().unwrap_or(n);
            let mut trie = Trie { match_len, n_matches: matches.len(), nodes: Vec::new() };
            for &e in &matches {
                trie.insert(&self.tokens[e..(e + max_len).min(len)]);
            }
            return Some(trie);
        }
        None
    }
}

/// The repeat a node at `depth` (1 = the first proposed token) of a proposal behind a repeat
/// of `match_len` tokens would extend, given that the target took the proposed tokens before
/// it: those tokens repeat the context too.
fn repeat_at(match_len: usize, depth: usize) -> usize {
    match_len + depth.saturating_sub(1)
}

/// A 64-bit hash of an n-gram (FNV-1a over its tokens, seeded with n).
fn key(gram: &[Token]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ gram.len() as u64;
    for &t in gram {
        for b in t.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The continuations of one look-up as a trie: nodes parents first, in insertion order
/// (the most recent match's path first).
#[derive(Debug, Clone, PartialEq)]
pub struct Trie {
    /// Tokens of the longest repeat behind it (at most `LONG_MATCH`): the matched suffix and
    /// as far before it as an earlier occurrence agrees.
    pub match_len: usize,
    /// Earlier occurrences that contributed a continuation.
    pub n_matches: usize,
    pub nodes: Vec<TrieNode>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TrieNode {
    pub token: Token,
    pub parent: Option<usize>,
    pub depth: usize,
    /// Continuations through this node.
    pub support: usize,
}

impl Trie {
    fn insert(&mut self, continuation: &[Token]) {
        let mut parent = None;
        for (d, &token) in continuation.iter().enumerate() {
            let found = self.nodes.iter().position(|n| n.parent == parent && n.token == token);
            let i = match found {
                Some(i) => i,
                None => {
                    self.nodes.push(TrieNode { token, parent, depth: d + 1, support: 0 });
                    self.nodes.len() - 1
                }
            };
            self.nodes[i].support += 1;
            parent = Some(i);
        }
    }

    /// The repeat a node at `depth` would extend (see [`repeat_at`]).
    pub fn repeat_at(&self, depth: usize) -> usize {
        repeat_at(self.match_len, depth)
    }

    /// Each node's chance of acceptance given its parent: the sequence's acceptance rate
    /// of look-up tokens extending a repeat as long as this node's, times the node's share
    /// of its parent's continuations.
    fn q(&self, i: usize, calibration: &Calibration) -> f32 {
        let n = &self.nodes[i];
        let parent_support = n.parent.map_or(self.n_matches, |p| self.nodes[p].support);
        calibration.rate(self.repeat_at(n.depth)) * n.support as f32 / parent_support as f32
    }

    /// The whole trie as a draft tree, best-first, at most `budget` nodes.
    pub fn tree(&self, calibration: &Calibration, budget: usize) -> DraftTree {
        let nodes = (0..self.nodes.len()).map(|i| self.draft_node(i, self.nodes[i].parent, calibration)).collect();
        DraftTree { nodes }.best_first(budget)
    }

    /// The likeliest continuation (the most supported child at each step; the most recent
    /// match on ties) as a chain.
    pub fn path(&self, calibration: &Calibration) -> DraftTree {
        let mut tree = DraftTree::default();
        let mut at = None;
        loop {
            // `max_by_key` keeps the last of equal maxima: scanning in reverse, that is the
            // node inserted first, from the most recent match.
            let best = (0..self.nodes.len()).rev().filter(|&i| self.nodes[i].parent == at).max_by_key(|&i| self.nodes[i].support);
            let Some(i) = best else { break };
            let parent = tree.nodes.len().checked_sub(1);
            tree.nodes.push(self.draft_node(i, parent, calibration));
            at = Some(i);
        }
        tree
    }

    fn draft_node(&self, i: usize, parent: Option<usize>, calibration: &Calibration) -> DraftNode {
        let n = &self.nodes[i];
        DraftNode { token: n.token, parent, depth: n.depth, cand: 0, q: self.q(i, calibration), origin: Origin::Lookup }
    }
}

/// How often the target took look-up tokens, by the length of the repeat each token would
/// extend: the acceptance estimate of the next proposals. One table serves every depth of a
/// draft: a token deep in a proposal whose tokens before it were taken extends a longer
/// repeat, and on the held-apart editing set its acceptance matches a first token after a
/// match that long (`tests/support/lookup_features.py`).
///
/// The engine keeps one table over every conversation it served (how this target copies
/// from its context) and gives each run a table of its own that starts from it
/// ([`Calibration::learning_from`]) and follows what the target does in this answer.
#[derive(Debug, Clone)]
pub struct Calibration {
    /// Look-up tokens the target tested (their parent was accepted) and accepted, by bucket.
    tested: [u32; BUCKETS],
    accepted: [u32; BUCKETS],
    /// The rate by bucket before this table's own evidence, and how many observations it weighs.
    prior: [f32; BUCKETS],
    prior_weight: [f32; BUCKETS],
}

/// Match lengths 1-4 each, then 5-7, 8-11 and 12 or more: long repeats are rarer, so they
/// share their evidence.
const BUCKETS: usize = 8;

fn bucket(match_len: usize) -> usize {
    match match_len {
        0..=4 => match_len,
        5..=7 => 5,
        8..=11 => 6,
        _ => 7,
    }
}

/// Pseudo-observations of the built-in prior: it fades after a few cycles.
const PRIOR_WEIGHT: f32 = 2.0;
/// Pseudo-observations of what earlier conversations showed, at most (as many as they
/// observed, at least `PRIOR_WEIGHT`): a run's own evidence takes over after a few drafts
/// (replays of the editing set: 8-16 gain 1-3% over 2 and over starting every run from the
/// built-in prior).
const LEARNED_WEIGHT: f32 = 8.0;

impl Default for Calibration {
    /// Before any evidence: longer repeats are likelier to go on.
    fn default() -> Self {
        let prior = std::array::from_fn(|b| (0.3 + 0.1 * b as f32).min(0.9));
        Self { tested: [0; BUCKETS], accepted: [0; BUCKETS], prior, prior_weight: [PRIOR_WEIGHT; BUCKETS] }
    }
}

impl Calibration {
    /// A table for a new run that starts from what `learned` has seen.
    pub fn learning_from(learned: &Calibration) -> Self {
        let prior = std::array::from_fn(|b| learned.bucket_rate(b));
        let prior_weight = std::array::from_fn(|b| (learned.tested[b] as f32).clamp(PRIOR_WEIGHT, LEARNED_WEIGHT));
        Self { tested: [0; BUCKETS], accepted: [0; BUCKETS], prior, prior_weight }
    }

    /// Chance that the target takes a look-up token whose parent it took, extending a
    /// repeat of `repeat` tokens.
    pub fn rate(&self, repeat: usize) -> f32 {
        self.bucket_rate(bucket(repeat))
    }

    fn bucket_rate(&self, b: usize) -> f32 {
        let w = self.prior_weight[b];
        let rate = (self.accepted[b] as f32 + w * self.prior[b]) / (self.tested[b] as f32 + w);
        rate.min(0.98)
    }

    /// One look-up token the target tested, extending a repeat of `repeat` tokens.
    pub fn record(&mut self, repeat: usize, accepted: bool) {
        let b = bucket(repeat);
        self.tested[b] += 1;
        self.accepted[b] += accepted as u32;
    }
}

/// The look-up as a draft source: per sequence, its n-gram index over the committed tokens
/// (brought up to date when it proposes, so it costs nothing where the look-up is off) and how
/// often the target took its tokens in this generation.
pub struct Lookup {
    seqs: Vec<LookupSeq>,
    /// How often the target took look-up tokens in every generation so far: where each
    /// generation's own calibration starts.
    learned: Calibration,
}

#[derive(Default)]
struct LookupSeq {
    index: NgramIndex,
    calibration: Calibration,
    ngram: usize,
    /// The repeat behind the proposal awaiting its verify.
    match_len: Option<usize>,
}

impl Lookup {
    pub fn new(n_seqs: usize) -> Self {
        Self { seqs: (0..n_seqs).map(|_| LookupSeq::default()).collect(), learned: Calibration::default() }
    }
}

impl DraftSource for Lookup {
    fn origin(&self) -> Origin {
        Origin::Lookup
    }

    fn decodes(&self) -> bool {
        false
    }

    fn begin(&mut self, _env: &mut Env, seq: usize, _prompt: &[Token], cfg: &DraftConfig) -> crate::llama::Result<()> {
        let s = &mut self.seqs[seq];
        s.calibration = Calibration::learning_from(&self.learned);
        s.ngram = cfg.lookup_ngram;
        Ok(())
    }

    fn propose(&mut self, _env: &mut Env, requests: &[Request]) -> crate::llama::Result<Vec<Option<Proposal>>> {
        let mut out = Vec::with_capacity(requests.len());
        for r in requests {
            let t = std::time::Instant::now();
            let s = &mut self.seqs[r.seq];
            s.index.sync(r.history, r.last);
            let trie = s.index.propose(s.ngram, r.max_len);
            s.match_len = trie.as_ref().map(|t| t.match_len);
            // Under rejection sampling a look-up draft is a chain: its tokens are one-hot
            // proposals, and siblings in a rejection-sampled tree must share one proposal law.
            let branch = match r.walk {
                Walk::Tree { budget } if r.matching => Some(budget),
                _ => None,
            };
            let draft = trie.map(|trie| Draft::Estimates {
                path: trie.path(&s.calibration),
                tree: branch.map(|budget| trie.tree(&s.calibration, budget)),
            });
            out.push(draft.map(|d| Proposal::free(d, ms_since(t))));
        }
        Ok(out)
    }

    /// Calibrate by every look-up token the target tested (its parent taken): those it took,
    /// and the first look-up child of where it stopped (one per depth: its siblings were tested
    /// by the same row).
    fn learn(&mut self, _env: &mut Env, _proposal: &Proposal, o: &Outcome, _prediction: &mut Prediction) -> crate::llama::Result<()> {
        let s = &mut self.seqs[o.seq];
        let Some(match_len) = s.match_len.take() else { return Ok(()) };
        let tree = o.tree;
        let stopped_at = o.path.last().copied();
        let rejected = tree.children(stopped_at).any(|c| tree.nodes[c].origin.from_lookup());
        let rejected_depth = stopped_at.map_or(1, |i| tree.nodes[i].depth + 1);
        let tested = o.path.iter().filter(|&&i| tree.nodes[i].origin.from_lookup()).map(|&i| (tree.nodes[i].depth, true));
        for (depth, taken) in tested.chain(rejected.then_some((rejected_depth, false))) {
            let repeat = repeat_at(match_len, depth);
            s.calibration.record(repeat, taken);
            self.learned.record(repeat, taken);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(tokens: &[Token]) -> NgramIndex {
        let mut ix = NgramIndex::default();
        ix.sync(&tokens[..tokens.len() - 1], *tokens.last().unwrap());
        ix
    }

    fn tokens(tree: &DraftTree) -> Vec<Token> {
        tree.nodes.iter().map(|n| n.token).collect()
    }

    #[test]
    fn the_longest_earlier_match_proposes_what_followed_it() {
        //          0  1  2  3  4  5  6  7  8  9
        let ix = index(&[1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3]);
        // suffix [1 2 3] occurred at 0..3, followed by 4 5 9 ...
        let p = ix.propose(4, 3).unwrap();
        assert_eq!(p.match_len, 3);
        assert_eq!(p.n_matches, 1);
        assert_eq!(tokens(&p.path(&Calibration::default())), vec![4, 5, 9]);
        // with at most 2-grams, [2 3] matches twice: 7 (most recent) and 4; the older
        // occurrence repeats [1 2 3], so the repeat behind the proposal is 3 long
        let p = ix.propose(2, 2).unwrap();
        assert_eq!((p.match_len, p.n_matches), (3, 2));
        let tree = p.tree(&Calibration::default(), 8);
        assert_eq!(tree.nodes.iter().filter(|n| n.parent.is_none()).count(), 2);
        assert!(tree.nodes.iter().all(|n| n.origin == Origin::Lookup));
        // nothing to match: a sequence without repeats
        assert_eq!(index(&[1, 2, 3, 4]).propose(4, 8), None);
    }

    #[test]
    fn continuations_merge_by_support_and_the_most_recent_wins_ties() {
        // [5] followed by 6 7, 6 8, 6 7 (most recent last), then 5 again
        let ix = index(&[5, 6, 7, 0, 5, 6, 8, 0, 5, 6, 7, 0, 5]);
        let p = ix.propose(1, 2).unwrap();
        assert_eq!(p.n_matches, 3);
        let cal = Calibration::default();
        let path = p.path(&cal);
        assert_eq!(tokens(&path), vec![6, 7], "6 -> 7 has two of three continuations");
        assert_eq!(p.match_len, 5, "the sequence ends as it began: [5 6 7 0 5]");
        assert!((path.nodes[0].q - cal.rate(5)).abs() < 1e-6, "all three matches go through 6");
        assert!((path.nodes[1].q - cal.rate(6) * 2.0 / 3.0).abs() < 1e-6, "6 extends the repeat to 6 tokens");
        let tie = index(&[5, 1, 0, 5, 2, 0, 5]).propose(1, 1).unwrap();
        assert_eq!(tokens(&tie.path(&cal)), vec![2], "the most recent of equal supports");
    }

    #[test]
    fn the_index_follows_edits_and_rollbacks_of_the_sequence() {
        let mut ix = index(&[1, 2, 3, 1, 2]);
        assert_eq!(tokens(&ix.propose(2, 1).unwrap().path(&Calibration::default())), vec![3]);
        // the sequence is rolled back and continues differently
        ix.sync(&[1, 2, 9, 1], 2);
        assert_eq!(ix.len(), 5);
        assert_eq!(tokens(&ix.propose(2, 1).unwrap().path(&Calibration::default())), vec![9]);
        // an index rebuilt from scratch proposes the same
        assert_eq!(ix.propose(8, 4), index(&[1, 2, 9, 1, 2]).propose(8, 4));
        ix.sync(&[], 4);
        assert_eq!((ix.len(), ix.ends.len()), (1, 1), "only the one 1-gram is left");
    }

    #[test]
    fn a_long_repeat_is_measured_beyond_the_indexed_ngram() {
        let quoted: Vec<Token> = (10..30).collect();
        // the quote, other text, then the first 13 tokens of the quote again
        let seq: Vec<Token> = quoted.iter().chain(&[1, 2, 3]).chain(&quoted[..13]).copied().collect();
        let p = index(&seq).propose(4, 4).unwrap();
        assert_eq!(p.match_len, 13);
        assert_eq!(tokens(&p.path(&Calibration::default())), vec![23, 24, 25, 26]);
        let long: Vec<Token> = quoted.iter().chain(&[1]).chain(&quoted).copied().collect();
        assert_eq!(index(&long).propose(4, 1).unwrap().match_len, LONG_MATCH, "measured up to LONG_MATCH");
        let cal = Calibration::default();
        assert!(cal.rate(13) > cal.rate(4), "a long repeat is likelier to go on before evidence");
    }

    #[test]
    fn calibration_follows_what_the_target_accepted() {
        let mut cal = Calibration::default();
        let before = cal.rate(4);
        (0..20).for_each(|i| cal.record(4, i > 0));
        assert!(cal.rate(4) > before && cal.rate(4) > 0.85);
        (0..20).for_each(|i| cal.record(1, i == 0));
        assert!(cal.rate(1) < 0.15);
        assert!(cal.rate(3) < cal.rate(5), "a longer match is likelier before evidence");
    }

    #[test]
    fn a_new_run_starts_from_what_earlier_runs_showed_and_follows_its_own() {
        let mut learned = Calibration::default();
        (0..100).for_each(|i| learned.record(2, i % 10 == 0));
        let mut run = Calibration::learning_from(&learned);
        assert!((run.rate(2) - learned.rate(2)).abs() < 1e-6);
        assert!(run.rate(2) < 0.15, "earlier runs rarely took these");
        assert_eq!(run.rate(9), Calibration::default().rate(9), "no evidence yet: the built-in prior");
        let mut fresh = Calibration::learning_from(&Calibration::default());
        let mut first = Calibration::default();
        (0..5).for_each(|_| {
            fresh.record(9, false);
            first.record(9, false);
        });
        assert_eq!(fresh.rate(9), first.rate(9), "with nothing learned, a run adapts as fast as the first");
        (0..24).for_each(|_| run.record(2, true));
        assert!(run.rate(2) > 0.7, "this answer copies: {}", run.rate(2));
    }

    #[test]
    fn a_deeper_token_is_estimated_by_the_longer_repeat_it_extends() {
        // after a 1-token match the copy often breaks; once two tokens repeat, it goes on
        let mut cal = Calibration::default();
        (0..20).for_each(|i| cal.record(1, i % 5 == 0));
        (0..20).for_each(|i| cal.record(2, i > 0));
        (0..20).for_each(|i| cal.record(3, i > 0));
        //               0  1  2  3  4  5
        let p = index(&[7, 1, 2, 3, 0, 7]).propose(1, 3).unwrap();
        assert_eq!((p.match_len, tokens(&p.path(&cal))), (1, vec![1, 2, 3]));
        let q: Vec<f32> = p.path(&cal).nodes.iter().map(|n| n.q).collect();
        assert_eq!(q, vec![cal.rate(1), cal.rate(2), cal.rate(3)]);
        assert!(q[0] < 0.3 && q[1] > 0.85, "{q:?}");
        assert_eq!(p.repeat_at(3), 3);
    }
}
