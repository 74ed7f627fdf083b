//! dflash2's op kernels (vendor/f16_attention.cpp, vendor/quant_rows.cpp, vendor/kquant_rows.cpp,
//! vendor/q4_x8_rows.cpp, vendor/kx8_rows.cpp, vendor/drafter_conv.cpp, vendor/drafter_ops.cpp,
//! vendor/q8_0_attention.cpp) must give every output the bits ggml's own
//! kernels give it; the drafter's integer products (vendor/drafter_rows.cpp) must give each output
//! the bits of their own scheme, never touch a target, and keep the drafter's candidates. The
//! comparisons switch kernels off and on for the whole process, so they live in a test binary of
//! their own, one test at a time.
mod common;

use common::tail_logits;
use dflash2::llama::{Model, ModelParams, OpKernel};
use dflash2::target::{load_target, Repack};
use std::sync::{Arc, Mutex};

/// The comparisons switch kernels process-wide: one at a time.
static SWITCHING: Mutex<()> = Mutex::new(());

/// Whether this CPU has what the product and q8_0 attention kernels are built for.
fn vnni() -> bool {
    dflash2::llama::system_info().contains("AVX512_VNNI = 1")
}

/// The same values, bit for bit.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Every logit with `kernel` on against ggml's own kernel in its place, on both test targets loaded
/// as the engine loads them (in the layout whose batches round as single rows: on an AVX-512 CPU
/// without AMX, repacked Q4_K batches of 4 or more do not): in the prompt batch, in single steps and
/// in verify batches of 2, 3, 6 and 17 rows, before and past 256 cells of cache. `built` says
/// whether this build has the kernel (the CPU features it needs).
fn rounds_every_logit_as_ggml_does(kernel: OpKernel, built: bool) {
    let targets = [common::real_model(common::SMOLLM2), common::real_model(common::QWEN_05B)];
    rounds_every_logit_of_targets_as_ggml_does(kernel, built, &targets, Reference::Batched);
}

/// What ggml's logits are computed as.
#[derive(Clone, Copy, PartialEq)]
enum Reference {
    /// The prompt as one batch, as the kernel's run decodes it (ggml's batch kernel rounds as its
    /// single-row one).
    Batched,
    /// Every token alone: for a kernel that gives a batch the bits of ggml's single-row kernel
    /// where ggml's own batch kernel rounds otherwise (its prompt batch would fill another cache).
    SingleRows,
}

/// The same on `targets`, each loaded once.
fn rounds_every_logit_of_targets_as_ggml_does(kernel: OpKernel, built: bool, targets: &[std::path::PathBuf], reference: Reference) {
    let _one_at_a_time = SWITCHING.lock().unwrap_or_else(|e| e.into_inner());
    dflash2::llama::install_kernels(); // as every target load does
    assert_eq!(kernel.is_on(), built, "{kernel:?} must be on exactly where it is built");
    for target in targets {
        let file = target.display();
        let params = common::engine_params(2, dflash2::llama::CacheType::F16);
        let (model, _) = load_target(target, 999, Repack::Auto, &params).unwrap();
        let text = "def fizzbuzz(n):\n    \"\"\"Return the FizzBuzz sequence up to n.\"\"\"\n".repeat(20);
        let tokens = model.tokenize(&text, true, false).unwrap();
        assert!(tokens.len() > 300, "the context must pass 256 cells");
        for context in [120, tokens.len()] {
            let tokens = &tokens[..context];
            kernel.set(false);
            let ggml = match reference {
                Reference::Batched => tail_logits(&model, tokens, 17, 1),
                Reference::SingleRows => tail_logits(&model, tokens, context - 1, 1).split_off(context - 1 - 17),
            };
            assert_eq!(kernel.set(built), built);
            for chunk in [1, 2, 3, 6, 17] {
                let ours = tail_logits(&model, tokens, 17, chunk);
                for (row, (a, b)) in ours.iter().zip(&ggml).enumerate() {
                    assert!(same_bits(a, b), "{kernel:?}, {file}, {context} tokens, batches of {chunk}: row {row} differs from ggml's");
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
    let built = vnni();
    rounds_every_logit_as_ggml_does(OpKernel::Q5_0Rows, built);
}

/// SmolLM2 as shipped keeps its layers' weights in Q4_1, which ggml repacks for no CPU without AMX
/// and dflash2's kernel multiplies on AVX512-VNNI CPUs (the blocks' minimums times the activations'
/// sums added as ggml adds them): one weight row at a time for one row, four by up to four rows
/// for more.
#[test]
fn q4_1_kernel_rounds_every_logit_as_ggml_does() {
    let built = vnni();
    rounds_every_logit_as_ggml_does(OpKernel::Q4_1Rows, built);
}

/// SmolLM2 requantized to Q4_0 (`dflash2 quantize`, the target of the speed goal) has its layers'
/// weights repacked into 8-column runs on AVX2 CPUs without AMX, which dflash2's kernel multiplies
/// by 2 or more rows on AVX512-VNNI CPUs: 2, 3 and 6 rows are one pass over each block, 17 and the
/// prompt several passes of 8 and a last short one; a single step stays ggml's. The kernel must sit
/// in front of every such weight (30 layers of 7) where it is built and ggml repacks them so.
#[test]
fn q4_0x8_kernel_rounds_every_logit_as_ggml_does() {
    let built = vnni();
    let q4_0 = requantized(common::SMOLLM2, "q4_0", "SmolLM2-135M-Instruct.Q4_0.gguf");
    let before = OpKernel::Q4_0x8Rows.taken().unwrap_or(0);
    rounds_every_logit_of_targets_as_ggml_does(OpKernel::Q4_0x8Rows, built, &[q4_0], Reference::Batched);
    let taken = OpKernel::Q4_0x8Rows.taken().unwrap_or(0) - before;
    assert_eq!(taken, if repacked_8x8_here() { 30 * 7 } else { 0 }, "the kernel sits in front of {taken} weights");
}

/// SmolLM2's output head (its tied token embeddings) and Qwen2.5-Coder's head and value projections
/// are Q8_0, which dflash2's kernel multiplies on AVX512-VNNI CPUs where ggml's AMX backend does
/// not hold them: eight weight rows side by side for one row, four by up to four rows for more.
#[test]
fn q8_0_kernel_rounds_every_logit_as_ggml_does() {
    let built = vnni();
    rounds_every_logit_as_ggml_does(OpKernel::Q8_0Rows, built);
}

/// Whether ggml repacks Q4_0 and K-quant weights into 8-column runs on this CPU (AVX2 CPUs without
/// AMX, whose backend holds them in its tiles instead) and dflash2's kernels for them are built
/// (AVX512-VNNI).
fn repacked_8x8_here() -> bool {
    vnni() && !dflash2::llama::system_info().contains("AMX_INT8 = 1")
}

/// `model` requantized to `kind` by `dflash2 quantize`, made once in the tests' scratch folder.
fn requantized(model: &str, kind: &str, file: &str) -> std::path::PathBuf {
    let out = common::scratch_dir(&format!("op-kernels-{kind}")).join(file);
    if !out.exists() {
        let (_, ftype) = dflash2::llama::QUANT_TYPES.into_iter().find(|(name, _)| *name == kind).unwrap();
        dflash2::llama::quantize(&common::real_model(model), &out, ftype, true, 2).unwrap();
    }
    out
}

/// Qwen2.5-Coder-0.5B's Q4_K_M keeps its 24 ffn_down weights (4864 wide, its only width that is a
/// multiple of 256) half in Q4_K, half in Q6_K. ggml repacks the Q4_K ones into 8-column runs on AVX2
/// CPUs, whose 4-row gemm rounds otherwise than its single-row gemv; dflash2's kernel gives every
/// row the gemv's bits (ggml's logits are taken one token at a time, the prompt's too), so the
/// load-time probe keeps the weights repacked (it had to drop repacking before) and the kernel
/// sits in front of all 12 of them.
#[test]
fn q4_kx8_kernel_rounds_every_logit_as_ggml_does() {
    let built = vnni();
    let before = OpKernel::Q4Kx8Rows.taken().unwrap_or(0);
    let qwen = common::real_model(common::QWEN_05B); // SmolLM2 has no Q4_K weights
    rounds_every_logit_of_targets_as_ggml_does(OpKernel::Q4Kx8Rows, built, &[qwen.clone()], Reference::SingleRows);
    let taken = OpKernel::Q4Kx8Rows.taken().unwrap_or(0) - before;
    assert_eq!(taken, if repacked_8x8_here() { 12 } else { 0 }, "the kernel sits in front of {taken} weights");
    if repacked_8x8_here() {
        dflash2::llama::install_kernels();
        let params = common::engine_params(2, dflash2::llama::CacheType::F16);
        let (_, choice) = load_target(&qwen, 999, Repack::Auto, &params).unwrap();
        assert!(choice.repack && choice.lossless, "the probe dropped repacking: {}", choice.reason);
    }
}

/// The Q5_K and Q6_K weights of Qwen2.5-Coder-0.5B requantized to Q5_K_M (`dflash2 quantize`: its
/// ffn_down, the model's only width that is a multiple of 256, in both types, as the Q6_K ones of
/// its Q4_K_M), which ggml keeps unrepacked on x86 without AMX: dflash2's kernel multiplies them, a
/// plain step's single row included.
#[test]
fn kquant_kernel_rounds_every_logit_as_ggml_does() {
    let built = vnni();
    let q5_k_m = requantized(common::QWEN_05B, "q5_k_m", "qwen2.5-coder-0.5b-instruct-q5_k_m.gguf");
    let types = dflash2::gguf::read_gguf(&q5_k_m).unwrap().weight_types();
    for kind in ["Q5_K", "Q6_K"] {
        assert!(types.iter().any(|w| w.type_name == kind), "the requantized file has no {kind} weights: {types:?}");
    }
    rounds_every_logit_of_targets_as_ggml_does(OpKernel::KQuantRows, built, &[q5_k_m], Reference::Batched);
}

const BLOCKS: [usize; 4] = [2, 4, 8, 16];

/// Code of the kind the drafter drafts (over 300 tokens: past 256 cells of the drafter's cache).
const CODE: &str = r#"import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class Inventory:
    """Items in stock, by name, with their prices and counts."""

    prices: Dict[str, float] = field(default_factory=dict)
    counts: Dict[str, int] = field(default_factory=dict)

    def add(self, name: str, price: float, count: int = 1) -> None:
        """Add `count` items called `name` at `price` each."""
        if count <= 0:
            raise ValueError("count must be positive")
        self.prices[name] = price
        self.counts[name] = self.counts.get(name, 0) + count

    def remove(self, name: str, count: int = 1) -> bool:
        """Take `count` items out; False if there are not enough."""
        have = self.counts.get(name, 0)
        if have < count:
            return False
        self.counts[name] = have - count
        return True

    def total_value(self) -> float:
        """The value of everything in stock."""
        return sum(self.prices[n] * c for n, c in self.counts.items())

    def cheapest(self) -> Optional[str]:
        """The name of the cheapest item in stock, if any."""
        names = [n for n, c in self.counts.items() if c > 0]
        return min(names, key=lambda n: self.prices[n]) if names else None

    def to_json(self) -> str:
        return json.dumps({"prices": self.prices, "counts": self.counts}, sort_keys=True)


def load(text: str) -> Inventory:
    data = json.loads(text)
    return Inventory(prices=data["prices"], counts=data["counts"])
"#;

/// The shipped drafter's lattices of SmolLM2's own features over code, at every block size the
/// engine drafts, after 64 and 300 injected positions (before and past 256 cells of cache), from a
/// fresh drafter for each kernel setting `switch(true)` and `switch(false)` make:
/// [setting][injected][block].
fn drafter_lattices(switch: impl Fn(bool)) -> [[[dflash2::draft::Lattice; 4]; 2]; 2] {
    use dflash2::draft::drafter::Drafter;
    use dflash2::llama::{Batch, CacheType, Context, ContextParams, FeatureSource};
    let target = Arc::new(Model::load(&common::real_model(common::SMOLLM2), &ModelParams::default()).unwrap());
    let drafter = Arc::new(Model::load(&common::shipped_drafter(), &ModelParams::default()).unwrap());
    let features = FeatureSource::Native(drafter.target_layer_ids());
    let mut tctx = Context::new(target.clone(), &ContextParams { n_ctx: 1024, features, ..ContextParams::default() }, None).unwrap();
    let tokens = target.tokenize(CODE, true, false).unwrap();
    assert!(tokens.len() > 301, "{} tokens", tokens.len());
    let mut b = Batch::tokens(tokens.len(), 1);
    for (i, &t) in tokens.iter().enumerate() {
        b.add_token(t, i as i32, &[0], false).unwrap();
    }
    tctx.decode(&b, "code").unwrap();
    let mut rows = Vec::new();
    tctx.append_features(&(0..300).collect::<Vec<_>>(), &mut rows).unwrap();
    let lattices = |setting: bool, injected: usize| {
        switch(setting);
        let mut d = Drafter::new(drafter.clone(), &tctx, 1, 2, CacheType::Q8_0, CacheType::Q8_0).unwrap();
        d.inject(&rows[..d.feature_width() * injected], 0, 0).unwrap();
        // twice each: llama.cpp reuses the graph of a shape for the second
        let out = BLOCKS.map(|b| {
            let first = d.draft(&[(tokens[injected], injected, 0)], b).unwrap().remove(0);
            let again = d.draft(&[(tokens[injected], injected, 0)], b).unwrap().remove(0);
            assert!(first.ids == again.ids && same_bits(&first.scores, &again.scores), "block {b}: a second draft of the same block differs");
            again
        });
        for (l, b) in out.iter().zip(BLOCKS) {
            assert!(l.ids.iter().all(|&t| t >= 0 && t < target.n_vocab() as i32), "block {b}: candidates in the vocabulary");
        }
        out
    };
    [true, false].map(|setting| [64, 300].map(|injected| lattices(setting, injected)))
}

/// Every candidate and transition score of the shipped drafter's lattices with `kernel` on against
/// ggml's own kernel in its place, the drafter's products as ggml rounds them.
fn drafter_lattices_as_ggml_gives_them(kernel: OpKernel) {
    let _one_at_a_time = SWITCHING.lock().unwrap_or_else(|e| e.into_inner());
    dflash2::llama::install_kernels();
    let integer = OpKernel::DrafterRows.is_on();
    let [ours, ggml] = drafter_lattices(|on| {
        OpKernel::DrafterRows.set(false);
        assert_eq!(kernel.set(on), on);
    });
    OpKernel::DrafterRows.set(integer);
    kernel.set(true);
    for ((ours, ggml), injected) in ours.iter().zip(&ggml).zip([64, 300]) {
        for ((a, g), b) in ours.iter().zip(ggml).zip(BLOCKS) {
            assert_eq!(a.ids, g.ids, "{kernel:?}, {injected} positions, block {b}: candidates differ from ggml's");
            assert!(same_bits(&a.scores, &g.scores), "{kernel:?}, {injected} positions, block {b}: scores differ from ggml's");
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

/// The DFlash 2 drafter's convolutions (four a layer) computed at their last adds, 13 ops each
/// skipped: the lattices keep ggml's bits, and the kernel did compute the drafter's convolutions
/// (every block size drafts from the same four per layer).
#[test]
fn drafter_conv_gives_the_drafter_the_same_lattices() {
    dflash2::llama::install_kernels();
    assert!(OpKernel::DrafterConv.is_on(), "the convolutions are built everywhere");
    let before = OpKernel::DrafterConv.taken().unwrap();
    drafter_lattices_as_ggml_gives_them(OpKernel::DrafterConv);
    let computed = OpKernel::DrafterConv.taken().unwrap() - before;
    // 2 cache lengths x 4 block sizes x 2 drafts x 2 layers x 4 convolutions
    assert_eq!(computed, 2 * 4 * 2 * 2 * 4, "convolutions the kernel computed");
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
    let built = vnni();
    dflash2::llama::install_kernels();
    assert_eq!(kernel.is_on(), built, "{kernel:?} must be on exactly where it is built");
    if built {
        drafter_lattices_as_ggml_gives_them(kernel);
    }
}

/// The drafter's weights are Q8_0: on AVX512-VNNI CPUs without AMX, with the drafter's integer
/// products off (`DFLASH2_NO_DRAFTER_ROWS`), dflash2's kernel multiplies them as ggml rounds them
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
    let has_vnni = vnni();
    let needs_vnni = |k: OpKernel| !matches!(k, OpKernel::DrafterOps | OpKernel::DrafterConv);
    for kernel in [
        OpKernel::DrafterConv,
        OpKernel::DrafterOps,
        OpKernel::Q8_0Attention,
        OpKernel::Q5_0Rows,
        OpKernel::Q4_0x8Rows,
        OpKernel::Q4Kx8Rows,
        OpKernel::Iq4NlX8Rows,
        OpKernel::Q2Kx8Rows,
        OpKernel::Q4_1Rows,
        OpKernel::KQuantRows,
        OpKernel::Q8_0Rows,
        OpKernel::DrafterRows,
    ] {
        for seed in 1..=3 {
            for threads in [1, 2] {
                match kernel.differences(seed, threads).expect("these kernels have random checks") {
                    // the drafter's integer products: outputs off their own scheme or beyond its bound
                    Ok(differing) => assert_eq!(differing, 0, "{kernel:?}, seed {seed}, {threads} threads: outputs differ"),
                    Err(e) => assert!(needs_vnni(kernel) && !has_vnni, "{kernel:?}: {e}"),
                }
            }
        }
        assert!(kernel.is_on() || (needs_vnni(kernel) && !has_vnni), "{kernel:?} is left on");
    }
    assert!(OpKernel::F16Attention.differences(1, 1).is_none(), "checked on real models only");
}

/// The drafter's integer products are on exactly where they are built (AVX512-VNNI) and keep the
/// shipped drafter's candidates on SmolLM2's features: at every block size and both cache lengths,
/// 9 of each position's 16 candidates at least are among ggml's 16 (14-16 measured), each first
/// candidate is among ggml's first 8 (first to fourth measured), and at least 6 of 10 positions
/// keep ggml's first (7 of 10 measured: a drafter's later positions hold near ties, which coarser
/// rounding reorders). What that does to acceptance on real text: BENCHMARKS.md (q).
#[test]
fn drafter_rows_keep_the_drafters_candidates() {
    let built = vnni();
    let _one_at_a_time = SWITCHING.lock().unwrap_or_else(|e| e.into_inner());
    dflash2::llama::install_kernels();
    assert_eq!(OpKernel::DrafterRows.is_on(), built, "on exactly where it is built");
    let [integer, ggml] = drafter_lattices(|on| {
        OpKernel::DrafterRows.set(on && built);
    });
    OpKernel::DrafterRows.set(built);
    if OpKernel::DrafterRows.taken() == Some(0) {
        // not built, or ggml's AMX backend holds the drafter's weights: ggml's products both times
        assert_eq!(integer.iter().flatten().map(|l| &l.ids).collect::<Vec<_>>(), ggml.iter().flatten().map(|l| &l.ids).collect::<Vec<_>>());
        return;
    }
    let (mut same, mut positions) = (0, 0);
    for ((ours, ggml), injected) in integer.iter().zip(&ggml).zip([64, 300]) {
        for ((a, g), b) in ours.iter().zip(ggml).zip(BLOCKS) {
            assert_eq!((a.k, a.n_pos), (g.k, g.n_pos));
            for p in 0..a.n_pos {
                let (ours, theirs) = (&a.ids[p * a.k..(p + 1) * a.k], &g.ids[p * g.k..(p + 1) * g.k]);
                let shared = ours.iter().filter(|t| theirs.contains(t)).count();
                let at = format!("{injected} positions, block {b}, position {p}");
                assert!(shared * 16 >= 9 * a.k, "{at}: {shared} of {} candidates shared with ggml's", a.k);
                assert!(theirs[..a.k / 2].contains(&ours[0]), "{at}: first candidate {} not among ggml's first {}", ours[0], a.k / 2);
                same += usize::from(ours[0] == theirs[0]);
                positions += 1;
            }
        }
    }
    assert!(same * 10 >= positions * 6, "first candidates the same at {same} of {positions} positions");
}

/// Only a drafter's weights go through the integer products: with a drafter alive (its weights
/// adopted), both test targets' logits keep ggml's bits with the kernel on, SmolLM2's tied Q8_0 head
/// and Qwen2.5-Coder's Q8_0 head and value projections included.
#[test]
fn drafter_rows_leave_every_target_logit_as_ggml_gives_it() {
    use dflash2::draft::drafter::Drafter;
    use dflash2::llama::{CacheType, Context, ContextParams};
    let built = vnni();
    let drafter = Arc::new(Model::load(&common::shipped_drafter(), &ModelParams::default()).unwrap());
    let smollm2 = Arc::new(Model::load(&common::real_model(common::SMOLLM2), &ModelParams::default()).unwrap());
    let tctx = Context::new(smollm2, &ContextParams { n_ctx: 512, ..ContextParams::default() }, None).unwrap();
    let _alive = Drafter::new(drafter, &tctx, 1, 2, CacheType::Q8_0, CacheType::Q8_0).unwrap();
    rounds_every_logit_as_ggml_does(OpKernel::DrafterRows, built);
}
