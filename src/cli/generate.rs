//! `dflash2 generate`: one prompt, one completion, optionally as JSON.
use crate::engine::FinishReason;
use crate::llama::ChatMessage;
use crate::text::Utf8Stream;
use std::io::Write;

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: super::EngineArgs,
    /// The prompt text.
    #[arg(short = 'p', long = "prompt")]
    pub prompt: String,
    /// Tokens to generate at most.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n_predict: usize,
    /// Apply the target's chat template to the prompt (as the user's message).
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat.
    #[arg(long)]
    pub system: Option<String>,
    /// Stop when the output contains this text (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Print one JSON object with the text, tokens and statistics.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    let mut engine = args.engine.load()?;
    let text = if args.chat {
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(ChatMessage { role: "system".into(), content: s.clone() });
        }
        messages.push(ChatMessage { role: "user".into(), content: args.prompt.clone() });
        args.engine.models.template.load(engine.model())?.render(&messages, true)?
    } else {
        args.prompt.clone()
    };
    let prompt = engine.model().tokenize(&text, true, args.chat)?;
    let opts = args.engine.options(&engine, args.n_predict, args.stop.clone())?;
    let (block, adaptive) = opts.draft.block.resolve(engine.drafter().map(|d| d.trained_block()));

    let model = engine.model().clone();
    let mut stdout = std::io::stdout().lock();
    let mut utf8 = Utf8Stream::default();
    let gen = engine.generate(&prompt, &opts, |tokens| {
        if !args.json {
            let bytes: Vec<u8> = tokens.iter().filter(|&&t| !model.is_eog(t)).flat_map(|&t| model.token_bytes(t, false)).collect();
            let _ = stdout.write_all(utf8.push(&bytes).as_bytes());
            let _ = stdout.flush();
        }
        true
    })?;
    let s = &gen.stats;
    if args.json {
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
            "n_draft_calls": s.n_draft_calls,
            "n_draft_positions": s.n_draft_positions,
            "from_drafter": s.from_drafter,
            "from_lookup": s.from_lookup,
            "tokens_per_second": s.tokens_per_second(),
            "prefill_ms": s.prefill_ms,
            "draft_ms": s.draft_ms,
            "verify_ms": s.verify_ms,
            "host_ms": s.host_ms,
            "total_ms": s.total_ms,
            "select": opts.draft.select_name(),
            "block": block,
            "adaptive": adaptive,
            "lookup": opts.draft.lookup.then_some(opts.draft.lookup_ngram),
        });
        writeln!(stdout, "{out}")?;
    } else {
        writeln!(stdout, "{}", utf8.finish())?;
        eprintln!(
            "{} tokens, {:.1} tok/s, tau {:.2} ({} cycles), finish: {:?}",
            s.n_generated,
            s.tokens_per_second(),
            s.tau(),
            s.cycles,
            gen.finish
        );
    }
    if gen.finish == FinishReason::Context {
        eprintln!("warning: stopped because the context ({} tokens) is full", engine.n_ctx());
    }
    Ok(())
}
