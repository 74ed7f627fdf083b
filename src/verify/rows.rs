//! The target's law at a verify row, as plain decoding would have it at that point: the
//! history its penalties read, and the grammar's mask in the state the draft above the row
//! leaves it in.
use crate::draft::DraftTree;
use crate::llama::{Grammar, LlamaError, Result, Token};
use crate::sampling::{Sampler, SamplingParams};
use std::borrow::Cow;

/// The history a verify row's distribution depends on: the cache, `last`, and the drafted
/// path down to that row's node (left empty when no penalty reads it).
pub fn fill_history(out: &mut Vec<Token>, cached: &[Token], last: Token, tree: &DraftTree, row: usize, law: &SamplingParams) {
    out.clear();
    if !law.uses_history() {
        return;
    }
    out.extend_from_slice(cached);
    out.push(last);
    if row > 0 {
        out.extend(tree.path_to(row - 1).into_iter().map(|i| tree.nodes[i].token));
    }
}

/// `logits` with what `grammar` forbids masked out (borrowed as they are without one).
pub fn masked<'a>(logits: &'a [f32], grammar: Option<&Grammar>) -> Cow<'a, [f32]> {
    match grammar {
        None => Cow::Borrowed(logits),
        Some(g) => Cow::Owned(g.mask(logits)),
    }
}

/// The greedy token under `grammar`. Masking only removes tokens, so when the unmasked choice is
/// allowed it is the masked one too (llama.cpp samples first and masks only on a miss, for the
/// same reason): the whole vocabulary is masked only then.
pub fn constrained_argmax(sampler: &Sampler, logits: &[f32], history: &[Token], grammar: Option<&Grammar>) -> Token {
    let free = sampler.distribution(logits, history).argmax();
    match grammar {
        Some(g) if !g.allows(free) => sampler.distribution(&g.mask(logits), history).argmax(),
        _ => free,
    }
}

/// The target's own token: its greedy token under `grammar` at temperature 0, else its law
/// (masked by `grammar`) sampled with the draw of generated token `index`, as plain decoding
/// picks it.
pub fn own_token(sampler: &Sampler, logits: &[f32], history: &[Token], grammar: Option<&Grammar>, index: usize) -> Token {
    match sampler.is_greedy() {
        true => constrained_argmax(sampler, logits, history, grammar),
        false => sampler.pick(&masked(logits, grammar), history, index),
    }
}

/// A draft's grammar states: the state after each node's token (None under a token the grammar
/// forbids, which only sampled drafts keep: the target never accepts it).
#[derive(Debug, Default)]
pub struct States(Vec<Option<Grammar>>);

impl States {
    /// Follow `grammar` (the sequence's state) down `tree`. Verified by `matching`, the tokens
    /// it forbids, and what hangs below them, are cut first: the target would never take them.
    /// Sampled drafts keep them (dropping a drawn token would bias the rejection sampler), and
    /// verification rejects them.
    pub fn follow(tree: &mut DraftTree, grammar: Option<&Grammar>, matching: bool) -> Self {
        let Some(g) = grammar else { return Self::default() };
        let mut states: Vec<Option<Grammar>> = Vec::with_capacity(tree.len());
        for n in &tree.nodes {
            let parent = match n.parent {
                None => Some(g),
                Some(i) => states[i].as_ref(),
            };
            let state = parent.filter(|s| s.allows(n.token)).and_then(|s| {
                let mut next = s.clone();
                next.accept(n.token).ok().map(|_| next)
            });
            states.push(state);
        }
        if matching && states.iter().any(Option::is_none) {
            let keep: Vec<bool> = states.iter().map(Option::is_some).collect();
            *tree = tree.retain(&keep);
            states.retain(Option::is_some);
        }
        Self(states)
    }

    /// The grammar state after draft node `node` (`grammar`: the sequence's).
    pub fn node<'a>(&'a self, grammar: Option<&'a Grammar>, node: usize) -> Result<Option<&'a Grammar>> {
        match grammar {
            None => Ok(None),
            Some(_) => match self.0.get(node) {
                Some(Some(g)) => Ok(Some(g)),
                _ => Err(LlamaError::Invalid(format!(
                    "no grammar state below draft node {node}: the target took a token the grammar forbids"
                ))),
            },
        }
    }

    /// The grammar state of verify row `row` (0: the anchor, the sequence's own state).
    pub fn row<'a>(&'a self, grammar: Option<&'a Grammar>, row: usize) -> Result<Option<&'a Grammar>> {
        match row {
            0 => Ok(grammar),
            r => self.node(grammar, r - 1),
        }
    }
}
