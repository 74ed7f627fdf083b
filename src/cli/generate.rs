//! `dflash2 generate`: one prompt, one completion, optionally as JSON.
use crate::engine::{self, Engine, EngineConfig, FeatureMode, GenerateOptions, SelectMode};
use crate::llama::ChatMessage;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// Target model (GGUF).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// DFlash / DFlash 2 drafter (GGUF); without it decoding is plain.
    #[arg(short = 'd', long = "drafter")]
    pub drafter: Option<PathBuf>,
    /// The prompt text.
    #[arg(short = 'p', long = "prompt")]
    pub prompt: String,
    /// Tokens to generate at most.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n_predict: usize,
    /// Block size: the anchor plus at most BLOCK-1 drafted tokens per cycle, or `auto`
    /// to choose each cycle's length from measured costs (up to the trained block size).
    #[arg(long, default_value = "auto")]
    pub block: super::BlockArg,
    /// How drafts are picked from the drafter's candidates (`none`: plain decoding).
    #[arg(long, value_enum, default_value_t = SelectMode::Greedy)]
    pub select: SelectMode,
    /// Node budget of a token tree (`--select tree`).
    #[arg(long, default_value_t = 32)]
    pub tree_budget: usize,
    /// Apply the target's chat template to the prompt (as the user's message).
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat.
    #[arg(long)]
    pub system: Option<String>,
    /// Stop when the output contains this text (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// CPU threads.
    #[arg(short = 't', long = "threads", default_value_t = engine::default_threads())]
    pub threads: i32,
    /// Context size in tokens.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Layers to offload to a GPU (GPU builds only).
    #[arg(long = "gpu-layers", default_value_t = 999)]
    pub gpu_layers: i32,
    /// Where the target's layer inputs come from.
    #[arg(long, value_enum, default_value_t = FeatureMode::Auto)]
    pub features: FeatureMode,
    #[command(flatten)]
    pub sampling: super::SamplingArgs,
    /// Print one JSON object with the text, tokens and statistics.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    let drafter = if args.select == SelectMode::None { None } else { args.drafter.clone() };
    if args.select != SelectMode::None && drafter.is_none() {
        anyhow::bail!("--select {:?} needs a drafter (-d DRAFTER.gguf), or use --select none", args.select);
    }
    let mut cfg = EngineConfig::new(args.model.clone(), drafter);
    cfg.n_ctx = args.ctx_size;
    cfg.n_threads = args.threads;
    cfg.n_gpu_layers = args.gpu_layers;
    cfg.features = args.features;

    let spinner = super::loading_spinner("models");
    let engine = Engine::load(&cfg);
    spinner.finish_and_clear();
    let mut engine = engine?;

    let text = if args.chat {
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(ChatMessage { role: "system".into(), content: s.clone() });
        }
        messages.push(ChatMessage { role: "user".into(), content: args.prompt.clone() });
        engine.model().apply_chat_template(&messages, true)?
    } else {
        args.prompt.clone()
    };
    let prompt = engine.model().tokenize(&text, true, args.chat)?;

    let trained = engine.drafter().map_or(1, |d| d.trained_block());
    let (block, adaptive) = args.block.resolve(trained);
    if args.select != SelectMode::None && block < 2 {
        anyhow::bail!("--block must be at least 2 (the anchor plus one drafted token)");
    }
    let opts = GenerateOptions {
        n_predict: args.n_predict,
        select: args.select,
        block,
        adaptive,
        tree_budget: args.tree_budget,
        stop: args.stop.clone(),
        sampling: args.sampling.params(),
        ..Default::default()
    };

    let model = engine.model().clone();
    let mut stdout = std::io::stdout().lock();
    let stream = !args.json;
    let mut pending = Vec::new();
    let gen = engine.generate(&prompt, &opts, |tokens| {
        if stream {
            // Print whole UTF-8 characters only; a token may end inside one.
            for &t in tokens {
                if !model.is_eog(t) {
                    pending.extend_from_slice(&model.token_bytes(t, false));
                }
            }
            let valid = match std::str::from_utf8(&pending) {
                Ok(_) => pending.len(),
                Err(e) => e.valid_up_to(),
            };
            let _ = stdout.write_all(&pending[..valid]);
            let _ = stdout.flush();
            pending.drain(..valid);
        }
        true
    })?;
    if args.json {
        let s = &gen.stats;
        let out = serde_json::json!({
            "text": gen.text,
            "tokens": gen.tokens,
            "n_prompt": s.n_prompt,
            "n_generated": s.n_generated,
            "finish_reason": gen.finish,
            "tau": s.tau(),
            "cycles": s.cycles,
            "n_drafted": s.n_drafted,
            "n_draft_accepted": s.n_draft_accepted,
            "accepted_hist": s.accepted_hist,
            "tokens_per_second": s.tokens_per_second(),
            "prefill_ms": s.prefill_ms,
            "draft_ms": s.draft_ms,
            "verify_ms": s.verify_ms,
            "host_ms": s.host_ms,
            "total_ms": s.total_ms,
            "select": args.select,
            "block": block,
            "adaptive": adaptive,
        });
        writeln!(stdout, "{out}")?;
    } else {
        writeln!(stdout)?;
        let s = &gen.stats;
        eprintln!(
            "{} tokens, {:.1} tok/s, tau {:.2} ({} cycles), finish: {:?}",
            s.n_generated,
            s.tokens_per_second(),
            s.tau(),
            s.cycles,
            gen.finish
        );
    }
    if gen.finish == engine::FinishReason::Context {
        eprintln!("warning: stopped because the context ({} tokens) is full", engine.n_ctx());
    }
    Ok(())
}
