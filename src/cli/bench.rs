//! `dflash2 bench`: every mode on every prompt, alternating, side by side in one process.
//!
//! Modes run one after another on the same prompt before moving to the next run, so a
//! slow moment of the machine hits all modes alike; speedups are ratios of runs measured
//! next to each other. At temperature 0 every mode's tokens are checked against `none`.
use super::SelectArg;
use crate::draft::config::{Block, DraftConfig, Upstream, DEFAULT_LOOKUP_NGRAM};
use crate::engine::{Engine, GenerateOptions, Generation};
use crate::llama::{ChatMessage, Model, Token};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Target, drafter (required unless --lookup), threads, context.
    #[command(flatten)]
    pub models: super::ModelArgs,
    /// Prompts, one JSON object per line with a "prompt" field.
    #[arg(long)]
    pub prompts: PathBuf,
    /// Use at most this many prompts.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Tokens to generate per prompt.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n_predict: usize,
    /// Modes to compare (`none` is always run: it is the baseline).
    #[arg(long, value_delimiter = ',', default_value = "none,greedy,best-path,tree")]
    pub select: Vec<SelectArg>,
    /// Block size or `auto`.
    #[arg(long, default_value = "auto")]
    pub block: Block,
    /// Node budget of token trees.
    #[arg(long, default_value_t = 32)]
    pub tree_budget: usize,
    /// Also run every mode with context look-up drafting (`MODE+lookup`), and the look-up
    /// alone without the drafter (`lookup MODE`, path and tree).
    #[arg(long)]
    pub lookup: bool,
    /// Longest suffix the look-up matches.
    #[arg(long, default_value_t = DEFAULT_LOOKUP_NGRAM)]
    pub lookup_ngram: usize,
    /// Also run llama.cpp's own n-gram drafting of these types, in-process with its default
    /// settings (`llama ngram-mod`, ...): the baselines of the look-up. Comma-separated:
    /// ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache.
    #[arg(long = "llama-ngram", value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(crate::llama::LLAMA_NGRAM_TYPES))]
    pub llama_ngram: Vec<String>,
    /// Runs of every (prompt, mode) pair; medians are over all of them.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Apply the target's chat template to each prompt.
    #[arg(long)]
    pub chat: bool,
    #[command(flatten)]
    pub sampling: super::SamplingArgs,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

/// One way of decoding that the bench compares.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Variant {
    select: SelectArg,
    drafter: bool,
    lookup: bool,
    /// llama.cpp's n-gram drafting of this type instead.
    llama_ngram: Option<&'static str>,
}

impl Variant {
    fn name(&self) -> String {
        if let Some(kind) = self.llama_ngram {
            return format!("llama {kind}");
        }
        let mode = clap::ValueEnum::to_possible_value(&self.select).map(|v| v.get_name().to_string()).unwrap_or_default();
        match (self.drafter, self.lookup) {
            (true, true) => format!("{mode}+lookup"),
            (false, true) => format!("lookup {mode}"),
            _ => mode,
        }
    }

    /// The modes of `args`: `none` first (the baseline), then each mode with the drafter,
    /// with the drafter and the look-up, and with the look-up alone (paths are all alike
    /// there: `greedy` stands for them; llama.cpp's driver needs the drafter).
    fn all(args: &BenchArgs, has_drafter: bool) -> Vec<Variant> {
        let plain = Variant { select: SelectArg::None, drafter: false, lookup: false, llama_ngram: None };
        let mut out = vec![plain];
        let modes = args.select.iter().copied().filter(|&m| m != SelectArg::None);
        for m in modes.clone().filter(|_| has_drafter) {
            out.push(Variant { drafter: true, ..plain.with(m) });
            if args.lookup && m != SelectArg::Upstream {
                out.push(Variant { drafter: true, lookup: true, ..plain.with(m) });
            }
        }
        if args.lookup {
            for m in [SelectArg::Greedy, SelectArg::Tree] {
                if modes.clone().any(|x| x == m || (m == SelectArg::Greedy && x == SelectArg::BestPath)) {
                    out.push(Variant { lookup: true, ..plain.with(m) });
                }
            }
        }
        for kind in &args.llama_ngram {
            let kind = crate::llama::LLAMA_NGRAM_TYPES.into_iter().find(|k| k == kind).expect("clap checked the name");
            out.push(Variant { llama_ngram: Some(kind), ..plain.with(SelectArg::Greedy) });
        }
        out
    }

    fn with(self, select: SelectArg) -> Variant {
        Variant { select, ..self }
    }

    /// How this variant drafts, over the bench's flags.
    fn draft(&self, args: &BenchArgs) -> DraftConfig {
        let (select, upstream) = self.select.config();
        DraftConfig {
            select,
            block: args.block,
            tree_budget: args.tree_budget,
            lookup: self.lookup,
            lookup_ngram: args.lookup_ngram,
            upstream: self.llama_ngram.map(Upstream::Ngram).or(upstream),
        }
    }
}

#[derive(Default, Clone)]
struct ModeResult {
    tps: Vec<f64>,
    speedup: Vec<f64>,
    cycles: usize,
    cycle_tokens: usize,
    drafted: usize,
    accepted: usize,
    draft_ms: f64,
    verify_ms: f64,
    host_ms: f64,
    total_ms: f64,
    mismatches: usize,
    predicted: f64,
    rejections: usize,
    rejected_in_candidates: usize,
    lookup_drafted: usize,
    lookup_accepted: usize,
}

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.models.drafter.is_some() || args.lookup || !args.llama_ngram.is_empty(),
        "bench needs a drafter (-d DRAFTER.gguf), --lookup or --llama-ngram"
    );
    anyhow::ensure!(
        (1..=crate::draft::lookup::MAX_NGRAM).contains(&args.lookup_ngram),
        "--lookup-ngram must be 1..={}",
        crate::draft::lookup::MAX_NGRAM
    );
    let modes = Variant::all(args, args.models.drafter.is_some());

    let spinner = super::loading_spinner("models");
    let cfg = args.models.config(args.models.drafter.clone());
    // Loaded as every other command loads them (the target probed for batch invariance).
    let (target, drafter) = Engine::load_models(&cfg)?;
    spinner.finish_and_clear();
    // `none` and the look-up alone get an engine without a drafter: the true plain baseline.
    let mut plain = Engine::from_models(target.clone(), None, &cfg)?;
    let mut spec = match &drafter {
        Some(d) => Some(Engine::from_models(target.clone(), Some(d.clone()), &cfg)?),
        None => None,
    };
    let (block, adaptive) = args.block.resolve(spec.as_ref().and_then(|e| e.drafter()).map(|d| d.trained_block()));

    let prompts = read_prompts(args, &target)?;
    let mut results = vec![ModeResult::default(); modes.len()];
    let mut progress = super::Progress::new((prompts.len() * args.runs) as u64, "bench");
    for (pi, prompt) in prompts.iter().enumerate() {
        for run in 0..args.runs {
            // At T > 0 each run samples with its own seed: more trajectories behind tau.
            let mut sampling = args.sampling.params();
            sampling.seed = sampling.seed.wrapping_add(run as u64);
            let mut baseline: Option<(Vec<Token>, f64)> = None;
            for (mi, &mode) in modes.iter().enumerate() {
                let verifier = args.sampling.spec_sampling;
                let opts = GenerateOptions { n_predict: args.n_predict, draft: mode.draft(args), sampling: sampling.clone(), verifier, ..Default::default() };
                let engine = match (&mut spec, mode.drafter) {
                    (Some(spec), true) => spec,
                    _ => &mut plain,
                };
                // Each run starts from an empty cache: prompt processing is part of no mode's speed.
                engine.reset()?;
                let g = engine.generate(prompt, &opts, |_| true)?;
                let tps = g.stats.tokens_per_second();
                let r = &mut results[mi];
                match &baseline {
                    None => baseline = Some((g.tokens.clone(), tps)),
                    Some((tokens, base_tps)) => {
                        r.speedup.push(tps / base_tps);
                        // matching reproduces plain decoding at any temperature
                        if verifier.matches(args.sampling.temperature <= 0.0) && &g.tokens != tokens {
                            r.mismatches += 1;
                            tracing::warn!("prompt {pi}: {} output differs from plain decoding", mode.name());
                        }
                    }
                }
                record(r, &g, tps);
            }
            let tau = |r: &ModeResult| r.cycle_tokens as f64 / r.cycles.max(1) as f64;
            let taus: Vec<String> =
                modes.iter().zip(&results).map(|(m, r)| format!("{} {:.2}", m.name(), tau(r))).collect();
            progress.inc(&format!("(tau so far: {})", taus.join(", ")));
        }
    }
    progress.finish();
    report(args, &modes, &results, prompts.len(), block, adaptive)
}

fn record(r: &mut ModeResult, g: &Generation, tps: f64) {
    let s = &g.stats;
    r.tps.push(tps);
    r.cycles += s.cycles;
    r.cycle_tokens += s.cycle_tokens;
    r.drafted += s.n_drafted;
    r.accepted += s.n_draft_accepted;
    r.draft_ms += s.draft_ms;
    r.verify_ms += s.verify_ms;
    r.host_ms += s.host_ms;
    r.total_ms += s.total_ms - s.prefill_ms;
    r.predicted += s.prediction.predicted_accepted;
    r.rejections += s.prediction.rejections;
    r.rejected_in_candidates += s.prediction.rejected_in_candidates;
    r.lookup_drafted += s.from_lookup.drafted;
    r.lookup_accepted += s.from_lookup.accepted;
}

fn read_prompts(args: &BenchArgs, target: &Model) -> anyhow::Result<Vec<Vec<Token>>> {
    let template = if args.chat { Some(args.models.template.load(target)?) } else { None };
    let text = std::fs::read_to_string(&args.prompts)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", args.prompts.display()))?;
    let mut prompts = Vec::new();
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| anyhow::anyhow!("{} line {}: {e}", args.prompts.display(), i + 1))?;
        let p = v["prompt"]
            .as_str()
            .ok_or_else(|| anyhow::anyhow!("{} line {}: no \"prompt\" string", args.prompts.display(), i + 1))?;
        let tokens = if let Some(template) = &template {
            let msgs = [ChatMessage { role: "user".into(), content: p.into() }];
            template.tokens(target, &msgs)?
        } else {
            target.tokenize(p, true, false)?
        };
        prompts.push(tokens);
        if Some(prompts.len()) == args.limit {
            break;
        }
    }
    anyhow::ensure!(!prompts.is_empty(), "{} holds no prompts", args.prompts.display());
    Ok(prompts)
}

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    }
}

fn report(
    args: &BenchArgs,
    modes: &[Variant],
    results: &[ModeResult],
    n_prompts: usize,
    block: usize,
    adaptive: bool,
) -> anyhow::Result<()> {
    let rows: Vec<serde_json::Value> = modes
        .iter()
        .zip(results)
        .map(|(mode, r)| {
            let busy = (r.draft_ms + r.verify_ms + r.host_ms).max(1e-9);
            serde_json::json!({
                "select": mode.name(),
                "tau": r.cycle_tokens as f64 / r.cycles.max(1) as f64,
                "acceptance": r.accepted as f64 / r.drafted.max(1) as f64,
                "tokens_per_second_median": median(&r.tps),
                "speedup_median": if mode.select == SelectArg::None { 1.0 } else { median(&r.speedup) },
                "draft_share": r.draft_ms / busy,
                "verify_share": r.verify_ms / busy,
                "host_share": r.host_ms / busy,
                "host_ms_per_cycle": r.host_ms / r.cycles.max(1) as f64,
                "mismatches": r.mismatches,
                "predicted_accepted": r.predicted,
                "observed_accepted": r.accepted,
                "rejections": r.rejections,
                "lookup_drafted": r.lookup_drafted,
                "lookup_accepted": r.lookup_accepted,
                "target_token_in_candidates_at_rejection": r.rejected_in_candidates as f64 / r.rejections.max(1) as f64,
                "samples": r.tps.len(),
            })
        })
        .collect();
    let block_desc = if adaptive { format!("auto (max {block})") } else { block.to_string() };
    if args.json {
        let out = serde_json::json!({
            "prompts": n_prompts, "runs": args.runs, "n_predict": args.n_predict,
            "block": block_desc, "temperature": args.sampling.temperature, "modes": rows,
        });
        println!("{out}");
        return Ok(());
    }
    println!(
        "{n_prompts} prompts x {} runs, {} tokens each, block {block_desc}, temperature {}",
        args.runs, args.n_predict, args.sampling.temperature
    );
    println!("| mode | tau | accepted/drafted | tok/s (median) | speedup vs none (median) | draft / verify / host time | host ms/cycle | accepted: predicted / observed | target token in candidates at rejection | look-up accepted / drafted | mismatches |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {:.2} | {:.2} | {:.1} | {:.2}x | {:.0}% / {:.0}% / {:.1}% | {:.3} | {:.0} / {} | {:.0}% | {} / {} | {} |",
            r["select"].as_str().unwrap_or("?"),
            r["tau"].as_f64().unwrap_or(0.0),
            r["acceptance"].as_f64().unwrap_or(0.0),
            r["tokens_per_second_median"].as_f64().unwrap_or(0.0),
            r["speedup_median"].as_f64().unwrap_or(0.0),
            100.0 * r["draft_share"].as_f64().unwrap_or(0.0),
            100.0 * r["verify_share"].as_f64().unwrap_or(0.0),
            100.0 * r["host_share"].as_f64().unwrap_or(0.0),
            r["host_ms_per_cycle"].as_f64().unwrap_or(0.0),
            r["predicted_accepted"].as_f64().unwrap_or(0.0),
            r["observed_accepted"],
            100.0 * r["target_token_in_candidates_at_rejection"].as_f64().unwrap_or(0.0),
            r["lookup_accepted"],
            r["lookup_drafted"],
            r["mismatches"],
        );
    }
    Ok(())
}
