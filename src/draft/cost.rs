//! How many tokens to draft and verify, from measured costs and predicted acceptance.
//!
//! On a CPU, verifying b tokens costs far more than one step (a batch of 16 can cost
//! 8-20 plain steps), and a drafter call costs one or two steps, so the draft length
//! must follow what this machine measures. Costs are kept as moving averages of real
//! decodes; the acceptance the lattice predicts is calibrated against what the target
//! actually accepts; and when drafting stops paying, the engine decodes plainly and
//! only probes the drafter now and then.
use super::sharing::{self, Share};
use super::{DraftTree, Origin};
use crate::llama::{Batch, Context, Result, Token};
use std::time::Instant;

/// Exponential moving average that starts at its first sample.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ema {
    value: Option<f64>,
}

impl Ema {
    const ALPHA: f64 = 0.2;

    pub fn add(&mut self, x: f64) {
        self.value = Some(match self.value {
            None => x,
            Some(v) => v + Self::ALPHA * (x - v),
        });
    }

    pub fn get(&self) -> Option<f64> {
        self.value
    }
}

/// Longest plain stretch between two probes of a drafter that does not pay, at least.
const MAX_PROBE_INTERVAL: usize = 64;
/// Probes of a drafter that does not pay may cost this share of plain decoding, at most.
const PROBE_BUDGET: f64 = 0.02;
/// Shallowest block the drafter drafts when the length is adaptive: a block of 4 rows.
/// Below it a call costs nearly the same (its weights are read whatever the rows).
const MIN_DRAFT_DEPTH: usize = 3;
/// Verifies whose depth sets the next block: two, so one short verify does not cut a block
/// that is usually taken deep, yet a drafter off but probed now and then is cut after two
/// probes whose drafts were not verified.
const USED_DEPTH_WINDOW: usize = 2;

#[derive(Debug, Clone, Default)]
pub struct CostModel {
    /// `verify_ms[b]`: a target decode of `b` tokens.
    verify_ms: Vec<Ema>,
    /// One drafter block (plus the injection of the rows before it).
    draft_ms: Ema,
    /// Per depth k (1-based at index k-1): observed / predicted acceptance to depth k.
    observed: Vec<Ema>,
    predicted: Vec<Ema>,
    /// Drafted tokens the target took per drafter call, lately.
    drafter_accepted: Ema,
    /// Depth of the drafter's tokens the last verifies took in, newest last (a verify that
    /// took the whole block counts twice its depth: it might have taken more).
    used_depths: Vec<usize>,
    /// Realised speed of speculative cycles relative to plain decoding of the same
    /// number of sequences (above 1: drafting pays).
    spec_gain: Ema,
    /// Time a speculative cycle took beyond what plain steps would have taken for the
    /// tokens it committed (its drafter call plus the verify of rows it lost), lately.
    cycle_loss_ms: Ema,
    /// Plain steps left before the next probe, and the current interval.
    plain_left: usize,
    probe_interval: usize,
}

impl CostModel {
    pub fn record_verify(&mut self, batch: usize, ms: f64) {
        if self.verify_ms.len() <= batch {
            self.verify_ms.resize(batch + 1, Ema::default());
        }
        self.verify_ms[batch].add(ms);
    }

    pub fn record_draft(&mut self, ms: f64) {
        self.draft_ms.add(ms);
    }

    fn is_calibrated(&self, max_batch: usize) -> bool {
        self.verify_ms.len() > max_batch && self.verify_ms[1].get().is_some() && self.verify_ms[max_batch].get().is_some()
    }

    /// Time target decodes of the batch sizes a cycle may verify (1, 2, 4, ... and `max_batch`
    /// rows of `token` at positions `pos0..` of `seq`), so the first cycles already choose their
    /// length from this machine's costs. The cells are removed again.
    pub fn calibrate(&mut self, target: &mut Context, batch: &mut Batch, seq: i32, pos0: usize, token: Token, max_batch: usize) -> Result<()> {
        if self.is_calibrated(max_batch) || max_batch < 2 {
            return Ok(());
        }
        let mut sizes: Vec<usize> = std::iter::successors(Some(1usize), |b| Some(b * 2)).take_while(|&b| b < max_batch).collect();
        sizes.push(max_batch);
        for &b in &sizes {
            for rep in 0..2 {
                batch.clear();
                for i in 0..b {
                    batch.add_token(token, (pos0 + i) as i32, &[seq], true)?;
                }
                let t = Instant::now();
                target.decode(batch, "cost calibration")?;
                // The first run of a size warms up (graph allocation): keep the second.
                if rep == 1 {
                    self.record_verify(b, t.elapsed().as_secs_f64() * 1e3);
                }
                target.seq_rm(seq, pos0 as i32, -1)?;
            }
        }
        Ok(())
    }

    /// Cost of verifying `batch` tokens: measured, or interpolated between measured sizes.
    pub fn verify_cost(&self, batch: usize) -> Option<f64> {
        if let Some(v) = self.verify_ms.get(batch).and_then(|e| e.get()) {
            return Some(v);
        }
        let below = (1..batch.min(self.verify_ms.len())).rev().find_map(|b| Some((b, self.verify_ms[b].get()?)));
        let above = (batch + 1..self.verify_ms.len()).find_map(|b| Some((b, self.verify_ms[b].get()?)));
        match (below, above) {
            (Some((b0, v0)), Some((b1, v1))) => Some(v0 + (v1 - v0) * (batch - b0) as f64 / (b1 - b0) as f64),
            (Some((b0, v0)), None) => Some(v0 * batch as f64 / b0 as f64),
            (None, Some((b1, v1))) => Some(v1 * batch as f64 / b1 as f64),
            (None, None) => None,
        }
    }

    /// Acceptance to depth k predicted by the drafter, corrected by what was observed.
    fn calibrated(&self, k: usize, p: f64) -> f64 {
        match (self.observed.get(k).and_then(|e| e.get()), self.predicted.get(k).and_then(|e| e.get())) {
            (Some(o), Some(q)) if q > 1e-6 => (p * (o / q).clamp(0.02, 4.0)).min(1.0),
            _ => p,
        }
    }

    /// Node k's chance of being accepted: its path probability `gain`, corrected by the
    /// drafter's calibration where the drafter alone proposed it (the look-up's estimates
    /// are calibrated where they are made).
    fn node_gain(&self, tree: &DraftTree, k: usize, gain: f32) -> f64 {
        let n = &tree.nodes[k];
        match n.origin {
            Origin::Drafter => self.calibrated(n.depth - 1, gain as f64),
            Origin::Lookup | Origin::Both => gain as f64,
        }
    }

    /// Drafted tokens the target is expected to take from `tree` (its path
    /// probabilities, calibrated).
    pub fn expected_accepted(&self, tree: &DraftTree) -> f64 {
        self.node_gains(tree).iter().sum()
    }

    /// Expected tokens each node of `tree` adds: its path probability, calibrated.
    pub fn node_gains(&self, tree: &DraftTree) -> Vec<f64> {
        tree.gains().iter().enumerate().map(|(k, &g)| self.node_gain(tree, k, g)).collect()
    }

    /// How many nodes of `tree` (best first, parents first: any prefix is a valid draft) a run
    /// verifying alone should verify (0: a plain step), and the tokens per millisecond of
    /// verify it expects (infinite before any cost is measured). The draft itself is already
    /// paid for: this maximises tokens per verify time. (Several runs: [`super::sharing`].)
    pub fn best_len(&self, tree: &DraftTree) -> (usize, f64) {
        let a = sharing::allot(self, &[Share { gains: self.node_gains(tree), adaptive: true, credit: 0.0 }]);
        (a.lengths[0], a.rate)
    }

    /// Record how many drafted tokens the target took after a drafter call.
    pub fn record_drafter_accepted(&mut self, accepted: usize) {
        self.drafter_accepted.add(accepted as f64);
    }

    /// Drafted tokens the target took per drafter call, lately (infinite before the
    /// first call: nothing is known to beat it).
    pub fn drafter_expected(&self) -> f64 {
        self.drafter_accepted.get().unwrap_or(f64::INFINITY)
    }

    /// How deep the drafter should draft, at most `max`: twice the deepest the last
    /// verifies took its drafts in, at least [`MIN_DRAFT_DEPTH`]. A call's cost grows with
    /// its rows (on a CPU a block of 16 costs twice a block of 4), so the block ends where
    /// its tail would not be verified anyway; it deepens again as soon as a verify takes
    /// it whole.
    pub fn draft_depth(&self, max: usize) -> usize {
        match self.used_depths.iter().max() {
            None => max,
            Some(&d) => (2 * d).max(MIN_DRAFT_DEPTH).min(max),
        }
    }

    /// Record how deep a verify takes in a drafter's block of `drafted` positions, drafted
    /// for a run whose block allows `max`. A block taken whole that was shallower than
    /// [`CostModel::draft_depth`] wanted (the run's end or its context cut it) says nothing.
    pub fn record_used_depth(&mut self, drafted: usize, max: usize, used: usize) {
        if used >= drafted && drafted < self.draft_depth(max) {
            return;
        }
        if self.used_depths.len() == USED_DEPTH_WINDOW {
            self.used_depths.remove(0);
        }
        self.used_depths.push(if used >= drafted { 2 * drafted } else { used });
    }

    /// Record one verified draft: `path_probs` as predicted, `accepted` drafted tokens taken.
    pub fn record_acceptance(&mut self, path_probs: &[f32], accepted: usize) {
        if self.observed.len() < path_probs.len() {
            self.observed.resize(path_probs.len(), Ema::default());
            self.predicted.resize(path_probs.len(), Ema::default());
        }
        for (k, &p) in path_probs.iter().enumerate() {
            self.predicted[k].add(p as f64);
            self.observed[k].add(if accepted > k { 1.0 } else { 0.0 });
        }
    }

    /// Record a whole speculative cycle: `tokens` committed for `n_seqs` sequences in `ms`.
    pub fn record_cycle(&mut self, tokens: usize, n_seqs: usize, ms: f64) {
        if let Some(plain) = self.verify_cost(n_seqs) {
            let plain_rate = n_seqs as f64 / plain;
            self.spec_gain.add(tokens as f64 / ms.max(1e-3) / plain_rate);
            self.cycle_loss_ms.add((ms - tokens as f64 / plain_rate).max(0.0));
        }
    }

    /// Whether the next cycle should draft. Drafting continues while its realised rate
    /// beats plain decoding; otherwise plain steps run, with a probe after an interval
    /// that doubles each time the probe does not pay.
    pub fn should_draft(&mut self) -> bool {
        let Some(gain) = self.spec_gain.get() else { return true };
        if gain >= 1.0 {
            self.probe_interval = 0;
            return true;
        }
        if self.plain_left > 0 {
            self.plain_left -= 1;
            return false;
        }
        // Probe now, and wait longer before the next probe if this one fails too, until
        // probes cost at most PROBE_BUDGET of the plain steps between them. A failed probe
        // costs its drafter call and the verify of the rows it lost: the cycles' measured loss.
        let probe_cost = match (self.cycle_loss_ms.get(), self.draft_ms.get()) {
            (Some(loss), Some(draft)) => Some(loss.max(draft)),
            (loss, draft) => loss.or(draft),
        };
        let budget_interval = match (probe_cost, self.verify_cost(1)) {
            (Some(cost), Some(plain)) => (cost / (plain * PROBE_BUDGET)).ceil() as usize,
            _ => 0,
        };
        self.probe_interval = (self.probe_interval * 2).clamp(4, MAX_PROBE_INTERVAL.max(budget_interval));
        self.plain_left = self.probe_interval;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(costs: &[(usize, f64)]) -> CostModel {
        let mut m = CostModel::default();
        for &(b, ms) in costs {
            m.record_verify(b, ms);
        }
        m
    }

    #[test]
    fn verify_cost_interpolates_between_measured_sizes() {
        let m = model(&[(1, 10.0), (4, 16.0), (8, 40.0)]);
        assert_eq!(m.verify_cost(4), Some(16.0));
        assert_eq!(m.verify_cost(2), Some(12.0));
        assert_eq!(m.verify_cost(6), Some(28.0));
        assert_eq!(m.verify_cost(16), Some(80.0));
    }

    /// A chain whose per-step acceptance is `steps`, and its path probabilities.
    fn chain(steps: &[f32]) -> (Vec<f32>, DraftTree) {
        let mut tree = DraftTree::chain(&vec![0; steps.len()]);
        for (n, &q) in tree.nodes.iter_mut().zip(steps) {
            n.q = q;
        }
        (tree.gains(), tree)
    }

    fn choose(m: &CostModel, steps: &[f32]) -> usize {
        let (_, tree) = chain(steps);
        m.best_len(&tree).0
    }

    #[test]
    fn cheap_batches_and_confident_drafts_verify_long() {
        // Batches almost as cheap as one step: verify everything that is likely.
        let m = model(&[(1, 10.0), (16, 12.0)]);
        assert_eq!(choose(&m, &[0.99; 15]), 15);
    }

    #[test]
    fn linear_costs_or_hopeless_drafts_verify_nothing() {
        // Each extra token costs a full step: a draft only pays if it is certain.
        let m = model(&[(1, 10.0), (16, 160.0)]);
        assert_eq!(choose(&m, &[0.5; 15]), 0);
        let m = model(&[(1, 10.0), (16, 14.0)]);
        assert_eq!(choose(&m, &[0.001; 15]), 0);
    }

    #[test]
    fn the_length_balances_cost_against_acceptance() {
        let m = model(&[(1, 10.0), (2, 11.0), (3, 12.0), (4, 30.0)]);
        // Depth 1 and 2 are likely and cheap; depth 3 costs a big jump for little.
        assert_eq!(choose(&m, &[0.9, 0.9, 0.3]), 2);
    }

    #[test]
    fn calibration_corrects_an_overconfident_drafter() {
        let mut m = model(&[(1, 10.0), (2, 12.0), (3, 14.0)]);
        assert_eq!(choose(&m, &[0.9, 0.9]), 2);
        let (gains, _) = chain(&[0.9, 0.9]);
        for _ in 0..50 {
            m.record_acceptance(&gains, 0);
        }
        assert_eq!(choose(&m, &[0.9, 0.9]), 0);
    }

    #[test]
    fn an_expensive_useless_drafter_is_probed_rarely() {
        let mut m = model(&[(1, 1.0)]);
        m.record_draft(10.0); // a draft costs ten plain steps
        m.record_cycle(1, 1, 11.0);
        let probes = (0..3000).filter(|_| m.should_draft()).count();
        // Probe intervals grow to 10 / (1 * 0.02) = 500 steps.
        assert!(probes <= 14, "{probes} probes in 3000 steps");
    }

    #[test]
    fn a_probe_that_loses_its_verify_too_is_counted_whole() {
        // A cheap drafter call (a fifth of a step) whose drafts are rejected after a verify
        // of several rows: each probe cycle commits 1 token in 3 steps' time.
        let mut m = model(&[(1, 10.0)]);
        m.record_draft(2.0);
        m.record_cycle(1, 1, 30.0);
        let probes = (0..3000).filter(|_| m.should_draft()).count();
        // Each probe loses 20 ms = 2 steps: intervals grow to 2 / 0.02 = 100 steps, not the
        // 64 (at least) that the drafter call alone would give.
        assert!((30..=36).contains(&probes), "{probes} probes in 3000 steps");
    }

    #[test]
    fn the_drafter_drafts_as_deep_as_verifies_take_it() {
        let mut m = CostModel::default();
        assert_eq!(m.draft_depth(15), 15, "nothing measured: the whole block");
        m.record_used_depth(15, 15, 6);
        m.record_used_depth(15, 15, 0);
        assert_eq!(m.draft_depth(15), 12, "one short verify does not cut the block to nothing");
        m.record_used_depth(12, 15, 0);
        assert_eq!(m.draft_depth(15), MIN_DRAFT_DEPTH, "drafts no longer verified: the shallowest block");
        assert_eq!(m.draft_depth(2), 2, "never beyond the run's own block");
        m.record_used_depth(3, 15, 3);
        assert_eq!(m.draft_depth(15), 12, "a verify that took the whole block: twice as deep");
        m.record_used_depth(12, 15, 12);
        assert_eq!(m.draft_depth(15), 15);
        m.record_used_depth(15, 15, 4);
        m.record_used_depth(15, 15, 4);
        assert_eq!(m.draft_depth(15), 8, "verifies taking 4 tokens: a block twice as deep");
        m.record_used_depth(5, 15, 5);
        assert_eq!(m.draft_depth(15), 8, "a block the run's end cut short, taken whole: nothing learned");
    }

    #[test]
    fn a_drafter_that_does_not_pay_is_probed_with_growing_intervals() {
        let mut m = model(&[(1, 10.0)]);
        m.record_cycle(1, 1, 30.0); // 1 token in 30 ms: worse than 1 in 10 ms
        let pattern: Vec<bool> = (0..40).map(|_| m.should_draft()).collect();
        let probes: Vec<usize> = pattern.iter().enumerate().filter(|(_, &d)| d).map(|(i, _)| i).collect();
        assert_eq!(probes, vec![0, 5, 14, 31]);
        m.record_cycle(10, 1, 30.0);
        m.record_cycle(10, 1, 30.0);
        m.record_cycle(10, 1, 30.0);
        assert!(m.should_draft() && m.should_draft(), "a paying drafter drafts every cycle");
    }
}
