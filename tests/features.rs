//! Target features: llama.cpp's own layer-input extraction and our graph-callback
//! capture must hand the drafter the same rows, and the callback must work where
//! llama.cpp has no extraction (qwen2).
mod common;

use dflash2::llama::{Batch, Context, ContextParams, FeatureSource, Model, ModelParams};
use std::sync::Arc;

fn capture(model: &Arc<Model>, source: FeatureSource, prompt: &[i32]) -> Vec<f32> {
    let params = ContextParams { n_ctx: 512, n_batch: 64, features: source, ..ContextParams::default() };
    let mut ctx = Context::new(model.clone(), &params, None).unwrap();
    let mut batch = Batch::tokens(64, 1);
    for (i, &t) in prompt.iter().enumerate() {
        batch.add_token(t, i as i32, &[0], i + 1 == prompt.len()).unwrap();
    }
    ctx.decode(&batch, "test").unwrap();
    let rows: Vec<usize> = (0..prompt.len()).collect();
    let mut out = Vec::new();
    ctx.append_features(&rows, &mut out).unwrap();
    out
}

#[test]
fn native_and_callback_features_are_identical_on_a_llama_target() {
    let model = Arc::new(Model::load(&common::real_model(common::SMOLLM2), &ModelParams::default()).unwrap());
    let prompt = model.tokenize("The quick brown fox jumps over the lazy dog.", true, false).unwrap();
    let layers = vec![1, 11, 20, 29];
    let native = capture(&model, FeatureSource::Native(layers.clone()), &prompt);
    let callback = capture(&model, FeatureSource::Callback(layers.clone()), &prompt);
    assert_eq!(native.len(), prompt.len() * layers.len() * model.n_embd());
    assert!(native.iter().any(|&x| x != 0.0), "features are all zero");
    assert_eq!(native, callback, "callback capture differs from llama.cpp's extraction");
}

#[test]
fn callback_features_work_on_a_qwen2_target() {
    let model = Arc::new(Model::load(&common::real_model(common::QWEN_05B), &ModelParams::default()).unwrap());
    assert_eq!(model.architecture(), "qwen2");
    assert!(matches!(FeatureSource::auto("qwen2", vec![1]), FeatureSource::Callback(_)));
    let prompt = model.tokenize("def add(a, b):\n    return", true, false).unwrap();
    let layers = vec![2, 12, 22];
    let a = capture(&model, FeatureSource::Callback(layers.clone()), &prompt);
    assert_eq!(a.len(), prompt.len() * layers.len() * model.n_embd());
    assert!(a.iter().all(|x| x.is_finite()) && a.iter().any(|&x| x != 0.0));
    // Rows differ between tokens (they are real per-token states, not one row repeated).
    let w = layers.len() * model.n_embd();
    assert_ne!(&a[..w], &a[w..2 * w]);
    // Deterministic across contexts.
    assert_eq!(a, capture(&model, FeatureSource::Callback(layers), &prompt));
}
