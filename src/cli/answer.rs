//! `dflash2 answer -m T.gguf --prompts P.jsonl --out A.jsonl`: the target answers a drafter's
//! training prompts itself, many conversations decoded together. Each step is ONE target decode
//! for every active conversation (the engine's slots, as the server batches requests), so the
//! corpus grows at the target's batch speed, not one conversation at a time.
//!
//! Input rows are JSON objects with a `"prompt"` (other fields are kept). Output rows add
//! `"answer"` (text), `"answer_tokens"` (the target's token ids), `"sample"` and, for sampled
//! answers, `"temperature"` and `"seed"`. Sample 0 of a prompt is the greedy answer; `--samples K`
//! adds K-1 answers sampled at `--temp` (diversity; the trainer keeps a label only where the text
//! follows the target's greedy path). Resumable: (prompt, sample) pairs already in `--out` are
//! skipped, and every answer is appended as soon as it is done.
use std::collections::{HashSet, VecDeque};
use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context as _, Result};
use serde_json::{json, Value};

use crate::draft::config::{DraftConfig, SelectMode};
use crate::engine::{Engine, GenerateOptions, Run};
use crate::llama::ChatMessage;

#[derive(clap::Args, Debug)]
pub struct AnswerArgs {
    /// Target model (GGUF): the model whose answers the drafter will learn.
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// JSONL of prompts: one object with a "prompt" string per line.
    #[arg(long)]
    pub prompts: PathBuf,
    /// JSONL to append the answers to (resumed if it exists).
    #[arg(long)]
    pub out: PathBuf,
    /// Conversations decoded together.
    #[arg(long, default_value_t = 8)]
    pub parallel: usize,
    /// Longest answer, in tokens.
    #[arg(short = 'n', long = "n-predict", default_value_t = 256)]
    pub n_predict: usize,
    /// Answers per prompt: the greedy one, then samples at --temp.
    #[arg(long, default_value_t = 1)]
    pub samples: usize,
    /// Temperature of the sampled answers (samples after the first).
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Base seed of the sampled answers (each gets its own).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Context per conversation, in tokens.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 1024)]
    pub ctx_size: usize,
    /// CPU threads.
    #[arg(short = 't', long = "threads", default_value_t = crate::engine::default_threads())]
    pub threads: i32,
    /// Stop after this many answers (0: all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    #[command(flatten)]
    pub template: super::TemplateArgs,
}

/// One answer to write: which prompt row, which sample.
struct Job {
    row: Value,
    sample: usize,
}

pub fn run(args: &AnswerArgs) -> Result<()> {
    anyhow::ensure!(args.parallel >= 1 && args.samples >= 1, "--parallel and --samples must be at least 1");
    let text = std::fs::read_to_string(&args.prompts).with_context(|| format!("reading {}", args.prompts.display()))?;
    let done = answered(&args.out)?;
    let mut todo = VecDeque::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let row: Value = serde_json::from_str(line).with_context(|| format!("{} line {}", args.prompts.display(), i + 1))?;
        let prompt = row["prompt"].as_str().with_context(|| format!("{} line {}: no \"prompt\" string", args.prompts.display(), i + 1))?;
        for sample in 0..args.samples {
            if !done.contains(&(prompt.to_string(), sample)) {
                todo.push_back(Job { row: row.clone(), sample });
            }
        }
    }
    if args.limit > 0 {
        todo.truncate(args.limit);
    }
    eprintln!("{} answers to write ({} already in {})", todo.len(), done.len(), args.out.display());

    let mut cfg = crate::engine::EngineConfig::new(args.model.clone(), None);
    cfg.n_ctx = args.ctx_size;
    cfg.n_threads = args.threads;
    cfg.n_slots = args.parallel;
    let mut engine = Engine::load(&cfg)?;
    let model = engine.model().clone();
    let template = args.template.load(&model)?;
    let mut out = std::fs::OpenOptions::new().create(true).append(true).open(&args.out)?;

    let mut slots: Vec<Option<(Job, Run)>> = (0..args.parallel).map(|_| None).collect();
    let mut progress = super::Progress::new(todo.len() as u64, "answer");
    let (started, mut n_tokens) = (std::time::Instant::now(), 0usize);
    loop {
        // Fill free slots; a new conversation's prompt is decoded as it joins.
        for (slot, entry) in slots.iter_mut().enumerate() {
            if entry.is_some() {
                continue;
            }
            let Some(job) = todo.pop_front() else { break };
            let msgs = [ChatMessage { role: "user".into(), content: job.row["prompt"].as_str().unwrap_or_default().into() }];
            let prompt = template.tokens(&model, &msgs)?;
            let draft = DraftConfig { select: SelectMode::None, ..DraftConfig::default() };
            let mut opts = GenerateOptions { n_predict: args.n_predict, draft, ..Default::default() };
            if job.sample > 0 {
                opts.sampling.temperature = args.temp;
                // one seed per (prompt, sample): reruns and resumed runs write the same answers
                opts.sampling.seed = sample_seed(args.seed, job.row["prompt"].as_str().unwrap_or_default(), job.sample);
            }
            if prompt.len() + 1 >= engine.n_ctx() {
                tracing::warn!("skipping a prompt of {} tokens: over --ctx-size", prompt.len());
                progress.inc("(skipped a long prompt)");
                continue;
            }
            engine.reset_slot(slot)?;
            let run = engine.start_in(slot, &prompt, &opts)?;
            *entry = Some((job, run));
        }
        if slots.iter().all(Option::is_none) {
            break;
        }
        let mut runs: Vec<&mut Run> =
            slots.iter_mut().flatten().map(|(_, r)| r).filter(|r| r.finish().is_none()).collect();
        if !runs.is_empty() {
            engine.step_all(&mut runs)?;
        }
        for slot in slots.iter_mut() {
            if slot.as_ref().is_some_and(|(_, r)| r.finish().is_some()) {
                let (job, run) = slot.take().expect("checked");
                n_tokens += run.tokens().len();
                let mut row = job.row;
                row["answer"] = json!(run.text());
                row["answer_tokens"] = json!(run.tokens());
                row["sample"] = json!(job.sample);
                if job.sample > 0 {
                    row["temperature"] = json!(run.options().sampling.temperature);
                    row["seed"] = json!(run.options().sampling.seed);
                }
                writeln!(out, "{row}")?;
                out.flush()?;
                let tps = n_tokens as f64 / started.elapsed().as_secs_f64();
                progress.inc(&format!("({n_tokens} tokens, {tps:.0} tok/s)"));
            }
        }
    }
    progress.finish();
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "{n_tokens} answer tokens in {secs:.1} s: {:.1} tok/s with {} conversations decoded together",
        n_tokens as f64 / secs.max(1e-9),
        args.parallel
    );
    Ok(())
}

/// The seed of sample `sample` of `prompt`: FNV-1a over both, from the base seed.
fn sample_seed(base: u64, prompt: &str, sample: usize) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325 ^ base;
    for b in prompt.bytes().chain(sample.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// (prompt, sample) pairs already answered in `path` (none if it does not exist).
fn answered(path: &std::path::Path) -> Result<HashSet<(String, usize)>> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(HashSet::new()) };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            let v: Value = serde_json::from_str(l).with_context(|| format!("{} line {}", path.display(), i + 1))?;
            let prompt = v["prompt"].as_str().unwrap_or_default().to_string();
            Ok((prompt, v["sample"].as_u64().unwrap_or(0) as usize))
        })
        .collect()
}
