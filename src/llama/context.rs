//! A llama.cpp context: decoding, logits, KV-cache edits, and the target-feature
//! capture that feeds a DFlash drafter.
use super::{shim, Batch, LlamaError, Model, Result};
use llama_cpp_sys_2 as sys;
use std::sync::Arc;

/// How a target context provides the inputs of the layers a drafter reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeatureSource {
    /// No features (a plain or drafter context).
    None,
    /// llama.cpp's own layer-input extraction (architectures whose graph sets it).
    Native(Vec<i32>),
    /// The graph-evaluation callback copies `l_out-<il-1>`: works for any architecture.
    Callback(Vec<i32>),
}

impl FeatureSource {
    pub fn layers(&self) -> &[i32] {
        match self {
            FeatureSource::None => &[],
            FeatureSource::Native(l) | FeatureSource::Callback(l) => l,
        }
    }
}

/// Element type of a KV cache: the values of llama.cpp's `--cache-type-k` / `--cache-type-v`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    Iq4Nl,
    Q5_0,
    Q5_1,
}

impl CacheType {
    const ALL: [(CacheType, &'static str); 9] = [
        (CacheType::F32, "f32"),
        (CacheType::F16, "f16"),
        (CacheType::Bf16, "bf16"),
        (CacheType::Q8_0, "q8_0"),
        (CacheType::Q4_0, "q4_0"),
        (CacheType::Q4_1, "q4_1"),
        (CacheType::Iq4Nl, "iq4_nl"),
        (CacheType::Q5_0, "q5_0"),
        (CacheType::Q5_1, "q5_1"),
    ];

    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(t, _)| *t == self).map(|(_, n)| *n).expect("every type is listed")
    }

    pub fn is_quantized(self) -> bool {
        !matches!(self, CacheType::F32 | CacheType::F16 | CacheType::Bf16)
    }

    /// Whether heads of `head_size` values fill whole blocks of this type (llama.cpp's condition).
    pub fn fits(self, head_size: usize) -> bool {
        let block = unsafe { sys::ggml_blck_size(self.ggml()) }.max(1) as usize;
        head_size % block == 0
    }

    fn ggml(self) -> sys::ggml_type {
        match self {
            CacheType::F32 => sys::GGML_TYPE_F32,
            CacheType::F16 => sys::GGML_TYPE_F16,
            CacheType::Bf16 => sys::GGML_TYPE_BF16,
            CacheType::Q8_0 => sys::GGML_TYPE_Q8_0,
            CacheType::Q4_0 => sys::GGML_TYPE_Q4_0,
            CacheType::Q4_1 => sys::GGML_TYPE_Q4_1,
            CacheType::Iq4Nl => sys::GGML_TYPE_IQ4_NL,
            CacheType::Q5_0 => sys::GGML_TYPE_Q5_0,
            CacheType::Q5_1 => sys::GGML_TYPE_Q5_1,
        }
    }
}

impl std::str::FromStr for CacheType {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        Self::ALL.iter().find(|(_, n)| *n == lower).map(|(t, _)| *t).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|(_, n)| *n).collect();
            format!("unknown KV cache type `{s}` (one of {})", names.join(", "))
        })
    }
}

impl std::fmt::Display for CacheType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone)]
pub struct ContextParams {
    pub n_ctx: usize,
    pub n_batch: usize,
    pub n_seq_max: usize,
    pub n_threads: i32,
    pub features: FeatureSource,
    /// One cache shared by all sequences (cells may belong to several: token trees).
    /// Otherwise each sequence gets its own stream of `n_ctx / n_seq_max` cells.
    pub kv_unified: bool,
    /// Let llama.cpp use flash attention where it can. Its CPU kernel splits the cache of
    /// a single-token decode above 256 cells and rounds differently from a multi-token
    /// decode, so a context whose outputs must not depend on the batch shape turns it off.
    pub flash_attn: bool,
    /// Run ggml's reference CPU kernels (`dflash2_set_cpu_reference`): each output row is
    /// computed alone, which makes flash attention round a batch like single steps, at a cost
    /// (BENCHMARKS.md (j)); only `inspect --check --flash-attn-ref` asks for it.
    pub reference_kernels: bool,
    /// Element types of the K and V caches. llama.cpp quantizes V only with flash attention.
    pub cache_k: CacheType,
    pub cache_v: CacheType,
    /// Let each decode run with fewer threads when the machine is busy and that is faster
    /// ([`super::threads`]); off for measurements that must run as configured.
    pub adapt_threads: bool,
    /// Take the products of the model's Q8_0 weights in integers with one scale per row
    /// ([`super::OpKernel::DrafterRows`], while it is on): faster, and not ggml's rounding, so
    /// only for a drafter, whose numerics never reach the generated text.
    pub integer_products: bool,
}

impl Default for ContextParams {
    /// One sequence of 4096 tokens without feature capture, run as the target is
    /// (no flash attention), f16 caches.
    fn default() -> Self {
        Self {
            n_ctx: 4096,
            n_batch: 512,
            n_seq_max: 1,
            n_threads: 2,
            features: FeatureSource::None,
            kv_unified: true,
            flash_attn: false,
            reference_kernels: false,
            cache_k: CacheType::F16,
            cache_v: CacheType::F16,
            adapt_threads: true,
            integer_products: false,
        }
    }
}

/// The raw context plus what must outlive it (its model, the capture state the
/// callback writes into, and the context it borrows weights from).
struct Handle {
    ptr: std::ptr::NonNull<sys::llama_context>,
    capture: Option<Arc<Capture>>,
    _other: Option<Arc<Handle>>,
    _model: Arc<Model>,
    /// False for a frontend's context ([`Context::borrow_raw`]): it frees its own.
    owned: bool,
    /// The model's Q8_0 weights are adopted for integer products (given up on drop).
    integer_products: bool,
}

// The handle only carries pointers; every use of the context goes through a `Context`
// method, and the ones that run it take `&mut self`. The target's handle is shared with its
// drafter's context only to keep it alive (the engine owns and moves both together).
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // Fields drop after this: the capture and the other context outlive llama_free.
        if self.owned {
            unsafe { sys::llama_free(self.ptr.as_ptr()) }
        }
        if self.integer_products {
            unsafe { shim::dflash2_adopt_drafter_weights(self._model.as_ptr(), false) };
        }
    }
}

/// The capture callback itself (what [`Capture::install`] sets), for a frontend that calls it
/// from its own `cb_eval` with the user data the install put there.
///
/// # Safety
/// `user_data` must be a live capture's state, `t` a tensor of the graph being computed.
pub unsafe extern "C" fn capture_eval(t: *mut sys::ggml_tensor, ask: bool, user_data: *mut std::ffi::c_void) -> bool {
    shim::dflash2_capture_eval(t, ask, user_data)
}

/// Layer inputs copied out of a target's graph by its `cb_eval` callback (any architecture).
pub struct Capture(std::ptr::NonNull<shim::dflash2_capture>);

// The capture is written by the decoding thread inside llama_decode and read after it; the
// context that decodes is used by one thread at a time.
unsafe impl Send for Capture {}
unsafe impl Sync for Capture {}

impl Drop for Capture {
    fn drop(&mut self) {
        unsafe { shim::dflash2_capture_free(self.0.as_ptr()) }
    }
}

impl Capture {
    /// Capture the inputs of target layers `layers` (`n_embd` floats per row).
    pub fn new(layers: &[i32], n_embd: usize) -> Result<Self> {
        let raw = unsafe { shim::dflash2_capture_new(layers.as_ptr(), layers.len() as u32, n_embd as i64) };
        std::ptr::NonNull::new(raw).map(Capture).ok_or_else(|| LlamaError::Capture("cannot allocate capture state".into()))
    }

    /// Point a context's `cb_eval` at this capture (before the context is created; the
    /// capture must outlive the context).
    pub fn install(&self, cp: &mut sys::llama_context_params) {
        cp.cb_eval = Some(shim::dflash2_capture_eval);
        cp.cb_eval_user_data = self.0.as_ptr().cast();
    }

    fn clear(&self) {
        unsafe { shim::dflash2_capture_clear(self.0.as_ptr()) };
    }

    fn error(&self) -> Option<String> {
        let err = unsafe { shim::dflash2_capture_error(self.0.as_ptr()) };
        (!err.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(err) }.to_string_lossy().into_owned())
    }

    /// The last `rows` rows captured for the `i`-th layer (a frontend that did not report
    /// a decode leaves older rows in front of them).
    fn last_rows(&self, i: usize, rows: usize, n_embd: usize) -> Option<&[f32]> {
        let mut n: i64 = 0;
        let p = unsafe { shim::dflash2_capture_rows(self.0.as_ptr(), i as u32, &mut n) };
        let n = n as usize;
        if p.is_null() || n < rows {
            return None;
        }
        let all = unsafe { std::slice::from_raw_parts(p, n * n_embd) };
        Some(&all[(n - rows) * n_embd..])
    }
}

pub struct Context {
    h: Arc<Handle>,
    kv_unified: bool,
    n_seq_max: usize,
    model: Arc<Model>,
    features: FeatureSource,
    n_ctx: usize,
    n_batch: usize,
    /// Rows llama.cpp computes in one graph: native layer inputs hold the last micro-batch only.
    n_ubatch: usize,
    /// Rows of the last decoded batch (the rows that features and logits refer to).
    last_batch_len: usize,
    /// Chooses each decode's thread count from measured times (None: one thread, or a
    /// frontend's context, whose threads are its own).
    governor: Option<super::threads::ThreadGovernor>,
    threads: i32,
}


impl Context {
    /// A context over `model`. A DFlash drafter context passes its target's context as
    /// `other`: the drafter borrows the target's embeddings and output head from it.
    pub fn new(model: Arc<Model>, params: &ContextParams, other: Option<&Context>) -> Result<Self> {
        if params.cache_v.is_quantized() && !params.flash_attn {
            // llama.cpp would only say that it cannot create the context.
            return Err(LlamaError::Invalid(format!(
                "a {} V cache: llama.cpp quantizes the V cache only with flash attention, and {} runs without it \
                 (the target's CPU kernel rounds batches differently from single tokens); use f16 or f32 (a quantized K \
                 cache is fine)",
                params.cache_v,
                model.path()
            )));
        }
        let (head_k, head_v) = model.head_sizes();
        for (what, t, head) in [("K", params.cache_k, head_k), ("V", params.cache_v, head_v)] {
            if !t.fits(head) {
                return Err(LlamaError::Invalid(format!(
                    "a {t} {what} cache stores attention heads in whole blocks, and the heads of {} have {head} values: use f16",
                    model.path()
                )));
            }
        }
        check_memory(&model, params)?;
        let mut cp = unsafe { sys::llama_context_default_params() };
        cp.type_k = params.cache_k.ggml();
        cp.type_v = params.cache_v.ggml();
        cp.n_ctx = params.n_ctx as u32;
        cp.n_batch = params.n_batch as u32;
        cp.n_ubatch = params.n_batch as u32;
        cp.n_seq_max = params.n_seq_max.max(1) as u32;
        cp.kv_unified = params.kv_unified;
        if !params.flash_attn {
            cp.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_DISABLED;
        }
        // llama.cpp reserves at least one output row per sequence and by default allows
        // only n_batch (which it clamps to n_ctx): room for both.
        cp.n_outputs_max = params.n_batch.max(params.n_seq_max) as u32;
        cp.n_threads = params.n_threads;
        cp.n_threads_batch = params.n_threads;
        cp.no_perf = true;
        // `--gpu-layers 0` means the CPU does all the work: without this a GPU build would still
        // run batches' matrix products on the device (offloading ops of host-resident weights).
        if model.n_gpu_layers() == 0 {
            cp.op_offload = false;
        }
        if let Some(o) = other {
            cp.ctx_other = o.h.ptr.as_ptr();
        }
        let capture = match &params.features {
            FeatureSource::Callback(layers) => {
                let cap = Capture::new(layers, model.n_embd())?;
                cap.install(&mut cp);
                Some(Arc::new(cap))
            }
            _ => None,
        };
        let raw = unsafe { sys::llama_init_from_model(model.as_ptr(), cp) };
        let ptr = std::ptr::NonNull::new(raw)
            .ok_or_else(|| LlamaError::CreateContext { what: model.path().to_string() })?;
        if let FeatureSource::Native(layers) = &params.features {
            for &l in layers {
                unsafe { shim::dflash2_set_embeddings_layer_inp(ptr.as_ptr(), l as u32, true) };
            }
        }
        if params.reference_kernels && unsafe { shim::dflash2_set_cpu_reference(ptr.as_ptr(), true) } == 0 {
            unsafe { sys::llama_free(ptr.as_ptr()) };
            return Err(LlamaError::Invalid(format!(
                "reference kernels asked for {}, but its context has no CPU backend with that switch",
                model.path()
            )));
        }
        let n_ctx = unsafe { sys::llama_n_ctx(ptr.as_ptr()) } as usize;
        let n_batch = unsafe { sys::llama_n_batch(ptr.as_ptr()) } as usize;
        let integer_products =
            params.integer_products && unsafe { shim::dflash2_adopt_drafter_weights(model.as_ptr(), true) } > 0;
        let h = Arc::new(Handle {
            ptr,
            capture,
            _other: other.map(|o| o.h.clone()),
            _model: model.clone(),
            owned: true,
            integer_products,
        });
        let governor = if params.adapt_threads && !model.keeps_thread_count() {
            super::threads::ThreadGovernor::for_machine(params.n_threads)
        } else {
            None
        };
        Ok(Self {
            h,
            kv_unified: params.kv_unified,
            n_seq_max: params.n_seq_max.max(1),
            model,
            features: params.features.clone(),
            n_ctx,
            n_batch,
            n_ubatch: n_batch,
            last_batch_len: 0,
            governor,
            threads: params.n_threads,
        })
    }

    /// A frontend's own context over `model`, used here and never freed. Features come
    /// from llama.cpp's layer-input extraction (turned on here) or from `capture`, which the
    /// frontend installed as the context's `cb_eval`; the frontend decodes and reports each
    /// batch with [`Context::observe`].
    ///
    /// # Safety
    /// `ptr` must be a live context of `model` from the libllama this crate links, and
    /// outlive the returned value and every context made next to it.
    pub unsafe fn borrow_raw(
        model: Arc<Model>,
        ptr: *mut sys::llama_context,
        features: FeatureSource,
        capture: Option<Arc<Capture>>,
    ) -> Result<Self> {
        let ptr = std::ptr::NonNull::new(ptr).ok_or_else(|| LlamaError::Invalid("the target context is NULL".into()))?;
        if !model.is(sys::llama_get_model(ptr.as_ptr())) {
            return Err(LlamaError::Invalid("the target context was not made from the target model".into()));
        }
        match (&features, &capture) {
            (FeatureSource::Native(layers), _) => {
                for &l in layers {
                    shim::dflash2_set_embeddings_layer_inp(ptr.as_ptr(), l as u32, true);
                }
            }
            (FeatureSource::Callback(_), None) => {
                return Err(LlamaError::Capture("callback features need the capture installed in the context".into()))
            }
            _ => {}
        }
        let n_ctx = sys::llama_n_ctx(ptr.as_ptr()) as usize;
        let n_batch = sys::llama_n_batch(ptr.as_ptr()) as usize;
        let n_ubatch = sys::llama_n_ubatch(ptr.as_ptr()) as usize;
        let n_seq_max = (sys::llama_n_seq_max(ptr.as_ptr()) as usize).max(1);
        let kv_unified = sys::llama_n_ctx_seq(ptr.as_ptr()) as usize >= n_ctx;
        let h = Arc::new(Handle { ptr, capture, _other: None, _model: model.clone(), owned: false, integer_products: false });
        Ok(Self { h, kv_unified, n_seq_max, model, features, n_ctx, n_batch, n_ubatch, last_batch_len: 0, governor: None, threads: 0 })
    }

    /// A frontend decoded a batch of `rows` rows on this context: its features are the ones
    /// to read now. Call [`Context::forget_captured`] once they are read.
    pub fn observe(&mut self, rows: usize) -> Result<()> {
        if matches!(self.features, FeatureSource::Native(_)) && rows > self.n_ubatch {
            return Err(LlamaError::Capture(format!(
                "a batch of {rows} rows on a context with n_ubatch {}: llama.cpp keeps the layer inputs of the last \
                 micro-batch only (decode at most n_ubatch rows at a time, or make n_ubatch = n_batch)",
                self.n_ubatch
            )));
        }
        self.last_batch_len = rows;
        match self.h.capture.as_ref().and_then(|c| c.error()) {
            Some(msg) => Err(LlamaError::Capture(msg)),
            None => Ok(()),
        }
    }

    /// Drop the captured rows of the decodes read so far.
    pub fn forget_captured(&self) {
        if let Some(cap) = &self.h.capture {
            cap.clear();
        }
    }

    pub(super) fn ptr(&self) -> *mut sys::llama_context {
        self.h.ptr.as_ptr()
    }

    /// Whether this is the llama.cpp context behind `ptr`.
    pub fn is(&self, ptr: *const sys::llama_context) -> bool {
        std::ptr::eq(self.ptr(), ptr)
    }

    pub(super) fn raw(&self) -> *mut sys::llama_context {
        self.ptr()
    }

    /// A second handle on the same llama.cpp context, only to keep it alive.
    pub(super) fn share(&self) -> Context {
        Context {
            h: self.h.clone(),
            kv_unified: self.kv_unified,
            n_seq_max: self.n_seq_max,
            model: self.model.clone(),
            features: self.features.clone(),
            n_ctx: self.n_ctx,
            n_batch: self.n_batch,
            n_ubatch: self.n_ubatch,
            last_batch_len: 0,
            governor: None,
            threads: self.threads,
        }
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn features(&self) -> &FeatureSource {
        &self.features
    }

    /// Cells of the whole cache.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Positions one sequence can hold (its stream's size when streams are separate).
    pub fn n_ctx_per_seq(&self) -> usize {
        if self.kv_unified {
            self.n_ctx
        } else {
            self.n_ctx / self.n_seq_max
        }
    }

    pub fn n_batch(&self) -> usize {
        self.n_batch
    }

    /// Threads the last decode ran with (0 for a frontend's context).
    pub fn threads(&self) -> i32 {
        self.threads
    }

    pub fn set_causal_attn(&mut self, causal: bool) {
        unsafe { sys::llama_set_causal_attn(self.ptr(), causal) }
    }

    /// Make a DFlash drafter output its extra rows (the DFlash 2 lattice).
    pub fn set_nextn(&mut self, value: bool, masked: bool) {
        unsafe { shim::dflash2_set_embeddings_nextn(self.ptr(), value, masked) }
    }

    pub fn decode(&mut self, batch: &Batch, what: &'static str) -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        self.forget_captured();
        let threads = self.governor.as_mut().map(|g| g.threads_for(batch.len(), what));
        if let Some(t) = threads.filter(|&t| t != self.threads) {
            tracing::debug!("{}: {} rows on {t} threads (was {})", self.model.path(), batch.len(), self.threads);
            unsafe { sys::llama_set_n_threads(self.ptr(), t, t) };
            self.threads = t;
        }
        let started = std::time::Instant::now();
        let code = unsafe { sys::llama_decode(self.ptr(), batch.raw()) };
        if code != 0 {
            return Err(LlamaError::Decode { code, what });
        }
        // A GPU backend returns before the work is done: wait, so that the clock a caller
        // stops after this call times the decode itself (a no-op on the CPU).
        unsafe { sys::llama_synchronize(self.ptr()) };
        if let (Some(g), Some(t)) = (self.governor.as_mut(), threads) {
            let ms = started.elapsed().as_secs_f64() * 1e3;
            tracing::trace!("{} rows on {t} threads: {ms:.2} ms", batch.len());
            g.record(batch.len(), what, t, ms);
        }
        self.observe(batch.len())
    }

    /// Logits of row `i` of the last decoded batch (the row must have asked for output).
    pub fn logits(&self, i: usize) -> Result<&[f32]> {
        let p = unsafe { sys::llama_get_logits_ith(self.ptr(), i as i32) };
        if p.is_null() {
            return Err(LlamaError::Invalid(format!("no logits for batch row {i}")));
        }
        Ok(unsafe { std::slice::from_raw_parts(p, self.model.n_vocab()) })
    }

    /// The drafter's extra output rows of the last decode, `n_embd` floats per batch row.
    pub fn nextn(&self) -> Result<&[f32]> {
        let p = unsafe { shim::dflash2_get_embeddings_nextn(self.ptr()) };
        if p.is_null() {
            return Err(LlamaError::Invalid("the drafter produced no lattice rows".into()));
        }
        Ok(unsafe { std::slice::from_raw_parts(p, self.last_batch_len * self.model.n_embd()) })
    }

    /// Append the target features of `rows` of the last decoded batch to `out`: for
    /// each row, the inputs of every feature layer concatenated in layer order.
    pub fn append_features(&self, rows: &[usize], out: &mut Vec<f32>) -> Result<()> {
        if let Some(&bad) = rows.iter().find(|&&r| r >= self.last_batch_len) {
            return Err(LlamaError::Invalid(format!(
                "feature row {bad} beyond the last batch ({} rows)",
                self.last_batch_len
            )));
        }
        let n_embd = self.model.n_embd();
        let layers = self.layer_slices()?;
        out.reserve(rows.len() * layers.len() * n_embd);
        for &r in rows {
            for l in &layers {
                out.extend_from_slice(&l[r * n_embd..(r + 1) * n_embd]);
            }
        }
        Ok(())
    }

    fn layer_slices(&self) -> Result<Vec<&[f32]>> {
        let n_embd = self.model.n_embd();
        let rows = self.last_batch_len;
        match &self.features {
            FeatureSource::None => Err(LlamaError::Capture("this context captures no features".into())),
            FeatureSource::Native(layers) => layers
                .iter()
                .map(|&l| {
                    let p = unsafe { shim::dflash2_get_embeddings_layer_inp(self.ptr(), l as u32) };
                    if p.is_null() {
                        return Err(LlamaError::Capture(format!("layer {l} input was not extracted")));
                    }
                    Ok(unsafe { std::slice::from_raw_parts(p, rows * n_embd) })
                })
                .collect(),
            FeatureSource::Callback(layers) => {
                let cap = self.h.capture.as_ref().expect("callback source always has a capture");
                (0..layers.len())
                    .map(|i| {
                        cap.last_rows(i, rows, n_embd).ok_or_else(|| {
                            LlamaError::Capture(format!(
                                "layer {} input: fewer rows captured than the batch's {rows} (was the capture installed \
                                 in this context's cb_eval?)",
                                layers[i]
                            ))
                        })
                    })
                    .collect()
            }
        }
    }

    fn memory(&self) -> sys::llama_memory_t {
        unsafe { sys::llama_get_memory(self.ptr()) }
    }

    /// Drop the cache cells of `seq` at positions `[p0, p1)` (`p1 < 0`: to the end).
    pub fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> Result<()> {
        if unsafe { sys::llama_memory_seq_rm(self.memory(), seq, p0, p1) } {
            Ok(())
        } else {
            Err(LlamaError::Invalid(format!("cannot remove cache positions {p0}..{p1} of sequence {seq}")))
        }
    }

    /// Copy the cells of `src` at `[p0, p1)` into `dst` (they are shared, not duplicated).
    pub fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) {
        unsafe { sys::llama_memory_seq_cp(self.memory(), src, dst, p0, p1) }
    }

    /// Largest position held for `seq`, -1 when empty.
    pub fn seq_pos_max(&self, seq: i32) -> i32 {
        unsafe { sys::llama_memory_seq_pos_max(self.memory(), seq) }
    }

    pub fn clear_memory(&mut self) {
        unsafe { sys::llama_memory_clear(self.memory(), true) }
    }
}

/// Bytes of KV cache a context of `n_ctx` cells takes (every layer, K and V).
fn kv_bytes(model: &Model, params: &ContextParams) -> f64 {
    let n_head_kv = unsafe { sys::llama_model_n_head_kv(model.as_ptr()) }.max(1) as f64;
    let (head_k, head_v) = model.head_sizes();
    let per_value = |t: CacheType| unsafe { sys::ggml_type_sizef(t.ggml()) };
    let per_cell = n_head_kv * (head_k as f64 * per_value(params.cache_k) + head_v as f64 * per_value(params.cache_v));
    params.n_ctx as f64 * model.n_layer() as f64 * per_cell
}

/// A KV cache larger than the memory left is refused before llama.cpp allocates it: the
/// allocation can succeed (the kernel overcommits) and the first write then has the process
/// killed, with no message. Only where the cache lives in host memory (CPU builds).
fn check_memory(model: &Model, params: &ContextParams) -> Result<()> {
    if super::gpu_offload_supported() && model.n_gpu_layers() != 0 {
        return Ok(());
    }
    let Some(available) = mem_available() else { return Ok(()) };
    let needed = kv_bytes(model, params);
    if needed > available as f64 {
        const GIB: f64 = (1u64 << 30) as f64;
        return Err(LlamaError::Invalid(format!(
            "a context of {} tokens needs {:.1} GiB of KV cache for {}, and {:.1} GiB of memory are available: \
             lower --ctx-size (or use a quantized K cache, -ctk q8_0)",
            params.n_ctx,
            needed / GIB,
            model.path(),
            available as f64 / GIB
        )));
    }
    Ok(())
}

/// `MemAvailable` of /proc/meminfo, in bytes (None where there is none).
fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = info.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

/// Architectures whose llama.cpp graph exposes layer inputs (`t_layer_inp`); the rest
/// (qwen2, gemma3, ...) would assert inside llama.cpp, so they use the callback.
const NATIVE_FEATURE_ARCHS: &[&str] = &["llama", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe", "lfm2"];

impl FeatureSource {
    /// Whether llama.cpp's graph for `arch` exposes layer inputs.
    pub fn has_native(arch: &str) -> bool {
        NATIVE_FEATURE_ARCHS.contains(&arch)
    }

    /// The best source for a target architecture: native where llama.cpp has it.
    pub fn auto(arch: &str, layers: Vec<i32>) -> Self {
        if Self::has_native(arch) {
            FeatureSource::Native(layers)
        } else {
            FeatureSource::Callback(layers)
        }
    }
}
