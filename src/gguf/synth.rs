//! Tiny synthetic targets and DFlash drafters for tests, deterministic from a seed.
//!
//! [`synth_all`] writes a random llama target with a real byte-level BPE tokenizer, a random
//! DFlash 1 and DFlash 2 drafter for it, and a constructed target/drafter family whose drafts the
//! target accepts fully, partly or never. [`synth_for_target`] writes a random DFlash 2 drafter
//! that pairs with a real target. Weights come from splitmix64 and exact float arithmetic, so
//! the same seed gives the same bytes on every run.
//!
//! # The constructed cycle pair
//!
//! `target-cycle.gguf` is a llama model whose layers add nothing: `attn_output` and `ffn_down`
//! are zero, so the residual stream, hence the final hidden state, is the token embedding. Token
//! t embeds as the one-hot vector e_j of j = index of its successor `next_T(t)` among the 16
//! cycle tokens c0..c15, and the output head's row for c_j is e_j (other rows zero). After the
//! final RMSNorm the hidden state is sqrt(n_embd) e_j, so the greedy next token is exactly
//! `next_T(t)`: c_i -> c_(i+1 mod 16), every other token t -> c_(t mod 16).
//!
//! Both targets store their matrices (token embedding, attention and FFN weights, output head)
//! as Q4_1, like a real quantized target, so llama.cpp gives bit-identical logits for a token
//! decoded alone or in a batch (see [`Matrices::Q4_1`]); norms stay F32. For the cycle target
//! this is exact in the sense that matters: a zero block stores d = m = 0 and stays exactly zero,
//! and every 1 of a one-hot row becomes the same 15 * f16(1/15) = 0.99976, which the RMSNorm
//! scales away and which is the same for every output row.
//!
//! The cycle drafters (DFlash 2, K = 16, rank 16, 1 layer) ship their own `token_embd` and
//! `output`. Their conv weights (`*_conv_base`, `*_conv_proj`) are zero: llama.cpp multiplies
//! the attention and FFN inputs *and* outputs by `conv_proj(x) + conv_base`, so both branches
//! add exactly zero and each layer is the identity; the drafter ignores the target features
//! and its hidden state at position i is its own embedding of the block token there. The mask
//! token embeds as e_0, so every masked position has the hidden state h = sqrt(n_embd) e_0 after
//! `output_norm`; the output rows of the 16 cycle tokens are e_0 and all others zero, so the
//! top-16 candidates at every position are exactly the cycle tokens, all with logit sqrt(n_embd).
//! The selector scores `S(a, c) = logit(c) + <P[a] * (H h), N[c]>`: `selector_hidden` H has a
//! 1 in column 0 of every rank row, so H h = sqrt(n_embd) in every rank; N[c_j] = e_j (zero for
//! non-cycle tokens) and P[a] = e_(index of next_D(a)), so S(a, c) = sqrt(n_embd) * (1 +
//! [c == next_D(a)]) and the greedy walk from anchor a drafts next_D(a), next_D(next_D(a)), ...
//!
//! - `drafter-cycle-exact.gguf`: next_D = next_T, every draft is accepted in full.
//! - `drafter-cycle-partial.gguf`: next_D(c15) = c5 instead of c0, otherwise next_T. From anchor
//!   c_j the 15 drafts of a 16-token block are right up to c15: 15 - j accepted (15 from c0, 0
//!   from c15). Note for loops: 15 drafts + 1 bonus token are exactly one turn of the cycle, so
//!   once a block ends at c15 the next anchor is c0 and every later full block is accepted in
//!   full (15); drafting fewer tokens per block moves the anchor round the cycle instead, and the
//!   wrong link keeps cutting blocks short.
//! - `drafter-cycle-wrong.gguf`: next_D(a) = the cycle token after next_T(a): nothing accepted.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::read::{read_gguf, ModelInfo};
use super::{GgufWriter, MetaValue};

/// Token ids of the synthetic vocabulary's special tokens.
pub const ENDOFTEXT: u32 = 0;
pub const IM_START: u32 = 1;
pub const IM_END: u32 = 2;
pub const MASK: u32 = 3;
const SPECIALS: [&str; 4] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"];
/// Byte tokens follow the specials: byte b is token `BYTE0 + b`.
pub const BYTE0: u32 = SPECIALS.len() as u32;
/// Vocabulary size of the synthetic tokenizer: specials, 256 bytes, then BPE merges.
pub const N_VOCAB: usize = 512;
/// The 16 cycle tokens of the constructed pair: the byte tokens of 'A'..'P'.
pub const CYCLE_LEN: usize = 16;

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Text the BPE merges are learnt from: a little prose and a little code, like chat traffic.
const CORPUS: &str = "The quick brown fox jumps over the lazy dog. A speculative decoder drafts a block of \
tokens with a small model, and the target model verifies the whole block in one pass. When the \
target agrees with the draft, many tokens are accepted at once and generation gets faster; when \
it disagrees, the first wrong token is replaced and the rest of the block is thrown away. The \
drafter reads the hidden states of the target, so it knows what the target is thinking about. \
It then fills every masked position of the block at the same time, which is why it is called a \
diffusion drafter. The second version adds a selector that chooses a path through the top \
candidates of each position, so that the chosen tokens fit together.\n\
def accept_length(draft, target):\n    n = 0\n    for d, t in zip(draft, target):\n        if d != t:\n            break\n        n += 1\n    return n\n\
fn main() {\n    let tokens = vec![1, 2, 3];\n    for token in tokens.iter() {\n        println!(\"token {}\", token);\n    }\n}\n\
Once upon a time there was a little model that wanted to write stories. Every day it read the \
words of the people around it and tried to guess the next one. At first it was often wrong, but \
it kept trying, and the more it read, the better its guesses became. The people were happy, \
because the stories were good and they came quickly. The end.\n\
Question: what is the capital of France? Answer: the capital of France is Paris. Question: how \
many days are there in a week? Answer: there are seven days in a week. Question: what colour is \
the sky on a clear day? Answer: the sky is blue on a clear day.\n";

/// A byte-level GPT-2 style BPE vocabulary.
#[derive(Clone, Debug)]
pub struct Vocab {
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    pub merges: Vec<String>,
}

impl Vocab {
    /// Specials, the 256 byte tokens, and merges learnt from a built-in corpus until the
    /// vocabulary has `n_vocab` tokens (never fewer than those 260, at most what the corpus
    /// supports).
    pub fn bpe(n_vocab: usize) -> Vocab {
        let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
        tokens.extend((0..=255u8).map(|b| byte_char(b).to_string()));
        let mut token_types = vec![3; SPECIALS.len()]; // control
        token_types.resize(tokens.len(), 1); // normal
        let mut merges = Vec::new();

        // every distinct pre-token is a word: symbols and count; BTreeMap keeps it deterministic
        let mut words: BTreeMap<String, (Vec<String>, u64)> = BTreeMap::new();
        for piece in pretokenize(CORPUS) {
            let mapped: String = piece.bytes().map(byte_char).collect();
            let symbols = mapped.chars().map(String::from).collect();
            words.entry(mapped).or_insert((symbols, 0)).1 += 1;
        }
        let mut known: std::collections::HashSet<String> = tokens.iter().cloned().collect();
        while tokens.len() < n_vocab {
            let mut pairs: BTreeMap<(&str, &str), u64> = BTreeMap::new();
            for (symbols, count) in words.values() {
                for w in symbols.windows(2) {
                    *pairs.entry((&w[0], &w[1])).or_default() += count;
                }
            }
            // most frequent pair; ties go to the lexicographically smallest
            let Some(((a, b), _)) = pairs.iter().max_by(|x, y| x.1.cmp(y.1).then(y.0.cmp(x.0))) else {
                break;
            };
            let (a, b) = (a.to_string(), b.to_string());
            for (symbols, _) in words.values_mut() {
                *symbols = merge_pair(symbols, &a, &b);
            }
            merges.push(format!("{a} {b}"));
            // two merges can spell the same token; llama.cpp requires unique token texts
            let joined = a + &b;
            if known.insert(joined.clone()) {
                tokens.push(joined);
                token_types.push(1);
            }
        }
        Vocab { tokens, token_types, merges }
    }

    fn put(&self, w: &mut GgufWriter) -> Result<()> {
        w.set_str("tokenizer.ggml.model", "gpt2")?;
        w.set_str("tokenizer.ggml.pre", "gpt-2")?;
        w.set("tokenizer.ggml.tokens", MetaValue::str_array(self.tokens.iter().cloned()))?;
        w.set("tokenizer.ggml.token_type", MetaValue::i32_array(self.token_types.iter().copied()))?;
        w.set("tokenizer.ggml.merges", MetaValue::str_array(self.merges.iter().cloned()))?;
        w.set_u32("tokenizer.ggml.bos_token_id", ENDOFTEXT)?;
        w.set_u32("tokenizer.ggml.eos_token_id", ENDOFTEXT)?;
        w.set_u32("tokenizer.ggml.mask_token_id", MASK)?;
        w.set_bool("tokenizer.ggml.add_bos_token", false)?;
        w.set_str("tokenizer.chat_template", CHATML)?;
        Ok(())
    }
}

/// GPT-2's byte-to-unicode map: printable bytes stand for themselves, the rest are shifted past
/// U+0100 in order (space is 'Ġ', newline 'Ċ').
fn byte_char(b: u8) -> char {
    let printable = |x: u8| matches!(x, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
    if printable(b) {
        return char::from(b);
    }
    let shift = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shift).unwrap_or('?')
}

/// GPT-2-like pre-tokenization: an optional leading space plus a run of letters, of digits or
/// of punctuation; other whitespace runs stand alone.
fn pretokenize(text: &str) -> Vec<&str> {
    let class = |c: char| match c {
        c if c.is_alphabetic() => 1,
        c if c.is_numeric() => 2,
        c if c.is_whitespace() => 0,
        _ => 3,
    };
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let end = |j: usize| chars.get(j).map_or(text.len(), |&(i, _)| i);
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let mut j = i;
        if chars[j].1 == ' ' && chars.get(j + 1).is_some_and(|&(_, c)| class(c) != 0) {
            j += 1;
        }
        let k = class(chars[j].1);
        j += 1;
        while j < chars.len() && class(chars[j].1) == k && !(k == 0 && chars[j].1 == ' ' && chars[j - 1].1 != ' ') {
            j += 1;
        }
        out.push(&text[end(i)..end(j)]);
        i = j;
    }
    out
}

fn merge_pair(symbols: &[String], a: &str, b: &str) -> Vec<String> {
    let mut out = Vec::with_capacity(symbols.len());
    let mut i = 0;
    while i < symbols.len() {
        if i + 1 < symbols.len() && symbols[i] == a && symbols[i + 1] == b {
            out.push(format!("{a}{b}"));
            i += 2;
        } else {
            out.push(symbols[i].clone());
            i += 1;
        }
    }
    out
}

/// splitmix64: tiny, portable, and fully determined by the seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64, stream: &str) -> Rng {
        // a separate stream per tensor name, so adding a tensor does not shift the others
        let mut h = seed ^ 0x9e37_79b9_7f4a_7c15;
        for b in stream.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        Rng(h)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-scale, scale): 24 random bits, exactly representable.
    fn uniform(&mut self, scale: f32) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u32 << 24) as f32;
        (2.0 * u - 1.0) * scale
    }

    fn fill(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(scale)).collect()
    }
}

/// Transformer dimensions shared by the targets and drafters written here.
#[derive(Clone, Debug)]
struct Dims {
    n_embd: u64,
    n_layer: u64,
    n_head: u64,
    n_head_kv: u64,
    n_ff: u64,
    n_vocab: u64,
    context_length: u32,
    rope_freq_base: f32,
}

impl Dims {
    fn head_dim(&self) -> u64 {
        self.n_embd / self.n_head
    }

    fn put(&self, w: &mut GgufWriter, arch: &str) -> Result<()> {
        w.set_str("general.architecture", arch)?;
        w.set_u32(&format!("{arch}.context_length"), self.context_length)?;
        w.set_u32(&format!("{arch}.embedding_length"), self.n_embd as u32)?;
        w.set_u32(&format!("{arch}.block_count"), self.n_layer as u32)?;
        w.set_u32(&format!("{arch}.feed_forward_length"), self.n_ff as u32)?;
        w.set_u32(&format!("{arch}.attention.head_count"), self.n_head as u32)?;
        w.set_u32(&format!("{arch}.attention.head_count_kv"), self.n_head_kv as u32)?;
        w.set_u32(&format!("{arch}.rope.dimension_count"), self.head_dim() as u32)?;
        w.set_f32(&format!("{arch}.rope.freq_base"), self.rope_freq_base)?;
        w.set_f32(&format!("{arch}.attention.layer_norm_rms_epsilon"), 1e-5)?;
        Ok(())
    }

    /// Per-layer attention + SwiGLU FFN tensors common to llama and dflash, in llama.cpp's order.
    fn layer_tensors(&self, il: u64, qk_norm: bool) -> Vec<(String, Vec<u64>)> {
        let (e, hd) = (self.n_embd, self.head_dim());
        let mut t = vec![
            (format!("blk.{il}.attn_norm.weight"), vec![e]),
            (format!("blk.{il}.attn_q.weight"), vec![e, hd * self.n_head]),
            (format!("blk.{il}.attn_k.weight"), vec![e, hd * self.n_head_kv]),
            (format!("blk.{il}.attn_v.weight"), vec![e, hd * self.n_head_kv]),
            (format!("blk.{il}.attn_output.weight"), vec![hd * self.n_head, e]),
        ];
        if qk_norm {
            t.push((format!("blk.{il}.attn_q_norm.weight"), vec![hd]));
            t.push((format!("blk.{il}.attn_k_norm.weight"), vec![hd]));
        }
        t.extend([
            (format!("blk.{il}.ffn_norm.weight"), vec![e]),
            (format!("blk.{il}.ffn_gate.weight"), vec![e, self.n_ff]),
            (format!("blk.{il}.ffn_up.weight"), vec![e, self.n_ff]),
            (format!("blk.{il}.ffn_down.weight"), vec![self.n_ff, e]),
        ]);
        t
    }

    fn llama_tensors(&self) -> Vec<(String, Vec<u64>)> {
        let mut t = vec![("token_embd.weight".to_string(), vec![self.n_embd, self.n_vocab])];
        for il in 0..self.n_layer {
            t.extend(self.layer_tensors(il, false));
        }
        t.push(("output_norm.weight".into(), vec![self.n_embd]));
        t.push(("output.weight".into(), vec![self.n_embd, self.n_vocab]));
        t
    }
}

/// DFlash-specific shape of a drafter.
#[derive(Clone, Debug)]
struct DflashSpec {
    target_layers: Vec<i32>,
    target_n_embd: u64,
    block_size: u32,
    /// (conv kernel, conv group size, selector rank, top-k) of a DFlash 2 drafter.
    dflash2: Option<(u64, u64, u64, u32)>,
    own_embeddings: bool,
}

impl DflashSpec {
    fn put(&self, w: &mut GgufWriter) -> Result<()> {
        let dflash2 = self.dflash2.map(|(kernel, group, rank, top_k)| (kernel as u32, group as u32, rank as u32, top_k));
        Ok(w.set_dflash(&self.target_layers, self.block_size, dflash2)?)
    }

    /// Every tensor llama.cpp's dflash loader creates for this shape (it rejects extra ones).
    fn tensors(&self, d: &Dims) -> Vec<(String, Vec<u64>)> {
        let e = d.n_embd;
        let mut t = Vec::new();
        if self.own_embeddings {
            t.push(("token_embd.weight".to_string(), vec![e, d.n_vocab]));
        }
        if let Some((_, _, rank, _)) = self.dflash2 {
            t.push(("selector_predecessor.weight".into(), vec![rank, d.n_vocab]));
            t.push(("selector_successor.weight".into(), vec![rank, d.n_vocab]));
            t.push(("selector_hidden.weight".into(), vec![e, rank]));
        }
        t.push(("fc.weight".into(), vec![self.target_layers.len() as u64 * self.target_n_embd, e]));
        t.push(("enc.output_norm.weight".into(), vec![e]));
        t.push(("output_norm.weight".into(), vec![e]));
        if self.own_embeddings {
            t.push(("output.weight".into(), vec![e, d.n_vocab]));
        }
        for il in 0..d.n_layer {
            t.extend(d.layer_tensors(il, true));
            if let Some((kernel, group, _, _)) = self.dflash2 {
                let projected = 2 * kernel * (e / group);
                for side in ["attn", "ffn"] {
                    t.push((format!("blk.{il}.{side}_conv_base"), vec![e, kernel, 2]));
                    t.push((format!("blk.{il}.{side}_conv_proj.weight"), vec![e, projected]));
                }
            }
        }
        t
    }
}

/// How [`add_tensors`] stores matrices (2-D tensors); vectors and 3-D tensors are always F32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Matrices {
    F32,
    F16,
    /// The targets: with Q4_1 weights llama.cpp computes every logit with the same per-row
    /// `vec_dot` whether a token is decoded alone or in a batch, as for real quantized targets,
    /// so plain and speculative decoding see bit-identical logits. F32 weights go through
    /// different kernels (vec_dot for one token, llamafile sgemm for several) whose rounding
    /// differs, which flips rare near-ties and breaks exact losslessness checks.
    Q4_1,
}

/// Adds tensors with values from `values(name, shape)`, matrices stored as `matrices` says.
fn add_tensors(
    w: &mut GgufWriter,
    tensors: &[(String, Vec<u64>)],
    matrices: Matrices,
    mut values: impl FnMut(&str, &[u64]) -> Vec<f32>,
) -> Result<()> {
    for (name, shape) in tensors {
        let data = values(name, shape);
        // conv_base is added to activations in llama.cpp, which needs F32
        match matrices {
            _ if shape.len() != 2 || name.ends_with("conv_base") => w.add_f32(name, shape, &data)?,
            Matrices::F32 => w.add_f32(name, shape, &data)?,
            Matrices::F16 => w.add_f16(name, shape, &data)?,
            Matrices::Q4_1 => w.add_q4_1(name, shape, &data)?,
        }
    }
    Ok(())
}

/// Random weights, scaled per role: norms near 1, the conv base near the identity tap, the rest
/// uniform with a fan-in scale times `gain(name)`.
fn random_values(seed: u64, gain: impl Fn(&str) -> f32) -> impl FnMut(&str, &[u64]) -> Vec<f32> {
    move |name, shape| {
        let mut rng = Rng::new(seed, name);
        let n = shape.iter().product::<u64>() as usize;
        if name.contains("norm") {
            return (0..n).map(|_| 1.0 + rng.uniform(0.1)).collect();
        }
        if name.ends_with("conv_base") {
            // [n_embd, kernel, 2]: tap 0 of both sides near 1, older taps small
            let e = shape[0] as usize;
            let kernel = shape[1] as usize;
            return (0..n).map(|i| if (i / e) % kernel == 0 { 1.0 + rng.uniform(0.1) } else { rng.uniform(0.1) }).collect();
        }
        // uniform(s) has variance s^2/3: s = sqrt(3/fan_in) maps unit-variance inputs to
        // unit-variance outputs
        let fan_in = shape[0] as f32;
        rng.fill(n, gain(name) * (3.0 / fan_in).sqrt())
    }
}

/// Gains of the random target: unit-scale embeddings, so that in the residual stream a token
/// weighs as much as what attention and the FFN (fed unit-RMS normalized inputs) add from its
/// context, and sharper attention (larger q and k), so that context changes the output.
fn target_gain(name: &str) -> f32 {
    if name == "token_embd.weight" {
        (synth_dims().n_embd as f32).sqrt()
    } else if name.contains("attn_q") || name.contains("attn_k") {
        2.0
    } else {
        1.0
    }
}

fn synth_dims() -> Dims {
    Dims {
        n_embd: 128,
        n_layer: 3,
        n_head: 4,
        n_head_kv: 2,
        n_ff: 256,
        n_vocab: N_VOCAB as u64,
        context_length: 4096,
        rope_freq_base: 10000.0,
    }
}

/// Tokens greedy decoding of the random target should never emit: the specials (so it never
/// stops early) and byte tokens that are not printable text on their own (control bytes other
/// than tab and newline, and the bytes >= 0x80 that are only parts of UTF-8 sequences).
fn unprintable(t: u32) -> bool {
    match t.checked_sub(BYTE0) {
        None => true,
        Some(b) if b < 256 => !(matches!(b, 0x09 | 0x0a) || (0x20..0x7f).contains(&b)),
        Some(_) => false,
    }
}

/// The random llama target: real tokenizer, random weights, matrices in Q4_1. The output rows
/// of [`unprintable`] tokens are zero (exactly, also in Q4_1), so their logit is 0 while the
/// maximum over ~400 random rows is well above.
pub fn random_target(vocab: &Vocab, seed: u64) -> Result<GgufWriter> {
    let dims = Dims { n_vocab: vocab.tokens.len() as u64, ..synth_dims() };
    let mut w = GgufWriter::new();
    dims.put(&mut w, "llama")?;
    w.set_str("general.name", "dflash2 synthetic target")?;
    vocab.put(&mut w)?;
    let mut random = random_values(seed, target_gain);
    add_tensors(&mut w, &dims.llama_tensors(), Matrices::Q4_1, |name, shape| {
        let mut v = random(name, shape);
        if name == "output.weight" {
            let width = shape[0] as usize;
            for t in (0..shape[1] as u32).filter(|&t| unprintable(t)) {
                v[t as usize * width..(t as usize + 1) * width].fill(0.0);
            }
        }
        v
    })?;
    Ok(w)
}

fn random_drafter(vocab: &Vocab, seed: u64, dflash2: bool) -> Result<GgufWriter> {
    let target = synth_dims();
    let dims = Dims { n_layer: 1, n_vocab: vocab.tokens.len() as u64, ..target.clone() };
    let spec = DflashSpec {
        target_layers: vec![1, 2],
        target_n_embd: target.n_embd,
        block_size: 16,
        dflash2: dflash2.then_some((4, 16, 16, 8)),
        own_embeddings: false,
    };
    let mut w = GgufWriter::new();
    dims.put(&mut w, "dflash")?;
    w.set_str("general.name", if dflash2 { "dflash2 synthetic DFlash 2 drafter" } else { "dflash2 synthetic DFlash 1 drafter" })?;
    spec.put(&mut w)?;
    vocab.put(&mut w)?;
    add_tensors(&mut w, &spec.tensors(&dims), Matrices::F32, random_values(seed ^ (0xd7a + u64::from(dflash2)), |_| 1.0))?;
    Ok(w)
}

/// Cycle token c_(j mod 16): the byte token of 'A' + j.
pub fn cycle_token(j: usize) -> u32 {
    BYTE0 + u32::from(b'A') + (j % CYCLE_LEN) as u32
}

fn cycle_index(t: u32) -> Option<usize> {
    (0..CYCLE_LEN).find(|&j| cycle_token(j) == t)
}

/// The cycle target's greedy next token after `t`.
pub fn next_target(t: u32) -> u32 {
    match cycle_index(t) {
        Some(j) => cycle_token(j + 1),
        None => cycle_token(t as usize),
    }
}

/// Which successor function a cycle drafter follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CycleDrafter {
    Exact,
    Partial,
    Wrong,
}

impl CycleDrafter {
    /// The token this drafter's greedy lattice walk puts after `t`.
    pub fn next(self, t: u32) -> u32 {
        let right = next_target(t);
        match self {
            CycleDrafter::Exact => right,
            CycleDrafter::Partial if cycle_index(t) == Some(CYCLE_LEN - 1) => cycle_token(5),
            CycleDrafter::Partial => right,
            CycleDrafter::Wrong => next_target(right),
        }
    }

    fn file_name(self) -> &'static str {
        match self {
            CycleDrafter::Exact => "drafter-cycle-exact.gguf",
            CycleDrafter::Partial => "drafter-cycle-partial.gguf",
            CycleDrafter::Wrong => "drafter-cycle-wrong.gguf",
        }
    }
}

fn cycle_dims(n_vocab: u64) -> Dims {
    // n_embd >= K (K + 1) = 272 for K = 16, divisible by the conv group size 16
    Dims { n_embd: 288, n_layer: 3, n_head: 4, n_head_kv: 2, n_ff: 64, n_vocab, context_length: 4096, rope_freq_base: 10000.0 }
}

/// One-hot rows: `rows[t]` = e_(code(t)) in a [width, n_rows] matrix (None: a zero row).
fn one_hot(width: u64, n_rows: u64, code: impl Fn(u32) -> Option<usize>) -> Vec<f32> {
    let mut m = vec![0.0; (width * n_rows) as usize];
    for t in 0..n_rows as u32 {
        if let Some(j) = code(t) {
            m[t as usize * width as usize + j] = 1.0;
        }
    }
    m
}

/// See the module docs.
fn cycle_target(vocab: &Vocab) -> Result<GgufWriter> {
    let dims = cycle_dims(vocab.tokens.len() as u64);
    let mut w = GgufWriter::new();
    dims.put(&mut w, "llama")?;
    w.set_str("general.name", "dflash2 cycle target")?;
    vocab.put(&mut w)?;
    add_tensors(&mut w, &dims.llama_tensors(), Matrices::Q4_1, |name, shape| match name {
        "token_embd.weight" => one_hot(shape[0], shape[1], |t| cycle_index(next_target(t))),
        "output.weight" => one_hot(shape[0], shape[1], cycle_index),
        n if n.contains("norm") => vec![1.0; shape.iter().product::<u64>() as usize],
        _ => vec![0.0; shape.iter().product::<u64>() as usize],
    })?;
    Ok(w)
}

/// See the module docs.
fn cycle_drafter(vocab: &Vocab, kind: CycleDrafter) -> Result<GgufWriter> {
    let target = cycle_dims(vocab.tokens.len() as u64);
    let dims = Dims { n_layer: 1, ..target.clone() };
    let rank = CYCLE_LEN as u64;
    let spec = DflashSpec {
        target_layers: vec![1, 2],
        target_n_embd: target.n_embd,
        block_size: 16,
        dflash2: Some((4, 16, rank, CYCLE_LEN as u32)),
        own_embeddings: true,
    };
    let mut w = GgufWriter::new();
    dims.put(&mut w, "dflash")?;
    w.set_str("general.name", &format!("dflash2 cycle drafter ({kind:?})"))?;
    spec.put(&mut w)?;
    vocab.put(&mut w)?;
    add_tensors(&mut w, &spec.tensors(&dims), Matrices::F32, |name, shape| {
        let n = shape.iter().product::<u64>() as usize;
        match name {
            "token_embd.weight" => one_hot(shape[0], shape[1], |t| (t == MASK).then_some(0)),
            "output.weight" => one_hot(shape[0], shape[1], |t| cycle_index(t).map(|_| 0)),
            "selector_successor.weight" => one_hot(shape[0], shape[1], cycle_index),
            "selector_predecessor.weight" => one_hot(shape[0], shape[1], |t| cycle_index(kind.next(t))),
            // [n_embd, rank]: rank row r reads hidden dimension 0
            "selector_hidden.weight" => one_hot(shape[0], shape[1], |_| Some(0)),
            nm if nm.contains("norm") => vec![1.0; n],
            _ => vec![0.0; n],
        }
    })?;
    Ok(w)
}

/// Writes every synthetic model into `out_dir` and returns their paths.
pub fn synth_all(out_dir: &Path, seed: u64) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let vocab = Vocab::bpe(N_VOCAB);
    let mut files = vec![
        ("target.gguf", random_target(&vocab, seed)?),
        ("drafter-dflash1.gguf", random_drafter(&vocab, seed, false)?),
        ("drafter-dflash2.gguf", random_drafter(&vocab, seed, true)?),
        ("target-cycle.gguf", cycle_target(&vocab)?),
    ];
    for kind in [CycleDrafter::Exact, CycleDrafter::Partial, CycleDrafter::Wrong] {
        files.push((kind.file_name(), cycle_drafter(&vocab, kind)?));
    }
    files
        .into_iter()
        .map(|(name, w)| {
            let path = out_dir.join(name);
            w.write(&path).with_context(|| format!("writing {}", path.display()))?;
            Ok(path)
        })
        .collect()
}

/// What [`synth_for_target`] wrote and chose.
#[derive(Debug)]
pub struct TargetDrafter {
    pub path: PathBuf,
    pub mask_id: u32,
    /// Set when the target has no mask token and one was picked: which and why.
    pub mask_note: Option<String>,
    pub target_layers: Vec<i32>,
    pub top_k: u32,
    pub rank: u64,
}

/// Writes `drafter-dflash2.gguf` into `out_dir`: a random DFlash 2 drafter for a real target,
/// with the target's tokenizer metadata copied verbatim.
pub fn synth_for_target(target_path: &Path, out_dir: &Path, seed: u64) -> Result<TargetDrafter> {
    let g = read_gguf(target_path)?;
    let info = ModelInfo::from_gguf(&g)?;
    if info.dflash.is_some() {
        bail!("{}: is a DFlash drafter, not a target", target_path.display());
    }
    if info.n_layer < 2 {
        bail!("{}: has {} layer(s); a drafter needs a layer-input id in 1..n_layer", target_path.display(), info.n_layer);
    }
    let n_vocab = u64::from(info.n_vocab);
    let n_embd = u64::from(info.n_embd);
    // K*(K+1) values of the selector lattice must fit a row of n_embd
    let top_k = (1..=16u32).rev().find(|k| u64::from(k * (k + 1)) <= n_embd && u64::from(*k) <= n_vocab).unwrap_or(1);
    let group = [16, 8, 4, 2, 1].into_iter().find(|g| n_embd % g == 0).unwrap_or(1);
    let head_dim = [64, 32, 16, 8, 4, 2].into_iter().find(|h| n_embd % h == 0).unwrap_or(n_embd);
    // the two [rank, n_vocab] F16 codebooks: at most 2 MB unless that needs a rank below 4
    let rank = [16, 8, 4].into_iter().find(|r| 2 * r * n_vocab * 2 <= 2 << 20).unwrap_or(4);

    let l = info.n_layer as i32;
    let mut target_layers: Vec<i32> = (0..3).map(|k| 1 + k * (l - 2) / 2).collect();
    target_layers.dedup();

    let (mask_id, mask_note) = mask_token(&g, &info)?;

    let dims = Dims {
        n_embd,
        n_layer: 1,
        n_head: n_embd / head_dim,
        n_head_kv: 1,
        n_ff: 128,
        n_vocab,
        context_length: info.context_length.unwrap_or(4096),
        rope_freq_base: g
            .get(&format!("{}.rope.freq_base", info.architecture))
            .and_then(MetaValue::as_f64)
            .map_or(10000.0, |v| v as f32),
    };
    let spec = DflashSpec {
        target_layers: target_layers.clone(),
        target_n_embd: n_embd,
        block_size: 16,
        dflash2: Some((4, group, rank, top_k)),
        own_embeddings: false,
    };
    let mut w = GgufWriter::new();
    dims.put(&mut w, "dflash")?;
    let target_name = info.name.clone().unwrap_or_else(|| info.architecture.clone());
    w.set_str("general.name", &format!("dflash2 random DFlash 2 drafter for {target_name}"))?;
    spec.put(&mut w)?;
    w.set_tokenizer_of(&g, mask_id)?;
    add_tensors(&mut w, &spec.tensors(&dims), Matrices::F16, random_values(seed, |_| 1.0))?;

    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let path = out_dir.join("drafter-dflash2.gguf");
    super::write::write_paired_drafter(&w, &path, &info)?;
    Ok(TargetDrafter { path, mask_id, mask_note, target_layers, top_k, rank })
}

/// The mask token a drafter for this target fills its blocks with: the target's own
/// `tokenizer.ggml.mask_token_id`, else one picked by [`pick_mask`] (with a note saying which).
pub fn mask_token(g: &super::Gguf, info: &ModelInfo) -> Result<(u32, Option<String>)> {
    match info.mask_id {
        Some(id) => Ok((id, None)),
        None => pick_mask(g, info).map(|(id, why)| (id, Some(why))),
    }
}

/// A mask token for a target without one: a control (or unused) token that is not one of the
/// target's declared special tokens and that its chat template never writes, preferring names
/// that say "unused", "reserved", "pad" or "mask"; the highest id among equals.
fn pick_mask(g: &super::Gguf, info: &ModelInfo) -> Result<(u32, String)> {
    let tokens = g.get("tokenizer.ggml.tokens").and_then(MetaValue::as_array).unwrap_or(&[]);
    let types = g.get("tokenizer.ggml.token_type").and_then(MetaValue::as_array).unwrap_or(&[]);
    let template = g.get("tokenizer.chat_template").and_then(MetaValue::as_str).unwrap_or("");
    let declared: Vec<u32> = g
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer.ggml.") && k.ends_with("_token_id"))
        .filter_map(|(_, v)| v.as_u32())
        .collect();
    let mut best: Option<(bool, u32, &str)> = None;
    for (id, tok) in tokens.iter().enumerate() {
        let (Some(text), id) = (tok.as_str(), id as u32) else { continue };
        // llama.cpp token types: 3 control, 5 unused
        let special = matches!(types.get(id as usize).and_then(MetaValue::as_i64), Some(3 | 5));
        if !special || declared.contains(&id) || text.is_empty() || template.contains(text) {
            continue;
        }
        let lower = text.to_lowercase();
        let named = ["unused", "reserved", "pad", "mask"].iter().any(|w| lower.contains(w));
        if best.is_none_or(|(b_named, _, _)| named >= b_named) {
            best = Some((named, id, text));
        }
    }
    match best {
        Some((_, id, text)) => Ok((id, format!("mask token: the target has none; using id {id} {text:?}, a control token its chat template never writes"))),
        None => {
            let id = info.n_vocab.checked_sub(1).context("target has an empty vocabulary")?;
            let text = tokens.get(id as usize).and_then(MetaValue::as_str).unwrap_or("?");
            Ok((id, format!("mask token: the target has none and no spare control token; using the last token, id {id} {text:?}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::read::{check_pair, read_model_info};

    fn tmp(tag: &str) -> PathBuf {
        std::env::temp_dir().join(format!("dflash2-synth-{tag}-{}", std::process::id()))
    }

    #[test]
    fn vocab_is_well_formed() {
        let v = Vocab::bpe(N_VOCAB);
        assert_eq!(v.tokens.len(), N_VOCAB);
        assert_eq!(v.tokens[MASK as usize], "<|mask|>");
        assert_eq!(v.tokens[(BYTE0 + u32::from(b' ')) as usize], "Ġ");
        assert_eq!(v.tokens[(BYTE0 + u32::from(b'\n')) as usize], "Ċ");
        let unique: std::collections::HashSet<_> = v.tokens.iter().collect();
        assert_eq!(unique.len(), v.tokens.len());
        for m in &v.merges {
            let (a, b) = m.split_once(' ').unwrap();
            assert!(v.tokens.contains(&format!("{a}{b}")), "merge {m} makes no token");
        }
    }

    #[test]
    fn cycle_successors() {
        for j in 0..CYCLE_LEN {
            let c = cycle_token(j);
            assert_eq!(next_target(c), cycle_token(j + 1));
            assert_eq!(CycleDrafter::Exact.next(c), next_target(c));
            assert_ne!(CycleDrafter::Wrong.next(c), next_target(c));
            assert_eq!(CycleDrafter::Partial.next(c) == next_target(c), j != CYCLE_LEN - 1);
        }
        for t in 0..N_VOCAB as u32 {
            assert!(cycle_index(next_target(t)).is_some());
            assert_ne!(CycleDrafter::Wrong.next(t), next_target(t));
        }
    }

    #[test]
    fn targets_store_matrices_as_q4_1() {
        use crate::gguf::write::dequantize_q4_1;
        use crate::gguf::{GGML_F32, GGML_Q4_1};
        let dir = tmp("q4");
        synth_all(&dir, 7).unwrap();
        for name in ["target.gguf", "target-cycle.gguf"] {
            let g = read_gguf(&dir.join(name)).unwrap();
            for t in &g.tensors {
                let want = if t.shape.len() == 2 { GGML_Q4_1 } else { GGML_F32 };
                assert_eq!(t.ggml_type, want, "{name}: {} is {}", t.name, t.type_name);
            }
        }
        // the cycle target's one-hot matrices come back one-hot, every 1 as the same value
        let g = read_gguf(&dir.join("target-cycle.gguf")).unwrap();
        let bytes = std::fs::read(&g.path).unwrap();
        let one = 15.0 * crate::gguf::write::f16_bits_to_f32(crate::gguf::write::f32_to_f16_bits(1.0 / 15.0));
        let width = cycle_dims(N_VOCAB as u64).n_embd as usize;
        for (tensor, code) in [
            ("token_embd.weight", &(|t| cycle_index(next_target(t))) as &dyn Fn(u32) -> Option<usize>),
            ("output.weight", &cycle_index),
        ] {
            let t = g.tensor(tensor).unwrap();
            let v = dequantize_q4_1(&bytes[t.offset as usize..(t.offset + t.nbytes) as usize]);
            let want = one_hot(width as u64, N_VOCAB as u64, code);
            let want: Vec<f32> = want.iter().map(|&x| x * one).collect();
            assert_eq!(v, want, "{tensor}");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn deterministic_small_and_pairing() {
        let (a, b) = (tmp("a"), tmp("b"));
        let files = synth_all(&a, 7).unwrap();
        synth_all(&b, 7).unwrap();
        assert_eq!(files.len(), 7);
        for f in &files {
            let name = f.file_name().unwrap();
            let bytes = std::fs::read(f).unwrap();
            assert_eq!(bytes, std::fs::read(b.join(name)).unwrap(), "{name:?} differs between runs");
            assert!(bytes.len() < 8 << 20, "{name:?} is {} bytes", bytes.len());
        }
        let other = tmp("c");
        synth_all(&other, 8).unwrap();
        assert_ne!(std::fs::read(a.join("target.gguf")).unwrap(), std::fs::read(other.join("target.gguf")).unwrap());

        let target = read_model_info(&a.join("target.gguf")).unwrap();
        let cycle = read_model_info(&a.join("target-cycle.gguf")).unwrap();
        for (t, d) in [
            (&target, "drafter-dflash1.gguf"),
            (&target, "drafter-dflash2.gguf"),
            (&cycle, "drafter-cycle-exact.gguf"),
            (&cycle, "drafter-cycle-partial.gguf"),
            (&cycle, "drafter-cycle-wrong.gguf"),
        ] {
            let d = read_model_info(&a.join(d)).unwrap();
            assert_eq!(check_pair(t, &d), Ok(()), "{}", d.path.display());
        }
        let d2 = read_model_info(&a.join("drafter-dflash2.gguf")).unwrap().dflash.unwrap();
        assert_eq!((d2.selector_top_k, d2.selector_rank, d2.conv_kernel_size, d2.conv_group_size), (8, 16, 4, 16));
        assert_eq!(read_model_info(&a.join("drafter-dflash1.gguf")).unwrap().dflash.unwrap().selector_top_k, 0);

        // a drafter made for the synthetic target through the --target path pairs with it too
        let t = synth_for_target(&a.join("target.gguf"), &other, 3).unwrap();
        assert_eq!((t.mask_id, t.top_k, t.target_layers.clone()), (MASK, 10, vec![1, 2]));
        let d = read_model_info(&t.path).unwrap();
        assert_eq!(check_pair(&target, &d), Ok(()));
        for dir in [a, b, other] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
}
