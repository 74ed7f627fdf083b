//! GGUF files: read a model's metadata and check a target/drafter pair ([`read`]), write small
//! GGUF files deterministically ([`write`]), and synthesize tiny targets and DFlash drafters for
//! tests ([`synth`]).
//!
//! The types shared by the reader and the writer live here: metadata values with their exact
//! GGUF type (so tokenizer metadata can be copied verbatim) and the size table of ggml tensor types.

pub mod convert;
pub mod read;
pub mod synth;
pub mod write;

pub use read::{
    check_pair, check_pair_files, parse_gguf, read_gguf, read_model_info, DflashInfo, Gguf, GgufError, ModelInfo, PairCheckError,
    PairError, TensorInfo, WeightType,
};
pub use write::GgufWriter;

/// One metadata value, typed exactly as GGUF stores it.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    U64(u64),
    I64(i64),
    F64(f64),
    /// Element type id (never [`TYPE_ARRAY`]) and the elements, all of that type.
    Array(u32, Vec<MetaValue>),
}

/// GGUF metadata type ids (gguf.h `enum gguf_type`).
pub const TYPE_U8: u32 = 0;
pub const TYPE_I8: u32 = 1;
pub const TYPE_U16: u32 = 2;
pub const TYPE_I16: u32 = 3;
pub const TYPE_U32: u32 = 4;
pub const TYPE_I32: u32 = 5;
pub const TYPE_F32: u32 = 6;
pub const TYPE_BOOL: u32 = 7;
pub const TYPE_STRING: u32 = 8;
pub const TYPE_ARRAY: u32 = 9;
pub const TYPE_U64: u32 = 10;
pub const TYPE_I64: u32 = 11;
pub const TYPE_F64: u32 = 12;

/// Bytes of one scalar of a fixed-size metadata type; `None` for strings and arrays.
pub fn meta_scalar_size(type_id: u32) -> Option<u64> {
    match type_id {
        TYPE_U8 | TYPE_I8 | TYPE_BOOL => Some(1),
        TYPE_U16 | TYPE_I16 => Some(2),
        TYPE_U32 | TYPE_I32 | TYPE_F32 => Some(4),
        TYPE_U64 | TYPE_I64 | TYPE_F64 => Some(8),
        _ => None,
    }
}

impl MetaValue {
    /// The GGUF type id of this value.
    pub fn type_id(&self) -> u32 {
        match self {
            MetaValue::U8(_) => TYPE_U8,
            MetaValue::I8(_) => TYPE_I8,
            MetaValue::U16(_) => TYPE_U16,
            MetaValue::I16(_) => TYPE_I16,
            MetaValue::U32(_) => TYPE_U32,
            MetaValue::I32(_) => TYPE_I32,
            MetaValue::F32(_) => TYPE_F32,
            MetaValue::Bool(_) => TYPE_BOOL,
            MetaValue::Str(_) => TYPE_STRING,
            MetaValue::U64(_) => TYPE_U64,
            MetaValue::I64(_) => TYPE_I64,
            MetaValue::F64(_) => TYPE_F64,
            MetaValue::Array(..) => TYPE_ARRAY,
        }
    }

    /// Any integer value that fits in an i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::U64(v) => i64::try_from(v).ok(),
            MetaValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Any integer value that fits in a u32.
    pub fn as_u32(&self) -> Option<u32> {
        self.as_i64().and_then(|v| u32::try_from(v).ok())
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(_, items) => Some(items),
            _ => None,
        }
    }

    /// A string array of owned strings (the writer's most common array).
    pub fn str_array<S: Into<String>>(items: impl IntoIterator<Item = S>) -> MetaValue {
        MetaValue::Array(TYPE_STRING, items.into_iter().map(|s| MetaValue::Str(s.into())).collect())
    }

    pub fn i32_array(items: impl IntoIterator<Item = i32>) -> MetaValue {
        MetaValue::Array(TYPE_I32, items.into_iter().map(MetaValue::I32).collect())
    }

    pub fn f32_array(items: impl IntoIterator<Item = f32>) -> MetaValue {
        MetaValue::Array(TYPE_F32, items.into_iter().map(MetaValue::F32).collect())
    }
}

/// ggml tensor type ids the writer produces.
pub const GGML_F32: u32 = 0;
pub const GGML_F16: u32 = 1;
pub const GGML_Q4_1: u32 = 3;
pub const GGML_I64: u32 = 27;
pub const GGML_Q8_0: u32 = 8;

/// Name, elements per block and bytes per block of a ggml tensor type (ggml.c `type_traits`,
/// block sizes from ggml-common.h of the bundled llama.cpp). `None`: removed or unknown type.
pub fn ggml_type_info(type_id: u32) -> Option<(&'static str, u64, u64)> {
    Some(match type_id {
        0 => ("F32", 1, 4),
        1 => ("F16", 1, 2),
        2 => ("Q4_0", 32, 18),
        3 => ("Q4_1", 32, 20),
        6 => ("Q5_0", 32, 22),
        7 => ("Q5_1", 32, 24),
        8 => ("Q8_0", 32, 34),
        9 => ("Q8_1", 32, 36),
        10 => ("Q2_K", 256, 84),
        11 => ("Q3_K", 256, 110),
        12 => ("Q4_K", 256, 144),
        13 => ("Q5_K", 256, 176),
        14 => ("Q6_K", 256, 210),
        15 => ("Q8_K", 256, 292),
        16 => ("IQ2_XXS", 256, 66),
        17 => ("IQ2_XS", 256, 74),
        18 => ("IQ3_XXS", 256, 98),
        19 => ("IQ1_S", 256, 50),
        20 => ("IQ4_NL", 32, 18),
        21 => ("IQ3_S", 256, 110),
        22 => ("IQ2_S", 256, 82),
        23 => ("IQ4_XS", 256, 136),
        24 => ("I8", 1, 1),
        25 => ("I16", 1, 2),
        26 => ("I32", 1, 4),
        27 => ("I64", 1, 8),
        28 => ("F64", 1, 8),
        29 => ("IQ1_M", 256, 56),
        30 => ("BF16", 1, 2),
        34 => ("TQ1_0", 256, 54),
        35 => ("TQ2_0", 256, 66),
        39 => ("MXFP4", 32, 17),
        40 => ("NVFP4", 64, 36),
        41 => ("Q1_0", 128, 18),
        42 => ("Q2_0", 64, 18),
        _ => return None,
    })
}

/// Bytes of a tensor of this type and shape; `None` for an unknown type, a first dimension
/// that is not a whole number of blocks, or an overflow.
pub fn ggml_nbytes(type_id: u32, shape: &[u64]) -> Option<u64> {
    let (_, block, block_bytes) = ggml_type_info(type_id)?;
    let first = *shape.first().unwrap_or(&1);
    if first % block != 0 {
        return None;
    }
    let rows = shape.iter().skip(1).try_fold(1u64, |acc, &d| acc.checked_mul(d))?;
    (first / block).checked_mul(block_bytes)?.checked_mul(rows)
}
