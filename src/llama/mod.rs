//! The binding layer: the only module with `unsafe`.
//!
//! llama-cpp-2 keeps its model and context pointers private, so the handles that the
//! DFlash calls need are owned here over llama-cpp-sys-2. llama-cpp-2 still serves
//! alongside for what it does well: initialising the backend once per process and
//! routing llama.cpp's log through `tracing`.
//!
//! Every raw pointer lives in a type that frees it on drop; callers see safe methods.

mod batch;
mod context;
mod grammar;
mod model;
mod sampler;
mod shim;
mod threads;
mod upstream;

pub use batch::Batch;
pub use context::{capture_eval, CacheType, Capture, Context, ContextParams, FeatureSource};
pub use grammar::Grammar;
pub use model::{apply_llama_template, builtin_chat_templates, quantize, ChatMessage, FimTokens, Model, ModelParams, QUANT_TYPES};
pub use sampler::{ForeignChain, Terminal};
pub use upstream::{UpstreamDrafter, LLAMA_NGRAM_TYPES};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

pub type Token = i32;

#[derive(Debug, thiserror::Error)]
pub enum LlamaError {
    #[error("cannot load model {path}: llama.cpp rejected it (see the log above for its reason)")]
    LoadModel { path: String },
    #[error("cannot create a llama.cpp context for {what}")]
    CreateContext { what: String },
    #[error("llama_decode failed with code {code} ({what})")]
    Decode { code: i32, what: &'static str },
    #[error("the context is full: {needed} positions needed, the context holds {n_ctx}")]
    ContextFull { needed: usize, n_ctx: usize },
    #[error("tokenization failed: {0}")]
    Tokenize(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("layer-input capture failed: {0}")]
    Capture(String),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, LlamaError>;

static BACKEND: Once = Once::new();
static KERNELS: Once = Once::new();
static F16_ATTENTION: AtomicBool = AtomicBool::new(false);
const TILED_MM: &str = "GGML_CPU_TILED_MM";

/// Environment switches that give ggml's own kernels back in place of dflash2's (for A/B
/// measurements): the few-row AMX products, the f16 attention.
pub const NO_FEW_ROW_KERNELS: &str = "DFLASH2_NO_FEW_ROW_KERNELS";
pub const NO_F16_ATTENTION: &str = "DFLASH2_NO_F16_ATTENTION";
/// Both switches: they change the kernels that run, so the probe cache keys on them.
pub const KERNEL_SWITCHES: &[&str] = &[NO_FEW_ROW_KERNELS, NO_F16_ATTENTION];

/// Whether this build of llama.cpp can offload layers to a GPU (CUDA, Metal, Vulkan builds).
pub fn gpu_offload_supported() -> bool {
    unsafe { llama_cpp_sys_2::llama_supports_gpu_offload() }
}

/// What llama.cpp was built to use on this machine (its CPU features and backends).
pub fn system_info() -> String {
    init_backend();
    let p = unsafe { llama_cpp_sys_2::llama_print_system_info() };
    if p.is_null() {
        return String::new();
    }
    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().trim().to_string()
}

/// Initialise llama.cpp's backends once per process and send its log to `tracing`,
/// so stdout carries only what the user asked for.
///
/// ggml's CPU backend takes K-quant matrix products of 8 rows or more through a tiled kernel
/// that rounds differently from the single-row kernel a plain decoding step uses (0.3-0.4 in a
/// Qwen2.5 Q4_K_M logit on an AVX-512 CPU). Its switch, `GGML_CPU_TILED_MM`, is read once per
/// process at the first matrix product, so it is turned off here, before any, unless the user
/// set it; the load-time probe (`crate::target`) then checks whatever is in effect.
pub fn init_backend() {
    BACKEND.call_once(|| {
        if std::env::var_os(TILED_MM).is_none() {
            std::env::set_var(TILED_MM, "0");
        }
        llama_cpp_2::send_logs_to_tracing(llama_cpp_2::LogOptions::default());
        // The backend lives as long as the process: models may be loaded at any time.
        if let Ok(backend) = llama_cpp_2::llama_backend::LlamaBackend::init() {
            std::mem::forget(backend);
        }
    });
}

/// Plugs dflash2's CPU kernels that serve every model into ggml's CPU backend, once per process:
/// today the kernel for attention over an f16 cache (vendor/f16_attention.cpp: each output
/// rounded as ggml's own kernel rounds it, each cache row converted once for the queries that
/// read it), unless `DFLASH2_NO_F16_ATTENTION` is set. ggml's list of such kernels is not
/// guarded against computations running meanwhile, so this runs when dflash2 loads a target of
/// its own (`crate::target::load_target`, `inspect`), never from the frontend ABI, whose frontend
/// may be decoding on other threads.
pub fn install_kernels() {
    init_backend();
    KERNELS.call_once(|| {
        if std::env::var_os(NO_F16_ATTENTION).is_none() {
            set_f16_attention(true);
        }
    });
}

/// Turns dflash2's kernel for attention over f16 caches on or off for the whole process
/// (vendor/f16_attention.cpp; off gives ggml's own back, for comparisons), so only while no
/// decode runs in the process. Returns whether it is on: false where this build has no such
/// kernel (no AVX-512).
pub fn set_f16_attention(on: bool) -> bool {
    let state = unsafe { shim::dflash2_set_f16_attention(on) };
    F16_ATTENTION.store(state == 1, Ordering::Relaxed);
    state == 1
}

/// Whether dflash2's kernel computes this process's attention over f16 caches.
pub fn f16_attention_on() -> bool {
    F16_ATTENTION.load(Ordering::Relaxed)
}
