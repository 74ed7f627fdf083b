//! `dflash2 inspect FILE.gguf [--target T.gguf] [--json]`: a model's metadata and, given a
//! target, whether FILE can draft for it. A failed pairing is an error (non-zero exit) whose
//! message names the field and both values. `--check` loads a target and probes whether its
//! verify batches reproduce single-token steps bit for bit, with weight repacking on and off.
//! `--costs` (FILE a drafter, with `--target`) times a cycle's pieces on this machine.

use std::path::PathBuf;

use anyhow::Result;

use crate::gguf::read::{check_pair, read_gguf, read_model_info, Gguf, ModelInfo, PairCheckError};
use crate::gguf::MetaValue;

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// GGUF file to inspect: a target model or a DFlash drafter
    pub file: PathBuf,
    /// Check FILE as a drafter for this target model
    #[arg(long)]
    pub target: Option<PathBuf>,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
    /// Also list every metadata key and tensor
    #[arg(long)]
    pub all: bool,
    /// Load FILE as a target and probe, with weight repacking on and off, whether batches of
    /// each size round exactly like single-token steps (what lossless verification rests on)
    #[arg(long)]
    pub check: bool,
    /// Batch sizes the probe checks (`--check`)
    #[arg(long, value_delimiter = ',', default_values_t = [2, 4, 5, 8, 16, 17, 33])]
    pub batches: Vec<usize>,
    /// CPU threads of the probe (`--check`)
    #[arg(short = 't', long = "threads", default_value_t = crate::engine::default_threads())]
    pub threads: i32,
    /// Probes per repack setting (`--check`); decode times are the medians over them
    #[arg(long, default_value_t = 1)]
    pub runs: usize,
    /// KV cache type of the target's K during the probe (`--check`)
    #[arg(long = "cache-type-k", default_value_t = crate::llama::CacheType::F16)]
    pub cache_type_k: crate::llama::CacheType,
    /// KV cache type of the target's V during the probe (`--check`)
    #[arg(long = "cache-type-v", default_value_t = crate::llama::CacheType::F16)]
    pub cache_type_v: crate::llama::CacheType,
    /// Layers to offload to a GPU during the probe (GPU builds only)
    #[arg(long = "gpu-layers", default_value_t = 999)]
    pub gpu_layers: i32,
    /// With --target (FILE is the drafter): time the target's single step and the drafter's
    /// feature injection and block decode at each block size, as the engine runs them
    #[arg(long, requires = "target")]
    pub costs: bool,
    /// Tokens of context before the timed steps (`--costs`; default 256) or the probed
    /// positions (`--check`; default 4)
    #[arg(long)]
    pub context: Option<usize>,
    /// Probe the target with flash attention through ggml's reference CPU kernels (`--check`):
    /// the one flash attention of the CPU backend that computes each row alone, whatever the
    /// batch (its split and tiled paths round a batch differently). Not what the engine runs:
    /// measured slower past a few hundred tokens of context (BENCHMARKS.md, section (j)).
    #[arg(long = "flash-attn-ref")]
    pub flash_attn_ref: bool,
}

pub fn run(args: &InspectArgs) -> Result<()> {
    let gguf = read_gguf(&args.file)?;
    let model = ModelInfo::from_gguf(&gguf)?;
    if args.check {
        return check(args, &model);
    }
    if args.costs {
        return costs(args, &model);
    }
    let target = args.target.as_deref().map(read_model_info).transpose()?;
    let verdict = target.as_ref().map(|t| check_pair(t, &model));

    if args.json {
        let pairing = verdict.as_ref().map(|v| match v {
            Ok(()) => serde_json::json!({ "ok": true }),
            Err(e) => serde_json::json!({ "ok": false, "error": e.to_string() }),
        });
        let mut out = serde_json::json!({ "model": model, "tensor_types": gguf.weight_types(), "target": target, "pairing": pairing });
        if args.all {
            out["metadata"] = gguf.metadata.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(short(v)))).collect();
            out["tensors"] = serde_json::to_value(&gguf.tensors)?;
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print!("{}", describe(&model));
        let types: Vec<String> =
            gguf.weight_types().iter().map(|w| format!("{} {} tensors {:.1} MB", w.type_name, w.tensors, w.bytes as f64 / 1e6)).collect();
        println!("tensor types   {}", types.join(", "));
        if args.all {
            print!("{}", list_all(&gguf));
        }
        if let Some(t) = &target {
            println!("\ntarget:");
            print!("{}", describe(t));
        }
    }
    match (verdict, &args.target) {
        (Some(Err(problem)), Some(t)) => {
            Err(PairCheckError::Mismatch { target: t.clone(), drafter: args.file.clone(), problem }.into())
        }
        (Some(Ok(())), Some(t)) if !args.json => {
            println!("\npairing with {}: ok", t.display());
            Ok(())
        }
        _ => Ok(()),
    }
}

fn describe(m: &ModelInfo) -> String {
    let id = |v: Option<u32>| v.map_or("none".to_string(), |v| v.to_string());
    let mut s = format!(
        "file           {} ({:.1} MB, GGUF v{}, {} tensors)\n",
        m.path.display(),
        m.file_size as f64 / 1e6,
        m.gguf_version,
        m.n_tensors
    );
    let name = m.name.as_deref().map(|n| format!(" ({n})")).unwrap_or_default();
    s += &format!("architecture   {}{name}\n", m.architecture);
    s += &format!("n_embd         {}\nn_layer        {}\n", m.n_embd, m.n_layer);
    if let Some(c) = m.context_length {
        s += &format!("context        {c}\n");
    }
    s += &format!(
        "vocabulary     {} tokens, tokenizer {}/{}, fingerprint {:016x}\n",
        m.n_vocab,
        m.tokenizer_model.as_deref().unwrap_or("none"),
        m.tokenizer_pre.as_deref().unwrap_or("-"),
        m.tokenizer_fingerprint
    );
    s += &format!("special ids    bos {}, eos {}, mask {}\n", id(m.bos_id), id(m.eos_id), id(m.mask_id));
    s += &format!("chat template  {}\n", if m.has_chat_template { "yes" } else { "no" });
    if let Some(d) = &m.dflash {
        let kind = if d.is_dflash2() { "DFlash 2" } else { "DFlash 1" };
        s += &format!(
            "drafter        {kind}, block size {}, target layer inputs {:?}\n",
            d.block_size.map_or("none".into(), |b| b.to_string()),
            d.target_layers
        );
        if d.is_dflash2() {
            s += &format!(
                "selector       top-k {}, rank {}, conv kernel {}, conv group {}\n",
                d.selector_top_k, d.selector_rank, d.conv_kernel_size, d.conv_group_size
            );
        }
        let fc = d.fc_shape.map_or("missing".into(), |[i, o]| format!("{i} -> {o}"));
        let embd = match (d.has_token_embd, d.has_output) {
            (true, true) => "own token_embd and output",
            (true, false) => "own token_embd, also used as output",
            (false, true) => "target's token_embd, own output",
            (false, false) => "target's token_embd and output",
        };
        let d2t = d.d2t_len.map_or("no d2t".into(), |n| format!("d2t of {n} tokens"));
        s += &format!("weights        fc {fc}, {embd}, {d2t}{}\n", if d.causal { ", causal" } else { "" });
    }
    s
}

/// Every key with a short rendering of its value, then every tensor.
fn list_all(g: &Gguf) -> String {
    let mut s = format!("\nmetadata ({} keys):\n", g.metadata.len());
    for (k, v) in &g.metadata {
        s += &format!("  {k} = {}\n", short(v));
    }
    s += &format!("\ntensors ({}):\n", g.tensors.len());
    for t in &g.tensors {
        s += &format!("  {} {} {:?} at {} ({} bytes)\n", t.name, t.type_name, t.shape, t.offset, t.nbytes);
    }
    s
}

/// A value on one line: arrays show their length and first elements, long strings are cut.
fn short(v: &MetaValue) -> String {
    match v {
        MetaValue::Array(_, items) => {
            let head: Vec<String> = items.iter().take(4).map(short).collect();
            let more = if items.len() > 4 { ", ..." } else { "" };
            format!("[{} items: {}{more}]", items.len(), head.join(", "))
        }
        MetaValue::Str(s) if s.chars().count() > 60 => format!("{:?}... ({} bytes)", s.chars().take(60).collect::<String>(), s.len()),
        MetaValue::Str(s) => format!("{s:?}"),
        MetaValue::U8(x) => format!("{x}u8"),
        MetaValue::I8(x) => format!("{x}i8"),
        MetaValue::U16(x) => format!("{x}u16"),
        MetaValue::I16(x) => format!("{x}i16"),
        MetaValue::U32(x) => format!("{x}u32"),
        MetaValue::I32(x) => format!("{x}i32"),
        MetaValue::U64(x) => format!("{x}u64"),
        MetaValue::I64(x) => format!("{x}i64"),
        MetaValue::F32(x) => format!("{x}f32"),
        MetaValue::F64(x) => format!("{x}f64"),
        MetaValue::Bool(x) => x.to_string(),
    }
}

/// `--check`: the batch-invariance probe with repacking on and off, and the choice the engine
/// makes from it.
fn check(args: &InspectArgs, info: &ModelInfo) -> Result<()> {
    use crate::llama::{ContextParams, Model, ModelParams};
    use std::sync::Arc;
    if info.dflash.is_some() {
        anyhow::bail!("{} is a DFlash drafter: --check probes a target", args.file.display());
    }
    if args.batches.iter().any(|&b| !(2..=512).contains(&b)) {
        anyhow::bail!("--batches: each size must be between 2 and 512");
    }
    let params = ContextParams {
        n_threads: args.threads,
        cache_k: args.cache_type_k,
        cache_v: args.cache_type_v,
        flash_attn: args.flash_attn_ref,
        reference_kernels: args.flash_attn_ref,
        ..ContextParams::default()
    };
    let context = args.context.unwrap_or(4).max(1);
    let mut probes = Vec::new();
    let mut few_row_weights = 0;
    crate::llama::install_kernels(); // the kernels a target loaded by the engine runs with
    for repack in [true, false] {
        let model = Arc::new(Model::load(&args.file, &ModelParams { n_gpu_layers: args.gpu_layers, repack })?);
        if repack {
            few_row_weights = model.few_row_weights();
        }
        let runs = (0..args.runs.max(1))
            .map(|_| crate::target::probe_at(&model, &params, &args.batches, false, context))
            .collect::<Result<Vec<_>, _>>()?;
        probes.push(median_probe(runs));
    }
    let choice = match (probes[0].invariant(), probes[1].invariant()) {
        (true, _) => "repack on (bit-identical)",
        (false, true) => "repack off (repacked batches round differently)",
        (false, false) => "none is bit-identical: speculative output may differ from plain decoding",
    };
    // The kernels with a check of their own run it here, on this CPU and this build: every op
    // they take, on random inputs, against ggml's own kernels.
    let random_checks: Vec<_> = crate::llama::OpKernel::ALL
        .into_iter()
        .filter(|k| k.is_on())
        .filter_map(|k| Some((k, k.differences(1, args.threads)?)))
        .collect();
    if args.json {
        let mut out = serde_json::json!({ "file": args.file, "threads": args.threads, "cache_type_k": args.cache_type_k.name(),
            "cache_type_v": args.cache_type_v.name(), "context": context, "flash_attn_ref": args.flash_attn_ref,
            "system_info": crate::llama::system_info(), "few_row_weights": few_row_weights, "probes": probes, "choice": choice });
        for kernel in crate::llama::OpKernel::ALL {
            out[kernel.key()] = kernel.is_on().into();
        }
        for (kernel, check) in &random_checks {
            out[format!("{}_random_check", kernel.key())] = match check {
                Ok(n) if kernel.rounds_as_ggml() => serde_json::json!({ "differing_outputs": n }),
                Ok(n) => serde_json::json!({ "outputs_beyond_error_bound": n }),
                Err(e) => serde_json::json!({ "error": e }),
            };
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{} ({}), {} threads, K / V cache {} / {}, {context} tokens of context, {}",
        args.file.display(),
        info.architecture,
        args.threads,
        args.cache_type_k.name(),
        args.cache_type_v.name(),
        if args.flash_attn_ref { "flash attention (reference kernels)" } else { "no flash attention (as the engine runs it)" }
    );
    println!(
        "{:<7} {:>5} {:>9} {:>11} {:>12} {:>9} {:>13}",
        "repack", "batch", "identical", "max |diff|", "argmax flips", "ms", "x single step"
    );
    for p in &probes {
        let on = if p.repack { "on" } else { "off" };
        println!("{on:<7} {:>5} {:>9} {:>11} {:>12} {:>9.1} {:>13.2}", 1, "-", "-", "-", p.single_ms, 1.0);
        for c in &p.checks {
            let same = if c.identical { "yes" } else { "NO" };
            let x = c.ms / p.single_ms;
            println!("{on:<7} {:>5} {same:>9} {:>11.6} {:>12} {:>9.1} {x:>13.2}", c.batch, c.max_abs_diff, c.argmax_flips, c.ms);
        }
    }
    println!("(decode times: medians over {} probe(s), logits for every row)", args.runs.max(1));
    if few_row_weights > 0 {
        println!("repacked for AMX: {few_row_weights} weights multiply 2-6 rows with dflash2's few-row kernels");
    }
    for kernel in crate::llama::OpKernel::ALL.into_iter().filter(|k| k.is_on()) {
        let exact = kernel.rounds_as_ggml();
        let checked = match random_checks.iter().find(|(k, _)| *k == kernel).map(|(_, c)| c) {
            None => String::new(),
            Some(Ok(0)) if exact => "; on random inputs here: bit-identical".into(),
            Some(Ok(0)) => "; on random inputs here: every output within its error bound".into(),
            Some(Ok(n)) if exact => format!("; on random inputs here: {n} outputs DIFFER"),
            Some(Ok(n)) => format!("; on random inputs here: {n} outputs BEYOND its error bound"),
            Some(Err(e)) => format!("; random check failed: {e}"),
        };
        let values = if exact { "the same values as ggml's" } else { "not ggml's rounding, for a drafter's weights only" };
        println!("{}: dflash2's kernel ({values}; {}=1 for ggml's{checked})", kernel.what(), kernel.switch());
    }
    println!("choice: {choice}");
    Ok(())
}

/// One probe whose timings are the medians of `runs` (their bit checks are the same each time:
/// the kernels are deterministic; any difference is kept).
fn median_probe(mut runs: Vec<crate::target::Probe>) -> crate::target::Probe {
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut p = runs.remove(0);
    p.single_ms = median(std::iter::once(p.single_ms).chain(runs.iter().map(|r| r.single_ms)).collect());
    for (i, c) in p.checks.iter_mut().enumerate() {
        c.ms = median(std::iter::once(c.ms).chain(runs.iter().map(|r| r.checks[i].ms)).collect());
        for r in &runs {
            c.identical &= r.checks[i].identical;
            c.max_abs_diff = c.max_abs_diff.max(r.checks[i].max_abs_diff);
        }
    }
    p
}

/// `--costs`: what one speculative cycle's pieces cost here, at `--context` tokens of context,
/// with the engine's settings (threads, cache types), medians of 30 rounds that each time every
/// piece once, in a cycle's order (so the drafter runs after target decodes, as in the engine, and a
/// burst of noise on a shared machine lands on every piece alike): the target's single step (what
/// plain decoding pays per token), the drafter's injection of 1..8 rows of target features (the
/// tokens a cycle accepted) and its block decode at each block size. A drafter call pays off only
/// while it is a small share of a step (issue #18 asks <= 0.25 at block 8).
fn costs(args: &InspectArgs, info: &ModelInfo) -> Result<()> {
    use crate::draft::drafter::Drafter;
    use crate::engine::CacheTypes;
    use crate::llama::{Batch, Context, ContextParams, FeatureSource, Model, ModelParams};
    use std::sync::Arc;
    use std::time::Instant;
    let Some(dflash) = &info.dflash else {
        anyhow::bail!("{} is not a DFlash drafter: --costs times a drafter against its --target", args.file.display());
    };
    let target_path = args.target.as_ref().expect("clap requires --target with --costs");
    crate::llama::install_kernels(); // the kernels a target loaded by the engine runs with
    let gpu = ModelParams { n_gpu_layers: args.gpu_layers, ..ModelParams::default() };
    let target = Arc::new(Model::load(target_path, &gpu)?);
    let drafter = Arc::new(Model::load(&args.file, &gpu)?);
    let n = args.context.unwrap_or(256).max(1);
    let params = ContextParams {
        n_ctx: n + 64,
        n_threads: args.threads,
        flash_attn: false,
        adapt_threads: false,
        ..ContextParams::default()
    };
    let text = "The quick brown fox jumps over the lazy dog, and the speculative decoder drafts a block. ";
    let mut tokens = target.tokenize(&text.repeat(n / 8 + 1), true, false)?;
    tokens.truncate(n);
    const RUNS: usize = 30;
    // The target as plain decoding runs it, and as the engine runs it beside this drafter (its
    // layer inputs extracted at every decode), each in a context holding the prompt.
    let prefilled = |p: &ContextParams| -> Result<Context> {
        let mut ctx = Context::new(target.clone(), p, None)?;
        let mut batch = Batch::tokens(p.n_batch.max(1), 1);
        for (c, chunk) in tokens.chunks(p.n_batch.max(1)).enumerate() {
            batch.clear();
            for (i, &t) in chunk.iter().enumerate() {
                batch.add_token(t, (c * p.n_batch + i) as i32, &[0], c * p.n_batch + i + 1 == n)?;
            }
            ctx.decode(&batch, "costs prefill")?;
        }
        Ok(ctx)
    };
    let with_features =
        ContextParams { features: FeatureSource::auto(&target.architecture(), drafter.target_layer_ids()), ..params.clone() };
    let mut plain = prefilled(&params)?;
    let mut featured = prefilled(&with_features)?;
    let mut batch = Batch::tokens(8, 1);
    // a verify of `rows` rows after the prompt, taken back after
    let mut verify = |ctx: &mut Context, rows: usize| -> crate::llama::Result<()> {
        batch.clear();
        for i in 0..rows {
            batch.add_token(tokens[n - 1], (n + i) as i32, &[0], true)?;
        }
        ctx.decode(&batch, "costs verify")?;
        ctx.seq_rm(0, n as i32, -1)
    };

    let caches = CacheTypes::default();
    let mut d = Drafter::new(drafter, &plain, 1, args.threads, caches.draft_k, caches.draft_v)?;
    let w = d.feature_width();
    // any values: the drafter's cost does not depend on them (its norms take out the scale)
    let rows: Vec<f32> = (0..w * (n + 8)).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
    d.inject(&rows[..w * n], 0, 0)?;
    let injections = [1usize, 2, 4, 8];
    let trained = dflash.block_size.unwrap_or(16) as usize;
    let blocks: Vec<usize> = [2usize, 4, 8, 16, 32].into_iter().filter(|&b| b <= trained.max(2)).collect();

    // Every piece is timed once per round, RUNS rounds: a burst of noise on a shared machine then
    // lands on all of them alike, and their ratios hold.
    let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(RUNS); 4 + injections.len() + blocks.len()];
    let mut timed = |piece: usize, f: &mut dyn FnMut() -> crate::llama::Result<()>| -> Result<()> {
        let t = Instant::now();
        f()?;
        samples[piece].push(t.elapsed().as_secs_f64() * 1e3);
        Ok(())
    };
    for _ in 0..RUNS {
        timed(0, &mut || verify(&mut plain, 1))?;
        timed(1, &mut || verify(&mut plain, 8))?;
        timed(2, &mut || verify(&mut featured, 1))?;
        timed(3, &mut || verify(&mut featured, 8))?;
        for (i, &k) in injections.iter().enumerate() {
            timed(4 + i, &mut || {
                d.inject(&rows[w * n..w * (n + k)], n, 0)?;
                d.truncate(0, n)
            })?;
        }
        for (i, &b) in blocks.iter().enumerate() {
            timed(4 + injections.len() + i, &mut || d.draft(&[(tokens[n - 1], n, 0)], b).map(|_| ()))?;
        }
    }
    let median: Vec<f64> = samples
        .into_iter()
        .map(|mut v| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        })
        .collect();
    let [step, verify8, step_f, verify8_f] = [median[0], median[1], median[2], median[3]];
    let inject: Vec<(usize, f64)> = injections.iter().copied().zip(median[4..].iter().copied()).collect();
    let draft: Vec<(usize, f64)> = blocks.iter().copied().zip(median[4 + injections.len()..].iter().copied()).collect();
    if args.json {
        let rows = |v: &[(usize, f64)]| -> Vec<serde_json::Value> {
            v.iter().map(|&(k, ms)| serde_json::json!({ "n": k, "ms": ms, "steps": ms / step })).collect()
        };
        let out = serde_json::json!({ "target": target_path, "drafter": args.file, "context": n, "threads": args.threads,
            "system_info": crate::llama::system_info(), "target_step_ms": step,
            "target_verify8_ms": verify8, "target_with_features_ms": { "step": step_f, "verify8": verify8_f },
            "inject": rows(&inject), "draft": rows(&draft) });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("{} drafting for {}, {n} tokens of context, {} threads, medians of {RUNS} rounds (every piece once a round)",
        args.file.display(), target_path.display(), args.threads);
    println!("target single step: {step:.2} ms, verify of 8 rows: {verify8:.2} ms");
    println!(
        "with the drafter's feature extraction: single step {step_f:.2} ms ({:+.1}%), verify of 8 rows {verify8_f:.2} ms ({:+.1}%)",
        (step_f / step - 1.0) * 100.0,
        (verify8_f / verify8 - 1.0) * 100.0
    );
    println!("{:<22} {:>5} {:>9} {:>13}", "drafter", "rows", "ms", "x target step");
    for (k, ms) in &inject {
        println!("{:<22} {k:>5} {ms:>9.2} {:>13.2}", "feature injection", ms / step);
    }
    for (b, ms) in &draft {
        println!("{:<22} {b:>5} {ms:>9.2} {:>13.2}", "block decode", ms / step);
    }
    Ok(())
}
