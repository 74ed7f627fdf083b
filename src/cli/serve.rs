//! `dflash2 serve`: the HTTP server (OpenAI and llama-server endpoints).
use crate::draft::config::SelectMode;
use crate::server::metrics::Metrics;
use crate::server::reasoning::{ReasoningFormat, Thinking};
use crate::server::scheduler::Scheduler;
use crate::server::{self, AppState, Defaults};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Target, drafter (without it every request is decoded plainly), threads (all slots
    /// are decoded together by one engine) and the context of ALL slots together (as
    /// llama-server's `-c`: each slot gets --ctx-size / --parallel).
    #[command(flatten)]
    pub models: super::ModelArgs,
    /// Addresses to listen on, comma-separated (`127.0.0.1,::1`), each on `--port`.
    #[arg(long, default_value = "127.0.0.1", value_delimiter = ',')]
    pub host: Vec<String>,
    /// Port to listen on (0: any free port; the chosen address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Generation slots (`-np`): requests decoded at the same time, each with a cache of
    /// --ctx-size / --parallel tokens.
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// Tokens a request generates at most when it sets no limit (-1: to the end of its slot's context).
    #[arg(short = 'n', long = "n-predict", default_value_t = -1, allow_negative_numbers = true)]
    pub n_predict: i64,
    /// Longest prompt a request may send, in tokens (0: as long as a slot's context holds); a
    /// longer one is refused as a prompt over the context is, naming this cap as `n_ctx`.
    #[arg(long = "max-prompt-tokens", default_value_t = 0)]
    pub max_prompt_tokens: usize,
    /// Requests that may wait for a slot; past that the server answers 503 (default: 4 x parallel).
    #[arg(long)]
    pub queue: Option<usize>,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    #[arg(long = "api-key")]
    pub api_key: Option<String>,
    /// Names of the model in /v1/models, comma-separated; the first is the one answers carry
    /// (default: the target's file name). One model is served, so a request may name any model
    /// (as clients configured for another server do), as with llama-server.
    #[arg(long, value_delimiter = ',')]
    pub alias: Vec<String>,
    /// Labels of the model in /v1/models' `tags`, comma-separated (llama-server's `--tags`).
    #[arg(long, value_delimiter = ',')]
    pub tags: Vec<String>,
    /// Offer `GET /slots` (the default, as llama-server's); `--no-slots` answers it 501.
    #[arg(long, overrides_with = "no_slots")]
    pub slots: bool,
    #[arg(long = "no-slots", overrides_with = "slots")]
    pub no_slots: bool,
    /// Add `__verbose` (the prompt as decoded, special tokens written out) to every whole
    /// OpenAI answer, as llama-server's `--verbose` does; a request's `"verbose": true` asks
    /// for it alone.
    #[arg(long)]
    pub verbose: bool,
    /// Origins whose pages a browser lets call this server, comma-separated (llama-server's
    /// `--cors-origins`): exact origins (`https://app.example`), or `localhost` for any port
    /// of localhost, 127.0.0.1 and [::1]. Default: every origin (the request's is mirrored).
    #[arg(long = "cors-origins", value_delimiter = ',')]
    pub cors_origins: Vec<String>,
    /// Leave out the chat page at `/` (llama-server's `--no-webui`).
    #[arg(long = "no-webui")]
    pub no_webui: bool,
    /// Largest request body accepted, in bytes (larger: 413).
    #[arg(long = "max-body", default_value_t = 4 << 20)]
    pub max_body: usize,
    /// Seconds a client has to send a request's headers, and again its body; a client that
    /// stalls longer is cut off.
    #[arg(long = "read-timeout", default_value_t = 30.0)]
    pub read_timeout: f64,
    /// Connections served at once; further ones wait to be accepted.
    #[arg(long = "max-connections", default_value_t = 512)]
    pub max_connections: usize,
    /// Where a chat answer's thinking goes (llama-server's): `deepseek` or `auto` split it into
    /// `reasoning_content` (streamed as `delta.reasoning_content`); `deepseek-legacy` does too,
    /// but streams it inline in `content`; `none` leaves it in `content`, tags included. A
    /// request's `reasoning_format` chooses for itself.
    #[arg(long = "reasoning-format", value_enum, default_value_t = ReasoningFormat::Auto)]
    pub reasoning_format: ReasoningFormat,
    /// Whether the model thinks (`-rea`, llama-server's): the chat template's `enable_thinking`
    /// (`auto`: true, the template decides). A request's `chat_template_kwargs` may set it.
    #[arg(long = "reasoning", value_enum, default_value_t = Thinking::Auto)]
    pub reasoning: Thinking,
    /// Tokens of thinking an answer may write at most (llama-server's; -1: no limit). Past it
    /// every token but those that end the thinking (after --reasoning-budget-message) is banned,
    /// in drafts and verification as in plain decoding, so speculation keeps the answer.
    #[arg(long = "reasoning-budget", default_value_t = -1, allow_negative_numbers = true)]
    pub reasoning_budget: i64,
    /// Text written before the end of the thinking when the budget ends it.
    #[arg(long = "reasoning-budget-message", default_value = "")]
    pub reasoning_budget_message: String,
    /// Block, selection and tree budget of requests that do not set them.
    #[command(flatten)]
    pub draft: super::DraftArgs,
    /// Defaults for requests that leave a sampling field out.
    #[command(flatten)]
    pub sampling: super::SamplingArgs,
}

/// llama.cpp pads a context to 256 cells: a smaller slot would silently get more.
const MIN_SLOT_CTX: usize = 256;

pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    let (router, limits) = app(args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let (mut listeners, mut lines) = (Vec::with_capacity(args.host.len()), String::new());
        for host in &args.host {
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let listener = tokio::net::TcpListener::bind((host, args.port))
                .await
                .map_err(|e| anyhow::anyhow!("cannot listen on {host} port {}: {e}", args.port))?;
            lines += &format!("dflash2 listening on http://{}\n", listener.local_addr()?);
            listeners.push(listener);
        }
        // A line per address on stdout, in one write, so that scripts (and the tests) learn a
        // port chosen with --port 0.
        print!("{lines}");
        std::io::stdout().flush()?;
        server::serve(listeners, router, limits).await?;
        anyhow::Ok(())
    })
}

/// The server as `args` describe it, models loaded, not yet listening: its routes and the
/// limits the accept loop applies (the fuzz harness drives the routes in-process).
pub fn app(args: &ServeArgs) -> anyhow::Result<(axum::Router, server::Limits)> {
    anyhow::ensure!(args.parallel >= 1, "--parallel must be at least 1");
    let mut draft = args.draft.config(args.models.drafter.is_some())?;
    // `--select none` is plain decoding: there the look-up drafts only for a request that asks
    // for it (`"lookup": true`).
    draft.lookup &= draft.select != SelectMode::None;
    let drafter = if draft.select == SelectMode::None { None } else { args.models.drafter.clone() };
    let mut cfg = args.models.config(drafter.clone());
    cfg.n_ctx = args.models.ctx_size / args.parallel;
    anyhow::ensure!(
        cfg.n_ctx >= MIN_SLOT_CTX,
        "--ctx-size {} over {} slots leaves {} tokens per slot; llama.cpp needs at least {MIN_SLOT_CTX}",
        args.models.ctx_size,
        args.parallel,
        cfg.n_ctx
    );
    anyhow::ensure!(args.n_predict >= -1 && args.n_predict != 0, "--n-predict must be -1 or a positive count");
    anyhow::ensure!(args.reasoning_budget >= -1, "--reasoning-budget must be -1 (no limit) or a count of tokens");

    let metrics = Arc::new(Metrics::default());
    let queue = args.queue.unwrap_or(4 * args.parallel);
    let spinner = super::loading_spinner("models");
    let scheduler = Scheduler::start(cfg, args.parallel, queue, metrics.clone());
    spinner.finish_and_clear();
    let scheduler = scheduler?;
    let template = Arc::new(args.models.template.load(&scheduler.info().target)?);
    let state = Arc::new(AppState {
        scheduler,
        metrics,
        model_ids: if args.alias.is_empty() { vec![file_name(&args.models.model)] } else { args.alias.clone() },
        model_tags: args.tags.clone(),
        started_unix: crate::server::reply::now(),
        drafter_path: drafter.map(|d| d.display().to_string()),
        api_key: args.api_key.clone(),
        defaults: Defaults {
            draft,
            sampling: args.sampling.params(),
            verifier: args.sampling.spec_sampling,
            n_predict: usize::try_from(args.n_predict).ok(),
            max_prompt_tokens: Some(args.max_prompt_tokens).filter(|&n| n > 0),
            reasoning_format: args.reasoning_format,
            thinking: args.reasoning,
            reasoning_budget: usize::try_from(args.reasoning_budget).ok().map(|n| (n, args.reasoning_budget_message.clone())),
        },
        template,
        slots_endpoint: !args.no_slots,
        verbose: args.verbose,
        cors_origins: args.cors_origins.clone(),
        webui: !args.no_webui,
    });
    anyhow::ensure!(
        args.read_timeout.is_finite() && args.read_timeout > 0.0,
        "--read-timeout must be a positive number of seconds"
    );
    anyhow::ensure!(args.max_connections >= 1, "--max-connections must be at least 1");
    let limits = server::Limits {
        max_connections: args.max_connections,
        read_timeout: std::time::Duration::from_secs_f64(args.read_timeout),
        max_body_bytes: args.max_body,
    };
    Ok((server::router(state, &limits), limits))
}

fn file_name(p: &Path) -> String {
    p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned())
}
