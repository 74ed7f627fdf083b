//! Lossless on real targets from PyPI, each paired with a drafter that `synth --target`
//! writes for it: SmolLM2 (llama arch, llama.cpp's own feature extraction; also `upstream`) and
//! Qwen2.5-Coder (qwen2, features captured by the graph callback).
mod common;

use dflash2::engine::{Engine, EngineConfig, GenerateOptions, SelectMode};
use dflash2::llama::{ChatMessage, Model, ModelParams, Token};
use std::path::Path;
use std::sync::Arc;

const PROMPTS: [&str; 5] = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of Japan? Answer in one sentence.",
    "List three uses of a paperclip.",
    "def quicksort(arr):",
    "Explain recursion to a child.",
];

fn check_target(file: &str, n_predict: usize, modes: &[(SelectMode, usize)]) {
    let target_path = common::real_model(file);
    let dir = common::scratch_dir(&format!("real-{file}"));
    let drafter_path = dflash2::gguf::synth::synth_for_target(&target_path, &dir, 0).expect("synth --target").path;
    dflash2::gguf::check_pair_files(&target_path, &drafter_path).expect("the synthesized drafter pairs");

    let target = Arc::new(Model::load(&target_path, &ModelParams::default()).unwrap());
    let drafter = Arc::new(Model::load(&drafter_path, &ModelParams::default()).unwrap());
    let mut cfg = EngineConfig::new(target_path.clone(), None);
    cfg.n_ctx = 1024;
    let mut plain = Engine::from_models(target.clone(), None, &cfg).unwrap();
    let mut spec = Engine::from_models(target.clone(), Some(drafter), &cfg).unwrap();

    for (i, text) in PROMPTS.iter().enumerate() {
        let prompt = chat_prompt(&target, text);
        let opts = GenerateOptions { n_predict, select: SelectMode::None, ..Default::default() };
        let baseline = plain.generate(&prompt, &opts, |_| true).unwrap();
        assert!(!baseline.text.trim().is_empty(), "{file}: empty baseline for prompt {i}");
        for &(select, block) in modes {
            let opts = GenerateOptions { n_predict, select, block, tree_budget: 8, ..Default::default() };
            let g = spec.generate(&prompt, &opts, |_| true).unwrap();
            assert_eq!(
                g.tokens, baseline.tokens,
                "{file}, {select:?}, block {block}, prompt {i}: speculative output differs from plain\nplain: {}\nspec:  {}",
                baseline.text, g.text
            );
            assert!(g.stats.n_drafted > 0, "{file}: nothing was drafted");
            let (t, d) = spec.cache_extents();
            assert_eq!((t, d), (spec.cached_tokens().len(), Some(spec.cached_tokens().len())));
        }
    }
}

fn chat_prompt(target: &Model, text: &str) -> Vec<Token> {
    let msgs = [ChatMessage { role: "user".into(), content: text.into() }];
    let rendered = target.apply_chat_template(&msgs, true).unwrap();
    target.tokenize(&rendered, true, true).unwrap()
}

#[test]
fn smollm2_speculative_equals_plain() {
    check_target(
        common::SMOLLM2,
        48,
        &[(SelectMode::Greedy, 16), (SelectMode::Greedy, 4), (SelectMode::BestPath, 8), (SelectMode::Tree, 6), (SelectMode::Upstream, 8)],
    );
}

#[test]
fn qwen2_coder_speculative_equals_plain() {
    assert!(Path::new(&common::real_model(common::QWEN_05B)).is_file());
    check_target(common::QWEN_05B, 24, &[(SelectMode::Greedy, 4), (SelectMode::BestPath, 4), (SelectMode::Tree, 4)]);
}
