//! The command line: one file per subcommand; flags are defined once, here and in
//! the subcommand's `Args` struct.
pub mod answer;
pub mod bench;
pub mod chat;
pub mod convert;
pub mod dataset;
pub mod generate;
pub mod inspect;
pub mod quantize;
pub mod serve;
pub mod synth;

use clap::{Parser, Subcommand};

use crate::draft::config::{Block, DraftConfig, SelectMode, Upstream, DEFAULT_LOOKUP_NGRAM};
use crate::llama::CacheType;

#[derive(Parser, Debug)]
#[command(name = "dflash2", version, about = "DFlash 2 speculative decoding for llama.cpp, lossless")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate a completion for one prompt.
    Generate(generate::GenerateArgs),
    /// Chat interactively, the conversation kept in the cache.
    Chat(chat::ChatArgs),
    /// Compare selection modes on a prompt set, side by side.
    Bench(bench::BenchArgs),
    /// Print a GGUF's metadata and, with --target, whether a drafter pairs with it.
    Inspect(inspect::InspectArgs),
    /// Write synthetic test models (no download needed).
    Synth(synth::SynthArgs),
    /// Serve OpenAI- and llama-server-compatible HTTP endpoints.
    Serve(serve::ServeArgs),
    /// Convert a Hugging Face DFlash / DFlash 2 drafter checkpoint to GGUF.
    Convert(convert::ConvertArgs),
    /// Read a drafter's training data (features, greedy labels) off the target.
    Dataset(dataset::DatasetArgs),
    /// Answer a drafter's training prompts with the target, many conversations at once.
    Answer(answer::AnswerArgs),
    /// Write a model's weights in another type (llama.cpp's quantizer).
    Quantize(quantize::QuantizeArgs),
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match &cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Synth(a) => synth::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Dataset(a) => dataset::run(a),
        Command::Answer(a) => answer::run(a),
        Command::Quantize(a) => quantize::run(a),
    }
}

/// A spinner on stderr while models load (hidden when stderr is not a terminal).
pub fn loading_spinner(what: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new_spinner();
    pb.set_draw_target(indicatif::ProgressDrawTarget::stderr());
    pb.set_message(format!("loading {what}"));
    pb.enable_steady_tick(std::time::Duration::from_millis(120));
    pb
}

/// Progress of long work (bench, dataset, convert): a bar on a terminal; elsewhere (a log, CI) a
/// one-line report on stderr at most every `LINE_EVERY`, and at the end.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    what: String,
    len: u64,
    done: u64,
    started: std::time::Instant,
    last_line: std::time::Instant,
}

impl Progress {
    const LINE_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

    pub fn new(len: u64, what: &str) -> Self {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::with_draw_target(Some(len), indicatif::ProgressDrawTarget::stderr());
            let style = indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed} (eta {eta}) {msg}")
                .expect("a valid template");
            bar.set_style(style.progress_chars("=> "));
            bar.set_prefix(what.to_string());
            bar
        });
        let now = std::time::Instant::now();
        Self { bar, what: what.to_string(), len, done: 0, started: now, last_line: now }
    }

    /// One more item done; `msg` says what the latest one gave.
    pub fn inc(&mut self, msg: &str) {
        self.done += 1;
        match &self.bar {
            Some(bar) => {
                bar.set_message(msg.to_string());
                bar.inc(1);
            }
            None if self.done == self.len || self.last_line.elapsed() >= Self::LINE_EVERY => {
                self.last_line = std::time::Instant::now();
                let s = self.started.elapsed().as_secs_f64();
                eprintln!("{}: {}/{} after {s:.0} s {msg}", self.what, self.done, self.len);
            }
            None => {}
        }
    }

    pub fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }
}

/// Sampling flags as llama.cpp users know them (one definition for every subcommand).
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy.
    #[arg(long = "temp", default_value_t = 0.0)]
    pub temperature: f32,
    /// Top-k (<= 0 disables).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: i32,
    /// Top-p (1 disables).
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p (0 disables).
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1 disables).
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Tokens the penalties look back over.
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: i32,
    /// Subtracted once from the logit of each token in the penalty window (0 disables).
    #[arg(long = "presence-penalty", default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the penalty window (0 disables).
    #[arg(long = "frequency-penalty", default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Bias a token's logit, as llama.cpp's `-l`: `15043+1`, `15043-0.5`, `15043-inf` (repeatable).
    #[arg(short = 'l', long = "logit-bias", value_parser = parse_logit_bias)]
    pub logit_bias: Vec<(i32, f32)>,
    /// Random seed.
    #[arg(long = "seed", default_value_t = 0xD1F1A5)]
    pub seed: u64,
    /// How drafts are verified at T > 0: `match` samples each verified row with its position's
    /// draw and keeps drafted tokens while they equal it (a seed gives plain decoding's text);
    /// `reject` is rejection sampling (the same distribution, not the same text).
    #[arg(long = "spec-sampling", value_enum, default_value_t = crate::engine::Verifier::Match)]
    pub spec_sampling: crate::engine::Verifier,
    /// Constrain the output to a GBNF grammar (root rule `root`), as llama.cpp's `--grammar`.
    #[arg(long, conflicts_with_all = ["grammar_file", "json_schema"])]
    pub grammar: Option<String>,
    /// GBNF grammar read from a file.
    #[arg(long = "grammar-file", conflicts_with = "json_schema")]
    pub grammar_file: Option<std::path::PathBuf>,
    /// Constrain the output to a JSON schema (`{}`: any JSON), as llama.cpp's `-j`.
    #[arg(short = 'j', long = "json-schema")]
    pub json_schema: Option<String>,
}

impl SamplingArgs {
    pub fn params(&self) -> crate::sampling::SamplingParams {
        crate::sampling::SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repeat_last_n: self.repeat_last_n,
            logit_bias: self.logit_bias.clone(),
            seed: self.seed,
            choice: 0,
        }
    }
}

impl SamplingArgs {
    /// The GBNF grammar these flags ask for, if any.
    pub fn grammar(&self) -> anyhow::Result<Option<String>> {
        Ok(match (&self.grammar, &self.grammar_file, &self.json_schema) {
            (Some(g), _, _) => Some(g.clone()),
            (_, Some(path), _) => Some(
                std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?,
            ),
            (_, _, Some(schema)) => Some(
                crate::llama::Grammar::from_json_schema(schema).map_err(|e| anyhow::anyhow!("--json-schema: {e}"))?,
            ),
            _ => None,
        })
    }
}

/// `ID+BIAS` or `ID-BIAS` (llama.cpp's `--logit-bias` syntax; `inf` allowed).
fn parse_logit_bias(s: &str) -> Result<(i32, f32), String> {
    let bad = || format!("{s:?}: expected TOKEN_ID+BIAS or TOKEN_ID-BIAS, e.g. 15043+1 or 15043-inf");
    let at = s.find(['+', '-']).filter(|&i| i > 0).ok_or_else(bad)?;
    let id: i32 = s[..at].parse().map_err(|_| bad())?;
    let bias: f32 = s[at..].parse().map_err(|_| bad())?;
    if bias.is_nan() || bias == f32::INFINITY {
        return Err(bad());
    }
    Ok((id, bias))
}

/// The model flags of every subcommand that runs the engine (one definition, one meaning).
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Target model (GGUF).
    #[arg(short = 'm', long = "model")]
    pub model: std::path::PathBuf,
    /// DFlash / DFlash 2 drafter (GGUF); without it decoding is plain.
    #[arg(short = 'd', long = "drafter")]
    pub drafter: Option<std::path::PathBuf>,
    /// CPU threads, at most: a decode runs on half as many while other processes leave no room
    /// for the full team, which is then faster (llama.cpp's OpenMP team spins at every barrier).
    #[arg(short = 't', long = "threads", default_value_t = crate::engine::default_threads())]
    pub threads: i32,
    /// Context size in tokens.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Prompt tokens decoded per batch (`-b` as in llama.cpp; at least 64).
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch_size: usize,
    /// Layers to offload to a GPU (GPU builds only).
    #[arg(long = "gpu-layers", default_value_t = 999)]
    pub gpu_layers: i32,
    /// Where the target's layer inputs come from.
    #[arg(long, value_enum, default_value_t = crate::engine::FeatureMode::Auto)]
    pub features: crate::engine::FeatureMode,
    /// KV cache type of the target's K (`-ctk` as in llama.cpp): f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1.
    #[arg(long = "cache-type-k", default_value_t = CacheType::F16)]
    pub cache_type_k: CacheType,
    /// KV cache type of the target's V (`-ctv`): f32, f16 or bf16 (llama.cpp quantizes V only with flash
    /// attention, which the target runs without).
    #[arg(long = "cache-type-v", default_value_t = CacheType::F16)]
    pub cache_type_v: CacheType,
    /// KV cache type of the drafter's K (`-ctkd`); its numerics never change the output.
    #[arg(long = "cache-type-k-draft", default_value_t = CacheType::Q8_0)]
    pub cache_type_k_draft: CacheType,
    /// KV cache type of the drafter's V (`-ctvd`).
    #[arg(long = "cache-type-v-draft", default_value_t = CacheType::Q8_0)]
    pub cache_type_v_draft: CacheType,
    /// Repack the target's weights even where a verify batch then rounds differently from a
    /// single step (default: probe at load and repack only where batches stay bit-identical).
    /// Output may then differ from plain decoding.
    #[arg(long, conflicts_with = "no_repack")]
    pub repack: bool,
    /// Never repack the target's weights (llama.cpp's `--no-repack`).
    #[arg(long)]
    pub no_repack: bool,
    #[command(flatten)]
    pub template: TemplateArgs,
}

/// Which chat template renders messages (as llama-server's flags).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TemplateArgs {
    /// Chat template: one of llama.cpp's built-in names (chatml, llama3, ...) or a Jinja
    /// template's text (default: the target's own, from its GGUF).
    #[arg(long = "chat-template", conflicts_with = "chat_template_file")]
    pub chat_template: Option<String>,
    /// Chat template read from a Jinja file.
    #[arg(long = "chat-template-file")]
    pub chat_template_file: Option<std::path::PathBuf>,
}

impl TemplateArgs {
    pub fn choice(&self) -> anyhow::Result<crate::template::TemplateChoice> {
        use crate::template::TemplateChoice;
        Ok(match (&self.chat_template, &self.chat_template_file) {
            (Some(t), _) => TemplateChoice::Given(t.clone()),
            (None, Some(path)) => TemplateChoice::Given(
                std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?,
            ),
            (None, None) => TemplateChoice::Model,
        })
    }

    /// The chat template these flags choose for `model`.
    pub fn load(&self, model: &crate::llama::Model) -> anyhow::Result<crate::template::ChatTemplate> {
        Ok(crate::template::ChatTemplate::new(model, &self.choice()?)?)
    }
}

/// llama.cpp spells some long flags with one dash (`-ctk q8_0`); clap cannot, so they are
/// rewritten to their long form before parsing.
pub fn llama_style_args(args: impl IntoIterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    const SPELLINGS: [(&str, &str); 6] = [
        ("-np", "--parallel"),
        ("-rea", "--reasoning"),
        ("-ctk", "--cache-type-k"),
        ("-ctv", "--cache-type-v"),
        ("-ctkd", "--cache-type-k-draft"),
        ("-ctvd", "--cache-type-v-draft"),
    ];
    args.into_iter()
        .map(|arg| match SPELLINGS.iter().find(|(short, _)| arg.to_str() == Some(short)) {
            Some((_, long)) => long.into(),
            None => arg,
        })
        .collect()
}

impl ModelArgs {
    pub fn repack_mode(&self) -> crate::target::Repack {
        use crate::target::Repack;
        match (self.repack, self.no_repack) {
            (true, _) => Repack::On,
            (_, true) => Repack::Off,
            _ => Repack::Auto,
        }
    }

    /// The engine configuration these flags describe, with `drafter` (or none).
    pub fn config(&self, drafter: Option<std::path::PathBuf>) -> crate::engine::EngineConfig {
        let mut cfg = crate::engine::EngineConfig::new(self.model.clone(), drafter);
        cfg.n_ctx = self.ctx_size;
        cfg.n_batch = self.batch_size;
        cfg.n_threads = self.threads;
        cfg.n_gpu_layers = self.gpu_layers;
        cfg.features = self.features;
        cfg.repack = self.repack_mode();
        cfg.cache = crate::engine::CacheTypes {
            target_k: self.cache_type_k,
            target_v: self.cache_type_v,
            draft_k: self.cache_type_k_draft,
            draft_v: self.cache_type_v_draft,
        };
        cfg
    }
}

/// `--select`: how drafts are picked from the drafter's candidates, or `upstream`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SelectArg {
    /// No drafting: plain autoregressive decoding (the baseline).
    None,
    /// llama.cpp's walk: the best-scoring successor of each pick.
    Greedy,
    /// The path with the most expected accepted tokens.
    BestPath,
    /// A best-first token tree over the candidates, verified in one decode.
    Tree,
    /// Drafting by llama.cpp's own DFlash driver (its greedy walk, a fixed block): the
    /// baseline to beat, run through the same verification. Targets with llama.cpp's
    /// layer extraction only (llama, qwen3, ...).
    Upstream,
}

impl SelectArg {
    /// The selection, and llama.cpp's driver for `upstream` (whose walk is greedy).
    pub fn config(self) -> (SelectMode, Option<Upstream>) {
        match self {
            SelectArg::None => (SelectMode::None, None),
            SelectArg::Greedy => (SelectMode::Greedy, None),
            SelectArg::BestPath => (SelectMode::BestPath, None),
            SelectArg::Tree => (SelectMode::Tree, None),
            SelectArg::Upstream => (SelectMode::Greedy, Some(Upstream::Dflash)),
        }
    }
}

/// How each cycle drafts: flags of `generate`, `chat` and `serve` (its request defaults).
#[derive(clap::Args, Debug, Clone)]
pub struct DraftArgs {
    /// Block size: the anchor plus at most BLOCK-1 drafted tokens per cycle, or `auto`
    /// to choose each cycle's length from measured costs (up to the trained block size).
    #[arg(long, default_value = "auto")]
    pub block: Block,
    /// How drafts are picked from the drafter's candidates (default: `greedy` with a
    /// drafter, `none` (plain decoding) without one).
    #[arg(long, value_enum)]
    pub select: Option<SelectArg>,
    /// Node budget of a token tree (`--select tree`).
    #[arg(long, default_value_t = 32)]
    pub tree_budget: usize,
    /// Also draft from the context: what followed earlier occurrences of its last tokens
    /// (prompt and output), beside a drafter or alone (no -d): cheap speculation for
    /// editing work that repeats the prompt. On by default (where nothing repeats it costs
    /// within noise, BENCHMARKS.md); the flag is kept for scripts that name it.
    #[arg(long, overrides_with = "no_lookup")]
    lookup: bool,
    /// Turn context look-up drafting off (plain decoding without -d).
    #[arg(long, overrides_with = "lookup")]
    no_lookup: bool,
    /// Longest suffix the look-up matches, in tokens.
    #[arg(long, default_value_t = DEFAULT_LOOKUP_NGRAM,
          value_parser = clap::builder::TypedValueParser::map(
              clap::value_parser!(u16).range(1..=crate::draft::lookup::MAX_NGRAM as i64), usize::from))]
    pub lookup_ngram: usize,
}

impl DraftArgs {
    /// Whether cycles draft from the context (`--lookup`, the default; `--no-lookup`).
    pub fn lookup(&self) -> bool {
        self.lookup || !self.no_lookup
    }

    /// The drafting these flags describe, given whether a drafter was named: a mode that
    /// drafts needs one, or the look-up (which drafts paths and trees, not llama.cpp's
    /// driver's blocks).
    pub fn config(&self, has_drafter: bool) -> anyhow::Result<DraftConfig> {
        let (select, upstream) = match (self.select, has_drafter || self.lookup()) {
            (None, true) => (SelectMode::Greedy, None),
            (None, false) | (Some(SelectArg::None), _) => (SelectMode::None, None),
            (Some(SelectArg::Upstream), _) if !has_drafter => {
                anyhow::bail!("--select upstream needs a drafter (-d DRAFTER.gguf)")
            }
            (Some(s), true) => s.config(),
            (Some(s), false) => {
                anyhow::bail!("--select {s:?} needs a drafter (-d DRAFTER.gguf) or the look-up (not --no-lookup), or use --select none")
            }
        };
        if select != SelectMode::None && matches!(self.block, Block::Fixed(b) if b < 2) {
            anyhow::bail!("--block must be at least 2 (the anchor plus one drafted token)");
        }
        Ok(DraftConfig {
            select,
            block: self.block,
            tree_budget: self.tree_budget,
            lookup: self.lookup(),
            lookup_ngram: self.lookup_ngram,
            upstream,
        })
    }
}

/// The engine flags shared by `generate` and `chat`.
#[derive(clap::Args, Debug, Clone)]
pub struct EngineArgs {
    #[command(flatten)]
    pub models: ModelArgs,
    #[command(flatten)]
    pub draft: DraftArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

impl EngineArgs {
    /// Load the engine these flags describe (with a spinner while the models load).
    pub fn load(&self) -> anyhow::Result<crate::engine::Engine> {
        let draft = self.draft.config(self.models.drafter.is_some())?;
        let drafter = if draft.select == SelectMode::None { None } else { self.models.drafter.clone() };
        let cfg = self.models.config(drafter);
        let spinner = loading_spinner("models");
        let engine = crate::engine::Engine::load(&cfg);
        spinner.finish_and_clear();
        Ok(engine?)
    }

    /// Generation options for `engine` (built from these flags).
    pub fn options(
        &self,
        engine: &crate::engine::Engine,
        n_predict: usize,
        stop: Vec<String>,
    ) -> anyhow::Result<crate::engine::GenerateOptions> {
        let draft = self.draft.config(engine.drafter().is_some())?;
        let n_vocab = engine.model().n_vocab();
        if let Some((id, _)) = self.sampling.logit_bias.iter().find(|(id, _)| !(0..n_vocab as i32).contains(id)) {
            anyhow::bail!("--logit-bias: token {id} is outside the vocabulary (0..{n_vocab})");
        }
        Ok(crate::engine::GenerateOptions {
            n_predict,
            draft,
            stop,
            sampling: self.sampling.params(),
            grammar: self.sampling.grammar()?,
            verifier: self.sampling.spec_sampling,
            ..Default::default()
        })
    }
}
