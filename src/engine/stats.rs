//! Counters and timings of one generation.
use crate::draft::source::{Prediction, Proposal};
use crate::draft::Origin;

/// Counters and timings of one generation.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Stats {
    pub n_prompt: usize,
    /// Prompt tokens decoded (the rest came from the cache).
    pub n_prompt_decoded: usize,
    pub n_generated: usize,
    /// Target verify decodes (plain steps included, one token each).
    pub cycles: usize,
    /// Tokens committed by those cycles (bonus included).
    pub cycle_tokens: usize,
    pub n_drafted: usize,
    pub n_draft_accepted: usize,
    /// `accepted_hist[n]`: speculative cycles that accepted exactly `n` drafted tokens.
    pub accepted_hist: Vec<usize>,
    /// Accepted tree tokens decoded a second time to keep the cache in position order.
    pub redecoded: usize,
    /// Verify rows too close to call on a target whose batches are not bit-exact: the cycle
    /// was cut there and the row's token decided by a single step (the near-tie guard).
    pub near_ties: usize,
    /// Drafter calls (a drafter decode may serve several slots at once).
    pub n_draft_calls: usize,
    /// Block positions those calls drafted (under `--block auto`, as deep as the verifies
    /// have lately taken the drafter's tokens in).
    pub n_draft_positions: usize,
    /// How the drafter's predicted acceptance held where it drafted alone.
    #[serde(flatten)]
    pub prediction: Prediction,
    /// Drafter outputs with ids outside the vocabulary or scores that are not numbers,
    /// repaired before selection (a drafter gone wrong; the output stays the target's).
    pub repaired_lattices: usize,
    /// Per origin: what the drafting models (the DFlash drafter, llama.cpp's drivers) and the
    /// context look-up proposed and the target took (a node both proposed counts for both).
    pub from_drafter: SourceStats,
    pub from_lookup: SourceStats,
    pub prefill_ms: f64,
    pub draft_ms: f64,
    pub verify_ms: f64,
    pub host_ms: f64,
    pub total_ms: f64,
}

/// What one origin of drafts proposed and what the target took.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SourceStats {
    /// Cycles whose verified draft held tokens of this origin.
    pub cycles: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// Time spent drafting (the drafter's calls; the look-up's index and queries).
    pub ms: f64,
}

impl Stats {
    /// Mean tokens committed per target verify, bonus included.
    pub fn tau(&self) -> f64 {
        if self.cycles == 0 {
            0.0
        } else {
            self.cycle_tokens as f64 / self.cycles as f64
        }
    }

    /// Generation speed after the prompt (the first token comes from the prefill).
    pub fn tokens_per_second(&self) -> f64 {
        let ms = self.total_ms - self.prefill_ms;
        if ms <= 0.0 {
            0.0
        } else {
            self.n_generated.saturating_sub(1) as f64 * 1000.0 / ms
        }
    }

    /// A verify decode that committed `committed` tokens, `accepted` of them drafted.
    pub(super) fn record_verify(&mut self, drafted: usize, accepted: usize, committed: usize) {
        self.cycles += 1;
        self.cycle_tokens += committed;
        self.n_drafted += drafted;
        self.n_draft_accepted += accepted;
        if drafted == 0 {
            return; // a plain step: nothing was proposed
        }
        if self.accepted_hist.len() <= accepted {
            self.accepted_hist.resize(accepted + 1, 0);
        }
        self.accepted_hist[accepted] += 1;
    }

    /// What making `p` cost, its source's tokens tagged `origin`.
    pub(super) fn record_proposal(&mut self, p: &Proposal, origin: Origin) {
        self.n_draft_calls += p.calls;
        self.n_draft_positions += p.positions;
        self.repaired_lattices += usize::from(p.repaired);
        match origin {
            Origin::Lookup => self.from_lookup.ms += p.ms,
            Origin::Drafter | Origin::Both => self.from_drafter.ms += p.ms,
        }
    }

    /// Count what each origin proposed in `tree` and what the target took of it (`path`).
    pub(super) fn record_origins(&mut self, tree: &crate::draft::DraftTree, path: &[usize]) {
        let mut taken = vec![false; tree.len()];
        path.iter().for_each(|&i| taken[i] = true);
        for (stats, of) in [(&mut self.from_drafter, Origin::from_drafter as fn(Origin) -> bool), (&mut self.from_lookup, Origin::from_lookup)] {
            let drafted = tree.nodes.iter().filter(|n| of(n.origin)).count();
            stats.cycles += (drafted > 0) as usize;
            stats.drafted += drafted;
            stats.accepted += tree.nodes.iter().zip(&taken).filter(|(n, &t)| t && of(n.origin)).count();
        }
    }
}
