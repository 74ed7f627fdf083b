//! The frontend ABI (`dflash2_spec_*`): a llama.cpp frontend that owns its model, context,
//! sampler chain and KV rollback (`ffi/examples/frontend.c`, built here against libdflash2.a)
//! drafts and verifies through it with output identical to the same frontend without
//! speculation at T=0 and the same law at T>0, at the engine's tau; and every misuse is an
//! error code with a message that says what was wrong.
mod common;

use dflash2::capi::*;
use dflash2::engine::{Engine, EngineConfig, GenerateOptions, Repack, SelectMode};
use llama_cpp_sys_2 as sys;
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::ptr::{null, null_mut};
use std::sync::OnceLock;

fn drafter() -> PathBuf {
    common::shipped_drafter()
}

/// A random DFlash 2 drafter paired with the Qwen2.5-Coder target (a qwen2 graph: no native
/// layer-input extraction, so features come from the capture).
fn qwen_drafter() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = common::scratch_dir("frontend-qwen-synth");
        let out = Command::new(env!("CARGO_BIN_EXE_dflash2"))
            .args(["synth", "--target"])
            .arg(common::real_model(common::QWEN_05B))
            .arg("--out")
            .arg(&dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        dir
    });
    dir.join("drafter-dflash2.gguf")
}

/// ffi/examples/frontend.c, compiled against the llama.h of this build and linked with
/// libdflash2.a (which carries the one llama.cpp both sides use).
fn frontend() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let dir = common::scratch_dir("frontend-example");
        let exe = dir.join("frontend");
        let ffi = Path::new(env!("CARGO_MANIFEST_DIR")).join("ffi");
        let out = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O2"])
            .arg(ffi.join("examples/frontend.c"))
            .arg(format!("-I{}", ffi.display()))
            .arg(format!("-I{}", env!("DFLASH2_LLAMA_INCLUDE")))
            .arg(common::lib_dir().join("libdflash2.a"))
            .args(["-lstdc++", "-lgomp", "-lm", "-lpthread", "-ldl", "-o"])
            .arg(&exe)
            .output()
            .unwrap();
        assert!(out.status.success(), "frontend.c does not build:\n{}", String::from_utf8_lossy(&out.stderr));
        exe
    })
}

struct FrontendRun {
    /// Token ids of each run.
    runs: Vec<Vec<i32>>,
    stderr: String,
}

fn run_frontend(args: &[&str]) -> FrontendRun {
    let out = Command::new(frontend()).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "frontend {args:?} failed:\n{stderr}");
    let runs = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect())
        .collect();
    FrontendRun { runs, stderr }
}

/// `name value` pairs of the frontend's last statistics line.
fn stat(stderr: &str, name: &str) -> f64 {
    let line = stderr.lines().filter(|l| l.starts_with("frontend: run")).last().expect("a statistics line");
    let words: Vec<&str> = line.split_whitespace().collect();
    let i = words.iter().position(|w| *w == name).unwrap_or_else(|| panic!("no {name} in {line}"));
    words[i + 1].parse().unwrap()
}

/// Drafted tokens accepted over all runs (from each run's statistics line).
fn accepted_total(stderr: &str) -> usize {
    stderr
        .lines()
        .filter(|l| l.starts_with("frontend: run"))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            w[w.iter().position(|x| *x == "accepted").unwrap() + 1].parse::<usize>().unwrap()
        })
        .sum()
}

/// A chat prompt as text (the frontend tokenizes it with special tokens parsed).
fn chat_text(target: &Path, text: &str) -> String {
    let model = dflash2::llama::Model::load(target, &Default::default()).unwrap();
    let msgs = [dflash2::llama::ChatMessage { role: "user".into(), content: text.into() }];
    let template = dflash2::template::ChatTemplate::new(&model, &dflash2::template::TemplateChoice::Model).unwrap();
    template.render(&msgs, true).unwrap()
}

const CHATS: [&str; 3] = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash map is in two sentences.",
    "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"",
];

#[test]
fn smollm2_frontend_with_native_features_reproduces_plain_decoding_at_the_engines_tau() {
    let target = common::real_model(common::SMOLLM2);
    let t = target.to_str().unwrap();
    let d = drafter();
    let d = d.to_str().unwrap();
    let cfg = EngineConfig {
        n_ctx: 2048,
        repack: Repack::Off, // as the frontend loads it
        ..EngineConfig::new(target.clone(), Some(drafter()))
    };
    let mut engine = Engine::load(&cfg).unwrap();
    // The frontend's process runs ggml's own kernels (the frontend ABI plugs in none); they round
    // as dflash2's do, all but the drafter's integer products: off here, the engine drafts as the
    // frontend does.
    dflash2::llama::OpKernel::DrafterRows.set(false);
    let mut tau_seen = 0.0f64;
    for chat in CHATS {
        let prompt = chat_text(&target, chat);
        let plain = run_frontend(&["-m", t, "-p", &prompt, "-n", "64"]);
        for select in ["greedy", "best-path"] {
            let spec = run_frontend(&["-m", t, "-d", d, "-p", &prompt, "-n", "64", "--block", "16", "--select", select]);
            assert_eq!(spec.runs, plain.runs, "{select} on {chat:?}:\n{}", spec.stderr);
            assert!(spec.stderr.contains("(features: native)"), "{}", spec.stderr);
            // The engine on the same tokens, block and selection drafts and accepts the same.
            let tokens = engine.model().tokenize(&prompt, true, true).unwrap();
            let mode = if select == "greedy" { SelectMode::Greedy } else { SelectMode::BestPath };
            let opts = GenerateOptions { n_predict: 64, draft: common::draft(mode, 16), ..GenerateOptions::default() };
            engine.reset().unwrap();
            let g = engine.generate(&tokens, &opts, |_| true).unwrap();
            assert_eq!(g.tokens, spec.runs[0], "engine and frontend ({select}, {chat:?})");
            let st = &g.stats;
            assert_eq!(stat(&spec.stderr, "accepted") as usize, st.n_draft_accepted, "{select} {chat:?}: {}", spec.stderr);
            assert_eq!(stat(&spec.stderr, "cycles") as usize, st.cycles, "{select} {chat:?}: {}", spec.stderr);
            assert!((stat(&spec.stderr, "tau") - st.tau()).abs() < 1e-3, "{select} {chat:?}: {}", spec.stderr);
            tau_seen = tau_seen.max(st.tau());
        }
    }
    assert!(tau_seen > 1.5, "the shipped drafter should be accepted here (best tau {tau_seen})");
}

#[test]
fn qwen_frontend_with_captured_features_reproduces_plain_decoding() {
    let target = common::real_model(common::QWEN_05B);
    let t = target.to_str().unwrap();
    let d = qwen_drafter();
    let d = d.to_str().unwrap();
    for prompt in ["def quicksort(arr):", "The three laws of thermodynamics are"] {
        let plain = run_frontend(&["-m", t, "-p", prompt, "-n", "40"]);
        for block in ["4", "0"] {
            let spec = run_frontend(&["-m", t, "-d", d, "-p", prompt, "-n", "40", "--block", block, "--capture"]);
            assert_eq!(spec.runs, plain.runs, "block {block} on {prompt:?}:\n{}", spec.stderr);
            assert!(spec.stderr.contains("(features: callback)"), "{}", spec.stderr);
            assert!(stat(&spec.stderr, "drafts") > 0.0, "the drafter ran: {}", spec.stderr);
        }
    }
}

#[test]
fn frontend_sampling_through_the_helpers_follows_the_chains_law() {
    const RUNS: usize = 1000;
    const N: usize = 4;
    let target = common::real_model(common::SMOLLM2);
    let t = target.to_str().unwrap();
    let d = drafter();
    let d = d.to_str().unwrap();
    let prompt = chat_text(&target, "Write a haiku about the sea.");
    let runs = RUNS.to_string();
    let pad = |r: FrontendRun| -> Vec<Vec<i32>> {
        r.runs.into_iter().map(|mut v| {
            v.resize(N, -1);
            v
        }).collect()
    };
    let base = ["-m", t, "-p", &prompt, "-n", "4", "--temp", "0.8", "--runs", &runs];
    let plain = pad(run_frontend(&[&base[..], &["--seed", "1"]].concat()));
    let spec = run_frontend(&[&base[..], &["-d", d, "--block", "4", "--seed", "100000"]].concat());
    assert!(stat(&spec.stderr, "drafts") > 0.0, "{}", spec.stderr);
    let accepted = accepted_total(&spec.stderr);
    assert!(accepted > RUNS / 10, "drafts were accepted at T>0 ({accepted} over {RUNS} runs)");
    let spec = pad(spec);
    assert_eq!((plain.len(), spec.len()), (RUNS, RUNS));
    common::same_distribution(N, &plain, &spec).unwrap();
}

/// `dflash2_verify_match`: the frontend's chain samples each verified row itself (its draw, its
/// stream), so with the drafter its loop gives the text it gives without one, seed for seed.
#[test]
fn frontend_matching_gives_the_chains_own_text_for_each_seed() {
    let target = common::real_model(common::SMOLLM2);
    let t = target.to_str().unwrap();
    let d = drafter();
    let d = d.to_str().unwrap();
    let prompt = chat_text(&target, CHATS[0]);
    let base = ["-m", t, "-p", &prompt, "-n", "48", "--temp", "0.8", "--runs", "12", "--seed", "7"];
    let plain = run_frontend(&base);
    let spec = run_frontend(&[&base[..], &["-d", d, "--block", "4", "--match"]].concat());
    assert_eq!(plain.runs.len(), 12);
    assert_eq!(spec.runs, plain.runs, "matching changed the frontend's text");
    let distinct: std::collections::HashSet<_> = plain.runs.iter().collect();
    assert!(distinct.len() > 1, "twelve seeds gave one text: nothing was sampled");
    assert!(accepted_total(&spec.stderr) > 50, "few drafts were taken: {}", spec.stderr);
}

// ---- misuse: an error code and a message, never a crash ----------------------------------

fn last_error() -> String {
    unsafe { CStr::from_ptr(dflash2_last_error()) }.to_string_lossy().into_owned()
}

#[track_caller]
fn expect_err(status: Status, want: Status, needle: &str) {
    let msg = last_error();
    assert_eq!(status, want, "{msg}");
    assert!(msg.contains(needle), "`{needle}` not in: {msg}");
}

/// A frontend's model and context, made with llama.h calls only.
struct Frontend {
    model: *mut sys::llama_model,
    ctx: *mut sys::llama_context,
}

impl Frontend {
    fn new(path: &Path) -> Self {
        dflash2::llama::init_backend();
        let c = CString::new(path.to_str().unwrap()).unwrap();
        unsafe {
            let mut mp = sys::llama_model_default_params();
            mp.use_extra_bufts = false;
            let model = sys::llama_model_load_from_file(c.as_ptr(), mp);
            assert!(!model.is_null());
            let mut cp = sys::llama_context_default_params();
            cp.n_ctx = 512;
            cp.n_batch = 256;
            cp.n_ubatch = 256;
            cp.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_DISABLED;
            let ctx = sys::llama_init_from_model(model, cp);
            assert!(!ctx.is_null());
            Self { model, ctx }
        }
    }

    fn spec(&self, drafter: &Path, p: &CSpecParams) -> std::result::Result<*mut SpecHandle, Status> {
        let d = CString::new(drafter.to_str().unwrap()).unwrap();
        let mut out = null_mut();
        match unsafe { dflash2_spec_init(self.model, self.ctx, d.as_ptr(), p, 2, &mut out) } {
            Status::Ok => Ok(out),
            s => Err(s),
        }
    }

    /// Decode `tokens` at positions `pos0..` of `seq`, every row asking for logits.
    fn decode(&self, tokens: &[i32], pos0: i32, seq: i32) -> sys::llama_batch {
        unsafe {
            let mut b = sys::llama_batch_init(tokens.len() as i32, 0, 1);
            for (i, &t) in tokens.iter().enumerate() {
                *b.token.add(i) = t;
                *b.pos.add(i) = pos0 + i as i32;
                *b.n_seq_id.add(i) = 1;
                *(*b.seq_id.add(i)) = seq;
                *b.logits.add(i) = 1;
            }
            b.n_tokens = tokens.len() as i32;
            assert_eq!(sys::llama_decode(self.ctx, b), 0);
            b
        }
    }
}

impl Drop for Frontend {
    fn drop(&mut self) {
        unsafe {
            sys::llama_free(self.ctx);
            sys::llama_model_free(self.model);
        }
    }
}

fn smollm2() -> &'static Frontend {
    struct Shared(Frontend);
    unsafe impl Sync for Shared {}
    unsafe impl Send for Shared {}
    static F: OnceLock<Shared> = OnceLock::new();
    &F.get_or_init(|| Shared(Frontend::new(&common::real_model(common::SMOLLM2)))).0
}

fn greedy_chain() -> *mut sys::llama_sampler {
    unsafe {
        let chain = sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params());
        sys::llama_sampler_chain_add(chain, sys::llama_sampler_init_greedy());
        chain
    }
}

fn dist_chain() -> *mut sys::llama_sampler {
    unsafe {
        let chain = sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params());
        sys::llama_sampler_chain_add(chain, sys::llama_sampler_init_temp(0.8));
        sys::llama_sampler_chain_add(chain, sys::llama_sampler_init_dist(7));
        chain
    }
}

#[test]
fn init_refuses_nulls_a_foreign_context_and_a_drafter_for_another_target() {
    let f = smollm2();
    let p = dflash2_spec_default_params();
    let d = CString::new(drafter().to_str().unwrap()).unwrap();
    let mut out = null_mut();
    unsafe {
        expect_err(dflash2_spec_init(null_mut(), f.ctx, d.as_ptr(), &p, 1, &mut out), Status::NullArg, "target");
        expect_err(dflash2_spec_init(f.model, null_mut(), d.as_ptr(), &p, 1, &mut out), Status::NullArg, "ctx_tgt");
        expect_err(dflash2_spec_init(f.model, f.ctx, null(), &p, 1, &mut out), Status::NullArg, "drafter_path");
        expect_err(dflash2_spec_init(f.model, f.ctx, d.as_ptr(), null(), 1, &mut out), Status::NullArg, "params");
        expect_err(dflash2_spec_init(f.model, f.ctx, d.as_ptr(), &p, 1, null_mut()), Status::NullArg, "out");
        expect_err(dflash2_spec_init(f.model, f.ctx, d.as_ptr(), &p, 0, &mut out), Status::InvalidArg, "n_seq");
        let missing = CString::new("/nonexistent/drafter.gguf").unwrap();
        expect_err(dflash2_spec_init(f.model, f.ctx, missing.as_ptr(), &p, 1, &mut out), Status::Model, "drafter.gguf");
    }
    // A context of another model.
    let qwen = Frontend::new(&common::real_model(common::QWEN_05B));
    unsafe {
        expect_err(
            dflash2_spec_init(f.model, qwen.ctx, d.as_ptr(), &p, 1, &mut out),
            Status::InvalidArg,
            "not made from the target model",
        );
    }
    // The Qwen drafter for the SmolLM2 target: the pairing check names the field.
    let qd = CString::new(qwen_drafter().to_str().unwrap()).unwrap();
    unsafe {
        expect_err(dflash2_spec_init(f.model, f.ctx, qd.as_ptr(), &p, 1, &mut out), Status::Mismatch, "vocabulary size");
    }
    assert!(out.is_null());
}

#[test]
fn drafting_before_begin_after_free_or_without_features_is_a_state_error() {
    let f = smollm2();
    let spec = f.spec(&drafter(), &CSpecParams { block_size: 4, ..dflash2_spec_default_params() }).unwrap();
    let mut tokens = [0i32; 8];
    let mut n = 0usize;
    unsafe {
        expect_err(dflash2_spec_draft(spec, 0, 1, 3, tokens.as_mut_ptr(), 8, &mut n), Status::State, "has not begun");
        expect_err(dflash2_spec_draft(spec, 5, 1, 3, tokens.as_mut_ptr(), 8, &mut n), Status::InvalidArg, "sequence 5");
        assert_eq!(dflash2_spec_begin(spec, 0), Status::Ok);
        // Positions 0..3 were never decoded and reported.
        expect_err(dflash2_spec_draft(spec, 0, 1, 3, tokens.as_mut_ptr(), 8, &mut n), Status::State, "no features for position 0");
        // Decode and report them: drafting works.
        sys::llama_memory_clear(sys::llama_get_memory(f.ctx), true);
        let b = f.decode(&[1, 2, 3], 0, 0);
        assert_eq!(dflash2_spec_process(spec, &b), Status::Ok, "{}", last_error());
        assert_eq!(dflash2_spec_draft(spec, 0, 4, 3, tokens.as_mut_ptr(), 8, &mut n), Status::Ok, "{}", last_error());
        assert!(n >= 1 && n <= 3, "block 4 drafts up to 3 tokens, got {n}");
        // Accepting more than was drafted.
        expect_err(dflash2_spec_accept(spec, 0, n as i32 + 1), Status::InvalidArg, "its last draft had");
        assert_eq!(dflash2_spec_accept(spec, 0, 0), Status::Ok);
        // A freed sequence must begin again.
        assert_eq!(dflash2_spec_seq_rm(spec, 0, -1), Status::Ok);
        expect_err(dflash2_spec_draft(spec, 0, 4, 3, tokens.as_mut_ptr(), 8, &mut n), Status::State, "or was freed");
        expect_err(dflash2_spec_accept(spec, 0, 0), Status::State, "has not begun");
        // Too small an output buffer is an argument error, not a silent cut.
        assert_eq!(dflash2_spec_begin(spec, 0), Status::Ok);
        expect_err(dflash2_spec_draft(spec, 0, 4, 3, null_mut(), 8, &mut n), Status::NullArg, "tokens");
        expect_err(dflash2_spec_process(spec, null()), Status::NullArg, "batch");
        sys::llama_batch_free(b);
        dflash2_spec_free(spec);
    }
}

#[test]
fn features_fed_by_the_frontend_are_checked_and_drafted_from() {
    let f = smollm2();
    let spec = f.spec(&drafter(), &CSpecParams { block_size: 4, ..dflash2_spec_default_params() }).unwrap();
    let mut info = std::mem::MaybeUninit::<CSpecInfo>::uninit();
    unsafe {
        assert_eq!(dflash2_spec_get_info(spec, info.as_mut_ptr()), Status::Ok);
        let info = info.assume_init();
        assert_eq!(info.feature_source, FEATURES_NATIVE);
        let n_embd = sys::llama_model_n_embd(f.model) as u64;
        assert_eq!(info.feature_width, u64::from(info.n_feature_layers) * n_embd);
        let width = info.feature_width as usize;
        assert_eq!(dflash2_spec_begin(spec, 1), Status::Ok);
        let rows = vec![0.01f32; 3 * width];
        expect_err(dflash2_spec_feed(spec, 1, 0, 0, rows.as_ptr()), Status::InvalidArg, "n is 0");
        expect_err(dflash2_spec_feed(spec, 1, -1, 3, rows.as_ptr()), Status::InvalidArg, "pos0");
        expect_err(dflash2_spec_feed(spec, 0, 0, 3, rows.as_ptr()), Status::State, "has not begun");
        assert_eq!(dflash2_spec_feed(spec, 1, 0, 3, rows.as_ptr()), Status::Ok, "{}", last_error());
        let mut tokens = [0i32; 8];
        let mut n = 0usize;
        assert_eq!(dflash2_spec_draft(spec, 1, 4, 3, tokens.as_mut_ptr(), 8, &mut n), Status::Ok, "{}", last_error());
        assert!(n >= 1, "a draft from fed features");
        // One position too far: position 3 has no features.
        assert_eq!(dflash2_spec_accept(spec, 1, 0), Status::Ok);
        expect_err(dflash2_spec_draft(spec, 1, 4, 5, tokens.as_mut_ptr(), 8, &mut n), Status::State, "no features for position 3");
        dflash2_spec_free(spec);
    }
}

#[test]
fn verify_helpers_refuse_the_wrong_chain_context_or_rows() {
    let f = smollm2();
    let spec = f.spec(&drafter(), &CSpecParams { block_size: 4, ..dflash2_spec_default_params() }).unwrap();
    let qwen = Frontend::new(&common::real_model(common::QWEN_05B));
    let (greedy, dist) = (greedy_chain(), dist_chain());
    let mut out = [0i32; 8];
    let mut n = 0usize;
    unsafe {
        assert_eq!(dflash2_spec_begin(spec, 0), Status::Ok);
        sys::llama_memory_clear(sys::llama_get_memory(f.ctx), true);
        let b = f.decode(&[1, 2, 3], 0, 0);
        assert_eq!(dflash2_spec_process(spec, &b), Status::Ok, "{}", last_error());
        let rows = [2i32];
        expect_err(
            dflash2_verify_greedy(spec, 0, dist, f.ctx, rows.as_ptr(), 1, out.as_mut_ptr(), 8, &mut n),
            Status::InvalidArg,
            "dflash2_verify_sample",
        );
        expect_err(
            dflash2_verify_sample(spec, 0, greedy, f.ctx, rows.as_ptr(), 1, out.as_mut_ptr(), 8, &mut n),
            Status::InvalidArg,
            "dflash2_verify_greedy",
        );
        expect_err(
            dflash2_verify_greedy(spec, 0, greedy, qwen.ctx, rows.as_ptr(), 1, out.as_mut_ptr(), 8, &mut n),
            Status::InvalidArg,
            "not the target context",
        );
        expect_err(
            dflash2_verify_greedy(spec, 0, null_mut(), f.ctx, rows.as_ptr(), 1, out.as_mut_ptr(), 8, &mut n),
            Status::NullArg,
            "chain",
        );
        // No draft pending: one row (a plain step); two rows is a mismatch.
        let two = [1i32, 2];
        expect_err(
            dflash2_verify_greedy(spec, 0, greedy, f.ctx, two.as_ptr(), 2, out.as_mut_ptr(), 8, &mut n),
            Status::InvalidArg,
            "0 drafted",
        );
        assert_eq!(dflash2_verify_greedy(spec, 0, greedy, f.ctx, rows.as_ptr(), 1, out.as_mut_ptr(), 8, &mut n), Status::Ok);
        assert_eq!(n, 1);
        let want = {
            let logits = std::slice::from_raw_parts(sys::llama_get_logits_ith(f.ctx, 2), sys::llama_vocab_n_tokens(sys::llama_model_get_vocab(f.model)) as usize);
            logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as i32
        };
        assert_eq!(out[0], want, "a plain step takes the argmax");
        // A row that asked for no logits.
        let b2 = {
            let mut b = sys::llama_batch_init(1, 0, 1);
            *b.token = out[0];
            *b.pos = 3;
            *b.n_seq_id = 1;
            **b.seq_id = 0;
            *b.logits = 0;
            b.n_tokens = 1;
            assert_eq!(sys::llama_decode(f.ctx, b), 0);
            b
        };
        assert_eq!(dflash2_spec_process(spec, &b2), Status::Ok, "{}", last_error());
        let zero = [0i32];
        expect_err(
            dflash2_verify_greedy(spec, 0, greedy, f.ctx, zero.as_ptr(), 1, out.as_mut_ptr(), 8, &mut n),
            Status::InvalidArg,
            "no logits",
        );
        sys::llama_batch_free(b);
        sys::llama_batch_free(b2);
        sys::llama_sampler_free(greedy);
        sys::llama_sampler_free(dist);
        dflash2_spec_free(spec);
    }
}

#[test]
fn tree_mode_drafts_trees_parents_first_and_refuses_chains() {
    let f = smollm2();
    let p = CSpecParams { select: SELECT_TREE, tree_budget: 8, block_size: 8, ..dflash2_spec_default_params() };
    let spec = f.spec(&drafter(), &p).unwrap();
    let (mut tokens, mut parents) = ([0i32; 16], [0i32; 16]);
    let mut n = 0usize;
    unsafe {
        assert_eq!(dflash2_spec_begin(spec, 0), Status::Ok);
        sys::llama_memory_clear(sys::llama_get_memory(f.ctx), true);
        let prompt = common::chat_prompt(&dflash2::llama::Model::load(&common::real_model(common::SMOLLM2), &Default::default()).unwrap(), "Count from one to ten.");
        let b = f.decode(&prompt, 0, 0);
        assert_eq!(dflash2_spec_process(spec, &b), Status::Ok, "{}", last_error());
        let pos = prompt.len() as i32;
        expect_err(dflash2_spec_draft(spec, 0, 28, pos, tokens.as_mut_ptr(), 16, &mut n), Status::State, "dflash2_spec_draft_tree");
        let st = dflash2_spec_draft_tree(spec, 0, 28, pos, tokens.as_mut_ptr(), parents.as_mut_ptr(), 16, &mut n);
        assert_eq!(st, Status::Ok, "{}", last_error());
        assert!((1..=8).contains(&n), "a tree within the budget: {n} nodes");
        for k in 0..n {
            assert!(parents[k] >= -1 && parents[k] < k as i32, "node {k}'s parent {} comes first", parents[k]);
        }
        // The frontend kept the first child of the anchor: a path of depth 1.
        expect_err(dflash2_spec_accept(spec, 0, 9), Status::InvalidArg, "its last draft had");
        assert_eq!(dflash2_spec_accept(spec, 0, 1), Status::Ok, "{}", last_error());
        expect_err(dflash2_spec_accept_rows(spec, 0, [999i32].as_ptr(), 1), Status::InvalidArg, "row 999");
        sys::llama_batch_free(b);
        dflash2_spec_free(spec);
    }
}

#[test]
fn a_target_without_native_extraction_needs_the_capture() {
    let qwen = Frontend::new(&common::real_model(common::QWEN_05B));
    let spec = qwen.spec(&qwen_drafter(), &dflash2_spec_default_params()).unwrap();
    unsafe {
        assert_eq!(dflash2_spec_begin(spec, 0), Status::Ok);
        let b = qwen.decode(&[1, 2], 0, 0);
        expect_err(dflash2_spec_process(spec, &b), Status::State, "dflash2_spec_capture_new");
        sys::llama_batch_free(b);
        dflash2_spec_free(spec);
        // A capture for a drafter of another target is refused.
        let mut cp = sys::llama_context_default_params();
        let mut cap = null_mut();
        let d = CString::new(drafter().to_str().unwrap()).unwrap();
        expect_err(dflash2_spec_capture_new(qwen.model, d.as_ptr(), &mut cp, &mut cap), Status::Mismatch, "vocabulary size");
        assert!(cap.is_null());
        let qd = CString::new(qwen_drafter().to_str().unwrap()).unwrap();
        assert_eq!(dflash2_spec_capture_new(qwen.model, qd.as_ptr(), &mut cp, &mut cap), Status::Ok, "{}", last_error());
        assert!(cp.cb_eval.is_some() && !cp.cb_eval_user_data.is_null());
        dflash2_spec_capture_free(cap);
    }
}

#[test]
fn the_abi_check_names_a_struct_that_differs_and_a_second_libllama() {
    let good = CSpecAbi {
        sizeof_context_params: std::mem::size_of::<sys::llama_context_params>(),
        sizeof_model_params: std::mem::size_of::<sys::llama_model_params>(),
        sizeof_batch: std::mem::size_of::<sys::llama_batch>(),
        sizeof_token_data_array: std::mem::size_of::<sys::llama_token_data_array>(),
        backend_init: Some(sys::llama_backend_init),
    };
    unsafe extern "C" fn other_libllama() {}
    unsafe {
        assert_eq!(dflash2_spec_abi_check(&good), Status::Ok, "{}", last_error());
        let bad = CSpecAbi { sizeof_batch: good.sizeof_batch + 8, ..good };
        expect_err(dflash2_spec_abi_check(&bad), Status::Mismatch, "llama_batch");
        let bad = CSpecAbi { backend_init: Some(other_libllama), ..good };
        expect_err(dflash2_spec_abi_check(&bad), Status::Mismatch, "another copy of libllama");
        expect_err(dflash2_spec_abi_check(null()), Status::NullArg, "abi");
    }
}

/// One token-tree cycle as a frontend with several sequences runs it: every leaf gets a
/// sequence that shares the prompt, each node is decoded once for the leaves below it, and
/// dflash2_verify_greedy over the tree's rows gives exactly what plain greedy decoding gives.
#[test]
fn a_tree_verified_with_one_sequence_per_leaf_gives_the_plain_tokens() {
    let target = common::real_model(common::SMOLLM2);
    dflash2::llama::init_backend();
    let c = CString::new(target.to_str().unwrap()).unwrap();
    let (model, ctx) = unsafe {
        let mut mp = sys::llama_model_default_params();
        mp.use_extra_bufts = false;
        let model = sys::llama_model_load_from_file(c.as_ptr(), mp);
        let mut cp = sys::llama_context_default_params();
        cp.n_ctx = 1024;
        cp.n_batch = 256;
        cp.n_ubatch = 256;
        cp.n_seq_max = 16;
        cp.kv_unified = true;
        cp.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_DISABLED;
        (model, sys::llama_init_from_model(model, cp))
    };
    let f = Frontend { model, ctx };
    let p = CSpecParams { select: SELECT_TREE, tree_budget: 12, block_size: 8, ..dflash2_spec_default_params() };
    let spec = f.spec(&drafter(), &p).unwrap();
    let loaded = dflash2::llama::Model::load(&target, &Default::default()).unwrap();
    let prompt = common::chat_prompt(&loaded, "Write a Python function that returns the n-th Fibonacci number.");
    let plain = {
        let cfg = EngineConfig { n_ctx: 1024, repack: Repack::Off, ..EngineConfig::new(target.clone(), None) };
        let mut e = Engine::load(&cfg).unwrap();
        let opts = GenerateOptions { n_predict: 12, draft: common::draft(SelectMode::None, 16), ..GenerateOptions::default() };
        e.generate(&prompt, &opts, |_| true).unwrap().tokens
    };
    let greedy = greedy_chain();
    unsafe {
        let mem = sys::llama_get_memory(f.ctx);
        sys::llama_memory_clear(mem, true);
        assert_eq!(dflash2_spec_begin(spec, 0), Status::Ok);
        let b = f.decode(&prompt, 0, 0);
        assert_eq!(dflash2_spec_process(spec, &b), Status::Ok, "{}", last_error());
        let (mut out, mut n) = ([0i32; 16], 0usize);
        let rows = [prompt.len() as i32 - 1];
        assert_eq!(dflash2_verify_greedy(spec, 0, greedy, f.ctx, rows.as_ptr(), 1, out.as_mut_ptr(), 16, &mut n), Status::Ok);
        let first = out[0];
        assert_eq!(first, plain[0]);
        let pos = prompt.len() as i32;
        let (mut tokens, mut parents) = ([0i32; 16], [0i32; 16]);
        let st = dflash2_spec_draft_tree(spec, 0, first, pos, tokens.as_mut_ptr(), parents.as_mut_ptr(), 16, &mut n);
        assert_eq!(st, Status::Ok, "{}", last_error());
        let n_nodes = n;
        // Leaves get sequences 1.. (sharing the prompt); a node belongs to the leaves below it.
        let is_leaf = |k: usize| !(0..n_nodes).any(|j| parents[j] == k as i32);
        let leaves: Vec<usize> = (0..n_nodes).filter(|&k| is_leaf(k)).collect();
        assert!(leaves.len() < 16, "{} leaves", leaves.len());
        let leaf_seq = |l: usize| 1 + leaves.iter().position(|&x| x == l).unwrap() as i32;
        for &l in &leaves {
            sys::llama_memory_seq_cp(mem, 0, leaf_seq(l), 0, pos);
        }
        let below = |k: usize| -> Vec<i32> {
            leaves
                .iter()
                .filter(|&&l| {
                    let mut x = l as i32;
                    while x >= 0 && x != k as i32 {
                        x = parents[x as usize];
                    }
                    x == k as i32
                })
                .map(|&l| leaf_seq(l))
                .collect()
        };
        let depth = |k: usize| {
            let (mut d, mut x) = (1, parents[k]);
            while x >= 0 {
                d += 1;
                x = parents[x as usize];
            }
            d
        };
        let mut tb = sys::llama_batch_init(n_nodes as i32 + 1, 0, 16);
        let put = |row: usize, token: i32, p: i32, seqs: &[i32]| {
            *tb.token.add(row) = token;
            *tb.pos.add(row) = p;
            *tb.n_seq_id.add(row) = seqs.len() as i32;
            for (i, &s) in seqs.iter().enumerate() {
                *(*tb.seq_id.add(row)).add(i) = s;
            }
            *tb.logits.add(row) = 1;
        };
        let all: Vec<i32> = std::iter::once(0).chain(leaves.iter().map(|&l| leaf_seq(l))).collect();
        put(0, first, pos, &all);
        for k in 0..n_nodes {
            put(k + 1, tokens[k], pos + depth(k), &below(k));
        }
        tb.n_tokens = n_nodes as i32 + 1;
        assert_eq!(sys::llama_decode(f.ctx, tb), 0);
        assert_eq!(dflash2_spec_process(spec, &tb), Status::Ok, "{}", last_error());
        let rows: Vec<i32> = (0..=n_nodes as i32).collect();
        let st = dflash2_verify_greedy(spec, 0, greedy, f.ctx, rows.as_ptr(), rows.len() as i32, out.as_mut_ptr(), 16, &mut n);
        assert_eq!(st, Status::Ok, "{}", last_error());
        assert_eq!(&out[..n], &plain[1..1 + n], "the tree's accepted path and bonus are the plain tokens");
        eprintln!("tree of {n_nodes} nodes, {} leaves: {} accepted", leaves.len(), n - 1);
        assert!(n >= 2, "the shipped drafter's tree should hold the next plain token here");
        // The accepted path's rows become sequence 0's features (the anchor's row first).
        let mut path_rows = vec![0i32];
        let mut at: i32 = -1;
        for &t in &out[..n - 1] {
            let k = (0..n_nodes).find(|&k| parents[k] == at && tokens[k] == t).expect("an accepted token is a child") as i32;
            path_rows.push(k + 1);
            at = k;
        }
        assert_eq!(dflash2_spec_accept_rows(spec, 0, path_rows.as_ptr(), path_rows.len() as i32), Status::Ok, "{}", last_error());
        let mut st = std::mem::MaybeUninit::<CSpecStats>::uninit();
        assert_eq!(dflash2_spec_get_stats(spec, 0, st.as_mut_ptr()), Status::Ok);
        let st = st.assume_init();
        assert_eq!((st.cycles, st.n_accepted as usize), (1, n - 1), "{st:?}");
        sys::llama_batch_free(b);
        sys::llama_batch_free(tb);
        sys::llama_sampler_free(greedy);
        dflash2_spec_free(spec);
    }
}
