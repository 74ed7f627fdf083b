//! One speculative cycle for every run in progress: plan, draft, select, verify, commit, roll
//! back. All runs draft in one call per source and verify in one target decode.
use super::report::{ms_since, Cycle, Probs};
use super::{Engine, EngineError, Result, Run};
use crate::draft::arbiter::{self, Choice, Pending};
use crate::draft::source::{Outcome, Proposal, Request};
use crate::llama::Token;
use crate::sampling::TokenProb;
use crate::verify::{in_order, Check, Drafted, Law, States, Verdict};
use std::time::Instant;

/// What one run does in a cycle.
struct Plan {
    /// Index into the cycle's runs.
    run: usize,
    /// Drafted tokens allowed this cycle (0: a plain step).
    max_draft: usize,
    /// What its sources proposed, and which source each came from.
    proposals: Vec<Proposal>,
    from: Vec<usize>,
    /// The draft chosen, as the verify batch holds it.
    draft: Drafted,
}

impl Engine {
    /// One cycle of one run; see [`Engine::step_all`].
    pub fn step(&mut self, run: &mut Run) -> Result<Vec<Token>> {
        Ok(self.step_all(&mut [run])?.pop().unwrap_or_default())
    }

    /// One cycle for several runs (each in its own slot): every source drafts for all of them
    /// in one call (the drafter in ONE decode), and all drafts are verified in ONE target
    /// decode. A run that does not draft this cycle (plain decoding, or drafting would not
    /// pay) adds its one token to the same verify decode. Returns, per run, the tokens
    /// committed to its output. Token trees need a single-slot engine: with several slots,
    /// `tree` drafts the best path.
    pub fn step_all(&mut self, runs: &mut [&mut Run]) -> Result<Vec<Vec<Token>>> {
        check_slots(runs, self.cached.len())?;
        let mut plans = self.plan(runs);
        let mut out = vec![Vec::new(); runs.len()];
        if plans.is_empty() {
            return Ok(out);
        }
        let mut cycle = Cycle::start();
        self.draft(&mut plans, runs)?;
        cycle.drafted();
        self.select(&mut plans, runs);
        let mut check = Check { target: &mut self.target, batch: &mut self.batch, history: &mut self.history, n_seqs: self.cached.len() };
        check.layout(plans.iter_mut().map(|p| &mut p.draft))?;
        cycle.laid_out();
        self.target.decode(&self.batch, "verify")?;
        let drafted = self.batch.len() > plans.len() || plans.iter().any(|p| p.proposals.iter().any(|q| q.calls > 0));
        cycle.verified(&mut self.cost, self.batch.len(), drafted.then_some(plans.len()));
        for p in &plans {
            let (t, run) = (Instant::now(), &mut *runs[p.run]);
            let verify_before = run.stats.verify_ms;
            let (committed, probs, free) = self.commit(p, run)?;
            let (redecode_ms, judged) = (run.stats.verify_ms - verify_before, p.proposals.iter().any(Proposal::judged));
            cycle.report(run, t, redecode_ms, committed.len(), free, judged);
            // (a cycle whose first row was a near-tie commits nothing: its token is decided
            // alone next cycle)
            if let Some(&last) = committed.last() {
                run.next = last;
            }
            out[p.run] = run.commit(self.target.model(), &committed, &probs).to_vec();
        }
        cycle.close(&mut self.cost);
        Ok(out)
    }

    /// Decide, for each unfinished run, how many tokens it may draft this cycle.
    fn plan(&mut self, runs: &mut [&mut Run]) -> Vec<Plan> {
        let n_ctx = self.n_ctx();
        let mut plans = Vec::new();
        for (i, run) in runs.iter_mut().enumerate().filter(|(_, r)| r.finish.is_none()) {
            // `run.next` is committed but not yet decoded: it sits at position cached.len().
            let pos0 = self.cached[run.slot].len();
            if pos0 >= n_ctx {
                run.end_at_context();
                continue;
            }
            let remaining = run.opts.n_predict - run.tokens().len();
            let max_draft = run.block.saturating_sub(1).min(remaining.saturating_sub(1)).min(n_ctx - pos0 - 1);
            let single = std::mem::take(&mut run.single_next);
            plans.push(Plan::new(i, run, pos0, if run.sources.is_empty() || single { 0 } else { max_draft }));
        }
        plans
    }

    /// Every plan's proposals: the free sources' first, then the decoding sources', where the
    /// free proposals and the cost model leave a decode worth it. Each source proposes for all
    /// its plans in one call.
    fn draft(&mut self, plans: &mut [Plan], runs: &mut [&mut Run]) -> Result<()> {
        let trees = self.cached.len() == 1;
        let mut asked = vec![false; plans.len()];
        // The cost model's verdict on the drafter for adaptive lengths, asked once a cycle.
        let mut pays = None;
        for decoding in [false, true] {
            if decoding {
                for (p, ask) in plans.iter().zip(asked.iter_mut()) {
                    let run = &*runs[p.run];
                    let decodes = run.sources.iter().any(|&id| self.sources.decodes(id));
                    *ask = p.max_draft > 0
                        && decodes
                        && arbiter::decode_pays(&self.cost, &p.proposals)
                        && (!run.adaptive || *pays.get_or_insert_with(|| self.cost.should_draft()));
                }
            }
            let ids: std::collections::BTreeSet<usize> = runs.iter().flat_map(|r| r.sources.iter().copied()).collect();
            for id in ids {
                if self.sources.decodes(id) != decoding {
                    continue;
                }
                let asking: Vec<usize> = (0..plans.len())
                    .filter(|&i| plans[i].max_draft > 0 && runs[plans[i].run].sources.contains(&id) && (!decoding || asked[i]))
                    .collect();
                if asking.is_empty() {
                    continue;
                }
                let requests: Vec<Request> = asking.iter().map(|&i| request(&self.cached, &plans[i], runs[plans[i].run], trees)).collect();
                let proposals = self.sources.propose(id, &self.target, &mut self.cost, &requests)?;
                for (&i, proposal) in asking.iter().zip(proposals) {
                    let Some(proposal) = proposal else { continue };
                    runs[plans[i].run].stats.record_proposal(&proposal, self.sources.origin(id));
                    plans[i].proposals.push(proposal);
                    plans[i].from.push(id);
                }
            }
        }
        Ok(())
    }

    /// Every plan's one draft from its proposals (`draft::arbiter`), the adaptive lengths settled
    /// together for the batch they share, each cut where a grammar forbids.
    fn select(&mut self, plans: &mut [Plan], runs: &mut [&mut Run]) {
        let trees = self.cached.len() == 1;
        let mut cuttable = Vec::with_capacity(plans.len());
        for p in plans.iter_mut() {
            let run = &mut *runs[p.run];
            let d = &run.opts.draft;
            let choice = Choice { walk: d.select.walk(trees, d.tree_budget), adaptive: run.adaptive, matching: run.matching(), temperature: run.sampler.params().temperature };
            p.draft.tree = arbiter::choose(&p.proposals, &choice, &self.cost, run.sampler.drafting());
            cuttable.push(arbiter::cuttable(&p.proposals, run.adaptive));
        }
        let mut pending: Vec<Pending> = plans
            .iter_mut()
            .zip(cuttable)
            .map(|(p, adaptive)| Pending { tree: &mut p.draft.tree, adaptive, credit: runs[p.run].credit })
            .collect();
        arbiter::settle(&self.cost, &mut pending);
        for p in plans.iter_mut() {
            let run = &*runs[p.run];
            p.draft.states = States::follow(&mut p.draft.tree, run.grammar.as_ref(), run.matching());
            if run.adaptive {
                arbiter::chosen(&mut self.cost, &p.proposals, &p.draft.tree, run.block);
            }
        }
    }

    /// Verify one plan's rows, keep what the target accepts in both caches (the rest rolls
    /// back), and let its sources learn. Returns the committed tokens (accepted drafts, then the
    /// target's own next token), their log-probabilities when asked for, and how many of them
    /// came from sources that cost no call.
    fn commit(&mut self, p: &Plan, run: &mut Run) -> Result<(Vec<Token>, Vec<TokenProb>, usize)> {
        let d = &p.draft;
        let qs = if run.matching() { Vec::new() } else { arbiter::laws(&p.proposals, &d.tree, run.sampler.params().temperature) };
        let Self { sources, target, batch, history, cached, cost, near_tie_margin, .. } = self;
        let mut check = Check { target, batch, history, n_seqs: cached.len() };
        let (index, verifier) = (run.tokens().len(), run.opts.verifier);
        let law = Law { sampler: &run.sampler, grammar: run.grammar.as_ref(), cached: &cached[d.seq], index, verifier };
        let (mut path, mut next) = match check.accept(d, law, *near_tie_margin, &qs)? {
            Verdict::Retry => {
                run.near_tie();
                check.retry_alone(d)?;
                run.stats.record_verify(d.tree.len(), 0, 0);
                return Ok((Vec::new(), Vec::new(), 0));
            }
            Verdict::Take { path, next, near_tie } => {
                if near_tie {
                    run.near_tie();
                }
                (path, next)
            }
        };
        // The target keeps `last` and the accepted path, the drafter receives their features;
        // everything else leaves both caches.
        check.keep(d, &path)?;
        // The principal branch (laid out first) sits in cells right after the anchor, in
        // position order, exactly as plain decoding would have put it.
        let in_order = in_order(&path);
        let rows: Vec<usize> = std::iter::once(d.row0).chain(path[..in_order].iter().map(|&i| d.row0 + i + 1)).collect();
        sources.observe(check.target, d.seq, &rows, d.pos0)?;
        // Log-probabilities of the in-order part, and of the first side-branch node (its parent's
        // row is in order); the rest of a side branch, and the token after it, from the re-decode.
        let mut probs = Probs::new(run.opts.n_probs);
        probs.chosen(check.target, d, &path[..path.len().min(in_order + 1)])?;
        if in_order < path.len() {
            let t = Instant::now();
            let tail = path.split_off(in_order);
            let law = Law { sampler: &run.sampler, grammar: run.grammar.as_ref(), cached: &cached[d.seq], index, verifier };
            let (kept, bonus) = check.redecode(d, &tail, &law)?;
            sources.observe(check.target, d.seq, &(0..kept).collect::<Vec<_>>(), d.pos0 + d.tree.nodes[tail[0]].depth)?;
            path.extend_from_slice(&tail[..kept]);
            next = bonus.unwrap_or(next);
            probs.redecoded(check.target, d, &tail[..kept], next)?;
            // a target decode: verify time, not host time
            run.stats.verify_ms += ms_since(t);
            run.stats.redecoded += tail.len();
        }
        probs.next(check.target, d, &path, next)?;
        let mut committed: Vec<Token> = path.iter().map(|&i| d.tree.nodes[i].token).collect();
        if let Some(g) = run.grammar.as_mut() {
            // the output ends at an end-of-generation token: nothing after it is the grammar's
            for &t in committed.iter().chain([&next]).take_while(|&&t| !check.target.model().is_eog(t)) {
                g.accept(t)?;
            }
        }
        cached[d.seq].push(d.last);
        cached[d.seq].extend_from_slice(&committed);
        run.stats.record_verify(d.tree.len(), path.len(), path.len() + 1);
        run.stats.record_origins(&d.tree, &path);
        let outcome = Outcome { seq: d.seq, tree: &d.tree, path: &path, next: Some(next) };
        for (&id, proposal) in p.from.iter().zip(&p.proposals) {
            sources.learn(id, check.target, cost, proposal, &outcome, &mut run.stats.prediction)?;
        }
        let free = path.iter().filter(|&&i| d.tree.nodes[i].origin.from_lookup()).count();
        committed.push(next);
        Ok((committed, probs.out, free))
    }
}

impl Plan {
    fn new(run: usize, r: &Run, pos0: usize, max_draft: usize) -> Self {
        let draft = Drafted { seq: r.slot, last: r.next, pos0, tree: Default::default(), states: States::default(), row0: 0, n_leaves: 0 };
        Self { run, max_draft, proposals: Vec::new(), from: Vec::new(), draft }
    }
}

/// Runs stepped together must each have a slot of their own.
fn check_slots(runs: &[&mut Run], n_slots: usize) -> Result<()> {
    let mut seen = vec![false; n_slots];
    match runs.iter().find(|r| std::mem::replace(&mut seen[r.slot], true)) {
        Some(r) => Err(EngineError::Config(format!("two runs share slot {}", r.slot))),
        None => Ok(()),
    }
}

/// What `p`'s run asks of its sources this cycle (`cached`: every slot's committed tokens).
fn request<'a>(cached: &'a [Vec<Token>], p: &Plan, run: &Run, trees: bool) -> Request<'a> {
    let d = &run.opts.draft;
    Request {
        seq: run.slot,
        history: &cached[run.slot],
        last: p.draft.last,
        pos: p.draft.pos0,
        max_len: p.max_draft,
        walk: d.select.walk(trees, d.tree_budget),
        matching: run.matching(),
        adaptive: run.adaptive,
    }
}
