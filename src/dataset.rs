//! Training data for a drafter, read off the target itself: for every token of a
//! conversation, the target's features (the inputs of the layers the drafter will read,
//! exactly as the engine captures them at inference time) and the target's own greedy
//! prediction of the next token. A drafter trained on these learns what THIS quantized
//! target computes and says, not what a reference checkpoint would.
//!
//! Written as one safetensors file (see [`DATASET_FORMAT`]) that
//! `gguf-drafters/train/train.py` reads.
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};

use crate::llama::{Batch, ChatMessage, Context, ContextParams, FeatureSource, Model, Token};
use crate::template::{ChatTemplate, TemplateChoice};

/// What the file holds (also written into its metadata, for whoever opens it).
pub const DATASET_FORMAT: &str = "dflash2-dataset-v1: tokens I32[N]; next I32[N] = target argmax after \
token i; features F32[N, n_layers*n_embd] = target layer inputs in target_layers order; offsets \
I64[S+1] = sequence bounds; answer_start I64[S] = first token of each sequence that may anchor a block \
(the answer of a chat row, token 1 of a text row); with soft labels also topk_ids I32[N, K] and \
topk_logprobs F32[N, K] = the target's K most likely next tokens after token i, most likely first, and \
their log-probabilities (softmax over the whole vocabulary, temperature 1)";

/// One training row: a user prompt and the target's answer to it (chat template applied),
/// or plain text (code, prose) read as it is.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(untagged)]
pub enum Conversation {
    Chat { prompt: String, answer: String },
    Text { text: String },
}

/// The layer inputs a drafter with `n_features` feature layers reads from a target of
/// `n_layer` layers: spread from near the bottom to near the top as the reference recipe
/// does (its layer OUTPUT ids + 1, as llama.cpp counts layer inputs).
pub fn default_layers(n_layer: usize, n_features: usize) -> Vec<i32> {
    let n_layer = n_layer as f64;
    if n_features <= 1 {
        return vec![(n_layer / 2.0).floor() as i32 + 1];
    }
    let (start, end) = (1.0, n_layer - 3.0);
    (0..n_features)
        .map(|i| (start + i as f64 * (end - start) / (n_features - 1) as f64).round_ties_even() as i32 + 1)
        .collect()
}

/// Accumulates sequences and writes them as one safetensors file.
pub struct Dataset {
    layers: Vec<i32>,
    mask_token: u32,
    n_embd: usize,
    tokens: Vec<i32>,
    next: Vec<i32>,
    features: Vec<f32>,
    offsets: Vec<i64>,
    answer_start: Vec<i64>,
    /// Soft labels kept per token (0: none).
    soft_k: usize,
    topk_ids: Vec<i32>,
    topk_logprobs: Vec<f32>,
}

/// Reads features and greedy predictions off a target, one conversation at a time.
pub struct Extractor {
    target: Arc<Model>,
    mask_token: u32,
    ctx: Context,
    max_len: usize,
    soft_k: usize,
    /// How chat rows are rendered (the model's own template unless the corpus says otherwise),
    /// compiled at the first chat row (a corpus of plain text needs none).
    template: TemplateChoice,
    compiled: std::sync::OnceLock<ChatTemplate>,
}

/// How an [`Extractor`] reads: what `dflash2 dataset`'s flags set.
#[derive(Debug, Clone)]
pub struct ExtractorParams {
    /// The token the drafter's blocks will be filled with (see
    /// [`crate::gguf::synth::mask_token`]), recorded for the training script.
    pub mask_token: u32,
    /// Target layer inputs to capture, as llama.cpp counts them.
    pub layers: Vec<i32>,
    /// Longest conversation kept, in tokens.
    pub max_len: usize,
    pub n_threads: i32,
    /// How many of the target's most likely next tokens to keep per position, with their
    /// log-probabilities (soft labels for distillation; 0 keeps only the greedy label).
    pub soft_k: usize,
    pub template: TemplateChoice,
    /// Read with llama.cpp's flash attention: about twice as fast on long rows, rounded
    /// differently from the engine's target (see [`ContextParams::flash_attn`]). Off, the
    /// target runs as the engine runs it and features match inference bit for bit.
    pub flash_attn: bool,
}

impl Extractor {
    pub fn new(target: Arc<Model>, p: ExtractorParams) -> Result<Self> {
        let ExtractorParams { mask_token, layers, max_len, n_threads, soft_k, template, flash_attn } = p;
        let n_layer = target.n_layer() as i32;
        if let Some(&bad) = layers.iter().find(|&&l| l < 1 || l >= n_layer) {
            bail!("layer {bad}: the target has layers 0..{n_layer}; feature layers are layer inputs 1..{}", n_layer - 1);
        }
        let params = ContextParams {
            n_ctx: max_len,
            n_batch: 512.min(max_len),
            n_threads,
            features: FeatureSource::auto(&target.architecture(), layers),
            flash_attn,
            ..ContextParams::default()
        };
        let ctx = Context::new(target.clone(), &params, None)?;
        if soft_k > target.n_vocab() {
            bail!("--soft-k {soft_k}: the target's vocabulary has {} tokens", target.n_vocab());
        }
        Ok(Self { target, mask_token, ctx, max_len, soft_k, template, compiled: std::sync::OnceLock::new() })
    }

    pub fn dataset(&self) -> Dataset {
        Dataset {
            layers: self.ctx.features().layers().to_vec(),
            mask_token: self.mask_token,
            n_embd: self.target.n_embd(),
            tokens: Vec::new(),
            next: Vec::new(),
            features: Vec::new(),
            offsets: vec![0],
            answer_start: Vec::new(),
            soft_k: self.soft_k,
            topk_ids: Vec::new(),
            topk_logprobs: Vec::new(),
        }
    }

    /// The row's tokens and where the target's own text starts: the answer of a chat row,
    /// the second token of a text row (the trainer keeps only labels the target agrees with).
    pub fn tokenize(&self, c: &Conversation) -> Result<(Vec<Token>, usize)> {
        let (mut tokens, start) = match c {
            Conversation::Chat { prompt, answer } => {
                let user = ChatMessage { role: "user".into(), content: prompt.clone() };
                let assistant = ChatMessage { role: "assistant".into(), content: answer.clone() };
                let template = match self.compiled.get() {
                    Some(t) => t,
                    None => {
                        let t = ChatTemplate::new(&self.target, &self.template)?;
                        self.compiled.get_or_init(|| t)
                    }
                };
                let prefix = template.render(std::slice::from_ref(&user), true)?;
                let full = template.render(&[user, assistant], false)?;
                let prefix = self.target.tokenize(&prefix, true, true)?;
                let full = self.target.tokenize(&full, true, true)?;
                let start = prefix.iter().zip(&full).take_while(|(a, b)| a == b).count();
                (full, start)
            }
            Conversation::Text { text } => (self.target.tokenize(text, true, false)?, 1),
        };
        tokens.truncate(self.max_len);
        Ok((tokens, start))
    }

    /// Prefill one conversation and append its rows to `out`; returns its token count.
    pub fn add(&mut self, c: &Conversation, out: &mut Dataset) -> Result<usize> {
        let (tokens, answer_start) = self.tokenize(c)?;
        if answer_start >= tokens.len() {
            return Ok(0); // nothing the target wrote survives the length cut
        }
        self.ctx.clear_memory();
        let n_batch = self.ctx.n_batch();
        let mut batch = Batch::tokens(n_batch, 1);
        let base = out.tokens.len() as i64;
        for (chunk_i, chunk) in tokens.chunks(n_batch).enumerate() {
            batch.clear();
            for (j, &t) in chunk.iter().enumerate() {
                batch.add_token(t, (chunk_i * n_batch + j) as i32, &[0], true)?;
            }
            self.ctx.decode(&batch, "dataset prefill")?;
            let rows: Vec<usize> = (0..chunk.len()).collect();
            self.ctx.append_features(&rows, &mut out.features)?;
            for r in rows {
                let logits = self.ctx.logits(r)?;
                // the first maximum, as llama.cpp's greedy sampler picks
                out.next.push(crate::draft::lattice::argmax(logits) as i32);
                if self.soft_k > 0 {
                    top_logprobs(logits, self.soft_k, &mut out.topk_ids, &mut out.topk_logprobs);
                }
            }
        }
        out.tokens.extend_from_slice(&tokens);
        out.answer_start.push(base + answer_start as i64);
        out.offsets.push(out.tokens.len() as i64);
        Ok(tokens.len())
    }
}

impl Dataset {
    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    pub fn n_sequences(&self) -> usize {
        self.answer_start.len()
    }

    pub fn write(&self, path: &Path, target_name: &str) -> Result<()> {
        use safetensors::tensor::{Dtype, TensorView};
        fn bytes<T: Copy>(v: &[T]) -> &[u8] {
            // plain integers and floats, little-endian on every platform llama.cpp runs on
            unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
        }
        let n = self.tokens.len();
        let width = self.layers.len() * self.n_embd;
        let s = self.answer_start.len();
        let views = vec![
            ("tokens", TensorView::new(Dtype::I32, vec![n], bytes(&self.tokens))?),
            ("next", TensorView::new(Dtype::I32, vec![n], bytes(&self.next))?),
            ("features", TensorView::new(Dtype::F32, vec![n, width], bytes(&self.features))?),
            ("offsets", TensorView::new(Dtype::I64, vec![s + 1], bytes(&self.offsets))?),
            ("answer_start", TensorView::new(Dtype::I64, vec![s], bytes(&self.answer_start))?),
        ];
        let mut views = views;
        if self.soft_k > 0 {
            let k = self.soft_k;
            views.push(("topk_ids", TensorView::new(Dtype::I32, vec![n, k], bytes(&self.topk_ids))?));
            views.push(("topk_logprobs", TensorView::new(Dtype::F32, vec![n, k], bytes(&self.topk_logprobs))?));
        }
        let layers = self.layers.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(",");
        let meta = HashMap::from([
            ("format".to_string(), DATASET_FORMAT.to_string()),
            ("target".to_string(), target_name.to_string()),
            ("target_layers".to_string(), layers),
            ("n_embd".to_string(), self.n_embd.to_string()),
            ("mask_token_id".to_string(), self.mask_token.to_string()),
        ]);
        safetensors::serialize_to_file(views, Some(meta), path)
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }
}

/// Appends the `k` most likely tokens of `logits` (most likely first; ties by lower id, as
/// the greedy label) and their log-probabilities under the softmax over all of `logits`.
fn top_logprobs(logits: &[f32], k: usize, ids: &mut Vec<i32>, logprobs: &mut Vec<f32>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_z = max + logits.iter().map(|&x| ((x - max) as f64).exp()).sum::<f64>().ln() as f32;
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    order.select_nth_unstable_by(k - 1, by_logit);
    order.truncate(k);
    order.sort_by(by_logit);
    for i in order {
        ids.push(i as i32);
        logprobs.push(logits[i as usize] - log_z);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_logprobs_are_the_k_most_likely_in_order_with_their_log_probabilities() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let (mut ids, mut lp) = (Vec::new(), Vec::new());
        top_logprobs(&logits, 3, &mut ids, &mut lp);
        assert_eq!(ids, vec![1, 3, 2], "most likely first, ties by lower id");
        let z: f32 = logits.iter().map(|x| x.exp()).sum();
        for (&i, &l) in ids.iter().zip(&lp) {
            assert!((l - (logits[i as usize].exp() / z).ln()).abs() < 1e-5, "{i}: {l}");
        }
        assert_eq!(ids[0], crate::draft::lattice::argmax(&logits) as i32, "the first is the greedy label");
    }

    #[test]
    fn default_layers_follow_the_reference_spread_plus_one() {
        // reference (layer outputs) for 30 layers, 5 features: [1, 8, 14, 20, 27]
        assert_eq!(default_layers(30, 5), vec![2, 9, 15, 21, 28]);
        assert_eq!(default_layers(24, 1), vec![13]);
        assert!(default_layers(24, 4).iter().all(|&l| (1..24).contains(&l)));
    }
}
