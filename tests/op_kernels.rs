//! dflash2's op kernels (vendor/f16_attention.cpp, vendor/quant_rows.cpp, vendor/drafter_ops.cpp,
//! vendor/q8_0_attention.cpp) must give every output the bits ggml's own kernels give it. The
//! comparisons switch kernels off and on for the whole process, so they live in a test binary of
//! their own, one test at a time.
mod common;

use common::tail_logits;
use dflash2::llama::{Model, ModelParams, OpKernel};
use dflash2::target::{load_target, Repack};
use std::sync::{Arc, Mutex};

/// The comparisons switch kernels process-wide: one at a time.
static SWITCHING: Mutex<()> = Mutex::new(());

/// Every logit with `kernel` on against ggml's own kernel in its place, on both test targets loaded
/// as the engine loads them (in the layout whose batches round as single rows: on an AVX-512 CPU
/// without AMX, repacked Q4_K batches of 4 or more do not): in the prompt batch, in single steps and
/// in verify batches of 2, 3, 6 and 17 rows, before and past 256 cells of cache. `built` says
/// whether this build has the kernel (the CPU features it needs).
fn rounds_every_logit_as_ggml_does(kernel: OpKernel, built: bool) {
    let _one_at_a_time = SWITCHING.lock().unwrap_or_else(|e| e.into_inner());
    dflash2::llama::install_kernels(); // as every target load does
    assert_eq!(kernel.is_on(), built, "{kernel:?} must be on exactly where it is built");
    for file in [common::SMOLLM2, common::QWEN_05B] {
        let params = common::engine_params(2, dflash2::llama::CacheType::F16);
        let (model, _) = load_target(&common::real_model(file), 999, Repack::Auto, &params).unwrap();
        let text = "def fizzbuzz(n):\n    \"\"\"Return the FizzBuzz sequence up to n.\"\"\"\n".repeat(20);
        let tokens = model.tokenize(&text, true, false).unwrap();
        assert!(tokens.len() > 300, "the context must pass 256 cells");
        for context in [120, tokens.len()] {
            let tokens = &tokens[..context];
            kernel.set(false);
            let ggml = tail_logits(&model, tokens, 17, 1);
            assert_eq!(kernel.set(built), built);
            for chunk in [1, 2, 3, 6, 17] {
                let ours = tail_logits(&model, tokens, 17, chunk);
                for (row, (a, b)) in ours.iter().zip(&ggml).enumerate() {
                    let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{kernel:?}, {file}, {context} tokens, batches of {chunk}: row {row} differs from ggml's");
                }
            }
        }
    }
}

/// Without flash attention the target's attention over its f16 cache runs dflash2's kernel on
/// every AVX-512 CPU. One pass of a cache row serves up to 6 queries: 1, 2 and 6 rows are one pass
/// on SmolLM2's 3 query heads per cache head, 3 and 17 are several.
#[test]
fn f16_attention_kernel_rounds_every_logit_as_ggml_does() {
    let built = dflash2::llama::system_info().contains("AVX512 = 1");
    rounds_every_logit_as_ggml_does(OpKernel::F16Attention, built);
}

/// Qwen2.5-Coder-0.5B's Q4_K_M keeps most of its weights in Q5_0 (its width, 896, is no multiple
/// of 256), which dflash2's kernel multiplies on AVX512-VNNI CPUs: eight weight rows side by side
/// for one row (a single step), four by up to four rows (2, 3: one group; 6, 17 and the prompt:
/// several, the last one short).
#[test]
fn q5_0_kernel_rounds_every_logit_as_ggml_does() {
    let built = dflash2::llama::system_info().contains("AVX512_VNNI = 1");
    rounds_every_logit_as_ggml_does(OpKernel::Q5_0Rows, built);
}

/// SmolLM2's output head (its tied token embeddings) and Qwen2.5-Coder's head and value projections
/// are Q8_0, which dflash2's kernel multiplies on AVX512-VNNI CPUs where ggml's AMX backend does
/// not hold them: eight weight rows side by side for one row, four by up to four rows for more.
#[test]
fn q8_0_kernel_rounds_every_logit_as_ggml_does() {
    let built = dflash2::llama::system_info().contains("AVX512_VNNI = 1");
    rounds_every_logit_as_ggml_does(OpKernel::Q8_0Rows, built);
}

/// Every candidate and transition score of the shipped drafter's lattices at every block size the
/// engine drafts, with `kernel` on against ggml's own kernel in its place, over 64 and 300 injected
/// positions (before and past 256 cells of cache).
fn drafter_lattices_as_ggml_gives_them(kernel: OpKernel) {
    use dflash2::draft::drafter::Drafter;
    use dflash2::llama::{CacheType, Context, ContextParams};
    let _one_at_a_time = SWITCHING.lock().unwrap_or_else(|e| e.into_inner());
    dflash2::llama::install_kernels();
    let target = Arc::new(Model::load(&common::real_model(common::SMOLLM2), &ModelParams::default()).unwrap());
    let drafter = Arc::new(Model::load(&common::shipped_drafter(), &ModelParams::default()).unwrap());
    let tctx = Context::new(target.clone(), &ContextParams { n_ctx: 512, ..ContextParams::default() }, None).unwrap();
    const BLOCKS: [usize; 4] = [2, 4, 8, 16];
    for injected in [64, 300] {
        let lattices = |ours: bool| {
            assert_eq!(kernel.set(ours), ours);
            let mut d = Drafter::new(drafter.clone(), &tctx, 1, 2, CacheType::Q8_0, CacheType::Q8_0).unwrap();
            let w = d.feature_width();
            // any features: the comparison is between two computations of the same graph
            let rows: Vec<f32> = (0..w * injected).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
            d.inject(&rows, 0, 0).unwrap();
            BLOCKS.map(|b| d.draft(&[(1234, injected, 0)], b).unwrap())
        };
        let ggml = lattices(false);
        let ours = lattices(true);
        for ((a, g), b) in ours.iter().zip(&ggml).zip(BLOCKS) {
            let (a, g) = (&a[0], &g[0]);
            assert_eq!(a.ids, g.ids, "{kernel:?}, {injected} positions, block {b}: candidates differ from ggml's");
            let same = a.scores.iter().zip(&g.scores).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{kernel:?}, {injected} positions, block {b}: scores differ from ggml's");
            assert!(a.ids.iter().all(|&t| t >= 0 && t < target.n_vocab() as i32), "block {b}: candidates in the vocabulary");
        }
    }
}

/// The shipped drafter's reduced vocabulary (8,192 draft tokens) reaches the full one through
/// logits rows filled with -inf as a tensor one element wide and scattered into; its candidates
/// are a top-k over those rows, its lattice rows are padded, its convolutions repeat, add and
/// multiply rows 16 wide: dflash2's kernels for these ops must leave each block's lattice with the
/// bits ggml's give it.
#[test]
fn drafter_ops_give_the_drafter_the_same_lattices() {
    dflash2::llama::install_kernels();
    assert!(OpKernel::DrafterOps.is_on(), "the drafter ops are built everywhere");
    drafter_lattices_as_ggml_gives_them(OpKernel::DrafterOps);
}

/// The drafter ops' adds, multiplies and repeats also take a target's ops of their shapes (its norm
/// weights' broadcast products): every logit keeps its bits.
#[test]
fn drafter_ops_leave_every_target_logit_as_ggml_gives_it() {
    rounds_every_logit_as_ggml_does(OpKernel::DrafterOps, true);
}

/// `kernel`, built for AVX512-VNNI CPUs, is on exactly there and leaves the drafter's lattices as
/// ggml's kernel gives them.
fn vnni_kernel_gives_the_drafter_the_same_lattices(kernel: OpKernel) {
    let built = dflash2::llama::system_info().contains("AVX512_VNNI = 1");
    dflash2::llama::install_kernels();
    assert_eq!(kernel.is_on(), built, "{kernel:?} must be on exactly where it is built");
    if built {
        drafter_lattices_as_ggml_gives_them(kernel);
    }
}

/// The drafter's weights are Q8_0: on AVX512-VNNI CPUs without AMX dflash2's kernel multiplies them
/// (an 8-row block decode is two groups of four rows, a block of 2 one group of two, the feature
/// injection of 1-8 rows one or two groups).
#[test]
fn q8_0_rows_give_the_drafter_the_same_lattices() {
    vnni_kernel_gives_the_drafter_the_same_lattices(OpKernel::Q8_0Rows);
}

/// The drafter attends over its q8_0 cache with flash attention, which dflash2's kernel computes
/// on AVX512-VNNI CPUs: SmolLM2's drafter has 3 query heads per KV head, so a block of 2-8 is one
/// pass of 6-24 rows per KV head and a block of 16 two (10 and 6 tokens).
#[test]
fn q8_0_attention_gives_the_drafter_the_same_lattices() {
    vnni_kernel_gives_the_drafter_the_same_lattices(OpKernel::Q8_0Attention);
}

/// The kernels with a check of their own on random inputs (every op they take, in the drafter's
/// shapes and others: tests/op_kernels.rs's lattices alone would miss a change that the drafter's
/// quantized products round away) against ggml's, output for output, at 1 and 2 threads.
#[test]
fn kernels_round_every_output_as_ggml_does_on_random_inputs() {
    let _one_at_a_time = SWITCHING.lock().unwrap_or_else(|e| e.into_inner());
    dflash2::llama::install_kernels();
    let vnni = dflash2::llama::system_info().contains("AVX512_VNNI = 1");
    let needs_vnni = |k: OpKernel| k != OpKernel::DrafterOps;
    for kernel in [OpKernel::DrafterOps, OpKernel::Q8_0Attention, OpKernel::Q5_0Rows, OpKernel::Q8_0Rows] {
        for seed in 1..=3 {
            for threads in [1, 2] {
                match kernel.differences(seed, threads).expect("these kernels have random checks") {
                    Ok(differing) => assert_eq!(differing, 0, "{kernel:?}, seed {seed}, {threads} threads: outputs differ from ggml's"),
                    Err(e) => assert!(needs_vnni(kernel) && !vnni, "{kernel:?}: {e}"),
                }
            }
        }
        assert!(kernel.is_on() || (needs_vnni(kernel) && !vnni), "{kernel:?} is left on");
    }
    assert!(OpKernel::F16Attention.differences(1, 1).is_none(), "checked on real models only");
}
