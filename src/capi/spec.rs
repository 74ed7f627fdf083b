//! The frontend ABI (`dflash2_spec_*` in `ffi/dflash2.h`): a DFlash 2 speculator attached to
//! a llama.cpp frontend's own model and context, over [`Speculator`]. Same rules as the
//! engine ABI: validated arguments, a status and a message, no panic across.
use super::{check_tokens, err, free_handle, guard, non_null, out_buf, out_ptr, select_mode, slice, Error, Result, Status};
use crate::draft::config::{Block, DraftConfig};
use crate::llama::{Capture, Context, FeatureSource, ForeignChain, LlamaError, Model};
use crate::speculator::{check_drafter_for, load_drafter_for, BatchRow, ChainVerify, SpecError, SpecOptions, Speculator};
use llama_cpp_sys_2 as sys;
use std::ffi::{c_char, c_void};
use std::path::Path;
use std::sync::{Arc, Mutex, TryLockError};

/// `dflash2_spec_params`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CSpecParams {
    pub block_size: u32,
    pub select: i32,
    pub tree_budget: u32,
    pub temperature: f32,
    pub seed: u64,
    pub n_threads: i32,
    pub capture: *mut SpecCaptureHandle,
}

/// `dflash2_spec_abi`: what the frontend's compiler and linker saw of llama.h.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CSpecAbi {
    pub sizeof_context_params: usize,
    pub sizeof_model_params: usize,
    pub sizeof_batch: usize,
    pub sizeof_token_data_array: usize,
    pub backend_init: Option<unsafe extern "C" fn()>,
}

/// `dflash2_spec_stats`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CSpecStats {
    pub cycles: u64,
    pub drafts: u64,
    pub n_drafted: u64,
    pub n_accepted: u64,
    pub tau: f64,
    pub draft_ms: f64,
}

/// `dflash2_spec_info`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CSpecInfo {
    pub n_seq: u32,
    pub trained_block: u32,
    pub feature_width: u64,
    pub feature_source: i32,
    pub n_feature_layers: u32,
    pub feature_layers: [i32; MAX_FEATURE_LAYERS],
}

pub const MAX_FEATURE_LAYERS: usize = 16;
pub const FEATURES_FEED: i32 = 0;
pub const FEATURES_NATIVE: i32 = 1;
pub const FEATURES_CALLBACK: i32 = 2;

/// `dflash2_spec_capture`: the layer-input capture a frontend installs as `cb_eval`.
pub struct SpecCaptureHandle {
    capture: Arc<Capture>,
    layers: Vec<i32>,
}

/// `dflash2_spec`. The mutex turns concurrent calls into `DFLASH2_ERR_BUSY`.
pub struct SpecHandle {
    state: Mutex<Speculator>,
}

impl From<SpecError> for Error {
    fn from(e: SpecError) -> Self {
        let status = match &e {
            SpecError::Llama(LlamaError::LoadModel { .. }) | SpecError::Gguf(_) => Status::Model,
            SpecError::Llama(LlamaError::ContextFull { .. }) => Status::Context,
            SpecError::Llama(LlamaError::Tokenize(_) | LlamaError::Invalid(_)) | SpecError::Invalid(_) => Status::InvalidArg,
            SpecError::Llama(LlamaError::Capture(_)) | SpecError::State(_) => Status::State,
            SpecError::Llama(_) => Status::Llama,
            SpecError::Mismatch { .. } => Status::Mismatch,
        };
        Error { status, message: e.to_string() }
    }
}

fn lock<'a>(spec: *const SpecHandle) -> Result<std::sync::MutexGuard<'a, Speculator>> {
    let s: &'a SpecHandle = non_null(spec, "spec")?;
    s.state.try_lock().or_else(|e| match e {
        TryLockError::WouldBlock => err(Status::Busy, "the speculator is in use by another call"),
        TryLockError::Poisoned(_) => err(Status::Panic, "the speculator failed with an internal error earlier: free it"),
    })
}

fn path_arg<'a>(p: *const c_char, name: &str) -> Result<&'a Path> {
    Ok(Path::new(super::c_str(p, name)?))
}

/// A count, position or index the header declares signed: negative is an argument error naming it.
fn non_negative(v: i32, name: &str) -> Result<usize> {
    usize::try_from(v).or_else(|_| err(Status::InvalidArg, format!("{name} is {v}")))
}

/// Batch-row indices from the caller, each non-negative.
fn row_indices(rows: &[i32]) -> Result<Vec<usize>> {
    rows.iter().map(|&r| non_negative(r, "a row")).collect()
}

/// The target model behind a frontend's pointer (used, never freed).
unsafe fn attach_model(target: *mut sys::llama_model) -> Result<Arc<Model>> {
    if target.is_null() {
        return err(Status::NullArg, "target is NULL");
    }
    Ok(Arc::new(Model::borrow_raw(target, "the frontend's target")?))
}

#[no_mangle]
pub extern "C" fn dflash2_spec_default_params() -> CSpecParams {
    CSpecParams {
        block_size: 0,
        select: super::SELECT_GREEDY,
        tree_budget: 32,
        temperature: 0.0,
        seed: 0,
        n_threads: 0,
        capture: std::ptr::null_mut(),
    }
}

/// # Safety
/// See `dflash2_spec_abi_check` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_abi_check(abi: *const CSpecAbi) -> Status {
    guard(|| {
        let abi = non_null(abi, "abi")?;
        let ours = [
            ("llama_context_params", abi.sizeof_context_params, std::mem::size_of::<sys::llama_context_params>()),
            ("llama_model_params", abi.sizeof_model_params, std::mem::size_of::<sys::llama_model_params>()),
            ("llama_batch", abi.sizeof_batch, std::mem::size_of::<sys::llama_batch>()),
            ("llama_token_data_array", abi.sizeof_token_data_array, std::mem::size_of::<sys::llama_token_data_array>()),
        ];
        for (name, theirs, ours) in ours {
            if theirs != ours {
                return err(
                    Status::Mismatch,
                    format!(
                        "struct {name} is {theirs} bytes in the frontend's llama.h and {ours} in the libllama dflash2 was \
                         built with: compile against the llama.h of that build (README.md, \"Adding DFlash 2 to an existing llama.cpp frontend\")"
                    ),
                );
            }
        }
        let theirs = abi.backend_init.map(|f| f as usize);
        let ours = sys::llama_backend_init as unsafe extern "C" fn() as usize;
        if theirs != Some(ours) {
            return err(
                Status::Mismatch,
                "the frontend calls another copy of libllama than dflash2 does: link both against one libllama \
                 (libdflash2.a carries one; see \"Adding DFlash 2 to an existing llama.cpp frontend\" in README.md)",
            );
        }
        Ok(())
    })
}

/// # Safety
/// See `dflash2_spec_capture_new` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_capture_new(
    target: *mut sys::llama_model,
    drafter_path: *const c_char,
    cparams: *mut sys::llama_context_params,
    out: *mut *mut SpecCaptureHandle,
) -> Status {
    guard(|| {
        let out = out_ptr(out, "out")?;
        *out = std::ptr::null_mut();
        let cparams = out_ptr(cparams, "cparams")?;
        let path = path_arg(drafter_path, "drafter_path")?;
        let model = attach_model(target)?;
        let info = check_drafter_for(&model, path)?;
        let layers: Vec<i32> =
            info.dflash.as_ref().map(|d| d.target_layers.iter().map(|&l| l as i32).collect()).unwrap_or_default();
        let capture = Capture::new(&layers, model.n_embd())?;
        capture.install(cparams);
        *out = Box::into_raw(Box::new(SpecCaptureHandle { capture: Arc::new(capture), layers }));
        Ok(())
    })
}

/// # Safety
/// See `dflash2_spec_capture_free` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_capture_free(capture: *mut SpecCaptureHandle) {
    // SAFETY: made by Box::into_raw in dflash2_spec_capture_new, freed once (header contract).
    unsafe { free_handle(capture) }
}

/// # Safety
/// See `dflash2_spec_capture_eval` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_capture_eval(t: *mut sys::ggml_tensor, ask: bool, user_data: *mut c_void) -> bool {
    if user_data.is_null() || t.is_null() {
        return !ask;
    }
    // `user_data`: what dflash2_spec_capture_new put in cparams.cb_eval_user_data.
    crate::llama::capture_eval(t, ask, user_data)
}

/// # Safety
/// See `dflash2_spec_init` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_init(
    target: *mut sys::llama_model,
    ctx_tgt: *mut sys::llama_context,
    drafter_path: *const c_char,
    params: *const CSpecParams,
    n_seq: u32,
    out: *mut *mut SpecHandle,
) -> Status {
    guard(|| {
        let out = out_ptr(out, "out")?;
        *out = std::ptr::null_mut();
        let p = *non_null(params, "params")?;
        let path = path_arg(drafter_path, "drafter_path")?;
        if ctx_tgt.is_null() {
            return err(Status::NullArg, "ctx_tgt is NULL");
        }
        if !(0.0..=100.0).contains(&p.temperature) {
            return err(Status::InvalidArg, format!("temperature is {}, expected 0..=100", p.temperature));
        }
        if p.tree_budget == 0 {
            return err(Status::InvalidArg, "tree_budget is 0");
        }
        let n_threads = match p.n_threads {
            0 => crate::engine::default_threads(),
            n if n > 0 => n,
            n => return err(Status::InvalidArg, format!("n_threads is {n}")),
        };
        let block = match p.block_size {
            0 => Block::Auto,
            n => Block::Fixed(n as usize),
        };
        let draft = DraftConfig { select: select_mode(p.select)?, block, tree_budget: p.tree_budget as usize, ..DraftConfig::default() };
        let opts = SpecOptions {
            draft,
            temperature: p.temperature,
            seed: p.seed,
            n_threads,
        };
        let model = attach_model(target)?;
        let drafter = load_drafter_for(&model, path)?;
        let layers = drafter.target_layer_ids();
        let (features, capture) = match p.capture.as_ref() {
            Some(c) => {
                if c.layers != layers {
                    return err(Status::Mismatch, "the capture was made for another drafter's layers");
                }
                (FeatureSource::Callback(layers), Some(c.capture.clone()))
            }
            None if FeatureSource::has_native(&model.architecture()) => (FeatureSource::Native(layers), None),
            None => (FeatureSource::None, None),
        };
        let target_ctx = Context::borrow_raw(model, ctx_tgt, features, capture)?;
        let spec = Speculator::new(target_ctx, drafter, n_seq as usize, opts)?;
        *out = Box::into_raw(Box::new(SpecHandle { state: Mutex::new(spec) }));
        Ok(())
    })
}

/// # Safety
/// See `dflash2_spec_free` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_free(spec: *mut SpecHandle) {
    // SAFETY: made by Box::into_raw in dflash2_spec_init, freed once (header contract).
    unsafe { free_handle(spec) }
}

/// # Safety
/// See `dflash2_spec_info` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_get_info(spec: *const SpecHandle, out: *mut CSpecInfo) -> Status {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let s = lock(spec)?;
        let layers = s.feature_layers();
        let mut feature_layers = [0i32; MAX_FEATURE_LAYERS];
        for (d, &l) in feature_layers.iter_mut().zip(layers) {
            *d = l;
        }
        *out = CSpecInfo {
            n_seq: s.n_seq() as u32,
            trained_block: s.trained_block() as u32,
            feature_width: s.feature_width() as u64,
            feature_source: match s.target().features() {
                FeatureSource::None => FEATURES_FEED,
                FeatureSource::Native(_) => FEATURES_NATIVE,
                FeatureSource::Callback(_) => FEATURES_CALLBACK,
            },
            n_feature_layers: layers.len().min(MAX_FEATURE_LAYERS) as u32,
            feature_layers,
        };
        Ok(())
    })
}

/// # Safety
/// See `dflash2_spec_begin` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_begin(spec: *mut SpecHandle, seq: i32) -> Status {
    guard(|| Ok(lock(spec)?.begin(seq)?))
}

/// # Safety
/// See `dflash2_spec_seq_rm` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_seq_rm(spec: *mut SpecHandle, seq: i32, p0: i32) -> Status {
    guard(|| Ok(lock(spec)?.seq_rm(seq, i64::from(p0))?))
}

/// The rows of a frontend's batch: positions and sequences as llama.cpp reads them (a batch
/// without positions, as `llama_batch_get_one` makes, is sequence 0 continuing its cache).
unsafe fn batch_rows(s: &Speculator, b: &sys::llama_batch) -> Result<Vec<BatchRow>> {
    let n = usize::try_from(b.n_tokens).ok().filter(|&n| n > 0).ok_or_else(|| Error {
        status: Status::InvalidArg,
        message: format!("batch.n_tokens is {}", b.n_tokens),
    })?;
    let seqs = |i: usize| -> Vec<i32> {
        if b.seq_id.is_null() || b.n_seq_id.is_null() {
            return vec![0];
        }
        let k = (*b.n_seq_id.add(i)).max(0) as usize;
        let ids = *b.seq_id.add(i);
        if ids.is_null() {
            return vec![0];
        }
        std::slice::from_raw_parts(ids, k).to_vec()
    };
    let rows = if b.pos.is_null() {
        // llama.cpp placed the rows after what sequence 0 held: they now end its cache.
        let end = s.target().seq_pos_max(0);
        if end + 1 < n as i32 {
            return err(Status::State, "a batch without positions, but sequence 0 holds fewer cells than its rows");
        }
        (0..n).map(|i| BatchRow { pos: (end + 1) as usize - n + i, seqs: seqs(i) }).collect()
    } else {
        (0..n)
            .map(|i| Ok(BatchRow { pos: non_negative(*b.pos.add(i), &format!("batch.pos[{i}]"))?, seqs: seqs(i) }))
            .collect::<Result<_>>()?
    };
    Ok(rows)
}

/// # Safety
/// See `dflash2_spec_process` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_process(spec: *mut SpecHandle, batch: *const sys::llama_batch) -> Status {
    guard(|| {
        let mut s = lock(spec)?;
        let b = non_null(batch, "batch")?;
        if matches!(s.target().features(), FeatureSource::None) {
            return err(
                Status::State,
                format!(
                    "llama.cpp has no layer-input extraction for {} targets: install the capture \
                     (dflash2_spec_capture_new) before creating the context, or pass features with dflash2_spec_feed",
                    s.target().model().architecture()
                ),
            );
        }
        let rows = batch_rows(&s, b)?;
        Ok(s.process(&rows)?)
    })
}

/// # Safety
/// See `dflash2_spec_feed` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_feed(spec: *mut SpecHandle, seq: i32, pos0: i32, n: i32, rows: *const f32) -> Status {
    guard(|| {
        let mut s = lock(spec)?;
        let pos0 = non_negative(pos0, "pos0")?;
        let n = non_negative(n, "n")?;
        let width = s.feature_width();
        let rows = slice(rows, n * width, "rows", "n")?;
        Ok(s.feed(seq, pos0, rows)?)
    })
}

/// # Safety
/// See `dflash2_spec_draft` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_draft(
    spec: *mut SpecHandle,
    seq: i32,
    last: i32,
    pos: i32,
    out: *mut i32,
    capacity: usize,
    n_out: *mut usize,
) -> Status {
    draft_into(spec, seq, last, pos, out, std::ptr::null_mut(), capacity, n_out, false)
}

/// # Safety
/// See `dflash2_spec_draft_tree` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_draft_tree(
    spec: *mut SpecHandle,
    seq: i32,
    last: i32,
    pos: i32,
    tokens: *mut i32,
    parents: *mut i32,
    capacity: usize,
    n_out: *mut usize,
) -> Status {
    draft_into(spec, seq, last, pos, tokens, parents, capacity, n_out, true)
}

#[allow(clippy::too_many_arguments)]
unsafe fn draft_into(
    spec: *mut SpecHandle,
    seq: i32,
    last: i32,
    pos: i32,
    tokens: *mut i32,
    parents: *mut i32,
    capacity: usize,
    n_out: *mut usize,
    tree: bool,
) -> Status {
    guard(|| {
        let n_out = out_ptr(n_out, "n_out")?;
        *n_out = 0;
        let mut s = lock(spec)?;
        check_tokens(s.target().model(), &[last])?;
        let pos = non_negative(pos, "pos")?;
        let tokens = out_buf(tokens, capacity, "tokens")?;
        let mut parents = if tree { Some(out_buf(parents, capacity, "parents")?) } else { None };
        if capacity == 0 {
            return err(Status::InvalidArg, "capacity is 0: room for the drafted tokens is needed");
        }
        if !tree && s.tree_mode() {
            return err(Status::State, "select is DFLASH2_SELECT_TREE: draft with dflash2_spec_draft_tree");
        }
        // The buffer bounds the draft (a frontend passes what its output and context leave).
        let draft = s.draft(seq, last, pos, capacity)?;
        for (k, node) in draft.nodes.iter().enumerate() {
            tokens[k] = node.token;
            if let Some(p) = parents.as_deref_mut() {
                p[k] = node.parent.map_or(-1, |i| i as i32);
            }
        }
        *n_out = draft.len();
        Ok(())
    })
}

/// # Safety
/// See `dflash2_spec_accept` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_accept(spec: *mut SpecHandle, seq: i32, n_accepted: i32) -> Status {
    guard(|| {
        let n = non_negative(n_accepted, "n_accepted")?;
        Ok(lock(spec)?.accept(seq, n)?)
    })
}

/// # Safety
/// See `dflash2_spec_accept_rows` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_accept_rows(spec: *mut SpecHandle, seq: i32, rows: *const i32, n: i32) -> Status {
    guard(|| {
        let n = non_negative(n, "n")?;
        let rows = slice(rows, n, "rows", "n")?;
        let rows = row_indices(rows)?;
        Ok(lock(spec)?.accept_rows(seq, &rows)?)
    })
}

/// # Safety
/// See `dflash2_spec_report_verify` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_report_verify(spec: *mut SpecHandle, n_tokens: i32, ms: f64) -> Status {
    guard(|| {
        let n = non_negative(n_tokens, "n_tokens")?;
        Ok(lock(spec)?.report_verify(n, ms)?)
    })
}

/// # Safety
/// See `dflash2_spec_get_stats` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_spec_get_stats(spec: *const SpecHandle, seq: i32, out: *mut CSpecStats) -> Status {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let st = lock(spec)?.stats(seq)?;
        *out = CSpecStats {
            cycles: st.cycles,
            drafts: st.drafts,
            n_drafted: st.drafted,
            n_accepted: st.accepted,
            tau: st.tau(),
            draft_ms: st.draft_ms,
        };
        Ok(())
    })
}

/// # Safety
/// See `dflash2_verify_greedy` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_verify_greedy(
    spec: *mut SpecHandle,
    seq: i32,
    chain: *mut sys::llama_sampler,
    ctx: *mut sys::llama_context,
    rows: *const i32,
    n_rows: i32,
    out: *mut i32,
    capacity: usize,
    n_out: *mut usize,
) -> Status {
    verify_into(spec, seq, chain, ctx, rows, n_rows, out, capacity, n_out, ChainVerify::Greedy)
}

/// # Safety
/// See `dflash2_verify_sample` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_verify_sample(
    spec: *mut SpecHandle,
    seq: i32,
    chain: *mut sys::llama_sampler,
    ctx: *mut sys::llama_context,
    rows: *const i32,
    n_rows: i32,
    out: *mut i32,
    capacity: usize,
    n_out: *mut usize,
) -> Status {
    verify_into(spec, seq, chain, ctx, rows, n_rows, out, capacity, n_out, ChainVerify::Reject)
}

/// # Safety
/// See `dflash2_verify_match` in `ffi/dflash2.h`.
#[no_mangle]
pub unsafe extern "C" fn dflash2_verify_match(
    spec: *mut SpecHandle,
    seq: i32,
    chain: *mut sys::llama_sampler,
    ctx: *mut sys::llama_context,
    rows: *const i32,
    n_rows: i32,
    out: *mut i32,
    capacity: usize,
    n_out: *mut usize,
) -> Status {
    verify_into(spec, seq, chain, ctx, rows, n_rows, out, capacity, n_out, ChainVerify::Match)
}

#[allow(clippy::too_many_arguments)]
unsafe fn verify_into(
    spec: *mut SpecHandle,
    seq: i32,
    chain: *mut sys::llama_sampler,
    ctx: *mut sys::llama_context,
    rows: *const i32,
    n_rows: i32,
    out: *mut i32,
    capacity: usize,
    n_out: *mut usize,
    how: ChainVerify,
) -> Status {
    guard(|| {
        let n_out = out_ptr(n_out, "n_out")?;
        *n_out = 0;
        let mut s = lock(spec)?;
        if ctx.is_null() {
            return err(Status::NullArg, "ctx is NULL");
        }
        if !s.target().is(ctx) {
            return err(Status::InvalidArg, "ctx is not the target context this speculator was attached to");
        }
        if chain.is_null() {
            return err(Status::NullArg, "chain is NULL");
        }
        let n_rows = non_negative(n_rows, "n_rows")?;
        let rows = slice(rows, n_rows, "rows", "n_rows")?;
        let rows = row_indices(rows)?;
        let out = out_buf(out, capacity, "out")?;
        if out.len() < rows.len() {
            *n_out = rows.len();
            return err(Status::BufferTooSmall, format!("out holds {} tokens, up to {} may be accepted", out.len(), rows.len()));
        }
        let mut chain = ForeignChain::borrow_raw(chain)?;
        let tokens = s.verify(seq, &mut chain, &rows, how)?;
        out[..tokens.len()].copy_from_slice(&tokens);
        *n_out = tokens.len();
        Ok(())
    })
}
