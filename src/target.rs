//! Loading the target so that verification is lossless on this machine.
//!
//! A verify decode must give every row the very numbers a single-token step gives, or a near-tie
//! flips a token. Whether llama.cpp's batch kernels do depends on the CPU, the weight type and the
//! weight layout: with repacking on (`use_extra_bufts`), an AVX-512 machine without AMX rounds a
//! Q4_K_M batch differently from one row, while Q4_0 and Q4_1 stay bit-identical. So nothing is
//! assumed: [`probe`] decodes a few positions one token at a time, then again as batches of the
//! sizes the engine verifies, and compares every row bit for bit. [`load_target`] loads with
//! repacking, probes, and reloads without it when the probe fails. Results are cached per model
//! file, settings and build, so the probe runs once.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::draft::lattice;
use crate::llama::{Batch, CacheType, Context, ContextParams, FeatureSource, LlamaError, Model, ModelParams, Token};

/// Whether the target's weights are repacked: `Auto` probes and chooses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Repack {
    /// Repack when the probe shows batches stay bit-identical, else not.
    #[default]
    Auto,
    /// Always repack (`--repack`): faster on some CPUs, output may differ from plain decoding.
    On,
    /// Never repack (`--no-repack`).
    Off,
}

/// Batch sizes the load-time probe checks. A repacked CPU kernel takes rows four at a time and
/// the rest one at a time, and ggml's tiled K-quant kernel takes over from 8 rows: 4 and 8
/// (batch paths), 5 (both kinds of row) and 2 (single-row path) cover them. `dflash2 inspect
/// --check` probes any sizes (the tests go up to the 33 rows of a token tree).
pub const LOAD_PROBE_BATCHES: [usize; 4] = [4, 5, 8, 2];

/// Batch sizes measured where no layout is bit-exact (every verify size: chains of block 4, 8
/// and 16, trees of 32 nodes): how far each strays sizes the engine's near-tie guard.
pub const TOLERANCE_BATCHES: [usize; 9] = [2, 3, 4, 5, 8, 9, 16, 17, 33];

/// One batch size compared with single-token steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchCheck {
    pub batch: usize,
    /// Every logit of every row equal, bit for bit.
    pub identical: bool,
    pub max_abs_diff: f32,
    /// Rows whose argmax differs from the single-token step's.
    pub argmax_flips: usize,
    /// Wall time of the batch's decode (logits for every row, as a verify asks).
    pub ms: f64,
}

/// What one probe of a loaded target found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    pub repack: bool,
    pub checks: Vec<BatchCheck>,
    /// Median wall time of one single-token step (a plain decoding step).
    pub single_ms: f64,
    /// Whether single steps at half the threads gave the same numbers (the engine moves
    /// between the two when the machine is busy); None when there is one thread.
    #[serde(default)]
    pub threads_identical: Option<bool>,
    /// Wall time of the whole probe.
    pub ms: f64,
}

impl Probe {
    pub fn invariant(&self) -> bool {
        self.checks.iter().all(|c| c.identical)
    }

    fn summary(&self) -> String {
        let worst = self.checks.iter().map(|c| c.max_abs_diff).fold(0.0f32, f32::max);
        let bad: Vec<String> = self.checks.iter().filter(|c| !c.identical).map(|c| c.batch.to_string()).collect();
        if bad.is_empty() {
            format!("batches of {} rows bit-identical to single steps", self.sizes())
        } else {
            format!("batches of {} rows differ from single steps (max |diff| {worst:.3})", bad.join(", "))
        }
    }

    fn sizes(&self) -> String {
        self.checks.iter().map(|c| c.batch.to_string()).collect::<Vec<_>>().join(", ")
    }
}

/// The target as loaded, and why it was loaded so.
#[derive(Debug, Clone, Serialize)]
pub struct TargetChoice {
    pub repack: bool,
    /// The probes behind the choice (read from the cache where they were run before).
    pub probes: Vec<Probe>,
    /// Whether verify batches are known to reproduce single steps with this choice.
    pub lossless: bool,
    pub reason: String,
}

/// Decode a few positions one token at a time (as plain decoding does), then each batch size
/// `b` over the last `b` of them, and compare every row bit for bit. `params` must be the
/// context settings the engine runs the target with (threads, cache types, flash attention).
/// `first_difference` stops at the first batch size that differs (enough to decide).
pub fn probe(
    model: &Arc<Model>,
    params: &ContextParams,
    batches: &[usize],
    first_difference: bool,
) -> Result<Probe, LlamaError> {
    probe_at(model, params, batches, first_difference, 4)
}

/// [`probe`] after `context` tokens decoded as one batch: some kernels change path with the
/// cache's length (ggml's flash attention splits a single row's cache past 256 cells).
pub fn probe_at(
    model: &Arc<Model>,
    params: &ContextParams,
    batches: &[usize],
    first_difference: bool,
    context: usize,
) -> Result<Probe, LlamaError> {
    let started = Instant::now();
    let n_ref = batches.iter().copied().max().unwrap_or(1).max(1);
    let prefix = context.max(1);
    let tokens = probe_tokens(model, prefix + n_ref)?;
    // One sequence, no feature capture: the probe is about the target's own numbers.
    let params = ContextParams {
        n_ctx: (prefix + n_ref).next_multiple_of(256),
        n_batch: n_ref.max(prefix),
        n_seq_max: 1,
        features: FeatureSource::None,
        kv_unified: true,
        // timed and compared as configured
        adapt_threads: false,
        ..params.clone()
    };
    let mut ctx = Context::new(model.clone(), &params, None)?;
    let mut batch = Batch::tokens(n_ref.max(prefix), 1);
    for (i, &t) in tokens[..prefix].iter().enumerate() {
        batch.add_token(t, i as i32, &[0], i + 1 == prefix)?;
    }
    ctx.decode(&batch, "probe prefix")?;
    let mut single = Vec::with_capacity(n_ref);
    let mut single_ms = Vec::with_capacity(n_ref);
    for (i, &t) in tokens[prefix..].iter().enumerate() {
        batch.clear();
        batch.add_token(t, (prefix + i) as i32, &[0], true)?;
        let t0 = Instant::now();
        ctx.decode(&batch, "probe single step")?;
        single_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        single.push(ctx.logits(0)?.to_vec());
    }
    single_ms.sort_by(f64::total_cmp);
    let threads_identical = if params.n_threads > 1 {
        let half = ContextParams { n_threads: (params.n_threads / 2).max(1), ..params.clone() };
        let mut other = Context::new(model.clone(), &half, None)?;
        let mut b = Batch::tokens(prefix, 1);
        for (i, &t) in tokens[..prefix].iter().enumerate() {
            b.add_token(t, i as i32, &[0], i + 1 == prefix)?;
        }
        other.decode(&b, "probe prefix")?;
        let mut same = true;
        for (i, &t) in tokens[prefix..].iter().enumerate() {
            b.clear();
            b.add_token(t, (prefix + i) as i32, &[0], true)?;
            other.decode(&b, "probe single step")?;
            same &= other.logits(0)?.iter().zip(&single[i]).all(|(x, y)| x.to_bits() == y.to_bits());
        }
        Some(same)
    } else {
        None
    };
    let mut checks = Vec::new();
    for &b in batches {
        let start = prefix + n_ref - b;
        ctx.seq_rm(0, start as i32, -1)?;
        batch.clear();
        for (i, &t) in tokens[start..].iter().enumerate() {
            batch.add_token(t, (start + i) as i32, &[0], true)?;
        }
        let t0 = Instant::now();
        ctx.decode(&batch, "probe batch")?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let mut check = BatchCheck { batch: b, identical: true, max_abs_diff: 0.0, argmax_flips: 0, ms };
        for r in 0..b {
            let (got, want) = (ctx.logits(r)?, &single[n_ref - b + r]);
            for (x, y) in got.iter().zip(want) {
                if x.to_bits() != y.to_bits() {
                    check.identical = false;
                    check.max_abs_diff = check.max_abs_diff.max((x - y).abs());
                }
            }
            check.argmax_flips += usize::from(lattice::argmax(got) != lattice::argmax(want));
        }
        let stop = first_difference && !check.identical;
        checks.push(check);
        if stop {
            break;
        }
    }
    let repack = model.repacked();
    let single_ms = single_ms[single_ms.len() / 2];
    Ok(Probe { repack, checks, single_ms, threads_identical, ms: started.elapsed().as_secs_f64() * 1e3 })
}

/// `n` ordinary tokens of code-like text (what speculative decoding mostly verifies).
fn probe_tokens(model: &Model, n: usize) -> Result<Vec<Token>, LlamaError> {
    const TEXT: &str = "def mean(xs):\n    \"\"\"Return the average of a list of numbers.\"\"\"\n    \
                        total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n";
    let mut tokens = Vec::new();
    while tokens.len() < n {
        let more = model.tokenize(TEXT, false, false)?;
        if more.is_empty() {
            return Err(LlamaError::Invalid("the probe text tokenizes to nothing".into()));
        }
        tokens.extend(more);
    }
    tokens.truncate(n);
    Ok(tokens)
}

/// Load the target at `path` for verification with context settings `params`: with repacking
/// unless `repack` says otherwise, falling back to no repacking when a probe shows that batches
/// round differently. Says at info level what was chosen and why.
pub fn load_target(
    path: &Path,
    n_gpu_layers: i32,
    repack: Repack,
    params: &ContextParams,
) -> Result<(Arc<Model>, TargetChoice), LlamaError> {
    // before the probe, which must see the kernels the target will run with
    crate::llama::install_kernels();
    let cache = ProbeCache::new(path, n_gpu_layers, params);
    let load = |repack: bool| Model::load(path, &ModelParams { n_gpu_layers, repack }).map(Arc::new);
    // A cached probe needs no model; a fresh one is run on the model it loads.
    let mut loaded: Option<Arc<Model>> = None;
    let choice = decide(repack, |on| {
        if let Some(p) = cache.get(on) {
            return Ok(p);
        }
        loaded = None; // free one copy of the weights before loading the other
        let model = load(on)?;
        let p = probe(&model, params, &LOAD_PROBE_BATCHES, true)?;
        cache.put(&p);
        loaded = Some(model);
        Ok(p)
    })?;
    let model = match loaded {
        Some(m) if m.repacked() == choice.repack => m,
        other => {
            drop(other);
            load(choice.repack)?
        }
    };
    if choice.probes.iter().any(|p| p.threads_identical == Some(false)) {
        // moving between thread counts would change the target's numbers: keep them fixed
        model.keep_thread_count();
        tracing::info!(
            "target {}: {} threads and half as many round differently here: decodes keep {}",
            path.display(),
            params.n_threads,
            params.n_threads
        );
    }
    let on_cpu = !crate::llama::gpu_offload_supported() || n_gpu_layers == 0;
    if on_cpu
        && params.cache_k == CacheType::F16
        && !crate::llama::OpKernel::F16Attention.is_on()
        && crate::llama::system_info().contains("AVX512_BF16 = 1")
    {
        // ggml's own f16 attention converts every cached element; with bf16 it uses vdpbf16ps
        // (BENCHMARKS (k)). dflash2's f16 kernel, when on, is faster than either (BENCHMARKS (m)).
        tracing::info!(
            "this CPU has bf16 dot products (AVX512-BF16) and dflash2's f16 attention kernel is off: a bf16 target \
             cache (-ctk bf16 -ctv bf16) makes the target's attention cheaper; it changes the target's text, as any \
             cache type does (README)"
        );
    }
    if choice.lossless {
        tracing::info!("target {}: {}", path.display(), choice.reason);
    } else {
        // Measure every verify size: the engine then trusts a batch row's choice only where
        // its two best candidates are further apart than the batch can stray (`engine`).
        let p = probe(&model, params, &TOLERANCE_BATCHES, false)?;
        let diffs: Vec<(usize, f32)> = p.checks.iter().map(|c| (c.batch, c.max_abs_diff)).collect();
        tracing::warn!(
            "target {}: {}; near-ties within {:?} (batch rows, max |diff|) are decided by single steps",
            path.display(),
            choice.reason,
            diffs
        );
        model.set_verify_tolerance(diffs);
    }
    Ok((model, choice))
}

/// The choice for `mode`, given `load_and_probe(repack)`, which probes the model loaded with
/// that setting.
pub fn decide(
    mode: Repack,
    mut load_and_probe: impl FnMut(bool) -> Result<Probe, LlamaError>,
) -> Result<TargetChoice, LlamaError> {
    Ok(match mode {
        Repack::Auto => {
            let first = load_and_probe(true)?;
            if first.invariant() {
                let reason = format!("weight repacking on: {}", first.summary());
                TargetChoice { repack: true, lossless: true, reason, probes: vec![first] }
            } else {
                let second = load_and_probe(false)?;
                let lossless = second.invariant();
                let reason = if lossless {
                    format!("weight repacking off: with it, {}; without it, {}", first.summary(), second.summary())
                } else {
                    format!(
                        "NOT bit-exact on this machine: with repacking, {}; without, {}",
                        first.summary(),
                        second.summary()
                    )
                };
                TargetChoice { repack: false, lossless, reason, probes: vec![first, second] }
            }
        }
        Repack::On | Repack::Off => {
            let on = mode == Repack::On;
            let p = load_and_probe(on)?;
            let lossless = p.invariant();
            let reason = format!("weight repacking {} (forced): {}", if on { "on" } else { "off" }, p.summary());
            TargetChoice { repack: on, lossless, reason, probes: vec![p] }
        }
    })
}

/// Probe results on disk, one file per (model file, settings, build, CPU): a probe costs a few
/// hundred milliseconds, a cache read nothing. `DFLASH2_CACHE_DIR` moves it; an unusable cache
/// directory only means probing again.
struct ProbeCache {
    dir: Option<PathBuf>,
    key: String,
}

impl ProbeCache {
    fn new(path: &Path, n_gpu_layers: i32, params: &ContextParams) -> Self {
        let dir = std::env::var_os("DFLASH2_CACHE_DIR")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("dflash2")))
            .or_else(|| std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache").join("dflash2")))
            .map(|d| d.join("invariance"));
        let file = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let meta = std::fs::metadata(path).ok();
        let mtime = meta.as_ref().and_then(|m| m.modified().ok()).and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
        let key = format!(
            "{}|{}|{:?}|gpu {n_gpu_layers}|threads {}|k {}|v {}|fa {}|ref {}|{} {}|{}|{}|{:?}|{}",
            file.display(),
            meta.map_or(0, |m| m.len()),
            mtime,
            params.n_threads,
            params.cache_k.name(),
            params.cache_v.name(),
            params.flash_attn,
            params.reference_kernels,
            env!("CARGO_PKG_VERSION"),
            env!("DFLASH2_KERNELS_HASH"),
            crate::llama::system_info(),
            cpu_model(),
            LOAD_PROBE_BATCHES,
            ggml_env(),
        );
        Self { dir, key }
    }

    fn file(&self, repack: bool) -> Option<PathBuf> {
        let mut h: u64 = 0xcbf29ce484222325; // FNV-1a: a stable name for the key
        for b in self.key.bytes().chain([u8::from(repack)]) {
            h = (h ^ u64::from(b)).wrapping_mul(0x100000001b3);
        }
        self.dir.as_ref().map(|d| d.join(format!("{h:016x}.json")))
    }

    fn get(&self, repack: bool) -> Option<Probe> {
        #[derive(Deserialize)]
        struct Entry {
            key: String,
            probe: Probe,
        }
        let text = std::fs::read_to_string(self.file(repack)?).ok()?;
        let e: Entry = serde_json::from_str(&text).ok()?;
        (e.key == self.key && e.probe.repack == repack).then_some(e.probe)
    }

    fn put(&self, probe: &Probe) {
        let Some(file) = self.file(probe.repack) else { return };
        let body = serde_json::json!({ "key": self.key, "probe": probe }).to_string();
        let written = file.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|()| {
            let tmp = file.with_extension("tmp");
            std::fs::write(&tmp, body)?;
            std::fs::rename(tmp, &file)
        });
        if let Err(e) = written {
            tracing::debug!("cannot cache the invariance probe in {}: {e}", file.display());
        }
    }
}

/// ggml's switches from the environment (`GGML_CPU_TILED_MM`, ...) and dflash2's own kernels' switches:
/// they change the kernels that run.
fn ggml_env() -> String {
    let mut vars: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("GGML_") || k.starts_with("LLAMA_") || crate::llama::KERNEL_SWITCHES.contains(&k.as_str()))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    vars.sort();
    vars.join(" ")
}

/// The CPU's model name and feature flags (the probe's result is only valid on the same kind).
fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let line = |key: &str| info.lines().find(|l| l.starts_with(key)).unwrap_or_default().to_string();
    format!("{} {}", line("model name"), line("flags"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(repack: bool, identical: bool) -> Probe {
        let check =
            |batch| BatchCheck { batch, identical, max_abs_diff: if identical { 0.0 } else { 0.5 }, argmax_flips: 0, ms: 1.0 };
        Probe { repack, checks: LOAD_PROBE_BATCHES.iter().map(|&b| check(b)).collect(), single_ms: 1.0, threads_identical: None, ms: 1.0 }
    }

    /// `loads` records each load; `differs(repack)` says whether that layout's batches differ.
    fn run(mode: Repack, differs: impl Fn(bool) -> bool) -> (TargetChoice, Vec<bool>) {
        let mut loads = Vec::new();
        let choice = decide(mode, |on| {
            loads.push(on);
            Ok(probe(on, !differs(on)))
        })
        .unwrap();
        (choice, loads)
    }

    #[test]
    fn auto_keeps_repacking_where_batches_are_bit_identical() {
        let (c, loads) = run(Repack::Auto, |_| false);
        assert_eq!((c.repack, c.lossless, loads), (true, true, vec![true]));
    }

    #[test]
    fn auto_reloads_without_repacking_when_repacked_batches_differ() {
        let (c, loads) = run(Repack::Auto, |on| on);
        assert_eq!((c.repack, c.lossless, loads), (false, true, vec![true, false]));
        assert!(c.reason.contains("differ"), "{}", c.reason);
        assert_eq!(c.probes.len(), 2);
    }

    #[test]
    fn a_machine_where_nothing_is_bit_exact_is_said_so() {
        let (c, _) = run(Repack::Auto, |_| true);
        assert!(!c.lossless && c.reason.starts_with("NOT bit-exact"), "{}", c.reason);
    }

    #[test]
    fn a_forced_setting_is_kept_and_reported() {
        let (c, loads) = run(Repack::On, |on| on);
        assert_eq!((c.repack, c.lossless, loads), (true, false, vec![true]));
        let (c, loads) = run(Repack::Off, |on| on);
        assert_eq!((c.repack, c.lossless, loads), (false, true, vec![false]));
    }
}
