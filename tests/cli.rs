//! The command line as users run it: `generate`, and `answer` (training answers, many at once).
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn synth_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = common::scratch_dir("cli-synth");
        let out = dflash2(&["synth", "--out", dir.to_str().unwrap(), "--seed", "3"]);
        assert!(out.status.success(), "synth failed: {}", String::from_utf8_lossy(&out.stderr));
        dir
    })
}

fn dflash2(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dflash2")).args(args).output().unwrap()
}

fn path(name: &str) -> String {
    synth_dir().join(name).to_str().unwrap().to_string()
}

fn generate_json(extra: &[&str]) -> serde_json::Value {
    let target = path("target.gguf");
    let mut args = vec!["generate", "-m", &target, "-p", "Once upon a time", "-n", "24", "--json"];
    args.extend_from_slice(extra);
    let out = dflash2(&args);
    assert!(out.status.success(), "generate {extra:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON object on stdout")
}

#[test]
fn json_output_has_the_promised_fields_and_matches_plain_decoding() {
    let drafter = path("drafter-dflash2.gguf");
    let spec = generate_json(&["-d", &drafter, "--block", "8"]);
    let plain = generate_json(&["--select", "none"]);
    for key in [
        "text",
        "tokens",
        "n_generated",
        "tau",
        "cycles",
        "tokens_per_second",
        "n_draft_calls",
        "n_draft_positions",
        "draft_ms",
        "verify_ms",
        "host_ms",
    ] {
        assert!(spec.get(key).is_some(), "missing {key} in {spec}");
    }
    assert_eq!(spec["tokens"], plain["tokens"]);
    assert_eq!(spec["text"], plain["text"]);
    assert_eq!(spec["n_generated"], 24);
    assert!(spec["tau"].as_f64().unwrap() >= 1.0);
    assert!(spec["cycles"].as_u64().unwrap() > 0);
    let (calls, positions) = (spec["n_draft_calls"].as_u64().unwrap(), spec["n_draft_positions"].as_u64().unwrap());
    assert!(calls > 0 && positions >= calls && positions <= 7 * calls, "{calls} calls drafted {positions} positions at block 8");
}

#[test]
fn chat_applies_the_targets_template() {
    let out = generate_json(&["--select", "none", "--chat", "--system", "Be brief."]);
    // The chatml prompt is longer than the raw one: the template was applied.
    let raw = generate_json(&["--select", "none"]);
    assert!(out["n_prompt"].as_u64().unwrap() > raw["n_prompt"].as_u64().unwrap() + 4);
}

#[test]
fn a_drafter_for_another_target_is_refused_before_loading() {
    let dir = common::scratch_dir("cli-other-target");
    // A drafter written for the real SmolLM2 target does not pair with the synthetic one.
    let smol = common::real_model(common::SMOLLM2);
    let d = dflash2::gguf::synth::synth_for_target(&smol, &dir, 0).unwrap().path;
    let target = path("target.gguf");
    let out = dflash2(&["generate", "-m", &target, "-d", d.to_str().unwrap(), "-p", "hi", "-n", "4"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("vocabulary"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn the_look_up_drafts_by_default_and_plain_decoding_is_one_flag_away() {
    let target = path("target.gguf");
    // Without a drafter and without --select, the look-up drafts from the context (the default).
    let out = dflash2(&["generate", "-m", &target, "-p", "a b a b a b", "-n", "8", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((json["select"].as_str(), json["lookup"].as_u64()), (Some("greedy"), Some(4)), "{json}");
    assert!(json["from_lookup"]["drafted"].is_u64() && json["from_drafter"]["drafted"] == 0, "{json}");
    // --no-lookup without a drafter: plain decoding, as in llama.cpp, and drafting modes are refused
    // naming what they need; the last of --lookup / --no-lookup wins.
    let out = dflash2(&["generate", "-m", &target, "-p", "hi", "-n", "4", "--no-lookup", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((json["select"].as_str(), json["lookup"].is_null()), (Some("none"), true), "{json}");
    let out = dflash2(&["generate", "-m", &target, "-p", "hi", "--select", "greedy", "--lookup", "--no-lookup"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs a drafter (-d DRAFTER.gguf) or the look-up (not --no-lookup)"));
    let out = dflash2(&["generate", "-m", &target, "-p", "hi", "-n", "4", "--no-lookup", "--lookup", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["select"], "greedy", "{json}");
    // llama.cpp's driver cannot draft without a drafter; the n-gram has bounds.
    let out = dflash2(&["generate", "-m", &target, "-p", "hi", "--select", "upstream"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--select upstream needs a drafter"));
    let out = dflash2(&["generate", "-m", &target, "-p", "hi", "--lookup-ngram", "9"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--lookup-ngram"));
}

#[test]
fn a_prompt_over_the_context_exits_with_a_clear_error() {
    let target = path("target.gguf");
    let long = "word ".repeat(400);
    let out = dflash2(&["generate", "-m", &target, "-p", &long, "-c", "128", "--select", "none"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("context holds"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// A KV cache larger than the machine's memory is refused with the sizes before llama.cpp
/// allocates it (an overcommitted allocation would get the process killed without a word).
#[test]
fn a_context_larger_than_memory_is_refused_at_start() {
    let target = path("target.gguf");
    for cmd in [&["generate", "-m", &target, "-p", "hi", "--select", "none", "-c", "2000000000"][..],
                &["serve", "-m", &target, "--port", "0", "-c", "2000000000"][..]] {
        let out = dflash2(cmd);
        assert!(!out.status.success(), "{cmd:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("GiB of KV cache") && err.contains("lower --ctx-size"), "{cmd:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn missing_model_file_is_a_clear_error() {
    let out = dflash2(&["generate", "-m", "/nonexistent/model.gguf", "-p", "hi", "--select", "none"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn kv_cache_types_take_llama_cpp_spellings_and_keep_the_output() {
    let drafter = path("drafter-dflash2.gguf");
    let spec = generate_json(&["-d", &drafter, "--block", "8", "-ctk", "q8_0", "-ctkd", "f16", "-ctvd", "q4_0"]);
    let plain = generate_json(&["--select", "none", "--cache-type-k", "q8_0"]);
    assert_eq!(spec["tokens"], plain["tokens"]);
}

#[test]
fn bad_kv_cache_types_are_refused_with_the_reason() {
    let target = path("target.gguf");
    let out = dflash2(&["generate", "-m", &target, "-p", "hi", "-n", "4", "-ctk", "q3_x"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("unknown KV cache type `q3_x`") && err.contains("q8_0"), "{err}");
    // The target runs without flash attention, which llama.cpp needs to quantize V.
    let out = dflash2(&["generate", "-m", &target, "-p", "hi", "-n", "4", "-ctv", "q8_0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("flash attention") && err.contains("f16"), "{err}");
}

/// `dflash2 answer` writes, for every prompt, the greedy answer plain `generate --chat` gives
/// (token for token, whatever number of conversations is decoded together), sampled answers after
/// it, and resumes without writing an answer twice.
#[test]
fn answer_writes_each_prompts_greedy_answer_batched_and_resumes() {
    let dir = common::scratch_dir("cli-answer");
    let prompts = dir.join("prompts.jsonl");
    let texts = ["Tell me a story.", "def add(a, b):", "What is the sea?", "List three colours."];
    let rows: Vec<String> = texts.iter().map(|t| serde_json::json!({ "source": "test", "prompt": t }).to_string()).collect();
    std::fs::write(&prompts, rows.join("\n") + "\n").unwrap();
    let out = dir.join("answers.jsonl");
    let _ = std::fs::remove_file(&out);
    let target = path("target.gguf");
    let answer = |limit: &str| {
        let o = dflash2(&[
            "answer", "-m", &target, "--prompts", prompts.to_str().unwrap(), "--out", out.to_str().unwrap(),
            "--parallel", "3", "-n", "16", "--samples", "2", "--temp", "0.9", "--limit", limit,
        ]);
        assert!(o.status.success(), "answer failed: {}", String::from_utf8_lossy(&o.stderr));
    };
    answer("5"); // stopped part-way: the rerun must finish the rest and repeat nothing
    answer("0");
    let written: Vec<serde_json::Value> =
        std::fs::read_to_string(&out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(written.len(), texts.len() * 2, "every (prompt, sample) once");
    for t in texts {
        let greedy: Vec<_> = written.iter().filter(|r| r["prompt"] == t && r["sample"] == 0).collect();
        let sampled: Vec<_> = written.iter().filter(|r| r["prompt"] == t && r["sample"] == 1).collect();
        assert_eq!((greedy.len(), sampled.len()), (1, 1), "{t}");
        let plain = dflash2(&["generate", "-m", &target, "--select", "none", "--chat", "-p", t, "-n", "16", "--json"]);
        let plain: serde_json::Value = serde_json::from_slice(&plain.stdout).unwrap();
        assert_eq!(greedy[0]["answer_tokens"], plain["tokens"], "{t}: the batched greedy answer differs from generate's");
        assert_eq!(greedy[0]["answer"], plain["text"], "{t}");
        assert_eq!(greedy[0]["source"], "test");
        assert_eq!(sampled[0]["temperature"].as_f64(), Some(0.9f32 as f64));
    }
}

/// `dflash2 quantize` goes through llama.cpp's quantizer: an already-quantized input is refused
/// without `--allow-requantize` (saying why), and the result loads and generates.
#[test]
fn quantize_refuses_a_silent_requantize_and_writes_a_loadable_model() {
    let dir = common::scratch_dir("cli-quantize");
    let (target, out) = (path("target.gguf"), dir.join("target.q4_0.gguf"));
    let _ = std::fs::remove_file(&out);
    let refused = dflash2(&["quantize", &target, out.to_str().unwrap(), "--type", "q4_0"]);
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("already quantized") && err.contains("--allow-requantize"), "{err}");
    assert!(!out.exists(), "a refused quantize wrote a file");

    let bad_type = dflash2(&["quantize", &target, out.to_str().unwrap(), "--type", "q3_zz"]);
    assert!(String::from_utf8_lossy(&bad_type.stderr).contains("--type q3_zz"));

    let done = dflash2(&["quantize", &target, out.to_str().unwrap(), "--type", "q4_0", "--allow-requantize"]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    assert!(String::from_utf8_lossy(&done.stderr).contains("warning: requantizing"));
    let info = dflash2(&["inspect", out.to_str().unwrap(), "--all"]);
    assert!(String::from_utf8_lossy(&info.stdout).contains(" Q4_0 "), "no Q4_0 tensor in the output");
    let g = dflash2(&["generate", "-m", out.to_str().unwrap(), "-p", "Once upon a time", "-n", "8", "--json"]);
    assert!(g.status.success(), "{}", String::from_utf8_lossy(&g.stderr));
    let g: serde_json::Value = serde_json::from_slice(&g.stdout).unwrap();
    assert_eq!(g["n_generated"], 8);
}

/// A drafter's weights decide how often its drafts are taken, never the output: quantized by
/// `dflash2 quantize`, it still pairs with its target, drafts, and the text stays plain decoding's;
/// requantizing it warns about acceptance, not about the text.
#[test]
fn quantize_writes_a_drafter_that_pairs_and_keeps_the_output() {
    let dir = common::scratch_dir("cli-quantize-drafter");
    let (out, again) = (dir.join("drafter.q4_0.gguf"), dir.join("drafter.q8_0.gguf"));
    let (out_s, again_s) = (out.to_str().unwrap(), again.to_str().unwrap());
    let done = dflash2(&["quantize", &path("drafter-dflash2.gguf"), out_s, "--type", "q4_0"]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    let info = dflash2(&["inspect", out_s, "--all"]);
    assert!(String::from_utf8_lossy(&info.stdout).contains(" Q4_0 "), "no Q4_0 tensor in the output");
    let paired = dflash2(&["inspect", out_s, "--target", &path("target.gguf")]);
    assert!(paired.status.success(), "{}", String::from_utf8_lossy(&paired.stderr));

    let spec = generate_json(&["-d", out_s, "--block", "8", "--no-lookup"]);
    let plain = generate_json(&["--select", "none"]);
    assert!(spec["from_drafter"]["drafted"].as_u64().unwrap() > 0, "the quantized drafter drafted nothing: {spec}");
    assert_eq!(spec["tokens"], plain["tokens"]);

    let requantized = dflash2(&["quantize", out_s, again_s, "--type", "q8_0", "--allow-requantize"]);
    assert!(requantized.status.success(), "{}", String::from_utf8_lossy(&requantized.stderr));
    let warning = String::from_utf8_lossy(&requantized.stderr);
    assert!(warning.contains("warning: requantizing") && warning.contains("drafts may be taken less often"), "{warning}");
}

/// `inspect --check` probes where it is told: after `--context` tokens, with the V cache type and
/// the reference flash attention it is given (each row computed alone: every batch bit-exact).
#[test]
fn inspect_check_probes_at_a_given_context_with_reference_flash_attention() {
    let target = path("target.gguf");
    let out = dflash2(&[
        "inspect", &target, "--check", "--context", "300", "--flash-attn-ref", "--cache-type-v", "f32", "--batches", "2,4", "-t", "2",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((j["context"].as_u64(), j["flash_attn_ref"].as_bool(), j["cache_type_v"].as_str()), (Some(300), Some(true), Some("f32")));
    let probes = j["probes"].as_array().unwrap();
    assert_eq!(probes.len(), 2, "{j}");
    for p in probes {
        let sizes: Vec<u64> = p["checks"].as_array().unwrap().iter().map(|c| c["batch"].as_u64().unwrap()).collect();
        assert_eq!(sizes, [2, 4], "{p}");
        assert!(p["checks"].as_array().unwrap().iter().all(|c| c["identical"] == true), "{p}");
    }
    // the kernels check themselves against ggml's on random inputs, on this CPU
    assert_eq!(j["drafter_ops_random_check"]["differing_outputs"], 0, "{j}");
    for kernel in ["q8_0_attention", "q5_0_rows", "q4_0x8_rows", "q4_1_rows", "q8_0_rows"] {
        if j[kernel] == true {
            assert_eq!(j[format!("{kernel}_random_check")]["differing_outputs"], 0, "{kernel}: {j}");
        }
    }
    // the drafter's integer products do not round as ggml's: each output within the kernel's bound
    if j["drafter_rows"] == true {
        assert_eq!(j["drafter_rows_random_check"]["outputs_beyond_error_bound"], 0, "{j}");
    }
}

#[test]
fn inspect_costs_times_each_piece_of_a_cycle_and_refuses_a_target_alone() {
    let (target, drafter) = (path("target.gguf"), path("drafter-dflash2.gguf"));
    let out = dflash2(&["inspect", &drafter, "--target", &target, "--costs", "--context", "64", "-t", "1", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let step = j["target_step_ms"].as_f64().unwrap();
    assert!(step > 0.0, "{j}");
    assert_eq!(j["context"], 64);
    let rows = |key: &str| -> Vec<u64> { j[key].as_array().unwrap().iter().map(|r| r["n"].as_u64().unwrap()).collect() };
    assert_eq!(rows("inject"), [1, 2, 4, 8]);
    // every block size up to the drafter's trained one (the synthetic drafter's is 16)
    assert_eq!(rows("draft"), [2, 4, 8, 16]);
    for r in j["draft"].as_array().unwrap() {
        let (ms, steps) = (r["ms"].as_f64().unwrap(), r["steps"].as_f64().unwrap());
        assert!(ms > 0.0 && (steps - ms / step).abs() < 1e-9, "{r}");
    }
    // FILE must be the drafter, and the costs need its target
    let wrong = dflash2(&["inspect", &target, "--target", &target, "--costs"]);
    assert!(!wrong.status.success());
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("is not a DFlash drafter"), "{}", String::from_utf8_lossy(&wrong.stderr));
    let alone = dflash2(&["inspect", &drafter, "--costs"]);
    assert!(!alone.status.success());
    assert!(String::from_utf8_lossy(&alone.stderr).contains("--target"), "{}", String::from_utf8_lossy(&alone.stderr));
}
