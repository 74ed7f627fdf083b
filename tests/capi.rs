//! The C ABI (`ffi/dflash2.h`): the header compiles as C99 and C++11 and matches the library's
//! layouts, the C example builds against the shared and the static library and reproduces the
//! engine, and every call turns bad arguments into an error code and a message.
mod common;

use dflash2::capi::*;
use dflash2::engine::{Engine, EngineConfig, GenerateOptions, SelectMode};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::ptr::{null, null_mut};
use std::sync::OnceLock;

const N_CTX: u32 = 512;

fn synth_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = common::scratch_dir("capi-synth");
        dflash2::gguf::synth::synth_all(&dir, 5).unwrap();
        dir
    })
}

fn model(name: &str) -> PathBuf {
    synth_dir().join(name)
}

fn ffi_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("ffi")
}

fn tool(env: &str, default: &str) -> String {
    std::env::var(env).unwrap_or_else(|_| default.to_string())
}

fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

// ---- the header ------------------------------------------------------------------------------

#[test]
fn header_compiles_as_c99_and_cpp11_without_warnings() {
    let dir = common::scratch_dir("capi-header");
    let src = dir.join("include_only.c");
    std::fs::write(&src, "#include <dflash2.h>\nint main(void) { return dflash2_version() == 0; }\n").unwrap();
    let inc = format!("-I{}", ffi_dir().display());
    run_ok(
        Command::new(tool("CC", "cc"))
            .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", &inc, "-c"])
            .arg(&src)
            .arg("-o")
            .arg(dir.join("c.o")),
    );
    run_ok(
        Command::new(tool("CXX", "c++"))
            .args(["-std=c++11", "-Wall", "-Wextra", "-Werror", "-pedantic", &inc, "-x", "c++", "-c"])
            .arg(&src)
            .arg("-o")
            .arg(dir.join("cpp.o")),
    );
}

#[test]
fn header_layouts_and_constants_match_the_library() {
    use std::mem::{offset_of, size_of};
    let mut expected: Vec<(String, usize)> = Vec::new();
    let mut put = |name: &str, v: usize| expected.push((name.to_string(), v));
    put("sizeof(dflash2_sampling)", size_of::<CSampling>());
    put("offsetof(dflash2_sampling, top_p)", offset_of!(CSampling, top_p));
    put("offsetof(dflash2_sampling, repeat_last_n)", offset_of!(CSampling, repeat_last_n));
    put("offsetof(dflash2_sampling, seed)", offset_of!(CSampling, seed));
    put("sizeof(dflash2_engine_params)", size_of::<CEngineParams>());
    put("offsetof(dflash2_engine_params, drafter_path)", offset_of!(CEngineParams, drafter_path));
    put("offsetof(dflash2_engine_params, n_ctx)", offset_of!(CEngineParams, n_ctx));
    put("offsetof(dflash2_engine_params, n_gpu_layers)", offset_of!(CEngineParams, n_gpu_layers));
    put("offsetof(dflash2_engine_params, block_size)", offset_of!(CEngineParams, block_size));
    put("offsetof(dflash2_engine_params, select)", offset_of!(CEngineParams, select));
    put("offsetof(dflash2_engine_params, tree_budget)", offset_of!(CEngineParams, tree_budget));
    put("offsetof(dflash2_engine_params, sampling)", offset_of!(CEngineParams, sampling));
    put("offsetof(dflash2_engine_params, lookup_ngram)", offset_of!(CEngineParams, lookup_ngram));
    put("sizeof(dflash2_chat_message)", size_of::<CChatMessage>());
    put("offsetof(dflash2_chat_message, content)", offset_of!(CChatMessage, content));
    put("sizeof(dflash2_stats)", size_of::<CStats>());
    put("offsetof(dflash2_stats, n_accepted)", offset_of!(CStats, n_accepted));
    put("offsetof(dflash2_stats, tau)", offset_of!(CStats, tau));
    put("offsetof(dflash2_stats, total_ms)", offset_of!(CStats, total_ms));
    put("offsetof(dflash2_stats, finish)", offset_of!(CStats, finish));
    put("sizeof(dflash2_status)", size_of::<Status>());
    put("sizeof(dflash2_spec_params)", size_of::<CSpecParams>());
    put("offsetof(dflash2_spec_params, temperature)", offset_of!(CSpecParams, temperature));
    put("offsetof(dflash2_spec_params, seed)", offset_of!(CSpecParams, seed));
    put("offsetof(dflash2_spec_params, n_threads)", offset_of!(CSpecParams, n_threads));
    put("offsetof(dflash2_spec_params, capture)", offset_of!(CSpecParams, capture));
    put("sizeof(dflash2_spec_abi)", size_of::<CSpecAbi>());
    put("offsetof(dflash2_spec_abi, backend_init)", offset_of!(CSpecAbi, backend_init));
    put("sizeof(dflash2_spec_info)", size_of::<CSpecInfo>());
    put("offsetof(dflash2_spec_info, feature_width)", offset_of!(CSpecInfo, feature_width));
    put("offsetof(dflash2_spec_info, feature_layers)", offset_of!(CSpecInfo, feature_layers));
    put("sizeof(dflash2_spec_stats)", size_of::<CSpecStats>());
    put("offsetof(dflash2_spec_stats, tau)", offset_of!(CSpecStats, tau));
    put("offsetof(dflash2_spec_stats, draft_ms)", offset_of!(CSpecStats, draft_ms));
    for (c, v) in [
        ("DFLASH2_OK", Status::Ok),
        ("DFLASH2_ERR_NULL_ARG", Status::NullArg),
        ("DFLASH2_ERR_INVALID_ARG", Status::InvalidArg),
        ("DFLASH2_ERR_UTF8", Status::Utf8),
        ("DFLASH2_ERR_BUFFER_TOO_SMALL", Status::BufferTooSmall),
        ("DFLASH2_ERR_MODEL", Status::Model),
        ("DFLASH2_ERR_MISMATCH", Status::Mismatch),
        ("DFLASH2_ERR_STATE", Status::State),
        ("DFLASH2_ERR_BUSY", Status::Busy),
        ("DFLASH2_ERR_CONTEXT", Status::Context),
        ("DFLASH2_ERR_TEMPLATE", Status::Template),
        ("DFLASH2_ERR_LLAMA", Status::Llama),
        ("DFLASH2_ERR_PANIC", Status::Panic),
    ] {
        put(c, v as usize);
    }
    for (c, v) in [
        ("DFLASH2_SELECT_NONE", SELECT_NONE),
        ("DFLASH2_SELECT_GREEDY", SELECT_GREEDY),
        ("DFLASH2_SELECT_BEST_PATH", SELECT_BEST_PATH),
        ("DFLASH2_SELECT_TREE", SELECT_TREE),
        ("DFLASH2_FINISH_NONE", FINISH_NONE),
        ("DFLASH2_FINISH_EOG", FINISH_EOG),
        ("DFLASH2_FINISH_LENGTH", FINISH_LENGTH),
        ("DFLASH2_FINISH_STOP", FINISH_STOP),
        ("DFLASH2_FINISH_CONTEXT", FINISH_CONTEXT),
        ("DFLASH2_FINISH_CANCELLED", FINISH_CANCELLED),
        ("DFLASH2_FEATURES_FEED", FEATURES_FEED),
        ("DFLASH2_FEATURES_NATIVE", FEATURES_NATIVE),
        ("DFLASH2_FEATURES_CALLBACK", FEATURES_CALLBACK),
    ] {
        put(c, v as usize);
    }

    // A C program prints the same expressions as the C compiler sees them.
    let dir = common::scratch_dir("capi-layout");
    let mut src = String::from("#include <dflash2.h>\n#include <stdio.h>\nint main(void) {\n");
    for (name, _) in &expected {
        src += &format!("    printf(\"%s %lu\\n\", \"{name}\", (unsigned long)({name}));\n");
    }
    src += "    return 0;\n}\n";
    let c = dir.join("layout.c");
    std::fs::write(&c, src).unwrap();
    let exe = dir.join("layout");
    run_ok(
        Command::new(tool("CC", "cc"))
            .args(["-std=c99", "-Wall", "-Werror"])
            .arg(format!("-I{}", ffi_dir().display()))
            .arg(&c)
            .arg("-o")
            .arg(&exe),
    );
    let out = String::from_utf8(run_ok(&mut Command::new(&exe)).stdout).unwrap();
    let seen: Vec<(String, usize)> = out
        .lines()
        .map(|l| {
            let (name, v) = l.rsplit_once(' ').unwrap();
            (name.to_string(), v.parse().unwrap())
        })
        .collect();
    assert_eq!(seen, expected);
}

// ---- the C example ---------------------------------------------------------------------------

/// A pkg-config file from the template, pointing at `libdir` and the header in ffi/.
fn write_pc(dir: &Path, libdir: &Path) -> PathBuf {
    let template = std::fs::read_to_string(ffi_dir().join("dflash2.pc.in")).unwrap();
    let pc = template
        .replace("@LIBDIR@", libdir.to_str().unwrap())
        .replace("@INCLUDEDIR@", ffi_dir().to_str().unwrap())
        .replace("@VERSION@", env!("CARGO_PKG_VERSION"));
    let left = pc.lines().filter(|l| !l.starts_with('#')).find(|l| l.contains('@'));
    assert!(left.is_none(), "a placeholder of dflash2.pc.in is left: {left:?}");
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("dflash2.pc"), pc).unwrap();
    dir.to_path_buf()
}

fn pkg_config(pc_dir: &Path, args: &[&str]) -> Vec<String> {
    let out = run_ok(Command::new("pkg-config").env("PKG_CONFIG_PATH", pc_dir).args(args).arg("dflash2"));
    String::from_utf8(out.stdout).unwrap().split_whitespace().map(String::from).collect()
}

/// What the engine itself generates for stream.c's prompt (one chat turn, greedy).
fn engine_reply(prompt: &str, n_predict: usize) -> String {
    let mut cfg = EngineConfig::new(model("target.gguf"), Some(model("drafter-dflash2.gguf")));
    cfg.n_ctx = 2048;
    let mut engine = Engine::load(&cfg).unwrap();
    let tokens = common::chat_prompt(engine.model(), prompt);
    let block = engine.drafter().unwrap().trained_block();
    let opts = GenerateOptions { n_predict, draft: common::draft(SelectMode::Greedy, block), ..GenerateOptions::default() };
    engine.generate(&tokens, &opts, |_| true).unwrap().text
}

#[test]
fn stream_example_builds_shared_and_static_and_reproduces_the_engine() {
    let dir = common::scratch_dir("capi-stream");
    let libdir = common::lib_dir();
    let example = ffi_dir().join("examples/stream.c");
    let (prompt, n) = ("Tell me about the sea.", 20);
    let expected = engine_reply(prompt, n) + "\n";

    // Shared: what `pkg-config --cflags --libs` gives, plus an rpath to find it at run time.
    let pc_shared = write_pc(&dir.join("pc-shared"), &libdir);
    let shared_exe = dir.join("stream-shared");
    run_ok(
        Command::new(tool("CC", "cc"))
            .args(["-std=c99", "-Wall", "-Wextra", "-Werror"])
            .arg(&example)
            .args(pkg_config(&pc_shared, &["--cflags", "--libs"]))
            .arg(format!("-Wl,-rpath,{}", libdir.display()))
            .arg("-o")
            .arg(&shared_exe),
    );

    // Static: a libdir holding only libdflash2.a, linked with `pkg-config --static`.
    let static_lib = dir.join("static-lib");
    std::fs::create_dir_all(&static_lib).unwrap();
    let link = static_lib.join("libdflash2.a");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(libdir.join("libdflash2.a"), &link).unwrap();
    let pc_static = write_pc(&dir.join("pc-static"), &static_lib);
    let static_exe = dir.join("stream-static");
    run_ok(
        Command::new(tool("CC", "cc"))
            .args(["-std=c99", "-Wall", "-Wextra", "-Werror"])
            .arg(&example)
            .args(pkg_config(&pc_static, &["--static", "--cflags", "--libs"]))
            .arg("-o")
            .arg(&static_exe),
    );

    for exe in [&shared_exe, &static_exe] {
        let out = run_ok(
            Command::new(exe)
                .arg(model("target.gguf"))
                .arg(model("drafter-dflash2.gguf"))
                .arg(prompt)
                .arg(n.to_string()),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(String::from_utf8_lossy(&out.stdout), expected, "{} (stderr: {stderr})", exe.display());
        assert!(stderr.contains(&format!("dflash2 {}: ", env!("CARGO_PKG_VERSION"))), "{stderr}");
        for field in ["tokens/s", "tau ", "drafted", "accepted"] {
            assert!(stderr.contains(field), "no {field} in the statistics: {stderr}");
        }
    }

    // A bad model path comes back as the library's message, not a crash.
    let out = Command::new(&shared_exe).arg(model("target.gguf")).arg("/nonexistent/drafter.gguf").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent/drafter.gguf: no such file"), "{stderr}");
}

// ---- the calls, from Rust --------------------------------------------------------------------

fn last_error() -> String {
    let p = dflash2_last_error();
    assert!(!p.is_null());
    unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_string()
}

/// `status` and a last error that mentions `needle`.
#[track_caller]
fn expect_err(status: Status, want: Status, needle: &str) {
    let msg = last_error();
    assert_eq!(status, want, "message: {msg}");
    assert!(msg.contains(needle), "{want:?}: message {msg:?} does not mention {needle:?}");
}

#[track_caller]
fn ok(status: Status) {
    assert_eq!(status, Status::Ok, "{}", last_error());
    assert_eq!(last_error(), "");
}

fn cstring(p: &Path) -> CString {
    CString::new(p.to_str().unwrap()).unwrap()
}

fn params(target: &CString, drafter: Option<&CString>) -> CEngineParams {
    let mut p = std::mem::MaybeUninit::<CEngineParams>::uninit();
    ok(unsafe { dflash2_engine_params_init(p.as_mut_ptr()) });
    let mut p = unsafe { p.assume_init() };
    p.target_path = target.as_ptr();
    p.drafter_path = drafter.map_or(null(), |d| d.as_ptr());
    p.n_ctx = N_CTX;
    p
}

fn new_engine(p: &CEngineParams) -> Result<*mut EngineHandle, (Status, String)> {
    let mut e = null_mut();
    let status = unsafe { dflash2_engine_new(p, &mut e) };
    if status == Status::Ok {
        Ok(e)
    } else {
        assert!(e.is_null(), "a failed dflash2_engine_new must leave *out NULL");
        Err((status, last_error()))
    }
}

/// The synthetic target with its DFlash 2 drafter; freed at the end of the test.
struct Fixture {
    engine: *mut EngineHandle,
}

impl Fixture {
    fn new() -> Self {
        let (t, d) = (cstring(&model("target.gguf")), cstring(&model("drafter-dflash2.gguf")));
        Self { engine: new_engine(&params(&t, Some(&d))).unwrap() }
    }

    fn session(&self) -> *mut SessionHandle {
        let mut s = null_mut();
        ok(unsafe { dflash2_session_new(self.engine, &mut s) });
        s
    }

    fn tokenize(&self, text: &str, special: bool) -> Vec<i32> {
        let mut n = 0;
        let mut buf = vec![0i32; text.len() + 8];
        ok(unsafe {
            dflash2_tokenize(
                self.engine,
                text.as_ptr().cast(),
                text.len(),
                special,
                special,
                buf.as_mut_ptr(),
                buf.len(),
                &mut n,
            )
        });
        buf.truncate(n);
        buf
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        unsafe { dflash2_engine_free(self.engine) };
    }
}

unsafe extern "C" fn collect(text: *const c_char, len: usize, user: *mut c_void) -> c_int {
    let out = &mut *(user as *mut String);
    let bytes = std::slice::from_raw_parts(text.cast::<u8>(), len);
    assert_eq!(*text.add(len), 0, "a piece is NUL-terminated");
    out.push_str(std::str::from_utf8(bytes).expect("pieces are whole UTF-8 characters"));
    0
}

unsafe extern "C" fn stop_at_once(_: *const c_char, _: usize, user: *mut c_void) -> c_int {
    *(user as *mut usize) += 1;
    1
}

/// Calls back into its own session (which must answer BUSY) and stops.
unsafe extern "C" fn reenter(_: *const c_char, _: usize, user: *mut c_void) -> c_int {
    let (session, seen) = &mut *(user as *mut (*mut SessionHandle, Option<Status>));
    let mut stats = CStats::default();
    *seen = Some(dflash2_session_stats(*session, &mut stats));
    1
}

fn stats(s: *mut SessionHandle) -> CStats {
    let mut st = CStats::default();
    ok(unsafe { dflash2_session_stats(s, &mut st) });
    st
}

fn step_all(s: *mut SessionHandle, capacity: usize) -> (Vec<i32>, i32) {
    let mut out = Vec::new();
    let mut buf = vec![0i32; capacity];
    loop {
        let (mut n, mut finish) = (0, FINISH_NONE);
        ok(unsafe { dflash2_session_step(s, buf.as_mut_ptr(), capacity, &mut n, &mut finish) });
        assert!(n <= capacity);
        out.extend_from_slice(&buf[..n]);
        if finish != FINISH_NONE {
            return (out, finish);
        }
        assert!(n > 0, "a running generation commits at least one token per step");
    }
}

#[test]
fn sessions_reproduce_the_engine_step_by_step_and_streamed() {
    let fx = Fixture::new();
    let prompt = fx.tokenize("Once upon a time", false);
    let n_predict = 16;
    let mut cfg = EngineConfig::new(model("target.gguf"), Some(model("drafter-dflash2.gguf")));
    cfg.n_ctx = N_CTX as usize;
    let mut engine = Engine::load(&cfg).unwrap();
    let block = engine.drafter().unwrap().trained_block();
    let expected = engine
        .generate(&prompt, &GenerateOptions { n_predict, draft: common::draft(SelectMode::Greedy, block), ..GenerateOptions::default() }, |_| true)
        .unwrap();

    // Step by step, with a buffer smaller than a cycle's tokens: the rest comes next call.
    let a = fx.session();
    ok(unsafe { dflash2_session_feed(a, prompt.as_ptr(), prompt.len(), n_predict as u32) });
    let (tokens, finish) = step_all(a, 3);
    assert_eq!(tokens, expected.tokens);
    assert_eq!(finish, FINISH_LENGTH);
    let st = stats(a);
    assert_eq!(st.n_generated as usize, expected.tokens.len());
    assert_eq!(st.finish, FINISH_LENGTH);
    assert!(st.cycles > 0 && st.n_drafted > 0 && st.tau >= 1.0, "{st:?}");
    // Finished: more steps return nothing and the same reason; the statistics are frozen.
    let (rest, again) = step_all(a, 3);
    assert!(rest.is_empty());
    assert_eq!(again, FINISH_LENGTH);
    assert_eq!(stats(a).total_ms, st.total_ms);

    // Streamed through the callback, in two sessions on two threads at once.
    let engine_ptr = fx.engine as usize;
    let texts: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let prompt = prompt.clone();
                scope.spawn(move || {
                    let mut s = null_mut();
                    ok(unsafe { dflash2_session_new(engine_ptr as *const EngineHandle, &mut s) });
                    let mut text = String::new();
                    ok(unsafe { dflash2_session_feed(s, prompt.as_ptr(), prompt.len(), n_predict as u32) });
                    ok(unsafe { dflash2_session_generate(s, Some(collect), (&mut text as *mut String).cast()) });
                    unsafe { dflash2_session_free(s) };
                    text
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(texts, vec![expected.text.clone(), expected.text.clone()]);

    // The next turn extends the cached conversation: only its new part is decoded.
    let mut turn2 = prompt.clone();
    turn2.extend_from_slice(&expected.tokens);
    let new_part = fx.tokenize(" and then", false);
    turn2.extend_from_slice(&new_part);
    ok(unsafe { dflash2_session_feed(a, turn2.as_ptr(), turn2.len(), 4) });
    let st = stats(a);
    assert_eq!(st.n_prompt as usize, turn2.len());
    // The last generated token was committed but never decoded, so it is decoded now.
    assert_eq!(st.n_prompt_decoded as usize, new_part.len() + 1, "{st:?}");
    // After a reset the whole prompt is decoded again.
    ok(unsafe { dflash2_session_reset(a) });
    expect_err(unsafe { dflash2_session_stats(a, &mut CStats::default()) }, Status::State, "feed");
    ok(unsafe { dflash2_session_feed(a, turn2.as_ptr(), turn2.len(), 4) });
    assert_eq!(stats(a).n_prompt_decoded as usize, turn2.len());

    // A callback that returns non-zero stops the generation at once.
    let mut calls = 0usize;
    ok(unsafe { dflash2_session_feed(a, prompt.as_ptr(), prompt.len(), n_predict as u32) });
    ok(unsafe { dflash2_session_generate(a, Some(stop_at_once), (&mut calls as *mut usize).cast()) });
    assert_eq!(calls, 1);
    let st = stats(a);
    assert_eq!(st.finish, FINISH_CANCELLED);
    assert!((st.n_generated as usize) < expected.tokens.len(), "{st:?}");
    unsafe { dflash2_session_free(a) };
}

/// `lookup_ngram` > 0 without a drafter: the session drafts from its own context (the prompt
/// repeats itself; this random model rarely follows it) and still gives plain decoding's tokens.
#[test]
fn a_lookup_session_without_a_drafter_reproduces_plain_decoding() {
    let t = cstring(&model("target.gguf"));
    let mut p = params(&t, None);
    p.lookup_ngram = 4;
    let engine = new_engine(&p).unwrap();
    let mut cfg = EngineConfig::new(model("target.gguf"), None);
    cfg.n_ctx = N_CTX as usize;
    let mut plain = Engine::load(&cfg).unwrap();
    let prompt = plain.model().tokenize("one two three one two three one two three one two", true, false).unwrap();
    let n_predict = 40;
    let opts = GenerateOptions { n_predict, draft: common::draft(SelectMode::None, 16), ..GenerateOptions::default() };
    let expected = plain.generate(&prompt, &opts, |_| true).unwrap();

    let mut s = null_mut();
    ok(unsafe { dflash2_session_new(engine, &mut s) });
    ok(unsafe { dflash2_session_feed(s, prompt.as_ptr(), prompt.len(), n_predict as u32) });
    let (tokens, _) = step_all(s, 64);
    assert_eq!(tokens, expected.tokens);
    let st = stats(s);
    assert!(st.n_drafted > 0, "the look-up drafted nothing: {st:?}");
    unsafe { dflash2_session_free(s) };
    unsafe { dflash2_engine_free(engine) };
}

#[test]
fn tokenize_detokenize_and_chat_template_round_trip() {
    let fx = Fixture::new();
    let text = "Hello, wörld";
    let tokens = fx.tokenize(text, false);
    let mut buf = vec![0 as c_char; 64];
    let mut len = 0;
    ok(unsafe {
        dflash2_detokenize(fx.engine, tokens.as_ptr(), tokens.len(), false, buf.as_mut_ptr(), buf.len(), &mut len)
    });
    assert_eq!(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap(), text);
    assert_eq!(len, text.len());

    let (role, content) = (CString::new("user").unwrap(), CString::new("Hi!").unwrap());
    let msg = CChatMessage { role: role.as_ptr(), content: content.as_ptr() };
    let mut need = 0;
    expect_err(
        unsafe { dflash2_apply_chat_template(fx.engine, &msg, 1, true, null_mut(), 0, &mut need) },
        Status::BufferTooSmall,
        "needed",
    );
    let mut buf = vec![0 as c_char; need + 1];
    ok(unsafe { dflash2_apply_chat_template(fx.engine, &msg, 1, true, buf.as_mut_ptr(), buf.len(), &mut len) });
    let rendered = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap();
    assert_eq!(len, need);
    assert_eq!(rendered, "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n");
}

#[test]
fn every_call_rejects_bad_arguments_with_a_code_and_a_message() {
    let target = cstring(&model("target.gguf"));
    let drafter = cstring(&model("drafter-dflash2.gguf"));

    // Library.
    assert_eq!(unsafe { CStr::from_ptr(dflash2_version()) }.to_str().unwrap(), env!("CARGO_PKG_VERSION"));

    // dflash2_engine_params_init
    expect_err(unsafe { dflash2_engine_params_init(null_mut()) }, Status::NullArg, "params is NULL");

    // dflash2_engine_new: pointers, strings, settings, files.
    let good = params(&target, Some(&drafter));
    expect_err(unsafe { dflash2_engine_new(null(), &mut null_mut()) }, Status::NullArg, "params is NULL");
    expect_err(unsafe { dflash2_engine_new(&good, null_mut()) }, Status::NullArg, "out is NULL");
    let bad_utf8 = CString::new(b"/tmp/\xff\xfe.gguf".to_vec()).unwrap();
    let empty = CString::new("").unwrap();
    let missing = CString::new("/nonexistent/model.gguf").unwrap();
    let not_gguf_path = common::scratch_dir("capi-bad").join("not-a-model.gguf");
    std::fs::write(&not_gguf_path, b"this is not a GGUF file").unwrap();
    let not_gguf = cstring(&not_gguf_path);
    let smol = common::real_model(common::SMOLLM2);
    let other = dflash2::gguf::synth::synth_for_target(&smol, &common::scratch_dir("capi-other-target"), 0).unwrap();
    let other_drafter = cstring(&other.path);
    type Edit<'a> = Box<dyn Fn(&mut CEngineParams) + 'a>;
    let cases: Vec<(Edit<'_>, Status, &str)> = vec![
        (Box::new(|p| p.target_path = null()), Status::NullArg, "params->target_path is NULL"),
        (Box::new(|p| p.target_path = bad_utf8.as_ptr()), Status::Utf8, "params->target_path is not valid UTF-8"),
        (Box::new(|p| p.drafter_path = bad_utf8.as_ptr()), Status::Utf8, "params->drafter_path is not valid UTF-8"),
        (Box::new(|p| p.target_path = empty.as_ptr()), Status::InvalidArg, "target_path is empty"),
        (Box::new(|p| p.target_path = missing.as_ptr()), Status::Model, "/nonexistent/model.gguf: no such file"),
        (Box::new(|p| p.drafter_path = missing.as_ptr()), Status::Model, "/nonexistent/model.gguf: no such file"),
        (Box::new(|p| p.target_path = not_gguf.as_ptr()), Status::Model, "not a GGUF file"),
        (Box::new(|p| p.drafter_path = target.as_ptr()), Status::Mismatch, "expected 'dflash'"),
        (Box::new(|p| p.drafter_path = other_drafter.as_ptr()), Status::Mismatch, "vocabulary"),
        (Box::new(|p| p.n_ctx = 0), Status::InvalidArg, "n_ctx is 0"),
        (Box::new(|p| p.n_threads = 0), Status::InvalidArg, "n_threads is 0"),
        (Box::new(|p| p.n_gpu_layers = -1), Status::InvalidArg, "n_gpu_layers is -1"),
        (Box::new(|p| p.block_size = 1), Status::InvalidArg, "block_size is 1"),
        (Box::new(|p| p.block_size = MAX_BLOCK + 1), Status::InvalidArg, "block_size is 65"),
        (Box::new(|p| p.select = 9), Status::InvalidArg, "select is 9"),
        (Box::new(|p| p.tree_budget = 0), Status::InvalidArg, "tree_budget is 0"),
        (Box::new(|p| p.lookup_ngram = 9), Status::InvalidArg, "lookup_ngram is 9"),
        (Box::new(|p| p.sampling.temperature = f32::NAN), Status::InvalidArg, "sampling.temperature is NaN"),
        (Box::new(|p| p.sampling.repeat_penalty = 0.0), Status::InvalidArg, "sampling.repeat_penalty is 0"),
    ];
    for (edit, want, needle) in cases {
        let mut p = good;
        edit(&mut p);
        let (status, msg) = new_engine(&p).unwrap_err();
        assert_eq!(status, want, "{msg}");
        assert!(msg.contains(needle), "{want:?}: message {msg:?} does not mention {needle:?}");
    }
    unsafe { dflash2_engine_free(null_mut()) };
    assert_eq!(last_error(), "");

    let fx = Fixture::new();
    let e = fx.engine;
    let (mut n, mut len) = (0usize, 0usize);
    let mut toks = [0i32; 4];
    let mut buf = [0 as c_char; 4];
    let text = "hello world";
    let (tp, tl) = (text.as_ptr().cast::<c_char>(), text.len());

    // dflash2_tokenize
    expect_err(
        unsafe { dflash2_tokenize(null(), tp, tl, true, true, toks.as_mut_ptr(), 4, &mut n) },
        Status::NullArg,
        "engine is NULL",
    );
    expect_err(
        unsafe { dflash2_tokenize(e, null(), tl, true, true, toks.as_mut_ptr(), 4, &mut n) },
        Status::NullArg,
        "text is NULL",
    );
    expect_err(
        unsafe { dflash2_tokenize(e, tp, 0, true, true, toks.as_mut_ptr(), 4, &mut n) },
        Status::InvalidArg,
        "text_len is 0",
    );
    let bad = b"ab\xc3(";
    expect_err(
        unsafe { dflash2_tokenize(e, bad.as_ptr().cast(), bad.len(), true, true, toks.as_mut_ptr(), 4, &mut n) },
        Status::Utf8,
        "text is not valid UTF-8 (at byte 2)",
    );
    expect_err(
        unsafe { dflash2_tokenize(e, tp, tl, true, true, null_mut(), 4, &mut n) },
        Status::NullArg,
        "tokens is NULL but its capacity is 4",
    );
    expect_err(
        unsafe { dflash2_tokenize(e, tp, tl, true, true, toks.as_mut_ptr(), 4, null_mut()) },
        Status::NullArg,
        "n_tokens is NULL",
    );
    let need = fx.tokenize(text, true).len();
    expect_err(
        unsafe { dflash2_tokenize(e, tp, tl, true, true, toks.as_mut_ptr(), 1, &mut n) },
        Status::BufferTooSmall,
        "tokens holds 1",
    );
    assert_eq!(n, need, "a too-small buffer reports the size needed");

    // dflash2_detokenize
    let t = [1i32, 2];
    expect_err(
        unsafe { dflash2_detokenize(null(), t.as_ptr(), 2, false, buf.as_mut_ptr(), 4, &mut len) },
        Status::NullArg,
        "engine is NULL",
    );
    expect_err(
        unsafe { dflash2_detokenize(e, null(), 2, false, buf.as_mut_ptr(), 4, &mut len) },
        Status::NullArg,
        "tokens is NULL",
    );
    expect_err(
        unsafe { dflash2_detokenize(e, t.as_ptr(), 0, false, buf.as_mut_ptr(), 4, &mut len) },
        Status::InvalidArg,
        "n_tokens is 0",
    );
    expect_err(
        unsafe { dflash2_detokenize(e, [5, -1].as_ptr(), 2, false, buf.as_mut_ptr(), 4, &mut len) },
        Status::InvalidArg,
        "token -1 (at index 1) is outside the vocabulary of 512",
    );
    expect_err(
        unsafe { dflash2_detokenize(e, [512].as_ptr(), 1, false, buf.as_mut_ptr(), 4, &mut len) },
        Status::InvalidArg,
        "token 512 (at index 0)",
    );
    expect_err(
        unsafe { dflash2_detokenize(e, t.as_ptr(), 2, false, null_mut(), 4, &mut len) },
        Status::NullArg,
        "buf is NULL but its capacity is 4",
    );
    expect_err(
        unsafe { dflash2_detokenize(e, t.as_ptr(), 2, false, buf.as_mut_ptr(), 4, null_mut()) },
        Status::NullArg,
        "len is NULL",
    );
    let long = fx.tokenize("a rather long piece of text", false);
    expect_err(
        unsafe { dflash2_detokenize(e, long.as_ptr(), long.len(), false, buf.as_mut_ptr(), 4, &mut len) },
        Status::BufferTooSmall,
        "buf holds 4 bytes",
    );
    assert_eq!(len, "a rather long piece of text".len());

    // dflash2_apply_chat_template
    let (user, hi) = (CString::new("user").unwrap(), CString::new("hi").unwrap());
    let bad_content = CString::new(b"\xc3(".to_vec()).unwrap();
    let msg = |role: *const c_char, content: *const c_char| CChatMessage { role, content };
    let good_msg = msg(user.as_ptr(), hi.as_ptr());
    let mut big = [0 as c_char; 256];
    let chat = |m: *const CChatMessage,
                n_m: usize,
                b: *mut c_char,
                cap: usize,
                l: *mut usize,
                eng: *const EngineHandle| unsafe {
        dflash2_apply_chat_template(eng, m, n_m, true, b, cap, l)
    };
    expect_err(chat(&good_msg, 1, big.as_mut_ptr(), 256, &mut len, null()), Status::NullArg, "engine is NULL");
    expect_err(chat(null(), 1, big.as_mut_ptr(), 256, &mut len, e), Status::NullArg, "messages is NULL");
    expect_err(chat(&good_msg, 0, big.as_mut_ptr(), 256, &mut len, e), Status::InvalidArg, "n_messages is 0");
    expect_err(
        chat(&msg(null(), hi.as_ptr()), 1, big.as_mut_ptr(), 256, &mut len, e),
        Status::NullArg,
        "messages[0].role is NULL",
    );
    let two = [good_msg, msg(user.as_ptr(), null())];
    expect_err(
        chat(two.as_ptr(), 2, big.as_mut_ptr(), 256, &mut len, e),
        Status::NullArg,
        "messages[1].content is NULL",
    );
    expect_err(
        chat(&msg(user.as_ptr(), bad_content.as_ptr()), 1, big.as_mut_ptr(), 256, &mut len, e),
        Status::Utf8,
        "messages[0].content is not valid UTF-8",
    );
    expect_err(chat(&good_msg, 1, null_mut(), 256, &mut len, e), Status::NullArg, "buf is NULL");
    expect_err(chat(&good_msg, 1, big.as_mut_ptr(), 256, null_mut(), e), Status::NullArg, "len is NULL");
    expect_err(chat(&good_msg, 1, big.as_mut_ptr(), 4, &mut len, e), Status::BufferTooSmall, "buf holds 4 bytes");

    // dflash2_session_new / dflash2_session_free
    expect_err(unsafe { dflash2_session_new(null(), &mut null_mut()) }, Status::NullArg, "engine is NULL");
    expect_err(unsafe { dflash2_session_new(e, null_mut()) }, Status::NullArg, "out is NULL");
    unsafe { dflash2_session_free(null_mut()) };
    assert_eq!(last_error(), "");
    let s = fx.session();

    // Before any prompt: generation calls are out of order.
    let (mut finish, mut st) = (0i32, CStats::default());
    expect_err(
        unsafe { dflash2_session_step(s, toks.as_mut_ptr(), 4, &mut n, &mut finish) },
        Status::State,
        "call dflash2_session_feed first",
    );
    expect_err(
        unsafe { dflash2_session_generate(s, Some(collect), null_mut()) },
        Status::State,
        "call dflash2_session_feed first",
    );
    expect_err(unsafe { dflash2_session_stats(s, &mut st) }, Status::State, "no generation yet");

    // dflash2_session_feed
    let prompt = fx.tokenize(text, false);
    let (pp, pl) = (prompt.as_ptr(), prompt.len());
    expect_err(unsafe { dflash2_session_feed(null_mut(), pp, pl, 4) }, Status::NullArg, "session is NULL");
    expect_err(unsafe { dflash2_session_feed(s, null(), pl, 4) }, Status::NullArg, "tokens is NULL");
    expect_err(unsafe { dflash2_session_feed(s, pp, 0, 4) }, Status::InvalidArg, "n_tokens is 0");
    expect_err(unsafe { dflash2_session_feed(s, pp, pl, 0) }, Status::InvalidArg, "n_predict is 0");
    expect_err(
        unsafe { dflash2_session_feed(s, [7, 99999].as_ptr(), 2, 4) },
        Status::InvalidArg,
        "token 99999 (at index 1)",
    );
    let too_long = vec![prompt[0]; N_CTX as usize + 1];
    expect_err(
        unsafe { dflash2_session_feed(s, too_long.as_ptr(), too_long.len(), 4) },
        Status::Context,
        "the context holds 512",
    );
    ok(unsafe { dflash2_session_feed(s, pp, pl, 4) });

    // dflash2_session_step
    expect_err(
        unsafe { dflash2_session_step(null_mut(), toks.as_mut_ptr(), 4, &mut n, &mut finish) },
        Status::NullArg,
        "session is NULL",
    );
    expect_err(
        unsafe { dflash2_session_step(s, null_mut(), 4, &mut n, &mut finish) },
        Status::NullArg,
        "tokens is NULL",
    );
    expect_err(
        unsafe { dflash2_session_step(s, toks.as_mut_ptr(), 0, &mut n, &mut finish) },
        Status::InvalidArg,
        "capacity is 0",
    );
    expect_err(
        unsafe { dflash2_session_step(s, toks.as_mut_ptr(), 4, null_mut(), &mut finish) },
        Status::NullArg,
        "n_tokens is NULL",
    );
    expect_err(
        unsafe { dflash2_session_step(s, toks.as_mut_ptr(), 4, &mut n, null_mut()) },
        Status::NullArg,
        "finish is NULL",
    );

    // dflash2_session_generate; a callback that re-enters its own session gets BUSY.
    expect_err(
        unsafe { dflash2_session_generate(null_mut(), Some(collect), null_mut()) },
        Status::NullArg,
        "session is NULL",
    );
    expect_err(unsafe { dflash2_session_generate(s, None, null_mut()) }, Status::NullArg, "callback is NULL");
    let mut probe: (*mut SessionHandle, Option<Status>) = (s, None);
    ok(unsafe {
        dflash2_session_generate(s, Some(reenter), (&mut probe as *mut (*mut SessionHandle, Option<Status>)).cast())
    });
    assert_eq!(probe.1, Some(Status::Busy));

    // dflash2_session_stats / dflash2_session_reset
    expect_err(unsafe { dflash2_session_stats(null(), &mut st) }, Status::NullArg, "session is NULL");
    expect_err(unsafe { dflash2_session_stats(s, null_mut()) }, Status::NullArg, "out is NULL");
    ok(unsafe { dflash2_session_stats(s, &mut st) });
    assert_eq!(st.finish, FINISH_CANCELLED);
    expect_err(unsafe { dflash2_session_reset(null_mut()) }, Status::NullArg, "session is NULL");
    ok(unsafe { dflash2_session_reset(s) });

    // The last error is per thread.
    expect_err(unsafe { dflash2_session_reset(null_mut()) }, Status::NullArg, "session is NULL");
    std::thread::spawn(|| assert_eq!(last_error(), "")).join().unwrap();
    assert!(last_error().contains("session is NULL"));
    unsafe { dflash2_session_free(s) };
}
