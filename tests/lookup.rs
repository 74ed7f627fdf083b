//! Context look-up drafting is lossless on real targets: with the drafter (merged into its
//! paths and trees) and alone, in every select mode, at fixed blocks and `--block auto`, the
//! output at T = 0 is plain decoding's, on editing prompts where the look-up is taken often.
//! (Its T > 0 law is checked in `sampling_distribution.rs`.)
mod common;

use dflash2::cli::SelectArg;
use dflash2::engine::{Block, Engine, EngineConfig, GenerateOptions, SelectMode, Upstream};
use common::chat_prompt;
use std::path::PathBuf;

/// Requests that quote what the answer repeats: code to change, JSON to transform.
const EDITING: [&str; 3] = [
    "Add type hints to this function and show it in full:\n```python\ndef add_all(numbers):\n    total = 0\n    for n in numbers:\n        total += n\n    return total\n```",
    "Rename `count_words` to `word_count` and show the whole code:\n```python\ndef count_words(text):\n    words = text.split()\n    return len(words)\n\nprint(count_words(\"a b c\"))\n```",
    "Repeat this JSON with \"age\" changed to 31: {\"name\": \"Ada\", \"age\": 30, \"city\": \"London\", \"tags\": [\"math\", \"code\"]}",
];

/// One way to decode: the select mode (as `--select` names it), the block, and whether the
/// drafter drafts beside the look-up (else the look-up drafts alone).
type Mode = (SelectArg, Block, bool);


/// Every mode with `lookup` gives plain decoding's tokens on every editing prompt; returns
/// the look-up tokens the target took over all of them (the test must exercise the look-up).
fn check(file: &str, drafter: Option<PathBuf>, n_predict: usize, modes: &[Mode]) -> usize {
    let target_path = common::real_model(file);
    let drafter_path = drafter.unwrap_or_else(|| {
        let dir = common::scratch_dir(&format!("lookup-{file}"));
        dflash2::gguf::synth::synth_for_target(&target_path, &dir, 0).expect("synth --target").path
    });
    let mut cfg = EngineConfig::new(target_path, Some(drafter_path));
    cfg.n_ctx = 1024;
    let (target, drafter) = Engine::load_models(&cfg).unwrap();
    let mut plain = Engine::from_models(target.clone(), None, &cfg).unwrap();
    let mut with_drafter = Engine::from_models(target.clone(), drafter, &cfg).unwrap();
    let mut taken = 0;
    for (i, text) in EDITING.iter().enumerate() {
        let prompt = chat_prompt(&target, text);
        let opts = GenerateOptions { n_predict, draft: common::draft(SelectMode::None, 16), ..Default::default() };
        let baseline = plain.generate(&prompt, &opts, |_| true).unwrap();
        for &(select, block, use_drafter) in modes {
            let draft = dflash2::engine::DraftConfig { tree_budget: 12, lookup: true, ..common::draft_as(select, block) };
            let opts = GenerateOptions { n_predict, draft, ..Default::default() };
            let engine = if use_drafter { &mut with_drafter } else { &mut plain };
            let g = engine.generate(&prompt, &opts, |_| true).unwrap();
            assert_eq!(
                g.tokens, baseline.tokens,
                "{file}, {select:?}, block {block:?}, drafter {use_drafter}, prompt {i}: look-up output differs from plain\nplain: {}\nspec:  {}",
                baseline.text, g.text
            );
            assert!(use_drafter || g.stats.from_drafter.drafted == 0, "no drafter, yet drafter tokens");
            taken += g.stats.from_lookup.accepted;
            let s = &g.stats;
            assert!(s.from_lookup.accepted <= s.from_lookup.drafted && s.n_draft_accepted <= s.n_drafted);
            assert_eq!(engine.cache_extents().0, engine.cached_tokens().len(), "target cache out of step");
        }
    }
    taken
}

const ALL_MODES: [Mode; 9] = [
    (SelectArg::Greedy, Block::Fixed(8), true),
    (SelectArg::BestPath, Block::Fixed(8), true),
    (SelectArg::Tree, Block::Fixed(8), true),
    (SelectArg::Greedy, Block::Auto, true),
    (SelectArg::Tree, Block::Auto, true),
    (SelectArg::Greedy, Block::Fixed(8), false),
    (SelectArg::Tree, Block::Fixed(8), false),
    (SelectArg::Greedy, Block::Auto, false),
    (SelectArg::Upstream, Block::Fixed(8), true),
];

#[test]
fn smollm2_lookup_equals_plain_in_every_mode() {
    let drafter = common::shipped_drafter();
    let taken = check(common::SMOLLM2, Some(drafter), 64, &ALL_MODES);
    eprintln!("look-up tokens taken: {taken}");
    assert!(taken > 100, "the target took only {taken} look-up tokens: the look-up went untested");
}

/// Qwen2.5-Coder (qwen2: features through the graph callback) with a random drafter, which
/// the look-up must out-draft (and llama.cpp's driver, which needs native extraction, left out).
#[test]
fn qwen2_coder_lookup_equals_plain_in_every_mode() {
    let taken = check(common::QWEN_05B, None, 40, &ALL_MODES[..8]);
    eprintln!("look-up tokens taken: {taken}");
    assert!(taken > 50, "the target took only {taken} look-up tokens: the look-up went untested");
}

/// llama.cpp's own n-gram drafting (`bench --llama-ngram`'s baselines), in-process through
/// the shim and verified by the engine: plain decoding's tokens with every type, and drafts
/// that the target takes.
#[test]
fn llama_cpp_ngram_drafts_verified_here_equal_plain() {
    let mut cfg = EngineConfig::new(common::real_model(common::SMOLLM2), None);
    cfg.n_ctx = 1024;
    let mut engine = Engine::load(&cfg).unwrap();
    let target = engine.model().clone();
    let mut taken = 0;
    for kind in dflash2::llama::LLAMA_NGRAM_TYPES {
        let (mut drafted, mut accepted) = (0, 0);
        for (i, text) in EDITING.iter().enumerate() {
            let prompt = chat_prompt(&target, text);
            let plain = GenerateOptions { n_predict: 64, draft: common::draft(SelectMode::None, 16), ..Default::default() };
            let baseline = engine.generate(&prompt, &plain, |_| true).unwrap();
            let draft = dflash2::engine::DraftConfig { upstream: Some(Upstream::Ngram(kind)), ..common::draft(SelectMode::Greedy, 16) };
            let opts = GenerateOptions { n_predict: 64, draft, ..Default::default() };
            let g = engine.generate(&prompt, &opts, |_| true).unwrap();
            assert_eq!(g.tokens, baseline.tokens, "llama {kind}, prompt {i}: output differs from plain\nplain: {}\nspec:  {}", baseline.text, g.text);
            assert_eq!(engine.cache_extents().0, engine.cached_tokens().len(), "target cache out of step");
            (drafted, accepted) = (drafted + g.stats.n_drafted, accepted + g.stats.n_draft_accepted);
        }
        eprintln!("llama {kind}: {accepted} of {drafted} drafted tokens taken");
        taken += accepted;
    }
    // (the longer-match types need longer answers to draft at all: `bench` measures them)
    assert!(taken > 20, "the target took {taken} of llama.cpp's drafted tokens: the baselines went untested");
}
