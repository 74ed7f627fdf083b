//! Lossless at temperature > 0: speculative sampling draws from the target's own
//! distribution. The first generated tokens of thousands of seeded runs are compared
//! between plain and speculative decoding with a two-sample chi-square test under rejection
//! sampling, and must be plain decoding's, seed for seed, under matching (its law is the
//! target's by construction); the same test must reject a deliberately broken verifier.
mod common;

use dflash2::engine::{DraftConfig, Engine, EngineConfig, GenerateOptions, SelectMode, Verifier};
use dflash2::llama::{Model, ModelParams, Token};
use dflash2::sampling::SamplingParams;
use std::path::PathBuf;
use std::sync::Arc;

const RUNS: u64 = 2000;
const N_TOKENS: usize = 4;

struct Fixture {
    target: Arc<Model>,
    drafter: Arc<Model>,
    prompt: Vec<Token>,
}

/// SmolLM2 with the shipped, trained drafter, whose candidates often hold the target's
/// token: the only pairing here where token trees keep side branches at T > 0.
fn smollm2_fixture(text: &str) -> Fixture {
    let drafter_path = common::shipped_drafter();
    let cfg = EngineConfig::new(common::real_model(common::SMOLLM2), Some(drafter_path));
    let (target, drafter) = Engine::load_models(&cfg).unwrap();
    let drafter = drafter.unwrap();
    let prompt = common::chat_prompt(&target, text);
    Fixture { target, drafter, prompt }
}

fn fixture() -> Fixture {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = common::scratch_dir("sampling-synth");
        dflash2::gguf::synth::synth_all(&dir, 11).unwrap();
        dir
    });
    let target = Arc::new(Model::load(&dir.join("target.gguf"), &ModelParams::default()).unwrap());
    let drafter = Arc::new(Model::load(&dir.join("drafter-dflash2.gguf"), &ModelParams::default()).unwrap());
    let prompt = target.tokenize("The old lighthouse keeper", true, false).unwrap();
    Fixture { target, drafter, prompt }
}

/// Tokens at positions 1..=N_TOKENS over `runs` seeds; a run that ended (end of
/// generation sampled) reads -1 at the positions it did not reach.
fn sample_runs(f: &Fixture, runs: u64, speculative: bool, select: SelectMode, temp: f32, verifier: Verifier) -> Vec<Vec<Token>> {
    sample_runs_counting_side_branches(f, runs, speculative, select, temp, verifier).0
}

/// [`sample_runs`], and how many drafted tokens off the first-child path of a token tree
/// were accepted over all runs.
fn sample_runs_counting_side_branches(
    f: &Fixture,
    runs: u64,
    speculative: bool,
    select: SelectMode,
    temp: f32,
    verifier: Verifier,
) -> (Vec<Vec<Token>>, usize) {
    let select = if speculative { select } else { SelectMode::None };
    let (samples, stats) = sample(f, runs, speculative, select, false, temp, verifier, None);
    (samples, stats.redecoded)
}

/// Tokens at positions 1..=N_TOKENS over `runs` seeds (block 4, trees of 6 nodes), with the
/// drafter or without, with the context look-up or without, under a grammar or not; and the
/// summed statistics.
#[allow(clippy::too_many_arguments)]
fn sample(
    f: &Fixture,
    runs: u64,
    with_drafter: bool,
    select: SelectMode,
    lookup: bool,
    temp: f32,
    verifier: Verifier,
    grammar: Option<&str>,
) -> (Vec<Vec<Token>>, dflash2::engine::Stats) {
    let mut cfg = EngineConfig::new(PathBuf::new(), None);
    cfg.n_ctx = 256;
    cfg.n_threads = 2;
    let drafter = with_drafter.then(|| f.drafter.clone());
    let mut e = Engine::from_models(f.target.clone(), drafter, &cfg).unwrap();
    let mut total = dflash2::engine::Stats::default();
    let samples = (0..runs)
        .map(|seed| {
            let opts = GenerateOptions {
                n_predict: N_TOKENS,
                draft: DraftConfig { tree_budget: 6, lookup, ..common::draft(select, 4) },
                sampling: SamplingParams { temperature: temp, top_k: 0, top_p: 0.9, min_p: 0.0, seed, ..Default::default() },
                verifier,
                grammar: grammar.map(str::to_string),
                ..Default::default()
            };
            let generation = e.generate(&f.prompt, &opts, |_| true).unwrap();
            total.n_drafted += generation.stats.n_drafted;
            total.n_draft_accepted += generation.stats.n_draft_accepted;
            total.redecoded += generation.stats.redecoded;
            total.from_lookup.drafted += generation.stats.from_lookup.drafted;
            total.from_lookup.accepted += generation.stats.from_lookup.accepted;
            let mut tokens = generation.tokens;
            tokens.resize(N_TOKENS, -1);
            tokens
        })
        .collect();
    (samples, total)
}

#[test]
fn speculative_sampling_matches_plain_sampling() {
    let f = fixture();
    for temp in [0.7f32, 1.0] {
        let plain = sample_runs(&f, RUNS, false, SelectMode::None, temp, Verifier::Rejection);
        let distinct: std::collections::HashSet<_> = plain.iter().map(|r| r[1]).collect();
        assert!(distinct.len() >= 5, "T={temp}: the target is nearly deterministic, the test would be weak");
        for select in [SelectMode::Greedy, SelectMode::BestPath, SelectMode::Tree] {
            let spec = sample_runs(&f, RUNS, true, select, temp, Verifier::Rejection);
            if let Err(e) = common::same_distribution(N_TOKENS, &plain, &spec) {
                panic!("T={temp}, {select:?}: speculative sampling differs from plain sampling: {e}");
            }
        }
    }
    for select in [SelectMode::Greedy, SelectMode::Tree] {
        let plain = sample_runs(&f, RUNS, false, SelectMode::None, 1.0, Verifier::Match);
        let matched = sample_runs(&f, RUNS, true, select, 1.0, Verifier::Match);
        assert!(plain == matched, "{select:?}: matching gave other tokens than plain sampling for some seeds");
    }
}

/// Under a grammar the target law is the masked one: the random drafter proposes tokens the
/// grammar forbids, which sampled drafts keep and rejection sampling must reject, and the
/// output still follows plain sampling's law under the same grammar.
#[test]
fn speculative_sampling_under_a_grammar_matches_plain_sampling() {
    let f = fixture();
    let grammar = Some("root ::= [a-m ]+");
    let (plain, _) = sample(&f, RUNS, false, SelectMode::None, false, 1.0, Verifier::Rejection, grammar);
    let distinct: std::collections::HashSet<_> = plain.iter().map(|r| r[1]).collect();
    assert!(distinct.len() >= 5, "the grammar leaves the target nearly deterministic, the test would be weak");
    let text = f.target.detokenize(&plain[0].iter().copied().filter(|&t| t >= 0).collect::<Vec<_>>(), false);
    assert!(text.chars().all(|c| ('a'..='m').contains(&c) || c == ' '), "{text:?} breaks the grammar");
    for select in [SelectMode::Greedy, SelectMode::Tree] {
        let (spec, stats) = sample(&f, RUNS, true, select, false, 1.0, Verifier::Rejection, grammar);
        if let Err(e) = common::same_distribution(N_TOKENS, &plain, &spec) {
            panic!("{select:?}: speculative sampling under a grammar differs from plain sampling: {e}");
        }
        assert!(stats.n_drafted > 0 && stats.n_draft_accepted > 0, "{select:?}: drafts went untested");
    }
    let (matched, stats) = sample(&f, RUNS, true, SelectMode::Tree, false, 1.0, Verifier::Match, grammar);
    assert!(plain == matched, "matching under a grammar gave other tokens than plain sampling for some seeds");
    assert!(stats.n_draft_accepted > 0, "matching: drafts went untested");
}

#[test]
fn a_verifier_that_accepts_every_draft_fails_the_test() {
    let f = fixture();
    let plain = sample_runs(&f, RUNS, false, SelectMode::None, 1.0, Verifier::Rejection);
    let broken = sample_runs(&f, RUNS, true, SelectMode::Greedy, 1.0, Verifier::AcceptAll);
    assert!(common::same_distribution(N_TOKENS, &plain, &broken).is_err(), "the test cannot tell a broken verifier apart");
}

#[test]
fn the_same_seed_gives_the_same_output() {
    let f = fixture();
    let a = sample_runs(&f, 200, true, SelectMode::Greedy, 0.8, Verifier::Rejection);
    let b = sample_runs(&f, 200, true, SelectMode::Greedy, 0.8, Verifier::Rejection);
    assert_eq!(a, b);
}

/// The same check on a real target: SmolLM2 with the trained drafter at T = 1, chains and
/// token trees. The random drafter above is almost never right, so only here do trees
/// keep later-drawn siblings, which the test requires.
#[test]
fn smollm2_chains_and_trees_sample_the_target_law() {
    let f = smollm2_fixture("Write a Python function that reverses a string.");
    let runs = 1500;
    let plain = sample_runs(&f, runs, false, SelectMode::None, 1.0, Verifier::Rejection);
    let distinct: std::collections::HashSet<_> = plain.iter().map(|r| r[0]).collect();
    assert!(distinct.len() >= 5, "the target is nearly deterministic, the test would be weak");
    for select in [SelectMode::Greedy, SelectMode::Tree] {
        let (spec, side_branch_tokens) =
            sample_runs_counting_side_branches(&f, runs, true, select, 1.0, Verifier::Rejection);
        if let Err(e) = common::same_distribution(N_TOKENS, &plain, &spec) {
            panic!("{select:?}: speculative sampling differs from plain sampling: {e}");
        }
        if select == SelectMode::Tree {
            assert!(side_branch_tokens > 50, "only {side_branch_tokens} side-branch tokens accepted: trees went untested");
        }
    }
    let (matched, side_branch_tokens) = sample_runs_counting_side_branches(&f, runs, true, SelectMode::Tree, 1.0, Verifier::Match);
    assert!(plain == matched, "trees, matching: other tokens than plain sampling for some seeds");
    assert!(side_branch_tokens > 0, "matching accepted no side branch: trees went untested");
}

/// Look-up drafts are one-hot proposals verified by the same rejection sampling: on a request
/// to repeat a list, where the look-up proposes the list's next items and is often taken, alone
/// and beside the drafter (chains and trees, where the look-up's chain may replace the tree),
/// the output still follows the target's law.
#[test]
fn smollm2_lookup_samples_the_target_law() {
    let f = smollm2_fixture("Here is a list: apple, banana, cherry, grape, lemon, mango, peach. Write the list again.");
    let runs = 1200;
    let (plain, _) = sample(&f, runs, false, SelectMode::None, false, 1.0, Verifier::Rejection, None);
    let distinct: std::collections::HashSet<_> = plain.iter().map(|r| r[0]).collect();
    assert!(distinct.len() >= 3, "the target is nearly deterministic, the test would be weak");
    for (with_drafter, select) in [(false, SelectMode::Greedy), (true, SelectMode::Tree)] {
        let (spec, stats) = sample(&f, runs, with_drafter, select, true, 1.0, Verifier::Rejection, None);
        if let Err(e) = common::same_distribution(N_TOKENS, &plain, &spec) {
            panic!("look-up, drafter {with_drafter}, {select:?}: speculative sampling differs from plain sampling: {e}");
        }
        assert!(
            stats.from_lookup.accepted > 150,
            "drafter {with_drafter}, {select:?}: only {} look-up tokens taken: the look-up went untested",
            stats.from_lookup.accepted
        );
    }
}
