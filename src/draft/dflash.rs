//! The DFlash drafter as a draft source: one block decode for every sequence that drafts this
//! cycle, each proposing its block's candidate lattice (the arbiter walks it, or draws from it).
use super::source::{ms_since, Draft, DraftSource, Env, Outcome, Prediction, Proposal, Request};
use super::Origin;
use crate::llama::{LlamaError, Result, Token};
use std::time::Instant;

/// Our walks over the DFlash drafter's lattice. The drafter itself (its context and the
/// features it is fed) is shared through [`Env::drafter`]: llama.cpp's own DFlash driver
/// drafts with it too.
#[derive(Debug, Default)]
pub struct Dflash;

impl DraftSource for Dflash {
    fn origin(&self) -> Origin {
        Origin::Drafter
    }

    fn decodes(&self) -> bool {
        true
    }

    fn propose(&mut self, env: &mut Env, requests: &[Request]) -> Result<Vec<Option<Proposal>>> {
        let t0 = Instant::now();
        let drafter = env.drafter.as_deref_mut().ok_or_else(|| LlamaError::Invalid("DFlash drafting needs a drafter".into()))?;
        for r in requests {
            drafter.flush(r.seq)?;
        }
        let blocks: Vec<(Token, usize, i32)> = requests.iter().map(|r| (r.last, r.pos, r.seq as i32)).collect();
        // An adaptive request's block is as deep as its verifies have lately taken drafts in.
        let cost = &*env.cost;
        let depth = |r: &Request| if r.adaptive { cost.draft_depth(r.max_len) } else { r.max_len };
        let n_block = requests.iter().map(depth).max().unwrap_or(0) + 1;
        let lattices = drafter.draft(&blocks, n_block)?;
        let ms = ms_since(t0);
        env.cost.record_draft(ms);
        let proposals = requests.iter().zip(lattices).map(|(r, l)| Proposal {
            calls: 1,
            positions: l.n_pos,
            repaired: l.repaired > 0,
            ms,
            draft: Draft::Law(l.truncated(r.max_len)),
        });
        Ok(proposals.map(Some).collect())
    }

    /// The cost model learns how many of its tokens the target takes per call, and, from the
    /// drafts it made alone, how far its predicted acceptance holds.
    fn learn(&mut self, env: &mut Env, proposal: &Proposal, o: &Outcome, prediction: &mut Prediction) -> Result<()> {
        let Draft::Law(lattice) = &proposal.draft else { return Ok(()) };
        let taken = o.path.iter().filter(|&&i| o.tree.nodes[i].origin.from_drafter()).count();
        env.cost.record_drafter_accepted(taken);
        let alone = o.tree.nodes.iter().all(|n| n.origin == Origin::Drafter);
        if !alone || o.tree.is_empty() {
            return Ok(());
        }
        let gains = o.tree.gains();
        prediction.predicted_accepted += gains.iter().map(|&g| g as f64).sum::<f64>();
        let depth = o.path.len(); // where the target decided differently, if it did
        if depth < o.tree.len() {
            prediction.rejections += 1;
            let in_candidates = |next| depth < lattice.n_pos && (0..lattice.k).any(|c| lattice.id(depth, c) == next);
            prediction.rejected_in_candidates += usize::from(o.next.is_some_and(in_candidates));
        }
        if o.tree.is_chain() {
            env.cost.record_acceptance(&gains, depth);
        }
        Ok(())
    }
}
