//! Reading GGUF metadata ([`read_gguf`], [`read_model_info`]) and checking that a drafter fits a
//! target ([`check_pair`]).
//!
//! One bounds-checked pass decodes the header: every length is checked against the bytes left in
//! the file before anything is allocated or read, tensor types and extents are checked with ggml's
//! own size table, and no input can panic (no `catch_unwind` is needed). This is written here and
//! not taken from gguf-rs: that crate panics on real tensor types it does not know (NVFP4),
//! allocates strings before checking the file holds them, and turns on serde_json's
//! `arbitrary_precision` for the whole build, which broke every fractional number in the server's
//! requests.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::{ggml_nbytes, ggml_type_info, meta_scalar_size, MetaValue, TYPE_ARRAY, TYPE_STRING, TYPE_U32};
use super::{TYPE_BOOL, TYPE_F32, TYPE_F64, TYPE_I16, TYPE_I32, TYPE_I64, TYPE_I8, TYPE_U16, TYPE_U64, TYPE_U8};

/// More array elements than any real vocabulary needs (Gemma 3 has 262,144 tokens, Llama 3
/// ~280k merges). Caps the memory a crafted file can make the decoder spend (~40 B an element).
const MAX_ARRAY_ELEMENTS: u64 = 8 << 20;
/// ggml's `GGML_MAX_NAME`: llama.cpp rejects longer tensor names.
const MAX_TENSOR_NAME: u64 = 64;
const DEFAULT_ALIGNMENT: u64 = 32;

/// Why a file could not be read as a model. Every message starts with the path.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{}: no such file", path.display())]
    NotFound { path: PathBuf },
    // the io::Error is shown, not chained as a source, so `{:#}` does not print it twice
    #[error("{}: cannot read: {error}", path.display())]
    Io { path: PathBuf, error: io::Error },
    #[error("{}: not a GGUF file ({detail})", path.display())]
    NotGguf { path: PathBuf, detail: String },
    #[error("{}: unsupported GGUF version {version} ({detail})", path.display())]
    Version { path: PathBuf, version: u32, detail: String },
    #[error("{}: truncated GGUF file: {detail}", path.display())]
    Truncated { path: PathBuf, detail: String },
    #[error("{}: malformed GGUF file: {detail}", path.display())]
    Malformed { path: PathBuf, detail: String },
    #[error("{}: metadata key {key}: {problem}", path.display())]
    Metadata { path: PathBuf, key: String, problem: String },
}

/// A tensor's header entry.
#[derive(Clone, Debug, Serialize)]
pub struct TensorInfo {
    pub name: String,
    pub ggml_type: u32,
    pub type_name: &'static str,
    /// ggml order: `shape[0]` is ne[0], the contiguous dimension.
    pub shape: Vec<u64>,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    pub nbytes: u64,
}

/// A decoded GGUF header: typed metadata in file order and the tensor table.
#[derive(Clone, Debug)]
pub struct Gguf {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<TensorInfo>,
    pub file_size: u64,
}

impl Gguf {
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    fn key_error(&self, key: &str, problem: &str) -> GgufError {
        GgufError::Metadata { path: self.path.clone(), key: key.to_string(), problem: problem.to_string() }
    }

    fn required_u32(&self, key: &str) -> Result<u32, GgufError> {
        match self.get(key) {
            None => Err(self.key_error(key, "missing")),
            Some(v) => v.as_u32().ok_or_else(|| self.key_error(key, &format!("expected an unsigned integer, found {v:?}"))),
        }
    }

    fn optional_u32(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.get(key).map(|_| self.required_u32(key)).transpose()
    }
}

/// What the engine and the pairing check need to know about a model.
#[derive(Clone, Debug, Serialize)]
pub struct ModelInfo {
    pub path: PathBuf,
    pub gguf_version: u32,
    pub file_size: u64,
    pub n_tensors: usize,
    pub architecture: String,
    pub name: Option<String>,
    pub n_embd: u32,
    pub n_layer: u32,
    pub context_length: Option<u32>,
    /// Tokens in the vocabulary (`tokenizer.ggml.tokens`, else `<arch>.vocab_size`, else the
    /// rows of `token_embd.weight`; 0 when none is there).
    pub n_vocab: u32,
    pub tokenizer_model: Option<String>,
    pub tokenizer_pre: Option<String>,
    /// FNV-1a 64 over the token list, token types and merges: equal vocabularies compare equal.
    pub tokenizer_fingerprint: u64,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub mask_id: Option<u32>,
    pub has_chat_template: bool,
    /// Present when the architecture is `dflash`.
    pub dflash: Option<DflashInfo>,
}

/// One tensor type of a file: how many tensors, how many bytes.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct WeightType {
    pub type_name: &'static str,
    pub tensors: usize,
    pub bytes: u64,
}

impl Gguf {
    /// The tensor types the file holds, the most bytes first: what a "Q4_K_M" file really is (a
    /// width that is no multiple of 256 falls back to Q5_0 or Q8_0), and so which kernels multiply it.
    pub fn weight_types(&self) -> Vec<WeightType> {
        let mut types: Vec<WeightType> = Vec::new();
        for t in &self.tensors {
            match types.iter_mut().find(|w| w.type_name == t.type_name) {
                Some(w) => {
                    w.tensors += 1;
                    w.bytes += t.nbytes;
                }
                None => types.push(WeightType { type_name: t.type_name, tensors: 1, bytes: t.nbytes }),
            }
        }
        types.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.type_name.cmp(b.type_name)));
        types
    }
}

/// DFlash drafter metadata (architecture `dflash`).
#[derive(Clone, Debug, Serialize)]
pub struct DflashInfo {
    /// `dflash.target_layers` as stored: target layer INPUT ids (the reference's
    /// `target_layer_ids` + 1), in the order their features are concatenated.
    pub target_layers: Vec<i64>,
    pub block_size: Option<u32>,
    /// K of the DFlash 2 candidate selector; 0 for a DFlash 1 drafter.
    pub selector_top_k: u32,
    pub selector_rank: u32,
    pub conv_kernel_size: u32,
    pub conv_group_size: u32,
    /// The drafter has the selector tensors (llama.cpp keys DFlash 2 on `selector_hidden.weight`).
    pub has_selector: bool,
    /// `d2t` length (reduced draft vocabulary), if the drafter has one.
    pub d2t_len: Option<u64>,
    /// Ships `token_embd.weight`: it then needs neither the target's embeddings nor (lacking
    /// `output.weight`, it reuses its own embeddings) the target's head.
    pub has_token_embd: bool,
    pub has_output: bool,
    /// `fc.weight` shape [ne0, ne1] = [n_ids * feature width, n_embd].
    pub fc_shape: Option<[u64; 2]>,
    pub causal: bool,
}

impl DflashInfo {
    pub fn is_dflash2(&self) -> bool {
        self.selector_top_k > 0
    }
}

/// Reads the header and metadata of a GGUF file (never the tensor data).
pub fn read_gguf(path: &Path) -> Result<Gguf, GgufError> {
    let io_err = |source: io::Error| match source.kind() {
        io::ErrorKind::NotFound => GgufError::NotFound { path: path.to_path_buf() },
        _ => GgufError::Io { path: path.to_path_buf(), error: source },
    };
    let file = File::open(path).map_err(io_err)?;
    let meta = file.metadata().map_err(io_err)?;
    if meta.is_dir() {
        return Err(GgufError::NotGguf { path: path.to_path_buf(), detail: "it is a directory".into() });
    }
    scan(BufReader::new(file), meta.len(), path)
}

/// [`read_gguf`] of a file's bytes held in memory, named `path` in messages (the fuzz harness
/// reads mutated headers this way, without a file per input).
pub fn parse_gguf(bytes: &[u8], path: &Path) -> Result<Gguf, GgufError> {
    scan(bytes, bytes.len() as u64, path)
}

fn scan(r: impl Read, len: u64, path: &Path) -> Result<Gguf, GgufError> {
    let layout = Scanner { r, pos: 0, len }.layout().map_err(|p| p.into_error(path))?;
    Ok(Gguf { path: path.to_path_buf(), version: layout.version, metadata: layout.kv, tensors: layout.tensors, file_size: len })
}

/// Reads a model's metadata and extracts what the pairing check and the engine need.
pub fn read_model_info(path: &Path) -> Result<ModelInfo, GgufError> {
    ModelInfo::from_gguf(&read_gguf(path)?)
}

/// llama.cpp's layer bound (`LLAMA_MAX_LAYERS`) and expert bound (`LLAMA_MAX_EXPERTS`).
const LLAMA_MAX_LAYERS: u32 = 512;
const LLAMA_MAX_EXPERTS: u32 = 1024;

/// The hyperparameters llama.cpp asserts on while it loads (`llama_model_base::load_hparams`):
/// an assert aborts the whole process, so each is checked here first and refused by name.
/// (The layer count was found by the `gguf` fuzz target; the rest sit beside it there.)
fn llama_hparams_in_range(g: &Gguf, arch_key: &dyn Fn(&str) -> String, n_layer: u32) -> Result<(), GgufError> {
    let bad = |k: &str, problem: String| Err(g.key_error(&arch_key(k), &format!("{problem} (llama.cpp would abort)")));
    if !(1..=LLAMA_MAX_LAYERS).contains(&n_layer) {
        return bad("block_count", format!("{n_layer} layers; llama.cpp takes 1..={LLAMA_MAX_LAYERS}"));
    }
    // optional counts, 0 when absent (as llama.cpp reads them); a value of another type is
    // refused by llama.cpp with an error, not an assert
    let count = |k: &str| g.get(&arch_key(k)).and_then(MetaValue::as_u32).unwrap_or(0);
    let nextn = count("nextn_predict_layers");
    if nextn > n_layer {
        return bad("nextn_predict_layers", format!("{nextn}, more than the {n_layer} layers"));
    }
    let experts = count("expert_count");
    if experts > LLAMA_MAX_EXPERTS {
        return bad("expert_count", format!("{experts}; llama.cpp takes at most {LLAMA_MAX_EXPERTS}"));
    }
    // one count for every layer, or one per layer (the largest counts)
    let used = match g.get(&arch_key("expert_used_count")) {
        Some(MetaValue::Array(_, a)) => a.iter().filter_map(MetaValue::as_u32).max().unwrap_or(0),
        Some(v) => v.as_u32().unwrap_or(0),
        None => 0,
    };
    let (groups, groups_used) = (count("expert_group_count"), count("expert_group_used_count"));
    if used > experts || (experts > 0 && used == 0) {
        return bad("expert_used_count", format!("{used} of {experts} experts"));
    }
    let groups_ok = if experts == 0 {
        groups == 0
    } else {
        groups < experts && (groups <= 1 || (experts % groups == 0 && (1..groups).contains(&groups_used)))
    };
    if !groups_ok {
        return bad("expert_group_count", format!("{groups} groups ({groups_used} used) of {experts} experts"));
    }
    if let Some(t) = g.get(&arch_key("rope.scaling.type")).and_then(MetaValue::as_str) {
        if !["none", "linear", "yarn", "longrope"].contains(&t) {
            return bad("rope.scaling.type", format!("{t:?}; llama.cpp knows none, linear, yarn and longrope"));
        }
    }
    Ok(())
}

/// llama.cpp aborts the whole process (a `GGML_ASSERT` in `llama_vocab::load`) on a vocabulary
/// where two ids share a text, so that is refused here first. llama.cpp reads each text as a C
/// string (up to its first NUL byte) and names an empty one `[EMPTY_<id>]`; so does this check.
/// (Both found by the `gguf` fuzz target.)
fn distinct_token_texts(g: &Gguf, tokens: &[MetaValue]) -> Result<(), GgufError> {
    const KEY: &str = "tokenizer.ggml.tokens";
    let mut seen = std::collections::HashMap::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        let text = match t.as_str().map(|s| s.split('\0').next().unwrap_or_default()) {
            Some("") => std::borrow::Cow::Owned(format!("[EMPTY_{id}]")),
            Some(s) => std::borrow::Cow::Borrowed(s),
            None => return Err(g.key_error(KEY, &format!("token {id} is not a string"))),
        };
        if let Some(first) = seen.insert(text, id) {
            let text = t.as_str().unwrap_or_default().split('\0').next().unwrap_or_default();
            return Err(g.key_error(KEY, &format!("tokens {first} and {id} have the same text {text:?} (llama.cpp would abort)")));
        }
    }
    Ok(())
}

/// llama.cpp aborts while it loads a WordPiece vocabulary (`tokenizer.ggml.model` "bert") that
/// has a byte token (type 6): it has no byte form for one. (Found by the `gguf` fuzz target.)
fn no_byte_tokens_in_wordpiece(g: &Gguf) -> Result<(), GgufError> {
    const BYTE: i64 = 6;
    if g.get("tokenizer.ggml.model").and_then(MetaValue::as_str) != Some("bert") {
        return Ok(());
    }
    let types = g.get("tokenizer.ggml.token_type").and_then(MetaValue::as_array).unwrap_or_default();
    match types.iter().position(|t| t.as_i64() == Some(BYTE)) {
        Some(id) => Err(g.key_error(
            "tokenizer.ggml.token_type",
            &format!("token {id} is a byte token in a WordPiece (\"bert\") vocabulary (llama.cpp would abort)"),
        )),
        None => Ok(()),
    }
}

impl ModelInfo {
    pub fn from_gguf(g: &Gguf) -> Result<ModelInfo, GgufError> {
        let architecture = match g.get("general.architecture") {
            None => return Err(g.key_error("general.architecture", "missing")),
            Some(v) => v.as_str().ok_or_else(|| g.key_error("general.architecture", "not a string"))?.to_string(),
        };
        let arch_key = |k: &str| format!("{architecture}.{k}");
        let n_embd = g.required_u32(&arch_key("embedding_length"))?;
        let n_layer = g.required_u32(&arch_key("block_count"))?;
        llama_hparams_in_range(g, &arch_key, n_layer)?;

        let tokens = g.get("tokenizer.ggml.tokens").and_then(MetaValue::as_array);
        if let Some(tokens) = tokens {
            distinct_token_texts(g, tokens)?;
        }
        no_byte_tokens_in_wordpiece(g)?;
        let n_vocab = match tokens {
            Some(t) => t.len() as u32,
            None => match g.optional_u32(&arch_key("vocab_size"))? {
                Some(n) => n,
                None => g.tensor("token_embd.weight").and_then(|t| t.shape.get(1)).map_or(0, |&n| u32::try_from(n).unwrap_or(u32::MAX)),
            },
        };
        let string = |k: &str| g.get(k).and_then(MetaValue::as_str).map(str::to_string);

        let dflash = if architecture == "dflash" { Some(DflashInfo::from_gguf(g)?) } else { None };
        Ok(ModelInfo {
            path: g.path.clone(),
            gguf_version: g.version,
            file_size: g.file_size,
            n_tensors: g.tensors.len(),
            name: string("general.name"),
            n_embd,
            n_layer,
            context_length: g.optional_u32(&arch_key("context_length"))?,
            n_vocab,
            tokenizer_model: string("tokenizer.ggml.model"),
            tokenizer_pre: string("tokenizer.ggml.pre"),
            tokenizer_fingerprint: tokenizer_fingerprint(g),
            bos_id: g.optional_u32("tokenizer.ggml.bos_token_id")?,
            eos_id: g.optional_u32("tokenizer.ggml.eos_token_id")?,
            mask_id: g.optional_u32("tokenizer.ggml.mask_token_id")?,
            has_chat_template: string("tokenizer.chat_template").is_some_and(|t| !t.is_empty()),
            architecture,
            dflash,
        })
    }
}

impl DflashInfo {
    fn from_gguf(g: &Gguf) -> Result<DflashInfo, GgufError> {
        let key = "dflash.target_layers";
        let target_layers = match g.get(key) {
            None => return Err(g.key_error(key, "missing (llama.cpp refuses a DFlash drafter without it)")),
            Some(v) => v
                .as_array()
                .and_then(|items| items.iter().map(MetaValue::as_i64).collect::<Option<Vec<_>>>())
                .ok_or_else(|| g.key_error(key, "expected an array of integers"))?,
        };
        let zero_default = |k: &str| g.optional_u32(k).map(Option::unwrap_or_default);
        Ok(DflashInfo {
            target_layers,
            block_size: g.optional_u32("dflash.block_size")?,
            selector_top_k: zero_default("dflash.selector_top_k")?,
            selector_rank: zero_default("dflash.selector_rank")?,
            conv_kernel_size: zero_default("dflash.conv_kernel_size")?,
            conv_group_size: zero_default("dflash.conv_group_size")?,
            has_selector: g.tensor("selector_hidden.weight").is_some(),
            d2t_len: g.tensor("d2t").and_then(|t| t.shape.first().copied()),
            has_token_embd: g.tensor("token_embd.weight").is_some(),
            has_output: g.tensor("output.weight").is_some(),
            fc_shape: g.tensor("fc.weight").map(|t| [t.shape.first().copied().unwrap_or(1), t.shape.get(1).copied().unwrap_or(1)]),
            causal: g.get("dflash.attention.causal").and_then(MetaValue::as_bool).unwrap_or(false),
        })
    }
}

/// FNV-1a 64 over tokens, token types and merges, each list tagged and length-prefixed so that
/// moving an element from one list to another changes the hash.
fn tokenizer_fingerprint(g: &Gguf) -> u64 {
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    for key in ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"] {
        let items = g.get(key).and_then(MetaValue::as_array).unwrap_or(&[]);
        h.write(key.as_bytes());
        h.write(&(items.len() as u64).to_le_bytes());
        for item in items {
            match item {
                MetaValue::Str(s) => {
                    h.write(&(s.len() as u64).to_le_bytes());
                    h.write(s.as_bytes());
                }
                other => h.write(&other.as_i64().unwrap_or(i64::MIN).to_le_bytes()),
            }
        }
    }
    h.0
}

struct Fnv(u64);

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// A pairing failure, naming the field and both values.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PairError {
    #[error("architecture: the drafter is '{0}', expected 'dflash' (was a target model given as the drafter?)")]
    NotADrafter(String),
    #[error("architecture: the target is a 'dflash' drafter, expected a target model")]
    TargetIsDrafter,
    #[error("target layers: the drafter lists none")]
    NoTargetLayers,
    #[error(
        "target layer id {id}: the target has {n_layer} layers, so a layer-input id must be in 1..={max} \
         (ids are layer inputs: llama.cpp has no input for layer {n_layer} and id 0 is the raw token embedding)",
        max = n_layer.saturating_sub(1)
    )]
    LayerOutOfRange { id: i64, n_layer: u32 },
    #[error("embedding width: target has {target}, drafter has {drafter} ({why})")]
    EmbdWidth { target: u32, drafter: u32, why: &'static str },
    #[error("fc input width: drafter's fc.weight takes {fc_in}, target features are {n_ids} layers x {target_embd} = {expected}")]
    FcWidth { fc_in: u64, n_ids: usize, target_embd: u32, expected: u64 },
    #[error("fc.weight: the drafter has none")]
    NoFc,
    #[error("vocabulary size: target has {target}, drafter has {drafter}")]
    VocabSize { target: u32, drafter: u32 },
    #[error("tokenizer: target has {target_model} vocabulary {target:016x}, drafter has {drafter_model} vocabulary {drafter:016x} (same size, different tokens, types or merges)")]
    Tokenizer { target: u64, drafter: u64, target_model: String, drafter_model: String },
    #[error("mask token: the drafter has no tokenizer.ggml.mask_token_id")]
    NoMask,
    #[error("mask token: id {id} is outside the vocabulary of {n_vocab} tokens")]
    MaskOutOfRange { id: u32, n_vocab: u32 },
    #[error("block size: the drafter has no dflash.block_size")]
    NoBlockSize,
    #[error("block size: the drafter has {0}, expected 2..=64")]
    BlockSize(u32),
    #[error("selector: top-k {k} needs n_embd >= K*(K+1) = {need}, the drafter has n_embd {n_embd}")]
    SelectorWidth { k: u32, need: u64, n_embd: u32 },
    #[error("selector: top-k {k} exceeds the vocabulary of {n_vocab} tokens")]
    SelectorTopK { k: u32, n_vocab: u32 },
    #[error("selector: a DFlash 2 drafter needs selector tensors and rank, conv kernel and group > 0 (has tensors: {has_tensors}, rank {rank}, kernel {kernel}, group {group})")]
    SelectorIncomplete { has_tensors: bool, rank: u32, kernel: u32, group: u32 },
    #[error("conv group size: {group} does not divide the drafter's n_embd {n_embd}")]
    ConvGroup { group: u32, n_embd: u32 },
}

/// [`check_pair`] on two files, or why they could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PairCheckError {
    #[error(transparent)]
    Read(#[from] GgufError),
    // `problem`, not `source`: shown in the message, not chained, so `{:#}` prints it once
    #[error("{} cannot draft for {}: {problem}", drafter.display(), target.display())]
    Mismatch { target: PathBuf, drafter: PathBuf, problem: PairError },
}

/// Reads both models and checks the pair; on success returns (target, drafter) info.
pub fn check_pair_files(target: &Path, drafter: &Path) -> Result<(ModelInfo, ModelInfo), PairCheckError> {
    let t = read_model_info(target)?;
    let d = read_model_info(drafter)?;
    check_pair(&t, &d).map_err(|problem| PairCheckError::Mismatch {
        target: target.to_path_buf(),
        drafter: drafter.to_path_buf(),
        problem,
    })?;
    Ok((t, d))
}

/// Checks that `drafter` can draft for `target` through llama.cpp. Returns the first problem,
/// most fundamental first: architecture, vocabulary, target layers, widths, mask, block, selector.
///
/// Layer ids: `dflash.target_layers` holds layer INPUT ids. llama.cpp's
/// `llama_set_embeddings_layer_inp` accepts 0..=n_layer, but most target graphs (llama, qwen3, ...)
/// only set a layer-input tensor for il < n_layer and abort on n_layer, and 0 is the token
/// embedding, which the reference (`hidden_states[id + 1]`) never asks for. So an id must be in
/// 1..=n_layer-1; it then also maps onto the graph's `l_out-<id-1>` for a `cb_eval` capture.
///
/// Widths: the engine feeds fc the target's layer inputs, n_ids * target n_embd wide, so fc's
/// input must be that wide. A drafter without its own `token_embd.weight` embeds its block with
/// the target's table, so its n_embd must equal the target's; one with its own embeddings could
/// in principle differ, but the bundled llama.cpp creates `fc.weight` as
/// [n_ids * drafter n_embd, n_embd] (and sizes the feature batch the same way), so it must not.
pub fn check_pair(target: &ModelInfo, drafter: &ModelInfo) -> Result<(), PairError> {
    let Some(d) = &drafter.dflash else {
        return Err(PairError::NotADrafter(drafter.architecture.clone()));
    };
    if target.dflash.is_some() {
        return Err(PairError::TargetIsDrafter);
    }
    if target.n_vocab != drafter.n_vocab {
        return Err(PairError::VocabSize { target: target.n_vocab, drafter: drafter.n_vocab });
    }
    if target.tokenizer_fingerprint != drafter.tokenizer_fingerprint {
        let model = |m: &ModelInfo| m.tokenizer_model.clone().unwrap_or_else(|| "no".into());
        return Err(PairError::Tokenizer {
            target: target.tokenizer_fingerprint,
            drafter: drafter.tokenizer_fingerprint,
            target_model: model(target),
            drafter_model: model(drafter),
        });
    }
    if d.target_layers.is_empty() {
        return Err(PairError::NoTargetLayers);
    }
    let n_layer = target.n_layer;
    if let Some(&id) = d.target_layers.iter().find(|&&id| id < 1 || id >= i64::from(n_layer)) {
        return Err(PairError::LayerOutOfRange { id, n_layer });
    }
    let [fc_in, _] = d.fc_shape.ok_or(PairError::NoFc)?;
    let n_ids = d.target_layers.len();
    let expected = n_ids as u64 * u64::from(target.n_embd);
    if fc_in != expected {
        return Err(PairError::FcWidth { fc_in, n_ids, target_embd: target.n_embd, expected });
    }
    if drafter.n_embd != target.n_embd {
        let why = if d.has_token_embd {
            "llama.cpp sizes fc's input as target layers x the drafter's own n_embd, so they must match"
        } else {
            "the drafter embeds its block with the target's token embeddings"
        };
        return Err(PairError::EmbdWidth { target: target.n_embd, drafter: drafter.n_embd, why });
    }
    let mask = drafter.mask_id.ok_or(PairError::NoMask)?;
    if mask >= drafter.n_vocab {
        return Err(PairError::MaskOutOfRange { id: mask, n_vocab: drafter.n_vocab });
    }
    let block = d.block_size.ok_or(PairError::NoBlockSize)?;
    if !(2..=64).contains(&block) {
        return Err(PairError::BlockSize(block));
    }
    if d.is_dflash2() || d.has_selector {
        let k = d.selector_top_k;
        if !d.has_selector || k == 0 || d.selector_rank == 0 || d.conv_kernel_size == 0 || d.conv_group_size == 0 {
            return Err(PairError::SelectorIncomplete {
                has_tensors: d.has_selector,
                rank: d.selector_rank,
                kernel: d.conv_kernel_size,
                group: d.conv_group_size,
            });
        }
        let need = u64::from(k) * (u64::from(k) + 1);
        if u64::from(drafter.n_embd) < need {
            return Err(PairError::SelectorWidth { k, need, n_embd: drafter.n_embd });
        }
        if k > drafter.n_vocab {
            return Err(PairError::SelectorTopK { k, n_vocab: drafter.n_vocab });
        }
        if drafter.n_embd % d.conv_group_size != 0 {
            return Err(PairError::ConvGroup { group: d.conv_group_size, n_embd: drafter.n_embd });
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The bounds-checked header scan.

/// What the scan found wrong, before the path is attached.
enum Problem {
    Io(io::Error),
    NotGguf(String),
    Version(u32, String),
    Truncated(String),
    Malformed(String),
}

impl Problem {
    fn into_error(self, path: &Path) -> GgufError {
        let path = path.to_path_buf();
        match self {
            Problem::Io(error) => GgufError::Io { path, error },
            Problem::NotGguf(detail) => GgufError::NotGguf { path, detail },
            Problem::Version(version, detail) => GgufError::Version { path, version, detail },
            Problem::Truncated(detail) => GgufError::Truncated { path, detail },
            Problem::Malformed(detail) => GgufError::Malformed { path, detail },
        }
    }
}

impl From<io::Error> for Problem {
    fn from(e: io::Error) -> Self {
        Problem::Io(e)
    }
}

struct Layout {
    version: u32,
    kv: Vec<(String, MetaValue)>,
    tensors: Vec<TensorInfo>,
}

struct Scanner<R> {
    r: R,
    pos: u64,
    len: u64,
}

impl<R: Read> Scanner<R> {
    /// Fails with `Truncated` unless `n` more bytes exist.
    fn need(&self, n: u64, what: &dyn Fn() -> String) -> Result<(), Problem> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Problem::Truncated(format!(
                "{} at byte {} needs {} bytes, but the file ends at byte {}",
                what(),
                self.pos,
                n,
                self.len
            ))),
        }
    }

    fn bytes<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], Problem> {
        self.need(N as u64, what)?;
        let mut buf = [0u8; N];
        self.r.read_exact(&mut buf)?;
        self.pos += N as u64;
        Ok(buf)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, Problem> {
        self.bytes::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, Problem> {
        self.bytes::<8>(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, Problem> {
        let n = self.u64(what)?;
        self.text(n, what)
    }

    fn text(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<String, Problem> {
        self.need(n, what)?;
        let mut buf = vec![0u8; n as usize];
        self.r.read_exact(&mut buf)?;
        self.pos += n;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    /// One metadata value of a scalar or string type (the caller checked the type id).
    fn scalar(&mut self, type_id: u32, what: &dyn Fn() -> String) -> Result<MetaValue, Problem> {
        Ok(match type_id {
            TYPE_U8 => MetaValue::U8(self.bytes::<1>(what)?[0]),
            TYPE_I8 => MetaValue::I8(self.bytes::<1>(what).map(i8::from_le_bytes)?),
            TYPE_BOOL => MetaValue::Bool(self.bytes::<1>(what)?[0] != 0),
            TYPE_U16 => MetaValue::U16(self.bytes::<2>(what).map(u16::from_le_bytes)?),
            TYPE_I16 => MetaValue::I16(self.bytes::<2>(what).map(i16::from_le_bytes)?),
            TYPE_U32 => MetaValue::U32(self.u32(what)?),
            TYPE_I32 => MetaValue::I32(self.bytes::<4>(what).map(i32::from_le_bytes)?),
            TYPE_F32 => MetaValue::F32(self.bytes::<4>(what).map(f32::from_le_bytes)?),
            TYPE_U64 => MetaValue::U64(self.u64(what)?),
            TYPE_I64 => MetaValue::I64(self.bytes::<8>(what).map(i64::from_le_bytes)?),
            TYPE_F64 => MetaValue::F64(self.bytes::<8>(what).map(f64::from_le_bytes)?),
            TYPE_STRING => MetaValue::Str(self.string(what)?),
            _ => return Err(Problem::Malformed(format!("{}: invalid type {type_id}", what()))),
        })
    }

    fn layout(&mut self) -> Result<Layout, Problem> {
        if self.len < 4 {
            return Err(Problem::NotGguf(format!("only {} bytes long", self.len)));
        }
        let magic = self.bytes::<4>(&|| "magic".into())?;
        if &magic != b"GGUF" {
            let hex: Vec<String> = magic.iter().map(|b| format!("{b:02x}")).collect();
            return Err(Problem::NotGguf(format!("it starts with bytes {}, a GGUF file starts with \"GGUF\"", hex.join(" "))));
        }
        let version = self.u32(&|| "the version".into())?;
        if version != 2 && version != 3 {
            let detail = if version & 0xffff == 0 {
                "a big-endian file? only little-endian GGUF v2 and v3 are supported"
            } else {
                "only GGUF v2 and v3 are supported, as in llama.cpp"
            };
            return Err(Problem::Version(version, detail.into()));
        }
        let n_tensors = self.u64(&|| "the tensor count".into())?;
        let n_kv = self.u64(&|| "the key/value count".into())?;

        let mut kv = Vec::new();
        let mut seen = HashSet::new();
        let mut alignment = DEFAULT_ALIGNMENT;
        let mut elements = 0u64;
        // Every pass consumes bytes or fails on a bound, so a huge count cannot loop long.
        for i in 0..n_kv {
            let what = |s: &str| format!("key/value pair {i} of {n_kv} ({s})");
            let key = self.string(&|| what("key"))?;
            if key.is_empty() || !seen.insert(key.clone()) {
                return Err(Problem::Malformed(format!("key/value pair {i} has an empty or repeated key '{key}'")));
            }
            let what = |s: &str| format!("the {s} of key {key}");
            let type_id = self.u32(&|| what("type"))?;
            let value = if type_id == TYPE_ARRAY {
                let elem = self.u32(&|| what("array element type"))?;
                let n = self.u64(&|| what("array length"))?;
                elements = elements.saturating_add(n);
                if elements > MAX_ARRAY_ELEMENTS {
                    return Err(Problem::Malformed(format!("key {key}: arrays hold more than {MAX_ARRAY_ELEMENTS} elements")));
                }
                if elem != TYPE_STRING && meta_scalar_size(elem).is_none() {
                    return Err(Problem::Malformed(format!("key {key}: invalid array element type {elem}")));
                }
                // Each element is at least one byte (a string at least its 8-byte length), so
                // this bounds the allocation by the file before anything is read.
                self.need(n.saturating_mul(meta_scalar_size(elem).unwrap_or(8)), &|| what("array"))?;
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.scalar(elem, &|| what("array"))?);
                }
                MetaValue::Array(elem, items)
            } else if type_id == TYPE_STRING || meta_scalar_size(type_id).is_some() {
                self.scalar(type_id, &|| what("value"))?
            } else {
                return Err(Problem::Malformed(format!("key {key}: invalid value type {type_id}")));
            };
            if key == "general.alignment" {
                let MetaValue::U32(a) = value else {
                    return Err(Problem::Malformed("general.alignment must be a u32".into()));
                };
                if !a.is_power_of_two() {
                    return Err(Problem::Malformed(format!("general.alignment {a} is not a power of 2")));
                }
                alignment = u64::from(a);
            }
            kv.push((key, value));
        }

        let mut tensors = Vec::new();
        let mut names = HashSet::new();
        for i in 0..n_tensors {
            let what = |s: &str| format!("tensor info {i} of {n_tensors} ({s})");
            let name_len = self.u64(&|| what("name"))?;
            if name_len >= MAX_TENSOR_NAME {
                return Err(Problem::Malformed(format!("tensor {i} has a {name_len}-byte name (ggml allows < {MAX_TENSOR_NAME})")));
            }
            let name = self.text(name_len, &|| what("name"))?;
            if !names.insert(name.clone()) {
                return Err(Problem::Malformed(format!("tensor {name} appears twice")));
            }
            let what = |s: &str| format!("the {s} of tensor {name}");
            let n_dims = self.u32(&|| what("dimension count"))?;
            if n_dims > 4 {
                return Err(Problem::Malformed(format!("tensor {name} has {n_dims} dimensions (ggml allows 4)")));
            }
            let shape = (0..n_dims).map(|_| self.u64(&|| what("shape"))).collect::<Result<Vec<_>, _>>()?;
            let ggml_type = self.u32(&|| what("type"))?;
            let offset = self.u64(&|| what("offset"))?;
            let Some((type_name, _, _)) = ggml_type_info(ggml_type) else {
                return Err(Problem::Malformed(format!("tensor {name} has unknown ggml type {ggml_type}")));
            };
            let nbytes = ggml_nbytes(ggml_type, &shape).ok_or_else(|| {
                Problem::Malformed(format!("tensor {name}: shape {shape:?} does not fit type {type_name}"))
            })?;
            if offset % alignment != 0 {
                return Err(Problem::Malformed(format!("tensor {name}: data offset {offset} is not a multiple of {alignment}")));
            }
            tensors.push(TensorInfo { name, ggml_type, type_name, shape, offset, nbytes });
        }

        let data_start = self.pos.next_multiple_of(alignment);
        for t in &mut tensors {
            let end = data_start.checked_add(t.offset).and_then(|s| s.checked_add(t.nbytes));
            match end {
                Some(end) if end <= self.len => t.offset += data_start,
                _ => {
                    return Err(Problem::Truncated(format!(
                        "tensor {} ({} bytes at data offset {}) ends past the end of the file ({} bytes)",
                        t.name, t.nbytes, t.offset, self.len
                    )))
                }
            }
        }
        Ok(Layout { version, kv, tensors })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufWriter;

    fn tmp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("dflash2-read-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn tiny(arch: &str) -> GgufWriter {
        let mut w = GgufWriter::new();
        w.set_str("general.architecture", arch).unwrap();
        w.set_u32(&format!("{arch}.embedding_length"), 8).unwrap();
        w.set_u32(&format!("{arch}.block_count"), 4).unwrap();
        w.set("tokenizer.ggml.tokens", MetaValue::str_array(["a", "b", "c", "<m>"])).unwrap();
        w.set("tokenizer.ggml.token_type", MetaValue::i32_array([1, 1, 1, 3])).unwrap();
        w.set("tokenizer.ggml.merges", MetaValue::str_array(Vec::<String>::new())).unwrap();
        w.set_u32("tokenizer.ggml.mask_token_id", 3).unwrap();
        w.set("tokenizer.ggml.scores", MetaValue::f32_array([0.0, -1.5, f32::NAN, 2.0])).unwrap();
        w
    }

    fn drafter() -> GgufWriter {
        let mut w = tiny("dflash");
        w.set("dflash.target_layers", MetaValue::i32_array([1, 3])).unwrap();
        w.set_u32("dflash.block_size", 16).unwrap();
        w.add_f32("fc.weight", &[16, 8], &[0.5; 128]).unwrap();
        w.add_i64("d2t", &[4], &[0, 1, 2, 3]).unwrap();
        w
    }

    fn info(w: &GgufWriter, dir: &Path, name: &str) -> ModelInfo {
        let path = dir.join(name);
        w.write(&path).unwrap();
        read_model_info(&path).unwrap()
    }

    /// What llama.cpp asserts on while loading (an abort of the process) is refused by name.
    #[test]
    fn values_llama_cpp_aborts_on_are_refused_first() {
        let dir = tmp_dir("aborts");
        let refused = |edit: &dyn Fn(&mut GgufWriter), needle: &str| {
            let mut w = tiny("llama");
            edit(&mut w);
            let path = dir.join("m.gguf");
            w.write(&path).unwrap();
            let e = read_model_info(&path).expect_err(needle).to_string();
            assert!(e.contains(needle) && e.contains("llama.cpp would abort"), "{needle}: {e}");
        };
        refused(&|w| w.set_u32("llama.block_count", 0).unwrap(), "llama.block_count: 0 layers");
        refused(&|w| w.set_u32("llama.block_count", 513).unwrap(), "llama.block_count: 513 layers");
        refused(&|w| w.set_u32("llama.nextn_predict_layers", 5).unwrap(), "llama.nextn_predict_layers");
        refused(&|w| w.set_u32("llama.expert_count", 2000).unwrap(), "llama.expert_count");
        refused(&|w| w.set_u32("llama.expert_used_count", 2).unwrap(), "llama.expert_used_count: 2 of 0 experts");
        refused(&|w| w.set_u32("llama.expert_count", 8).unwrap(), "llama.expert_used_count: 0 of 8 experts");
        refused(
            &|w| {
                w.set_u32("llama.expert_count", 8).unwrap();
                w.set_u32("llama.expert_used_count", 2).unwrap();
                w.set_u32("llama.expert_group_count", 3).unwrap();
            },
            "llama.expert_group_count: 3 groups",
        );
        refused(&|w| w.set_str("llama.rope.scaling.type", "spiral").unwrap(), "llama.rope.scaling.type");
        refused(
            &|w| {
                w.set_str("tokenizer.ggml.model", "bert").unwrap();
                w.set("tokenizer.ggml.token_type", MetaValue::i32_array([1, 6, 1, 3])).unwrap();
            },
            "token 1 is a byte token",
        );
        refused(&|w| w.set("tokenizer.ggml.tokens", MetaValue::str_array(["a", "b", "a", "<m>"])).unwrap(), "tokens 0 and 2");
        refused(&|w| w.set("tokenizer.ggml.tokens", MetaValue::str_array(["a", "b\0x", "b", "<m>"])).unwrap(), "tokens 1 and 2");
        // what real models hold passes
        let mut w = tiny("llama");
        w.set_u32("llama.expert_count", 8).unwrap();
        w.set("llama.expert_used_count", MetaValue::i32_array([2, 2, 2, 2])).unwrap();
        w.set_u32("llama.expert_group_count", 4).unwrap();
        w.set_u32("llama.expert_group_used_count", 2).unwrap();
        w.set_str("llama.rope.scaling.type", "yarn").unwrap();
        w.set("tokenizer.ggml.tokens", MetaValue::str_array(["a", "", "c", "<m>"])).unwrap();
        info(&w, &dir, "ok.gguf");
    }

    #[test]
    fn round_trip_through_the_reader() {
        let dir = tmp_dir("rt");
        let mut w = drafter();
        w.set_bool("dflash.attention.causal", true).unwrap();
        w.add_f16("x.weight", &[2, 2], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        let path = dir.join("d.gguf");
        w.write(&path).unwrap();
        let g = read_gguf(&path).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap().len(), 4);
        assert_eq!(g.get("tokenizer.ggml.token_type"), Some(&MetaValue::i32_array([1, 1, 1, 3])));
        let scores = g.get("tokenizer.ggml.scores").unwrap().as_array().unwrap();
        assert_eq!(scores[1], MetaValue::F32(-1.5));
        assert!(matches!(scores[2], MetaValue::F32(v) if v.is_nan()));
        let d2t = g.tensor("d2t").unwrap();
        assert_eq!((d2t.ggml_type, d2t.nbytes, d2t.offset % 32), (27, 32, 0));
        let bytes = std::fs::read(&path).unwrap();
        let at = d2t.offset as usize;
        assert_eq!(&bytes[at + 8..at + 16], &1i64.to_le_bytes());
        assert_eq!(g.tensor("x.weight").unwrap().nbytes, 8);

        let m = ModelInfo::from_gguf(&g).unwrap();
        assert_eq!((m.architecture.as_str(), m.n_embd, m.n_layer, m.n_vocab, m.mask_id), ("dflash", 8, 4, 4, Some(3)));
        let d = m.dflash.unwrap();
        assert_eq!(d.target_layers, vec![1, 3]);
        assert_eq!((d.block_size, d.selector_top_k, d.d2t_len, d.fc_shape, d.causal), (Some(16), 0, Some(4), Some([16, 8]), true));
        // the metadata comes back typed and in write order, so a copy is verbatim
        let mut copy = GgufWriter::new();
        for (k, v) in &g.metadata {
            copy.set(k, v.clone()).unwrap();
        }
        let copy_path = dir.join("copy.gguf");
        copy.write(&copy_path).unwrap();
        let again = read_gguf(&copy_path).unwrap();
        assert_eq!(format!("{:?}", again.metadata), format!("{:?}", g.metadata));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn bad_files_give_distinct_errors() {
        let dir = tmp_dir("bad");
        let missing = dir.join("missing.gguf");
        assert!(matches!(read_gguf(&missing), Err(GgufError::NotFound { .. })));

        let text = dir.join("text.gguf");
        std::fs::write(&text, "hello world, not a model").unwrap();
        let err = read_gguf(&text).unwrap_err();
        assert!(matches!(err, GgufError::NotGguf { .. }), "{err}");
        assert!(err.to_string().contains("text.gguf"));

        let good = drafter().to_bytes();
        let v1 = dir.join("v1.gguf");
        let mut bytes = good.clone();
        bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
        std::fs::write(&v1, &bytes).unwrap();
        assert!(matches!(read_gguf(&v1), Err(GgufError::Version { version: 1, .. })));

        // cut inside the tensor data, inside the header, and right after the magic
        for cut in [good.len() - 1, 100, 6] {
            let p = dir.join(format!("cut{cut}.gguf"));
            std::fs::write(&p, &good[..cut]).unwrap();
            let err = read_gguf(&p).unwrap_err();
            assert!(matches!(err, GgufError::Truncated { .. }), "cut at {cut}: {err}");
        }

        // a header announcing an absurd number of keys and a 1 TB string
        let mut huge = good[..24].to_vec();
        huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        huge.extend_from_slice(&(1u64 << 40).to_le_bytes());
        let p = dir.join("huge.gguf");
        std::fs::write(&p, &huge).unwrap();
        assert!(matches!(read_gguf(&p), Err(GgufError::Truncated { .. })));

        // tensor type 40 makes gguf-rs panic if it sees it: the scan must take it first
        let mut w = GgufWriter::new();
        w.set_str("general.architecture", "llama").unwrap();
        w.add_f32("t", &[64], &[0.0; 64]).unwrap();
        let mut bytes = w.to_bytes();
        let name_at = bytes.windows(1 + 8).position(|win| win == b"\x01\x00\x00\x00\x00\x00\x00\x00t").unwrap() + 9;
        let type_pos = name_at + 4 + 8; // n_dims, one dim
        bytes[type_pos..type_pos + 4].copy_from_slice(&40u32.to_le_bytes());
        let p = dir.join("nvfp4.gguf");
        std::fs::write(&p, &bytes).unwrap();
        // NVFP4 is a real type: 64 elements are one 36-byte block, which fits the data written
        assert_eq!(read_gguf(&p).unwrap().tensors[0].type_name, "NVFP4");
        bytes[type_pos..type_pos + 4].copy_from_slice(&99u32.to_le_bytes());
        std::fs::write(&p, &bytes).unwrap();
        assert!(matches!(read_gguf(&p), Err(GgufError::Malformed { .. })));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn check_pair_files_names_both_files() {
        let dir = tmp_dir("files");
        let (t, d) = (dir.join("t.gguf"), dir.join("d.gguf"));
        tiny("llama").write(&t).unwrap();
        drafter().write(&d).unwrap();
        let (ti, di) = check_pair_files(&t, &d).unwrap();
        assert_eq!((ti.architecture.as_str(), di.architecture.as_str()), ("llama", "dflash"));
        let e = check_pair_files(&d, &t).unwrap_err().to_string();
        assert!(e.contains("t.gguf cannot draft for") && e.contains("architecture: the drafter is 'llama'"), "{e}");
        let missing = check_pair_files(&dir.join("x.gguf"), &d);
        assert!(matches!(missing, Err(PairCheckError::Read(GgufError::NotFound { .. }))));
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn target_info(n_vocab_tokens: &[&str]) -> ModelInfo {
        let dir = tmp_dir(&format!("t{}", n_vocab_tokens.len()));
        let mut w = tiny("llama");
        w.set("tokenizer.ggml.tokens", MetaValue::str_array(n_vocab_tokens.iter().copied())).unwrap();
        w.set("tokenizer.ggml.token_type", MetaValue::i32_array(vec![1; n_vocab_tokens.len()])).unwrap();
        let m = info(&w, &dir, "t.gguf");
        std::fs::remove_dir_all(dir).unwrap();
        m
    }

    #[test]
    fn check_pair_accepts_a_match_and_rejects_each_mismatch() {
        let dir = tmp_dir("pair");
        let target = info(&tiny("llama"), &dir, "t.gguf");
        let good = info(&drafter(), &dir, "d.gguf");
        // layer 3 of a 4-layer target is the last valid input id
        assert_eq!(check_pair(&target, &good), Ok(()));

        assert!(matches!(check_pair(&target, &target), Err(PairError::NotADrafter(a)) if a == "llama"));
        assert!(matches!(check_pair(&good, &good), Err(PairError::TargetIsDrafter)));

        let mut d = good.clone();
        d.dflash.as_mut().unwrap().target_layers = vec![1, 4];
        let e = check_pair(&target, &d).unwrap_err();
        assert_eq!(e, PairError::LayerOutOfRange { id: 4, n_layer: 4 });
        assert!(e.to_string().contains("1..=3"), "{e}");
        d.dflash.as_mut().unwrap().target_layers = vec![0, 1];
        assert!(matches!(check_pair(&target, &d), Err(PairError::LayerOutOfRange { id: 0, .. })));

        let other_vocab = target_info(&["a", "b", "c"]);
        let e = check_pair(&other_vocab, &good).unwrap_err();
        assert_eq!(e.to_string(), "vocabulary size: target has 3, drafter has 4");
        let other_tokens = target_info(&["a", "b", "x", "<m>"]);
        assert!(matches!(check_pair(&other_tokens, &good), Err(PairError::Tokenizer { .. })));

        let mut d = good.clone();
        d.mask_id = None;
        assert_eq!(check_pair(&target, &d), Err(PairError::NoMask));
        d.mask_id = Some(4);
        assert_eq!(check_pair(&target, &d), Err(PairError::MaskOutOfRange { id: 4, n_vocab: 4 }));

        for (bad, want) in [(Some(1), PairError::BlockSize(1)), (Some(65), PairError::BlockSize(65)), (None, PairError::NoBlockSize)] {
            let mut d = good.clone();
            d.dflash.as_mut().unwrap().block_size = bad;
            assert_eq!(check_pair(&target, &d), Err(want));
        }

        let mut d = good.clone();
        d.n_embd = 16;
        let e = check_pair(&target, &d).unwrap_err();
        assert!(matches!(e, PairError::EmbdWidth { target: 8, drafter: 16, .. }), "{e}");
        assert!(e.to_string().starts_with("embedding width: target has 8, drafter has 16 (the drafter embeds"), "{e}");
        d.dflash.as_mut().unwrap().has_token_embd = true;
        assert!(matches!(check_pair(&target, &d), Err(PairError::EmbdWidth { why, .. }) if why.contains("fc")));
        d.dflash.as_mut().unwrap().fc_shape = Some([32, 16]);
        assert!(matches!(check_pair(&target, &d), Err(PairError::FcWidth { fc_in: 32, expected: 16, .. })));

        let mut d = good.clone();
        {
            let x = d.dflash.as_mut().unwrap();
            (x.selector_top_k, x.selector_rank, x.conv_kernel_size, x.conv_group_size, x.has_selector) = (2, 4, 4, 4, true);
        }
        assert_eq!(check_pair(&target, &d), Ok(())); // 8 >= 2*3
        d.dflash.as_mut().unwrap().selector_top_k = 3;
        assert_eq!(check_pair(&target, &d), Err(PairError::SelectorWidth { k: 3, need: 12, n_embd: 8 }));
        d.dflash.as_mut().unwrap().selector_top_k = 2;
        d.dflash.as_mut().unwrap().has_selector = false;
        assert!(matches!(check_pair(&target, &d), Err(PairError::SelectorIncomplete { .. })));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
