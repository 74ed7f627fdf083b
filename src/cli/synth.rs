//! `dflash2 synth --out DIR [--seed N] [--target T.gguf]`: writes the synthetic test models
//! (see [`crate::gguf::synth`]), or with `--target` only a random DFlash 2 drafter for that target.

use std::path::PathBuf;

use anyhow::Result;

use crate::gguf::synth::{synth_all, synth_for_target};

#[derive(clap::Args, Debug)]
pub struct SynthArgs {
    /// Directory to write the GGUF files into (created if missing)
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the random weights: the same seed writes the same bytes
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write only drafter-dflash2.gguf, a random DFlash 2 drafter pairing with this target
    #[arg(long)]
    pub target: Option<PathBuf>,
}

pub fn run(args: &SynthArgs) -> Result<()> {
    let files = match &args.target {
        Some(target) => {
            let d = synth_for_target(target, &args.out, args.seed)?;
            if let Some(note) = &d.mask_note {
                eprintln!("{note}");
            }
            eprintln!(
                "drafter: target layer inputs {:?}, top-k {}, selector rank {}, mask token {}",
                d.target_layers, d.top_k, d.rank, d.mask_id
            );
            vec![d.path]
        }
        None => synth_all(&args.out, args.seed)?,
    };
    for f in files {
        let size = std::fs::metadata(&f)?.len();
        println!("{} ({:.2} MB)", f.display(), size as f64 / 1e6);
    }
    Ok(())
}
