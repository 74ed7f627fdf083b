//! The engine's draft sources, the DFlash drafter they share, and which of them a generation
//! drafts with. Sources are addressed by their index: a generation keeps the indices it drafts
//! with (`Run::sources`), a plan the index behind each proposal.
use crate::draft::config::{DraftConfig, Upstream};
use crate::draft::cost::CostModel;
use crate::draft::dflash::Dflash;
use crate::draft::drafter::Drafter;
use crate::draft::lookup::Lookup;
use crate::draft::source::{DraftSource, Env, Outcome, Prediction, Proposal, Request};
use crate::draft::upstream::UpstreamSource;
use crate::llama::{Context, Result, Token};

/// Where the look-up sits in the list.
const LOOKUP: usize = 0;
/// Where our DFlash walks sit, with a drafter.
const DFLASH: usize = 1;

pub(super) struct Sources {
    list: Vec<Box<dyn DraftSource>>,
    /// llama.cpp's drafting of the kind generations last asked for, and its index.
    upstream: Option<(Upstream, usize)>,
    // Last: the upstream driver holds the drafter's context too.
    drafter: Option<Drafter>,
    n_seqs: usize,
}

impl Sources {
    pub fn new(drafter: Option<Drafter>, n_seqs: usize) -> Self {
        let mut list: Vec<Box<dyn DraftSource>> = vec![Box::new(Lookup::new(n_seqs))];
        if drafter.is_some() {
            list.push(Box::new(Dflash));
        }
        Self { list, upstream: None, drafter, n_seqs }
    }

    pub fn drafter(&self) -> Option<&Drafter> {
        self.drafter.as_ref()
    }

    pub fn decodes(&self, id: usize) -> bool {
        self.list[id].decodes()
    }

    pub fn origin(&self, id: usize) -> crate::draft::Origin {
        self.list[id].origin()
    }

    /// The sources `cfg` drafts with (none for plain decoding), each begun on `seq`.
    pub fn begin(&mut self, target: &Context, cost: &mut CostModel, seq: usize, prompt: &[Token], cfg: &DraftConfig) -> Result<Vec<usize>> {
        let mut ids = Vec::new();
        if !cfg.drafts(self.drafter.is_some()) {
            return Ok(ids);
        }
        if cfg.lookup {
            ids.push(LOOKUP);
        }
        match cfg.upstream {
            Some(kind) => ids.push(self.upstream(kind, target)?),
            None if self.drafter.is_some() => ids.push(DFLASH),
            None => {}
        }
        for &id in &ids {
            let mut env = Env { target, drafter: self.drafter.as_mut(), cost: &mut *cost };
            self.list[id].begin(&mut env, seq, prompt, cfg)?;
        }
        Ok(ids)
    }

    /// llama.cpp's drafting of `kind`, made (in place of another kind) where none is.
    fn upstream(&mut self, kind: Upstream, target: &Context) -> Result<usize> {
        match self.upstream {
            Some((k, id)) if k == kind => Ok(id),
            other => {
                let source = Box::new(UpstreamSource::new(kind, target, self.drafter.as_ref(), self.n_seqs)?);
                let id = match other {
                    Some((_, id)) => {
                        self.list[id] = source;
                        id
                    }
                    None => {
                        self.list.push(source);
                        self.list.len() - 1
                    }
                };
                self.upstream = Some((kind, id));
                Ok(id)
            }
        }
    }

    pub fn propose(&mut self, id: usize, target: &Context, cost: &mut CostModel, requests: &[Request]) -> Result<Vec<Option<Proposal>>> {
        let mut env = Env { target, drafter: self.drafter.as_mut(), cost };
        self.list[id].propose(&mut env, requests)
    }

    pub fn learn(&mut self, id: usize, target: &Context, cost: &mut CostModel, p: &Proposal, o: &Outcome, prediction: &mut Prediction) -> Result<()> {
        let mut env = Env { target, drafter: self.drafter.as_mut(), cost };
        self.list[id].learn(&mut env, p, o, prediction)
    }

    /// The target decoded `rows` of its last batch, now committed at consecutive positions
    /// `pos0..` of `seq`: the drafter's cache follows (their features queue for its next draft).
    pub fn observe(&mut self, target: &Context, seq: usize, rows: &[usize], pos0: usize) -> Result<()> {
        match self.drafter.as_mut() {
            Some(d) => d.queue(target, seq, rows, pos0),
            None => Ok(()),
        }
    }

    /// `seq` keeps only its first `keep` positions.
    pub fn truncate(&mut self, seq: usize, keep: usize) -> Result<()> {
        match self.drafter.as_mut() {
            Some(d) => d.truncate(seq, keep),
            None => Ok(()),
        }
    }
}
