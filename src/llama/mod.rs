//! The binding layer: the only module with `unsafe`.
//!
//! llama-cpp-2 keeps its model and context pointers private, so the handles that the
//! DFlash calls need are owned here over llama-cpp-sys-2. llama-cpp-2 still serves
//! alongside for what it does well: initialising the backend once per process and
//! routing llama.cpp's log through `tracing`.
//!
//! Every raw pointer lives in a type that frees it on drop; callers see safe methods.

mod batch;
mod chat;
mod context;
mod grammar;
mod model;
mod sampler;
mod shim;
mod threads;
mod upstream;

pub use batch::Batch;
pub use chat::{AnswerParser, ChatRender, LlamaChat, Split};
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
static OP_KERNELS_ON: [AtomicBool; OpKernel::ALL.len()] = [const { AtomicBool::new(false) }; OpKernel::ALL.len()];
const TILED_MM: &str = "GGML_CPU_TILED_MM";

/// Environment switches that give ggml's own kernels back in place of dflash2's (for A/B
/// measurements): the few-row AMX products and each [`OpKernel`].
pub const NO_FEW_ROW_KERNELS: &str = "DFLASH2_NO_FEW_ROW_KERNELS";
pub const NO_F16_ATTENTION: &str = "DFLASH2_NO_F16_ATTENTION";
pub const NO_Q5_0_ROWS: &str = "DFLASH2_NO_Q5_0_ROWS";
pub const NO_Q4_0X8_ROWS: &str = "DFLASH2_NO_Q4_0X8_ROWS";
pub const NO_Q4_KX8_ROWS: &str = "DFLASH2_NO_Q4_KX8_ROWS";
pub const NO_IQ4_NLX8_ROWS: &str = "DFLASH2_NO_IQ4_NLX8_ROWS";
pub const NO_Q2_KX8_ROWS: &str = "DFLASH2_NO_Q2_KX8_ROWS";
pub const NO_Q4_1_ROWS: &str = "DFLASH2_NO_Q4_1_ROWS";
pub const NO_KQUANT_ROWS: &str = "DFLASH2_NO_KQUANT_ROWS";
pub const NO_DRAFTER_OPS: &str = "DFLASH2_NO_DRAFTER_OPS";
pub const NO_Q8_0_ATTENTION: &str = "DFLASH2_NO_Q8_0_ATTENTION";
pub const NO_Q8_0_ROWS: &str = "DFLASH2_NO_Q8_0_ROWS";
pub const NO_DRAFTER_ROWS: &str = "DFLASH2_NO_DRAFTER_ROWS";
pub const NO_DRAFTER_CONV: &str = "DFLASH2_NO_DRAFTER_CONV";
/// Every switch of a kernel that a target can run: they change the kernels of its probe, so the
/// probe cache keys on them (a drafter's integer products, [`OpKernel::DrafterRows`], never run
/// for a target).
pub const KERNEL_SWITCHES: &[&str] =
    &[NO_FEW_ROW_KERNELS, NO_F16_ATTENTION, NO_Q5_0_ROWS, NO_Q4_0X8_ROWS, NO_Q4_KX8_ROWS, NO_IQ4_NLX8_ROWS, NO_Q2_KX8_ROWS, NO_Q4_1_ROWS, NO_KQUANT_ROWS, NO_DRAFTER_CONV, NO_DRAFTER_OPS, NO_Q8_0_ATTENTION, NO_Q8_0_ROWS];

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

/// dflash2's kernels for ops of every model, plugged into ggml's CPU backend (vendor/cpu_extra.h):
/// each computes its outputs as ggml's own kernel rounds them, only faster (all but
/// [`OpKernel::DrafterRows`], which runs for a drafter's weights alone), and can be switched off for
/// the whole process (for comparisons) by its environment switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKernel {
    /// Attention over an f16 cache without flash attention (vendor/f16_attention.cpp): each cache
    /// row converted once for the queries that read it. Built for AVX-512.
    F16Attention,
    /// Products of Q5_0 weights (vendor/quant_rows.cpp): for several activation rows each weight
    /// block unpacked once for up to four of them, four weight rows side by side; for one, the
    /// weights streamed a row at a time. Built for AVX512-VNNI.
    Q5_0Rows,
    /// Products of 2 or more rows with the Q4_0 weights ggml repacks into 8-column runs on AVX2 CPUs
    /// (vendor/q4_x8_rows.cpp): 16 columns to a register, each block unpacked once for up to 8
    /// rows (a verify's). It sits in front of ggml's traits of the weights that a target load puts
    /// it before (`Model::load`); one row stays ggml's. Built for AVX512-VNNI.
    Q4_0x8Rows,
    /// Products of any number of rows with the Q4_K weights ggml repacks into 8-column runs on AVX2
    /// CPUs (vendor/kx8_rows.cpp), every row rounded as ggml's single-row gemv rounds it (its
    /// 4-row gemm does not): each run unpacked once for up to 8 rows, 16 products a lane in one
    /// vpdpbusd chain, one vpdpwssd for the sub-block's scale. With it the probe keeps Q4_K_M
    /// targets repacked. It sits in front of ggml's traits of the weights that a target load puts it
    /// before (`Model::load`). Built for AVX512-VNNI.
    Q4Kx8Rows,
    /// Products of 2 or more rows with the IQ4_NL weights ggml repacks into 8-column runs on AVX2
    /// CPUs (vendor/q4_x8_rows.cpp, as [`OpKernel::Q4_0x8Rows`], the weights from IQ4_NL's table):
    /// IQ4_XS files keep the weights whose width is no multiple of 256 in IQ4_NL. One row stays
    /// ggml's. Built for AVX512-VNNI.
    Iq4NlX8Rows,
    /// Products of any number of rows with the Q2_K weights ggml repacks into 8-column runs on
    /// AVX-512 CPUs (vendor/kx8_rows.cpp, as [`OpKernel::Q4Kx8Rows`]): the bulk of Q2_K files.
    /// Built for AVX512-VNNI.
    Q2Kx8Rows,
    /// Products of Q4_1 and Q5_1 weights (vendor/quant_rows.cpp, as [`OpKernel::Q5_0Rows`], the
    /// blocks' minimums added as ggml adds them): SmolLM2's Q4_1 on AVX2 CPUs without AMX, where
    /// ggml has no repacked layout for them, and Q5_K_M files' fallback for widths that are no
    /// multiple of 256. Built for AVX512-VNNI.
    Q4_1Rows,
    /// Products of the Q4_K, Q5_K, Q6_K and IQ4_XS weights ggml keeps unrepacked (vendor/kquant_rows.cpp):
    /// each superblock unpacked once for up to 8 rows, one vpdpbusd and one vpdpwssd per 64
    /// weights, a plain step's single row included. Every Q4_K_M and Q5_K_M file has Q6_K tensors
    /// (the output head of tied-embedding files). Built for AVX512-VNNI.
    KQuantRows,
    /// The DFlash 2 drafter's convolutions, each computed at its last add from its per-tap weights
    /// and hidden rows (vendor/drafter_conv.cpp); the 13 ops between them are skipped, with their
    /// barriers.
    DrafterConv,
    /// The DFlash drafter graph's fills of narrow rows, zero pads, vocabulary-wide top-k, scatters
    /// of narrow rows, repeats and broadcast adds and multiplies (vendor/drafter_ops.cpp), which
    /// ggml runs element by element or row by row.
    DrafterOps,
    /// Flash attention over a q8_0 cache, a DFlash drafter's (vendor/q8_0_attention.cpp): the
    /// query rows of a KV head through the cells together, each cell widened once. Built for
    /// AVX512-VNNI.
    Q8_0Attention,
    /// Products of Q8_0 weights (a DFlash drafter's) that ggml's AMX backend does not hold
    /// (vendor/quant_rows.cpp, as [`OpKernel::Q5_0Rows`]). Built for AVX512-VNNI.
    Q8_0Rows,
    /// Products of a DFlash drafter's Q8_0 weights in integers (vendor/drafter_rows.cpp): each
    /// weight row requantized once to bytes with one scale, each activation row to bytes with one
    /// scale, one exact integer sum per output. Not ggml's rounding: only the weights a
    /// drafter's context adopts ([`ContextParams::integer_products`]) go through it, never a
    /// target's, whose outputs must be ggml's. Built for AVX512-VNNI.
    DrafterRows,
}

impl OpKernel {
    /// In the order ggml asks them whether they take an op: the drafter's convolutions before the
    /// drafter ops that take some of their ops, the drafter's integer products before the Q8_0
    /// products that would take the same weights. ([`OpKernel::Q4_0x8Rows`],
    /// [`OpKernel::Q4Kx8Rows`], [`OpKernel::Iq4NlX8Rows`] and [`OpKernel::Q2Kx8Rows`] are not asked:
    /// they sit in front of the traits ggml keeps with each repacked weight.)
    pub const ALL: [OpKernel; 13] = [
        OpKernel::F16Attention,
        OpKernel::Q5_0Rows,
        OpKernel::Q4_0x8Rows,
        OpKernel::Q4Kx8Rows,
        OpKernel::Iq4NlX8Rows,
        OpKernel::Q2Kx8Rows,
        OpKernel::Q4_1Rows,
        OpKernel::KQuantRows,
        OpKernel::DrafterConv,
        OpKernel::DrafterOps,
        OpKernel::Q8_0Attention,
        OpKernel::DrafterRows,
        OpKernel::Q8_0Rows,
    ];

    /// What the kernel computes, for reports.
    pub fn what(self) -> &'static str {
        match self {
            OpKernel::F16Attention => "attention over an f16 cache",
            OpKernel::Q5_0Rows => "products of Q5_0 weights",
            OpKernel::Q4_0x8Rows => "products of repacked Q4_0 weights with several rows",
            OpKernel::Q4Kx8Rows => "products of repacked Q4_K weights",
            OpKernel::Iq4NlX8Rows => "products of repacked IQ4_NL weights with several rows",
            OpKernel::Q2Kx8Rows => "products of repacked Q2_K weights",
            OpKernel::Q4_1Rows => "products of Q4_1 and Q5_1 weights",
            OpKernel::KQuantRows => "products of unrepacked Q4_K, Q5_K, Q6_K and IQ4_XS weights",
            OpKernel::DrafterConv => "a DFlash 2 drafter's convolutions as one op each",
            OpKernel::DrafterOps => "a DFlash drafter's fills, pads, top-k, scatters, repeats and broadcasts",
            OpKernel::Q8_0Attention => "flash attention over a q8_0 cache",
            OpKernel::Q8_0Rows => "products of Q8_0 weights",
            OpKernel::DrafterRows => "a drafter's Q8_0 products in integers",
        }
    }

    /// Its name in JSON reports.
    pub fn key(self) -> &'static str {
        match self {
            OpKernel::F16Attention => "f16_attention",
            OpKernel::Q5_0Rows => "q5_0_rows",
            OpKernel::Q4_0x8Rows => "q4_0x8_rows",
            OpKernel::Q4Kx8Rows => "q4_kx8_rows",
            OpKernel::Iq4NlX8Rows => "iq4_nlx8_rows",
            OpKernel::Q2Kx8Rows => "q2_kx8_rows",
            OpKernel::Q4_1Rows => "q4_1_rows",
            OpKernel::KQuantRows => "kquant_rows",
            OpKernel::DrafterConv => "drafter_conv",
            OpKernel::DrafterOps => "drafter_ops",
            OpKernel::Q8_0Attention => "q8_0_attention",
            OpKernel::Q8_0Rows => "q8_0_rows",
            OpKernel::DrafterRows => "drafter_rows",
        }
    }

    /// The environment variable that leaves ggml's own kernel in its place.
    pub fn switch(self) -> &'static str {
        match self {
            OpKernel::F16Attention => NO_F16_ATTENTION,
            OpKernel::Q5_0Rows => NO_Q5_0_ROWS,
            OpKernel::Q4_0x8Rows => NO_Q4_0X8_ROWS,
            OpKernel::Q4Kx8Rows => NO_Q4_KX8_ROWS,
            OpKernel::Iq4NlX8Rows => NO_IQ4_NLX8_ROWS,
            OpKernel::Q2Kx8Rows => NO_Q2_KX8_ROWS,
            OpKernel::Q4_1Rows => NO_Q4_1_ROWS,
            OpKernel::KQuantRows => NO_KQUANT_ROWS,
            OpKernel::DrafterConv => NO_DRAFTER_CONV,
            OpKernel::DrafterOps => NO_DRAFTER_OPS,
            OpKernel::Q8_0Attention => NO_Q8_0_ATTENTION,
            OpKernel::Q8_0Rows => NO_Q8_0_ROWS,
            OpKernel::DrafterRows => NO_DRAFTER_ROWS,
        }
    }

    /// Turns the kernel on or off for the whole process (off gives ggml's own back), so only while
    /// no decode runs in the process. Returns whether it is on: false where this build has no
    /// such kernel (the CPU lacks what it is built for).
    pub fn set(self, on: bool) -> bool {
        let state = unsafe {
            match self {
                OpKernel::F16Attention => shim::dflash2_set_f16_attention(on),
                OpKernel::Q5_0Rows => shim::dflash2_set_q5_0_rows(on),
                OpKernel::Q4_0x8Rows => shim::dflash2_set_q4_0x8_rows(on),
                OpKernel::Q4Kx8Rows => shim::dflash2_set_q4_kx8_rows(on),
                OpKernel::Iq4NlX8Rows => shim::dflash2_set_iq4_nlx8_rows(on),
                OpKernel::Q2Kx8Rows => shim::dflash2_set_q2_kx8_rows(on),
                OpKernel::Q4_1Rows => shim::dflash2_set_q4_1_rows(on),
                OpKernel::KQuantRows => shim::dflash2_set_kquant_rows(on),
                OpKernel::DrafterConv => shim::dflash2_set_drafter_conv(on),
                OpKernel::DrafterOps => shim::dflash2_set_drafter_ops(on),
                OpKernel::Q8_0Attention => shim::dflash2_set_q8_0_attention(on),
                OpKernel::Q8_0Rows => shim::dflash2_set_q8_0_rows(on),
                OpKernel::DrafterRows => shim::dflash2_set_drafter_rows(on),
            }
        };
        OP_KERNELS_ON[self as usize].store(state == 1, Ordering::Relaxed);
        state == 1
    }

    /// Runs every op the kernel takes on random inputs drawn from `seed` (the shapes the kernel's
    /// C entry lists) through ggml's kernel and through this one on `threads` threads, and counts
    /// the outputs whose bits differ (0: they agree); for [`OpKernel::DrafterRows`], which does not
    /// round as ggml does, those that differ from its own scheme taken one product at a time or lie
    /// beyond its error bound. None for the kernels checked on real models only (tests/op_kernels.rs). Switches the kernel process-wide meanwhile, so only while no
    /// decode runs in the process; leaves it as it was.
    pub fn differences(self, seed: u32, threads: i32) -> Option<std::result::Result<u64, String>> {
        init_backend();
        let n = unsafe {
            match self {
                OpKernel::DrafterConv => shim::dflash2_drafter_conv_differences(seed, threads),
                OpKernel::DrafterOps => shim::dflash2_drafter_ops_differences(seed, threads),
                OpKernel::Q8_0Attention => shim::dflash2_q8_0_attention_differences(seed, threads),
                OpKernel::Q5_0Rows => shim::dflash2_q5_0_rows_differences(seed, threads),
                OpKernel::Q4_0x8Rows => shim::dflash2_q4_0x8_rows_differences(seed, threads),
                OpKernel::Q4Kx8Rows => shim::dflash2_q4_kx8_rows_differences(seed, threads),
                OpKernel::Iq4NlX8Rows => shim::dflash2_iq4_nlx8_rows_differences(seed, threads),
                OpKernel::Q2Kx8Rows => shim::dflash2_q2_kx8_rows_differences(seed, threads),
                OpKernel::Q4_1Rows => shim::dflash2_q4_1_rows_differences(seed, threads),
                OpKernel::KQuantRows => shim::dflash2_kquant_rows_differences(seed, threads),
                OpKernel::Q8_0Rows => shim::dflash2_q8_0_rows_differences(seed, threads),
                // Not ggml's rounding: the outputs beyond the kernel's error bound.
                OpKernel::DrafterRows => shim::dflash2_drafter_rows_excess(seed, threads),
                OpKernel::F16Attention => return None,
            }
        };
        Some(match n {
            -1 => Err(format!("this build has no {} kernel", self.key())),
            -2 => Err(format!("the {} kernel does not take one of its checks' ops", self.key())),
            n if n < 0 => Err(format!("the {} check failed ({n})", self.key())),
            n => Ok(n as u64),
        })
    }

    /// Whether every output is the value ggml's own kernel gives it (all but the drafter's integer
    /// products, which only a drafter's weights go through).
    pub fn rounds_as_ggml(self) -> bool {
        self != OpKernel::DrafterRows
    }

    /// How much the kernel has taken in this process, for the kernels that count it (None for the
    /// others): [`OpKernel::DrafterRows`] the drafter weights it multiplied (once per weight and
    /// adoption; 0 where none went through it: a CPU without VNNI, or ggml's AMX backend holds the
    /// drafter's weights), [`OpKernel::DrafterConv`] the convolutions it computed,
    /// [`OpKernel::Q4_0x8Rows`], [`OpKernel::Q4Kx8Rows`], [`OpKernel::Iq4NlX8Rows`] and
    /// [`OpKernel::Q2Kx8Rows`] the repacked weights of loaded models they sit in front of.
    pub fn taken(self) -> Option<u64> {
        let n = match self {
            OpKernel::Q4_0x8Rows => unsafe { shim::dflash2_q4_0x8_rows_fronted() },
            OpKernel::Q4Kx8Rows => unsafe { shim::dflash2_q4_kx8_rows_fronted() },
            OpKernel::Iq4NlX8Rows => unsafe { shim::dflash2_iq4_nlx8_rows_fronted() },
            OpKernel::Q2Kx8Rows => unsafe { shim::dflash2_q2_kx8_rows_fronted() },
            OpKernel::DrafterRows => unsafe { shim::dflash2_drafter_rows_made() },
            OpKernel::DrafterConv => unsafe { shim::dflash2_drafter_conv_computed() },
            _ => return None,
        };
        Some(n.max(0) as u64)
    }

    /// Whether the kernel computes this process's ops of its kind.
    pub fn is_on(self) -> bool {
        OP_KERNELS_ON[self as usize].load(Ordering::Relaxed)
    }
}

/// Plugs dflash2's op kernels into ggml's CPU backend, once per process, each on unless its
/// environment switch is set (registered either way, so that ggml asks them in [`OpKernel::ALL`]'s
/// order whichever is switched on later). ggml's list of such kernels is not guarded against computations
/// running meanwhile, so this runs when dflash2 loads a target of its own
/// (`crate::target::load_target`, `inspect`), never from the frontend ABI, whose frontend may be
/// decoding on other threads.
pub fn install_kernels() {
    init_backend();
    KERNELS.call_once(|| {
        for kernel in OpKernel::ALL {
            kernel.set(std::env::var_os(kernel.switch()).is_none());
        }
    });
}
