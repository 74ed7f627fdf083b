//! The target must give a verify batch the same numbers a single-token step gets, or a
//! near-tie flips a token and speculative output stops being the target's own. Checked on
//! a real target with a context past 256 cells (where llama.cpp's flash-attention decode
//! path would split the cache and round differently; the engine turns it off).
mod common;

use dflash2::llama::{Batch, Context, ContextParams, Model, ModelParams};
use std::sync::Arc;

/// Logits of the last `tail` tokens of `tokens`, fed `chunk` at a time after the rest.
fn tail_logits(model: &Arc<Model>, tokens: &[i32], tail: usize, chunk: usize) -> Vec<Vec<f32>> {
    // The defaults are the engine's target settings (no flash attention, f16 caches).
    let params = ContextParams { n_ctx: 1024, ..ContextParams::default() };
    let mut ctx = Context::new(model.clone(), &params, None).unwrap();
    let mut b = Batch::tokens(512, 1);
    let n0 = tokens.len() - tail;
    for (i, &t) in tokens[..n0].iter().enumerate() {
        b.add_token(t, i as i32, &[0], false).unwrap();
    }
    ctx.decode(&b, "prefix").unwrap();
    let mut out = Vec::new();
    for start in (n0..tokens.len()).step_by(chunk) {
        let end = (start + chunk).min(tokens.len());
        b.clear();
        for (i, &t) in tokens[start..end].iter().enumerate() {
            b.add_token(t, (start + i) as i32, &[0], true).unwrap();
        }
        ctx.decode(&b, "tail").unwrap();
        for r in 0..end - start {
            out.push(ctx.logits(r).unwrap().to_vec());
        }
    }
    out
}

#[test]
fn verify_batches_reproduce_single_token_steps_past_256_cells() {
    let model = Arc::new(Model::load(&common::real_model(common::SMOLLM2), &ModelParams::default()).unwrap());
    let text = "def fizzbuzz(n):\n    \"\"\"Return the FizzBuzz sequence up to n.\"\"\"\n".repeat(20);
    let tokens = model.tokenize(&text, true, false).unwrap();
    assert!(tokens.len() > 300, "the context must pass 256 cells");
    let single = tail_logits(&model, &tokens, 24, 1);
    for chunk in [2, 5, 8, 16] {
        assert!(tail_logits(&model, &tokens, 24, chunk) == single, "a batch of {chunk} rounds differently");
    }
}
