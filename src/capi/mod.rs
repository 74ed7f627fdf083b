//! The C ABI declared in `ffi/dflash2.h`: opaque engine and session handles over [`Engine`].
//!
//! Every entry point validates its arguments, runs inside `catch_unwind` (no panic crosses
//! into C), returns a [`Status`] and leaves a message for `dflash2_last_error` on failure.
//! The header is the contract; the layouts here must match it (tests/capi.rs checks them).
use crate::text::Utf8Stream;
use crate::draft::config::{Block, DraftConfig, SelectMode, DEFAULT_LOOKUP_NGRAM, LOOKUP_BLOCK};
use crate::engine::{default_threads, Engine, EngineConfig, EngineError, FinishReason, GenerateOptions, Run, Stats};
use crate::llama::{ChatMessage, LlamaError, Model, Token};
use crate::template::{ChatTemplate, TemplateChoice};
use crate::sampling::SamplingParams;
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, TryLockError};

mod spec;
pub use spec::*;

/// `dflash2_status`: what every call returns.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok = 0,
    NullArg = 1,
    InvalidArg = 2,
    Utf8 = 3,
    BufferTooSmall = 4,
    Model = 5,
    Mismatch = 6,
    State = 7,
    Busy = 8,
    Context = 9,
    Template = 10,
    Llama = 11,
    Panic = 12,
}

pub const SELECT_NONE: i32 = 0;
pub const SELECT_GREEDY: i32 = 1;
pub const SELECT_BEST_PATH: i32 = 2;
pub const SELECT_TREE: i32 = 3;

pub const FINISH_NONE: i32 = 0;
pub const FINISH_EOG: i32 = 1;
pub const FINISH_LENGTH: i32 = 2;
pub const FINISH_STOP: i32 = 3;
pub const FINISH_CONTEXT: i32 = 4;
pub const FINISH_CANCELLED: i32 = 5;

/// Largest block size accepted (DFlash drafters are trained with blocks of at most 64).
pub const MAX_BLOCK: u32 = 64;

/// `dflash2_sampling`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CSampling {
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    pub repeat_last_n: i32,
    pub seed: u64,
}

/// `dflash2_engine_params`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CEngineParams {
    pub target_path: *const c_char,
    pub drafter_path: *const c_char,
    pub n_ctx: u32,
    pub n_threads: i32,
    pub n_gpu_layers: i32,
    pub block_size: u32,
    pub select: i32,
    pub tree_budget: u32,
    pub sampling: CSampling,
    pub lookup_ngram: u32,
}

/// `dflash2_chat_message`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CChatMessage {
    pub role: *const c_char,
    pub content: *const c_char,
}

/// `dflash2_stats`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CStats {
    pub n_prompt: u64,
    pub n_prompt_decoded: u64,
    pub n_generated: u64,
    pub cycles: u64,
    pub n_drafted: u64,
    pub n_accepted: u64,
    pub tau: f64,
    pub tokens_per_second: f64,
    pub prefill_ms: f64,
    pub draft_ms: f64,
    pub verify_ms: f64,
    pub host_ms: f64,
    pub total_ms: f64,
    pub finish: i32,
}

/// `dflash2_text_callback`: one piece of text (whole UTF-8 characters, NUL-terminated);
/// non-zero stops the generation.
pub type TextCallback = Option<unsafe extern "C" fn(text: *const c_char, len: usize, user_data: *mut c_void) -> c_int>;

/// `dflash2_engine`: the loaded models and the settings every session starts from.
pub struct EngineHandle {
    target: Arc<Model>,
    /// The target's chat template, compiled at the first call that renders one.
    template: std::sync::OnceLock<std::result::Result<ChatTemplate, String>>,
    drafter: Option<Arc<Model>>,
    config: EngineConfig,
    /// The block every session drafts with (None: the drafter's trained block).
    block: Option<usize>,
    /// What every session starts from (its block set per session).
    opts: GenerateOptions,
}

/// `dflash2_session`: one conversation. The mutex turns a concurrent or re-entrant call
/// into `DFLASH2_ERR_BUSY` instead of a data race.
pub struct SessionHandle {
    state: Mutex<SessionState>,
}

struct SessionState {
    engine: Engine,
    opts: GenerateOptions,
    run: Option<Run>,
    /// Tokens of `run` already handed to the caller.
    emitted: usize,
    /// Statistics taken when the run ended: a finished run's clock would keep running.
    final_stats: Option<Stats>,
}

struct Error {
    status: Status,
    message: String,
}

type Result<T> = std::result::Result<T, Error>;

fn err<T>(status: Status, message: impl Into<String>) -> Result<T> {
    Err(Error { status, message: message.into() })
}

impl From<LlamaError> for Error {
    fn from(e: LlamaError) -> Self {
        let status = match &e {
            LlamaError::LoadModel { .. } => Status::Model,
            LlamaError::ChatTemplate(_) => Status::Template,
            LlamaError::ContextFull { .. } => Status::Context,
            LlamaError::Tokenize(_) | LlamaError::Invalid(_) => Status::InvalidArg,
            _ => Status::Llama,
        };
        Error { status, message: e.to_string() }
    }
}

impl From<EngineError> for Error {
    fn from(e: EngineError) -> Self {
        let status = match e {
            EngineError::Llama(e) => return e.into(),
            EngineError::Gguf(_) => Status::Model,
            EngineError::Pair(crate::gguf::PairCheckError::Read(_)) => Status::Model,
            EngineError::Pair(crate::gguf::PairCheckError::Mismatch { .. }) => Status::Mismatch,
            EngineError::PromptTooLong { .. } => Status::Context,
            EngineError::EmptyPrompt | EngineError::Config(_) => Status::InvalidArg,
        };
        Error { status, message: e.to_string() }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    let c = CString::new(message.replace('\0', "\\0")).expect("NULs were replaced");
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Run one entry point: catch panics, turn the result into a status, and leave its message
/// (empty on success, also when a callback's own calls failed in between).
fn guard(f: impl FnOnce() -> Result<()>) -> Status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => {
            set_last_error("");
            Status::Ok
        }
        Ok(Err(e)) => {
            set_last_error(&e.message);
            e.status
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!("internal error (a bug in dflash2): {what}"));
            Status::Panic
        }
    }
}

// ---- argument checks -------------------------------------------------------------------

fn non_null<'a, T>(p: *const T, name: &str) -> Result<&'a T> {
    // SAFETY: the header requires non-NULL pointers to point at a valid object.
    unsafe { p.as_ref() }.map_or_else(|| err(Status::NullArg, format!("{name} is NULL")), Ok)
}

fn out_ptr<'a, T>(p: *mut T, name: &str) -> Result<&'a mut T> {
    // SAFETY: as above, for an object the caller lets us write.
    unsafe { p.as_mut() }.map_or_else(|| err(Status::NullArg, format!("{name} is NULL")), Ok)
}

/// A NUL-terminated UTF-8 string argument.
fn c_str<'a>(p: *const c_char, name: &str) -> Result<&'a str> {
    if p.is_null() {
        return err(Status::NullArg, format!("{name} is NULL"));
    }
    // SAFETY: the header requires a NUL-terminated string.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().or_else(|e| err(Status::Utf8, format!("{name} is not valid UTF-8 (at byte {})", e.valid_up_to())))
}

/// `len` elements at `p`; a zero length is an error (there is nothing to work on).
fn slice<'a, T>(p: *const T, len: usize, name: &str, len_name: &str) -> Result<&'a [T]> {
    if p.is_null() {
        return err(Status::NullArg, format!("{name} is NULL"));
    }
    if len == 0 {
        return err(Status::InvalidArg, format!("{len_name} is 0"));
    }
    // SAFETY: the header requires `len` readable elements at `p`.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

fn check_tokens(model: &Model, tokens: &[Token]) -> Result<()> {
    let n_vocab = model.n_vocab();
    match tokens.iter().position(|&t| t < 0 || t as usize >= n_vocab) {
        Some(i) => err(
            Status::InvalidArg,
            format!("token {} (at index {i}) is outside the vocabulary of {n_vocab} tokens", tokens[i]),
        ),
        None => Ok(()),
    }
}

/// The caller's output buffer: NULL is allowed only with capacity 0 (a size query).
fn out_buf<'a, T>(p: *mut T, capacity: usize, name: &str) -> Result<&'a mut [T]> {
    if capacity == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return err(Status::NullArg, format!("{name} is NULL but its capacity is {capacity}"));
    }
    // SAFETY: the header requires `capacity` writable elements at `p`.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, capacity) })
}

/// Copy `src` to the caller, or report the size it needs.
fn copy_out<T: Copy>(src: &[T], buf: &mut [T], n_out: &mut usize, name: &str) -> Result<()> {
    *n_out = src.len();
    if buf.len() < src.len() {
        return err(Status::BufferTooSmall, format!("{name} holds {} but {} are needed", buf.len(), src.len()));
    }
    buf[..src.len()].copy_from_slice(src);
    Ok(())
}

/// Copy text and its terminating NUL; `*len` excludes the NUL.
fn copy_text(text: &str, buf: &mut [c_char], len: &mut usize) -> Result<()> {
    *len = text.len();
    if buf.len() <= text.len() {
        return err(
            Status::BufferTooSmall,
            format!("buf holds {} bytes but {} are needed (the text and its NUL)", buf.len(), text.len() + 1),
        );
    }
    for (d, &s) in buf.iter_mut().zip(text.as_bytes()) {
        *d = s as c_char;
    }
    buf[text.len()] = 0;
    Ok(())
}

fn lock_session<'a>(session: *const SessionHandle) -> Result<std::sync::MutexGuard<'a, SessionState>> {
    let s: &'a SessionHandle = non_null(session, "session")?;
    s.state.try_lock().or_else(|e| match e {
        TryLockError::WouldBlock => {
            err(Status::Busy, "the session is in use by another call (another thread, or this session's callback)")
        }
        TryLockError::Poisoned(_) => {
            err(Status::Panic, "the session failed with an internal error earlier: free it and create a new one")
        }
    })
}

fn select_mode(v: i32) -> Result<SelectMode> {
    Ok(match v {
        SELECT_NONE => SelectMode::None,
        SELECT_GREEDY => SelectMode::Greedy,
        SELECT_BEST_PATH => SelectMode::BestPath,
        SELECT_TREE => SelectMode::Tree,
        _ => return err(Status::InvalidArg, format!("select is {v}, expected a DFLASH2_SELECT_* value (0..=3)")),
    })
}

fn finish_code(f: Option<FinishReason>) -> i32 {
    match f {
        None => FINISH_NONE,
        Some(FinishReason::Eog) => FINISH_EOG,
        Some(FinishReason::Length) => FINISH_LENGTH,
        Some(FinishReason::Stop) => FINISH_STOP,
        Some(FinishReason::Context) => FINISH_CONTEXT,
        Some(FinishReason::Cancelled) => FINISH_CANCELLED,
    }
}

fn sampling_params(s: &CSampling) -> Result<SamplingParams> {
    for (name, v) in [("temperature", s.temperature), ("top_p", s.top_p), ("min_p", s.min_p)] {
        if !v.is_finite() {
            return err(Status::InvalidArg, format!("sampling.{name} is {v}, expected a finite number"));
        }
    }
    if !(s.repeat_penalty.is_finite() && s.repeat_penalty > 0.0) {
        return err(Status::InvalidArg, format!("sampling.repeat_penalty is {}, expected > 0", s.repeat_penalty));
    }
    Ok(SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: s.top_p,
        min_p: s.min_p,
        repeat_penalty: s.repeat_penalty,
        repeat_last_n: s.repeat_last_n,
        seed: s.seed,
        // (not in dflash2_sampling: adding fields would change its layout)
        ..SamplingParams::default()
    })
}

/// The checked engine settings and block (`block_size` 0: none, the drafter's); the model files
/// are checked and loaded afterwards.
fn engine_settings(p: &CEngineParams) -> Result<(EngineConfig, GenerateOptions, Option<usize>)> {
    let target = c_str(p.target_path, "params->target_path")?;
    if target.is_empty() {
        return err(Status::InvalidArg, "params->target_path is empty");
    }
    let drafter = match p.drafter_path.is_null() {
        true => None,
        false => Some(PathBuf::from(c_str(p.drafter_path, "params->drafter_path")?)),
    };
    if p.n_ctx < 2 {
        return err(Status::InvalidArg, format!("params->n_ctx is {}, expected at least 2", p.n_ctx));
    }
    if p.n_threads < 1 {
        return err(Status::InvalidArg, format!("params->n_threads is {}, expected at least 1", p.n_threads));
    }
    if p.n_gpu_layers < 0 {
        return err(
            Status::InvalidArg,
            format!("params->n_gpu_layers is {}, expected >= 0 (999 offloads every layer)", p.n_gpu_layers),
        );
    }
    if p.block_size == 1 || p.block_size > MAX_BLOCK {
        return err(
            Status::InvalidArg,
            format!("params->block_size is {}, expected 0 (the drafter's) or 2..={MAX_BLOCK}", p.block_size),
        );
    }
    if p.tree_budget == 0 {
        return err(Status::InvalidArg, "params->tree_budget is 0");
    }
    let max_ngram = crate::draft::lookup::MAX_NGRAM as u32;
    if p.lookup_ngram > max_ngram {
        return err(
            Status::InvalidArg,
            format!("params->lookup_ngram is {}, expected 0 (no look-up) or 1..={max_ngram}", p.lookup_ngram),
        );
    }
    let mut cfg = EngineConfig::new(PathBuf::from(target), drafter);
    cfg.n_ctx = p.n_ctx as usize;
    cfg.n_threads = p.n_threads;
    cfg.n_gpu_layers = p.n_gpu_layers;
    let draft = DraftConfig {
        select: select_mode(p.select)?,
        tree_budget: p.tree_budget as usize,
        lookup: p.lookup_ngram > 0,
        lookup_ngram: if p.lookup_ngram > 0 { p.lookup_ngram as usize } else { DEFAULT_LOOKUP_NGRAM },
        ..DraftConfig::default()
    };
    let opts = GenerateOptions { draft, sampling: sampling_params(&p.sampling)?, ..GenerateOptions::default() };
    Ok((cfg, opts, Some(p.block_size as usize).filter(|&b| b > 0)))
}

impl SessionState {
    fn run_mut(&mut self) -> Result<&mut Run> {
        self.run.as_mut().map_or_else(|| err(Status::State, "no prompt fed: call dflash2_session_feed first"), Ok)
    }

    /// One engine cycle; a failed cycle ends the run (the caller may feed again or reset).
    fn advance(&mut self) -> Result<()> {
        let run = self.run.as_mut().expect("advance needs a run");
        if let Err(e) = self.engine.step(run) {
            self.run = None;
            return Err(e.into());
        }
        self.freeze_if_finished();
        Ok(())
    }

    fn freeze_if_finished(&mut self) {
        if let Some(run) = &self.run {
            if run.finish().is_some() && self.final_stats.is_none() {
                self.final_stats = Some(run.stats());
            }
        }
    }

    fn pending(&self) -> &[Token] {
        self.run.as_ref().map_or(&[], |r| &r.tokens()[self.emitted..])
    }
}

// ---- entry points ------------------------------------------------------------------------

#[no_mangle]
pub extern "C" fn dflash2_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

#[no_mangle]
pub extern "C" fn dflash2_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// # Safety
/// See `dflash2_engine_params_init` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_engine_params_init(params: *mut CEngineParams) -> Status {
    guard(|| {
        let p = out_ptr(params, "params")?;
        let s = SamplingParams::default();
        let o = GenerateOptions::default();
        *p = CEngineParams {
            target_path: std::ptr::null(),
            drafter_path: std::ptr::null(),
            n_ctx: 4096,
            n_threads: default_threads(),
            n_gpu_layers: 999,
            block_size: 0,
            select: SELECT_GREEDY,
            tree_budget: o.draft.tree_budget as u32,
            sampling: CSampling {
                temperature: s.temperature,
                top_k: s.top_k,
                top_p: s.top_p,
                min_p: s.min_p,
                repeat_penalty: s.repeat_penalty,
                repeat_last_n: s.repeat_last_n,
                seed: s.seed,
            },
            lookup_ngram: DEFAULT_LOOKUP_NGRAM as u32,
        };
        Ok(())
    })
}

/// # Safety
/// See `dflash2_engine_new` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_engine_new(params: *const CEngineParams, out: *mut *mut EngineHandle) -> Status {
    guard(|| {
        let out = out_ptr(out, "out")?;
        *out = std::ptr::null_mut();
        let (config, opts, block) = engine_settings(non_null(params, "params")?)?;
        let (target, drafter) = Engine::load_models(&config)?;
        *out = Box::into_raw(Box::new(EngineHandle { target, template: Default::default(), drafter, config, block, opts }));
        Ok(())
    })
}

/// # Safety
/// See `dflash2_engine_free` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_engine_free(engine: *mut EngineHandle) {
    // SAFETY: made by Box::into_raw in dflash2_engine_new, freed once (header contract).
    unsafe { free_handle(engine) }
}

/// # Safety
/// See `dflash2_tokenize` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_tokenize(
    engine: *const EngineHandle,
    text: *const c_char,
    text_len: usize,
    add_special: bool,
    parse_special: bool,
    tokens: *mut i32,
    capacity: usize,
    n_tokens: *mut usize,
) -> Status {
    guard(|| {
        let e = non_null(engine, "engine")?;
        let n_tokens = out_ptr(n_tokens, "n_tokens")?;
        *n_tokens = 0;
        let bytes = slice(text.cast::<u8>(), text_len, "text", "text_len")?;
        let text = std::str::from_utf8(bytes)
            .or_else(|x| err(Status::Utf8, format!("text is not valid UTF-8 (at byte {})", x.valid_up_to())))?;
        let buf = out_buf(tokens, capacity, "tokens")?;
        let toks = e.target.tokenize(text, add_special, parse_special)?;
        copy_out(&toks, buf, n_tokens, "tokens")
    })
}

/// # Safety
/// See `dflash2_detokenize` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_detokenize(
    engine: *const EngineHandle,
    tokens: *const i32,
    n_tokens: usize,
    special: bool,
    buf: *mut c_char,
    capacity: usize,
    len: *mut usize,
) -> Status {
    guard(|| {
        let e = non_null(engine, "engine")?;
        let len = out_ptr(len, "len")?;
        *len = 0;
        let toks = slice(tokens, n_tokens, "tokens", "n_tokens")?;
        let buf = out_buf(buf, capacity, "buf")?;
        check_tokens(&e.target, toks)?;
        copy_text(&e.target.detokenize(toks, special), buf, len)
    })
}

/// # Safety
/// See `dflash2_apply_chat_template` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_apply_chat_template(
    engine: *const EngineHandle,
    messages: *const CChatMessage,
    n_messages: usize,
    add_assistant: bool,
    buf: *mut c_char,
    capacity: usize,
    len: *mut usize,
) -> Status {
    guard(|| {
        let e = non_null(engine, "engine")?;
        let len = out_ptr(len, "len")?;
        *len = 0;
        let msgs = slice(messages, n_messages, "messages", "n_messages")?;
        let buf = out_buf(buf, capacity, "buf")?;
        let msgs = msgs
            .iter()
            .enumerate()
            .map(|(i, m)| {
                Ok(ChatMessage {
                    role: c_str(m.role, &format!("messages[{i}].role"))?.to_string(),
                    content: c_str(m.content, &format!("messages[{i}].content"))?.to_string(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let template = e
            .template
            .get_or_init(|| ChatTemplate::new(&e.target, &TemplateChoice::Model).map_err(|err| err.to_string()))
            .as_ref()
            .or_else(|message| err(Status::Template, message.clone()))?;
        copy_text(&template.render(&msgs, add_assistant)?, buf, len)
    })
}

/// # Safety
/// See `dflash2_session_new` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_session_new(engine: *const EngineHandle, out: *mut *mut SessionHandle) -> Status {
    guard(|| {
        let out = out_ptr(out, "out")?;
        *out = std::ptr::null_mut();
        let e = non_null(engine, "engine")?;
        let engine = Engine::from_models(e.target.clone(), e.drafter.clone(), &e.config)?;
        let mut opts = e.opts.clone();
        let trained = || engine.drafter().map_or(LOOKUP_BLOCK, |d| d.trained_block());
        opts.draft.block = Block::Fixed(e.block.unwrap_or_else(trained));
        let state = SessionState { engine, opts, run: None, emitted: 0, final_stats: None };
        *out = Box::into_raw(Box::new(SessionHandle { state: Mutex::new(state) }));
        Ok(())
    })
}

/// # Safety
/// See `dflash2_session_free` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_session_free(session: *mut SessionHandle) {
    // SAFETY: made by Box::into_raw in dflash2_session_new, freed once (header contract).
    unsafe { free_handle(session) }
}

/// Free a handle made by `Box::into_raw` (null is allowed and does nothing).
///
/// # Safety
/// `handle` is null or came from `Box::into_raw` and is not used again.
unsafe fn free_handle<T>(handle: *mut T) {
    guard(|| {
        if !handle.is_null() {
            drop(unsafe { Box::from_raw(handle) });
        }
        Ok(())
    });
}

/// # Safety
/// See `dflash2_session_feed` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_session_feed(
    session: *mut SessionHandle,
    tokens: *const i32,
    n_tokens: usize,
    n_predict: u32,
) -> Status {
    guard(|| {
        let mut s = lock_session(session)?;
        let prompt = slice(tokens, n_tokens, "tokens", "n_tokens")?;
        if n_predict == 0 {
            return err(Status::InvalidArg, "n_predict is 0");
        }
        check_tokens(s.engine.model(), prompt)?;
        s.run = None;
        s.emitted = 0;
        s.final_stats = None;
        s.opts.n_predict = n_predict as usize;
        let run = {
            let s = &mut *s;
            s.engine.start(prompt, &s.opts)?
        };
        s.run = Some(run);
        s.freeze_if_finished();
        Ok(())
    })
}

/// # Safety
/// See `dflash2_session_step` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_session_step(
    session: *mut SessionHandle,
    tokens: *mut i32,
    capacity: usize,
    n_tokens: *mut usize,
    finish: *mut i32,
) -> Status {
    guard(|| {
        let mut s = lock_session(session)?;
        let n_tokens = out_ptr(n_tokens, "n_tokens")?;
        let finish = out_ptr(finish, "finish")?;
        *n_tokens = 0;
        *finish = FINISH_NONE;
        if capacity == 0 {
            return err(Status::InvalidArg, "capacity is 0: a step commits at least one token");
        }
        let buf = out_buf(tokens, capacity, "tokens")?;
        let done = s.run_mut()?.finish().is_some();
        if s.pending().is_empty() && !done {
            s.advance()?;
        }
        let n = s.pending().len().min(capacity);
        buf[..n].copy_from_slice(&s.pending()[..n]);
        s.emitted += n;
        *n_tokens = n;
        if s.pending().is_empty() {
            *finish = finish_code(s.run_mut()?.finish());
        }
        Ok(())
    })
}

/// # Safety
/// See `dflash2_session_generate` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_session_generate(
    session: *mut SessionHandle,
    callback: TextCallback,
    user_data: *mut c_void,
) -> Status {
    guard(|| {
        let mut s = lock_session(session)?;
        let Some(callback) = callback else { return err(Status::NullArg, "callback is NULL") };
        s.run_mut()?;
        let model = s.engine.model().clone();
        let mut utf8 = Utf8Stream::default();
        // A piece is handed over NUL-terminated; the callback must not keep the pointer.
        let emit = |text: String| -> bool {
            if text.is_empty() {
                return true;
            }
            let len = text.len();
            let mut bytes = text.into_bytes();
            bytes.push(0);
            // SAFETY: a valid C function pointer, per the header.
            unsafe { callback(bytes.as_ptr().cast(), len, user_data) == 0 }
        };
        loop {
            let bytes: Vec<u8> = s.pending().iter().flat_map(|&t| model.token_bytes(t, false)).collect();
            s.emitted = s.run_mut()?.tokens().len();
            let finished = s.run_mut()?.finish().is_some();
            let mut text = utf8.push(&bytes);
            if finished {
                text.push_str(&utf8.finish());
            }
            if !emit(text) {
                s.run_mut()?.cancel();
                s.freeze_if_finished();
                return Ok(());
            }
            if finished {
                return Ok(());
            }
            s.advance()?;
        }
    })
}

/// # Safety
/// See `dflash2_session_stats` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_session_stats(session: *const SessionHandle, out: *mut CStats) -> Status {
    guard(|| {
        let s = lock_session(session)?;
        let out = out_ptr(out, "out")?;
        let Some(run) = &s.run else { return err(Status::State, "no generation yet: call dflash2_session_feed first") };
        let st = s.final_stats.clone().unwrap_or_else(|| run.stats());
        *out = CStats {
            n_prompt: st.n_prompt as u64,
            n_prompt_decoded: st.n_prompt_decoded as u64,
            n_generated: st.n_generated as u64,
            cycles: st.cycles as u64,
            n_drafted: st.n_drafted as u64,
            n_accepted: st.n_draft_accepted as u64,
            tau: st.tau(),
            tokens_per_second: st.tokens_per_second(),
            prefill_ms: st.prefill_ms,
            draft_ms: st.draft_ms,
            verify_ms: st.verify_ms,
            host_ms: st.host_ms,
            total_ms: st.total_ms,
            finish: finish_code(run.finish()),
        };
        Ok(())
    })
}

/// # Safety
/// See `dflash2_session_reset` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_session_reset(session: *mut SessionHandle) -> Status {
    guard(|| {
        let mut s = lock_session(session)?;
        s.run = None;
        s.emitted = 0;
        s.final_stats = None;
        s.engine.reset().map_err(Into::into)
    })
}
