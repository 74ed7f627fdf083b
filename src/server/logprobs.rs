//! Log-probabilities in each API's shape: OpenAI chat (`logprobs` + `top_logprobs`), OpenAI's
//! legacy completions (`logprobs: n`) and llama-server's `completion_probabilities` (`n_probs`).
//! The values are the engine's (`sampling::token_probs`): the target's log-softmax at the row
//! that chose each token, equal to plain decoding's.

use super::types::{ChatLogprob, ChatLogprobs, TextLogprobs, TopLogprob};
use crate::llama::{Model, Token};
use crate::sampling::TokenProb;

fn piece(model: &Model, id: Token) -> (String, Vec<u8>) {
    let bytes = model.token_bytes(id, true);
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

pub fn chat(model: &Model, probs: &[TokenProb]) -> ChatLogprobs {
    ChatLogprobs { content: entries(model, probs, false), refusal: None }
}

/// `offset`: characters of text before these tokens (a stream's earlier pieces).
pub fn text(model: &Model, probs: &[TokenProb], mut offset: usize) -> TextLogprobs {
    let mut out = TextLogprobs::default();
    for p in probs {
        let (token, _) = piece(model, p.id);
        out.text_offset.push(offset);
        offset += token.chars().count();
        out.tokens.push(token);
        out.token_logprobs.push(p.logprob);
        out.top_logprobs.push(p.top.iter().map(|&(id, lp)| (piece(model, id).0, lp.into())).collect());
    }
    out
}

/// llama-server's `completion_probabilities`: the chat entries with token ids.
pub fn llama(model: &Model, probs: &[TokenProb]) -> Vec<ChatLogprob> {
    entries(model, probs, true)
}

fn entries(model: &Model, probs: &[TokenProb], with_ids: bool) -> Vec<ChatLogprob> {
    let id = |t: Token| with_ids.then_some(t);
    probs
        .iter()
        .map(|p| {
            let (token, bytes) = piece(model, p.id);
            let top_logprobs = p
                .top
                .iter()
                .map(|&(t, logprob)| {
                    let (token, bytes) = piece(model, t);
                    TopLogprob { id: id(t), token, logprob, bytes }
                })
                .collect();
            ChatLogprob { id: id(p.id), token, logprob: p.logprob, bytes, top_logprobs }
        })
        .collect()
}
