//! Speculation under load: the rows of one verify batch shared among the runs decoded in it.
//!
//! Alone, a run verifies the prefix of its draft that gives the most tokens per verify time. With
//! several slots busy the other runs' rows already fill the decode: k more rows cost what the
//! batch grows by (on a CPU nearly a step per row once a batch holds a few), and every run waits
//! for the whole batch. So the lengths are chosen together, for the most expected tokens per
//! millisecond of the shared decode, under one rule of fairness: no run may expect from a cycle
//! less than plain decoding would give it in the cycle's time, beyond what it is already ahead
//! of plain decoding (its credit). A run that decodes plainly, or whose drafts have not paid, has
//! no credit to spend: others' drafts never slow it. As slots fill, drafts shrink and stop; they
//! come back as slots empty. With one run this is the single-sequence rule, unchanged.
use super::cost::CostModel;

/// Expected tokens a run may fall short of its plain share in one cycle, for the noise of the
/// cost estimates (a row that costs nothing measurable, as on a GPU, is not refused for it).
const NOISE: f64 = 0.02;

/// One run's part of a verify batch, as the allotment sees it.
#[derive(Debug, Clone, Default)]
pub struct Share {
    /// Expected tokens each node of its draft adds (calibrated path probabilities), nodes
    /// best first, parents first: any prefix is a valid draft.
    pub gains: Vec<f64>,
    /// Its length follows the allotment; otherwise (a fixed block) the whole draft is verified.
    pub adaptive: bool,
    /// Tokens it is ahead of plain decoding so far, never below 0 (a debt is not carried).
    pub credit: f64,
}

/// The allotment: nodes verified per run (a prefix of its draft), and the tokens per millisecond
/// of verify it expects.
#[derive(Debug, Clone, PartialEq)]
pub struct Allotment {
    pub lengths: Vec<usize>,
    pub rate: f64,
}

/// Choose every adaptive run's draft length together: of the states reached by adding nodes one
/// at a time (each step the node that leaves the batch fair and fastest, or, while none does,
/// the one that helps the run furthest behind), the fair one with the best expected goodput.
/// Before any verify is measured, every draft is verified whole.
pub fn allot(cost: &CostModel, runs: &[Share]) -> Allotment {
    let whole = || runs.iter().map(|r| r.gains.len()).collect();
    let Some(plain) = cost.verify_cost(runs.len()) else { return Allotment { lengths: whole(), rate: f64::INFINITY } };
    let mut state = State {
        lengths: runs.iter().map(|r| if r.adaptive { 0 } else { r.gains.len() }).collect(),
        expected: runs.iter().map(|r| 1.0 + if r.adaptive { 0.0 } else { r.gains.iter().sum() }).collect(),
        rows: runs.iter().map(|r| 1 + if r.adaptive { 0 } else { r.gains.len() }).sum(),
    };
    // The state without adaptive drafts is taken even where fixed blocks make it unfair.
    let Some(t0) = cost.verify_cost(state.rows) else { return Allotment { lengths: whole(), rate: f64::INFINITY } };
    let mut best = Allotment { lengths: state.lengths.clone(), rate: state.total() / t0 };
    loop {
        let mut step: Option<(usize, State, f64, f64)> = None; // (run, state, rate, worst slack)
        for (i, r) in runs.iter().enumerate().filter(|(i, r)| r.adaptive && state.lengths[*i] < r.gains.len()) {
            let mut next = state.clone();
            next.lengths[i] += 1;
            next.expected[i] += r.gains[state.lengths[i]];
            next.rows += 1;
            let Some(t) = cost.verify_cost(next.rows) else { continue };
            let (rate, slack) = (next.total() / t, next.worst_slack(runs, t / plain));
            let better = match &step {
                None => true,
                Some((_, _, best_rate, best_slack)) if slack >= -NOISE && *best_slack >= -NOISE => rate > *best_rate,
                Some((_, _, _, best_slack)) => slack > *best_slack,
            };
            if better {
                step = Some((i, next, rate, slack));
            }
        }
        let Some((_, next, rate, slack)) = step else { break };
        if slack >= -NOISE && rate > best.rate {
            best = Allotment { lengths: next.lengths.clone(), rate };
        }
        state = next;
    }
    best
}

#[derive(Debug, Clone)]
struct State {
    lengths: Vec<usize>,
    /// Expected tokens per run this cycle (its own next token included).
    expected: Vec<f64>,
    rows: usize,
}

impl State {
    fn total(&self) -> f64 {
        self.expected.iter().sum()
    }

    /// The least, over runs, of expected tokens plus credit minus the tokens plain decoding would
    /// give in a cycle `steps` plain steps long.
    fn worst_slack(&self, runs: &[Share], steps: f64) -> f64 {
        self.expected.iter().zip(runs).map(|(e, r)| r.credit + e - steps).fold(f64::INFINITY, f64::min)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2 Q4_1's verify curve on the 2-core EPYC (ms per decode of b rows).
    fn smollm2() -> CostModel {
        let mut m = CostModel::default();
        for (b, ms) in [(1, 8.6), (2, 11.4), (4, 14.8), (8, 24.7), (16, 39.8), (32, 75.0), (64, 150.0)] {
            m.record_verify(b, ms);
        }
        m
    }

    fn run(gains: &[f64]) -> Share {
        Share { gains: gains.to_vec(), adaptive: true, credit: 0.0 }
    }

    #[test]
    fn alone_a_run_verifies_what_pays_per_verify_time() {
        let m = smollm2();
        assert_eq!(allot(&m, &[run(&[0.99; 7])]).lengths, vec![7]);
        assert_eq!(allot(&m, &[run(&[0.2, 0.1])]).lengths, vec![0]);
    }

    #[test]
    fn drafts_shrink_and_stop_as_the_batch_fills() {
        let m = smollm2();
        let draft = [0.8, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05];
        let total = |n: usize| allot(&m, &vec![run(&draft); n]).lengths.iter().sum::<usize>() as f64 / n as f64;
        let per_run: Vec<f64> = [1, 2, 4, 8, 16].iter().map(|&n| total(n)).collect();
        assert!(per_run.windows(2).all(|w| w[1] <= w[0]), "rows per run as load grows: {per_run:?}");
        assert!(per_run[0] >= 2.0 && per_run[4] == 0.0, "{per_run:?}");
    }

    #[test]
    fn a_plain_run_is_never_slowed_by_another_runs_draft() {
        let m = smollm2();
        let plain = Share { adaptive: false, ..Share::default() };
        let a = allot(&m, &[run(&[0.99, 0.99, 0.99, 0.99]), plain.clone(), plain]);
        assert_eq!(a.lengths, vec![0, 0, 0], "goodput alone would take the sure draft");
    }

    #[test]
    fn credit_buys_other_runs_drafts() {
        let m = smollm2();
        let sure = run(&[0.99, 0.99, 0.99, 0.99]);
        let idle = run(&[]);
        assert_eq!(allot(&m, &[sure.clone(), idle.clone()]).lengths, vec![0, 0]);
        let ahead = Share { credit: 5.0, ..idle };
        assert_eq!(allot(&m, &[sure, ahead]).lengths, vec![4, 0], "a run ahead of plain decoding can wait");
    }

    #[test]
    fn runs_that_all_draft_well_share_the_rows_fairly() {
        let m = smollm2();
        let a = allot(&m, &[run(&[0.9, 0.8, 0.7]), run(&[0.6, 0.3, 0.1])]);
        // Both are drafted for: the weak run's first node keeps it at its plain share.
        assert!(a.lengths[0] >= 1 && a.lengths[1] >= 1, "{a:?}");
        assert!(a.rate > 2.0 / 11.4, "better than two plain rows");
    }

    #[test]
    fn fixed_blocks_are_verified_whole() {
        let m = smollm2();
        let fixed = Share { gains: vec![0.1, 0.1, 0.1], adaptive: false, credit: 0.0 };
        assert_eq!(allot(&m, &[fixed, run(&[0.2])]).lengths, vec![3, 0]);
    }

    #[test]
    fn nothing_measured_verifies_everything() {
        let a = allot(&CostModel::default(), &[run(&[0.1, 0.1]), run(&[0.2])]);
        assert_eq!(a.lengths, vec![2, 1]);
    }
}
