// Products of the Q4_0 and IQ4_NL weights ggml repacks for AVX2 CPUs (block_q4_0x8,
// block_iq4_nlx8) with several activation rows.
//
// ggml repacks a Q4_0 (IQ4_NL) weight into runs of 8 columns (the 8 columns' scales, then their
// 4-bit quants interleaved 8 bytes at a time) and multiplies it by one activation row with
// gemv_q4_b32_8x8_q8_0_lut_avx: per 32-wide block and column, the exact integer dot product of the
// weights (a nibble's value from a 16-entry table: Q4_0's signed nibbles, IQ4_NL's non-linear
// values) with the row's q8_0 block, then acc = fma(float(dot), column scale * row scale, acc), the
// blocks in order. Its gemm for four rows at a time rounds the same (the engine's load-time probe
// compares them), but spends some 35 instructions per row, block and 8 columns: a verify of 8 rows
// cost 4 single steps of SmolLM2 Q4_0 on a 2-core EPYC, half of it in that gemm (BENCHMARKS.md (r)).
//
// This kernel gives every output those bits: the same integer dot products (the weights made
// unsigned, w + 8 for Q4_0 and w + 128 for IQ4_NL, by the signed activations, counted from -8 or
// -128 times the activations' sum), the same scale product, the same chain of fused multiply-adds.
// What changes: 16 columns fill a 512-bit register, one vpdpbusd takes 4 weights of each of them,
// and the weights of a block are unpacked once for up to 8 activation rows. It sits in front of
// ggml's traits of the repack buffer's weights (vendor/repacked.h); what the kernel does not take (a
// single row: a plain step keeps ggml's own kernel) goes to ggml's traits. (MXFP4, which ggml
// repacks the same way, is left to ggml: its weights are a mixture of experts', multiplied by
// MUL_MAT_ID, which these kernels do not take.)
//
// Built for AVX-512 CPUs with VNNI in the same `-march=native` build as llama.cpp; elsewhere
// dflash2_set_q4_0x8_rows() and dflash2_set_iq4_nlx8_rows() report that it is not built.

#include "dflash2_shim.h"
#include "repacked.h"

#include <algorithm>
#include <random>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define DFLASH2_Q4_0X8_ROWS 1
#include "ggml-cpu/quants.h"  // quantize_row_q8_0 (ggml's quantizer for the activations)
#define GGML_COMMON_IMPL_CPP
#include "ggml-common.h"  // kvalues_iq4nl
#include <immintrin.h>
#else
#define DFLASH2_Q4_0X8_ROWS 0
#endif

#if DFLASH2_Q4_0X8_ROWS
namespace {

constexpr int QK = 32;
// Activation rows that one pass over a block's weights serves (their accumulators stay in registers).
constexpr int MAX_TILE_ROWS = 8;
// How far ahead of its reads a tile asks for the two runs' blocks (144 bytes, 3 cache lines, each):
// on a 2-core EPYC the hardware prefetcher alone left a verify of 8 rows 4% slower.
constexpr int PREFETCH_BLOCKS = 8;
// The largest work buffer the kernel asks for (a prompt batch is the most); beyond, ggml's own.
constexpr size_t MAX_WORK = size_t(64) << 20;

// The weight types: the repacked block, and a nibble's weight made unsigned, w + offset.
struct q4_0 {
    using block = block_q4_0x8;
    static constexpr ggml_type type = GGML_TYPE_Q4_0;
    static constexpr int offset = 8;
    // the repacked nibbles n are the signed weights' two's complement: n ^ 8 = w + 8
    static __m512i weights(__m512i nibbles) {
        return _mm512_ternarylogic_epi32(nibbles, _mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x08), 0x6A);  // (a & b) ^ c
    }
};

struct iq4_nl {
    using block = block_iq4_nlx8;
    static constexpr ggml_type type = GGML_TYPE_IQ4_NL;
    static constexpr int offset = 128;
    // ggml's table of 16 values (-127..113), each + 128
    static __m512i weights(__m512i nibbles) {
        alignas(16) static const int8_t shifted[16] = {
            (int8_t) (kvalues_iq4nl[0] + 128),  (int8_t) (kvalues_iq4nl[1] + 128),  (int8_t) (kvalues_iq4nl[2] + 128),
            (int8_t) (kvalues_iq4nl[3] + 128),  (int8_t) (kvalues_iq4nl[4] + 128),  (int8_t) (kvalues_iq4nl[5] + 128),
            (int8_t) (kvalues_iq4nl[6] + 128),  (int8_t) (kvalues_iq4nl[7] + 128),  (int8_t) (kvalues_iq4nl[8] + 128),
            (int8_t) (kvalues_iq4nl[9] + 128),  (int8_t) (kvalues_iq4nl[10] + 128), (int8_t) (kvalues_iq4nl[11] + 128),
            (int8_t) (kvalues_iq4nl[12] + 128), (int8_t) (kvalues_iq4nl[13] + 128), (int8_t) (kvalues_iq4nl[14] + 128),
            (int8_t) (kvalues_iq4nl[15] + 128),
        };
        const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *) shifted));
        return _mm512_shuffle_epi8(table, _mm512_and_si512(nibbles, _mm512_set1_epi8(0x0F)));
    }
};

template <class W> std::atomic<bool> enabled{ false };
template <class W> std::atomic<int64_t> fronted{ 0 };  // weights of models it sits in front of, for reports

// A block of an activation row: ggml's q8_0 quants, its scale widened, -offset times the quants' sum.
struct operand {
    int8_t qs[QK];
    int32_t neg_sum;
    float d;
};

inline size_t work_for(int64_t rows, int64_t blocks) { return size_t(rows * blocks) * (sizeof(operand) + sizeof(block_q8_0)); }

// One activation row quantized as ggml quantizes it (quantize_row_q8_0, into `scratch`).
template <class W> void operands(const float * x, int64_t k, block_q8_0 * scratch, operand * out) {
    quantize_row_q8_0(x, scratch, k);
    for (int64_t b = 0; b < k / QK; ++b) {
        int32_t sum = 0;
        for (int i = 0; i < QK; ++i) sum += scratch[b].qs[i];
        std::memcpy(out[b].qs, scratch[b].qs, QK);
        out[b].neg_sum = -W::offset * sum;
        out[b].d = _cvtsh_ss(scratch[b].d);
    }
}

// A 64-byte half of a repacked block's quants as unsigned weights: the low nibbles, then the high
// ones. In dword lane L: 4 weights of column L / 2, from 4 * (L % 2) on (+8 in the second half, +16
// in the high nibbles).
template <class W> inline void unpack(const uint8_t * qs, __m512i & lo, __m512i & hi) {
    const __m512i bytes = _mm512_loadu_si512(qs);
    lo = W::weights(bytes);
    hi = W::weights(_mm512_srli_epi16(bytes, 4));
}

// R activation rows times 16 columns (two runs of 8, `a` and `b`; `b` == `a` for a last run alone,
// whose outputs beyond 8 are dropped), each output as ggml's gemv computes it; out[r] receives row r's.
template <class W, int R>
void tile(int64_t blocks, const typename W::block * a, const typename W::block * b, const operand * const * act, float * const * out, int cols) {
    // a run's lanes hold 4 weights of each column twice over (weights 0-3 in even lanes, 4-7 in
    // odd ones); these gather one of the two from both runs, a lane per column
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t ib = 0; ib < blocks; ++ib) {
        for (int line = 0; line < 3; ++line) {
            _mm_prefetch((const char *) (a + ib + PREFETCH_BLOCKS) + 64 * line, _MM_HINT_T0);
            _mm_prefetch((const char *) (b + ib + PREFETCH_BLOCKS) + 64 * line, _MM_HINT_T0);
        }
        // w[j]: weights 4j to 4j + 3 of the 16 columns, a lane each
        __m512i w[8];
        {
            __m512i a0, a1, a2, a3, b0, b1, b2, b3;  // weights 0-7, 8-15, 16-23, 24-31 of each run
            unpack<W>((const uint8_t *) a[ib].qs, a0, a2);
            unpack<W>((const uint8_t *) a[ib].qs + 64, a1, a3);
            unpack<W>((const uint8_t *) b[ib].qs, b0, b2);
            unpack<W>((const uint8_t *) b[ib].qs + 64, b1, b3);
            const __m512i ra[4] = { a0, a1, a2, a3 }, rb[4] = { b0, b1, b2, b3 };
            for (int j = 0; j < 4; ++j) {
                w[2 * j] = _mm512_permutex2var_epi32(ra[j], even, rb[j]);
                w[2 * j + 1] = _mm512_permutex2var_epi32(ra[j], odd, rb[j]);
            }
        }
        const __m512 scales = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) a[ib].d)), _mm_loadu_si128((const __m128i *) b[ib].d), 1));
        for (int r = 0; r < R; ++r) {
            const operand & o = act[r][ib];
            // the exact dot product of w + offset with the activations, counted from -offset times their sum
            __m512i dots = _mm512_set1_epi32(o.neg_sum);
            for (int j = 0; j < 8; ++j) {
                int32_t x;
                std::memcpy(&x, o.qs + 4 * j, sizeof(x));
                dots = _mm512_dpbusd_epi32(dots, w[j], _mm512_set1_epi32(x));
            }
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(scales, _mm512_set1_ps(o.d)), acc[r]);
        }
    }
    const __mmask16 keep = cols == 16 ? 0xFFFF : 0x00FF;
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out[r], keep, acc[r]);
}

template <class W>
void tile(int R, int64_t blocks, const typename W::block * a, const typename W::block * b, const operand * const * act, float * const * out, int cols) {
    switch (R) {
        case 1: tile<W, 1>(blocks, a, b, act, out, cols); break;
        case 2: tile<W, 2>(blocks, a, b, act, out, cols); break;
        case 3: tile<W, 3>(blocks, a, b, act, out, cols); break;
        case 4: tile<W, 4>(blocks, a, b, act, out, cols); break;
        case 5: tile<W, 5>(blocks, a, b, act, out, cols); break;
        case 6: tile<W, 6>(blocks, a, b, act, out, cols); break;
        case 7: tile<W, 7>(blocks, a, b, act, out, cols); break;
        default: tile<W, 8>(blocks, a, b, act, out, cols); break;
    }
}

template <class W> struct kernel {
    static bool repacked(const ggml_tensor * t) { return t->type == W::type && t->ne[0] % QK == 0 && t->ne[1] % 8 == 0; }

    // 2-D products of 2 or more f32 rows (fewer go to ggml: a plain step keeps its kernel) whose
    // work fits the cap.
    static bool takes(const ggml_tensor * op) {
        const ggml_tensor * x = op->src[0];
        const ggml_tensor * y = op->src[1];
        return enabled<W>.load(std::memory_order_relaxed) && op->op == GGML_OP_MUL_MAT && y->type == GGML_TYPE_F32 &&
               op->type == GGML_TYPE_F32 && y->ne[1] >= 2 && x->ne[2] == 1 && x->ne[3] == 1 && y->ne[2] == 1 && y->ne[3] == 1 &&
               y->nb[0] == sizeof(float) && op->nb[0] == sizeof(float) && work_for(y->ne[1], x->ne[0] / QK) <= MAX_WORK;
    }

    static size_t work_size(const ggml_tensor * op) { return work_for(op->src[1]->ne[1], op->src[0]->ne[0] / QK); }

    static void compute(ggml_compute_params * params, ggml_tensor * op) {
        const ggml_tensor * x = op->src[0];
        const ggml_tensor * y = op->src[1];
        const int64_t k = x->ne[0], blocks = k / QK, runs = x->ne[1] / 8, m = y->ne[1];
        operand * acts = static_cast<operand *>(params->wdata);
        block_q8_0 * quants = reinterpret_cast<block_q8_0 *>(acts + m * blocks);
        for (int64_t i = params->ith; i < m; i += params->nth) {
            operands<W>((const float *) ((const char *) y->data + i * y->nb[1]), k, quants + i * blocks, acts + i * blocks);
        }
        ggml_barrier(params->threadpool);

        // Pairs of 8-column runs split between the threads; each pair meets the rows 8 at a time.
        const auto * w = static_cast<const typename W::block *>(x->data);
        const int64_t pairs = (runs + 1) / 2;
        const int64_t first = pairs * params->ith / params->nth, last = pairs * (params->ith + 1) / params->nth;
        const operand * act[MAX_TILE_ROWS];
        float * out[MAX_TILE_ROWS];
        for (int64_t p = first; p < last; ++p) {
            const int64_t run = 2 * p;
            const bool alone = run + 1 == runs;
            const typename W::block * a = w + run * blocks;
            const typename W::block * b = alone ? a : a + blocks;
            for (int64_t r0 = 0; r0 < m; r0 += MAX_TILE_ROWS) {
                const int R = (int) std::min<int64_t>(MAX_TILE_ROWS, m - r0);
                for (int r = 0; r < R; ++r) {
                    act[r] = acts + (r0 + r) * blocks;
                    out[r] = (float *) ((char *) op->data + (r0 + r) * op->nb[1]) + run * 8;
                }
                tile<W>(R, blocks, a, b, act, out, alone ? 8 : 16);
            }
        }
    }
};

// Random W weights (some at the ends of their range), repacked by ggml, times random activation
// rows (one of them all zeros): 2 to 33 rows, 8 to 136 columns (one run alone, a pair and one
// alone, many pairs), each output against ggml's gemv of its row alone.
template <class W> int64_t differences(std::mt19937 & rng, int n_threads) {
    int64_t differing = 0;
    for (int64_t width : { 32, 576, 1536 })
        for (int64_t n : { 8, 24, 136 })
            for (int64_t m : { 2, 3, 4, 5, 8, 9, 17, 33 }) {
                ggml_init_params meta_init = { ggml_tensor_overhead(), nullptr, true };
                ggml_context * meta = ggml_init(meta_init);
                ggml_init_params init = { size_t(16) << 20, nullptr, false };
                ggml_context * ctx = ggml_init(init);
                if (!meta || !ctx) {
                    return -3;
                }
                std::vector<char> quants(ggml_row_size(W::type, width) * n);
                dflash2::random_weights(rng, W::type, quants.data(), width, n);
                ggml_backend_buffer_t buffer = nullptr;
                ggml_tensor * x = dflash2::repacked_weight(meta, W::type, width, n, quants.data(), buffer);
                if (!x) {
                    return -2;
                }
                dflash2::put_in_front<kernel<W>>(x);
                ggml_tensor * y = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, width, m);
                dflash2::random_rows(rng, y, 0);
                ggml_tensor * batch = ggml_mul_mat(ctx, x, y);
                std::vector<ggml_tensor *> rows;
                for (int64_t i = 0; i < m; ++i) rows.push_back(ggml_mul_mat(ctx, x, ggml_view_2d(ctx, y, width, 1, y->nb[1], i * y->nb[1])));
                const int64_t d = dflash2::differences_by_row(ctx, batch, rows, n_threads, [](bool on) { enabled<W>.store(on); });
                ggml_backend_buffer_free(buffer);
                ggml_free(ctx);
                ggml_free(meta);
                if (d < 0) {
                    return d;
                }
                differing += d;
            }
    return differing;
}

}  // namespace
#endif

DFLASH2_REPACKED_ROWS_ENTRIES(DFLASH2_Q4_0X8_ROWS, q4_0x8, q4_0)
DFLASH2_REPACKED_ROWS_ENTRIES(DFLASH2_Q4_0X8_ROWS, iq4_nlx8, iq4_nl)
