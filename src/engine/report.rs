//! What the engine reports as it goes: a prompt's progress, and each cycle's times (to every
//! run's statistics) and its verdict on the drafter call (to the cost model).
use super::run::Run;
use crate::draft::cost::CostModel;
pub use crate::draft::source::ms_since;
use crate::llama::{Context, Result, Token};
use crate::sampling::{token_probs, TokenProb};
use crate::verify::Drafted;
use std::time::Instant;

/// How far a prompt's decoding is (llama-server's `prompt_progress`): of `total` prompt tokens,
/// `cache` came from the slot's cache and `processed` (the cached ones included) are done.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct PromptProgress {
    pub total: usize,
    pub cache: usize,
    pub processed: usize,
    #[serde(rename = "time_ms")]
    pub ms: f64,
}

impl PromptProgress {
    /// The report of a prompt of `total` tokens, `cache` of them cached, begun at `t_start`,
    /// once `processed` are done (the report before the first decode has taken no time yet).
    pub(super) fn reporter(total: usize, cache: usize, t_start: Instant) -> impl Fn(usize) -> Self {
        move |processed| Self { total, cache, processed, ms: if processed == cache { 0.0 } else { ms_since(t_start) } }
    }
}

/// One cycle's clock and the tokens it owes to the drafter call: every run is charged the
/// cycle's draft and verify time and its own host time, and, where the cycle drafted, what it
/// got against a plain step's share (its credit, `draft::sharing`); the cost model weighs the
/// cycle against plain decoding where a drafter call it judges was made.
pub(super) struct Cycle {
    t0: Instant,
    mark: Instant,
    draft_ms: f64,
    host_ms: f64,
    verify_ms: f64,
    /// Committed tokens the drafter call is credited with, and whether one was made.
    credited: usize,
    judged: bool,
    n_runs: usize,
    /// A plain step of the cycle's runs, where the cycle did more (a drafter decode or drafted rows).
    plain_ms: Option<f64>,
}

impl Cycle {
    pub fn start() -> Self {
        let now = Instant::now();
        Self { t0: now, mark: now, draft_ms: 0.0, host_ms: 0.0, verify_ms: 0.0, credited: 0, judged: false, n_runs: 0, plain_ms: None }
    }

    fn lap(&mut self) -> f64 {
        let now = Instant::now();
        let ms = (now - self.mark).as_secs_f64() * 1e3;
        self.mark = now;
        ms
    }

    pub fn drafted(&mut self) {
        self.draft_ms = self.lap();
    }

    pub fn laid_out(&mut self) {
        self.host_ms = self.lap();
    }

    /// The verify decode of `batch` rows is done; `plain`: the number of runs in it, where the
    /// cycle drafted (a plain cycle leaves every run's credit as it is).
    pub fn verified(&mut self, cost: &mut CostModel, batch: usize, plain: Option<usize>) {
        self.verify_ms = self.lap();
        cost.record_verify(batch, self.verify_ms);
        self.plain_ms = plain.and_then(|n| cost.verify_cost(n));
    }

    /// One run's share, once its tokens are committed: `committed` tokens (`free` of them from
    /// sources that cost no call), its commit begun at `t` (a re-decode in it counts as verify
    /// time, already in its statistics); `judged`: it drafted with a drafter call.
    pub fn report(&mut self, run: &mut Run, t: Instant, redecode_ms: f64, committed: usize, free: usize, judged: bool) {
        // The look-up's tokens would have been taken without the drafter call: a drafter whose
        // cycles pay only through them is not paying.
        self.credited += committed.saturating_sub(if judged { free } else { 0 });
        // A draft that was not worth verifying still cost a drafter call.
        self.judged |= judged;
        self.n_runs += 1;
        if let Some(plain) = self.plain_ms {
            // A debt is not carried: a drafter call that did not pay would otherwise stop every
            // draft of the batch until the run won it back.
            run.credit = (run.credit + committed as f64 - (self.draft_ms + self.host_ms + self.verify_ms) / plain).max(0.0);
        }
        let s = &mut run.stats;
        s.draft_ms += self.draft_ms;
        s.verify_ms += self.verify_ms;
        s.host_ms += self.host_ms + ms_since(t) - redecode_ms;
    }

    /// The cost model's verdict on the cycle's drafter call, if one was made.
    pub fn close(self, cost: &mut CostModel) {
        if self.judged {
            cost.record_cycle(self.credited, self.n_runs, ms_since(self.t0));
        }
    }
}

/// The log-probabilities of a cycle's committed tokens, when asked for (`n`: alternatives per
/// token), each read from the target row that chose it, before a re-decode replaces the rows.
pub(super) struct Probs {
    n: Option<usize>,
    pub out: Vec<TokenProb>,
}

impl Probs {
    pub fn new(n: Option<usize>) -> Self {
        Self { n, out: Vec::new() }
    }

    /// Nodes of `d` chosen on the verify batch's rows (each by its parent's row).
    pub fn chosen(&mut self, target: &Context, d: &Drafted, nodes: &[usize]) -> Result<()> {
        let Some(n) = self.n else { return Ok(()) };
        for &i in nodes {
            let row = d.tree.nodes[i].parent.map_or(0, |q| q + 1);
            self.out.push(token_probs(target.logits(d.row0 + row)?, d.tree.nodes[i].token, n));
        }
        Ok(())
    }

    /// A re-decoded side branch whose nodes `kept` sit at rows `0..` of the last decode (the
    /// first already reported, each next one chosen by the row before it), and `next` after it.
    pub fn redecoded(&mut self, target: &Context, d: &Drafted, kept: &[usize], next: Token) -> Result<()> {
        let Some(n) = self.n else { return Ok(()) };
        for (k, &i) in kept.iter().enumerate().skip(1) {
            self.out.push(token_probs(target.logits(k - 1)?, d.tree.nodes[i].token, n));
        }
        self.out.push(token_probs(target.logits(kept.len() - 1)?, next, n));
        Ok(())
    }

    /// The target's own `next` token after the accepted `path` of the verify batch, unless a
    /// re-decode reported it.
    pub fn next(&mut self, target: &Context, d: &Drafted, path: &[usize], next: Token) -> Result<()> {
        if let (Some(n), true) = (self.n, self.out.len() == path.len()) {
            let row = path.last().map_or(0, |&i| i + 1);
            self.out.push(token_probs(target.logits(d.row0 + row)?, next, n));
        }
        Ok(())
    }
}
