//! llama.cpp's own drafting as a draft source: its DFlash driver over our drafter, or one of
//! its n-gram types. Their drafts are verified as they come, by our verification: the
//! baselines the DFlash lattice walks and the look-up are measured against.
use super::config::Upstream;
use super::drafter::Drafter;
use super::source::{ms_since, Draft, DraftSource, Env, Outcome, Prediction, Proposal, Request};
use super::{DraftTree, Origin};
use crate::llama::{Context, FeatureSource, LlamaError, Result, Token, UpstreamDrafter};
use std::time::Instant;

pub struct UpstreamSource {
    kind: Upstream,
    driver: UpstreamDrafter,
}

impl UpstreamSource {
    /// llama.cpp's drafting of `kind` for `n_seqs` sequences of `target` (its DFlash driver
    /// drafts with `drafter`).
    pub fn new(kind: Upstream, target: &Context, drafter: Option<&Drafter>, n_seqs: usize) -> Result<Self> {
        let driver = match kind {
            Upstream::Dflash => {
                let drafter = drafter.ok_or_else(|| LlamaError::Invalid("llama.cpp's DFlash driver needs a drafter".into()))?;
                if !matches!(target.features(), FeatureSource::Native(_)) {
                    return Err(LlamaError::Invalid(format!(
                        "llama.cpp's DFlash driver needs the target's own layer extraction, which {} ({}) lacks",
                        target.model().path(),
                        target.model().architecture()
                    )));
                }
                UpstreamDrafter::dflash(target, drafter.context(), drafter.trained_block() - 1, n_seqs)?
            }
            Upstream::Ngram(name) => UpstreamDrafter::ngram(name, target, n_seqs)?,
        };
        Ok(Self { kind, driver })
    }
}

impl DraftSource for UpstreamSource {
    fn origin(&self) -> Origin {
        Origin::Drafter
    }

    /// The DFlash driver decodes a drafter block; the n-gram types read the context.
    fn decodes(&self) -> bool {
        self.kind == Upstream::Dflash
    }

    fn begin(&mut self, _env: &mut Env, seq: usize, prompt: &[Token], _cfg: &super::config::DraftConfig) -> Result<()> {
        self.driver.begin(seq as i32, prompt)
    }

    /// One call per sequence: llama.cpp's driver drafts one sequence at a time.
    fn propose(&mut self, env: &mut Env, requests: &[Request]) -> Result<Vec<Option<Proposal>>> {
        let mut out = Vec::with_capacity(requests.len());
        for r in requests {
            let t = Instant::now();
            let seq = r.seq as i32;
            let proposal = match (self.kind, env.drafter.as_deref_mut()) {
                (Upstream::Dflash, Some(drafter)) => {
                    drafter.flush(r.seq)?;
                    let drafted = self.driver.draft(seq, &[], r.last, r.pos, r.max_len);
                    // The driver leaves its block in the drafter's cache: only features may stay.
                    drafter.truncate(r.seq, r.pos)?;
                    let draft = Draft::Fixed(DraftTree::chain(&drafted?));
                    Proposal { calls: 1, positions: r.max_len, ..Proposal::free(draft, 0.0) }
                }
                (Upstream::Dflash, None) => return Err(LlamaError::Invalid("llama.cpp's DFlash driver needs a drafter".into())),
                (Upstream::Ngram(_), _) => {
                    let drafted = self.driver.draft(seq, r.history, r.last, r.pos, r.max_len)?;
                    Proposal::free(Draft::Fixed(DraftTree::chain(&drafted)), 0.0)
                }
            };
            out.push(Some(Proposal { ms: ms_since(t), ..proposal }));
        }
        Ok(out)
    }

    /// Its driver is told how many of its tokens the target took.
    fn learn(&mut self, _env: &mut Env, _proposal: &Proposal, o: &Outcome, _prediction: &mut Prediction) -> Result<()> {
        if o.tree.is_empty() || !o.tree.nodes.iter().all(|n| n.origin == Origin::Drafter) {
            return Ok(()); // its draft was not verified (empty, or another's won)
        }
        self.driver.accept(o.seq as i32, o.path.len())
    }
}
