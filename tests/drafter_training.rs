//! The drafter recipe end to end on the synthetic target: `dflash2 dataset` reads features
//! and greedy labels off the target, `gguf-drafters/train/train.py` trains a DFlash 2 (and a
//! DFlash 1) drafter for a few steps (its loss must fall), `dflash2 convert` turns the
//! checkpoint into GGUF, llama.cpp's drafter outputs for a block equal an independent
//! PyTorch computation of the same checkpoint (`reference.py`), the trained drafter
//! decodes losslessly, and the PyTorch copy of the target (`target_torch.py`, for GPU machines
//! without llama.cpp) reads the labels and features llama.cpp reads.
//!
//! Needs the training environment: `.venv/bin/python` with torch, numpy, safetensors and
//! gguf (`tests/support/setup.sh` makes it), or `$DFLASH2_TRAIN_PYTHON`. Missing: the test
//! fails, it is never skipped.
mod common;

use dflash2::draft::{drafter::Drafter, Lattice};
use dflash2::engine::{Engine, EngineConfig, GenerateOptions, SelectMode};
use dflash2::llama::{CacheType, Context, ContextParams, Model, ModelParams, Token};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use common::{train_python as python, train_script as script};

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{cmd:?} failed:\n{stderr}\n{}", String::from_utf8_lossy(&out.stdout));
    stderr
}

fn dflash2() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dflash2"))
}

/// Conversations for the synthetic target: any text works, the labels are the target's
/// own greedy tokens read off by `dflash2 dataset`.
fn write_conversations(path: &Path) {
    let words = "the quick brown fox jumps over the lazy dog a speculative decoder drafts a block of tokens \
        with a small model and the target model verifies the whole block in one pass def accept length draft \
        target for d t in zip return n once upon a time there was a little model that wanted to write stories";
    let words: Vec<&str> = words.split(' ').collect();
    let mut out = String::new();
    for i in 0..24 {
        let prompt: Vec<&str> = (0..6).map(|j| words[(i * 7 + j * 3) % words.len()]).collect();
        let answer: Vec<&str> = (0..60).map(|j| words[(i * 5 + j * (1 + i % 4)) % words.len()]).collect();
        let row = serde_json::json!({"prompt": prompt.join(" "), "answer": answer.join(" ")});
        out.push_str(&row.to_string());
        out.push('\n');
    }
    // plain text rows too (read as they are; the trainer keeps the labels the target agrees with)
    for i in 0..4 {
        let text: Vec<&str> = (0..80).map(|j| words[(i * 11 + j * 2) % words.len()]).collect();
        out.push_str(&serde_json::json!({"text": text.join(" ")}).to_string());
        out.push('\n');
    }
    std::fs::write(path, out).unwrap();
}

struct Trained {
    checkpoint: PathBuf,
    first_loss: f64,
    last_loss: f64,
    log: String,
}

fn train(target: &Path, data: &Path, out: &Path, extra: &[&str]) -> Trained {
    let _ = std::fs::remove_dir_all(out);
    let log = run(Command::new(python())
        .arg(script("train.py"))
        .args(["--target", target.to_str().unwrap(), "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .args(["--layers", "1", "--rank", "16", "--steps", "60", "--lr", "3e-3", "--warmup", "5"])
        .args(["--blocks-per-step", "16", "--log-every", "10", "--eval-every", "60", "--threads", "2"])
        .args(extra));
    // "step N/M loss X ..." lines, every 10 steps: the loss must have fallen
    let losses: Vec<f64> = log
        .lines()
        .filter(|l| l.starts_with("step "))
        .filter_map(|l| l.split_whitespace().nth(3).and_then(|x| x.parse().ok()))
        .collect();
    assert!(losses.len() >= 5, "too few loss lines in the training log:\n{log}");
    Trained { checkpoint: out.to_path_buf(), first_loss: losses[0], last_loss: *losses.last().unwrap(), log }
}

/// llama.cpp's lattice for the block at `anchor` of sequence `seq` of the dataset, with
/// the dataset's features of the positions before it injected, as the engine drafts it;
/// and the anchor token.
fn llama_lattice(target: &Path, drafter: &Path, data: &Path, seq: usize, anchor: usize, block: usize) -> (Lattice, i64) {
    let bytes = std::fs::read(data).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ints = |name: &str| -> Vec<i64> {
        let v = st.tensor(name).unwrap();
        match v.dtype() {
            safetensors::Dtype::I64 => v.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect(),
            _ => v.data().chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64).collect(),
        }
    };
    let (offsets, tokens) = (ints("offsets"), ints("tokens"));
    let feats = st.tensor("features").unwrap();
    let width = feats.shape()[1];
    let start = offsets[seq] as usize;
    let rows: Vec<f32> = feats.data()[start * width * 4..(start + anchor) * width * 4]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();

    let target = Arc::new(Model::load(target, &ModelParams::default()).unwrap());
    let drafter = Arc::new(Model::load(drafter, &ModelParams::default()).unwrap());
    let params = ContextParams { n_ctx: 512, n_batch: 256, ..ContextParams::default() };
    let tctx = Context::new(target, &params, None).unwrap();
    // f16 caches, not the engine's q8_0: the scores are compared with the reference to 2e-3
    let mut d = Drafter::new(drafter, &tctx, 1, 2, CacheType::F16, CacheType::F16).unwrap();
    d.inject(&rows, 0, 0).unwrap();
    let anchor_token = tokens[start + anchor];
    (d.draft(&[(anchor_token as Token, anchor, 0)], block).unwrap().remove(0), anchor_token)
}

/// The lattice as a map (position, predecessor id, candidate id) -> score.
fn score_map(ids: &[Vec<i64>], scores: &[Vec<Vec<f64>>], anchor: i64) -> std::collections::BTreeMap<(usize, i64, i64), f64> {
    let mut m = std::collections::BTreeMap::new();
    for t in 0..ids.len() {
        let preds: Vec<i64> = if t == 0 { vec![anchor] } else { ids[t - 1].clone() };
        for (p, &pred) in preds.iter().enumerate() {
            for (c, &cand) in ids[t].iter().enumerate() {
                m.insert((t, pred, cand), scores[t][p][c]);
            }
        }
    }
    m
}

fn compare_with_reference(target: &Path, trained: &Trained, data: &Path, dir: &Path, kind: &str) {
    let gguf = dir.join(format!("drafter-{kind}.gguf"));
    run(dflash2().args(["convert", "--from", trained.checkpoint.to_str().unwrap(), "--target"]).arg(target).arg("--out").arg(&gguf).args(["--type", "f32"]));
    let (seq, anchor, block) = (1usize, 40usize, 8usize);
    let ref_json = dir.join(format!("reference-{kind}.json"));
    run(Command::new(python())
        .arg(script("reference.py"))
        .args(["--checkpoint", trained.checkpoint.to_str().unwrap(), "--target", target.to_str().unwrap()])
        .args(["--data", data.to_str().unwrap(), "--out", ref_json.to_str().unwrap()])
        .args(["--seq", &seq.to_string(), "--anchor", &anchor.to_string(), "--block", &block.to_string()]));
    let reference: serde_json::Value = serde_json::from_slice(&std::fs::read(&ref_json).unwrap()).unwrap();
    let r_ids: Vec<Vec<i64>> = serde_json::from_value(reference["ids"].clone()).unwrap();
    let r_scores: Vec<Vec<Vec<f64>>> = serde_json::from_value(reference["scores"].clone()).unwrap();

    let (lat, anchor_id) = llama_lattice(target, &gguf, data, seq, anchor, block);
    assert_eq!(lat.n_pos, block - 1);
    assert_eq!(lat.k, r_ids[0].len(), "{kind}: candidates per position");
    let l_ids: Vec<Vec<i64>> = (0..lat.n_pos).map(|t| (0..lat.k).map(|c| lat.id(t, c) as i64).collect()).collect();
    let l_scores: Vec<Vec<Vec<f64>>> = (0..lat.n_pos)
        .map(|t| (0..lat.k).map(|p| lat.score_row(t, p).iter().map(|&x| x as f64).collect()).collect())
        .collect();
    // the anchor token is the reference's position-0 predecessor
    let r = score_map(&r_ids, &r_scores, anchor_id);
    let l = score_map(&l_ids, &l_scores, anchor_id);
    let scale = r.values().fold(1.0f64, |m, v| m.max(v.abs()));
    let mut compared = 0;
    for (key, &rv) in &r {
        // candidate sets may differ only by near-ties at the K-th place
        if let Some(&lv) = l.get(key) {
            assert!(
                (lv - rv).abs() <= 2e-3 * scale,
                "{kind}: score {key:?}: llama.cpp {lv}, reference {rv}\nllama.cpp {:?} {:?}\nreference {:?} {:?}",
                l_ids[key.0],
                l_scores[key.0][0],
                r_ids[key.0],
                r_scores[key.0][0]
            );
            compared += 1;
        }
    }
    assert!(
        compared as f64 >= 0.9 * r.len() as f64,
        "{kind}: llama.cpp's candidates differ from the reference's: {compared} of {} scores in common\nllama.cpp {l_ids:?}\nreference {r_ids:?}",
        r.len()
    );
}

/// One of a dataset's integer tensors (tokens, labels, soft-label ids).
fn ints(st: &safetensors::SafeTensors, name: &str) -> Vec<i32> {
    st.tensor(name).unwrap().data().chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap())).collect()
}

/// The dataset's soft labels: per token the target's `k` most likely next tokens, the first one
/// the greedy label, with log-probabilities that fall from one to the next and sum below 1.
fn check_soft_labels(data: &Path, k: usize) {
    let bytes = std::fs::read(data).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (next, ids) = (ints(&st, "next"), ints(&st, "topk_ids"));
    assert_eq!(st.tensor("topk_ids").unwrap().shape(), [next.len(), k]);
    assert_eq!(st.tensor("topk_logprobs").unwrap().shape(), [next.len(), k]);
    let lp: Vec<f32> = st.tensor("topk_logprobs").unwrap().data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    for (i, &label) in next.iter().enumerate() {
        let (row_ids, row_lp) = (&ids[i * k..(i + 1) * k], &lp[i * k..(i + 1) * k]);
        assert_eq!(row_ids[0], label, "token {i}: the most likely soft label is not the greedy one");
        assert!(row_lp.windows(2).all(|w| w[0] >= w[1]), "token {i}: {row_lp:?}");
        let mass: f32 = row_lp.iter().map(|l| l.exp()).sum();
        assert!(mass > 0.0 && mass <= 1.0 + 1e-4, "token {i}: top-{k} mass {mass}");
    }
}

#[test]
fn dataset_train_convert_and_run_a_drafter_on_the_synthetic_target() {
    let dir = common::scratch_dir("drafter-training");
    dflash2::gguf::synth::synth_all(&dir, 3).unwrap();
    let target = dir.join("target.gguf");
    let conv = dir.join("conversations.jsonl");
    write_conversations(&conv);
    let data = dir.join("dataset.safetensors");
    let log = run(dflash2().args(["dataset", "-m"]).arg(&target).arg("--conversations").arg(&conv).arg("--out").arg(&data).args(["--layers", "1,2", "-t", "2"]));
    assert!(log.contains("28 conversations"), "{log}");
    check_soft_labels(&data, 8);

    // read with flash attention (faster on long rows): the same tokens, labels equal up to
    // near-ties of the random target's flat laws, valid soft labels
    let fa = dir.join("dataset-fa.safetensors");
    let log = run(dflash2().args(["dataset", "-m"]).arg(&target).arg("--conversations").arg(&conv).arg("--out").arg(&fa).args(["--layers", "1,2", "-t", "2", "--flash-attn"]));
    assert!(log.contains("28 conversations"), "{log}");
    check_soft_labels(&fa, 8);
    let (exact, fast) = (std::fs::read(&data).unwrap(), std::fs::read(&fa).unwrap());
    let (exact, fast) = (safetensors::SafeTensors::deserialize(&exact).unwrap(), safetensors::SafeTensors::deserialize(&fast).unwrap());
    assert_eq!(ints(&exact, "tokens"), ints(&fast, "tokens"));
    let (exact, fast) = (ints(&exact, "next"), ints(&fast, "next"));
    let same = exact.iter().zip(&fast).filter(|(a, b)| a == b).count();
    assert!(same as f64 >= 0.9 * exact.len() as f64, "labels with flash attention: {same} of {} equal", exact.len());

    // the PyTorch copy of the target (what a GPU machine without llama.cpp decodes and reads
    // features with) computes what llama.cpp computes, up to llama.cpp's rounding of activations
    // (near-ties of this random target's flat laws flip; a wrong layout would agree by chance
    // alone), and its cached, left-padded batch decoding equals a full read
    let log = run(Command::new(python()).arg(script("target_torch.py")).arg("--target").arg(&target).arg("--data").arg(&data)
        .args(["--min-agree", "0.9", "--max-err", "0.03"]));
    let line = log.lines().find(|l| l.starts_with("greedy next agrees")).unwrap_or_else(|| panic!("{log}"));
    let agree: f64 = line.split_whitespace().nth(6).and_then(|x| x.parse().ok()).unwrap_or_else(|| panic!("{line}"));
    assert!(agree >= 0.9, "{line}");

    // DFlash 2: the shipped kind
    let d2 = train(&target, &data, &dir.join("ckpt-dflash2"), &["--top-k", "8", "--draft-vocab", "256"]);
    // (a random target's greedy tokens are hard to predict: a small but sure fall)
    assert!(d2.last_loss < d2.first_loss - 0.2, "DFlash 2 loss did not fall: {} -> {}", d2.first_loss, d2.last_loss);
    assert!(d2.log.contains("soft labels: the target's top-8 law"), "the trainer did not use the soft labels:\n{}", d2.log);
    compare_with_reference(&target, &d2, &data, &dir, "dflash2");

    // starting from the target's layers: norms, V/O and FFN are copied where the shapes fit
    let init = train(&target, &data, &dir.join("ckpt-init"), &["--top-k", "8", "--draft-vocab", "256", "--init-from-target", "1"]);
    let line = init.log.lines().find(|l| l.starts_with("initialised from target layers [1]")).unwrap_or_else(|| panic!("{}", init.log));
    let copied: usize = line.split(": ").nth(1).and_then(|x| x.split(' ').next()).and_then(|n| n.parse().ok()).unwrap();
    assert!(copied >= 2, "nothing but norms fit: {line}");
    assert!(init.last_loss < init.first_loss, "{line}: loss {} -> {}", init.first_loss, init.last_loss);

    // DFlash 1 (no selector), full vocabulary
    let d1 = train(&target, &data, &dir.join("ckpt-dflash1"), &["--top-k", "0", "--draft-vocab", "0"]);
    assert!(d1.last_loss < d1.first_loss - 0.2, "DFlash 1 loss did not fall: {} -> {}", d1.first_loss, d1.last_loss);
    compare_with_reference(&target, &d1, &data, &dir, "dflash1");

    // the trained drafter decodes losslessly, and resuming a finished run changes nothing
    let t = Arc::new(Model::load(&target, &ModelParams::default()).unwrap());
    let d = Arc::new(Model::load(&dir.join("drafter-dflash2.gguf"), &ModelParams::default()).unwrap());
    let mut cfg = EngineConfig::new(PathBuf::new(), None);
    cfg.n_ctx = 512;
    cfg.n_threads = 2;
    let mut e = Engine::from_models(t.clone(), Some(d), &cfg).unwrap();
    let prompt = t.tokenize("the quick brown fox jumps over", true, false).unwrap();
    let gen = |e: &mut Engine, select| {
        let opts = GenerateOptions { n_predict: 48, draft: common::draft(select, 8), ..Default::default() };
        e.generate(&prompt, &opts, |_| true).unwrap().tokens
    };
    let plain = gen(&mut e, SelectMode::None);
    for select in [SelectMode::Greedy, SelectMode::BestPath, SelectMode::Tree] {
        assert_eq!(gen(&mut e, select), plain, "{select:?} differs from plain decoding");
    }
}

#[test]
fn convert_rejects_a_checkpoint_that_does_not_fit_the_target() {
    let dir = common::scratch_dir("convert-bad");
    dflash2::gguf::synth::synth_all(&dir, 3).unwrap();
    let ck = dir.join("ckpt");
    let _ = std::fs::remove_dir_all(&ck);
    std::fs::create_dir_all(&ck).unwrap();
    // no config.json
    let out = dflash2().args(["convert", "--from"]).arg(&ck).arg("--target").arg(dir.join("target.gguf")).arg("--out").arg(dir.join("x.gguf")).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("config.json"), "{}", String::from_utf8_lossy(&out.stderr));
    // a config whose target layers the 3-layer target does not have
    let cfg = serde_json::json!({
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2,
        "dflash_config": {"target_layer_ids": [0, 5], "block_size": 8, "mask_token_id": 3}
    });
    std::fs::write(ck.join("config.json"), cfg.to_string()).unwrap();
    std::fs::write(ck.join("model.safetensors"), b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ").unwrap();
    let out = dflash2().args(["convert", "--from"]).arg(&ck).arg("--target").arg(dir.join("target.gguf")).arg("--out").arg(dir.join("x.gguf")).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("target_layer_ids") && err.contains("3-layer"), "{err}");
    assert!(!dir.join("x.gguf").exists(), "a failed conversion must not leave a file");
}

#[test]
fn the_campaign_learning_curve_is_drawn_from_its_csv() {
    let dir = common::scratch_dir("campaign-curve");
    let csv = Path::new(env!("CARGO_MANIFEST_DIR")).join("gguf-drafters/train/curves/campaign.csv");
    let (png, svg) = (dir.join("curve.png"), dir.join("curve.svg"));
    let _ = std::fs::remove_file(&png);
    run(Command::new(python()).arg(script("curve.py")).arg("--campaign").arg(&csv).arg("--png").arg(&png).arg("--svg").arg(&svg));
    let bytes = std::fs::read(&png).unwrap();
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 10_000, "not a drawn PNG ({} bytes)", bytes.len());
    // one line per series of the CSV: (block, prompt set, mode)
    let text = std::fs::read_to_string(&csv).unwrap();
    let series: std::collections::BTreeSet<Vec<&str>> =
        text.lines().skip(1).map(|l| l.split(',').collect::<Vec<_>>()).map(|c| vec![c[2], c[3], c[4]]).collect();
    let drawn = std::fs::read_to_string(&svg).unwrap().matches("<polyline").count();
    assert_eq!(drawn, series.len(), "series {series:?}");
    assert!(series.iter().any(|s| s[2] == "4") && series.iter().any(|s| s[2] == "16"), "block 4 and block 16 both: {series:?}");
}
