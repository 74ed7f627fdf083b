//! Hugging Face DFlash / DFlash 2 drafter checkpoint -> GGUF (arch `dflash`).
//!
//! Reads the layout z-lab publishes (`config.json` with a `dflash_config`, weights in
//! safetensors as bf16, f16 or f32) plus the target GGUF (tokenizer metadata, which a
//! drafter must share with its target), and writes a GGUF that the bundled llama.cpp loads.
//! Weight names are those of z-lab's `dflash` package (`DFlashDraftModel` /
//! `DFlash2DraftModel`); a `model.` prefix is accepted. Two additions for drafters with a
//! reduced draft vocabulary: `lm_head.weight` [draft_vocab, hidden] and `d2t`
//! [draft_vocab] (draft row -> target token id, absolute ids).
//!
//! The off-by-one: the reference's `target_layer_ids` name layer OUTPUTS
//! (`hidden_states[id + 1]`), llama.cpp's `dflash.target_layers` name layer INPUTS, and the
//! output of layer `id` is the input of layer `id + 1`; so GGUF = reference + 1.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

use super::read::{read_gguf, ModelInfo};
use super::GgufWriter;

/// How the converter stores matrices (vectors and conv kernels are always F32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutType {
    F32,
    F16,
    #[value(name = "q8_0")]
    Q8_0,
}

/// A drafter's shape, read from `config.json`.
#[derive(Clone, Debug)]
pub struct DrafterConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub max_position_embeddings: Option<u32>,
    pub hidden_act: String,
    /// The reference's ids (layer outputs).
    pub target_layer_ids: Vec<i64>,
    pub block_size: u32,
    pub mask_token_id: u32,
    /// (conv kernel, conv group size, selector rank, selector top-k): DFlash 2 only.
    pub dflash2: Option<(u32, u32, u32, u32)>,
}

/// Bounds of a drafter config's counts and sizes (far above any real drafter: DFlash drafters have
/// a few layers as wide as their target).
const MAX_LAYERS: u64 = 256;
const MAX_WIDTH: u64 = 1 << 16;
const MAX_HEADS: u64 = 1024;
const MAX_BLOCK: u64 = 1024;

impl DrafterConfig {
    pub fn from_json(v: &Value) -> Result<Self> {
        let num = |key: &str| -> Result<u64> {
            v.get(key).and_then(Value::as_u64).ok_or_else(|| anyhow!("config.json: missing or non-integer \"{key}\""))
        };
        let dc = v
            .get("dflash_config")
            .ok_or_else(|| anyhow!("config.json: no \"dflash_config\" (not a DFlash drafter checkpoint?)"))?;
        let dnum = |key: &str| dc.get(key).and_then(Value::as_u64);
        let dreq = |key: &str| dnum(key).ok_or_else(|| anyhow!("config.json: dflash_config has no integer \"{key}\""));
        // Every count and size is bounded before anything loops over it or multiplies it: no
        // drafter is larger, and the GGUF stores them as u32.
        let sized = |key: &str, value: u64, max: u64| -> Result<usize> {
            if !(1..=max).contains(&value) {
                bail!("config.json: \"{key}\" is {value}; expected 1 to {max}");
            }
            Ok(value as usize)
        };
        let hidden_size = sized("hidden_size", num("hidden_size")?, MAX_WIDTH)?;
        let heads = sized("num_attention_heads", num("num_attention_heads")?, MAX_HEADS)?;
        let target_layer_ids = dc
            .get("target_layer_ids")
            .and_then(Value::as_array)
            .ok_or_else(|| anyhow!("config.json: dflash_config has no \"target_layer_ids\" list"))?
            .iter()
            .map(|x| x.as_i64().ok_or_else(|| anyhow!("config.json: target_layer_ids must be integers")))
            .collect::<Result<Vec<_>>>()?;
        if target_layer_ids.is_empty() {
            bail!("config.json: target_layer_ids is empty");
        }
        let dflash2 = match dnum("selector_top_k") {
            None | Some(0) => None,
            Some(k) => Some((
                sized("conv_kernel_size", dreq("conv_kernel_size")?, MAX_BLOCK)? as u32,
                sized("conv_group_size", dreq("conv_group_size")?, hidden_size as u64)? as u32,
                sized("selector_rank", dreq("selector_rank")?, MAX_WIDTH)? as u32,
                sized("selector_top_k", k, MAX_HEADS)? as u32,
            )),
        };
        let kv_heads = v.get("num_key_value_heads").and_then(Value::as_u64).unwrap_or(heads as u64);
        let kv_heads = sized("num_key_value_heads", kv_heads, heads as u64)?;
        if heads % kv_heads != 0 {
            bail!("config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}");
        }
        let head_dim = match v.get("head_dim").and_then(Value::as_u64) {
            Some(h) => sized("head_dim", h, MAX_WIDTH)?,
            None if hidden_size % heads == 0 => hidden_size / heads,
            None => bail!("config.json: no \"head_dim\", and hidden_size {hidden_size} is not a multiple of {heads} heads"),
        };
        let mask_token_id = dnum("mask_token_id")
            .or_else(|| v.get("mask_token_id").and_then(Value::as_u64))
            .ok_or_else(|| anyhow!("config.json: dflash_config has no \"mask_token_id\""))?;
        let mask_token_id =
            u32::try_from(mask_token_id).map_err(|_| anyhow!("config.json: mask_token_id {mask_token_id} is not a token id"))?;
        Ok(Self {
            hidden_size,
            intermediate_size: sized("intermediate_size", num("intermediate_size")?, MAX_WIDTH)?,
            num_hidden_layers: sized("num_hidden_layers", num("num_hidden_layers")?, MAX_LAYERS)?,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: v.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6) as f32,
            rope_theta: v.get("rope_theta").and_then(Value::as_f64).unwrap_or(10000.0) as f32,
            max_position_embeddings: v.get("max_position_embeddings").and_then(Value::as_u64).map(|x| x as u32),
            hidden_act: v.get("hidden_act").and_then(Value::as_str).unwrap_or("silu").to_string(),
            target_layer_ids,
            block_size: sized("block_size", dnum("block_size").unwrap_or(16), MAX_BLOCK)? as u32,
            mask_token_id,
            dflash2,
        })
    }
}

/// One tensor read from safetensors, as f32 with its torch shape (outermost first).
struct HfTensor {
    shape: Vec<usize>,
    data: Vec<f32>,
    /// Integer tensors (`d2t`) keep their values here.
    ints: Option<Vec<i64>>,
}

fn load_safetensors(dir: &Path) -> Result<HashMap<String, HfTensor>> {
    use safetensors::tensor::Dtype;
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("{}: no .safetensors files", dir.display());
    }
    let mut out = HashMap::new();
    for f in files {
        let bytes = std::fs::read(&f).with_context(|| format!("reading {}", f.display()))?;
        let st = safetensors::SafeTensors::deserialize(&bytes).with_context(|| format!("{}: not safetensors", f.display()))?;
        for (name, view) in st.tensors() {
            let raw = view.data();
            let (data, ints) = match view.dtype() {
                Dtype::F32 => (raw.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(), None),
                Dtype::F16 => {
                    (raw.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(), None)
                }
                Dtype::BF16 => {
                    (raw.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(), None)
                }
                Dtype::I64 => (Vec::new(), Some(raw.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect())),
                Dtype::I32 => {
                    (Vec::new(), Some(raw.chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64).collect()))
                }
                other => bail!("{}: tensor {name} has dtype {other:?}; expected bf16, f16, f32 (or i64 for d2t)", f.display()),
            };
            let name = name.strip_prefix("model.").unwrap_or(&name).to_string();
            out.insert(name, HfTensor { shape: view.shape().to_vec(), data, ints });
        }
    }
    Ok(out)
}

/// HF name -> GGUF name of one layer's tensors (`pairs`: the names after the layer prefixes).
fn layer_names(il: usize, pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(h, g)| (format!("layers.{il}.{h}"), format!("blk.{il}.{g}"))).collect()
}

const LAYER_TENSORS: [(&str, &str); 11] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
];

/// DFlash 2's dynamic convolutions around attention and FFN.
const CONV_TENSORS: [(&str, &str); 4] = [
    ("attention_conv.base_kernel", "attn_conv_base"),
    ("attention_conv.kernel_projection.weight", "attn_conv_proj.weight"),
    ("mlp_conv.base_kernel", "ffn_conv_base"),
    ("mlp_conv.kernel_projection.weight", "ffn_conv_proj.weight"),
];

/// What [`convert`] wrote.
#[derive(Debug)]
pub struct Converted {
    pub path: PathBuf,
    pub n_tensors: usize,
    pub target_layers: Vec<i64>,
    pub draft_vocab: Option<usize>,
}

/// Convert the checkpoint in `dir` for `target` into `out`.
pub fn convert(dir: &Path, target: &Path, out: &Path, out_type: OutType) -> Result<Converted> {
    let cfg_path = dir.join("config.json");
    let cfg_text = std::fs::read_to_string(&cfg_path).with_context(|| format!("reading {}", cfg_path.display()))?;
    let cfg_json: Value = serde_json::from_str(&cfg_text).with_context(|| format!("{}: not JSON", cfg_path.display()))?;
    let cfg = DrafterConfig::from_json(&cfg_json)?;
    let g = read_gguf(target)?;
    let tinfo = ModelInfo::from_gguf(&g)?;
    if tinfo.dflash.is_some() {
        bail!("{}: is a DFlash drafter; --target must be the target model", target.display());
    }

    // GGUF counts layer inputs: reference id + 1 (see the module comment)
    let target_layers: Vec<i64> = cfg.target_layer_ids.iter().map(|&id| id + 1).collect();
    if let Some(&bad) = target_layers.iter().find(|&&l| l < 1 || l >= i64::from(tinfo.n_layer)) {
        bail!(
            "target_layer_ids {:?}: layer output {} is not followed by a layer of the {}-layer target (GGUF layer input {bad})",
            cfg.target_layer_ids,
            bad - 1,
            tinfo.n_layer
        );
    }
    if cfg.mask_token_id >= tinfo.n_vocab {
        bail!("mask_token_id {} is outside the target's vocabulary of {}", cfg.mask_token_id, tinfo.n_vocab);
    }

    let mut tensors = load_safetensors(dir)?;

    let mut w = GgufWriter::new();
    let arch = "dflash";
    w.set_str("general.architecture", arch)?;
    let tname = tinfo.name.clone().unwrap_or_else(|| tinfo.architecture.clone());
    let kind = if cfg.dflash2.is_some() { "DFlash 2" } else { "DFlash" };
    w.set_str("general.name", &format!("{kind} drafter for {tname}"))?;
    let ctx_len = cfg.max_position_embeddings.or(tinfo.context_length).unwrap_or(4096);
    w.set_u32(&format!("{arch}.context_length"), ctx_len)?;
    w.set_u32(&format!("{arch}.embedding_length"), cfg.hidden_size as u32)?;
    w.set_u32(&format!("{arch}.block_count"), cfg.num_hidden_layers as u32)?;
    w.set_u32(&format!("{arch}.feed_forward_length"), cfg.intermediate_size as u32)?;
    w.set_u32(&format!("{arch}.attention.head_count"), cfg.num_attention_heads as u32)?;
    w.set_u32(&format!("{arch}.attention.head_count_kv"), cfg.num_key_value_heads as u32)?;
    w.set_u32(&format!("{arch}.attention.key_length"), cfg.head_dim as u32)?;
    w.set_u32(&format!("{arch}.attention.value_length"), cfg.head_dim as u32)?;
    w.set_u32(&format!("{arch}.rope.dimension_count"), cfg.head_dim as u32)?;
    w.set_f32(&format!("{arch}.rope.freq_base"), cfg.rope_theta)?;
    w.set_f32(&format!("{arch}.attention.layer_norm_rms_epsilon"), cfg.rms_norm_eps)?;
    if cfg.hidden_act != "silu" {
        w.set_str(&format!("{arch}.hidden_act"), &cfg.hidden_act)?;
    }
    let layers_i32: Vec<i32> = target_layers.iter().map(|&l| l as i32).collect();
    w.set_dflash(&layers_i32, cfg.block_size, cfg.dflash2)?;
    w.set_tokenizer_of(&g, cfg.mask_token_id)?;

    // (hf name, gguf name, torch shape it must have)
    let (e, hd) = (cfg.hidden_size, cfg.head_dim);
    let n_ids = target_layers.len();
    let mut plan: Vec<(String, String, Vec<usize>)> = vec![
        ("fc.weight".into(), "fc.weight".into(), vec![e, n_ids * tinfo.n_embd as usize]),
        ("hidden_norm.weight".into(), "enc.output_norm.weight".into(), vec![e]),
        ("norm.weight".into(), "output_norm.weight".into(), vec![e]),
    ];
    for il in 0..cfg.num_hidden_layers {
        let shapes = [
            vec![e],
            vec![cfg.num_attention_heads * hd, e],
            vec![cfg.num_key_value_heads * hd, e],
            vec![cfg.num_key_value_heads * hd, e],
            vec![e, cfg.num_attention_heads * hd],
            vec![hd],
            vec![hd],
            vec![e],
            vec![cfg.intermediate_size, e],
            vec![cfg.intermediate_size, e],
            vec![e, cfg.intermediate_size],
        ];
        for ((h, g), s) in layer_names(il, &LAYER_TENSORS).into_iter().zip(shapes) {
            plan.push((h, g, s));
        }
        if let Some((kernel, group, _, _)) = cfg.dflash2 {
            let (kernel, group) = (kernel as usize, group as usize);
            if group == 0 || e % group != 0 {
                bail!("conv_group_size {group} does not divide hidden_size {e}");
            }
            let proj = 2 * kernel * (e / group);
            let shapes = [vec![2, kernel, e], vec![proj, e], vec![2, kernel, e], vec![proj, e]];
            for ((h, g), s) in layer_names(il, &CONV_TENSORS).into_iter().zip(shapes) {
                plan.push((h, g, s));
            }
        }
    }
    let n_vocab = tinfo.n_vocab as usize;
    if let Some((_, _, rank, top_k)) = cfg.dflash2 {
        let rank = rank as usize;
        if e < (top_k * (top_k + 1)) as usize {
            bail!("hidden_size {e} is too small for the selector lattice of top-k {top_k} (needs K*(K+1))");
        }
        for side in ["predecessor", "successor"] {
            let h = format!("candidate_selector.{side}_codebook");
            // z-lab's checkpoints store the codebooks without the `.weight` suffix
            if let Some(t) = tensors.remove(&format!("{h}.weight")) {
                tensors.insert(h.clone(), t);
            }
            plan.push((h, format!("selector_{side}.weight"), vec![n_vocab, rank]));
        }
        plan.push(("candidate_selector.hidden_projection.weight".into(), "selector_hidden.weight".into(), vec![rank, e]));
    }
    // optional: own embeddings / own (reduced-vocabulary) head
    let d2t = tensors.remove("d2t");
    let draft_vocab = match &d2t {
        Some(t) => {
            let ids = t.ints.as_ref().ok_or_else(|| anyhow!("d2t must be an integer tensor (i64 target ids)"))?;
            if let Some(&bad) = ids.iter().find(|&&id| id < 0 || id as usize >= n_vocab) {
                bail!("d2t maps to token {bad}, outside the target's vocabulary of {n_vocab}");
            }
            if !tensors.contains_key("lm_head.weight") {
                bail!("a checkpoint with d2t must carry its own lm_head.weight [draft_vocab, hidden]");
            }
            Some(ids.len())
        }
        None => None,
    };
    if tensors.contains_key("embed_tokens.weight") {
        plan.push(("embed_tokens.weight".into(), "token_embd.weight".into(), vec![n_vocab, e]));
    }
    if tensors.contains_key("lm_head.weight") {
        plan.push(("lm_head.weight".into(), "output.weight".into(), vec![draft_vocab.unwrap_or(n_vocab), e]));
    }

    for (hf, gg, shape) in &plan {
        let t = tensors
            .remove(hf)
            .ok_or_else(|| anyhow!("{}: missing tensor {hf} (for {gg})", dir.display()))?;
        if &t.shape != shape {
            bail!("tensor {hf}: shape {:?}, expected {:?} from config.json and the target", t.shape, shape);
        }
        // GGUF lists dimensions innermost first: the reverse of torch's
        let ggml_shape: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        let is_matrix = shape.len() == 2 && !gg.ends_with("conv_base");
        match out_type {
            _ if !is_matrix => w.add_f32(gg, &ggml_shape, &t.data)?,
            OutType::F32 => w.add_f32(gg, &ggml_shape, &t.data)?,
            OutType::F16 => w.add_f16(gg, &ggml_shape, &t.data)?,
            OutType::Q8_0 if ggml_shape[0] % 32 == 0 => w.add_q8_0(gg, &ggml_shape, &t.data)?,
            OutType::Q8_0 => w.add_f16(gg, &ggml_shape, &t.data)?,
        }
    }
    if let (Some(t), Some(n)) = (&d2t, draft_vocab) {
        w.add_i64("d2t", &[n as u64], t.ints.as_ref().expect("checked above"))?;
    }
    if !tensors.is_empty() {
        let mut left: Vec<_> = tensors.keys().cloned().collect();
        left.sort();
        bail!("{}: tensors this converter does not know (would be dropped): {}", dir.display(), left.join(", "));
    }
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    super::write::write_paired_drafter(&w, out, &tinfo)?;
    Ok(Converted { path: out.to_path_buf(), n_tensors: plan.len() + d2t.is_some() as usize, target_layers, draft_vocab })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Value {
        serde_json::json!({
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "dflash_config": {"target_layer_ids": [1, 4], "block_size": 8, "mask_token_id": 3,
                              "conv_kernel_size": 4, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
        })
    }

    #[test]
    fn a_dflash2_config_is_read_with_its_selector() {
        let c = DrafterConfig::from_json(&base()).unwrap();
        assert_eq!((c.head_dim, c.num_key_value_heads, c.block_size, c.mask_token_id), (32, 1, 8, 3));
        assert_eq!(c.dflash2, Some((4, 16, 8, 4)));
        assert_eq!(c.target_layer_ids, vec![1, 4]);
    }

    #[test]
    fn a_dflash1_config_has_no_selector() {
        let mut v = base();
        v["dflash_config"].as_object_mut().unwrap().remove("selector_top_k");
        assert_eq!(DrafterConfig::from_json(&v).unwrap().dflash2, None);
    }

    #[test]
    fn missing_fields_are_named() {
        let mut v = base();
        v.as_object_mut().unwrap().remove("hidden_size");
        assert!(DrafterConfig::from_json(&v).unwrap_err().to_string().contains("hidden_size"));
        let mut v = base();
        v.as_object_mut().unwrap().remove("dflash_config");
        assert!(DrafterConfig::from_json(&v).unwrap_err().to_string().contains("dflash_config"));
        let mut v = base();
        v["dflash_config"].as_object_mut().unwrap().remove("conv_group_size");
        assert!(DrafterConfig::from_json(&v).unwrap_err().to_string().contains("conv_group_size"));
        let mut v = base();
        v["dflash_config"]["target_layer_ids"] = serde_json::json!([]);
        assert!(DrafterConfig::from_json(&v).unwrap_err().to_string().contains("empty"));
    }
}
