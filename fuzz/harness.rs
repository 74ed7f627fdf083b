//! What each coverage-guided fuzz target does with one input, and the promise it checks: a
//! broken promise panics, which libFuzzer reports as a crash (an abort inside llama.cpp is one
//! too). Shared, as one file, by the targets in `fuzz_targets/` (`cargo fuzz run NAME`) and by
//! `tests/fuzz.rs`, which replays the committed corpora and crash inputs through the same code.
//!
//! Everything runs in-process on the synthetic models (`dflash2::gguf::synth`), written once per
//! process: fast enough for thousands of inputs a second where no model is loaded.
#![allow(dead_code)] // each fuzz target uses one entry point

use dflash2::gguf::{check_pair, ModelInfo};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The synthetic target and drafters, written once per process.
pub fn models() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = scratch("models");
        dflash2::gguf::synth::synth_all(&dir, 3).expect("writing the synthetic models");
        dir
    })
}

/// A directory of this process's own (fuzzers run several processes side by side).
fn scratch(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dflash2-fuzz-{}-{what}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("creating a scratch directory");
    dir
}

fn target() -> PathBuf {
    models().join("target.gguf")
}

fn target_info() -> &'static ModelInfo {
    static INFO: OnceLock<ModelInfo> = OnceLock::new();
    INFO.get_or_init(|| dflash2::gguf::read_model_info(&target()).expect("the synthetic target reads"))
}

// ---- GGUF ------------------------------------------------------------------------------------

/// A model file's size in the `gguf` target: the input is its header (metadata and tensor
/// infos), the rest zeros, so inputs stay small and the tensors the synthetic models declare
/// (under 1 MiB) still lie inside the file. Truncated files are `tests/fuzz.rs`'s mutations.
const GGUF_FILE_BYTES: usize = 1 << 20;

/// A model file made of the input and zeros up to [`GGUF_FILE_BYTES`]: the pre-scan refuses it
/// with a message that names the file, or reads it (and pairs a drafter with the target); what
/// it reads, llama.cpp then loads or refuses, never aborting.
pub fn gguf(data: &[u8]) {
    let mut bytes = data.to_vec();
    bytes.resize(bytes.len().max(GGUF_FILE_BYTES), 0);
    let name = Path::new("input.gguf");
    let info = match dflash2::gguf::read::parse_gguf(&bytes, name).and_then(|g| ModelInfo::from_gguf(&g)) {
        Ok(info) => info,
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.starts_with("input.gguf") && msg.len() > "input.gguf".len() + 2, "a refusal that names nothing: {msg:?}");
            return;
        }
    };
    if info.dflash.is_some() {
        if let Err(e) = check_pair(target_info(), &info) {
            assert!(!e.to_string().is_empty());
        }
    }
    // What passed the pre-scan goes to llama.cpp's loader, as `dflash2 generate` would send it.
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    let file = FILE.get_or_init(|| scratch("gguf").join("input.gguf"));
    std::fs::write(file, &bytes).expect("writing the input");
    let _ = dflash2::llama::Model::load(file, &dflash2::llama::ModelParams::default());
}

// ---- HTTP ------------------------------------------------------------------------------------

/// Every route the server answers, by method (the input's first byte picks one).
const ROUTES: [(&str, &str); 33] = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/chat/completions"),
    ("POST", "/v1/chat/completions/input_tokens"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/responses/input_tokens"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/completion"),
    ("POST", "/completions"),
    ("POST", "/infill"),
    ("POST", "/apply-template"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("GET", "/props"),
    ("GET", "/slots"),
    ("GET", "/slots?fail_on_no_slot=1"),
    ("GET", "/metrics"),
    ("GET", "/health"),
    ("POST", "/v1/embeddings"),
    ("POST", "/rerank"),
    ("GET", "/v1/chat/completions"),
    ("POST", "/v1/models"),
    ("POST", "/nowhere"),
    ("OPTIONS", "/v1/chat/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/completion"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
];

pub const API_KEY: &str = "fuzz-key";

struct Server {
    runtime: tokio::runtime::Runtime,
    router: axum::Router,
}

fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        let m = models();
        let argv = [
            "dflash2", "serve", "-t", "1", "--parallel", "2", "-n", "4", "-c", "1024", "--queue", "2", "--api-key", API_KEY,
            "--max-body", "65536", "-m",
        ];
        let mut argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
        argv.push(m.join("target.gguf").display().to_string());
        argv.push("-d".into());
        argv.push(m.join("drafter-dflash2.gguf").display().to_string());
        let cli = <dflash2::cli::Cli as clap::Parser>::try_parse_from(argv).expect("the serve flags parse");
        let dflash2::cli::Command::Serve(args) = cli.command else { unreachable!() };
        let (router, _) = dflash2::cli::serve::app(&args).expect("the server starts on the synthetic models");
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        Server { runtime, router }
    })
}

/// One request: byte 0 picks the route, byte 1 the headers (API key, content type, origin), the
/// rest is the body. The answer is a success, or an error with an OpenAI-style JSON body and a
/// 4xx status or 501/503: never another 5xx, never a panic, and it comes (the router is the
/// whole server but the socket loop).
pub fn http(data: &[u8]) {
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    let (Some(&route), Some(&flags)) = (data.first(), data.get(1)) else { return };
    let (method, path) = ROUTES[route as usize % ROUTES.len()];
    let body = data[2..].to_vec();
    let mut req = Request::builder().method(method).uri(path);
    if flags & 3 != 0 {
        req = req.header("authorization", format!("Bearer {API_KEY}"));
    }
    req = match (flags >> 2) & 3 {
        0 => req.header("content-type", "application/json"),
        1 => req.header("content-type", "text/plain; charset=utf-8"),
        2 => req.header("content-type", "application/x-www-form-urlencoded"),
        _ => req,
    };
    if flags & 16 != 0 {
        req = req.header("origin", "http://localhost:5173").header("access-control-request-method", "POST");
    }
    let s = server();
    let request = req.body(Body::from(body.clone())).expect("a request from valid parts");
    let (status, reply) = s.runtime.block_on(async {
        let answer = tokio::time::timeout(std::time::Duration::from_secs(60), async {
            let resp = s.router.clone().oneshot(request).await.expect("the router's error type is Infallible");
            let status = resp.status().as_u16();
            let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX).await;
            (status, bytes.map(|b| b.to_vec()).unwrap_or_default())
        })
        .await;
        answer.unwrap_or_else(|_| panic!("{method} {path} did not answer in 60 s: {}", String::from_utf8_lossy(&body)))
    });
    let shown = || format!("{method} {path} ({flags:#04x}) {} -> {status} {}", String::from_utf8_lossy(&body), String::from_utf8_lossy(&reply));
    assert!(status < 500 || matches!(status, 501 | 503), "a server error: {}", shown());
    if status >= 400 {
        let v: serde_json::Value = serde_json::from_slice(&reply).unwrap_or_else(|e| panic!("an error that is not JSON ({e}): {}", shown()));
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "an error without a message: {}", shown());
    }
}

// ---- training inputs -------------------------------------------------------------------------

/// A conversation JSONL file, as `dflash2 dataset` reads it: each line is refused with a reason
/// or tokenized and read off the target.
pub fn conversations(data: &[u8]) {
    use dflash2::dataset::{Conversation, Extractor, ExtractorParams};
    static EX: OnceLock<Mutex<Extractor>> = OnceLock::new();
    let ex = EX.get_or_init(|| {
        let target = std::sync::Arc::new(dflash2::llama::Model::load(&target(), &Default::default()).expect("the synthetic target loads"));
        let template = dflash2::template::TemplateChoice::Given("chatml".into());
        let params = ExtractorParams { mask_token: 0, layers: vec![1, 2], max_len: 256, n_threads: 1, soft_k: 4, template, flash_attn: false };
        Mutex::new(Extractor::new(target, params).expect("an extractor on the synthetic target"))
    });
    let mut ex = ex.lock().unwrap_or_else(|p| p.into_inner());
    let mut out = ex.dataset();
    for line in String::from_utf8_lossy(data).lines().filter(|l| !l.trim().is_empty()).take(8) {
        if let Ok(c) = serde_json::from_str::<Conversation>(line) {
            if let Err(e) = ex.add(&c, &mut out) {
                assert!(!e.to_string().is_empty());
            }
        }
    }
}

/// A drafter checkpoint as `dflash2 convert` reads it. The input is `config.json` (its length in
/// the first two bytes) and the JSON header of `model.safetensors`; the tensor data the header
/// declares is filled in with zeros (up to 64 MiB), so inputs stay small while every offset,
/// shape and dtype is the fuzzer's. A refusal leaves no output; what is converted, llama.cpp
/// loads or refuses, never aborting.
pub fn checkpoint(data: &[u8]) {
    if data.len() < 2 {
        return;
    }
    let n = (u16::from_le_bytes([data[0], data[1]]) as usize).min(data.len() - 2);
    let (config, header) = data[2..].split_at(n);
    let declared = serde_json::from_slice::<serde_json::Value>(header)
        .ok()
        .and_then(|h| h.as_object()?.values().filter_map(|t| t.get("data_offsets")?.get(1)?.as_u64()).max())
        .unwrap_or(0)
        .min(64 << 20);
    let mut weights = (header.len() as u64).to_le_bytes().to_vec();
    weights.extend_from_slice(header);
    weights.resize(weights.len() + declared as usize, 0);
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| scratch("checkpoint"));
    std::fs::write(dir.join("config.json"), config).expect("writing config.json");
    std::fs::write(dir.join("model.safetensors"), weights).expect("writing model.safetensors");
    let out = dir.join("out.gguf");
    let _ = std::fs::remove_file(&out);
    match dflash2::gguf::convert::convert(dir, &target(), &out, dflash2::gguf::convert::OutType::Q8_0) {
        Err(e) => {
            assert!(!e.to_string().is_empty());
            assert!(!out.exists(), "a refused checkpoint left {}", out.display());
        }
        Ok(_) => {
            let _ = dflash2::llama::Model::load(&out, &dflash2::llama::ModelParams::default());
        }
    }
}

/// The targets by name, for the replay of committed inputs.
pub const TARGETS: [(&str, fn(&[u8])); 4] = [("gguf", gguf), ("http", http), ("conversations", conversations), ("checkpoint", checkpoint)];
