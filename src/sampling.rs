//! The target distribution p: what a llama.cpp user sampling with the same flags draws from.
//!
//! Plain decoding samples p directly and speculative decoding verifies drafts against it, so both
//! must build it with this one function for speculation to be lossless.
//!
//! The chain follows llama.cpp's default sampler order (`common/common.h`,
//! `common_params_sampling::samplers`): penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc,
//! temperature, then `dist`. Dry, top_n_sigma, typ_p and xtc are off by default and not offered here,
//! which leaves
//!
//! `penalties -> top_k -> top_p -> min_p -> temperature -> dist`
//!
//! with the semantics of `src/llama-sampler.cpp`:
//! - logit bias first (`common_sampler_init` puts `llama_sampler_init_logit_bias` before the chain):
//!   each `(id, bias)` adds `bias` to that logit (entries for one id add up; `-inf` bans it);
//! - penalties: each distinct token among the last `repeat_last_n` of the history, seen `count` times
//!   there, gets `logit <= 0 ? logit * repeat : logit / repeat`, then
//!   `logit -= count * frequency + presence` (`repeat_last_n <= 0` disables them, as
//!   `llama_sampler_init_penalties` clamps negatives to 0);
//! - top_k: the k highest logits;
//! - top_p: on the softmax of the UNTEMPERED surviving logits (over those k when top_k is on, over the
//!   whole vocabulary when it is off), the shortest best-first prefix whose cumulative probability
//!   reaches `top_p`;
//! - min_p: keep logits `>= max + ln(min_p)`, i.e. untempered `p >= min_p * p_max`;
//! - temperature: divides the surviving logits; `<= 0` keeps only the argmax (greedy);
//! - dist: softmax of what is left.
//!
//! `min_keep` is llama.cpp's default 0: every stage keeps at least one token. Grammars and a
//! vocabulary's suppressed tokens are not applied here. Ties between equal logits, which llama.cpp
//! leaves to `std::partial_sort`, go to the lower token id.

use rand::Rng;

/// The user's sampling flags; the defaults are llama.cpp's except the temperature (greedy here).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SamplingParams {
    pub temperature: f32,
    /// `<= 0` disables.
    pub top_k: i32,
    /// `>= 1` disables.
    pub top_p: f32,
    /// `<= 0` disables.
    pub min_p: f32,
    /// `1` disables.
    pub repeat_penalty: f32,
    /// Subtracted once from each token of the penalty window (OpenAI's `presence_penalty`); 0 disables.
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the penalty window (OpenAI's `frequency_penalty`); 0 disables.
    pub frequency_penalty: f32,
    /// The window of all three penalties; `<= 0` disables them.
    pub repeat_last_n: i32,
    /// Added to the logits of these token ids before anything else (`-inf` bans a token).
    /// Shown as llama-server shows it: `[{"token", "bias"}]`, `-inf` as null.
    #[serde(serialize_with = "bias_as_llama_server")]
    pub logit_bias: Vec<(i32, f32)>,
    pub seed: u64,
    /// Which of one request's choices this generation is: each draws from its own stream of
    /// the seed.
    #[serde(skip)]
    pub choice: u64,
}

fn bias_as_llama_server<S: serde::Serializer>(bias: &[(i32, f32)], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeSeq;
    let mut seq = s.serialize_seq(Some(bias.len()))?;
    for &(token, bias) in bias {
        // serde_json writes a non-finite float as null, as llama-server's nlohmann::json does
        seq.serialize_element(&serde_json::json!({ "token": token, "bias": bias }))?;
    }
    seq.end()
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repeat_last_n: 64,
            logit_bias: Vec::new(),
            seed: 0xD1F1A5,
            choice: 0,
        }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Whether the distribution depends on the history (a penalty is on).
    pub fn uses_history(&self) -> bool {
        self.repeat_last_n > 0
            && (self.repeat_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0)
    }

    /// p after `history` (only its tail within `repeat_last_n` matters).
    pub fn distribution(&self, logits: &[f32], history: &[i32]) -> Distribution {
        let tail = history.len().saturating_sub(self.repeat_last_n.max(0) as usize);
        target_distribution(logits, &history[tail..], self)
    }

    /// How far the greedy choice leads: its (penalised, biased) logit minus the runner-up's;
    /// infinite when nothing else is possible. A row whose logits may stray by more than half
    /// of this could choose differently.
    pub fn greedy_lead(&self, logits: &[f32], history: &[i32]) -> f32 {
        let tail = history.len().saturating_sub(self.repeat_last_n.max(0) as usize);
        let best = top_candidates(&PenalisedLogits::new(logits, &history[tail..], self), 2, f32::NEG_INFINITY);
        match best.as_slice() {
            [first, second, ..] => first.logit - second.logit,
            _ => f32::INFINITY,
        }
    }
}

/// A sparse distribution over token ids: only tokens with positive probability, most likely first
/// (ties by lower id), probabilities summing to 1.
#[derive(Debug, Clone, PartialEq)]
pub struct Distribution {
    pub ids: Vec<i32>,
    pub probs: Vec<f32>,
}

impl Distribution {
    /// The probability of `id`, 0 outside the support.
    pub fn prob(&self, id: i32) -> f32 {
        self.ids
            .iter()
            .position(|&t| t == id)
            .map_or(0.0, |i| self.probs[i])
    }

    /// Draws one token with exactly one uniform draw, whatever the support size, so the number of
    /// RNG draws never depends on the logits.
    pub fn sample(&self, rng: &mut impl Rng) -> i32 {
        let u: f64 = rng.gen();
        let mut cumulative = 0.0f64;
        for (&id, &p) in self.ids.iter().zip(&self.probs) {
            cumulative += f64::from(p);
            if u < cumulative {
                return id;
            }
        }
        // Rounding can leave the total a hair under u.
        *self
            .ids
            .last()
            .expect("a distribution has at least one token")
    }

    pub fn argmax(&self) -> i32 {
        self.ids[0]
    }
}

/// A committed token's log-probability and the likeliest alternatives at its position, from the
/// target's raw logits (before any sampler), as OpenAI and llama-server report them.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenProb {
    pub id: i32,
    pub logprob: f32,
    /// The `n` likeliest tokens, most likely first (ties by lower id).
    pub top: Vec<(i32, f32)>,
}

/// `id`'s log-softmax over `logits`, and the `n` likeliest tokens'.
pub fn token_probs(logits: &[f32], id: i32, n: usize) -> TokenProb {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let log_z = f64::from(max) + sum.ln();
    let logprob = |t: i32| (f64::from(logits[t as usize]) - log_z) as f32;
    let mut top: Vec<i32> = (0..logits.len() as i32).collect();
    let by_rank = |a: &i32, b: &i32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let n = n.min(top.len());
    if n > 0 && n < top.len() {
        top.select_nth_unstable_by(n - 1, by_rank);
    }
    top.truncate(n);
    top.sort_by(by_rank);
    TokenProb { id, logprob: logprob(id), top: top.into_iter().map(|t| (t, logprob(t))).collect() }
}

/// The distribution a llama.cpp user gets for these logits, `history` (the tokens the penalty
/// sampler has accepted, oldest first) and flags; see the module documentation for the chain.
pub fn target_distribution(
    logits: &[f32],
    history: &[i32],
    params: &SamplingParams,
) -> Distribution {
    assert!(!logits.is_empty(), "no logits to sample from");
    let logits = PenalisedLogits::new(logits, history, params);
    if params.is_greedy() {
        return Distribution {
            ids: vec![logits.argmax() as i32],
            probs: vec![1.0],
        };
    }
    let candidates = filtered_candidates(&logits, params);
    tempered_softmax(&candidates, params.temperature)
}

/// The logits with the repetition penalty applied, without copying the vocabulary: runs of untouched
/// logits between the few penalised tokens, each run scanned as a plain slice so the passes over the
/// vocabulary stay tight loops.
struct PenalisedLogits<'a> {
    logits: &'a [f32],
    /// The penalised logit of each distinct in-vocabulary token of the penalty window, sorted by id.
    penalised: Vec<(usize, f32)>,
}

impl<'a> PenalisedLogits<'a> {
    fn new(logits: &'a [f32], history: &[i32], params: &SamplingParams) -> Self {
        let in_vocab = |t: i32| usize::try_from(t).ok().filter(|&t| t < logits.len());
        // (id, bias, count in the penalty window), one entry per id, sorted by id
        let mut touched: Vec<(usize, f32, u32)> =
            params.logit_bias.iter().filter_map(|&(t, b)| Some((in_vocab(t)?, b, 0))).collect();
        if params.uses_history() {
            let window = &history[history.len().saturating_sub(params.repeat_last_n as usize)..];
            touched.extend(window.iter().filter_map(|&t| Some((in_vocab(t)?, 0.0, 1))));
        }
        if touched.is_empty() {
            return Self { logits, penalised: Vec::new() };
        }
        touched.sort_unstable_by_key(|&(id, ..)| id);
        touched.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                kept.1 += later.1;
                kept.2 += later.2;
            }
            same
        });
        let penalised = touched
            .into_iter()
            .map(|(id, bias, count)| {
                let mut logit = logits[id] + bias;
                if count > 0 {
                    // Dividing a negative logit would raise its probability, hence llama.cpp's sign split.
                    logit = if logit <= 0.0 { logit * params.repeat_penalty } else { logit / params.repeat_penalty };
                    logit -= count as f32 * params.frequency_penalty + params.presence_penalty;
                }
                (id, logit)
            })
            .collect();
        Self { logits, penalised }
    }

    /// Calls `visit(first_id, chunk)` over the whole vocabulary in id order: each run of untouched
    /// logits, and each penalised logit as a chunk of one.
    fn for_each_chunk(&self, mut visit: impl FnMut(usize, &[f32])) {
        let mut start = 0;
        for (id, logit) in &self.penalised {
            visit(start, &self.logits[start..*id]);
            visit(*id, std::slice::from_ref(logit));
            start = id + 1;
        }
        visit(start, &self.logits[start..]);
    }

    /// The highest logit; NaNs are ignored.
    fn max(&self) -> f32 {
        let mut max = f32::NEG_INFINITY;
        // A fold with f32::max vectorises, unlike a running argmax.
        self.for_each_chunk(|_, chunk| max = chunk.iter().copied().fold(max, f32::max));
        max
    }

    /// The first id holding the highest logit; llama.cpp's `temp <= 0` keeps exactly this token,
    /// which every earlier filter keeps too.
    fn argmax(&self) -> usize {
        let max = self.max();
        let mut first = None;
        self.for_each_chunk(|start, chunk| {
            if first.is_none() {
                first = chunk
                    .iter()
                    .position(|&logit| logit == max)
                    .map(|i| start + i);
            }
        });
        first.unwrap_or(0)
    }
}

/// A token and its (penalised) logit.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    id: i32,
    logit: f32,
}

/// Whether `a` ranks before `b`: higher logit first, then lower id.
fn rank(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// The `limit` best tokens with logit `>= floor`, best first, in one streaming pass: a buffer of
/// `2 * limit` is cut back to the best `limit` by partial selection whenever it fills, after which
/// only logits strictly above the current k-th can still enter (an equal one comes later, so has a
/// higher id and ranks below it). NaN logits never enter.
fn top_candidates(logits: &PenalisedLogits, limit: usize, floor: f32) -> Vec<Candidate> {
    let capacity = limit.saturating_mul(2);
    let mut buffer = Vec::with_capacity(capacity.min(logits.logits.len()));
    let mut cutoff = (floor, true);
    logits.for_each_chunk(|start, chunk| {
        // Kept in locals while scanning so the compiler holds them in registers.
        let (mut cutoff_logit, mut cutoff_inclusive) = cutoff;
        for (block_index, block) in chunk.chunks(SCAN_BLOCK).enumerate() {
            // A vectorised max rejects most blocks without looking at each token.
            if block.iter().copied().fold(f32::NEG_INFINITY, f32::max) < cutoff_logit {
                continue;
            }
            for (i, &logit) in block.iter().enumerate() {
                if logit < cutoff_logit
                    || !(cutoff_inclusive || logit > cutoff_logit)
                    || logit.is_nan()
                {
                    continue;
                }
                let id = start + block_index * SCAN_BLOCK + i;
                buffer.push(Candidate {
                    id: id as i32,
                    logit,
                });
                if buffer.len() == capacity {
                    buffer.select_nth_unstable_by(limit - 1, rank);
                    buffer.truncate(limit);
                    (cutoff_logit, cutoff_inclusive) = (buffer[limit - 1].logit, false);
                }
            }
        }
        cutoff = (cutoff_logit, cutoff_inclusive);
    });
    buffer.sort_unstable_by(rank);
    buffer.truncate(limit);
    buffer
}

/// Tokens per block in `top_candidates`' scan.
const SCAN_BLOCK: usize = 64;

/// Cuts the best-first `candidates` to the shortest prefix whose probability, `exp(logit - max) /
/// normaliser`, reaches `top_p` (llama.cpp's float arithmetic); returns false and keeps them all
/// when they fall short.
fn truncate_top_p(candidates: &mut Vec<Candidate>, normaliser: f32, top_p: f32) -> bool {
    let max = candidates[0].logit;
    let mut cumulative = 0.0f32;
    for (i, c) in candidates.iter().enumerate() {
        cumulative += (c.logit - max).exp() / normaliser;
        if cumulative >= top_p {
            candidates.truncate(i + 1);
            return true;
        }
    }
    false
}

/// The min_p cut on untempered logits, keeping at least the best token.
fn truncate_min_p(candidates: &mut Vec<Candidate>, min_p: f32) {
    if min_p <= 0.0 {
        return;
    }
    let floor = candidates[0].logit + min_p.ln();
    let keep = candidates
        .iter()
        .position(|c| c.logit < floor)
        .unwrap_or(candidates.len())
        .max(1);
    candidates.truncate(keep);
}

/// The top_p cut is located on a histogram of the probability mass by distance below the max
/// logit, in bins of this many nats ...
const TOP_P_BIN_NATS: f32 = 0.25;
/// ... this many of them, the last one taking everything further down.
const TOP_P_BINS: usize = 128;

/// The softmax normaliser of the whole vocabulary, summed in id order as llama.cpp's top_p does,
/// and a logit floor above which its top_p nucleus lies, so that only the nucleus needs sorting.
/// The floor sits one histogram bin below the bin where the mass reaches `top_p`, a margin for
/// llama.cpp's f32 running sum drifting from the histogram's f64 one.
fn normaliser_and_top_p_floor(logits: &PenalisedLogits, max: f32, top_p: f32) -> (f32, f32) {
    let mut normaliser = 0.0f32;
    let mut mass = [0.0f64; TOP_P_BINS];
    logits.for_each_chunk(|_, chunk| {
        for &logit in chunk {
            let weight = (logit - max).exp();
            normaliser += weight;
            // A float-to-int cast saturates, so -inf logits land in the last bin.
            mass[(((max - logit) / TOP_P_BIN_NATS) as usize).min(TOP_P_BINS - 1)] +=
                f64::from(weight);
        }
    });
    let target = f64::from(top_p) * mass.iter().sum::<f64>();
    let mut cumulative = 0.0;
    for (bin, bin_mass) in mass.iter().enumerate() {
        cumulative += bin_mass;
        if cumulative >= target {
            return (normaliser, max - (bin + 2) as f32 * TOP_P_BIN_NATS);
        }
    }
    (normaliser, f32::NEG_INFINITY)
}

/// The survivors of top_k, top_p and min_p, best first.
fn filtered_candidates(logits: &PenalisedLogits, params: &SamplingParams) -> Vec<Candidate> {
    let mut candidates = if params.top_k > 0 {
        let mut candidates = top_candidates(logits, params.top_k as usize, f32::NEG_INFINITY);
        if params.top_p < 1.0 {
            // llama.cpp's top_p softmax runs over the k survivors, summed best first.
            let max = candidates[0].logit;
            let normaliser: f32 = candidates.iter().map(|c| (c.logit - max).exp()).sum();
            truncate_top_p(&mut candidates, normaliser, params.top_p);
        }
        candidates
    } else {
        let max = logits.max();
        // top_p and min_p both keep a best-first prefix, and min_p's threshold only depends on the
        // max, which top_p keeps: both cuts can be applied as floors while collecting, before any
        // sorting. (min_p's is capped at the max, which min_p always keeps.)
        let min_p_floor = if params.min_p > 0.0 {
            max + params.min_p.ln().min(0.0)
        } else {
            f32::NEG_INFINITY
        };
        if params.top_p < 1.0 {
            let (normaliser, top_p_floor) = normaliser_and_top_p_floor(logits, max, params.top_p);
            let mut candidates = top_candidates(logits, usize::MAX, min_p_floor.max(top_p_floor));
            if !truncate_top_p(&mut candidates, normaliser, params.top_p)
                && top_p_floor > min_p_floor
            {
                // The margin fell short of llama.cpp's running sum: take all that min_p allows.
                candidates = top_candidates(logits, usize::MAX, min_p_floor);
                truncate_top_p(&mut candidates, normaliser, params.top_p);
            }
            candidates
        } else {
            top_candidates(logits, usize::MAX, min_p_floor)
        }
    };
    truncate_min_p(&mut candidates, params.min_p);
    candidates
}

/// llama.cpp's `temp` then `dist`: softmax of `logit / temperature`, weights in f32 and their sum in
/// f64. Tokens whose weight underflows to 0 can never be drawn and are dropped from the support.
fn tempered_softmax(candidates: &[Candidate], temperature: f32) -> Distribution {
    let max = candidates[0].logit / temperature;
    let weights: Vec<f32> = candidates
        .iter()
        .map(|c| (c.logit / temperature - max).exp())
        .collect();
    let support = weights
        .iter()
        .position(|&w| w == 0.0)
        .unwrap_or(weights.len());
    let total: f64 = weights[..support].iter().map(|&w| f64::from(w)).sum();
    Distribution {
        ids: candidates[..support].iter().map(|c| c.id).collect(),
        probs: weights[..support]
            .iter()
            .map(|&w| (f64::from(w) / total) as f32)
            .collect(),
    }
}

/// The target distribution of one generation plus its seeded random streams: plain and
/// speculative decoding both pick tokens through it, so both draw from the same p.
///
/// The draw that picks the i-th generated token comes from (seed, choice, i) alone, never from
/// a stream whose position depends on how many draws came before: however a cycle drafts and
/// verifies, a seed gives plain decoding's text. Drafting draws from a stream of its own.
pub struct Sampler {
    params: SamplingParams,
    drafting: rand_chacha::ChaCha8Rng,
}

/// log2 of the ChaCha words each generated token's draws may use (rejection sampling draws
/// two per tested draft from the anchor's window; a cycle tests at most a few dozen).
const WORDS_PER_TOKEN_LOG2: u32 = 20;

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let drafting = stream(&params, 1);
        Self { params, drafting }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    pub fn is_greedy(&self) -> bool {
        self.params.is_greedy()
    }

    pub fn uses_history(&self) -> bool {
        self.params.uses_history()
    }

    pub fn distribution(&self, logits: &[f32], history: &[i32]) -> Distribution {
        self.params.distribution(logits, history)
    }

    /// Draw generated token `index` (the argmax when greedy).
    pub fn pick(&self, logits: &[f32], history: &[i32], index: usize) -> i32 {
        let p = self.distribution(logits, history);
        if self.is_greedy() {
            p.argmax()
        } else {
            p.sample(&mut self.draws(index))
        }
    }

    /// The random stream of generated token `index`: its first draw is the one that picks it.
    pub fn draws(&self, index: usize) -> rand_chacha::ChaCha8Rng {
        let mut rng = stream(&self.params, 0);
        rng.set_word_pos((index as u128) << WORDS_PER_TOKEN_LOG2);
        rng
    }

    /// The stream drafts are drawn from (never the target's).
    pub fn drafting(&mut self) -> &mut rand_chacha::ChaCha8Rng {
        &mut self.drafting
    }
}

/// ChaCha stream `which` (0: the target's, 1: drafting) of this seed and choice.
fn stream(params: &SamplingParams, which: u64) -> rand_chacha::ChaCha8Rng {
    use rand::SeedableRng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(params.seed);
    rng.set_stream(params.choice.wrapping_mul(2) | which);
    rng
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn sampled(temperature: f32, top_k: i32, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            ..SamplingParams::default()
        }
    }

    fn assert_probs(dist: &Distribution, expected: &[(i32, f32)]) {
        assert_eq!(
            dist.ids,
            expected.iter().map(|e| e.0).collect::<Vec<_>>(),
            "{dist:?}"
        );
        for (&p, &(_, e)) in dist.probs.iter().zip(expected) {
            assert!((p - e).abs() < 1e-6, "{dist:?} vs {expected:?}");
        }
    }

    fn softmax(logits: &[f32]) -> Vec<f32> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let total: f32 = logits.iter().map(|l| (l - max).exp()).sum();
        logits.iter().map(|l| (l - max).exp() / total).collect()
    }

    /// Logits whose softmax is exactly these probabilities.
    fn logits_of(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    #[test]
    fn greedy_is_one_hot_on_the_first_argmax() {
        let params = SamplingParams::default();
        assert!(params.is_greedy());
        let dist = target_distribution(&[0.5, 3.0, -1.0, 3.0, 2.9], &[], &params);
        assert_eq!(
            dist,
            Distribution {
                ids: vec![1],
                probs: vec![1.0]
            }
        );
        assert_eq!(dist.argmax(), 1);
        assert_eq!(dist.prob(1), 1.0);
        assert_eq!(dist.prob(3), 0.0);
    }

    #[test]
    fn top_k_keeps_the_k_best_and_renormalises() {
        let logits = [1.0, 4.0, 2.0, 3.0, 0.0];
        let dist = target_distribution(&logits, &[], &sampled(1.0, 2, 1.0, 0.0));
        let p = softmax(&[4.0, 3.0]);
        assert_probs(&dist, &[(1, p[0]), (3, p[1])]);
    }

    #[test]
    fn top_k_breaks_ties_towards_the_lower_id() {
        let dist = target_distribution(&[1.0, 2.0, 2.0, 2.0], &[], &sampled(1.0, 2, 1.0, 0.0));
        assert_probs(&dist, &[(1, 0.5), (2, 0.5)]);
    }

    #[test]
    fn top_p_keeps_the_shortest_prefix_reaching_the_mass() {
        let logits = logits_of(&[0.15, 0.5, 0.05, 0.3]);
        let dist = target_distribution(&logits, &[], &sampled(1.0, 0, 0.75, 0.0));
        assert_probs(&dist, &[(1, 0.5 / 0.8), (3, 0.3 / 0.8)]);
        let dist = target_distribution(&logits, &[], &sampled(1.0, 0, 0.85, 0.0));
        assert_probs(&dist, &[(1, 0.5 / 0.95), (3, 0.3 / 0.95), (0, 0.15 / 0.95)]);
        let dist = target_distribution(&logits, &[], &sampled(1.0, 0, 0.4, 0.0));
        assert_probs(&dist, &[(1, 1.0)]);
    }

    #[test]
    fn top_p_measures_mass_after_top_k() {
        let logits = logits_of(&[0.4, 0.3, 0.2, 0.1]);
        // Over the whole vocabulary 0.4 < 0.5, so two tokens are needed ...
        let dist = target_distribution(&logits, &[], &sampled(1.0, 0, 0.5, 0.0));
        assert_eq!(dist.ids, vec![0, 1]);
        // ... but after top_k = 2 the best one alone has 4/7 of the mass.
        let dist = target_distribution(&logits, &[], &sampled(1.0, 2, 0.5, 0.0));
        assert_eq!(dist.ids, vec![0]);
    }

    #[test]
    fn min_p_drops_tokens_below_a_fraction_of_the_best() {
        let logits = logits_of(&[0.5, 0.3, 0.15, 0.05]);
        let dist = target_distribution(&logits, &[], &sampled(1.0, 0, 1.0, 0.2));
        assert_probs(&dist, &[(0, 0.5 / 0.95), (1, 0.3 / 0.95), (2, 0.15 / 0.95)]);
    }

    #[test]
    fn temperature_applies_after_min_p() {
        let logits = logits_of(&[0.5, 0.3, 0.15, 0.05]);
        let dist = target_distribution(&logits, &[], &sampled(2.0, 0, 1.0, 0.2));
        // Tempered first, token 3 would sit at 0.32 of the best and survive min_p = 0.2.
        let p = softmax(&[logits[0] / 2.0, logits[1] / 2.0, logits[2] / 2.0]);
        assert_probs(&dist, &[(0, p[0]), (1, p[1]), (2, p[2])]);
    }

    #[test]
    fn temperature_scales_logits() {
        let logits = [1.0, 0.0, 2.0];
        let dist = target_distribution(&logits, &[], &sampled(0.5, 0, 1.0, 0.0));
        let p = softmax(&[2.0, 0.0, 4.0]);
        assert_probs(&dist, &[(2, p[2]), (0, p[0]), (1, p[1])]);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits_once() {
        let logits = [2.0, -1.0, 0.5, 1.0];
        let params = SamplingParams {
            repeat_penalty: 2.0,
            repeat_last_n: 3,
            ..sampled(1.0, 0, 1.0, 0.0)
        };
        // The window is the last 3 tokens [1, 1, 3]: token 0 is outside it, token 1 counts once.
        let history = [0, 1, 1, 3];
        let dist = target_distribution(&logits, &history, &params);
        let p = softmax(&[2.0, -2.0, 0.5, 0.5]);
        assert_probs(&dist, &[(0, p[0]), (2, p[2]), (3, p[3]), (1, p[1])]);

        let greedy = SamplingParams {
            temperature: 0.0,
            ..params.clone()
        };
        assert_eq!(target_distribution(&[1.0, 1.5], &[1], &greedy).argmax(), 0);
        let no_window = SamplingParams {
            repeat_last_n: 0,
            ..params
        };
        assert_eq!(
            target_distribution(&logits, &history, &no_window).prob(1),
            softmax(&logits)[1]
        );
    }

    #[test]
    fn token_probs_are_the_log_softmax_of_the_raw_logits() {
        let logits = [1.0f32, 3.0, 3.0, -2.0];
        let p = softmax(&logits);
        let tp = token_probs(&logits, 0, 2);
        assert!((tp.logprob - p[0].ln()).abs() < 1e-6, "{tp:?}");
        assert_eq!(tp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2]); // tie: lower id first
        assert!((tp.top[0].1 - p[1].ln()).abs() < 1e-6);
        assert_eq!(token_probs(&logits, 3, 0).top, []);
        assert_eq!(token_probs(&logits, 3, 9).top.len(), 4);
    }

    #[test]
    fn logit_bias_comes_first_then_presence_and_frequency_per_count() {
        let logits = [2.0, 1.0, 0.5, -1.0];
        let params = SamplingParams {
            repeat_penalty: 2.0,
            presence_penalty: 0.25,
            frequency_penalty: 0.5,
            repeat_last_n: 4,
            // two entries for token 2 add up; token 3 is banned; out-of-vocabulary ids do nothing
            logit_bias: vec![(2, 1.0), (2, 1.0), (3, f32::NEG_INFINITY), (9, 5.0), (-1, 5.0)],
            ..sampled(1.0, 0, 1.0, 0.0)
        };
        // window [1, 1, 2, 0]: token 1 twice, tokens 0 and 2 once
        let history = [3, 1, 1, 2, 0];
        let dist = target_distribution(&logits, &history, &params);
        let t0 = 2.0 / 2.0 - 0.5 - 0.25; // divided (positive), one occurrence
        let t1 = 1.0 / 2.0 - 2.0 * 0.5 - 0.25; // two occurrences
        let t2 = (0.5 + 2.0) / 2.0 - 0.5 - 0.25; // biased before the penalty
        let p = softmax(&[t0, t1, t2]);
        assert_probs(&dist, &[(2, p[2]), (0, p[0]), (1, p[1])]);
        assert_eq!(dist.prob(3), 0.0, "a token biased by -inf is banned");
        // a bias alone (no penalty) still moves the greedy choice, with no history read
        let biased = SamplingParams { logit_bias: vec![(1, 2.0)], ..SamplingParams::default() };
        assert!(!biased.uses_history());
        assert_eq!(target_distribution(&logits, &[], &biased).argmax(), 1);
    }

    #[test]
    fn repetition_penalty_ignores_out_of_vocabulary_history() {
        let params = SamplingParams {
            repeat_penalty: 1.5,
            ..sampled(1.0, 0, 1.0, 0.0)
        };
        let with = target_distribution(&[1.0, 2.0], &[-1, 7, 1], &params);
        let only = target_distribution(&[1.0, 2.0], &[1], &params);
        assert_eq!(with, only);
    }

    #[test]
    fn underflowing_tokens_leave_the_support() {
        let dist = target_distribution(&[0.0, -200.0, 1.0], &[], &sampled(1.0, 0, 1.0, 0.0));
        assert_eq!(dist.ids, vec![2, 0]);
    }

    #[test]
    fn sample_follows_the_probabilities() {
        let dist = Distribution {
            ids: vec![7, 3, 9],
            probs: vec![0.6, 0.3, 0.1],
        };
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let draws = 100_000;
        let mut counts = [0usize; 3];
        for _ in 0..draws {
            let token = dist.sample(&mut rng);
            counts[dist.ids.iter().position(|&t| t == token).unwrap()] += 1;
        }
        for (c, p) in counts.iter().zip(&dist.probs) {
            assert!((*c as f32 / draws as f32 - p).abs() < 0.01, "{counts:?}");
        }
    }

    #[test]
    fn each_token_draws_from_its_seed_choice_and_position_alone() {
        let sampler = |seed, choice| Sampler::new(SamplingParams { seed, choice, ..SamplingParams::default() });
        let first = |seed, choice, index| -> u64 { sampler(seed, choice).draws(index).gen() };
        let mut s = sampler(7, 0);
        let drafted: u64 = s.drafting().gen();
        // drafting's draws move nothing of the target's, and no draw moves a later one
        assert_eq!(s.draws(3).gen::<u64>(), first(7, 0, 3));
        let keyed = [first(7, 0, 3), first(7, 0, 4), first(7, 1, 3), first(8, 0, 3), first(7, 0, 0)];
        let distinct: std::collections::HashSet<u64> = keyed.iter().copied().chain([drafted]).collect();
        assert_eq!(distinct.len(), keyed.len() + 1, "{keyed:?} {drafted}");
    }

    /// The chain written the obvious way: copy, penalise, sort everything, cut, softmax.
    fn reference_distribution(
        logits: &[f32],
        history: &[i32],
        params: &SamplingParams,
    ) -> Distribution {
        let mut penalised = logits.to_vec();
        let window = &history[history
            .len()
            .saturating_sub(params.repeat_last_n.max(0) as usize)..];
        let mut seen = std::collections::HashSet::new();
        for &t in window {
            if seen.insert(t) {
                let l = &mut penalised[t as usize];
                *l = if *l <= 0.0 {
                    *l * params.repeat_penalty
                } else {
                    *l / params.repeat_penalty
                };
            }
        }
        let mut all: Vec<Candidate> = penalised
            .iter()
            .enumerate()
            .map(|(id, &logit)| Candidate {
                id: id as i32,
                logit,
            })
            .collect();
        let normaliser_in_id_order = {
            let max = penalised.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            penalised.iter().map(|l| (l - max).exp()).sum::<f32>()
        };
        all.sort_by(rank);
        if params.top_k > 0 {
            all.truncate(params.top_k as usize);
        }
        if params.top_p < 1.0 {
            let normaliser = if params.top_k > 0 {
                all.iter().map(|c| (c.logit - all[0].logit).exp()).sum()
            } else {
                normaliser_in_id_order
            };
            truncate_top_p(&mut all, normaliser, params.top_p);
        }
        if params.min_p > 0.0 {
            let floor = all[0].logit + params.min_p.ln();
            let keep = all.iter().take_while(|c| c.logit >= floor).count().max(1);
            all.truncate(keep);
        }
        tempered_softmax(&all, params.temperature)
    }

    #[test]
    fn fast_paths_match_the_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(42);
        // Small and real vocabularies, flat logits (a nucleus spanning most of the vocabulary) and
        // peaked ones.
        for (vocab, scale) in [20usize, 300, 50_000]
            .into_iter()
            .flat_map(|v| [(v, 0.3f32), (v, 1.0), (v, 4.0)])
        {
            let history: Vec<i32> = (0..100).map(|_| rng.gen_range(0..vocab as i32)).collect();
            let logits: Vec<f32> = (0..vocab)
                .map(|_| scale * (rng.gen::<f32>() + rng.gen::<f32>() - 1.0) * 3.0)
                .collect();
            for (top_k, top_p, min_p) in [
                (40, 0.95, 0.05),
                (0, 0.95, 0.05),
                (0, 0.9, 0.0),
                // So close to 1 that the top_p floor's margin falls short and min_p's is used.
                (0, 0.9999999, 0.0),
                (0, 0.9999999, 0.01),
                (0, 1.0, 0.05),
                (0, 1.0, 0.0),
                (1000, 0.8, 0.0),
                (3, 1.0, 0.0),
            ] {
                for repeat_penalty in [1.0, 1.3] {
                    let params = SamplingParams {
                        repeat_penalty,
                        ..sampled(0.7, top_k, top_p, min_p)
                    };
                    let fast = target_distribution(&logits, &history, &params);
                    let reference = reference_distribution(&logits, &history, &params);
                    assert_eq!(
                        fast, reference,
                        "vocab {vocab} scale {scale} params {params:?}"
                    );
                    let total: f64 = fast.probs.iter().map(|&p| f64::from(p)).sum();
                    assert!((total - 1.0).abs() < 1e-4, "{total}");
                }
            }
        }
    }
}
