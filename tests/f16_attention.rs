//! dflash2's kernel for attention over an f16 cache (vendor/f16_attention.cpp) must give every
//! logit the bits ggml's own kernel gives it. The comparison switches the kernel off and on for
//! the whole process, so it lives in a test binary of its own, where no other decode runs.
mod common;

use common::tail_logits;
use dflash2::llama::{Model, ModelParams};
use std::sync::Arc;

/// Without flash attention the target's attention over its f16 cache runs dflash2's kernel
/// (vendor/f16_attention.cpp) on every AVX-512 CPU. Every logit must keep the bits ggml's own
/// kernel gives it: in the prompt batch, in single steps and in verify batches (one pass of a
/// cache row serves up to 6 queries: 1, 2 and 6 rows are one pass on SmolLM2's 3 query heads per
/// cache head, 3 and 17 are several), before and past 256 cells of cache, on both test targets.
#[test]
fn f16_attention_kernel_rounds_every_logit_as_ggml_does() {
    let avx512 = dflash2::llama::system_info().contains("AVX512 = 1");
    dflash2::llama::install_kernels(); // as every target load does
    assert_eq!(dflash2::llama::f16_attention_on(), avx512, "the f16 attention kernel must be on exactly on AVX-512 builds");
    for file in [common::SMOLLM2, common::QWEN_05B] {
        let model = Arc::new(Model::load(&common::real_model(file), &ModelParams::default()).unwrap());
        let text = "def fizzbuzz(n):\n    \"\"\"Return the FizzBuzz sequence up to n.\"\"\"\n".repeat(20);
        let tokens = model.tokenize(&text, true, false).unwrap();
        assert!(tokens.len() > 300, "the context must pass 256 cells");
        for context in [120, tokens.len()] {
            let tokens = &tokens[..context];
            dflash2::llama::set_f16_attention(false);
            let ggml = tail_logits(&model, tokens, 17, 1);
            assert_eq!(dflash2::llama::set_f16_attention(avx512), avx512);
            for chunk in [1, 2, 3, 6, 17] {
                let ours = tail_logits(&model, tokens, 17, chunk);
                for (row, (a, b)) in ours.iter().zip(&ggml).enumerate() {
                    let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{file}, {context} tokens, batches of {chunk}: row {row} differs from ggml's");
                }
            }
        }
    }
}

