//! `dflash2 serve`: the HTTP server (OpenAI and llama-server endpoints).
use crate::engine::{self, Engine, EngineConfig, FeatureMode, SelectMode};
use crate::server::metrics::Metrics;
use crate::server::scheduler::{Scheduler, SlotModels};
use crate::server::{self, AppState, Defaults};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Target model (GGUF).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// DFlash / DFlash 2 drafter (GGUF); without it every request is decoded plainly.
    #[arg(short = 'd', long = "drafter")]
    pub drafter: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the chosen address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Generation slots: requests decoded at the same time, one engine each.
    #[arg(long, short = 'n', default_value_t = 1)]
    pub parallel: usize,
    /// Requests that may wait for a slot; past that the server answers 503 (default: 4 x parallel).
    #[arg(long)]
    pub queue: Option<usize>,
    /// Context size of each slot, in tokens.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    #[arg(long = "api-key")]
    pub api_key: Option<String>,
    /// Name of the model in /v1/models and in requests (default: the target's file name).
    #[arg(long)]
    pub alias: Option<String>,
    /// Largest request body accepted, in bytes (larger: 413).
    #[arg(long = "max-body", default_value_t = 4 << 20)]
    pub max_body: usize,
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
    /// CPU threads (all slots are decoded together by one engine).
    #[arg(short = 't', long = "threads")]
    pub threads: Option<i32>,
    /// Layers to offload to a GPU (GPU builds only).
    #[arg(long = "gpu-layers", default_value_t = 999)]
    pub gpu_layers: i32,
    /// Where the target's layer inputs come from.
    #[arg(long, value_enum, default_value_t = FeatureMode::Auto)]
    pub features: FeatureMode,
    /// Defaults for requests that leave a sampling field out.
    #[command(flatten)]
    pub sampling: super::SamplingArgs,
}

pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.parallel >= 1, "--parallel must be at least 1");
    let drafter = if args.select == SelectMode::None { None } else { args.drafter.clone() };
    let select = if drafter.is_some() { args.select } else { SelectMode::None };
    let mut cfg = EngineConfig::new(args.model.clone(), drafter.clone());
    cfg.n_ctx = args.ctx_size;
    cfg.n_threads = args.threads.unwrap_or_else(engine::default_threads);
    cfg.n_gpu_layers = args.gpu_layers;
    cfg.features = args.features;

    let spinner = super::loading_spinner("models");
    let models = load_models(&cfg);
    spinner.finish_and_clear();
    let models = models?;
    let target = models.target.clone();

    let metrics = Arc::new(Metrics::default());
    let queue = args.queue.unwrap_or(4 * args.parallel);
    let scheduler = Scheduler::start(models, args.parallel, queue, metrics.clone())?;
    let (block, adaptive) = args.block.resolve(scheduler.info().trained_block.unwrap_or(1));
    anyhow::ensure!(
        select == SelectMode::None || block >= 2,
        "--block must be at least 2 (the anchor plus one drafted token)"
    );
    let state = Arc::new(AppState {
        scheduler,
        metrics,
        model_id: args.alias.clone().unwrap_or_else(|| file_name(&args.model)),
        model: target,
        drafter_path: drafter.map(|d| d.display().to_string()),
        api_key: args.api_key.clone(),
        defaults: Defaults { select, block, adaptive, tree_budget: args.tree_budget, sampling: args.sampling.params() },
    });
    let router = server::router(state, args.max_body);

    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port)).await?;
        // One line on stdout, so that scripts (and the tests) learn a port chosen with --port 0.
        println!("dflash2 listening on http://{}", listener.local_addr()?);
        std::io::stdout().flush()?;
        server::serve(listener, router).await?;
        anyhow::Ok(())
    })
}

/// Load the models once, for every slot to share; the files are checked first (readable
/// GGUF, a drafter that pairs with the target) so a bad file is an error, not an abort.
fn load_models(cfg: &EngineConfig) -> anyhow::Result<SlotModels> {
    let (target, drafter) = Engine::load_models(cfg)?;
    Ok(SlotModels { target, drafter, cfg: cfg.clone() })
}

fn file_name(p: &Path) -> String {
    p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned())
}
