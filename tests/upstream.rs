//! `--select greedy` must draft exactly what llama.cpp's own DFlash driver drafts, and
//! `--select upstream` (that driver, through our verification) stays lossless.
mod common;

use dflash2::cli::SelectArg;
use dflash2::draft::cost::CostModel;
use dflash2::draft::drafter::Drafter;
use dflash2::draft::select::{Greedy, Selector, Walk};
use dflash2::draft::source::{Draft, DraftSource, Env, Request};
use dflash2::draft::upstream::UpstreamSource;
use dflash2::engine::{Block, Engine, EngineConfig, GenerateOptions, SelectMode, Upstream};
use dflash2::llama::{CacheType, Batch, Context, ContextParams, FeatureSource, Model, ModelParams};
use std::path::Path;
use std::sync::Arc;

fn load(p: &Path) -> Arc<Model> {
    Arc::new(Model::load(p, &ModelParams::default()).unwrap())
}

/// Our greedy walk over the lattice against llama.cpp's driver, on the same drafter state.
fn same_drafts(target: Arc<Model>, drafter_model: Arc<Model>, prompts: &[&str]) {
    let layers = drafter_model.target_layer_ids();
    let params = ContextParams { n_ctx: 1024, features: FeatureSource::Native(layers), ..ContextParams::default() };
    let mut ctx = Context::new(target.clone(), &params, None).unwrap();
    let mut drafter = Drafter::new(drafter_model, &ctx, 1, 2, CacheType::Q8_0, CacheType::Q8_0).unwrap();
    let block = drafter.trained_block();
    let mut upstream = UpstreamSource::new(Upstream::Dflash, &ctx, Some(&drafter), 1).unwrap();
    let mut cost = CostModel::default();
    let mut compared = 0;
    for text in prompts {
        ctx.clear_memory();
        drafter.truncate(0, 0).unwrap();
        let tokens = target.tokenize(text, true, false).unwrap();
        let (prefix, last) = (&tokens[..tokens.len() - 1], tokens[tokens.len() - 1]);
        let mut b = Batch::tokens(512, 1);
        for (i, &t) in prefix.iter().enumerate() {
            b.add_token(t, i as i32, &[0], false).unwrap();
        }
        ctx.decode(&b, "prefix").unwrap();
        let mut features = Vec::new();
        ctx.append_features(&(0..prefix.len()).collect::<Vec<_>>(), &mut features).unwrap();
        drafter.inject(&features, 0, 0).unwrap();

        let lattice = drafter.draft(&[(last, prefix.len(), 0)], block).unwrap().remove(0);
        let ours: Vec<i32> = Greedy.select(&lattice, block - 1).nodes.iter().map(|n| n.token).collect();
        let request = Request { seq: 0, history: prefix, last, pos: prefix.len(), max_len: block - 1, walk: Walk::Greedy, matching: true, adaptive: false };
        let mut env = Env { target: &ctx, drafter: Some(&mut drafter), cost: &mut cost };
        let proposal = upstream.propose(&mut env, &[request]).unwrap().remove(0).expect("a proposal");
        let Draft::Fixed(tree) = proposal.draft else { panic!("llama.cpp's driver drafts a fixed chain") };
        let theirs: Vec<i32> = tree.nodes.iter().map(|n| n.token).collect();
        assert_eq!(ours, theirs, "prompt {text:?}: our greedy walk differs from llama.cpp's");
        assert_eq!(drafter.extent(0), prefix.len(), "a block stayed in the drafter cache");
        compared += ours.len();
    }
    assert!(compared > 0);
}

#[test]
fn greedy_drafts_what_llama_cpp_drafts() {
    let dir = common::scratch_dir("upstream-synth");
    dflash2::gguf::synth::synth_all(&dir, 5).unwrap();
    let target = load(&dir.join("target.gguf"));
    same_drafts(target.clone(), load(&dir.join("drafter-dflash2.gguf")), &common::PROMPTS[..6]);

    let smol_path = common::real_model(common::SMOLLM2);
    let smol_drafter = dflash2::gguf::synth::synth_for_target(&smol_path, &dir, 0).unwrap().path;
    same_drafts(load(&smol_path), load(&smol_drafter), &common::PROMPTS[..4]);
}

#[test]
fn upstream_mode_is_lossless_and_refuses_targets_without_extraction() {
    let dir = common::scratch_dir("upstream-modes");
    dflash2::gguf::synth::synth_all(&dir, 5).unwrap();
    let target = load(&dir.join("target.gguf"));
    let mut cfg = EngineConfig::new(Default::default(), None);
    cfg.n_ctx = 1024;
    let mut plain = Engine::from_models(target.clone(), None, &cfg).unwrap();
    let mut spec = Engine::from_models(target.clone(), Some(load(&dir.join("drafter-dflash2.gguf"))), &cfg).unwrap();
    for text in &common::PROMPTS[..8] {
        let prompt = target.tokenize(text, true, false).unwrap();
        let base = plain.generate(&prompt, &GenerateOptions { n_predict: 32, draft: common::draft(SelectMode::None, 16), ..Default::default() }, |_| true).unwrap();
        let opts = GenerateOptions { n_predict: 32, draft: common::draft_as(SelectArg::Upstream, Block::Fixed(8)), ..Default::default() };
        let g = spec.generate(&prompt, &opts, |_| true).unwrap();
        assert_eq!(g.tokens, base.tokens, "{text:?}");
        assert!(g.stats.n_drafted > 0);
    }

    // qwen2 has no layer extraction in llama.cpp: its driver would abort, so we refuse.
    let qwen_path = common::real_model(common::QWEN_05B);
    let qwen_drafter = dflash2::gguf::synth::synth_for_target(&qwen_path, &dir, 0).unwrap().path;
    let mut e = Engine::from_models(load(&qwen_path), Some(load(&qwen_drafter)), &cfg).unwrap();
    let prompt = e.model().tokenize("def f(x):", true, false).unwrap();
    let opts = GenerateOptions { n_predict: 8, draft: common::draft_as(SelectArg::Upstream, Block::Fixed(4)), ..Default::default() };
    let err = e.generate(&prompt, &opts, |_| true).unwrap_err().to_string();
    assert!(err.contains("layer extraction"), "{err}");
}
