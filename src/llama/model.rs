//! A loaded GGUF model (target or drafter) and its vocabulary.
use super::{shim, LlamaError, Result, Token};
use llama_cpp_sys_2 as sys;
use std::ffi::{CStr, CString};
use std::path::Path;
use std::ptr::NonNull;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelParams {
    /// Layers to offload to the GPU (0 = CPU only; ignored by CPU builds).
    pub n_gpu_layers: i32,
    /// llama.cpp's weight repacking (`use_extra_bufts`): interleaved layouts with their own
    /// batch kernels, which on some CPUs and types round a batch differently from one row
    /// (`crate::target` decides it for a target).
    pub repack: bool,
}

impl Default for ModelParams {
    fn default() -> Self {
        Self { n_gpu_layers: 999, repack: true }
    }
}

/// Fill-in-the-middle tokens: prefix, suffix, middle, and the repository-level pattern's
/// repository and file separators.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FimTokens {
    pub pre: Option<Token>,
    pub suf: Option<Token>,
    pub mid: Option<Token>,
    pub rep: Option<Token>,
    pub sep: Option<Token>,
}

/// One chat turn for the model's chat template.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub struct Model {
    ptr: NonNull<sys::llama_model>,
    vocab: NonNull<sys::llama_vocab>,
    path: String,
    repacked: bool,
    /// Weights whose products of 2-6 rows run the few-row AMX kernels (-1: not in this build).
    few_row_weights: i32,
    n_gpu_layers: i32,
    /// False for a frontend's model ([`Model::borrow_raw`]): it frees its own.
    owned: bool,
    /// Its numbers depend on the thread count on this machine: contexts keep theirs.
    fixed_threads: std::sync::atomic::AtomicBool,
    /// Where verify batches are not bit-exact: per batch size probed, the largest logit
    /// difference from single steps (unset where they are bit-exact).
    verify_tolerance: std::sync::OnceLock<Vec<(usize, f32)>>,
}

// llama.cpp models are immutable after loading and safe to share between threads.
unsafe impl Send for Model {}
unsafe impl Sync for Model {}

impl Drop for Model {
    fn drop(&mut self) {
        if self.owned {
            unsafe { sys::llama_model_free(self.ptr.as_ptr()) }
        }
    }
}

impl Model {
    pub fn load(path: &Path, params: &ModelParams) -> Result<Self> {
        super::init_backend();
        let shown = path.display().to_string();
        let cpath = CString::new(path.to_string_lossy().as_bytes())
            .map_err(|_| LlamaError::Invalid(format!("model path contains a NUL byte: {shown}")))?;
        let mut mp = unsafe { sys::llama_model_default_params() };
        mp.n_gpu_layers = params.n_gpu_layers;
        mp.use_extra_bufts = params.repack;
        let raw = unsafe { sys::llama_model_load_from_file(cpath.as_ptr(), mp) };
        let ptr = NonNull::new(raw).ok_or_else(|| LlamaError::LoadModel { path: shown.clone() })?;
        let vocab = unsafe { sys::llama_model_get_vocab(ptr.as_ptr()) };
        let vocab = NonNull::new(vocab as *mut sys::llama_vocab)
            .ok_or_else(|| LlamaError::LoadModel { path: shown.clone() })?;
        // Weights repacked for AMX: products of 2-6 rows (short verifies) without AMX's 32-row
        // tiles, rounding as single steps do (vendor/amx_few_rows.cpp). The environment switch
        // is for measuring them against ggml's own.
        let few_row_weights = if params.repack && std::env::var_os(super::NO_FEW_ROW_KERNELS).is_none() {
            unsafe { shim::dflash2_model_few_row_kernels(ptr.as_ptr()) }
        } else {
            0
        };
        if few_row_weights > 0 {
            tracing::debug!("{shown}: {few_row_weights} AMX weights take few-row products");
        }
        // Q4_0, IQ4_NL, Q4_K and Q2_K weights repacked into 8-column runs (AVX2 CPUs without AMX;
        // Q2_K on AVX-512): products of several rows (any number for the K-quants) through dflash2's
        // kernels while they are on ([`super::OpKernel::Q4_0x8Rows`], [`super::OpKernel::Iq4NlX8Rows`],
        // [`super::OpKernel::Q4Kx8Rows`], [`super::OpKernel::Q2Kx8Rows`]), rounding as ggml's
        // single-row gemv does.
        if params.repack {
            let fronts: [(unsafe extern "C" fn(*mut sys::llama_model) -> i32, &str); 4] = [
                (shim::dflash2_model_q4_0x8_rows, "Q4_0"),
                (shim::dflash2_model_q4_kx8_rows, "Q4_K"),
                (shim::dflash2_model_iq4_nlx8_rows, "IQ4_NL"),
                (shim::dflash2_model_q2_kx8_rows, "Q2_K"),
            ];
            for (put_in_front, kind) in fronts {
                let n = unsafe { put_in_front(ptr.as_ptr()) };
                if n > 0 {
                    tracing::debug!("{shown}: {n} repacked {kind} weights take dflash2's products of several rows");
                }
            }
        }
        Ok(Self { ptr, vocab, path: shown, repacked: params.repack, few_row_weights, n_gpu_layers: params.n_gpu_layers, owned: true, fixed_threads: Default::default(), verify_tolerance: Default::default() })
    }

    /// A model a frontend loaded and keeps: used, never freed, here.
    ///
    /// # Safety
    /// `ptr` must be a live `llama_model` of the libllama this crate links, and outlive the
    /// returned value and everything made from it.
    pub unsafe fn borrow_raw(ptr: *mut sys::llama_model, name: &str) -> Result<Self> {
        super::init_backend();
        let ptr = NonNull::new(ptr).ok_or_else(|| LlamaError::Invalid("the target model is NULL".into()))?;
        let vocab = sys::llama_model_get_vocab(ptr.as_ptr());
        let vocab = NonNull::new(vocab as *mut sys::llama_vocab)
            .ok_or_else(|| LlamaError::Invalid(format!("{name} has no vocabulary")))?;
        // Offload is the frontend's; only the drafter's own context reads this (0 = CPU).
        Ok(Self { ptr, vocab, path: name.to_string(), repacked: false, few_row_weights: 0, n_gpu_layers: -1, owned: false, fixed_threads: Default::default(), verify_tolerance: Default::default() })
    }

    /// Contexts of this model keep their thread count (the probe found that it changes the
    /// numbers here); see `threads.rs`.
    pub fn keep_thread_count(&self) {
        self.fixed_threads.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn keeps_thread_count(&self) -> bool {
        self.fixed_threads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Record that verify batches of this model stray from single steps, by up to `diffs[i].1`
    /// in a batch of `diffs[i].0` rows (measured by the invariance probe); set once.
    pub fn set_verify_tolerance(&self, mut diffs: Vec<(usize, f32)>) {
        diffs.sort_by_key(|d| d.0);
        let _ = self.verify_tolerance.set(diffs);
    }

    /// How far a row of a verify batch of `rows` rows may stray from a single step (the
    /// probe's figure for the smallest probed size at least that large, else the largest);
    /// None where batches are bit-exact.
    pub fn verify_tolerance(&self, rows: usize) -> Option<f32> {
        let diffs = self.verify_tolerance.get()?;
        let larger = diffs.iter().find(|d| d.0 >= rows).or(diffs.last());
        // a smaller batch's figure is a floor for a larger one
        let floor = diffs.iter().filter(|d| d.0 <= rows).map(|d| d.1).fold(0.0, f32::max);
        larger.map(|d| d.1.max(floor))
    }

    /// Whether this is the llama.cpp model behind `ptr`.
    pub fn is(&self, ptr: *const sys::llama_model) -> bool {
        std::ptr::eq(self.ptr.as_ptr(), ptr)
    }

    pub(super) fn as_ptr(&self) -> *mut sys::llama_model {
        self.ptr.as_ptr()
    }

    pub(super) fn vocab_ptr(&self) -> *const sys::llama_vocab {
        self.vocab.as_ptr()
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// Layers offloaded to a GPU as asked at load ([`ModelParams::n_gpu_layers`]).
    pub fn n_gpu_layers(&self) -> i32 {
        self.n_gpu_layers
    }

    /// How many weights multiply 2-6 rows with the few-row AMX kernels: 0 where none was
    /// repacked for AMX (or repacking is off), -1 where this build has no AMX.
    pub fn few_row_weights(&self) -> i32 {
        self.few_row_weights
    }

    /// Whether llama.cpp was allowed to repack the weights ([`ModelParams::repack`]).
    pub fn repacked(&self) -> bool {
        self.repacked
    }

    pub fn n_embd(&self) -> usize {
        unsafe { sys::llama_model_n_embd(self.as_ptr()) as usize }
    }

    /// Values in one attention head's K and in its V (`{arch}.attention.key_length` /
    /// `value_length`, else n_embd / n_head): a quantized KV cache stores them in whole blocks.
    pub fn head_sizes(&self) -> (usize, usize) {
        let n_head = unsafe { sys::llama_model_n_head(self.as_ptr()) }.max(1) as usize;
        let fallback = self.n_embd() / n_head;
        let arch = self.architecture();
        let read = |key: &str| {
            self.meta(&format!("{arch}.attention.{key}")).and_then(|v| v.trim().parse().ok()).unwrap_or(fallback)
        };
        (read("key_length"), read("value_length"))
    }

    pub fn n_layer(&self) -> usize {
        unsafe { sys::llama_model_n_layer(self.as_ptr()) as usize }
    }

    pub fn n_vocab(&self) -> usize {
        unsafe { sys::llama_vocab_n_tokens(self.vocab_ptr()) as usize }
    }

    /// The first token whose vocabulary entry (its text as stored, before detokenizing)
    /// differs from `other`'s, if any (same-size vocabularies).
    pub fn first_vocab_difference(&self, other: &Model) -> Option<(Token, String, String)> {
        let text = |m: &Model, t: Token| {
            let p = unsafe { sys::llama_vocab_get_text(m.vocab_ptr(), t) };
            if p.is_null() {
                return Vec::new();
            }
            unsafe { CStr::from_ptr(p) }.to_bytes().to_vec()
        };
        (0..self.n_vocab().min(other.n_vocab()) as Token).find_map(|t| {
            let (a, b) = (text(self, t), text(other, t));
            (a != b).then(|| (t, String::from_utf8_lossy(&a).into_owned(), String::from_utf8_lossy(&b).into_owned()))
        })
    }

    /// A metadata value as text (`None` when the key is absent).
    pub fn meta(&self, key: &str) -> Option<String> {
        let ckey = CString::new(key).ok()?;
        let mut buf = vec![0u8; 256];
        loop {
            let n = unsafe {
                sys::llama_model_meta_val_str(self.as_ptr(), ckey.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
            };
            if n < 0 {
                return None;
            }
            if (n as usize) < buf.len() {
                buf.truncate(n as usize);
                return Some(String::from_utf8_lossy(&buf).into_owned());
            }
            buf.resize(n as usize + 1, 0);
        }
    }

    pub fn architecture(&self) -> String {
        self.meta("general.architecture").unwrap_or_default()
    }

    pub fn is_eog(&self, token: Token) -> bool {
        unsafe { sys::llama_vocab_is_eog(self.vocab_ptr(), token) }
    }

    /// Every end-of-generation token of the vocabulary.
    pub fn eog_tokens(&self) -> Vec<Token> {
        (0..self.n_vocab() as Token).filter(|&t| self.is_eog(t)).collect()
    }

    /// The mask token that fills a DFlash block, if the vocabulary has one.
    pub fn mask_token(&self) -> Option<Token> {
        let t = unsafe { sys::llama_vocab_mask(self.vocab_ptr()) };
        (t >= 0 && (t as usize) < self.n_vocab()).then_some(t)
    }

    /// Target layers a DFlash drafter reads (layer INPUT ids, as llama.cpp counts them).
    pub fn target_layer_ids(&self) -> Vec<i32> {
        unsafe {
            let n = shim::dflash2_model_target_layer_ids_n(self.as_ptr());
            let p = shim::dflash2_model_target_layer_ids(self.as_ptr());
            if p.is_null() || n == 0 {
                return Vec::new();
            }
            std::slice::from_raw_parts(p, n as usize).to_vec()
        }
    }

    /// Block size a DFlash drafter was trained with (`dflash.block_size`).
    pub fn dflash_block_size(&self) -> Option<usize> {
        self.meta("dflash.block_size")?.parse().ok()
    }

    /// K of the DFlash 2 selector; 0 for a DFlash 1 drafter or a non-drafter.
    pub fn selector_top_k(&self) -> usize {
        unsafe { shim::dflash2_model_selector_top_k(self.as_ptr()).max(0) as usize }
    }

    pub fn tokenize(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<Token>> {
        let len = i32::try_from(text.len()).map_err(|_| LlamaError::Tokenize("text too long".into()))?;
        let mut out = vec![0 as Token; text.len() + 8];
        let mut n = unsafe {
            sys::llama_tokenize(
                self.vocab_ptr(),
                text.as_ptr().cast(),
                len,
                out.as_mut_ptr(),
                out.len() as i32,
                add_special,
                parse_special,
            )
        };
        if n < 0 && n != i32::MIN {
            out.resize((-n) as usize, 0);
            n = unsafe {
                sys::llama_tokenize(
                    self.vocab_ptr(),
                    text.as_ptr().cast(),
                    len,
                    out.as_mut_ptr(),
                    out.len() as i32,
                    add_special,
                    parse_special,
                )
            };
        }
        if n < 0 {
            return Err(LlamaError::Tokenize(format!("llama_tokenize returned {n}")));
        }
        out.truncate(n as usize);
        Ok(out)
    }

    /// The bytes of one token (special tokens rendered when `special`); a token may
    /// hold part of a UTF-8 character, so this is bytes, not text.
    pub fn token_bytes(&self, token: Token, special: bool) -> Vec<u8> {
        let mut buf = vec![0u8; 32];
        loop {
            let n = unsafe {
                sys::llama_token_to_piece(self.vocab_ptr(), token, buf.as_mut_ptr().cast(), buf.len() as i32, 0, special)
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return buf;
            }
            buf.resize((-n) as usize, 0);
        }
    }

    /// Text of a token sequence (lossy on broken UTF-8).
    pub fn detokenize(&self, tokens: &[Token], special: bool) -> String {
        let bytes: Vec<u8> = tokens.iter().flat_map(|&t| self.token_bytes(t, special)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The model's own chat template, if it ships one.
    pub fn chat_template(&self) -> Option<String> {
        let p = unsafe { sys::llama_model_chat_template(self.as_ptr(), std::ptr::null()) };
        if p.is_null() {
            return None;
        }
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }

    /// The vocabulary's fill-in-the-middle tokens (code models such as Qwen2.5-Coder have them).
    pub fn fim_tokens(&self) -> FimTokens {
        let v = self.vocab.as_ptr();
        let some = |t: Token| (t >= 0).then_some(t);
        unsafe {
            FimTokens {
                pre: some(sys::llama_vocab_fim_pre(v)),
                suf: some(sys::llama_vocab_fim_suf(v)),
                mid: some(sys::llama_vocab_fim_mid(v)),
                rep: some(sys::llama_vocab_fim_rep(v)),
                sep: some(sys::llama_vocab_fim_sep(v)),
            }
        }
    }

    /// Whether tokenizing with `add_special` starts with BOS.
    pub fn adds_bos(&self) -> Option<Token> {
        let v = self.vocab.as_ptr();
        unsafe { sys::llama_vocab_get_add_bos(v).then(|| sys::llama_vocab_bos(v)).filter(|&t| t >= 0) }
    }

    /// The text of the vocabulary's BOS and EOS tokens, and whether tokenizing with
    /// `add_special` adds BOS itself (a rendered template then must not start with it too).
    pub fn special_texts(&self) -> (String, String, bool) {
        let text = |t: Token| String::from_utf8_lossy(&self.token_bytes(t, true)).into_owned();
        let v = self.vocab.as_ptr();
        let (bos, eos) = unsafe { (sys::llama_vocab_bos(v), sys::llama_vocab_eos(v)) };
        (if bos >= 0 { text(bos) } else { String::new() }, if eos >= 0 { text(eos) } else { String::new() }, self.adds_bos().is_some())
    }
}

/// Render `messages` with llama.cpp's own template code: `tmpl` is one of its built-in
/// names ([`builtin_chat_templates`]) or a template it recognises by its text.
pub fn apply_llama_template(tmpl: &str, messages: &[ChatMessage], add_assistant: bool) -> Result<String> {
    let ctmpl = CString::new(tmpl).map_err(|_| LlamaError::ChatTemplate("template has a NUL byte".into()))?;
    let owned: Vec<(CString, CString)> = messages
        .iter()
        .map(|m| Ok((CString::new(m.role.as_str())?, CString::new(m.content.as_str())?)))
        .collect::<std::result::Result<_, std::ffi::NulError>>()
        .map_err(|_| LlamaError::ChatTemplate("a message contains a NUL byte".into()))?;
    let msgs: Vec<sys::llama_chat_message> = owned
        .iter()
        .map(|(r, c)| sys::llama_chat_message { role: r.as_ptr(), content: c.as_ptr() })
        .collect();
    let total: usize = messages.iter().map(|m| m.content.len() + m.role.len()).sum();
    let mut buf = vec![0u8; 2 * total + 256];
    for _ in 0..2 {
        let n = unsafe {
            sys::llama_chat_apply_template(
                ctmpl.as_ptr(),
                msgs.as_ptr(),
                msgs.len(),
                add_assistant,
                buf.as_mut_ptr().cast(),
                buf.len() as i32,
            )
        };
        if n < 0 {
            return Err(LlamaError::ChatTemplate(
                format!("llama.cpp does not know the chat template {:?}", tmpl.chars().take(60).collect::<String>()),
            ));
        }
        if (n as usize) <= buf.len() {
            buf.truncate(n as usize);
            return String::from_utf8(buf).map_err(|_| LlamaError::ChatTemplate("not UTF-8".into()));
        }
        buf.resize(n as usize, 0);
    }
    Err(LlamaError::ChatTemplate("template output kept growing".into()))
}

/// The names of llama.cpp's built-in chat templates (`chatml`, `llama3`, ...).
pub fn builtin_chat_templates() -> Vec<String> {
    let n = unsafe { sys::llama_chat_builtin_templates(std::ptr::null_mut(), 0) };
    let mut names: Vec<*const std::os::raw::c_char> = vec![std::ptr::null(); n.max(0) as usize];
    let n = unsafe { sys::llama_chat_builtin_templates(names.as_mut_ptr(), names.len()) };
    names.truncate(n.max(0) as usize);
    names.iter().map(|&p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()).collect()
}

/// Weight types `quantize` writes: (name, llama.cpp's file type).
pub const QUANT_TYPES: [(&str, u32); 16] = [
    ("f16", sys::LLAMA_FTYPE_MOSTLY_F16),
    ("q8_0", sys::LLAMA_FTYPE_MOSTLY_Q8_0),
    ("q6_k", sys::LLAMA_FTYPE_MOSTLY_Q6_K),
    ("q5_k_m", sys::LLAMA_FTYPE_MOSTLY_Q5_K_M),
    ("q5_k_s", sys::LLAMA_FTYPE_MOSTLY_Q5_K_S),
    ("q5_1", sys::LLAMA_FTYPE_MOSTLY_Q5_1),
    ("q5_0", sys::LLAMA_FTYPE_MOSTLY_Q5_0),
    ("q4_k_m", sys::LLAMA_FTYPE_MOSTLY_Q4_K_M),
    ("q4_k_s", sys::LLAMA_FTYPE_MOSTLY_Q4_K_S),
    ("q4_1", sys::LLAMA_FTYPE_MOSTLY_Q4_1),
    ("q4_0", sys::LLAMA_FTYPE_MOSTLY_Q4_0),
    ("iq4_xs", sys::LLAMA_FTYPE_MOSTLY_IQ4_XS),
    ("iq4_nl", sys::LLAMA_FTYPE_MOSTLY_IQ4_NL),
    ("q3_k_m", sys::LLAMA_FTYPE_MOSTLY_Q3_K_M),
    ("q3_k_s", sys::LLAMA_FTYPE_MOSTLY_Q3_K_S),
    ("q2_k", sys::LLAMA_FTYPE_MOSTLY_Q2_K),
];

/// Write `input`'s weights as `ftype` (one of [`QUANT_TYPES`]) to `output` with llama.cpp's own
/// quantizer. `allow_requantize` lets it start from weights that are already quantized.
pub fn quantize(input: &Path, output: &Path, ftype: u32, allow_requantize: bool, threads: i32) -> Result<()> {
    super::init_backend();
    let path = |p: &Path| {
        CString::new(p.to_string_lossy().as_bytes())
            .map_err(|_| LlamaError::Invalid(format!("path contains a NUL byte: {}", p.display())))
    };
    let (inp, out) = (path(input)?, path(output)?);
    let mut params = unsafe { sys::llama_model_quantize_default_params() };
    params.ftype = ftype as _;
    params.allow_requantize = allow_requantize;
    params.nthread = threads;
    let code = unsafe { sys::llama_model_quantize(inp.as_ptr(), out.as_ptr(), &params) };
    if code != 0 {
        return Err(LlamaError::Invalid(format!(
            "llama.cpp could not quantize {} (code {code}; see the log above for its reason)",
            input.display()
        )));
    }
    Ok(())
}
