//! `dflash2 dataset`: a drafter's training data read off the target (see [`crate::dataset`]).
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context as _, Result};

use crate::dataset::{default_layers, Conversation, Extractor, ExtractorParams};
use crate::llama::{Model, ModelParams};

#[derive(clap::Args, Debug)]
pub struct DatasetArgs {
    /// Target model (GGUF) the drafter is for.
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Training rows, one JSON object per line: {"prompt", "answer"} (the target's own answer,
    /// as `dflash2 answer` writes them) or {"text"} (any text).
    #[arg(long)]
    pub conversations: PathBuf,
    /// Output file (safetensors).
    #[arg(long)]
    pub out: PathBuf,
    /// Target layer inputs the drafter reads, as llama.cpp counts them (GGUF
    /// `dflash.target_layers`); default: --n-features layers spread over the target.
    #[arg(long, value_delimiter = ',')]
    pub layers: Option<Vec<i32>>,
    /// Number of feature layers when --layers is not given.
    #[arg(long, default_value_t = 5)]
    pub n_features: usize,
    /// Longest conversation kept, in tokens (longer ones are cut).
    #[arg(long, default_value_t = 1024)]
    pub max_len: usize,
    #[arg(short = 't', long = "threads", default_value_t = crate::engine::default_threads())]
    pub threads: i32,
    /// Soft labels: the target's K most likely next tokens per position and their
    /// log-probabilities, for a distillation loss (0: greedy labels only).
    #[arg(long = "soft-k", default_value_t = 8)]
    pub soft_k: usize,
    /// Read with llama.cpp's flash attention: about twice as fast on long rows, features and
    /// labels rounded slightly differently from the engine's target (which runs without it so
    /// that a verify equals single steps). A drafter does not need bit-exact training features.
    #[arg(long = "flash-attn")]
    pub flash_attn: bool,
    /// How chat rows are rendered: as `dflash2 answer` rendered their prompts.
    #[command(flatten)]
    pub template: super::TemplateArgs,
}

pub fn run(args: &DatasetArgs) -> Result<()> {
    let g = crate::gguf::read_gguf(&args.model)?;
    let info = crate::gguf::ModelInfo::from_gguf(&g)?;
    let (mask, note) = crate::gguf::synth::mask_token(&g, &info)?;
    if let Some(note) = note {
        eprintln!("{note}");
    }
    let target = Arc::new(Model::load(&args.model, &ModelParams::default())?);
    let layers = args.layers.clone().unwrap_or_else(|| default_layers(target.n_layer(), args.n_features));
    let params = ExtractorParams {
        mask_token: mask,
        layers: layers.clone(),
        max_len: args.max_len,
        n_threads: args.threads,
        soft_k: args.soft_k,
        template: args.template.choice()?,
        flash_attn: args.flash_attn,
    };
    let mut ex = Extractor::new(target, params)?;
    let mut data = ex.dataset();
    let text = std::fs::read_to_string(&args.conversations)
        .with_context(|| format!("reading {}", args.conversations.display()))?;
    let mut progress = super::Progress::new(text.lines().filter(|l| !l.trim().is_empty()).count() as u64, "dataset");
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let c: Conversation = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: neither {{\"prompt\", \"answer\"}} nor {{\"text\"}}", args.conversations.display(), i + 1))?;
        ex.add(&c, &mut data)?;
        progress.inc(&format!("({} tokens)", data.n_tokens()));
    }
    progress.finish();
    let name = args.model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    data.write(&args.out, &name)?;
    eprintln!(
        "{} conversations, {} tokens, layers {:?} -> {}",
        data.n_sequences(),
        data.n_tokens(),
        layers,
        args.out.display()
    );
    Ok(())
}
