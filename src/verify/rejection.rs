//! Lossless speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023).
//!
//! A draft token x drawn from the drafter's proposal q is kept with probability min(1, p(x)/q(x));
//! at the first rejection the replacement is drawn from normalize(max(p - q, 0)). Every emitted token
//! is then distributed exactly as the target p, whatever q is, so speculation changes speed, never
//! output. A greedy draft at T > 0 is the proposal q = one-hot on the draft.
//!
//! RNG use is fixed by the outcome, so a seed reproduces a run: `verify_step` makes one uniform draw
//! for the accept test and, only on rejection, one more for the replacement. `verify_chain` thus makes
//! `n_accepted + 2` draws when it rejects a draft and `n_accepted + 1` (the last for the bonus token)
//! when it accepts them all.

use crate::sampling::Distribution;
use rand::Rng;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOutcome {
    Accepted,
    /// The draft was rejected; `resampled` replaces it and ends the chain.
    Rejected {
        resampled: i32,
    },
}

/// Verifies one draft position: `draft` was drawn from `q`, the drafter's sparse proposal (distinct
/// ids with their probabilities, `q(draft) > 0`), and `p` is the target distribution there.
pub fn verify_step(
    draft: i32,
    q: &[(i32, f32)],
    p: &Distribution,
    rng: &mut impl Rng,
) -> StepOutcome {
    let u: f64 = rng.gen();
    if u < acceptance_probability(p.prob(draft), proposal_prob(q, draft)) {
        StepOutcome::Accepted
    } else {
        StepOutcome::Rejected {
            resampled: sample_residual(q, p, rng),
        }
    }
}

/// The outcome of verifying a chain of drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainResult {
    /// How many leading drafts were accepted.
    pub n_accepted: usize,
    /// The token after the accepted prefix: the replacement of the first rejected draft, or the bonus
    /// token drawn from the last target distribution when every draft was accepted.
    pub next: i32,
}

/// Verifies `drafts` in order, stopping at the first rejection. `qs[i]` is the proposal `drafts[i]`
/// was drawn from and `ps[i]` the target distribution at that position; `ps` has one more entry, the
/// target distribution after the last draft, for the bonus token.
pub fn verify_chain(
    drafts: &[i32],
    qs: &[Vec<(i32, f32)>],
    ps: &[Distribution],
    rng: &mut impl Rng,
) -> ChainResult {
    assert_eq!(qs.len(), drafts.len(), "one proposal per draft");
    assert_eq!(
        ps.len(),
        drafts.len() + 1,
        "one target distribution per draft, plus one for the bonus token"
    );
    for (i, ((&draft, q), p)) in drafts.iter().zip(qs).zip(ps).enumerate() {
        if let StepOutcome::Rejected { resampled } = verify_step(draft, q, p, rng) {
            return ChainResult {
                n_accepted: i,
                next: resampled,
            };
        }
    }
    ChainResult {
        n_accepted: drafts.len(),
        next: ps[drafts.len()].sample(rng),
    }
}

fn proposal_prob(q: &[(i32, f32)], id: i32) -> f32 {
    q.iter()
        .find(|&&(t, _)| t == id)
        .map_or(0.0, |&(_, prob)| prob)
}

/// min(1, p(x)/q(x)), the chance of keeping a draft x the drafter drew with probability q(x).
fn acceptance_probability(p_draft: f32, q_draft: f32) -> f64 {
    debug_assert!(
        q_draft > 0.0,
        "the drafter cannot have drawn a token it gave probability 0"
    );
    if p_draft <= 0.0 {
        // Explicit so that even a wrong q(x) = 0 (0/0) never lets out a token the target forbids.
        return 0.0;
    }
    (f64::from(p_draft) / f64::from(q_draft)).min(1.0)
}

/// max(p(t) - q(t), 0) for each token of p's support, in p's order; the residual is 0 off that support.
/// `q_by_id` is the proposal sorted by id.
fn residual_weights<'a>(
    q_by_id: &'a [(i32, f32)],
    p: &'a Distribution,
) -> impl Iterator<Item = (i32, f64)> + 'a {
    p.ids.iter().zip(&p.probs).map(move |(&id, &p_t)| {
        let q_t = q_by_id
            .binary_search_by_key(&id, |&(t, _)| t)
            .map_or(0.0, |i| q_by_id[i].1);
        (id, (f64::from(p_t) - f64::from(q_t)).max(0.0))
    })
}

/// Draws from normalize(max(p - q, 0)) with one uniform draw. A zero residual means p == q, where
/// rejection cannot happen save by rounding; p itself is then the right law.
fn sample_residual(q: &[(i32, f32)], p: &Distribution, rng: &mut impl Rng) -> i32 {
    let mut q_by_id = q.to_vec();
    q_by_id.sort_unstable_by_key(|&(id, _)| id);
    let total: f64 = residual_weights(&q_by_id, p).map(|(_, w)| w).sum();
    if total <= 0.0 {
        return p.sample(rng);
    }
    let target = rng.gen::<f64>() * total;
    let mut cumulative = 0.0;
    let mut chosen = None;
    for (id, weight) in residual_weights(&q_by_id, p) {
        if weight > 0.0 {
            chosen = Some(id);
            cumulative += weight;
            if target < cumulative {
                break;
            }
        }
    }
    // When rounding puts the target past the end, the last token with weight is taken.
    chosen.expect("a positive residual has a token with positive weight")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;
    use std::collections::HashMap;

    /// Sparse random weights over `vocab` tokens: cubed uniforms with about a third zeroed, never all.
    fn random_weights(rng: &mut impl Rng, vocab: usize) -> Vec<f32> {
        let mut weights: Vec<f32> = (0..vocab)
            .map(|_| {
                if rng.gen_bool(0.3) {
                    0.0
                } else {
                    rng.gen::<f32>().powi(3)
                }
            })
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
        Distribution {
            ids: entries.iter().map(|e| e.0).collect(),
            probs: entries.iter().map(|e| e.1).collect(),
        }
    }

    /// A drafter proposal with these weights, listed in a scrambled order as a drafter might.
    fn proposal(weights: &[f32]) -> Vec<(i32, f32)> {
        let dist = distribution(weights);
        let mut q: Vec<(i32, f32)> = dist.ids.into_iter().zip(dist.probs).collect();
        q.reverse();
        q
    }

    fn sample_proposal(q: &[(i32, f32)], rng: &mut impl Rng) -> i32 {
        let u: f32 = rng.gen();
        let mut cumulative = 0.0;
        for &(id, prob) in q {
            cumulative += prob;
            if u < cumulative {
                return id;
            }
        }
        q.last().unwrap().0
    }

    #[test]
    fn step_output_law_is_exactly_the_target() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for vocab in 3..=5 {
            for trial in 0..300 {
                let p = distribution(&random_weights(&mut rng, vocab));
                // Some trials propose p itself, where nothing is ever rejected.
                let q_weights = if trial % 10 == 0 {
                    (0..vocab as i32).map(|t| p.prob(t)).collect()
                } else {
                    random_weights(&mut rng, vocab)
                };
                let q = proposal(&q_weights);
                let mut q_by_id = q.clone();
                q_by_id.sort_unstable_by_key(|&(id, _)| id);

                let rejected_mass: f64 = q
                    .iter()
                    .map(|&(x, q_x)| {
                        f64::from(q_x) * (1.0 - acceptance_probability(p.prob(x), q_x))
                    })
                    .sum();
                let residual: Vec<(i32, f64)> = residual_weights(&q_by_id, &p).collect();
                let residual_total: f64 = residual.iter().map(|r| r.1).sum();
                for t in 0..vocab as i32 {
                    let q_t = proposal_prob(&q, t);
                    let accepted = if q_t > 0.0 {
                        f64::from(q_t) * acceptance_probability(p.prob(t), q_t)
                    } else {
                        0.0
                    };
                    let residual_t = residual.iter().find(|r| r.0 == t).map_or(0.0, |r| r.1);
                    // A residual lost to rounding falls back to p, as sample_residual does.
                    let resampled_law = if residual_total > 0.0 {
                        residual_t / residual_total
                    } else {
                        f64::from(p.prob(t))
                    };
                    let resampled = rejected_mass * resampled_law;
                    let output = accepted + resampled;
                    assert!(
                        (output - f64::from(p.prob(t))).abs() < 1e-6,
                        "token {t}: {output} vs {p:?}, q {q:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn greedy_target_accepts_only_its_argmax_and_replaces_with_it() {
        let p = Distribution {
            ids: vec![5],
            probs: vec![1.0],
        };
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(
            verify_step(5, &[(5, 1.0)], &p, &mut rng),
            StepOutcome::Accepted
        );
        assert_eq!(
            verify_step(2, &[(2, 1.0)], &p, &mut rng),
            StepOutcome::Rejected { resampled: 5 }
        );
        assert_eq!(
            verify_step(2, &[(2, 0.7), (5, 0.3)], &p, &mut rng),
            StepOutcome::Rejected { resampled: 5 }
        );
    }

    #[test]
    fn rng_draws_are_fixed_by_the_outcome() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let (mut rejections, mut full_acceptances) = (0, 0);
        for _ in 0..500 {
            let vocab = 4;
            let drafts_len = rng.gen_range(0..4);
            let mut drafts = Vec::new();
            let mut qs = Vec::new();
            for _ in 0..drafts_len {
                let q = proposal(&random_weights(&mut rng, vocab));
                drafts.push(sample_proposal(&q, &mut rng));
                qs.push(q);
            }
            let ps: Vec<Distribution> = (0..=drafts_len)
                .map(|_| distribution(&random_weights(&mut rng, vocab)))
                .collect();

            let mut verifier_rng = ChaCha8Rng::seed_from_u64(rng.gen());
            let mut replay = verifier_rng.clone();
            let words_before = verifier_rng.get_word_pos();
            let result = verify_chain(&drafts, &qs, &ps, &mut verifier_rng);
            let rejected = result.n_accepted < drafts_len;
            let draws = result.n_accepted + 1 + usize::from(rejected);
            // Each f64 draw consumes one u64, two ChaCha words.
            assert_eq!(
                verifier_rng.get_word_pos() - words_before,
                2 * draws as u128
            );
            assert_eq!(verify_chain(&drafts, &qs, &ps, &mut replay), result);
            if rejected {
                rejections += 1;
            } else if drafts_len > 0 {
                full_acceptances += 1;
            }
        }
        assert!(
            rejections > 50 && full_acceptances > 50,
            "{rejections} rejections, {full_acceptances} full acceptances"
        );
    }

    type Verifier = fn(&[i32], &[Vec<(i32, f32)>], &[Distribution], &mut ChaCha8Rng) -> ChainResult;

    /// Total variation between the law of the first two tokens a speculative decoder emits with
    /// `verifier` (two-draft cycles, redrafting after each) and the target's own law, over a
    /// 4-token vocabulary where both target and drafter depend on the whole prefix.
    fn two_token_total_variation(verifier: Verifier) -> f64 {
        let vocab = 4;
        let mut tables_rng = ChaCha8Rng::seed_from_u64(5);
        let mut targets: HashMap<Vec<i32>, Distribution> = HashMap::new();
        let mut proposals: HashMap<Vec<i32>, Vec<(i32, f32)>> = HashMap::new();
        let mut prefixes = vec![Vec::new()];
        for _ in 0..=3 {
            let mut longer = Vec::new();
            for prefix in prefixes {
                targets.insert(
                    prefix.clone(),
                    distribution(&random_weights(&mut tables_rng, vocab)),
                );
                proposals.insert(
                    prefix.clone(),
                    proposal(&random_weights(&mut tables_rng, vocab)),
                );
                longer.extend((0..vocab as i32).map(|t| [prefix.as_slice(), &[t]].concat()));
            }
            prefixes = longer;
        }

        let samples = 200_000;
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let mut counts = vec![0usize; vocab * vocab];
        for _ in 0..samples {
            let mut emitted = Vec::new();
            while emitted.len() < 2 {
                let mut context = emitted.clone();
                let mut drafts = Vec::new();
                let mut qs = Vec::new();
                let mut ps = vec![targets[&context].clone()];
                for _ in 0..2 {
                    let q = proposals[&context].clone();
                    let draft = sample_proposal(&q, &mut rng);
                    context.push(draft);
                    drafts.push(draft);
                    qs.push(q);
                    ps.push(targets[&context].clone());
                }
                let result = verifier(&drafts, &qs, &ps, &mut rng);
                emitted.extend_from_slice(&drafts[..result.n_accepted]);
                emitted.push(result.next);
            }
            counts[emitted[0] as usize * vocab + emitted[1] as usize] += 1;
        }

        let mut total_variation = 0.0;
        for first in 0..vocab as i32 {
            for second in 0..vocab as i32 {
                let exact = f64::from(targets[&vec![]].prob(first))
                    * f64::from(targets[&vec![first]].prob(second));
                let empirical =
                    counts[first as usize * vocab + second as usize] as f64 / samples as f64;
                total_variation += (exact - empirical).abs() / 2.0;
            }
        }
        total_variation
    }

    #[test]
    fn chain_emits_the_target_law() {
        let tv = two_token_total_variation(verify_chain);
        eprintln!("lossless chain: total variation {tv}");
        assert!(tv < 0.01, "total variation {tv}");
    }

    #[test]
    fn accepting_every_draft_fails_the_same_check() {
        let tv = two_token_total_variation(|drafts, _, ps, rng| ChainResult {
            n_accepted: drafts.len(),
            next: ps[drafts.len()].sample(rng),
        });
        eprintln!("accept-all chain: total variation {tv}");
        assert!(tv > 0.1, "total variation {tv}");
    }
}
