//! Lossless at temperature 0: every selection mode, block size and drafter kind gives
//! exactly the tokens of plain decoding (`--select none`), through llama.cpp itself,
//! and both caches hold exactly the committed tokens afterwards.
mod common;

use dflash2::engine::{Engine, EngineConfig, GenerateOptions, Generation, SelectMode};
use dflash2::llama::{Model, ModelParams, Token};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// The synthetic model set, written once per test process.
fn synth_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = common::scratch_dir("lossless-synth");
        dflash2::gguf::synth::synth_all(&dir, 7).expect("synth models");
        dir
    })
}

fn load(path: &Path) -> Arc<Model> {
    Arc::new(Model::load(path, &ModelParams::default()).unwrap())
}

fn engine(target: &Arc<Model>, drafter: Option<&Arc<Model>>) -> Engine {
    let mut cfg = EngineConfig::new(PathBuf::new(), None);
    cfg.n_ctx = 1024;
    cfg.n_threads = 2;
    Engine::from_models(target.clone(), drafter.cloned(), &cfg).unwrap()
}

fn generate(e: &mut Engine, prompt: &[Token], select: SelectMode, block: usize, n: usize) -> Generation {
    let opts = GenerateOptions { n_predict: n, draft: dflash2::engine::DraftConfig { tree_budget: 12, ..common::draft(select, block) }, ..Default::default() };
    let g = e.generate(prompt, &opts, |_| true).unwrap();
    let (target_len, drafter_len) = e.cache_extents();
    assert_eq!(target_len, e.cached_tokens().len(), "target cache holds uncommitted cells");
    if let Some(d) = drafter_len {
        assert_eq!(d, e.cached_tokens().len(), "drafter cache holds uncommitted cells");
    }
    g
}

fn tokenize(m: &Model, prompts: &[&str]) -> Vec<Vec<Token>> {
    prompts.iter().map(|p| m.tokenize(p, true, false).unwrap()).collect()
}

#[test]
fn speculative_output_equals_plain_on_random_drafters() {
    let dir = synth_dir();
    let target = load(&dir.join("target.gguf"));
    let prompts = tokenize(&target, &common::PROMPTS);
    let mut plain = engine(&target, None);
    let baseline: Vec<Vec<Token>> =
        prompts.iter().map(|p| generate(&mut plain, p, SelectMode::None, 1, 40).tokens).collect();
    assert!(
        baseline.iter().any(|b| b != &baseline[0]),
        "the synthetic target ignores its prompt: the test would prove nothing"
    );

    for drafter_file in ["drafter-dflash1.gguf", "drafter-dflash2.gguf"] {
        let drafter = load(&dir.join(drafter_file));
        let mut spec = engine(&target, Some(&drafter));
        for block in [2, 4, 8, 16] {
            for select in [SelectMode::Greedy, SelectMode::BestPath, SelectMode::Tree] {
                for (i, prompt) in prompts.iter().enumerate() {
                    let g = generate(&mut spec, prompt, select, block, 40);
                    assert_eq!(
                        g.tokens, baseline[i],
                        "{drafter_file}, block {block}, {select:?}, prompt {i}: output differs from plain decoding"
                    );
                    assert!(g.stats.cycles > 0);
                }
            }
        }
    }
}

/// The constructed pair: the cycle target follows a fixed 16-token cycle; its three
/// drafters encode the same cycle, the cycle with one wrong transition, or a wrong cycle.
#[test]
fn constructed_drafters_are_accepted_fully_partly_and_never() {
    let dir = synth_dir();
    let target = load(&dir.join("target-cycle.gguf"));
    let mut plain = engine(&target, None);
    // One prompt per entry point into the cycle: every phase of the wrong transition.
    let prompts: Vec<Vec<Token>> = (0..dflash2::gguf::synth::CYCLE_LEN)
        .map(|i| {
            let mut p = target.tokenize("start", true, false).unwrap();
            p.push(dflash2::gguf::synth::cycle_token(i) as Token);
            p
        })
        .collect();
    let baseline: Vec<Vec<Token>> =
        prompts.iter().map(|p| generate(&mut plain, p, SelectMode::None, 1, 48).tokens).collect();

    let mut hist_by_drafter = Vec::new();
    for name in ["exact", "partial", "wrong"] {
        let drafter = load(&dir.join(format!("drafter-cycle-{name}.gguf")));
        let mut spec = engine(&target, Some(&drafter));
        let mut hist = vec![0usize; 16];
        for block in [2, 4, 8, 16] {
            for (i, p) in prompts.iter().enumerate() {
                let g = generate(&mut spec, p, SelectMode::Greedy, block, 48);
                assert_eq!(g.tokens, baseline[i], "{name}, block {block}, prompt {i}: output differs");
                for (n, &c) in g.stats.accepted_hist.iter().enumerate() {
                    hist[n] += c;
                }
                if name == "exact" && block == 16 {
                    // 48 tokens: 1 from the prefill, then two full blocks of 16 and a last short one.
                    assert!(g.stats.tau() > 10.0, "exact drafter, prompt {i}: tau {}", g.stats.tau());
                }
            }
        }
        hist_by_drafter.push((name, hist));
    }
    let (_, exact) = &hist_by_drafter[0];
    let (_, partial) = &hist_by_drafter[1];
    let (_, wrong) = &hist_by_drafter[2];
    assert_eq!(exact[0], 0, "the exact drafter had a draft rejected outright: {exact:?}");
    assert!(exact[15] > 0, "the exact drafter never filled a 16-block: {exact:?}");
    assert_eq!(wrong.iter().skip(1).sum::<usize>(), 0, "the wrong drafter got tokens accepted: {wrong:?}");
    assert!(wrong[0] > 0);
    for (n, &c) in partial.iter().enumerate() {
        assert!(c > 0, "the partial drafter never had exactly {n} tokens accepted: {partial:?}");
    }
}

#[test]
fn a_prompt_over_the_context_is_a_clear_error() {
    let dir = synth_dir();
    let target = load(&dir.join("target.gguf"));
    let mut cfg = EngineConfig::new(PathBuf::new(), None);
    cfg.n_ctx = 64;
    let mut e = Engine::from_models(target.clone(), None, &cfg).unwrap();
    let prompt: Vec<Token> = target.tokenize(&"lorem ipsum ".repeat(40), true, false).unwrap();
    assert!(prompt.len() >= 64);
    let err = e.generate(&prompt, &GenerateOptions::default(), |_| true).unwrap_err().to_string();
    assert!(err.contains("context"), "{err}");
    // The engine is still usable afterwards.
    let ok = e.generate(&prompt[..10], &GenerateOptions { n_predict: 5, ..Default::default() }, |_| true);
    assert_eq!(ok.unwrap().tokens.len(), 5);
}

#[test]
fn generation_stops_at_the_end_of_the_context() {
    let dir = synth_dir();
    let target = load(&dir.join("target.gguf"));
    let drafter = load(&dir.join("drafter-dflash2.gguf"));
    for drafter in [None, Some(&drafter)] {
        let mut cfg = EngineConfig::new(PathBuf::new(), None);
        cfg.n_ctx = 48;
        let mut e = Engine::from_models(target.clone(), drafter.cloned(), &cfg).unwrap();
        let prompt = target.tokenize("The quick brown fox", true, false).unwrap();
        let opts = GenerateOptions { n_predict: 1000, draft: common::draft(SelectMode::Greedy, 16), ..Default::default() };
        let g = e.generate(&prompt, &opts, |_| true).unwrap();
        assert_eq!(g.finish, dflash2::engine::FinishReason::Context);
        assert_eq!(prompt.len() + g.tokens.len(), e.n_ctx() + 1, "the last token is committed but never decoded");
    }
}

/// Several conversations decoded together: each cycle drafts all their blocks in one
/// drafter decode and verifies them in one target decode. Runs join and leave between
/// cycles; every output still equals plain decoding of that prompt alone.
#[test]
fn batched_slots_equal_plain_decoding_run_alone() {
    let dir = synth_dir();
    let target = load(&dir.join("target.gguf"));
    let prompts = tokenize(&target, &common::PROMPTS[..12]);
    let mut plain = engine(&target, None);
    let n_predict = |i: usize| 12 + 5 * (i % 4);
    let baseline: Vec<Vec<Token>> =
        prompts.iter().enumerate().map(|(i, p)| generate(&mut plain, p, SelectMode::None, 1, n_predict(i)).tokens).collect();

    for drafter_file in ["drafter-dflash1.gguf", "drafter-dflash2.gguf"] {
        let drafter = load(&dir.join(drafter_file));
        let mut cfg = EngineConfig::new(PathBuf::new(), None);
        cfg.n_ctx = 1024;
        cfg.n_threads = 2;
        cfg.n_slots = 4;
        let mut e = Engine::from_models(target.clone(), Some(drafter), &cfg).unwrap();
        let mut queue: std::collections::VecDeque<usize> = (0..prompts.len()).collect();
        let mut active: Vec<(usize, dflash2::engine::Run)> = Vec::new();
        let mut done = 0;
        let mut max_together = 0;
        while done < prompts.len() {
            // Fill free slots between cycles.
            while active.len() < e.n_slots() {
                let Some(i) = queue.pop_front() else { break };
                let slot = (0..e.n_slots()).find(|s| active.iter().all(|(_, r)| r.slot() != *s)).unwrap();
                let select = [SelectMode::Greedy, SelectMode::BestPath, SelectMode::Tree][i % 3];
                let opts = GenerateOptions { n_predict: n_predict(i), draft: common::draft(select, 2 + i % 7), ..Default::default() };
                active.push((i, e.start_in(slot, &prompts[i], &opts).unwrap()));
            }
            max_together = max_together.max(active.len());
            let mut runs: Vec<&mut dflash2::engine::Run> = active.iter_mut().map(|(_, r)| r).collect();
            e.step_all(&mut runs).unwrap();
            active.retain(|(i, r)| {
                if r.finish().is_none() {
                    return true;
                }
                assert_eq!(r.tokens(), &baseline[*i][..], "{drafter_file}, prompt {i}: batched output differs");
                let slot = r.slot();
                let (t, d) = e.cache_extents_in(slot);
                assert_eq!((t, d), (e.cached_tokens_in(slot).len(), Some(e.cached_tokens_in(slot).len())));
                done += 1;
                false
            });
        }
        assert_eq!(max_together, 4, "the slots never ran together");
    }
}

/// A drafter whose numbers are not numbers (its output norm set to NaN) drafts garbage
/// lattices: they are repaired before selection and counted, and the output stays the target's.
#[test]
fn a_drafter_that_outputs_nan_never_changes_the_output() {
    let bad = synth_dir().join("drafter-nan.gguf");
    std::fs::copy(synth_dir().join("drafter-dflash2.gguf"), &bad).unwrap();
    let g = dflash2::gguf::read_gguf(&bad).unwrap();
    let norm = g.tensors.iter().find(|t| t.name == "output_norm.weight" && t.ggml_type == 0).expect("an f32 output norm");
    let mut bytes = std::fs::read(&bad).unwrap();
    for v in bytes[norm.offset as usize..(norm.offset + norm.nbytes) as usize].chunks_exact_mut(4) {
        v.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(&bad, bytes).unwrap();
    let target = load(&synth_dir().join("target.gguf"));
    let drafter = load(&bad);
    let prompts = tokenize(&target, &["The quick brown fox", "def fibonacci(n):"]);
    let mut plain = engine(&target, None);
    let mut spec = engine(&target, Some(&drafter));
    for p in &prompts {
        let want = generate(&mut plain, p, SelectMode::None, 1, 24);
        for select in [SelectMode::Greedy, SelectMode::BestPath, SelectMode::Tree] {
            let got = generate(&mut spec, p, select, 6, 24);
            assert_eq!(got.tokens, want.tokens, "{select:?}");
            assert!(got.stats.repaired_lattices > 0, "{select:?}: the NaN lattices were not counted");
        }
    }
}
