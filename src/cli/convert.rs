//! `dflash2 convert --from DIR --target T.gguf --out D.gguf`: a Hugging Face DFlash /
//! DFlash 2 drafter checkpoint to GGUF (see [`crate::gguf::convert`]).
use std::path::PathBuf;

use anyhow::Result;

use crate::gguf::convert::{convert, OutType};

#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    /// Checkpoint directory: config.json (with "dflash_config") and *.safetensors.
    #[arg(long = "from")]
    pub from: PathBuf,
    /// The target GGUF the drafter was trained for (its tokenizer is copied).
    #[arg(long)]
    pub target: PathBuf,
    /// Output GGUF.
    #[arg(long)]
    pub out: PathBuf,
    /// Storage of the weight matrices (norms and conv kernels stay f32).
    #[arg(long = "type", value_enum, default_value = "f16")]
    pub out_type: OutType,
}

pub fn run(args: &ConvertArgs) -> Result<()> {
    let c = convert(&args.from, &args.target, &args.out, args.out_type)?;
    let size = std::fs::metadata(&c.path)?.len();
    println!(
        "{} ({:.2} MB, {} tensors, target layer inputs {:?}{})",
        c.path.display(),
        size as f64 / 1e6,
        c.n_tensors,
        c.target_layers,
        c.draft_vocab.map(|n| format!(", draft vocabulary {n}")).unwrap_or_default()
    );
    Ok(())
}
