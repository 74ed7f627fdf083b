//! The synthetic models through llama.cpp: the targets give bit-identical logits whatever the
//! batch shape (what makes exact losslessness checks on them meaningful), the random target's
//! greedy output depends on its prompt, and the cycle target follows its cycle.
mod common;

use dflash2::gguf::synth::{cycle_token, next_target, synth_all};
use dflash2::llama::{Batch, Context, ContextParams, Model, ModelParams, Token};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

fn synth_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = common::scratch_dir("synth-models");
        synth_all(&dir, 7).expect("synth models");
        dir
    })
}

fn load(name: &str) -> Arc<Model> {
    Arc::new(Model::load(&synth_dir().join(name), &ModelParams::default()).unwrap())
}

fn context(model: &Arc<Model>) -> Context {
    let params = ContextParams { n_ctx: 256, n_batch: 64, ..ContextParams::default() };
    Context::new(model.clone(), &params, None).unwrap()
}

fn argmax(v: &[f32]) -> Token {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as Token
}

/// Greedy decoding, one token per decode (as plain decoding does).
fn greedy(model: &Arc<Model>, prompt: &[Token], n: usize) -> Vec<Token> {
    let mut ctx = context(model);
    let mut batch = Batch::tokens(64, 1);
    for (i, &t) in prompt.iter().enumerate() {
        batch.add_token(t, i as i32, &[0], i + 1 == prompt.len()).unwrap();
    }
    ctx.decode(&batch, "prompt").unwrap();
    let mut out = Vec::new();
    let mut row = prompt.len() - 1;
    for pos in prompt.len()..prompt.len() + n {
        let t = argmax(ctx.logits(row).unwrap());
        out.push(t);
        batch.clear();
        batch.add_token(t, pos as i32, &[0], true).unwrap();
        ctx.decode(&batch, "token").unwrap();
        row = 0;
    }
    out
}

#[test]
fn target_logits_do_not_depend_on_the_batch_shape() {
    for name in ["target.gguf", "target-cycle.gguf"] {
        let model = load(name);
        for (i, text) in common::PROMPTS.iter().take(6).enumerate() {
            let mut tokens = model.tokenize(text, true, false).unwrap();
            tokens.extend(greedy(&model, &tokens, 8));
            let one = common::tail_logits_in(&mut context(&model), &tokens, 4, 1);
            assert_eq!(one.len(), 4);
            assert!(one.iter().flatten().all(|x| x.is_finite()));
            for chunk in [2, 3, 4] {
                let other = common::tail_logits_in(&mut context(&model), &tokens, 4, chunk);
                for (pos, (a, b)) in one.iter().zip(&other).enumerate() {
                    let diff = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
                    assert_eq!(diff, 0, "{name}, prompt {i}, chunks of {chunk}: tail row {pos} has {diff} logits that differ from single-token decoding");
                }
            }
        }
    }
}

#[test]
fn random_target_output_depends_on_the_prompt() {
    let model = load("target.gguf");
    let outs: Vec<Vec<Token>> = common::PROMPTS
        .iter()
        .take(8)
        .map(|p| greedy(&model, &model.tokenize(p, true, false).unwrap(), 30))
        .collect();
    for (p, o) in common::PROMPTS.iter().zip(&outs) {
        let distinct: std::collections::BTreeSet<_> = o.iter().collect();
        println!("{p:?} -> {:?} ({} distinct)", model.detokenize(o, false), distinct.len());
        assert!(distinct.len() >= 5, "{p:?}: greedy output is nearly constant: {o:?}");
    }
    let unique: std::collections::BTreeSet<_> = outs.iter().collect();
    assert!(unique.len() >= 6, "only {} distinct continuations of 8 prompts", unique.len());
}

#[test]
fn cycle_target_follows_its_cycle() {
    let model = load("target-cycle.gguf");
    for j in 0..dflash2::gguf::synth::CYCLE_LEN {
        let mut prompt = model.tokenize("start", true, false).unwrap();
        prompt.push(cycle_token(j) as Token);
        let out = greedy(&model, &prompt, 40);
        let mut want = Vec::new();
        let mut t = cycle_token(j);
        for _ in 0..40 {
            t = next_target(t);
            want.push(t as Token);
        }
        assert_eq!(out, want, "entry c{j}");
    }
    // a token off the cycle leads into it
    let out = greedy(&model, &model.tokenize("xyz", true, false).unwrap(), 3);
    let last = *model.tokenize("xyz", true, false).unwrap().last().unwrap();
    assert_eq!(out[0], next_target(last as u32) as Token);
}
