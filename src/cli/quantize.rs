//! `dflash2 quantize IN.gguf OUT.gguf --type q4_0`: a model's weights in another type, through
//! llama.cpp's own quantizer. On a CPU the weight type decides what a verify batch costs (Q4_0 has
//! batch kernels that Q4_1 lacks on many CPUs; BENCHMARKS.md), but requantizing changes the
//! target's own text: it is the user's choice, never done silently. A drafter's weights decide only
//! how often its drafts are taken, never the text (the target verifies every token): a 4-bit
//! drafter costs less per call (BENCHMARKS.md (s)).
use std::path::PathBuf;

use anyhow::{bail, Result};

use crate::llama::QUANT_TYPES;

#[derive(clap::Args, Debug)]
pub struct QuantizeArgs {
    /// The model to read (GGUF).
    pub input: PathBuf,
    /// The GGUF to write.
    pub output: PathBuf,
    /// Weight type: f16, q8_0, q6_k, q5_k_m, q5_k_s, q5_1, q5_0, q4_k_m, q4_k_s, q4_1, q4_0, iq4_xs,
    /// iq4_nl, q3_k_m, q3_k_s, q2_k (the i-quants here need no importance matrix).
    #[arg(long = "type")]
    pub kind: String,
    /// Start from weights that are already quantized (loses some quality: quantize from the
    /// original f16/f32 weights where you have them).
    #[arg(long)]
    pub allow_requantize: bool,
    /// CPU threads.
    #[arg(short = 't', long = "threads", default_value_t = crate::engine::default_threads())]
    pub threads: i32,
}

pub fn run(args: &QuantizeArgs) -> Result<()> {
    let Some(&(_, ftype)) = QUANT_TYPES.iter().find(|(n, _)| n.eq_ignore_ascii_case(&args.kind)) else {
        let names: Vec<&str> = QUANT_TYPES.iter().map(|(n, _)| *n).collect();
        bail!("--type {}: not a type this command writes (one of {})", args.kind, names.join(", "));
    };
    // Read the header first: a bad file is a clear error, not an abort inside llama.cpp.
    let g = crate::gguf::read_gguf(&args.input)?;
    let drafter = g.get("general.architecture").and_then(crate::gguf::MetaValue::as_str) == Some("dflash");
    let quantized: Vec<&str> = g
        .tensors
        .iter()
        .filter(|t| t.shape.len() > 1 && !matches!(t.type_name, "F32" | "F16" | "BF16"))
        .map(|t| t.type_name)
        .collect();
    if let Some(first) = quantized.first() {
        if !args.allow_requantize {
            bail!(
                "{} is already quantized ({first} weights): pass --allow-requantize to quantize it again, \
                 which loses some quality",
                args.input.display()
            );
        }
        let what_changes = if drafter {
            "and its drafts may be taken less often (the output stays the target's own)"
        } else {
            "and its text differs from the original file's"
        };
        eprintln!(
            "warning: requantizing {} ({first} weights) to {}: the result is worse than quantizing the original weights, \
             {what_changes}",
            args.input.display(),
            args.kind
        );
    }
    if args.input.canonicalize().ok() == args.output.canonicalize().ok() {
        bail!("the output must be another file than the input");
    }
    crate::llama::quantize(&args.input, &args.output, ftype, args.allow_requantize, args.threads)?;
    let size = std::fs::metadata(&args.output)?.len();
    println!("{} ({:.1} MB, {})", args.output.display(), size as f64 / 1e6, args.kind.to_lowercase());
    Ok(())
}
