//! The synthetic models through llama.cpp: the targets give bit-identical logits whatever the
//! batch shape (what makes exact losslessness checks on them meaningful), the random target's
//! greedy output depends on its prompt, and the cycle target follows its cycle.
mod common;

use dflash2::gguf::synth::{cycle_token, next_target, synth_all};
use dflash2::llama::{Batch, Context, ContextParams, FeatureSource, Model, ModelParams, Token};
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
    let params = ContextParams { n_ctx: 256, n_batch: 64, n_seq_max: 1, n_threads: 2, features: FeatureSource::None };
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

/// Decodes `tokens` in a fresh context: all but the last `tail` as one batch, then the tail in
/// chunks of `chunk` tokens; returns the logits of every tail position.
fn tail_logits(model: &Arc<Model>, tokens: &[Token], tail: usize, chunk: usize) -> Vec<Vec<f32>> {
    let mut ctx = context(model);
    let mut batch = Batch::tokens(64, 1);
    let head = tokens.len() - tail;
    for (i, &t) in tokens[..head].iter().enumerate() {
        batch.add_token(t, i as i32, &[0], false).unwrap();
    }
    ctx.decode(&batch, "head").unwrap();
    let mut out = Vec::new();
    for start in (head..tokens.len()).step_by(chunk) {
        batch.clear();
        let end = (start + chunk).min(tokens.len());
        for (p, &t) in tokens.iter().enumerate().take(end).skip(start) {
            batch.add_token(t, p as i32, &[0], true).unwrap();
        }
        ctx.decode(&batch, "tail").unwrap();
        for row in 0..end - start {
            out.push(ctx.logits(row).unwrap().to_vec());
        }
    }
    out
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
            let one = tail_logits(&model, &tokens, 4, 1);
            assert_eq!(one.len(), 4);
            assert!(one.iter().flatten().all(|x| x.is_finite()));
            for chunk in [2, 3, 4] {
                let other = tail_logits(&model, &tokens, 4, chunk);
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

mod probe {
    use super::*;
    use dflash2::engine::{Engine, EngineConfig, GenerateOptions, SelectMode};

    fn engine(target: &Arc<Model>, drafter: Option<&Arc<Model>>) -> Engine {
        let mut cfg = EngineConfig::new(PathBuf::new(), None);
        cfg.n_ctx = 1024;
        cfg.n_threads = 2;
        Engine::from_models(target.clone(), drafter.cloned(), &cfg).unwrap()
    }

    fn ctx2(model: &Arc<Model>) -> Context {
        let params = ContextParams { n_ctx: 256, n_batch: 64, n_seq_max: 4, n_threads: 2, features: FeatureSource::None };
        Context::new(model.clone(), &params, None).unwrap()
    }

    fn cmp(what: &str, a: &[f32], b: &[f32]) {
        let n = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        let m = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        let amax = a.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        println!("{what}: {n} logits differ, max |diff| {m:e} (max |logit| {amax})");
    }

    #[test]
    fn probe_layout() {
        for name in ["target.gguf"] {
            let model = load(name);
            for text in common::PROMPTS.iter().take(3) {
                let mut s = model.tokenize(text, true, false).unwrap();
                s.extend(greedy(&model, &s, 6));
                let n = s.len() - 4;
                let plain = tail_logits(&model, &s, 4, 1);
                // a masked sibling cell between the anchor and the accepted token
                let mut ctx = ctx2(&model);
                let mut b = Batch::tokens(64, 4);
                for (i, &t) in s[..n].iter().enumerate() {
                    b.add_token(t, i as i32, &[0], false).unwrap();
                }
                ctx.decode(&b, "head").unwrap();
                ctx.seq_cp(0, 1, -1, -1);
                b.clear();
                b.add_token(s[n], n as i32, &[0, 1], true).unwrap();
                b.add_token(7, n as i32 + 1, &[1], true).unwrap();
                b.add_token(s[n + 1], n as i32 + 1, &[0], true).unwrap();
                ctx.decode(&b, "tree").unwrap();
                cmp("anchor row (a masked sibling cell after it)", &plain[0], ctx.logits(0).unwrap());
                cmp("accepted row (a masked sibling cell before it)", &plain[1], ctx.logits(2).unwrap());
                ctx.seq_rm(1, -1, -1).unwrap();
                b.clear();
                b.add_token(s[n + 2], n as i32 + 2, &[0], true).unwrap();
                ctx.decode(&b, "next").unwrap();
                cmp("next token (may land in the sibling's freed cell)", &plain[2], ctx.logits(0).unwrap());
                b.clear();
                b.add_token(s[n + 3], n as i32 + 3, &[0], true).unwrap();
                ctx.decode(&b, "next2").unwrap();
                cmp("the token after", &plain[3], ctx.logits(0).unwrap());
                // the suggested fix: drop every tree cell after the anchor, re-decode the accepted token
                let mut ctx = ctx2(&model);
                b.clear();
                for (i, &t) in s[..n].iter().enumerate() {
                    b.add_token(t, i as i32, &[0], false).unwrap();
                }
                ctx.decode(&b, "head").unwrap();
                ctx.seq_cp(0, 1, -1, -1);
                b.clear();
                b.add_token(s[n], n as i32, &[0, 1], true).unwrap();
                b.add_token(7, n as i32 + 1, &[1], true).unwrap();
                b.add_token(s[n + 1], n as i32 + 1, &[0], true).unwrap();
                ctx.decode(&b, "tree").unwrap();
                ctx.seq_rm(1, -1, -1).unwrap();
                ctx.seq_rm(0, n as i32 + 1, -1).unwrap();
                b.clear();
                b.add_token(s[n + 1], n as i32 + 1, &[0], true).unwrap();
                ctx.decode(&b, "redo").unwrap();
                cmp("fix: re-decoded accepted token", &plain[1], ctx.logits(0).unwrap());
                for k in 2..4 {
                    b.clear();
                    b.add_token(s[n + k], (n + k) as i32, &[0], true).unwrap();
                    ctx.decode(&b, "next").unwrap();
                    cmp("fix: following token", &plain[k], ctx.logits(0).unwrap());
                }
                // same without the sibling, but a 2-sequence context and a multi-seq anchor
                let mut ctx = ctx2(&model);
                b.clear();
                for (i, &t) in s[..n].iter().enumerate() {
                    b.add_token(t, i as i32, &[0], false).unwrap();
                }
                ctx.decode(&b, "head").unwrap();
                ctx.seq_cp(0, 1, -1, -1);
                b.clear();
                b.add_token(s[n], n as i32, &[0, 1], true).unwrap();
                b.add_token(s[n + 1], n as i32 + 1, &[0], true).unwrap();
                ctx.decode(&b, "chain2").unwrap();
                cmp("control: anchor in seqs 0,1, no sibling", &plain[0], ctx.logits(0).unwrap());
                cmp("control: accepted, no sibling", &plain[1], ctx.logits(1).unwrap());
            }
        }
    }

    #[test]
    fn probe_lossless() {
        let target = load("target.gguf");
        let prompts: Vec<Vec<Token>> = common::PROMPTS.iter().map(|p| target.tokenize(p, true, false).unwrap()).collect();
        // plain, with top-2 gaps
        let mut min_gap = f32::MAX;
        let mut baseline = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let out = greedy(&target, p, 40);
            let params = ContextParams { n_ctx: 256, n_batch: 128, n_seq_max: 1, n_threads: 2, features: FeatureSource::None };
            let mut ctx = Context::new(target.clone(), &params, None).unwrap();
            let mut b = Batch::tokens(128, 1);
            let all: Vec<Token> = p.iter().chain(&out).copied().collect();
            for (k, &t) in all.iter().enumerate() {
                b.add_token(t, k as i32, &[0], true).unwrap();
            }
            ctx.decode(&b, "x").unwrap();
            for k in 0..40 {
                let l = ctx.logits(p.len() - 1 + k).unwrap();
                let mut s: Vec<f32> = l.to_vec();
                s.sort_by(|a, b| b.partial_cmp(a).unwrap());
                let gap = s[0] - s[1];
                if gap < 1e-3 || (i == 0 && k == 11) {
                    println!("prompt {i} step {k}: top-2 gap {gap:e} argmax {}", argmax(l));
                }
                min_gap = min_gap.min(gap);
            }
            baseline.push(out);
        }
        println!("min top-2 gap over plain decoding: {min_gap:e}");
        let mut plain = engine(&target, None);
        for (i, p) in prompts.iter().enumerate() {
            let g = plain.generate(p, &GenerateOptions { n_predict: 40, select: SelectMode::None, block: 1, ..Default::default() }, |_| true).unwrap();
            assert_eq!(g.tokens, baseline[i], "engine plain vs test greedy, prompt {i}");
        }
        for drafter_file in ["drafter-dflash1.gguf", "drafter-dflash2.gguf"] {
            let drafter = load(drafter_file);
            let mut spec = engine(&target, Some(&drafter));
            for block in [2, 4, 8, 16] {
                for select in [SelectMode::Greedy, SelectMode::BestPath, SelectMode::Tree] {
                    let mut bad = vec![];
                    for (i, p) in prompts.iter().enumerate() {
                        let opts = GenerateOptions { n_predict: 40, select, block, tree_budget: 12, ..Default::default() };
                        let g = spec.generate(p, &opts, |_| true).unwrap();
                        if g.tokens != baseline[i] {
                            let at = g.tokens.iter().zip(&baseline[i]).position(|(a, b)| a != b);
                            bad.push((i, at));
                        }
                    }
                    println!("{drafter_file} block {block} {select:?}: mismatches (prompt, first index) {bad:?}");
                }
            }
        }
    }
}
