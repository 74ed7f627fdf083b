//! Inputs nobody thought of. First, what coverage-guided fuzzing (`fuzz/`, libFuzzer through
//! `cargo fuzz`) found and kept: every committed corpus input and crash input replayed through the
//! fuzz targets' own code (`fuzz/harness.rs`). Then seeded mutation fuzzing of the parsers of outside bytes. GGUF files
//! (the pre-scan and pairing check in-process; the whole llama.cpp load in a child process for
//! the mutants the pre-scan lets through), HTTP request bodies against the real server, and the
//! drafter recipe's inputs: `dataset`'s conversation JSONL and `convert`'s checkpoint (config.json,
//! the safetensors header), each converted mutant that passes loaded by llama.cpp too.
//! Nothing may panic, abort or hang; every refusal is a clear error. A short run is part of the
//! suite; `DFLASH2_FUZZ_ITERS=N` (and `DFLASH2_FUZZ_SEED`) runs a longer campaign.
mod common;
#[path = "../fuzz/harness.rs"]
mod harness;

use dflash2::gguf::{check_pair, read_model_info};
// the synthetic models: the ones the replayed fuzz targets use, written once per process
use harness::models;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn iters(default: usize) -> usize {
    std::env::var("DFLASH2_FUZZ_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn rng(salt: u64) -> ChaCha8Rng {
    let seed: u64 = std::env::var("DFLASH2_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    ChaCha8Rng::seed_from_u64(seed ^ salt)
}

/// The coverage-guided campaigns' corpora (`fuzz/corpus/NAME`, minimised with `cargo fuzz cmin`)
/// and every input that once broke a promise (`fuzz/regressions/NAME`), through the same code
/// the fuzzers ran: none may break one now.
#[test]
fn committed_fuzz_inputs_keep_every_promise() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut broken = Vec::new();
    for (name, run) in harness::TARGETS {
        let mut n = 0;
        for dir in ["corpus", "regressions"] {
            let Ok(entries) = std::fs::read_dir(root.join(dir).join(name)) else { continue };
            let mut files: Vec<PathBuf> = entries.map(|e| e.unwrap().path()).collect();
            files.sort();
            for file in files {
                let bytes = std::fs::read(&file).unwrap();
                if std::panic::catch_unwind(|| run(&bytes)).is_err() {
                    broken.push(file.display().to_string());
                }
                n += 1;
            }
        }
        eprintln!("{name}: {n} committed inputs");
        assert!(n >= 10, "fuzz/corpus/{name} holds {n} inputs: the campaign's corpus is missing");
    }
    assert!(broken.is_empty(), "inputs that break a promise again: {broken:#?}");
}

/// Integers that break length and count arithmetic.
const EDGES: [u64; 9] = [0, 1, 0x7f, 0xff, 0xffff, 0x7fff_ffff, 0xffff_ffff, 0x7fff_ffff_ffff_ffff, u64::MAX];

/// One to four mutations, mostly in the header (metadata and tensor infos: what is parsed).
fn mutate(bytes: &[u8], header: usize, r: &mut ChaCha8Rng) -> Vec<u8> {
    let mut b = bytes.to_vec();
    for _ in 0..r.gen_range(1..=4) {
        let span = if r.gen_bool(0.9) { header.min(b.len()) } else { b.len() };
        if span < 8 {
            break;
        }
        let at = r.gen_range(0..span - 8);
        match r.gen_range(0..6) {
            0 => b[at] ^= 1 << r.gen_range(0..8),
            1 => b[at] = r.gen(),
            2 => b[at..at + 4].copy_from_slice(&(EDGES[r.gen_range(0..EDGES.len())] as u32).to_le_bytes()),
            3 => b[at..at + 8].copy_from_slice(&EDGES[r.gen_range(0..EDGES.len())].to_le_bytes()),
            4 => b.truncate(at),
            _ => {
                let n = r.gen_range(1..64).min(b.len() - at);
                b.drain(at..at + n);
            }
        }
    }
    b
}

/// Where a GGUF's tensor data starts, roughly: what the pre-scan reads lies before.
fn header_len(bytes: &[u8]) -> usize {
    (bytes.len() / 8).clamp(4096, 256 << 10)
}

#[test]
fn gguf_prescan_and_pairing_survive_mutated_files() {
    let dir = common::scratch_dir("fuzz-gguf");
    let target = models().join("target.gguf");
    let target_info = read_model_info(&target).unwrap();
    let seeds: Vec<PathBuf> = ["target.gguf", "drafter-dflash2.gguf", "drafter-dflash1.gguf"]
        .iter()
        .map(|f| models().join(f))
        .chain([common::real_model(common::SMOLLM2)])
        .collect();
    let mut r = rng(0x6767);
    let (n, mut accepted, mut refused) = (iters(3000), Vec::new(), 0usize);
    for i in 0..n {
        let seed = &seeds[i % seeds.len()];
        // the real target: its first MiB only (the pre-scan never reads its tensor data)
        let bytes = read_prefix(seed, 4 << 20);
        let m = mutate(&bytes, header_len(&bytes), &mut r);
        let file = dir.join(format!("m{}.gguf", i % 8));
        std::fs::write(&file, &m).unwrap();
        let t = Instant::now();
        let outcome = std::panic::catch_unwind(|| {
            let info = read_model_info(&file)?;
            if info.dflash.is_some() {
                let _ = check_pair(&target_info, &info);
            }
            Ok::<_, dflash2::gguf::GgufError>(info)
        });
        let kept = dir.join(format!("panic-{i}.gguf"));
        match outcome {
            Err(_) => {
                std::fs::write(&kept, &m).unwrap();
                panic!("the pre-scan panicked on mutant {i} of {} (kept as {})", seed.display(), kept.display());
            }
            Ok(Err(e)) => {
                refused += 1;
                assert!(!e.to_string().is_empty());
            }
            Ok(Ok(_)) if seed.starts_with(models()) => {
                if accepted.len() < 64 {
                    let keep = dir.join(format!("accepted-{}.gguf", accepted.len()));
                    std::fs::write(&keep, &m).unwrap();
                    accepted.push(keep);
                }
            }
            Ok(Ok(_)) => {}
        }
        assert!(t.elapsed() < Duration::from_secs(5), "mutant {i} took {:?} to pre-scan", t.elapsed());
    }
    eprintln!("{n} mutants: {refused} refused by the pre-scan, {} of the synthetic ones passed it", accepted.len());
    assert!(refused > n / 4, "the mutations should mostly break something ({refused} of {n} refused)");

    // What the pre-scan lets through goes to llama.cpp: an error, never an abort or a hang.
    for (i, file) in accepted.iter().enumerate() {
        let is_drafter = read_model_info(file).map(|m| m.dflash.is_some()).unwrap_or(false);
        let mut cmd = dflash2_cli();
        cmd.args(["generate", "-n", "2", "-t", "1", "-p", "hello", "-m"]);
        if is_drafter {
            cmd.arg(&target).arg("-d").arg(file).args(["--block", "4"]);
        } else {
            cmd.arg(file);
        }
        cli_survives(cmd, &format!("accepted mutant {i} ({})", file.display()));
    }
}

fn read_prefix(path: &Path, n: usize) -> Vec<u8> {
    let mut f = std::fs::File::open(path).unwrap();
    let mut b = Vec::new();
    Read::by_ref(&mut f).take(n as u64).read_to_end(&mut b).unwrap();
    b
}

fn tail(s: &str) -> &str {
    &s[s.len().saturating_sub(2000)..]
}

fn run_bounded(mut cmd: Command, limit: Duration) -> std::process::Output {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{cmd:?} hung past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---- training inputs -----------------------------------------------------------------------

fn dflash2_cli() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dflash2"))
}

/// A `dflash2` command in a child process, bounded: it exits 0, or 1 with an `error:` line; never
/// a panic (exit 101), an abort (a signal) or a hang. Returns whether it succeeded.
fn cli_survives(cmd: Command, what: &str) -> bool {
    let out = run_bounded(cmd, Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let code = out.status.code();
    assert!(
        matches!(code, Some(0) | Some(1)) && !stderr.contains("panicked"),
        "{what}: {:?}\n{}",
        out.status,
        tail(&stderr)
    );
    if code == Some(1) {
        assert!(stderr.contains("error:"), "{what}: a failure without a message:\n{}", tail(&stderr));
    }
    code == Some(0)
}

#[test]
fn training_inputs_mutated_get_errors_and_converted_mutants_load() {
    let dir = common::scratch_dir("fuzz-training");
    let target = models().join("target.gguf");
    // a valid base: conversations, their dataset, a checkpoint trained one step on it
    let rows: Vec<Value> = (0..6)
        .map(|i| json!({"prompt": format!("question {i} about the fox"), "answer": "the quick brown fox jumps over the lazy dog ".repeat(3)}))
        .chain([json!({"text": "once upon a time there was a little model that drafted blocks"})])
        .collect();
    let lines = |rows: &[Value]| rows.iter().map(|r| r.to_string() + "\n").collect::<String>();
    let conv = dir.join("conversations.jsonl");
    std::fs::write(&conv, lines(&rows)).unwrap();
    let data = dir.join("base.safetensors");
    let dataset = |conv: &Path, out: &Path| {
        let mut cmd = dflash2_cli();
        cmd.args(["dataset", "-m"]).arg(&target).arg("--conversations").arg(conv).arg("--out").arg(out);
        cmd.args(["--layers", "1,2", "-t", "1"]);
        cmd
    };
    assert!(cli_survives(dataset(&conv, &data), "the base dataset"), "the base dataset failed");
    let ck = dir.join("ckpt");
    let out = Command::new(common::train_python())
        .arg(common::train_script("train.py"))
        .arg("--target").arg(&target).arg("--data").arg(&data).arg("--out").arg(&ck)
        .args(["--layers", "1", "--rank", "8", "--top-k", "4", "--draft-vocab", "64", "--steps", "1", "--threads", "1", "--eval-every", "100"])
        .output()
        .unwrap();
    assert!(out.status.success(), "train.py: {}", String::from_utf8_lossy(&out.stderr));
    let config: Value = serde_json::from_slice(&std::fs::read(ck.join("config.json")).unwrap()).unwrap();
    let weights = std::fs::read(ck.join("model.safetensors")).unwrap();
    let header = 8 + u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;

    let mut r = rng(0x7a11);
    let (n, mut refused) = (iters(40), [0usize; 2]);
    for i in 0..n {
        // conversations: rows with fields replaced or removed, or damaged bytes
        let file = dir.join(format!("conv-{}.jsonl", i % 4));
        if r.gen_bool(0.5) {
            let mutated: Vec<Value> = rows.iter().map(|row| if r.gen_bool(0.4) { mutate_row(row, &mut r) } else { row.clone() }).collect();
            std::fs::write(&file, lines(&mutated)).unwrap();
        } else {
            let bytes = lines(&rows).into_bytes();
            std::fs::write(&file, mutate(&bytes, bytes.len(), &mut r)).unwrap();
        }
        let ok = cli_survives(dataset(&file, &dir.join("mutant.safetensors")), &format!("dataset mutant {i}"));
        refused[0] += usize::from(!ok);

        // the checkpoint: config values replaced, or the safetensors header damaged
        let m = dir.join("ckpt-mutant");
        std::fs::create_dir_all(&m).unwrap();
        if r.gen_bool(0.5) {
            std::fs::write(m.join("config.json"), mutate_config(&config, &mut r).to_string()).unwrap();
            std::fs::write(m.join("model.safetensors"), &weights).unwrap();
        } else {
            std::fs::write(m.join("config.json"), config.to_string()).unwrap();
            std::fs::write(m.join("model.safetensors"), mutate(&weights, header, &mut r)).unwrap();
        }
        let gguf = dir.join("mutant.gguf");
        let _ = std::fs::remove_file(&gguf);
        let mut convert = dflash2_cli();
        convert.args(["convert", "--from"]).arg(&m).arg("--target").arg(&target).arg("--out").arg(&gguf);
        if cli_survives(convert, &format!("convert mutant {i}")) {
            // what convert accepts, llama.cpp loads and drafts with, or refuses with an error
            let mut run = dflash2_cli();
            run.args(["generate", "-n", "2", "-t", "1", "-p", "hello", "--block", "4", "-m"]).arg(&target).arg("-d").arg(&gguf);
            cli_survives(run, &format!("converted mutant {i}"));
        } else {
            refused[1] += 1;
            assert!(!gguf.exists(), "convert mutant {i}: a failed conversion left {}", gguf.display());
        }
    }
    eprintln!("{n} dataset mutants ({} refused), {n} checkpoint mutants ({} refused)", refused[0], refused[1]);
    assert!(refused[0] > 0 && refused[1] > 0, "the mutations should break something: {refused:?}");
}

/// A conversation row with a field replaced by a random value, removed, or a stray one added.
fn mutate_row(row: &Value, r: &mut ChaCha8Rng) -> Value {
    let mut v = row.clone();
    let obj = v.as_object_mut().expect("rows are objects");
    let field = ["prompt", "answer", "text", "messages", "source"][r.gen_range(0..5)];
    match r.gen_range(0..3) {
        0 => {
            obj.remove(field);
        }
        _ => {
            obj.insert(field.into(), random_value(r, 0));
        }
    }
    if r.gen_bool(0.1) {
        return random_value(r, 0); // not even an object
    }
    v
}

/// A drafter config with one to three of the values convert reads replaced by random ones.
fn mutate_config(config: &Value, r: &mut ChaCha8Rng) -> Value {
    const TOP: [&str; 11] = [
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "rope_theta", "vocab_size", "draft_vocab_size", "architectures",
    ];
    const DFLASH: [&str; 7] =
        ["target_layer_ids", "block_size", "mask_token_id", "selector_top_k", "selector_rank", "conv_kernel_size", "conv_group_size"];
    let mut v = config.clone();
    for _ in 0..r.gen_range(1..=3) {
        let value = random_value(r, 1);
        if r.gen_bool(0.5) {
            v[TOP[r.gen_range(0..TOP.len())]] = value;
        } else {
            v["dflash_config"][DFLASH[r.gen_range(0..DFLASH.len())]] = value;
        }
    }
    v
}

// ---- HTTP ---------------------------------------------------------------------------------

fn start_server() -> common::Server {
    let (target, drafter) = (models().join("target.gguf"), models().join("drafter-dflash2.gguf"));
    let (target, drafter) = (target.to_str().unwrap(), drafter.to_str().unwrap());
    common::Server::spawn("fuzz", &["-t", "1", "-np", "2", "-n", "8", "--read-timeout", "2", "-m", target, "-d", drafter])
}

/// One request on its own connection: (status, body).
fn http(addr: &str, method: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    c.write_all(head.as_bytes()).unwrap();
    let _ = c.write_all(body);
    let mut reply = Vec::new();
    c.read_to_end(&mut reply).unwrap();
    let text = String::from_utf8_lossy(&reply);
    let status = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("no status line: {text:?}"));
    let body_at = reply.windows(4).position(|w| w == b"\r\n\r\n").map_or(reply.len(), |i| i + 4);
    (status, reply[body_at..].to_vec())
}

/// A random JSON value: what a confused or hostile client puts where a field goes.
fn random_value(r: &mut ChaCha8Rng, depth: usize) -> Value {
    match r.gen_range(0..if depth > 3 { 9 } else { 11 }) {
        0 => Value::Null,
        1 => json!(r.gen_bool(0.5)),
        2 => json!(EDGES[r.gen_range(0..EDGES.len())]),
        3 => json!(-(r.gen_range(0..i64::MAX))),
        4 => json!([1e308, -1e-308, 0.5, 3.0][r.gen_range(0..4)]),
        5 => json!(""),
        6 => json!("\u{0}\u{fffd}\u{1F600}<|im_start|>"),
        7 => json!("x".repeat(r.gen_range(1..5000))),
        8 => json!(r.gen_range(-3..70)),
        9 => Value::Array((0..r.gen_range(0..6)).map(|_| random_value(r, depth + 1)).collect()),
        _ => {
            let mut m = serde_json::Map::new();
            for k in ["role", "content", "type", "text", "id", "name"] {
                if r.gen_bool(0.4) {
                    m.insert(k.into(), random_value(r, depth + 1));
                }
            }
            Value::Object(m)
        }
    }
}

/// A valid body with a few fields replaced, added or removed.
fn mutate_json(base: &Value, r: &mut ChaCha8Rng) -> Value {
    const FIELDS: [&str; 24] = [
        "prompt", "messages", "max_tokens", "n_predict", "temperature", "top_p", "top_k", "min_p", "stop", "stream",
        "n", "seed", "logit_bias", "logprobs", "top_logprobs", "n_probs", "grammar", "json_schema", "response_format",
        "input_prefix", "input_suffix", "tokens", "content", "samplers",
    ];
    let mut v = base.clone();
    let obj = v.as_object_mut().expect("bodies are objects");
    for _ in 0..r.gen_range(1..=3) {
        let field = FIELDS[r.gen_range(0..FIELDS.len())];
        match r.gen_range(0..4) {
            0 => {
                obj.remove(field);
            }
            1 if field == "messages" => {
                let msgs = (0..r.gen_range(0..4)).map(|_| random_value(r, 1)).collect();
                obj.insert(field.into(), Value::Array(msgs));
            }
            _ => {
                obj.insert(field.into(), random_value(r, 0));
            }
        }
    }
    v
}

#[test]
fn http_bodies_mutated_get_answers_or_openai_errors_and_the_server_keeps_serving() {
    let server = start_server();
    let tool = json!({ "type": "function", "function": { "name": "f", "parameters": { "type": "object", "properties": { "x": { "type": "integer" } } } } });
    let corpus: [(&str, Value); 9] = [
        ("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 4 })),
        ("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": "hi" },
            { "role": "assistant", "content": null, "tool_calls": [{ "id": "c", "type": "function", "function": { "name": "f", "arguments": "{\"x\": 1}" } }] },
            { "role": "tool", "tool_call_id": "c", "content": "2" }], "tools": [tool], "tool_choice": "required", "max_tokens": 8 })),
        ("/v1/responses", json!({ "input": [{ "role": "user", "content": [{ "type": "input_text", "text": "hi" }] },
            { "type": "function_call_output", "call_id": "c", "output": "2" }], "instructions": "Be brief.",
            "tools": [{ "type": "function", "name": "f", "parameters": { "type": "object" } }], "max_output_tokens": 4, "stream": true })),
        ("/v1/completions", json!({ "prompt": "Once upon", "max_tokens": 4 })),
        ("/completion", json!({ "prompt": "Once upon", "n_predict": 4 })),
        ("/infill", json!({ "input_prefix": "def f(", "input_suffix": "\n", "n_predict": 4 })),
        ("/tokenize", json!({ "content": "hello world" })),
        ("/detokenize", json!({ "tokens": [1, 2, 3] })),
        ("/apply-template", json!({ "messages": [{ "role": "user", "content": "hi" }] })),
    ];
    let mut r = rng(0x4854);
    let mut by_status = std::collections::BTreeMap::<u16, usize>::new();
    for i in 0..iters(400) {
        let (path, base) = &corpus[i % corpus.len()];
        let body = if r.gen_bool(0.8) {
            serde_json::to_vec(&mutate_json(base, &mut r)).unwrap()
        } else {
            // byte-level damage: truncation, stray bytes, invalid UTF-8
            let mut b = serde_json::to_vec(base).unwrap();
            let at = r.gen_range(0..b.len());
            match r.gen_range(0..3) {
                0 => b.truncate(at),
                1 => b[at] = r.gen(),
                _ => b.insert(at, 0xff),
            }
            b
        };
        let (status, reply) = http(server.addr(), "POST", path, &body);
        *by_status.entry(status).or_default() += 1;
        let shown = String::from_utf8_lossy(&body);
        assert!(
            matches!(status, 200 | 400 | 404 | 413 | 501 | 503),
            "{path} answered {status} to {shown}: {}",
            String::from_utf8_lossy(&reply)
        );
        if status != 200 {
            let v: Value = serde_json::from_slice(&reply)
                .unwrap_or_else(|e| panic!("{path} {status} is not JSON ({e}) for {shown}: {}", String::from_utf8_lossy(&reply)));
            assert!(v["error"]["message"].is_string(), "{path} {status}: {v} for {shown}");
        }
    }
    eprintln!("statuses: {by_status:?}");
    assert!(by_status.get(&200).copied().unwrap_or(0) > 0 && by_status.get(&400).copied().unwrap_or(0) > 0, "{by_status:?}");
    // Still serving, nothing left behind.
    let (status, _) = http(server.addr(), "POST", "/v1/completions", br#"{"prompt": "hi", "max_tokens": 2}"#);
    assert_eq!(status, 200);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, m) = http(server.addr(), "GET", "/metrics", b"");
        let m = String::from_utf8_lossy(&m).into_owned();
        let busy = |name: &str| m.lines().any(|l| l.starts_with(name) && !l.ends_with(" 0"));
        if !busy("dflash2_requests_in_flight ") && !busy("dflash2_requests_queued ") {
            break;
        }
        assert!(Instant::now() < deadline, "slots left busy: {m}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ---- the C ABI --------------------------------------------------------------------------------

mod c_abi {
    use super::*;
    use dflash2::capi::*;
    use std::ffi::{c_char, c_int, c_void, CString};
    use std::ptr::{null, null_mut};

    unsafe extern "C" fn stop_sometimes(_: *const c_char, len: usize, user: *mut c_void) -> c_int {
        let calls = &mut *(user as *mut usize);
        *calls += 1;
        c_int::from(len % 3 == 0 || *calls > 40)
    }

    /// Random sequences of engine and session calls with random (valid or NULL) pointers and
    /// random values, on the synthetic models: each call returns a status, never a panic.
    #[test]
    fn random_call_sequences_get_statuses_never_a_crash() {
        let target = CString::new(models().join("target.gguf").to_str().unwrap()).unwrap();
        let drafter = CString::new(models().join("drafter-dflash2.gguf").to_str().unwrap()).unwrap();
        let mut p = std::mem::MaybeUninit::<CEngineParams>::uninit();
        let mut engine = null_mut();
        unsafe {
            assert_eq!(dflash2_engine_params_init(p.as_mut_ptr()), Status::Ok);
            let mut p = p.assume_init();
            p.target_path = target.as_ptr();
            p.drafter_path = drafter.as_ptr();
            p.n_ctx = 256;
            p.n_threads = 1;
            p.block_size = 4;
            assert_eq!(dflash2_engine_new(&p, &mut engine), Status::Ok, "{}", super::last_error());
        }
        let mut r = rng(0xCAB1);
        let mut sessions: Vec<*mut SessionHandle> = Vec::new();
        let mut by_status = std::collections::BTreeMap::<i32, usize>::new();
        let mut buf_tokens = vec![0i32; 64];
        let mut buf_text = vec![0 as c_char; 256];
        for _ in 0..iters(1500) {
            let session = match sessions.len() {
                0 => null_mut(),
                n if r.gen_bool(0.95) => sessions[r.gen_range(0..n)],
                _ => null_mut(),
            };
            let tokens: Vec<i32> = (0..r.gen_range(0..40)).map(|_| if r.gen_bool(0.9) { r.gen_range(0..300) } else { r.gen() }).collect();
            let (mut n, mut finish) = (0usize, 0i32);
            let cap = [0usize, 1, 3, 64][r.gen_range(0..4)];
            let status = unsafe {
                match r.gen_range(0..11) {
                    0 if sessions.len() < 4 => {
                        let mut s = null_mut();
                        let st = dflash2_session_new(engine, &mut s);
                        if st == Status::Ok {
                            sessions.push(s);
                        }
                        st
                    }
                    1 if !sessions.is_empty() && r.gen_bool(0.3) => {
                        let s = sessions.swap_remove(r.gen_range(0..sessions.len()));
                        dflash2_session_free(s);
                        Status::Ok
                    }
                    2 | 3 => dflash2_session_feed(
                        session,
                        if r.gen_bool(0.9) { tokens.as_ptr() } else { null() },
                        tokens.len(),
                        [0u32, 1, 8, 40, 100_000][r.gen_range(0..5)],
                    ),
                    4 | 5 => dflash2_session_step(
                        session,
                        if cap > 0 && r.gen_bool(0.9) { buf_tokens.as_mut_ptr() } else { null_mut() },
                        cap,
                        &mut n,
                        &mut finish,
                    ),
                    6 => {
                        let mut calls = 0usize;
                        let cb = if r.gen_bool(0.9) { Some(stop_sometimes as _) } else { None };
                        dflash2_session_generate(session, cb, (&mut calls as *mut usize).cast())
                    }
                    7 => {
                        let mut st = std::mem::MaybeUninit::<CStats>::uninit();
                        dflash2_session_stats(session, st.as_mut_ptr())
                    }
                    8 => dflash2_session_reset(session),
                    9 => {
                        let bytes: Vec<u8> = (0..r.gen_range(0..50)).map(|_| r.gen()).collect();
                        dflash2_tokenize(
                            engine,
                            bytes.as_ptr().cast(),
                            bytes.len(),
                            r.gen(),
                            r.gen(),
                            buf_tokens.as_mut_ptr(),
                            cap,
                            &mut n,
                        )
                    }
                    _ => dflash2_detokenize(
                        engine,
                        if r.gen_bool(0.9) { tokens.as_ptr() } else { null() },
                        tokens.len(),
                        r.gen(),
                        buf_text.as_mut_ptr(),
                        cap * 4,
                        &mut n,
                    ),
                }
            };
            assert_ne!(status, Status::Panic, "a call panicked: {}", super::last_error());
            if status != Status::Ok {
                assert!(!super::last_error().is_empty(), "status {status:?} without a message");
            }
            *by_status.entry(status as i32).or_default() += 1;
        }
        eprintln!("C ABI statuses: {by_status:?}");
        assert!(by_status.len() >= 4, "the calls should meet several kinds of refusal: {by_status:?}");
        unsafe {
            for s in sessions {
                dflash2_session_free(s);
            }
            dflash2_engine_free(engine);
        }
    }
}

fn last_error() -> String {
    unsafe { std::ffi::CStr::from_ptr(dflash2::capi::dflash2_last_error()) }.to_string_lossy().into_owned()
}
