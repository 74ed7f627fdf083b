//! A small deterministic GGUF v3 writer.
//!
//! gguf-rs 0.1.8 has a writer, but it sorts keys, sizes I64 tensors as if they were 256-element
//! blocks (so a `d2t` tensor is rejected) and pads byte by byte; this one is short enough to own.
//! Keys and tensors are written in insertion order, tensor data aligned to 32 bytes (the GGUF
//! default, so no `general.alignment` key is needed): the same calls give the same bytes.

use std::io;
use std::path::Path;

use super::{ggml_nbytes, MetaValue, GGML_F16, GGML_F32, GGML_I64, GGML_Q4_1, GGML_Q8_0, TYPE_ARRAY};

const ALIGNMENT: usize = 32;

/// Values per ggml `block_q4_1` (QK4_1); a block is `ggml_half d, m; uint8_t qs[16]`, 20 bytes.
pub const QK4_1: usize = 32;
const Q4_1_BLOCK_BYTES: usize = 4 + QK4_1 / 2;

/// Errors building a GGUF file in memory (all are programming errors of the caller).
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("tensor {name}: shape {shape:?} holds {expected} elements but {got} were given")]
    ElementCount { name: String, shape: Vec<u64>, expected: u64, got: usize },
    #[error("tensor {name}: first dimension of shape {shape:?} is not a multiple of the block size {block}")]
    BlockSize { name: String, shape: Vec<u64>, block: u64 },
    #[error("tensor {name} is added twice")]
    DuplicateTensor { name: String },
    #[error("metadata key {key}: array elements must all have type {elem_type} and not be arrays")]
    MixedArray { key: String, elem_type: u32 },
}

struct Tensor {
    name: String,
    shape: Vec<u64>,
    ggml_type: u32,
    bytes: Vec<u8>,
}

/// Collects metadata and tensors, then serializes them in one go.
#[derive(Default)]
pub struct GgufWriter {
    kv: Vec<(String, MetaValue)>,
    tensors: Vec<Tensor>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets a key; a key set twice keeps its first position and takes the last value.
    pub fn set(&mut self, key: &str, value: MetaValue) -> Result<(), WriteError> {
        if let MetaValue::Array(elem_type, items) = &value {
            if *elem_type == TYPE_ARRAY || items.iter().any(|v| v.type_id() != *elem_type) {
                return Err(WriteError::MixedArray { key: key.to_string(), elem_type: *elem_type });
            }
        }
        match self.kv.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.kv.push((key.to_string(), value)),
        }
        Ok(())
    }

    pub fn set_str(&mut self, key: &str, value: &str) -> Result<(), WriteError> {
        self.set(key, MetaValue::Str(value.to_string()))
    }

    pub fn set_u32(&mut self, key: &str, value: u32) -> Result<(), WriteError> {
        self.set(key, MetaValue::U32(value))
    }

    pub fn set_f32(&mut self, key: &str, value: f32) -> Result<(), WriteError> {
        self.set(key, MetaValue::F32(value))
    }

    pub fn set_bool(&mut self, key: &str, value: bool) -> Result<(), WriteError> {
        self.set(key, MetaValue::Bool(value))
    }

    /// The `dflash.*` keys of a drafter: the target layer inputs it reads, its trained block
    /// size and, for DFlash 2, (conv kernel, conv group size, selector rank, selector top-k).
    pub fn set_dflash(
        &mut self,
        target_layers: &[i32],
        block_size: u32,
        dflash2: Option<(u32, u32, u32, u32)>,
    ) -> Result<(), WriteError> {
        self.set("dflash.target_layers", MetaValue::i32_array(target_layers.iter().copied()))?;
        self.set_u32("dflash.block_size", block_size)?;
        if let Some((kernel, group, rank, top_k)) = dflash2 {
            self.set_u32("dflash.conv_kernel_size", kernel)?;
            self.set_u32("dflash.conv_group_size", group)?;
            self.set_u32("dflash.selector_rank", rank)?;
            self.set_u32("dflash.selector_top_k", top_k)?;
        }
        Ok(())
    }

    /// Every `tokenizer.*` key of `target`, verbatim (a drafter shares its target's
    /// vocabulary), and the drafter's mask token.
    pub fn set_tokenizer_of(&mut self, target: &super::Gguf, mask_id: u32) -> Result<(), WriteError> {
        for (key, value) in target.metadata.iter().filter(|(k, _)| k.starts_with("tokenizer.")) {
            self.set(key, value.clone())?;
        }
        self.set_u32("tokenizer.ggml.mask_token_id", mask_id)
    }

    /// An F32 tensor; `shape` is in ggml order (ne[0] first, the contiguous dimension).
    pub fn add_f32(&mut self, name: &str, shape: &[u64], data: &[f32]) -> Result<(), WriteError> {
        let bytes = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.add(name, shape, GGML_F32, data.len(), bytes)
    }

    /// An F16 tensor from f32 values (rounded to nearest even).
    pub fn add_f16(&mut self, name: &str, shape: &[u64], data: &[f32]) -> Result<(), WriteError> {
        let bytes = data.iter().flat_map(|&v| f32_to_f16_bits(v).to_le_bytes()).collect();
        self.add(name, shape, GGML_F16, data.len(), bytes)
    }

    /// A Q4_1 tensor (ggml `block_q4_1`), quantized as [`quantize_q4_1`]; `shape[0]` must be a
    /// multiple of [`QK4_1`]. ggml multiplies Q4_1 weights with one `vec_dot` per output value
    /// whatever the batch size (no llamafile sgemm kernel takes Q4_1), so unlike F32 weights
    /// they give bit-identical logits for a token decoded alone or inside a batch.
    pub fn add_q4_1(&mut self, name: &str, shape: &[u64], data: &[f32]) -> Result<(), WriteError> {
        let expected = shape.iter().product::<u64>();
        if expected != data.len() as u64 {
            return Err(WriteError::ElementCount { name: name.to_string(), shape: shape.to_vec(), expected, got: data.len() });
        }
        if shape.first().is_none_or(|&n| n % QK4_1 as u64 != 0) {
            return Err(WriteError::BlockSize { name: name.to_string(), shape: shape.to_vec(), block: QK4_1 as u64 });
        }
        self.add(name, shape, GGML_Q4_1, data.len(), quantize_q4_1(data))
    }

    /// A Q8_0 tensor (ggml `block_q8_0`: f16 scale, 32 signed bytes), as ggml's
    /// `quantize_row_q8_0_ref`: d = max|x| / 127, q = round(x / d); `shape[0]` a multiple of 32.
    pub fn add_q8_0(&mut self, name: &str, shape: &[u64], data: &[f32]) -> Result<(), WriteError> {
        if shape.first().is_none_or(|&n| n % 32 != 0) {
            return Err(WriteError::BlockSize { name: name.to_string(), shape: shape.to_vec(), block: 32 });
        }
        if data.len() % 32 != 0 {
            let expected = shape.iter().product::<u64>();
            return Err(WriteError::ElementCount { name: name.to_string(), shape: shape.to_vec(), expected, got: data.len() });
        }
        let mut bytes = Vec::with_capacity(data.len() / 32 * 34);
        for block in data.chunks_exact(32) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            bytes.extend_from_slice(&f32_to_f16_bits(d).to_le_bytes());
            bytes.extend(block.iter().map(|&x| (x * id).round() as i8 as u8));
        }
        self.add(name, shape, GGML_Q8_0, data.len(), bytes)
    }

    /// An I64 tensor (e.g. `d2t`, draft vocabulary row -> target token id).
    pub fn add_i64(&mut self, name: &str, shape: &[u64], data: &[i64]) -> Result<(), WriteError> {
        let bytes = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.add(name, shape, GGML_I64, data.len(), bytes)
    }

    fn add(&mut self, name: &str, shape: &[u64], ggml_type: u32, n: usize, bytes: Vec<u8>) -> Result<(), WriteError> {
        let expected = shape.iter().product::<u64>();
        if expected != n as u64 || ggml_nbytes(ggml_type, shape) != Some(bytes.len() as u64) {
            return Err(WriteError::ElementCount { name: name.to_string(), shape: shape.to_vec(), expected, got: n });
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(WriteError::DuplicateTensor { name: name.to_string() });
        }
        self.tensors.push(Tensor { name: name.to_string(), shape: shape.to_vec(), ggml_type, bytes });
        Ok(())
    }

    /// The whole file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
        for (key, value) in &self.kv {
            put_str(&mut out, key);
            out.extend_from_slice(&value.type_id().to_le_bytes());
            put_value(&mut out, value);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for d in &t.shape {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset += t.bytes.len().next_multiple_of(ALIGNMENT);
        }
        for t in &self.tensors {
            out.resize(out.len().next_multiple_of(ALIGNMENT), 0);
            out.extend_from_slice(&t.bytes);
        }
        out
    }

    /// Writes the file (through a temporary name, so a reader never sees half a file).
    pub fn write(&self, path: &Path) -> io::Result<()> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".partial");
        std::fs::write(&tmp, self.to_bytes())?;
        std::fs::rename(&tmp, path)
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &MetaValue) {
    match value {
        MetaValue::U8(v) => out.push(*v),
        MetaValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::Bool(v) => out.push(u8::from(*v)),
        MetaValue::Str(s) => put_str(out, s),
        MetaValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::Array(elem_type, items) => {
            out.extend_from_slice(&elem_type.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
    }
}

/// Write a drafter for `target` to `path`, then read it back and apply the pairing check
/// the engine applies: what is written must load next to its target.
pub fn write_paired_drafter(w: &GgufWriter, path: &Path, target: &super::ModelInfo) -> anyhow::Result<()> {
    use anyhow::Context as _;
    w.write(path).with_context(|| format!("writing {}", path.display()))?;
    super::check_pair(target, &super::read_model_info(path)?)
        .with_context(|| format!("{} does not pair with its target", path.display()))
}

/// Q4_1 blocks of `data` (length a multiple of [`QK4_1`]), as ggml's `quantize_row_q4_1_ref`:
/// per block of 32, d = (max - min) / 15 and m = min (both stored as f16), q = round((x - min) / d)
/// clamped to 0..=15 (computed as `(x - min) * (1 / d) + 0.5` truncated, 0 when d is 0), value j
/// in the low nibble of `qs[j]` and value j + 16 in its high nibble. Dequantized: q * d + m.
pub fn quantize_q4_1(data: &[f32]) -> Vec<u8> {
    assert!(data.len() % QK4_1 == 0, "Q4_1 needs whole blocks of {QK4_1} values, got {}", data.len());
    let mut out = Vec::with_capacity(data.len() / QK4_1 * Q4_1_BLOCK_BYTES);
    for block in data.chunks_exact(QK4_1) {
        let (mut min, mut max) = (f32::MAX, -f32::MAX);
        for &v in block {
            min = min.min(v);
            max = max.max(v);
        }
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f32_to_f16_bits(d).to_le_bytes());
        out.extend_from_slice(&f32_to_f16_bits(min).to_le_bytes());
        // x >= min, so the cast truncates a non-negative value, as C's (int8_t) does
        let q = |x: f32| (((x - min) * id + 0.5) as u8).min(15);
        for j in 0..QK4_1 / 2 {
            out.push(q(block[j]) | q(block[j + QK4_1 / 2]) << 4);
        }
    }
    out
}

/// The values Q4_1 `bytes` stand for, as ggml's `dequantize_row_q4_1`.
pub fn dequantize_q4_1(bytes: &[u8]) -> Vec<f32> {
    assert!(bytes.len() % Q4_1_BLOCK_BYTES == 0, "Q4_1 data must be whole {Q4_1_BLOCK_BYTES}-byte blocks");
    let mut out = vec![0.0; bytes.len() / Q4_1_BLOCK_BYTES * QK4_1];
    for (block, y) in bytes.chunks_exact(Q4_1_BLOCK_BYTES).zip(out.chunks_exact_mut(QK4_1)) {
        let d = f16_bits_to_f32(u16::from_le_bytes([block[0], block[1]]));
        let m = f16_bits_to_f32(u16::from_le_bytes([block[2], block[3]]));
        for (j, &b) in block[4..].iter().enumerate() {
            y[j] = f32::from(b & 0x0f) * d + m;
            y[j + QK4_1 / 2] = f32::from(b >> 4) * d + m;
        }
    }
    out
}

/// The f32 value of IEEE half precision bits (exact).
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((h >> 10) & 0x1f);
    let mant = f32::from(h & 0x3ff);
    sign * match exp {
        0 => mant * 2f32.powi(-24),
        0x1f if mant == 0.0 => f32::INFINITY,
        0x1f => f32::NAN,
        e => (1024.0 + mant) * 2f32.powi(e - 25),
    }
}

/// IEEE half precision bits of `v`, round to nearest even (as ggml's `GGML_FP32_TO_FP16`).
pub fn f32_to_f16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    let sign = ((x >> 16) & 0x8000) as u16;
    let exp = ((x >> 23) & 0xff) as i32;
    let mant = x & 0x007f_ffff;
    if exp == 0xff {
        // inf stays inf, NaN stays a (quiet) NaN
        return sign | 0x7c00 | if mant != 0 { 0x0200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        // subnormal half (or zero): shift the mantissa with its implicit bit into place
        if e < -10 {
            return sign;
        }
        let m = mant | 0x0080_0000;
        let shift = (14 - e) as u32;
        let half = m >> shift;
        let rem = m & ((1 << shift) - 1);
        let halfway = 1 << (shift - 1);
        let round = u32::from(rem > halfway || (rem == halfway && half & 1 == 1));
        return sign | (half + round) as u16;
    }
    let half = ((e as u32) << 10) | (mant >> 13);
    let rem = mant & 0x1fff;
    let round = u32::from(rem > 0x1000 || (rem == 0x1000 && half & 1 == 1));
    // a carry out of the mantissa correctly bumps the exponent (up to inf)
    sign | (half + round) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_blocks_hold_a_scale_and_rounded_values() {
        let mut w = GgufWriter::new();
        let data: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) / 8.0).collect();
        w.add_q8_0("t", &[32, 2], &data).unwrap();
        let t = &w.tensors[0];
        assert_eq!(t.bytes.len(), 2 * 34);
        for (b, block) in data.chunks_exact(32).enumerate() {
            let raw = &t.bytes[b * 34..(b + 1) * 34];
            let d = f16_bits_to_f32(u16::from_le_bytes([raw[0], raw[1]]));
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!((d - amax / 127.0).abs() <= 1e-3 * d);
            for (j, &x) in block.iter().enumerate() {
                let q = raw[2 + j] as i8 as f32;
                assert!((q * d - x).abs() <= 0.5 * d + 1e-3, "value {x}: stored {q} x {d}");
            }
        }
        assert!(matches!(w.add_q8_0("u", &[16, 2], &data[..32]), Err(WriteError::BlockSize { .. })));
    }

    #[test]
    fn f16_conversion_matches_known_values() {
        assert_eq!(f32_to_f16_bits(0.0), 0x0000);
        assert_eq!(f32_to_f16_bits(-0.0), 0x8000);
        assert_eq!(f32_to_f16_bits(1.0), 0x3c00);
        assert_eq!(f32_to_f16_bits(-2.0), 0xc000);
        assert_eq!(f32_to_f16_bits(0.5), 0x3800);
        assert_eq!(f32_to_f16_bits(65504.0), 0x7bff);
        assert_eq!(f32_to_f16_bits(1e6), 0x7c00);
        assert_eq!(f32_to_f16_bits(f32::INFINITY), 0x7c00);
        assert_eq!(f32_to_f16_bits(5.960_464_5e-8), 0x0001); // smallest subnormal
        assert_eq!(f32_to_f16_bits(1.0 + 1.0 / 2048.0), 0x3c00); // halfway rounds to even
        assert_eq!(f32_to_f16_bits(1.0 + 3.0 / 2048.0), 0x3c02);
    }

    #[test]
    fn f16_round_trip() {
        for bits in (0..=0xffffu16).filter(|b| b & 0x7c00 != 0x7c00) {
            assert_eq!(f32_to_f16_bits(f16_bits_to_f32(bits)), bits, "{bits:#06x}");
        }
        assert_eq!(f16_bits_to_f32(0x3266), 0.199_951_17);
        assert_eq!(f16_bits_to_f32(0x0001), 5.960_464_5e-8);
        assert_eq!(f16_bits_to_f32(0xfc00), f32::NEG_INFINITY);
    }

    #[test]
    fn q4_1_hand_computed_block() {
        // min -1, max 2: d = 3/15 = 0.2 (f16 0x3266), m = -1 (f16 0xbc00); q = round((x + 1) * 5)
        let mut x = [-1.0f32; 32];
        x[1] = 2.0; // q 15
        x[2] = 0.0; // q 5
        x[17] = 1.0; // q 10
        x[18] = -0.45; // 2.75: q 3
        x[31] = 1.95; // 14.75: q 15
        let mut want = vec![0x66, 0x32, 0x00, 0xbc];
        let mut qs = [0u8; 16];
        qs[1] = 15 | 10 << 4;
        qs[2] = 5 | 3 << 4;
        qs[15] = 15 << 4;
        want.extend_from_slice(&qs);
        assert_eq!(quantize_q4_1(&x), want);

        // a constant block: d = 0, every q 0, the value is m
        let c = quantize_q4_1(&[0.75; 32]);
        assert_eq!(&c[..4], &[0, 0, 0x00, 0x3a]);
        assert!(c[4..].iter().all(|&b| b == 0));
        assert_eq!(dequantize_q4_1(&c), vec![0.75; 32]);

        // one-hot blocks: zeros stay exactly zero, every 1 becomes the same 15 * f16(1/15)
        let mut hot = vec![0.0f32; 64];
        hot[5] = 1.0;
        hot[32 + 20] = 1.0;
        let back = dequantize_q4_1(&quantize_q4_1(&hot));
        let one = 15.0 * f16_bits_to_f32(f32_to_f16_bits(1.0 / 15.0));
        for (i, (&a, &b)) in hot.iter().zip(&back).enumerate() {
            assert_eq!(b, if a == 0.0 { 0.0 } else { one }, "value {i}");
        }
        assert!((one - 1.0).abs() < 1e-3);
    }

    #[test]
    fn q4_1_dequantizes_close_to_its_input() {
        // a mix of scales and offsets, from a tiny LCG so the test needs no crate
        let mut s = 12345u64;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u32 << 24) as f32
        };
        let x: Vec<f32> = (0..32 * 64).map(|i| (2.0 * next() - 1.0) * (1 + i / 256) as f32 + (i / 512) as f32).collect();
        let back = dequantize_q4_1(&quantize_q4_1(&x));
        assert_eq!(back.len(), x.len());
        for (b, (xs, ys)) in x.chunks(32).zip(back.chunks(32)).enumerate() {
            let min = xs.iter().copied().fold(f32::MAX, f32::min);
            let max = xs.iter().copied().fold(f32::MIN, f32::max);
            let d = (max - min) / 15.0;
            // d/2 from rounding q, plus the f16 rounding of d (times q <= 15) and of m
            let tol = d / 2.0 + (15.0 * d + min.abs()) / 2048.0 + 1e-6;
            for (j, (&x, &y)) in xs.iter().zip(ys).enumerate() {
                assert!((x - y).abs() <= tol, "block {b} value {j}: {x} -> {y}, tolerance {tol}");
            }
        }
    }

    #[test]
    fn q4_1_tensor_size_and_checks() {
        let mut w = GgufWriter::new();
        w.add_q4_1("q", &[64, 3], &[0.5; 192]).unwrap();
        assert!(matches!(w.add_q4_1("bad_block", &[48, 2], &[0.0; 96]), Err(WriteError::BlockSize { .. })));
        assert!(matches!(w.add_q4_1("bad_count", &[64, 2], &[0.0; 64]), Err(WriteError::ElementCount { .. })));
        assert_eq!(w.tensors[0].bytes.len(), 6 * 20);
        assert_eq!(w.tensors[0].ggml_type, GGML_Q4_1);
    }

    #[test]
    fn layout_is_aligned_and_deterministic() {
        let build = || {
            let mut w = GgufWriter::new();
            w.set_str("general.architecture", "llama").unwrap();
            w.add_f32("a", &[3], &[1.0, 2.0, 3.0]).unwrap();
            w.add_i64("b", &[2], &[7, -1]).unwrap();
            w.to_bytes()
        };
        let bytes = build();
        assert_eq!(bytes, build());
        assert_eq!(&bytes[..4], b"GGUF");
        // b's data starts on the next 32-byte boundary after a's 12 bytes
        let tail = &bytes[bytes.len() - 16..];
        assert_eq!(&tail[..8], &7i64.to_le_bytes());
        assert_eq!((bytes.len() - 16 - 32) % 32, 0);
    }

    #[test]
    fn rejects_bad_input() {
        let mut w = GgufWriter::new();
        assert!(w.add_f32("a", &[2, 2], &[1.0]).is_err());
        w.add_f32("a", &[1], &[1.0]).unwrap();
        assert!(w.add_f32("a", &[1], &[1.0]).is_err());
        assert!(w.set("k", MetaValue::Array(super::super::TYPE_U32, vec![MetaValue::I32(1)])).is_err());
    }
}
