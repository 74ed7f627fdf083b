//! `dflash2 serve` as clients use it: the real binary on a loopback port with the synthetic
//! models, driven by the official `openai` Python package and by curl.
//!
//! Losslessness under load is checked against a second server started without a drafter
//! (plain decoding, what `--select none` does): every response of the speculative server,
//! streamed to 8 concurrent clients, must equal the same request run alone on the plain one.
mod common;

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const MODEL: &str = "target.gguf";

fn models() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = common::scratch_dir("server-synth");
        dflash2::gguf::synth::synth_all(&dir, 5).expect("synthetic models");
        dir
    })
}

fn model(name: &str) -> String {
    models().join(name).to_str().unwrap().to_string()
}

use common::Server;

impl Server {
    fn start(name: &str, extra: &[&str]) -> Server {
        Self::start_with(name, &model("target.gguf"), extra)
    }

    fn start_with(name: &str, target: &str, extra: &[&str]) -> Server {
        let server = Server::spawn(name, &[&["-m", target, "-t", "1"], extra].concat());
        server.wait_healthy();
        server
    }

    fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if self.get("/health").0 == 200 {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{} never became healthy", self.base);
    }

    fn get(&self, path: &str) -> (u16, String) {
        curl(&[&format!("{}{path}", self.base)])
    }

    fn post(&self, path: &str, body: &str) -> (u16, Value) {
        let (code, text) = curl(&["-X", "POST", "-d", body, &format!("{}{path}", self.base)]);
        (code, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}")))
    }

    fn post_ok(&self, path: &str, body: Value) -> Value {
        let (code, v) = self.post(path, &body.to_string());
        assert_eq!(code, 200, "{path} {body}: {v}");
        v
    }

    /// Server-sent events of a streamed POST: the `data:` payloads, in order.
    fn post_sse(&self, path: &str, body: Value) -> Vec<String> {
        let (code, text) = curl(&["-N", "-X", "POST", "-d", &body.to_string(), &format!("{}{path}", self.base)]);
        assert_eq!(code, 200, "{text}");
        text.split("\n\n")
            .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
            .map(str::to_string)
            .collect()
    }

    fn metric(&self, name: &str) -> f64 {
        let (code, text) = self.get("/metrics");
        assert_eq!(code, 200, "{text}");
        let prefix = format!("dflash2_{name} ");
        let line = text.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("no {name} in {text}"));
        line[prefix.len()..].parse().unwrap()
    }

    /// Wait (bounded) until the slots are idle and nothing waits: no request leaked a slot.
    fn wait_idle(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if self.metric("requests_in_flight") == 0.0 && self.metric("requests_queued") == 0.0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("slots still busy: {}", self.get("/metrics").1);
    }

    fn assert_healthy(&self, after: &str) {
        assert_eq!(self.get("/health"), (200, r#"{"status":"ok"}"#.to_string()), "after {after}");
    }
}

/// curl, bounded in time and never through a proxy; returns (status, body).
fn curl(args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-sS", "--noproxy", "*", "--max-time", "120", "-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("curl is installed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// Run a command to its end within `limit` (killed and failed past it); returns stdout.
fn run_bounded(cmd: &mut Command, limit: Duration, what: &str) -> String {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap_or_else(|e| panic!("{what}: {e}"));
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    assert!(status.success(), "{what} failed ({status}): {err}\n{out}");
    out
}

/// A virtualenv under target/ with the `openai` package; a test that needs it fails
/// (never skips) when it cannot be made.
fn python() -> &'static Path {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
        let py = venv.join("bin/python");
        let ready = Command::new(&py).args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success());
        if !ready {
            let minutes = Duration::from_secs(300);
            run_bounded(Command::new("python3").args(["-m", "venv", "--clear"]).arg(&venv), minutes, "python3 -m venv");
            run_bounded(
                Command::new(&py).args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "openai"]),
                minutes,
                "pip install openai",
            );
        }
        py
    })
}

/// One scenario of tests/server_openai.py; its JSON result.
fn openai_scenario(args: &[&str]) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/server_openai.py");
    let mut cmd = Command::new(python());
    cmd.arg(script).args(args);
    for var in ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"] {
        cmd.env_remove(var);
    }
    cmd.env("NO_PROXY", "127.0.0.1,localhost").env_remove("OPENAI_BASE_URL").env_remove("OPENAI_API_KEY");
    let out = run_bounded(&mut cmd, Duration::from_secs(600), &format!("server_openai.py {}", args[0]));
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("scenario output is not JSON ({e}): {out}"))
}

fn drafter() -> String {
    model("drafter-dflash2.gguf")
}

#[test]
fn the_openai_client_gets_chat_completions_and_streams() {
    let d = drafter();
    let server = Server::start("openai", &["-d", &d, "--parallel", "2", "--block", "4"]);
    let r = openai_scenario(&["basic", &server.base, MODEL]);

    assert_eq!(r["models"], json!([MODEL]));
    for (whole, streamed) in
        [("chat", "chat_stream"), ("completion", "completion_stream"), ("stopped", "stopped_stream")]
    {
        let (w, s) = (&r[whole], &r[streamed]);
        assert_eq!(w["text"], s["text"], "{whole}: streamed text differs");
        assert_eq!(w["finish"], s["finish"], "{whole}");
        assert_eq!(w["usage"], s["usage"], "{whole}: usage differs");
        let usage = &w["usage"];
        let total = usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap();
        assert_eq!(usage["total_tokens"].as_u64().unwrap(), total);
        assert!(s["chunks"].as_u64().unwrap() >= 2, "{streamed} came in one piece: {s}");
        let t = &w["timings"];
        for key in [
            "prompt_n",
            "prompt_ms",
            "predicted_n",
            "predicted_ms",
            "predicted_per_second",
            "draft_n",
            "draft_n_accepted",
        ] {
            assert!(t[key].is_number(), "{whole}: no timings.{key} in {t}");
        }
        assert_eq!(t["predicted_n"], usage["completion_tokens"]);
    }
    assert_eq!(r["chat"]["object"], "chat.completion");
    assert_eq!(r["chat"]["role"], "assistant");
    assert_eq!(r["completion"]["object"], "text_completion");
    assert_eq!(r["chat"]["usage"]["completion_tokens"], 24);
    assert_eq!(r["chat"]["finish"], "length");
    // Speculation ran: the fixed block drafts every cycle.
    assert!(r["completion"]["timings"]["draft_n"].as_u64().unwrap() > 0);
    // The stop string ends the text just before its first occurrence, streamed or not.
    let (full, stop) = (r["completion"]["text"].as_str().unwrap(), r["stop"].as_str().unwrap());
    assert!(!stop.is_empty());
    assert_eq!(r["stopped"]["text"].as_str().unwrap(), &full[..full.find(stop).unwrap()]);
    assert_eq!(r["stopped"]["finish"], "stop");
    // Any model name is served by the one model, and the answer names the served one.
    assert_eq!(r["other_model"], json!({ "model": MODEL, "tokens": 4 }));

    // Fractional sampling values (temperature 0.7, top_p 0.95, min_p 1e-3) are taken, not refused,
    // and they reach the sampler: one seed reproduces its text, other seeds change it.
    for route in ["chat", "completion"] {
        let texts: Vec<&str> = r["sampled"][route].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(texts[0], texts[1], "{route}: the same seed gave two texts");
        assert_eq!(r["sampled"][format!("{route}_stream")], texts[0], "{route}: streamed text differs");
        assert!(texts[1..].windows(2).any(|w| w[0] != w[1]), "{route}: four seeds gave one text at T = 0.7: {texts:?}");
        assert_ne!(texts[0], r[route]["text"], "{route}: the T = 0.7 text equals the greedy one");
    }
    assert_eq!(r["temperature_too_high"], json!({ "status": 400, "param": "temperature" }));
    // penalties and biases arrive; a JSON response format (not built) is refused by name
    let (greedy, biased) = (r["chat"]["text"].as_str().unwrap(), r["biased"].as_str().unwrap());
    assert_ne!(biased, greedy, "banning token {} changed nothing", r["banned_first"]);
    assert_ne!(r["penalised"], r["chat"]["text"], "the penalties changed nothing");
    assert_eq!(r["bad_format"], json!({ "status": 400, "param": "response_format" }));
    let structured: Value = serde_json::from_str(r["structured"]["text"].as_str().unwrap()).unwrap();
    assert!(structured == "yes" || structured == "no", "{}", r["structured"]);
    assert_eq!(r["structured"]["finish"], "stop");
    let logprobs = r["logprobs"].as_array().unwrap();
    assert_eq!(logprobs.len(), 24, "{logprobs:?}");
    assert!(logprobs.iter().all(|t| t[2] == 2), "{logprobs:?}");
    assert_eq!(r["logprobs_stream"], r["logprobs"]);
    server.wait_idle();
}

#[test]
fn concurrent_streams_are_lossless_and_leave_no_slot_busy() {
    let d = drafter();
    // Four slots, eight clients: half the requests wait in the queue at first.
    let spec = Server::start("load-spec", &["-d", &d, "--parallel", "4", "--queue", "16", "--block", "4"]);
    let plain = Server::start("load-plain", &["--parallel", "1", "--no-lookup"]);
    let requests: Vec<Value> = (0..40)
        .map(|i| {
            json!({
                "kind": if i % 2 == 0 { "completion" } else { "chat" },
                "prompt": common::PROMPTS[i % common::PROMPTS.len()],
                "max_tokens": 16 + (i * 7) % 48,
                "stop": if i % 5 == 4 { json!(["e "]) } else { Value::Null },
            })
        })
        .collect();
    let path = common::scratch_dir("server-load").join("requests.json");
    std::fs::write(&path, serde_json::to_string(&requests).unwrap()).unwrap();

    let r = openai_scenario(&["load", &spec.base, &plain.base, MODEL, path.to_str().unwrap(), "8"]);
    let (got, want) = (r["spec"].as_array().unwrap(), r["plain"].as_array().unwrap());
    assert_eq!(got.len(), 40);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.get("error").is_none() && w.get("error").is_none(), "request {i}: {g} / {w}");
        assert_eq!(g["text"], w["text"], "request {i} ({}) differs from plain decoding", requests[i]);
        assert_eq!(g["finish"], w["finish"], "request {i}");
        assert_eq!(g["usage"], w["usage"], "request {i}");
    }
    assert!(r["peak"]["in_flight"].as_f64().unwrap() >= 2.0, "no two requests ran at once: {}", r["peak"]);

    // Token for token too, through llama-server's endpoint.
    for prompt in &common::PROMPTS[..4] {
        let body = json!({ "prompt": prompt, "n_predict": 40, "return_tokens": true, "temperature": 0 });
        let (a, b) = (spec.post_ok("/completion", body.clone()), plain.post_ok("/completion", body));
        assert_eq!(a["tokens"], b["tokens"], "{prompt}");
        assert!(!a["tokens"].as_array().unwrap().is_empty());
    }

    // At T > 0 a seeded request sent while the other slots are busy gets the text it gets alone
    // from the plain server (verification by matching, the default), token for token; so does
    // each of `n` choices, each drawing from its own stream.
    let sampled = |i: usize| {
        json!({ "prompt": common::PROMPTS[i % 4], "n_predict": 32, "return_tokens": true,
                "temperature": 0.9, "top_p": 0.9, "repeat_penalty": 1.1, "seed": 100 + i / 2 })
    };
    let together: Vec<Value> = std::thread::scope(|s| {
        let spec = &spec;
        let asks: Vec<_> = (0..8).map(|i| s.spawn(move || spec.post_ok("/completion", sampled(i)))).collect();
        asks.into_iter().map(|a| a.join().unwrap()).collect()
    });
    let mut answers = std::collections::HashSet::new();
    for (i, got) in together.iter().enumerate() {
        let alone = plain.post_ok("/completion", sampled(i));
        assert_eq!(got["tokens"], alone["tokens"], "{}: under load it differs from plain decoding alone", sampled(i));
        answers.insert(alone["tokens"].to_string());
    }
    assert!(answers.len() > 4, "the seeds gave {} answers: nothing was sampled", answers.len());
    let choices = |server: &Server| {
        let body = json!({ "prompt": "Once upon a time", "max_tokens": 24, "n": 3, "temperature": 1.0, "seed": 5 });
        let v = server.post_ok("/v1/completions", body);
        let mut texts: Vec<(i64, String)> =
            v["choices"].as_array().unwrap().iter().map(|c| (c["index"].as_i64().unwrap(), c["text"].as_str().unwrap().into())).collect();
        texts.sort();
        texts
    };
    let (a, b) = (choices(&spec), choices(&plain));
    assert_eq!(a, b, "n = 3 at T = 1: the choices differ from plain decoding's");
    assert!(a[0].1 != a[1].1 || a[1].1 != a[2].1, "three choices gave one text: {a:?}");

    spec.wait_idle();
    assert_eq!(spec.metric("requests_failed_total"), 0.0);
    assert_eq!(spec.metric("requests_finished_total"), 55.0);
    assert!(spec.metric("draft_tokens_total") > 0.0, "the speculative server never drafted");
    assert!(spec.metric("tau") >= 1.0);
}

#[test]
fn llama_server_endpoints_answer_in_its_shapes() {
    let d = drafter();
    let server = Server::start("llama", &["-d", &d, "--block", "4"]);

    let whole =
        server.post_ok("/completion", json!({ "prompt": "Once upon a time", "n_predict": 24, "return_tokens": true }));
    assert_eq!(whole["stop"], true);
    assert_eq!(whole["stop_type"], "limit");
    assert_eq!(whole["tokens_predicted"], 24);
    assert_eq!(whole["tokens"].as_array().unwrap().len(), 24);
    for key in ["prompt_n", "prompt_ms", "predicted_n", "predicted_per_second", "draft_n", "draft_n_accepted"] {
        assert!(whole["timings"][key].is_number(), "no timings.{key}: {whole}");
    }
    assert!(whole["timings"]["draft_n"].as_u64().unwrap() > 0);

    // Streamed: the pieces add up to the same content; the last event ends it, no [DONE].
    let events =
        server.post_sse("/completion", json!({ "prompt": "Once upon a time", "n_predict": 24, "stream": true }));
    let parsed: Vec<Value> = events.iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let content: String = parsed.iter().map(|e| e["content"].as_str().unwrap()).collect();
    assert_eq!(content, whole["content"].as_str().unwrap());
    let last = parsed.last().unwrap();
    assert_eq!(last["stop"], true);
    assert!(last["timings"]["predicted_n"].is_number());
    assert!(parsed[..parsed.len() - 1].iter().all(|e| e["stop"] == false));
    // every piece carries its token ids (as llama-server's), and together they are the answer's
    let streamed: Vec<Value> = parsed[..parsed.len() - 1].iter().flat_map(|e| e["tokens"].as_array().unwrap().clone()).collect();
    assert!(parsed[..parsed.len() - 1].iter().all(|e| !e["tokens"].as_array().unwrap().is_empty()), "{parsed:?}");
    assert_eq!(Value::Array(streamed), whole["tokens"]);

    // A stop word: named in the answer, cut from the content.
    let text = whole["content"].as_str().unwrap();
    let stop = &text[8..11];
    let stopped =
        server.post_ok("/completion", json!({ "prompt": "Once upon a time", "n_predict": 24, "stop": [stop] }));
    assert_eq!(stopped["stop_type"], "word");
    assert_eq!(stopped["stopping_word"], stop);
    assert_eq!(stopped["content"].as_str().unwrap(), &text[..text.find(stop).unwrap()]);

    // Tokenize and detokenize round-trip; pieces name each token's text.
    let toks = server.post_ok("/tokenize", json!({ "content": "The quick brown fox", "add_special": true }));
    let ids = toks["tokens"].clone();
    assert!(ids.as_array().unwrap().iter().all(Value::is_i64));
    let back = server.post_ok("/detokenize", json!({ "tokens": ids }));
    assert!(back["content"].as_str().unwrap().ends_with("The quick brown fox"), "{back}");
    let pieces = server.post_ok("/tokenize", json!({ "content": "The quick", "with_pieces": true }));
    let joined: String = pieces["tokens"].as_array().unwrap().iter().map(|t| t["piece"].as_str().unwrap()).collect();
    assert_eq!(joined, "The quick");

    // llama-server's routes without the `/v1` prefix answer as the prefixed ones do.
    let (code, models) = server.get("/models");
    assert_eq!((code, serde_json::from_str::<Value>(&models).unwrap()["data"][0]["id"].clone()), (200, json!(MODEL)));
    assert_eq!(server.get("/v1/health"), (200, r#"{"status":"ok"}"#.to_string()));
    let body = json!({ "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0 });
    let d = server.post_ok("/v1/completions", body);
    assert!(d["system_fingerprint"].as_str().unwrap().starts_with("dflash2-"), "{d}");
    // `/completions` is llama-server's `/completion` (its own shape), as llama-server routes it
    let legacy = json!({ "prompt": "Once upon a time", "n_predict": 8, "temperature": 0 });
    let (c, e) = (server.post_ok("/completions", legacy.clone()), server.post_ok("/completion", legacy));
    assert_eq!((&c["content"], &c["tokens_predicted"]), (&e["content"], &e["tokens_predicted"]), "{c}");
    assert_eq!(c["content"], d["choices"][0]["text"], "the same text in both shapes");
    assert!(c.get("choices").is_none(), "{c}");
    let chat = json!({ "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 6 });
    let (a, b) = (server.post_ok("/chat/completions", chat.clone()), server.post_ok("/v1/chat/completions", chat));
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
    let n_unprefixed: f64 = [&a, &b, &d].iter().map(|r| r["usage"]["completion_tokens"].as_f64().unwrap()).sum::<f64>()
        + [&c, &e].iter().map(|r| r["tokens_predicted"].as_f64().unwrap()).sum::<f64>();

    // Token ids as the prompt give the same answer as the text they spell.
    let by_ids = server.post_ok("/completion", json!({ "prompt": ids, "n_predict": 8 }));
    let by_text = server.post_ok("/completion", json!({ "prompt": "The quick brown fox", "n_predict": 8 }));
    assert_eq!(by_ids["content"], by_text["content"]);

    // llama-server's sampling fields as its clients send them, fractional: one seed reproduces
    // its tokens, other seeds change them.
    let sampled = |seed: u64| {
        let body = json!({ "prompt": "Once upon a time", "n_predict": 16, "return_tokens": true, "seed": seed,
            "temperature": 0.8, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1 });
        server.post_ok("/completion", body)["tokens"].clone()
    };
    let runs: Vec<Value> = [5, 5, 6, 7].into_iter().map(sampled).collect();
    assert_eq!(runs[0], runs[1], "the same seed gave two answers");
    assert!(runs[1..].windows(2).any(|w| w[0] != w[1]), "three seeds gave one answer at T = 0.8: {runs:?}");

    let (code, props) = server.get("/props");
    assert_eq!(code, 200);
    let props: Value = serde_json::from_str(&props).unwrap();
    assert_eq!(props["total_slots"], 1);
    assert_eq!(props["default_generation_settings"]["n_ctx"], 4096);
    assert_eq!(props["default_generation_settings"]["speculative"]["block"], 4);
    assert!(props["chat_template"].as_str().unwrap().contains("<|im_start|>"));
    assert!(props["drafter_path"].as_str().unwrap().ends_with("drafter-dflash2.gguf"));

    let (code, metrics) = server.get("/metrics");
    assert_eq!(code, 200);
    for name in [
        "requests_finished_total",
        "tokens_predicted_total",
        "draft_tokens_total",
        "draft_tokens_accepted_total",
        "tau",
        "draft_acceptance_ratio",
        "predicted_tokens_seconds",
        "requests_queued",
        "requests_in_flight",
    ] {
        assert!(metrics.contains(&format!("# TYPE dflash2_{name} ")), "no {name} in {metrics}");
    }
    // llama-server's family, for dashboards built on it: each with its type and help
    for (name, kind) in [
        ("prompt_tokens_total", "counter"),
        ("prompt_tokens_cached_total", "counter"),
        ("tokens_predicted_total", "counter"),
        ("n_decode_total", "counter"),
        ("spec_decode_num_draft_tokens_total", "counter"),
        ("spec_decode_num_accepted_tokens_total", "counter"),
        ("predicted_tokens_seconds", "gauge"),
        ("requests_processing", "gauge"),
        ("n_busy_slots_per_decode", "gauge"),
    ] {
        assert!(metrics.contains(&format!("# TYPE llamacpp:{name} {kind}\n")), "no llamacpp:{name} in {metrics}");
        assert!(metrics.contains(&format!("# HELP llamacpp:{name} ")), "no help for llamacpp:{name}");
    }
    let value = |name: &str| -> f64 {
        let prefix = format!("llamacpp:{name} ");
        metrics.lines().find_map(|l| l.strip_prefix(&prefix)).unwrap().parse().unwrap()
    };
    assert_eq!(value("tokens_predicted_total"), server.metric("tokens_predicted_total"));
    assert_eq!(value("spec_decode_num_draft_tokens_total"), server.metric("draft_tokens_total"));
    assert!(value("n_decode_total") >= server.metric("cycles_total") && value("requests_processing") == 0.0);
    let (code, head) = curl(&["-D", "-", "-o", "/dev/null", &format!("{}/metrics", server.base)]);
    assert_eq!(code, 200);
    let started: u64 = head.lines().find_map(|l| l.strip_prefix("Process-Start-Time-Unix: ")).unwrap().trim().parse().unwrap();
    assert!(started > 1_700_000_000, "{head}");
    assert_eq!(server.metric("requests_finished_total"), 14.0);
    let n_stopped = stopped["tokens_predicted"].as_f64().unwrap();
    let n_sampled: f64 = runs.iter().map(|t| t.as_array().unwrap().len() as f64).sum();
    assert_eq!(server.metric("tokens_predicted_total"), 24.0 + 24.0 + n_stopped + 8.0 + 8.0 + n_sampled + n_unprefixed);
}

#[test]
fn curl_streams_openai_events_ending_with_done() {
    let server = Server::start("curl-sse", &[]);
    let body =
        json!({ "model": MODEL, "messages": [{ "role": "user", "content": "Hi" }], "max_tokens": 6, "stream": true });
    let events = server.post_sse("/v1/chat/completions", body);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    // as OpenAI and llama-server send it: the first delta's content is there, and null
    assert_eq!(chunks[0]["choices"][0]["delta"].get("content"), Some(&Value::Null), "{}", chunks[0]);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(last["timings"]["draft_n"].is_number());

    let events = server.post_sse("/v1/completions", json!({ "prompt": "Hi", "max_tokens": 6, "stream": true }));
    assert_eq!(events.last().unwrap(), "[DONE]");
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "text_completion");
}

/// Each bad request gets an OpenAI-style error with the right status, and the server goes on.
#[test]
fn bad_input_gets_openai_errors_and_the_server_keeps_serving() {
    let server = Server::start("bad-input", &["--ctx-size", "256", "--max-body", "65536", "--alias", "tiny,tiny-chat", "--tags", "chat,small"]);
    let user = |extra: Value| {
        let mut body = json!({ "model": MODEL, "messages": [{ "role": "user", "content": "hello" }] });
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body.to_string()
    };
    let long_prompt = "word ".repeat(600);
    // (what, route, body, status, error code, the field the error must name)
    type Case<'a> = (&'a str, &'a str, String, u16, &'a str, Option<&'a str>);
    let cases: Vec<Case> = vec![
        ("malformed JSON", "/v1/chat/completions", "{\"messages\": [".into(), 400, "invalid_request", None),
        ("not an object", "/v1/chat/completions", "[1, 2]".into(), 400, "invalid_request", None),
        ("trailing garbage", "/v1/completions", r#"{"prompt": "hi"} x"#.into(), 400, "invalid_request", None),
        (
            "messages of the wrong type",
            "/v1/chat/completions",
            r#"{"messages": "hello"}"#.into(),
            400,
            "invalid_request",
            Some("messages"),
        ),
        (
            "temperature of the wrong type",
            "/v1/chat/completions",
            user(json!({ "temperature": "hot" })),
            400,
            "invalid_request",
            Some("temperature"),
        ),
        (
            "top_p of the wrong type",
            "/completion",
            r#"{"prompt": "hi", "top_p": [0.5]}"#.into(),
            400,
            "invalid_request",
            Some("top_p"),
        ),
        ("no messages field", "/v1/chat/completions", r#"{"model": "target.gguf"}"#.into(), 400, "invalid_request", None),
        ("empty messages", "/v1/chat/completions", r#"{"messages": []}"#.into(), 400, "invalid_request", Some("messages")),
        ("max_tokens 0", "/v1/chat/completions", user(json!({ "max_tokens": 0 })), 400, "invalid_request", Some("max_tokens")),
        (
            "max_tokens negative",
            "/v1/completions",
            r#"{"prompt": "hi", "max_tokens": -5}"#.into(),
            400,
            "invalid_request",
            Some("max_tokens"),
        ),
        (
            "max_tokens over the context",
            "/v1/chat/completions",
            user(json!({ "max_tokens": 100000 })),
            400,
            "invalid_request",
            Some("max_tokens"),
        ),
        (
            "max_tokens fractional",
            "/v1/completions",
            r#"{"prompt": "hi", "max_tokens": 2.5}"#.into(),
            400,
            "invalid_request",
            Some("max_tokens"),
        ),
        ("n_predict 0", "/completion", r#"{"prompt": "hi", "n_predict": 0}"#.into(), 400, "invalid_request", Some("n_predict")),
        (
            "temperature out of range",
            "/v1/chat/completions",
            user(json!({ "temperature": 7.5 })),
            400,
            "invalid_request",
            Some("temperature"),
        ),
        (
            "top_p out of range",
            "/v1/completions",
            r#"{"prompt": "hi", "top_p": 1.5}"#.into(),
            400,
            "invalid_request",
            Some("top_p"),
        ),
        ("min_p negative", "/completion", r#"{"prompt": "hi", "min_p": -0.05}"#.into(), 400, "invalid_request", Some("min_p")),
        (
            "repeat_penalty out of range",
            "/v1/completions",
            r#"{"prompt": "hi", "repeat_penalty": 1e3}"#.into(),
            400,
            "invalid_request",
            Some("repeat_penalty"),
        ),
        ("too many choices", "/v1/chat/completions", user(json!({ "n": 17 })), 400, "invalid_request", Some("n")),
        (
            "image content",
            "/v1/chat/completions",
            user(json!({ "messages": [{ "role": "user", "content": [{ "type": "image_url" }] }] })),
            400,
            "invalid_request",
            Some("messages[0].content"),
        ),
        ("empty token prompt", "/v1/completions", r#"{"prompt": []}"#.into(), 400, "invalid_request", Some("prompt")),
        ("a prompt of no shape", "/v1/completions", r#"{"prompt": [[1, 2], 3]}"#.into(), 400, "invalid_request", Some("prompt")),
        ("a prompt object without text", "/completion", r#"{"prompt": {"text": "hi"}}"#.into(), 400, "invalid_request", Some("prompt")),
        (
            "token id outside the vocabulary",
            "/completion",
            r#"{"prompt": [1, 2, 999999]}"#.into(),
            400,
            "invalid_request",
            Some("prompt"),
        ),
        ("negative token id", "/detokenize", r#"{"tokens": [-3]}"#.into(), 400, "invalid_request", Some("tokens")),
        (
            "prompt over the context",
            "/v1/completions",
            json!({ "prompt": long_prompt }).to_string(),
            400,
            "context_length_exceeded",
            None,
        ),
        (
            "chat over the context",
            "/v1/chat/completions",
            user(json!({ "messages": [{ "role": "user", "content": long_prompt }] })),
            400,
            "context_length_exceeded",
            None,
        ),
        ("tokenize without content", "/tokenize", "{}".into(), 400, "invalid_request", None),
        (
            "look-up n-gram out of range",
            "/v1/chat/completions",
            user(json!({ "lookup": true, "lookup_ngram": 0 })),
            400,
            "invalid_request",
            Some("lookup_ngram"),
        ),
        ("look-up of the wrong type", "/completion", r#"{"prompt": "hi", "lookup": "yes"}"#.into(), 400, "invalid_request", Some("lookup")),
        ("unknown endpoint", "/v1/embeddingz", "{}".into(), 404, "not_found", None),
        ("embeddings are not offered", "/v1/embeddings", r#"{"input": "hi"}"#.into(), 501, "not_supported", None),
    ];
    for (what, path, body, status, code, param) in &cases {
        let (got, v) = server.post(path, body);
        assert_eq!(got, *status, "{what}: {v}");
        if *code == "context_length_exceeded" {
            assert_eq!(v["error"]["type"], "exceed_context_size_error", "{what}: {v}");
            assert!(v["error"]["n_prompt_tokens"].as_u64().unwrap() > v["error"]["n_ctx"].as_u64().unwrap(), "{v}");
        }
        assert_eq!(v["error"]["code"], *code, "{what}: {v}");
        assert_eq!(v["error"]["param"].as_str(), *param, "{what}: the error names the wrong field: {v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {v}");
        assert!(v["error"]["type"].is_string(), "{what}: {v}");
        server.assert_healthy(what);
    }

    // --alias names the model: one entry (llama-server's shape) lists every name in `aliases` and
    // `--tags` in `tags`; the first name is its id and what answers carry.
    let (_, models) = server.get("/v1/models");
    let data = serde_json::from_str::<Value>(&models).unwrap()["data"].clone();
    assert_eq!(data.as_array().map(Vec::len), Some(1), "{data}");
    assert_eq!((&data[0]["id"], &data[0]["aliases"], &data[0]["tags"]), (&json!("tiny"), &json!(["tiny", "tiny-chat"]), &json!(["chat", "small"])), "{data}");
    let ok = server.post_ok("/v1/chat/completions", json!({ "model": "tiny-chat", "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 2 }));
    assert_eq!(ok["model"], "tiny");

    // A body over --max-body: 413, read from a file as a client would upload it.
    let big = common::scratch_dir("server-bad-input").join("big.json");
    std::fs::write(&big, json!({ "prompt": "x".repeat(100_000) }).to_string()).unwrap();
    let url = format!("{}/v1/completions", server.base);
    let (code, text) = curl(&["-X", "POST", "--data-binary", &format!("@{}", big.display()), &url]);
    assert_eq!(code, 413, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["code"], "request_too_large");
    server.assert_healthy("a body over the limit");

    // A wrong method is refused the same way.
    let (code, text) = curl(&["-X", "GET", &url]);
    assert_eq!(code, 405, "{text}");
    assert!(text.contains("method_not_allowed"));
    server.assert_healthy("a wrong method");

    // None of it cost a slot, and the server still generates.
    assert_eq!(server.metric("requests_failed_total"), 0.0);
    let ok = server
        .post_ok("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 4 }));
    assert_eq!(ok["usage"]["completion_tokens"], 4);
    server.wait_idle();
}

/// Look-up drafting on a server without a drafter (`--lookup`, a fixed block so that every match
/// is verified): it drafts from the context (the prompt repeats itself), a request can turn it
/// off, and the answer is plain decoding's either way; under `--select none` only on request.
/// Speculation under load (#49), on SmolLM2 with the shipped drafter: a verify row costs what it
/// costs on this CPU, so as four slots fill, the batch's rows are shared (`draft::sharing`) and
/// the drafting rate, from the server's own counters, falls well below what the same requests
/// draft one at a time, and comes back once they are alone again; every answer, alone or under
/// load, equals plain decoding's.
#[test]
fn drafting_gives_way_as_the_slots_fill_and_every_answer_stays_plain_decodings() {
    let target = common::real_model(common::SMOLLM2);
    let (target, drafter) = (target.to_str().unwrap(), common::shipped_drafter());
    let spec = Server::start_with("sharing-spec", target, &["-d", drafter.to_str().unwrap(), "--parallel", "4"]);
    let plain = Server::start_with("sharing-plain", target, &["--select", "none", "--no-lookup"]);
    // Code-editing prompts: the look-up drafts much of their answers when a slot is alone.
    let prompts = common::prompt_set("edit-heldout.jsonl", 0..8);
    let body = |p: &String| json!({ "prompt": format!("<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n"), "n_predict": 64, "temperature": 0 });
    let rate = |answers: &mut Vec<String>, concurrent: bool| {
        let (drafted, generated) = (spec.metric("draft_tokens_total"), spec.metric("tokens_predicted_total"));
        *answers = if concurrent {
            std::thread::scope(|s| {
                let asks: Vec<_> = prompts.iter().map(|p| s.spawn(|| spec.post_ok("/completion", body(p)))).collect();
                asks.into_iter().map(|a| a.join().unwrap()["content"].as_str().unwrap().to_string()).collect()
            })
        } else {
            prompts.iter().map(|p| spec.post_ok("/completion", body(p))["content"].as_str().unwrap().to_string()).collect()
        };
        (spec.metric("draft_tokens_total") - drafted) / (spec.metric("tokens_predicted_total") - generated)
    };
    let (mut alone, mut together, mut again) = (Vec::new(), Vec::new(), Vec::new());
    let rate_alone = rate(&mut alone, false);
    let rate_together = rate(&mut together, true);
    let rate_again = rate(&mut again, false);
    eprintln!("drafted tokens per generated token: alone {rate_alone:.2}, four slots busy {rate_together:.2}, alone again {rate_again:.2}");
    for (i, p) in prompts.iter().enumerate() {
        let want = plain.post_ok("/completion", body(p))["content"].as_str().unwrap().to_string();
        assert_eq!(alone[i], want, "prompt {i} alone differs from plain decoding");
        assert_eq!(together[i], want, "prompt {i} under load differs from plain decoding");
        assert_eq!(again[i], want, "prompt {i} alone again differs from plain decoding");
    }
    assert!(rate_alone > 0.3, "alone the defaults drafted {rate_alone:.2} tokens per token: nothing to give way");
    assert!(
        rate_together < 0.6 * rate_alone,
        "with four slots busy the defaults drafted {rate_together:.2} tokens per token, alone {rate_alone:.2}"
    );
    assert!(rate_again > 0.6 * rate_alone, "alone again the defaults drafted {rate_again:.2} tokens per token, at first {rate_alone:.2}");
    spec.wait_idle();
}

#[test]
fn lookup_drafts_from_the_context_and_keeps_the_answer() {
    let server = Server::start("lookup", &["--lookup", "--block", "4"]);
    let repeat = "one two three four five one two three four five one two three four five one two";
    let plain = server.post_ok("/completion", json!({ "prompt": repeat, "n_predict": 40, "lookup": false }));
    let lookup = server.post_ok("/completion", json!({ "prompt": repeat, "n_predict": 40 }));
    assert_eq!(lookup["content"], plain["content"], "look-up changed the answer");
    assert_eq!(plain["timings"]["draft_n"], 0, "{plain}");
    assert!(lookup["timings"]["draft_n"].as_u64().unwrap() > 0, "the look-up drafted nothing: {lookup}");
    drop(server);

    // `--select none` decodes plainly although the look-up is on by default; a request may still ask
    // for it.
    let none = Server::start("lookup-select-none", &["--select", "none", "--block", "4"]);
    let by_default = none.post_ok("/completion", json!({ "prompt": repeat, "n_predict": 40 }));
    let asked = none.post_ok("/completion", json!({ "prompt": repeat, "n_predict": 40, "lookup": true }));
    assert_eq!(by_default["timings"]["draft_n"], 0, "--select none drafted: {by_default}");
    assert!(asked["timings"]["draft_n"].as_u64().unwrap() > 0, "a request's lookup was ignored: {asked}");
    assert_eq!((&by_default["content"], &asked["content"]), (&plain["content"], &plain["content"]));
}

/// Chat prompts are the Jinja template's rendering (`--chat-template-file` here; the GGUF's own by
/// default), `/apply-template` shows it, and a template that refuses the messages
/// (`raise_exception`) gets a 400 naming `messages` with the template's own words.
#[test]
fn chat_templates_render_as_jinja_and_refusals_name_the_messages() {
    let default = Server::start("template-default", &[]);
    let v = default.post_ok("/apply-template", json!({ "messages": [{ "role": "user", "content": "hi" }] }));
    assert_eq!(v["prompt"], "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    drop(default);

    let template = "{%- if messages[0]['role'] != 'system' %}{{ raise_exception('the first message must be the system message') }}{% endif %}\n\
{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.strip() }}<|im_end|>\n{% endfor %}\n\
{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let file = common::scratch_dir("server-template").join("system-first.jinja");
    std::fs::write(&file, template).unwrap();
    let server = Server::start("template-file", &["--chat-template-file", file.to_str().unwrap()]);
    let (_, props) = server.get("/props");
    assert_eq!(serde_json::from_str::<Value>(&props).unwrap()["chat_template"], template);

    let messages = json!([{ "role": "system", "content": " Be brief. " }, { "role": "user", "content": "hi" }]);
    let v = server.post_ok("/apply-template", json!({ "messages": messages }));
    let prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(v["prompt"], prompt);
    let tokens = server.post_ok("/tokenize", json!({ "content": prompt }));
    let chat = server.post_ok("/v1/chat/completions", json!({ "messages": messages, "max_tokens": 4 }));
    assert_eq!(chat["usage"]["prompt_tokens"], tokens["tokens"].as_array().unwrap().len(), "{chat}");

    for route in ["/v1/chat/completions", "/apply-template"] {
        let body = json!({ "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 4 });
        let (code, v) = server.post(route, &body.to_string());
        assert_eq!(code, 400, "{route}: {v}");
        assert_eq!(v["error"]["param"], "messages", "{route}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("the first message must be the system message"), "{route}: {message}");
    }
    // A conversation ending with an assistant message is continued (llama-server's prefill).
    let prefill = json!([{ "role": "system", "content": "Be brief." }, { "role": "user", "content": "hi" },
        { "role": "assistant", "content": "Hello, I" }]);
    let v = server.post_ok("/apply-template", json!({ "messages": prefill }));
    assert!(v["prompt"].as_str().unwrap().ends_with("<|im_start|>assistant\nHello, I"), "{v}");
    // vLLM's explicit name for it gives the same prompt; with `add_generation_prompt: true` it is
    // refused, as llama-server refuses the pair; without a final assistant message too
    let same = server.post_ok("/apply-template", json!({ "messages": prefill, "continue_final_message": true, "add_generation_prompt": false }));
    assert_eq!(same["prompt"], v["prompt"]);
    let (code, e) = server.post("/v1/chat/completions", &json!({ "messages": prefill, "continue_final_message": true, "add_generation_prompt": true }).to_string());
    assert_eq!((code, e["error"]["param"].as_str()), (400, Some("continue_final_message")), "{e}");
    let (code, e) = server.post("/apply-template", &json!({ "messages": messages, "continue_final_message": true }).to_string());
    assert_eq!((code, e["error"]["param"].as_str()), (400, Some("continue_final_message")), "{e}");
    // `add_generation_prompt: false` leaves the assistant's turn closed
    let closed = server.post_ok("/apply-template", json!({ "messages": messages, "add_generation_prompt": false }));
    assert_eq!(closed["prompt"], "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n");
    let mut two = prefill.as_array().unwrap().clone();
    two.push(json!({ "role": "assistant", "content": "again" }));
    let (code, v) = server.post("/v1/chat/completions", &json!({ "messages": two }).to_string());
    assert_eq!((code, v["error"]["param"].as_str()), (400, Some("messages")), "{v}");
    server.assert_healthy("after refused templates");
    drop(server);

    // An earlier answer's reasoning reaches a template that writes it (Qwen3's way): as chat's
    // `reasoning_content`, and from the Messages API's `thinking` blocks, as llama-server passes them.
    let template = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}";
    let file = common::scratch_dir("server-template").join("reasoning.jinja");
    std::fs::write(&file, template).unwrap();
    let server = Server::start("template-reasoning", &["--chat-template-file", file.to_str().unwrap()]);
    let chat = json!([{ "role": "user", "content": "hi" }, { "role": "assistant", "content": "Hello.", "reasoning_content": "Greet back." }, { "role": "user", "content": "bye" }]);
    let v = server.post_ok("/apply-template", json!({ "messages": chat }));
    assert!(v["prompt"].as_str().unwrap().contains("<|im_start|>assistant\n<think>Greet back.</think>Hello.<|im_end|>"), "{v}");
    let thinking = json!([{ "role": "user", "content": "hi" },
        { "role": "assistant", "content": [{ "type": "thinking", "thinking": "Greet back." }, { "type": "text", "text": "Hello." }] },
        { "role": "user", "content": "bye" }]);
    let without = json!([{ "role": "user", "content": "hi" }, { "role": "assistant", "content": "Hello." }, { "role": "user", "content": "bye" }]);
    let count = |m: &Value| server.post_ok("/v1/messages/count_tokens", json!({ "model": "m", "messages": m }))["input_tokens"].as_u64().unwrap();
    let chat_count = server.post_ok("/v1/chat/completions/input_tokens", json!({ "messages": chat }))["input_tokens"].as_u64().unwrap();
    assert_eq!(count(&thinking), chat_count, "thinking blocks and reasoning_content render alike");
    assert!(count(&thinking) > count(&without));
    // OpenAI text content parts are joined by a blank line, as llama-server joins them
    let parts = json!([{ "role": "user", "content": [{ "type": "text", "text": "Wh" }, { "type": "text", "text": "ill" }] }]);
    let v = server.post_ok("/apply-template", json!({ "messages": parts }));
    assert!(v["prompt"].as_str().unwrap().contains("<|im_start|>user\nWh\n\nill<|im_end|>"), "{v}");
}

/// llama-server's flags mean what they mean there: `-c` is the context of all slots together,
/// `-np` the slots, `-n` the limit of a request that sets none; and `/completion` carries its
/// end-of-answer fields.
#[test]
fn llama_server_flags_mean_what_they_mean_there() {
    let server = Server::start("llama-flags", &["-c", "1024", "-np", "2", "-n", "5"]);
    let (_, props) = server.get("/props");
    let props: Value = serde_json::from_str(&props).unwrap();
    assert_eq!(props["total_slots"], 2);
    assert_eq!(props["default_generation_settings"]["n_ctx"], 512, "{props}");
    assert_eq!(props["default_generation_settings"]["params"]["n_predict"], 5, "{props}");
    let v = server.post_ok("/completion", json!({ "prompt": "Once upon a time", "temperature": 0 }));
    assert!(v["tokens_predicted"].as_u64().unwrap() <= 5, "{v}");
    for field in ["has_new_line", "truncated"] {
        assert!(v[field].is_boolean(), "no {field}: {v}");
    }
    assert_eq!(v["timings"]["cache_n"], 0, "{v}");
    let again = server.post_ok("/completion", json!({ "prompt": "Once upon a time", "temperature": 0 }));
    assert_eq!(again["content"], v["content"]);
    let v = server.post_ok("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": "hi" }] }));
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() <= 5, "{v}");
    // -n also caps what a request asks for, as in llama-server.
    let v = server.post_ok("/v1/completions", json!({ "prompt": "Once upon a time", "max_tokens": 50, "temperature": 0 }));
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() <= 5, "{v}");
    drop(server);
    // A slot smaller than llama.cpp's smallest context is refused at start, not silently enlarged.
    let out = Command::new(env!("CARGO_BIN_EXE_dflash2"))
        .args(["serve", "-m", &model("target.gguf"), "-c", "512", "-np", "4", "--port", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("128 tokens per slot"), "{}", String::from_utf8_lossy(&out.stderr));

    // `--host a,b`: every address serves, each named on its own line
    let mut child = Command::new(env!("CARGO_BIN_EXE_dflash2"))
        .args(["serve", "-m", &model("target.gguf"), "--host", "127.0.0.1,127.0.0.2", "--port", "0", "-t", "1"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let addrs: Vec<String> = (0..2)
        .map(|_| {
            let mut line = String::new();
            out.read_line(&mut line).unwrap();
            line.trim().strip_prefix("dflash2 listening on ").unwrap_or_else(|| panic!("{line:?}")).to_string()
        })
        .collect();
    assert!(addrs[0].starts_with("http://127.0.0.1:") && addrs[1].starts_with("http://127.0.0.2:"), "{addrs:?}");
    for addr in &addrs {
        let deadline = Instant::now() + Duration::from_secs(30);
        while curl(&[&format!("{addr}/health")]).0 != 200 {
            assert!(Instant::now() < deadline, "{addr} never answered");
            std::thread::sleep(Duration::from_millis(50));
        }
        let (code, _) = curl(&["-X", "POST", "-d", r#"{"prompt": "hi", "n_predict": 2}"#, &format!("{addr}/completion")]);
        assert_eq!(code, 200, "{addr}");
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Penalties and logit biases arrive (they change the answer) and stay lossless with a drafter;
/// fields this server does not build pass at their neutral values (as llama.cpp's web UI sends
/// them) and are refused by name otherwise.
#[test]
fn prompts_over_max_prompt_tokens_are_refused_as_over_a_context_of_that_size() {
    let server = Server::start("prompt-cap", &["--max-prompt-tokens", "24"]);
    let long = "the quick brown fox jumps over the lazy dog ".repeat(8);
    for (path, body) in [
        ("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": long }], "max_tokens": 2 })),
        ("/completion", json!({ "prompt": long, "n_predict": 2 })),
        ("/v1/completions", json!({ "prompt": ["hi", long], "max_tokens": 2 })),
    ] {
        let (code, v) = server.post(path, &body.to_string());
        assert_eq!(code, 400, "{path}: {v}");
        assert_eq!((&v["error"]["type"], &v["error"]["code"]), (&json!("exceed_context_size_error"), &json!("context_length_exceeded")), "{v}");
        assert_eq!(v["error"]["n_ctx"], 24, "{path}: the cap stands for the context: {v}");
        assert!(v["error"]["n_prompt_tokens"].as_u64().unwrap() > 24, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("--max-prompt-tokens"), "{v}");
    }
    // under the cap: answered
    server.post_ok("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 2 }));
    server.post_ok("/completion", json!({ "prompt": "the quick brown fox", "n_predict": 2 }));
    server.wait_idle();
}

#[test]
fn sampling_fields_arrive_and_unbuilt_ones_are_refused_by_name() {
    let d = drafter();
    let spec = Server::start("fields-spec", &["-d", &d, "--block", "4"]);
    let plain = Server::start("fields-plain", &["--no-lookup"]);
    let ask = |server: &Server, extra: Value| {
        let mut body = json!({ "prompt": "Once upon a time", "n_predict": 24, "return_tokens": true });
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        server.post_ok("/completion", body)["tokens"].clone()
    };
    let free = ask(&plain, json!({}));
    // either verification at T > 0 arrives; matching gives plain decoding's tokens
    let hot = json!({ "temperature": 0.9, "seed": 3 });
    let reject = json!({ "temperature": 0.9, "seed": 3, "spec_sampling": "reject" });
    assert_eq!(ask(&spec, json!({ "temperature": 0.9, "seed": 3, "spec_sampling": "match" })), ask(&plain, hot.clone()));
    assert_eq!(ask(&spec, reject).as_array().map(Vec::len), ask(&plain, hot).as_array().map(Vec::len));
    let first = free[0].as_i64().unwrap();
    let text: String = plain.post_ok("/detokenize", json!({ "tokens": [first] }))["content"].as_str().unwrap().into();
    let cases = [
        json!({ "logit_bias": { first.to_string(): -100 } }),         // OpenAI's shape
        json!({ "logit_bias": [[first, false]] }),                    // llama-server's, banned
        json!({ "logit_bias": [[text, false]] }),                     // by its text
        json!({ "frequency_penalty": 1.5, "presence_penalty": 0.5 }),
        json!({ "presence_penalty": -1.25, "repeat_penalty": 1.1, "repeat_last_n": 16 }),
    ];
    for extra in cases {
        let (a, b) = (ask(&plain, extra.clone()), ask(&spec, extra.clone()));
        assert_eq!(a, b, "speculative decoding changed the answer with {extra}");
        assert_ne!(a, free, "{extra} changed nothing");
        if extra.get("logit_bias").is_some() {
            assert_ne!(a[0].as_i64(), Some(first), "{extra}: the banned token came first");
        }
    }
    let webui = json!({ "typical_p": 1.0, "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "top_n_sigma": -1.0,
        "dynatemp_range": 0.0, "n_probs": 0, "cache_prompt": true, "samplers": "edkypmxt", "id_slot": -1 });
    assert_eq!(ask(&spec, webui), free, "neutral values changed the answer");
    for (body, field) in [
        (r#"{"prompt": "hi", "typical_p": 0.5}"#, "typical_p"),
        (r#"{"prompt": "hi", "mirostat": 2}"#, "mirostat"),
        (r#"{"prompt": "hi", "samplers": ["temperature", "top_k"]}"#, "samplers"),
        (r#"{"prompt": "hi", "logit_bias": {"999999999": 1}}"#, "logit_bias"),
        (r#"{"prompt": "hi", "logit_bias": {"1": "a lot"}}"#, "logit_bias"),
        (r#"{"prompt": "hi", "frequency_penalty": 2.5}"#, "frequency_penalty"),
        (r#"{"prompt": "hi", "spec_sampling": "exact"}"#, "spec_sampling"),
    ] {
        let (code, v) = spec.post("/completion", body);
        assert_eq!(code, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], field, "{body}: {v}");
    }
    for (extra, field) in [
        (json!({ "response_format": { "type": "xml" } }), "response_format"),
        (json!({ "grammar": "root ::= (" }), "grammar"),
        (json!({ "grammar": "root ::= \"a\"", "json_schema": {} }), "grammar"),
        (json!({ "json_schema": {}, "response_format": { "type": "json_object" } }), "json_schema"),
        (json!({ "json_schema": { "type": "no such type" } }), "json_schema"),
    ] {
        let mut chat = json!({ "messages": [{ "role": "user", "content": "hi" }] });
        chat.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (code, v) = spec.post("/v1/chat/completions", &chat.to_string());
        assert_eq!((code, v["error"]["param"].as_str()), (400, Some(field)), "{chat}: {v}");
    }
    // a grammar arrives: the answer is what it allows, with a drafter as without
    let body = json!({ "prompt": "Once upon a time", "n_predict": 12, "grammar": "root ::= [a-c]+ \".\"" });
    let (a, b) = (plain.post_ok("/completion", body.clone()), spec.post_ok("/completion", body));
    assert_eq!(a["content"], b["content"]);
    assert!(a["content"].as_str().unwrap().chars().all(|c| "abc.".contains(c)), "{a}");
    spec.assert_healthy("after refused fields");
}

/// `/infill` builds llama-server's fill-in-the-middle prompt from the code model's own tokens
/// (repository pattern included), answers in `/completion`'s shape, and speculation (look-up
/// here) keeps the answer; a model without FIM tokens gets 501 saying why.
#[test]
fn infill_completes_code_between_prefix_and_suffix() {
    let qwen = common::real_model(common::QWEN_05B);
    let server = Server::start_with("infill", qwen.to_str().unwrap(), &["--lookup", "--block", "4"]);
    let body = json!({
        "input_prefix": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n    return ",
        "input_suffix": "\n\n\nprint(add(1, 2))\n",
        "input_extra": [{ "filename": "util.py", "text": "def add(a, b):\n    return a + b\n" }],
        "n_predict": 12, "temperature": 0, "return_tokens": true,
    });
    let mut plain_body = body.clone();
    plain_body["lookup"] = json!(false);
    let plain = server.post_ok("/infill", plain_body);
    let spec = server.post_ok("/infill", body.clone());
    assert_eq!(spec["tokens"], plain["tokens"], "look-up changed the infill");
    assert!(!spec["content"].as_str().unwrap().is_empty(), "{spec}");
    let expected = "<|repo_name|>myproject\n<|file_sep|>util.py\ndef add(a, b):\n    return a + b\n<|file_sep|>filename\n\
        <|fim_prefix|>def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n    return <|fim_suffix|>\n\n\nprint(add(1, 2))\n<|fim_middle|>";
    let tokens = server.post_ok("/tokenize", json!({ "content": expected, "parse_special": true }));
    assert_eq!(plain["tokens_evaluated"], tokens["tokens"].as_array().unwrap().len(), "{plain}");
    drop(server);

    let tiny = Server::start("infill-tiny", &[]);
    let (code, v) = tiny.post("/infill", r#"{"input_prefix": "a", "input_suffix": "b"}"#);
    assert_eq!(code, 501, "{v}");
    assert_eq!(v["error"]["type"], "not_supported_error");
    assert!(v["error"]["message"].as_str().unwrap().contains("fill-in-the-middle"), "{v}");
    let (code, v) = tiny.post("/infill", r#"{"input_prefix": "a", "input_extra": [{"filename": "x"}]}"#);
    assert_eq!((code, v["error"]["param"].as_str()), (400, Some("input_extra[0]")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("missing field `text`"), "{v}");
}

/// `/v1/responses` is the chat path in the Responses API's shapes: the official SDK reads it
/// whole, streamed (its events, and its own stream helper) and with message items, and the text
/// is the chat completion's of the same conversation.
#[test]
fn the_responses_api_answers_as_the_chat_path_does() {
    let d = drafter();
    let server = Server::start("responses", &["-d", &d, "--block", "4"]);
    let r = openai_scenario(&["responses", &server.base, MODEL]);
    let (whole, chat) = (&r["whole"], &r["chat"]);
    assert_eq!((whole["object"].as_str(), whole["text"].as_str()), (Some("response"), chat["text"].as_str()), "{r}");
    assert_eq!((&whole["output_tokens"], &whole["input_tokens"]), (&chat["completion_tokens"], &chat["prompt_tokens"]), "{r}");
    let cut = chat["finish"] == "length";
    assert_eq!((whole["status"].as_str(), whole["incomplete"].as_str()), if cut { (Some("incomplete"), Some("max_output_tokens")) } else { (Some("completed"), None) }, "{r}");
    for text in [&r["stream_text"], &r["helper"]["text"], &r["items_text"]] {
        assert_eq!(text, &whole["text"], "{r}");
    }
    assert_eq!(r["helper"]["status"], whole["status"]);
    let events: Vec<&str> = r["events"].as_array().unwrap().iter().map(|e| e.as_str().unwrap()).collect();
    assert_eq!(events[..4], ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"], "{events:?}");
    assert_eq!(events[events.len() - 4..], ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"], "{events:?}");
    assert!(events.iter().filter(|e| **e == "response.output_text.delta").count() >= 2, "{events:?}");
    assert_eq!(r["previous"], json!({ "status": 400, "param": "previous_response_id" }));
    let count = server.post_ok("/v1/responses/input_tokens", json!({ "input": "Tell me a story.", "instructions": "Be brief." }));
    assert_eq!((count["object"].as_str(), &count["input_tokens"]), (Some("response.input_tokens"), &whole["input_tokens"]), "{count}");
    for (body, param) in [
        (json!({ "input": [{ "type": "reasoning" }] }), "input[0].type"),
        (json!({ "input": "hi", "max_output_tokens": 0 }), "max_output_tokens"),
        (json!({ "input": "hi", "tools": [{ "type": "web_search" }] }), "tools[0].type"),
        (json!({ "input": "hi", "text": { "format": { "type": "json_object" } } }), "text.format"),
    ] {
        let (code, v) = server.post("/v1/responses", &body.to_string());
        assert_eq!((code, v["error"]["param"].as_str()), (400, Some(param)), "{body}: {v}");
    }
    server.wait_idle();
}

/// `/v1/messages` is the chat path in Anthropic's shapes: at T = 0 its text and token counts are
/// the chat completion's of the same conversation (drafter on), streamed as Anthropic's events
/// whose text deltas add up to it; `stop_sequences` stop it and are reported; `tool_choice` any
/// gets a `tool_use` block (input an object) whole and streamed; `count_tokens` counts the prompt;
/// wrong blocks and fields are 400s naming them.
#[test]
fn the_messages_api_answers_as_the_chat_path_does() {
    let d = drafter();
    let server = Server::start("messages", &["-d", &d, "--block", "4"]);
    let ask = json!({ "system": [{ "type": "text", "text": "Be brief." }], "max_tokens": 24, "temperature": 0,
        "messages": [{ "role": "user", "content": [{ "type": "text", "text": "Tell me " }, { "type": "text", "text": "a story." }] }] });
    let chat = server.post_ok("/v1/chat/completions", json!({ "max_tokens": 24, "temperature": 0,
        "messages": [{ "role": "system", "content": "Be brief." }, { "role": "user", "content": "Tell me a story." }] }));
    let whole = server.post_ok("/v1/messages", ask.clone());
    let text = whole["content"][0]["text"].as_str().unwrap_or_else(|| panic!("no text block: {whole}")).to_string();
    assert_eq!((whole["type"].as_str(), whole["role"].as_str(), whole["content"][0]["type"].as_str()), (Some("message"), Some("assistant"), Some("text")), "{whole}");
    assert_eq!(Some(text.as_str()), chat["choices"][0]["message"]["content"].as_str(), "{whole}\n{chat}");
    let u = &whole["usage"];
    assert_eq!(u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(), chat["usage"]["prompt_tokens"].as_u64().unwrap(), "{whole}");
    assert_eq!(u["output_tokens"], chat["usage"]["completion_tokens"], "{whole}");
    let reason = match chat["choices"][0]["finish_reason"].as_str() {
        Some("length") => "max_tokens",
        _ => "end_turn",
    };
    assert_eq!((whole["stop_reason"].as_str(), &whole["stop_sequence"]), (Some(reason), &Value::Null), "{whole}");
    assert!(whole.get("timings").is_none() && whole["id"].as_str().is_some_and(|id| id.starts_with("msg_")), "{whole}");

    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let events: Vec<Value> = server.post_sse("/v1/messages", streamed).iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds[..2], ["message_start", "content_block_start"], "{kinds:?}");
    assert_eq!(kinds[kinds.len() - 3..], ["content_block_stop", "message_delta", "message_stop"], "{kinds:?}");
    assert!(kinds[2..kinds.len() - 3].iter().all(|k| *k == "content_block_delta") && kinds.len() > 6, "{kinds:?}");
    let start = &events[0]["message"];
    assert_eq!((&start["content"], start["usage"]["input_tokens"].as_u64()), (&json!([]), chat["usage"]["prompt_tokens"].as_u64()), "{start}");
    let deltas: String = events.iter().filter(|e| e["type"] == "content_block_delta").map(|e| e["delta"]["text"].as_str().unwrap()).collect();
    assert_eq!(deltas, text);
    let end = &events[kinds.len() - 2];
    assert_eq!((end["delta"]["stop_reason"].as_str(), &end["usage"]["output_tokens"]), (Some(reason), &u["output_tokens"]), "{end}");

    // A stop sequence taken from the answer ends it there, and is named.
    let word: String = text.chars().skip(3).take(3).collect();
    let mut stopped = ask.clone();
    stopped["stop_sequences"] = json!([word]);
    let v = server.post_ok("/v1/messages", stopped);
    assert_eq!((v["stop_reason"].as_str(), v["stop_sequence"].as_str()), (Some("stop_sequence"), Some(word.as_str())), "{v}");
    let cut = v["content"].get(0).map_or("", |b| b["text"].as_str().unwrap());
    assert!(text.starts_with(cut) && cut.len() < text.len() && !cut.contains(&word), "{cut:?} of {text:?}");

    // A required tool (no parameters: the grammar holds the call to a few tokens and bounded
    // whitespace): a tool_use block.
    let tools = json!([{ "name": "ping", "description": "Check the network", "input_schema": { "type": "object", "properties": {}, "additionalProperties": false } }]);
    let call = json!({ "max_tokens": 256, "tools": tools, "tool_choice": { "type": "any" }, "messages": [{ "role": "user", "content": "Is the network up?" }] });
    let v = server.post_ok("/v1/messages", call.clone());
    let block = v["content"].as_array().unwrap().iter().find(|b| b["type"] == "tool_use").cloned().unwrap_or_else(|| panic!("no tool_use: {v}"));
    assert_eq!((block["name"].as_str(), block["input"].is_object(), v["stop_reason"].as_str()), (Some("ping"), true, Some("tool_use")), "{v}");
    let mut call_stream = call.clone();
    call_stream["stream"] = json!(true);
    let events: Vec<Value> = server.post_sse("/v1/messages", call_stream).iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let started = events.iter().find(|e| e["type"] == "content_block_start" && e["content_block"]["type"] == "tool_use").unwrap_or_else(|| panic!("{events:?}"));
    assert_eq!(started["content_block"]["name"], "ping");
    let json_delta = events.iter().find(|e| e["delta"]["type"] == "input_json_delta").unwrap_or_else(|| panic!("{events:?}"));
    assert_eq!(serde_json::from_str::<Value>(json_delta["delta"]["partial_json"].as_str().unwrap()).unwrap(), block["input"]);
    // ... and the conversation sent back with the call and its result.
    let back = json!({ "max_tokens": 4, "tools": tools, "messages": [call["messages"][0],
        { "role": "assistant", "content": [{ "type": "tool_use", "id": block["id"], "name": "ping", "input": {} }] },
        { "role": "user", "content": [{ "type": "tool_result", "tool_use_id": block["id"], "content": "up" }] }] });
    assert_eq!(server.post_ok("/v1/messages", back)["type"], "message");

    let count = server.post_ok("/v1/messages/count_tokens", ask.clone());
    assert_eq!((&count["input_tokens"], count.get("output_tokens")), (&chat["usage"]["prompt_tokens"], None), "{count}");
    for (body, param) in [
        (json!({ "messages": [] }), "messages"),
        (json!({ "messages": [{ "role": "user", "content": [{ "type": "image", "source": { "type": "url", "url": "x" } }] }] }), "messages[0].content[0]"),
        (json!({ "messages": [{ "role": "user", "content": "hi" }], "tools": [{ "type": "bash_20250124", "name": "bash" }] }), "tools[0].type"),
        (json!({ "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 0 }), "max_tokens"),
        (json!({ "messages": [{ "role": "user", "content": "hi" }], "tool_choice": { "type": "sometimes" } }), "tool_choice.type"),
    ] {
        let (code, v) = server.post("/v1/messages", &body.to_string());
        assert_eq!((code, v["error"]["param"].as_str()), (400, Some(param)), "{body}: {v}");
    }
    server.wait_idle();
}

/// The one call of a chat answer that called tools: (name, arguments parsed).
fn tool_call(answer: &Value) -> (String, Value) {
    let calls = answer["choices"][0]["message"]["tool_calls"].as_array().unwrap_or_else(|| panic!("no tool_calls: {answer}"));
    assert_eq!(calls.len(), 1, "{answer}");
    assert_eq!(calls[0]["type"], "function", "{answer}");
    assert!(calls[0]["id"].as_str().is_some_and(|id| !id.is_empty()), "{answer}");
    let f = &calls[0]["function"];
    (f["name"].as_str().unwrap().to_string(), serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap())
}

/// Tool calling on real models with their own templates: Qwen2.5-Coder's describes the tools and
/// asks for `<tool_call>` blocks (Hermes); SmolLM2's knows no tools, so they are described in a
/// system message and a grammar holds the answer to llama.cpp's generic JSON. Calls come back in
/// OpenAI's shape, whole and streamed (the official SDK reads both, and sends the conversation
/// back with a tool result); speculation (context look-up on Qwen, the shipped drafter on SmolLM2)
/// gives plain decoding's answer; malformed tools are refused by their field.
#[test]
fn tool_calls_come_back_in_openai_shape_on_real_models() {
    let weather = json!({ "type": "function", "function": { "name": "get_weather", "description": "Get the current weather of a city",
        "parameters": { "type": "object", "properties": { "city": { "type": "string" } }, "required": ["city"] } } });
    let add = json!({ "type": "function", "function": { "name": "add", "description": "Add two integers",
        "parameters": { "type": "object", "properties": { "a": { "type": "integer" }, "b": { "type": "integer" } }, "required": ["a", "b"] } } });
    let ask = json!([{ "role": "user", "content": "What is the weather in Paris?" }]);

    let qwen = common::real_model(common::QWEN_05B);
    let server = Server::start_with("tools-qwen", qwen.to_str().unwrap(), &["--lookup", "--block", "4"]);
    let prompt = server.post_ok("/apply-template", json!({ "messages": ask, "tools": [weather] }))["prompt"].as_str().unwrap().to_string();
    assert!(prompt.contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""), "{prompt}");
    assert!(prompt.contains("within <tool_call></tool_call> XML tags"), "{prompt}");
    let count = |body: Value| server.post_ok("/v1/chat/completions/input_tokens", body)["input_tokens"].as_u64().unwrap();
    assert!(count(json!({ "messages": ask, "tools": [weather] })) > count(json!({ "messages": ask })) + 50);

    // A named tool among two, held by a grammar: its call parses, with look-up drafting as without.
    let named = json!({ "messages": ask, "tools": [add, weather], "max_tokens": 48,
        "tool_choice": { "type": "function", "function": { "name": "get_weather" } } });
    let spec = server.post_ok("/v1/chat/completions", named.clone());
    let mut plain = named.clone();
    plain["lookup"] = json!(false);
    let plain = server.post_ok("/v1/chat/completions", plain);
    let (name, args) = tool_call(&spec);
    assert_eq!(name, "get_weather");
    assert!(args["city"].as_str().is_some_and(|c| c.contains("Paris")), "{args}");
    assert_eq!((spec["choices"][0]["finish_reason"].as_str(), spec["choices"][0]["message"]["content"].is_null()), (Some("tool_calls"), true), "{spec}");
    assert_eq!(tool_call(&plain), (name, args), "speculation changed the call");
    assert_eq!(spec["usage"], plain["usage"]);
    assert!(spec["timings"]["draft_n"].as_u64().unwrap() > 0 && plain["timings"]["draft_n"] == 0, "{spec}\n{plain}");

    // `auto`: free text until the answer writes `<tool_call>`, then a lazy grammar holds the
    // call (as llama-server sets it): the same answer with look-up drafting as without. (This
    // model answers in a JSON code block here: no call; the engine test covers the trigger.)
    let auto = json!({ "messages": ask, "tools": [add, weather], "max_tokens": 64 });
    let spec = server.post_ok("/v1/chat/completions", auto.clone());
    let mut plain = auto.clone();
    plain["lookup"] = json!(false);
    let plain = server.post_ok("/v1/chat/completions", plain);
    assert_eq!(spec["choices"][0]["message"], plain["choices"][0]["message"]);
    assert!(spec["timings"]["draft_n"].as_u64().unwrap() > 0, "{spec}");

    // The official SDK: whole, streamed (its own accumulation and by hand), and the conversation
    // continued with its assistant message and a tool result.
    let r = openai_scenario(&["tools", &server.base, "any-model"]);
    let whole = &r["whole"];
    assert_eq!((whole["finish"].as_str(), whole["content"].is_null()), (Some("tool_calls"), true), "{r}");
    let call = &whole["calls"][0];
    assert_eq!((call[0].as_str(), call[3].as_str()), (Some("get_weather"), Some("function")), "{r}");
    for streamed in ["sdk_stream", "stream"] {
        let s = &r[streamed];
        assert_eq!(s["finish"], "tool_calls", "{streamed}: {r}");
        assert!(s["content"].is_null() || s["content"] == "", "{streamed}: {r}");
        assert_eq!((&s["calls"][0][0], &s["calls"][0][1]), (&call[0], &call[1]), "{streamed}: {r}");
    }
    let answer = &r["answer"];
    assert!(answer["content"].as_str().is_some_and(|c| !c.trim().is_empty()) && answer["calls"] == json!([]), "{r}");
    assert_eq!(r["malformed"], json!({ "status": 400, "param": "tools[0].function.name" }));
    assert_eq!(r["responses"], json!([["function_call", call[0], call[1]]]), "{r}");

    for (body, param) in [
        (json!({ "messages": ask, "tool_choice": "required" }), "tool_choice"),
        (json!({ "messages": ask, "tools": [weather], "grammar": "root ::= \"a\"" }), "tools"),
        (json!({ "messages": ask, "tools": [{ "type": "code_interpreter" }] }), "tools[0].type"),
        (json!({ "messages": ask, "tools": [weather], "tool_choice": { "type": "function", "function": { "name": "add" } } }), "tool_choice"),
    ] {
        let (code, v) = server.post("/v1/chat/completions", &body.to_string());
        assert_eq!((code, v["error"]["param"].as_str()), (400, Some(param)), "{body}: {v}");
    }
    let bad_call = json!({ "messages": [ask[0], { "role": "assistant", "tool_calls": [{ "id": "c", "function": { "arguments": "{}" } }] }] });
    let (code, v) = server.post("/v1/chat/completions", &bad_call.to_string());
    assert_eq!(code, 400, "{v}");
    assert!(v["error"]["param"].as_str().unwrap().starts_with("messages[1].tool_calls[0].function"), "{v}");
    drop(server);

    // SmolLM2's template knows no tools: the generic format, with the shipped drafter and without.
    let smol = common::real_model(common::SMOLLM2);
    let drafter = common::shipped_drafter();
    let spec = Server::start_with("tools-smol-spec", smol.to_str().unwrap(), &["-d", drafter.to_str().unwrap(), "--block", "8"]);
    let plain = Server::start_with("tools-smol-plain", smol.to_str().unwrap(), &[]);
    let prompt = spec.post_ok("/apply-template", json!({ "messages": ask, "tools": [weather] }))["prompt"].as_str().unwrap().to_string();
    for part in ["You can call any of the following tools", "\"name\": \"get_weather\"", "Respond in JSON format"] {
        assert!(prompt.contains(part), "{part:?} not in {prompt}");
    }
    let auto = json!({ "messages": ask, "tools": [weather], "max_tokens": 64 });
    let (a, b) = (spec.post_ok("/v1/chat/completions", auto.clone()), plain.post_ok("/v1/chat/completions", auto.clone()));
    assert_eq!(a["choices"][0]["message"]["tool_calls"][0]["function"], b["choices"][0]["message"]["tool_calls"][0]["function"], "{a}\n{b}");
    assert_eq!(a["usage"], b["usage"]);
    assert!(a["timings"]["draft_n"].as_u64().unwrap() > 0, "{a}");
    let (name, args) = tool_call(&a);
    assert_eq!((name.as_str(), a["choices"][0]["finish_reason"].as_str()), ("get_weather", Some("tool_calls")), "{a}");
    assert!(args["city"].is_string(), "{args}");
    // streamed: content held back (the answer is JSON), the call whole before the end
    let mut stream = auto.clone();
    stream["stream"] = json!(true);
    let events: Vec<Value> = spec.post_sse("/v1/chat/completions", stream).iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
    let deltas: Vec<&Value> = events.iter().map(|e| &e["choices"][0]["delta"]).collect();
    assert!(deltas.iter().all(|d| d["content"].is_null()), "{events:?}");
    let calls: Vec<&Value> = deltas.iter().filter_map(|d| d["tool_calls"].as_array()).flatten().collect();
    assert_eq!(calls.len(), 1, "{events:?}");
    assert_eq!((&calls[0]["index"], &calls[0]["function"]), (&json!(0), &a["choices"][0]["message"]["tool_calls"][0]["function"]));
    assert_eq!(events.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
    // the conversation continued with the result: calls and results as the generic format's JSON
    let follow = json!([ask[0], { "role": "assistant", "content": null, "tool_calls": [{ "id": "call_1", "type": "function",
        "function": { "name": "get_weather", "arguments": "{\"city\": \"Paris\"}" } }] },
        { "role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny" }]);
    let prompt = spec.post_ok("/apply-template", json!({ "messages": follow, "tools": [weather] }))["prompt"].as_str().unwrap().to_string();
    assert!(prompt.contains("\"tool_call\": {\n    \"name\": \"get_weather\""), "{prompt}");
    assert!(prompt.contains("\"tool_response\": {\n    \"content\": \"18 C and sunny\""), "{prompt}");
    // `none`: the tools are not described, the answer is text
    let none = spec.post_ok("/v1/chat/completions", json!({ "messages": follow, "tools": [weather], "tool_choice": "none", "max_tokens": 16 }));
    assert!(none["choices"][0]["message"]["content"].is_string() && none["choices"][0]["message"].get("tool_calls").is_none(), "{none}");
}

/// Log-probabilities in each API's shape, streamed or not, equal plain decoding's with a
/// drafter on (they are read from the rows that chose each token).
#[test]
fn logprobs_equal_plain_decoding_in_every_shape() {
    let d = drafter();
    let spec = Server::start("logprobs-spec", &["-d", &d, "--block", "4"]);
    let plain = Server::start("logprobs-plain", &["--no-lookup"]);
    let both = |path: &str, body: Value| (plain.post_ok(path, body.clone()), spec.post_ok(path, body));

    let (a, b) = both("/completion", json!({ "prompt": "Once upon a time", "n_predict": 16, "n_probs": 3, "return_tokens": true }));
    assert_eq!(a["completion_probabilities"], b["completion_probabilities"]);
    assert!(b["timings"]["draft_n"].as_u64().unwrap() > 0, "nothing was drafted: {b}");
    let probs = a["completion_probabilities"].as_array().unwrap();
    assert_eq!(probs.len(), a["tokens"].as_array().unwrap().len());
    for (p, t) in probs.iter().zip(a["tokens"].as_array().unwrap()) {
        assert_eq!(&p["id"], t);
        assert_eq!(p["top_logprobs"].as_array().unwrap().len(), 3);
        assert_eq!(p["top_logprobs"][0]["id"], p["id"], "greedy takes the likeliest: {p}");
        assert!(p["logprob"].as_f64().unwrap() <= 0.0);
    }

    let chat = json!({ "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 12, "logprobs": true, "top_logprobs": 2 });
    let (a, b) = both("/v1/chat/completions", chat.clone());
    assert_eq!(a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]);
    let content = a["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len() as u64, a["usage"]["completion_tokens"].as_u64().unwrap());
    let joined: String = content.iter().map(|e| e["token"].as_str().unwrap()).collect();
    assert_eq!(joined, a["choices"][0]["message"]["content"].as_str().unwrap());
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let events = spec.post_sse("/v1/chat/completions", streamed);
    let pieces: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&pieces, content, "streamed log-probabilities differ");

    let (a, b) = both("/v1/completions", json!({ "prompt": "Once upon a time", "max_tokens": 12, "logprobs": 2 }));
    assert_eq!(a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]);
    let offsets = a["choices"][0]["logprobs"]["text_offset"].as_array().unwrap();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0].as_u64() <= w[1].as_u64()));

    for (path, body, field) in [
        ("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": "hi" }], "logprobs": true, "top_logprobs": 21 }), "top_logprobs"),
        ("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": "hi" }], "top_logprobs": 2 }), "top_logprobs"),
        ("/v1/completions", json!({ "prompt": "hi", "logprobs": 6 }), "logprobs"),
        ("/completion", json!({ "prompt": "hi", "n_probs": -1 }), "n_probs"),
    ] {
        let (code, v) = spec.post(path, &body.to_string());
        assert_eq!((code, v["error"]["param"].as_str()), (400, Some(field)), "{body}: {v}");
    }
}

/// `n` choices are decoded side by side in the slots: at T = 0 each is the one plain answer
/// (with a drafter on), at T > 0 each samples with its own seed and a rerun repeats them;
/// streamed, every chunk names its choice and the pieces add up to the whole answers.
#[test]
fn several_choices_come_from_the_slots() {
    let d = drafter();
    let spec = Server::start("choices", &["-d", &d, "--block", "4", "-np", "2"]);
    let plain = Server::start("choices-plain", &[]);
    let chat = |extra: Value| {
        let mut body = json!({ "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 10 });
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let one = plain.post_ok("/v1/chat/completions", chat(json!({ "temperature": 0 })));
    let three = spec.post_ok("/v1/chat/completions", chat(json!({ "temperature": 0, "n": 3 })));
    let texts = |v: &Value| -> Vec<Value> { v["choices"].as_array().unwrap().iter().map(|c| c["message"]["content"].clone()).collect() };
    assert_eq!(texts(&three), vec![one["choices"][0]["message"]["content"].clone(); 3]);
    assert_eq!(three["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1, 2]);
    let tokens = one["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(three["usage"]["completion_tokens"].as_u64().unwrap(), 3 * tokens);
    assert_eq!(three["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"]);

    // At T > 0 a seed reproduces its choices where the batching repeats (plain decoding here): with
    // a drafter, which choices share a drafter decode changes its drafts, and so the draws (each
    // choice still follows the target's law).
    let sampled = chat(json!({ "temperature": 0.9, "seed": 5, "n": 4 }));
    let a = texts(&plain.post_ok("/v1/chat/completions", sampled.clone()));
    assert_eq!(a, texts(&plain.post_ok("/v1/chat/completions", sampled.clone())), "a rerun changed the choices");
    assert!(a.windows(2).any(|w| w[0] != w[1]), "four sampled choices are one answer: {a:?}");
    let b = texts(&spec.post_ok("/v1/chat/completions", sampled.clone()));
    assert!(b.windows(2).any(|w| w[0] != w[1]), "four sampled choices are one answer: {b:?}");

    let mut streamed = sampled.clone();
    streamed["stream"] = json!(true);
    let events = plain.post_sse("/v1/chat/completions", streamed);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let mut pieces = vec![String::new(); 4];
    let mut finished = 0;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        let c = &v["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        pieces[i] += c["delta"]["content"].as_str().unwrap_or_default();
        finished += c["finish_reason"].is_string() as usize;
    }
    assert_eq!(finished, 4);
    assert_eq!(pieces.into_iter().map(Value::from).collect::<Vec<_>>(), a, "streamed choices differ");
    let text = spec.post_ok("/v1/completions", json!({ "prompt": "Once", "max_tokens": 6, "n": 2, "temperature": 0 }));
    assert_eq!(text["choices"][0]["text"], text["choices"][1]["text"]);
    spec.wait_idle();
}

#[test]
fn several_prompts_progress_and_timings_come_in_llama_servers_shapes() {
    let d = drafter();
    let spec = Server::start("prompts", &["-d", &d, "--block", "4", "-np", "2", "-b", "64"]);
    let plain = Server::start("prompts-plain", &[]);
    let one = |prompt: &str| {
        plain.post_ok("/completion", json!({ "prompt": prompt, "n_predict": 8, "temperature": 0 }))["content"].clone()
    };
    let (fox, sea) = (one("The quick brown fox"), one("The sea"));
    let ids = spec.post_ok("/tokenize", json!({ "content": "The quick brown fox", "add_special": true }))["tokens"].clone();

    // A list of prompts (ids, a text, a prompt object) is answered as a list, each as alone,
    // with its index and the request's settings.
    let prompts = json!([ids, "The sea", { "prompt_string": "The quick brown fox" }]);
    let all = spec.post_ok("/completion", json!({ "prompt": prompts, "n_predict": 8, "temperature": 0, "seed": 9 }));
    let all = all.as_array().unwrap_or_else(|| panic!("not a list: {all}"));
    assert_eq!(all.iter().map(|a| a["content"].clone()).collect::<Vec<_>>(), [fox.clone(), sea.clone(), fox.clone()]);
    assert_eq!(all.iter().map(|a| a["index"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1, 2]);
    for a in all {
        let g = &a["generation_settings"];
        assert_eq!((g["n_predict"].as_u64(), g["seed"].as_u64(), g["temperature"].as_f64()), (Some(8), Some(9), Some(0.0)), "{a}");
        assert_eq!(g["speculative.n_max"], 3, "{g}");
    }
    // response_fields: the paths asked for, each under its path, and nothing else
    let fields = json!(["content", "generation_settings/n_predict", "prompt", "no/such/field"]);
    let picked = spec.post_ok("/completion", json!({ "prompt": "The sea", "n_predict": 8, "temperature": 0, "response_fields": fields }));
    let keys: Vec<&String> = picked.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["content", "generation_settings/n_predict", "prompt"], "{picked}");
    assert_eq!((&picked["content"], &picked["generation_settings/n_predict"]), (&sea, &json!(8)));
    assert!(picked["prompt"].as_str().unwrap().ends_with("The sea"), "{picked}");
    // ignore_eos bans every end-of-generation token, shown as llama-server shows it
    let ignoring = spec.post_ok("/completion", json!({ "prompt": "The sea", "n_predict": 4, "ignore_eos": true }));
    let bias = ignoring["generation_settings"]["logit_bias"].as_array().unwrap().clone();
    assert!(!bias.is_empty() && bias.iter().all(|b| b["bias"].is_null() && b["token"].is_u64()), "{ignoring}");
    let plain_bias = spec.post_ok("/completion", json!({ "prompt": "The sea", "n_predict": 4, "ignore_eos": false }));
    assert_eq!(plain_bias["generation_settings"]["logit_bias"], json!([]));
    // ids with a text among them are one prompt (llama-server's mixed prompt)
    // (a text after the first piece gets no BOS)
    let bare = spec.post_ok("/tokenize", json!({ "content": "The quick brown fox" }))["tokens"].as_array().unwrap().len() as u64;
    let mixed = spec.post_ok("/completion", json!({ "prompt": [ids[0], "The quick brown fox"], "n_predict": 4 }));
    assert!(mixed["content"].is_string() && mixed["tokens_evaluated"].as_u64() == Some(1 + bare), "{mixed}");
    // OpenAI's completions: n choices per prompt, prompt by prompt
    let legacy = spec.post_ok("/v1/completions", json!({ "prompt": ["The quick brown fox", "The sea"], "n": 2, "max_tokens": 8, "temperature": 0 }));
    let texts: Vec<Value> = legacy["choices"].as_array().unwrap().iter().map(|c| c["text"].clone()).collect();
    assert_eq!(texts, [fox.clone(), fox.clone(), sea.clone(), sea.clone()], "{legacy}");
    let n_prompts = |p: &str| spec.post_ok("/tokenize", json!({ "content": p, "add_special": true }))["tokens"].as_array().unwrap().len();
    assert_eq!(legacy["usage"]["prompt_tokens"].as_u64(), Some((n_prompts("The quick brown fox") + n_prompts("The sea")) as u64), "{legacy}");
    // streamed: every piece names its prompt
    let events = spec.post_sse("/completion", json!({ "prompt": ["The quick brown fox", "The sea"], "n_predict": 8, "stream": true }));
    let mut streamed = [String::new(), String::new()];
    for e in &events {
        let v: Value = serde_json::from_str(e).unwrap();
        streamed[v["index"].as_u64().unwrap() as usize] += v["content"].as_str().unwrap();
    }
    assert_eq!([Value::from(streamed[0].clone()), Value::from(streamed[1].clone())], [fox, sea]);
    // too many generations name the field
    let (code, err) = spec.post("/v1/completions", &json!({ "prompt": vec!["a"; 9], "n": 2 }).to_string());
    assert_eq!((code, err["error"]["param"].as_str()), (400, Some("n")), "{err}");
    let (code, err) = spec.post("/completion", &json!({ "prompt": vec!["a"; 17] }).to_string());
    assert_eq!((code, err["error"]["param"].as_str()), (400, Some("prompt")), "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("at most 16"), "{err}");

    // return_progress: before the first decode (the cached prefix counted as processed), then
    // after each batch of 64 tokens, up to the whole prompt.
    let long = "This is a test. ".repeat(40);
    let chat = json!({ "messages": [{ "role": "user", "content": long }], "max_tokens": 4, "stream": true, "return_progress": true });
    let progress = |events: &[String]| -> Vec<Value> {
        events.iter().filter_map(|e| serde_json::from_str::<Value>(e).ok()).filter_map(|v| v.get("prompt_progress").cloned()).collect()
    };
    let first = progress(&spec.post_sse("/v1/chat/completions", chat.clone()));
    let total = first[0]["total"].as_u64().unwrap();
    assert!(total > 128, "{first:?}");
    let cached = first[0]["cache"].as_u64().unwrap();
    assert_eq!(first.len() as u64, 1 + (total - cached).div_ceil(64), "{first:?}");
    assert!(first.windows(2).all(|w| w[1]["processed"].as_u64() > w[0]["processed"].as_u64()), "{first:?}");
    assert_eq!(first.last().unwrap()["processed"].as_u64(), Some(total));
    assert_eq!(first[0]["cache"], first[0]["processed"]);
    // again in the same slot: the cached prefix is reused, one batch decodes the rest
    let mut again = chat.clone();
    again["id_slot"] = json!(0);
    let _ = spec.post_sse("/v1/chat/completions", again.clone());
    let second = progress(&spec.post_sse("/v1/chat/completions", again));
    assert!(second[0]["cache"].as_u64().unwrap() > 0 && second.len() == 2, "{second:?}");
    // with timings_per_token, each report carries the timings so far; none before a decode
    let mut timed = chat.clone();
    timed["timings_per_token"] = json!(true);
    timed["messages"][0]["content"] = json!(format!("{long} Once more."));
    let events: Vec<Value> = spec.post_sse("/v1/chat/completions", timed).iter().filter_map(|e| serde_json::from_str(e).ok()).collect();
    let reports: Vec<&Value> = events.iter().filter(|v| v.get("prompt_progress").is_some()).collect();
    assert_eq!((reports[0]["timings"]["prompt_ms"].as_f64(), reports[0]["timings"]["predicted_n"].as_u64()), (Some(0.0), Some(0)));
    let last = reports.last().unwrap();
    assert_eq!(last["timings"]["prompt_n"].as_u64().unwrap() + last["timings"]["cache_n"].as_u64().unwrap(), last["prompt_progress"]["total"].as_u64().unwrap());
    assert!(last["timings"]["prompt_ms"].as_f64().unwrap() > 0.0, "{last}");
    // without the flag, nothing of it
    let mut quiet = chat.clone();
    quiet["return_progress"] = json!(false);
    assert!(progress(&spec.post_sse("/v1/chat/completions", quiet)).is_empty());

    // `"verbose": true` (llama-server's debugging aid): the prompt as decoded
    let hi = json!([{ "role": "user", "content": "hi" }]);
    let rendered = spec.post_ok("/apply-template", json!({ "messages": hi }))["prompt"].as_str().unwrap().to_string();
    let v = spec.post_ok("/v1/chat/completions", json!({ "messages": hi, "max_tokens": 2, "verbose": true }));
    assert!(v["__verbose"]["prompt"].as_str().unwrap().ends_with(&rendered), "{v}");
    assert_eq!(v["__verbose"]["tokens_evaluated"], v["usage"]["prompt_tokens"]);
    assert!(spec.post_ok("/v1/chat/completions", json!({ "messages": hi, "max_tokens": 2 })).get("__verbose").is_none());

    // timings_per_token: every streamed piece carries the timings so far
    for (path, body) in [
        ("/completion", json!({ "prompt": "Once upon a time", "n_predict": 12, "stream": true, "timings_per_token": true })),
        ("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 12, "stream": true, "timings_per_token": true })),
    ] {
        let events = spec.post_sse(path, body);
        let parsed: Vec<Value> = events.iter().filter_map(|e| serde_json::from_str(e).ok()).collect();
        let counts: Vec<u64> = parsed.iter().filter_map(|v| v["timings"]["predicted_n"].as_u64()).collect();
        assert!(counts.len() >= 3 && counts.windows(2).all(|w| w[0] <= w[1]), "{path}: {counts:?}");
        assert!(parsed.iter().filter_map(|v| v["timings"]["draft_n"].as_u64()).any(|n| n > 0), "{path}");
    }
    // the usage chunk carries the timings too (llama-server's)
    let body = json!({ "messages": hi, "max_tokens": 4, "stream": true, "stream_options": { "include_usage": true } });
    let events = spec.post_sse("/v1/chat/completions", body);
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert!(usage["choices"] == json!([]) && usage["timings"]["predicted_n"] == usage["usage"]["completion_tokens"], "{usage}");
    spec.wait_idle();
}

#[test]
fn an_api_key_guards_everything_but_health() {
    let key = "sk-test-1234";
    let server = Server::start("api-key", &["--api-key", key]);
    server.assert_healthy("start");
    let url = |p: &str| format!("{}{p}", server.base);
    for path in ["/v1/models", "/props", "/metrics"] {
        let (code, text) = curl(&[&url(path)]);
        assert_eq!(code, 401, "{path}: {text}");
        assert!(text.contains("invalid_api_key"), "{text}");
        let (code, _) = curl(&["-H", "Authorization: Bearer nope", &url(path)]);
        assert_eq!(code, 401, "{path} with a wrong key");
        let (code, text) = curl(&["-H", &format!("Authorization: Bearer {key}"), &url(path)]);
        assert_eq!(code, 200, "{path} with the key: {text}");
        // llama-server's other header for the key
        let (code, text) = curl(&["-H", &format!("X-Api-Key: {key}"), &url(path)]);
        assert_eq!(code, 200, "{path} with X-Api-Key: {text}");
        let (code, _) = curl(&["-H", "X-Api-Key: nope", &url(path)]);
        assert_eq!(code, 401, "{path} with a wrong X-Api-Key");
    }
    let (code, _) = curl(&["-X", "POST", "-d", r#"{"prompt":"hi","max_tokens":2}"#, &url("/v1/completions")]);
    assert_eq!(code, 401);

    // A browser's CORS preflight carries no key: it is answered, and the origin mirrored.
    let origin = "http://localhost:5173";
    let (code, headers) = curl(&[
        "-X", "OPTIONS", "-D", "-", "-o", "/dev/null",
        "-H", &format!("Origin: {origin}"),
        "-H", "Access-Control-Request-Method: POST",
        "-H", "Access-Control-Request-Headers: authorization, content-type",
        &url("/v1/chat/completions"),
    ]);
    assert_eq!(code, 200, "{headers}");
    let headers = headers.to_ascii_lowercase();
    assert!(headers.contains(&format!("access-control-allow-origin: {origin}")), "{headers}");
    assert!(headers.contains("access-control-allow-headers: authorization, content-type"), "{headers}");
    let (code, headers) = curl(&["-D", "-", "-H", &format!("Origin: {origin}"), "-H", &format!("X-Api-Key: {key}"), &url("/v1/models")]);
    assert_eq!(code, 200);
    assert!(headers.to_ascii_lowercase().contains(&format!("access-control-allow-origin: {origin}")), "{headers}");
    let r = openai_scenario(&["auth", &server.base, MODEL, key]);
    assert_eq!(r["with_key"], "length");
    assert_eq!(r["wrong_key"], json!({ "status": 401, "code": "invalid_api_key" }));
    drop(server);

    // --cors-origins: only the listed origins (`localhost`: local pages on any port)
    let server = Server::start("cors-origins", &["--cors-origins", "localhost,https://app.example"]);
    let allowed = |origin: &str| {
        let (code, headers) = curl(&["-D", "-", "-o", "/dev/null", "-H", &format!("Origin: {origin}"), &format!("{}/v1/models", server.base)]);
        assert_eq!(code, 200);
        headers.to_ascii_lowercase().contains(&format!("access-control-allow-origin: {origin}"))
    };
    assert!(allowed("http://localhost:5173") && allowed("http://[::1]:3000") && allowed("https://app.example"));
    assert!(!allowed("http://evil.com") && !allowed("http://localhost.evil.com"));
}

/// One slot and one queue place: a third request is refused with 503 while two are held,
/// and clients that leave free the slot and the queue place at once.
#[test]
fn a_full_queue_answers_503_and_clients_that_leave_free_their_slot() {
    let server = Server::start("queue", &["--parallel", "1", "--queue", "1"]);
    let long = json!({ "prompt": "Once upon a time", "max_tokens": 4000, "stream": true }).to_string();
    let url = format!("{}/v1/completions", server.base);
    let hold = || {
        Command::new("curl")
            .args(["-sN", "--noproxy", "*", "--max-time", "60", "-X", "POST", "-d", &long, &url])
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    };
    let wait_for = |name: &str, value: f64| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while server.metric(name) != value {
            assert!(Instant::now() < deadline, "{name} never reached {value}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let mut running = hold();
    wait_for("requests_in_flight", 1.0);
    let mut waiting = hold();
    wait_for("requests_queued", 1.0);

    let (code, v) = server.post("/v1/completions", r#"{"prompt": "hi", "max_tokens": 2}"#);
    assert_eq!(code, 503, "{v}");
    assert_eq!(v["error"]["code"], "server_busy");
    assert_eq!(server.metric("requests_rejected_total"), 1.0);
    server.assert_healthy("a refused request");

    for c in [&mut waiting, &mut running] {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    server.wait_idle();
    assert_eq!(server.metric("requests_cancelled_total"), 1.0, "the running request was not cancelled");
    assert_eq!(server.metric("requests_finished_total"), 0.0);
    let ok = server.post_ok("/v1/completions", json!({ "prompt": "hi", "max_tokens": 2 }));
    assert_eq!(ok["usage"]["completion_tokens"], 2);
}

/// `GET /slots` shows each slot as llama-server does: the task it took, that request's settings
/// and how far it got (`next_token` a one-entry list; a slot that never took a request shows no
/// task at all); `?fail_on_no_slot=1` answers 503 while every slot is busy, and `--no-slots`
/// turns the route off (501). `/v1/chat/completions/input_tokens` counts a chat request's prompt.
#[test]
fn slots_show_each_request_and_input_tokens_count_the_prompt() {
    let d = drafter();
    let server = Server::start("slots", &["-d", &d, "--parallel", "2", "-c", "8192", "--block", "4"]);
    let slots = |query: &str| -> Vec<Value> {
        let (code, text) = server.get(&format!("/slots{query}"));
        assert_eq!(code, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    };
    let idle = slots("");
    assert_eq!(idle.len(), 2, "{idle:?}");
    for (i, s) in idle.iter().enumerate() {
        assert_eq!((s["id"].as_u64(), s["is_processing"].as_bool()), (Some(i as u64), Some(false)), "{s}");
        assert_eq!((s["n_ctx"].as_u64(), s["speculative"].as_bool()), (Some(4096), Some(true)), "{s}");
        for absent in ["id_task", "params", "next_token", "n_prompt_tokens"] {
            assert!(s.get(absent).is_none(), "{absent} before the first request: {s}");
        }
    }

    // A finished request leaves its settings and its prompt's count in its slot.
    let body = json!({ "prompt": "Once upon a time", "n_predict": 7, "temperature": 0.5, "seed": 11, "top_k": 5, "stop": ["zzz"] });
    let v = server.post_ok("/completion", body);
    let used: Vec<Value> = slots("").into_iter().filter(|s| s.get("id_task").is_some()).collect();
    assert_eq!(used.len(), 1, "{used:?}");
    let (s, p) = (&used[0], &used[0]["params"]);
    assert_eq!((s["id_task"].as_i64(), s["is_processing"].as_bool()), (Some(0), Some(false)), "{s}");
    assert_eq!(&s["n_prompt_tokens"], &v["tokens_evaluated"], "{s}");
    // an idle slot has no budget left over from its last request (llama-server's)
    assert_eq!((s["next_token"][0]["n_decoded"].as_u64(), s["next_token"][0]["n_remain"].as_i64()), (Some(0), Some(-1)), "{s}");
    assert_eq!(s["next_token"].as_array().map(Vec::len), Some(1), "{s}");
    assert!(p["samplers"].is_array(), "{p}");
    assert_eq!((p["n_predict"].as_i64(), p["temperature"].as_f64(), p["seed"].as_u64(), p["top_k"].as_i64()), (Some(7), Some(0.5), Some(11), Some(5)), "{p}");
    assert_eq!((&p["stop"], &p["speculative.n_max"]), (&json!(["zzz"]), &json!(3)), "{p}");

    // `id_slot` puts a request in that slot when it is free (the other one here), with the same
    // answer; a slot that does not exist is refused naming the field
    let other = 1 - s["id"].as_i64().unwrap();
    let body = json!({ "prompt": "Once upon a time", "n_predict": 7, "temperature": 0.5, "seed": 11, "top_k": 5, "id_slot": other });
    let w = server.post_ok("/completion", body);
    assert_eq!(w["content"], v["content"]);
    let there = &slots("")[other as usize];
    assert_eq!((there["id_task"].as_i64(), &there["n_prompt_tokens"]), (Some(1), &w["tokens_evaluated"]), "{there}");
    let (code, e) = server.post("/v1/chat/completions", &json!({ "messages": [{ "role": "user", "content": "hi" }], "id_slot": 2 }).to_string());
    assert_eq!((code, e["error"]["param"].as_str()), (400, Some("id_slot")), "{e}");

    // Two long requests take both slots: /slots shows them running.
    let long = json!({ "prompt": "Once upon a time", "max_tokens": 4000, "stream": true }).to_string();
    let url = format!("{}/v1/completions", server.base);
    let mut holds: Vec<_> = (0..2)
        .map(|_| {
            Command::new("curl")
                .args(["-sN", "--noproxy", "*", "--max-time", "60", "-X", "POST", "-d", &long, &url])
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !slots("").iter().all(|s| s["is_processing"] == true && s["next_token"][0]["n_decoded"].as_u64() > Some(0)) {
        assert!(Instant::now() < deadline, "the slots never both ran: {:?}", slots(""));
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, text) = server.get("/slots?fail_on_no_slot=1");
    assert_eq!(code, 503, "{text}");
    let running = slots("");
    let mut tasks: Vec<i64> = running.iter().map(|s| s["id_task"].as_i64().unwrap()).collect();
    tasks.sort();
    assert_eq!(tasks, [2, 3], "{running:?}");
    assert!(running.iter().all(|s| s["params"]["n_predict"] == 4000 && s["next_token"][0]["has_next_token"] == true), "{running:?}");
    for c in &mut holds {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    server.wait_idle();
    assert!(slots("?fail_on_no_slot=1").iter().all(|s| s["is_processing"] == false));

    // The prompt a chat request decodes, counted.
    let messages = json!([{ "role": "system", "content": "Be brief." }, { "role": "user", "content": "hi" }]);
    let count = server.post_ok("/v1/chat/completions/input_tokens", json!({ "messages": messages }));
    assert_eq!(count["object"], "response.input_tokens");
    let chat = server.post_ok("/v1/chat/completions", json!({ "messages": messages, "max_tokens": 2 }));
    assert_eq!(count["input_tokens"], chat["usage"]["prompt_tokens"], "{count}");
    // without `/v1` too, as llama-server routes it
    let bare = server.post_ok("/chat/completions/input_tokens", json!({ "messages": messages }));
    assert_eq!(bare["input_tokens"], count["input_tokens"], "{bare}");
    let (code, v) = server.post("/v1/chat/completions/input_tokens", r#"{"messages": []}"#);
    assert_eq!((code, v["error"]["param"].as_str()), (400, Some("messages")), "{v}");
    drop(server);

    let off = Server::start("no-slots", &["--no-slots"]);
    let (code, text) = off.get("/slots");
    assert_eq!(code, 501, "{text}");
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["error"]["type"], "not_supported_error");
}

/// A public server's limits: a client that stalls in its headers is cut off, one that stalls
/// in its body gets 408, connections beyond `--max-connections` wait until one is free (and
/// are then served), and stop strings are bounded, each refusal naming the field.
#[test]
fn stalled_clients_are_cut_off_and_extra_connections_wait_their_turn() {
    use std::io::Write;

    let server = Server::start("limits", &["--read-timeout", "1", "--max-connections", "3"]);
    let addr = server.base.trim_start_matches("http://").to_string();
    let connect = || {
        let c = TcpStream::connect(&addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        c
    };
    // Headers that never end: the server closes the connection after its read timeout.
    let mut c = connect();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n").unwrap();
    let t = Instant::now();
    let mut rest = Vec::new();
    let _ = c.read_to_end(&mut rest);
    assert!(t.elapsed() < Duration::from_secs(10), "a stalled header was held {:?}", t.elapsed());
    // A body that stops halfway: 408 with an OpenAI-style body.
    let mut c = connect();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\": ").unwrap();
    let mut reply = String::new();
    let _ = c.read_to_string(&mut reply);
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(reply.contains("\"code\":\"request_timeout\""), "{reply}");
    // Three silent connections hold every slot: a request waits until they are cut, then is served.
    let idle: Vec<TcpStream> = (0..3).map(|_| connect()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    let v = server.post_ok("/v1/completions", json!({ "prompt": "hi", "max_tokens": 2 }));
    assert_eq!(v["usage"]["completion_tokens"], 2, "{v}");
    assert!(t.elapsed() >= Duration::from_millis(500), "served at once past a full connection limit ({:?})", t.elapsed());
    drop(idle);
    // Stop strings: at most 16, each 1..=256 bytes.
    let many: Vec<String> = (0..17).map(|i| format!("s{i}")).collect();
    for stop in [json!(many), json!([""]), json!(["x".repeat(300)])] {
        let (code, v) = server.post("/v1/completions", &json!({ "prompt": "hi", "max_tokens": 2, "stop": stop }).to_string());
        assert_eq!((code, v["error"]["param"].as_str()), (400, Some("stop")), "{v}");
    }
    server.assert_healthy("the limits");
    server.wait_idle();
}

/// Resident memory of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// A soak: client threads for `DFLASH2_SOAK_SECS` (default 40) mixing streamed and plain chat and
/// completion requests at T=0 and T>0, clients that disconnect mid-stream, send half a request
/// and stall, or send garbage, and bursts past the slots and the queue. Afterwards: every finished
/// T=0 answer equals the same request alone on a plain server, no 5xx but 503 and every error an
/// OpenAI-style body, no slot or queue entry left, and memory within 64 MiB of after the warm-up.
#[test]
fn a_soak_of_mixed_and_misbehaving_clients_loses_nothing() {
    use rand::{Rng, SeedableRng};
    use std::io::Write;
    use std::sync::{Arc, Mutex};
    let secs: u64 = std::env::var("DFLASH2_SOAK_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(40);
    let d = drafter();
    let spec = Server::start("soak-spec", &["-d", &d, "-np", "2", "--queue", "4", "-c", "1024", "--read-timeout", "2"]);
    let plain = Server::start("soak-plain", &["-np", "1", "-c", "512"]);
    // warm-up: every kind of request once
    for body in [json!({ "prompt": "hi", "n_predict": 8 }), json!({ "prompt": "hi", "n_predict": 8, "temperature": 0.8 })] {
        spec.post_ok("/completion", body);
    }
    let rss_warm = rss_kib(spec.child.id());
    let addr = spec.base.trim_start_matches("http://").to_string();
    let finished: Arc<Mutex<Vec<(Value, Value)>>> = Arc::default();
    let tally: Arc<Mutex<std::collections::BTreeMap<String, usize>>> = Arc::default();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let threads: Vec<_> = (0..6u64)
        .map(|t| {
            let (base, addr, finished, tally) = (spec.base.clone(), addr.clone(), finished.clone(), tally.clone());
            std::thread::spawn(move || {
                let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(t);
                let count = |what: String| *tally.lock().unwrap().entry(what).or_default() += 1;
                while Instant::now() < deadline {
                    let prompt = common::PROMPTS[r.gen_range(0..common::PROMPTS.len())];
                    match r.gen_range(0..10) {
                        // T=0, checked against plain decoding afterwards
                        0..=3 => {
                            let long = r.gen_bool(0.2);
                            let prompt = if long { prompt.repeat(40) } else { prompt.to_string() };
                            let body = json!({ "prompt": prompt, "n_predict": r.gen_range(4..40), "temperature": 0, "return_tokens": true });
                            let (code, text) = curl(&["-X", "POST", "-d", &body.to_string(), &format!("{base}/completion")]);
                            count(format!("{code}"));
                            assert!(code == 200 || code == 503 || code == 400, "{code}: {text}");
                            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{code} not JSON ({e}): {text}"));
                            if code == 200 {
                                finished.lock().unwrap().push((body, v["tokens"].clone()));
                            } else {
                                assert!(v["error"]["message"].is_string(), "{v}");
                            }
                        }
                        // T>0 chat, streamed or not
                        4 | 5 => {
                            let stream = r.gen_bool(0.5);
                            let body = json!({ "messages": [{ "role": "user", "content": prompt }], "max_tokens": r.gen_range(4..32),
                                               "temperature": 0.8, "stream": stream });
                            let (code, text) = curl(&["-N", "-X", "POST", "-d", &body.to_string(), &format!("{base}/v1/chat/completions")]);
                            count(format!("{code}"));
                            assert!(code == 200 || code == 503, "{code}: {text}");
                            if code == 200 && stream {
                                assert!(text.trim_end().ends_with("data: [DONE]"), "a stream that did not end: {text}");
                            }
                        }
                        // a client that leaves mid-stream
                        6 => {
                            let body = json!({ "prompt": prompt, "max_tokens": 400, "stream": true });
                            let _ = Command::new("curl")
                                .args(["-sN", "--noproxy", "*", "--max-time", "0.3", "-X", "POST", "-d", &body.to_string()])
                                .arg(format!("{base}/v1/completions"))
                                .output();
                            count("left mid-stream".into());
                        }
                        // half a request, then silence (the server cuts it off)
                        7 => {
                            if let Ok(mut c) = TcpStream::connect(&addr) {
                                let _ = c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"prompt\":");
                                c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                                let mut reply = String::new();
                                let _ = c.read_to_string(&mut reply);
                                assert!(reply.is_empty() || reply.starts_with("HTTP/1.1 408"), "{reply}");
                            }
                            count("stalled".into());
                        }
                        // garbage
                        8 => {
                            if let Ok(mut c) = TcpStream::connect(&addr) {
                                let junk: Vec<u8> = (0..r.gen_range(1..2000)).map(|_| r.gen()).collect();
                                let _ = c.write_all(&junk);
                                let _ = c.shutdown(std::net::Shutdown::Write);
                                c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                                let mut reply = Vec::new();
                                let _ = c.read_to_end(&mut reply);
                                let text = String::from_utf8_lossy(&reply);
                                assert!(!text.starts_with("HTTP/1.1 5"), "garbage got a 5xx: {text}");
                            }
                            count("garbage".into());
                        }
                        // a burst past the slots and the queue
                        _ => {
                            let body = json!({ "prompt": prompt, "max_tokens": 24 }).to_string();
                            let url = format!("{base}/v1/completions");
                            let burst: Vec<_> = (0..8)
                                .map(|_| {
                                    Command::new("curl")
                                        .args(["-s", "--noproxy", "*", "--max-time", "120", "-w", "\n%{http_code}", "-X", "POST", "-d", &body, &url])
                                        .stdout(Stdio::piped())
                                        .spawn()
                                        .unwrap()
                                })
                                .collect();
                            for c in burst {
                                let out = String::from_utf8_lossy(&c.wait_with_output().unwrap().stdout).into_owned();
                                let (text, code) = out.rsplit_once('\n').unwrap();
                                assert!(code == "200" || code == "503", "{code}: {text}");
                                count(format!("burst {code}"));
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    spec.wait_idle();
    spec.assert_healthy("the soak");
    let rss_end = rss_kib(spec.child.id());
    let finished = finished.lock().unwrap();
    eprintln!("soak {secs} s: {:?}; T=0 finished {}; RSS {rss_warm} -> {rss_end} KiB", tally.lock().unwrap(), finished.len());
    assert!(finished.len() >= 5, "too few requests finished to judge");
    assert!(rss_end <= rss_warm + 64 * 1024, "RSS grew from {rss_warm} to {rss_end} KiB");
    assert_eq!(spec.metric("requests_failed_total"), 0.0);
    for (body, tokens) in finished.iter() {
        let alone = plain.post_ok("/completion", body.clone());
        assert_eq!(&alone["tokens"], tokens, "{body} differs from plain decoding");
    }
}

/// Both slots run into the end of their context at once: each answer ends with
/// `finish_reason: "length"` (OpenAI's word for a cut-off answer), both slots are free after,
/// and the next request is served.
#[test]
fn a_full_context_on_every_slot_ends_with_length_and_frees_the_slots() {
    let d = drafter();
    let server = Server::start("ctx-full", &["-d", &d, "-np", "2", "-c", "512", "--block", "4"]);
    let prompt: Vec<u32> = (0..200).map(|i| 10 + (i * 7) % 200).collect();
    let body = json!({ "prompt": prompt, "max_tokens": 250, "temperature": 0 }).to_string();
    let url = format!("{}/v1/completions", server.base);
    let clients: Vec<_> = (0..2)
        .map(|_| {
            Command::new("curl")
                .args(["-s", "--noproxy", "*", "--max-time", "120", "-X", "POST", "-d", &body, &url])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in clients {
        let out = c.wait_with_output().unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
        let n = v["usage"]["completion_tokens"].as_u64().unwrap();
        // the slot holds 256 cells; the last token is sampled from the last cell and never decoded
        assert!(n < 250 && v["usage"]["prompt_tokens"].as_u64().unwrap() + n <= 257, "{v}");
    }
    server.wait_idle();
    assert_eq!(server.metric("requests_failed_total"), 0.0);
    let ok = server.post_ok("/v1/completions", json!({ "prompt": "hi", "max_tokens": 2 }));
    assert_eq!(ok["usage"]["completion_tokens"], 2);
}
