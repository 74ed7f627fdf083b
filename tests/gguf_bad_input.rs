//! `dflash2 inspect` on files that are missing, damaged or do not pair: each must exit non-zero
//! with a message naming the problem, and never panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dflash2::gguf::synth::{random_target, Vocab};

fn dflash2(args: &[&Path]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dflash2"))
        .args(args)
        // keep stderr to the message itself
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .output()
        .expect("run dflash2")
}

/// A fresh directory holding the synthetic models (written through the CLI).
fn models(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dflash2-bad-input-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = dflash2(&[Path::new("synth"), Path::new("--out"), &dir, Path::new("--seed"), Path::new("1")]);
    assert!(out.status.success(), "synth failed: {}", String::from_utf8_lossy(&out.stderr));
    dir
}

fn inspect(file: &Path, target: Option<&Path>) -> Output {
    match target {
        Some(t) => dflash2(&[Path::new("inspect"), file, Path::new("--target"), t]),
        None => dflash2(&[Path::new("inspect"), file]),
    }
}

/// Non-zero exit, every `needles` in stderr, no panic.
fn assert_fails(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "exit status {:?}, stderr: {stderr}", out.status);
    for n in needles {
        assert!(stderr.contains(n), "stderr lacks {n:?}: {stderr}");
    }
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
}

#[test]
fn good_pair_passes_and_prints_json() {
    let dir = models("good");
    let out = inspect(&dir.join("drafter-dflash2.gguf"), Some(&dir.join("target.gguf")));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("pairing with"));
    let json = dflash2(&[Path::new("inspect"), &dir.join("drafter-cycle-exact.gguf"), Path::new("--json")]);
    assert!(json.status.success());
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).expect("valid JSON");
    assert_eq!(v["model"]["dflash"]["selector_top_k"], 16);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn missing_file() {
    let dir = models("missing");
    let path = dir.join("no-such-model.gguf");
    assert_fails(&inspect(&path, None), &["no-such-model.gguf", "no such file"]);
    // a missing target is reported as well
    assert_fails(&inspect(&dir.join("drafter-dflash1.gguf"), Some(&path)), &["no-such-model.gguf", "no such file"]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn truncated_file() {
    let dir = models("truncated");
    let bytes = std::fs::read(dir.join("target.gguf")).unwrap();
    // cut in the tensor data, in the tokenizer metadata, and inside the first header field
    for (name, len) in [("half.gguf", bytes.len() / 2), ("header.gguf", 3000), ("tiny.gguf", 10)] {
        let path = dir.join(name);
        std::fs::write(&path, &bytes[..len]).unwrap();
        assert_fails(&inspect(&path, None), &[name, "truncated"]);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn not_a_gguf_file() {
    let dir = models("notgguf");
    let path = dir.join("notes.txt");
    std::fs::write(&path, "these are not model weights\n").unwrap();
    assert_fails(&inspect(&path, None), &["notes.txt", "not a GGUF file"]);
    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert_fails(&inspect(&empty, None), &["empty.gguf", "not a GGUF file"]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn unsupported_version() {
    let dir = models("version");
    let mut bytes = std::fs::read(dir.join("target.gguf")).unwrap();
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    let path = dir.join("v1.gguf");
    std::fs::write(&path, &bytes).unwrap();
    assert_fails(&inspect(&path, None), &["v1.gguf", "version 1"]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn target_given_as_drafter() {
    let dir = models("arch");
    let target = dir.join("target.gguf");
    assert_fails(&inspect(&target, Some(&target)), &["architecture", "'llama'", "'dflash'"]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn mismatched_vocabulary() {
    let dir = models("vocab");
    let other = dir.join("target-400.gguf");
    random_target(&Vocab::bpe(400), 1).unwrap().write(&other).unwrap();
    assert_fails(
        &inspect(&dir.join("drafter-dflash2.gguf"), Some(&other)),
        &["vocabulary size: target has 400, drafter has 512"],
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn layer_id_out_of_range() {
    let dir = models("layers");
    // the drafter reads target layer inputs [1, 2]; make it [1, 7] for a 3-layer target
    let mut bytes = std::fs::read(dir.join("drafter-dflash1.gguf")).unwrap();
    let key = b"dflash.target_layers";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    // array of 2 int32: type 9, element type 5, length 2, then the ids
    assert_eq!(&bytes[at..at + 16], &[9, 0, 0, 0, 5, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]);
    bytes[at + 20..at + 24].copy_from_slice(&7i32.to_le_bytes());
    let path = dir.join("drafter-layer7.gguf");
    std::fs::write(&path, &bytes).unwrap();
    assert_fails(&inspect(&path, Some(&dir.join("target.gguf"))), &["target layer id 7", "3 layers", "1..=2"]);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Two tokens with one text: llama.cpp aborts the process on such a vocabulary (found by the
/// `gguf` fuzz target), so the pre-scan refuses it, and `generate` exits with that error.
#[test]
fn duplicate_token_texts_are_refused_before_llama_cpp_aborts() {
    let dir = models("duplicate-token");
    let mut bytes = std::fs::read(dir.join("target.gguf")).unwrap();
    // the one-character token "4" (a GGUF string: u64 length 1, then the byte) becomes "5"
    let four = [1u8, 0, 0, 0, 0, 0, 0, 0, b'4'];
    let at = bytes.windows(four.len()).position(|w| w == four).expect("the vocabulary has a token \"4\"");
    assert!(bytes.windows(four.len()).any(|w| w == [1u8, 0, 0, 0, 0, 0, 0, 0, b'5']), "and a token \"5\"");
    bytes[at + 8] = b'5';
    let path = dir.join("target-duplicate.gguf");
    std::fs::write(&path, &bytes).unwrap();
    assert_fails(&inspect(&path, None), &["tokenizer.ggml.tokens", "the same text \"5\"", "llama.cpp would abort"]);
    let out = dflash2(&[Path::new("generate"), Path::new("-m"), &path, Path::new("-p"), Path::new("hi"), Path::new("-n"), Path::new("2")]);
    assert_eq!(out.status.code(), Some(1), "an error exit, not an abort: {}", String::from_utf8_lossy(&out.stderr));
    assert_fails(&out, &["the same text \"5\""]);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A mutation search over the header of a real drafter file: random byte flips, lengths and counts
/// overwritten with extreme values, truncations. The reader and the pairing check must answer
/// every variant with a value or an error naming the file, and never panic. (Deterministic: a
/// failure reproduces with its seed and iteration; a longer search is `DFLASH2_MUTATIONS=N`.)
#[test]
fn mutated_headers_never_panic_the_reader_or_the_pairing_check() {
    use rand::{Rng, SeedableRng};
    let dir = models("mutate");
    let (target, drafter) = (dir.join("target.gguf"), dir.join("drafter-dflash2.gguf"));
    let original = std::fs::read(&drafter).unwrap();
    let target_info = dflash2::gguf::read_model_info(&target).unwrap();
    let n: usize = std::env::var("DFLASH2_MUTATIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(400);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let file = dir.join("mutant.gguf");
    let head = original.len().min(64 << 10);
    let (mut errors, mut oks) = (0, 0);
    for i in 0..n {
        let mut bytes = original.clone();
        for _ in 0..rng.gen_range(1..4) {
            let head = head.min(bytes.len());
            if head < 16 {
                break;
            }
            match rng.gen_range(0..4) {
                0 => bytes[rng.gen_range(0..head)] = rng.gen(),
                1 => {
                    // a length or count field overwritten with an extreme value
                    let at = rng.gen_range(0..head - 8) & !3;
                    let v: u64 = [0, 1, u64::MAX, u64::MAX / 2, 1 << 40, original.len() as u64, rng.gen()][rng.gen_range(0..7)];
                    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
                }
                2 => {
                    let at = rng.gen_range(0..head - 4);
                    bytes[at..at + 4].copy_from_slice(&rng.gen_range(0u32..64).to_le_bytes());
                }
                _ => bytes.truncate(rng.gen_range(0..bytes.len())),
            }
        }
        std::fs::write(&file, &bytes).unwrap();
        let outcome = std::panic::catch_unwind(|| {
            dflash2::gguf::read_model_info(&file).map(|info| dflash2::gguf::check_pair(&target_info, &info).is_ok())
        });
        match outcome {
            Err(_) => panic!("mutation {i} (seed 7) panicked the reader; the file is kept at {}", file.display()),
            Ok(Ok(_)) => oks += 1,
            Ok(Err(e)) => {
                assert!(e.to_string().contains("mutant.gguf"), "mutation {i}: the error does not name the file: {e}");
                errors += 1;
            }
        }
    }
    // the search reached both outcomes: it is not only feeding files the reader rejects at byte 0
    assert!(errors > n / 10 && oks > 0, "{errors} errors, {oks} files read");
    let _ = std::fs::remove_dir_all(&dir);
}
