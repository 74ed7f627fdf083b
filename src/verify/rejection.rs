//! Lossless speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023), on
//! token trees (recursive rejection sampling: SpecInfer, Miao et al. 2024; drafts drawn
//! without replacement: Jeon et al. 2024).
//!
//! A draft token x drawn from the drafter's proposal q is kept with probability
//! min(1, p(x)/q(x)). On rejection, the target's token is still to be drawn from the
//! residual p' = normalize(max(p - q, 0)); that holds whatever x was, so the next sibling
//! (drawn from q without the siblings drawn before it, renormalised) is tested against p'
//! the same way, and so on. When no sibling is left the token is drawn from the last
//! residual (from p itself at a leaf: the bonus token). Every emitted token is thus
//! distributed exactly as the target p, whatever q is, so speculation changes speed, never
//! output. A chain is the tree with one child per node; a greedy draft at T > 0 is the
//! proposal q = one-hot on the draft.
//!
//! RNG use is fixed by the outcome: one uniform draw per tested draft, and one for the token
//! drawn where the walk stops. The output follows p, but which tokens come out depends on what
//! was drafted: only matching (`super::matching`) gives plain decoding's text for a seed.

use super::Accepted;
use crate::draft::DraftTree;
use crate::sampling::Distribution;
use rand::Rng;

/// Walks `tree` from the anchor, testing each node's children in node order (the order
/// they were drawn) and descending into the first one kept.
///
/// `qs[i]` is the proposal node `i` was drawn from before any sibling was removed (the
/// same for all children of one parent: distinct ids with their probabilities).
/// `target_law(row)` is the target distribution at verify-batch row `row` (0 = anchor,
/// `i + 1` = node `i`); it is only asked for rows on the accepted path.
pub fn verify_tree<E>(
    tree: &DraftTree,
    qs: &[Vec<(i32, f32)>],
    mut target_law: impl FnMut(usize) -> Result<Distribution, E>,
    rng: &mut impl Rng,
) -> Result<Accepted, E> {
    assert_eq!(qs.len(), tree.len(), "one proposal per node");
    let mut nodes = Vec::new();
    let mut current: Option<usize> = None;
    'descend: loop {
        let mut p = Residual::new(target_law(current.map_or(0, |node| node + 1))?);
        let mut q: Option<Proposal> = None;
        for child in tree.children(current) {
            let q = q.get_or_insert_with(|| Proposal::new(&qs[child]));
            let draft = tree.nodes[child].token;
            let u: f64 = rng.gen();
            if u < acceptance_probability(p.prob(draft), q.prob(draft)) {
                nodes.push(child);
                current = Some(child);
                continue 'descend;
            }
            p.subtract(q);
            q.remove(draft);
        }
        return Ok(Accepted {
            nodes,
            bonus: p.sample(rng),
        });
    }
}

/// min(1, p(x)/q(x)), the chance of keeping a draft x the drafter drew with probability q(x).
fn acceptance_probability(p_draft: f64, q_draft: f64) -> f64 {
    if p_draft <= 0.0 || q_draft <= 0.0 {
        // p = 0: never let out a token the target forbids. q = 0: the drafter cannot have
        // drawn it; not testing it (the residual stays as it is) keeps the law exact.
        return 0.0;
    }
    (p_draft / q_draft).min(1.0)
}

/// What is left of the target's law at one row while its drafts are tested: p, then the
/// normalised residual after each rejection. It lives on p's support.
#[derive(Debug, Clone)]
struct Residual {
    ids: Vec<i32>,
    probs: Vec<f64>,
}

impl Residual {
    fn new(p: Distribution) -> Self {
        Self { probs: p.probs.iter().map(|&x| f64::from(x)).collect(), ids: p.ids }
    }

    fn prob(&self, id: i32) -> f64 {
        self.ids.iter().position(|&t| t == id).map_or(0.0, |i| self.probs[i])
    }

    /// p <- normalize(max(p - q, 0)). A residual with no mass means p == q, where a
    /// rejection only happens by rounding; p is then still the right law and is kept.
    fn subtract(&mut self, q: &Proposal) {
        let residual: Vec<f64> =
            self.ids.iter().zip(&self.probs).map(|(&id, &p)| (p - q.prob(id)).max(0.0)).collect();
        let total: f64 = residual.iter().sum();
        if total > 0.0 {
            self.probs = residual.into_iter().map(|r| r / total).collect();
        }
    }

    /// One uniform draw; when rounding puts it past the end, the last token with mass.
    fn sample(&self, rng: &mut impl Rng) -> i32 {
        let u: f64 = rng.gen::<f64>() * self.probs.iter().sum::<f64>();
        let mut cumulative = 0.0;
        let mut chosen = None;
        for (&id, &p) in self.ids.iter().zip(&self.probs) {
            if p > 0.0 {
                chosen = Some(id);
                cumulative += p;
                if u < cumulative {
                    break;
                }
            }
        }
        chosen.unwrap_or(self.ids[0])
    }
}

/// A proposal that siblings are drawn from without replacement: each draw removes its
/// token, and the next draw follows the rest, renormalised.
#[derive(Debug, Clone)]
struct Proposal {
    /// Sorted by id.
    by_id: Vec<(i32, f64)>,
    total: f64,
}

impl Proposal {
    fn new(q: &[(i32, f32)]) -> Self {
        let mut by_id: Vec<(i32, f64)> = q.iter().map(|&(id, x)| (id, f64::from(x))).collect();
        by_id.sort_unstable_by_key(|&(id, _)| id);
        let total = by_id.iter().map(|&(_, x)| x).sum();
        Self { by_id, total }
    }

    fn prob(&self, id: i32) -> f64 {
        if self.total <= 0.0 {
            return 0.0;
        }
        self.by_id.binary_search_by_key(&id, |&(t, _)| t).map_or(0.0, |i| self.by_id[i].1 / self.total)
    }

    fn remove(&mut self, id: i32) {
        if let Ok(i) = self.by_id.binary_search_by_key(&id, |&(t, _)| t) {
            self.total -= self.by_id[i].1;
            self.by_id[i].1 = 0.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::draft::{DraftNode, Origin};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;
    use std::collections::HashMap;

    /// Sparse random weights over `vocab` tokens: cubed uniforms with about a third zeroed, never all.
    fn random_weights(rng: &mut impl Rng, vocab: usize) -> Vec<f32> {
        let mut weights: Vec<f32> = (0..vocab)
            .map(|_| if rng.gen_bool(0.3) { 0.0 } else { rng.gen::<f32>().powi(3) })
            .collect();
        let keep = rng.gen_range(0..vocab);
        weights[keep] = weights[keep].max(0.05);
        weights
    }

    /// The target distribution with these (unnormalised) weights, in `Distribution`'s layout.
    fn distribution(weights: &[f32]) -> Distribution {
        let total: f32 = weights.iter().sum();
        let mut entries: Vec<(i32, f32)> = weights
            .iter()
            .enumerate()
            .filter(|(_, &w)| w > 0.0)
            .map(|(id, &w)| (id as i32, w / total))
            .collect();
        entries.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        Distribution { ids: entries.iter().map(|e| e.0).collect(), probs: entries.iter().map(|e| e.1).collect() }
    }

    /// A drafter proposal with these weights, listed in a scrambled order as a drafter might.
    fn proposal(weights: &[f32]) -> Vec<(i32, f32)> {
        let dist = distribution(weights);
        let mut q: Vec<(i32, f32)> = dist.ids.into_iter().zip(dist.probs).collect();
        q.reverse();
        q
    }

    /// Up to `n` distinct tokens drawn from `q` one after another, each from what is left
    /// of `q` renormalised (written independently of the module).
    fn draw_without_replacement(q: &[(i32, f32)], n: usize, rng: &mut impl Rng) -> Vec<i32> {
        let mut left = q.to_vec();
        let mut drawn = Vec::new();
        while drawn.len() < n {
            let total: f32 = left.iter().map(|e| e.1).sum();
            if total <= 0.0 {
                break;
            }
            let u = rng.gen::<f32>() * total;
            let mut cumulative = 0.0;
            let mut pick = left.iter().rposition(|e| e.1 > 0.0).unwrap();
            for (i, e) in left.iter().enumerate() {
                cumulative += e.1;
                if u < cumulative && e.1 > 0.0 {
                    pick = i;
                    break;
                }
            }
            drawn.push(left[pick].0);
            left[pick].1 = 0.0;
        }
        drawn
    }

    /// The exact law of the token one tree level emits when up to `siblings` drafts are
    /// drawn from `drawn` without replacement and tested in draw order, enumerating every
    /// draw order. `tested` is the verifier's view of the proposal; `remove = false` is a
    /// broken verifier that forgets to take drawn siblings out of it.
    fn level_law(p: &Residual, drawn: &Proposal, tested: &Proposal, siblings: usize, weight: f64, remove: bool, law: &mut HashMap<i32, f64>) {
        let drawable: Vec<(i32, f64)> =
            drawn.by_id.iter().map(|&(id, _)| (id, drawn.prob(id))).filter(|&(_, x)| x > 0.0).collect();
        if siblings == 0 || drawable.is_empty() {
            for (&id, &x) in p.ids.iter().zip(&p.probs) {
                *law.entry(id).or_default() += weight * x;
            }
            return;
        }
        for (draft, q_draft) in drawable {
            let accept = acceptance_probability(p.prob(draft), tested.prob(draft));
            *law.entry(draft).or_default() += weight * q_draft * accept;
            let (mut p, mut drawn_left, mut tested_left) = (p.clone(), drawn.clone(), tested.clone());
            p.subtract(tested);
            drawn_left.remove(draft);
            if remove {
                tested_left.remove(draft);
            }
            level_law(&p, &drawn_left, &tested_left, siblings - 1, weight * q_draft * (1.0 - accept), remove, law);
        }
    }

    fn level_error(p: &Distribution, q: &[(i32, f32)], siblings: usize, remove: bool) -> f64 {
        let mut law = HashMap::new();
        let q = Proposal::new(q);
        level_law(&Residual::new(p.clone()), &q, &q, siblings, 1.0, remove, &mut law);
        let support: std::collections::HashSet<i32> = law.keys().chain(&p.ids).copied().collect();
        support.into_iter().map(|id| (law.get(&id).copied().unwrap_or(0.0) - f64::from(p.prob(id))).abs()).fold(0.0, f64::max)
    }

    #[test]
    fn one_level_emits_exactly_the_target_law() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut broken_detected = 0;
        for vocab in 3..=5 {
            for trial in 0..200 {
                let p = distribution(&random_weights(&mut rng, vocab));
                // Some trials propose p itself (nothing is rejected) or one token (a greedy draft).
                let q = match trial % 10 {
                    0 => p.ids.iter().zip(&p.probs).map(|(&id, &x)| (id, x)).collect(),
                    1 => vec![(rng.gen_range(0..vocab as i32), 1.0)],
                    _ => proposal(&random_weights(&mut rng, vocab)),
                };
                for siblings in 1..=3 {
                    let error = level_error(&p, &q, siblings, true);
                    assert!(error < 1e-6, "{siblings} siblings: off by {error}: p {p:?}, q {q:?}");
                    if siblings > 1 && level_error(&p, &q, siblings, false) > 1e-3 {
                        broken_detected += 1;
                    }
                }
            }
        }
        assert!(broken_detected > 100, "forgetting drawn siblings went unnoticed ({broken_detected})");
    }

    /// [`verify_tree`] with every row's target law at hand, checking it asks for each row at most once.
    fn verify(tree: &DraftTree, qs: &[Vec<(i32, f32)>], ps: &[Distribution], rng: &mut ChaCha8Rng) -> Accepted {
        assert_eq!(ps.len(), tree.len() + 1);
        let mut asked = vec![false; ps.len()];
        let result = verify_tree(tree, qs, |row| {
            assert!(!std::mem::replace(&mut asked[row], true), "row {row} asked twice");
            Ok::<_, ()>(ps[row].clone())
        }, rng);
        result.unwrap()
    }

    fn chain(tokens: &[i32]) -> DraftTree {
        DraftTree::chain(tokens)
    }

    fn one_hot(token: i32) -> Distribution {
        Distribution { ids: vec![token], probs: vec![1.0] }
    }

    #[test]
    fn greedy_target_accepts_only_its_argmax_and_replaces_with_it() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let accepted = verify(&chain(&[5]), &[vec![(5, 1.0)]], &[one_hot(5), one_hot(8)], &mut rng);
        assert_eq!(accepted, Accepted { nodes: vec![0], bonus: 8 });
        let rejected = verify(&chain(&[2]), &[vec![(2, 0.7), (5, 0.3)]], &[one_hot(5), one_hot(8)], &mut rng);
        assert_eq!(rejected, Accepted { nodes: vec![], bonus: 5 });
        // Two siblings: the second is the target's token and is kept.
        let tree = DraftTree {
            nodes: vec![
                DraftNode { token: 2, parent: None, depth: 1, cand: 0, q: 0.7, origin: Origin::Drafter },
                DraftNode { token: 5, parent: None, depth: 1, cand: 1, q: 0.3, origin: Origin::Drafter },
            ],
        };
        let q = vec![(2, 0.7), (5, 0.3)];
        let accepted = verify(&tree, &[q.clone(), q], &[one_hot(5), one_hot(1), one_hot(9)], &mut rng);
        assert_eq!(accepted, Accepted { nodes: vec![1], bonus: 9 });
    }

    type TreeCase = (DraftTree, Vec<Vec<(i32, f32)>>, Vec<Distribution>);

    /// A random tree of depth <= 3 with up to 3 children a node, drawn from random proposals
    /// without replacement; returns the tree, each node's proposal and each row's target law.
    fn random_tree(rng: &mut ChaCha8Rng, vocab: usize) -> TreeCase {
        let mut tree = DraftTree::default();
        let mut qs = Vec::new();
        let mut open: Vec<Option<usize>> = vec![None];
        while let Some(parent) = open.pop() {
            let depth = parent.map_or(0, |p| tree.nodes[p].depth);
            if depth == 3 {
                continue;
            }
            let q = proposal(&random_weights(rng, vocab));
            let width = rng.gen_range(0..=3);
            for token in draw_without_replacement(&q, width, rng) {
                tree.nodes.push(DraftNode { token, parent, depth: depth + 1, cand: 0, q: 1.0, origin: Origin::Drafter });
                qs.push(q.clone());
                open.push(Some(tree.nodes.len() - 1));
            }
        }
        let ps = (0..=tree.len()).map(|_| distribution(&random_weights(rng, vocab))).collect();
        (tree, qs, ps)
    }

    #[test]
    fn rng_draws_are_fixed_by_the_outcome() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let (mut rejections, mut full_acceptances) = (0, 0);
        for _ in 0..500 {
            let (tree, qs, ps) = random_tree(&mut rng, 4);
            let mut verifier_rng = ChaCha8Rng::seed_from_u64(rng.gen());
            let mut replay = verifier_rng.clone();
            let words_before = verifier_rng.get_word_pos();
            let result = verify(&tree, &qs, &ps, &mut verifier_rng);
            // Tested drafts: the siblings up to each kept node, then every child of the last one.
            let mut tested = 0;
            let mut parent = None;
            for &node in &result.nodes {
                tested += tree.children(parent).position(|c| c == node).unwrap() + 1;
                parent = Some(node);
            }
            let last_children = tree.children(parent).count();
            tested += last_children;
            // Each f64 draw consumes one u64, two ChaCha words; one more draw for the emitted token.
            assert_eq!(verifier_rng.get_word_pos() - words_before, 2 * (tested + 1) as u128);
            assert_eq!(verify(&tree, &qs, &ps, &mut replay), result);
            if last_children > 0 {
                rejections += 1;
            } else if !tree.is_empty() {
                full_acceptances += 1;
            }
        }
        assert!(rejections > 50 && full_acceptances > 50, "{rejections} rejections, {full_acceptances} full acceptances");
    }

    type Verifier = fn(&DraftTree, &[Vec<(i32, f32)>], &[Distribution], &mut ChaCha8Rng) -> Accepted;

    /// Total variation between the law of the first two tokens a speculative decoder emits with
    /// `verifier` and the target's own law, over a 4-token vocabulary where both target and
    /// drafter depend on the whole prefix. Each cycle drafts a tree of depth 2 with
    /// `siblings` children a node (drawn without replacement), then redrafts after what it emitted.
    fn two_token_total_variation(verifier: Verifier, siblings: usize) -> f64 {
        let vocab = 4;
        let mut tables_rng = ChaCha8Rng::seed_from_u64(5);
        let mut targets: HashMap<Vec<i32>, Distribution> = HashMap::new();
        let mut proposals: HashMap<Vec<i32>, Vec<(i32, f32)>> = HashMap::new();
        let mut prefixes = vec![Vec::new()];
        for _ in 0..=3 {
            let mut longer = Vec::new();
            for prefix in prefixes {
                targets.insert(prefix.clone(), distribution(&random_weights(&mut tables_rng, vocab)));
                proposals.insert(prefix.clone(), proposal(&random_weights(&mut tables_rng, vocab)));
                longer.extend((0..vocab as i32).map(|t| [prefix.as_slice(), &[t]].concat()));
            }
            prefixes = longer;
        }

        let samples = 200_000;
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let mut counts = vec![0usize; vocab * vocab];
        for _ in 0..samples {
            let mut emitted: Vec<i32> = Vec::new();
            while emitted.len() < 2 {
                let mut tree = DraftTree::default();
                let mut qs = Vec::new();
                let mut contexts = vec![emitted.clone()];
                let mut open: Vec<Option<usize>> = vec![None];
                while let Some(parent) = open.pop() {
                    let context = contexts[parent.map_or(0, |p| p + 1)].clone();
                    let depth = parent.map_or(0, |p| tree.nodes[p].depth);
                    if depth == 2 {
                        continue;
                    }
                    let q = proposals[&context].clone();
                    for token in draw_without_replacement(&q, siblings, &mut rng) {
                        tree.nodes.push(DraftNode { token, parent, depth: depth + 1, cand: 0, q: 1.0, origin: Origin::Drafter });
                        qs.push(q.clone());
                        contexts.push([context.as_slice(), &[token]].concat());
                        open.push(Some(tree.nodes.len() - 1));
                    }
                }
                let ps: Vec<Distribution> = contexts.iter().map(|c| targets[c].clone()).collect();
                let result = verifier(&tree, &qs, &ps, &mut rng);
                emitted.extend(result.nodes.iter().map(|&n| tree.nodes[n].token));
                emitted.push(result.bonus);
            }
            counts[emitted[0] as usize * vocab + emitted[1] as usize] += 1;
        }

        let mut total_variation = 0.0;
        for first in 0..vocab as i32 {
            for second in 0..vocab as i32 {
                let exact = f64::from(targets[&vec![]].prob(first)) * f64::from(targets[&vec![first]].prob(second));
                let empirical = counts[first as usize * vocab + second as usize] as f64 / samples as f64;
                total_variation += (exact - empirical).abs() / 2.0;
            }
        }
        total_variation
    }

    #[test]
    fn chains_and_trees_emit_the_target_law() {
        for siblings in [1, 2, 3] {
            let tv = two_token_total_variation(verify, siblings);
            eprintln!("{siblings} siblings a node: total variation {tv}");
            assert!(tv < 0.01, "{siblings} siblings: total variation {tv}");
        }
    }

    #[test]
    fn accepting_the_first_child_always_fails_the_same_check() {
        let tv = two_token_total_variation(
            |tree, _, ps, rng| {
                let nodes = tree.principal_path();
                let row = nodes.last().map_or(0, |&n| n + 1);
                Accepted { nodes, bonus: ps[row].sample(rng) }
            },
            2,
        );
        eprintln!("accept-all: total variation {tv}");
        assert!(tv > 0.1, "total variation {tv}");
    }
}
